//! The `GpuMemoryBudget` API (`gpubudget.io/v1alpha1`).
//!
//! Doc comments here become the schema descriptions that `kubectl explain gmb.spec` prints, so they are
//! written for the person reading that output.

use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, LabelSelector};
use kube::{CustomResource, KubeSchema};
use serde::{Deserialize, Serialize};

/// The most pods listed in `status.topPods`.
pub const TOP_PODS_MAX: usize = 10;
/// How many evicted pod UIDs `status.countedEvictions` remembers, so an eviction is counted once.
pub const COUNTED_EVICTIONS_MAX: usize = 100;

/// A GPU memory budget for the pods its selector matches, enforced by the gpubudget agent on each node.
///
/// Usage is what NVML reports for a pod's processes: for PyTorch that is the caching allocator's reserved
/// pool plus the CUDA context of each process (about 0.5 GiB on an H100), not
/// `torch.cuda.memory_allocated()`. Size the limit for that.
#[derive(CustomResource, KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[kube(
    group = "gpubudget.io",
    version = "v1alpha1",
    kind = "GpuMemoryBudget",
    plural = "gpumemorybudgets",
    singular = "gpumemorybudget",
    shortname = "gmb",
    category = "gpubudget",
    doc = "A GPU memory budget: a limit on the GPU memory each pod its selector matches may hold, enforced by the gpubudget agent on each node (warn, wait out overLimitSeconds, evict). Usage is what NVML reports for the pod's processes: for PyTorch the caching allocator's reserved pool plus about 0.5 GiB of CUDA context per process, not torch.cuda.memory_allocated().",
    namespaced,
    status = "GpuMemoryBudgetStatus",
    derive = "PartialEq",
    printcolumn = r#"{"name":"Request","type":"string","jsonPath":".spec.request","description":"GPU memory guaranteed to each pod: never evicted within it"}"#,
    printcolumn = r#"{"name":"Limit","type":"string","jsonPath":".spec.limit","description":"GPU memory one pod may hold"}"#,
    printcolumn = r#"{"name":"Action","type":"string","jsonPath":".spec.action","description":"Evict or Warn"}"#,
    printcolumn = r#"{"name":"Enforcement","type":"string","priority":1,"jsonPath":".spec.enforcement","description":"Observe or Enforce its own evictions; empty: as the node says"}"#,
    printcolumn = r#"{"name":"Matched","type":"integer","jsonPath":".status.matchedPods","description":"Pods the selector matches"}"#,
    printcolumn = r#"{"name":"Over","type":"integer","jsonPath":".status.podsOverBudget","description":"Matched pods over the limit now"}"#,
    printcolumn = r#"{"name":"Capped","type":"integer","jsonPath":".status.podsCapped","description":"With admissionCaps: matched pods whose GPU containers carry the driver's caps"}"#,
    printcolumn = r#"{"name":"Uncapped","type":"integer","priority":1,"jsonPath":".status.podsUncapped","description":"With admissionCaps: matched GPU pods created without the caps (webhook down, or before caps were enabled)"}"#,
    printcolumn = r#"{"name":"Share","type":"string","jsonPath":".status.share","description":"With share: the recorded pods by where their declared share came from"}"#,
    printcolumn = r#"{"name":"Evicted","type":"integer","jsonPath":".status.evictions","description":"Pods this budget has evicted"}"#,
    printcolumn = r#"{"name":"Age","type":"date","jsonPath":".metadata.creationTimestamp"}"#
)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = Rule::new("!has(self.request) || !isQuantity(string(self.request)) || !isQuantity(string(self.limit)) || !quantity(string(self.request)).isGreaterThan(quantity(string(self.limit)))").message("request must not be more than limit").field_path(".request"))]
pub struct GpuMemoryBudgetSpec {
    /// Which pods in this namespace the budget applies to: a standard label selector. `{}` selects every
    /// pod in the namespace. A pod matched by several budgets gets the one with the smallest limit, and
    /// that budget's request (none if it sets none).
    #[x_kube(validation = Rule::new("!has(self.matchExpressions) || self.matchExpressions.all(e, e.operator in ['In', 'NotIn', 'Exists', 'DoesNotExist'])").message("selector.matchExpressions[].operator must be one of In, NotIn, Exists, DoesNotExist"))]
    #[x_kube(validation = Rule::new("!has(self.matchExpressions) || self.matchExpressions.all(e, e.operator in ['Exists', 'DoesNotExist'] ? (!has(e.values) || size(e.values) == 0) : (has(e.values) && size(e.values) > 0))").message("selector.matchExpressions[].values must be non-empty for In and NotIn, and empty for Exists and DoesNotExist"))]
    #[schemars(schema_with = "bounded_label_selector")]
    pub selector: LabelSelector,

