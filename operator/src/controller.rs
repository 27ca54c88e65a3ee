//! The budget status controller: a kube-runtime `Controller<GpuMemoryBudget>` over every namespace, fed by
//! the budget watch and by a metadata-only pod watch through the [`Index`].
//!
//! ```text
//!  pods (metadata only) ──► Index::apply_pod ──► affected budgets ──► reconcile_on ─┐
//!  budgets ──► reflector ──► Index::apply_budget ──► other affected budgets ────────┤
//!            └──► touched objects (generation changed) ─────────────────────────────┼─► reconcile(budget)
//!  caches synced / leadership gained ──► reconcile_all_on ─────────────────────────┘      │
//!                                                                                         ▼
//!                          status::compute(budget, index inputs, previous) ─ changed? ─► SSA /status
//! ```
//!
//! - `ClusterGpuMemoryBudget`s (#23) have a controller of their own, fed by their watch into the same index
//!   and by the namespaces' labels ([`crate::namespaces`]); a change anywhere triggers the budgets it
//!   affects, namespaced or cluster, each through its controller. Without their CRD (an upgrade whose
//!   CRDs were not applied) the cluster watch logs a warning and keeps retrying; the namespaced statuses
//!   are written meanwhile.
//! - Reconciles start once the caches have listed (pods, budgets, namespaces, and the cluster budgets or
//!   their first failure), so a restart does not write half-known statuses.
//! - Only the leader writes (and publishes events); a follower keeps both caches warm and reconciles
//!   every budget as soon as it becomes leader.
//! - A status is written only when it differs from the one in the cache (condition times aside). The write
//!   carries the `resourceVersion` it was computed from as a precondition, so a write computed from a stale
//!   cache (or by a deposed leader) fails with a conflict instead of counting an eviction twice.

use std::collections::{BTreeSet, HashMap};
use std::sync::{Arc, Mutex, PoisonError, RwLock};
use std::time::{Duration, Instant};

use futures::channel::mpsc::{UnboundedSender, unbounded};
use futures::{StreamExt, TryStreamExt};
use gpubudget_common::crd::GpuMemoryBudgetStatus;
use gpubudget_common::mirror::Copied;
use gpubudget_common::{Budget, ClusterGpuMemoryBudget, GpuMemoryBudget, GpuNodeUsage, SpecError};
use gpubudget_daemon::Health;
use k8s_openapi::jiff::Timestamp;
use kube::api::{Patch, PatchParams};
use kube::runtime::controller::{self, Action};
use kube::runtime::events::{Event as KubeEvent, EventType, Recorder, Reporter};
use kube::runtime::reflector::{self, ObjectRef};
use kube::runtime::watcher::{self, Event};
use kube::runtime::{Controller, WatchStreamExt, predicates};
use kube::{Api, Client, Resource, ResourceExt};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use crate::caps_scope::{self, Labeller};
use crate::error::Error;
use crate::index::{Affected, Index};
use crate::metrics::Metrics;
use crate::pods::{ObjKey, PodMeta};
use crate::status::{self, Inputs, PreviousTop, notices, top_pods_digest, unchanged};

/// The field manager of every status write (and the events' reporting controller).
pub const FIELD_MANAGER: &str = "gpubudget-operator";
/// Readiness check: the pod cache has listed.
pub const CHECK_PODS: &str = "pods-synced";
/// Readiness check: the budget cache has listed (and the namespaces, and the cluster budgets or their
/// first failure).
pub const CHECK_BUDGETS: &str = "budgets-synced";
/// Pods in these phases are not watched: they hold no GPU memory and count for no budget.
pub const ACTIVE_PODS: &str = "status.phase!=Succeeded,status.phase!=Failed";

/// How the controller runs.
#[derive(Debug, Clone)]
pub struct Settings {
    /// Field manager of status writes.
    pub field_manager: String,
    /// Field selector of the pod watch (`None`: every pod).
    pub pod_field_selector: Option<String>,
    /// Reconciles running at once.
    pub concurrency: u16,
    /// Every budget is reconciled again this often even if nothing changed (a safety net): one timer for
    /// all of them, not one each (10 000 timers held about 6 MiB in the controller's scheduler).
    pub resync: Duration,
    /// First retry delay after a transient failure (doubling up to `max_backoff`).
    pub min_backoff: Duration,
    /// Longest retry delay.
    pub max_backoff: Duration,
    /// This replica, for events (`reportingInstance`).
    pub instance: Option<String>,
    /// The namespaces whose critical-priority pods are never evicted for a namespace total (#33).
    pub critical_namespaces: gpubudget_common::CriticalNamespaces,
    /// Whether the leader writes the budgets' mirrors (#34), which agents read instead of the budgets.
    pub mirrors: bool,
    /// The Lease (namespace, name) by which the leader vouches that every budget has a current mirror
    /// ([`vouch_mirrors`]); `None`: none is kept.
    pub mirrors_lease: Option<(String, String)>,
}

impl Default for Settings {
    fn default() -> Self {
        Self {
            field_manager: FIELD_MANAGER.to_owned(),
            pod_field_selector: Some(ACTIVE_PODS.to_owned()),
            concurrency: 16,
            resync: Duration::from_secs(600),
            critical_namespaces: gpubudget_common::CriticalNamespaces::default(),
            min_backoff: Duration::from_millis(250),
            max_backoff: Duration::from_secs(300),
            instance: None,
            mirrors: true,
            mirrors_lease: None,
        }
    }
}

/// What a reconcile computes from: the status before, where its `topPods` are ([`status::unchanged`]), and
/// the resourceVersion to write against.
struct Previous {
    status: Option<GpuMemoryBudgetStatus>,
    top: PreviousTop,
    resource_version: Option<String>,
}

/// A status this replica wrote, kept until the cache shows it (so a reconcile in between reads it).
#[derive(Debug)]
struct Written {
    uid: Option<String>,
    before: Option<String>,
    after: Option<String>,
    status: GpuMemoryBudgetStatus,
}

/// The statuses this replica is writing and has written, until the cache shows them.
#[derive(Debug, Default)]
struct Writes {
    /// Written, not yet seen in the cache: what [`Context::previous`] computes from meanwhile.
    done: HashMap<ObjKey, Written>,
    /// Being written, with the last resourceVersion the watch delivered meanwhile: when it is the write's own,
    /// the cache already shows it and no copy is kept (the watch can be quicker than the write's answer).
    in_flight: HashMap<ObjKey, Option<String>>,
}

