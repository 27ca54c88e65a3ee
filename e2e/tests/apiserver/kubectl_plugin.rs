//! `kubectl gpubudget` on a real kube-apiserver (formerly kubectl-plugin.sh): as the admin creates them by hand,
//! the CRD, budgets (two overlapping), pods carrying the agent's records (gpubudget.io/* annotations), the agent's
//! events (events.k8s.io/v1, as its Recorder publishes them) and a pod that was evicted and is gone (its events and
//! the budget's status.lastEviction remain). No agent or operator runs: the records, events and status are what
//! they would have written. Then the plugin (`kubectl-gpubudget` of the release binaries, found by kubectl on PATH)
//! runs as a tenant (a ServiceAccount with `edit` in its namespace, by token), before and after the chart's
//! `budgets-view` ClusterRole, and as the admin; what each prints is asserted, and the transcript (every command
//! and its output) is written to `GPUBUDGET_E2E_TRANSCRIPT` when set: e2e/apiserver/results/kubectl-plugin.txt,
//! which docs/kubectl-plugin.md shows.

use std::process::Command;

use gpubudget_common::GpuMemoryBudget;
use k8s_openapi::api::authorization::v1::SelfSubjectAccessReview;
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::events::v1::Event;
use kube::api::{Api, ListParams, Patch, PatchParams, PostParams};
use kube::{Client, ResourceExt};
use serde_json::{Value, json};

use crate::harness::{GI, Identity, Run, repo};

const PLUGIN: &str = "kubectl-gpubudget";

/// The run and what it printed (the transcript).
struct Plugin {
    run: Run,
    transcript: String,
}

/// What one `kubectl gpubudget` printed (stdout and stderr, in order) and its exit status.
struct Shown {
    text: String,
    code: i32,
}

impl Shown {
    /// Its lines with runs of spaces made one (a table's columns widen with the run's names).
    fn lines(&self) -> Vec<String> {
        self.text.lines().map(|l| l.split_whitespace().collect::<Vec<_>>().join(" ")).collect()
    }

    /// Fails unless a line (spaces squeezed) starts with `start`.
    fn has_line(&self, start: &str) -> String {
        let found = self.lines().into_iter().find(|l| l.starts_with(start));
        found.unwrap_or_else(|| panic!("no line starting with {start:?} in:\n{}", self.text))
    }

    /// Fails unless the text contains `part`.
    fn has(&self, part: &str) {
        assert!(self.text.contains(part), "{part:?} not in:\n{}", self.text);
    }

    /// The rows of a table (spaces squeezed) whose first cell is one of `first`: the run's pods or namespaces.
    fn rows(&self, first: &[&str]) -> Vec<String> {
        self.lines().into_iter().filter(|l| first.iter().any(|f| l.split(' ').next() == Some(f))).collect()
    }
}

impl Plugin {
    fn say(&mut self, what: &str) {
        let text = self.run.say(what);
        self.transcript.push_str(&text);
        self.transcript.push('\n');
    }

    fn info(&mut self, what: &str) {
        self.run.info(what);
        self.transcript.push_str(&format!("    {what}\n"));
    }

    /// `kubectl gpubudget <args>` as `who` (its kubeconfig), kubectl finding the plugin on PATH; prints and
    /// records it, its output and, unless 0, its exit status.
    fn show(&mut self, who: &str, kubeconfig: &str, args: &[&str]) -> Shown {
        let path = std::env::join_paths(
            std::iter::once(self.run.binaries().to_owned())
                .chain(std::env::split_paths(&std::env::var_os("PATH").unwrap_or_default())),
        )
        .expect("PATH");
        let out = Command::new("sh")
            .args(["-c", "exec kubectl gpubudget \"$@\" 2>&1", "sh"])
            .args(args)
            .env("PATH", path)
            .env("KUBECONFIG", kubeconfig)
            .output()
            .expect("kubectl runs");
        let shown =
            Shown { text: String::from_utf8_lossy(&out.stdout).into_owned(), code: out.status.code().unwrap_or(-1) };
        let mut block = format!("\n$ kubectl gpubudget {}    # as {who}\n{}", args.join(" "), shown.text);
        if shown.code != 0 {
            block.push_str(&format!("(exit status {})\n", shown.code));
        }
        print!("{block}");
        self.transcript.push_str(&block);
        shown
    }

