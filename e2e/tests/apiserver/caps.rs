//! Caps set at admission (issue 22, part 5; formerly caps.sh): the operator's mutating webhook (POST
//! /mutate-pod-caps, URL mode on 127.0.0.1), scoped by the namespace label the operator keeps, the chart's caps
//! record policy, a tenant's attempts at the record, the operator down, and the webhook's cost per pod create:
//! - the operator labels the namespace of a budget with `admissionCaps: Enabled` (and only it);
//! - a GPU pod a tenant creates there gets CUDA_MPS_PINNED_DEVICE_MEM_LIMIT (one entry per device),
//!   NVIDIA_GPU_MEMORY_LIMIT and NVIDIA_GPU_MEMORY_REQUEST, and the gpubudget.io/caps record;
//! - a user's smaller values are kept (in canonical form: 0=2G is written 0=2048M, #32);
//! - a GPU pod in a namespace without such a budget gets nothing and never reaches the webhook (the operator's
//!   gpubudget_operator_caps_admissions_total does not move);
//! - the tenant (`edit` in its namespace, by token) cannot forge the record: one written at creation is replaced
//!   by the webhook's; adding, changing or removing it afterwards is refused by the chart's policy;
//! - the operator down: pods are still created (failurePolicy Ignore), without the variables, and once the
//!   operator is back its status counts them uncapped (a record forged meanwhile does not make one capped);
//! - pod-create latency, p50/p99 of N sequential creates (GPUBUDGET_E2E_CAPS_N, default 200) in a namespace the
//!   webhook serves and in one it does not.

use std::time::{Duration, Instant};

use gpubudget_common::GpuMemoryBudget;
use k8s_openapi::api::core::v1::{Namespace, Pod};
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, PostParams};
use kube::{Client, ResourceExt};
use serde_json::{Value, json};

use crate::harness::{
    CAPS_WEBHOOK, Operator, Run, annotate, caps_record, env_of, latencies, metrics, patch_pod, refused,
};

/// A pod with one container asking for 2 GPUs, pinned to nodes that do not share them (without, 2 may be replicas
/// of one card: no MPS cap is written).
fn gpu_pod(name: &str, env: Value, annotations: Value) -> Pod {
    serde_json::from_value(json!({"metadata": {"name": name, "annotations": annotations},
        "spec": {"nodeSelector": {"nvidia.com/gpu.sharing-strategy": "none"},
                 "containers": [{"name": "main", "image": "local/busybox:1", "env": env,
                                 "resources": {"limits": {"nvidia.com/gpu": "2"}}}]}}))
    .expect("a pod")
}

