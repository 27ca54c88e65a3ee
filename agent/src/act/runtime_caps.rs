//! Caps set where the container is made (#45): the agent as an NRI plugin of the node's container runtime
//! (`--runtime-caps`). At each `CreateContainer` the runtime shows the container it will build — its final
//! environment and device nodes — and the agent, from its own pod table (the budget that applies, the share
//! resolved on this node's GPUs), writes the canonical caps into it ([`gpubudget_common::caps::runtime`]) before
//! its process exists: whichever way the pod was created (webhook down, static pod, devices from a ConfigMap,
//! a hostile value), and for a fraction of a GPU, whose size only the node knows.
//!
//! A GPU container whose budget cannot be told yet (the caches not synced, the pod not in the table) is waited
//! for up to `--runtime-caps-wait`, then created uncapped and reported (`create`, the default) or refused with
//! the reason (`refuse`: the kubelet retries with back-off). Without the agent connected the runtime creates every
//! container unadjusted (measured on containerd 2.3.4: nri/README.md): that is the node's *fail-open* floor, and
//! the cap-in-force check, status and eviction stay the judges.

use std::sync::Arc;
use std::time::Duration;

use gpubudget_common::Budget;
use gpubudget_common::caps::runtime::{self, Adjustment};
use std::collections::{BTreeMap, HashMap};

use gpubudget_common::caps::{Caps, Devices, Held};
use gpubudget_common::pod_record::RuntimeCapsRecord;
use gpubudget_nri::api::{self, Container, ContainerAdjustment, EventMask, PodSandbox};
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::histogram::Histogram;
use tokio::sync::{mpsc, watch};

use crate::attribute::pods::{MpsCap, PodTable};
use crate::decide::{Action, PodRef, Reason};

/// What a GPU container whose budget is not known in time gets (`--runtime-caps-unresolved`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum Unresolved {
    /// Created without caps, reported (event `GpuMemoryNotCappedAtCreation`, metric): eviction still holds it.
    #[default]
    Create,
    /// Refused with the reason; the kubelet retries the container with back-off.
    Refuse,
}

/// The plugin's settings (`--runtime-caps-*`).
#[derive(Debug, Clone)]
pub struct Settings {
    /// How long a GPU container waits for its pod's budget to be known.
    pub wait: Duration,
    /// What it gets after that.
    pub unresolved: Unresolved,
    /// The node's MPS pipe directory, set in every capped container (`None`: left as it is).
    pub mps_pipe: Option<String>,
}

/// What the plugin decides from, published by the agent's loop at each table build.
#[derive(Debug, Clone, Default)]
pub struct View {
    /// The latest pod table (budgets resolved, shares on this node's GPUs).
    pub table: Arc<PodTable>,
    /// Whether the caches had synced when it was built.
    pub synced: bool,
    /// The node's GPUs (`NVIDIA_VISIBLE_DEVICES=all` sees them all).
    pub gpus: u32,
}

/// `{outcome}` of a container creation the plugin saw.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct OutcomeLabels {
    /// `not_gpu`, `no_budget`, `caps_off`, `capped`, `devices_unknown`, `unresolved_created`, `unresolved_refused`.
    pub outcome: String,
}

/// The plugin's metrics (registered by [`crate::report::metrics::Metrics`]).
#[derive(Debug, Clone)]
pub struct RuntimeMetrics {
    /// `gpubudget_runtime_caps_containers_total{outcome}`.
    pub containers: Family<OutcomeLabels, Counter>,
    /// `gpubudget_runtime_caps_seconds`: the time the plugin took to answer a `CreateContainer`.
    pub seconds: Histogram,
    /// `gpubudget_runtime_caps_registrations_total`: registrations with the runtime (one per (re)connection).
    pub registrations: Counter,
}

impl Default for RuntimeMetrics {
    fn default() -> Self {
        let buckets = [0.000_05, 0.000_1, 0.000_25, 0.000_5, 0.001, 0.002_5, 0.005, 0.01, 0.05, 0.25, 1.0, 2.0];
        Self { containers: Family::default(), seconds: Histogram::new(buckets), registrations: Counter::default() }
    }
}

