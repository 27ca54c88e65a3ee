//! The gpubudget operator: turns what the node agents record on pods into `GpuMemoryBudget` status,
//! generates the CRD, and validates budget files offline.

pub mod cli;
pub mod crd;
pub mod index;
pub mod pods;
pub mod status;
pub mod validate;
