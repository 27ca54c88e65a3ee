//! Caps set at admission against the in-memory API (gpubudget-testkit): the leader's namespace labels
//! that scope the webhook, the status counts read from the pods' environment, and the webhook served over
//! HTTP from the controller's budget cache (its patch, metric and event).

mod harness;

use std::sync::Arc;
use std::time::Duration;

use gpubudget_common::GpuMemoryBudget;
use gpubudget_common::caps::{ANNOTATION, MEMORY_LIMIT, MPS_LIMIT};
use gpubudget_common::crd::GpuMemoryBudgetStatus;
use gpubudget_daemon::Health;
use gpubudget_operator::caps_webhook::{self, NAMESPACE_LABEL};
use gpubudget_operator::controller::{self, CHECK_BUDGETS, CHECK_PODS, Context, Settings};
use gpubudget_operator::eviction_check::{self, PodLookup};
use gpubudget_operator::metrics::{CapsResult, Metrics};
use gpubudget_testkit::FakeApi;
use serde_json::{Value, json};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use harness::{Operator, WAIT};

fn namespace(fake: &FakeApi, name: &str, labels: Value) {
    fake.put_object(json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name, "labels": labels}}))
        .expect("namespace stored");
}

fn budget(fake: &FakeApi, ns: &str, name: &str, limit: &str, caps: &str) {
    fake.put_object(json!({
        "apiVersion": "gpubudget.io/v1alpha1", "kind": "GpuMemoryBudget",
        "metadata": {"name": name, "namespace": ns, "generation": 1},
        "spec": {"selector": {}, "limit": limit, "admissionCaps": caps},
    }))
    .expect("budget stored");
}

fn gpu_pod(fake: &FakeApi, name: &str, env: Value, annotations: Value) {
    fake.put_object(json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": "team-a", "annotations": annotations},
        "spec": {"containers": [{"name": "main", "image": "x", "env": env,
                                 "resources": {"limits": {"nvidia.com/gpu": "1"}}}]},
        "status": {"phase": "Running"},
    }))
    .expect("pod stored");
}

fn labelled(fake: &FakeApi, ns: &str) -> bool {
    fake.get("namespaces", "", ns).is_some_and(|n| n["metadata"]["labels"][NAMESPACE_LABEL] == "enabled")
}

fn status(fake: &FakeApi, name: &str) -> GpuMemoryBudgetStatus {
    fake.typed::<GpuMemoryBudget>("team-a", name).and_then(|b| b.status).unwrap_or_default()
}

async fn until(fake: &FakeApi, what: &str, mut check: impl FnMut(&FakeApi) -> bool) {
    assert!(fake.wait_until(WAIT, |f| check(f)).await, "timed out waiting for {what}");
}

#[tokio::test(start_paused = true)]
async fn the_leader_labels_exactly_the_namespaces_with_caps_budgets() {
    let fake = FakeApi::new();
    namespace(&fake, "team-a", json!({}));
    namespace(&fake, "team-b", json!({}));
    // Left by an earlier leader for a budget since deleted.
    namespace(&fake, "team-c", json!({NAMESPACE_LABEL: "enabled", "keep": "me"}));
    budget(&fake, "team-a", "llm", "8Gi", "Enabled");
    budget(&fake, "team-b", "plain", "8Gi", "Disabled");

    // A follower labels nothing.
    let op = Operator::start(&fake, false);
    until(&fake, "the caches", |_| *op.ctx.synced_watch().borrow()).await;
    assert!(!fake.wait_until(Duration::from_millis(300), |f| labelled(f, "team-a")).await, "a follower wrote");
    op.leader.send_replace(true);
    until(&fake, "team-a labelled, team-c unlabelled", |f| labelled(f, "team-a") && !labelled(f, "team-c")).await;
    assert!(!labelled(&fake, "team-b"));
    assert_eq!(fake.get("namespaces", "", "team-c").expect("ns")["metadata"]["labels"]["keep"], "me");

    // Caps turned off: the label goes; on in another namespace: it comes.
    fake.modify("gpumemorybudgets", "team-a", "llm", |b| {
        b["spec"]["admissionCaps"] = "Disabled".into();
        b["metadata"]["generation"] = 2.into();
    });
    budget(&fake, "team-b", "capped", "4Gi", "Enabled");
    until(&fake, "labels to follow", |f| !labelled(f, "team-a") && labelled(f, "team-b")).await;
    let writes = op.ctx.metrics().namespace_label_writes.get();
    assert_eq!(writes, 4, "team-a on, team-c off, team-a off, team-b on");
    op.stop().await;
}

