//! What the GPUs hold, per process: sampled from NVML ([`nvml::NvmlSampler`]) or replayed from a sample
//! file ([`file::RecordedSampler`]).

pub mod file;
pub mod nvml;

use std::sync::Arc;
use std::time::{Duration, Instant};

/// The agent's monotonic clock, for every timer its decisions and retries keep (`overLimitSeconds`, backoffs):
/// tokio's. In the agent it reads `std::time::Instant::now()`; a test on tokio's paused clock
/// (`#[tokio::test(start_paused = true)]`) controls it, so the timers run without wall-clock waits. (Durations
/// measured for metrics, such as a sample's cost, stay on `std::time::Instant`.)
pub fn monotonic_now() -> Instant {
    tokio::time::Instant::now().into_std()
}

/// One GPU, or one MIG instance of a GPU: the unit processes are reported on.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct GpuInfo {
    /// NVML index of the physical GPU.
    pub index: u32,
    /// MIG device index on that GPU, for a MIG instance.
    pub mig: Option<u32>,
    /// `GPU-…` or `MIG-…`.
    pub uuid: String,
    /// Product name.
    pub name: String,
    /// Memory of the GPU or instance, bytes.
    pub total_bytes: u64,
    /// The `gpu` label in metrics and tables: `0`, or `0/mig1` for a MIG instance.
    pub label: String,
}

impl GpuInfo {
    /// A GPU's or MIG instance's label.
    pub fn label_for(index: u32, mig: Option<u32>) -> String {
        match mig {
            Some(m) => format!("{index}/mig{m}"),
            None => index.to_string(),
        }
    }
}

/// A pod named directly by a sample file (replay on a cluster without GPUs), instead of through `/proc`.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum PodKey {
    /// By UID.
    Uid(String),
    /// By namespace and name.
    Name {
        /// Namespace.
        namespace: String,
        /// Name.
        name: String,
    },
}

/// The owner of a replayed process, as the sample file names it.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct DirectOwner {
    /// The pod.
    pub pod: PodKey,
    /// Container name, if given.
    pub container: Option<String>,
    /// Container ID (without the runtime scheme), if given.
    pub container_id: Option<String>,
}

/// One process's memory on one GPU.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProcessSample {
    /// Index into [`Snapshot::gpus`].
    pub gpu: usize,
    /// Host PID (absent for replayed entries that name their pod).
    pub pid: Option<u32>,
    /// Bytes NVML reports for the process on that GPU; `None` where NVML says the figure is unavailable
    /// (counted per GPU in [`GpuReading::unavailable`], never taken as 0 bytes of a budget silently).
    pub bytes: Option<u64>,
    /// Set when a sample file names the pod itself.
    pub direct: Option<Arc<DirectOwner>>,
    /// Whether the process is a client of the GPU's MPS server: `Some(true)` on NVML's MPS list, `Some(false)`
    /// when the list was read after the process appeared and it was not on it, `None` when not known (the
    /// unit answers no MPS list, or a sample file does not say). A process that is no client is not held by
    /// an MPS cap, whatever its environment says (#32).
    pub mps_client: Option<bool>,
}

impl ProcessSample {
    /// The bytes to charge: the figure, or 0 where NVML has none (such a process is counted apart and
    /// never makes a pod look over).
    pub fn charged(&self) -> u64 {
        self.bytes.unwrap_or(0)
    }
}

/// The device's own figures for a GPU (`memory_info`). `used` leaves out the driver's reserve (about
/// 480 MiB on an H100, driver 580), so `used + free` is a little less than the total.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DeviceMemory {
    /// Bytes in use by processes and the driver's allocations for them.
    pub used: u64,
    /// Bytes free.
    pub free: u64,
}

impl DeviceMemory {
    /// Figures from a device that reports only its used bytes (a sample file): free is the rest.
    pub fn from_used(used: u64, total: u64) -> Self {
        Self { used, free: total.saturating_sub(used) }
    }
}

