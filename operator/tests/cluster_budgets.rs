//! #23: `ClusterGpuMemoryBudget` status end to end against the in-memory API (gpubudget-testkit, not a
//! cluster): a cluster budget and namespaced budgets in two namespaces, pods with the agent's records →
//! the status `kubectl get cgmb` prints (MATCHED, OVER, EVICTED read `status.matchedPods`,
//! `status.podsOverBudget`, `status.evictions`), overlaps, and a namespace relabelled in and out.

mod harness;

use gpubudget_common::crd::GpuMemoryBudgetStatus;
use gpubudget_common::{ClusterGpuMemoryBudget, GpuMemoryBudget};
use gpubudget_testkit::{FakeApi, Verb};
use kube::CustomResourceExt;
use serde_json::{Value, json};

use harness::{Operator, WAIT, record};

const GI: u64 = 1 << 30;

fn namespace(fake: &FakeApi, name: &str, labels: Value) {
    fake.put_object(json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name, "labels": labels}}))
        .expect("namespace stored");
}

fn budget(fake: &FakeApi, namespace: &str, name: &str, limit: &str, selector: Value) {
    fake.put_object(json!({
        "apiVersion": "gpubudget.io/v1alpha1", "kind": "GpuMemoryBudget",
        "metadata": {"name": name, "namespace": namespace, "generation": 1},
        "spec": {"selector": selector, "limit": limit},
    }))
    .expect("budget stored");
}

fn pod(fake: &FakeApi, namespace: &str, name: &str, app: &str) {
    fake.put_object(json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": namespace, "labels": {"app": app}},
        "spec": {"nodeName": "gpu-1", "containers": [{"name": "c", "image": "x"}]},
        "status": {"phase": "Running"},
    }))
    .expect("pod stored");
}

fn cluster_status(fake: &FakeApi) -> GpuMemoryBudgetStatus {
    fake.typed::<ClusterGpuMemoryBudget>("", "tenants").and_then(|b| b.status).unwrap_or_default()
}

fn status(fake: &FakeApi, namespace: &str, name: &str) -> GpuMemoryBudgetStatus {
    fake.typed::<GpuMemoryBudget>(namespace, name).and_then(|b| b.status).unwrap_or_default()
}

fn overlapping(s: &GpuMemoryBudgetStatus) -> (String, String) {
    s.conditions
        .iter()
        .find(|c| c.type_ == "Overlapping")
        .map(|c| (c.status.clone(), c.message.clone()))
        .unwrap_or_default()
}

fn top(s: &GpuMemoryBudgetStatus) -> Vec<&str> {
    s.top_pods.iter().map(|p| p.name.as_str()).collect()
}

async fn until(fake: &FakeApi, what: &str, mut check: impl FnMut(&FakeApi) -> bool) {
    if !fake.wait_until(WAIT, |f| check(f)).await {
        panic!(
            "timed out waiting for {what}: cluster budget {:?}",
            fake.get("clustergpumemorybudgets", "", "tenants").map(|b| b["status"].clone())
        );
    }
}

/// team-a and team-b are tenants; sys is not. `tenants` (16Gi) covers the tenants' pods; team-a/llm
/// (8Gi, every other field the default, as the cluster budget's) tightens it for llm pods; team-b/loose
/// (32Gi) cannot loosen it.
fn fixture() -> FakeApi {
    let fake = FakeApi::new();
    fake.put_object(serde_json::to_value(ClusterGpuMemoryBudget::crd()).expect("crd")).expect("crd stored");
    namespace(&fake, "team-a", json!({"tier": "tenant"}));
    namespace(&fake, "team-b", json!({"tier": "tenant"}));
    namespace(&fake, "sys", json!({}));
    fake.put_object(json!({
        "apiVersion": "gpubudget.io/v1alpha1", "kind": "ClusterGpuMemoryBudget",
        "metadata": {"name": "tenants", "generation": 1},
        "spec": {"namespaceSelector": {"matchLabels": {"tier": "tenant"}}, "selector": {}, "limit": "16Gi"},
    }))
    .expect("cluster budget stored");
    budget(&fake, "team-a", "llm", "8Gi", json!({"matchLabels": {"app": "llm"}}));
    budget(&fake, "team-b", "loose", "32Gi", json!({}));
    pod(&fake, "team-a", "p1", "llm");
    pod(&fake, "team-a", "p2", "web");
    pod(&fake, "team-b", "q1", "batch");
    pod(&fake, "sys", "s1", "batch");
    fake
}

