//! GPU memory per process from NVML (nvml-wrapper; `libnvidia-ml.so.1` is loaded at run time).
//!
//! On a GPU with MIG enabled, per-process figures come from each MIG instance's handle
//! (`mig_device_by_index` → `running_compute_processes`), so each instance is a unit of its own and the
//! parent's lists are not read. The device list is enumerated at start and again every
//! [`NvmlSampler::REENUMERATE`] (MIG layouts can change).
//!
//! NVML's process lists cost about 75 µs per process per sample on an H100 (nvml-wrapper asks twice per
//! list, count then fill), while `memory_info` costs about 7 µs whatever the count. So each unit's lists
//! are read only when its [`RefreshGate`] says so: whenever the unit's used bytes (`memory_info`) differ
//! from those at its last list, and at least every [`RefreshGate::DEFAULT_MAX_AGE`] (3 s) regardless.
//! Between lists the unit's previous per-process figures are carried unchanged. The graphics list is read
//! with every list on units that have reported a graphics process; on the others, on the first list, on
//! every [`RefreshGate::GRAPHICS_EVERY`]th periodic list (15 s), and when the used bytes moved but the
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

use std::time::{Duration, Instant};

use nvml_wrapper::Nvml;
use nvml_wrapper::enums::device::UsedGpuMemory;
use nvml_wrapper::error::NvmlError;
use nvml_wrapper::struct_wrappers::device::ProcessInfo;

use super::{GpuInfo, ProcessSample, SampleError, Sampler, Snapshot};

/// What a unit's sample reads, as decided by [`RefreshGate::decide`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refresh {
    /// Nothing: the previous per-process figures stand.
    Skip,
    /// The process lists (compute; graphics too where the unit has had a graphics process).
    Changed,
    /// Both lists: the periodic refresh (or the first sample).
    Full,
}

impl Refresh {
    /// Whether any list is read.
    pub fn lists(self) -> bool {
        self != Self::Skip
    }
}

/// The pure decision of whether one unit's process lists must be read (no NVML in it).
///
/// Lists whenever `used_bytes` differs from the figure at the last list, and at least every `max_age`
/// whatever it says. So every change of the device total is listed at the next sample, and every other
/// change within `max_age` plus one sampling interval.
#[derive(Debug, Clone)]
pub struct RefreshGate {
    max_age: Duration,
    last: Option<(u64, Instant)>,
    graphics_seen: bool,
    fulls: u32,
}

impl RefreshGate {
    /// The default longest time between two full lists.
    pub const DEFAULT_MAX_AGE: Duration = Duration::from_secs(3);
    /// On a unit that has never had a graphics process, the graphics list is read on every this many
    /// periodic lists (every 15 s with the default `max_age`), on the first, and when the device total
    /// moved but the compute list did not.
    pub const GRAPHICS_EVERY: u32 = 5;

    /// A gate that lists at least every `max_age`.
    pub fn new(max_age: Duration) -> Self {
        Self { max_age, last: None, graphics_seen: false, fulls: 0 }
    }

    /// The longest time between two full lists.
    pub fn max_age(&self) -> Duration {
        self.max_age
    }

    /// Decides for a sample taken at `now` that read `used_bytes`, and records a list if it says so
    /// (call [`Self::forget`] when that list then fails).
    pub fn decide(&mut self, used_bytes: u64, now: Instant) -> Refresh {
        let decision = match self.last {
            None => Refresh::Full,
            Some((_, at)) if now.saturating_duration_since(at) >= self.max_age => Refresh::Full,
            Some((used, _)) if used != used_bytes => Refresh::Changed,
            Some(_) => Refresh::Skip,
        };
        match decision {
            Refresh::Full => self.last = Some((used_bytes, now)),
            Refresh::Changed => {
                // The age counts from the last full list, so a unit that changes at every sample still
                // gets its graphics list every `max_age`.
                let at = self.last.map_or(now, |(_, at)| at);
                self.last = Some((used_bytes, at));
            }
            Refresh::Skip => {}
        }
        decision
    }

    /// [`Self::decide`] as a yes or no.
    pub fn must_list(&mut self, used_bytes: u64, now: Instant) -> bool {
        self.decide(used_bytes, now).lists()
    }

    /// Forgets the last list: the next sample lists in full, graphics included.
    pub fn forget(&mut self) {
        self.last = None;
        self.fulls = 0;
    }

