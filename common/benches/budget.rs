//! The pure hot paths an agent runs every tick: budget resolution and the state machine.
//! `cargo bench -p gpubudget-common`; CI only compiles this (`cargo bench --no-run`).

use std::collections::BTreeMap;
use std::hint::black_box;

use criterion::{BenchmarkId, Criterion, criterion_group, criterion_main};
use gpubudget_common::quantity::parse_bytes;
use gpubudget_common::share::{Declaration, Sources, declared};
use gpubudget_common::{Budget, PodLabels, Thresholds, Tracker, resolve, step};
use k8s_openapi::api::core::v1::Pod;

fn budgets(n: usize) -> Vec<Budget> {
    (0..n)
        .map(|i| {
            let yaml = format!(
                "selector: {{matchLabels: {{app: app-{}}}, matchExpressions: [{{key: tier, operator: In, values: [gold, silver]}}]}}\n\
                 limit: {}Gi\n",
                i % 50,
                1 + i % 16
            );
            Budget::from_spec("team-a", &format!("b{i}"), &serde_yaml::from_str(&yaml).expect("spec")).expect("valid")
        })
        .collect()
}

fn bench(c: &mut Criterion) {
    let mut group = c.benchmark_group("resolve");
    for n in [10usize, 100, 1000] {
        let all = budgets(n);
        let labels: BTreeMap<String, String> =
            [("app".to_owned(), "app-7".to_owned()), ("tier".to_owned(), "gold".to_owned())].into();
        let no_labels = BTreeMap::new();
        group.bench_with_input(BenchmarkId::from_parameter(n), &all, |b, all| {
            b.iter(|| {
                resolve(black_box(all), black_box(&PodLabels::new("team-a", &no_labels, &labels)))
                    .map(|r| r.budget.limit_bytes)
            })
        });
    }
    group.finish();

    let th = Thresholds::new(8 << 30, 90, 10_000, true);
    c.bench_function("state_machine_step_x1024", |b| {
        let mut trackers = vec![Tracker::default(); 1024];
        let mut now = 0u64;
        b.iter(|| {
            now += 250;
            for (i, t) in trackers.iter_mut().enumerate() {
                *t = step(*t, &th, now, black_box((i as u64) << 24));
            }
        })
    });

    c.bench_function("parse_quantity", |b| b.iter(|| parse_bytes(black_box("1536Mi"))));

    // Shares (issue 44): 10 000 pods as KAI and HAMi leave them, each declaration read from the whole pod (once
    // per pod event in the agent), then each pod's rules under a share budget on an H100 (once per table build).
    let pods: Vec<Pod> = (0..10_000)
        .map(|i| {
            let yaml = if i % 2 == 0 {
                format!(
                    "metadata: {{name: p{i}, namespace: a, annotations: {{gpu-fraction: '0.{}', gpu-fraction-num-devices: '{}'}}}}\n\
                     spec: {{schedulerName: kai-scheduler, containers: [{{name: c, image: i}}]}}",
                    1 + i % 9,
                    1 + i % 2
                )
            } else {
                format!(
                    "metadata: {{name: p{i}, namespace: a}}\n\
                     spec: {{containers: [{{name: c, image: i, resources: {{limits: {{nvidia.com/gpu: 1, nvidia.com/gpumem: {}}}}}}}]}}",
                    1000 + i
                )
            };
            serde_yaml::from_str(&yaml).expect("pod")
        })
        .collect();
    c.bench_function("share_declared_x10000", |b| {
        b.iter(|| pods.iter().filter(|p| declared(black_box(p), None, Sources::ALL) != Declaration::None).count())
    });
    let decls: Vec<Declaration> = pods.iter().map(|p| declared(p, None, Sources::ALL)).collect();
    let budget =
        Budget::from_spec("a", "shares", &serde_yaml::from_str("selector: {}\nlimit: 80Gi\nshare: {}").expect("spec"))
            .expect("valid");
    let h100 = [81_559u64 << 20];
    c.bench_function("share_rules_x10000", |b| {
        b.iter(|| {
            decls.iter().filter_map(|d| budget.for_declared(black_box(d), &h100)).map(|r| r.limit_bytes).sum::<u64>()
        })
    });
}

criterion_group!(benches, bench);
criterion_main!(benches);
