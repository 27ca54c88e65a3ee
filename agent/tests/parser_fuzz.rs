//! The agent's parsers of untrusted input under a million generated inputs each, plus regression corpora
//! (tests/corpus/cgroup.txt, tests/corpus/samples.txt) and hostile files through the real readers.
//!
//! - `/proc/<pid>/cgroup` (`parse_cgroup_file`) and `/proc/<pid>/stat` (`parse_start_time`): written by
//!   the kernel, but named after cgroups and commands that workloads choose, and read through a
//!   `--proc-root` that may be anything;
//! - sample files (`SampleFile::parse`): operator-supplied, replayed by `--sample-file`.
//!
//! The toolchain is stable-only, so coverage-guided fuzzing (cargo-fuzz needs nightly) is replaced by
//! property tests: shaped inputs (the grammar's pieces recombined) and mutations of valid inputs (byte
//! flips, truncations, insertions, splices) rather than only uniform noise, which never gets past the
//! first check. Every input that ever broke an expectation belongs in the corpus.

mod support;

use std::collections::BTreeSet;

use gpubudget_agent::attribute::cgroup::{ContainerRef, parse_cgroup_file};
use gpubudget_agent::attribute::procfs::{Lookup, ProcAttributor, parse_start_time, write_fake_process};
use gpubudget_agent::sample::file::SampleFile;
use proptest::prelude::*;
use proptest::test_runner::{Config, TestRunner};

/// One million per parser, in four tests each so the harness runs them side by side.
const INPUTS_PER_TEST: u32 = 250_000;

fn runner(cases: u32) -> TestRunner {
    TestRunner::new(Config { cases, failure_persistence: None, max_shrink_iters: 2_000, ..Config::default() })
}

