//! gpubudget's shared core: the `GpuMemoryBudget` API types and the pure budget logic that the operator
//! and the node agent both use. Nothing here does I/O.

pub mod budget;
pub mod contract;
pub mod quantity;
pub mod selector;
pub mod state;
pub mod types;

pub use budget::{Budget, Resolution, SpecError, is_critical, resolve};
pub use state::{BudgetState, Thresholds, Tracker, step};
pub use types::{Action, GpuMemoryBudget, GpuMemoryBudgetSpec, GpuMemoryBudgetStatus};
