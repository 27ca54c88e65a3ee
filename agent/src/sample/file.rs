//! Sample files: a node's GPU usage as JSON, written by `gpubudget-agent capture` and replayed by
//! `--sample-file` / `top --sample`.
//!
//! ```json
//! {
//!   "version": 1,
//!   "taken_at": "2026-11-21T18:00:00Z",
//!   "gpus": [
//!     {"index": 0, "uuid": "GPU-…", "name": "NVIDIA H100 80GB HBM3", "memory_total_bytes": 85520809984,
//!      "processes": [
//!        {"pid": 4242, "used_bytes": 2787115008},
//!        {"pod_uid": "5a1e3c9d-…", "container": "trainer", "used_bytes": "9Gi"},
//!        {"namespace": "team-a", "pod": "llm-0", "used_bytes": 1073741824}
//!      ],
//!      "mig": [{"index": 1, "uuid": "MIG-…", "memory_total_bytes": 10200547328, "processes": []}]}
//!   ]
//! }
//! ```
//!
//! A process entry with a `pid` is attributed through `/proc` as usual. One that names its pod
//! (`pod_uid`, or `namespace` + `pod`; optionally `container` by name or `container_id`) is charged to
//! that pod directly, so a cluster without GPUs can replay usage for real pods. `used_bytes` is an
//! integer or a Kubernetes quantity. `"mps_client": true|false` says whether NVML listed the process as a
//! client of the GPU's MPS server (`capture` writes it where it read the MPS list). The file is re-read when its modification time, size or inode
//! changes (a ConfigMap update swaps a symlink), and only then.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::SystemTime;

use serde::{Deserialize, Deserializer, Serialize};

use super::{
    Call, DeviceMemory, DirectOwner, GpuHealth, GpuInfo, GpuReading, PodKey, ProcessSample, SampleError, Sampler,
    Snapshot,
};

/// A sample file.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct SampleFile {
    /// Format version (1).
    #[serde(default = "version_one")]
    pub version: u32,
    /// When the sample was taken (RFC 3339).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub taken_at: Option<String>,
    /// Host it was taken on.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host: Option<String>,
    /// The GPUs.
    #[serde(default)]
    pub gpus: Vec<SampleGpu>,
}

fn version_one() -> u32 {
    1
}

/// A GPU in a sample file.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct SampleGpu {
    /// NVML index.
    pub index: u32,
    /// `GPU-…`.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub uuid: String,
    /// Product name.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub name: String,
    /// Memory of the GPU, bytes.
    #[serde(default, deserialize_with = "bytes")]
    pub memory_total_bytes: u64,
    /// Memory the device says is used (`memory_info`), bytes; absent: unknown (no pressure signal).
    #[serde(default, skip_serializing_if = "Option::is_none", deserialize_with = "opt_bytes")]
    pub memory_used_bytes: Option<u64>,
    /// Processes on the whole GPU (MIG disabled).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub processes: Vec<SampleProcess>,
    /// MIG instances (MIG enabled).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub mig: Vec<SampleMig>,
    /// The GPU's sample failed with this error (a GPU lost, say): it is replayed as a failed GPU, its
    /// processes and figures left out (docs/agent.md, "GPU states").
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

/// A MIG instance in a sample file.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct SampleMig {
    /// MIG device index on the GPU.
    pub index: u32,
    /// `MIG-…`.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub uuid: String,
    /// Memory of the instance, bytes.
    #[serde(default, deserialize_with = "bytes")]
    pub memory_total_bytes: u64,
    /// Memory the instance says is used, bytes; absent: unknown.
    #[serde(default, skip_serializing_if = "Option::is_none", deserialize_with = "opt_bytes")]
    pub memory_used_bytes: Option<u64>,
    /// Its processes.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub processes: Vec<SampleProcess>,
}

