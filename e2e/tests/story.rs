//! The user's story, in memory: the operator and the agent run in this process against gpubudget-testkit's
//! in-memory API (a fake, not a cluster). GPU usage comes from a recorded-format sample file with real PIDs,
//! attributed through a fixture `/proc` tree laid out like a kubelet's cgroups. The budgets are the ones in
//! `examples/`. Run with `--nocapture` to see the events and the `kubectl get gmb` view it produces.

use std::time::Duration;

use gpubudget_common::crd::GpuMemoryBudgetStatus;
use gpubudget_common::quantity::HumanBytes;
use gpubudget_common::{GpuMemoryBudget, pod_record};
use gpubudget_demo::scenario::budgets_table;
use gpubudget_demo::stack::{CONTEXT, GI, MI, NODE, Stack, kubelet_like_api, put_example, put_pod};
use gpubudget_testkit::{EventSummary, pass_time};
use serde_json::{Value, json};
use tokio::time::Instant;

/// Assertions over the stack, as the stories read them.
trait See {
    fn events(&self, namespace: &str, pod: &str) -> Vec<EventSummary>;
    async fn event(&self, namespace: &str, pod: &str, reason: &str, within: Duration) -> EventSummary;
    fn status(&self, namespace: &str, name: &str) -> GpuMemoryBudgetStatus;
    async fn status_until(
        &self,
        namespace: &str,
        name: &str,
        what: &str,
        check: impl Fn(&GpuMemoryBudgetStatus) -> bool,
    ) -> GpuMemoryBudgetStatus;
    fn annotations(&self, namespace: &str, pod: &str) -> Value;
    async fn annotations_until(&self, namespace: &str, pod: &str, what: &str, check: impl Fn(&Value) -> bool) -> Value;
    fn transcript(&self, namespace: &str, pods: &[&str]) -> String;
    async fn started(self) -> Self;
}

impl See for Stack {
    fn events(&self, namespace: &str, pod: &str) -> Vec<EventSummary> {
        self.fake.events_for(namespace, pod)
    }

    async fn event(&self, namespace: &str, pod: &str, reason: &str, within: Duration) -> EventSummary {
        let found =
            self.fake.wait_until(within, |f| f.events_for(namespace, pod).iter().any(|e| e.reason == reason)).await;
        assert!(
            found,
            "no {reason} event on {namespace}/{pod} within {within:?}: {:#?}\npod: {:#}",
            self.events(namespace, pod),
            self.fake.get("pods", namespace, pod).unwrap_or_default()
        );
        self.events(namespace, pod).into_iter().find(|e| e.reason == reason).expect("found")
    }

    fn status(&self, namespace: &str, name: &str) -> GpuMemoryBudgetStatus {
        self.fake.typed::<GpuMemoryBudget>(namespace, name).and_then(|b| b.status).unwrap_or_default()
    }

    async fn status_until(
        &self,
        namespace: &str,
        name: &str,
        what: &str,
        check: impl Fn(&GpuMemoryBudgetStatus) -> bool,
    ) -> GpuMemoryBudgetStatus {
        let ok = self
            .fake
            .wait_until(Duration::from_secs(10), |f| {
                check(&f.typed::<GpuMemoryBudget>(namespace, name).and_then(|b| b.status).unwrap_or_default())
            })
            .await;
        let status = self.status(namespace, name);
        assert!(ok, "{namespace}/{name}: {what} never held: {status:#?}");
        status
    }

    fn annotations(&self, namespace: &str, pod: &str) -> Value {
        self.fake.get("pods", namespace, pod).map(|p| p["metadata"]["annotations"].clone()).unwrap_or_default()
    }

    /// The record is written on its own schedule: an event about a state can land before the record of
    /// it, so a test waits for the record itself.
    async fn annotations_until(&self, namespace: &str, pod: &str, what: &str, check: impl Fn(&Value) -> bool) -> Value {
        let ok = self
            .fake
            .wait_until(Duration::from_secs(10), |f| {
                check(&f.get("pods", namespace, pod).map(|p| p["metadata"]["annotations"].clone()).unwrap_or_default())
            })
            .await;
        let annotations = self.annotations(namespace, pod);
        assert!(ok, "{namespace}/{pod}: {what} never held: {annotations:#}");
        annotations
    }

    /// `kubectl get gmb -n <namespace>` and the pod events, as a person would see them.
    fn transcript(&self, namespace: &str, pods: &[&str]) -> String {
        let mut out = format!("$ kubectl get gmb -n {namespace}\n{}", budgets_table(&self.fake));
        out += &format!("\n$ kubectl get events -n {namespace} --field-selector involvedObject.kind=Pod\n");
        for pod in pods {
            for e in self.events(namespace, pod) {
                out += &format!("{:<8} {:<26} pod/{pod}  {}\n", e.type_, e.reason, e.message);
            }
        }
        out
    }

