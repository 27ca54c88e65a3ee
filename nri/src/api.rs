//! The NRI messages the plugin side uses (`nri.pkg.api.v1alpha1`, NRI v0.12.0's `api.proto`), written by hand.
//!
//! Only the fields this crate's users need are declared; protobuf decoding skips the others, so the structs decode
//! whatever the runtime sends. Field numbers are the proto's: never renumber one.

use std::collections::BTreeMap;

/// The `Plugin` service, which the plugin serves.
pub const PLUGIN_SERVICE: &str = "nri.pkg.api.v1alpha1.Plugin";
/// The `Runtime` service, which the plugin calls.
pub const RUNTIME_SERVICE: &str = "nri.pkg.api.v1alpha1.Runtime";

/// `Runtime.RegisterPlugin`'s request: the plugin's first call.
#[derive(Clone, PartialEq, prost::Message)]
pub struct RegisterPluginRequest {
    /// The plugin's name.
    #[prost(string, tag = "1")]
    pub plugin_name: String,
    /// Its two-digit index, which orders plugins (`00`..`99`).
    #[prost(string, tag = "2")]
    pub plugin_idx: String,
    /// The NRI version the plugin speaks (the runtime only logs it).
    #[prost(string, tag = "3")]
    pub nri_version: String,
}

/// An empty message (`RegisterPlugin`'s and `Shutdown`'s answers, `StateChange`'s answer).
#[derive(Clone, PartialEq, prost::Message)]
pub struct Empty {}

/// `Plugin.Configure`'s request: the runtime's first call after registration.
#[derive(Clone, PartialEq, prost::Message)]
pub struct ConfigureRequest {
    /// The plugin's configuration (from the runtime's config dir), if any.
    #[prost(string, tag = "1")]
    pub config: String,
    /// The runtime's name, e.g. `containerd`.
    #[prost(string, tag = "2")]
    pub runtime_name: String,
    /// The runtime's version.
    #[prost(string, tag = "3")]
    pub runtime_version: String,
    /// The runtime's registration timeout, in milliseconds.
    #[prost(int64, tag = "4")]
    pub registration_timeout: i64,
    /// The runtime's timeout for each request to the plugin, in milliseconds.
    #[prost(int64, tag = "5")]
    pub request_timeout: i64,
    /// The runtime's NRI version.
    #[prost(string, tag = "6")]
    pub nri_version: String,
}

/// `Plugin.Configure`'s answer.
#[derive(Clone, PartialEq, prost::Message)]
pub struct ConfigureResponse {
    /// The events the plugin subscribes to, an [`EventMask`]. Zero subscribes to *every* event.
    #[prost(int32, tag = "2")]
    pub events: i32,
}

/// `Plugin.Synchronize`'s request: the pods and containers that exist when the plugin connects.
#[derive(Clone, PartialEq, prost::Message)]
pub struct SynchronizeRequest {
    /// Pods.
    #[prost(message, repeated, tag = "1")]
    pub pods: Vec<PodSandbox>,
    /// Containers.
    #[prost(message, repeated, tag = "2")]
    pub containers: Vec<Container>,
    /// More follow in further requests (the runtime splits large states).
    #[prost(bool, tag = "3")]
    pub more: bool,
}

/// `Plugin.Synchronize`'s answer.
#[derive(Clone, PartialEq, prost::Message)]
pub struct SynchronizeResponse {
    /// Updates to existing containers (only in the answer to the last part).
    #[prost(message, repeated, tag = "1")]
    pub update: Vec<ContainerUpdate>,
    /// Echoes the request's `more`.
    #[prost(bool, tag = "2")]
    pub more: bool,
}

/// A pod sandbox.
#[derive(Clone, PartialEq, prost::Message)]
pub struct PodSandbox {
    /// The runtime's sandbox id.
    #[prost(string, tag = "1")]
    pub id: String,
    /// The pod's name.
    #[prost(string, tag = "2")]
    pub name: String,
    /// The pod's UID.
    #[prost(string, tag = "3")]
    pub uid: String,
    /// The pod's namespace.
    #[prost(string, tag = "4")]
    pub namespace: String,
    /// The pod's labels.
    #[prost(btree_map = "string, string", tag = "5")]
    pub labels: BTreeMap<String, String>,
    /// The pod's annotations.
    #[prost(btree_map = "string, string", tag = "6")]
    pub annotations: BTreeMap<String, String>,
    /// The runtime handler (RuntimeClass).
    #[prost(string, tag = "7")]
    pub runtime_handler: String,
    /// Linux specifics.
    #[prost(message, optional, tag = "8")]
    pub linux: Option<LinuxPodSandbox>,
    /// The sandbox's process id, if running.
    #[prost(uint32, tag = "9")]
    pub pid: u32,
}