    /// The agent's event about a pod, as its Recorder publishes it, `ago` seconds ago.
    async fn event(&self, ns: &str, pod: &str, uid: &str, reason: &str, ago: i64, note: &str) {
        let action = if reason == "EvictingForGpuMemory" { "Evict" } else { "Measure" };
        let event: Event = serde_json::from_value(json!({
            "metadata": {"generateName": format!("{pod}-"), "namespace": ns},
            "eventTime": micro_time(ago), "reportingController": "gpubudget-agent", "reportingInstance": "n1",
            "action": action, "reason": reason, "type": "Warning",
            "regarding": {"apiVersion": "v1", "kind": "Pod", "namespace": ns, "name": pod, "uid": uid},
            "note": note}))
        .expect("an event");
        Api::<Event>::namespaced(self.run.admin.clone(), ns)
            .create(&PostParams::default(), &event)
            .await
            .expect("event");
    }

    /// A running pod on n1 (container `server`, one GPU, `env`) with the agent's record: `state`, `usage` bytes,
    /// `budget`, and `extra` annotations; returns its UID.
    #[allow(clippy::too_many_arguments)] // a record's fields, each named where it is called
    async fn pod(
        &self,
        ns: &str,
        name: &str,
        app: &str,
        (state, usage, budget): (&str, u64, &str),
        env: Value,
        extra: Value,
    ) -> String {
        let mut annotations = json!({"gpubudget.io/state": state, "gpubudget.io/usage-bytes": usage.to_string(),
            "gpubudget.io/budget": budget, "gpubudget.io/node": "n1"});
        annotations.as_object_mut().expect("an object").extend(extra.as_object().cloned().unwrap_or_default());
        let pod: Pod = serde_json::from_value(json!({
            "metadata": {"name": name, "namespace": ns, "labels": {"app": app}, "annotations": annotations},
            "spec": {"nodeName": "n1", "terminationGracePeriodSeconds": 20, "containers": [{"name": "server",
                "image": "vllm/vllm-openai:v0.6", "env": env, "resources": {"limits": {"nvidia.com/gpu": "1"}}}]}}))
        .expect("a pod");
        let api = Api::<Pod>::namespaced(self.run.admin.clone(), ns);
        let pod = api.create(&PostParams::default(), &pod).await.unwrap_or_else(|e| panic!("pod {ns}/{name}: {e}"));
        let running = json!({"status": {"phase": "Running"}});
        api.patch_status(name, &PatchParams::default(), &Patch::Merge(&running)).await.expect("pod status");
        pod.uid().expect("a uid")
    }
}

/// A MicroTime `ago` seconds ago, as an event's `eventTime`.
fn micro_time(ago: i64) -> String {
    (jiff::Timestamp::now() - jiff::SignedDuration::from_secs(ago)).strftime("%Y-%m-%dT%H:%M:%S.000000Z").to_string()
}

/// A Time `ago` seconds ago.
fn time(ago: i64) -> String {
    (jiff::Timestamp::now() - jiff::SignedDuration::from_secs(ago)).strftime("%Y-%m-%dT%H:%M:%SZ").to_string()
}

/// Whether `client` may list budgets in `ns` (as `kubectl auth can-i list gpumemorybudgets.gpubudget.io`).
async fn may_list_budgets(client: &Client, ns: &str) -> bool {
    let review: SelfSubjectAccessReview = serde_json::from_value(json!({"spec": {"resourceAttributes": {
        "group": "gpubudget.io", "resource": "gpumemorybudgets", "verb": "list", "namespace": ns}}}))
    .expect("a review");
    let answer = Api::<SelfSubjectAccessReview>::all(client.clone())
        .create(&PostParams::default(), &review)
        .await
        .expect("the access review");
    answer.status.is_some_and(|s| s.allowed)
}

