//! The join: each sampled process to its owner (a pod of the table, an unknown pod, or none), through a
//! replayed sample file's own statement or the PID cache over `/proc/<pid>/cgroup`. The only part of
//! attribution that reads the host; the per-pod sum ([`super::usage`]) is pure.

use std::sync::Arc;

use super::pods::PodTable;
use super::procfs::{Lookup, ProcAttributor};
use crate::sample::{PodKey, ProcessSample, Snapshot};

/// Who holds a process's memory.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Owner {
    /// A pod of the table (index), and its container's name when known.
    Pod {
        /// Index in [`PodTable::pods`].
        pod: usize,
        /// Container name (or a short container ID when the pod does not list it).
        container: Option<Arc<str>>,
    },
    /// A pod's cgroup, but no pod of the table has that UID (not synced yet, no API, another node).
    UnknownPod {
        /// The pod UID from the cgroup path (or the sample file).
        uid: String,
        /// The container ID or name, if known.
        container: Option<String>,
    },
    /// No pod (a host process), or the process exited before it could be looked at.
    NoPod,
}

fn short_id(id: &str) -> Arc<str> {
    Arc::from(&id[..id.len().min(12)])
}

/// Refills `out` with the owner of each process of `snapshot` (same indexes). `now_ms` is a monotonic
/// clock (the PID cache's retry timer).
pub fn owners(
    snapshot: &Snapshot,
    table: &PodTable,
    attributor: &mut ProcAttributor,
    now_ms: u64,
    out: &mut Vec<Owner>,
) {
    out.clear();
    attributor.begin_round();
    out.extend(snapshot.processes.iter().map(|process| owner(process, table, attributor, now_ms)));
    attributor.end_round();
}

fn owner(process: &ProcessSample, table: &PodTable, attributor: &mut ProcAttributor, now_ms: u64) -> Owner {
    match (&process.direct, process.pid) {
        (Some(direct), _) => {
            let found = match &direct.pod {
                PodKey::Uid(uid) => table.find_uid(uid),
                PodKey::Name { namespace, name } => table.find_name(namespace, name),
            };
            match found {
                Some(pod) => {
                    let view = &table.pods[pod];
                    let container = match (&direct.container, &direct.container_id) {
                        (Some(name), _) => Some(
                            view.containers
                                .iter()
                                .find(|c| &*c.name == name.as_str())
                                .map_or_else(|| Arc::from(name.as_str()), |c| c.name.clone()),
                        ),
                        (None, Some(id)) => Some(view.container_by_id(id).cloned().unwrap_or_else(|| short_id(id))),
                        (None, None) => None,
                    };
                    Owner::Pod { pod, container }
                }
                None => Owner::UnknownPod {
                    uid: match &direct.pod {
                        PodKey::Uid(uid) => uid.clone(),
                        PodKey::Name { namespace, name } => format!("{namespace}/{name}"),
                    },
                    container: direct.container.clone().or_else(|| direct.container_id.clone()),
                },
            }
        }
        (None, Some(pid)) => match attributor.lookup(pid, now_ms) {
            Lookup::Pod(r) => match table.find_uid(&r.pod_uid) {
                Some(pod) => {
                    let view = &table.pods[pod];
                    let container = r
                        .container_id
                        .as_deref()
                        .map(|id| view.container_by_id(id).cloned().unwrap_or_else(|| short_id(id)));
                    Owner::Pod { pod, container }
                }
                None => Owner::UnknownPod { uid: r.pod_uid.clone(), container: r.container_id.clone() },
            },
            Lookup::NoPod | Lookup::Gone => Owner::NoPod,
        },
        (None, None) => Owner::NoPod,
    }
}