/// A process in a sample file.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct SampleProcess {
    /// Host PID (attributed through `/proc` unless the entry names its pod).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pid: Option<u32>,
    /// Bytes on this GPU: an integer or a quantity (`"9Gi"`).
    #[serde(deserialize_with = "bytes")]
    pub used_bytes: u64,
    /// NVML reported no figure for this process (`used_bytes` is then not read): counted apart, never
    /// charged.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub unavailable: bool,
    /// The pod's UID, to charge it directly.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pod_uid: Option<String>,
    /// The pod's namespace (with `pod`), to charge it directly by name.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub namespace: Option<String>,
    /// The pod's name (with `namespace`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pod: Option<String>,
    /// The container's name.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub container: Option<String>,
    /// The container's ID (no runtime scheme).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub container_id: Option<String>,
    /// Whether the process is a client of the GPU's MPS server (NVML's MPS list); absent: not known.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mps_client: Option<bool>,
}

fn bytes<'de, D: Deserializer<'de>>(d: D) -> Result<u64, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Bytes {
        Int(u64),
        Text(String),
    }
    match Bytes::deserialize(d)? {
        Bytes::Int(n) => Ok(n),
        Bytes::Text(t) => gpubudget_common::quantity::parse_bytes(&t).map_err(serde::de::Error::custom),
    }
}

fn opt_bytes<'de, D: Deserializer<'de>>(d: D) -> Result<Option<u64>, D::Error> {
    bytes(d).map(Some)
}

impl SampleProcess {
    fn direct(&self) -> Result<Option<DirectOwner>, String> {
        let pod = match (&self.pod_uid, &self.namespace, &self.pod) {
            (Some(uid), _, _) => PodKey::Uid(uid.to_ascii_lowercase()),
            (None, Some(namespace), Some(name)) => PodKey::Name { namespace: namespace.clone(), name: name.clone() },
            (None, None, Some(_)) | (None, Some(_), None) => {
                return Err("names a pod by name: give both \"namespace\" and \"pod\"".into());
            }
            (None, None, None) if self.pid.is_some() => return Ok(None),
            (None, None, None) => return Err("needs a \"pid\", a \"pod_uid\", or \"namespace\" and \"pod\"".into()),
        };
        Ok(Some(DirectOwner { pod, container: self.container.clone(), container_id: self.container_id.clone() }))
    }
}

impl SampleFile {
    /// Parses and checks a sample file's text (JSON; YAML is accepted too).
    pub fn parse(text: &str) -> Result<Self, String> {
        let file: Self = match serde_json::from_str(text) {
            Ok(f) => f,
            Err(json) => serde_yaml::from_str(text).map_err(|_| format!("not a sample file: {json}"))?,
        };
        if file.version != 1 {
            return Err(format!("version {} is not supported (1 is)", file.version));
        }
        file.to_snapshot().map(|_| file)
    }

