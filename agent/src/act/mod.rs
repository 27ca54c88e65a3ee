//! Stage 4: carrying decisions out. [`kube`] against the API server (records by server-side apply,
//! events, evictions); [`usage`] the node's `GpuNodeUsage`; [`log`] as JSON lines (the `standalone` subcommand);
//! [`denied`] what the API server refuses for good, told on the Node. Caps written into containers as the runtime
//! makes them are a room of their own: [`crate::runtime_caps`].

pub mod denied;
pub mod kube;
pub mod log;
pub mod usage;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;

/// The `result` of an eviction request (`gpubudget_evictions_total`).
#[derive(Debug, Clone, Copy, Hash, PartialEq, Eq)]
pub enum EvictionResult {
    /// `accepted`.
    Accepted,
    /// `blocked`: refused for now (HTTP 429, a PodDisruptionBudget).
    Blocked,
    /// `gone`: the pod was gone.
    Gone,
    /// `error`.
    Error,
}

impl EvictionResult {
    /// The label value.
    pub fn as_str(self) -> &'static str {
        match self {
            EvictionResult::Accepted => "accepted",
            EvictionResult::Blocked => "blocked",
            EvictionResult::Gone => "gone",
            EvictionResult::Error => "error",
        }
    }
}

/// The `kind` of an API write (`gpubudget_api_writes_total`).
#[derive(Debug, Clone, Copy, Hash, PartialEq, Eq)]
pub enum WriteKind {
    /// `apply`: a pod's record.
    Apply,
    /// `clear`: a pod's record removed.
    Clear,
    /// `event`.
    Event,
    /// `evict`.
    Evict,
    /// `delete`: a pod deleted after refused evictions.
    Delete,
    /// `usage`: the node's `GpuNodeUsage`.
    Usage,
}

impl WriteKind {
    /// The label value.
    pub fn as_str(self) -> &'static str {
        match self {
            WriteKind::Apply => "apply",
            WriteKind::Clear => "clear",
            WriteKind::Event => "event",
            WriteKind::Evict => "evict",
            WriteKind::Delete => "delete",
            WriteKind::Usage => "usage",
        }
    }
}

/// The `result` of an API write (`gpubudget_api_writes_total`).
#[derive(Debug, Clone, Copy, Hash, PartialEq, Eq)]
pub enum WriteResult {
    /// `ok`.
    Ok,
    /// `blocked`: an eviction refused for now.
    Blocked,
    /// `denied`: refused for good (an admission policy, RBAC; [`denied`]).
    Denied,
    /// `error`.
    Error,
}

impl WriteResult {
    /// The label value.
    pub fn as_str(self) -> &'static str {
        match self {
            WriteResult::Ok => "ok",
            WriteResult::Blocked => "blocked",
            WriteResult::Denied => "denied",
            WriteResult::Error => "error",
        }
    }
}

/// The `set_by` of an eviction observe mode held back: the level that set the mode
/// ([`gpubudget_common::enforcement::Level`]).
#[derive(Debug, Clone, Copy, Hash, PartialEq, Eq)]
pub struct SetByLabel(pub gpubudget_common::enforcement::Level);

impl SetByLabel {
    /// The label value.
    pub fn as_str(self) -> &'static str {
        self.0.as_str()
    }
}

gpubudget_daemon::label_values!(EvictionResult, WriteKind, WriteResult, crate::decide::EvictCause, SetByLabel);

/// `{result}` of an eviction request.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ResultLabels {
    /// `accepted`, `blocked`, `gone`, `error`.
    pub result: EvictionResult,
}

/// `{cause, set_by}` of an eviction observe mode held back (#54).
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct WouldEvictLabels {
    /// `budget` (over its own limit) or `pressure`.
    pub cause: crate::decide::EvictCause,
    /// The level that set observe mode: `agent`, `node` or `budget`.
    pub set_by: SetByLabel,
}

/// `{kind, result}` of an API write.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct WriteLabels {
    /// `apply`, `clear`, `event`, `evict`, `delete`, `usage` (the node's `GpuNodeUsage`).
    pub kind: WriteKind,
    /// `ok`, `blocked`, `denied` (refused for good: an admission policy, RBAC; [`denied`]), `error`.
    pub result: WriteResult,
}

/// `{kind, result}` of a budget spec read (`gpubudget_budget_spec_reads_total`).
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct SpecReadLabels {
    /// `get` or `list`.
    pub kind: crate::attribute::kube::ReadKind,
    /// `ok` or `error`.
    pub result: crate::attribute::kube::ReadResult,
}

/// What the executors count (cheap to clone: the families are shared). [`crate::report::metrics`]
/// registers them.
#[derive(Debug, Clone, Default)]
pub struct Counters {
    /// Eviction requests by result.
    pub evictions: Family<ResultLabels, Counter>,
    /// API writes by kind and result.
    pub api_writes: Family<WriteLabels, Counter>,
    /// Eviction requests sent before their `Evicting` record landed (the wait for it ran out).
    pub evictions_without_record: Counter,
    /// Evictions observe mode held back (#54): none of them was requested.
    pub would_evict: Family<WouldEvictLabels, Counter>,
}

impl Counters {
    /// Counts one API write.
    pub fn write(&self, kind: WriteKind, result: WriteResult) {
        self.api_writes.get_or_create(&WriteLabels { kind, result }).inc();
    }

    /// Counts one eviction observe mode held back (nothing was requested).
    pub fn would_evict(&self, cause: crate::decide::EvictCause, set_by: gpubudget_common::enforcement::Level) {
        self.would_evict.get_or_create(&WouldEvictLabels { cause, set_by: SetByLabel(set_by) }).inc();
    }

    /// Counts one eviction request.
    pub fn eviction(&self, result: EvictionResult) {
        self.evictions.get_or_create(&ResultLabels { result }).inc();
    }
}

/// The annotations an [`Action::Apply`](crate::decide::Action::Apply) writes: the record's, and
/// `gpubudget.io/driver-limits` when the driver's limits are known.
pub fn annotations(
    record: &gpubudget_common::pod_record::PodRecord,
    driver: Option<&gpubudget_common::pod_record::DriverLimitsRecord>,
) -> std::collections::BTreeMap<String, String> {
    let mut out = record.to_annotations();
    if let Some(driver) = driver {
        out.insert(gpubudget_common::pod_record::DRIVER_LIMITS.to_owned(), driver.to_annotation());
    }
    out
}

#[cfg(test)]
mod tests {
    use gpubudget_common::BudgetState;
    use gpubudget_common::pod_record::{DRIVER_LIMITS, DriverLimitsRecord, PodRecord};

    #[test]
    fn the_driver_limits_ride_in_the_records_apply_when_known() {
        let record = PodRecord {
            state: BudgetState::Within,
            usage_bytes: 1,
            budget: "llm".into(),
            node: "n1".into(),
            eviction_requested_at: None,
            cap_not_in_force: None,
            share: None,
            runtime_caps: None,
        };
        assert_eq!(super::annotations(&record, None), record.to_annotations());
        let driver =
            DriverLimitsRecord { pairs: 1, capped: 1, hard_bytes: Some(8 << 30), ..DriverLimitsRecord::default() };
        let with = super::annotations(&record, Some(&driver));
        assert_eq!(with.len(), record.to_annotations().len() + 1);
        assert_eq!(DriverLimitsRecord::from_annotation(&with[DRIVER_LIMITS]), Some(driver));
    }
}
