//! Observe first (issue 54; formerly e2e/apiserver/observe.sh): one agent (token bound to its Node) with the
//! chart's RBAC and admission policies, started as the chart starts it with `agent.enforcement=Observe`
//! (`GPUBUDGET_ENFORCEMENT=Observe`), and the API server's own Eviction API and CEL validation. On one replayed
//! GPU:
//! a. a pod over its Evict budget (8Gi, overLimitSeconds 2) at 9 GiB for 20 s: not evicted; GpuMemoryWouldEvict
//!    once, naming the agent's default; its record stays Over, no eviction time; gpubudget_would_evict_total
//!    counts it, gpubudget_evictions_total nothing; `kubectl gpubudget why` answers WouldEvict;
//! b. GPU memory pressure where a neighbour is harmed: a pod no budget selects at 43 GiB beside `serve` (request
//!    30Gi) at 27 GiB and llm, under 1 GiB free: not evicted for 20 s; GpuMemoryWouldEvict (pressure) once;
//! c. the API server refuses `enforcement: observe` (the CRD's enum);
//! d. the budget of (a) switched to `enforcement: Enforce`: its pod is evicted;
//! e. the Node labelled `gpubudget.io/enforcement=Enforce`: the pod of (b) is evicted for pressure.

use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::Node;
use kube::api::{Api, Patch, PatchParams};
use serde_json::{Value, json};

use crate::harness::{Binary, GI, RBAC_AND_POLICIES, Run, Workloads, annotation, metric, metrics, refusal};

const AGENT: &str = "gpubudget-agent";
const PLUGIN: &str = "kubectl-gpubudget";