impl Writes {
    /// A write of `key`'s status begins.
    fn begin(&mut self, key: &ObjKey) {
        self.in_flight.insert(key.clone(), None);
    }

    /// The watch delivered `key` at `rv`: a copy of the status written at `rv` is dropped, and a write under
    /// way remembers `rv`.
    fn seen(&mut self, key: &ObjKey, rv: &Option<String>) {
        if rv.is_some() && self.done.get(key).is_some_and(|w| w.after == *rv) {
            self.done.remove(key);
        }
        if let Some(seen) = self.in_flight.get_mut(key) {
            seen.clone_from(rv);
        }
    }

    /// The write of `key`'s status was answered (`None`: it failed): the copy is kept unless the watch
    /// already delivered what it wrote.
    fn answered(&mut self, key: &ObjKey, written: Option<Written>) {
        let seen = self.in_flight.remove(key).flatten();
        if let Some(written) = written.filter(|w| w.after.is_none() || w.after != seen) {
            self.done.insert(key.clone(), written);
        }
    }
}

/// What reconciles share.
pub struct Context {
    client: Client,
    /// The pod ↔ budget index.
    pub index: Arc<RwLock<Index>>,
    metrics: Metrics,
    recorder: Recorder,
    reporter: Reporter,
    leader: watch::Receiver<bool>,
    settings: Settings,
    synced: watch::Sender<bool>,
    /// What has listed ([`Listed`]).
    listed: Mutex<Listed>,
    /// The budgets' mirrors (#34): namespaced, cluster.
    mirrors: [crate::mirror::Mirrors; 2],
    written: Mutex<Writes>,
    /// The digest of each cached budget's `topPods` (dropped from the cache, [`top_pods_digest`]), with the
    /// resourceVersion it was read at.
    top_digests: Mutex<HashMap<ObjKey, (Option<String>, u64)>>,
    failures: Mutex<HashMap<ObjKey, u32>>,
    caps_namespaces: watch::Sender<BTreeSet<String>>,
}

impl std::fmt::Debug for Context {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Context").field("settings", &self.settings).finish_non_exhaustive()
    }
}

/// What has listed; reconciles start once all have.
#[derive(Debug, Default)]
struct Listed {
    budgets: bool,
    namespaces: bool,
    /// Or failed before listing (their CRD missing).
    cluster_budgets: bool,
    /// Each mirror kind's metadata, or its first failure (set from the start without mirrors).
    mirrors: bool,
    cluster_mirrors: bool,
}

