//! The core stories (formerly e2e/apiserver/run.sh): records, usage objects, events, eviction with the budget's
//! grace, the agent restarted mid-grace, Warn, overlaps, node restriction both ways, mirrors, the operator down
//! and back, a PodDisruptionBudget escalated, pressure, a GPU lost and back, two operator replicas with the
//! leader crashed, and a Node's usage collected with it. One story after another on the same objects, as the
//! script ran them; e2e/apiserver/README.md lists what each asserts.

use std::time::{Duration, Instant};

use gpubudget_common::GpuMemoryBudget;
use gpubudget_demo::stack::example;
use k8s_openapi::api::authentication::v1::SelfSubjectReview;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{Node, Pod};
use k8s_openapi::api::events::v1::Event;
use kube::api::{Api, DeleteParams, DynamicObject, EvictParams, ListParams, Patch, PatchParams, PostParams};
use kube::{Client, ResourceExt};
use serde_json::{Value, json};

use crate::harness::{
    Binary, GI, Identity, OperatorRun, RBAC_AND_POLICIES, Run, annotate, annotation, apply_as, gpubudget_resource,
    http_get, metric, metrics, mirrors_lease, patch_pod, refused, table,
};

const AGENT: &str = "gpubudget-agent";
const OPERATOR: &str = "gpubudget-operator";

/// The run's names, identities and running binaries.
struct Core {
    // The binaries first: they stop before the run deletes what they work on.
    operator: Option<Binary>,
    agent: Option<Binary>,
    extra: Vec<Binary>,
    run: Run,
    ns: String,
    ns_a: String,
    ns_b: String,
    node: String,
    node2: String,
    release: String,
    webhook_config: String,
    ids: Ids,
    agent_runs: u32,
}

/// The identities, each with its own token.
struct Ids {
    operator: Identity,
    agent: Identity,
    agent2: Identity,
    unbound: Identity,
    tenant: Identity,
}

impl Core {
    fn addr(&self, n: u16) -> String {
        self.run.addr(n)
    }

    fn mirrors_lease(&self) -> String {
        mirrors_lease(&self.release)
    }

    async fn start_operator(&mut self) {
        let (admin, webhook) = (self.addr(1), self.addr(2));
        let lease = self.mirrors_lease();
        let binary = self.run.spawn_operator(&OperatorRun {
            identity: &self.ids.operator,
            ns: &self.ns,
            pod: "operator-e2e",
            admin: &admin,
            webhook: Some(&webhook),
            extra: &["--mirrors-lease-name", &lease],
            rust_log: "info,gpubudget_operator=debug",
            log: "operator.log",
        });
        self.run.ready(&format!("operator ready (pid {})", binary.pid()), &admin).await;
        self.operator = Some(binary);
    }

    async fn start_agent(&mut self) {
        self.agent_runs += 1;
        let lease = format!("{}/{}", self.ns, self.mirrors_lease());
        let log = format!("agent-{}.log", self.agent_runs);
        let env = [("RUST_LOG", "info,gpubudget_agent=debug")];
        let (agent, node, admin) = (&self.ids.agent, &self.node, self.addr(0));
        let binary = self.run.start_agent(agent, node, &admin, &["--mirrors-lease", &lease], &env, &log).await;
        self.agent = Some(binary);
    }

    /// What NVML reports on GPU 0, by process: llm-evict's two (4101, 4102), trainer (4103), llm-b (4104), other-b
    /// (4105), remote-a (4106: sampled here, its pod on the other node), held (4107); the device's used bytes
    /// when given (the pressure signal).
    fn usage(&self, evict: (u64, u64), trainer: u64, llm_b: u64, other_b: u64, device: Option<u64>, held: u64) {
        let processes = [
            (4101, evict.0),
            (4102, evict.1),
            (4103, trainer),
            (4104, llm_b),
            (4105, other_b),
            (4106, 50 * GI),
            (4107, held),
        ];
        match device {
            Some(used) => self.run.sample().set_usage_and_device(&processes, used),
            None => self.run.sample().set_usage(&processes),
        }
    }

    fn agent_log(&self) -> String {
        self.agent.as_ref().map(Binary::log_text).unwrap_or_default()
    }

    async fn budget(&self, ns: &str, name: &str) -> GpuMemoryBudget {
        self.run.budget(ns, name).await
    }

    async fn evictions_are(&self, ns: &str, name: &str, n: i64) {
        let what = format!("{name} ({ns}) EVICTED {n}");
        self.run.budget_until(ns, name, &what, |b| b.status.as_ref().is_some_and(|s| s.evictions == n)).await;
    }

    async fn grace(&self, ns: &str, pod: &str) -> Option<i64> {
        self.run.pod(ns, pod).await.metadata.deletion_grace_period_seconds
    }

    /// `kubectl get gmb -n <ns>`: the column names and the rows.
    async fn gmb_table(&self, ns: &str) -> (Vec<String>, Vec<Vec<String>>) {
        table(&self.run.admin, &format!("/apis/gpubudget.io/v1alpha1/namespaces/{ns}/gpumemorybudgets")).await
    }

    /// The first six non-empty cells of a budget's row, as `kubectl get gmb | tr -s ' '` shows them.
    async fn gmb_row(&self, ns: &str, name: &str) -> String {
        let (_, rows) = self.gmb_table(ns).await;
        let row = rows.into_iter().find(|r| r.first().map(String::as_str) == Some(name)).unwrap_or_default();
        row.into_iter().filter(|c| !c.is_empty()).take(6).collect::<Vec<_>>().join(" ")
    }

    async fn gmb_row_is(&self, ns: &str, name: &str, want: &str) {
        self.run.until(&format!("kubectl get gmb: {want}"), || async { self.gmb_row(ns, name).await == want }).await;
    }
}

async fn evict(client: &Client, ns: &str, pod: &str) -> kube::Result<kube::core::Status> {
    Api::<Pod>::namespaced(client.clone(), ns).evict(pod, &EvictParams::default()).await
}

/// The run's `GpuNodeUsage` of a node.
fn usage_body(name: &str, node_name: &str) -> Value {
    let now = jiff::Timestamp::now().round(jiff::Unit::Second).expect("rounds").to_string();
    json!({"apiVersion": "gpubudget.io/v1alpha1", "kind": "GpuNodeUsage", "metadata": {"name": name},
           "spec": {"nodeName": node_name, "observedAt": now, "podCount": 0, "total": "0", "pods": []}})
}

