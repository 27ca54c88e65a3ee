//! Caps set at admission: which containers of a pod use GPUs, which driver variables a budget gives
//! them, how those merge with what the pod's author wrote, and whether a running pod's (immutable)
//! environment holds it to its budget. Pure: the operator's webhook, its status and `kubectl gpubudget
//! why` share it.
//!
//! The variables (measured on the H100, driver 580, and read from NVIDIA's docs; docs/operator.md):
//!
//! - `CUDA_MPS_PINNED_DEVICE_MEM_LIMIT`: enforced by an MPS daemon **per client process**, per device, as
//!   comma-separated `<device>=<amount>` entries (`0=8192M,1=8192M`), `<device>` the ordinal among the
//!   devices the process sees or a GPU UUID. A bare amount without `<device>=` is silently ignored by the
//!   driver, so this module always writes one entry per ordinal.
//! - `NVIDIA_GPU_MEMORY_LIMIT` / `NVIDIA_GPU_MEMORY_REQUEST`: MiB, read by the container toolkit's CDI hook
//!   (driver R615 and later) and applied to the container's cgroup as hard and soft limits.
//!
//! Amounts are whole MiB, rounded down (`floor(bytes / 1 MiB)`), so a cap is never above the budget. Each
//! GPU container gets the pod's whole limit: the MPS cap is per process, so a pod with several GPU
//! containers (or processes) can still hold more than its budget together; the agent's eviction stays
//! the backstop for that.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{Container, EnvVar, Pod};
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};

use crate::budget::Budget;

/// The MPS client's per-device memory cap.
pub const MPS_LIMIT: &str = "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT";
/// The container toolkit's hard limit (MiB).
pub const MEMORY_LIMIT: &str = "NVIDIA_GPU_MEMORY_LIMIT";
/// The container toolkit's soft limit (MiB).
pub const MEMORY_REQUEST: &str = "NVIDIA_GPU_MEMORY_REQUEST";
/// The extended resources that make a container a GPU container; the count is how many devices it sees.
pub const GPU_RESOURCES: [&str; 2] = ["nvidia.com/gpu", "nvidia.com/gpu.shared"];
/// The pod annotation the webhook writes: what it did, as JSON ([`Record`]). A report only: status counts
/// come from the environment, which nobody can change after creation.
pub const ANNOTATION: &str = "gpubudget.io/caps";
/// Devices written into the MPS variable at most (a larger count is treated as this many).
pub const MAX_DEVICES: u32 = 64;

const MIB: u64 = 1 << 20;

/// The caps a budget gives each GPU container, in MiB.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Caps {
    /// The hard cap: the budget's limit in whole MiB (rounded down).
    pub limit_mib: u64,
    /// The soft cap: the budget's request in whole MiB, when it sets one.
    pub request_mib: Option<u64>,
}

impl Caps {
    /// The caps of a budget with caps enabled; `None` when it has them disabled or its limit is under
    /// 1 MiB (a cap of 0 cannot be written: the toolkit would read it as no limit).
    pub fn of(budget: &Budget) -> Option<Self> {
        if !budget.admission_caps {
            return None;
        }
        Self::from_bytes(budget.limit_bytes, budget.request_bytes)
    }

    /// Caps from a limit and request in bytes (rounded down to MiB); `None` for a limit under 1 MiB.
    pub fn from_bytes(limit: u64, request: Option<u64>) -> Option<Self> {
        let limit_mib = limit / MIB;
        (limit_mib > 0).then(|| Self { limit_mib, request_mib: request.map(|r| r / MIB) })
    }
}

/// The value of one of the variables in a container's `env` (the entry that wins: the last of its name).
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum EnvValue {
    /// `value: ...` (an absent value is the empty string, as Kubernetes reads it).
    Literal(String),
    /// `valueFrom: ...`: unknown until the kubelet resolves it.
    FromSource,
}

/// What the caps module needs of one container.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
pub struct GpuContainer {
    /// The container's name.
    pub name: String,
    /// Devices it sees (the sum of its [`GPU_RESOURCES`] limits, at most [`MAX_DEVICES`]).
    pub devices: u32,
    /// `CUDA_MPS_PINNED_DEVICE_MEM_LIMIT`, if set in `env`.
    pub mps_limit: Option<EnvValue>,
    /// `NVIDIA_GPU_MEMORY_LIMIT`, if set in `env`.
    pub memory_limit: Option<EnvValue>,
    /// `NVIDIA_GPU_MEMORY_REQUEST`, if set in `env`.
    pub memory_request: Option<EnvValue>,
}

