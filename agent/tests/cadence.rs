//! The sampling pace through the whole pipeline (issue 36): the engine asks for the fast interval while a
//! budgeted pod is near or over its budget or a GPU is near its pressure threshold, the relaxed one
//! otherwise, and publishes it as `gpubudget_sample_interval_seconds`. In-process, a synthetic node replayed
//! from a sample file (no GPU, no API server); the pace's own rules are unit-tested in `decide::cadence`.

#[path = "../fixtures/synthetic.rs"]
mod synthetic;

use std::time::Duration;

use gpubudget_agent::attribute::ProcAttributor;
use gpubudget_agent::attribute::pods::{PodTable, PodView};
use gpubudget_agent::decide::Settings;
use gpubudget_agent::decide::cadence::Cadence;
use gpubudget_agent::decide::pressure::Threshold;
use gpubudget_agent::pipeline::Engine;
use gpubudget_agent::report::metrics::Metrics;
use gpubudget_agent::sample::SamplerSlot;
use gpubudget_agent::sample::file::RecordedSampler;
use prometheus_client::registry::Registry;
use synthetic::SyntheticNode;

const RELAXED: Duration = Duration::from_millis(250);
const FAST: Duration = Duration::from_millis(20);

fn interval_metric(registry: &Registry) -> Option<String> {
    let mut out = String::new();
    prometheus_client::encoding::text::encode(&mut out, registry).expect("encodes");
    out.lines().find_map(|l| l.strip_prefix("gpubudget_sample_interval_seconds ").map(str::to_owned))
}

/// An engine replaying `node` (its GPUs with `free` bytes each, where given).
fn start(dir: &std::path::Path, node: &SyntheticNode, settings: Settings, free: Option<u64>) -> (Engine, Registry) {
    node.write_proc(dir).expect("proc");
    let sample = dir.join("sample.json");
    let mut json: serde_json::Value = serde_json::from_str(&node.sample_json()).expect("json");
    for gpu in json["gpus"].as_array_mut().expect("gpus") {
        if let Some(free) = free {
            gpu["memory_used_bytes"] = (gpu["memory_total_bytes"].as_u64().expect("total") - free).into();
        }
    }
    std::fs::write(&sample, json.to_string()).expect("sample");
    let mut registry = Registry::default();
    let engine = Engine::new(
        SamplerSlot::new(RecordedSampler::factory(sample)),
        ProcAttributor::new(dir),
        settings,
        Metrics::new(&mut registry),
    );
    (engine, registry)
}

#[test]
fn pods_near_their_budgets_make_the_agent_sample_fast_until_they_are_not() {
    let dir = tempfile::tempdir().expect("tempdir");
    let node = SyntheticNode::new("n1", 2, 8);
    let mut settings = Settings::new("n1");
    // Held 0 ms (fast only after a tick that saw a sign); no bound from the ticks' cost, which in a debug
    // build on a busy machine is no measure of anything.
    settings.cadence = Cadence { hold_ms: 0, duty: 0, ..Cadence::DEFAULT };
    let (mut engine, registry) = start(dir.path(), &node, settings, None);
    let budgeted = node.table();
    let unbudgeted = PodTable::build(node.pods.iter().filter_map(PodView::from_pod), &[], Some("n1"));

    // No budget: nothing is near anything; the relaxed interval.
    assert!(engine.tick(&unbudgeted, true).sampled);
    assert_eq!(engine.next_sample(), RELAXED);
    assert_eq!(interval_metric(&registry).as_deref(), Some("0.25"));
    // Budgets under which p0 is Over and p1 Near: fast.
    engine.tick(&budgeted, true);
    assert_eq!(engine.next_sample(), FAST);
    assert_eq!(interval_metric(&registry).as_deref(), Some("0.02"));
    // The budgets gone again: relaxed once the hold (0 here) is over.
    engine.tick(&unbudgeted, true);
    assert_eq!(engine.next_sample(), RELAXED);
    // Not enforcing (the caches not synced): nothing is decided, so nothing asks for the fast pace.
    engine.tick(&budgeted, false);
    assert_eq!(engine.next_sample(), RELAXED);
    // A fixed interval (--interval-near off) is never faster.
    let mut settings = Settings::new("n1");
    settings.cadence = Cadence::fixed(250);
    let dir = tempfile::tempdir().expect("tempdir");
    let (mut fixed, _) = start(dir.path(), &node, settings, None);
    fixed.tick(&budgeted, true);
    assert_eq!(fixed.next_sample(), RELAXED);
}

#[test]
fn a_gpu_near_its_pressure_threshold_makes_the_agent_sample_fast() {
    let node = SyntheticNode::new("n1", 2, 8);
    let unbudgeted = PodTable::build(node.pods.iter().filter_map(PodView::from_pod), &[], Some("n1"));
    let pace = |threshold: Threshold| {
        let dir = tempfile::tempdir().expect("tempdir");
        let mut settings = Settings::new("n1");
        settings.pressure.hard = Some(threshold);
        settings.cadence.duty = 0;
        let (mut engine, _) = start(dir.path(), &node, settings, Some(10 << 30));
        engine.tick(&unbudgeted, true);
        engine.next_sample()
    };
    // 10 GiB free on each GPU: far above a 1 GiB threshold; near a 6 GiB one (free memory under twice the
    // threshold, though not under it: no pressure yet); no threshold at all (pressure off) is never near.
    assert_eq!(pace(Threshold::Bytes(1 << 30)), RELAXED);
    assert_eq!(pace(Threshold::Bytes(6 << 30)), FAST);
    let dir = tempfile::tempdir().expect("tempdir");
    let (mut off, _) = start(dir.path(), &node, Settings::new("n1"), Some(10 << 30));
    off.tick(&unbudgeted, true);
    assert_eq!(off.next_sample(), RELAXED);
}
