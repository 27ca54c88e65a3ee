//! A tenant who cannot stall the operator (issue 32, item 2; formerly hostile-caps.sh): the operator's caps
//! webhook and eviction check served from one process (URL mode on 127.0.0.1), a tenant sending hostile pod
//! creates (server dry runs of a pod whose `CUDA_MPS_PINNED_DEVICE_MEM_LIMIT` is 150 000 entries, 1.5 MB, under
//! the API server's 3 MB) in loops, and the eviction check's latency measured while it does:
//! - the eviction check (`POST /validate-eviction`, the request the API server sends for each of the agent's
//!   evictions: a node-bound agent identity, a pod looked up through the API server) answered N times in a row
//!   (`GPUBUDGET_E2E_HOSTILE_N`, default 300), 10 ms apart, over one keep-alive TLS connection as the API server
//!   holds one: idle, then while W loops (`GPUBUDGET_E2E_HOSTILE_WORKERS`, default 4) send the hostile creates;
//!   every check is allowed, and its p99 under load is under 1 s;
//! - what the webhook makes of the hostile value, how many hostile creates went through, the webhook's answers.
//!
//! The checks are timed on a `kube::Client` of their own, on a thread and runtime of their own (the hostile
//! loops' 1.5 MB requests cannot delay them in the test); hostile-caps.sh timed them with Python's http.client,
//! and sent its hostile creates with `kubectl create --dry-run=server` (a process and a connection each), where the
//! loops here are tasks on the admin's client (kept-alive connections).

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::{Namespace, Pod};
use kube::api::{Api, PostParams};
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::{Client, Config, ResourceExt};
use serde_json::{Value, json};

use crate::harness::{CAPS_WEBHOOK, Operator, Run, latencies, metrics, nearest_rank};

const MPS: &str = "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT";

/// The hostile pod, serialized: one GPU container whose MPS value is 150 000 entries (1.5 MB).
fn hostile_pod() -> Vec<u8> {
    let value: Vec<String> = (0..150_000).map(|i| format!("{}={}M", i % 7, 100_000 + i % 50)).collect();
    let pod = json!({"apiVersion": "v1", "kind": "Pod", "metadata": {"generateName": "hostile-"},
        "spec": {"containers": [{"name": "main", "image": "local/busybox:1",
                                 "env": [{"name": MPS, "value": value.join(",")}],
                                 "resources": {"limits": {"nvidia.com/gpu": "1"}}}]}});
    serde_json::to_vec(&pod).expect("json")
}

/// A server dry run of the pod `body`'s create in `ns` (as `kubectl create --dry-run=server`): the pod admitted.
async fn dry_run_create(client: &Client, ns: &str, body: &[u8]) -> kube::Result<String> {
    let request = http::Request::post(format!("/api/v1/namespaces/{ns}/pods?dryRun=All"))
        .header("Content-Type", "application/json")
        .body(body.to_vec())
        .expect("a request");
    client.request_text(request).await
}

/// The MPS value of a pod's first container.
fn mps_value(pod: &Value) -> String {
    let env = pod["spec"]["containers"][0]["env"].as_array().cloned().unwrap_or_default();
    env.iter().find(|e| e["name"] == MPS).and_then(|e| e["value"].as_str()).unwrap_or_default().to_owned()
}

/// N eviction checks of the pod `victim` in `ns`, asked as the agent of `node`.
#[derive(Clone, Debug)]
struct Checks {
    /// The operator's webhook address, trusted by the run's CA.
    webhook: Kubeconfig,
    ns: String,
    node: String,
    agent: String,
    n: usize,
}

/// What the checks measured.
struct Checked {
    line: String,
    p99: f64,
    verdicts: BTreeMap<String, usize>,
}

impl Checks {
    /// Runs the checks on a thread and a client of their own; the latencies, as `label: <latencies> verdicts=…`.
    async fn measure(&self, label: &str) -> Checked {
        let (checks, label) = (self.clone(), label.to_owned());
        let thread = std::thread::spawn(move || {
            let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("a runtime");
            runtime.block_on(checks.run(&label))
        });
        tokio::task::spawn_blocking(move || thread.join().expect("the checks ran")).await.expect("joined")
    }

