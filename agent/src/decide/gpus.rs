//! Each GPU's health and accounting, told on the Node (pure: no I/O). Per GPU:
//!
//! - **sample failed / recovered**: when a GPU's sample starts failing (a GPU lost, a call that errors), one
//!   `GpuSampleFailed` warning naming the error; when it is sampled again, one `GpuSampleRecovered`. While
//!   it fails nothing is decided from it (its processes are not in the snapshot), and the other GPUs are
//!   enforced as before.
//! - **unaccounted memory**: the device's used bytes less every listed process's. A few MiB per process and
//!   the MPS server's own share are normal (H100, driver 580: 9–10 MiB per process). When it stays at or
//!   above [`AccountingSettings::threshold`] (2 GiB by default) for [`AccountingSettings::after_ms`] (60 s),
//!   one `GpuMemoryUnaccounted` warning names the likely cause ([`likely_cause`]); again only after it
//!   has dropped under the threshold.
//! - **memory no budget covers**: the bytes of the known pods of this node that no budget selects. When they
//!   stay at or above the same threshold for the same time as unaccounted memory, one `GpuMemoryUnbudgeted`
//!   warning names the largest such pods and the node's `unbudgetedPods` policy; again only after they have
//!   dropped under the threshold.
//! - **unavailable figures**: the first time NVML gives no per-process figure on a GPU (by UUID), one
//!   `GpuProcessMemoryUnavailable` warning: such processes are counted, never charged, never the basis of
//!   an eviction.

use gpubudget_common::quantity::HumanBytes;

use super::pressure::{Threshold, Unbudgeted};
use super::{Action, NodeReason, bounded, seconds};
use crate::sample::{GpuHealth, GpuInfo, GpuReading, Snapshot};

/// When unaccounted memory is told.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AccountingSettings {
    /// At or above this (bytes or a percentage of the GPU); `None`: never told.
    pub threshold: Option<Threshold>,
    /// For at least this long.
    pub after_ms: u64,
}

impl AccountingSettings {
    /// 2 GiB for 60 s.
    pub const DEFAULT: Self = Self { threshold: Some(Threshold::Bytes(2 << 30)), after_ms: 60_000 };
}

/// What most likely holds memory that no listed process accounts for, from what the sample saw.
pub fn likely_cause(reading: &GpuReading, listed: usize) -> String {
    if reading.unavailable > 0 {
        format!(
            "NVML gives no per-process figure for {} process(es) on it (their memory is counted here, never charged to a budget)",
            reading.unavailable
        )
    } else if listed == 0 {
        "NVML lists no process on it: the agent does not share the host's PID namespace (the chart's DaemonSet sets hostPID: true; NVML lists only the caller's namespace), or the memory is held from outside this node's PID namespace".to_owned()
    } else if reading.mps_clients > 0 {
        format!(
            "MPS: the MPS server holds memory for its {} client(s) that NVML does not list per client",
            reading.mps_clients
        )
    } else {
        "processes the agent cannot see (another PID namespace) or the driver's own allocations".to_owned()
    }
}

/// The memory of pods no budget selects, per GPU, and what pressure does to them on this node.
#[derive(Debug, Clone, Copy)]
pub struct UnbudgetedMemory<'a> {
    /// Bytes per GPU of the snapshot ([`crate::attribute::Usage::unbudgeted`]).
    pub bytes: &'a [u64],
    /// The node's `--unbudgeted-pods`.
    pub policy: Unbudgeted,
}

/// A condition told once per episode, once it has lasted.
#[derive(Debug, Clone, Copy, Default)]
struct Episode {
    since: Option<u64>,
    told: bool,
}

impl Episode {
    /// Whether to tell it now: it `holds` at `now_ms`, has since `after_ms` ago, and was not told in this
    /// episode. `Some(false)` ends the episode; `None` (not known) restarts the clock and keeps it told.
    fn tell(&mut self, holds: Option<bool>, now_ms: u64, after_ms: u64) -> bool {
        match holds {
            None => {
                self.since = None;
                false
            }
            Some(false) => {
                *self = Self::default();
                false
            }
            Some(true) => {
                let since = *self.since.get_or_insert(now_ms);
                if self.told || now_ms.saturating_sub(since) < after_ms {
                    return false;
                }
                self.told = true;
                true
            }
        }
    }
}

