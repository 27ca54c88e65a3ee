//! The driver's limits beside the budget (pure). From driver R615 the NVIDIA driver can hold a soft and a
//! hard GPU memory limit per cgroup and GPU (set by nvidia-container-toolkit's hook from a container's
//! `NVIDIA_GPU_MEMORY_REQUEST` / `NVIDIA_GPU_MEMORY_LIMIT`); the agent reads them back per (container cgroup,
//! GPU) pair of a pod ([`DriverView`]) and [`compare`] says how they stand against the pod's budget. The
//! cases, in the order they are checked (the first that applies is the one told), are the table in
//! docs/agent.md, "Driver limits":
//!
//! | driver | budget | [`Disagreement`] |
//! |---|---|---|
//! | nothing read (no GPU process, or every read failed) | any | none: nothing to compare |
//! | no hard limit on any pair, `NOT_SUPPORTED` on every pair | caps expected | [`Disagreement::NotSupported`] |
//! | no hard limit on any pair | caps expected | [`Disagreement::Missing`] |
//! | no hard limit on any pair | caps not expected | none: eviction only, as without the driver's limits |
//! | hard limits on some pairs only | any | [`Disagreement::PartlyCapped`] |
//! | hard limits summed above the limit | any | [`Disagreement::HardAboveLimit`] |
//! | hard limits summed below the request | request set | [`Disagreement::HardBelowRequest`] |
//! | soft limits summed ≠ the request (or none) | request set | [`Disagreement::SoftDiffers`] |
//! | otherwise (hard ≤ limit, soft = request or no request) | | none: they agree |
//!
//! Bytes are compared with a tolerance of 1 MiB per pair: the toolkit takes MiB.

use gpubudget_common::caps::Caps;
use gpubudget_common::pod_record::DriverLimitsRecord;
use gpubudget_common::quantity::HumanBytes;
use gpubudget_nvml_limits::{Reading, Unavailable};

pub use crate::attribute::driver_limits::{Applied, DriverView};
use crate::sample::GpuInfo;

use super::{Action, Enforcer, NodeReason, Reason, bounded};
use crate::attribute::pods::PodTable;

/// What the agent says on its Node, once per start, when the driver's limits cannot be read
/// ([`NodeReason::DriverLimitsUnavailable`], Normal): why, with the driver's version, and that budgets are
/// enforced by eviction only there.
pub fn unavailable(why: &Unavailable) -> Action {
    let note = format!(
        "the NVIDIA driver's per-cgroup GPU memory limits cannot be read on this node ({why}): budgets are \
         enforced by eviction only (MPS caps set in a pod's environment still apply)"
    );
    Action::NodeEvent { reason: NodeReason::DriverLimitsUnavailable, note: bounded(note) }
}

impl Enforcer {
    /// The driver's limits this tick (`views` indexed like `table.pods`; `None`: not read, or no pair): for each
    /// pod with a budget that this enforcer remembers (so after [`Enforcer::tick`]), how they stand against its
    /// budget ([`compare`]), kept for [`Enforcer::driver_disagreement`], and a `GpuMemoryDriverLimitsDisagree`
    /// warning the first time each kind of disagreement is seen for the pod (told once per pod per kind, for as
    /// long as the agent remembers the pod). Caps are expected of a pod whose `gpubudget.io/caps` record says
    /// the admission webhook set `NVIDIA_GPU_MEMORY_LIMIT` in it ([`crate::attribute::pods::PodView::caps_expected`]).
    pub fn driver_limits(&mut self, table: &PodTable, views: &[Option<DriverView>], out: &mut Vec<Action>) {
        for (i, pod) in table.pods.iter().enumerate() {
            let (Some(budget), Some(mem)) = (table.budget(i), self.pods.get_mut(&pod.uid)) else { continue };
            let view = views.get(i).copied().flatten();
            let verdict = view.and_then(|v| compare(budget.limit_bytes, budget.request_bytes, pod.caps_expected, &v));
            mem.driver = verdict;
            mem.driver_record = view.filter(|v| v.answered() > 0).map(|v| record(&v, verdict));
            let Some(d) = verdict else { continue };
            let bit = 1_u8 << d.kind();
            if mem.driver_told & bit == 0 {
                mem.driver_told |= bit;
                let note = format!("{} (budget {})", d.note(), budget.key());
                out.push(Action::Event {
                    pod: mem.pod.clone(),
                    reason: Reason::DriverLimitsDisagree,
                    note: bounded(note),
                });
            }
        }
    }