/// The operator's caps_admissions_total, all results.
async fn admissions(admin: &str) -> f64 {
    metrics(admin)
        .await
        .lines()
        .filter(|l| l.starts_with("gpubudget_operator_caps_admissions_total"))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// What the caps record policy says when it refuses a tenant's change to the record.
const RECORD_REFUSED: &str = "cannot be added, changed or removed";

/// `n` sequential pod creates (after 10 not counted) in `ns`: p50, p90, p99, mean and max in ms, and whether the
/// last one came back capped.
async fn latency(client: &Client, ns: &str, n: usize) -> (String, bool) {
    let api = Api::<Pod>::namespaced(client.clone(), ns);
    let mut times = Vec::with_capacity(n);
    let mut capped = false;
    for i in 0..n + 10 {
        let pod: Pod = serde_json::from_value(json!({"metadata": {"name": format!("lat-{i}")},
            "spec": {"containers": [{"name": "main", "image": "local/busybox:1",
                                     "resources": {"limits": {"nvidia.com/gpu": "1"}}}]}}))
        .expect("a pod");
        let t = Instant::now();
        let created = api.create(&PostParams::default(), &pod).await.expect("created");
        let ms = t.elapsed().as_secs_f64() * 1000.0;
        if i >= 10 {
            times.push(ms);
        }
        capped = env_of(&created).iter().any(|l| l.contains("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"));
    }
    let line = format!("{} capped={capped}", latencies(&mut times));
    let _ = api.delete_collection(&DeleteParams::background(), &ListParams::default()).await;
    (line, capped)
}

pub async fn caps_at_admission() {
    let mut run = Run::start("gpubudget-caps", &["gpubudget-operator"]).await;
    let n: usize = std::env::var("GPUBUDGET_E2E_CAPS_N").ok().and_then(|s| s.parse().ok()).unwrap_or(200);
    let id = run.id.clone();
    let release = format!("gpubudget-caps-{id}");
    run.say("control plane, chart");
    run.apply_crds().await;
    let ns = run.namespace(&release).await;
    let ns_a = run.namespace(&format!("{release}-a")).await; // a budget with caps; the tenant's
    let ns_b = run.namespace(&format!("{release}-b")).await; // no budget
    let ns_l1 = run.namespace(&format!("{release}-l1")).await; // latency: served by the webhook
    let ns_l2 = run.namespace(&format!("{release}-l2")).await; // latency: not served
    let tls = run.webhook_cert();
    let webhook = run.addr(1);
    run.apply_chart(&release, &ns, CAPS_WEBHOOK, Some((&webhook, &tls.join("ca.crt")))).await;
    run.tenant_with_edit(&ns_a).await;
    let tenant_token = run.token(&ns_a, "tenant", None).await;
    let tenant = run.identity("tenant", &tenant_token).await.client;
    // Its webhooks on the run's port 1, its admin on port 0.
    let operator = run.chart_operator(&ns, &release).await;
    let mut operator = Operator::new(&run, operator, &ns, run.addr(0), Some(run.addr(1)));
    let admin = operator.admin.clone();
    let tenant_pods = Api::<Pod>::namespaced(tenant.clone(), &ns_a);
    let namespaces = Api::<Namespace>::all(run.admin.clone());
    let labelled = |n: &Namespace| n.labels().get("gpubudget.io/admission-caps").map(String::as_str) == Some("enabled");

    run.say(&format!("operator; a budget with admissionCaps: Enabled in {ns_a} labels that namespace only"));
    let mut op = operator.start(&[]).await;
    let budget = |ns: &str, spec: Value| json!({"apiVersion": "gpubudget.io/v1alpha1", "kind": "GpuMemoryBudget", "metadata": {"name": "llm", "namespace": ns}, "spec": spec});
    run.apply(
        &budget(&ns_a, json!({"selector": {}, "limit": "8Gi", "request": "6Gi", "admissionCaps": "Enabled"})),
        &ns_a,
    )
    .await;
    run.object_until(
        namespaces.clone(),
        &ns_a,
        &format!("{ns_a} labelled gpubudget.io/admission-caps=enabled"),
        labelled,
    )
    .await;
    assert!(!labelled(&namespaces.get(&ns_b).await.expect("ns b")), "{ns_b} was labelled");
    run.info(&format!("ok: {ns_b} not labelled"));

    run.say(&format!("a tenant's GPU pod in {ns_a} gets the variables and the record"));
    let plain =
        tenant_pods.create(&PostParams::default(), &gpu_pod("plain", json!([]), json!({}))).await.expect("created");
    for line in env_of(&plain) {
        run.info(&format!("env: {line}"));
    }
    assert_eq!(
        env_of(&plain).join("\n"),
        "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=8192M,1=8192M\nNVIDIA_GPU_MEMORY_LIMIT=8192\nNVIDIA_GPU_MEMORY_REQUEST=6144",
        "unexpected env on {ns_a}/plain"
    );
    let (text, record) = caps_record(&plain);
    run.info(&format!("record: {text}"));
    assert_eq!(
        (record.budget.as_str(), record.limit_mib, record.request_mib),
        ("llm", 8192, Some(6144)),
        "unexpected record: {text}"
    );
    run.info("ok: three variables, one MPS entry per device, the record");

    run.say("a user's smaller values are kept");
    let env = json!([{"name": "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT", "value": "0=2G,1=20G"}, {"name": "NVIDIA_GPU_MEMORY_LIMIT", "value": "1000"}]);
    let smaller =
        tenant_pods.create(&PostParams::default(), &gpu_pod("smaller", env, json!({}))).await.expect("created");
    for line in env_of(&smaller) {
        run.info(&format!("env: {line}"));
    }
    assert_eq!(
        env_of(&smaller).join("\n"),
        "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=2048M,1=8192M\nNVIDIA_GPU_MEMORY_LIMIT=1000\nNVIDIA_GPU_MEMORY_REQUEST=6144",
        "unexpected env on {ns_a}/smaller"
    );
    run.info("ok: 0=2G kept as 0=2048M, 1000 kept, 1=20G lowered");

    run.say(&format!("a GPU pod in {ns_b} (no budget) gets nothing and never reaches the webhook"));
    let before = admissions(&admin).await;
    let outside = Api::<Pod>::namespaced(run.admin.clone(), &ns_b)
        .create(&PostParams::default(), &gpu_pod("outside", json!([]), json!({})))
        .await
        .expect("created");
    assert!(env_of(&outside).is_empty(), "{ns_b}/outside got env");
    let after = admissions(&admin).await;
    run.info(&format!("webhook answers before/after: {before}/{after}"));
    assert_eq!(before, after, "the webhook was called for {ns_b}");
    run.info("ok: no variables, no webhook call");

    run.say("the tenant cannot forge the record");
    let forged = json!({"gpubudget.io/caps": "{\"budget\":\"llm\",\"limitMib\":99999,\"containers\":[]}"});
    let pod = tenant_pods
        .create(&PostParams::default(), &gpu_pod("forged-at-create", json!([]), forged))
        .await
        .expect("created");
    let (text, record) = caps_record(&pod);
    assert!(record.limit_mib == 8192 && record.containers.len() == 1, "a record written at creation survived: {text}");
    run.info(&format!(
        "ok: written at creation: replaced by the webhook's (limitMib {}, containers {})",
        record.limit_mib,
        serde_json::to_string(&record.containers).expect("json")
    ));
    let record = |pod: &'static str, value: Option<&'static str>| {
        patch_pod(&tenant, &ns_a, pod, annotate("gpubudget.io/caps", value))
    };
    // The caps record policy is in force once a dry run of the change is refused (dry runs go through admission).
    run.until("the caps record policy in force (a dry-run change of the record refused)", || async {
        let patch = annotate("gpubudget.io/caps", Some("{}"));
        let dry = PatchParams { dry_run: true, ..PatchParams::default() };
        tenant_pods.patch("plain", &dry, &Patch::Merge(&patch)).await.is_err()
    })
    .await;
    refused(
        &run,
        RECORD_REFUSED,
        "the tenant changing plain's record",
        record("plain", Some(r#"{"budget":"llm","limitMib":1}"#)).await,
    );
    refused(&run, RECORD_REFUSED, "the tenant removing plain's record", record("plain", None).await);
    patch_pod(&tenant, &ns_a, "plain", annotate("example.com/note", Some("fine")))
        .await
        .expect("another annotation allowed");
    run.info("ok: another annotation: allowed");

    run.say("the operator down: pods are still created, without caps, and reported uncapped");
    op.stop();
    let down = tenant_pods
        .create(&PostParams::default(), &gpu_pod("while-down", json!([]), json!({})))
        .await
        .expect("created (failurePolicy Ignore)");
    let forged = json!({"gpubudget.io/caps": "{\"budget\":\"llm\",\"limitMib\":8192,\"containers\":[]}"});
    tenant_pods
        .create(&PostParams::default(), &gpu_pod("forged-while-down", json!([]), forged))
        .await
        .expect("created");
    assert!(env_of(&down).is_empty(), "caps set while the operator was down?");
    run.info("ok: created without variables (failurePolicy Ignore)");
    refused(
        &run,
        RECORD_REFUSED,
        "the tenant adding while-down's record",
        record("while-down", Some(r#"{"budget":"llm","limitMib":8192,"containers":[]}"#)).await,
    );
    let _op = operator.start(&[]).await;
    let budgets = Api::<GpuMemoryBudget>::namespaced(run.admin.clone(), &ns_a);
    run.object_until(budgets, "llm", "status: 3 capped, 2 uncapped", |b| {
        b.status.as_ref().is_some_and(|s| (s.pods_capped, s.pods_uncapped) == (Some(3), Some(2)))
    })
    .await;

    run.say(&format!("pod-create latency: {n} sequential creates each, with and without the webhook"));
    run.apply(&budget(&ns_l1, json!({"selector": {}, "limit": "8Gi", "admissionCaps": "Enabled"})), &ns_l1).await;
    run.object_until(namespaces, &ns_l1, &format!("{ns_l1} labelled"), labelled).await;
    for round in 1..=2 {
        let (line, capped) = latency(&run.admin, &ns_l2, n).await;
        run.info(&format!("round {round}, without the webhook ({ns_l2}): {line}"));
        assert!(!capped, "a pod in {ns_l2} was capped");
        let (line, capped) = latency(&run.admin, &ns_l1, n).await;
        run.info(&format!("round {round}, with the webhook    ({ns_l1}): {line}"));
        assert!(capped, "a pod in {ns_l1} was not capped");
        tokio::time::sleep(Duration::from_secs(2)).await;
    }
    run.info(&format!("operator: caps admissions answered: {} (this run)", admissions(&admin).await));
    run.say(&format!("PASS ({} s)", run.elapsed()));
}
