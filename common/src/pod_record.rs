//! What the agent records on a pod and the operator reads back: a few annotations, written by the
//! agent with server-side apply under the field manager [`agent_field_manager`] of its node.
//!
//! Annotations (not a status condition) because the operator watches pod metadata only, which keeps
//! its memory small at cluster scale, and `kubectl get pod -o yaml` shows them.

use std::collections::BTreeMap;
use std::sync::Arc;

use crate::state::BudgetState;

/// `Within`, `Near`, `Over` or `Evicting`.
pub const STATE: &str = "gpubudget.io/state";
/// GPU memory the pod holds, in bytes (decimal integer).
pub const USAGE_BYTES: &str = "gpubudget.io/usage-bytes";
/// Name of the budget (same namespace) that applies to the pod; for a `ClusterGpuMemoryBudget`, its name after
/// [`CLUSTER_BUDGET_PREFIX`].
pub const BUDGET: &str = "gpubudget.io/budget";
/// What precedes a cluster budget's name in [`BUDGET`] (no budget's name can hold a `/` or capitals, so a
/// record never names a namespaced budget of the same name).
pub const CLUSTER_BUDGET_PREFIX: &str = "ClusterGpuMemoryBudget/";
/// The node whose agent wrote the record.
pub const NODE: &str = "gpubudget.io/node";
/// When the agent requested the pod's eviction (RFC 3339); present only once it has.
pub const EVICTION_REQUESTED_AT: &str = "gpubudget.io/eviction-requested-at";

/// Why the pod's MPS cap is not in force, in words, when the agent saw it is not (#32): a process of the pod that
/// is not a client of the GPU's MPS server (it unset its variable or went around the server), or that holds more
/// than its cap. Absent while the cap is in force or the pod has none. Part of the record: the operator counts such
/// a pod uncapped (`podsCapNotInForce`), and only the agent may write it (the records policy).
pub const CAP_NOT_IN_FORCE: &str = "gpubudget.io/cap-not-in-force";

/// How the pod's limit came from its declared share (#44), as JSON ([`crate::share::HeldShare`]): its limit, the sources
/// read (none where it is unresolved) and the note (`KAI gpu-fraction 0.5 of 79.6Gi = 39.8Gi`). Present only where
/// the budget that applies takes shares (`spec.share`); the operator counts it in status, `why` and `top` show it.
pub const SHARE: &str = "gpubudget.io/share";

/// What the container runtime gave the pod's GPU containers at creation (`--runtime-caps`, #45), as JSON
/// ([`RuntimeCapsRecord`]): present only where the node's agent is the runtime's NRI plugin and saw them (made or,
/// after it (re)connected, listed by the runtime). Part of the record: the operator counts the pod capped or
/// uncapped from it instead of from the spec (the runtime's value is the one the process started with).
pub const RUNTIME_CAPS: &str = "gpubudget.io/runtime-caps";

/// What the NVIDIA driver caps the pod at (driver R615 per-cgroup limits, read back by the agent), as JSON
/// ([`DriverLimitsRecord`]); present only where the node's driver can tell. Informational: the operator does not
/// read it, so it is not in [`ALL`]; the agent writes it in the same apply as the record (and an apply of none
/// removes it with the rest).
pub const DRIVER_LIMITS: &str = "gpubudget.io/driver-limits";

/// Every annotation key of the contract.
pub const ALL: [&str; 8] =
    [STATE, USAGE_BYTES, BUDGET, NODE, EVICTION_REQUESTED_AT, CAP_NOT_IN_FORCE, SHARE, RUNTIME_CAPS];

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
    /// The budget that applies: a name in the pod's namespace, or [`CLUSTER_BUDGET_PREFIX`] and a cluster
    /// budget's name ([`crate::Budget::record_name`]).
    pub budget: Arc<str>,
    /// The node of the agent that wrote it.
    pub node: Arc<str>,
    /// When eviction was requested, if it was.
    pub eviction_requested_at: Option<String>,
    /// Why the pod's cap is not in force ([`CAP_NOT_IN_FORCE`]), when the agent saw it is not.
    pub cap_not_in_force: Option<String>,
    /// How the pod's limit came from its declared share ([`SHARE`]), when its budget takes one.
    pub share: Option<crate::share::HeldShare>,
    /// The caps the runtime gave its GPU containers ([`RUNTIME_CAPS`]), when the agent saw them made.
    pub runtime_caps: Option<RuntimeCapsRecord>,
}

