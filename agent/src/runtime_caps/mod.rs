//! Caps set where the container is made (#45), with least privilege (#53): a room of its own beside the tick, an
//! input of the node's state (what the runtime made) and an actor at each container's creation.
//!
//! Two processes in two pods. The [`relay`] (`gpubudget-agent runtime-caps-relay`) alone holds the runtime's NRI
//! socket — no host PIDs, no API token, no port; it hands the agent only GPU containers, and only the variables the
//! decision reads ([`wire`]), and lets back only an adjustment of the MPS and memory-limit variables. The agent
//! (`run --runtime-caps`, non-root) connects to the relay's socket ([`channel`]) and decides here: at each
//! `CreateContainer` the runtime shows the container it will build — its final environment and device nodes — and
//! the agent, from its own pod table (the budget that applies, the share resolved on this node's GPUs), writes the
//! canonical caps into it ([`gpubudget_common::caps::runtime`]) before its process exists: whichever way the pod was
//! created (webhook down, static pod, devices from a ConfigMap, a hostile value), and for a fraction of a GPU, whose
//! size only the node knows. A container counts capped only once the runtime shows the container it made
//! (`PostCreateContainer`: [`RuntimeCaps::created`]), and every GPU container left uncapped is told by an event on
//! it, in addition to the pod's record.
//!
//! A GPU container whose budget cannot be told in time (the caches not synced, the pod not in the table, the agent
//! not connected to the relay) is created uncapped and told (`create`, the default: fail-open) or refused with the
//! reason (`refuse`: fail-closed for GPU containers; the kubelet retries with back-off). Without the relay the
//! runtime creates every container unadjusted (measured on containerd 2.3.4: nri/README.md), and the cap-in-force
//! check, status and eviction stay the judges.

pub mod channel;
pub mod made;
pub mod relay;
pub mod wire;

use std::sync::Arc;
use std::time::Duration;

use gpubudget_common::caps::runtime::{self, Adjustment};
use gpubudget_common::{Budget, CriticalNamespaces};

use gpubudget_common::caps::{Caps, ContainerCap, Devices};
use gpubudget_nri::api::{Container, ContainerAdjustment, PodSandbox};
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::histogram::Histogram;
use tokio::sync::{mpsc, watch};

use crate::attribute::pods::PodTable;
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

impl Unresolved {
    /// The choice for a container of `namespace`: `Create` in the namespaces `never_refuse` lists.
    pub fn for_namespace(self, never_refuse: &CriticalNamespaces, namespace: &str) -> Unresolved {
        if never_refuse.exempts(namespace) { Unresolved::Create } else { self }
    }
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
    /// Namespaces whose containers are never refused, whatever `unresolved` says (the release's own, whose agent
    /// must start for any container to be capped, and the administrator's critical ones: a device plugin or a
    /// GPU operator's pods see every GPU).
    pub never_refuse: CriticalNamespaces,
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

/// What became of a container creation the agent answered (`gpubudget_runtime_caps_containers_total{outcome}`).
#[derive(Debug, Clone, Copy, Hash, PartialEq, Eq)]
pub enum Outcome {
    /// `not_gpu`: it sees no GPU.
    NotGpu,
    /// `no_budget`: no budget selects its pod.
    NoBudget,
    /// `caps_off`: its budget sets no caps.
    CapsOff,
    /// `capped`: given its caps.
    Capped,
    /// `devices_unknown`: its device count is unknown, so no MPS cap.
    DevicesUnknown,
    /// `unresolved_created`: its budget not known in time, created uncapped.
    UnresolvedCreated,
    /// `unresolved_refused`: its budget not known in time, refused.
    UnresolvedRefused,
}

impl Outcome {
    /// The label value.
    pub fn as_str(self) -> &'static str {
        match self {
            Outcome::NotGpu => "not_gpu",
            Outcome::NoBudget => "no_budget",
            Outcome::CapsOff => "caps_off",
            Outcome::Capped => "capped",
            Outcome::DevicesUnknown => "devices_unknown",
            Outcome::UnresolvedCreated => "unresolved_created",
            Outcome::UnresolvedRefused => "unresolved_refused",
        }
    }
}

