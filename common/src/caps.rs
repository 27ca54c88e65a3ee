//! Caps set at admission: which containers of a pod use GPUs and how many devices each sees, which driver
//! variables a budget gives them, how those merge with what the pod's author wrote, and whether a running
//! pod's (immutable) environment holds it to its budget. Pure: the operator's webhook, its status and
//! `kubectl gpubudget why` share it.
//!
//! The variables (measured on the H100, driver 580, and read from NVIDIA's docs; docs/operator.md):
//!
//! - `CUDA_MPS_PINNED_DEVICE_MEM_LIMIT`: enforced by an MPS daemon **per client process**, per device, as
//!   comma-separated `<device>=<amount>` entries (`0=8192M,1=8192M`), `<device>` the ordinal among the
//!   devices the process sees or a GPU UUID. The driver's reading is unforgiving and silent ([`read_mps`]):
//!   one entry it cannot read, an amount in `K`, in bytes or of 0, or an entry for an ordinal the process
//!   does not see, and it ignores **the whole variable** (the process runs uncapped). So this module writes
//!   only the canonical form `<i>=<MiB>M` for exactly the ordinals `0..n` a container sees, and only when
//!   it knows `n` for certain ([`Devices`]): not where a resource asked more than once may be replicas of one
//!   card ([`gpu_limits`]), nor where `NVIDIA_VISIBLE_DEVICES` may come from `valueFrom` or `envFrom`
//!   ([`container_value`]). Status counts such a container uncapped, with the reason.
//! - `NVIDIA_GPU_MEMORY_LIMIT` / `NVIDIA_GPU_MEMORY_REQUEST`: MiB, read by the container toolkit's CDI hook
//!   (driver R615 and later) and applied to the container's cgroup as hard and soft limits. Written as plain
//!   positive decimal integers.
//!
//! Amounts are whole MiB, rounded down (`floor(bytes / 1 MiB)`), so a cap is never above the budget. Each
//! GPU container gets the pod's whole limit: the MPS cap is per process, so a pod with several GPU
//! containers (or processes) can still hold more than its budget together; the agent's eviction stays
//! the backstop for that.
//!
//! Bounded and linear: a variable's value is read in one pass, and a value longer than [`MAX_ENV_VALUE`]
//! (which Linux refuses at exec anyway) is never read: it is replaced, or for `NVIDIA_VISIBLE_DEVICES`
//! makes the device count unknown.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use k8s_openapi::api::core::v1::{Container, EnvFromSource, EnvVar, EphemeralContainer, Pod, ResourceRequirements};
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};

use crate::budget::Budget;

/// The MPS client's per-device memory cap.
pub const MPS_LIMIT: &str = "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT";
/// The container toolkit's hard limit (MiB).
pub const MEMORY_LIMIT: &str = "NVIDIA_GPU_MEMORY_LIMIT";
/// The container toolkit's soft limit (MiB).
pub const MEMORY_REQUEST: &str = "NVIDIA_GPU_MEMORY_REQUEST";
/// The container runtime's list of devices to expose (`all`, indices, `GPU-`/`MIG-` UUIDs; `none`, `void`
/// or empty: none).
pub const VISIBLE_DEVICES: &str = "NVIDIA_VISIBLE_DEVICES";
/// The variables this module reads of a container's `env`.
pub const VARIABLES: [&str; 4] = [MPS_LIMIT, MEMORY_LIMIT, MEMORY_REQUEST, VISIBLE_DEVICES];
/// The extended resources that give a container whole or shared GPUs; the count is how many devices it sees.
pub const GPU_RESOURCES: [&str; 2] = [crate::share::GPU, crate::share::GPU_SHARED];
/// The prefix of the MIG extended resources (`nvidia.com/mig-1g.10gb`): each counts as one device seen.
pub const MIG_RESOURCE_PREFIX: &str = "nvidia.com/mig-";
/// The pod annotation the webhook writes: what it did, as JSON ([`Record`]). A report only: status counts
/// come from the environment, which nobody can change after creation.
pub const ANNOTATION: &str = "gpubudget.io/caps";
/// Devices written into the MPS variable at most; a container seeing more has an unknown count.
pub const MAX_DEVICES: u32 = 64;
/// The longest variable value read, in bytes: Linux refuses one environment string over 128 KiB at exec
/// (`MAX_ARG_STRLEN`, measured: "Argument list too long"), so no container that starts needs more. Longer
/// values are never parsed.
pub const MAX_ENV_VALUE: usize = 128 * 1024;

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
    /// 1 MiB (a cap of 0 cannot be written: the driver ignores it, the toolkit reads it as no limit).
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

/// The value of one of the variables in a container's environment: the winning entry of its `env` (the last
/// of its name), else an `envFrom` entry that may set it (`env` wins over `envFrom` in Kubernetes).
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum EnvValue {
    /// `value: ...` (an absent value is the empty string, as Kubernetes reads it).
    Literal(String),
    /// `valueFrom: ...`: unknown until the kubelet resolves it.
    FromSource,
    /// Not in `env`, but `envFrom` entry `entry` (from 0; the last that may) can set it: a ConfigMap or
    /// Secret the kubelet reads when the container starts, so whether it does, and to what, is not in the
    /// pod.
    FromEnvFrom {
        /// The `envFrom` entry, from 0.
        entry: u32,
        /// A Secret (else a ConfigMap).
        secret: bool,
    },
}

impl EnvValue {
    /// The literal text, if any.
    pub fn literal(&self) -> Option<&str> {
        match self {
            Self::Literal(text) => Some(text),
            Self::FromSource | Self::FromEnvFrom { .. } => None,
        }
    }

    /// The value as `env` holds it: `None` for one only `envFrom` may set (an entry the webhook writes in
    /// `env` overrides it, so it is nothing to merge with).
    fn in_env(&self) -> Option<&Self> {
        (!matches!(self, Self::FromEnvFrom { .. })).then_some(self)
    }
}

/// `a ConfigMap` or `a Secret`.
fn source_kind(secret: bool) -> &'static str {
    if secret { "a Secret" } else { "a ConfigMap" }
}

// ---- which containers use GPUs, and how many devices they see ---------------------------------------------

