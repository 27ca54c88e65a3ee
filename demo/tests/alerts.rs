//! The chart's alerts (charts/gpubudget/files/alerts.yaml) use only series the binaries really export: the demo's
//! story runs on the in-process stack (agent and operator registered as `run` registers them), and every
//! `gpubudget_*` name in an alert's expression must be in what their `/metrics` serve.

use std::collections::BTreeSet;
use std::time::Duration;

use gpubudget_demo::scenario::{self, Until};
use gpubudget_demo::stack::{Stack, kubelet_like_api};

const RULES: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../charts/gpubudget/files/alerts.yaml");

/// Names a `/metrics` text exports: every sample's name, and for each declared family the names its type
/// gives its samples (`_total` of a counter; `_bucket`, `_sum`, `_count` of a histogram), so a family
/// without a series yet (no NVML error so far) still counts.
fn exported(text: &str) -> BTreeSet<String> {
    let mut names = BTreeSet::new();
    for line in text.lines() {
        if let Some(decl) = line.strip_prefix("# TYPE ") {
            let mut parts = decl.split_whitespace();
            let (Some(name), Some(kind)) = (parts.next(), parts.next()) else { continue };
            let suffixes: &[&str] = match kind {
                "counter" => &["_total"],
                "histogram" => &["_bucket", "_sum", "_count"],
                _ => &[""],
            };
            names.extend(suffixes.iter().map(|s| format!("{name}{s}")));
        } else if !line.starts_with('#') {
            let end = line.find(['{', ' ']).unwrap_or(line.len());
            names.insert(line[..end].to_owned());
        }
    }
    names
}

/// The `gpubudget_*` names in the alerts' expressions, with the alert using each.
fn used_in_rules() -> Vec<(String, String)> {
    let text = std::fs::read_to_string(RULES).expect("the chart's alerts file");
    let doc: serde_yaml::Value = serde_yaml::from_str(&text).expect("valid YAML");
    let mut used = Vec::new();
    for group in doc["groups"].as_sequence().expect("groups") {
        for rule in group["rules"].as_sequence().expect("rules") {
            let alert = rule["alert"].as_str().expect("every rule is an alert").to_owned();
            let expr = rule["expr"].as_str().expect("expr");
            // Names outside `{…}` are series; inside are label names (`gpubudget_component`, set by the
            // ServiceMonitors).
            let mut depth = 0_i32;
            let mut name = String::new();
            for c in expr.chars().chain(std::iter::once(' ')) {
                if c.is_ascii_alphanumeric() || c == '_' || c == ':' {
                    name.push(c);
                    continue;
                }
                if depth == 0 && name.starts_with("gpubudget_") {
                    used.push((name.clone(), alert.clone()));
                }
                name.clear();
                match c {
                    '{' => depth += 1,
                    '}' => depth -= 1,
                    _ => {}
                }
            }
        }
    }
    used
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_metric_the_alerts_use_is_exported_by_the_agent_or_the_operator() {
    let stack = Stack::new(kubelet_like_api());
    let (outcome, stack) = scenario::run(stack, Until::Evicted, |_| {}).await;
    assert!(outcome.evicted, "the story did not reach its eviction:\n{}", outcome.transcript);
    let (agent, operator) = (stack.agent_metrics(), stack.operator_metrics());
    // Then a second GPU whose sample fails: the NVML error and not-sampled series (a family has no series, and
    // is not in /metrics, until something is counted in it).
    stack.set_gpus(&[(&[], None), (&[], Some("GPU is lost"))]);
    let failing = stack
        .fake
        .wait_until(Duration::from_secs(20), |_| stack.agent_metrics().contains("gpubudget_nvml_errors_total{"))
        .await;
    let agent_failing = stack.agent_metrics();
    stack.stop().await;
    assert!(failing, "no NVML error counted:\n{agent_failing}");
    assert!(agent_failing.contains("gpubudget_gpu_sampled{gpu=\"1\"} 0"), "{agent_failing}");

    let names: BTreeSet<String> =
        [&agent, &agent_failing, &operator].into_iter().flat_map(|text| exported(text)).collect();
    let used = used_in_rules();
    assert!(used.len() >= 14, "the alerts use {} names: {used:?}", used.len());
    let missing: Vec<_> = used.iter().filter(|(name, _)| !names.contains(name)).collect();
    assert!(missing.is_empty(), "not exported by either binary: {missing:?}\nexported: {names:?}");

    // The series new for the alerts carry real values after the story: the GPU's size, the budgets on it,
    // both components ready.
    assert!(agent.contains("gpubudget_gpu_memory_total_bytes{gpu=\"0\"} 85520809984"), "{agent}");
    let budgeted = agent
        .lines()
        .find_map(|l| l.strip_prefix("gpubudget_gpu_budgeted_bytes{gpu=\"0\"} "))
        .and_then(|v| v.parse::<u64>().ok());
    assert!(budgeted.is_some_and(|b| b > 0), "no budget counted on GPU 0:\n{agent}");
    for check in ["gpu", "pods", "budgets"] {
        assert!(agent.contains(&format!("gpubudget_ready{{check=\"{check}\"}} 1")), "{agent}");
    }
    assert!(operator.contains("gpubudget_operator_ready{check=\"pods-synced\"} 1"), "{operator}");
    assert!(operator.contains("gpubudget_operator_leader 1"), "{operator}");
}

#[test]
fn names_are_read_from_samples_and_declared_families() {
    let text = "# TYPE a_errors counter\n# TYPE b_seconds histogram\n# TYPE c gauge\nc{x=\"1\"} 2\nd 1\n# EOF\n";
    let names = exported(text);
    for name in ["a_errors_total", "b_seconds_bucket", "b_seconds_count", "c", "d"] {
        assert!(names.contains(name), "{name} in {names:?}");
    }
    assert!(!names.contains("a_errors"));
}