gpubudget_daemon::label_values!(Outcome);

/// `{outcome}` of a container creation the plugin saw.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct OutcomeLabels {
    /// What became of it.
    pub outcome: Outcome,
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
    Adjust {
        /// The variables set and removed.
        adjustment: Box<Adjustment>,
        /// Its pod.
        pod: PodRef,
        /// Which budget, and its limit (or why its device count is unknown), for the events.
        how: String,
    },
    /// Its pod's budget is not known yet.
    Unknown(NotKnown),
}

/// Why a GPU container's budget is not known (yet).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum NotKnown {
    /// The agent's caches have not synced.
    #[error("the agent's caches have not synced yet")]
    NotSynced,
    /// The pod is not in the agent's table (yet).
    #[error("pod {namespace}/{name} (uid {uid}) is not in the agent's table yet")]
    NotInTable {
        /// Its namespace, as the runtime names it.
        namespace: String,
        /// Its name.
        name: String,
        /// Its UID.
        uid: String,
    },
    /// Its share cannot be sized yet (a fraction before the node knows its GPUs' memory).
    #[error("pod {namespace}/{name}: {note}")]
    ShareNotSized {
        /// Its namespace.
        namespace: String,
        /// Its name.
        name: String,
        /// The share's note.
        note: String,
    },
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
        return Decision::Unknown(NotKnown::NotSynced);
    }
    let Some((pod_ref, budget)) = rules(&view.table, pod) else {
        let (namespace, name, uid) = (pod.namespace.clone(), pod.name.clone(), pod.uid.clone());
        return Decision::Unknown(NotKnown::NotInTable { namespace, name, uid });
    };
    let Some(budget) = budget else { return Decision::NoBudget };
    let Some(caps) = Caps::of(budget) else { return Decision::CapsOff };
    // A share the node cannot size yet (a fraction before NVML told the GPUs' memory) is not known: the container
    // waits for it like any unknown (#51), never capped at the budget's limit for its whole life. A share that
    // cannot be read because of the pod's own values is held to the limit, as enforcement holds it.
    if let Some(held) = budget.held_share.as_ref().filter(|h| !h.resolved() && !budget.share_fault_is_pods()) {
        let (namespace, name, note) = (pod.namespace.clone(), pod.name.clone(), held.note.clone());
        return Decision::Unknown(NotKnown::ShareNotSized { namespace, name, note });
    }
    let adjustment = runtime::adjust(&container.name, &container.env, devices, caps, mps_pipe);
    let how = match devices {
        Devices::Known(_) => format!("budget {} ({})", budget.key(), budget.limit_text),
        Devices::Unknown(why) => format!("budget {}: its device count is unknown ({why})", budget.key()),
    };
    Decision::Adjust { adjustment: Box::new(adjustment), pod: pod_ref, how }
}

pub use made::{Expect, Made};

/// The name the relay registers with the runtime as (its logs and `ctr plugins` show it).
pub const PLUGIN_NAME: &str = "gpubudget";
/// Its index: late among plugins, so the caps are set on the environment other plugins left.
pub const PLUGIN_INDEX: &str = "90";

