//! The enforcement state machine: where a pod stands against its budget, from its usage samples.
//!
//! A pure function of (thresholds, previous tracker, sample). It models the kubelet's soft eviction
//! threshold: usage must stay over the limit at every sample for `overLimitSeconds` before the action is
//! due, and a single sample at or under the limit resets that timer. Leaving a state needs the usage to
//! fall a hysteresis band below the threshold that entered it, so a value hovering at a threshold does
//! not flap between states; the eviction timer is never held by hysteresis.

use serde::{Deserialize, Serialize};

/// Where a pod stands against its budget.
#[derive(
    Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord, schemars::JsonSchema,
)]
pub enum BudgetState {
    /// Under `warnAtPercent` of the limit.
    #[default]
    Within,
    /// At or above `warnAtPercent` of the limit, not over it.
    Near,
    /// Over the limit (or just back under it, inside the hysteresis band).
    Over,
    /// Over the limit for `overLimitSeconds`: the eviction is due or under way.
    Evicting,
}

impl BudgetState {
    /// The name used in annotations, metrics and tables.
    pub fn as_str(self) -> &'static str {
        match self {
            BudgetState::Within => "Within",
            BudgetState::Near => "Near",
            BudgetState::Over => "Over",
            BudgetState::Evicting => "Evicting",
        }
    }

    /// Parses [`BudgetState::as_str`] output.
    pub fn parse(text: &str) -> Option<Self> {
        [Self::Within, Self::Near, Self::Over, Self::Evicting].into_iter().find(|s| s.as_str() == text)
    }

    /// Over or evicting.
    pub fn is_over(self) -> bool {
        matches!(self, BudgetState::Over | BudgetState::Evicting)
    }
}

impl std::fmt::Display for BudgetState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The numbers one budget imposes on one pod.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Thresholds {
    /// Bytes the pod may hold; more is over.
    pub limit: u64,
    /// Bytes at or above which the pod is near its budget.
    pub warn: u64,
    /// Band under a threshold that usage must fall below to leave the state that threshold entered.
    pub hysteresis: u64,
    /// Milliseconds usage must stay over the limit before the action is due.
    pub over_limit_ms: u64,
    /// False for `action: Warn` and for critical pods: the action never becomes due.
    pub may_evict: bool,
}

impl Thresholds {
    /// Thresholds for a limit, a warn percentage (1..=100) and a delay; the hysteresis band is 2 % of
    /// the limit.
    pub fn new(limit: u64, warn_at_percent: u8, over_limit_ms: u64, may_evict: bool) -> Self {
        let percent = u128::from(warn_at_percent.clamp(1, 100));
        let warn = u64::try_from(u128::from(limit) * percent / 100).unwrap_or(limit);
        Self { limit, warn, hysteresis: limit / 50, over_limit_ms, may_evict }
    }
}

/// What the state machine remembers about one pod between samples.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Tracker {
    /// The state after the last sample.
    pub state: BudgetState,
    /// Time (ms) of the first sample of the current unbroken run of samples over the limit.
    pub over_since: Option<u64>,
}

impl Tracker {
    /// Milliseconds the pod has been continuously over its limit at `now`.
    pub fn over_for(&self, now_ms: u64) -> u64 {
        self.over_since.map_or(0, |since| now_ms.saturating_sub(since))
    }
}