    /// The snapshot the file describes.
    pub fn to_snapshot(&self) -> Result<Snapshot, String> {
        let mut snapshot = Snapshot::default();
        for gpu in &self.gpus {
            type Unit<'a> = (Option<u32>, &'a str, u64, Option<u64>, &'a [SampleProcess]);
            let units: Vec<Unit<'_>> = if gpu.mig.is_empty() {
                vec![(None, gpu.uuid.as_str(), gpu.memory_total_bytes, gpu.memory_used_bytes, &gpu.processes)]
            } else {
                gpu.mig
                    .iter()
                    .map(|m| {
                        (Some(m.index), m.uuid.as_str(), m.memory_total_bytes, m.memory_used_bytes, &m.processes[..])
                    })
                    .collect()
            };
            for (mig, uuid, total, used, processes) in units {
                let slot = snapshot.gpus.len();
                let unavailable = processes.iter().filter(|p| p.unavailable).count();
                snapshot.readings.push(match &gpu.error {
                    Some(error) => GpuReading::failed(SampleError::new(Call::SampleFile, error), 1),
                    None => GpuReading {
                        unavailable: u32::try_from(unavailable).unwrap_or(u32::MAX),
                        ..GpuReading::sampled(used.map(|u| DeviceMemory::from_used(u, total)))
                    },
                });
                snapshot.gpus.push(GpuInfo {
                    index: gpu.index,
                    mig,
                    uuid: uuid.to_owned(),
                    name: gpu.name.clone(),
                    total_bytes: total,
                    label: GpuInfo::label_for(gpu.index, mig),
                });
                for (i, p) in processes.iter().enumerate() {
                    let direct = p.direct().map_err(|e| format!("gpus[{}] process {i}: {e}", gpu.index))?;
                    if gpu.error.is_some() {
                        continue; // checked, but a failed GPU's processes are not in the sample
                    }
                    snapshot.processes.push(ProcessSample {
                        gpu: slot,
                        pid: p.pid,
                        bytes: (!p.unavailable).then_some(p.used_bytes),
                        direct: direct.map(Arc::new),
                        mps_client: p.mps_client,
                    });
                }
            }
        }
        Ok(snapshot)
    }

    /// A sample file holding `snapshot` (what `capture` writes). Processes keep their PIDs.
    pub fn from_snapshot(snapshot: &Snapshot, host: Option<String>) -> Self {
        let mut gpus: Vec<SampleGpu> = Vec::new();
        for (slot, info) in snapshot.gpus.iter().enumerate() {
            let processes: Vec<SampleProcess> = snapshot
                .processes
                .iter()
                .filter(|p| p.gpu == slot)
                .map(|p| SampleProcess {
                    pid: p.pid,
                    used_bytes: p.charged(),
                    unavailable: p.bytes.is_none(),
                    mps_client: p.mps_client,
                    ..SampleProcess::default()
                })
                .collect();
            if gpus.last().is_none_or(|g| g.index != info.index) {
                gpus.push(SampleGpu { index: info.index, name: info.name.clone(), ..SampleGpu::default() });
            }
            let Some(gpu) = gpus.last_mut() else { continue };
            if let Some(GpuHealth::Failed { error, .. }) = snapshot.readings.get(slot).map(|r| &r.health) {
                gpu.error = Some(error.to_string());
            }
            match info.mig {
                None => {
                    gpu.uuid.clone_from(&info.uuid);
                    gpu.memory_total_bytes = info.total_bytes;
                    gpu.memory_used_bytes = snapshot.memory(slot).map(|m| m.used);
                    gpu.processes = processes;
                }
                Some(m) => gpu.mig.push(SampleMig {
                    index: m,
                    uuid: info.uuid.clone(),
                    memory_total_bytes: info.total_bytes,
                    memory_used_bytes: snapshot.memory(slot).map(|m| m.used),
                    processes,
                }),
            }
        }
        Self { version: 1, taken_at: Some(jiff::Timestamp::now().to_string()), host, gpus }
    }
}

/// Tells whether a file changed since last asked, from one `stat` (modification time, size, inode).
#[derive(Debug, Clone)]
pub struct FileWatch {
    path: PathBuf,
    last: Option<(Option<SystemTime>, u64, u64)>,
}

impl FileWatch {
    /// Watches `path` (symlinks followed).
    pub fn new(path: &Path) -> Self {
        Self { path: path.to_owned(), last: None }
    }

    /// The watched path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// True the first time and whenever the file changed since the last call.
    pub fn changed(&mut self) -> std::io::Result<bool> {
        use std::os::unix::fs::MetadataExt as _;
        let meta = std::fs::metadata(&self.path)?;
        let now = (meta.modified().ok(), meta.len(), meta.ino());
        let changed = self.last != Some(now);
        self.last = Some(now);
        Ok(changed)
    }

    /// Forgets the last state, so the next [`Self::changed`] is true.
    pub fn reset(&mut self) {
        self.last = None;
    }
}

/// Replays a sample file, re-reading it when it changes.
#[derive(Debug)]
pub struct RecordedSampler {
    watch: FileWatch,
    current: Snapshot,
    reads: u64,
}

impl RecordedSampler {
    /// A sampler over the file at `path`; fails if it cannot be read or parsed now.
    pub fn new(path: &Path) -> Result<Self, SampleError> {
        let mut sampler = Self { watch: FileWatch::new(path), current: Snapshot::default(), reads: 0 };
        sampler.refresh()?;
        Ok(sampler)
    }

    /// A boxed factory for [`super::SamplerSlot`].
    pub fn factory(path: PathBuf) -> super::SamplerFactory {
        Box::new(move || Ok(Box::new(Self::new(&path)?) as Box<dyn Sampler>))
    }

