//! The pod table from the caches as they are at one moment: a plain function of plain values ([`build`]), with
//! what the runtime made of the pods' containers merged in.

use std::collections::{BTreeMap, HashSet};
use std::sync::Arc;

use gpubudget_common::enforcement;
use gpubudget_common::pod_record::RuntimeCapsRecord;
use gpubudget_common::share::Declaration;
use k8s_openapi::api::core::v1::Pod;

use crate::attribute::budgets::{BudgetIndex, ClusterIndex};
use crate::attribute::pods::{MIRROR_ANNOTATION, MpsCap, PodTable, PodView};

/// The caches at one moment: what [`build`] reads.
#[derive(Debug, Clone, Copy)]
pub struct Cached<'a> {
    /// The node's pods (as the reflector keeps them: cut down by [`crate::attribute::pods::slim_pod`]).
    pub pods: &'a [Arc<Pod>],
    /// The namespaced budgets, compiled.
    pub budgets: &'a BudgetIndex,
    /// The cluster budgets, with the namespaces' labels they select by.
    pub cluster: &'a ClusterIndex,
    /// The Node's sharing and enforcement labels ([`super::node`]); `None` until read.
    pub node_labels: Option<&'a BTreeMap<String, String>>,
}

/// What the runtime made of a pod's GPU containers, as the table reads it: the record, and the MPS cap it holds
/// them to.
pub type MadeSummary = (RuntimeCapsRecord, Option<MpsCap>);

/// The pod table of `node`, its GPUs holding `gpu_totals` bytes each: each pod's declared share read on the
/// Node's labels, and where the runtime made its GPU containers (`made`, by pod UID, a static pod's by its
/// mirror's annotation) their caps instead of the spec's (they are what the pods' processes started with).
pub fn build(
    cached: Cached<'_>,
    made: impl Fn(&str) -> Option<MadeSummary>,
    node: &str,
    gpu_totals: &[u64],
) -> PodTable {
    let Cached { pods, budgets, cluster, node_labels } = cached;
    let label = node_labels.and_then(|l| l.get(enforcement::NODE_LABEL));
    let node_enforcement = enforcement::parse_label(label.map(String::as_str)).ok().flatten();
    let mut table = PodTable::from_index(
        pods.iter().filter_map(|p| PodView::from_pod(p)).map(|mut v| {
            v.share = std::mem::replace(&mut v.share, Declaration::None).on_node(node_labels);
            let by_runtime = made(&v.uid).or_else(|| v.mirror_of.as_deref().and_then(&made));
            if let Some((record, cap)) = by_runtime {
                v.mps_cap_mib = cap;
                v.runtime_caps = Some(record);
            }
            v
        }),
        budgets,
        cluster,
        Some(node),
        gpu_totals,
    );
    table.node_enforcement = node_enforcement;
    table
}