/// `0 (GPU-…)`, or the label alone without a UUID.
fn gpu_name(info: &GpuInfo) -> GpuName<'_> {
    GpuName(info)
}

/// A GPU as notes name it: its label, and its UUID when known. Written only into a note (a tick that writes
/// none allocates nothing for it).
struct GpuName<'a>(&'a GpuInfo);

impl std::fmt::Display for GpuName<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let info = self.0;
        if info.uuid.is_empty() { f.write_str(&info.label) } else { write!(f, "{} ({})", info.label, info.uuid) }
    }
}

#[derive(Debug, Clone, Default)]
struct Track {
    label: String,
    failed: bool,
    unaccounted: Episode,
    unbudgeted: Episode,
}

/// The per-GPU watch. Keyed by the snapshot's GPU order; a changed GPU list starts afresh (UUIDs told
/// about unavailable figures are kept).
#[derive(Debug, Clone, Default)]
pub struct GpuWatch {
    gpus: Vec<Track>,
    told_unavailable: Vec<String>,
}

impl GpuWatch {
    /// Looks at one sample: `unaccounted` per GPU (same order as `snapshot.gpus`). Node events go to `out`.
    pub fn observe(
        &mut self,
        settings: &AccountingSettings,
        now_ms: u64,
        snapshot: &Snapshot,
        unaccounted: &[Option<u64>],
        out: &mut Vec<Action>,
    ) {
        if self.gpus.len() != snapshot.gpus.len()
            || self.gpus.iter().zip(&snapshot.gpus).any(|(t, g)| t.label != g.label)
        {
            self.gpus = snapshot.gpus.iter().map(|g| Track { label: g.label.clone(), ..Track::default() }).collect();
        }
        for (g, info) in snapshot.gpus.iter().enumerate() {
            let Some(reading) = snapshot.readings.get(g) else { continue };
            let track = &mut self.gpus[g];
            let name = gpu_name(info);
            match &reading.health {
                GpuHealth::Failed { error, .. } => {
                    if !track.failed {
                        track.failed = true;
                        track.unaccounted.since = None;
                        let note = format!(
                            "GPU {name}: sample failed ({error}); nothing is decided from this GPU until it is sampled again (retried with backoff); the other GPUs are enforced as before"
                        );
                        out.push(Action::NodeEvent { reason: NodeReason::GpuSampleFailed, note: bounded(note) });
                    }
                    continue;
                }
                GpuHealth::Sampled if track.failed => {
                    track.failed = false;
                    let note = format!("GPU {name}: sampled again; its pods are enforced again");
                    out.push(Action::NodeEvent { reason: NodeReason::GpuSampleRecovered, note });
                }
                GpuHealth::Sampled => {}
            }
            if reading.unavailable > 0 && !self.told_unavailable.contains(&info.uuid) {
                self.told_unavailable.push(info.uuid.clone());
                let note = format!(
                    "GPU {name}: NVML gives no per-process memory figure for {} process(es); they are counted (gpubudget_gpu_processes_unavailable), never charged to a budget and never the basis of an eviction",
                    reading.unavailable
                );
                out.push(Action::NodeEvent { reason: NodeReason::Unavailable, note });
            }
            let (Some(threshold), Some(Some(bytes))) = (settings.threshold, unaccounted.get(g)) else {
                track.unaccounted.tell(None, now_ms, settings.after_ms);
                continue;
            };
            let large = *bytes >= threshold.bytes(info.total_bytes);
            if !track.unaccounted.tell(Some(large), now_ms, settings.after_ms) {
                continue;
            }
            let listed = snapshot.processes.iter().filter(|p| p.gpu == g).count();
            let used = snapshot.memory(g).map_or(0, |m| m.used);
            let note = format!(
                "GPU {name}: {} of the {} in use is held by no process the agent lists, for {}s or more (gpubudget_gpu_unaccounted_bytes). Likely cause: {}",
                HumanBytes(*bytes),
                HumanBytes(used),
                seconds(settings.after_ms),
                likely_cause(reading, listed)
            );
            out.push(Action::NodeEvent { reason: NodeReason::Unaccounted, note: bounded(note) });
        }
    }