impl Listed {
    fn all(&self) -> bool {
        self.budgets && self.namespaces && self.cluster_budgets && self.mirrors && self.cluster_mirrors
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

impl Context {
    /// A context. `leader` says whether this replica may write (constant `true` without election).
    pub fn new(client: Client, metrics: Metrics, leader: watch::Receiver<bool>, settings: Settings) -> Self {
        let reporter = Reporter { controller: settings.field_manager.clone(), instance: settings.instance.clone() };
        let no_mirrors = !settings.mirrors;
        Self {
            recorder: Recorder::new(client.clone(), reporter.clone()),
            reporter,
            client,
            index: Arc::default(),
            metrics,
            leader,
            settings,
            synced: watch::Sender::new(false),
            listed: Mutex::new(Listed { mirrors: no_mirrors, cluster_mirrors: no_mirrors, ..Listed::default() }),
            mirrors: Default::default(),
            written: Mutex::default(),
            top_digests: Mutex::default(),
            failures: Mutex::default(),
            caps_namespaces: watch::Sender::new(BTreeSet::new()),
        }
    }

    /// The client.
    pub fn client(&self) -> Client {
        self.client.clone()
    }

    /// The event recorder (`reportingController: gpubudget-operator`). It keeps every event it published
    /// for six minutes, to count repeats as a series: for events that repeat (namespace totals, caps).
    pub fn recorder(&self) -> &Recorder {
        &self.recorder
    }

    /// A recorder that keeps nothing, for the budgets' status notices: each tells a change, so a repeat within
    /// minutes is rare, and kube's recorder would keep a 2 KB copy of each for six minutes in a table that
    /// never shrinks (35 MB after a start that published one for each of 10 000 budgets).
    fn notice_recorder(&self) -> Recorder {
        Recorder::new(self.client.clone(), self.reporter.clone())
    }

    /// Whether this replica may write (leads, or election is off), as it changes.
    pub fn leader_watch(&self) -> watch::Receiver<bool> {
        self.leader.clone()
    }

    /// Whether both caches have listed, as it changes.
    pub fn synced_watch(&self) -> watch::Receiver<bool> {
        self.synced.subscribe()
    }

    /// The namespaces holding a valid budget with caps enabled, as they change.
    pub fn caps_namespaces(&self) -> watch::Receiver<BTreeSet<String>> {
        self.caps_namespaces.subscribe()
    }

    /// The metrics this context updates.
    pub fn metrics(&self) -> &Metrics {
        &self.metrics
    }

    fn is_leader(&self) -> bool {
        *self.leader.borrow()
    }

    /// Marks one of the budget caches listed; once all are, the caches are synced: ready, and every budget
    /// is reconciled (`true` returned, once).
    fn mark_listed(&self, which: fn(&mut Listed) -> &mut bool) -> bool {
        let mut listed = lock(&self.listed);
        *which(&mut listed) = true;
        let all = listed.all();
        drop(listed);
        all && !self.synced.send_replace(true)
    }

    /// Publishes the namespaces the caps webhook is scoped to, if they changed.
    fn publish_caps_namespaces(&self, index: &Index) {
        let caps_namespaces = index.caps_namespaces();
        self.caps_namespaces.send_if_modified(|known| {
            let changed = *known != caps_namespaces;
            *known = caps_namespaces;
            changed
        });
    }

    /// The status to compute from, and the resourceVersion to write against: ours if the cache has not yet
    /// caught up with our last write, else the cache's, whose `topPods` are a digest ([`Context::drop_top_pods`]).
    fn previous<K: StatusOwner>(&self, key: &ObjKey, obj: &K) -> Previous {
        let obj_meta = obj.meta();
        let rv = obj_meta.resource_version.clone();
        let mut written = lock(&self.written);
        if let Some(w) = written.done.get(key) {
            if w.uid == obj_meta.uid && w.before == rv && rv.is_some() {
                let (status, resource_version) = (Some(w.status.clone()), w.after.clone());
                return Previous { status, top: PreviousTop::InStatus, resource_version };
            }
            written.done.remove(key);
        }
        drop(written);
        let top = match lock(&self.top_digests).get(key) {
            Some((at, digest)) if *at == rv => PreviousTop::Digest(*digest),
            // Another version's (the watch moved on between the cache and this read): written.
            _ => PreviousTop::Unknown,
        };
        Previous { status: obj.status().cloned(), top, resource_version: rv }
    }

    /// Drops a budget's `topPods` before it is cached, keeping their digest (with 10 000 budgets, 14 MiB
    /// fewer on a real API server: docs/performance.md).
    fn drop_top_pods<K: StatusOwner>(&self, obj: &mut K) {
        let (Some(key), rv) = (obj.key(), obj.meta().resource_version.clone()) else { return };
        let Some(status) = obj.status_mut() else { return };
        let top = std::mem::take(&mut status.top_pods);
        lock(&self.top_digests).insert(key, (rv, top_pods_digest(&top)));
    }

    /// The cache shows a budget: a copy kept for [`Context::previous`] of the status it shows is no longer
    /// needed (kept, it would double the statuses held: one in the cache, one here, for every budget).
    fn caught_up<K: StatusOwner>(&self, obj: &K) {
        let Some(key) = obj.key() else { return };
        lock(&self.written).seen(&key, &obj.meta().resource_version);
    }

    /// A budget was deleted: what was kept about it goes.
    fn forget(&self, key: &ObjKey) {
        let mut written = lock(&self.written);
        written.done.remove(key);
        written.in_flight.remove(key);
        drop(written);
        lock(&self.top_digests).remove(key);
        lock(&self.failures).remove(key);
    }

    /// The number of statuses kept until the cache shows them (for tests).
    pub fn statuses_kept(&self) -> usize {
        lock(&self.written).done.len()
    }

    fn update_gauges(&self, index: &Index) {
        self.metrics.budgets.set(index.budget_count() as i64);
        self.metrics.budgets_invalid.set(index.invalid_budget_count() as i64);
        self.metrics.pods.set(index.pod_count() as i64);
        self.metrics.matched_pods.set(index.selected_pod_count() as i64);
    }
}

/// A budget kind whose status the operator writes: `GpuMemoryBudget` and `ClusterGpuMemoryBudget`.
pub trait StatusOwner:
    crate::mirror::MirrorOwner
    + Resource<DynamicType = (), Scope = Self::Scoped>
    + Clone
    + serde::de::DeserializeOwned
    + serde::Serialize
    + std::fmt::Debug
    + Send
    + Sync
    + 'static
{
    /// `NamespaceResourceScope` or `ClusterResourceScope`.
    type Scoped;
    /// Its key in the index.
    fn key(&self) -> Option<ObjKey>;
    /// Its status as read.
    fn status(&self) -> Option<&GpuMemoryBudgetStatus>;
    /// Its status, to change as it is cached.
    fn status_mut(&mut self) -> Option<&mut GpuMemoryBudgetStatus>;
    /// Why its spec is invalid, if it is.
    fn spec_error(&self) -> Option<SpecError>;
    /// Its status computed from the index's inputs.
    fn compute(
        &self,
        inputs: &Inputs<'_>,
        previous: Option<&GpuMemoryBudgetStatus>,
        now: Timestamp,
    ) -> GpuMemoryBudgetStatus;
    /// The API to write its status through.
    fn api(client: Client, key: &ObjKey) -> Api<Self>;
    /// Its reference for the controller's queue.
    fn reference(key: &ObjKey) -> ObjectRef<Self>;
}

impl StatusOwner for GpuMemoryBudget {
    type Scoped = k8s_openapi::NamespaceResourceScope;
    fn key(&self) -> Option<ObjKey> {
        ObjKey::of(&self.metadata)
    }
    fn status(&self) -> Option<&GpuMemoryBudgetStatus> {
        self.status.as_ref()
    }
    fn status_mut(&mut self) -> Option<&mut GpuMemoryBudgetStatus> {
        self.status.as_mut()
    }
    fn spec_error(&self) -> Option<SpecError> {
        Budget::compile(self).err()
    }
    fn compute(
        &self,
        inputs: &Inputs<'_>,
        previous: Option<&GpuMemoryBudgetStatus>,
        now: Timestamp,
    ) -> GpuMemoryBudgetStatus {
        status::compute(self, inputs, previous, now)
    }
    fn api(client: Client, key: &ObjKey) -> Api<Self> {
        Api::namespaced(client, &key.namespace)
    }
    fn reference(key: &ObjKey) -> ObjectRef<Self> {
        ObjectRef::new(&key.name).within(&key.namespace)
    }
}

impl StatusOwner for ClusterGpuMemoryBudget {
    type Scoped = k8s_openapi::ClusterResourceScope;
    fn key(&self) -> Option<ObjKey> {
        ObjKey::of_cluster(&self.metadata)
    }
    fn status(&self) -> Option<&GpuMemoryBudgetStatus> {
        self.status.as_ref()
    }
    fn status_mut(&mut self) -> Option<&mut GpuMemoryBudgetStatus> {
        self.status.as_mut()
    }
    fn spec_error(&self) -> Option<SpecError> {
        Budget::compile_cluster(self).err()
    }
    fn compute(
        &self,
        inputs: &Inputs<'_>,
        previous: Option<&GpuMemoryBudgetStatus>,
        now: Timestamp,
    ) -> GpuMemoryBudgetStatus {
        status::compute_cluster(self, inputs, previous, now)
    }
    fn api(client: Client, _key: &ObjKey) -> Api<Self> {
        Api::all(client)
    }
    fn reference(key: &ObjKey) -> ObjectRef<Self> {
        ObjectRef::new(&key.name)
    }
}

/// Reconciles one budget: computes its status and writes it if it changed.
pub async fn reconcile<K: StatusOwner>(obj: Arc<K>, ctx: Arc<Context>) -> Result<Action, Error> {
    let started = Instant::now();
    ctx.metrics.reconciles.inc();
    let result = reconcile_inner(&*obj, &ctx).await;
    ctx.metrics.duration.observe(started.elapsed().as_secs_f64());
    let key = obj.key();
    match &result {
        Ok(_) | Err(Error::InvalidSpec(_)) => {
            if let Some(key) = &key {
                lock(&ctx.failures).remove(key);
            }
        }
        Err(_) => {}
    }
    if let Err(error) = &result {
        ctx.metrics.failed(error.metric_label());
        if matches!(error, Error::Conflict)
            && let Some(key) = &key
        {
            lock(&ctx.written).done.remove(key);
        }
    }
    result
}

async fn reconcile_inner<K: StatusOwner>(obj: &K, ctx: &Context) -> Result<Action, Error> {
    let key = obj.key().ok_or(Error::Unnamed)?;
    if !*ctx.synced.borrow() || !ctx.is_leader() {
        // Caches not listed yet, or a follower: nothing to write. All budgets are reconciled when that changes.
        return Ok(Action::await_change());
    }
    // The mirror first: agents enforce from it. A failed write does not hold the status back; the budget is
    // reconciled again after a backoff.
    let mirrors = K::mirrors(&ctx.mirrors);
    let mut mirror_failed =
        match crate::mirror::ensure(obj, &key, mirrors, ctx.client.clone(), &ctx.settings.field_manager).await {
            Ok(true) => {
                ctx.metrics.mirror_written(crate::metrics::MirrorWrite::Written);
                None
            }
            Ok(false) => None,
            Err(error) => {
                ctx.metrics.mirror_written(crate::metrics::MirrorWrite::Failed);
                tracing::warn!(budget = %key, %error, "cannot write the budget's mirror; retrying with backoff");
                Some(error)
            }
        };
    // A failed mirror write is the reconcile's error once the status is done: retried with the budget's backoff.
    let mut retry = |action: Result<Action, Error>| match (action, mirror_failed.take()) {
        (Ok(_), Some(error)) => Err(Error::Kube(error)),
        (action, _) => action,
    };
    let Previous { status: previous, top: previous_top, resource_version } = ctx.previous(&key, obj);
    let (next, spec_error) = {
        let index = ctx.index.read().unwrap_or_else(PoisonError::into_inner);
        let mut inputs = index.inputs(&key);
        inputs.nodes = Some(if ctx.settings.mirrors && mirrors.available() {
            crate::status::Nodes::Mirror(obj.meta().uid.as_deref().and_then(|uid| mirrors.copied_generation(&key, uid)))
        } else {
            crate::status::Nodes::Direct
        });
        let spec_error = match inputs.spec {
            Some(spec) => spec.err().cloned(),
            None => obj.spec_error(),
        };
        (obj.compute(&inputs, previous.as_ref(), Timestamp::now()), spec_error)
    };
    let done = || match &spec_error {
        Some(error) => Err(Error::InvalidSpec(error.clone())),
        // The resync is one timer for every budget (`run`).
        None => Ok(Action::await_change()),
    };
    if previous.as_ref().is_some_and(|p| unchanged(p, previous_top, &next)) {
        return retry(done());
    }
    let mut metadata = serde_json::json!({});
    if let Some(rv) = &resource_version {
        metadata["resourceVersion"] = rv.clone().into();
    }
    let patch = serde_json::json!({
        "apiVersion": K::api_version(&()),
        "kind": K::kind(&()),
        "metadata": metadata,
        "status": serde_json::to_value(&next).map_err(Error::Serialize)?,
    });
    let api: Api<K> = K::api(ctx.client.clone(), &key);
    let params = PatchParams::apply(&ctx.settings.field_manager).force();
    lock(&ctx.written).begin(&key);
    let result = api.patch_status(&key.name, &params, &Patch::Apply(&patch)).await;
    let copy = result.as_ref().ok().map(|written| Written {
        uid: obj.meta().uid.clone(),
        before: resource_version.clone(),
        after: written.meta().resource_version.clone(),
        status: written.status().cloned().unwrap_or(next.clone()),
    });
    lock(&ctx.written).answered(&key, copy);
    result?;
    ctx.metrics.status_writes.inc();
    tracing::debug!(budget = %key, matched = next.matched_pods, over = next.pods_over_budget, evictions = next.evictions, "status written");
    let reference = obj.object_ref(&());
    for notice in notices(previous.as_ref(), &next) {
        let event = KubeEvent {
            type_: if notice.warning { EventType::Warning } else { EventType::Normal },
            reason: notice.reason.to_owned(),
            note: Some(notice.note),
            action: "Reconcile".to_owned(),
            secondary: None,
        };
        match ctx.notice_recorder().publish(&event, &reference).await {
            Ok(()) => {
                ctx.metrics.events.inc();
            }
            Err(error) => tracing::warn!(budget = %key, %error, reason = notice.reason, "cannot publish event"),
        }
    }
    retry(done())
}

/// What to do after a failed reconcile: transient failures retry with exponential backoff per budget; an
/// invalid budget waits for a change (its status already says why).
pub fn error_policy<K: StatusOwner>(obj: Arc<K>, error: &Error, ctx: Arc<Context>) -> Action {
    if !error.is_transient() {
        return Action::await_change();
    }
    let Some(key) = obj.key() else { return Action::await_change() };
    let mut failures = lock(&ctx.failures);
    let n = failures.entry(key).or_insert(0);
    *n = n.saturating_add(1);
    Action::requeue(backoff(*n, ctx.settings.min_backoff, ctx.settings.max_backoff))
}

/// `min × 2^(n-1)`, at most `max`.
pub fn backoff(failures: u32, min: Duration, max: Duration) -> Duration {
    let factor = 2u32.saturating_pow(failures.saturating_sub(1).min(20));
    min.saturating_mul(factor).min(max)
}

/// Where the budgets a change affects are sent: each kind to its controller.
#[derive(Clone)]
struct Triggers {
    budgets: UnboundedSender<ObjectRef<GpuMemoryBudget>>,
    cluster: UnboundedSender<ObjectRef<ClusterGpuMemoryBudget>>,
    all: UnboundedSender<()>,
    cluster_all: UnboundedSender<()>,
}

impl Triggers {
    /// Every budget of both kinds.
    fn reconcile_all(&self) {
        let _ = self.all.unbounded_send(());
        let _ = self.cluster_all.unbounded_send(());
    }

    fn send_all(&self, affected: Affected, except: Option<&ObjKey>) {
        for key in affected.iter().filter(|k| Some(*k) != except) {
            if key.is_cluster() {
                let _ = self.cluster.unbounded_send(ClusterGpuMemoryBudget::reference(key));
            } else {
                let _ = self.budgets.unbounded_send(GpuMemoryBudget::reference(key));
            }
        }
    }
}

/// Feeds the pod metadata watch into the index; sends the budgets each change affects.
async fn watch_pods(
    ctx: Arc<Context>,
    triggers: Triggers,
    listed: watch::Sender<bool>,
    health: Health,
    shutdown: CancellationToken,
) -> anyhow::Result<()> {
    // Pods parsed leanly: metadata, GPU limits and cap variables (see `PodMeta`).
    let api: Api<PodMeta> = Api::all(ctx.client.clone());
    let mut config = watcher::Config::default();
    if let Some(fields) = &ctx.settings.pod_field_selector {
        config = config.fields(fields);
    }
    let mut stream = std::pin::pin!(watcher::watcher(api, config).default_backoff());
    let mut listed_once = false;
    loop {
        let next = tokio::select! {
            () = shutdown.cancelled() => return Ok(()),
            next = stream.next() => next,
        };
        let Some(event) = next else { anyhow::bail!("the pod watch ended") };
        let event = match event {
            Ok(event) => event,
            Err(error) => {
                tracing::warn!(%error, "pod watch failed; retrying with backoff");
                continue;
            }
        };
        let affected = {
            let mut index = ctx.index.write().unwrap_or_else(PoisonError::into_inner);
            let affected = match event {
                Event::Init => {
                    index.begin_pod_resync();
                    Affected::new()
                }
                Event::InitApply(meta) | Event::Apply(meta) => {
                    meta.info(&ctx.settings.critical_namespaces).map(|info| index.apply_pod(info)).unwrap_or_default()
                }
                Event::Delete(meta) => ObjKey::of(&meta.metadata).map(|k| index.delete_pod(&k)).unwrap_or_default(),
                Event::InitDone => {
                    if !listed_once {
                        tracing::info!(pods = index.pod_count(), "pod metadata listed");
                    }
                    listed_once = true;
                    health.set(CHECK_PODS, true);
                    listed.send_replace(true);
                    index.end_pod_resync()
                }
            };
            ctx.update_gauges(&index);
            affected
        };
        if listed_once {
            triggers.send_all(affected, None);
        }
    }
}

/// The next event of a watch, its failures logged and skipped (the stream retries with backoff); `None` once
/// `shutdown` fires or the stream ends.
async fn next_event<K, S>(
    stream: &mut std::pin::Pin<&mut S>,
    shutdown: &CancellationToken,
    what: &str,
) -> Option<Event<K>>
where
    S: futures::Stream<Item = Result<Event<K>, watcher::Error>>,
{
    loop {
        let next = tokio::select! {
            () = shutdown.cancelled() => return None,
            next = stream.next() => next,
        };
        match next? {
            Ok(event) => return Some(event),
            Err(error) => tracing::warn!(%error, watch = what, "watch failed; retrying with backoff"),
        }
    }
}

/// Feeds the nodes' `GpuNodeUsage` into the index (#34); sends the budgets whose pods' usage moved. Until it
/// has listed (or while its CRD is not installed), statuses read the usage in the pods' records.
async fn watch_node_usage(ctx: Arc<Context>, triggers: Triggers, shutdown: CancellationToken) {
    let api: Api<GpuNodeUsage> = Api::all(ctx.client.clone());
    let mut stream = std::pin::pin!(watcher::watcher(api, watcher::Config::default().page_size(100)).default_backoff());
    while let Some(event) = next_event(&mut stream, &shutdown, "node usage").await {
        let affected = match event {
            // Not rewritten for half an hour: its agent is gone or rolled back; the records are newer.
            Event::InitApply(usage) | Event::Apply(usage)
                if !gpubudget_common::node_usage::fresh(
                    &usage.spec.observed_at,
                    k8s_openapi::jiff::Timestamp::now(),
                ) =>
            {
                tracing::debug!(node = usage.metadata.name.as_deref(), observed_at = %usage.spec.observed_at,
                    "node usage not read: not rewritten for 30 min");
                Affected::new()
            }
            Event::InitApply(usage) | Event::Apply(usage) => {
                let mut index = ctx.index.write().unwrap_or_else(PoisonError::into_inner);
                // The node is the object's name: the one an agent's credential lets it write.
                index.apply_node_usage(usage.metadata.name.as_deref().unwrap_or_default(), &usage.spec.pods)
            }
            // A node's object goes with its Node, and the node's pods with it: nothing to forget here.
            Event::Init | Event::InitDone | Event::Delete(_) => Affected::new(),
        };
        if *ctx.synced.borrow() {
            triggers.send_all(affected, None);
        }
    }
}

/// Watches both kinds of mirrors' metadata (#34), when mirrors are written; a mirror deleted while its budget
/// exists has that budget reconciled, which writes it again.
async fn watch_mirrors(ctx: Arc<Context>, triggers: Triggers, health: Health, shutdown: CancellationToken) {
    if !ctx.settings.mirrors {
        return std::future::pending().await;
    }
    let listed = |which: fn(&mut Listed) -> &mut bool| {
        let (ctx, triggers, health) = (ctx.clone(), triggers.clone(), health.clone());
        move || {
            if ctx.mark_listed(which) {
                synced(&ctx, &triggers, &health);
            }
        }
    };
    // A cluster mirror's key has no namespace: a cluster budget's.
    let deleted = || {
        let (ctx, triggers) = (ctx.clone(), triggers.clone());
        move |key: ObjKey| {
            if *ctx.synced.borrow() {
                triggers.send_all(Affected::from([key]), None);
            }
        }
    };
    let namespaced = crate::mirror::watch::<GpuMemoryBudget>(
        ctx.client.clone(),
        <GpuMemoryBudget as crate::mirror::MirrorOwner>::mirrors(&ctx.mirrors),
        shutdown.clone(),
        listed(|l| &mut l.mirrors),
        deleted(),
    );
    let cluster = crate::mirror::watch::<ClusterGpuMemoryBudget>(
        ctx.client.clone(),
        <ClusterGpuMemoryBudget as crate::mirror::MirrorOwner>::mirrors(&ctx.mirrors),
        shutdown,
        listed(|l| &mut l.cluster_mirrors),
        deleted(),
    );
    futures::join!(namespaced, cluster);
}

/// Keeps the mirrors' Lease ([`gpubudget_common::mirror::Vouch`]): while this replica leads, mirrors are written
/// and their CRDs answer, and no budget has gone without a current mirror for
/// [`MISSING_BOUND`](gpubudget_common::mirror::MISSING_BOUND), it renews the Lease every
/// [`VOUCH_RENEW`](gpubudget_common::mirror::VOUCH_RENEW); otherwise it deletes it, so that every agent reads the
/// budgets themselves again. With mirrors off it deletes the Lease a previous operator left.
async fn vouch_mirrors(ctx: Arc<Context>, shutdown: CancellationToken) {
    use gpubudget_common::mirror::{MISSING_BOUND, VOUCH_RENEW, VOUCH_SECONDS};
    use k8s_openapi::api::coordination::v1::Lease;
    let Some((namespace, name)) = ctx.settings.mirrors_lease.clone() else {
        return std::future::pending().await;
    };
    let api: Api<Lease> = Api::namespaced(ctx.client.clone(), &namespace);
    let identity = ctx.settings.instance.clone().unwrap_or_else(|| "gpubudget-operator".to_owned());
    let (mut lag, mut vouched) = ([crate::mirror::Lag::default(), crate::mirror::Lag::default()], None::<bool>);
    let mut ticks = tokio::time::interval(VOUCH_RENEW);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            () = shutdown.cancelled() => return,
            _ = ticks.tick() => {}
        }
        if !ctx.is_leader() || !*ctx.synced.borrow() {
            continue;
        }
        let now = tokio::time::Instant::now();
        let why_not = if !ctx.settings.mirrors {
            Some("mirrors are off (--budget-mirrors=false)".to_owned())
        } else if !ctx.mirrors.iter().all(crate::mirror::Mirrors::available) {
            Some("the mirror CRDs do not answer".to_owned())
        } else {
            let oldest = ctx
                .mirrors
                .iter()
                .zip(&mut lag)
                .filter_map(|(m, l)| l.update(m.lagging(), now))
                .max_by_key(|(_, d)| *d);
            oldest.filter(|(_, d)| *d >= MISSING_BOUND).map(|(key, d)| {
                format!("budget {key} has had no current mirror for {}s (is its mirror write failing?)", d.as_secs())
            })
        };
        match why_not {
            None => {
                let lease = serde_json::json!({
                    "apiVersion": "coordination.k8s.io/v1",
                    "kind": "Lease",
                    "metadata": {"name": name},
                    "spec": {
                        "holderIdentity": identity,
                        "leaseDurationSeconds": VOUCH_SECONDS,
                        "renewTime": Timestamp::now().strftime("%Y-%m-%dT%H:%M:%S%.6fZ").to_string(),
                    },
                });
                let params = PatchParams::apply(&ctx.settings.field_manager).force();
                match api.patch(&name, &params, &Patch::Apply(&lease)).await {
                    Ok(_) => {
                        if vouched != Some(true) {
                            tracing::info!(lease = %name, "every budget has a current mirror: vouching for the mirrors");
                        }
                        vouched = Some(true);
                    }
                    Err(error) => {
                        tracing::warn!(%error, lease = %name, "cannot renew the mirrors' Lease; agents read the budgets once it expires")
                    }
                }
            }
            Some(why) => {
                if vouched != Some(false) {
                    match api.delete(&name, &kube::api::DeleteParams::default()).await {
                        Ok(_) => {}
                        Err(kube::Error::Api(e)) if e.code == 404 => {}
                        Err(error) => {
                            tracing::warn!(%error, lease = %name, "cannot delete the mirrors' Lease; agents read the budgets once it expires");
                            continue;
                        }
                    }
                    tracing::warn!(lease = %name, reason = %why, "not vouching for the mirrors: agents read the budgets themselves");
                    vouched = Some(false);
                }
            }
        }
    }
}