    /// A quantity of bytes (8Gi, 500Mi or 8589934592): the GPU memory one pod may hold, summed over all its
    /// containers, processes and GPUs. Counted as NVML counts it: the framework's reserved pool plus about
    /// 0.5 GiB of CUDA context per process.
    #[x_kube(validation = Rule::new("isQuantity(string(self)) && quantity(string(self)).isGreaterThan(quantity('0'))").message("limit must be a positive quantity of bytes, such as 8Gi, 500Mi or 8589934592"))]
    pub limit: Quantity,

    /// A quantity of bytes, at most the limit: the GPU memory each pod is guaranteed, as a container's
    /// memory request is for RAM. Under GPU memory pressure on a node, pods are ranked by how far their
    /// usage is above their request and the one most above is evicted first; a pod within its request is
    /// never evicted, for pressure or otherwise. Unset: the limit is the line (only pods over their limit
    /// are evicted for pressure, ranked by how far over).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[x_kube(validation = Rule::new("isQuantity(string(self)) && !quantity(string(self)).isLessThan(quantity('0'))").message("request must be a quantity of bytes, 0 or more, such as 6Gi, 500Mi or 6442450944"))]
    pub request: Option<Quantity>,

    /// Percent of the limit at which the pod is reported as near its budget (an event and a status
    /// count, never an eviction). 1 to 100; default 90.
    #[serde(default = "default_warn_at_percent")]
    #[schemars(range(min = 1, max = 100))]
    #[x_kube(validation = Rule::new("self >= 1 && self <= 100").message("warnAtPercent must be between 1 and 100"))]
    pub warn_at_percent: i32,

    /// What to do when a pod stays over its limit for `overLimitSeconds`: `Evict` (the default) asks the
    /// API server to evict the pod, honouring PodDisruptionBudgets; `Warn` only records events and status.
    #[serde(default)]
    pub action: BudgetAction,

    /// Whether this budget's own evictions (a pod over its limit for `overLimitSeconds`, `action: Evict`) are
    /// carried out: `Enforce` evicts; `Observe` only reports what would be evicted (the event
    /// `GpuMemoryWouldEvict`, the metric `gpubudget_would_evict_total`, `kubectl gpubudget why`) and evicts
    /// nothing. Unset (the default): as the pod's node says (its label `gpubudget.io/enforcement`, else the
    /// agent's `--enforcement`). Pressure relief and pods no budget selects always follow the node. Where several
    /// budgets select a pod, the tighter value applies (`Enforce`, then unset, then `Observe`): a namespace's
    /// `Observe` never loosens a cluster budget.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub enforcement: Option<crate::enforcement::Enforcement>,

    /// How long usage must be over the limit before the action is taken. Seconds, 0 or more; default 10.
    /// Dips do not reset it: time at or under the limit takes back half as much, so an unbroken run acts
    /// after exactly this long and a pod over more than a third of the time acts eventually.
    #[serde(default = "default_over_limit_seconds")]
    #[schemars(range(min = 0))]
    #[x_kube(validation = Rule::new("self >= 0").message("overLimitSeconds must be 0 or more"))]
    pub over_limit_seconds: i64,

    /// The most termination grace, in seconds, given to a pod this budget evicts: the pod gets its own
    /// `terminationGracePeriodSeconds` (30 when unset), at most this (as the kubelet's
    /// `--eviction-max-pod-grace-period`). 1 or more (0, which would kill the pod at once without its shutdown,
    /// is refused). Unset: at most 30 (a pod cannot hold the memory for the hour its own grace period may ask
    /// for).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1))]
    #[x_kube(validation = Rule::new("self >= 1").message("evictionGracePeriodSeconds must be 1 or more (0 would kill the pod without its shutdown); leave it unset for the pod's own terminationGracePeriodSeconds, capped at 30"))]
    pub eviction_grace_period_seconds: Option<i64>,

