//! Scale harness for the operator (issue 4's targets, figures in docs/performance.md): the real
//! `gpubudget-operator run` binary, as a child process, against the in-memory API (gpubudget-testkit)
//! served over HTTP on 127.0.0.1, with 10 000 pods and 1 000 budgets.
//!
//! ```sh
//! cargo build --release -p gpubudget-operator --bin gpubudget-operator --example scale
//! target/release/examples/scale    # --pods 10000 --budgets 1000 --budgets-per-namespace 10 --changes 100 --moves 20
//! ```
//!
//! It measures, on the operator process only (the fake API lives in this process):
//! - RSS (`VmRSS`) and peak RSS (`VmHWM`) from `/proc/<pid>/status`, after start-up and after the changes;
//! - start-up convergence: from spawn to every budget's status written;
//! - convergence after a pod change: from the agent's record write (server-side apply of the pod's
//!   annotations, as the agent does) to the budget's status showing it, p50/p99 over `--changes`;
//! - the same for label changes that move a pod between budgets (`--moves`).
//!
//! Pods are created through the API (so they carry managedFields like real ones), with six labels, an
//! owner reference, a 1.5 KB `last-applied-configuration` annotation and the agent's record. Budgets:
//! `--budgets / --budgets-per-namespace` namespaces (default 10 budgets each); budget 0 of a namespace selects every pod there (so
//! every pod is in an overlap), the others select `app: app-<k>`.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::Stdio;
use std::time::{Duration, Instant};

use futures::StreamExt;
use gpubudget_common::GpuMemoryBudget;
use gpubudget_testkit::{FakeApi, Verb};
use http_body_util::BodyExt;
use hyper::body::Incoming;
use hyper_util::rt::TokioIo;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Patch, PatchParams, PostParams};
use kube::{Api, CustomResourceExt};
use serde_json::{Value, json};
use tower::ServiceExt;

const GI: u64 = 1 << 30;

#[derive(Debug)]
struct Args {
    pods: usize,
    budgets: usize,
    changes: usize,
    moves: usize,
    per_ns: usize,
    operator: PathBuf,
}

fn args() -> anyhow::Result<Args> {
    let exe = std::env::current_exe()?;
    let default_operator =
        exe.parent().and_then(|p| p.parent()).map(|p| p.join("gpubudget-operator")).unwrap_or_default();
    let mut out =
        Args { pods: 10_000, budgets: 1_000, changes: 100, moves: 20, per_ns: 10, operator: default_operator };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let value = it.next().ok_or_else(|| anyhow::anyhow!("{flag} needs a value"))?;
        match flag.as_str() {
            "--pods" => out.pods = value.parse()?,
            "--budgets" => out.budgets = value.parse()?,
            "--changes" => out.changes = value.parse()?,
            "--moves" => out.moves = value.parse()?,
            "--budgets-per-namespace" => out.per_ns = value.parse()?,
            "--operator" => out.operator = value.into(),
            _ => anyhow::bail!("unknown flag {flag}"),
        }
    }
    anyhow::ensure!(
        out.per_ns >= 2 && out.budgets >= out.per_ns && out.budgets.is_multiple_of(out.per_ns),
        "--budgets must be a multiple of --budgets-per-namespace (at least 2)"
    );
    Ok(out)
}

fn ns(i: usize) -> String {
    format!("ns-{i:03}")
}

type Reply = hyper::Response<http_body_util::combinators::BoxBody<bytes::Bytes, std::convert::Infallible>>;

/// Paginates lists the way the API server does (`limit` and `continue` over one snapshot), which the fake
/// does not: without it the operator would read 10 000 pods in one response, a peak no real cluster makes
/// it take (kube's watcher lists 500 at a time).
#[derive(Default)]
struct Pager {
    lists: std::sync::Mutex<std::collections::HashMap<u64, (Value, Vec<Value>)>>,
    next: std::sync::atomic::AtomicU64,
}

