//! One tick: sample the GPUs, attribute processes to pods, sum per pod, decide, publish metrics. Shared by
//! `run` (API executor), `standalone` (JSON lines) and, without decisions, `top`.

use std::time::{Duration, Instant};

use crate::attribution::ProcAttributor;
use crate::enforce::decide::Enforcer;
use crate::enforce::{Action, Feedback, Now, Settings, Usage};
use crate::gpu::{SamplerSlot, SlotOutcome, Snapshot};
use crate::metrics::{Metrics, SeriesTracker};
use crate::pods::PodTable;

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
    series: SeriesTracker,
    started: Instant,
    actions: Vec<Action>,
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
            series: SeriesTracker::default(),
            started: Instant::now(),
            actions: Vec::new(),
        }
    }

    /// The clock now.
    pub fn now(&self) -> Now {
        let mono_ms = u64::try_from(self.started.elapsed().as_millis()).unwrap_or(u64::MAX);
        Now { mono_ms, wall: jiff::Timestamp::now() }
    }

    /// Samples and, with `enforce`, decides. The actions are in [`Self::take_actions`].
    pub fn tick(&mut self, table: &PodTable, enforce: bool) -> TickReport {
        let start = Instant::now();
        let now = self.now();
        let outcome = self.slot.sample(start, &mut self.snapshot);
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
        if enforce {
            self.enforcer.tick(now, table, &self.usage.pods, &self.snapshot.gpus, &mut self.actions);
        }
        let enforcer = &self.enforcer;
        self.series.update(&self.metrics, &self.snapshot, table, &self.usage, |uid| enforcer.state_of(uid));
        let tick_time = start.elapsed();
        self.metrics.sample_duration.observe(tick_time.as_secs_f64());
        TickReport { sampled: true, sample_time, tick_time }
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::attribution::procfs::write_fake_process;
    use crate::gpu::recorded::RecordedSampler;
    use crate::pods::PodView;
    use k8s_openapi::api::core::v1::Pod;
    use prometheus_client::registry::Registry;

    /// A node at the pod limit: 110 pods with a budget, 8 GPUs, 2 processes per pod (one by PID through a
    /// fake /proc, one named in the sample file). `cargo test -p gpubudget-agent --release -- --ignored
    /// --nocapture bench_tick` prints the cost of a tick without NVML.
    #[test]
    #[ignore = "a benchmark: run with --ignored --nocapture"]
    fn bench_tick() {
        let dir = tempfile::tempdir().expect("tempdir");
        let mut pods = Vec::new();
        let mut processes = Vec::new();
        for i in 0..110u32 {
            let uid = format!("00000000-0000-4000-8000-{i:012}");
            let cid = format!("{i:064x}");
            let cgroup = format!("0::/kubepods/burstable/pod{uid}/{cid}\n");
            write_fake_process(dir.path(), 1000 + i, 1, &cgroup).expect("fixture");
            let pod: Pod = serde_yaml::from_str(&format!(
                "metadata: {{name: p{i}, namespace: ns, uid: {uid}, labels: {{app: a{}}}}}\nspec: {{nodeName: n1, containers: []}}\n\
                 status: {{containerStatuses: [{{name: main, containerID: 'containerd://{cid}', image: x, imageID: x, ready: true, restartCount: 0}}]}}",
                i % 10
            ))
            .expect("pod");
            pods.push(PodView::from_pod(&pod).expect("view"));
            processes.push(format!(r#"{{"pid": {}, "used_bytes": {}}}"#, 1000 + i, u64::from(i) << 26));
            processes.push(format!(r#"{{"pod_uid": "{uid}", "container": "main", "used_bytes": 1048576}}"#));
        }
        let gpus: Vec<String> = (0..8)
            .map(|g| {
                let mine: Vec<&str> = processes.iter().skip(g).step_by(8).map(String::as_str).collect();
                format!(r#"{{"index": {g}, "processes": [{}]}}"#, mine.join(","))
            })
            .collect();
        let sample = dir.path().join("sample.json");
        std::fs::write(&sample, format!(r#"{{"gpus": [{}]}}"#, gpus.join(","))).expect("sample");
        let budgets: Vec<gpubudget_common::GpuMemoryBudget> = (0..10)
            .map(|a| {
                serde_yaml::from_str(&format!(
                    "apiVersion: gpubudget.io/v1alpha1\nkind: GpuMemoryBudget\nmetadata: {{name: b{a}, namespace: ns}}\n\
                     spec: {{selector: {{matchLabels: {{app: a{a}}}}}, limit: 4Gi}}"
                ))
                .expect("budget")
            })
            .collect();
        let table = PodTable::build(pods, &budgets, Some("n1"));
        let mut engine = Engine::new(
            SamplerSlot::new(RecordedSampler::factory(sample)),
            ProcAttributor::new(dir.path()),
            Settings::new("n1"),
            Metrics::new(&mut Registry::default()),
        );
        for _ in 0..10 {
            engine.tick(&table, true);
            for a in engine.take_actions().collect::<Vec<_>>() {
                if let Action::Apply { pod, record } = a {
                    engine.feedback(Feedback::Written { uid: pod.uid, record: Some(record), ok: true });
                }
            }
        }
        let n = 2_000;
        let start = Instant::now();
        let mut actions = 0;
        for _ in 0..n {
            assert!(engine.tick(&table, true).sampled);
            actions += engine.take_actions().count();
        }
        let per_tick = start.elapsed() / n;
        println!(
            "tick with 110 pods, 220 processes on 8 GPUs (no NVML): {per_tick:?}; {actions} actions in steady state"
        );
        assert_eq!(actions, 0);
    }
}
