//! Budgets whose limit is each pod's declared share (issue 44; formerly shares.sh): the chart's RBAC, admission
//! policies, caps webhook and eviction webhook (URL mode), the operator (status, the webhooks) and one agent
//! (token bound to its Node, GPU usage replayed from a sample file: the demo's H100, 79.6 GiB). Pods shaped as
//! KAI-Scheduler, HAMi and the NVIDIA device plugin leave them (common/tests/fixtures/shares/), created by a tenant
//! (`edit` in its namespace, the admin impersonating it) and bound by a Binding (KAI's) or spec.nodeName (no
//! scheduler: the API server checks no Node capacity for them).
//! 1. a GpuMemoryBudget `shares` {selector: {}, limit: 80Gi, share: {}, admissionCaps: Enabled, overLimitSeconds:
//!    10};
//! 2. the tenant's pods: kai-half (gpu-fraction "0.5") and kai-quarter ("0.25"), schedulerName kai-scheduler, no
//!    GPU resource, NVIDIA_VISIBLE_DEVICES from a ConfigMap (valueFrom) and an envFrom ConfigMap, as KAI's webhook
//!    and binder leave them; hami (nvidia.com/gpu: 1, nvidia.com/gpumem: 10240, as HAMi's scheduler leaves it);
//!    kai-nan (gpu-fraction "NaN", which KAI's own webhook admits);
//! 3. at admission (the operator's webhook): hami gets CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=10240M and
//!    NVIDIA_GPU_MEMORY_LIMIT=10240 (its absolute share, not the 80Gi limit); the KAI pods (a fraction: capped at
//!    the limit) are recorded uncapped, with the reason (their devices come from a ConfigMap);
//! 4. the agent resolves and records each share (`gpubudget.io/share`), tells kai-nan's once
//!    (GpuMemoryShareUnresolved); the budget's status: SHARE `KAI gpu-fraction 2, HAMi gpumem 1, unresolved 1`
//!    (by source, in the CRD's order), podsOnShare 3, podsShareUnresolved 1, CAPPED 1, UNCAPPED 3;
//! 5. kai-half at 44Gi (over its 39.8Gi share, within the 80Gi limit) and hami at 12Gi (over its 10Gi): Over, the
//!    messages naming the shares, both evicted 10 s later (hami's MPS cap told not in force, #32: counted
//!    uncapped from then on); kai-quarter at 15Gi of its 19.9Gi: no event;
//! 6. a plain budget {selector: {}, limit: 30Gi} added: the smallest limit wins with shares: kai-quarter stays
//!    under `shares` (its 19.9Gi share < 30Gi), kai-nan (unresolved: held to 80Gi) moves to the plain one; both
//!    budgets' status; `kubectl gpubudget why kai-quarter` (its Share: line) and `kubectl gpubudget top`;
//! 7. the Node labelled as GPU feature discovery labels it for MPS (sharing-strategy mps, replicas 4) and a pod
//!    asking nvidia.com/gpu: 1 at 22Gi: the agent (not restarted) reads the labels within its 60 s period and
//!    holds the pod to "MPS replica of 4 per GPU of 79.6Gi = 19.9Gi" (Over); the time from the label to the Over
//!    event.
//!
//! (kai-half had to go before the plain budget came: its 39.8Gi share is larger than 30Gi, so the plain budget
//! would hold it, rightly, and its messages would not name its share.)
//!
//! The script replayed an 80 GiB card; a KAI fraction and an MPS replica are of the card's memory, so here 0.5 is
//! 39.8Gi, 0.25 and a replica of 4 19.9Gi where the script's figures were 40Gi and 20Gi.

use std::time::{Duration, Instant};

use gpubudget_common::share::ShareSource;
use gpubudget_common::{GpuMemoryBudget, GpuNodeUsage};
use gpubudget_demo::stack::{GPU_TOTAL, GPU_UUID};
use k8s_openapi::api::core::v1::{ConfigMap, Namespace, Node, Pod};
use kube::api::{Api, Patch, PatchParams, PostParams};
use kube::{Client, ResourceExt};
use serde_json::{Value, json};

use crate::harness::{
    GI, RBAC_AND_POLICIES, ReleaseBinaries, Run, Workloads, annotation, bind, binding, caps_record, env_of, held_share,
    held_to, is_terminating, share_fixture, wide_table,
};

/// The kubectl plugin.
const PLUGIN: &str = "kubectl-gpubudget";
/// The GPU the share fixtures name (their ConfigMaps' NVIDIA_VISIBLE_DEVICES, HAMi's allocation).
const FIXTURE_GPU: &str = "GPU-5f2c7a1e-3b4d-4e8f-9a01-2c3d4e5f6a7b";