/// Advances the tracker by one sample of `usage` bytes taken at `now_ms` (a monotonic clock).
pub fn step(prev: Tracker, th: &Thresholds, now_ms: u64, usage: u64) -> Tracker {
    let over = usage > th.limit;
    let over_since = if over { Some(prev.over_since.unwrap_or(now_ms)) } else { None };
    let over_for = over_since.map_or(0, |since| now_ms.saturating_sub(since));
    let was_over = prev.state.is_over();
    let was_near_or_over = was_over || prev.state == BudgetState::Near;
    let state = if over && th.may_evict && over_for >= th.over_limit_ms {
        BudgetState::Evicting
    } else if over || (was_over && usage > th.limit.saturating_sub(th.hysteresis)) {
        BudgetState::Over
    } else if usage >= th.warn || (was_near_or_over && usage >= th.warn.saturating_sub(th.hysteresis)) {
        BudgetState::Near
    } else {
        BudgetState::Within
    };
    Tracker { state, over_since }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const GI: u64 = 1 << 30;

    fn run(th: &Thresholds, samples: &[(u64, u64)]) -> Vec<BudgetState> {
        let mut t = Tracker::default();
        samples
            .iter()
            .map(|&(at, usage)| {
                t = step(t, th, at, usage);
                t.state
            })
            .collect()
    }

    #[test]
    fn climbs_from_within_to_evicting() {
        let th = Thresholds::new(8 * GI, 90, 10_000, true);
        let states =
            run(&th, &[(0, 6 * GI), (1_000, 7_800_000_000), (2_000, 9 * GI), (11_999, 9 * GI), (12_000, 9 * GI)]);
        use BudgetState::*;
        assert_eq!(states, vec![Within, Near, Over, Over, Evicting]);
    }

    #[test]
    fn one_sample_at_the_limit_resets_the_timer() {
        let th = Thresholds::new(8 * GI, 90, 10_000, true);
        let states = run(&th, &[(0, 9 * GI), (9_000, 8 * GI), (10_000, 9 * GI), (19_999, 9 * GI), (20_000, 9 * GI)]);
        assert_eq!(states.last(), Some(&BudgetState::Evicting));
        assert!(!states[..4].contains(&BudgetState::Evicting), "{states:?}");
        assert_eq!(states[1], BudgetState::Over, "at the limit, inside the band: still reported over");
    }

    #[test]
    fn warn_and_critical_never_evict() {
        let th = Thresholds::new(GI, 90, 0, false);
        assert_eq!(run(&th, &[(0, 2 * GI), (60_000, 2 * GI)]), vec![BudgetState::Over, BudgetState::Over]);
    }

    #[test]
    fn zero_delay_is_a_hard_threshold() {
        let th = Thresholds::new(GI, 90, 0, true);
        assert_eq!(run(&th, &[(5, GI + 1)]), vec![BudgetState::Evicting]);
    }

    #[test]
    fn hovering_at_the_warn_threshold_does_not_flap() {
        let th = Thresholds::new(100 * GI, 90, 10_000, true);
        let samples: Vec<(u64, u64)> =
            (0..100).map(|i| (i * 250, if i % 2 == 0 { 90 * GI } else { 90 * GI - 1 })).collect();
        let states = run(&th, &samples);
        assert!(states.iter().all(|s| *s == BudgetState::Near), "{states:?}");
        // Leaving needs a real fall.
        assert_eq!(run(&th, &[(0, 90 * GI), (1, 80 * GI)]), vec![BudgetState::Near, BudgetState::Within]);
    }

    #[test]
    fn clock_going_backwards_only_delays() {
        let th = Thresholds::new(GI, 90, 10_000, true);
        let states = run(&th, &[(50_000, 2 * GI), (10_000, 2 * GI), (59_999, 2 * GI), (60_000, 2 * GI)]);
        assert_eq!(states, vec![BudgetState::Over, BudgetState::Over, BudgetState::Over, BudgetState::Evicting]);
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(2_000))]

        /// Evicting at time t means every sample in [t - overLimit, t] was over the limit, and the run
        /// of over samples began at least overLimit before t.
        #[test]
        fn never_evicts_early(
            limit in 1u64..1_000,
            percent in 1u8..=100,
            delay in 0u64..5_000,
            may_evict in any::<bool>(),
            steps in proptest::collection::vec((0u64..2_000, 0u64..2_000), 1..80),
        ) {
            let th = Thresholds::new(limit, percent, delay, may_evict);
            let mut t = Tracker::default();
            let mut now = 0u64;
            let mut history: Vec<(u64, u64)> = Vec::new();
            for (dt, usage) in steps {
                now += dt;
                history.push((now, usage));
                t = step(t, &th, now, usage);
                if t.state == BudgetState::Evicting {
                    prop_assert!(may_evict);
                    let run_start = history.iter().rev().take_while(|(_, u)| *u > limit).last().map(|(at, _)| *at);
                    let start = run_start.expect("the current sample is over");
                    prop_assert!(now - start >= delay, "evicted after {}ms < {}ms", now - start, delay);
                }
                if usage > limit {
                    prop_assert!(t.state.is_over());
                }
                if usage < th.warn.saturating_sub(th.hysteresis) {
                    prop_assert_eq!(t.state, BudgetState::Within);
                }
            }
        }

        /// A value moving inside the hysteresis band below the warn threshold changes state at most once.
        #[test]
        fn hysteresis_bounds_flapping(limit in 1_000u64..1_000_000, wiggles in proptest::collection::vec(any::<bool>(), 2..200)) {
            let th = Thresholds::new(limit, 90, 10_000, true);
            let mut t = Tracker::default();
            let mut changes = 0;
            for (i, up) in wiggles.into_iter().enumerate() {
                let usage = if up { th.warn } else { th.warn - th.hysteresis / 2 };
                let next = step(t, &th, i as u64 * 250, usage);
                if next.state != t.state { changes += 1; }
                t = next;
            }
            prop_assert!(changes <= 1, "{changes} changes");
        }
    }
}
