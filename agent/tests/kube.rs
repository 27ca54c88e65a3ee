//! The agent's `run` loop against gpubudget-testkit's in-memory API server: reflectors, records (SSA),
//! events (events.k8s.io/v1), evictions (policy/v1), readiness and metrics. Usage comes from a sample file
//! that names pods directly, so no GPU and no `/proc` are needed.

use std::time::Duration;

use gpubudget_demo::stack::Stack;
use gpubudget_testkit::{FakeApi, Verb, pass_time, wait_for};
use serde_json::Value;
use tokio::time::Instant;

const NODE: &str = "gpu-node-1";
const WAIT: Duration = Duration::from_secs(10);

const PODS: &str = r#"
apiVersion: v1
kind: Pod
metadata: {name: llm-0, namespace: team-a, uid: 11111111-1111-1111-1111-111111111111, labels: {app: llm}}
spec: {nodeName: gpu-node-1, terminationGracePeriodSeconds: 45, containers: [{name: trainer, image: x}]}
status:
  phase: Running
  containerStatuses: [{name: trainer, containerID: "containerd://aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa", image: x, imageID: x, ready: true, restartCount: 0}]
---
apiVersion: v1
kind: Pod
metadata: {name: audit-0, namespace: team-w, uid: 22222222-2222-2222-2222-222222222222}
spec: {nodeName: gpu-node-1, containers: [{name: main, image: x}]}
---
apiVersion: v1
kind: Pod
metadata: {name: dns-0, namespace: kube-system, uid: 33333333-3333-3333-3333-333333333333}
spec: {nodeName: gpu-node-1, priorityClassName: system-node-critical, priority: 2000001000, containers: [{name: main, image: x}]}
---
apiVersion: v1
kind: Pod
metadata: {name: remote-0, namespace: team-a, uid: 44444444-4444-4444-4444-444444444444, labels: {app: llm}}
spec: {nodeName: gpu-node-2, containers: [{name: main, image: x}]}
---
apiVersion: v1
kind: Pod
metadata: {name: small-0, namespace: team-a, uid: 55555555-5555-5555-5555-555555555555, labels: {app: small}}
spec: {nodeName: gpu-node-1, containers: [{name: main, image: x}]}
"#;

fn budgets(over_limit_seconds: u32) -> String {
    format!(
        r#"
apiVersion: gpubudget.io/v1alpha1
kind: GpuMemoryBudget
metadata: {{name: llm-inference, namespace: team-a}}
spec: {{selector: {{matchLabels: {{app: llm}}}}, limit: 8Gi, warnAtPercent: 90, action: Evict, overLimitSeconds: {over_limit_seconds}, evictionGracePeriodSeconds: 30}}
---
apiVersion: gpubudget.io/v1alpha1
kind: GpuMemoryBudget
metadata: {{name: small, namespace: team-a}}
spec: {{selector: {{matchLabels: {{app: small}}}}, limit: 8Gi, warnAtPercent: 90, action: Evict, overLimitSeconds: 0}}
---
apiVersion: gpubudget.io/v1alpha1
kind: GpuMemoryBudget
metadata: {{name: audit, namespace: team-w}}
spec: {{selector: {{}}, limit: 1Gi, warnAtPercent: 90, action: Warn, overLimitSeconds: 0}}
---
apiVersion: gpubudget.io/v1alpha1
kind: GpuMemoryBudget
metadata: {{name: system, namespace: kube-system}}
spec: {{selector: {{}}, limit: 1Gi, warnAtPercent: 90, action: Evict, overLimitSeconds: 0}}
"#
    )
}

const GI: u64 = 1 << 30;

/// The agent alone (no operator) over `fake`, sampling every 50 ms, with `usage` charged by pod name.
async fn start(fake: FakeApi, usage: &[(&str, &str, &str, u64)]) -> Stack {
    let mut stack = Stack::new(fake);
    stack.set_named_usage(usage);
    stack.start_agent(Duration::from_millis(50));
    stack
}

fn fake_with(budget_yaml: &str) -> FakeApi {
    let fake = FakeApi::new();
    fake.apply_yaml(PODS).expect("pods");
    fake.apply_yaml(budget_yaml).expect("budgets");
    fake
}

fn annotations(fake: &FakeApi, ns: &str, name: &str) -> serde_json::Map<String, Value> {
    fake.get("pods", ns, name).and_then(|p| p["metadata"]["annotations"].as_object().cloned()).unwrap_or_default()
}

/// Writes: everything but reads and watches.
fn writes(fake: &FakeApi) -> Vec<String> {
    fake.requests()
        .into_iter()
        .filter(|r| !matches!(r.verb, Verb::Get | Verb::List | Verb::Watch))
        .map(|r| format!("{} {}", r.method, r.path))
        .collect()
}

