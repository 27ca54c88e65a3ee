//! `top`: GPU memory by pod across nodes: the pods the agents keep a record on, with what the nodes'
//! `GpuNodeUsage` say they hold (#34).

use std::collections::HashMap;

use gpubudget_common::pod_record::CLUSTER_BUDGET_PREFIX;
use gpubudget_common::pod_record::PodRecord;
use gpubudget_common::quantity::HumanBytes;
use gpubudget_common::{Budget, ClusterGpuMemoryBudget, GpuMemoryBudget};
use k8s_openapi::api::core::v1::Pod;

use crate::format::percent;
use crate::report::TopRow;

/// `--sort-by`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum SortBy {
    /// Most GPU memory first (the default).
    Usage,
    /// Highest share of the limit first (pods without a known limit last).
    Percent,
    /// Most severe state first (Evicting, Over, Near, Within), then usage.
    State,
    /// By namespace, then name.
    Name,
    /// By node, then most GPU memory.
    Node,
    /// By budget, then most GPU memory.
    Budget,
}

/// The limit in bytes of each valid budget, by `(namespace, name)`; a `ClusterGpuMemoryBudget`'s (#23) by
/// `("", "ClusterGpuMemoryBudget/<name>")`, as a pod's record names it in any namespace.
pub fn limits(budgets: &[GpuMemoryBudget], cluster: &[ClusterGpuMemoryBudget]) -> HashMap<(String, String), u64> {
    let namespaced = budgets.iter().filter_map(|b| Budget::compile(b).ok());
    let cluster = cluster.iter().filter_map(|b| Budget::compile_cluster(b).ok());
    namespaced.chain(cluster).map(|b| ((b.namespace.clone(), b.record_name()), b.limit_bytes)).collect()
}

/// One row per pod that carries an agent's record; the limit from `limits` when the budget is known; the
/// usage from `measured` (the nodes' `GpuNodeUsage`, by pod UID) where it lists the pod, else the record's
/// (written at the pod's last state change).
pub fn rows(pods: &[Pod], limits: &HashMap<(String, String), u64>, measured: &HashMap<String, u64>) -> Vec<TopRow> {
    pods.iter()
        .filter_map(|pod| {
            let meta = &pod.metadata;
            let record = PodRecord::from_annotations(meta.annotations.as_ref()?)?;
            let namespace = meta.namespace.clone().unwrap_or_default();
            let scope =
                if record.budget.starts_with(CLUSTER_BUDGET_PREFIX) { String::new() } else { namespace.clone() };
            // A pod held to its declared share has a limit of its own, as its agent recorded it.
            let own = record.share.as_ref().map(|s| s.limit_bytes);
            let limit_bytes = own.or_else(|| limits.get(&(scope, record.budget.to_string())).copied());
            let usage = meta.uid.as_ref().and_then(|uid| measured.get(uid)).copied().unwrap_or(record.usage_bytes);
            Some(TopRow {
                name: meta.name.clone().unwrap_or_default(),
                node: Some(record.node.to_string())
                    .filter(|n| !n.is_empty())
                    .or_else(|| pod.spec.as_ref().and_then(|s| s.node_name.clone())),
                state: record.state,
                usage_bytes: usage,
                usage: HumanBytes(usage).to_string(),
                limit: limit_bytes.map(|l| HumanBytes(l).to_string()),
                percent: limit_bytes.and_then(|l| percent(usage, l)),
                limit_bytes,
                budget: record.budget.to_string(),
                eviction_requested_at: record.eviction_requested_at,
                share: record.share.map(|s| s.note),
                namespace,
            })
        })
        .collect()
}