/// Why the number of devices a GPU container sees is not known from its pod. Without it no MPS value can be
/// written safely (an entry for an ordinal the process does not see voids the whole value), so such a
/// container gets no MPS cap and is counted uncapped, with this as the reason.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, thiserror::Error)]
pub enum Unknown {
    /// `NVIDIA_VISIBLE_DEVICES=all`.
    #[error("NVIDIA_VISIBLE_DEVICES=all: the container may see every GPU of its node, how many is not in the pod")]
    All,
    /// `NVIDIA_VISIBLE_DEVICES` from `valueFrom`.
    #[error("NVIDIA_VISIBLE_DEVICES is set through valueFrom: which devices the container sees is not in the pod")]
    VisibleFromSource,
    /// `NVIDIA_VISIBLE_DEVICES` not in `env`, and an `envFrom` entry may set it (a GPU-sharing scheduler's
    /// ConfigMap holding `NVIDIA_VISIBLE_DEVICES=all`, say).
    #[error(
        "NVIDIA_VISIBLE_DEVICES may come from envFrom entry {entry} ({}, read when the container starts): the \
         device count is unknown at admission",
        source_kind(*secret)
    )]
    VisibleFromEnvFrom {
        /// The `envFrom` entry, from 0.
        entry: u32,
        /// A Secret (else a ConfigMap).
        secret: bool,
    },
    /// A value that is not a list of indices or UUIDs (or is longer than [`MAX_ENV_VALUE`]).
    #[error("NVIDIA_VISIBLE_DEVICES is not a list of device indices or GPU-/MIG- UUIDs")]
    VisibleUnreadable,
    /// Indices and UUIDs mixed, or a device listed twice: the runtime may show fewer devices than listed.
    #[error(
        "NVIDIA_VISIBLE_DEVICES mixes indices and UUIDs or repeats a device: how many the container sees is not certain"
    )]
    VisibleMixed,
    /// `NVIDIA_VISIBLE_DEVICES` lists another number of devices than its GPU limits ask for.
    #[error(
        "NVIDIA_VISIBLE_DEVICES lists {listed} device(s) where its limits ask for {limits}: which the container \
         sees depends on the runtime"
    )]
    Disagree {
        /// Devices the limits ask for.
        limits: u32,
        /// Devices the variable lists.
        listed: u32,
    },
    /// More than one of a GPU resource the device plugin may hand out as replicas of one card (time-slicing
    /// or MPS sharing): the process may see fewer devices than it asked for, and an MPS entry for an ordinal it
    /// does not see voids the whole value.
    #[error("{}", replicas_reason(*resource, *count))]
    Replicas {
        /// Which kind of resource.
        resource: Replicated,
        /// How many it asks for.
        count: u32,
    },
    /// A DRA claim (`resources.claims`): its devices are allocated at scheduling.
    #[error("a DRA resource claim (resources.claims): its devices are allocated at scheduling, not written in the pod")]
    Claim,
    /// More than [`MAX_DEVICES`].
    #[error("more than 64 devices")]
    TooMany,
}

/// A GPU resource asked for more than once that may be replicas of one card ([`Unknown::Replicas`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Replicated {
    /// A `.shared` resource (`nvidia.com/gpu.shared`): the device plugin's replicas, renamed.
    Shared,
    /// `nvidia.com/gpu`: time-slicing (`renameByDefault: false`, the default) keeps the name.
    Gpu,
    /// A MIG profile (`nvidia.com/mig-...`), which the device plugin can replicate as it does whole GPUs.
    Mig,
}

fn replicas_reason(resource: Replicated, count: u32) -> String {
    match resource {
        Replicated::Shared => format!(
            "nvidia.com/gpu.shared: {count} (a shared GPU's replicas) may be replicas of one card: the device count is \
             uncertain"
        ),
        Replicated::Gpu => format!(
            "nvidia.com/gpu: {count} may be replicas of one card (the device plugin's time-slicing keeps the name \
             nvidia.com/gpu by default): the device count is uncertain; a pod whose nodeSelector pins \
             nvidia.com/gpu.sharing-strategy: none (or nvidia.com/gpu.replicas: \"1\") gets whole GPUs"
        ),
        Replicated::Mig => format!(
            "a MIG resource asked {count} times may be replicas of one instance (the device plugin can time-slice MIG \
             devices too): the device count is uncertain; a pod whose nodeSelector pins <resource>.sharing-strategy: \
             none (or <resource>.replicas: \"1\") gets whole instances"
        ),
    }
}

/// How many devices a GPU container sees.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Devices {
    /// Exactly this many (at least 1): ordinals `0..n`.
    Known(u32),
    /// Not known from the pod.
    Unknown(Unknown),
}

impl Default for Devices {
    fn default() -> Self {
        Self::Known(1)
    }
}

impl Devices {
    /// The count, when known.
    pub fn known(self) -> Option<u32> {
        match self {
            Self::Known(n) => Some(n),
            Self::Unknown(_) => None,
        }
    }
}

impl std::fmt::Display for Devices {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Known(n) => write!(f, "{n} device(s)"),
            Self::Unknown(_) => f.write_str("an unknown number of devices"),
        }
    }
}

/// What `NVIDIA_VISIBLE_DEVICES` asks the runtime for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Visible {
    /// `none`, `void` or empty: no device.
    Nothing,
    /// This many distinct devices.
    Listed(u32),
    /// Some devices, how many is unknown.
    Unknown(Unknown),
}

fn visible(value: &EnvValue) -> Visible {
    let text = match value {
        EnvValue::FromSource => return Visible::Unknown(Unknown::VisibleFromSource),
        &EnvValue::FromEnvFrom { entry, secret } => {
            return Visible::Unknown(Unknown::VisibleFromEnvFrom { entry, secret });
        }
        EnvValue::Literal(text) if text.len() > MAX_ENV_VALUE => return Visible::Unknown(Unknown::VisibleUnreadable),
        EnvValue::Literal(text) => text.as_str(),
    };
    match text {
        "" | "none" | "void" => return Visible::Nothing,
        "all" => return Visible::Unknown(Unknown::All),
        _ => {}
    }
    let (mut indices, mut uuids) = (Vec::new(), Vec::new());
    for entry in text.split(',') {
        if !entry.is_empty() && entry.bytes().all(|b| b.is_ascii_digit()) {
            indices.push(entry);
        } else if valid_uuid(entry) {
            uuids.push(entry);
        } else {
            return Visible::Unknown(Unknown::VisibleUnreadable);
        }
        if indices.len() + uuids.len() > MAX_DEVICES as usize {
            return Visible::Unknown(Unknown::TooMany);
        }
    }
    if !indices.is_empty() && !uuids.is_empty() {
        return Visible::Unknown(Unknown::VisibleMixed);
    }
    let mut all: Vec<&str> = indices.into_iter().chain(uuids).collect();
    let listed = all.len();
    all.sort_unstable();
    all.dedup();
    if all.len() != listed {
        return Visible::Unknown(Unknown::VisibleMixed);
    }
    Visible::Listed(u32::try_from(listed).unwrap_or(MAX_DEVICES))
}

