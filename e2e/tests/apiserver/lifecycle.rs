//! The chart's lifecycle (issue 24, part 3; formerly lifecycle.sh): `helm install` → `helm upgrade` (new image
//! tags, changed values) → `helm rollback` → `helm uninstall`, with Helm itself, while budgets are enforced:
//! - every step succeeds and keeps every budget, its spec and its status (evictions, lastEviction) as they were;
//! - a rollout of the agent and of the operator (the release binaries run on this machine out of cluster, so a
//!   rollout is a stop and a start of them, with the new values) in the middle of an eviction's grace period and
//!   of another pod's overLimitSeconds: no pod is evicted twice, none early, a Warn budget's pod and a pod of
//!   another node never; each eviction is counted once;
//! - after uninstall no ValidatingWebhookConfiguration, ValidatingAdmissionPolicy or binding, ClusterRole or
//!   ClusterRoleBinding of the release remains; what stays is what docs/operations.md says stays: the CRD, the
//!   budgets with their status, the pods' gpubudget.io/ records.
//!
//! Helm installs a copy of the chart whose kubeVersion admits the 1.32 control plane of /work/shared/realk8s
//! ([`Run::chart_admitting_1_32`]), with a post-renderer that puts the eviction webhook in URL mode on the operator
//! at 127.0.0.1 ([`Run::url_mode_post_renderer`]; no kube-proxy carries a Service here).
//!
//! Across versions (#34): `GPUBUDGET_E2E_FROM=<dir>` holding an older release's `bin/gpubudget-{agent,operator}`
//! and `chart/` installs that version first; the upgrade applies this checkout's CRDs (docs/operations.md: Helm
//! never upgrades them) and moves to this chart and these binaries; the rollback returns to the older ones. The
//! same checks hold both ways: the older agent's Evicting record is neither forgotten nor acted on twice.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::time::Duration;

use gpubudget_demo::stack::example;
use k8s_openapi::api::apps::v1::DaemonSet;
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::{Api, ApiResource, DynamicObject, ListParams};
use kube::core::GroupVersionKind;
use kube::discovery::pinned_kind;
use serde_json::{Value, json};

use crate::harness::{Binary, GI, Identity, OperatorRun, Run, annotation, repo, table};

const AGENT: &str = "gpubudget-agent";
const OPERATOR: &str = "gpubudget-operator";
const CRD: &str = "gpumemorybudgets.gpubudget.io";

/// The run, its names, identities and the release binaries running now (a rollout stops and starts them).
struct Lifecycle {
    // The binaries first: they stop before the run deletes what they work on.
    operator: Option<Binary>,
    agent: Option<Binary>,
    run: Run,
    ns: String,
    ns_a: String,
    node: String,
    release: String,
    post_renderer: PathBuf,
    operator_id: Identity,
    agent_id: Identity,
    runs: u32,
}

impl Lifecycle {
    /// The operator, then the agent, as a rollout starts a new "pod" of each (`interval`: the agent's).
    async fn start_binaries(&mut self, interval: &str) {
        self.runs += 1;
        let runs = self.runs;
        let (admin, webhook) = (self.run.addr(1), self.run.addr(2));
        let (pod, log) = (format!("operator-{runs}"), format!("operator-{runs}.log"));
        let operator = self.run.spawn_operator(&OperatorRun {
            identity: &self.operator_id,
            ns: &self.ns,
            pod: &pod,
            admin: &admin,
            webhook: Some(&webhook),
            extra: &[],
            rust_log: "info",
            log: &log,
        });
        self.run.ready(&format!("operator ready (run {runs})"), &admin).await;
        self.operator = Some(operator);
        let (log, agent_admin) = (format!("agent-{runs}.log"), self.run.addr(0));
        let (extra, env) = (["--interval", interval], [("RUST_LOG", "info")]);
        let agent = self.run.start_agent(&self.agent_id, &self.node, &agent_admin, &extra, &env, &log).await;
        self.agent = Some(agent);
        self.run.info(&format!("run {runs}: the operator as pod operator-{runs}, the agent every {interval}"));
    }

