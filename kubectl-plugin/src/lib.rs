//! `kubectl gpubudget`: a kubectl plugin that reads only the Kubernetes API (pods and the
//! `gpubudget.io/*` records the agents write on them, GpuMemoryBudgets and their status, Events), so it
//! works with a tenant's RBAC in its own namespace and cluster-wide for an admin.
//!
//! - `top`: GPU memory by pod across nodes, from the agents' records ([`top`]);
//! - `why POD`: which budget applies and why, state, usage against the limit, time over, caps set at
//!   admission, the last events and what happens next ([`why`]).
//!
//! Everything that decides or formats is a pure function of API objects ([`top`], [`why`], [`admission`],
//! [`events`], [`render`]); [`api`] is the only module that talks to the API server. The JSON/YAML output is
//! the [`report`] structs, documented there and in docs/kubectl-plugin.md.

pub mod admission;
pub mod api;
pub mod cli;
pub mod error;
pub mod events;
pub mod format;
pub mod render;
pub mod report;
pub mod top;
pub mod why;
