//! A tenant can write any annotation on its own pods, the agent's `gpubudget.io/*` record included.
//! What a forged record can and cannot do to the operator's eviction counts (docs/security.md, "Hostile
//! pods"), through the real index and status computation.

use std::collections::BTreeMap;

use gpubudget_common::pod_record::PodRecord;
use gpubudget_common::{BudgetState, GpuMemoryBudget};
use gpubudget_operator::index::Index;
use gpubudget_operator::pods::{ObjKey, PodInfo};
use gpubudget_operator::status::compute;
use k8s_openapi::jiff::Timestamp;

fn budget(namespace: &str, name: &str) -> GpuMemoryBudget {
    serde_yaml::from_str(&format!(
        "apiVersion: gpubudget.io/v1alpha1\nkind: GpuMemoryBudget\nmetadata: {{name: {name}, namespace: {namespace}}}\n\
         spec: {{selector: {{matchLabels: {{app: llm}}}}, limit: 8Gi}}"
    ))
    .expect("budget")
}

fn forged(namespace: &str, name: &str, terminating: bool) -> PodInfo {
    PodInfo {
        namespace: namespace.into(),
        name: name.into(),
        uid: format!("uid-{namespace}-{name}").as_str().into(),
        labels: std::sync::Arc::new(BTreeMap::from([("app".to_owned(), "other".to_owned())])),
        record: Some(PodRecord {
            state: BudgetState::Evicting,
            usage_bytes: 1 << 40,
            budget: "llm".into(),
            node: "gpu-node-1".into(),
            eviction_requested_at: Some("2026-11-21T18:00:00Z".into()),
            cap_not_in_force: None,
            share: None,
            runtime_caps: None,
        }),
        terminating,
        caps: gpubudget_common::caps::PodCaps::NoGpu,
        started_ms: None,
        exempt: None,
        grace_seconds: None,
    }
}

fn evictions(index: &Index, resource: &GpuMemoryBudget) -> i64 {
    let key = ObjKey::new(resource.metadata.namespace.clone().expect("ns"), resource.metadata.name.clone().expect("n"));
    compute(resource, &index.inputs(&key), None, Timestamp::UNIX_EPOCH).evictions
}

/// A record names a budget by name only, resolved in the pod's own namespace: a tenant's forged
/// record can never reach a budget of another namespace.
#[test]
fn a_forged_record_cannot_reach_another_namespaces_budget() {
    let mut index = Index::new();
    let theirs = budget("team-a", "llm");
    let mine = budget("tenant-b", "llm");
    index.apply_budget(&theirs);
    index.apply_budget(&mine);
    index.apply_pod(forged("tenant-b", "p", true));
    assert_eq!(evictions(&index, &theirs), 0, "team-a/llm is out of tenant-b's reach");
    // Within its own namespace the count is an audit figure the tenant can inflate (documented).
    assert_eq!(evictions(&index, &mine), 1);
}

/// A forged `Evicting` record on a pod that keeps running is not an eviction: the count needs the pod to
/// be going, and counts a pod once by UID however often the record is rewritten.
#[test]
fn a_forged_record_on_a_running_pod_counts_nothing_and_a_pod_counts_once() {
    let mut index = Index::new();
    let resource = budget("tenant-b", "llm");
    index.apply_budget(&resource);
    index.apply_pod(forged("tenant-b", "p", false));
    assert_eq!(evictions(&index, &resource), 0);
    let mut again = forged("tenant-b", "p", true);
    index.apply_pod(again.clone());
    let key = ObjKey::new("tenant-b", "llm");
    let first = compute(&resource, &index.inputs(&key), None, Timestamp::UNIX_EPOCH);
    assert_eq!(first.evictions, 1);
    again.record.as_mut().expect("record").eviction_requested_at = Some("2026-11-21T19:00:00Z".into());
    index.apply_pod(again);
    let second = compute(&resource, &index.inputs(&key), Some(&first), Timestamp::UNIX_EPOCH);
    assert_eq!(second.evictions, 1, "the same UID is not counted twice");
}
