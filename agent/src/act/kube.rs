//! Carries actions out against the API server, off the sampling loop.
//!
//! Each pod gets a worker task that runs its actions one after another, in the order decided, so two
//! applies of one pod never race. (The eviction request is not even decided until the apply that records
//! `Evicting` and `eviction-requested-at` has been accepted: see `decide.rs`.) Pods are independent of each
//! other, but at most [`MAX_WRITES_IN_FLIGHT`] requests are in flight at once, all pods together: the
//! client speaks HTTP/1.1, one connection per concurrent request, so 1 000 pods writing their first records
//! at once would otherwise open 1 000 TLS connections to the API server (measured: 1 004 connections and
//! 79 MiB resident on a real kube-apiserver, docs/performance.md). Every API write is counted in
//! `gpubudget_api_writes_total{kind,result}`; results go back to the loop as [`Feedback`]. A record write the
//! API server refuses for good (an admission policy, RBAC) is counted `denied` and told on the Node
//! ([`super::denied`]).

use std::collections::HashMap;
use std::sync::Arc;

use k8s_openapi::api::core::v1::{ObjectReference, Pod};
use k8s_openapi::api::policy::v1::Eviction;
use kube::api::{DeleteParams, Patch, PatchParams, PostParams};
use kube::runtime::events::{Event, EventType, Recorder, Reporter};
use kube::{Api, Client};
use serde_json::json;
use tokio::sync::{Semaphore, mpsc};

use super::denied::{Denial, Notices};
use super::{Counters, EvictionResult, WriteKind, WriteResult};
use crate::decide::{Action, EvictOutcome, Feedback, PodRef, Reason};

/// The reporting controller of the agent's events.
pub const REPORTING_CONTROLLER: &str = "gpubudget-agent";

/// API requests (applies, events, evictions) in flight at once, all pods together. Each is one HTTP/1.1
/// connection while it lasts (idle ones are reused), so this also bounds the agent's connections to the API
/// server: this many plus its two watches.
pub const MAX_WRITES_IN_FLIGHT: usize = 8;

#[derive(Clone)]
struct Shared {
    client: Client,
    recorder: Recorder,
    field_manager: String,
    node: String,
    counters: Counters,
    feedback: mpsc::UnboundedSender<Feedback>,
    /// [`MAX_WRITES_IN_FLIGHT`] permits; a worker holds one while its request runs.
    in_flight: Arc<Semaphore>,
    /// Refused writes already told on the Node.
    denials: Arc<Notices>,
}

/// Dispatches actions to per-pod workers.
pub struct KubeExecutor {
    shared: Shared,
    workers: HashMap<Arc<str>, mpsc::UnboundedSender<Action>>,
}

impl std::fmt::Debug for KubeExecutor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KubeExecutor").field("workers", &self.workers.len()).finish_non_exhaustive()
    }
}

impl KubeExecutor {
    /// An executor for the agent of `node`; results arrive on the returned receiver.
    pub fn new(client: Client, node: &str, counters: Counters) -> (Self, mpsc::UnboundedReceiver<Feedback>) {
        let reporter = Reporter { controller: REPORTING_CONTROLLER.into(), instance: Some(node.to_owned()) };
        let (tx, rx) = mpsc::unbounded_channel();
        let shared = Shared {
            recorder: Recorder::new(client.clone(), reporter),
            client,
            field_manager: gpubudget_common::pod_record::agent_field_manager(node),
            node: node.to_owned(),
            counters,
            feedback: tx,
            in_flight: Arc::new(Semaphore::new(MAX_WRITES_IN_FLIGHT)),
            denials: Arc::default(),
        };
        (Self { shared, workers: HashMap::new() }, rx)
    }

    /// Queues actions; [`Action::Transition`] is only logged.
    pub fn dispatch(&mut self, actions: impl IntoIterator<Item = Action>) {
        for action in actions {
            if let Action::Transition { pod, from, to, usage, limit, budget } = &action {
                tracing::info!(%pod, from = from.as_str(), to = to.as_str(), usage, limit, %budget, "state changed");
                continue;
            }
            // Observe mode (#54): counted and logged; nothing goes to the API (its event is an action of its own).
            if let Action::WouldEvict { pod, cause, set_by } = &action {
                self.shared.counters.would_evict(*cause, *set_by);
                tracing::info!(%pod, cause = cause.as_str(), set_by = set_by.as_str(), "would evict (observe mode): no eviction requested");
                continue;
            }
            // Events on the Node have no pod: they share one worker, keyed by the empty UID.
            let uid = action.pod().map_or_else(|| Arc::from(""), |pod| pod.uid.clone());
            let sender = self.workers.entry(uid).or_insert_with(|| {
                let (tx, rx) = mpsc::unbounded_channel();
                tokio::spawn(worker(self.shared.clone(), rx));
                tx
            });
            if let Err(mpsc::error::SendError(action)) = sender.send(action) {
                // The worker ended (it never does while its sender lives); start another.
                let (tx, rx) = mpsc::unbounded_channel();
                tokio::spawn(worker(self.shared.clone(), rx));
                let _ = tx.send(action);
                *sender = tx;
            }
        }
    }

