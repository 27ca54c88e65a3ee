//! Caps set by the container runtime as it makes a container (NRI, #45): from the container it will actually
//! build — its final environment (after `valueFrom` and `envFrom` were resolved by the kubelet) and the device
//! nodes it will get (the device plugin's or CDI's) — not from the pod spec. Pure: the agent's NRI plugin hands
//! the runtime's view in and writes what comes out.
//!
//! The same canonical values as admission ([`super::admit`]): the MPS cap `<i>=<MiB>M` for exactly the devices
//! the container sees, the smaller of the budget's limit and the user's value where the driver would read the
//! user's; `NVIDIA_GPU_MEMORY_LIMIT` / `NVIDIA_GPU_MEMORY_REQUEST` in MiB. What the pod's author wrote is
//! replaced, never trusted: the runtime's value is the one the process starts with.

use super::{
    Caps, ContainerCap, ContainerRecord, Devices, EnvValue, GpuContainer, MAX_DEVICES, MAX_ENV_VALUE, MEMORY_LIMIT,
    MEMORY_REQUEST, MPS_LIMIT, Outcome, Unknown, VISIBLE_DEVICES, Visible, held, merge_mib, merge_mps_outcome, visible,
};
use std::collections::BTreeMap;

/// The MPS client's pipe directory: where the node runs an MPS daemon, the runtime points GPU containers at it.
pub const MPS_PIPE_DIRECTORY: &str = "CUDA_MPS_PIPE_DIRECTORY";

/// The variables the runtime-caps decision reads of a container the runtime makes: the devices it sees, the caps it
/// carries, its MPS pipe. The relay that holds the runtime's socket hands the agent only these ([`relevant`]).
pub const READ: [&str; 5] = [VISIBLE_DEVICES, MPS_LIMIT, MEMORY_LIMIT, MEMORY_REQUEST, MPS_PIPE_DIRECTORY];

/// The variables a runtime adjustment may set or remove: the relay lets nothing else through ([`check_adjustment`]).
pub const ADJUSTABLE: [&str; 4] = [MPS_LIMIT, MEMORY_LIMIT, MEMORY_REQUEST, MPS_PIPE_DIRECTORY];

/// The part of a container the decision reads, and nothing else (no other variable, no other device): for each of
/// [`READ`] its last entry where it is readable (the one [`env_get`] reads), and its distinct GPU device nodes, at most
/// [`MAX_DEVICES`]` + 1` (more are too many either way). [`devices_seen`], [`held_in`] and [`adjust`] read the same
/// from it as from the whole container (property-tested). Linear in the environment and the device list.
pub fn relevant<'a>(env: &[String], device_paths: impl IntoIterator<Item = &'a str>) -> (Vec<String>, Vec<String>) {
    let env = READ.iter().filter_map(|name| env_get(env, name).map(|v| format!("{name}={v}"))).collect();
    let mut nodes: Vec<&str> = device_paths.into_iter().filter(|p| gpu_node(p)).collect();
    nodes.sort_unstable();
    nodes.dedup();
    let nodes = nodes.into_iter().take(MAX_DEVICES as usize + 1).map(str::to_owned).collect();
    (env, nodes)
}

/// Whether an adjustment stays within what runtime caps change: each of [`ADJUSTABLE`] set or removed at most once,
/// values no longer than [`MAX_ENV_VALUE`] and without NUL. The relay checks every answer of the agent with it, so a
/// compromised agent can change no other part of a container.
pub fn check_adjustment(set: &[(String, String)], remove: &[String]) -> Result<(), String> {
    let mut seen: Vec<&str> = Vec::with_capacity(ADJUSTABLE.len());
    for key in set.iter().map(|(k, _)| k).chain(remove) {
        if !ADJUSTABLE.contains(&key.as_str()) {
            return Err(format!("{key:.64} is not a variable runtime caps set"));
        }
        if seen.contains(&key.as_str()) {
            return Err(format!("{key} adjusted twice"));
        }
        seen.push(key);
    }
    match set.iter().find(|(_, v)| v.len() > MAX_ENV_VALUE || v.contains('\0')) {
        Some((k, _)) => Err(format!("{k}: a value over {MAX_ENV_VALUE} bytes or with NUL")),
        None => Ok(()),
    }
}

