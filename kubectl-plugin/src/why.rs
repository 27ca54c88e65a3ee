//! `why POD`: which budget applies and why, where the pod stands, since when it is over, what caps its
//! spec sets, its last events and what happens next. A pure function of the API objects read; a pod that
//! is gone (evicted and deleted) is answered from its events and the budgets' `status.lastEviction`.

use std::collections::BTreeMap;

use gpubudget_common::pod_record::CLUSTER_BUDGET_PREFIX;
use gpubudget_common::pod_record::{PodRecord, RuntimeCapsRecord};
use gpubudget_common::quantity::HumanBytes;
use gpubudget_common::{
    Budget, BudgetAction, BudgetState, ClusterGpuMemoryBudget, CriticalNamespaces, GpuMemoryBudget, is_critical,
    resolve,
};
use jiff::{SignedDuration, Timestamp};
use k8s_openapi::api::core::v1::{Event, Pod};

use crate::admission::admission;
use crate::events::{self, EventRow, reason};
use crate::format::{human_duration, percent, selector_text};
use crate::report::{API_VERSION, BudgetInfo, MatchedBudget, Next, PodInfo, RecordInfo, WhyReport};

/// The annotation the kubelet puts on the mirror of a static pod.
pub const MIRROR_ANNOTATION: &str = "kubernetes.io/config.mirror";
/// How many of the pod's events `why` shows.
pub const EVENTS_SHOWN: usize = 10;

/// What `why` reads from the API.
#[derive(Debug, Clone)]
pub struct WhyInput<'a> {
    pub namespace: &'a str,
    pub name: &'a str,
    /// `None`: the pod does not exist (any more).
    pub pod: Option<&'a Pod>,
    /// The namespace's budgets; `None` when they could not be read (RBAC): a warning says so.
    pub budgets: Option<&'a [GpuMemoryBudget]>,
    /// Their specs as stored, by `(namespace, name)` (see [`crate::api::Budgets`]); a budget missing here is
    /// shown from its typed spec.
    pub specs: &'a BTreeMap<(String, String), serde_json::Value>,
    /// The `ClusterGpuMemoryBudget`s (#23); `None` when they could not be read (a tenant may not; the caller
    /// warns).
    pub cluster_budgets: Option<&'a [ClusterGpuMemoryBudget]>,
    /// The labels of the pod's namespace (cluster budgets select by them); `None` when it could not be read
    /// (the caller warns): matched as if it had none.
    pub namespace_labels: Option<&'a BTreeMap<String, String>>,
    /// Events whose involved object is this pod (by name: an earlier pod of the name included).
    pub events: &'a [Event],
    pub now: Timestamp,
    /// What the caller could not read.
    pub warnings: Vec<String>,
    /// The namespaces whose critical-priority pods are never evicted (`--critical-namespaces`, #33).
    pub critical_namespaces: &'a CriticalNamespaces,
    /// What the pod's node's `GpuNodeUsage` says it holds (#34); `None`: the record's usage is shown (that of
    /// its last state change).
    pub measured: Option<u64>,
}

/// Neither the pod, nor an event about it, nor a budget's last eviction of it: nothing to answer from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NotFound;

fn round(t: Timestamp) -> String {
    t.round(jiff::Unit::Second).unwrap_or(t).to_string()
}

fn plus(t: Timestamp, seconds: i64) -> Option<Timestamp> {
    t.checked_add(SignedDuration::from_secs(seconds)).ok()
}

fn until(now: Timestamp, at: Timestamp) -> String {
    let s = at.duration_since(now).as_secs();
    if s > 0 { format!("in {}", human_duration(s)) } else { format!("{} ago", human_duration(-s)) }
}

