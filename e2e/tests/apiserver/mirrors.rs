//! Budget mirrors turned off, and the operator gone (issue 43, item 2; formerly mirrors-off.sh): the operator (out
//! of cluster, its ServiceAccount's token, POD_NAMESPACE the release's, no leader election) keeps the mirrors'
//! Lease; the agent (token bound to its Node) runs with `--mirrors-lease`.
//! 1. Mirrors on: budget `a` (16Gi) over pod pa (10 GiB, Within); the agent reads the mirrors
//!    (gpubudget_budget_specs_from_mirrors{kind="GpuMemoryBudget"} 1), the Lease is renewed; `a`'s status says
//!    enforcedGeneration and NodesCurrent True/MirrorCurrent.
//! 2. The operator restarted with `--budget-mirrors=false` (what `helm upgrade --set operator.budgetMirrors=false`
//!    does: the operator restarted, the agents not): the Lease deleted, the agent's gauge 0 and a Warning
//!    GpuBudgetMirrorsNotCurrent on its Node, timed; every mirror of the run then deleted by hand.
//! 3. A new budget `b` (4Gi) over pod pb (10 GiB, no budget before), and `a` tightened to 4Gi: the time to
//!    GpuMemoryOverBudget on each; `a`'s status: enforcedGeneration its generation, NodesCurrent True/ReadDirectly;
//!    the eviction events name the generation they acted under.
//! 4. Mirrors on again, then the operator killed (SIGKILL: nothing deletes the Lease) and budget `c` (16Gi over pod
//!    pc at 10 GiB) tightened to 4Gi while its mirror still says 16Gi: the time until the agent goes back to the
//!    budgets (the Lease no longer renewed under its eyes) and enforces the edit.

use std::time::{Duration, Instant};

use gpubudget_common::GpuMemoryBudget;
use k8s_openapi::api::coordination::v1::Lease;
use kube::api::{Api, DeleteParams, DynamicObject, ListParams, Patch, PatchParams};
use serde_json::{Value, json};

use crate::harness::{
    GI, Operator, RBAC_AND_POLICIES, Run, Workloads, annotation, gpubudget_resource, metric, metrics, mirrors_lease,
};

/// NodesCurrent's `status/reason` of a budget, and whether enforcedGeneration is its generation.
fn nodes_current(b: &GpuMemoryBudget) -> (String, bool) {
    let status = b.status.clone().unwrap_or_default();
    let condition = status.conditions.iter().find(|c| c.type_ == "NodesCurrent");
    let said = condition.map(|c| format!("{}/{}", c.status, c.reason)).unwrap_or_default();
    (said, status.enforced_generation.is_some() && status.enforced_generation == b.metadata.generation)
}

fn show_status(run: &Run, b: &GpuMemoryBudget) {
    let status = b.status.clone().unwrap_or_default();
    let condition = status.conditions.iter().find(|c| c.type_ == "NodesCurrent");
    run.info(&format!(
        "gmb {}: generation {:?}, status.enforcedGeneration {:?}, NodesCurrent {}: {}",
        b.metadata.name.as_deref().unwrap_or_default(),
        b.metadata.generation,
        status.enforced_generation,
        nodes_current(b).0,
        condition.map(|c| c.message.as_str()).unwrap_or_default()
    ));
}

