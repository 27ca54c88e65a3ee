//! The agent's per-tick hot paths, without NVML: cgroup parsing, PID attribution with a warm and a cold
//! cache, and one whole tick (sample-file check, attribution, per-pod sums, decisions, metrics) at 8, 128
//! and 1 024 processes on a synthetic node (`gpubudget_agent::synthetic`, fixture `/proc` in a tempdir).
//!
//! `cargo bench -p gpubudget-agent --bench tick`; CI only compiles this (`cargo bench --no-run`). Before
//! the measurements it counts heap allocations over 1 000 steady ticks of the 128-process node (a
//! counting global allocator, `stats_alloc`) and fails if the heap grew.

use std::alloc::System;
use std::hint::black_box;
use std::path::Path;
use std::time::Duration;

use criterion::{BatchSize, BenchmarkId, Criterion, criterion_group, criterion_main};
use gpubudget_agent::act::log::LogExecutor;
use gpubudget_agent::attribute::pods::{PodTable, PodView};
use gpubudget_agent::attribute::{ProcAttributor, parse_cgroup_file};
use gpubudget_agent::decide::Settings;
use gpubudget_agent::pipeline::Engine;
use gpubudget_agent::report::metrics::Metrics;
use gpubudget_agent::sample::SamplerSlot;
use gpubudget_agent::sample::file::RecordedSampler;
#[path = "../fixtures/synthetic.rs"]
mod synthetic;
use prometheus_client::registry::Registry;
use stats_alloc::{INSTRUMENTED_SYSTEM, Region, StatsAlloc};
use synthetic::SyntheticNode;

#[global_allocator]
static GLOBAL: &StatsAlloc<System> = &INSTRUMENTED_SYSTEM;

const CORPUS: &str = include_str!("../tests/fixtures/cgroup_corpus.txt");

/// The content of the first corpus block whose header contains `key`.
fn corpus_block(key: &str) -> String {
    let mut out = String::new();
    let mut inside = false;
    for line in CORPUS.lines() {
        if line.starts_with("== ") {
            if inside {
                break;
            }
            inside = line.contains(key);
        } else if inside && !line.starts_with('#') && !line.is_empty() {
            out.push_str(line);
            out.push('\n');
        }
    }
    assert!(!out.is_empty(), "no corpus block for {key:?}");
    out
}

/// The budgets of a bench's table.
#[derive(Debug, Clone, Copy)]
enum Budgets {
    /// None: nothing is enforced (the baseline of issue 25).
    None,
    /// The synthetic node's, selecting every pod.
    Node,
    /// The node's and this many more in the pods' namespace that select none of them.
    NodeAnd(u32),
}

/// A synthetic node written to `dir`, an engine over it, and its pod table, after the first ticks' writes.
fn engine_for(dir: &Path, processes: u32, with: Budgets) -> (Engine, PodTable) {
    let node = SyntheticNode::new("n1", 8, processes);
    node.write_proc(&dir.join("proc")).expect("fixture /proc");
    let sample = dir.join("sample.json");
    std::fs::write(&sample, node.sample_json()).expect("sample file");
    // Budgets of the pods' namespace that select none of them: the table carries every budget of the
    // namespaces with pods here, as the agent's does.
    let (mut budgets, extra_budgets) = match with {
        Budgets::None => (Vec::new(), 0),
        Budgets::Node => (node.budgets.clone(), 0),
        Budgets::NodeAnd(extra) => (node.budgets.clone(), extra),
    };
    budgets.extend((0..extra_budgets).map(|k| {
        serde_yaml::from_str::<gpubudget_common::GpuMemoryBudget>(&format!(
            "apiVersion: gpubudget.io/v1alpha1\nkind: GpuMemoryBudget\nmetadata: {{name: other-{k}, namespace: team-a}}\n\
             spec: {{selector: {{matchLabels: {{app: other-{k}}}}}, limit: 40Gi}}\n"
        ))
        .expect("budget")
    }));
    let table = PodTable::build(node.pods.iter().filter_map(PodView::from_pod), &budgets, Some(&node.node));
    assert_eq!(table.budgets.len(), budgets.len(), "every budget of the namespace is in the table");
    let mut engine = Engine::new(
        SamplerSlot::new(RecordedSampler::factory(sample)),
        ProcAttributor::new(&dir.join("proc")),
        Settings::new("n1"),
        Metrics::new(&mut Registry::default()),
    );
    let mut executor = LogExecutor::new(std::io::sink());
    for _ in 0..3 {
        assert!(engine.tick(&table, true).sampled);
        loop {
            let actions: Vec<_> = engine.take_actions().collect();
            if actions.is_empty() {
                break;
            }
            for feedback in executor.apply(actions, jiff::Timestamp::now()).expect("sink") {
                engine.feedback(feedback);
            }
        }
    }
    (engine, table)
}