fn param(query: &str, key: &str) -> Option<String> {
    query.split('&').find_map(|kv| kv.strip_prefix(key).and_then(|v| v.strip_prefix('='))).map(str::to_owned)
}

impl Pager {
    fn page(&self, id: u64, offset: usize, limit: usize) -> Value {
        let mut lists = self.lists.lock().expect("pager lock");
        let Some((head, items)) = lists.get(&id) else {
            return json!({"kind": "Status", "apiVersion": "v1", "status": "Failure", "code": 410, "reason": "Expired"});
        };
        let end = (offset + limit).min(items.len());
        let mut out = head.clone();
        out["items"] = Value::Array(items[offset..end].to_vec());
        if end < items.len() {
            out["metadata"]["continue"] = format!("{id}:{end}").into();
            out["metadata"]["remainingItemCount"] = (items.len() - end).into();
        } else {
            lists.remove(&id);
        }
        out
    }

    fn store(&self, mut list: Value) -> u64 {
        let items = match list["items"].take() {
            Value::Array(items) => items,
            _ => Vec::new(),
        };
        let id = self.next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        self.lists.lock().expect("pager lock").insert(id, (list, items));
        id
    }
}

fn json_reply(value: &Value) -> Reply {
    let body = http_body_util::Full::new(bytes::Bytes::from(value.to_string())).boxed();
    let mut response = hyper::Response::new(body);
    response.headers_mut().insert("content-type", "application/json".parse().expect("header"));
    response
}

/// Serves the fake over plain HTTP/1.1, paginating lists.
async fn serve(fake: FakeApi) -> anyhow::Result<SocketAddr> {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    let pager = std::sync::Arc::new(Pager::default());
    tokio::spawn(async move {
        loop {
            let Ok((stream, _)) = listener.accept().await else { continue };
            let (svc, pager) = (fake.service(), pager.clone());
            tokio::spawn(async move {
                let service = hyper::service::service_fn(move |req: hyper::Request<Incoming>| {
                    let (svc, pager) = (svc.clone(), pager.clone());
                    async move {
                        let query = req.uri().query().unwrap_or_default().to_owned();
                        let limit = param(&query, "limit").and_then(|l| l.parse::<usize>().ok()).filter(|l| *l > 0);
                        let is_list = req.method() == hyper::Method::GET && param(&query, "watch").is_none();
                        if let (true, Some(limit)) = (is_list, limit)
                            && let Some(token) = param(&query, "continue")
                        {
                            let token = token.replace("%3A", ":").replace("%3a", ":");
                            let (id, offset) = token.split_once(':').unwrap_or_default();
                            let page = pager.page(id.parse().unwrap_or(u64::MAX), offset.parse().unwrap_or(0), limit);
                            return Ok::<Reply, std::convert::Infallible>(json_reply(&page));
                        }
                        let (parts, body) = req.into_parts();
                        let bytes = body.collect().await.map(|c| c.to_bytes()).unwrap_or_default();
                        let req = hyper::Request::from_parts(parts, kube::client::Body::from(bytes));
                        let Ok(response) = svc.oneshot(req).await;
                        let (true, Some(limit)) = (is_list, limit) else { return Ok(response.map(|b| b.boxed())) };
                        let (parts, body) = response.into_parts();
                        let bytes = body.collect().await.map(|c| c.to_bytes()).unwrap_or_default();
                        match serde_json::from_slice::<Value>(&bytes) {
                            Ok(list) if list["items"].as_array().is_some_and(|i| i.len() > limit) => {
                                let id = pager.store(list);
                                Ok(json_reply(&pager.page(id, 0, limit)))
                            }
                            _ => Ok(hyper::Response::from_parts(parts, http_body_util::Full::new(bytes).boxed())),
                        }
                    }
                });
                let _ =
                    hyper::server::conn::http1::Builder::new().serve_connection(TokioIo::new(stream), service).await;
            });
        }
    });
    Ok(addr)
}

