//! Namespace totals (`ClusterGpuMemoryQuota`, #23 part 3): the operator sees every node's records, so it
//! adds them up per namespace and, as leader only, evicts the pod that took a namespace over its quota.
//!
//! ```text
//!  quotas ──► reflector ─┐
//!  namespaces (index) ───┼─► every `interval`, leader only: per quota
//!  pod index (records) ──┘     compute (pure: common's quota::decide per namespace) ─► status (SSA, own
//!                              field manager, resourceVersion precondition) ─► evict / delete ─► events
//! ```
//!
//! - What must survive a change of leader (time over banked, the eviction under way) is in the quota's
//!   status, written **before** an eviction is asked for and against the resourceVersion it was computed
//!   from: a deposed leader's write conflicts and it does not evict; a new leader reads the period and the
//!   pending eviction back and neither restarts the one nor repeats the other.
//! - No double eviction with an agent: a pod whose record says `Evicting` (its agent evicts it for its own
//!   budget) or that is terminating is never picked, and pods going already count as gone when deciding
//!   whether anything more must go.
//! - Evictions go through the Eviction API (PodDisruptionBudgets apply) with the quota's grace; a refusal is
//!   told as an event and retried every `interval`; after `blockedEvictionTimeoutSeconds` the pod is
//!   deleted with the same grace, as the agent does.
//! - Observe (`--enforcement Observe`, or the quota's `spec.enforcement`): the same passes, and the eviction that
//!   would be due is told (`NamespaceGpuMemoryWouldEvict`, `status.namespaces[].wouldEvict`,
//!   `gpubudget_operator_quota_would_evict_total`) and never asked for; the condition says `Observing`.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use futures::StreamExt;
use gpubudget_common::crd::{
    ClusterGpuMemoryQuotaStatus, EvictionRecord, NamespaceTotal, PendingEviction, QUOTA_NAMESPACES_DETAILED,
    QUOTA_NAMESPACES_MAX, QUOTA_STATUS_BYTES_MAX, QUOTA_TOP_PODS_MAX, TopPod, WouldEvict,
};
use gpubudget_common::enforcement::{Enforcement, Mode, for_quota};
use gpubudget_common::eviction::eviction_body;
use gpubudget_common::quantity::HumanBytes;
use gpubudget_common::quota::{self, Act, Notice, Pending, QuotaPod, Remembered, Withheld};
use gpubudget_common::state::Tracker;
use gpubudget_common::{Budget, BudgetState, ClusterGpuMemoryQuota, PodLabels};
use k8s_openapi::api::core::v1::{ObjectReference, Pod};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;
use k8s_openapi::jiff::Timestamp;
use kube::api::{DeleteParams, Patch, PatchParams, PostParams, Preconditions};
use kube::runtime::events::{Event as KubeEvent, EventType};
use kube::runtime::watcher::{self, Event};
use kube::runtime::{WatchStreamExt, reflector};
use kube::{Api, Resource, ResourceExt};
use tokio_util::sync::CancellationToken;

use crate::controller::Context;
use crate::index::Index;
use crate::pods::Uid;

/// The field manager of quota status writes (its own: the budget status controller's writes never touch it).
pub const FIELD_MANAGER: &str = "gpubudget-operator/quota";
/// How often each quota is added up (and a refused eviction retried).
pub const INTERVAL: Duration = Duration::from_secs(5);

/// Milliseconds since the epoch, now (a wall clock: the status keeps times other replicas compare).
pub type Clock = Arc<dyn Fn() -> u64 + Send + Sync>;

/// How the quota loop runs.
#[derive(Clone)]
pub struct QuotaSettings {
    /// How often quotas are added up.
    pub interval: Duration,
    /// Field manager of status writes.
    pub field_manager: String,
    /// The time (tests give one that follows tokio's paused clock).
    pub clock: Clock,
    /// Whether quotas that leave it unset evict (`--enforcement`).
    pub enforcement: Enforcement,
}

impl std::fmt::Debug for QuotaSettings {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("QuotaSettings").field("interval", &self.interval).finish_non_exhaustive()
    }
}

impl Default for QuotaSettings {
    fn default() -> Self {
        Self {
            interval: INTERVAL,
            field_manager: FIELD_MANAGER.to_owned(),
            clock: Arc::new(|| u64::try_from(Timestamp::now().as_millisecond()).unwrap_or(0)),
            enforcement: Enforcement::Enforce,
        }
    }
}

fn rfc3339(ms: u64) -> String {
    Timestamp::from_millisecond(i64::try_from(ms).unwrap_or(i64::MAX)).map(|t| t.to_string()).unwrap_or_default()
}

