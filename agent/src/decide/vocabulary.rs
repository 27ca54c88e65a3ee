//! The vocabulary the decisions and the executors share: what an executor is asked to do ([`Action`], about a
//! [`PodRef`], with event [`Reason`]s and [`NodeReason`]s) and what it reports back ([`Feedback`],
//! [`EvictOutcome`]). The API executor (`act::kube`) and the standalone one (`act::log`) speak only this.

use std::sync::Arc;

use gpubudget_common::BudgetState;
use gpubudget_common::pod_record::{DriverLimitsRecord, PodRecord};

use crate::attribute::pods::PodView;

/// The pod an action is about.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct PodRef {
    /// UID.
    pub uid: Arc<str>,
    /// Namespace.
    pub namespace: Arc<str>,
    /// Name.
    pub name: Arc<str>,
}

impl PodRef {
    pub(super) fn of(view: &PodView) -> Self {
        Self { uid: view.uid.clone(), namespace: view.namespace.clone(), name: view.name.clone() }
    }
}

impl std::fmt::Display for PodRef {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.namespace, self.name)
    }
}

/// Event reasons (PascalCase, as Kubernetes reasons are).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Reason {
    /// At or above `warnAtPercent` of the limit.
    NearBudget,
    /// Over the limit.
    OverBudget,
    /// Over the limit for `overLimitSeconds`: eviction requested.
    Evicting,
    /// The eviction was refused (HTTP 429: a PodDisruptionBudget).
    EvictionBlocked,
    /// Back under the limit (or under the warning threshold).
    WithinBudget,
    /// The `Evicting` record could not be written in time: the eviction goes ahead without it.
    RecordNotWritten,
    /// Evictions were refused for `blockedEvictionTimeoutSeconds`: the pod is deleted instead.
    Deleting,
    /// The budget's action or `overLimitSeconds` changed while the pod was over: the period starts afresh.
    BudgetChanged,
    /// The driver's per-cgroup limits disagree with the budget ([`driver_limits`](super::driver_limits)); once
    /// per pod per kind of disagreement.
    DriverLimitsDisagree,
    /// `--apply-driver-limits` set a pod's per-cgroup driver limits and read them back.
    DriverLimitsApplied,
    /// `--apply-driver-limits` could not set them (the driver refused, or did not hold them).
    DriverLimitsNotApplied,
    /// A capped pod's MPS cap is not in force ([`cap_check`](super::cap_check)); once per offending process.
    CapNotInForce,
    /// Its budget takes each pod's limit from its declared share, and the pod's declaration cannot be read
    /// (malformed, out of range): it is held to the budget's limit; once per reason.
    ShareUnresolved,
    /// The pod's declared share changed after it was placed (rewritten larger, removed, made unreadable): the
    /// change is ignored and the pod held to its first share (#51); once per change.
    ShareChangeIgnored,
    /// `--runtime-caps`: the container runtime created a GPU container with the budget's caps in its environment.
    CappedAtCreation,
    /// `--runtime-caps`: a GPU container was created without an MPS cap (its device count unknown, or its budget not
    /// known in time under `--runtime-caps-unresolved=create`).
    NotCappedAtCreation,
    /// Observe mode (#54): the pod would be evicted now (for its budget, or for pressure) and is not; once per
    /// episode. Normal: nothing happened to the pod.
    WouldEvict,
}

impl Reason {
    /// The event's `reason`.
    pub fn as_str(self) -> &'static str {
        match self {
            Reason::NearBudget => "GpuMemoryNearBudget",
            Reason::OverBudget => "GpuMemoryOverBudget",
            Reason::Evicting => "EvictingForGpuMemory",
            Reason::EvictionBlocked => "GpuMemoryEvictionBlocked",
            Reason::WithinBudget => "GpuMemoryWithinBudget",
            Reason::RecordNotWritten => "GpuMemoryEvictionRecordFailed",
            Reason::Deleting => "DeletingForGpuMemory",
            Reason::BudgetChanged => "GpuMemoryBudgetChanged",
            Reason::DriverLimitsDisagree => "GpuMemoryDriverLimitsDisagree",
            Reason::CapNotInForce => "GpuMemoryCapNotInForce",
            Reason::DriverLimitsApplied => "GpuMemoryDriverLimitsApplied",
            Reason::DriverLimitsNotApplied => "GpuMemoryDriverLimitsNotApplied",
            Reason::ShareUnresolved => "GpuMemoryShareUnresolved",
            Reason::ShareChangeIgnored => "GpuMemoryShareChangeIgnored",
            Reason::CappedAtCreation => "GpuMemoryCappedAtCreation",
            Reason::NotCappedAtCreation => "GpuMemoryNotCappedAtCreation",
            Reason::WouldEvict => "GpuMemoryWouldEvict",
        }
    }

    /// Warning (true) or Normal.
    pub fn is_warning(self) -> bool {
        matches!(
            self,
            Reason::NearBudget
                | Reason::OverBudget
                | Reason::Evicting
                | Reason::EvictionBlocked
                | Reason::RecordNotWritten
                | Reason::Deleting
                | Reason::DriverLimitsDisagree
                | Reason::CapNotInForce
                | Reason::DriverLimitsNotApplied
                | Reason::ShareUnresolved
                | Reason::ShareChangeIgnored
                | Reason::NotCappedAtCreation
        )
    }

    /// How many reasons there are.
    pub(super) const COUNT: usize = 17;

    pub(super) fn slot(self) -> usize {
        self as usize
    }
}

