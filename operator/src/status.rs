//! A budget's status, computed by a pure function of the budget, the pods it selects, the other budgets
//! that select those pods, and the status it had.
//!
//! - `matchedPods`, `podsNearBudget`, `podsOverBudget` and `topPods` count the pods this budget *applies*
//!   to: those it selects and wins by the common resolution rule (smallest limit, then name). Near and over
//!   come from the agent's record (`gpubudget.io/state`) when the record names this budget (the state is
//!   relative to that budget's limit). `podsAboveRequest` (only when the budget sets a request) counts
//!   those whose recorded usage is above the request: the candidates for eviction under GPU memory pressure.
//! - With `admissionCaps: Enabled`, `podsCapped`, `podsUncapped` and `podsCappedAboveLimit` count those
//!   pods by their GPU containers' environment as the driver reads it (`caps::PodCaps`; fixed at creation,
//!   never the annotation, which a pod's author could have written while the webhook was down). Pods
//!   without a GPU container count in none of them.
//! - `evictions` counts each pod once, by UID: a pod whose record names this budget and carries
//!   `gpubudget.io/eviction-requested-at`. The UIDs already counted are kept in `status.countedEvictions`
//!   (the newest [`COUNTED_EVICTIONS_MAX`]), so a restart or a re-list does not count a pod twice.
//! - `Ready` says whether the spec is valid; `Overlapping` whether some selected pod is also selected by
//!   other budgets, naming them and which budget applies.
//! - A `ClusterGpuMemoryBudget` (#23) has the same status, computed by [`compute_cluster`] from the pods it
//!   selects in every namespace its `namespaceSelector` matches: `matchedPods` and the counts are the pods it
//!   applies to by the same rule (a namespaced budget no looser in any field takes a pod over, and that pod
//!   counts for that budget, not this one); `topPods` name `namespace/pod`; evictions are those whose record
//!   names `ClusterGpuMemoryBudget/<name>`. `Overlapping` names the namespaced budgets as `namespace/name`;
//!   a namespaced budget's names a cluster budget as `ClusterGpuMemoryBudget/<name>`.
//! - A condition keeps its `lastTransitionTime` while its status does not change, so a status computed
//!   twice from the same inputs is equal, and [`same_ignoring_timestamps`] tells whether a write is needed.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::hash::{BuildHasher, RandomState};
use std::str::FromStr;
use std::sync::LazyLock;

use gpubudget_common::caps::{Assessment, Caps};
use gpubudget_common::crd::{COUNTED_EVICTIONS_MAX, EvictionRecord, GpuMemoryBudgetStatus, TOP_PODS_MAX, TopPod};
use gpubudget_common::pod_record::PodRecord;
use gpubudget_common::quantity::HumanBytes;
use gpubudget_common::{Budget, BudgetState, ClusterGpuMemoryBudget, GpuMemoryBudget, SpecError};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use k8s_openapi::jiff::Timestamp;

use crate::pods::{PodInfo, Uid};

/// The status type.
pub type Status = GpuMemoryBudgetStatus;

/// The `Ready` condition: the spec is valid and the agents enforce it.
pub const READY: &str = "Ready";
/// The `Overlapping` condition: some selected pod is also selected by another budget.
pub const OVERLAPPING: &str = "Overlapping";
/// How many other budgets an `Overlapping` message names before "and N more".
pub const OVERLAP_NAMES_MAX: usize = 10;

/// A pod a budget's selector matches, with every budget whose selector matches it (this one included).
#[derive(Debug, Clone)]
pub struct Selected<'a> {
    /// The pod.
    pub pod: &'a PodInfo,
    /// The labels of its namespace (cluster budgets select by them).
    pub namespace_labels: &'a BTreeMap<String, String>,
    /// Every valid budget that selects it: of its namespace, and cluster ones.
    pub selected_by: Vec<&'a Budget>,
}

/// What a budget's status is computed from, besides the budget itself.
#[derive(Debug, Clone, Default)]
pub struct Inputs<'a> {
    /// The budget as the index compiled it (once per change); `None` when the index does not know it yet.
    pub spec: Option<Result<&'a Budget, &'a SpecError>>,
    /// The pods its selector matches.
    pub selected: Vec<Selected<'a>>,
    /// The pods whose record names it (they may no longer be selected): the source of evictions.
    pub recorded: Vec<&'a PodInfo>,
    /// Which spec the nodes enforce; `None`: unknown (no `enforcedGeneration`, no `NodesCurrent`).
    pub nodes: Option<Nodes>,
}

/// Which spec of a budget the nodes enforce, as the operator knows it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Nodes {
    /// The agents read the budget itself (mirrors off, or their CRDs absent): its current spec.
    Direct,
    /// The agents may read its mirror, which copies this generation (`None`: no mirror of it yet).
    Mirror(Option<i64>),
}

/// The `NodesCurrent` condition: the nodes enforce the current spec.
pub const NODES_CURRENT: &str = "NodesCurrent";