fn parse_ms(text: &str) -> Option<u64> {
    text.parse::<Timestamp>().ok().and_then(|t| u64::try_from(t.as_millisecond()).ok())
}

fn bytes_i64(bytes: u64) -> i64 {
    i64::try_from(bytes).unwrap_or(i64::MAX)
}

/// What a namespace's status entry remembers, for the decision.
pub fn remembered(entry: &NamespaceTotal) -> Remembered {
    let last = entry.last_sample.as_deref().and_then(parse_ms).map(|at| (at, entry.last_over));
    Remembered {
        tracker: Tracker { state: entry.state, over_ms: u64::try_from(entry.over_millis).unwrap_or(0), last },
        pending: entry.pending_eviction.as_ref().map(|p| Pending {
            pod: p.pod.clone(),
            uid: p.uid.clone(),
            node: p.node.clone(),
            requested_at_ms: parse_ms(&p.requested_at).unwrap_or(0),
            usage_bytes: u64::try_from(p.usage_bytes).unwrap_or(0),
            accepted: p.accepted,
        }),
        withheld: entry
            .would_evict
            .as_ref()
            .map(|w| Withheld { pod: w.pod.clone(), since_ms: parse_ms(&w.since).unwrap_or(0) }),
    }
}

/// One namespace's pods as the decision reads them: those the quota's selectors pick, with a record.
pub fn quota_pods(index: &Index, quota: &Budget) -> BTreeMap<String, Vec<QuotaPod>> {
    let mut out: BTreeMap<String, Vec<QuotaPod>> = BTreeMap::new();
    for (namespace, pods) in index.pods_by_namespace() {
        let labels = index.namespace_labels(namespace);
        for pod in pods {
            let Some(record) = &pod.record else { continue };
            if !quota.selects(&PodLabels::new(namespace, labels, &pod.labels)) {
                continue;
            }
            out.entry(namespace.to_owned()).or_default().push(QuotaPod {
                name: pod.name.to_string(),
                uid: pod.uid.to_string(),
                node: Some(record.node.to_string()).filter(|n| !n.is_empty()),
                started_ms: pod.started_ms.unwrap_or(0),
                usage_bytes: record.usage_bytes,
                state: record.state,
                terminating: pod.terminating,
                exempt: pod.exempt,
            });
        }
    }
    out
}

/// What to do after a status is written: an eviction or delete of one pod.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Action {
    /// The namespace.
    pub namespace: String,
    /// The pod and what the quota remembers of its eviction.
    pub pending: Pending,
    /// Evict or delete.
    pub act: Act,
}

/// A quota's next status, what to do, and the events to publish ((namespace, notice)).
#[derive(Debug, Clone, Default)]
pub struct Outcome {
    /// The status to write.
    pub status: ClusterGpuMemoryQuotaStatus,
    /// Evictions or deletes to do once it is written.
    pub actions: Vec<Action>,
    /// Events.
    pub notices: Vec<(String, Notice)>,
    /// Pods gone after an eviction, counted now.
    pub evicted: usize,
    /// Evictions observe mode withheld, told now (once per episode).
    pub would_evict: usize,
}

fn ready(previous: &ClusterGpuMemoryQuotaStatus, status: &str, reason: &str, message: String, now: u64) -> Condition {
    let kept = previous.conditions.iter().find(|c| c.type_ == "Ready" && c.status == status);
    Condition {
        type_: "Ready".into(),
        status: status.into(),
        reason: reason.into(),
        message,
        observed_generation: None,
        last_transition_time: kept.map(|c| c.last_transition_time.clone()).unwrap_or_else(|| {
            k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(
                Timestamp::from_millisecond(i64::try_from(now).unwrap_or(0)).unwrap_or_default(),
            )
        }),
    }
}