/// Feeds the namespaces' labels (metadata only) into the index; sends the budgets a relabel affects.
async fn watch_namespaces(ctx: Arc<Context>, triggers: Triggers, health: Health, shutdown: CancellationToken) {
    let mut stream = std::pin::pin!(crate::namespaces::events(ctx.client.clone()));
    while let Some(event) = next_event(&mut stream, &shutdown, "namespace").await {
        let listed = matches!(event, Event::InitDone);
        let affected = {
            let mut index = ctx.index.write().unwrap_or_else(PoisonError::into_inner);
            let affected = index.apply_namespace_event(&event);
            ctx.publish_caps_namespaces(&index);
            affected
        };
        if listed && ctx.mark_listed(|l| &mut l.namespaces) {
            synced(&ctx, &triggers, &health);
        }
        if *ctx.synced.borrow() {
            triggers.send_all(affected, None);
        }
    }
}

/// Every cache has listed: ready, and every budget of both kinds is reconciled.
fn synced(ctx: &Context, triggers: &Triggers, health: &Health) {
    let index = ctx.index.read().unwrap_or_else(PoisonError::into_inner);
    tracing::info!(budgets = index.budget_count(), pods = index.pod_count(), "budgets listed; reconciling");
    drop(index);
    health.set(CHECK_BUDGETS, true);
    triggers.reconcile_all();
}

