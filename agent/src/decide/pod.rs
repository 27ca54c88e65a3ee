//! One pod under its budget, between ticks: the state machine's step on its summed usage, the events of its
//! transitions, its record (annotations) and its eviction's lifecycle (record first, then the request;
//! refusals, backoff, delete after `blockedEvictionTimeoutSeconds`), and what the executors report back.

use gpubudget_common::enforcement::{self, Enforcement, Mode};
use gpubudget_common::pod_record::{DriverLimitsRecord, PodRecord};
use gpubudget_common::quantity::HumanBytes;
use gpubudget_common::{Budget, BudgetAction, BudgetState, Thresholds, Tracker, step};

use super::notes::{bounded, holders_summary, seconds};
use super::{Action, Enforcer, EvictOutcome, Feedback, Now, PodRef, Reason, cadence};
use crate::attribute::PodUsage;
use crate::attribute::pods::PodView;
use crate::sample::GpuInfo;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(in crate::decide) enum Eviction {
    Idle,
    /// Due since `since` (monotonic ms): the `Evicting` record (with `eviction-requested-at`) is on its way;
    /// the request follows once the API has it, so the operator can count the eviction even when the pod is
    /// gone in a moment; or, when `failed` writes reach [`super::Settings::record_wait_attempts`] or the wait
    /// [`super::Settings::record_wait_ms`], without it.
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
    /// Observe mode (#54): the eviction was due and was told as "would evict" (`GpuMemoryWouldEvict`), not
    /// requested; held while it stays due, so it is told once per episode. `gpu`: `Some` for pressure relief on
    /// that GPU ([`super::pressure::step`]), `None` for the budget's own limit.
    Observed {
        gpu: Option<usize>,
    },
}

/// The state a pod's record says: `Evicting` while evicted for pressure, else the state machine's.
pub(in crate::decide) fn record_state(mem: &PodMemory) -> BudgetState {
    if mem.pressure.is_some() { BudgetState::Evicting } else { mem.tracker.state }
}

/// Whether the record's word on the pod's cap is due: at once when a breach is first seen (a pod must not stay
/// counted capped), otherwise (another breach's words, or the cap back in force) spaced like a state move, so a
/// pod cycling uncapped processes cannot make its node write every tick.
fn cap_due(written: &PodRecord, mem: &PodMemory, spaced: bool) -> bool {
    let now = mem.cap_breach.as_ref().map(|(_, n)| n.as_str());
    match (written.cap_not_in_force.as_deref(), now) {
        (None, Some(_)) => true,
        (w, n) => w != n && spaced,
    }
}

/// Whether evictions were refused for the budget's `blockedEvictionTimeoutSeconds` (never when unset).
fn blocked_too_long(budget: &Budget, refused_since: u64, now: u64) -> bool {
    budget.blocked_eviction_timeout_seconds.is_some_and(|t| now.saturating_sub(refused_since) >= t.saturating_mul(1000))
}

/// Whether the API has the record that says this eviction was requested (written by this agent).
pub(in crate::decide) fn record_landed(mem: &PodMemory) -> bool {
    mem.eviction_requested_at.is_some()
        && mem.written.as_ref().is_some_and(|w| w.eviction_requested_at == mem.eviction_requested_at)
}

