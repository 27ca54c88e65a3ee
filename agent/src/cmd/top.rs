//! `gpubudget-agent top`: GPU memory by pod, container and process on this host, wired: the sampler, the `/proc`
//! join, the pods' names and budgets from the API server when in reach ([`crate::attribute::kube::list`]; without
//! it, pods by UID) and the view ([`crate::report::top`]).

use std::time::{Duration, Instant};

use anyhow::Context as _;
use gpubudget_nvml_limits::DriverLimits;

use crate::attribute::driver_limits::DriverReader;
use crate::attribute::pods::PodTable;
use crate::attribute::{ProcAttributor, Usage, kube};
use crate::cli::{Output, TopArgs};
use crate::report::top::{add_driver_limits, build_view, render_table};
use crate::sample::{Sampler, Snapshot};

fn hostname() -> Option<String> {
    std::fs::read_to_string("/proc/sys/kernel/hostname").ok().map(|h| h.trim().to_owned()).filter(|h| !h.is_empty())
}

/// `gpubudget-agent top`.
pub async fn run(args: TopArgs) -> anyhow::Result<()> {
    let mut sampler: Box<dyn Sampler> = match &args.sample_file {
        Some(path) => Box::new(crate::sample::file::RecordedSampler::new(path)?),
        None => Box::new(crate::sample::nvml::NvmlSampler::new().context("NVML is not available on this host")?),
    };
    let (table, names) = if args.no_api {
        (PodTable::default(), false)
    } else {
        let node = args.node_name.clone().or_else(hostname);
        match kube::list::table(node.as_deref()).await {
            Ok(t) => (t, true),
            Err(error) => {
                tracing::debug!(error = format!("{error:#}"), "no pod names from the API");
                (PodTable::default(), false)
            }
        }
    };
    let mut attributor = ProcAttributor::new(&args.sample.proc_root);
    let mut snapshot = Snapshot::default();
    let mut usage = Usage::default();
    let started = Instant::now();
    let refresh = args.sample.interval.max(Duration::from_secs(1));
    // The driver's per-cgroup limits, where the node's NVML has them (not for a replayed sample).
    let mut driver = match args.sample_file {
        Some(_) => None,
        None => DriverLimits::open().ok().map(|l| DriverReader::new(Box::new(l), args.cgroup_root.clone())),
    };
    let mut driver_views = Vec::new();
    loop {
        sampler.sample(&mut snapshot)?;
        let now_ms = u64::try_from(started.elapsed().as_millis()).unwrap_or(u64::MAX);
        usage.compute(&snapshot, &table, &mut attributor, now_ms);
        let mut view = build_view(&snapshot, &table, &usage, &args.sample.proc_root, names, args.pressure_hard.0);
        if let Some(reader) = &mut driver {
            reader.observe(&snapshot, &usage.owners, &attributor, table.pods.len(), now_ms, &mut driver_views);
            add_driver_limits(&mut view, &table, &driver_views);
        }
        let text = match args.output {
            Output::Table => render_table(&view),
            Output::Json => serde_json::to_string_pretty(&view)? + "\n",
        };
        if args.once {
            print!("{text}");
            return Ok(());
        }
        print!("\x1b[H\x1b[2J{text}");
        tokio::select! {
            () = tokio::time::sleep(refresh) => {}
            _ = tokio::signal::ctrl_c() => return Ok(()),
        }
    }
}