pub async fn tenant_and_admin() {
    let mut run = Run::start("gpubudget-kp", &[PLUGIN]).await;
    let release = format!("gpubudget-kp-{}", run.id);
    run.apply_crds().await;
    let ns_a = run.namespace(&format!("{release}-a")).await;
    let ns_b = run.namespace(&format!("{release}-b")).await;
    let mut p = Plugin { run, transcript: String::new() };
    let (a, b) = (ns_a.as_str(), ns_b.as_str());

    p.say(&format!("as the admin: the CRD, namespaces {a} and {b}, budgets, pods with records, the agent's events"));
    let version = p.run.admin.apiserver_version().await.expect("the version").git_version;
    let plugin = p.run.output(PLUGIN, &["--version"]);
    let head = Command::new("git").args(["rev-parse", "--short", "HEAD"]).current_dir(repo()).output().expect("git");
    let cores = std::thread::available_parallelism().map_or(0, usize::from);
    p.info(&format!(
        "{}; real kube-apiserver {version} (realk8s), {cores}-core VM; {} ({})",
        jiff::Timestamp::now().round(jiff::Unit::Second).expect("rounds"),
        plugin.trim(),
        String::from_utf8_lossy(&head.stdout).trim()
    ));
    for (name, ns, spec) in [
        (
            "llm-inference",
            a,
            json!({"selector": {"matchLabels": {"app": "llm"}}, "limit": "8Gi", "overLimitSeconds": 60,
                   "blockedEvictionTimeoutSeconds": 600}),
        ),
        ("team-default", a, json!({"selector": {}, "limit": "20Gi", "action": "Warn"})),
        ("other-team", b, json!({"selector": {}, "limit": "4Gi"})),
    ] {
        let budget = json!({"apiVersion": "gpubudget.io/v1alpha1", "kind": "GpuMemoryBudget",
            "metadata": {"name": name, "namespace": ns}, "spec": spec});
        p.run.apply(&budget, ns).await;
    }
    let llm = p.pod(a, "llm-0", "llm", ("Over", 9 * GI, "llm-inference"), json!([]), json!({})).await;
    let caps = json!([{"name": "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT", "value": "0=16G"},
        {"name": "NVIDIA_GPU_MEMORY_LIMIT", "value": "20480"}]);
    let ft = p.pod(a, "finetune-0", "finetune", ("Near", 19 * GI, "team-default"), caps, json!({})).await;
    p.pod(b, "b-0", "b", ("Within", GI / 2, "other-team"), json!([]), json!({})).await;
    let requested = json!({"gpubudget.io/eviction-requested-at": time(100)});
    let old = p.pod(a, "llm-1", "llm", ("Evicting", 19 * GI / 2, "llm-inference"), json!([]), requested).await;
    let budget_a = |name: &str| format!("budget {a}/{name}");
    let (team, inference) = (budget_a("team-default"), budget_a("llm-inference"));
    p.event(
        a,
        "finetune-0",
        &ft,
        "GpuMemoryNearBudget",
        300,
        &format!(
            "using 19Gi of 20Gi ({team}), at or above the 90% warning threshold; held by server (pid 4242, GPU 0) 19Gi"
        ),
    )
    .await;
    p.event(a, "llm-0", &llm, "GpuMemoryNearBudget", 60, &format!("using 7.5Gi of 8Gi ({inference}), at or above the 90% warning threshold; held by server (pid 1304, GPU 0) 7.5Gi")).await;
    p.event(
        a,
        "llm-0",
        &llm,
        "GpuMemoryOverBudget",
        25,
        &format!(
            "using 9Gi of 8Gi ({inference}); evicting if it stays over for 60s; held by server (pid 1304, GPU 0) 9Gi"
        ),
    )
    .await;
    p.event(a, "llm-1", &old, "GpuMemoryOverBudget", 160, &format!("using 9.5Gi of 8Gi ({inference}); evicting if it stays over for 60s; held by server (pid 1311, GPU 0) 9.5Gi")).await;
    p.event(a, "llm-1", &old, "EvictingForGpuMemory", 100, &format!("using 9.5Gi of 8Gi ({inference}) for 60s; evicting with the pod's 20s grace; held by server (pid 1311, GPU 0) 9.5Gi")).await;
    // What the operator writes once it counts the eviction; then the pod is gone (no kubelet here: deleted at once).
    let evicted_at = time(100);
    let status = json!({"status": {"evictions": 1,
        "lastEviction": {"pod": "llm-1", "node": "n1", "time": evicted_at, "usage": "9.5Gi"}}});
    Api::<GpuMemoryBudget>::namespaced(p.run.admin.clone(), a)
        .patch_status("llm-inference", &PatchParams::default(), &Patch::Merge(&status))
        .await
        .expect("the budget's status");
    p.run.gone(a, "llm-1", &[]).await;
    let mut budgets = Vec::new();
    for ns in [a, b] {
        for budget in Api::<GpuMemoryBudget>::namespaced(p.run.admin.clone(), ns)
            .list(&ListParams::default())
            .await
            .expect("budgets")
        {
            budgets.push(format!("{ns}/{} {}", budget.name_any(), budget.spec.limit.0));
        }
    }
    p.info(&format!("budgets: {}", budgets.join(",")));

    p.say(&format!(
        "a tenant: ServiceAccount tenant in {a} with the edit ClusterRole bound there (a RoleBinding), by token"
    ));
    p.run.tenant_with_edit(a).await;
    let token = p.run.token(a, "tenant", None).await;
    let tenant: Identity = p.run.identity_in("tenant", &token, a).await;
    let tenant_kc = tenant.path().to_owned();
    let may = may_list_budgets(&tenant.client, a).await;
    p.info(&format!("the tenant may list gpumemorybudgets in {a}: {}", if may { "yes" } else { "no" }));
    assert!(!may, "the tenant may list budgets before the budgets-view ClusterRole (another release's left over?)");
    let user = format!("system:serviceaccount:{a}:tenant");

    let top = p.show("tenant", &tenant_kc, &["top"]);
    assert_eq!(top.code, 0, "top without read access to budgets");
    top.has(&format!(
        "warning: forbidden: cannot list gpumemorybudgets.gpubudget.io in namespace {a}: RBAC does not allow it for you"
    ));
    top.has(&format!("User \"{user}\" cannot list resource \"gpumemorybudgets\""));
    top.has("LIMIT and % are left out");
    cluster_scoped_unread(&top);
    top.has_line("POD NODE USAGE LIMIT % STATE BUDGET");
    assert_eq!(
        top.rows(&["finetune-0", "llm-0", "llm-1", "b-0"]),
        ["finetune-0 n1 19Gi <unknown> - Near team-default", "llm-0 n1 9Gi <unknown> - Over llm-inference"],
        "top's rows (by usage), the limits unknown"
    );

    let why = p.show("tenant", &tenant_kc, &["why", "llm-0"]);
    assert_eq!(why.code, 0, "why without read access to budgets");
    why.has_line(&format!("Pod: {a}/llm-0 on n1 (Running)"));
    assert_eq!(why.has_line("Budget:"), "Budget: llm-inference");
    why.has_line(&format!("Why: the budgets of {a} could not be read; the agent's record names budget llm-inference"));
    why.has_line("State: Over: using 9Gi, recorded by the agent on n1");
    why.has_line("Over for:");
    why.has_line("Cap: none set at admission: the GPU container server sets none of CUDA_MPS_PINNED_DEVICE_MEM_LIMIT");
    why.has_line("Next: unknown: the budgets could not be read; the agent recorded Over under budget llm-inference");
    why.has_line(&format!("Warning: forbidden: cannot list gpumemorybudgets.gpubudget.io in namespace {a}"));
    cluster_scoped_unread(&why);
    why.has_line("Events (last 2):");
    why.has(&format!("using 7.5Gi of 8Gi ({inference}), at or above the 90% warning threshold"));
    assert_events(&why, &["GpuMemoryNearBudget", "GpuMemoryOverBudget"]);

    let top_all = p.show("tenant", &tenant_kc, &["top", "-A"]);
    assert_eq!(top_all.code, 1, "top -A as a tenant");
    top_all.has_line(
        "error: forbidden: cannot list pods at the cluster scope (all namespaces): RBAC does not allow it for you",
    );
    top_all.has("or name your namespace with -n NAMESPACE");

    let why_b = p.show("tenant", &tenant_kc, &["why", "b-0", "-n", b]);
    assert_eq!(why_b.code, 1, "why in another namespace as a tenant");
    why_b.has_line(&format!("error: forbidden: cannot get pods in namespace {b}: RBAC does not allow it for you"));
    why_b.has("ask an admin for \"get\" on \"pods\" there");

    p.say("the admin applies the chart's budgets-view ClusterRole: read access to budgets aggregated into view (so edit, admin)");
    let view = p
        .run
        .render_chart(&release, a)
        .into_iter()
        .find(|v| v["kind"] == "ClusterRole" && v["metadata"]["name"] == format!("{release}-budgets-view"))
        .expect("the chart's budgets-view ClusterRole");
    p.run.apply(&view, a).await;
    p.run.until("the edit role to aggregate the budget rule", || may_list_budgets(&tenant.client, a)).await;
    p.transcript.push_str("    ok: the edit role to aggregate the budget rule\n");

    let top = p.show("tenant", &tenant_kc, &["top", "--sort-by", "percent"]);
    assert_eq!(top.code, 0);
    budgets_read(&top);
    assert_eq!(
        top.rows(&["finetune-0", "llm-0", "llm-1", "b-0"]),
        ["llm-0 n1 9Gi 8Gi 113% Over llm-inference", "finetune-0 n1 19Gi 20Gi 95% Near team-default"],
        "top's rows by percent"
    );

    let why = p.show("tenant", &tenant_kc, &["why", "llm-0"]);
    assert_eq!(why.code, 0);
    why.has_line("Budget: llm-inference (limit 8Gi, action Evict, warnAtPercent 90, overLimitSeconds 60, blockedEvictionTimeoutSeconds 600)");
    why.has_line(&format!("Why: 2 budgets in {a} select this pod: llm-inference (8Gi), team-default (20Gi); the smallest limit applies (equal limits: the name that sorts first), so llm-inference"));
    why.has_line("State: Over: using 9Gi of 8Gi (112.5%), recorded by the agent on n1");
    // The smallest limit's budget, its rules tightened by the other's overLimitSeconds (team-default's 10 s).
    why.has(&format!("tightened by GpuMemoryBudget/{a}/team-default (overLimitSeconds)"));
    let next = why.has_line("Next: evicted at ");
    assert!(next.contains(" if still over 8Gi: over since ") && next.ends_with("; 20s grace"), "{next}");
    budgets_read(&why);
    assert_events(&why, &["GpuMemoryNearBudget", "GpuMemoryOverBudget"]);

    let gone = p.show("tenant", &tenant_kc, &["why", "llm-1"]);
    assert_eq!(gone.code, 0);
    gone.has_line(&format!("Pod: {a}/llm-1 (gone: answered from its events and the budgets' status)"));
    gone.has_line("Why: the pod is gone; budget llm-inference evicted it (its status.lastEviction names it)");
    gone.has_line("Cap: unknown: the pod spec is gone");
    gone.has_line(&format!("Next: nothing: the pod is gone, evicted at {evicted_at} using 9.5Gi on n1"));
    gone.has_line(&format!("Evicted: at {evicted_at} using 9.5Gi on n1 (the budget's status.lastEviction)"));
    assert_events(&gone, &["GpuMemoryOverBudget", "EvictingForGpuMemory"]);

    let yaml = p.show("tenant", &tenant_kc, &["why", "finetune-0", "-o", "yaml"]);
    assert_eq!(yaml.code, 0);
    let doc: Value = serde_yaml::from_str(&yaml.text).expect("why -o yaml is YAML");
    assert_eq!(doc["apiVersion"], "kubectl-gpubudget.gpubudget.io/v1");
    assert_eq!(doc["kind"], "GpuMemoryWhy");
    assert_eq!(
        (&doc["pod"]["exists"], &doc["pod"]["phase"], &doc["pod"]["uid"]),
        (&json!(true), &json!("Running"), &json!(ft))
    );
    assert_eq!((&doc["budget"]["name"], &doc["budget"]["limitBytes"]), (&json!("team-default"), &json!(20 * GI)));
    assert_eq!(doc["budget"]["spec"]["action"], "Warn");
    assert_eq!(
        (&doc["record"]["state"], &doc["record"]["usageBytes"], &doc["record"]["percent"]),
        (&json!("Near"), &json!(19 * GI), &json!(95.0))
    );
    let caps: Vec<(Value, Value, Value)> = doc["admission"]["caps"]
        .as_array()
        .expect("caps")
        .iter()
        .map(|c| (c["container"].clone(), c["variable"].clone(), c["bytes"].clone()))
        .collect();
    assert_eq!(
        caps,
        [
            (json!("server"), json!("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"), json!(16 * GI)),
            (json!("server"), json!("NVIDIA_GPU_MEMORY_LIMIT"), json!(20 * GI)),
        ],
        "the admission caps read from the pod spec"
    );
    assert_eq!(doc["next"]["action"], "Nothing");
    assert!(
        doc["next"]["message"].as_str().is_some_and(|m| m.contains("never evicted: the budget's action is Warn")),
        "{}",
        doc["next"]
    );
    let reasons: Vec<&Value> = doc["events"].as_array().expect("events").iter().map(|e| &e["reason"]).collect();
    assert_eq!(reasons, [&json!("GpuMemoryNearBudget")]);

    let nope = p.show("tenant", &tenant_kc, &["why", "nope"]);
    assert_eq!(nope.code, 1, "why of a pod nothing names");
    nope.has_line(&format!("error: pod nope not found in namespace {a}, and no event or budget names it"));

    p.say("as the admin, cluster-wide");
    let admin_kc = std::env::var("KUBECONFIG").expect("KUBECONFIG");
    let top = p.show("admin", &admin_kc, &["top", "-A"]);
    assert_eq!(top.code, 0);
    top.has_line("NAMESPACE POD NODE USAGE LIMIT % STATE BUDGET");
    assert_eq!(
        top.rows(&[a, b]),
        [
            format!("{a} finetune-0 n1 19Gi 20Gi 95% Near team-default"),
            format!("{a} llm-0 n1 9Gi 8Gi 113% Over llm-inference"),
            format!("{b} b-0 n1 512Mi 4Gi 13% Within other-team"),
        ],
        "top -A's rows of the run's namespaces"
    );
    let json = p.show("admin", &admin_kc, &["top", "-A", "-l", "app=llm", "-o", "json"]);
    assert_eq!(json.code, 0);
    let doc: Value = serde_json::from_str(&json.text).expect("top -o json is JSON");
    assert_eq!(
        (&doc["apiVersion"], &doc["kind"]),
        (&json!("kubectl-gpubudget.gpubudget.io/v1"), &json!("GpuMemoryTop"))
    );
    let mine: Vec<&Value> =
        doc["pods"].as_array().expect("pods").iter().filter(|p| p["namespace"] == a || p["namespace"] == b).collect();
    assert_eq!(
        mine,
        [&json!({"namespace": a, "name": "llm-0", "node": "n1", "state": "Over", "usageBytes": 9 * GI, "usage": "9Gi",
                 "budget": "llm-inference", "limitBytes": 8 * GI, "limit": "8Gi", "percent": 112.5})],
        "top -A -l app=llm -o json: the run's pods"
    );
    let elapsed = p.run.elapsed();
    p.say(&format!("PASS: the tenant before and after budgets-view, the admin cluster-wide ({elapsed} s)"));
    if let Some(path) = std::env::var_os("GPUBUDGET_E2E_TRANSCRIPT") {
        let text = p.transcript.trim_start_matches('\n').to_owned();
        std::fs::write(&path, text).unwrap_or_else(|e| panic!("the transcript to {}: {e}", path.to_string_lossy()));
    }
}

