//! GPU memory caps set in the pod spec at admission: the environment of the pod's GPU containers.
//!
//! gpubudget's caps webhook sets them for budgets with `admissionCaps: Enabled` (docs/operator.md) and records
//! it in `gpubudget.io/caps`; the pod's owner or another webhook may set them too. This reads what the spec
//! holds, and says what each variable caps and where it does not, by the driver's own reading rules. Which
//! containers are GPU containers, how many devices each sees, how the driver reads an MPS value and whether a
//! container is capped all come from `gpubudget_common::caps`, as the webhook and the operator's status read
//! them (a pod `why` calls uncapped is one the status counts in `podsUncapped`).
//! - `CUDA_MPS_PINNED_DEVICE_MEM_LIMIT` (`0=4096M,1=4096M`): the driver caps each MPS client *process* on
//!   each device, only with an MPS control daemon; one entry it cannot read, an amount in `K` or bytes, 0, or
//!   an entry for a device the process does not see, and it ignores the whole value.
//! - `NVIDIA_GPU_MEMORY_LIMIT` / `NVIDIA_GPU_MEMORY_REQUEST` (MiB): nvidia-container-toolkit's CDI hook
//!   applies them to the container's cgroup as hard / soft limits, on driver R615 or newer only.

use gpubudget_common::caps::{self, ContainerCap, Devices, GpuContainer};
use gpubudget_common::quantity::HumanBytes;
use k8s_openapi::api::core::v1::{EnvVar, Pod};
use serde::Serialize;

/// The MPS per-client pinned memory limit.
pub const MPS_LIMIT: &str = caps::MPS_LIMIT;
/// nvidia-container-toolkit's hard limit (MiB).
pub const NVIDIA_LIMIT: &str = caps::MEMORY_LIMIT;
/// nvidia-container-toolkit's soft limit (MiB).
pub const NVIDIA_REQUEST: &str = caps::MEMORY_REQUEST;

/// What the pod spec caps.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Admission {
    /// Containers that use a GPU: a GPU or MIG limit, a DRA claim or `NVIDIA_VISIBLE_DEVICES` (init
    /// containers first, ephemeral ones last).
    pub gpu_containers: Vec<String>,
    /// Per GPU container, whether the driver holds it to an MPS cap, as the operator's status counts it.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub verdicts: Vec<Verdict>,
    /// What gpubudget's caps webhook did at creation (its `gpubudget.io/caps` record), when it did.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub set_by_gpubudget: Option<String>,
    /// Every cap variable found, one per container and variable.
    pub caps: Vec<Cap>,
    /// The sentence `why` prints.
    pub summary: String,
}

/// Whether one GPU container is capped.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Verdict {
    pub container: String,
    /// `2 device(s)`, or `an unknown number of devices`.
    pub devices: String,
    /// Every device it sees has an MPS cap the driver honours.
    pub capped: bool,
    /// The largest such cap (bytes), when capped.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_bytes: Option<u64>,
    /// Why not, when not.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
}

/// One cap variable in one container.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Cap {
    pub container: String,
    pub variable: String,
    /// The value as written (at most 80 characters, then `...`); `valueFrom` when it comes from a ConfigMap,
    /// Secret or field.
    pub value: String,
    /// The bytes it caps, when it caps (per process for MPS, per container for the toolkit's).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub bytes: Option<u64>,
    /// What it caps, and where it does not.
    pub meaning: String,
}

/// What an MPS value does in a container seeing `devices` (`None`: not a GPU container, count unknown).
fn mps_meaning(value: &str, devices: Option<Devices>) -> (Option<u64>, String) {
    let (n, unknown) = match devices {
        Some(Devices::Known(n)) => (n, None),
        Some(Devices::Unknown(why)) => (caps::MAX_DEVICES, Some(why.to_string())),
        None => (caps::MAX_DEVICES, Some("it asks for no GPU".to_owned())),
    };
    let read = match caps::read_mps(value, n) {
        Ok(read) => read,
        Err(why) => {
            return (
                None,
                format!(
                    "the driver ignores the whole value ({why}): the container's processes run uncapped (write \
                     DEVICE=SIZE for each device it sees, such as 0=4096M)"
                ),
            );
        }
    };
    let entries: Vec<(usize, u64)> = read
        .per_device
        .iter()
        .enumerate()
        .filter_map(|(i, a)| a.map(|a| (i, a.high_mib.saturating_mul(1 << 20))))
        .collect();
    let max = entries.iter().map(|(_, b)| *b).max();
    let listed =
        entries.iter().map(|(i, b)| format!("{} on device {i}", HumanBytes(*b))).collect::<Vec<_>>().join(", ");
    let mut text = if listed.is_empty() {
        "caps no device by ordinal".to_owned()
    } else {
        format!(
            "the driver caps each MPS client process at {listed} (only while an MPS control daemon serves the GPU; \
             per process, not per pod)"
        )
    };
    if read.names_uuid {
        text.push_str(
            "; an entry names a GPU by UUID: the driver ignores the whole value if the container does not see it",
        );
    }
    if let Some(why) = unknown {
        text.push_str(&format!(
            "; how many devices the container sees is not in the pod ({why}): an entry for a device it does not see \
             makes the driver ignore the whole value"
        ));
    } else if let Some(missing) = read.per_device.iter().position(Option::is_none) {
        text.push_str(&format!("; device {missing} has no entry: uncapped"));
    }
    (max, text)
}

