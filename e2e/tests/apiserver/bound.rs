//! The pressure bound (issue 43, item 1; formerly pressure-bound.sh): one agent (token bound to its Node) with the
//! chart's RBAC and admission policies, `--namespaced-budgets ClusterBound --pressure-blocked-timeout 20s`, a
//! PodDisruptionBudget (`maxUnavailable: 0`) on each pressured pod, and the API server's own disruption controller
//! and Eviction API. One story after the other on one replayed GPU (the demo's H100, 79.6 GiB; 0.6 GiB free: under
//! the default 5 % hard threshold), each beside the neighbour nb (1 GiB of the administrator's 70Gi cluster budget:
//! owed 69 GiB, so harmed; since issue 52 a pod alone on its GPU is never relieved):
//! a. a namespaced budget (tenant-written under ClusterBound; only it selects the pod) with
//!    `blockedEvictionTimeoutSeconds: 86400`, the pod at 78 GiB: deleted with the pressure grace (5 s) after the
//!    node's 20 s bound, never before, the event naming "the node's pressure blocked timeout" (before issue 43 the
//!    budget's 86400 s was the bound);
//! b. the same budget without the field: the baseline, ~20 s;
//! c. an administrator's ClusterGpuMemoryBudget, limit 70Gi, no optional field, the pod at 78 GiB from the start:
//!    over its budget and most over it under pressure; its evictions refused by the PodDisruptionBudget; deleted
//!    after the node's bound;
//! d. the same cluster budget, the pod first at 74 GiB (4.6 GiB free, no pressure): over its budget for its
//!    overLimitSeconds (10 s), its budget's eviction refused (GpuMemoryEvictionBlocked); then 78 GiB: a pod whose
//!    eviction by its budget a PodDisruptionBudget refuses is still a pressure candidate (before issue 43 it was
//!    skipped), deleted ~20 s after the pressure began.
//! For each: the time from the pressure's start (the sample written) to the deletion (the API server's
//! deletionTimestamp less the grace, and the first poll that saw it), the grace, the events' texts.

use std::time::{Duration, Instant};

use serde_json::json;

use crate::harness::{Binary, GI, RBAC_AND_POLICIES, Run, Workloads, annotation, metric, metrics};

/// `--pressure-blocked-timeout`, seconds.
const BOUND: u64 = 20;

/// The run, its agent and its workloads.
struct Bound<'a> {
    run: &'a Run,
    agent: &'a Binary,
    admin: String,
    w: Workloads<'a>,
    summary: Vec<String>,
}

