//! GPU memory pressure, per GPU: the signal, whether anyone is harmed, and the choice of the pod to evict.
//! Pure: the caller gives the device's free and total bytes, the time, and the pods using the GPU; nothing here
//! reads a device or logs.
//!
//! The model is the kubelet's node-pressure eviction for RAM (`memory.available`), narrowed to where it
//! protects someone (#52):
//! - a **hard** threshold: free memory under it is pressure at once;
//! - an optional **soft** threshold: free memory under it for its grace period is pressure;
//! - a **transition period**: the signal ends only once free memory has stayed above the thresholds that
//!   long, so it does not flap;
//! - a full GPU is **relieved only where a neighbour is harmed** ([`harm`]): the pods holding memory on it that
//!   are within their guarantee (request, else limit) are still owed the rest of it, and relief happens only
//!   while what they are owed is more than is free. A pod alone on its GPU, or a framework that preallocates
//!   most of the card (vLLM, TensorFlow, JAX) beside neighbours whose guarantees still fit, is left alone:
//!   nobody is short of anything the budgets promised;
//! - while a neighbour is harmed, **one** pod at a time per GPU is evicted, the one most above its guarantee
//!   (as the kubelet ranks pods by usage above their memory request); at equal excess an `Evict` budget's pod
//!   before a `Warn` one. Only pods above their guarantee are candidates: a pod within its request (or,
//!   without one, within its limit) is the neighbour being protected and is never evicted for pressure.
//!   `action: Warn` does not exempt a pod from it: Warn is about the pod's own limit, not about memory a
//!   neighbour is guaranteed;
//! - a pod **no budget selects** is ranked by the node's [`Unbudgeted`] policy: by default
//!   ([`Unbudgeted::Ranked`]) it is guaranteed nothing, so its whole usage counts as above its guarantee and
//!   it goes before any pod within its budget (where a budgeted neighbour is harmed); with
//!   [`Unbudgeted::Never`] it is never evicted for pressure.
//!
//! The step of a tick that acts on them, [`Enforcer::pressure`](crate::decide::Enforcer::pressure), is in
//! `step.rs` beside this.

pub(in crate::decide) mod step;

/// A threshold on a GPU's free memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Threshold {
    /// Free bytes.
    Bytes(u64),
    /// Percent of the GPU's memory (0–100).
    Percent(u8),
}

impl Threshold {
    /// The threshold in bytes on a GPU of `total` bytes.
    pub fn bytes(self, total: u64) -> u64 {
        match self {
            Self::Bytes(b) => b,
            Self::Percent(p) => u64::try_from(u128::from(total) * u128::from(p.min(100)) / 100).unwrap_or(u64::MAX),
        }
    }

    /// Parses `2Gi`, `2147483648` or `5%`.
    pub fn parse(text: &str) -> Result<Self, String> {
        let text = text.trim();
        if let Some(p) = text.strip_suffix('%') {
            return match p.trim().parse::<u8>() {
                Ok(p) if p <= 100 => Ok(Self::Percent(p)),
                _ => Err(format!("{text:?}: a percentage must be a whole number from 0 to 100")),
            };
        }
        gpubudget_common::quantity::parse_bytes(text)
            .map(Self::Bytes)
            .map_err(|e| format!("{text:?}: expected bytes (2Gi, 2147483648) or a percentage (5%): {e}"))
    }
}

/// What pressure does to the pods no budget selects (a namespace without a budget, a pod relabelled out of
/// every selector): a node policy (`--unbudgeted-pods`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Unbudgeted {
    /// Ranked as guaranteed nothing: all their usage is above their guarantee, so under pressure they go before
    /// any pod within its budget (the default: it protects the budgeted neighbour). Critical and static pods
    /// are still never evicted.
    #[default]
    Ranked,
    /// Never evicted for pressure.
    Never,
}

impl Unbudgeted {
    /// The policy's name, as the flag and the chart spell it.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Ranked => "Ranked",
            Self::Never => "Never",
        }
    }
}

/// Who writes namespaced budgets (`GpuMemoryBudget`), and so what one may give its pods under GPU memory
/// pressure (#33; `--namespaced-budgets`, the chart's `budgets.tenantsWrite`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum NamespacedBudgets {
    /// Administrators only (the chart aggregates no write on them into any role): a namespaced budget's
    /// request (else its limit) is a guarantee under pressure, and its `action: Warn` keeps its pods from
    /// pressure eviction.
    #[default]
    Trusted,
    /// Tenants may write them: a tenant-written budget buys nothing under pressure. A pod's guarantee is
    /// what the rules applied give where a cluster budget selects it (those rules are no looser than any
    /// cluster budget's), and nothing where none does; `action: Warn` keeps a pod from pressure eviction
    /// only where a cluster budget selects it.
    ClusterBound,
}