/// `enforcedGeneration` and the `NodesCurrent` condition of a budget at `generation`.
fn nodes_current(
    nodes: Nodes,
    generation: Option<i64>,
) -> (Option<i64>, (&'static str, &'static str, &'static str, String)) {
    match nodes {
        Nodes::Direct => (
            generation,
            (NODES_CURRENT, "True", "ReadDirectly", "the nodes read this budget's spec themselves".to_owned()),
        ),
        Nodes::Mirror(copied) if copied == generation => (
            copied,
            (
                NODES_CURRENT,
                "True",
                "MirrorCurrent",
                format!("its mirror copies generation {}, the current spec", generation.unwrap_or_default()),
            ),
        ),
        Nodes::Mirror(copied) => (
            copied,
            (
                NODES_CURRENT,
                "False",
                "MirrorBehind",
                format!(
                    "{}, not the current generation {}: nodes reading the mirrors enforce the older spec until the \
                     operator writes it; a mirror missing or behind for 30 s makes the operator stop vouching for \
                     the mirrors, and every node then reads the budgets themselves",
                    copied.map_or_else(
                        || "no mirror of it exists yet".to_owned(),
                        |g| format!("its mirror copies generation {g}")
                    ),
                    generation.unwrap_or_default()
                ),
            ),
        ),
    }
}

/// Computes a budget's status.
pub fn compute(
    resource: &GpuMemoryBudget,
    inputs: &Inputs<'_>,
    previous: Option<&GpuMemoryBudgetStatus>,
    now: Timestamp,
) -> GpuMemoryBudgetStatus {
    let name = resource.metadata.name.as_deref().unwrap_or_default();
    compute_from(name, resource.metadata.generation, || Budget::compile(resource), inputs, previous, now)
}

/// Computes a `ClusterGpuMemoryBudget`'s status (the same status type; see the module's notes).
pub fn compute_cluster(
    resource: &ClusterGpuMemoryBudget,
    inputs: &Inputs<'_>,
    previous: Option<&GpuMemoryBudgetStatus>,
    now: Timestamp,
) -> GpuMemoryBudgetStatus {
    let recorded_as = format!("{}{}", gpubudget_common::pod_record::CLUSTER_BUDGET_PREFIX, resource.key());
    let compile = || Budget::compile_cluster(resource);
    compute_from(&recorded_as, resource.metadata.generation, compile, inputs, previous, now)
}

/// A status from the name pod records give the budget, its generation and its compiled spec.
fn compute_from(
    recorded_as: &str,
    generation: Option<i64>,
    compile: impl FnOnce() -> Result<Budget, SpecError>,
    inputs: &Inputs<'_>,
    previous: Option<&GpuMemoryBudgetStatus>,
    now: Timestamp,
) -> GpuMemoryBudgetStatus {
    let mut status = GpuMemoryBudgetStatus { observed_generation: generation, ..Default::default() };
    count_evictions(&mut status, recorded_as, &inputs.recorded, previous);
    let fallback;
    let spec = match inputs.spec {
        Some(spec) => spec,
        None => {
            fallback = compile();
            fallback.as_ref()
        }
    };
    let mut conditions = match spec {
        Ok(budget) => {
            let overlap = tally(budget, inputs, &mut status);
            vec![ready_true(budget), overlapping(budget, &overlap)]
        }
        Err(error) => vec![ready_false(error), overlap_unknown()],
    };
    if let Some(nodes) = inputs.nodes {
        let (enforced, condition) = nodes_current(nodes, generation);
        status.enforced_generation = enforced;
        conditions.push(condition);
    }
    status.conditions = conditions
        .into_iter()
        .map(|(type_, state, reason, message)| condition(type_, state, reason, message, generation, previous, now))
        .collect();
    status
}

/// Other budgets that select this budget's pods: name → (limit, pods shared); and per pod who applies.
#[derive(Debug, Default)]
struct Overlap {
    pods: usize,
    others: BTreeMap<String, String>,
    winners: BTreeMap<String, usize>,
    /// A cluster budget is among them (the rule the message states is then the cluster one).
    cluster: bool,
    /// Where this budget applies with its rules tightened by other budgets selecting the same pods (cluster budgets,
    /// #33; or namespaced ones, #51): by which.
    tightened_by: Option<String>,
}

/// Whether two compiled budgets are the same object.
fn same_budget(a: &Budget, b: &Budget) -> bool {
    a.is_cluster() == b.is_cluster() && a.name == b.name && a.namespace == b.namespace
}

/// How `viewer`'s status names `other`: a cluster budget as `ClusterGpuMemoryBudget/<name>`; a namespaced one
/// by its name in a namespaced budget's status (same namespace), as `namespace/name` in a cluster budget's.
fn seen_from(viewer: &Budget, other: &Budget) -> String {
    match (viewer.is_cluster(), other.is_cluster()) {
        (_, true) => other.record_name(),
        (true, false) => other.key(),
        (false, false) => other.name.clone(),
    }
}

/// Whether the pod's node said its cap is not in force: read from a record its own node's agent wrote (the
/// records policy lets no one else write `gpubudget.io/` keys on pods).
fn cap_not_in_force(pod: &PodInfo) -> bool {
    pod.record.as_ref().is_some_and(|r| r.cap_not_in_force.is_some())
}

fn tally(budget: &Budget, inputs: &Inputs<'_>, status: &mut GpuMemoryBudgetStatus) -> Overlap {
    let mut overlap = Overlap::default();
    let mut top: Vec<(&PodInfo, &PodRecord)> = Vec::new();
    let mut above_request = 0;
    let mut assessed: HashMap<Assessment, i64> = HashMap::new();
    let mut not_in_force = 0;
    let mut shares = ShareTally::default();
    for selected in &inputs.selected {
        let pod = selected.pod;
        let pod_labels = gpubudget_common::PodLabels::new(&pod.namespace, selected.namespace_labels, &pod.labels);
        // The caps the pod was given: by the rules that apply to it (a cluster budget may have tightened them).
        let mut pod_caps = Caps::of(budget);
        // A budget taking shares may win on the node with a pod's own limit (its share), which only the node can
        // know for a fraction: where the agent's record names such a budget that selects the pod, that one applies.
        let by_share = pod.record.as_ref().and_then(|r| {
            r.share.as_ref()?;
            selected.selected_by.iter().copied().find(|b| b.share.is_some() && b.is_record_name(&r.budget))
        });
        let applies = match gpubudget_common::resolve(selected.selected_by.iter().copied(), &pod_labels) {
            Some(resolution) => {
                pod_caps = Caps::of(by_share.unwrap_or(resolution.applied()));
                if !resolution.also_matched.is_empty() {
                    overlap.pods += 1;
                    let winner = by_share.unwrap_or(resolution.budget);
                    overlap.cluster |= winner.is_cluster() || resolution.also_matched.iter().any(|b| b.is_cluster());
                    *overlap.winners.entry(seen_from(budget, winner)).or_default() += 1;
                    if same_budget(winner, budget)
                        && by_share.is_none()
                        && let Some(by) = resolution.applied().tightened_by.as_ref()
                    {
                        overlap.tightened_by.get_or_insert_with(|| by.clone());
                    }
                    for other in std::iter::once(resolution.budget).chain(resolution.also_matched.iter().copied()) {
                        if !same_budget(other, budget) {
                            overlap.others.insert(seen_from(budget, other), other.limit_text.clone());
                        }
                    }
                }
                same_budget(by_share.unwrap_or(resolution.budget), budget)
            }
            // The index says this budget selects the pod; resolve disagrees only if the inputs are
            // inconsistent. Count it for this budget rather than lose it.
            None => true,
        };
        if !applies {
            continue;
        }
        status.matched_pods += 1;
        if let Some(caps) = pod_caps {
            // The environment says capped; the node may have seen otherwise (#32): then it counts uncapped.
            let made = pod.caps.as_made(pod.record.as_ref().and_then(|r| r.runtime_caps.as_ref()));
            let assessment = match made.assess(caps) {
                Assessment::Capped | Assessment::AboveLimit if cap_not_in_force(pod) => {
                    not_in_force += 1;
                    Assessment::Uncapped
                }
                other => other,
            };
            *assessed.entry(assessment).or_default() += 1;
        }
        let Some(record) = &pod.record else { continue };
        if budget.is_record_name(&record.budget) {
            match record.state {
                BudgetState::Near => status.pods_near_budget += 1,
                state if state.is_over() => status.pods_over_budget += 1,
                _ => {}
            }
            // A pod's request is its share where it has one (the budget's rules for it say so).
            let request =
                record.share.as_ref().filter(|s| s.resolved()).map(|s| s.limit_bytes).or(budget.request_bytes);
            if request.is_some_and(|request| record.usage_bytes > request) {
                above_request += 1;
            }
            if budget.share.is_some() {
                shares.add(record.share.as_ref());
            }
        }
        top.push((pod, record));
    }
    status.pods_above_request = (budget.request_bytes.is_some() || budget.share.is_some()).then_some(above_request);
    if budget.share.is_some() {
        shares.write(status);
    }
    if Caps::of(budget).is_some() || !assessed.is_empty() {
        let count = |a| assessed.get(&a).copied().unwrap_or_default();
        status.pods_capped = Some(count(Assessment::Capped));
        status.pods_uncapped = Some(count(Assessment::Uncapped));
        status.pods_capped_above_limit = Some(count(Assessment::AboveLimit));
        status.pods_cap_not_in_force = Some(not_in_force);
    }
    top.sort_by(|a, b| {
        b.1.usage_bytes
            .cmp(&a.1.usage_bytes)
            .then_with(|| (&a.0.name, &a.0.namespace).cmp(&(&b.0.name, &b.0.namespace)))
    });
    status.top_pods = top
        .into_iter()
        .take(TOP_PODS_MAX)
        .map(|(pod, record)| TopPod {
            // A cluster budget's pods come from many namespaces: `namespace/pod`.
            name: if budget.is_cluster() { format!("{}/{}", pod.namespace, pod.name) } else { pod.name.to_string() },
            node: Some(record.node.to_string()).filter(|n| !n.is_empty()),
            usage: HumanBytes(record.usage_bytes).to_string(),
            usage_bytes: i64::try_from(record.usage_bytes).unwrap_or(i64::MAX),
            state: record.state,
            share: record.share.as_ref().map(|s| format!("{}: {}", HumanBytes(s.limit_bytes), s.note)),
        })
        .collect();
    overlap
}

/// A share budget's recorded pods by where their share came from ([`GpuMemoryBudgetStatus::share`]).
#[derive(Default)]
struct ShareTally {
    by_source: std::collections::BTreeMap<gpubudget_common::share::ShareSource, i64>,
    on_share: i64,
    unresolved: i64,
}

impl ShareTally {
    fn add(&mut self, held: Option<&gpubudget_common::share::HeldShare>) {
        match held {
            Some(h) if h.resolved() => {
                self.on_share += 1;
                for source in &h.sources {
                    *self.by_source.entry(*source).or_default() += 1;
                }
            }
            Some(_) => self.unresolved += 1,
            // Recorded under this budget before it took shares, or the pod declares none it reads.
            None => {}
        }
    }

    fn write(self, status: &mut GpuMemoryBudgetStatus) {
        let mut parts: Vec<String> = self.by_source.iter().map(|(s, n)| format!("{} {n}", s.name())).collect();
        if self.unresolved > 0 {
            parts.push(format!("unresolved {}", self.unresolved));
        }
        status.pods_on_share = Some(self.on_share);
        status.pods_share_unresolved = Some(self.unresolved);
        status.share = Some(if parts.is_empty() { "none recorded".to_owned() } else { parts.join(", ") });
    }
}

fn parse_time(text: &str) -> Option<Timestamp> {
    Timestamp::from_str(text).ok()
}

/// Adds the evictions recorded on pods not counted yet; keeps the counted UIDs bounded.
fn count_evictions(
    status: &mut GpuMemoryBudgetStatus,
    name: &str,
    recorded: &[&PodInfo],
    previous: Option<&GpuMemoryBudgetStatus>,
) {
    let mut counted: Vec<String> = previous.map(|p| p.counted_evictions.clone()).unwrap_or_default();
    let mut evictions = previous.map_or(0, |p| p.evictions);
    // A cluster budget's evicted pods are of many namespaces: `namespace/pod`.
    let cluster = name.starts_with(gpubudget_common::pod_record::CLUSTER_BUDGET_PREFIX);
    let mut last = previous.and_then(|p| p.last_eviction.clone());
    let evicted: Vec<(&PodInfo, &PodRecord, &str)> = recorded
        .iter()
        .filter_map(|pod| {
            let record = pod.evicted_by(name)?;
            Some((*pod, record, record.eviction_requested_at.as_deref()?))
        })
        .filter(|(pod, _, _)| !pod.uid.is_empty())
        .collect();
    // Already counted, or listed twice (a pod and its tombstone): skipped.
    let mut seen: HashSet<Uid> = counted.iter().map(|uid| Uid::from(uid.as_str())).collect();
    let mut new: Vec<&(&PodInfo, &PodRecord, &str)> =
        evicted.iter().filter(|(pod, _, _)| seen.insert(pod.uid.clone())).collect();
    new.sort_by(|a, b| (parse_time(a.2), &a.0.name).cmp(&(parse_time(b.2), &b.0.name)));
    for (pod, record, at) in new {
        evictions += 1;
        counted.push(pod.uid.to_string());
        let newer = match last.as_ref().and_then(|l| parse_time(&l.time)) {
            Some(previous_time) => parse_time(at).is_some_and(|t| t >= previous_time),
            None => true,
        };
        if newer {
            last = Some(EvictionRecord {
                pod: if cluster { format!("{}/{}", pod.namespace, pod.name) } else { pod.name.to_string() },
                node: Some(record.node.to_string()).filter(|n| !n.is_empty()),
                time: (*at).to_owned(),
                usage: HumanBytes(record.usage_bytes).to_string(),
            });
        }
    }
    // Bounded: forget first the UIDs of pods that are gone (they cannot be seen, so counted, again).
    let present: HashSet<&Uid> = evicted.iter().map(|(pod, _, _)| &pod.uid).collect();
    while counted.len() > COUNTED_EVICTIONS_MAX {
        let at = counted.iter().position(|uid| !present.contains(&Uid::from(uid.as_str()))).unwrap_or(0);
        counted.remove(at);
    }
    status.evictions = evictions;
    status.counted_evictions = counted;
    status.last_eviction = last;
}

type Draft = (&'static str, &'static str, &'static str, String);

fn ready_true(budget: &Budget) -> Draft {
    let request = budget
        .request_text
        .as_ref()
        .map(|r| format!("request {r} (never evicted within it; under GPU memory pressure, the most above it first), "))
        .unwrap_or_default();
    (
        READY,
        "True",
        "Valid",
        format!(
            "{request}limit {} per pod, action {}, near at {}% of the limit; enforced by the gpubudget agent on each \
             node",
            budget.limit_text, budget.action, budget.warn_at_percent
        ),
    )
}

fn ready_false(error: &SpecError) -> Draft {
    (READY, "False", "InvalidSpec", format!("{error}; this budget selects no pod until the spec is fixed"))
}

fn overlap_unknown() -> Draft {
    (OVERLAPPING, "Unknown", "InvalidSpec", "the selector is not evaluated while the spec is invalid".to_owned())
}

fn overlapping(budget: &Budget, overlap: &Overlap) -> Draft {
    if overlap.pods == 0 {
        return (OVERLAPPING, "False", "NoOverlap", "no pod this budget selects is selected by another budget".into());
    }
    let mut names: Vec<String> =
        overlap.others.iter().take(OVERLAP_NAMES_MAX).map(|(name, limit)| format!("{name} ({limit})")).collect();
    if overlap.others.len() > OVERLAP_NAMES_MAX {
        names.push(format!("and {} more", overlap.others.len() - OVERLAP_NAMES_MAX));
    }
    let mut winners: Vec<String> = Vec::new();
    let me = seen_from(budget, budget);
    let mine = overlap.winners.get(&me).copied().unwrap_or(0);
    winners.push(format!("this budget ({}) applies to {mine}", budget.limit_text));
    for (name, count) in overlap.winners.iter().filter(|(n, _)| **n != me).take(OVERLAP_NAMES_MAX) {
        winners.push(format!("{name} to {count}"));
    }
    let pods = overlap.pods;
    let plural = if pods == 1 { "pod" } else { "pods" };
    (
        OVERLAPPING,
        "True",
        "SelectorsOverlap",
        format!(
            "{pods} {plural} this budget selects {verb} also selected by {}; {rule}: {}{tightened}",
            names.join(", "),
            winners.join(", "),
            tightened = match &overlap.tightened_by {
                Some(by) => format!(
                    "; where this budget applies its rules are tightened by {by}: no rule applied is looser \
                     than theirs"
                ),
                None => String::new(),
            },
            rule = if overlap.cluster {
                "the smallest limit applies (equal limits: the cluster budget, then the name that sorts first), and \
                 a namespaced budget only if it is no looser in any field than the cluster budget"
            } else {
                "the smallest limit applies (equal limits: the name that sorts first)"
            },
            verb = if pods == 1 { "is" } else { "are" },
        ),
    )
}

fn condition(
    type_: &str,
    status: &str,
    reason: &str,
    message: String,
    generation: Option<i64>,
    previous: Option<&GpuMemoryBudgetStatus>,
    now: Timestamp,
) -> Condition {
    let last_transition_time = previous
        .and_then(|p| p.conditions.iter().find(|c| c.type_ == type_))
        .filter(|c| c.status == status)
        .map_or(Time(now), |c| c.last_transition_time.clone());
    Condition {
        type_: type_.to_owned(),
        status: status.to_owned(),
        reason: reason.to_owned(),
        message,
        observed_generation: generation,
        last_transition_time,
    }
}

/// What the operator's cache keeps of a status's `topPods`: a digest. They are most of a status (10 pods with
/// names, nodes and usages, about 1.8 KB) and are only ever compared, never read back.
/// Keyed per process, so that no tenant can name pods whose list collides with another's (a collision would
/// leave a stale `topPods` unwritten).
pub fn top_pods_digest(top: &[TopPod]) -> u64 {
    static KEYS: LazyLock<RandomState> = LazyLock::new(RandomState::new);
    KEYS.hash_one(top)
}

/// Where a previous status's `topPods` are.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PreviousTop {
    /// In the status itself (a status this replica wrote).
    InStatus,
    /// Dropped by the cache, which kept their digest ([`top_pods_digest`]).
    Digest(u64),
    /// Dropped, and no digest is known for the version cached: taken as different, so the status is written.
    Unknown,
}

/// Whether `next` would change nothing of `previous` (conditions' transition times aside): if so, nothing is
/// written.
pub fn unchanged(previous: &GpuMemoryBudgetStatus, top: PreviousTop, next: &GpuMemoryBudgetStatus) -> bool {
    let top_same = match top {
        PreviousTop::InStatus => previous.top_pods == next.top_pods,
        PreviousTop::Digest(digest) => digest == top_pods_digest(&next.top_pods),
        PreviousTop::Unknown => false,
    };
    top_same && normalized(previous) == normalized(next)
}

/// Whether two statuses say the same thing (condition timestamps aside).
pub fn same_ignoring_timestamps(a: &GpuMemoryBudgetStatus, b: &GpuMemoryBudgetStatus) -> bool {
    unchanged(a, PreviousTop::InStatus, b)
}

/// A status without what the comparison leaves aside: conditions' transition times, and the top pods
/// (compared apart, since the cache may hold only their digest).
fn normalized(s: &GpuMemoryBudgetStatus) -> GpuMemoryBudgetStatus {
    let mut s = GpuMemoryBudgetStatus { top_pods: Vec::new(), ..s.clone() };
    for c in &mut s.conditions {
        c.last_transition_time = Time(Timestamp::UNIX_EPOCH);
    }
    s
}

/// The status of a condition, if present.
pub fn condition_status<'a>(status: Option<&'a GpuMemoryBudgetStatus>, type_: &str) -> Option<&'a Condition> {
    status?.conditions.iter().find(|c| c.type_ == type_)
}