impl Bound<'_> {
    async fn pressure(&self) -> Option<String> {
        metric(&metrics(&self.admin).await, "gpubudget_gpu_memory_pressure{")
    }

    /// Waits for the pod to be deleted, failing if that happens before the bound; prints and records the figures
    /// and the events. Returns the first DeletingForGpuMemory note.
    async fn watch_deletion(&mut self, story: &str, ns: &str, pod: &str, pressed: Instant) -> String {
        let run = self.run;
        let deadline = Duration::from_secs(BOUND + 60);
        let terminating = async {
            while !run.is_terminating(ns, pod).await {
                tokio::time::sleep(Duration::from_millis(250)).await;
            }
        };
        tokio::time::timeout(deadline, terminating)
            .await
            .unwrap_or_else(|_| panic!("{ns}/{pod} not deleted {} s after the pressure began", BOUND + 60));
        let seen = pressed.elapsed().as_secs_f64();
        let now = jiff::Timestamp::now();
        let meta = run.pod(ns, pod).await.metadata;
        let grace = meta.deletion_grace_period_seconds.expect("a grace");
        let deleted = meta.deletion_timestamp.expect("terminating").0;
        // When the API server took it: its deletionTimestamp less the grace (whole seconds), against the pressure's
        // start (now less what has passed since).
        let api_at = (deleted.as_second() - grace) as f64 - (now.as_millisecond() as f64 / 1000.0 - seen);
        run.info(&format!(
            "{ns}/{pod} terminating: seen {seen:.1}s after the pressure began; deleted by the API server at {api_at:.1}s \
             (deletionTimestamp {deleted} less grace {grace}s; whole seconds)"
        ));
        assert!(
            seen >= (BOUND - 1) as f64,
            "{ns}/{pod} deleted {seen:.1}s after the pressure began, before the {BOUND} s bound"
        );
        assert_eq!(grace, 5, "{ns}/{pod}'s grace, the pressure grace 5");
        run.event(ns, pod, "DeletingForGpuMemory").await;
        let blocked = run.occurrences(ns, pod, "GpuMemoryEvictionBlocked").await;
        for reason in
            ["GpuMemoryOverBudget", "EvictingForGpuMemory", "GpuMemoryEvictionBlocked", "DeletingForGpuMemory"]
        {
            for note in run.notes(ns, pod, reason).await.into_iter().take(2) {
                run.info(&format!("{reason}: {note}"));
            }
        }
        let log = self.agent.log_text();
        let key = format!("{ns}/{pod}");
        let refused = log.lines().filter(|l| l.contains("eviction blocked (HTTP 429)") && l.contains(&key)).count();
        run.info(&format!("GpuMemoryEvictionBlocked events (series counted): {blocked}; refusals (HTTP 429) in the agent's log: {refused}"));
        for line in log.lines().filter(|l| l.contains("evictions refused too long: pod deleted") && l.contains(&key)) {
            run.info(&format!("agent: {}", line.chars().take(240).collect::<String>()));
        }
        self.summary.push(format!(
            "{story}: deleted {api_at:.1}s (API, whole seconds) / {seen:.1}s (first seen) after the pressure began, grace \
             {grace}, {refused} refusals (429) before it"
        ));
        run.notes(ns, pod, "DeletingForGpuMemory").await.remove(0)
    }

    /// The deleted pod's processes exit, the pod goes; then the GPU's pressure ends.
    async fn kubelet(&self, pod: &str) {
        self.w.gone(pod).await;
        self.w.sample(&[("nb", GI)]);
        self.run
            .until("the GPU's pressure ended (gpubudget_gpu_memory_pressure 0, after the 10 s transition)", || async {
                self.pressure().await.as_deref() == Some("0")
            })
            .await;
    }

    /// A namespaced budget (limit 80Gi: the pod is within it) selecting only POD, with `extra` in its spec.
    async fn namespaced_story(&mut self, letter: &str, ns: &str, pod: &str, extra: serde_json::Value) {
        self.w.pod_behind_pdb_in(ns, pod).await;
        let mut spec = json!({"selector": {"matchLabels": {"app": pod}}, "limit": "80Gi"});
        spec.as_object_mut().expect("an object").extend(extra.as_object().cloned().unwrap_or_default());
        let budget = json!({"apiVersion": "gpubudget.io/v1alpha1", "kind": "GpuMemoryBudget",
            "metadata": {"name": pod, "namespace": ns}, "spec": spec});
        self.run.apply(&budget, ns).await;
        self.w.sample(&[(pod, GI), ("nb", GI)]);
        self.run
            .pod_until(ns, pod, &format!("{ns}/{pod} recorded (1 GiB, no pressure)"), |p| {
                annotation(p, "state").is_some()
            })
            .await;
        self.run.info(&format!("spec: {spec}"));
        let pressed = Instant::now();
        self.w.sample(&[(pod, 78 * GI), ("nb", GI)]);
        self.run.event(ns, pod, "GpuMemoryEvictionBlocked").await;
        self.run.info(&format!("first refusal {:.1}s after the pressure began", pressed.elapsed().as_secs_f64()));
        let deleting = self.watch_deletion(letter, ns, pod, pressed).await;
        let bound = format!("the node's pressure blocked timeout: {BOUND}s");
        assert!(
            deleting.contains(&bound),
            "story {letter}: the deletion event does not name the node's {BOUND} s bound: {deleting}"
        );
        self.kubelet(pod).await;
    }
}

