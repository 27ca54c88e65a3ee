//! The controller end to end against the in-memory API (gpubudget-testkit): budgets and pods in, the agent's
//! records simulated by writing pod annotations, statuses, conditions, events and requests checked.

mod harness;

use std::time::Duration;

use gpubudget_common::GpuMemoryBudget;
use gpubudget_common::crd::GpuMemoryBudgetStatus;
use gpubudget_daemon::Health;
use gpubudget_operator::controller;
use gpubudget_testkit::{FakeApi, Verb, pass_time, wait_for};
use serde_json::{Value, json};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use harness::{Operator, WAIT};

const GI: u64 = 1 << 30;

fn budget(fake: &FakeApi, name: &str, limit: &str, selector: Value) {
    fake.put_object(json!({
        "apiVersion": "gpubudget.io/v1alpha1",
        "kind": "GpuMemoryBudget",
        "metadata": {"name": name, "namespace": "team-a", "generation": 1},
        "spec": {"selector": selector, "limit": limit, "warnAtPercent": 90, "action": "Evict", "overLimitSeconds": 10},
    }))
    .expect("budget stored");
}

fn pod(fake: &FakeApi, name: &str, app: &str) {
    fake.put_object(json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": "team-a", "labels": {"app": app},
                     "annotations": {"kubectl.kubernetes.io/last-applied-configuration": "{}"}},
        "spec": {"nodeName": "gpu-1", "containers": [{"name": "c", "image": "x"}]},
        "status": {"phase": "Running"},
    }))
    .expect("pod stored");
}

/// What the agent writes on a pod of team-a (its record).
fn record(fake: &FakeApi, name: &str, state: &str, usage: u64, budget: &str, evicted_at: Option<&str>) {
    harness::record(fake, "team-a", name, state, usage, budget, evicted_at);
}

/// The agent's eviction, accepted: the pod terminates (with graceful deletion on, it stays until
/// `finish_deletion`).
async fn evict(fake: &FakeApi, name: &str) {
    let pods: kube::Api<k8s_openapi::api::core::v1::Pod> = kube::Api::namespaced(fake.client(), "team-a");
    pods.evict(name, &kube::api::EvictParams::default()).await.expect("evicted");
}

fn status(fake: &FakeApi, name: &str) -> GpuMemoryBudgetStatus {
    fake.typed::<GpuMemoryBudget>("team-a", name).and_then(|b| b.status).unwrap_or_default()
}

fn condition(s: &GpuMemoryBudgetStatus, type_: &str) -> (String, String, String) {
    s.conditions
        .iter()
        .find(|c| c.type_ == type_)
        .map(|c| (c.status.clone(), c.reason.clone(), c.message.clone()))
        .unwrap_or_default()
}

async fn until(fake: &FakeApi, what: &str, mut check: impl FnMut(&FakeApi) -> bool) {
    assert!(fake.wait_until(WAIT, |f| check(f)).await, "timed out waiting for {what}");
}

fn status_writes(fake: &FakeApi) -> usize {
    fake.count(Verb::Patch, "gpumemorybudgets/status")
}

fn budget_events(fake: &FakeApi, name: &str) -> Vec<(String, String, i64)> {
    fake.list("events.events.k8s.io", Some("team-a"))
        .into_iter()
        .filter(|e| e["regarding"]["kind"] == "GpuMemoryBudget" && e["regarding"]["name"] == name)
        .map(|e| {
            let count = e["series"]["count"].as_i64().unwrap_or(1);
            (
                e["type"].as_str().unwrap_or_default().to_owned(),
                e["reason"].as_str().unwrap_or_default().to_owned(),
                count,
            )
        })
        .collect()
}

/// Two overlapping budgets and three pods.
fn cluster() -> FakeApi {
    let fake = FakeApi::new();
    budget(&fake, "llm", "8Gi", json!({"matchLabels": {"app": "llm"}}));
    budget(&fake, "wide", "16Gi", json!({}));
    pod(&fake, "p1", "llm");
    pod(&fake, "p2", "llm");
    pod(&fake, "w1", "web");
    fake
}