/// A `GPU-<uuid>` or `MIG-<...>` device name.
fn valid_uuid(name: &str) -> bool {
    name.len() > 4
        && (name.starts_with("GPU-") || name.starts_with("MIG-"))
        && name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'/')
}

/// Whether an extended resource gives a container GPU devices: [`GPU_RESOURCES`] or a MIG profile.
pub fn is_gpu_resource(name: &str) -> bool {
    GPU_RESOURCES.contains(&name) || name.strip_prefix(MIG_RESOURCE_PREFIX).is_some_and(|p| !p.is_empty())
}

/// How many devices a container's resource limits give it: the sum of its positive whole GPU and MIG counts
/// ([`is_gpu_resource`]), saturating.
pub fn limit_devices<'a>(limits: impl IntoIterator<Item = (&'a str, &'a str)>) -> u64 {
    gpu_limits(limits, None).count
}

/// What a container's GPU and MIG limits ask for ([`gpu_limits`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct GpuLimits {
    /// The sum of the positive counts, saturating.
    pub count: u64,
    /// Why those may not be as many distinct devices: a resource asked more than once that the device plugin
    /// may hand out as replicas of one card ([`Unknown::Replicas`]).
    pub replicas: Option<Unknown>,
}

/// The GPU resources of a container's limits, and whether their count is that of distinct devices.
///
/// The NVIDIA device plugin's sharing (time-slicing, MPS) advertises each card as several replicas, and may
/// give one container two replicas of the same card: the process then sees one device. So a resource asked
/// for more than once is counted distinct devices only where replicas cannot be:
/// - a `.shared` resource (`nvidia.com/gpu.shared`, the renamed replicas): never;
/// - `nvidia.com/gpu` or a MIG profile (time-slicing keeps the name unless `renameByDefault`): only when the
///   pod's `nodeSelector` pins nodes that do not share it, by the labels the GPU feature discovery sets there
///   (`<resource>.sharing-strategy: none` or `<resource>.replicas: "1"`; the scheduler keeps the pod off
///   any other node).
///
/// One of a resource is one device, replica or not (ordinal 0 is right either way).
pub fn gpu_limits<'a>(
    limits: impl IntoIterator<Item = (&'a str, &'a str)>,
    node_selector: Option<&BTreeMap<String, String>>,
) -> GpuLimits {
    let mut out = GpuLimits::default();
    for (name, count) in limits.into_iter().filter(|(name, _)| is_gpu_resource(name)) {
        let Some(count) = count.trim().parse::<u64>().ok() else { continue };
        out.count = out.count.saturating_add(count);
        if count <= 1 || out.replicas.is_some() {
            continue;
        }
        let resource = if name.ends_with(".shared") {
            Replicated::Shared
        } else if unshared(name, node_selector) {
            continue;
        } else if name.starts_with(MIG_RESOURCE_PREFIX) {
            Replicated::Mig
        } else {
            Replicated::Gpu
        };
        out.replicas = Some(Unknown::Replicas { resource, count: u32::try_from(count).unwrap_or(u32::MAX) });
    }
    out
}

/// Whether a pod's `nodeSelector` pins nodes where the device plugin does not share `resource`: the GPU
/// feature discovery's `<resource>.sharing-strategy: none` or `<resource>.replicas: "1"`.
pub fn unshared(resource: &str, node_selector: Option<&BTreeMap<String, String>>) -> bool {
    node_selector.is_some_and(|selector| {
        selector.get(&format!("{resource}.sharing-strategy")).is_some_and(|v| v == "none")
            || selector.get(&format!("{resource}.replicas")).is_some_and(|v| v == "1")
    })
}

/// How many devices a container sees, from every way it can get a GPU: its GPU and MIG limits (`limits`,
/// [`gpu_limits`]), its `NVIDIA_VISIBLE_DEVICES` (`visible_devices`) and whether it has DRA claims.
/// `None`: not a GPU container.
///
/// - A DRA claim makes the count unknown (gpubudget cannot tell a GPU claim from another without the claim).
/// - `NVIDIA_VISIBLE_DEVICES` with a limit: known only when it lists as many devices as the limits ask for
///   (or says `none`/`void`/empty: the device plugin's own list then decides); otherwise which list the
///   runtime uses decides, so unknown. `all` is always unknown (a container with 1 GPU limit and `all` may
///   see every GPU: it must not be capped on device 0 only), and so is a value `envFrom` may set.
/// - Limits that may be replicas of one card ([`GpuLimits::replicas`]): unknown, whatever the variable
///   lists (a runtime that ignores the variable, as the GPU Operator's CDI default does for unprivileged
///   containers, uses the device plugin's list).
/// - `NVIDIA_VISIBLE_DEVICES` alone: its list's length (`all`: unknown). A value only `envFrom` may set does
///   not make a container a GPU container (as one from its image's `ENV` does not: neither is in the pod).
pub fn devices(limits: GpuLimits, visible_devices: Option<&EnvValue>, claims: bool) -> Option<Devices> {
    if claims {
        return Some(Devices::Unknown(Unknown::Claim));
    }
    let visible = match visible_devices {
        Some(EnvValue::FromEnvFrom { .. }) if limits.count == 0 => Visible::Nothing,
        other => other.map_or(Visible::Nothing, visible),
    };
    let count = |n: u64| match u32::try_from(n) {
        Ok(n) if n <= MAX_DEVICES => Devices::Known(n),
        _ => Devices::Unknown(Unknown::TooMany),
    };
    match (limits.count, visible) {
        (0, Visible::Nothing) => None,
        (0, Visible::Listed(n)) => Some(count(u64::from(n))),
        (_, Visible::Unknown(why)) => Some(Devices::Unknown(why)),
        (n, Visible::Listed(listed)) if n != u64::from(listed) => {
            Some(Devices::Unknown(Unknown::Disagree { limits: u32::try_from(n).unwrap_or(u32::MAX), listed }))
        }
        (n, Visible::Nothing | Visible::Listed(_)) => Some(limits.replicas.map_or_else(|| count(n), Devices::Unknown)),
    }
}

/// The winning value of `name` in an `env` list (the last entry of that name, as the kubelet reads it).
pub fn env_value(env: &[EnvVar], name: &str) -> Option<EnvValue> {
    env.iter().rev().find(|e| e.name == name).map(|e| match (&e.value, &e.value_from) {
        (_, Some(_)) => EnvValue::FromSource,
        (value, None) => EnvValue::Literal(value.clone().unwrap_or_default()),
    })
}

/// Whether an `envFrom` entry with this prefix may set the variable `name`: a ConfigMap's or Secret's key is
/// never empty, so `prefix + key` is `name` only when `name` starts with `prefix` and is longer.
pub fn env_from_may_set(prefix: &str, name: &str) -> bool {
    name.len() > prefix.len() && name.starts_with(prefix)
}

