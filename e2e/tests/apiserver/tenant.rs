//! No exemption a tenant can grant itself (issue 33, items 1–3; formerly tenant.sh): one agent (token bound to its
//! Node) with the chart's RBAC and admission policies, a tenant's manifests, and the API server's own admission
//! (Priority), disruption controller (PodDisruptionBudgets) and Eviction API. As a hostile tenant would try them
//! (edit rights in its own namespaces, nothing cluster-scoped):
//! 1. critical priority: its pod asks for `priorityClassName: system-node-critical` (the API server admits it in
//!    any namespace without a ResourceQuota scope) and holds 2Gi of its 1Gi budget: evicted after
//!    overLimitSeconds all the same, and the events say why; the same in kube-system (the default
//!    criticalNamespaces) is never evicted;
//! 2. a PodDisruptionBudget (`maxUnavailable: 0`) on its unbudgeted pod filling the GPU: every pressure eviction
//!    refused (the API's 429), then, after the node's bound (--pressure-blocked-timeout, 10 s here), the pod is
//!    deleted with the pressure grace; the budgeted neighbour keeps its memory;
//! 3. a label that opts into a looser cluster budget (a smaller limit, `Warn`, an hour over): the pod adds it and
//!    is evicted after the administrator's overLimitSeconds all the same, the events naming the tightening.

use std::time::{Duration, Instant};

use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use kube::api::Api;
use serde_json::json;

use crate::harness::{GI, RBAC_AND_POLICIES, Run, annotation};

