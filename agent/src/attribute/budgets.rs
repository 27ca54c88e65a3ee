//! The budgets as the agent keeps them: compiled once, as the watch delivers them, and kept per namespace (a
//! budget applies to the pods of its own namespace only). An agent watches every budget of the cluster; with
//! 10 000 of them it keeps 10 000 compiled [`Budget`]s, not 10 000 objects, a rebuild of its pod table
//! compiles nothing and resolves each pod among its own namespace's budgets only, and a write that leaves a
//! budget's compiled form as it was (the operator's status writes) does not rebuild the table at all.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use gpubudget_common::{Budget, ClusterGpuMemoryBudget, GpuMemoryBudget, SpecError};
use k8s_openapi::api::core::v1::Namespace;
use kube::runtime::watcher;

/// A budget compiled, or why its spec cannot be enforced.
pub type Compiled = Result<Arc<Budget>, SpecError>;

/// Compiled budgets by namespace, then by name.
#[derive(Debug, Default, Clone, PartialEq)]
pub struct BudgetIndex {
    namespaces: HashMap<String, BTreeMap<String, Compiled>>,
}

impl BudgetIndex {
    /// An index of these budgets.
    pub fn of<'a>(budgets: impl IntoIterator<Item = &'a GpuMemoryBudget>) -> Self {
        let mut index = Self::default();
        for b in budgets {
            index.insert(b);
        }
        index
    }

    /// Compiles and keeps `budget`; whether what is kept changed (a new budget, or one whose spec compiles to
    /// something else). A budget without a name or namespace (a file of `standalone`'s) is kept as invalid
    /// ([`SpecError::Unnamed`]), so that it is reported, never enforced.
    pub fn insert(&mut self, budget: &GpuMemoryBudget) -> bool {
        let (namespace, name) = key(budget);
        let compiled = Budget::compile(budget).map(Arc::new);
        let names = self.namespaces.entry(namespace.to_owned()).or_default();
        match names.get(name) {
            Some(kept) if *kept == compiled => false,
            _ => {
                names.insert(name.to_owned(), compiled);
                true
            }
        }
    }

    /// Forgets `budget`; whether it was kept.
    pub fn remove(&mut self, budget: &GpuMemoryBudget) -> bool {
        let (namespace, name) = key(budget);
        self.remove_named(namespace, name)
    }

    /// Forgets the budget `namespace/name`; whether it was kept.
    pub fn remove_named(&mut self, namespace: &str, name: &str) -> bool {
        let Some(names) = self.namespaces.get_mut(namespace) else { return false };
        let removed = names.remove(name).is_some();
        if names.is_empty() {
            self.namespaces.remove(namespace);
        }
        removed
    }

    /// The valid budgets of `namespace`, by name.
    pub fn valid_in<'a>(&'a self, namespace: &str) -> impl Iterator<Item = &'a Arc<Budget>> + 'a {
        self.namespaces.get(namespace).into_iter().flat_map(|names| names.values().filter_map(|c| c.as_ref().ok()))
    }

    /// Budgets that cannot be enforced, as `namespace/name` with why, sorted.
    pub fn invalid(&self) -> Vec<(String, SpecError)> {
        let mut invalid: Vec<_> = self
            .namespaces
            .iter()
            .flat_map(|(ns, names)| {
                names.iter().filter_map(move |(name, c)| c.as_ref().err().map(|e| (format!("{ns}/{name}"), e.clone())))
            })
            .collect();
        invalid.sort_by(|a, b| a.0.cmp(&b.0));
        invalid
    }

    /// How many budgets are kept, valid or not.
    pub fn len(&self) -> usize {
        self.namespaces.values().map(BTreeMap::len).sum()
    }

    /// No budget is kept.
    pub fn is_empty(&self) -> bool {
        self.namespaces.is_empty()
    }
}

/// Where a budget is kept: its namespace and name, empty when missing.
fn key(budget: &GpuMemoryBudget) -> (&str, &str) {
    (budget.metadata.namespace.as_deref().unwrap_or_default(), budget.metadata.name.as_deref().unwrap_or_default())
}

/// What a watch event changed in the cache.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Change {
    /// Nothing a pod table reads (a status write, a budget already gone, a relist that found the same).
    Nothing,
    /// The budgets of this namespace: a table without pods there is the same.
    In(String),
    /// Anything (a relist that found something else, the first list).
    Everything,
}

