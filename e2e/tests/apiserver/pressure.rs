//! Pressure relief in both directions (issue 52; formerly pressure-harm.sh): one agent (token bound to its Node)
//! with the chart's RBAC and admission policies, at its defaults (hard threshold 5 %, unbudgetedPods Ranked,
//! namespaced budgets Trusted) but `--pressure-blocked-timeout 20s`, and the API server's own disruption
//! controller and Eviction API. On one replayed GPU (the demo's H100, 79.6 GiB):
//! e. never where nobody is harmed: a pod no budget selects, alone, holding 77 GiB (2.6 GiB free, under the 5 %
//!    threshold: what vLLM at 0.95 does): not evicted for 60 s; the Node says GpuMemoryFullNoneHarmed, once;
//! f. Warn does not exempt: a pod under a Warn budget (limit 10Gi, request 1Gi) at 50 GiB beside `serve` within its
//!    Evict budget (limit and request 30Gi) at 28 GiB, 1.6 GiB free: the Warn pod is evicted, serve never;
//! g. the bound counts pressure in all: an administrator's 40Gi budget (overLimitSeconds 3600) over `hog` at 70 GiB
//!    behind a PodDisruptionBudget (maxUnavailable 0); the neighbour `nb` (its 20Gi budget) alternates 12 s at
//!    8 GiB and 14 s at nothing, as one that meets CUDA OOM, frees and restarts: hog is deleted once 20 s of
//!    pressure have passed in all (before issue 52: never, the bound restarting with each episode).

use std::time::{Duration, Instant};

use serde_json::json;

use crate::harness::{GI, RBAC_AND_POLICIES, Run, Workloads, annotation, metric, metrics};

/// `--pressure-blocked-timeout`, seconds.
const BOUND: u64 = 20;

