//! The enforcement decisions: a pure function from (what the agent remembers, this tick's pods and
//! usage, the time) to a list of [`Action`]s. The executors (API or standalone) apply them and report back
//! through [`Enforcer::feedback`]. No I/O here, so every rule is unit-tested.
//!
//! Rules:
//! - the state machine is `gpubudget_common::step`, per pod, on the pod's summed usage;
//! - **events** on transitions, deduplicated: a reason is not repeated for a pod within
//!   [`Settings::event_cooldown_ms`]; the state the events speak for survives restarts (seeded from the
//!   pod's `gpubudget.io/state`), so a restart does not repeat them;
//! - **records** (annotations, server-side apply): at once on a change of state, budget or eviction time;
//!   usage alone only when it moved by ≥ [`Settings::usage_change_percent`] and the last write is
//!   [`Settings::usage_min_interval_ms`] old; nothing in steady state; one write in flight per pod;
//!   failed writes retried with backoff;
//! - **eviction**: when the state machine says `Evicting` (it never does for `action: Warn` or critical
//!   pods), for a pod of this node that is not terminating: one apply carrying state `Evicting` and
//!   `eviction-requested-at`, then the `EvictingForGpuMemory` event, then the eviction request, in that
//!   order; the request waits for that record at most [`Settings::record_wait_attempts`] failed writes or
//!   [`Settings::record_wait_ms`], then goes ahead without it (`GpuMemoryEvictionRecordFailed`). One request
//!   in flight per pod; HTTP 429 → `GpuMemoryEvictionBlocked` and a retry with
//!   backoff while still due; an accepted eviction is never requested again for that pod UID. Timers
//!   start afresh when the agent starts, so a restart can only delay an eviction.

pub mod gpus;
pub mod pressure;

use std::collections::HashMap;
use std::sync::Arc;

use gpubudget_common::pod_record::PodRecord;
use gpubudget_common::quantity::HumanBytes;
use gpubudget_common::{Budget, BudgetAction, BudgetState, Tracker, step};

use crate::attribute::pods::{PodTable, PodView};
use crate::attribute::{Holder, PodUsage};
use crate::sample::{GpuInfo, Snapshot};

/// The pod an action is about.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct PodRef {
    /// UID.
    pub uid: Arc<str>,
    /// Namespace.
    pub namespace: Arc<str>,
    /// Name.
    pub name: Arc<str>,
}

impl PodRef {
    fn of(view: &PodView) -> Self {
        Self { uid: view.uid.clone(), namespace: view.namespace.clone(), name: view.name.clone() }
    }
}

impl std::fmt::Display for PodRef {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.namespace, self.name)
    }
}

/// Event reasons (PascalCase, as Kubernetes reasons are).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Reason {
    /// At or above `warnAtPercent` of the limit.
    NearBudget,
    /// Over the limit.
    OverBudget,
    /// Over the limit for `overLimitSeconds`: eviction requested.
    Evicting,
    /// The eviction was refused (HTTP 429: a PodDisruptionBudget).
    EvictionBlocked,
    /// Back under the limit (or under the warning threshold).
    WithinBudget,
    /// The `Evicting` record could not be written in time: the eviction goes ahead without it.
    RecordNotWritten,
    /// Evictions were refused for `blockedEvictionTimeoutSeconds`: the pod is deleted instead.
    Deleting,
    /// The budget's action or `overLimitSeconds` changed while the pod was over: the period starts afresh.
    BudgetChanged,
}

impl Reason {
    /// The event's `reason`.
    pub fn as_str(self) -> &'static str {
        match self {
            Reason::NearBudget => "GpuMemoryNearBudget",
            Reason::OverBudget => "GpuMemoryOverBudget",
            Reason::Evicting => "EvictingForGpuMemory",
            Reason::EvictionBlocked => "GpuMemoryEvictionBlocked",
            Reason::WithinBudget => "GpuMemoryWithinBudget",
            Reason::RecordNotWritten => "GpuMemoryEvictionRecordFailed",
            Reason::Deleting => "DeletingForGpuMemory",
            Reason::BudgetChanged => "GpuMemoryBudgetChanged",
        }
    }

    /// Warning (true) or Normal.
    pub fn is_warning(self) -> bool {
        matches!(
            self,
            Reason::NearBudget
                | Reason::OverBudget
                | Reason::Evicting
                | Reason::EvictionBlocked
                | Reason::RecordNotWritten
                | Reason::Deleting
        )
    }

    /// How many reasons there are.
    const COUNT: usize = 8;

    fn slot(self) -> usize {
        self as usize
    }
}

/// Why an event on the Node is sent.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum NodeReason {
    /// A GPU came under memory pressure.
    Pressure,
    /// It is no longer.
    PressureEnded,
    /// Under pressure, but no pod on the GPU is over its budget: the budgets add up to more than it holds.
    Overcommitted,
    /// A GPU's sample failed: nothing is decided from it until it is back ([`gpus`]).
    GpuSampleFailed,
    /// It is sampled again.
    GpuSampleRecovered,
    /// A large share of a GPU's used memory is held by no process the agent can see, for a while.
    Unaccounted,
    /// NVML gives no per-process figure for some processes on a GPU (once per GPU).
    Unavailable,
}

