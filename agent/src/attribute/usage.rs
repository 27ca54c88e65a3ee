//! The pure per-pod sum: each process's bytes charged to the pod that owns it (from [`super::join`]),
//! summed over processes and GPUs. Buffers are kept between ticks; a steady tick allocates nothing here.

use std::sync::Arc;

use super::join::{self, Owner};
use super::pods::PodTable;
use super::procfs::ProcAttributor;
use crate::sample::Snapshot;

/// One process's share of a pod's usage.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Holder {
    /// Container name.
    pub container: Option<Arc<str>>,
    /// PID, when known.
    pub pid: Option<u32>,
    /// GPU index in the snapshot.
    pub gpu: usize,
    /// Bytes.
    pub bytes: u64,
    /// Whether the process is an MPS client ([`crate::sample::ProcessSample::mps_client`]).
    pub mps_client: Option<bool>,
}

/// A pod's usage in one sample.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PodUsage {
    /// Bytes over every process and GPU (processes with a figure).
    pub total: u64,
    /// The processes that hold them.
    pub holders: Vec<Holder>,
    /// Its processes whose figure NVML reports as unavailable: not in `total`, so never the basis of an
    /// eviction.
    pub unknown: u32,
}

/// The result of attributing a snapshot.
#[derive(Debug, Default)]
pub struct Usage {
    /// Per pod of the table (same indexes).
    pub pods: Vec<PodUsage>,
    /// Per process of the snapshot (same indexes).
    pub owners: Vec<Owner>,
    /// Per GPU of the snapshot: bytes of processes in no known pod.
    pub unattributed: Vec<u64>,
    /// Per GPU of the snapshot: the device's used bytes less every listed process's (attributed or not),
    /// when the device's figures are known: what no process accounts for (the driver's allocations, an
    /// MPS server's share, processes the agent cannot see, figures NVML does not give).
    pub unaccounted: Vec<Option<u64>>,
    /// Per GPU of the snapshot: bytes charged to pods of the table that no budget selects (a namespace
    /// without a budget, a pod relabelled out of every selector). Unlike [`Self::unattributed`], these pods
    /// are known; they are simply not covered by any budget.
    pub unbudgeted: Vec<u64>,
}

impl Usage {
    /// Attributes every process of `snapshot` ([`join::owners`], the part that reads `/proc`), then sums
    /// per pod ([`Self::sum`]). `now_ms` is a monotonic clock.
    pub fn compute(&mut self, snapshot: &Snapshot, table: &PodTable, attributor: &mut ProcAttributor, now_ms: u64) {
        let mut owners = std::mem::take(&mut self.owners);
        join::owners(snapshot, table, attributor, now_ms, &mut owners);
        self.owners = owners;
        self.sum(snapshot, table.pods.len());
        self.count_unbudgeted(table, snapshot.gpus.len());
    }

    /// Fills [`Self::unbudgeted`] from [`Self::pods`] (indexed like `table.pods`): per GPU, the bytes of the pods
    /// `table` gives no budget. Pure.
    pub fn count_unbudgeted(&mut self, table: &PodTable, gpus: usize) {
        self.unbudgeted.clear();
        self.unbudgeted.resize(gpus, 0);
        for (i, usage) in self.pods.iter().enumerate() {
            if table.budget(i).is_some() {
                continue;
            }
            for holder in &usage.holders {
                if let Some(u) = self.unbudgeted.get_mut(holder.gpu) {
                    *u = u.saturating_add(holder.bytes);
                }
            }
        }
    }