/// What a budget kind's watch does to the index.
trait Indexed: StatusOwner {
    /// The watch's name in logs.
    const CACHE: &'static str;
    /// Which flag of [`Context::mark_listed`] its listing sets.
    fn listed(flags: &mut Listed) -> &mut bool;
    fn apply(index: &mut Index, obj: &Self) -> Affected;
    fn delete(index: &mut Index, key: &ObjKey) -> Affected;
    fn begin(index: &mut Index);
    fn end(index: &mut Index) -> Affected;
}

impl Indexed for GpuMemoryBudget {
    const CACHE: &'static str = "budgets";
    fn listed(flags: &mut Listed) -> &mut bool {
        &mut flags.budgets
    }
    fn apply(index: &mut Index, obj: &Self) -> Affected {
        index.apply_budget(obj)
    }
    fn delete(index: &mut Index, key: &ObjKey) -> Affected {
        index.delete_budget(key)
    }
    fn begin(index: &mut Index) {
        index.begin_budget_resync();
    }
    fn end(index: &mut Index) -> Affected {
        index.end_budget_resync()
    }
}

impl Indexed for ClusterGpuMemoryBudget {
    const CACHE: &'static str = "clusterbudgets";
    fn listed(flags: &mut Listed) -> &mut bool {
        &mut flags.cluster_budgets
    }
    fn apply(index: &mut Index, obj: &Self) -> Affected {
        index.apply_cluster_budget(obj)
    }
    fn delete(index: &mut Index, key: &ObjKey) -> Affected {
        index.delete_cluster_budget(&key.name)
    }
    fn begin(index: &mut Index) {
        index.begin_cluster_resync();
    }
    fn end(index: &mut Index) -> Affected {
        index.end_cluster_resync()
    }
}