/// An event worth a person's attention, published on the budget.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Notice {
    /// Warning (else Normal).
    pub warning: bool,
    /// The event's reason (PascalCase, stable).
    pub reason: &'static str,
    /// The event's note.
    pub note: String,
}

/// The transitions between two statuses that deserve an event: the spec became invalid (or valid again),
/// the budget became overlapping (or stopped). Computed from the condition statuses, so a status that is
/// not written again produces no event again.
pub fn notices(previous: Option<&GpuMemoryBudgetStatus>, next: &GpuMemoryBudgetStatus) -> Vec<Notice> {
    let mut out = Vec::new();
    let was = |t| condition_status(previous, t).map(|c| c.status.as_str());
    let ready = condition_status(Some(next), READY);
    match (was(READY), ready) {
        (prev, Some(c)) if c.status == "False" && prev != Some("False") => {
            out.push(Notice { warning: true, reason: "InvalidSpec", note: c.message.clone() });
        }
        (Some("False"), Some(c)) if c.status == "True" => {
            out.push(Notice {
                warning: false,
                reason: "Valid",
                note: format!("the spec is valid again: {}", c.message),
            });
        }
        _ => {}
    }
    let overlapping = condition_status(Some(next), OVERLAPPING);
    match (was(OVERLAPPING), overlapping) {
        (prev, Some(c)) if c.status == "True" && prev != Some("True") => {
            out.push(Notice { warning: true, reason: "Overlapping", note: c.message.clone() });
        }
        (Some("True"), Some(c)) if c.status == "False" => {
            out.push(Notice { warning: false, reason: "OverlapResolved", note: c.message.clone() });
        }
        _ => {}
    }
    out
}