    /// Looks at the memory of pods no budget selects, after [`Self::observe`] on the same sample: `held`, its
    /// bytes per GPU and the node's policy; `pods(g)` names the largest such pods on GPU `g` (called only when
    /// the event is sent). Node events go to `out`.
    pub fn observe_unbudgeted(
        &mut self,
        settings: &AccountingSettings,
        now_ms: u64,
        snapshot: &Snapshot,
        held: UnbudgetedMemory<'_>,
        pods: impl Fn(usize) -> String,
        out: &mut Vec<Action>,
    ) {
        let UnbudgetedMemory { bytes: unbudgeted, policy } = held;
        for (g, (info, track)) in snapshot.gpus.iter().zip(&mut self.gpus).enumerate() {
            let bytes = unbudgeted.get(g).copied().unwrap_or(0);
            let threshold = settings.threshold.map(|t| t.bytes(info.total_bytes));
            let large = threshold.is_some_and(|t| bytes >= t);
            if !track.unbudgeted.tell(Some(large), now_ms, settings.after_ms) {
                continue;
            }
            let name = gpu_name(info);
            let used = snapshot.memory(g).map_or(0, |m| m.used);
            let then = match policy {
                Unbudgeted::Ranked => {
                    "under memory pressure they are guaranteed nothing and go before any pod within its budget \
                     (node policy unbudgetedPods=Ranked)"
                }
                Unbudgeted::Never => {
                    "under memory pressure they are never evicted (node policy unbudgetedPods=Never): they can \
                     fill the GPU and starve a budgeted neighbour"
                }
            };
            let note = format!(
                "GPU {name}: {} of the {} in use (at or above {}) is held by pods no budget selects, for {}s or more \
                 (gpubudget_unbudgeted_bytes): {}; {then}. Give their namespaces a GpuMemoryBudget",
                HumanBytes(bytes),
                HumanBytes(used),
                HumanBytes(threshold.unwrap_or_default()),
                seconds(settings.after_ms),
                pods(g)
            );
            out.push(Action::NodeEvent { reason: NodeReason::Unbudgeted, note: bounded(note) });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sample::{DeviceMemory, GpuInfo, ProcessSample, SampleError};
    use proptest::prelude::*;

    const GI: u64 = 1 << 30;

    fn snapshot(readings: Vec<GpuReading>, processes: &[(usize, Option<u64>)]) -> Snapshot {
        Snapshot {
            gpus: (0..readings.len())
                .map(|i| GpuInfo {
                    index: i as u32,
                    label: i.to_string(),
                    uuid: format!("GPU-{i}"),
                    total_bytes: 80 * GI,
                    ..GpuInfo::default()
                })
                .collect(),
            processes: processes
                .iter()
                .enumerate()
                .map(|(n, &(gpu, bytes))| ProcessSample {
                    gpu,
                    pid: Some(n as u32 + 1),
                    bytes,
                    direct: None,
                    mps_client: None,
                })
                .collect(),
            readings,
        }
    }

    fn sampled(used: u64) -> GpuReading {
        GpuReading::sampled(Some(DeviceMemory::from_used(used, 80 * GI)))
    }

    fn reasons(out: &[Action]) -> Vec<(NodeReason, String)> {
        out.iter()
            .filter_map(|a| match a {
                Action::NodeEvent { reason, note } => Some((*reason, note.clone())),
                _ => None,
            })
            .collect()
    }

    #[test]
    fn a_failed_gpu_is_told_once_and_its_recovery_once() {
        let mut watch = GpuWatch::default();
        let s = AccountingSettings::DEFAULT;
        let mut out = Vec::new();
        let lost = GpuReading::failed(SampleError::new(crate::sample::Call::MemoryInfo, "GPU is lost"), 1);
        watch.observe(&s, 0, &snapshot(vec![sampled(0), lost.clone()], &[]), &[Some(0), None], &mut out);
        let told = reasons(&out);
        assert_eq!(told.len(), 1);
        assert_eq!(told[0].0, NodeReason::GpuSampleFailed);
        assert!(told[0].1.contains("GPU 1 (GPU-1)") && told[0].1.contains("GPU is lost"), "{}", told[0].1);
        out.clear();
        let again = GpuReading::failed(SampleError::new(crate::sample::Call::MemoryInfo, "GPU is lost"), 2);
        watch.observe(&s, 250, &snapshot(vec![sampled(0), again], &[]), &[Some(0), None], &mut out);
        assert!(out.is_empty(), "told once per episode");
        watch.observe(&s, 500, &snapshot(vec![sampled(0), sampled(0)], &[]), &[Some(0), Some(0)], &mut out);
        assert_eq!(reasons(&out)[0].0, NodeReason::GpuSampleRecovered);
        out.clear();
        watch.observe(&s, 750, &snapshot(vec![sampled(0), lost], &[]), &[Some(0), None], &mut out);
        assert_eq!(reasons(&out)[0].0, NodeReason::GpuSampleFailed, "a new episode is told again");
    }

    #[test]
    fn unaccounted_memory_is_told_after_it_stays_large_with_its_likely_cause() {
        let mut watch = GpuWatch::default();
        let s = AccountingSettings { threshold: Some(Threshold::Bytes(2 * GI)), after_ms: 60_000 };
        let mut out = Vec::new();
        // 30 GiB in use, no process listed: the agent without the host PID namespace.
        let view = snapshot(vec![sampled(30 * GI)], &[]);
        watch.observe(&s, 0, &view, &[Some(30 * GI)], &mut out);
        watch.observe(&s, 59_999, &view, &[Some(30 * GI)], &mut out);
        assert!(out.is_empty(), "not before it has lasted");
        watch.observe(&s, 60_000, &view, &[Some(30 * GI)], &mut out);
        let told = reasons(&out);
        assert_eq!(told.len(), 1);
        assert_eq!(told[0].0, NodeReason::Unaccounted);
        assert!(told[0].1.contains("30Gi of the 30Gi") && told[0].1.contains("hostPID"), "{}", told[0].1);
        out.clear();
        watch.observe(&s, 120_000, &view, &[Some(30 * GI)], &mut out);
        assert!(out.is_empty(), "told once while it lasts");
        // A dip under the threshold resets the clock, and a dip in the middle of a stretch restarts it.
        watch.observe(&s, 121_000, &view, &[Some(GI)], &mut out);
        watch.observe(&s, 122_000, &view, &[Some(3 * GI)], &mut out);
        watch.observe(&s, 181_000, &view, &[Some(3 * GI)], &mut out);
        assert!(out.is_empty());
        watch.observe(&s, 182_000, &view, &[Some(3 * GI)], &mut out);
        assert_eq!(reasons(&out).len(), 1);
    }

    #[test]
    fn memory_of_pods_no_budget_selects_is_told_once_per_episode_with_the_policy() {
        let mut watch = GpuWatch::default();
        let s = AccountingSettings { threshold: Some(Threshold::Bytes(2 * GI)), after_ms: 60_000 };
        let mut out = Vec::new();
        let view = snapshot(vec![sampled(50 * GI), sampled(10 * GI)], &[]);
        let pods = |g: usize| format!("free/filler-{g} 40Gi");
        let at = |watch: &mut GpuWatch, ms: u64, bytes: [u64; 2], policy, out: &mut Vec<Action>| {
            watch.observe(&s, ms, &view, &[Some(0), Some(0)], out);
            watch.observe_unbudgeted(&s, ms, &view, UnbudgetedMemory { bytes: &bytes, policy }, pods, out);
        };
        // GPU 0: 40Gi held by pods no budget selects; GPU 1: 1Gi, under the threshold.
        at(&mut watch, 0, [40 * GI, GI], Unbudgeted::Ranked, &mut out);
        at(&mut watch, 59_999, [40 * GI, GI], Unbudgeted::Ranked, &mut out);
        assert!(out.is_empty(), "not before it has lasted");
        at(&mut watch, 60_000, [40 * GI, GI], Unbudgeted::Ranked, &mut out);
        let told = reasons(&out);
        assert_eq!(told.len(), 1, "{told:?}");
        assert_eq!((told[0].0, told[0].0.as_str()), (NodeReason::Unbudgeted, "GpuMemoryUnbudgeted"));
        let note = &told[0].1;
        assert!(note.starts_with("GPU 0 (GPU-0): 40Gi of the 50Gi in use"), "{note}");
        assert!(note.contains("free/filler-0 40Gi") && note.contains("unbudgetedPods=Ranked"), "{note}");
        out.clear();
        at(&mut watch, 120_000, [40 * GI, GI], Unbudgeted::Ranked, &mut out);
        assert!(out.is_empty(), "told once per episode");
        // Under the threshold ends the episode; the next one is told again, with the policy of the node.
        at(&mut watch, 121_000, [GI, GI], Unbudgeted::Never, &mut out);
        at(&mut watch, 122_000, [3 * GI, GI], Unbudgeted::Never, &mut out);
        at(&mut watch, 182_000, [3 * GI, GI], Unbudgeted::Never, &mut out);
        let told = reasons(&out);
        assert_eq!(told.len(), 1, "{told:?}");
        assert!(told[0].1.contains("unbudgetedPods=Never") && told[0].1.contains("starve"), "{}", told[0].1);
        // "off" never tells.
        let mut quiet = GpuWatch::default();
        let off = AccountingSettings { threshold: None, after_ms: 0 };
        out.clear();
        quiet.observe(&off, 0, &view, &[None, None], &mut out);
        let all = UnbudgetedMemory { bytes: &[80 * GI, 80 * GI], policy: Unbudgeted::Ranked };
        quiet.observe_unbudgeted(&off, 0, &view, all, pods, &mut out);
        assert!(out.is_empty());
    }

    #[test]
    fn causes_are_named_from_what_was_seen() {
        let plain = sampled(10 * GI);
        assert!(likely_cause(&plain, 0).contains("hostPID"));
        assert!(likely_cause(&plain, 3).contains("cannot see"));
        let mps = GpuReading { mps_clients: 2, ..sampled(10 * GI) };
        assert!(likely_cause(&mps, 3).starts_with("MPS"));
        let blind = GpuReading { unavailable: 4, mps_clients: 2, ..sampled(10 * GI) };
        assert!(likely_cause(&blind, 4).contains("no per-process figure for 4"));
    }

    #[test]
    fn unavailable_figures_are_told_once_per_gpu() {
        let mut watch = GpuWatch::default();
        let s = AccountingSettings { threshold: None, after_ms: 0 };
        let mut out = Vec::new();
        let blind = GpuReading { unavailable: 2, ..sampled(4 * GI) };
        let view = snapshot(vec![blind.clone(), sampled(0)], &[(0, None), (0, None)]);
        for t in 0..10 {
            watch.observe(&s, t * 250, &view, &[Some(4 * GI), Some(0)], &mut out);
        }
        let told = reasons(&out);
        assert_eq!(told.len(), 1, "{told:?}");
        assert_eq!(told[0].0, NodeReason::Unavailable);
        assert!(told[0].1.starts_with("GPU 0 (GPU-0)") && told[0].1.contains("never the basis of an eviction"));
        // The other GPU gets its own, once.
        out.clear();
        let view = snapshot(vec![blind.clone(), blind], &[(0, None), (1, None)]);
        watch.observe(&s, 5_000, &view, &[None, None], &mut out);
        watch.observe(&s, 5_250, &view, &[None, None], &mut out);
        assert_eq!(reasons(&out).len(), 1);
        assert!(reasons(&out)[0].1.starts_with("GPU 1"));
    }

    proptest! {
        /// Over any run of healthy and failed samples, the failures and recoveries told alternate, starting
        /// with a failure, and there is one per change of health.
        #[test]
        fn health_events_follow_the_changes(health in proptest::collection::vec(any::<bool>(), 1..60)) {
            let mut watch = GpuWatch::default();
            let s = AccountingSettings::DEFAULT;
            let mut out = Vec::new();
            let mut failures = 0;
            let mut changes = 0;
            let mut was_ok = true;
            for (t, &ok) in health.iter().enumerate() {
                let reading = if ok {
                    failures = 0;
                    sampled(0)
                } else {
                    failures += 1;
                    GpuReading::failed(SampleError::new(crate::sample::Call::MemoryInfo, "GPU is lost"), failures)
                };
                if ok != was_ok {
                    changes += 1;
                }
                was_ok = ok;
                watch.observe(&s, t as u64 * 250, &snapshot(vec![reading], &[]), &[None], &mut out);
            }
            let told: Vec<NodeReason> = reasons(&out).into_iter().map(|(r, _)| r).collect();
            prop_assert_eq!(told.len(), changes);
            for (i, r) in told.iter().enumerate() {
                let expected = if i % 2 == 0 { NodeReason::GpuSampleFailed } else { NodeReason::GpuSampleRecovered };
                prop_assert_eq!(*r, expected);
            }
        }
    }
}
