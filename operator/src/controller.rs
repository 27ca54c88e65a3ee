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
//! - Reconciles start once both caches have listed, so a restart does not write half-known statuses.
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
use gpubudget_common::{Budget, GpuMemoryBudget};
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

use crate::error::Error;
use crate::index::{Affected, Index};
use crate::metrics::Metrics;
use crate::pods::{ObjKey, PodMeta};
use crate::status::{self, notices, same_ignoring_timestamps};

/// The field manager of every status write (and the events' reporting controller).
pub const FIELD_MANAGER: &str = "gpubudget-operator";
/// Readiness check: the pod cache has listed.
pub const CHECK_PODS: &str = "pods-synced";
/// Readiness check: the budget cache has listed.
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
    /// A valid budget is reconciled again after this long even if nothing changed (a safety net).
    pub resync: Duration,
    /// First retry delay after a transient failure (doubling up to `max_backoff`).
    pub min_backoff: Duration,
    /// Longest retry delay.
    pub max_backoff: Duration,
    /// This replica, for events (`reportingInstance`).
    pub instance: Option<String>,
}

impl Default for Settings {
    fn default() -> Self {
        Self {
            field_manager: FIELD_MANAGER.to_owned(),
            pod_field_selector: Some(ACTIVE_PODS.to_owned()),
            concurrency: 16,
            resync: Duration::from_secs(600),
            min_backoff: Duration::from_millis(250),
            max_backoff: Duration::from_secs(300),
            instance: None,
        }
    }
}

/// A status this replica wrote, kept until the cache shows it (so a reconcile in between reads it).
#[derive(Debug)]
struct Written {
    uid: Option<String>,
    before: Option<String>,
    after: Option<String>,
    status: GpuMemoryBudgetStatus,
}

/// What reconciles share.
pub struct Context {
    client: Client,
    /// The pod ↔ budget index.
    pub index: Arc<RwLock<Index>>,
    metrics: Metrics,
    recorder: Recorder,
    leader: watch::Receiver<bool>,
    settings: Settings,
    synced: watch::Sender<bool>,
    written: Mutex<HashMap<ObjKey, Written>>,
    failures: Mutex<HashMap<ObjKey, u32>>,
    caps_namespaces: watch::Sender<BTreeSet<String>>,
}

impl std::fmt::Debug for Context {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Context").field("settings", &self.settings).finish_non_exhaustive()
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

impl Context {
    /// A context. `leader` says whether this replica may write (constant `true` without election).
    pub fn new(client: Client, metrics: Metrics, leader: watch::Receiver<bool>, settings: Settings) -> Self {
        let reporter = Reporter { controller: settings.field_manager.clone(), instance: settings.instance.clone() };
        Self {
            recorder: Recorder::new(client.clone(), reporter),
            client,
            index: Arc::default(),
            metrics,
            leader,
            settings,
            synced: watch::Sender::new(false),
            written: Mutex::default(),
            failures: Mutex::default(),
            caps_namespaces: watch::Sender::new(BTreeSet::new()),
        }
    }

    /// The client.
    pub fn client(&self) -> Client {
        self.client.clone()
    }

    /// The event recorder (`reportingController: gpubudget-operator`).
    pub fn recorder(&self) -> &Recorder {
        &self.recorder
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

    /// The status to compute from, and the resourceVersion to write against: ours if the cache has not yet
    /// caught up with our last write, else the cache's.
    fn previous(&self, key: &ObjKey, obj: &GpuMemoryBudget) -> (Option<GpuMemoryBudgetStatus>, Option<String>) {
        let rv = obj.metadata.resource_version.clone();
        let mut written = lock(&self.written);
        if let Some(w) = written.get(key) {
            if w.uid == obj.metadata.uid && w.before == rv && rv.is_some() {
                return (Some(w.status.clone()), w.after.clone());
            }
            written.remove(key);
        }
        (obj.status.clone(), rv)
    }

    fn update_gauges(&self, index: &Index) {
        self.metrics.budgets.set(index.budget_count() as i64);
        self.metrics.budgets_invalid.set(index.invalid_budget_count() as i64);
        self.metrics.pods.set(index.pod_count() as i64);
        self.metrics.matched_pods.set(index.selected_pod_count() as i64);
    }
}

/// Reconciles one budget: computes its status and writes it if it changed.
pub async fn reconcile(obj: Arc<GpuMemoryBudget>, ctx: Arc<Context>) -> Result<Action, Error> {
    let started = Instant::now();
    ctx.metrics.reconciles.inc();
    let result = reconcile_inner(&obj, &ctx).await;
    ctx.metrics.duration.observe(started.elapsed().as_secs_f64());
    let key = ObjKey::of(&obj.metadata);
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
            lock(&ctx.written).remove(key);
        }
    }
    result
}

