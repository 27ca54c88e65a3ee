//! The agent's `run` loop under API faults, against gpubudget-testkit's in-memory API server: failed and
//! throttled writes, failed eviction requests, watch disconnects and failed re-lists. For each: no early
//! or duplicated eviction, the eviction record not lost, the problem counted in metrics, and recovery
//! without a restart. (Blocked evictions, a broken sampler and a restart in the middle of the grace
//! period are in tests/kube.rs; the sampler's rebuild with backoff in src/gpu/mod.rs.)

use std::time::Duration;

use gpubudget_demo::stack::Stack;
use gpubudget_testkit::{FakeApi, Verb, pass_time};
use serde_json::Value;
use tokio::time::Instant;

const WAIT: Duration = Duration::from_secs(10);
const GI: u64 = 1 << 30;

const PODS: &str = r#"
apiVersion: v1
kind: Pod
metadata: {name: llm-0, namespace: team-a, uid: 11111111-1111-1111-1111-111111111111, labels: {app: llm}}
spec: {nodeName: gpu-node-1, terminationGracePeriodSeconds: 45, containers: [{name: trainer, image: x}]}
status: {phase: Running}
"#;

fn budget(limit: &str, over_limit_seconds: u32) -> String {
    format!(
        "apiVersion: gpubudget.io/v1alpha1\nkind: GpuMemoryBudget\nmetadata: {{name: llm, namespace: team-a}}\n\
         spec: {{selector: {{matchLabels: {{app: llm}}}}, limit: {limit}, overLimitSeconds: {over_limit_seconds}, \
         evictionGracePeriodSeconds: 30}}\n"
    )
}

/// The agent alone (no operator) over `fake`, sampling every 50 ms, with llm-0 holding `bytes`.
fn start(fake: FakeApi, bytes: u64) -> Stack {
    let mut stack = Stack::new(fake);
    stack.set_named_usage(&[("team-a", "llm-0", "trainer", bytes)]);
    stack.start_agent(Duration::from_millis(50));
    stack
}

fn fake_with(budget_yaml: &str) -> FakeApi {
    let fake = FakeApi::new();
    fake.set_graceful_pod_deletion(true);
    fake.apply_yaml(PODS).expect("pods");
    fake.apply_yaml(budget_yaml).expect("budget");
    fake
}

fn annotation(fake: &FakeApi, key: &str) -> Option<String> {
    fake.get("pods", "team-a", "llm-0").and_then(|p| p["metadata"]["annotations"][key].as_str().map(str::to_owned))
}

fn metric(metrics: &str, series: &str) -> f64 {
    metrics.lines().find_map(|l| l.strip_prefix(series).and_then(|v| v.trim().parse().ok())).unwrap_or(0.0)
}

