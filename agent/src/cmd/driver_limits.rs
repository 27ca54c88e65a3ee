//! `gpubudget-agent driver-limits`: whether this node's NVML has the driver's per-cgroup GPU memory limits
//! (`nvmlDeviceGetMemoryLimits_v1`, driver R615 or newer), and, with `--gpu` and cgroup paths, what the driver
//! holds for each. The first line is always `driver-limits: available …` or `driver-limits: unavailable: …`
//! (the same detection `run` does at its start), so a check on a node is one grep.

use gpubudget_common::quantity::HumanBytes;
use gpubudget_nvml_limits::{DriverLimits, Limits, Reading};

use crate::cli::DriverLimitsArgs;

/// One reading in words: `soft 4Gi, hard 8Gi, used 1Gi`, `not set`, `not supported`.
pub fn describe(reading: &Reading) -> String {
    match reading {
        Reading::Set(Limits { soft, hard, used }) => {
            let bound = |b: Option<u64>| b.map_or_else(|| "none".to_owned(), |b| HumanBytes(b).to_string());
            let l = Limits { soft: *soft, hard: *hard, used: *used };
            format!("soft {}, hard {}, used {}", bound(l.soft_limit()), bound(l.hard_limit()), HumanBytes(*used))
        }
        Reading::NotSet => "not set (NVML_ERROR_NOT_FOUND)".to_owned(),
        Reading::NotSupported => "not supported (NVML_ERROR_NOT_SUPPORTED: MIG, or not cgroup v2)".to_owned(),
    }
}

/// Runs `driver-limits`. Exits 0 whether or not the driver has the calls (that is the answer); an error for
/// cgroups given without `--gpu`, or a read that fails.
pub fn run(args: &DriverLimitsArgs) -> anyhow::Result<()> {
    let limits = match DriverLimits::open_at(args.library.as_os_str()) {
        Ok(limits) => limits,
        Err(why) => {
            println!("driver-limits: unavailable: {why}");
            return Ok(());
        }
    };
    println!("driver-limits: available (driver {})", limits.driver_version().unwrap_or_else(|| "unknown".into()));
    if args.cgroups.is_empty() {
        return Ok(());
    }
    let Some(gpu) = &args.gpu else { anyhow::bail!("give the GPU's UUID with --gpu to read cgroups") };
    let mut failed = 0;
    for cgroup in &args.cgroups {
        match limits.read(gpu, cgroup) {
            Ok(reading) => println!("{gpu} {}: {}", cgroup.display(), describe(&reading)),
            Err(error) => {
                failed += 1;
                println!("{gpu} {}: error: {error}", cgroup.display());
            }
        }
    }
    anyhow::ensure!(failed == 0, "{failed} of {} reads failed", args.cgroups.len());
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn readings_are_described_with_none_for_unset_bounds() {
        let set = Reading::Set(Limits { soft: 0, hard: 8 << 30, used: 1 << 30 });
        assert_eq!(describe(&set), "soft none, hard 8Gi, used 1Gi");
        assert!(describe(&Reading::NotSet).starts_with("not set"));
        assert!(describe(&Reading::NotSupported).starts_with("not supported"));
    }
}
