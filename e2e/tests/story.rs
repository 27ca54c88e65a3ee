//! The user's story, in memory: the operator and the agent run in this process against gpubudget-testkit's
//! in-memory API (a fake, not a cluster). GPU usage comes from a recorded-format sample file with real PIDs,
//! attributed through a fixture `/proc` tree laid out like a kubelet's cgroups. The budgets are the ones in
//! `examples/`. Run with `--nocapture` to see the events and the `kubectl get gmb` view it produces.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use gpubudget_agent::attribution::procfs::write_fake_process;
use gpubudget_agent::cli::RunArgs;
use gpubudget_common::quantity::HumanBytes;
use gpubudget_common::types::GpuMemoryBudgetStatus;
use gpubudget_common::{GpuMemoryBudget, contract};
use gpubudget_operator::controller::{self, CHECK_BUDGETS, CHECK_PODS, Context, Settings};
use gpubudget_runtime::Health;
use gpubudget_testkit::{EventSummary, FakeApi};
use prometheus_client::registry::Registry;
use serde_json::{Value, json};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

const NODE: &str = "gpu-node-1";
const GI: u64 = 1 << 30;
const MI: u64 = 1 << 20;
/// The CUDA context each process holds on an H100, as NVML reports it (FIELD_NOTES: ~510 MiB).
const CONTEXT: u64 = 510 * MI;