impl NodeReason {
    /// The event's `reason`.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Pressure => "GpuMemoryPressure",
            Self::PressureEnded => "GpuMemoryPressureEnded",
            Self::Overcommitted => "GpuMemoryBudgetsOvercommitted",
            Self::GpuSampleFailed => "GpuSampleFailed",
            Self::GpuSampleRecovered => "GpuSampleRecovered",
            Self::Unaccounted => "GpuMemoryUnaccounted",
            Self::Unavailable => "GpuProcessMemoryUnavailable",
        }
    }

    /// Warning (true) or Normal.
    pub fn is_warning(self) -> bool {
        !matches!(self, Self::PressureEnded | Self::GpuSampleRecovered)
    }
}

/// What the executor is asked to do.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Action {
    /// The pod changed state (logged; the standalone mode's decision lines).
    Transition {
        /// The pod.
        pod: PodRef,
        /// Previous state.
        from: BudgetState,
        /// New state.
        to: BudgetState,
        /// Usage, bytes.
        usage: u64,
        /// Limit, bytes.
        limit: u64,
        /// `namespace/name` of the budget.
        budget: String,
    },
    /// Write the pod's record (server-side apply of the contract annotations).
    Apply {
        /// The pod.
        pod: PodRef,
        /// The record.
        record: PodRecord,
    },
    /// Remove the agent's annotations (no budget applies any more).
    Clear {
        /// The pod.
        pod: PodRef,
    },
    /// Emit an event on the pod.
    Event {
        /// The pod.
        pod: PodRef,
        /// Why.
        reason: Reason,
        /// The message.
        note: String,
    },
    /// Emit an event on this node's Node object (GPU memory pressure, a GPU's health and accounting).
    NodeEvent {
        /// Why.
        reason: NodeReason,
        /// The message.
        note: String,
    },
    /// Delete the pod (UID precondition) with this grace period: evictions were refused for the budget's
    /// `blockedEvictionTimeoutSeconds`. Answered like an eviction ([`Feedback::Evicted`]).
    Delete {
        /// The pod.
        pod: PodRef,
        /// `gracePeriodSeconds`, as for the eviction.
        grace_seconds: Option<i64>,
    },
    /// Request the pod's eviction (policy/v1 Eviction).
    Evict {
        /// The pod.
        pod: PodRef,
        /// `deleteOptions.gracePeriodSeconds` ([`Budget::eviction_grace_seconds`]); `None`: the pod's own.
        grace_seconds: Option<i64>,
        /// Whether the API has the `Evicting` record (false: the wait for it ran out, see
        /// [`Settings::record_wait_attempts`]); counted in `gpubudget_evictions_without_record_total`.
        recorded: bool,
    },
}

impl Action {
    /// The pod the action is about; `None` for an event on the node.
    pub fn pod(&self) -> Option<&PodRef> {
        match self {
            Action::Transition { pod, .. }
            | Action::Apply { pod, .. }
            | Action::Clear { pod }
            | Action::Event { pod, .. }
            | Action::Evict { pod, .. }
            | Action::Delete { pod, .. } => Some(pod),
            Action::NodeEvent { .. } => None,
        }
    }
}

/// How an eviction request ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum EvictOutcome {
    /// Accepted (the pod is being deleted).
    Accepted,
    /// HTTP 429: refused for now (a PodDisruptionBudget). The server's message.
    Blocked(String),
    /// The pod no longer exists.
    Gone,
    /// Any other failure (retried with backoff). What happened.
    Failed(String),
}

/// What an executor reports back.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Feedback {
    /// An [`Action::Apply`] or [`Action::Clear`] finished.
    Written {
        /// The pod's UID.
        uid: Arc<str>,
        /// The record written (`None` for a clear).
        record: Option<PodRecord>,
        /// Whether the API accepted it.
        ok: bool,
    },
    /// An [`Action::Evict`] finished.
    Evicted {
        /// The pod's UID.
        uid: Arc<str>,
        /// How.
        outcome: EvictOutcome,
    },
}

/// Tunables (the defaults are the write budget).
#[derive(Debug, Clone)]
pub struct Settings {
    /// This node's name (records carry it; pods of other nodes are never acted on).
    pub node: String,
    /// Usage is rewritten only when it moved by at least this percentage of the last written value.
    pub usage_change_percent: u64,
    /// … and at most this often per pod.
    pub usage_min_interval_ms: u64,
    /// A reason is not repeated for a pod within this.
    pub event_cooldown_ms: u64,
    /// First retry delay after a refused eviction (doubles up to `evict_backoff_max_ms`).
    pub evict_backoff_min_ms: u64,
    /// Longest retry delay for an eviction.
    pub evict_backoff_max_ms: u64,
    /// First retry delay after a failed write (doubles up to `usage_min_interval_ms`).
    pub write_backoff_min_ms: u64,
    /// The GPU memory pressure signal ([`pressure`]); off: budgets alone.
    pub pressure: pressure::PressureSettings,
    /// Termination grace of a pressure eviction, seconds; a budget's `evictionGracePeriodSeconds` caps it.
    pub pressure_grace_seconds: i64,
    /// When memory no process accounts for is told on the Node ([`gpus`]).
    pub accounting: gpus::AccountingSettings,
    /// The eviction waits for its `Evicting` record at most this many failed writes …
    pub record_wait_attempts: u32,
    /// … and at most this long after it became due; then it goes ahead without the record (an event says
    /// so), and the record is retried while the pod terminates. A write the tenant can break (annotations
    /// filling the 256 KiB limit, a webhook refusing the update) cannot hold the eviction back.
    pub record_wait_ms: u64,
}