    /// The operator and the agent (at its default 250 ms: the stories run at the agent's real speed), ready.
    async fn started(mut self) -> Self {
        self.start_operator();
        self.start_agent(Duration::from_millis(250));
        assert!(self.ready(Duration::from_secs(10)).await, "not ready: {}", self.readiness());
        self
    }
}

const LLM_CID: &str = "1f2e3d4c5b6a79881f2e3d4c5b6a79881f2e3d4c5b6a79881f2e3d4c5b6a7988";

#[tokio::test(start_paused = true)]
async fn evict_story_a_pod_climbs_past_its_budget_and_is_evicted_once() {
    let stack = Stack::new(kubelet_like_api());
    let fake = &stack.fake;
    put_example(fake, "llm-inference.yaml", "team-a", |_| {});
    let uid = put_pod(fake, "team-a", "llm-0", json!({"app": "llm"}), LLM_CID);
    // Two processes in the pod's container: the server and a tokenizer worker holding only its CUDA context.
    stack.process(4242, &uid, LLM_CID);
    stack.process(4243, &uid, LLM_CID);
    stack.set_usage(&[(4242, 6 * GI - CONTEXT), (4243, CONTEXT)]);
    let stack = stack.started().await;

    // 6Gi of 8Gi: within; the agent records it and the operator counts the pod.
    let status = stack.status_until("team-a", "llm-inference", "MATCHED 1", |s| s.matched_pods == 1).await;
    assert_eq!((status.pods_near_budget, status.pods_over_budget, status.evictions), (0, 0, 0));
    assert!(
        stack.events("team-a", "llm-0").is_empty(),
        "no event while within: {:#?}",
        stack.events("team-a", "llm-0")
    );

    // 7.5Gi: at least 90 % of 8Gi.
    stack.set_usage(&[(4242, 7 * GI), (4243, CONTEXT)]);
    let near = stack.event("team-a", "llm-0", "GpuMemoryNearBudget", Duration::from_secs(3)).await;
    assert_eq!(near.type_, "Warning");
    assert!(near.message.contains("of 8Gi (budget team-a/llm-inference)"), "{}", near.message);
    assert_eq!((near.reporting_controller.as_str(), near.reporting_instance.as_str()), ("gpubudget-agent", NODE));

    // 9Gi: over. The eviction must wait out overLimitSeconds (10 s) of continuous overage.
    stack.set_usage(&[(4242, 9 * GI - CONTEXT), (4243, CONTEXT)]);
    let over = stack.event("team-a", "llm-0", "GpuMemoryOverBudget", Duration::from_secs(3)).await;
    let over_seen = Instant::now();
    assert!(over.message.contains("using 9Gi of 8Gi (budget team-a/llm-inference)"), "{}", over.message);
    assert!(over.message.contains("pid 4242") && over.message.contains("8.5Gi"), "names the holders: {}", over.message);
    let status = stack.status_until("team-a", "llm-inference", "OVER 1", |s| s.pods_over_budget == 1).await;
    assert_eq!(status.top_pods.first().map(|p| p.usage.as_str()), Some("9Gi"));
    assert!(stack.fake.evictions().is_empty(), "no eviction before overLimitSeconds");

    let evicting = stack.event("team-a", "llm-0", "EvictingForGpuMemory", Duration::from_secs(15)).await;
    let waited = over_seen.elapsed();
    assert!(waited >= Duration::from_millis(9_000), "evicted after only {waited:?} over the limit");
    assert!(evicting.message.contains("using 9Gi of 8Gi (budget team-a/llm-inference) for 1"), "{}", evicting.message);
    assert!(evicting.message.contains("evicting with 30s grace"), "{}", evicting.message);

    // Exactly one eviction request, carrying the budget's grace period; the pod is recorded as evicting.
    pass_time(Duration::from_secs(1)).await;
    let evictions = stack.fake.evictions();
    assert_eq!(evictions.len(), 1, "{evictions:#?}");
    assert_eq!(evictions[0]["apiVersion"], "policy/v1");
    assert_eq!(evictions[0]["metadata"]["name"], "llm-0");
    assert_eq!(evictions[0]["deleteOptions"]["gracePeriodSeconds"], 30);
    let annotations = stack.annotations("team-a", "llm-0");
    assert_eq!(annotations[pod_record::STATE], "Evicting");
    assert_eq!(annotations[pod_record::BUDGET], "llm-inference");
    assert!(annotations[pod_record::EVICTION_REQUESTED_AT].is_string(), "{annotations}");
    let pod = stack.fake.get("pods", "team-a", "llm-0").expect("terminating, not gone");
    assert!(pod["metadata"]["deletionTimestamp"].is_string(), "the eviction started the pod's termination");

    // The budget's status: MATCHED 1, OVER 1, EVICTED 1.
    let status = stack.status_until("team-a", "llm-inference", "EVICTED 1", |s| s.evictions == 1).await;
    assert_eq!((status.matched_pods, status.pods_over_budget, status.evictions), (1, 1, 1));
    assert_eq!(status.last_eviction.as_ref().map(|e| e.pod.as_str()), Some("llm-0"));
    println!("{}", stack.transcript("team-a", &["llm-0"]));
    let fake = stack.stop().await;
    assert_eq!(fake.evictions().len(), 1);
}

