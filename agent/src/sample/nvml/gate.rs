//! When a unit's process lists are read: the pure [`RefreshGate`] (no NVML in it) and the sampling mode
//! ([`RefreshMode`], `GPUBUDGET_NVML_REFRESH`).

use std::time::{Duration, Instant};

/// What a unit's sample reads, as decided by [`RefreshGate::decide`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refresh {
    /// Nothing: the previous per-process figures stand.
    Skip,
    /// The process lists (compute; the other lists too where the unit has had a process on them).
    Changed,
    /// Both lists: the periodic refresh (or the first sample).
    Full,
}

impl Refresh {
    /// Whether any list is read.
    pub fn lists(self) -> bool {
        self != Self::Skip
    }
}

/// The pure decision of whether one unit's process lists must be read (no NVML in it).
///
/// Lists whenever `used_bytes` differs from the figure at the last list, and at least every `max_age`
/// whatever it says. So every change of the device total is listed at the next sample, and every other
/// change within `max_age` plus one sampling interval.
#[derive(Debug, Clone)]
pub struct RefreshGate {
    max_age: Duration,
    last: Option<(u64, Instant)>,
    others_seen: bool,
    fulls: u32,
}

impl RefreshGate {
    /// The default longest time between two full lists.
    pub const DEFAULT_MAX_AGE: Duration = Duration::from_secs(3);
    /// On a unit that has never had a process on the other lists (graphics, MPS clients), they are read
    /// on every this many periodic lists (every 15 s with the default `max_age`), on the first, and when
    /// the device total moved but the compute list did not.
    pub const OTHERS_EVERY: u32 = 5;

    /// A gate that lists at least every `max_age`.
    pub fn new(max_age: Duration) -> Self {
        Self { max_age, last: None, others_seen: false, fulls: 0 }
    }

    /// The longest time between two full lists.
    pub fn max_age(&self) -> Duration {
        self.max_age
    }

    /// Decides for a sample taken at `now` that read `used_bytes`, and records a list if it says so
    /// (call [`Self::forget`] when that list then fails).
    pub fn decide(&mut self, used_bytes: u64, now: Instant) -> Refresh {
        let decision = match self.last {
            None => Refresh::Full,
            Some((_, at)) if now.saturating_duration_since(at) >= self.max_age => Refresh::Full,
            Some((used, _)) if used != used_bytes => Refresh::Changed,
            Some(_) => Refresh::Skip,
        };
        match decision {
            Refresh::Full => self.last = Some((used_bytes, now)),
            Refresh::Changed => {
                // The age counts from the last full list, so a unit that changes at every sample still
                // gets its other lists every `max_age`.
                let at = self.last.map_or(now, |(_, at)| at);
                self.last = Some((used_bytes, at));
            }
            Refresh::Skip => {}
        }
        decision
    }

    /// [`Self::decide`] as a yes or no.
    pub fn must_list(&mut self, used_bytes: u64, now: Instant) -> bool {
        self.decide(used_bytes, now).lists()
    }

    /// Forgets the last list: the next sample lists in full, the other lists included.
    pub fn forget(&mut self) {
        self.last = None;
        self.fulls = 0;
    }

    /// Whether the other lists (graphics, MPS clients) are read too, once the gate has said `decision`
    /// and the compute list came back, `compute_unchanged` when it holds the same PIDs and bytes as the
    /// last one (so the device total moved for something else: a graphics process, say). Always on a unit
    /// that has had a process on them ([`Self::others_found`]).
    pub fn read_others(&mut self, decision: Refresh, compute_unchanged: bool) -> bool {
        match decision {
            Refresh::Skip => false,
            _ if self.others_seen => true,
            Refresh::Full => {
                let due = self.fulls.is_multiple_of(Self::OTHERS_EVERY);
                self.fulls = self.fulls.wrapping_add(1);
                due
            }
            Refresh::Changed => compute_unchanged,
        }
    }

    /// Records that another list held a process: from then on they are read with every list.
    pub fn others_found(&mut self) {
        self.others_seen = true;
    }
}

/// How the sampler reads the process lists (`GPUBUDGET_NVML_REFRESH`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RefreshMode {
    /// Through a [`RefreshGate`] with this `max_age` (the default).
    Gated(Duration),
    /// Both lists, every sample (the behaviour before the gate).
    Always,
    /// `memory_info` alone, no process (the floor, for measurements only).
    Never,
}

