//! The operator's Prometheus metrics (served on the admin port's `/metrics`).

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

/// The readiness checks as a gauge ([`gpubudget_daemon::Health::register`]): `gpubudget_operator_ready{check}`.
pub const READY_METRIC: &str = "gpubudget_operator_ready";

/// The `error` label of failures.
#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
pub struct ErrorLabels {
    /// [`crate::error::Error::metric_label`].
    pub error: crate::error::ErrorLabel,
}

/// Every metric the operator exports, all prefixed `gpubudget_operator_`.
#[derive(Debug, Clone)]
pub struct Metrics {
    /// Reconciles run (`_reconciles_total`).
    pub reconciles: Counter,
    /// Reconciles failed, by error (`_reconcile_failures_total{error}`).
    pub failures: Family<ErrorLabels, Counter>,
    /// Reconcile duration (`_reconcile_duration_seconds`).
    pub duration: Histogram,
    /// Budgets known (`_budgets`).
    pub budgets: Gauge,
    /// Budgets whose spec is invalid (`_budgets_invalid`).
    pub budgets_invalid: Gauge,
    /// Pods in the cache (`_pods`).
    pub pods: Gauge,
    /// Pods selected by at least one valid budget (`_matched_pods`).
    pub matched_pods: Gauge,
    /// Status writes (`_status_writes_total`).
    pub status_writes: Counter,
    /// Budget mirror writes, by result (`_mirror_writes_total{result}`: `written`, `failed`).
    pub mirror_writes: Family<MirrorWriteLabels, Counter>,
    /// Events published on budgets (`_events_total`).
    pub events: Counter,
    /// 1 while this replica writes status (the leader, or election off) (`_leader`).
    pub leader: Gauge,
    /// Requests the caps webhook answered, by result (`_caps_admissions_total{result}`).
    pub caps_admissions: Family<CapsResultLabels, Counter>,
    /// Namespace label writes of the caps webhook's scope (`_caps_namespace_label_writes_total`).
    pub namespace_label_writes: Counter,
    /// Eviction requests (and deletes after blockedEvictionTimeoutSeconds) sent for namespace totals
    /// (`_quota_eviction_requests_total`).
    pub quota_eviction_requests: Counter,
    /// Pods gone after a namespace total evicted them (`_quota_evictions_total`).
    pub quota_evictions: Counter,
    /// Evictions of namespace totals observe mode withheld, once per episode (`_quota_would_evict_total`).
    pub quota_would_evict: Counter,
    /// Namespaces over a ClusterGpuMemoryQuota now, summed over quotas (`_quota_namespaces_over`).
    pub quota_namespaces_over: Gauge,
}

/// The `result` label of the caps webhook's answers.
#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
pub struct CapsResultLabels {
    /// `capped`, `uncapped`, `skipped`, `failed` or `saturated` ([`crate::caps_webhook::Verdict::label`]).
    pub result: CapsResult,
}

/// What the caps webhook answered (`_caps_admissions_total{result}`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum CapsResult {
    /// `skipped`: not a pod's creation.
    Skipped,
    /// `uncapped`: no budget asks for caps.
    Uncapped,
    /// `capped`.
    Capped,
    /// `failed`.
    Failed,
    /// `saturated`: too many requests at once.
    Saturated,
}

impl CapsResult {
    /// The label value.
    pub fn as_str(self) -> &'static str {
        match self {
            CapsResult::Skipped => "skipped",
            CapsResult::Uncapped => "uncapped",
            CapsResult::Capped => "capped",
            CapsResult::Failed => "failed",
            CapsResult::Saturated => "saturated",
        }
    }
}

/// The `result` label of mirror writes.
#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
pub struct MirrorWriteLabels {
    /// `written` or `failed`.
    pub result: MirrorWrite,
}

/// How a mirror write ended (`_mirror_writes_total{result}`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum MirrorWrite {
    /// `written`.
    Written,
    /// `failed`.
    Failed,
}

impl MirrorWrite {
    /// The label value.
    pub fn as_str(self) -> &'static str {
        match self {
            MirrorWrite::Written => "written",
            MirrorWrite::Failed => "failed",
        }
    }
}

gpubudget_daemon::label_values!(CapsResult, MirrorWrite);

