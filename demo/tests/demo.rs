//! The demo's story, run as `cargo run -p gpubudget-demo -- --until-evicted` runs it (the same function, the
//! in-memory API served on 127.0.0.1): these are the promises it makes, and what it prints is docs/demo.md's
//! sample, but for the port, the kubeconfig's path, the times and the order of events that arrive together.

use gpubudget_demo::scenario::Until;
use gpubudget_demo::session::{self, Options};
use tokio_util::sync::CancellationToken;

const PAGE: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../docs/demo.md");

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_demo_shows_near_over_and_one_eviction_and_warn_never_evicts() {
    let dir = tempfile::tempdir().unwrap();
    let options = Options {
        listen: "127.0.0.1:0".parse().unwrap(),
        kubeconfig: dir.path().join("kubeconfig"),
        until: Until::Evicted,
    };
    let mut printed = String::new();
    let (outcome, fake) = session::session(options, CancellationToken::new(), |line| {
        printed.push_str(line);
        printed.push('\n');
    })
    .await
    .expect("the demo runs");
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

    // docs/demo.md shows what it printed.
    let page = std::fs::read_to_string(PAGE).unwrap();
    let sample = session::sample_of(&page).expect("docs/demo.md has the demo-output markers");
    let expected = session::doc_block(&printed);
    let problems = session::disagreements(&session::comparable(sample), &session::comparable(&expected));
    assert!(
        problems.is_empty(),
        "docs/demo.md's sample is not what the demo prints now; regenerate it with\n  \
         cargo run -q -p gpubudget-demo -- --until-evicted --update-doc docs/demo.md\n{}",
        problems.join("\n\n")
    );
}