    /// Whether the graphics list is read too, once the gate has said `decision` and the compute list came
    /// back, `compute_unchanged` when it holds the same PIDs and bytes as the last one (so the device
    /// total moved for something else: a graphics process, say). Always on a unit that has had a graphics
    /// process ([`Self::graphics_found`]).
    pub fn read_graphics(&mut self, decision: Refresh, compute_unchanged: bool) -> bool {
        match decision {
            Refresh::Skip => false,
            _ if self.graphics_seen => true,
            Refresh::Full => {
                let due = self.fulls.is_multiple_of(Self::GRAPHICS_EVERY);
                self.fulls = self.fulls.wrapping_add(1);
                due
            }
            Refresh::Changed => compute_unchanged,
        }
    }

    /// Records that the graphics list held a process: from then on it is read with every list.
    pub fn graphics_found(&mut self) {
        self.graphics_seen = true;
    }
}

/// How the sampler reads the process lists (`GPUBUDGET_NVML_REFRESH`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RefreshMode {
    /// Through a [`RefreshGate`] with this `max_age` (the default).
    Gated(Duration),
    /// Both lists, every sample (the behaviour before the gate).
    Always,
    /// `memory_info` alone, no process (the floor, for measurements only).
    Never,
}

impl RefreshMode {
    /// Parses `gated`, `gated:2s`, `always`, `never`.
    pub fn parse(text: &str) -> Result<Self, String> {
        match text.trim() {
            "" | "gated" => Ok(Self::Gated(RefreshGate::DEFAULT_MAX_AGE)),
            "always" => Ok(Self::Always),
            "never" => Ok(Self::Never),
            other => match other.strip_prefix("gated:") {
                Some(age) => crate::cli::parse_duration(age).map(Self::Gated),
                None => Err(format!("{other:?}: expected gated, gated:<duration>, always or never")),
            },
        }
    }

    fn from_env() -> Self {
        match std::env::var("GPUBUDGET_NVML_REFRESH") {
            Ok(text) => Self::parse(&text).unwrap_or_else(|error| {
                tracing::warn!(%error, "GPUBUDGET_NVML_REFRESH ignored");
                Self::Gated(RefreshGate::DEFAULT_MAX_AGE)
            }),
            Err(_) => Self::Gated(RefreshGate::DEFAULT_MAX_AGE),
        }
    }
}

/// One unit's gate and the processes its last list gave.
#[derive(Debug, Clone)]
struct Unit {
    gate: RefreshGate,
    processes: Vec<ProcessSample>,
}

/// Counts of what the sampler read, for measurements (logged at drop with `GPUBUDGET_NVML_STATS=1`).
#[derive(Debug, Clone, Default)]
struct Stats {
    enabled: bool,
    sample_us: Vec<u32>,
    skips: u64,
    changed: u64,
    full: u64,
    graphics_lists: u64,
}

/// Samples through NVML.
pub struct NvmlSampler {
    nvml: Nvml,
    gpus: Vec<GpuInfo>,
    units: Vec<Unit>,
    mode: RefreshMode,
    enumerated_at: Instant,
    unavailable_logged: bool,
    stats: Stats,
}

impl std::fmt::Debug for NvmlSampler {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NvmlSampler").field("gpus", &self.gpus).field("mode", &self.mode).finish_non_exhaustive()
    }
}

fn error(call: &'static str, e: NvmlError) -> SampleError {
    let fatal = matches!(
        e,
        NvmlError::Uninitialized
            | NvmlError::DriverNotLoaded
            | NvmlError::GpuLost
            | NvmlError::LibraryNotFound
            | NvmlError::LibloadingError(_)
            | NvmlError::FunctionNotFound
            | NvmlError::FailedToLoadSymbol(_)
    );
    let err = SampleError::new(call, e);
    if fatal { err.fatal() } else { err }
}

impl NvmlSampler {
    /// How often the GPU and MIG list is read again.
    pub const REENUMERATE: Duration = Duration::from_secs(30);

    /// Initialises NVML and lists the GPUs.
    pub fn new() -> Result<Self, SampleError> {
        let nvml = Nvml::init().map_err(|e| error("init", e).fatal())?;
        let gpus = enumerate(&nvml)?;
        let mode = RefreshMode::from_env();
        tracing::info!(
            gpus = gpus.len(),
            list = %gpus.iter().map(|g| format!("{} {} ({})", g.label, g.name, g.uuid)).collect::<Vec<_>>().join(", "),
            refresh = ?mode,
            "NVML initialised"
        );
        if mode == RefreshMode::Never {
            tracing::warn!(
                "GPUBUDGET_NVML_REFRESH=never: no process is listed, nothing is enforced (measurement only)"
            );
        }
        let stats = Stats { enabled: std::env::var_os("GPUBUDGET_NVML_STATS").is_some(), ..Stats::default() };
        let mut sampler = Self {
            nvml,
            gpus,
            units: Vec::new(),
            mode,
            enumerated_at: Instant::now(),
            unavailable_logged: false,
            stats,
        };
        sampler.reset_units();
        Ok(sampler)
    }

