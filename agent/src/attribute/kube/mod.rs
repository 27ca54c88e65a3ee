//! Where the agent reads Kubernetes: the [`Index`] of this node's pods, every budget and cluster budget (or their
//! mirrors), the namespaces' labels and the Node's labels, each kept current by a watch (the Node's by a poll,
//! [`node`]); and the pod table built from them ([`table::build`], a plain function of the caches). `top`'s
//! one-shot reads are in [`list`].
//!
//! The pods of this node only (`fieldSelector=spec.nodeName=<node>`, listed [`LIST_PAGE_SIZE`] at a time, each pod
//! cut down by [`slim_pod`] to what the decisions read as it arrives) and every `GpuMemoryBudget` (all
//! namespaces), compiled as it arrives into a [`BudgetCache`], with every `ClusterGpuMemoryBudget` and the labels
//! of every Namespace (their `namespaceSelector` reads them) in a [`ClusterCache`]. The loop rebuilds its pod table
//! only when [`Index::generation`] moved: a change the table reads (the operator's status writes on budgets do not
//! count, nor budgets of namespaces without pods here). Nothing is decided before [`Index::synced`].

pub mod list;
pub mod mirror_watch;
mod node;
pub mod spec_watch;
pub mod table;
mod watch;

#[cfg(test)]
mod tests;

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use gpubudget_common::{ClusterGpuMemoryBudget, ClusterGpuMemoryBudgetMirror, GpuMemoryBudget, GpuMemoryBudgetMirror};
use gpubudget_daemon::Health;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{Namespace, Node, Pod};
use kube::runtime::reflector::{self, Store};
use kube::runtime::watcher;
use kube::{Api, Client};
use tokio_util::sync::CancellationToken;

use crate::attribute::budgets::{BudgetCache, Change, ClusterCache};
use crate::attribute::pods::{PodTable, slim_pod};
pub use spec_watch::{ReadKind, ReadResult};
use spec_watch::{Scoped, Source, SpecEvent};

pub use table::{Cached, MadeSummary};

/// Pods, budgets and namespaces are listed this many at a time (a page of full objects is held while it is cut down or
/// compiled; kube's default is 500).
pub const LIST_PAGE_SIZE: u32 = 100;

/// A budget spec read: `get` or `list`, and whether it was answered (`gpubudget_budget_spec_reads_total`).
pub type SpecRead = Arc<dyn Fn(ReadKind, ReadResult) + Send + Sync>;
/// A kind's specs now read from its mirrors (`true`) or from the budgets themselves, with why it went back to them
/// if it did (`gpubudget_budget_specs_from_mirrors`, and an event on the Node).
pub type FromMirrors = Arc<dyn Fn(BudgetKind, bool, Option<&str>) + Send + Sync>;

/// The kind of budget whose specs a watch reads (`{kind}` of `gpubudget_budget_specs_from_mirrors`).
#[derive(Debug, Clone, Copy, Hash, PartialEq, Eq)]
pub enum BudgetKind {
    /// `GpuMemoryBudget`.
    Namespaced,
    /// `ClusterGpuMemoryBudget`.
    Cluster,
}

impl BudgetKind {
    /// The kind's name: the label value, and how a Node event names it.
    pub fn as_str(self) -> &'static str {
        match self {
            BudgetKind::Namespaced => "GpuMemoryBudget",
            BudgetKind::Cluster => "ClusterGpuMemoryBudget",
        }
    }
}

impl std::fmt::Display for BudgetKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

gpubudget_daemon::label_values!(BudgetKind);

/// How the budget caches read specs: the mirrors' Lease (`None`: the budgets always), and whom they tell.
pub struct Mirroring {
    /// The Lease by which the operator vouches for the mirrors (namespace, name).
    pub lease: Option<(String, String)>,
    /// Told each spec read.
    pub spec_read: SpecRead,
    /// Told when a kind's specs switch between the mirrors and the budgets.
    pub from_mirrors: FromMirrors,
}

impl std::fmt::Debug for Mirroring {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Mirroring").field("lease", &self.lease).finish_non_exhaustive()
    }
}

/// What the runtime made of the pods' GPU containers (`--runtime-caps`), as the table reads it and prunes it
/// (`runtime_caps::Made`; a trait, so that this stage does not import that edge).
pub trait RuntimeMade {
    /// Whether nothing is remembered.
    fn is_empty(&self) -> bool;
    /// Forgets the pods for which `here` is false.
    fn retain_pods(&self, here: impl Fn(&str) -> bool);
    /// What the pod with UID `uid`'s GPU containers as the runtime made them come to, if it made any.
    fn summary(&self, uid: &str) -> Option<MadeSummary>;
}