#[tokio::test(start_paused = true)]
async fn a_cluster_budgets_status_counts_its_pods_across_namespaces_and_follows_relabels() {
    let fake = fixture();
    let op = Operator::start(&fake, true);
    op.synced().await;
    until(&fake, "the cluster budget's pods", |f| cluster_status(f).matched_pods == 2).await;
    until(&fake, "the namespaced statuses", |f| status(f, "team-a", "llm").matched_pods == 1).await;

    // `tenants` applies to team-a/p2 and team-b/q1; team-a/llm took p1 over (tighter, no looser anywhere).
    let (state, message) = overlapping(&cluster_status(&fake));
    assert_eq!(state, "True");
    assert!(message.contains("team-a/llm (8Gi)") && message.contains("team-b/loose (32Gi)"), "{message}");
    assert!(message.contains("this budget (16Gi) applies to 1, team-a/llm to 1"), "{message}");
    assert!(message.contains("a namespaced budget only if it is no looser"), "{message}");
    let (state, message) = overlapping(&status(&fake, "team-a", "llm"));
    assert_eq!(state, "True");
    assert!(message.contains("ClusterGpuMemoryBudget/tenants (16Gi)"), "{message}");
    let loose = status(&fake, "team-b", "loose");
    assert_eq!(loose.matched_pods, 0, "32Gi cannot loosen the cluster budget's 16Gi");
    assert!(overlapping(&loose).1.contains("ClusterGpuMemoryBudget/tenants to 1"), "{}", overlapping(&loose).1);

    // The agent's records name the cluster budget: counted across namespaces, top pods as namespace/pod.
    record(&fake, "team-a", "p2", "Over", 17 * GI, "ClusterGpuMemoryBudget/tenants", None);
    record(&fake, "team-b", "q1", "Within", 4 * GI, "ClusterGpuMemoryBudget/tenants", None);
    until(&fake, "the records", |f| cluster_status(f).pods_over_budget == 1 && cluster_status(f).top_pods.len() == 2)
        .await;
    assert_eq!(top(&cluster_status(&fake)), ["team-a/p2", "team-b/q1"]);
    // What `kubectl get cgmb` prints comes from these fields of the stored object.
    let raw = fake.get("clustergpumemorybudgets", "", "tenants").expect("stored without a namespace");
    assert_eq!((raw["status"]["matchedPods"].as_i64(), raw["status"]["podsOverBudget"].as_i64()), (Some(2), Some(1)));
    assert_eq!(raw["status"]["observedGeneration"], 1);

    // sys is labelled a tenant: its pod joins; team-b is unlabelled: its pod leaves for team-b/loose.
    fake.clear_requests();
    fake.modify("namespaces", "", "sys", |ns| ns["metadata"]["labels"]["tier"] = "tenant".into()).expect("ns");
    until(&fake, "sys relabelled in", |f| cluster_status(f).matched_pods == 3).await;
    fake.modify("namespaces", "", "team-b", |ns| ns["metadata"]["labels"] = json!({})).expect("ns");
    until(&fake, "team-b relabelled out", |f| {
        cluster_status(f).matched_pods == 2 && status(f, "team-b", "loose").matched_pods == 1
    })
    .await;
    assert_eq!(top(&cluster_status(&fake)), ["team-a/p2"], "q1's record still names it, but it no longer applies");
    let (state, _) = overlapping(&status(&fake, "team-b", "loose"));
    assert_eq!(state, "False", "nothing else selects team-b's pod now");
    // Only the budgets a relabel touched were written: team-a/llm shares no pod with a moved selection.
    let written: Vec<String> = fake
        .requests()
        .iter()
        .filter(|r| r.method == "PATCH" && r.path.ends_with("/status"))
        .map(|r| r.path.clone())
        .collect();
    assert!(written.iter().all(|p| !p.contains("/team-a/")), "{written:?}");
    assert!(written.iter().any(|p| p.ends_with("/clustergpumemorybudgets/tenants/status")), "{written:?}");
    assert!(written.iter().any(|p| p.ends_with("/team-b/gpumemorybudgets/loose/status")), "{written:?}");

    // An eviction under the cluster budget is counted once, naming namespace/pod.
    record(&fake, "sys", "s1", "Evicting", 20 * GI, "ClusterGpuMemoryBudget/tenants", Some("2027-01-15T08:00:00Z"));
    let pods: kube::Api<k8s_openapi::api::core::v1::Pod> = kube::Api::namespaced(fake.client(), "sys");
    pods.evict("s1", &kube::api::EvictParams::default()).await.expect("evicted");
    until(&fake, "the eviction", |f| cluster_status(f).evictions == 1).await;
    let last = cluster_status(&fake).last_eviction.expect("last eviction");
    assert_eq!((last.pod.as_str(), last.usage.as_str()), ("sys/s1", "20Gi"));
    op.stop().await;
}

/// Without the ClusterGpuMemoryBudget CRD (an upgrade whose CRDs were not applied), the operator still
/// becomes ready and writes the namespaced budgets' status.
#[tokio::test(start_paused = true)]
async fn without_the_cluster_crd_the_namespaced_statuses_are_written() {
    let fake = FakeApi::new();
    fake.fail_next(Verb::List, "clustergpumemorybudgets", usize::MAX, 404);
    namespace(&fake, "team-a", json!({}));
    budget(&fake, "team-a", "llm", "8Gi", json!({}));
    pod(&fake, "team-a", "p1", "llm");
    let op = Operator::start(&fake, true);
    op.synced().await;
    until(&fake, "the namespaced status", |f| status(f, "team-a", "llm").matched_pods == 1).await;
    op.stop().await;
}
