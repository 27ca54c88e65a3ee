//! The pod ↔ budget index: which budgets select which pods, kept up to date from the two watches, and
//! which budgets a change affects.
//!
//! Every change returns the budgets whose status it can change, so a pod event reconciles those and no
//! others:
//!
//! - a pod whose labels change (or that appears or goes): every budget that selected it before or selects it
//!   now, since matches and the overlap resolution of all of them may change;
//! - a pod whose record only changes (usage, state, eviction): the budget that applies to it (the resolution
//!   is unchanged because the labels are) and the budgets its old and new records name (evictions are
//!   counted for the budget a record names);
//! - a pod event that changes nothing the operator keeps (a status update, another annotation): none;
//! - a budget whose selector or limit changes (or that appears or goes): itself and every budget that shares
//!   a pod with it before or after, since the resolution of those pods may change; any other budget change:
//!   itself only.
//!
//! - `ClusterGpuMemoryBudget`s (#23, keys with an empty namespace, [`ObjKey::cluster`]) select pods of every
//!   namespace whose labels match their `namespaceSelector`. They are few, so the pods they select are not
//!   stored: they are found when asked (a cluster budget's inputs scan the pods of the namespaces it
//!   selects). A change of a cluster budget affects itself and every budget sharing a pod with it before or
//!   after; a namespace relabelled affects the cluster budgets whose selection of its pods changed, and the
//!   budgets of those pods, and no other.
//!
//! Pure and synchronous: the controller holds it behind a lock and feeds it the watch events.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet, VecDeque};
use std::sync::Arc;

use gpubudget_common::{Budget, ClusterGpuMemoryBudget, GpuMemoryBudget, PodLabels, SpecError};

use crate::intern::Pool;
use crate::namespaces::{NamespaceLabels, Relabel};
use crate::pods::{ObjKey, PodInfo, Uid};
use crate::status::{Inputs, Selected};

/// How many deleted, evicted pods are remembered per budget (fewer than `status.countedEvictions` holds, so
/// every remembered one stays in that dedupe list).
pub const TOMBSTONES_MAX: usize = 32;

/// Sorted budget names, shared (see [`Index::budget_sets`]).
type Names = Arc<[Arc<str>]>;

/// Budgets whose status a change may have changed.
pub type Affected = BTreeSet<ObjKey>;

/// The budget keys of a namespace's budget names.
fn keys_in<'a>(namespace: &'a str, names: &'a [Arc<str>]) -> impl Iterator<Item = ObjKey> + 'a {
    names.iter().map(move |name| ObjKey::new(namespace, &**name))
}

#[derive(Debug)]
struct PodEntry {
    info: PodInfo,
    /// Names of the valid budgets (same namespace) whose selector matches the pod, sorted; one copy for the
    /// pods that carry the same labels.
    budgets: Names,
    /// The pod re-list that last listed it ([`Index::begin_pod_resync`]).
    listed_in: u32,
    /// What its node's `GpuNodeUsage` last said it holds (#34), and the usage its record carried as written
    /// then: the measured figure replaces the record's until the agent writes the record with another usage
    /// (a state change, whose usage is then the newer).
    measured: Option<Measured>,
}

/// A pod's usage from its node's object, and its record's own figure at the time.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Measured {
    bytes: u64,
    recorded: u64,
}

impl PodEntry {
    /// Whether the budget `name` of its namespace selects it.
    fn selected_by(&self, name: &str) -> bool {
        self.budgets.binary_search_by(|b| (**b).cmp(name)).is_ok()
    }
}

/// One namespace's budgets and pods (budgets apply only within their namespace).
#[derive(Debug, Default)]
struct Namespace {
    /// Budgets by name, compiled once per change; an invalid spec selects nothing.
    budgets: BTreeMap<Arc<str>, Result<Budget, SpecError>>,
    /// Pods by name. Boxed: a hash table's free slots are as large as its entries, and at 150 pods a
    /// namespace a table of 256 slots is 40 % free.
    pods: HashMap<Arc<str>, Box<PodEntry>>,
}

impl Namespace {
    /// Names of the valid budgets whose selector matches these labels, sorted.
    fn selecting(&self, labels: &BTreeMap<String, String>) -> Vec<Arc<str>> {
        self.budgets
            .iter()
            .filter(|(_, b)| b.as_ref().is_ok_and(|b| b.selector.matches(labels)))
            .map(|(name, _)| name.clone())
            .collect()
    }

    /// The pods the budget `name` of this namespace selects.
    fn selected_by<'a>(&'a self, name: &str) -> impl Iterator<Item = &'a PodEntry> {
        self.pods.values().map(|e| &**e).filter(move |e| e.selected_by(name))
    }

    fn compiled<'a>(&'a self, names: &'a [Arc<str>]) -> Vec<&'a Budget> {
        names.iter().filter_map(|name| self.budgets.get(&**name).and_then(|b| b.as_ref().ok())).collect()
    }
}

/// A pod's namespace and name as the index shares them (no copies).
type SharedKey = (Arc<str>, Arc<str>);

/// The operator's view of budgets and pods. Each pod keeps the names of the budgets of its namespace that
/// select it; the pods a budget selects, or whose record names it, are found by a pass over its namespace's
/// pods (every namespace's for a cluster budget), not kept twice: at 150 000 pods the reverse maps cost more
/// than the pods (docs/performance.md).
#[derive(Debug, Default)]
pub struct Index {
    namespaces: HashMap<String, Namespace>,
    /// The `ClusterGpuMemoryBudget`s by name, compiled once per change; an invalid spec selects nothing.
    cluster: BTreeMap<String, Result<Budget, SpecError>>,
    /// The namespaces' labels, which the cluster budgets select by.
    namespace_labels: NamespaceLabels,
    /// Budget → the last pods deleted with an eviction record naming it: an eviction whose pod is gone
    /// before the budget is reconciled is still counted.
    tombstones: HashMap<ObjKey, VecDeque<PodInfo>>,
    budgets: usize,
    invalid_budgets: usize,
    pods: usize,
    selected_pods: usize,
    budget_resync: Option<HashSet<ObjKey>>,
    cluster_resync: Option<HashSet<String>>,
    /// A pod re-list is under way: pods it has not listed by its end are forgotten.
    pod_resync: bool,
    /// The pod re-lists begun, which each entry records as `listed_in` (a number per pod, not a set of
    /// keys, so a re-list of 150 000 pods costs no memory of its own).
    pod_relists: u32,
    /// One copy of each distinct label set the pods carry.
    label_sets: Pool<BTreeMap<String, String>>,
    /// One copy of each namespace, node and recorded budget name the pods carry.
    names: Pool<str>,
    /// One copy of each list of selecting budgets the pods carry.
    budget_sets: Pool<[Arc<str>]>,
    /// Per node, the pods its last usage object gave a figure above 0 (the index's shared names, about 40 bytes a
    /// pod): one it lists no more (pushed off its `PODS_MAX` list, or back to nothing) has its figure cleared,
    /// not kept.
    holding_by_node: HashMap<Arc<str>, HashSet<SharedKey>>,
}

/// The valid cluster budgets that select a pod of `namespace` (labelled `namespace_labels`) labelled `labels`.
fn cluster_selecting<'a>(
    cluster: &'a BTreeMap<String, Result<Budget, SpecError>>,
    namespace: &str,
    namespace_labels: &BTreeMap<String, String>,
    labels: &BTreeMap<String, String>,
) -> impl Iterator<Item = &'a Budget> {
    let pod = PodLabels::new(namespace, namespace_labels, labels);
    cluster.values().filter_map(|b| b.as_ref().ok()).filter(move |b| b.selects(&pod)).collect::<Vec<_>>().into_iter()
}

/// [`cluster_selecting`]'s keys.
fn cluster_keys(
    cluster: &BTreeMap<String, Result<Budget, SpecError>>,
    namespace: &str,
    namespace_labels: &BTreeMap<String, String>,
    labels: &BTreeMap<String, String>,
) -> Vec<ObjKey> {
    cluster_selecting(cluster, namespace, namespace_labels, labels).map(|b| ObjKey::cluster(&b.name)).collect()
}

/// Whether two readings of a budget select the same pods and resolve the same way, so that no other budget's
/// status changes: same selectors, and equal in every field [`gpubudget_common::resolve`] reads: the limit, every
/// field that governs enforcement (a namespaced budget takes a pod over from a cluster budget only if no looser in
/// any of them; and budgets of one kind selecting a pod tighten each other's rules field by field, which the other
/// budgets' `Overlapping` condition tells) and `warnAtPercent` (the earlier warning is taken the same way).
fn same_matching(a: &Result<Budget, SpecError>, b: &Result<Budget, SpecError>) -> bool {
    match (a, b) {
        (Err(_), Err(_)) => true,
        (Ok(a), Ok(b)) => {
            a.selector == b.selector
                && a.scope == b.scope
                && a.limit_bytes == b.limit_bytes
                && a.no_looser_than(b)
                && b.no_looser_than(a)
                && a.warn_at_percent == b.warn_at_percent
        }
        _ => false,
    }
}

impl Index {
    /// An empty index.
    pub fn new() -> Self {
        Self::default()
    }

