//! The decisions' tunables ([`Settings`]) and the time a tick is decided at ([`Now`]).

use super::{cadence, gpus, pressure};

/// Tunables (the defaults are the write budget).
#[derive(Debug, Clone)]
pub struct Settings {
    /// This node's name (records carry it; pods of other nodes are never acted on).
    pub node: String,
    /// Usage is rewritten only when it moved by at least this percentage of the last written value.
    pub usage_change_percent: u64,
    /// … and at most this often per pod.
    pub usage_min_interval_ms: u64,
    /// A move among Within, Near and Over is written at most this soon after the pod's last write (an
    /// `Evicting` record, a new budget or eviction time are written at once).
    pub state_min_interval_ms: u64,
    /// A reason is not repeated for a pod within this.
    pub event_cooldown_ms: u64,
    /// First retry delay after a refused eviction (doubles up to `evict_backoff_max_ms`).
    pub evict_backoff_min_ms: u64,
    /// Longest retry delay for an eviction.
    pub evict_backoff_max_ms: u64,
    /// First retry delay after a failed write (doubles up to `usage_min_interval_ms`).
    pub write_backoff_min_ms: u64,
    /// The GPU memory pressure signal ([`pressure`]); off: budgets alone.
    pub pressure: pressure::PressureSettings,
    /// What pressure does to pods no budget selects ([`pressure::Unbudgeted`]); by default they are ranked as
    /// guaranteed nothing, so a namespace without a budget cannot fill a GPU at a budgeted neighbour's cost.
    pub unbudgeted_pods: pressure::Unbudgeted,
    /// Termination grace of a pressure eviction, seconds; a budget's `evictionGracePeriodSeconds` caps it.
    pub pressure_grace_seconds: i64,
    /// When memory no process accounts for is told on the Node ([`gpus`]).
    pub accounting: gpus::AccountingSettings,
    /// The eviction waits for its `Evicting` record at most this many failed writes …
    pub record_wait_attempts: u32,
    /// … and at most this long after it became due; then it goes ahead without the record (an event says
    /// so), and the record is retried while the pod terminates. A write the tenant can break (annotations
    /// filling the 256 KiB limit, a webhook refusing the update) cannot hold the eviction back.
    pub record_wait_ms: u64,
    /// How often the agent samples: relaxed, and fast while something is close to a threshold ([`cadence`]).
    pub cadence: cadence::Cadence,
    /// The namespaces whose critical-priority pods are never evicted (#33; `--critical-namespaces`).
    pub critical_namespaces: gpubudget_common::CriticalNamespaces,
    /// A pressure eviction refused (a PodDisruptionBudget) for this long deletes the pod with its grace, as
    /// the kubelet's node-pressure eviction does, for pods without a budget and budgets without their own
    /// `blockedEvictionTimeoutSeconds` (#33; `--pressure-blocked-timeout`).
    pub pressure_blocked_timeout_ms: u64,
    /// Who writes namespaced budgets, so what they may guarantee under pressure (#33; `--namespaced-budgets`).
    pub namespaced_budgets: pressure::NamespacedBudgets,
    /// Whether evictions are carried out or only reported, where neither the Node's label nor a budget says
    /// (#54; `--enforcement`; [`gpubudget_common::enforcement`]).
    pub enforcement: gpubudget_common::Enforcement,
}

impl Settings {
    /// The defaults for a node.
    pub fn new(node: impl Into<String>) -> Self {
        Self {
            node: node.into(),
            usage_change_percent: 5,
            usage_min_interval_ms: 30_000,
            state_min_interval_ms: 5_000,
            event_cooldown_ms: 60_000,
            evict_backoff_min_ms: 5_000,
            evict_backoff_max_ms: 60_000,
            write_backoff_min_ms: 1_000,
            pressure: pressure::PressureSettings::OFF,
            unbudgeted_pods: pressure::Unbudgeted::Ranked,
            pressure_grace_seconds: 5,
            accounting: gpus::AccountingSettings::DEFAULT,
            record_wait_attempts: 3,
            record_wait_ms: 30_000,
            cadence: cadence::Cadence::DEFAULT,
            critical_namespaces: gpubudget_common::CriticalNamespaces::default(),
            pressure_blocked_timeout_ms: 60_000,
            namespaced_budgets: pressure::NamespacedBudgets::Trusted,
            enforcement: gpubudget_common::Enforcement::Enforce,
        }
    }
}

/// The time of a tick: a monotonic clock for rules, wall time for records.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Now {
    /// Monotonic milliseconds (since the agent started).
    pub mono_ms: u64,
    /// Wall-clock time.
    pub wall: jiff::Timestamp,
}
