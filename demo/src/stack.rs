//! The in-process stack: gpubudget-testkit's in-memory API (a fake, not a cluster), the operator and the
//! agent in this process, a kubelet-shaped fixture `/proc` and a sample file in the format `gpubudget-agent
//! capture` writes. The demo runs on it, and so do the tests that need the agent and the operator together
//! (e2e stories, the agent's API tests): one harness, not one per test file.
//!
//! Waiting is done by polling a condition with a deadline ([`FakeApi::wait_until`]), never by sleeping.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use gpubudget_agent::attribute::procfs::write_fake_process;
use gpubudget_agent::cli::RunArgs;
use gpubudget_agent::report::metrics::Metrics;
use gpubudget_daemon::Health;
use gpubudget_operator::controller::{self, CHECK_BUDGETS, CHECK_PODS, Context, Settings};
use gpubudget_testkit::FakeApi;
use prometheus_client::registry::Registry;
use serde_json::{Value, json};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

/// The node the agent runs as.
pub const NODE: &str = "gpu-node-1";
/// A gibibyte.
pub const GI: u64 = 1 << 30;
/// A mebibyte.
pub const MI: u64 = 1 << 20;
/// The CUDA context each process holds on an H100, as NVML reports it (~510 MiB, measured).
pub const CONTEXT: u64 = 510 * MI;
/// The GPU the sample files describe: the H100 of the real-GPU check.
pub const GPU_UUID: &str = "GPU-70431999-2302-5d30-e742-174aa217640c";
/// Its name.
pub const GPU_NAME: &str = "NVIDIA H100 80GB HBM3";
/// Its memory, bytes.
pub const GPU_TOTAL: u64 = 85_520_809_984;

/// One GPU for [`Stack::set_gpus`]: its processes `(pid, bytes)`, and the error its sample fails with.
pub type GpuUsage<'a> = (&'a [(u32, u64)], Option<&'a str>);

/// The Lease by which the operator vouches for the budgets' mirrors (namespace, name), as the chart names it.
pub const MIRRORS_LEASE: (&str, &str) = ("gpubudget", "gpubudget-mirrors");

/// The operator, the agent, and what they run against.
pub struct Stack {
    /// The in-memory API.
    pub fake: FakeApi,
    client: kube::Client,
    dir: tempfile::TempDir,
    shutdown: CancellationToken,
    /// The running operator's own (a child of `shutdown`).
    operator_shutdown: CancellationToken,
    tasks: Vec<tokio::task::JoinHandle<()>>,
    operator_health: Option<Health>,
    agent_health: Option<Health>,
    agent_registry: Arc<Registry>,
    operator_registry: Arc<Registry>,
}

impl std::fmt::Debug for Stack {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Stack").field("dir", &self.dir.path()).field("tasks", &self.tasks.len()).finish_non_exhaustive()
    }
}

impl Stack {
    /// A stack over `fake`, with nothing running yet. The components talk to the fake in process; see
    /// [`Self::with_client`].
    pub fn new(fake: FakeApi) -> Self {
        let client = fake.client();
        Self {
            fake,
            client,
            dir: tempfile::tempdir().expect("a temporary directory"),
            shutdown: CancellationToken::new(),
            operator_shutdown: CancellationToken::new(),
            tasks: Vec::new(),
            operator_health: None,
            agent_health: None,
            agent_registry: Arc::new(Registry::default()),
            operator_registry: Arc::new(Registry::default()),
        }
    }

    /// The components use `client` (the fake served over HTTP, say) instead of the in-process one.
    pub fn with_client(mut self, client: kube::Client) -> Self {
        self.client = client;
        self
    }

    /// The fixture `/proc`.
    pub fn proc_root(&self) -> PathBuf {
        self.dir.path().join("proc")
    }

    /// The sample file the agent replays.
    pub fn sample_path(&self) -> PathBuf {
        self.dir.path().join("sample.json")
    }

    /// The shutdown signal every component listens to.
    pub fn shutdown(&self) -> CancellationToken {
        self.shutdown.clone()
    }