pub async fn core() {
    let mut run = Run::start("gpubudget-api", &[AGENT, OPERATOR]).await;
    let id = run.id.clone();
    let release = format!("gpubudget-api-{id}");
    let (agent_sa, operator_sa) = (format!("{release}-agent"), format!("{release}-operator"));

    run.say("CRD, the chart's RBAC, admission policies and eviction webhook (helm template; the webhook in URL mode)");
    run.apply_crds().await;
    let ns = run.namespace(&format!("gpubudget-api-{id}")).await;
    let ns_a = run.namespace(&format!("gpubudget-api-{id}-a")).await;
    let ns_b = run.namespace(&format!("gpubudget-api-{id}-b")).await;
    let tls = run.webhook_cert();
    let webhook = run.addr(2);
    let mut kinds = RBAC_AND_POLICIES.to_vec();
    kinds.push("ValidatingWebhookConfiguration");
    let applied = run.apply_chart(&release, &ns, &kinds, Some((&webhook, &tls.join("ca.crt")))).await;
    let policies: Vec<&str> = applied
        .iter()
        .filter(|v| v["kind"] == "ValidatingAdmissionPolicy")
        .filter_map(|v| v["metadata"]["name"].as_str()?.strip_prefix(&format!("{release}-")))
        .collect();
    assert_eq!(
        policies,
        [
            "agent-node-restriction-pods",
            "agent-node-restriction-events",
            "agent-node-restriction-usage",
            "agent-records",
            "agent-shares",
            "agent-shares-binding",
            "operator-caps-record"
        ],
        "the chart's seven admission policies (node restriction of pods, events and usage objects, records, shares, \
         caps record)"
    );
    let webhook_config = applied
        .iter()
        .find(|v| v["kind"] == "ValidatingWebhookConfiguration")
        .and_then(|v| v["metadata"]["name"].as_str())
        .expect("the eviction webhook")
        .to_owned();
    for v in &applied {
        run.info(&format!(
            "{}/{} applied",
            v["kind"].as_str().unwrap_or_default(),
            v["metadata"]["name"].as_str().unwrap_or_default()
        ));
    }

    run.say("nodes, pods (API objects; the test is their kubelet), identities");
    let node = format!("gpubudget-api-{id}-n1");
    let node2 = format!("gpubudget-api-{id}-n2");
    let node_uid = run.node(&node).await;
    let node2_uid = run.node(&node2).await;
    let pods = [
        (ns_a.as_str(), "llm-evict", node.as_str(), ("app", "llm"), &[4101u32, 4102][..]), // Evict: 6 → 7.5 → 9Gi of 8Gi
        (&ns_a, "trainer", &node, ("job-type", "training"), &[4103]), // Warn: 20 → 35 → 45Gi of 40Gi (warn at 80 %)
        (&ns_a, "remote-a", &node2, ("app", "llm"), &[4106]),         // the other node: never the agent's
        (&ns_b, "llm-b", &node, ("app", "llm"), &[4104]),             // llm-inference (8Gi) and team-b-default (20Gi)
        (&ns_b, "other-b", &node, ("tier", "batch"), &[4105]),        // team-b-default only
    ];
    for (pod_ns, name, on, label, pids) in pods {
        let uid = run.make_pod(pod_ns, name, on, &[label]).await;
        for pid in pids {
            run.process(*pid, pod_ns, name, &uid);
        }
    }
    let token = |sa: &str, bound: Option<(&str, &str)>| {
        let (run, ns, sa) = (&run, ns.clone(), sa.to_owned());
        let bound = bound.map(|(a, b)| (a.to_owned(), b.to_owned()));
        async move { run.token(&ns, &sa, bound.as_ref().map(|(a, b)| (a.as_str(), b.as_str()))).await }
    };
    let operator_token = token(&operator_sa, None).await;
    let agent_token = token(&agent_sa, Some((&node, &node_uid))).await;
    let agent2_token = token(&agent_sa, Some((&node2, &node2_uid))).await;
    let unbound_token = token(&agent_sa, None).await;
    run.tenant_with_edit(&ns_a).await;
    let tenant_token = run.token(&ns_a, "tenant", None).await;
    let ids = Ids {
        operator: run.identity("operator", &operator_token).await,
        agent: run.identity("agent", &agent_token).await,
        agent2: run.identity("agent-n2", &agent2_token).await,
        unbound: run.identity("agent-unbound", &unbound_token).await,
        tenant: run.identity("tenant", &tenant_token).await,
    };
    let review = Api::<SelfSubjectReview>::all(ids.agent.client.clone())
        .create(&PostParams::default(), &SelfSubjectReview::default())
        .await
        .expect("whoami");
    let user = review.status.and_then(|s| s.user_info).expect("the agent's user");
    let bound_to = user
        .extra
        .as_ref()
        .and_then(|e| e.get("authentication.kubernetes.io/node-name"))
        .and_then(|v| v.first().cloned());
    assert_eq!(bound_to.as_deref(), Some(node.as_str()), "the agent's token does not carry its node");
    run.info(&format!("agent: {} bound to node {node}", user.username.unwrap_or_default()));

    let mut core = Core {
        operator: None,
        agent: None,
        extra: Vec::new(),
        run,
        ns,
        ns_a,
        ns_b,
        node,
        node2,
        release,
        webhook_config,
        ids,
        agent_runs: 0,
    };
    core.usage((5 * GI, GI), 20 * GI, GI, 2 * GI, None, 0);
    core.run.say("the release binaries, out of cluster, each with its own identity");
    core.start_operator().await;
    core.start_agent().await;

    core.run.say("budgets from examples/ (namespaces moved)");
    for (file, ns) in [
        ("llm-inference.yaml", &core.ns_a),
        ("training-warn.yaml", &core.ns_a),
        ("namespace-wide.yaml", &core.ns_b),
        ("llm-inference.yaml", &core.ns_b),
    ] {
        let budget = example(file, ns);
        core.run.apply(&budget, ns).await;
        core.run
            .info(&format!("gpumemorybudget {ns}/{} applied", budget["metadata"]["name"].as_str().unwrap_or_default()));
    }

    records(&core).await;
    let trainer_over = near_and_over(&mut core).await;
    warn_and_overlaps(&core, trainer_over).await;
    node_restriction(&core).await;
    mirrors(&core).await;
    operator_down_and_back(&mut core).await;
    pdb_escalated(&core).await;
    pressure(&core).await;
    gpu_lost_and_back(&core).await;
    leader_crash(&mut core).await;
    node_deleted(&core).await;
    core.run.say(&format!(
        "PASS: records, mirrors, events, Evict with the budget's grace, Warn, overlaps, node restriction both ways, \
         usage objects (own node only, collected with the Node), operator down and back, agent restart mid-grace, \
         pressure eviction, a PodDisruptionBudget escalated, a GPU lost and back, two operator replicas with the \
         leader crashed ({} s)",
        core.run.elapsed()
    ));
}

