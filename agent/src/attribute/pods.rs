//! The pods of this node as enforcement needs them, indexed for the PID → pod join, with each pod's
//! budget resolved. Rebuilt only when the pods or the budgets change, never per sample.

use std::collections::BTreeMap;
use std::sync::Arc;

use gpubudget_common::caps;
use gpubudget_common::pod_record::{self, PodRecord};
use gpubudget_common::share::{self, Declaration};
use gpubudget_common::{Budget, CriticalNamespaces, GpuMemoryBudget, PodLabels, SpecError, is_critical, resolve};

use super::budgets::{BudgetIndex, ClusterIndex};
use crate::FastMap;
use k8s_openapi::api::core::v1::Pod;

/// Annotation the kubelet puts on the mirror pod of a static pod: the static pod's UID, which is what
/// its cgroup is named after.
pub const MIRROR_ANNOTATION: &str = "kubernetes.io/config.mirror";

/// A container of a pod.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ContainerView {
    /// Container ID without the runtime scheme, lowercase.
    pub id: String,
    /// Container name.
    pub name: Arc<str>,
}

/// The MPS cap a pod's environment holds it to, as the driver reads it ([`caps::PodCaps::capped_mib`]): the
/// largest cap, and how many devices the value names in each GPU container (the fewest of them: a process that
/// holds memory on more GPUs than that is capped on some of them only, [`crate::decide::cap_check`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MpsCap {
    /// The largest cap, MiB.
    pub mib: u64,
    /// The devices the value names in the GPU container that sees the fewest (at least 1).
    pub devices: u32,
}

impl MpsCap {
    /// The cap of a pod from its spec; `None` unless every GPU container is capped on every device it sees.
    pub fn of_pod(pod: &Pod) -> Option<Self> {
        let found = caps::gpu_containers(pod);
        let mib = caps::PodCaps::of(found.iter().map(|f| &f.gpu)).capped_mib()?;
        let devices = found.iter().filter_map(|f| f.gpu.devices.known()).min()?;
        Some(Self { mib, devices })
    }
}

impl MpsCap {
    /// How [`slim_pod`] keeps the cap in the agent's memory: `<MiB>/<devices>` (`8192/1`); [`MpsCap::decode`]
    /// reads it back.
    pub fn encode(&self) -> String {
        format!("{}/{}", self.mib, self.devices)
    }

    /// Reads back what [`MpsCap::encode`] wrote; what is not that form is refused, saying what is wrong.
    pub fn decode(text: &str) -> Result<Self, MpsCapDecodeError> {
        let (mib, devices) = text.split_once('/').ok_or_else(|| MpsCapDecodeError::Form(text.to_owned()))?;
        let number = |n: &str| n.parse().map_err(|_| MpsCapDecodeError::Number(n.to_owned()));
        let (mib, devices) = (number(mib)?, u32::try_from(number(devices)?));
        match devices {
            Ok(devices) if devices > 0 => Ok(Self { mib, devices }),
            _ => Err(MpsCapDecodeError::Devices(text.to_owned())),
        }
    }
}

/// Why [`MpsCap::decode`] refused a text.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum MpsCapDecodeError {
    /// Not `<MiB>/<devices>`.
    #[error("{0:?} is not <MiB>/<devices>")]
    Form(String),
    /// A part is not a whole number.
    #[error("{0:?} is not a whole number")]
    Number(String),
    /// The devices are 0 or more than a `u32`: a cap names at least one.
    #[error("{0:?} names no device count from 1 to 2^32-1")]
    Devices(String),
}

/// What enforcement needs of a pod.
#[derive(Debug, Clone, PartialEq)]
pub struct PodView {
    /// `metadata.uid`.
    pub uid: Arc<str>,
    /// `metadata.namespace`.
    pub namespace: Arc<str>,
    /// `metadata.name`.
    pub name: Arc<str>,
    /// `spec.nodeName`.
    pub node: Option<String>,
    /// `metadata.labels`.
    pub labels: BTreeMap<String, String>,
    /// Critical by priority class or priority: never evicted in the namespaces the administrator lists
    /// ([`PodView::never_evicted`]).
    pub critical: bool,
    /// Has a deletion timestamp (being terminated: left alone).
    pub terminating: bool,
    /// `spec.terminationGracePeriodSeconds`.
    pub termination_grace_seconds: Option<i64>,
    /// Containers with an ID (init, regular and ephemeral).
    pub containers: Vec<ContainerView>,
    /// For a mirror pod, the static pod's UID (its cgroups carry that one).
    pub mirror_of: Option<String>,
    /// The agent record found in its annotations, if any.
    pub record: Option<PodRecord>,
    /// Whether any contract annotation is present.
    pub has_annotations: bool,
    /// Whether the admission webhook set the driver's cgroup limit (`NVIDIA_GPU_MEMORY_LIMIT`) in a container
    /// of this pod at creation (its `gpubudget.io/caps` record says so): then a pod the driver holds no limit
    /// for was not capped as its budget asked, and the agent says so.
    pub caps_expected: bool,
    /// The MPS cap its GPU containers' environment holds it to, as the driver reads the variable, when every
    /// GPU container is capped on every device it sees ([`MpsCap`]: the largest cap, MiB, and the devices it
    /// names). The agent checks that such a cap is in force ([`crate::decide::cap_check`]).
    pub mps_cap_mib: Option<MpsCap>,
    /// The share of GPU memory the tool that placed the pod declared (KAI-Scheduler's annotations, HAMi's
    /// resources), read once from the whole pod ([`gpubudget_common::share::declared`]); a budget with
    /// `spec.share` takes the pod's limit from it ([`PodTable::from_index`]).
    pub share: Declaration,
    /// What the container runtime gave its GPU containers (`--runtime-caps`): set by the agent's own table build
    /// from what its NRI plugin saw, never read from the pod; when set, `mps_cap_mib` is the runtime's cap.
    pub runtime_caps: Option<gpubudget_common::pod_record::RuntimeCapsRecord>,
}