#[tokio::test(start_paused = true)]
async fn status_conditions_and_events_follow_the_agents_records() {
    let fake = cluster();
    let op = Operator::start(&fake, true);
    op.synced().await;
    until(&fake, "matched pods", |f| status(f, "llm").matched_pods == 2 && status(f, "wide").matched_pods == 1).await;

    let llm = status(&fake, "llm");
    assert_eq!(llm.observed_generation, Some(1));
    assert_eq!(condition(&llm, "Ready").0, "True");
    let (overlapping, reason, message) = condition(&llm, "Overlapping");
    assert_eq!((overlapping.as_str(), reason.as_str()), ("True", "SelectorsOverlap"));
    assert!(message.contains("also selected by wide (16Gi)") && message.contains("applies to 2"), "{message}");
    let (_, _, wide_message) = condition(&status(&fake, "wide"), "Overlapping");
    assert!(wide_message.contains("llm to 2"), "{wide_message}");
    // The API server's view, as `kubectl get gmb` prints it.
    let raw = fake.get("gpumemorybudgets", "team-a", "llm").expect("stored");
    assert_eq!(raw["status"]["matchedPods"], 2);
    let managers: Vec<&str> = raw["metadata"]["managedFields"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|m| m["subresource"] == "status")
        .filter_map(|m| m["manager"].as_str())
        .collect();
    assert_eq!(managers, ["gpubudget-operator"]);
    until(&fake, "overlap events", |f| budget_events(f, "llm").iter().any(|e| e.1 == "Overlapping")).await;

    // The agent reports usage.
    record(&fake, "p1", "Over", 9 * GI, "llm", None);
    record(&fake, "p2", "Near", 15 * GI / 2, "llm", None);
    until(&fake, "over and near", |f| {
        let s = status(f, "llm");
        s.pods_over_budget == 1 && s.pods_near_budget == 1
    })
    .await;
    let llm = status(&fake, "llm");
    let top: Vec<(&str, &str, Option<&str>)> =
        llm.top_pods.iter().map(|p| (p.name.as_str(), p.usage.as_str(), p.node.as_deref())).collect();
    assert_eq!(top, [("p1", "9Gi", Some("gpu-1")), ("p2", "7.5Gi", Some("gpu-1"))]);
    assert_eq!(status(&fake, "wide").pods_over_budget, 0);

    // Overlapping was announced once (one event, not one per write).
    let overlap_events = budget_events(&fake, "llm").into_iter().filter(|e| e.1 == "Overlapping").count();
    assert_eq!(overlap_events, 1);
    op.stop().await;
}

#[tokio::test(start_paused = true)]
async fn pods_above_the_request_are_counted_once_the_budget_sets_one() {
    let fake = FakeApi::new();
    budget(&fake, "burst", "16Gi", json!({"matchLabels": {"app": "burst"}}));
    for name in ["b1", "b2", "b3"] {
        pod(&fake, name, "burst");
    }
    let op = Operator::start(&fake, true);
    op.synced().await;
    record(&fake, "b1", "Within", 2 * GI, "burst", None);
    record(&fake, "b2", "Within", 6 * GI, "burst", None);
    record(&fake, "b3", "Near", 15 * GI, "burst", None);
    until(&fake, "near", |f| status(f, "burst").pods_near_budget == 1).await;
    assert_eq!(status(&fake, "burst").pods_above_request, None, "no request: no count");
    let raw = fake.get("gpumemorybudgets", "team-a", "burst").expect("stored");
    assert!(raw["status"].get("podsAboveRequest").is_none(), "{}", raw["status"]);

    // The budget gains a request of 4Gi: b2 (6Gi) and b3 (15Gi) are above it, b1 (2Gi) within.
    fake.modify("gpumemorybudgets", "team-a", "burst", |b| {
        b["spec"]["request"] = "4Gi".into();
        b["metadata"]["generation"] = 2.into();
    })
    .expect("budget exists");
    until(&fake, "above request", |f| status(f, "burst").pods_above_request == Some(2)).await;
    let raw = fake.get("gpumemorybudgets", "team-a", "burst").expect("stored");
    assert_eq!(raw["status"]["podsAboveRequest"], 2);
    let (_, _, ready) = condition(&status(&fake, "burst"), "Ready");
    assert!(ready.starts_with("request 4Gi"), "{ready}");
    // b3 goes back within its request.
    record(&fake, "b3", "Within", 3 * GI, "burst", None);
    until(&fake, "one above", |f| status(f, "burst").pods_above_request == Some(1)).await;
    op.stop().await;
}