/// How many devices a container sees from its resource limits: the sum of its positive whole
/// [`GPU_RESOURCES`] counts, at most [`MAX_DEVICES`]; 0 for a container that is not a GPU container.
pub fn device_count<'a>(limits: impl IntoIterator<Item = (&'a str, &'a str)>) -> u32 {
    let total: u64 = limits
        .into_iter()
        .filter(|(name, _)| GPU_RESOURCES.contains(name))
        .filter_map(|(_, count)| count.trim().parse::<u64>().ok())
        .fold(0, u64::saturating_add);
    u32::try_from(total.min(u64::from(MAX_DEVICES))).unwrap_or(MAX_DEVICES)
}

/// The winning value of `name` in an `env` list (the last entry of that name, as the kubelet reads it).
pub fn env_value(env: &[EnvVar], name: &str) -> Option<EnvValue> {
    env.iter().rev().find(|e| e.name == name).map(|e| match (&e.value, &e.value_from) {
        (_, Some(_)) => EnvValue::FromSource,
        (value, None) => EnvValue::Literal(value.clone().unwrap_or_default()),
    })
}

impl GpuContainer {
    /// The container as the caps module sees it; `None` when it is not a GPU container.
    pub fn of(container: &Container) -> Option<Self> {
        let limits = container.resources.as_ref().and_then(|r| r.limits.as_ref());
        let devices = device_count(limits.iter().flat_map(|l| l.iter()).map(|(k, v)| (k.as_str(), v.0.as_str())));
        if devices == 0 {
            return None;
        }
        let env = container.env.as_deref().unwrap_or_default();
        Some(Self {
            name: container.name.clone(),
            devices,
            mps_limit: env_value(env, MPS_LIMIT),
            memory_limit: env_value(env, MEMORY_LIMIT),
            memory_request: env_value(env, MEMORY_REQUEST),
        })
    }
}

/// The GPU containers of a pod (init containers first, as they run), with their JSON pointer.
pub fn gpu_containers(pod: &Pod) -> Vec<(String, &Container, GpuContainer)> {
    let Some(spec) = pod.spec.as_ref() else { return Vec::new() };
    let init = spec.init_containers.iter().flatten().enumerate().map(|(i, c)| (format!("/spec/initContainers/{i}"), c));
    let main = spec.containers.iter().enumerate().map(|(i, c)| (format!("/spec/containers/{i}"), c));
    init.chain(main).filter_map(|(path, c)| GpuContainer::of(c).map(|g| (path, c, g))).collect()
}

// ---- the MPS variable ------------------------------------------------------------------------------------

/// One `<device>=<amount>` entry of the MPS variable, as written.
#[derive(Debug, Clone, PartialEq, Eq)]
struct MpsEntry {
    device: String,
    /// The amount in MiB, read the largest way its unit can be read (binary), so a kept value is never
    /// above the cap whichever way the driver reads it; `None`: not an amount.
    mib: Option<u64>,
    text: String,
}

/// An amount as the MPS variable writes it (`4G`, `6000M`, `512MB`, `1T`; a bare number is bytes), in bytes,
/// its unit read as binary (the larger reading, so a value compared with a cap is never underestimated).
pub fn mps_amount_bytes(text: &str) -> Option<u64> {
    let text = text.trim();
    let end = text.find(|c: char| !c.is_ascii_digit()).unwrap_or(text.len());
    let (number, unit) = text.split_at(end);
    let number: u64 = number.parse().ok()?;
    let bytes_per: u64 = match unit.to_ascii_uppercase().as_str() {
        "" | "B" => 1,
        "K" | "KB" | "KI" | "KIB" => 1 << 10,
        "M" | "MB" | "MI" | "MIB" => 1 << 20,
        "G" | "GB" | "GI" | "GIB" => 1 << 30,
        "T" | "TB" | "TI" | "TIB" => 1 << 40,
        _ => return None,
    };
    number.checked_mul(bytes_per)
}

/// [`mps_amount_bytes`] in MiB, rounded up.
fn mps_amount_mib(text: &str) -> Option<u64> {
    Some(mps_amount_bytes(text)?.div_ceil(MIB))
}