/// Why the pod is never evicted, if it is; a critical-priority pod outside `critical` adds a warning saying it
/// is enforced all the same (#33).
fn never_evicted(pod: &Pod, critical: &CriticalNamespaces, warnings: &mut Vec<String>) -> Option<String> {
    let spec = pod.spec.as_ref();
    let class = spec.and_then(|s| s.priority_class_name.as_deref());
    let namespace = pod.metadata.namespace.as_deref().unwrap_or_default();
    if is_critical(class, spec.and_then(|s| s.priority)) {
        if critical.exempts(namespace) {
            return Some(format!(
                "the pod is critical (priority class {}) in {namespace}, a namespace of criticalNamespaces \
                 ({critical}, as --critical-namespaces says), and is never evicted",
                class.unwrap_or("of system priority")
            ));
        }
        warnings.push(critical.not_exempt_note().replacen("the pod", "this pod", 1));
    }
    pod.metadata.annotations.as_ref().is_some_and(|a| a.contains_key(MIRROR_ANNOTATION)).then(|| {
        "the pod is a static pod (evicting its mirror would delete only the mirror) and is never evicted".into()
    })
}

/// A warning when the nodes may enforce another spec of budget `name` than its current one (`generation`): its
/// status's `enforcedGeneration` is older (the `NodesCurrent` condition says why), or the status was not
/// written for the current generation (the operator down: what the nodes enforce is then unknown here).
fn nodes_generation_warning(
    name: &str,
    generation: Option<i64>,
    status: Option<&gpubudget_common::crd::GpuMemoryBudgetStatus>,
) -> Option<String> {
    let generation = generation?;
    let Some(status) = status.filter(|s| s.observed_generation == Some(generation)) else {
        return Some(format!(
            "budget {name} is at generation {generation} and its status was not written for it (is the operator \
             up?): which spec the nodes enforce is unknown here; nodes reading the budgets themselves enforce the \
             current one"
        ));
    };
    match status.enforced_generation {
        Some(enforced) if enforced == generation => None,
        None if status.conditions.iter().all(|c| c.type_ != "NodesCurrent") => None,
        enforced => {
            let why = status.conditions.iter().find(|c| c.type_ == "NodesCurrent").map(|c| c.message.clone());
            Some(format!(
                "the nodes enforce {} of budget {name}, not its current generation {generation}{}",
                enforced.map_or_else(|| "no mirror".to_owned(), |g| format!("generation {g}")),
                why.map(|w| format!(": {w}")).unwrap_or_default()
            ))
        }
    }
}

/// The budget that evicted a pod of this name last, by the budgets' `status.lastEviction`.
fn evicted_by<'a>(budgets: &'a [GpuMemoryBudget], name: &str) -> Option<&'a GpuMemoryBudget> {
    budgets
        .iter()
        .filter(|b| b.status.as_ref().and_then(|s| s.last_eviction.as_ref()).is_some_and(|l| l.pod == name))
        .max_by_key(|b| b.status.as_ref().and_then(|s| s.last_eviction.as_ref()).map(|l| l.time.clone()))
}

/// The spec as this plugin reads it (defaults filled in), with every field stored on top: a field newer than
/// the plugin is kept.
fn spec_shown(budget: &GpuMemoryBudget, stored: Option<&serde_json::Value>) -> serde_json::Value {
    let mut spec = serde_json::to_value(&budget.spec).unwrap_or_default();
    if let (Some(out), Some(extra)) = (spec.as_object_mut(), stored.and_then(|s| s.as_object())) {
        out.extend(extra.iter().map(|(k, v)| (k.clone(), v.clone())));
    }
    spec
}

fn budget_info(resource: Option<&GpuMemoryBudget>, name: &str, stored: Option<&serde_json::Value>) -> BudgetInfo {
    match resource {
        Some(r) => {
            let compiled = Budget::compile(r);
            BudgetInfo {
                name: name.to_owned(),
                spec: spec_shown(r, stored),
                limit_bytes: compiled.as_ref().ok().map(|b| b.limit_bytes),
                invalid: compiled.err().map(|e| e.to_string()),
            }
        }
        None => BudgetInfo { name: name.to_owned(), spec: serde_json::Value::Null, limit_bytes: None, invalid: None },
    }
}