impl Settings {
    /// The defaults for a node.
    pub fn new(node: impl Into<String>) -> Self {
        Self {
            node: node.into(),
            usage_change_percent: 5,
            usage_min_interval_ms: 30_000,
            event_cooldown_ms: 60_000,
            evict_backoff_min_ms: 5_000,
            evict_backoff_max_ms: 60_000,
            write_backoff_min_ms: 1_000,
            pressure: pressure::PressureSettings::OFF,
            pressure_grace_seconds: 5,
            accounting: gpus::AccountingSettings::DEFAULT,
            record_wait_attempts: 3,
            record_wait_ms: 30_000,
        }
    }
}

/// The time of a tick: a monotonic clock for rules, wall time for records.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Now {
    /// Monotonic milliseconds (since the agent started).
    pub mono_ms: u64,
    /// Wall-clock time.
    pub wall: jiff::Timestamp,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Eviction {
    Idle,
    /// Due since `since` (monotonic ms): the `Evicting` record (with `eviction-requested-at`) is on its way;
    /// the request follows once the API has it, so the operator can count the eviction even when the pod is
    /// gone in a moment; or, when `failed` writes reach [`Settings::record_wait_attempts`] or the wait
    /// [`Settings::record_wait_ms`], without it.
    AwaitingRecord {
        since: u64,
        failed: u32,
    },
    /// A request is out; `attempts` earlier ones were refused or failed, the first at `refused_since`.
    InFlight {
        attempts: u32,
        refused_since: Option<u64>,
    },
    Blocked {
        attempts: u32,
        retry_at: u64,
        refused_since: u64,
    },
    Done,
}

/// Marks the "overcommitted" event as sent for this pressure episode; whether it already was.
fn gpu_told(gpu: &mut GpuPressure) -> bool {
    std::mem::replace(&mut gpu.told_overcommitted, true)
}

/// The state a pod's record says: `Evicting` while evicted for pressure, else the state machine's.
fn record_state(mem: &PodMemory) -> BudgetState {
    if mem.pressure.is_some() { BudgetState::Evicting } else { mem.tracker.state }
}

/// Whether evictions were refused for the budget's `blockedEvictionTimeoutSeconds` (never when unset).
fn blocked_too_long(budget: &Budget, refused_since: u64, now: u64) -> bool {
    budget.blocked_eviction_timeout_seconds.is_some_and(|t| now.saturating_sub(refused_since) >= t.saturating_mul(1000))
}

/// Whether the API has the record that says this eviction was requested (written by this agent).
fn record_landed(mem: &PodMemory) -> bool {
    mem.eviction_requested_at.is_some()
        && mem.written.as_ref().is_some_and(|w| w.eviction_requested_at == mem.eviction_requested_at)
}

#[derive(Debug, Clone)]
struct PodMemory {
    pod: PodRef,
    tracker: Tracker,
    /// The action and `overLimitSeconds` of the budget the tracker counted under: a change starts the
    /// period afresh (an edit never acts on time already spent over the limit).
    policy: Option<(BudgetAction, u64)>,
    reported: BudgetState,
    written: Option<PodRecord>,
    has_annotations: bool,
    last_write_ms: u64,
    write_in_flight: bool,
    write_failures: u32,
    write_retry_at: u64,
    eviction: Eviction,
    eviction_requested_at: Option<String>,
    last_event_ms: [Option<u64>; Reason::COUNT],
    /// For messages written from feedback.
    last_usage: u64,
    last_limit: u64,
    last_budget: String,
    seen: u64,
    /// The GPU whose memory pressure this pod is being evicted for.
    pressure: Option<usize>,
}

/// Remembers each pod between ticks and decides what to do.
#[derive(Debug)]
pub struct Enforcer {
    settings: Settings,
    pods: HashMap<Arc<str>, PodMemory>,
    generation: u64,
    /// Per GPU of the snapshot: the pressure signal.
    gpus: Vec<GpuPressure>,
    /// Per GPU: health and accounting, told on the Node.
    watch: gpus::GpuWatch,
}

/// One GPU's memory pressure between ticks.
#[derive(Debug, Clone, Default)]
struct GpuPressure {
    signal: pressure::Signal,
    /// The "budgets add up to more than the GPU" event was sent for this episode.
    told_overcommitted: bool,
    /// A pressure eviction on this GPU was refused: the next choice waits until then (monotonic ms).
    retry_at: u64,
}

fn percent_changed(old: u64, new: u64, percent: u64) -> bool {
    let diff = u128::from(old.abs_diff(new));
    diff * 100 >= u128::from(old) * u128::from(percent) && diff > 0
}

/// Whether `key` is `budget`'s `namespace/name` (compared without allocating).
fn is_key(key: &str, budget: &Budget) -> bool {
    key.len() == budget.namespace.len() + 1 + budget.name.len()
        && key.starts_with(budget.namespace.as_str())
        && key.ends_with(budget.name.as_str())
        && key.as_bytes()[budget.namespace.len()] == b'/'
}

/// Whole seconds, rounded to the nearest, for messages.
fn seconds(ms: u64) -> u64 {
    ms.saturating_add(500) / 1000
}