#[derive(Debug, Clone)]
pub(in crate::decide) struct PodMemory {
    pub(in crate::decide) pod: PodRef,
    pub(in crate::decide) tracker: Tracker,
    /// The action and `overLimitSeconds` of the budget the tracker counted under: a change starts the
    /// period afresh (an edit never acts on time already spent over the limit).
    /// And whether they were observed or enforced (#54).
    pub(in crate::decide) policy: Option<(BudgetAction, u64, Enforcement)>,
    pub(in crate::decide) reported: BudgetState,
    pub(in crate::decide) written: Option<PodRecord>,
    pub(in crate::decide) has_annotations: bool,
    pub(in crate::decide) last_write_ms: u64,
    pub(in crate::decide) write_in_flight: bool,
    pub(in crate::decide) write_failures: u32,
    pub(in crate::decide) write_retry_at: u64,
    pub(in crate::decide) eviction: Eviction,
    pub(in crate::decide) eviction_requested_at: Option<String>,
    pub(in crate::decide) last_event_ms: [Option<u64>; Reason::COUNT],
    /// For messages written from feedback.
    pub(in crate::decide) last_usage: u64,
    pub(in crate::decide) last_limit: u64,
    pub(in crate::decide) last_budget: String,
    pub(in crate::decide) seen: u64,
    /// The GPU whose memory pressure this pod is being evicted for.
    pub(in crate::decide) pressure: Option<usize>,
    /// A pressure eviction of this pod was refused: kept across the turns the refusals give back and across
    /// pressure episodes, so a PodDisruptionBudget holds pressure relief back a bounded time of pressure only
    /// (#33, #52). Cleared when the pod is back within its guarantee, or its GPU harms no one for a while.
    pub(in crate::decide) pressure_refused: Option<super::pressure::Refused>,
    /// How the driver's limits disagree with the budget now ([`super::driver_limits`]).
    pub(in crate::decide) driver: Option<super::driver_limits::Disagreement>,
    /// The kinds of disagreement told already (bit per [`super::driver_limits::Disagreement::kind`]).
    pub(in crate::decide) driver_told: u8,
    /// What the record should say of the driver's limits; what the last accepted write said; what the write in
    /// flight says.
    pub(in crate::decide) driver_record: Option<DriverLimitsRecord>,
    pub(in crate::decide) driver_written: Option<DriverLimitsRecord>,
    pub(in crate::decide) driver_pending: Option<DriverLimitsRecord>,
    /// Why the pod's MPS cap is not in force, while the process that showed it lives ([`super::cap_check`]),
    /// and the record's words for it (fixed when seen, so the record is written once per breach).
    pub(in crate::decide) cap_breach: Option<(super::cap_check::Breach, String)>,
    /// Why the pod's declared share could not be read, as last told (`GpuMemoryShareUnresolved`, once per
    /// reason).
    pub(in crate::decide) share_told: Option<String>,
}

/// A pod's thresholds under its budget, for its budget's own evictions.
struct OwnThresholds {
    /// The state machine's rules (in observe mode, never evicting).
    rules: Thresholds,
    /// Observe mode (#54): the eviction the rules would have made due is told as "would evict" instead.
    would_evict: bool,
}

/// Where a pod's eviction stands this tick ([`Enforcer::eviction_due`]).
#[derive(Debug, Clone, Copy)]
struct Due {
    /// Due: by the budget's timer (`Evicting`) or for memory pressure on a GPU.
    due: bool,
    /// Due, and may be carried out (its action, its exemptions, its node).
    evictable: bool,
    /// Observe mode (#54): the budget's own eviction would have been due, and is told instead.
    would_be_due: bool,
}

pub(in crate::decide) struct Context<'a> {
    pub(in crate::decide) view: &'a PodView,
    pub(in crate::decide) budget: &'a Budget,
    /// Only a namespaced budget selects the pod and tenants may write those
    /// ([`NamespacedBudgets::ClusterBound`](super::pressure::NamespacedBudgets)): under pressure it is
    /// guaranteed nothing and `Warn` does not keep it (#33).
    pub(in crate::decide) tenant_only: bool,
    pub(in crate::decide) usage: &'a PodUsage,
    pub(in crate::decide) gpus: &'a [GpuInfo],
}