/// Whether a GPU was sampled this tick.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub enum GpuHealth {
    /// Sampled: its processes are in the snapshot.
    #[default]
    Sampled,
    /// Its last attempt failed (or it is waiting for its retry): the snapshot holds none of its processes
    /// and no figure of it, so nothing is decided from it.
    Failed {
        /// The last error.
        error: SampleError,
        /// Failed attempts in a row.
        failures: u32,
    },
}

impl GpuHealth {
    /// Whether the GPU was sampled.
    pub fn sampled(&self) -> bool {
        matches!(self, Self::Sampled)
    }
}

/// What one GPU's sample found besides its processes (same index as [`Snapshot::gpus`]).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct GpuReading {
    /// Sampled or failed.
    pub health: GpuHealth,
    /// The device's figures, when the sampler knows them (a sample file may not say).
    pub memory: Option<DeviceMemory>,
    /// Processes listed whose memory NVML reports as unavailable.
    pub unavailable: u32,
    /// Processes listed by NVML's MPS query (clients of an MPS server).
    pub mps_clients: u32,
}

impl GpuReading {
    /// A sampled GPU with these figures.
    pub fn sampled(memory: Option<DeviceMemory>) -> Self {
        Self { memory, ..Self::default() }
    }

    /// A failed GPU.
    pub fn failed(error: SampleError, failures: u32) -> Self {
        Self { health: GpuHealth::Failed { error, failures }, ..Self::default() }
    }
}

/// One sample of every GPU. Reused from tick to tick: samplers clear and refill it.
#[derive(Debug, Clone, Default)]
pub struct Snapshot {
    /// GPUs and MIG instances, failed ones included.
    pub gpus: Vec<GpuInfo>,
    /// Processes of the sampled GPUs, in GPU order.
    pub processes: Vec<ProcessSample>,
    /// Per GPU (same indexes as `gpus`): health and the device's figures.
    pub readings: Vec<GpuReading>,
}

impl Snapshot {
    /// The GPUs sampled this tick: where budgets and pressure are enforced.
    pub fn sampled_gpus(&self) -> usize {
        self.readings.iter().filter(|r| r.health.sampled()).count()
    }

    /// The device's figures for GPU `gpu`, when it was sampled and they are known.
    pub fn memory(&self, gpu: usize) -> Option<DeviceMemory> {
        self.readings.get(gpu).filter(|r| r.health.sampled()).and_then(|r| r.memory)
    }
}

/// The sampling call that failed: an NVML call as nvml-wrapper names it, or the sample file's reading. Its
/// `as_str` is the `call` label of `gpubudget_nvml_errors_total` and starts an error's message.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Call {
    /// `init`.
    Init,
    /// `device_count`.
    DeviceCount,
    /// `device_by_index`.
    DeviceByIndex,
    /// `uuid`.
    Uuid,
    /// `memory_info`.
    MemoryInfo,
    /// `mig_device_count`.
    MigDeviceCount,
    /// `mig_device_by_index`.
    MigDeviceByIndex,
    /// `running_compute_processes`.
    RunningComputeProcesses,
    /// `running_graphics_processes`.
    RunningGraphicsProcesses,
    /// `mps_running_compute_processes`.
    MpsRunningComputeProcesses,
    /// `memory_limits`: the driver's per-cgroup limits (`--apply-driver-limits`).
    MemoryLimits,
    /// `sample_file`: a GPU the sample file says failed.
    SampleFile,
    /// `read_sample_file`.
    ReadSampleFile,
}

impl Call {
    /// The call's name.
    pub fn as_str(self) -> &'static str {
        match self {
            Call::Init => "init",
            Call::DeviceCount => "device_count",
            Call::DeviceByIndex => "device_by_index",
            Call::Uuid => "uuid",
            Call::MemoryInfo => "memory_info",
            Call::MigDeviceCount => "mig_device_count",
            Call::MigDeviceByIndex => "mig_device_by_index",
            Call::RunningComputeProcesses => "running_compute_processes",
            Call::RunningGraphicsProcesses => "running_graphics_processes",
            Call::MpsRunningComputeProcesses => "mps_running_compute_processes",
            Call::MemoryLimits => "memory_limits",
            Call::SampleFile => "sample_file",
            Call::ReadSampleFile => "read_sample_file",
        }
    }
}

gpubudget_daemon::label_values!(Call);