async fn records(core: &Core) {
    let (run, ns_a, ns_b, node) = (&core.run, &core.ns_a, &core.ns_b, &core.node);
    run.say("records: what the agent attributes through /proc, on the pods of its node only");
    let want =
        [Some("Within".to_owned()), Some((6 * GI).to_string()), Some("llm-inference".into()), Some(node.clone())];
    let pod = run
        .pod_until(ns_a, "llm-evict", &format!("llm-evict recorded Within at 6Gi under llm-inference on {node}"), |p| {
            ["state", "usage-bytes", "budget", "node"].map(|k| annotation(p, k)) == want
        })
        .await;
    run.record_is(ns_a, "trainer", "budget", "training-audit").await;
    run.record_is(ns_b, "llm-b", "budget", "llm-inference").await; // the smaller of two budgets
    run.record_is(ns_b, "other-b", "budget", "team-b-default").await;
    let remote = run.pod(ns_a, "remote-a").await;
    assert_eq!(
        annotation(&remote, "state"),
        None,
        "remote-a (node {}) got a record from the agent of {node}",
        core.node2
    );
    let managers: Vec<String> =
        pod.metadata.managed_fields.unwrap_or_default().into_iter().filter_map(|m| m.manager).collect();
    assert!(
        managers.contains(&format!("gpubudget-agent/{node}")),
        "no field manager gpubudget-agent/{node}: {managers:?}"
    );
    run.info(&format!("field managers of llm-evict: {}", managers.join(",")));

    run.say("usage: one GpuNodeUsage per node (#34), named after it, owned by its Node, the pods' bytes in it");
    let usages = Api::<DynamicObject>::all_with(run.admin.clone(), &gpubudget_resource("GpuNodeUsage"));
    let usage_of = |u: &DynamicObject, pod: &str| {
        u.data["spec"]["pods"]
            .as_array()
            .into_iter()
            .flatten()
            .find(|p| p["name"] == pod)
            .map(|p| p["usageBytes"].clone())
    };
    let usage = run
        .object_until(usages.clone(), node, &format!("GpuNodeUsage {node} lists llm-evict at 6Gi"), |u| {
            usage_of(u, "llm-evict")
                .is_some_and(|b| b.as_u64() == Some(6 * GI) || b.as_str() == Some(&(6 * GI).to_string()))
        })
        .await;
    let owner = usage.metadata.owner_references.clone().unwrap_or_default();
    let node_uid = Api::<Node>::all(run.admin.clone()).get(node).await.expect("the node").uid();
    assert_eq!(
        owner.first().map(|o| (o.kind.as_str(), o.name.as_str(), Some(o.uid.clone()))),
        Some(("Node", node.as_str(), node_uid)),
        "GpuNodeUsage {node}'s owner"
    );
    assert_eq!(usage_of(&usage, "remote-a"), None, "the GpuNodeUsage of {node} lists remote-a (node {})", core.node2);
    let managers: Vec<String> =
        usage.metadata.managed_fields.clone().unwrap_or_default().into_iter().filter_map(|m| m.manager).collect();
    assert_eq!(managers, [format!("gpubudget-agent/{node}")], "field managers of GpuNodeUsage {node}");
    run.info(&format!("GpuNodeUsage {node}: {}", usage.data["spec"]));
}

/// Returns when trainer went over its Warn budget.
async fn near_and_over(core: &mut Core) -> Instant {
    let (ns_a, node) = (core.ns_a.clone(), core.node.clone());
    core.run.say("Near: llm-evict 7.5Gi of 8Gi, trainer 35Gi of 40Gi (Warn, 80 %)");
    core.usage((6 * GI, 3 * GI / 2), 35 * GI, GI, 2 * GI, None, 0);
    let near = core.run.event(&ns_a, "llm-evict", "GpuMemoryNearBudget").await;
    core.run.event(&ns_a, "trainer", "GpuMemoryNearBudget").await;
    let note = near.note.clone().unwrap_or_default();
    core.run.info(&format!("llm-evict: {note}"));
    assert!(
        note.contains("7.5Gi of 8Gi") && note.contains("pid 4101") && note.contains("pid 4102"),
        "the Near note should give 7.5Gi of 8Gi and both processes: {note}"
    );
    let seen = (
        near.type_.as_deref(),
        near.reporting_controller.as_deref(),
        near.reporting_instance.as_deref(),
        near.action.as_deref(),
    );
    assert_eq!(seen, (Some("Warning"), Some("gpubudget-agent"), Some(node.as_str()), Some("Measure")), "Near event");

    core.run.say("Over: llm-evict 9Gi of 8Gi (Evict, overLimitSeconds 10, grace 30 s), trainer 45Gi of 40Gi (Warn)");
    core.usage((7 * GI, 2 * GI), 45 * GI, GI, 2 * GI, None, 0);
    let over = core.run.event(&ns_a, "llm-evict", "GpuMemoryOverBudget").await;
    let over_at = Instant::now();
    core.run.event(&ns_a, "trainer", "GpuMemoryOverBudget").await;
    let note = over.note.clone().unwrap_or_default();
    core.run.info(&format!("llm-evict: {note}"));
    assert!(note.contains("9Gi of 8Gi") && note.contains("evicting if it stays over for 10s"), "Over note: {note}");
    let trainer = core.run.notes(&ns_a, "trainer", "GpuMemoryOverBudget").await.join("\n");
    assert!(trainer.contains("action is Warn: not evicted for being over its limit"), "trainer's Over note: {trainer}");

    core.run.say(
        "eviction: after 10 s over, through the Eviction API (the webhook allows the agent's own node), grace 30 s",
    );
    let (_, grace) = core.run.evicted_after(&ns_a, "llm-evict", &over, 10).await;
    assert_eq!(grace, 30, "deletionGracePeriodSeconds, not the budget's 30 (the pod's own is 60)");
    core.run.info("deletionGracePeriodSeconds 30: the budget's (the pod's own is 60)");
    let evicting = core.run.notes(&ns_a, "llm-evict", "EvictingForGpuMemory").await.join("\n");
    assert!(
        evicting.contains("evicting with 30s grace") && evicting.contains("llm-inference"),
        "Evicting note: {evicting}"
    );
    let pod = core.run.pod(&ns_a, "llm-evict").await;
    assert_eq!(annotation(&pod, "state").as_deref(), Some("Evicting"));
    let requested = annotation(&pod, "eviction-requested-at").expect("eviction-requested-at on llm-evict");
    let operator_log = core.operator.as_ref().expect("running").log_text();
    assert!(
        !operator_log.contains("agent-eviction.gpubudget.io") && !operator_log.contains("eviction denied"),
        "the webhook denied an eviction of the agent's own node"
    );

    core.run.say("the agent restarted in the middle of the grace period: no event repeated, no second eviction");
    core.agent.as_mut().expect("running").stop();
    core.start_agent().await;
    tokio::time::sleep(Duration::from_secs(3)).await;
    for reason in ["EvictingForGpuMemory", "GpuMemoryOverBudget", "GpuMemoryNearBudget"] {
        let n = core.run.occurrences(&ns_a, "llm-evict", reason).await;
        assert_eq!(
            n,
            1,
            "{reason} on llm-evict {n} times after the restart: {:?}",
            core.run.events(&ns_a, "llm-evict", reason).await
        );
    }
    let accepted = (1..=core.agent_runs)
        .map(|i| std::fs::read_to_string(core.run.file(&format!("agent-{i}.log"))).unwrap_or_default())
        .map(|log| {
            log.lines().filter(|l| l.contains("eviction requested and accepted") && l.contains("llm-evict")).count()
        })
        .sum::<usize>();
    assert_eq!(accepted, 1, "accepted evictions of llm-evict in the agent's logs (both runs)");
    let pod = core.run.pod(&ns_a, "llm-evict").await;
    assert_eq!(
        annotation(&pod, "eviction-requested-at").as_deref(),
        Some(requested.as_str()),
        "eviction-requested-at changed after the restart"
    );
    core.run.info(&format!("one EvictingForGpuMemory event, one accepted eviction, record unchanged ({requested})"));

    core.run
        .say("the kubelet's part: the processes exit on SIGTERM, the pod is deleted; the operator counts one eviction");
    core.usage((0, 0), 45 * GI, GI, 2 * GI, None, 0);
    core.run.gone(&ns_a, "llm-evict", &[4101, 4102]).await;
    core.evictions_are(&ns_a, "llm-inference", 1).await;
    core.run
        .budget_until(&ns_a, "llm-inference", "llm-inference lastEviction names llm-evict", |b| {
            b.status.as_ref().and_then(|s| s.last_eviction.as_ref()).is_some_and(|e| e.pod == "llm-evict")
        })
        .await;
    // No request, no admissionCaps, no share: the REQUEST, CAPPED and SHARE cells are empty. MATCHED counts
    // remote-a (app=llm, on the other node): the operator reports every pod a budget selects.
    core.gmb_row_is(&ns_a, "llm-inference", "llm-inference 8Gi Evict 1 0 1").await;
    let (columns, rows) = core.gmb_table(&ns_a).await;
    assert_eq!(
        columns.join(" "),
        "NAME REQUEST LIMIT ACTION MATCHED OVER CAPPED SHARE EVICTED AGE",
        "kubectl get gmb columns"
    );
    core.run.info(&columns.join(" "));
    for row in rows {
        core.run.info(&row.join(" | "));
    }
    let last = core.budget(&ns_a, "llm-inference").await.status.and_then(|s| s.last_eviction);
    core.run.info(&format!("lastEviction: {}", serde_json::to_string(&last).expect("json")));
    over_at
}

