//! Namespace totals (`ClusterGpuMemoryQuota`, #23 part 3) end to end against the in-memory API
//! (gpubudget-testkit), on tokio's paused clock: the agents' records simulated by writing pod annotations,
//! the operator's evictions, status and events checked, with one operator and with two during a leader change.

mod harness;

use std::sync::Arc;
use std::time::Duration;

use gpubudget_common::ClusterGpuMemoryQuota;
use gpubudget_common::crd::ClusterGpuMemoryQuotaStatus;
use gpubudget_common::enforcement::Enforcement;
use gpubudget_operator::quota::{self, QuotaSettings};
use gpubudget_testkit::{FakeApi, Verb, pass_time};
use serde_json::{Value, json};
use tokio::task::JoinHandle;

use harness::Operator;

const GI: u64 = 1 << 30;
/// 2026-11-25T00:00:00Z: the wall clock the tests' quota loops start at.
const EPOCH_MS: u64 = 1_795_564_800_000;

fn fake() -> FakeApi {
    let fake = FakeApi::new();
    fake.set_graceful_pod_deletion(true);
    for (ns, tier) in [("team-a", "tenant"), ("team-b", "tenant"), ("kube-system", "system")] {
        fake.put_object(json!({"apiVersion": "v1", "kind": "Namespace",
            "metadata": {"name": ns, "labels": {"tier": tier}}}))
            .expect("namespace stored");
    }
    fake.put_object(json!({
        "apiVersion": "gpubudget.io/v1alpha1",
        "kind": "ClusterGpuMemoryQuota",
        "metadata": {"name": "tenant-totals", "generation": 1},
        "spec": {"namespaceSelector": {"matchLabels": {"tier": "tenant"}}, "limit": "10Gi",
                 "overLimitSeconds": 30, "evictionGracePeriodSeconds": 7},
    }))
    .expect("quota stored");
    fake
}

/// A running pod on `node`, started `started_s` seconds after the hour, with the agent's record.
fn pod(fake: &FakeApi, ns: &str, name: &str, node: &str, started_s: u32, usage: u64, state: &str) {
    fake.put_object(json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": ns, "labels": {"app": "train"},
                     "annotations": {"gpubudget.io/state": state, "gpubudget.io/usage-bytes": usage.to_string(),
                                     "gpubudget.io/budget": "ClusterGpuMemoryBudget/tenants", "gpubudget.io/node": node}},
        "spec": {"nodeName": node, "containers": [{"name": "c", "image": "x"}]},
        "status": {"phase": "Running", "startTime": format!("2026-11-25T00:{:02}:{:02}Z", started_s / 60, started_s % 60)},
    }))
    .expect("pod stored");
}

/// Six 2Gi pods in team-a on three nodes (12Gi, over 10Gi; p5 started last), two in team-b (4Gi), and a big
/// one in kube-system, which the quota does not select.
fn many_small_pods(fake: &FakeApi) {
    for i in 0..6u32 {
        pod(fake, "team-a", &format!("p{i}"), &format!("gpu-{}", i % 3 + 1), 10 + i, 2 * GI, "Within");
    }
    pod(fake, "team-b", "b0", "gpu-1", 1, 2 * GI, "Within");
    pod(fake, "team-b", "b1", "gpu-2", 50, 2 * GI, "Within");
    pod(fake, "kube-system", "sys", "gpu-3", 59, 40 * GI, "Within");
}

/// The quota loop on `op`'s context, with a wall clock that follows tokio's (paused) clock.
fn start_quota(op: &Operator) -> JoinHandle<anyhow::Result<()>> {
    start_quota_as(op, Enforcement::Enforce)
}

/// The same with the operator's `--enforcement`.
fn start_quota_as(op: &Operator, enforcement: Enforcement) -> JoinHandle<anyhow::Result<()>> {
    let start = tokio::time::Instant::now();
    let clock: quota::Clock = Arc::new(move || EPOCH_MS + u64::try_from(start.elapsed().as_millis()).unwrap_or(0));
    let settings = QuotaSettings { clock, enforcement, ..QuotaSettings::default() };
    tokio::spawn(quota::run(op.ctx.clone(), settings, op.shutdown.clone()))
}