pub async fn pressure_bound() {
    let mut run = Run::start("gpubudget-pb", &["gpubudget-agent"]).await;
    let id = run.id.clone();
    let release = format!("gpubudget-pb-{id}");
    run.say("control plane, CRDs, the chart's RBAC and admission policies, one node");
    run.apply_crds().await;
    let ns = run.namespace(&release).await;
    let ns_t = run.namespace(&format!("{release}-t")).await; // stories a, b: namespaced budgets
    let ns_c = run.namespace(&format!("{release}-c")).await; // stories c, d: the administrator's cluster budget
    run.label_namespace(&ns_c, "e2e.gpubudget.io/cluster-budgets", &id).await;
    run.apply_chart(&release, &ns, RBAC_AND_POLICIES, None).await;
    let node = format!("{release}-n1");
    let node_uid = run.node(&node).await;
    let admin_cgmb = format!("{release}-admin");
    run.owns("gpubudget.io", "v1alpha1", "ClusterGpuMemoryBudget", None, &admin_cgmb);
    run.sample().set_usage(&[]);

    run.say(&format!(
        "the agent: --namespaced-budgets ClusterBound --pressure-blocked-timeout {BOUND}s (pressure grace 5 s, hard threshold 5 %)"
    ));
    let identity = run.chart_agent(&ns, &release, (&node, &node_uid), "agent").await;
    let admin = run.addr(0);
    let bound = format!("{BOUND}s");
    let extra = ["--namespaced-budgets", "ClusterBound", "--pressure-blocked-timeout", bound.as_str()];
    let agent = run.start_agent(&identity, &node, &admin, &extra, &[("RUST_LOG", "info")], "agent.log").await;
    let w = Workloads::new(&run, &ns_c, &node, 7100);
    let mut b = Bound { run: &run, agent: &agent, admin, w, summary: Vec::new() };

    run.say("the administrator's ClusterGpuMemoryBudget: limit 70Gi, no optional field set (overLimitSeconds 10), and its pod nb, the neighbour");
    run.apply(
        &json!({"apiVersion": "gpubudget.io/v1alpha1", "kind": "ClusterGpuMemoryBudget", "metadata": {"name": admin_cgmb},
                "spec": {"namespaceSelector": {"matchLabels": {"e2e.gpubudget.io/cluster-budgets": id}}, "selector": {}, "limit": "70Gi"}}),
        "",
    )
    .await;
    let under_cluster_budget = format!("ClusterGpuMemoryBudget/{admin_cgmb}");
    b.w.pod_behind_pdb("nb").await;
    b.w.sample(&[("nb", GI)]);
    run.record_is(&ns_c, "nb", "budget", &under_cluster_budget).await;
    run.info("the neighbour nb: 1 GiB of its 70Gi, owed 69 GiB: every story's pressure harms it (#52: relief only where a neighbour is harmed)");

    run.say("a. a namespaced budget (tenant-written under ClusterBound) with blockedEvictionTimeoutSeconds 86400; the pod at 78 GiB beside nb (0.6 GiB free)");
    b.namespaced_story(
        "a (namespaced budget, blockedEvictionTimeoutSeconds 86400)",
        &ns_t,
        "pa",
        json!({"blockedEvictionTimeoutSeconds": 86400}),
    )
    .await;

    run.say("b. the same, blockedEvictionTimeoutSeconds unset (the baseline)");
    b.namespaced_story("b (namespaced budget, field unset)", &ns_t, "pb", json!({})).await;

    run.say("c. the pod at 78 GiB from the start beside nb: over its 70Gi, and the card at 0.6 GiB free");
    b.w.pod_behind_pdb("pc").await;
    b.w.sample(&[("pc", GI), ("nb", GI)]);
    run.record_is(&ns_c, "pc", "budget", &under_cluster_budget).await;
    let pressed = Instant::now();
    b.w.sample(&[("pc", 78 * GI), ("nb", GI)]);
    run.event(&ns_c, "pc", "GpuMemoryEvictionBlocked").await;
    run.info(&format!("first refusal {:.1}s after the pressure began", pressed.elapsed().as_secs_f64()));
    b.watch_deletion("c (cluster budget 70Gi, 78 GiB from the start)", &ns_c, "pc", pressed).await;
    b.kubelet("pc").await;

    run.say("d. the pod first at 74 GiB beside nb (4.6 GiB free: no pressure), over its 70Gi: its budget's eviction refused; then 78 GiB");
    b.w.pod_behind_pdb("pd").await;
    b.w.sample(&[("pd", GI), ("nb", GI)]);
    run.record_is(&ns_c, "pd", "budget", &under_cluster_budget).await;
    let over = Instant::now();
    b.w.sample(&[("pd", 74 * GI), ("nb", GI)]);
    run.event(&ns_c, "pd", "GpuMemoryOverBudget").await;
    let blocked = run.event(&ns_c, "pd", "GpuMemoryEvictionBlocked").await.note.unwrap_or_default();
    run.info(&format!(
        "its budget's eviction refused {:.1}s after going over: {}",
        over.elapsed().as_secs_f64(),
        blocked.chars().take(240).collect::<String>()
    ));
    assert_ne!(b.pressure().await.as_deref(), Some("1"), "the GPU is under pressure at 75 GiB used");
    assert!(!run.is_terminating(&ns_c, "pd").await, "pd deleted before any pressure");
    tokio::time::sleep(Duration::from_secs(5)).await;
    let state = annotation(&run.pod(&ns_c, "pd").await, "state").unwrap_or_default();
    run.info(&format!(
        "record: {state}, refusals so far: {}",
        run.occurrences(&ns_c, "pd", "GpuMemoryEvictionBlocked").await
    ));
    let pressed = Instant::now();
    b.w.sample(&[("pd", 78 * GI), ("nb", GI)]);
    run.until("the GPU under pressure (0.6 GiB free)", || async { b.pressure().await.as_deref() == Some("1") }).await;
    b.watch_deletion("d (cluster budget 70Gi, its eviction refused before the pressure)", &ns_c, "pd", pressed).await;
    b.kubelet("pd").await;

    run.say(&format!("summary (--pressure-blocked-timeout {BOUND}s, real kube-apiserver, replayed GPU)"));
    for line in &b.summary {
        run.info(line);
    }
    run.say(&format!(
        "PASS: under pressure a PodDisruptionBudget holds relief back the node's bound at most, whatever the budget says ({} s)",
        run.elapsed()
    ));
}
