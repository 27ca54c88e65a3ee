//! What the NVIDIA driver caps each pod at (driver R615 per-cgroup limits): each pod's (container cgroup, GPU)
//! pairs, from the processes attributed to it, read through NVML and summed per pod into a
//! [`DriverView`]. Reading is I/O (one NVML call per pair); the comparison with the budget is pure
//! (`decide::driver_limits`).
//!
//! Cadence: a pair is read when it first appears (a container's limits are set by the toolkit's hook before it
//! starts, so they are there at once), then every [`DriverReader::REREAD_MS`]: limits change only when someone
//! sets them by hand (`nvidia-smi memory-limits`), and the live usage comes from the sample already, so reading
//! every pair every 250 ms tick would cost NVML calls for nothing. Pairs whose processes left are forgotten.
//!
//! With `--apply-driver-limits` ([`DriverReader::apply`]), a pair the plan says to cap (`decide::driver_limits::
//! to_apply`: a pod its budget caps, whose cgroup has no hard limit there or a larger one) is set through NVML and
//! read back at once; only the read-back figure counts. A pair whose set failed is tried again after
//! [`DriverReader::REREAD_MS`].

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;

use gpubudget_nvml_limits::{DriverLimits, ReadError, Reading, SetError};

use super::Owner;
use super::procfs::ProcAttributor;
use crate::sample::Snapshot;

/// Reads one pair: the real NVML ([`DriverLimits`]) or a test's.
pub trait LimitsSource: Send {
    /// The limits on GPU `gpu_uuid` for the cgroup at `cgroup` (its full sysfs path).
    fn read(&self, gpu_uuid: &str, cgroup: &std::path::Path) -> Result<Reading, ReadError>;
    /// Sets the soft and hard limits (bytes) on GPU `gpu_uuid` for the cgroup at `cgroup`.
    fn set(&self, gpu_uuid: &str, cgroup: &std::path::Path, soft: u64, hard: u64) -> Result<(), SetError>;
}

impl LimitsSource for DriverLimits {
    fn read(&self, gpu_uuid: &str, cgroup: &std::path::Path) -> Result<Reading, ReadError> {
        DriverLimits::read(self, gpu_uuid, cgroup)
    }

    fn set(&self, gpu_uuid: &str, cgroup: &std::path::Path, soft: u64, hard: u64) -> Result<(), SetError> {
        DriverLimits::set(self, gpu_uuid, cgroup, soft, hard)
    }
}

/// One set the agent made on a pair ([`DriverReader::apply`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Applied {
    /// The pod's index in the table.
    pub pod: usize,
    /// Snapshot GPU index.
    pub gpu: usize,
    /// The container cgroup, relative to the cgroup root.
    pub cgroup: Arc<str>,
    /// The hard limit before (`None`: none).
    pub before: Option<u64>,
    /// Soft and hard, bytes, as asked.
    pub asked: (u64, u64),
    /// What the driver answered when read back (`Ok`), or why the set failed (the call and `nvmlReturn_t`, or
    /// "read back without it").
    pub outcome: Result<Reading, String>,
}

impl Applied {
    /// Whether the read-back hard limit is at most what was asked.
    pub fn held(&self) -> bool {
        matches!(&self.outcome, Ok(Reading::Set(l)) if l.hard_limit().is_some_and(|h| h <= self.asked.1))
    }
}

struct Pair {
    reading: Option<Reading>,
    read_at_ms: u64,
    seen: u64,
    /// When a set last failed here (monotonic ms): not tried again before [`DriverReader::REREAD_MS`].
    set_failed_at: Option<u64>,
}

/// Reads and caches the driver's limits per (container cgroup, GPU).
pub struct DriverReader {
    source: Box<dyn LimitsSource>,
    cgroup_root: PathBuf,
    pairs: HashMap<(Arc<str>, usize), Pair>,
    generation: u64,
    /// Failed reads and sets so far (for `gpubudget_nvml_errors_total{call="memory_limits"}`).
    pub failures: u64,
    /// Whether the engine sets limits too (`--apply-driver-limits`, [`Self::apply`]).
    pub apply: bool,
    scratch: Vec<(usize, Arc<str>, usize)>,
}