    /// How long evictions may be refused (a PodDisruptionBudget with no disruption allowed, two
    /// PodDisruptionBudgets selecting the pod, any other refusal) before the agent deletes the pod instead,
    /// with the same grace period, as the kubelet's node-pressure eviction does. Seconds, 0 to 86400.
    /// Unset (the default): PodDisruptionBudgets are always respected, and a pod they protect may hold its
    /// memory for as long as they refuse.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0, max = 86400))]
    #[x_kube(validation = Rule::new("self >= 0 && self <= 86400").message("blockedEvictionTimeoutSeconds must be between 0 and 86400 (a day)"))]
    pub blocked_eviction_timeout_seconds: Option<i64>,

    /// `Enabled`: when a pod this budget applies to is created, the gpubudget operator's admission webhook
    /// sets the driver's memory caps in the environment of each of its GPU containers (those whose limits
    /// ask for `nvidia.com/gpu` or `nvidia.com/gpu.shared`): `CUDA_MPS_PINNED_DEVICE_MEM_LIMIT` (enforced by
    /// an MPS daemon, per process, per device), `NVIDIA_GPU_MEMORY_LIMIT` and, with a request,
    /// `NVIDIA_GPU_MEMORY_REQUEST` (MiB, for the container toolkit's per-cgroup limits on driver R615 and
    /// later). Each GPU container gets the whole limit; a smaller value already set is kept. The values are
    /// fixed when the pod is created: a later change of the limit reaches new pods only, and running pods
    /// are held to it by eviction. `Disabled` (the default): pods are not changed.
    #[serde(default, skip_serializing_if = "AdmissionCaps::is_disabled")]
    pub admission_caps: AdmissionCaps,

    /// Take each pod's limit from the share of GPU memory the tool that placed it declared, instead of
    /// restating it here: KAI-Scheduler's `gpu-fraction` (of each GPU the pod got, resolved on the node
    /// against the GPU's memory as NVML reports it) or `gpu-memory` annotations with
    /// `gpu-fraction-num-devices`; HAMi's `nvidia.com/gpumem` or `nvidia.com/gpumem-percentage` times
    /// `nvidia.com/gpu`; the NVIDIA device plugin's MPS replicas (1/replicas of a GPU each, on nodes labelled
    /// `nvidia.com/gpu.sharing-strategy: mps`). A pod with a share is held to it, at most `limit`, and is
    /// guaranteed it under pressure (its request); a pod declaring none gets `limit` and `request` as
    /// written; a pod whose declaration is malformed is held to `limit` and reported unresolved, with why.
    /// Other budgets selecting the pod still apply: the smallest limit wins. With `admissionCaps: Enabled`, an
    /// absolute share (MiB) is the cap set at admission; a fraction's size is known on the node only, so its
    /// pod is capped at `limit`. Unset: `limit` for every pod.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub share: Option<ShareSpec>,
}

/// Where a budget reads each pod's declared share of GPU memory.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, Hash, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ShareSpec {
    /// The declarations read: `KaiFraction`, `KaiMemory`, `HamiMemory`, `HamiPercentage`, `MpsReplicas`.
    /// Empty or unset (the default): all of them. Where a pod declares several, their sum is its share.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 5))]
    #[schemars(extend("x-kubernetes-list-type" = "set"))]
    pub sources: Vec<crate::share::ShareSource>,
}