pub async fn no_exemption() {
    let mut run = Run::start("gpubudget-tn", &["gpubudget-agent", "kubectl-gpubudget"]).await;
    let id = run.id.clone();
    let release = format!("gpubudget-tn-{id}");
    run.say("control plane, CRDs, the chart's RBAC and admission policies, one node");
    run.apply_crds().await;
    let ns = run.namespace(&release).await;
    let ns_a = run.namespace(&format!("{release}-a")).await;
    let ns_b = run.namespace(&format!("{release}-b")).await;
    let ns_c = run.namespace(&format!("{release}-c")).await;
    run.label_namespace(&ns_c, "e2e.gpubudget.io/cluster-budgets", &id).await;
    run.apply_chart(&release, &ns, RBAC_AND_POLICIES, None).await;
    let node = format!("{release}-n1");
    let node_uid = run.node(&node).await;

    run.say("the tenant's manifests (and the administrator's cluster budgets)");
    let sys = format!("{release}-sys");
    let (admin_cgmb, lax_cgmb) = (format!("{release}-admin"), format!("{release}-lax"));
    let gmb = |name: &str, ns: &str, spec| json!({"apiVersion": "gpubudget.io/v1alpha1", "kind": "GpuMemoryBudget", "metadata": {"name": name, "namespace": ns}, "spec": spec});
    let cgmb = |name: &str, spec| json!({"apiVersion": "gpubudget.io/v1alpha1", "kind": "ClusterGpuMemoryBudget", "metadata": {"name": name}, "spec": spec});
    run.owns("gpubudget.io", "v1alpha1", "GpuMemoryBudget", Some("kube-system"), &sys);
    run.owns("gpubudget.io", "v1alpha1", "ClusterGpuMemoryBudget", None, &admin_cgmb);
    run.owns("gpubudget.io", "v1alpha1", "ClusterGpuMemoryBudget", None, &lax_cgmb);
    run.owns("", "v1", "Pod", Some("kube-system"), &sys);
    for object in [
        gmb("small", &ns_a, json!({"selector": {}, "limit": "1Gi", "overLimitSeconds": 2})),
        gmb(
            &sys,
            "kube-system",
            json!({"selector": {"matchLabels": {"e2e.gpubudget.io/run": id}}, "limit": "1Gi", "overLimitSeconds": 2}),
        ),
        gmb("neighbour", &ns_b, json!({"selector": {"matchLabels": {"app": "neighbour"}}, "limit": "10Gi"})),
        json!({"apiVersion": "policy/v1", "kind": "PodDisruptionBudget", "metadata": {"name": "never", "namespace": ns_b},
               "spec": {"maxUnavailable": 0, "selector": {"matchLabels": {"app": "filler"}}}}),
        cgmb(
            &admin_cgmb,
            json!({"namespaceSelector": {"matchLabels": {"e2e.gpubudget.io/cluster-budgets": id}},
            "selector": {}, "limit": "8Gi", "overLimitSeconds": 3, "blockedEvictionTimeoutSeconds": 30}),
        ),
        cgmb(
            &lax_cgmb,
            json!({"namespaceSelector": {"matchLabels": {"e2e.gpubudget.io/cluster-budgets": id}},
            "selector": {"matchLabels": {"tier": "batch"}}, "limit": "6Gi", "action": "Warn", "overLimitSeconds": 3600,
            "evictionGracePeriodSeconds": 3600}),
        ),
    ] {
        let applied = run.apply(&object, &ns).await;
        run.info(&format!(
            "{}/{} applied",
            object["kind"].as_str().unwrap_or_default(),
            applied.metadata.name.unwrap_or_default()
        ));
    }
    let critical = json!({"priorityClassName": "system-node-critical"});
    let pods = [
        (ns_a.as_str(), "critical", ("app", "critical"), critical.clone(), 6101),
        ("kube-system", sys.as_str(), ("app", "sys"), critical, 6102),
        (&ns_c, "labelled", ("tier", "batch"), json!({}), 6103),
        (&ns_b, "neighbour", ("app", "neighbour"), json!({}), 6104),
        (&ns_b, "filler", ("app", "filler"), json!({}), 6105),
    ];
    for (pod_ns, name, label, spec, pid) in pods {
        let uid = run.make_pod_with(pod_ns, name, &node, &[label], spec).await;
        run.process(pid, pod_ns, name, &uid);
    }
    let priority = run.pod(&ns_a, "critical").await.spec.and_then(|s| s.priority);
    run.info(&format!("the API server admitted {ns_a}/critical with system-node-critical: priority {priority:?}"));
    assert_eq!(priority, Some(2_000_001_000), "critical's priority");
    // An 80 GiB card's worth as NVML reports it (the device's used bytes the sum of the processes').
    let sample = |usage: &[(u32, u64)]| run.sample().set_usage_and_device(usage, usage.iter().map(|(_, b)| b).sum());
    sample(&[(6101, 2 * GI), (6102, 2 * GI), (6103, 7 * GI), (6104, 8 * GI)]);

    run.say("the agent (defaults: criticalNamespaces kube-system; --pressure-blocked-timeout 10s for a short test)");
    let identity = run.chart_agent(&ns, &release, (&node, &node_uid), "agent").await;
    let admin = run.addr(0);
    let extra = ["--pressure-blocked-timeout", "10s"];
    let _agent = run.start_agent(&identity, &node, &admin, &extra, &[("RUST_LOG", "info")], "agent.log").await;
    let started = Instant::now();

    run.say("1. critical priority in the tenant's namespace: evicted over its budget; in kube-system: never");
    run.terminating(&ns_a, "critical").await;
    run.info(&format!("evicted {} s after the agent started (overLimitSeconds 2)", started.elapsed().as_secs()));
    let over = run.event(&ns_a, "critical", "GpuMemoryOverBudget").await.note.unwrap_or_default();
    run.info(&format!("GpuMemoryOverBudget: {over}"));
    assert!(
        over.contains("criticalNamespaces: kube-system"),
        "the over event does not say why critical priority exempts nothing: {over}"
    );
    let evicting = run.event(&ns_a, "critical", "EvictingForGpuMemory").await.note.unwrap_or_default();
    run.info(&format!("EvictingForGpuMemory: {}", evicting.chars().take(260).collect::<String>()));
    let kube_system = run.event("kube-system", &sys, "GpuMemoryOverBudget").await.note.unwrap_or_default();
    run.info(&format!("kube-system: {kube_system}"));
    assert!(kube_system.contains("critical and is never evicted"), "kube-system's critical pod: {kube_system}");

    run.say("3. the tenant's label opts into a smaller-limit cluster budget that says Warn and an hour over");
    let pod = run
        .pod_until(
            &ns_c,
            "labelled",
            "labelled terminating (evicted after the administrator's 3 s, not Warn)",
            crate::harness::is_terminating,
        )
        .await;
    let labelled = run.notes(&ns_c, "labelled", "GpuMemoryOverBudget").await.remove(0);
    run.info(&format!("GpuMemoryOverBudget: {labelled}"));
    let tightened =
        format!("budget {lax_cgmb}, tightened by ClusterGpuMemoryBudget/{admin_cgmb} (action, overLimitSeconds");
    assert!(labelled.contains(&tightened), "the event does not name the tightening: {labelled}");
    assert_eq!(
        pod.metadata.deletion_grace_period_seconds,
        Some(30),
        "labelled's grace: the administrator's 30 (lax says 3600)"
    );
    run.info("evicted with 30s grace (lax's 3600 s tightened to the default 30 s of admin)");
    assert_eq!(annotation(&pod, "budget"), Some(format!("ClusterGpuMemoryBudget/{lax_cgmb}")), "labelled's record");
    let why = run.output("kubectl-gpubudget", &["why", "labelled", "-n", &ns_c]);
    for line in why.lines().take(20) {
        run.info(line);
    }
    assert!(why.contains("tightened by"), "kubectl gpubudget why does not name the tightening: {why}");

    run.say("the kubelet's part: evicted pods' processes exit, the pods are deleted");
    run.gone(&ns_a, "critical", &[6101]).await;
    run.gone(&ns_c, "labelled", &[6103]).await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert!(!run.is_terminating("kube-system", &sys).await, "kube-system's critical pod evicted");

    run.say("2. the unbudgeted pod fills the GPU (68Gi: 78Gi used, 1.6Gi free); its PodDisruptionBudget refuses every eviction");
    let pdbs = Api::<PodDisruptionBudget>::namespaced(run.admin.clone(), &ns_b);
    run.object_until(pdbs, "never", "the PodDisruptionBudget allows no disruption", |p| {
        p.status.as_ref().is_some_and(|s| s.disruptions_allowed == 0 && s.current_healthy == 1)
    })
    .await;
    let pressed = Instant::now();
    sample(&[(6102, 2 * GI), (6104, 8 * GI), (6105, 68 * GI)]);
    let blocked = run.event(&ns_b, "filler", "GpuMemoryEvictionBlocked").await.note.unwrap_or_default();
    run.info(&format!("refused: {}", blocked.chars().take(200).collect::<String>()));
    assert!(!run.is_terminating(&ns_b, "filler").await, "filler deleted before the bound");
    let deleted = tokio::time::timeout(
        crate::harness::step_timeout() + Duration::from_secs(30),
        run.terminating(&ns_b, "filler"),
    );
    let pod = deleted.await.expect("filler terminating (deleted after the bound)");
    let after = pressed.elapsed().as_secs();
    assert!(after >= 10, "filler deleted {after}s after the pressure began, before the 10 s bound");
    assert_eq!(pod.metadata.deletion_grace_period_seconds, Some(5), "filler's grace, the pressure grace 5");
    let deleting = run.event(&ns_b, "filler", "DeletingForGpuMemory").await.note.unwrap_or_default();
    run.info(&format!("deleted {after}s after the pressure began (bound 10 s, retries every 5–10 s), grace 5"));
    run.info(&format!("DeletingForGpuMemory: {}", deleting.chars().take(260).collect::<String>()));
    run.info(&format!("refusals before it: {}", run.occurrences(&ns_b, "filler", "GpuMemoryEvictionBlocked").await));
    assert!(!run.is_terminating(&ns_b, "neighbour").await, "the budgeted neighbour (8Gi of its 10Gi) was evicted");
    run.say(&format!(
        "PASS: a tenant's critical priority, a PodDisruptionBudget and a label bought no exemption ({} s)",
        run.elapsed()
    ));
}