/// Feeds a budget kind's watch into the index and the controller's store (`writer`); yields the budgets
/// whose generation changed (the controller reconciles those), and sends the other budgets each change
/// affects (those sharing its pods) to `triggers`. Once every cache has listed: ready, and every budget is
/// reconciled. A failure of the cluster budgets' watch before it lists (their CRD missing) counts as
/// listed, so the namespaced budgets' statuses are written meanwhile.
fn watch_budgets<K: Indexed>(
    ctx: Arc<Context>,
    writer: reflector::store::Writer<K>,
    triggers: Triggers,
    health: Health,
) -> impl futures::Stream<Item = Result<K, watcher::Error>> + Send {
    let api: Api<K> = Api::all(ctx.client.clone());
    let (index_ctx, error_ctx, modify_ctx) = (ctx.clone(), ctx.clone(), ctx);
    let (error_triggers, error_health) = (triggers.clone(), health.clone());
    let mut warned = false;
    watcher::watcher(api, watcher::Config::default().page_size(crate::namespaces::LIST_PAGE_SIZE))
        .default_backoff()
        .inspect_err(move |error| {
            if !warned {
                warned = true;
                tracing::warn!(cache = K::CACHE, %error, "budget watch failed; retrying with backoff");
            }
            if K::CACHE == ClusterGpuMemoryBudget::CACHE && error_ctx.mark_listed(K::listed) {
                synced(&error_ctx, &error_triggers, &error_health);
            }
        })
        // Managed fields are never read, top pods only compared: the cached budgets are smaller without them.
        .modify(move |b| {
            b.meta_mut().managed_fields = None;
            modify_ctx.drop_top_pods(b);
        })
        .reflect(writer)
        .inspect_ok(move |event| {
            let mut index = index_ctx.index.write().unwrap_or_else(PoisonError::into_inner);
            let budgets = K::mirrors(&index_ctx.mirrors);
            match event {
                Event::Init => budgets.budgets_begin(),
                Event::InitApply(b) | Event::Apply(b) => {
                    if let Some(k) = b.key() {
                        budgets.budget(k, Copied::of_budget(b.meta()));
                    }
                }
                Event::Delete(b) => {
                    if let Some(k) = b.key() {
                        budgets.budget(k, None);
                    }
                }
                Event::InitDone => budgets.budgets_end(),
            }
            let (affected, own, listed) = match event {
                Event::Init => {
                    K::begin(&mut index);
                    (Affected::new(), None, false)
                }
                Event::InitApply(b) | Event::Apply(b) => {
                    index_ctx.caught_up(b);
                    (K::apply(&mut index, b), b.key(), false)
                }
                Event::Delete(b) => {
                    let key = b.key();
                    if let Some(k) = &key {
                        index_ctx.forget(k);
                        if index_ctx.is_leader() {
                            crate::mirror::forget::<K>(k, K::mirrors(&index_ctx.mirrors), index_ctx.client.clone());
                        }
                    }
                    (key.as_ref().map(|k| K::delete(&mut index, k)).unwrap_or_default(), None, false)
                }
                Event::InitDone => (K::end(&mut index), None, true),
            };
            index_ctx.update_gauges(&index);
            index_ctx.publish_caps_namespaces(&index);
            drop(index);
            if listed && index_ctx.mark_listed(K::listed) {
                synced(&index_ctx, &triggers, &health);
            }
            if *index_ctx.synced.borrow() {
                // The budget itself comes through the controller's own trigger (when its generation
                // changed); the others whose pods it shares come from here.
                triggers.send_all(affected, own.as_ref());
            }
        })
        .touched_objects()
        .predicate_filter(predicates::generation, Default::default())
}