fn status(fake: &FakeApi) -> ClusterGpuMemoryQuotaStatus {
    fake.typed::<ClusterGpuMemoryQuota>("", "tenant-totals").and_then(|q| q.status).unwrap_or_default()
}

fn evicted_pods(fake: &FakeApi) -> Vec<String> {
    fake.requests()
        .iter()
        .filter(|r| r.verb == Verb::Create && r.path.ends_with("/eviction"))
        .map(|r| r.path.rsplit('/').nth(1).unwrap_or_default().to_owned())
        .collect()
}

fn quota_events(fake: &FakeApi) -> Vec<(String, String)> {
    fake.list("events.events.k8s.io", None)
        .into_iter()
        .filter(|e| e["regarding"]["kind"] == "ClusterGpuMemoryQuota")
        .map(|e| {
            (e["reason"].as_str().unwrap_or_default().to_owned(), e["note"].as_str().unwrap_or_default().to_owned())
        })
        .collect()
}

async fn until(fake: &FakeApi, within: Duration, what: &str, check: impl FnMut(&FakeApi) -> bool) {
    let ok = fake.wait_until(within, check).await;
    if !ok {
        for r in fake.requests().iter().filter(|r| r.resource.contains("quota") || r.status >= 400) {
            eprintln!("{} {} {} {:?}", r.method, r.path, r.status, r.body);
        }
        eprintln!("{:?}", fake.get("clustergpumemoryquotas", "", "tenant-totals"));
    }
    assert!(ok, "timed out waiting for {what}");
}

fn team(status: &ClusterGpuMemoryQuotaStatus, ns: &str) -> Value {
    let entry = status.namespaces.iter().find(|n| n.namespace == ns);
    serde_json::to_value(entry).unwrap_or_default()
}

#[tokio::test(start_paused = true)]
async fn a_total_reached_by_many_small_pods_on_several_nodes_evicts_the_latest_after_the_period() {
    let fake = fake();
    many_small_pods(&fake);
    let op = Operator::start(&fake, true);
    let quota_task = start_quota(&op);
    let started = tokio::time::Instant::now();
    until(&fake, Duration::from_secs(10), "the totals", |f| status(f).namespaces_over == 1).await;
    let s = status(&fake);
    let a = team(&s, "team-a");
    assert_eq!((a["total"].as_str(), a["limit"].as_str(), a["pods"].as_i64()), (Some("12Gi"), Some("10Gi"), Some(6)));
    assert_eq!(a["topPods"].as_array().map(Vec::len), Some(5), "top holders, at most 5");
    let nodes: std::collections::BTreeSet<&str> =
        a["topPods"].as_array().into_iter().flatten().filter_map(|p| p["node"].as_str()).collect();
    assert_eq!(nodes.len(), 3, "holders on three nodes: {a}");
    assert_eq!(team(&s, "team-b")["total"], "4Gi");
    assert!(s.namespaces.iter().all(|n| n.namespace != "kube-system"), "not selected");
    assert_eq!(s.namespaces_selected, 2);
    assert!(quota_events(&fake).iter().any(|(r, n)| r == "NamespaceGpuMemoryOver" && n.starts_with("team-a:")));

    // Nothing before the 30 s over the limit.
    pass_time(Duration::from_secs(20)).await;
    assert!(evicted_pods(&fake).is_empty(), "evicted before the period: {:?}", evicted_pods(&fake));
    until(&fake, Duration::from_secs(30), "an eviction", |f| !evicted_pods(f).is_empty()).await;
    let after = started.elapsed();
    assert!(after >= Duration::from_secs(30) && after <= Duration::from_secs(42), "evicted after {after:?}");
    assert_eq!(evicted_pods(&fake), ["p5"], "the most recently started pod");
    let body = &fake.evictions()[0];
    assert_eq!(body["deleteOptions"]["gracePeriodSeconds"], 7, "the quota's grace: {body}");
    let pending = team(&status(&fake), "team-a")["pendingEviction"].clone();
    assert_eq!(pending["pod"], "p5");
    let pod_events = fake.events_for("team-a", "p5");
    assert!(
        pod_events.iter().any(|e| e.reason == "NamespaceGpuMemoryEvicting" && e.type_ == "Warning"),
        "{pod_events:?}"
    );
    assert!(quota_events(&fake).iter().any(|(r, _)| r == "NamespaceGpuMemoryEvicting"));

    // p5 terminates (its grace): the others stay, nothing more is asked for while it holds its memory.
    pass_time(Duration::from_secs(30)).await;
    assert_eq!(evicted_pods(&fake), ["p5"]);
    assert!(fake.finish_deletion("team-a", "p5"));
    until(&fake, Duration::from_secs(15), "the eviction counted", |f| status(f).evictions == 1).await;
    let s = status(&fake);
    assert_eq!(team(&s, "team-a")["total"], "10Gi");
    assert_eq!(s.last_eviction.as_ref().map(|e| e.pod.as_str()), Some("p5"));
    pass_time(Duration::from_secs(60)).await;
    assert_eq!(evicted_pods(&fake), ["p5"], "10Gi is not over 10Gi");
    for i in 0..5 {
        assert!(fake.get("pods", "team-a", &format!("p{i}")).is_some());
    }
    op.stop().await;
    quota_task.await.expect("joins").expect("runs cleanly");
}

