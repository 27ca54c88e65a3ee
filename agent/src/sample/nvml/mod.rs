//! GPU memory per process from NVML (nvml-wrapper; `libnvidia-ml.so.1` is loaded at run time).
//!
//! On a GPU with MIG enabled, per-process figures come from each MIG instance's handle
//! (`mig_device_by_index` → `running_compute_processes`), so each instance is a unit of its own and the
//! parent's lists are not read. The device list is enumerated at start and again every
//! [`NvmlSampler::REENUMERATE`] (MIG layouts can change).
//!
//! **One GPU at a time.** An error on one GPU (`GpuLost` after an Xid 79, a call that fails) marks that GPU
//! failed on its own: its processes leave the snapshot, so nothing is decided from it, and it is retried
//! with backoff ([`Backoff`]: 0.5 s doubling to 30 s), each retry describing its NVML index again, so a
//! GPU that comes back (or never initialised) is picked up without touching the others. Only errors that
//! mean NVML itself is gone ([`real::error`]) fail the whole sample.
//!
//! **Lists.** A unit's processes are the union of NVML's compute list, its graphics list and its MPS list
//! (clients of an MPS server), merged by PID (a process on several lists is counted once, with its largest
//! figure). On driver 580 an MPS client is on both the compute and the MPS list with the same figure; the
//! MPS list also tells which processes are MPS clients ([`ProcessSample::mps_client`]): it is read whenever a
//! process appears on a unit that answers it, so a new process is never taken for a client or not from an older
//! list (#32: a process that went around the MPS server is told at first sight). A figure NVML reports as
//! unavailable is kept as unknown ([`ProcessSample::bytes`] `None`) and counted per GPU ([`GpuReading::unavailable`]).
//!
//! NVML's process lists cost about 75 µs per process per sample on an H100 (nvml-wrapper asks twice per
//! list, count then fill), while `memory_info` costs about 7 µs whatever the count. So each unit's lists
//! are read only when its [`RefreshGate`] says so: whenever the unit's used bytes (`memory_info`) differ
//! from those at its last list, and at least every [`RefreshGate::DEFAULT_MAX_AGE`] (3 s) regardless.
//! Between lists the unit's previous per-process figures are carried unchanged. The other lists (graphics,
//! MPS) are read with every list on units that have reported a process on them; on the others, on the first list, on
//! every [`RefreshGate::OTHERS_EVERY`]th periodic list (15 s), and when the used bytes moved but the
//! compute list did not.
//!
//! **Bound.** A change that moves the unit's used bytes (a process appearing, exiting, growing or
//! shrinking, which is how a budget is crossed) is seen at the next sample, as before. A change that
//! leaves the used bytes exactly as they were (bytes moving between processes, PID reuse with the same
//! footprint) is seen within `max_age + one interval` (3 s + 250 ms with the defaults). A first graphics
//! process on a unit that never had one is seen at the next sample when it alone moved the used bytes,
//! and within `GRAPHICS_EVERY × max_age + one interval` (15.25 s) otherwise. 3 s: one compute list of 64
//! processes costs about 4 ms of CPU, so on an H100 a list every 1 s took 0.50 % of a core and every 2 s
//! 0.28–0.30 %; on two H200s with 64 processes each, every 2 s took 0.51–0.61 % and every 3 s 0.41–0.44 %
//! (docs/performance.md, issue 13). `GPUBUDGET_NVML_REFRESH` chooses the mode: `gated` (default;
//! `gated:2s` sets `max_age`),
//! `always` (both lists every sample, as before the gate), or `never` (only `memory_info`: no processes
//! are reported; for measuring the floor, never for enforcement).

pub mod gate;
pub mod real;

use std::time::{Duration, Instant};

pub use gate::{Refresh, RefreshGate, RefreshMode};
pub use real::RealNvml;

use super::{Backoff, Call, DeviceMemory, GpuInfo, GpuReading, ProcessSample, SampleError, Sampler, Snapshot};

/// One process on one of NVML's lists.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Listed {
    /// Host PID.
    pub pid: u32,
    /// Bytes, or `None` where NVML reports the figure as unavailable.
    pub bytes: Option<u64>,
}

/// NVML's per-process lists.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ProcessList {
    /// Processes with a compute context (`nvmlDeviceGetComputeRunningProcesses_v3`).
    Compute,
    /// Processes with a graphics context.
    Graphics,
    /// Clients of an MPS server (`nvmlDeviceGetMPSComputeRunningProcesses_v3`).
    Mps,
}