#[cfg(test)]
mod tests {
    static NO_NS: BTreeMap<String, String> = BTreeMap::new();
    use super::*;
    use gpubudget_common::pod_record::PodRecord;

    fn resource(name: &str, limit: &str, selector: &str) -> GpuMemoryBudget {
        let mut r: GpuMemoryBudget = serde_yaml::from_str(&format!(
            "apiVersion: gpubudget.io/v1alpha1\nkind: GpuMemoryBudget\nmetadata: {{name: {name}, namespace: a, generation: 3}}\n\
             spec: {{selector: {selector}, limit: {limit}}}\n"
        ))
        .expect("fixture parses");
        r.metadata.uid = Some(format!("uid-{name}"));
        r
    }

    fn compiled(r: &GpuMemoryBudget) -> Budget {
        Budget::compile(r).expect("valid")
    }

    fn pod(name: &str, app: &str, record: Option<(BudgetState, u64, &str)>) -> PodInfo {
        PodInfo {
            namespace: "a".into(),
            name: name.into(),
            uid: format!("uid-{name}").as_str().into(),
            labels: std::sync::Arc::new([("app".to_owned(), app.to_owned())].into()),
            record: record.map(|(state, usage_bytes, budget)| PodRecord {
                state,
                usage_bytes,
                budget: budget.into(),
                node: "gpu-1".into(),
                eviction_requested_at: None,
                cap_not_in_force: None,
                share: None,
                runtime_caps: None,
            }),
            terminating: false,
            caps: gpubudget_common::caps::PodCaps::NoGpu,
            started_ms: None,
            exempt: None,
            grace_seconds: None,
        }
    }

    /// The agent asked for the eviction.
    fn requested(mut p: PodInfo, at: &str) -> PodInfo {
        if let Some(r) = p.record.as_mut() {
            r.state = BudgetState::Evicting;
            r.eviction_requested_at = Some(at.into());
        }
        p
    }

    /// The agent asked for the eviction and the API server accepted it: the pod is terminating.
    fn evicted(p: PodInfo, at: &str) -> PodInfo {
        PodInfo { terminating: true, ..requested(p, at) }
    }

    fn t(secs: i64) -> Timestamp {
        Timestamp::from_second(1_800_000_000 + secs).expect("in range")
    }

    const GI: u64 = 1 << 30;

    fn with_env(name: &str, mps: Option<&str>) -> PodInfo {
        use gpubudget_common::caps::{Devices, EnvValue, GpuContainer, PodCaps};
        let gpu = GpuContainer {
            name: "main".into(),
            devices: Devices::Known(1),
            mps_limit: mps.map(|m| EnvValue::Literal(m.into())),
            ..GpuContainer::default()
        };
        PodInfo { caps: PodCaps::of([&gpu]), ..pod(name, "llm", None) }
    }

    /// The status of an 8Gi budget selecting every pod of `pods`, with caps enabled or not.
    fn caps_status(pods: &[PodInfo], caps: bool) -> GpuMemoryBudgetStatus {
        let mut r = resource("llm", "8Gi", "{}");
        if caps {
            r.spec.admission_caps = gpubudget_common::AdmissionCaps::Enabled;
        }
        let b = compiled(&r);
        let selected =
            pods.iter().map(|p| Selected { pod: p, namespace_labels: &NO_NS, selected_by: vec![&b] }).collect();
        compute(&r, &Inputs { spec: None, selected, recorded: vec![], nodes: None }, None, t(0))
    }

