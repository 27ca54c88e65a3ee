//! Shares that hold against the tenant (issue 51; formerly shares-tenant.sh): the chart's RBAC, admission policies
//! and eviction webhook (URL mode), the operator (status, the webhook) and one agent (token bound to its Node, the
//! demo's H100 replayed, 79.6 GiB). A tenant with `edit` in its namespace tries each door; KAI-Scheduler's binder
//! (its ServiceAccount kai-scheduler/binder, which the chart exempts) binds; another scheduler's identity
//! (pods/binding allowed, not exempt) tries too. Each identity is the admin impersonating it (`kubectl --as`).
//! 1. a GpuMemoryBudget `shares` {selector: {}, limit: 80Gi, share: {}, overLimitSeconds: 10};
//! 2. the tenant creates `kai` (schedulerName kai-scheduler, gpu-fraction "0.25", not bound): allowed; a Binding of
//!    its own (pods/binding, bindings): refused (RBAC); another scheduler's Binding carrying gpu-fraction: refused
//!    (the policy); KAI's binder binds it: allowed;
//! 3. on the bound pod the tenant's rewrite (gpu-fraction=1), removal, gpu-fraction-num-devices added, gpu-memory
//!    instead, through the pod and pods/status: all refused; a label change: allowed;
//! 4. the tenant creates pods already bound (spec.nodeName): schedulerName kai-scheduler with gpu-fraction "1",
//!    gpu-memory, num-devices: refused; with another scheduler and gpu-fraction "1": allowed, and the agent gives it
//!    no share (the budget's 80Gi, no gpubudget.io/share);
//! 5. HAMi pods with nvidia.com/gpumem 20000, 2e4 and 3000: read back as the API server stores them (20k, 20e3, 3k)
//!    and held to 20000, 20000 and 3000 MiB by the agent; hami-20000 at 20001 MiB: Over, naming "HAMi gpumem 20000
//!    MiB";
//! 6. the agent's defence in depth: KAI's binder (exempt) rewrites kai's gpu-fraction to 1: the agent keeps the
//!    first share (19.9Gi, a quarter of the card), tells GpuMemoryShareChangeIgnored once, records what it ignored;
//!    kai at 30Gi is Over "of 19.9Gi" and evicted 10 s later;
//! 7. under pressure after a rewrite: two KAI pods at 0.5, bound by KAI's binder; the binder rewrites pa's share to
//!    1; pa at 50 GiB, pb at 28 GiB (663 MiB free): pa is relieved for pressure (EvictingForGpuMemory "under
//!    memory pressure", at once), pb never: a rewrite buys no guarantee under pressure.
//!
//! The scripts replayed an 80 GiB card; a KAI fraction is of the card's memory, so here 0.25 is 19.9Gi and 0.5
//! 39.8Gi where the script's figures were 20Gi and 40Gi.

use std::time::{Duration, Instant};

use gpubudget_demo::stack::GPU_TOTAL;
use k8s_openapi::api::core::v1::{Namespace, Pod};
use kube::ResourceExt;
use kube::api::{Api, Patch, PatchParams, PostParams};
use serde_json::{Value, json};

use crate::harness::{
    GI, RBAC_AND_POLICIES, Run, Workloads, allowed, annotate, annotation, bind, binding, bindings, forbidden,
    held_share, held_to, is_terminating, patch_pod,
};

/// A mebibyte.
const MI: u64 = 1 << 20;
/// KAI-Scheduler's namespace, as the chart's default `shares.kai.namespace`.
const NS_KAI: &str = "kai-scheduler";

/// A tenant's pod of one container `main` (the run's label), `annotations` and `limits` as given; bound to `node`
/// when given (created with `spec.nodeName`).
fn pod(ns: &str, id: &str, name: &str, scheduler: &str, node: Option<&str>, annotations: Value, limits: Value) -> Pod {
    let mut spec = json!({"schedulerName": scheduler, "containers": [{"name": "main",
        "image": "nvidia/cuda:12.4.1-base-ubuntu22.04", "resources": {"limits": limits}}]});
    if let Some(node) = node {
        spec["nodeName"] = node.into();
    }
    serde_json::from_value(json!({"metadata": {"name": name, "namespace": ns, "labels": {"e2e.gpubudget.io/run": id},
        "annotations": annotations}, "spec": spec}))
    .expect("a pod")
}

