//! [`Backend`] on nvml-wrapper: the only place that calls NVML.

use nvml_wrapper::Nvml;
use nvml_wrapper::enums::device::UsedGpuMemory;
use nvml_wrapper::error::NvmlError;
use nvml_wrapper::{Device, struct_wrappers::device::ProcessInfo};

use super::{Backend, Listed, ProcessList};
use crate::sample::{Call, DeviceMemory, GpuInfo, SampleError};

/// NVML, loaded and initialised.
pub struct RealNvml(Nvml);

impl std::fmt::Debug for RealNvml {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("RealNvml")
    }
}

impl RealNvml {
    /// Loads `libnvidia-ml.so.1` and initialises it (about 15 ms on an H100).
    pub fn init() -> Result<Self, SampleError> {
        Nvml::init().map(Self).map_err(|e| error(Call::Init, e).fatal())
    }
}

/// An NVML error as a [`SampleError`] named after `call`. Errors that mean NVML itself is gone (not
/// initialised, the driver unloaded, the library or a symbol missing) are fatal: the whole sampler is
/// built again. Every other error, `GpuLost` included, belongs to the one GPU it came from.
pub fn error(call: Call, e: NvmlError) -> SampleError {
    let fatal = matches!(
        e,
        NvmlError::Uninitialized
            | NvmlError::DriverNotLoaded
            | NvmlError::LibraryNotFound
            | NvmlError::LibloadingError(_)
            | NvmlError::FunctionNotFound
            | NvmlError::FailedToLoadSymbol(_)
    );
    let err = SampleError::new(call, e);
    if fatal { err.fatal() } else { err }
}

fn listed(processes: Vec<ProcessInfo>) -> Vec<Listed> {
    processes
        .into_iter()
        .map(|p| Listed {
            pid: p.pid,
            bytes: match p.used_gpu_memory {
                UsedGpuMemory::Used(b) => Some(b),
                UsedGpuMemory::Unavailable => None,
            },
        })
        .collect()
}

impl Backend for RealNvml {
    type Device<'a> = Device<'a>;

    fn device_count(&self) -> Result<u32, SampleError> {
        self.0.device_count().map_err(|e| error(Call::DeviceCount, e))
    }

    fn describe(&self, index: u32) -> Result<Vec<GpuInfo>, SampleError> {
        let device = self.0.device_by_index(index).map_err(|e| error(Call::DeviceByIndex, e))?;
        let name = device.name().unwrap_or_else(|_| "unknown".into());
        if !matches!(device.mig_mode(), Ok(mode) if mode.current == 1) {
            return Ok(vec![GpuInfo {
                index,
                mig: None,
                uuid: device.uuid().map_err(|e| error(Call::Uuid, e))?,
                name,
                total_bytes: device.memory_info().map_err(|e| error(Call::MemoryInfo, e))?.total,
                label: GpuInfo::label_for(index, None),
            }]);
        }
        let slots = device.mig_device_count().map_err(|e| error(Call::MigDeviceCount, e))?;
        let mut units = Vec::new();
        for m in 0..slots {
            match device.mig_device_by_index(m) {
                Ok(mig) => units.push(GpuInfo {
                    index,
                    mig: Some(m),
                    uuid: mig.uuid().unwrap_or_default(),
                    name: name.clone(),
                    total_bytes: mig.memory_info().map(|i| i.total).unwrap_or(0),
                    label: GpuInfo::label_for(index, Some(m)),
                }),
                Err(NvmlError::NotFound) => {}
                Err(e) => return Err(error(Call::MigDeviceByIndex, e)),
            }
        }
        Ok(units)
    }

    fn device(&self, unit: &GpuInfo) -> Result<Device<'_>, SampleError> {
        let parent = self.0.device_by_index(unit.index).map_err(|e| error(Call::DeviceByIndex, e))?;
        match unit.mig {
            Some(m) => parent.mig_device_by_index(m).map_err(|e| error(Call::MigDeviceByIndex, e)),
            None => Ok(parent),
        }
    }

    fn memory(&self, device: &Device<'_>) -> Result<DeviceMemory, SampleError> {
        // nvml-wrapper reads `nvmlDeviceGetMemoryInfo_v2`: `used` leaves out the driver's reserve.
        let info = device.memory_info().map_err(|e| error(Call::MemoryInfo, e))?;
        Ok(DeviceMemory { used: info.used, free: info.free })
    }

    fn processes(&self, device: &Device<'_>, list: ProcessList) -> Result<Option<Vec<Listed>>, SampleError> {
        let result = match list {
            ProcessList::Compute => device.running_compute_processes(),
            ProcessList::Graphics => device.running_graphics_processes(),
            ProcessList::Mps => device.mps_running_compute_processes(),
        };
        match result {
            Ok(processes) => Ok(Some(listed(processes))),
            Err(NvmlError::NotSupported) if list != ProcessList::Compute => Ok(None),
            Err(e) => Err(error(list.call(), e)),
        }
    }
}
