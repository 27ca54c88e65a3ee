//! One tick of the pipeline: sample the GPUs, attribute processes to pods, sum per pod, decide, publish
//! metrics. Shared by `run` (API executor) and `standalone` (JSON lines); `top` samples and attributes
//! on its own (it decides nothing and exports nothing).

use std::time::{Duration, Instant};

use crate::attribute::ProcAttributor;
use crate::attribute::Usage;
use crate::attribute::driver_limits::{DriverReader, DriverView};
use crate::attribute::pods::PodTable;
use crate::decide::Enforcer;
use crate::decide::{Action, Feedback, Now, Settings};
use crate::report::metrics::{DriverLimitsResult, DriverSeries, Metrics, SeriesTracker};
use crate::sample::{SamplerSlot, SlotOutcome, Snapshot, monotonic_now};

/// What a tick did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TickReport {
    /// A sample was taken (and, if asked, decided on).
    pub sampled: bool,
    /// Time spent in the sampler (NVML calls, or the sample-file check).
    pub sample_time: Duration,
    /// Time for the whole tick (sample, attribution, decisions, metrics).
    pub tick_time: Duration,
}

/// The agent's loop state.
#[derive(Debug)]
pub struct Engine {
    /// The GPU sampler (rebuilt with backoff when it fails).
    pub slot: SamplerSlot,
    /// PID → container.
    pub attributor: ProcAttributor,
    /// The last sample.
    pub snapshot: Snapshot,
    /// The last per-pod usage.
    pub usage: Usage,
    /// The decisions.
    pub enforcer: Enforcer,
    /// Metric families.
    pub metrics: Metrics,
    /// The NVIDIA driver's per-cgroup limits, where this node's NVML has them (set by `run`).
    pub driver: Option<DriverReader>,
    /// Per pod of the table: what the driver caps it at (this tick's, or the last read).
    pub driver_views: Vec<Option<DriverView>>,
    /// What `--apply-driver-limits` set this tick.
    applied: Vec<crate::attribute::driver_limits::Applied>,
    series: SeriesTracker,
    driver_series: DriverSeries,
    started: Instant,
    actions: Vec<Action>,
    /// The interval last chosen.
    next: Duration,
}

impl Engine {
    /// An engine; `started` is the zero of its monotonic clock.
    pub fn new(slot: SamplerSlot, attributor: ProcAttributor, settings: Settings, metrics: Metrics) -> Self {
        Self {
            slot,
            attributor,
            snapshot: Snapshot::default(),
            usage: Usage::default(),
            enforcer: Enforcer::new(settings),
            metrics,
            driver: None,
            driver_views: Vec::new(),
            applied: Vec::new(),
            series: SeriesTracker::default(),
            driver_series: DriverSeries::default(),
            started: monotonic_now(),
            actions: Vec::new(),
            next: Duration::ZERO,
        }
    }

    /// The clock now.
    pub fn now(&self) -> Now {
        let mono_ms =
            u64::try_from(monotonic_now().saturating_duration_since(self.started).as_millis()).unwrap_or(u64::MAX);
        Now { mono_ms, wall: jiff::Timestamp::now() }
    }

