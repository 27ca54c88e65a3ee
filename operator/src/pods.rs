//! What the operator keeps of a pod: its name, UID, labels, the agent's record and whether its GPU
//! containers' environment caps it (a verdict of a few bytes, not the variables), nothing else.
//!
//! The operator watches pods and keeps what the status needs. Everything else a pod carries (managed
//! fields, other annotations, owner references, the rest of the spec, the status) is skipped by the parser
//! as each event arrives, which is what keeps the operator small with 10 000 pods (docs/performance.md).
//! The spec is read (not a metadata-only watch) for one reason: whether a pod is capped is read from its
//! GPU containers' environment, which is fixed at creation and cannot be forged afterwards (common's
//! `caps`). The variables are read as each event arrives and reduced to [`PodCaps`] at once: a pod whose
//! author wrote a megabyte into one of them costs the operator no more than any other.

use std::borrow::Cow;
use std::collections::BTreeMap;
use std::fmt;
use std::sync::Arc;

use gpubudget_common::caps::{self, GpuContainer, PodCaps};
use gpubudget_common::pod_record::{self, PodRecord};
use gpubudget_common::quota::Exempt;
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::Resource;
use kube::core::NamespaceResourceScope;
use serde::de::{self, Deserializer, IgnoredAny, MapAccess, Visitor};

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

    /// The key of a `ClusterGpuMemoryBudget` (#23): its name, with an empty namespace.
    pub fn cluster(name: impl Into<String>) -> Self {
        Self::new("", name)
    }

    /// The key of a cluster-scoped object's metadata; `None` when it has no name.
    pub fn of_cluster(meta: &ObjectMeta) -> Option<Self> {
        Some(Self::cluster(meta.name.clone()?))
    }

    /// A `ClusterGpuMemoryBudget`'s key (no namespace).
    pub fn is_cluster(&self) -> bool {
        self.namespace.is_empty()
    }
}

impl std::fmt::Display for ObjKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.is_cluster() {
            write!(f, "{}{}", gpubudget_common::pod_record::CLUSTER_BUDGET_PREFIX, self.name)
        } else {
            write!(f, "{}/{}", self.namespace, self.name)
        }
    }
}

/// A pod's labels, shared: the index keeps one copy of each distinct label set (the replicas of a Deployment
/// carry the same labels), which is most of what 150 000 pods would otherwise cost (docs/performance.md).
pub type Labels = Arc<BTreeMap<String, String>>;

/// A pod's `metadata.uid`. The API server makes it a UUID, kept as its 16 bytes (as text, with its `String`,
/// it costs 72 bytes a pod); any other text (fakes, tests) is kept as it is. Shown as it was read.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Uid {
    /// A UUID in its canonical form (lowercase, hyphenated), which is how it is shown again.
    Uuid(uuid::Uuid),
    /// Anything else, the empty UID included.
    Text(Box<str>),
}

impl Uid {
    /// The UUID of `text` if `text` is its canonical form (other forms `uuid` reads, such as upper case or
    /// braces, would not be shown as they were read), else `None`.
    fn parse_uuid(text: &str) -> Option<uuid::Uuid> {
        uuid::Uuid::try_parse(text)
            .ok()
            .filter(|u| *u.hyphenated().encode_lower(&mut uuid::Uuid::encode_buffer()) == *text)
    }

    /// No UID (a pod without one is never counted as evicted).
    pub fn is_empty(&self) -> bool {
        matches!(self, Self::Text(t) if t.is_empty())
    }
}

impl Default for Uid {
    fn default() -> Self {
        Self::Text(Box::default())
    }
}

impl From<&str> for Uid {
    fn from(text: &str) -> Self {
        Self::parse_uuid(text).map_or_else(|| Self::Text(text.into()), Self::Uuid)
    }
}

impl fmt::Display for Uid {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Text(text) => f.write_str(text),
            Self::Uuid(uuid) => fmt::Display::fmt(&uuid.hyphenated(), f),
        }
    }
}