fn valid_device(device: &str) -> bool {
    !device.is_empty()
        && (device.bytes().all(|b| b.is_ascii_digit())
            || ((device.starts_with("GPU-") || device.starts_with("MIG-"))
                && device.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'/')))
}

/// The entries of an MPS variable; entries that are not `<device>=<amount>` come back with no device.
fn mps_entries(value: &str) -> Vec<MpsEntry> {
    value
        .split(',')
        .map(str::trim)
        .filter(|e| !e.is_empty())
        .map(|entry| match entry.split_once('=') {
            Some((device, amount)) if valid_device(device.trim()) => {
                MpsEntry { device: device.trim().to_owned(), mib: mps_amount_mib(amount), text: entry.to_owned() }
            }
            _ => MpsEntry { device: String::new(), mib: None, text: entry.to_owned() },
        })
        .collect()
}

/// Per device, the largest amount the entries give it (`None` if one of them is not an amount).
fn per_device(entries: &[MpsEntry]) -> BTreeMap<&str, Option<u64>> {
    let mut out: BTreeMap<&str, Option<u64>> = BTreeMap::new();
    for e in entries.iter().filter(|e| !e.device.is_empty()) {
        let slot = out.entry(e.device.as_str()).or_insert(Some(0));
        *slot = match (*slot, e.mib) {
            (Some(a), Some(b)) => Some(a.max(b)),
            _ => None,
        };
    }
    out
}

/// The MPS variable for a container seeing `devices` devices, capped at `cap_mib` each, keeping what the
/// user wrote where it is at most the cap.
///
/// Every ordinal `0..devices` gets the user's entry if every entry for it is an amount at most the cap
/// (the smallest of them, as written), else `<i>=<cap>M`. Entries naming a GPU UUID (or an ordinal the
/// container does not see) are kept only under the same condition. Anything else is dropped.
pub fn merge_mps(user: Option<&str>, devices: u32, cap_mib: u64) -> String {
    let entries = user.map(mps_entries).unwrap_or_default();
    let worst = per_device(&entries);
    let fits = |device: &str| worst.get(device).is_some_and(|m| m.is_some_and(|m| m <= cap_mib));
    let smallest =
        |device: &str| entries.iter().filter(|e| e.device == device).min_by_key(|e| e.mib).map(|e| e.text.clone());
    let mut out = Vec::new();
    for i in 0..devices {
        let device = i.to_string();
        out.push(match smallest(&device).filter(|_| fits(&device)) {
            Some(text) => text,
            None => format!("{i}={cap_mib}M"),
        });
    }
    let mut seen: Vec<&str> = Vec::new();
    for e in &entries {
        let ordinal_in_range = e.device.parse::<u32>().is_ok_and(|i| i < devices);
        if e.device.is_empty() || ordinal_in_range || seen.contains(&e.device.as_str()) {
            continue;
        }
        seen.push(&e.device);
        if let Some(text) = smallest(&e.device).filter(|_| fits(&e.device)) {
            out.push(text);
        }
    }
    out.join(",")
}

/// The MiB variable's value: the user's if it is a whole number of MiB at most `cap_mib`, else the cap.
/// Returns the value and whether the user's was kept.
fn merge_mib(user: Option<&EnvValue>, cap_mib: u64) -> (String, bool) {
    match user {
        Some(EnvValue::Literal(text)) if text.trim().parse::<u64>().is_ok_and(|v| v > 0 && v <= cap_mib) => {
            (text.clone(), true)
        }
        _ => (cap_mib.to_string(), false),
    }
}

// ---- admission -------------------------------------------------------------------------------------------

/// What was done to one container's variable.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub enum Outcome {
    /// Absent: set.
    Set,
    /// The user's value was at most the cap: kept as written.
    Kept,
    /// The user's value was above the cap: lowered.
    Lowered,
    /// The user's value was not a value the driver reads (or came from `valueFrom`): replaced.
    Replaced,
}

/// What the webhook did to one GPU container.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ContainerRecord {
    /// The container's name.
    pub name: String,
    /// Devices it sees.
    pub devices: u32,
    /// Per variable, what was done.
    pub env: BTreeMap<String, Outcome>,
}

