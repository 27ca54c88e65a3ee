//! The pressure step of a tick ([`Enforcer::pressure`]): each GPU's [`Signal`](super::Signal), Node events when
//! it begins and ends, and while it lasts the choice ([`choose`](super::choose)) of one pod to evict per GPU,
//! carried out through the pod's eviction lifecycle ([`crate::decide::pod`]).

use gpubudget_common::BudgetAction;
use gpubudget_common::quantity::HumanBytes;

use super::{Candidate, Cause, Change, Harm, REFUSAL_WINDOW_MS, Refused, Signal, Unbudgeted, choose, harm};
use crate::attribute::PodUsage;
use crate::attribute::pods::PodTable;
use crate::decide::notes::{bounded, holders_summary, seconds};
use crate::decide::pod::{Context, Eviction};
use crate::decide::{Action, Enforcer, EvictCause, NodeReason, Now, Reason, cadence};
use crate::sample::Snapshot;

/// One GPU's memory pressure between ticks.
#[derive(Debug, Clone, Default)]
pub(in crate::decide) struct GpuPressure {
    pub(in crate::decide) signal: Signal,
    /// The "budgets add up to more than the GPU" event was sent for this episode.
    pub(in crate::decide) told_overcommitted: bool,
    /// The "full, but nobody is harmed" event was sent for this episode.
    pub(in crate::decide) told_unharmed: bool,
    /// The last tick at which a neighbour was harmed on this GPU, if the tick before this one was such a tick
    /// (what refused pods' [`Refused::pressed_ms`] grows by).
    pub(in crate::decide) last_harm_ms: Option<u64>,
    /// A pressure eviction on this GPU was refused: the next choice waits until then (monotonic ms).
    pub(in crate::decide) retry_at: u64,
    /// Free bytes at the last sample (the rate they fall at, for the [`cadence`]).
    pub(in crate::decide) last_free: Option<u64>,
}

/// How long refused pressure evictions hold a pod before it is deleted ([`Budget::pressure_blocked_timeout_ms`]
/// of the node's `--pressure-blocked-timeout`), and whose bound that is, for the event.
///
/// [`Budget::pressure_blocked_timeout_ms`]: gpubudget_common::Budget::pressure_blocked_timeout_ms
pub(in crate::decide) fn pressure_bound_ms(
    node_ms: u64,
    budget: Option<&gpubudget_common::Budget>,
) -> (u64, &'static str) {
    match budget.map(|b| b.pressure_blocked_timeout_ms(node_ms)) {
        Some(own) if own < node_ms => (own, "the budget's blockedEvictionTimeoutSeconds, shorter than the node's"),
        _ => (node_ms, "the node's pressure blocked timeout"),
    }
}

/// Marks the "overcommitted" event as sent for this pressure episode; whether it already was.
fn gpu_told(gpu: &mut GpuPressure) -> bool {
    std::mem::replace(&mut gpu.told_overcommitted, true)
}

/// The Node event of a GPU under pressure where nobody is harmed ([`Harm::Alone`], [`Harm::Fits`]): which it
/// is, and who holds the memory (at most 5 pods named).
fn unharmed_note(label: &str, free: u64, total: u64, harm: Harm, candidates: &[Candidate]) -> String {
    let mut holders: Vec<String> =
        candidates.iter().take(5).map(|c| format!("{} {}", c.key, HumanBytes(c.on_gpu))).collect();
    if candidates.len() > 5 {
        holders.push(format!("and {} more", candidates.len() - 5));
    }
    let why = match harm {
        Harm::Alone => "one pod holds it alone (a framework that preallocates, such as vLLM or TensorFlow?), so \
                        there is no neighbour to protect"
            .to_owned(),
        Harm::Fits { owed } | Harm::Short { owed } => format!(
            "the pods within their guarantee (request, else limit) are owed {} and that fits in what is free",
            HumanBytes(owed)
        ),
    };
    format!(
        "GPU {label}: {} free of {}, but no pod is harmed: {why}; nothing is evicted for pressure until a pod within \
         its guarantee is owed more than is free; held by {}",
        HumanBytes(free),
        HumanBytes(total),
        holders.join(", ")
    )
}