/// What the plugin decided for one container, before any waiting (pure: [`decide`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Decision {
    /// The container sees no GPU: left as it is.
    NotGpu,
    /// No budget selects its pod: left as it is.
    NoBudget,
    /// Its budget sets no caps (`admissionCaps` not enabled): left as it is.
    CapsOff,
    /// Capped (or, with an unknown device count, its MPS value removed and reported).
    Adjust(Box<Adjustment>, PodRef, String),
    /// Its pod's budget is not known yet: why.
    Unknown(String),
}

/// Which budget rules apply to the pod the runtime names (by UID; a static pod's is its mirror's annotation, which
/// the table indexes too).
fn rules<'t>(table: &'t PodTable, pod: &PodSandbox) -> Option<(PodRef, Option<&'t Budget>)> {
    let uid = pod.uid.to_ascii_lowercase();
    let i = table.find_uid(&uid)?;
    let view = &table.pods[i];
    let pod_ref = PodRef { uid: view.uid.clone(), namespace: view.namespace.clone(), name: view.name.clone() };
    Some((pod_ref, table.budget(i)))
}

/// The devices `container` will see as the runtime makes it, on a node of `gpus` GPUs (`None`: no GPU).
fn devices_of(container: &Container, gpus: u32) -> Option<Devices> {
    let paths = container.linux.iter().flat_map(|l| l.devices.iter().map(|d| d.path.as_str()));
    runtime::devices_seen(&container.env, paths, gpus)
}

/// What to do with `container` of `pod`, from `view`. Linear in the container's environment and devices.
pub fn decide(view: &View, pod: &PodSandbox, container: &Container, mps_pipe: Option<&str>) -> Decision {
    let Some(devices) = devices_of(container, view.gpus) else { return Decision::NotGpu };
    if !view.synced {
        return Decision::Unknown("the agent's caches have not synced yet".to_owned());
    }
    let Some((pod_ref, budget)) = rules(&view.table, pod) else {
        return Decision::Unknown(format!(
            "pod {}/{} (uid {}) is not in the agent's table yet",
            pod.namespace, pod.name, pod.uid
        ));
    };
    let Some(budget) = budget else { return Decision::NoBudget };
    let Some(caps) = Caps::of(budget) else { return Decision::CapsOff };
    // A share the node cannot size yet (a fraction before NVML told the GPUs' memory) is not known: the container
    // waits for it like any unknown (#51), never capped at the budget's limit for its whole life. A share that
    // cannot be read because of the pod's own values is held to the limit, as enforcement holds it.
    if let Some(held) = budget.held_share.as_ref().filter(|h| !h.resolved() && !budget.share_fault) {
        return Decision::Unknown(format!("pod {}/{}: {}", pod.namespace, pod.name, held.note));
    }
    let adjustment = runtime::adjust(&container.name, &container.env, devices, caps, mps_pipe);
    let how = match devices {
        Devices::Known(_) => format!("budget {} ({})", budget.key(), budget.limit_text),
        Devices::Unknown(why) => format!("budget {}: its device count is unknown ({why})", budget.key()),
    };
    Decision::Adjust(Box::new(adjustment), pod_ref, how)
}

/// What the runtime made of each pod's GPU containers, by pod UID and container name: how the driver holds each one
/// (read from its final environment) and how many devices it sees. Filled from the containers the plugin adjusts
/// and from those the runtime lists when the plugin (re)connects; the table reads it ([`summary`]).
pub type Made = Arc<std::sync::Mutex<HashMap<Arc<str>, BTreeMap<String, (Held, u32)>>>>;

/// What a pod's GPU containers as the runtime made them come to: the record (capped at the largest, or the first
/// uncapped one and why) and, when every one is capped, the cap the agent's cap-in-force check judges.
pub fn summary(containers: &BTreeMap<String, (Held, u32)>) -> (RuntimeCapsRecord, Option<MpsCap>) {
    let mut cap: Option<MpsCap> = None;
    for (name, (held, devices)) in containers {
        match held {
            Held::Uncapped(why) => return (RuntimeCapsRecord::uncapped(format!("container {name}: {why}")), None),
            Held::Capped { max_mib } => {
                let c = cap.get_or_insert(MpsCap { mib: *max_mib, devices: *devices });
                c.mib = c.mib.max(*max_mib);
                c.devices = c.devices.min(*devices);
            }
        }
    }
    (RuntimeCapsRecord::Capped { max_mib: cap.map_or(0, |c| c.mib) }, cap)
}