impl Context<'_> {
    /// What the pod is guaranteed under GPU memory pressure: its budget's request, else its limit; nothing
    /// when only a tenant-written budget selects it.
    pub(in crate::decide) fn pressure_guarantee(&self) -> u64 {
        if self.tenant_only { 0 } else { self.budget.guaranteed_bytes() }
    }

    pub(in crate::decide) fn used_of(&self) -> String {
        format!(
            "using {} of {} ({})",
            HumanBytes(self.usage.total),
            HumanBytes(self.budget.limit_bytes),
            self.budget.described()
        )
    }

    /// "3Gi above its request of 4Gi" when the budget sets a request; `None` without one.
    pub(in crate::decide) fn above_request(&self) -> Option<String> {
        let request = self.budget.request_bytes?;
        let above = self.usage.total.saturating_sub(request);
        Some(format!("{} above its request of {}", HumanBytes(above), HumanBytes(request)))
    }

    pub(in crate::decide) fn held_by(&self) -> String {
        format!("held by {}", holders_summary(&self.usage.holders, self.gpus))
    }

    /// The grace period of an eviction (or delete) of this pod: [`Budget::eviction_grace_seconds`].
    pub(in crate::decide) fn grace_seconds(&self) -> Option<i64> {
        Some(self.eviction_grace())
    }

    /// [`Budget::eviction_grace_seconds`]; a budget only a tenant wrote
    /// ([`NamespacedBudgets::ClusterBound`](super::pressure::NamespacedBudgets)) gets at most the 30 s cap: its
    /// author cannot have its pod hold the memory for a day while it terminates (#33).
    fn eviction_grace(&self) -> i64 {
        let grace = self.budget.eviction_grace_seconds(self.view.termination_grace_seconds);
        if self.tenant_only { grace.min(gpubudget_common::budget::DEFAULT_EVICTION_GRACE_CAP_SECONDS) } else { grace }
    }

    fn grace_text(&self) -> String {
        let grace = self.eviction_grace();
        let own = self.view.termination_grace_seconds.unwrap_or(30);
        match self.budget.eviction_grace_period_seconds {
            Some(asked) if self.tenant_only && asked > grace => {
                format!("{grace}s grace (the budget asks for {asked}s; capped for a budget only a tenant wrote)")
            }
            Some(_) => format!("{grace}s grace"),
            None if grace == own => format!("the pod's {grace}s grace"),
            None => format!("{grace}s grace (the pod asks for {own}s; capped when the budget sets none)"),
        }
    }
}

impl Enforcer {
    pub(in crate::decide) fn event(
        &self,
        mem: &mut PodMemory,
        now: u64,
        reason: Reason,
        note: String,
        out: &mut Vec<Action>,
    ) {
        let slot = &mut mem.last_event_ms[reason.slot()];
        if slot.is_some_and(|at| now.saturating_sub(at) < self.settings.event_cooldown_ms) {
            return;
        }
        *slot = Some(now);
        out.push(Action::Event { pod: mem.pod.clone(), reason, note: bounded(note) });
    }