impl std::fmt::Debug for DriverReader {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DriverReader").field("pairs", &self.pairs.len()).finish_non_exhaustive()
    }
}

impl DriverReader {
    /// A pair is read again after this long.
    pub const REREAD_MS: u64 = 10_000;

    /// A reader through `source`, cgroup paths under `cgroup_root` (`/sys/fs/cgroup`).
    pub fn new(source: Box<dyn LimitsSource>, cgroup_root: impl Into<PathBuf>) -> Self {
        Self {
            source,
            cgroup_root: cgroup_root.into(),
            pairs: HashMap::new(),
            generation: 0,
            failures: 0,
            apply: false,
            scratch: Vec::new(),
        }
    }

    /// Pairs remembered.
    pub fn len(&self) -> usize {
        self.pairs.len()
    }

    /// Whether none is.
    pub fn is_empty(&self) -> bool {
        self.pairs.is_empty()
    }

    /// Refills `out` with one view per pod of the table (`pods` of them; `None` for a pod with no pair): the
    /// pairs of the processes `owners` (one per process of `snapshot`) charges to it, with the container
    /// cgroups `attributor` found this round. `now_ms`: a monotonic clock.
    pub fn observe(
        &mut self,
        snapshot: &Snapshot,
        owners: &[Owner],
        attributor: &ProcAttributor,
        pods: usize,
        now_ms: u64,
        out: &mut Vec<Option<DriverView>>,
    ) {
        self.generation += 1;
        let generation = self.generation;
        out.clear();
        out.resize(pods, None);
        self.scratch.clear();
        for (process, owner) in snapshot.processes.iter().zip(owners) {
            let (Owner::Pod { pod, .. }, Some(pid)) = (owner, process.pid) else { continue };
            let Some(cgroup) = attributor.cgroup_of(pid) else { continue };
            self.scratch.push((*pod, cgroup.clone(), process.gpu));
        }
        self.scratch.sort_unstable();
        self.scratch.dedup();
        for (_, cgroup, gpu) in &self.scratch {
            let Some(info) = snapshot.gpus.get(*gpu) else { continue };
            let key = (cgroup.clone(), *gpu);
            let due = self.pairs.get(&key).is_none_or(|p| now_ms.saturating_sub(p.read_at_ms) >= Self::REREAD_MS);
            if due {
                let path = self.cgroup_root.join(cgroup.trim_start_matches('/'));
                let reading = match self.source.read(&info.uuid, &path) {
                    Ok(r) => Some(r),
                    Err(_) => {
                        self.failures += 1;
                        None
                    }
                };
                let set_failed_at = self.pairs.get(&key).and_then(|p| p.set_failed_at);
                self.pairs.insert(key.clone(), Pair { reading, read_at_ms: now_ms, seen: generation, set_failed_at });
            }
            if let Some(pair) = self.pairs.get_mut(&key) {
                pair.seen = generation;
            }
        }
        self.pairs.retain(|_, p| p.seen == generation);
        self.views(out);
    }

    /// Sums this round's pairs per pod into `out` (already sized to the table).
    fn views(&self, out: &mut [Option<DriverView>]) {
        out.iter_mut().for_each(|v| *v = None);
        for (pod, cgroup, gpu) in &self.scratch {
            let Some(pair) = self.pairs.get(&(cgroup.clone(), *gpu)) else { continue };
            if let Some(view) = out.get_mut(*pod) {
                view.get_or_insert_with(DriverView::default).add(pair.reading);
            }
        }
    }