/// The NRI plugin: see the module's documentation.
#[derive(Debug)]
pub struct RuntimeCaps {
    view: watch::Receiver<View>,
    settings: Settings,
    metrics: RuntimeMetrics,
    events: mpsc::UnboundedSender<Action>,
    made: Made,
}

impl RuntimeCaps {
    /// A plugin reading `view`, telling pods' events through `events` (the loop's executor).
    pub fn new(
        view: watch::Receiver<View>,
        settings: Settings,
        metrics: RuntimeMetrics,
        events: mpsc::UnboundedSender<Action>,
        made: Made,
    ) -> Self {
        Self { view, settings, metrics, events, made }
    }

    /// Remembers how the driver holds a GPU container of the pod with UID `uid`, as made with `env`.
    fn remember(&self, uid: &str, name: &str, env: &[String], devices: Devices) {
        let held = runtime::held_in(name, env, devices);
        let mut made = self.made.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        made.entry(Arc::from(uid.to_ascii_lowercase()))
            .or_default()
            .insert(name.to_owned(), (held, devices.known().unwrap_or(0)));
    }

    fn count(&self, outcome: &str) {
        self.metrics.containers.get_or_create(&OutcomeLabels { outcome: outcome.to_owned() }).inc();
    }

    /// An event on `container` of `pod`: each container its own (a pod's several GPU containers are each told).
    fn tell(&self, pod: PodRef, container: &str, reason: Reason, note: String) {
        let _ = self.events.send(Action::ContainerEvent { pod, container: container.to_owned(), reason, note });
    }

    /// [`decide`], waiting up to the settings' `wait` for a new table while the pod's budget is unknown.
    async fn decide_in_time(&self, pod: &PodSandbox, container: &Container) -> Decision {
        let mut view = self.view.clone();
        let deadline = tokio::time::Instant::now() + self.settings.wait;
        loop {
            let decision = decide(&view.borrow_and_update(), pod, container, self.settings.mps_pipe.as_deref());
            if !matches!(decision, Decision::Unknown(_)) {
                return decision;
            }
            match tokio::time::timeout_at(deadline, view.changed()).await {
                Ok(Ok(())) => {}
                Ok(Err(_)) | Err(_) => return decision,
            }
        }
    }
}

/// The adjustment the runtime applies: the variables set and removed.
fn to_nri(a: &Adjustment) -> ContainerAdjustment {
    let mut out = ContainerAdjustment::default();
    for (k, v) in &a.set {
        out.add_env(*k, v.as_str());
    }
    for k in &a.remove {
        out.remove_env(k);
    }
    out
}

impl gpubudget_nri::Plugin for RuntimeCaps {
    async fn configure(&self, req: api::ConfigureRequest) -> EventMask {
        tracing::info!(runtime = %req.runtime_name, version = %req.runtime_version, "runtime caps: registered with the container runtime");
        self.metrics.registrations.inc();
        EventMask::of(&[api::Event::CreateContainer])
    }