#[tokio::test(start_paused = true)]
async fn a_label_change_moves_a_pod_between_budgets() {
    let fake = cluster();
    let op = Operator::start(&fake, true);
    until(&fake, "first statuses", |f| status(f, "llm").matched_pods == 2 && status(f, "wide").matched_pods == 1).await;
    assert!(fake.set_pod_labels("team-a", "p2", [("app", "web")]));
    until(&fake, "p2 moved", |f| status(f, "llm").matched_pods == 1 && status(f, "wide").matched_pods == 2).await;
    // And a pod that goes away.
    assert!(fake.delete_object("pods", "team-a", "w1"));
    until(&fake, "w1 gone", |f| status(f, "wide").matched_pods == 1).await;
    // A pod the agent stopped tracking (the record gone) still counts as matched.
    assert!(fake.set_pod_labels("team-a", "p1", [("app", "batch")]));
    until(&fake, "llm empty", |f| status(f, "llm").matched_pods == 0 && status(f, "wide").matched_pods == 2).await;
    let (overlapping, _, _) = condition(&status(&fake, "llm"), "Overlapping");
    assert_eq!(overlapping, "False");
    op.stop().await;
}

#[tokio::test(start_paused = true)]
async fn evictions_are_counted_once_across_restarts() {
    let fake = cluster();
    fake.set_graceful_pod_deletion(true);
    let op = Operator::start(&fake, true);
    until(&fake, "first statuses", |f| status(f, "llm").matched_pods == 2).await;
    record(&fake, "p1", "Evicting", 9 * GI, "llm", Some("2027-01-15T08:00:00Z"));
    until(&fake, "p1 evicting", |f| status(f, "llm").pods_over_budget == 1).await;
    assert_eq!(status(&fake, "llm").evictions, 0, "requested, not (yet) accepted: the pod runs");
    evict(&fake, "p1").await;
    until(&fake, "one eviction", |f| status(f, "llm").evictions == 1).await;
    let s = status(&fake, "llm");
    let uid = fake.get("pods", "team-a", "p1").expect("p1")["metadata"]["uid"].as_str().map(str::to_owned);
    assert_eq!(s.counted_evictions, Vec::from_iter(uid));
    let last = s.last_eviction.expect("last eviction");
    assert_eq!((last.pod.as_str(), last.usage.as_str(), last.time.as_str()), ("p1", "9Gi", "2027-01-15T08:00:00Z"));
    op.stop().await;

    // A new operator over the same API: the pod still carries its record, the count stays.
    let op = Operator::start(&fake, true);
    op.synced().await;
    record(&fake, "p2", "Near", 7 * GI, "llm", None);
    until(&fake, "the new operator at work", |f| status(f, "llm").pods_near_budget == 1).await;
    assert_eq!(status(&fake, "llm").evictions, 1, "not counted again");
    // The evicted pod goes; another is evicted.
    assert!(fake.delete_object("pods", "team-a", "p1"));
    record(&fake, "p2", "Evicting", 9 * GI, "llm", Some("2027-01-15T09:00:00Z"));
    evict(&fake, "p2").await;
    until(&fake, "two evictions", |f| status(f, "llm").evictions == 2).await;
    op.stop().await;

    let op = Operator::start(&fake, true);
    op.synced().await;
    fake.clear_requests();
    pod(&fake, "p3", "llm");
    until(&fake, "p3 counted", |f| status(f, "llm").matched_pods == 2).await;
    let s = status(&fake, "llm");
    assert_eq!((s.evictions, s.counted_evictions.len()), (2, 2));
    assert_eq!(s.last_eviction.map(|l| l.pod), Some("p2".to_owned()));
    op.stop().await;
}