#[tokio::test(start_paused = true)]
async fn status_counts_caps_from_the_environment_never_from_the_annotation() {
    let fake = FakeApi::new();
    budget(&fake, "team-a", "llm", "8Gi", "Enabled");
    gpu_pod(&fake, "capped", json!([{"name": MPS_LIMIT, "value": "0=8192M"}]), json!({}));
    gpu_pod(&fake, "smaller", json!([{"name": MPS_LIMIT, "value": "0=2G"}]), json!({}));
    // Created while the webhook was down, with a record its author wrote: still uncapped.
    gpu_pod(
        &fake,
        "forged",
        json!([]),
        json!({ANNOTATION: "{\"budget\":\"llm\",\"limitMib\":8192,\"containers\":[]}"}),
    );
    gpu_pod(&fake, "bare", json!([{"name": MPS_LIMIT, "value": "8G"}]), json!({}));
    let op = Operator::start(&fake, true);
    until(&fake, "the caps counts", |f| status(f, "llm").pods_capped == Some(2)).await;
    let s = status(&fake, "llm");
    assert_eq!((s.matched_pods, s.pods_uncapped, s.pods_capped_above_limit), (4, Some(2), Some(0)));
    // The limit lowered after the pods started: their environment is fixed; they are capped above it now.
    fake.modify("gpumemorybudgets", "team-a", "llm", |b| {
        b["spec"]["limit"] = "4Gi".into();
        b["metadata"]["generation"] = 2.into();
    });
    until(&fake, "the lowered limit", |f| status(f, "llm").pods_capped_above_limit == Some(1)).await;
    assert_eq!(status(&fake, "llm").pods_capped, Some(1), "0=2G is still within 4Gi");
    op.stop().await;
}

async fn post(addr: std::net::SocketAddr, body: &Value) -> Value {
    let out = post_raw(addr, &body.to_string()).await;
    assert!(out.starts_with("HTTP/1.1 200"), "{out}");
    serde_json::from_str(out.split("\r\n\r\n").nth(1).expect("a body")).expect("json")
}

/// The whole HTTP answer to a POST of `body`.
async fn post_raw(addr: std::net::SocketAddr, body: &str) -> String {
    let mut stream = tokio::net::TcpStream::connect(addr).await.expect("connects");
    let request = format!(
        "POST {} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        caps_webhook::PATH,
        body.len()
    );
    // A body the server refuses to read may close the connection before all of it is written.
    let _ = stream.write_all(request.as_bytes()).await;
    let mut out = String::new();
    let _ = stream.read_to_string(&mut out).await;
    out
}

fn create_review(ns: &str) -> Value {
    json!({
        "apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
        "request": {
            "uid": "u-1", "kind": {"group": "", "version": "v1", "kind": "Pod"},
            "resource": {"group": "", "version": "v1", "resource": "pods"},
            "name": "", "namespace": ns, "operation": "CREATE", "userInfo": {"username": "alice"}, "dryRun": false,
            "object": {"apiVersion": "v1", "kind": "Pod", "metadata": {"generateName": "w-", "namespace": ns},
                       "spec": {"nodeSelector": {"nvidia.com/gpu.sharing-strategy": "none"},
                                "containers": [{"name": "main", "resources": {"limits": {"nvidia.com/gpu": "2"}}}]}},
        }
    })
}

/// `app` served on 127.0.0.1 (plain HTTP) until the operator's shutdown: its address and the server's task.
async fn serve(
    op: &Operator,
    app: axum::Router,
) -> (std::net::SocketAddr, tokio::task::JoinHandle<anyhow::Result<()>>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("binds");
    let addr = listener.local_addr().expect("addr");
    (addr, tokio::spawn(eviction_check::serve_on(listener, None, app, op.shutdown.clone())))
}