/// Where [`slim_pod`] keeps [`PodView::mps_cap_mib`] once the containers are dropped: a key of the agent's
/// memory only, never written to the API. `slim_pod` sets or removes it on every event, so whatever a pod
/// carries under that name is never read (and the records policy keeps anyone but the agent from writing
/// `gpubudget.io/` keys on pods).
const SLIM_MPS_CAP: &str = "gpubudget.io/agent-slim-mps-cap-mib";
/// Where [`slim_pod`] keeps [`PodView::share`] once the annotations and containers it is read from are
/// dropped; as for [`SLIM_MPS_CAP`], set or removed on every event, never read from what a pod carries.
const SLIM_SHARE: &str = "gpubudget.io/agent-slim-share";

/// Strips `containerd://`, `cri-o://`, `docker://` (any scheme) and lowercases.
pub fn strip_container_scheme(id: &str) -> String {
    id.rsplit_once("://").map_or(id, |(_, rest)| rest).to_ascii_lowercase()
}

impl PodView {
    /// Why this pod is never evicted, if it is: critical (by priority class or priority, which admission
    /// controls) in a namespace the administrator lists, or a static pod's mirror (`kubernetes.io/config.mirror`): evicting or deleting a mirror
    /// deletes only the mirror, the kubelet runs the static pod on (#11). A pod created through the API with
    /// that annotation is not run by any kubelet, so it holds no GPU memory to protect.
    /// Critical priority counts only in the namespaces `critical` lists (#33).
    pub fn never_evicted(&self, critical: &CriticalNamespaces) -> Option<&'static str> {
        if self.critical && critical.exempts(&self.namespace) {
            Some("the pod is critical and is never evicted")
        } else if self.mirror_of.is_some() {
            Some("the pod is a static pod (evicting its mirror would delete only the mirror) and is never evicted")
        } else {
            None
        }
    }

    /// From a Pod object; `None` without a UID, name or namespace, or when it has finished (Succeeded or
    /// Failed: no process left to account for).
    pub fn from_pod(pod: &Pod) -> Option<Self> {
        let meta = &pod.metadata;
        let (uid, name, namespace) = (meta.uid.as_deref()?, meta.name.as_deref()?, meta.namespace.as_deref()?);
        let status = pod.status.as_ref();
        if matches!(status.and_then(|s| s.phase.as_deref()), Some("Succeeded" | "Failed")) {
            return None;
        }
        let spec = pod.spec.as_ref();
        let containers = status
            .into_iter()
            .flat_map(|s| {
                s.init_container_statuses
                    .iter()
                    .flatten()
                    .chain(s.container_statuses.iter().flatten())
                    .chain(s.ephemeral_container_statuses.iter().flatten())
            })
            .filter_map(|c| {
                let id = c.container_id.as_deref().filter(|i| !i.is_empty())?;
                Some(ContainerView { id: strip_container_scheme(id), name: Arc::from(c.name.as_str()) })
            })
            .collect();
        let annotations = meta.annotations.as_ref();
        Some(Self {
            uid: Arc::from(uid.to_ascii_lowercase()),
            namespace: Arc::from(namespace),
            name: Arc::from(name),
            node: spec.and_then(|s| s.node_name.clone()),
            labels: meta.labels.clone().unwrap_or_default(),
            critical: is_critical(spec.and_then(|s| s.priority_class_name.as_deref()), spec.and_then(|s| s.priority)),
            terminating: meta.deletion_timestamp.is_some(),
            termination_grace_seconds: spec.and_then(|s| s.termination_grace_period_seconds),
            containers,
            mirror_of: annotations.and_then(|a| a.get(MIRROR_ANNOTATION)).map(|m| m.to_ascii_lowercase()),
            record: annotations.and_then(PodRecord::from_annotations),
            has_annotations: annotations.is_some_and(|a| pod_record::ALL.iter().any(|k| a.contains_key(*k))),
            caps_expected: caps::record_of(pod)
                .is_some_and(|r| r.containers.iter().any(|c| c.env.contains_key(caps::MEMORY_LIMIT))),
            mps_cap_mib: match spec {
                Some(s) if !s.containers.is_empty() => MpsCap::of_pod(pod),
                _ => annotations.and_then(|a| a.get(SLIM_MPS_CAP)).and_then(|v| MpsCap::decode(v).ok()),
            },
            share: match spec {
                Some(s) if !s.containers.is_empty() => share::declared_by_pod(pod, share::Sources::ALL),
                _ => annotations
                    .and_then(|a| a.get(SLIM_SHARE))
                    .and_then(|v| Declaration::decode(v).ok())
                    .unwrap_or(Declaration::None),
            },
            runtime_caps: None,
        })
    }

    /// The name of the container with this ID.
    pub fn container_by_id(&self, id: &str) -> Option<&Arc<str>> {
        self.containers.iter().find(|c| c.id == id).map(|c| &c.name)
    }

    /// `namespace/name`.
    pub fn key(&self) -> String {
        format!("{}/{}", self.namespace, self.name)
    }
}