impl NamespacedBudgets {
    /// The policy's name, as the flag spells it.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Trusted => "Trusted",
            Self::ClusterBound => "ClusterBound",
        }
    }
}

/// How the signal is computed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PressureSettings {
    /// Free memory under this is pressure at once. `None`: no hard threshold.
    pub hard: Option<Threshold>,
    /// Free memory under this for `soft_grace_ms` is pressure.
    pub soft: Option<Threshold>,
    /// How long the soft threshold must hold.
    pub soft_grace_ms: u64,
    /// How long free memory must stay above the thresholds before the signal ends.
    pub transition_ms: u64,
}

impl PressureSettings {
    /// Pressure eviction off.
    pub const OFF: Self = Self { hard: None, soft: None, soft_grace_ms: 0, transition_ms: 0 };

    /// Whether any threshold is set.
    pub fn enabled(&self) -> bool {
        self.hard.is_some() || self.soft.is_some()
    }

    /// The larger of the two thresholds in bytes on a GPU of `total` bytes (0: none set).
    pub fn threshold_bytes(&self, total: u64) -> u64 {
        let bytes = |t: Option<Threshold>| t.map_or(0, |t| t.bytes(total));
        bytes(self.hard).max(bytes(self.soft))
    }
}

/// Which threshold put a GPU under pressure.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Cause {
    /// The hard threshold.
    Hard,
    /// The soft threshold, held for its grace.
    Soft,
}

/// One GPU's signal between samples.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Signal {
    /// Under pressure since, and why.
    pub active: Option<(u64, Cause)>,
    /// The soft threshold has been crossed since (not yet for its grace).
    soft_since: Option<u64>,
    /// Free memory has been above the thresholds since (while active).
    clear_since: Option<u64>,
    /// The last sample was under a threshold (hard, or soft held for its grace).
    breached: bool,
}

/// What one sample did to a GPU's signal.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Change {
    /// Nothing new.
    None,
    /// Pressure began.
    Began(Cause),
    /// Pressure ended (free memory stayed above the thresholds for the transition period).
    Ended,
}

impl Signal {
    /// Whether the GPU is under pressure (the signal, transition period included).
    pub fn active(&self) -> bool {
        self.active.is_some()
    }

    /// Whether the last sample was under a threshold: evictions are decided only then, not while the signal
    /// merely waits out its transition period (as the kubelet evicts only while a threshold is met).
    pub fn breached(&self) -> bool {
        self.breached
    }

    /// Takes one sample of the GPU: `free` of `total` bytes at `now_ms` (monotonic).
    pub fn observe(&mut self, settings: &PressureSettings, free: u64, total: u64, now_ms: u64) -> Change {
        let under = |t: Option<Threshold>| t.is_some_and(|t| free < t.bytes(total));
        let hard = under(settings.hard);
        let soft = under(settings.soft);
        if soft {
            self.soft_since.get_or_insert(now_ms);
        } else {
            self.soft_since = None;
        }
        let soft_held = self.soft_since.is_some_and(|since| now_ms.saturating_sub(since) >= settings.soft_grace_ms);
        let cause = if hard {
            Some(Cause::Hard)
        } else if soft_held {
            Some(Cause::Soft)
        } else {
            None
        };
        self.breached = cause.is_some();
        match (self.active, cause) {
            (None, Some(cause)) => {
                self.active = Some((now_ms, cause));
                self.clear_since = None;
                Change::Began(cause)
            }
            (Some(_), Some(_)) => {
                self.clear_since = None;
                Change::None
            }
            (Some(_), None) => {
                // Above the hard threshold and not held under the soft one: ends after the transition
                // period, counted from the first sample above.
                if soft {
                    self.clear_since = None;
                    return Change::None;
                }
                let since = *self.clear_since.get_or_insert(now_ms);
                if now_ms.saturating_sub(since) >= settings.transition_ms {
                    *self = Self::default();
                    Change::Ended
                } else {
                    Change::None
                }
            }
            (None, None) => Change::None,
        }
    }
}

/// A pod using a GPU under pressure, as the choice needs it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Candidate {
    /// `namespace/name`: the last tie-break, so the choice does not depend on input order.
    pub key: String,
    /// The pod's usage over all its GPUs (what its budget counts).
    pub usage: u64,
    /// Its budget's limit; `None` for a pod no budget selects (ranked by the [`Unbudgeted`] policy).
    pub limit: Option<u64>,
    /// Its budget's request (at most the limit); `None`: the budget sets none, the limit is the line.
    pub request: Option<u64>,
    /// Its bytes on this GPU (what evicting it frees here).
    pub on_gpu: u64,
    /// May be evicted at all: not critical, not static, not already terminating (a budget's `action` does not
    /// matter here: `Warn` only ranks it after an `Evict` pod at equal excess).
    pub evictable: bool,
    /// Its budget's action is `Warn`: at equal bytes above the guarantee, chosen after a pod whose budget evicts.
    pub warn: bool,
}