#[tokio::test]
async fn the_webhook_caps_from_the_controllers_cache_and_reports_it() {
    let fake = FakeApi::new();
    budget(&fake, "team-a", "llm", "8Gi", "Enabled");
    let op = Operator::start(&fake, true);
    until(&fake, "the caches", |_| *op.ctx.synced_watch().borrow()).await;
    let app = eviction_check::router(PodLookup::new(fake.client())).merge(caps_webhook::router(op.ctx.clone()));
    let (addr, server) = serve(&op, app).await;

    let answer = post(addr, &create_review("team-a")).await;
    assert_eq!(
        (answer["response"]["allowed"].as_bool(), answer["response"]["uid"].as_str()),
        (Some(true), Some("u-1"))
    );
    assert_eq!(answer["response"]["patchType"], "JSONPatch");
    // The patch as the API server reads it ([]byte in JSON).
    let bytes: Vec<u8> = serde_json::from_value(answer["response"]["patch"].clone()).expect("patch bytes");
    let patch: Value = serde_json::from_slice(&bytes).expect("a JSON patch");
    assert_eq!(
        patch[0]["value"],
        json!([{"name": MPS_LIMIT, "value": "0=8192M,1=8192M"}, {"name": MEMORY_LIMIT, "value": "8192"}])
    );
    // Another namespace: no budget, nothing to do (the chart never sends it; the webhook copes anyway).
    let other = post(addr, &create_review("team-z")).await;
    assert!(other["response"]["patch"].is_null());
    let count = |result| {
        op.ctx.metrics().caps_admissions.get_or_create(&gpubudget_operator::metrics::CapsResultLabels { result }).get()
    };
    assert_eq!((count(CapsResult::Capped), count(CapsResult::Uncapped)), (1, 1));
    until(&fake, "the CapsSet event", |f| {
        f.list("events.events.k8s.io", Some("team-a")).iter().any(|e| {
            e["reason"] == "CapsSet"
                && e["regarding"]["name"] == "llm"
                && e["note"].as_str().is_some_and(|n| n.contains("limit 8192 MiB"))
        })
    })
    .await;
    op.stop().await;
    server.await.expect("joins").expect("serves cleanly");
}

/// #33: the caps webhook never decides from caches that have not listed. While the API is slow to list, a
/// request waits a bounded time and is answered 503 (the chart's failurePolicy then applies, as for an
/// unreachable replica) and the replica is not ready; once the caches have listed, it caps.
#[tokio::test(start_paused = true)]
async fn the_caps_webhook_answers_only_from_synced_caches() {
    use tower::ServiceExt;
    let fake = FakeApi::new();
    budget(&fake, "team-a", "llm", "8Gi", "Enabled");
    fake.set_latency(Duration::from_secs(120));
    let op = Operator::start(&fake, true);
    let call = || async {
        let request = axum::http::Request::post(caps_webhook::PATH)
            .header("content-type", "application/json")
            .body(axum::body::Body::from(create_review("team-a").to_string()))
            .expect("a request");
        let response = caps_webhook::router(op.ctx.clone()).oneshot(request).await.expect("answered");
        let status = response.status();
        let body = axum::body::to_bytes(response.into_body(), usize::MAX).await.expect("a body");
        (status, String::from_utf8_lossy(&body).into_owned())
    };
    let (status, body) = call().await;
    assert_eq!(status, axum::http::StatusCode::SERVICE_UNAVAILABLE, "{body}");
    assert!(body.contains("caches have not listed"), "{body}");
    assert!(!op.health.is_ready(), "readiness agrees: not ready");
    fake.set_latency(Duration::ZERO);
    assert!(
        fake.wait_until(Duration::from_secs(300), |_| *op.ctx.synced_watch().borrow()).await,
        "the caches list once the API answers"
    );
    let (status, body) = call().await;
    assert_eq!(status, axum::http::StatusCode::OK, "{body}");
    let answer: Value = serde_json::from_str(&body).expect("json");
    assert_eq!(answer["response"]["patchType"], "JSONPatch", "{answer}");
    op.stop().await;
}