fn repo(rel: &str) -> String {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("..").join(rel);
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// A budget from `examples/`, moved to `namespace`, with `tweak` applied.
fn example(fake: &FakeApi, file: &str, namespace: &str, tweak: impl FnOnce(&mut Value)) {
    let mut value: Value = serde_yaml::from_str(&repo(file)).expect("example parses");
    value["metadata"]["namespace"] = namespace.into();
    tweak(&mut value);
    fake.put_object(value).expect("budget stored");
}

/// A running pod on `NODE` with one container, as the kubelet reports it. Returns the UID the API server gave it.
fn pod(fake: &FakeApi, namespace: &str, name: &str, labels: Value, container_id: &str) -> String {
    let stored = fake
        .put_object(json!({
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": name, "namespace": namespace, "labels": labels},
            "spec": {"nodeName": NODE, "terminationGracePeriodSeconds": 60,
                     "containers": [{"name": "server", "image": "vllm:latest"}]},
            "status": {"phase": "Running", "containerStatuses": [{
                "name": "server", "containerID": format!("containerd://{container_id}"), "image": "vllm:latest",
                "imageID": "x", "ready": true, "restartCount": 0}]},
        }))
        .expect("pod stored");
    stored["metadata"]["uid"].as_str().expect("a uid").to_owned()
}

/// The pieces of a node and a control plane: the fake API, the operator, the agent.
struct Stack {
    fake: FakeApi,
    shutdown: CancellationToken,
    tasks: Vec<tokio::task::JoinHandle<()>>,
    operator_health: Health,
    agent_health: Health,
    dir: tempfile::TempDir,
}

impl Stack {
    fn setup() -> (FakeApi, tempfile::TempDir) {
        let fake = FakeApi::new();
        // Pods evicted or deleted stay while they terminate, as on a real node.
        fake.set_graceful_pod_deletion(true);
        (fake, tempfile::tempdir().expect("tempdir"))
    }

    fn proc_root(dir: &Path) -> PathBuf {
        dir.join("proc")
    }

    fn sample_path(dir: &Path) -> PathBuf {
        dir.join("sample.json")
    }

    /// A process of a pod's container: a `/proc/<pid>` whose cgroup is the kubelet's (systemd driver,
    /// containerd, burstable QoS), as on a real node.
    fn process(dir: &Path, pid: u32, pod_uid: &str, container_id: &str) {
        let cgroup = format!(
            "0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{}.slice/cri-containerd-{container_id}.scope\n",
            pod_uid.replace('-', "_")
        );
        write_fake_process(&Self::proc_root(dir), pid, 1000 + u64::from(pid), &cgroup).expect("fake /proc");
    }

    /// What NVML would report now: `(pid, bytes)` on GPU 0 (written atomically, as a ConfigMap update is).
    fn usage(dir: &Path, processes: &[(u32, u64)]) {
        let processes: Vec<Value> =
            processes.iter().map(|(pid, bytes)| json!({"pid": pid, "used_bytes": bytes})).collect();
        let sample = json!({"version": 1, "gpus": [{"index": 0, "uuid": "GPU-5d0c8a86-1111-2222-3333-444455556666",
            "name": "NVIDIA H100 80GB HBM3", "memory_total_bytes": 85_520_809_984u64, "processes": processes}]});
        let path = Self::sample_path(dir);
        let tmp = path.with_extension("tmp");
        std::fs::write(&tmp, sample.to_string()).expect("sample");
        std::fs::rename(&tmp, &path).expect("rename");
    }

    fn start(fake: FakeApi, dir: tempfile::TempDir) -> Self {
        gpubudget_runtime::init_tracing(gpubudget_runtime::LogFormat::Text);
        let shutdown = CancellationToken::new();
        let (_, leader) = watch::channel(true);
        let settings = Settings { instance: Some("gpubudget-operator-0".into()), ..Settings::default() };
        let ctx = Arc::new(Context::new(fake.client(), Default::default(), leader, settings));
        let operator_health = Health::new(&[CHECK_PODS, CHECK_BUDGETS]);
        let operator = tokio::spawn({
            let (health, shutdown) = (operator_health.clone(), shutdown.clone());
            async move { controller::run(ctx, health, shutdown).await.expect("operator runs") }
        });
        let agent_health = Health::new(&gpubudget_agent::run::CHECKS);
        // The default interval: the story runs at the agent's real speed.
        let args = RunArgs::replay(
            NODE,
            Self::proc_root(dir.path()),
            Self::sample_path(dir.path()),
            Duration::from_millis(250),
        );
        let metrics = gpubudget_agent::metrics::Metrics::new(&mut Registry::default());
        let agent = tokio::spawn(gpubudget_agent::run::run_with(
            args,
            fake.client(),
            agent_health.clone(),
            metrics,
            shutdown.clone(),
        ));
        Self { fake, shutdown, tasks: vec![operator, agent], operator_health, agent_health, dir }
    }

    async fn ready(&self) {
        let deadline = Instant::now() + Duration::from_secs(10);
        while !(self.operator_health.is_ready() && self.agent_health.is_ready()) {
            assert!(
                Instant::now() < deadline,
                "not ready: operator {} agent {}",
                self.operator_health.report(),
                self.agent_health.report()
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    fn set_usage(&self, processes: &[(u32, u64)]) {
        Self::usage(self.dir.path(), processes);
    }

    fn events(&self, namespace: &str, pod: &str) -> Vec<EventSummary> {
        self.fake.events_for(namespace, pod)
    }

    async fn event(&self, namespace: &str, pod: &str, reason: &str, within: Duration) -> EventSummary {
        let found =
            self.fake.wait_until(within, |f| f.events_for(namespace, pod).iter().any(|e| e.reason == reason)).await;
        assert!(
            found,
            "no {reason} event on {namespace}/{pod} within {within:?}: {:#?}\npod: {:#}",
            self.events(namespace, pod),
            self.fake.get("pods", namespace, pod).unwrap_or_default()
        );
        self.events(namespace, pod).into_iter().find(|e| e.reason == reason).expect("found")
    }

    fn status(&self, namespace: &str, name: &str) -> GpuMemoryBudgetStatus {
        self.fake.typed::<GpuMemoryBudget>(namespace, name).and_then(|b| b.status).unwrap_or_default()
    }

    async fn status_until(
        &self,
        namespace: &str,
        name: &str,
        what: &str,
        check: impl Fn(&GpuMemoryBudgetStatus) -> bool,
    ) -> GpuMemoryBudgetStatus {
        let ok = self
            .fake
            .wait_until(Duration::from_secs(10), |f| {
                check(&f.typed::<GpuMemoryBudget>(namespace, name).and_then(|b| b.status).unwrap_or_default())
            })
            .await;
        let status = self.status(namespace, name);
        assert!(ok, "{namespace}/{name}: {what} never held: {status:#?}");
        status
    }

    fn annotations(&self, namespace: &str, pod: &str) -> Value {
        self.fake.get("pods", namespace, pod).map(|p| p["metadata"]["annotations"].clone()).unwrap_or_default()
    }

    /// `kubectl get gmb -n <namespace>` and the pod events, as a person would see them.
    fn transcript(&self, namespace: &str, pods: &[&str]) -> String {
        let mut out = format!(
            "$ kubectl get gmb -n {namespace}\n{:<16}{:<8}{:<8}{:<8}{:<6}{}\n",
            "NAME", "LIMIT", "ACTION", "MATCHED", "OVER", "EVICTED"
        );
        for budget in self.fake.list("gpumemorybudgets", Some(namespace)) {
            let s = &budget["status"];
            out += &format!(
                "{:<16}{:<8}{:<8}{:<8}{:<6}{}\n",
                budget["metadata"]["name"].as_str().unwrap_or_default(),
                budget["spec"]["limit"].as_str().unwrap_or_default(),
                budget["spec"]["action"].as_str().unwrap_or("Evict"),
                s["matchedPods"].as_i64().unwrap_or_default(),
                s["podsOverBudget"].as_i64().unwrap_or_default(),
                s["evictions"].as_i64().unwrap_or_default(),
            );
        }
        out += &format!("\n$ kubectl get events -n {namespace} --field-selector involvedObject.kind=Pod\n");
        for pod in pods {
            for e in self.events(namespace, pod) {
                out += &format!("{:<8} {:<26} pod/{pod}  {}\n", e.type_, e.reason, e.message);
            }
        }
        out
    }

    async fn stop(self) -> FakeApi {
        self.shutdown.cancel();
        for task in self.tasks {
            tokio::time::timeout(Duration::from_secs(10), task).await.expect("stops in time").expect("no panic");
        }
        self.fake
    }
}

const LLM_CID: &str = "1f2e3d4c5b6a79881f2e3d4c5b6a79881f2e3d4c5b6a79881f2e3d4c5b6a7988";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn evict_story_a_pod_climbs_past_its_budget_and_is_evicted_once() {
    let (fake, dir) = Stack::setup();
    example(&fake, "examples/llm-inference.yaml", "team-a", |_| {});
    let uid = pod(&fake, "team-a", "llm-0", json!({"app": "llm"}), LLM_CID);
    // Two processes in the pod's container: the server and a tokenizer worker holding only its CUDA context.
    Stack::process(dir.path(), 4242, &uid, LLM_CID);
    Stack::process(dir.path(), 4243, &uid, LLM_CID);
    Stack::usage(dir.path(), &[(4242, 6 * GI - CONTEXT), (4243, CONTEXT)]);
    let stack = Stack::start(fake, dir);
    stack.ready().await;

    // 6Gi of 8Gi: within; the agent records it and the operator counts the pod.
    let status = stack.status_until("team-a", "llm-inference", "MATCHED 1", |s| s.matched_pods == 1).await;
    assert_eq!((status.pods_near_budget, status.pods_over_budget, status.evictions), (0, 0, 0));
    assert!(
        stack.events("team-a", "llm-0").is_empty(),
        "no event while within: {:#?}",
        stack.events("team-a", "llm-0")
    );

    // 7.5Gi: at least 90 % of 8Gi.
    stack.set_usage(&[(4242, 7 * GI), (4243, CONTEXT)]);
    let near = stack.event("team-a", "llm-0", "GpuMemoryNearBudget", Duration::from_secs(3)).await;
    assert_eq!(near.type_, "Warning");
    assert!(near.message.contains("of 8Gi (budget team-a/llm-inference)"), "{}", near.message);
    assert_eq!((near.reporting_controller.as_str(), near.reporting_instance.as_str()), ("gpubudget-agent", NODE));

    // 9Gi: over. The eviction must wait out overLimitSeconds (10 s) of continuous overage.
    stack.set_usage(&[(4242, 9 * GI - CONTEXT), (4243, CONTEXT)]);
    let over = stack.event("team-a", "llm-0", "GpuMemoryOverBudget", Duration::from_secs(3)).await;
    let over_seen = Instant::now();
    assert!(over.message.contains("using 9Gi of 8Gi (budget team-a/llm-inference)"), "{}", over.message);
    assert!(over.message.contains("pid 4242") && over.message.contains("8.5Gi"), "names the holders: {}", over.message);
    let status = stack.status_until("team-a", "llm-inference", "OVER 1", |s| s.pods_over_budget == 1).await;
    assert_eq!(status.top_pods.first().map(|p| p.usage.as_str()), Some("9Gi"));
    assert!(stack.fake.evictions().is_empty(), "no eviction before overLimitSeconds");

    let evicting = stack.event("team-a", "llm-0", "EvictingForGpuMemory", Duration::from_secs(15)).await;
    let waited = over_seen.elapsed();
    assert!(waited >= Duration::from_millis(9_000), "evicted after only {waited:?} over the limit");
    assert!(evicting.message.contains("using 9Gi of 8Gi (budget team-a/llm-inference) for 1"), "{}", evicting.message);
    assert!(evicting.message.contains("evicting with 30s grace"), "{}", evicting.message);

    // Exactly one eviction request, carrying the budget's grace period; the pod is recorded as evicting.
    tokio::time::sleep(Duration::from_secs(1)).await;
    let evictions = stack.fake.evictions();
    assert_eq!(evictions.len(), 1, "{evictions:#?}");
    assert_eq!(evictions[0]["apiVersion"], "policy/v1");
    assert_eq!(evictions[0]["metadata"]["name"], "llm-0");
    assert_eq!(evictions[0]["deleteOptions"]["gracePeriodSeconds"], 30);
    let annotations = stack.annotations("team-a", "llm-0");
    assert_eq!(annotations[contract::STATE], "Evicting");
    assert_eq!(annotations[contract::BUDGET], "llm-inference");
    assert!(annotations[contract::EVICTION_REQUESTED_AT].is_string(), "{annotations}");
    let pod = stack.fake.get("pods", "team-a", "llm-0").expect("terminating, not gone");
    assert!(pod["metadata"]["deletionTimestamp"].is_string(), "the eviction started the pod's termination");

    // The budget's status: MATCHED 1, OVER 1, EVICTED 1.
    let status = stack.status_until("team-a", "llm-inference", "EVICTED 1", |s| s.evictions == 1).await;
    assert_eq!((status.matched_pods, status.pods_over_budget, status.evictions), (1, 1, 1));
    assert_eq!(status.last_eviction.as_ref().map(|e| e.pod.as_str()), Some("llm-0"));
    println!("{}", stack.transcript("team-a", &["llm-0"]));
    let fake = stack.stop().await;
    assert_eq!(fake.evictions().len(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn warn_story_events_and_status_but_never_an_eviction() {
    let (fake, dir) = Stack::setup();
    // The example waits 30 s before its (audit-only) action; 1 s keeps the test short and still proves it.
    example(&fake, "examples/training-warn.yaml", "team-a", |b| b["spec"]["overLimitSeconds"] = 1.into());
    let cid = "2a".repeat(32);
    let uid = pod(&fake, "team-a", "finetune-0", json!({"job-type": "finetune"}), &cid);
    Stack::process(dir.path(), 5150, &uid, &cid);
    Stack::usage(dir.path(), &[(5150, 20 * GI)]);
    let stack = Stack::start(fake, dir);
    stack.ready().await;
    stack.status_until("team-a", "training-audit", "MATCHED 1", |s| s.matched_pods == 1).await;

    stack.set_usage(&[(5150, 33 * GI)]); // 80 % of 40Gi is 32Gi
    let near = stack.event("team-a", "finetune-0", "GpuMemoryNearBudget", Duration::from_secs(3)).await;
    assert!(near.message.contains("of 40Gi (budget team-a/training-audit)"), "{}", near.message);
    stack.set_usage(&[(5150, 41 * GI)]);
    let over = stack.event("team-a", "finetune-0", "GpuMemoryOverBudget", Duration::from_secs(3)).await;
    assert!(over.message.contains("using 41Gi of 40Gi"), "{}", over.message);

    // Well past overLimitSeconds: still no eviction, and nothing says one is coming.
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert!(stack.fake.evictions().is_empty());
    let reasons: Vec<String> = stack.events("team-a", "finetune-0").into_iter().map(|e| e.reason).collect();
    assert!(!reasons.iter().any(|r| r == "EvictingForGpuMemory"), "{reasons:?}");
    assert_eq!(stack.annotations("team-a", "finetune-0")[contract::STATE], "Over");
    let status = stack.status_until("team-a", "training-audit", "OVER 1", |s| s.pods_over_budget == 1).await;
    assert_eq!((status.matched_pods, status.evictions), (1, 0));
    println!("{}", stack.transcript("team-a", &["finetune-0"]));
    stack.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn overlapping_story_the_smallest_budget_applies_and_both_say_so() {
    let (fake, dir) = Stack::setup();
    example(&fake, "examples/namespace-wide.yaml", "team-b", |_| {});
    example(&fake, "examples/llm-inference.yaml", "team-b", |_| {});
    let cid = "3b".repeat(32);
    let uid = pod(&fake, "team-b", "llm-b-0", json!({"app": "llm"}), &cid);
    Stack::process(dir.path(), 6001, &uid, &cid);
    // 7.5Gi: near the 8Gi budget, far under the namespace's 20Gi.
    Stack::usage(dir.path(), &[(6001, 7 * GI + 512 * MI)]);
    let stack = Stack::start(fake, dir);
    stack.ready().await;

    let near = stack.event("team-b", "llm-b-0", "GpuMemoryNearBudget", Duration::from_secs(5)).await;
    assert!(
        near.message.contains(&format!("using {} of 8Gi (budget team-b/llm-inference)", HumanBytes(7 * GI + 512 * MI))),
        "{}",
        near.message
    );
    let record = stack.annotations("team-b", "llm-b-0");
    assert_eq!(record[contract::BUDGET], "llm-inference");
    assert_eq!(record[contract::STATE], "Near");

    let overlapping = |s: &GpuMemoryBudgetStatus| {
        s.conditions.iter().find(|c| c.type_ == "Overlapping").map(|c| (c.status.clone(), c.message.clone()))
    };
    // The status catches up with the agent's record in its own time: wait for both.
    let small = stack
        .status_until("team-b", "llm-inference", "Overlapping, MATCHED 1, NEAR 1", |s| {
            overlapping(s).is_some_and(|(st, _)| st == "True") && s.matched_pods == 1 && s.pods_near_budget == 1
        })
        .await;
    let wide = stack
        .status_until("team-b", "team-b-default", "Overlapping", |s| overlapping(s).is_some_and(|(st, _)| st == "True"))
        .await;
    assert!(overlapping(&small).is_some_and(|(_, m)| m.contains("team-b-default")), "{small:#?}");
    assert!(overlapping(&wide).is_some_and(|(_, m)| m.contains("llm-inference")), "{wide:#?}");
    assert_eq!((small.matched_pods, small.pods_near_budget), (1, 1), "the smaller budget applies");
    assert_eq!(wide.matched_pods, 0, "the wider budget does not count a pod another budget governs");
    println!("{}", stack.transcript("team-b", &["llm-b-0"]));
    stack.stop().await;
}
