//! The Node's labels the table reads: how the device plugin shares the GPUs and whether the node enforces (#54),
//! read every [`EVERY`] with a `get` of this one Node (no watch on all Nodes).

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use k8s_openapi::api::core::v1::Node;
use kube::Api;
use tokio_util::sync::CancellationToken;

use super::lock;

/// How often the Node's GPU sharing labels are read again: GPU feature discovery changes them when an
/// administrator changes the device plugin's sharing (rarely); a `get` of one Node needs no watch on all Nodes.
pub const EVERY: Duration = Duration::from_secs(60);

/// How long one read of the Node may take before the labels last read stay.
const READ_TIMEOUT: Duration = Duration::from_secs(10);

/// Reads the labels of `node` into `sharing` at once and every [`EVERY`] until `shutdown`, moving `changes` when
/// they change, and setting `asked` after each read (answered or not).
pub(super) fn spawn(
    nodes: Api<Node>,
    node: String,
    sharing: Arc<Mutex<Option<BTreeMap<String, String>>>>,
    changes: Arc<AtomicU64>,
    asked: Arc<AtomicBool>,
    shutdown: CancellationToken,
) {
    tokio::spawn(async move {
        let mut every = tokio::time::interval(EVERY);
        every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                () = shutdown.cancelled() => break,
                _ = every.tick() => {}
            }
            if let Some(labels) = labels(&nodes, &node).await {
                let mut known = lock(&sharing);
                if known.as_ref() != Some(&labels) {
                    tracing::info!(
                        %node,
                        ?labels,
                        "the Node's GPU sharing and enforcement labels: the pods' shares and evictions follow them"
                    );
                    *known = Some(labels);
                    changes.fetch_add(1, Ordering::AcqRel);
                }
            }
            // After the labels are in: a table built once this is set reads them.
            asked.store(true, Ordering::Release);
        }
    });
}

/// The labels of `node` that say how the device plugin shares its GPUs (GPU feature discovery's strategy and
/// replicas; a share budget reads a pod's MPS replicas from them) and whether it enforces or observes (#54:
/// `gpubudget.io/enforcement`, warned about when it is neither `Observe` nor `Enforce`), or `None`, with a
/// warning, when the Node cannot be read in 10 s (the last labels read stay).
async fn labels(nodes: &Api<Node>, node: &str) -> Option<BTreeMap<String, String>> {
    use gpubudget_common::enforcement;
    use gpubudget_common::share::{REPLICAS, SHARING_STRATEGY};
    match tokio::time::timeout(READ_TIMEOUT, nodes.get_metadata(node)).await {
        Ok(Ok(n)) => {
            let mut labels = n.metadata.labels.unwrap_or_default();
            labels.retain(|k, _| k == SHARING_STRATEGY || k == REPLICAS || k == enforcement::NODE_LABEL);
            if let Err(why) = enforcement::parse_label(labels.get(enforcement::NODE_LABEL).map(String::as_str)) {
                tracing::warn!(%node, %why, "the agent's --enforcement applies on this node");
            }
            Some(labels)
        }
        Ok(Err(error)) => {
            tracing::warn!(%node, %error, "cannot read the Node's labels: MPS replicas' shares as last read");
            None
        }
        Err(_) => {
            tracing::warn!(%node, "the Node's labels not read in 10s: MPS replicas' shares as last read");
            None
        }
    }
}