/// Sorts in place; ties always end on namespace and name, so the order is stable across runs.
pub fn sort(rows: &mut [TopRow], by: SortBy) {
    let name = |r: &TopRow| (r.namespace.clone(), r.name.clone());
    rows.sort_by(|a, b| {
        let first = match by {
            SortBy::Usage => b.usage_bytes.cmp(&a.usage_bytes),
            SortBy::Percent => {
                let key = |r: &TopRow| r.percent.map(|p| (p * 10.0) as i64);
                key(b).cmp(&key(a)).then_with(|| b.usage_bytes.cmp(&a.usage_bytes))
            }
            SortBy::State => b.state.cmp(&a.state).then_with(|| b.usage_bytes.cmp(&a.usage_bytes)),
            SortBy::Name => std::cmp::Ordering::Equal,
            SortBy::Node => a.node.cmp(&b.node).then_with(|| b.usage_bytes.cmp(&a.usage_bytes)),
            SortBy::Budget => a.budget.cmp(&b.budget).then_with(|| b.usage_bytes.cmp(&a.usage_bytes)),
        };
        first.then_with(|| name(a).cmp(&name(b)))
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use gpubudget_common::BudgetState;
    use proptest::prelude::*;

    pub(crate) fn pod(ns: &str, name: &str, record: Option<(&str, u64, &str, &str)>) -> Pod {
        let mut annotations = std::collections::BTreeMap::new();
        if let Some((state, usage, budget, node)) = record {
            annotations = PodRecord {
                state: BudgetState::parse(state).unwrap(),
                usage_bytes: usage,
                budget: budget.into(),
                node: node.into(),
                eviction_requested_at: None,
                cap_not_in_force: None,
                share: None,
                runtime_caps: None,
            }
            .to_annotations();
        }
        serde_json::from_value(serde_json::json!({
            "metadata": {"name": name, "namespace": ns, "annotations": annotations},
            "spec": {"nodeName": "spec-node", "containers": []},
        }))
        .unwrap()
    }

    fn budget(ns: &str, name: &str, limit: &str) -> GpuMemoryBudget {
        serde_yaml::from_str(&format!(
            "apiVersion: gpubudget.io/v1alpha1\nkind: GpuMemoryBudget\nmetadata: {{name: {name}, namespace: {ns}}}\n\
             spec: {{selector: {{}}, limit: {limit}}}\n"
        ))
        .unwrap()
    }

    /// #34: the nodes' `GpuNodeUsage` (by pod UID) gives the usage where it lists the pod; else the record's.
    #[test]
    fn usage_comes_from_the_nodes_objects_where_they_list_the_pod() {
        let mut listed = pod("team-a", "llm-0", Some(("Within", 2 << 30, "llm", "n1")));
        listed.metadata.uid = Some("u-llm".into());
        let mut unlisted = pod("team-a", "llm-1", Some(("Within", 3 << 30, "llm", "n1")));
        unlisted.metadata.uid = Some("u-other".into());
        let measured = HashMap::from([("u-llm".to_owned(), 6u64 << 30)]);
        let rows = rows(&[listed, unlisted], &limits(&[budget("team-a", "llm", "8Gi")], &[]), &measured);
        let got: Vec<(&str, u64, Option<f64>)> =
            rows.iter().map(|r| (r.name.as_str(), r.usage_bytes, r.percent)).collect();
        assert_eq!(got, [("llm-0", 6 << 30, Some(75.0)), ("llm-1", 3 << 30, Some(37.5))]);
        assert_eq!(rows[0].usage, "6Gi");
    }

    fn names(rows: &[TopRow]) -> Vec<&str> {
        rows.iter().map(|r| r.name.as_str()).collect()
    }

    fn fixture() -> Vec<TopRow> {
        let pods = [
            pod("team-a", "llm-0", Some(("Evicting", 9 << 30, "llm", "n1"))),
            pod("team-a", "finetune-0", Some(("Over", 41 << 30, "audit", "n2"))),
            pod("team-a", "web", None),
            pod("team-b", "llm-b-0", Some(("Near", 7_516_192_768, "llm", ""))),
            pod("team-b", "gone-budget", Some(("Within", 1 << 30, "deleted", "n1"))),
        ];
        let budgets =
            [budget("team-a", "llm", "8Gi"), budget("team-a", "audit", "40Gi"), budget("team-b", "llm", "8Gi")];
        rows(&pods, &limits(&budgets, &[]), &HashMap::new())
    }

    #[test]
    fn a_pod_held_to_its_share_shows_its_own_limit_and_how() {
        let mut p = pod("team-a", "kai-0", Some(("Over", 22 << 30, "shares", "n1")));
        let held = gpubudget_common::share::HeldShare::new(
            20 << 30,
            vec![gpubudget_common::share::ShareSource::KaiFraction],
            "KAI gpu-fraction 0.25 of 80Gi = 20Gi".into(),
        );
        let annotations = p.metadata.annotations.get_or_insert_default();
        annotations.insert(gpubudget_common::pod_record::SHARE.into(), held.to_annotation());
        let rows = rows(&[p], &limits(&[budget("team-a", "shares", "80Gi")], &[]), &HashMap::new());
        assert_eq!((rows[0].limit.as_deref(), rows[0].percent), (Some("20Gi"), Some(110.0)));
        assert_eq!(rows[0].share.as_deref(), Some("KAI gpu-fraction 0.25 of 80Gi = 20Gi"));
    }

    #[test]
    fn rows_come_from_records_with_the_named_budgets_limit() {
        let rows = fixture();
        assert_eq!(
            names(&rows),
            ["llm-0", "finetune-0", "llm-b-0", "gone-budget"],
            "a pod without a record is left out"
        );
        assert_eq!((rows[0].limit.as_deref(), rows[0].percent), (Some("8Gi"), Some(112.5)));
        assert_eq!((rows[1].usage.as_str(), rows[1].percent), ("41Gi", Some(102.5)));
        assert_eq!(rows[2].node.as_deref(), Some("spec-node"), "no node in the record: the pod's");
        assert_eq!((rows[2].limit_bytes, rows[2].percent), (Some(8 << 30), Some(87.5)));
        assert_eq!((rows[3].limit.as_deref(), rows[3].percent), (None, None), "its budget is gone");
    }

    #[test]
    fn every_sort_order() {
        let mut rows = fixture();
        let cases = [
            (SortBy::Usage, ["finetune-0", "llm-0", "llm-b-0", "gone-budget"]),
            (SortBy::Percent, ["llm-0", "finetune-0", "llm-b-0", "gone-budget"]),
            (SortBy::State, ["llm-0", "finetune-0", "llm-b-0", "gone-budget"]),
            (SortBy::Name, ["finetune-0", "llm-0", "gone-budget", "llm-b-0"]),
            (SortBy::Node, ["llm-0", "gone-budget", "finetune-0", "llm-b-0"]),
            (SortBy::Budget, ["finetune-0", "gone-budget", "llm-0", "llm-b-0"]),
        ];
        for (by, want) in cases {
            sort(&mut rows, by);
            assert_eq!(names(&rows), want, "{by:?}");
        }
    }

    proptest! {
        #[test]
        fn usage_order_is_descending_and_a_permutation(usages in proptest::collection::vec(0u64..1 << 40, 0..12)) {
            let pods: Vec<Pod> = usages.iter().enumerate()
                .map(|(i, u)| pod("n", &format!("p{i}"), Some(("Within", *u, "b", "n1"))))
                .collect();
            let mut rows = rows(&pods, &HashMap::new(), &HashMap::new());
            sort(&mut rows, SortBy::Usage);
            prop_assert_eq!(rows.len(), usages.len());
            prop_assert!(rows.windows(2).all(|w| w[0].usage_bytes >= w[1].usage_bytes));
        }
    }

    /// #23: a record naming a cluster budget gets that budget's limit, in any namespace.
    #[test]
    fn a_cluster_budgets_limit_is_found_in_every_namespace() {
        let tenants: ClusterGpuMemoryBudget = serde_yaml::from_str(
            "apiVersion: gpubudget.io/v1alpha1\nkind: ClusterGpuMemoryBudget\nmetadata: {name: tenants}\n\
             spec: {namespaceSelector: {}, selector: {}, limit: 16Gi}\n",
        )
        .unwrap();
        let pods = [
            pod("team-b", "q", Some(("Within", 4 << 30, "ClusterGpuMemoryBudget/tenants", "n1"))),
            pod("team-b", "tenants", Some(("Within", 1 << 30, "tenants", "n1"))),
        ];
        let rows = rows(&pods, &limits(&[], std::slice::from_ref(&tenants)), &HashMap::new());
        assert_eq!((rows[0].limit.as_deref(), rows[0].percent), (Some("16Gi"), Some(25.0)));
        assert_eq!(rows[1].limit, None, "a namespaced budget of that name does not exist");
    }
}
