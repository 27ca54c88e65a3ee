//! How soon the next sample is taken: the agent's [`Pace`].
//!
//! Where nothing is close to a threshold the agent samples every [`Cadence::relaxed_ms`] (the
//! `--interval`, 250 ms by default); while something is, every [`Cadence::fast_ms`] (`--interval-near`,
//! 20 ms by default), so a crossing near a threshold is decided within tens of milliseconds instead of a
//! quarter of a second. Close means ([`Urgency`]):
//! - a budgeted pod at or above its warning threshold (Near, or Over: also so that its return under the
//!   limit is seen as soon), or one whose usage, at the rate it moved since the last sample, reaches the
//!   warning threshold within [`Cadence::horizon_ms`];
//! - a GPU whose free memory is under twice its pressure threshold (the larger of hard and soft), or, at the
//!   rate it fell since the last sample, reaches the threshold within the horizon.
//!
//! The fast pace holds for [`Cadence::hold_ms`] after the last such sign, so one quiet sample does not
//! relax it. Its cost is bounded: the fast interval is never shorter than [`Cadence::duty`] times the
//! ticks' own recent cost (a smoothed tick time), so ticks that list many moving processes cannot take more
//! than 1/`duty` of a core (1/20 by default), whatever the interval asked; it is never longer than the
//! relaxed one.
//!
//! Only the spacing of samples changes: every timer of the decisions (overLimitSeconds, grace periods, soft
//! pressure grace, backoffs) runs on the monotonic clock given per tick, in milliseconds, not on tick counts.
//! No I/O here.

use gpubudget_common::BudgetState;

/// The pace's tunables.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Cadence {
    /// Between samples while nothing is close to a threshold.
    pub relaxed_ms: u64,
    /// Between samples while something is (equal to `relaxed_ms`: a fixed interval).
    pub fast_ms: u64,
    /// How far ahead a level is projected at the rate it moved since the last sample.
    pub horizon_ms: u64,
    /// How long the fast pace outlasts its last sign.
    pub hold_ms: u64,
    /// The fast interval is at least this many times the ticks' smoothed cost (20: the agent's ticks take at
    /// most 1/20 of a core at the fast pace; 0: no bound).
    pub duty: u64,
}

impl Cadence {
    /// The defaults: 250 ms relaxed, 20 ms near a threshold, a 1 s horizon, held 2 s, at most 1/20 of a core.
    pub const DEFAULT: Self = Self { relaxed_ms: 250, fast_ms: 20, horizon_ms: 1_000, hold_ms: 2_000, duty: 20 };

    /// A fixed interval (no fast pace).
    pub fn fixed(interval_ms: u64) -> Self {
        Self { relaxed_ms: interval_ms, fast_ms: interval_ms, ..Self::DEFAULT }
    }
}

/// Why the agent samples fast.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Urgency {
    /// A budgeted pod at or above its warning threshold (Near or Over).
    PodNear,
    /// A budgeted pod whose usage reaches its warning threshold within the horizon at its current rate.
    PodRising,
    /// A GPU's free memory under twice its pressure threshold.
    GpuLow,
    /// A GPU's free memory reaches its pressure threshold within the horizon at its current rate.
    GpuFalling,
}

impl Urgency {
    /// Its label in logs and metrics.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::PodNear => "pod_near",
            Self::PodRising => "pod_rising",
            Self::GpuLow => "gpu_low",
            Self::GpuFalling => "gpu_falling",
        }
    }
}

/// Whether a level that moved from `prev` to `now` in `dt_ms` reaches `target` within `horizon_ms` at that
/// rate, moving up (`up`) or down. Already there counts. Without a previous sample (or no time between
/// them) only where it is now counts.
pub fn reaches(now: u64, prev: Option<u64>, dt_ms: u64, horizon_ms: u64, target: u64, up: bool) -> bool {
    let (position, step) = match (up, prev) {
        (true, prev) => (now >= target, prev.map(|p| (target.saturating_sub(now), now.saturating_sub(p)))),
        (false, prev) => (now <= target, prev.map(|p| (now.saturating_sub(target), p.saturating_sub(now)))),
    };
    if position {
        return true;
    }
    // distance / (step / dt) <= horizon, in integers: distance × dt <= step × horizon.
    match step {
        Some((distance, step)) if dt_ms > 0 && step > 0 => {
            u128::from(distance) * u128::from(dt_ms) <= u128::from(step) * u128::from(horizon_ms)
        }
        _ => false,
    }
}