#[tokio::test(start_paused = true)]
async fn warn_story_events_and_status_but_never_an_eviction() {
    let stack = Stack::new(kubelet_like_api());
    let fake = &stack.fake;
    // The example waits 30 s before its (audit-only) action; 1 s keeps the test short and still proves it.
    put_example(fake, "training-warn.yaml", "team-a", |b| b["spec"]["overLimitSeconds"] = 1.into());
    let cid = "2a".repeat(32);
    let uid = put_pod(fake, "team-a", "finetune-0", json!({"job-type": "finetune"}), &cid);
    stack.process(5150, &uid, &cid);
    stack.set_usage(&[(5150, 20 * GI)]);
    let stack = stack.started().await;
    stack.status_until("team-a", "training-audit", "MATCHED 1", |s| s.matched_pods == 1).await;

    stack.set_usage(&[(5150, 33 * GI)]); // 80 % of 40Gi is 32Gi
    let near = stack.event("team-a", "finetune-0", "GpuMemoryNearBudget", Duration::from_secs(3)).await;
    assert!(near.message.contains("of 40Gi (budget team-a/training-audit)"), "{}", near.message);
    stack.set_usage(&[(5150, 41 * GI)]);
    let over = stack.event("team-a", "finetune-0", "GpuMemoryOverBudget", Duration::from_secs(3)).await;
    assert!(over.message.contains("using 41Gi of 40Gi"), "{}", over.message);

    // Well past overLimitSeconds: still no eviction, and nothing says one is coming.
    pass_time(Duration::from_secs(3)).await;
    assert!(stack.fake.evictions().is_empty());
    let reasons: Vec<String> = stack.events("team-a", "finetune-0").into_iter().map(|e| e.reason).collect();
    assert!(!reasons.iter().any(|r| r == "EvictingForGpuMemory"), "{reasons:?}");
    // The Over record follows the Near one 5 s after it at the soonest (a move is spaced per pod).
    stack.annotations_until("team-a", "finetune-0", "state Over", |a| a[pod_record::STATE] == "Over").await;
    let status = stack.status_until("team-a", "training-audit", "OVER 1", |s| s.pods_over_budget == 1).await;
    assert_eq!((status.matched_pods, status.evictions), (1, 0));
    println!("{}", stack.transcript("team-a", &["finetune-0"]));
    stack.stop().await;
}