/// The `gpubudget.io/caps` annotation: what the webhook did at creation.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Record {
    /// The budget that applied, as a pod's record names it: its name, or `ClusterGpuMemoryBudget/<name>`.
    pub budget: String,
    /// The hard cap, MiB.
    pub limit_mib: u64,
    /// The soft cap, MiB (when the budget has a request).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub request_mib: Option<u64>,
    /// Each GPU container.
    pub containers: Vec<ContainerRecord>,
}

impl Record {
    /// One line for events and logs: `budget llm: 8192 MiB per device; main set, side kept 1 of 2`.
    pub fn summary(&self) -> String {
        let containers: Vec<String> = self
            .containers
            .iter()
            .map(|c| {
                let changed = c.env.values().filter(|o| **o != Outcome::Kept).count();
                format!("{} ({} device(s), {changed} of {} variables set)", c.name, c.devices, c.env.len())
            })
            .collect();
        let request = self.request_mib.map(|r| format!(", request {r} MiB")).unwrap_or_default();
        format!(
            "budget {}: limit {} MiB per GPU container{request}; {}",
            self.budget,
            self.limit_mib,
            if containers.is_empty() { "no GPU container".to_owned() } else { containers.join(", ") }
        )
    }
}

/// The admission's result: JSON patch operations and the record (also in the patch, as the annotation).
#[derive(Debug, Clone, PartialEq)]
pub struct Admission {
    /// RFC 6902 operations, applied in order.
    pub patch: Vec<Value>,
    /// What was done; `None` when no budget with caps applies (the patch then only removes a
    /// `gpubudget.io/caps` annotation the pod's author wrote).
    pub record: Option<Record>,
}

fn escape(key: &str) -> String {
    key.replace('~', "~0").replace('/', "~1")
}

/// The env ops for one container at `path`: replace the winning entry of each variable, or append.
fn env_ops(path: &str, container: &Container, values: &[(&str, String)], ops: &mut Vec<Value>) {
    let env = container.env.as_deref().unwrap_or_default();
    if env.is_empty() {
        let list: Vec<Value> = values.iter().map(|(n, v)| json!({"name": n, "value": v})).collect();
        ops.push(json!({"op": "add", "path": format!("{path}/env"), "value": list}));
        return;
    }
    for (name, value) in values {
        let entry = json!({"name": name, "value": value});
        match env.iter().rposition(|e| e.name == *name) {
            Some(i) if env[i].value.as_deref() == Some(value.as_str()) && env[i].value_from.is_none() => {}
            Some(i) => ops.push(json!({"op": "replace", "path": format!("{path}/env/{i}"), "value": entry})),
            None => ops.push(json!({"op": "add", "path": format!("{path}/env/-"), "value": entry})),
        }
    }
}

fn outcome(user: Option<&EnvValue>, kept: bool, parses: impl Fn(&str) -> bool) -> Outcome {
    match user {
        None => Outcome::Set,
        Some(_) if kept => Outcome::Kept,
        Some(EnvValue::Literal(text)) if parses(text) => Outcome::Lowered,
        Some(_) => Outcome::Replaced,
    }
}