/// The value of `name` in a runtime's environment list (`KEY=value` strings; the last entry of a name wins, as
/// at exec). Values longer than [`MAX_ENV_VALUE`] are not read (Linux refuses them at exec).
pub fn env_get<'a>(env: &'a [String], name: &str) -> Option<&'a str> {
    env.iter().rev().find_map(|kv| kv.strip_prefix(name)?.strip_prefix('=')).filter(|v| v.len() <= MAX_ENV_VALUE)
}

/// Whether a device node path is one GPU (`/dev/nvidia0`, `/dev/nvidia12`); not `/dev/nvidiactl`, `-uvm`, caps.
fn gpu_node(path: &str) -> bool {
    path.strip_prefix("/dev/nvidia").is_some_and(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()))
}

/// The devices a container will see, from what the runtime will give it: its GPU device nodes where it gets
/// any (device plugin or CDI), else `NVIDIA_VISIBLE_DEVICES` in its final environment (`all`: the node's
/// `node_gpus`, where known). `None`: no GPU (no GPU device node, and the variable absent, empty, `none` or
/// `void`). Linear in the environment and the device list.
pub fn devices_seen<'a>(
    env: &[String],
    device_paths: impl IntoIterator<Item = &'a str>,
    node_gpus: u32,
) -> Option<Devices> {
    let mut nodes: Vec<&str> = device_paths.into_iter().filter(|p| gpu_node(p)).collect();
    nodes.sort_unstable();
    nodes.dedup();
    if !nodes.is_empty() {
        return Some(match u32::try_from(nodes.len()) {
            Ok(n) if n <= MAX_DEVICES => Devices::Known(n),
            _ => Devices::Unknown(Unknown::TooMany),
        });
    }
    let value = env_get(env, VISIBLE_DEVICES)?;
    match visible(&EnvValue::Literal(value.to_owned())) {
        Visible::Nothing => None,
        Visible::Listed(n) => Some(Devices::Known(n)),
        Visible::Unknown(Unknown::All) if node_gpus > 0 && node_gpus <= MAX_DEVICES => Some(Devices::Known(node_gpus)),
        Visible::Unknown(why) => Some(Devices::Unknown(why)),
    }
}

/// How the driver holds a container the runtime makes (or made), from its final environment: the same reading as
/// for a pod's spec ([`held`]), so a container counts capped only where the driver reads its cap on every device it
/// sees.
pub fn held_in(name: &str, env: &[String], devices: Devices) -> ContainerCap {
    let literal = |n: &str| env_get(env, n).map(|v| EnvValue::Literal(v.to_owned()));
    held(&GpuContainer {
        name: name.to_owned(),
        devices,
        mps_limit: literal(MPS_LIMIT),
        memory_limit: literal(MEMORY_LIMIT),
        memory_request: literal(MEMORY_REQUEST),
    })
}

/// What the runtime does to one GPU container: variables to set and to remove, and the record of it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Adjustment {
    /// Variables to set (replacing any entry of that name).
    pub set: Vec<(&'static str, String)>,
    /// Variables to remove.
    pub remove: Vec<&'static str>,
    /// What was done, as admission records it ([`ContainerRecord`]; `uncapped` when the device count is unknown).
    pub record: ContainerRecord,
}

impl Adjustment {
    /// The environment the container starts with: `env` with this adjustment applied (set entries replace every entry
    /// of their name, removed ones are dropped).
    pub fn applied_to(&self, env: &[String]) -> Vec<String> {
        let touched = |kv: &str| {
            let key = kv.split_once('=').map_or(kv, |(k, _)| k);
            self.set.iter().any(|(k, _)| *k == key) || self.remove.contains(&key)
        };
        let mut out: Vec<String> = env.iter().filter(|kv| !touched(kv)).cloned().collect();
        out.extend(self.set.iter().map(|(k, v)| format!("{k}={v}")));
        out
    }
}

