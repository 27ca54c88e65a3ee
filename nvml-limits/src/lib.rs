//! The NVIDIA driver's per-cgroup GPU memory limits, read back.
//!
//! From driver R615 (CUDA 13.4, "MPS v3 memory partitioning") a cgroup v2 can carry a soft and a hard GPU
//! memory limit per GPU, enforced by the driver; nvidia-container-toolkit's `apply-cuda-memory-limits` hook
//! sets them from a container's `NVIDIA_GPU_MEMORY_REQUEST` / `NVIDIA_GPU_MEMORY_LIMIT`. gpubudget reads them
//! back (`nvmlDeviceGetMemoryLimits_v1`) to show them beside the budget and to say when the two disagree, and,
//! where the administrator opts in (`--apply-driver-limits`), sets them (`nvmlDeviceSetMemoryLimits_v1`,
//! [`DriverLimits::set`]) on a capped pod's container cgroup that has none or a larger one. On drivers without
//! the calls, [`DriverLimits::open`] answers [`Unavailable::Symbol`] and the agent carries on with eviction
//! alone.
//!
//! All `unsafe` lives in the one private module `ffi` (the reason is written there).

mod ffi;

use std::ffi::{CString, OsStr};
use std::path::Path;

/// The library the NVIDIA container runtime mounts into GPU pods.
pub const LIBRARY: &str = "libnvidia-ml.so.1";

/// `NVML_ERROR_NOT_SUPPORTED`.
const NOT_SUPPORTED: i32 = 3;
/// `NVML_ERROR_NOT_FOUND`.
const NOT_FOUND: i32 = 6;

/// Why the driver's limits cannot be read on this node.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Unavailable {
    /// `libnvidia-ml.so.1` could not be loaded (no NVIDIA driver here).
    #[error("NVML could not be loaded: {0}")]
    Library(String),
    /// The library lacks an entry point: `nvmlDeviceGetMemoryLimits_v1` is new in driver R615.
    #[error("{symbol} is not in this driver's NVML (driver {driver}; per-cgroup memory limits need R615 or newer)")]
    Symbol {
        /// The missing entry point.
        symbol: &'static str,
        /// The driver's version, as NVML reports it ("unknown" when that failed too).
        driver: String,
    },
    /// `nvmlInit_v2` failed with this `nvmlReturn_t`.
    #[error("nvmlInit_v2 failed (nvmlReturn_t {0})")]
    Init(i32),
}

/// A call that failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ReadError {
    /// A GPU UUID or cgroup path with a NUL byte in it.
    #[error("{0} contains a NUL byte")]
    Nul(&'static str),
    /// NVML answered with an error (`nvmlReturn_t`).
    #[error("{call} failed (nvmlReturn_t {code})")]
    Nvml {
        /// The entry point.
        call: &'static str,
        /// Its return code.
        code: i32,
    },
}

/// A set that failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SetError {
    /// A GPU UUID or cgroup path with a NUL byte in it, or a soft limit above the hard one: refused before any
    /// call.
    #[error("{0}")]
    Invalid(&'static str),
    /// NVML answered with an error (`nvmlReturn_t`; 4, `NVML_ERROR_NO_PERMISSION`: the caller is not root).
    #[error("{call} failed (nvmlReturn_t {code})")]
    Nvml {
        /// The entry point.
        call: &'static str,
        /// Its return code.
        code: i32,
    },
}

/// The limits the driver holds for a cgroup on one GPU, and what the cgroup uses there (bytes).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Soft limit: past it, a client is a candidate for the driver's eviction under memory pressure. 0: none.
    pub soft: u64,
    /// Hard limit: an allocation past it fails. `u64::MAX`: none.
    pub hard: u64,
    /// GPU memory the cgroup uses now.
    pub used: u64,
}

impl Limits {
    /// The soft limit, if one is set.
    pub fn soft_limit(&self) -> Option<u64> {
        (self.soft != 0).then_some(self.soft)
    }

    /// The hard limit, if one is set.
    pub fn hard_limit(&self) -> Option<u64> {
        (self.hard != u64::MAX).then_some(self.hard)
    }
}

