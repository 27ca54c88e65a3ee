//! Whether a capped pod's MPS cap is in force (#32), from what the node sees (pure).
//!
//! A pod is *capped* when its GPU containers' environment holds `CUDA_MPS_PINNED_DEVICE_MEM_LIMIT` that the
//! driver reads ([`PodView::mps_cap_mib`](crate::attribute::pods::PodView::mps_cap_mib): the webhook writes it,
//! the operator counts it in `podsCapped`). But the variable is advice to the process, read when CUDA starts in
//! it, and only by clients of an MPS server. Measured on the H100 (driver 580, FIELD_NOTES): a process started
//! with the variable removed (`env -u`), or with `CUDA_MPS_PIPE_DIRECTORY` pointing elsewhere, ran uncapped; so
//! does every process where no MPS server runs. The agent sees each GPU process of the pod and tells
//! ([`check`]), in this order:
//!
//! | what NVML shows of a process of a capped pod | [`Breach`] |
//! |---|---|
//! | it holds more than the cap + [`SLACK_BYTES`] on a GPU | [`Breach::AboveCap`] |
//! | it holds memory on more GPUs than the value names devices ([`MpsCap::devices`]): the driver caps the ordinals named, the others not | [`Breach::UnnamedGpu`], unless the driver holds the pod by per-cgroup hard limits (R615) |
//! | the GPU's MPS client list was read since it appeared, and it is not on it | [`Breach::NotMpsClient`], unless the driver holds the pod by per-cgroup hard limits (R615) |
//! | it is on the MPS list, or the list cannot be read there | none |
//!
//! A breach is kept while its process lives ([`Breach::still_seen`]): a process is an MPS client or not for
//! its whole life, and one that went past its cap was never held by it. The pod is then reported *cap not in
//! force* (event, record, status, metric, `why`), and its budget is enforced by eviction as for any uncapped
//! pod (the agent never relied on the cap for that).

use gpubudget_common::quantity::HumanBytes;

use crate::attribute::Holder;
use crate::attribute::pods::MpsCap;
use crate::sample::GpuInfo;

/// How far NVML's figure for a process may go past its MPS cap before the cap is taken not to hold it. The cap
/// counts what NVML counts, CUDA context included: on the H100 (driver 580, `e2e/gpu/cap-in-force.sh`) clients
/// capped at 1024, 3072 and 8192 MiB met CUDA OOM with NVML showing the cap less 252 MiB (their next 256 MiB
/// would have passed it by 4 MiB). 64 MiB is room for rounding, not for a process: anything past it was never
/// held by the cap.
pub const SLACK_BYTES: u64 = 64 << 20;

/// Why a capped pod's cap is not in force.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Breach {
    /// A process of the pod is not a client of the GPU's MPS server.
    NotMpsClient {
        /// Its PID (absent for an entry of a sample file that names its pod).
        pid: Option<u32>,
        /// Snapshot GPU index.
        gpu: usize,
        /// What it held when seen.
        bytes: u64,
    },
    /// A process of the pod holds more than its cap allows.
    AboveCap {
        /// Its PID.
        pid: Option<u32>,
        /// Snapshot GPU index.
        gpu: usize,
        /// What it held when seen.
        bytes: u64,
    },
    /// A process of the pod holds memory on more GPUs than its cap names devices: on some of them nothing caps
    /// it (within its cap on each GPU or not).
    UnnamedGpu {
        /// Its PID.
        pid: Option<u32>,
        /// Snapshot GPU index: the first (by index) past as many as the cap names.
        gpu: usize,
        /// What it held there when seen.
        bytes: u64,
        /// The GPUs it holds memory on.
        gpus: u32,
        /// The devices its cap names.
        named: u32,
    },
}

impl Breach {
    fn process(self) -> (Option<u32>, usize) {
        match self {
            Self::NotMpsClient { pid, gpu, .. }
            | Self::AboveCap { pid, gpu, .. }
            | Self::UnnamedGpu { pid, gpu, .. } => (pid, gpu),
        }
    }