    /// Samples and, with `enforce`, decides. The actions are in [`Self::take_actions`].
    pub fn tick(&mut self, table: &PodTable, enforce: bool) -> TickReport {
        let start = Instant::now();
        let now = self.now();
        let outcome = self.slot.sample(monotonic_now(), &mut self.snapshot);
        let sample_time = start.elapsed();
        match outcome {
            SlotOutcome::Sampled => {}
            SlotOutcome::Failed(error) => {
                self.metrics.nvml_error(error.call);
                return TickReport { sampled: false, sample_time, tick_time: start.elapsed() };
            }
            SlotOutcome::Waiting => return TickReport { sampled: false, sample_time, tick_time: start.elapsed() },
        }
        self.usage.compute(&self.snapshot, table, &mut self.attributor, now.mono_ms);
        if let Some(reader) = &mut self.driver {
            let failures = reader.failures;
            let (snapshot, owners, attributor) = (&self.snapshot, &self.usage.owners, &self.attributor);
            reader.observe(snapshot, owners, attributor, table.pods.len(), now.mono_ms, &mut self.driver_views);
            self.applied.clear();
            if reader.apply && enforce {
                let plan = |pod: usize, reading| {
                    let caps = table.budget(pod).and_then(gpubudget_common::caps::Caps::of)?;
                    crate::decide::driver_limits::to_apply(caps, reading)
                };
                reader.apply(snapshot, plan, now.mono_ms, &mut self.driver_views, &mut self.applied);
                for a in &self.applied {
                    let result = if a.held() { DriverLimitsResult::Applied } else { DriverLimitsResult::Failed };
                    self.metrics.driver_limits_applied(result);
                }
            }
            for _ in failures..reader.failures {
                self.metrics.nvml_error(crate::sample::Call::MemoryLimits);
            }
            self.driver_series.update(&self.metrics, table, &self.driver_views);
        }
        if enforce {
            self.enforcer.tick(now, table, &self.usage.pods, &self.snapshot.gpus, &mut self.actions);
            self.enforcer.pressure(now, table, &self.usage.pods, &self.snapshot, &mut self.actions);
            self.enforcer.watch_gpus(now, &self.snapshot, table, &self.usage, &mut self.actions);
            if self.driver.is_some() {
                self.enforcer.driver_limits(table, &self.driver_views, &mut self.actions);
                self.enforcer.driver_applied(now, table, &self.applied, &self.snapshot.gpus, &mut self.actions);
            }
            let uncapped = self.enforcer.caps_not_in_force();
            self.metrics.caps_not_in_force.set(i64::try_from(uncapped).unwrap_or(i64::MAX));
        }
        let enforcer = &self.enforcer;
        self.series.update(
            &self.metrics,
            &self.snapshot,
            table,
            &self.usage,
            |uid| enforcer.state_of(uid),
            |gpu| enforcer.under_pressure(gpu),
        );
        let tick_time = start.elapsed();
        self.metrics.sample_duration.observe(tick_time.as_secs_f64());
        self.enforcer.tick_cost_us(u64::try_from(tick_time.as_micros()).unwrap_or(u64::MAX));
        TickReport { sampled: true, sample_time, tick_time }
    }

    /// How long after the last tick's start the next is due: the relaxed interval, or the fast one while a
    /// pod or a GPU is close to a threshold ([`crate::decide::cadence`]). Published as
    /// `gpubudget_sample_interval_seconds` when it changes.
    pub fn next_sample(&mut self) -> Duration {
        let (ms, fast) = self.enforcer.next_sample_ms();
        let next = Duration::from_millis(ms);
        if next != self.next {
            tracing::debug!(interval = ?next, reason = fast.map(|u| u.as_str()), "sampling pace");
            self.next = next;
            self.metrics.sample_interval.set(next.as_secs_f64());
        }
        next
    }

    /// Whether budgets are enforced on at least one GPU: the sampler is up and a GPU was sampled in the
    /// last tick (the agent's readiness).
    /// The memory of each GPU and MIG instance of the node, bytes (empty until NVML has answered): what a
    /// fraction of a GPU declared by a pod's scheduler resolves against.
    pub fn gpu_totals(&self) -> Vec<u64> {
        self.snapshot.gpus.iter().map(|g| g.total_bytes).collect()
    }

    /// Whether [`gpu_totals`](Self::gpu_totals) are `totals`, without a copy (asked every tick).
    pub fn gpu_totals_are(&self, totals: &[u64]) -> bool {
        self.snapshot.gpus.iter().map(|g| g.total_bytes).eq(totals.iter().copied())
    }

    pub fn enforcing(&self) -> bool {
        self.slot.healthy() && self.snapshot.sampled_gpus() > 0
    }

    /// Takes an executor's report into account.
    pub fn feedback(&mut self, feedback: Feedback) {
        let now = self.now();
        self.enforcer.feedback(now, feedback, &mut self.actions);
    }

    /// The actions decided since the last call, in order.
    pub fn take_actions(&mut self) -> std::vec::Drain<'_, Action> {
        self.actions.drain(..)
    }
}