impl PodRecord {
    /// Reads a record from annotations; `None` when there is none or it is malformed.
    pub fn from_annotations(annotations: &BTreeMap<String, String>) -> Option<Self> {
        Some(Self {
            state: BudgetState::parse(annotations.get(STATE)?)?,
            usage_bytes: annotations.get(USAGE_BYTES)?.parse().ok()?,
            budget: annotations.get(BUDGET)?.as_str().into(),
            node: annotations.get(NODE).map(|n| n.as_str().into()).unwrap_or_default(),
            eviction_requested_at: annotations.get(EVICTION_REQUESTED_AT).cloned(),
            cap_not_in_force: annotations.get(CAP_NOT_IN_FORCE).cloned(),
            share: annotations.get(SHARE).and_then(|v| crate::share::HeldShare::from_annotation(v)),
            runtime_caps: annotations.get(RUNTIME_CAPS).and_then(|v| RuntimeCapsRecord::from_annotation(v)),
        })
    }

    /// The annotations that carry this record.
    pub fn to_annotations(&self) -> BTreeMap<String, String> {
        let mut out = BTreeMap::from([
            (STATE.to_owned(), self.state.as_str().to_owned()),
            (USAGE_BYTES.to_owned(), self.usage_bytes.to_string()),
            (BUDGET.to_owned(), self.budget.to_string()),
            (NODE.to_owned(), self.node.to_string()),
        ]);
        if let Some(at) = &self.eviction_requested_at {
            out.insert(EVICTION_REQUESTED_AT.to_owned(), at.clone());
        }
        if let Some(why) = &self.cap_not_in_force {
            out.insert(CAP_NOT_IN_FORCE.to_owned(), why.clone());
        }
        if let Some(share) = &self.share {
            out.insert(SHARE.to_owned(), share.to_annotation());
        }
        if let Some(caps) = &self.runtime_caps {
            out.insert(RUNTIME_CAPS.to_owned(), caps.to_annotation());
        }
        out
    }
}

/// The value of [`RUNTIME_CAPS`]: every GPU container of the pod the runtime made with an MPS cap the driver reads
/// (the largest, MiB, and each container's), or those it made without one, and why (then each other's cap).
/// An older reader ignores `containers`.
#[derive(Debug, Clone, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "camelCase", rename_all_fields = "camelCase")]
pub enum RuntimeCapsRecord {
    /// Every GPU container seen is capped; the largest cap, MiB.
    Capped {
        /// The largest cap of any container and device.
        max_mib: u64,
        /// Each GPU container's largest cap, MiB, by name (at most [`RuntimeCapsRecord::CONTAINERS_MAX`]).
        #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
        containers: BTreeMap<String, u64>,
    },
    /// Some GPU container is not: `container <name>: <why>`, each uncapped one first, then the capped ones'
    /// `container <name>: capped at <MiB> MiB`, `; `-separated.
    Uncapped(String),
}

impl RuntimeCapsRecord {
    /// The longest reason kept.
    const WHY_MAX: usize = 600;
    /// Containers named at most (a tenant writes a pod's containers: bounded).
    pub const CONTAINERS_MAX: usize = 16;

    /// Capped, each container at its cap (the first [`Self::CONTAINERS_MAX`] by name are named).
    pub fn capped(containers: impl IntoIterator<Item = (String, u64)>) -> Self {
        let all: BTreeMap<String, u64> = containers.into_iter().collect();
        let max_mib = all.values().copied().max().unwrap_or(0);
        Self::Capped { max_mib, containers: all.into_iter().take(Self::CONTAINERS_MAX).collect() }
    }

    /// The annotation's value.
    pub fn to_annotation(&self) -> String {
        serde_json::to_string(self).unwrap_or_default()
    }

    /// Reads the annotation's value; `None` when it is not this record's JSON or longer than the agent writes.
    pub fn from_annotation(value: &str) -> Option<Self> {
        // Names of 63 bytes at most, each with its figure and JSON's quoting.
        let most = Self::WHY_MAX + 40 + Self::CONTAINERS_MAX * 90;
        (value.len() <= most).then(|| serde_json::from_str(value).ok()).flatten()
    }

    /// An uncapped record whose reason is cut to what is kept.
    pub fn uncapped(why: String) -> Self {
        Self::Uncapped(why.chars().take(Self::WHY_MAX).collect())
    }
}