/// A failed sampling call, named after the NVML call.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{}: {message}", call.as_str())]
pub struct SampleError {
    /// The call that failed.
    pub call: Call,
    /// What it said.
    pub message: String,
    /// The sampler cannot recover by itself (NVML must be initialised again).
    pub fatal: bool,
}

impl SampleError {
    /// An error of `call`.
    pub fn new(call: Call, message: impl std::fmt::Display) -> Self {
        Self { call, message: message.to_string(), fatal: false }
    }

    /// Marks it as needing a new sampler.
    pub fn fatal(mut self) -> Self {
        self.fatal = true;
        self
    }
}

/// A source of GPU memory samples.
pub trait Sampler: Send + std::fmt::Debug {
    /// Refills `out` with the current usage. On error `out` is left in an unspecified state and must not
    /// be used.
    fn sample(&mut self, out: &mut Snapshot) -> Result<(), SampleError>;

    /// Where samples come from, for logs (`nvml`, `file:/path`).
    fn source(&self) -> String;
}

/// Exponential backoff between retries (0.5 s doubling to 30 s): the sampler's when NVML is down, each
/// GPU's when only that GPU fails.
#[derive(Debug, Clone)]
pub struct Backoff {
    next_try: Option<Instant>,
    delay: Duration,
}

impl Default for Backoff {
    fn default() -> Self {
        Self { next_try: None, delay: Self::MIN }
    }
}

impl Backoff {
    /// First retry delay.
    pub const MIN: Duration = Duration::from_millis(500);
    /// Longest retry delay.
    pub const MAX: Duration = Duration::from_secs(30);

    /// Whether a try is due at `now` (always, until a failure).
    pub fn due(&self, now: Instant) -> bool {
        self.next_try.is_none_or(|at| now >= at)
    }

    /// Records a failure at `now`; returns the delay until the next try.
    pub fn failed(&mut self, now: Instant) -> Duration {
        let delay = self.delay;
        self.next_try = Some(now + delay);
        self.delay = (delay * 2).min(Self::MAX);
        delay
    }

    /// Records a success: the next failure waits [`Self::MIN`] again.
    pub fn reset(&mut self) {
        *self = Self::default();
    }
}

/// Makes a sampler; called again, with backoff, after the sampler fails.
pub type SamplerFactory = Box<dyn FnMut() -> Result<Box<dyn Sampler>, SampleError> + Send>;

/// A sampler that is rebuilt with exponential backoff when it cannot be made or keeps failing (NVML not
/// loaded yet, a driver upgrade, a GPU falling off the bus). While it is down, no sample is produced, so
/// nothing is enforced: a failure can delay an eviction, never cause one.
pub struct SamplerSlot {
    factory: SamplerFactory,
    current: Option<Box<dyn Sampler>>,
    backoff: Backoff,
    consecutive_failures: u32,
    last_error: Option<SampleError>,
}

impl std::fmt::Debug for SamplerSlot {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SamplerSlot")
            .field("current", &self.current)
            .field("consecutive_failures", &self.consecutive_failures)
            .field("last_error", &self.last_error)
            .finish_non_exhaustive()
    }
}

/// What one attempt to sample gave.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SlotOutcome {
    /// `out` holds a fresh sample.
    Sampled,
    /// Failed; the error is to be counted and logged.
    Failed(SampleError),
    /// Down and waiting for the next retry.
    Waiting,
}

impl SamplerSlot {
    /// Failed samples in a row after which the sampler is rebuilt.
    pub const REBUILD_AFTER: u32 = 3;

    /// A slot that builds its sampler with `factory` (first attempt on the first [`Self::sample`]).
    pub fn new(factory: SamplerFactory) -> Self {
        Self { factory, current: None, backoff: Backoff::default(), consecutive_failures: 0, last_error: None }
    }

    /// Whether the last attempt sampled successfully.
    pub fn healthy(&self) -> bool {
        self.current.is_some() && self.consecutive_failures == 0
    }

    /// The last error, while unhealthy.
    pub fn last_error(&self) -> Option<&SampleError> {
        self.last_error.as_ref()
    }