#[tokio::test(start_paused = true)]
async fn overlapping_story_the_smallest_budget_applies_and_both_say_so() {
    let stack = Stack::new(kubelet_like_api());
    let fake = &stack.fake;
    put_example(fake, "namespace-wide.yaml", "team-b", |_| {});
    put_example(fake, "llm-inference.yaml", "team-b", |_| {});
    let cid = "3b".repeat(32);
    let uid = put_pod(fake, "team-b", "llm-b-0", json!({"app": "llm"}), &cid);
    stack.process(6001, &uid, &cid);
    // 7.5Gi: near the 8Gi budget, far under the namespace's 20Gi.
    stack.set_usage(&[(6001, 7 * GI + 512 * MI)]);
    let stack = stack.started().await;

    let near = stack.event("team-b", "llm-b-0", "GpuMemoryNearBudget", Duration::from_secs(5)).await;
    assert!(
        near.message.contains(&format!("using {} of 8Gi (budget team-b/llm-inference)", HumanBytes(7 * GI + 512 * MI))),
        "{}",
        near.message
    );
    let record =
        stack.annotations_until("team-b", "llm-b-0", "a Near record", |a| a[pod_record::STATE] == "Near").await;
    assert_eq!(record[pod_record::BUDGET], "llm-inference");

    let overlapping = |s: &GpuMemoryBudgetStatus| {
        s.conditions.iter().find(|c| c.type_ == "Overlapping").map(|c| (c.status.clone(), c.message.clone()))
    };
    // The status catches up with the agent's record in its own time: wait for both.
    let small = stack
        .status_until("team-b", "llm-inference", "Overlapping, MATCHED 1, NEAR 1", |s| {
            overlapping(s).is_some_and(|(st, _)| st == "True") && s.matched_pods == 1 && s.pods_near_budget == 1
        })
        .await;
    let wide = stack
        .status_until("team-b", "team-b-default", "Overlapping", |s| overlapping(s).is_some_and(|(st, _)| st == "True"))
        .await;
    assert!(overlapping(&small).is_some_and(|(_, m)| m.contains("team-b-default")), "{small:#?}");
    assert!(overlapping(&wide).is_some_and(|(_, m)| m.contains("llm-inference")), "{wide:#?}");
    assert_eq!((small.matched_pods, small.pods_near_budget), (1, 1), "the smaller budget applies");
    assert_eq!(wide.matched_pods, 0, "the wider budget does not count a pod another budget governs");
    println!("{}", stack.transcript("team-b", &["llm-b-0"]));
    stack.stop().await;
}

#[tokio::test(start_paused = true)]
async fn pressure_story_the_gpu_fills_and_the_pod_most_over_its_budget_goes_at_once() {
    let stack = Stack::new(kubelet_like_api());
    let fake = &stack.fake;
    // The budget's own timer would wait 10 minutes: only pressure can act within the test.
    put_example(fake, "llm-inference.yaml", "team-a", |b| b["spec"]["overLimitSeconds"] = 600.into());
    put_example(fake, "training-warn.yaml", "team-a", |b| b["spec"]["limit"] = "60Gi".into());
    let grower = put_pod(fake, "team-a", "llm-0", json!({"app": "llm"}), LLM_CID);
    let cid = "2a".repeat(32);
    let neighbour = put_pod(fake, "team-a", "finetune-0", json!({"job-type": "finetune"}), &cid);
    stack.process(4242, &grower, LLM_CID);
    stack.process(5150, &neighbour, &cid);
    // 20Gi (over its 8Gi budget) and 30Gi (within 60Gi): 50Gi of the H100's 79.6Gi used, no pressure.
    stack.set_usage_and_device(&[(4242, 20 * GI), (5150, 30 * GI)], 50 * GI);
    let stack = stack.started().await;
    let fake = &stack.fake;
    stack.event("team-a", "llm-0", "GpuMemoryOverBudget", Duration::from_secs(5)).await;

    // The grower climbs to 47Gi: 77Gi used, under the default hard threshold (5 %, about 4Gi free).
    stack.set_usage_and_device(&[(4242, 47 * GI), (5150, 30 * GI)], 77 * GI);
    let evicting = stack.event("team-a", "llm-0", "EvictingForGpuMemory", Duration::from_secs(5)).await;
    assert!(evicting.message.contains("under memory pressure"), "{}", evicting.message);
    assert!(evicting.message.contains("most over its budget"), "{}", evicting.message);
    let node: Vec<Value> = fake
        .list("events.events.k8s.io", None)
        .into_iter()
        .filter(|e| e["regarding"]["kind"] == "Node" && e["regarding"]["name"] == NODE)
        .collect();
    assert!(
        node.iter().any(|e| e["reason"] == "GpuMemoryPressure" && e["type"] == "Warning"),
        "an event on the Node: {node:#?}"
    );
    assert!(fake.wait_until(Duration::from_secs(5), |f| f.evictions().len() == 1).await);
    let evictions = fake.evictions();
    assert_eq!(evictions[0]["metadata"]["name"], "llm-0");
    assert_eq!(evictions[0]["deleteOptions"]["gracePeriodSeconds"], 5, "the pressure grace, not the pod's 60 s");
    // The neighbour within its budget is protected, not evicted; the budget counts the eviction.
    let status = stack.status_until("team-a", "llm-inference", "EVICTED 1", |s| s.evictions == 1).await;
    assert_eq!(status.last_eviction.map(|e| e.pod), Some("llm-0".to_owned()));
    assert_eq!(fake.evictions().len(), 1);
    assert!(fake.get("pods", "team-a", "finetune-0").is_some_and(|p| p["metadata"]["deletionTimestamp"].is_null()));
    stack.stop().await;
}