pub async fn observe_first() {
    let mut run = Run::start("gpubudget-ob", &[AGENT, PLUGIN]).await;
    let id = run.id.clone();
    let release = format!("gpubudget-ob-{id}");
    run.say("control plane, CRDs, the chart's RBAC and admission policies, one node");
    run.apply_crds().await;
    let ns = run.namespace(&format!("gpubudget-ob-{id}")).await;
    let ns_w = run.namespace(&format!("gpubudget-ob-{id}-w")).await;
    run.apply_chart(&release, &ns, RBAC_AND_POLICIES, None).await;
    let node = format!("gpubudget-ob-{id}-n1");
    let node_uid = run.node(&node).await;
    run.sample().set_usage(&[]);

    run.say("the agent as the chart starts it with agent.enforcement=Observe (GPUBUDGET_ENFORCEMENT=Observe)");
    let agent_id = run.chart_agent(&ns, &release, (&node, &node_uid), "agent").await;
    let admin = run.addr(0);
    let env = [("RUST_LOG", "info"), ("GPUBUDGET_ENFORCEMENT", "Observe")];
    let _agent: Binary = run.start_agent(&agent_id, &node, &admin, &[], &env, "agent.log").await;
    let mut w = Workloads::new(&run, &ns_w, &node, 7400);
    let mut summary = Vec::new();

    run.say("a. llm over its Evict budget (8Gi, overLimitSeconds 2) at 9 GiB, for 20 s");
    w.budget("llm", json!({"limit": "8Gi", "overLimitSeconds": 2})).await.expect("the budget");
    w.pod("llm").await;
    let over = Instant::now();
    w.sample(&[("llm", 9 * GI)]);
    run.event(&ns_w, "llm", "GpuMemoryWouldEvict").await;
    let told = over.elapsed().as_secs_f64();
    w.kept("llm", 20).await;
    assert!(!run.has_event(&ns_w, "llm", "EvictingForGpuMemory").await, "an EvictingForGpuMemory on llm");
    assert_eq!(run.occurrences(&ns_w, "llm", "GpuMemoryWouldEvict").await, 1, "GpuMemoryWouldEvict in one episode");
    let note = run.notes(&ns_w, "llm", "GpuMemoryWouldEvict").await.remove(0);
    run.info(&format!("GpuMemoryWouldEvict {told:.1}s after going over: {note}"));
    let expected = format!(
        "would be evicted (observe mode: the agent's default, --enforcement (chart value agent.enforcement); nothing \
         is evicted): using 9Gi of 8Gi (budget {ns_w}/llm) for "
    );
    assert!(note.starts_with(&expected), "unexpected note: {note}");
    let pod = run.pod(&ns_w, "llm").await;
    assert_eq!(annotation(&pod, "state").as_deref(), Some("Over"), "llm's record");
    assert_eq!(annotation(&pod, "eviction-requested-at"), None, "llm's record has an eviction time");
    let text = metrics(&admin).await;
    let would = metric(&text, "gpubudget_would_evict_total{cause=\"budget\",set_by=\"agent\"}");
    assert_eq!(would.as_deref(), Some("1"), "gpubudget_would_evict_total{{cause=budget,set_by=agent}}");
    assert_eq!(metric(&text, "gpubudget_evictions_total{"), None, "gpubudget_evictions_total counts an eviction");
    let why: Value =
        serde_json::from_str(&run.output(PLUGIN, &["why", "-n", &ns_w, "llm", "-o", "json"])).expect("json");
    let next = format!(
        "{}: {}",
        why["next"]["action"].as_str().unwrap_or_default(),
        why["next"]["message"].as_str().unwrap_or_default()
    );
    run.info(&format!("kubectl gpubudget why: {next}"));
    assert!(next.starts_with("WouldEvict: would be evicted (observe mode: the agent's default"), "why says: {next}");
    summary.push(format!(
        "a: llm at 9 of 8 GiB, overLimitSeconds 2: GpuMemoryWouldEvict once ({told:.1}s after going over), not \
         evicted in 20 s; record Over without eviction time; would_evict_total 1, evictions_total none; why: WouldEvict"
    ));

    run.say("b. pressure: nb (no budget) at 43 GiB beside serve (request 30Gi) at 27 GiB and llm: under 1 GiB free, serve owed 3, for 20 s");
    w.budget("serve", json!({"limit": "30Gi", "request": "30Gi"})).await.expect("the budget");
    w.pod("serve").await;
    w.pod("nb").await;
    w.sample(&[("llm", 9 * GI), ("serve", 27 * GI), ("nb", 43 * GI)]);
    run.until("the GPU under pressure", || async {
        metric(&metrics(&admin).await, "gpubudget_gpu_memory_pressure{").as_deref() == Some("1")
    })
    .await;
    run.event(&ns_w, "nb", "GpuMemoryWouldEvict").await;
    w.kept("nb", 20).await;
    assert_eq!(run.occurrences(&ns_w, "nb", "GpuMemoryWouldEvict").await, 1, "nb's GpuMemoryWouldEvict in one episode");
    assert!(!run.has_event(&ns_w, "serve", "GpuMemoryWouldEvict").await, "serve (within its request) was named");
    let note = run.notes(&ns_w, "nb", "GpuMemoryWouldEvict").await.remove(0);
    run.info(&format!("GpuMemoryWouldEvict: {}", note.chars().take(300).collect::<String>()));
    let at = note.find("GPU 0 is under memory pressure").unwrap_or_else(|| panic!("unexpected note: {note}"));
    assert!(note[at..].contains("no budget selects it"), "unexpected note: {note}");
    let would = metric(&metrics(&admin).await, "gpubudget_would_evict_total{cause=\"pressure\",set_by=\"agent\"}");
    assert_eq!(would.as_deref(), Some("1"), "gpubudget_would_evict_total{{cause=pressure,set_by=agent}}");
    assert_eq!(
        run.occurrences(&ns_w, "llm", "GpuMemoryWouldEvict").await,
        1,
        "llm's GpuMemoryWouldEvict (once per episode)"
    );
    summary.push(
        "b: nb (no budget, 43 GiB) beside serve owed 3 GiB with under 1 GiB free: GpuMemoryWouldEvict (pressure) \
         once, not evicted in 20 s; serve never named"
            .to_owned(),
    );

    run.say("c. the API server refuses enforcement: observe (the CRD's enum)");
    let spec = json!({"limit": "8Gi", "overLimitSeconds": 2, "enforcement": "observe"});
    let message = refusal(w.budget("llm", spec).await, "enforcement: observe");
    run.info(&format!("refused: {}", message.chars().take(240).collect::<String>()));
    assert!(message.contains("Unsupported value: \"observe\""), "refused for another reason: {message}");
    summary.push("c: enforcement: observe refused by the API server (enum Observe, Enforce)".to_owned());

    run.say("d. llm's budget switched to enforcement: Enforce");
    let switched = Instant::now();
    w.budget("llm", json!({"limit": "8Gi", "overLimitSeconds": 2, "enforcement": "Enforce"})).await.expect("switched");
    run.terminating(&ns_w, "llm").await;
    let after = switched.elapsed().as_secs_f64();
    let evicting = run.notes(&ns_w, "llm", "EvictingForGpuMemory").await.join(" ");
    run.info(&format!(
        "llm terminating {after:.1}s after the switch: {}",
        evicting.chars().take(200).collect::<String>()
    ));
    assert!(run.has_event(&ns_w, "llm", "GpuMemoryBudgetChanged").await, "no GpuMemoryBudgetChanged for the switch");
    assert!(!run.is_terminating(&ns_w, "nb").await, "nb evicted while the node observes");
    // The kubelet's part: llm's processes exit and it goes; nb grows so that serve is still short.
    w.gone("llm").await;
    w.sample(&[("serve", 27 * GI), ("nb", 51 * GI)]);
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert!(!run.is_terminating(&ns_w, "nb").await, "nb evicted while the node observes");
    summary.push(format!(
        "d: llm's budget switched to Enforce: llm evicted {after:.1}s later (the period started afresh: \
         GpuMemoryBudgetChanged); nb still not"
    ));

    run.say("e. the Node labelled gpubudget.io/enforcement=Enforce (read within 60 s)");
    let labelled = Instant::now();
    let label = json!({"metadata": {"labels": {"gpubudget.io/enforcement": "Enforce"}}});
    Api::<Node>::all(run.admin.clone())
        .patch(&node, &PatchParams::default(), &Patch::Merge(&label))
        .await
        .expect("labelled");
    // The agent reads its Node's labels every 60 s: a longer wait than the step timeout's default.
    let nodes_read = tokio::time::timeout(Duration::from_secs(90), async {
        while !run.is_terminating(&ns_w, "nb").await {
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
    });
    nodes_read.await.expect("nb evicted for pressure within 90 s of the label");
    let after = labelled.elapsed().as_secs_f64();
    let evicting = run.notes(&ns_w, "nb", "EvictingForGpuMemory").await.join(" ");
    run.info(&format!(
        "nb terminating {after:.1}s after the label: {}",
        evicting.chars().take(200).collect::<String>()
    ));
    assert!(!run.is_terminating(&ns_w, "serve").await, "serve was evicted");
    summary.push(format!(
        "e: the Node labelled Enforce: nb evicted for pressure {after:.1}s later (the label is read every 60 s); \
         serve kept"
    ));

    run.say("summary (real kube-apiserver, replayed GPU, GPUBUDGET_ENFORCEMENT=Observe)");
    for line in &summary {
        run.info(line);
    }
    run.say(&format!(
        "PASS: observing evicts nothing and tells what it would; a budget, then a node, switched to Enforce act ({} s)",
        run.elapsed()
    ));
}