/// Answers `why` from what was read.
pub fn why(input: WhyInput<'_>) -> Result<WhyReport, NotFound> {
    let WhyInput {
        namespace,
        name,
        pod,
        budgets,
        specs,
        cluster_budgets,
        namespace_labels,
        events,
        now,
        mut warnings,
        critical_namespaces,
        measured,
    } = input;
    let stored = |n: &str| specs.get(&(namespace.to_owned(), n.to_owned()));
    let uid = pod.and_then(|p| p.metadata.uid.clone());
    let rows = events::rows(events, uid.as_deref());
    let in_namespace: Vec<&GpuMemoryBudget> =
        budgets.unwrap_or_default().iter().filter(|b| b.metadata.namespace.as_deref() == Some(namespace)).collect();
    let compiled: Vec<Budget> = in_namespace
        .iter()
        .filter_map(|b| match Budget::compile(b) {
            Ok(b) => Some(b),
            Err(e) => {
                warnings.push(format!("budget {} is invalid and not enforced: {e}", b.key()));
                None
            }
        })
        .collect();
    let mut compiled = compiled;
    for cluster in cluster_budgets.unwrap_or_default() {
        match Budget::compile_cluster(cluster) {
            Ok(b) => compiled.push(b),
            Err(e) => {
                warnings.push(format!("{CLUSTER_BUDGET_PREFIX}{} is invalid and not enforced: {e}", cluster.key()))
            }
        }
    }
    let resource = |n: &str| in_namespace.iter().copied().find(|b| b.metadata.name.as_deref() == Some(n));
    let cluster_resource = |n: &str| {
        let n = n.strip_prefix(CLUSTER_BUDGET_PREFIX)?;
        cluster_budgets.unwrap_or_default().iter().find(|b| b.metadata.name.as_deref() == Some(n))
    };
    // A budget by the name a record gives it: a cluster one's spec as read, else the namespace's.
    let info = |n: &str| match cluster_resource(n) {
        Some(c) => {
            let compiled = Budget::compile_cluster(c);
            BudgetInfo {
                name: n.to_owned(),
                spec: serde_json::to_value(&c.spec).unwrap_or_default(),
                limit_bytes: compiled.as_ref().ok().map(|b| b.limit_bytes),
                invalid: compiled.err().map(|e| e.to_string()),
            }
        }
        None => budget_info(resource(n), n, stored(n)),
    };
    let record = pod.and_then(|p| PodRecord::from_annotations(p.metadata.annotations.as_ref()?));
    let last_eviction_of = |b: Option<&GpuMemoryBudget>| {
        b.and_then(|b| b.status.as_ref()?.last_eviction.clone()).filter(|l| l.pod == name)
    };

    let Some(pod) = pod else {
        // Gone: the budget that evicted it, by its status, else the one its events name.
        let by_status = evicted_by(budgets.unwrap_or_default(), name);
        let budget_name = by_status.and_then(|b| b.metadata.name.clone()).or_else(|| events::budget_named(&rows));
        let last_eviction = last_eviction_of(by_status);
        if rows.is_empty() && last_eviction.is_none() {
            return Err(NotFound);
        }
        let why = match (&budget_name, by_status) {
            (Some(b), Some(_)) => format!("the pod is gone; budget {b} evicted it (its status.lastEviction names it)"),
            (Some(b), None) => format!("the pod is gone; its events name budget {b}"),
            (None, _) => "the pod is gone, and its events name no budget".to_owned(),
        };
        let evicted = rows.iter().rev().find(|r| [reason::EVICTING, reason::DELETING].contains(&r.reason.as_str()));
        let message = match (&last_eviction, evicted) {
            (Some(l), _) => format!(
                "nothing: the pod is gone, evicted at {} using {} on {}; if a controller (Deployment, StatefulSet, Job) owned it, it makes a new pod, \
                 which starts within its budget",
                l.time,
                l.usage,
                l.node.as_deref().unwrap_or("its node")
            ),
            (None, Some(e)) => format!(
                "nothing: the pod is gone; {} at {}: {}",
                e.reason,
                e.last_time.as_deref().unwrap_or("?"),
                e.message
            ),
            (None, None) => "nothing: the pod is gone (its events show no eviction by gpubudget)".to_owned(),
        };
        return Ok(WhyReport {
            api_version: API_VERSION,
            kind: "GpuMemoryWhy",
            pod: PodInfo {
                namespace: namespace.to_owned(),
                name: name.to_owned(),
                exists: false,
                uid: None,
                node: last_eviction.as_ref().and_then(|l| l.node.clone()),
                phase: None,
                deletion_timestamp: None,
                never_evicted: None,
            },
            budget: budget_name.as_deref().map(info),
            why,
            share: None,
            matched: Vec::new(),
            record: None,
            over_since: None,
            over_for_seconds: None,
            admission: crate::admission::Admission {
                gpu_containers: Vec::new(),
                verdicts: Vec::new(),
                set_by_gpubudget: None,
                caps: Vec::new(),
                summary: "unknown: the pod spec is gone".to_owned(),
            },
            next: Next { action: "Gone", at: None, message },
            last_eviction,
            events: last(rows),
            warnings,
        });
    };

    let labels = pod.metadata.labels.clone().unwrap_or_default();
    let no_namespace_labels = BTreeMap::new();
    let namespace_labels = namespace_labels.unwrap_or(&no_namespace_labels);
    let resolution = resolve(&compiled, &gpubudget_common::PodLabels::new(namespace, namespace_labels, &labels));
    let mut matched: Vec<MatchedBudget> = Vec::new();
    if let Some(r) = &resolution {
        for (i, b) in std::iter::once(r.budget).chain(r.also_matched.iter().copied()).enumerate() {
            let selector = match cluster_resource(&b.record_name()) {
                Some(c) => format!(
                    "namespaceSelector {}, selector {}",
                    selector_text(&c.spec.namespace_selector),
                    selector_text(&c.spec.budget.selector)
                ),
                None => resource(&b.name).map(|r| selector_text(&r.spec.selector)).unwrap_or_default(),
            };
            matched.push(MatchedBudget {
                name: b.record_name(),
                limit: b.limit_text.clone(),
                limit_bytes: b.limit_bytes,
                selector,
                applies: i == 0,
            });
        }
    }
    let with_cluster = resolution
        .as_ref()
        .is_some_and(|r| std::iter::once(r.budget).chain(r.also_matched.iter().copied()).any(Budget::is_cluster));
    let label_text = if labels.is_empty() {
        "none".to_owned()
    } else {
        labels.iter().map(|(k, v)| format!("{k}={v}")).collect::<Vec<_>>().join(",")
    };
    // The rules enforced: the budget's own, or tightened by the cluster budgets that also select the pod; or,
    // where the agent's record says a budget taking shares applied the pod's own share (only the node knows a
    // fraction's size), that budget's rules for the pod as recorded.
    let by_share: Option<Budget> = record.as_ref().and_then(|r| {
        let held = r.share.clone()?;
        let all = resolution.iter().flat_map(|res| std::iter::once(res.budget).chain(res.also_matched.iter().copied()));
        all.into_iter().find(|b| b.share.is_some() && b.is_record_name(&r.budget)).map(|b| b.with_held(held))
    });
    // The pod's own share is the limit that budget gives it: listed as such, and first, since it won on the node.
    if let Some(b) = &by_share {
        for m in &mut matched {
            m.applies = m.name == b.record_name();
            if m.applies {
                m.limit = format!("{}, this pod's share", b.limit_text);
                m.limit_bytes = b.limit_bytes;
            }
        }
        matched.sort_by_key(|m| !m.applies);
    }
    let applying: Option<&Budget> = by_share.as_ref().or_else(|| resolution.as_ref().map(|r| r.applied()));
    let mut why = match (budgets, matched.as_slice()) {
        (None, _) => match &record {
            Some(r) => {
                format!("the budgets of {namespace} could not be read; the agent's record names budget {}", r.budget)
            }
            None => format!("the budgets of {namespace} could not be read, and no agent has recorded this pod"),
        },
        (Some(_), []) => format!("no valid GpuMemoryBudget in {namespace} selects this pod (its labels: {label_text})"),
        (Some(_), [only]) => {
            format!(
                "{} is the only budget in {namespace} that selects this pod; its selector: {}",
                only.name, only.selector
            )
        }
        (Some(_), [first, ..]) if with_cluster => format!(
            "{} budgets select this pod: {}; the smallest limit applies (equal limits: the cluster budget, then the \
             name that sorts first), and a budget of {namespace} only if it is no looser in any field than the \
             cluster budgets, so {}",
            matched.len(),
            matched.iter().map(|m| format!("{} ({})", m.name, m.limit)).collect::<Vec<_>>().join(", "),
            first.name
        ),
        (Some(_), [first, ..]) => format!(
            "{} budgets in {namespace} select this pod: {}; the smallest limit applies (equal limits: the name that \
             sorts first), so {}",
            matched.len(),
            matched.iter().map(|m| format!("{} ({})", m.name, m.limit)).collect::<Vec<_>>().join(", "),
            first.name
        ),
    };
    let share = applying.and_then(|b| share_sentence(b, pod));
    if let Some(b) = &by_share {
        why.push_str(&format!(
            "; {} takes each pod's declared share as its limit, as the pod's node resolved it",
            b.record_name()
        ));
    }
    if let Some(by) = applying.filter(|_| by_share.is_none()).and_then(|b| b.tightened_by.as_deref()) {
        why.push_str(&format!("; its rules are tightened by {by}: no rule applied is looser than theirs"));
    }
    if let (Some(r), Some(b)) = (&record, applying)
        && !b.is_record_name(&r.budget)
    {
        let now_name = b.record_name();
        warnings.push(format!(
            "the agent's record names budget {}, but the budgets now resolve to {now_name}: the agent applies \
             {now_name} from its next sample (a budget or the pod's labels changed)",
            r.budget
        ));
    }
    // Which spec the nodes enforce, as the budget's status says (the operator writes it).
    if let Some(b) = applying {
        let name = b.record_name();
        let (generation, status) = match cluster_resource(&name) {
            Some(c) => (c.metadata.generation, c.status.as_ref()),
            None => resource(&b.name).map_or((None, None), |r| (r.metadata.generation, r.status.as_ref())),
        };
        if let Some(warning) = nodes_generation_warning(&name, generation, status) {
            warnings.push(warning);
        }
    }
    let budget_name = applying.map(Budget::record_name).or_else(|| record.as_ref().map(|r| r.budget.to_string()));
    let budget = budget_name.as_deref().map(info);
    let limit = applying.map(|b| b.limit_bytes);
    let over_since = record.as_ref().filter(|r| r.state.is_over()).and_then(|_| events::over_since(&rows));
    let never = never_evicted(pod, critical_namespaces, &mut warnings);
    let deletion = pod.metadata.deletion_timestamp.as_ref().map(|t| t.0);
    let grace =
        applying.map(|b| b.eviction_grace_seconds(pod.spec.as_ref().and_then(|s| s.termination_grace_period_seconds)));
    let next = next_step(&Situation {
        now,
        budget: applying,
        budgets_read: budgets.is_some(),
        record: record.as_ref(),
        over_since,
        never_evicted: never.as_deref(),
        deletion,
        grace,
        blocked_at: events::last_of(&rows, reason::BLOCKED),
        would_evict: events::would_evict(&rows),
        node: pod.spec.as_ref().and_then(|s| s.node_name.as_deref()),
    });
    Ok(WhyReport {
        api_version: API_VERSION,
        kind: "GpuMemoryWhy",
        pod: PodInfo {
            namespace: namespace.to_owned(),
            name: name.to_owned(),
            exists: true,
            uid,
            node: pod.spec.as_ref().and_then(|s| s.node_name.clone()),
            phase: pod.status.as_ref().and_then(|s| s.phase.clone()),
            deletion_timestamp: deletion.map(round),
            never_evicted: never,
        },
        last_eviction: last_eviction_of(budget_name.as_deref().and_then(resource)),
        budget,
        why,
        share,
        matched,
        record: record.as_ref().map(|r| (r, measured.unwrap_or(r.usage_bytes))).map(|(r, usage)| RecordInfo {
            state: r.state,
            usage_bytes: usage,
            usage: HumanBytes(usage).to_string(),
            budget: r.budget.to_string(),
            node: r.node.to_string(),
            percent: limit.and_then(|l| percent(usage, l)),
            eviction_requested_at: r.eviction_requested_at.clone(),
            cap_not_in_force: r.cap_not_in_force.clone(),
            limit_bytes: r.share.as_ref().map(|s| s.limit_bytes),
            runtime_caps: r.runtime_caps.as_ref().map(|c| match c {
                RuntimeCapsRecord::Capped { max_mib, containers } => {
                    let each: Vec<String> = containers.iter().map(|(name, mib)| format!("{name} {mib} MiB")).collect();
                    let each = if each.is_empty() { String::new() } else { format!(" ({})", each.join(", ")) };
                    format!(
                        "every GPU container made by the container runtime with an MPS cap the driver reads, at most \
                         {max_mib} MiB{each} (the runtime's environment is the one its processes started with; it wins \
                         over the spec's)"
                    )
                }
                RuntimeCapsRecord::Uncapped(why) => format!("made by the container runtime without a cap: {why}"),
            }),
        }),
        over_since: over_since.map(round),
        over_for_seconds: over_since.map(|t| now.duration_since(t).as_secs().max(0)),
        admission: admission(pod),
        next,
        events: last(rows),
        warnings,
    })
}