    /// The rollout stops the old pods (SIGTERM, as the kubelet does): the agent, then the operator; prints how long
    /// each took to exit (the operator keeps serving its webhook for its 5 s drain). Returns when the agent had
    /// stopped: from then on no old binary evicts (the operator only answers the agent's evictions).
    fn stop_binaries(&mut self) -> jiff::Timestamp {
        let stop = |binary: Option<Binary>| {
            let stopping = std::time::Instant::now();
            if let Some(mut binary) = binary {
                binary.stop();
            }
            stopping.elapsed().as_secs_f64()
        };
        let agent_took = stop(self.agent.take());
        let agent_stopped = jiff::Timestamp::now();
        let operator_took = stop(self.operator.take());
        self.run
            .info(&format!("stopped (SIGTERM): the agent in {agent_took:.1} s, the operator in {operator_took:.1} s"));
        agent_stopped
    }

    /// What NVML reports: first (4201), second (4202), trainer (4203) and remote (4204: sampled here, its pod on the
    /// other node) at 20Gi.
    fn sample(&self, first: u64, second: u64, trainer: u64) {
        self.run.sample().set_usage(&[(4201, first), (4202, second), (4203, trainer), (4204, 20 * GI)]);
    }

    /// `helm <args>`; fails on a failure; its stdout.
    fn helm(&self, args: &[&str]) -> String {
        helm(&self.run, args)
    }

    /// Prints the first `n` lines of `text`, indented.
    fn show(&self, text: &str, n: usize) {
        for line in text.lines().take(n) {
            self.run.info(line);
        }
    }

    /// How many times the agent's logs (every run) say it asked for `pod`'s eviction and the API server accepted it.
    fn accepted(&self, pod: &str) -> usize {
        (1..=self.runs)
            .map(|k| std::fs::read_to_string(self.run.file(&format!("agent-{k}.log"))).unwrap_or_default())
            .map(|log| log.lines().filter(|l| l.contains("eviction requested and accepted") && l.contains(pod)).count())
            .sum()
    }