#[tokio::test(start_paused = true)]
async fn status_is_written_only_when_it_changes() {
    let fake = cluster();
    let op = Operator::start(&fake, true);
    until(&fake, "first statuses", |f| status(f, "llm").matched_pods == 2 && status(f, "wide").matched_pods == 1).await;
    // Let the first writes settle (each budget's own write comes back through the watch).
    pass_time(Duration::from_millis(300)).await;
    let writes = status_writes(&fake);
    assert_eq!(writes, 2, "one write per budget");
    assert_eq!(op.ctx.metrics().status_writes.get(), 2);
    // Once the cache shows them, no copy of the written statuses is kept (whichever came first: the write's
    // answer or its event on the watch).
    assert_eq!(op.ctx.statuses_kept(), 0, "copies of statuses the cache already shows");

    // Pod changes the operator does not keep: another annotation, the pod's status.
    fake.modify("pods", "team-a", "p1", |p| p["metadata"]["annotations"]["example.com/x"] = "1".into());
    fake.modify("pods", "team-a", "p1", |p| p["status"]["podIP"] = "10.0.0.1".into());
    // A change that does reconcile but computes the same status: the same record written again differently.
    record(&fake, "p1", "Within", GI, "llm", None);
    until(&fake, "the record", |f| status(f, "llm").top_pods.len() == 1).await;
    let after_record = status_writes(&fake);
    assert_eq!(after_record, writes + 1);
    fake.modify("pods", "team-a", "p1", |p| p["metadata"]["annotations"]["example.com/x"] = "2".into());
    pass_time(Duration::from_millis(300)).await;
    assert_eq!(status_writes(&fake), after_record, "nothing kept changed");
    // Only the top pods change (a usage within the same state; the cache keeps a digest of them): written.
    record(&fake, "p1", "Within", 2 * GI, "llm", None);
    until(&fake, "the new usage", |f| {
        status(f, "llm").top_pods.first().is_some_and(|t| t.usage_bytes == (2 * GI) as i64)
    })
    .await;
    assert_eq!(status_writes(&fake), after_record + 1);
    pass_time(Duration::from_millis(300)).await;
    assert_eq!(status_writes(&fake), after_record + 1, "written once");
    op.stop().await;

    // A restart over up-to-date statuses writes nothing.
    fake.clear_requests();
    let op = Operator::start(&fake, true);
    op.synced().await;
    pass_time(Duration::from_millis(500)).await;
    assert!(op.ctx.metrics().reconciles.get() >= 2, "every budget was reconciled");
    assert_eq!(status_writes(&fake), 0);
    // Full pod requests (the caps status reads the containers' environment; the parser keeps only that
    // of the spec), of active pods only.
    let pod_requests: Vec<_> = fake.requests().into_iter().filter(|r| r.resource == "pods").collect();
    assert!(!pod_requests.is_empty());
    for r in &pod_requests {
        let accept = r.accept.clone().unwrap_or_default();
        assert!(!accept.contains("as=PartialObjectMetadata"), "{} {}?{} accept {accept}", r.method, r.path, r.query);
        assert!(r.query.contains("fieldSelector=status.phase"), "{} {}?{}", r.method, r.path, r.query);
    }
    op.stop().await;
}