#[tokio::test(start_paused = true)]
async fn evicts_once_with_grace_after_recording_and_telling() {
    let fake = fake_with(&budgets(1));
    fake.set_graceful_pod_deletion(true);
    let agent = start(fake, &[("team-a", "llm-0", "trainer", 9 * GI + GI / 5)]).await;
    let f = &agent.fake;
    assert!(f.wait_until(WAIT, |f| !f.evictions().is_empty()).await, "evicted: {:?}", writes(f));
    assert!(agent.agent_health().is_ready(), "{}", agent.agent_health().report());

    // The eviction body carries the budget's grace period and the pod's UID.
    let body = &f.evictions()[0];
    assert_eq!(body["kind"], "Eviction");
    assert_eq!(body["deleteOptions"]["gracePeriodSeconds"], 30, "{body}");
    let pod = f.get("pods", "team-a", "llm-0").expect("terminating, not gone");
    assert_eq!(body["deleteOptions"]["preconditions"]["uid"], pod["metadata"]["uid"], "only the pod measured");
    // The API server applied the grace period (the pod terminates with 30 s, not its own 45 s).
    assert_eq!(pod["metadata"]["deletionGracePeriodSeconds"], 30, "{pod}");

    // The Evicting record went out (same apply as eviction-requested-at) before the eviction request.
    let requests = f.requests();
    let evict_at = requests.iter().position(|r| r.subresource.as_deref() == Some("eviction")).expect("eviction");
    let evicting_apply = requests[..evict_at]
        .iter()
        .rev()
        .find(|r| r.verb == Verb::Patch && r.resource == "pods")
        .expect("an apply before the eviction");
    assert_eq!(evicting_apply.param("fieldManager").as_deref(), Some("gpubudget-agent/gpu-node-1"));
    assert_eq!(evicting_apply.param("force").as_deref(), Some("true"));
    assert_eq!(evicting_apply.content_type.as_deref(), Some("application/apply-patch+yaml"));
    let sent = &evicting_apply.body.as_ref().expect("body")["metadata"]["annotations"];
    assert_eq!(sent["gpubudget.io/state"], "Evicting");
    assert_eq!(sent["gpubudget.io/budget"], "llm-inference");
    assert_eq!(sent["gpubudget.io/node"], NODE);
    assert!(sent["gpubudget.io/eviction-requested-at"].as_str().is_some_and(|t| t.ends_with('Z')), "{sent}");

    // Events: Over, then Evicting, with the numbers and who holds them.
    assert!(f.wait_until(WAIT, |f| f.events_for("team-a", "llm-0").len() >= 2).await);
    let events = f.events_for("team-a", "llm-0");
    let reasons: Vec<&str> = events.iter().map(|e| e.reason.as_str()).collect();
    assert_eq!(reasons, ["GpuMemoryOverBudget", "EvictingForGpuMemory"], "{events:?}");
    let evicting = &events[1];
    assert_eq!((evicting.type_.as_str(), evicting.api_version.as_str()), ("Warning", "events.k8s.io/v1"));
    assert_eq!(
        (evicting.reporting_controller.as_str(), evicting.reporting_instance.as_str()),
        ("gpubudget-agent", NODE)
    );
    // "for 1s", unless the machine is slow enough to delay a 50 ms tick by half a second.
    let (head, tail) = evicting.message.split_once(" for ").expect("for <n>s");
    assert_eq!(head, "using 9.2Gi of 8Gi (budget team-a/llm-inference)");
    assert!(
        tail.ends_with(
            "s; evicting with 30s grace; held by trainer (GPU 0) 9.2Gi; under generation 1 of budget \
             team-a/llm-inference"
        ),
        "{}",
        evicting.message
    );
    assert_eq!(
        events[0].message,
        "using 9.2Gi of 8Gi (budget team-a/llm-inference); evicting if it stays over for 1s; held by trainer (GPU 0) 9.2Gi"
    );

    // Exactly one request, however long the loop keeps running.
    pass_time(Duration::from_millis(800)).await;
    assert_eq!(f.count(Verb::Create, "pods/eviction"), 1);
    let metrics = agent.agent_metrics();
    assert!(metrics.contains(r#"gpubudget_evictions_total{result="accepted"} 1"#), "{metrics}");
    assert!(metrics.contains(r#"gpubudget_api_writes_total{kind="evict",result="ok"} 1"#), "{metrics}");
    agent.stop().await;
}

#[tokio::test(start_paused = true)]
async fn a_blocked_eviction_is_told_and_retried() {
    let fake = fake_with(&budgets(0));
    fake.block_evictions(1);
    let agent = start(fake, &[("team-a", "llm-0", "trainer", 9 * GI)]).await;
    let f = &agent.fake;
    assert!(
        f.wait_until(WAIT, |f| f.events_for("team-a", "llm-0").iter().any(|e| e.reason == "GpuMemoryEvictionBlocked"))
            .await,
        "{:?}",
        f.events_for("team-a", "llm-0")
    );
    let blocked =
        f.events_for("team-a", "llm-0").into_iter().find(|e| e.reason == "GpuMemoryEvictionBlocked").expect("event");
    assert!(blocked.message.starts_with("eviction refused: "), "{}", blocked.message);
    assert!(blocked.message.ends_with("retrying in 5s"), "{}", blocked.message);
    assert_eq!(f.count(Verb::Create, "pods/eviction"), 1, "one in flight, then a wait");
    // The retry comes after the backoff, and succeeds.
    assert!(f.wait_until(Duration::from_secs(12), |f| f.count(Verb::Create, "pods/eviction") == 2).await);
    assert!(f.wait_until(WAIT, |f| f.get("pods", "team-a", "llm-0").is_none()).await, "evicted and deleted");
    // The executor counts once the API's answer is back: the pod can be gone a moment before.
    let accepted = r#"gpubudget_evictions_total{result="accepted"} 1"#;
    assert!(f.wait_until(WAIT, |_| agent.agent_metrics().contains(accepted)).await, "{}", agent.agent_metrics());
    let metrics = agent.agent_metrics();
    assert!(metrics.contains(r#"gpubudget_evictions_total{result="blocked"} 1"#), "{metrics}");
    agent.stop().await;
}

/// A PodDisruptionBudget that never allows the disruption holds the memory for as long as it refuses (#11):
/// unless the budget sets `blockedEvictionTimeoutSeconds`. Here evictions are refused with a 500 (what two
/// PodDisruptionBudgets on one pod get), which is told like a 429; after 2 s of refusals the pod is deleted,
/// with the budget's grace period and its UID as a precondition.
#[tokio::test(start_paused = true)]
async fn evictions_refused_past_the_blocked_timeout_delete_the_pod_with_grace() {
    let budget = budgets(0).replace(
        "overLimitSeconds: 0, evictionGracePeriodSeconds: 30}",
        "overLimitSeconds: 0, evictionGracePeriodSeconds: 30, blockedEvictionTimeoutSeconds: 2}",
    );
    assert!(budget.contains("blockedEvictionTimeoutSeconds: 2"), "{budget}");
    let fake = fake_with(&budget);
    fake.set_graceful_pod_deletion(true);
    fake.fail_next(Verb::Create, "pods/eviction", 1_000, 500);
    let agent = start(fake, &[("team-a", "llm-0", "trainer", 9 * GI)]).await;
    let f = &agent.fake;
    let reasons = |f: &FakeApi| f.events_for("team-a", "llm-0").into_iter().map(|e| e.reason).collect::<Vec<_>>();
    assert!(
        f.wait_until(WAIT, |f| reasons(f).iter().any(|r| r == "GpuMemoryEvictionBlocked")).await,
        "a 500 is told: {:?}",
        reasons(f)
    );
    assert!(f.wait_until(WAIT, |f| f.count(Verb::Delete, "pods") == 1).await, "deleted: {:?}", writes(f));
    let pod = f.get("pods", "team-a", "llm-0").expect("terminating, not gone");
    assert_eq!(pod["metadata"]["deletionGracePeriodSeconds"], 30, "{pod:#}");
    let delete = f.requests().into_iter().find(|r| r.verb == Verb::Delete && r.resource == "pods").expect("delete");
    let body = delete.body.expect("delete options");
    assert_eq!(body["preconditions"]["uid"], pod["metadata"]["uid"], "{body:#}");
    assert!(reasons(f).iter().any(|r| r == "DeletingForGpuMemory"), "{:?}", reasons(f));
    pass_time(Duration::from_millis(500)).await;
    assert_eq!(f.count(Verb::Delete, "pods"), 1, "one delete");
    agent.stop().await;
}

/// Static pods (#11 scenario 7): evicting (or deleting) a mirror pod deletes only the mirror, and the kubelet
/// keeps running the static pod. So they are treated like critical pods: told, never evicted. And every pod
/// write the agent makes (records, evictions) carries the pod's UID as a precondition.
#[tokio::test(start_paused = true)]
async fn static_pods_are_never_evicted_and_every_pod_write_names_the_uid() {
    let fake = fake_with(&budgets(0));
    fake.apply_yaml(
        "apiVersion: v1\nkind: Pod\nmetadata: {name: static-0, namespace: team-a, labels: {app: small}, \
         annotations: {kubernetes.io/config.mirror: 0123456789abcdef0123456789abcdef}}\n\
         spec: {nodeName: gpu-node-1, containers: [{name: main, image: x}]}\n",
    )
    .expect("mirror pod");
    let usage = [("team-a", "static-0", "main", 9 * GI), ("team-a", "small-0", "main", 9 * GI)];
    let agent = start(fake, &usage).await;
    let f = &agent.fake;
    assert!(f.wait_until(WAIT, |f| f.evictions().len() == 1).await, "small-0 is evicted: {:?}", writes(f));
    let over = |f: &FakeApi| f.events_for("team-a", "static-0").into_iter().find(|e| e.reason == "GpuMemoryOverBudget");
    assert!(f.wait_until(WAIT, |f| over(f).is_some()).await, "{:?}", f.events_for("team-a", "static-0"));
    assert!(over(f).expect("event").message.contains("static pod"), "{:?}", over(f));
    pass_time(Duration::from_millis(500)).await;
    assert_eq!(f.evictions().len(), 1, "only small-0: {:?}", f.evictions());
    assert_eq!(f.evictions()[0]["metadata"]["name"], "small-0");
    assert_eq!(
        annotations(f, "team-a", "static-0").get("gpubudget.io/state"),
        Some(&Value::from("Over")),
        "recorded, never Evicting"
    );
    // Every pod write names the pod's UID.
    let uid = |name: &str| f.get("pods", "team-a", name).map(|p| p["metadata"]["uid"].clone());
    let mut checked = 0;
    for r in f
        .requests()
        .into_iter()
        .filter(|r| r.resource == "pods" && !matches!(r.verb, Verb::Get | Verb::List | Verb::Watch))
    {
        let name = r.name.clone().expect("a named pod");
        let body = r.body.expect("a body");
        let named = match r.subresource.as_deref() {
            Some("eviction") => body["deleteOptions"]["preconditions"]["uid"].clone(),
            _ => body["metadata"]["uid"].clone(),
        };
        if let Some(live) = uid(&name) {
            assert_eq!(named, live, "{} {}: {body:#}", r.method, r.path);
        }
        assert!(named.is_string(), "{} {}: {body:#}", r.method, r.path);
        checked += 1;
    }
    assert!(checked >= 4, "{checked} pod writes");
    agent.stop().await;
}

/// Counts that lie (#11): an eviction refused by a PodDisruptionBudget, then the pod back under its limit.
/// No eviction happened, so the record drops `eviction-requested-at`: a later deletion of the pod (a
/// rollout) is not counted by the operator as an eviction.
#[tokio::test(start_paused = true)]
async fn a_refused_eviction_leaves_no_request_time_once_the_pod_is_back_under() {
    let fake = fake_with(&budgets(0));
    fake.block_all_evictions();
    let agent = start(fake, &[("team-a", "llm-0", "trainer", 9 * GI)]).await;
    let f = &agent.fake;
    let requested = |f: &FakeApi| annotations(f, "team-a", "llm-0").contains_key("gpubudget.io/eviction-requested-at");
    assert!(f.wait_until(WAIT, |f| f.count(Verb::Create, "pods/eviction") >= 1).await, "{:?}", writes(f));
    assert!(f.wait_until(WAIT, requested).await, "the request was recorded");
    agent.set_named_usage(&[("team-a", "llm-0", "trainer", 2 * GI)]);
    assert!(
        f.wait_until(WAIT, |f| !requested(f)
            && annotations(f, "team-a", "llm-0").get("gpubudget.io/state") == Some(&Value::from("Within")))
            .await,
        "{:?}",
        annotations(f, "team-a", "llm-0")
    );
    agent.stop().await;
}

/// A budget switched from Warn to Evict while its pod has long been over the limit (#11 scenario 6): the
/// period starts afresh at the edit (`GpuMemoryBudgetChanged`), so the eviction comes a full
/// `overLimitSeconds` after it, not on the next sample.
#[tokio::test(start_paused = true)]
async fn switching_warn_to_evict_starts_the_period_afresh() {
    let warn = budgets(1).replace("action: Evict, overLimitSeconds: 1,", "action: Warn, overLimitSeconds: 1,");
    assert!(warn.contains("action: Warn, overLimitSeconds: 1,"), "{warn}");
    let fake = fake_with(&warn);
    let agent = start(fake, &[("team-a", "llm-0", "trainer", 9 * GI)]).await;
    let f = &agent.fake;
    let state = |f: &FakeApi| annotations(f, "team-a", "llm-0").get("gpubudget.io/state").cloned();
    assert!(f.wait_until(WAIT, |f| state(f) == Some(Value::from("Over"))).await, "{:?}", writes(f));
    // Time passes over the limit under Warn: twice the period.
    pass_time(Duration::from_secs(2)).await;
    let edited = Instant::now();
    f.modify("gpumemorybudgets", "team-a", "llm-inference", |b| b["spec"]["action"] = Value::from("Evict"))
        .expect("budget");
    assert!(f.wait_until(WAIT, |f| !f.evictions().is_empty()).await, "evicted: {:?}", writes(f));
    assert!(edited.elapsed() >= Duration::from_secs(1), "evicted {:?} after the edit", edited.elapsed());
    let events = f.events_for("team-a", "llm-0");
    let changed = events.iter().find(|e| e.reason == "GpuMemoryBudgetChanged").expect("told");
    assert!(changed.message.contains("action Warn → Evict"), "{}", changed.message);
    agent.stop().await;
}

/// The pod's own grace period cannot hold the memory (#11): a pod asking for an hour, under a budget that
/// sets no `evictionGracePeriodSeconds`, is evicted with 30 s.
#[tokio::test(start_paused = true)]
async fn a_pods_own_long_grace_period_is_capped_at_30s() {
    let budget = budgets(0).replace(", evictionGracePeriodSeconds: 30}", "}");
    let fake = fake_with(&budget);
    fake.modify("pods", "team-a", "llm-0", |p| p["spec"]["terminationGracePeriodSeconds"] = Value::from(3600))
        .expect("pod");
    fake.set_graceful_pod_deletion(true);
    let agent = start(fake, &[("team-a", "llm-0", "trainer", 9 * GI)]).await;
    let f = &agent.fake;
    assert!(f.wait_until(WAIT, |f| !f.evictions().is_empty()).await, "evicted: {:?}", writes(f));
    assert_eq!(f.evictions()[0]["deleteOptions"]["gracePeriodSeconds"], 30, "{:#}", f.evictions()[0]);
    let pod = f.get("pods", "team-a", "llm-0").expect("terminating");
    assert_eq!(pod["metadata"]["deletionGracePeriodSeconds"], 30, "{pod:#}");
    agent.stop().await;
}

#[tokio::test(start_paused = true)]
async fn warn_critical_and_other_nodes_pods_are_never_evicted() {
    let fake = fake_with(&budgets(0));
    let usage = [
        ("team-w", "audit-0", "main", 4 * GI),
        ("kube-system", "dns-0", "main", 4 * GI),
        ("team-a", "remote-0", "main", 40 * GI),
    ];
    let agent = start(fake, &usage).await;
    let f = &agent.fake;
    assert!(f.wait_until(WAIT, |f| !f.events_for("team-w", "audit-0").is_empty()).await);
    assert!(f.wait_until(WAIT, |f| !f.events_for("kube-system", "dns-0").is_empty()).await);
    pass_time(Duration::from_millis(1500)).await;
    assert_eq!(f.count(Verb::Create, "pods/eviction"), 0);
    let audit = f.events_for("team-w", "audit-0");
    assert_eq!(audit.len(), 1, "{audit:?}");
    assert!(audit[0].message.contains("action is Warn: not evicted for being over its limit"), "{}", audit[0].message);
    let dns = f.events_for("kube-system", "dns-0");
    assert!(dns[0].message.contains("the pod is critical and is never evicted"), "{}", dns[0].message);
    assert_eq!(annotations(f, "team-w", "audit-0")["gpubudget.io/state"], "Over");
    assert_eq!(annotations(f, "kube-system", "dns-0")["gpubudget.io/state"], "Over");
    // The other node's pod is not in this agent's cache: no record, no event, charged to nobody.
    assert!(annotations(f, "team-a", "remote-0").is_empty());
    assert!(f.events_for("team-a", "remote-0").is_empty());
    let metrics = agent.agent_metrics();
    assert!(metrics.contains(r#"gpubudget_unattributed_bytes{gpu="0"} 42949672960"#), "{metrics}");
    // The pod watch asked for this node's pods only.
    let watch = f.requests().into_iter().find(|r| r.resource == "pods" && r.verb == Verb::Watch).expect("pod watch");
    assert_eq!(watch.param("fieldSelector").as_deref(), Some("spec.nodeName=gpu-node-1"));
    agent.stop().await;
}

#[tokio::test(start_paused = true)]
async fn steady_state_writes_nothing_and_series_follow_the_pods() {
    let fake = fake_with(&budgets(10));
    let agent =
        start(fake, &[("team-a", "small-0", "main", 2 * GI), ("team-a", "llm-0", "trainer", 7_900_000_000)]).await;
    let f = &agent.fake;
    assert!(f.wait_until(WAIT, |f| annotations(f, "team-a", "llm-0").contains_key("gpubudget.io/state")).await);
    assert!(f.wait_until(WAIT, |f| annotations(f, "team-a", "small-0").contains_key("gpubudget.io/state")).await);
    let llm = annotations(f, "team-a", "llm-0");
    assert_eq!(llm["gpubudget.io/state"], "Near");
    assert_eq!(llm["gpubudget.io/usage-bytes"], "7900000000");
    assert_eq!(annotations(f, "team-a", "small-0")["gpubudget.io/state"], "Within");
    assert!(f.wait_until(WAIT, |f| !f.events_for("team-a", "llm-0").is_empty()).await);
    assert_eq!(f.events_for("team-a", "llm-0")[0].reason, "GpuMemoryNearBudget");

    // Steady: two seconds (40 ticks) with usage moving by less than 5 %: not one write.
    pass_time(Duration::from_millis(300)).await;
    f.clear_requests();
    agent.set_named_usage(&[
        ("team-a", "small-0", "main", 2 * GI + GI / 50),
        ("team-a", "llm-0", "trainer", 7_900_000_000),
    ]);
    pass_time(Duration::from_secs(2)).await;
    assert_eq!(writes(f), Vec::<String>::new());

    let metrics = agent.agent_metrics();
    for line in [
        r#"gpubudget_pod_gpu_memory_bytes{namespace="team-a",pod="llm-0",container="trainer",gpu="0"} 7900000000"#,
        r#"gpubudget_pod_budget_bytes{namespace="team-a",pod="llm-0",budget="llm-inference"} 8589934592"#,
        r#"gpubudget_pod_state{namespace="team-a",pod="llm-0",state="Near"} 1"#,
        r#"gpubudget_pod_state{namespace="team-a",pod="llm-0",state="Within"} 0"#,
        // One record per pod with a budget (llm-0, small-0, audit-0, dns-0), then nothing.
        r#"gpubudget_api_writes_total{kind="apply",result="ok"} 4"#,
        r#"gpubudget_api_writes_total{kind="event",result="ok"} 1"#,
    ] {
        assert!(metrics.contains(line), "missing {line} in\n{metrics}");
    }
    // A pod that goes away takes its series with it.
    f.delete_object("pods", "team-a", "llm-0");
    assert!(wait_for(WAIT, || !agent.agent_metrics().contains(r#"pod="llm-0""#)).await, "series removed");
    agent.stop().await;
}

#[tokio::test(start_paused = true)]
async fn back_under_the_budget_is_recorded_and_told() {
    let fake = fake_with(&budgets(30));
    let agent = start(fake, &[("team-a", "llm-0", "trainer", 9 * GI)]).await;
    let f = &agent.fake;
    assert!(
        f.wait_until(WAIT, |f| annotations(f, "team-a", "llm-0")
            .get("gpubudget.io/state")
            .is_some_and(|s| s == "Over"))
            .await
    );
    agent.set_named_usage(&[("team-a", "llm-0", "trainer", 2 * GI)]);
    assert!(
        f.wait_until(WAIT, |f| annotations(f, "team-a", "llm-0")
            .get("gpubudget.io/state")
            .is_some_and(|s| s == "Within"))
            .await
    );
    assert!(f.wait_until(WAIT, |f| f.events_for("team-a", "llm-0").len() == 2).await);
    let events = f.events_for("team-a", "llm-0");
    assert_eq!(events[1].reason, "GpuMemoryWithinBudget");
    assert_eq!(events[1].type_, "Normal");
    assert!(events[1].message.starts_with("back under the limit: using 2Gi of 8Gi"), "{}", events[1].message);
    assert_eq!(f.count(Verb::Create, "pods/eviction"), 0);
    // The budget goes away: the record is removed.
    f.delete_object("gpumemorybudgets.gpubudget.io", "team-a", "llm-inference");
    assert!(
        f.wait_until(WAIT, |f| annotations(f, "team-a", "llm-0").is_empty()).await,
        "{:?}",
        annotations(f, "team-a", "llm-0")
    );
    agent.stop().await;
}

#[tokio::test(start_paused = true)]
async fn not_ready_and_no_decisions_until_the_sampler_works() {
    let fake = fake_with(&budgets(0));
    let agent = start(fake, &[]).await;
    std::fs::write(agent.sample_path(), "{broken").expect("break it");
    let f = &agent.fake;
    // Whatever the first tick saw, the broken file soon makes the sampler fail (counted) and readiness drop.
    // (The gpu check also starts out false, before the first tick: wait for the failure itself.)
    let down = || {
        let report = agent.agent_health().report();
        let failed = agent.agent_metrics().contains(r#"gpubudget_nvml_errors_total{call="read_sample_file"}"#);
        failed && report.contains("gpu not ready") && report.contains("pods ok") && report.contains("budgets ok")
    };
    assert!(wait_for(WAIT, down).await, "caches synced, sample read failed and counted, gpu check down");
    assert!(!agent.agent_health().is_ready());
    assert_eq!(f.count(Verb::Create, "pods/eviction"), 0);
    // Back: ready again, and enforcing.
    agent.set_named_usage(&[("team-a", "llm-0", "trainer", 9 * GI)]);
    assert!(f.wait_until(WAIT, |_| agent.agent_health().is_ready()).await, "{}", agent.agent_health().report());
    assert!(f.wait_until(WAIT, |f| f.count(Verb::Create, "pods/eviction") == 1).await);
    agent.stop().await;
}

#[tokio::test(start_paused = true)]
async fn a_restart_repeats_nothing_and_never_evicts_earlier() {
    let fake = fake_with(&budgets(3));
    let usage = [("team-a", "llm-0", "trainer", 9 * GI)];
    let first = start(fake, &usage).await;
    let over = |f: &FakeApi| annotations(f, "team-a", "llm-0").get("gpubudget.io/state").is_some_and(|s| s == "Over");
    assert!(first.fake.wait_until(WAIT, over).await);
    assert!(first.fake.wait_until(WAIT, |f| f.events_for("team-a", "llm-0").len() == 1).await);
    pass_time(Duration::from_millis(1500)).await;
    let fake = first.stop().await;
    fake.clear_requests();

    // Halfway through overLimitSeconds, a new agent: its timer starts at its own start.
    let restarted = Instant::now();
    let second = start(fake, &usage).await;
    let f = &second.fake;
    assert!(f.wait_until(WAIT, |f| f.count(Verb::Create, "pods/eviction") == 1).await);
    let waited = restarted.elapsed();
    assert!(waited >= Duration::from_secs(3), "evicted {waited:?} after the restart, before overLimitSeconds");
    let reasons: Vec<String> = f.events_for("team-a", "llm-0").into_iter().map(|e| e.reason).collect();
    assert_eq!(reasons, ["GpuMemoryOverBudget", "EvictingForGpuMemory"], "no second OverBudget event");
    // Before the eviction the new agent wrote nothing for llm-0: its record was already right.
    let requests = f.requests();
    let evict_at = requests.iter().position(|r| r.subresource.as_deref() == Some("eviction")).expect("eviction");
    let llm_writes_before: Vec<&str> = requests[..evict_at]
        .iter()
        .filter(|r| r.verb == Verb::Patch && r.name.as_deref() == Some("llm-0"))
        .filter_map(|r| r.body.as_ref()?["metadata"]["annotations"]["gpubudget.io/state"].as_str())
        .collect();
    assert_eq!(llm_writes_before, ["Evicting"]);
    second.stop().await;
}

/// 200 pods of one node writing their first records at once, each request answered after 50 ms: at most
/// `MAX_WRITES_IN_FLIGHT` requests are in flight together (on a real API server each is one HTTP/1.1
/// connection: 1 000 pods opened 1 004 connections before the bound), and every pod still gets its record.
#[tokio::test(start_paused = true)]
async fn api_writes_are_bounded_in_flight_and_every_pod_gets_its_record() {
    use gpubudget_agent::act::kube::MAX_WRITES_IN_FLIGHT;
    const PODS: usize = 200;
    let fake = FakeApi::new();
    let mut yaml = String::from(
        "apiVersion: gpubudget.io/v1alpha1\nkind: GpuMemoryBudget\nmetadata: {name: all, namespace: team-a}\n\
         spec: {selector: {}, limit: 8Gi}\n",
    );
    for i in 0..PODS {
        yaml.push_str(&format!(
            "---\napiVersion: v1\nkind: Pod\nmetadata: {{name: p-{i}, namespace: team-a}}\n\
             spec: {{nodeName: {NODE}, containers: [{{name: main, image: x}}]}}\nstatus: {{phase: Running}}\n"
        ));
    }
    fake.apply_yaml(&yaml).expect("pods and budget");
    fake.set_latency(Duration::from_millis(50));
    fake.reset_max_in_flight();
    let usage: Vec<(String, u64)> = (0..PODS).map(|i| (format!("p-{i}"), GI)).collect();
    let usage: Vec<(&str, &str, &str, u64)> = usage.iter().map(|(p, b)| ("team-a", p.as_str(), "main", *b)).collect();
    let agent = start(fake, &usage).await;
    let f = &agent.fake;
    let recorded = |f: &FakeApi| {
        f.list("pods", Some("team-a"))
            .iter()
            .filter(|p| p["metadata"]["annotations"]["gpubudget.io/state"].is_string())
            .count()
    };
    // 200 writes, 8 at a time, 50 ms each: about 1.3 s.
    assert!(f.wait_until(Duration::from_secs(30), |f| recorded(f) == PODS).await, "{} of {PODS} recorded", recorded(f));
    // The four watches (pods, budgets, cluster budgets, namespaces) are answered at once and stream; the
    // writes are the rest.
    let max = f.max_in_flight();
    assert!(max <= MAX_WRITES_IN_FLIGHT + 4, "{max} requests in flight at once");
    assert!(max >= MAX_WRITES_IN_FLIGHT, "the bound is used: {max}");
    agent.stop().await;
}

fn rebuilds(agent: &Stack) -> u64 {
    let metrics = agent.agent_metrics();
    metrics
        .lines()
        .find_map(|l| l.strip_prefix("gpubudget_pod_table_rebuilds_total "))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or_else(|| panic!("no rebuild counter in\n{metrics}"))
}

/// The operator writes budget statuses all the time; every agent watches every budget. Those writes must not
/// make the agents rebuild their tables, nor budgets or labels of namespaces without pods on the node: only a spec
/// change that moves what is enforced here, a new budget or a deleted one does, and the records follow it.
#[tokio::test(start_paused = true)]
async fn budget_status_writes_do_not_rebuild_the_pod_table_and_spec_changes_do() {
    let fake = fake_with(&budgets(30));
    let agent = start(fake, &[("team-a", "llm-0", "trainer", 7 * GI)]).await;
    let f = &agent.fake;
    let state = |f: &FakeApi| annotations(f, "team-a", "llm-0").get("gpubudget.io/state").cloned();
    assert!(f.wait_until(WAIT, |f| state(f).is_some_and(|s| s == "Within")).await);
    // Every pod's first record is a pod change the table follows: let them land.
    pass_time(Duration::from_millis(500)).await;
    let settled = rebuilds(&agent);
    assert!(settled >= 1, "the first table");

    for n in 0..20 {
        f.modify("gpumemorybudgets", "team-a", "llm-inference", |b| {
            b["status"] = serde_json::json!({"matchedPods": n, "overBudgetPods": 0});
        })
        .expect("budget");
    }
    f.modify("gpumemorybudgets", "team-w", "audit", |b| b["metadata"]["labels"] = serde_json::json!({"a": "b"}))
        .expect("budget");
    // Another team's budgets, in a namespace without pods on this node: nothing here changes.
    f.apply_yaml(
        "apiVersion: gpubudget.io/v1alpha1\nkind: GpuMemoryBudget\nmetadata: {name: elsewhere, namespace: team-z}\n\
         spec: {selector: {}, limit: 1Gi}",
    )
    .expect("budget");
    f.modify("gpumemorybudgets", "team-z", "elsewhere", |b| b["spec"]["limit"] = serde_json::json!("2Gi"));
    f.delete_object("gpumemorybudgets", "team-z", "elsewhere");
    // Namespaces come and go cluster-wide; one without pods here, labelled and deleted, changes nothing here.
    f.apply_yaml("apiVersion: v1\nkind: Namespace\nmetadata: {name: team-y}").expect("namespace");
    f.modify("namespaces", "", "team-y", |ns| ns["metadata"]["labels"] = serde_json::json!({"tier": "tenant"}))
        .expect("namespace");
    f.delete_object("namespaces", "", "team-y");
    pass_time(Duration::from_millis(500)).await;
    assert_eq!(rebuilds(&agent), settled, "status and metadata writes, budgets and namespaces without pods here");

    // 7 GiB of a limit lowered to 7.5 GiB: Near.
    f.modify("gpumemorybudgets", "team-a", "llm-inference", |b| b["spec"]["limit"] = serde_json::json!("7680Mi"))
        .expect("budget");
    assert!(f.wait_until(WAIT, |f| state(f).is_some_and(|s| s == "Near")).await, "the new limit applies");
    // The spec change, and the pod's new record (a pod change) in the same or the next tick.
    pass_time(Duration::from_millis(300)).await;
    let after_spec = rebuilds(&agent);
    assert!(after_spec > settled);
    f.delete_object("gpumemorybudgets", "team-w", "audit");
    assert!(wait_for(WAIT, || rebuilds(&agent) > after_spec).await, "a deleted budget");
    agent.stop().await;
}

/// #54, the user's story on one node: a Node labelled `gpubudget.io/enforcement: Observe` evicts nothing, tells
/// once what it would evict (event, metric, a record that stays `Over`); the budget switched to `Enforce` acts.
#[tokio::test(start_paused = true)]
async fn an_observing_node_tells_what_it_would_evict_and_a_budget_switched_to_enforce_acts() {
    let fake = fake_with(&budgets(1));
    fake.apply_yaml(
        "apiVersion: v1\nkind: Node\nmetadata: {name: gpu-node-1, labels: {gpubudget.io/enforcement: Observe}}\n",
    )
    .expect("node");
    let agent = start(fake, &[("team-a", "llm-0", "trainer", 9 * GI + GI / 5)]).await;
    let f = &agent.fake;
    let told = |f: &FakeApi| f.events_for("team-a", "llm-0").iter().any(|e| e.reason == "GpuMemoryWouldEvict");
    assert!(f.wait_until(WAIT, told).await, "told: {:?}", f.events_for("team-a", "llm-0"));
    // However long it stays over: no request, told once, the record says Over and no eviction time.
    pass_time(Duration::from_secs(3)).await;
    assert_eq!(f.count(Verb::Create, "pods/eviction"), 0, "{:?}", writes(f));
    assert!(f.evictions().is_empty());
    let events = f.events_for("team-a", "llm-0");
    let would: Vec<_> = events.iter().filter(|e| e.reason == "GpuMemoryWouldEvict").collect();
    assert_eq!(would.len(), 1, "{events:?}");
    assert_eq!(would[0].type_, "Normal");
    assert!(
        would[0].message.starts_with(
            "would be evicted (observe mode: the Node's label gpubudget.io/enforcement; nothing is evicted): using \
             9.2Gi of 8Gi (budget team-a/llm-inference) for "
        ),
        "{}",
        would[0].message
    );
    assert!(!events.iter().any(|e| e.reason == "EvictingForGpuMemory"), "{events:?}");
    let record = annotations(f, "team-a", "llm-0");
    assert_eq!(record.get("gpubudget.io/state").and_then(Value::as_str), Some("Over"), "{record:?}");
    assert!(!record.contains_key("gpubudget.io/eviction-requested-at"), "{record:?}");
    let metrics = agent.agent_metrics();
    assert!(metrics.contains(r#"gpubudget_would_evict_total{cause="budget",set_by="node"} 1"#), "{metrics}");
    assert!(!metrics.contains("gpubudget_evictions_total{"), "{metrics}");

    // The budget is switched to Enforce: it acts, once its period (started afresh) has run.
    f.apply_yaml(
        "apiVersion: gpubudget.io/v1alpha1\nkind: GpuMemoryBudget\nmetadata: {name: llm-inference, namespace: team-a}\n\
         spec: {selector: {matchLabels: {app: llm}}, limit: 8Gi, warnAtPercent: 90, action: Evict, overLimitSeconds: 1, \
         evictionGracePeriodSeconds: 30, enforcement: Enforce}\n",
    )
    .expect("budget");
    assert!(f.wait_until(WAIT, |f| !f.evictions().is_empty()).await, "evicted: {:?}", writes(f));
    let reasons: Vec<String> = f.events_for("team-a", "llm-0").into_iter().map(|e| e.reason).collect();
    assert!(
        reasons.ends_with(&["GpuMemoryBudgetChanged".to_owned(), "EvictingForGpuMemory".to_owned()]),
        "{reasons:?}"
    );
    agent.stop().await;
}
