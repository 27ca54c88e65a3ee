//! `top`'s one-shot reads: the pods and budgets listed once, if the API server answers quickly (top is
//! interactive, not a hot path: no watch, no cache).

use std::time::Duration;

use anyhow::Context as _;
use gpubudget_common::GpuMemoryBudget;
use k8s_openapi::api::core::v1::Pod;
use kube::{Api, Client, ResourceExt as _};

use crate::attribute::pods::{PodTable, PodView};

/// How long the client's configuration and each list may take.
const TIMEOUT: Duration = Duration::from_secs(3);

/// The pod table of `node`'s pods (or of every pod, when none is bound to `node`: the host name is not always the
/// node name) with every namespaced budget.
pub async fn table(node: Option<&str>) -> anyhow::Result<PodTable> {
    let mut pods: Vec<Pod> = pods(node).await?;
    if pods.is_empty() && node.is_some() {
        // The host name is not always the node name: then every pod (top is interactive, not a hot path).
        pods = self::pods(None).await?;
    }
    let budgets: Vec<GpuMemoryBudget> = budgets().await.unwrap_or_default();
    Ok(PodTable::build(pods.iter().filter_map(PodView::from_pod), &budgets, None))
}

/// The pods of `node` (or all pods) from the API, if it answers quickly.
async fn pods(node: Option<&str>) -> anyhow::Result<Vec<Pod>> {
    let client = tokio::time::timeout(TIMEOUT, Client::try_default())
        .await
        .context("timed out configuring the Kubernetes client")??;
    let api: Api<Pod> = Api::all(client);
    let mut params = kube::api::ListParams::default();
    if let Some(node) = node {
        params = params.fields(&format!("spec.nodeName={node}"));
    }
    let list = tokio::time::timeout(TIMEOUT, api.list(&params)).await.context("timed out listing pods")??;
    Ok(list
        .items
        .into_iter()
        .map(|mut p| {
            p.managed_fields_mut().clear();
            p
        })
        .collect())
}

/// Every namespaced budget.
async fn budgets() -> anyhow::Result<Vec<GpuMemoryBudget>> {
    let client = Client::try_default().await?;
    let api: Api<GpuMemoryBudget> = Api::all(client);
    let list = tokio::time::timeout(TIMEOUT, api.list(&Default::default())).await??;
    Ok(list.items)
}