#[tokio::test(start_paused = true)]
async fn every_budget_is_reconciled_again_each_resync_and_nothing_is_written_for_it() {
    let fake = cluster();
    let settings = controller::Settings { resync: Duration::from_millis(400), ..controller::Settings::default() };
    let op = Operator::start_with(&fake, true, settings);
    until(&fake, "first statuses", |f| status(f, "llm").matched_pods == 2 && status(f, "wide").matched_pods == 1).await;
    pass_time(Duration::from_millis(100)).await;
    let (reconciles, writes) = (op.ctx.metrics().reconciles.get(), status_writes(&fake));
    // Nothing changes: the one timer reconciles both budgets again, over and over, and writes nothing.
    assert!(
        fake.wait_until(WAIT, |_| op.ctx.metrics().reconciles.get() >= reconciles + 4).await,
        "no resync: {} reconciles",
        op.ctx.metrics().reconciles.get()
    );
    assert_eq!(status_writes(&fake), writes, "a resync with nothing changed writes nothing");

    // A status someone else overwrote: no event reconciles it (the watch passes on generation changes
    // only), the next resync puts it right.
    fake.modify("gpumemorybudgets", "team-a", "llm", |b| b["status"]["matchedPods"] = 7.into());
    until(&fake, "the status put right", |f| status(f, "llm").matched_pods == 2).await;
    op.stop().await;
}

#[tokio::test(start_paused = true)]
async fn invalid_budgets_are_not_ready_until_fixed() {
    let fake = cluster();
    let op = Operator::start(&fake, true);
    until(&fake, "first statuses", |f| status(f, "llm").matched_pods == 2).await;
    fake.modify("gpumemorybudgets", "team-a", "llm", |b| b["spec"]["warnAtPercent"] = 0.into());
    until(&fake, "not ready", |f| condition(&status(f, "llm"), "Ready").0 == "False").await;
    let s = status(&fake, "llm");
    let (_, reason, message) = condition(&s, "Ready");
    assert_eq!(reason, "InvalidSpec");
    assert!(message.starts_with("spec.warnAtPercent: 0 is not between 1 and 100"), "{message}");
    assert_eq!(s.matched_pods, 0);
    assert_eq!(s.observed_generation, Some(2));
    // p1 and p2 now fall to wide.
    until(&fake, "wide takes over", |f| status(f, "wide").matched_pods == 3).await;
    until(&fake, "invalid event", |f| budget_events(f, "llm").iter().any(|e| e.0 == "Warning" && e.1 == "InvalidSpec"))
        .await;
    // No hot loop: an invalid budget waits for a change.
    let reconciles = op.ctx.metrics().reconciles.get();
    pass_time(Duration::from_millis(300)).await;
    assert!(op.ctx.metrics().reconciles.get() <= reconciles + 1);

    fake.modify("gpumemorybudgets", "team-a", "llm", |b| b["spec"]["warnAtPercent"] = 80.into());
    until(&fake, "ready again", |f| condition(&status(f, "llm"), "Ready").0 == "True").await;
    until(&fake, "valid event", |f| budget_events(f, "llm").iter().any(|e| e.1 == "Valid")).await;
    until(&fake, "llm takes back", |f| status(f, "llm").matched_pods == 2 && status(f, "wide").matched_pods == 1).await;
    op.stop().await;
}

#[tokio::test(start_paused = true)]
async fn only_the_leader_writes() {
    let fake = cluster();
    let op = Operator::start(&fake, false);
    op.synced().await;
    record(&fake, "p1", "Over", 9 * GI, "llm", None);
    pass_time(Duration::from_millis(300)).await;
    assert_eq!(status_writes(&fake), 0, "a follower does not write");
    op.leader.send_replace(true);
    until(&fake, "the new leader's statuses", |f| {
        status(f, "llm").pods_over_budget == 1 && status(f, "wide").matched_pods == 1
    })
    .await;
    op.leader.send_replace(false);
    pass_time(Duration::from_millis(100)).await;
    let writes = status_writes(&fake);
    record(&fake, "p2", "Over", 9 * GI, "llm", None);
    pass_time(Duration::from_millis(300)).await;
    assert_eq!(status_writes(&fake), writes, "deposed: no more writes");
    op.stop().await;
}