impl Candidate {
    /// What the pod is guaranteed: its request, else its limit; without a budget, nothing under
    /// [`Unbudgeted::Ranked`], and `None` (never a candidate) under [`Unbudgeted::Never`].
    pub fn guaranteed(&self, unbudgeted: Unbudgeted) -> Option<u64> {
        match self.limit {
            Some(limit) => Some(self.request.map_or(limit, |request| request.min(limit))),
            None if unbudgeted == Unbudgeted::Ranked => Some(0),
            None => None,
        }
    }

    /// Bytes above what the pod is guaranteed (its request, else its limit; without a budget, all of its usage
    /// under [`Unbudgeted::Ranked`]); 0 within it, or without a budget under [`Unbudgeted::Never`].
    pub fn over(&self, unbudgeted: Unbudgeted) -> u64 {
        self.guaranteed(unbudgeted).map_or(0, |line| self.usage.saturating_sub(line))
    }

    /// Bytes the pod is guaranteed and does not hold: its guarantee minus its usage, 0 at or above it (and
    /// for a pod no budget selects, which is guaranteed nothing).
    pub fn owed(&self, unbudgeted: Unbudgeted) -> u64 {
        self.guaranteed(unbudgeted).map_or(0, |line| line.saturating_sub(self.usage))
    }
}

/// Whether a GPU under pressure harms anyone ([`harm`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Harm {
    /// One pod holds all the memory pods hold on it (a framework that preallocates, alone): relieving it would
    /// protect no one.
    Alone,
    /// Several pods hold memory on it, and what those within their guarantee are still owed (`owed` bytes)
    /// fits in what is free, with [`CLAIM_SLACK`] to spare: nobody is short of what the budgets promised.
    Fits {
        /// Bytes the pods within their guarantee may still claim.
        owed: u64,
    },
    /// The pods within their guarantee are owed more than is free (less [`CLAIM_SLACK`]): the neighbour the
    /// budgets protect is short.
    Short {
        /// Bytes they may still claim (more than is free).
        owed: u64,
    },
}

impl Harm {
    /// Whether pressure relief may evict a pod on this GPU.
    pub fn relieves(self) -> bool {
        matches!(self, Self::Short { .. })
    }
}

/// The room a pod needs beyond the bytes it is owed to claim them: a CUDA context for a process that starts
/// (about 0.5 GiB on an H100) and the caching allocator's rounding. On the H100 a neighbour 2 GiB short of its
/// guarantee met CUDA OOM with 2.47 GiB free (docs/agent.md, Pressure).
pub const CLAIM_SLACK: u64 = 1 << 30;

/// Whether pressure on a GPU with `free` bytes harms the pods holding memory on it (`candidates`, each with its
/// bytes here): [`Harm::Short`] when the pods within their guarantee (request, else limit; a pod no budget selects
/// is guaranteed nothing) are owed something, and it does not fit in what is free with [`CLAIM_SLACK`] to
/// spare; [`Harm::Alone`] when one pod holds memory here.
pub fn harm(candidates: &[Candidate], free: u64, unbudgeted: Unbudgeted) -> Harm {
    let mut holders = candidates.iter().filter(|c| c.on_gpu > 0);
    if holders.clone().nth(1).is_none() {
        return Harm::Alone;
    }
    let owed = holders.try_fold(0u64, |sum, c| sum.checked_add(c.owed(unbudgeted))).unwrap_or(u64::MAX);
    if owed > 0 && owed.saturating_add(CLAIM_SLACK) > free { Harm::Short { owed } } else { Harm::Fits { owed } }
}

/// The pod to evict for pressure on one GPU: among the evictable pods above their guarantee (request, else
/// limit; a pod no budget selects is guaranteed nothing under [`Unbudgeted::Ranked`] and is never a candidate
/// under [`Unbudgeted::Never`]) that hold memory on it, the one most above it; ties: more bytes on this GPU,
/// then a pod whose budget evicts before a `Warn` one, then more bytes on this GPU, then the key that sorts first
/// (a budgeted pod and an unbudgeted one are ranked alike: the bytes above the guarantee decide, not whether
/// there is a budget). `None` when no pod qualifies: the guarantees on this GPU add up to more than it holds,
/// or the memory is held by pods that may not be evicted. Whether anyone needs the relief is [`harm`]'s call.
pub fn choose(candidates: &[Candidate], unbudgeted: Unbudgeted) -> Option<usize> {
    let over = |c: &Candidate| c.over(unbudgeted);
    candidates
        .iter()
        .enumerate()
        .filter(|(_, c)| c.evictable && over(c) > 0 && c.on_gpu > 0)
        .max_by(|(_, a), (_, b)| {
            over(a)
                .cmp(&over(b))
                .then(b.warn.cmp(&a.warn))
                .then(a.on_gpu.cmp(&b.on_gpu))
                .then_with(|| b.key.cmp(&a.key))
        })
        .map(|(i, _)| i)
}

