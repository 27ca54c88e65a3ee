//! The agent's Prometheus metrics. Series of pods that are gone are removed. Label sets are built once per
//! series and cached with the series' gauge, so a steady tick allocates nothing here and sets gauges without
//! hashing label sets (the family lookups were a third of a tick: docs/performance.md).

use std::collections::HashMap;
use std::sync::Arc;

use gpubudget_common::BudgetState;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

use crate::FastMap;
use crate::act::{Counters, SpecReadLabels};
use crate::attribute::Usage;
use crate::attribute::pods::PodTable;
use crate::sample::{GpuHealth, Snapshot};

/// `{namespace, pod, container, gpu}`.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ContainerLabels {
    /// Namespace.
    pub namespace: String,
    /// Pod name.
    pub pod: String,
    /// Container name (empty when unknown).
    pub container: String,
    /// GPU label.
    pub gpu: String,
}

/// `{namespace, pod, budget}`.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct BudgetLabels {
    /// Namespace.
    pub namespace: String,
    /// Pod name.
    pub pod: String,
    /// Budget name.
    pub budget: String,
}

/// `{namespace, pod, state}`.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct StateLabels {
    /// Namespace.
    pub namespace: String,
    /// Pod name.
    pub pod: String,
    /// `Within`, `Near`, `Over`, `Evicting`.
    pub state: StateLabel,
}

/// A pod's state as a label value: `Within`, `Near`, `Over`, `Evicting` ([`BudgetState::as_str`]).
#[derive(Debug, Clone, Copy, Hash, PartialEq, Eq)]
pub struct StateLabel(pub BudgetState);

impl StateLabel {
    /// The label value.
    pub fn as_str(self) -> &'static str {
        self.0.as_str()
    }
}

/// The `result` of a set of `--apply-driver-limits` (`gpubudget_driver_limits_applied_total`).
#[derive(Debug, Clone, Copy, Hash, PartialEq, Eq)]
pub enum DriverLimitsResult {
    /// `applied`: the driver holds the limits set.
    Applied,
    /// `failed`.
    Failed,
}

impl DriverLimitsResult {
    /// The label value.
    pub fn as_str(self) -> &'static str {
        match self {
            DriverLimitsResult::Applied => "applied",
            DriverLimitsResult::Failed => "failed",
        }
    }
}

gpubudget_daemon::label_values!(StateLabel, DriverLimitsResult);

/// `{result}` of a set of `--apply-driver-limits`.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct DriverLimitsLabels {
    /// `applied` or `failed`.
    pub result: DriverLimitsResult,
}

/// `{namespace, pod}`.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct PodLabels {
    /// Namespace.
    pub namespace: String,
    /// Pod name.
    pub pod: String,
}

/// `{call}`.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct CallLabels {
    /// The failing call.
    pub call: crate::sample::Call,
}

/// `{gpu}`.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct GpuLabels {
    /// GPU label.
    pub gpu: String,
}