async fn reconcile_inner(obj: &GpuMemoryBudget, ctx: &Context) -> Result<Action, Error> {
    let key = ObjKey::of(&obj.metadata).ok_or(Error::Unnamed)?;
    if !*ctx.synced.borrow() || !ctx.is_leader() {
        // Caches not listed yet, or a follower: nothing to write. All budgets are reconciled when that changes.
        return Ok(Action::await_change());
    }
    let (previous, resource_version) = ctx.previous(&key, obj);
    let (next, spec_error) = {
        let index = ctx.index.read().unwrap_or_else(PoisonError::into_inner);
        let inputs = index.inputs(&key);
        let spec_error = match inputs.spec {
            Some(spec) => spec.err().cloned(),
            None => Budget::compile(obj).err(),
        };
        (status::compute(obj, &inputs, previous.as_ref(), Timestamp::now()), spec_error)
    };
    let done = || match &spec_error {
        Some(error) => Err(Error::InvalidSpec(error.clone())),
        None => Ok(Action::requeue(ctx.settings.resync)),
    };
    if previous.as_ref().is_some_and(|p| same_ignoring_timestamps(p, &next)) {
        return done();
    }
    let mut metadata = serde_json::json!({});
    if let Some(rv) = &resource_version {
        metadata["resourceVersion"] = rv.clone().into();
    }
    let patch = serde_json::json!({
        "apiVersion": GpuMemoryBudget::api_version(&()),
        "kind": GpuMemoryBudget::kind(&()),
        "metadata": metadata,
        "status": serde_json::to_value(&next).map_err(Error::Serialize)?,
    });
    let api: Api<GpuMemoryBudget> = Api::namespaced(ctx.client.clone(), &key.namespace);
    let params = PatchParams::apply(&ctx.settings.field_manager).force();
    let written = api.patch_status(&key.name, &params, &Patch::Apply(&patch)).await?;
    ctx.metrics.status_writes.inc();
    tracing::debug!(budget = %key, matched = next.matched_pods, over = next.pods_over_budget, evictions = next.evictions, "status written");
    lock(&ctx.written).insert(
        key.clone(),
        Written {
            uid: obj.metadata.uid.clone(),
            before: resource_version,
            after: written.metadata.resource_version.clone(),
            status: written.status.clone().unwrap_or(next.clone()),
        },
    );
    let reference = obj.object_ref(&());
    for notice in notices(previous.as_ref(), &next) {
        let event = KubeEvent {
            type_: if notice.warning { EventType::Warning } else { EventType::Normal },
            reason: notice.reason.to_owned(),
            note: Some(notice.note),
            action: "Reconcile".to_owned(),
            secondary: None,
        };
        match ctx.recorder.publish(&event, &reference).await {
            Ok(()) => {
                ctx.metrics.events.inc();
            }
            Err(error) => tracing::warn!(budget = %key, %error, reason = notice.reason, "cannot publish event"),
        }
    }
    done()
}

/// What to do after a failed reconcile: transient failures retry with exponential backoff per budget; an
/// invalid budget waits for a change (its status already says why).
pub fn error_policy(obj: Arc<GpuMemoryBudget>, error: &Error, ctx: Arc<Context>) -> Action {
    if !error.is_transient() {
        return Action::await_change();
    }
    let Some(key) = ObjKey::of(&obj.metadata) else { return Action::await_change() };
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

fn to_ref(key: &ObjKey) -> ObjectRef<GpuMemoryBudget> {
    ObjectRef::new(&key.name).within(&key.namespace)
}

fn send_all(tx: &UnboundedSender<ObjectRef<GpuMemoryBudget>>, affected: Affected, except: Option<&ObjKey>) {
    for key in affected.iter().filter(|k| Some(*k) != except) {
        let _ = tx.unbounded_send(to_ref(key));
    }
}

/// Feeds the pod metadata watch into the index; sends the budgets each change affects.
async fn watch_pods(
    ctx: Arc<Context>,
    triggers: UnboundedSender<ObjectRef<GpuMemoryBudget>>,
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
                    meta.info().map(|info| index.apply_pod(info)).unwrap_or_default()
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
            send_all(&triggers, affected, None);
        }
    }
}