impl ProcessList {
    /// The nvml-wrapper call, for errors and metrics.
    pub fn call(self) -> Call {
        match self {
            Self::Compute => Call::RunningComputeProcesses,
            Self::Graphics => Call::RunningGraphicsProcesses,
            Self::Mps => Call::MpsRunningComputeProcesses,
        }
    }
}

/// The NVML calls the sampler makes ([`RealNvml`]), behind a trait so that its per-GPU handling can be
/// tested with faults injected (a GPU lost mid-run, one that never initialises, one that comes back).
pub trait Backend: Send {
    /// A handle on one unit, looked up once per sample.
    type Device<'a>
    where
        Self: 'a;
    /// How many GPUs NVML knows. An error here fails the whole sample.
    fn device_count(&self) -> Result<u32, SampleError>;
    /// The units of GPU `index`: the GPU, or its MIG instances.
    fn describe(&self, index: u32) -> Result<Vec<GpuInfo>, SampleError>;
    /// The handle on `unit`.
    fn device(&self, unit: &GpuInfo) -> Result<Self::Device<'_>, SampleError>;
    /// The device's used and free bytes (about 7 µs on an H100).
    fn memory(&self, device: &Self::Device<'_>) -> Result<DeviceMemory, SampleError>;
    /// One list; `None` where the unit does not support it (graphics or MPS lists only).
    fn processes(&self, device: &Self::Device<'_>, list: ProcessList) -> Result<Option<Vec<Listed>>, SampleError>;
}

/// One unit's state: what it is, its gate, the processes its last list gave, its health.
#[derive(Debug, Clone)]
struct Unit {
    info: GpuInfo,
    gate: RefreshGate,
    processes: Vec<ProcessSample>,
    mps_clients: u32,
    /// The last error, while failing.
    error: Option<SampleError>,
    failures: u32,
    backoff: Backoff,
    /// The unit answers the graphics list (not `NotSupported`).
    graphics_supported: bool,
    /// The unit answers the MPS list.
    mps_supported: bool,
}

impl Unit {
    fn new(info: GpuInfo, max_age: Duration) -> Self {
        Self {
            info,
            gate: RefreshGate::new(max_age),
            processes: Vec::new(),
            mps_clients: 0,
            error: None,
            failures: 0,
            backoff: Backoff::default(),
            graphics_supported: true,
            mps_supported: true,
        }
    }

    /// A stand-in for GPU `index`, which could not be described.
    fn placeholder(index: u32, max_age: Duration) -> Self {
        let info =
            GpuInfo { index, name: "unknown".into(), label: GpuInfo::label_for(index, None), ..GpuInfo::default() };
        Self::new(info, max_age)
    }

    fn failing(&self) -> bool {
        self.error.is_some()
    }

    fn fail(&mut self, now: Instant, error: SampleError) {
        self.failures = self.failures.saturating_add(1);
        let retry_in = self.backoff.failed(now);
        tracing::warn!(gpu = %self.info.label, uuid = %self.info.uuid, %error, ?retry_in, failures = self.failures,
            "GPU sample failed; nothing is decided from this GPU until it is back; the others are enforced as before");
        self.processes.clear();
        self.mps_clients = 0;
        self.gate.forget();
        self.error = Some(error);
    }

    fn recovered(&mut self) {
        if let Some(error) = self.error.take() {
            tracing::info!(gpu = %self.info.label, uuid = %self.info.uuid, after = %error, "GPU sampled again");
        }
        self.failures = 0;
        self.backoff.reset();
    }

    fn reading(&self, memory: Option<DeviceMemory>) -> GpuReading {
        match &self.error {
            Some(error) => GpuReading::failed(error.clone(), self.failures),
            None => GpuReading {
                memory,
                unavailable: u32::try_from(self.processes.iter().filter(|p| p.bytes.is_none()).count())
                    .unwrap_or(u32::MAX),
                mps_clients: self.mps_clients,
                ..GpuReading::default()
            },
        }
    }
}

/// Counts of what the sampler read, for measurements (logged at drop with `GPUBUDGET_NVML_STATS=1`).
#[derive(Debug, Clone, Default)]
struct Stats {
    enabled: bool,
    sample_us: Vec<u32>,
    skips: u64,
    changed: u64,
    full: u64,
    other_lists: u64,
}

/// Samples through NVML ([`RealNvml`]), or through any [`Backend`].
pub struct NvmlSampler<B: Backend = RealNvml> {
    backend: B,
    units: Vec<Unit>,
    mode: RefreshMode,
    enumerated_at: Instant,
    stats: Stats,
}

impl<B: Backend> std::fmt::Debug for NvmlSampler<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let gpus: Vec<&str> = self.units.iter().map(|u| u.info.label.as_str()).collect();
        f.debug_struct("NvmlSampler").field("gpus", &gpus).field("mode", &self.mode).finish_non_exhaustive()
    }
}