/// A GPU memory budget set by a cluster administrator for pods in any namespace: the same fields as a
/// `GpuMemoryBudget`, plus `namespaceSelector`. It applies together with the namespaced budgets under the
/// same rule: among all budgets selecting a pod, the smallest limit wins, so a namespace can tighten a
/// cluster budget but never loosen it.
#[derive(CustomResource, KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[kube(
    group = "gpubudget.io",
    version = "v1alpha1",
    kind = "ClusterGpuMemoryBudget",
    plural = "clustergpumemorybudgets",
    singular = "clustergpumemorybudget",
    shortname = "cgmb",
    category = "gpubudget",
    doc = "A cluster-wide GPU memory budget, for administrators: a limit on the GPU memory each pod its namespaceSelector and selector match may hold, in any namespace, enforced by the gpubudget agent like a GpuMemoryBudget. With namespaced budgets the smallest limit wins, so a namespace can tighten it but never loosen it: a GpuMemoryBudget takes over from it only when it is no looser in any field (limit, request, action, overLimitSeconds, evictionGracePeriodSeconds, blockedEvictionTimeoutSeconds, admissionCaps).",
    status = "GpuMemoryBudgetStatus",
    derive = "PartialEq",
    printcolumn = r#"{"name":"Request","type":"string","jsonPath":".spec.request","description":"GPU memory guaranteed to each pod: never evicted within it"}"#,
    printcolumn = r#"{"name":"Limit","type":"string","jsonPath":".spec.limit","description":"GPU memory one pod may hold"}"#,
    printcolumn = r#"{"name":"Action","type":"string","jsonPath":".spec.action","description":"Evict or Warn"}"#,
    printcolumn = r#"{"name":"Enforcement","type":"string","priority":1,"jsonPath":".spec.enforcement","description":"Observe or Enforce its own evictions; empty: as the node says"}"#,
    printcolumn = r#"{"name":"Matched","type":"integer","jsonPath":".status.matchedPods","description":"Pods the selectors match"}"#,
    printcolumn = r#"{"name":"Over","type":"integer","jsonPath":".status.podsOverBudget","description":"Matched pods over the limit now"}"#,
    printcolumn = r#"{"name":"Capped","type":"integer","jsonPath":".status.podsCapped","description":"With admissionCaps: matched pods whose GPU containers carry the driver's caps"}"#,
    printcolumn = r#"{"name":"Uncapped","type":"integer","priority":1,"jsonPath":".status.podsUncapped","description":"With admissionCaps: matched GPU pods created without the caps (webhook down, or before caps were enabled)"}"#,
    printcolumn = r#"{"name":"Share","type":"string","jsonPath":".status.share","description":"With share: the recorded pods by where their declared share came from"}"#,
    printcolumn = r#"{"name":"Evicted","type":"integer","jsonPath":".status.evictions","description":"Pods this budget has evicted"}"#,
    printcolumn = r#"{"name":"Age","type":"date","jsonPath":".metadata.creationTimestamp"}"#
)]
#[serde(rename_all = "camelCase")]
pub struct ClusterGpuMemoryBudgetSpec {
    /// Which namespaces the budget applies in: a standard label selector on the namespaces' labels.
    /// `{}` (the default) selects every namespace. Only an administrator can label a namespace, so a tenant
    /// cannot move its namespace out of it.
    #[serde(default)]
    #[x_kube(validation = Rule::new("!has(self.matchExpressions) || self.matchExpressions.all(e, e.operator in ['In', 'NotIn', 'Exists', 'DoesNotExist'])").message("namespaceSelector.matchExpressions[].operator must be one of In, NotIn, Exists, DoesNotExist"))]
    #[x_kube(validation = Rule::new("!has(self.matchExpressions) || self.matchExpressions.all(e, e.operator in ['Exists', 'DoesNotExist'] ? (!has(e.values) || size(e.values) == 0) : (has(e.values) && size(e.values) > 0))").message("namespaceSelector.matchExpressions[].values must be non-empty for In and NotIn, and empty for Exists and DoesNotExist"))]
    #[schemars(schema_with = "bounded_label_selector")]
    pub namespace_selector: LabelSelector,

    /// The fields every budget has (`selector` picks pods within the selected namespaces).
    #[serde(flatten)]
    pub budget: GpuMemoryBudgetSpec,
}

/// Whether pods get the driver's memory caps in their environment when they are created.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq, Hash, schemars::JsonSchema)]
pub enum AdmissionCaps {
    /// Set the caps in each GPU container of a pod this budget applies to, at creation.
    Enabled,
    /// Leave pods as they are (the default).
    #[default]
    Disabled,
}

impl AdmissionCaps {
    /// `Disabled`, the default (not written out).
    pub fn is_disabled(&self) -> bool {
        *self == AdmissionCaps::Disabled
    }
}

/// What the agent does with a pod that stays over its budget.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq, Hash, schemars::JsonSchema)]
pub enum BudgetAction {
    /// Evict the pod through the Eviction API (PodDisruptionBudgets apply).
    #[default]
    Evict,
    /// Events and status for being over the limit, no eviction for it. Under GPU memory pressure where a neighbour
    /// is short of its guarantee, its pods are relieved like any others (ranked after `Evict` ones at equal excess).
    Warn,
}

impl std::fmt::Display for BudgetAction {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            BudgetAction::Evict => "Evict",
            BudgetAction::Warn => "Warn",
        })
    }
}

