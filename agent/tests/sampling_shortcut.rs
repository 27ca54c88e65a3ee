//! The NVML sampler's shortcut (issue 13): a unit's process lists are read only when its used bytes moved
//! or its last full list is `max_age` old ([`RefreshGate`]). The real sampler ([`NvmlSampler`]) runs over a
//! fake NVML showing a simulated GPU (processes appearing, exiting, growing, moving bytes under an unchanged device total, PID
//! reuse) and checks that every change shows in the snapshot within `max_age + one interval`, that a
//! change of the device total shows at the very next sample, and that when the gate says no, the previous
//! per-process figures are carried unchanged.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

mod support;

use gpubudget_agent::sample::nvml::{Listed, NvmlSampler, ProcessList, RefreshGate, RefreshMode};
use gpubudget_agent::sample::{ProcessSample, Snapshot};
use proptest::prelude::*;
use support::fake_nvml::{FakeGpu, FakeNvml};

const INTERVAL: Duration = Duration::from_millis(250);
const MAX_AGE: Duration = RefreshGate::DEFAULT_MAX_AGE;

/// One simulated GPU: pid -> (bytes, generation). The generation changes when a PID is reused.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
struct World {
    overhead: u64,
    procs: BTreeMap<u32, (u64, u32)>,
    next_generation: u32,
}

impl World {
    fn used(&self) -> u64 {
        self.overhead + self.procs.values().map(|(b, _)| b).sum::<u64>()
    }
}

#[derive(Debug, Clone)]
enum Event {
    Appear {
        pid: u32,
        bytes: u64,
    },
    Exit {
        pid: u32,
    },
    Grow {
        pid: u32,
        bytes: u64,
    },
    /// Bytes move from one process to another: the device total does not change.
    Move {
        from: u32,
        to: u32,
        bytes: u64,
    },
    /// The process exits and another one gets its PID with the same footprint: nothing NVML shows changes
    /// but the process behind the PID.
    Reuse {
        pid: u32,
    },
    Nothing,
}

impl World {
    fn apply(&mut self, event: &Event) -> bool {
        let generation = self.next_generation;
        let changed = match *event {
            Event::Appear { pid, bytes } => self.procs.insert(pid, (bytes, generation)).is_none(),
            Event::Exit { pid } => self.procs.remove(&pid).is_some(),
            Event::Grow { pid, bytes } => self.procs.get_mut(&pid).map(|p| p.0 += bytes).is_some(),
            Event::Move { from, to, bytes } => {
                if from != to && self.procs.get(&from).is_some_and(|p| p.0 >= bytes) && self.procs.contains_key(&to) {
                    self.procs.get_mut(&from).expect("from").0 -= bytes;
                    self.procs.get_mut(&to).expect("to").0 += bytes;
                    bytes > 0
                } else {
                    false
                }
            }
            Event::Reuse { pid } => self.procs.get_mut(&pid).map(|p| p.1 = generation).is_some(),
            Event::Nothing => false,
        };
        self.next_generation += 1;
        changed
    }

    /// What a full list shows: (pid, bytes, generation).
    fn listed(&self) -> Vec<(u32, u64, u32)> {
        self.procs.iter().map(|(&pid, &(b, g))| (pid, b, g)).collect()
    }
}

/// What the sampler read at its last list (the fake NVML's calls say when it listed).
#[derive(Debug, Clone, Default)]
struct Observed {
    /// When the sampler last read the lists, and what they held (pid, bytes, generation).
    listed_at: Option<Instant>,
    seen: Vec<(u32, u64, u32)>,
    lists: u64,
    skips: u64,
}

/// Puts `world` into the fake NVML: its processes on the compute list, its overhead in no list.
fn show(nvml: &FakeNvml, world: &World) {
    nvml.with(|w| {
        w.gpus[0].hidden = world.overhead;
        w.gpus[0].processes = world
            .procs
            .iter()
            .map(|(&pid, &(bytes, _))| (ProcessList::Compute, Listed { pid, bytes: Some(bytes) }))
            .collect();
    });
}

fn event() -> impl Strategy<Value = Event> {
    let pid = 1u32..6;
    prop_oneof![
        (pid.clone(), 1u64..8).prop_map(|(pid, b)| Event::Appear { pid, bytes: b << 20 }),
        pid.clone().prop_map(|pid| Event::Exit { pid }),
        (pid.clone(), 1u64..8).prop_map(|(pid, b)| Event::Grow { pid, bytes: b << 20 }),
        (pid.clone(), pid.clone(), 1u64..4).prop_map(|(from, to, b)| Event::Move { from, to, bytes: b << 20 }),
        (pid.clone(), pid.clone(), 1u64..4).prop_map(|(from, to, b)| Event::Move { from, to, bytes: b << 20 }),
        pid.prop_map(|pid| Event::Reuse { pid }),
        Just(Event::Nothing),
        Just(Event::Nothing),
    ]
}

#[derive(Debug, Default)]
struct Outcome {
    /// Longest delay from a change to the first sample whose list was read at or after it.
    worst: Duration,
    /// Longest delay of a change that left the device total unchanged (moves, PID reuse).
    worst_hidden: Duration,
    lists: u64,
    skips: u64,
}