    /// The current sampler's source, if one is up.
    pub fn source(&self) -> Option<String> {
        self.current.as_ref().map(|s| s.source())
    }

    /// Samples into `out`, building the sampler first if it is down and its retry is due.
    pub fn sample(&mut self, now: Instant, out: &mut Snapshot) -> SlotOutcome {
        if self.current.is_none() {
            if !self.backoff.due(now) {
                return SlotOutcome::Waiting;
            }
            match (self.factory)() {
                Ok(sampler) => {
                    tracing::info!(source = %sampler.source(), "GPU sampler is up");
                    self.current = Some(sampler);
                }
                Err(error) => return self.fail(now, error, true),
            }
        }
        let Some(sampler) = self.current.as_mut() else { return SlotOutcome::Waiting };
        match sampler.sample(out) {
            Ok(()) => {
                if self.consecutive_failures > 0 || self.last_error.is_some() {
                    tracing::info!("GPU sampling recovered");
                }
                self.consecutive_failures = 0;
                self.backoff.reset();
                self.last_error = None;
                SlotOutcome::Sampled
            }
            Err(error) => {
                let rebuild = error.fatal || self.consecutive_failures + 1 >= Self::REBUILD_AFTER;
                self.fail(now, error, rebuild)
            }
        }
    }

    fn fail(&mut self, now: Instant, error: SampleError, rebuild: bool) -> SlotOutcome {
        self.consecutive_failures = self.consecutive_failures.saturating_add(1);
        if rebuild {
            self.current = None;
            let retry_in = self.backoff.failed(now);
            tracing::warn!(%error, ?retry_in, "GPU sampler down; nothing is enforced until it is back");
        } else {
            tracing::warn!(%error, "GPU sample failed; this tick is skipped");
        }
        self.last_error = Some(error.clone());
        SlotOutcome::Failed(error)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Mutex;

    #[derive(Debug)]
    struct Scripted(Arc<Mutex<Vec<Result<(), SampleError>>>>);

    impl Sampler for Scripted {
        fn sample(&mut self, out: &mut Snapshot) -> Result<(), SampleError> {
            out.processes.clear();
            self.0.lock().expect("lock").pop().unwrap_or(Ok(()))
        }
        fn source(&self) -> String {
            "scripted".into()
        }
    }

    #[test]
    fn rebuilds_with_backoff_and_recovers() {
        let script = Arc::new(Mutex::new(Vec::new()));
        let builds =
            Arc::new(Mutex::new(vec![Ok(()), Err(SampleError::new(Call::Init, "NVML_ERROR_LIBRARY_NOT_FOUND"))]));
        let (s, b) = (script.clone(), builds.clone());
        let mut slot = SamplerSlot::new(Box::new(move || match b.lock().expect("lock").pop() {
            Some(Ok(())) | None => Ok(Box::new(Scripted(s.clone())) as Box<dyn Sampler>),
            Some(Err(e)) => Err(e),
        }));
        let mut out = Snapshot::default();
        let t0 = Instant::now();
        assert!(matches!(slot.sample(t0, &mut out), SlotOutcome::Failed(e) if e.call == Call::Init));
        assert!(!slot.healthy());
        assert_eq!(slot.sample(t0 + Duration::from_millis(100), &mut out), SlotOutcome::Waiting);
        assert_eq!(slot.sample(t0 + Backoff::MIN, &mut out), SlotOutcome::Sampled);
        assert!(slot.healthy());

        // Three failures in a row rebuild the sampler.
        *script.lock().expect("lock") = vec![
            Err(SampleError::new(Call::RunningComputeProcesses, "GPU lost")),
            Err(SampleError::new(Call::RunningComputeProcesses, "GPU lost")),
            Err(SampleError::new(Call::RunningComputeProcesses, "GPU lost")),
        ];
        let t1 = t0 + Duration::from_secs(10);
        for _ in 0..3 {
            assert!(matches!(slot.sample(t1, &mut out), SlotOutcome::Failed(_)));
        }
        assert_eq!(slot.sample(t1, &mut out), SlotOutcome::Waiting);
        assert_eq!(slot.sample(t1 + Backoff::MIN, &mut out), SlotOutcome::Sampled);
    }
}
