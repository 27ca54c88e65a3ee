//! The gpubudget operator: turns what the node agents record on pods into `GpuMemoryBudget` status,
//! generates the CRD, and validates budget files offline.

pub mod caps_scope;
pub mod caps_webhook;
pub mod cli;
pub mod controller;
pub mod crd;
pub mod error;
pub mod eviction_check;
pub mod index;
pub mod intern;
pub mod leader;
pub mod metrics;
pub mod mirror;
pub mod namespaces;
pub mod pods;
pub mod quota;
pub mod run;
pub mod status;
pub mod validate;