/// The caps `caps` give a container named `name` whose final environment is `env` and which sees `devices`;
/// `mps_pipe`: the node's MPS pipe directory, set where the node runs an MPS daemon (`None`: left as it is).
pub fn adjust(name: &str, env: &[String], devices: Devices, caps: Caps, mps_pipe: Option<&str>) -> Adjustment {
    let literal = |n: &str| env_get(env, n).map(|v| EnvValue::Literal(v.to_owned()));
    let mut record = BTreeMap::new();
    let (mut set, mut remove) = (Vec::new(), Vec::new());
    let mut uncapped = None;
    match devices {
        Devices::Known(n) => {
            let (value, outcome) = merge_mps_outcome(literal(MPS_LIMIT).as_ref(), n, caps.limit_mib);
            record.insert(MPS_LIMIT.to_owned(), outcome);
            set.push((MPS_LIMIT, value));
        }
        Devices::Unknown(why) => {
            // No value can be known to be read: a user's entry for a device the container does not see voids
            // the whole variable, silently. Removed, and the container reported uncapped with the reason.
            if env_get(env, MPS_LIMIT).is_some() {
                record.insert(MPS_LIMIT.to_owned(), Outcome::Removed);
                remove.push(MPS_LIMIT);
            }
            uncapped = Some(why.to_string());
        }
    }
    let (limit, outcome) = merge_mib(literal(MEMORY_LIMIT).as_ref(), caps.limit_mib);
    record.insert(MEMORY_LIMIT.to_owned(), outcome);
    set.push((MEMORY_LIMIT, limit));
    if let Some(request_mib) = caps.request_mib.filter(|r| *r > 0) {
        let (request, outcome) = merge_mib(literal(MEMORY_REQUEST).as_ref(), request_mib);
        record.insert(MEMORY_REQUEST.to_owned(), outcome);
        set.push((MEMORY_REQUEST, request));
    }
    if let Some(pipe) = mps_pipe {
        let outcome = if env_get(env, MPS_PIPE_DIRECTORY) == Some(pipe) { Outcome::Kept } else { Outcome::Set };
        record.insert(MPS_PIPE_DIRECTORY.to_owned(), outcome);
        set.push((MPS_PIPE_DIRECTORY, pipe.to_owned()));
    }
    let record =
        ContainerRecord { name: name.to_owned(), devices: devices.known().unwrap_or(0), env: record, uncapped };
    Adjustment { set, remove, record }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn env(pairs: &[&str]) -> Vec<String> {
        pairs.iter().map(|s| (*s).to_owned()).collect()
    }

    const CAPS: Caps = Caps { limit_mib: 10240, request_mib: None };

    #[test]
    fn the_devices_are_those_the_runtime_gives() {
        let none: [&str; 0] = [];
        assert_eq!(devices_seen(&env(&["PATH=/bin"]), none, 8), None, "no variable, no device node: no GPU");
        assert_eq!(devices_seen(&env(&["NVIDIA_VISIBLE_DEVICES=void"]), none, 8), None);
        // The kubelet resolved KAI's ConfigMap: the final value is a list.
        let kai = env(&["NVIDIA_VISIBLE_DEVICES=GPU-1a2b", "PATH=/bin"]);
        assert_eq!(devices_seen(&kai, none, 8), Some(Devices::Known(1)));
        assert_eq!(devices_seen(&env(&["NVIDIA_VISIBLE_DEVICES=all"]), none, 4), Some(Devices::Known(4)));
        assert_eq!(devices_seen(&env(&["NVIDIA_VISIBLE_DEVICES=all"]), none, 0), Some(Devices::Unknown(Unknown::All)));
        // The last entry wins, as at exec.
        let twice = env(&["NVIDIA_VISIBLE_DEVICES=0,1", "NVIDIA_VISIBLE_DEVICES=3"]);
        assert_eq!(devices_seen(&twice, none, 8), Some(Devices::Known(1)));
        // Device nodes (CDI, the device plugin) are what the process sees, whatever the variable says.
        let nodes = ["/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia2", "/dev/nvidia5", "/dev/nvidia2"];
        assert_eq!(devices_seen(&env(&["NVIDIA_VISIBLE_DEVICES=all"]), nodes, 8), Some(Devices::Known(2)));
        assert_eq!(devices_seen(&env(&[]), ["/dev/nvidiactl"], 8), None, "the control node alone is no GPU");
    }

    #[test]
    fn a_hostile_value_is_replaced_by_the_canonical_cap() {
        // The author asked more than the budget, in a spelling the driver ignores, with a UUID and a junk entry.
        let hostile = env(&["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=99G,GPU-x=1G,junk", "NVIDIA_GPU_MEMORY_LIMIT=999999"]);
        let a = adjust("main", &hostile, Devices::Known(2), CAPS, None);
        assert_eq!(a.set, [(MPS_LIMIT, "0=10240M,1=10240M".to_owned()), (MEMORY_LIMIT, "10240".to_owned())]);
        assert_eq!(a.record.env[MPS_LIMIT], Outcome::Replaced);
        assert_eq!(a.record.env[MEMORY_LIMIT], Outcome::Lowered);
        assert!(a.remove.is_empty() && a.record.uncapped.is_none() && a.record.devices == 2);
        // A smaller value the driver reads is kept (canonical form), and the node's MPS pipe is set.
        let modest = env(&["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=2G"]);
        let a = adjust(
            "main",
            &modest,
            Devices::Known(1),
            Caps { limit_mib: 10240, request_mib: Some(4096) },
            Some("/run/mps"),
        );
        assert_eq!(
            a.set,
            [
                (MPS_LIMIT, "0=2048M".to_owned()),
                (MEMORY_LIMIT, "10240".to_owned()),
                (MEMORY_REQUEST, "4096".to_owned()),
                (MPS_PIPE_DIRECTORY, "/run/mps".to_owned())
            ]
        );
        assert_eq!(a.record.env[MPS_LIMIT], Outcome::Kept);
    }

    #[test]
    fn an_unknown_device_count_removes_the_users_mps_value_and_says_why() {
        let a = adjust(
            "main",
            &env(&["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=1G"]),
            Devices::Unknown(Unknown::All),
            CAPS,
            None,
        );
        assert_eq!(a.remove, [MPS_LIMIT]);
        assert_eq!(a.set, [(MEMORY_LIMIT, "10240".to_owned())]);
        assert_eq!(a.record.uncapped.as_deref(), Some(Unknown::All.to_string().as_str()));
    }

    #[test]
    fn a_container_counts_capped_only_as_the_driver_reads_its_final_environment() {
        let hostile = env(&["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=80G,1=1G", "PATH=/bin"]);
        assert!(
            matches!(held_in("c", &hostile, Devices::Known(1)), ContainerCap::Uncapped(_)),
            "an unseen ordinal voids it"
        );
        let a = adjust("c", &hostile, Devices::Known(1), CAPS, None);
        let made = a.applied_to(&hostile);
        assert_eq!(
            made,
            env(&["PATH=/bin", "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=10240M", "NVIDIA_GPU_MEMORY_LIMIT=10240"])
        );
        assert_eq!(held_in("c", &made, Devices::Known(1)), ContainerCap::Capped { max_mib: 10240 });
        let unknown = adjust("c", &hostile, Devices::Unknown(Unknown::All), CAPS, None);
        assert!(matches!(
            held_in("c", &unknown.applied_to(&hostile), Devices::Unknown(Unknown::All)),
            ContainerCap::Uncapped(_)
        ));
    }

    #[test]
    fn only_the_adjustable_variables_pass_and_each_once() {
        let kv = |k: &str, v: &str| (k.to_owned(), v.to_owned());
        assert!(check_adjustment(&[kv(MPS_LIMIT, "0=1024M"), kv(MEMORY_LIMIT, "1024")], &[]).is_ok());
        assert!(check_adjustment(&[], &[MPS_LIMIT.to_owned()]).is_ok());
        let ld = check_adjustment(&[kv("LD_PRELOAD", "/tmp/x.so")], &[]).expect_err("not ours");
        assert!(ld.contains("LD_PRELOAD"), "{ld}");
        assert!(check_adjustment(&[], &["NVIDIA_VISIBLE_DEVICES".to_owned()]).is_err(), "devices are not ours");
        assert!(check_adjustment(&[kv(MPS_LIMIT, "0=1M")], &[MPS_LIMIT.to_owned()]).is_err(), "twice");
        assert!(check_adjustment(&[kv(MPS_PIPE_DIRECTORY, "/run\0x")], &[]).is_err(), "NUL");
        assert!(check_adjustment(&[kv(MEMORY_LIMIT, &"9".repeat(MAX_ENV_VALUE + 1))], &[]).is_err(), "too long");
    }

    #[test]
    fn the_relevant_part_is_small_whatever_the_container_holds() {
        let mut e: Vec<String> = (0..10_000).map(|i| format!("SECRET_{i}=x")).collect();
        e.extend(env(&[
            "NVIDIA_VISIBLE_DEVICES=0",
            "NVIDIA_VISIBLE_DEVICES=GPU-1",
            "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=1G",
        ]));
        let paths: Vec<String> =
            (0..1000).map(|i| format!("/dev/nvidia{}", i % 100)).chain(["/dev/sda".into()]).collect();
        let (kept, nodes) = relevant(&e, paths.iter().map(String::as_str));
        assert_eq!(kept, env(&["NVIDIA_VISIBLE_DEVICES=GPU-1", "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=1G"]));
        assert_eq!(nodes.len(), MAX_DEVICES as usize + 1, "distinct GPU nodes, bounded");
        assert!(nodes.iter().all(|n| n.starts_with("/dev/nvidia")));
    }

    proptest! {
        /// The relay hands the agent only [`relevant`]: every decision reads the same from it as from the whole
        /// container.
        #[test]
        fn the_relevant_part_decides_as_the_whole_container(
            entries in proptest::collection::vec(
                (prop_oneof![Just("NVIDIA_VISIBLE_DEVICES"), Just("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"),
                    Just("NVIDIA_GPU_MEMORY_LIMIT"), Just("NVIDIA_GPU_MEMORY_REQUEST"), Just("CUDA_MPS_PIPE_DIRECTORY"),
                    Just("PATH"), Just("NVIDIA_VISIBLE_DEVICESX")],
                 prop_oneof![Just("all".to_owned()), Just("0,1".to_owned()), Just("GPU-a".to_owned()),
                    Just("0=1G,1=2G".to_owned()), Just("4096".to_owned()), "[ -~]{0,12}"]),
                0..12),
            nodes in proptest::collection::vec(0u32..80, 0..70),
            extra in proptest::collection::vec(prop_oneof![Just("/dev/nvidiactl"), Just("/dev/nvidia-uvm"), Just("/dev/null")], 0..3),
            gpus in 0u32..9, limit_mib in 1u64..100_000,
        ) {
            let e: Vec<String> = entries.iter().map(|(k, v)| format!("{k}={v}")).collect();
            let paths: Vec<String> =
                nodes.iter().map(|n| format!("/dev/nvidia{n}")).chain(extra.iter().map(|p| (*p).to_owned())).collect();
            let (re, rn) = relevant(&e, paths.iter().map(String::as_str));
            let whole = devices_seen(&e, paths.iter().map(String::as_str), gpus);
            prop_assert_eq!(whole, devices_seen(&re, rn.iter().map(String::as_str), gpus));
            if let Some(d) = whole {
                prop_assert_eq!(held_in("c", &e, d), held_in("c", &re, d));
                let caps = Caps { limit_mib, request_mib: Some(limit_mib / 2) };
                let (a, b) = (adjust("c", &e, d, caps, Some("/run/mps")), adjust("c", &re, d, caps, Some("/run/mps")));
                prop_assert_eq!(&a, &b);
                prop_assert!(check_adjustment(
                    &a.set.iter().map(|(k, v)| ((*k).to_owned(), v.clone())).collect::<Vec<_>>(),
                    &a.remove.iter().map(|k| (*k).to_owned()).collect::<Vec<_>>(),
                ).is_ok(), "every adjustment the agent makes passes the relay");
            }
        }
    }

    proptest! {
        /// Whatever the author wrote, a container seeing `n` devices starts with exactly `n` canonical entries,
        /// each at most the cap: the form the driver reads (common/src/caps.rs `read_mps`).
        #[test]
        fn the_runtimes_cap_is_always_read_by_the_driver_and_never_above_the_limit(
            user in "[ -~]{0,40}", n in 1u32..=8, limit_mib in 1u64..200_000,
        ) {
            let e = vec![format!("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT={user}")];
            let a = adjust("c", &e, Devices::Known(n), Caps { limit_mib, request_mib: None }, None);
            let value = &a.set[0].1;
            let read = super::super::read_mps(value, n).expect("the driver reads it");
            prop_assert_eq!(read.per_device.len(), n as usize);
            prop_assert!(read.per_device.iter().all(|d| d.is_some_and(|d| d.high_mib <= limit_mib)));
        }
    }
}