    fn prune(&mut self, namespace: &str) {
        if self.namespaces.get(namespace).is_some_and(|ns| ns.budgets.is_empty() && ns.pods.is_empty()) {
            self.namespaces.remove(namespace);
        }
    }

    // ---- budgets -------------------------------------------------------------------------------------

    /// A budget was created or changed (or listed).
    pub fn apply_budget(&mut self, resource: &GpuMemoryBudget) -> Affected {
        let Some(key) = ObjKey::of(&resource.metadata) else { return Affected::new() };
        if let Some(seen) = self.budget_resync.as_mut() {
            seen.insert(key.clone());
        }
        let compiled = Budget::compile(resource);
        let old = self.namespaces.get(&key.namespace).and_then(|ns| ns.budgets.get(key.name.as_str()));
        match old {
            Some(old) => {
                self.invalid_budgets -= usize::from(old.is_err());
                if same_matching(old, &compiled) {
                    self.invalid_budgets += usize::from(compiled.is_err());
                    if let Some(ns) = self.namespaces.get_mut(&key.namespace) {
                        ns.budgets.insert(key.name.as_str().into(), compiled);
                    }
                    return Affected::from([key]);
                }
            }
            None => self.budgets += 1,
        }
        self.invalid_budgets += usize::from(compiled.is_err());
        let mut affected = self.unlink_budget(&key);
        affected.insert(key.clone());
        let ns = self.namespaces.entry(key.namespace.clone()).or_default();
        let name: Arc<str> = match ns.budgets.get_key_value(key.name.as_str()) {
            Some((kept, _)) => kept.clone(),
            None => key.name.as_str().into(),
        };
        if let Ok(budget) = &compiled {
            for entry in ns.pods.values_mut() {
                if !budget.selector.matches(&entry.info.labels) {
                    continue;
                }
                if entry.budgets.is_empty() {
                    self.selected_pods += 1;
                }
                if let Err(at) = entry.budgets.binary_search(&name) {
                    let mut names = entry.budgets.to_vec();
                    names.insert(at, name.clone());
                    entry.budgets = self.budget_sets.intern(names.into());
                }
                affected.extend(keys_in(&key.namespace, &entry.budgets));
                let ns_labels = self.namespace_labels.get(&key.namespace);
                affected.extend(cluster_keys(&self.cluster, &key.namespace, ns_labels, &entry.info.labels));
            }
        }
        ns.budgets.insert(name, compiled);
        affected
    }

    /// A budget was deleted. The budget itself is not in the result (there is nothing left to reconcile).
    pub fn delete_budget(&mut self, key: &ObjKey) -> Affected {
        let mut affected = self.unlink_budget(key);
        affected.remove(key);
        self.tombstones.remove(key);
        if let Some(old) = self.namespaces.get_mut(&key.namespace).and_then(|ns| ns.budgets.remove(key.name.as_str())) {
            self.budgets -= 1;
            self.invalid_budgets -= usize::from(old.is_err());
        }
        self.prune(&key.namespace);
        affected
    }

    /// Removes a budget from the pods it selected; returns every budget that selected one of them.
    fn unlink_budget(&mut self, key: &ObjKey) -> Affected {
        let mut affected = Affected::new();
        let Some(ns) = self.namespaces.get_mut(&key.namespace) else { return affected };
        for entry in ns.pods.values_mut().filter(|e| e.selected_by(&key.name)) {
            affected.extend(keys_in(&key.namespace, &entry.budgets));
            let ns_labels = self.namespace_labels.get(&key.namespace);
            affected.extend(cluster_keys(&self.cluster, &key.namespace, ns_labels, &entry.info.labels));
            let mut names = entry.budgets.to_vec();
            names.retain(|b| **b != *key.name);
            entry.budgets = self.budget_sets.intern(names.into());
            if entry.budgets.is_empty() {
                self.selected_pods -= 1;
            }
        }
        affected
    }

    /// A re-list of the budgets begins: budgets not seen before [`Index::end_budget_resync`] are deleted then.
    pub fn begin_budget_resync(&mut self) {
        self.budget_resync = Some(HashSet::new());
    }

    /// A re-list of the budgets ended: forgets those it did not list.
    pub fn end_budget_resync(&mut self) -> Affected {
        let Some(seen) = self.budget_resync.take() else { return Affected::new() };
        let gone: Vec<ObjKey> = self
            .namespaces
            .iter()
            .flat_map(|(ns, n)| n.budgets.keys().map(move |name| ObjKey::new(ns, &**name)))
            .filter(|k| !seen.contains(k))
            .collect();
        let mut affected = Affected::new();
        for key in &gone {
            affected.extend(self.delete_budget(key));
        }
        for key in &gone {
            affected.remove(key);
        }
        affected
    }

    // ---- cluster budgets and namespaces (#23) --------------------------------------------------------

    /// The valid cluster budget `name`, if any.
    fn cluster_budget(&self, name: &str) -> Option<&Budget> {
        self.cluster.get(name).and_then(|b| b.as_ref().ok())
    }