/// Runs `events` through the real NVML sampler over a fake NVML, one event at the given offset inside each
/// 250 ms interval, a sample at the end of each, and checks every sample on the way.
fn run(events: &[(Event, u64)]) -> Outcome {
    let t0 = Instant::now();
    let mut world = World { overhead: 500 << 20, procs: BTreeMap::from([(1, (1 << 20, 0))]), next_generation: 1 };
    let nvml = FakeNvml::new(vec![FakeGpu::new("GPU-shortcut", 80 << 30)]);
    show(&nvml, &world);
    let mut sampler =
        NvmlSampler::with_backend(nvml.clone(), RefreshMode::Gated(MAX_AGE), t0).expect("the fake initialises");
    let mut observed = Observed::default();
    let mut out = Snapshot::default();
    let mut outcome = Outcome::default();
    // Changes not shown yet: (when, whether the device total moved).
    let mut pending: Vec<(Instant, bool)> = Vec::new();
    let mut previous: Option<Vec<ProcessSample>> = None;
    for (tick, (event, offset_ms)) in events.iter().enumerate() {
        let start = t0 + INTERVAL * tick as u32;
        let now = start + INTERVAL;
        let before = world.used();
        if world.apply(event) {
            pending.push((start + Duration::from_millis(offset_ms % 250), world.used() != before));
        }
        show(&nvml, &world);
        nvml.take_calls();
        sampler.sample_at(now, &mut out).expect("sampled");
        if nvml.take_calls().iter().any(|c| c.starts_with(ProcessList::Compute.call().as_str())) {
            observed.lists += 1;
            observed.listed_at = Some(now);
            observed.seen = world.listed();
        } else {
            observed.skips += 1;
        }
        let shown: Vec<(u32, u64)> = out.processes.iter().map(|p| (p.pid.expect("pid"), p.charged())).collect();
        let cached: Vec<(u32, u64)> = observed.seen.iter().map(|&(p, b, _)| (p, b)).collect();
        // The snapshot is always the last list, whole.
        assert_eq!(shown, cached, "tick {tick}");
        if observed.listed_at != Some(now) {
            // Skipped: the previous per-process figures are carried unchanged, and the device total has
            // not moved since that list.
            assert_eq!(Some(&out.processes), previous.as_ref(), "tick {tick}: skipped list not carried unchanged");
        } else {
            assert_eq!(observed.seen, world.listed());
        }
        let listed_at = observed.listed_at.expect("the first sample lists");
        assert!(now - listed_at < MAX_AGE, "tick {tick}: the last list is {:?} old", now - listed_at);
        // A change is shown once a list was read at or after it.
        pending.retain(|&(at, moved_total)| {
            if listed_at >= at {
                let delay = now - at;
                outcome.worst = outcome.worst.max(delay);
                if moved_total {
                    assert!(delay <= INTERVAL, "tick {tick}: a change of the device total took {delay:?}");
                } else {
                    outcome.worst_hidden = outcome.worst_hidden.max(delay);
                }
                false
            } else {
                assert!(now - at <= MAX_AGE + INTERVAL, "tick {tick}: a change is {:?} old and not shown", now - at);
                true
            }
        });
        outcome.lists = observed.lists;
        outcome.skips = observed.skips;
        previous = Some(out.processes.clone());
    }
    outcome
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn every_change_is_seen_within_max_age_plus_one_interval(
        events in proptest::collection::vec((event(), 0u64..250), 1..160)
    ) {
        let outcome = run(&events);
        prop_assert!(outcome.worst <= MAX_AGE + INTERVAL, "worst delay {:?}", outcome.worst);
    }
}

/// The cases the issue names, one by one, with their delays.
#[test]
fn named_cases() {
    let quiet = |n: usize| std::iter::repeat_n((Event::Nothing, 0), n);
    // Bytes move between two processes under an unchanged device total, just after a list.
    let mut events: Vec<(Event, u64)> = vec![(Event::Appear { pid: 2, bytes: 4 << 20 }, 0)];
    events.extend(quiet(2));
    events.push((Event::Move { from: 2, to: 1, bytes: 1 << 20 }, 1));
    events.extend(quiet(12));
    let o = run(&events);
    assert!(o.worst_hidden > Duration::ZERO && o.worst_hidden <= MAX_AGE + INTERVAL, "{o:?}");
    // PID reuse with the same footprint.
    let mut events: Vec<(Event, u64)> = vec![(Event::Reuse { pid: 1 }, 1)];
    events.extend(quiet(12));
    let o = run(&events);
    assert!(o.worst_hidden <= MAX_AGE + INTERVAL, "{o:?}");
    // Appearing and exiting move the total: seen at the next sample.
    let events = vec![
        (Event::Nothing, 0),
        (Event::Appear { pid: 3, bytes: 2 << 20 }, 10),
        (Event::Nothing, 0),
        (Event::Exit { pid: 3 }, 10),
        (Event::Nothing, 0),
    ];
    let o = run(&events);
    assert!(o.worst <= INTERVAL, "{o:?}");
    // Steady state: one list per `max_age` (every 12th sample at 250 ms with 3 s), the rest skipped.
    let o = run(&quiet(40).collect::<Vec<_>>());
    assert_eq!(MAX_AGE, Duration::from_secs(3));
    assert_eq!((o.lists, o.skips), (4, 36), "{o:?}");
}
