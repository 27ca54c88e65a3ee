//! `gpubudget-agent capture`: one NVML sample written as a sample file.

use std::io::Write as _;

use anyhow::Context as _;

use crate::attribute::{Lookup, ProcAttributor};
use crate::cli::CaptureArgs;
use crate::sample::file::SampleFile;
use crate::sample::{Sampler as _, Snapshot};

/// Adds `pod_uid` and `container_id` to every process `/proc` attributes, so the file replays on
/// another host (the PID stays, for reference).
pub fn attribute(file: &mut SampleFile, attributor: &mut ProcAttributor) {
    attributor.begin_round();
    let processes = file.gpus.iter_mut().flat_map(|g| {
        let mig = g.mig.iter_mut().flat_map(|m| m.processes.iter_mut());
        g.processes.iter_mut().chain(mig)
    });
    for p in processes {
        let Some(pid) = p.pid else { continue };
        if let Lookup::Pod(r) = attributor.lookup(pid, 0) {
            p.pod_uid = Some(r.pod_uid.clone());
            p.container_id.clone_from(&r.container_id);
        }
    }
    attributor.end_round();
}

/// Runs `capture`.
pub fn run(args: CaptureArgs) -> anyhow::Result<()> {
    let mut sampler = crate::sample::nvml::NvmlSampler::new().context("NVML is not available on this host")?;
    let mut snapshot = Snapshot::default();
    sampler.sample(&mut snapshot)?;
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname").ok().map(|h| h.trim().to_owned());
    let mut file = SampleFile::from_snapshot(&snapshot, host);
    if args.attribute {
        attribute(&mut file, &mut ProcAttributor::new(&args.proc_root));
    }
    let text = serde_json::to_string_pretty(&file)? + "\n";
    match &args.output {
        Some(path) => std::fs::write(path, text).with_context(|| format!("cannot write {}", path.display()))?,
        None => std::io::stdout().write_all(text.as_bytes())?,
    }
    Ok(())
}
