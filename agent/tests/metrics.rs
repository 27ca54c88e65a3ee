//! The agent's metrics through the whole pipeline: cached gauge handles follow the pods.

#[path = "../fixtures/synthetic.rs"]
mod synthetic;

use gpubudget_agent::attribute::PodTable;
use gpubudget_agent::attribute::ProcAttributor;
use gpubudget_agent::attribute::parse_cgroup_file;
use gpubudget_agent::attribute::pods::PodView;
use gpubudget_agent::decide::Settings;
use gpubudget_agent::pipeline::Engine;
use gpubudget_agent::report::metrics::Metrics;
use gpubudget_agent::sample::SamplerSlot;
use gpubudget_agent::sample::file::RecordedSampler;
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use prometheus_client::registry::Registry;
use synthetic::SyntheticNode;

fn encode(registry: &Registry) -> String {
    let mut out = String::new();
    prometheus_client::encoding::text::encode(&mut out, registry).expect("encodes");
    out
}

/// Gauges set through the cached handles are the registry's series; a pod that goes takes its series
/// with it, and one that comes back gets them again.
#[test]
fn cached_series_follow_the_pods() {
    let dir = tempfile::tempdir().expect("tempdir");
    let node = SyntheticNode::new("n1", 2, 4);
    node.write_proc(dir.path()).expect("proc");
    let sample = dir.path().join("sample.json");
    std::fs::write(&sample, node.sample_json()).expect("sample");
    let mut registry = Registry::default();
    let metrics = Metrics::new(&mut registry);
    let mut engine = Engine::new(
        SamplerSlot::new(RecordedSampler::factory(sample)),
        ProcAttributor::new(dir.path()),
        Settings::new("n1"),
        metrics,
    );
    let full = node.table();
    let without_p0 = PodTable::build(node.pods.iter().skip(1).filter_map(PodView::from_pod), &node.budgets, Some("n1"));
    let over = "gpubudget_pod_state{namespace=\"team-a\",pod=\"p0\",state=\"Over\"} 1";
    let bytes =
        "gpubudget_pod_gpu_memory_bytes{namespace=\"team-a\",pod=\"p0\",container=\"main\",gpu=\"0\"} 2684354560";
    let limit = "gpubudget_pod_budget_bytes{namespace=\"team-a\",pod=\"p0\",budget=\"b0\"} 4294967296";
    for _ in 0..2 {
        assert!(engine.tick(&full, true).sampled);
        let text = encode(&registry);
        for line in [over, bytes, limit] {
            assert!(text.contains(line), "{line} missing from\n{text}");
        }
        assert!(text.contains("gpubudget_pod_state{namespace=\"team-a\",pod=\"p1\",state=\"Near\"} 1"), "{text}");
        engine.tick(&without_p0, true);
        let text = encode(&registry);
        assert!(!text.contains("pod=\"p0\""), "p0's series stay after it left:\n{text}");
        assert!(text.contains("pod=\"p1\""));
    }
    // The gauges are written when what they show changes: p0's limit lowered (still Over), then raised to
    // 8Gi (Within); its limit and states follow at the next tick.
    let with_b0 = |limit: &str| {
        let mut budgets = node.budgets.clone();
        for b in budgets.iter_mut().filter(|b| b.metadata.name.as_deref() == Some("b0")) {
            b.spec.limit = Quantity(limit.into());
        }
        PodTable::build(node.pods.iter().filter_map(PodView::from_pod), &budgets, Some("n1"))
    };
    for (limit, bytes, state) in [("4Gi", 4u64 << 30, "Over"), ("2Gi", 2 << 30, "Over"), ("8Gi", 8 << 30, "Within")] {
        engine.tick(&with_b0(limit), true);
        let text = encode(&registry);
        for line in [
            format!("gpubudget_pod_budget_bytes{{namespace=\"team-a\",pod=\"p0\",budget=\"b0\"}} {bytes}"),
            format!("gpubudget_pod_state{{namespace=\"team-a\",pod=\"p0\",state=\"{state}\"}} 1"),
        ] {
            assert!(text.contains(&line), "{limit}: {line} missing from\n{text}");
        }
    }
    assert!(encode(&registry).contains("gpubudget_pod_state{namespace=\"team-a\",pod=\"p0\",state=\"Over\"} 0"));
    // Every pod has a budget: nothing is unbudgeted. The same pods with no budget in the table: the bytes of
    // each GPU's pods are.
    engine.tick(&full, true);
    assert!(encode(&registry).contains("gpubudget_unbudgeted_bytes{gpu=\"0\"} 0"));
    let no_budgets = PodTable::build(node.pods.iter().filter_map(PodView::from_pod), &[], Some("n1"));
    engine.tick(&no_budgets, true);
    let text = encode(&registry);
    let value = |line: &str| line.rsplit(' ').next().and_then(|v| v.parse::<u64>().ok()).expect("a value");
    let pods_on_0: u64 = text
        .lines()
        .filter(|l| l.starts_with("gpubudget_pod_gpu_memory_bytes{") && l.contains("gpu=\"0\""))
        .map(value)
        .sum();
    let unbudgeted_0 = text.lines().find(|l| l.starts_with("gpubudget_unbudgeted_bytes{gpu=\"0\"}")).map(value);
    assert!(pods_on_0 > 0);
    assert_eq!(unbudgeted_0, Some(pods_on_0), "{text}");
}

#[test]
fn a_node_of_128_processes() {
    let n = SyntheticNode::new("n1", 8, 128);
    assert_eq!((n.pods.len(), n.processes.len(), n.budgets.len()), (64, 128, 8));
    let table = n.table();
    assert_eq!(table.pods.len(), 64);
    assert!(table.invalid_budgets.is_empty());
    assert!((0..64).all(|i| table.budget(i).is_some()), "every pod has a budget");
    for p in &n.processes {
        let owner = parse_cgroup_file(&p.cgroup).expect("attributed");
        let pod = table.find_uid(&owner.pod_uid).expect("known pod");
        let cid = owner.container_id.expect("container");
        assert_eq!(table.pods[pod].container_by_id(&cid).map(|c| &**c), Some("main"));
    }
    let sample: serde_json::Value = serde_json::from_str(&n.sample_json()).expect("json");
    assert_eq!(sample["gpus"].as_array().map(Vec::len), Some(8));
    assert_eq!(sample["gpus"][0]["processes"].as_array().map(Vec::len), Some(16));
    assert_eq!(SyntheticNode::new("n1", 8, 8).processes.len(), 8);
}
