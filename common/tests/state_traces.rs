//! The state machine driven by YAML traces in tests/traces/: a budget spec, optionally `critical`,
//! and samples `{at, usage, expect}`.

use std::path::Path;

use gpubudget_common::quantity::parse_bytes;
use gpubudget_common::{Budget, BudgetState, GpuMemoryBudgetSpec, Tracker, step};
use serde::Deserialize;

#[derive(Deserialize)]
struct Trace {
    budget: GpuMemoryBudgetSpec,
    #[serde(default)]
    critical: bool,
    samples: Vec<Sample>,
}

#[derive(Deserialize)]
struct Sample {
    at: String,
    usage: String,
    expect: BudgetState,
}

fn millis(text: &str) -> u64 {
    let seconds: f64 = text.strip_suffix('s').and_then(|s| s.parse().ok()).unwrap_or_else(|| panic!("bad time {text}"));
    (seconds * 1000.0).round() as u64
}

#[test]
fn traces_reach_the_expected_states() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/traces");
    let mut files: Vec<_> = std::fs::read_dir(&dir).expect("traces/").map(|e| e.expect("entry").path()).collect();
    files.sort();
    assert!(files.len() >= 6, "{files:?}");
    for file in files {
        let trace: Trace = serde_yaml::from_str(&std::fs::read_to_string(&file).expect("readable"))
            .unwrap_or_else(|e| panic!("{}: {e}", file.display()));
        let budget = Budget::from_spec("ns", "b", &trace.budget).expect("valid budget");
        let thresholds = budget.thresholds(trace.critical);
        let mut tracker = Tracker::default();
        for (i, sample) in trace.samples.iter().enumerate() {
            let usage = parse_bytes(&sample.usage).expect("usage quantity");
            tracker = step(tracker, &thresholds, millis(&sample.at), usage);
            assert_eq!(
                tracker.state,
                sample.expect,
                "{} sample {i} ({} at {})",
                file.display(),
                sample.usage,
                sample.at
            );
        }
    }
}