/// "trainer (pid 4242, GPU 0) 9.1Gi, sidecar (pid 4300, GPU 1) 100Mi"; the largest first, at most five.
pub fn holders_summary(holders: &[Holder], gpus: &[GpuInfo]) -> String {
    let mut sorted: Vec<&Holder> = holders.iter().collect();
    sorted.sort_by(|a, b| b.bytes.cmp(&a.bytes).then(a.pid.cmp(&b.pid)));
    let mut parts: Vec<String> = sorted
        .iter()
        .take(5)
        .map(|h| {
            let container = h.container.as_deref().unwrap_or("(pod)");
            let gpu = gpus.get(h.gpu).map_or("?", |g| g.label.as_str());
            match h.pid {
                Some(pid) => format!("{container} (pid {pid}, GPU {gpu}) {}", HumanBytes(h.bytes)),
                None => format!("{container} (GPU {gpu}) {}", HumanBytes(h.bytes)),
            }
        })
        .collect();
    if sorted.len() > 5 {
        parts.push(format!("and {} more", sorted.len() - 5));
    }
    if parts.is_empty() { "no GPU process".to_owned() } else { parts.join(", ") }
}

/// Event notes are limited to 1 kB by the API server.
fn bounded(mut note: String) -> String {
    const MAX: usize = 1024;
    if note.len() > MAX {
        let mut cut = MAX - 3;
        while !note.is_char_boundary(cut) {
            cut -= 1;
        }
        note.truncate(cut);
        note.push_str("...");
    }
    note
}

struct Context<'a> {
    view: &'a PodView,
    budget: &'a Budget,
    usage: &'a PodUsage,
    gpus: &'a [GpuInfo],
}

impl Context<'_> {
    fn used_of(&self) -> String {
        format!(
            "using {} of {} (budget {})",
            HumanBytes(self.usage.total),
            HumanBytes(self.budget.limit_bytes),
            self.budget.key()
        )
    }

    fn held_by(&self) -> String {
        format!("held by {}", holders_summary(&self.usage.holders, self.gpus))
    }

    /// The grace period of an eviction (or delete) of this pod: [`Budget::eviction_grace_seconds`].
    fn grace_seconds(&self) -> Option<i64> {
        Some(self.budget.eviction_grace_seconds(self.view.termination_grace_seconds))
    }

    fn grace_text(&self) -> String {
        let grace = self.budget.eviction_grace_seconds(self.view.termination_grace_seconds);
        let own = self.view.termination_grace_seconds.unwrap_or(30);
        match self.budget.eviction_grace_period_seconds {
            Some(_) => format!("{grace}s grace"),
            None if grace == own => format!("the pod's {grace}s grace"),
            None => format!("{grace}s grace (the pod asks for {own}s; capped when the budget sets none)"),
        }
    }
}

impl Enforcer {
    /// An enforcer with these settings and no memory (a fresh start).
    pub fn new(settings: Settings) -> Self {
        Self { settings, pods: HashMap::new(), generation: 0, gpus: Vec::new(), watch: gpus::GpuWatch::default() }
    }

    /// Looks at each GPU's health and accounting ([`gpus`]): Node events for a GPU whose sample fails or
    /// recovers, memory no process accounts for, and figures NVML does not give. `unaccounted` per GPU of
    /// the snapshot ([`crate::attribute::Usage::unaccounted`]).
    pub fn watch_gpus(&mut self, now: Now, snapshot: &Snapshot, unaccounted: &[Option<u64>], out: &mut Vec<Action>) {
        self.watch.observe(&self.settings.accounting, now.mono_ms, snapshot, unaccounted, out);
    }

    /// The settings.
    pub fn settings(&self) -> &Settings {
        &self.settings
    }

    /// The state the agent holds for a pod (for `top` and metrics).
    pub fn state_of(&self, uid: &str) -> Option<BudgetState> {
        self.pods.get(uid).filter(|m| !m.last_budget.is_empty()).map(|m| m.tracker.state)
    }

    /// Pods remembered.
    pub fn len(&self) -> usize {
        self.pods.len()
    }

    /// Whether no pod is remembered.
    pub fn is_empty(&self) -> bool {
        self.pods.is_empty()
    }

    fn event(&self, mem: &mut PodMemory, now: u64, reason: Reason, note: String, out: &mut Vec<Action>) {
        let slot = &mut mem.last_event_ms[reason.slot()];
        if slot.is_some_and(|at| now.saturating_sub(at) < self.settings.event_cooldown_ms) {
            return;
        }
        *slot = Some(now);
        out.push(Action::Event { pod: mem.pod.clone(), reason, note: bounded(note) });
    }

    /// Decides this tick. `usage` is indexed like `table.pods`; `gpus` are the snapshot's (for messages).
    pub fn tick(&mut self, now: Now, table: &PodTable, usage: &[PodUsage], gpus: &[GpuInfo], out: &mut Vec<Action>) {
        self.generation += 1;
        let empty = PodUsage::default();
        for (i, view) in table.pods.iter().enumerate() {
            let pod_usage = usage.get(i).unwrap_or(&empty);
            match table.budget(i) {
                Some(budget) => {
                    let cx = Context { view, budget, usage: pod_usage, gpus };
                    self.tick_pod(now, &cx, out);
                }
                None => self.tick_unbudgeted(now, view, out),
            }
        }
        let generation = self.generation;
        self.pods.retain(|_, m| m.seen == generation);
    }

    fn new_memory(&self, now: Now, view: &PodView) -> PodMemory {
        // What this agent (on this node) recorded before a restart.
        let record = view.record.clone().filter(|r| r.node == self.settings.node);
        PodMemory {
            pod: PodRef::of(view),
            tracker: Tracker::default(),
            policy: None,
            reported: record.as_ref().map_or(BudgetState::Within, |r| r.state),
            eviction_requested_at: record.as_ref().and_then(|r| r.eviction_requested_at.clone()),
            written: record,
            has_annotations: view.has_annotations,
            // Conservative: as if just written, so a restart does not rewrite usage at once.
            last_write_ms: now.mono_ms,
            write_in_flight: false,
            write_failures: 0,
            write_retry_at: 0,
            eviction: Eviction::Idle,
            last_event_ms: [None; Reason::COUNT],
            last_usage: 0,
            last_limit: 0,
            last_budget: String::new(),
            seen: 0,
            pressure: None,
        }
    }