/// Why an event on the Node is sent.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum NodeReason {
    /// A GPU came under memory pressure.
    Pressure,
    /// It is no longer.
    PressureEnded,
    /// Under pressure, but nobody is harmed: one pod holds the memory alone, or what the pods within their
    /// guarantee are owed fits in what is free (once per episode). Nothing is evicted for it.
    FullNoneHarmed,
    /// Under pressure, but no pod on the GPU is over its budget: the budgets add up to more than it holds.
    Overcommitted,
    /// A GPU's sample failed: nothing is decided from it until it is back ([`gpus`](super::gpus)).
    GpuSampleFailed,
    /// It is sampled again.
    GpuSampleRecovered,
    /// A large share of a GPU's used memory is held by no process the agent can see, for a while.
    Unaccounted,
    /// NVML gives no per-process figure for some processes on a GPU (once per GPU).
    Unavailable,
    /// Pods no budget selects hold a large share of a GPU, for a while ([`gpus`](super::gpus)).
    Unbudgeted,
    /// The driver's per-cgroup memory limits (R615) cannot be read here: eviction only (once per agent start).
    DriverLimitsUnavailable,
    /// The budgets' mirrors stopped being current: the agent reads the budgets themselves again.
    MirrorsNotCurrent,
}

impl NodeReason {
    /// The event's `reason`.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Pressure => "GpuMemoryPressure",
            Self::PressureEnded => "GpuMemoryPressureEnded",
            Self::FullNoneHarmed => "GpuMemoryFullNoneHarmed",
            Self::Overcommitted => "GpuMemoryBudgetsOvercommitted",
            Self::GpuSampleFailed => "GpuSampleFailed",
            Self::GpuSampleRecovered => "GpuSampleRecovered",
            Self::Unaccounted => "GpuMemoryUnaccounted",
            Self::Unavailable => "GpuProcessMemoryUnavailable",
            Self::Unbudgeted => "GpuMemoryUnbudgeted",
            Self::DriverLimitsUnavailable => "DriverLimitsUnavailable",
            Self::MirrorsNotCurrent => "GpuBudgetMirrorsNotCurrent",
        }
    }

    /// Warning (true) or Normal.
    pub fn is_warning(self) -> bool {
        !matches!(
            self,
            Self::PressureEnded | Self::FullNoneHarmed | Self::GpuSampleRecovered | Self::DriverLimitsUnavailable
        )
    }
}