/// A 500, a 409 and a 429 (API priority and fairness) on the record writes, the Evicting record included: the
/// eviction comes no earlier than overLimitSeconds, is requested once, and its record lands by retry
/// while the pod terminates (so the operator counts it). The eviction itself does not wait for its
/// record: with a grace period shorter than the write backoff the count can be lost (docs/security.md).
#[tokio::test(start_paused = true)]
async fn failed_record_writes_are_retried_and_the_eviction_is_neither_early_nor_doubled() {
    let fake = fake_with(&budget("8Gi", 2));
    fake.fail_next(Verb::Patch, "pods", 1, 500);
    fake.fail_next(Verb::Patch, "pods", 1, 409);
    fake.fail_next(Verb::Patch, "pods", 1, 429);
    let started = Instant::now();
    let agent = start(fake, 9 * GI);
    let f = &agent.fake;
    assert!(f.wait_until(WAIT, |f| f.count(Verb::Create, "pods/eviction") == 1).await);
    assert!(started.elapsed() >= Duration::from_secs(2), "evicted after {:?}", started.elapsed());
    assert!(
        // Write retries back off 1, 2, 4 s: the record lands within the pod's 30 s grace period.
        f.wait_until(Duration::from_secs(15), |f| annotation(f, "gpubudget.io/eviction-requested-at").is_some()).await,
        "the eviction record is not lost"
    );
    assert_eq!(annotation(f, "gpubudget.io/state").as_deref(), Some("Evicting"));
    pass_time(Duration::from_millis(600)).await;
    assert_eq!(f.count(Verb::Create, "pods/eviction"), 1, "one request");
    let metrics = agent.agent_metrics();
    assert_eq!(metric(&metrics, r#"gpubudget_api_writes_total{kind="apply",result="error"}"#), 3.0, "{metrics}");
    assert_eq!(metric(&metrics, r#"gpubudget_evictions_total{result="accepted"}"#), 1.0, "{metrics}");
    assert!(agent.agent_health().is_ready(), "{}", agent.agent_health().report());
    agent.stop().await;
}

/// A record write the tenant can break (#11): every write to the pod is refused (422, as for annotations
/// filling the 256 KiB limit, or a webhook rejecting the update). The eviction waits for its `Evicting`
/// record 3 failed attempts only, then goes ahead, with a `GpuMemoryEvictionRecordFailed` event and
/// `gpubudget_evictions_without_record_total`; the record is retried while the pod terminates and, once the
/// API takes it, the operator counts the eviction.
#[tokio::test(start_paused = true)]
async fn a_record_the_tenant_breaks_delays_the_eviction_a_bounded_time_only() {
    let fake = fake_with(&budget("8Gi", 1));
    fake.fail_next(Verb::Patch, "pods", 1_000_000, 422);
    let mut agent = start(fake, 9 * GI);
    agent.start_operator();
    let f = &agent.fake;
    assert!(
        f.wait_until(Duration::from_secs(15), |f| f.count(Verb::Create, "pods/eviction") == 1).await,
        "evicted although its record cannot be written"
    );
    assert!(annotation(f, "gpubudget.io/state").is_none(), "no record landed");
    let events = f.events_for("team-a", "llm-0");
    let failed: Vec<_> = events.iter().filter(|e| e.reason == "GpuMemoryEvictionRecordFailed").collect();
    assert_eq!(failed.len(), 1, "{events:#?}");
    assert!(events.iter().any(|e| e.reason == "EvictingForGpuMemory"), "{events:#?}");
    // The executor counts once the API's answer is back, a moment after the request arrived.
    let counted = |_: &_| metric(&agent.agent_metrics(), r#"gpubudget_evictions_total{result="accepted"}"#) == 1.0;
    assert!(f.wait_until(WAIT, counted).await, "{}", agent.agent_metrics());
    let metrics = agent.agent_metrics();
    assert_eq!(metric(&metrics, "gpubudget_evictions_without_record_total"), 1.0, "{metrics}");
    // The API takes writes again while the pod terminates: the record lands and the eviction is counted.
    f.clear_faults();
    assert!(
        f.wait_until(Duration::from_secs(40), |f| annotation(f, "gpubudget.io/eviction-requested-at").is_some()).await,
        "the record lands while the pod terminates"
    );
    assert!(
        f.wait_until(WAIT, |f| {
            f.typed::<gpubudget_common::GpuMemoryBudget>("team-a", "llm")
                .and_then(|b| b.status)
                .is_some_and(|s| s.evictions == 1)
        })
        .await,
        "the operator counts it"
    );
    assert_eq!(f.count(Verb::Create, "pods/eviction"), 1, "one request");
    agent.stop().await;
}

/// A 500 (or a timeout-like failure) on the eviction request: counted, retried after the backoff, once,
/// and only while the pod is still over its budget.
#[tokio::test(start_paused = true)]
async fn a_failed_eviction_request_is_retried_once_after_the_backoff() {
    let fake = fake_with(&budget("8Gi", 0));
    fake.fail_next(Verb::Create, "pods/eviction", 1, 500);
    let agent = start(fake, 9 * GI);
    let f = &agent.fake;
    assert!(f.wait_until(WAIT, |f| f.count(Verb::Create, "pods/eviction") == 1).await);
    let first = Instant::now();
    assert!(
        f.wait_until(WAIT, |_| metric(&agent.agent_metrics(), r#"gpubudget_evictions_total{result="error"}"#) == 1.0)
            .await
    );
    assert!(f.wait_until(Duration::from_secs(12), |f| f.count(Verb::Create, "pods/eviction") == 2).await);
    assert!(first.elapsed() >= Duration::from_secs(4), "retried after {:?}, before the 5 s backoff", first.elapsed());
    assert!(
        f.wait_until(WAIT, |_| metric(&agent.agent_metrics(), r#"gpubudget_evictions_total{result="accepted"}"#)
            == 1.0)
            .await
    );
    pass_time(Duration::from_millis(500)).await;
    assert_eq!(f.count(Verb::Create, "pods/eviction"), 2, "no request after the accepted one");
    agent.stop().await;
}

/// Watches cut and re-lists failing (500, then 410 Expired): the agent resumes, sees the budget edited
/// while it was disconnected, and acts on it, without a restart; it never evicts on stale data.
#[tokio::test(start_paused = true)]
async fn watch_disconnects_and_failed_relists_recover_without_a_restart() {
    let fake = fake_with(&budget("16Gi", 0));
    let agent = start(fake, 9 * GI);
    let f = &agent.fake;
    assert!(f.wait_until(WAIT, |f| annotation(f, "gpubudget.io/state").as_deref() == Some("Within")).await);
    assert!(f.wait_until(WAIT, |_| agent.agent_health().is_ready()).await);
    f.fail_next(Verb::Watch, "gpumemorybudgets", 2, 500);
    f.fail_next(Verb::List, "gpumemorybudgets", 2, 500);
    f.compact_history();
    f.disconnect_watches();
    // Edited while the agent is cut off: the limit drops under the usage.
    f.modify("gpumemorybudgets", "team-a", "llm", |b| b["spec"]["limit"] = Value::from("8Gi")).expect("budget");
    assert!(
        f.wait_until(Duration::from_secs(20), |f| f.count(Verb::Create, "pods/eviction") == 1).await,
        "the edit is seen after the reconnect and enforced"
    );
    assert_eq!(annotation(f, "gpubudget.io/budget").as_deref(), Some("llm"));
    assert!(f.wait_until(WAIT, |_| agent.agent_health().is_ready()).await, "{}", agent.agent_health().report());
    pass_time(Duration::from_millis(500)).await;
    assert_eq!(f.count(Verb::Create, "pods/eviction"), 1);
    agent.stop().await;
}
