//! The caps webhook's decision, from the request body to the encoded answer (what one slot of the
//! blocking pool does per request, `caps_webhook::answer` less the budget cache's lock and the metric):
//! for an ordinary GPU pod, for a 128 KiB MPS value (the longest read), and for a 1.5 MB value (about the
//! largest the API server accepts in one field: its request bodies are capped at 3 MB), which is replaced
//! unread. `cargo bench -p gpubudget-operator --bench caps`; CI only compiles this (`cargo bench --no-run`).

use std::collections::BTreeMap;
use std::hint::black_box;

use criterion::{Criterion, criterion_group, criterion_main};
use gpubudget_common::Budget;
use gpubudget_operator::caps_webhook::decide;
use kube::core::DynamicObject;
use kube::core::admission::{AdmissionRequest, AdmissionReview};
use serde_json::{Value, json};

fn review(env: Value) -> Vec<u8> {
    serde_json::to_vec(&json!({
        "apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
        "request": {
            "uid": "req-1", "kind": {"group": "", "version": "v1", "kind": "Pod"},
            "resource": {"group": "", "version": "v1", "resource": "pods"},
            "requestKind": {"group": "", "version": "v1", "kind": "Pod"},
            "name": "", "namespace": "team-a", "operation": "CREATE",
            "userInfo": {"username": "alice"}, "dryRun": false,
            "object": {
                "apiVersion": "v1", "kind": "Pod",
                "metadata": {"generateName": "trainer-", "namespace": "team-a", "labels": {"app": "llm"}},
                "spec": {"nodeSelector": {"nvidia.com/gpu.sharing-strategy": "none"}, "containers": [
                    {"name": "main", "image": "pytorch", "resources": {"limits": {"nvidia.com/gpu": "2", "memory": "8Gi"}},
                     "env": env},
                    {"name": "sidecar", "image": "logger", "env": [{"name": "LOG", "value": "info"}]},
                ]},
            },
        }
    }))
    .expect("json")
}

/// What one request costs: parse, decide, encode.
fn decide_bytes(body: &[u8], budgets: &[Budget], labels: &BTreeMap<String, String>) -> usize {
    let review: AdmissionReview<DynamicObject> = serde_json::from_slice(body).expect("review");
    let request: AdmissionRequest<DynamicObject> = review.try_into().expect("request");
    let (response, _) = decide(&request, budgets, labels);
    serde_json::to_vec(&response.into_review()).expect("encodes").len()
}

fn bench(c: &mut Criterion) {
    let spec =
        serde_yaml::from_str("{selector: {matchLabels: {app: llm}}, limit: 8Gi, request: 6Gi, admissionCaps: Enabled}")
            .expect("spec");
    let budgets = [Budget::from_spec("team-a", "llm", &spec).expect("valid")];
    let labels = BTreeMap::new();
    let ordinary = review(json!([{"name": "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT", "value": "0=4G,1=99G"}]));
    // Just under 128 KiB: read, entry by entry (every one for device 0 or 1, so the driver would honour it).
    let mut read = String::new();
    for device in [0, 1].into_iter().cycle() {
        if read.len() >= 128 * 1024 - 16 {
            break;
        }
        read.push_str(&format!("{device}={}M,", 4096 >> device));
    }
    let longest_read = review(json!([{"name": "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT", "value": read}]));
    let huge: String = (0..200_000).map(|i| format!("{}=1024M,", i % 7)).collect();
    assert!(huge.len() > 1_500_000);
    let largest = review(json!([{"name": "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT", "value": huge}]));
    let mut group = c.benchmark_group("caps_decision");
    for (name, body) in
        [("ordinary_pod", &ordinary), ("mps_value_128KiB", &longest_read), ("mps_value_1_5MB", &largest)]
    {
        group.bench_function(name, |b| b.iter(|| decide_bytes(black_box(body), &budgets, &labels)));
    }
    group.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