    /// How many times the file was read and parsed.
    pub fn reads(&self) -> u64 {
        self.reads
    }

    fn refresh(&mut self) -> Result<(), SampleError> {
        let changed = self.watch.changed().map_err(|e| SampleError::new(Call::ReadSampleFile, e))?;
        if !changed {
            return Ok(());
        }
        let parsed = std::fs::read_to_string(self.watch.path())
            .map_err(|e| e.to_string())
            .and_then(|text| SampleFile::parse(&text))
            .and_then(|file| file.to_snapshot());
        match parsed {
            Ok(snapshot) => {
                self.reads += 1;
                tracing::debug!(path = %self.watch.path().display(), processes = snapshot.processes.len(), "sample file read");
                self.current = snapshot;
                Ok(())
            }
            Err(e) => {
                // Read it again next time, even if it does not change: it may have been caught mid-write.
                self.watch.reset();
                Err(SampleError::new(Call::ReadSampleFile, format!("{}: {e}", self.watch.path().display())))
            }
        }
    }
}

impl Sampler for RecordedSampler {
    fn sample(&mut self, out: &mut Snapshot) -> Result<(), SampleError> {
        self.refresh()?;
        if out.gpus != self.current.gpus {
            out.gpus.clone_from(&self.current.gpus);
        }
        out.processes.clone_from(&self.current.processes);
        out.readings.clone_from(&self.current.readings);
        Ok(())
    }

    fn source(&self) -> String {
        format!("file:{}", self.watch.path().display())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const EXAMPLE: &str = r#"{
      "version": 1,
      "gpus": [
        {"index": 0, "uuid": "GPU-a", "name": "NVIDIA H100 80GB HBM3", "memory_total_bytes": 85520809984,
         "processes": [
           {"pid": 4242, "used_bytes": 2787115008},
           {"pod_uid": "5A1E3C9D-7B2F-4E8A-9C61-0D3F2B7A8E41", "container": "trainer", "used_bytes": "9Gi"},
           {"namespace": "team-a", "pod": "llm-0", "used_bytes": 1073741824}
         ]},
        {"index": 1, "name": "NVIDIA A100", "mig": [
           {"index": 0, "uuid": "MIG-x", "memory_total_bytes": "10Gi", "processes": [{"pid": 7, "used_bytes": 5}]},
           {"index": 2, "uuid": "MIG-y", "memory_total_bytes": "20Gi"}
        ]}
      ]
    }"#;

    #[test]
    fn parses_every_entry_form() {
        let file = SampleFile::parse(EXAMPLE).expect("parses");
        let snap = file.to_snapshot().expect("snapshot");
        let labels: Vec<&str> = snap.gpus.iter().map(|g| g.label.as_str()).collect();
        assert_eq!(labels, ["0", "1/mig0", "1/mig2"]);
        assert_eq!(snap.gpus[1].total_bytes, 10 << 30);
        assert_eq!(snap.processes.len(), 4);
        assert_eq!(snap.processes[1].bytes, Some(9 << 30));
        let direct = snap.processes[1].direct.as_deref().expect("direct");
        assert_eq!(direct.pod, PodKey::Uid("5a1e3c9d-7b2f-4e8a-9c61-0d3f2b7a8e41".into()));
        assert_eq!(direct.container.as_deref(), Some("trainer"));
        assert!(
            matches!(&snap.processes[2].direct.as_deref().expect("direct").pod, PodKey::Name { name, .. } if name == "llm-0")
        );
        assert_eq!((snap.processes[3].gpu, snap.processes[3].pid), (1, Some(7)));
    }