fn toolkit_meaning(variable: &str, value: &str) -> (Option<u64>, String) {
    let kind = if variable == NVIDIA_LIMIT { "hard limit" } else { "soft limit" };
    match caps::strict_mib(value).and_then(|mib| mib.checked_mul(1 << 20)) {
        Some(bytes) => (
            Some(bytes),
            format!(
                "a {kind} of {} on this container's cgroup, applied by nvidia-container-toolkit's CDI hook on \
                 driver R615 or newer (older drivers: not applied)",
                HumanBytes(bytes)
            ),
        ),
        None => (None, format!("{:?} is not a plain number of MiB: the toolkit may apply nothing", short(value))),
    }
}

/// At most 80 characters of a value (a tenant may write a megabyte).
fn short(value: &str) -> String {
    match value.char_indices().nth(80) {
        Some((end, _)) => format!("{}...", &value[..end]),
        None => value.to_owned(),
    }
}

/// What [`admission`] says of a pod whose spec sets no cap: who could have set one and did not. The
/// variables are named once, with a verb that agrees with its subject ("the GPU containers a, b set none of
/// ..."; "no container sets ...").
fn uncapped(gpu_containers: &[String]) -> String {
    let variables = format!("{MPS_LIMIT}, {NVIDIA_LIMIT}, {NVIDIA_REQUEST}");
    let who = match gpu_containers {
        [] => format!(
            "no container asks for nvidia.com/gpu or nvidia.com/gpu.shared, and no container sets any of {variables}"
        ),
        [one] => format!("the GPU container {one} sets none of {variables}"),
        many => format!("the GPU containers {} set none of {variables}", many.join(", ")),
    };
    format!("none set at admission: {who}; only the budget's eviction bounds this pod's GPU memory")
}

fn verdict(gpu: &GpuContainer, env_from: &[k8s_openapi::api::core::v1::EnvFromSource]) -> Verdict {
    let (capped, max_bytes, reason) = match caps::held(gpu) {
        ContainerCap::Capped { max_mib } => (true, Some(max_mib.saturating_mul(1 << 20)), None),
        // A device count not in the pod: said as the webhook records it (naming an envFrom's ConfigMap).
        ContainerCap::Uncapped(caps::Uncapped::Devices(why)) => {
            (false, None, Some(caps::unknown_reason(why, env_from)))
        }
        ContainerCap::Uncapped(why) => (false, None, Some(why.to_string())),
    };
    Verdict { container: gpu.name.clone(), devices: gpu.devices.to_string(), capped, max_bytes, reason }
}

