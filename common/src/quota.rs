//! Namespace totals (`ClusterGpuMemoryQuota`): what one namespace's selected pods hold together across all
//! nodes, and which pod goes when the total stays over the limit. Pure: the operator (the one place that
//! sees every node's records) feeds it the pods, what it remembered (kept in the quota's status, so a new
//! leader carries on) and the time, and does what comes out.
//!
//! The rules:
//!
//! - **Total**: the usage every selected pod's record reports, pods already going (terminating) included,
//!   since they hold their memory until they exit.
//! - **Period**: the total goes through the same state machine as one pod's usage ([`crate::state::step`]):
//!   `Near` at `warnAtPercent`, `Over` above the limit, and due (`Evicting`) once over for
//!   `overLimitSeconds` banked, dips taking back half. The bank lives in the status: a change of leader
//!   neither restarts the period nor skips it.
//! - **Who goes**: the pod that took the namespace over, read as the most recently started pod (largest start
//!   time; ties broken by name, the last in alphabetical order), among those that hold GPU memory, are not
//!   terminating, are not being evicted by their agent (record `Evicting`), and are neither critical nor
//!   static (the agent's exemptions).
//! - **One at a time, no double eviction**: nothing is picked while an eviction this quota asked for is under
//!   way (it is retried while refused, and the pod deleted after `blockedEvictionTimeoutSeconds` when set),
//!   nor while the pods already going (terminating, or evicted by their agent) would bring the namespace
//!   back within the limit once gone.
//! - **Never under the limit**: an eviction is asked for (or retried) only while the total is over the limit
//!   and due; a refused eviction whose namespace falls back within the limit is dropped.
//! - **Observe** (the quota's `enforcement`, else the operator's; [`crate::enforcement::for_quota`]): nothing is
//!   evicted. The state stays `Over`; when the eviction would be due, the pod it would evict is told once per
//!   episode (`NamespaceGpuMemoryWouldEvict`) and kept in what is remembered ([`Withheld`]) until the total
//!   falls back; a refused eviction asked for before the switch is dropped. Switched to `Enforce`, the next
//!   pass evicts if still due.

use crate::budget::{Budget, Scope, SpecError};
use crate::crd::ClusterGpuMemoryQuota;
use crate::enforcement::Mode;
use crate::selector::Selector;
use crate::state::{BudgetState, Tracker, step};

/// Event reason: a namespace reached `warnAtPercent` of its quota.
pub const REASON_NEAR: &str = "NamespaceGpuMemoryNear";
/// Event reason: a namespace went over its quota.
pub const REASON_OVER: &str = "NamespaceGpuMemoryOver";
/// Event reason: the quota asks for a pod's eviction (on the pod and the quota).
pub const REASON_EVICTING: &str = "NamespaceGpuMemoryEvicting";
/// Event reason: the eviction was refused (a PodDisruptionBudget, most often); retried.
pub const REASON_BLOCKED: &str = "NamespaceGpuMemoryEvictionBlocked";
/// Event reason: refused for `blockedEvictionTimeoutSeconds`: the pod is deleted instead.
pub const REASON_DELETING: &str = "NamespaceGpuMemoryDeleting";
/// Event reason: the evicted pod is gone.
pub const REASON_EVICTED: &str = "NamespaceGpuMemoryEvicted";
/// Event reason: a refused eviction is dropped, the namespace being back within its quota.
pub const REASON_CANCELLED: &str = "NamespaceGpuMemoryEvictionCancelled";
/// Event reason: the eviction is due but no pod may be evicted (all exempt or already going).
pub const REASON_NO_CANDIDATE: &str = "NamespaceGpuMemoryNoCandidate";
/// Event reason: observe mode, the eviction is due and not carried out (on the pod and the quota).
pub const REASON_WOULD_EVICT: &str = "NamespaceGpuMemoryWouldEvict";

/// Validates a quota into a [`Budget`] ([`Scope::Cluster`], no request, no caps): one place checks the
/// fields a quota shares with a budget, and computes its thresholds and grace.
pub fn compile(resource: &ClusterGpuMemoryQuota) -> Result<Budget, SpecError> {
    let name = resource.metadata.name.as_deref().ok_or(SpecError::UnnamedQuota)?;
    let namespaces = Selector::compile(&resource.spec.namespace_selector).map_err(SpecError::NamespaceSelector)?;
    Ok(Budget { scope: Scope::Cluster { namespaces }, ..Budget::from_spec("", name, &resource.spec.as_budget_spec())? })
}