/// Fails unless the output tells the tenant that the cluster-scoped kinds could not be read: a namespace's
/// RoleBinding of `edit` grants nothing on them, with the chart's budgets-view ClusterRole or without.
fn cluster_scoped_unread(shown: &Shown) {
    shown.has("forbidden: cannot list clustergpumemorybudgets.gpubudget.io at the cluster scope (all namespaces)");
    shown.has("gpunodeusages.gpubudget.io at the cluster scope (all namespaces): RBAC does not allow it for you");
}

/// Fails unless the output read the namespace's budgets (and still not the cluster-scoped kinds).
fn budgets_read(shown: &Shown) {
    assert!(
        !shown.text.contains("cannot list gpumemorybudgets.gpubudget.io"),
        "the budgets unread with read access to them:\n{}",
        shown.text
    );
    cluster_scoped_unread(shown);
}

/// Fails unless the output's "Events" table lists these reasons, in this order.
fn assert_events(shown: &Shown, reasons: &[&str]) {
    let lines = shown.lines();
    let start = lines
        .iter()
        .position(|l| l.starts_with("Events (last"))
        .unwrap_or_else(|| panic!("no events in:\n{}", shown.text));
    let listed: Vec<&str> = lines[start + 2..].iter().filter_map(|l| l.split(' ').nth(2)).collect();
    assert_eq!(listed, reasons, "the events listed in:\n{}", shown.text);
}
