//! Enforcement: per-pod usage ([`usage`]), the pure decisions ([`decide`]), and the executors that
//! carry them out against the API server ([`kube_executor`]) or as JSON lines ([`log_executor`]).

pub mod decide;
pub mod kube_executor;
pub mod log_executor;
pub mod usage;

pub use decide::{Action, EvictOutcome, Feedback, Now, PodRef, Reason, Settings};
pub use usage::{Holder, Owner, PodUsage, Usage};