fn default_warn_at_percent() -> i32 {
    90
}

fn default_over_limit_seconds() -> i64 {
    10
}

/// The standard LabelSelector schema with bounds on its lists, so the API server can cost the CEL rules.
fn bounded_label_selector(generator: &mut schemars::SchemaGenerator) -> schemars::Schema {
    let mut schema = generator.subschema_for::<LabelSelector>();
    if let Some(reference) = schema.get("$ref").and_then(|r| r.as_str()).map(str::to_owned) {
        // Inline the definition so the bounds below can be attached to it.
        let name = reference.rsplit('/').next().unwrap_or_default().to_owned();
        if let Some(def) = generator.definitions().get(&name) {
            schema = schemars::Schema::try_from(def.clone()).unwrap_or(schema);
        }
    }
    let bounds = serde_json::json!({"maxItems": 32, "items": {"maxItems": 256}});
    if let Some(expressions) =
        schema.get_mut("properties").and_then(|p| p.get_mut("matchExpressions")).and_then(|m| m.as_object_mut())
    {
        expressions.insert("maxItems".into(), bounds["maxItems"].clone());
        if let Some(values) = expressions
            .get_mut("items")
            .and_then(|i| i.get_mut("properties"))
            .and_then(|p| p.get_mut("values"))
            .and_then(|v| v.as_object_mut())
        {
            values.insert("maxItems".into(), bounds["items"]["maxItems"].clone());
        }
    }
    schema
}

/// What the operator observed for a budget.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct GpuMemoryBudgetStatus {
    /// The `metadata.generation` this status was computed for.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    /// The `metadata.generation` of the spec the nodes enforce: while the agents read the budgets' mirrors, the
    /// one this budget's mirror copies (condition `NodesCurrent` says when it lags the spec, and why);
    /// otherwise this budget's own (the agents read it directly). Unset while unknown.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub enforced_generation: Option<i64>,
    /// Pods the selector matches whose budget this is (after resolving overlaps).
    #[serde(default)]
    pub matched_pods: i64,
    /// Matched pods at or above `warnAtPercent` of the limit.
    #[serde(default)]
    pub pods_near_budget: i64,
    /// Matched pods over the limit, including those being evicted.
    #[serde(default)]
    pub pods_over_budget: i64,
    /// Matched pods using more than the budget's request (candidates for eviction under GPU memory
    /// pressure); unset when the budget sets no request.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pods_above_request: Option<i64>,
    /// With `admissionCaps: Enabled`: matched pods whose every GPU container carries the driver's caps at
    /// most at the limit, read from their environment (fixed at creation, so nobody can fake it later), and
    /// whose node's agent has not seen the cap fail (`podsCapNotInForce`). Unset otherwise.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pods_capped: Option<i64>,
    /// With `admissionCaps: Enabled`: matched pods with a GPU container that carries no MPS cap for some
    /// device it sees (created while the webhook was down or before caps were enabled), or whose cap the
    /// node's agent saw is not in force (`podsCapNotInForce`); eviction still holds them to the limit. Unset
    /// otherwise.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pods_uncapped: Option<i64>,
    /// With `admissionCaps: Enabled`: of `podsUncapped`, the pods whose environment carries a cap that their
    /// node's agent saw is not in force: a process that is no client of the GPU's MPS server (it unset its
    /// variable, uses another pipe directory, or no MPS server runs), or one holding more than its cap. The
    /// pod's `gpubudget.io/cap-not-in-force` annotation says which. Unset otherwise.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pods_cap_not_in_force: Option<i64>,
    /// With `admissionCaps: Enabled`: matched pods capped above the limit (the limit was lowered after they
    /// were created; eviction holds them to the new one). Unset otherwise.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pods_capped_above_limit: Option<i64>,
    /// With `share`: matched pods whose limit is their declared share, as their node's agent resolved it on the
    /// GPUs they got (counted from the agents' records: a pod counts once its agent has seen it on a GPU).
    /// Unset otherwise.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pods_on_share: Option<i64>,
    /// With `share`: matched pods whose declared share could not be resolved (a malformed or out-of-range value,
    /// or a fraction before the node knows its GPUs' sizes), held to `limit` instead; their events say why.
    /// Unset otherwise.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pods_share_unresolved: Option<i64>,
    /// With `share`: the recorded pods by where their share came from, e.g. `KAI gpu-fraction 2, HAMi gpumem 1,
    /// unresolved 1` (`none recorded` while no agent has recorded a pod under this budget). Unset otherwise.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub share: Option<String>,
    /// Pods this budget has evicted since it was created (each pod counted once).
    #[serde(default)]
    pub evictions: i64,
    /// The most recent eviction this budget caused.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_eviction: Option<EvictionRecord>,
    /// The matched pods with the highest GPU memory usage, highest first (at most 10).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 10))]
    pub top_pods: Vec<TopPod>,
    /// UIDs of recently evicted pods already counted in `evictions`, newest last (bookkeeping that keeps
    /// the count exact across operator restarts; at most 100).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 100))]
    pub counted_evictions: Vec<String>,
    /// `Ready` (the spec is valid and enforced) and `Overlapping` (some matched pod is also matched by
    /// another budget).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub conditions: Vec<Condition>,
}