/// A pod sandbox's Linux specifics.
#[derive(Clone, PartialEq, prost::Message)]
pub struct LinuxPodSandbox {
    /// The pod's cgroup parent, e.g. `/kubepods/besteffort/pod<uid>`.
    #[prost(string, tag = "3")]
    pub cgroup_parent: String,
    /// The sandbox's cgroups path.
    #[prost(string, tag = "4")]
    pub cgroups_path: String,
}

/// A container.
#[derive(Clone, PartialEq, prost::Message)]
pub struct Container {
    /// The runtime's container id.
    #[prost(string, tag = "1")]
    pub id: String,
    /// Its pod's sandbox id.
    #[prost(string, tag = "2")]
    pub pod_sandbox_id: String,
    /// The container's name in the pod spec.
    #[prost(string, tag = "3")]
    pub name: String,
    /// Its state.
    #[prost(enumeration = "ContainerState", tag = "4")]
    pub state: i32,
    /// Labels.
    #[prost(btree_map = "string, string", tag = "5")]
    pub labels: BTreeMap<String, String>,
    /// Annotations.
    #[prost(btree_map = "string, string", tag = "6")]
    pub annotations: BTreeMap<String, String>,
    /// The command line.
    #[prost(string, repeated, tag = "7")]
    pub args: Vec<String>,
    /// The environment, `KEY=value` strings.
    #[prost(string, repeated, tag = "8")]
    pub env: Vec<String>,
    /// Linux specifics.
    #[prost(message, optional, tag = "11")]
    pub linux: Option<LinuxContainer>,
    /// Its process id, once it runs.
    #[prost(uint32, tag = "12")]
    pub pid: u32,
}

/// A container's state.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, prost::Enumeration)]
#[repr(i32)]
pub enum ContainerState {
    /// Unknown.
    Unknown = 0,
    /// Created, not started.
    Created = 1,
    /// Paused.
    Paused = 2,
    /// Running.
    Running = 3,
    /// Stopped.
    Stopped = 4,
}

/// A container's Linux specifics.
#[derive(Clone, PartialEq, prost::Message)]
pub struct LinuxContainer {
    /// Its device nodes.
    #[prost(message, repeated, tag = "2")]
    pub devices: Vec<LinuxDevice>,
    /// Its cgroups path.
    #[prost(string, tag = "5")]
    pub cgroups_path: String,
}

/// A device node.
#[derive(Clone, PartialEq, prost::Message)]
pub struct LinuxDevice {
    /// The path in the container, e.g. `/dev/nvidia0`.
    #[prost(string, tag = "1")]
    pub path: String,
    /// `c` or `b`.
    #[prost(string, tag = "2")]
    pub r#type: String,
    /// Major number.
    #[prost(int64, tag = "3")]
    pub major: i64,
    /// Minor number.
    #[prost(int64, tag = "4")]
    pub minor: i64,
}

/// `Plugin.CreateContainer`'s request.
#[derive(Clone, PartialEq, prost::Message)]
pub struct CreateContainerRequest {
    /// The container's pod.
    #[prost(message, optional, tag = "1")]
    pub pod: Option<PodSandbox>,
    /// The container about to be created.
    #[prost(message, optional, tag = "2")]
    pub container: Option<Container>,
}

/// `Plugin.CreateContainer`'s answer.
#[derive(Clone, PartialEq, prost::Message)]
pub struct CreateContainerResponse {
    /// Changes to the container being created.
    #[prost(message, optional, tag = "1")]
    pub adjust: Option<ContainerAdjustment>,
    /// Updates to other, existing containers.
    #[prost(message, repeated, tag = "2")]
    pub update: Vec<ContainerUpdate>,
    /// Containers to evict.
    #[prost(message, repeated, tag = "3")]
    pub evict: Vec<ContainerEviction>,
}

/// Changes to a container being created.
#[derive(Clone, PartialEq, prost::Message)]
pub struct ContainerAdjustment {
    /// Annotations to set; a key prefixed with `-` removes the annotation.
    #[prost(btree_map = "string, string", tag = "2")]
    pub annotations: BTreeMap<String, String>,
    /// Environment variables to set, in order; a key prefixed with `-` removes the variable.
    #[prost(message, repeated, tag = "4")]
    pub env: Vec<KeyValue>,
}

impl ContainerAdjustment {
    /// Sets `key=value` in the container's environment.
    pub fn add_env(&mut self, key: impl Into<String>, value: impl Into<String>) -> &mut Self {
        self.env.push(KeyValue { key: key.into(), value: value.into() });
        self
    }

