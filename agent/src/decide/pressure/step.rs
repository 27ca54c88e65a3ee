//! The pressure step of a tick ([`Enforcer::pressure`]): each GPU's [`Signal`](super::Signal), Node events when
//! it begins and ends, and while it lasts the choice ([`choose`](super::choose)) of one pod to evict per GPU,
//! carried out through the pod's eviction lifecycle ([`crate::decide::pod`]).

use gpubudget_common::BudgetAction;
use gpubudget_common::quantity::HumanBytes;

use super::{Candidate, Cause, Change, Signal, Unbudgeted, choose};
use crate::attribute::PodUsage;
use crate::attribute::pods::PodTable;
use crate::decide::notes::{bounded, holders_summary, seconds};
use crate::decide::pod::{Context, Eviction};
use crate::decide::{Action, Enforcer, NodeReason, Now, Reason, cadence};
use crate::sample::Snapshot;

/// One GPU's memory pressure between ticks.
#[derive(Debug, Clone, Default)]
pub(in crate::decide) struct GpuPressure {
    pub(in crate::decide) signal: Signal,
    /// The "budgets add up to more than the GPU" event was sent for this episode.
    pub(in crate::decide) told_overcommitted: bool,
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

impl Enforcer {
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
                    let note = format!(
                        "GPU {}: {} free of {}, under the {name} threshold ({}); evicting pods over their budgets on it{unbudgeted}, the most over first, one at a time",
                        info.label,
                        HumanBytes(free),
                        HumanBytes(total),
                        HumanBytes(threshold)
                    );
                    out.push(Action::NodeEvent { reason: NodeReason::Pressure, note });
                }
                Change::Ended => {
                    gpu.told_overcommitted = false;
                    for m in self.pods.values_mut() {
                        if m.pressure_refused.is_some_and(|(on, _)| on == g) {
                            m.pressure_refused = None;
                        }
                    }
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
                // Only a tenant-written budget selects it (`--namespaced-budgets ClusterBound`): guaranteed
                // nothing, and its `Warn` does not keep it (#33).
                let tenant_only = self.tenant_only(table, i);
                // A pod no budget selects is evictable only as the node policy says (`--unbudgeted-pods`).
                let evictable = budget
                    .map_or(unbudgeted == Unbudgeted::Ranked, |b| b.action == BudgetAction::Evict || tenant_only)
                    && view.never_evicted(&self.settings.critical_namespaces).is_none()
                    && !view.terminating
                    && view.node.as_deref() == Some(self.settings.node.as_str())
                    // Not one whose eviction is under way; one whose eviction by its budget was refused (a
                    // PodDisruptionBudget) is a candidate like any other, so the node's bound ends its stall.
                    && self.pods.get(&view.uid).is_some_and(|m| matches!(m.eviction, Eviction::Idle | Eviction::Blocked { .. }));
                on_this_gpu.push(i);
                candidates.push(Candidate {
                    key: format!("{}/{}", view.namespace, view.name),
                    usage: usage.get(i).unwrap_or(&empty).total,
                    limit: budget.map(|b| b.limit_bytes),
                    request: if tenant_only { Some(0) } else { budget.and_then(|b| b.request_bytes) },
                    on_gpu: bytes,
                    evictable,
                });
            }
            match choose(&candidates, unbudgeted) {
                Some(c) => {
                    let i = on_this_gpu[c];
                    let (view, budget) = (&table.pods[i], table.budget(i));
                    let Some(mut mem) = self.pods.remove(&view.uid) else { continue };
                    // Its eviction by its budget was refused: the stall under pressure counts from now (the
                    // pressure eviction below is refused in its turn and keeps this first time).
                    if let Eviction::Blocked { .. } = mem.eviction {
                        mem.pressure_refused =
                            mem.pressure_refused.filter(|(on, _)| *on == g).or(Some((g, now.mono_ms)));
                        mem.eviction = Eviction::Idle;
                    }
                    // Refused (a PodDisruptionBudget) for the bound: deleted with its grace, as the kubelet's
                    // node-pressure eviction does ([`pressure_bound_ms`]).
                    let (timeout_ms, whose) = pressure_bound_ms(self.settings.pressure_blocked_timeout_ms, budget);
                    if let Some((_, since)) = mem
                        .pressure_refused
                        .filter(|(on, since)| *on == g && now.mono_ms.saturating_sub(*since) >= timeout_ms)
                    {
                        let grace = self.pressure_grace(budget);
                        let pod_usage = usage.get(i).unwrap_or(&empty);
                        let note = format!(
                            "evictions for GPU memory pressure on GPU {} refused for {}s ({whose}: {}s): deleting \
                             the pod with {grace}s grace, as the kubelet's node-pressure eviction does; using {}; \
                             held by {}",
                            info.label,
                            seconds(now.mono_ms.saturating_sub(since)),
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
                             pressure ({} free of {}) and this pod is the most above its guarantee there: evicting \
                             with {grace}s grace; held by {}",
                            unbudgeted.as_str(),
                            HumanBytes(pod_usage.total),
                            info.label,
                            HumanBytes(free),
                            HumanBytes(total),
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
                    let note = format!(
                        "{used}; GPU {} is under memory pressure ({} free of {}) and this pod is the {most} there: evicting with {}s grace; {}{}",
                        info.label,
                        HumanBytes(free),
                        HumanBytes(total),
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
                         are are critical, static or Warn; what the budgets of the pods using it guarantee adds up \
                         to more than it holds"
                    } else {
                        "none is over its budget (or those over it are critical, static or Warn); the budgets of the \
                         pods using it add up to more than it holds"
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