    async fn synchronize(&self, pods: Vec<PodSandbox>, containers: Vec<Container>) -> Vec<api::ContainerUpdate> {
        // The containers that exist when the plugin (re)connects, made while it was away or before: judged as they
        // are, so a pod with one made uncapped meanwhile is not counted capped.
        // `NVIDIA_VISIBLE_DEVICES=all` is the node's GPUs: at the agent's start they are known once its first table
        // is built (within the runtime's 2 s, or judged with what is known then).
        let mut view = self.view.clone();
        let _ = tokio::time::timeout(self.settings.wait, view.wait_for(|v| v.synced)).await;
        let gpus = view.borrow().gpus;
        let pod_of: HashMap<&str, &PodSandbox> = pods.iter().map(|p| (p.id.as_str(), p)).collect();
        let mut seen = 0;
        for c in &containers {
            let Some(pod) = pod_of.get(c.pod_sandbox_id.as_str()) else { continue };
            let Some(devices) = devices_of(c, gpus) else { continue };
            self.remember(&pod.uid, &c.name, &c.env, devices);
            seen += 1;
            // Made uncapped while the plugin was away, where its budget sets caps: told on the container (#53), not
            // only in the record.
            if let (Held::Uncapped(why), Decision::Adjust(_, pod_ref, how)) = (
                runtime::held_in(&c.name, &c.env, devices),
                decide(&view.borrow(), pod, c, self.settings.mps_pipe.as_deref()),
            ) {
                let note = format!(
                    "container {} was made while the agent was not connected to the runtime: not capped at creation \
                     ({why}); {how}; eviction still holds the pod to its budget",
                    c.name
                );
                self.tell(pod_ref, &c.name, Reason::NotCappedAtCreation, note);
            }
        }
        tracing::info!(
            pods = pods.len(),
            containers = containers.len(),
            gpu_containers = seen,
            "runtime caps: the runtime's existing containers read"
        );
        Vec::new()
    }

    async fn create_container(&self, pod: PodSandbox, container: Container) -> Result<ContainerAdjustment, String> {
        let started = tokio::time::Instant::now();
        let decision = self.decide_in_time(&pod, &container).await;
        let devices = devices_of(&container, self.view.borrow().gpus);
        let answer = match decision {
            Decision::NotGpu => {
                self.count("not_gpu");
                Ok(ContainerAdjustment::default())
            }
            Decision::NoBudget | Decision::CapsOff => {
                self.count(if decision == Decision::NoBudget { "no_budget" } else { "caps_off" });
                if let Some(devices) = devices {
                    self.remember(&pod.uid, &container.name, &container.env, devices);
                }
                Ok(ContainerAdjustment::default())
            }
            Decision::Adjust(adjustment, pod_ref, how) => {
                let record = &adjustment.record;
                let made = adjustment.applied_to(&container.env);
                if let Some(devices) = devices {
                    self.remember(&pod.uid, &container.name, &made, devices);
                }
                let set: Vec<String> = adjustment.set.iter().map(|(k, v)| format!("{k}={v}")).collect();
                match &record.uncapped {
                    None => {
                        self.count("capped");
                        let note = format!(
                            "container {} capped by the runtime at creation, {how}: {}",
                            container.name,
                            set.join(" ")
                        );
                        self.tell(pod_ref, &container.name, Reason::CappedAtCreation, note);
                    }
                    Some(why) => {
                        self.count("devices_unknown");
                        let note = format!(
                            "container {}: no MPS cap at creation ({why}); {how}; set {}",
                            container.name,
                            set.join(" ")
                        );
                        self.tell(pod_ref, &container.name, Reason::NotCappedAtCreation, note);
                    }
                }
                Ok(to_nri(&adjustment))
            }
            Decision::Unknown(why) => match self.settings.unresolved {
                Unresolved::Create => {
                    self.count("unresolved_created");
                    if let Some(devices) = devices {
                        self.remember(&pod.uid, &container.name, &container.env, devices);
                    }
                    let pod_ref = PodRef {
                        uid: pod.uid.to_ascii_lowercase().into(),
                        namespace: pod.namespace.as_str().into(),
                        name: pod.name.as_str().into(),
                    };
                    let note = format!(
                        "container {} created without caps: {why} (--runtime-caps-unresolved=create)",
                        container.name
                    );
                    self.tell(pod_ref, &container.name, Reason::NotCappedAtCreation, note);
                    tracing::warn!(pod = %format!("{}/{}", pod.namespace, pod.name), container = %container.name, %why, "runtime caps: GPU container created uncapped (--runtime-caps-unresolved=create)");
                    Ok(ContainerAdjustment::default())
                }
                Unresolved::Refuse => {
                    self.count("unresolved_refused");
                    Err(format!(
                        "gpubudget: GPU container {} not created: {why} after {:?} (--runtime-caps-unresolved=refuse; the kubelet retries)",
                        container.name, self.settings.wait
                    ))
                }
            },
        };
        self.metrics.seconds.observe(started.elapsed().as_secs_f64());
        answer
    }
}

#[cfg(test)]
mod tests;
