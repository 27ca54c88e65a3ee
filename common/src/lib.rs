//! gpubudget's shared core: the `GpuMemoryBudget` API types and the pure budget logic that the operator
//! and the node agent both use. Nothing here does I/O.

pub mod budget;
pub mod caps;
pub mod crd;
pub mod enforcement;
pub mod eviction;
pub mod mirror;
pub mod node_usage;
pub mod pod_record;
pub mod quantity;
pub mod quota;
pub mod selector;
pub mod share;
pub mod state;
pub mod text;

pub use budget::{Budget, CriticalNamespaces, PodLabels, Resolution, Scope, SpecError, is_critical, resolve};
pub use crd::{
    AdmissionCaps, BudgetAction, ClusterGpuMemoryBudget, ClusterGpuMemoryBudgetSpec, ClusterGpuMemoryQuota,
    ClusterGpuMemoryQuotaSpec, ClusterGpuMemoryQuotaStatus, GpuMemoryBudget, GpuMemoryBudgetSpec,
    GpuMemoryBudgetStatus,
};
pub use enforcement::Enforcement;
pub use mirror::{ClusterGpuMemoryBudgetMirror, GpuMemoryBudgetMirror, Mirrored};
pub use node_usage::{GpuNodeUsage, GpuNodeUsageSpec, NodePodUsage};
pub use state::{BudgetState, Thresholds, Tracker, step};