    /// After [`Self::observe`]: sets each pair of this round that `plan` (pod index, its reading) says to cap
    /// (soft, hard bytes), reads it back at once, and refreshes `out`; what was done goes to `applied`. A pair
    /// whose set failed is not tried again before [`Self::REREAD_MS`].
    pub fn apply(
        &mut self,
        snapshot: &Snapshot,
        plan: impl Fn(usize, Option<Reading>) -> Option<(u64, u64)>,
        now_ms: u64,
        out: &mut [Option<DriverView>],
        applied: &mut Vec<Applied>,
    ) {
        let before = applied.len();
        for (pod, cgroup, gpu) in &self.scratch {
            let (Some(info), Some(pair)) = (snapshot.gpus.get(*gpu), self.pairs.get_mut(&(cgroup.clone(), *gpu)))
            else {
                continue;
            };
            if pair.set_failed_at.is_some_and(|at| now_ms.saturating_sub(at) < Self::REREAD_MS) {
                continue;
            }
            let Some((soft, hard)) = plan(*pod, pair.reading) else { continue };
            let hard_before = match pair.reading {
                Some(Reading::Set(l)) => l.hard_limit(),
                _ => None,
            };
            let path = self.cgroup_root.join(cgroup.trim_start_matches('/'));
            let outcome = match self.source.set(&info.uuid, &path, soft, hard) {
                Err(e) => Err(e.to_string()),
                Ok(()) => self.source.read(&info.uuid, &path).map_err(|e| format!("set, but not read back: {e}")),
            };
            pair.read_at_ms = now_ms;
            match &outcome {
                Ok(reading) => pair.reading = Some(*reading),
                Err(_) => self.failures += 1,
            }
            let done = Applied {
                pod: *pod,
                gpu: *gpu,
                cgroup: cgroup.clone(),
                before: hard_before,
                asked: (soft, hard),
                outcome,
            };
            pair.set_failed_at = (!done.held()).then_some(now_ms);
            applied.push(done);
        }
        if applied.len() > before {
            self.views(out);
        }
    }
}

/// What the driver holds for a pod, summed over its (container cgroup, GPU) pairs.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DriverView {
    /// Pairs read (failed reads included).
    pub pairs: u32,
    /// Pairs whose read failed.
    pub failed: u32,
    /// Pairs the driver does not partition (`NVML_ERROR_NOT_SUPPORTED`).
    pub unsupported: u32,
    /// Pairs with a hard limit, and their sum.
    pub hard_pairs: u32,
    /// Bytes.
    pub hard_sum: u64,
    /// Pairs with a soft limit, and their sum.
    pub soft_pairs: u32,
    /// Bytes.
    pub soft_sum: u64,
}

impl DriverView {
    /// Adds one pair's reading (`None`: the read failed).
    pub fn add(&mut self, reading: Option<Reading>) {
        self.pairs = self.pairs.saturating_add(1);
        match reading {
            None => self.failed = self.failed.saturating_add(1),
            Some(Reading::NotSupported) => self.unsupported = self.unsupported.saturating_add(1),
            Some(Reading::NotSet) => {}
            Some(Reading::Set(limits)) => {
                if let Some(hard) = limits.hard_limit() {
                    self.hard_pairs = self.hard_pairs.saturating_add(1);
                    self.hard_sum = self.hard_sum.saturating_add(hard);
                }
                if let Some(soft) = limits.soft_limit() {
                    self.soft_pairs = self.soft_pairs.saturating_add(1);
                    self.soft_sum = self.soft_sum.saturating_add(soft);
                }
            }
        }
    }

    /// Pairs the driver answered for.
    pub fn answered(&self) -> u32 {
        self.pairs - self.failed
    }

    /// The hard limits summed, when every answered pair has one: the most the driver lets the pod hold.
    pub fn hard(&self) -> Option<u64> {
        (self.answered() > 0 && self.hard_pairs == self.answered()).then_some(self.hard_sum)
    }