    fn new_memory(&self, now: Now, view: &PodView) -> PodMemory {
        // What this agent (on this node) recorded before a restart.
        let record = view.record.clone().filter(|r| *r.node == *self.settings.node);
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
            pressure_refused: None,
            driver: None,
            driver_told: 0,
            driver_record: None,
            driver_written: None,
            driver_pending: None,
            cap_breach: None,
            share_told: None,
        }
    }

    pub(in crate::decide) fn take_memory(&mut self, now: Now, view: &PodView) -> PodMemory {
        match self.pods.remove(&view.uid) {
            Some(mut mem) => {
                mem.pod = PodRef::of(view);
                mem
            }
            None => self.new_memory(now, view),
        }
    }

    pub(in crate::decide) fn tick_unbudgeted(&mut self, now: Now, view: &PodView, out: &mut Vec<Action>) {
        let mut mem = self.take_memory(now, view);
        mem.seen = self.generation;
        mem.last_budget.clear();
        mem.tracker = Tracker::default();
        mem.policy = None;
        mem.reported = BudgetState::Within;
        if matches!(mem.eviction, Eviction::Blocked { .. } | Eviction::AwaitingRecord { .. }) {
            mem.eviction = Eviction::Idle;
            mem.pressure = None;
        }
        if mem.eviction == (Eviction::Observed { gpu: None }) {
            mem.eviction = Eviction::Idle;
        }
        // A record of ours with no budget behind it any more: remove it, once.
        let ours = view.record.as_ref().is_some_and(|r| *r.node == *self.settings.node) || mem.written.is_some();
        if ours && mem.has_annotations && !mem.write_in_flight && now.mono_ms >= mem.write_retry_at {
            mem.write_in_flight = true;
            out.push(Action::Clear { pod: mem.pod.clone() });
        }
        self.pods.insert(view.uid.clone(), mem);
    }

    /// One tick of a budgeted pod, in its steps: its thresholds under its mode, the period started afresh on a
    /// budget edit, the share and cap told, the state machine's step on its usage, the transition told, whether
    /// an eviction is due and its lifecycle moved on, and its record written when due.
    pub(in crate::decide) fn tick_pod(&mut self, now: Now, cx: &Context<'_>, out: &mut Vec<Action>) {
        let (thresholds, own) = self.own_thresholds(cx);
        let mut mem = self.take_memory(now, cx.view);
        // Its usage at the last tick, if it was seen then (the rate its usage moves at).
        let prev_usage = (mem.seen + 1 == self.generation && !mem.last_budget.is_empty()).then_some(mem.last_usage);
        mem.seen = self.generation;
        self.restart_on_policy_change(now, &mut mem, cx, own, out);
        self.tell_share(now, &mut mem, cx.budget, out);
        self.check_cap(now, &mut mem, cx, out);
        self.step_usage(now, &mut mem, cx, &thresholds.rules, prev_usage);
        self.tell_transition(now, &mut mem, cx, thresholds.would_evict, out);
        let due = self.eviction_due(&mut mem, cx, &thresholds);
        let applied = self.move_eviction(now, &mut mem, cx, due, out);
        self.write_record(now, &mut mem, cx, applied, out);
        self.pods.insert(cx.view.uid.clone(), mem);
    }

    /// The pod's thresholds under its budget, and the mode of its budget's own evictions. Observe mode (#54): the
    /// budget's own eviction is only told. The state machine then never says `Evicting` (nothing is, and records,
    /// metrics and `top` must not say so); when it would have is [`Eviction::Observed`], by the same rule.
    fn own_thresholds(&self, cx: &Context<'_>) -> (OwnThresholds, Enforcement) {
        let budget = cx.budget;
        let mut rules = budget.thresholds(cx.view.never_evicted(&self.settings.critical_namespaces).is_some());
        let own = budget.enforcement.unwrap_or(self.node_mode.enforcement);
        let would_evict = rules.may_evict && own == Enforcement::Observe;
        rules.may_evict &= !would_evict;
        (OwnThresholds { rules, would_evict }, own)
    }

    /// A budget edit (Warn → Evict, a shorter overLimitSeconds) or a move to a budget that acts otherwise
    /// does not act on the time already spent over the limit: the period starts afresh, and is told.
    /// So does a move between observe and enforce (#54): switching a pod that has been over for an hour to
    /// Enforce does not evict it at once.
    fn restart_on_policy_change(
        &self,
        now: Now,
        mem: &mut PodMemory,
        cx: &Context<'_>,
        own: Enforcement,
        out: &mut Vec<Action>,
    ) {
        let budget = cx.budget;
        let policy = (budget.action, budget.over_limit_seconds, own);
        if let Some(old) = mem.policy.filter(|old| *old != policy) {
            if mem.tracker.state.is_over() {
                let mode = if old.2 == own {
                    String::new()
                } else {
                    format!(", enforcement {} → {own} (set by {})", old.2, self.own_mode(budget).set_by)
                };
                let note = format!(
                    "budget {} changed (action {} → {}, overLimitSeconds {} → {}{mode}): the over-limit period \
                     starts afresh; {}",
                    budget.key(),
                    old.0,
                    policy.0,
                    old.1,
                    policy.1,
                    cx.used_of()
                );
                self.event(mem, now.mono_ms, Reason::BudgetChanged, note, out);
            }
            mem.tracker = Tracker { state: mem.tracker.state, ..Tracker::default() };
        }
        mem.policy = Some(policy);
    }

    /// Why the pod's declared share cannot be read, or why its change is ignored: told once per reason.
    fn tell_share(&self, now: Now, mem: &mut PodMemory, budget: &Budget, out: &mut Vec<Action>) {
        if let Some(why) = budget.share_unresolved().filter(|why| mem.share_told.as_deref() != Some(*why)) {
            mem.share_told = Some(why.to_owned());
            let note = format!("its declared GPU memory share cannot be read; {}", budget.described());
            self.event(mem, now.mono_ms, Reason::ShareUnresolved, note, out);
        }
        if let Some(why) = budget.share_change_ignored().filter(|why| mem.share_told.as_deref() != Some(*why)) {
            mem.share_told = Some(why.to_owned());
            let note = format!("its declared GPU memory share changed: {why}; {}", budget.described());
            self.event(mem, now.mono_ms, Reason::ShareChangeIgnored, note, out);
        }
    }

    /// The state machine's step on the pod's usage; a pod near or over its limit, or moving fast, urges the pace
    /// ([`cadence::pod`]). What feedback's messages say of the pod is kept.
    fn step_usage(
        &mut self,
        now: Now,
        mem: &mut PodMemory,
        cx: &Context<'_>,
        thresholds: &Thresholds,
        prev_usage: Option<u64>,
    ) {
        let (budget, total) = (cx.budget, cx.usage.total);
        mem.tracker = step(mem.tracker, thresholds, now.mono_ms, total);
        let cadence = self.settings.cadence;
        if let Some(why) =
            cadence::pod(&cadence, mem.tracker.state, total, prev_usage, self.pace.dt_ms(), thresholds.warn)
        {
            self.pace.urge(&cadence, now.mono_ms, why);
        }
        mem.last_usage = total;
        mem.last_limit = budget.limit_bytes;
        if !budget.has_key(&mem.last_budget) {
            mem.last_budget = budget.key();
        }
    }

    /// A move of the state machine since the last tick: the transition (metrics) and its event.
    fn tell_transition(
        &self,
        now: Now,
        mem: &mut PodMemory,
        cx: &Context<'_>,
        would_evict: bool,
        out: &mut Vec<Action>,
    ) {
        let (budget, view) = (cx.budget, cx.view);
        let state = mem.tracker.state;
        if state == mem.reported {
            return;
        }
        out.push(Action::Transition {
            pod: mem.pod.clone(),
            from: mem.reported,
            to: state,
            usage: cx.usage.total,
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
                    "action is Warn: not evicted for being over its limit (only, as any pod above its \
                     guarantee, where its GPU fills and a neighbour is short of its own)"
                        .to_owned()
                } else if let Some(why) = view.never_evicted(&self.settings.critical_namespaces) {
                    why.to_owned()
                } else if would_evict {
                    format!(
                        "observe mode ({}): would be evicted if it stays over for {}s, and is not",
                        self.own_mode(budget).set_by,
                        budget.over_limit_seconds
                    )
                } else if budget.over_limit_seconds == 0 {
                    "evicting now".to_owned()
                } else {
                    format!("evicting if it stays over for {}s", budget.over_limit_seconds)
                };
                let why = self.not_exempt(view);
                Some((Reason::OverBudget, format!("{}; {then}; {}{why}", cx.used_of(), cx.held_by())))
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
            self.event(mem, now.mono_ms, reason, note, out);
        }
        mem.reported = state;
    }

    /// Whether the pod's eviction is due, by the budget's timer or for memory pressure on a GPU, and whether it may
    /// be carried out; or, in observe mode, whether it would have been due. Pressure relief ends for a pod back
    /// within its guarantee, unless the request is already out.
    fn eviction_due(&self, mem: &mut PodMemory, cx: &Context<'_>, thresholds: &OwnThresholds) -> Due {
        let (budget, view, total, state) = (cx.budget, cx.view, cx.usage.total, mem.tracker.state);
        // Eviction: by the budget's timer (over the limit, so above any request), or for memory pressure on a
        // GPU, only while still above its request (without one, its limit): a pod back within it is not
        // evicted, unless the request is already out.
        if mem.pressure.is_some()
            && total <= cx.pressure_guarantee()
            && !matches!(mem.eviction, Eviction::InFlight { .. })
        {
            mem.pressure = None;
        }
        let due = state == BudgetState::Evicting || mem.pressure.is_some();
        let evictable = due
            && (thresholds.rules.may_evict || mem.pressure.is_some())
            // Pressure relief whatever the action: `Warn` is about the pod's own limit (#52).
            && (budget.action == BudgetAction::Evict || mem.pressure.is_some())
            && view.never_evicted(&self.settings.critical_namespaces).is_none()
            && !view.terminating
            && view.node.as_deref() == Some(self.settings.node.as_str());
        // Observe mode: when the state machine would have said `Evicting`, by its rule (over now, and over for
        // `overLimitSeconds` in all); a pressure eviction already under way goes on.
        let would_be_due = thresholds.would_evict
            && thresholds.rules.due(total, mem.tracker.over_for())
            && mem.pressure.is_none()
            && view.never_evicted(&self.settings.critical_namespaces).is_none()
            && !view.terminating
            && view.node.as_deref() == Some(self.settings.node.as_str());
        Due { due, evictable, would_be_due }
    }

    /// The eviction's lifecycle moved on, as [`Self::eviction_due`] says: in observe mode told as "would evict"
    /// once per episode; else the `Evicting` record first, then the request; refusals retried with backoff, and
    /// the pod deleted after `blockedEvictionTimeoutSeconds`. Whether a record write went out (with the
    /// eviction's first step).
    fn move_eviction(&self, now: Now, mem: &mut PodMemory, cx: &Context<'_>, due: Due, out: &mut Vec<Action>) -> bool {
        let (budget, view, total) = (cx.budget, cx.view, cx.usage.total);
        let Due { due, evictable, would_be_due } = due;
        let mut applied = false;
        match mem.eviction {
            Eviction::Idle if would_be_due => {
                let note = format!(
                    "would be evicted (observe mode: {}; nothing is evicted): {} for {}s, an eviction would give {}; \
                     {}{}",
                    self.own_mode(budget).set_by,
                    cx.used_of(),
                    seconds(mem.tracker.over_for()),
                    cx.grace_text(),
                    cx.held_by(),
                    budget.under_generation()
                );
                // Once per episode (the state below holds it), not subject to the cooldown.
                mem.last_event_ms[Reason::WouldEvict.slot()] = Some(now.mono_ms);
                out.push(Action::Event { pod: mem.pod.clone(), reason: Reason::WouldEvict, note: bounded(note) });
                let set_by = self.own_mode(budget).set_by.level();
                out.push(Action::WouldEvict { pod: mem.pod.clone(), cause: super::EvictCause::Budget, set_by });
                mem.eviction = Eviction::Observed { gpu: None };
            }
            // Back under (or enforcing again, which starts the period afresh): a later episode is told again.
            Eviction::Observed { gpu: None } if !would_be_due => mem.eviction = Eviction::Idle,
            // Pressure relief observed on a GPU: over once the pod is back within its guarantee.
            Eviction::Observed { gpu: Some(_) } if total <= cx.pressure_guarantee() => mem.eviction = Eviction::Idle,
            Eviction::Idle if evictable => {
                let at = now.wall.round(jiff::Unit::Second).unwrap_or(now.wall).to_string();
                mem.eviction_requested_at = Some(at);
                let record = self.desired(mem, cx);
                mem.driver_pending = mem.driver_record.clone();
                out.push(Action::Apply { pod: mem.pod.clone(), record, driver: mem.driver_record.clone() });
                mem.write_in_flight = true;
                applied = true;
                let note = format!(
                    "{} for {}s; evicting with {}; {}{}{}",
                    cx.used_of(),
                    seconds(mem.tracker.over_for()),
                    cx.grace_text(),
                    cx.held_by(),
                    self.not_exempt(view),
                    budget.under_generation()
                );
                // Not subject to the cooldown: one per eviction, and evictions are rare.
                mem.last_event_ms[Reason::Evicting.slot()] = Some(now.mono_ms);
                out.push(Action::Event { pod: mem.pod.clone(), reason: Reason::Evicting, note: bounded(note) });
                mem.eviction = Eviction::AwaitingRecord { since: now.mono_ms, failed: 0 };
            }
            Eviction::AwaitingRecord { .. } if evictable && !mem.write_in_flight && record_landed(mem) => {
                out.push(Action::Evict { pod: mem.pod.clone(), grace_seconds: self.grace(mem, cx), recorded: true });
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
                self.event(mem, now.mono_ms, Reason::RecordNotWritten, note, out);
                out.push(Action::Evict { pod: mem.pod.clone(), grace_seconds: self.grace(mem, cx), recorded: false });
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
                let grace_seconds = self.grace(mem, cx);
                if blocked_too_long(budget, refused_since, now.mono_ms) {
                    let note = format!(
                        "evictions refused for {}s (blockedEvictionTimeoutSeconds {}): deleting the pod with {}, as \
                         the kubelet's node-pressure eviction does; {}{}",
                        seconds(now.mono_ms.saturating_sub(refused_since)),
                        budget.blocked_eviction_timeout_seconds.unwrap_or_default(),
                        cx.grace_text(),
                        cx.used_of(),
                        budget.under_generation()
                    );
                    self.event(mem, now.mono_ms, Reason::Deleting, note, out);
                    out.push(Action::Delete { pod: mem.pod.clone(), grace_seconds });
                } else {
                    out.push(Action::Evict { pod: mem.pod.clone(), grace_seconds, recorded: record_landed(mem) });
                }
                mem.eviction = Eviction::InFlight { attempts, refused_since: Some(refused_since) };
            }
            Eviction::Blocked { .. } if !due => {
                mem.eviction = Eviction::Idle;
                mem.eviction_requested_at = None;
            }
            _ => {}
        }
        applied
    }

    /// The pod's record (annotations), compared field by field and built only when due; none while a write is
    /// out, or when the eviction's first step (`applied`) just wrote it.
    fn write_record(&self, now: Now, mem: &mut PodMemory, cx: &Context<'_>, applied: bool, out: &mut Vec<Action>) {
        let (budget, view) = (cx.budget, cx.view);
        let state = record_state(mem);
        if !applied && !mem.write_in_flight && now.mono_ms >= mem.write_retry_at {
            let since_write = now.mono_ms.saturating_sub(mem.last_write_ms);
            let due = match &mem.written {
                None => true,
                Some(w) => {
                    // At once: what an eviction or another reader depends on. A move among Within, Near and
                    // Over is spaced by `state_min_interval_ms`, so a pod whose usage swings across a
                    // threshold every tick cannot make its node write every tick.
                    let moved = w.state != state;
                    (moved && (state == BudgetState::Evicting || since_write >= self.settings.state_min_interval_ms))
                        || !budget.is_record_name(&w.budget)
                        || *w.node != *self.settings.node
                        || w.eviction_requested_at != mem.eviction_requested_at
                        || cap_due(w, mem, since_write >= self.settings.state_min_interval_ms)
                        // What status counts besides the state: the pod's share and what the runtime made of its
                        // containers; they change rarely (a budget, a GPU, a container made), spaced as a move is.
                        || ((w.share != budget.held_share || w.runtime_caps != view.runtime_caps)
                            && since_write >= self.settings.state_min_interval_ms)
                }
            };
            // What the driver caps the pod at: rewritten when it changed, at most as often as usage.
            let driver_due =
                mem.driver_record != mem.driver_written && since_write >= self.settings.usage_min_interval_ms;
            if due || driver_due {
                mem.driver_pending = mem.driver_record.clone();
                let driver = mem.driver_record.clone();
                out.push(Action::Apply { pod: mem.pod.clone(), record: self.desired(mem, cx), driver });
                mem.write_in_flight = true;
            }
        }
    }

    /// The mode of the budget's own evictions of a pod (#54): the rules' `spec.enforcement`, else the node's.
    pub(in crate::decide) fn own_mode(&self, budget: &Budget) -> Mode {
        enforcement::for_budget(&self.node_mode, budget.enforcement, || budget.described())
    }

    /// For a critical-priority pod outside the namespaces the administrator lists: `; ` and why it is
    /// enforced all the same (#33). Empty otherwise.
    pub(in crate::decide) fn not_exempt(&self, view: &PodView) -> String {
        let critical = &self.settings.critical_namespaces;
        if view.critical && !critical.exempts(&view.namespace) {
            format!("; {}", critical.not_exempt_note())
        } else {
            String::new()
        }
    }

    /// The grace period of an eviction: the budget's, or for pressure the agent's capped by the budget's.
    pub(in crate::decide) fn grace(&self, mem: &PodMemory, cx: &Context<'_>) -> Option<i64> {
        match mem.pressure {
            Some(_) => Some(self.pressure_grace(Some(cx.budget))),
            None => cx.grace_seconds(),
        }
    }

    /// The grace period of a pressure eviction (or delete): the agent's, capped by the budget's
    /// `evictionGracePeriodSeconds`.
    pub(in crate::decide) fn pressure_grace(&self, budget: Option<&Budget>) -> i64 {
        let own = self.settings.pressure_grace_seconds;
        budget.map_or(own, |b| b.pressure_grace_seconds(own))
    }

    /// Whether the pod's MPS cap is in force ([`super::cap_check`]): a breach is kept while its process lives;
    /// a new one is told once (`GpuMemoryCapNotInForce`) and goes into the record at once.
    fn check_cap(&self, now: Now, mem: &mut PodMemory, cx: &Context<'_>, out: &mut Vec<Action>) {
        let Some(cap_mib) = cx.view.mps_cap_mib else {
            mem.cap_breach = None;
            return;
        };
        if mem.cap_breach.as_ref().is_some_and(|(b, _)| b.still_seen(&cx.usage.holders)) {
            return;
        }
        // The driver's per-cgroup hard limits (R615) hold the pod: each pair capped, within the budget.
        let driver_holds =
            mem.driver.is_none() && mem.driver_record.as_ref().is_some_and(|d| d.pairs > 0 && d.capped == d.pairs);
        mem.cap_breach = super::cap_check::check(cap_mib, &cx.usage.holders, driver_holds)
            .map(|breach| (breach, breach.note(cap_mib, cx.gpus)));
        if let Some((_, note)) = &mem.cap_breach {
            let note = format!("{note} ({})", cx.used_of());
            self.event(mem, now.mono_ms, Reason::CapNotInForce, note, out);
        }
    }

    /// Pods whose MPS cap the agent saw is not in force.
    pub fn caps_not_in_force(&self) -> usize {
        self.pods.values().filter(|m| m.cap_breach.is_some()).count()
    }

    pub(in crate::decide) fn desired(&self, mem: &PodMemory, cx: &Context<'_>) -> PodRecord {
        PodRecord {
            state: record_state(mem),
            usage_bytes: cx.usage.total,
            budget: cx.budget.record_name().into(),
            node: self.settings.node.as_str().into(),
            eviction_requested_at: mem.eviction_requested_at.clone(),
            cap_not_in_force: mem.cap_breach.as_ref().map(|(_, note)| note.clone()),
            share: cx.budget.held_share.clone(),
            runtime_caps: cx.view.runtime_caps.clone(),
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
                    mem.driver_written = if record.is_some() { mem.driver_pending.take() } else { None };
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
                    Eviction::Idle | Eviction::AwaitingRecord { .. } | Eviction::Done | Eviction::Observed { .. } => {
                        (0, None)
                    }
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
                            mem.pressure_refused =
                                Some(super::pressure::Refused::on(mem.pressure_refused, g, refused_since, now.mono_ms));
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
                        let using = if mem.last_budget.is_empty() {
                            format!("using {}, no budget selects this pod", HumanBytes(mem.last_usage))
                        } else {
                            format!(
                                "using {} of {} (budget {})",
                                HumanBytes(mem.last_usage),
                                HumanBytes(mem.last_limit),
                                mem.last_budget
                            )
                        };
                        let note =
                            format!("eviction refused: {message}{check}; {using}; retrying in {}s", seconds(backoff));
                        self.event(&mut mem, now.mono_ms, Reason::EvictionBlocked, note, out);
                    }
                }
                self.pods.insert(uid, mem);
            }
        }
    }
}
