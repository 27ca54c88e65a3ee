//! What the operator keeps of a pod: its name, UID, labels and the agent's record, nothing else.
//!
//! The operator watches pod *metadata* only (`PartialObjectMeta<Pod>`), and of that it keeps what the
//! status needs. Everything else a pod carries (managed fields, other annotations, owner references, the
//! spec and status it never receives) is dropped as each event arrives, which is what keeps the operator
//! small with 10 000 pods (docs/performance.md).

use std::collections::BTreeMap;

use gpubudget_common::contract::PodRecord;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;

/// `namespace/name` of a namespaced object.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ObjKey {
    /// Namespace.
    pub namespace: String,
    /// Name.
    pub name: String,
}

impl ObjKey {
    /// A key from its parts.
    pub fn new(namespace: impl Into<String>, name: impl Into<String>) -> Self {
        Self { namespace: namespace.into(), name: name.into() }
    }

    /// The key of an object's metadata; `None` when it has no name or namespace.
    pub fn of(meta: &ObjectMeta) -> Option<Self> {
        Some(Self::new(meta.namespace.clone()?, meta.name.clone()?))
    }
}

impl std::fmt::Display for ObjKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.namespace, self.name)
    }
}

/// A pod as the operator keeps it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PodInfo {
    /// Namespace.
    pub namespace: String,
    /// Name.
    pub name: String,
    /// `metadata.uid`: evictions are counted once per UID.
    pub uid: String,
    /// Labels, for the budgets' selectors.
    pub labels: BTreeMap<String, String>,
    /// The agent's record (the `gpubudget.io/` annotations), if the pod has a well-formed one.
    pub record: Option<PodRecord>,
}

impl PodInfo {
    /// What the operator keeps of a pod's metadata; `None` without a name or namespace.
    pub fn from_meta(meta: &ObjectMeta) -> Option<Self> {
        let key = ObjKey::of(meta)?;
        Some(Self {
            namespace: key.namespace,
            name: key.name,
            uid: meta.uid.clone().unwrap_or_default(),
            labels: meta.labels.clone().unwrap_or_default(),
            record: meta.annotations.as_ref().and_then(PodRecord::from_annotations),
        })
    }

    /// `namespace/name`.
    pub fn key(&self) -> ObjKey {
        ObjKey::new(&self.namespace, &self.name)
    }

    /// The budget this pod's record names (same namespace), if any.
    pub fn recorded_budget(&self) -> Option<ObjKey> {
        self.record.as_ref().map(|r| ObjKey::new(&self.namespace, &r.budget))
    }
}

/// Strips from a pod's metadata what the operator never reads: managed fields, owner references,
/// finalizers and every annotation outside the `gpubudget.io/` contract. For a stream `.modify()` or a
/// store that keeps `PartialObjectMeta`; [`PodInfo::from_meta`] reads only what survives this.
pub fn strip(meta: &mut ObjectMeta) {
    meta.managed_fields = None;
    meta.owner_references = None;
    meta.finalizers = None;
    meta.generate_name = None;
    if let Some(annotations) = meta.annotations.as_mut() {
        annotations.retain(|k, _| gpubudget_common::contract::ALL.contains(&k.as_str()));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use gpubudget_common::BudgetState;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::ManagedFieldsEntry;

    #[test]
    fn keeps_only_what_the_status_needs() {
        let mut meta = ObjectMeta {
            name: Some("p".into()),
            namespace: Some("ns".into()),
            uid: Some("u1".into()),
            labels: Some(BTreeMap::from([("app".into(), "llm".into())])),
            annotations: Some(BTreeMap::from([
                ("gpubudget.io/state".into(), "Over".into()),
                ("gpubudget.io/usage-bytes".into(), "100".into()),
                ("gpubudget.io/budget".into(), "b".into()),
                ("kubectl.kubernetes.io/last-applied-configuration".into(), "x".repeat(10_000)),
            ])),
            managed_fields: Some(vec![ManagedFieldsEntry::default()]),
            ..ObjectMeta::default()
        };
        strip(&mut meta);
        assert!(meta.managed_fields.is_none());
        assert_eq!(meta.annotations.as_ref().map(BTreeMap::len), Some(3));
        let info = PodInfo::from_meta(&meta).expect("named");
        assert_eq!(info.key(), ObjKey::new("ns", "p"));
        let record = info.record.as_ref().expect("record");
        assert_eq!((record.state, record.usage_bytes), (BudgetState::Over, 100));
        assert_eq!(info.recorded_budget(), Some(ObjKey::new("ns", "b")));
        assert!(PodInfo::from_meta(&ObjectMeta::default()).is_none());
    }
}