/// Runs the controllers until `shutdown` is cancelled (then finishes the reconciles under way).
pub async fn run(ctx: Arc<Context>, health: Health, shutdown: CancellationToken) -> anyhow::Result<()> {
    let (trigger_tx, trigger_rx) = unbounded::<ObjectRef<GpuMemoryBudget>>();
    let (cluster_tx, cluster_rx) = unbounded::<ObjectRef<ClusterGpuMemoryBudget>>();
    let (all_tx, all_rx) = unbounded::<()>();
    let (cluster_all_tx, cluster_all_rx) = unbounded::<()>();
    let triggers = Triggers { budgets: trigger_tx, cluster: cluster_tx, all: all_tx, cluster_all: cluster_all_tx };
    let (pods_listed_tx, mut pods_listed) = watch::channel(false);
    let pods = watch_pods(ctx.clone(), triggers.clone(), pods_listed_tx, health.clone(), shutdown.clone());

    // Reconcile everything when this replica becomes leader.
    let mut leader = ctx.leader.clone();
    let leader_all = triggers.clone();
    let leader_metric = ctx.metrics.leader.clone();
    let leadership = async move {
        let mut was = false;
        loop {
            let now = *leader.borrow_and_update();
            leader_metric.set(i64::from(now));
            if now && !was {
                tracing::info!("writing status (leader, or leader election off): reconciling every budget");
                leader_all.reconcile_all();
            }
            was = now;
            if leader.changed().await.is_err() {
                // The sender is gone: leadership cannot change any more.
                return std::future::pending::<()>().await;
            }
        }
    };

    let controllers = {
        let ctx = ctx.clone();
        let shutdown = shutdown.clone();
        let health = health.clone();
        let triggers = triggers.clone();
        async move {
            // Budgets are reconciled only with every pod known.
            tokio::select! {
                () = shutdown.cancelled() => return,
                _ = pods_listed.wait_for(|listed| *listed) => {}
            }
            let config = controller::Config::default().concurrency(ctx.settings.concurrency);
            let (reader, writer) = reflector::store();
            let budgets = watch_budgets::<GpuMemoryBudget>(ctx.clone(), writer, triggers.clone(), health.clone());
            let shutdown_signal = shutdown.clone();
            let namespaced = Controller::for_stream(budgets, reader)
                .with_config(config.clone())
                .reconcile_on(trigger_rx)
                .reconcile_all_on(all_rx)
                .graceful_shutdown_on(async move { shutdown_signal.cancelled().await })
                .run(reconcile, error_policy, ctx.clone())
                .for_each(|result| {
                    log_result(result);
                    std::future::ready(())
                });
            let (reader, writer) = reflector::store();
            let cluster = watch_budgets::<ClusterGpuMemoryBudget>(ctx.clone(), writer, triggers, health);
            let shutdown_signal = shutdown.clone();
            let cluster = Controller::for_stream(cluster, reader)
                .with_config(config)
                .reconcile_on(cluster_rx)
                .reconcile_all_on(cluster_all_rx)
                .graceful_shutdown_on(async move { shutdown_signal.cancelled().await })
                .run(reconcile, error_policy, ctx)
                .for_each(|result| {
                    log_result(result);
                    std::future::ready(())
                });
            futures::join!(namespaced, cluster);
        }
    };

    // The safety net: every budget reconciled again each `resync`, once the caches have synced.
    let resync_all = triggers.clone();
    let resync_ctx = ctx.clone();
    let resync = async move {
        let period = resync_ctx.settings.resync;
        let mut ticks = tokio::time::interval_at(tokio::time::Instant::now() + period, period);
        ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            ticks.tick().await;
            if *resync_ctx.synced.borrow() {
                resync_all.reconcile_all();
            }
        }
    };

    let mirrors = watch_mirrors(ctx.clone(), triggers.clone(), health.clone(), shutdown.clone());
    let vouch = vouch_mirrors(ctx.clone(), shutdown.clone());
    let node_usage = watch_node_usage(ctx.clone(), triggers.clone(), shutdown.clone());
    let namespaces = watch_namespaces(ctx.clone(), triggers, health, shutdown.clone());
    let labeller = Labeller {
        client: ctx.client(),
        wanted: ctx.caps_namespaces(),
        leader: ctx.leader_watch(),
        synced: ctx.synced_watch(),
        writes: ctx.metrics.namespace_label_writes.clone(),
    };
    let labels = caps_scope::label_namespaces(labeller, shutdown.clone());
    tokio::select! {
        result = pods => result?,
        () = leadership => {},
        () = resync => {},
        () = controllers => {},
        () = labels => {},
        () = namespaces => {},
        () = node_usage => {},
        () = mirrors => {},
        () = vouch => {},
    }
    Ok(())
}

