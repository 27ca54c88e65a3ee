//! A budget as the enforcement logic uses it, and which budget a pod gets.

use std::collections::BTreeMap;

use crate::crd::{AdmissionCaps, BudgetAction, ClusterGpuMemoryBudget, GpuMemoryBudget, GpuMemoryBudgetSpec};
use crate::quantity::{self, QuantityError};
use crate::selector::{Selector, SelectorError};
use crate::state::Thresholds;

/// Priority classes whose pods are never evicted (as for the kubelet).
pub const CRITICAL_PRIORITY_CLASSES: [&str; 2] = ["system-node-critical", "system-cluster-critical"];
/// Pods at or above this priority are critical whatever their class is called (the kubelet's rule).
pub const SYSTEM_CRITICAL_PRIORITY: i32 = 2_000_000_000;

/// Why a budget's spec cannot be enforced. Each names the field.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SpecError {
    /// `spec.limit` is not a positive quantity.
    #[error("spec.limit: {0}")]
    Limit(QuantityError),
    /// `spec.limit` is zero.
    #[error("spec.limit: must be more than 0")]
    ZeroLimit,
    /// `spec.request` is not a quantity of bytes.
    #[error("spec.request: {0}")]
    Request(QuantityError),
    /// `spec.request` is more than `spec.limit`.
    #[error("spec.request: {request} is more than the limit {limit}")]
    RequestAboveLimit {
        /// The request as written.
        request: String,
        /// The limit as written.
        limit: String,
    },
    /// `spec.selector` is not a valid label selector.
    #[error("spec.selector: {0}")]
    Selector(SelectorError),
    /// `spec.warnAtPercent` is outside 1..=100.
    #[error("spec.warnAtPercent: {0} is not between 1 and 100")]
    WarnAtPercent(i32),
    /// A seconds field is negative.
    #[error("spec.{field}: {value} is negative; must be 0 or more")]
    NegativeSeconds {
        /// The field's name.
        field: &'static str,
        /// The value written.
        value: i64,
    },
    /// A seconds field is under its minimum.
    #[error("spec.{field}: {value} is less than {min}")]
    SecondsBelow {
        /// The field's name.
        field: &'static str,
        /// The value written.
        value: i64,
        /// Smallest allowed.
        min: i64,
    },
    /// A seconds field is outside its bounds.
    #[error("spec.{field}: {value} is not between {min} and {max}")]
    SecondsOutOfRange {
        /// The field's name.
        field: &'static str,
        /// The value written.
        value: i64,
        /// Smallest allowed.
        min: i64,
        /// Largest allowed.
        max: i64,
    },
    /// The object has no name or namespace.
    #[error("metadata: a GpuMemoryBudget needs a name and a namespace")]
    Unnamed,
    /// A `ClusterGpuMemoryBudget` has no name.
    #[error("metadata: a ClusterGpuMemoryBudget needs a name")]
    UnnamedCluster,
    /// A `ClusterGpuMemoryQuota` has no name.
    #[error("metadata: a ClusterGpuMemoryQuota needs a name")]
    UnnamedQuota,
    /// `spec.namespaceSelector` is not a valid label selector.
    #[error("spec.namespaceSelector: {0}")]
    NamespaceSelector(SelectorError),
}

/// Where a budget applies.
#[derive(Debug, Clone, PartialEq)]
pub enum Scope {
    /// A `GpuMemoryBudget`: the pods of its own namespace.
    Namespaced,
    /// A `ClusterGpuMemoryBudget`: the pods of the namespaces whose labels this selector matches.
    Cluster {
        /// The compiled `spec.namespaceSelector`.
        namespaces: Selector,
    },
}

/// The longest grace period a pod's own `terminationGracePeriodSeconds` gets when the budget sets no
/// `evictionGracePeriodSeconds`: a pod asking for an hour would hold its memory for that hour.
pub const DEFAULT_EVICTION_GRACE_CAP_SECONDS: i64 = 30;

/// A validated budget, ready for matching and enforcement.
#[derive(Debug, Clone, PartialEq)]
pub struct Budget {
    /// Namespace of the budget (it applies to pods there only); empty for a cluster budget.
    pub namespace: String,
    /// A namespaced or a cluster budget.
    pub scope: Scope,
    /// Name of the budget.
    pub name: String,
    /// The compiled selector.
    pub selector: Selector,
    /// `spec.limit` in bytes.
    pub limit_bytes: u64,
    /// `spec.limit` as written.
    pub limit_text: String,
    /// `spec.request` in bytes (at most `limit_bytes`): a pod using no more is never evicted. `None`: unset.
    pub request_bytes: Option<u64>,
    /// `spec.request` as written.
    pub request_text: Option<String>,
    /// `spec.warnAtPercent`.
    pub warn_at_percent: u8,
    /// `spec.action`.
    pub action: BudgetAction,
    /// `spec.enforcement`: whether its own evictions are carried out (`None`: as the node says;
    /// [`crate::enforcement`]). Merged to the tighter value ([`Budget::tighten`]).
    pub enforcement: Option<crate::enforcement::Enforcement>,
    /// `spec.overLimitSeconds`.
    pub over_limit_seconds: u64,
    /// `spec.evictionGracePeriodSeconds`.
    pub eviction_grace_period_seconds: Option<i64>,
    /// `spec.blockedEvictionTimeoutSeconds`: refused evictions this long → delete the pod. `None`: never.
    pub blocked_eviction_timeout_seconds: Option<u64>,
    /// The resource's `metadata.generation` this was compiled from (`None`: not known), for messages: which
    /// spec an eviction acted under.
    pub generation: Option<i64>,
    /// Only on the rules [`resolve`] made for a pod, never on a compiled spec: the most grace another budget
    /// that selected the pod allows an eviction ([`Budget::tighten`]); every grace this budget gives is capped
    /// by it. `None`: no other cap.
    pub grace_ceiling_seconds: Option<i64>,
    /// `spec.admissionCaps` is `Enabled`: the admission webhook sets the driver's caps in new pods
    /// (`crate::caps`).
    pub admission_caps: bool,
    /// Only on the rules [`resolve`] made for a pod, never on a compiled spec: the budgets of the same kind that
    /// selected the pod too and made this budget's rules tighter than its spec (`ClusterGpuMemoryBudget/x
    /// (action, overLimitSeconds)`, `GpuMemoryBudget/ns/y (overLimitSeconds)`), for messages. `None`: the rules
    /// are this budget's own.
    pub tightened_by: Option<String>,
    /// `spec.share`: the declarations each pod's limit is taken from ([`crate::share`]). `None`: unset.
    pub share: Option<crate::share::Sources>,
    /// Only on the rules made for one pod ([`Budget::for_share`], [`Budget::for_unresolved_share`]): how its
    /// limit came from its declared share (`KAI gpu-fraction 0.5 of 79.6Gi = 39.8Gi`), or why it could not.
    pub held_share: Option<crate::share::HeldShare>,
    /// Only on the rules [`Budget::for_unresolved_share`] made: why the share could not be resolved, the pod's
    /// own declaration ([`ShareFault::Invalid`](crate::share::ShareFault::Invalid): the agent tells the pod so)
    /// or the node's GPUs not known yet.
    pub share_fault: Option<crate::share::ShareFault>,
    /// Only on the rules made for one pod ([`Budget::for_declared_since`]): the share the pod declares now (or
    /// its removal, or an unreadable one) would loosen the share it was first held to, and is ignored; why, in
    /// words (#51: a share is fixed when the pod is placed and only tightens).
    pub share_kept: Option<String>,
}

impl Budget {
    /// Validates a resource's spec into a `Budget`.
    pub fn compile(resource: &GpuMemoryBudget) -> Result<Self, SpecError> {
        let (Some(namespace), Some(name)) = (&resource.metadata.namespace, &resource.metadata.name) else {
            return Err(SpecError::Unnamed);
        };
        Ok(Self { generation: resource.metadata.generation, ..Self::from_spec(namespace, name, &resource.spec)? })
    }

    /// Validates a `ClusterGpuMemoryBudget` into a `Budget` (empty namespace, [`Scope::Cluster`]).
    pub fn compile_cluster(resource: &ClusterGpuMemoryBudget) -> Result<Self, SpecError> {
        let name = resource.metadata.name.as_deref().ok_or(SpecError::UnnamedCluster)?;
        let namespaces = Selector::compile(&resource.spec.namespace_selector).map_err(SpecError::NamespaceSelector)?;
        Ok(Self {
            scope: Scope::Cluster { namespaces },
            generation: resource.metadata.generation,
            ..Self::from_spec("", name, &resource.spec.budget)?
        })
    }

    /// Validates a spec into a `Budget` named `namespace/name`.
    pub fn from_spec(namespace: &str, name: &str, spec: &GpuMemoryBudgetSpec) -> Result<Self, SpecError> {
        let limit_bytes = quantity::parse_bytes(&spec.limit.0).map_err(SpecError::Limit)?;
        if limit_bytes == 0 {
            return Err(SpecError::ZeroLimit);
        }
        let request_bytes = match &spec.request {
            None => None,
            Some(request) => {
                let bytes = quantity::parse_bytes(&request.0).map_err(SpecError::Request)?;
                if bytes > limit_bytes {
                    return Err(SpecError::RequestAboveLimit {
                        request: request.0.clone(),
                        limit: spec.limit.0.clone(),
                    });
                }
                Some(bytes)
            }
        };
        let warn_at_percent = u8::try_from(spec.warn_at_percent)
            .ok()
            .filter(|p| (1..=100).contains(p))
            .ok_or(SpecError::WarnAtPercent(spec.warn_at_percent))?;
        let over_limit_seconds = u64::try_from(spec.over_limit_seconds)
            .map_err(|_| SpecError::NegativeSeconds { field: "overLimitSeconds", value: spec.over_limit_seconds })?;
        if let Some(grace) = spec.eviction_grace_period_seconds.filter(|g| *g < 1) {
            return Err(SpecError::SecondsBelow { field: "evictionGracePeriodSeconds", value: grace, min: 1 });
        }
        let blocked_eviction_timeout_seconds = match spec.blocked_eviction_timeout_seconds {
            None => None,
            Some(value @ 0..=86_400) => Some(value.unsigned_abs()),
            Some(value) => {
                return Err(SpecError::SecondsOutOfRange {
                    field: "blockedEvictionTimeoutSeconds",
                    value,
                    min: 0,
                    max: 86_400,
                });
            }
        };
        Ok(Self {
            namespace: namespace.to_owned(),
            scope: Scope::Namespaced,
            name: name.to_owned(),
            selector: Selector::compile(&spec.selector).map_err(SpecError::Selector)?,
            limit_bytes,
            limit_text: spec.limit.0.clone(),
            request_bytes,
            request_text: spec.request.as_ref().map(|r| r.0.clone()),
            warn_at_percent,
            action: spec.action,
            enforcement: spec.enforcement,
            over_limit_seconds,
            eviction_grace_period_seconds: spec.eviction_grace_period_seconds,
            blocked_eviction_timeout_seconds,
            generation: None,
            grace_ceiling_seconds: None,
            admission_caps: spec.admission_caps == AdmissionCaps::Enabled,
            tightened_by: None,
            share: spec.share.as_ref().map(|s| crate::share::Sources::of(&s.sources)),
            held_share: None,
            share_fault: None,
            share_kept: None,
        })
    }