/// Computes a quota's status and actions from its pods (pure). `pods` are the selected pods per namespace;
/// `operator` is the operator's `--enforcement`, for a quota that leaves it unset.
pub fn compute(
    quota: &ClusterGpuMemoryQuota,
    operator: Enforcement,
    pods: &BTreeMap<String, Vec<QuotaPod>>,
    previous: &ClusterGpuMemoryQuotaStatus,
    now: u64,
) -> Outcome {
    let mut out = Outcome::default();
    out.status.observed_generation = quota.metadata.generation;
    out.status.evictions = previous.evictions;
    out.status.last_eviction = previous.last_eviction.clone();
    let compiled = match quota::compile(quota) {
        Ok(compiled) => compiled,
        Err(error) => {
            // Nothing is enforced, and nothing remembered is kept (a fixed spec starts afresh).
            out.status.conditions = vec![ready(previous, "False", "InvalidSpec", error.to_string(), now)];
            return out;
        }
    };
    let mode = for_quota(operator, quota.spec.enforcement, &quota.key());
    let before: BTreeMap<&str, &NamespaceTotal> =
        previous.namespaces.iter().map(|n| (n.namespace.as_str(), n)).collect();
    let names: std::collections::BTreeSet<&str> =
        pods.keys().map(String::as_str).chain(before.keys().copied()).collect();
    let mut entries = Vec::new();
    for namespace in names {
        let here = pods.get(namespace).map(Vec::as_slice).unwrap_or_default();
        let prev = before.get(namespace).map(|e| remembered(e)).unwrap_or_default();
        let decision = quota::decide(&compiled, &mode, namespace, here, &prev, now);
        out.would_evict += decision.notices.iter().filter(|n| n.reason == quota::REASON_WOULD_EVICT).count();
        if let Some(done) = &decision.evicted {
            out.evicted += 1;
            out.status.evictions += 1;
            out.status.last_eviction = Some(EvictionRecord {
                pod: done.pod.clone(),
                node: done.node.clone(),
                time: rfc3339(done.requested_at_ms),
                usage: HumanBytes(done.usage_bytes).to_string(),
            });
        }
        if let (Some(act), Some(pending)) = (&decision.act, &decision.next.pending) {
            out.actions.push(Action { namespace: namespace.to_owned(), pending: pending.clone(), act: act.clone() });
        }
        out.notices.extend(decision.notices.iter().map(|n| (namespace.to_owned(), n.clone())));
        let mut top: Vec<&QuotaPod> = here.iter().filter(|p| p.usage_bytes > 0).collect();
        top.sort_by(|a, b| b.usage_bytes.cmp(&a.usage_bytes).then_with(|| a.name.cmp(&b.name)));
        let next = &decision.next;
        let entry = NamespaceTotal {
            namespace: namespace.to_owned(),
            total: HumanBytes(decision.total).to_string(),
            total_bytes: bytes_i64(decision.total),
            limit: compiled.limit_text.clone(),
            state: next.tracker.state,
            pods: i64::try_from(top.len()).unwrap_or(i64::MAX),
            over_millis: bytes_i64(next.tracker.over_ms),
            last_sample: next.tracker.last.map(|(at, _)| rfc3339(at)),
            last_over: next.tracker.last.is_some_and(|(_, over)| over),
            pending_eviction: next.pending.as_ref().map(|p| PendingEviction {
                pod: p.pod.clone(),
                uid: p.uid.clone(),
                node: p.node.clone(),
                requested_at: rfc3339(p.requested_at_ms),
                usage_bytes: bytes_i64(p.usage_bytes),
                accepted: p.accepted,
            }),
            would_evict: next.withheld.as_ref().map(|w| WouldEvict { pod: w.pod.clone(), since: rfc3339(w.since_ms) }),
            top_pods: top
                .iter()
                .take(QUOTA_TOP_PODS_MAX)
                .map(|p| TopPod {
                    name: p.name.clone(),
                    node: p.node.clone(),
                    usage: HumanBytes(p.usage_bytes).to_string(),
                    usage_bytes: bytes_i64(p.usage_bytes),
                    state: p.state,
                    share: None,
                })
                .collect(),
        };
        // A namespace with nothing held and nothing to remember is left out.
        if entry.total_bytes > 0 || remembers(&entry) {
            entries.push(entry);
        }
    }
    out.status.namespaces_selected = i64::try_from(entries.iter().filter(|e| e.total_bytes > 0).count()).unwrap_or(0);
    out.status.namespaces_over = i64::try_from(entries.iter().filter(|e| e.state.is_over()).count()).unwrap_or(0);
    // An eviction under way first, then what must be remembered (over or near, time banked), then the largest
    // totals.
    entries.sort_by(|a, b| {
        let rank = |e: &NamespaceTotal| (e.pending_eviction.is_some(), remembers(e));
        rank(b).cmp(&rank(a)).then(b.total_bytes.cmp(&a.total_bytes)).then_with(|| a.namespace.cmp(&b.namespace))
    });
    let (stored, not_stored) = stored_entries(entries);
    out.status.namespaces = stored;
    out.status.namespaces_not_stored = (not_stored > 0).then(|| i64::try_from(not_stored).unwrap_or(i64::MAX));
    out.status.conditions = vec![ready_condition(previous, &compiled, &mode, now)];
    out
}

