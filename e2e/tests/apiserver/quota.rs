//! Namespace totals (ClusterGpuMemoryQuota, issue 23 part 3; formerly quota.sh): the release operator as two
//! leader-elected replicas and two release agents (one per node, each with a token bound to its Node, its own
//! fixture `/proc` and sample file) writing the records the totals are made of. As a tenant would try it:
//! - six small pods (1.5Gi each, far within their namespace's 16Gi budget) on two nodes: 9Gi of the namespace's
//!   10Gi quota, Near; then each grows to 2Gi: 12Gi, Over, though no pod is over its own budget;
//! - the leader is killed (SIGKILL, no hand-over) 3 s into the 10 s period; the other replica takes the Lease and
//!   evicts, once, the pod that started last (on the other node from the one created last), with the quota's
//!   grace, through the Eviction API, after the period: not restarted by the leader change, not repeated;
//! - the other five stay; a namespace the quota does not select holds more and keeps all its pods;
//! - `kubectl get cgmq` and the quota's status show the total, the state and the top holders;
//! - observe (#54): the quota set to `enforcement: Observe`, the five left grow over again: the pod it would evict
//!   is told once (NamespaceGpuMemoryWouldEvict, `status.namespaces[].wouldEvict`, Ready reason `Observing`, the
//!   metric) and nothing is evicted; set to `Enforce`, that pod is evicted at the next pass.

use std::time::{Duration, Instant};

use gpubudget_common::crd::{ClusterGpuMemoryQuota, NamespaceTotal};
use gpubudget_demo::stack::SampleFile;
use k8s_openapi::api::coordination::v1::Lease;
use kube::api::{Api, Patch, PatchParams};
use serde_json::json;

use crate::harness::{Binary, GI, OperatorRun, RBAC_AND_POLICIES, Run, metrics, table};

/// The pods: name, namespace suffix, node index, start offset (s), PID.
const PODS: [(&str, &str, usize, i64, u32); 8] = [
    ("q-1", "q", 0, 10, 5101),
    ("q-2", "q", 1, 20, 5102),
    ("q-3", "q", 0, 30, 5103),
    ("q-4", "q", 1, 90, 5104), // created fourth, started last: the start time decides
    ("q-5", "q", 0, 50, 5105),
    ("q-6", "q", 1, 60, 5106),
    ("r-1", "r", 0, 70, 5107),
    ("r-2", "r", 1, 80, 5108),
];

/// One sample file per node: every q pod holds `q`, every r pod `r` (`gone`'s process exited).
fn sample(samples: &[SampleFile; 2], q: u64, r: u64, gone: Option<&str>) {
    for (i, file) in samples.iter().enumerate() {
        let processes: Vec<(u32, u64)> = PODS
            .iter()
            .filter(|(name, _, node, _, _)| *node == i && Some(*name) != gone)
            .map(|(name, _, _, _, pid)| (*pid, if name.starts_with('q') { q } else { r }))
            .collect();
        file.set_usage(&processes);
    }
}

fn namespace<'a>(quota: &'a ClusterGpuMemoryQuota, ns: &str) -> Option<&'a NamespaceTotal> {
    quota.status.as_ref()?.namespaces.iter().find(|n| n.namespace == ns)
}

fn state(total: &NamespaceTotal) -> String {
    serde_json::to_value(total.state).ok().and_then(|v| v.as_str().map(str::to_owned)).unwrap_or_default()
}

