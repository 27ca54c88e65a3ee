//! #23: `ClusterGpuMemoryBudget` on the agent's `run` loop, against gpubudget-testkit's in-memory API server
//! (in-memory, not a real API server). A cluster budget governs pods of namespaces its `namespaceSelector`
//! matches whatever namespaced budgets exist there: a namespace with no budget, a pod relabelled out of every
//! namespaced selector, a looser namespaced budget; a tighter namespaced budget wins.

use std::time::Duration;

use gpubudget_demo::stack::Stack;
use gpubudget_testkit::{FakeApi, Verb, pass_time};

const WAIT: Duration = Duration::from_secs(10);
const GI: u64 = 1 << 30;

/// Namespaces `tenant-*` are labelled `gpubudget.io/tier: tenant`; `free` is not. The cluster budget: 4Gi,
/// evict at once, tenants only. `tenant-loose` has a 16Gi budget for `app: llm` (looser: it does not
/// loosen the cluster budget); `tenant-tight` a 2Gi one (tighter: it wins).
const OBJECTS: &str = r#"
apiVersion: v1
kind: Namespace
metadata: {name: tenant-empty, labels: {gpubudget.io/tier: tenant}}
---
apiVersion: v1
kind: Namespace
metadata: {name: tenant-loose, labels: {gpubudget.io/tier: tenant}}
---
apiVersion: v1
kind: Namespace
metadata: {name: tenant-tight, labels: {gpubudget.io/tier: tenant}}
---
apiVersion: v1
kind: Namespace
metadata: {name: free}
---
apiVersion: gpubudget.io/v1alpha1
kind: ClusterGpuMemoryBudget
metadata: {name: tenants}
spec: {namespaceSelector: {matchLabels: {gpubudget.io/tier: tenant}}, selector: {}, limit: 4Gi, overLimitSeconds: 0}
---
apiVersion: gpubudget.io/v1alpha1
kind: GpuMemoryBudget
metadata: {name: loose, namespace: tenant-loose}
spec: {selector: {matchLabels: {app: llm}}, limit: 16Gi, overLimitSeconds: 0}
---
apiVersion: gpubudget.io/v1alpha1
kind: GpuMemoryBudget
metadata: {name: tight, namespace: tenant-tight}
spec: {selector: {}, limit: 2Gi, overLimitSeconds: 0}
---
apiVersion: v1
kind: Pod
metadata: {name: p, namespace: tenant-empty, uid: 11111111-1111-1111-1111-111111111111}
spec: {nodeName: gpu-node-1, containers: [{name: main, image: x}]}
---
apiVersion: v1
kind: Pod
metadata: {name: p, namespace: tenant-loose, uid: 22222222-2222-2222-2222-222222222222, labels: {app: llm}}
spec: {nodeName: gpu-node-1, containers: [{name: main, image: x}]}
---
apiVersion: v1
kind: Pod
metadata: {name: p, namespace: tenant-tight, uid: 33333333-3333-3333-3333-333333333333}
spec: {nodeName: gpu-node-1, containers: [{name: main, image: x}]}
---
apiVersion: v1
kind: Pod
metadata: {name: p, namespace: free, uid: 44444444-4444-4444-4444-444444444444}
spec: {nodeName: gpu-node-1, containers: [{name: main, image: x}]}
"#;

fn record(fake: &FakeApi, ns: &str) -> (Option<String>, Option<String>) {
    let pod = fake.get("pods", ns, "p").unwrap_or_default();
    let annotation = |k: &str| pod["metadata"]["annotations"][k].as_str().map(str::to_owned);
    (annotation("gpubudget.io/budget"), annotation("gpubudget.io/state"))
}

fn evicted(fake: &FakeApi) -> Vec<String> {
    let mut namespaces: Vec<String> =
        fake.evictions().iter().filter_map(|e| e["metadata"]["namespace"].as_str().map(str::to_owned)).collect();
    namespaces.sort();
    namespaces
}

async fn start(usage: &[(&str, u64)]) -> Stack {
    start_with(FakeApi::new(), usage).await
}

async fn start_with(fake: FakeApi, usage: &[(&str, u64)]) -> Stack {
    fake.apply_yaml(OBJECTS).expect("objects");
    // An evicted pod stays, terminating, with its record.
    fake.set_graceful_pod_deletion(true);
    let mut stack = Stack::new(fake);
    let usage: Vec<(&str, &str, &str, u64)> = usage.iter().map(|(ns, b)| (*ns, "p", "main", *b)).collect();
    stack.set_named_usage(&usage);
    stack.start_agent(Duration::from_millis(50));
    stack
}