/// `Ready`: what the quota enforces, or, observing, that it evicts nothing and who said so.
fn ready_condition(previous: &ClusterGpuMemoryQuotaStatus, compiled: &Budget, mode: &Mode, now: u64) -> Condition {
    let rule = format!(
        "each selected namespace may hold {} of GPU memory in total; action {} after {}s over",
        compiled.limit_text, compiled.action, compiled.over_limit_seconds
    );
    if mode.observes() {
        let note = format!(
            "{rule}; observe mode ({}): the pod it would evict is told (NamespaceGpuMemoryWouldEvict, \
             status.namespaces[].wouldEvict), nothing is evicted",
            mode.set_by
        );
        ready(previous, "True", "Observing", note, now)
    } else {
        ready(previous, "True", "Enforced", rule, now)
    }
}

/// Whether a namespace's entry holds something a later pass (or a new leader) needs: over or near the
/// limit, time banked, an eviction under way.
fn remembers(entry: &NamespaceTotal) -> bool {
    entry.over_millis > 0 || entry.pending_eviction.is_some() || entry.state != BudgetState::Within
}

/// What of the sorted entries the status keeps (#33): the first [`QUOTA_NAMESPACES_DETAILED`] whole; after
/// them, every entry with something to remember, without its pods, up to [`QUOTA_NAMESPACES_MAX`] entries
/// and [`QUOTA_STATUS_BYTES_MAX`] bytes; and how many entries with something to remember did not fit. Linear
/// in the entries.
fn stored_entries(entries: Vec<NamespaceTotal>) -> (Vec<NamespaceTotal>, usize) {
    let (mut stored, mut bytes, mut not_stored) = (Vec::new(), 0usize, 0usize);
    for (i, mut entry) in entries.into_iter().enumerate() {
        if i >= QUOTA_NAMESPACES_DETAILED {
            if !remembers(&entry) {
                continue;
            }
            entry.top_pods.clear();
        }
        let size = serde_json::to_vec(&entry).map_or(usize::MAX, |v| v.len() + 1);
        if stored.len() >= QUOTA_NAMESPACES_MAX || bytes.saturating_add(size) > QUOTA_STATUS_BYTES_MAX {
            not_stored += usize::from(remembers(&entry));
            continue;
        }
        bytes += size;
        stored.push(entry);
    }
    (stored, not_stored)
}

/// Whether two statuses say the same, the last sample's time aside (it changes every pass; writing only
/// for it would write every quota every few seconds, and a stale one only makes a new leader count the
/// time since as the last sample said, which is what happened).
pub fn same_but_for_sample_times(a: &ClusterGpuMemoryQuotaStatus, b: &ClusterGpuMemoryQuotaStatus) -> bool {
    let strip = |s: &ClusterGpuMemoryQuotaStatus| {
        let mut s = s.clone();
        for n in &mut s.namespaces {
            n.last_sample = None;
        }
        s
    };
    strip(a) == strip(b)
}

#[derive(Debug)]
struct Written {
    uid: Option<String>,
    before: Option<String>,
    after: Option<String>,
    status: ClusterGpuMemoryQuotaStatus,
}

/// The quota loop's own state.
struct Quotas {
    ctx: Arc<Context>,
    settings: QuotaSettings,
    written: Mutex<HashMap<String, Written>>,
}

impl Quotas {
    /// The status to compute from and the resourceVersion to write against: ours until the cache shows it.
    fn previous(&self, quota: &ClusterGpuMemoryQuota) -> (ClusterGpuMemoryQuotaStatus, Option<String>) {
        let rv = quota.metadata.resource_version.clone();
        let mut written = self.written.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(w) = written.get(&quota.name_any()) {
            if w.uid == quota.metadata.uid && w.before == rv && rv.is_some() {
                return (w.status.clone(), w.after.clone());
            }
            written.remove(&quota.name_any());
        }
        (quota.status.clone().unwrap_or_default(), rv)
    }