    /// Whether the process it names is still among `holders`.
    pub fn still_seen(self, holders: &[Holder]) -> bool {
        let (pid, gpu) = self.process();
        holders.iter().any(|h| h.pid == pid && h.gpu == gpu)
    }

    /// The kind, for events and the metric: `not-mps-client`, `above-cap` or `unnamed-gpu`.
    pub fn kind(self) -> &'static str {
        match self {
            Self::NotMpsClient { .. } => "not-mps-client",
            Self::AboveCap { .. } => "above-cap",
            Self::UnnamedGpu { .. } => "unnamed-gpu",
        }
    }

    /// In words, for the pod's record, its event and `why`; `cap` is the pod's.
    pub fn note(self, cap: MpsCap, gpus: &[GpuInfo]) -> String {
        let (pid, gpu) = self.process();
        let process = pid.map_or_else(|| "a process".to_owned(), |p| format!("process {p}"));
        let on = gpus.get(gpu).map_or_else(|| format!("GPU {gpu}"), |g| format!("GPU {}", g.label));
        let cap = format!("{} MiB", cap.mib);
        match self {
            Self::NotMpsClient { bytes, .. } => format!(
                "{process} on {on} ({} as NVML counts it) is not a client of the GPU's MPS server, so its \
                 CUDA_MPS_PINNED_DEVICE_MEM_LIMIT cap of {cap} is not applied to it (it unset the variable, uses \
                 another CUDA_MPS_PIPE_DIRECTORY, or no MPS server runs there): cap not in force; the budget is \
                 enforced by eviction",
                HumanBytes(bytes)
            ),
            Self::AboveCap { bytes, .. } => format!(
                "{process} holds {} on {on} as NVML counts it, more than its CUDA_MPS_PINNED_DEVICE_MEM_LIMIT cap \
                 of {cap} lets a process hold: cap not in force; the budget is enforced by eviction",
                HumanBytes(bytes)
            ),
            Self::UnnamedGpu { bytes, gpus, named, .. } => format!(
                "{process} holds memory on {gpus} GPUs ({} on {on}), but its CUDA_MPS_PINNED_DEVICE_MEM_LIMIT cap \
                 of {cap} names {named} device(s): the driver caps only those, so the cap is not in force on the \
                 others; the budget is enforced by eviction",
                HumanBytes(bytes)
            ),
        }
    }
}

/// The first process (by PID) that holds memory on more GPUs than `named`, as a breach at its first GPU past
/// `named` (by snapshot index). Processes without a PID (a sample file's entries) are not grouped. Sorting the
/// (PID, GPU) pairs: O(n log n) in the pod's holders.
fn unnamed_gpu(named: u32, holders: &[Holder]) -> Option<Breach> {
    let mut pairs: Vec<(u32, usize, u64)> = holders.iter().filter_map(|h| Some((h.pid?, h.gpu, h.bytes))).collect();
    pairs.sort_unstable();
    pairs.dedup_by_key(|(pid, gpu, _)| (*pid, *gpu));
    let mut i = 0;
    while i < pairs.len() {
        let pid = pairs[i].0;
        let end = pairs[i..].iter().position(|p| p.0 != pid).map_or(pairs.len(), |n| i + n);
        let gpus = u32::try_from(end - i).unwrap_or(u32::MAX);
        if gpus > named {
            let (_, gpu, bytes) = pairs[i + usize::try_from(named).unwrap_or(usize::MAX).min(end - i - 1)];
            return Some(Breach::UnnamedGpu { pid: Some(pid), gpu, bytes, gpus, named });
        }
        i = end;
    }
    None
}