/// The value of [`DRIVER_LIMITS`]: the driver's limits on the pod's containers, summed over each
/// (container cgroup, GPU) pair the pod uses. Every field has a default, so a reader ignores what it does not
/// know and a writer may leave out what it does not have.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct DriverLimitsRecord {
    /// (container cgroup, GPU) pairs read.
    pub pairs: u32,
    /// Of which carry a hard limit.
    pub capped: u32,
    /// The hard limits added up, bytes, when every pair has one (the most the driver lets the pod hold).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub hard_bytes: Option<u64>,
    /// The soft limits added up, bytes, when every pair has one.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub soft_bytes: Option<u64>,
    /// How the driver's limits disagree with the budget, in words; absent when they agree.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub note: Option<String>,
}

impl DriverLimitsRecord {
    /// The annotation's value.
    pub fn to_annotation(&self) -> String {
        serde_json::to_string(self).unwrap_or_default()
    }

    /// Reads the annotation's value; `None` when it is not this record's JSON.
    pub fn from_annotation(value: &str) -> Option<Self> {
        serde_json::from_str(value).ok()
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
            cap_not_in_force: Some("pid 4242 on GPU 0 is not an MPS client".into()),
            share: None,
            runtime_caps: None,
        };
        let annotations = record.to_annotations();
        assert_eq!(annotations[STATE], "Evicting");
        assert_eq!(annotations[CAP_NOT_IN_FORCE], "pid 4242 on GPU 0 is not an MPS client");
        assert_eq!(PodRecord::from_annotations(&annotations), Some(record));
        let mut bad = annotations.clone();
        bad.insert(USAGE_BYTES.into(), "9Gi".into());
        assert_eq!(PodRecord::from_annotations(&bad), None);
        bad = annotations;
        bad.insert(STATE.into(), "Fine".into());
        assert_eq!(PodRecord::from_annotations(&bad), None);
        assert_eq!(agent_field_manager("n1"), "gpubudget-agent/n1");
    }

    #[test]
    fn runtime_caps_round_trip_in_camel_case_and_garbage_is_no_record() {
        let capped = RuntimeCapsRecord::capped([("g1".to_owned(), 8192), ("g2".to_owned(), 4096)]);
        assert_eq!(capped.to_annotation(), r#"{"capped":{"maxMib":8192,"containers":{"g1":8192,"g2":4096}}}"#);
        assert_eq!(RuntimeCapsRecord::from_annotation(&capped.to_annotation()), Some(capped));
        // An older writer's record (no containers) still reads.
        let old = RuntimeCapsRecord::from_annotation(r#"{"capped":{"maxMib":8192}}"#).expect("read");
        assert_eq!(old, RuntimeCapsRecord::Capped { max_mib: 8192, containers: BTreeMap::new() });
        // Many containers (a tenant's pod): the largest counted, the first named, the record still read back.
        let many = RuntimeCapsRecord::capped((0..100).map(|i| (format!("{i:0>63}"), 100 + i)));
        let RuntimeCapsRecord::Capped { max_mib, containers } = &many else { panic!("{many:?}") };
        assert_eq!((*max_mib, containers.len()), (199, RuntimeCapsRecord::CONTAINERS_MAX));
        assert_eq!(RuntimeCapsRecord::from_annotation(&many.to_annotation()), Some(many.clone()));
        let long = RuntimeCapsRecord::uncapped("x".repeat(1000));
        assert_eq!(RuntimeCapsRecord::from_annotation(&long.to_annotation()), Some(long));
        assert_eq!(RuntimeCapsRecord::from_annotation("capped"), None);
        assert_eq!(RuntimeCapsRecord::from_annotation(&format!("{{\"uncapped\":\"{}\"}}", "x".repeat(4000))), None);
    }

    #[test]
    fn driver_limits_round_trip_and_unknown_fields_are_ignored() {
        let record = DriverLimitsRecord {
            pairs: 2,
            capped: 2,
            hard_bytes: Some(8 << 30),
            soft_bytes: None,
            note: Some("driver allows more".into()),
        };
        let text = record.to_annotation();
        assert_eq!(text, r#"{"pairs":2,"capped":2,"hardBytes":8589934592,"note":"driver allows more"}"#);
        assert_eq!(DriverLimitsRecord::from_annotation(&text), Some(record));
        // A newer writer's extra field, an older writer's missing ones: read, not refused.
        let newer = DriverLimitsRecord::from_annotation(r#"{"pairs":1,"future":true}"#).expect("read");
        assert_eq!(newer, DriverLimitsRecord { pairs: 1, ..DriverLimitsRecord::default() });
        assert_eq!(DriverLimitsRecord::from_annotation("8Gi"), None);
    }
}
