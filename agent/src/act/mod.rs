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

/// `{result}` of an eviction request.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ResultLabels {
    /// `accepted`, `blocked`, `gone`, `error`.
    pub result: String,
}

/// `{cause, set_by}` of an eviction observe mode held back (#54).
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct WouldEvictLabels {
    /// `budget` (over its own limit) or `pressure`.
    pub cause: String,
    /// The level that set observe mode: `agent`, `node` or `budget`.
    pub set_by: String,
}

/// `{kind, result}` of an API write.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct WriteLabels {
    /// `apply`, `clear`, `event`, `evict`, `delete`, `usage` (the node's `GpuNodeUsage`).
    pub kind: String,
    /// `ok`, `blocked`, `denied` (refused for good: an admission policy, RBAC; [`denied`]), `error`.
    pub result: String,
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
    pub fn write(&self, kind: &str, result: &str) {
        self.api_writes.get_or_create(&WriteLabels { kind: kind.to_owned(), result: result.to_owned() }).inc();
    }

    /// Counts one eviction observe mode held back (nothing was requested).
    pub fn would_evict(&self, cause: &str, set_by: &str) {
        self.would_evict.get_or_create(&WouldEvictLabels { cause: cause.to_owned(), set_by: set_by.to_owned() }).inc();
    }

    /// Counts one eviction request.
    pub fn eviction(&self, result: &str) {
        self.evictions.get_or_create(&ResultLabels { result: result.to_owned() }).inc();
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