#[tokio::test(start_paused = true)]
async fn transient_failures_are_retried() {
    let fake = cluster();
    fake.fail_next(Verb::Patch, "gpumemorybudgets/status", 3, 503);
    let op = Operator::start(&fake, true);
    until(&fake, "statuses despite failures", |f| {
        status(f, "llm").matched_pods == 2 && status(f, "wide").matched_pods == 1
    })
    .await;
    let mut text = String::new();
    let mut registry = prometheus_client::registry::Registry::default();
    registry.register("x", "x", op.ctx.metrics().failures.clone());
    prometheus_client::encoding::text::encode(&mut text, &registry).expect("encodes");
    assert!(text.contains("x_total{error=\"api_unavailable\"} 3"), "{text}");

    // Watches that drop are resumed, and what changed meanwhile is seen.
    fake.disconnect_watches();
    assert!(fake.set_pod_labels("team-a", "p2", [("app", "web")]));
    until(&fake, "after the reconnect", |f| status(f, "llm").matched_pods == 1).await;
    op.stop().await;
}

#[tokio::test(start_paused = true)]
async fn an_eviction_is_counted_even_when_the_pod_is_gone_at_once() {
    let fake = cluster();
    let op = Operator::start(&fake, true);
    until(&fake, "first statuses", |f| status(f, "llm").matched_pods == 2).await;
    // Record and deletion back to back: the reconcile may run after the pod has left the cache.
    record(&fake, "p1", "Evicting", 9 * GI, "llm", Some("2027-01-15T08:00:00Z"));
    assert!(fake.delete_object("pods", "team-a", "p1"));
    until(&fake, "the eviction", |f| status(f, "llm").evictions == 1 && status(f, "llm").matched_pods == 1).await;
    pass_time(Duration::from_millis(200)).await;
    assert_eq!(status(&fake, "llm").evictions, 1);
    op.stop().await;
}

#[tokio::test(start_paused = true)]
async fn the_crd_is_awaited() {
    let fake = FakeApi::new();
    let health = Health::new(&[gpubudget_operator::run::CHECK_CRD]);
    let shutdown = CancellationToken::new();
    let wait = tokio::spawn({
        let (client, health, shutdown) = (fake.client(), health.clone(), shutdown.clone());
        async move { gpubudget_operator::run::wait_for_crd(client, &health, &shutdown).await }
    });
    pass_time(Duration::from_millis(200)).await;
    assert!(!wait.is_finished() && !health.is_ready(), "waits while the CRD is missing");
    let mut crd = serde_json::to_value(<GpuMemoryBudget as kube::CustomResourceExt>::crd()).expect("crd");
    fake.put_object(crd.clone()).expect("stored");
    pass_time(Duration::from_millis(200)).await;
    assert!(!wait.is_finished(), "not established yet");
    crd["status"] = json!({"conditions": [{"type": "Established", "status": "True"}]});
    fake.put_object(crd).expect("stored");
    let established = tokio::time::timeout(WAIT, wait).await.expect("in time").expect("joins").expect("no error");
    assert!(established);
    assert!(health.is_ready());

    // Shut down while waiting: returns false.
    let fake = FakeApi::new();
    shutdown.cancel();
    let waited = gpubudget_operator::run::wait_for_crd(fake.client(), &health, &shutdown).await.expect("no error");
    assert!(!waited);
}

