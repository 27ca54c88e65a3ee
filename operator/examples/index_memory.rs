//! What the operator's pod ↔ budget index costs per pod (issue 25: 150 000 pods in 128 MiB): fills an
//! [`Index`] as the pod watch does — each pod's JSON parsed by the watch's lean parser (`PodMeta`), then
//! `apply_pod` — and prints this process's RSS before and after. No API server, no network: a bench for the
//! index alone, to compare designs; the operator's RSS on a real API server is e2e/apiserver/scale-operator.sh's.
//!
//! ```sh
//! cargo run --release -p gpubudget-operator --example index_memory -- 1000 150 10        # NAMESPACES PODS_PER_NS BUDGETS_PER_NS
//! cargo run --release -p gpubudget-operator --example index_memory -- 1000 150 10 unique # + a label of each pod's own
//! ```
//!
//! The pods are shaped like e2e/apiserver/load.py's: six labels (`app` one of 9, `team` the namespace), a 1.5 KB
//! last-applied annotation (parsed and dropped, as the watch drops it) and the agent's record; budget 0 of a
//! namespace selects every pod there, budget k selects `app: app-k`. With `unique`, each pod also carries a
//! label no other pod has (a StatefulSet's `statefulset.kubernetes.io/pod-name`), so no label set is shared.

use gpubudget_operator::index::Index;
use gpubudget_operator::pods::PodMeta;
use serde_json::json;

fn rss_kib() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| s.lines().find(|l| l.starts_with("VmRSS:")).map(str::to_owned))
        .and_then(|l| l.split_whitespace().nth(1).and_then(|v| v.parse().ok()))
        .unwrap_or(0)
}

fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let number = |i: usize, default: usize| args.get(i).and_then(|a| a.parse().ok()).unwrap_or(default);
    let (namespaces, per_ns, budgets_per_ns) = (number(0, 1000), number(1, 150), number(2, 10));
    let unique = args.iter().any(|a| a == "unique");
    let last_applied = "x".repeat(1500);

    let mut index = Index::new();
    for n in 0..namespaces {
        for b in 0..budgets_per_ns {
            let selector = if b == 0 { json!({}) } else { json!({"matchLabels": {"app": format!("app-{b}")}}) };
            let budget = serde_json::from_value(json!({
                "apiVersion": "gpubudget.io/v1alpha1", "kind": "GpuMemoryBudget",
                "metadata": {"name": format!("budget-{b}"), "namespace": format!("ns-{n}"), "uid": format!("b-{n}-{b}")},
                "spec": {"selector": selector, "limit": "40Gi"},
            }))?;
            index.apply_budget(&budget);
        }
    }
    let before = rss_kib();
    let started = std::time::Instant::now();
    for n in 0..namespaces {
        for k in 0..per_ns {
            let (namespace, name) = (format!("ns-{n}"), format!("pod-{k:05}"));
            let app = format!("app-{}", 1 + k % budgets_per_ns.saturating_sub(1).max(1));
            let mut labels = json!({"app": app, "team": namespace, "tier": "inference", "version": "v1.2.3",
                                    "pod-template-hash": "5d8f7c9b6", "app.kubernetes.io/managed-by": "helm"});
            if unique {
                labels["statefulset.kubernetes.io/pod-name"] = json!(name);
            }
            let pod = json!({
                "apiVersion": "v1", "kind": "Pod",
                "metadata": {
                    "name": name, "namespace": namespace, "uid": format!("0b6f6a4e-{n:04x}-4c1e-9d7a-{k:012x}"),
                    "resourceVersion": "12345", "creationTimestamp": "2026-11-25T10:00:00Z", "labels": labels,
                    "annotations": {
                        "kubectl.kubernetes.io/last-applied-configuration": last_applied,
                        "gpubudget.io/state": "Within", "gpubudget.io/usage-bytes": ((1 + k % 6) << 30).to_string(),
                        "gpubudget.io/budget": app.replace("app-", "budget-"),
                        "gpubudget.io/node": format!("node-{}", (n * per_ns + k) % 5000),
                    },
                },
                "spec": {"nodeName": "node-0", "terminationGracePeriodSeconds": 30,
                         "containers": [{"name": "main", "image": "registry.k8s.io/pause:3.10"}]},
                "status": {"phase": "Running", "startTime": "2026-11-25T10:00:01Z"},
            });
            let meta: PodMeta = serde_json::from_value(pod)?;
            index.apply_pod(
                meta.info(&gpubudget_common::CriticalNamespaces::default())
                    .ok_or_else(|| anyhow::anyhow!("pod without a name"))?,
            );
        }
    }
    let elapsed = started.elapsed();
    let after = rss_kib();
    let pods = index.pod_count();
    println!(
        "index_memory pods={pods} budgets={} unique_labels={unique} rss_before={:.1}MiB rss_after={:.1}MiB \
         per_pod={:.0}B apply={:.2}us/pod",
        index.budget_count(),
        before as f64 / 1024.0,
        after as f64 / 1024.0,
        (after.saturating_sub(before) * 1024) as f64 / pods.max(1) as f64,
        elapsed.as_secs_f64() * 1e6 / pods.max(1) as f64,
    );
    Ok(())
}