fn kubeconfig(addr: SocketAddr, dir: &std::path::Path) -> anyhow::Result<PathBuf> {
    let path = dir.join("kubeconfig");
    std::fs::write(
        &path,
        format!(
            "apiVersion: v1\nkind: Config\nclusters: [{{name: fake, cluster: {{server: 'http://{addr}'}}}}]\n\
             users: [{{name: fake, user: {{}}}}]\ncontexts: [{{name: fake, context: {{cluster: fake, user: fake, namespace: default}}}}]\n\
             current-context: fake\n"
        ),
    )?;
    Ok(path)
}

fn proc_status(pid: u32) -> (u64, u64) {
    let text = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    let field = |name: &str| {
        text.lines()
            .find(|l| l.starts_with(name))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|v| v.parse::<u64>().ok())
            .unwrap_or(0)
    };
    (field("VmRSS:"), field("VmHWM:"))
}

fn mib(kib: u64) -> f64 {
    kib as f64 / 1024.0
}

async fn http_get(addr: SocketAddr, path: &str) -> Option<String> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut stream = tokio::net::TcpStream::connect(addr).await.ok()?;
    let request = format!("GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
    stream.write_all(request.as_bytes()).await.ok()?;
    let mut out = String::new();
    stream.read_to_string(&mut out).await.ok()?;
    Some(out)
}

fn budget_status(fake: &FakeApi, ns: &str, name: &str) -> Value {
    fake.get("gpumemorybudgets", ns, name).map(|b| b["status"].clone()).unwrap_or(Value::Null)
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    if sorted.is_empty() {
        return Duration::ZERO;
    }
    let at = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[at.min(sorted.len() - 1)]
}

fn summary(name: &str, mut samples: Vec<Duration>) -> String {
    samples.sort();
    format!(
        "{name}: n={} p50={:.1} ms p99={:.1} ms max={:.1} ms",
        samples.len(),
        percentile(&samples, 0.5).as_secs_f64() * 1e3,
        percentile(&samples, 0.99).as_secs_f64() * 1e3,
        samples.last().copied().unwrap_or_default().as_secs_f64() * 1e3
    )
}

