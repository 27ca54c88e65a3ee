//! The only `unsafe` code in gpubudget: six NVML entry points resolved by name from `libnvidia-ml.so.1`
//! (`nvmlInit_v2`, `nvmlShutdown`, `nvmlSystemGetDriverVersion`, `nvmlDeviceGetHandleByUUID` and, where the
//! driver has them, `nvmlDeviceGetMemoryLimits_v1` and `nvmlDeviceSetMemoryLimits_v1`).
//!
//! Why FFI at all: nvml-wrapper (0.13, and nvml-wrapper-sys under it) was generated from NVML headers older
//! than driver R615 and binds neither `nvmlDeviceGetMemoryLimits_v1` nor `nvmlDeviceSetMemoryLimits_v1`. They
//! are resolved here at run time, so a driver without them (R580 on our H100) is an answer
//! ([`Unavailable::Symbol`](crate::Unavailable::Symbol)), not a load failure of the agent.
//!
//! The layout is the CUDA 13.4 `nvml.h` one (cuda-nvml-dev 13.4.92):
//! `typedef struct { const char* nameSpace; unsigned long long softLimit, hardLimit, currentUsed; }
//! nvmlGetMemoryLimits_v1_t;` — 32 bytes on x86-64, no version field — and the setter's
//! `typedef struct { const char* nameSpace; unsigned long long softLimit, hardLimit; } nvmlSetMemoryLimits_v1_t;`
//! — 24 bytes. `nameSpace` is the cgroup's full sysfs path. The setter is called only by an agent run with
//! `--apply-driver-limits` (the container toolkit's hook sets limits otherwise, from the environment the
//! admission webhook sets); it needs root.

#![allow(unsafe_code)]

use std::ffi::{CStr, CString, OsStr, c_char, c_int, c_uint, c_void};

use libloading::Library;

/// `nvmlReturn_t`.
pub(crate) type Return = c_int;
pub(crate) const SUCCESS: Return = 0;
/// `NVML_ERROR_FUNCTION_NOT_FOUND`: what a call into an entry point the library lacks answers.
pub(crate) const FUNCTION_NOT_FOUND: Return = 13;
/// The getter's name in the library.
pub(crate) const GET_MEMORY_LIMITS: &str = "nvmlDeviceGetMemoryLimits_v1";
/// The setter's name in the library.
pub(crate) const SET_MEMORY_LIMITS: &str = "nvmlDeviceSetMemoryLimits_v1";

type Device = *mut c_void;

#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub(crate) struct GetMemoryLimits {
    name_space: *const c_char,
    pub(crate) soft_limit: u64,
    pub(crate) hard_limit: u64,
    pub(crate) current_used: u64,
}

#[repr(C)]
#[derive(Debug, Clone, Copy)]
struct SetMemoryLimits {
    name_space: *const c_char,
    soft_limit: u64,
    hard_limit: u64,
}

type InitFn = unsafe extern "C" fn() -> Return;
type ShutdownFn = unsafe extern "C" fn() -> Return;
type VersionFn = unsafe extern "C" fn(*mut c_char, c_uint) -> Return;
type HandleByUuidFn = unsafe extern "C" fn(*const c_char, *mut Device) -> Return;
type GetMemoryLimitsFn = unsafe extern "C" fn(Device, *mut GetMemoryLimits) -> Return;
type SetMemoryLimitsFn = unsafe extern "C" fn(Device, *mut SetMemoryLimits) -> Return;

/// What could not be resolved.
#[derive(Debug)]
pub(crate) enum OpenError {
    Library(String),
    /// A call every NVML has (init, shutdown, version, device by UUID): not an NVIDIA library.
    Symbol(&'static str),
    Init(Return),
}

/// The library, initialised once more (NVML counts `nvmlInit_v2` calls: this one is matched by the
/// `nvmlShutdown` in `Drop`, so nvml-wrapper's own handle is untouched), and the entry points. The getter is
/// `None` on drivers before R615: the library still opens, so its driver version can be told.
pub(crate) struct Nvml {
    shutdown: ShutdownFn,
    version: VersionFn,
    handle_by_uuid: HandleByUuidFn,
    get_memory_limits: Option<GetMemoryLimitsFn>,
    set_memory_limits: Option<SetMemoryLimitsFn>,
    // Keeps the code behind the function pointers above mapped; dropped after `Drop::drop` ran.
    _library: Library,
}

impl std::fmt::Debug for Nvml {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Nvml")
    }
}

/// A symbol's address as `T`, copied out of the library (valid while the library is loaded).
///
/// # Safety
/// `T` must be the symbol's real function type.
unsafe fn symbol<T: Copy>(library: &Library, name: &'static str) -> Result<T, OpenError> {
    let mut c_name = name.as_bytes().to_vec();
    c_name.push(0);
    // SAFETY: the caller names the type; the value is copied out while `library` is alive, and `Nvml` keeps the
    // library loaded for as long as it holds the pointer.
    unsafe { library.get::<T>(&c_name).map(|s| *s).map_err(|_| OpenError::Symbol(name)) }
}