    /// The status says which spec the nodes enforce: the mirror's generation while agents may read the
    /// mirrors, and a `NodesCurrent` condition that is False, with why, while the mirror lags the spec.
    #[test]
    fn the_status_says_which_generation_the_nodes_enforce() {
        let mut r = resource("llm", "8Gi", "{}");
        r.metadata.generation = Some(4);
        let at = |nodes| compute(&r, &Inputs { nodes, ..Inputs::default() }, None, t(0));
        let current = |s: &GpuMemoryBudgetStatus| {
            condition_status(Some(s), NODES_CURRENT).map(|c| (c.status.clone(), c.reason.clone(), c.message.clone()))
        };
        let s = at(Some(Nodes::Mirror(Some(4))));
        assert_eq!(s.enforced_generation, Some(4));
        assert_eq!(current(&s).map(|c| (c.0, c.1)), Some(("True".into(), "MirrorCurrent".into())));
        let s = at(Some(Nodes::Mirror(Some(3))));
        assert_eq!(s.enforced_generation, Some(3), "the nodes reading the mirror enforce generation 3");
        let (state, reason, message) = current(&s).expect("NodesCurrent");
        assert_eq!((state.as_str(), reason.as_str()), ("False", "MirrorBehind"));
        assert!(message.contains("its mirror copies generation 3, not the current generation 4"), "{message}");
        let s = at(Some(Nodes::Mirror(None)));
        assert_eq!((s.enforced_generation, current(&s).map(|c| c.0)), (None, Some("False".to_owned())));
        let s = at(Some(Nodes::Direct));
        assert_eq!((s.enforced_generation, current(&s).map(|c| c.1)), (Some(4), Some("ReadDirectly".to_owned())));
        let s = at(None);
        assert_eq!((s.enforced_generation, current(&s)), (None, None), "unknown: nothing said");
    }

    #[test]
    fn caps_are_counted_from_the_environment_only_with_the_opt_in() {
        let pods = [
            with_env("capped", Some("0=8192M")),
            with_env("smaller", Some("0=2G")),
            with_env("uncapped", None),
            with_env("bare", Some("8G")),
            with_env("lowered-since", Some("0=16384M")),
            pod("cpu-only", "llm", None),
        ];
        // A forged annotation changes nothing: PodInfo does not even keep it.
        let count = |caps: bool| {
            let s = caps_status(&pods, caps);
            (s.pods_capped, s.pods_uncapped, s.pods_capped_above_limit)
        };
        assert_eq!(count(true), (Some(2), Some(2), Some(1)));
        assert_eq!(count(false), (None, None, None));
    }

    /// #32: a pod whose environment caps it but whose node saw the cap fail counts uncapped, never capped.
    #[test]
    fn a_cap_the_node_saw_fail_counts_uncapped_and_not_in_force() {
        let node_says = |mut p: PodInfo, why: Option<&str>| {
            p.record = Some(PodRecord {
                state: BudgetState::Within,
                usage_bytes: GI,
                budget: "llm".into(),
                node: "gpu-1".into(),
                eviction_requested_at: None,
                cap_not_in_force: why.map(str::to_owned),
                share: None,
                runtime_caps: None,
            });
            p
        };
        let pods = [
            node_says(with_env("held", Some("0=8192M")), None),
            node_says(with_env("went-around", Some("0=8192M")), Some("process 8 on GPU 0 is not a client")),
            node_says(with_env("lowered-since", Some("0=16384M")), Some("process 9 holds 20Gi")),
            // Uncapped by its environment already: counted once, as uncapped, not as "not in force".
            node_says(with_env("no-variable", None), Some("stale words")),
        ];
        let s = caps_status(&pods, true);
        assert_eq!(
            (s.pods_capped, s.pods_uncapped, s.pods_capped_above_limit, s.pods_cap_not_in_force),
            (Some(1), Some(3), Some(0), Some(2))
        );
    }

    #[test]
    fn counts_the_pods_it_applies_to_and_lists_the_top_ones() {
        let llm = resource("llm", "8Gi", "{matchLabels: {app: llm}}");
        let b = compiled(&llm);
        let pods = [
            pod("p1", "llm", Some((BudgetState::Within, GI, "llm"))),
            pod("p2", "llm", Some((BudgetState::Near, 15 * GI / 2, "llm"))),
            pod("p3", "llm", Some((BudgetState::Over, 9 * GI, "llm"))),
            pod("p4", "llm", Some((BudgetState::Evicting, 10 * GI, "llm"))),
            pod("p5", "llm", None),
        ];
        let inputs = Inputs {
            spec: None,
            selected: pods
                .iter()
                .map(|p| Selected { pod: p, namespace_labels: &NO_NS, selected_by: vec![&b] })
                .collect(),
            recorded: pods.iter().collect(),
            nodes: None,
        };
        let s = compute(&llm, &inputs, None, t(0));
        assert_eq!(s.observed_generation, Some(3));
        assert_eq!((s.matched_pods, s.pods_near_budget, s.pods_over_budget), (5, 1, 2));
        let top: Vec<(&str, &str)> = s.top_pods.iter().map(|p| (p.name.as_str(), p.usage.as_str())).collect();
        assert_eq!(top, [("p4", "10Gi"), ("p3", "9Gi"), ("p2", "7.5Gi"), ("p1", "1Gi")]);
        assert_eq!(s.top_pods[0].usage_bytes, 10 * GI as i64);
        assert_eq!((s.top_pods[0].node.as_deref(), s.top_pods[0].state), (Some("gpu-1"), BudgetState::Evicting));
        assert_eq!(s.evictions, 0, "Evicting without eviction-requested-at is not an eviction yet");
        let ready = condition_status(Some(&s), READY).expect("ready");
        assert_eq!((ready.status.as_str(), ready.reason.as_str()), ("True", "Valid"));
        assert!(ready.message.contains("limit 8Gi"), "{}", ready.message);
        assert_eq!(condition_status(Some(&s), OVERLAPPING).map(|c| c.status.as_str()), Some("False"));
    }

    #[test]
    fn pods_above_the_request_are_counted_only_when_the_budget_sets_one() {
        let mut llm = resource("llm", "8Gi", "{matchLabels: {app: llm}}");
        let pods = [
            pod("p1", "llm", Some((BudgetState::Within, 4 * GI, "llm"))),
            pod("p2", "llm", Some((BudgetState::Near, 15 * GI / 2, "llm"))),
            pod("p3", "llm", Some((BudgetState::Over, 9 * GI, "llm"))),
            pod("p4", "llm", Some((BudgetState::Within, 5 * GI, "other"))),
            pod("p5", "llm", None),
        ];
        let unset = compiled(&llm);
        let inputs = |b| Inputs {
            spec: Some(Ok(b)),
            selected: pods
                .iter()
                .map(|p| Selected { pod: p, namespace_labels: &NO_NS, selected_by: vec![b] })
                .collect(),
            recorded: pods.iter().collect(),
            nodes: None,
        };
        let s = compute(&llm, &inputs(&unset), None, t(0));
        assert_eq!(s.pods_above_request, None, "no request: no count, the status as before");
        assert!(!serde_json::to_string(&s).expect("json").contains("podsAboveRequest"));
        llm.spec.request = Some(k8s_openapi::apimachinery::pkg::api::resource::Quantity("4Gi".into()));
        let set = compiled(&llm);
        let s = compute(&llm, &inputs(&set), None, t(0));
        // p1 sits at its request; p4's record names another budget; p5 has no record.
        assert_eq!((s.matched_pods, s.pods_above_request), (5, Some(2)));
        let ready = condition_status(Some(&s), READY).expect("ready");
        assert!(ready.message.starts_with("request 4Gi (never evicted within it"), "{}", ready.message);
    }