/// Keeps of a pod only what [`PodView::from_pod`] reads, for the agent's pod cache: its name, namespace,
/// UID, labels, deletion timestamp, the `gpubudget.io/` and mirror annotations; the spec's node, priority
/// and grace period; the status' phase and each container's name and ID. Everything else (managed fields,
/// `kubectl.kubernetes.io/last-applied-configuration`, containers, volumes, env, conditions, container
/// states) is dropped as the watch delivers it, so a cache of 1 000 pods costs what 1 000 `PodView`s need.
/// Of the containers' GPU limits and cap variables only the verdict is kept ([`PodView::mps_cap_mib`]).
///
/// The pod's declared share is kept as the pod declares it ([`gpubudget_common::share::declared_by_pod`]): the
/// node's labels, which say whether GPU replicas are MPS replicas, are read when the table is built.
pub fn slim_pod(pod: &mut Pod) {
    use k8s_openapi::api::core::v1::{ContainerStatus, PodSpec, PodStatus};
    let mps_cap = pod.spec.as_ref().filter(|s| !s.containers.is_empty()).map(|_| MpsCap::of_pod(pod));
    let declared = pod
        .spec
        .as_ref()
        .filter(|s| !s.containers.is_empty())
        .map(|_| share::declared_by_pod(pod, share::Sources::ALL));
    let meta = &mut pod.metadata;
    meta.managed_fields = None;
    meta.owner_references = None;
    meta.finalizers = None;
    meta.generate_name = None;
    if let Some(annotations) = meta.annotations.as_mut() {
        // A pod with containers has its verdict computed afresh below; a slim pod (none) keeps its own.
        annotations.retain(|k, _| {
            (k.starts_with("gpubudget.io/")
                && (k != SLIM_MPS_CAP || mps_cap.is_none())
                && (k != SLIM_SHARE || declared.is_none()))
                || k == MIRROR_ANNOTATION
        });
    }
    if let Some(cap) = mps_cap.flatten() {
        meta.annotations.get_or_insert_default().insert(SLIM_MPS_CAP.to_owned(), cap.encode());
    }
    if let Some(d) = declared.filter(|d| *d != Declaration::None) {
        meta.annotations.get_or_insert_default().insert(SLIM_SHARE.to_owned(), d.encode());
    }
    if let Some(spec) = pod.spec.as_mut() {
        *spec = PodSpec {
            node_name: spec.node_name.take(),
            priority_class_name: spec.priority_class_name.take(),
            priority: spec.priority,
            termination_grace_period_seconds: spec.termination_grace_period_seconds,
            ..PodSpec::default()
        };
    }
    if let Some(status) = pod.status.as_mut() {
        let slim = |statuses: Option<Vec<ContainerStatus>>| {
            statuses.map(|s| {
                s.into_iter()
                    .map(|c| ContainerStatus {
                        name: c.name,
                        container_id: c.container_id,
                        ..ContainerStatus::default()
                    })
                    .collect()
            })
        };
        *status = PodStatus {
            phase: status.phase.take(),
            init_container_statuses: slim(status.init_container_statuses.take()),
            container_statuses: slim(status.container_statuses.take()),
            ephemeral_container_statuses: slim(status.ephemeral_container_statuses.take()),
            ..PodStatus::default()
        };
    }
}

/// The pods of the node, their budgets, and the indexes the join uses.
#[derive(Debug, Default)]
pub struct PodTable {
    /// Pods, in a stable order (namespace, name).
    pub pods: Vec<PodView>,
    /// The valid budgets of the namespaces that have pods here.
    pub budgets: Vec<Arc<Budget>>,
    /// Per pod, the index in `budgets` of the rules that apply: its budget's, or (after the namespaces' runs)
    /// its budget's tightened by the cluster budgets that also select it ([`gpubudget_common::Resolution`]).
    pub budget_of: Vec<Option<usize>>,
    /// Per pod, whether a cluster budget (an administrator's) selects it.
    pub cluster_selected: Vec<bool>,
    /// Budgets that failed validation, with why.
    pub invalid_budgets: Vec<(String, SpecError)>,
    /// What the node's label `gpubudget.io/enforcement` says (#54): `None` where unset, not read yet, or not
    /// `Observe` or `Enforce` (the agent's `--enforcement` then applies).
    pub node_enforcement: Option<gpubudget_common::Enforcement>,
    by_uid: FastMap<String, usize>,
    by_name: FastMap<(String, String), usize>,
}