type RunResult<K> = Result<(ObjectRef<K>, Action), controller::Error<Error, watcher::Error>>;

fn log_result<K: StatusOwner>(result: RunResult<K>) {
    match result {
        Ok(_) => {}
        Err(controller::Error::ReconcilerFailed(Error::InvalidSpec(error), obj)) => {
            tracing::debug!(budget = %obj, %error, "invalid budget; waiting for a change");
        }
        Err(controller::Error::ReconcilerFailed(error, obj)) => {
            tracing::warn!(budget = %obj, %error, label = error.metric_label().as_str(), "reconcile failed; retrying");
        }
        Err(controller::Error::ObjectNotFound(obj)) => tracing::debug!(budget = %obj, "budget gone"),
        Err(error) => tracing::warn!(%error, "controller"),
    }
}

/// A name for a budget in logs and events.
pub fn display(obj: &GpuMemoryBudget) -> String {
    format!("{}/{}", obj.namespace().unwrap_or_default(), obj.name_any())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn written(after: &str) -> Written {
        Written {
            uid: Some("u".into()),
            before: Some("1".into()),
            after: Some(after.into()),
            status: GpuMemoryBudgetStatus::default(),
        }
    }

    #[test]
    fn a_written_status_is_kept_only_until_the_watch_delivers_it_whichever_comes_first() {
        let key = ObjKey::new("a", "llm");
        let rv = |v: &str| Some(v.to_owned());
        // The answer first, then the watch: kept, then dropped.
        let mut writes = Writes::default();
        writes.begin(&key);
        writes.answered(&key, Some(written("2")));
        assert_eq!(writes.done.len(), 1, "the cache does not show it yet");
        writes.seen(&key, &rv("2"));
        assert!(writes.done.is_empty() && writes.in_flight.is_empty());

        // The watch first (the write's own event), then the answer: never kept.
        writes.begin(&key);
        writes.seen(&key, &rv("3"));
        writes.answered(&key, Some(written("3")));
        assert!(writes.done.is_empty() && writes.in_flight.is_empty());

        // Another writer's event during the write: ours is kept until the watch shows it.
        writes.begin(&key);
        writes.seen(&key, &rv("4"));
        writes.answered(&key, Some(written("5")));
        assert_eq!(writes.done.get(&key).and_then(|w| w.after.clone()), rv("5"));
        writes.seen(&key, &rv("4"));
        assert_eq!(writes.done.len(), 1, "an older event drops nothing");

        // A failed write keeps nothing of its own.
        let other = ObjKey::new("a", "web");
        writes.begin(&other);
        writes.answered(&other, None);
        assert!(!writes.done.contains_key(&other) && writes.in_flight.is_empty());
    }

    #[test]
    fn backoff_doubles_and_saturates() {
        let (min, max) = (Duration::from_millis(250), Duration::from_secs(300));
        assert_eq!(backoff(1, min, max), min);
        assert_eq!(backoff(3, min, max), Duration::from_secs(1));
        assert_eq!(backoff(40, min, max), max);
        assert_eq!(backoff(0, min, max), min);
    }
}