/// Steady ticks must not grow the heap (and, with a sample file, should not allocate at all).
fn check_allocations() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (mut engine, table) = engine_for(dir.path(), 128, Budgets::Node);
    let ticks = 1_000u32;
    let region = Region::new(GLOBAL);
    let mut actions = 0;
    for _ in 0..ticks {
        engine.tick(&table, true);
        actions += engine.take_actions().count();
    }
    let stats = region.change();
    let growth = stats.bytes_allocated as i64 - stats.bytes_deallocated as i64 + stats.bytes_reallocated as i64;
    println!(
        "steady ticks, 128 processes: {ticks} ticks, {actions} actions, {} allocations ({:.2} per tick), heap growth {growth} B",
        stats.allocations,
        f64::from(u32::try_from(stats.allocations).unwrap_or(u32::MAX)) / f64::from(ticks),
    );
    assert_eq!(actions, 0, "steady state decides nothing");
    assert!(growth <= 0, "the heap grew by {growth} B over {ticks} steady ticks");
}

fn bench(c: &mut Criterion) {
    check_allocations();

    let mut group = c.benchmark_group("cgroup_parse");
    for (name, key) in [
        ("containerd_systemd_v2", "(EKS, AKS, kubeadm"),
        ("cgroupfs_v2", "(k3s, rke2 default)"),
        ("cgroupns_relative", "paths relative to the agent's cgroup"),
        ("docker_v1_12_lines", "(GKE COS before 1.24"),
        ("host_process", "pod=- "),
    ] {
        let content = corpus_block(key);
        group.bench_with_input(BenchmarkId::from_parameter(name), &content, |b, content| {
            b.iter(|| parse_cgroup_file(black_box(content)))
        });
    }
    group.finish();

    let mut warm = c.benchmark_group("attribution_warm");
    for processes in [8u32, 128, 1024] {
        let dir = tempfile::tempdir().expect("tempdir");
        let node = SyntheticNode::new("n1", 8, processes);
        node.write_proc(dir.path()).expect("fixture");
        let pids: Vec<u32> = node.processes.iter().map(|p| p.pid).collect();
        let mut attributor = ProcAttributor::new(dir.path());
        attributor.begin_round();
        for pid in &pids {
            let _ = attributor.lookup(*pid, 0);
        }
        attributor.end_round();
        warm.bench_with_input(BenchmarkId::from_parameter(processes), &pids, |b, pids| {
            b.iter(|| {
                attributor.begin_round();
                for pid in pids {
                    black_box(attributor.lookup(*pid, 1_000));
                }
                attributor.end_round();
            })
        });
    }
    warm.finish();

    let mut cold = c.benchmark_group("attribution_cold");
    for processes in [8u32, 128, 1024] {
        let dir = tempfile::tempdir().expect("tempdir");
        let node = SyntheticNode::new("n1", 8, processes);
        node.write_proc(dir.path()).expect("fixture");
        let pids: Vec<u32> = node.processes.iter().map(|p| p.pid).collect();
        cold.bench_with_input(BenchmarkId::from_parameter(processes), &pids, |b, pids| {
            b.iter_batched_ref(
                || ProcAttributor::new(dir.path()),
                |attributor| {
                    attributor.begin_round();
                    for pid in pids {
                        black_box(attributor.lookup(*pid, 0));
                    }
                    attributor.end_round();
                },
                BatchSize::SmallInput,
            )
        });
    }
    cold.finish();

    let mut tick = c.benchmark_group("tick");
    for processes in [8u32, 128, 1024] {
        let dir = tempfile::tempdir().expect("tempdir");
        let (mut engine, table) = engine_for(dir.path(), processes, Budgets::Node);
        tick.bench_function(BenchmarkId::from_parameter(processes), |b| {
            b.iter(|| {
                let report = engine.tick(&table, true);
                assert!(report.sampled && engine.take_actions().next().is_none());
            })
        });
    }
    tick.finish();

    // Issue 25: the tick's cost with no budget at all, with every pod budgeted, and with 10 000 more budgets
    // in the pods' namespace (128 processes).
    let mut by_budgets = c.benchmark_group("tick_128_processes_by_budgets");
    for with in [Budgets::None, Budgets::Node, Budgets::NodeAnd(10_000)] {
        let dir = tempfile::tempdir().expect("tempdir");
        let (mut engine, table) = engine_for(dir.path(), 128, with);
        by_budgets.bench_function(BenchmarkId::from_parameter(table.budgets.len()), |b| {
            b.iter(|| {
                let report = engine.tick(&table, true);
                assert!(report.sampled && engine.take_actions().next().is_none());
            })
        });
    }
    by_budgets.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default().warm_up_time(Duration::from_secs(1)).measurement_time(Duration::from_secs(3));
    targets = bench
}
criterion_main!(benches);