/// How long a pod's refused pressure evictions are remembered after its GPU last harmed a neighbour: pressure
/// that comes and goes within this window adds up towards the node's bound (#52).
pub(in crate::decide) const REFUSAL_WINDOW_MS: u64 = 10 * 60 * 1000;

/// A pod's pressure evictions were refused (a PodDisruptionBudget): how long its GPU has harmed a neighbour
/// since, in all, so the node's bound ends the stall however often the pressure comes and goes (a neighbour
/// that meets CUDA OOM, frees and restarts). Kept until the pod is back within its guarantee, or its GPU has
/// harmed no one for [`REFUSAL_WINDOW_MS`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(in crate::decide) struct Refused {
    /// The GPU it was refused on.
    pub(in crate::decide) gpu: usize,
    /// First refused at (monotonic ms).
    pub(in crate::decide) first_ms: u64,
    /// How long that GPU has harmed a neighbour since, in all (monotonic ms).
    pub(in crate::decide) pressed_ms: u64,
    /// When it last did (monotonic ms).
    pub(in crate::decide) last_pressed_ms: u64,
}

impl Refused {
    /// First refused on `gpu` at `first_ms`, seen at `now_ms`.
    pub(in crate::decide) fn new(gpu: usize, first_ms: u64, now_ms: u64) -> Self {
        Self { gpu, first_ms, pressed_ms: 0, last_pressed_ms: now_ms }
    }

