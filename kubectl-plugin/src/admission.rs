//! GPU memory caps set in the pod spec at admission: the environment of the pod's GPU containers.
//!
//! gpubudget's caps webhook sets them for budgets with `admissionCaps: Enabled` (docs/operator.md) and records
//! it in `gpubudget.io/caps`; the pod's owner or another webhook may set them too. This reads what the spec
//! holds, and says what each variable caps and where it does not. Which containers are GPU containers and how
//! an MPS amount reads come from `gpubudget_common::caps`, as the webhook and the operator read them.
//! - `CUDA_MPS_PINNED_DEVICE_MEM_LIMIT` (`0=4G,1=2G` or `<GPU UUID>=4G`): the driver caps each MPS client
//!   *process* on that device, only with an MPS control daemon; a value without a device (`4G`) is ignored.
//! - `NVIDIA_GPU_MEMORY_LIMIT` / `NVIDIA_GPU_MEMORY_REQUEST` (MiB): nvidia-container-toolkit's CDI hook
//!   applies them to the container's cgroup as hard / soft limits, on driver R615 or newer only.

use gpubudget_common::caps;
use gpubudget_common::quantity::HumanBytes;
use k8s_openapi::api::core::v1::{Container, Pod};
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
    /// Containers whose limits ask for `nvidia.com/gpu` or `nvidia.com/gpu.shared` (init containers first).
    pub gpu_containers: Vec<String>,
    /// What gpubudget's caps webhook did at creation (its `gpubudget.io/caps` record), when it did.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub set_by_gpubudget: Option<String>,
    /// Every cap variable found, one per container and variable.
    pub caps: Vec<Cap>,
    /// The sentence `why` prints.
    pub summary: String,
}

/// One cap variable in one container.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Cap {
    pub container: String,
    pub variable: String,
    /// The value as written; `valueFrom` when it comes from a ConfigMap, Secret or field.
    pub value: String,
    /// The bytes it caps, when it caps (per process for MPS, per container for the toolkit's).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub bytes: Option<u64>,
    /// What it caps, and where it does not.
    pub meaning: String,
}

fn is_gpu_container(c: &Container) -> bool {
    caps::GpuContainer::of(c).is_some()
}

/// A size as MPS writes it (binary units), as the webhook reads it.
fn mps_size(text: &str) -> Option<u64> {
    caps::mps_amount_bytes(text)
}

fn mps_meaning(value: &str) -> (Option<u64>, String) {
    let mut capped = Vec::new();
    let mut ignored = Vec::new();
    for part in value.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        match part.split_once('=').and_then(|(dev, size)| Some((dev, mps_size(size)?))) {
            Some((dev, bytes)) if !dev.is_empty() => capped.push((dev.to_owned(), bytes)),
            _ => ignored.push(part.to_owned()),
        }
    }
    let mut text = match capped.as_slice() {
        [] => "caps nothing".to_owned(),
        list => format!(
            "the driver caps each MPS client process at {} (only while an MPS control daemon serves the GPU; \
             per process, not per pod)",
            list.iter().map(|(d, b)| format!("{} on device {d}", HumanBytes(*b))).collect::<Vec<_>>().join(", ")
        ),
    };
    if !ignored.is_empty() {
        text.push_str(&format!(
            "; ignored by the driver: {} (write DEVICE=SIZE, such as 0=4G or GPU-<uuid>=4G)",
            ignored.join(", ")
        ));
    }
    (capped.iter().map(|(_, b)| *b).max(), text)
}

fn toolkit_meaning(variable: &str, value: &str) -> (Option<u64>, String) {
    let kind = if variable == NVIDIA_LIMIT { "hard limit" } else { "soft limit" };
    match value.trim().parse::<u64>().ok().and_then(|mib| mib.checked_mul(1 << 20)) {
        Some(bytes) => (
            Some(bytes),
            format!(
                "a {kind} of {} on this container's cgroup, applied by nvidia-container-toolkit's CDI hook on \
                 driver R615 or newer (older drivers: not applied)",
                HumanBytes(bytes)
            ),
        ),
        None => (None, format!("{value:?} is not a number of MiB: the toolkit applies nothing")),
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

/// The caps the pod spec sets, for [`crate::why`].
pub fn admission(pod: &Pod) -> Admission {
    let containers: Vec<&Container> =
        pod.spec.iter().flat_map(|s| s.init_containers.iter().flatten().chain(s.containers.iter())).collect();
    let gpu: Vec<&Container> = containers.iter().copied().filter(|c| is_gpu_container(c)).collect();
    // Without a GPU resource (time-slicing by a device plugin under another name, say), every container.
    let looked_at = if gpu.is_empty() { &containers } else { &gpu };
    let mut caps = Vec::new();
    for c in looked_at {
        for env in c.env.iter().flatten() {
            if ![MPS_LIMIT, NVIDIA_LIMIT, NVIDIA_REQUEST].contains(&env.name.as_str()) {
                continue;
            }
            let (value, (bytes, meaning)) = match (&env.value, &env.value_from) {
                (Some(v), _) => {
                    let m = if env.name == MPS_LIMIT { mps_meaning(v) } else { toolkit_meaning(&env.name, v) };
                    (v.clone(), m)
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
            caps.push(Cap { container: c.name.clone(), variable: env.name.clone(), value, bytes, meaning });
        }
    }
    let gpu_containers: Vec<String> = gpu.iter().map(|c| c.name.clone()).collect();
    let set_by_gpubudget = caps::record_of(pod).map(|r| format!("cap set at admission by gpubudget: {}", r.summary()));
    let summary = if caps.is_empty() {
        uncapped(&gpu_containers)
    } else {
        caps.iter()
            .map(|c| format!("{} {}={}: {}", c.container, c.variable, c.value, c.meaning))
            .collect::<Vec<_>>()
            .join("; ")
    };
    let summary = match &set_by_gpubudget {
        Some(set) => format!("{set}; {summary}"),
        None => summary,
    };
    Admission { gpu_containers, caps, set_by_gpubudget, summary }
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
        assert_eq!(found, [(MPS_LIMIT, Some(4 << 30)), (NVIDIA_LIMIT, Some(8 << 30)), (NVIDIA_REQUEST, None)]);
        assert!(
            a.caps[0].meaning.contains("4Gi on device 0") && a.caps[0].meaning.contains("ignored by the driver: 4G")
        );
        assert!(a.caps[1].meaning.starts_with("a hard limit of 8Gi"), "{}", a.caps[1].meaning);
        assert!(a.caps[2].meaning.contains("not a number of MiB"));
        assert!(a.summary.starts_with("server CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=4G,4G: "), "{}", a.summary);
    }

    #[test]
    fn mps_sizes() {
        assert_eq!(mps_size("4G"), Some(4 << 30));
        assert_eq!(mps_size("512MB"), Some(512 << 20));
        assert_eq!(mps_size("6000M"), Some(6000 << 20));
        assert_eq!(mps_size("1024"), None, "bytes: the driver ignores them");
        assert_eq!(mps_size("lots"), None);
        assert_eq!(mps_meaning("GPU-1234=2G").0, Some(2 << 30));
        assert_eq!(mps_meaning("=2G").0, None);
    }
}
