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
//! - Ephemeral containers (`kubectl debug`) arrive through `UPDATE pods/ephemeralcontainers`: each new GPU
//!   ephemeral container is capped there as at creation ([`caps::admit_ephemeral`]); the record is not
//!   touched (the API server keeps only the ephemeral containers of such an update).
//! - A tenant cannot stall it (#32 item 2). The body is read only once a slot is free, up to
//!   [`MAX_BODY`] and within [`BODY_WAIT`]; the CPU work (parsing the review, deciding, encoding the patch) runs on tokio's blocking
//!   pool, at most [`SLOTS`] at a time, never on the async workers that serve the eviction check, the Lease
//!   and the controllers. A request that finds no free slot within [`SLOT_WAIT`] is answered 503 at once:
//!   the chart's `failurePolicy: Ignore` admits the pod unchanged, and the pod is counted uncapped
//!   (`status.podsUncapped`) and still evicted over its budget (metric result `saturated`). The caps module
//!   reads each variable in one pass and never past 128 KiB.
//!
//! The decision ([`decide`]) is a pure function of the request, the budgets and the namespace's labels.

use std::collections::BTreeMap;
use std::sync::{Arc, PoisonError};
use std::time::Duration;

use axum::Json;
use axum::extract::{DefaultBodyLimit, Request, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use gpubudget_common::Budget;
use gpubudget_common::caps::{self, Record};
use k8s_openapi::api::core::v1::{ObjectReference, Pod};
use kube::core::DynamicObject;
use kube::core::admission::{AdmissionRequest, AdmissionResponse, AdmissionReview, Operation};
use kube::runtime::events::{Event, EventType};

pub use crate::caps_scope::NAMESPACE_LABEL;
use crate::controller::Context;
use crate::metrics::CapsResult;

/// The path the chart's `MutatingWebhookConfiguration` calls.
pub const PATH: &str = "/mutate-pod-caps";
/// The largest request body read: the API server accepts objects up to 3 MB, and an
/// `pods/ephemeralcontainers` review carries the pod twice (`object`, `oldObject`). A larger body is
/// answered 413 (the chart's `failurePolicy: Ignore` then admits the pod unchanged, counted uncapped).
pub const MAX_BODY: usize = 8 << 20;
/// Admissions decided at once, on tokio's blocking pool. An ordinary pod takes well under a millisecond,
/// a 1.5 MB one a few milliseconds (`cargo bench -p gpubudget-operator --bench caps`).
pub const SLOTS: usize = 2;
/// How long a request waits for a slot before it is answered 503 (the chart's `timeoutSeconds` is 2).
pub const SLOT_WAIT: Duration = Duration::from_millis(500);
/// How long the body may take to arrive once a slot is held (the API server sends it at once; a client
/// trickling it must not hold a slot): then 408.
pub const BODY_WAIT: Duration = Duration::from_secs(1);
/// What an admission did, for the metric's `result` label.
#[derive(Debug, Clone, PartialEq)]
pub enum Verdict {
    /// Not a pod creation nor ephemeral containers added (or not a pod), or ephemeral containers without a
    /// GPU: allowed unchanged.
    NotPodCreate,
    /// No budget with caps applies; a `gpubudget.io/caps` annotation the author wrote was removed if any.
    NoCaps,
    /// Caps set (the record is also in the patch, as the annotation).
    Capped(Record),
    /// The request could not be read or the patch not encoded: allowed unchanged.
    Failed(String),
    /// No slot was free within [`SLOT_WAIT`]: answered 503, the pod admitted unchanged by `failurePolicy:
    /// Ignore`.
    Saturated,
}

impl Verdict {
    /// The metric label: `skipped`, `uncapped`, `capped`, `failed` or `saturated`.
    pub fn label(&self) -> CapsResult {
        match self {
            Verdict::NotPodCreate => CapsResult::Skipped,
            Verdict::NoCaps => CapsResult::Uncapped,
            Verdict::Capped(_) => CapsResult::Capped,
            Verdict::Failed(_) => CapsResult::Failed,
            Verdict::Saturated => CapsResult::Saturated,
        }
    }
}

fn read_pod(object: Option<&DynamicObject>, which: &str) -> Result<Pod, String> {
    match object.map(|o| serde_json::to_value(o).and_then(serde_json::from_value)) {
        Some(Ok(pod)) => Ok(pod),
        Some(Err(error)) => Err(format!("the {which} cannot be read: {error}")),
        None => Err(format!("the request carries no {which}")),
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
    let ephemeral = match (&request.operation, request.sub_resource.as_deref()) {
        (Operation::Create, None) if is_pod => false,
        (Operation::Update, Some("ephemeralcontainers")) if is_pod => true,
        _ => return (response, Verdict::NotPodCreate),
    };
    let pod = match read_pod(request.object.as_ref(), "pod") {
        Ok(pod) => pod,
        Err(error) => return (response, Verdict::Failed(error)),
    };
    let namespace = request.namespace.clone().or_else(|| pod.metadata.namespace.clone()).unwrap_or_default();
    let labels = pod.metadata.labels.clone().unwrap_or_default();
    // A budget with `share` caps a pod at its declared share where that is absolute (MiB: KAI gpu-memory, HAMi
    // gpumem); a fraction needs the GPU the pod gets, known on the node only, so it is capped at the limit.
    let declaration = gpubudget_common::share::declared(&pod, None, gpubudget_common::share::Sources::ALL);
    let rules = gpubudget_common::budget::with_declared(budgets, &declaration, &[]);
    let resolution = gpubudget_common::resolve(
        rules.iter().map(|r| r.as_ref()),
        &gpubudget_common::PodLabels::new(&namespace, namespace_labels, &labels),
    );
    let admission = if ephemeral {
        let old = match read_pod(request.old_object.as_ref(), "old pod") {
            Ok(old) => old,
            Err(error) => return (response, Verdict::Failed(error)),
        };
        caps::admit_ephemeral(&pod, &old, resolution.as_ref().map(|r| r.applied()))
    } else {
        caps::admit(&pod, resolution.as_ref().map(|r| r.applied()))
    };
    let verdict = match admission.record {
        Some(record) if ephemeral && record.containers.is_empty() => Verdict::NotPodCreate,
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

/// The webhook's state: the controller's context (its budget cache) and the decision slots.
struct Admitter {
    ctx: Arc<Context>,
    slots: Arc<tokio::sync::Semaphore>,
    wait: Duration,
}

/// How long a request waits for the budget caches to have listed before it is answered 503.
pub const SYNC_WAIT: Duration = Duration::from_secs(1);

/// Whether the caches the decision reads (namespaced and cluster budgets, namespaces' labels) have listed,
/// waiting [`SYNC_WAIT`] at most: the same event that makes the replica ready (#33).
async fn caches_synced(ctx: &Context) -> bool {
    let mut synced = ctx.synced_watch();
    matches!(tokio::time::timeout(SYNC_WAIT, synced.wait_for(|s| *s)).await, Ok(Ok(_)))
}

/// The webhook's route, sharing the controller's context (its budget cache): [`SLOTS`] decisions at once,
/// [`SLOT_WAIT`] to get one.
pub fn router(ctx: Arc<Context>) -> axum::Router {
    router_with(ctx, SLOTS, SLOT_WAIT)
}

/// [`router`] with `slots` decisions at once and `wait` to get one (tests).
pub fn router_with(ctx: Arc<Context>, slots: usize, wait: Duration) -> axum::Router {
    let state = Arc::new(Admitter { ctx, slots: Arc::new(tokio::sync::Semaphore::new(slots)), wait });
    axum::Router::new()
        .route(PATH, axum::routing::post(mutate))
        .layer(DefaultBodyLimit::max(MAX_BODY))
        .with_state(state)
}

/// `POST /mutate-pod-caps`: waits for the caches, then for a slot, reads the body, decides on the blocking
/// pool. Never decided from caches that have not listed (an empty cache would admit every pod uncapped as if
/// no budget asked for caps): until they have, `503 Service Unavailable`, which the API server treats as it
/// treats an unreachable webhook (the chart's `failurePolicy`), as the replica's readiness already keeps the
/// Service from sending it requests (#33).
async fn mutate(State(state): State<Arc<Admitter>>, request: Request) -> Response {
    let ctx = state.ctx.clone();
    if !caches_synced(&ctx).await {
        ctx.metrics().caps_admitted(CapsResult::Failed);
        tracing::warn!("caps webhook: the budget caches have not listed yet; answering 503");
        return (StatusCode::SERVICE_UNAVAILABLE, "the gpubudget operator's budget caches have not listed yet")
            .into_response();
    }
    let slot = match tokio::time::timeout(state.wait, state.slots.clone().acquire_owned()).await {
        Ok(Ok(slot)) => slot,
        _ => {
            ctx.metrics().caps_admitted(Verdict::Saturated.label());
            tracing::warn!(
                "caps webhook: no decision slot free; answering 503 (failurePolicy Ignore admits the pod uncapped)"
            );
            return (StatusCode::SERVICE_UNAVAILABLE, "the caps webhook is saturated: try again").into_response();
        }
    };
    // A slot is held while the body arrives: a client trickling it would hold the slot, so it gets BODY_WAIT.
    let body = match tokio::time::timeout(BODY_WAIT, axum::body::to_bytes(request.into_body(), MAX_BODY)).await {
        Ok(Ok(body)) => body,
        Ok(Err(error)) => {
            ctx.metrics().caps_admitted(CapsResult::Failed);
            tracing::warn!(%error, "caps webhook: the request body cannot be read (over {MAX_BODY} bytes?)");
            return (StatusCode::PAYLOAD_TOO_LARGE, format!("the request body cannot be read: {error}"))
                .into_response();
        }
        Err(_) => {
            ctx.metrics().caps_admitted(CapsResult::Failed);
            tracing::warn!("caps webhook: the request body did not arrive within {BODY_WAIT:?}");
            return (StatusCode::REQUEST_TIMEOUT, "the request body did not arrive in time").into_response();
        }
    };
    let decided = {
        let ctx = ctx.clone();
        tokio::task::spawn_blocking(move || {
            let answer = answer(&ctx, &body);
            drop(slot);
            answer
        })
        .await
    };
    match decided {
        Ok((review, publish_on)) => {
            if let Some((namespace, record)) = publish_on {
                publish(ctx, &namespace, record);
            }
            Json(review).into_response()
        }
        Err(error) => {
            ctx.metrics().caps_admitted(CapsResult::Failed);
            tracing::warn!(%error, "caps webhook: the decision failed");
            (StatusCode::INTERNAL_SERVER_ERROR, "the caps decision failed").into_response()
        }
    }
}

/// The answer to one request body, and the record to publish as an event (not for dry runs). CPU work
/// only: runs on the blocking pool.
pub fn answer(ctx: &Context, body: &[u8]) -> (AdmissionReview<DynamicObject>, Option<(String, Record)>) {
    let review: AdmissionReview<DynamicObject> = match serde_json::from_slice(body) {
        Ok(review) => review,
        Err(error) => {
            tracing::warn!(%error, "caps webhook: unreadable AdmissionReview; answering nothing to patch");
            ctx.metrics().caps_admitted(CapsResult::Failed);
            return (AdmissionResponse::invalid(error.to_string()).into_review(), None);
        }
    };
    let request: AdmissionRequest<DynamicObject> = match review.try_into() {
        Ok(request) => request,
        Err(error) => {
            tracing::warn!(%error, "caps webhook: malformed AdmissionReview; answering nothing to patch");
            ctx.metrics().caps_admitted(CapsResult::Failed);
            // Without a request UID the API server cannot match the answer; `failurePolicy: Ignore` admits.
            return (AdmissionResponse::invalid(error.to_string()).into_review(), None);
        }
    };
    let namespace = request.namespace.clone().unwrap_or_default();
    let (budgets, namespace_labels) = ctx.index.read().unwrap_or_else(PoisonError::into_inner).budgets_in(&namespace);
    let (response, verdict) = decide(&request, &budgets, &namespace_labels);
    ctx.metrics().caps_admitted(verdict.label());
    let pod = pod_name(&request);
    let mut publish_on = None;
    match verdict {
        Verdict::Capped(record) => {
            tracing::debug!(%namespace, %pod, caps = %record.summary(), "caps set at admission");
            if !request.dry_run {
                publish_on = Some((namespace, record));
            }
        }
        Verdict::Failed(error) => tracing::warn!(%namespace, %pod, %error, "caps webhook: pod admitted unchanged"),
        Verdict::NoCaps | Verdict::NotPodCreate | Verdict::Saturated => {}
    }
    (response.into_review(), publish_on)
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