/// The metric families (cheap to clone: each is shared).
#[derive(Debug, Clone)]
pub struct Metrics {
    /// `gpubudget_pod_gpu_memory_bytes`.
    pub pod_memory: Family<ContainerLabels, Gauge>,
    /// `gpubudget_pod_budget_bytes`.
    pub pod_budget: Family<BudgetLabels, Gauge>,
    /// `gpubudget_pod_state`.
    pub pod_state: Family<StateLabels, Gauge>,
    /// `gpubudget_evictions_total` and `gpubudget_api_writes_total`, counted by the executor.
    pub act: Counters,
    /// `gpubudget_nvml_errors_total`.
    pub nvml_errors: Family<CallLabels, Counter>,
    /// `gpubudget_unattributed_bytes`.
    pub unattributed: Family<GpuLabels, Gauge>,
    /// `gpubudget_unbudgeted_bytes`.
    pub unbudgeted: Family<GpuLabels, Gauge>,
    /// `gpubudget_gpu_free_bytes`.
    pub gpu_free: Family<GpuLabels, Gauge>,
    /// `gpubudget_gpu_memory_pressure`.
    pub gpu_pressure: Family<GpuLabels, Gauge>,
    /// `gpubudget_gpu_sampled`.
    pub gpu_sampled: Family<GpuLabels, Gauge>,
    /// `gpubudget_gpu_unaccounted_bytes`.
    pub gpu_unaccounted: Family<GpuLabels, Gauge>,
    /// `gpubudget_gpu_processes_unavailable`.
    pub gpu_unavailable: Family<GpuLabels, Gauge>,
    /// `gpubudget_gpu_memory_total_bytes`.
    pub gpu_total: Family<GpuLabels, Gauge>,
    /// `gpubudget_gpu_budgeted_bytes`.
    pub gpu_budgeted: Family<GpuLabels, Gauge>,
    /// `gpubudget_sample_duration_seconds`.
    pub sample_duration: Histogram,
    /// `gpubudget_pod_table_rebuilds_total`.
    pub table_rebuilds: Counter,
    /// `gpubudget_sample_interval_seconds`.
    pub sample_interval: Gauge<f64, std::sync::atomic::AtomicU64>,
    /// `gpubudget_driver_limits_available`.
    pub driver_limits_available: Gauge,
    /// `gpubudget_pods_cap_not_in_force`.
    pub caps_not_in_force: Gauge,
    /// `gpubudget_driver_limits_applied_total`.
    pub driver_applied: Family<DriverLimitsLabels, Counter>,
    /// `gpubudget_pod_driver_hard_limit_bytes`.
    pub pod_driver_hard: Family<PodLabels, Gauge>,
    /// `gpubudget_pod_driver_soft_limit_bytes`.
    pub pod_driver_soft: Family<PodLabels, Gauge>,
    /// `gpubudget_budget_spec_reads_total`.
    pub spec_reads: Family<SpecReadLabels, Counter>,
    /// `gpubudget_budget_specs_from_mirrors{kind}`.
    pub specs_from_mirrors: Family<KindLabels, Gauge>,
    /// `gpubudget_runtime_caps_*` (`--runtime-caps`).
    pub runtime: crate::runtime_caps::RuntimeMetrics,
}

/// `{kind}`: `GpuMemoryBudget` or `ClusterGpuMemoryBudget`.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct KindLabels {
    /// The budget kind.
    pub kind: crate::attribute::kube::BudgetKind,
}