    /// A boxed factory for [`super::SamplerSlot`].
    pub fn factory() -> super::SamplerFactory {
        Box::new(|| Ok(Box::new(Self::new()?) as Box<dyn Sampler>))
    }

    fn reset_units(&mut self) {
        let max_age = match self.mode {
            RefreshMode::Gated(age) => age,
            _ => Duration::ZERO,
        };
        self.units =
            (0..self.gpus.len()).map(|_| Unit { gate: RefreshGate::new(max_age), processes: Vec::new() }).collect();
    }

    fn sample_units(&mut self, out: &mut Snapshot) -> Result<(), SampleError> {
        for gpu in 0..self.gpus.len() {
            let (index, mig) = (self.gpus[gpu].index, self.gpus[gpu].mig);
            let parent = self.nvml.device_by_index(index).map_err(|e| error("device_by_index", e))?;
            let device = match mig {
                Some(m) => parent.mig_device_by_index(m).map_err(|e| error("mig_device_by_index", e))?,
                None => parent,
            };
            let unit = &mut self.units[gpu];
            // Read in every mode: the pressure signal needs it.
            let used = device.memory_info().map_err(|e| error("memory_info", e))?.used;
            out.used[gpu] = Some(used);
            let decision = match self.mode {
                RefreshMode::Always => Refresh::Full,
                RefreshMode::Never => Refresh::Skip,
                RefreshMode::Gated(_) => unit.gate.decide(used, Instant::now()),
            };
            match decision {
                Refresh::Skip => self.stats.skips += 1,
                Refresh::Changed => self.stats.changed += 1,
                Refresh::Full => self.stats.full += 1,
            }
            if !decision.lists() {
                continue;
            }
            let compute = device.running_compute_processes().map_err(|e| error("running_compute_processes", e))?;
            let label = &out.gpus[gpu].label;
            let mut list = Vec::with_capacity(compute.len());
            push(&mut list, &mut self.unavailable_logged, label, gpu, compute);
            let graphics = match self.mode {
                RefreshMode::Always => true,
                _ => unit.gate.read_graphics(decision, list == unit.processes),
            };
            if graphics {
                self.stats.graphics_lists += 1;
                let graphics = match device.running_graphics_processes() {
                    Ok(list) => list,
                    Err(NvmlError::NotSupported) => Vec::new(),
                    Err(e) => return Err(error("running_graphics_processes", e)),
                };
                if !graphics.is_empty() {
                    unit.gate.graphics_found();
                }
                push(&mut list, &mut self.unavailable_logged, label, gpu, graphics);
            }
            unit.processes = list;
        }
        out.processes.clear();
        for unit in &self.units {
            out.processes.extend_from_slice(&unit.processes);
        }
        Ok(())
    }
}

fn push(
    list: &mut Vec<ProcessSample>,
    unavailable_logged: &mut bool,
    label: &str,
    gpu: usize,
    processes: Vec<ProcessInfo>,
) {
    for p in processes {
        let bytes = match p.used_gpu_memory {
            UsedGpuMemory::Used(b) => b,
            UsedGpuMemory::Unavailable => {
                if !*unavailable_logged {
                    *unavailable_logged = true;
                    tracing::warn!(pid = p.pid, gpu = %label, "NVML reports no per-process memory on this GPU; its processes count as 0");
                }
                0
            }
        };
        // A process with both a compute and a graphics context is listed twice with the same figure.
        if let Some(seen) = list.iter_mut().find(|s| s.pid == Some(p.pid)) {
            seen.bytes = seen.bytes.max(bytes);
        } else {
            list.push(ProcessSample { gpu, pid: Some(p.pid), bytes, direct: None });
        }
    }
}

fn enumerate(nvml: &Nvml) -> Result<Vec<GpuInfo>, SampleError> {
    let count = nvml.device_count().map_err(|e| error("device_count", e))?;
    let mut gpus = Vec::new();
    for index in 0..count {
        let device = nvml.device_by_index(index).map_err(|e| error("device_by_index", e))?;
        let name = device.name().unwrap_or_else(|_| "unknown".into());
        let mig_enabled = matches!(device.mig_mode(), Ok(mode) if mode.current == 1);
        if mig_enabled {
            let slots = device.mig_device_count().map_err(|e| error("mig_device_count", e))?;
            for m in 0..slots {
                match device.mig_device_by_index(m) {
                    Ok(mig) => gpus.push(GpuInfo {
                        index,
                        mig: Some(m),
                        uuid: mig.uuid().unwrap_or_default(),
                        name: name.clone(),
                        total_bytes: mig.memory_info().map(|i| i.total).unwrap_or(0),
                        label: GpuInfo::label_for(index, Some(m)),
                    }),
                    Err(NvmlError::NotFound) => {}
                    Err(e) => return Err(error("mig_device_by_index", e)),
                }
            }
        } else {
            gpus.push(GpuInfo {
                index,
                mig: None,
                uuid: device.uuid().map_err(|e| error("uuid", e))?,
                name,
                total_bytes: device.memory_info().map_err(|e| error("memory_info", e))?.total,
                label: GpuInfo::label_for(index, None),
            });
        }
    }
    Ok(gpus)
}