/// What `budget` (the one that applies) makes of the pod's declared share, where it takes shares: as the pod's
/// node resolved it (the record), or, before any agent has, what the pod declares: an absolute share is known
/// here; a fraction's size only on the node, against the GPU the pod got.
fn share_sentence(budget: &Budget, pod: &Pod) -> Option<String> {
    let sources = budget.share?;
    if let Some(held) = &budget.held_share {
        let limit = HumanBytes(budget.limit_bytes);
        return Some(if held.resolved() {
            let ignored = held.ignored.as_ref().map_or_else(String::new, |i| {
                format!(
                    "; its declaration changed since and is ignored ({i}): a share is fixed when the pod is placed \
                     and only tightens"
                )
            });
            format!("limit {limit} from its declared share: {} (resolved by its node's agent){ignored}", held.note)
        } else {
            format!("limit {limit}: {} (as its node's agent recorded)", held.note)
        });
    }
    let declaration = gpubudget_common::share::declared(pod, None, sources);
    Some(match declaration.under(sources, &[]) {
        None => format!(
            "the budget takes shares, but this pod declares none it reads: the budget's limit {} applies",
            budget.limit_text
        ),
        Some(Ok(resolved)) => format!(
            "its declared share {} is its limit (at most the budget's {}) once its node's agent sees it",
            resolved.text, budget.limit_text
        ),
        Some(Err(why)) if why.is_pods() => {
            format!("its declared share is unresolved: {why}; it is held to the budget's limit {}", budget.limit_text)
        }
        Some(Err(_)) => format!(
            "its declared share is a part of a GPU: its size is resolved on its node, against the GPU it got, once \
             the agent there sees it (until then: the budget's limit {})",
            budget.limit_text
        ),
    })
}