    fn take_memory(&mut self, now: Now, view: &PodView) -> PodMemory {
        match self.pods.remove(&view.uid) {
            Some(mut mem) => {
                mem.pod = PodRef::of(view);
                mem
            }
            None => self.new_memory(now, view),
        }
    }

    fn tick_unbudgeted(&mut self, now: Now, view: &PodView, out: &mut Vec<Action>) {
        let mut mem = self.take_memory(now, view);
        mem.seen = self.generation;
        mem.last_budget.clear();
        mem.tracker = Tracker::default();
        mem.policy = None;
        mem.reported = BudgetState::Within;
        if matches!(mem.eviction, Eviction::Blocked { .. } | Eviction::AwaitingRecord { .. }) {
            mem.eviction = Eviction::Idle;
        }
        // A record of ours with no budget behind it any more: remove it, once.
        let ours = view.record.as_ref().is_some_and(|r| r.node == self.settings.node) || mem.written.is_some();
        if ours && mem.has_annotations && !mem.write_in_flight && now.mono_ms >= mem.write_retry_at {
            mem.write_in_flight = true;
            out.push(Action::Clear { pod: mem.pod.clone() });
        }
        self.pods.insert(view.uid.clone(), mem);
    }

    fn tick_pod(&mut self, now: Now, cx: &Context<'_>, out: &mut Vec<Action>) {
        let budget = cx.budget;
        let view = cx.view;
        let total = cx.usage.total;
        let thresholds = budget.thresholds(view.never_evicted().is_some());
        let mut mem = self.take_memory(now, view);
        mem.seen = self.generation;
        // A budget edit (Warn → Evict, a shorter overLimitSeconds) or a move to a budget that acts otherwise
        // does not act on the time already spent over the limit: the period starts afresh, and is told.
        let policy = (budget.action, budget.over_limit_seconds);
        if let Some(old) = mem.policy.filter(|old| *old != policy) {
            if mem.tracker.state.is_over() {
                let note = format!(
                    "budget {} changed (action {} → {}, overLimitSeconds {} → {}): the over-limit period starts \
                     afresh; {}",
                    budget.key(),
                    old.0,
                    policy.0,
                    old.1,
                    policy.1,
                    cx.used_of()
                );
                self.event(&mut mem, now.mono_ms, Reason::BudgetChanged, note, out);
            }
            mem.tracker = Tracker { state: mem.tracker.state, ..Tracker::default() };
        }
        mem.policy = Some(policy);
        mem.tracker = step(mem.tracker, &thresholds, now.mono_ms, total);
        mem.last_usage = total;
        mem.last_limit = budget.limit_bytes;
        if !is_key(&mem.last_budget, budget) {
            mem.last_budget = budget.key();
        }
        let state = mem.tracker.state;

        if state != mem.reported {
            out.push(Action::Transition {
                pod: mem.pod.clone(),
                from: mem.reported,
                to: state,
                usage: total,
                limit: budget.limit_bytes,
                budget: mem.last_budget.clone(),
            });
            let event = match (mem.reported, state) {
                (BudgetState::Within, BudgetState::Near) => Some((
                    Reason::NearBudget,
                    format!(
                        "{}, at or above the {}% warning threshold; {}",
                        cx.used_of(),
                        budget.warn_at_percent,
                        cx.held_by()
                    ),
                )),
                (BudgetState::Within | BudgetState::Near, BudgetState::Over) => {
                    let then = if budget.action == BudgetAction::Warn {
                        "action is Warn: the pod is not evicted".to_owned()
                    } else if let Some(why) = view.never_evicted() {
                        why.to_owned()
                    } else if budget.over_limit_seconds == 0 {
                        "evicting now".to_owned()
                    } else {
                        format!("evicting if it stays over for {}s", budget.over_limit_seconds)
                    };
                    Some((Reason::OverBudget, format!("{}; {then}; {}", cx.used_of(), cx.held_by())))
                }
                (BudgetState::Over | BudgetState::Evicting, BudgetState::Within | BudgetState::Near) => {
                    Some((Reason::WithinBudget, format!("back under the limit: {}; {}", cx.used_of(), cx.held_by())))
                }
                (BudgetState::Near, BudgetState::Within) => Some((
                    Reason::WithinBudget,
                    format!("{}, under the {}% warning threshold again", cx.used_of(), budget.warn_at_percent),
                )),
                _ => None,
            };
            if let Some((reason, note)) = event {
                self.event(&mut mem, now.mono_ms, reason, note, out);
            }
            mem.reported = state;
        }

        // Eviction: by the budget's timer, or for memory pressure on a GPU (only while still over the limit).
        if mem.pressure.is_some() && total <= budget.limit_bytes && !matches!(mem.eviction, Eviction::InFlight { .. }) {
            mem.pressure = None;
        }
        let due = state == BudgetState::Evicting || mem.pressure.is_some();
        let evictable = due
            && (thresholds.may_evict || mem.pressure.is_some())
            && budget.action == BudgetAction::Evict
            && view.never_evicted().is_none()
            && !view.terminating
            && view.node.as_deref() == Some(self.settings.node.as_str());
        let mut applied = false;
        match mem.eviction {
            Eviction::Idle if evictable => {
                let at = now.wall.round(jiff::Unit::Second).unwrap_or(now.wall).to_string();
                mem.eviction_requested_at = Some(at);
                let record = self.desired(&mem, cx);
                out.push(Action::Apply { pod: mem.pod.clone(), record });
                mem.write_in_flight = true;
                applied = true;
                let note = format!(
                    "{} for {}s; evicting with {}; {}",
                    cx.used_of(),
                    seconds(mem.tracker.over_for()),
                    cx.grace_text(),
                    cx.held_by()
                );
                // Not subject to the cooldown: one per eviction, and evictions are rare.
                mem.last_event_ms[Reason::Evicting.slot()] = Some(now.mono_ms);
                out.push(Action::Event { pod: mem.pod.clone(), reason: Reason::Evicting, note: bounded(note) });
                mem.eviction = Eviction::AwaitingRecord { since: now.mono_ms, failed: 0 };
            }
            Eviction::AwaitingRecord { .. } if evictable && !mem.write_in_flight && record_landed(&mem) => {
                out.push(Action::Evict { pod: mem.pod.clone(), grace_seconds: self.grace(&mem, cx), recorded: true });
                mem.eviction = Eviction::InFlight { attempts: 0, refused_since: None };
            }
            Eviction::AwaitingRecord { since, failed }
                if evictable
                    && (failed >= self.settings.record_wait_attempts
                        || now.mono_ms.saturating_sub(since) >= self.settings.record_wait_ms) =>
            {
                let note = format!(
                    "the Evicting record could not be written ({failed} failed attempts in {}s); evicting without \
                     it, and writing it while the pod terminates: until it lands, the budget's eviction count \
                     misses this eviction",
                    seconds(now.mono_ms.saturating_sub(since))
                );
                self.event(&mut mem, now.mono_ms, Reason::RecordNotWritten, note, out);
                out.push(Action::Evict { pod: mem.pod.clone(), grace_seconds: self.grace(&mem, cx), recorded: false });
                mem.eviction = Eviction::InFlight { attempts: 0, refused_since: None };
            }
            // Back under before any request was accepted: no eviction happened, so the record must not say one
            // was asked for (the operator would count a later, unrelated deletion of the pod as one).
            Eviction::AwaitingRecord { .. } if !due => {
                mem.eviction = Eviction::Idle;
                mem.eviction_requested_at = None;
            }
            Eviction::Blocked { retry_at, attempts, refused_since }
                if evictable && (now.mono_ms >= retry_at || blocked_too_long(budget, refused_since, now.mono_ms)) =>
            {
                let grace_seconds = self.grace(&mem, cx);
                if blocked_too_long(budget, refused_since, now.mono_ms) {
                    let note = format!(
                        "evictions refused for {}s (blockedEvictionTimeoutSeconds {}): deleting the pod with {}, as \
                         the kubelet's node-pressure eviction does; {}",
                        seconds(now.mono_ms.saturating_sub(refused_since)),
                        budget.blocked_eviction_timeout_seconds.unwrap_or_default(),
                        cx.grace_text(),
                        cx.used_of()
                    );
                    self.event(&mut mem, now.mono_ms, Reason::Deleting, note, out);
                    out.push(Action::Delete { pod: mem.pod.clone(), grace_seconds });
                } else {
                    out.push(Action::Evict { pod: mem.pod.clone(), grace_seconds, recorded: record_landed(&mem) });
                }
                mem.eviction = Eviction::InFlight { attempts, refused_since: Some(refused_since) };
            }
            Eviction::Blocked { .. } if !due => {
                mem.eviction = Eviction::Idle;
                mem.eviction_requested_at = None;
            }
            _ => {}
        }

        // The record: compared field by field, built only when due.
        let state = record_state(&mem);
        if !applied && !mem.write_in_flight && now.mono_ms >= mem.write_retry_at {
            let due = match &mem.written {
                None => true,
                Some(w) => {
                    w.state != state
                        || w.budget != budget.name
                        || w.node != self.settings.node
                        || w.eviction_requested_at != mem.eviction_requested_at
                        || (percent_changed(w.usage_bytes, total, self.settings.usage_change_percent)
                            && now.mono_ms.saturating_sub(mem.last_write_ms) >= self.settings.usage_min_interval_ms)
                }
            };
            if due {
                out.push(Action::Apply { pod: mem.pod.clone(), record: self.desired(&mem, cx) });
                mem.write_in_flight = true;
            }
        }
        self.pods.insert(view.uid.clone(), mem);
    }