    async fn reconcile(&self, quota: &ClusterGpuMemoryQuota) -> anyhow::Result<()> {
        let name = quota.name_any();
        let now = (self.settings.clock)();
        let (previous, resource_version) = self.previous(quota);
        let pods = match quota::compile(quota) {
            Ok(compiled) => {
                let index = self.ctx.index.read().unwrap_or_else(PoisonError::into_inner);
                quota_pods(&index, &compiled)
            }
            Err(_) => BTreeMap::new(),
        };
        let outcome = compute(quota, self.settings.enforcement, &pods, &previous, now);
        if !same_but_for_sample_times(&previous, &outcome.status) {
            let mut metadata = serde_json::json!({});
            if let Some(rv) = &resource_version {
                metadata["resourceVersion"] = rv.clone().into();
            }
            let patch = serde_json::json!({
                "apiVersion": ClusterGpuMemoryQuota::api_version(&()),
                "kind": ClusterGpuMemoryQuota::kind(&()),
                "metadata": metadata,
                "status": serde_json::to_value(&outcome.status)?,
            });
            let api: Api<ClusterGpuMemoryQuota> = Api::all(self.ctx.client());
            let params = PatchParams::apply(&self.settings.field_manager).force();
            // A conflict (a stale cache, or another replica wrote): nothing is done; the next pass reads again.
            let written = api.patch_status(&name, &params, &Patch::Apply(&patch)).await?;
            self.written.lock().unwrap_or_else(PoisonError::into_inner).insert(
                name.clone(),
                Written {
                    uid: quota.metadata.uid.clone(),
                    before: resource_version,
                    after: written.metadata.resource_version.clone(),
                    status: written.status.clone().unwrap_or(outcome.status.clone()),
                },
            );
        }
        let metrics = self.ctx.metrics();
        for _ in 0..outcome.evicted {
            metrics.quota_evictions.inc();
        }
        for _ in 0..outcome.would_evict {
            metrics.quota_would_evict.inc();
        }
        let reference = quota.object_ref(&());
        for (namespace, notice) in &outcome.notices {
            self.publish(&reference, namespace, notice).await;
        }
        let grace_of = |ns: &str, uid: &str| {
            let index = self.ctx.index.read().unwrap_or_else(PoisonError::into_inner);
            let uid = Uid::from(uid);
            let own = index
                .pods_by_namespace()
                .filter(|(n, _)| *n == ns)
                .flat_map(|(_, pods)| pods)
                .find(|p| p.uid == uid)
                .and_then(|p| p.grace_seconds);
            quota::compile(quota).map(|q| q.eviction_grace_seconds(own)).unwrap_or(30)
        };
        for action in &outcome.actions {
            let grace = grace_of(&action.namespace, &action.pending.uid);
            self.act(quota, &reference, action, grace).await;
        }
        Ok(())
    }

    async fn act(&self, quota: &ClusterGpuMemoryQuota, reference: &ObjectReference, action: &Action, grace: i64) {
        let pods: Api<Pod> = Api::namespaced(self.ctx.client(), &action.namespace);
        self.ctx.metrics().quota_eviction_requests.inc();
        let pod = &action.pending.pod;
        let result = match action.act {
            Act::Evict => {
                let body = eviction_body(&action.namespace, pod, &action.pending.uid, Some(grace));
                pods.create_subresource::<_, serde_json::Value>("eviction", pod, &PostParams::default(), &body)
                    .await
                    .map(|_| ())
            }
            Act::Delete => {
                let delete = DeleteParams {
                    grace_period_seconds: u32::try_from(grace).ok(),
                    preconditions: Some(Preconditions {
                        uid: Some(action.pending.uid.clone()),
                        resource_version: None,
                    }),
                    ..DeleteParams::default()
                };
                pods.delete(pod, &delete).await.map(|_| ())
            }
        };
        match result {
            Ok(()) => {
                tracing::info!(quota = %quota.name_any(), namespace = %action.namespace, %pod, act = ?action.act, grace, "namespace total: eviction asked for")
            }
            // Gone already (or a new pod of that name: the UID precondition): the next pass sees it.
            Err(kube::Error::Api(e)) if e.code == 404 || e.code == 409 => {}
            Err(error) => {
                let why = match &error {
                    kube::Error::Api(e) if e.code == 429 => format!("refused: {} (a PodDisruptionBudget)", e.message),
                    other => format!("failed: {other}"),
                };
                let notice = Notice {
                    reason: quota::REASON_BLOCKED,
                    warning: true,
                    pod: Some(pod.clone()),
                    note: format!("the eviction of {pod} for the namespace's GPU memory quota was {why}; retrying"),
                };
                self.publish(reference, &action.namespace, &notice).await;
            }
        }
    }