/// A pod as the operator keeps it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PodInfo {
    /// Namespace (shared by its pods in the index).
    pub namespace: Arc<str>,
    /// Name.
    pub name: Arc<str>,
    /// `metadata.uid`: evictions are counted once per UID.
    pub uid: Uid,
    /// Labels, for the budgets' selectors.
    pub labels: Labels,
    /// The agent's record (the `gpubudget.io/` annotations), if the pod has a well-formed one.
    pub record: Option<PodRecord>,
    /// The pod is being deleted (`metadata.deletionTimestamp`), as an evicted pod is once the Eviction API
    /// accepted the request; a pod deleted from the cache is remembered with this set.
    pub terminating: bool,
    /// Whether its GPU containers' environment (fixed at creation) caps it, and at most how much, or why
    /// not ([`PodCaps::of`]).
    pub caps: PodCaps,
    /// When it started (ms since the epoch): `status.startTime`, else `metadata.creationTimestamp`. A
    /// namespace total evicts the most recent start first.
    pub started_ms: Option<u64>,
    /// Never evicted for a namespace total, and why (critical priority, or a static pod's mirror).
    pub exempt: Option<Exempt>,
    /// `spec.terminationGracePeriodSeconds`.
    pub grace_seconds: Option<i64>,
}

/// Annotation the kubelet puts on a static pod's mirror (evicting the mirror would delete only the mirror).
pub const MIRROR_ANNOTATION: &str = "kubernetes.io/config.mirror";

/// Milliseconds since the epoch of a Kubernetes time (0 before the epoch).
pub fn epoch_ms(time: &k8s_openapi::apimachinery::pkg::apis::meta::v1::Time) -> u64 {
    u64::try_from(time.0.as_millisecond()).unwrap_or(0)
}

impl PodInfo {
    /// What the operator keeps of a pod's metadata; `None` without a name or namespace.
    pub fn from_meta(meta: &ObjectMeta) -> Option<Self> {
        let key = ObjKey::of(meta)?;
        Some(Self {
            namespace: key.namespace.into(),
            name: key.name.into(),
            uid: meta.uid.as_deref().map(Uid::from).unwrap_or_default(),
            labels: Arc::new(meta.labels.clone().unwrap_or_default()),
            record: meta.annotations.as_ref().and_then(PodRecord::from_annotations),
            terminating: meta.deletion_timestamp.is_some(),
            caps: PodCaps::NoGpu,
            started_ms: meta.creation_timestamp.as_ref().map(epoch_ms),
            exempt: meta
                .annotations
                .as_ref()
                .is_some_and(|a| a.contains_key(MIRROR_ANNOTATION))
                .then_some(Exempt::Static),
            grace_seconds: None,
        })
    }

    /// Whether this pod was evicted under the budget `name`: its record names that budget and says the agent
    /// requested the eviction, and the pod is going (terminating or deleted). A request that a
    /// PodDisruptionBudget refused leaves the pod running: not an eviction (yet).
    pub fn evicted_by(&self, name: &str) -> Option<&PodRecord> {
        self.record.as_ref().filter(|r| self.terminating && *r.budget == *name && r.eviction_requested_at.is_some())
    }

    /// `namespace/name`.
    pub fn key(&self) -> ObjKey {
        ObjKey::new(&*self.namespace, &*self.name)
    }

    /// The budget this pod's record names: `(true, name)` for a cluster budget, `(false, name)` for one of its
    /// namespace.
    fn recorded(&self) -> Option<(bool, &str)> {
        let recorded = &self.record.as_ref()?.budget;
        Some(match recorded.strip_prefix(gpubudget_common::pod_record::CLUSTER_BUDGET_PREFIX) {
            Some(cluster) => (true, cluster),
            None => (false, &**recorded),
        })
    }

    /// Whether this pod's record names the budget `key` (as [`PodInfo::recorded_budget`], without building a
    /// key: the index asks it of every pod of a namespace).
    pub fn records(&self, key: &ObjKey) -> bool {
        self.recorded().is_some_and(|(cluster, name)| {
            cluster == key.is_cluster() && key.name == name && (cluster || *key.namespace == *self.namespace)
        })
    }

    /// The budget this pod's record names, if any: one of its namespace, or a cluster budget
    /// (`ClusterGpuMemoryBudget/<name>`, [`ObjKey::cluster`]).
    pub fn recorded_budget(&self) -> Option<ObjKey> {
        let (cluster, name) = self.recorded()?;
        Some(if cluster { ObjKey::cluster(name) } else { ObjKey::new(&*self.namespace, name) })
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
        annotations.retain(|k, _| gpubudget_common::pod_record::ALL.contains(&k.as_str()) || k == MIRROR_ANNOTATION);
    }
}