/// Why a pod is never evicted for a namespace total (as the agent exempts it from its budget).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Exempt {
    /// `system-node-critical`, `system-cluster-critical` or an equivalent priority.
    Critical,
    /// A static pod's mirror: evicting it would delete only the mirror.
    Static,
}

/// One selected pod of the namespace, as the operator knows it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct QuotaPod {
    /// Name.
    pub name: String,
    /// UID.
    pub uid: String,
    /// The node its record came from.
    pub node: Option<String>,
    /// When it started (milliseconds since the epoch): `status.startTime`, else its creation.
    pub started_ms: u64,
    /// Bytes its record says it holds.
    pub usage_bytes: u64,
    /// Its record's state against its own budget; `Evicting`: its agent is evicting it.
    pub state: BudgetState,
    /// It is being deleted (an accepted eviction, or a delete).
    pub terminating: bool,
    /// Never evicted for a total, and why.
    pub exempt: Option<Exempt>,
}

impl QuotaPod {
    /// Its agent is evicting it for its own budget (its record says `Evicting`).
    pub fn agent_evicting(&self) -> bool {
        self.state == BudgetState::Evicting
    }

    /// Going already: terminating, or being evicted by its agent.
    pub fn going(&self) -> bool {
        self.terminating || self.agent_evicting()
    }
}

/// An eviction this quota asked for, seen through until the pod is gone.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Pending {
    /// Pod name.
    pub pod: String,
    /// Pod UID.
    pub uid: String,
    /// Its node.
    pub node: Option<String>,
    /// When the eviction was first asked for (ms since the epoch).
    pub requested_at_ms: u64,
    /// Bytes it held then.
    pub usage_bytes: u64,
    /// The API server accepted it (the pod was seen terminating).
    pub accepted: bool,
}

/// Observe mode: an eviction that is due and withheld, told once when it became due.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Withheld {
    /// The pod it would evict now; `None`: none may go (critical, static, or already going).
    pub pod: Option<String>,
    /// When it became due (ms since the epoch).
    pub since_ms: u64,
}

/// What the quota remembers of one namespace between decisions (kept in its status).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Remembered {
    /// The state machine's memory: state, time over banked, last sample.
    pub tracker: Tracker,
    /// The eviction under way.
    pub pending: Option<Pending>,
    /// Observe mode: the eviction due and withheld.
    pub withheld: Option<Withheld>,
}

/// What the operator must do now.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Act {
    /// Ask the Eviction API to evict the pending pod (first time or a retry).
    Evict,
    /// Delete the pending pod with the grace period: evictions were refused for `blockedEvictionTimeoutSeconds`.
    Delete,
}

/// An event to publish.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Notice {
    /// Stable reason.
    pub reason: &'static str,
    /// `Warning` rather than `Normal`.
    pub warning: bool,
    /// The pod it is also about, if any (the event goes on the pod and on the quota).
    pub pod: Option<String>,
    /// What happened, in words.
    pub note: String,
}

/// The decision for one namespace at one time.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Decision {
    /// Bytes the selected pods hold together.
    pub total: u64,
    /// What to remember (the status's part for this namespace).
    pub next: Remembered,
    /// What to do to `next.pending`'s pod.
    pub act: Option<Act>,
    /// An eviction that completed (its pod is gone): count it.
    pub evicted: Option<Pending>,
    /// Events to publish.
    pub notices: Vec<Notice>,
}

/// The pod the quota would evict now: see the module's rules. `None` when no pod may go.
pub fn pick(pods: &[QuotaPod]) -> Option<&QuotaPod> {
    pods.iter()
        .filter(|p| !p.going() && p.exempt.is_none() && p.usage_bytes > 0)
        .max_by(|a, b| a.started_ms.cmp(&b.started_ms).then_with(|| a.name.cmp(&b.name)))
}

fn human(bytes: u64) -> String {
    crate::quantity::HumanBytes(bytes).to_string()
}