/// The UIDs (lowercase) the runtime's containers of `pods` are known by: each pod's own, and a mirror's static
/// pod's (from its annotation). What the runtime made of any other pod is forgotten.
pub fn uids_here(pods: &[Arc<Pod>]) -> HashSet<String> {
    pods.iter()
        .flat_map(|p| {
            let meta = &p.metadata;
            let mirror = meta.annotations.as_ref().and_then(|a| a.get(MIRROR_ANNOTATION));
            meta.uid.iter().chain(mirror).map(|u| u.to_ascii_lowercase())
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use gpubudget_common::{Enforcement, GpuMemoryBudget};

    const NODE: &str = "gpu-node-1";
    const GI: u64 = 1 << 30;

    fn pods(yaml: &str) -> Vec<Arc<Pod>> {
        serde_yaml::Deserializer::from_str(yaml)
            .map(|doc| Arc::new(serde::Deserialize::deserialize(doc).expect("pod fixture")))
            .collect()
    }

    const PODS: &str = r#"
metadata: {name: llm-0, namespace: team-a, uid: AAAAAAAA-0000-0000-0000-000000000001, labels: {app: llm}}
spec: {nodeName: gpu-node-1, containers: [{name: main, image: x}]}
---
metadata:
  name: static-0-gpu-node-1
  namespace: team-a
  uid: cccccccc-0000-0000-0000-000000000003
  labels: {app: llm}
  annotations: {kubernetes.io/config.mirror: BBBBBBBB-0000-0000-0000-000000000002}
spec: {nodeName: gpu-node-1, containers: [{name: main, image: x}]}
---
metadata: {name: elsewhere-0, namespace: team-a, uid: dddddddd-0000-0000-0000-000000000004, labels: {app: llm}}
spec: {nodeName: gpu-node-2, containers: [{name: main, image: x}]}
"#;

    fn budgets() -> BudgetIndex {
        let budget: GpuMemoryBudget = serde_yaml::from_str(
            "metadata: {name: llm, namespace: team-a}\nspec: {selector: {matchLabels: {app: llm}}, limit: 8Gi}",
        )
        .expect("budget fixture");
        BudgetIndex::of([&budget])
    }

    fn table(pods: &[Arc<Pod>], labels: Option<&BTreeMap<String, String>>, made: &[(&str, MadeSummary)]) -> PodTable {
        let budgets = budgets();
        let cluster = ClusterIndex::default();
        let cached = Cached { pods, budgets: &budgets, cluster: &cluster, node_labels: labels };
        build(cached, |uid| made.iter().find(|(u, _)| *u == uid).map(|(_, s)| s.clone()), NODE, &[80 * GI])
    }

    fn names(table: &PodTable) -> Vec<&str> {
        table.pods.iter().map(|p| &*p.name).collect()
    }

    #[test]
    fn the_table_holds_the_pods_of_its_node_with_their_budgets() {
        let t = table(&pods(PODS), None, &[]);
        assert_eq!(names(&t), ["llm-0", "static-0-gpu-node-1"]);
        for i in 0..t.pods.len() {
            let budget = t.budget(i).expect("the budget selects the pod");
            assert_eq!((budget.key(), budget.limit_bytes), ("team-a/llm".to_owned(), 8 * GI));
            assert_eq!(t.pods[i].runtime_caps, None, "nothing made by the runtime");
        }
        assert_eq!(t.node_enforcement, None, "the Node's labels not read");
    }

    #[test]
    fn what_the_runtime_made_is_the_pods_cap_a_static_pods_found_by_its_mirror() {
        let record = |mib| RuntimeCapsRecord::capped([("main".to_owned(), mib)]);
        let made = [
            ("aaaaaaaa-0000-0000-0000-000000000001", (record(4096), Some(MpsCap { mib: 4096, devices: 1 }))),
            ("bbbbbbbb-0000-0000-0000-000000000002", (record(2048), Some(MpsCap { mib: 2048, devices: 1 }))),
            ("dddddddd-0000-0000-0000-000000000004", (record(1024), None)),
        ];
        let t = table(&pods(PODS), None, &made);
        let caps: Vec<_> = t.pods.iter().map(|p| (p.mps_cap_mib.map(|c| c.mib), p.runtime_caps.clone())).collect();
        assert_eq!(caps, [(Some(4096), Some(record(4096))), (Some(2048), Some(record(2048)))]);
    }

    #[test]
    fn the_nodes_enforcement_label_is_read_when_valid() {
        let labels = |value: &str| BTreeMap::from([(enforcement::NODE_LABEL.to_owned(), value.to_owned())]);
        let observe = labels("Observe");
        assert_eq!(table(&pods(PODS), Some(&observe), &[]).node_enforcement, Some(Enforcement::Observe));
        let enforce = labels("Enforce");
        assert_eq!(table(&pods(PODS), Some(&enforce), &[]).node_enforcement, Some(Enforcement::Enforce));
        // Neither: the agent's --enforcement applies.
        let neither = labels("Sometimes");
        assert_eq!(table(&pods(PODS), Some(&neither), &[]).node_enforcement, None);
        assert_eq!(table(&pods(PODS), Some(&BTreeMap::new()), &[]).node_enforcement, None);
    }

    #[test]
    fn the_runtimes_containers_are_known_by_each_pods_uid_and_its_static_pods() {
        let mut here: Vec<String> = uids_here(&pods(PODS)).into_iter().collect();
        here.sort();
        assert_eq!(
            here,
            [
                "aaaaaaaa-0000-0000-0000-000000000001",
                "bbbbbbbb-0000-0000-0000-000000000002",
                "cccccccc-0000-0000-0000-000000000003",
                "dddddddd-0000-0000-0000-000000000004",
            ]
        );
    }
}
