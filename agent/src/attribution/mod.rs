//! Which pod and container a GPU process belongs to.
//!
//! [`cgroup`] is the pure parser of `/proc/<pid>/cgroup`; [`procfs`] reads and caches it per PID.
//! Joining the answer to a pod (by UID, then container by `containerStatuses[].containerID`) is done by
//! [`crate::pods::PodTable`].

pub mod cgroup;
pub mod procfs;

pub use cgroup::{ContainerRef, normalize_uid, parse_cgroup_file, parse_cgroup_path};
pub use procfs::{Lookup, ProcAttributor};