/// The deciding side: see the module's documentation. Called by [`channel`] for each question of the relay.
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

    fn count(&self, outcome: Outcome) {
        self.metrics.containers.get_or_create(&OutcomeLabels { outcome }).inc();
    }

    /// An event on `container` of `pod`: each container its own (a pod's several GPU containers are each told).
    fn tell(&self, pod: PodRef, container: &str, reason: Reason, note: String) {
        let _ = self.events.send(Action::ContainerEvent { pod, container: container.to_owned(), reason, note });
    }

    /// [`decide`], waiting up to `wait` for a new table while the pod's budget is unknown.
    async fn decide_in_time(&self, pod: &PodSandbox, container: &Container, wait: Duration) -> Decision {
        let mut view = self.view.clone();
        let deadline = tokio::time::Instant::now() + wait;
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

    /// A GPU container that exists (made while the agent was away, or before): judged as it is, so a pod with one
    /// made uncapped meanwhile is not counted capped, and told on the container (#53), not only in the record.
    /// `NVIDIA_VISIBLE_DEVICES=all` is the node's GPUs: known once the agent's first table is built (waited for up to
    /// the settings' `wait`).
    pub async fn existing(&self, pod: &PodSandbox, c: &Container) {
        let mut view = self.view.clone();
        let _ = tokio::time::timeout(self.settings.wait, view.wait_for(|v| v.synced)).await;
        let Some(devices) = devices_of(c, view.borrow().gpus) else { return };
        let held = runtime::held_in(&c.name, &c.env, devices);
        self.made.remember(&pod.uid, &c.name, held, devices.known().unwrap_or(0));
        if let (ContainerCap::Uncapped(why), Decision::Adjust { pod: pod_ref, how, .. }) =
            (held, decide(&view.borrow(), pod, c, self.settings.mps_pipe.as_deref()))
        {
            let note = format!(
                "container {} was made while the agent was not connected to the runtime: not capped at creation \
                 ({why}); {how}; eviction still holds the pod to its budget",
                c.name
            );
            self.tell(pod_ref, &c.name, Reason::NotCappedAtCreation, note);
        }
    }

    /// A container about to be made: its adjustment (`Err`: refused, with the reason), waiting at most `wait` (the
    /// settings' or less: the runtime's deadline) for its pod's budget. What was asked is remembered and told once
    /// the runtime shows the container it made ([`Self::created`]).
    pub async fn create(
        &self,
        pod: &PodSandbox,
        container: &Container,
        wait: Duration,
    ) -> Result<ContainerAdjustment, String> {
        let started = tokio::time::Instant::now();
        let decision = self.decide_in_time(pod, container, wait.min(self.settings.wait)).await;
        let devices = devices_of(container, self.view.borrow().gpus);
        let expect = |expect: Expect| {
            if let Some(d) = devices {
                self.made.expect(&pod.uid, &container.id, &container.name, d.known().unwrap_or(0), expect);
            }
        };
        let answer = match decision {
            Decision::NotGpu => {
                self.count(Outcome::NotGpu);
                Ok(ContainerAdjustment::default())
            }
            Decision::NoBudget | Decision::CapsOff => {
                self.count(if decision == Decision::NoBudget { Outcome::NoBudget } else { Outcome::CapsOff });
                if let Some(d) = devices {
                    let held = runtime::held_in(&container.name, &container.env, d);
                    self.made.remember(&pod.uid, &container.name, held, d.known().unwrap_or(0));
                }
                Ok(ContainerAdjustment::default())
            }
            Decision::Adjust { adjustment, how, .. } => {
                match &adjustment.record.uncapped {
                    None => {
                        self.count(Outcome::Capped);
                        expect(Expect::Capped { how });
                    }
                    Some(why) => {
                        self.count(Outcome::DevicesUnknown);
                        let set: Vec<String> = adjustment.set.iter().map(|(k, v)| format!("{k}={v}")).collect();
                        let note = format!(
                            "container {}: no MPS cap at creation ({why}); {how}; set {}",
                            container.name,
                            set.join(" ")
                        );
                        expect(Expect::Uncapped { note });
                    }
                }
                Ok(to_nri(&adjustment))
            }
            Decision::Unknown(why) => {
                match self.settings.unresolved.for_namespace(&self.settings.never_refuse, &pod.namespace) {
                    Unresolved::Create => {
                        self.count(Outcome::UnresolvedCreated);
                        let note = format!(
                            "container {} created without caps: {why} (--runtime-caps-unresolved=create)",
                            container.name
                        );
                        expect(Expect::Uncapped { note });
                        tracing::warn!(pod = %format!("{}/{}", pod.namespace, pod.name), container = %container.name, %why, "runtime caps: GPU container created uncapped (--runtime-caps-unresolved=create)");
                        Ok(ContainerAdjustment::default())
                    }
                    Unresolved::Refuse => {
                        self.count(Outcome::UnresolvedRefused);
                        Err(format!(
                            "gpubudget: GPU container {} not created: {why} after {:?} (--runtime-caps-unresolved=refuse; the kubelet retries)",
                            container.name,
                            wait.min(self.settings.wait)
                        ))
                    }
                }
            }
        };
        self.metrics.seconds.observe(started.elapsed().as_secs_f64());
        answer
    }

    /// A GPU container as the runtime made it (`PostCreateContainer`): how the driver holds it, read from the
    /// environment it was made with, is what the record counts and what the event on it says — capped only where
    /// the runtime applied the caps (#53).
    pub async fn created(&self, pod: &PodSandbox, c: &Container) {
        // The budget as the creation saw it: a pod made while the agent was away (or stopped) may reach its table
        // only now; and the creation's own answer, handled concurrently, is then recorded.
        let decision = self.decide_in_time(pod, c, self.settings.wait).await;
        tokio::task::yield_now().await;
        let expected = self.made.take_expected(&c.id);
        let Some(devices) = devices_of(c, self.view.borrow().gpus) else { return };
        let held = runtime::held_in(&c.name, &c.env, devices);
        self.made.confirm(&pod.uid, &c.id, &c.name, held, devices.known().unwrap_or(0));
        let pod_ref = || match &decision {
            Decision::Adjust { pod: pod_ref, .. } => pod_ref.clone(),
            _ => PodRef {
                uid: pod.uid.to_ascii_lowercase().into(),
                namespace: pod.namespace.as_str().into(),
                name: pod.name.as_str().into(),
            },
        };
        if let Some((reason, note)) = confirmation(&c.name, &c.env, expected, held, &decision) {
            self.tell(pod_ref(), &c.name, reason, note);
        }
    }
}

