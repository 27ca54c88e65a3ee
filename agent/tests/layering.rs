//! The agent's modules follow the data: sample → attribute → decide → act → report. A stage may use the
//! stages before it, never one after it (doc comments may point anywhere). This reads the sources, so a
//! `use` that runs back up the pipeline fails here with the file and line.

use std::path::Path;

const STAGES: [&str; 5] = ["sample", "attribute", "decide", "act", "report"];

fn rust_files(dir: &Path, out: &mut Vec<std::path::PathBuf>) {
    for entry in std::fs::read_dir(dir).expect("readable source dir") {
        let path = entry.expect("entry").path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// `(line number, stage)` of every `crate::<stage>` in code (not in comments) of `text`.
fn uses(text: &str) -> Vec<(usize, &'static str)> {
    let mut found = Vec::new();
    for (n, line) in text.lines().enumerate() {
        let code = line.split("//").next().unwrap_or_default();
        for stage in STAGES {
            let needle = format!("crate::{stage}");
            let hit = code
                .match_indices(&needle)
                .any(|(at, _)| !code[at + needle.len()..].starts_with(|c: char| c.is_alphanumeric() || c == '_'));
            if hit {
                found.push((n + 1, stage));
            }
        }
    }
    found
}

#[test]
fn no_stage_uses_a_later_one() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut violations = Vec::new();
    let mut checked = 0;
    for (rank, stage) in STAGES.iter().enumerate() {
        let mut files = Vec::new();
        rust_files(&src.join(stage), &mut files);
        assert!(!files.is_empty(), "src/{stage} has no sources");
        for file in files {
            let text = std::fs::read_to_string(&file).expect("readable");
            for (line, used) in uses(&text) {
                checked += 1;
                let used_rank = STAGES.iter().position(|s| *s == used).expect("a stage");
                if used_rank > rank {
                    violations.push(format!("{}:{line}: {stage} uses {used}", file.display()));
                }
            }
        }
    }
    assert!(checked > 0, "no cross-module use found at all: is the scan broken?");
    assert!(violations.is_empty(), "imports that run back up the pipeline:\n{}", violations.join("\n"));
}

#[test]
fn the_scan_sees_code_and_skips_comments() {
    let text =
        "use crate::act::Counters;\n/// see [`crate::report::metrics`]\nlet x = crate::decide_more; // crate::report\n";
    assert_eq!(uses(text), vec![(1, "act")]);
}