/// `over_at`: when trainer went over its Warn budget.
async fn warn_and_overlaps(core: &Core, over_at: Instant) {
    let (run, ns_a, ns_b) = (&core.run, &core.ns_a, &core.ns_b);
    run.say("Warn: trainer stays over 40Gi past overLimitSeconds (30 s), events only");
    if let Some(rest) = Duration::from_secs(40).checked_sub(over_at.elapsed()) {
        tokio::time::sleep(rest).await;
    }
    assert!(
        !run.has_event(ns_a, "trainer", "EvictingForGpuMemory").await,
        "trainer (action Warn) got an EvictingForGpuMemory event"
    );
    assert!(!run.is_terminating(ns_a, "trainer").await, "trainer (action Warn) is being deleted");
    assert_eq!(
        annotation(&run.pod(ns_a, "trainer").await, "state").as_deref(),
        Some("Over"),
        "trainer's recorded state"
    );
    run.budget_until(ns_a, "training-audit", "training-audit OVER 1", |b| {
        b.status.as_ref().is_some_and(|s| s.pods_over_budget == 1)
    })
    .await;
    core.gmb_row_is(ns_a, "training-audit", "training-audit 40Gi Warn 1 1 0").await;
    run.info("trainer is still running, Over, never evicted");

    run.say("overlapping budgets: llm-b is matched by llm-inference (8Gi) and team-b-default (20Gi)");
    let overlapping = |b: &GpuMemoryBudget| {
        b.status.as_ref().is_some_and(|s| s.conditions.iter().any(|c| c.type_ == "Overlapping" && c.status == "True"))
    };
    run.budget_until(ns_b, "llm-inference", "llm-inference Overlapping=True", overlapping).await;
    run.budget_until(ns_b, "team-b-default", "team-b-default Overlapping=True", overlapping).await;
    let matched = |n| move |b: &GpuMemoryBudget| b.status.as_ref().is_some_and(|s| s.matched_pods == n);
    run.budget_until(ns_b, "llm-inference", "llm-inference MATCHED 1 (llm-b: the smaller limit wins)", matched(1))
        .await;
    run.budget_until(ns_b, "team-b-default", "team-b-default MATCHED 1 (other-b)", matched(1)).await;
    let events = Api::<k8s_openapi::api::core::v1::Event>::namespaced(run.admin.clone(), ns_b)
        .list(&ListParams::default().fields("involvedObject.kind=GpuMemoryBudget,reason=Overlapping"))
        .await
        .expect("events");
    assert!(events.items.len() >= 2, "no Overlapping events on both budgets: {:?}", events.items);
    for row in core.gmb_table(ns_b).await.1 {
        run.info(&row.join(" | "));
    }
}