    /// How the driver's limits disagree with the pod's budget, as of the last [`Enforcer::driver_limits`].
    pub fn driver_disagreement(&self, uid: &str) -> Option<Disagreement> {
        self.pods.get(uid).and_then(|m| m.driver)
    }
}

/// What the pod's record (`gpubudget.io/driver-limits`) and `top` say of the driver's limits.
pub fn record(view: &DriverView, verdict: Option<Disagreement>) -> DriverLimitsRecord {
    DriverLimitsRecord {
        pairs: view.pairs,
        capped: view.hard_pairs,
        hard_bytes: view.hard(),
        soft_bytes: view.soft(),
        note: verdict.map(Disagreement::note),
    }
}

/// The toolkit's unit: what one pair's limit may differ by after rounding to MiB.
pub const TOLERANCE_PER_PAIR: u64 = 1 << 20;

/// How the driver's limits disagree with a pod's budget.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Disagreement {
    /// Caps are expected for the pod, and the driver says it cannot partition here (MIG, no cgroup v2).
    NotSupported,
    /// Caps are expected for the pod, and the driver holds none (the toolkit's hook did not apply them).
    Missing,
    /// Some of the pod's (container, GPU) pairs have a hard limit, others none.
    PartlyCapped {
        /// Pairs with a hard limit.
        capped: u32,
        /// Pairs answered.
        of: u32,
    },
    /// The hard limits add up to more than the budget's limit.
    HardAboveLimit {
        /// Bytes, summed.
        hard: u64,
        /// The budget's limit.
        limit: u64,
    },
    /// The hard limits add up to less than the budget's request: the pod can never use its guarantee.
    HardBelowRequest {
        /// Bytes, summed.
        hard: u64,
        /// The budget's request.
        request: u64,
    },
    /// The soft limits (summed; `None`: not on every pair) differ from the budget's request.
    SoftDiffers {
        /// Bytes, summed.
        soft: Option<u64>,
        /// The budget's request.
        request: u64,
    },
}

impl Disagreement {
    /// How many kinds there are (for "told once per pod per kind").
    pub const KINDS: usize = 6;

    /// Its kind, `0..KINDS`.
    pub fn kind(self) -> usize {
        match self {
            Self::NotSupported => 0,
            Self::Missing => 1,
            Self::PartlyCapped { .. } => 2,
            Self::HardAboveLimit { .. } => 3,
            Self::HardBelowRequest { .. } => 4,
            Self::SoftDiffers { .. } => 5,
        }
    }

    /// In words, for the record, `top` and the event.
    pub fn note(self) -> String {
        match self {
            Self::NotSupported => "the budget expects driver caps, but the driver does not partition this GPU or \
                                   cgroup (MIG, or not cgroup v2): eviction only"
                .to_owned(),
            Self::Missing => "the budget expects driver caps, but the driver holds no limit for this pod (did the \
                              container toolkit's apply-cuda-memory-limits hook run?): eviction only"
                .to_owned(),
            Self::PartlyCapped { capped, of } => format!(
                "the driver caps {capped} of the pod's {of} container/GPU pairs, the others are unbounded: \
                 eviction still enforces the budget"
            ),
            Self::HardAboveLimit { hard, limit } => format!(
                "driver allows more than the budget (hard limits {} above the limit {}): eviction still enforces \
                 the budget",
                HumanBytes(hard),
                HumanBytes(limit)
            ),
            Self::HardBelowRequest { hard, request } => format!(
                "the driver caps the pod at {}, below its request of {}: it can never use what its budget \
                 guarantees",
                HumanBytes(hard),
                HumanBytes(request)
            ),
            Self::SoftDiffers { soft, request } => format!(
                "the driver's soft limit ({}) is not the budget's request ({}): under pressure the driver and \
                 gpubudget do not rank this pod alike",
                soft.map_or_else(|| "none".to_owned(), |s| HumanBytes(s).to_string()),
                HumanBytes(request)
            ),
        }
    }
}