/// A pod as the operator reads it from a list or watch, lean from the start: only the name, namespace,
/// UID, resourceVersion, labels, the `gpubudget.io/` annotations and the caps verdict of its containers
/// (init, regular and ephemeral: read from their GPU limits, DRA claims and the four variables, then
/// dropped). Managed fields, owner references, other annotations (`last-applied-configuration` is often
/// kilobytes), the rest of the spec and the status are skipped by the parser; containers that use no GPU
/// are dropped as soon as they are read.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct PodMeta {
    /// What was kept of `metadata`.
    pub metadata: ObjectMeta,
    /// Whether its GPU containers' environment caps it ([`PodCaps::of`]).
    pub caps: PodCaps,
    /// `status.startTime`, ms since the epoch.
    pub started_ms: Option<u64>,
    /// `spec.priorityClassName` and `spec.priority` say the pod is critical ([`gpubudget_common::is_critical`]).
    pub critical: bool,
    /// `spec.terminationGracePeriodSeconds`.
    pub grace_seconds: Option<i64>,
}

impl PodMeta {
    /// What the operator keeps of this pod; `None` without a name or namespace. Critical priority exempts it
    /// only in the namespaces `critical` lists (#33).
    pub fn info(&self, critical: &gpubudget_common::CriticalNamespaces) -> Option<PodInfo> {
        PodInfo::from_meta(&self.metadata).map(|info| PodInfo {
            caps: self.caps,
            started_ms: self.started_ms.or(info.started_ms),
            exempt: if self.critical && critical.exempts(&info.namespace) {
                Some(Exempt::Critical)
            } else {
                info.exempt
            },
            grace_seconds: self.grace_seconds,
            ..info
        })
    }
}

impl Resource for PodMeta {
    type DynamicType = ();
    type Scope = NamespaceResourceScope;

    fn kind(dt: &()) -> Cow<'_, str> {
        Pod::kind(dt)
    }

    fn group(dt: &()) -> Cow<'_, str> {
        Pod::group(dt)
    }

    fn version(dt: &()) -> Cow<'_, str> {
        Pod::version(dt)
    }

    fn plural(dt: &()) -> Cow<'_, str> {
        Pod::plural(dt)
    }

    fn meta(&self) -> &ObjectMeta {
        &self.metadata
    }

    fn meta_mut(&mut self) -> &mut ObjectMeta {
        &mut self.metadata
    }

    fn metadata_api() -> bool {
        // The caps status reads the containers' environment (see the module's comment).
        false
    }
}

impl<'de> serde::Deserialize<'de> for PodMeta {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        #[derive(serde::Deserialize)]
        struct Wire {
            #[serde(default)]
            metadata: Lean,
            #[serde(default)]
            spec: Option<LeanSpec>,
            #[serde(default)]
            status: Option<LeanStatus>,
        }
        #[derive(serde::Deserialize, Default)]
        #[serde(rename_all = "camelCase")]
        struct LeanSpec {
            init_containers: Option<Vec<LeanContainer>>,
            containers: Option<Vec<LeanContainer>>,
            ephemeral_containers: Option<Vec<LeanContainer>>,
            priority_class_name: Option<String>,
            priority: Option<i32>,
            termination_grace_period_seconds: Option<i64>,
            node_selector: Option<BTreeMap<String, String>>,
        }
        #[derive(serde::Deserialize, Default)]
        #[serde(rename_all = "camelCase")]
        struct LeanStatus {
            start_time: Option<k8s_openapi::apimachinery::pkg::apis::meta::v1::Time>,
        }
        #[derive(serde::Deserialize)]
        struct LeanContainer(#[serde(deserialize_with = "gpu_container")] Option<LeanGpu>);
        #[derive(serde::Deserialize, Default)]
        #[serde(rename_all = "camelCase")]
        struct Lean {
            name: Option<String>,
            namespace: Option<String>,
            uid: Option<String>,
            resource_version: Option<String>,
            deletion_timestamp: Option<k8s_openapi::apimachinery::pkg::apis::meta::v1::Time>,
            creation_timestamp: Option<k8s_openapi::apimachinery::pkg::apis::meta::v1::Time>,
            labels: Option<BTreeMap<String, String>>,
            #[serde(default)]
            annotations: ContractAnnotations,
        }
        let wire = Wire::deserialize(deserializer)?;
        let spec = wire.spec.unwrap_or_default();
        let critical = gpubudget_common::is_critical(spec.priority_class_name.as_deref(), spec.priority);
        let grace_seconds = spec.termination_grace_period_seconds;
        let started_ms = wire.status.and_then(|s| s.start_time).as_ref().map(epoch_ms);
        let gpu: Vec<GpuContainer> = spec
            .init_containers
            .into_iter()
            .chain(spec.containers)
            .chain(spec.ephemeral_containers)
            .flatten()
            .filter_map(|c| c.0.and_then(|c| c.gpu(spec.node_selector.as_ref())))
            .collect();
        let caps = PodCaps::of(&gpu);
        let m = wire.metadata;
        let annotations = Some(m.annotations.0).filter(|a| !a.is_empty());
        Ok(Self {
            metadata: ObjectMeta {
                name: m.name,
                namespace: m.namespace,
                uid: m.uid,
                resource_version: m.resource_version,
                deletion_timestamp: m.deletion_timestamp,
                creation_timestamp: m.creation_timestamp,
                labels: m.labels,
                annotations,
                ..ObjectMeta::default()
            },
            caps,
            started_ms,
            critical,
            grace_seconds,
        })
    }
}