async fn node_restriction(core: &Core) {
    let (run, ns_a, ns_b, node, node2) = (&core.run, &core.ns_a, &core.ns_b, &core.node, &core.node2);
    let ids = &core.ids;
    run.say("node restriction, by the real admission policies and webhook");
    // Own node: allowed (the agent's records and its eviction above went through the same checks).
    patch_pod(&ids.agent.client, ns_b, "other-b", annotate("gpubudget.io/e2e-probe", Some("own-node")))
        .await
        .expect("the agent annotates a pod of its own node");
    patch_pod(&ids.agent.client, ns_b, "other-b", annotate("gpubudget.io/e2e-probe", None))
        .await
        .expect("and removes it");
    run.info(&format!("allowed: the agent of {node} annotates other-b (on {node})"));
    let over = Some("Over");
    refused(
        run,
        "not on its node",
        &format!("the agent of {node} annotating remote-a (on {node2})"),
        patch_pod(&ids.agent.client, ns_a, "remote-a", annotate("gpubudget.io/state", over)).await,
    );
    refused(
        run,
        &format!("may evict only pods of node {node}"),
        &format!("the agent of {node} evicting remote-a (on {node2})"),
        evict(&ids.agent.client, ns_a, "remote-a").await,
    );
    refused(
        run,
        "not on its node",
        &format!("the agent of {node2} annotating other-b (on {node})"),
        patch_pod(&ids.agent2.client, ns_b, "other-b", annotate("gpubudget.io/state", over)).await,
    );
    refused(
        run,
        &format!("may evict only pods of node {node2}"),
        &format!("the agent of {node2} evicting other-b (on {node})"),
        evict(&ids.agent2.client, ns_b, "other-b").await,
    );
    refused(
        run,
        "carries no node",
        "the agent's identity with an unbound token annotating other-b",
        patch_pod(&ids.unbound.client, ns_b, "other-b", annotate("gpubudget.io/state", over)).await,
    );
    refused(
        run,
        "gpubudget",
        "the agent's identity with an unbound token evicting other-b",
        evict(&ids.unbound.client, ns_b, "other-b").await,
    );
    refused(
        run,
        "which is not on its node",
        &format!(
            "the agent of {node} deleting remote-a (on {node2}; it may delete pods of its own node only, after blockedEvictionTimeoutSeconds)"
        ),
        Api::<Pod>::namespaced(ids.agent.client.clone(), ns_a).delete("remote-a", &DeleteParams::default()).await,
    );
    let forged: Event = serde_json::from_value(json!({
        "metadata": {"name": format!("forged-{}", run.id), "namespace": ns_b},
        "eventTime": jiff::Timestamp::now().to_string(), "reportingController": "gpubudget-agent",
        "reportingInstance": node, "action": "Evict", "reason": "EvictingForGpuMemory", "type": "Warning",
        "note": "forged by the agent of another node",
        "regarding": {"apiVersion": "v1", "kind": "Pod", "name": "other-b", "namespace": ns_b},
    }))
    .expect("an event");
    refused(
        run,
        &format!("must have reportingController gpubudget-agent and reportingInstance {node2}"),
        &format!("the agent of {node2} publishing an event as {node}"),
        Api::<Event>::namespaced(ids.agent2.client.clone(), ns_b).create(&PostParams::default(), &forged).await,
    );
    refused(
        run,
        "only the agent may set, change or remove them",
        &format!("the tenant (edit in {ns_a}) forging trainer's record"),
        patch_pod(&ids.tenant.client, ns_a, "trainer", annotate("gpubudget.io/state", Some("Within"))).await,
    );
    let forged_pod: Pod = serde_json::from_value(json!({
        "metadata": {"name": "forged", "namespace": ns_a,
                     "annotations": {"gpubudget.io/eviction-requested-at": "2026-01-01T00:00:00Z"}},
        "spec": {"containers": [{"name": "forged", "image": "registry.k8s.io/pause:3.10"}]},
    }))
    .expect("a pod");
    refused(
        run,
        "only the agent may set, change or remove them",
        "the tenant creating a pod with a record",
        Api::<Pod>::namespaced(ids.tenant.client.clone(), ns_a).create(&PostParams::default(), &forged_pod).await,
    );
    // The usage object (#34): each agent writes only the one named after its node, naming its node, owned by it.
    refused(
        run,
        &format!("spec.nodeName must be {node2}"),
        &format!("the agent of {node2} writing its own object naming {node}"),
        apply_as(&ids.agent2.client, &usage_body(node2, node), "").await,
    );
    apply_as(&ids.agent2.client, &usage_body(node2, node2), "")
        .await
        .expect("the agent of node 2 writes its own GpuNodeUsage");
    run.info(&format!("allowed: the agent of {node2} writes GpuNodeUsage {node2}"));
    refused(
        run,
        &format!("may write only the GpuNodeUsage {node2}, not {node}"),
        &format!("the agent of {node2} writing GpuNodeUsage {node}"),
        apply_as(&ids.agent2.client, &usage_body(node, node), "").await,
    );
    refused(
        run,
        "carries no node",
        &format!("the agent's identity with an unbound token writing GpuNodeUsage {node}"),
        apply_as(&ids.unbound.client, &usage_body(node, node), "").await,
    );
    refused(
        run,
        "forbidden",
        &format!("the tenant (edit in {ns_a}) writing GpuNodeUsage {node}"),
        apply_as(&ids.tenant.client, &usage_body(node, node), "").await,
    );
    refused(
        run,
        "forbidden",
        &format!("the tenant (edit in {ns_a}) reading the nodes' usage"),
        Api::<DynamicObject>::all_with(ids.tenant.client.clone(), &gpubudget_resource("GpuNodeUsage"))
            .list(&ListParams::default())
            .await,
    );
    // Owned by its Node (the agent's own writes name it as owner): deleted with the Node, at the end of the run.
    let node2_uid = Api::<Node>::all(run.admin.clone()).get(node2).await.expect("node 2").uid();
    let mut owned = usage_body(node2, node2);
    owned["metadata"]["ownerReferences"] =
        json!([{"apiVersion": "v1", "kind": "Node", "name": node2, "uid": node2_uid}]);
    apply_as(&ids.agent2.client, &owned, "")
        .await
        .expect("the agent of node 2 names its Node as its usage object's owner");
    patch_pod(&ids.tenant.client, ns_a, "trainer", annotate("team.example/owner", Some("me")))
        .await
        .expect("the tenant sets its own annotation");
    run.info("allowed: the tenant's own annotations on its pods");
    assert!(!run.is_terminating(ns_b, "other-b").await, "other-b is being deleted");
    assert!(!run.is_terminating(ns_a, "remote-a").await, "remote-a is being deleted");
    assert_eq!(
        annotation(&run.pod(ns_a, "trainer").await, "state").as_deref(),
        Some("Over"),
        "trainer's record changed"
    );
}