impl Change {
    /// What `event` changed, given whether it changed the cache; `namespace` names the namespace an object
    /// is about (a budget's own, a Namespace's name).
    fn of<K>(changed: bool, event: &watcher::Event<K>, namespace: impl Fn(&K) -> &str) -> Self {
        match event {
            _ if !changed => Self::Nothing,
            watcher::Event::Apply(k) | watcher::Event::Delete(k) => Self::In(namespace(k).to_owned()),
            watcher::Event::Init | watcher::Event::InitApply(_) | watcher::Event::InitDone => Self::Everything,
        }
    }
}

/// The agent's budget cache, fed by the budget watch: the index in use, and the one a relist is filling.
#[derive(Debug, Default)]
pub struct BudgetCache {
    index: Relisted<BudgetIndex>,
}

impl BudgetCache {
    /// Applies a watch event; what it changed. A relist (`Init` … `InitDone`) fills a new index and replaces
    /// the live one when it is complete, so budgets deleted while the watch was down are dropped; the live one
    /// serves until then.
    pub fn apply(&mut self, event: &watcher::Event<GpuMemoryBudget>) -> Change {
        let changed =
            self.index.apply(event, |index, b, delete| if delete { index.remove(b) } else { index.insert(b) });
        Change::of(changed, event, |b| key(b).0)
    }

    /// Forgets the budget `namespace/name`, deleted (a metadata watch's deletion: [`super::kube::spec_watch`]).
    pub fn forget(&mut self, namespace: &str, name: &str) -> Change {
        if self.index.live.remove_named(namespace, name) { Change::In(namespace.to_owned()) } else { Change::Nothing }
    }

    /// The first list has been applied.
    pub fn synced(&self) -> bool {
        self.index.synced
    }

    /// The budgets in use.
    pub fn index(&self) -> &BudgetIndex {
        &self.index.live
    }
}

/// Labels by namespace name.
pub type NamespaceLabels = HashMap<String, BTreeMap<String, String>>;

/// What cluster budgets need besides the namespaced ones (#23): the `ClusterGpuMemoryBudget`s, compiled, by
/// name, and the labels of every namespace (their `namespaceSelector` reads them). Both are small: an admin's
/// handful of budgets, and one label map per namespace.
#[derive(Debug, Default, Clone, PartialEq)]
pub struct ClusterIndex {
    budgets: BTreeMap<String, Compiled>,
    namespaces: NamespaceLabels,
}

impl ClusterIndex {
    /// An index of these cluster budgets and namespaces' labels.
    pub fn of<'a>(
        budgets: impl IntoIterator<Item = &'a ClusterGpuMemoryBudget>,
        namespaces: impl IntoIterator<Item = (String, BTreeMap<String, String>)>,
    ) -> Self {
        let mut index = Self { namespaces: namespaces.into_iter().collect(), ..Self::default() };
        for b in budgets {
            ClusterIndex::insert(&mut index.budgets, b);
        }
        index
    }

    /// Compiles and keeps a cluster budget; whether what is kept changed. One without a name is kept as
    /// invalid ([`SpecError::UnnamedCluster`]).
    fn insert(budgets: &mut BTreeMap<String, Compiled>, budget: &ClusterGpuMemoryBudget) -> bool {
        let compiled = Budget::compile_cluster(budget).map(Arc::new);
        let name = budget.key();
        if budgets.get(&name) == Some(&compiled) {
            return false;
        }
        budgets.insert(name, compiled);
        true
    }

    /// The valid cluster budgets, by name.
    pub fn valid(&self) -> impl Iterator<Item = &Arc<Budget>> {
        self.budgets.values().filter_map(|c| c.as_ref().ok())
    }

    /// Cluster budgets that cannot be enforced, by name, with why.
    pub fn invalid(&self) -> Vec<(String, SpecError)> {
        self.budgets.iter().filter_map(|(name, c)| c.as_ref().err().map(|e| (name.clone(), e.clone()))).collect()
    }

    /// The labels of `namespace`; empty when it is not known.
    pub fn labels_of(&self, namespace: &str) -> &BTreeMap<String, String> {
        static NONE: BTreeMap<String, String> = BTreeMap::new();
        self.namespaces.get(namespace).unwrap_or(&NONE)
    }
}