pub async fn mirrors_off() {
    let mut run = Run::start("gpubudget-mo", &["gpubudget-agent", "gpubudget-operator"]).await;
    let id = run.id.clone();
    let release = format!("gpubudget-mo-{id}");
    run.say("control plane, CRDs, the chart's RBAC (its mirrors Roles included) and admission policies, one node");
    run.apply_crds().await;
    let ns = run.namespace(&release).await;
    let ns_a = run.namespace(&format!("{release}-a")).await;
    run.apply_chart(&release, &ns, RBAC_AND_POLICIES, None).await;
    let node = format!("{release}-n1");
    let node_uid = run.node(&node).await;
    let lease = mirrors_lease(&release);
    let mut w = Workloads::new(&run, &ns_a, &node, 7300);
    w.pod("pa").await;
    w.pod("pb").await;
    w.sample(&[("pa", 10 * GI), ("pb", 10 * GI)]);
    let operator = run.chart_operator(&ns, &release).await;
    let mut operator =
        Operator::new(&run, operator, &ns, run.addr(1), None).with_args(&["--mirrors-lease-name", &lease]);
    let agent_identity = run.chart_agent(&ns, &release, (&node, &node_uid), "agent").await;
    let agent_admin = run.addr(0);
    let leases = Api::<Lease>::namespaced(run.admin.clone(), &ns);
    let budgets = Api::<GpuMemoryBudget>::namespaced(run.admin.clone(), &ns_a);
    let mirrors =
        Api::<DynamicObject>::namespaced_with(run.admin.clone(), &ns_a, &gpubudget_resource("GpuMemoryBudgetMirror"));
    let gauge = || async {
        metric(&metrics(&agent_admin).await, "gpubudget_budget_specs_from_mirrors{kind=\"GpuMemoryBudget\"}")
    };
    let lease_there = || async { leases.get_opt(&lease).await.expect("leases").is_some() };
    let renewed =
        || async { leases.get_opt(&lease).await.expect("leases").and_then(|l| l.spec?.renew_time).map(|t| t.0) };
    let not_current =
        || async { run.node_events(&node, "GpuBudgetMirrorsNotCurrent").await.iter().map(|(n, _)| n).sum::<i32>() };
    let budget = |name: &str, spec: Value| json!({"apiVersion": "gpubudget.io/v1alpha1", "kind": "GpuMemoryBudget", "metadata": {"name": name, "namespace": ns_a}, "spec": spec});
    let status_says = |name: &'static str, want: &'static str| {
        let (budgets, run) = (budgets.clone(), &run);
        async move {
            let what = format!("{name}'s status: enforcedGeneration its generation, NodesCurrent {want}");
            let b = run.object_until(budgets, name, &what, move |b| nodes_current(b) == (want.to_owned(), true)).await;
            show_status(run, &b);
        }
    };
    let mut summary = Vec::new();

    run.say(&format!(
        "1. mirrors on: the operator (--mirrors-lease-name {lease}) and the agent (--mirrors-lease {ns}/{lease})"
    ));
    let mut op = operator.start(&[]).await;
    let mirrors_lease = format!("{ns}/{lease}");
    let extra = ["--mirrors-lease", mirrors_lease.as_str()];
    let _agent =
        run.start_agent(&agent_identity, &node, &agent_admin, &extra, &[("RUST_LOG", "info")], "agent.log").await;
    run.apply(&budget("a", json!({"selector": {"matchLabels": {"app": "pa"}}, "limit": "16Gi"})), &ns_a).await;
    run.object_until(mirrors.clone(), "a", "gmbmirror a written", |_| true).await;
    run.until(&format!("the Lease {ns}/{lease} renewed"), lease_there).await;
    run.until("the agent reads the mirrors (gauge 1)", || async { gauge().await.as_deref() == Some("1") }).await;
    run.pod_until(&ns_a, "pa", "pa recorded Within under a", |p| {
        (annotation(p, "state").as_deref(), annotation(p, "budget").as_deref()) == (Some("Within"), Some("a"))
    })
    .await;
    status_says("a", "True/MirrorCurrent").await;
    let r1 = renewed().await;
    tokio::time::sleep(Duration::from_secs(11)).await;
    let r2 = renewed().await;
    assert_ne!(r1, r2, "the Lease was not renewed in 11 s");
    run.info(&format!("renewTime {r1:?} → {r2:?} (every 10 s)"));
    let before = not_current().await;
    run.info(&format!("GpuBudgetMirrorsNotCurrent on the Node so far: {before}"));

    run.say("2. the operator restarted with --budget-mirrors=false (helm upgrade --set operator.budgetMirrors=false); the agent not");
    let stopped = Instant::now();
    op.stop();
    run.info(&format!(
        "operator stopped (SIGTERM) in {:.1}s; the Lease is {}",
        stopped.elapsed().as_secs_f64(),
        if lease_there().await { "still there" } else { "gone" }
    ));
    let restarted = Instant::now();
    let mut op = operator.start(&["--budget-mirrors=false"]).await;
    let t_lease = run
        .timed("the Lease deleted (since the new operator started)", restarted, || async { !lease_there().await })
        .await;
    let t_gauge = run
        .timed("the agent's gauge 0 (since the new operator started)", restarted, || async {
            gauge().await.as_deref() == Some("0")
        })
        .await;
    let t_event = run
        .timed("GpuBudgetMirrorsNotCurrent on the Node (since the new operator started)", restarted, || async {
            not_current().await > before
        })
        .await;
    run.info(&format!(
        "since the old operator stopped: gauge 0 by {:.1}s at the latest",
        stopped.elapsed().as_secs_f64()
    ));
    for (n, note) in run.node_events(&node, "GpuBudgetMirrorsNotCurrent").await {
        run.info(&format!("GpuBudgetMirrorsNotCurrent ({n}): {note}"));
    }
    if let Some(line) = op.log_text().lines().rfind(|l| l.contains("not vouching for the mirrors")) {
        run.info(&format!("operator: {}", line.chars().take(300).collect::<String>()));
    }
    summary.push(format!(
        "mirrors off (operator restarted with --budget-mirrors=false): Lease deleted {t_lease:.1}s, agent gauge 0 \
         {t_gauge:.1}s, Node event {t_event:.1}s after the new operator started"
    ));
    status_says("a", "True/ReadDirectly").await;
    let left = mirrors.list(&ListParams::default()).await.expect("mirrors").items.len();
    run.info(&format!("every mirror of the run deleted by hand ({left} in {ns_a}; other runs' are not this test's)"));
    mirrors.delete_collection(&DeleteParams::default(), &ListParams::default()).await.expect("mirrors deleted");
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(gauge().await.as_deref(), Some("0"), "the agent reads the mirrors again");

    run.say("3. budget b (4Gi) over pb at 10 GiB, and a tightened from 16Gi to 4Gi: read from the budgets themselves");
    let edited = Instant::now();
    run.apply(&budget("b", json!({"selector": {"matchLabels": {"app": "pb"}}, "limit": "4Gi"})), &ns_a).await;
    budgets
        .patch("a", &PatchParams::default(), &Patch::Merge(&json!({"spec": {"limit": "4Gi"}})))
        .await
        .expect("a tightened");
    let t_b = run
        .timed("GpuMemoryOverBudget on pb (new budget b)", edited, || run.has_event(&ns_a, "pb", "GpuMemoryOverBudget"))
        .await;
    let t_a = run
        .timed("GpuMemoryOverBudget on pa (a tightened)", edited, || run.has_event(&ns_a, "pa", "GpuMemoryOverBudget"))
        .await;
    summary.push(format!(
        "mirrors off, every mirror deleted: GpuMemoryOverBudget {t_b:.1}s after budget b was created (pb), {t_a:.1}s \
         after a was tightened (pa)"
    ));
    for pod in ["pa", "pb"] {
        run.info(&format!("{pod}: {}", run.notes(&ns_a, pod, "GpuMemoryOverBudget").await.remove(0)));
    }
    let written = mirrors.list(&ListParams::default()).await.expect("mirrors").items.len();
    run.info(&format!("gmbmirrors in {ns_a} now: {written} (mirrors off: none written)"));
    status_says("a", "True/ReadDirectly").await;
    status_says("b", "True/ReadDirectly").await;
    let evicting = run.event(&ns_a, "pa", "EvictingForGpuMemory").await.note.unwrap_or_default();
    run.info(&format!("pa: {evicting}"));
    let generation = budgets.get("a").await.expect("a").metadata.generation.expect("a generation");
    let under = format!("; under generation {generation} of budget {ns_a}/a");
    assert!(evicting.ends_with(&under), "the eviction does not name generation {generation} of {ns_a}/a: {evicting}");
    let evicting = run.event(&ns_a, "pb", "EvictingForGpuMemory").await.note.unwrap_or_default();
    run.info(&format!("pb: {evicting}"));
    // The kubelet's part: the evicted pods' processes exit, the pods go.
    w.sample(&[]);
    w.gone("pa").await;
    w.gone("pb").await;

    run.say("4. mirrors on again; then the operator killed (SIGKILL) and a budget edited while its mirror still has the old spec");
    op.stop();
    w.pod("pc").await;
    w.sample(&[("pc", 10 * GI)]);
    run.apply(&budget("c", json!({"selector": {"matchLabels": {"app": "pc"}}, "limit": "16Gi"})), &ns_a).await;
    let restarted = Instant::now();
    let mut op = operator.start(&[]).await;
    let t_back = run
        .timed(
            "the agent reads the mirrors again (gauge 1, since the operator started with mirrors on)",
            restarted,
            || async { gauge().await.as_deref() == Some("1") },
        )
        .await;
    run.object_until(mirrors.clone(), "c", "gmbmirror c written", |_| true).await;
    run.pod_until(&ns_a, "pc", "pc recorded Within under c", |p| {
        (annotation(p, "state").as_deref(), annotation(p, "budget").as_deref()) == (Some("Within"), Some("c"))
    })
    .await;
    status_says("c", "True/MirrorCurrent").await;
    let before = not_current().await;
    op.crash();
    let killed = Instant::now();
    run.info(&format!("operator killed (SIGKILL): the Lease stays, renewed last at {:?}", renewed().await));
    budgets
        .patch("c", &PatchParams::default(), &Patch::Merge(&json!({"spec": {"limit": "4Gi"}})))
        .await
        .expect("c tightened");
    let edited = Instant::now();
    let mirror_limit = mirrors.get("c").await.expect("c's mirror").data["spec"]["budget"]["limit"].clone();
    run.info(&format!(
        "c tightened to 4Gi (generation {:?}); its mirror still says {mirror_limit}",
        budgets.get("c").await.expect("c").metadata.generation
    ));
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert!(
        !run.has_event(&ns_a, "pc", "GpuMemoryOverBudget").await,
        "pc judged over 3 s after the edit, while the agent should read the stale mirror"
    );
    // The Lease runs out (its duration) before the agent leaves the mirrors: longer than a step (90 s, as the
    // script waited).
    let long = Duration::from_secs(90);
    let t_fall = run
        .timed_within("the agent back on the budgets (gauge 0, since the kill)", killed, long, || async {
            gauge().await.as_deref() == Some("0")
        })
        .await;
    let t_over = run
        .timed_within("GpuMemoryOverBudget on pc (c's edit enforced, since the edit)", edited, long, || {
            run.has_event(&ns_a, "pc", "GpuMemoryOverBudget")
        })
        .await;
    run.info(&format!(
        "since the kill: {:.1}s; the Lease {}",
        killed.elapsed().as_secs_f64(),
        if lease_there().await {
            format!("still there, renewed last at {:?}", renewed().await)
        } else {
            "gone".to_owned()
        }
    ));
    run.timed_within("a new GpuBudgetMirrorsNotCurrent on the Node (since the kill)", killed, long, || async {
        not_current().await > before
    })
    .await;
    for (n, note) in run.node_events(&node, "GpuBudgetMirrorsNotCurrent").await {
        run.info(&format!("GpuBudgetMirrorsNotCurrent ({n}): {note}"));
    }
    run.info(&format!("pc: {}", run.notes(&ns_a, "pc", "GpuMemoryOverBudget").await.remove(0)));
    summary.push(format!("mirrors back on: the agent read them again {t_back:.1}s after the operator started"));
    summary.push(format!(
        "operator SIGKILLed with mirrors on: the agent back on the budgets {t_fall:.1}s after the kill; c's edit (16Gi \
         → 4Gi, made right after the kill) enforced (GpuMemoryOverBudget) {t_over:.1}s after the edit"
    ));
    w.sample(&[]);

    run.say("summary (real kube-apiserver, operator and agent out of cluster, replayed GPU sample)");
    for line in &summary {
        run.info(line);
    }
    run.say(&format!(
        "PASS: with the mirrors off, or their operator gone, the agent enforces every budget's current spec ({} s)",
        run.elapsed()
    ));
}