/// The value of `name` in a container's environment as the kubelet builds it: `env` (its last entry of that
/// name) wins; else the last `envFrom` entry that may set it ([`EnvValue::FromEnvFrom`]). Linear in both lists.
pub fn container_value(env: &[EnvVar], env_from: &[EnvFromSource], name: &str) -> Option<EnvValue> {
    env_value(env, name).or_else(|| {
        let entry = env_from.iter().rposition(|s| env_from_may_set(s.prefix.as_deref().unwrap_or_default(), name))?;
        Some(EnvValue::FromEnvFrom {
            entry: u32::try_from(entry).unwrap_or(u32::MAX),
            secret: env_from[entry].secret_ref.is_some(),
        })
    })
}

/// What the caps module needs of one container.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Default)]
pub struct GpuContainer {
    /// The container's name.
    pub name: String,
    /// Devices it sees.
    pub devices: Devices,
    /// `CUDA_MPS_PINNED_DEVICE_MEM_LIMIT`, if set in `env`.
    pub mps_limit: Option<EnvValue>,
    /// `NVIDIA_GPU_MEMORY_LIMIT`, if set in `env`.
    pub memory_limit: Option<EnvValue>,
    /// `NVIDIA_GPU_MEMORY_REQUEST`, if set in `env`.
    pub memory_request: Option<EnvValue>,
}

impl GpuContainer {
    /// A container from its parts: its GPU limits ([`gpu_limits`], with the pod's `nodeSelector`), whether
    /// it has DRA claims, its `env` and `envFrom`. `None` when it is not a GPU container ([`devices`]).
    pub fn from_lean(
        name: &str,
        limits: GpuLimits,
        claims: bool,
        env: &[EnvVar],
        env_from: &[EnvFromSource],
    ) -> Option<Self> {
        let devices = devices(limits, container_value(env, env_from, VISIBLE_DEVICES).as_ref(), claims)?;
        Some(Self {
            name: name.to_owned(),
            devices,
            mps_limit: container_value(env, env_from, MPS_LIMIT),
            memory_limit: container_value(env, env_from, MEMORY_LIMIT),
            memory_request: container_value(env, env_from, MEMORY_REQUEST),
        })
    }

    /// A container from its parts, in a pod with this `nodeSelector`; `None` when it is not a GPU container.
    pub fn from_parts(
        name: &str,
        resources: Option<&ResourceRequirements>,
        env: &[EnvVar],
        env_from: &[EnvFromSource],
        node_selector: Option<&BTreeMap<String, String>>,
    ) -> Option<Self> {
        let limits = resources.and_then(|r| r.limits.as_ref());
        let limits =
            gpu_limits(limits.iter().flat_map(|l| l.iter()).map(|(k, v)| (k.as_str(), v.0.as_str())), node_selector);
        let claims = resources.and_then(|r| r.claims.as_ref()).is_some_and(|c| !c.is_empty());
        Self::from_lean(name, limits, claims, env, env_from)
    }

    /// The container as the caps module sees it, in a pod with this `nodeSelector`; `None` when it is not a
    /// GPU container.
    pub fn of(container: &Container, node_selector: Option<&BTreeMap<String, String>>) -> Option<Self> {
        Self::from_parts(
            &container.name,
            container.resources.as_ref(),
            container.env.as_deref().unwrap_or_default(),
            container.env_from.as_deref().unwrap_or_default(),
            node_selector,
        )
    }

    /// An ephemeral container (`kubectl debug`) as the caps module sees it.
    pub fn of_ephemeral(
        container: &EphemeralContainer,
        node_selector: Option<&BTreeMap<String, String>>,
    ) -> Option<Self> {
        Self::from_parts(
            &container.name,
            container.resources.as_ref(),
            container.env.as_deref().unwrap_or_default(),
            container.env_from.as_deref().unwrap_or_default(),
            node_selector,
        )
    }
}

/// Which list of the pod spec a container is in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// `spec.initContainers`.
    Init,
    /// `spec.containers`.
    Main,
    /// `spec.ephemeralContainers` (added through the `pods/ephemeralcontainers` subresource).
    Ephemeral,
}

/// A GPU container of a pod, with where it is and its `env`.
#[derive(Debug, Clone)]
pub struct Found<'a> {
    /// Its JSON pointer (`/spec/containers/0`).
    pub path: String,
    /// Its list.
    pub kind: Kind,
    /// Its `env`.
    pub env: &'a [EnvVar],
    /// Its `envFrom`.
    pub env_from: &'a [EnvFromSource],
    /// What the caps module reads of it.
    pub gpu: GpuContainer,
}

/// The GPU containers of a pod: init containers first (as they run), then the containers, then the
/// ephemeral ones.
pub fn gpu_containers(pod: &Pod) -> Vec<Found<'_>> {
    let Some(spec) = pod.spec.as_ref() else { return Vec::new() };
    let selector = spec.node_selector.as_ref();
    let init = spec.init_containers.iter().flatten().enumerate().map(|(i, c)| {
        (format!("/spec/initContainers/{i}"), Kind::Init, &c.env, &c.env_from, GpuContainer::of(c, selector))
    });
    let main = spec.containers.iter().enumerate().map(|(i, c)| {
        (format!("/spec/containers/{i}"), Kind::Main, &c.env, &c.env_from, GpuContainer::of(c, selector))
    });
    let ephemeral = spec.ephemeral_containers.iter().flatten().enumerate().map(|(i, c)| {
        (
            format!("/spec/ephemeralContainers/{i}"),
            Kind::Ephemeral,
            &c.env,
            &c.env_from,
            GpuContainer::of_ephemeral(c, selector),
        )
    });
    init.chain(main)
        .chain(ephemeral)
        .filter_map(|(path, kind, env, env_from, gpu)| {
            let (env, env_from) = (env.as_deref().unwrap_or_default(), env_from.as_deref().unwrap_or_default());
            gpu.map(|gpu| Found { path, kind, env, env_from, gpu })
        })
        .collect()
}

// ---- the MPS variable, as the driver reads it ------------------------------------------------------------

