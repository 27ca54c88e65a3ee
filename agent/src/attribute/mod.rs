//! Stage 2: which pod and container each GPU process belongs to, and what each pod holds.
//!
//! - [`cgroup`]: the pure parser of `/proc/<pid>/cgroup` (PID → container → pod UID);
//! - [`procfs`]: reads and caches it per PID (the only reader of the host's `/proc` here);
//! - [`budgets`]: the cluster's budgets, compiled as the watch delivers them, per namespace;
//! - [`kube`]: where the agent reads Kubernetes: the index of the node's pods, the budgets and the Node's labels (the
//!   watches, the Node poll) and the pod table built from them; `top`'s one-shot list; the budgets' specs without
//!   their status ([`kube::spec_watch`]: a metadata watch, a read when `generation` moves) or from the operator's
//!   mirrors once every budget has one ([`kube::mirror_watch`]: no status traffic);
//! - [`pods`]: the node's pods with their budgets, indexed for the join (rebuilt on cache changes);
//! - [`join`]: each sampled process to its owner;
//! - [`usage`]: the pure per-pod sum;
//! - [`driver_limits`]: what the NVIDIA driver caps each pod at (R615 per-cgroup limits), read per pair.

pub mod budgets;
pub mod cgroup;
pub mod driver_limits;
pub mod join;
pub mod kube;
pub mod pods;
pub mod procfs;
pub mod usage;

pub use cgroup::{ContainerRef, container_cgroup_v2, normalize_uid, parse_cgroup_file, parse_cgroup_path};
pub use join::Owner;
pub use pods::{PodTable, PodView};
pub use procfs::{Lookup, ProcAttributor};
pub use usage::{Holder, PodUsage, Usage};
