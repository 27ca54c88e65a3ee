//! What `-o json` and `-o yaml` print: stable, versioned documents. Fields are only ever added (a new
//! optional field of the budget's spec, such as a future `request`, appears in `why`'s `budget.spec`
//! without a change here); a removal or a change of meaning would bump [`API_VERSION`].
//!
//! Sizes come twice: in bytes (`usageBytes`, `limitBytes`) for programs and human-readable (`usage`,
//! `limit`: `9Gi`, `7.5Gi`) for people. Times are RFC 3339.

use gpubudget_common::BudgetState;
use gpubudget_common::crd::EvictionRecord;
use serde::Serialize;

use crate::events::EventRow;

/// The `apiVersion` of every document the plugin prints.
pub const API_VERSION: &str = "kubectl-gpubudget.gpubudget.io/v1";

/// `kubectl gpubudget top -o json|yaml`.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct TopReport {
    /// [`API_VERSION`].
    pub api_version: &'static str,
    /// `GpuMemoryTop`.
    pub kind: &'static str,
    /// Pods with an agent's record, in the order asked for (`--sort-by`).
    pub pods: Vec<TopRow>,
    /// What could not be read (a resource RBAC does not allow) and what that leaves out.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub warnings: Vec<String>,
}

/// One pod in `top`: its agent's record, and the limit of the budget the record names.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct TopRow {
    pub namespace: String,
    pub name: String,
    /// The node whose agent wrote the record.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub node: Option<String>,
    /// `Within`, `Near`, `Over` or `Evicting`, as the agent recorded it.
    pub state: BudgetState,
    pub usage_bytes: u64,
    pub usage: String,
    /// The budget (same namespace) the agent applied.
    pub budget: String,
    /// That budget's limit; absent when the budget is gone, invalid or could not be read.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub limit_bytes: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub limit: Option<String>,
    /// Usage as a percentage of the limit (one decimal).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub percent: Option<f64>,
    /// When the agent asked for the pod's eviction.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub eviction_requested_at: Option<String>,
    /// How the pod's limit came from its declared share, as its node's agent recorded it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub share: Option<String>,
}

/// `kubectl gpubudget why POD -o json|yaml`.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct WhyReport {
    /// [`API_VERSION`].
    pub api_version: &'static str,
    /// `GpuMemoryWhy`.
    pub kind: &'static str,
    pub pod: PodInfo,
    /// The budget that applies (or, for a pod that is gone, the one that evicted it); absent when none does.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub budget: Option<BudgetInfo>,
    /// Why that budget: which budgets select the pod and how the overlap was resolved.
    pub why: String,
    /// Where the budget that applies takes shares (`spec.share`): the pod's limit from its declared share, as its
    /// node's agent resolved it (its record), or what the pod declares before any agent has recorded it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub share: Option<String>,
    /// Every budget in the namespace whose selector picks the pod, the one that applies first.
    pub matched: Vec<MatchedBudget>,
    /// The agent's record on the pod; absent when no agent has written one.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub record: Option<RecordInfo>,
    /// Since when the pod has been over its limit (from its events); absent when it is not over or the
    /// events that say so have expired.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub over_since: Option<String>,
    /// Seconds over the limit so far (`now - overSince`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub over_for_seconds: Option<i64>,
    /// GPU memory caps set in the pod spec at admission.
    pub admission: crate::admission::Admission,
    /// What happens next, and when.
    pub next: Next,
    /// The budget's `status.lastEviction` when it is this pod.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub last_eviction: Option<EvictionRecord>,
    /// The pod's last events (at most 10), oldest first, from every reporter.
    pub events: Vec<EventRow>,
    /// What could not be read and what that leaves out.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub warnings: Vec<String>,
}

/// The pod asked about.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct PodInfo {
    pub namespace: String,
    pub name: String,
    /// False when the pod is gone (evicted and deleted, say): the answer then comes from events and the
    /// budget's status.
    pub exists: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub uid: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub node: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub phase: Option<String>,
    /// When the API server will remove the pod (it is terminating).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub deletion_timestamp: Option<String>,
    /// Why the pod is never evicted (critical priority, static pod), if so.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub never_evicted: Option<String>,
}

/// The budget that applies.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct BudgetInfo {
    pub name: String,
    /// The budget's spec: as this plugin reads it (defaults filled in), with every field the API server
    /// returned on top, so a field newer than the plugin (a CRD upgraded first) is shown too.
    pub spec: serde_json::Value,
    /// `spec.limit` in bytes; absent when the budget could not be read.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub limit_bytes: Option<u64>,
    /// Why the spec cannot be enforced, when it cannot.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub invalid: Option<String>,
}

/// A budget whose selector picks the pod.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct MatchedBudget {
    pub name: String,
    pub limit: String,
    pub limit_bytes: u64,
    pub selector: String,
    /// True for the one that applies.
    pub applies: bool,
}

/// The agent's record, as written on the pod.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct RecordInfo {
    pub state: BudgetState,
    pub usage_bytes: u64,
    pub usage: String,
    pub budget: String,
    pub node: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub percent: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub eviction_requested_at: Option<String>,
    /// Why the pod's MPS cap is not in force, as its node's agent saw (`gpubudget.io/cap-not-in-force`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cap_not_in_force: Option<String>,
    /// The pod's own limit, where it comes from its declared share (`gpubudget.io/share`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub limit_bytes: Option<u64>,
    /// What the container runtime gave its GPU containers at creation (`gpubudget.io/runtime-caps`), in words.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub runtime_caps: Option<String>,
}

/// What happens next.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Next {
    /// One of `Nothing`, `Evict`, `WouldEvict` (observe mode, #54: the agent would evict it and does not),
    /// `Delete`, `Terminate`, `Gone`, `Unknown` (what the agent or the API server will do to the pod; `Nothing`
    /// includes a Warn budget's events).
    pub action: &'static str,
    /// When, at the earliest (RFC 3339), if known.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub at: Option<String>,
    /// The sentence `why` prints.
    pub message: String,
}