impl RefreshMode {
    /// Parses `gated`, `gated:2s`, `always`, `never`.
    pub fn parse(text: &str) -> Result<Self, String> {
        match text.trim() {
            "" | "gated" => Ok(Self::Gated(RefreshGate::DEFAULT_MAX_AGE)),
            "always" => Ok(Self::Always),
            "never" => Ok(Self::Never),
            other => match other.strip_prefix("gated:") {
                Some(age) => crate::cli::parse_duration(age).map(Self::Gated),
                None => Err(format!("{other:?}: expected gated, gated:<duration>, always or never")),
            },
        }
    }

    pub(super) fn from_env() -> Self {
        match std::env::var("GPUBUDGET_NVML_REFRESH") {
            Ok(text) => Self::parse(&text).unwrap_or_else(|error| {
                tracing::warn!(%error, "GPUBUDGET_NVML_REFRESH ignored");
                Self::Gated(RefreshGate::DEFAULT_MAX_AGE)
            }),
            Err(_) => Self::Gated(RefreshGate::DEFAULT_MAX_AGE),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const TICK: Duration = Duration::from_millis(250);

    #[test]
    fn first_sample_lists_in_full_then_skips_while_nothing_moves() {
        let t0 = Instant::now();
        let mut gate = RefreshGate::new(Duration::from_secs(1));
        assert_eq!(gate.decide(100, t0), Refresh::Full);
        assert_eq!(gate.decide(100, t0 + TICK), Refresh::Skip);
        assert_eq!(gate.decide(100, t0 + 2 * TICK), Refresh::Skip);
        assert_eq!(gate.decide(100, t0 + 3 * TICK), Refresh::Skip);
        assert_eq!(gate.decide(100, t0 + 4 * TICK), Refresh::Full, "max_age reached");
        assert_eq!(gate.decide(101, t0 + 5 * TICK), Refresh::Changed);
        assert_eq!(gate.decide(101, t0 + 6 * TICK), Refresh::Skip);
        assert_eq!(gate.decide(100, t0 + 7 * TICK), Refresh::Changed, "back to an earlier figure is a change");
        assert_eq!(gate.decide(100, t0 + 8 * TICK), Refresh::Full, "age counts from the last full list");
    }

    #[test]
    fn forget_lists_again() {
        let t0 = Instant::now();
        let mut gate = RefreshGate::new(Duration::from_secs(1));
        assert!(gate.must_list(5, t0));
        assert!(!gate.must_list(5, t0 + TICK));
        gate.forget();
        assert!(gate.must_list(5, t0 + 2 * TICK));
    }

    #[test]
    fn other_lists_cadence() {
        let mut gate = RefreshGate::new(Duration::from_secs(2));
        assert!(!gate.read_others(Refresh::Skip, true));
        // Periodic lists: the first, then every OTHERS_EVERY-th.
        let reads: Vec<bool> = (0..11).map(|_| gate.read_others(Refresh::Full, false)).collect();
        assert_eq!(reads, [true, false, false, false, false, true, false, false, false, false, true]);
        // A moved device total with an unchanged compute list reads graphics; a changed compute list does not.
        assert!(gate.read_others(Refresh::Changed, true));
        assert!(!gate.read_others(Refresh::Changed, false));
        // Once a graphics process was seen, every list reads graphics.
        gate.others_found();
        assert!(gate.read_others(Refresh::Changed, false));
        assert!(gate.read_others(Refresh::Full, false));
        assert!(!gate.read_others(Refresh::Skip, false));
        // After a failure, the next list is a full one with graphics.
        let mut gate = RefreshGate::new(Duration::from_secs(2));
        gate.read_others(Refresh::Full, false);
        gate.forget();
        assert!(gate.read_others(Refresh::Full, false));
    }

    #[test]
    fn modes_parse() {
        assert_eq!(RefreshMode::parse("gated"), Ok(RefreshMode::Gated(RefreshGate::DEFAULT_MAX_AGE)));
        assert_eq!(RefreshMode::parse("gated:1s"), Ok(RefreshMode::Gated(Duration::from_secs(1))));
        assert_eq!(RefreshMode::parse("always"), Ok(RefreshMode::Always));
        assert_eq!(RefreshMode::parse("never"), Ok(RefreshMode::Never));
        assert!(RefreshMode::parse("sometimes").is_err());
    }
}
