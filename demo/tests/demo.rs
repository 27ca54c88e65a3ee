//! The demo's story, run the way `cargo run -p gpubudget-demo -- --until-evicted` runs it but in process:
//! what it prints is what the README shows, and these are the promises it makes.

use gpubudget_demo::scenario::{self, Until};
use gpubudget_demo::stack::{Stack, kubelet_like_api};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_demo_shows_near_over_and_one_eviction_and_warn_never_evicts() {
    let stack = Stack::new(kubelet_like_api());
    let (outcome, stack) = scenario::run(stack, Until::Evicted, |_| {}).await;
    let fake = stack.stop().await;
    let text = &outcome.transcript;
    assert!(outcome.evicted, "the eviction was never counted:\n{text}");
    for (pod, reason) in [
        ("llm-0", "GpuMemoryNearBudget"),
        ("llm-0", "GpuMemoryOverBudget"),
        ("llm-0", "EvictingForGpuMemory"),
        ("finetune-0", "GpuMemoryOverBudget"),
        ("llm-b-0", "GpuMemoryNearBudget"),
    ] {
        assert!(
            text.lines().any(|l| l.contains(reason) && l.contains(&format!("pod/{pod} "))),
            "no {reason} line for {pod}:\n{text}"
        );
    }
    assert!(text.contains("Overlapping"), "the overlap is shown:\n{text}");
    assert!(
        !text.lines().any(|l| l.contains("EvictingForGpuMemory") && l.contains("finetune-0")),
        "a Warn budget evicted:\n{text}"
    );
    let evictions = fake.evictions();
    assert_eq!(evictions.len(), 1, "{evictions:#?}");
    assert_eq!(evictions[0]["metadata"]["name"], "llm-0");
    assert!(
        text.lines().any(|l| l.starts_with("team-a") && l.contains("llm-inference") && l.trim_end().ends_with('1')),
        "the table shows EVICTED 1:\n{text}"
    );
}
