//! The agent's modules follow the data: sample → attribute → decide → act → report. A stage may use the
//! stages before it, never one after it (doc comments may point anywhere). This reads the sources, so a
//! `use` that runs back up the pipeline fails here with the file and line.
//!
//! `decide` is also pure: it never uses the wiring around the stages (`cli`, `cmd`, `pipeline`: flags are
//! turned into `decide::Settings` by `cli`, never the reverse), nor I/O, the clock or logging.

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

/// The modules around the stages that wire them to flags, inputs and executors.
const WIRING: [&str; 3] = ["cli", "cmd", "pipeline"];

/// What pure decisions never touch: I/O, the clock, threads, processes, logging.
const IMPURE: [&str; 11] = [
    "std::fs",
    "std::io",
    "std::net",
    "std::process",
    "std::time",
    "std::thread",
    "tokio",
    "tracing",
    "println!",
    "eprintln!",
    "dbg!",
];

/// `(line number, stage)` of every `crate::<stage>` in code (not in comments) of `text`.
fn uses(text: &str) -> Vec<(usize, &'static str)> {
    mentions(text, &STAGES.map(|stage| format!("crate::{stage}")))
        .into_iter()
        .map(|(line, i)| (line, STAGES[i]))
        .collect()
}

/// `(line number, index in needles)` of every whole-word mention of a needle in code (not in comments) of
/// `text`.
fn mentions(text: &str, needles: &[String]) -> Vec<(usize, usize)> {
    let mut found = Vec::new();
    for (n, line) in text.lines().enumerate() {
        let code = line.split("//").next().unwrap_or_default();
        for (i, needle) in needles.iter().enumerate() {
            let before_ok = |at: usize| !code[..at].ends_with(|c: char| c.is_alphanumeric() || c == '_' || c == ':');
            let hit = code.match_indices(needle.as_str()).any(|(at, _)| {
                before_ok(at) && !code[at + needle.len()..].starts_with(|c: char| c.is_alphanumeric() || c == '_')
            });
            if hit {
                found.push((n + 1, i));
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

/// Every mention of `needles` in the code of `src/decide`, as `file:line: needle`.
fn decide_mentions(needles: &[String]) -> Vec<String> {
    let mut files = Vec::new();
    rust_files(&Path::new(env!("CARGO_MANIFEST_DIR")).join("src/decide"), &mut files);
    assert!(!files.is_empty(), "src/decide has no sources");
    let mut found = Vec::new();
    for file in files {
        let text = std::fs::read_to_string(&file).expect("readable");
        for (line, i) in mentions(&text, needles) {
            found.push(format!("{}:{line}: {}", file.display(), needles[i]));
        }
    }
    found
}

#[test]
fn decide_never_uses_the_wiring() {
    let needles: Vec<String> =
        WIRING.iter().flat_map(|m| [format!("crate::{m}"), format!("gpubudget_agent::{m}")]).collect();
    let found = decide_mentions(&needles);
    assert!(
        found.is_empty(),
        "decide uses the wiring (cli, cmd, pipeline use decide, never the reverse):\n{}",
        found.join("\n")
    );
}

#[test]
fn decide_does_no_io_and_no_logging() {
    let needles: Vec<String> = IMPURE.iter().map(|s| (*s).to_owned()).collect();
    let found = decide_mentions(&needles);
    assert!(found.is_empty(), "decide is pure (no I/O, clock, threads or logging):\n{}", found.join("\n"));
}

#[test]
fn the_wiring_and_impurity_scans_see_what_they_look_for() {
    let wiring: Vec<String> = WIRING.iter().map(|m| format!("crate::{m}")).collect();
    let text = "use crate::cli::PressureArgs;\n// crate::cmd\nlet a = crate::cli_like;\nuse super::crate::pipeline;\n";
    assert_eq!(mentions(text, &wiring), vec![(1, 0)]);
    let impure: Vec<String> = IMPURE.iter().map(|s| (*s).to_owned()).collect();
    let text = "use std::fs::read;\ntracing::info!(x);\nlet b = my_tokio;\nstd::iota();\n";
    assert_eq!(mentions(text, &impure), vec![(1, 0), (2, 7)]);
}

#[test]
fn the_scan_sees_code_and_skips_comments() {
    let text =
        "use crate::act::Counters;\n/// see [`crate::report::metrics`]\nlet x = crate::decide_more; // crate::report\n";
    assert_eq!(uses(text), vec![(1, "act")]);
}