    /// Publishes a notice on the quota and, when it names one, on the pod.
    async fn publish(&self, quota: &ObjectReference, namespace: &str, notice: &Notice) {
        let event = |note: String| KubeEvent {
            type_: if notice.warning { EventType::Warning } else { EventType::Normal },
            reason: notice.reason.to_owned(),
            note: Some(note),
            action: "NamespaceTotal".to_owned(),
            secondary: None,
        };
        let quota_name = quota.name.clone().unwrap_or_default();
        let mut targets = vec![(event(format!("{namespace}: {}", notice.note)), quota.clone())];
        if let Some(pod) = &notice.pod {
            let uid = {
                let index = self.ctx.index.read().unwrap_or_else(PoisonError::into_inner);
                index
                    .pods_by_namespace()
                    .filter(|(n, _)| *n == namespace)
                    .flat_map(|(_, pods)| pods)
                    .find(|p| *p.name == **pod)
                    .map(|p| p.uid.to_string())
            };
            let pod_ref = ObjectReference {
                api_version: Some("v1".into()),
                kind: Some("Pod".into()),
                namespace: Some(namespace.to_owned()),
                name: Some(pod.clone()),
                uid,
                ..ObjectReference::default()
            };
            targets.push((event(format!("ClusterGpuMemoryQuota {quota_name}: {}", notice.note)), pod_ref));
        }
        for (event, reference) in targets {
            match self.ctx.recorder().publish(&event, &reference).await {
                Ok(()) => {
                    self.ctx.metrics().events.inc();
                }
                Err(error) => tracing::warn!(%error, reason = notice.reason, "cannot publish event"),
            }
        }
    }
}

