//! The node's `GpuNodeUsage` (#34): what this node's pods hold, in one object named after the node, written
//! by server-side apply under the node's field manager, owned by the Node (deleted with it). Written at most
//! once per `--usage-write-interval` and only when a pod came or went or moved by the change percentage
//! ([`Published::due`]): a constant API cost per node, whatever the pod count or churn. Pod records no
//! longer change for usage alone.

use std::sync::Arc;

use gpubudget_common::node_usage::{GpuNodeUsage, Published, spec_of};
use k8s_openapi::api::core::v1::Node;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference;
use kube::api::{Patch, PatchParams};
use kube::runtime::events::{Recorder, Reporter};
use kube::{Api, Client, Resource as _};
use serde_json::json;
use tokio::sync::oneshot;

use super::denied::{Denial, Notices};
use super::{Counters, WriteKind, WriteResult};
use crate::attribute::{PodTable, PodUsage};
use crate::decide::Now;

/// The first wait after a failed write; it doubles up to [`RETRY_MAX_MS`].
pub const RETRY_MIN_MS: u64 = 10_000;
/// The longest wait after failed writes.
pub const RETRY_MAX_MS: u64 = 60_000;

/// A write under way: what it carries, and when it was decided.
struct InFlight {
    pods: Vec<(Arc<str>, u64)>,
    at_ms: u64,
    done: oneshot::Receiver<(bool, Option<OwnerReference>)>,
}

/// Writes the node's usage object when due.
pub struct UsageWriter {
    client: Client,
    node: String,
    field_manager: String,
    counters: Counters,
    interval_ms: u64,
    percent: u64,
    published: Published,
    in_flight: Option<InFlight>,
    retry_at_ms: u64,
    failures: u32,
    /// The Node's owner reference, once read.
    owner: Option<OwnerReference>,
    /// A write refused for good (an admission policy, RBAC) is told on the Node ([`super::denied`]).
    recorder: Recorder,
    denials: Arc<Notices>,
}

impl std::fmt::Debug for UsageWriter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("UsageWriter")
            .field("node", &self.node)
            .field("failures", &self.failures)
            .finish_non_exhaustive()
    }
}

impl UsageWriter {
    /// A writer for `node`'s object: at most once per `interval_ms`, for moves of `percent` or more.
    pub fn new(client: Client, node: &str, counters: Counters, interval_ms: u64, percent: u64) -> Self {
        let reporter =
            Reporter { controller: super::kube::REPORTING_CONTROLLER.into(), instance: Some(node.to_owned()) };
        Self {
            recorder: Recorder::new(client.clone(), reporter),
            denials: Arc::default(),
            client,
            node: node.to_owned(),
            field_manager: gpubudget_common::pod_record::agent_field_manager(node),
            counters,
            interval_ms,
            percent,
            published: Published::default(),
            in_flight: None,
            retry_at_ms: 0,
            failures: 0,
            owner: None,
        }
    }

    /// After a tick: takes in a finished write, and starts the next if one is due. Lists the pods that hold
    /// GPU memory or have a budget (`usage` has the table's indexes).
    pub fn tick(&mut self, now: Now, table: &PodTable, usage: &[PodUsage]) {
        if let Some(flight) = &mut self.in_flight {
            match flight.done.try_recv() {
                Err(oneshot::error::TryRecvError::Empty) => return,
                Ok((ok, owner)) => {
                    let flight = self.in_flight.take().expect("in flight");
                    if owner.is_some() {
                        self.owner = owner;
                    }
                    if ok {
                        self.published.written(flight.at_ms, flight.pods.iter().map(|(u, b)| (u, *b)));
                        self.failures = 0;
                    } else {
                        self.failures = self.failures.saturating_add(1);
                        let wait = RETRY_MIN_MS.saturating_mul(1 << self.failures.min(6).saturating_sub(1));
                        self.retry_at_ms = now.mono_ms.saturating_add(wait.min(RETRY_MAX_MS));
                    }
                }
                Err(oneshot::error::TryRecvError::Closed) => self.in_flight = None,
            }
        }
        if now.mono_ms < self.retry_at_ms {
            return;
        }
        let listed = || {
            table.pods.iter().zip(usage).enumerate().filter(|(i, (_, u))| u.total > 0 || table.budget_of[*i].is_some())
        };
        let measured = listed().map(|(_, (view, u))| (&view.uid, u.total));
        if !self.published.due(now.mono_ms, self.interval_ms, self.percent, measured) {
            return;
        }
        let spec = spec_of(
            &self.node,
            now.wall.to_string(),
            listed().map(|(_, (view, u))| (&*view.namespace, &*view.name, &view.uid, u.total)),
        );
        let pods = listed().map(|(_, (view, u))| (view.uid.clone(), u.total)).collect();
        let (tx, rx) = oneshot::channel();
        self.in_flight = Some(InFlight { pods, at_ms: now.mono_ms, done: rx });
        let (client, node, manager, counters, owner) = (
            self.client.clone(),
            self.node.clone(),
            self.field_manager.clone(),
            self.counters.clone(),
            self.owner.clone(),
        );
        let (recorder, denials) = (self.recorder.clone(), self.denials.clone());
        tokio::spawn(async move {
            let owner = match owner {
                Some(owner) => Some(owner),
                None => node_owner(&client, &node).await,
            };
            let mut metadata = json!({"name": &node});
            if let Some(owner) = &owner {
                metadata["ownerReferences"] = json!([owner]);
            }
            let body = json!({
                "apiVersion": GpuNodeUsage::api_version(&()),
                "kind": GpuNodeUsage::kind(&()),
                "metadata": metadata,
                "spec": spec,
            });
            let api: Api<GpuNodeUsage> = Api::all(client);
            let ok = match api.patch(&node, &PatchParams::apply(&manager).force(), &Patch::Apply(&body)).await {
                Ok(_) => {
                    counters.write(WriteKind::Usage, WriteResult::Ok);
                    true
                }
                Err(error) => {
                    if let Some(denial) = Denial::of(&error) {
                        counters.write(WriteKind::Usage, WriteResult::Denied);
                        let what = format!("the GpuNodeUsage of node {node}");
                        super::denied::tell(&recorder, &denials, &node, &denial, &what).await;
                    } else {
                        counters.write(WriteKind::Usage, WriteResult::Error);
                        tracing::warn!(%node, %error, "cannot write the node's GPU usage");
                    }
                    false
                }
            };
            let _ = tx.send((ok, owner));
        });
    }
}

/// The owner reference to `node` (the object goes with the Node); `None` when it cannot be read (the object
/// is written without one, and the next write tries again).
async fn node_owner(client: &Client, node: &str) -> Option<OwnerReference> {
    match Api::<Node>::all(client.clone()).get(node).await {
        Ok(found) => found.controller_owner_ref(&()).map(|mut owner| {
            // Not a controller: the Node does not manage it, it only takes it along when deleted.
            owner.controller = None;
            owner.block_owner_deletion = None;
            owner
        }),
        Err(error) => {
            tracing::warn!(%node, %error, "cannot read the Node (its usage object is written without an owner)");
            None
        }
    }
}