/// The first process of a pod capped at `cap` that shows the cap is not in force, if any (the table in the
/// module's comment). `driver_holds`: the driver's per-cgroup hard limits (R615) hold the pod, so a process
/// that is no MPS client, or holds memory on a GPU its value does not name, is still capped.
pub fn check(cap: MpsCap, holders: &[Holder], driver_holds: bool) -> Option<Breach> {
    let allowed = cap.mib.saturating_mul(1 << 20).saturating_add(SLACK_BYTES);
    let above =
        holders.iter().find(|h| h.bytes > allowed).map(|h| Breach::AboveCap { pid: h.pid, gpu: h.gpu, bytes: h.bytes });
    let not_client = || {
        holders.iter().find(|h| h.mps_client == Some(false)).map(|h| Breach::NotMpsClient {
            pid: h.pid,
            gpu: h.gpu,
            bytes: h.bytes,
        })
    };
    above.or_else(|| if driver_holds { None } else { unnamed_gpu(cap.devices, holders).or_else(not_client) })
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const MIB: u64 = 1 << 20;

    fn holder(pid: u32, gpu: usize, bytes: u64, mps_client: Option<bool>) -> Holder {
        Holder { container: None, pid: Some(pid), gpu, bytes, mps_client }
    }

    /// A cap naming one device (`0=<mib>M`).
    fn cap(mib: u64) -> MpsCap {
        MpsCap { mib, devices: 1 }
    }

    /// A process at its cap on each of several GPUs whose cap names only one is not held on the others: not in
    /// force (the driver caps the ordinals the value names). Within as many GPUs as it names: in force.
    #[test]
    fn a_process_on_more_gpus_than_its_cap_names_is_not_in_force() {
        let at_cap = 3000 * MIB;
        let h = [holder(7, 0, at_cap, Some(true)), holder(7, 2, at_cap, Some(true)), holder(7, 1, at_cap, Some(true))];
        assert_eq!(
            check(cap(3072), &h, false),
            Some(Breach::UnnamedGpu { pid: Some(7), gpu: 1, bytes: at_cap, gpus: 3, named: 1 })
        );
        let two = MpsCap { mib: 3072, devices: 2 };
        assert_eq!(
            check(two, &h, false),
            Some(Breach::UnnamedGpu { pid: Some(7), gpu: 2, bytes: at_cap, gpus: 3, named: 2 })
        );
        assert_eq!(check(MpsCap { mib: 3072, devices: 3 }, &h, false), None, "as many GPUs as named");
        // Two processes, one GPU each: each within what its value names.
        let apart = [holder(7, 0, at_cap, Some(true)), holder(8, 1, at_cap, Some(true))];
        assert_eq!(check(cap(3072), &apart, false), None);
        // Per-cgroup hard limits (R615) hold every GPU of the container.
        assert_eq!(check(cap(3072), &h, true), None);
        let gpus: Vec<GpuInfo> = (0..3).map(|i| GpuInfo { label: i.to_string(), ..GpuInfo::default() }).collect();
        let note = check(cap(3072), &h, false).expect("breach").note(cap(3072), &gpus);
        assert!(note.starts_with("process 7 holds memory on 3 GPUs"), "{note}");
        assert!(note.contains("names 1 device(s)") && note.contains("not in force"), "{note}");
        let b = check(cap(3072), &h, false).expect("breach");
        assert_eq!(b.kind(), "unnamed-gpu");
        assert!(b.still_seen(&h) && !b.still_seen(&h[..1]), "lasts while the process holds that GPU");
    }

    #[test]
    fn an_mps_client_within_its_cap_and_context_is_in_force() {
        // The H100 figure of a client capped at 3072 MiB that filled its cap: 2304 MiB of tensors + the context.
        let h = [holder(7, 0, 2820 * MIB, Some(true))];
        assert_eq!(check(cap(3072), &h, false), None);
        // A process the MPS list could not be read for: nothing is claimed either way.
        assert_eq!(check(cap(3072), &[holder(7, 0, 2820 * MIB, None)], false), None);
        // ... unless it holds what no capped process can: the 6 GiB an uncapped client got beside it.
        assert_eq!(
            check(cap(3072), &[holder(7, 0, 6660 * MIB, None)], false),
            Some(Breach::AboveCap { pid: Some(7), gpu: 0, bytes: 6660 * MIB })
        );
    }

    #[test]
    fn a_process_that_went_around_mps_is_told_with_its_pid_and_gpu() {
        let h = [holder(7, 0, 600 * MIB, Some(true)), holder(8, 1, 700 * MIB, Some(false))];
        assert_eq!(check(cap(3072), &h, false), Some(Breach::NotMpsClient { pid: Some(8), gpu: 1, bytes: 700 * MIB }));
        // Per-cgroup hard limits (R615) hold it all the same.
        assert_eq!(check(cap(3072), &h, true), None);
        let gpus =
            [GpuInfo { label: "0".into(), ..GpuInfo::default() }, GpuInfo { label: "1".into(), ..GpuInfo::default() }];
        let note = check(cap(3072), &h, false).expect("breach").note(cap(3072), &gpus);
        assert!(note.starts_with("process 8 on GPU 1 (700Mi as NVML counts it) is not a client"), "{note}");
        assert!(note.contains("3072 MiB") && note.contains("cap not in force"), "{note}");
    }

    #[test]
    fn above_the_cap_and_the_slack_is_told_first_whatever_the_list_says() {
        let over = 3072 * MIB + SLACK_BYTES + 1;
        let h = [holder(8, 0, MIB, Some(false)), holder(9, 0, over, Some(true))];
        assert_eq!(check(cap(3072), &h, false), Some(Breach::AboveCap { pid: Some(9), gpu: 0, bytes: over }));
        assert_eq!(
            check(cap(3072), &h, true),
            Some(Breach::AboveCap { pid: Some(9), gpu: 0, bytes: over }),
            "R615 too"
        );
        assert_eq!(check(cap(3072), &[holder(9, 0, over - 1, Some(true))], false), None, "the boundary holds");
    }

    #[test]
    fn a_breach_lasts_as_long_as_its_process() {
        let b = Breach::NotMpsClient { pid: Some(8), gpu: 1, bytes: MIB };
        assert!(b.still_seen(&[holder(8, 1, 2 * MIB, Some(false))]));
        assert!(!b.still_seen(&[holder(8, 0, MIB, Some(false))]), "another GPU");
        assert!(!b.still_seen(&[holder(9, 1, MIB, Some(false))]), "gone");
    }

    proptest! {
        /// Never a breach from MPS clients within cap + slack; always one when some process is no client (and the
        /// driver does not hold the pod) or is past the slack.
        #[test]
        fn told_exactly_when_a_process_escapes(
            cap_mib in 1_u64..200_000,
            devices in 1_u32..4,
            procs in proptest::collection::vec((0_u32..50, 0_usize..4, 0_u64..300_000 * MIB, proptest::option::of(any::<bool>())), 0..12),
            driver_holds in any::<bool>(),
        ) {
            let holders: Vec<Holder> = procs.iter().map(|&(p, g, b, m)| holder(p, g, b, m)).collect();
            let allowed = cap_mib * MIB + SLACK_BYTES;
            let gpus_of = |pid: u32| {
                let mut gpus: Vec<usize> = holders.iter().filter(|h| h.pid == Some(pid)).map(|h| h.gpu).collect();
                gpus.sort_unstable();
                gpus.dedup();
                gpus.len()
            };
            let escaped = holders.iter().any(|h| h.bytes > allowed)
                || (!driver_holds && holders.iter().any(|h| h.mps_client == Some(false)))
                || (!driver_holds && holders.iter().any(|h| h.pid.is_some_and(|p| gpus_of(p) > devices as usize)));
            let breach = check(MpsCap { mib: cap_mib, devices }, &holders, driver_holds);
            prop_assert_eq!(breach.is_some(), escaped);
            if let Some(b) = breach {
                prop_assert!(b.still_seen(&holders));
            }
        }
    }
}