pub async fn doors() {
    let mut run = Run::start("gpubudget-st", &["gpubudget-agent", "gpubudget-operator"]).await;
    let id = run.id.clone();
    let release = format!("gpubudget-st-{id}");
    run.say("control plane, CRDs, the chart (RBAC, admission policies, eviction webhook in URL mode), one node");
    run.apply_crds().await;
    let ns = run.namespace(&release).await; // the release's (its ServiceAccounts)
    let ns_t = run.namespace(&format!("{release}-t")).await; // the tenant's
    let namespaces = Api::<Namespace>::all(run.admin.clone());
    if namespaces.get_opt(NS_KAI).await.expect("namespaces read").is_none() {
        // Shared with other runs, as KAI's own would be: left in place.
        run.apply(&json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NS_KAI}}), NS_KAI).await;
    }
    let tls = run.webhook_cert();
    let webhook = run.addr(2);
    let mut kinds = RBAC_AND_POLICIES.to_vec();
    kinds.push("ValidatingWebhookConfiguration");
    let applied = run.apply_chart(&release, &ns, &kinds, Some((&webhook, &tls.join("ca.crt")))).await;
    for v in applied.iter().filter(|v| v["kind"] == "ValidatingAdmissionPolicy") {
        run.info(&format!("ValidatingAdmissionPolicy/{}", v["metadata"]["name"].as_str().unwrap_or_default()));
    }
    let node = format!("{release}-n1");
    let node_uid = run.node(&node).await;
    let account = |name: &str, ns: &str| {
        json!({"apiVersion": "v1", "kind": "ServiceAccount",
            "metadata": {"name": name, "namespace": ns}})
    };
    run.tenant_with_edit(&ns_t).await;
    run.apply(&account("binder", NS_KAI), NS_KAI).await; // left in place with its namespace
    run.apply(&account("other-scheduler", &ns), &ns).await;
    // What a scheduler's binder may do: bind pods, and patch them (KAI's binder writes annotations).
    let binder_role = format!("e2e-binder-{id}");
    run.owns("rbac.authorization.k8s.io", "v1", "ClusterRole", None, &binder_role);
    run.owns("rbac.authorization.k8s.io", "v1", "ClusterRoleBinding", None, &binder_role);
    run.apply(
        &json!({"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole", "metadata": {"name": binder_role},
            "rules": [{"apiGroups": [""], "resources": ["pods/binding", "bindings"], "verbs": ["create"]},
                      {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "patch", "update"]}]}),
        &ns,
    )
    .await;
    run.apply(
        &json!({"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
            "metadata": {"name": binder_role},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": binder_role},
            "subjects": [{"kind": "ServiceAccount", "name": "binder", "namespace": NS_KAI},
                         {"kind": "ServiceAccount", "name": "other-scheduler", "namespace": ns}]}),
        &ns,
    )
    .await;
    let tenant_name = format!("system:serviceaccount:{ns_t}:tenant");
    let binder_name = format!("system:serviceaccount:{NS_KAI}:binder");
    let other_name = format!("system:serviceaccount:{ns}:other-scheduler");
    let (tenant, binder, other) =
        (run.as_user(&tenant_name).await, run.as_user(&binder_name).await, run.as_user(&other_name).await);
    run.info(&format!("the tenant {tenant_name} (edit), KAI's binder {binder_name}, another scheduler {other_name}"));
    let operator = run.chart_operator(&ns, &release).await;
    let agent = run.chart_agent(&ns, &release, (&node, &node_uid), "agent").await;
    let mut w = Workloads::new(&run, &ns_t, &node, 5100);
    w.sample_processes(&[]);

    run.say(&format!(
        "the release binaries, out of cluster: the operator (eviction webhook on {webhook}) and the agent (bound to \
         {node})"
    ));
    let _binaries = run.start_release((&operator, &agent), (&release, &ns), &node, &webhook).await;
    let mut summary = Vec::new();

    run.say("1. the budget: {selector: {}, limit: 80Gi, share: {}, overLimitSeconds: 10}");
    run.apply(
        &json!({"apiVersion": "gpubudget.io/v1alpha1", "kind": "GpuMemoryBudget",
            "metadata": {"name": "shares", "namespace": ns_t},
            "spec": {"selector": {}, "limit": "80Gi", "share": {}, "overLimitSeconds": 10}}),
        &ns_t,
    )
    .await;
    run.info(&format!("GpuMemoryBudget {ns_t}/shares applied"));

    // KAI's fractions of the card (the replayed H100, 79.6 GiB): exact, the card's bytes divisible by 4.
    let (quarter, half) = (GPU_TOTAL / 4, GPU_TOTAL / 2);
    let (note_quarter, note_half) =
        ("KAI gpu-fraction 0.25 of 79.6Gi = 19.9Gi", "KAI gpu-fraction 0.5 of 79.6Gi = 39.8Gi");
    let tenant_pods = Api::<Pod>::namespaced(tenant.clone(), &ns_t);
    let pp = PostParams::default();
    let rbac_binding = "cannot create resource \"pods/binding\"";
    let rbac_bindings = "cannot create resource \"bindings\"";
    let shares_policy = format!("ValidatingAdmissionPolicy '{release}-agent-shares'");
    let binding_policy = format!("ValidatingAdmissionPolicy '{release}-agent-shares-binding'");

    run.say("2. a KAI pod created unbound; who may bind it");
    let kai = pod(&ns_t, &id, "kai", "kai-scheduler", None, json!({"gpu-fraction": "0.25"}), json!({}));
    let kai = allowed(
        &run,
        "the tenant creates kai (kai-scheduler, gpu-fraction 0.25, unbound)",
        tenant_pods.create(&pp, &kai).await,
    );
    let kai_uid = kai.uid().expect("a uid");
    let plain = binding(&ns_t, "kai", &node, json!({}));
    let carrying = binding(&ns_t, "kai", &node, json!({"gpu-fraction": "1"}));
    forbidden(&run, "the tenant's Binding through pods/binding", rbac_binding, bind(&tenant, &plain).await);
    forbidden(&run, "the tenant's Binding through bindings", rbac_bindings, bindings(&tenant, &plain).await);
    let what = "another scheduler's Binding carrying gpu-fraction 1 through pods/binding";
    forbidden(&run, what, &binding_policy, bind(&other, &carrying).await);
    let what = "another scheduler's Binding carrying gpu-fraction 1 through bindings";
    forbidden(&run, what, &binding_policy, bindings(&other, &carrying).await);
    let bound = Instant::now();
    allowed(&run, "KAI's binder binds kai through pods/binding", bind(&binder, &plain).await);
    let kai_node = run.pod(&ns_t, "kai").await.spec.and_then(|s| s.node_name);
    assert_eq!(kai_node.as_deref(), Some(node.as_str()), "kai is not bound to {node}");
    w.running("kai", &kai_uid).await;
    w.sample_processes(&[("kai", 10 * GI)]);
    run.pod_until(&ns_t, "kai", &format!("kai held to 19.9Gi ({note_quarter})"), |p| held_to(p, quarter, note_quarter))
        .await;
    summary.push(format!(
        "kai bound by KAI's binder → its share recorded by the agent: {:.1}s",
        bound.elapsed().as_secs_f64()
    ));

    run.say(
        "3. the tenant on the bound pod: rewrite, removal, num-devices, gpu-memory, through the pod and pods/status",
    );
    for t in 1..=3 {
        let asked = Instant::now();
        let result = patch_pod(&tenant, &ns_t, "kai", annotate("gpu-fraction", Some("1"))).await;
        let secs = asked.elapsed().as_secs_f64();
        forbidden(&run, &format!("the tenant rewrites kai's gpu-fraction to 1 (try {t})"), &shares_policy, result);
        summary.push(format!("refused rewrite {t}: {secs:.2}s round trip (kube::Client, impersonated)"));
    }
    for (what, body) in [
        ("the tenant removes kai's gpu-fraction", annotate("gpu-fraction", None)),
        ("the tenant adds gpu-fraction-num-devices 8 to kai", annotate("gpu-fraction-num-devices", Some("8"))),
        ("the tenant adds gpu-memory 81920 to kai", annotate("gpu-memory", Some("81920"))),
        (
            "the tenant swaps kai's gpu-fraction for gpu-memory 81920",
            json!({"metadata": {"annotations": {"gpu-fraction": null, "gpu-memory": "81920"}}}),
        ),
    ] {
        forbidden(&run, what, &shares_policy, patch_pod(&tenant, &ns_t, "kai", body).await);
    }
    let through_status = tenant_pods
        .patch_status("kai", &PatchParams::default(), &Patch::Merge(&annotate("gpu-fraction", Some("1"))))
        .await;
    let what = "the tenant rewrites kai's gpu-fraction through pods/status";
    forbidden(&run, what, "cannot patch resource \"pods/status\"", through_status);
    let labelled = json!({"metadata": {"labels": {"team": "a"}}});
    allowed(&run, "the tenant labels kai team=a", patch_pod(&tenant, &ns_t, "kai", labelled).await);
    let fraction = run.pod(&ns_t, "kai").await.annotations().get("gpu-fraction").cloned();
    assert_eq!(fraction.as_deref(), Some("0.25"), "kai's gpu-fraction changed");
    run.info("ok: kai's gpu-fraction is still 0.25");

    run.say("4. pods created already bound (spec.nodeName): they never passed KAI");
    for (name, annotations) in [
        ("bypass", json!({"gpu-fraction": "1"})),
        ("bypass-mem", json!({"gpu-memory": "81920"})),
        ("bypass-n", json!({"gpu-fraction-num-devices": "4"})),
    ] {
        let p = pod(&ns_t, &id, name, "kai-scheduler", Some(&node), annotations.clone(), json!({}));
        let what = format!("the tenant creates {name} (kai-scheduler, {annotations}, spec.nodeName set)");
        forbidden(&run, &what, &shares_policy, tenant_pods.create(&pp, &p).await);
    }
    let p =
        pod(&ns_t, &id, "bypass-default", "default-scheduler", Some(&node), json!({"gpu-fraction": "1"}), json!({}));
    let what = "the tenant creates bypass-default (default-scheduler, gpu-fraction 1, spec.nodeName set)";
    let created = allowed(&run, what, tenant_pods.create(&pp, &p).await);
    w.running("bypass-default", &created.uid().expect("a uid")).await;
    w.sample_processes(&[("kai", 10 * GI), ("bypass-default", 30 * GI)]);
    run.pod_until(&ns_t, "bypass-default", "bypass-default recorded", |p| annotation(p, "state").is_some()).await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    let p = run.pod(&ns_t, "bypass-default").await;
    assert_eq!(annotation(&p, "share"), None, "bypass-default got a share");
    assert_eq!(annotation(&p, "state").as_deref(), Some("Within"), "bypass-default's state");
    run.info(
        "ok: bypass-default (another scheduler, gpu-fraction 1) at 30Gi: Within under the budget's 80Gi, no \
         gpubudget.io/share",
    );

    run.say("5. HAMi's nvidia.com/gpumem as the API server stores it");
    for (written, stored) in [("20000", "20k"), ("2e4", "20e3"), ("3000", "3k")] {
        let name = format!("hami-{written}");
        let limits = json!({"nvidia.com/gpu": "1", "nvidia.com/gpumem": written});
        let p = pod(&ns_t, &id, &name, "hami-scheduler", Some(&node), json!({}), limits);
        let created = allowed(&run, &format!("the tenant creates {name}"), tenant_pods.create(&pp, &p).await);
        let limits = created.spec.as_ref().and_then(|s| s.containers[0].resources.as_ref()?.limits.clone());
        let got = limits.and_then(|l| l.get("nvidia.com/gpumem").map(|q| q.0.clone())).unwrap_or_default();
        run.info(&format!("{name}: written {written}, stored {got}"));
        assert_eq!(got, stored, "{name}'s nvidia.com/gpumem as stored");
        summary.push(format!("nvidia.com/gpumem {written} stored as {got}"));
        w.running(&name, &created.uid().expect("a uid")).await;
    }
    let hami = |h20000: u64| {
        [
            ("kai", 10 * GI),
            ("bypass-default", 30 * GI),
            ("hami-20000", h20000),
            ("hami-2e4", 19 * GI),
            ("hami-3000", 2 * GI),
        ]
    };
    w.sample_processes(&hami(19 * GI));
    for (name, mib, note) in [
        ("hami-20000", 20000, "HAMi gpumem 20000 MiB = 19.5Gi"),
        ("hami-2e4", 20000, "HAMi gpumem 20000 MiB = 19.5Gi"),
        ("hami-3000", 3000, "HAMi gpumem 3000 MiB = 2.9Gi"),
    ] {
        let what = format!("{name} held to {mib} MiB");
        let p = run.pod_until(&ns_t, name, &what, |p| held_to(p, mib * MI, note)).await;
        run.info(&format!("{name}: gpubudget.io/share {}", annotation(&p, "share").unwrap_or_default()));
    }
    let sampled = Instant::now();
    w.sample_processes(&hami(20001 * MI));
    let what = "GpuMemoryOverBudget on hami-20000 at 20001 MiB";
    let t_hami = run.timed(what, sampled, || run.has_event(&ns_t, "hami-20000", "GpuMemoryOverBudget")).await;
    let note = run.notes(&ns_t, "hami-20000", "GpuMemoryOverBudget").await.pop().unwrap_or_default();
    run.info(&format!("hami-20000: {note}"));
    assert!(note.contains("HAMi gpumem 20000 MiB = 19.5Gi"), "hami-20000's Over note does not name its share: {note}");
    summary.push(format!("hami-20000 at 20001 MiB → Over event {t_hami:.1}s after the sample"));

    run.say("6. the agent's defence in depth: KAI's binder (exempt from the policy) rewrites kai's share to 1");
    let rewritten = Instant::now();
    let what = "KAI's binder rewrites kai's gpu-fraction to 1";
    allowed(&run, what, patch_pod(&binder, &ns_t, "kai", annotate("gpu-fraction", Some("1"))).await);
    let ignored = "GpuMemoryShareChangeIgnored";
    let t_ign = run.timed(&format!("{ignored} on kai"), rewritten, || run.has_event(&ns_t, "kai", ignored)).await;
    let event = run.events(&ns_t, "kai", ignored).await.remove(0);
    let note = event.note.clone().unwrap_or_default();
    run.info(&format!("kai: {} {ignored}: {note}", event.type_.as_deref().unwrap_or_default()));
    assert_eq!(event.type_.as_deref(), Some("Warning"), "{ignored} is not a Warning");
    let what = "kai's record keeps 19.9Gi and says what it ignored";
    let p = run
        .pod_until(&ns_t, "kai", what, |p| {
            held_share(p).is_some_and(|s| {
                s.limit_bytes == quarter
                    && s.ignored.as_deref().is_some_and(|i| i.contains("KAI gpu-fraction 1 of 79.6Gi"))
            })
        })
        .await;
    run.info(&format!("kai: gpubudget.io/share {}", annotation(&p, "share").unwrap_or_default()));
    summary.push(format!("exempt rewrite → {ignored} {t_ign:.1}s"));
    let sampled = Instant::now();
    w.sample_processes(&[
        ("kai", 30 * GI),
        ("bypass-default", 30 * GI),
        ("hami-20000", 19 * GI),
        ("hami-2e4", 19 * GI),
        ("hami-3000", 2 * GI),
    ]);
    let t_over = run
        .timed("GpuMemoryOverBudget on kai at 30Gi", sampled, || run.has_event(&ns_t, "kai", "GpuMemoryOverBudget"))
        .await;
    let note = run.notes(&ns_t, "kai", "GpuMemoryOverBudget").await.pop().unwrap_or_default();
    run.info(&format!("kai: {note}"));
    assert!(note.contains("of 19.9Gi"), "kai is not held to 19.9Gi: {note}");
    let over = run.events(&ns_t, "kai", "GpuMemoryOverBudget").await.remove(0);
    let (after, _) = run.evicted_after(&ns_t, "kai", &over, 10).await;
    summary.push(format!(
        "kai at 30Gi (rewritten to 1 by an exempt identity): Over {t_over:.1}s after the sample, evicted {after}s \
         after Over"
    ));
    assert_eq!(run.occurrences(&ns_t, "kai", ignored).await, 1, "{ignored} repeated");
    run.info(&format!("ok: {ignored} told once"));

    run.say(
        "7. under pressure after a rewrite: pa and pb at gpu-fraction 0.5, pa's share rewritten to 1 by KAI's binder",
    );
    w.sample(&[("bypass-default", GI)]);
    for name in ["pa", "pb"] {
        let p = pod(&ns_t, &id, name, "kai-scheduler", None, json!({"gpu-fraction": "0.5"}), json!({}));
        let what = format!("the tenant creates {name} (kai-scheduler, gpu-fraction 0.5, unbound)");
        let created = allowed(&run, &what, tenant_pods.create(&pp, &p).await);
        let what = format!("KAI's binder binds {name}");
        allowed(&run, &what, bind(&binder, &binding(&ns_t, name, &node, json!({}))).await);
        w.running(name, &created.uid().expect("a uid")).await;
    }
    w.sample(&[("bypass-default", GI), ("pa", 10 * GI), ("pb", 10 * GI)]);
    run.pod_until(&ns_t, "pa", &format!("pa held to 39.8Gi ({note_half})"), |p| held_to(p, half, note_half)).await;
    run.pod_until(&ns_t, "pb", "pb held to 39.8Gi", |p| held_to(p, half, note_half)).await;
    let what = "KAI's binder rewrites pa's gpu-fraction to 1";
    allowed(&run, what, patch_pod(&binder, &ns_t, "pa", annotate("gpu-fraction", Some("1"))).await);
    run.until(&format!("{ignored} on pa"), || run.has_event(&ns_t, "pa", ignored)).await;
    let pressed = Instant::now();
    w.sample(&[("bypass-default", GI), ("pa", 50 * GI), ("pb", 28 * GI)]);
    run.pod_until(&ns_t, "pa", "pa terminating (relieved)", is_terminating).await;
    let t_press = pressed.elapsed().as_secs_f64();
    let note = run.notes(&ns_t, "pa", "EvictingForGpuMemory").await.into_iter().next().unwrap_or_default();
    run.info(&format!("pa: {note}"));
    assert!(note.contains("under memory pressure"), "pa was not relieved for pressure: {note}");
    assert!(!run.is_terminating(&ns_t, "pb").await, "pb, within its 0.5, was evicted");
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert!(!run.is_terminating(&ns_t, "pb").await, "pb, within its 0.5, was evicted");
    run.info("ok: pb kept");
    summary.push(format!(
        "pa rewritten to 1, at 50 GiB beside pb at 28 GiB (663 MiB free): relieved for pressure, seen terminating \
         {t_press:.1}s after the sample; pb kept"
    ));

    run.say("summary");
    for line in &summary {
        run.info(line);
    }
    run.say(&format!(
        "PASS: every door to a share refused the tenant; the agent held each first share ({} s)",
        run.elapsed()
    ));
}