    /// `old` if it is for `gpu`, else a first refusal there.
    pub(in crate::decide) fn on(old: Option<Self>, gpu: usize, first_ms: u64, now_ms: u64) -> Self {
        old.filter(|r| r.gpu == gpu).unwrap_or_else(|| Self::new(gpu, first_ms, now_ms))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const GI: u64 = 1 << 30;
    const TOTAL: u64 = 80 * GI;
    /// The rule before the node policy: pods no budget selects are never evicted for pressure.
    const NEVER: Unbudgeted = Unbudgeted::Never;
    const RANKED: Unbudgeted = Unbudgeted::Ranked;

    fn settings() -> PressureSettings {
        PressureSettings {
            hard: Some(Threshold::Bytes(2 * GI)),
            soft: Some(Threshold::Percent(10)),
            soft_grace_ms: 5_000,
            transition_ms: 10_000,
        }
    }

    #[test]
    fn thresholds_parse_and_scale() {
        assert_eq!(Threshold::parse("2Gi"), Ok(Threshold::Bytes(2 * GI)));
        assert_eq!(Threshold::parse("5%"), Ok(Threshold::Percent(5)));
        assert_eq!(Threshold::Percent(5).bytes(TOTAL), 4 * GI);
        assert!(Threshold::parse("101%").unwrap_err().contains("0 to 100"));
        assert!(Threshold::parse("lots").unwrap_err().contains("expected bytes"));
    }

    #[test]
    fn hard_acts_at_once_soft_after_its_grace_and_the_end_waits_out_the_transition() {
        let s = settings();
        let mut g = Signal::default();
        assert_eq!(g.observe(&s, 20 * GI, TOTAL, 0), Change::None);
        // Under the soft threshold (8Gi): not yet.
        assert_eq!(g.observe(&s, 7 * GI, TOTAL, 1_000), Change::None);
        assert_eq!(g.observe(&s, 7 * GI, TOTAL, 5_999), Change::None);
        assert_eq!(g.observe(&s, 7 * GI, TOTAL, 6_000), Change::Began(Cause::Soft));
        // Back above: still under pressure for the transition period.
        assert_eq!(g.observe(&s, 20 * GI, TOTAL, 7_000), Change::None);
        assert!(g.active());
        // A dip under the soft threshold restarts the transition.
        assert_eq!(g.observe(&s, 7 * GI, TOTAL, 12_000), Change::None);
        assert_eq!(g.observe(&s, 20 * GI, TOTAL, 13_000), Change::None);
        assert_eq!(g.observe(&s, 20 * GI, TOTAL, 22_999), Change::None);
        assert_eq!(g.observe(&s, 20 * GI, TOTAL, 23_000), Change::Ended);
        // Under the hard threshold (2Gi): at once.
        assert_eq!(g.observe(&s, GI, TOTAL, 24_000), Change::Began(Cause::Hard));
    }

    #[test]
    fn off_never_signals() {
        let mut g = Signal::default();
        assert_eq!(g.observe(&PressureSettings::OFF, 0, TOTAL, 0), Change::None);
        assert!(!g.active());
    }

    fn candidate(key: &str, usage: u64, limit: Option<u64>, on_gpu: u64, evictable: bool) -> Candidate {
        Candidate { key: key.into(), usage, limit, request: None, on_gpu, evictable, warn: false }
    }

    #[test]
    fn the_most_over_pod_is_chosen_and_pods_within_or_protected_never_are() {
        let pods = [
            candidate("a/within", 30 * GI, Some(40 * GI), 30 * GI, true),
            candidate("a/little-over", 9 * GI, Some(8 * GI), 9 * GI, true),
            candidate("a/most-over", 20 * GI, Some(8 * GI), 20 * GI, true),
            candidate("a/no-budget", 40 * GI, None, 40 * GI, true),
            candidate("kube-system/critical", 60 * GI, Some(GI), 60 * GI, false),
        ];
        assert_eq!(choose(&pods, NEVER), Some(2));
        assert_eq!(choose(&pods[..2], NEVER), Some(1));
        assert_eq!(choose(&[pods[0].clone(), pods[3].clone(), pods[4].clone()], NEVER), None);
    }

    fn with_request(mut c: Candidate, request: u64) -> Candidate {
        c.request = Some(request);
        c
    }

    #[test]
    fn with_a_request_pods_are_ranked_by_usage_above_it_and_never_chosen_within_it() {
        let pods = [
            // 16Gi, within its 40Gi limit but 12Gi above its 4Gi request: the most above.
            with_request(candidate("a/burst", 16 * GI, Some(40 * GI), 16 * GI, true), 4 * GI),
            // Within its 30Gi request, however much it holds on this GPU.
            with_request(candidate("a/steady", 30 * GI, Some(40 * GI), 30 * GI, true), 30 * GI),
            // No request: over its 8Gi limit by 10Gi.
            candidate("a/no-request", 18 * GI, Some(8 * GI), 18 * GI, true),
            // A request of 0: all its usage is above it.
            with_request(candidate("a/best-effort", 5 * GI, Some(8 * GI), 5 * GI, true), 0),
        ];
        assert_eq!(choose(&pods, NEVER), Some(0));
        assert_eq!((pods[0].over(NEVER), pods[1].over(NEVER), pods[3].over(NEVER)), (12 * GI, 0, 5 * GI));
        assert_eq!(choose(&pods[1..], NEVER), Some(1), "10Gi over the limit beats 5Gi above a request of 0");
        assert_eq!(choose(&pods[1..2], NEVER), None, "within its request: never");
        // A request above the limit (refused by the CRD and the spec reader) is read as the limit.
        assert_eq!(with_request(candidate("a/x", 9 * GI, Some(8 * GI), GI, true), 20 * GI).over(NEVER), GI);
    }

    /// The key of the pod chosen among `pods` rotated left by `rotate` (the choice must not depend on order).
    fn chosen_after_rotating(pods: &[Candidate], rotate: usize, unbudgeted: Unbudgeted) -> Option<String> {
        let mut rotated = pods.to_vec();
        if !rotated.is_empty() {
            let k = rotate % rotated.len();
            rotated.rotate_left(k);
        }
        choose(&rotated, unbudgeted).map(|i| rotated[i].key.clone())
    }

    /// The rule before requests: the most over its limit among evictable pods holding memory here.
    fn old_choose(candidates: &[Candidate]) -> Option<usize> {
        let over = |c: &Candidate| c.limit.map_or(0, |l| c.usage.saturating_sub(l));
        candidates
            .iter()
            .enumerate()
            .filter(|(_, c)| c.evictable && over(c) > 0 && c.on_gpu > 0)
            .max_by(|(_, a), (_, b)| {
                over(a).cmp(&over(b)).then(a.on_gpu.cmp(&b.on_gpu)).then_with(|| b.key.cmp(&a.key))
            })
            .map(|(i, _)| i)
    }

    #[test]
    fn under_ranked_a_pod_no_budget_selects_is_guaranteed_nothing_and_goes_before_any_pod_within_its_budget() {
        let pods = [
            // Within its 40Gi limit: the neighbour being protected.
            candidate("a/within", 30 * GI, Some(40 * GI), 30 * GI, true),
            // Within its 4Gi request, however much it holds.
            with_request(candidate("a/steady", 4 * GI, Some(40 * GI), 4 * GI, true), 4 * GI),
            // No budget selects it: 40Gi, all of it above its (nothing) guarantee.
            candidate("free/filler", 40 * GI, None, 40 * GI, true),
            // Critical, no budget: never.
            candidate("kube-system/critical", 60 * GI, None, 60 * GI, false),
        ];
        assert_eq!(pods[2].guaranteed(RANKED), Some(0));
        assert_eq!((pods[2].over(RANKED), pods[2].over(NEVER)), (40 * GI, 0));
        assert_eq!(choose(&pods, RANKED), Some(2));
        assert_eq!(choose(&pods, NEVER), None, "under Never it is never chosen: the budgets alone decide");
        assert_eq!(choose(&[pods[0].clone(), pods[1].clone(), pods[3].clone()], RANKED), None);
        // Ranked alike with budgeted pods: a pod 50Gi over its limit goes before a 40Gi unbudgeted one …
        let over = candidate("a/way-over", 58 * GI, Some(8 * GI), 10 * GI, true);
        assert_eq!(choose(&[pods[2].clone(), over.clone()], RANKED), Some(1));
        // … and on equal bytes above the guarantee, more bytes on this GPU, then the key that sorts first.
        let tie = candidate("a/tie", 48 * GI, Some(8 * GI), 40 * GI, true);
        assert_eq!(choose(&[pods[2].clone(), tie.clone()], RANKED), Some(1), "a/tie sorts before free/filler");
        let smaller_here = candidate("a/tie", 48 * GI, Some(8 * GI), 39 * GI, true);
        assert_eq!(choose(&[pods[2].clone(), smaller_here], RANKED), Some(0));
    }

    /// Up to 12 pods: usage, a budget or none (a limit, and a request or none), bytes on this GPU, evictable.
    fn pods_with_requests() -> impl Strategy<Value = Vec<Candidate>> {
        let pod = (0u64..64, proptest::option::of((1u64..64, proptest::option::of(0u64..64))), 0u64..8, any::<bool>());
        proptest::collection::vec(pod, 0..12).prop_map(|pods| {
            pods.iter()
                .enumerate()
                .map(|(i, (u, budget, g, e))| {
                    let c = candidate(&format!("ns/p{i}"), u * GI, budget.map(|(l, _)| l * GI), g * GI, *e);
                    // A request at most the limit, as the CRD's rule and the spec reader allow.
                    match budget {
                        Some((l, Some(r))) => with_request(c, (*r).min(*l) * GI),
                        _ => c,
                    }
                })
                .collect()
        })
    }

    #[test]
    fn a_pod_alone_is_never_harmed_whatever_it_holds() {
        // vLLM at 0.95 of the card, no budget, Ranked: alone on its GPU, with 4Gi free.
        let alone = [candidate("serve/vllm", 76 * GI, None, 76 * GI, true)];
        assert_eq!(harm(&alone, 4 * GI, RANKED), Harm::Alone);
        // A budgeted pod far over its limit, alone: nobody to protect either.
        let over = [candidate("a/grower", 79 * GI, Some(8 * GI), 79 * GI, true)];
        assert_eq!(harm(&over, GI / 2, RANKED), Harm::Alone);
        // Pods listed without memory on this GPU are not neighbours here.
        let idle = candidate("a/idle", 0, Some(40 * GI), 0, true);
        assert_eq!(harm(&[alone[0].clone(), idle], GI, RANKED), Harm::Alone);
        assert_eq!(harm(&[], 0, RANKED), Harm::Alone);
    }

    #[test]
    fn a_neighbour_is_harmed_only_when_what_it_is_owed_no_longer_fits_in_what_is_free() {
        // A preallocator (no budget) at 70Gi beside a pod within its 6Gi limit at 5Gi: owed 1Gi, 3Gi free.
        let pre = candidate("serve/tf", 70 * GI, None, 70 * GI, true);
        let small = candidate("a/small", 5 * GI, Some(6 * GI), 5 * GI, true);
        assert_eq!(harm(&[pre.clone(), small.clone()], 3 * GI, RANKED), Harm::Fits { owed: GI });
        // Owed 1Gi with 2Gi free is still room, but not with less than the claim slack to spare.
        assert_eq!(harm(&[pre.clone(), small.clone()], 2 * GI, RANKED), Harm::Fits { owed: GI });
        assert_eq!(harm(&[pre.clone(), small.clone()], 2 * GI - 1, RANKED), Harm::Short { owed: GI });
        // Owed nothing: never harmed, however little is free.
        let full = candidate("a/small", 6 * GI, Some(6 * GI), 6 * GI, true);
        assert_eq!(harm(&[pre.clone(), full], 0, RANKED), Harm::Fits { owed: 0 });
        // The same neighbour with a 20Gi limit: owed 15Gi, more than the 3Gi free.
        let short = candidate("a/small", 5 * GI, Some(20 * GI), 5 * GI, true);
        assert_eq!(harm(&[pre.clone(), short.clone()], 3 * GI, RANKED), Harm::Short { owed: 15 * GI });
        assert_eq!(choose(&[pre.clone(), short], RANKED), Some(0));
        // With a request, the request is what is owed: 1Gi request, 5Gi held: owed nothing.
        let request = with_request(candidate("a/small", 5 * GI, Some(20 * GI), 5 * GI, true), GI);
        assert_eq!(harm(&[pre.clone(), request], 0, RANKED), Harm::Fits { owed: 0 });
        // Two pods no budget selects: neither is guaranteed anything, so neither is harmed.
        let other = candidate("serve/jax", 8 * GI, None, 8 * GI, true);
        assert_eq!(harm(&[pre, other], 0, RANKED), Harm::Fits { owed: 0 });
    }

    #[test]
    fn warn_does_not_exempt_but_ranks_after_evict_at_equal_excess() {
        let mut warn = candidate("a/warn", 50 * GI, Some(10 * GI), 50 * GI, true);
        warn.warn = true;
        let within = with_request(candidate("a/serve", 28 * GI, Some(30 * GI), 28 * GI, true), 30 * GI);
        // The case: a Warn grower at 50Gi beside a pod within its 30Gi request, 2Gi free.
        assert!(harm(&[warn.clone(), within.clone()], 2 * GI, RANKED).relieves());
        assert_eq!(choose(&[warn.clone(), within.clone()], RANKED), Some(0));
        // At equal excess (40Gi each) the Evict pod goes first, whatever the order and the bytes here.
        let evict = candidate("z/evict", 48 * GI, Some(8 * GI), 40 * GI, true);
        assert_eq!(
            chosen_after_rotating(&[warn.clone(), evict.clone(), within.clone()], 0, RANKED).as_deref(),
            Some("z/evict")
        );
        assert_eq!(chosen_after_rotating(&[warn.clone(), evict, within], 1, RANKED).as_deref(), Some("z/evict"));
        // More above its guarantee: the Warn pod goes first.
        let less = candidate("z/evict", 20 * GI, Some(8 * GI), 20 * GI, true);
        assert_eq!(choose(&[less, warn], RANKED), Some(1));
    }

    /// Up to 12 pods as [`pods_with_requests`], each with a `Warn` budget or not.
    fn pods_with_actions() -> impl Strategy<Value = Vec<Candidate>> {
        (pods_with_requests(), proptest::collection::vec(any::<bool>(), 12)).prop_map(|(mut pods, warn)| {
            for (p, w) in pods.iter_mut().zip(warn) {
                p.warn = w && p.limit.is_some();
            }
            pods
        })
    }

    proptest! {
        /// Under `Ranked`: a pod within its guarantee is never chosen, whenever an evictable unbudgeted pod holds
        /// memory here something is chosen, the chosen pod is the most above its guarantee (an unbudgeted pod's
        /// whole usage), and the order of the pods does not matter. Under `Never` no unbudgeted pod is chosen.
        #[test]
        fn unbudgeted_rules(pods in pods_with_requests(), rotate in 0usize..12) {
            let ranked = choose(&pods, RANKED);
            if let Some(i) = ranked {
                let c = &pods[i];
                prop_assert!(c.evictable && c.on_gpu > 0);
                prop_assert!(c.limit.is_none() || c.usage > c.request.unwrap_or(c.limit.unwrap_or(0)));
                let best = pods.iter().filter(|p| p.evictable && p.over(RANKED) > 0 && p.on_gpu > 0)
                    .map(|p| p.over(RANKED)).max();
                prop_assert_eq!(Some(c.over(RANKED)), best);
            }
            if pods.iter().any(|p| p.limit.is_none() && p.evictable && p.usage > 0 && p.on_gpu > 0) {
                prop_assert!(ranked.is_some(), "an evictable unbudgeted pod holds memory here: one is chosen");
            }
            prop_assert_eq!(chosen_after_rotating(&pods, rotate, RANKED), ranked.map(|i| pods[i].key.clone()));
            if let Some(i) = choose(&pods, NEVER) {
                prop_assert!(pods[i].limit.is_some(), "under Never an unbudgeted pod is never chosen");
            }
            // Budgeted pods alone: the policy changes nothing.
            let budgeted: Vec<Candidate> = pods.iter().filter(|p| p.limit.is_some()).cloned().collect();
            prop_assert_eq!(choose(&budgeted, RANKED), choose(&budgeted, NEVER));
        }

        /// Harm: nobody is harmed where one pod holds the memory; otherwise harmed exactly when what the pods
        /// within their guarantee are owed exceeds what is free; and when relief is due, the pod chosen is never
        /// one that is owed anything (so someone else is), Warn pods are candidates, and a Warn pod is chosen
        /// only where no evictable `Evict` pod is as far above its guarantee.
        #[test]
        fn harm_rules(pods in pods_with_actions(), free in 0u64..16, rotate in 0usize..12) {
            let free = free * GI;
            let holders: Vec<&Candidate> = pods.iter().filter(|p| p.on_gpu > 0).collect();
            let owed: u64 = holders.iter().map(|p| p.owed(RANKED)).sum();
            let h = harm(&pods, free, RANKED);
            match holders.len() {
                0 | 1 => prop_assert_eq!(h, Harm::Alone),
                _ if owed > 0 && owed + CLAIM_SLACK > free => prop_assert_eq!(h, Harm::Short { owed }),
                _ => prop_assert_eq!(h, Harm::Fits { owed }),
            }
            let chosen = choose(&pods, RANKED);
            prop_assert_eq!(chosen_after_rotating(&pods, rotate, RANKED), chosen.map(|i| pods[i].key.clone()));
            if let (true, Some(i)) = (h.relieves(), chosen) {
                let c = &pods[i];
                prop_assert_eq!(c.owed(RANKED), 0);
                prop_assert!(pods.iter().any(|p| p.key != c.key && p.on_gpu > 0 && p.owed(RANKED) > 0));
                if c.warn {
                    prop_assert!(!pods.iter().any(|p| !p.warn && p.evictable && p.on_gpu > 0 && p.over(RANKED) >= c.over(RANKED)));
                }
            }
            // A Warn pod above its guarantee is as much a candidate as any.
            if pods.iter().any(|p| p.evictable && p.on_gpu > 0 && p.over(RANKED) > 0) {
                prop_assert!(chosen.is_some());
            }
        }

        /// With requests: the chosen pod is above its request, no pod within its request is ever chosen,
        /// the chosen one is the most above its guarantee, and the order of the pods does not matter.
        #[test]
        fn request_rules(pods in pods_with_requests(), rotate in 0usize..12) {
            let chosen = choose(&pods, NEVER);
            if let Some(i) = chosen {
                let c = &pods[i];
                prop_assert!(c.evictable && c.on_gpu > 0);
                prop_assert!(c.request.is_none_or(|r| c.usage > r), "chosen within its request: {c:?}");
                prop_assert!(c.limit.is_some_and(|l| c.usage > c.request.unwrap_or(l)));
                let best = pods.iter().filter(|p| p.evictable && p.over(NEVER) > 0 && p.on_gpu > 0).map(|p| p.over(NEVER)).max();
                prop_assert_eq!(Some(c.over(NEVER)), best);
            }
            for p in &pods {
                if p.request.is_some_and(|r| p.usage <= r) {
                    prop_assert!(chosen.is_none_or(|i| pods[i].key != p.key));
                }
            }
            prop_assert_eq!(chosen_after_rotating(&pods, rotate, NEVER), chosen.map(|i| pods[i].key.clone()));
        }

        /// With no request set, the choice is exactly the rule before requests.
        #[test]
        fn without_requests_the_choice_is_the_old_rule(pods in proptest::collection::vec(
            (0u64..64, proptest::option::of(0u64..64), 0u64..8, any::<bool>()), 0..12)) {
            let pods: Vec<Candidate> = pods.iter().enumerate()
                .map(|(i, (u, l, g, e))| candidate(&format!("ns/p{i}"), u * GI, l.map(|l| l * GI), g * GI, *e))
                .collect();
            prop_assert_eq!(choose(&pods, NEVER), old_choose(&pods));
        }

        /// Never a pod within its budget, without one, or protected; always one of the most over; the answer
        /// does not depend on the order of the pods.
        #[test]
        fn choice_rules(pods in proptest::collection::vec(
            (0u64..64, proptest::option::of(0u64..64), 0u64..8, any::<bool>()), 0..12), rotate in 0usize..12) {
            let pods: Vec<Candidate> = pods.iter().enumerate()
                .map(|(i, (u, l, g, e))| candidate(&format!("ns/p{i}"), u * GI, l.map(|l| l * GI), g * GI, *e))
                .collect();
            let chosen = choose(&pods, NEVER);
            if let Some(i) = chosen {
                let c = &pods[i];
                prop_assert!(c.evictable && c.limit.is_some() && c.usage > c.limit.unwrap_or(u64::MAX) && c.on_gpu > 0);
                let best = pods.iter().filter(|p| p.evictable && p.over(NEVER) > 0 && p.on_gpu > 0).map(|p| p.over(NEVER)).max();
                prop_assert_eq!(Some(c.over(NEVER)), best);
            } else {
                prop_assert!(!pods.iter().any(|p| p.evictable && p.over(NEVER) > 0 && p.on_gpu > 0));
            }
            prop_assert_eq!(chosen_after_rotating(&pods, rotate, NEVER), chosen.map(|i| pods[i].key.clone()));
        }

        /// The signal is on whenever free memory is under the hard threshold, and never ends sooner than the
        /// transition period after the last sample under a threshold.
        #[test]
        fn signal_rules(frees in proptest::collection::vec(0u64..80, 1..60)) {
            let s = settings();
            let mut g = Signal::default();
            let mut last_under: Option<u64> = None;
            for (i, free) in frees.iter().enumerate() {
                let now = i as u64 * 250;
                let change = g.observe(&s, free * GI, TOTAL, now);
                if free * GI < 2 * GI {
                    prop_assert!(g.active());
                }
                if free * GI < 8 * GI {
                    last_under = Some(now);
                }
                if change == Change::Ended {
                    let last = last_under.expect("it began under a threshold");
                    prop_assert!(now - last >= s.transition_ms);
                }
            }
        }
    }
}