    /// This budget's rules for a pod whose declared share came to `share` ([`crate::share::resolve`]): its
    /// limit is the share, at most the budget's `limit`, and so is its request (the tool that declared the
    /// share reserved it for the pod, so it is guaranteed under pressure). Everything else is the budget's.
    pub fn for_share(&self, share: &crate::share::Resolved) -> Budget {
        let note = if share.bytes > self.limit_bytes {
            format!("{}, held to the budget's limit {}", share.text, self.limit_text)
        } else {
            share.text.clone()
        };
        self.with_held(crate::share::HeldShare::new(share.bytes, share.sources.clone(), note))
    }

    /// This budget's rules for a pod held as `held` says (how the agent resolved its share, as its record
    /// carries it): the limit is the held one, at most the budget's; a resolved share is the pod's request too.
    pub fn with_held(&self, mut held: crate::share::HeldShare) -> Budget {
        let limit = held.limit_bytes.clamp(1, self.limit_bytes);
        held.limit_bytes = limit;
        let (request_bytes, request_text) = if held.resolved() {
            (Some(limit), Some(crate::quantity::HumanBytes(limit).to_string()))
        } else {
            (self.request_bytes, self.request_text.clone())
        };
        Budget {
            limit_bytes: limit,
            limit_text: if limit == self.limit_bytes {
                self.limit_text.clone()
            } else {
                crate::quantity::HumanBytes(limit).to_string()
            },
            request_bytes,
            request_text,
            held_share: Some(held),
            ..self.clone()
        }
    }

    /// This budget's rules for a pod that declares `declaration`, on a node whose GPUs hold `gpu_totals`
    /// bytes: `None` where the budget takes no share (`spec.share` unset) or the pod declares none of the
    /// sources it reads (the budget's own rules apply); else [`for_share`](Self::for_share) or, where the
    /// declaration cannot be resolved, [`for_unresolved_share`](Self::for_unresolved_share).
    pub fn for_declared(&self, declaration: &crate::share::Declaration, gpu_totals: &[u64]) -> Option<Budget> {
        let sources = self.share?;
        match declaration.under(sources, gpu_totals)? {
            Ok(share) => Some(self.for_share(&share)),
            Err(fault) => Some(self.for_unresolved_share(fault)),
        }
    }

    /// This budget's rules for a pod that declares `declaration` now, and whose record holds `first`, the share
    /// the agent first held it to (#51): a share is fixed when the pod is placed (the scheduler reserved it then
    /// and never reads the declaration again) and can only tighten. A declaration that resolves to no more than
    /// `first` applies ([`for_declared`](Self::for_declared)); one that resolves to more, that cannot be read, or
    /// that is gone keeps `first` (at most this budget's limit), with [`share_kept`](Self::share_kept) saying so;
    /// its request is then `first` at most this budget's own guaranteed bytes, so that nothing written on the
    /// pod (its declaration, or a record written by anyone but the agent) raises it. `first` counts only where it
    /// was resolved from a source this budget reads.
    pub fn for_declared_since(
        &self,
        declaration: &crate::share::Declaration,
        gpu_totals: &[u64],
        first: Option<&crate::share::HeldShare>,
    ) -> Option<Budget> {
        let now = self.for_declared(declaration, gpu_totals);
        let sources = self.share?;
        let Some(first) = first.filter(|h| h.resolved() && h.sources.iter().any(|s| sources.has(*s))) else {
            return now;
        };
        let held_now = now.as_ref().and_then(|r| r.held_share.as_ref());
        let ignored = match held_now {
            Some(h) if h.resolved() && h.limit_bytes <= first.limit_bytes => return now,
            Some(h) if h.resolved() => format!("the share declared now ({}) is more", h.note),
            Some(_) => match now.as_ref().and_then(|r| r.share_fault.as_ref()) {
                Some(why) if why.is_pods() => format!("the share declared now cannot be read ({why})"),
                // The node's GPUs not known yet (an agent's restart): the first share holds, nothing to tell.
                _ => String::new(),
            },
            None => "the share was removed".to_owned(),
        };
        let held = if ignored.is_empty() { first.clone() } else { first.clone().kept_over(ignored.clone()) };
        let mut kept = self.with_held(held);
        let request = kept.limit_bytes.min(self.guaranteed_bytes());
        if kept.request_bytes != Some(request) {
            kept.request_bytes = Some(request);
            kept.request_text = Some(crate::quantity::HumanBytes(request).to_string());
        }
        kept.share_kept = (!ignored.is_empty()).then(|| {
            let why = format!(
                "{ignored} and is ignored: a share is fixed when the pod is placed and only tightens; held to the \
                 first, {}",
                first.note
            );
            crate::share::HeldShare::new(0, Vec::new(), why).note
        });
        Some(kept)
    }

    /// Where these are a pod's rules that kept its first share over a later declaration that would loosen it
    /// ([`for_declared_since`](Self::for_declared_since)): why, in words.
    pub fn share_change_ignored(&self) -> Option<&str> {
        self.share_kept.as_deref()
    }

    /// This budget's rules for a pod whose declared share could not be resolved, for `fault`: the budget's own,
    /// with the reason in every message, never a guessed share.
    pub fn for_unresolved_share(&self, fault: crate::share::ShareFault) -> Budget {
        let note = format!("share unresolved: {fault}; held to the budget's limit {}", self.limit_text);
        let held = crate::share::HeldShare::new(self.limit_bytes, Vec::new(), note);
        Budget { share_fault: Some(fault), ..self.with_held(held) }
    }

    /// Where these are a pod's rules from a declared share that could not be read because of the pod (its
    /// declaration malformed or out of range, not the node's GPUs still unknown): the note saying why.
    pub fn share_unresolved(&self) -> Option<&str> {
        self.held_share.as_ref().map(|h| h.note.as_str()).filter(|_| self.share_fault_is_pods())
    }

    /// Whether these are a pod's rules from a declared share that could not be read because of the pod's own
    /// declaration ([`ShareFault::is_pods`](crate::share::ShareFault::is_pods)).
    pub fn share_fault_is_pods(&self) -> bool {
        self.share_fault.as_ref().is_some_and(crate::share::ShareFault::is_pods)
    }

    /// The grace period (seconds) for evicting a pod whose own `terminationGracePeriodSeconds` is
    /// `pod_grace` (30 when unset): the pod's own, at most [`most_grace_seconds`](Self::most_grace_seconds)
    /// (the budget's `evictionGracePeriodSeconds`, else [`DEFAULT_EVICTION_GRACE_CAP_SECONDS`]), and at least 1
    /// (0 would kill it without its shutdown). A most, as the kubelet's `--eviction-max-pod-grace-period` is:
    /// what a budget allows never gives a pod more than it asks for, so a tighter budget is tighter for every pod.
    pub fn eviction_grace_seconds(&self, pod_grace: Option<i64>) -> i64 {
        pod_grace.unwrap_or(30).clamp(1, self.most_grace_seconds().max(1))
    }

    /// The most grace any eviction under these rules may give, whatever the pod asks for.
    pub fn most_grace_seconds(&self) -> i64 {
        let most = self.eviction_grace_period_seconds.unwrap_or(DEFAULT_EVICTION_GRACE_CAP_SECONDS);
        self.grace_ceiling_seconds.map_or(most, |ceiling| most.min(ceiling))
    }

    /// The grace of an eviction for GPU memory pressure: the node's (`node_seconds`), at most
    /// [`most_grace_seconds`](Self::most_grace_seconds) (a budget may shorten the node's, never lengthen it).
    pub fn pressure_grace_seconds(&self, node_seconds: i64) -> i64 {
        node_seconds.min(self.most_grace_seconds())
    }

    /// Under GPU memory pressure, how long refused evictions hold the pod before it is deleted (ms): the node's
    /// bound (`node_ms`), or `blockedEvictionTimeoutSeconds` where that is shorter. A budget may shorten the
    /// node's bound, never lengthen it: tenants may write budgets, and the bound is what keeps a
    /// PodDisruptionBudget from holding memory a neighbour needs.
    pub fn pressure_blocked_timeout_ms(&self, node_ms: u64) -> u64 {
        self.blocked_eviction_timeout_seconds.map_or(node_ms, |own| own.saturating_mul(1000).min(node_ms))
    }

    /// The bytes a pod of this budget is never evicted within, for GPU memory pressure or otherwise: its
    /// request, or without one its limit. Under pressure, pods are ranked by how far they are above it.
    pub fn guaranteed_bytes(&self) -> u64 {
        self.request_bytes.unwrap_or(self.limit_bytes)
    }

    /// `namespace/name`; a cluster budget's is its name alone (it has no namespace, and no namespaced key
    /// lacks the `/`).
    pub fn key(&self) -> String {
        match self.scope {
            Scope::Namespaced => format!("{}/{}", self.namespace, self.name),
            Scope::Cluster { .. } => self.name.clone(),
        }
    }

    /// Whether `key` is this budget's [`key`](Self::key) (compared without allocating).
    pub fn has_key(&self, key: &str) -> bool {
        match self.scope {
            Scope::Cluster { .. } => key == self.name,
            Scope::Namespaced => {
                key.len() == self.namespace.len() + 1 + self.name.len()
                    && key.starts_with(self.namespace.as_str())
                    && key.ends_with(self.name.as_str())
                    && key.as_bytes()[self.namespace.len()] == b'/'
            }
        }
    }

    /// How a pod's record names this budget ([`crate::pod_record::BUDGET`]): its name, after
    /// [`crate::pod_record::CLUSTER_BUDGET_PREFIX`] for a cluster budget.
    pub fn record_name(&self) -> String {
        match self.scope {
            Scope::Cluster { .. } => format!("{}{}", crate::pod_record::CLUSTER_BUDGET_PREFIX, self.name),
            Scope::Namespaced => self.name.clone(),
        }
    }

