//! The pure hot paths an agent runs every tick: budget resolution and the state machine.
//! `cargo bench -p gpubudget-common`; CI only compiles this (`cargo bench --no-run`).

use std::collections::BTreeMap;
use std::hint::black_box;

use criterion::{BenchmarkId, Criterion, criterion_group, criterion_main};
use gpubudget_common::quantity::parse_bytes;
use gpubudget_common::{Budget, PodLabels, Thresholds, Tracker, resolve, step};

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
}

criterion_group!(benches, bench);
criterion_main!(benches);
