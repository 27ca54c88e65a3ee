//! The index over the in-memory API server (gpubudget-testkit): what it lists, when its generation moves, and what
//! it forgets of what the runtime made.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Duration;

use gpubudget_common::Enforcement;
use gpubudget_common::pod_record::RuntimeCapsRecord;
use gpubudget_testkit::{FakeApi, pass_time, wait_for};

use super::*;

const NODE: &str = "gpu-node-1";
const WAIT: Duration = Duration::from_secs(10);

const OBJECTS: &str = r#"
apiVersion: v1
kind: Node
metadata: {name: gpu-node-1, labels: {gpubudget.io/enforcement: Observe}}
---
apiVersion: v1
kind: Namespace
metadata: {name: team-a}
---
apiVersion: v1
kind: Namespace
metadata: {name: team-b}
---
apiVersion: v1
kind: Pod
metadata: {name: llm-0, namespace: team-a, labels: {app: llm}}
spec: {nodeName: gpu-node-1, containers: [{name: main, image: x}]}
---
apiVersion: v1
kind: Pod
metadata: {name: remote-0, namespace: team-b, labels: {app: llm}}
spec: {nodeName: gpu-node-2, containers: [{name: main, image: x}]}
---
apiVersion: gpubudget.io/v1alpha1
kind: GpuMemoryBudget
metadata: {name: llm, namespace: team-a}
spec: {selector: {matchLabels: {app: llm}}, limit: 8Gi}
---
apiVersion: gpubudget.io/v1alpha1
kind: GpuMemoryBudget
metadata: {name: llm, namespace: team-b}
spec: {selector: {matchLabels: {app: llm}}, limit: 8Gi}
"#;

/// What the runtime made, by pod UID.
#[derive(Default)]
struct Runtime(Mutex<HashMap<String, MadeSummary>>);

impl RuntimeMade for Runtime {
    fn is_empty(&self) -> bool {
        self.0.lock().expect("lock").is_empty()
    }

    fn retain_pods(&self, here: impl Fn(&str) -> bool) {
        self.0.lock().expect("lock").retain(|uid, _| here(uid));
    }

    fn summary(&self, uid: &str) -> Option<MadeSummary> {
        self.0.lock().expect("lock").get(uid).cloned()
    }
}

/// The index over `fake` (the budgets themselves: no mirrors' Lease), once synced, with its health and the spec
/// reads it told.
async fn synced(fake: &FakeApi) -> (Index, Health, Arc<Mutex<Vec<(ReadKind, ReadResult)>>>) {
    let health = Health::new(&["pods", "budgets"]);
    let reads = Arc::new(Mutex::new(Vec::new()));
    let told = reads.clone();
    let mirroring = Mirroring {
        lease: None,
        spec_read: Arc::new(move |kind, result| told.lock().expect("lock").push((kind, result))),
        from_mirrors: Arc::new(|_, _, _| {}),
    };
    let index = Index::start(fake.client(), NODE, health.clone(), mirroring, CancellationToken::new());
    assert!(!index.synced(), "nothing listed yet");
    assert!(wait_for(WAIT, || index.synced()).await, "the index syncs");
    (index, health, reads)
}

fn fake() -> FakeApi {
    let fake = FakeApi::new();
    fake.apply_yaml(OBJECTS).expect("objects");
    fake
}

#[tokio::test(start_paused = true)]
async fn the_index_lists_its_nodes_pods_their_budgets_and_the_nodes_labels() {
    let fake = fake();
    let (index, health, reads) = synced(&fake).await;
    assert!(health.is_ready(), "pods and budgets set ready");
    let table = index.table(NODE, &[], &Runtime::default());
    let pods: Vec<&str> = table.pods.iter().map(|p| &*p.name).collect();
    assert_eq!(pods, ["llm-0"], "only this node's pods");
    assert_eq!(table.budget(0).map(|b| b.key()), Some("team-a/llm".to_owned()));
    assert_eq!(table.node_enforcement, Some(Enforcement::Observe));
    assert!(reads.lock().expect("lock").contains(&(ReadKind::List, ReadResult::Ok)), "spec reads told");
}

#[tokio::test(start_paused = true)]
async fn the_generation_moves_only_on_what_the_table_reads() {
    let fake = fake();
    let (index, _, _) = synced(&fake).await;
    let settled = index.generation();
    // A budget and a namespace's labels where no pod of this node runs: the table is the same.
    fake.modify("gpumemorybudgets", "team-b", "llm", |b| b["spec"]["limit"] = "4Gi".into()).expect("budget");
    fake.modify("namespaces", "", "team-b", |n| n["metadata"]["labels"] = serde_json::json!({"tier": "gold"}))
        .expect("namespace");
    pass_time(Duration::from_secs(5)).await;
    assert_eq!(index.generation(), settled, "nothing this node's table reads changed");
    // Where a pod of this node runs: it moves, and the table reads the new limit.
    fake.modify("gpumemorybudgets", "team-a", "llm", |b| b["spec"]["limit"] = "4Gi".into()).expect("budget");
    assert!(wait_for(WAIT, || index.generation() > settled).await, "a budget of team-a changed");
    assert!(
        wait_for(WAIT, || index.table(NODE, &[], &Runtime::default()).budget(0).map(|b| b.limit_bytes)
            == Some(4 << 30))
        .await
    );
    // The Node's labels are read again within a minute.
    let before = index.generation();
    fake.modify("nodes", "", NODE, |n| n["metadata"]["labels"] = serde_json::json!({})).expect("node");
    pass_time(node::EVERY).await;
    assert!(wait_for(WAIT, || index.generation() > before).await, "the Node's labels changed");
    assert_eq!(index.table(NODE, &[], &Runtime::default()).node_enforcement, None);
}

#[tokio::test(start_paused = true)]
async fn what_the_runtime_made_of_pods_gone_is_forgotten() {
    let fake = fake();
    let (index, _, _) = synced(&fake).await;
    let runtime = Runtime::default();
    let record = RuntimeCapsRecord::capped([("main".to_owned(), 4096)]);
    let object = fake.get("pods", "team-a", "llm-0").expect("pod");
    let uid = object["metadata"]["uid"].as_str().expect("the API server's UID").to_owned();
    for uid in [uid.as_str(), "ffffffff-0000-0000-0000-00000000000f"] {
        runtime.0.lock().expect("lock").insert(uid.to_owned(), (record.clone(), None));
    }
    let table = index.table(NODE, &[], &runtime);
    assert_eq!(table.pods[0].runtime_caps, Some(record), "the pod's caps as the runtime made them");
    let kept: Vec<String> = runtime.0.lock().expect("lock").keys().cloned().collect();
    assert_eq!(kept, [uid], "a pod not here is forgotten");
    let before = index.generation();
    assert!(fake.delete_object("pods", "team-a", "llm-0"));
    assert!(wait_for(WAIT, || index.generation() > before).await);
    assert!(index.table(NODE, &[], &runtime).pods.is_empty());
    assert!(runtime.is_empty(), "the pod gone, what the runtime made of it is forgotten");
}