/// What is told of a GPU container named `name` the runtime made with `env`, held `held`: from what was asked at its
/// creation (`expected`; `None` when the agent did not answer it) and its budget's decision now. Pure.
pub fn confirmation(
    name: &str,
    env: &[String],
    expected: Option<Expect>,
    held: ContainerCap,
    decision: &Decision,
) -> Option<(Reason, String)> {
    let values = || {
        let set: Vec<String> =
            runtime::ADJUSTABLE.iter().filter_map(|k| runtime::env_get(env, k).map(|v| format!("{k}={v}"))).collect();
        set.join(" ")
    };
    match (expected, held) {
        (Some(Expect::Capped { how }), ContainerCap::Capped { .. }) => Some((
            Reason::CappedAtCreation,
            format!(
                "container {name} capped by the runtime at creation (read back from the container it made), {how}: {}",
                values()
            ),
        )),
        (Some(Expect::Capped { how }), ContainerCap::Uncapped(why)) => Some((
            Reason::NotCappedAtCreation,
            format!(
                "container {name}: the runtime made it without the caps it was given ({why}); {how}; eviction still \
                 holds the pod to its budget"
            ),
        )),
        (Some(Expect::Uncapped { note }), _) => Some((Reason::NotCappedAtCreation, note)),
        (None, held) => match (decision, held) {
            (Decision::Adjust { how, .. }, ContainerCap::Uncapped(why)) => Some((
                Reason::NotCappedAtCreation,
                format!(
                    "container {name} was made while the agent did not answer the runtime: not capped at creation \
                     ({why}); {how}; eviction still holds the pod to its budget"
                ),
            )),
            (Decision::Adjust { how, .. }, ContainerCap::Capped { .. }) => Some((
                Reason::CappedAtCreation,
                format!(
                    "container {name} made capped (read back from the container the runtime made), {how}: {}",
                    values()
                ),
            )),
            _ => None,
        },
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

#[cfg(test)]
mod tests;