/// The caches the agent decides from (cheap to clone: each cache behind one lock).
#[derive(Debug, Clone)]
pub struct Index {
    pods: Store<Pod>,
    budgets: Arc<Mutex<BudgetCache>>,
    cluster: Arc<Mutex<ClusterCache>>,
    changes: Arc<AtomicU64>,
    pods_ready: Arc<AtomicBool>,
    /// The Node's labels were asked for once (read or not): until then the node's enforcement is not known, and
    /// nothing is decided (#54: an observing node's label must be read before its first eviction).
    node_asked: Arc<AtomicBool>,
    /// The Node's labels that say how the device plugin shares its GPUs, and its enforcement label
    /// ([`node`]); `None` until read.
    sharing: Arc<Mutex<Option<BTreeMap<String, String>>>>,
}

impl Index {
    /// Starts the watches: the pods of `node` (into a reflector, each pod cut down by [`slim_pod`] as it
    /// arrives), every budget (compiled into a [`BudgetCache`]), and the cluster budgets with the namespaces'
    /// labels they select by (a [`ClusterCache`]); and the poll of the Node's labels. Sets `health`'s checks
    /// `pods` and `budgets` as the caches list.
    pub fn start(
        client: Client,
        node: &str,
        health: Health,
        mirroring: Mirroring,
        shutdown: CancellationToken,
    ) -> Self {
        let Mirroring { lease, spec_read, from_mirrors } = mirroring;
        let lease = lease.map(|(namespace, name)| (Api::<Lease>::namespaced(client.clone(), &namespace), name));
        let changes = Arc::new(AtomicU64::new(0));
        let pods_ready = Arc::new(AtomicBool::new(false));
        let (pods, mut writer) = reflector::store::<Pod>();
        {
            let (changes, ready, health) = (changes.clone(), pods_ready.clone(), health.clone());
            watch::spawn(
                Api::<Pod>::all(client.clone()),
                watcher::Config::default().fields(&format!("spec.nodeName={node}")).page_size(LIST_PAGE_SIZE),
                "pods",
                shutdown.clone(),
                move |event: watcher::Event<Pod>| {
                    let listed = matches!(event, watcher::Event::InitDone);
                    writer.apply_watcher_event(&event.modify(slim_pod));
                    changes.fetch_add(1, Ordering::AcqRel);
                    if listed && !ready.swap(true, Ordering::AcqRel) {
                        health.set("pods", true);
                        tracing::info!(cache = "pods", "cache synced");
                    }
                },
            );
        }
        let sharing = Arc::new(Mutex::new(None));
        let node_asked = Arc::new(AtomicBool::new(false));
        node::spawn(
            Api::<Node>::all(client.clone()),
            node.to_owned(),
            sharing.clone(),
            changes.clone(),
            node_asked.clone(),
            shutdown.clone(),
        );
        let budgets = Arc::new(Mutex::new(BudgetCache::default()));
        let cluster = Arc::new(Mutex::new(ClusterCache::default()));
        // `budgets` is ready once the namespaced budgets, the cluster budgets and the namespaces have listed.
        let announce = {
            let (budgets, cluster, health) = (budgets.clone(), cluster.clone(), health.clone());
            let announced = Arc::new(AtomicBool::new(false));
            move || {
                let synced = lock(&budgets).synced() && lock(&cluster).synced();
                if synced && !announced.swap(true, Ordering::AcqRel) {
                    health.set("budgets", true);
                    tracing::info!(cache = "budgets", budgets = lock(&budgets).index().len(), "cache synced");
                }
            }
        };
        let told = |kind: BudgetKind| {
            let from_mirrors = from_mirrors.clone();
            move |mirrors: bool, why: Option<&str>| from_mirrors(kind, mirrors, why)
        };
        let counted = || {
            let spec_read = spec_read.clone();
            move |kind: ReadKind, result: ReadResult| spec_read(kind, result)
        };
        {
            let (changes, cache, announce) = (changes.clone(), cluster.clone(), announce.clone());
            let (absent_changes, absent_cache, absent_announce) = (changes.clone(), cluster.clone(), announce.clone());
            let all = Api::<ClusterGpuMemoryBudget>::all(client.clone());
            let scoped: Scoped<ClusterGpuMemoryBudget> = {
                let all = all.clone();
                Arc::new(move |_: &str| all.clone())
            };
            mirror_watch::spawn(
                move || Source { all: all.clone(), scoped: scoped.clone() },
                Api::<ClusterGpuMemoryBudgetMirror>::all(client.clone()),
                lease.clone(),
                LIST_PAGE_SIZE,
                "clusterbudgets",
                shutdown.clone(),
                counted(),
                told(BudgetKind::Cluster),
                move |event| {
                    let changed = match event {
                        SpecEvent::Event(event) => lock(&cache).apply_budget(&event),
                        SpecEvent::Deleted((_, name)) => lock(&cache).forget_budget(&name),
                    };
                    if changed {
                        changes.fetch_add(1, Ordering::AcqRel);
                    }
                    announce();
                },
                // The ClusterGpuMemoryBudget CRD not installed (an upgrade whose CRDs were not applied first: Helm
                // installs crds/ on first install only): namespaced budgets are enforced all the same, and the
                // watch keeps trying, so cluster budgets are enforced once the CRD is there.
                move |error| {
                    if watch::is_not_found(error) && lock(&absent_cache).budgets_absent() {
                        tracing::warn!(
                            "the ClusterGpuMemoryBudget CRD is not installed (apply charts/gpubudget/crds/): \
                             enforcing namespaced budgets only until it is"
                        );
                        absent_changes.fetch_add(1, Ordering::AcqRel);
                        absent_announce();
                    }
                },
            );
        }
        {
            let (changes, cache, announce, pods) = (changes.clone(), cluster.clone(), announce.clone(), pods.clone());
            watch::spawn(
                Api::<Namespace>::all(client.clone()),
                watcher::Config::default().page_size(LIST_PAGE_SIZE),
                "namespaces",
                shutdown.clone(),
                move |event: watcher::Event<Namespace>| {
                    if rebuilds(&pods, &lock(&cache).apply_namespace(&event)) {
                        changes.fetch_add(1, Ordering::AcqRel);
                    }
                    announce();
                },
            );
        }
        {
            let (changes, cache, pods) = (changes.clone(), budgets.clone(), pods.clone());
            let scoped: Scoped<GpuMemoryBudget> = {
                let client = client.clone();
                Arc::new(move |namespace: &str| Api::<GpuMemoryBudget>::namespaced(client.clone(), namespace))
            };
            let all = Api::<GpuMemoryBudget>::all(client.clone());
            mirror_watch::spawn(
                move || Source { all: all.clone(), scoped: scoped.clone() },
                Api::<GpuMemoryBudgetMirror>::all(client),
                lease,
                LIST_PAGE_SIZE,
                "budgets",
                shutdown,
                counted(),
                told(BudgetKind::Namespaced),
                move |event| {
                    let mut cache = lock(&cache);
                    let change = match event {
                        SpecEvent::Event(event) => cache.apply(&event),
                        SpecEvent::Deleted((namespace, name)) => cache.forget(&namespace, &name),
                    };
                    if rebuilds(&pods, &change) {
                        changes.fetch_add(1, Ordering::AcqRel);
                    }
                    drop(cache);
                    announce();
                },
                |_| {},
            );
        }
        Self { pods, budgets, cluster, changes, pods_ready, node_asked, sharing }
    }