    /// Lets the workers of pods no longer known finish their queue and end.
    pub fn retain(&mut self, keep: impl Fn(&str) -> bool) {
        self.workers.retain(|uid, _| keep(uid));
    }

    /// Workers alive.
    pub fn workers(&self) -> usize {
        self.workers.len()
    }
}

async fn worker(shared: Shared, mut rx: mpsc::UnboundedReceiver<Action>) {
    while let Some(action) = rx.recv().await {
        // Waiting here keeps this pod's order: its next action is not even received before this one ran.
        let Ok(_permit) = shared.in_flight.acquire().await else { return };
        // Boxed: an idle worker (one per pod with a record, 1 000 on a full node) holds only this loop's
        // state, not room for the largest request future (measured: docs/performance.md).
        let feedback = Box::pin(execute(&shared, action)).await;
        if let Some(feedback) = feedback {
            let _ = shared.feedback.send(feedback);
        }
    }
}

fn object_ref(pod: &PodRef) -> ObjectReference {
    ObjectReference {
        api_version: Some("v1".into()),
        kind: Some("Pod".into()),
        name: Some(pod.name.to_string()),
        namespace: Some(pod.namespace.to_string()),
        uid: Some(pod.uid.to_string()),
        ..ObjectReference::default()
    }
}

fn api_code(error: &kube::Error) -> Option<u16> {
    match error {
        kube::Error::Api(status) => Some(status.code),
        _ => None,
    }
}

async fn execute(shared: &Shared, action: Action) -> Option<Feedback> {
    let m = &shared.counters;
    match action {
        Action::Transition { .. } | Action::WouldEvict { .. } => None,
        Action::Apply { pod, record, driver } => {
            // `metadata.uid` is a precondition: the API server refuses (409) a write to a pod that took the name.
            let body = json!({
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": {"name": &*pod.name, "namespace": &*pod.namespace, "uid": &*pod.uid,
                             "annotations": super::annotations(&record, driver.as_ref())},
            });
            let ok = apply(shared, &pod, &body, WriteKind::Apply).await;
            Some(Feedback::Written { uid: pod.uid, record: Some(record), ok })
        }
        Action::Clear { pod } => {
            let body = json!({"apiVersion": "v1", "kind": "Pod",
                              "metadata": {"name": &*pod.name, "namespace": &*pod.namespace, "uid": &*pod.uid}});
            let ok = apply(shared, &pod, &body, WriteKind::Clear).await;
            Some(Feedback::Written { uid: pod.uid, record: None, ok })
        }
        Action::Event { pod, reason, note } => {
            let event = Event {
                type_: if reason.is_warning() { EventType::Warning } else { EventType::Normal },
                reason: reason.as_str().into(),
                note: Some(note),
                action: match reason {
                    Reason::Evicting | Reason::EvictionBlocked => "Evict".into(),
                    _ => "Measure".into(),
                },
                secondary: None,
            };
            match shared.recorder.publish(&event, &object_ref(&pod)).await {
                Ok(()) => m.write(WriteKind::Event, WriteResult::Ok),
                Err(error) => {
                    m.write(WriteKind::Event, WriteResult::Error);
                    tracing::warn!(%pod, reason = reason.as_str(), %error, "cannot publish event");
                }
            }
            None
        }
        Action::ContainerEvent { pod, container, reason, note } => {
            let event = Event {
                type_: if reason.is_warning() { EventType::Warning } else { EventType::Normal },
                reason: reason.as_str().into(),
                note: Some(note),
                action: "Measure".into(),
                secondary: None,
            };
            let regarding =
                ObjectReference { field_path: Some(format!("spec.containers{{{container}}}")), ..object_ref(&pod) };
            match shared.recorder.publish(&event, &regarding).await {
                Ok(()) => m.write(WriteKind::Event, WriteResult::Ok),
                Err(error) => {
                    m.write(WriteKind::Event, WriteResult::Error);
                    tracing::warn!(%pod, %container, %error, "event not recorded");
                }
            }
            None
        }
        Action::NodeEvent { reason, note } => {
            let event = Event {
                type_: if reason.is_warning() { EventType::Warning } else { EventType::Normal },
                reason: reason.as_str().into(),
                note: Some(note),
                action: "Measure".into(),
                secondary: None,
            };
            let node = ObjectReference {
                api_version: Some("v1".into()),
                kind: Some("Node".into()),
                name: Some(shared.node.clone()),
                ..ObjectReference::default()
            };
            match shared.recorder.publish(&event, &node).await {
                Ok(()) => m.write(WriteKind::Event, WriteResult::Ok),
                Err(error) => {
                    m.write(WriteKind::Event, WriteResult::Error);
                    tracing::warn!(node = %shared.node, reason = reason.as_str(), %error, "cannot publish event");
                }
            }
            None
        }
        Action::Evict { pod, grace_seconds, recorded } => {
            if !recorded {
                m.evictions_without_record.inc();
            }
            let outcome = match evict(&shared.client, &pod, grace_seconds).await {
                Ok(()) => EvictOutcome::Accepted,
                Err(error) => match (api_code(&error), &error) {
                    (Some(429), kube::Error::Api(status)) => EvictOutcome::Blocked(status.message.clone()),
                    // Two PodDisruptionBudgets select the pod: the API server refuses with a 500.
                    (Some(500), kube::Error::Api(status)) if status.message.contains("PodDisruptionBudget") => {
                        EvictOutcome::Blocked(status.message.clone())
                    }
                    (Some(404), _) => EvictOutcome::Gone,
                    _ => EvictOutcome::Failed(error.to_string()),
                },
            };
            let (result, write) = match &outcome {
                EvictOutcome::Accepted => (EvictionResult::Accepted, WriteResult::Ok),
                EvictOutcome::Blocked(_) => (EvictionResult::Blocked, WriteResult::Blocked),
                EvictOutcome::Gone => (EvictionResult::Gone, WriteResult::Error),
                EvictOutcome::Failed(_) => (EvictionResult::Error, WriteResult::Error),
            };
            m.eviction(result);
            m.write(WriteKind::Evict, write);
            match &outcome {
                EvictOutcome::Accepted => tracing::info!(%pod, grace_seconds, "eviction requested and accepted"),
                EvictOutcome::Blocked(message) => tracing::warn!(%pod, %message, "eviction blocked (HTTP 429)"),
                EvictOutcome::Gone => tracing::info!(%pod, "pod already gone"),
                EvictOutcome::Failed(message) => tracing::warn!(%pod, %message, "eviction request failed"),
            }
            Some(Feedback::Evicted { uid: pod.uid, outcome })
        }
        Action::Delete { pod, grace_seconds } => {
            let api: Api<Pod> = Api::namespaced(shared.client.clone(), &pod.namespace);
            let params = DeleteParams {
                grace_period_seconds: grace_seconds.and_then(|g| u32::try_from(g.max(0)).ok()),
                // Only the pod the agent measured.
                preconditions: Some(kube::api::Preconditions {
                    uid: Some(pod.uid.to_string()),
                    resource_version: None,
                }),
                ..DeleteParams::default()
            };
            let outcome = match api.delete(&pod.name, &params).await {
                Ok(_) => EvictOutcome::Accepted,
                // Gone, or another pod took the name (the UID precondition).
                Err(error) if matches!(api_code(&error), Some(404 | 409)) => EvictOutcome::Gone,
                Err(error) => EvictOutcome::Failed(error.to_string()),
            };
            m.write(
                WriteKind::Delete,
                if outcome == EvictOutcome::Accepted { WriteResult::Ok } else { WriteResult::Error },
            );
            match &outcome {
                EvictOutcome::Accepted => {
                    tracing::warn!(%pod, grace_seconds, "evictions refused too long: pod deleted")
                }
                other => tracing::warn!(%pod, ?other, "delete after refused evictions did not go through"),
            }
            Some(Feedback::Evicted { uid: pod.uid, outcome })
        }
    }
}