/// On the wall clock, as kube-lease-manager's lease expiry is (see below).
#[tokio::test]
async fn one_replica_leads_and_another_takes_over() {
    use gpubudget_operator::leader::{self, CHECK_LEASE, Election};
    let fake = FakeApi::new();
    let replica = |name: &str| {
        let (tx, rx) = watch::channel(false);
        let health = Health::new(&[CHECK_LEASE]);
        let shutdown = CancellationToken::new();
        let election =
            Election { lease_seconds: 2, grace_seconds: 1, ..Election::new("gpubudget-operator", "gpubudget", name) };
        let task = tokio::spawn(leader::run(fake.client(), election, tx, health.clone(), shutdown.clone()));
        (rx, health, shutdown, task)
    };
    let (a, a_health, a_stop, a_task) = replica("operator-a");
    let (b, b_health, b_stop, b_task) = replica("operator-b");
    // One leads, the other stands by; both are ready.
    assert!(
        wait_for(WAIT, || *a.borrow() ^ *b.borrow() && a_health.is_ready() && b_health.is_ready()).await,
        "no leader and follower: {} {}",
        a_health.report(),
        b_health.report()
    );
    let lease = fake.get("leases", "gpubudget", "gpubudget-operator").expect("lease created");
    let holder = lease["spec"]["holderIdentity"].as_str().unwrap_or_default().to_owned();
    let (leader_stop, leader_task, follower, follower_stop, follower_task) = if *a.borrow() {
        assert_eq!(holder, "operator-a");
        (a_stop, a_task, b, b_stop, b_task)
    } else {
        assert_eq!(holder, "operator-b");
        (b_stop, b_task, a, a_stop, a_task)
    };
    // Both stay what they are over several renewals (one a second with a 2 s lease). A wall-clock wait, and it
    // must be: kube-lease-manager keeps the lease's expiry as wall-clock time (SystemTime), and a follower
    // re-reads the lease only once that passes, so on a paused tokio clock it would never take over, nor be
    // tempted to.
    let lease_writes = || fake.count(Verb::Update, "leases") + fake.count(Verb::Patch, "leases");
    let before = lease_writes();
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert!(!*follower.borrow());
    assert!(lease_writes() >= before + 2, "renewals in 3 s: {}", lease_writes() - before);
    // The leader stops (SIGTERM): it releases the lease, the other takes over within the lease duration.
    leader_stop.cancel();
    tokio::time::timeout(WAIT, leader_task).await.expect("stops").expect("joins").expect("clean");
    let mut follower = follower;
    tokio::time::timeout(WAIT, follower.wait_for(|leading| *leading)).await.expect("takes over").expect("open");
    follower_stop.cancel();
    tokio::time::timeout(WAIT, follower_task).await.expect("stops").expect("joins").expect("clean");
}

/// #34: each budget gets a mirror of its spec, rewritten only when the spec changes (a status write leaves it);
/// a failed mirror write does not hold the status back and is retried with backoff.
#[tokio::test(start_paused = true)]
async fn mirrors_follow_the_spec_not_the_status_and_a_failed_write_is_retried() {
    let fake = cluster();
    fake.fail_next(Verb::Patch, "gpumemorybudgetmirrors", 1, 500);
    let op = Operator::start(&fake, true);
    op.synced().await;
    until(&fake, "statuses", |f| status(f, "llm").matched_pods == 2 && status(f, "wide").matched_pods == 1).await;
    until(&fake, "both mirrors, one after a retry", |f| {
        f.get("gpumemorybudgetmirrors", "team-a", "llm").is_some()
            && f.get("gpumemorybudgetmirrors", "team-a", "wide").is_some()
    })
    .await;
    assert_eq!(fake.count(Verb::Patch, "gpumemorybudgetmirrors"), 3, "two writes and the retried one");
    let mirror = fake.get("gpumemorybudgetmirrors", "team-a", "llm").expect("mirror");
    let budget = fake.get("gpumemorybudgets", "team-a", "llm").expect("budget");
    assert_eq!(mirror["spec"]["budget"], budget["spec"]);
    assert_eq!(mirror["metadata"]["annotations"]["gpubudget.io/budget-generation"], "1");

    // Usage moves: statuses are rewritten, the mirrors are not.
    let writes = status_writes(&fake);
    record(&fake, "p1", "Over", 9 * GI, "llm", None);
    until(&fake, "llm over", |f| status(f, "llm").pods_over_budget == 1).await;
    assert!(status_writes(&fake) > writes);
    assert_eq!(fake.count(Verb::Patch, "gpumemorybudgetmirrors"), 3, "no mirror write for a status");

    // The spec changes: its mirror follows, at the new generation.
    fake.modify("gpumemorybudgets", "team-a", "llm", |b| b["spec"]["limit"] = json!("6Gi"));
    until(&fake, "llm's mirror at 6Gi", |f| {
        f.get("gpumemorybudgetmirrors", "team-a", "llm").is_some_and(|m| {
            m["spec"]["budget"]["limit"] == "6Gi"
                && m["metadata"]["annotations"]["gpubudget.io/budget-generation"] == "2"
        })
    })
    .await;
    op.stop().await;
}