/// Decides for one namespace: `quota` compiled by [`compile`], its mode (observe or enforce, and who said), the
/// namespace's selected pods, what was remembered, and the time (ms since the epoch, a wall clock: it is
/// compared with times kept in the status by other replicas).
pub fn decide(
    quota: &Budget,
    mode: &Mode,
    namespace: &str,
    pods: &[QuotaPod],
    prev: &Remembered,
    now_ms: u64,
) -> Decision {
    let total: u64 = pods.iter().map(|p| p.usage_bytes).fold(0, u64::saturating_add);
    let mut th = quota.thresholds(false);
    let observing = mode.observes();
    // Observe: the state machine never says `Evicting`; whether the eviction would be due is read by its rule.
    let may_evict = th.may_evict;
    th.may_evict &= !observing;
    let tracker = step(prev.tracker, &th, now_ms, total);
    let would_be_due = observing && may_evict && th.due(total, tracker.over_ms);
    let limit = &quota.limit_text;
    let mut notices = Vec::new();
    let was = prev.tracker.state;
    if tracker.state.is_over() && !was.is_over() {
        notices.push(Notice {
            reason: REASON_OVER,
            warning: true,
            pod: None,
            note: format!(
                "namespace {namespace} holds {} of GPU memory, over its quota of {limit}; pods are evicted after {}s over",
                human(total),
                quota.over_limit_seconds
            ),
        });
    } else if tracker.state == BudgetState::Near && was == BudgetState::Within {
        notices.push(Notice {
            reason: REASON_NEAR,
            warning: true,
            pod: None,
            note: format!(
                "namespace {namespace} holds {} of GPU memory, {}% or more of its quota of {limit}",
                human(total),
                quota.warn_at_percent
            ),
        });
    }
    let due = tracker.state == BudgetState::Evicting;
    let mut evicted = None;
    let mut pending = None;
    let mut act = None;
    if let Some(p) = &prev.pending {
        match pods.iter().find(|pod| pod.uid == p.uid) {
            None => {
                notices.push(Notice {
                    reason: REASON_EVICTED,
                    warning: false,
                    pod: None,
                    note: format!("pod {namespace}/{} evicted for the namespace's GPU memory quota is gone", p.pod),
                });
                evicted = Some(p.clone());
            }
            Some(pod) if pod.terminating => pending = Some(Pending { accepted: true, ..p.clone() }),
            Some(_) if observing => notices.push(Notice {
                reason: REASON_CANCELLED,
                warning: false,
                pod: Some(p.pod.clone()),
                note: format!(
                    "observe mode ({}): the refused eviction of {} is dropped; nothing is evicted",
                    mode.set_by, p.pod
                ),
            }),
            Some(_) if !due => notices.push(Notice {
                reason: REASON_CANCELLED,
                warning: false,
                pod: Some(p.pod.clone()),
                note: format!(
                    "namespace {namespace} is back to {} (quota {limit}): the refused eviction of {} is dropped",
                    human(total),
                    p.pod
                ),
            }),
            Some(_) => {
                let blocked_for = now_ms.saturating_sub(p.requested_at_ms);
                let delete =
                    quota.blocked_eviction_timeout_seconds.is_some_and(|s| blocked_for >= s.saturating_mul(1000));
                act = Some(if delete { Act::Delete } else { Act::Evict });
                if delete {
                    notices.push(Notice {
                        reason: REASON_DELETING,
                        warning: true,
                        pod: Some(p.pod.clone()),
                        note: format!(
                            "evictions of {} refused for {}s (blockedEvictionTimeoutSeconds): deleting it",
                            p.pod,
                            blocked_for / 1000
                        ),
                    });
                }
                pending = Some(p.clone());
            }
        }
    }
    // Pods already going free their memory once gone: pick only if the namespace stays over without them.
    let stays_over =
        || pods.iter().filter(|p| !p.going()).map(|p| p.usage_bytes).fold(0, u64::saturating_add) > quota.limit_bytes;
    if pending.is_none() && due && stays_over() {
        match pick(pods) {
            Some(pod) => {
                notices.push(Notice {
                    reason: REASON_EVICTING,
                    warning: true,
                    pod: Some(pod.name.clone()),
                    note: format!(
                        "namespace {namespace} holds {} of GPU memory, over its quota of {limit} for {}s: evicting \
                         {} ({}, the most recently started)",
                        human(total),
                        quota.over_limit_seconds,
                        pod.name,
                        human(pod.usage_bytes)
                    ),
                });
                pending = Some(Pending {
                    pod: pod.name.clone(),
                    uid: pod.uid.clone(),
                    node: pod.node.clone(),
                    requested_at_ms: now_ms,
                    usage_bytes: pod.usage_bytes,
                    accepted: false,
                });
                act = Some(Act::Evict);
            }
            None if was != BudgetState::Evicting => notices.push(Notice {
                reason: REASON_NO_CANDIDATE,
                warning: true,
                pod: None,
                note: format!(
                    "namespace {namespace} holds {} of GPU memory, over its quota of {limit}, but no pod may be \
                     evicted (critical, static, or already going)",
                    human(total)
                ),
            }),
            None => {}
        }
    }
    let mut withheld = None;
    if pending.is_none() && would_be_due && stays_over() {
        let candidate = pick(pods);
        let since_ms = prev.withheld.as_ref().map_or(now_ms, |w| w.since_ms);
        // Told once per episode: when it becomes due (the status remembers it across leaders).
        if prev.withheld.is_none() {
            notices.push(would_evict_notice(quota, mode, namespace, total, candidate));
        }
        withheld = Some(Withheld { pod: candidate.map(|p| p.name.clone()), since_ms });
    }
    Decision { total, next: Remembered { tracker, pending, withheld }, act, evicted, notices }
}