/// One eviction caused by a budget.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct EvictionRecord {
    /// The evicted pod's name.
    pub pod: String,
    /// The node it ran on.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node: Option<String>,
    /// When the agent asked for the eviction (RFC 3339).
    pub time: String,
    /// GPU memory the pod held then, as a quantity.
    pub usage: String,
}

/// A matched pod and what it holds.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, Hash, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct TopPod {
    /// Pod name.
    pub name: String,
    /// Node the pod runs on.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node: Option<String>,
    /// GPU memory the pod holds, human readable (`9.2Gi`).
    pub usage: String,
    /// GPU memory the pod holds, in bytes.
    pub usage_bytes: i64,
    /// Where the pod stands against the limit.
    pub state: crate::state::BudgetState,
    /// With `share`: the pod's own limit and how its share gave it (`39.8Gi: KAI gpu-fraction 0.5 of 79.6Gi =
    /// 39.8Gi`), as its node's agent recorded it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub share: Option<String>,
}

impl ClusterGpuMemoryBudget {
    /// The name, the way messages name a cluster budget (no namespace).
    pub fn key(&self) -> String {
        self.metadata.name.clone().unwrap_or_default()
    }
}

impl GpuMemoryBudget {
    /// `namespace/name`, the way messages name a budget.
    pub fn key(&self) -> String {
        format!(
            "{}/{}",
            self.metadata.namespace.as_deref().unwrap_or_default(),
            self.metadata.name.as_deref().unwrap_or_default()
        )
    }
}

/// The namespaces listed with their top pods in a quota's `status.namespaces`; after them, only namespaces
/// with something to remember (over or near, time banked, an eviction under way), without their pods.
pub const QUOTA_NAMESPACES_DETAILED: usize = 100;
/// The most namespaces a quota's `status.namespaces` holds (#33: every namespace over or near keeps its
/// period, in turn, up to this many and [`QUOTA_STATUS_BYTES_MAX`]).
pub const QUOTA_NAMESPACES_MAX: usize = 5_000;
/// The most bytes (JSON) `status.namespaces` takes, well under the API server's 1.5 MiB per object.
pub const QUOTA_STATUS_BYTES_MAX: usize = 1 << 20;
/// The most pods listed per namespace in a quota's `status.namespaces[].topPods`.
pub const QUOTA_TOP_PODS_MAX: usize = 5;