impl NvmlSampler<RealNvml> {
    /// Initialises NVML and lists the GPUs; the mode comes from `GPUBUDGET_NVML_REFRESH`.
    pub fn new() -> Result<Self, SampleError> {
        let mode = RefreshMode::from_env();
        let mut sampler = Self::with_backend(RealNvml::init()?, mode, super::monotonic_now())?;
        sampler.stats.enabled = std::env::var_os("GPUBUDGET_NVML_STATS").is_some();
        if mode == RefreshMode::Never {
            tracing::warn!(
                "GPUBUDGET_NVML_REFRESH=never: no process is listed, nothing is enforced (measurement only)"
            );
        }
        Ok(sampler)
    }

    /// A boxed factory for [`super::SamplerSlot`].
    pub fn factory() -> super::SamplerFactory {
        Box::new(|| Ok(Box::new(Self::new()?) as Box<dyn Sampler>))
    }
}

impl<B: Backend> NvmlSampler<B> {
    /// How often the GPU and MIG list is read again.
    pub const REENUMERATE: Duration = Duration::from_secs(30);

    /// A sampler over `backend`; lists the GPUs (a GPU that cannot be described starts failed).
    pub fn with_backend(backend: B, mode: RefreshMode, now: Instant) -> Result<Self, SampleError> {
        let mut sampler = Self { backend, units: Vec::new(), mode, enumerated_at: now, stats: Stats::default() };
        sampler.enumerate(now)?;
        let list: Vec<String> = sampler
            .units
            .iter()
            .map(|u| match &u.error {
                None => format!("{} {} ({})", u.info.label, u.info.name, u.info.uuid),
                Some(error) => format!("{} failed ({error})", u.info.label),
            })
            .collect();
        tracing::info!(gpus = sampler.units.len(), list = %list.join(", "), refresh = ?mode, "NVML initialised");
        Ok(sampler)
    }

    fn max_age(&self) -> Duration {
        match self.mode {
            RefreshMode::Gated(age) => age,
            _ => Duration::ZERO,
        }
    }

    /// Lists the GPUs again. A GPU that is failing is left to its own retries; one that cannot be described
    /// is marked failed (or, new, gets a failed stand-in); the others keep their state when unchanged.
    /// A fatal error leaves the list incomplete: the slot drops the whole sampler on it.
    fn enumerate(&mut self, now: Instant) -> Result<(), SampleError> {
        let count = self.backend.device_count()?;
        let max_age = self.max_age();
        let mut old = std::mem::take(&mut self.units);
        let mut units = Vec::with_capacity(old.len());
        for index in 0..count {
            let mine: Vec<Unit> = old.extract_if(.., |u| u.info.index == index).collect();
            if mine.iter().any(Unit::failing) {
                units.extend(mine);
                continue;
            }
            match self.backend.describe(index) {
                Ok(infos) => units.extend(reuse(mine, infos, max_age)),
                Err(error) if error.fatal => return Err(error),
                Err(error) => {
                    let mut mine = if mine.is_empty() { vec![Unit::placeholder(index, max_age)] } else { mine };
                    for unit in &mut mine {
                        unit.fail(now, error.clone());
                    }
                    units.extend(mine);
                }
            }
        }
        if !old.is_empty() {
            tracing::warn!(gone = ?old.iter().map(|u| u.info.label.as_str()).collect::<Vec<_>>(), "GPUs no longer listed by NVML");
        }
        self.units = units;
        Ok(())
    }

    /// Describes GPU `index` again for the retry of its failing units: on success its units are replaced by
    /// what NVML says now (keeping their failure count and backoff until a sample succeeds). A fatal error drops
    /// them with the whole sampler, as in [`Self::enumerate`].
    fn redescribe(&mut self, index: u32, now: Instant) -> Result<(), SampleError> {
        let max_age = self.max_age();
        let at = self.units.iter().position(|u| u.info.index == index).unwrap_or(self.units.len());
        let mine: Vec<Unit> = self.units.extract_if(.., |u| u.info.index == index).collect();
        let health = mine.first().map(|u| (u.error.clone(), u.failures, u.backoff.clone()));
        let replaced = match self.backend.describe(index) {
            Ok(infos) => {
                let mut fresh = reuse(mine, infos, max_age);
                if let Some((error, failures, backoff)) = health {
                    for unit in &mut fresh {
                        (unit.error, unit.failures, unit.backoff) = (error.clone(), failures, backoff.clone());
                    }
                }
                fresh
            }
            Err(error) if error.fatal => return Err(error),
            Err(error) => {
                let mut mine = mine;
                for unit in &mut mine {
                    unit.fail(now, error.clone());
                }
                mine
            }
        };
        self.units.splice(at..at, replaced);
        Ok(())
    }