/// Why the driver ignores a whole `CUDA_MPS_PINNED_DEVICE_MEM_LIMIT` value (the process then runs
/// uncapped). Measured on an H100, driver 580.159.04, with an MPS daemon (2026-11-26; docs/operator.md); where
/// the driver's reading was not measured, this module assumes the worst (ignored), so a value is never counted
/// capped unless its every part was seen to be honoured. Entries are numbered from 1.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, thiserror::Error)]
pub enum Ignored {
    /// The empty value.
    #[error("it is empty")]
    Empty,
    /// Longer than [`MAX_ENV_VALUE`] (not read; Linux refuses it at exec).
    #[error("it is longer than 128 KiB (not read; Linux refuses such an environment string at exec)")]
    TooLong,
    /// An entry that is not `<device>=<amount>` (a bare amount, a space before it, junk, an empty entry
    /// other than one trailing comma).
    #[error("entry {0} is not DEVICE=AMOUNT (such as 0=4096M)")]
    Malformed(u32),
    /// An amount in a unit the driver was not seen to read: `K`, `T`, bytes (no unit), `GiB`...
    #[error(
        "entry {0} has an amount in a unit the driver ignores (it reads M, m, MB, MiB, Mi, G, g, GB, Gi; not K or bytes)"
    )]
    Unit(u32),
    /// An amount of 0.
    #[error("entry {0} has an amount of 0")]
    Zero(u32),
    /// An amount too large to be a number of bytes.
    #[error("entry {0} has an amount too large to read")]
    Overflow(u32),
    /// An entry for an ordinal the process does not see.
    #[error("entry {entry} names device {ordinal}, which a container seeing {devices} device(s) does not see")]
    Unseen {
        /// The entry.
        entry: u32,
        /// The ordinal it names (`u32::MAX` for a larger one).
        ordinal: u32,
        /// Devices the container sees.
        devices: u32,
    },
}

/// An amount as the driver may read it, in MiB: the smaller and the larger reading (`MB`/`GB` may be
/// decimal or binary; `M`, `Mi`, `MiB`, `G`, `Gi` are binary). The high one is at least 1; the low one
/// may be 0 (`1MB` may be under 1 MiB).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Amount {
    /// The smallest reading, rounded down.
    pub low_mib: u64,
    /// The largest reading.
    pub high_mib: u64,
}

/// One amount (`4096M`, `4G`, `03072MiB`), as the driver reads it; `entry` numbers errors.
fn read_amount(text: &str, entry: u32) -> Result<Amount, Ignored> {
    let end = text.bytes().position(|b| !b.is_ascii_digit()).unwrap_or(text.len());
    let (digits, unit) = text.split_at(end);
    if digits.is_empty() {
        return Err(Ignored::Malformed(entry));
    }
    // Leading zeros are read (measured); strip them so a long run of them is not an overflow.
    let significant = digits.trim_start_matches('0');
    let n: u64 = if significant.is_empty() { 0 } else { significant.parse().map_err(|_| Ignored::Overflow(entry))? };
    // (decimal bytes per unit, binary MiB per unit)
    let (decimal, binary_mib): (Option<u64>, u64) = match unit {
        "M" | "m" | "Mi" | "MiB" => (None, 1),
        "MB" => (Some(1_000_000), 1),
        "G" | "g" | "Gi" => (None, 1024),
        "GB" => (Some(1_000_000_000), 1024),
        _ => return Err(Ignored::Unit(entry)),
    };
    if n == 0 {
        return Err(Ignored::Zero(entry));
    }
    let high_mib = n.checked_mul(binary_mib).ok_or(Ignored::Overflow(entry))?;
    let low_mib = match decimal {
        Some(bytes) => u64::try_from(u128::from(n) * u128::from(bytes) / u128::from(MIB)).unwrap_or(u64::MAX),
        None => high_mib,
    };
    Ok(Amount { low_mib, high_mib })
}

/// A `CUDA_MPS_PINNED_DEVICE_MEM_LIMIT` value the driver honours, for a container seeing some devices.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MpsValue {
    /// Per ordinal `0..n`, the cap the driver applies (the smaller of duplicates), if an entry names it.
    pub per_device: Vec<Option<Amount>>,
    /// Some entry names a device by UUID: honoured when it is the process's own, but which GPU the process
    /// gets is not in the pod, so such a value is never counted as a cap.
    pub names_uuid: bool,
}

/// How the driver reads an MPS value in a process seeing `devices` devices; `Err`: it ignores the whole
/// value. One pass over the text, O(length); never reads past [`MAX_ENV_VALUE`].
///
/// Honoured (measured): `<i>=<n><unit>` entries with `unit` one of `M m MB MiB Mi G g Gi GB`, spaces around
/// `=`, leading zeros, a trailing comma, duplicates (the smaller wins), a GPU UUID as the device. Ignored
/// (the whole value): a space before an entry, a bare amount, `K`, bytes, 0, any ordinal the process does
/// not see, any entry it cannot parse.
pub fn read_mps(value: &str, devices: u32) -> Result<MpsValue, Ignored> {
    if value.len() > MAX_ENV_VALUE {
        return Err(Ignored::TooLong);
    }
    if value.is_empty() {
        return Err(Ignored::Empty);
    }
    let slots = usize::try_from(devices.min(MAX_DEVICES)).unwrap_or(0);
    let mut out = MpsValue { per_device: vec![None; slots], names_uuid: false };
    // A trailing comma is read; any other empty entry is not.
    let body = value.strip_suffix(',').unwrap_or(value);
    for (i, entry) in body.split(',').enumerate() {
        let number = u32::try_from(i + 1).unwrap_or(u32::MAX);
        let (device, amount) = entry.split_once('=').ok_or(Ignored::Malformed(number))?;
        let device = device.trim_end_matches(' ');
        let amount = amount.trim_start_matches(' ');
        let amount = read_amount(amount, number)?;
        if valid_uuid(device) {
            out.names_uuid = true;
            continue;
        }
        let canonical = device == "0" || (device.starts_with(|c: char| c.is_ascii_digit() && c != '0'));
        if !canonical || !device.bytes().all(|b| b.is_ascii_digit()) {
            return Err(Ignored::Malformed(number));
        }
        let ordinal: u32 = device.parse().unwrap_or(u32::MAX);
        let slot = usize::try_from(ordinal).ok().and_then(|o| out.per_device.get_mut(o));
        let Some(slot) = slot else { return Err(Ignored::Unseen { entry: number, ordinal, devices }) };
        *slot = Some(match *slot {
            Some(seen) => {
                Amount { low_mib: seen.low_mib.min(amount.low_mib), high_mib: seen.high_mib.min(amount.high_mib) }
            }
            None => amount,
        });
    }
    Ok(out)
}

/// An amount as MPS writes it (`4G`, `6000M`, `512MB`), in bytes, read the largest way (binary); `None`
/// for an amount the driver ignores (`K`, bytes, 0, another unit).
pub fn mps_amount_bytes(text: &str) -> Option<u64> {
    read_amount(text.trim(), 1).ok()?.high_mib.checked_mul(MIB)
}