/// A cap on the GPU memory all the selected pods of one namespace hold together, across every node, set by
/// a cluster administrator. The operator adds up the agents' records; over the limit for `overLimitSeconds`,
/// it evicts the pod that took the namespace over (the most recently started one).
#[derive(CustomResource, KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[kube(
    group = "gpubudget.io",
    version = "v1alpha1",
    kind = "ClusterGpuMemoryQuota",
    plural = "clustergpumemoryquotas",
    singular = "clustergpumemoryquota",
    shortname = "cgmq",
    category = "gpubudget",
    doc = "A namespace total, for administrators: the most GPU memory the pods its selectors match may hold together in each namespace its namespaceSelector matches, across all nodes. The gpubudget operator adds up the agents' records; a namespace over the limit for overLimitSeconds loses its most recently started pod (ties: the name last in alphabetical order) through the Eviction API, one pod at a time, with the same warnings, grace and PodDisruptionBudget handling as a GpuMemoryBudget.",
    status = "ClusterGpuMemoryQuotaStatus",
    derive = "PartialEq",
    printcolumn = r#"{"name":"Limit","type":"string","jsonPath":".spec.limit","description":"GPU memory each selected namespace may hold in total"}"#,
    printcolumn = r#"{"name":"Action","type":"string","jsonPath":".spec.action","description":"Evict or Warn"}"#,
    printcolumn = r#"{"name":"Namespaces","type":"integer","jsonPath":".status.namespacesSelected","description":"Namespaces the namespaceSelector matches that hold selected pods"}"#,
    printcolumn = r#"{"name":"Over","type":"integer","jsonPath":".status.namespacesOver","description":"Namespaces over the limit now"}"#,
    printcolumn = r#"{"name":"Evicted","type":"integer","jsonPath":".status.evictions","description":"Pods this quota has evicted"}"#,
    printcolumn = r#"{"name":"Enforcement","type":"string","priority":1,"jsonPath":".spec.enforcement","description":"Observe or Enforce its evictions; empty: as the operator's --enforcement says"}"#,
    printcolumn = r#"{"name":"Age","type":"date","jsonPath":".metadata.creationTimestamp"}"#
)]
#[serde(rename_all = "camelCase")]
pub struct ClusterGpuMemoryQuotaSpec {
    /// Which namespaces the quota applies in: a standard label selector on the namespaces' labels. `{}`
    /// selects every namespace. Each selected namespace gets the whole limit for itself.
    #[serde(default)]
    #[schemars(schema_with = "bounded_label_selector")]
    pub namespace_selector: LabelSelector,

    /// Which pods, in the selected namespaces, count towards the total: a standard label selector on the
    /// pods' labels. `{}` (the default) counts every pod.
    #[serde(default)]
    #[schemars(schema_with = "bounded_label_selector")]
    pub selector: LabelSelector,

    /// A quantity of bytes (64Gi, 500Mi or 68719476736): the GPU memory the selected pods of one namespace
    /// may hold together, summed over all their containers, processes, GPUs and nodes. Counted as NVML
    /// counts it: the framework's reserved pool plus about 0.5 GiB of CUDA context per process.
    pub limit: Quantity,

    /// Percent of the limit at which a namespace is reported as near its quota (an event and status, never
    /// an eviction). 1 to 100; default 90.
    #[serde(default = "default_warn_at_percent")]
    pub warn_at_percent: i32,

    /// What to do when a namespace stays over the limit for `overLimitSeconds`: `Evict` (the default) asks
    /// the API server to evict its most recently started pod, honouring PodDisruptionBudgets, then the next
    /// while the namespace is still over; `Warn` only records events and status.
    #[serde(default)]
    pub action: BudgetAction,

    /// How long the namespace's total must be over the limit before the action is taken. Seconds, 0 or
    /// more; default 10. Dips do not reset it: time at or under the limit takes back half as much. A change
    /// of operator leader does not restart it (it is kept in the status).
    #[serde(default = "default_over_limit_seconds")]
    pub over_limit_seconds: i64,

    /// Termination grace period, in seconds, given to a pod this quota evicts: 1 or more. Unset: the pod's
    /// own `terminationGracePeriodSeconds`, capped at 30.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub eviction_grace_period_seconds: Option<i64>,

    /// How long evictions may be refused (a PodDisruptionBudget with no disruption allowed, or any other
    /// refusal) before the operator deletes the pod instead, with the same grace period. Seconds, 0 to
    /// 86400. Unset (the default): PodDisruptionBudgets are always respected.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub blocked_eviction_timeout_seconds: Option<i64>,

    /// Whether this quota's evictions are carried out: `Enforce` evicts; `Observe` only reports the pod it
    /// would evict (the event `NamespaceGpuMemoryWouldEvict`, `status.namespaces[].wouldEvict`, the metric
    /// `gpubudget_operator_quota_would_evict_total`) and evicts nothing. Unset (the default): as the operator's
    /// `--enforcement` says (the chart's `agent.enforcement`, which the agents follow too). A Node's label
    /// `gpubudget.io/enforcement` plays no part: a namespace total spans nodes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub enforcement: Option<crate::enforcement::Enforcement>,
}