async fn mirrors(core: &Core) {
    let (run, ns, ns_a) = (&core.run, &core.ns, &core.ns_a);
    let lease = core.mirrors_lease();
    run.say("mirrors (#34): the operator copies each budget's spec; the agent reads the mirrors alone, so no status write reaches it");
    run.object_until(
        Api::<Lease>::namespaced(run.admin.clone(), ns),
        &lease,
        &format!("the operator vouches for the mirrors (Lease {ns}/{lease})"),
        |_| true,
    )
    .await;
    let admin = core.addr(0);
    run.until(
        &format!("the agent reads the mirrors only (--mirrors-lease {ns}/{lease} renewed under its eyes)"),
        || async {
            metric(&metrics(&admin).await, "gpubudget_budget_specs_from_mirrors{kind=\"GpuMemoryBudget\"}").as_deref()
                == Some("1")
        },
    )
    .await;
    let mirrors =
        Api::<DynamicObject>::namespaced_with(run.admin.clone(), ns_a, &gpubudget_resource("GpuMemoryBudgetMirror"));
    let mirror = mirrors.get("llm-inference").await.expect("the mirror");
    let budget = Api::<DynamicObject>::namespaced_with(run.admin.clone(), ns_a, &gpubudget_resource("GpuMemoryBudget"))
        .get("llm-inference")
        .await
        .expect("the budget");
    assert_eq!(mirror.data["spec"]["budget"], budget.data["spec"], "the mirror's spec is not the budget's");
    let owner = mirror.metadata.owner_references.clone().unwrap_or_default();
    assert_eq!(
        owner.first().map(|o| (o.kind.clone(), Some(o.uid.clone()), o.controller)),
        Some(("GpuMemoryBudget".to_owned(), budget.uid(), Some(true))),
        "the mirror is not owned by its budget"
    );
    let generation = budget.metadata.generation.expect("a generation").to_string();
    assert_eq!(
        mirror.annotations().get("gpubudget.io/budget-generation"),
        Some(&generation),
        "the mirror's generation is not the budget's"
    );
    run.info(&format!("gmbmirror/llm-inference: the budget's spec at generation {generation}, owned by it"));
    let mut forged: DynamicObject = mirror.clone();
    forged.metadata =
        kube::core::ObjectMeta { name: Some("forged".into()), namespace: Some(ns_a.clone()), ..Default::default() };
    let tenant_mirrors = Api::<DynamicObject>::namespaced_with(
        core.ids.tenant.client.clone(),
        ns_a,
        &gpubudget_resource("GpuMemoryBudgetMirror"),
    );
    let agent_mirrors = Api::<DynamicObject>::namespaced_with(
        core.ids.agent.client.clone(),
        ns_a,
        &gpubudget_resource("GpuMemoryBudgetMirror"),
    );
    refused(
        run,
        "forbidden",
        &format!("the tenant (edit in {ns_a}) writing a mirror"),
        tenant_mirrors.create(&PostParams::default(), &forged).await,
    );
    refused(
        run,
        "forbidden",
        "the agent writing a mirror",
        agent_mirrors.create(&PostParams::default(), &forged).await,
    );
    refused(
        run,
        "forbidden",
        &format!("the tenant (edit in {ns_a}) deleting a mirror"),
        tenant_mirrors.delete("llm-inference", &DeleteParams::default()).await,
    );
    mirrors.delete("llm-inference", &DeleteParams::default()).await.expect("the admin deletes a mirror");
    let old = mirror.uid();
    run.object_until(mirrors, "llm-inference", "a mirror deleted by hand is written again by the operator", |m| {
        m.uid() != old
    })
    .await;
}

async fn operator_down_and_back(core: &mut Core) {
    let (ns_a, ns_b) = (core.ns_a.clone(), core.ns_b.clone());
    core.run.say("operator down: the agent records and warns; its eviction waits for the webhook (failurePolicy Fail)");
    core.operator.take().expect("running").stop();
    core.usage((0, 0), 45 * GI, 9 * GI, 2 * GI, None, 0);
    core.run.event(&ns_b, "llm-b", "GpuMemoryOverBudget").await;
    let over = Instant::now();
    core.run.record_is(&ns_b, "llm-b", "state", "Evicting").await;
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert!(
        !core.run.is_terminating(&ns_b, "llm-b").await,
        "llm-b was evicted while the webhook was down (failurePolicy Fail)"
    );
    let log = core.agent_log();
    let failed = log.lines().find(|l| l.contains("llm-b") && l.contains("eviction request failed"));
    let failed = failed.expect("the agent reports a failed eviction of llm-b while the operator is down");
    core.run.info(&failed.chars().take(240).collect::<String>());

    core.run.say("operator back: the agent's retry goes through, counted once");
    core.start_operator().await;
    core.run.terminating(&ns_b, "llm-b").await;
    core.run.info(&format!("evicted {}s after going over (retries back off 5 s, doubling)", over.elapsed().as_secs()));
    assert_eq!(core.grace(&ns_b, "llm-b").await, Some(30), "llm-b's grace");
    core.evictions_are(&ns_b, "llm-inference", 1).await;
    core.usage((0, 0), 45 * GI, 0, 2 * GI, None, 0);
    core.run.gone(&ns_b, "llm-b", &[4104]).await;
    tokio::time::sleep(Duration::from_secs(3)).await;
    let count = |b: GpuMemoryBudget| b.status.map(|s| s.evictions);
    assert_eq!(count(core.budget(&ns_b, "llm-inference").await), Some(1), "llm-inference ({ns_b})");
    assert_eq!(
        count(core.budget(&ns_a, "llm-inference").await),
        Some(1),
        "llm-inference ({ns_a}) recounted after the operator's restart"
    );
    assert_eq!(core.run.occurrences(&ns_b, "llm-b", "EvictingForGpuMemory").await, 1, "EvictingForGpuMemory on llm-b");
    let accepted = core
        .agent_log()
        .lines()
        .filter(|l| l.contains("eviction requested and accepted") && l.contains("llm-b"))
        .count();
    assert_eq!(accepted, 1, "accepted evictions of llm-b");
}

async fn pdb_escalated(core: &Core) {
    let (run, ns_b, node) = (&core.run, &core.ns_b, &core.node);
    run.say("a PodDisruptionBudget that never allows it (maxUnavailable 0): refused, then deleted after blockedEvictionTimeoutSeconds");
    let uid = run.make_pod(ns_b, "held", node, &[("app", "held")]).await;
    run.process(4107, ns_b, "held", &uid);
    run.apply(&json!({"apiVersion": "policy/v1", "kind": "PodDisruptionBudget", "metadata": {"name": "held", "namespace": ns_b},
        "spec": {"maxUnavailable": 0, "selector": {"matchLabels": {"app": "held"}}}}), ns_b).await;
    run.apply(&json!({"apiVersion": "gpubudget.io/v1alpha1", "kind": "GpuMemoryBudget", "metadata": {"name": "held", "namespace": ns_b},
        "spec": {"selector": {"matchLabels": {"app": "held"}}, "limit": "1Gi", "overLimitSeconds": 0,
                 "evictionGracePeriodSeconds": 5, "blockedEvictionTimeoutSeconds": 5}}), ns_b).await;
    core.usage((0, 0), 45 * GI, 0, 0, None, 2 * GI);
    let blocked = run.event(ns_b, "held", "GpuMemoryEvictionBlocked").await;
    let blocked_at = Instant::now();
    run.info(&blocked.note.unwrap_or_default().chars().take(200).collect::<String>());
    assert!(!run.is_terminating(ns_b, "held").await, "held was evicted through its PodDisruptionBudget");
    let deleting = run.event(ns_b, "held", "DeletingForGpuMemory").await;
    run.terminating(ns_b, "held").await;
    run.info(&format!(
        "deleted {}s after the first refusal: {}",
        blocked_at.elapsed().as_secs(),
        deleting.note.unwrap_or_default().chars().take(160).collect::<String>()
    ));
    assert_eq!(core.grace(ns_b, "held").await, Some(5), "held's grace, the budget's 5");
    core.usage((0, 0), 45 * GI, 0, 0, None, 0);
    run.gone(ns_b, "held", &[4107]).await;
}