    /// One sample at `now` (the clock is a parameter for tests; [`Sampler::sample`] passes
    /// [`super::monotonic_now`]).
    pub fn sample_at(&mut self, now: Instant, out: &mut Snapshot) -> Result<(), SampleError> {
        let start = Instant::now();
        let result = self.sample_units(now, out);
        if result.is_err() {
            // A unit whose gate said "list" may not have been listed: list every unit next time.
            for unit in &mut self.units {
                unit.gate.forget();
            }
        }
        if self.stats.enabled && self.stats.sample_us.len() < 1_000_000 {
            self.stats.sample_us.push(u32::try_from(start.elapsed().as_micros()).unwrap_or(u32::MAX));
        }
        result
    }

    fn sample_units(&mut self, now: Instant, out: &mut Snapshot) -> Result<(), SampleError> {
        if now.saturating_duration_since(self.enumerated_at) >= Self::REENUMERATE {
            self.enumerate(now)?;
            self.enumerated_at = now;
        }
        let mut due: Vec<u32> =
            self.units.iter().filter(|u| u.failing() && u.backoff.due(now)).map(|u| u.info.index).collect();
        due.dedup();
        for index in due {
            self.redescribe(index, now)?;
        }
        if out.gpus.len() != self.units.len() || out.gpus.iter().zip(&self.units).any(|(g, u)| *g != u.info) {
            out.gpus.clear();
            out.gpus.extend(self.units.iter().map(|u| u.info.clone()));
        }
        out.readings.clear();
        for (gpu, unit) in self.units.iter_mut().enumerate() {
            if unit.failing() && !unit.backoff.due(now) {
                out.readings.push(unit.reading(None));
                continue;
            }
            match sample_unit(&self.backend, unit, gpu, self.mode, now, &mut self.stats) {
                Ok(memory) => {
                    unit.recovered();
                    out.readings.push(unit.reading(Some(memory)));
                }
                Err(error) if error.fatal => return Err(error),
                Err(error) => {
                    unit.fail(now, error);
                    out.readings.push(unit.reading(None));
                }
            }
        }
        out.processes.clear();
        for unit in self.units.iter().filter(|u| !u.failing()) {
            out.processes.extend_from_slice(&unit.processes);
        }
        Ok(())
    }
}

/// The units for `infos`, reusing those of `old` that describe the same unit (their gate and last list).
fn reuse(mut old: Vec<Unit>, infos: Vec<GpuInfo>, max_age: Duration) -> Vec<Unit> {
    infos
        .into_iter()
        .map(|info| match old.iter().position(|u| u.info == info) {
            Some(i) => old.swap_remove(i),
            None => Unit::new(info, max_age),
        })
        .collect()
}