/// What the caps verdict needs of a container that may use a GPU (a GPU limit, a DRA claim or
/// `NVIDIA_VISIBLE_DEVICES` in its `env`): its GPU limits, cap variables and `envFrom` prefixes. Read once the
/// pod's `nodeSelector` is known ([`LeanGpu::gpu`]).
struct LeanGpu {
    name: String,
    limits: Vec<(String, String)>,
    claims: bool,
    env: Vec<k8s_openapi::api::core::v1::EnvVar>,
    env_from: Vec<k8s_openapi::api::core::v1::EnvFromSource>,
}

impl LeanGpu {
    /// The container as the caps module reads it, in a pod with this `nodeSelector` ([`caps::devices`]);
    /// `None` when it is not a GPU container.
    fn gpu(self, node_selector: Option<&BTreeMap<String, String>>) -> Option<GpuContainer> {
        let limits = caps::gpu_limits(self.limits.iter().map(|(k, v)| (k.as_str(), v.as_str())), node_selector);
        GpuContainer::from_lean(&self.name, limits, self.claims, &self.env, &self.env_from)
    }
}

/// A container, kept only if it may use a GPU ([`LeanGpu`]).
fn gpu_container<'de, D: Deserializer<'de>>(deserializer: D) -> Result<Option<LeanGpu>, D::Error> {
    #[derive(serde::Deserialize, Default)]
    struct Resources {
        // Quantities are strings from the API server; a number (as a hand-written object may hold) is read
        // too rather than failing the whole pod event.
        limits: Option<BTreeMap<String, serde_json::Value>>,
        claims: Option<Vec<IgnoredAny>>,
    }
    #[derive(serde::Deserialize)]
    struct Env {
        name: String,
        value: Option<String>,
        #[serde(rename = "valueFrom")]
        value_from: Option<IgnoredAny>,
    }
    #[derive(serde::Deserialize)]
    #[serde(rename_all = "camelCase")]
    struct EnvFrom {
        prefix: Option<String>,
        secret_ref: Option<IgnoredAny>,
    }
    #[derive(serde::Deserialize)]
    #[serde(rename_all = "camelCase")]
    struct Lean {
        #[serde(default)]
        name: String,
        resources: Option<Resources>,
        env: Option<Vec<Env>>,
        env_from: Option<Vec<EnvFrom>>,
    }
    let c = <Lean as serde::Deserialize>::deserialize(deserializer)?;
    let resources = c.resources.unwrap_or_default();
    let limits: Vec<(String, String)> = resources
        .limits
        .unwrap_or_default()
        .into_iter()
        .filter(|(k, _)| caps::is_gpu_resource(k))
        .map(|(k, v)| {
            let v = v.as_str().map_or_else(|| v.to_string(), str::to_owned);
            (k, v)
        })
        .collect();
    let claims = resources.claims.is_some_and(|c| !c.is_empty());
    let env: Vec<k8s_openapi::api::core::v1::EnvVar> = c
        .env
        .unwrap_or_default()
        .into_iter()
        .filter(|e| caps::VARIABLES.contains(&e.name.as_str()))
        .map(|e| k8s_openapi::api::core::v1::EnvVar {
            name: e.name,
            value: e.value,
            value_from: e.value_from.map(|_| Default::default()),
        })
        .collect();
    if limits.is_empty() && !claims && !env.iter().any(|e| e.name == caps::VISIBLE_DEVICES) {
        return Ok(None);
    }
    // Each entry's prefix and kind, in order (the verdict names an entry by its place); a prefix that can set
    // none of the variables is kept as one that cannot (NUL, which no name holds), not as the tenant's text.
    let env_from = c
        .env_from
        .unwrap_or_default()
        .into_iter()
        .map(|e| k8s_openapi::api::core::v1::EnvFromSource {
            prefix: e.prefix.map(|p| {
                if caps::VARIABLES.iter().any(|v| caps::env_from_may_set(&p, v)) { p } else { "\0".to_owned() }
            }),
            secret_ref: e.secret_ref.map(|_| Default::default()),
            config_map_ref: None,
        })
        .collect();
    Ok(Some(LeanGpu { name: c.name, limits, claims, env, env_from }))
}