impl PodTable {
    /// Builds the table, compiling the budgets. With `node`, pods bound to another node are left out.
    pub fn build<'a>(
        pods: impl IntoIterator<Item = PodView>,
        budgets: impl IntoIterator<Item = &'a GpuMemoryBudget>,
        node: Option<&str>,
    ) -> Self {
        Self::from_index(pods, &BudgetIndex::of(budgets), &ClusterIndex::default(), node, &[])
    }

    /// Builds the table from budgets already compiled: each pod is resolved among its namespace's budgets
    /// and the cluster budgets (#23), with its namespace's labels. The cluster budgets come first in
    /// `budgets`, once; then each namespace's, once. A budget with `spec.share` gives a pod that declares a
    /// share rules of its own ([`Budget::for_declared`], on GPUs of `gpu_totals` bytes: empty while the
    /// node's GPUs are not known, which leaves a fraction unresolved), resolved among the others as any budget
    /// is, so the smallest limit still wins.
    pub fn from_index(
        pods: impl IntoIterator<Item = PodView>,
        index: &BudgetIndex,
        cluster: &ClusterIndex,
        node: Option<&str>,
        gpu_totals: &[u64],
    ) -> Self {
        let mut pods: Vec<PodView> =
            pods.into_iter().filter(|p| node.is_none() || p.node.is_none() || p.node.as_deref() == node).collect();
        pods.sort_by(|a, b| (&a.namespace, &a.name).cmp(&(&b.namespace, &b.name)));
        let mut budgets: Vec<Arc<Budget>> = cluster.valid().cloned().collect();
        let clusters = budgets.len();
        // Pods are sorted by namespace: each namespace's budgets are taken once, as a run of `budgets`.
        let mut run: (Option<&str>, std::ops::Range<usize>) = (None, 0..0);
        let mut budget_of = Vec::with_capacity(pods.len());
        let mut cluster_selected = Vec::with_capacity(pods.len());
        let mut tightened_index: FastMap<(Option<usize>, String), usize> = FastMap::default();
        for p in &pods {
            if run.0 != Some(&*p.namespace) {
                let start = budgets.len();
                budgets.extend(index.valid_in(&p.namespace).cloned());
                run = (Some(&*p.namespace), start..budgets.len());
            }
            let candidates = (0..clusters).chain(run.1.clone());
            let pod = PodLabels::new(&p.namespace, cluster.labels_of(&p.namespace), &p.labels);
            // A pod that declares a share gets rules of its own from a budget that takes one
            // (gpubudget_common::budget::with_declared); any other is resolved among the budgets as they are,
            // without a copy.
            // The share the agent first held the pod to, as its record carries it (only the agent writes records:
            // the chart's records policy): a later declaration never loosens it (#51).
            let first = p.record.as_ref().and_then(|r| r.share.as_ref()).filter(|h| h.resolved());
            let resolved = if p.share == Declaration::None && first.is_none() {
                resolve(candidates.clone().map(|i| &*budgets[i]), &pod).map(|r| {
                    let named = candidates.clone().find(|i| std::ptr::eq(&*budgets[*i], r.budget));
                    (named, None, r.tightened, r.cluster_selected)
                })
            } else {
                let rules = gpubudget_common::budget::with_declared_since(
                    candidates.clone().map(|i| &*budgets[i]),
                    &p.share,
                    gpu_totals,
                    first,
                );
                resolve(rules.iter().map(|r| r.as_ref()), &pod).map(|r| {
                    let j = rules.iter().position(|b| std::ptr::eq(b.as_ref(), r.budget));
                    let owned = j.and_then(|j| match &rules[j] {
                        std::borrow::Cow::Owned(b) => Some(b.clone()),
                        std::borrow::Cow::Borrowed(_) => None,
                    });
                    (j.and_then(|j| candidates.clone().nth(j)), owned, r.tightened, r.cluster_selected)
                })
            };
            // Rules of their own — a cluster budget tightened them (#33), or a share made them — get an entry
            // after the run, shared by every pod they apply to (the same named budget, tightened by the same
            // cluster budgets, with the same share).
            let mut entry = |named: Option<usize>, rules: Budget| {
                let key = (
                    named,
                    format!(
                        "{:?}|{:?}|{}|{:?}|{:?}",
                        rules.tightened_by,
                        rules.held_share.as_ref().map(|h| &h.note),
                        rules.limit_bytes,
                        rules.request_bytes,
                        rules.share_kept
                    ),
                );
                *tightened_index.entry(key).or_insert_with(|| {
                    budgets.push(Arc::new(rules));
                    budgets.len() - 1
                })
            };
            let applies = match resolved {
                None => None,
                Some((named, None, None, cluster)) => named.map(|i| (i, cluster)),
                Some((named, Some(owned), None, cluster)) => Some((entry(named, owned), cluster)),
                Some((named, _, Some(tightened), cluster)) => Some((entry(named, tightened), cluster)),
            };
            budget_of.push(applies.map(|(i, _)| i));
            cluster_selected.push(applies.is_some_and(|(_, cluster)| cluster));
        }
        let mut by_uid = FastMap::with_capacity_and_hasher(pods.len(), Default::default());
        let mut by_name = FastMap::with_capacity_and_hasher(pods.len(), Default::default());
        for (i, p) in pods.iter().enumerate() {
            by_uid.insert(p.uid.to_string(), i);
            if let Some(m) = &p.mirror_of {
                by_uid.entry(m.clone()).or_insert(i);
            }
            by_name.insert((p.namespace.to_string(), p.name.to_string()), i);
        }
        let mut invalid_budgets = index.invalid();
        invalid_budgets.extend(cluster.invalid());
        Self { pods, budgets, budget_of, cluster_selected, invalid_budgets, node_enforcement: None, by_uid, by_name }
    }

    /// The pod whose UID (or static pod UID) this is.
    pub fn find_uid(&self, uid: &str) -> Option<usize> {
        self.by_uid.get(uid).copied()
    }

    /// The pod `namespace/name`.
    pub fn find_name(&self, namespace: &str, name: &str) -> Option<usize> {
        self.by_name.get(&(namespace.to_owned(), name.to_owned())).copied()
    }

    /// Whether a cluster budget (an administrator's) selects pod `i`.
    pub fn cluster_selects(&self, i: usize) -> bool {
        self.cluster_selected.get(i).copied().unwrap_or(false)
    }

    /// The budget that applies to pod `i`.
    pub fn budget(&self, i: usize) -> Option<&Budget> {
        self.budget_of.get(i).copied().flatten().and_then(|b| self.budgets.get(b)).map(|b| &**b)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    pub(crate) fn pod(yaml: &str) -> Pod {
        serde_yaml::from_str(yaml).expect("pod fixture")
    }

    #[test]
    fn reads_what_enforcement_needs() {
        let p = pod(r#"
metadata:
  name: llm-0
  namespace: team-a
  uid: 5A1E3C9D-7B2F-4E8A-9C61-0D3F2B7A8E41
  labels: {app: llm}
  annotations: {gpubudget.io/state: Over, gpubudget.io/usage-bytes: "9000", gpubudget.io/budget: b, gpubudget.io/node: n1}
spec:
  nodeName: n1
  priorityClassName: system-node-critical
  terminationGracePeriodSeconds: 45
  containers: [{name: main}]
status:
  containerStatuses:
  - {name: main, containerID: "containerd://A3F1", image: x, imageID: x, ready: true, restartCount: 0}
  - {name: sidecar, image: x, imageID: x, ready: false, restartCount: 0}
"#);
        let v = PodView::from_pod(&p).expect("view");
        assert_eq!(&*v.uid, "5a1e3c9d-7b2f-4e8a-9c61-0d3f2b7a8e41");
        assert!(v.critical && !v.terminating);
        assert_eq!(v.containers, vec![ContainerView { id: "a3f1".into(), name: Arc::from("main") }]);
        assert_eq!(v.record.as_ref().map(|r| r.usage_bytes), Some(9000));
        assert_eq!(v.termination_grace_seconds, Some(45));
        assert_eq!(strip_container_scheme("cri-o://ABC"), "abc");
        assert_eq!(strip_container_scheme("docker://x"), "x");
        assert_eq!(strip_container_scheme("plain"), "plain");
    }

    #[test]
    fn the_slim_cache_reads_the_same_as_the_full_objects() {
        let full = pod(r#"
metadata:
  name: llm-0
  namespace: team-a
  uid: 5a1e3c9d-7b2f-4e8a-9c61-0d3f2b7a8e41
  generateName: llm-
  deletionTimestamp: "2026-01-01T00:00:00Z"
  labels: {app: llm}
  annotations:
    gpubudget.io/state: Evicting
    gpubudget.io/usage-bytes: "9000"
    gpubudget.io/budget: b
    gpubudget.io/node: n1
    gpubudget.io/eviction-requested-at: "2026-01-01T00:00:00Z"
    kubernetes.io/config.mirror: HASH
    kubectl.kubernetes.io/last-applied-configuration: '{"a very": "long copy of the pod"}'
  ownerReferences: [{apiVersion: apps/v1, kind: StatefulSet, name: llm, uid: x}]
  finalizers: [example.com/f]
  managedFields: [{manager: kubectl, operation: Apply, apiVersion: v1}]
spec:
  nodeName: n1
  priority: 2000001000
  priorityClassName: system-node-critical
  terminationGracePeriodSeconds: 45
  containers: [{name: main, image: vllm, env: [{name: A, value: b}], args: [serve, --a-long-list]}]
  initContainers: [{name: init, image: busybox}]
  volumes: [{name: v, emptyDir: {}}]
status:
  phase: Running
  podIP: 10.0.0.1
  conditions: [{type: Ready, status: "True"}]
  initContainerStatuses:
  - {name: init, containerID: "containerd://B1", image: busybox, imageID: x, ready: false, restartCount: 0, state: {terminated: {exitCode: 0}}}
  containerStatuses:
  - {name: main, containerID: "containerd://A3F1", image: vllm, imageID: x, ready: true, restartCount: 2, state: {running: {}}}
  - {name: sidecar, image: x, imageID: x, ready: false, restartCount: 0}
"#);
        let mut slim = full.clone();
        slim_pod(&mut slim);
        assert_eq!(PodView::from_pod(&slim), PodView::from_pod(&full));
        let view = PodView::from_pod(&slim).expect("view");
        assert!(view.critical && view.terminating && view.record.is_some() && view.mirror_of.is_some());
        assert_eq!(view.containers.len(), 2);
        assert!(slim.metadata.managed_fields.is_none() && slim.metadata.owner_references.is_none());
        assert_eq!(slim.metadata.annotations.as_ref().map(BTreeMap::len), Some(6), "the record and the mirror");
        assert!(slim.spec.as_ref().is_some_and(|s| s.containers.is_empty() && s.volumes.is_none()));
        assert!(slim.status.as_ref().is_some_and(|s| s.conditions.is_none() && s.pod_ip.is_none()));
        let full_size = serde_json::to_string(&full).expect("json").len();
        let slim_size = serde_json::to_string(&slim).expect("json").len();
        assert!(slim_size * 3 < full_size * 2, "{slim_size} of {full_size} bytes");
        // A finished pod stays finished.
        let mut done =
            pod("metadata: {name: d, namespace: a, uid: u}\nspec: {containers: []}\nstatus: {phase: Failed}");
        slim_pod(&mut done);
        assert!(PodView::from_pod(&done).is_none());
    }

    #[test]
    fn caps_are_expected_only_where_the_webhook_set_the_drivers_cgroup_limit() {
        let with = |caps: &str| {
            let p = pod(&format!(
                "metadata: {{name: a, namespace: n, uid: u, annotations: {{gpubudget.io/caps: '{caps}'}}}}\nspec: {{containers: []}}"
            ));
            let mut slim = p.clone();
            slim_pod(&mut slim);
            assert_eq!(PodView::from_pod(&slim), PodView::from_pod(&p), "kept by the slim copy");
            PodView::from_pod(&slim).expect("view").caps_expected
        };
        let set = r#"{"budget":"b","limitMib":8192,"containers":[{"name":"m","devices":1,"env":{"NVIDIA_GPU_MEMORY_LIMIT":"set","CUDA_MPS_PINNED_DEVICE_MEM_LIMIT":"set"}}]}"#;
        let mps_only = r#"{"budget":"b","limitMib":8192,"containers":[{"name":"m","devices":1,"env":{"CUDA_MPS_PINNED_DEVICE_MEM_LIMIT":"kept"}}]}"#;
        let no_gpu = r#"{"budget":"b","limitMib":8192,"containers":[]}"#;
        assert!(with(set));
        assert!(!with(mps_only), "an MPS cap only is not a driver cgroup limit");
        assert!(!with(no_gpu));
        assert!(!with("not json"), "an unreadable record expects nothing");
        let none = pod("metadata: {name: a, namespace: n, uid: u}\nspec: {containers: []}");
        assert!(!PodView::from_pod(&none).expect("view").caps_expected);
    }

    /// #32: the MPS cap the driver reads from the environment, kept as a verdict by the slim copy; a pod's own
    /// annotation under the slim key is never read.
    #[test]
    fn the_mps_cap_is_read_from_the_environment_and_survives_the_slim_copy() {
        let with = |env: &str, annotations: &str| {
            let p = pod(&format!(
                "metadata: {{name: a, namespace: n, uid: u, annotations: {{{annotations}}}}}\n\
                 spec: {{containers: [{{name: m, image: x, resources: {{limits: {{nvidia.com/gpu: '1'}}}}, env: [{env}]}}]}}"
            ));
            let mut slim = p.clone();
            slim_pod(&mut slim);
            let (full, slim) = (PodView::from_pod(&p).expect("view"), PodView::from_pod(&slim).expect("view"));
            assert_eq!(full.mps_cap_mib, slim.mps_cap_mib, "kept by the slim copy");
            slim.mps_cap_mib
        };
        let forged = "gpubudget.io/agent-slim-mps-cap-mib: '1'";
        let one = |mib| Some(MpsCap { mib, devices: 1 });
        assert_eq!(with("{name: CUDA_MPS_PINNED_DEVICE_MEM_LIMIT, value: 0=3072M}", ""), one(3072));
        assert_eq!(with("{name: CUDA_MPS_PINNED_DEVICE_MEM_LIMIT, value: 0=3072M}", forged), one(3072));
        assert_eq!(with("{name: CUDA_MPS_PINNED_DEVICE_MEM_LIMIT, value: 3G}", forged), None, "ignored by the driver");
        assert_eq!(
            with("{name: CUDA_MPS_PINNED_DEVICE_MEM_LIMIT, value: '0=3072M,1=3072M'}", ""),
            None,
            "unseen ordinal"
        );
        assert_eq!(with("{name: OTHER, value: x}", forged), None, "no variable");
        // A slim copy sliced again keeps its verdict.
        let mut twice = pod(
            "metadata: {name: a, namespace: n, uid: u}\nspec: {containers: [{name: m, image: x, resources: {limits: \
             {nvidia.com/gpu: '1'}}, env: [{name: CUDA_MPS_PINNED_DEVICE_MEM_LIMIT, value: 0=8G}]}]}",
        );
        slim_pod(&mut twice);
        slim_pod(&mut twice);
        assert_eq!(PodView::from_pod(&twice).expect("view").mps_cap_mib, Some(MpsCap { mib: 8192, devices: 1 }));
        // The devices the value names, kept too: the fewest of any GPU container.
        let mut two =
            pod("metadata: {name: a, namespace: n, uid: u}\nspec: {nodeSelector: {nvidia.com/gpu.replicas: '1'}, \
             initContainers: [{name: w, image: x, resources: {limits: {nvidia.com/gpu: '1'}}, env: [{name: \
             CUDA_MPS_PINNED_DEVICE_MEM_LIMIT, value: 0=1G}]}], containers: [{name: m, image: x, resources: {limits: \
             {nvidia.com/gpu: '2'}}, env: [{name: CUDA_MPS_PINNED_DEVICE_MEM_LIMIT, value: '0=3G,1=3G'}]}]}");
        assert_eq!(PodView::from_pod(&two).expect("view").mps_cap_mib, Some(MpsCap { mib: 3072, devices: 1 }));
        slim_pod(&mut two);
        assert_eq!(PodView::from_pod(&two).expect("view").mps_cap_mib, Some(MpsCap { mib: 3072, devices: 1 }));
    }

    /// The slim copy keeps a cap as `<MiB>/<devices>` ([`MpsCap::encode`]): pinned, and refused with the reason
    /// where it is not that form.
    #[test]
    fn an_mps_cap_is_encoded_as_it_always_was() {
        assert_eq!(MpsCap { mib: 8192, devices: 1 }.encode(), "8192/1");
        assert_eq!(MpsCap::decode("3072/2"), Ok(MpsCap { mib: 3072, devices: 2 }));
        for (bad, why) in [
            ("8192", MpsCapDecodeError::Form("8192".into())),
            ("x/1", MpsCapDecodeError::Number("x".into())),
            ("1/", MpsCapDecodeError::Number(String::new())),
            ("1/0", MpsCapDecodeError::Devices("1/0".into())),
            ("1/4294967296", MpsCapDecodeError::Devices("1/4294967296".into())),
            ("1/2/3", MpsCapDecodeError::Number("2/3".into())),
        ] {
            assert_eq!(MpsCap::decode(bad), Err(why), "{bad}");
        }
    }

    proptest::proptest! {
        /// Whatever cap the slim copy keeps, it reads back the same.
        #[test]
        fn every_mps_cap_survives_the_slim_copy(mib in proptest::prelude::any::<u64>(), devices in 1u32..) {
            let cap = MpsCap { mib, devices };
            proptest::prop_assert_eq!(MpsCap::decode(&cap.encode()), Ok(cap));
        }
    }

    /// #33: pods labelled into a cluster budget that another cluster budget tightens share one entry of the
    /// tightened rules; the budget they are named by keeps its own.
    #[test]
    fn tightened_rules_are_one_entry_shared_by_their_pods() {
        let cgmb = |name: &str, rest: &str| -> gpubudget_common::ClusterGpuMemoryBudget {
            serde_yaml::from_str(&format!(
                "apiVersion: gpubudget.io/v1alpha1\nkind: ClusterGpuMemoryBudget\nmetadata: {{name: {name}}}\n\
                 spec: {{namespaceSelector: {{}}, {rest}}}"
            ))
            .expect("fixture")
        };
        let lax = cgmb("lax", "selector: {matchLabels: {tier: batch}}, limit: 6Gi, action: Warn");
        let admin = cgmb("admin", "selector: {}, limit: 8Gi");
        let view = |ns: &str, name: &str, labels: &str| {
            PodView::from_pod(&pod(&format!(
                "metadata: {{name: {name}, namespace: {ns}, uid: u-{ns}-{name}, labels: {labels}}}\nspec: {{nodeName: n1}}"
            )))
            .expect("view")
        };
        let pods = [view("a", "p1", "{tier: batch}"), view("b", "p2", "{tier: batch}"), view("a", "p3", "{}")];
        let table =
            PodTable::from_index(pods, &BudgetIndex::default(), &ClusterIndex::of([&lax, &admin], []), Some("n1"), &[]);
        let (p1, p2, p3) = (table.find_name("a", "p1"), table.find_name("b", "p2"), table.find_name("a", "p3"));
        let (p1, p2, p3) = (p1.expect("p1"), p2.expect("p2"), p3.expect("p3"));
        assert_eq!(table.budget_of[p1], table.budget_of[p2], "one shared entry");
        let tightened = table.budget(p1).expect("applies");
        assert_eq!((tightened.name.as_str(), tightened.action), ("lax", gpubudget_common::BudgetAction::Evict));
        assert!(tightened.tightened_by.is_some());
        assert_eq!(table.budget(p3).map(|b| (b.name.as_str(), b.tightened_by.is_none())), Some(("admin", true)));
        assert_eq!(table.budgets.iter().filter(|b| b.tightened_by.is_some()).count(), 1);
        assert!(table.cluster_selects(p1) && table.cluster_selects(p3));
    }

    #[test]
    fn a_share_budget_holds_each_pod_to_its_declared_share_and_the_smallest_limit_still_wins() {
        const H100: u64 = 81_559 << 20;
        let shares: GpuMemoryBudget = serde_yaml::from_str(
            "apiVersion: gpubudget.io/v1alpha1\nkind: GpuMemoryBudget\nmetadata: {name: shares, namespace: a}\n\
             spec: {selector: {}, limit: 80Gi, share: {}}",
        )
        .expect("budget");
        let tight: GpuMemoryBudget = serde_yaml::from_str(
            "apiVersion: gpubudget.io/v1alpha1\nkind: GpuMemoryBudget\nmetadata: {name: tight, namespace: a}\n\
             spec: {selector: {matchLabels: {team: small}}, limit: 30Gi}",
        )
        .expect("budget");
        let kai = |name: &str, annotations: &str, labels: &str| {
            let mut p = pod(&format!(
                "metadata: {{name: {name}, namespace: a, uid: u-{name}, labels: {labels}, annotations: {annotations}}}\n\
                 spec: {{nodeName: n1, schedulerName: kai-scheduler, containers: [{{name: c, image: i}}]}}"
            ));
            slim_pod(&mut p); // as the agent's cache keeps it: the share survives the dropped annotations
            PodView::from_pod(&p).expect("view")
        };
        let pods = [
            kai("half", "{gpu-fraction: '0.5'}", "{}"),
            kai("quarter", "{gpu-fraction: '0.25'}", "{}"),
            kai("half-small-team", "{gpu-fraction: '0.5'}", "{team: small}"),
            kai("none", "{}", "{}"),
            kai("hostile", "{gpu-fraction: '1e400'}", "{}"),
        ];
        let table = PodTable::from_index(
            pods.clone(),
            &BudgetIndex::of([&shares, &tight]),
            &ClusterIndex::default(),
            Some("n1"),
            &[H100],
        );
        let of = |name: &str| table.budget(table.find_name("a", name).expect(name)).expect("a budget applies");
        assert_eq!((of("half").limit_bytes, of("half").request_bytes), (H100 / 2, Some(H100 / 2)));
        assert_eq!(of("half").described(), "budget a/shares: KAI gpu-fraction 0.5 of 79.6Gi = 39.8Gi");
        assert_eq!(of("quarter").limit_bytes, H100 / 4);
        let small = of("half-small-team");
        assert_eq!(
            (small.name.as_str(), small.limit_bytes),
            ("tight", 30 << 30),
            "30Gi is smaller than its 39.8Gi share"
        );
        assert_eq!((of("none").limit_bytes, of("none").held_share.as_ref()), (80 << 30, None));
        let hostile = of("hostile");
        assert_eq!(hostile.limit_bytes, 80 << 30, "never a guessed share: the budget's limit");
        assert!(
            hostile.described().contains("share unresolved: gpu-fraction: \"1e400\" is not a decimal"),
            "{}",
            hostile.described()
        );
        // Before NVML answers, a fraction is unresolved (the limit), never a guess; absolute shares need no GPU.
        let early =
            PodTable::from_index(pods, &BudgetIndex::of([&shares, &tight]), &ClusterIndex::default(), Some("n1"), &[]);
        let half = early.budget(early.find_name("a", "half").expect("half")).expect("applies");
        assert_eq!(half.limit_bytes, 80 << 30);
        assert!(half.described().contains("the node's GPU memory is not known yet"));
        assert_eq!(table.budgets.iter().filter(|b| b.held_share.is_some()).count(), 3, "half, quarter, hostile");
    }

    #[test]
    fn a_tenant_share_budget_never_loosens_a_cluster_budget() {
        const H100: u64 = 81_559 << 20;
        let tenant: GpuMemoryBudget = serde_yaml::from_str(
            "apiVersion: gpubudget.io/v1alpha1\nkind: GpuMemoryBudget\nmetadata: {name: mine, namespace: a}\n\
             spec: {selector: {}, limit: 80Gi, share: {}}",
        )
        .expect("budget");
        let admin: gpubudget_common::ClusterGpuMemoryBudget = serde_yaml::from_str(
            "apiVersion: gpubudget.io/v1alpha1\nkind: ClusterGpuMemoryBudget\nmetadata: {name: admin}\n\
             spec: {namespaceSelector: {}, selector: {}, limit: 40Gi, request: 10Gi}",
        )
        .expect("cluster budget");
        let mut p = pod("metadata: {name: q, namespace: a, uid: u-q, annotations: {gpu-fraction: '0.25'}}\n\
             spec: {nodeName: n1, schedulerName: kai-scheduler, containers: [{name: c, image: i}]}");
        slim_pod(&mut p);
        let view = PodView::from_pod(&p).expect("view");
        let table = PodTable::from_index(
            [view],
            &BudgetIndex::of([&tenant]),
            &ClusterIndex::of([&admin], []),
            Some("n1"),
            &[H100],
        );
        let applied = table.budget(table.find_uid("u-q").expect("pod")).expect("applies");
        // The share (19.9Gi) is a smaller limit, but its request (19.9Gi) is above the administrator's 10Gi:
        // the tenant's rules would guarantee more, so the cluster budget's apply.
        assert_eq!((applied.name.as_str(), applied.guaranteed_bytes()), ("admin", 10 << 30));
        assert!(table.cluster_selects(0));
    }

    #[test]
    fn joins_by_uid_mirror_and_name_and_resolves_budgets() {
        let a = pod(
            "metadata: {name: a, namespace: team-a, uid: u-a, labels: {app: llm}}\nspec: {nodeName: n1, containers: []}",
        );
        let b = pod(
            "metadata: {name: b, namespace: team-a, uid: u-b, annotations: {kubernetes.io/config.mirror: HASH}}\nspec: {nodeName: n1, containers: []}",
        );
        let elsewhere = pod("metadata: {name: c, namespace: team-a, uid: u-c}\nspec: {nodeName: n2, containers: []}");
        let done = pod(
            "metadata: {name: d, namespace: team-a, uid: u-d}\nspec: {nodeName: n1, containers: []}\nstatus: {phase: Succeeded}",
        );
        let budgets: Vec<GpuMemoryBudget> = [
            "metadata: {name: wide, namespace: team-a}\nspec: {selector: {}, limit: 16Gi}",
            "metadata: {name: llm, namespace: team-a}\nspec: {selector: {matchLabels: {app: llm}}, limit: 8Gi}",
            "metadata: {name: broken, namespace: team-a}\nspec: {selector: {}, limit: 8 GiB}",
            "metadata: {name: elsewhere, namespace: team-b}\nspec: {selector: {}, limit: 1Gi}",
        ]
        .iter()
        .map(|y| {
            serde_yaml::from_str(&format!("apiVersion: gpubudget.io/v1alpha1\nkind: GpuMemoryBudget\n{y}"))
                .expect("budget")
        })
        .collect();
        let views = [a, b, elsewhere, done].iter().filter_map(PodView::from_pod).collect::<Vec<_>>();
        let table = PodTable::build(views, &budgets, Some("n1"));
        assert_eq!(table.pods.len(), 2, "other node's and finished pods are left out");
        let ia = table.find_uid("u-a").expect("a");
        assert_eq!(table.budget(ia).map(|b| b.name.as_str()), Some("llm"));
        let ib = table.find_uid("hash").expect("mirror pods join by the static pod's UID");
        assert_eq!(table.find_uid("u-b"), Some(ib));
        assert_eq!(table.budget(ib).map(|b| b.name.as_str()), Some("wide"));
        assert_eq!(table.find_name("team-a", "a"), Some(ia));
        assert_eq!(table.find_uid("u-c"), None);
        assert_eq!(table.invalid_budgets.len(), 1);
        let mut kept: Vec<_> = table.budgets.iter().map(|b| b.name.as_str()).collect();
        kept.sort_unstable();
        assert_eq!(kept, ["llm", "wide"], "only the budgets of the namespaces with pods here");
    }

    proptest::proptest! {
        /// Resolving each pod among its own namespace's budgets gives what resolving it among every budget of
        /// the cluster gives (a budget selects pods of its namespace only), and the table keeps no budget of a
        /// namespace without pods here.
        #[test]
        fn per_namespace_resolution_is_resolution_among_all_budgets(
            pods in proptest::collection::vec((0..3usize, 0..3usize), 0..12),
            budgets in proptest::collection::vec((0..3usize, 0..4usize, 1..5u64), 0..12),
        ) {
            let views: Vec<PodView> = pods
                .iter()
                .enumerate()
                .filter_map(|(i, (ns, app))| {
                    PodView::from_pod(&pod(&format!(
                        "metadata: {{name: p{i}, namespace: ns{ns}, uid: u{i}, labels: {{app: a{app}}}}}\nspec: {{nodeName: n1, containers: []}}"
                    )))
                })
                .collect();
            let objects: Vec<GpuMemoryBudget> = budgets
                .iter()
                .enumerate()
                .map(|(i, (ns, app, gib))| {
                    let selector = if *app == 3 { "{}".to_owned() } else { format!("{{matchLabels: {{app: a{app}}}}}") };
                    serde_yaml::from_str(&format!(
                        "apiVersion: gpubudget.io/v1alpha1\nkind: GpuMemoryBudget\nmetadata: {{name: b{i}, namespace: ns{ns}}}\n\
                         spec: {{selector: {selector}, limit: {gib}Gi}}"
                    ))
                    .expect("budget")
                })
                .collect();
            let all: Vec<Budget> = objects.iter().filter_map(|b| Budget::compile(b).ok()).collect();
            let table = PodTable::build(views.clone(), &objects, Some("n1"));
            for (i, view) in table.pods.iter().enumerate() {
                let expected = resolve(&all, &PodLabels::new(&view.namespace, &BTreeMap::new(), &view.labels)).map(|r| r.budget.key());
                proptest::prop_assert_eq!(table.budget(i).map(Budget::key), expected);
            }
            let namespaces: std::collections::BTreeSet<&str> = table.pods.iter().map(|p| &*p.namespace).collect();
            proptest::prop_assert!(table.budgets.iter().all(|b| namespaces.contains(b.namespace.as_str())));
        }
    }
}
