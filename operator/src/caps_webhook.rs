//! Caps set at admission (`POST /mutate-pod-caps`): when a pod is created in a namespace whose budgets
//! enable `admissionCaps`, its GPU containers get the driver's memory caps in their environment
//! (`gpubudget_common::caps`), and the pod gets the `gpubudget.io/caps` annotation saying what was done.
//!
//! - Scope: the chart's `MutatingWebhookConfiguration` sends only pods of namespaces labelled
//!   [`NAMESPACE_LABEL`], which the leader keeps on exactly the namespaces holding a budget with caps
//!   enabled, or selected by a `ClusterGpuMemoryBudget` with caps enabled ([`crate::caps_scope`]); other
//!   pods never reach the operator. A pod is resolved among its namespace's budgets and the cluster ones,
//!   with its namespace's labels.
//! - Never in the way: every answer allows the pod. A request it cannot read, or a patch it cannot
//!   encode, is allowed unchanged and counted (`gpubudget_operator_caps_admissions_total{result="failed"}`),
//!   and the chart's `failurePolicy: Ignore` does the same when the operator cannot be reached. A pod
//!   created uncapped is reported (`status.podsUncapped`) and still evicted over its budget.
//! - The record cannot be forged: at CREATE the webhook replaces (or removes) whatever `gpubudget.io/caps`
//!   the author wrote, the chart's ValidatingAdmissionPolicy refuses later changes to it, and the status
//!   counts come from the containers' environment, never from the annotation.
//!
//! The decision ([`decide`]) is a pure function of the request, the budgets and the namespace's labels.

use std::collections::BTreeMap;
use std::sync::{Arc, PoisonError};

use axum::Json;
use axum::extract::State;
use gpubudget_common::Budget;
use gpubudget_common::caps::{self, Record};
use k8s_openapi::api::core::v1::{ObjectReference, Pod};
use kube::core::DynamicObject;
use kube::core::admission::{AdmissionRequest, AdmissionResponse, AdmissionReview, Operation};
use kube::runtime::events::{Event, EventType};

pub use crate::caps_scope::NAMESPACE_LABEL;
use crate::controller::Context;

/// The path the chart's `MutatingWebhookConfiguration` calls.
pub const PATH: &str = "/mutate-pod-caps";
/// What an admission did, for the metric's `result` label.
#[derive(Debug, Clone, PartialEq)]
pub enum Verdict {
    /// Not a pod creation (or not a pod): allowed unchanged.
    NotPodCreate,
    /// No budget with caps applies; a `gpubudget.io/caps` annotation the author wrote was removed if any.
    NoCaps,
    /// Caps set (the record is also in the patch, as the annotation).
    Capped(Record),
    /// The request could not be read or the patch not encoded: allowed unchanged.
    Failed(String),
}

impl Verdict {
    /// The metric label: `skipped`, `uncapped`, `capped` or `failed`.
    pub fn label(&self) -> &'static str {
        match self {
            Verdict::NotPodCreate => "skipped",
            Verdict::NoCaps => "uncapped",
            Verdict::Capped(_) => "capped",
            Verdict::Failed(_) => "failed",
        }
    }
}

/// The answer to a request, given the valid budgets a pod of its namespace may get (the namespace's and
/// the cluster ones) and the namespace's labels (which the cluster budgets select by). Always allows.
pub fn decide(
    request: &AdmissionRequest<DynamicObject>,
    budgets: &[Budget],
    namespace_labels: &BTreeMap<String, String>,
) -> (AdmissionResponse, Verdict) {
    let response = AdmissionResponse::from(request);
    let is_pod = request.resource.group.is_empty() && request.resource.resource == "pods";
    if request.operation != Operation::Create || !is_pod || request.sub_resource.is_some() {
        return (response, Verdict::NotPodCreate);
    }
    let pod: Pod = match request.object.as_ref().map(|o| serde_json::to_value(o).and_then(serde_json::from_value)) {
        Some(Ok(pod)) => pod,
        Some(Err(error)) => return (response, Verdict::Failed(format!("the pod cannot be read: {error}"))),
        None => return (response, Verdict::Failed("the request carries no pod".into())),
    };
    let namespace = request.namespace.clone().or_else(|| pod.metadata.namespace.clone()).unwrap_or_default();
    let labels = pod.metadata.labels.clone().unwrap_or_default();
    let resolution =
        gpubudget_common::resolve(budgets, &gpubudget_common::PodLabels::new(&namespace, namespace_labels, &labels));
    let admission = caps::admit(&pod, resolution.as_ref().map(|r| r.applied()));
    let verdict = match admission.record {
        Some(record) => Verdict::Capped(record),
        None => Verdict::NoCaps,
    };
    if admission.patch.is_empty() {
        return (response, verdict);
    }
    let patch = serde_json::from_value::<json_patch::Patch>(serde_json::Value::Array(admission.patch))
        .map_err(|e| e.to_string())
        .and_then(|patch| response.clone().with_patch(patch).map_err(|e| e.to_string()));
    match patch {
        Ok(patched) => (patched, verdict),
        Err(error) => (response, Verdict::Failed(format!("the patch cannot be encoded: {error}"))),
    }
}