/// Issue 23: a namespace nobody gave a budget fills the GPU beside a budgeted pod within its budget. Under the
/// default node policy (`unbudgetedPods: Ranked`) the pod no budget selects is guaranteed nothing: it is the one
/// evicted for pressure, through the eviction API with the pressure grace, with an event that says why, and
/// without any record written on it; the budgeted neighbour stays.
#[tokio::test(start_paused = true)]
async fn unbudgeted_story_a_namespace_without_a_budget_fills_the_gpu_and_goes_before_the_budgeted_neighbour() {
    let stack = Stack::new(kubelet_like_api());
    let fake = &stack.fake;
    put_example(fake, "llm-inference.yaml", "team-a", |b| b["spec"]["limit"] = "40Gi".into());
    let neighbour = put_pod(fake, "team-a", "llm-0", json!({"app": "llm"}), LLM_CID);
    let cid = "3b".repeat(32);
    // The namespace `scratch` has no budget.
    let filler = put_pod(fake, "scratch", "filler-0", json!({"app": "filler"}), &cid);
    stack.process(4242, &neighbour, LLM_CID);
    stack.process(6161, &filler, &cid);
    // 30Gi within its 40Gi budget, and 20Gi no budget covers: 50Gi of the H100's 79.6Gi, no pressure.
    stack.set_usage_and_device(&[(4242, 30 * GI), (6161, 20 * GI)], 50 * GI);
    let stack = stack.started().await;
    let fake = &stack.fake;
    assert!(
        fake.wait_until(Duration::from_secs(5), |_| stack
            .agent_metrics()
            .contains("gpubudget_unbudgeted_bytes{gpu=\"0\"} 21474836480"))
            .await,
        "{}",
        stack.agent_metrics()
    );

    // The filler climbs to 47Gi: 77Gi used, under the default hard threshold (5 %, about 4Gi free).
    stack.set_usage_and_device(&[(4242, 30 * GI), (6161, 47 * GI)], 77 * GI);
    let evicting = stack.event("scratch", "filler-0", "EvictingForGpuMemory", Duration::from_secs(5)).await;
    assert!(
        evicting.message.starts_with("no budget selects this pod; node policy unbudgetedPods=Ranked"),
        "{}",
        evicting.message
    );
    assert!(fake.wait_until(Duration::from_secs(5), |f| f.evictions().len() == 1).await);
    let evictions = fake.evictions();
    assert_eq!(
        (&evictions[0]["metadata"]["namespace"], &evictions[0]["metadata"]["name"]),
        (&json!("scratch"), &json!("filler-0"))
    );
    assert_eq!(evictions[0]["deleteOptions"]["gracePeriodSeconds"], 5, "the pressure grace");
    // No record on a pod no budget selects; the neighbour within its budget is not evicted.
    assert!(
        stack
            .annotations("scratch", "filler-0")
            .as_object()
            .is_none_or(|a| a.keys().all(|k| !k.starts_with("gpubudget.io/")))
    );
    assert_eq!(fake.evictions().len(), 1);
    assert!(fake.get("pods", "team-a", "llm-0").is_some_and(|p| p["metadata"]["deletionTimestamp"].is_null()));
    stack.stop().await;
}

#[tokio::test(start_paused = true)]
async fn gpu_failure_story_a_lost_gpu_is_told_on_the_node_and_nothing_is_decided_from_it() {
    let stack = Stack::new(kubelet_like_api());
    let fake = &stack.fake;
    put_example(fake, "llm-inference.yaml", "team-a", |b| b["spec"]["overLimitSeconds"] = 1.into());
    let llm = put_pod(fake, "team-a", "llm-0", json!({"app": "llm"}), LLM_CID);
    let cid = "2a".repeat(32);
    let neighbour = put_pod(fake, "team-a", "finetune-0", json!({"job-type": "finetune"}), &cid);
    stack.process(4242, &llm, LLM_CID);
    stack.process(5150, &neighbour, &cid);
    // llm-0 holds 20Gi (over its 8Gi budget) on GPU 1, which has fallen off the bus.
    let on_1: &[(u32, u64)] = &[(4242, 20 * GI)];
    stack.set_gpus(&[(&[(5150, 2 * GI)], None), (on_1, Some("GPU is lost"))]);
    let stack = stack.started().await;
    let fake = &stack.fake;
    let on_node = |reason: &str| -> Vec<Value> {
        fake.list("events.events.k8s.io", None)
            .into_iter()
            .filter(|e| e["regarding"]["kind"] == "Node" && e["regarding"]["name"] == NODE && e["reason"] == reason)
            .collect()
    };
    assert!(fake.wait_until(Duration::from_secs(5), |_| !on_node("GpuSampleFailed").is_empty()).await);
    let failed = &on_node("GpuSampleFailed")[0];
    assert_eq!(failed["type"], "Warning");
    let note = failed["note"].as_str().unwrap_or_default();
    assert!(note.starts_with("GPU 1 (") && note.contains("GPU is lost"), "{note}");
    // The agent stays ready (GPU 0 is enforced), and nothing is decided from GPU 1 for well over the
    // budget's one second.
    stack.annotations_until("team-a", "llm-0", "a Within record", |a| a[pod_record::STATE] == "Within").await;
    assert!(stack.agent_health().is_ready(), "{}", stack.readiness());
    pass_time(Duration::from_secs(3)).await;
    assert!(fake.evictions().is_empty(), "evicted from a failed GPU's figures");
    assert!(stack.events("team-a", "llm-0").iter().all(|e| e.reason != "GpuMemoryOverBudget"));
    assert_eq!(on_node("GpuSampleFailed").len(), 1, "told once");

    // GPU 1 is back: told, and llm-0's 20Gi count again: over, evicted.
    stack.set_gpus(&[(&[(5150, 2 * GI)], None), (on_1, None)]);
    assert!(fake.wait_until(Duration::from_secs(5), |_| !on_node("GpuSampleRecovered").is_empty()).await);
    stack.event("team-a", "llm-0", "EvictingForGpuMemory", Duration::from_secs(10)).await;
    assert!(fake.wait_until(Duration::from_secs(5), |f| f.evictions().len() == 1).await);
    stack.stop().await;
}