    /// Whether a pod record's budget field names this budget (compared without allocating).
    pub fn is_record_name(&self, recorded: &str) -> bool {
        match self.scope {
            Scope::Cluster { .. } => {
                recorded.strip_prefix(crate::pod_record::CLUSTER_BUDGET_PREFIX) == Some(&self.name)
            }
            Scope::Namespaced => recorded == self.name,
        }
    }

    /// A `ClusterGpuMemoryBudget`.
    pub fn is_cluster(&self) -> bool {
        matches!(self.scope, Scope::Cluster { .. })
    }

    /// Whether this budget's selectors pick the pod `pod`: for a namespaced budget, a pod of its namespace
    /// whose labels its selector matches; for a cluster budget, a pod whose namespace's labels its
    /// `namespaceSelector` matches and whose labels its selector matches.
    pub fn selects(&self, pod: &PodLabels<'_>) -> bool {
        let here = match &self.scope {
            Scope::Namespaced => self.namespace == pod.namespace,
            Scope::Cluster { namespaces } => namespaces.matches(pod.namespace_labels),
        };
        here && self.selector.matches(pod.labels)
    }

    /// Whether this budget is no looser than `other` in any field that governs enforcement: limit, the
    /// bytes guaranteed (request), action, `enforcement` ([`crate::enforcement::tightness`]), `overLimitSeconds`,
    /// the most grace an eviction may give, `blockedEvictionTimeoutSeconds` (unset: never) and `admissionCaps`. `warnAtPercent` only reports,
    /// and is not compared.
    pub fn no_looser_than(&self, other: &Budget) -> bool {
        let evicts = |b: &Budget| b.action == BudgetAction::Evict;
        let most_grace = Budget::most_grace_seconds;
        let blocked = |b: &Budget| b.blocked_eviction_timeout_seconds.unwrap_or(u64::MAX);
        self.limit_bytes <= other.limit_bytes
            && self.guaranteed_bytes() <= other.guaranteed_bytes()
            && (evicts(self) || !evicts(other))
            && crate::enforcement::tightness(self.enforcement) >= crate::enforcement::tightness(other.enforcement)
            && self.over_limit_seconds <= other.over_limit_seconds
            && most_grace(self) <= most_grace(other)
            && blocked(self) <= blocked(other)
            && (self.admission_caps || !other.admission_caps)
    }

    /// Makes this budget's rules no looser than `other`'s in any field [`no_looser_than`](Self::no_looser_than)
    /// compares but the limit (the budget keeps its own, which names it), taking the tighter value of each;
    /// `warnAtPercent` takes the earlier warning. Returns the names of the fields `other` tightened.
    pub fn tighten(&mut self, other: &Budget) -> Vec<&'static str> {
        let mut changed = Vec::new();
        if other.guaranteed_bytes() < self.guaranteed_bytes() {
            self.request_bytes = Some(other.guaranteed_bytes());
            self.request_text = Some(crate::quantity::HumanBytes(other.guaranteed_bytes()).to_string());
            changed.push("request");
        }
        if other.action == BudgetAction::Evict && self.action != BudgetAction::Evict {
            self.action = BudgetAction::Evict;
            changed.push("action");
        }
        let enforcement = crate::enforcement::tighter(self.enforcement, other.enforcement);
        if enforcement != self.enforcement {
            self.enforcement = enforcement;
            changed.push("enforcement");
        }
        if other.over_limit_seconds < self.over_limit_seconds {
            self.over_limit_seconds = other.over_limit_seconds;
            changed.push("overLimitSeconds");
        }
        // Capped, not replaced: a pod asking for less grace than the other budget's most keeps its own.
        if other.most_grace_seconds() < self.most_grace_seconds() {
            self.grace_ceiling_seconds = Some(other.most_grace_seconds());
            changed.push("evictionGracePeriodSeconds");
        }
        let blocked = |b: &Budget| b.blocked_eviction_timeout_seconds.unwrap_or(u64::MAX);
        if blocked(other) < blocked(self) {
            self.blocked_eviction_timeout_seconds = other.blocked_eviction_timeout_seconds;
            changed.push("blockedEvictionTimeoutSeconds");
        }
        if other.admission_caps && !self.admission_caps {
            self.admission_caps = true;
            changed.push("admissionCaps");
        }
        if other.warn_at_percent < self.warn_at_percent {
            self.warn_at_percent = other.warn_at_percent;
            changed.push("warnAtPercent");
        }
        changed
    }

    /// `budget team-a/llm` or `budget team-a/llm, tightened by ClusterGpuMemoryBudget/strict (action)`: how
    /// messages name the rules that apply.
    pub fn described(&self) -> String {
        let share = self.held_share.as_ref().map(|h| format!(": {}", h.note)).unwrap_or_default();
        match &self.tightened_by {
            None => format!("budget {}{share}", self.key()),
            Some(by) => format!("budget {}{share}, tightened by {by}", self.key()),
        }
    }

    /// `; under generation 4 of budget team-a/llm` when the generation is known, else empty: which spec an
    /// eviction acted under, so that one taken under a spec since changed is told as such.
    pub fn under_generation(&self) -> String {
        self.generation.map(|g| format!("; under generation {g} of budget {}", self.key())).unwrap_or_default()
    }

    /// The state machine's thresholds for a pod under this budget.
    pub fn thresholds(&self, critical: bool) -> Thresholds {
        Thresholds::new(
            self.limit_bytes,
            self.warn_at_percent,
            self.over_limit_seconds.saturating_mul(1000),
            self.action == BudgetAction::Evict && !critical,
        )
    }
}

/// Whether a pod has critical priority. Decided only from fields that admission controls (the priority
/// class and the priority the API server resolved from it), never from labels or annotations the pod's
/// owner can set. Critical priority exempts a pod from eviction only in the namespaces an administrator
/// lists ([`CriticalNamespaces`]): any namespace may use those classes unless a ResourceQuota forbids it.
pub fn is_critical(priority_class_name: Option<&str>, priority: Option<i32>) -> bool {
    priority_class_name.is_some_and(|c| CRITICAL_PRIORITY_CLASSES.contains(&c))
        || priority.is_some_and(|p| p >= SYSTEM_CRITICAL_PRIORITY)
}

/// Namespaces listed in `--critical-namespaces` at most.
pub const CRITICAL_NAMESPACES_MAX: usize = 256;

/// The namespaces whose critical-priority pods are never evicted (#33): an administrator's list
/// (`--critical-namespaces`, the chart's `criticalNamespaces`), `kube-system` by default. A pod of
/// `system-node-critical` elsewhere is enforced like any other, and its events say why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CriticalNamespaces(std::sync::Arc<std::collections::BTreeSet<String>>);

impl Default for CriticalNamespaces {
    fn default() -> Self {
        Self(std::sync::Arc::new(std::iter::once("kube-system".to_owned()).collect()))
    }
}

/// Why a `--critical-namespaces` list is refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CriticalNamespacesError {
    /// An entry is not a namespace name.
    #[error(
        "{0:?} is not a namespace name (lowercase letters, digits and '-', at most 63, starting and ending with a letter or digit)"
    )]
    NotANamespace(String),
    /// Too many entries.
    #[error("{0} namespaces listed; at most {CRITICAL_NAMESPACES_MAX}")]
    TooMany(usize),
}

impl std::str::FromStr for CriticalNamespaces {
    type Err = CriticalNamespacesError;

    /// A comma-separated list (`kube-system,gpu-system`); empty: no namespace (critical priority exempts
    /// nothing). Each entry a namespace name (a DNS-1123 label).
    fn from_str(text: &str) -> Result<Self, Self::Err> {
        let entries: Vec<&str> = text.split(',').map(str::trim).filter(|e| !e.is_empty()).collect();
        if entries.len() > CRITICAL_NAMESPACES_MAX {
            return Err(CriticalNamespacesError::TooMany(entries.len()));
        }
        let label = |e: &str| {
            let bytes = e.as_bytes();
            (1..=63).contains(&bytes.len())
                && bytes.iter().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || *b == b'-')
                && bytes[0] != b'-'
                && bytes[bytes.len() - 1] != b'-'
        };
        if let Some(bad) = entries.iter().find(|e| !label(e)) {
            let shown: String = bad.chars().take(80).collect();
            return Err(CriticalNamespacesError::NotANamespace(shown));
        }
        Ok(Self(std::sync::Arc::new(entries.into_iter().map(str::to_owned).collect())))
    }
}

impl std::fmt::Display for CriticalNamespaces {
    /// `kube-system,gpu-system`, or `(none)`.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.0.is_empty() {
            return f.write_str("(none)");
        }
        let mut first = true;
        for namespace in self.0.iter() {
            if !first {
                f.write_str(",")?;
            }
            first = false;
            f.write_str(namespace)?;
        }
        Ok(())
    }
}

impl CriticalNamespaces {
    /// Whether critical priority exempts a pod of `namespace`.
    pub fn exempts(&self, namespace: &str) -> bool {
        self.0.contains(namespace)
    }

    /// Whether a pod of `namespace` with this priority is exempt as critical.
    pub fn exempt(&self, namespace: &str, priority_class_name: Option<&str>, priority: Option<i32>) -> bool {
        is_critical(priority_class_name, priority) && self.exempts(namespace)
    }

    /// What an event says of a critical-priority pod outside the list: why it is enforced.
    pub fn not_exempt_note(&self) -> String {
        format!(
            "the pod has critical priority, but critical priority exempts only pods of the namespaces the \
             administrator lists (criticalNamespaces: {self}), so it is enforced like any other"
        )
    }
}

/// The budget that applies to a pod, and the others that also select it.
#[derive(Debug, Clone, PartialEq)]
pub struct Resolution<'a> {
    /// The budget that applies ([`resolve`]): the smallest limit, ties broken by scope and name. It names
    /// the pod's budget (its record, its status counts) and gives its limit; the rules enforced are
    /// [`applied`](Self::applied).
    pub budget: &'a Budget,
    /// Other budgets that select the pod, in the same order.
    pub also_matched: Vec<&'a Budget>,
    /// `budget` made no looser than every other budget of its kind that selects the pod (and, for a cluster
    /// budget, than the cluster floor), when one of them is tighter in some field than `budget`
    /// ([`Budget::tighten`]); `None`: `budget`'s own rules apply.
    pub tightened: Option<Budget>,
    /// Whether a cluster budget (an administrator's) selects the pod: then every rule applied is no looser
    /// than that one's.
    pub cluster_selected: bool,
}