/// What the executor is asked to do.
// `Apply` carries the pod's whole record (its share, #51, with what was ignored): actions live for one tick in a
// short Vec, so boxing it would cost an allocation per write for nothing.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Action {
    /// The pod changed state (logged; the standalone mode's decision lines).
    Transition {
        /// The pod.
        pod: PodRef,
        /// Previous state.
        from: BudgetState,
        /// New state.
        to: BudgetState,
        /// Usage, bytes.
        usage: u64,
        /// Limit, bytes.
        limit: u64,
        /// `namespace/name` of the budget.
        budget: String,
    },
    /// Write the pod's record (server-side apply of the contract annotations).
    Apply {
        /// The pod.
        pod: PodRef,
        /// The record.
        record: PodRecord,
        /// What the driver caps the pod at, where the node's driver can tell (`gpubudget.io/driver-limits`,
        /// written in the same apply).
        driver: Option<DriverLimitsRecord>,
    },
    /// Remove the agent's annotations (no budget applies any more).
    Clear {
        /// The pod.
        pod: PodRef,
    },
    /// Emit an event on the pod.
    Event {
        /// The pod.
        pod: PodRef,
        /// Why.
        reason: Reason,
        /// The message.
        note: String,
    },
    /// Emit an event on one container of the pod (`regarding.fieldPath` `spec.containers{NAME}`, the API's form
    /// for a container within a pod): each container its own event, not one series per pod whose note is the
    /// first container's (#53: the caps set when each container is made).
    ContainerEvent {
        /// The pod.
        pod: PodRef,
        /// The container's name.
        container: String,
        /// Why.
        reason: Reason,
        /// The message.
        note: String,
    },
    /// Emit an event on this node's Node object (GPU memory pressure, a GPU's health and accounting).
    NodeEvent {
        /// Why.
        reason: NodeReason,
        /// The message.
        note: String,
    },
    /// Delete the pod (UID precondition) with this grace period: evictions were refused for the budget's
    /// `blockedEvictionTimeoutSeconds`. Answered like an eviction ([`Feedback::Evicted`]).
    Delete {
        /// The pod.
        pod: PodRef,
        /// `gracePeriodSeconds`, as for the eviction.
        grace_seconds: Option<i64>,
    },
    /// Observe mode (#54): the pod would be evicted now, and is not (the `GpuMemoryWouldEvict` event goes with it).
    /// Counted in `gpubudget_would_evict_total`; nothing is sent to the API for it.
    WouldEvict {
        /// The pod.
        pod: PodRef,
        /// Why it would be evicted.
        cause: EvictCause,
        /// The level that set the mode ([`gpubudget_common::enforcement::SetBy::level`]).
        set_by: gpubudget_common::enforcement::Level,
    },
    /// Request the pod's eviction (policy/v1 Eviction).
    Evict {
        /// The pod.
        pod: PodRef,
        /// `deleteOptions.gracePeriodSeconds`
        /// ([`Budget::eviction_grace_seconds`](gpubudget_common::Budget::eviction_grace_seconds)); `None`: the
        /// pod's own.
        grace_seconds: Option<i64>,
        /// Whether the API has the `Evicting` record (false: the wait for it ran out, see
        /// [`Settings::record_wait_attempts`](super::Settings::record_wait_attempts)); counted in
        /// `gpubudget_evictions_without_record_total`. A pressure eviction of a pod no budget selects has no
        /// record to wait for (no budget counts it): true, so it is not counted there.
        recorded: bool,
    },
}

impl Action {
    /// The pod the action is about; `None` for an event on the node.
    pub fn pod(&self) -> Option<&PodRef> {
        match self {
            Action::Transition { pod, .. }
            | Action::Apply { pod, .. }
            | Action::Clear { pod }
            | Action::Event { pod, .. }
            | Action::ContainerEvent { pod, .. }
            | Action::Evict { pod, .. }
            | Action::WouldEvict { pod, .. }
            | Action::Delete { pod, .. } => Some(pod),
            Action::NodeEvent { .. } => None,
        }
    }
}

/// Why a pod would be evicted ([`Action::WouldEvict`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum EvictCause {
    /// `budget`: over its own limit.
    Budget,
    /// `pressure`: relief of a GPU where a neighbour is short.
    Pressure,
}

impl EvictCause {
    /// `budget` or `pressure` (a metric's label, a log line's field).
    pub fn as_str(self) -> &'static str {
        match self {
            EvictCause::Budget => "budget",
            EvictCause::Pressure => "pressure",
        }
    }
}

/// How an eviction request ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum EvictOutcome {
    /// Accepted (the pod is being deleted).
    Accepted,
    /// HTTP 429: refused for now (a PodDisruptionBudget). The server's message.
    Blocked(String),
    /// The pod no longer exists.
    Gone,
    /// Any other failure (retried with backoff). What happened.
    Failed(String),
}

/// What an executor reports back.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Feedback {
    /// An [`Action::Apply`] or [`Action::Clear`] finished.
    Written {
        /// The pod's UID.
        uid: Arc<str>,
        /// The record written (`None` for a clear).
        record: Option<PodRecord>,
        /// Whether the API accepted it.
        ok: bool,
    },
    /// An [`Action::Evict`] finished.
    Evicted {
        /// The pod's UID.
        uid: Arc<str>,
        /// How.
        outcome: EvictOutcome,
    },
}