/// The caps the pod spec sets, for [`crate::why`].
pub fn admission(pod: &Pod) -> Admission {
    let spec = pod.spec.as_ref();
    fn env(e: &Option<Vec<EnvVar>>) -> &[EnvVar] {
        e.as_deref().unwrap_or_default()
    }
    let mut all: Vec<(&str, &[EnvVar])> = Vec::new();
    if let Some(s) = spec {
        all.extend(s.init_containers.iter().flatten().map(|c| (c.name.as_str(), env(&c.env))));
        all.extend(s.containers.iter().map(|c| (c.name.as_str(), env(&c.env))));
        all.extend(s.ephemeral_containers.iter().flatten().map(|c| (c.name.as_str(), env(&c.env))));
    }
    let found = caps::gpu_containers(pod);
    let gpu_containers: Vec<String> = found.iter().map(|f| f.gpu.name.clone()).collect();
    let devices_of = |name: &str| found.iter().find(|f| f.gpu.name == name).map(|f| f.gpu.devices);
    // Without a GPU container (time-slicing by a device plugin under another name, say), every container.
    let looked_at: Vec<(&str, &[EnvVar])> =
        if found.is_empty() { all } else { found.iter().map(|f| (f.gpu.name.as_str(), f.env)).collect() };
    let mut caps = Vec::new();
    for (name, env) in looked_at {
        for env in env {
            if ![MPS_LIMIT, NVIDIA_LIMIT, NVIDIA_REQUEST].contains(&env.name.as_str()) {
                continue;
            }
            let (value, (bytes, meaning)) = match (&env.value, &env.value_from) {
                (Some(v), _) => {
                    let m = if env.name == MPS_LIMIT {
                        mps_meaning(v, devices_of(name))
                    } else {
                        toolkit_meaning(&env.name, v)
                    };
                    (short(v), m)
                }
                (None, Some(_)) => (
                    "valueFrom".to_owned(),
                    (
                        None,
                        "set from a ConfigMap, Secret or field at start: its value is not in the pod spec".to_owned(),
                    ),
                ),
                (None, None) => (String::new(), (None, "empty: caps nothing".to_owned())),
            };
            caps.push(Cap { container: name.to_owned(), variable: env.name.clone(), value, bytes, meaning });
        }
    }
    let verdicts: Vec<Verdict> = found.iter().map(|f| verdict(&f.gpu, f.env_from)).collect();
    let set_by_gpubudget = caps::record_of(pod).map(|r| format!("cap set at admission by gpubudget: {}", r.summary()));
    let held = verdicts
        .iter()
        .map(|v| match (&v.reason, v.max_bytes) {
            (Some(why), _) => format!("{} ({}) is UNCAPPED: {why}", v.container, v.devices),
            (None, max) => format!(
                "{} ({}) is capped by MPS at most {} per process and device",
                v.container,
                v.devices,
                HumanBytes(max.unwrap_or_default())
            ),
        })
        .collect::<Vec<_>>()
        .join("; ");
    let summary = if caps.is_empty() {
        let none = uncapped(&gpu_containers);
        // A device count the pod does not say is a reason of its own (a DRA claim, NVIDIA_VISIBLE_DEVICES=all).
        let unknown: Vec<String> = found
            .iter()
            .filter_map(|f| match f.gpu.devices {
                Devices::Unknown(why) => Some(format!("{}: {}", f.gpu.name, caps::unknown_reason(why, f.env_from))),
                Devices::Known(_) => None,
            })
            .collect();
        if unknown.is_empty() { none } else { format!("{none} ({})", unknown.join("; ")) }
    } else {
        let details = caps
            .iter()
            .map(|c| format!("{} {}={}: {}", c.container, c.variable, c.value, c.meaning))
            .collect::<Vec<_>>()
            .join("; ");
        if held.is_empty() { details } else { format!("{held}. {details}") }
    };
    let summary = match &set_by_gpubudget {
        Some(set) => format!("{set}; {summary}"),
        None => summary,
    };
    Admission { gpu_containers, verdicts, caps, set_by_gpubudget, summary }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pod(containers: &str) -> Pod {
        serde_yaml::from_str(&format!("metadata: {{name: p, namespace: n}}\nspec:\n  containers:\n{containers}"))
            .unwrap()
    }

    #[test]
    fn no_cap_says_so_and_names_the_gpu_containers() {
        let a = admission(&pod(
            "  - {name: server, image: x, resources: {limits: {nvidia.com/gpu: 1}}}\n  - {name: sidecar, image: y}\n",
        ));
        assert_eq!(a.gpu_containers, ["server"]);
        assert!(a.caps.is_empty());
        assert!(a.summary.starts_with("none set at admission: the GPU container server sets none of"), "{}", a.summary);
        let a = admission(&pod("  - {name: main, image: x}\n"));
        assert_eq!(
            a.summary,
            "none set at admission: no container asks for nvidia.com/gpu or nvidia.com/gpu.shared, and no container \
             sets any of CUDA_MPS_PINNED_DEVICE_MEM_LIMIT, NVIDIA_GPU_MEMORY_LIMIT, NVIDIA_GPU_MEMORY_REQUEST; only \
             the budget's eviction bounds this pod's GPU memory"
        );
        assert!(!a.summary.contains("none sets none"), "{}", a.summary);
        assert!(a.set_by_gpubudget.is_none());
        let a = admission(&pod(
            "  - {name: a, image: x, resources: {limits: {nvidia.com/gpu: 1}}}\n  - {name: b, image: x, resources: {limits: {nvidia.com/gpu.shared: 1}}}\n",
        ));
        assert!(
            a.summary.starts_with("none set at admission: the GPU containers a, b set none of CUDA_MPS"),
            "{}",
            a.summary
        );
    }

    #[test]
    fn says_when_gpubudget_set_the_caps() {
        let mut p = pod("  - name: server\n    image: x\n    resources: {limits: {nvidia.com/gpu: 2}}\n    env:\n\
             \x20   - {name: CUDA_MPS_PINNED_DEVICE_MEM_LIMIT, value: \"0=8192M,1=8192M\"}\n");
        // Whole GPUs: pinned to nodes that do not share them.
        p.spec.as_mut().expect("spec").node_selector =
            Some([("nvidia.com/gpu.sharing-strategy".to_owned(), "none".to_owned())].into());
        let record = r#"{"budget":"llm","limitMib":8192,"containers":[{"name":"server","devices":2,"env":{"CUDA_MPS_PINNED_DEVICE_MEM_LIMIT":"set"}}]}"#;
        p.metadata.annotations = Some([(caps::ANNOTATION.to_owned(), record.to_owned())].into());
        let a = admission(&p);
        assert!(
            a.summary.starts_with("cap set at admission by gpubudget: budget llm: limit 8192 MiB per GPU container"),
            "{}",
            a.summary
        );
        assert!(a.summary.contains("8Gi on device 1"), "{}", a.summary);
    }

    #[test]
    fn reads_every_cap_and_what_it_does() {
        let a =
            admission(&pod("  - name: server\n    image: x\n    resources: {limits: {nvidia.com/gpu: 1}}\n    env:\n\
             \x20   - {name: CUDA_MPS_PINNED_DEVICE_MEM_LIMIT, value: \"0=4G,4G\"}\n\
             \x20   - {name: NVIDIA_GPU_MEMORY_LIMIT, value: \"8192\"}\n\
             \x20   - {name: NVIDIA_GPU_MEMORY_REQUEST, value: \"lots\"}\n\
             \x20   - {name: OTHER, value: \"1\"}\n\
             \x20 - name: helper\n    image: y\n    env: [{name: NVIDIA_GPU_MEMORY_LIMIT, value: \"1\"}]\n"));
        let found: Vec<(&str, Option<u64>)> = a.caps.iter().map(|c| (c.variable.as_str(), c.bytes)).collect();
        assert_eq!(found, [(MPS_LIMIT, None), (NVIDIA_LIMIT, Some(8 << 30)), (NVIDIA_REQUEST, None)]);
        // A bare amount beside an entry: the driver ignores the whole value (measured, #32).
        assert!(
            a.caps[0].meaning.starts_with("the driver ignores the whole value (entry 2 is not DEVICE=AMOUNT"),
            "{}",
            a.caps[0].meaning
        );
        assert!(a.caps[1].meaning.starts_with("a hard limit of 8Gi"), "{}", a.caps[1].meaning);
        assert!(a.caps[2].meaning.contains("not a plain number of MiB"));
        assert!(
            a.summary.starts_with(
                "server (1 device(s)) is UNCAPPED: the driver ignores its CUDA_MPS_PINNED_DEVICE_MEM_LIMIT: entry 2 \
                 is not DEVICE=AMOUNT (such as 0=4096M). server CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=4G,4G: "
            ),
            "{}",
            a.summary
        );
    }

    #[test]
    fn mps_sizes() {
        let mps_size = caps::mps_amount_bytes;
        assert_eq!(mps_size("4G"), Some(4 << 30));
        assert_eq!(mps_size("512MB"), Some(512 << 20));
        assert_eq!(mps_size("6000M"), Some(6000 << 20));
        assert_eq!(mps_size("1024"), None, "bytes: the driver ignores them");
        assert_eq!(mps_size("lots"), None);
        let one = Some(Devices::Known(1));
        let (bytes, meaning) = mps_meaning("GPU-1234=2G", one);
        assert!(bytes.is_none() && meaning.contains("names a GPU by UUID"), "{meaning}");
        assert_eq!(mps_meaning("=2G", one).0, None);
        assert_eq!(mps_meaning("0=2G,1=2G", Some(Devices::Known(2))).0, Some(2 << 30));
    }

    /// `why` says uncapped, with the reason, where the device count is not certain: a scheduler's ConfigMap in
    /// `envFrom` may set NVIDIA_VISIBLE_DEVICES; two of a shared GPU may be replicas of one card.
    #[test]
    fn says_uncapped_for_env_from_and_replicas() {
        let a = admission(&pod("  - name: main\n    image: x\n    resources: {limits: {nvidia.com/gpu: 1}}\n\
             \x20   envFrom: [{configMapRef: {name: gpu-sharing}}]\n    env:\n\
             \x20   - {name: CUDA_MPS_PINNED_DEVICE_MEM_LIMIT, value: \"0=3072M\"}\n"));
        assert!(!a.verdicts[0].capped);
        assert!(
            a.summary.starts_with(
                "main (an unknown number of devices) is UNCAPPED: NVIDIA_VISIBLE_DEVICES may come from envFrom entry 0 \
                 (a ConfigMap, read when the container starts): the device count is unknown at admission [ConfigMap \
                 gpu-sharing]"
            ),
            "{}",
            a.summary
        );
        let a = admission(&pod("  - name: main\n    image: x\n    resources: {limits: {nvidia.com/gpu.shared: 2}}\n\
             \x20   env:\n    - {name: CUDA_MPS_PINNED_DEVICE_MEM_LIMIT, value: \"0=3072M,1=3072M\"}\n"));
        assert!(!a.verdicts[0].capped);
        assert!(
            a.verdicts[0]
                .reason
                .as_deref()
                .is_some_and(|r| r.contains("nvidia.com/gpu.shared: 2") && r.contains("may be replicas of one card")),
            "{:?}",
            a.verdicts[0]
        );
        let a = admission(&pod("  - name: main\n    image: x\n    resources: {limits: {nvidia.com/gpu: 2}}\n"));
        assert!(a.summary.contains("(main: nvidia.com/gpu: 2 may be replicas of one card"), "{}", a.summary);
    }

    /// #32: `why` says what the status counts: the driver's reading, and every way to a GPU.
    #[test]
    fn says_uncapped_where_the_driver_ignores_the_value_or_the_devices_are_unknown() {
        let a =
            admission(&pod("  - name: main\n    image: x\n    resources: {limits: {nvidia.com/gpu: 1}}\n    env:\n\
             \x20   - {name: CUDA_MPS_PINNED_DEVICE_MEM_LIMIT, value: \"0=1000M,7=1M\"}\n"));
        assert!(
            a.summary.starts_with(
                "main (1 device(s)) is UNCAPPED: the driver ignores its CUDA_MPS_PINNED_DEVICE_MEM_LIMIT: entry 2 \
                 names device 7, which a container seeing 1 device(s) does not see"
            ),
            "{}",
            a.summary
        );
        assert!(!a.verdicts[0].capped);
        let a =
            admission(&pod("  - name: main\n    image: x\n    resources: {limits: {nvidia.com/gpu: 1}}\n    env:\n\
             \x20   - {name: NVIDIA_VISIBLE_DEVICES, value: all}\n\
             \x20   - {name: CUDA_MPS_PINNED_DEVICE_MEM_LIMIT, value: \"0=1000M\"}\n"));
        assert!(
            a.summary.starts_with("main (an unknown number of devices) is UNCAPPED: NVIDIA_VISIBLE_DEVICES=all"),
            "{}",
            a.summary
        );
        assert!(
            a.caps[0].meaning.contains("how many devices the container sees is not in the pod"),
            "{}",
            a.caps[0].meaning
        );
        let a = admission(&pod("  - {name: main, image: x, resources: {claims: [{name: gpu}]}}\n"));
        assert_eq!(a.gpu_containers, ["main"]);
        assert!(a.summary.ends_with("(main: a DRA resource claim (resources.claims): its devices are allocated at scheduling, not written in the pod)"), "{}", a.summary);
        let mut p =
            pod("  - name: main\n    image: x\n    resources: {limits: {nvidia.com/mig-1g.10gb: 1}}\n    env:\n\
             \x20   - {name: CUDA_MPS_PINNED_DEVICE_MEM_LIMIT, value: \"0=1024M\"}\n");
        p.spec.as_mut().unwrap().ephemeral_containers =
            Some(serde_yaml::from_str("[{name: debug, env: [{name: NVIDIA_VISIBLE_DEVICES, value: '0'}]}]").unwrap());
        let a = admission(&p);
        assert_eq!(a.gpu_containers, ["main", "debug"]);
        assert!(
            a.summary.starts_with(
                "main (1 device(s)) is capped by MPS at most 1Gi per process and device; debug (1 device(s)) is \
                 UNCAPPED: no CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"
            ),
            "{}",
            a.summary
        );
    }
}
