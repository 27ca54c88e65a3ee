//! What the agent records on a pod and the operator reads back: a few annotations, written by the
//! agent with server-side apply under the field manager [`agent_field_manager`] of its node.
//!
//! Annotations (not a status condition) because the operator watches pod metadata only, which keeps
//! its memory small at cluster scale, and `kubectl get pod -o yaml` shows them.

use std::collections::BTreeMap;

use crate::state::BudgetState;

/// `Within`, `Near`, `Over` or `Evicting`.
pub const STATE: &str = "gpubudget.io/state";
/// GPU memory the pod holds, in bytes (decimal integer).
pub const USAGE_BYTES: &str = "gpubudget.io/usage-bytes";
/// Name of the budget (same namespace) that applies to the pod.
pub const BUDGET: &str = "gpubudget.io/budget";
/// The node whose agent wrote the record.
pub const NODE: &str = "gpubudget.io/node";
/// When the agent requested the pod's eviction (RFC 3339); present only once it has.
pub const EVICTION_REQUESTED_AT: &str = "gpubudget.io/eviction-requested-at";

/// Every annotation key of the contract.
pub const ALL: [&str; 5] = [STATE, USAGE_BYTES, BUDGET, NODE, EVICTION_REQUESTED_AT];

/// The field manager an agent uses for everything it writes, one per node (as the kubelet does).
pub fn agent_field_manager(node: &str) -> String {
    format!("gpubudget-agent/{node}")
}

/// The agent's record of a pod, as carried in its annotations.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PodRecord {
    /// Where the pod stands.
    pub state: BudgetState,
    /// Bytes it holds.
    pub usage_bytes: u64,
    /// The budget that applies (name in the pod's namespace).
    pub budget: String,
    /// The node of the agent that wrote it.
    pub node: String,
    /// When eviction was requested, if it was.
    pub eviction_requested_at: Option<String>,
}

impl PodRecord {
    /// Reads a record from annotations; `None` when there is none or it is malformed.
    pub fn from_annotations(annotations: &BTreeMap<String, String>) -> Option<Self> {
        Some(Self {
            state: BudgetState::parse(annotations.get(STATE)?)?,
            usage_bytes: annotations.get(USAGE_BYTES)?.parse().ok()?,
            budget: annotations.get(BUDGET)?.clone(),
            node: annotations.get(NODE).cloned().unwrap_or_default(),
            eviction_requested_at: annotations.get(EVICTION_REQUESTED_AT).cloned(),
        })
    }

    /// The annotations that carry this record.
    pub fn to_annotations(&self) -> BTreeMap<String, String> {
        let mut out = BTreeMap::from([
            (STATE.to_owned(), self.state.as_str().to_owned()),
            (USAGE_BYTES.to_owned(), self.usage_bytes.to_string()),
            (BUDGET.to_owned(), self.budget.clone()),
            (NODE.to_owned(), self.node.clone()),
        ]);
        if let Some(at) = &self.eviction_requested_at {
            out.insert(EVICTION_REQUESTED_AT.to_owned(), at.clone());
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_and_rejects_garbage() {
        let record = PodRecord {
            state: BudgetState::Evicting,
            usage_bytes: 9_663_676_416,
            budget: "llm-inference".into(),
            node: "gpu-node-1".into(),
            eviction_requested_at: Some("2026-11-21T18:00:00Z".into()),
        };
        let annotations = record.to_annotations();
        assert_eq!(annotations[STATE], "Evicting");
        assert_eq!(PodRecord::from_annotations(&annotations), Some(record));
        let mut bad = annotations.clone();
        bad.insert(USAGE_BYTES.into(), "9Gi".into());
        assert_eq!(PodRecord::from_annotations(&bad), None);
        bad = annotations;
        bad.insert(STATE.into(), "Fine".into());
        assert_eq!(PodRecord::from_annotations(&bad), None);
        assert_eq!(agent_field_manager("n1"), "gpubudget-agent/n1");
    }
}