/// A budgeted pod's urgency: its state after this sample, its usage now and at the last sample (`None`: not
/// seen then), the time between, and its warning threshold in bytes.
pub fn pod(
    cadence: &Cadence,
    state: BudgetState,
    usage: u64,
    prev: Option<u64>,
    dt_ms: u64,
    warn: u64,
) -> Option<Urgency> {
    match state {
        BudgetState::Near | BudgetState::Over => Some(Urgency::PodNear),
        // Evicting: the decision is taken; its lifecycle runs on timers and the executors' reports.
        BudgetState::Evicting => None,
        BudgetState::Within => {
            reaches(usage, prev, dt_ms, cadence.horizon_ms, warn, true).then_some(Urgency::PodRising)
        }
    }
}

/// A GPU's urgency: its free bytes now and at the last sample, the time between, and its pressure threshold
/// in bytes (the larger of hard and soft; 0: none).
pub fn gpu(cadence: &Cadence, free: u64, prev: Option<u64>, dt_ms: u64, threshold: u64) -> Option<Urgency> {
    if threshold == 0 {
        None
    } else if free < threshold.saturating_mul(2) {
        Some(Urgency::GpuLow)
    } else {
        reaches(free, prev, dt_ms, cadence.horizon_ms, threshold, false).then_some(Urgency::GpuFalling)
    }
}

/// The agent's sampling pace between ticks.
#[derive(Debug, Clone, Default)]
pub struct Pace {
    /// The fast pace holds until then (monotonic ms); 0: relaxed.
    fast_until: u64,
    /// The last sign seen, and whether the last tick saw it.
    reason: Option<Urgency>,
    seen: bool,
    /// The previous tick's time (monotonic ms) and this one's, for the rates.
    last_ms: Option<u64>,
    dt_ms: u64,
    /// The ticks' smoothed cost, microseconds (an exponential average, weight 1/8).
    cost_us: u64,
}

impl Pace {
    /// Starts a tick at `now_ms`: the time since the last one is what rates are measured over.
    pub fn begin(&mut self, now_ms: u64) {
        self.dt_ms = self.last_ms.map_or(0, |last| now_ms.saturating_sub(last));
        self.last_ms = Some(now_ms);
        self.seen = false;
    }

    /// The time since the previous tick (0 on the first).
    pub fn dt_ms(&self) -> u64 {
        self.dt_ms
    }

    /// Records a sign seen at `now_ms`: fast until `hold_ms` later.
    pub fn urge(&mut self, cadence: &Cadence, now_ms: u64, why: Urgency) {
        self.fast_until = self.fast_until.max(now_ms.saturating_add(cadence.hold_ms));
        self.reason = Some(why);
        self.seen = true;
    }

    /// Records what a tick cost (its whole time), for the duty bound.
    pub fn cost(&mut self, tick_us: u64) {
        self.cost_us = if self.cost_us == 0 { tick_us } else { (self.cost_us * 7 + tick_us) / 8 };
    }

    /// Why the pace is fast after the last tick, if it is: a sign seen by it, or less than `hold_ms` before.
    pub fn fast(&self) -> Option<Urgency> {
        let at = self.last_ms?;
        self.reason.filter(|_| self.seen || at < self.fast_until)
    }