impl Enforcer {
    /// Pod `i` of the table as the pressure decisions see it: `usage` in all, `on_gpu` bytes on the GPU at hand.
    /// Only a tenant-written budget selects it (`--namespaced-budgets ClusterBound`): guaranteed nothing (#33).
    fn candidate(&self, table: &PodTable, i: usize, usage: u64, on_gpu: u64, evictable: bool) -> Candidate {
        let view = &table.pods[i];
        let budget = table.budget(i);
        let tenant_only = self.tenant_only(table, i);
        Candidate {
            key: format!("{}/{}", view.namespace, view.name),
            usage,
            limit: budget.map(|b| b.limit_bytes),
            request: if tenant_only { Some(0) } else { budget.and_then(|b| b.request_bytes) },
            on_gpu,
            evictable,
            warn: budget.is_some_and(|b| b.action == BudgetAction::Warn) && !tenant_only,
        }
    }

    /// Forgets a pod's refused pressure evictions ([`Refused`]) once it is back within its guarantee, or its GPU
    /// has harmed no one for [`REFUSAL_WINDOW_MS`].
    fn forget_refusals(&mut self, now_ms: u64, table: &PodTable, usage: &[PodUsage]) {
        if !self.pods.values().any(|m| m.pressure_refused.is_some()) {
            return;
        }
        let unbudgeted = self.settings.unbudgeted_pods;
        for (i, view) in table.pods.iter().enumerate() {
            let Some(refused) = self.pods.get(&view.uid).and_then(|m| m.pressure_refused) else { continue };
            let total = usage.get(i).map_or(0, |u| u.total);
            let within = self.candidate(table, i, total, 0, false).over(unbudgeted) == 0;
            let quiet = now_ms.saturating_sub(refused.last_pressed_ms) >= REFUSAL_WINDOW_MS;
            if (within || quiet)
                && let Some(m) = self.pods.get_mut(&view.uid)
            {
                m.pressure_refused = None;
            }
        }
    }

    /// Forgets the pressure relief observe mode told on GPU `gpu` (`None`: on any): the GPU harms no one any more,
    /// or the node enforces now. A later episode is told again.
    fn forget_observed(&mut self, gpu: Option<usize>) {
        for m in self.pods.values_mut() {
            if let Eviction::Observed { gpu: Some(g) } = m.eviction
                && gpu.is_none_or(|want| want == g)
            {
                m.eviction = Eviction::Idle;
            }
        }
    }

    /// Whether GPU `gpu` (index in the snapshot) is under memory pressure.
    pub fn under_pressure(&self, gpu: usize) -> bool {
        self.gpus.get(gpu).is_some_and(|g| g.signal.active())
    }