/// What admission does to a pod being created, given the budget that applies to it (after
/// [`crate::resolve`]) if any: with caps enabled, each GPU container's variables are set or merged and the
/// annotation records it; otherwise only an annotation the author wrote is removed. Nothing else in the
/// pod is touched.
pub fn admit(pod: &Pod, budget: Option<&Budget>) -> Admission {
    let annotations = pod.metadata.annotations.as_ref();
    let forged = annotations.is_some_and(|a| a.contains_key(ANNOTATION));
    let annotation_path = format!("/metadata/annotations/{}", escape(ANNOTATION));
    let Some((budget, caps)) = budget.and_then(|b| Caps::of(b).map(|c| (b, c))) else {
        let patch = if forged { vec![json!({"op": "remove", "path": annotation_path})] } else { Vec::new() };
        return Admission { patch, record: None };
    };
    let mut ops = Vec::new();
    let mut containers = Vec::new();
    for (path, container, gpu) in gpu_containers(pod) {
        let mut env = BTreeMap::new();
        let mut values = Vec::new();
        let user_mps = match &gpu.mps_limit {
            Some(EnvValue::Literal(text)) => Some(text.as_str()),
            _ => None,
        };
        let mps = merge_mps(user_mps, gpu.devices, caps.limit_mib);
        let mps_outcome = match &gpu.mps_limit {
            None => Outcome::Set,
            Some(EnvValue::FromSource) => Outcome::Replaced,
            Some(EnvValue::Literal(text)) if *text == mps => Outcome::Kept,
            Some(EnvValue::Literal(text)) => {
                let any_amount = mps_entries(text).iter().any(|e| !e.device.is_empty() && e.mib.is_some());
                if any_amount { Outcome::Lowered } else { Outcome::Replaced }
            }
        };
        env.insert(MPS_LIMIT.to_owned(), mps_outcome);
        values.push((MPS_LIMIT, mps));
        let whole = |t: &str| t.trim().parse::<u64>().is_ok();
        let (limit, kept) = merge_mib(gpu.memory_limit.as_ref(), caps.limit_mib);
        env.insert(MEMORY_LIMIT.to_owned(), outcome(gpu.memory_limit.as_ref(), kept, whole));
        values.push((MEMORY_LIMIT, limit));
        if let Some(request_mib) = caps.request_mib.filter(|r| *r > 0) {
            let (request, kept) = merge_mib(gpu.memory_request.as_ref(), request_mib);
            env.insert(MEMORY_REQUEST.to_owned(), outcome(gpu.memory_request.as_ref(), kept, whole));
            values.push((MEMORY_REQUEST, request));
        }
        env_ops(&path, container, &values, &mut ops);
        containers.push(ContainerRecord { name: gpu.name, devices: gpu.devices, env });
    }
    let record =
        Record { budget: budget.record_name(), limit_mib: caps.limit_mib, request_mib: caps.request_mib, containers };
    let text = serde_json::to_string(&record).unwrap_or_default();
    if annotations.is_none() {
        ops.push(json!({"op": "add", "path": "/metadata/annotations", "value": {ANNOTATION: text}}));
    } else {
        ops.push(json!({"op": if forged { "replace" } else { "add" }, "path": annotation_path, "value": text}));
    }
    Admission { patch: ops, record: Some(record) }
}

// ---- running pods ----------------------------------------------------------------------------------------

/// The record the webhook wrote on a pod (`gpubudget.io/caps`), if it parses. A report of what was done at
/// creation, not proof that the pod is capped: [`assess`] reads the environment for that.
pub fn record_of(pod: &Pod) -> Option<Record> {
    serde_json::from_str(pod.metadata.annotations.as_ref()?.get(ANNOTATION)?).ok()
}

/// Whether a running pod's environment holds it to its budget's caps.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Assessment {
    /// No GPU container: nothing to cap.
    NoGpu,
    /// Every GPU container is capped at most at the budget, on every device it sees.
    Capped,
    /// Some GPU container has no MPS cap at all (created before caps were enabled, while the webhook was
    /// down, or outside its scope).
    Uncapped,
    /// Capped, but some cap is above the budget's limit now (the limit was lowered after the pod was
    /// created: its environment is fixed; eviction holds it to the new limit).
    AboveLimit,
}

/// How a running pod's GPU containers stand against the caps.
pub fn assess(containers: &[GpuContainer], caps: Caps) -> Assessment {
    if containers.is_empty() {
        return Assessment::NoGpu;
    }
    let mut worst = Assessment::Capped;
    for c in containers {
        let entries = match &c.mps_limit {
            Some(EnvValue::Literal(text)) => mps_entries(text),
            _ => Vec::new(),
        };
        let devices = per_device(&entries);
        let mut capped = 0;
        let mut above = false;
        for i in 0..c.devices {
            if let Some(Some(mib)) = devices.get(i.to_string().as_str()) {
                capped += 1;
                above |= *mib > caps.limit_mib;
            }
        }
        // UUID entries can name the device too; count them only against the cap.
        above |= devices.iter().any(|(d, m)| d.parse::<u32>().is_err() && m.is_some_and(|m| m > caps.limit_mib));
        let limit_above = matches!(&c.memory_limit, Some(EnvValue::Literal(t)) if t.trim().parse::<u64>().is_ok_and(|v| v > caps.limit_mib));
        if capped < c.devices {
            return Assessment::Uncapped;
        }
        if above || limit_above {
            worst = Assessment::AboveLimit;
        }
    }
    worst
}

#[cfg(test)]
mod tests;