impl Metrics {
    /// Creates the families and registers them.
    pub fn new(registry: &mut Registry) -> Self {
        let buckets = [0.000_05, 0.000_1, 0.000_25, 0.000_5, 0.001, 0.002_5, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25];
        let m = Self {
            pod_memory: Family::default(),
            pod_budget: Family::default(),
            pod_state: Family::default(),
            act: Counters::default(),
            nvml_errors: Family::default(),
            unattributed: Family::default(),
            unbudgeted: Family::default(),
            gpu_free: Family::default(),
            gpu_pressure: Family::default(),
            gpu_sampled: Family::default(),
            gpu_unaccounted: Family::default(),
            gpu_unavailable: Family::default(),
            gpu_total: Family::default(),
            gpu_budgeted: Family::default(),
            sample_duration: Histogram::new(buckets),
            table_rebuilds: Counter::default(),
            sample_interval: Gauge::default(),
            driver_limits_available: Gauge::default(),
            caps_not_in_force: Gauge::default(),
            driver_applied: Family::default(),
            pod_driver_hard: Family::default(),
            pod_driver_soft: Family::default(),
            spec_reads: Family::default(),
            specs_from_mirrors: Family::default(),
            runtime: Default::default(),
        };
        registry.register(
            "gpubudget_runtime_caps_containers",
            "Containers the container runtime asked the agent about at creation (--runtime-caps), by outcome: not_gpu, no_budget, caps_off (the budget has no admissionCaps), capped, devices_unknown (no MPS cap: the device count is unknown), unresolved_created, unresolved_refused (the pod's budget not known within --runtime-caps-wait)",
            m.runtime.containers.clone(),
        );
        registry.register(
            "gpubudget_runtime_caps_seconds",
            "Time the agent took to answer the runtime's CreateContainer (--runtime-caps), waiting for an unknown pod's budget included",
            m.runtime.seconds.clone(),
        );
        registry.register(
            "gpubudget_runtime_caps_registrations",
            "Registrations with the container runtime's NRI socket (--runtime-caps): one per connection, so more than one means the runtime or the connection restarted",
            m.runtime.registrations.clone(),
        );
        registry.register(
            "gpubudget_budget_specs_from_mirrors",
            "1 while the agent reads a budget kind's specs from the operator's mirrors only (every budget mirrored: status writes no longer reach it), 0 while it watches the budgets themselves",
            m.specs_from_mirrors.clone(),
        );
        registry.register(
            "gpubudget_budget_spec_reads",
            "Reads of budgets' objects (kind get, or list for a page of a full list), by result: the agent watches budgets' metadata only and reads a budget when its spec's generation moves, never for a status write",
            m.spec_reads.clone(),
        );
        registry.register(
            "gpubudget_pod_driver_hard_limit_bytes",
            "The NVIDIA driver's hard GPU memory limits on a pod's container cgroups, summed over its (container, GPU) pairs, when every pair has one (driver R615 or newer; bytes)",
            m.pod_driver_hard.clone(),
        );
        registry.register(
            "gpubudget_pod_driver_soft_limit_bytes",
            "The NVIDIA driver's soft GPU memory limits on a pod's container cgroups, summed over its (container, GPU) pairs, when every pair has one (driver R615 or newer; bytes)",
            m.pod_driver_soft.clone(),
        );
        registry.register(
            "gpubudget_driver_limits_applied",
            "Per-cgroup driver limits the agent set with --apply-driver-limits (result: applied, read back at most as asked; failed, refused by the driver or not held)",
            m.driver_applied.clone(),
        );
        registry.register(
            "gpubudget_pods_cap_not_in_force",
            "Pods on this node whose GPU containers carry an MPS cap that the agent saw is not in force: a process that is no client of the GPU's MPS server, or one holding more than its cap (the GpuMemoryCapNotInForce event and the pod's gpubudget.io/cap-not-in-force say which)",
            m.caps_not_in_force.clone(),
        );
        registry.register(
            "gpubudget_driver_limits_available",
            "1 when this node's NVML has the driver's per-cgroup GPU memory limits (nvmlDeviceGetMemoryLimits_v1, driver R615 or newer), 0 when it has not (eviction only); checked at the agent's start",
            m.driver_limits_available.clone(),
        );
        registry.register(
            "gpubudget_pod_table_rebuilds",
            "Rebuilds of the agent's table of its pods and their budgets: on changes of its pods, and of budgets' specs (not of their status)",
            m.table_rebuilds.clone(),
        );
        registry.register(
            "gpubudget_pod_gpu_memory_bytes",
            "GPU memory a pod's container holds on a GPU, as NVML reports it (bytes)",
            m.pod_memory.clone(),
        );
        registry.register(
            "gpubudget_pod_budget_bytes",
            "The limit of the budget that applies to the pod (bytes)",
            m.pod_budget.clone(),
        );
        registry.register(
            "gpubudget_pod_state",
            "Where the pod stands against its budget: 1 for its current state",
            m.pod_state.clone(),
        );
        registry.register(
            "gpubudget_evictions",
            "Eviction requests, by result (accepted, blocked, gone, error)",
            m.act.evictions.clone(),
        );
        registry.register(
            "gpubudget_would_evict",
            "Observe mode: evictions the agent would have requested and did not, by cause (budget, pressure) and the \
             level that set the mode (agent, node, budget)",
            m.act.would_evict.clone(),
        );
        registry.register(
            "gpubudget_evictions_without_record",
            "Eviction requests sent before the API accepted their Evicting record (the bounded wait ran out)",
            m.act.evictions_without_record.clone(),
        );
        registry.register(
            "gpubudget_api_writes",
            "Writes to the API server, by kind (apply, clear, event, evict, delete, usage) and result",
            m.act.api_writes.clone(),
        );
        registry.register(
            "gpubudget_nvml_errors",
            "Failed NVML calls (or sample-file reads), by call",
            m.nvml_errors.clone(),
        );
        registry.register(
            "gpubudget_gpu_free_bytes",
            "Free memory of a GPU as the device reports it (bytes)",
            m.gpu_free.clone(),
        );
        registry.register(
            "gpubudget_gpu_memory_pressure",
            "1 while a GPU is under memory pressure (free memory under the agent's threshold), else 0",
            m.gpu_pressure.clone(),
        );
        registry.register(
            "gpubudget_gpu_sampled",
            "1 while a GPU is sampled and enforced, 0 while its sample fails (retried with backoff; nothing is decided from it)",
            m.gpu_sampled.clone(),
        );
        registry.register(
            "gpubudget_gpu_unaccounted_bytes",
            "A GPU's used memory (as the device reports it) that no listed process accounts for: the driver's allocations, an MPS server's share, processes the agent cannot see, unavailable figures (bytes)",
            m.gpu_unaccounted.clone(),
        );
        registry.register(
            "gpubudget_gpu_processes_unavailable",
            "Processes on a GPU whose memory NVML reports as unavailable (never charged to a budget)",
            m.gpu_unavailable.clone(),
        );
        registry.register(
            "gpubudget_gpu_memory_total_bytes",
            "Total memory of a GPU as the device reports it (bytes)",
            m.gpu_total.clone(),
        );
        registry.register(
            "gpubudget_gpu_budgeted_bytes",
            "The budget limits of the pods holding memory on a GPU, added up (a pod on several GPUs counts its whole limit on each): above the GPU's total, the budgets overcommit it (bytes)",
            m.gpu_budgeted.clone(),
        );
        registry.register(
            "gpubudget_unattributed_bytes",
            "GPU memory of processes in no known pod, per GPU (bytes)",
            m.unattributed.clone(),
        );
        registry.register(
            "gpubudget_unbudgeted_bytes",
            "GPU memory of known pods on this node that no budget selects, per GPU (bytes): under pressure they are ranked by the agent's --unbudgeted-pods policy",
            m.unbudgeted.clone(),
        );
        registry.register(
            "gpubudget_sample_duration_seconds",
            "Time to sample, attribute and decide, per tick",
            m.sample_duration.clone(),
        );
        registry.register(
            "gpubudget_sample_interval_seconds",
            "Time from the last sample to the next: the --interval, or the shorter --interval-near while a pod or a GPU is close to a threshold",
            m.sample_interval.clone(),
        );
        m
    }