impl Resolution<'_> {
    /// The rules enforced on the pod: [`Resolution::budget`]'s, tightened where a cluster budget selecting
    /// the pod is tighter.
    pub fn applied(&self) -> &Budget {
        self.tightened.as_ref().unwrap_or(self.budget)
    }
}

/// What budget selection reads of a pod: its namespace, that namespace's labels (for cluster budgets'
/// `namespaceSelector`) and its own labels.
#[derive(Debug, Clone, Copy)]
pub struct PodLabels<'a> {
    /// The pod's namespace.
    pub namespace: &'a str,
    /// The labels of the pod's namespace (empty when unknown: only a `namespaceSelector` of `{}`, or one
    /// of `NotIn`/`DoesNotExist` alone, matches then).
    pub namespace_labels: &'a BTreeMap<String, String>,
    /// The pod's labels.
    pub labels: &'a BTreeMap<String, String>,
}

impl<'a> PodLabels<'a> {
    /// A pod of `namespace`, whose labels are `namespace_labels`, labelled `labels`.
    pub fn new(
        namespace: &'a str,
        namespace_labels: &'a BTreeMap<String, String>,
        labels: &'a BTreeMap<String, String>,
    ) -> Self {
        Self { namespace, namespace_labels, labels }
    }
}

/// The rules each of `budgets` gives a pod that declares `declaration`, on GPUs of `gpu_totals` bytes (empty where
/// they are not known, as at admission: a fraction then stays unresolved, an absolute share does not): a budget
/// with `spec.share` gives the pod rules of its own ([`Budget::for_declared`]), any other its own. Resolve among
/// them as among budgets ([`resolve`]).
pub fn with_declared<'a>(
    budgets: impl IntoIterator<Item = &'a Budget>,
    declaration: &crate::share::Declaration,
    gpu_totals: &[u64],
) -> Vec<std::borrow::Cow<'a, Budget>> {
    with_declared_since(budgets, declaration, gpu_totals, None)
}

/// [`with_declared`] for a pod whose record holds `first`, the share the agent first held it to
/// ([`Budget::for_declared_since`]: a later declaration never loosens it).
pub fn with_declared_since<'a>(
    budgets: impl IntoIterator<Item = &'a Budget>,
    declaration: &crate::share::Declaration,
    gpu_totals: &[u64],
    first: Option<&crate::share::HeldShare>,
) -> Vec<std::borrow::Cow<'a, Budget>> {
    budgets
        .into_iter()
        .map(|b| {
            b.for_declared_since(declaration, gpu_totals, first)
                .map_or(std::borrow::Cow::Borrowed(b), std::borrow::Cow::Owned)
        })
        .collect()
}