pub async fn namespace_totals() {
    let mut run = Run::start("gpubudget-quota", &["gpubudget-agent", "gpubudget-operator"]).await;
    let id = run.id.clone();
    let release = format!("gpubudget-quota-{id}");
    run.say("control plane, CRDs, the chart's RBAC and admission policies");
    run.apply_crds().await;
    let ns = run.namespace(&release).await;
    let ns_q = run.namespace(&format!("{release}-q")).await; // selected by the quota: six pods on two nodes
    let ns_r = run.namespace(&format!("{release}-r")).await; // not selected: holds more, keeps everything
    run.apply_chart(&release, &ns, RBAC_AND_POLICIES, None).await;
    let nodes = [format!("{release}-n1"), format!("{release}-n2")];
    let mut uids = Vec::new();
    for node in &nodes {
        uids.push(run.node(node).await);
    }
    // Each namespace has a budget far above any pod's usage: records are written, nothing is over its own budget.
    for budget_ns in [&ns_q, &ns_r] {
        let budget = json!({"apiVersion": "gpubudget.io/v1alpha1", "kind": "GpuMemoryBudget",
            "metadata": {"name": "per-pod", "namespace": budget_ns}, "spec": {"selector": {}, "limit": "16Gi"}});
        run.apply(&budget, budget_ns).await;
    }
    run.label_namespace(&ns_q, "e2e.gpubudget.io/quota", &id).await;
    let quota_name = release.clone();
    run.owns("gpubudget.io", "v1alpha1", "ClusterGpuMemoryQuota", None, &quota_name);
    run.apply(
        &json!({"apiVersion": "gpubudget.io/v1alpha1", "kind": "ClusterGpuMemoryQuota", "metadata": {"name": quota_name},
                "spec": {"namespaceSelector": {"matchLabels": {"e2e.gpubudget.io/quota": id}}, "limit": "10Gi",
                         "warnAtPercent": 80, "overLimitSeconds": 10, "evictionGracePeriodSeconds": 7}}),
        "",
    )
    .await;

    run.say(&format!("pods (API objects; the test is their kubelet): six in {ns_q} on two nodes, two in {ns_r}"));
    let t0 = jiff::Timestamp::now();
    let procs = [run.file("proc-n1"), run.file("proc-n2")];
    let samples = [SampleFile::new(run.file("sample-n1.json")), SampleFile::new(run.file("sample-n2.json"))];
    for (name, suffix, node, offset, pid) in PODS {
        let pod_ns = if suffix == "q" { &ns_q } else { &ns_r };
        let uid = run.make_pod(pod_ns, name, &nodes[node], &[]).await;
        let started = t0 - jiff::SignedDuration::from_secs(600 - offset);
        run.pod_running_since(pod_ns, name, Some(started)).await;
        gpubudget_demo::stack::kubelet_process(&procs[node], pid, &uid, &crate::harness::container_id(pod_ns, name));
    }
    sample(&samples, 3 * GI / 2, 8 * GI, None);

    run.say("two agents, one per node (tokens bound to their Node), and two operator replicas (leader election)");
    run.webhook_cert();
    let operator = run.chart_operator(&ns, &release).await;
    let mut agents: Vec<Binary> = Vec::new();
    for i in 0..2 {
        let identity = run.chart_agent(&ns, &release, (&nodes[i], &uids[i]), &format!("agent-{}", i + 1)).await;
        let files = (procs[i].as_path(), &samples[i]);
        let env = [("RUST_LOG", "info")];
        let log = format!("agent-{}.log", i + 1);
        agents.push(run.start_agent_on(&identity, &nodes[i], &run.addr(1 + i as u16), files, &[], &env, &log).await);
    }
    let mut replicas = Vec::new();
    for (k, name) in ["operator-a", "operator-b"].into_iter().enumerate() {
        let (admin, webhook) = (run.addr(12 + 2 * k as u16), run.addr(13 + 2 * k as u16));
        let log = format!("{name}.log");
        let binary = run.spawn_operator(&OperatorRun {
            identity: &operator,
            ns: &ns,
            pod: name,
            admin: &admin,
            webhook: Some(&webhook),
            extra: &["--leader-election"],
            rust_log: "info",
            log: &log,
        });
        replicas.push((name, admin.clone(), binary));
    }
    let leases = Api::<Lease>::namespaced(run.admin.clone(), &ns);
    let holder = |l: &Lease| l.spec.as_ref().and_then(|s| s.holder_identity.clone());
    let leader = run.object_until(leases.clone(), "gpubudget-operator", "a leader", |l| holder(l).is_some()).await;
    run.info(&format!("leader: {}", holder(&leader).unwrap_or_default()));
    for (name, _, _, _, _) in PODS.iter().filter(|p| p.1 == "q") {
        run.pod_until(&ns_q, name, &format!("{name} recorded"), |p| {
            crate::harness::annotation(p, "usage-bytes").is_some()
        })
        .await;
    }

    let quotas = Api::<ClusterGpuMemoryQuota>::all(run.admin.clone());
    run.say("Near: six pods × 1.5Gi = 9Gi of the namespace's 10Gi (each within its own 16Gi budget)");
    let q = run
        .object_until(quotas.clone(), &quota_name, &format!("the quota's status: {ns_q} Near at 9Gi"), |q| {
            namespace(q, &ns_q).is_some_and(|n| (state(n), n.total.as_str()) == ("Near".to_owned(), "9Gi"))
        })
        .await;
    assert!(namespace(&q, &ns_r).is_none(), "{ns_r} (not selected) is in the quota's status");
    run.until("NamespaceGpuMemoryNear on the quota", || async {
        !run.object_events("ClusterGpuMemoryQuota", &quota_name, "NamespaceGpuMemoryNear").await.is_empty()
    })
    .await;

    run.say("Over: each pod grows to 2Gi: 12Gi of 10Gi; no pod is over its own budget");
    let grew = Instant::now();
    sample(&samples, 2 * GI, 8 * GI, None);
    // The totals are the agents' records: a usage change within a state is rewritten at most every
    // --usage-write-interval (30 s by default), so the namespace is seen over up to that late.
    let over = async {
        while !quotas
            .get(&quota_name)
            .await
            .ok()
            .and_then(|q| namespace(&q, &ns_q).map(|n| (state(n), n.total.clone())))
            .is_some_and(|(s, t)| s == "Over" && t == "12Gi")
        {
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
    };
    tokio::time::timeout(crate::harness::step_timeout() + Duration::from_secs(30), over)
        .await
        .expect("the quota's status: Over at 12Gi");
    let over_at = Instant::now();
    run.info(&format!(
        "ok: the quota's status: {ns_q} Over at 12Gi, seen {} s after the pods grew (records rewritten for usage at most every 30 s, a pass every 5 s)",
        grew.elapsed().as_secs()
    ));
    let (columns, rows) = table(&run.admin, "/apis/gpubudget.io/v1alpha1/clustergpumemoryquotas").await;
    assert_eq!(columns.join(" "), "NAME LIMIT ACTION NAMESPACES OVER EVICTED AGE", "kubectl get cgmq columns");
    run.info(&columns.join(" "));
    for row in rows.iter().filter(|r| r[0] == quota_name) {
        run.info(&row.join(" | "));
    }
    let q = quotas.get(&quota_name).await.expect("the quota");
    let top: Vec<String> = namespace(&q, &ns_q)
        .expect("selected")
        .top_pods
        .iter()
        .map(|p| format!("{}@{}", p.name, p.node.as_deref().unwrap_or("?")))
        .collect();
    run.info(&format!("top holders: {}", top.join(" ")));

    run.say("the leader is killed 3 s into the period (SIGKILL: no hand-over; its Lease runs out after 15 s)");
    tokio::time::sleep(Duration::from_secs(3)).await;
    let leader = holder(&leases.get("gpubudget-operator").await.expect("the Lease")).expect("a holder");
    let survivor = if leader == "operator-a" { "operator-b" } else { "operator-a" };
    replicas.iter_mut().find(|(name, _, _)| *name == leader).expect("the leader").2.crash();
    let killed = Instant::now();
    run.info(&format!("killed {leader}; {survivor} waits for the Lease"));
    assert!(!run.is_terminating(&ns_q, "q-4").await, "q-4 evicted before the period was over");
    run.object_until(leases, "gpubudget-operator", &format!("the Lease moves to {survivor}"), |l| {
        holder(l).as_deref() == Some(survivor)
    })
    .await;
    run.info(&format!("Lease held by {survivor} {} s after the kill", killed.elapsed().as_secs()));
    let evicted =
        tokio::time::timeout(crate::harness::step_timeout() + Duration::from_secs(30), run.terminating(&ns_q, "q-4"));
    let pod = evicted.await.unwrap_or_else(|_| panic!("q-4 (started last, on {}) not terminating in time", nodes[1]));
    let after = over_at.elapsed().as_secs();
    assert!(after >= 10, "q-4 evicted {after}s after the namespace went over, before overLimitSeconds (10 s)");
    assert_eq!(pod.metadata.deletion_grace_period_seconds, Some(7), "q-4's grace, the quota's 7 (the pod's own is 60)");
    run.info(&format!("q-4 evicted {after}s after the namespace went over (the leader killed 3 s in), grace 7"));
    let note = run.event(&ns_q, "q-4", "NamespaceGpuMemoryEvicting").await.note.unwrap_or_default();
    run.info(&format!("q-4: {}", note.chars().take(220).collect::<String>()));

    run.say("one eviction, one pod: the others and the namespace the quota does not select keep theirs");
    tokio::time::sleep(Duration::from_secs(6)).await; // more than one pass (5 s) of the new leader with q-4 going
    for pod in ["q-1", "q-2", "q-3", "q-5", "q-6"] {
        assert!(!run.is_terminating(&ns_q, pod).await, "{pod} evicted too");
    }
    for pod in ["r-1", "r-2"] {
        assert!(!run.is_terminating(&ns_r, pod).await, "{pod} ({ns_r}, 16Gi, not selected) evicted");
    }
    assert_eq!(
        run.occurrences(&ns_q, "q-4", "NamespaceGpuMemoryEvicting").await,
        1,
        "NamespaceGpuMemoryEvicting on q-4"
    );
    let survivor_admin = &replicas.iter().find(|(name, _, _)| *name == survivor).expect("the survivor").1;
    let requests = metrics(survivor_admin)
        .await
        .lines()
        .filter(|l| l.starts_with("gpubudget_operator_quota_eviction_requests_total"))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum::<f64>();
    assert_eq!(requests, 1.0, "{survivor} asked for {requests} evictions");
    run.info(&format!("{survivor} asked for 1 eviction"));

    run.say("the kubelet's part: q-4's process exits, the pod is deleted; 10Gi left, at the limit: nothing more goes");
    sample(&samples, 2 * GI, 8 * GI, Some("q-4"));
    let _ = std::fs::remove_dir_all(procs[1].join("5104"));
    run.gone(&ns_q, "q-4", &[]).await;
    // At the limit is not over it (no time banked); the state keeps Over until the total is below the limit less
    // the hysteresis, as for one pod.
    run.object_until(
        quotas.clone(),
        &quota_name,
        &format!("the quota's status: {ns_q} at 10Gi, 5 pods, not over the limit"),
        |q| namespace(q, &ns_q).is_some_and(|n| n.total == "10Gi" && n.pods == 5 && !n.last_over),
    )
    .await;
    let q = run
        .object_until(quotas.clone(), &quota_name, "the quota counts one eviction", |q| {
            q.status.as_ref().is_some_and(|s| s.evictions == 1)
        })
        .await;
    let n = namespace(&q, &ns_q).expect("selected");
    run.info(&format!(
        "{ns_q}: {} {} of {}, {} pods, {} ms over banked",
        state(n),
        n.total,
        n.limit,
        n.pods,
        n.over_millis
    ));
    tokio::time::sleep(Duration::from_secs(12)).await; // longer than overLimitSeconds
    for pod in ["q-1", "q-2", "q-3", "q-5", "q-6"] {
        assert!(!run.is_terminating(&ns_q, pod).await, "{pod} evicted after the namespace was back within");
    }

    run.say("observe (#54): the quota set to Observe, the five pods grow to 2.5Gi: 12.5Gi of 10Gi");
    set_enforcement(&quotas, &quota_name, "Observe").await;
    sample(&samples, 5 * GI / 2, 8 * GI, Some("q-4"));
    // Each record is rewritten for its usage at most every 30 s: the total crosses 10Gi with the first of them.
    entry_until(&quotas, &quota_name, &ns_q, "over the limit again", |n| n.last_over).await;
    let over_again = Instant::now();
    let n =
        entry_until(&quotas, &quota_name, &ns_q, "the pod it would evict in the status", |n| n.would_evict.is_some())
            .await;
    let told_after = over_again.elapsed().as_secs();
    assert_eq!(n.would_evict.as_ref().and_then(|w| w.pod.as_deref()), Some("q-6"), "the most recently started left");
    // Due by the eviction's rule: the period banked in full (what the dip at 10Gi took back had to be made up).
    assert_eq!(n.over_millis, 10_000, "told with {} ms banked, not the 10 s period", n.over_millis);
    let note = run.event(&ns_q, "q-6", "NamespaceGpuMemoryWouldEvict").await.note.unwrap_or_default();
    run.info(&format!(
        "q-6 told {told_after} s after the namespace was seen over again ({}), the 10 s period banked: {}",
        n.total,
        note.chars().take(260).collect::<String>()
    ));
    let reason =
        |q: &ClusterGpuMemoryQuota| q.status.as_ref().and_then(|s| s.conditions.first()).map(|c| c.reason.clone());
    assert_eq!(reason(&quotas.get(&quota_name).await.expect("the quota")).as_deref(), Some("Observing"));
    tokio::time::sleep(Duration::from_secs(20)).await; // four passes past due
    for pod in ["q-1", "q-2", "q-3", "q-5", "q-6"] {
        assert!(!run.is_terminating(&ns_q, pod).await, "{pod} evicted while the quota observes");
    }
    let q = quotas.get(&quota_name).await.expect("the quota");
    assert_eq!(namespace(&q, &ns_q).map(state).as_deref(), Some("Over"), "never Evicting while nothing is");
    assert_eq!(run.occurrences(&ns_q, "q-6", "NamespaceGpuMemoryWouldEvict").await, 1, "told once per episode");
    let text = metrics(survivor_admin).await;
    let sum = |name: &str| {
        text.lines()
            .filter(|l| l.starts_with(name))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum::<f64>()
    };
    assert_eq!(
        (sum("gpubudget_operator_quota_would_evict_total"), sum("gpubudget_operator_quota_eviction_requests_total")),
        (1.0, 1.0),
        "told once, and no eviction asked for while observing"
    );
    run.info("20 s past due: nothing evicted, state Over, one event, gpubudget_operator_quota_would_evict_total 1");

    run.say("the administrator enforces the quota: q-6 goes at the next pass");
    set_enforcement(&quotas, &quota_name, "Enforce").await;
    let switched = Instant::now();
    tokio::time::timeout(crate::harness::step_timeout(), run.terminating(&ns_q, "q-6"))
        .await
        .expect("q-6 terminating once the quota enforces");
    run.info(&format!("q-6 evicted {} s after the switch (a pass every 5 s)", switched.elapsed().as_secs()));
    let q = quotas.get(&quota_name).await.expect("the quota");
    assert_eq!(reason(&q).as_deref(), Some("Enforced"));
    run.say(&format!(
        "PASS: a namespace total reached by six small pods on two nodes, the leader killed mid-period: one eviction (the \
         latest start) by the new leader after the period, with the quota's grace; neighbours and an unselected \
         namespace untouched; observing, the pod it would evict told once and kept; enforced, evicted at the next \
         pass ({} s)",
        run.elapsed()
    ));
}

/// Sets the quota's `spec.enforcement` (a merge patch, as an administrator would).
async fn set_enforcement(quotas: &Api<ClusterGpuMemoryQuota>, name: &str, mode: &str) {
    let patch = Patch::Merge(json!({"spec": {"enforcement": mode}}));
    quotas.patch(name, &PatchParams::default(), &patch).await.expect("the quota patched");
}

/// Waits until the namespace's entry in the quota's status passes `check`, polling every 0.5 s for the step
/// timeout plus 30 s (records are rewritten for usage at most every 30 s).
async fn entry_until(
    quotas: &Api<ClusterGpuMemoryQuota>,
    name: &str,
    ns: &str,
    what: &str,
    check: impl Fn(&NamespaceTotal) -> bool,
) -> NamespaceTotal {
    let poll = async {
        loop {
            let entry = quotas.get(name).await.ok().and_then(|q| namespace(&q, ns).cloned());
            if let Some(entry) = entry.filter(|n| check(n)) {
                return entry;
            }
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
    };
    tokio::time::timeout(crate::harness::step_timeout() + Duration::from_secs(30), poll)
        .await
        .unwrap_or_else(|_| panic!("timed out: {what}"))
}
