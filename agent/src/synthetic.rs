//! A synthetic GPU node for the benchmarks (`agent/benches/tick.rs`) and the soak harness
//! (`agent/examples/soak.rs`): pods whose processes sit in kubelet-shaped cgroups of a fake `/proc`,
//! budgets, and a sample file listing those PIDs the way NVML would. The agent itself never uses it.
//!
//! Process `p` (PID `10_000 + p`) runs on GPU `p % gpus` in pod `p / 2`. Pods rotate through three real
//! cgroup layouts (containerd + systemd driver, cgroupfs, CRI-O) and eight budgets (`app: a0` … `a7`,
//! limit 4Gi; `b7` evicts, the others warn). Pod `i` holds 5 GiB when `i % 4 == 0` (Over), 3.8 GiB when
//! `i % 4 == 1` (Near), 1 GiB otherwise (Within); pods of `b7` are all Within, so a steady run evicts
//! nothing and, once every pod's first record is written, writes nothing.

use std::fmt::Write as _;
use std::path::Path;

use gpubudget_common::GpuMemoryBudget;
use k8s_openapi::api::core::v1::Pod;

use crate::attribution::procfs::write_fake_process;
use crate::pods::{PodTable, PodView};

const GI: u64 = 1 << 30;

/// One synthetic process.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SyntheticProcess {
    /// Host PID.
    pub pid: u32,
    /// GPU index.
    pub gpu: u32,
    /// Content of its `/proc/<pid>/cgroup`.
    pub cgroup: String,
    /// Bytes it holds.
    pub bytes: u64,
}

/// A synthetic node.
#[derive(Debug, Clone)]
pub struct SyntheticNode {
    /// The node's name.
    pub node: String,
    /// Number of GPUs.
    pub gpus: u32,
    /// Its pods.
    pub pods: Vec<Pod>,
    /// The budgets (namespace `team-a`).
    pub budgets: Vec<GpuMemoryBudget>,
    /// Its GPU processes.
    pub processes: Vec<SyntheticProcess>,
}

fn budget_yaml(k: u32) -> String {
    let action = if k == 7 { "Evict" } else { "Warn" };
    format!(
        "apiVersion: gpubudget.io/v1alpha1\nkind: GpuMemoryBudget\nmetadata: {{name: b{k}, namespace: team-a}}\n\
         spec: {{selector: {{matchLabels: {{app: a{k}}}}}, limit: 4Gi, warnAtPercent: 90, action: {action}, overLimitSeconds: 0}}\n"
    )
}

/// The cgroup file of pod `i`'s container, in one of three real layouts.
fn cgroup_of(i: u32, uid: &str, cid: &str) -> String {
    match i % 3 {
        0 => format!(
            "0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{}.slice/cri-containerd-{cid}.scope\n",
            uid.replace('-', "_")
        ),
        1 => format!("0::/kubepods/besteffort/pod{uid}/{cid}\n"),
        _ => format!("0::/kubepods.slice/kubepods-pod{}.slice/crio-{cid}.scope/container\n", uid.replace('-', "_")),
    }
}