impl Default for Metrics {
    fn default() -> Self {
        Self {
            reconciles: Counter::default(),
            failures: Family::default(),
            duration: Histogram::new(exponential_buckets(0.000_25, 2.0, 16)),
            budgets: Gauge::default(),
            budgets_invalid: Gauge::default(),
            pods: Gauge::default(),
            matched_pods: Gauge::default(),
            status_writes: Counter::default(),
            mirror_writes: Family::default(),
            events: Counter::default(),
            leader: Gauge::default(),
            caps_admissions: Family::default(),
            namespace_label_writes: Counter::default(),
            quota_eviction_requests: Counter::default(),
            quota_evictions: Counter::default(),
            quota_would_evict: Counter::default(),
            quota_namespaces_over: Gauge::default(),
        }
    }
}

impl Metrics {
    /// Creates the metrics and registers them in `registry`.
    pub fn register(registry: &mut Registry) -> Self {
        let m = Self::default();
        let r = registry.sub_registry_with_prefix("gpubudget_operator");
        r.register("reconciles", "Budget reconciles run", m.reconciles.clone());
        r.register("reconcile_failures", "Budget reconciles that failed, by error", m.failures.clone());
        r.register("reconcile_duration_seconds", "Time one budget reconcile took", m.duration.clone());
        r.register("budgets", "GpuMemoryBudgets known", m.budgets.clone());
        r.register(
            "budgets_invalid",
            "GpuMemoryBudgets whose spec is invalid (Ready=False)",
            m.budgets_invalid.clone(),
        );
        r.register("pods", "Pods in the operator's metadata cache", m.pods.clone());
        r.register("matched_pods", "Pods selected by at least one valid budget", m.matched_pods.clone());
        r.register("status_writes", "GpuMemoryBudget status writes (server-side apply)", m.status_writes.clone());
        r.register(
            "mirror_writes",
            "Budget mirror writes (the spec copies agents read), by result (written, failed)",
            m.mirror_writes.clone(),
        );
        r.register("events", "Events published on budgets", m.events.clone());
        r.register("leader", "1 while this replica writes status (leader, or election off)", m.leader.clone());
        r.register(
            "caps_admissions",
            "Pod admissions the caps webhook answered, by result (capped, uncapped, skipped, failed, saturated)",
            m.caps_admissions.clone(),
        );
        r.register(
            "caps_namespace_label_writes",
            "Namespace label writes that scope the caps webhook",
            m.namespace_label_writes.clone(),
        );
        r.register(
            "quota_eviction_requests",
            "Eviction requests (and deletes after blockedEvictionTimeoutSeconds) sent for ClusterGpuMemoryQuota namespace totals",
            m.quota_eviction_requests.clone(),
        );
        r.register(
            "quota_evictions",
            "Pods gone after a ClusterGpuMemoryQuota evicted them",
            m.quota_evictions.clone(),
        );
        r.register(
            "quota_would_evict",
            "Evictions of ClusterGpuMemoryQuota namespace totals that observe mode withheld (told, not asked for)",
            m.quota_would_evict.clone(),
        );
        r.register(
            "quota_namespaces_over",
            "Namespaces over a ClusterGpuMemoryQuota now (summed over quotas)",
            m.quota_namespaces_over.clone(),
        );
        m
    }

    /// Counts an answer of the caps webhook.
    pub fn caps_admitted(&self, result: CapsResult) {
        self.caps_admissions.get_or_create(&CapsResultLabels { result }).inc();
    }

    /// Counts a mirror write.
    pub fn mirror_written(&self, result: MirrorWrite) {
        self.mirror_writes.get_or_create(&MirrorWriteLabels { result }).inc();
    }

    /// Counts a failed reconcile.
    pub fn failed(&self, error: crate::error::ErrorLabel) {
        self.failures.get_or_create(&ErrorLabels { error }).inc();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exports_the_names_the_docs_list() {
        let mut registry = Registry::default();
        let m = Metrics::register(&mut registry);
        m.reconciles.inc();
        m.failed(crate::error::ErrorLabel::Conflict);
        m.duration.observe(0.001);
        m.matched_pods.set(7);
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &registry).expect("encodes");
        for name in [
            "gpubudget_operator_reconciles_total 1",
            "gpubudget_operator_reconcile_failures_total{error=\"conflict\"} 1",
            "gpubudget_operator_reconcile_duration_seconds_count 1",
            "gpubudget_operator_matched_pods 7",
            "gpubudget_operator_status_writes_total 0",
            "gpubudget_operator_leader 0",
        ] {
            assert!(text.contains(name), "{name} missing from\n{text}");
        }
    }
}