    /// The pressure step of a tick, after [`Self::tick`] with the same inputs: each GPU's signal from its
    /// used bytes (`used`, per GPU; `None`: unknown, no signal), events on the Node when it begins and ends,
    /// and while it lasts one eviction at a time per GPU: the evictable pod most above its guarantee (its
    /// budget's request, else its limit) among those holding memory on it ([`choose`]), without waiting for
    /// `overLimitSeconds`. Pods within their request (without one, their limit), with a `Warn` budget,
    /// critical or static are never chosen; pods no budget selects are ranked as guaranteed nothing under the
    /// node policy [`Unbudgeted::Ranked`] (evicted at once, without a record: no budget counts them) and never
    /// chosen under [`Unbudgeted::Never`]. While a pod
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
        self.forget_refusals(now.mono_ms, table, usage);
        // Observe mode (#54) follows the node for pressure relief: an enforcing node forgets what it observed, so
        // relief acts at once.
        let observe = self.node_mode.observes();
        if !observe {
            self.forget_observed(None);
        }
        let empty = PodUsage::default();
        for (g, info) in snapshot.gpus.iter().enumerate() {
            // A GPU whose sample failed has no figures: no pressure is decided from it.
            let Some(memory) = snapshot.memory(g).filter(|_| info.total_bytes > 0) else { continue };
            let (free, total) = (memory.free, info.total_bytes);
            let settings = self.settings.pressure;
            let unbudgeted = self.settings.unbudgeted_pods;
            let gpu = &mut self.gpus[g];
            let threshold = settings.threshold_bytes(total);
            let cadence = self.settings.cadence;
            if let Some(why) = cadence::gpu(&cadence, free, gpu.last_free, self.pace.dt_ms(), threshold) {
                self.pace.urge(&cadence, now.mono_ms, why);
            }
            gpu.last_free = Some(free);
            match gpu.signal.observe(&settings, free, total, now.mono_ms) {
                Change::Began(cause) => {
                    let (name, threshold) = match cause {
                        Cause::Hard => ("hard", settings.hard),
                        Cause::Soft => ("soft", settings.soft),
                    };
                    let threshold = threshold.map_or(0, |t| t.bytes(total));
                    let unbudgeted = match self.settings.unbudgeted_pods {
                        Unbudgeted::Ranked => {
                            " (pods no budget selects count as guaranteed nothing: unbudgetedPods=Ranked)"
                        }
                        Unbudgeted::Never => " (pods no budget selects are never evicted for it: unbudgetedPods=Never)",
                    };
                    let act = if observe {
                        format!(
                            "telling which pod would be evicted (observe mode: {}; nothing is evicted)",
                            self.node_mode.set_by
                        )
                    } else {
                        "evicting".to_owned()
                    };
                    let note = format!(
                        "GPU {}: {} free of {}, under the {name} threshold ({}); while pods on it within their guarantee (request, else limit) are owed more than is free, {act} the pod most above its guarantee{unbudgeted}, one at a time",
                        info.label,
                        HumanBytes(free),
                        HumanBytes(total),
                        HumanBytes(threshold)
                    );
                    out.push(Action::NodeEvent { reason: NodeReason::Pressure, note });
                }
                Change::Ended => {
                    // A pod's refusals are kept (#52): the bound counts the pressure it has caused in all.
                    gpu.told_overcommitted = false;
                    gpu.told_unharmed = false;
                    let note = format!(
                        "GPU {}: {} free of {}, above the thresholds for {}s",
                        info.label,
                        HumanBytes(free),
                        HumanBytes(total),
                        seconds(settings.transition_ms)
                    );
                    out.push(Action::NodeEvent { reason: NodeReason::PressureEnded, note });
                }
                Change::None => {}
            }
            if !gpu.signal.breached() {
                gpu.last_harm_ms = None;
                self.forget_observed(Some(g));
                continue;
            }
            let on_gpu = |i: usize| -> u64 {
                usage.get(i).unwrap_or(&empty).holders.iter().filter(|h| h.gpu == g).map(|h| h.bytes).sum()
            };
            // The pods holding memory here (table indexes) and what the choice needs of them.
            let (mut on_this_gpu, mut candidates) = (Vec::new(), Vec::new());
            for (i, view) in table.pods.iter().enumerate() {
                let bytes = on_gpu(i);
                if bytes == 0 {
                    continue;
                }
                // A pod no budget selects is evictable only as the node policy says (`--unbudgeted-pods`); a
                // budget's `Warn` does not keep its pod (#52): it only ranks it after an `Evict` one.
                let evictable = (table.budget(i).is_some() || unbudgeted == Unbudgeted::Ranked)
                    && view.never_evicted(&self.settings.critical_namespaces).is_none()
                    && !view.terminating
                    && view.node.as_deref() == Some(self.settings.node.as_str())
                    // Not one whose eviction is under way; one whose eviction by its budget was refused (a
                    // PodDisruptionBudget) is a candidate like any other, so the node's bound ends its stall; and
                    // one whose budget only observes its own eviction (#54) is relieved as the node says.
                    && self.pods.get(&view.uid).is_some_and(|m| {
                        matches!(m.eviction, Eviction::Idle | Eviction::Blocked { .. } | Eviction::Observed { gpu: None })
                    });
                on_this_gpu.push(i);
                candidates.push(self.candidate(table, i, usage.get(i).unwrap_or(&empty).total, bytes, evictable));
            }
            // Relief only where a neighbour is harmed (#52): a pod alone, or neighbours whose guarantees still fit
            // in what is free, are a full card, not pressure on anyone.
            let harm = harm(&candidates, free, unbudgeted);
            if !harm.relieves() {
                self.forget_observed(Some(g));
                let gpu = &mut self.gpus[g];
                gpu.last_harm_ms = None;
                if !std::mem::replace(&mut gpu.told_unharmed, true) {
                    let note = unharmed_note(&info.label, free, total, harm, &candidates);
                    out.push(Action::NodeEvent { reason: NodeReason::FullNoneHarmed, note: bounded(note) });
                }
                continue;
            }
            let gpu = &mut self.gpus[g];
            // The pressure refused pods have held out against grows by the time since the last such tick.
            let dt = gpu.last_harm_ms.map_or(0, |at| now.mono_ms.saturating_sub(at));
            gpu.last_harm_ms = Some(now.mono_ms);
            for r in self.pods.values_mut().filter_map(|m| m.pressure_refused.as_mut()).filter(|r| r.gpu == g) {
                r.pressed_ms = r.pressed_ms.saturating_add(dt);
                r.last_pressed_ms = now.mono_ms;
            }
            // A pod whose refusals have held out for the node's bound of pressure is deleted now, not after the
            // eviction backoff (which may outlast an episode of pressure that comes and goes).
            let node_bound = self.settings.pressure_blocked_timeout_ms;
            let due =
                on_this_gpu.iter().zip(&candidates).position(|(&i, c)| {
                    c.evictable
                        && c.over(unbudgeted) > 0
                        && self.pods.get(&table.pods[i].uid).and_then(|m| m.pressure_refused).is_some_and(|r| {
                            r.gpu == g && r.pressed_ms >= pressure_bound_ms(node_bound, table.budget(i)).0
                        })
                });
            if due.is_none() && now.mono_ms < gpu.retry_at {
                continue;
            }
            // Wait for reclaim: a pod this agent is evicting still holds memory here; observing, one it would be
            // evicting for this GPU (told once: what it would do next waits as the eviction would).
            let reclaiming = table.pods.iter().enumerate().any(|(i, view)| {
                on_gpu(i) > 0
                    && self.pods.get(&view.uid).is_some_and(|m| match m.eviction {
                        Eviction::AwaitingRecord { .. } | Eviction::InFlight { .. } | Eviction::Done => true,
                        Eviction::Observed { gpu } => gpu == Some(g),
                        Eviction::Idle | Eviction::Blocked { .. } => false,
                    })
            });
            if reclaiming {
                continue;
            }
            let Harm::Short { owed } = harm else { continue };
            match due.or_else(|| choose(&candidates, unbudgeted)) {
                Some(c) => {
                    let i = on_this_gpu[c];
                    let (view, budget) = (&table.pods[i], table.budget(i));
                    let Some(mut mem) = self.pods.remove(&view.uid) else { continue };
                    if observe {
                        let pod_usage = usage.get(i).unwrap_or(&empty);
                        let (standing, guarantee) = match budget {
                            Some(b) if self.tenant_only(table, i) => (
                                format!("using {} ({})", HumanBytes(pod_usage.total), b.described()),
                                "only a namespaced budget selects it (namespacedBudgets=ClusterBound): guaranteed nothing",
                            ),
                            Some(b) => (
                                format!("using {} ({})", HumanBytes(pod_usage.total), b.described()),
                                "above its guarantee (request, else limit)",
                            ),
                            None => (
                                format!("using {}", HumanBytes(pod_usage.total)),
                                "no budget selects it: guaranteed nothing (unbudgetedPods=Ranked)",
                            ),
                        };
                        let note = format!(
                            "would be evicted (observe mode: {}; nothing is evicted): GPU {} is under memory pressure \
                             ({} free of {}; pods within their guarantee there are owed {}) and this pod is the most \
                             above its guarantee there: {standing}, {guarantee}; held by {}",
                            self.node_mode.set_by,
                            info.label,
                            HumanBytes(free),
                            HumanBytes(total),
                            HumanBytes(owed),
                            holders_summary(&pod_usage.holders, &snapshot.gpus)
                        );
                        mem.last_event_ms[Reason::WouldEvict.slot()] = Some(now.mono_ms);
                        out.push(Action::Event {
                            pod: mem.pod.clone(),
                            reason: Reason::WouldEvict,
                            note: bounded(note),
                        });
                        let set_by = self.node_mode.set_by.level();
                        out.push(Action::WouldEvict { pod: mem.pod.clone(), cause: EvictCause::Pressure, set_by });
                        mem.eviction = Eviction::Observed { gpu: Some(g) };
                        self.pods.insert(view.uid.clone(), mem);
                        continue;
                    }
                    // Its eviction by its budget was refused: the stall under pressure counts from now (the
                    // pressure eviction below is refused in its turn and keeps this first time).
                    if let Eviction::Blocked { .. } = mem.eviction {
                        mem.pressure_refused = Some(Refused::on(mem.pressure_refused, g, now.mono_ms, now.mono_ms));
                        mem.eviction = Eviction::Idle;
                    }
                    // Refused (a PodDisruptionBudget) for the bound: deleted with its grace, as the kubelet's
                    // node-pressure eviction does ([`pressure_bound_ms`]).
                    let (timeout_ms, whose) = pressure_bound_ms(self.settings.pressure_blocked_timeout_ms, budget);
                    if let Some(refused) = mem.pressure_refused.filter(|r| r.gpu == g && r.pressed_ms >= timeout_ms) {
                        let since = refused.first_ms;
                        let grace = self.pressure_grace(budget);
                        let pod_usage = usage.get(i).unwrap_or(&empty);
                        let note = format!(
                            "evictions for GPU memory pressure on GPU {} refused since {}s ago, while a neighbour \
                             there was short of its guarantee for {}s in all ({whose}: {}s): deleting the pod with \
                             {grace}s grace, as the kubelet's node-pressure eviction does; using {}; held by {}",
                            info.label,
                            seconds(now.mono_ms.saturating_sub(since)),
                            seconds(refused.pressed_ms),
                            seconds(timeout_ms),
                            HumanBytes(pod_usage.total),
                            holders_summary(&pod_usage.holders, &snapshot.gpus)
                        );
                        mem.pressure = Some(g);
                        mem.last_usage = pod_usage.total;
                        if budget.is_some() {
                            let at = now.wall.round(jiff::Unit::Second).unwrap_or(now.wall).to_string();
                            mem.eviction_requested_at = Some(at);
                        }
                        mem.last_event_ms[Reason::Deleting.slot()] = Some(now.mono_ms);
                        out.push(Action::Event { pod: mem.pod.clone(), reason: Reason::Deleting, note: bounded(note) });
                        out.push(Action::Delete { pod: mem.pod.clone(), grace_seconds: Some(grace) });
                        mem.eviction = Eviction::InFlight { attempts: 0, refused_since: Some(since) };
                        self.pods.insert(view.uid.clone(), mem);
                        continue;
                    }
                    let Some(budget) = budget else {
                        // No budget selects it (and the policy is `Ranked`): no record to write (no budget counts
                        // the eviction), so the request goes out at once, through the same eviction path.
                        let pod_usage = usage.get(i).unwrap_or(&empty);
                        mem.pressure = Some(g);
                        mem.last_usage = pod_usage.total;
                        let grace = self.pressure_grace(None);
                        let note = format!(
                            "no budget selects this pod; node policy unbudgetedPods={}: a pod without a budget is \
                             guaranteed nothing, so all its {} count as above its guarantee; GPU {} is under memory \
                             pressure ({} free of {}; pods within their guarantee there are owed {}) and this pod is \
                             the most above its guarantee there: evicting with {grace}s grace; held by {}",
                            unbudgeted.as_str(),
                            HumanBytes(pod_usage.total),
                            info.label,
                            HumanBytes(free),
                            HumanBytes(total),
                            HumanBytes(owed),
                            holders_summary(&pod_usage.holders, &snapshot.gpus)
                        );
                        mem.last_event_ms[Reason::Evicting.slot()] = Some(now.mono_ms);
                        out.push(Action::Event { pod: mem.pod.clone(), reason: Reason::Evicting, note: bounded(note) });
                        // `recorded`: no record is missing (none is written for a pod without a budget).
                        out.push(Action::Evict { pod: mem.pod.clone(), grace_seconds: Some(grace), recorded: true });
                        mem.eviction = Eviction::InFlight { attempts: 0, refused_since: None };
                        self.pods.insert(view.uid.clone(), mem);
                        continue;
                    };
                    let tenant_only = self.tenant_only(table, i);
                    let cx = Context {
                        view,
                        budget,
                        tenant_only,
                        usage: usage.get(i).unwrap_or(&empty),
                        gpus: &snapshot.gpus,
                    };
                    mem.pressure = Some(g);
                    let at = now.wall.round(jiff::Unit::Second).unwrap_or(now.wall).to_string();
                    mem.eviction_requested_at = Some(at);
                    mem.driver_pending = mem.driver_record.clone();
                    let driver = mem.driver_record.clone();
                    out.push(Action::Apply { pod: mem.pod.clone(), record: self.desired(&mem, &cx), driver });
                    mem.write_in_flight = true;
                    // With a request, the pod is ranked by its usage above it (the kubelet's rule for RAM).
                    let (used, most) = match cx.above_request() {
                        _ if cx.tenant_only => (
                            format!(
                                "{}; only a namespaced budget selects this pod, and tenants may write those \
                                 (namespacedBudgets=ClusterBound): under pressure it is guaranteed nothing",
                                cx.used_of()
                            ),
                            "most above its guarantee",
                        ),
                        Some(above) => (format!("{}, {above}", cx.used_of()), "most above its request"),
                        None => (cx.used_of(), "most over its budget"),
                    };
                    // Warn keeps a pod from eviction for its own limit, not from giving back a neighbour's
                    // guarantee (#52).
                    let warn = if budget.action == BudgetAction::Warn && !cx.tenant_only {
                        " (its budget's action is Warn, which does not keep memory a neighbour is guaranteed)"
                    } else {
                        ""
                    };
                    let note = format!(
                        "{used}; GPU {} is under memory pressure ({} free of {}; pods within their guarantee there are owed {}) and this pod is the {most} there{warn}: evicting with {}s grace; {}{}",
                        info.label,
                        HumanBytes(free),
                        HumanBytes(total),
                        HumanBytes(owed),
                        self.grace(&mem, &cx).unwrap_or_default(),
                        cx.held_by(),
                        budget.under_generation()
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
                            let line = match (c.request, c.limit) {
                                (_, None) => format!("no budget, unbudgetedPods={}", unbudgeted.as_str()),
                                (Some(r), Some(l)) => format!("request {}, limit {}", HumanBytes(r), HumanBytes(l)),
                                (None, Some(l)) => format!("limit {}", HumanBytes(l)),
                            };
                            format!("{} {} ({line})", c.key, HumanBytes(c.on_gpu))
                        })
                        .collect();
                    if candidates.len() > 5 {
                        pods.push(format!("and {} more", candidates.len() - 5));
                    }
                    let why = if candidates.iter().any(|c| c.request.is_some() && c.limit.is_some()) {
                        "none is above its request (or, where its budget sets none, over its limit), or those that \
                         are are critical or static; what the budgets of the pods using it guarantee adds up to more \
                         than it holds"
                    } else {
                        "none is over its budget (or those over it are critical or static); the budgets of the pods \
                         using it add up to more than it holds"
                    };
                    let note = format!(
                        "GPU {}: {} free of {} and no pod on it may be evicted for pressure: {why}: {}",
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
}