/// `\n`, `\t`, `\r`, `\\` and `\xNN` escapes of the corpus files.
fn unescape(text: &str) -> Vec<u8> {
    let bytes = text.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'\\' && i + 1 < bytes.len() {
            match bytes[i + 1] {
                b'n' => out.push(b'\n'),
                b't' => out.push(b'\t'),
                b'r' => out.push(b'\r'),
                b'\\' => out.push(b'\\'),
                b'x' => {
                    let hex = std::str::from_utf8(&bytes[i + 2..i + 4]).expect("hex escape");
                    out.push(u8::from_str_radix(hex, 16).expect("hex escape"));
                    i += 2;
                }
                other => panic!("unknown escape \\{}", other as char),
            }
            i += 2;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    out
}

fn corpus(text: &str) -> impl Iterator<Item = (&str, &str)> {
    text.lines().filter(|l| !l.starts_with('#') && !l.is_empty()).map(|l| {
        let (a, b) = l.split_once('\t').unwrap_or_else(|| panic!("corpus line without a tab: {l:?}"));
        (a, b)
    })
}

/// What the agent does with a cgroup file's bytes: invalid UTF-8 is "no pod".
fn cgroup_of(bytes: &[u8]) -> Option<ContainerRef> {
    std::str::from_utf8(bytes).ok().and_then(parse_cgroup_file)
}

/// What a parsed answer must look like, whatever the input.
fn well_formed(input: &str, found: &ContainerRef) -> Result<(), TestCaseError> {
    let uid = &found.pod_uid;
    let hyphenated = uid.len() == 36
        && uid.char_indices().all(|(i, c)| {
            if matches!(i, 8 | 13 | 18 | 23) { c == '-' } else { c.is_ascii_digit() || ('a'..='f').contains(&c) }
        });
    let hash = uid.len() == 32 && uid.chars().all(|c| c.is_ascii_digit() || ('a'..='f').contains(&c));
    prop_assert!(hyphenated || hash, "pod uid {uid:?} from {input:?}");
    // The UID was in the input (as written: hyphens or underscores, any case).
    let lower = input.to_ascii_lowercase();
    prop_assert!(lower.contains(uid.as_str()) || lower.contains(&uid.replace('-', "_")), "{uid} not in {input:?}");
    if let Some(id) = &found.container_id {
        prop_assert!((12..=128).contains(&id.len()), "container id {id:?}");
        prop_assert!(id.chars().all(|c| c.is_ascii_digit() || ('a'..='f').contains(&c)), "container id {id:?}");
        prop_assert!(lower.contains(id.as_str()), "{id} not in {input:?}");
    }
    Ok(())
}

#[test]
fn cgroup_regression_corpus() {
    let mut checked = 0;
    for (input, want) in corpus(include_str!("corpus/cgroup.txt")) {
        let got = cgroup_of(&unescape(input));
        let got_text = match &got {
            None => "-".to_owned(),
            Some(ContainerRef { pod_uid, container_id: None }) => pod_uid.clone(),
            Some(ContainerRef { pod_uid, container_id: Some(c) }) => format!("{pod_uid} {c}"),
        };
        assert_eq!(got_text, want, "input {input:?}");
        checked += 1;
    }
    assert!(checked >= 30, "{checked}");
}

/// splitmix64: inputs are built from one generated seed, which is much cheaper than composing regex
/// strategies a million times in a debug build; a failure prints the input itself.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        support::splitmix64(&mut self.0)
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
    fn pick<'a>(&mut self, items: &[&'a str]) -> &'a str {
        items[self.below(items.len())]
    }
    fn hex(&mut self, n: usize, upper: bool, out: &mut String) {
        let digits: &[u8] = if upper { b"0123456789ABCDEF" } else { b"0123456789abcdef" };
        for _ in 0..n {
            out.push(digits[self.below(16)] as char);
        }
    }
    /// Arbitrary characters: ASCII, separators, multi-byte, controls.
    fn noise(&mut self, n: usize, out: &mut String) {
        const CHARS: [char; 16] =
            ['a', 'Z', '0', '-', '_', ':', '.', '/', ' ', '\n', '\0', '\r', 'é', '€', '𝄞', '\u{202e}'];
        for _ in 0..n {
            out.push(CHARS[self.below(CHARS.len())]);
        }
    }
    /// A pod UID as cgroups spell it, sometimes a digit short or long, with either separator.
    fn uid(&mut self, out: &mut String) {
        let sep = if self.below(2) == 0 { '-' } else { '_' };
        let upper = self.below(4) == 0;
        for (i, len) in [8usize, 4, 4, 4, 12].into_iter().enumerate() {
            if i > 0 {
                out.push(if self.below(30) == 0 { '-' } else { sep });
            }
            let len = match self.below(20) {
                0 => len - 1,
                1 => len + 1,
                _ => len,
            };
            self.hex(len, upper, out);
        }
    }
}

/// Path segments: the real spellings, near misses, and separators in odd places.
fn cgroup_segment(rng: &mut Rng, out: &mut String) {
    match rng.below(12) {
        0..=2 => {
            out.push_str("pod");
            rng.uid(out);
        }
        3..=5 => {
            let prefix = rng.pick(&["", "kubelet-", "x-", "kube"]);
            out.push_str(prefix);
            out.push_str(rng.pick(&["kubepods-", "kubepods-burstable-", "kubepods-besteffort-", "pods-"]));
            out.push_str("pod");
            rng.uid(out);
            out.push_str(rng.pick(&[".slice", ".slice", ".scope", ""]));
            if rng.below(4) == 0 {
                out.push_str(rng.pick(&[":cri-containerd:", ":", "::", ":crio:"]));
                let n = rng.below(80);
                rng.hex(n, false, out);
            }
        }
        6..=8 => {
            out.push_str(rng.pick(&["cri-containerd-", "crio-", "docker-", "crio-conmon-", "", "x_"]));
            let n = [12, 64, 64, 11, 129, 0][rng.below(6)];
            let upper = rng.below(4) == 0;
            rng.hex(n, upper, out);
            out.push_str(rng.pick(&[".scope", "", ".slice"]));
        }
        9 => {
            out.push_str("pod");
            rng.hex(32, false, out);
        }
        10 => out.push_str(rng.pick(&[
            "kubepods",
            "kubepods.slice",
            "burstable",
            "..",
            ".",
            "init",
            "container",
            "docker",
        ])),
        _ => {
            let n = rng.below(24);
            rng.noise(n, out);
        }
    }
}