/// How the pod is named in messages: its name, or `generateName*` before the API server names it.
fn pod_name(request: &AdmissionRequest<DynamicObject>) -> String {
    if !request.name.is_empty() {
        return request.name.clone();
    }
    let generated = request.object.as_ref().and_then(|o| o.metadata.generate_name.clone()).unwrap_or_default();
    format!("{generated}*")
}

/// The webhook's route, sharing the controller's context (its budget cache).
pub fn router(ctx: Arc<Context>) -> axum::Router {
    axum::Router::new().route(PATH, axum::routing::post(mutate)).with_state(ctx)
}

/// How long a request waits for the budget caches to have listed before it is answered 503.
pub const SYNC_WAIT: std::time::Duration = std::time::Duration::from_secs(1);

/// Whether the caches the decision reads (namespaced and cluster budgets, namespaces' labels) have listed,
/// waiting [`SYNC_WAIT`] at most: the same event that makes the replica ready (#33).
async fn caches_synced(ctx: &Context) -> bool {
    let mut synced = ctx.synced_watch();
    matches!(tokio::time::timeout(SYNC_WAIT, synced.wait_for(|s| *s)).await, Ok(Ok(_)))
}

/// `POST /mutate-pod-caps`. Never decided from caches that have not listed (an empty cache would admit every
/// pod uncapped as if no budget asked for caps): until they have, `503 Service Unavailable`, which the API
/// server treats as it treats an unreachable webhook (the chart's `failurePolicy`), as the replica's
/// readiness already keeps the Service from sending it requests.
pub async fn mutate(
    State(ctx): State<Arc<Context>>,
    Json(review): Json<AdmissionReview<DynamicObject>>,
) -> Result<Json<AdmissionReview<DynamicObject>>, (axum::http::StatusCode, &'static str)> {
    if !caches_synced(&ctx).await {
        ctx.metrics().caps_admitted("failed");
        tracing::warn!("caps webhook: the budget caches have not listed yet; answering 503");
        return Err((
            axum::http::StatusCode::SERVICE_UNAVAILABLE,
            "the gpubudget operator's budget caches have not listed yet",
        ));
    }
    let request: AdmissionRequest<DynamicObject> = match review.try_into() {
        Ok(request) => request,
        Err(error) => {
            tracing::warn!(%error, "caps webhook: malformed AdmissionReview; answering nothing to patch");
            ctx.metrics().caps_admitted("failed");
            // Without a request UID the API server cannot match the answer; `failurePolicy: Ignore` admits.
            return Ok(Json(AdmissionResponse::invalid(error.to_string()).into_review()));
        }
    };
    let namespace = request.namespace.clone().unwrap_or_default();
    let (budgets, namespace_labels) = ctx.index.read().unwrap_or_else(PoisonError::into_inner).budgets_in(&namespace);
    let (response, verdict) = decide(&request, &budgets, &namespace_labels);
    ctx.metrics().caps_admitted(verdict.label());
    let pod = pod_name(&request);
    match &verdict {
        Verdict::Capped(record) => {
            tracing::debug!(%namespace, %pod, caps = %record.summary(), "caps set at admission");
            if !request.dry_run {
                publish(ctx.clone(), &namespace, record.clone());
            }
        }
        Verdict::Failed(error) => tracing::warn!(%namespace, %pod, %error, "caps webhook: pod admitted unchanged"),
        Verdict::NoCaps | Verdict::NotPodCreate => {}
    }
    Ok(Json(response.into_review()))
}

/// Publishes a `CapsSet` event on the budget, in the background (admission does not wait for it). On the
/// budget, not the pod: at admission a pod has no UID yet, often no name. The note names no pod, so the
/// recorder folds the creations of one workload into one event series.
fn publish(ctx: Arc<Context>, namespace: &str, record: Record) {
    let reference = match record.budget.strip_prefix(gpubudget_common::pod_record::CLUSTER_BUDGET_PREFIX) {
        Some(cluster) => ObjectReference {
            api_version: Some("gpubudget.io/v1alpha1".into()),
            kind: Some("ClusterGpuMemoryBudget".into()),
            name: Some(cluster.to_owned()),
            ..ObjectReference::default()
        },
        None => ObjectReference {
            api_version: Some("gpubudget.io/v1alpha1".into()),
            kind: Some("GpuMemoryBudget".into()),
            name: Some(record.budget.clone()),
            namespace: Some(namespace.to_owned()),
            ..ObjectReference::default()
        },
    };
    let event = Event {
        type_: EventType::Normal,
        reason: "CapsSet".into(),
        note: Some(format!("caps set at admission on a new pod: {}", record.summary())),
        action: "Admit".into(),
        secondary: None,
    };
    tokio::spawn(async move {
        match ctx.recorder().publish(&event, &reference).await {
            Ok(()) => {
                ctx.metrics().events.inc();
            }
            Err(error) => tracing::warn!(budget = %record.budget, %error, "cannot publish the CapsSet event"),
        }
    });
}

#[cfg(test)]
mod tests;