    /// Counts one set of `--apply-driver-limits`.
    pub fn driver_limits_applied(&self, result: DriverLimitsResult) {
        self.driver_applied.get_or_create(&DriverLimitsLabels { result }).inc();
    }

    /// Counts one failed call.
    pub fn nvml_error(&self, call: crate::sample::Call) {
        self.nvml_errors.get_or_create(&CallLabels { call }).inc();
    }
}

/// Per GPU (snapshot index): the budget limits of the pods holding memory on it, added up. A pod on several
/// GPUs counts its whole limit on each (its budget does not say how it splits).
fn budgeted_per_gpu(gpus: usize, table: &PodTable, usage: &Usage) -> Vec<u64> {
    let mut sums = vec![0_u64; gpus];
    for (i, pod_usage) in usage.pods.iter().enumerate() {
        let Some(budget) = table.budget(i) else { continue };
        for (g, sum) in sums.iter_mut().enumerate() {
            if pod_usage.holders.iter().any(|h| h.gpu == g && h.bytes > 0) {
                *sum = sum.saturating_add(budget.limit_bytes);
            }
        }
    }
    sums
}

/// The per-pod series of the driver's limits: one pair of gauges per pod the driver caps, removed when the pod
/// goes or is no longer capped (as many series as pods with limits, like `gpubudget_pod_budget_bytes`).
#[derive(Debug, Default)]
pub struct DriverSeries {
    pods: HashMap<Arc<str>, (PodLabels, Option<u64>, Option<u64>)>,
}

impl DriverSeries {
    /// Publishes `views` (indexed like `table.pods`).
    pub fn update(
        &mut self,
        metrics: &Metrics,
        table: &PodTable,
        views: &[Option<crate::attribute::driver_limits::DriverView>],
    ) {
        let gauge = |bytes: u64| i64::try_from(bytes).unwrap_or(i64::MAX);
        let mut now: HashMap<Arc<str>, (Option<u64>, Option<u64>)> = HashMap::new();
        for (view, pod) in views.iter().zip(&table.pods) {
            let Some(v) = view else { continue };
            let (hard, soft) = (v.hard(), v.soft());
            if hard.is_some() || soft.is_some() {
                now.insert(pod.uid.clone(), (hard, soft));
            }
        }
        self.pods.retain(|uid, (labels, hard, soft)| {
            let (new_hard, new_soft) = now.get(uid).copied().unwrap_or((None, None));
            if new_hard.is_none() && hard.is_some() {
                metrics.pod_driver_hard.remove(labels);
            }
            if new_soft.is_none() && soft.is_some() {
                metrics.pod_driver_soft.remove(labels);
            }
            (*hard, *soft) = (new_hard, new_soft);
            new_hard.is_some() || new_soft.is_some()
        });
        for (uid, (hard, soft)) in now {
            let Some(i) = table.find_uid(&uid) else { continue };
            let pod = &table.pods[i];
            let entry = self.pods.entry(uid).or_insert_with(|| {
                (PodLabels { namespace: pod.namespace.to_string(), pod: pod.name.to_string() }, hard, soft)
            });
            if let Some(h) = hard {
                metrics.pod_driver_hard.get_or_create(&entry.0).set(gauge(h));
            }
            if let Some(s) = soft {
                metrics.pod_driver_soft.get_or_create(&entry.0).set(gauge(s));
            }
        }
    }
}