pub async fn harm() {
    let mut run = Run::start("gpubudget-ph", &["gpubudget-agent"]).await;
    let id = run.id.clone();
    let release = format!("gpubudget-ph-{id}");
    run.say("control plane, CRDs, the chart's RBAC and admission policies, one node");
    run.apply_crds().await;
    let ns = run.namespace(&release).await;
    let ns_w = run.namespace(&format!("{release}-w")).await;
    run.apply_chart(&release, &ns, RBAC_AND_POLICIES, None).await;
    let node = format!("{release}-n1");
    let node_uid = run.node(&node).await;
    run.sample().set_usage(&[]);

    run.say(&format!("the agent at its defaults, --pressure-blocked-timeout {BOUND}s"));
    let identity = run.chart_agent(&ns, &release, (&node, &node_uid), "agent").await;
    let admin = run.addr(0);
    let bound = format!("{BOUND}s");
    let extra = ["--pressure-blocked-timeout", bound.as_str()];
    let _agent = run.start_agent(&identity, &node, &admin, &extra, &[("RUST_LOG", "info")], "agent.log").await;
    let pressure = || async { metric(&metrics(&admin).await, "gpubudget_gpu_memory_pressure{") };
    let mut w = Workloads::new(&run, &ns_w, &node, 7200);
    let mut summary = Vec::new();

    run.say("e. a pod no budget selects, alone, at 77 GiB (2.6 GiB free, under the 5 % threshold): 60 s");
    w.pod("vllm").await;
    w.sample(&[("vllm", 77 * GI)]);
    run.until("the GPU under pressure", || async { pressure().await.as_deref() == Some("1") }).await;
    let told = || async { run.node_events(&node, "GpuMemoryFullNoneHarmed").await.iter().map(|(n, _)| n).sum::<i32>() };
    run.until("GpuMemoryFullNoneHarmed on the Node", || async { told().await > 0 }).await;
    let note = run.node_events(&node, "GpuMemoryFullNoneHarmed").await.remove(0).1;
    run.info(&format!("Node: GpuMemoryFullNoneHarmed: {}", note.chars().take(300).collect::<String>()));
    w.kept("vllm", 60).await;
    assert!(!run.has_event(&ns_w, "vllm", "EvictingForGpuMemory").await, "an EvictingForGpuMemory on the lone pod");
    assert_eq!(told().await, 1, "GpuMemoryFullNoneHarmed told in one episode");
    assert_eq!(pressure().await.as_deref(), Some("1"), "the GPU should still be under pressure (2.6 GiB free)");
    summary.push(
        "e: a pod alone at 77 of 79.6 GiB (no budget, unbudgetedPods=Ranked): not evicted in 60 s under pressure; \
         GpuMemoryFullNoneHarmed once"
            .to_owned(),
    );
    w.gone("vllm").await;
    w.sample(&[]);
    run.until("the pressure ended", || async { pressure().await.as_deref() == Some("0") }).await;

    run.say(
        "f. a Warn grower (limit 10Gi, request 1Gi) at 50 GiB beside serve within its 30Gi (request 30Gi) at 28 GiB",
    );
    w.budget("warn", json!({"limit": "10Gi", "request": "1Gi", "action": "Warn", "overLimitSeconds": 3600}))
        .await
        .expect("budget");
    w.budget("serve", json!({"limit": "30Gi", "request": "30Gi"})).await.expect("budget");
    w.pod("warn").await;
    w.pod("serve").await;
    w.sample(&[("warn", GI), ("serve", 28 * GI)]);
    run.pod_until(&ns_w, "warn", "warn recorded", |p| annotation(p, "state").is_some()).await;
    let pressed = Instant::now();
    w.sample(&[("warn", 50 * GI), ("serve", 28 * GI)]);
    run.terminating(&ns_w, "warn").await;
    let after = pressed.elapsed().as_secs_f64();
    assert!(!run.is_terminating(&ns_w, "serve").await, "serve was evicted");
    let note = run.notes(&ns_w, "warn", "EvictingForGpuMemory").await.remove(0);
    run.info(&format!("EvictingForGpuMemory {after:.1}s after 1.6 GiB free: {note}"));
    assert!(
        note.contains("its budget's action is Warn, which does not keep memory a neighbour is guaranteed"),
        "the event does not say why Warn did not keep it: {note}"
    );
    summary.push(format!(
        "f: the Warn grower evicted {after:.1}s after the card had 1.6 GiB free; serve (within its 30Gi request) kept"
    ));
    w.gone("warn").await;
    w.sample(&[("serve", 28 * GI)]);
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert!(!run.is_terminating(&ns_w, "serve").await, "serve was evicted after the Warn pod went");
    w.gone("serve").await;
    w.sample(&[]);
    run.until("the pressure ended", || async { pressure().await.as_deref() == Some("0") }).await;

    run.say("g. hog (budget 40Gi, overLimitSeconds 3600, PodDisruptionBudget) at 70 GiB; nb (budget 20Gi) flapping 12 s at 8 GiB, 14 s at nothing");
    w.budget("hog", json!({"limit": "40Gi", "overLimitSeconds": 3600})).await.expect("budget");
    w.budget("nb", json!({"limit": "20Gi"})).await.expect("budget");
    w.pod_behind_pdb("hog").await;
    w.pod("nb").await;
    w.sample(&[("hog", 70 * GI)]);
    run.record_is(&ns_w, "hog", "state", "Over").await;
    let pressed = Instant::now();
    // Polls every 0.5 s, `n` times, whether hog is being deleted; when it is, how long after the first episode.
    let watch = |n: u32| {
        let (run, ns_w) = (&run, &ns_w);
        async move {
            for _ in 0..n {
                if run.is_terminating(ns_w, "hog").await {
                    return Some(pressed.elapsed().as_secs_f64());
                }
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
            None
        }
    };
    let mut deleted = None;
    let mut cycle = 0;
    while deleted.is_none() && cycle < 4 {
        cycle += 1;
        w.sample(&[("hog", 70 * GI), ("nb", 8 * GI)]);
        deleted = watch(24).await;
        if deleted.is_none() {
            w.sample(&[("hog", 70 * GI)]);
            deleted = watch(28).await;
        }
    }
    let deleted = deleted.unwrap_or_else(|| {
        panic!("hog not deleted in 4 episodes of 12 s of pressure (the bound is {BOUND} s of pressure in all)")
    });
    run.info(&format!(
        "hog terminating {deleted:.1}s after the first episode began (cycle {cycle}; 12 s of pressure, 14 s without, per cycle)"
    ));
    let blocked = run.occurrences(&ns_w, "hog", "GpuMemoryEvictionBlocked").await;
    let note = run.notes(&ns_w, "hog", "DeletingForGpuMemory").await.remove(0);
    run.info(&format!("GpuMemoryEvictionBlocked: {blocked}; DeletingForGpuMemory: {note}"));
    assert!(
        note.contains(&format!("for {BOUND}s in all")) || note.contains(&format!("for {}s in all", BOUND + 1)),
        "the deletion does not count the pressure in all: {note}"
    );
    let grace = run.pod(&ns_w, "hog").await.metadata.deletion_grace_period_seconds;
    assert_eq!(grace, Some(5), "hog's grace, the pressure grace 5");
    assert!(!run.is_terminating(&ns_w, "nb").await, "nb was evicted");
    summary.push(format!(
        "g: hog deleted {deleted:.1}s after the first episode began, in cycle {cycle} (12 s pressure + 14 s none per \
         cycle), after {blocked} refused evictions; nb kept"
    ));

    run.say(&format!(
        "summary (real kube-apiserver, replayed GPU, the agent's defaults, --pressure-blocked-timeout {BOUND}s)"
    ));
    for line in &summary {
        run.info(line);
    }
    run.say(&format!(
        "PASS: relief never where nobody is harmed, Warn no exemption, the bound counted over every episode ({} s)",
        run.elapsed()
    ));
}