    #[test]
    fn top_pods_are_bounded() {
        let llm = resource("llm", "8Gi", "{}");
        let b = compiled(&llm);
        let pods: Vec<PodInfo> =
            (0..25).map(|i| pod(&format!("p{i:02}"), "x", Some((BudgetState::Within, i * 1000, "llm")))).collect();
        let inputs = Inputs {
            spec: None,
            selected: pods
                .iter()
                .map(|p| Selected { pod: p, namespace_labels: &NO_NS, selected_by: vec![&b] })
                .collect(),
            recorded: vec![],
            nodes: None,
        };
        let s = compute(&llm, &inputs, None, t(0));
        assert_eq!(s.top_pods.len(), TOP_PODS_MAX);
        assert_eq!(s.top_pods[0].name, "p24");
        assert_eq!(s.matched_pods, 25);
    }

    #[test]
    fn overlapping_names_the_others_and_who_applies() {
        let llm = resource("llm", "8Gi", "{matchLabels: {app: llm}}");
        let wide = resource("wide", "16Gi", "{}");
        let (bl, bw) = (compiled(&llm), compiled(&wide));
        let pods = [
            pod("p1", "llm", Some((BudgetState::Near, 7 * GI, "llm"))),
            pod("p2", "llm", None),
            pod("w", "web", Some((BudgetState::Within, GI, "wide"))),
        ];
        let wide_inputs = Inputs {
            spec: None,
            selected: vec![
                Selected { pod: &pods[0], namespace_labels: &NO_NS, selected_by: vec![&bl, &bw] },
                Selected { pod: &pods[1], namespace_labels: &NO_NS, selected_by: vec![&bw, &bl] },
                Selected { pod: &pods[2], namespace_labels: &NO_NS, selected_by: vec![&bw] },
            ],
            recorded: vec![&pods[2]],
            nodes: None,
        };
        let s = compute(&wide, &wide_inputs, None, t(0));
        assert_eq!((s.matched_pods, s.pods_near_budget), (1, 0), "llm applies to p1 and p2");
        assert_eq!(s.top_pods.len(), 1);
        let c = condition_status(Some(&s), OVERLAPPING).expect("overlapping");
        assert_eq!((c.status.as_str(), c.reason.as_str()), ("True", "SelectorsOverlap"));
        assert_eq!(
            c.message,
            "2 pods this budget selects are also selected by llm (8Gi); the smallest limit applies (equal limits: \
             the name that sorts first): this budget (16Gi) applies to 0, llm to 2"
        );
        let llm_inputs =
            Inputs { spec: None, selected: wide_inputs.selected[..2].to_vec(), recorded: vec![&pods[0]], nodes: None };
        let s = compute(&llm, &llm_inputs, None, t(0));
        assert_eq!((s.matched_pods, s.pods_near_budget), (2, 1));
        let c = condition_status(Some(&s), OVERLAPPING).expect("overlapping");
        assert!(
            c.message.contains("also selected by wide (16Gi)") && c.message.ends_with("applies to 2"),
            "{}",
            c.message
        );
    }

    /// A budget taking shares counts the pods whose node applied it (their share is smaller than another
    /// budget's limit, which only the node can know for a fraction), by source, with the unresolved apart.
    #[test]
    fn a_share_budget_counts_the_pods_its_node_applied_by_source() {
        use gpubudget_common::share::{HeldShare, ShareSource};
        let mut shares = resource("shares", "80Gi", "{}");
        shares.spec.share = Some(serde_json::from_value(serde_json::json!({})).expect("share spec"));
        let plain = resource("plain", "30Gi", "{}");
        let (bs, bp) = (compiled(&shares), compiled(&plain));
        let with_share = |mut p: PodInfo, held: HeldShare| {
            p.record.as_mut().expect("record").share = Some(held);
            p
        };
        let pods = [
            with_share(
                pod("kai", "x", Some((BudgetState::Near, 19 * GI, "shares"))),
                HeldShare::new(20 * GI, vec![ShareSource::KaiFraction], "KAI gpu-fraction 0.25 of 80Gi = 20Gi".into()),
            ),
            pod("none", "x", Some((BudgetState::Within, GI, "plain"))),
            with_share(
                pod("bad", "x", Some((BudgetState::Within, 2 * GI, "shares"))),
                HeldShare::new(80 * GI, vec![], "share unresolved: gpu-fraction \"lots\" is no decimal".into()),
            ),
        ];
        let selected: Vec<Selected> =
            pods.iter().map(|p| Selected { pod: p, namespace_labels: &NO_NS, selected_by: vec![&bp, &bs] }).collect();
        let inputs = Inputs { spec: None, selected, recorded: pods.iter().collect(), nodes: None };
        let s = compute(&shares, &inputs, None, t(0));
        assert_eq!((s.matched_pods, s.pods_near_budget), (2, 1), "the node applied shares to kai and bad");
        assert_eq!((s.pods_on_share, s.pods_share_unresolved), (Some(1), Some(1)));
        assert_eq!(s.share.as_deref(), Some("KAI gpu-fraction 1, unresolved 1"));
        assert_eq!(s.pods_above_request, Some(0), "kai holds 19Gi of its 20Gi share, which is its request");
        assert_eq!(s.top_pods[0].share.as_deref(), Some("20Gi: KAI gpu-fraction 0.25 of 80Gi = 20Gi"));
        let s = compute(&plain, &inputs, None, t(0));
        assert_eq!((s.matched_pods, s.pods_on_share, s.share), (1, None, None), "plain applies to none only");
        // Before any agent has recorded a pod: the operator's own resolution (the smallest spec limit).
        let fresh: Vec<PodInfo> = ["a", "b"].iter().map(|n| pod(n, "x", None)).collect();
        let selected =
            fresh.iter().map(|p| Selected { pod: p, namespace_labels: &NO_NS, selected_by: vec![&bp, &bs] }).collect();
        let s = compute(&shares, &Inputs { spec: None, selected, recorded: vec![], nodes: None }, None, t(0));
        assert_eq!((s.matched_pods, s.share.as_deref()), (0, Some("none recorded")));
    }

    /// With runtime caps the node's record of what the runtime made wins over the spec: a pod created while the
    /// webhook was down (nothing in its spec) counts capped once its containers were made capped, and one whose
    /// container was made uncapped counts uncapped whatever its spec says.
    #[test]
    fn what_the_runtime_made_wins_over_the_spec() {
        use gpubudget_common::pod_record::RuntimeCapsRecord;
        let made = |name: &str, mps: Option<&str>, by_runtime: RuntimeCapsRecord| {
            let mut p = with_env(name, mps);
            p.record = pod(name, "llm", Some((BudgetState::Within, GI, "llm"))).record;
            p.record.as_mut().expect("record").runtime_caps = Some(by_runtime);
            p
        };
        let pods = [
            made("webhook-down", None, RuntimeCapsRecord::capped([("main".to_owned(), 8192)])),
            made("spec-says-capped", Some("0=8192M"), RuntimeCapsRecord::uncapped("container main: no cap".into())),
            made("above", None, RuntimeCapsRecord::capped([("main".to_owned(), 16384)])),
            with_env("spec-only", Some("0=4096M")),
        ];
        let s = caps_status(&pods, true);
        assert_eq!((s.pods_capped, s.pods_uncapped, s.pods_capped_above_limit), (Some(2), Some(1), Some(1)));
    }

    #[test]
    fn invalid_specs_are_not_ready_and_keep_their_evictions() {
        let mut bad = resource("llm", "8Gi", "{}");
        bad.spec.warn_at_percent = 0;
        let previous =
            GpuMemoryBudgetStatus { evictions: 4, counted_evictions: vec!["x".into()], ..Default::default() };
        let s = compute(&bad, &Inputs::default(), Some(&previous), t(0));
        let ready = condition_status(Some(&s), READY).expect("ready");
        assert_eq!((ready.status.as_str(), ready.reason.as_str()), ("False", "InvalidSpec"));
        assert!(ready.message.starts_with("spec.warnAtPercent"), "{}", ready.message);
        assert_eq!(condition_status(Some(&s), OVERLAPPING).map(|c| c.status.as_str()), Some("Unknown"));
        assert_eq!((s.evictions, s.matched_pods), (4, 0));
        let n = notices(None, &s);
        assert_eq!(n.iter().map(|n| (n.reason, n.warning)).collect::<Vec<_>>(), [("InvalidSpec", true)]);
    }