/// How the driver's limits `view` stand against a budget's `limit` and `request`; `caps_expected`: the pod
/// was given the toolkit's variables at admission. `None`: they agree, or there is nothing to compare.
pub fn compare(limit: u64, request: Option<u64>, caps_expected: bool, view: &DriverView) -> Option<Disagreement> {
    let answered = view.answered();
    if answered == 0 {
        return None;
    }
    if view.hard_pairs == 0 {
        return match caps_expected {
            true if view.unsupported == answered => Some(Disagreement::NotSupported),
            true => Some(Disagreement::Missing),
            false => None,
        };
    }
    let Some(hard) = view.hard() else {
        return Some(Disagreement::PartlyCapped { capped: view.hard_pairs, of: answered });
    };
    let tolerance = TOLERANCE_PER_PAIR.saturating_mul(u64::from(answered));
    if hard > limit.saturating_add(tolerance) {
        return Some(Disagreement::HardAboveLimit { hard, limit });
    }
    let request = request?;
    if hard.saturating_add(tolerance) < request {
        return Some(Disagreement::HardBelowRequest { hard, request });
    }
    let soft = view.soft();
    match soft {
        Some(s) if s.abs_diff(request) <= tolerance => None,
        _ => Some(Disagreement::SoftDiffers { soft, request }),
    }
}

/// What the agent sets on one (container cgroup, GPU) pair of a pod whose budget has caps enabled, with
/// `--apply-driver-limits` (#32): the budget's caps as the webhook would have put them in the container's
/// `NVIDIA_GPU_MEMORY_LIMIT` / `_REQUEST` (whole MiB, per container and GPU), as (soft, hard) bytes, where the
/// pair has no hard limit or a larger one. Never where the read failed or the driver does not partition the
/// pair, and never to raise a limit: a smaller one is someone's choice (an administrator's `nvidia-smi
/// memory-limits`, the toolkit's hook from a tighter budget) and stays. Without a request the soft limit already
/// there is kept when it fits under the new hard one.
pub fn to_apply(caps: Caps, reading: Option<Reading>) -> Option<(u64, u64)> {
    let hard = caps.limit_mib.saturating_mul(1 << 20);
    let request = caps.request_mib.map(|r| r.saturating_mul(1 << 20).min(hard));
    match reading? {
        Reading::NotSupported => None,
        Reading::NotSet => Some((request.unwrap_or(0), hard)),
        Reading::Set(l) => match l.hard_limit() {
            Some(h) if h <= hard => None,
            _ => Some((request.unwrap_or_else(|| l.soft_limit().filter(|s| *s <= hard).unwrap_or(0)), hard)),
        },
    }
}