    /// Sums `snapshot` per pod from [`Self::owners`] (one per process): every byte is charged to exactly one
    /// pod of the `pods` table entries, or counted as unattributed on its GPU. Pure.
    pub fn sum(&mut self, snapshot: &Snapshot, pods: usize) {
        self.pods.resize_with(pods, PodUsage::default);
        self.pods.truncate(pods);
        for p in &mut self.pods {
            p.total = 0;
            p.unknown = 0;
            p.holders.clear();
        }
        self.unattributed.clear();
        self.unattributed.resize(snapshot.gpus.len(), 0);
        for (process, owner) in snapshot.processes.iter().zip(&self.owners) {
            match owner {
                Owner::Pod { pod, container } => {
                    let Some(usage) = self.pods.get_mut(*pod) else { continue };
                    let Some(bytes) = process.bytes else {
                        usage.unknown = usage.unknown.saturating_add(1);
                        continue;
                    };
                    usage.total = usage.total.saturating_add(bytes);
                    usage.holders.push(Holder {
                        container: container.clone(),
                        pid: process.pid,
                        gpu: process.gpu,
                        bytes,
                        mps_client: process.mps_client,
                    });
                }
                Owner::UnknownPod { .. } | Owner::NoPod => {
                    if let Some(u) = self.unattributed.get_mut(process.gpu) {
                        *u = u.saturating_add(process.charged());
                    }
                }
            }
        }
        self.unaccounted.clear();
        self.unaccounted.extend((0..snapshot.gpus.len()).map(|g| snapshot.memory(g).map(|m| m.used)));
        for process in &snapshot.processes {
            if let Some(Some(left)) = self.unaccounted.get_mut(process.gpu) {
                *left = left.saturating_sub(process.charged());
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::attribute::pods::PodView;
    use crate::attribute::procfs::write_fake_process;
    use crate::sample::{DirectOwner, GpuInfo, PodKey, ProcessSample};
    use k8s_openapi::api::core::v1::Pod;
    use proptest::prelude::*;

    const UID: &str = "5a1e3c9d-7b2f-4e8a-9c61-0d3f2b7a8e41";

    fn table() -> PodTable {
        let pod: Pod = serde_yaml::from_str(&format!(
            "metadata: {{name: llm-0, namespace: team-a, uid: {UID}}}\nspec: {{nodeName: n1, containers: []}}\n\
             status: {{containerStatuses: [{{name: trainer, containerID: 'containerd://{}', image: x, imageID: x, ready: true, restartCount: 0}}]}}",
            "a".repeat(64)
        ))
        .expect("pod");
        PodTable::build(PodView::from_pod(&pod), &[], Some("n1"))
    }

    fn gpus(n: u32) -> Vec<GpuInfo> {
        (0..n).map(|i| GpuInfo { index: i, label: i.to_string(), ..GpuInfo::default() }).collect()
    }

    #[test]
    fn sums_a_pod_over_processes_and_gpus_and_leaves_others_unattributed() {
        let dir = tempfile::tempdir().expect("tempdir");
        let a = "a".repeat(64);
        let b = "b".repeat(64);
        write_fake_process(dir.path(), 10, 1, &format!("0::/kubepods/pod{UID}/{a}\n")).expect("fixture");
        write_fake_process(dir.path(), 11, 1, &format!("0::/kubepods/pod{UID}/{b}\n")).expect("fixture");
        write_fake_process(dir.path(), 12, 1, "0::/system.slice/x.service\n").expect("fixture");
        let other = "0c6b2f1e-3d4a-4b5c-8d9e-0f1a2b3c4d5e";
        write_fake_process(dir.path(), 13, 1, &format!("0::/kubepods/pod{other}/{a}\n")).expect("fixture");
        let snapshot = Snapshot {
            readings: Vec::new(),
            gpus: gpus(2),
            processes: vec![
                ProcessSample { gpu: 0, pid: Some(10), bytes: Some(100), direct: None, mps_client: None },
                ProcessSample { gpu: 1, pid: Some(10), bytes: Some(50), direct: None, mps_client: None },
                ProcessSample { gpu: 1, pid: Some(11), bytes: Some(7), direct: None, mps_client: None },
                ProcessSample { gpu: 0, pid: Some(12), bytes: Some(1000), direct: None, mps_client: None },
                ProcessSample { gpu: 1, pid: Some(13), bytes: Some(3), direct: None, mps_client: None },
                ProcessSample { gpu: 1, pid: Some(99), bytes: Some(5), direct: None, mps_client: None },
                ProcessSample {
                    gpu: 0,
                    pid: None,
                    bytes: Some(1 << 20),
                    direct: Some(Arc::new(DirectOwner {
                        pod: PodKey::Name { namespace: "team-a".into(), name: "llm-0".into() },
                        container: Some("trainer".into()),
                        container_id: None,
                    })),
                    mps_client: None,
                },
            ],
        };
        let table = table();
        let mut attributor = ProcAttributor::new(dir.path());
        let mut usage = Usage::default();
        usage.compute(&snapshot, &table, &mut attributor, 0);
        assert_eq!(usage.pods[0].total, 100 + 50 + 7 + (1 << 20));
        let names: Vec<Option<&str>> = usage.pods[0].holders.iter().map(|h| h.container.as_deref()).collect();
        assert_eq!(names, [Some("trainer"), Some("trainer"), Some("bbbbbbbbbbbb"), Some("trainer")]);
        assert_eq!(usage.unattributed, vec![1000, 3 + 5]);
        // llm-0 is known and no budget selects it (the table has none): its bytes are unbudgeted, per GPU;
        // the unattributed ones are not.
        assert_eq!(usage.unbudgeted, vec![100 + (1 << 20), 50 + 7]);
        assert!(matches!(&usage.owners[4], Owner::UnknownPod { uid, .. } if uid == other));

        // Again: same answer, from the cache.
        let reads = attributor.reads().cgroup;
        usage.compute(&snapshot, &table, &mut attributor, 250);
        assert_eq!(usage.pods[0].total, 100 + 50 + 7 + (1 << 20));
        assert_eq!(attributor.reads().cgroup, reads);
    }

    proptest! {
        /// Every byte is either charged to exactly one pod or counted as unattributed.
        #[test]
        fn conserves_bytes(samples in proptest::collection::vec((0usize..3, 0u64..1u64 << 40, any::<bool>()), 0..40)) {
            let table = table();
            let dir = tempfile::tempdir().expect("tempdir");
            let mut attributor = ProcAttributor::new(dir.path());
            let snapshot = Snapshot {
                readings: Vec::new(),
                gpus: gpus(3),
                processes: samples.iter().map(|(gpu, bytes, mine)| ProcessSample {
                    gpu: *gpu,
                    pid: None,
                    bytes: Some(*bytes),
                    direct: Some(Arc::new(DirectOwner {
                        pod: PodKey::Uid(if *mine { UID.into() } else { "nobody".into() }),
                        container: None,
                        container_id: None,
                    })),
                    mps_client: None,
                }).collect(),
            };
            let mut usage = Usage::default();
            usage.compute(&snapshot, &table, &mut attributor, 0);
            let total: u64 = samples.iter().map(|s| s.1).sum();
            let charged: u64 = usage.pods.iter().map(|p| p.total).sum();
            prop_assert_eq!(charged + usage.unattributed.iter().sum::<u64>(), total);
            let mine: u64 = samples.iter().filter(|s| s.2).map(|s| s.1).sum();
            prop_assert_eq!(charged, mine);
            // No budget in the table: every charged byte is unbudgeted, on its GPU.
            prop_assert_eq!(usage.unbudgeted.iter().sum::<u64>(), charged);
            for g in 0..3 {
                let on_g: u64 = samples.iter().filter(|s| s.2 && s.0 == g).map(|s| s.1).sum();
                prop_assert_eq!(usage.unbudgeted[g], on_g);
            }
        }
    }
}