    /// The budgets' specs and status that must survive every step (condition times and observedGeneration aside),
    /// by name.
    async fn budgets_state(&self) -> Vec<Value> {
        let gvk = GroupVersionKind::gvk("gpubudget.io", "v1alpha1", "GpuMemoryBudget");
        let resource = ApiResource::from_gvk_with_plural(&gvk, "gpumemorybudgets");
        let api = Api::<DynamicObject>::namespaced_with(self.run.admin.clone(), &self.ns_a, &resource);
        let mut budgets: Vec<Value> = api
            .list(&ListParams::default())
            .await
            .expect("budgets")
            .items
            .into_iter()
            .map(|b| {
                let status = &b.data["status"];
                let conditions: Vec<Value> = status["conditions"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .map(|c| json!({"type": c["type"], "status": c["status"], "reason": c["reason"]}))
                    .collect();
                json!({"name": b.metadata.name, "uid": b.metadata.uid, "spec": b.data["spec"],
                    "evictions": status["evictions"], "lastEviction": status["lastEviction"],
                    "podsOverBudget": status["podsOverBudget"], "conditions": conditions})
            })
            .collect();
        budgets.sort_by_key(|b| b["name"].as_str().unwrap_or_default().to_owned());
        budgets
    }

    /// The agent DaemonSet's image.
    async fn agent_image(&self) -> String {
        let ds = Api::<DaemonSet>::namespaced(self.run.admin.clone(), &self.ns)
            .get(&format!("{}-agent", self.release))
            .await
            .expect("the agent DaemonSet");
        let spec = ds.spec.and_then(|s| s.template.spec).expect("a pod template");
        spec.containers[0].image.clone().unwrap_or_default()
    }

    async fn record(&self, pod: &str, key: &str) -> Option<String> {
        annotation(&self.run.pod(&self.ns_a, pod).await, key)
    }

    async fn evictions_are(&self, name: &str, n: i64, what: &str) {
        self.run.budget_until(&self.ns_a, name, what, |b| b.status.as_ref().is_some_and(|s| s.evictions == n)).await;
    }
}

/// The release's cluster-scoped admission and RBAC objects, `Kind/name`, sorted.
async fn release_cluster_objects(run: &Run, release: &str) -> Vec<String> {
    let mut objects = Vec::new();
    for (group, kind) in [
        ("admissionregistration.k8s.io", "ValidatingWebhookConfiguration"),
        ("admissionregistration.k8s.io", "ValidatingAdmissionPolicy"),
        ("admissionregistration.k8s.io", "ValidatingAdmissionPolicyBinding"),
        ("rbac.authorization.k8s.io", "ClusterRole"),
        ("rbac.authorization.k8s.io", "ClusterRoleBinding"),
    ] {
        let list = list(run, group, "v1", kind, None, &ListParams::default()).await;
        objects.extend(list.into_iter().filter(|name| name.starts_with(release)).map(|name| format!("{kind}/{name}")));
    }
    objects.sort();
    objects
}

/// The names of the objects of a kind (in `ns`, else cluster-wide) that `params` select.
async fn list(run: &Run, group: &str, version: &str, kind: &str, ns: Option<&str>, params: &ListParams) -> Vec<String> {
    let (resource, _) =
        pinned_kind(&run.admin, &GroupVersionKind::gvk(group, version, kind)).await.expect("a served kind");
    let api = match ns {
        Some(ns) => Api::<DynamicObject>::namespaced_with(run.admin.clone(), ns, &resource),
        None => Api::<DynamicObject>::all_with(run.admin.clone(), &resource),
    };
    let list = api.list(params).await.unwrap_or_else(|e| panic!("listing {kind}: {e}"));
    list.items.into_iter().filter_map(|o| o.metadata.name).collect()
}

/// `helm <args>`; fails on a failure; its stdout.
fn helm(run: &Run, args: &[&str]) -> String {
    let (ok, stdout, stderr) = run.helm_args(args);
    assert!(ok, "helm {}: {stdout}{stderr}", args.join(" "));
    stdout
}

/// `helm <verb> <release> <chart> -n <ns> --post-renderer <URL mode> <args>` (install, upgrade); its stdout.
fn helm_chart(run: &Run, verb: &str, release: &str, chart: &Path, ns: &str, post: &Path, args: &[&str]) -> String {
    let (chart, post) = (chart.to_str().expect("utf-8"), post.to_str().expect("utf-8"));
    let mut all = vec![verb, release, chart, "-n", ns, "--post-renderer", post];
    all.extend_from_slice(args);
    helm(run, &all)
}

pub async fn chart_lifecycle() {
    let mut run = Run::start("gpubudget-lc", &[AGENT, OPERATOR]).await;
    let id = run.id.clone();
    let release = format!("gpubudget-lc-{id}");
    let this_bin = run.binaries().to_owned();
    run.info(&format!("helm: {}  binaries: {}", run.helm_version(), this_bin.display()));

    run.say("the chart as installed here: a copy admitting 1.32, a post-renderer for the webhook's URL mode");
    let chart = run.chart_admitting_1_32(&repo().join("charts/gpubudget"), "chart");
    let from = std::env::var_os("GPUBUDGET_E2E_FROM").map(PathBuf::from);
    let (first_chart, first_bin) = match &from {
        Some(from) => {
            let bin = from.join("bin");
            assert!(
                bin.join(AGENT).is_file() && bin.join(OPERATOR).is_file() && from.join("chart/Chart.yaml").is_file(),
                "GPUBUDGET_E2E_FROM={} needs bin/{AGENT}, bin/{OPERATOR} and chart/",
                from.display()
            );
            let version = std::process::Command::new(bin.join(AGENT)).arg("--version").output().expect("runs");
            run.info(&format!(
                "across versions: install {} (agent {}), upgrade to this checkout",
                from.display(),
                String::from_utf8_lossy(&version.stdout).trim()
            ));
            (run.chart_admitting_1_32(&from.join("chart"), "chart-from"), bin)
        }
        None => (chart.clone(), this_bin.clone()),
    };
    run.use_binaries(first_bin.clone());
    let tls = run.webhook_cert();
    let post_renderer = run.url_mode_post_renderer(&run.addr(2), &tls.join("ca.crt"));
    run.owns_release(&release);

    run.say("helm install (revision 1: image tag 0.1.0, interval 250ms)");
    let ns = run.namespace(&release).await; // the release's namespace
    let ns_a = run.namespace(&format!("{release}-a")).await; // the tenant's pods and budgets
    let node = format!("{release}-n1");
    let node2 = format!("{release}-n2");
    let tags = ["--set", "agent.image.tag=0.1.0", "--set", "operator.image.tag=0.1.0"];
    let out = helm_chart(&run, "install", &release, &first_chart, &ns, &post_renderer, &tags);
    for line in out.lines() {
        run.info(line);
    }
    run.crd_established(CRD).await;
    let installed = release_cluster_objects(&run, &release).await;
    for object in &installed {
        run.info(object);
    }
    // As many admission policies as bindings, as the chart renders them (the node restriction's, the records', the
    // caps record's: their number grew with the issues), and the eviction webhook.
    let count = |prefix: &str| installed.iter().filter(|o| o.starts_with(prefix)).count();
    let policies = count("ValidatingAdmissionPolicy/");
    let manifest = helm(&run, &["get", "manifest", &release, "-n", &ns]);
    let rendered = serde_yaml::Deserializer::from_str(&manifest)
        .filter_map(|doc| <Value as serde::Deserialize>::deserialize(doc).ok())
        .filter(|object| object["kind"] == "ValidatingAdmissionPolicy")
        .count();
    assert!(policies >= 3 && policies == rendered, "{policies} admission policies installed, {rendered} rendered");
    assert_eq!(count("ValidatingAdmissionPolicyBinding/"), policies, "a policy without its binding");
    assert!(count("ValidatingWebhookConfiguration/") > 0, "no webhook configuration");

    run.say("nodes, pods (API objects; the test is their kubelet), the binaries with the chart's identities");
    let node_uid = run.node(&node).await;
    run.node(&node2).await;
    let pods = [
        ("first", node.as_str(), ("app", "llm"), 4201), // llm-inference (Evict, 8Gi, 10 s, grace 30 s): evicted before the upgrade
        ("second", &node, ("app", "llm"), 4202), // goes over just before the upgrade: its 10 s run across the rollout
        ("trainer", &node, ("job-type", "training"), 4203), // training-audit (Warn, 40Gi): over all along, never evicted
        ("remote", &node2, ("app", "llm"), 4204),           // another node's pod: never this agent's
    ];
    for (name, on, label, pid) in pods {
        let uid = run.make_pod(&ns_a, name, on, &[label]).await;
        run.process(pid, &ns_a, name, &uid);
    }
    let operator_id = run.chart_operator(&ns, &release).await;
    let agent_id = run.chart_agent(&ns, &release, (&node, &node_uid), "agent").await;
    let mut lc = Lifecycle {
        operator: None,
        agent: None,
        run,
        ns,
        ns_a,
        node,
        release,
        post_renderer,
        operator_id,
        agent_id,
        runs: 0,
    };
    lc.sample(2 * GI, 2 * GI, 45 * GI);
    lc.start_binaries("250ms").await;
    for file in ["llm-inference.yaml", "training-warn.yaml"] {
        let budget = example(file, &lc.ns_a);
        lc.run.apply(&budget, &lc.ns_a).await;
        let name = budget["metadata"]["name"].as_str().unwrap_or_default();
        lc.run.info(&format!("gpumemorybudget {}/{name} applied", lc.ns_a));
    }

    lc.run.say("enforcement before the upgrade: first evicted (grace 30 s), trainer over (Warn)");
    lc.sample(9 * GI, 2 * GI, 45 * GI);
    let ns_a = lc.ns_a.clone();
    lc.run.terminating(&ns_a, "first").await;
    lc.run.record_is(&ns_a, "trainer", "state", "Over").await;
    lc.evictions_are("llm-inference", 1, "llm-inference EVICTED 1").await;
    let requested_at = lc.record("first", "eviction-requested-at").await.expect("eviction-requested-at on first");
    lc.run
        .budget_until(&ns_a, "training-audit", "training-audit OVER 1", |b| {
            b.status.as_ref().is_some_and(|s| s.pods_over_budget == 1)
        })
        .await;
    let before = lc.budgets_state().await;

    lc.run.say(
        "second goes over; helm upgrade (revision 2: tag 0.2.0, interval 500ms, log text) and the rollout within its \
         10 s and first's grace",
    );
    lc.sample(9 * GI, 9 * GI, 45 * GI);
    lc.run.event(&ns_a, "second", "GpuMemoryOverBudget").await;
    let over_second = jiff::Timestamp::now();
    if from.is_some() {
        // docs/operations.md: Helm installs a chart's CRDs on first install only; an upgrade applies them first.
        lc.run.apply_crds().await;
        lc.run.info("this checkout's CRDs applied (server-side)");
    }
    // Not --reuse-values: a newer chart's new values would be missing (Helm does not merge its defaults then).
    let upgrade = [
        "--set",
        "agent.image.tag=0.2.0",
        "--set",
        "operator.image.tag=0.2.0",
        "--set",
        "agent.interval=500ms",
        "--set",
        "logFormat=text",
    ];
    let (release, ns) = (lc.release.clone(), lc.ns.clone());
    let upgrading = std::time::Instant::now();
    let out = helm_chart(&lc.run, "upgrade", &release, &chart, &ns, &lc.post_renderer, &upgrade);
    let upgrade_took = upgrading.elapsed().as_secs_f64();
    lc.show(&out, 3);
    let image = lc.agent_image().await;
    assert_eq!(
        image, "example.invalid/gpubudget/gpubudget-agent:0.2.0",
        "the agent DaemonSet's image after the upgrade"
    );
    assert!(lc.run.is_terminating(&ns_a, "first").await, "first is not in its grace period at the rollout");
    let stopping = std::time::Instant::now();
    let agent_stopped = lc.stop_binaries();
    let (rolled, stop_took) = (jiff::Timestamp::now(), stopping.elapsed().as_secs_f64());
    // Else the old agent evicted second before the rollout, and the story did not test what it says.
    assert!(
        !lc.run.is_terminating(&ns_a, "second").await,
        "second evicted before the rollout (the upgrade took too long)"
    );
    lc.run.use_binaries(this_bin.clone());
    lc.start_binaries("500ms").await;
    let since_over = |t: jiff::Timestamp| (t - over_second).get_seconds();
    lc.run.info(&format!(
        "rollout: the old agent stopped {:.1} s after second went over (of its overLimitSeconds 10; helm upgrade \
         {upgrade_took:.1} s), the old operator {} s after (the stop {stop_took:.1} s: its SIGTERM drain); first \
         still in its grace",
        (agent_stopped - over_second).total(jiff::Unit::Second).expect("a span in seconds"),
        since_over(rolled)
    ));
    assert!(
        !(lc.run.is_terminating(&ns_a, "second").await && since_over(jiff::Timestamp::now()) < 10),
        "second evicted before overLimitSeconds"
    );
    let what = "second terminating (after the rollout, its timer started afresh)";
    let second = lc.run.pod_until(&ns_a, "second", what, crate::harness::is_terminating).await;
    let deletion = second.metadata.deletion_timestamp.expect("terminating").0;
    let grace = second.metadata.deletion_grace_period_seconds.expect("a grace period");
    let evicted_after = since_over(deletion) - grace;
    assert!(evicted_after >= 9, "second evicted {evicted_after}s after going over (overLimitSeconds 10)");
    lc.run.info(&format!(
        "second evicted {evicted_after}s after going over (overLimitSeconds 10; a restart can only delay)"
    ));
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(lc.accepted("first"), 1, "accepted evictions of first across the rollout");
    assert_eq!(
        lc.run.occurrences(&ns_a, "first", "EvictingForGpuMemory").await,
        1,
        "EvictingForGpuMemory on first repeated"
    );
    assert_eq!(
        lc.record("first", "eviction-requested-at").await.as_deref(),
        Some(requested_at.as_str()),
        "first's eviction-requested-at changed"
    );
    if from.is_some() {
        // #34: the new agent publishes the node's usage in its GpuNodeUsage; the older one's records were read as
        // its own.
        let gvk = GroupVersionKind::gvk("gpubudget.io", "v1alpha1", "GpuNodeUsage");
        let api = Api::<DynamicObject>::all_with(lc.run.admin.clone(), &ApiResource::from_gvk(&gvk));
        let what = "the node's GpuNodeUsage, written by the upgraded agent";
        let usage = lc.run.object_until(api, &lc.node, what, |_| true).await;
        let spec = &usage.data["spec"];
        let total = spec["total"].as_str().unwrap_or_default();
        lc.run.info(&format!("GpuNodeUsage {}: {} pods, {total} in all", lc.node, spec["podCount"]));
    }
    lc.evictions_are("llm-inference", 2, "llm-inference EVICTED 2 (first, second: each once)").await;

    lc.run.say("the kubelet's part: first and second exit, their pods are deleted");
    lc.sample(0, 0, 45 * GI);
    lc.run.gone(&ns_a, "first", &[4201]).await;
    lc.run.gone(&ns_a, "second", &[4202]).await;
    tokio::time::sleep(Duration::from_secs(3)).await;
    let evictions = lc.run.budget(&ns_a, "llm-inference").await.status.map(|s| s.evictions);
    assert_eq!(evictions, Some(2), "llm-inference's count once its pods are gone");
    let upgraded = lc.budgets_state().await;
    // Across versions a newer operator may add a condition the older one never wrote (NodesCurrent came with the
    // mirrors, #34): nothing of the older status may change or go, and what was added is said.
    let known = condition_types(&before);
    let added: BTreeSet<String> = condition_types(&upgraded).difference(&known).cloned().collect();
    if !added.is_empty() {
        lc.run.info(&format!("conditions this version adds to the older status: {added:?}"));
    }
    let named = |state: &[Value], name: &str| state.iter().find(|b| b["name"] == name).cloned();
    assert_eq!(
        named(&before, "training-audit"),
        named(&only_conditions(&upgraded, &known), "training-audit"),
        "training-audit changed across the upgrade"
    );
    let uids = |state: &[Value]| state.iter().map(|b| b["uid"].clone()).collect::<Vec<_>>();
    assert_eq!(uids(&before), uids(&upgraded), "a budget was recreated across the upgrade");

    lc.run.say("helm rollback to revision 1, and its rollout");
    let out = lc.helm(&["rollback", &lc.release, "1", "-n", &lc.ns]);
    lc.show(&out, 3);
    let image = lc.agent_image().await;
    assert_eq!(
        image, "example.invalid/gpubudget/gpubudget-agent:0.1.0",
        "the agent DaemonSet's image after the rollback"
    );
    lc.stop_binaries();
    lc.run.use_binaries(first_bin);
    lc.start_binaries("250ms").await;
    tokio::time::sleep(Duration::from_secs(5)).await;
    let rolled_back = lc.budgets_state().await;
    // The older operator keeps what it knows and drops what it does not (a condition it cannot keep current).
    assert_eq!(only_conditions(&upgraded, &known), rolled_back, "budgets or their status changed across the rollback");
    assert_eq!(
        release_cluster_objects(&lc.run, &lc.release).await,
        installed,
        "the cluster-scoped objects differ after the rollback"
    );
    assert!(!lc.run.is_terminating(&ns_a, "trainer").await, "trainer (Warn) was evicted");
    assert!(!lc.run.is_terminating(&ns_a, "remote").await, "remote (another node) was evicted");
    assert_eq!(lc.record("remote", "state").await, None, "remote got a record from this agent");
    let history = lc.helm(&["history", &lc.release, "-n", &lc.ns]);
    lc.show(&history, usize::MAX);

    lc.run.say("helm uninstall: what goes, what stays");
    lc.stop_binaries();
    let out = lc.helm(&["uninstall", &lc.release, "-n", &lc.ns]);
    lc.show(&out, usize::MAX);
    let left = release_cluster_objects(&lc.run, &lc.release).await;
    assert!(left.is_empty(), "left behind by helm uninstall: {left:?}");
    lc.run.info(&format!(
        "gone: webhook configuration, {policies} admission policies and their bindings, ClusterRoles and bindings of {}",
        lc.release
    ));
    let selector = ListParams::default().labels(&format!("app.kubernetes.io/instance={}", lc.release));
    for (group, kind) in [
        ("apps", "DaemonSet"),
        ("apps", "Deployment"),
        ("", "ServiceAccount"),
        ("rbac.authorization.k8s.io", "Role"),
        ("rbac.authorization.k8s.io", "RoleBinding"),
        ("", "Secret"),
        ("", "Service"),
        ("policy", "PodDisruptionBudget"),
    ] {
        let left = list(&lc.run, group, "v1", kind, Some(&lc.ns), &selector).await;
        assert!(left.is_empty(), "{kind} of the release left in {}: {left:?}", lc.ns);
    }
    let crds = Api::<CustomResourceDefinition>::all(lc.run.admin.clone());
    assert!(
        crds.get_opt(CRD).await.expect("CRDs read").is_some(),
        "the CRD was removed (docs/operations.md: helm uninstall leaves it)"
    );
    let uninstalled = lc.budgets_state().await;
    assert_eq!(rolled_back, uninstalled, "budgets or their status changed with the uninstall");
    assert_eq!(lc.record("trainer", "state").await.as_deref(), Some("Over"), "trainer's record is gone");
    let kept: Vec<String> = uninstalled
        .iter()
        .map(|b| {
            format!("{} (evictions {})", b["name"].as_str().unwrap_or_default(), b["evictions"].as_i64().unwrap_or(0))
        })
        .collect();
    lc.run
        .info(&format!("stays (documented): CRD {CRD}, budgets {}, the pods' gpubudget.io/ records", kept.join(", ")));
    let (columns, rows) =
        table(&lc.run.admin, &format!("/apis/gpubudget.io/v1alpha1/namespaces/{ns_a}/gpumemorybudgets")).await;
    lc.run.info(&columns.join(" | "));
    for row in rows {
        lc.run.info(&row.join(" | "));
    }

    lc.run.say(&format!(
        "PASS: install, upgrade (rollout mid grace and mid overLimitSeconds: one eviction each, none early), rollback, \
         uninstall (nothing admission- or RBAC-related left; CRD, budgets, status, records stay) ({} s)",
        lc.run.elapsed()
    ));
}

/// The condition types a [`Lifecycle::budgets_state`] holds.
fn condition_types(state: &[Value]) -> BTreeSet<String> {
    state
        .iter()
        .flat_map(|b| b["conditions"].as_array().into_iter().flatten())
        .filter_map(|c| c["type"].as_str().map(str::to_owned))
        .collect()
}

/// `state` with only the conditions of the types in `known`.
fn only_conditions(state: &[Value], known: &BTreeSet<String>) -> Vec<Value> {
    let mut state = state.to_vec();
    for budget in &mut state {
        if let Some(conditions) = budget["conditions"].as_array_mut() {
            conditions.retain(|c| c["type"].as_str().is_some_and(|t| known.contains(t)));
        }
    }
    state
}