    #[test]
    fn the_cache_compares_top_pods_by_their_digest() {
        let top = |usage: u64| TopPod {
            name: "p1".into(),
            node: Some("gpu-1".into()),
            usage: HumanBytes(usage).to_string(),
            usage_bytes: usage as i64,
            state: BudgetState::Within,
            share: None,
        };
        let full = GpuMemoryBudgetStatus { matched_pods: 1, top_pods: vec![top(GI)], ..Default::default() };
        let cached = GpuMemoryBudgetStatus { top_pods: Vec::new(), ..full.clone() };
        let digest = PreviousTop::Digest(top_pods_digest(&full.top_pods));
        assert!(unchanged(&full, PreviousTop::InStatus, &full.clone()) && unchanged(&cached, digest, &full));
        let moved = GpuMemoryBudgetStatus { top_pods: vec![top(2 * GI)], ..full.clone() };
        assert!(!unchanged(&cached, digest, &moved), "only a top pod changed");
        assert!(!unchanged(&full, PreviousTop::InStatus, &moved), "only a top pod changed (kept in the status)");
        assert!(
            !unchanged(&cached, PreviousTop::Unknown, &full),
            "a digest not known for this version matches nothing"
        );
        let counted = GpuMemoryBudgetStatus { matched_pods: 2, ..full.clone() };
        assert!(!unchanged(&cached, digest, &counted), "the rest is compared as before");
        assert!(
            !unchanged(&cached, PreviousTop::InStatus, &full),
            "a cached status is never taken as having no top pods"
        );
    }

    #[test]
    fn each_eviction_is_counted_once_across_restarts() {
        let llm = resource("llm", "8Gi", "{}");
        let p1 = evicted(pod("p1", "x", Some((BudgetState::Over, 9 * GI, "llm"))), "2027-01-15T08:00:00Z");
        let p2 = evicted(pod("p2", "x", Some((BudgetState::Over, 12 * GI, "llm"))), "2027-01-15T09:00:00Z");
        let other = evicted(pod("o", "x", Some((BudgetState::Over, GI, "other"))), "2027-01-15T10:00:00Z");
        // Requested but refused (a PodDisruptionBudget): the pod runs on, nothing is counted yet.
        let blocked = requested(pod("p1", "x", Some((BudgetState::Over, 9 * GI, "llm"))), "2027-01-15T08:00:00Z");
        let s0 =
            compute(&llm, &Inputs { spec: None, selected: vec![], recorded: vec![&blocked], nodes: None }, None, t(0));
        assert_eq!((s0.evictions, s0.counted_evictions.len()), (0, 0));
        let inputs = Inputs { spec: None, selected: vec![], recorded: vec![&p1, &other], nodes: None };
        let s1 = compute(&llm, &inputs, None, t(0));
        assert_eq!((s1.evictions, s1.counted_evictions.clone()), (1, vec!["uid-p1".to_owned()]));
        let last = s1.last_eviction.clone().expect("last");
        assert_eq!((last.pod.as_str(), last.usage.as_str(), last.node.as_deref()), ("p1", "9Gi", Some("gpu-1")));
        // Recomputed from the written status (a restart, a re-list): nothing new.
        let again = compute(&llm, &inputs, Some(&s1), t(60));
        assert!(same_ignoring_timestamps(&s1, &again));
        assert_eq!(again, s1, "conditions keep their transition times");
        // A second eviction; the first pod is gone by now.
        let inputs = Inputs { spec: None, selected: vec![], recorded: vec![&p2], nodes: None };
        let s2 = compute(&llm, &inputs, Some(&s1), t(120));
        assert_eq!(s2.evictions, 2);
        assert_eq!(s2.last_eviction.as_ref().map(|l| l.pod.as_str()), Some("p2"));
        assert_eq!(s2.counted_evictions, ["uid-p1", "uid-p2"]);
        // An older eviction seen late does not replace the last one.
        let late = evicted(pod("p0", "x", Some((BudgetState::Over, GI, "llm"))), "2027-01-15T07:00:00Z");
        let s3 = compute(
            &llm,
            &Inputs { spec: None, selected: vec![], recorded: vec![&late, &p2], nodes: None },
            Some(&s2),
            t(180),
        );
        assert_eq!((s3.evictions, s3.last_eviction.as_ref().map(|l| l.pod.as_str())), (3, Some("p2")));
    }

    #[test]
    fn counted_evictions_stay_bounded_and_keep_present_pods() {
        let llm = resource("llm", "8Gi", "{}");
        let previous = GpuMemoryBudgetStatus {
            evictions: COUNTED_EVICTIONS_MAX as i64,
            counted_evictions: (0..COUNTED_EVICTIONS_MAX).map(|i| format!("uid-old{i}")).collect(),
            ..Default::default()
        };
        // old0 is still present (its eviction blocked by a PodDisruptionBudget, say): it must stay counted.
        let old0 = evicted(pod("old0", "x", Some((BudgetState::Over, GI, "llm"))), "2027-01-15T07:00:00Z");
        let new = evicted(pod("new", "x", Some((BudgetState::Over, GI, "llm"))), "2027-01-15T08:00:00Z");
        let s = compute(
            &llm,
            &Inputs { spec: None, selected: vec![], recorded: vec![&old0, &new], nodes: None },
            Some(&previous),
            t(0),
        );
        assert_eq!(s.evictions, COUNTED_EVICTIONS_MAX as i64 + 1);
        assert_eq!(s.counted_evictions.len(), COUNTED_EVICTIONS_MAX);
        assert_eq!(s.counted_evictions[0], "uid-old0");
        assert!(!s.counted_evictions.contains(&"uid-old1".to_owned()));
        assert_eq!(s.counted_evictions.last().map(String::as_str), Some("uid-new"));
        let s = compute(
            &llm,
            &Inputs { spec: None, selected: vec![], recorded: vec![&old0, &new], nodes: None },
            Some(&s),
            t(1),
        );
        assert_eq!(s.evictions, COUNTED_EVICTIONS_MAX as i64 + 1, "no double count");
    }