fn cgroup_input(seed: u64) -> String {
    let mut rng = Rng(seed);
    let mut out = String::new();
    match rng.below(8) {
        0 => {
            let n = rng.below(200);
            rng.noise(n, &mut out);
        }
        _ => {
            for line in 0..rng.below(4) {
                if line > 0 {
                    out.push('\n');
                }
                out.push_str(rng.pick(&["0", "12", "", "x"]));
                out.push_str(rng.pick(&["::/", ":memory:/", ":cpu,cpuacct:/", ":name=systemd:/", "::", ":::/", ":/"]));
                for i in 0..rng.below(8) {
                    if i > 0 {
                        out.push_str(rng.pick(&["/", "/", "/", "//"]));
                    }
                    cgroup_segment(&mut rng, &mut out);
                }
                out.push_str(rng.pick(&["", "", "/", "\r", "\0", " "]));
            }
        }
    }
    out
}

fn cgroup_fuzz() {
    runner(INPUTS_PER_TEST)
        .run(&any::<u64>().prop_map(cgroup_input), |input| {
            if let Some(found) = parse_cgroup_file(&input) {
                well_formed(&input, &found)?;
            }
            Ok(())
        })
        .expect("the cgroup parser holds");
}

#[test]
fn cgroup_parser_generated_inputs_1_of_4() {
    cgroup_fuzz();
}

#[test]
fn cgroup_parser_generated_inputs_2_of_4() {
    cgroup_fuzz();
}

#[test]
fn cgroup_parser_generated_inputs_3_of_4() {
    cgroup_fuzz();
}

#[test]
fn cgroup_parser_generated_inputs_4_of_4() {
    cgroup_fuzz();
}

/// `/proc/<pid>/stat`: a command name may contain spaces and `)`; the start time is field 22.
#[test]
fn stat_parser_generated_inputs() {
    let strategy = any::<u64>().prop_map(|seed| {
        let mut rng = Rng(seed);
        let mut stat = String::from("4242 (");
        let n = rng.below(16);
        rng.noise(n, &mut stat);
        stat.push_str(rng.pick(&[")", ") ", "))", ") S ", ""]));
        for _ in 0..rng.below(30) {
            stat.push_str(rng.pick(&["1 ", "18446744073709551615 ", "18446744073709551616 ", "-1 ", ") ", " ", "x "]));
        }
        stat
    });
    runner(250_000)
        .run(&strategy, |stat| {
            let parsed = parse_start_time(stat.as_bytes());
            if let Some(t) = parsed {
                // Whatever it returns is field 22 counted after the last ')'.
                let after = &stat[stat.rfind(')').expect("has a )") + 1..];
                let field = after.split_ascii_whitespace().nth(19);
                prop_assert_eq!(field.and_then(|f| f.parse::<u64>().ok()), Some(t));
            }
            Ok(())
        })
        .expect("the stat parser holds");
    // Binary, truncated, and overlong.
    assert_eq!(parse_start_time(b""), None);
    assert_eq!(parse_start_time(b"4242 (x"), None);
    assert_eq!(parse_start_time(b"4242 (x) S\xff 1 2 3"), None);
    assert_eq!(parse_start_time(&vec![b')'; 1 << 20]), None);
}