/// A cache fed by one watch: the value in use, and the one a relist is filling (replacing it when the relist
/// is complete, so objects deleted while the watch was down are dropped). `Init` and `InitApply` change
/// nothing in use; `InitDone` changes it when the relist differs, and always the first time.
#[derive(Debug, Default)]
struct Relisted<T> {
    live: T,
    relist: Option<T>,
    synced: bool,
}

impl<T: Default + PartialEq> Relisted<T> {
    /// Applies a watch event with `apply` (whether it changed the value, `true` for a deletion); whether
    /// the live value changed.
    fn apply<K>(&mut self, event: &watcher::Event<K>, apply: impl Fn(&mut T, &K, bool) -> bool) -> bool {
        match event {
            watcher::Event::Init => {
                self.relist = Some(T::default());
                false
            }
            watcher::Event::InitApply(k) => {
                apply(self.relist.get_or_insert_with(T::default), k, false);
                false
            }
            watcher::Event::InitDone => {
                let first = !self.synced;
                self.synced = true;
                let relisted = self.relist.take().unwrap_or_default();
                let changed = relisted != self.live;
                self.live = relisted;
                changed || first
            }
            watcher::Event::Apply(k) => apply(&mut self.live, k, false),
            watcher::Event::Delete(k) => apply(&mut self.live, k, true),
        }
    }
}

/// The agent's cache of cluster budgets and namespace labels, fed by two watches.
#[derive(Debug, Default)]
pub struct ClusterCache {
    budgets: Relisted<BTreeMap<String, Compiled>>,
    namespaces: Relisted<NamespaceLabels>,
    live: ClusterIndex,
}

impl ClusterCache {
    /// Applies a `ClusterGpuMemoryBudget` watch event; whether the pod table must be rebuilt.
    pub fn apply_budget(&mut self, event: &watcher::Event<ClusterGpuMemoryBudget>) -> bool {
        let changed = self.budgets.apply(event, |budgets, b, delete| {
            if delete { budgets.remove(&b.key()).is_some() } else { ClusterIndex::insert(budgets, b) }
        });
        self.refresh(changed)
    }

    /// Forgets the cluster budget `name`, deleted; whether the pod table must be rebuilt.
    pub fn forget_budget(&mut self, name: &str) -> bool {
        let removed = self.budgets.live.remove(name).is_some();
        self.refresh(removed)
    }

    /// Applies a Namespace watch event (its labels only are kept). A namespace's labels are read for the pods
    /// in it only, so a change of one is [`Change::In`] that namespace (a node without pods there has nothing
    /// to rebuild: namespaces come and go cluster-wide).
    pub fn apply_namespace(&mut self, event: &watcher::Event<Namespace>) -> Change {
        let changed = self.namespaces.apply(event, |namespaces, ns, delete| {
            let name = ns.metadata.name.clone().unwrap_or_default();
            if delete {
                return namespaces.remove(&name).is_some();
            }
            let labels = ns.metadata.labels.clone().unwrap_or_default();
            namespaces.insert(name, labels.clone()) != Some(labels)
        });
        Change::of(self.refresh(changed), event, |ns| ns.metadata.name.as_deref().unwrap_or_default())
    }

    /// The cluster budgets' resource is not served (its CRD is not installed): none, and listed, unless a list
    /// came in before; whether that is news.
    pub fn budgets_absent(&mut self) -> bool {
        if self.budgets.synced {
            return false;
        }
        self.budgets.synced = true;
        self.refresh(true)
    }

    fn refresh(&mut self, changed: bool) -> bool {
        if changed {
            self.live = ClusterIndex { budgets: self.budgets.live.clone(), namespaces: self.namespaces.live.clone() };
        }
        changed
    }

    /// Both watches have their first list.
    pub fn synced(&self) -> bool {
        self.budgets.synced && self.namespaces.synced
    }