/// #32 item 2: a tenant cannot stall the webhook. A 1.5 MB value is decided off the async workers and
/// replaced; a body past the limit is refused unread (413), one that does not arrive in time too (408); with
/// no decision slot free the answer is 503 at once (the chart's failurePolicy Ignore admits the pod, counted uncapped), counted `saturated`.
#[tokio::test]
async fn the_webhook_is_bounded_and_answers_when_saturated() {
    let fake = FakeApi::new();
    budget(&fake, "team-a", "llm", "8Gi", "Enabled");
    let op = Operator::start(&fake, true);
    until(&fake, "the caches", |_| *op.ctx.synced_watch().borrow()).await;
    let (addr, server) = serve(&op, caps_webhook::router(op.ctx.clone())).await;
    let mut review = create_review("team-a");
    let huge: String = (0..200_000).map(|i| format!("{}=1024M,", i % 7)).collect();
    review["request"]["object"]["spec"]["containers"][0]["env"] = json!([{"name": MPS_LIMIT, "value": huge}]);
    let answer = post(addr, &review).await;
    let bytes: Vec<u8> = serde_json::from_value(answer["response"]["patch"].clone()).expect("patch bytes");
    let patch: Value = serde_json::from_slice(&bytes).expect("a JSON patch");
    assert_eq!(patch[0]["value"], json!({"name": MPS_LIMIT, "value": "0=8192M,1=8192M"}));
    let too_big = format!("{{\"pad\": \"{}\"}}", "x".repeat(caps_webhook::MAX_BODY));
    let out = post_raw(addr, &too_big).await;
    assert!(out.starts_with("HTTP/1.1 413"), "{}", &out[..out.len().min(200)]);

    // A client trickling its body does not hold a slot: 408 after BODY_WAIT.
    let mut stream = tokio::net::TcpStream::connect(addr).await.expect("connects");
    let head = format!(
        "POST {} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n{{\"apiV",
        caps_webhook::PATH
    );
    stream.write_all(head.as_bytes()).await.expect("writes");
    let mut out = String::new();
    let read = tokio::time::timeout(caps_webhook::BODY_WAIT * 5, stream.read_to_string(&mut out)).await;
    assert!(read.is_ok() && out.starts_with("HTTP/1.1 408"), "{out}");

    let (busy, busy_server) = serve(&op, caps_webhook::router_with(op.ctx.clone(), 0, Duration::from_millis(20))).await;
    let out = post_raw(busy, &create_review("team-a").to_string()).await;
    assert!(out.starts_with("HTTP/1.1 503") && out.contains("saturated"), "{out}");
    let saturated = op
        .ctx
        .metrics()
        .caps_admissions
        .get_or_create(&gpubudget_operator::metrics::CapsResultLabels { result: CapsResult::Saturated })
        .get();
    assert_eq!(saturated, 1);
    op.stop().await;
    server.await.expect("joins").expect("serves cleanly");
    busy_server.await.expect("joins").expect("serves cleanly");
}

/// #32 item 2: the decision runs off the async workers. On a runtime with a single worker thread, while a
/// 6 MB review is being decided (well over 100 ms in a debug build), the same server answers another request
/// (here the 503 of a full slot) before the big one is answered: a decision on the worker would block it.
#[tokio::test(flavor = "current_thread")]
async fn a_big_decision_does_not_block_the_async_worker() {
    let fake = FakeApi::new();
    budget(&fake, "team-a", "llm", "8Gi", "Enabled");
    let op = Operator::start(&fake, true);
    until(&fake, "the caches", |_| *op.ctx.synced_watch().borrow()).await;
    let (addr, server) = serve(&op, caps_webhook::router_with(op.ctx.clone(), 1, Duration::ZERO)).await;

    let mut review = create_review("team-a");
    let pad = "x".repeat(1_500_000);
    review["request"]["object"]["spec"]["containers"] = (0..4)
        .map(|i| {
            json!({"name": format!("c{i}"), "resources": {"limits": {"nvidia.com/gpu": "1"}},
                        "env": [{"name": "PAD", "value": pad}]})
        })
        .collect();
    let body = review.to_string();
    assert!(body.len() > 6_000_000 && body.len() < caps_webhook::MAX_BODY);
    let mut big = tokio::net::TcpStream::connect(addr).await.expect("connects");
    let head = format!(
        "POST {} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        caps_webhook::PATH,
        body.len()
    );
    big.write_all(head.as_bytes()).await.expect("writes");
    big.write_all(body.as_bytes()).await.expect("writes");
    let big = tokio::spawn(async move {
        let mut out = String::new();
        big.read_to_string(&mut out).await.expect("reads");
        out
    });
    // The big one holds the only slot while it is decided: this one is answered 503 meanwhile.
    let small = post_raw(addr, &create_review("team-a").to_string()).await;
    assert!(small.starts_with("HTTP/1.1 503"), "{small}");
    assert!(!big.is_finished(), "the small request was answered while the big one was being decided");
    let big = big.await.expect("joins");
    assert!(big.starts_with("HTTP/1.1 200"), "{}", &big[..big.len().min(200)]);
    op.stop().await;
    server.await.expect("joins").expect("serves cleanly");
}