impl SyntheticNode {
    /// `processes` GPU processes (at least 2) on `gpus` GPUs, two per pod.
    pub fn new(node: &str, gpus: u32, processes: u32) -> Self {
        let gpus = gpus.max(1);
        let pod_count = (processes / 2).max(1);
        let mut pods = Vec::with_capacity(pod_count as usize);
        let mut out = Vec::with_capacity(processes as usize);
        for i in 0..pod_count {
            let uid = format!("00000000-0000-4000-8000-{i:012}");
            let cid = format!("{:064x}", u64::from(i) + 0xc0_ffee);
            let yaml = format!(
                "apiVersion: v1\nkind: Pod\n\
                 metadata: {{name: p{i}, namespace: team-a, uid: {uid}, labels: {{app: a{}}}}}\n\
                 spec: {{nodeName: {node}, containers: [{{name: main, image: x}}]}}\n\
                 status: {{phase: Running, containerStatuses: [{{name: main, containerID: 'containerd://{cid}', image: x, imageID: x, ready: true, restartCount: 0}}]}}\n",
                i % 8
            );
            pods.push(serde_yaml::from_str(&yaml).expect("synthetic pod"));
            let total = match i % 4 {
                0 => 5 * GI,
                1 => 38 * GI / 10,
                _ => GI,
            };
            let cgroup = cgroup_of(i, &uid, &cid);
            for half in 0..2u32 {
                let p = 2 * i + half;
                if p >= processes.max(2) {
                    break;
                }
                out.push(SyntheticProcess { pid: 10_000 + p, gpu: p % gpus, cgroup: cgroup.clone(), bytes: total / 2 });
            }
        }
        let budgets = (0..8).map(|k| serde_yaml::from_str(&budget_yaml(k)).expect("synthetic budget")).collect();
        Self { node: node.to_owned(), gpus, pods, budgets, processes: out }
    }

    /// Writes every process's `stat`, `comm` and `cgroup` under `root`.
    pub fn write_proc(&self, root: &Path) -> std::io::Result<()> {
        for p in &self.processes {
            write_fake_process(root, p.pid, 1_000 + u64::from(p.pid), &p.cgroup)?;
        }
        Ok(())
    }

    /// The sample file (version 1), listing PIDs only, as NVML reports them.
    pub fn sample_json(&self) -> String {
        let mut out = String::from(r#"{"version": 1, "gpus": ["#);
        for g in 0..self.gpus {
            if g > 0 {
                out.push(',');
            }
            let _ = write!(
                out,
                r#"{{"index": {g}, "uuid": "GPU-synthetic-{g}", "name": "Synthetic", "memory_total_bytes": 85520809984, "processes": ["#
            );
            let mut first = true;
            for p in self.processes.iter().filter(|p| p.gpu == g) {
                if !first {
                    out.push(',');
                }
                first = false;
                let _ = write!(out, r#"{{"pid": {}, "used_bytes": {}}}"#, p.pid, p.bytes);
            }
            out.push_str("]}");
        }
        out.push_str("]}\n");
        out
    }

    /// The pods as a `v1 List` (JSON), for `standalone --pods`.
    pub fn pods_json(&self) -> String {
        serde_json::json!({"apiVersion": "v1", "kind": "List", "items": self.pods}).to_string()
    }

    /// The budgets as a `v1 List` (JSON), for `standalone --budgets`.
    pub fn budgets_json(&self) -> String {
        serde_json::json!({"apiVersion": "v1", "kind": "List", "items": self.budgets}).to_string()
    }

    /// The pod table the agent would build.
    pub fn table(&self) -> PodTable {
        PodTable::build(self.pods.iter().filter_map(PodView::from_pod), &self.budgets, Some(&self.node))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::attribution::parse_cgroup_file;

    #[test]
    fn a_node_of_128_processes() {
        let n = SyntheticNode::new("n1", 8, 128);
        assert_eq!((n.pods.len(), n.processes.len(), n.budgets.len()), (64, 128, 8));
        let table = n.table();
        assert_eq!(table.pods.len(), 64);
        assert!(table.invalid_budgets.is_empty());
        assert!((0..64).all(|i| table.budget(i).is_some()), "every pod has a budget");
        for p in &n.processes {
            let owner = parse_cgroup_file(&p.cgroup).expect("attributed");
            let pod = table.find_uid(&owner.pod_uid).expect("known pod");
            let cid = owner.container_id.expect("container");
            assert_eq!(table.pods[pod].container_by_id(&cid).map(|c| &**c), Some("main"));
        }
        let sample: serde_json::Value = serde_json::from_str(&n.sample_json()).expect("json");
        assert_eq!(sample["gpus"].as_array().map(Vec::len), Some(8));
        assert_eq!(sample["gpus"][0]["processes"].as_array().map(Vec::len), Some(16));
        assert_eq!(SyntheticNode::new("n1", 8, 8).processes.len(), 8);
    }
}