    #[test]
    fn transition_times_move_only_when_a_condition_changes() {
        let llm = resource("llm", "8Gi", "{}");
        let wide = resource("wide", "16Gi", "{}");
        let (bl, bw) = (compiled(&llm), compiled(&wide));
        let p = pod("p", "x", None);
        let alone = Inputs {
            spec: None,
            selected: vec![Selected { pod: &p, namespace_labels: &NO_NS, selected_by: vec![&bl] }],
            recorded: vec![],
            nodes: None,
        };
        let shared = Inputs {
            spec: None,
            selected: vec![Selected { pod: &p, namespace_labels: &NO_NS, selected_by: vec![&bl, &bw] }],
            recorded: vec![],
            nodes: None,
        };
        let s0 = compute(&llm, &alone, None, t(0));
        let s1 = compute(&llm, &shared, Some(&s0), t(10));
        let ready =
            |s: &GpuMemoryBudgetStatus| condition_status(Some(s), READY).map(|c| c.last_transition_time.clone());
        let over = |s: &GpuMemoryBudgetStatus| {
            condition_status(Some(s), OVERLAPPING).map(|c| (c.status.clone(), c.last_transition_time.clone()))
        };
        assert_eq!(ready(&s1), ready(&s0));
        assert_eq!(over(&s1), Some(("True".into(), Time(t(10)))));
        assert!(!same_ignoring_timestamps(&s0, &s1));
        let n = notices(Some(&s0), &s1);
        assert_eq!(n.len(), 1);
        assert_eq!((n[0].reason, n[0].warning), ("Overlapping", true));
        assert!(n[0].note.contains("wide (16Gi)"), "{}", n[0].note);
        assert!(notices(Some(&s1), &compute(&llm, &shared, Some(&s1), t(20))).is_empty(), "no repeat");
        let s2 = compute(&llm, &alone, Some(&s1), t(30));
        assert_eq!(notices(Some(&s1), &s2).iter().map(|n| n.reason).collect::<Vec<_>>(), ["OverlapResolved"]);
        // Invalid, then valid again.
        let mut bad = llm.clone();
        bad.spec.limit.0 = "lots".into();
        let s3 = compute(&bad, &alone, Some(&s2), t(40));
        let s4 = compute(&llm, &alone, Some(&s3), t(50));
        assert_eq!(notices(Some(&s2), &s3).iter().map(|n| n.reason).collect::<Vec<_>>(), ["InvalidSpec"]);
        assert_eq!(notices(Some(&s3), &s4).iter().map(|n| n.reason).collect::<Vec<_>>(), ["Valid"]);
        assert_eq!(ready(&s4), Some(Time(t(50))));
    }

    #[test]
    fn a_generation_change_alone_is_a_change() {
        let mut llm = resource("llm", "8Gi", "{}");
        let s0 = compute(&llm, &Inputs::default(), None, t(0));
        llm.metadata.generation = Some(4);
        let s1 = compute(&llm, &Inputs::default(), Some(&s0), t(1));
        assert!(!same_ignoring_timestamps(&s0, &s1));
        assert_eq!(s1.conditions[0].observed_generation, Some(4));
    }

    /// #23: a cluster budget's status: the pods it applies to in every namespace, `namespace/pod` in
    /// `topPods` and `lastEviction`, its overlaps naming namespaced budgets as `namespace/name`, and a
    /// namespaced budget's naming it `ClusterGpuMemoryBudget/<name>`.
    #[test]
    fn a_cluster_budgets_status_spans_namespaces_and_names_who_applies() {
        let tenants: ClusterGpuMemoryBudget = serde_yaml::from_str(
            "apiVersion: gpubudget.io/v1alpha1\nkind: ClusterGpuMemoryBudget\nmetadata: {name: tenants, generation: 2}\n\
             spec: {namespaceSelector: {matchLabels: {tier: tenant}}, selector: {}, limit: 16Gi}\n",
        )
        .expect("fixture");
        let cluster = Budget::compile_cluster(&tenants).expect("valid");
        let llm = resource("llm", "8Gi", "{matchLabels: {app: llm}}");
        let bl = compiled(&llm);
        let labels: BTreeMap<String, String> = [("tier".to_owned(), "tenant".to_owned())].into();
        let in_b = |p: PodInfo| PodInfo { namespace: "b".into(), ..p };
        let recorded = "ClusterGpuMemoryBudget/tenants";
        let pods = [
            pod("p1", "llm", Some((BudgetState::Within, GI, "llm"))),
            pod("p2", "web", Some((BudgetState::Over, 17 * GI, recorded))),
            in_b(pod("q1", "web", Some((BudgetState::Near, 15 * GI, recorded)))),
            in_b(evicted(pod("gone", "web", Some((BudgetState::Over, 20 * GI, recorded))), "2027-01-15T08:00:00Z")),
        ];
        let selected = vec![
            Selected { pod: &pods[0], namespace_labels: &labels, selected_by: vec![&bl, &cluster] },
            Selected { pod: &pods[1], namespace_labels: &labels, selected_by: vec![&cluster] },
            Selected { pod: &pods[2], namespace_labels: &labels, selected_by: vec![&cluster] },
        ];
        let inputs = Inputs {
            spec: Some(Ok(&cluster)),
            selected: selected.clone(),
            recorded: vec![&pods[1], &pods[3]],
            nodes: None,
        };
        let s = compute_cluster(&tenants, &inputs, None, t(0));
        assert_eq!((s.observed_generation, s.matched_pods, s.pods_over_budget, s.pods_near_budget), (Some(2), 2, 1, 1));
        let top: Vec<&str> = s.top_pods.iter().map(|p| p.name.as_str()).collect();
        assert_eq!(top, ["a/p2", "b/q1"], "a/llm took p1 over");
        assert_eq!((s.evictions, s.last_eviction.as_ref().map(|l| l.pod.as_str())), (1, Some("b/gone")));
        let c = condition_status(Some(&s), OVERLAPPING).expect("overlapping");
        assert!(c.message.starts_with("1 pod this budget selects is also selected by a/llm (8Gi); the smallest limit"));
        assert!(c.message.ends_with("this budget (16Gi) applies to 0, a/llm to 1"), "{}", c.message);
        // The namespaced budget's side.
        let s = compute(
            &llm,
            &Inputs { spec: None, selected: selected[..1].to_vec(), recorded: vec![], nodes: None },
            None,
            t(0),
        );
        assert_eq!(s.matched_pods, 1);
        let c = condition_status(Some(&s), OVERLAPPING).expect("overlapping");
        assert!(c.message.contains("also selected by ClusterGpuMemoryBudget/tenants (16Gi)"), "{}", c.message);
        assert!(c.message.contains("no looser in any field than the cluster budget"), "{}", c.message);
    }

    /// #33: a smaller-limit cluster budget that a pod label brings in applies with its rules tightened by the
    /// other cluster budgets selecting the pod, and its Overlapping condition says by which.
    #[test]
    fn a_tightened_cluster_budget_says_so() {
        let cgmb = |name: &str, rest: &str| -> ClusterGpuMemoryBudget {
            serde_yaml::from_str(&format!(
                "apiVersion: gpubudget.io/v1alpha1\nkind: ClusterGpuMemoryBudget\nmetadata: {{name: {name}}}\n\
                 spec: {{namespaceSelector: {{}}, {rest}}}\n"
            ))
            .expect("fixture")
        };
        let lax = cgmb("lax", "selector: {matchLabels: {app: web}}, limit: 6Gi, action: Warn");
        let admin = cgmb("admin", "selector: {}, limit: 8Gi");
        let (l, a) = (Budget::compile_cluster(&lax).expect("valid"), Budget::compile_cluster(&admin).expect("valid"));
        let labels = BTreeMap::new();
        let pods = [pod("p1", "web", Some((BudgetState::Over, 7 * GI, "ClusterGpuMemoryBudget/lax")))];
        let selected = vec![Selected { pod: &pods[0], namespace_labels: &labels, selected_by: vec![&l, &a] }];
        let s = compute_cluster(
            &lax,
            &Inputs { spec: Some(Ok(&l)), selected: selected.clone(), recorded: vec![&pods[0]], nodes: None },
            None,
            t(0),
        );
        assert_eq!(s.matched_pods, 1);
        let c = condition_status(Some(&s), OVERLAPPING).expect("overlapping");
        assert!(
            c.message.ends_with(
                "its rules are tightened by ClusterGpuMemoryBudget/admin (action): no rule applied is looser \
                 than theirs"
            ),
            "{}",
            c.message
        );
        let s = compute_cluster(
            &admin,
            &Inputs { spec: Some(Ok(&a)), selected, recorded: vec![], nodes: None },
            None,
            t(0),
        );
        let c = condition_status(Some(&s), OVERLAPPING).expect("overlapping");
        assert!(!c.message.contains("tightened"), "only where the tightened budget applies: {}", c.message);
    }
}