/// Resolves which budget applies to a pod, among the namespaced and cluster budgets given.
///
/// Among namespaced budgets, the smallest limit names the budget (ties go to the name that sorts first), and
/// its rules are made no looser in any field than each other namespaced budget selecting the pod
/// ([`Budget::tighten`]: the smaller request, `Evict` over `Warn`, the shorter timers…; #51): a budget with a
/// smaller limit, a share's among them, never loosens another's action or timers. When cluster budgets select
/// the pod, no rule applied is looser than any of theirs, whatever labels the pod carries (#33):
/// - their *floor* is the smallest-limit cluster budget (ties: the name that sorts first) made no looser in
///   any field than each other cluster budget selecting the pod ([`Budget::tighten`]);
/// - the namespaced budgets' rules (above) win with a smaller limit only if they are
///   [no looser](Budget::no_looser_than) than the floor in every field: a namespace can tighten a cluster
///   budget (a smaller limit, a smaller request, a shorter `overLimitSeconds`…) but never loosen it
///   (`action: Warn`, a longer `overLimitSeconds`…);
/// - otherwise the smallest-limit cluster budget applies, with the floor's rules
///   ([`Resolution::tightened`] when they differ from its own).
///
/// Budgets passed over are still reported in `also_matched`.
pub fn resolve<'a>(budgets: impl IntoIterator<Item = &'a Budget>, pod: &PodLabels<'_>) -> Option<Resolution<'a>> {
    let mut matched: Vec<&Budget> = budgets.into_iter().filter(|b| b.selects(pod)).collect();
    if matched.is_empty() {
        return None;
    }
    matched.sort_by(|a, b| {
        a.limit_bytes
            .cmp(&b.limit_bytes)
            .then_with(|| b.is_cluster().cmp(&a.is_cluster()))
            .then_with(|| a.name.cmp(&b.name))
    });
    // The namespaced budgets' rules: the smallest limit's, made no looser than each other namespaced budget's. Copied
    // only where another one tightens them.
    let first_namespaced = matched.iter().position(|b| !b.is_cluster());
    let mut namespaced = first_namespaced.map(|n| std::borrow::Cow::Borrowed(matched[n]));
    let mut namespaced_by = Vec::new();
    if let (Some(n), Some(rules)) = (first_namespaced, namespaced.as_mut()) {
        for other in matched.iter().enumerate().filter(|(i, b)| *i != n && !b.is_cluster()).map(|(_, b)| *b) {
            if rules.no_looser_than(other) && rules.warn_at_percent <= other.warn_at_percent {
                continue;
            }
            let fields = rules.to_mut().tighten(other);
            namespaced_by.push(format!("GpuMemoryBudget/{} ({})", other.key(), fields.join(", ")));
        }
    }
    let own = |rules: std::borrow::Cow<'a, Budget>, by: Vec<String>| match rules {
        std::borrow::Cow::Borrowed(_) => None,
        std::borrow::Cow::Owned(mut rules) => {
            rules.tightened_by = Some(by.join("; "));
            Some(rules)
        }
    };
    let Some(first_cluster) = matched.iter().position(|b| b.is_cluster()) else {
        let tightened = namespaced.and_then(|rules| own(rules, namespaced_by));
        let budget = matched.remove(0);
        return Some(Resolution { budget, also_matched: matched, tightened, cluster_selected: false });
    };
    // The floor is copied only when another cluster budget tightens it: resolution runs for every pod on every
    // table build and status pass, and most pods meet one cluster budget or several that agree.
    let mut floor = std::borrow::Cow::Borrowed(matched[first_cluster]);
    let mut by = Vec::new();
    for other in matched.iter().filter(|b| b.is_cluster()).skip(1) {
        if floor.no_looser_than(other) && floor.warn_at_percent <= other.warn_at_percent {
            continue;
        }
        let fields = floor.to_mut().tighten(other);
        by.push(format!("ClusterGpuMemoryBudget/{} ({})", other.name, fields.join(", ")));
    }
    // A namespaced budget names the rules only with a smaller limit than the floor's (it sorts first) and rules no
    // looser than the floor's.
    let (winner, tightened) = match (first_namespaced, namespaced) {
        (Some(n), Some(rules)) if n < first_cluster && rules.no_looser_than(&floor) => (n, own(rules, namespaced_by)),
        _ => (first_cluster, own(floor, by)),
    };
    let budget = matched.remove(winner);
    Some(Resolution { budget, also_matched: matched, tightened, cluster_selected: true })
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    static NO_LABELS: BTreeMap<String, String> = BTreeMap::new();

    fn budget(yaml: &str) -> Result<Budget, SpecError> {
        Budget::compile(&serde_yaml::from_str(yaml).expect("fixture parses"))
    }

    fn named(name: &str, limit: &str, selector: &str) -> Budget {
        budget(&format!(
            "apiVersion: gpubudget.io/v1alpha1\nkind: GpuMemoryBudget\nmetadata: {{name: {name}, namespace: team-a}}\n\
             spec: {{selector: {selector}, limit: {limit}}}\n"
        ))
        .expect("valid fixture")
    }

    fn labels(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned())).collect()
    }

    #[test]
    fn compiles_the_issue_example_with_defaults() {
        let b = budget(
            "apiVersion: gpubudget.io/v1alpha1\nkind: GpuMemoryBudget\nmetadata: {name: llm-inference, namespace: team-a}\n\
             spec:\n  selector: {matchLabels: {app: llm}}\n  limit: 8Gi\n",
        )
        .expect("valid");
        assert_eq!(b.limit_bytes, 8 << 30);
        assert_eq!((b.warn_at_percent, b.action, b.over_limit_seconds), (90, BudgetAction::Evict, 10));
        assert_eq!(b.eviction_grace_period_seconds, None);
        assert_eq!(b.key(), "team-a/llm-inference");
        let th = b.thresholds(false);
        assert_eq!((th.limit, th.warn, th.over_limit_ms, th.may_evict), (8 << 30, 7_730_941_132, 10_000, true));
        assert!(!b.thresholds(true).may_evict, "critical pods are never evicted");
    }

    /// #11: the pod's own grace period (an hour, say) cannot hold the memory: unset, it is capped at 30 s.
    #[test]
    fn eviction_grace_is_the_pods_at_most_the_budgets() {
        let base = "apiVersion: gpubudget.io/v1alpha1\nkind: GpuMemoryBudget\nmetadata: {name: b, namespace: n}\nspec:\n  selector: {}\n  limit: 1Gi\n";
        let unset = budget(base).expect("budget");
        assert_eq!(unset.eviction_grace_seconds(Some(3_600)), 30);
        assert_eq!(unset.eviction_grace_seconds(Some(45)), 30);
        assert_eq!(unset.eviction_grace_seconds(Some(10)), 10);
        assert_eq!(unset.eviction_grace_seconds(None), 30);
        assert_eq!(unset.eviction_grace_seconds(Some(0)), 1, "never 0: that kills without a shutdown");
        let set = budget(&format!("{base}  evictionGracePeriodSeconds: 120\n")).expect("budget");
        assert_eq!(set.eviction_grace_seconds(Some(3_600)), 120, "the budget's most");
        assert_eq!(set.eviction_grace_seconds(Some(5)), 5, "never more than the pod asks for");
        assert_eq!(set.eviction_grace_seconds(None), 30, "the pod's default 30 s");
    }

    #[test]
    fn spec_errors_name_the_field() {
        let base = "apiVersion: gpubudget.io/v1alpha1\nkind: GpuMemoryBudget\nmetadata: {name: b, namespace: n}\nspec:\n  selector: {}\n";
        let cases = [
            ("  limit: 8 GiB\n", "spec.limit"),
            ("  limit: 0\n", "spec.limit"),
            ("  limit: 1Gi\n  warnAtPercent: 0\n", "spec.warnAtPercent"),
            ("  limit: 1Gi\n  warnAtPercent: 101\n", "spec.warnAtPercent"),
            ("  limit: 1Gi\n  overLimitSeconds: -1\n", "spec.overLimitSeconds"),
            ("  limit: 1Gi\n  evictionGracePeriodSeconds: -5\n", "spec.evictionGracePeriodSeconds"),
            ("  limit: 1Gi\n  evictionGracePeriodSeconds: 0\n", "spec.evictionGracePeriodSeconds"),
            ("  limit: 1Gi\n  blockedEvictionTimeoutSeconds: 86401\n", "spec.blockedEvictionTimeoutSeconds"),
            ("  limit: 1Gi\n  request: 2Gi\n", "spec.request: 2Gi is more than the limit 1Gi"),
            ("  limit: 1Gi\n  request: 6 GiB\n", "spec.request"),
            ("  limit: 1Gi\n  request: -1Mi\n", "spec.request"),
        ];
        for (tail, field) in cases {
            let err = budget(&format!("{base}{tail}")).expect_err(tail);
            assert!(err.to_string().starts_with(field), "{tail}: {err}");
        }
    }

    #[test]
    fn a_request_is_what_a_pod_is_guaranteed_and_the_limit_without_one() {
        let base = "apiVersion: gpubudget.io/v1alpha1\nkind: GpuMemoryBudget\nmetadata: {name: b, namespace: n}\nspec:\n  selector: {}\n  limit: 8Gi\n";
        let unset = budget(base).expect("budget");
        assert_eq!(
            (unset.request_bytes, unset.request_text.as_deref(), unset.guaranteed_bytes()),
            (None, None, 8 << 30)
        );
        let set = budget(&format!("{base}  request: 6Gi\n")).expect("budget");
        assert_eq!(
            (set.request_bytes, set.request_text.as_deref(), set.guaranteed_bytes()),
            (Some(6 << 30), Some("6Gi"), 6 << 30)
        );
        assert_eq!(budget(&format!("{base}  request: 8Gi\n")).expect("equal to the limit").guaranteed_bytes(), 8 << 30);
        assert_eq!(budget(&format!("{base}  request: 0\n")).expect("nothing guaranteed").guaranteed_bytes(), 0);
        assert_eq!(set.thresholds(false), unset.thresholds(false), "the state machine counts against the limit only");
    }

    /// The request comes with the budget that applies (the smallest limit), never from another one.
    #[test]
    fn the_request_is_the_applying_budgets() {
        let with_request = |name: &str, limit: &str, request: &str| {
            budget(&format!(
                "apiVersion: gpubudget.io/v1alpha1\nkind: GpuMemoryBudget\nmetadata: {{name: {name}, namespace: team-a}}\n\
                 spec: {{selector: {{}}, limit: {limit}, request: {request}}}\n"
            ))
            .expect("valid fixture")
        };
        let budgets = [with_request("wide", "16Gi", "12Gi"), named("small", "8Gi", "{}")];
        let r = resolve(&budgets, &PodLabels::new("team-a", &NO_LABELS, &labels(&[]))).expect("matched");
        assert_eq!((r.budget.name.as_str(), r.budget.request_bytes), ("small", None));
        let budgets = [with_request("wide", "16Gi", "12Gi"), with_request("small", "8Gi", "2Gi")];
        let r = resolve(&budgets, &PodLabels::new("team-a", &NO_LABELS, &labels(&[]))).expect("matched");
        assert_eq!((r.budget.name.as_str(), r.budget.request_bytes), ("small", Some(2 << 30)));
    }

    #[test]
    fn smallest_limit_wins_and_names_break_ties() {
        let budgets = [
            named("wide", "16Gi", "{}"),
            named("llm", "8Gi", "{matchLabels: {app: llm}}"),
            named("also-llm", "8Gi", "{matchLabels: {app: llm}}"),
            named("other", "1Gi", "{matchLabels: {app: web}}"),
        ];
        let r = resolve(&budgets, &PodLabels::new("team-a", &NO_LABELS, &labels(&[("app", "llm")]))).expect("matched");
        assert_eq!(r.budget.name, "also-llm");
        let others: Vec<&str> = r.also_matched.iter().map(|b| b.name.as_str()).collect();
        assert_eq!(others, ["llm", "wide"]);
        assert!(
            resolve(&budgets, &PodLabels::new("team-b", &NO_LABELS, &labels(&[("app", "llm")]))).is_none(),
            "namespaced"
        );
        let r = resolve(&budgets, &PodLabels::new("team-a", &NO_LABELS, &labels(&[]))).expect("namespace-wide");
        assert_eq!((r.budget.name.as_str(), r.also_matched.len()), ("wide", 0));
    }

    /// #33: critical priority exempts only in the namespaces an administrator lists; bad lists are named.
    #[test]
    fn critical_priority_exempts_only_in_listed_namespaces() {
        let default = CriticalNamespaces::default();
        assert!(default.exempt("kube-system", Some("system-node-critical"), None));
        assert!(!default.exempt("team-a", Some("system-node-critical"), Some(2_000_001_000)), "a tenant's namespace");
        assert!(!default.exempt("kube-system", Some("high"), Some(10)), "not critical");
        let listed: CriticalNamespaces = " kube-system, gpu-system ,".parse().expect("valid");
        assert!(listed.exempts("gpu-system") && listed.exempts("kube-system") && !listed.exempts("team-a"));
        assert_eq!(listed.to_string(), "gpu-system,kube-system");
        let none: CriticalNamespaces = "".parse().expect("empty: none");
        assert!(!none.exempts("kube-system"));
        assert_eq!(none.to_string(), "(none)");
        assert!(default.not_exempt_note().contains("criticalNamespaces: kube-system"));
        for bad in ["Kube-System", "-a", "a-", "a/b", "é", &"a".repeat(64)] {
            let err = bad.parse::<CriticalNamespaces>().expect_err(bad).to_string();
            assert!(err.contains("is not a namespace name"), "{bad}: {err}");
        }
        let many = (0..=CRITICAL_NAMESPACES_MAX).map(|i| format!("n{i}")).collect::<Vec<_>>().join(",");
        assert_eq!(many.parse::<CriticalNamespaces>(), Err(CriticalNamespacesError::TooMany(257)));
    }

    #[test]
    fn critical_comes_only_from_priority() {
        assert!(is_critical(Some("system-node-critical"), None));
        assert!(is_critical(Some("system-cluster-critical"), Some(2_000_000_000)));
        assert!(is_critical(None, Some(2_000_001_000)));
        assert!(!is_critical(Some("high-priority"), Some(1_000_000)));
        assert!(!is_critical(None, None));
    }

    fn cluster(name: &str, namespace_selector: &str, selector: &str, rest: &str) -> Budget {
        Budget::compile_cluster(
            &serde_yaml::from_str(&format!(
                "apiVersion: gpubudget.io/v1alpha1\nkind: ClusterGpuMemoryBudget\nmetadata: {{name: {name}}}\n\
                 spec: {{namespaceSelector: {namespace_selector}, selector: {selector}, {rest}}}\n"
            ))
            .expect("fixture parses"),
        )
        .expect("valid fixture")
    }

    fn namespaced(name: &str, rest: &str) -> Budget {
        budget(&format!(
            "apiVersion: gpubudget.io/v1alpha1\nkind: GpuMemoryBudget\nmetadata: {{name: {name}, namespace: team-a}}\n\
             spec: {{selector: {{}}, {rest}}}\n"
        ))
        .expect("valid fixture")
    }

    /// #23: a cluster budget selects by the namespace's labels and the pod's, in any namespace; its key has no
    /// namespace; bad selectors are named.
    #[test]
    fn a_cluster_budget_selects_by_namespace_and_pod_labels() {
        let c = cluster("gpu-tenants", "{matchLabels: {tier: tenant}}", "{matchLabels: {app: llm}}", "limit: 8Gi");
        assert_eq!((c.key(), c.is_cluster(), c.namespace.as_str()), ("gpu-tenants".to_owned(), true, ""));
        assert!(c.has_key("gpu-tenants") && !c.has_key("/gpu-tenants"));
        assert_eq!(c.record_name(), "ClusterGpuMemoryBudget/gpu-tenants");
        assert!(c.is_record_name("ClusterGpuMemoryBudget/gpu-tenants") && !c.is_record_name("gpu-tenants"));
        let n = namespaced("gpu-tenants", "limit: 8Gi");
        assert!(n.has_key("team-a/gpu-tenants") && !n.has_key("gpu-tenants") && !n.has_key("team-b/gpu-tenants"));
        assert!(n.is_record_name("gpu-tenants") && !n.is_record_name("ClusterGpuMemoryBudget/gpu-tenants"));
        let (tenant, system, llm) =
            (labels(&[("tier", "tenant")]), labels(&[("tier", "system")]), labels(&[("app", "llm")]));
        assert!(c.selects(&PodLabels::new("team-a", &tenant, &llm)));
        assert!(c.selects(&PodLabels::new("team-z", &tenant, &llm)), "any namespace with the label");
        assert!(!c.selects(&PodLabels::new("team-a", &system, &llm)), "namespaceSelector");
        assert!(!c.selects(&PodLabels::new("team-a", &tenant, &labels(&[]))), "selector");
        let everywhere = cluster("all", "{}", "{}", "limit: 8Gi");
        assert!(everywhere.selects(&PodLabels::new("kube-system", &NO_LABELS, &NO_LABELS)));
        let bad: Result<Budget, SpecError> = Budget::compile_cluster(
            &serde_yaml::from_str(
                "apiVersion: gpubudget.io/v1alpha1\nkind: ClusterGpuMemoryBudget\nmetadata: {name: b}\n\
                 spec: {namespaceSelector: {matchExpressions: [{key: a, operator: Equals, values: [x]}]}, selector: {}, limit: 1Gi}\n",
            )
            .expect("parses"),
        );
        assert!(matches!(bad, Err(SpecError::NamespaceSelector(_))), "{bad:?}");
        let unnamed: ClusterGpuMemoryBudget =
            serde_yaml::from_str("apiVersion: gpubudget.io/v1alpha1\nkind: ClusterGpuMemoryBudget\nmetadata: {}\nspec: {selector: {}, limit: 1Gi}\n")
                .expect("parses");
        assert_eq!(Budget::compile_cluster(&unnamed), Err(SpecError::UnnamedCluster));
    }

    /// #23: a namespace with no budget, or a pod relabelled out of every namespaced selector, is governed by
    /// the cluster budget; a tighter namespaced budget wins; a looser one (larger limit, or as tight but
    /// `Warn`, or a longer `overLimitSeconds`, a larger request, no caps) does not loosen it.
    #[test]
    fn a_namespace_tightens_a_cluster_budget_but_never_loosens_it() {
        let admin = cluster("admin", "{}", "{}", "limit: 8Gi, request: 4Gi, overLimitSeconds: 30");
        let pod = labels(&[("app", "llm")]);
        let at = |ns: &'static str| PodLabels::new(ns, &NO_LABELS, &NO_LABELS);
        let of = |budgets: &[Budget], pod: &PodLabels<'_>| resolve(budgets, pod).map(|r| r.budget.key());
        assert_eq!(of(std::slice::from_ref(&admin), &at("no-budget-here")).as_deref(), Some("admin"));
        let llm_only = namespaced("llm-only", "limit: 2Gi");
        let mut llm_only_sel = llm_only.clone();
        llm_only_sel.selector =
            Selector::compile(&serde_yaml::from_str("{matchLabels: {app: llm}}").expect("sel")).expect("valid");
        let budgets = [admin.clone(), llm_only_sel];
        assert_eq!(of(&budgets, &PodLabels::new("team-a", &NO_LABELS, &pod)).as_deref(), Some("team-a/llm-only"));
        assert_eq!(of(&budgets, &at("team-a")).as_deref(), Some("admin"), "relabelled out: still the cluster budget");
        let tighter = [admin.clone(), namespaced("tighter", "limit: 6Gi, request: 1Gi, overLimitSeconds: 5")];
        let r = resolve(&tighter, &at("team-a")).expect("matched");
        assert_eq!((r.budget.key(), r.also_matched[0].key()), ("team-a/tighter".to_owned(), "admin".to_owned()));
        for looser in [
            "limit: 16Gi",
            "limit: 8Gi, request: 4Gi, overLimitSeconds: 30",
            "limit: 6Gi, request: 1Gi, overLimitSeconds: 30, action: Warn",
            "limit: 6Gi, request: 1Gi, overLimitSeconds: 31",
            "limit: 6Gi, overLimitSeconds: 5",
            "limit: 6Gi, request: 1Gi, overLimitSeconds: 5, evictionGracePeriodSeconds: 300",
        ] {
            let budgets = [namespaced("ns", looser), admin.clone()];
            let r = resolve(&budgets, &at("team-a")).expect("matched");
            assert_eq!((r.budget.key().as_str(), r.also_matched.len()), ("admin", 1), "{looser}");
        }
        let capped = cluster("capped", "{}", "{}", "limit: 8Gi, admissionCaps: Enabled");
        let uncapped = [namespaced("ns", "limit: 6Gi"), capped.clone()];
        assert_eq!(of(&uncapped, &at("team-a")).as_deref(), Some("capped"), "caps cannot be turned off");
        let blocking = cluster("blocking", "{}", "{}", "limit: 8Gi, blockedEvictionTimeoutSeconds: 60");
        let forever = [namespaced("ns", "limit: 6Gi"), blocking.clone()];
        assert_eq!(of(&forever, &at("team-a")).as_deref(), Some("blocking"), "PDBs cannot hold it longer");
        let sooner = [namespaced("ns", "limit: 6Gi, blockedEvictionTimeoutSeconds: 10"), blocking];
        assert_eq!(of(&sooner, &at("team-a")).as_deref(), Some("team-a/ns"));
    }

    /// #54: a tenant's `enforcement: Observe` never loosens a cluster budget (set to `Enforce`, or left to the
    /// node): the cluster budget applies; a tenant may choose `Enforce` for its own pods, and two namespaced
    /// budgets merge to the tighter value.
    #[test]
    fn a_tenants_observe_never_loosens_a_cluster_budgets_enforcement() {
        use crate::enforcement::Enforcement::{Enforce, Observe};
        let at = PodLabels::new("team-a", &NO_LABELS, &NO_LABELS);
        for admin in ["limit: 8Gi, enforcement: Enforce", "limit: 8Gi"] {
            let admin = cluster("admin", "{}", "{}", admin);
            let budgets = [namespaced("ns", "limit: 6Gi, enforcement: Observe"), admin.clone()];
            let r = resolve(&budgets, &at).expect("matched");
            assert_eq!(r.budget.key(), "admin", "a namespace's Observe is looser than {:?}", admin.enforcement);
            assert_eq!(r.applied().enforcement, admin.enforcement);
        }
        let admin_observes = cluster("admin", "{}", "{}", "limit: 8Gi, enforcement: Observe");
        let budgets = [namespaced("ns", "limit: 6Gi, enforcement: Enforce"), admin_observes];
        let r = resolve(&budgets, &at).expect("matched");
        assert_eq!((r.budget.key().as_str(), r.applied().enforcement), ("team-a/ns", Some(Enforce)));
        let two = [
            namespaced("small", "limit: 2Gi, enforcement: Observe"),
            namespaced("big", "limit: 6Gi, enforcement: Enforce"),
        ];
        let r = resolve(&two, &at).expect("matched");
        assert_eq!((r.budget.key().as_str(), r.applied().enforcement), ("team-a/small", Some(Enforce)));
        assert!(r.applied().tightened_by.as_deref().is_some_and(|by| by.contains("enforcement")));
        let alone = [namespaced("mine", "limit: 2Gi, enforcement: Observe")];
        assert_eq!(resolve(&alone, &at).expect("matched").applied().enforcement, Some(Observe), "its own choice");
    }

    /// #33: of several cluster budgets the smallest limit names the budget, made no looser in any field than
    /// the others (a pod label that brings in a smaller-limit `Warn` cluster budget does not buy `Warn`); a
    /// namespaced budget is judged against that floor.
    #[test]
    fn cluster_budgets_resolve_among_themselves_by_limit_and_the_tightest_rules() {
        let budgets = [
            cluster("wide", "{}", "{}", "limit: 16Gi, overLimitSeconds: 5, blockedEvictionTimeoutSeconds: 60"),
            cluster("narrow", "{}", "{}", "limit: 4Gi, action: Warn, overLimitSeconds: 600, admissionCaps: Enabled"),
            namespaced("ns", "limit: 2Gi, action: Warn"),
        ];
        let r = resolve(&budgets, &PodLabels::new("team-a", &NO_LABELS, &NO_LABELS)).expect("matched");
        assert_eq!(r.budget.key(), "narrow", "the namespaced Warn budget would loosen the floor");
        let applied = r.applied();
        assert_eq!(
            (applied.limit_bytes, applied.action, applied.over_limit_seconds, applied.blocked_eviction_timeout_seconds),
            (4 << 30, BudgetAction::Evict, 5, Some(60))
        );
        assert!(applied.admission_caps && r.cluster_selected);
        assert_eq!(
            applied.described(),
            "budget narrow, tightened by ClusterGpuMemoryBudget/wide (action, overLimitSeconds, blockedEvictionTimeoutSeconds)"
        );
        assert!(budgets.iter().filter(|b| b.is_cluster()).all(|c| applied.no_looser_than(c)));
        let strict = namespaced(
            "strict",
            "limit: 2Gi, overLimitSeconds: 1, blockedEvictionTimeoutSeconds: 10, admissionCaps: Enabled",
        );
        let with_strict = [budgets[0].clone(), budgets[1].clone(), strict];
        let r = resolve(&with_strict, &PodLabels::new("team-a", &NO_LABELS, &NO_LABELS)).expect("matched");
        assert_eq!((r.budget.key().as_str(), r.tightened.is_none()), ("team-a/strict", true), "no looser: wins whole");
        let r = resolve(&budgets[..1], &PodLabels::new("team-b", &NO_LABELS, &NO_LABELS)).expect("matched");
        assert_eq!((r.budget.key().as_str(), r.tightened.is_none(), r.also_matched.len()), ("wide", true, 0));
        let r = resolve(&budgets[2..], &PodLabels::new("team-a", &NO_LABELS, &NO_LABELS)).expect("matched");
        assert_eq!((r.applied().action, r.cluster_selected), (BudgetAction::Warn, false), "namespaced alone: its own");
    }

    /// #33, the issue's case: a smaller-limit cluster budget that selects by a pod label and is looser in
    /// every other field; the tenant adds the label and gains nothing.
    #[test]
    fn a_label_never_loosens_a_cluster_budget() {
        let admin = cluster("admin", "{}", "{}", "limit: 8Gi, overLimitSeconds: 10, blockedEvictionTimeoutSeconds: 30");
        let lax = cluster(
            "lax",
            "{}",
            "{matchLabels: {tier: batch}}",
            "limit: 6Gi, action: Warn, overLimitSeconds: 3600, evictionGracePeriodSeconds: 3600",
        );
        let budgets = [admin.clone(), lax];
        let plain = resolve(&budgets, &PodLabels::new("t", &NO_LABELS, &NO_LABELS)).expect("matched");
        let labelled = labels(&[("tier", "batch")]);
        let relabelled = resolve(&budgets, &PodLabels::new("t", &NO_LABELS, &labelled)).expect("matched");
        assert_eq!((plain.budget.key(), relabelled.budget.key()), ("admin".to_owned(), "lax".to_owned()));
        let (a, b) = (plain.applied(), relabelled.applied());
        assert!(b.no_looser_than(a) && b.no_looser_than(&admin));
        assert_eq!(
            (b.action, b.over_limit_seconds, b.most_grace_seconds(), b.blocked_eviction_timeout_seconds),
            (BudgetAction::Evict, 10, 30, Some(30))
        );
        assert_eq!(b.limit_bytes, 6 << 30, "the smaller limit is tighter, and kept");
    }

    /// #51, the issue's case: a `share` budget with `action: Warn` whose resolved share (20Gi) is below a stricter
    /// `Evict` budget's 40Gi no longer makes the pod Warn-only: the share's limit with the strict budget's action,
    /// timers and request.
    #[test]
    fn a_share_never_loosens_another_namespaced_budget() {
        let share = namespaced("share", "limit: 80Gi, action: Warn, overLimitSeconds: 600, share: {}");
        let strict =
            namespaced("strict", "limit: 40Gi, request: 10Gi, overLimitSeconds: 5, blockedEvictionTimeoutSeconds: 30");
        let pod: k8s_openapi::api::core::v1::Pod = serde_yaml::from_str(
            "metadata: {name: p, namespace: team-a, annotations: {gpu-fraction: '0.25'}}\n\
             spec: {schedulerName: kai-scheduler, containers: [{name: c, image: i}]}",
        )
        .expect("pod");
        let declared = crate::share::declared(&pod, None, crate::share::Sources::ALL);
        let rules = with_declared([&share, &strict], &declared, &[80 << 30]);
        let r = resolve(rules.iter().map(|r| r.as_ref()), &PodLabels::new("team-a", &NO_LABELS, &NO_LABELS))
            .expect("matched");
        let applied = r.applied();
        assert_eq!(r.budget.name, "share", "the smaller limit names the rules");
        assert_eq!(
            (applied.limit_bytes, applied.action, applied.over_limit_seconds, applied.guaranteed_bytes()),
            (20 << 30, BudgetAction::Evict, 5, 10 << 30)
        );
        assert_eq!(applied.blocked_eviction_timeout_seconds, Some(30));
        assert!(applied.no_looser_than(&strict) && !r.cluster_selected);
        assert_eq!(
            applied.described(),
            "budget team-a/share: KAI gpu-fraction 0.25 of 80Gi = 20Gi, tightened by GpuMemoryBudget/team-a/strict \
             (request, action, overLimitSeconds, blockedEvictionTimeoutSeconds)"
        );
        // Budgets that agree leave the rules the named budget's own, uncopied.
        let same = [namespaced("a", "limit: 4Gi"), namespaced("b", "limit: 8Gi")];
        let r = resolve(&same, &PodLabels::new("team-a", &NO_LABELS, &NO_LABELS)).expect("matched");
        assert_eq!((r.budget.name.as_str(), r.tightened.is_none()), ("a", true));
        // Tightened namespaced rules still lose to a cluster floor they would loosen, and win where they do not.
        let admin = cluster("admin", "{}", "{}", "limit: 60Gi, overLimitSeconds: 10");
        let with_admin = [share.clone(), strict.clone(), admin.clone()];
        let rules = with_declared(&with_admin, &declared, &[80 << 30]);
        let r = resolve(rules.iter().map(|r| r.as_ref()), &PodLabels::new("team-a", &NO_LABELS, &NO_LABELS))
            .expect("matched");
        assert_eq!(
            (r.budget.name.as_str(), r.applied().action, r.cluster_selected),
            ("share", BudgetAction::Evict, true)
        );
        let lax = namespaced("lax", "limit: 50Gi, action: Warn");
        let lax_and_admin = [lax, admin];
        let r = resolve(&lax_and_admin, &PodLabels::new("team-a", &NO_LABELS, &NO_LABELS)).expect("matched");
        assert_eq!((r.budget.name.as_str(), r.applied().action), ("admin", BudgetAction::Evict));
    }

    fn kai_fraction(pm: u32) -> crate::share::Declaration {
        use crate::share::{Amount, ShareSource, Term};
        crate::share::Declaration::Share(vec![Term {
            source: ShareSource::KaiFraction,
            amount: Amount::PerMillion(pm),
            devices: 1,
        }])
    }

    /// #51: a tenant's rewrite (`gpu-fraction=1` after KAI placed the pod at 0.25), removal or garbage never raises
    /// the pod's limit or request: the first share holds, and the rules say why; a tighter one takes effect.
    #[test]
    fn a_share_is_fixed_at_placement_and_only_tightens() {
        use crate::share::{Declaration, ShareSource, Sources};
        let b = namespaced("shares", "limit: 80Gi, request: 10Gi, share: {}");
        let gpu = [80u64 << 30];
        let first = b.for_declared(&kai_fraction(250_000), &gpu).and_then(|r| r.held_share).expect("held");
        assert_eq!((first.limit_bytes, first.note.as_str()), (20 << 30, "KAI gpu-fraction 0.25 of 80Gi = 20Gi"));
        let since = |d: &Declaration, gpu: &[u64]| b.for_declared_since(d, gpu, Some(&first)).expect("share rules");
        let rewritten = since(&kai_fraction(1_000_000), &gpu);
        assert_eq!((rewritten.limit_bytes, rewritten.guaranteed_bytes()), (20 << 30, 10 << 30));
        let recorded = rewritten.held_share.as_ref().expect("held");
        assert_eq!(
            (recorded.limit_bytes, &recorded.note),
            (first.limit_bytes, &first.note),
            "the record keeps the first"
        );
        assert_eq!(
            recorded.ignored.as_deref(),
            Some("the share declared now (KAI gpu-fraction 1 of 80Gi = 80Gi) is more")
        );
        // Read back from that record after a restart, before the node's GPUs are known: the same rules.
        let again = b.for_declared_since(&kai_fraction(1_000_000), &[], Some(recorded)).expect("share rules");
        assert_eq!((again.limit_bytes, again.held_share.as_ref()), (20 << 30, Some(recorded)));
        assert_eq!(
            rewritten.share_change_ignored(),
            Some(
                "the share declared now (KAI gpu-fraction 1 of 80Gi = 80Gi) is more and is ignored: a share is fixed \
                 when the pod is placed and only tightens; held to the first, KAI gpu-fraction 0.25 of 80Gi = 20Gi"
            )
        );
        let removed = since(&Declaration::None, &gpu);
        assert_eq!((removed.limit_bytes, removed.guaranteed_bytes()), (20 << 30, 10 << 30));
        assert!(removed.share_change_ignored().is_some_and(|w| w.starts_with("the share was removed and is ignored")));
        let garbage = since(&Declaration::invalid(ShareSource::KaiFraction, "gpu-fraction: \"lots\""), &gpu);
        assert_eq!(garbage.limit_bytes, 20 << 30);
        assert!(garbage.share_change_ignored().is_some_and(|w| w.contains("cannot be read (gpu-fraction: \"lots\")")));
        assert_eq!(garbage.share_fault, None, "held to the first share, not to the budget's limit");
        // A tighter share takes effect, with nothing to tell; so does the same one.
        let tighter = since(&kai_fraction(125_000), &gpu);
        assert_eq!((tighter.limit_bytes, tighter.guaranteed_bytes(), tighter.share_kept), (10 << 30, 10 << 30, None));
        assert_eq!(since(&kai_fraction(250_000), &gpu), b.for_declared(&kai_fraction(250_000), &gpu).expect("rules"));
        // The node's GPUs not known yet (the agent restarted): the first share holds, silently.
        let restarted = since(&kai_fraction(1_000_000), &[]);
        assert_eq!((restarted.limit_bytes, restarted.share_kept), (20 << 30, None));
        // A budget that reads other sources, or no first share resolved: the declaration as it is.
        let hami_only = Budget { share: Some(Sources::of(&[ShareSource::HamiMemory])), ..b.clone() };
        assert_eq!(hami_only.for_declared_since(&kai_fraction(1_000_000), &gpu, Some(&first)), None);
        let unresolved = crate::share::HeldShare::new(80 << 30, Vec::new(), "share unresolved".into());
        assert_eq!(
            b.for_declared_since(&kai_fraction(1_000_000), &gpu, Some(&unresolved)),
            b.for_declared(&kai_fraction(1_000_000), &gpu)
        );
    }

    const LABELS: [&str; 3] = ["a", "b", "c"];

    fn label_selector(which: Option<usize>) -> String {
        which.map_or_else(|| "{}".to_owned(), |l| format!("{{matchLabels: {{{}: x}}}}", LABELS[l]))
    }

    /// A selector (by one of three labels, or none) and random enforcement fields.
    fn budget_fields() -> impl Strategy<Value = (Option<usize>, String)> {
        (
            proptest::option::of(0usize..3),
            1u64..10,
            proptest::option::of(0u64..10),
            any::<bool>(),
            0u64..100,
            proptest::option::of(1i64..100),
            proptest::option::of(0i64..100),
            any::<bool>(),
            1i32..=100,
            0u8..3,
        )
            .prop_map(|(selector, limit, request, warn, over, grace, blocked, caps, warn_at, enforcement)| {
                let mut rest = format!("limit: {limit}Gi, overLimitSeconds: {over}, warnAtPercent: {warn_at}");
                if let Some(r) = request {
                    rest += &format!(", request: {}Gi", r.min(limit));
                }
                if warn {
                    rest += ", action: Warn";
                }
                if let Some(g) = grace {
                    rest += &format!(", evictionGracePeriodSeconds: {g}");
                }
                if let Some(b) = blocked {
                    rest += &format!(", blockedEvictionTimeoutSeconds: {b}");
                }
                if caps {
                    rest += ", admissionCaps: Enabled";
                }
                match enforcement {
                    1 => rest += ", enforcement: Observe",
                    2 => rest += ", enforcement: Enforce",
                    _ => {}
                }
                (selector, rest)
            })
    }

    /// What rules mean wherever they are used, for a pod asking `pod_grace` on a node whose pressure bound is
    /// `node_ms` and pressure grace `node_grace`; in each place a smaller value is tighter. Every optional field
    /// is read as it is where it is used: an unset grace as the pod's own (capped), an unset
    /// `blockedEvictionTimeoutSeconds` as the node's bound under pressure and as "never" for the budget's own
    /// eviction.
    fn uses(b: &Budget, pod_grace: Option<i64>, node_ms: u64, node_grace: i64) -> [(&'static str, u128); 11] {
        [
            (
                "enforcement (Observe loosest, Enforce tightest)",
                u128::from(2 - crate::enforcement::tightness(b.enforcement)),
            ),
            ("limit", u128::from(b.limit_bytes)),
            ("guaranteed bytes", u128::from(b.guaranteed_bytes())),
            ("action (Warn looser)", u128::from(b.action != BudgetAction::Evict)),
            ("overLimitSeconds", u128::from(b.over_limit_seconds)),
            ("grace of its eviction", b.eviction_grace_seconds(pod_grace).unsigned_abs().into()),
            ("grace under pressure", b.pressure_grace_seconds(node_grace).unsigned_abs().into()),
            ("refusal bound under pressure", u128::from(b.pressure_blocked_timeout_ms(node_ms))),
            ("refusal bound of its eviction", b.blocked_eviction_timeout_seconds.map_or(u128::MAX, u128::from)),
            ("admissionCaps (Disabled looser)", u128::from(!b.admission_caps)),
            ("warnAtPercent", u128::from(b.warn_at_percent)),
        ]
    }

    proptest! {
        /// Tightening and "no looser than" read every field by what it means where it is used: rules tightened
        /// by another budget are, in every place and for every pod and node, no looser than either (the limit
        /// stays the budget's own, which names it), and a budget that is "no looser than" another is so in
        /// every place. Before issue 43 an unset grace tightened by another budget's longer one gave a pod
        /// asking for less more than it asked.
        #[test]
        fn tightening_is_no_looser_anywhere_a_field_is_used(
            a in budget_fields(),
            b in budget_fields(),
            pod_grace in proptest::option::of(0i64..5000),
            node_ms in 0u64..200_000,
            node_grace in 1i64..100,
        ) {
            let (x, y) = (namespaced("x", &a.1), namespaced("y", &b.1));
            let mut t = x.clone();
            t.tighten(&y);
            let (ut, ux, uy) = (uses(&t, pod_grace, node_ms, node_grace), uses(&x, pod_grace, node_ms, node_grace), uses(&y, pod_grace, node_ms, node_grace));
            for i in 0..ut.len() {
                let (field, value) = ut[i];
                prop_assert!(value <= ux[i].1, "{}: tightened {} looser than its own {}", field, value, ux[i].1);
                if field != "limit" {
                    prop_assert!(value <= uy[i].1, "{}: tightened {} looser than the other's {}", field, value, uy[i].1);
                }
            }
            let mut same_limit = t.clone();
            same_limit.limit_bytes = same_limit.limit_bytes.min(y.limit_bytes);
            same_limit.request_bytes = same_limit.request_bytes.map(|r| r.min(same_limit.limit_bytes));
            prop_assert!(same_limit.no_looser_than(&y));
            for (p, q) in [(&x, &y), (&y, &x), (&t, &x), (&t, &y)] {
                if p.no_looser_than(q) {
                    let (up, uq) = (uses(p, pod_grace, node_ms, node_grace), uses(q, pod_grace, node_ms, node_grace));
                    for i in 0..up.len() {
                        if up[i].0 != "warnAtPercent" {
                            prop_assert!(up[i].1 <= uq[i].1, "no looser, yet {} {} > {}", up[i].0, up[i].1, uq[i].1);
                        }
                    }
                }
            }
        }

        /// #51: whatever share a pod was first held to and whatever it declares now, its limit is the smaller of
        /// the two (at most the budget's), its request never more than the first share or the one declared now,
        /// and a change is told exactly when it is ignored.
        #[test]
        fn a_later_declaration_never_loosens_the_first_share(
            first_pm in 1u32..=1_000_000,
            now in proptest::option::of(1u32..=1_000_000),
            limit_gi in 1u64..100,
            request_gi in proptest::option::of(0u64..100),
        ) {
            let mut rest = format!("limit: {limit_gi}Gi, share: {{}}");
            if let Some(r) = request_gi {
                rest += &format!(", request: {}Gi", r.min(limit_gi));
            }
            let b = namespaced("shares", &rest);
            let gpu = [80u64 << 30];
            let first = b.for_declared(&kai_fraction(first_pm), &gpu).and_then(|r| r.held_share).expect("held");
            let declaration = now.map_or(crate::share::Declaration::None, kai_fraction);
            let r = b.for_declared_since(&declaration, &gpu, Some(&first)).expect("share rules");
            let now_limit = b.for_declared(&declaration, &gpu).map(|r| r.limit_bytes);
            let want = now_limit.map_or(first.limit_bytes, |n| n.min(first.limit_bytes));
            prop_assert_eq!(r.limit_bytes, want);
            prop_assert!(r.guaranteed_bytes() <= r.limit_bytes && r.guaranteed_bytes() <= first.limit_bytes);
            prop_assert!(r.limit_bytes <= b.limit_bytes);
            prop_assert_eq!(r.share_kept.is_some(), now_limit.is_none_or(|n| n > first.limit_bytes));
        }

        /// #51: whatever budgets select a pod, a namespaced budget's rules, when they apply, are no looser in any
        /// field (limit, request, action, every timer, caps) than any namespaced budget that selects the pod, nor
        /// than any cluster budget that does; rules a cluster budget names are no looser than every cluster
        /// budget's; and the order budgets come in changes nothing.
        #[test]
        fn no_budget_of_the_same_kind_is_loosened(
            clusters in proptest::collection::vec(budget_fields(), 0..3),
            namespaced_ones in proptest::collection::vec(budget_fields(), 1..5),
            pod_labels in proptest::collection::btree_set(0usize..3, 0..3),
            rotate in any::<usize>(),
        ) {
            let mut budgets: Vec<Budget> = Vec::new();
            for (i, (selector, rest)) in clusters.iter().enumerate() {
                budgets.push(cluster(&format!("c{i}"), "{}", &label_selector(*selector), rest));
            }
            for (i, (selector, rest)) in namespaced_ones.iter().enumerate() {
                let mut b = namespaced(&format!("n{i}"), rest);
                b.selector = Selector::compile(&serde_yaml::from_str(&label_selector(*selector)).expect("sel")).expect("valid");
                budgets.push(b);
            }
            let pod = labels(&pod_labels.iter().map(|l| (LABELS[*l], "x")).collect::<Vec<_>>());
            let at = PodLabels::new("team-a", &NO_LABELS, &pod);
            let Some(r) = resolve(&budgets, &at) else {
                prop_assert!(budgets.iter().all(|b| !b.selects(&at)));
                return Ok(());
            };
            let applied = r.applied();
            let kind = r.budget.is_cluster();
            for b in budgets.iter().filter(|b| b.selects(&at)) {
                if b.is_cluster() || !kind {
                    prop_assert!(applied.no_looser_than(b), "{:?} looser than {}", applied, b.key());
                }
            }
            prop_assert!(applied.request_bytes.unwrap_or(0) <= applied.limit_bytes);
            let mut rotated: Vec<&Budget> = budgets.iter().collect();
            rotated.rotate_left(rotate % budgets.len());
            let again = resolve(rotated, &at).expect("matched");
            prop_assert_eq!(again.budget.key(), r.budget.key());
            prop_assert_eq!(again.applied().no_looser_than(applied) && applied.no_looser_than(again.applied()), true);
        }

        #[test]
        fn resolution_is_order_independent(limits in proptest::collection::vec(1u64..5, 1..6), seed in any::<u64>()) {
            let budgets: Vec<Budget> = limits.iter().enumerate()
                .map(|(i, l)| named(&format!("b{i}"), &format!("{l}Gi"), "{}"))
                .collect();
            let mut shuffled: Vec<&Budget> = budgets.iter().collect();
            shuffled.rotate_left((seed % budgets.len() as u64) as usize);
            let a = resolve(budgets.iter(), &PodLabels::new("team-a", &NO_LABELS, &NO_LABELS)).expect("matched");
            let b = resolve(shuffled, &PodLabels::new("team-a", &NO_LABELS, &NO_LABELS)).expect("matched");
            prop_assert_eq!(&a.budget.name, &b.budget.name);
            prop_assert_eq!(a.also_matched.len() + 1, budgets.len());
            prop_assert!(budgets.iter().all(|x| x.limit_bytes >= a.budget.limit_bytes));
        }

        /// #23: whatever namespaced budgets exist, the resolved limit never exceeds the limit of any cluster
        /// budget that selects the pod, its action is Evict when that one's is, and a namespaced budget no
        /// looser than the cluster budget and tighter in limit wins.
        #[test]
        fn a_cluster_budget_is_never_loosened(
            cluster_limit in 1u64..8,
            cluster_warn in any::<bool>(),
            others in proptest::collection::vec((1u64..12, any::<bool>(), 0i64..20), 0..6),
        ) {
            let action = if cluster_warn { "Warn" } else { "Evict" };
            let admin = cluster("admin", "{}", "{}", &format!("limit: {cluster_limit}Gi, action: {action}, overLimitSeconds: 10"));
            let mut budgets: Vec<Budget> = others.iter().enumerate().map(|(i, (limit, warn, over))| {
                let action = if *warn { "Warn" } else { "Evict" };
                namespaced(&format!("n{i}"), &format!("limit: {limit}Gi, action: {action}, overLimitSeconds: {over}"))
            }).collect();
            budgets.push(admin.clone());
            let r = resolve(&budgets, &PodLabels::new("team-a", &NO_LABELS, &NO_LABELS)).expect("the cluster budget selects");
            prop_assert!(r.budget.limit_bytes <= admin.limit_bytes);
            prop_assert!(r.applied().no_looser_than(&admin));
            prop_assert!(cluster_warn || r.applied().action == BudgetAction::Evict);
            // A namespaced budget tighter than the cluster budget in limit and no looser in any field: the namespaced
            // rules apply, named by the smallest namespaced limit (ties: the name) and tightened by the others (#51).
            let smallest = budgets.iter().filter(|b| !b.is_cluster()).min_by(|a, b| a.limit_bytes.cmp(&b.limit_bytes).then_with(|| a.name.cmp(&b.name)));
            if budgets.iter().any(|b| !b.is_cluster() && b.limit_bytes < admin.limit_bytes && b.no_looser_than(&admin)) {
                prop_assert_eq!(Some(r.budget.key()), smallest.map(Budget::key));
            }
            if !r.budget.is_cluster() {
                prop_assert!(budgets.iter().filter(|b| !b.is_cluster()).all(|b| r.applied().no_looser_than(b)));
            }
        }

        /// #33: any number of cluster and namespaced budgets, selecting by a pod label or not, and any labels
        /// on the pod: the rules applied are no looser in any field than each cluster budget that selects it,
        /// and adding a label never makes them looser than before against those cluster budgets.
        #[test]
        fn no_label_loosens_any_cluster_budget(
            clusters in proptest::collection::vec(budget_fields(), 1..5),
            namespaced_ones in proptest::collection::vec(budget_fields(), 0..5),
            pod_labels in proptest::collection::btree_set(0usize..3, 0..3),
        ) {
            let mut budgets: Vec<Budget> = Vec::new();
            for (i, (selector, rest)) in clusters.iter().enumerate() {
                budgets.push(cluster(&format!("c{i}"), "{}", &label_selector(*selector), rest));
            }
            for (i, (selector, rest)) in namespaced_ones.iter().enumerate() {
                let mut b = namespaced(&format!("n{i}"), rest);
                b.selector = Selector::compile(&serde_yaml::from_str(&label_selector(*selector)).expect("sel")).expect("valid");
                budgets.push(b);
            }
            let pod = labels(&pod_labels.iter().map(|l| (LABELS[*l], "x")).collect::<Vec<_>>());
            let at = PodLabels::new("team-a", &NO_LABELS, &pod);
            let selecting: Vec<&Budget> = budgets.iter().filter(|b| b.is_cluster() && b.selects(&at)).collect();
            match resolve(&budgets, &at) {
                None => prop_assert!(budgets.iter().all(|b| !b.selects(&at))),
                Some(r) => {
                    for c in &selecting {
                        prop_assert!(r.applied().no_looser_than(c), "{:?} looser than {}", r.applied(), c.name);
                    }
                    prop_assert_eq!(r.cluster_selected, !selecting.is_empty());
                    prop_assert_eq!(r.applied().limit_bytes, r.budget.limit_bytes);
                    prop_assert!(r.applied().request_bytes.unwrap_or(0) <= r.applied().limit_bytes);
                }
            }
        }
    }
}