/// What the driver says of one cgroup on one GPU.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reading {
    /// Limits are set (one of them may still be "none": see [`Limits`]).
    Set(Limits),
    /// No limit applies to the cgroup (`NVML_ERROR_NOT_FOUND`).
    NotSet,
    /// The driver does not partition this GPU or cgroup (`NVML_ERROR_NOT_SUPPORTED`: MIG, no cgroup v2, or,
    /// with the driver's misc backend, no limit anywhere above the cgroup).
    NotSupported,
}

/// NVML with the limit calls resolved.
#[derive(Debug)]
pub struct DriverLimits {
    nvml: ffi::Nvml,
}

impl DriverLimits {
    /// The node's NVML ([`LIBRARY`]).
    pub fn open() -> Result<Self, Unavailable> {
        Self::open_at(OsStr::new(LIBRARY))
    }

    /// NVML from this file (a stand-in library in tests).
    pub fn open_at(library: &OsStr) -> Result<Self, Unavailable> {
        let nvml = ffi::Nvml::open(library).map_err(|e| match e {
            ffi::OpenError::Library(e) => Unavailable::Library(e),
            ffi::OpenError::Init(code) => Unavailable::Init(code),
            ffi::OpenError::Symbol(symbol) => Unavailable::Symbol { symbol, driver: "unknown".to_owned() },
        })?;
        if !nvml.has_memory_limits() {
            // The library is initialised: its version names the driver in the message (dropping `nvml` shuts
            // it down again).
            let driver = nvml.driver_version().unwrap_or_else(|| "unknown".to_owned());
            return Err(Unavailable::Symbol { symbol: ffi::GET_MEMORY_LIMITS, driver });
        }
        Ok(Self { nvml })
    }

    /// The driver's version.
    pub fn driver_version(&self) -> Option<String> {
        self.nvml.driver_version()
    }

    /// Whether this driver can set limits too (`nvmlDeviceSetMemoryLimits_v1`).
    pub fn can_set(&self) -> bool {
        self.nvml.has_setter()
    }

    /// Sets the soft and hard limits (bytes; soft 0: none) on GPU `gpu_uuid` for the cgroup at `cgroup`. Needs
    /// root. The caller reads them back ([`Self::read`]) before it says they hold.
    pub fn set(&self, gpu_uuid: &str, cgroup: &Path, soft: u64, hard: u64) -> Result<(), SetError> {
        if soft > hard {
            return Err(SetError::Invalid("a soft limit above the hard one"));
        }
        let uuid = CString::new(gpu_uuid).map_err(|_| SetError::Invalid("the GPU UUID contains a NUL byte"))?;
        let path = CString::new(cgroup.as_os_str().as_encoded_bytes())
            .map_err(|_| SetError::Invalid("the cgroup path contains a NUL byte"))?;
        self.nvml.set_memory_limits(&uuid, &path, soft, hard).map_err(|(call, code)| SetError::Nvml { call, code })
    }

    /// The limits on GPU `gpu_uuid` for the cgroup at `cgroup` (its full sysfs path, such as
    /// `/sys/fs/cgroup/kubepods.slice/…/cri-containerd-<id>.scope`).
    pub fn read(&self, gpu_uuid: &str, cgroup: &Path) -> Result<Reading, ReadError> {
        let uuid = CString::new(gpu_uuid).map_err(|_| ReadError::Nul("GPU UUID"))?;
        let path = CString::new(cgroup.as_os_str().as_encoded_bytes()).map_err(|_| ReadError::Nul("cgroup path"))?;
        match self.nvml.memory_limits(&uuid, &path) {
            Ok(l) => Ok(Reading::Set(Limits { soft: l.soft_limit, hard: l.hard_limit, used: l.current_used })),
            Err((ffi::GET_MEMORY_LIMITS, NOT_FOUND)) => Ok(Reading::NotSet),
            Err((ffi::GET_MEMORY_LIMITS, NOT_SUPPORTED)) => Ok(Reading::NotSupported),
            Err((call, code)) => Err(ReadError::Nvml { call, code }),
        }
    }
}