type SeriesKey = (Arc<str>, Option<Arc<str>>, usize);

#[derive(Debug)]
struct PodSeries {
    budget: BudgetLabels,
    budget_gauge: Gauge,
    states: [StateLabels; 4],
    state_gauges: [Gauge; 4],
    /// The state and limit the gauges hold (set only when they change: a steady tick writes no gauge).
    shown: Option<(BudgetState, u64)>,
    seen: u64,
}

/// One container's memory on one GPU.
#[derive(Debug)]
struct MemorySeries {
    labels: ContainerLabels,
    gauge: Gauge,
    /// The bytes the gauge holds.
    shown: Option<u64>,
    seen: u64,
}

/// One GPU's series.
#[derive(Debug)]
struct GpuSeries {
    labels: GpuLabels,
    unattributed: Gauge,
    unbudgeted: Gauge,
    free: Gauge,
    pressure: Gauge,
    sampled: Gauge,
    unaccounted: Gauge,
    unavailable: Gauge,
    total: Gauge,
    budgeted: Gauge,
    /// The failure count last seen, to count each failed attempt once in `gpubudget_nvml_errors`.
    failures: u32,
}

/// Keeps the per-pod series in step with the pods, removing those of pods that are gone.
#[derive(Debug, Default)]
pub struct SeriesTracker {
    memory: FastMap<SeriesKey, MemorySeries>,
    sums: FastMap<SeriesKey, u64>,
    pods: FastMap<Arc<str>, PodSeries>,
    gpus: Vec<GpuSeries>,
    generation: u64,
}

const STATES: [BudgetState; 4] = [BudgetState::Within, BudgetState::Near, BudgetState::Over, BudgetState::Evicting];