impl ClusterGpuMemoryQuotaSpec {
    /// The same fields as a budget's spec (no request, no caps), so a quota is validated and its
    /// thresholds and grace are computed by the one code that does it for budgets (`Budget::from_spec`).
    pub fn as_budget_spec(&self) -> GpuMemoryBudgetSpec {
        GpuMemoryBudgetSpec {
            selector: self.selector.clone(),
            limit: self.limit.clone(),
            request: None,
            warn_at_percent: self.warn_at_percent,
            action: self.action,
            over_limit_seconds: self.over_limit_seconds,
            eviction_grace_period_seconds: self.eviction_grace_period_seconds,
            blocked_eviction_timeout_seconds: self.blocked_eviction_timeout_seconds,
            admission_caps: AdmissionCaps::Disabled,
            share: None,
            enforcement: self.enforcement,
        }
    }
}

/// What the operator observed for a quota, and what it must remember across a change of leader.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ClusterGpuMemoryQuotaStatus {
    /// The `metadata.generation` this status was computed for.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    /// Namespaces the namespaceSelector matches that hold selected pods with GPU memory.
    #[serde(default)]
    pub namespaces_selected: i64,
    /// Namespaces over the limit now, including those losing a pod.
    #[serde(default)]
    pub namespaces_over: i64,
    /// Pods this quota has evicted since it was created.
    #[serde(default)]
    pub evictions: i64,
    /// The most recent eviction this quota caused.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_eviction: Option<EvictionRecord>,
    /// Per namespace, the total, the limit, the state and the top holders: namespaces with an eviction under
    /// way first, then those over or near the limit or with time banked, then by total, highest first. The
    /// first 100 with their top pods; after them only namespaces with something to remember, without pods
    /// (at most 5000, and 1 MiB).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 5000))]
    pub namespaces: Vec<NamespaceTotal>,
    /// Namespaces with something to remember that did not fit in `namespaces` (past 5000 or 1 MiB): the
    /// leader keeps their periods in memory only, and a new leader starts them afresh.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub namespaces_not_stored: Option<i64>,
    /// `Ready`: the spec is valid and enforced, or why not.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub conditions: Vec<Condition>,
}

/// One namespace's total under a quota.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct NamespaceTotal {
    /// The namespace.
    pub namespace: String,
    /// GPU memory its selected pods hold together, human readable (`41.5Gi`).
    pub total: String,
    /// The same, in bytes.
    pub total_bytes: i64,
    /// The quota's limit, as written.
    pub limit: String,
    /// Where the namespace stands against the limit.
    pub state: crate::state::BudgetState,
    /// Selected pods holding GPU memory.
    pub pods: i64,
    /// Time over the limit banked, milliseconds (the eviction is due when it reaches `overLimitSeconds`).
    #[serde(default)]
    pub over_millis: i64,
    /// When the operator last added the namespace up (RFC 3339), and whether it was over then.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_sample: Option<String>,
    /// Whether the total was over the limit at `lastSample`.
    #[serde(default)]
    pub last_over: bool,
    /// The eviction under way, if any: no other pod of the namespace is evicted before it is gone.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pending_eviction: Option<PendingEviction>,
    /// Observe mode (the quota's `enforcement`, else the operator's): the eviction is due and nothing is
    /// evicted; the pod it would evict. The state stays `Over`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub would_evict: Option<WouldEvict>,
    /// The selected pods holding the most, highest first (at most 5).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 5))]
    pub top_pods: Vec<TopPod>,
}

/// Observe mode: a namespace total's eviction is due, told and not carried out.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct WouldEvict {
    /// The pod the quota would evict now (the most recently started that may go); absent: none may
    /// (critical, static, or already going).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pod: Option<String>,
    /// When the eviction became due (RFC 3339): told then, once.
    pub since: String,
}

/// An eviction the operator asked for and is seeing through.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct PendingEviction {
    /// The pod's name.
    pub pod: String,
    /// The pod's UID (a new pod of the same name is not the one evicted).
    pub uid: String,
    /// The node it runs on, from its record.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node: Option<String>,
    /// When the eviction was first asked for (RFC 3339).
    pub requested_at: String,
    /// GPU memory the pod held then, in bytes.
    pub usage_bytes: i64,
    /// Whether the API server has accepted the eviction (the pod is terminating).
    #[serde(default)]
    pub accepted: bool,
}

impl ClusterGpuMemoryQuota {
    /// The name, the way messages name a quota.
    pub fn key(&self) -> String {
        self.metadata.name.clone().unwrap_or_default()
    }
}