    async fn run(self, label: &str) -> Checked {
        let config = Config::from_custom_kubeconfig(self.webhook, &KubeConfigOptions::default()).await.expect("config");
        let client = Client::try_from(config).expect("a client for the webhook");
        let (mut times, mut verdicts) = (Vec::with_capacity(self.n), BTreeMap::<String, usize>::new());
        for i in 0..self.n {
            let review = json!({"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": {
                "uid": format!("u-{i}"), "kind": {"group": "policy", "version": "v1", "kind": "Eviction"},
                "resource": {"group": "", "version": "v1", "resource": "pods"}, "subResource": "eviction",
                "name": "victim", "namespace": self.ns, "operation": "CREATE",
                "userInfo": {"username": self.agent, "groups": ["system:serviceaccounts"],
                             "extra": {"authentication.kubernetes.io/node-name": [self.node]}},
                "object": {"apiVersion": "policy/v1", "kind": "Eviction",
                           "metadata": {"name": "victim", "namespace": self.ns}},
                "dryRun": false}});
            let request = http::Request::post("/validate-eviction")
                .header("Content-Type", "application/json")
                .body(serde_json::to_vec(&review).expect("json"))
                .expect("a request");
            let t = Instant::now();
            // A failed call is what the chart's failurePolicy Fail turns into a refused eviction.
            let verdict = match tokio::time::timeout(Duration::from_secs(30), client.request_text(request)).await {
                Ok(Ok(text)) => match serde_json::from_str::<Value>(&text) {
                    Ok(answer) if answer["response"]["allowed"] == true => "allowed".to_owned(),
                    Ok(_) => "denied".to_owned(),
                    Err(_) => "error: not an AdmissionReview".to_owned(),
                },
                Ok(Err(e)) => format!("error: {}", e.to_string().chars().take(80).collect::<String>()),
                Err(_) => "error: no answer in 30 s".to_owned(),
            };
            times.push(t.elapsed().as_secs_f64() * 1000.0);
            *verdicts.entry(verdict).or_default() += 1;
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let line = format!("{label}: {} verdicts={verdicts:?}", latencies(&mut times));
        Checked { line, p99: nearest_rank(&times, 0.99), verdicts }
    }
}

pub async fn hostile_tenant() {
    let mut run = Run::start("gpubudget-hostile", &["gpubudget-operator"]).await;
    let env = |name: &str, default: usize| std::env::var(name).ok().and_then(|s| s.parse().ok()).unwrap_or(default);
    let (n, workers) = (env("GPUBUDGET_E2E_HOSTILE_N", 300), env("GPUBUDGET_E2E_HOSTILE_WORKERS", 4));
    let release = format!("gpubudget-hostile-{}", run.id);
    run.say("control plane, CRDs, the chart's RBAC, admission policies and webhooks (URL mode), one node, one pod");
    run.info(&format!("checks per run: {n}  hostile loops: {workers}"));
    run.apply_crds().await;
    let ns = run.namespace(&release).await; // the release's
    let ns_a = run.namespace(&format!("{release}-a")).await; // a budget with caps: the tenant's, and the victim's
    let node = format!("{release}-n1");
    run.node(&node).await;
    let tls = run.webhook_cert();
    let webhook = run.addr(1);
    run.apply_chart(&release, &ns, CAPS_WEBHOOK, Some((&webhook, &tls.join("ca.crt")))).await;
    run.apply(
        &json!({"apiVersion": "gpubudget.io/v1alpha1", "kind": "GpuMemoryBudget", "metadata": {"name": "capped", "namespace": ns_a},
                "spec": {"selector": {}, "limit": "8Gi", "admissionCaps": "Enabled"}}),
        &ns_a,
    )
    .await;
    let operator = run.chart_operator(&ns, &release).await;
    let mut operator = Operator::new(&run, operator, &ns, run.addr(0), Some(run.addr(1)));
    let admin = operator.admin.clone();
    let _op = operator.start(&[]).await;
    run.object_until(
        Api::<Namespace>::all(run.admin.clone()),
        &ns_a,
        &format!("the operator labels {ns_a} for the caps webhook"),
        |n| n.labels().get("gpubudget.io/admission-caps").map(String::as_str) == Some("enabled"),
    )
    .await;
    let victim: Pod = serde_json::from_value(json!({"metadata": {"name": "victim"},
        "spec": {"nodeName": node, "containers": [{"name": "main", "image": "local/busybox:1",
                                                   "resources": {"limits": {"nvidia.com/gpu": "1"}}}]}}))
    .expect("a pod");
    let victim = Api::<Pod>::namespaced(run.admin.clone(), &ns_a)
        .create(&PostParams::default(), &victim)
        .await
        .expect("the victim created");
    let victim_mps = mps_value(&serde_json::to_value(&victim).expect("json"));
    run.info(&format!("victim's MPS cap set at admission: {victim_mps}"));
    assert_eq!(victim_mps, "0=8192M", "the victim was not capped at admission");

    let hostile: Arc<[u8]> = hostile_pod().into();
    run.info(&format!("hostile pod: {} bytes", hostile.len()));
    let one = dry_run_create(&run.admin, &ns_a, &hostile).await.expect("a hostile dry run admitted");
    let made = mps_value(&serde_json::from_str(&one).expect("a pod"));
    run.info(&format!("what the webhook makes of its value (dry run): {}", made.chars().take(80).collect::<String>()));
    assert_eq!(made, "0=8192M", "the hostile value was not replaced by the canonical cap");

    let webhook_config = json!({"apiVersion": "v1", "kind": "Config",
        "clusters": [{"name": "webhook", "cluster": {"server": format!("https://{webhook}"),
                                                     "certificate-authority": tls.join("ca.crt")}}],
        "users": [{"name": "none", "user": {}}],
        "contexts": [{"name": "webhook", "context": {"cluster": "webhook", "user": "none"}}],
        "current-context": "webhook"});
    let checks = Checks {
        webhook: Kubeconfig::from_yaml(&webhook_config.to_string()).expect("the webhook's kubeconfig"),
        ns: ns_a.clone(),
        node: node.clone(),
        agent: format!("system:serviceaccount:{ns}:{release}-agent"),
        n,
    };

    run.say("the eviction check, idle");
    let idle = checks.measure("idle").await;
    run.info(&idle.line);

    run.say(&format!("the eviction check while {workers} tenant loops send hostile dry-run creates"));
    let stop = Arc::new(AtomicBool::new(false));
    let loops: Vec<_> = (0..workers)
        .map(|_| {
            let (client, ns, body, stop) = (run.admin.clone(), ns_a.clone(), hostile.clone(), stop.clone());
            tokio::spawn(async move {
                let (mut sent, mut admitted) = (0u32, 0u32);
                while !stop.load(Ordering::Relaxed) {
                    sent += 1;
                    admitted += u32::from(dry_run_create(&client, &ns, &body).await.is_ok());
                }
                (sent, admitted)
            })
        })
        .collect();
    let started = Instant::now();
    tokio::time::sleep(Duration::from_secs(3)).await;
    let loaded = checks.measure("under hostile creates").await;
    run.info(&loaded.line);
    stop.store(true, Ordering::Relaxed);
    let (mut sent, mut admitted) = (0, 0);
    for one in loops {
        let (s, a) = one.await.expect("a hostile loop");
        (sent, admitted) = (sent + s, admitted + a);
    }
    run.info(&format!(
        "hostile creates: {sent} sent ({admitted} admitted by the dry run) in {:.0} s",
        started.elapsed().as_secs_f64()
    ));
    run.info("the caps webhook's answers:");
    for line in metrics(&admin).await.lines().filter(|l| l.starts_with("gpubudget_operator_caps_admissions_total")) {
        run.info(&format!("  {line}"));
    }
    assert_eq!(
        loaded.verdicts,
        BTreeMap::from([("allowed".to_owned(), n)]),
        "the eviction check did not allow every request under load: {}",
        loaded.line
    );
    assert!(loaded.p99 < 1000.0, "p99 {:.1} ms under load", loaded.p99);
    assert!(sent > 0, "no hostile create was sent");
    run.say(&format!(
        "PASS: the eviction check kept answering while a tenant sent hostile creates ({} s)",
        run.elapsed()
    ));
}