impl SeriesTracker {
    /// Publishes this tick. `state_of` gives a pod's state (for pods with a budget), `under_pressure`
    /// whether a GPU (snapshot index) is under memory pressure.
    pub fn update(
        &mut self,
        metrics: &Metrics,
        snapshot: &Snapshot,
        table: &PodTable,
        usage: &Usage,
        state_of: impl Fn(&str) -> Option<BudgetState>,
        under_pressure: impl Fn(usize) -> bool,
    ) {
        self.generation += 1;
        let generation = self.generation;

        // GPU list changed: drop every per-GPU series.
        if self.gpus.len() != snapshot.gpus.len()
            || self.gpus.iter().zip(&snapshot.gpus).any(|(s, g)| s.labels.gpu != g.label)
        {
            for s in self.gpus.drain(..) {
                metrics.unattributed.remove(&s.labels);
                metrics.unbudgeted.remove(&s.labels);
                metrics.gpu_free.remove(&s.labels);
                metrics.gpu_pressure.remove(&s.labels);
                metrics.gpu_sampled.remove(&s.labels);
                metrics.gpu_unaccounted.remove(&s.labels);
                metrics.gpu_unavailable.remove(&s.labels);
                metrics.gpu_total.remove(&s.labels);
                metrics.gpu_budgeted.remove(&s.labels);
            }
            for (_, series) in self.memory.drain() {
                metrics.pod_memory.remove(&series.labels);
            }
            self.gpus = snapshot
                .gpus
                .iter()
                .map(|g| {
                    let labels = GpuLabels { gpu: g.label.clone() };
                    GpuSeries {
                        unattributed: metrics.unattributed.get_or_create(&labels).clone(),
                        unbudgeted: metrics.unbudgeted.get_or_create(&labels).clone(),
                        free: metrics.gpu_free.get_or_create(&labels).clone(),
                        pressure: metrics.gpu_pressure.get_or_create(&labels).clone(),
                        sampled: metrics.gpu_sampled.get_or_create(&labels).clone(),
                        unaccounted: metrics.gpu_unaccounted.get_or_create(&labels).clone(),
                        unavailable: metrics.gpu_unavailable.get_or_create(&labels).clone(),
                        total: metrics.gpu_total.get_or_create(&labels).clone(),
                        budgeted: metrics.gpu_budgeted.get_or_create(&labels).clone(),
                        failures: 0,
                        labels,
                    }
                })
                .collect();
        }
        let gauge = |bytes: u64| i64::try_from(bytes).unwrap_or(i64::MAX);
        let budgeted = budgeted_per_gpu(self.gpus.len(), table, usage);
        for (g, series) in self.gpus.iter_mut().enumerate() {
            series.unattributed.set(gauge(usage.unattributed.get(g).copied().unwrap_or(0)));
            series.unbudgeted.set(gauge(usage.unbudgeted.get(g).copied().unwrap_or(0)));
            if let Some(memory) = snapshot.memory(g) {
                series.free.set(gauge(memory.free));
            }
            if let Some(info) = snapshot.gpus.get(g) {
                series.total.set(gauge(info.total_bytes));
            }
            series.budgeted.set(gauge(budgeted[g]));
            series.pressure.set(i64::from(under_pressure(g)));
            let Some(reading) = snapshot.readings.get(g) else { continue };
            series.sampled.set(i64::from(reading.health.sampled()));
            series.unavailable.set(i64::from(reading.unavailable));
            if let Some(Some(bytes)) = usage.unaccounted.get(g) {
                series.unaccounted.set(gauge(*bytes));
            }
            match &reading.health {
                GpuHealth::Failed { error, failures } => {
                    if *failures > series.failures {
                        metrics.nvml_error(error.call);
                    }
                    series.failures = *failures;
                }
                GpuHealth::Sampled => series.failures = 0,
            }
        }

        self.sums.clear();
        for (i, pod_usage) in usage.pods.iter().enumerate() {
            let Some(view) = table.pods.get(i) else { continue };
            for h in &pod_usage.holders {
                *self.sums.entry((view.uid.clone(), h.container.clone(), h.gpu)).or_insert(0) += h.bytes;
            }
        }
        for (key, bytes) in &self.sums {
            let entry = self.memory.entry(key.clone()).or_insert_with(|| {
                let view = table.find_uid(&key.0).map(|i| &table.pods[i]);
                let labels = ContainerLabels {
                    namespace: view.map(|v| v.namespace.to_string()).unwrap_or_default(),
                    pod: view.map(|v| v.name.to_string()).unwrap_or_default(),
                    container: key.1.as_deref().unwrap_or_default().to_owned(),
                    gpu: snapshot.gpus.get(key.2).map(|g| g.label.clone()).unwrap_or_default(),
                };
                let gauge = metrics.pod_memory.get_or_create(&labels).clone();
                MemorySeries { labels, gauge, shown: None, seen: 0 }
            });
            entry.seen = generation;
            if entry.shown != Some(*bytes) {
                entry.shown = Some(*bytes);
                entry.gauge.set(i64::try_from(*bytes).unwrap_or(i64::MAX));
            }
        }
        self.memory.retain(|_, series| {
            let keep = series.seen == generation;
            if !keep {
                metrics.pod_memory.remove(&series.labels);
            }
            keep
        });

        for (i, view) in table.pods.iter().enumerate() {
            let (Some(budget), Some(state)) = (table.budget(i), state_of(&view.uid)) else { continue };
            let series = self.pods.entry(view.uid.clone()).or_insert_with(|| {
                let state = |s: BudgetState| StateLabels {
                    namespace: view.namespace.to_string(),
                    pod: view.name.to_string(),
                    state: StateLabel(s),
                };
                let budget_labels = BudgetLabels {
                    namespace: view.namespace.to_string(),
                    pod: view.name.to_string(),
                    budget: budget.name.clone(),
                };
                let states = STATES.map(state);
                PodSeries {
                    budget_gauge: metrics.pod_budget.get_or_create(&budget_labels).clone(),
                    budget: budget_labels,
                    state_gauges: std::array::from_fn(|k| metrics.pod_state.get_or_create(&states[k]).clone()),
                    states,
                    shown: None,
                    seen: 0,
                }
            });
            if series.budget.budget != budget.name {
                metrics.pod_budget.remove(&series.budget);
                series.budget.budget.clone_from(&budget.name);
                series.budget_gauge = metrics.pod_budget.get_or_create(&series.budget).clone();
                series.shown = None;
            }
            series.seen = generation;
            if series.shown != Some((state, budget.limit_bytes)) {
                series.shown = Some((state, budget.limit_bytes));
                series.budget_gauge.set(i64::try_from(budget.limit_bytes).unwrap_or(i64::MAX));
                for (gauge, s) in series.state_gauges.iter().zip(STATES) {
                    gauge.set(i64::from(s == state));
                }
            }
        }
        self.pods.retain(|_, series| {
            let keep = series.seen == generation;
            if !keep {
                metrics.pod_budget.remove(&series.budget);
                for labels in &series.states {
                    metrics.pod_state.remove(labels);
                }
            }
            keep
        });
    }
}