#[tokio::test(start_paused = true)]
async fn a_pod_created_over_a_zero_period_budget_is_evicted_and_a_refusal_is_told() {
    let stack = Stack::new(kubelet_like_api());
    let stack = stack.started().await;
    let fake = &stack.fake;
    // As on the real API server tier: the pod exists first under a namespace-wide budget, then a smaller one
    // comes, then the usage.
    put_example(fake, "namespace-wide.yaml", "team-a", |_| {});
    let uid = put_pod(fake, "team-a", "held", json!({"app": "llm"}), LLM_CID);
    stack.process(4107, &uid, LLM_CID);
    stack.annotations_until("team-a", "held", "a Within record", |a| a[pod_record::STATE] == "Within").await;
    put_example(fake, "llm-inference.yaml", "team-a", |b| {
        b["spec"]["limit"] = "1Gi".into();
        b["spec"]["overLimitSeconds"] = 0.into();
        b["spec"]["evictionGracePeriodSeconds"] = 5.into();
        b["spec"]["blockedEvictionTimeoutSeconds"] = 5.into();
    });
    fake.block_all_evictions();
    stack.annotations_until("team-a", "held", "the smaller budget", |a| a[pod_record::BUDGET] == "llm-inference").await;
    stack.set_usage(&[(4107, 2 * GI)]);
    stack.event("team-a", "held", "EvictingForGpuMemory", Duration::from_secs(5)).await;
    stack.event("team-a", "held", "GpuMemoryEvictionBlocked", Duration::from_secs(5)).await;
    stack.event("team-a", "held", "DeletingForGpuMemory", Duration::from_secs(10)).await;
    stack.stop().await;
}

/// #34: usage moving within a state rewrites the node's `GpuNodeUsage` (at most once per 30 s), never the pod;
/// the budget's status follows the node's object.
#[tokio::test(start_paused = true)]
async fn usage_moving_within_a_state_writes_the_nodes_usage_object_not_the_pod() {
    use gpubudget_testkit::Verb;
    let stack = Stack::new(kubelet_like_api());
    let fake = &stack.fake;
    put_example(fake, "llm-inference.yaml", "team-a", |_| {});
    let uid = put_pod(fake, "team-a", "llm-0", json!({"app": "llm"}), LLM_CID);
    stack.process(4242, &uid, LLM_CID);
    stack.set_usage(&[(4242, 2 * GI)]);
    let stack = stack.started().await;
    let status = stack.status_until("team-a", "llm-inference", "topPods at 2Gi", |s| {
        s.top_pods.first().is_some_and(|p| p.usage == "2Gi")
    });
    status.await;
    let (pod_writes, usage_writes) =
        (stack.fake.count(Verb::Patch, "pods"), stack.fake.count(Verb::Patch, "gpunodeusages"));
    // Five minutes of usage moving between 2 and 6 GiB (all Within 8Gi at 90 %) every 10 s.
    let start = Instant::now();
    for step in 0..30u64 {
        stack.set_usage(&[(4242, (2 + step % 5) * GI)]);
        pass_time(Duration::from_secs(10)).await;
    }
    let elapsed = start.elapsed().as_secs();
    assert_eq!(stack.fake.count(Verb::Patch, "pods"), pod_writes, "no pod write for usage alone");
    let written = stack.fake.count(Verb::Patch, "gpunodeusages") - usage_writes;
    assert!((1..=(elapsed / 30 + 1) as usize).contains(&written), "{written} usage writes in {elapsed} s");
    stack.set_usage(&[(4242, 6 * GI)]);
    stack
        .status_until("team-a", "llm-inference", "topPods at 6Gi", |s| {
            s.top_pods.first().is_some_and(|p| p.usage == "6Gi")
        })
        .await;
    let object = stack.fake.get("gpunodeusages", "", NODE).expect("the node's usage object");
    assert_eq!(object["spec"]["pods"][0]["usageBytes"], json!(6 * GI));
    assert_eq!(stack.annotations("team-a", "llm-0")["gpubudget.io/state"], "Within");
}