    /// The pods the valid cluster budget `name` selects (none for an unknown or invalid one).
    fn cluster_pods<'a>(&'a self, name: &str) -> Vec<&'a PodEntry> {
        let Some(budget) = self.cluster_budget(name) else { return Vec::new() };
        self.namespaces
            .iter()
            .flat_map(|(namespace, ns)| {
                let ns_labels = self.namespace_labels.get(namespace);
                ns.pods
                    .values()
                    .map(|e| &**e)
                    .filter(move |e| budget.selects(&PodLabels::new(namespace, ns_labels, &e.info.labels)))
            })
            .collect()
    }

    /// Every budget (namespaced or cluster) selecting a pod that the cluster budget `name` selects.
    fn sharing_cluster(&self, name: &str) -> Affected {
        let mut affected = Affected::new();
        for entry in self.cluster_pods(name) {
            affected.extend(self.selecting_entry(&entry.info.namespace, entry));
        }
        affected
    }

    /// Every budget selecting a pod: those of its namespace, then the cluster ones.
    fn selecting_entry(&self, namespace: &str, entry: &PodEntry) -> Vec<ObjKey> {
        let ns_labels = self.namespace_labels.get(namespace);
        let mut keys: Vec<ObjKey> = keys_in(namespace, &entry.budgets).collect();
        keys.extend(cluster_keys(&self.cluster, namespace, ns_labels, &entry.info.labels));
        keys
    }

    /// A `ClusterGpuMemoryBudget` was created or changed (or listed).
    pub fn apply_cluster_budget(&mut self, resource: &ClusterGpuMemoryBudget) -> Affected {
        let Some(key) = ObjKey::of_cluster(&resource.metadata) else { return Affected::new() };
        if let Some(seen) = self.cluster_resync.as_mut() {
            seen.insert(key.name.clone());
        }
        let compiled = Budget::compile_cluster(resource);
        match self.cluster.get(&key.name) {
            Some(old) => {
                self.invalid_budgets -= usize::from(old.is_err());
                if same_matching(old, &compiled) {
                    self.invalid_budgets += usize::from(compiled.is_err());
                    self.cluster.insert(key.name.clone(), compiled);
                    return Affected::from([key]);
                }
            }
            None => self.budgets += 1,
        }
        self.invalid_budgets += usize::from(compiled.is_err());
        let mut affected = self.sharing_cluster(&key.name);
        self.cluster.insert(key.name.clone(), compiled);
        affected.extend(self.sharing_cluster(&key.name));
        affected.insert(key);
        affected
    }

    /// A `ClusterGpuMemoryBudget` was deleted. The budget itself is not in the result.
    pub fn delete_cluster_budget(&mut self, name: &str) -> Affected {
        let key = ObjKey::cluster(name);
        let mut affected = self.sharing_cluster(name);
        self.tombstones.remove(&key);
        if let Some(old) = self.cluster.remove(name) {
            self.budgets -= 1;
            self.invalid_budgets -= usize::from(old.is_err());
        }
        affected.remove(&key);
        affected
    }

    /// A re-list of the cluster budgets begins.
    pub fn begin_cluster_resync(&mut self) {
        self.cluster_resync = Some(HashSet::new());
    }

    /// A re-list of the cluster budgets ended: forgets those it did not list.
    pub fn end_cluster_resync(&mut self) -> Affected {
        let Some(seen) = self.cluster_resync.take() else { return Affected::new() };
        let gone: Vec<String> = self.cluster.keys().filter(|n| !seen.contains(*n)).cloned().collect();
        let mut affected = Affected::new();
        for name in &gone {
            affected.extend(self.delete_cluster_budget(name));
        }
        for name in &gone {
            affected.remove(&ObjKey::cluster(name));
        }
        affected
    }

    /// A namespace event (see [`crate::namespaces::events`]): the budgets whose status its relabels may
    /// change. For each pod of a relabelled namespace whose selecting cluster budgets differ before and
    /// after: those cluster budgets and the pod's namespaced budgets (its resolution and their overlaps may
    /// change). A relabel that changes no cluster budget's selection affects nothing.
    pub fn apply_namespace_event(
        &mut self,
        event: &kube::runtime::watcher::Event<kube::core::PartialObjectMeta<k8s_openapi::api::core::v1::Namespace>>,
    ) -> Affected {
        let relabels = self.namespace_labels.apply_event(event);
        self.relabelled(&relabels)
    }

    /// A namespace's labels were set (as [`Index::apply_namespace_event`], for tests and fixtures).
    pub fn set_namespace_labels(&mut self, namespace: &str, labels: BTreeMap<String, String>) -> Affected {
        let relabels: Vec<Relabel> = self.namespace_labels.apply(namespace, labels).into_iter().collect();
        self.relabelled(&relabels)
    }

    fn relabelled(&self, relabels: &[Relabel]) -> Affected {
        let mut affected = Affected::new();
        for relabel in relabels {
            let Some(ns) = self.namespaces.get(&relabel.namespace) else { continue };
            for entry in ns.pods.values() {
                let labels = &entry.info.labels;
                let before = cluster_keys(&self.cluster, &relabel.namespace, &relabel.before, labels);
                let after = cluster_keys(&self.cluster, &relabel.namespace, &relabel.after, labels);
                if before != after {
                    affected.extend(before.into_iter().chain(after));
                    affected.extend(keys_in(&relabel.namespace, &entry.budgets));
                }
            }
        }
        affected
    }

    /// The labels of a namespace, as last watched (empty when unknown).
    pub fn namespace_labels(&self, namespace: &str) -> &BTreeMap<String, String> {
        self.namespace_labels.get(namespace)
    }

    /// Whether the namespace watch has listed once.
    pub fn namespaces_listed(&self) -> bool {
        self.namespace_labels.listed()
    }

    // ---- pods ----------------------------------------------------------------------------------------

    /// A pod was created or changed (or listed).
    pub fn apply_pod(&mut self, mut info: PodInfo) -> Affected {
        let key = info.key();
        self.share(&mut info);
        let listed_in = self.pod_relists;
        let mut affected = Affected::new();
        let ns = self.namespaces.entry(key.namespace.clone()).or_default();
        if let Some((name, _)) = ns.pods.get_key_value(&*info.name) {
            // The map's key and the entry share the name.
            info.name = name.clone();
        }
        // The node's figure is kept while the record names the same node (the one whose object measured it) and
        // carries the usage it carried then: a record written since (a state change) has the newer figure.
        let measured = ns.pods.get(&*info.name).and_then(|entry| {
            let m = entry.measured?;
            let (Some(old), Some(new)) = (&entry.info.record, &info.record) else { return None };
            (entry.info.uid == info.uid && old.node == new.node && new.usage_bytes == m.recorded).then_some(m)
        });
        if let (Some(m), Some(record)) = (measured, info.record.as_mut()) {
            record.usage_bytes = m.bytes;
        }
        let (labels_same, old_record_budget) = match ns.pods.get_mut(&*info.name) {
            Some(entry) if entry.info == info => {
                entry.listed_in = listed_in;
                return affected;
            }
            Some(entry) => (entry.info.labels == info.labels, entry.info.recorded_budget()),
            None => (false, None),
        };
        if !labels_same {
            // The cluster budgets selecting it before and now (their matches and overlaps may change).
            let ns_labels = self.namespace_labels.get(&key.namespace);
            if let Some(entry) = ns.pods.get(key.name.as_str()) {
                affected.extend(cluster_keys(&self.cluster, &key.namespace, ns_labels, &entry.info.labels));
            }
            affected.extend(cluster_keys(&self.cluster, &key.namespace, ns_labels, &info.labels));
        }
        let new_record_budget = info.recorded_budget();
        affected.extend(old_record_budget);
        affected.extend(new_record_budget);

        if labels_same {
            // Same labels: same selecting budgets, same resolution. Only the budget that applies (and the
            // recorded ones, above) can see a difference.
            if let Some(entry) = ns.pods.get_mut(key.name.as_str()) {
                entry.info = info;
                entry.listed_in = listed_in;
                entry.measured = measured;
            }
            affected.extend(self.resolved(&key));
            return affected;
        }

        let new_budgets = self.budget_sets.intern(ns.selecting(&info.labels).into());
        let old_budgets = match ns.pods.get(key.name.as_str()) {
            Some(entry) => entry.budgets.clone(),
            None => {
                self.pods += 1;
                Names::default()
            }
        };
        affected.extend(keys_in(&key.namespace, &old_budgets).chain(keys_in(&key.namespace, &new_budgets)));
        if old_budgets.is_empty() != new_budgets.is_empty() {
            if new_budgets.is_empty() {
                self.selected_pods -= 1;
            } else {
                self.selected_pods += 1;
            }
        }
        ns.pods.insert(info.name.clone(), Box::new(PodEntry { info, budgets: new_budgets, listed_in, measured }));
        affected
    }

    /// The pod with what other pods carry alike replaced by the copies kept for all of them.
    fn share(&mut self, info: &mut PodInfo) {
        self.label_sets.share(&mut info.labels);
        self.names.share(&mut info.namespace);
        if let Some(record) = &mut info.record {
            self.names.share(&mut record.budget);
            self.names.share(&mut record.node);
        }
    }

    /// `node`'s `GpuNodeUsage` was written (or listed): each listed pod of the index with that UID and a record
    /// written by that node's agent holds what it says (an agent cannot speak for another node's pods: its
    /// record writes are held to its node, its usage object is not read for any other); the budgets whose
    /// status reads a pod's usage (the one that applies, the recorded one) are affected where it moved. A pod
    /// without such a record yet keeps the usage its record carries (that of its last write).
    pub fn apply_node_usage(&mut self, node: &str, pods: &[gpubudget_common::NodePodUsage]) -> Affected {
        let mut affected = Affected::new();
        // The pods this object gives a figure above 0, by the index's own shared names (no copies).
        let mut holding: HashSet<SharedKey> = HashSet::new();
        for pod in pods {
            let bytes = u64::try_from(pod.usage_bytes).unwrap_or(0);
            let Some(entry) =
                self.namespaces.get_mut(pod.namespace.as_str()).and_then(|ns| ns.pods.get_mut(pod.name.as_str()))
            else {
                continue;
            };
            if entry.info.uid != Uid::from(pod.uid.as_str()) {
                continue;
            }
            let Some(record) = entry.info.record.as_mut().filter(|r| &*r.node == node) else { continue };
            if bytes > 0 {
                holding.insert((entry.info.namespace.clone(), entry.info.name.clone()));
            }
            // The record's own figure: the one it carried when measured before, else the one it carries.
            let recorded = entry.measured.map_or(record.usage_bytes, |m| m.recorded);
            entry.measured = Some(Measured { bytes, recorded });
            if record.usage_bytes == bytes {
                continue;
            }
            record.usage_bytes = bytes;
            affected.extend(entry.info.recorded_budget());
            let key = ObjKey::new(&pod.namespace, &pod.name);
            affected.extend(self.resolved(&key));
        }
        // Holding memory by the node's last object, not listed now (pushed off its list, or back to nothing):
        // its figure is no longer this node's to give; cleared (0), so namespace totals never count it stale.
        let before = self.holding_by_node.remove(node).unwrap_or_default();
        for (namespace, name) in before.difference(&holding) {
            let Some(entry) = self.namespaces.get_mut(&**namespace).and_then(|ns| ns.pods.get_mut(&**name)) else {
                continue;
            };
            let Some(record) = entry.info.record.as_mut().filter(|r| &*r.node == node) else { continue };
            if entry.measured.is_none() || record.usage_bytes == 0 {
                continue;
            }
            let recorded = entry.measured.map_or(record.usage_bytes, |m| m.recorded);
            entry.measured = Some(Measured { bytes: 0, recorded });
            record.usage_bytes = 0;
            affected.extend(entry.info.recorded_budget());
            affected.extend(self.resolved(&ObjKey::new(&**namespace, &**name)));
        }
        if !holding.is_empty() {
            self.holding_by_node.insert(Arc::from(node), holding);
        }
        affected
    }

    /// A pod was deleted (or stopped matching the watch).
    pub fn delete_pod(&mut self, key: &ObjKey) -> Affected {
        let mut affected = Affected::new();
        let Some(entry) = self.namespaces.get_mut(&key.namespace).and_then(|ns| ns.pods.remove(key.name.as_str()))
        else {
            return affected;
        };
        self.pods -= 1;
        self.prune(&key.namespace);
        affected.extend(keys_in(&key.namespace, &entry.budgets));
        if !entry.budgets.is_empty() {
            self.selected_pods -= 1;
        }
        let ns_labels = self.namespace_labels.get(&key.namespace);
        affected.extend(cluster_keys(&self.cluster, &key.namespace, ns_labels, &entry.info.labels));
        if let Some(recorded) = entry.info.recorded_budget() {
            if entry.info.record.as_ref().is_some_and(|r| r.eviction_requested_at.is_some()) {
                let tombstones = self.tombstones.entry(recorded.clone()).or_default();
                let mut gone = entry.info;
                gone.terminating = true;
                tombstones.push_back(gone);
                if tombstones.len() > TOMBSTONES_MAX {
                    tombstones.pop_front();
                }
            }
            affected.insert(recorded);
        }
        affected
    }

    /// A re-list of the pods begins.
    pub fn begin_pod_resync(&mut self) {
        self.pod_relists = self.pod_relists.wrapping_add(1);
        self.pod_resync = true;
    }

    /// A re-list of the pods ended: forgets those it did not list.
    pub fn end_pod_resync(&mut self) -> Affected {
        if !std::mem::take(&mut self.pod_resync) {
            return Affected::new();
        }
        let relist = self.pod_relists;
        let gone: Vec<ObjKey> = self
            .namespaces
            .iter()
            .flat_map(|(ns, n)| {
                n.pods.iter().filter(|(_, e)| e.listed_in != relist).map(move |(name, _)| ObjKey::new(ns, &**name))
            })
            .collect();
        let mut affected = Affected::new();
        for key in &gone {
            affected.extend(self.delete_pod(key));
        }
        affected
    }

    // ---- queries -------------------------------------------------------------------------------------

    /// Every valid budget selecting a pod: those of its namespace, then the cluster ones.
    fn compiled_for<'a>(&'a self, namespace: &str, ns: &'a Namespace, entry: &'a PodEntry) -> Vec<&'a Budget> {
        let ns_labels = self.namespace_labels.get(namespace);
        let mut budgets = ns.compiled(&entry.budgets);
        budgets.extend(cluster_selecting(&self.cluster, namespace, ns_labels, &entry.info.labels));
        budgets
    }

    /// The budget that applies to a pod (by the common resolution rule, cluster budgets included), if any
    /// selects it.
    pub fn resolved(&self, pod: &ObjKey) -> Option<ObjKey> {
        let ns = self.namespaces.get(&pod.namespace)?;
        let entry = ns.pods.get(pod.name.as_str())?;
        let pod_labels = PodLabels::new(&pod.namespace, self.namespace_labels.get(&pod.namespace), &entry.info.labels);
        let resolution = gpubudget_common::resolve(self.compiled_for(&pod.namespace, ns, entry), &pod_labels)?;
        Some(budget_key(&pod.namespace, resolution.budget))
    }

    /// The budgets whose selectors match a pod: its namespace's (sorted), then the cluster ones (sorted);
    /// empty for an unknown pod.
    pub fn budgets_selecting(&self, pod: &ObjKey) -> Vec<ObjKey> {
        self.namespaces
            .get(&pod.namespace)
            .and_then(|ns| ns.pods.get(pod.name.as_str()))
            .map(|e| self.selecting_entry(&pod.namespace, e))
            .unwrap_or_default()
    }

    /// The pods a budget's selectors match (sorted): names for a namespaced budget, `namespace/name` for a
    /// cluster one.
    pub fn pods_selected_by(&self, budget: &ObjKey) -> Vec<String> {
        let mut names: Vec<String> = if budget.is_cluster() {
            self.cluster_pods(&budget.name).iter().map(|e| e.info.key().to_string()).collect()
        } else {
            self.namespaces
                .get(&budget.namespace)
                .into_iter()
                .flat_map(|ns| ns.selected_by(&budget.name))
                .map(|entry| entry.info.name.to_string())
                .collect()
        };
        names.sort();
        names
    }

    /// What the status computation of a budget reads: the pods it selects (each with every budget that
    /// selects it) and the pods whose record names it (live ones, then the remembered deleted ones).
    pub fn inputs(&self, budget: &ObjKey) -> Inputs<'_> {
        // A namespaced budget is recorded only by pods of its namespace; a cluster budget by any.
        let namespaces: Vec<&Namespace> = if budget.is_cluster() {
            self.namespaces.values().collect()
        } else {
            self.namespaces.get(&budget.namespace).into_iter().collect()
        };
        let recorded = namespaces
            .into_iter()
            .flat_map(|ns| ns.pods.values())
            .map(|e| &e.info)
            .filter(|p| p.records(budget))
            .chain(self.tombstones.get(budget).into_iter().flatten())
            .collect();
        if budget.is_cluster() {
            let selected = self
                .cluster_pods(&budget.name)
                .into_iter()
                .filter_map(|entry| {
                    let namespace = &*entry.info.namespace;
                    let ns = self.namespaces.get(namespace)?;
                    Some(Selected {
                        pod: &entry.info,
                        namespace_labels: self.namespace_labels.get(namespace),
                        selected_by: self.compiled_for(namespace, ns, entry),
                    })
                })
                .collect();
            return Inputs {
                spec: self.cluster.get(&budget.name).map(Result::as_ref),
                selected,
                recorded,
                nodes: None,
            };
        }
        let Some(ns) = self.namespaces.get(&budget.namespace) else {
            return Inputs { spec: None, selected: Vec::new(), recorded, nodes: None };
        };
        let namespace_labels = self.namespace_labels.get(&budget.namespace);
        let selected = ns
            .selected_by(&budget.name)
            .map(|entry| Selected {
                pod: &entry.info,
                namespace_labels,
                selected_by: self.compiled_for(&budget.namespace, ns, entry),
            })
            .collect();
        Inputs { spec: ns.budgets.get(budget.name.as_str()).map(Result::as_ref), selected, recorded, nodes: None }
    }

    /// The valid budgets a pod of `namespace` may get: the namespace's, then every valid cluster budget
    /// (each still selects by the namespace's labels and the pod's), and the namespace's labels (cloned: the
    /// admission webhook resolves a new pod against them without holding the index's lock).
    pub fn budgets_in(&self, namespace: &str) -> (Vec<Budget>, BTreeMap<String, String>) {
        let mut budgets: Vec<Budget> = self
            .namespaces
            .get(namespace)
            .map(|ns| ns.budgets.values().filter_map(|b| b.as_ref().ok()).cloned().collect())
            .unwrap_or_default();
        budgets.extend(self.cluster.values().filter_map(|b| b.as_ref().ok()).cloned());
        (budgets, self.namespace_labels.get(namespace).clone())
    }

    /// Namespaces holding at least one valid budget with `admissionCaps: Enabled`, and the namespaces whose
    /// labels a valid cluster budget with it selects by its `namespaceSelector`: those the caps webhook is
    /// scoped to.
    pub fn caps_namespaces(&self) -> BTreeSet<String> {
        let mut out: BTreeSet<String> = self
            .namespaces
            .iter()
            .filter(|(_, ns)| ns.budgets.values().any(|b| b.as_ref().is_ok_and(|b| b.admission_caps)))
            .map(|(name, _)| name.clone())
            .collect();
        for budget in self.cluster.values().filter_map(|b| b.as_ref().ok()).filter(|b| b.admission_caps) {
            let gpubudget_common::budget::Scope::Cluster { namespaces } = &budget.scope else { continue };
            out.extend(self.namespace_labels.iter().filter(|(_, l)| namespaces.matches(l)).map(|(n, _)| n.to_owned()));
        }
        out
    }

    /// Every namespace's pods (what namespace totals add up).
    pub fn pods_by_namespace(&self) -> impl Iterator<Item = (&str, impl Iterator<Item = &PodInfo>)> {
        self.namespaces.iter().map(|(name, ns)| (name.as_str(), ns.pods.values().map(|e| &e.info)))
    }

    /// Budgets known (valid or not).
    pub fn budget_count(&self) -> usize {
        self.budgets
    }

    /// Budgets whose spec is invalid.
    pub fn invalid_budget_count(&self) -> usize {
        self.invalid_budgets
    }

    /// Pods known.
    pub fn pod_count(&self) -> usize {
        self.pods
    }

    /// Pods selected by at least one valid budget.
    pub fn selected_pod_count(&self) -> usize {
        self.selected_pods
    }
}

