//! The enforcement decisions: a pure function from (what the agent remembers, this tick's pods and
//! usage, the time) to a list of [`Action`]s. The executors (API or standalone) apply them and report back
//! through [`Enforcer::feedback`]. No I/O here, so every rule is unit-tested.
//!
//! Rules:
//! - the state machine is `gpubudget_common::step`, per pod, on the pod's summed usage;
//! - **events** on transitions, deduplicated: a reason is not repeated for a pod within
//!   [`Settings::event_cooldown_ms`]; the state the events speak for survives restarts (seeded from the
//!   pod's `gpubudget.io/state`), so a restart does not repeat them;
//! - **records** (annotations, server-side apply): at once on `Evicting`, a change of budget, eviction time or
//!   whether the pod's cap is in force,
//!   a move among Within/Near/Over at most [`Settings::state_min_interval_ms`] after the pod's last write;
//!   never for usage alone (#34: usage goes to the node's `GpuNodeUsage`, `crate::act::usage`); nothing in
//!   steady state; one write in flight per pod; failed writes retried with backoff;
//! - **eviction**: when the state machine says `Evicting` (it never does for `action: Warn` or critical
//!   pods), for a pod of this node that is not terminating: one apply carrying state `Evicting` and
//!   `eviction-requested-at`, then the `EvictingForGpuMemory` event, then the eviction request, in that
//!   order; the request waits for that record at most [`Settings::record_wait_attempts`] failed writes or
//!   [`Settings::record_wait_ms`], then goes ahead without it (`GpuMemoryEvictionRecordFailed`). One request
//!   in flight per pod; HTTP 429 → `GpuMemoryEvictionBlocked` and a retry with
//!   backoff while still due; an accepted eviction is never requested again for that pod UID. Timers
//!   start afresh when the agent starts, so a restart can only delay an eviction.
//! - **observe mode** (#54, [`gpubudget_common::enforcement`]): where the mode is `Observe` (the budget's
//!   `spec.enforcement` for its own evictions, else the Node's label, else `--enforcement`; pressure relief by the
//!   node's), an eviction that would start is told instead (`GpuMemoryWouldEvict` and [`Action::WouldEvict`], once
//!   per episode) and nothing is written or requested for it: the state machine never says `Evicting`, the
//!   record stays `Over`. A move between the modes starts a pod's over-limit period afresh.
//!
//! The rooms:
//! - `vocabulary`: what the executors are asked ([`Action`]) and report back ([`Feedback`]);
//! - `settings`: the tunables ([`Settings`]) and the time of a tick ([`Now`]);
//! - `enforcer`: the [`Enforcer`], what it remembers between ticks, and the tick;
//! - `pod`: one pod under its budget: the state machine, its events and record, its eviction's lifecycle
//!   and the executors' reports about it;
//! - [`pressure`]: GPU memory pressure: the signal and the choice of the pod to evict, and (in
//!   `pressure/step.rs`) the step of a tick that acts on them, [`Enforcer::pressure`];
//! - [`cadence`]: how soon the next sample is taken (faster while something is close to a threshold);
//! - [`gpus`]: each GPU's health and accounting, told on the Node;
//! - [`driver_limits`]: the NVIDIA driver's per-cgroup limits (R615) beside the budget: agree or not, and how;
//! - [`cap_check`]: whether a capped pod's MPS cap is in force (each process an MPS client, within its cap);
//! - `notes`: helpers for the text of events.
//!
//! Nothing here knows the command line: `cli` turns flags into [`Settings`], never the reverse
//! (`tests/layering.rs` checks it).

pub mod cadence;
pub mod cap_check;
pub mod driver_limits;
mod enforcer;
pub mod gpus;
mod notes;
mod pod;
pub mod pressure;
mod settings;
mod vocabulary;

pub use enforcer::Enforcer;
pub use notes::holders_summary;
pub use settings::{Now, Settings};
pub use vocabulary::{Action, EvictCause, EvictOutcome, Feedback, NodeReason, PodRef, Reason};

use notes::{bounded, seconds};

#[cfg(test)]
mod tests;