/// The fixture's documents with its names made the run's: `from` (the fixture's pod name, which its ConfigMaps'
/// names start with) renamed `to` in every string, the pod's container `main` (as the harness's kubelet reports
/// it), in namespace `ns` with the run's label, without what the API server sets (uid, owner references to the
/// fixture's pod, status); GPU UUIDs the replayed GPU's.
fn from_fixture(file: &str, from: &str, to: &str, ns: &str, id: &str) -> Vec<Value> {
    share_fixture(file)
        .into_iter()
        .map(|doc| {
            let text = doc.to_string().replace(from, to).replace(FIXTURE_GPU, GPU_UUID);
            let mut doc: Value = serde_json::from_str(&text).expect("json");
            let meta = doc["metadata"].as_object_mut().expect("metadata");
            meta.remove("uid");
            meta.remove("ownerReferences");
            meta.insert("namespace".into(), ns.into());
            doc.as_object_mut().expect("an object").remove("status");
            if doc["kind"] == "Pod" {
                doc["metadata"]["labels"]["e2e.gpubudget.io/run"] = id.into();
                doc["spec"]["containers"][0]["name"] = "main".into();
            }
            doc
        })
        .collect()
}

/// The fixture's Pod (its one document of kind Pod).
fn pod_of(docs: &[Value]) -> Pod {
    let pod = docs.iter().find(|d| d["kind"] == "Pod").expect("a pod in the fixture");
    serde_json::from_value(pod.clone()).expect("a pod")
}

/// `share|podsOnShare|podsShareUnresolved|matchedPods` of a budget's status, as the script compared them.
fn share_status(b: &GpuMemoryBudget) -> (Option<String>, Option<i64>, Option<i64>, i64) {
    let s = b.status.clone().unwrap_or_default();
    (s.share, s.pods_on_share, s.pods_share_unresolved, s.matched_pods)
}

/// `podsCapped/podsUncapped` of a budget's status.
fn capped(b: &GpuMemoryBudget) -> (Option<i64>, Option<i64>) {
    let s = b.status.clone().unwrap_or_default();
    (s.pods_capped, s.pods_uncapped)
}

/// `kubectl get gmb -n <ns> -o wide`, as the API server's table shows it, columns aligned.
async fn show_gmb(run: &Run, ns: &str) {
    let (columns, rows) =
        wide_table(&run.admin, &format!("/apis/gpubudget.io/v1alpha1/namespaces/{ns}/gpumemorybudgets")).await;
    let all: Vec<&Vec<String>> = std::iter::once(&columns).chain(rows.iter()).collect();
    let widths: Vec<usize> =
        (0..columns.len()).map(|i| all.iter().map(|r| r.get(i).map_or(0, String::len)).max().unwrap_or(0)).collect();
    for row in all {
        let cells: Vec<String> = row.iter().zip(&widths).map(|(c, w)| format!("{c:w$}")).collect();
        run.info(cells.join("   ").trim_end());
    }
}

/// The status fields of a budget the script printed.
async fn show_status(run: &Run, ns: &str, name: &str) {
    let s = run.budget(ns, name).await.status.unwrap_or_default();
    let shown = json!({"matchedPods": s.matched_pods, "podsOverBudget": s.pods_over_budget,
        "podsCapped": s.pods_capped, "podsUncapped": s.pods_uncapped, "podsOnShare": s.pods_on_share,
        "podsShareUnresolved": s.pods_share_unresolved, "share": s.share, "evictions": s.evictions});
    run.info(&format!("status of {name}: {shown}"));
}

/// The tenant's pods: KAI's (created unbound, bound by a Binding as KAI's binder binds them), HAMi's and the
/// device plugin's (created bound by spec.nodeName); the test is their kubelet.
struct Tenant<'a> {
    run: &'a Run,
    client: Client,
    ns: &'a str,
    node: &'a str,
}

impl Tenant<'_> {
    /// Creates `docs` (the ConfigMaps, then the pod) as the tenant; returns the pod.
    async fn create(&self, docs: &[Value]) -> Pod {
        let pp = PostParams::default();
        for doc in docs.iter().filter(|d| d["kind"] == "ConfigMap") {
            let cm: ConfigMap = serde_json::from_value(doc.clone()).expect("a ConfigMap");
            let api = Api::<ConfigMap>::namespaced(self.client.clone(), self.ns);
            api.create(&pp, &cm)
                .await
                .unwrap_or_else(|e| panic!("the tenant creates ConfigMap {}: {e}", cm.name_any()));
        }
        let pod = pod_of(docs);
        let api = Api::<Pod>::namespaced(self.client.clone(), self.ns);
        api.create(&pp, &pod).await.unwrap_or_else(|e| panic!("the tenant creates pod {}: {e}", pod.name_any()))
    }

    /// A pod as KAI-Scheduler's webhook and binder leave it (kai-fraction.yaml: the annotation, schedulerName
    /// kai-scheduler, env from the "-0" ConfigMap the binder fills, envFrom the empty "-evar" one, the volume, no
    /// GPU resource), created unbound and bound to the node by a Binding (#51: the chart refuses a KAI pod created
    /// already bound with a share); running, its process in the fixture /proc.
    async fn kai(&self, w: &mut Workloads<'_>, name: &str, fraction: &str) {
        let mut docs = from_fixture("kai-fraction.yaml", "kai-frac", name, self.ns, &self.run.id);
        for doc in &mut docs {
            if doc["kind"] == "Pod" {
                doc["spec"].as_object_mut().expect("a spec").remove("nodeName");
                doc["metadata"]["annotations"]["gpu-fraction"] = fraction.into();
            } else if doc["data"]["GPU_PORTION"].is_string() {
                doc["data"]["GPU_PORTION"] = fraction.into();
                doc["data"]["RUNAI_NUM_OF_GPUS"] = fraction.into();
            }
        }
        let created = self.create(&docs).await;
        bind(&self.run.admin, &binding(self.ns, name, self.node, json!({})))
            .await
            .unwrap_or_else(|e| panic!("binding {name} to {}: {e}", self.node));
        w.running(name, &created.uid().expect("a uid")).await;
    }

    /// A pod from `file` (its pod named `from` there), bound to the node by spec.nodeName, its limits `limits`
    /// and, for HAMi's, what HAMi's scheduler annotates; running, its process in the fixture /proc.
    async fn bound(&self, w: &mut Workloads<'_>, file: &str, from: &str, name: &str, edit: impl FnOnce(&mut Value)) {
        let mut docs = from_fixture(file, from, name, self.ns, &self.run.id);
        docs.retain(|d| d["kind"] == "Pod");
        docs[0]["spec"]["nodeName"] = self.node.into();
        edit(&mut docs[0]);
        let created = self.create(&docs).await;
        w.running(name, &created.uid().expect("a uid")).await;
    }
}