    /// Every cache has its first full list, and the Node's labels were asked for.
    pub fn synced(&self) -> bool {
        self.pods_ready.load(Ordering::Acquire)
            && self.node_asked.load(Ordering::Acquire)
            && lock(&self.budgets).synced()
            && lock(&self.cluster).synced()
    }

    /// A counter that moves on every change of a cache that can change the pod table.
    pub fn generation(&self) -> u64 {
        self.changes.load(Ordering::Acquire)
    }

    /// The pod table of `node` now, its GPUs holding `gpu_totals` bytes each, with what the runtime made of the
    /// pods' containers ([`table::build`]); what it made of pods no longer here is forgotten first.
    pub fn table(&self, node: &str, gpu_totals: &[u64], made: &impl RuntimeMade) -> PodTable {
        let pods = self.pods.state();
        if !made.is_empty() {
            let here = table::uids_here(&pods);
            made.retain_pods(|uid| here.contains(uid));
        }
        // Budgets before cluster, as every other holder of both takes them.
        let budgets = lock(&self.budgets);
        let cluster = lock(&self.cluster);
        let sharing = lock(&self.sharing).clone();
        let cached =
            Cached { pods: &pods, budgets: budgets.index(), cluster: cluster.index(), node_labels: sharing.as_ref() };
        table::build(cached, |uid| made.summary(uid), node, gpu_totals)
    }
}

/// Whether a change of the budgets or namespaces changes the pod table of a node with `pods`: a change in a
/// namespace without pods here does not (a pod that arrives there later is a pod change, and the table built
/// then reads the budgets and labels as they are).
fn rebuilds(pods: &reflector::Store<Pod>, change: &Change) -> bool {
    match change {
        Change::Nothing => false,
        Change::In(namespace) => {
            pods.state().iter().any(|p| p.metadata.namespace.as_deref() == Some(namespace.as_str()))
        }
        Change::Everything => true,
    }
}

/// A cache's lock, even if a watch task panicked holding it (the cache is whole between events).
fn lock<T>(cache: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    cache.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}