    /// The grace period of an eviction: the budget's, or for pressure the agent's capped by the budget's.
    fn grace(&self, mem: &PodMemory, cx: &Context<'_>) -> Option<i64> {
        match mem.pressure {
            Some(_) => Some(
                cx.budget
                    .eviction_grace_period_seconds
                    .map_or(self.settings.pressure_grace_seconds, |cap| cap.min(self.settings.pressure_grace_seconds)),
            ),
            None => cx.grace_seconds(),
        }
    }

    fn desired(&self, mem: &PodMemory, cx: &Context<'_>) -> PodRecord {
        PodRecord {
            state: record_state(mem),
            usage_bytes: cx.usage.total,
            budget: cx.budget.name.clone(),
            node: self.settings.node.clone(),
            eviction_requested_at: mem.eviction_requested_at.clone(),
        }
    }

    /// Whether GPU `gpu` (index in the snapshot) is under memory pressure.
    pub fn under_pressure(&self, gpu: usize) -> bool {
        self.gpus.get(gpu).is_some_and(|g| g.signal.active())
    }

    /// The pressure step of a tick, after [`Self::tick`] with the same inputs: each GPU's signal from its
    /// used bytes (`used`, per GPU; `None`: unknown, no signal), events on the Node when it begins and ends,
    /// and while it lasts one eviction at a time per GPU: the evictable pod most over its budget among those
    /// holding memory on it ([`pressure::choose`]), without waiting for `overLimitSeconds`. Pods within
    /// their budget, without one, with a `Warn` budget, critical or static are never chosen. While a pod
    /// this agent is evicting (record on its way, request out, or accepted) still holds memory on the GPU,
    /// no other is chosen (the kubelet's "wait for reclaim"); a refused one gives the GPU's turn back, and the
    /// next choice waits for the eviction backoff (so at most one pressure eviction per GPU is in flight).
    pub fn pressure(
        &mut self,
        now: Now,
        table: &PodTable,
        usage: &[PodUsage],
        snapshot: &Snapshot,
        out: &mut Vec<Action>,
    ) {
        if !self.settings.pressure.enabled() {
            return;
        }
        self.gpus.resize_with(snapshot.gpus.len(), GpuPressure::default);
        let empty = PodUsage::default();
        for (g, info) in snapshot.gpus.iter().enumerate() {
            // A GPU whose sample failed has no figures: no pressure is decided from it.
            let Some(memory) = snapshot.memory(g).filter(|_| info.total_bytes > 0) else { continue };
            let (free, total) = (memory.free, info.total_bytes);
            let settings = self.settings.pressure;
            let gpu = &mut self.gpus[g];
            match gpu.signal.observe(&settings, free, total, now.mono_ms) {
                pressure::Change::Began(cause) => {
                    let (name, threshold) = match cause {
                        pressure::Cause::Hard => ("hard", settings.hard),
                        pressure::Cause::Soft => ("soft", settings.soft),
                    };
                    let threshold = threshold.map_or(0, |t| t.bytes(total));
                    let note = format!(
                        "GPU {}: {} free of {}, under the {name} threshold ({}); evicting pods over their budgets on it, the most over first, one at a time",
                        info.label,
                        HumanBytes(free),
                        HumanBytes(total),
                        HumanBytes(threshold)
                    );
                    out.push(Action::NodeEvent { reason: NodeReason::Pressure, note });
                }
                pressure::Change::Ended => {
                    gpu.told_overcommitted = false;
                    let note = format!(
                        "GPU {}: {} free of {}, above the thresholds for {}s",
                        info.label,
                        HumanBytes(free),
                        HumanBytes(total),
                        seconds(settings.transition_ms)
                    );
                    out.push(Action::NodeEvent { reason: NodeReason::PressureEnded, note });
                }
                pressure::Change::None => {}
            }
            if !gpu.signal.breached() {
                continue;
            }
            let on_gpu = |i: usize| -> u64 {
                usage.get(i).unwrap_or(&empty).holders.iter().filter(|h| h.gpu == g).map(|h| h.bytes).sum()
            };
            if now.mono_ms < gpu.retry_at {
                continue;
            }
            // Wait for reclaim: a pod this agent is evicting still holds memory here.
            let reclaiming = table.pods.iter().enumerate().any(|(i, view)| {
                on_gpu(i) > 0
                    && self.pods.get(&view.uid).is_some_and(|m| {
                        matches!(
                            m.eviction,
                            Eviction::AwaitingRecord { .. } | Eviction::InFlight { .. } | Eviction::Done
                        )
                    })
            });
            if reclaiming {
                continue;
            }
            // The pods holding memory here (table indexes) and what the choice needs of them.
            let (mut on_this_gpu, mut candidates) = (Vec::new(), Vec::new());
            for (i, view) in table.pods.iter().enumerate() {
                let bytes = on_gpu(i);
                if bytes == 0 {
                    continue;
                }
                let budget = table.budget(i);
                let evictable = budget.is_some_and(|b| b.action == BudgetAction::Evict)
                    && view.never_evicted().is_none()
                    && !view.terminating
                    && view.node.as_deref() == Some(self.settings.node.as_str())
                    // Not one whose eviction by its budget is under way or refused (that one retries on its own).
                    && self.pods.get(&view.uid).is_some_and(|m| m.eviction == Eviction::Idle);
                on_this_gpu.push(i);
                candidates.push(pressure::Candidate {
                    key: format!("{}/{}", view.namespace, view.name),
                    usage: usage.get(i).unwrap_or(&empty).total,
                    limit: budget.map(|b| b.limit_bytes),
                    on_gpu: bytes,
                    evictable,
                });
            }
            match pressure::choose(&candidates) {
                Some(c) => {
                    let i = on_this_gpu[c];
                    let (view, budget) = (&table.pods[i], table.budget(i));
                    let (Some(budget), Some(mut mem)) = (budget, self.pods.remove(&view.uid)) else { continue };
                    let cx = Context { view, budget, usage: usage.get(i).unwrap_or(&empty), gpus: &snapshot.gpus };
                    mem.pressure = Some(g);
                    let at = now.wall.round(jiff::Unit::Second).unwrap_or(now.wall).to_string();
                    mem.eviction_requested_at = Some(at);
                    out.push(Action::Apply { pod: mem.pod.clone(), record: self.desired(&mem, &cx) });
                    mem.write_in_flight = true;
                    let note = format!(
                        "{}; GPU {} is under memory pressure ({} free of {}) and this pod is the most over its budget there: evicting with {}s grace; {}",
                        cx.used_of(),
                        info.label,
                        HumanBytes(free),
                        HumanBytes(total),
                        self.grace(&mem, &cx).unwrap_or_default(),
                        cx.held_by()
                    );
                    mem.last_event_ms[Reason::Evicting.slot()] = Some(now.mono_ms);
                    out.push(Action::Event { pod: mem.pod.clone(), reason: Reason::Evicting, note: bounded(note) });
                    mem.eviction = Eviction::AwaitingRecord { since: now.mono_ms, failed: 0 };
                    self.pods.insert(view.uid.clone(), mem);
                }
                None if !gpu_told(&mut self.gpus[g]) => {
                    let mut pods: Vec<String> = candidates
                        .iter()
                        .take(5)
                        .map(|c| {
                            let limit =
                                c.limit.map_or_else(|| "no budget".to_owned(), |l| format!("limit {}", HumanBytes(l)));
                            format!("{} {} ({limit})", c.key, HumanBytes(c.on_gpu))
                        })
                        .collect();
                    if candidates.len() > 5 {
                        pods.push(format!("and {} more", candidates.len() - 5));
                    }
                    let note = format!(
                        "GPU {}: {} free of {} and no pod on it may be evicted for pressure: none is over its budget (or those over it are critical, static or Warn); the budgets of the pods using it add up to more than it holds: {}",
                        info.label,
                        HumanBytes(free),
                        HumanBytes(total),
                        pods.join(", ")
                    );
                    out.push(Action::NodeEvent { reason: NodeReason::Overcommitted, note: bounded(note) });
                }
                None => {}
            }
        }
    }