impl Sampler for NvmlSampler {
    fn sample(&mut self, out: &mut Snapshot) -> Result<(), SampleError> {
        let start = Instant::now();
        if self.enumerated_at.elapsed() >= Self::REENUMERATE {
            let gpus = enumerate(&self.nvml)?;
            if gpus != self.gpus {
                tracing::info!(gpus = gpus.len(), "GPU list changed");
                self.gpus = gpus;
                self.reset_units();
            }
            self.enumerated_at = Instant::now();
        }
        if out.gpus != self.gpus {
            out.gpus.clone_from(&self.gpus);
        }
        out.used.clear();
        out.used.resize(self.gpus.len(), None);
        let result = self.sample_units(out);
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

    fn source(&self) -> String {
        "nvml".into()
    }
}

impl Drop for NvmlSampler {
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
            self.stats.graphics_lists
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const TICK: Duration = Duration::from_millis(250);

    #[test]
    fn first_sample_lists_in_full_then_skips_while_nothing_moves() {
        let t0 = Instant::now();
        let mut gate = RefreshGate::new(Duration::from_secs(1));
        assert_eq!(gate.decide(100, t0), Refresh::Full);
        assert_eq!(gate.decide(100, t0 + TICK), Refresh::Skip);
        assert_eq!(gate.decide(100, t0 + 2 * TICK), Refresh::Skip);
        assert_eq!(gate.decide(100, t0 + 3 * TICK), Refresh::Skip);
        assert_eq!(gate.decide(100, t0 + 4 * TICK), Refresh::Full, "max_age reached");
        assert_eq!(gate.decide(101, t0 + 5 * TICK), Refresh::Changed);
        assert_eq!(gate.decide(101, t0 + 6 * TICK), Refresh::Skip);
        assert_eq!(gate.decide(100, t0 + 7 * TICK), Refresh::Changed, "back to an earlier figure is a change");
        assert_eq!(gate.decide(100, t0 + 8 * TICK), Refresh::Full, "age counts from the last full list");
    }

    #[test]
    fn forget_lists_again() {
        let t0 = Instant::now();
        let mut gate = RefreshGate::new(Duration::from_secs(1));
        assert!(gate.must_list(5, t0));
        assert!(!gate.must_list(5, t0 + TICK));
        gate.forget();
        assert!(gate.must_list(5, t0 + 2 * TICK));
    }

    #[test]
    fn graphics_list_cadence() {
        let mut gate = RefreshGate::new(Duration::from_secs(2));
        assert!(!gate.read_graphics(Refresh::Skip, true));
        // Periodic lists: the first, then every GRAPHICS_EVERY-th.
        let reads: Vec<bool> = (0..11).map(|_| gate.read_graphics(Refresh::Full, false)).collect();
        assert_eq!(reads, [true, false, false, false, false, true, false, false, false, false, true]);
        // A moved device total with an unchanged compute list reads graphics; a changed compute list does not.
        assert!(gate.read_graphics(Refresh::Changed, true));
        assert!(!gate.read_graphics(Refresh::Changed, false));
        // Once a graphics process was seen, every list reads graphics.
        gate.graphics_found();
        assert!(gate.read_graphics(Refresh::Changed, false));
        assert!(gate.read_graphics(Refresh::Full, false));
        assert!(!gate.read_graphics(Refresh::Skip, false));
        // After a failure, the next list is a full one with graphics.
        let mut gate = RefreshGate::new(Duration::from_secs(2));
        gate.read_graphics(Refresh::Full, false);
        gate.forget();
        assert!(gate.read_graphics(Refresh::Full, false));
    }

    #[test]
    fn modes_parse() {
        assert_eq!(RefreshMode::parse("gated"), Ok(RefreshMode::Gated(RefreshGate::DEFAULT_MAX_AGE)));
        assert_eq!(RefreshMode::parse("gated:1s"), Ok(RefreshMode::Gated(Duration::from_secs(1))));
        assert_eq!(RefreshMode::parse("always"), Ok(RefreshMode::Always));
        assert_eq!(RefreshMode::parse("never"), Ok(RefreshMode::Never));
        assert!(RefreshMode::parse("sometimes").is_err());
    }
}
