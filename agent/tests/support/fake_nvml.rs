//! A [`Backend`] double: GPUs with processes on NVML's lists, and faults to inject (a GPU lost, one that
//! never initialises, NVML itself gone). Shared through `Arc<Mutex<_>>` so a test changes the world
//! between samples.
#![allow(dead_code)]

use std::sync::{Arc, Mutex};

use gpubudget_agent::sample::nvml::{Backend, Listed, ProcessList};
use gpubudget_agent::sample::{Call, DeviceMemory, GpuInfo, SampleError};

/// What goes wrong with a fake GPU.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    /// Every call on it fails as after an Xid 79 (`GpuLost`); describing it still works (its handle does).
    Lost,
    /// It cannot even be described (`device_by_index` fails): a GPU that never initialises.
    Undescribable,
    /// Only its MPS list fails.
    MpsListFails,
    /// The driver went away: a fatal error for the whole sampler.
    DriverGone,
}

/// One fake GPU.
#[derive(Debug, Clone, Default)]
pub struct FakeGpu {
    /// UUID.
    pub uuid: String,
    /// Memory, bytes.
    pub total: u64,
    /// Bytes in use that no list shows (the MPS server's share, an invisible process).
    pub hidden: u64,
    /// Processes and the list each is on (a PID may be on several).
    pub processes: Vec<(ProcessList, Listed)>,
    /// The MPS list is not supported on it.
    pub no_mps: bool,
    /// The fault, if any.
    pub fault: Option<Fault>,
}

impl FakeGpu {
    /// A healthy GPU of `total` bytes.
    pub fn new(uuid: &str, total: u64) -> Self {
        Self { uuid: uuid.into(), total, ..Self::default() }
    }

    /// Adds a process on `list`.
    pub fn with(mut self, list: ProcessList, pid: u32, bytes: Option<u64>) -> Self {
        self.processes.push((list, Listed { pid, bytes }));
        self
    }

    /// Used bytes as the device says: each PID once (its largest figure), plus what is hidden.
    pub fn used(&self) -> u64 {
        let mut seen: Vec<(u32, u64)> = Vec::new();
        for (_, p) in &self.processes {
            let bytes = p.bytes.unwrap_or(1 << 30);
            match seen.iter_mut().find(|(pid, _)| *pid == p.pid) {
                Some(s) => s.1 = s.1.max(bytes),
                None => seen.push((p.pid, bytes)),
            }
        }
        seen.iter().map(|(_, b)| b).sum::<u64>() + self.hidden
    }
}

/// The world the fake NVML reads, and what was asked of it.
#[derive(Debug, Default)]
pub struct World {
    /// The GPUs, by NVML index.
    pub gpus: Vec<FakeGpu>,
    /// Every call made, as `call gpu-index`.
    pub calls: Vec<String>,
}

/// The fake NVML.
#[derive(Debug, Clone, Default)]
pub struct FakeNvml(pub Arc<Mutex<World>>);

impl FakeNvml {
    /// A fake with these GPUs.
    pub fn new(gpus: Vec<FakeGpu>) -> Self {
        Self(Arc::new(Mutex::new(World { gpus, calls: Vec::new() })))
    }

    /// Changes the world.
    pub fn with<R>(&self, f: impl FnOnce(&mut World) -> R) -> R {
        f(&mut self.0.lock().expect("lock"))
    }

    /// The calls made since the last call of this, cleared.
    pub fn take_calls(&self) -> Vec<String> {
        std::mem::take(&mut self.0.lock().expect("lock").calls)
    }

    /// Logs `what` on GPU `index`; a fault fails it as NVML's `call` would.
    fn call(&self, what: &'static str, call: Call, index: u32) -> Result<FakeGpu, SampleError> {
        let mut world = self.0.lock().expect("lock");
        world.calls.push(format!("{what} {index}"));
        let gpu = world.gpus.get(index as usize).cloned().ok_or_else(|| SampleError::new(call, "Invalid Argument"))?;
        match gpu.fault {
            Some(Fault::DriverGone) => Err(SampleError::new(call, "Driver Not Loaded").fatal()),
            Some(Fault::Undescribable) => Err(SampleError::new(call, "Unknown Error")),
            Some(Fault::Lost) if what != "describe" => Err(SampleError::new(call, "GPU is lost")),
            _ => Ok(gpu),
        }
    }
}

impl Backend for FakeNvml {
    type Device<'a> = u32;

    fn device_count(&self) -> Result<u32, SampleError> {
        let world = self.0.lock().expect("lock");
        if world.gpus.iter().any(|g| g.fault == Some(Fault::DriverGone)) {
            return Err(SampleError::new(Call::DeviceCount, "Driver Not Loaded").fatal());
        }
        Ok(u32::try_from(world.gpus.len()).expect("count"))
    }

    fn describe(&self, index: u32) -> Result<Vec<GpuInfo>, SampleError> {
        let gpu = self.call("describe", Call::DeviceByIndex, index)?;
        Ok(vec![GpuInfo {
            index,
            mig: None,
            uuid: gpu.uuid,
            name: "Fake H100".into(),
            total_bytes: gpu.total,
            label: GpuInfo::label_for(index, None),
        }])
    }

    fn device(&self, unit: &GpuInfo) -> Result<u32, SampleError> {
        self.call("device_by_index", Call::DeviceByIndex, unit.index).map(|_| unit.index)
    }

    fn memory(&self, device: &u32) -> Result<DeviceMemory, SampleError> {
        let gpu = self.call("memory_info", Call::MemoryInfo, *device)?;
        let used = gpu.used();
        Ok(DeviceMemory { used, free: gpu.total.saturating_sub(used) })
    }

    fn processes(&self, device: &u32, list: ProcessList) -> Result<Option<Vec<Listed>>, SampleError> {
        let gpu = self.call(list.call().as_str(), list.call(), *device)?;
        if list == ProcessList::Mps && gpu.fault == Some(Fault::MpsListFails) {
            return Err(SampleError::new(list.call(), "Unknown Error"));
        }
        if list == ProcessList::Mps && gpu.no_mps {
            return Ok(None);
        }
        Ok(Some(gpu.processes.iter().filter(|(l, _)| *l == list).map(|(_, p)| *p).collect()))
    }
}