/// Since #52 pressure relief evicts only where a neighbour within its guarantee is short: serve-b (request and
/// limit 10Gi) at 8 GiB is owed 2 GiB, more than the 2.6 GiB free less the 1 GiB claim slack. Of the pods above
/// their guarantee the one most above it goes: other-b (27 of 20Gi, 7 over), not trainer (42 of its Warn 40Gi, 2
/// over: Warn does not exempt from pressure, it ranks it).
async fn pressure(core: &Core) {
    let (run, ns_a, ns_b, node) = (&core.run, &core.ns_a, &core.ns_b, &core.node);
    run.say("pressure: the GPU fills (2.6 GiB free of 79.6, under the 5 % threshold) and serve-b, within its 10Gi request, is owed 2 GiB; other-b, 27Gi of its 20Gi budget (the most above its guarantee), goes at once");
    run.apply(&json!({"apiVersion": "gpubudget.io/v1alpha1", "kind": "GpuMemoryBudget", "metadata": {"name": "serve", "namespace": ns_b},
        "spec": {"selector": {"matchLabels": {"app": "serve"}}, "limit": "10Gi", "request": "10Gi"}}), ns_b).await;
    let uid = run.make_pod(ns_b, "serve-b", node, &[("app", "serve")]).await;
    run.process(4110, ns_b, "serve-b", &uid);
    let sample = run.sample();
    sample.set_usage_and_device(&[(4103, 42 * GI), (4110, 8 * GI)], 50 * GI);
    run.record_is(ns_b, "serve-b", "budget", "serve").await;
    sample.set_usage_and_device(&[(4103, 42 * GI), (4105, 27 * GI), (4110, 8 * GI)], 77 * GI);
    run.node_event(node, "GpuMemoryPressure").await;
    let pressure_at = Instant::now();
    run.terminating(ns_b, "other-b").await;
    run.info(&format!(
        "evicted {}s after the Node event (team-b-default's overLimitSeconds is 10 s)",
        pressure_at.elapsed().as_secs()
    ));
    // The kubelet's part: other-b's processes exit on SIGTERM; 6.6 GiB free.
    sample.set_usage_and_device(&[(4103, 42 * GI), (4110, 8 * GI)], 50 * GI);
    assert_eq!(core.grace(ns_b, "other-b").await, Some(5), "other-b's grace, the pressure grace 5");
    let note = run.notes(ns_b, "other-b", "EvictingForGpuMemory").await.join("\n");
    assert!(note.contains("under memory pressure"), "other-b's eviction event does not say pressure: {note}");
    run.info(&note.chars().take(200).collect::<String>());
    assert!(
        !run.is_terminating(ns_a, "trainer").await,
        "trainer (Warn, less above its guarantee) was evicted for pressure"
    );
    assert!(!run.is_terminating(ns_b, "serve-b").await, "serve-b (within its request) was evicted for pressure");
    core.evictions_are(ns_b, "team-b-default", 1).await;
    run.gone(ns_b, "other-b", &[4105]).await;
    run.node_event(node, "GpuMemoryPressureEnded").await;
    sample.set_usage_and_device(&[(4103, 45 * GI)], 45 * GI);
    run.gone(ns_b, "serve-b", &[4110]).await;
}

async fn gpu_lost_and_back(core: &Core) {
    let (run, ns_b, node) = (&core.run, &core.ns_b, &core.node);
    run.say("one GPU of two lost: nothing is decided from it, the other GPU is enforced; back, it is");
    let uid = run.make_pod(ns_b, "lost-b", node, &[("app", "llm")]).await; // llm-inference (8Gi, overLimitSeconds 10)
    run.process(4108, ns_b, "lost-b", &uid);
    // GPU 0 holds the trainer's 45Gi; GPU 1 holds lost-b's process, or fails.
    let trainer: &[(u32, u64)] = &[(4103, 45 * GI)];
    let lost: &[(u32, u64)] = &[(4108, 30 * GI)];
    run.sample().set_gpus(&[(trainer, None), (lost, Some("GPU is lost"))]);
    let message = run.node_event(node, "GpuSampleFailed").await;
    run.info(&message.chars().take(200).collect::<String>());
    run.record_is(ns_b, "lost-b", "state", "Within").await; // from the GPU that is sampled: nothing
    let admin = core.addr(0);
    assert!(
        http_get(&admin, "/ready").await.is_some_and(|(code, _)| code == 200),
        "the agent is not ready with one GPU of two sampled"
    );
    assert_eq!(
        metric(&metrics(&admin).await, "gpubudget_gpu_sampled{gpu=\"1\"}").as_deref(),
        Some("0"),
        "gpubudget_gpu_sampled{{gpu=\"1\"}}"
    );
    tokio::time::sleep(Duration::from_secs(13)).await; // past overLimitSeconds: whatever GPU 1 held, nothing was decided from it
    assert!(
        !run.has_event(ns_b, "lost-b", "GpuMemoryOverBudget").await,
        "lost-b judged from a GPU whose sample failed"
    );
    assert!(!run.is_terminating(ns_b, "lost-b").await, "lost-b evicted from a GPU whose sample failed");
    run.sample().set_gpus(&[(trainer, None), (lost, None)]);
    run.node_event(node, "GpuSampleRecovered").await;
    let back = Instant::now();
    run.event(ns_b, "lost-b", "GpuMemoryOverBudget").await;
    run.terminating(ns_b, "lost-b").await;
    run.info(&format!("evicted {}s after GPU 1 came back (overLimitSeconds 10)", back.elapsed().as_secs()));
    core.evictions_are(ns_b, "llm-inference", 2).await;
    core.usage((0, 0), 45 * GI, 0, 0, Some(45 * GI), 0);
    run.gone(ns_b, "lost-b", &[4108]).await;
}