/// The key of a budget that selects a pod of `namespace`.
fn budget_key(namespace: &str, budget: &Budget) -> ObjKey {
    if budget.is_cluster() { ObjKey::cluster(&budget.name) } else { ObjKey::new(namespace, &budget.name) }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::*;
    use gpubudget_common::BudgetState;
    use gpubudget_common::pod_record::PodRecord;

    pub(crate) fn budget(ns: &str, name: &str, limit: &str, selector: &str) -> GpuMemoryBudget {
        serde_yaml::from_str(&format!(
            "apiVersion: gpubudget.io/v1alpha1\nkind: GpuMemoryBudget\nmetadata: {{name: {name}, namespace: {ns}}}\n\
             spec: {{selector: {selector}, limit: {limit}}}\n"
        ))
        .expect("fixture parses")
    }

    fn pod(ns: &str, name: &str, labels: &[(&str, &str)]) -> PodInfo {
        PodInfo {
            namespace: ns.into(),
            name: name.into(),
            uid: format!("uid-{name}").as_str().into(),
            labels: Arc::new(labels.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned())).collect()),
            record: None,
            terminating: false,
            caps: gpubudget_common::caps::PodCaps::NoGpu,
            started_ms: None,
            exempt: None,
            grace_seconds: None,
        }
    }

    fn keys(names: &[&str]) -> Affected {
        names.iter().map(|n| ObjKey::new("a", *n)).collect()
    }

    fn fixture() -> Index {
        let mut index = Index::new();
        index.apply_budget(&budget("a", "llm", "8Gi", "{matchLabels: {app: llm}}"));
        index.apply_budget(&budget("a", "wide", "16Gi", "{}"));
        index.apply_budget(&budget("a", "web", "1Gi", "{matchLabels: {app: web}}"));
        index.apply_budget(&budget("b", "other", "1Gi", "{}"));
        index
    }

    #[test]
    fn a_new_pod_affects_exactly_the_budgets_selecting_it() {
        let mut index = fixture();
        assert_eq!(index.apply_pod(pod("a", "p1", &[("app", "llm")])), keys(&["llm", "wide"]));
        assert_eq!(index.apply_pod(pod("a", "p2", &[("app", "batch")])), keys(&["wide"]));
        assert_eq!(index.budgets_selecting(&ObjKey::new("a", "p1")), Vec::from_iter(keys(&["llm", "wide"])));
        assert_eq!(index.resolved(&ObjKey::new("a", "p1")), Some(ObjKey::new("a", "llm")));
        assert_eq!(index.pods_selected_by(&ObjKey::new("a", "wide")), ["p1", "p2"]);
        assert_eq!(index.selected_pod_count(), 2);
        assert!(index.pods_selected_by(&ObjKey::new("b", "other")).is_empty(), "namespaced");
    }

    #[test]
    fn a_label_change_affects_the_budgets_before_and_after() {
        let mut index = fixture();
        index.apply_pod(pod("a", "p1", &[("app", "llm")]));
        let affected = index.apply_pod(pod("a", "p1", &[("app", "web")]));
        assert_eq!(affected, keys(&["llm", "web", "wide"]));
        assert!(index.pods_selected_by(&ObjKey::new("a", "llm")).is_empty());
        assert_eq!(index.pods_selected_by(&ObjKey::new("a", "web")), ["p1"]);
        assert_eq!(index.resolved(&ObjKey::new("a", "p1")), Some(ObjKey::new("a", "web")));
    }

    /// #34: usage comes from the node's `GpuNodeUsage` for pods whose record that node's agent wrote; a record
    /// rewritten since with another usage is the newer figure; a pod update that leaves the record keeps it.
    #[test]
    fn node_usage_replaces_the_records_figure_until_the_record_is_rewritten() {
        use gpubudget_common::NodePodUsage;
        let mut index = fixture();
        let mut p = pod("a", "p1", &[("app", "llm")]);
        p.record = Some(PodRecord {
            state: BudgetState::Within,
            usage_bytes: 2 << 30,
            budget: "llm".into(),
            node: "n1".into(),
            eviction_requested_at: None,
            cap_not_in_force: None,
            share: None,
            runtime_caps: None,
        });
        index.apply_pod(p.clone());
        let usage = |bytes: u64, uid: &str| NodePodUsage {
            namespace: "a".into(),
            name: "p1".into(),
            uid: uid.into(),
            usage_bytes: i64::try_from(bytes).expect("bytes"),
        };
        let held = |index: &Index| {
            index
                .inputs(&ObjKey::new("a", "llm"))
                .selected
                .iter()
                .find_map(|s| s.pod.record.as_ref())
                .map(|r| r.usage_bytes)
        };
        assert_eq!(index.apply_node_usage("n2", &[usage(5 << 30, "uid-p1")]), Affected::new(), "another node's");
        assert_eq!(index.apply_node_usage("n1", &[usage(5 << 30, "uid-other")]), Affected::new(), "another pod's");
        assert_eq!(held(&index), Some(2 << 30));
        assert_eq!(index.apply_node_usage("n1", &[usage(5 << 30, "uid-p1")]), keys(&["llm"]));
        assert_eq!(held(&index), Some(5 << 30));
        assert!(index.apply_node_usage("n1", &[usage(5 << 30, "uid-p1")]).is_empty(), "unchanged");
        // The pod changes otherwise (its record as written, 2Gi): the node's figure stays.
        p.terminating = true;
        index.apply_pod(p.clone());
        assert_eq!(held(&index), Some(5 << 30));
        // The agent rewrites the record (Over, 9Gi): that is the newer figure.
        if let Some(r) = p.record.as_mut() {
            (r.state, r.usage_bytes) = (BudgetState::Over, 9 << 30);
        }
        assert_eq!(index.apply_pod(p.clone()), keys(&["llm"]));
        assert_eq!(held(&index), Some(9 << 30));
        assert_eq!(index.apply_node_usage("n1", &[usage(10 << 30, "uid-p1")]), keys(&["llm"]));
        assert_eq!(held(&index), Some(10 << 30));
        // Off the node's list (pushed off its 1 000 pods, or back to nothing): the figure is cleared, never kept.
        assert_eq!(index.apply_node_usage("n1", &[]), keys(&["llm"]));
        assert_eq!(held(&index), Some(0));
        assert!(index.apply_node_usage("n1", &[]).is_empty(), "cleared once");
        assert_eq!(index.apply_node_usage("n1", &[usage(3 << 30, "uid-p1")]), keys(&["llm"]));
        assert_eq!(held(&index), Some(3 << 30));
        // Another node's list never clears it.
        assert!(index.apply_node_usage("n2", &[]).is_empty());
        assert_eq!(held(&index), Some(3 << 30));
    }

    #[test]
    fn a_record_change_affects_only_the_budget_that_applies_and_the_recorded_ones() {
        let mut index = fixture();
        let mut p = pod("a", "p1", &[("app", "llm")]);
        index.apply_pod(p.clone());
        assert!(index.apply_pod(p.clone()).is_empty(), "nothing kept changed");
        p.record = Some(PodRecord {
            state: BudgetState::Near,
            usage_bytes: 7 << 30,
            budget: "llm".into(),
            node: "n1".into(),
            eviction_requested_at: None,
            cap_not_in_force: None,
            share: None,
            runtime_caps: None,
        });
        assert_eq!(index.apply_pod(p.clone()), keys(&["llm"]), "wide selects it too but does not apply");
        // A stale record naming another budget: that one is affected as well (it counts the evictions).
        if let Some(r) = p.record.as_mut() {
            r.budget = "wide".into();
        }
        assert_eq!(index.apply_pod(p.clone()), keys(&["llm", "wide"]));
        assert_eq!(index.inputs(&ObjKey::new("a", "wide")).recorded.len(), 1);
        assert_eq!(index.inputs(&ObjKey::new("a", "llm")).recorded.len(), 0);
        assert_eq!(index.delete_pod(&ObjKey::new("a", "p1")), keys(&["llm", "wide"]));
        assert!(index.inputs(&ObjKey::new("a", "wide")).recorded.is_empty());
        assert_eq!(index.selected_pod_count(), 0);
    }

    #[test]
    fn evicted_pods_that_go_are_remembered() {
        let mut index = fixture();
        let mut p = pod("a", "p1", &[("app", "llm")]);
        p.record = Some(PodRecord {
            state: BudgetState::Evicting,
            usage_bytes: 9 << 30,
            budget: "llm".into(),
            node: "n1".into(),
            eviction_requested_at: Some("2027-01-15T08:00:00Z".into()),
            cap_not_in_force: None,
            share: None,
            runtime_caps: None,
        });
        index.apply_pod(p);
        index.apply_pod(pod("a", "p2", &[("app", "llm")]));
        assert_eq!(index.delete_pod(&ObjKey::new("a", "p1")), keys(&["llm", "wide"]));
        index.delete_pod(&ObjKey::new("a", "p2"));
        let inputs = index.inputs(&ObjKey::new("a", "llm"));
        assert_eq!(inputs.recorded.iter().map(|p| &*p.name).collect::<Vec<_>>(), ["p1"]);
        assert!(inputs.selected.is_empty());
        for i in 0..TOMBSTONES_MAX + 5 {
            let mut q = pod("a", &format!("q{i}"), &[]);
            q.record = Some(PodRecord {
                state: BudgetState::Evicting,
                usage_bytes: 1,
                budget: "llm".into(),
                node: "n1".into(),
                eviction_requested_at: Some("2027-01-15T09:00:00Z".into()),
                cap_not_in_force: None,
                share: None,
                runtime_caps: None,
            });
            index.apply_pod(q);
            index.delete_pod(&ObjKey::new("a", format!("q{i}")));
        }
        assert_eq!(index.inputs(&ObjKey::new("a", "llm")).recorded.len(), TOMBSTONES_MAX);
        index.delete_budget(&ObjKey::new("a", "llm"));
        assert!(index.inputs(&ObjKey::new("a", "llm")).recorded.is_empty(), "a new budget of that name starts afresh");
    }

    #[test]
    fn a_pod_nobody_selects_affects_nothing() {
        let mut index = Index::new();
        index.apply_budget(&budget("a", "llm", "8Gi", "{matchLabels: {app: llm}}"));
        assert!(index.apply_pod(pod("a", "p", &[("app", "web")])).is_empty());
        assert!(index.apply_pod(pod("a", "p", &[("app", "web"), ("x", "y")])).is_empty());
        assert_eq!(index.selected_pod_count(), 0);
    }

    #[test]
    fn budget_changes_reach_the_budgets_sharing_pods() {
        let mut index = fixture();
        index.apply_pod(pod("a", "p1", &[("app", "llm")]));
        index.apply_pod(pod("a", "p2", &[("app", "web")]));
        // Only the action changes: the same pods, but budgets selecting a pod tighten each other's rules field by
        // field (their `Overlapping` condition says by which), so the budgets sharing its pods are affected.
        let mut llm = budget("a", "llm", "8Gi", "{matchLabels: {app: llm}}");
        llm.spec.action = gpubudget_common::BudgetAction::Warn;
        assert_eq!(index.apply_budget(&llm), keys(&["llm", "wide"]));
        // The same spec again: nothing but itself.
        assert_eq!(index.apply_budget(&llm), keys(&["llm"]));
        // The limit changes: the budgets sharing its pods may resolve differently.
        assert_eq!(
            index.apply_budget(&budget("a", "llm", "32Gi", "{matchLabels: {app: llm}}")),
            keys(&["llm", "wide"])
        );
        assert_eq!(index.resolved(&ObjKey::new("a", "p1")), Some(ObjKey::new("a", "wide")));
        // The selector moves from llm pods to web pods.
        let affected = index.apply_budget(&budget("a", "llm", "8Gi", "{matchLabels: {app: web}}"));
        assert_eq!(affected, keys(&["llm", "web", "wide"]));
        assert_eq!(index.pods_selected_by(&ObjKey::new("a", "llm")), ["p2"]);
        // Invalid: selects nothing.
        let mut bad = budget("a", "llm", "8Gi", "{matchLabels: {app: web}}");
        bad.spec.warn_at_percent = 0;
        assert_eq!(index.apply_budget(&bad), keys(&["llm", "web", "wide"]));
        assert!(index.pods_selected_by(&ObjKey::new("a", "llm")).is_empty());
        assert_eq!(index.invalid_budget_count(), 1);
        // Deleted: the others that shared its pods (none now) are affected, not itself.
        index.apply_budget(&budget("a", "llm", "8Gi", "{}"));
        assert_eq!(index.delete_budget(&ObjKey::new("a", "llm")), keys(&["web", "wide"]));
        assert_eq!(index.budget_count(), 3);
        assert_eq!(index.budgets_selecting(&ObjKey::new("a", "p2")), Vec::from_iter(keys(&["web", "wide"])));
    }

    #[test]
    fn resyncs_forget_what_was_not_listed() {
        let mut index = fixture();
        index.apply_pod(pod("a", "p1", &[("app", "llm")]));
        index.apply_pod(pod("a", "p2", &[("app", "web")]));
        index.begin_pod_resync();
        assert!(index.apply_pod(pod("a", "p1", &[("app", "llm")])).is_empty());
        assert_eq!(index.end_pod_resync(), keys(&["web", "wide"]));
        assert_eq!(index.pod_count(), 1);

        index.begin_budget_resync();
        index.apply_budget(&budget("a", "llm", "8Gi", "{matchLabels: {app: llm}}"));
        index.apply_budget(&budget("b", "other", "1Gi", "{}"));
        assert_eq!(index.end_budget_resync(), keys(&["llm"]), "wide and web are gone; llm shared p1 with wide");
        assert_eq!(index.budget_count(), 2);
        assert_eq!(index.budgets_selecting(&ObjKey::new("a", "p1")), Vec::from_iter(keys(&["llm"])));

        // A second re-list: a pod listed by the first but not by this one goes too, and one applied between
        // re-lists (a watch event) counts as listed only if this re-list lists it.
        index.apply_pod(pod("a", "p3", &[("app", "llm")]));
        index.begin_pod_resync();
        index.apply_pod(pod("a", "p3", &[("app", "llm")]));
        index.end_pod_resync();
        assert_eq!(index.pod_count(), 1);
        assert!(index.resolved(&ObjKey::new("a", "p1")).is_none() && index.resolved(&ObjKey::new("a", "p3")).is_some());
    }

    #[test]
    fn what_pods_carry_alike_is_kept_once() {
        let mut index = fixture();
        let recorded = |ns: &str, name: &str, max_mib| PodInfo {
            record: Some(PodRecord {
                state: BudgetState::Within,
                usage_bytes: 1 << 30,
                budget: "llm".into(),
                node: "gpu-node-7".into(),
                eviction_requested_at: None,
                cap_not_in_force: None,
                share: None,
                runtime_caps: None,
            }),
            caps: gpubudget_common::caps::PodCaps::Capped { max_mib },
            ..pod(ns, name, &[("app", "llm")])
        };
        index.apply_pod(recorded("a", "p1", 1));
        index.apply_pod(recorded("a", "p2", 1));
        index.apply_pod(recorded("a", "p3", 2));
        let entry = |name: &str| &index.namespaces["a"].pods[name].info;
        let (p1, p2, p3) = (entry("p1"), entry("p2"), entry("p3"));
        let (r1, r2) = (p1.record.as_ref().unwrap(), p2.record.as_ref().unwrap());
        assert!(Arc::ptr_eq(&p1.namespace, &p2.namespace));
        assert!(Arc::ptr_eq(&r1.node, &r2.node) && Arc::ptr_eq(&r1.budget, &r2.budget));
        assert_eq!(p3.caps, gpubudget_common::caps::PodCaps::Capped { max_mib: 2 }, "each pod's own caps verdict");
        let (key, kept) = index.namespaces["a"].pods.get_key_value("p1").unwrap();
        assert!(Arc::ptr_eq(key, &kept.info.name), "the map's key is the entry's name");
        let budgets = |name: &str| index.namespaces["a"].pods[name].budgets.clone();
        assert!(Arc::ptr_eq(&budgets("p1"), &budgets("p3")), "same labels, one list of selecting budgets");
        assert_eq!(budgets("p1").iter().map(|b| &**b).collect::<Vec<_>>(), ["llm", "wide"]);

        // A new event for a pod keeps sharing (the new copy is dropped), and equal pods stay equal.
        index.apply_pod(recorded("a", "p1", 1));
        let (key, kept) = index.namespaces["a"].pods.get_key_value("p1").unwrap();
        assert!(Arc::ptr_eq(key, &kept.info.name));
        assert_eq!(kept.info, recorded("a", "p1", 1));
    }

    #[test]
    fn pods_with_the_same_labels_share_one_copy_and_unused_sets_are_dropped() {
        let mut index = fixture();
        index.apply_pod(pod("a", "p1", &[("app", "llm"), ("pod-template-hash", "5d8f")]));
        index.apply_pod(pod("b", "p2", &[("app", "llm"), ("pod-template-hash", "5d8f")]));
        let labels = |index: &Index, ns: &str, name: &str| index.namespaces[ns].pods[name].info.labels.clone();
        assert!(Arc::ptr_eq(&labels(&index, "a", "p1"), &labels(&index, "b", "p2")), "one copy for both pods");
        assert_eq!(index.label_sets.len(), 1);

        // Thousands of pods with labels of their own come and go: the sets kept stay bounded by those in use.
        for i in 0..5_000 {
            let name = format!("job-{i}");
            index.apply_pod(pod("a", &name, &[("app", "llm"), ("job-index", &i.to_string())]));
            index.delete_pod(&ObjKey::new("a", &name));
        }
        assert!(index.label_sets.len() <= 2 * 512 + 1, "{} label sets kept for 2 pods", index.label_sets.len());
        assert!(index.label_sets.contains(&*labels(&index, "a", "p1")), "a set in use is never dropped");
        assert_eq!(index.resolved(&ObjKey::new("a", "p1")), Some(ObjKey::new("a", "llm")));
    }

    #[test]
    fn inputs_carry_every_selecting_budget() {
        let mut index = fixture();
        index.apply_pod(pod("a", "p1", &[("app", "llm")]));
        let inputs = index.inputs(&ObjKey::new("a", "wide"));
        assert_eq!(inputs.selected.len(), 1);
        let names: Vec<&str> = inputs.selected[0].selected_by.iter().map(|b| b.name.as_str()).collect();
        assert_eq!(names, ["llm", "wide"]);
        let _ = BTreeMap::<String, String>::new();
    }

    mod model {
        use super::*;
        use crate::status;
        use proptest::prelude::*;

        const SELECTORS: [&str; 4] = [
            "{}",
            "{matchLabels: {app: x}}",
            "{matchLabels: {app: y}}",
            "{matchExpressions: [{key: tier, operator: In, values: ['1']}]}",
        ];

        #[derive(Debug, Clone)]
        enum Op {
            Budget { id: usize, selector: usize, limit: u64, valid: bool },
            DeleteBudget(usize),
            Pod { id: usize, app: usize, tier: usize, usage: Option<(u64, usize)> },
            DeletePod(usize),
        }

        fn op() -> impl Strategy<Value = Op> {
            prop_oneof![
                (0..4usize, 0..4usize, 1..4u64, proptest::bool::weighted(0.85))
                    .prop_map(|(id, selector, limit, valid)| Op::Budget { id, selector, limit, valid }),
                (0..4usize).prop_map(Op::DeleteBudget),
                (0..6usize, 0..3usize, 0..3usize, proptest::option::of((0..4u64, 0..4usize)))
                    .prop_map(|(id, app, tier, usage)| Op::Pod { id, app, tier, usage }),
                (0..6usize).prop_map(Op::DeletePod),
            ]
        }

        fn pod_info(id: usize, app: usize, tier: usize, usage: Option<(u64, usize)>) -> PodInfo {
            let mut p = pod("a", &format!("p{id}"), &[("app", ["x", "y", "z"][app]), ("tier", ["1", "2", "3"][tier])]);
            p.record = usage.map(|(gib, budget)| PodRecord {
                state: if gib > 2 { BudgetState::Over } else { BudgetState::Within },
                usage_bytes: gib << 30,
                budget: format!("b{budget}").into(),
                node: "n".into(),
                eviction_requested_at: None,
                cap_not_in_force: None,
                share: None,
                runtime_caps: None,
            });
            p
        }

        /// Every budget's status as computed from the index now.
        fn statuses(index: &Index, budgets: &BTreeMap<usize, GpuMemoryBudget>) -> BTreeMap<usize, status::Status> {
            let now = k8s_openapi::jiff::Timestamp::UNIX_EPOCH;
            budgets
                .iter()
                .map(|(id, b)| (*id, status::compute(b, &index.inputs(&ObjKey::new("a", format!("b{id}"))), None, now)))
                .collect()
        }

        proptest! {
            #![proptest_config(ProptestConfig::with_cases(300))]

            /// The index agrees with brute force, and every budget whose status a change alters is in the
            /// change's affected set.
            #[test]
            fn affected_budgets_cover_every_status_change(ops in proptest::collection::vec(op(), 1..40)) {
                let mut index = Index::new();
                let mut budgets: BTreeMap<usize, GpuMemoryBudget> = BTreeMap::new();
                let mut pods: BTreeMap<usize, PodInfo> = BTreeMap::new();
                for op in ops {
                    let before = statuses(&index, &budgets);
                    let affected = match op {
                        Op::Budget { id, selector, limit, valid } => {
                            let mut b = budget("a", &format!("b{id}"), &format!("{limit}Gi"), SELECTORS[selector]);
                            if !valid {
                                b.spec.warn_at_percent = 0;
                            }
                            budgets.insert(id, b.clone());
                            index.apply_budget(&b)
                        }
                        Op::DeleteBudget(id) => {
                            budgets.remove(&id);
                            index.delete_budget(&ObjKey::new("a", format!("b{id}")))
                        }
                        Op::Pod { id, app, tier, usage } => {
                            let p = pod_info(id, app, tier, usage);
                            pods.insert(id, p.clone());
                            index.apply_pod(p)
                        }
                        Op::DeletePod(id) => {
                            pods.remove(&id);
                            index.delete_pod(&ObjKey::new("a", format!("p{id}")))
                        }
                    };
                    let after = statuses(&index, &budgets);
                    for (id, status) in &after {
                        if before.get(id) != Some(status) {
                            prop_assert!(affected.contains(&ObjKey::new("a", format!("b{id}"))), "b{} changed but was not affected", id);
                        }
                    }
                    // Brute force: who selects each pod, who applies, counts.
                    let compiled: Vec<Budget> = budgets.values().filter_map(|b| Budget::compile(b).ok()).collect();
                    for p in pods.values() {
                        let expected: Vec<ObjKey> = compiled.iter().filter(|b| b.selects(&PodLabels::new("a", &BTreeMap::new(), &p.labels))).map(|b| ObjKey::new("a", &b.name)).collect();
                        let mut expected = expected;
                        expected.sort();
                        prop_assert_eq!(index.budgets_selecting(&p.key()), expected);
                        let resolved = gpubudget_common::resolve(&compiled, &PodLabels::new("a", &BTreeMap::new(), &p.labels)).map(|r| ObjKey::new("a", &r.budget.name));
                        prop_assert_eq!(index.resolved(&p.key()), resolved);
                    }
                    prop_assert_eq!(index.pod_count(), pods.len());
                    prop_assert_eq!(index.budget_count(), budgets.len());
                    prop_assert_eq!(index.invalid_budget_count(), budgets.len() - compiled.len());
                    let selected = pods.values().filter(|p| compiled.iter().any(|b| b.selects(&PodLabels::new("a", &BTreeMap::new(), &p.labels)))).count();
                    prop_assert_eq!(index.selected_pod_count(), selected);
                }
            }
        }
    }

    fn cluster_budget(name: &str, limit: &str, namespace_selector: &str, rest: &str) -> ClusterGpuMemoryBudget {
        serde_yaml::from_str(&format!(
            "apiVersion: gpubudget.io/v1alpha1\nkind: ClusterGpuMemoryBudget\nmetadata: {{name: {name}}}\n\
             spec: {{namespaceSelector: {namespace_selector}, selector: {{}}, limit: {limit}{rest}}}\n"
        ))
        .expect("fixture parses")
    }

    fn tenant() -> BTreeMap<String, String> {
        [("tier".to_owned(), "tenant".to_owned())].into()
    }

    /// #23: two tenant namespaces and one other; `tenants` (16Gi) selects the tenants' pods; a/llm (8Gi)
    /// takes a/p1 over; b/loose (32Gi) cannot.
    fn cluster_fixture() -> Index {
        let mut index = Index::new();
        index.set_namespace_labels("a", tenant());
        index.set_namespace_labels("b", tenant());
        index.apply_budget(&budget("a", "llm", "8Gi", "{matchLabels: {app: llm}}"));
        index.apply_budget(&budget("b", "loose", "32Gi", "{}"));
        index.apply_pod(pod("a", "p1", &[("app", "llm")]));
        index.apply_pod(pod("a", "p2", &[("app", "web")]));
        index.apply_pod(pod("b", "q1", &[]));
        index.apply_pod(pod("sys", "s1", &[]));
        index
    }

    #[test]
    fn a_cluster_budget_affects_the_budgets_sharing_its_pods_in_every_namespace() {
        let mut index = cluster_fixture();
        let tenants = cluster_budget("tenants", "16Gi", "{matchLabels: {tier: tenant}}", "");
        let affected = index.apply_cluster_budget(&tenants);
        let expected: Affected =
            [ObjKey::cluster("tenants"), ObjKey::new("a", "llm"), ObjKey::new("b", "loose")].into_iter().collect();
        assert_eq!(affected, expected);
        assert_eq!(index.pods_selected_by(&ObjKey::cluster("tenants")), ["a/p1", "a/p2", "b/q1"]);
        assert_eq!(index.resolved(&ObjKey::new("a", "p1")), Some(ObjKey::new("a", "llm")), "tighter: takes over");
        assert_eq!(index.resolved(&ObjKey::new("a", "p2")), Some(ObjKey::cluster("tenants")));
        assert_eq!(index.resolved(&ObjKey::new("b", "q1")), Some(ObjKey::cluster("tenants")), "looser: cannot");
        assert_eq!(index.resolved(&ObjKey::new("sys", "s1")), None);
        assert_eq!(
            index.budgets_selecting(&ObjKey::new("a", "p1")),
            [ObjKey::new("a", "llm"), ObjKey::cluster("tenants")]
        );
        let inputs = index.inputs(&ObjKey::cluster("tenants"));
        assert_eq!(inputs.selected.len(), 3);
        // Only the warning threshold changes: the earlier warning is taken across the budgets selecting a pod, so
        // those sharing its pods are affected; the same spec again affects only itself.
        let mut warn = tenants.clone();
        warn.spec.budget.warn_at_percent = 50;
        let sharing: Affected =
            [ObjKey::cluster("tenants"), ObjKey::new("a", "llm"), ObjKey::new("b", "loose")].into_iter().collect();
        assert_eq!(index.apply_cluster_budget(&warn), sharing);
        assert_eq!(index.apply_cluster_budget(&warn), Affected::from([ObjKey::cluster("tenants")]));
        // A longer overLimitSeconds: a/llm (10 s) is no looser any more… still tighter; the cluster's
        // shorter one makes a/llm looser: p1 goes back to the cluster budget.
        let mut strict = tenants.clone();
        strict.spec.budget.over_limit_seconds = 5;
        assert!(index.apply_cluster_budget(&strict).contains(&ObjKey::new("a", "llm")));
        assert_eq!(index.resolved(&ObjKey::new("a", "p1")), Some(ObjKey::cluster("tenants")));
        // A namespaced budget's action changes with a cluster budget present: the cluster one is affected.
        let mut llm = budget("a", "llm", "8Gi", "{matchLabels: {app: llm}}");
        llm.spec.over_limit_seconds = 5;
        assert!(index.apply_budget(&llm).contains(&ObjKey::cluster("tenants")));
        assert_eq!(index.resolved(&ObjKey::new("a", "p1")), Some(ObjKey::new("a", "llm")));
        let deleted = index.delete_cluster_budget("tenants");
        assert!(!deleted.contains(&ObjKey::cluster("tenants")) && deleted.contains(&ObjKey::new("b", "loose")));
        assert_eq!(index.resolved(&ObjKey::new("b", "q1")), Some(ObjKey::new("b", "loose")));
    }

    #[test]
    fn a_relabel_affects_only_the_cluster_budgets_whose_selection_moved_and_those_pods_budgets() {
        let mut index = cluster_fixture();
        index.apply_cluster_budget(&cluster_budget("tenants", "16Gi", "{matchLabels: {tier: tenant}}", ""));
        index.apply_cluster_budget(&cluster_budget("everyone", "64Gi", "{}", ""));
        // A label no selector reads: nothing.
        let mut more = tenant();
        more.insert("team".into(), "x".into());
        assert!(index.set_namespace_labels("a", more).is_empty());
        // sys becomes a tenant: tenants (its pod joins) and everyone (the pod is no longer its alone).
        let affected = index.set_namespace_labels("sys", tenant());
        let expected: Affected = [ObjKey::cluster("everyone"), ObjKey::cluster("tenants")].into_iter().collect();
        assert_eq!(affected, expected);
        assert_eq!(index.resolved(&ObjKey::new("sys", "s1")), Some(ObjKey::cluster("tenants")));
        // b leaves: tenants, and the other budgets of b's pod (everyone, b/loose); a's are untouched.
        let affected = index.set_namespace_labels("b", BTreeMap::new());
        let expected: Affected =
            [ObjKey::cluster("everyone"), ObjKey::cluster("tenants"), ObjKey::new("b", "loose")].into_iter().collect();
        assert_eq!(affected, expected);
        assert_eq!(index.resolved(&ObjKey::new("b", "q1")), Some(ObjKey::new("b", "loose")));
        assert!(index.caps_namespaces().is_empty());
        index.apply_cluster_budget(&cluster_budget(
            "tenants",
            "16Gi",
            "{matchLabels: {tier: tenant}}",
            ", admissionCaps: Enabled",
        ));
        assert_eq!(Vec::from_iter(index.caps_namespaces()), ["a", "sys"]);
    }

    /// #23: the pure model with cluster budgets and namespace relabels.
    mod cluster_model {
        use super::*;
        use crate::status;
        use proptest::prelude::*;

        const NAMESPACES: [&str; 3] = ["a", "b", "c"];
        const NS_SELECTORS: [&str; 3] =
            ["{}", "{matchLabels: {tier: t}}", "{matchExpressions: [{key: tier, operator: NotIn, values: [t]}]}"];
        const SELECTORS: [&str; 3] = ["{}", "{matchLabels: {app: x}}", "{matchLabels: {app: y}}"];

        #[derive(Debug, Clone)]
        enum Op {
            Budget { ns: usize, id: usize, selector: usize, limit: u64, slow: bool, early: bool },
            DeleteBudget { ns: usize, id: usize },
            Cluster { id: usize, ns_selector: usize, selector: usize, limit: u64, slow: bool },
            DeleteCluster(usize),
            Pod { ns: usize, id: usize, app: usize, usage: Option<(u64, bool)> },
            DeletePod { ns: usize, id: usize },
            Relabel { ns: usize, tenant: bool },
        }

        fn op() -> impl Strategy<Value = Op> {
            prop_oneof![
                (0..3usize, 0..2usize, 0..3usize, 1..4u64, any::<bool>(), any::<bool>()).prop_map(
                    |(ns, id, selector, limit, slow, early)| Op::Budget { ns, id, selector, limit, slow, early }
                ),
                (0..3usize, 0..2usize).prop_map(|(ns, id)| Op::DeleteBudget { ns, id }),
                (0..2usize, 0..3usize, 0..3usize, 1..4u64, any::<bool>()).prop_map(
                    |(id, ns_selector, selector, limit, slow)| Op::Cluster { id, ns_selector, selector, limit, slow }
                ),
                (0..2usize).prop_map(Op::DeleteCluster),
                (0..3usize, 0..3usize, 0..3usize, proptest::option::of((0..4u64, any::<bool>())))
                    .prop_map(|(ns, id, app, usage)| Op::Pod { ns, id, app, usage }),
                (0..3usize, 0..3usize).prop_map(|(ns, id)| Op::DeletePod { ns, id }),
                (0..3usize, any::<bool>()).prop_map(|(ns, tenant)| Op::Relabel { ns, tenant }),
            ]
        }

        #[derive(Default)]
        struct World {
            budgets: BTreeMap<(usize, usize), GpuMemoryBudget>,
            cluster: BTreeMap<usize, ClusterGpuMemoryBudget>,
            labels: BTreeMap<usize, BTreeMap<String, String>>,
            pods: BTreeMap<(usize, usize), PodInfo>,
        }

        fn statuses(index: &Index, world: &World) -> BTreeMap<ObjKey, status::Status> {
            let now = k8s_openapi::jiff::Timestamp::UNIX_EPOCH;
            let mut out = BTreeMap::new();
            for ((ns, id), b) in &world.budgets {
                let key = ObjKey::new(NAMESPACES[*ns], format!("b{id}"));
                out.insert(key.clone(), status::compute(b, &index.inputs(&key), None, now));
            }
            for (id, b) in &world.cluster {
                let key = ObjKey::cluster(format!("c{id}"));
                out.insert(key.clone(), status::compute_cluster(b, &index.inputs(&key), None, now));
            }
            out
        }

        proptest! {
            #![proptest_config(ProptestConfig::with_cases(200))]

            /// Every status a change alters is in its affected set; the index resolves as brute force does;
            /// and each pod some budget selects is counted (`matchedPods`) by exactly one budget, of either kind.
            #[test]
            fn cluster_budgets_and_relabels(ops in proptest::collection::vec(op(), 1..40)) {
                let mut index = Index::new();
                let mut world = World::default();
                for op in ops {
                    let before = statuses(&index, &world);
                    let affected = match op {
                        Op::Budget { ns, id, selector, limit, slow, early } => {
                            let mut b = budget(NAMESPACES[ns], &format!("b{id}"), &format!("{limit}Gi"), SELECTORS[selector]);
                            b.spec.over_limit_seconds = if slow { 30 } else { 10 };
                            b.spec.warn_at_percent = if early { 50 } else { 90 };
                            world.budgets.insert((ns, id), b.clone());
                            index.apply_budget(&b)
                        }
                        Op::DeleteBudget { ns, id } => {
                            world.budgets.remove(&(ns, id));
                            index.delete_budget(&ObjKey::new(NAMESPACES[ns], format!("b{id}")))
                        }
                        Op::Cluster { id, ns_selector, selector, limit, slow } => {
                            let rest = if slow { ", overLimitSeconds: 30" } else { "" };
                            let c = cluster_budget(&format!("c{id}"), &format!("{limit}Gi"), NS_SELECTORS[ns_selector], rest);
                            let mut c = c;
                            c.spec.budget.selector = serde_yaml::from_str(SELECTORS[selector]).expect("selector");
                            world.cluster.insert(id, c.clone());
                            index.apply_cluster_budget(&c)
                        }
                        Op::DeleteCluster(id) => {
                            world.cluster.remove(&id);
                            index.delete_cluster_budget(&format!("c{id}"))
                        }
                        Op::Pod { ns, id, app, usage } => {
                            let mut p = pod(NAMESPACES[ns], &format!("p{id}"), &[("app", ["x", "y", "z"][app])]);
                            p.record = usage.map(|(gib, cluster)| PodRecord {
                                state: if gib > 2 { BudgetState::Over } else { BudgetState::Within },
                                usage_bytes: gib << 30,
                                budget: if cluster { "ClusterGpuMemoryBudget/c0".into() } else { "b0".into() },
                                node: "n".into(),
                                eviction_requested_at: None,
                                cap_not_in_force: None,
                                share: None,
                                runtime_caps: None,
                            });
                            world.pods.insert((ns, id), p.clone());
                            index.apply_pod(p)
                        }
                        Op::DeletePod { ns, id } => {
                            world.pods.remove(&(ns, id));
                            index.delete_pod(&ObjKey::new(NAMESPACES[ns], format!("p{id}")))
                        }
                        Op::Relabel { ns, tenant } => {
                            let labels: BTreeMap<String, String> =
                                if tenant { [("tier".to_owned(), "t".to_owned())].into() } else { BTreeMap::new() };
                            world.labels.insert(ns, labels.clone());
                            index.set_namespace_labels(NAMESPACES[ns], labels)
                        }
                    };
                    let after = statuses(&index, &world);
                    for (key, status) in &after {
                        if before.get(key) != Some(status) {
                            prop_assert!(affected.contains(key), "{} changed but was not affected", key);
                        }
                    }
                    let mut compiled: Vec<Budget> = world.budgets.values().filter_map(|b| Budget::compile(b).ok()).collect();
                    compiled.extend(world.cluster.values().filter_map(|c| Budget::compile_cluster(c).ok()));
                    let mut selected = 0;
                    for ((ns, _), p) in &world.pods {
                        let no_labels = BTreeMap::new();
                        let labels = world.labels.get(ns).unwrap_or(&no_labels);
                        let pod_labels = PodLabels::new(NAMESPACES[*ns], labels, &p.labels);
                        let resolved = gpubudget_common::resolve(&compiled, &pod_labels)
                            .map(|r| budget_key(NAMESPACES[*ns], r.budget));
                        selected += usize::from(resolved.is_some());
                        prop_assert_eq!(index.resolved(&p.key()), resolved);
                    }
                    let counted: i64 = after.values().map(|s| s.matched_pods).sum();
                    prop_assert_eq!(counted, selected as i64, "each selected pod is counted by exactly one budget");
                }
            }
        }
    }
}