/// Feeds the budget watch into the index and the controller's store (`writer`); yields the budgets whose
/// generation changed (the controller reconciles those), and sends the other budgets each change affects
/// (those sharing its pods) to `triggers`. Once listed: ready, and every budget is reconciled (`all`).
fn watch_budgets(
    ctx: Arc<Context>,
    writer: reflector::store::Writer<GpuMemoryBudget>,
    triggers: UnboundedSender<ObjectRef<GpuMemoryBudget>>,
    all_tx: UnboundedSender<()>,
    health: Health,
) -> impl futures::Stream<Item = Result<GpuMemoryBudget, watcher::Error>> + Send {
    let api: Api<GpuMemoryBudget> = Api::all(ctx.client.clone());
    let index_ctx = ctx;
    let mut budgets_listed = false;
    let budget_triggers = triggers;
    watcher(api)
        .default_backoff()
        // Managed fields are never read; the cached budgets are smaller without them.
        .modify(|b| b.metadata.managed_fields = None)
        .reflect(writer)
        .inspect_ok(move |event| {
            let mut index = index_ctx.index.write().unwrap_or_else(PoisonError::into_inner);
            let (affected, own) = match event {
                Event::Init => {
                    index.begin_budget_resync();
                    (Affected::new(), None)
                }
                Event::InitApply(b) | Event::Apply(b) => (index.apply_budget(b), ObjKey::of(&b.metadata)),
                Event::Delete(b) => {
                    let key = ObjKey::of(&b.metadata);
                    if let Some(k) = &key {
                        lock(&index_ctx.written).remove(k);
                        lock(&index_ctx.failures).remove(k);
                    }
                    (key.as_ref().map(|k| index.delete_budget(k)).unwrap_or_default(), None)
                }
                Event::InitDone => {
                    let affected = index.end_budget_resync();
                    if !budgets_listed {
                        budgets_listed = true;
                        tracing::info!(
                            budgets = index.budget_count(),
                            pods = index.pod_count(),
                            "budgets listed; reconciling"
                        );
                        health.set(CHECK_BUDGETS, true);
                        index_ctx.synced.send_replace(true);
                        let _ = all_tx.unbounded_send(());
                    }
                    (affected, None)
                }
            };
            index_ctx.update_gauges(&index);
            let caps_namespaces = index.caps_namespaces();
            drop(index);
            index_ctx.caps_namespaces.send_if_modified(|known| {
                let changed = *known != caps_namespaces;
                *known = caps_namespaces;
                changed
            });
            if budgets_listed {
                // The budget itself comes through the controller's own trigger (when its generation
                // changed); the others whose pods it shares come from here.
                send_all(&budget_triggers, affected, own.as_ref());
            }
        })
        .touched_objects()
        .predicate_filter(predicates::generation, Default::default())
}

/// Runs the controller until `shutdown` is cancelled (then finishes the reconciles under way).
pub async fn run(ctx: Arc<Context>, health: Health, shutdown: CancellationToken) -> anyhow::Result<()> {
    let (trigger_tx, trigger_rx) = unbounded::<ObjectRef<GpuMemoryBudget>>();
    let (all_tx, all_rx) = unbounded::<()>();
    let (pods_listed_tx, mut pods_listed) = watch::channel(false);
    let pods = watch_pods(ctx.clone(), trigger_tx.clone(), pods_listed_tx, health.clone(), shutdown.clone());

    // Reconcile everything when this replica becomes leader.
    let mut leader = ctx.leader.clone();
    let leader_all = all_tx.clone();
    let leader_metric = ctx.metrics.leader.clone();
    let leadership = async move {
        let mut was = false;
        loop {
            let now = *leader.borrow_and_update();
            leader_metric.set(i64::from(now));
            if now && !was {
                tracing::info!("writing status (leader, or leader election off): reconciling every budget");
                let _ = leader_all.unbounded_send(());
            }
            was = now;
            if leader.changed().await.is_err() {
                // The sender is gone: leadership cannot change any more.
                return std::future::pending::<()>().await;
            }
        }
    };

    let controller = {
        let ctx = ctx.clone();
        let shutdown = shutdown.clone();
        async move {
            // Budgets are reconciled only with every pod known.
            tokio::select! {
                () = shutdown.cancelled() => return,
                _ = pods_listed.wait_for(|listed| *listed) => {}
            }
            let (reader, writer) = reflector::store();
            let budgets = watch_budgets(ctx.clone(), writer, trigger_tx.clone(), all_tx, health);
            let shutdown_signal = shutdown.clone();
            Controller::for_stream(budgets, reader)
                .with_config(controller::Config::default().concurrency(ctx.settings.concurrency))
                .reconcile_on(trigger_rx)
                .reconcile_all_on(all_rx)
                .graceful_shutdown_on(async move { shutdown_signal.cancelled().await })
                .run(reconcile, error_policy, ctx)
                .for_each(|result| {
                    log_result(result);
                    std::future::ready(())
                })
                .await;
        }
    };

    let labels = crate::caps_webhook::label_namespaces(ctx.clone(), shutdown.clone());
    tokio::select! {
        result = pods => result?,
        () = leadership => {},
        () = controller => {},
        () = labels => {},
    }
    Ok(())
}

fn watcher(api: Api<GpuMemoryBudget>) -> impl futures::Stream<Item = watcher::Result<Event<GpuMemoryBudget>>> + Send {
    watcher::watcher(api, watcher::Config::default())
}

type RunResult = Result<(ObjectRef<GpuMemoryBudget>, Action), controller::Error<Error, watcher::Error>>;

fn log_result(result: RunResult) {
    match result {
        Ok(_) => {}
        Err(controller::Error::ReconcilerFailed(Error::InvalidSpec(error), obj)) => {
            tracing::debug!(budget = %obj, %error, "invalid budget; waiting for a change");
        }
        Err(controller::Error::ReconcilerFailed(error, obj)) => {
            tracing::warn!(budget = %obj, %error, label = error.metric_label(), "reconcile failed; retrying");
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

    #[test]
    fn backoff_doubles_and_saturates() {
        let (min, max) = (Duration::from_millis(250), Duration::from_secs(300));
        assert_eq!(backoff(1, min, max), min);
        assert_eq!(backoff(3, min, max), Duration::from_secs(1));
        assert_eq!(backoff(40, min, max), max);
        assert_eq!(backoff(0, min, max), min);
    }
}