/// The eviction body for `pod` ([`gpubudget_common::eviction::eviction_body`]: the grace period, and the
/// pod's UID as a precondition).
pub fn eviction_body(pod: &PodRef, grace_seconds: Option<i64>) -> Eviction {
    gpubudget_common::eviction::eviction_body(&pod.namespace, &pod.name, &pod.uid, grace_seconds)
}

async fn evict(client: &Client, pod: &PodRef, grace_seconds: Option<i64>) -> Result<(), kube::Error> {
    let api: Api<Pod> = Api::namespaced(client.clone(), &pod.namespace);
    let body = eviction_body(pod, grace_seconds);
    api.create_subresource::<_, serde_json::Value>("eviction", &pod.name, &PostParams::default(), &body)
        .await
        .map(|_| ())
}

async fn apply(shared: &Shared, pod: &PodRef, body: &serde_json::Value, kind: WriteKind) -> bool {
    let api: Api<Pod> = Api::namespaced(shared.client.clone(), &pod.namespace);
    // Forced: these annotations are the agent's by contract, whoever touched them last.
    let params = PatchParams::apply(&shared.field_manager).force();
    match api.patch(&pod.name, &params, &Patch::Apply(body)).await {
        Ok(_) => {
            shared.counters.write(kind, WriteResult::Ok);
            true
        }
        Err(error) => {
            if let Some(denial) = Denial::of(&error) {
                shared.counters.write(kind, WriteResult::Denied);
                let what = format!("the record of pod {pod}");
                super::denied::tell(&shared.recorder, &shared.denials, &shared.node, &denial, &what).await;
            } else {
                shared.counters.write(kind, WriteResult::Error);
                tracing::warn!(%pod, %error, "cannot write the pod's record");
            }
            false
        }
    }
}