/// The canonical MPS value for a container seeing `devices` devices under a cap of `cap_mib`:
/// `<i>=<MiB>M` for each `i` in `0..devices`, each the smaller of the cap and the user's entry for `i`
/// (only where the driver would honour the user's value, read the smallest way, at least 1 MiB). Nothing
/// of the user's text is kept: no UUID entry, no other spelling. Linear in the user's value.
pub fn merge_mps(user: Option<&str>, devices: u32, cap_mib: u64) -> String {
    merge_mps_outcome(user.map(|u| EnvValue::Literal(u.to_owned())).as_ref(), devices, cap_mib).0
}

fn merge_mps_outcome(user: Option<&EnvValue>, devices: u32, cap_mib: u64) -> (String, Outcome) {
    let read = user.and_then(EnvValue::literal).map(|text| read_mps(text, devices));
    let per_device = match &read {
        Some(Ok(value)) => value.per_device.clone(),
        _ => Vec::new(),
    };
    let mut out = String::with_capacity(usize::try_from(devices).unwrap_or(0) * 12);
    let mut lowered = false;
    for i in 0..devices.min(MAX_DEVICES) {
        let user_mib = per_device.get(usize::try_from(i).unwrap_or(usize::MAX)).copied().flatten();
        lowered |= user_mib.is_none_or(|a| a.low_mib > cap_mib);
        let mib = user_mib.map_or(cap_mib, |a| a.low_mib.clamp(1, cap_mib));
        if i > 0 {
            out.push(',');
        }
        let _ = write!(out, "{i}={mib}M");
    }
    let outcome = match (user, &read) {
        (None, _) => Outcome::Set,
        (Some(EnvValue::Literal(text)), _) if *text == out => Outcome::Kept,
        (Some(_), Some(Ok(_))) if !lowered => Outcome::Kept,
        (Some(_), Some(Ok(_))) => Outcome::Lowered,
        (Some(_), _) => Outcome::Replaced,
    };
    (out, outcome)
}

// ---- the MiB variables ------------------------------------------------------------------------------------

/// A MiB variable's value read strictly: ASCII digits only, positive, as the canonical form writes it
/// (leading zeros allowed). `None` for anything else (`+1`, ` 1`, `8 GiB`, `0`, too long).
pub fn strict_mib(text: &str) -> Option<u64> {
    if text.is_empty() || text.len() > 40 || !text.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    text.trim_start_matches('0').parse::<u64>().ok().filter(|v| *v > 0)
}

/// A MiB variable's value read the most lenient way a reader might (`+1`, ` 1 `), to know whether it may
/// be above a cap.
fn lenient_mib(text: &str) -> Option<u64> {
    let text = text.trim();
    let text = text.strip_prefix('+').unwrap_or(text);
    if text.len() > 40 {
        return None;
    }
    text.parse::<u64>().ok()
}

/// The canonical value of a MiB variable under `cap_mib`: the smaller of the cap and the user's strictly
/// read value, as a plain decimal.
fn merge_mib(user: Option<&EnvValue>, cap_mib: u64) -> (String, Outcome) {
    let read = user.and_then(EnvValue::literal).and_then(strict_mib);
    let out = read.map_or(cap_mib, |v| v.min(cap_mib)).to_string();
    let outcome = match (user, read) {
        (None, _) => Outcome::Set,
        (Some(_), Some(v)) if v <= cap_mib => Outcome::Kept,
        (Some(_), Some(_)) => Outcome::Lowered,
        (Some(_), None) => Outcome::Replaced,
    };
    (out, outcome)
}

// ---- admission -------------------------------------------------------------------------------------------

/// What was done to one container's variable.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub enum Outcome {
    /// Absent: set.
    Set,
    /// The user's value was honoured and at most the cap: its caps kept (written in the canonical form).
    Kept,
    /// The user's value was above the cap (or left a device uncapped): lowered.
    Lowered,
    /// The user's value was not one the driver reads (or came from `valueFrom`): replaced.
    Replaced,
    /// The user's MPS value was removed: the device count is unknown, so no value can be known to be read
    /// (an entry for an ordinal the container does not see voids the whole value).
    Removed,
}