/// The notice of an eviction observe mode withholds: the pod it would evict, or that none may go.
fn would_evict_notice(quota: &Budget, mode: &Mode, namespace: &str, total: u64, pod: Option<&QuotaPod>) -> Notice {
    let limit = &quota.limit_text;
    match pod {
        Some(pod) => Notice {
            reason: REASON_WOULD_EVICT,
            warning: true,
            pod: Some(pod.name.clone()),
            note: format!(
                "namespace {namespace} holds {} of GPU memory, over its quota of {limit} for {}s: would evict {} ({}, \
                 the most recently started); observe mode ({}): nothing is evicted",
                human(total),
                quota.over_limit_seconds,
                pod.name,
                human(pod.usage_bytes),
                mode.set_by
            ),
        },
        None => Notice {
            reason: REASON_NO_CANDIDATE,
            warning: true,
            pod: None,
            note: format!(
                "namespace {namespace} holds {} of GPU memory, over its quota of {limit}, but no pod may be evicted \
                 (critical, static, or already going); observe mode ({}): nothing would be evicted",
                human(total),
                mode.set_by
            ),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::crd::ClusterGpuMemoryQuotaSpec;
    use crate::enforcement::{Enforcement, for_quota};
    use proptest::prelude::*;

    const GI: u64 = 1 << 30;

    fn enforce() -> Mode {
        for_quota(Enforcement::Enforce, None, "team-total")
    }

    fn observe() -> Mode {
        for_quota(Enforcement::Observe, None, "team-total")
    }

    fn quota(limit: &str, extra: serde_json::Value) -> Budget {
        let mut spec = serde_json::json!({"limit": limit, "overLimitSeconds": 10});
        if let (Some(spec), Some(extra)) = (spec.as_object_mut(), extra.as_object()) {
            spec.extend(extra.clone());
        }
        let spec: ClusterGpuMemoryQuotaSpec = serde_json::from_value(spec).expect("spec");
        compile(&ClusterGpuMemoryQuota::new("team-total", spec)).expect("valid")
    }

    fn pod(name: &str, started_s: u64, usage_gi: u64) -> QuotaPod {
        QuotaPod {
            name: name.into(),
            uid: format!("uid-{name}"),
            node: Some(format!("node-{}", started_s % 3)),
            started_ms: started_s * 1000,
            usage_bytes: usage_gi * GI,
            state: BudgetState::Within,
            terminating: false,
            exempt: None,
        }
    }

    /// Runs decisions every second from `from` to `to` (inclusive), enforcing, returning the last.
    fn run(q: &Budget, pods: &[QuotaPod], mem: Remembered, from: u64, to: u64) -> (Remembered, Vec<Decision>) {
        run_as(q, &enforce(), pods, mem, from, to)
    }

    /// Runs decisions every second from `from` to `to` (inclusive) in `mode`, returning the last.
    fn run_as(
        q: &Budget,
        mode: &Mode,
        pods: &[QuotaPod],
        mut mem: Remembered,
        from: u64,
        to: u64,
    ) -> (Remembered, Vec<Decision>) {
        let mut out = Vec::new();
        for t in from..=to {
            let d = decide(q, mode, "team-a", pods, &mem, t * 1000);
            mem = d.next.clone();
            out.push(d);
        }
        (mem, out)
    }

    #[test]
    fn many_small_pods_take_a_namespace_over_and_the_latest_goes_after_the_period() {
        let q = quota("10Gi", serde_json::json!({}));
        // Six 2Gi pods on three nodes: 12Gi, over 10Gi. p5 started last.
        let pods: Vec<QuotaPod> = (0..6).map(|i| pod(&format!("p{i}"), 100 + i, 2)).collect();
        let (mem, decisions) = run(&q, &pods, Remembered::default(), 1000, 1010);
        assert!(decisions[..10].iter().all(|d| d.act.is_none()), "nothing before 10 s over");
        assert_eq!(decisions[0].notices[0].reason, REASON_OVER);
        let last = &decisions[10];
        assert_eq!(last.total, 12 * GI);
        assert_eq!(last.act, Some(Act::Evict));
        let pending = mem.pending.clone().expect("pending");
        assert_eq!((pending.pod.as_str(), pending.requested_at_ms), ("p5", 1_010_000));
        assert!(last.notices.iter().any(|n| n.reason == REASON_EVICTING && n.pod.as_deref() == Some("p5")));

        // Refused (still running): retried, never a second pod.
        let d = decide(&q, &enforce(), "team-a", &pods, &mem, 1_011_000);
        assert_eq!((d.act, d.next.pending.as_ref().map(|p| p.pod.as_str())), (Some(Act::Evict), Some("p5")));
        // Accepted: p5 terminating, nothing more asked.
        let mut going = pods.clone();
        going[5].terminating = true;
        let d = decide(&q, &enforce(), "team-a", &going, &d.next, 1_012_000);
        assert_eq!(d.act, None);
        assert!(d.next.pending.as_ref().is_some_and(|p| p.accepted));
        // Gone: counted once, 10Gi is not over, nothing more.
        let d = decide(&q, &enforce(), "team-a", &pods[..5], &d.next, 1_013_000);
        assert_eq!(d.evicted.as_ref().map(|p| p.pod.as_str()), Some("p5"));
        assert_eq!((d.total, d.act.clone(), d.next.pending.clone()), (10 * GI, None, None));
        let d = decide(&q, &enforce(), "team-a", &pods[..5], &d.next, 1_014_000);
        assert_eq!((d.act, d.evicted), (None, None));
    }

    #[test]
    fn ties_go_to_the_name_last_in_alphabetical_order_and_exempt_or_going_pods_are_skipped() {
        let mut pods = vec![pod("a", 5, 4), pod("c", 5, 4), pod("b", 5, 4), pod("old", 1, 4)];
        assert_eq!(pick(&pods).map(|p| p.name.as_str()), Some("c"));
        pods[1].state = BudgetState::Evicting;
        assert_eq!(pick(&pods).map(|p| p.name.as_str()), Some("b"));
        pods[2].exempt = Some(Exempt::Critical);
        pods[0].terminating = true;
        assert_eq!(pick(&pods).map(|p| p.name.as_str()), Some("old"));
        pods[3].exempt = Some(Exempt::Static);
        assert_eq!(pick(&pods), None);
    }

    #[test]
    fn a_pod_its_agent_evicts_is_left_to_it_while_its_going_would_do() {
        let q = quota("10Gi", serde_json::json!({"overLimitSeconds": 0}));
        // 12Gi; the agent evicts the 4Gi pod: 8Gi stay, within 10Gi. No eviction by the quota.
        let mut pods = vec![pod("a", 1, 4), pod("b", 2, 4), pod("c", 3, 4)];
        pods[2].state = BudgetState::Evicting;
        let d = decide(&q, &enforce(), "team-a", &pods, &Remembered::default(), 1000);
        assert_eq!(d.next.tracker.state, BudgetState::Evicting);
        assert_eq!((d.act, d.next.pending), (None, None));
        // 16Gi with the agent's 4Gi going: 12Gi stay, still over: b (latest not going) goes.
        pods.push(pod("d", 0, 4));
        let d = decide(&q, &enforce(), "team-a", &pods, &Remembered::default(), 1000);
        assert_eq!(d.next.pending.map(|p| p.pod), Some("b".into()));
    }

    #[test]
    fn a_blocked_eviction_is_retried_then_the_pod_deleted_and_dropped_when_back_under() {
        let q = quota("10Gi", serde_json::json!({"overLimitSeconds": 0, "blockedEvictionTimeoutSeconds": 30}));
        let pods = vec![pod("a", 1, 6), pod("b", 2, 6)];
        let d = decide(&q, &enforce(), "team-a", &pods, &Remembered::default(), 0);
        assert_eq!(d.act, Some(Act::Evict));
        let d29 = decide(&q, &enforce(), "team-a", &pods, &d.next, 29_000);
        assert_eq!(d29.act, Some(Act::Evict));
        let d30 = decide(&q, &enforce(), "team-a", &pods, &d29.next, 30_000);
        assert_eq!(d30.act, Some(Act::Delete));
        assert!(d30.notices.iter().any(|n| n.reason == REASON_DELETING));
        // a shrinks to 2Gi while b's eviction is refused: 8Gi, within; the eviction is dropped.
        let shrunk = vec![pod("a", 1, 2), pod("b", 2, 6)];
        let d = decide(&q, &enforce(), "team-a", &shrunk, &d29.next, 31_000);
        assert_eq!((d.act, d.next.pending), (None, None));
        assert!(d.notices.iter().any(|n| n.reason == REASON_CANCELLED));
    }

    #[test]
    fn warn_never_evicts_and_the_period_survives_in_what_is_remembered() {
        let q = quota("10Gi", serde_json::json!({"action": "Warn", "overLimitSeconds": 0}));
        let d = decide(&q, &enforce(), "team-a", &[pod("a", 1, 12)], &Remembered::default(), 0);
        assert_eq!((d.act, d.next.tracker.state), (None, BudgetState::Over));
        // A new leader reading the remembered state 6 s into a 10 s period acts 4 s later, not 10.
        let q = quota("10Gi", serde_json::json!({}));
        let pods = [pod("a", 1, 12)];
        let (mem, _) = run(&q, &pods, Remembered::default(), 0, 6);
        assert_eq!(mem.tracker.over_ms, 6000);
        let (_, decisions) = run(&q, &pods, mem, 7, 10);
        assert_eq!(decisions.iter().map(|d| d.act.is_some()).collect::<Vec<_>>(), [false, false, false, true]);
    }

    #[test]
    fn observe_tells_the_pod_it_would_evict_once_per_episode_and_evicts_nothing() {
        let q = quota("10Gi", serde_json::json!({}));
        let pods: Vec<QuotaPod> = (0..6).map(|i| pod(&format!("p{i}"), 10 + i, 2)).collect();
        let mut mem = Remembered::default();
        let mut told = Vec::new();
        for t in 0..=40u64 {
            let d = decide(&q, &observe(), "team-a", &pods, &mem, t * 1000);
            assert_eq!((&d.act, &d.next.pending), (&None, &None), "nothing is evicted at {t}s");
            assert_ne!(d.next.tracker.state, BudgetState::Evicting, "the state stays Over");
            told.extend(d.notices.iter().filter(|n| n.reason == REASON_WOULD_EVICT).map(|n| (t, n.clone())));
            mem = d.next;
        }
        assert_eq!(told.len(), 1, "once per episode: {told:?}");
        let (at, notice) = &told[0];
        assert_eq!((*at, notice.pod.as_deref()), (10, Some("p5")), "due after overLimitSeconds, the latest pod");
        assert!(
            notice.note.contains("would evict p5") && notice.note.contains("nothing is evicted"),
            "{}",
            notice.note
        );
        assert!(notice.note.contains("the operator's default, --enforcement"), "says who set it: {}", notice.note);
        assert_eq!(mem.withheld, Some(Withheld { pod: Some("p5".into()), since_ms: 10_000 }));
        // Back within the limit: the episode ends; over again, told again.
        let d = decide(&q, &observe(), "team-a", &pods[..5], &mem, 41_000);
        assert_eq!(d.next.withheld, None);
        let (mem, decisions) = run_as(&q, &observe(), &pods, d.next, 42, 80);
        assert_eq!(decisions.iter().flat_map(|d| &d.notices).filter(|n| n.reason == REASON_WOULD_EVICT).count(), 1);
        // Switched to Enforce with the period banked: the next pass evicts.
        let d = decide(&q, &enforce(), "team-a", &pods, &mem, 81_000);
        assert_eq!((d.act, d.next.pending.map(|p| p.pod)), (Some(Act::Evict), Some("p5".into())));
    }

    #[test]
    fn observe_drops_a_refused_eviction_asked_for_before_the_switch_and_tells_when_none_may_go() {
        let q = quota("10Gi", serde_json::json!({}));
        let pods: Vec<QuotaPod> = (0..6).map(|i| pod(&format!("p{i}"), 10 + i, 2)).collect();
        let (mem, _) = run(&q, &pods, Remembered::default(), 0, 10);
        assert!(mem.pending.is_some(), "enforcing: p5's eviction asked for");
        let d = decide(&q, &observe(), "team-a", &pods, &mem, 11_000);
        assert_eq!((d.act, d.next.pending), (None, None));
        let dropped = d.notices.iter().find(|n| n.reason == REASON_CANCELLED).expect("told");
        assert!(dropped.note.contains("observe mode") && dropped.note.contains("p5"), "{}", dropped.note);
        let exempt: Vec<QuotaPod> =
            pods.iter().cloned().map(|p| QuotaPod { exempt: Some(Exempt::Critical), ..p }).collect();
        let (_, decisions) = run_as(&q, &observe(), &exempt, Remembered::default(), 0, 30);
        let none: Vec<&Notice> =
            decisions.iter().flat_map(|d| &d.notices).filter(|n| n.reason == REASON_NO_CANDIDATE).collect();
        assert_eq!(none.len(), 1, "once: {none:?}");
        assert!(none[0].note.contains("nothing would be evicted"), "{}", none[0].note);
    }

    #[test]
    fn compile_checks_the_shared_fields() {
        let spec: ClusterGpuMemoryQuotaSpec =
            serde_json::from_value(serde_json::json!({"limit": "0", "namespaceSelector": {}})).expect("spec");
        assert_eq!(compile(&ClusterGpuMemoryQuota::new("q", spec.clone())), Err(SpecError::ZeroLimit));
        let mut unnamed = ClusterGpuMemoryQuota::new("q", spec);
        unnamed.metadata.name = None;
        assert_eq!(compile(&unnamed), Err(SpecError::UnnamedQuota));
        assert!(quota("64Gi", serde_json::json!({})).selector.is_everything());
    }

    fn arb_pod() -> impl Strategy<Value = QuotaPod> {
        (0u64..20, 0u64..8, any::<bool>(), any::<bool>(), 0u8..6).prop_map(|(start, usage, agent, term, ex)| {
            let mut p = pod(&format!("p{start}-{usage}"), start, usage);
            if agent && ex % 2 == 0 {
                p.state = BudgetState::Evicting;
            }
            p.terminating = term && ex % 3 == 0;
            p.exempt = match ex {
                4 => Some(Exempt::Critical),
                5 => Some(Exempt::Static),
                _ => None,
            };
            p
        })
    }

    proptest! {
        /// Over sequences of changing pod sets: an eviction is asked for only while over the limit and due,
        /// of a pod that may go (never one its agent evicts, terminating, critical or static), the latest
        /// started of those, at most one per namespace at a time, and the total without it is smaller.
        #[test]
        fn evictions_are_justified_single_and_of_the_latest_pod(
            steps in proptest::collection::vec((proptest::collection::vec(arb_pod(), 0..8), 0u64..4000), 1..40),
            over_s in 0i64..5,
            blocked in proptest::option::of(0i64..5),
        ) {
            let mut extra = serde_json::json!({"overLimitSeconds": over_s});
            if let Some(b) = blocked { extra["blockedEvictionTimeoutSeconds"] = b.into(); }
            let q = quota("10Gi", extra);
            let mut mem = Remembered::default();
            let mut now = 0u64;
            for (mut pods, dt) in steps {
                now += dt;
                let mut seen = std::collections::HashSet::new();
                pods.retain(|p| seen.insert(p.uid.clone()));
                // Keep the pending pod in the set half the time, as the API server would until it goes.
                if let Some(p) = &mem.pending && dt % 2 == 0 && !pods.iter().any(|x| x.uid == p.uid) {
                    let mut kept = pod(&p.pod, p.requested_at_ms / 1000, p.usage_bytes / GI);
                    kept.uid = p.uid.clone();
                    pods.push(kept);
                }
                let d = decide(&q, &enforce(), "team-a", &pods, &mem, now);
                prop_assert_eq!(d.total, pods.iter().map(|p| p.usage_bytes).sum::<u64>());
                if let Some(act) = &d.act {
                    prop_assert!(d.total > q.limit_bytes, "{:?} under the limit", act);
                    prop_assert_eq!(d.next.tracker.state, BudgetState::Evicting);
                    let target = d.next.pending.as_ref().expect("an act has a pending pod");
                    let p = pods.iter().find(|p| p.uid == target.uid).expect("the target exists");
                    prop_assert!(!p.terminating);
                    let fresh = mem.pending.as_ref().is_none_or(|old| old.uid != target.uid);
                    if fresh {
                        prop_assert!(mem.pending.is_none() || d.evicted.is_some(), "one at a time");
                        prop_assert!(!p.agent_evicting() && p.exempt.is_none() && p.usage_bytes > 0);
                        let latest = pods.iter().filter(|x| !x.going() && x.exempt.is_none() && x.usage_bytes > 0)
                            .map(|x| (x.started_ms, x.name.clone())).max();
                        prop_assert_eq!(latest, Some((p.started_ms, p.name.clone())));
                        prop_assert!(d.total - p.usage_bytes < d.total);
                        let staying: u64 = pods.iter().filter(|x| !x.going()).map(|x| x.usage_bytes).sum();
                        prop_assert!(staying > q.limit_bytes);
                    }
                }
                if let (Some(old), Some(new)) = (&mem.pending, &d.next.pending)
                    && pods.iter().any(|p| p.uid == old.uid)
                {
                    prop_assert_eq!(&old.uid, &new.uid, "a pending eviction is never replaced while its pod is there");
                }
                mem = d.next;
            }
        }

        /// `Warn` never acts, whatever the pods.
        /// Observe never evicts, and tells the pod it would evict exactly when enforcing would first have
        /// evicted it (the same period, the same pod): what an administrator watches is what switching does.
        #[test]
        fn observe_tells_what_enforcing_would_first_do_and_nothing_more(
            steps in proptest::collection::vec((proptest::collection::vec(arb_pod(), 0..8), 0u64..4000), 1..40),
            over_s in 0i64..5,
        ) {
            let q = quota("10Gi", serde_json::json!({"overLimitSeconds": over_s}));
            let (mut seen, mut watched) = (Remembered::default(), Remembered::default());
            let mut now = 0u64;
            for (mut pods, dt) in steps {
                now += dt;
                let mut uids = std::collections::HashSet::new();
                pods.retain(|p| uids.insert(p.uid.clone()));
                let e = decide(&q, &enforce(), "team-a", &pods, &seen, now);
                let o = decide(&q, &observe(), "team-a", &pods, &watched, now);
                prop_assert!(o.act.is_none() && o.next.pending.is_none());
                prop_assert_ne!(o.next.tracker.state, BudgetState::Evicting);
                prop_assert_eq!(o.next.tracker.over_ms, e.next.tracker.over_ms, "the same period");
                let told = o.notices.iter().find(|n| n.reason == REASON_WOULD_EVICT);
                prop_assert!(told.is_none() || watched.withheld.is_none(), "once per episode");
                if e.act.is_some() {
                    // Enforcing's first eviction: observing tells it now, or told it already this episode.
                    let target = e.next.pending.as_ref().map(|p| p.pod.clone());
                    prop_assert!(o.next.withheld.is_some());
                    if watched.withheld.is_none() {
                        prop_assert_eq!(told.and_then(|n| n.pod.clone()), target);
                    }
                    break;
                }
                seen = e.next;
                watched = o.next;
            }
        }

        #[test]
        fn warn_never_acts(pods in proptest::collection::vec(arb_pod(), 0..8), t in 0u64..100_000) {
            let q = quota("1Gi", serde_json::json!({"action": "Warn", "overLimitSeconds": 0}));
            let d = decide(&q, &enforce(), "team-a", &pods, &Remembered::default(), t);
            prop_assert_eq!((d.act, d.next.pending), (None, None));
        }
    }
}