/// Runs the quota loop until `shutdown`: watches quotas (the namespaces' labels are the index's, fed by the
/// controller's namespace watch), and every `interval`, while this replica leads and the pod and budget
/// caches have listed, adds every quota up and acts.
pub async fn run(ctx: Arc<Context>, settings: QuotaSettings, shutdown: CancellationToken) -> anyhow::Result<()> {
    let (store, writer) = reflector::store::<ClusterGpuMemoryQuota>();
    let api: Api<ClusterGpuMemoryQuota> = Api::all(ctx.client());
    let mut quotas = std::pin::pin!(
        watcher::watcher(api, watcher::Config::default().page_size(100))
            .default_backoff()
            .modify(|q| q.metadata.managed_fields = None)
            .reflect(writer)
    );
    let state = Quotas { ctx: ctx.clone(), settings: settings.clone(), written: Mutex::default() };
    let mut ticker = tokio::time::interval(settings.interval);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut listed = false;
    let mut warned = false;
    loop {
        tokio::select! {
            () = shutdown.cancelled() => return Ok(()),
            event = quotas.next() => {
                match event {
                    Some(Ok(Event::InitDone)) => listed = true,
                    Some(Ok(Event::Delete(q))) => {
                        state.written.lock().unwrap_or_else(PoisonError::into_inner).remove(&q.name_any());
                    }
                    Some(Ok(_)) => {}
                    Some(Err(error)) => {
                        if !warned {
                            tracing::warn!(%error, "cannot watch ClusterGpuMemoryQuotas (is the CRD installed?); retrying with backoff");
                            warned = true;
                        }
                    }
                    None => anyhow::bail!("the ClusterGpuMemoryQuota watch ended"),
                }
                continue;
            }
            _ = ticker.tick() => {}
        }
        let leads = *ctx.leader_watch().borrow();
        let synced = *ctx.synced_watch().borrow();
        if !(leads && synced && listed) {
            continue;
        }
        let mut over = 0;
        for quota in store.state() {
            if let Err(error) = state.reconcile(&quota).await {
                tracing::warn!(quota = %quota.name_any(), %error, "namespace totals: pass failed; retrying next pass");
                state.written.lock().unwrap_or_else(PoisonError::into_inner).remove(&quota.name_any());
            }
            over += quota.status.as_ref().map_or(0, |s| s.namespaces_over);
        }
        ctx.metrics().quota_namespaces_over.set(over);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use gpubudget_common::ClusterGpuMemoryQuotaSpec;

    const GI: u64 = 1 << 30;

    fn quota(spec: serde_json::Value) -> ClusterGpuMemoryQuota {
        let spec: ClusterGpuMemoryQuotaSpec = serde_json::from_value(spec).expect("spec");
        ClusterGpuMemoryQuota::new("totals", spec)
    }

    fn pod(name: &str, started_ms: u64, usage: u64) -> QuotaPod {
        QuotaPod {
            name: name.into(),
            uid: format!("uid-{name}"),
            node: Some("gpu-1".into()),
            started_ms,
            usage_bytes: usage,
            state: BudgetState::Within,
            terminating: false,
            exempt: None,
        }
    }

    #[test]
    fn the_status_keeps_what_must_be_remembered_first_and_reads_it_back() {
        let q = quota(serde_json::json!({"limit": "10Gi", "overLimitSeconds": 30}));
        // 150 namespaces within their limit, one over.
        let mut pods: BTreeMap<String, Vec<QuotaPod>> =
            (0..150).map(|i| (format!("ns-{i:03}"), vec![pod("p", 0, GI + i)])).collect();
        pods.insert("zz-over".into(), (0..6).map(|i| pod(&format!("p{i}"), i, 2 * GI)).collect());
        let first = compute(&q, Enforcement::Enforce, &pods, &ClusterGpuMemoryQuotaStatus::default(), 1_000_000);
        assert_eq!(first.status.namespaces.len(), QUOTA_NAMESPACES_DETAILED);
        assert_eq!(
            (first.status.namespaces_selected, first.status.namespaces_over),
            (151, 1),
            "counted before the list is cut"
        );
        let over = &first.status.namespaces[0];
        assert_eq!((over.namespace.as_str(), over.state, over.total.as_str()), ("zz-over", BudgetState::Over, "12Gi"));
        assert_eq!(over.top_pods.len(), QUOTA_TOP_PODS_MAX);
        assert_eq!(first.status.namespaces[1].namespace, "ns-149", "then the largest totals");
        // 10 s later: the bank read back from the status grows by 10 s.
        let second = compute(&q, Enforcement::Enforce, &pods, &first.status, 1_010_000);
        let over = &second.status.namespaces[0];
        assert_eq!(over.over_millis, 10_000);
        assert_eq!(remembered(over).tracker.last, Some((1_010_000, true)));
        assert!(second.actions.is_empty());
        // At 30 s the latest pod goes; the status names it before anything is done.
        let third = compute(
            &q,
            Enforcement::Enforce,
            &pods,
            &compute(&q, Enforcement::Enforce, &pods, &second.status, 1_020_000).status,
            1_030_000,
        );
        assert_eq!(third.actions.len(), 1);
        assert_eq!((third.actions[0].pending.pod.as_str(), &third.actions[0].act), ("p5", &Act::Evict));
        let pending = third.status.namespaces[0].pending_eviction.clone().expect("pending in the status");
        assert_eq!((pending.pod.as_str(), pending.requested_at.as_str()), ("p5", "1970-01-01T00:17:10Z"));
        assert_eq!(remembered(&third.status.namespaces[0]).pending.map(|p| p.requested_at_ms), Some(1_030_000));
        assert!(same_but_for_sample_times(
            &third.status,
            &compute(&q, Enforcement::Enforce, &pods, &third.status, 1_031_000).status
        ));
    }

    /// Observe: the status says `Over` (never `Evicting`), names the pod it would evict, keeps it across a change
    /// of leader (told once, not again by a new leader), and the condition says nothing is evicted and why.
    #[test]
    fn observing_the_status_names_the_pod_it_would_evict_and_a_new_leader_does_not_tell_it_again() {
        let q = quota(serde_json::json!({"limit": "10Gi", "overLimitSeconds": 10}));
        let pods: BTreeMap<String, Vec<QuotaPod>> =
            [("team-a".to_owned(), (0..6).map(|i| pod(&format!("p{i}"), i, 2 * GI)).collect())].into();
        let mut status = ClusterGpuMemoryQuotaStatus::default();
        let mut told = 0;
        for pass in 0..=4u64 {
            let out = compute(&q, Enforcement::Observe, &pods, &status, 1_000_000 + pass * 5_000);
            assert!(out.actions.is_empty(), "pass {pass}: nothing is evicted");
            told += out.would_evict;
            status = out.status;
        }
        assert_eq!(told, 1, "told once");
        let entry = &status.namespaces[0];
        assert_eq!(entry.state, BudgetState::Over, "never Evicting while nothing is");
        let would = entry.would_evict.clone().expect("the pod it would evict");
        assert_eq!((would.pod.as_deref(), would.since.as_str()), (Some("p5"), "1970-01-01T00:16:50Z"));
        let ready = &status.conditions[0];
        assert_eq!(ready.reason, "Observing");
        assert!(
            ready.message.contains("nothing is evicted") && ready.message.contains("--enforcement"),
            "{}",
            ready.message
        );
        // A new leader reads it back: no second event; the quota's own Enforce evicts at once.
        let again = compute(&q, Enforcement::Observe, &pods, &status, 1_100_000);
        assert_eq!((again.would_evict, again.notices.len()), (0, 0));
        let enforcing = quota(serde_json::json!({"limit": "10Gi", "overLimitSeconds": 10, "enforcement": "Enforce"}));
        let acted = compute(&enforcing, Enforcement::Observe, &pods, &again.status, 1_105_000);
        assert_eq!(acted.actions.iter().map(|a| a.pending.pod.as_str()).collect::<Vec<_>>(), ["p5"]);
        assert_eq!(
            (acted.status.conditions[0].reason.as_str(), acted.status.namespaces[0].would_evict.as_ref()),
            ("Enforced", None)
        );
    }

    /// #33: with 1 000 namespaces over at once (and 500 near), every one keeps its banked time across passes
    /// and is evicted in turn when due, a near one's event is sent once, and the status stays well under the
    /// API server's object size limit.
    #[test]
    fn a_thousand_namespaces_over_at_once_each_keep_their_period_and_are_evicted() {
        let q = quota(serde_json::json!({"limit": "10Gi", "overLimitSeconds": 30, "warnAtPercent": 90}));
        let mut pods: BTreeMap<String, Vec<QuotaPod>> = (0..1_000)
            .map(|i| (format!("over-{i:04}"), (0..6).map(|p| pod(&format!("p{p}"), p, 2 * GI)).collect()))
            .collect();
        pods.extend((0..500).map(|i| (format!("near-{i:03}"), vec![pod("p", 0, 9_500 << 20)])));
        pods.extend((0..2_000).map(|i| (format!("calm-{i:04}"), vec![pod("p", 0, GI)])));
        let mut status = ClusterGpuMemoryQuotaStatus::default();
        let mut near_notices = 0;
        let mut evicting = BTreeMap::new();
        for pass in 0..=6u64 {
            let out = compute(&q, Enforcement::Enforce, &pods, &status, 1_000_000 + pass * 5_000);
            near_notices += out.notices.iter().filter(|(ns, _)| ns.starts_with("near-")).count();
            for a in &out.actions {
                *evicting.entry(a.namespace.clone()).or_insert(0) += 1;
            }
            let bytes = serde_json::to_vec(&out.status).expect("json").len();
            assert!(bytes < 3 * (1 << 19), "pass {pass}: {bytes} bytes");
            assert_eq!(out.status.namespaces_not_stored, None);
            assert_eq!(out.status.namespaces.len(), 1_500, "every namespace with something to remember");
            status = out.status;
        }
        let banked: Vec<i64> =
            status.namespaces.iter().filter(|n| n.namespace.starts_with("over-")).map(|n| n.over_millis).collect();
        assert_eq!(banked.len(), 1_000);
        assert_eq!(near_notices, 500, "each near namespace told once, not every pass");
        assert_eq!(evicting.len(), 1_000, "every namespace over evicted in turn");
        assert!(evicting.values().all(|n| *n == 1), "once each while the first is pending");
        assert!(
            status.namespaces.iter().filter(|n| n.namespace.starts_with("over-")).all(|n| n.pending_eviction.is_some())
        );
    }

    /// #33: past the byte bound, entries with something to remember are counted as not stored, never dropped
    /// silently.
    #[test]
    fn what_does_not_fit_is_counted_never_dropped_silently() {
        let long = |i: usize| format!("{}-{i:05}", "n".repeat(50));
        let entries: Vec<NamespaceTotal> = (0..QUOTA_NAMESPACES_MAX + 10)
            .map(|i| NamespaceTotal {
                namespace: long(i),
                state: BudgetState::Evicting,
                over_millis: 1,
                pending_eviction: Some(PendingEviction {
                    pod: long(i),
                    uid: "0123456789abcdef0123456789abcdef0123".into(),
                    node: Some(long(i)),
                    requested_at: "2026-11-26T00:00:00Z".into(),
                    usage_bytes: 1,
                    accepted: false,
                }),
                ..NamespaceTotal::default()
            })
            .collect();
        let (stored, not_stored) = stored_entries(entries);
        assert!(stored.len() < QUOTA_NAMESPACES_MAX && not_stored > 10, "{} stored", stored.len());
        assert_eq!(stored.len() + not_stored, QUOTA_NAMESPACES_MAX + 10);
        assert!(serde_json::to_vec(&stored).expect("json").len() <= QUOTA_STATUS_BYTES_MAX + stored.len());
    }

    #[test]
    fn an_invalid_quota_says_why_and_enforces_nothing() {
        let q = quota(serde_json::json!({"limit": "1Gi", "warnAtPercent": 0}));
        let pods = BTreeMap::from([("a".to_owned(), vec![pod("p", 0, 4 * GI)])]);
        let out = compute(&q, Enforcement::Enforce, &pods, &ClusterGpuMemoryQuotaStatus::default(), 0);
        assert!(out.actions.is_empty() && out.status.namespaces.is_empty());
        let ready = &out.status.conditions[0];
        assert_eq!((ready.status.as_str(), ready.reason.as_str()), ("False", "InvalidSpec"));
        assert!(ready.message.contains("warnAtPercent"), "{}", ready.message);
    }
}
