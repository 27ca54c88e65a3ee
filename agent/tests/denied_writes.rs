//! Writes the API server refuses for good (issue 43): an agent whose records an admission policy refuses (a
//! second gpubudget release's records policy admits only its own agent) says so on its Node, once per policy
//! per ten minutes, and counts the writes `denied`; against gpubudget-testkit's in-memory API server, whose
//! injected 403 stands for the policy (the classification of the real API server's wording is unit-tested in
//! src/act/denied.rs; the real thing in records_doors_on_a_real_api_server, e2e/tests/apiserver/records_doors.rs).

use std::time::Duration;

use gpubudget_demo::stack::{NODE, Stack};
use gpubudget_testkit::{FakeApi, Verb, pass_time};
use serde_json::Value;

const GI: u64 = 1 << 30;

const PODS: &str = r#"
apiVersion: v1
kind: Pod
metadata: {name: llm-0, namespace: team-a, uid: 11111111-1111-1111-1111-111111111111, labels: {app: llm}}
spec: {nodeName: gpu-node-1, terminationGracePeriodSeconds: 45, containers: [{name: trainer, image: x}]}
status: {phase: Running}
"#;

const BUDGET: &str = "apiVersion: gpubudget.io/v1alpha1\nkind: GpuMemoryBudget\n\
    metadata: {name: llm, namespace: team-a}\nspec: {selector: {matchLabels: {app: llm}}, limit: 8Gi}\n";

fn metric(metrics: &str, series: &str) -> f64 {
    metrics.lines().find_map(|l| l.strip_prefix(series).and_then(|v| v.trim().parse().ok())).unwrap_or(0.0)
}

/// Occurrences: an event repeated within kube's recorder cache (6 minutes of wall-clock time, which a paused
/// tokio clock does not move) is a series count on one object.
fn occurrences(events: &[Value]) -> u64 {
    events.iter().map(|e| e["series"]["count"].as_u64().unwrap_or(1)).sum()
}

fn denied_on_node(fake: &FakeApi) -> Vec<Value> {
    fake.list("events.events.k8s.io", None)
        .into_iter()
        .filter(|e| e["regarding"]["kind"] == "Node" && e["regarding"]["name"] == NODE)
        .filter(|e| e["reason"] == gpubudget_agent::act::denied::REASON)
        .collect()
}

#[tokio::test(start_paused = true)]
async fn refused_record_writes_are_told_on_the_node_once_per_interval_and_counted_denied() {
    let fake = FakeApi::new();
    fake.apply_yaml(PODS).expect("pods");
    fake.apply_yaml(BUDGET).expect("budget");
    // Every record write refused, as a policy refuses it (Forbidden).
    fake.fail_next(Verb::Patch, "pods", 1_000_000, 403);
    let mut stack = Stack::new(fake);
    stack.set_named_usage(&[("team-a", "llm-0", "trainer", 2 * GI)]);
    stack.start_agent(Duration::from_millis(50));
    let f = &stack.fake;
    assert!(f.wait_until(Duration::from_secs(10), |f| !denied_on_node(f).is_empty()).await, "no Node event");
    let told = denied_on_node(f);
    assert_eq!(told.len(), 1, "{told:#?}");
    assert_eq!(told[0]["type"], "Warning");
    let note = told[0]["note"].as_str().unwrap_or_default();
    assert!(note.contains("the record of pod team-a/llm-0") && note.contains("HTTP 403"), "{note}");
    assert!(note.contains("one release per cluster"), "{note}");
    // The record is retried (backoff up to 30 s): a few minutes of refusals, still one event.
    pass_time(Duration::from_secs(180)).await;
    let metrics = stack.agent_metrics();
    let denied = metric(&metrics, r#"gpubudget_api_writes_total{kind="apply",result="denied"}"#);
    assert!(denied >= 3.0, "{metrics}");
    assert_eq!(metric(&metrics, r#"gpubudget_api_writes_total{kind="apply",result="error"}"#), 0.0, "{metrics}");
    assert_eq!(occurrences(&denied_on_node(f)), 1, "told once per interval");
    // Ten minutes on, still refused: told again.
    pass_time(gpubudget_agent::act::denied::NOTICE_INTERVAL).await;
    assert!(f.wait_until(Duration::from_secs(60), |f| occurrences(&denied_on_node(f)) == 2).await, "told again");
    // Taken again: the record lands.
    f.clear_faults();
    assert!(
        f.wait_until(Duration::from_secs(60), |f| {
            f.get("pods", "team-a", "llm-0")
                .is_some_and(|p| p["metadata"]["annotations"]["gpubudget.io/state"].is_string())
        })
        .await,
        "the record lands once the API takes it"
    );
    stack.stop().await;
}