/// Huge and binary `/proc/<pid>/cgroup` files, read through the attributor from a proc tree: no panic,
/// no pod for garbage, and the valid line still found at the end of a 16 MiB file.
#[test]
fn huge_and_binary_cgroup_files_through_the_attributor() {
    let dir = tempfile::tempdir().expect("tempdir");
    let root = dir.path();
    let uid = "1b2c3d4e-5f60-4a7b-8c9d-0e1f2a3b4c5d";
    let cid = "ab".repeat(32);
    let valid = format!("0::/kubepods/burstable/pod{uid}/{cid}\n");
    let junk_line = format!("0::/{}\n", "x/".repeat(500));
    let huge = junk_line.repeat((16 << 20) / junk_line.len()) + &valid;
    write_fake_process(root, 10, 1, &huge).expect("fixture");
    write_fake_process(root, 11, 1, "").expect("fixture");
    std::fs::write(root.join("11/cgroup"), [0xffu8, 0xfe, 0, 0, b'\n', 0x80].repeat(1 << 16)).expect("binary");
    write_fake_process(root, 12, 1, &format!("{}{valid}", "0::/".repeat(1 << 18))).expect("fixture");
    write_fake_process(root, 13, 1, &"/".repeat(4 << 20)).expect("fixture");
    // A process that exits between the GPU sample and the /proc read.
    let mut attributor = ProcAttributor::new(root);
    attributor.begin_round();
    match attributor.lookup(10, 0) {
        Lookup::Pod(found) => {
            assert_eq!(found.pod_uid, uid);
            assert_eq!(found.container_id.as_deref(), Some(cid.as_str()));
        }
        _ => panic!("the valid line at the end of a huge file is found"),
    }
    assert!(matches!(attributor.lookup(11, 0), Lookup::NoPod), "binary content is no pod");
    assert!(matches!(attributor.lookup(12, 0), Lookup::Pod(_)));
    assert!(matches!(attributor.lookup(13, 0), Lookup::NoPod));
    assert!(matches!(attributor.lookup(99, 0), Lookup::Gone), "no such process");
    attributor.end_round();
}

fn sample_file_of(bytes: &[u8]) -> Result<SampleFile, String> {
    // The sampler reads the file with read_to_string: invalid UTF-8 is an error before parsing.
    let text = std::str::from_utf8(bytes).map_err(|e| e.to_string())?;
    SampleFile::parse(text)
}

fn processes(file: &SampleFile) -> usize {
    file.gpus
        .iter()
        .map(|g| if g.mig.is_empty() { g.processes.len() } else { g.mig.iter().map(|m| m.processes.len()).sum() })
        .sum()
}

#[test]
fn sample_file_regression_corpus() {
    let mut checked = 0;
    for (want, input) in corpus(include_str!("corpus/samples.txt")) {
        let got = sample_file_of(&unescape(input));
        match want.split_once(' ') {
            Some(("ok", n)) => {
                let file = got.unwrap_or_else(|e| panic!("{input:?} should parse: {e}"));
                assert_eq!(processes(&file).to_string(), n, "{input:?}");
            }
            _ => {
                assert_eq!(want, "err");
                assert!(got.is_err(), "{input:?} should be rejected, got {got:?}");
            }
        }
        checked += 1;
    }
    assert!(checked >= 25, "{checked}");
}

/// Nesting far past any parser's recursion limit is an error, not a stack overflow.
#[test]
fn deeply_nested_sample_files_are_errors() {
    for open in ["[", "{\"a\":", "- ", "a: {b: "] {
        let text = open.repeat(20_000);
        assert!(SampleFile::parse(&text).is_err(), "{open}");
    }
    let text = format!("{{\"gpus\": {}{}}}", "[".repeat(20_000), "]".repeat(20_000));
    assert!(SampleFile::parse(&text).is_err());
}

const SEED_SAMPLE: &str = r#"{"version":1,"gpus":[{"index":0,"uuid":"GPU-1","name":"H100","memory_total_bytes":85520809984,"processes":[{"pid":4242,"used_bytes":2787115008},{"pod_uid":"5A1E3C9D-7b2f","container":"t","used_bytes":"9Gi"},{"namespace":"a","pod":"p","used_bytes":1}],"mig":[]},{"index":1,"uuid":"GPU-2","name":"x","memory_total_bytes":1,"processes":[],"mig":[{"index":1,"uuid":"MIG-1","memory_total_bytes":"10Gi","processes":[{"pid":7,"used_bytes":"1.5Gi"}]}]}]}"#;