/// 3 GiB each: under the cluster budget (4Gi) everywhere but over the tight namespaced one (2Gi), which wins
/// in its namespace; every record names the budget that applies.
#[tokio::test(start_paused = true)]
async fn each_pod_gets_the_smallest_limit_of_cluster_and_namespaced_budgets() {
    let agent =
        start(&[("tenant-empty", 3 * GI), ("tenant-loose", 3 * GI), ("tenant-tight", 3 * GI), ("free", 3 * GI)]).await;
    let f = &agent.fake;
    assert!(f.wait_until(WAIT, |f| evicted(f) == ["tenant-tight"]).await, "evicted {:?}", evicted(f));
    let cluster = Some("ClusterGpuMemoryBudget/tenants".to_owned());
    assert_eq!(record(f, "tenant-empty"), (cluster.clone(), Some("Within".into())), "a namespace with no budget");
    assert_eq!(record(f, "tenant-loose"), (cluster, Some("Within".into())), "a looser budget does not apply");
    assert_eq!(record(f, "tenant-tight").0.as_deref(), Some("tight"), "a tighter budget wins");
    assert_eq!(record(f, "free"), (None, None), "a namespace the namespaceSelector leaves out: no budget");
    agent.stop().await;
}

/// 6 GiB each: over the cluster budget. The pod of the namespace with no budget, and the pod of the namespace
/// whose 16Gi budget selects it, are evicted; the pod relabelled out of every namespaced selector still is.
#[tokio::test(start_paused = true)]
async fn a_pod_over_the_cluster_budget_is_evicted_whatever_its_namespace_sets() {
    let agent = start(&[("tenant-empty", 6 * GI), ("free", 6 * GI)]).await;
    let f = &agent.fake;
    assert!(f.wait_until(WAIT, |f| evicted(f) == ["tenant-empty"]).await, "evicted {:?}", evicted(f));
    assert_eq!(record(f, "free"), (None, None), "not selected: never evicted");
    agent.stop().await;

    for relabel in [false, true] {
        let agent = start(&[("tenant-loose", 6 * GI)]).await;
        let f = &agent.fake;
        if relabel {
            assert!(f.set_pod_labels("tenant-loose", "p", [("app", "other")]), "relabelled");
        }
        assert!(f.wait_until(WAIT, |f| evicted(f) == ["tenant-loose"]).await, "relabel {relabel}: {:?}", evicted(f));
        let budget = record(f, "tenant-loose").0;
        assert_eq!(budget.as_deref(), Some("ClusterGpuMemoryBudget/tenants"), "relabel {relabel}");
        agent.stop().await;
    }
}

/// A namespace labelled into the cluster budget's namespaceSelector after the agent started: its pod is
/// governed from then on (the agent watches namespaces' labels).
#[tokio::test(start_paused = true)]
async fn labelling_a_namespace_brings_its_pods_under_the_cluster_budget() {
    let agent = start(&[("free", 6 * GI)]).await;
    let f = &agent.fake;
    assert!(f.wait_until(WAIT, |_| agent.agent_health().is_ready()).await, "{}", agent.agent_health().report());
    pass_time(Duration::from_millis(300)).await;
    assert!(evicted(f).is_empty(), "not selected yet");
    f.modify("namespaces", "", "free", |ns| {
        ns["metadata"]["labels"] = serde_json::json!({"gpubudget.io/tier": "tenant"});
    })
    .expect("namespace");
    assert!(f.wait_until(WAIT, |f| evicted(f) == ["free"]).await, "evicted {:?}", evicted(f));
    assert_eq!(record(f, "free").0, Some("ClusterGpuMemoryBudget/tenants".into()));
    agent.stop().await;
}

/// An upgrade whose CRDs were not applied first (Helm installs crds/ on first install only): the cluster
/// budgets' list is answered 404. The agent is ready and enforces the namespaced budgets all the same.
#[tokio::test(start_paused = true)]
async fn without_the_cluster_crd_namespaced_budgets_are_enforced() {
    let fake = FakeApi::new();
    fake.fail_next(Verb::List, "clustergpumemorybudgets", 10_000, 404);
    let agent = start_with(fake, &[("tenant-tight", 3 * GI), ("tenant-empty", 6 * GI)]).await;
    let f = &agent.fake;
    assert!(f.wait_until(WAIT, |f| evicted(f) == ["tenant-tight"]).await, "evicted {:?}", evicted(f));
    assert!(agent.agent_health().is_ready(), "{}", agent.agent_health().report());
    assert_eq!(record(f, "tenant-empty"), (None, None), "no cluster budget known");
    agent.stop().await;
}