    /// Removes `key` from the container's environment (NRI's removal marker: the key prefixed with `-`). Removing
    /// a variable first also lets this plugin set one another plugin set.
    pub fn remove_env(&mut self, key: &str) -> &mut Self {
        self.env.push(KeyValue { key: format!("-{key}"), value: String::new() });
        self
    }
}

/// A key and a value.
#[derive(Clone, PartialEq, prost::Message)]
pub struct KeyValue {
    /// The key.
    #[prost(string, tag = "1")]
    pub key: String,
    /// The value.
    #[prost(string, tag = "2")]
    pub value: String,
}

/// An update to an existing container's resources.
#[derive(Clone, PartialEq, prost::Message)]
pub struct ContainerUpdate {
    /// The container.
    #[prost(string, tag = "1")]
    pub container_id: String,
    /// The new Linux resources.
    #[prost(message, optional, tag = "2")]
    pub linux: Option<LinuxContainerUpdate>,
    /// Failing to apply it is not an error.
    #[prost(bool, tag = "3")]
    pub ignore_failure: bool,
}

/// The Linux part of a [`ContainerUpdate`].
#[derive(Clone, PartialEq, prost::Message)]
pub struct LinuxContainerUpdate {
    /// The resources.
    #[prost(message, optional, tag = "1")]
    pub resources: Option<LinuxResources>,
}

/// Linux resources (only the memory limit and the cgroup v2 `unified` map are declared).
#[derive(Clone, PartialEq, prost::Message)]
pub struct LinuxResources {
    /// Memory.
    #[prost(message, optional, tag = "1")]
    pub memory: Option<LinuxMemory>,
    /// cgroup v2 files and values.
    #[prost(btree_map = "string, string", tag = "6")]
    pub unified: BTreeMap<String, String>,
}

/// Linux memory resources (only the limit is declared).
#[derive(Clone, PartialEq, prost::Message)]
pub struct LinuxMemory {
    /// The memory limit in bytes; absent: unchanged.
    #[prost(message, optional, tag = "1")]
    pub limit: Option<OptionalInt64>,
}

/// An optional `int64`: present or absent, unlike a plain scalar.
#[derive(Clone, PartialEq, prost::Message)]
pub struct OptionalInt64 {
    /// The value.
    #[prost(int64, tag = "1")]
    pub value: i64,
}

/// A container to evict.
#[derive(Clone, PartialEq, prost::Message)]
pub struct ContainerEviction {
    /// The container.
    #[prost(string, tag = "1")]
    pub container_id: String,
    /// Why.
    #[prost(string, tag = "2")]
    pub reason: String,
}

/// `Plugin.UpdateContainer`'s request: a container's resources are about to change.
#[derive(Clone, PartialEq, prost::Message)]
pub struct UpdateContainerRequest {
    /// The pod.
    #[prost(message, optional, tag = "1")]
    pub pod: Option<PodSandbox>,
    /// The container.
    #[prost(message, optional, tag = "2")]
    pub container: Option<Container>,
    /// The requested resources.
    #[prost(message, optional, tag = "3")]
    pub linux_resources: Option<LinuxResources>,
}

/// `Plugin.UpdateContainer`'s answer.
#[derive(Clone, PartialEq, prost::Message)]
pub struct UpdateContainerResponse {
    /// Updates (to this or other containers).
    #[prost(message, repeated, tag = "1")]
    pub update: Vec<ContainerUpdate>,
    /// Containers to evict.
    #[prost(message, repeated, tag = "2")]
    pub evict: Vec<ContainerEviction>,
}

/// `Plugin.StopContainer`'s request.
#[derive(Clone, PartialEq, prost::Message)]
pub struct StopContainerRequest {
    /// The pod.
    #[prost(message, optional, tag = "1")]
    pub pod: Option<PodSandbox>,
    /// The container being stopped.
    #[prost(message, optional, tag = "2")]
    pub container: Option<Container>,
}

/// `Plugin.StopContainer`'s answer.
#[derive(Clone, PartialEq, prost::Message)]
pub struct StopContainerResponse {
    /// Updates to other containers.
    #[prost(message, repeated, tag = "1")]
    pub update: Vec<ContainerUpdate>,
}

/// A lifecycle event without an answer (`Plugin.StateChange`; this crate also delivers the dedicated
/// `RunPodSandbox`, `StartContainer`, `RemoveContainer`, ... calls, whose requests carry the same pod and
/// container, as this).
#[derive(Clone, PartialEq, prost::Message)]
pub struct StateChangeEvent {
    /// Which event.
    #[prost(enumeration = "Event", tag = "1")]
    pub event: i32,
    /// The pod.
    #[prost(message, optional, tag = "2")]
    pub pod: Option<PodSandbox>,
    /// The container, for container events.
    #[prost(message, optional, tag = "3")]
    pub container: Option<Container>,
}