/// What the webhook did to one GPU container.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ContainerRecord {
    /// The container's name.
    pub name: String,
    /// Devices it sees (0: unknown, see `uncapped`).
    pub devices: u32,
    /// Per variable, what was done.
    pub env: BTreeMap<String, Outcome>,
    /// Why it got no MPS cap (its device count is unknown), when it did not.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub uncapped: Option<String>,
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
    /// One line for events and logs: `budget llm: limit 8192 MiB per GPU container; main (1 device(s), 1 of
    /// 2 variables set)`.
    pub fn summary(&self) -> String {
        let containers: Vec<String> = self
            .containers
            .iter()
            .map(|c| {
                let changed = c.env.values().filter(|o| **o != Outcome::Kept).count();
                match &c.uncapped {
                    None => format!("{} ({} device(s), {changed} of {} variables set)", c.name, c.devices, c.env.len()),
                    Some(why) => format!("{} (no MPS cap: {why})", c.name),
                }
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

/// The env ops for one container at `path`: set each variable (replace its winning entry, or append), or,
/// for `None`, remove every entry of that name (last, from the end, so earlier indices stay valid).
fn env_ops(path: &str, env: &[EnvVar], values: &[(&str, Option<String>)], ops: &mut Vec<Value>) {
    if env.is_empty() {
        let list: Vec<Value> =
            values.iter().filter_map(|(n, v)| v.as_ref().map(|v| json!({"name": n, "value": v}))).collect();
        if !list.is_empty() {
            ops.push(json!({"op": "add", "path": format!("{path}/env"), "value": list}));
        }
        return;
    }
    let mut removed = Vec::new();
    for (name, value) in values {
        let Some(value) = value else {
            removed.extend(env.iter().enumerate().filter(|(_, e)| e.name == *name).map(|(i, _)| i));
            continue;
        };
        let entry = json!({"name": name, "value": value});
        match env.iter().rposition(|e| e.name == *name) {
            Some(i) if env[i].value.as_deref() == Some(value.as_str()) && env[i].value_from.is_none() => {}
            Some(i) => ops.push(json!({"op": "replace", "path": format!("{path}/env/{i}"), "value": entry})),
            None => ops.push(json!({"op": "add", "path": format!("{path}/env/-"), "value": entry})),
        }
    }
    removed.sort_unstable_by(|a, b| b.cmp(a));
    ops.extend(removed.into_iter().map(|i| json!({"op": "remove", "path": format!("{path}/env/{i}")})));
}

/// Why a container's device count is unknown, in words, naming the ConfigMap or Secret an `envFrom` entry
/// reads (`env_from`: the container's).
pub fn unknown_reason(why: Unknown, env_from: &[EnvFromSource]) -> String {
    let Unknown::VisibleFromEnvFrom { entry, .. } = why else { return why.to_string() };
    let source = usize::try_from(entry).ok().and_then(|i| env_from.get(i));
    let name = source.and_then(|s| {
        s.config_map_ref.as_ref().map(|c| ("ConfigMap", &c.name)).or(s.secret_ref.as_ref().map(|c| ("Secret", &c.name)))
    });
    match name {
        // A name is at most 253 characters (the API server's validation); never more is written.
        Some((kind, name)) => format!("{why} [{kind} {}]", name.chars().take(253).collect::<String>()),
        None => why.to_string(),
    }
}

/// Sets one GPU container's variables: the canonical MPS value when its device count is known (else none:
/// the user's is removed and the container recorded uncapped), the MiB variables always (they do not
/// depend on the device count). What `envFrom` may set is overridden by the `env` entries written
/// (Kubernetes' precedence), never merged with: its value is not in the pod.
fn cap_container(found: &Found<'_>, caps: Caps, ops: &mut Vec<Value>) -> ContainerRecord {
    let gpu = &found.gpu;
    let mut env = BTreeMap::new();
    let mut values: Vec<(&str, Option<String>)> = Vec::new();
    let mut uncapped = None;
    let mps_in_env = gpu.mps_limit.as_ref().and_then(EnvValue::in_env);
    match gpu.devices {
        Devices::Known(n) => {
            let (mps, outcome) = merge_mps_outcome(mps_in_env, n, caps.limit_mib);
            env.insert(MPS_LIMIT.to_owned(), outcome);
            values.push((MPS_LIMIT, Some(mps)));
        }
        Devices::Unknown(why) => {
            if mps_in_env.is_some() {
                env.insert(MPS_LIMIT.to_owned(), Outcome::Removed);
                values.push((MPS_LIMIT, None));
            }
            uncapped = Some(unknown_reason(why, found.env_from));
        }
    }
    let (limit, outcome) = merge_mib(gpu.memory_limit.as_ref().and_then(EnvValue::in_env), caps.limit_mib);
    env.insert(MEMORY_LIMIT.to_owned(), outcome);
    values.push((MEMORY_LIMIT, Some(limit)));
    if let Some(request_mib) = caps.request_mib.filter(|r| *r > 0) {
        let (request, outcome) = merge_mib(gpu.memory_request.as_ref().and_then(EnvValue::in_env), request_mib);
        env.insert(MEMORY_REQUEST.to_owned(), outcome);
        values.push((MEMORY_REQUEST, Some(request)));
    }
    env_ops(&found.path, found.env, &values, ops);
    ContainerRecord { name: gpu.name.clone(), devices: gpu.devices.known().unwrap_or(0), env, uncapped }
}

/// What admission does to a pod being created, given the budget that applies to it (after
/// [`crate::resolve`]) if any: with caps enabled, each GPU container's variables are set in canonical form
/// and the annotation records it; otherwise only an annotation the author wrote is removed. Nothing else in
/// the pod is touched.
pub fn admit(pod: &Pod, budget: Option<&Budget>) -> Admission {
    let annotations = pod.metadata.annotations.as_ref();
    let forged = annotations.is_some_and(|a| a.contains_key(ANNOTATION));
    let annotation_path = format!("/metadata/annotations/{}", escape(ANNOTATION));
    let Some((budget, caps)) = budget.and_then(|b| Caps::of(b).map(|c| (b, c))) else {
        let patch = if forged { vec![json!({"op": "remove", "path": annotation_path})] } else { Vec::new() };
        return Admission { patch, record: None };
    };
    let mut ops = Vec::new();
    let containers = gpu_containers(pod).iter().map(|found| cap_container(found, caps, &mut ops)).collect();
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

/// What admission does to ephemeral containers being added (`pods/ephemeralcontainers`, `kubectl debug`):
/// `pod` is the pod with them, `old` the pod before. Each new GPU ephemeral container (one whose name `old`
/// does not have) gets its variables as at creation; existing containers and the annotation are left alone
/// (the API server refuses changes to them there). The record lists the new GPU ephemeral containers.
pub fn admit_ephemeral(pod: &Pod, old: &Pod, budget: Option<&Budget>) -> Admission {
    let Some((budget, caps)) = budget.and_then(|b| Caps::of(b).map(|c| (b, c))) else {
        return Admission { patch: Vec::new(), record: None };
    };
    let existing: Vec<&str> =
        old.spec.iter().flat_map(|s| s.ephemeral_containers.iter().flatten()).map(|c| c.name.as_str()).collect();
    let mut ops = Vec::new();
    let containers = gpu_containers(pod)
        .iter()
        .filter(|f| f.kind == Kind::Ephemeral && !existing.contains(&f.gpu.name.as_str()))
        .map(|found| cap_container(found, caps, &mut ops))
        .collect();
    let record =
        Record { budget: budget.record_name(), limit_mib: caps.limit_mib, request_mib: caps.request_mib, containers };
    Admission { patch: ops, record: Some(record) }
}

// ---- running pods ----------------------------------------------------------------------------------------

/// The record the webhook wrote on a pod (`gpubudget.io/caps`), if it parses. A report of what was done at
/// creation, not proof that the pod is capped: [`PodCaps`] reads the environment for that.
pub fn record_of(pod: &Pod) -> Option<Record> {
    serde_json::from_str(pod.metadata.annotations.as_ref()?.get(ANNOTATION)?).ok()
}

/// Why a GPU container's environment does not hold it to any MPS cap.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, thiserror::Error)]
pub enum Uncapped {
    /// Its device count is not known from the pod.
    #[error("{0}")]
    Devices(Unknown),
    /// No MPS variable.
    #[error("no CUDA_MPS_PINNED_DEVICE_MEM_LIMIT")]
    NoMps,
    /// The MPS variable comes from `valueFrom`.
    #[error("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT is set through valueFrom: its value is not in the pod")]
    MpsFromSource,
    /// The MPS variable is not in `env`, and an `envFrom` entry may set it.
    #[error(
        "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT may come from envFrom entry {entry} ({}): its value is not in the pod",
        source_kind(*secret)
    )]
    MpsFromEnvFrom {
        /// The `envFrom` entry, from 0.
        entry: u32,
        /// A Secret (else a ConfigMap).
        secret: bool,
    },
    /// The driver ignores the whole MPS value.
    #[error("the driver ignores its CUDA_MPS_PINNED_DEVICE_MEM_LIMIT: {0}")]
    Ignored(Ignored),
    /// A device it sees has no entry.
    #[error("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT has no entry for device {0}")]
    Missing(u32),
    /// The container runtime made a GPU container without an MPS cap the driver reads (`--runtime-caps`: what
    /// the agent saw of the container the runtime made; the pod's record says which and why).
    #[error("a GPU container was made without an MPS cap the driver reads (its gpubudget.io/runtime-caps says which)")]
    AtCreation,
    /// The container runtime was given its caps but has not yet shown the container it made with them
    /// (`--runtime-caps`: a container counts capped only once read back from the runtime, #53).
    #[error("the container runtime has not yet confirmed the caps it was given")]
    Unconfirmed,
    /// An entry names a device by UUID.
    #[error(
        "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT names a device by UUID: whether the container sees it is not in the \
         pod (an entry for a device it does not see voids the value)"
    )]
    NamesUuid,
}