/// #34: once the operator has mirrored every budget, the agent reads the mirrors only: its budget watch is
/// closed (the operator's status writes reach it no more), an edit reaches it through the mirror, and a
/// deleted budget's mirror goes with it.
#[tokio::test(start_paused = true)]
async fn mirrored_budgets_spare_the_agent_every_status_write_and_still_carry_every_edit() {
    let stack = Stack::new(kubelet_like_api());
    let fake = &stack.fake;
    put_example(fake, "llm-inference.yaml", "team-a", |_| {});
    let uid = put_pod(fake, "team-a", "llm-0", json!({"app": "llm"}), LLM_CID);
    stack.process(4242, &uid, LLM_CID);
    stack.set_usage(&[(4242, 3 * GI)]);
    let stack = stack.started().await;
    let fake = &stack.fake;
    wait_for_mirrors(&stack, true).await;

    let budget = fake.get("gpumemorybudgets", "team-a", "llm-inference").expect("budget");
    let mirror = fake.get("gpumemorybudgetmirrors", "team-a", "llm-inference").expect("the budget's mirror");
    assert_eq!(mirror["spec"]["budget"], budget["spec"]);
    assert_eq!(mirror["metadata"]["annotations"]["gpubudget.io/budget-generation"], json!("1"));
    assert_eq!(mirror["metadata"]["ownerReferences"][0]["uid"], budget["metadata"]["uid"]);
    // Only the operator's own (full) budget watch is left: no agent receives a status write.
    assert_eq!(fake.open_watches_on("gpumemorybudgets"), [false], "the agent's metadata watch is closed");

    // Usage moves: the operator writes statuses; the mirror is not rewritten.
    let mirror_rv = mirror["metadata"]["resourceVersion"].clone();
    stack.set_usage(&[(4242, 5 * GI)]);
    // Usage reaches the status through the node's GpuNodeUsage, written at most every 30 s.
    pass_time(Duration::from_secs(31)).await;
    stack
        .status_until("team-a", "llm-inference", "topPods at 5Gi", |s| {
            s.top_pods.first().is_some_and(|p| p.usage == "5Gi")
        })
        .await;
    let mirror = fake.get("gpumemorybudgetmirrors", "team-a", "llm-inference").expect("mirror");
    assert_eq!(mirror["metadata"]["resourceVersion"], mirror_rv, "a status write does not touch the mirror");

    // An edit reaches the agent through the mirror: 4Gi puts the 5 GiB pod over.
    fake.modify("gpumemorybudgets", "team-a", "llm-inference", |b| b["spec"]["limit"] = json!("4Gi"));
    let over = stack.event("team-a", "llm-0", "GpuMemoryOverBudget", Duration::from_secs(10)).await;
    assert!(over.message.contains("4Gi"), "{}", over.message);
    let mirror = fake.get("gpumemorybudgetmirrors", "team-a", "llm-inference").expect("mirror");
    assert_eq!(mirror["spec"]["budget"]["limit"], json!("4Gi"));
    assert_eq!(mirror["metadata"]["annotations"]["gpubudget.io/budget-generation"], json!("2"));

    // Deleted: its mirror goes, and the agent forgets the budget (the pod's record is cleared).
    assert!(fake.delete_object("gpumemorybudgets", "team-a", "llm-inference"));
    let gone = fake
        .wait_until(Duration::from_secs(10), |f| f.get("gpumemorybudgetmirrors", "team-a", "llm-inference").is_none())
        .await;
    assert!(gone, "the deleted budget's mirror stayed");
    stack.annotations_until("team-a", "llm-0", "record cleared", |a| a.get("gpubudget.io/budget").is_none()).await;
}