/// The `gpubudget.io/` contract annotations of a map; every other entry is skipped unallocated.
#[derive(Default)]
struct ContractAnnotations(BTreeMap<String, String>);

/// A map key, kept only if it is one of the contract's annotation keys.
struct ContractKey(Option<&'static str>);

impl<'de> serde::Deserialize<'de> for ContractKey {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct KeyVisitor;
        impl Visitor<'_> for KeyVisitor {
            type Value = ContractKey;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("an annotation key")
            }
            fn visit_str<E: de::Error>(self, key: &str) -> Result<ContractKey, E> {
                let kept = pod_record::ALL.iter().copied().chain([MIRROR_ANNOTATION]).find(|k| *k == key);
                Ok(ContractKey(kept))
            }
        }
        deserializer.deserialize_str(KeyVisitor)
    }
}

impl<'de> serde::Deserialize<'de> for ContractAnnotations {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct MapVisitor;
        impl<'de> Visitor<'de> for MapVisitor {
            type Value = ContractAnnotations;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("annotations")
            }
            fn visit_unit<E: de::Error>(self) -> Result<ContractAnnotations, E> {
                Ok(ContractAnnotations::default())
            }
            fn visit_none<E: de::Error>(self) -> Result<ContractAnnotations, E> {
                Ok(ContractAnnotations::default())
            }
            fn visit_some<D: Deserializer<'de>>(self, d: D) -> Result<ContractAnnotations, D::Error> {
                d.deserialize_map(self)
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<ContractAnnotations, A::Error> {
                let mut out = BTreeMap::new();
                while let Some(ContractKey(key)) = map.next_key()? {
                    match key {
                        Some(key) => {
                            out.insert(key.to_owned(), map.next_value::<String>()?);
                        }
                        None => {
                            map.next_value::<IgnoredAny>()?;
                        }
                    }
                }
                Ok(ContractAnnotations(out))
            }
        }
        deserializer.deserialize_option(MapVisitor)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use gpubudget_common::BudgetState;
    use gpubudget_common::CriticalNamespaces;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::ManagedFieldsEntry;

    #[test]
    fn a_uuid_is_kept_as_bytes_and_shown_as_it_was_read() {
        let text = "0b6f6a4e-03e7-4c1e-9d7a-0000000000a5";
        let uid = Uid::from(text);
        assert!(matches!(uid, Uid::Uuid(u) if u.as_bytes()[0] == 0x0b && u.as_bytes()[15] == 0xa5));
        assert_eq!(uid.to_string(), text);
        // Not canonical (upper case, braces, a group too long or short): kept as text, never rewritten.
        for other in [
            "0B6F6A4E-03E7-4C1E-9D7A-0000000000A5",
            "{0b6f6a4e-03e7-4c1e-9d7a-0000000000a5}",
            "0b6f6a4e03e7-4c1e-9d7a-0000000000a5",
            "0b6f6a4e-03e7-4c1e-9d7a-0000000000a5-",
            "uid-p1",
            "",
        ] {
            assert_eq!(Uid::from(other), Uid::Text(other.into()), "{other}");
            assert_eq!(Uid::from(other).to_string(), other);
        }
        assert!(Uid::from("").is_empty() && !uid.is_empty());
        assert_ne!(Uid::from(text), Uid::from("0b6f6a4e-03e7-4c1e-9d7a-0000000000a6"));
    }

    proptest::proptest! {
        #[test]
        fn any_uid_reads_back_as_written(text in "[0-9a-fA-F-]{0,40}|[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}") {
            let uid = Uid::from(text.as_str());
            proptest::prop_assert_eq!(uid.to_string(), text.clone());
            proptest::prop_assert_eq!(uid, Uid::from(text.as_str()));
        }
    }

    #[test]
    fn a_record_names_a_budget_of_its_namespace_or_a_cluster_budget() {
        let pod = |budget: &str| {
            let mut meta = ObjectMeta { name: Some("p".into()), namespace: Some("a".into()), ..ObjectMeta::default() };
            meta.annotations = Some(
                PodRecord {
                    state: BudgetState::Within,
                    usage_bytes: 1,
                    budget: budget.into(),
                    node: "n".into(),
                    eviction_requested_at: None,
                    cap_not_in_force: None,
                    share: None,
                    runtime_caps: None,
                }
                .to_annotations(),
            );
            PodInfo::from_meta(&meta).expect("named")
        };
        let local = pod("llm");
        assert_eq!(local.recorded_budget(), Some(ObjKey::new("a", "llm")));
        assert!(local.records(&ObjKey::new("a", "llm")));
        assert!(!local.records(&ObjKey::new("b", "llm")), "a budget of another namespace");
        assert!(!local.records(&ObjKey::cluster("llm")), "a cluster budget of the same name");

        let cluster = pod(&format!("{}wide", gpubudget_common::pod_record::CLUSTER_BUDGET_PREFIX));
        assert_eq!(cluster.recorded_budget(), Some(ObjKey::cluster("wide")));
        assert!(cluster.records(&ObjKey::cluster("wide")));
        assert!(!cluster.records(&ObjKey::new("a", "wide")));

        let none = PodInfo { record: None, ..local };
        assert!(none.recorded_budget().is_none() && !none.records(&ObjKey::new("a", "llm")));
    }

    #[test]
    fn pod_meta_reads_only_what_it_keeps() {
        let wire = serde_json::json!({
            "apiVersion": "meta.k8s.io/v1", "kind": "PartialObjectMetadata",
            "metadata": {
                "name": "p", "namespace": "ns", "uid": "u1", "resourceVersion": "42", "generation": 3,
                "labels": {"app": "llm"},
                "annotations": {"gpubudget.io/state": "Near", "gpubudget.io/usage-bytes": "7",
                                "gpubudget.io/budget": "b", "other.io/big": "x\"y", "gpubudget.io/unknown": "z"},
                "managedFields": [{"manager": "kubectl", "fieldsV1": {"f:spec": {"f:containers": {}}}}],
                "ownerReferences": [{"apiVersion": "apps/v1", "kind": "ReplicaSet", "name": "r", "uid": "x"}],
            }
        });
        let meta: PodMeta = serde_json::from_value(wire).expect("parses");
        let m = &meta.metadata;
        assert_eq!((m.name.as_deref(), m.resource_version.as_deref(), m.generation), (Some("p"), Some("42"), None));
        assert!(m.managed_fields.is_none() && m.owner_references.is_none());
        let keys: Vec<&str> = m.annotations.iter().flatten().map(|(k, _)| k.as_str()).collect();
        assert_eq!(keys, ["gpubudget.io/budget", "gpubudget.io/state", "gpubudget.io/usage-bytes"]);
        let info = PodInfo::from_meta(m).expect("named");
        assert_eq!(info.record.map(|r| r.usage_bytes), Some(7));
        // Absent or null annotations and metadata.
        let bare: PodMeta =
            serde_json::from_str(r#"{"metadata": {"name": "p", "annotations": null}}"#).expect("parses");
        assert!(bare.metadata.annotations.is_none());
        assert!(!PodMeta::metadata_api(), "the caps status reads the spec");
        assert_eq!(PodMeta::plural(&()), "pods");
    }

    #[test]
    fn pod_meta_keeps_the_caps_verdict_only() {
        let wire = |main_env: serde_json::Value| {
            serde_json::json!({
                "apiVersion": "v1", "kind": "Pod",
                "metadata": {"name": "p", "namespace": "ns", "uid": "u1"},
                "spec": {
                    "nodeSelector": {"nvidia.com/gpu.replicas": "1"},
                    "initContainers": [{"name": "warm", "resources": {"limits": {"nvidia.com/gpu.shared": 1}},
                                        "env": [{"name": "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT", "value": "0=1G"}]}],
                    "containers": [
                        {"name": "main", "image": "x", "resources": {"limits": {"nvidia.com/gpu": "2", "cpu": "1"}},
                         "env": main_env, "volumeMounts": [{"name": "v", "mountPath": "/v"}]},
                        {"name": "web", "image": "y", "env": [{"name": "NVIDIA_GPU_MEMORY_LIMIT", "value": "1"}]},
                    ],
                    "volumes": [{"name": "v", "emptyDir": {}}],
                },
                "status": {"phase": "Running", "containerStatuses": [{"name": "main", "ready": true}]},
            })
        };
        let caps_of = |v: serde_json::Value| {
            serde_json::from_value::<PodMeta>(v)
                .expect("parses")
                .info(&CriticalNamespaces::default())
                .expect("named")
                .caps
        };
        let capped = wire(serde_json::json!([
            {"name": "OTHER", "value": "1"}, {"name": "NVIDIA_GPU_MEMORY_LIMIT", "value": "8192"},
            {"name": "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT", "value": "0=1G"},
            {"name": "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT", "value": "0=2G,1=2G"},
        ]));
        assert_eq!(
            caps_of(capped.clone()),
            PodCaps::Capped { max_mib: 8192 },
            "the last entry wins; the CPU-only container dropped"
        );
        // A value the driver ignores, and every other way to a GPU.
        let mut ignored = capped.clone();
        ignored["spec"]["containers"][0]["env"][3]["value"] = "0=2G,1=2G,2=1M".into();
        assert!(matches!(caps_of(ignored), PodCaps::Uncapped(caps::Uncapped::Ignored(caps::Ignored::Unseen { .. }))));
        let mut debug = capped.clone();
        debug["spec"]["ephemeralContainers"] =
            serde_json::json!([{"name": "debug", "env": [{"name": "NVIDIA_VISIBLE_DEVICES", "value": "all"}]}]);
        assert_eq!(caps_of(debug), PodCaps::Uncapped(caps::Uncapped::Devices(caps::Unknown::All)));
        let mut dra = capped.clone();
        dra["spec"]["containers"][1]["resources"] = serde_json::json!({"claims": [{"name": "gpu"}]});
        assert_eq!(caps_of(dra), PodCaps::Uncapped(caps::Uncapped::Devices(caps::Unknown::Claim)));
        let mut mig = capped;
        mig["spec"]["containers"][1]["resources"] = serde_json::json!({"limits": {"nvidia.com/mig-1g.10gb": "1"}});
        assert_eq!(caps_of(mig), PodCaps::Uncapped(caps::Uncapped::NoMps));
        let from = wire(serde_json::json!([{"name": "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT",
                                             "valueFrom": {"configMapKeyRef": {"name": "c", "key": "k"}}}]));
        assert_eq!(caps_of(from), PodCaps::Uncapped(caps::Uncapped::MpsFromSource));
        assert!(std::mem::size_of::<PodCaps>() <= 24, "a verdict, not the variables");
    }

    /// Caps counted only where the driver reads them: `nvidia.com/gpu: 2` off nodes pinned as unshared may be
    /// replicas of one card (the nodeSelector follows the containers on the wire, as the API server writes
    /// it); a scheduler's ConfigMap in `envFrom` may set NVIDIA_VISIBLE_DEVICES. Both counted uncapped.
    #[test]
    fn pod_meta_counts_replicas_and_env_from_uncapped() {
        let caps_of = |v: serde_json::Value| {
            serde_json::from_value::<PodMeta>(v)
                .expect("parses")
                .info(&CriticalNamespaces::default())
                .expect("named")
                .caps
        };
        let wire = |limits: serde_json::Value, selector: serde_json::Value, env_from: serde_json::Value| {
            serde_json::json!({
                "metadata": {"name": "p", "namespace": "ns", "uid": "u1"},
                "spec": {
                    "containers": [{"name": "main", "resources": {"limits": limits}, "envFrom": env_from,
                                    "env": [{"name": "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT", "value": "0=3G,1=3G"}]}],
                    "nodeSelector": selector,
                },
            })
        };
        let two = serde_json::json!({"nvidia.com/gpu": "2"});
        let unshared = serde_json::json!({"nvidia.com/gpu.sharing-strategy": "none"});
        assert_eq!(
            caps_of(wire(two.clone(), unshared.clone(), serde_json::json!([]))),
            PodCaps::Capped { max_mib: 3072 }
        );
        assert_eq!(
            caps_of(wire(two.clone(), serde_json::json!({}), serde_json::json!([]))),
            PodCaps::Uncapped(caps::Uncapped::Devices(caps::Unknown::Replicas {
                resource: caps::Replicated::Gpu,
                count: 2
            }))
        );
        let shared = serde_json::json!({"nvidia.com/gpu.shared": 2});
        assert!(matches!(
            caps_of(wire(shared, unshared.clone(), serde_json::json!([]))),
            PodCaps::Uncapped(caps::Uncapped::Devices(caps::Unknown::Replicas {
                resource: caps::Replicated::Shared,
                ..
            }))
        ));
        let kai = serde_json::json!([{"configMapRef": {"name": "app"}, "prefix": "APP_"}, {"configMapRef": {"name": "gpu-sharing"}}]);
        assert_eq!(
            caps_of(wire(two.clone(), unshared.clone(), kai)),
            PodCaps::Uncapped(caps::Uncapped::Devices(caps::Unknown::VisibleFromEnvFrom { entry: 1, secret: false }))
        );
        let prefixed = serde_json::json!([{"secretRef": {"name": "s"}, "prefix": "APP_"}]);
        assert_eq!(caps_of(wire(two, unshared, prefixed)), PodCaps::Capped { max_mib: 3072 });
    }

    /// What namespace totals read: the start (status.startTime, else creation), critical priority, a static
    /// pod's mirror, the pod's own grace period.
    #[test]
    fn pod_meta_reads_what_namespace_totals_need() {
        let wire = serde_json::json!({
            "metadata": {"name": "p", "namespace": "ns", "creationTimestamp": "2026-11-25T00:00:00Z",
                         "annotations": {"kubernetes.io/config.mirror": "abc", "other": "x"}},
            "spec": {"priorityClassName": "system-node-critical", "terminationGracePeriodSeconds": 90, "containers": []},
            "status": {"startTime": "2026-11-25T00:00:02Z"},
        });
        let meta = serde_json::from_value::<PodMeta>(wire).expect("parses");
        let listed: CriticalNamespaces = "kube-system,ns".parse().expect("valid");
        let info = meta.info(&listed).expect("named");
        assert_eq!(info.started_ms, Some(1_795_564_802_000));
        assert_eq!((info.exempt, info.grace_seconds), (Some(Exempt::Critical), Some(90)));
        // #33: critical priority in a namespace the administrator does not list exempts nothing (the mirror
        // annotation still does).
        let info = meta.info(&CriticalNamespaces::default()).expect("named");
        assert_eq!(info.exempt, Some(Exempt::Static));
        let mut plain = meta.clone();
        plain.metadata.annotations = None;
        assert_eq!(plain.info(&CriticalNamespaces::default()).expect("named").exempt, None);
        assert_eq!(plain.info(&listed).expect("named").exempt, Some(Exempt::Critical));
        let wire = serde_json::json!({
            "metadata": {"name": "p", "namespace": "ns", "creationTimestamp": "2026-11-25T00:00:00Z",
                         "annotations": {"kubernetes.io/config.mirror": "abc"}},
        });
        let info = serde_json::from_value::<PodMeta>(wire).expect("parses").info(&listed).expect("named");
        assert_eq!((info.started_ms, info.exempt), (Some(1_795_564_800_000), Some(Exempt::Static)));
    }

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