    /// How long after the last tick the next one is due.
    pub fn next_ms(&self, cadence: &Cadence) -> u64 {
        if self.fast().is_none() {
            return cadence.relaxed_ms;
        }
        let duty = self.cost_us.saturating_mul(cadence.duty).div_ceil(1_000);
        cadence.fast_ms.max(duty).min(cadence.relaxed_ms)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const GI: u64 = 1 << 30;
    const C: Cadence = Cadence::DEFAULT;

    #[test]
    fn a_pod_near_or_over_is_urgent_and_an_evicting_one_is_not() {
        for (state, want) in [
            (BudgetState::Near, Some(Urgency::PodNear)),
            (BudgetState::Over, Some(Urgency::PodNear)),
            (BudgetState::Evicting, None),
            (BudgetState::Within, None),
        ] {
            assert_eq!(pod(&C, state, GI, Some(GI), 250, 8 * GI), want, "{state:?}");
        }
    }

    #[test]
    fn a_pod_rising_toward_its_warning_threshold_is_urgent_within_the_horizon() {
        // 1 GiB in 250 ms is 4 GiB/s: 3 GiB below the threshold is reached in 0.75 s (within 1 s), 5 GiB is not.
        assert_eq!(pod(&C, BudgetState::Within, 5 * GI, Some(4 * GI), 250, 8 * GI), Some(Urgency::PodRising));
        assert_eq!(pod(&C, BudgetState::Within, 3 * GI, Some(2 * GI), 250, 8 * GI), None);
        // Falling, steady, or first seen: not rising.
        assert_eq!(pod(&C, BudgetState::Within, 5 * GI, Some(6 * GI), 250, 8 * GI), None);
        assert_eq!(pod(&C, BudgetState::Within, 5 * GI, Some(5 * GI), 250, 8 * GI), None);
        assert_eq!(pod(&C, BudgetState::Within, 5 * GI, None, 0, 8 * GI), None);
    }

    #[test]
    fn a_gpu_low_or_falling_toward_its_threshold_is_urgent() {
        let threshold = 4 * GI;
        assert_eq!(gpu(&C, 7 * GI, Some(7 * GI), 250, threshold), Some(Urgency::GpuLow));
        assert_eq!(gpu(&C, 20 * GI, Some(20 * GI), 250, threshold), None);
        // 1 GiB per 250 ms (4 GiB/s): 8 GiB or 5 GiB above the threshold is 2 s or 1.25 s away (beyond the
        // horizon); at 8 GiB/s 5 GiB is 0.625 s away.
        assert_eq!(gpu(&C, 12 * GI, Some(13 * GI), 250, threshold), None);
        assert_eq!(gpu(&C, 9 * GI, Some(10 * GI), 250, threshold), None);
        assert_eq!(gpu(&C, 9 * GI, Some(11 * GI), 250, threshold), Some(Urgency::GpuFalling));
        // No threshold (pressure off): never.
        assert_eq!(gpu(&C, 0, Some(GI), 250, 0), None);
    }

    #[test]
    fn the_pace_is_fast_while_held_and_relaxes_after() {
        let mut pace = Pace::default();
        assert_eq!(pace.next_ms(&C), 250);
        pace.begin(1_000);
        pace.urge(&C, 1_000, Urgency::GpuLow);
        assert_eq!((pace.fast(), pace.next_ms(&C)), (Some(Urgency::GpuLow), 20));
        pace.begin(2_999);
        assert_eq!(pace.next_ms(&C), 20);
        pace.begin(3_000);
        assert_eq!((pace.fast(), pace.next_ms(&C)), (None, 250));
        // Held for 0 ms: fast only after the tick that saw the sign, even one in the same millisecond.
        let instant = Cadence { hold_ms: 0, ..C };
        pace.urge(&instant, 3_000, Urgency::PodNear);
        assert_eq!(pace.next_ms(&instant), 20);
        pace.begin(3_000);
        assert_eq!(pace.next_ms(&instant), 250);
        // A fixed cadence is never faster than its interval.
        pace.urge(&C, 3_000, Urgency::PodNear);
        assert_eq!(pace.next_ms(&Cadence::fixed(100)), 100);
    }

    #[test]
    fn costly_ticks_slow_the_fast_pace_down_to_at_most_the_relaxed_one() {
        let mut pace = Pace::default();
        pace.begin(0);
        pace.urge(&C, 0, Urgency::PodNear);
        pace.cost(150); // 150 us × 20 = 3 ms: 20 ms stands.
        assert_eq!(pace.next_ms(&C), 20);
        for _ in 0..64 {
            pace.cost(5_000); // 5 ms ticks (64 moving processes listed): 100 ms.
        }
        assert_eq!(pace.next_ms(&C), 100);
        assert_eq!(pace.next_ms(&Cadence { duty: 0, ..C }), 20);
        for _ in 0..64 {
            pace.cost(50_000);
        }
        assert_eq!(pace.next_ms(&C), 250);
        // One slow tick among cheap ones moves the pace little.
        let mut pace = Pace::default();
        pace.begin(0);
        pace.urge(&C, 0, Urgency::PodNear);
        pace.cost(150);
        pace.cost(7_800);
        assert!(pace.next_ms(&C) <= 25, "{}", pace.next_ms(&C));
    }

    #[test]
    fn begin_measures_the_time_between_ticks() {
        let mut pace = Pace::default();
        pace.begin(100);
        assert_eq!(pace.dt_ms(), 0);
        pace.begin(350);
        assert_eq!(pace.dt_ms(), 250);
    }

    proptest! {
        /// Whatever the inputs: the interval is within [fast, relaxed]; a level already past its target is
        /// always reached; projecting further never turns "reached" into "not reached".
        #[test]
        fn bounds_and_monotonicity(
            now in 0u64..1 << 40, prev in proptest::option::of(0u64..1 << 40), dt in 0u64..10_000,
            target in 0u64..1 << 40, up in any::<bool>(), horizon in 0u64..10_000, extra in 0u64..10_000,
            cost in 0u64..1_000_000, fast in 1u64..500, relaxed in 1u64..2_000,
        ) {
            let past = if up { now >= target } else { now <= target };
            let short = reaches(now, prev, dt, horizon, target, up);
            prop_assert!(!past || short);
            prop_assert!(!short || reaches(now, prev, dt, horizon + extra, target, up));
            let cadence = Cadence { relaxed_ms: relaxed.max(fast), fast_ms: fast, ..C };
            let mut pace = Pace::default();
            pace.begin(0);
            pace.cost(cost);
            pace.urge(&cadence, 0, Urgency::PodNear);
            let next = pace.next_ms(&cadence);
            prop_assert!(next >= cadence.fast_ms && next <= cadence.relaxed_ms);
        }
    }
}
