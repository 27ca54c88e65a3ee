//! What the agent adds to a container's creation with `--runtime-caps`, without the wire (in memory, synthetic):
//! the decision for one GPU container (`runtime_caps::decide`: the devices it sees, the pod's budget from the
//! published table, the canonical values) on a node of 110 pods, with a plain 40-variable environment and with a
//! hostile MPS value. The wire and the real runtime: nri/README.md and e2e/cluster/runtime-caps.sh.
//!
//! `cargo bench -p gpubudget-agent --bench runtime_caps`; CI only compiles it.

use std::hint::black_box;
use std::sync::Arc;

use criterion::{Criterion, criterion_group, criterion_main};
use gpubudget_agent::attribute::pods::{PodTable, PodView};
use gpubudget_agent::runtime_caps::{Decision, View, decide};
use gpubudget_common::GpuMemoryBudget;
use gpubudget_nri::api::{Container, PodSandbox};
use k8s_openapi::api::core::v1::Pod;

fn table(pods: usize) -> PodTable {
    let budget: GpuMemoryBudget = serde_yaml::from_str(
        "apiVersion: gpubudget.io/v1alpha1\nkind: GpuMemoryBudget\nmetadata: {name: llm, namespace: team-a}\n\
         spec: {selector: {}, limit: 8Gi, admissionCaps: Enabled}",
    )
    .expect("budget");
    let views = (0..pods).map(|i| {
        let p: Pod = serde_yaml::from_str(&format!(
            "metadata: {{name: p{i}, namespace: team-a, uid: uid-{i}}}\nspec: {{nodeName: n1, containers: []}}"
        ))
        .expect("pod");
        PodView::from_pod(&p).expect("view")
    });
    PodTable::build(views, [&budget], Some("n1"))
}

fn container(extra: &str) -> Container {
    let mut env: Vec<String> = (0..38).map(|i| format!("VAR_{i}=value-{i}")).collect();
    env.push("NVIDIA_VISIBLE_DEVICES=GPU-8a1d0f2c-1b2a-4c3d-9e8f-0a1b2c3d4e5f".into());
    env.push(extra.into());
    Container { name: "main".into(), env, ..Default::default() }
}

fn bench(c: &mut Criterion) {
    let view = View { table: Arc::new(table(110)), synced: true, gpus: 8 };
    let pod = PodSandbox { uid: "uid-57".into(), name: "p57".into(), namespace: "team-a".into(), ..Default::default() };
    let plain = container("PATH=/usr/bin");
    let hostile = container("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=99G,GPU-x=1G,junk");
    assert!(matches!(decide(&view, &pod, &plain, None), Decision::Adjust { .. }));
    let mut group = c.benchmark_group("runtime_caps");
    group.bench_function("decide, 110 pods, 40 variables", |b| b.iter(|| decide(black_box(&view), &pod, &plain, None)));
    group.bench_function("decide, hostile MPS value", |b| b.iter(|| decide(black_box(&view), &pod, &hostile, None)));
    group.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