    #[test]
    fn rejects_entries_that_name_nothing() {
        let err = SampleFile::parse(r#"{"gpus":[{"index":0,"processes":[{"used_bytes":1}]}]}"#).expect_err("no owner");
        assert!(err.contains("gpus[0] process 0"), "{err}");
        let err =
            SampleFile::parse(r#"{"gpus":[{"index":0,"processes":[{"pod":"x","used_bytes":1}]}]}"#).expect_err("no ns");
        assert!(err.contains("namespace"), "{err}");
        assert!(SampleFile::parse(r#"{"version":2,"gpus":[]}"#).is_err());
        assert!(SampleFile::parse("[1,2").is_err());
        assert!(SampleFile::parse(r#"{"gpus":[{"index":0,"processes":[{"pid":1,"used_bytes":"8 GiB"}]}]}"#).is_err());
    }

    #[test]
    fn round_trips_a_snapshot() {
        let snap = SampleFile::parse(EXAMPLE).expect("parses").to_snapshot().expect("snapshot");
        let pids_only = Snapshot {
            readings: Vec::new(),
            gpus: snap.gpus.clone(),
            processes: snap.processes.iter().filter(|p| p.direct.is_none()).cloned().collect(),
        };
        let written = SampleFile::from_snapshot(&pids_only, Some("node-1".into()));
        let text = serde_json::to_string_pretty(&written).expect("json");
        let back = SampleFile::parse(&text).expect("parses").to_snapshot().expect("snapshot");
        assert_eq!(back.gpus, pids_only.gpus);
        assert_eq!(back.processes, pids_only.processes);
    }

    #[test]
    fn replays_failed_gpus_and_unavailable_figures_and_writes_them_back() {
        let text = r#"{"gpus": [
          {"index": 0, "uuid": "GPU-a", "memory_total_bytes": "80Gi", "memory_used_bytes": "10Gi",
           "processes": [{"pid": 1, "used_bytes": "9Gi"}, {"pid": 2, "used_bytes": 0, "unavailable": true}]},
          {"index": 1, "uuid": "GPU-b", "memory_total_bytes": "80Gi", "error": "GPU is lost",
           "processes": [{"pid": 3, "used_bytes": "4Gi"}]}
        ]}"#;
        let snap = SampleFile::parse(text).expect("parses").to_snapshot().expect("snapshot");
        let pids: Vec<(usize, Option<u32>, Option<u64>)> =
            snap.processes.iter().map(|p| (p.gpu, p.pid, p.bytes)).collect();
        assert_eq!(pids, [(0, Some(1), Some(9 << 30)), (0, Some(2), None)], "GPU 1's process left out");
        assert_eq!(snap.readings[0].unavailable, 1);
        assert_eq!(snap.memory(0).map(|m| m.free), Some(70 << 30));
        assert!(matches!(&snap.readings[1].health, GpuHealth::Failed { error, .. } if error.message == "GPU is lost"));
        assert_eq!(snap.sampled_gpus(), 1);
        let back = SampleFile::from_snapshot(&snap, None);
        assert_eq!(back.gpus[1].error.as_deref(), Some("sample_file: GPU is lost"));
        assert!(back.gpus[0].processes[1].unavailable);
        let again = SampleFile::parse(&serde_json::to_string(&back).expect("json")).expect("parses");
        assert_eq!(again.to_snapshot().expect("snapshot").processes, snap.processes);
    }

    #[test]
    fn rereads_only_when_the_file_changes() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("sample.json");
        std::fs::write(&path, EXAMPLE).expect("write");
        let mut sampler = RecordedSampler::new(&path).expect("reads");
        let mut out = Snapshot::default();
        for _ in 0..20 {
            sampler.sample(&mut out).expect("samples");
        }
        assert_eq!(sampler.reads(), 1);
        assert_eq!(out.processes.len(), 4);

        // A ConfigMap-style update: a new file renamed over the old one (new inode).
        let next = dir.path().join("next.json");
        std::fs::write(&next, r#"{"gpus":[{"index":0,"processes":[{"pid":1,"used_bytes":"1Gi"}]}]}"#).expect("write");
        std::fs::rename(&next, &path).expect("rename");
        sampler.sample(&mut out).expect("samples");
        assert_eq!(sampler.reads(), 2);
        assert_eq!(out.processes.len(), 1);

        // A broken update is an error (counted, the tick skipped), and is retried.
        std::fs::write(&path, "{").expect("write");
        assert_eq!(sampler.sample(&mut out).expect_err("broken").call, Call::ReadSampleFile);
        std::fs::write(&path, EXAMPLE).expect("write");
        sampler.sample(&mut out).expect("recovers");
        assert_eq!(out.processes.len(), 4);
    }
}