/// #54: under `--enforcement Observe` (the chart's `agent.enforcement=Observe`) a namespace total evicts nothing: it
/// tells the pod it would evict once, on the pod and the quota, names it in the status, counts it; the quota
/// switched to `enforcement: Enforce` evicts it at the next pass.
#[tokio::test(start_paused = true)]
async fn observing_a_total_tells_the_pod_it_would_evict_and_evicts_nothing_until_the_quota_enforces() {
    let fake = fake();
    many_small_pods(&fake);
    let op = Operator::start(&fake, true);
    let quota_task = start_quota_as(&op, Enforcement::Observe);
    let would = |f: &FakeApi| team(&status(f), "team-a")["wouldEvict"]["pod"].as_str().map(str::to_owned);
    until(&fake, Duration::from_secs(45), "the pod it would evict", |f| would(f).is_some()).await;
    assert_eq!(would(&fake).as_deref(), Some("p5"), "the most recently started");
    pass_time(Duration::from_secs(120)).await;
    assert!(evicted_pods(&fake).is_empty(), "observing, nothing is evicted: {:?}", evicted_pods(&fake));
    let s = status(&fake);
    assert_eq!(team(&s, "team-a")["state"], "Over", "never Evicting while nothing is");
    assert_eq!(team(&s, "team-a").get("pendingEviction"), None);
    assert_eq!(s.conditions.first().map(|c| c.reason.as_str()), Some("Observing"));
    let told: Vec<_> = quota_events(&fake).into_iter().filter(|(r, _)| r == "NamespaceGpuMemoryWouldEvict").collect();
    assert_eq!(told.len(), 1, "once per episode, not every pass: {told:?}");
    assert!(told[0].1.contains("would evict p5") && told[0].1.contains("nothing is evicted"), "{}", told[0].1);
    let on_pod = fake.events_for("team-a", "p5");
    assert!(on_pod.iter().any(|e| e.reason == "NamespaceGpuMemoryWouldEvict" && e.type_ == "Warning"), "{on_pod:?}");
    let metrics = op.ctx.metrics();
    assert_eq!((metrics.quota_would_evict.get(), metrics.quota_eviction_requests.get()), (1, 0));

    // The administrator enforces this quota: evicted at the next pass, the period already banked.
    let mut q = fake.get("clustergpumemoryquotas", "", "tenant-totals").expect("quota");
    q["spec"]["enforcement"] = "Enforce".into();
    fake.put_object(q).expect("quota updated");
    until(&fake, Duration::from_secs(15), "the eviction", |f| !evicted_pods(f).is_empty()).await;
    assert_eq!(evicted_pods(&fake), ["p5"]);
    op.stop().await;
    quota_task.await.expect("joins").expect("runs cleanly");
}