    /// The soft limits summed, when every answered pair has one.
    pub fn soft(&self) -> Option<u64> {
        (self.answered() > 0 && self.soft_pairs == self.answered()).then_some(self.soft_sum)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::attribute::procfs::write_fake_process;
    use crate::sample::{GpuInfo, ProcessSample};
    use gpubudget_nvml_limits::Limits;
    use std::sync::Mutex;

    const UID: &str = "5a1e3c9d-7b2f-4e8a-9c61-0d3f2b7a8e41";

    /// Answers 8 GiB hard / 4 GiB soft for every pair and records what it was asked.
    #[derive(Clone, Default)]
    struct Fake(Arc<Mutex<Vec<(String, PathBuf)>>>);

    impl LimitsSource for Fake {
        fn read(&self, gpu_uuid: &str, cgroup: &std::path::Path) -> Result<Reading, ReadError> {
            self.0.lock().expect("lock").push((gpu_uuid.to_owned(), cgroup.to_owned()));
            if gpu_uuid == "GPU-broken" {
                return Err(ReadError::Nvml { call: "nvmlDeviceGetHandleByUUID", code: 6 });
            }
            Ok(Reading::Set(Limits { soft: 4 << 30, hard: 8 << 30, used: 0 }))
        }

        fn set(&self, _: &str, _: &std::path::Path, _: u64, _: u64) -> Result<(), SetError> {
            Err(SetError::Nvml { call: "nvmlDeviceSetMemoryLimits_v1", code: 4 })
        }
    }

    #[test]
    fn pairs_are_read_once_then_every_ten_seconds_and_summed_per_pod() {
        let dir = tempfile::tempdir().expect("tempdir");
        let u = UID.replace('-', "_");
        let (a, b) = ("a".repeat(64), "b".repeat(64));
        let line = |c: &str| format!("0::/kubepods.slice/kubepods-pod{u}.slice/cri-containerd-{c}.scope\n");
        write_fake_process(dir.path(), 10, 1, &line(&a)).expect("fixture");
        write_fake_process(dir.path(), 11, 1, &line(&a)).expect("fixture");
        write_fake_process(dir.path(), 12, 1, &line(&b)).expect("fixture");
        let gpus = ["GPU-0", "GPU-1", "GPU-broken"]
            .iter()
            .enumerate()
            .map(|(i, u)| GpuInfo { index: i as u32, label: i.to_string(), uuid: (*u).into(), ..GpuInfo::default() })
            .collect();
        let process = |gpu, pid| ProcessSample { gpu, pid: Some(pid), bytes: Some(1), direct: None, mps_client: None };
        // Container a: two processes on GPU 0 (one pair), one on GPU 1; container b on GPU 0 and the broken GPU.
        let snapshot = Snapshot {
            gpus,
            processes: vec![process(0, 10), process(0, 11), process(1, 10), process(0, 12), process(2, 12)],
            readings: Vec::new(),
        };
        let mut attributor = ProcAttributor::new(dir.path());
        attributor.begin_round();
        for pid in [10, 11, 12] {
            attributor.lookup(pid, 0);
        }
        let owners = vec![Owner::Pod { pod: 0, container: None }; 5];
        let fake = Fake::default();
        let mut reader = DriverReader::new(Box::new(fake.clone()), "/sys/fs/cgroup");
        let mut out = Vec::new();
        reader.observe(&snapshot, &owners, &attributor, 2, 0, &mut out);
        let view = out[0].expect("pod 0 has pairs");
        assert_eq!((view.pairs, view.failed, view.hard(), view.soft()), (4, 1, Some(24 << 30), Some(12 << 30)));
        assert_eq!(out[1], None, "a pod with no process has no view");
        let asked = fake.0.lock().expect("lock").clone();
        assert_eq!(asked.len(), 4);
        let path = format!("/sys/fs/cgroup/kubepods.slice/kubepods-pod{u}.slice/cri-containerd-{a}.scope");
        assert!(asked.contains(&("GPU-1".to_owned(), PathBuf::from(&path))), "{asked:?}");
        assert_eq!(reader.failures, 1);
        // Steady: nothing read again before 10 s, the same view; then every pair again.
        reader.observe(&snapshot, &owners, &attributor, 2, 9_999, &mut out);
        assert_eq!(fake.0.lock().expect("lock").len(), 4);
        assert_eq!(out[0], Some(view));
        reader.observe(&snapshot, &owners, &attributor, 2, 10_000, &mut out);
        assert_eq!(fake.0.lock().expect("lock").len(), 8);
        // Processes gone: their pairs are forgotten.
        let empty = Snapshot { processes: Vec::new(), ..snapshot };
        reader.observe(&empty, &[], &attributor, 2, 10_250, &mut out);
        assert!(reader.is_empty());
        assert_eq!(out, vec![None, None]);
    }

    /// Holds what was set; refuses container `dddd…` (no root), takes but ignores `eeee…`.
    #[derive(Clone, Default)]
    struct Driver(Arc<Mutex<HashMap<PathBuf, Limits>>>);

    impl LimitsSource for Driver {
        fn read(&self, _: &str, cgroup: &std::path::Path) -> Result<Reading, ReadError> {
            Ok(self.0.lock().expect("lock").get(cgroup).map_or(Reading::NotSet, |l| Reading::Set(*l)))
        }

        fn set(&self, _: &str, cgroup: &std::path::Path, soft: u64, hard: u64) -> Result<(), SetError> {
            let name = cgroup.to_string_lossy();
            if name.contains("cri-containerd-dddd") {
                return Err(SetError::Nvml { call: "nvmlDeviceSetMemoryLimits_v1", code: 4 });
            }
            if !name.contains("cri-containerd-eeee") {
                self.0.lock().expect("lock").insert(cgroup.to_owned(), Limits { soft, hard, used: 0 });
            }
            Ok(())
        }
    }

    /// `--apply-driver-limits`: the plan's pairs are set and read back in the same tick (the view shows the
    /// read-back figure); a refused or ignored set is reported and not tried again for 10 s.
    #[test]
    fn planned_pairs_are_set_read_back_and_failures_wait() {
        let dir = tempfile::tempdir().expect("tempdir");
        let u = UID.replace('-', "_");
        let containers = ["a".repeat(64), "d".repeat(64), "e".repeat(64)];
        for (pid, c) in (10..).zip(&containers) {
            let line = format!("0::/kubepods.slice/kubepods-pod{u}.slice/cri-containerd-{c}.scope\n");
            write_fake_process(dir.path(), pid, 1, &line).expect("fixture");
        }
        let gpus = vec![GpuInfo { index: 0, label: "0".into(), uuid: "GPU-0".into(), ..GpuInfo::default() }];
        let process = |pid| ProcessSample { gpu: 0, pid: Some(pid), bytes: Some(1), direct: None, mps_client: None };
        let snapshot = Snapshot { gpus, processes: vec![process(10), process(11), process(12)], readings: Vec::new() };
        let mut attributor = ProcAttributor::new(dir.path());
        attributor.begin_round();
        for pid in [10, 11, 12] {
            attributor.lookup(pid, 0);
        }
        let owners = vec![Owner::Pod { pod: 0, container: None }; 3];
        let driver = Driver::default();
        let mut reader = DriverReader::new(Box::new(driver.clone()), "/sys/fs/cgroup");
        let (mut out, mut applied) = (Vec::new(), Vec::new());
        let plan = |_: usize, r: Option<Reading>| match r {
            Some(Reading::NotSet) => Some((4 << 30, 8 << 30)),
            _ => None,
        };
        reader.observe(&snapshot, &owners, &attributor, 1, 0, &mut out);
        assert_eq!(out[0].and_then(|v| v.hard()), None, "nothing set yet");
        reader.apply(&snapshot, plan, 0, &mut out, &mut applied);
        assert_eq!(applied.len(), 3);
        let held: Vec<bool> = applied.iter().map(Applied::held).collect();
        assert_eq!(held, [true, false, false], "{applied:?}");
        assert!(applied[1].outcome.as_ref().is_err_and(|e| e.contains("nvmlReturn_t 4")), "{applied:?}");
        assert_eq!(applied[2].outcome, Ok(Reading::NotSet), "taken, not held: read back without it");
        let view = out[0].expect("view");
        assert_eq!((view.hard_pairs, view.hard_sum), (1, 8 << 30), "the read-back figure, at once");
        assert_eq!(reader.failures, 1);
        // The failed pairs wait 10 s; the held one is not asked again (the plan says nothing to do).
        applied.clear();
        reader.observe(&snapshot, &owners, &attributor, 1, 250, &mut out);
        reader.apply(&snapshot, plan, 250, &mut out, &mut applied);
        assert!(applied.is_empty(), "{applied:?}");
        reader.observe(&snapshot, &owners, &attributor, 1, 10_000, &mut out);
        reader.apply(&snapshot, plan, 10_000, &mut out, &mut applied);
        assert_eq!(applied.len(), 2, "tried again after 10 s");
    }
}