pub async fn declared() {
    let mut run = Run::start("gpubudget-sh", &["gpubudget-agent", "gpubudget-operator", "kubectl-gpubudget"]).await;
    let id = run.id.clone();
    let release = format!("gpubudget-sh-{id}");
    run.say(
        "control plane, CRDs, the chart (RBAC, admission policies, caps and eviction webhooks in URL mode), one node",
    );
    run.apply_crds().await;
    let ns = run.namespace(&release).await; // the release's (its ServiceAccounts)
    let ns_t = run.namespace(&format!("{release}-t")).await; // the tenant's
    let tls = run.webhook_cert();
    let webhook = run.addr(2);
    let mut kinds = RBAC_AND_POLICIES.to_vec();
    kinds.extend(["MutatingWebhookConfiguration", "ValidatingWebhookConfiguration"]);
    let applied = run.apply_chart(&release, &ns, &kinds, Some((&webhook, &tls.join("ca.crt")))).await;
    for v in applied.iter().filter(|v| v["kind"].as_str().is_some_and(|k| k.ends_with("WebhookConfiguration"))) {
        let urls: Vec<&str> =
            v["webhooks"].as_array().into_iter().flatten().filter_map(|h| h["clientConfig"]["url"].as_str()).collect();
        run.info(&format!(
            "{}/{}: {}",
            v["kind"].as_str().unwrap_or_default(),
            v["metadata"]["name"].as_str().unwrap_or_default(),
            urls.join(", ")
        ));
    }
    // The Node as an API object, without the extended resources of its pods (nvidia.com/gpu, nvidia.com/gpumem):
    // the API server admits pods bound by spec.nodeName without looking at the Node's capacity (the kubelet would).
    let node = format!("{release}-n1");
    let node_uid = run.node(&node).await;
    run.tenant_with_edit(&ns_t).await;
    let tenant_name = format!("system:serviceaccount:{ns_t}:tenant");
    let tenant = Tenant { run: &run, client: run.as_user(&tenant_name).await, ns: &ns_t, node: &node };
    run.info(&format!("the tenant {tenant_name} (edit in {ns_t})"));
    let operator = run.chart_operator(&ns, &release).await;
    let agent = run.chart_agent(&ns, &release, (&node, &node_uid), "agent").await;
    let mut w = Workloads::new(&run, &ns_t, &node, 4400);
    // What NVML reports: the replayed GPU, the pods' processes (no device used bytes: no pressure signal).
    w.sample_processes(&[]);
    let mut summary = Vec::new();

    run.say(&format!(
        "the release binaries, out of cluster: the operator (webhooks on {webhook}) and the agent (bound to {node})"
    ));
    let ReleaseBinaries { operator: _operator, agent: mut agent_binary, agent_started } =
        run.start_release((&operator, &agent), (&release, &ns), &node, &webhook).await;

    run.say("1. the budget: {selector: {}, limit: 80Gi, share: {}, admissionCaps: Enabled, overLimitSeconds: 10}");
    run.apply(
        &json!({"apiVersion": "gpubudget.io/v1alpha1", "kind": "GpuMemoryBudget",
            "metadata": {"name": "shares", "namespace": ns_t},
            "spec": {"selector": {}, "limit": "80Gi", "share": {}, "admissionCaps": "Enabled",
                "overLimitSeconds": 10}}),
        &ns_t,
    )
    .await;
    run.info(&format!("GpuMemoryBudget {ns_t}/shares applied"));
    let what = format!("{ns_t} labelled gpubudget.io/admission-caps=enabled by the operator");
    run.object_until(Api::<Namespace>::all(run.admin.clone()), &ns_t, &what, |n| {
        n.labels().get("gpubudget.io/admission-caps").map(String::as_str) == Some("enabled")
    })
    .await;

    run.say(&format!("2. the tenant's pods, shaped as the tools leave them, bound to {node}"));
    tenant.kai(&mut w, "kai-half", "0.5").await;
    tenant.kai(&mut w, "kai-quarter", "0.25").await;
    // As HAMi's scheduler leaves it (hami-gpumem.yaml), 10240 MiB of the replayed GPU.
    tenant
        .bound(&mut w, "hami-gpumem.yaml", "hami-gpumem", "hami", |p| {
            let resources = json!({"nvidia.com/gpu": "1", "nvidia.com/gpumem": "10240"});
            p["spec"]["containers"][0]["resources"] = json!({"limits": resources, "requests": resources});
            let annotations = &mut p["metadata"]["annotations"];
            annotations["hami.io/vgpu-node"] = json!(node);
            annotations["hami.io/vgpu-devices-allocated"] = json!(format!("{GPU_UUID},NVIDIA,10240,0:;"));
            p["metadata"]["labels"]["hami.io/vgpu-node"] = json!(node);
        })
        .await;
    tenant.kai(&mut w, "kai-nan", "NaN").await;
    for name in ["hami", "kai-half", "kai-nan", "kai-quarter"] {
        let p = run.pod(&ns_t, name).await;
        let spec = p.spec.clone().unwrap_or_default();
        let limits = spec.containers[0].resources.as_ref().and_then(|r| r.limits.clone()).unwrap_or_default();
        let limits: Vec<String> = limits.iter().map(|(k, q)| format!("{k}:{}", q.0)).collect();
        run.info(&format!(
            "{name}: scheduler {}, node {}, phase {}, limits [{}], gpu-fraction {}",
            spec.scheduler_name.unwrap_or_default(),
            spec.node_name.unwrap_or_default(),
            p.status.as_ref().and_then(|s| s.phase.clone()).unwrap_or_default(),
            limits.join(" "),
            p.annotations().get("gpu-fraction").map_or("<none>", String::as_str)
        ));
        assert_eq!(p.spec.and_then(|s| s.node_name).as_deref(), Some(node.as_str()), "{name} is not bound to {node}");
    }
    let capacity =
        Api::<Node>::all(run.admin.clone()).get(&node).await.expect("the node").status.and_then(|s| s.capacity);
    run.info(&format!("the Node advertises no nvidia.com/gpu nor nvidia.com/gpumem: capacity {capacity:?}"));
    assert!(capacity.unwrap_or_default().keys().all(|k| !k.starts_with("nvidia.com/")), "the node advertises GPUs");

    run.say(
        "3. caps at admission: hami's absolute share is its cap; the KAI pods' fraction, capped at the limit, uncapped \
         where their devices come from a ConfigMap",
    );
    let hami = run.pod(&ns_t, "hami").await;
    let env = env_of(&hami);
    for line in &env {
        run.info(&format!("hami env: {line}"));
    }
    for want in ["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=10240M", "NVIDIA_GPU_MEMORY_LIMIT=10240"] {
        assert!(env.iter().any(|l| l == want), "hami has no {want}: {env:?}");
    }
    let (text, record) = caps_record(&hami);
    run.info(&format!("hami caps record: {text}"));
    assert_eq!(record.budget, "shares", "hami's caps record: {text}");
    assert_eq!(record.limit_mib, 10240, "hami's caps record: {text}");
    assert!(record.containers.iter().all(|c| c.uncapped.is_none()), "hami's caps record: {text}");
    for name in ["kai-half", "kai-quarter", "kai-nan"] {
        let p = run.pod(&ns_t, name).await;
        let env = env_of(&p);
        for line in &env {
            run.info(&format!("{name} env: {line}"));
        }
        let what = "capped at the budget's limit (NVIDIA_GPU_MEMORY_LIMIT=81920)";
        assert!(env.iter().any(|l| l == "NVIDIA_GPU_MEMORY_LIMIT=81920"), "{name} is not {what}: {env:?}");
        let mps = env.iter().any(|l| l.starts_with("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"));
        assert!(!mps, "{name} got an MPS cap though its devices are not in the pod: {env:?}");
        let (text, record) = caps_record(&p);
        run.info(&format!("{name} caps record: {text}"));
        let uncapped = record.containers.first().and_then(|c| c.uncapped.as_deref()).unwrap_or_default();
        assert!(
            record.limit_mib == 81920 && uncapped.contains("valueFrom"),
            "{name}'s caps record does not say it is uncapped because of valueFrom: {text}"
        );
    }
    run.info(
        "ok: hami capped at its 10240 MiB share; the KAI pods NVIDIA_GPU_MEMORY_LIMIT=81920 (the limit), no MPS cap, \
         recorded uncapped with the reason",
    );

    // KAI's fractions and an MPS replica of the card (the replayed H100, 79.6 GiB): exact, its bytes divisible by 4.
    let (quarter, half) = (GPU_TOTAL / 4, GPU_TOTAL / 2);
    let (note_quarter, note_half) =
        ("KAI gpu-fraction 0.25 of 79.6Gi = 19.9Gi", "KAI gpu-fraction 0.5 of 79.6Gi = 39.8Gi");
    let note_hami = "HAMi gpumem 10240 MiB = 10Gi";
    run.say(
        "4. usage replayed (GPU of 79.6Gi): kai-half 30Gi, kai-quarter 15Gi, hami 8Gi, kai-nan 5Gi: the shares recorded",
    );
    w.sample_processes(&[("kai-half", 30 * GI), ("kai-quarter", 15 * GI), ("hami", 8 * GI), ("kai-nan", 5 * GI)]);
    for (name, limit, note) in
        [("kai-half", half, note_half), ("kai-quarter", quarter, note_quarter), ("hami", 10 * GI, note_hami)]
    {
        // The note ends in the figure it holds the pod to: `… = 39.8Gi`.
        let figure = note.rsplit("= ").next().unwrap_or_default();
        run.pod_until(&ns_t, name, &format!("{name} held to {figure} ({note})"), |p| held_to(p, limit, note)).await;
    }
    run.pod_until(&ns_t, "kai-nan", "kai-nan recorded", |p| held_share(p).is_some()).await;
    for name in ["kai-half", "kai-quarter", "hami", "kai-nan"] {
        let p = run.pod(&ns_t, name).await;
        let budget = annotation(&p, "budget").unwrap_or_default();
        run.info(&format!(
            "{name}: state {}, budget {budget}, gpubudget.io/share {}",
            annotation(&p, "state").unwrap_or_default(),
            annotation(&p, "share").unwrap_or_default()
        ));
        assert_eq!(budget, "shares", "{name} is recorded under {budget}, not shares");
    }
    let sources = |name: &str, p: &Pod| held_share(p).unwrap_or_else(|| panic!("{name} has no share")).sources;
    assert_eq!(sources("kai-half", &run.pod(&ns_t, "kai-half").await), [ShareSource::KaiFraction]);
    assert_eq!(sources("hami", &run.pod(&ns_t, "hami").await), [ShareSource::HamiMemory]);
    let nan = held_share(&run.pod(&ns_t, "kai-nan").await).expect("recorded");
    assert!(
        nan.limit_bytes == 80 * GI
            && nan.sources.is_empty()
            && nan.note.starts_with("share unresolved:")
            && nan.note.ends_with("held to the budget's limit 80Gi"),
        "kai-nan's share record: {nan:?}"
    );
    let unresolved = run.event(&ns_t, "kai-nan", "GpuMemoryShareUnresolved").await;
    run.info(&format!(
        "kai-nan: {} GpuMemoryShareUnresolved ({} on {}): {}",
        unresolved.type_.as_deref().unwrap_or_default(),
        unresolved.reporting_controller.as_deref().unwrap_or_default(),
        unresolved.reporting_instance.as_deref().unwrap_or_default(),
        unresolved.note.as_deref().unwrap_or_default()
    ));
    assert_eq!(unresolved.type_.as_deref(), Some("Warning"), "GpuMemoryShareUnresolved is not a Warning");
    let what = "status of shares: SHARE 'KAI gpu-fraction 2, HAMi gpumem 1, unresolved 1', podsOnShare 3, \
                podsShareUnresolved 1, MATCHED 4";
    let want = (Some("KAI gpu-fraction 2, HAMi gpumem 1, unresolved 1".to_owned()), Some(3), Some(1), 4);
    run.budget_until(&ns_t, "shares", what, |b| share_status(b) == want).await;
    let what = "status of shares: CAPPED 1 (hami), UNCAPPED 3 (the KAI pods)";
    run.budget_until(&ns_t, "shares", what, |b| capped(b) == (Some(1), Some(3))).await;
    show_gmb(&run, &ns_t).await;
    show_status(&run, &ns_t, "shares").await;

    run.say(
        "5. kai-half to 44Gi (over its 39.8Gi share, within the 80Gi limit), hami to 12Gi (over its 10Gi); kai-quarter \
         stays at 15Gi of 19.9Gi",
    );
    let over_sample = Instant::now();
    run.info(&format!("sample written at {}", jiff::Timestamp::now().strftime("%H:%M:%S")));
    w.sample_processes(&[("kai-half", 44 * GI), ("kai-quarter", 15 * GI), ("hami", 12 * GI), ("kai-nan", 5 * GI)]);
    let over = "GpuMemoryOverBudget";
    let t_half =
        run.timed(&format!("{over} on kai-half"), over_sample, || run.has_event(&ns_t, "kai-half", over)).await;
    let t_hami = run.timed(&format!("{over} on hami"), over_sample, || run.has_event(&ns_t, "hami", over)).await;
    for (name, note) in [("kai-half", note_half), ("hami", note_hami)] {
        let message = run.notes(&ns_t, name, over).await.pop().unwrap_or_default();
        run.info(&format!("{name}: {message}"));
        assert!(message.contains(note), "{name}'s Over message does not name its share ({note}): {message}");
    }
    summary.push(format!(
        "Over events after the sample: kai-half {t_half:.1}s, hami {t_hami:.1}s (first poll that saw them)"
    ));
    run.budget_until(&ns_t, "shares", "status of shares: OVER 2", |b| {
        b.status.as_ref().is_some_and(|s| s.pods_over_budget == 2)
    })
    .await;
    // hami holds 12Gi under an MPS cap of 10240 MiB: the agent tells that cap not in force (#32), and status counts
    // the pod uncapped from then on.
    let not_in_force = run.event(&ns_t, "hami", "GpuMemoryCapNotInForce").await;
    let hami = run.pod(&ns_t, "hami").await;
    run.info(&format!(
        "hami: gpubudget.io/cap-not-in-force {}",
        annotation(&hami, "cap-not-in-force").unwrap_or_default()
    ));
    run.info(&format!("hami: GpuMemoryCapNotInForce: {}", not_in_force.note.unwrap_or_default()));
    let what = "status of shares: CAPPED 0, UNCAPPED 4 (hami's cap not in force)";
    run.budget_until(&ns_t, "shares", what, |b| capped(b) == (Some(0), Some(4))).await;
    show_gmb(&run, &ns_t).await;
    for name in ["kai-half", "hami"] {
        let over_event = run.events(&ns_t, name, over).await.remove(0);
        let (after, grace) = run.evicted_after(&ns_t, name, &over_event, 10).await;
        summary.push(format!("{name}: evicted {after}s after its Over event (whole seconds), grace {grace}s"));
        w.gone(name).await;
    }
    w.sample_processes(&[("kai-quarter", 15 * GI), ("kai-nan", 5 * GI)]);
    for reason in ["GpuMemoryNearBudget", over] {
        assert!(
            !run.has_event(&ns_t, "kai-quarter", reason).await,
            "kai-quarter (15Gi of its 19.9Gi share) got {reason}"
        );
    }
    let p = run.pod(&ns_t, "kai-quarter").await;
    assert!(!is_terminating(&p), "kai-quarter is being deleted");
    assert_eq!(annotation(&p, "state").as_deref(), Some("Within"), "kai-quarter's state");
    run.info("ok: kai-quarter Within at 15Gi of its 19.9Gi share, no event, not deleted");
    run.budget_until(&ns_t, "shares", "status of shares: EVICTED 2", |b| {
        b.status.as_ref().is_some_and(|s| s.evictions == 2)
    })
    .await;
    let what = "status of shares: SHARE 'KAI gpu-fraction 1, unresolved 1' once the evicted pods are gone";
    let want = (Some("KAI gpu-fraction 1, unresolved 1".to_owned()), Some(1), Some(1), 2);
    run.budget_until(&ns_t, "shares", what, |b| share_status(b) == want).await;
    show_gmb(&run, &ns_t).await;

    run.say(
        "6. a plain budget {selector: {}, limit: 30Gi}: the smallest limit wins, with each pod's share as its limit",
    );
    run.apply(
        &json!({"apiVersion": "gpubudget.io/v1alpha1", "kind": "GpuMemoryBudget",
            "metadata": {"name": "plain", "namespace": ns_t}, "spec": {"selector": {}, "limit": "30Gi"}}),
        &ns_t,
    )
    .await;
    run.info(&format!("GpuMemoryBudget {ns_t}/plain applied"));
    let plain_at = Instant::now();
    let what = "kai-nan (unresolved: held to 80Gi) recorded under plain (30Gi)";
    let t_plain = run
        .timed(what, plain_at, || async {
            annotation(&run.pod(&ns_t, "kai-nan").await, "budget").as_deref() == Some("plain")
        })
        .await;
    summary.push(format!("plain budget created → kai-nan recorded under it: {t_plain:.1}s"));
    let quarter_pod = run.pod(&ns_t, "kai-quarter").await;
    let budget = annotation(&quarter_pod, "budget").unwrap_or_default();
    assert_eq!(budget, "shares", "kai-quarter is recorded under {budget}, not shares (19.9Gi < 30Gi)");
    let record = annotation(&quarter_pod, "share").unwrap_or_default();
    assert!(held_to(&quarter_pod, quarter, note_quarter), "kai-quarter's share record: {record}");
    run.info(&format!("kai-quarter: budget shares, gpubudget.io/share {record}"));
    let nan_record = annotation(&run.pod(&ns_t, "kai-nan").await, "share").unwrap_or_default();
    run.info(&format!("kai-nan: budget plain, gpubudget.io/share '{nan_record}'"));
    let what = "status of shares: SHARE 'KAI gpu-fraction 1', podsOnShare 1, podsShareUnresolved 0, MATCHED 1";
    let want = (Some("KAI gpu-fraction 1".to_owned()), Some(1), Some(0), 1);
    run.budget_until(&ns_t, "shares", what, |b| share_status(b) == want).await;
    let plain = run
        .budget_until(&ns_t, "plain", "status of plain: MATCHED 1 (kai-nan)", |b| {
            b.status.as_ref().is_some_and(|s| s.matched_pods == 1)
        })
        .await;
    let plain_share = plain.status.and_then(|s| s.share);
    assert_eq!(plain_share, None, "the plain budget has a share status");
    show_gmb(&run, &ns_t).await;
    show_status(&run, &ns_t, "shares").await;
    show_status(&run, &ns_t, "plain").await;
    for name in ["shares", "plain"] {
        let status = run.budget(&ns_t, name).await.status.unwrap_or_default();
        let overlapping = status.conditions.iter().find(|c| c.type_ == "Overlapping");
        let (said, message) = overlapping.map_or(("", ""), |c| (c.status.as_str(), c.message.as_str()));
        run.info(&format!("{name}: Overlapping={said}: {}", message.chars().take(220).collect::<String>()));
    }
    let unresolved = run.occurrences(&ns_t, "kai-nan", "GpuMemoryShareUnresolved").await;
    assert_eq!(unresolved, 1, "GpuMemoryShareUnresolved on kai-nan: {unresolved} occurrences, not 1");
    run.info("ok: GpuMemoryShareUnresolved on kai-nan told once (series included)");
    // The node's GpuNodeUsage (written at most every 30 s, #34) is what top and why read for usage.
    let what = format!("GpuNodeUsage {node} lists kai-quarter at 15Gi (what top and why read for usage)");
    run.object_until(Api::<GpuNodeUsage>::all(run.admin.clone()), &node, &what, |u| {
        u.spec.pods.iter().any(|p| p.name == "kai-quarter" && p.usage_bytes == (15 * GI) as i64)
    })
    .await;
    run.info(&format!("$ kubectl gpubudget why kai-quarter -n {ns_t}"));
    let why = run.output(PLUGIN, &["why", "kai-quarter", "-n", &ns_t]);
    for line in why.lines() {
        run.info(&format!("| {line}"));
    }
    let line = |key: &str| why.lines().find(|l| l.trim_start().starts_with(key)).unwrap_or_default().to_owned();
    assert!(line("Share:").contains(note_quarter), "why has no Share: line naming kai-quarter's share: {why}");
    assert!(line("Budget:").contains("shares"), "why does not name the budget shares: {why}");
    run.info(&format!("$ kubectl gpubudget top -n {ns_t}"));
    let top = run.output(PLUGIN, &["top", "-n", &ns_t]);
    for line in top.lines() {
        run.info(&format!("| {line}"));
    }
    let row = top.lines().find(|l| l.split_whitespace().any(|w| w == "kai-quarter")).unwrap_or_default();
    assert!(row.split_whitespace().any(|w| w == "19.9Gi"), "top does not show kai-quarter's own limit 19.9Gi: {top}");

    run.say(
        "7. MPS: the Node labelled as GPU feature discovery labels it (sharing-strategy mps, 4 replicas); a pod asking \
         nvidia.com/gpu: 1 at 22Gi",
    );
    // As the NVIDIA device plugin's pods are (device-plugin-mps.yaml): nvidia.com/gpu: 1, the default scheduler.
    tenant.bound(&mut w, "device-plugin-mps.yaml", "dp-mps", "mps", |_| {}).await;
    let mps = run.pod(&ns_t, "mps").await;
    run.info(&format!(
        "mps at admission: env [{}], caps record '{}' (plain, 30Gi, applies there: a replica's share needs the node's \
         labels, which the webhook does not read)",
        env_of(&mps).join(" "),
        caps_record(&mps).0
    ));
    w.sample_processes(&[("kai-quarter", 15 * GI), ("kai-nan", 5 * GI), ("mps", 22 * GI)]);
    run.pod_until(&ns_t, "mps", "mps recorded Within under plain (30Gi) while the node shares nothing", |p| {
        annotation(p, "state").as_deref() == Some("Within") && annotation(p, "budget").as_deref() == Some("plain")
    })
    .await;
    // The labels GPU feature discovery puts on an MPS node (device-plugin-mps.yaml's Node), and its capacity.
    let fixture_node = from_fixture("device-plugin-mps.yaml", "dp-mps", "mps", &ns_t, &id);
    let fixture_labels =
        &fixture_node.iter().find(|d| d["kind"] == "Node").expect("the fixture's node")["metadata"]["labels"];
    let labels: serde_json::Map<String, Value> = [
        "nvidia.com/gpu.sharing-strategy",
        "nvidia.com/gpu.replicas",
        "nvidia.com/gpu.count",
        "nvidia.com/mps.capable",
        "nvidia.com/gpu.product",
    ]
    .into_iter()
    .map(|k| (k.to_owned(), fixture_labels[k].clone()))
    .collect();
    let nodes = Api::<Node>::all(run.admin.clone());
    let labelled = json!({"metadata": {"labels": labels}});
    nodes.patch(&node, &PatchParams::default(), &Patch::Merge(&labelled)).await.expect("node labelled");
    let labelled_at = (Instant::now(), jiff::Timestamp::now());
    let gpus = json!({"status": {"capacity": {"nvidia.com/gpu": "4"}, "allocatable": {"nvidia.com/gpu": "4"}}});
    nodes.patch_status(&node, &PatchParams::default(), &Patch::Merge(&gpus)).await.expect("node status");
    let since_start = labelled_at.0.duration_since(agent_started).as_secs_f64();
    let phase = since_start % 60.0;
    run.info(&format!(
        "labelled at {} with {}, {since_start:.1}s after the agent started (the agent reads its Node every 60 s from \
         its start: {phase:.1}s into a period)",
        labelled_at.1.strftime("%H:%M:%S"),
        Value::Object(labels.clone())
    ));
    let what = "GpuMemoryOverBudget on mps (22Gi of its 19.9Gi replica)";
    let t_mps =
        run.timed_within(what, labelled_at.0, Duration::from_secs(90), || run.has_event(&ns_t, "mps", over)).await;
    let mps_over = run.events(&ns_t, "mps", over).await.remove(0);
    let event_time = mps_over.event_time.as_ref().expect("an eventTime").0;
    let t_mps_event = event_time.duration_since(labelled_at.1).as_secs_f64();
    let message = run.notes(&ns_t, "mps", over).await.pop().unwrap_or_default();
    run.info(&format!("mps: {message}"));
    let note_mps = "MPS replica of 4 per GPU of 79.6Gi = 19.9Gi";
    assert!(message.contains(note_mps), "mps's Over message does not name its replica's share: {message}");
    // The Over event can be seen before the record that goes with it (a run read plain here): waited for.
    let what = "mps recorded under shares";
    let mps = run.pod_until(&ns_t, "mps", what, |p| annotation(p, "budget").as_deref() == Some("shares")).await;
    let share = held_share(&mps).expect("mps's share");
    assert_eq!((share.limit_bytes, share.sources.as_slice()), (quarter, &[ShareSource::MpsReplicas][..]), "{share:?}");
    run.info(&format!("mps: gpubudget.io/share {}", annotation(&mps, "share").unwrap_or_default()));
    let what = "status of shares: SHARE 'KAI gpu-fraction 1, MPS replicas 1', podsOnShare 2, MATCHED 2";
    let want = (Some("KAI gpu-fraction 1, MPS replicas 1".to_owned()), Some(2), Some(0), 2);
    run.budget_until(&ns_t, "shares", what, |b| share_status(b) == want).await;
    show_gmb(&run, &ns_t).await;
    let log = agent_binary.log_text();
    let starts = log.matches("agent running").count();
    assert!(agent_binary.is_running() && starts == 1, "the agent was restarted ({starts} starts in its log)");
    run.info(&format!(
        "ok: the agent (pid {}) was not restarted; its reads of the Node's sharing labels that changed something:",
        agent_binary.pid()
    ));
    let reads: Vec<String> = log.lines().filter(|l| l.contains("the Node's GPU sharing")).map(strip_ansi).collect();
    for line in &reads {
        run.info(&format!("agent: {line}"));
    }
    let mps_read = reads.iter().any(|l| l.contains(r#""nvidia.com/gpu.replicas": "4""#));
    assert!(mps_read, "the agent's log does not say it read the Node's MPS labels");
    summary.push(format!(
        "MPS: label → Over event {t_mps_event:.1}s (its eventTime), {t_mps:.1}s (first poll); the label came \
         {phase:.1}s into the agent's 60 s period"
    ));
    let (after, grace) = run.evicted_after(&ns_t, "mps", &mps_over, 10).await;
    summary.push(format!("mps: evicted {after}s after its Over event (whole seconds), grace {grace}s"));
    w.gone("mps").await;
    w.sample_processes(&[("kai-quarter", 15 * GI), ("kai-nan", 5 * GI)]);
    run.budget_until(&ns_t, "shares", "status of shares: EVICTED 3", |b| {
        b.status.as_ref().is_some_and(|s| s.evictions == 3)
    })
    .await;
    show_gmb(&run, &ns_t).await;
    let unresolved = run.occurrences(&ns_t, "kai-nan", "GpuMemoryShareUnresolved").await;
    assert_eq!(unresolved, 1, "GpuMemoryShareUnresolved on kai-nan repeated");
    let unlabelled =
        json!({"metadata": {"labels": {"nvidia.com/gpu.sharing-strategy": null, "nvidia.com/gpu.replicas": null}}});
    nodes.patch(&node, &PatchParams::default(), &Patch::Merge(&unlabelled)).await.expect("node unlabelled");

    run.say("summary");
    for line in &summary {
        run.info(line);
    }
    run.say(&format!("PASS ({} s)", run.elapsed()));
}

/// A log line without its colours (ANSI escape sequences).
fn strip_ansi(line: &str) -> String {
    let mut out = String::with_capacity(line.len());
    let mut chars = line.chars();
    while let Some(c) = chars.next() {
        if c == '\u{1b}' {
            for c in chars.by_ref() {
                if c.is_ascii_alphabetic() {
                    break;
                }
            }
        } else {
            out.push(c);
        }
    }
    out
}