/// Whether the agent reads the namespaced budgets' mirrors alone (`true`) or the budgets (`false`), waited for
/// up to a minute: the operator renews its mirrors Lease every 10 s, and the agent reads the mirrors only once
/// it saw it renewed.
async fn wait_for_mirrors(stack: &Stack, on: bool) -> Duration {
    let metric = format!("gpubudget_budget_specs_from_mirrors{{kind=\"GpuMemoryBudget\"}} {}", u8::from(on));
    let mut waited = Duration::ZERO;
    while !stack.agent_metrics().contains(&metric) && waited < Duration::from_secs(60) {
        pass_time(Duration::from_millis(250)).await;
        waited += Duration::from_millis(250);
    }
    assert!(stack.agent_metrics().contains(&metric), "never {metric}:\n{}", stack.agent_metrics());
    waited
}

/// Mirrors that cannot lose a budget: the agent reads the mirrors; the operator is restarted with mirrors off
/// (`helm upgrade --set operator.budgetMirrors=false`) and every mirror is deleted, as docs/operations.md says;
/// then a budget is created and another tightened. The agent goes back to the budgets within the bound, says
/// so on its Node, and enforces both; nothing it held was forgotten in between.
#[tokio::test(start_paused = true)]
async fn mirrors_switched_off_and_deleted_leave_every_budget_enforced() {
    const OTHER_CID: &str = "2a3b4c5d6e7f80912a3b4c5d6e7f80912a3b4c5d6e7f80912a3b4c5d6e7f8091";
    let stack = Stack::new(kubelet_like_api());
    let fake = &stack.fake;
    put_example(fake, "llm-inference.yaml", "team-a", |_| {});
    let llm = put_pod(fake, "team-a", "llm-0", json!({"app": "llm"}), LLM_CID);
    let other = put_pod(fake, "team-a", "batch-0", json!({"app": "batch"}), OTHER_CID);
    stack.process(4242, &llm, LLM_CID);
    stack.process(4343, &other, OTHER_CID);
    stack.set_usage(&[(4242, 3 * GI), (4343, 10 * GI)]);
    let mut stack = stack.started().await;
    wait_for_mirrors(&stack, true).await;
    assert!(stack.fake.get("leases", "gpubudget", "gpubudget-mirrors").is_some(), "the operator vouches");

    // `helm upgrade --set operator.budgetMirrors=false`: the operator's pod is replaced; the agents are not.
    stack.start_operator_with(false);
    let waited = wait_for_mirrors(&stack, false).await;
    assert!(waited <= Duration::from_secs(30), "back on the budgets after {waited:?}");
    assert!(stack.fake.get("leases", "gpubudget", "gpubudget-mirrors").is_none(), "the Lease was deleted");
    let told: Vec<Value> = stack
        .fake
        .list("events.events.k8s.io", None)
        .into_iter()
        .filter(|e| e["regarding"]["kind"] == "Node" && e["reason"] == "GpuBudgetMirrorsNotCurrent")
        .collect();
    assert_eq!(told.len(), 1, "told once on the Node: {told:#?}");
    let note = told[0]["note"].as_str().unwrap_or_default();
    assert!(note.contains("reading the budgets themselves again") && note.contains("Lease is absent"), "{note}");
    // Every mirror deleted by hand, as docs/operations.md says for turning mirrors off.
    assert!(stack.fake.delete_object("gpumemorybudgetmirrors", "team-a", "llm-inference"));
    // A new budget over the batch pod (10 GiB) and the example tightened under the llm pod (3 GiB).
    stack
        .fake
        .put_object(json!({
            "apiVersion": "gpubudget.io/v1alpha1", "kind": "GpuMemoryBudget",
            "metadata": {"name": "batch", "namespace": "team-a"},
            "spec": {"selector": {"matchLabels": {"app": "batch"}}, "limit": "4Gi", "action": "Warn"}
        }))
        .expect("created");
    stack.fake.modify("gpumemorybudgets", "team-a", "llm-inference", |b| b["spec"]["limit"] = json!("2Gi"));
    let started = Instant::now();
    let over = stack.event("team-a", "batch-0", "GpuMemoryOverBudget", Duration::from_secs(10)).await;
    assert!(over.message.contains("4Gi"), "{}", over.message);
    let over = stack.event("team-a", "llm-0", "GpuMemoryOverBudget", Duration::from_secs(10)).await;
    assert!(over.message.contains("2Gi"), "{}", over.message);
    println!(
        "enforced {:?} after the edits; back on the budgets {waited:?} after the operator restarted",
        started.elapsed()
    );
}