#[tokio::test(start_paused = true)]
async fn a_leader_without_election_keeps_running_and_labelling() {
    // Without election the leadership sender may be dropped at once (it cannot change): the labeller must not
    // take that as the end, nor stop the controller with it.
    let fake = FakeApi::new();
    namespace(&fake, "team-a", json!({}));
    let (tx, rx) = watch::channel(true);
    drop(tx);
    let ctx = Arc::new(Context::new(fake.client(), Metrics::default(), rx, Settings::default()));
    let shutdown = CancellationToken::new();
    let task = tokio::spawn(controller::run(ctx.clone(), Health::new(&[CHECK_PODS, CHECK_BUDGETS]), shutdown.clone()));
    until(&fake, "the caches", |_| *ctx.synced_watch().borrow()).await;
    budget(&fake, "team-a", "llm", "8Gi", "Enabled");
    until(&fake, "team-a labelled", |f| labelled(f, "team-a")).await;
    assert!(!task.is_finished(), "the controller is still running");
    shutdown.cancel();
    tokio::time::timeout(WAIT, task).await.expect("stops in time").expect("joins").expect("runs cleanly");
}

/// #23: a `ClusterGpuMemoryBudget` with `admissionCaps: Enabled` scopes the webhook to the namespaces it
/// selects, and follows a relabel in and out.
#[tokio::test(start_paused = true)]
async fn the_leader_labels_the_namespaces_a_caps_cluster_budget_selects() {
    use kube::CustomResourceExt;
    let fake = FakeApi::new();
    fake.put_object(serde_json::to_value(gpubudget_common::ClusterGpuMemoryBudget::crd()).expect("crd")).expect("crd");
    namespace(&fake, "team-a", json!({"tier": "tenant"}));
    namespace(&fake, "team-b", json!({}));
    fake.put_object(json!({
        "apiVersion": "gpubudget.io/v1alpha1", "kind": "ClusterGpuMemoryBudget",
        "metadata": {"name": "tenants", "generation": 1},
        "spec": {"namespaceSelector": {"matchLabels": {"tier": "tenant"}}, "selector": {}, "limit": "16Gi",
                 "admissionCaps": "Enabled"},
    }))
    .expect("cluster budget stored");
    let op = Operator::start(&fake, true);
    until(&fake, "team-a labelled", |f| labelled(f, "team-a")).await;
    assert!(!labelled(&fake, "team-b"));
    fake.modify("namespaces", "", "team-b", |ns| ns["metadata"]["labels"]["tier"] = "tenant".into());
    fake.modify("namespaces", "", "team-a", |ns| ns["metadata"]["labels"]["tier"] = "system".into());
    until(&fake, "the labels to follow", |f| labelled(f, "team-b") && !labelled(f, "team-a")).await;
    op.stop().await;
}

/// Status counts a pod capped only where the driver reads its value on every device: a pod carrying
/// `0=...,1=...` that may hold two replicas of one card, or a 1-GPU pod whose scheduler's ConfigMap may set
/// NVIDIA_VISIBLE_DEVICES=all, is counted uncapped.
#[tokio::test(start_paused = true)]
async fn status_counts_replicas_and_env_from_pods_uncapped() {
    let fake = FakeApi::new();
    budget(&fake, "team-a", "llm", "8Gi", "Enabled");
    let put = |name: &str, limits: Value, selector: Value, env_from: Value, mps: &str| {
        fake.put_object(json!({
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": "team-a"},
            "spec": {"nodeSelector": selector, "containers": [{"name": "main", "image": "x", "envFrom": env_from,
                     "env": [{"name": MPS_LIMIT, "value": mps}], "resources": {"limits": limits}}]},
            "status": {"phase": "Running"},
        }))
        .expect("pod stored");
    };
    let unshared = json!({"nvidia.com/gpu.sharing-strategy": "none"});
    put("whole", json!({"nvidia.com/gpu": "2"}), unshared.clone(), json!([]), "0=8192M,1=8192M");
    put("sliced", json!({"nvidia.com/gpu": "2"}), json!({}), json!([]), "0=8192M,1=8192M");
    put("shared", json!({"nvidia.com/gpu.shared": "2"}), unshared, json!([]), "0=8192M,1=8192M");
    put("mps-replica", json!({"nvidia.com/gpu.shared": "1"}), json!({}), json!([]), "0=8192M");
    put(
        "kai",
        json!({"nvidia.com/gpu": "1"}),
        json!({}),
        json!([{"configMapRef": {"name": "gpu-sharing"}}]),
        "0=8192M",
    );
    let op = Operator::start(&fake, true);
    until(&fake, "the caps counts", |f| status(f, "llm").matched_pods == 5 && status(f, "llm").pods_capped.is_some())
        .await;
    let s = status(&fake, "llm");
    assert_eq!((s.pods_capped, s.pods_uncapped), (Some(2), Some(3)), "whole and mps-replica capped");
    op.stop().await;
}
