//! What the GPUs hold, per process: sampled from NVML ([`nvml::NvmlSampler`]) or replayed from a sample
//! file ([`file::RecordedSampler`]).

pub mod file;
pub mod nvml;

use std::sync::Arc;
use std::time::{Duration, Instant};

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
    /// Bytes NVML reports for the process on that GPU.
    pub bytes: u64,
    /// Set when a sample file names the pod itself.
    pub direct: Option<Arc<DirectOwner>>,
}

/// One sample of every GPU. Reused from tick to tick: samplers clear and refill it.
#[derive(Debug, Clone, Default)]
pub struct Snapshot {
    /// GPUs and MIG instances.
    pub gpus: Vec<GpuInfo>,
    /// Processes, in GPU order.
    pub processes: Vec<ProcessSample>,
    /// Per GPU (same indexes as `gpus`): the bytes the device says are used (`memory_info`), when the
    /// sampler knows them (a sample file may not say). The pressure signal reads them.
    pub used: Vec<Option<u64>>,
}

/// A failed sampling call, named after the NVML call.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{call}: {message}")]
pub struct SampleError {
    /// The call that failed (`init`, `device_by_index`, `running_compute_processes`, `read_sample_file`, …).
    pub call: &'static str,
    /// What it said.
    pub message: String,
    /// The sampler cannot recover by itself (NVML must be initialised again).
    pub fatal: bool,
}

impl SampleError {
    /// An error of `call`.
    pub fn new(call: &'static str, message: impl std::fmt::Display) -> Self {
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

/// Makes a sampler; called again, with backoff, after the sampler fails.
pub type SamplerFactory = Box<dyn FnMut() -> Result<Box<dyn Sampler>, SampleError> + Send>;

/// A sampler that is rebuilt with exponential backoff when it cannot be made or keeps failing (NVML not
/// loaded yet, a driver upgrade, a GPU falling off the bus). While it is down, no sample is produced, so
/// nothing is enforced: a failure can delay an eviction, never cause one.
pub struct SamplerSlot {
    factory: SamplerFactory,
    current: Option<Box<dyn Sampler>>,
    next_try: Instant,
    backoff: Duration,
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
    /// First retry delay.
    pub const MIN_BACKOFF: Duration = Duration::from_millis(500);
    /// Longest retry delay.
    pub const MAX_BACKOFF: Duration = Duration::from_secs(30);
    /// Failed samples in a row after which the sampler is rebuilt.
    pub const REBUILD_AFTER: u32 = 3;

    /// A slot that builds its sampler with `factory` (first attempt on the first [`Self::sample`]).
    pub fn new(factory: SamplerFactory) -> Self {
        Self {
            factory,
            current: None,
            next_try: Instant::now(),
            backoff: Self::MIN_BACKOFF,
            consecutive_failures: 0,
            last_error: None,
        }
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
            if now < self.next_try {
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
                self.backoff = Self::MIN_BACKOFF;
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
            self.next_try = now + self.backoff;
            tracing::warn!(%error, retry_in = ?self.backoff, "GPU sampler down; nothing is enforced until it is back");
            self.backoff = (self.backoff * 2).min(Self::MAX_BACKOFF);
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
        let builds = Arc::new(Mutex::new(vec![Ok(()), Err(SampleError::new("init", "NVML_ERROR_LIBRARY_NOT_FOUND"))]));
        let (s, b) = (script.clone(), builds.clone());
        let mut slot = SamplerSlot::new(Box::new(move || match b.lock().expect("lock").pop() {
            Some(Ok(())) | None => Ok(Box::new(Scripted(s.clone())) as Box<dyn Sampler>),
            Some(Err(e)) => Err(e),
        }));
        let mut out = Snapshot::default();
        let t0 = Instant::now();
        assert!(matches!(slot.sample(t0, &mut out), SlotOutcome::Failed(e) if e.call == "init"));
        assert!(!slot.healthy());
        assert_eq!(slot.sample(t0 + Duration::from_millis(100), &mut out), SlotOutcome::Waiting);
        assert_eq!(slot.sample(t0 + SamplerSlot::MIN_BACKOFF, &mut out), SlotOutcome::Sampled);
        assert!(slot.healthy());

        // Three failures in a row rebuild the sampler.
        *script.lock().expect("lock") = vec![
            Err(SampleError::new("running_compute_processes", "GPU lost")),
            Err(SampleError::new("running_compute_processes", "GPU lost")),
            Err(SampleError::new("running_compute_processes", "GPU lost")),
        ];
        let t1 = t0 + Duration::from_secs(10);
        for _ in 0..3 {
            assert!(matches!(slot.sample(t1, &mut out), SlotOutcome::Failed(_)));
        }
        assert_eq!(slot.sample(t1, &mut out), SlotOutcome::Waiting);
        assert_eq!(slot.sample(t1 + SamplerSlot::MIN_BACKOFF, &mut out), SlotOutcome::Sampled);
    }
}