/// The request of the dedicated lifecycle calls: a pod (field 1) and, for container events, a container (2).
#[derive(Clone, PartialEq, prost::Message)]
pub struct PodContainerRequest {
    /// The pod.
    #[prost(message, optional, tag = "1")]
    pub pod: Option<PodSandbox>,
    /// The container.
    #[prost(message, optional, tag = "2")]
    pub container: Option<Container>,
}

/// `Runtime.UpdateContainers`' request: unsolicited updates from the plugin.
#[derive(Clone, PartialEq, prost::Message)]
pub struct UpdateContainersRequest {
    /// Updates.
    #[prost(message, repeated, tag = "1")]
    pub update: Vec<ContainerUpdate>,
    /// Evictions.
    #[prost(message, repeated, tag = "2")]
    pub evict: Vec<ContainerEviction>,
}

/// `Runtime.UpdateContainers`' answer.
#[derive(Clone, PartialEq, prost::Message)]
pub struct UpdateContainersResponse {
    /// The updates that failed.
    #[prost(message, repeated, tag = "1")]
    pub failed: Vec<ContainerUpdate>,
}

/// NRI's events.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, prost::Enumeration)]
#[repr(i32)]
pub enum Event {
    /// Not an event.
    Unknown = 0,
    /// A pod sandbox started.
    RunPodSandbox = 1,
    /// A pod sandbox stopped.
    StopPodSandbox = 2,
    /// A pod sandbox was removed.
    RemovePodSandbox = 3,
    /// A container is about to be created (adjustable, refusable).
    CreateContainer = 4,
    /// A container was created.
    PostCreateContainer = 5,
    /// A container is about to start.
    StartContainer = 6,
    /// A container started.
    PostStartContainer = 7,
    /// A container's resources are about to change.
    UpdateContainer = 8,
    /// A container's resources changed.
    PostUpdateContainer = 9,
    /// A container is stopping.
    StopContainer = 10,
    /// A container was removed.
    RemoveContainer = 11,
    /// A pod's resources are about to change.
    UpdatePodSandbox = 12,
    /// A pod's resources changed.
    PostUpdatePodSandbox = 13,
    /// Validate other plugins' adjustments (this crate accepts every adjustment).
    ValidateContainerAdjustment = 14,
}

/// A set of [`Event`]s, as `ConfigureResponse.events` carries it: event `e` is bit `e - 1`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct EventMask(pub i32);

impl EventMask {
    /// The set of the given events.
    pub fn of(events: &[Event]) -> EventMask {
        EventMask(events.iter().filter(|&&e| e != Event::Unknown).fold(0, |m, &e| m | 1 << (e as i32 - 1)))
    }

    /// Whether `event` is in the set.
    pub fn contains(self, event: Event) -> bool {
        event != Event::Unknown && self.0 & 1 << (event as i32 - 1) != 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use prost::Message as _;

    #[test]
    fn event_bits_are_event_minus_one() {
        assert_eq!(EventMask::of(&[Event::CreateContainer]).0, 0b1000);
        assert_eq!(EventMask::of(&[Event::RunPodSandbox, Event::RemoveContainer]).0, 1 | 1 << 10);
        assert!(EventMask(0b1000).contains(Event::CreateContainer));
        assert!(!EventMask(0b1000).contains(Event::StartContainer));
    }

    #[test]
    fn field_numbers_on_the_wire() {
        // ConfigureResponse.events is field 2, a varint.
        assert_eq!(ConfigureResponse { events: 8 }.encode_to_vec(), [0x10, 8]);
        // ContainerAdjustment.env is field 4: one KeyValue {key = 1, value = 2}.
        let mut adjust = ContainerAdjustment::default();
        adjust.remove_env("A");
        assert_eq!(adjust.encode_to_vec(), [0x22, 4, 0x0a, 2, b'-', b'A']);
        // Container.name is field 3, Container.linux field 11 with cgroups_path field 5, pid field 12.
        let bytes = [0x1a, 1, b'c', 0x5a, 3, 0x2a, 1, b'/', 0x60, 42];
        let c = Container::decode(&bytes[..]).unwrap();
        assert_eq!((c.name.as_str(), c.linux.unwrap().cgroups_path.as_str(), c.pid), ("c", "/", 42));
    }

    #[test]
    fn unknown_fields_are_skipped() {
        // PodSandbox with field 10 (ips, not declared here) before the name.
        let bytes = [0x52, 2, b'i', b'p', 0x12, 1, b'p'];
        assert_eq!(PodSandbox::decode(&bytes[..]).unwrap().name, "p");
    }
}