/// Whether one GPU container's environment holds it to an MPS cap, as the driver reads it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ContainerCap {
    /// Every device it sees is capped; the largest cap (or `NVIDIA_GPU_MEMORY_LIMIT`, if larger), MiB.
    Capped {
        /// The largest cap, read the largest way.
        max_mib: u64,
    },
    /// Not capped, and why.
    Uncapped(Uncapped),
}

/// How the driver holds one GPU container, from its environment.
pub fn held(c: &GpuContainer) -> ContainerCap {
    let devices = match c.devices {
        Devices::Known(n) => n,
        Devices::Unknown(why) => return ContainerCap::Uncapped(Uncapped::Devices(why)),
    };
    let text = match &c.mps_limit {
        None => return ContainerCap::Uncapped(Uncapped::NoMps),
        Some(EnvValue::FromSource) => return ContainerCap::Uncapped(Uncapped::MpsFromSource),
        &Some(EnvValue::FromEnvFrom { entry, secret }) => {
            return ContainerCap::Uncapped(Uncapped::MpsFromEnvFrom { entry, secret });
        }
        Some(EnvValue::Literal(text)) => text,
    };
    let value = match read_mps(text, devices) {
        Ok(value) => value,
        Err(why) => return ContainerCap::Uncapped(Uncapped::Ignored(why)),
    };
    if value.names_uuid {
        return ContainerCap::Uncapped(Uncapped::NamesUuid);
    }
    let mut max_mib = 0;
    for (i, slot) in value.per_device.iter().enumerate() {
        match slot {
            Some(amount) => max_mib = max_mib.max(amount.high_mib),
            None => return ContainerCap::Uncapped(Uncapped::Missing(u32::try_from(i).unwrap_or(u32::MAX))),
        }
    }
    let toolkit = c.memory_limit.as_ref().and_then(EnvValue::literal).and_then(lenient_mib).unwrap_or(0);
    ContainerCap::Capped { max_mib: max_mib.max(toolkit) }
}

/// What the operator keeps of a pod to count its caps: a few bytes, whatever its environment holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum PodCaps {
    /// No GPU container.
    #[default]
    NoGpu,
    /// Every GPU container is capped on every device it sees; the largest cap, MiB.
    Capped {
        /// The largest cap of any container and device.
        max_mib: u64,
    },
    /// Some GPU container is not (the first, in pod order), and why.
    Uncapped(Uncapped),
}

impl PodCaps {
    /// The pod's caps from its GPU containers.
    pub fn of<'a>(containers: impl IntoIterator<Item = &'a GpuContainer>) -> Self {
        let mut out = Self::NoGpu;
        for c in containers {
            match (held(c), out) {
                (ContainerCap::Uncapped(why), _) => return Self::Uncapped(why),
                (ContainerCap::Capped { max_mib }, Self::Capped { max_mib: seen }) => {
                    out = Self::Capped { max_mib: max_mib.max(seen) };
                }
                (ContainerCap::Capped { max_mib }, _) => out = Self::Capped { max_mib },
            }
        }
        out
    }

    /// The pod's caps from its spec: every GPU container, init and ephemeral ones included ([`gpu_containers`]).
    pub fn of_pod(pod: &Pod) -> Self {
        Self::of(gpu_containers(pod).iter().map(|f| &f.gpu))
    }

    /// The largest cap, MiB, when every GPU container is capped.
    pub fn capped_mib(self) -> Option<u64> {
        match self {
            Self::Capped { max_mib } => Some(max_mib),
            Self::NoGpu | Self::Uncapped(_) => None,
        }
    }

    /// Why it is uncapped, when it is.
    pub fn reason(self) -> Option<Uncapped> {
        match self {
            Self::Uncapped(why) => Some(why),
            Self::NoGpu | Self::Capped { .. } => None,
        }
    }

    /// The pod's caps as its node's agent saw the runtime make its GPU containers (`--runtime-caps`), where it did:
    /// they win over the spec's, since the runtime's environment is the one the processes started with.
    pub fn as_made(self, by_runtime: Option<&crate::pod_record::RuntimeCapsRecord>) -> Self {
        match by_runtime {
            Some(crate::pod_record::RuntimeCapsRecord::Capped { max_mib, .. }) => Self::Capped { max_mib: *max_mib },
            Some(crate::pod_record::RuntimeCapsRecord::Uncapped(_)) => Self::Uncapped(Uncapped::AtCreation),
            None => self,
        }
    }

    /// How the pod stands against a budget's caps.
    pub fn assess(self, caps: Caps) -> Assessment {
        match self {
            Self::NoGpu => Assessment::NoGpu,
            Self::Uncapped(_) => Assessment::Uncapped,
            Self::Capped { max_mib } if max_mib > caps.limit_mib => Assessment::AboveLimit,
            Self::Capped { .. } => Assessment::Capped,
        }
    }
}

/// Whether a running pod's environment holds it to its budget's caps.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Assessment {
    /// No GPU container: nothing to cap.
    NoGpu,
    /// Every GPU container is capped at most at the budget, on every device it sees.
    Capped,
    /// Some GPU container has no MPS cap the driver honours on every device it sees ([`Uncapped`] says
    /// why: created while the webhook was down or outside its scope, a value the driver ignores, a device
    /// count not in the pod).
    Uncapped,
    /// Capped, but some cap is above the budget's limit now (the limit was lowered after the pod was
    /// created: its environment is fixed; eviction holds it to the new limit).
    AboveLimit,
}

/// How a running pod's GPU containers stand against the caps ([`PodCaps::of`], then [`PodCaps::assess`]).
pub fn assess(containers: &[GpuContainer], caps: Caps) -> Assessment {
    PodCaps::of(containers).assess(caps)
}

pub mod runtime;
#[cfg(test)]
mod tests;