    /// The cluster budgets and namespace labels in use.
    pub fn index(&self) -> &ClusterIndex {
        &self.live
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use watcher::Event;

    fn budget(ns: &str, name: &str, limit: &str, matched: i32) -> GpuMemoryBudget {
        serde_json::from_value(serde_json::json!({
            "apiVersion": "gpubudget.io/v1alpha1", "kind": "GpuMemoryBudget",
            "metadata": {"name": name, "namespace": ns, "uid": format!("{ns}-{name}")},
            "spec": {"selector": {"matchLabels": {"app": name}}, "limit": limit},
            "status": {"matchedPods": matched},
        }))
        .expect("budget fixture")
    }

    fn names(index: &BudgetIndex, ns: &str) -> Vec<String> {
        index.valid_in(ns).map(|b| b.name.clone()).collect()
    }

    fn changes(cache: &mut BudgetCache, event: Event<GpuMemoryBudget>) -> bool {
        cache.apply(&event) != Change::Nothing
    }

    #[test]
    fn only_what_changes_a_compiled_budget_rebuilds_the_table() {
        let mut cache = BudgetCache::default();
        assert!(!changes(&mut cache, Event::Init));
        assert!(!changes(&mut cache, Event::InitApply(budget("a", "llm", "8Gi", 0))));
        assert!(!cache.synced(), "not before the list is complete");
        assert_eq!(cache.apply(&Event::InitDone), Change::Everything, "the first list");
        assert!(cache.synced());
        assert!(!changes(&mut cache, Event::Apply(budget("a", "llm", "8Gi", 3))), "a status write");
        assert!(!changes(&mut cache, Event::Apply(budget("a", "llm", "8Gi", 4))), "another status write");
        assert_eq!(cache.apply(&Event::Apply(budget("a", "llm", "16Gi", 4))), Change::In("a".into()), "a new limit");
        assert!(
            changes(&mut cache, Event::Apply(budget("a", "llm", "16384Mi", 4))),
            "the same limit written otherwise"
        );
        assert_eq!(cache.apply(&Event::Apply(budget("b", "llm", "8Gi", 0))), Change::In("b".into()), "a new budget");
        assert_eq!(cache.apply(&Event::Delete(budget("b", "llm", "8Gi", 0))), Change::In("b".into()), "a deletion");
        assert!(!changes(&mut cache, Event::Delete(budget("b", "llm", "8Gi", 0))), "a deletion of what is gone");
        assert!(
            changes(&mut cache, Event::Apply(budget("a", "broken", "8 GiB", 0))),
            "an invalid budget is kept, as such"
        );
        let mut unnamed = budget("a", "x", "8Gi", 0);
        unnamed.metadata.namespace = None;
        assert!(changes(&mut cache, Event::Apply(unnamed)), "a budget without a namespace is kept, as invalid");
        assert_eq!(names(cache.index(), "a"), ["llm"]);
        let invalid = cache.index().invalid();
        assert_eq!(invalid.iter().map(|(k, _)| k.as_str()).collect::<Vec<_>>(), ["/x", "a/broken"]);
        assert_eq!(invalid[0].1, SpecError::Unnamed);
        assert_eq!(cache.index().len(), 3);
        assert!(names(cache.index(), "b").is_empty(), "budgets apply in their own namespace only");
    }

    #[test]
    fn a_relist_replaces_the_index_when_complete_and_says_whether_it_changed() {
        let mut cache = BudgetCache::default();
        for e in
            [Event::Init, Event::InitApply(budget("a", "x", "8Gi", 0)), Event::InitApply(budget("a", "y", "8Gi", 0))]
        {
            cache.apply(&e);
        }
        assert_eq!(cache.apply(&Event::InitDone), Change::Everything);
        // The watch restarts: the same budgets (statuses moved) relisted change nothing.
        cache.apply(&Event::Init);
        cache.apply(&Event::InitApply(budget("a", "x", "8Gi", 5)));
        assert_eq!(names(cache.index(), "a"), ["x", "y"], "the live index serves during a relist");
        cache.apply(&Event::InitApply(budget("a", "y", "8Gi", 5)));
        assert_eq!(cache.apply(&Event::InitDone), Change::Nothing, "nothing the table reads changed");
        // y was deleted while the watch was down.
        cache.apply(&Event::Init);
        cache.apply(&Event::InitApply(budget("a", "x", "8Gi", 5)));
        assert_eq!(cache.apply(&Event::InitDone), Change::Everything);
        assert_eq!(names(cache.index(), "a"), ["x"]);
    }

    fn namespace(name: &str, labels: serde_json::Value) -> Namespace {
        serde_json::from_value(serde_json::json!({"metadata": {"name": name, "labels": labels}})).expect("namespace")
    }

    fn cluster_budget(name: &str, limit: &str) -> ClusterGpuMemoryBudget {
        serde_json::from_value(serde_json::json!({
            "apiVersion": "gpubudget.io/v1alpha1", "kind": "ClusterGpuMemoryBudget",
            "metadata": {"name": name},
            "spec": {"namespaceSelector": {"matchLabels": {"tier": "tenant"}}, "selector": {}, "limit": limit},
        }))
        .expect("cluster budget fixture")
    }

    /// #23: cluster budgets and namespace labels rebuild the table when what a pod table reads moves: a new
    /// limit, a namespace's labels; not a namespace written with the same labels.
    #[test]
    fn the_cluster_cache_changes_when_budgets_or_namespace_labels_do() {
        let mut cache = ClusterCache::default();
        assert!(!cache.synced());
        for e in [Event::Init, Event::InitApply(cluster_budget("tenants", "4Gi"))] {
            assert!(!cache.apply_budget(&e));
        }
        assert!(cache.apply_budget(&Event::InitDone), "the first list");
        assert!(!cache.synced(), "namespaces not listed yet");
        assert_eq!(cache.apply_namespace(&Event::Init), Change::Nothing);
        cache.apply_namespace(&Event::InitApply(namespace("a", serde_json::json!({"tier": "tenant"}))));
        assert_eq!(cache.apply_namespace(&Event::InitDone), Change::Everything);
        assert!(cache.synced());
        assert_eq!(cache.index().valid().map(|b| b.key()).collect::<Vec<_>>(), ["tenants"]);
        assert_eq!(cache.index().labels_of("a").get("tier").map(String::as_str), Some("tenant"));
        assert!(cache.index().labels_of("unknown").is_empty());
        let unchanged = cache.apply_namespace(&Event::Apply(namespace("a", serde_json::json!({"tier": "tenant"}))));
        assert_eq!(unchanged, Change::Nothing, "a namespace's status or annotations");
        let relabelled = cache.apply_namespace(&Event::Apply(namespace("a", serde_json::json!({}))));
        assert_eq!(relabelled, Change::In("a".into()), "relabelled: the pods of `a` only");
        assert_eq!(
            cache.apply_namespace(&Event::Delete(namespace("a", serde_json::json!({})))),
            Change::In("a".into())
        );
        assert_eq!(cache.apply_namespace(&Event::Delete(namespace("a", serde_json::json!({})))), Change::Nothing);
        assert!(!cache.apply_budget(&Event::Apply(cluster_budget("tenants", "4Gi"))), "a status write");
        assert!(cache.apply_budget(&Event::Apply(cluster_budget("tenants", "8Gi"))));
        assert!(cache.apply_budget(&Event::Apply(cluster_budget("broken", "8 GiB"))));
        assert_eq!(cache.index().invalid().iter().map(|(k, _)| k.as_str()).collect::<Vec<_>>(), ["broken"]);
        assert!(cache.apply_budget(&Event::Delete(cluster_budget("tenants", "8Gi"))));
        assert_eq!(cache.index().valid().count(), 0);
    }

    proptest! {
        /// Whatever the order of writes, the cache holds what compiling the last write of each budget gives,
        /// and says "changed" exactly when that compiled set moved.
        #[test]
        fn the_cache_is_the_last_write_of_each_budget(
            writes in proptest::collection::vec((0..3usize, 0..3usize, 0..3usize, proptest::bool::ANY), 0..40),
        ) {
            let limits = ["8Gi", "16Gi", "oops"];
            let mut cache = BudgetCache::default();
            cache.apply(&Event::Init);
            cache.apply(&Event::InitDone);
            let mut model: BTreeMap<(String, String), GpuMemoryBudget> = BTreeMap::new();
            for (ns, name, limit, delete) in writes {
                let b = budget(&format!("ns{ns}"), &format!("b{name}"), limits[limit], 0);
                let before = BudgetIndex::of(model.values());
                let key = (format!("ns{ns}"), format!("b{name}"));
                let change = if delete {
                    model.remove(&key);
                    cache.apply(&Event::Delete(b))
                } else {
                    model.insert(key.clone(), b.clone());
                    cache.apply(&Event::Apply(b))
                };
                let after = BudgetIndex::of(model.values());
                prop_assert_eq!(cache.index(), &after);
                let expected = if before == after { Change::Nothing } else { Change::In(key.0) };
                prop_assert_eq!(change, expected);
            }
        }
    }
}