/// Samples one unit: its memory, and its lists when its gate says so. Returns the device's figures.
fn sample_unit<B: Backend>(
    backend: &B,
    unit: &mut Unit,
    gpu: usize,
    mode: RefreshMode,
    now: Instant,
    stats: &mut Stats,
) -> Result<DeviceMemory, SampleError> {
    let device = backend.device(&unit.info)?;
    // Read in every mode: the pressure signal and the accounting need it.
    let memory = backend.memory(&device)?;
    let decision = match mode {
        RefreshMode::Always => Refresh::Full,
        RefreshMode::Never => Refresh::Skip,
        RefreshMode::Gated(_) => unit.gate.decide(memory.used, now),
    };
    match decision {
        Refresh::Skip => stats.skips += 1,
        Refresh::Changed => stats.changed += 1,
        Refresh::Full => stats.full += 1,
    }
    if !decision.lists() {
        return Ok(memory);
    }
    let mut list = Vec::with_capacity(unit.processes.len());
    merge(&mut list, gpu, backend.processes(&device, ProcessList::Compute)?.unwrap_or_default());
    let unchanged = list.len() == unit.processes.len()
        && list.iter().zip(&unit.processes).all(|(a, b)| a.pid == b.pid && a.bytes == b.bytes);
    // A process the last list did not have: whether it is an MPS client is read now, never guessed, so a
    // process that went around the MPS server is told at once (#32), and a new client is not taken for one
    // that did.
    // The last list's PIDs, sorted once: both lookups below stay O(n log n) however many processes a GPU holds.
    let mut before: Vec<(Option<u32>, Option<bool>)> = unit.processes.iter().map(|q| (q.pid, q.mps_client)).collect();
    before.sort_unstable();
    let known = |pid: Option<u32>| before.binary_search_by(|(p, _)| p.cmp(&pid)).ok().map(|i| before[i].1);
    let appeared = unit.mps_supported && list.iter().any(|p| known(p.pid).is_none());
    let others = match mode {
        RefreshMode::Always => true,
        _ => unit.gate.read_others(decision, unchanged) || appeared,
    };
    let mut mps_listed = false;
    if others {
        stats.other_lists += 1;
        if unit.graphics_supported {
            match backend.processes(&device, ProcessList::Graphics)? {
                Some(graphics) => {
                    if !graphics.is_empty() {
                        unit.gate.others_found();
                    }
                    merge(&mut list, gpu, graphics);
                }
                None => unit.graphics_supported = false,
            }
        }
        if unit.mps_supported {
            match backend.processes(&device, ProcessList::Mps)? {
                Some(clients) => {
                    if !clients.is_empty() {
                        unit.gate.others_found();
                    }
                    let mut pids: Vec<u32> = clients.iter().map(|c| c.pid).collect();
                    pids.sort_unstable();
                    pids.dedup();
                    unit.mps_clients = u32::try_from(pids.len()).unwrap_or(u32::MAX);
                    merge(&mut list, gpu, clients);
                    for p in &mut list {
                        p.mps_client = p.pid.map(|pid| pids.binary_search(&pid).is_ok());
                    }
                    mps_listed = true;
                }
                None => unit.mps_supported = false,
            }
        }
    }
    if !mps_listed && unit.mps_supported {
        // Not read this time: each process keeps what the last MPS list said of it (a process is a client
        // or not for its whole life: the choice is made when CUDA starts in it).
        for p in &mut list {
            p.mps_client = known(p.pid).flatten();
        }
    }
    unit.processes = list;
    Ok(memory)
}

/// Adds `listed` to `list`: a PID already there (a process on several lists: compute and graphics, or an
/// MPS client on the compute and MPS lists) is counted once, with the larger figure (a known figure wins
/// over an unavailable one).
fn merge(list: &mut Vec<ProcessSample>, gpu: usize, listed: Vec<Listed>) {
    for p in listed {
        if let Some(seen) = list.iter_mut().find(|s| s.pid == Some(p.pid)) {
            seen.bytes = seen.bytes.max(p.bytes);
        } else {
            list.push(ProcessSample { gpu, pid: Some(p.pid), bytes: p.bytes, direct: None, mps_client: None });
        }
    }
}

impl<B: Backend + 'static> Sampler for NvmlSampler<B> {
    fn sample(&mut self, out: &mut Snapshot) -> Result<(), SampleError> {
        self.sample_at(super::monotonic_now(), out)
    }

    fn source(&self) -> String {
        "nvml".into()
    }
}

impl<B: Backend> Drop for NvmlSampler<B> {
    fn drop(&mut self) {
        if !self.stats.enabled {
            return;
        }
        let mut us = std::mem::take(&mut self.stats.sample_us);
        if !us.is_empty() {
            us.remove(0); // the first sample lists everything and warms NVML up
        }
        us.sort_unstable();
        let pct = |p: f64| -> u32 {
            if us.is_empty() {
                return 0;
            }
            let rank = ((p / 100.0) * us.len() as f64).ceil() as usize;
            us[rank.clamp(1, us.len()) - 1]
        };
        // One line on stderr, read by e2e/gpu/cost.sh.
        eprintln!(
            "{{\"kind\":\"nvml_stats\",\"mode\":\"{:?}\",\"samples\":{},\"p50_us\":{},\"p99_us\":{},\"max_us\":{},\"skips\":{},\"changed\":{},\"full\":{},\"graphics_lists\":{}}}",
            self.mode,
            us.len(),
            pct(50.0),
            pct(99.0),
            us.last().copied().unwrap_or(0),
            self.stats.skips,
            self.stats.changed,
            self.stats.full,
            self.stats.other_lists
        );
    }
}