impl Nvml {
    pub(crate) fn open(path: &OsStr) -> Result<Self, OpenError> {
        // SAFETY: loading libnvidia-ml runs its initialisers, which NVIDIA's library (and the test stand-in)
        // keep free of side effects beyond its own state; nvml-wrapper loads the same library the same way.
        let library = unsafe { Library::new(path) }.map_err(|e| OpenError::Library(e.to_string()))?;
        // SAFETY: the types are those of nvml.h (CUDA 13.4) for these names.
        let (init, shutdown, version, handle_by_uuid) = unsafe {
            (
                symbol::<InitFn>(&library, "nvmlInit_v2")?,
                symbol::<ShutdownFn>(&library, "nvmlShutdown")?,
                symbol::<VersionFn>(&library, "nvmlSystemGetDriverVersion")?,
                symbol::<HandleByUuidFn>(&library, "nvmlDeviceGetHandleByUUID")?,
            )
        };
        // SAFETY: as above; absent before driver R615, which is an answer, not an error.
        let get_memory_limits = unsafe { symbol::<GetMemoryLimitsFn>(&library, GET_MEMORY_LIMITS) }.ok();
        // SAFETY: as above.
        let set_memory_limits = unsafe { symbol::<SetMemoryLimitsFn>(&library, SET_MEMORY_LIMITS) }.ok();
        // SAFETY: nvmlInit_v2 takes no arguments and may be called any number of times.
        let code = unsafe { init() };
        if code != SUCCESS {
            return Err(OpenError::Init(code));
        }
        Ok(Self { shutdown, version, handle_by_uuid, get_memory_limits, set_memory_limits, _library: library })
    }

    /// Whether the library has `nvmlDeviceGetMemoryLimits_v1` (driver R615 or newer).
    pub(crate) fn has_memory_limits(&self) -> bool {
        self.get_memory_limits.is_some()
    }

    /// Whether the library has `nvmlDeviceSetMemoryLimits_v1`.
    pub(crate) fn has_setter(&self) -> bool {
        self.set_memory_limits.is_some()
    }

    /// `nvmlDeviceGetHandleByUUID`.
    fn device(&self, uuid: &CString) -> Result<Device, (&'static str, Return)> {
        let mut device: Device = std::ptr::null_mut();
        // SAFETY: a NUL-terminated string and a pointer to a handle NVML fills in.
        let code = unsafe { (self.handle_by_uuid)(uuid.as_ptr(), &mut device) };
        if code != SUCCESS {
            return Err(("nvmlDeviceGetHandleByUUID", code));
        }
        Ok(device)
    }

    /// `nvmlDeviceGetHandleByUUID` then `nvmlDeviceSetMemoryLimits_v1`: the call's name and code on failure.
    pub(crate) fn set_memory_limits(
        &self,
        uuid: &CString,
        cgroup: &CString,
        soft: u64,
        hard: u64,
    ) -> Result<(), (&'static str, Return)> {
        let device = self.device(uuid)?;
        let Some(set_memory_limits) = self.set_memory_limits else {
            return Err((SET_MEMORY_LIMITS, FUNCTION_NOT_FOUND));
        };
        let mut limits = SetMemoryLimits { name_space: cgroup.as_ptr(), soft_limit: soft, hard_limit: hard };
        // SAFETY: `device` came from NVML; `limits` has the header's layout, and `cgroup` outlives the call.
        let code = unsafe { set_memory_limits(device, &mut limits) };
        if code != SUCCESS {
            return Err((SET_MEMORY_LIMITS, code));
        }
        Ok(())
    }

    /// `nvmlSystemGetDriverVersion`.
    pub(crate) fn driver_version(&self) -> Option<String> {
        let mut buffer = [0 as c_char; 96];
        // SAFETY: the buffer and its length are passed together; NVML writes a NUL-terminated string into it.
        let code = unsafe { (self.version)(buffer.as_mut_ptr(), buffer.len() as c_uint) };
        if code != SUCCESS {
            return None;
        }
        buffer[buffer.len() - 1] = 0;
        // SAFETY: NUL-terminated (the last byte is forced to 0 above), and the buffer outlives the borrow.
        Some(unsafe { CStr::from_ptr(buffer.as_ptr()) }.to_string_lossy().into_owned())
    }

    /// `nvmlDeviceGetHandleByUUID` then `nvmlDeviceGetMemoryLimits_v1`: the call's name and code on failure.
    pub(crate) fn memory_limits(
        &self,
        uuid: &CString,
        cgroup: &CString,
    ) -> Result<GetMemoryLimits, (&'static str, Return)> {
        let device = self.device(uuid)?;
        let Some(get_memory_limits) = self.get_memory_limits else {
            return Err((GET_MEMORY_LIMITS, FUNCTION_NOT_FOUND));
        };
        let mut limits = GetMemoryLimits { name_space: cgroup.as_ptr(), soft_limit: 0, hard_limit: 0, current_used: 0 };
        // SAFETY: `device` came from NVML; `limits` has the header's layout, and `cgroup` outlives the call.
        let code = unsafe { get_memory_limits(device, &mut limits) };
        if code != SUCCESS {
            return Err((GET_MEMORY_LIMITS, code));
        }
        Ok(limits)
    }
}

impl Drop for Nvml {
    fn drop(&mut self) {
        // SAFETY: one nvmlShutdown for the one successful nvmlInit_v2 of `open`.
        unsafe { (self.shutdown)() };
    }
}

// SAFETY: NVML's entry points are thread-safe (NVIDIA's documentation: "all NVML functions are thread-safe"),
// and the struct holds only function pointers and the library handle.
unsafe impl Send for Nvml {}
// SAFETY: as above: `&Nvml` only calls thread-safe NVML functions.
unsafe impl Sync for Nvml {}

#[cfg(test)]
mod tests {
    #[test]
    fn the_getter_struct_has_the_headers_layout() {
        // nvml.h (CUDA 13.4): a pointer and three unsigned long long, 32 bytes on a 64-bit target.
        assert_eq!(std::mem::size_of::<super::GetMemoryLimits>(), 8 + 3 * 8);
        assert_eq!(std::mem::align_of::<super::GetMemoryLimits>(), 8);
        // The setter's: a pointer and two unsigned long long, 24 bytes.
        assert_eq!(std::mem::size_of::<super::SetMemoryLimits>(), 8 + 2 * 8);
    }
}