    /// Takes an executor's report into account; may emit events (a blocked eviction).
    pub fn feedback(&mut self, now: Now, feedback: Feedback, out: &mut Vec<Action>) {
        let (write_min, usage_interval, evict_min, evict_max) = (
            self.settings.write_backoff_min_ms,
            self.settings.usage_min_interval_ms,
            self.settings.evict_backoff_min_ms,
            self.settings.evict_backoff_max_ms,
        );
        match feedback {
            Feedback::Written { uid, record, ok } => {
                let Some(mem) = self.pods.get_mut(&uid) else { return };
                mem.write_in_flight = false;
                if ok {
                    mem.has_annotations = record.is_some();
                    mem.written = record;
                    mem.last_write_ms = now.mono_ms;
                    mem.write_failures = 0;
                    mem.write_retry_at = 0;
                } else {
                    if let Eviction::AwaitingRecord { failed, .. } = &mut mem.eviction {
                        *failed = failed.saturating_add(1);
                    }
                    mem.write_failures = mem.write_failures.saturating_add(1);
                    let backoff = write_min
                        .saturating_mul(1 << mem.write_failures.min(16).saturating_sub(1))
                        .min(usage_interval.max(write_min));
                    mem.write_retry_at = now.mono_ms + backoff;
                }
            }
            Feedback::Evicted { uid, outcome } => {
                let Some(mut mem) = self.pods.remove(&uid) else { return };
                let (attempts, refused_since) = match mem.eviction {
                    Eviction::Blocked { attempts, refused_since, .. } => (attempts, Some(refused_since)),
                    Eviction::InFlight { attempts, refused_since } => (attempts, refused_since),
                    Eviction::Idle | Eviction::AwaitingRecord { .. } | Eviction::Done => (0, None),
                };
                let attempts = attempts + 1;
                let refused_since = refused_since.unwrap_or(now.mono_ms);
                let backoff = evict_min.saturating_mul(1 << attempts.min(16).saturating_sub(1)).min(evict_max);
                match outcome {
                    EvictOutcome::Accepted | EvictOutcome::Gone => mem.eviction = Eviction::Done,
                    // Every refusal is told (a PodDisruptionBudget's 429, the 500 of two PodDisruptionBudgets,
                    // a webhook's denial, a timeout): a silent failure would hide a pod holding its memory.
                    EvictOutcome::Blocked(message) | EvictOutcome::Failed(message) => {
                        mem.eviction = Eviction::Blocked { attempts, retry_at: now.mono_ms + backoff, refused_since };
                        // A refused pressure eviction gives the GPU's turn back: after the backoff the pressure
                        // step chooses again (this pod or the next most over), so at most one pressure eviction
                        // per GPU is ever in flight. The pod is not being evicted any more.
                        if let Some(g) = mem.pressure.take() {
                            if let Some(gpu) = self.gpus.get_mut(g) {
                                gpu.retry_at = now.mono_ms + backoff;
                            }
                            mem.eviction = Eviction::Idle;
                            mem.eviction_requested_at = None;
                        }
                        // The eviction check of nodeRestriction (the operator's webhook) refusing or unreachable.
                        let check = if message.contains("webhook") {
                            " (the eviction check of nodeRestriction, served by the gpubudget operator, refused it or \
                             could not be reached: is the operator up?)"
                        } else {
                            ""
                        };
                        let note = format!(
                            "eviction refused: {message}{check}; using {} of {} (budget {}); retrying in {}s",
                            HumanBytes(mem.last_usage),
                            HumanBytes(mem.last_limit),
                            mem.last_budget,
                            seconds(backoff)
                        );
                        self.event(&mut mem, now.mono_ms, Reason::EvictionBlocked, note, out);
                    }
                }
                self.pods.insert(uid, mem);
            }
        }
    }
}

#[cfg(test)]
mod tests;