async fn leader_crash(core: &mut Core) {
    let ns = core.ns.clone();
    let ns_b = core.ns_b.clone();
    core.run.say("two operator replicas (leader election, as the chart runs them): the leader crashes; the other answers the eviction check at once, then takes the Lease");
    core.operator.take().expect("running").stop();
    let (webhook_a, webhook_b, admin_a, admin_b, front) =
        (core.addr(3), core.addr(4), core.addr(5), core.addr(6), core.addr(7));
    let lease = core.mirrors_lease();
    let replica = |name: &str, admin: &str, webhook: &str| {
        core.run.spawn_operator(&OperatorRun {
            identity: &core.ids.operator,
            ns: &ns,
            pod: name,
            admin,
            webhook: Some(webhook),
            extra: &["--leader-election", "--mirrors-lease-name", &lease],
            rust_log: "info,gpubudget_operator=debug",
            log: &format!("operator-{name}.log"),
        })
    };
    let mut a = replica("operator-a", &admin_a, &webhook_a);
    let mut b = replica("operator-b", &admin_b, &webhook_b);
    let leases = Api::<Lease>::namespaced(core.run.admin.clone(), &ns);
    let holder = |l: &Lease| l.spec.as_ref().and_then(|s| s.holder_identity.clone());
    let leader = core.run.object_until(leases.clone(), "gpubudget-operator", "a leader", |l| holder(l).is_some()).await;
    let leader = holder(&leader).expect("a holder");
    core.run.ready("replica a ready", &admin_a).await;
    core.run.ready("replica b ready (the follower too: it serves the eviction check)", &admin_b).await;
    let (survivor, survivor_admin, survivor_webhook, leader_webhook) = if leader == "operator-a" {
        ("operator-b", &admin_b, &webhook_b, &webhook_a)
    } else {
        ("operator-a", &admin_a, &webhook_a, &webhook_b)
    };
    // The Service in front of the replicas: each connection to the first that accepts it, the leader tried first
    // (a Service does not know who leads; the eviction check does not need the leader).
    let failover = Failover::start(&front, &[leader_webhook, survivor_webhook]).await;
    let patch = json!([{"op": "replace", "path": "/webhooks/0/clientConfig/url", "value": format!("https://{front}/validate-eviction")}]);
    let hooks =
        Api::<k8s_openapi::api::admissionregistration::v1::ValidatingWebhookConfiguration>::all(core.run.admin.clone());
    hooks
        .patch(
            &core.webhook_config,
            &PatchParams::default(),
            &Patch::Json::<()>(serde_json::from_value(patch).expect("a patch")),
        )
        .await
        .expect("the webhook behind the front");
    if leader == "operator-a" {
        a.crash()
    } else {
        b.crash()
    }
    core.run.info(&format!("leader {leader} killed (SIGKILL: no hand-over; its Lease runs out after 15 s)"));
    let killed = Instant::now();
    let uid = core.run.make_pod(&ns_b, "ha-b", &core.node, &[("app", "llm")]).await;
    core.run.process(4109, &ns_b, "ha-b", &uid);
    let trainer: &[(u32, u64)] = &[(4103, 45 * GI)];
    let ha: &[(u32, u64)] = &[(4109, 9 * GI)];
    core.run.sample().set_gpus(&[(trainer, None), (ha, None)]);
    core.run.event(&ns_b, "ha-b", "GpuMemoryOverBudget").await;
    core.run.terminating(&ns_b, "ha-b").await;
    let evicted = killed.elapsed().as_secs();
    let log = failover.log();
    assert!(
        log.contains(&format!("connection -> {survivor_webhook}")),
        "no eviction check reached {survivor}: {log:?}"
    );
    core.run
        .object_until(leases, "gpubudget-operator", &format!("the Lease moves to {survivor}"), |l| {
            holder(l).as_deref() == Some(survivor)
        })
        .await;
    let moved = killed.elapsed().as_secs();
    core.evictions_are(&ns_b, "llm-inference", 3).await;
    core.run.info(&format!(
        "after the leader's crash: ha-b evicted at {evicted}s, the Lease held by {survivor} at {moved}s, the eviction counted at {}s",
        killed.elapsed().as_secs()
    ));
    assert_eq!(
        metric(&metrics(survivor_admin).await, "gpubudget_operator_leader").as_deref(),
        Some("1"),
        "{survivor} does not say it leads"
    );
    assert_eq!(core.run.occurrences(&ns_b, "ha-b", "EvictingForGpuMemory").await, 1, "EvictingForGpuMemory on ha-b");
    core.run.gone(&ns_b, "ha-b", &[4109]).await;
    core.extra.push(a);
    core.extra.push(b);
}

async fn node_deleted(core: &Core) {
    let (run, ns_a, node2) = (&core.run, &core.ns_a, &core.node2);
    run.say("a Node deleted: the garbage collector deletes its GpuNodeUsage with it");
    let usages = Api::<DynamicObject>::all_with(run.admin.clone(), &gpubudget_resource("GpuNodeUsage"));
    let usage = usages.get(node2).await.unwrap_or_else(|e| panic!("no GpuNodeUsage {node2} to collect: {e}"));
    run.gone(ns_a, "remote-a", &[4106]).await;
    Api::<Node>::all(run.admin.clone()).delete(node2, &DeleteParams::default()).await.expect("node 2 deleted");
    let uid = usage.uid().expect("a uid");
    let gone = kube::runtime::wait::await_condition(usages, node2, kube::runtime::wait::conditions::is_deleted(&uid));
    tokio::time::timeout(crate::harness::step_timeout(), gone).await.expect("collected in time").expect("watched");
    run.info(&format!("ok: GpuNodeUsage {node2} deleted with Node {node2}"));
}

/// What the operator's Service does for the eviction check in a cluster (formerly failover.py): listens on a front
/// address and hands each TCP connection to the first of the backends that accepts one (TLS passes through
/// untouched: the webhook's certificate is for 127.0.0.1). A replica that is down refuses at once, as a Service's
/// endpoint that is not ready is left out. Each connection is logged with the backend it went to; it stops
/// listening when dropped.
struct Failover {
    accepting: tokio::task::JoinHandle<()>,
    log: std::sync::Arc<std::sync::Mutex<Vec<String>>>,
}

impl Failover {
    async fn start(front: &str, backends: &[&str]) -> Self {
        let listener = tokio::net::TcpListener::bind(front).await.expect("the front listens");
        let backends: Vec<String> = backends.iter().map(|b| (*b).to_owned()).collect();
        let log = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let written = log.clone();
        let accepting = tokio::spawn(async move {
            while let Ok((mut client, _)) = listener.accept().await {
                let mut chosen = None;
                for backend in &backends {
                    let connect = tokio::net::TcpStream::connect(backend.as_str());
                    if let Ok(Ok(upstream)) = tokio::time::timeout(Duration::from_secs(2), connect).await {
                        chosen = Some((backend, upstream));
                        break;
                    }
                }
                let line = match chosen {
                    Some((backend, mut upstream)) => {
                        tokio::spawn(async move {
                            let _ = tokio::io::copy_bidirectional(&mut client, &mut upstream).await;
                        });
                        format!("connection -> {backend}")
                    }
                    None => "connection refused: no backend".to_owned(),
                };
                written.lock().expect("the log").push(line);
            }
        });
        Self { accepting, log }
    }

    /// The connections so far, each `connection -> <backend>` or `connection refused: no backend`.
    fn log(&self) -> Vec<String> {
        self.log.lock().expect("the log").clone()
    }
}

impl Drop for Failover {
    fn drop(&mut self) {
        self.accepting.abort();
    }
}