fn last(mut rows: Vec<EventRow>) -> Vec<EventRow> {
    rows.drain(..rows.len().saturating_sub(EVENTS_SHOWN));
    rows
}

/// What [`next_step`] decides from.
#[derive(Debug, Clone)]
pub struct Situation<'a> {
    pub now: Timestamp,
    /// The budget that applies (valid).
    pub budget: Option<&'a Budget>,
    pub budgets_read: bool,
    pub record: Option<&'a PodRecord>,
    pub over_since: Option<Timestamp>,
    pub never_evicted: Option<&'a str>,
    /// The pod's `deletionTimestamp`: it is terminating.
    pub deletion: Option<Timestamp>,
    /// The eviction grace period the budget gives this pod.
    pub grace: Option<i64>,
    /// The last `GpuMemoryEvictionBlocked` event.
    pub blocked_at: Option<Timestamp>,
    /// Observe mode (#54): the last `GpuMemoryWouldEvict` event of this episode ([`events::would_evict`]): when,
    /// and which level set the mode.
    pub would_evict: Option<(Timestamp, String)>,
    pub node: Option<&'a str>,
}

/// What happens to the pod next, and when: the agent's rules (`agent/src/decide`) read from outside.
pub fn next_step(s: &Situation<'_>) -> Next {
    let next = |action, at: Option<Timestamp>, message: String| Next { action, at: at.map(round), message };
    if let Some(at) = s.deletion {
        return next(
            "Terminate",
            Some(at),
            format!(
                "the pod is terminating: the kubelet stops it by {} ({}), and its GPU memory is freed",
                round(at),
                until(s.now, at)
            ),
        );
    }
    // Observe mode (#54): the agent said it would evict the pod, and did not.
    if let Some((at, set_by)) = &s.would_evict
        && s.record.is_none_or(|r| r.state != BudgetState::Evicting)
    {
        return next(
            "WouldEvict",
            None,
            format!(
                "would be evicted (observe mode: {set_by}): the agent said so at {} and evicts nothing while the mode \
                 is Observe (its event GpuMemoryWouldEvict says why); to enforce, see docs/operations.md, \
                 \"Observe first\"",
                round(*at)
            ),
        );
    }
    let Some(budget) = s.budget else {
        return match (s.budgets_read, s.record) {
            (true, _) => {
                next("Nothing", None, "nothing: no budget selects this pod, so gpubudget does not enforce it".into())
            }
            (false, Some(r)) => next(
                "Unknown",
                None,
                format!(
                    "unknown: the budgets could not be read; the agent recorded {} under budget {}",
                    r.state, r.budget
                ),
            ),
            (false, None) => next("Unknown", None, "unknown: the budgets could not be read".into()),
        };
    };
    let observed = budget.enforcement == Some(gpubudget_common::Enforcement::Observe);
    let limit = HumanBytes(budget.limit_bytes);
    let Some(record) = s.record else {
        return next(
            "Nothing",
            None,
            format!(
                "nothing yet: no agent has recorded GPU memory for this pod (it holds none the agent saw, or no agent runs \
                 on {}); over {limit} for {}s it would be {}",
                s.node.unwrap_or("its node"),
                budget.over_limit_seconds,
                if budget.action == BudgetAction::Warn {
                    "reported (action Warn)"
                } else if observed {
                    "reported as would be evicted (the budget's enforcement is Observe)"
                } else {
                    "evicted"
                }
            ),
        );
    };
    let then = match (budget.action, s.never_evicted) {
        (BudgetAction::Warn, _) => {
            "it is reported (events, status), never evicted: the budget's action is Warn".to_owned()
        }
        (_, Some(why)) => format!("it is reported, never evicted: {why}"),
        (BudgetAction::Evict, None) if observed => format!(
            "once over {limit} for {}s it would be evicted, and is not: the budget's enforcement is Observe (events \
             GpuMemoryWouldEvict)",
            budget.over_limit_seconds
        ),
        (BudgetAction::Evict, None) => format!(
            "it is evicted once over {limit} for {}s, with {}s grace",
            budget.over_limit_seconds,
            s.grace.unwrap_or(30)
        ),
    };
    match record.state {
        BudgetState::Within => next(
            "Nothing",
            None,
            format!(
                "nothing: within its budget (Near at {}% of {limit} = {}); {then}",
                budget.warn_at_percent,
                HumanBytes(budget.thresholds(false).warn)
            ),
        ),
        BudgetState::Near => next("Nothing", None, format!("nothing yet: near its limit of {limit}; {then}")),
        BudgetState::Over if budget.action == BudgetAction::Warn || s.never_evicted.is_some() || observed => {
            next("Nothing", None, format!("nothing: over its limit, but {then}"))
        }
        BudgetState::Over => {
            let due = s.over_since.and_then(|t| plus(t, i64::try_from(budget.over_limit_seconds).unwrap_or(i64::MAX)));
            let grace = s.grace.unwrap_or(30);
            match due {
                Some(at) if at > s.now => next(
                    "Evict",
                    Some(at),
                    format!(
                        "evicted at {} ({}) at the earliest, if it stays over {limit}: {}s over the limit, counted from {} \
                         (time at or under the limit pushes it back at half rate); {grace}s grace",
                        round(at),
                        until(s.now, at),
                        budget.over_limit_seconds,
                        s.over_since.map(round).unwrap_or_default()
                    ),
                ),
                Some(at) => next(
                    "Evict",
                    Some(s.now),
                    format!(
                        "evicted at the agent's next sample if still over {limit}: over since {} and due from {} (dips \
                         under the limit delay it); {grace}s grace",
                        s.over_since.map(round).unwrap_or_default(),
                        round(at)
                    ),
                ),
                None => next(
                    "Evict",
                    None,
                    format!(
                        "evicted once over {limit} for {}s in all (the events that say since when are gone); {grace}s grace",
                        budget.over_limit_seconds
                    ),
                ),
            }
        }
        BudgetState::Evicting => {
            let requested = record.eviction_requested_at.as_deref().and_then(|t| t.parse::<Timestamp>().ok());
            let refused = s.blocked_at.is_some_and(|b| requested.is_none_or(|r| b >= r));
            match (refused, budget.blocked_eviction_timeout_seconds, requested) {
                (true, Some(timeout), Some(r)) => {
                    let at = plus(r, i64::try_from(timeout).unwrap_or(i64::MAX));
                    next(
                        "Delete",
                        at,
                        format!(
                            "its evictions are refused (a PodDisruptionBudget or the eviction check); the agent retries, \
                             and deletes the pod at {} ({}) as blockedEvictionTimeoutSeconds ({timeout}) says, unless it \
                             goes back under {limit}",
                            at.map(round).unwrap_or_default(),
                            at.map(|a| until(s.now, a)).unwrap_or_default()
                        ),
                    )
                }
                (true, _, _) => next(
                    "Evict",
                    None,
                    format!(
                        "its evictions are refused (a PodDisruptionBudget or the eviction check); the agent retries while \
                         it stays over {limit}, for as long as they refuse: the budget sets no blockedEvictionTimeoutSeconds"
                    ),
                ),
                (false, _, r) => next(
                    "Evict",
                    r,
                    format!(
                        "eviction requested{}: once the API server accepts it the pod has {}s to stop",
                        r.map(|r| format!(" at {} ({})", round(r), until(s.now, r))).unwrap_or_default(),
                        s.grace.unwrap_or(30)
                    ),
                ),
            }
        }
    }
}

#[cfg(test)]
mod tests;