    /// A process of a pod's container: a `/proc/<pid>` whose cgroup is the kubelet's (systemd driver,
    /// containerd, burstable QoS), as on a real node.
    pub fn process(&self, pid: u32, pod_uid: &str, container_id: &str) {
        kubelet_process(&self.proc_root(), pid, pod_uid, container_id);
    }

    /// The sample file the agent replays, to write what NVML reports.
    pub fn sample(&self) -> SampleFile {
        SampleFile::new(self.sample_path())
    }

    /// What NVML reports now: `(pid, bytes)` on GPU 0.
    pub fn set_usage(&self, processes: &[(u32, u64)]) {
        self.sample().set_usage(processes);
    }

    /// [`Self::set_usage`], with the device's own used bytes (`memory_info`: what the pressure signal reads).
    pub fn set_usage_and_device(&self, processes: &[(u32, u64)], device_used: u64) {
        self.sample().set_usage_and_device(processes, device_used);
    }

    /// Usage charged to pods by name, `(namespace, pod, container, bytes)`: no `/proc` involved.
    pub fn set_named_usage(&self, entries: &[(&str, &str, &str, u64)]) {
        self.sample().set_named_usage(entries);
    }

    /// Several GPUs, each `(processes as (pid, bytes), the error its sample fails with)`: GPU `i` is NVML
    /// index `i`, an H100 like GPU 0.
    pub fn set_gpus(&self, gpus: &[GpuUsage<'_>]) {
        self.sample().set_gpus(gpus);
    }

    /// Starts the operator (leader, one replica), writing mirrors and vouching for them through
    /// [`MIRRORS_LEASE`] as the chart installs it.
    pub fn start_operator(&mut self) {
        self.start_operator_with(true);
    }

    /// Starts the operator (leader, one replica), mirrors written or not (`--budget-mirrors`); an operator this
    /// stack started before is stopped first, as a rollout replaces its pod.
    pub fn start_operator_with(&mut self, mirrors: bool) {
        self.operator_shutdown.cancel();
        self.operator_shutdown = self.shutdown.child_token();
        let (_, leader) = watch::channel(true);
        let settings = Settings {
            instance: Some("gpubudget-operator-0".into()),
            mirrors,
            mirrors_lease: Some((MIRRORS_LEASE.0.to_owned(), MIRRORS_LEASE.1.to_owned())),
            ..Settings::default()
        };
        let (registry, metrics, health) = operator_registry(&[CHECK_PODS, CHECK_BUDGETS]);
        let ctx = Arc::new(Context::new(self.client.clone(), metrics, leader, settings));
        self.operator_registry = Arc::new(registry);
        let (h, shutdown) = (health.clone(), self.operator_shutdown.clone());
        self.tasks.push(tokio::spawn(async move { controller::run(ctx, h, shutdown).await.expect("operator runs") }));
        self.operator_health = Some(health);
    }

    /// Starts the agent of [`NODE`], replaying [`Self::sample_path`] every `interval` through
    /// [`Self::proc_root`]. Its metrics are in [`Self::agent_metrics`].
    pub fn start_agent(&mut self, interval: Duration) {
        if !self.sample_path().exists() {
            self.set_usage(&[]);
        }
        let (registry, metrics, health) = agent_registry();
        let mut args = RunArgs::replay(NODE, self.proc_root(), self.sample_path(), interval);
        args.mirrors_lease = Some((MIRRORS_LEASE.0.to_owned(), MIRRORS_LEASE.1.to_owned()));
        self.tasks.push(tokio::spawn(gpubudget_agent::cmd::run::run_with(
            args,
            self.client.clone(),
            health.clone(),
            metrics,
            self.shutdown.clone(),
        )));
        self.agent_health = Some(health);
        self.agent_registry = Arc::new(registry);
    }

    /// The agent's health checks, once started.
    pub fn agent_health(&self) -> &Health {
        self.agent_health.as_ref().expect("the agent was started")
    }

    /// Waits until every started component reports ready.
    pub async fn ready(&self, within: Duration) -> bool {
        let ready = |h: &Option<Health>| h.as_ref().is_none_or(Health::is_ready);
        self.fake.wait_until(within, |_| ready(&self.operator_health) && ready(&self.agent_health)).await
    }

    /// Why not ready, for a failed assertion.
    pub fn readiness(&self) -> String {
        let report = |h: &Option<Health>| h.as_ref().map_or_else(|| "not started".to_owned(), Health::report);
        format!("operator: {}; agent: {}", report(&self.operator_health), report(&self.agent_health))
    }

    /// The agent's metrics, in the text format `/metrics` serves.
    pub fn agent_metrics(&self) -> String {
        let mut out = String::new();
        prometheus_client::encoding::text::encode(&mut out, &self.agent_registry).expect("metrics encode");
        out
    }

    /// The operator's metrics, in the text format `/metrics` serves (as `gpubudget-operator run` registers them).
    pub fn operator_metrics(&self) -> String {
        let mut out = String::new();
        prometheus_client::encoding::text::encode(&mut out, &self.operator_registry).expect("metrics encode");
        out
    }

    /// Stops every component and waits for them (at most 10 s each); the fake is returned for a restart.
    pub async fn stop(self) -> FakeApi {
        self.shutdown.cancel();
        for task in self.tasks {
            tokio::time::timeout(Duration::from_secs(10), task).await.expect("stops in time").expect("no panic");
        }
        self.fake
    }
}

/// The agent's metrics and readiness checks, registered as `gpubudget-agent run` registers them (its
/// `/metrics` serves this registry).
pub fn agent_registry() -> (Registry, Metrics, Health) {
    let mut registry = Registry::default();
    let metrics = Metrics::new(&mut registry);
    let health = Health::new(&gpubudget_agent::cmd::run::CHECKS);
    health.register(&mut registry, gpubudget_agent::cmd::run::READY_METRIC);
    (registry, metrics, health)
}

/// The operator's metrics and readiness `checks`, registered as `gpubudget-operator run` registers them.
pub fn operator_registry(checks: &[&'static str]) -> (Registry, gpubudget_operator::metrics::Metrics, Health) {
    let mut registry = Registry::default();
    let metrics = gpubudget_operator::metrics::Metrics::register(&mut registry);
    let health = Health::new(checks);
    health.register(&mut registry, gpubudget_operator::metrics::READY_METRIC);
    (registry, metrics, health)
}

/// An in-memory API where pods deleted or evicted stay while they terminate (until
/// [`FakeApi::finish_deletion`], the kubelet's part), as on a real node.
pub fn kubelet_like_api() -> FakeApi {
    let fake = FakeApi::new();
    fake.set_graceful_pod_deletion(true);
    // The node the pods run on, as its kubelet registers it: the agent's usage object is owned by it.
    fake.put_object(json!({
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {"name": NODE, "labels": {"nvidia.com/gpu.present": "true"}},
    }))
    .expect("node stored");
    fake
}

/// A running pod on [`NODE`] with one container, as the kubelet reports it. Returns the UID the API
/// server gave it.
pub fn put_pod(fake: &FakeApi, namespace: &str, name: &str, labels: Value, container_id: &str) -> String {
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

/// The budgets of the repository's `examples/`, embedded: `(file name, YAML)`.
pub const EXAMPLES: [(&str, &str); 3] = [
    ("llm-inference.yaml", include_str!("../../examples/llm-inference.yaml")),
    ("namespace-wide.yaml", include_str!("../../examples/namespace-wide.yaml")),
    ("training-warn.yaml", include_str!("../../examples/training-warn.yaml")),
];

/// A budget of [`EXAMPLES`] by file name, moved to `namespace`.
pub fn example(file: &str, namespace: &str) -> Value {
    let (_, text) = EXAMPLES.iter().find(|(name, _)| *name == file).unwrap_or_else(|| panic!("no example {file}"));
    let mut value: Value = serde_yaml::from_str(text).expect("example parses");
    value["metadata"]["namespace"] = namespace.into();
    value
}

/// A budget of [`EXAMPLES`] by file name, moved to `namespace`, with `tweak` applied.
pub fn put_example(fake: &FakeApi, file: &str, namespace: &str, tweak: impl FnOnce(&mut Value)) {
    let mut value = example(file, namespace);
    tweak(&mut value);
    fake.put_object(value).expect("budget stored");
}

/// A process of a pod's container in the fixture `/proc` at `proc_root`: its cgroup is the kubelet's (systemd
/// driver, containerd, burstable QoS), as on a real node. The in-memory stack and the real API server tier
/// (e2e/tests/apiserver) both lay their processes out this way.
pub fn kubelet_process(proc_root: &Path, pid: u32, pod_uid: &str, container_id: &str) {
    let cgroup = format!(
        "0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{}.slice/cri-containerd-{container_id}.scope\n",
        pod_uid.replace('-', "_")
    );
    write_fake_process(proc_root, pid, 1000 + u64::from(pid), &cgroup).expect("fixture /proc");
}

/// The sample file an agent replays (`--sample-file`), in the format `gpubudget-agent capture` writes: what
/// NVML reports, GPU 0 an H100 ([`GPU_UUID`]). Each write goes to a temporary file and is renamed, so the agent
/// never reads half a file. The in-memory stack and the real API server tier write it the same way.
#[derive(Debug, Clone)]
pub struct SampleFile {
    path: PathBuf,
}

impl SampleFile {
    /// The sample file at `path` (written by the first set).
    pub fn new(path: PathBuf) -> Self {
        Self { path }
    }

    /// Where it is.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// What NVML reports now: `(pid, bytes)` on GPU 0.
    pub fn set_usage(&self, processes: &[(u32, u64)]) {
        self.write_gpu0(pid_processes(processes), None);
    }

    /// [`Self::set_usage`], with the device's own used bytes (`memory_info`: what the pressure signal reads).
    pub fn set_usage_and_device(&self, processes: &[(u32, u64)], device_used: u64) {
        self.write_gpu0(pid_processes(processes), Some(device_used));
    }

    /// Usage charged to pods by name, `(namespace, pod, container, bytes)`: no `/proc` involved.
    pub fn set_named_usage(&self, entries: &[(&str, &str, &str, u64)]) {
        let processes: Vec<Value> = entries
            .iter()
            .map(|(ns, pod, c, bytes)| json!({"namespace": ns, "pod": pod, "container": c, "used_bytes": bytes}))
            .collect();
        self.write_gpu0(processes, None);
    }

    /// Several GPUs, each `(processes as (pid, bytes), the error its sample fails with)`: GPU `i` is NVML
    /// index `i`, an H100 like GPU 0.
    pub fn set_gpus(&self, gpus: &[GpuUsage<'_>]) {
        let gpus: Vec<Value> = gpus
            .iter()
            .enumerate()
            .map(|(i, (processes, error))| {
                let mut gpu = json!({"index": i, "uuid": format!("{GPU_UUID}-{i}"), "name": GPU_NAME,
                    "memory_total_bytes": GPU_TOTAL, "processes": pid_processes(processes)});
                if let Some(error) = error {
                    gpu["error"] = (*error).into();
                }
                gpu
            })
            .collect();
        self.write(&json!({"version": 1, "gpus": gpus}));
    }

    fn write_gpu0(&self, processes: Vec<Value>, device_used: Option<u64>) {
        let mut gpu = json!({"index": 0, "uuid": GPU_UUID, "name": GPU_NAME, "memory_total_bytes": GPU_TOTAL,
            "processes": processes});
        if let Some(used) = device_used {
            gpu["memory_used_bytes"] = used.into();
        }
        self.write(&json!({"version": 1, "gpus": [gpu]}));
    }

    fn write(&self, sample: &Value) {
        let tmp = self.path.with_extension("tmp");
        std::fs::write(&tmp, sample.to_string()).expect("sample written");
        std::fs::rename(&tmp, &self.path).expect("sample renamed");
    }
}

fn pid_processes(processes: &[(u32, u64)]) -> Vec<Value> {
    processes.iter().map(|(pid, bytes)| json!({"pid": pid, "used_bytes": bytes})).collect()
}