impl Enforcer {
    /// Tells what `--apply-driver-limits` did this tick: `GpuMemoryDriverLimitsApplied` (Normal) for a limit set
    /// and read back, `GpuMemoryDriverLimitsNotApplied` (Warning) for one the driver refused or did not hold;
    /// each at most once per pod per cooldown.
    pub fn driver_applied(
        &mut self,
        now: super::Now,
        table: &PodTable,
        applied: &[Applied],
        gpus: &[GpuInfo],
        out: &mut Vec<Action>,
    ) {
        for a in applied {
            let (Some(view), Some(budget)) = (table.pods.get(a.pod), table.budget(a.pod)) else { continue };
            let Some(mut mem) = self.pods.remove(&view.uid) else { continue };
            let gpu = gpus.get(a.gpu).map_or_else(|| a.gpu.to_string(), |g| g.label.clone());
            let container = a.cgroup.rsplit('/').next().unwrap_or_default();
            let before = a.before.map_or_else(|| "none".to_owned(), |h| HumanBytes(h).to_string());
            let asked = match a.asked {
                (0, hard) => format!("hard {}", HumanBytes(hard)),
                (soft, hard) => format!("hard {}, soft {}", HumanBytes(hard), HumanBytes(soft)),
            };
            let (reason, note) = if a.held() {
                let note = format!(
                    "set the driver's per-cgroup limits on GPU {gpu} for {container}: {asked} (it had {before}), read \
                     back; from budget {} (caps enabled; the agent's --apply-driver-limits)",
                    budget.key()
                );
                (Reason::DriverLimitsApplied, note)
            } else {
                let why = match &a.outcome {
                    Err(e) => e.clone(),
                    Ok(r) => format!("read back {r:?}"),
                };
                let note = format!(
                    "could not set the driver's per-cgroup limits on GPU {gpu} for {container} ({asked}; it has \
                     {before}): {why}; budget {} is enforced by eviction; tried again in {}s",
                    budget.key(),
                    crate::attribute::driver_limits::DriverReader::REREAD_MS / 1000
                );
                (Reason::DriverLimitsNotApplied, note)
            };
            self.event(&mut mem, now.mono_ms, reason, note, out);
            self.pods.insert(view.uid.clone(), mem);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use gpubudget_nvml_limits::{Limits, Reading};
    use proptest::prelude::*;

    const GI: u64 = 1 << 30;
    const NONE: u64 = u64::MAX;

    fn set(soft: u64, hard: u64) -> Option<Reading> {
        Some(Reading::Set(Limits { soft, hard, used: 0 }))
    }

    fn view(readings: &[Option<Reading>]) -> DriverView {
        let mut v = DriverView::default();
        for r in readings {
            v.add(*r);
        }
        v
    }

    #[test]
    fn the_table_of_docs_agent_md() {
        use Disagreement as D;
        let not_set = Some(Reading::NotSet);
        let unsupported = Some(Reading::NotSupported);
        // Nothing read, or every read failed: nothing to say.
        assert_eq!(compare(8 * GI, None, true, &view(&[])), None);
        assert_eq!(compare(8 * GI, None, true, &view(&[None, None])), None);
        // No hard limit anywhere: told only when caps are expected.
        assert_eq!(compare(8 * GI, None, true, &view(&[unsupported, None])), Some(D::NotSupported));
        assert_eq!(compare(8 * GI, None, true, &view(&[not_set, unsupported])), Some(D::Missing));
        assert_eq!(compare(8 * GI, None, true, &view(&[set(2 * GI, NONE)])), Some(D::Missing), "soft only");
        assert_eq!(compare(8 * GI, Some(2 * GI), false, &view(&[not_set])), None, "eviction only, as before");
        // Some pairs capped, not all.
        assert_eq!(
            compare(8 * GI, None, false, &view(&[set(0, 4 * GI), not_set, None])),
            Some(D::PartlyCapped { capped: 1, of: 2 })
        );
        // Hard above the limit (two GPUs with the limit each).
        assert_eq!(
            compare(8 * GI, None, true, &view(&[set(0, 8 * GI), set(0, 8 * GI)])),
            Some(D::HardAboveLimit { hard: 16 * GI, limit: 8 * GI })
        );
        // Below the request.
        assert_eq!(
            compare(8 * GI, Some(4 * GI), true, &view(&[set(4 * GI, 3 * GI)])),
            Some(D::HardBelowRequest { hard: 3 * GI, request: 4 * GI })
        );
        // Soft differs from the request, or is missing.
        assert_eq!(
            compare(8 * GI, Some(4 * GI), true, &view(&[set(2 * GI, 8 * GI)])),
            Some(D::SoftDiffers { soft: Some(2 * GI), request: 4 * GI })
        );
        assert_eq!(
            compare(8 * GI, Some(4 * GI), true, &view(&[set(0, 8 * GI)])),
            Some(D::SoftDiffers { soft: None, request: 4 * GI })
        );
        // Agreement: hard at (or under) the limit, soft at the request, within a MiB of rounding.
        assert_eq!(compare(8 * GI, None, true, &view(&[set(0, 8 * GI)])), None);
        assert_eq!(compare(8 * GI, None, true, &view(&[set(0, 6 * GI)])), None, "a user's smaller cap is fine");
        assert_eq!(compare(8 * GI, Some(4 * GI), true, &view(&[set(4 * GI - 1000, 8 * GI + 1000)])), None);
        assert_eq!(compare(8 * GI, None, true, &view(&[set(0, 8 * GI + (1 << 20) + 1)])).map(D::kind), Some(3));
    }

    #[test]
    fn an_unavailable_driver_is_told_with_its_version_and_eviction_only() {
        let why = Unavailable::Symbol { symbol: "nvmlDeviceGetMemoryLimits_v1", driver: "580.159.04".into() };
        let Action::NodeEvent { reason, note } = unavailable(&why) else { panic!("a Node event") };
        assert_eq!(reason.as_str(), "DriverLimitsUnavailable");
        assert!(!reason.is_warning());
        assert!(note.contains("driver 580.159.04") && note.contains("eviction only"), "{note}");
    }

    #[test]
    fn notes_say_what_the_issue_asks() {
        let above = Disagreement::HardAboveLimit { hard: 12 * GI, limit: 8 * GI }.note();
        assert!(above.starts_with("driver allows more than the budget") && above.contains("eviction still"));
        assert!(above.contains("12Gi") && above.contains("8Gi"), "{above}");
        assert!(Disagreement::Missing.note().contains("eviction only"));
        let kinds: std::collections::BTreeSet<usize> = [
            Disagreement::NotSupported,
            Disagreement::Missing,
            Disagreement::PartlyCapped { capped: 1, of: 2 },
            Disagreement::HardAboveLimit { hard: 1, limit: 0 },
            Disagreement::HardBelowRequest { hard: 0, request: 1 },
            Disagreement::SoftDiffers { soft: None, request: 1 },
        ]
        .into_iter()
        .map(Disagreement::kind)
        .collect();
        assert_eq!(kinds, (0..Disagreement::KINDS).collect());
    }

    fn reading() -> impl Strategy<Value = Option<Reading>> {
        prop_oneof![
            Just(None),
            Just(Some(Reading::NotSet)),
            Just(Some(Reading::NotSupported)),
            (prop_oneof![Just(0), 0..64 * GI], prop_oneof![Just(NONE), 0..64 * GI])
                .prop_map(|(soft, hard)| Some(Reading::Set(Limits { soft, hard, used: 0 }))),
        ]
    }

    proptest! {
        /// Whatever the driver says: a verdict of "agree" means every pair is capped at no more than the limit
        /// in sum; "above the limit" is said exactly when every pair is capped and the sum exceeds it; and
        /// without expected caps, a pod the driver does not cap is never told about.
        #[test]
        fn verdicts_follow_the_sums(
            readings in proptest::collection::vec(reading(), 0..6),
            limit in 1..64 * GI,
            request_part in proptest::option::of(0u64..=100),
            expected in any::<bool>(),
        ) {
            let request = request_part.map(|p| limit / 100 * p);
            let v = view(&readings);
            let verdict = compare(limit, request, expected, &v);
            let tolerance = TOLERANCE_PER_PAIR * u64::from(v.answered());
            if verdict.is_none() && v.hard_pairs > 0 {
                let hard = v.hard();
                prop_assert!(hard.is_some_and(|h| h <= limit + tolerance), "{v:?}");
            }
            let above = matches!(verdict, Some(Disagreement::HardAboveLimit { .. }));
            prop_assert_eq!(above, v.hard().is_some_and(|h| h > limit + tolerance));
            if !expected && v.hard_pairs == 0 {
                prop_assert_eq!(verdict, None);
            }
            if v.answered() == 0 {
                prop_assert_eq!(verdict, None);
            }
        }
    }

    fn caps(limit_mib: u64, request_mib: Option<u64>) -> Caps {
        Caps { limit_mib, request_mib }
    }

    #[test]
    fn limits_are_applied_where_missing_or_larger_and_never_raised() {
        let c = caps(8192, Some(4096));
        assert_eq!(to_apply(c, Some(Reading::NotSet)), Some((4 * GI, 8 * GI)), "none: the budget's");
        assert_eq!(to_apply(c, set(0, NONE)), Some((4 * GI, 8 * GI)), "cleared: the budget's");
        assert_eq!(to_apply(c, set(GI, 16 * GI)), Some((4 * GI, 8 * GI)), "larger: lowered");
        assert_eq!(to_apply(c, set(GI, 8 * GI)), None, "the same: left");
        assert_eq!(to_apply(c, set(0, 2 * GI)), None, "smaller: someone's choice, left");
        assert_eq!(to_apply(c, Some(Reading::NotSupported)), None, "MIG, no cgroup v2");
        assert_eq!(to_apply(c, None), None, "a failed read: nothing done blind");
        // Without a request: a soft limit already there is kept if it fits, dropped if it would not.
        assert_eq!(to_apply(caps(8192, None), set(2 * GI, 16 * GI)), Some((2 * GI, 8 * GI)));
        assert_eq!(to_apply(caps(8192, None), set(12 * GI, 16 * GI)), Some((0, 8 * GI)));
        // A request above the limit (the webhook's caps never have one; defensive): soft at most hard.
        assert_eq!(to_apply(caps(8192, Some(9000)), Some(Reading::NotSet)), Some((8 * GI, 8 * GI)));
    }

    proptest! {
        /// Whatever the pair holds: a set is asked only to lower the hard limit to the budget's, with soft ≤ hard.
        #[test]
        fn never_raises_and_soft_stays_under_hard(
            limit_mib in 1_u64..1_000_000,
            request_mib in proptest::option::of(0_u64..1_000_000),
            soft in any::<u64>(),
            hard in prop_oneof![Just(u64::MAX), any::<u64>()],
        ) {
            let c = caps(limit_mib, request_mib);
            let target = limit_mib << 20;
            if let Some((s, h)) = to_apply(c, set(soft, hard)) {
                prop_assert_eq!(h, target);
                prop_assert!(hard > target, "asked only where the pair allows more");
                prop_assert!(s <= h);
            } else {
                prop_assert!(hard <= target);
            }
        }
    }
}