/// The agent's record of a pod, applied as the agent applies it.
async fn agent_record(pods: &Api<Pod>, name: &str, usage: u64, budget: &str) -> anyhow::Result<()> {
    let state = if usage > 8 * GI { "Over" } else { "Within" };
    let patch = json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "annotations": {
            "gpubudget.io/state": state,
            "gpubudget.io/usage-bytes": usage.to_string(),
            "gpubudget.io/budget": budget,
            "gpubudget.io/node": "gpu-node-1",
        }},
    });
    pods.patch(name, &PatchParams::apply("gpubudget-agent/gpu-node-1"), &Patch::Apply(&patch)).await?;
    Ok(())
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = args()?;
    anyhow::ensure!(
        args.operator.exists(),
        "{} not found: build it with --bin gpubudget-operator",
        args.operator.display()
    );
    let budgets_per_ns = args.per_ns;
    let namespaces = args.budgets / budgets_per_ns;
    let per_ns = args.pods / namespaces;
    eprintln!("setting up {} pods and {} budgets in {namespaces} namespaces", namespaces * per_ns, args.budgets);
    let started = Instant::now();
    let fake = FakeApi::new();
    let client = fake.client();
    let mut crd = serde_json::to_value(GpuMemoryBudget::crd())?;
    crd["status"] = json!({"conditions": [{"type": "Established", "status": "True"}]});
    fake.put_object(crd)?;
    for n in 0..namespaces {
        for b in 0..budgets_per_ns {
            let (selector, limit) =
                if b == 0 { (json!({}), "64Gi") } else { (json!({"matchLabels": {"app": format!("app-{b}")}}), "8Gi") };
            fake.put_object(json!({
                "apiVersion": "gpubudget.io/v1alpha1", "kind": "GpuMemoryBudget",
                "metadata": {"name": format!("budget-{b}"), "namespace": ns(n), "generation": 1},
                "spec": {"selector": selector, "limit": limit, "warnAtPercent": 90, "action": "Evict", "overLimitSeconds": 10},
            }))?;
        }
    }
    let last_applied = "x".repeat(1500);
    let mut creates = futures::stream::iter(0..namespaces * per_ns)
        .map(|i| {
            let (n, k) = (i / per_ns, i % per_ns);
            let api: Api<Pod> = Api::namespaced(client.clone(), &ns(n));
            let app = format!("app-{}", 1 + k % (budgets_per_ns - 1));
            let pod: Pod = serde_json::from_value(json!({
                "apiVersion": "v1", "kind": "Pod",
                "metadata": {
                    "name": format!("pod-{k:05}"), "namespace": ns(n),
                    "labels": {"app": app, "team": ns(n), "tier": "inference", "version": "v1.2.3",
                               "pod-template-hash": "5d8f7c9b6", "app.kubernetes.io/managed-by": "helm"},
                    "annotations": {"kubectl.kubernetes.io/last-applied-configuration": last_applied, "prometheus.io/scrape": "true"},
                    "ownerReferences": [{"apiVersion": "apps/v1", "kind": "ReplicaSet", "name": format!("{app}-5d8f7c9b6"),
                                         "uid": "3f7b9a52-8f43-4c38-9b1e-000000000000", "controller": true, "blockOwnerDeletion": true}],
                },
                "spec": {"nodeName": format!("gpu-node-{}", k % 50), "containers": [{"name": "main", "image": "registry.example/llm:1.0",
                         "resources": {"limits": {"nvidia.com/gpu": "1"}}}]},
            }))
            .expect("pod fixture");
            async move {
                api.create(&PostParams::default(), &pod).await?;
                let usage = (1 + (i as u64 % 6)) * GI;
                agent_record(&api, &format!("pod-{k:05}"), usage, &format!("budget-{}", 1 + k % (budgets_per_ns - 1))).await
            }
        })
        .buffer_unordered(16);
    while let Some(result) = creates.next().await {
        result?;
    }
    drop(creates);
    eprintln!("set up in {:.1} s", started.elapsed().as_secs_f64());

    let addr = serve(fake.clone()).await?;
    let dir = tempfile::tempdir()?;
    let config = kubeconfig(addr, dir.path())?;
    let admin = {
        let l = std::net::TcpListener::bind("127.0.0.1:0")?;
        l.local_addr()?
    };
    fake.clear_requests();
    let spawned = Instant::now();
    let mut child = tokio::process::Command::new(&args.operator)
        .args(["run", "--admin-addr", &admin.to_string()])
        .env("KUBECONFIG", &config)
        .env("RUST_LOG", std::env::var("RUST_LOG").unwrap_or_else(|_| "warn".into()))
        .env_remove("RUST_BACKTRACE")
        .stdin(Stdio::null())
        .kill_on_drop(true)
        .spawn()?;
    let pid = child.id().ok_or_else(|| anyhow::anyhow!("no pid"))?;

    // Start-up: ready, and every budget's status written.
    let mut ready_at = None;
    loop {
        anyhow::ensure!(spawned.elapsed() < Duration::from_secs(300), "no convergence in 300 s");
        if let Some(status) = child.try_wait()? {
            anyhow::bail!("the operator exited: {status}");
        }
        if ready_at.is_none() && http_get(admin, "/ready").await.is_some_and(|r| r.starts_with("HTTP/1.1 200")) {
            ready_at = Some(spawned.elapsed());
        }
        let written =
            fake.list("gpumemorybudgets", None).iter().filter(|b| b["status"]["observedGeneration"] == 1).count();
        if ready_at.is_some() && written == args.budgets {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let converged = spawned.elapsed();
    let startup_writes = fake.count(Verb::Patch, "gpumemorybudgets/status");
    tokio::time::sleep(Duration::from_secs(2)).await;
    let (rss_start, hwm_start) = proc_status(pid);

    // Record changes: a new, highest usage on one pod must show first in its budget's topPods.
    let mut record_samples = Vec::new();
    for c in 0..args.changes {
        let i = (c * 7919) % (namespaces * per_ns);
        let (n, k) = (i / per_ns, i % per_ns);
        let budget = format!("budget-{}", 1 + k % (budgets_per_ns - 1));
        let usage = 7 * GI + 1000 + c as u64;
        let pods: Api<Pod> = Api::namespaced(client.clone(), &ns(n));
        let t0 = Instant::now();
        agent_record(&pods, &format!("pod-{k:05}"), usage, &budget).await?;
        loop {
            let status = budget_status(&fake, &ns(n), &budget);
            if status["topPods"][0]["usageBytes"].as_u64() == Some(usage) {
                break;
            }
            anyhow::ensure!(t0.elapsed() < Duration::from_secs(30), "change {c} never converged");
            tokio::time::sleep(Duration::from_micros(500)).await;
        }
        record_samples.push(t0.elapsed());
    }

    // Label moves: a pod leaves app-k for app-j; budget-j counts one more.
    let mut move_samples = Vec::new();
    for m in 0..args.moves {
        let n = (m * 37) % namespaces;
        let k = m % per_ns;
        let from = 1 + k % (budgets_per_ns - 1);
        let to = 1 + (from % (budgets_per_ns - 1));
        let target = format!("budget-{to}");
        let before = budget_status(&fake, &ns(n), &target)["matchedPods"].as_i64().unwrap_or(0);
        let t0 = Instant::now();
        fake.modify("pods", &ns(n), &format!("pod-{k:05}"), |p| {
            p["metadata"]["labels"]["app"] = format!("app-{to}").into()
        });
        loop {
            if budget_status(&fake, &ns(n), &target)["matchedPods"].as_i64() == Some(before + 1) {
                break;
            }
            anyhow::ensure!(t0.elapsed() < Duration::from_secs(30), "move {m} never converged");
            tokio::time::sleep(Duration::from_micros(500)).await;
        }
        move_samples.push(t0.elapsed());
    }
    let (rss_end, hwm_end) = proc_status(pid);
    let metrics = http_get(admin, "/metrics").await.unwrap_or_default();
    let metric = |name: &str| {
        metrics
            .lines()
            .find(|l| l.starts_with(name))
            .and_then(|l| l.split_whitespace().last())
            .unwrap_or("?")
            .to_owned()
    };

    // Graceful stop.
    let _ = std::process::Command::new("kill").args(["-TERM", &pid.to_string()]).status();
    let exit = tokio::time::timeout(Duration::from_secs(30), child.wait()).await??;

    println!("operator scale run: {} pods, {} budgets, {namespaces} namespaces", namespaces * per_ns, args.budgets);
    println!(
        "start-up: ready after {:.2} s; all statuses written after {:.2} s ({startup_writes} status writes)",
        ready_at.unwrap_or_default().as_secs_f64(),
        converged.as_secs_f64()
    );
    println!("RSS after start-up: {:.1} MiB (peak {:.1} MiB)", mib(rss_start), mib(hwm_start));
    println!("RSS after changes:  {:.1} MiB (peak {:.1} MiB)", mib(rss_end), mib(hwm_end));
    println!("{}", summary("record change -> status", record_samples));
    println!("{}", summary("label move    -> status", move_samples));
    println!(
        "operator metrics: reconciles {}, status writes {}, pods {}, matched pods {}",
        metric("gpubudget_operator_reconciles_total"),
        metric("gpubudget_operator_status_writes_total"),
        metric("gpubudget_operator_pods "),
        metric("gpubudget_operator_matched_pods "),
    );
    println!("operator exit after SIGTERM: {exit}");
    Ok(())
}
