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
    Caps, ContainerRecord, Devices, EnvValue, GpuContainer, Held, MAX_DEVICES, MAX_ENV_VALUE, MEMORY_LIMIT,
    MEMORY_REQUEST, MPS_LIMIT, Outcome, Unknown, VISIBLE_DEVICES, Visible, held, merge_mib, merge_mps_outcome, visible,
};
use std::collections::BTreeMap;

/// The MPS client's pipe directory: where the node runs an MPS daemon, the runtime points GPU containers at it.
pub const MPS_PIPE_DIRECTORY: &str = "CUDA_MPS_PIPE_DIRECTORY";

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
pub fn held_in(name: &str, env: &[String], devices: Devices) -> Held {
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
        assert!(matches!(held_in("c", &hostile, Devices::Known(1)), Held::Uncapped(_)), "an unseen ordinal voids it");
        let a = adjust("c", &hostile, Devices::Known(1), CAPS, None);
        let made = a.applied_to(&hostile);
        assert_eq!(
            made,
            env(&["PATH=/bin", "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=10240M", "NVIDIA_GPU_MEMORY_LIMIT=10240"])
        );
        assert_eq!(held_in("c", &made, Devices::Known(1)), Held::Capped { max_mib: 10240 });
        let unknown = adjust("c", &hostile, Devices::Unknown(Unknown::All), CAPS, None);
        assert!(matches!(
            held_in("c", &unknown.applied_to(&hostile), Devices::Unknown(Unknown::All)),
            Held::Uncapped(_)
        ));
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