#[tokio::test(start_paused = true)]
async fn a_pod_its_agent_evicts_is_not_evicted_twice_and_a_refused_eviction_is_retried() {
    let fake = fake();
    many_small_pods(&fake);
    // The agent evicts p5 for its own budget: once it is gone team-a holds 10Gi, within its quota.
    pod(&fake, "team-a", "p5", "gpu-3", 15, 2 * GI, "Evicting");
    let op = Operator::start(&fake, true);
    let quota_task = start_quota(&op);
    until(&fake, Duration::from_secs(10), "team-a over", |f| status(f).namespaces_over == 1).await;
    pass_time(Duration::from_secs(60)).await;
    assert!(evicted_pods(&fake).is_empty(), "the agent's eviction is enough: {:?}", evicted_pods(&fake));

    // A later 2Gi pod: even without p5 team-a would hold 12Gi. The newest pod that is not already going goes,
    // never p5; its eviction is refused once (a PodDisruptionBudget) and retried.
    fake.block_evictions(1);
    pod(&fake, "team-a", "p6", "gpu-2", 30, 2 * GI, "Within");
    until(&fake, Duration::from_secs(30), "two eviction requests", |f| evicted_pods(f).len() == 2).await;
    assert_eq!(evicted_pods(&fake), ["p6", "p6"]);
    let events = fake.events_for("team-a", "p6");
    assert!(events.iter().any(|e| e.reason == "NamespaceGpuMemoryEvictionBlocked"), "{events:?}");
    pass_time(Duration::from_secs(30)).await;
    assert_eq!(evicted_pods(&fake), ["p6", "p6"], "accepted: not asked again while it terminates");
    assert!(fake.get("pods", "team-a", "p5").is_some_and(|p| p["metadata"].get("deletionTimestamp").is_none()));
    op.stop().await;
    quota_task.await.expect("joins").expect("runs cleanly");
}

#[tokio::test(start_paused = true)]
async fn two_operators_during_a_leader_change_evict_once_and_keep_the_period() {
    let fake = fake();
    many_small_pods(&fake);
    let a = Operator::start(&fake, true);
    let b = Operator::start(&fake, false);
    let (task_a, task_b) = (start_quota(&a), start_quota(&b));
    let started = tokio::time::Instant::now();
    until(&fake, Duration::from_secs(10), "team-a over", |f| status(f).namespaces_over == 1).await;

    // Mid-period, a loses the lease and b takes over.
    pass_time(Duration::from_secs(15)).await;
    let banked = team(&status(&fake), "team-a")["overMillis"].as_i64().unwrap_or_default();
    assert!(banked >= 10_000, "time over banked in the status at the hand-over: {banked}");
    a.leader.send_replace(false);
    b.leader.send_replace(true);
    until(&fake, Duration::from_secs(40), "an eviction", |f| !evicted_pods(f).is_empty()).await;
    let after = started.elapsed();
    assert!(after <= Duration::from_secs(42), "the period went on across the change: evicted after {after:?}");
    // b's writes carry its own field manager; a wrote nothing after the change.
    let raw = fake.get("clustergpumemoryquotas", "", "tenant-totals").expect("stored");
    let managers: Vec<&str> = raw["metadata"]["managedFields"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|m| m["subresource"] == "status")
        .filter_map(|m| m["manager"].as_str())
        .collect();
    assert_eq!(managers, ["gpubudget-operator/quota"]);

    // Back to a, while p5 terminates: neither asks again.
    pass_time(Duration::from_secs(12)).await;
    b.leader.send_replace(false);
    a.leader.send_replace(true);
    pass_time(Duration::from_secs(40)).await;
    assert_eq!(evicted_pods(&fake), ["p5"], "one eviction across two leaders");
    assert!(fake.finish_deletion("team-a", "p5"));
    until(&fake, Duration::from_secs(15), "counted once", |f| status(f).evictions == 1).await;
    pass_time(Duration::from_secs(30)).await;
    assert_eq!(status(&fake).evictions, 1);
    a.stop().await;
    b.stop().await;
    task_a.await.expect("joins").expect("runs cleanly");
    task_b.await.expect("joins").expect("runs cleanly");
}