const SEED_YAML: &str = "version: 1\ngpus:\n- index: 0\n  uuid: GPU-1\n  name: x\n  memory_total_bytes: 1\n  processes:\n  - {pid: 1, used_bytes: 8Gi}\n  - {pod_uid: u, used_bytes: 1}\n";

const TOKENS: [&str; 34] = [
    "{",
    "}",
    "[",
    "]",
    ",",
    ":",
    "\"",
    "null",
    "true",
    "-1",
    "0",
    "1e999",
    "18446744073709551616",
    "\"9Gi\"",
    "\"-1\"",
    "\"version\"",
    "\"gpus\"",
    "\"processes\"",
    "\"mig\"",
    "\"pid\"",
    "\"used_bytes\"",
    "\"pod_uid\"",
    "\"pod\"",
    "\"namespace\"",
    "\"index\"",
    "\\u0000",
    "\\ud800",
    " ",
    "\n",
    "&a",
    "*a",
    "!!binary",
    "---",
    "- ",
];

/// Mutations of valid files (most generated inputs get past the first bytes), token soup, and noise.
fn sample_input(seed: u64) -> Vec<u8> {
    let mut rng = Rng(seed);
    match rng.below(8) {
        0 => (0..rng.below(40)).map(|_| rng.pick(&TOKENS)).collect::<String>().into_bytes(),
        1 => (0..rng.below(200)).map(|_| rng.next() as u8).collect(),
        _ => {
            let mut text = if rng.below(3) == 0 { SEED_YAML } else { SEED_SAMPLE }.as_bytes().to_vec();
            for _ in 0..1 + rng.below(5) {
                let at = rng.below(text.len() + 1);
                match rng.below(4) {
                    0 => text.truncate(at),
                    1 => {
                        let end = (at + rng.below(8)).min(text.len());
                        text.drain(at..end);
                    }
                    2 => {
                        let piece: String = (0..1 + rng.below(3)).map(|_| rng.pick(&TOKENS)).collect();
                        text.splice(at..at, piece.bytes());
                    }
                    _ => {
                        let bit = rng.below(8);
                        if let Some(b) = text.get_mut(at) {
                            *b ^= 1 << bit;
                        }
                    }
                }
            }
            text
        }
    }
}

fn sample_fuzz() {
    runner(INPUTS_PER_TEST)
        .run(&any::<u64>().prop_map(sample_input), |bytes| {
            if let Ok(file) = sample_file_of(&bytes) {
                prop_assert_eq!(file.version, 1);
                let snapshot = file.to_snapshot().map_err(TestCaseError::fail)?;
                prop_assert_eq!(snapshot.processes.len(), processes(&file));
                prop_assert!(snapshot.processes.iter().all(|p| p.gpu < snapshot.gpus.len()));
            }
            Ok(())
        })
        .expect("the sample-file parser holds");
}

#[test]
fn sample_file_generated_inputs_1_of_4() {
    sample_fuzz();
}

#[test]
fn sample_file_generated_inputs_2_of_4() {
    sample_fuzz();
}

#[test]
fn sample_file_generated_inputs_3_of_4() {
    sample_fuzz();
}

#[test]
fn sample_file_generated_inputs_4_of_4() {
    sample_fuzz();
}

/// The mutations reach parsed files and rejections alike (otherwise they test only one path).
#[test]
fn sample_mutations_reach_both_outcomes() {
    let mut outcomes = BTreeSet::new();
    for seed in 0..2_000 {
        outcomes.insert(sample_file_of(&sample_input(seed)).is_ok());
    }
    assert_eq!(outcomes.len(), 2);
}
