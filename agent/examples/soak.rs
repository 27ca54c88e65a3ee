//! Soak harness: the agent's real loop over a synthetic node for a while, measured from the OS.
//!
//! ```sh
//! cargo run -p gpubudget-agent --release --example soak -- --seconds 60            # both modes, 8 GPUs x 16 processes
//! cargo run -p gpubudget-agent --release --example soak -- --mode api --seconds 600 # the 10-minute writes check
//! ```
//!
//! The synthetic node (`gpubudget_agent::synthetic`): 8 GPUs × 16 processes = 128 processes in 64 pods,
//! each PID in a kubelet-shaped cgroup of a fixture `/proc`, a sample file listing the PIDs the way NVML
//! does, 8 budgets (16 pods Over under `action: Warn`, 16 Near, 32 Within; nothing evicts, so nothing
//! changes after the first records).
//!
//! Each mode runs in a child process of its own (this binary, re-executed), so the figures are that
//! process's alone, read by the parent from `/proc/<child>/stat`, `/proc/<child>/task/*/schedstat` and
//! `/proc/<child>/status`:
//!
//! - `standalone`: `gpubudget-agent standalone` exactly as the binary runs it (same runtime, 2 workers),
//!   decisions written as JSON lines to a file. No API client: this is the CPU and RSS figure.
//! - `api`: `gpubudget_agent::cmd::run::run_with` (the DaemonSet's loop: reflectors, API executor) against
//!   gpubudget-testkit's in-memory API server, which lives in the same process: its CPU and memory are
//!   included. This is the API-writes figure (the fake's request log).
//!
//! CPU is measured over the steady window (after `--warmup` seconds, to the end), as a percentage of one
//! core. The children count heap allocations (`stats_alloc`) over the same window.

use std::alloc::System;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail};
use clap::{Parser, Subcommand, ValueEnum};
use gpubudget_agent::cli::{Cli, RunArgs};
use gpubudget_agent::cmd::run::{CHECKS, run_with};
use gpubudget_agent::report::metrics::Metrics;
#[path = "../fixtures/synthetic.rs"]
mod synthetic;
use gpubudget_daemon::Health;
use gpubudget_testkit::{FakeApi, Verb};
use prometheus_client::registry::Registry;
use serde_json::{Value, json};
use stats_alloc::{INSTRUMENTED_SYSTEM, Region, StatsAlloc};
use synthetic::SyntheticNode;
use tokio_util::sync::CancellationToken;

#[global_allocator]
static GLOBAL: &StatsAlloc<System> = &INSTRUMENTED_SYSTEM;

const NODE: &str = "gpu-node-1";

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Mode {
    Standalone,
    Api,
    Binary,
    Both,
}

#[derive(Debug, Parser)]
struct Args {
    /// Which loop to run.
    #[arg(long, value_enum, default_value = "both")]
    mode: Mode,
    /// Length of each run.
    #[arg(long, default_value_t = 60)]
    seconds: u64,
    /// Seconds left out of the steady-state figures (start-up, first records).
    #[arg(long, default_value_t = 10)]
    warmup: u64,
    /// GPUs.
    #[arg(long, default_value_t = 8)]
    gpus: u32,
    /// Processes over all GPUs (two per pod).
    #[arg(long, default_value_t = 128)]
    processes: u32,
    /// Sampling interval in milliseconds.
    #[arg(long, default_value_t = 250)]
    interval_ms: u64,
    /// The agent binary (`--mode binary`); default: `gpubudget-agent` next to this example's directory.
    #[arg(long)]
    agent_bin: Option<PathBuf>,
    #[command(subcommand)]
    child: Option<Child>,
}

#[derive(Debug, Subcommand)]
enum Child {
    /// (internal) run one mode in this process.
    Child {
        #[arg(value_enum)]
        mode: Mode,
        dir: PathBuf,
    },
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    match &args.child {
        Some(Child::Child { mode, dir }) => child(&args, *mode, dir),
        None => parent(&args),
    }
}

/// CPU time of a process: (utime + stime from `stat`, in seconds; the sum of its threads' `schedstat`
/// run time, in seconds).
fn cpu_seconds(pid: u32) -> anyhow::Result<(f64, f64)> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))?;
    let after = &stat[stat.rfind(')').context("stat")? + 2..];
    let fields: Vec<&str> = after.split_whitespace().collect();
    // Fields 14 and 15 of the whole line are the 12th and 13th after the name.
    let ticks: u64 = fields[11].parse::<u64>()? + fields[12].parse::<u64>()?;
    let hz = clock_ticks();
    let mut sched_ns = 0u64;
    for task in std::fs::read_dir(format!("/proc/{pid}/task"))? {
        let Ok(text) = std::fs::read_to_string(task?.path().join("schedstat")) else { continue };
        sched_ns += text.split_whitespace().next().and_then(|v| v.parse::<u64>().ok()).unwrap_or(0);
    }
    Ok((ticks as f64 / hz, sched_ns as f64 / 1e9))
}

fn clock_ticks() -> f64 {
    Command::new("getconf")
        .arg("CLK_TCK")
        .output()
        .ok()
        .and_then(|o| String::from_utf8(o.stdout).ok())
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(100.0)
}

/// `VmRSS` and `VmHWM` of a process, in KiB.
fn memory_kib(pid: u32) -> anyhow::Result<(u64, u64)> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    let field = |name: &str| -> u64 {
        status
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|v| v.split_whitespace().next())
            .and_then(|v| v.parse().ok())
            .unwrap_or(0)
    };
    Ok((field("VmRSS:"), field("VmHWM:")))
}

fn parent(args: &Args) -> anyhow::Result<()> {
    if args.warmup + 5 > args.seconds {
        bail!("--seconds must exceed --warmup by at least 5");
    }
    let dir = tempfile::tempdir()?;
    let node = SyntheticNode::new(NODE, args.gpus, args.processes);
    node.write_proc(&dir.path().join("proc"))?;
    std::fs::write(dir.path().join("sample.json"), node.sample_json())?;
    std::fs::write(dir.path().join("pods.json"), node.pods_json())?;
    std::fs::write(dir.path().join("budgets.json"), node.budgets_json())?;
    println!(
        "synthetic node: {} GPUs, {} processes, {} pods, {} budgets; interval {} ms; {} s per run, steady window after {} s",
        node.gpus,
        node.processes.len(),
        node.pods.len(),
        node.budgets.len(),
        args.interval_ms,
        args.seconds,
        args.warmup
    );
    let modes = match args.mode {
        Mode::Both => vec![Mode::Standalone, Mode::Api],
        m => vec![m],
    };
    let mut results = Vec::new();
    for mode in modes {
        let result =
            if mode == Mode::Binary { measure_binary(args, dir.path())? } else { measure(args, mode, dir.path())? };
        println!("{}", serde_json::to_string_pretty(&result)?);
        results.push(result);
    }
    Ok(())
}

fn measure(args: &Args, mode: Mode, dir: &Path) -> anyhow::Result<Value> {
    let name = format!("{mode:?}").to_lowercase();
    let out = std::fs::File::create(dir.join(format!("{name}.summary")))?;
    let started = Instant::now();
    let mut child = Command::new(std::env::current_exe()?)
        .args(["--seconds", &args.seconds.to_string(), "--warmup", &args.warmup.to_string()])
        .args(["--interval-ms", &args.interval_ms.to_string()])
        .args(["--gpus", &args.gpus.to_string(), "--processes", &args.processes.to_string()])
        .arg("child")
        .arg(&name)
        .arg(dir)
        .stdout(out)
        .stderr(Stdio::inherit())
        .spawn()?;
    let pid = child.id();
    std::thread::sleep(Duration::from_secs(args.warmup));
    let (ticks0, sched0) = cpu_seconds(pid)?;
    let t0 = Instant::now();
    std::thread::sleep(Duration::from_secs(args.seconds - args.warmup - 1));
    let (ticks1, sched1) = cpu_seconds(pid)?;
    let window = t0.elapsed().as_secs_f64();
    let whole = started.elapsed().as_secs_f64();
    let (rss, hwm) = memory_kib(pid)?;
    let status = child.wait()?;
    if !status.success() {
        bail!("{name} child failed: {status}");
    }
    let summary: Value = serde_json::from_str(&std::fs::read_to_string(dir.join(format!("{name}.summary")))?)
        .context("child summary")?;
    Ok(json!({
        "mode": name,
        "steady_window_s": (window * 10.0).round() / 10.0,
        "cpu_percent_of_one_core_steady": {
            "schedstat": (sched1 - sched0) / window * 100.0,
            "utime_stime": (ticks1 - ticks0) / window * 100.0,
        },
        "cpu_percent_of_one_core_whole_run_including_start": sched1 / whole * 100.0,
        "rss_mib": rss as f64 / 1024.0,
        "peak_rss_vmhwm_mib": hwm as f64 / 1024.0,
        "child": summary,
    }))
}

fn child(args: &Args, mode: Mode, dir: &Path) -> anyhow::Result<()> {
    let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
    let interval = Duration::from_millis(args.interval_ms);
    let total = Duration::from_secs(args.seconds);
    let warmup = Duration::from_secs(args.warmup);
    let summary = match mode {
        Mode::Standalone => runtime.block_on(standalone(dir, interval, total, warmup))?,
        Mode::Api => runtime.block_on(api(dir, args, interval, total, warmup))?,
        Mode::Both | Mode::Binary => bail!("one in-process mode per child"),
    };
    println!("{summary}");
    Ok(())
}

/// Heap allocations over the steady window, from a thread that wakes at its start and end.
fn allocation_window(warmup: Duration, total: Duration) -> std::thread::JoinHandle<Value> {
    std::thread::spawn(move || {
        std::thread::sleep(warmup);
        let region = Region::new(GLOBAL);
        let window = total.saturating_sub(warmup + Duration::from_secs(1));
        std::thread::sleep(window);
        let s = region.change();
        let growth = s.bytes_allocated as i64 - s.bytes_deallocated as i64 + s.bytes_reallocated as i64;
        json!({
            "window_s": window.as_secs(),
            "allocations": s.allocations,
            "allocations_per_s": s.allocations as f64 / window.as_secs_f64(),
            "net_heap_growth_bytes": growth,
        })
    })
}

async fn standalone(dir: &Path, interval: Duration, total: Duration, warmup: Duration) -> anyhow::Result<Value> {
    let out = dir.join("standalone.jsonl");
    let interval_arg = format!("{}ms", interval.as_millis());
    let duration_arg = format!("{}s", total.as_secs());
    let p = |name: &str| dir.join(name).to_string_lossy().into_owned();
    let cli = <Cli as Parser>::try_parse_from([
        "gpubudget-agent",
        "standalone",
        "--budgets",
        &p("budgets.json"),
        "--pods",
        &p("pods.json"),
        "--node-name",
        NODE,
        "--proc-root",
        &p("proc"),
        "--sample-file",
        &p("sample.json"),
        "--interval",
        &interval_arg,
        "--duration",
        &duration_arg,
        "--output",
        &p("standalone.jsonl"),
    ])?;
    gpubudget_daemon::init_tracing(cli.log_format);
    let allocations = allocation_window(warmup, total);
    let started = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH)?.as_secs_f64();
    gpubudget_agent::dispatch(cli).await?;
    let allocations = allocations.join().map_err(|_| anyhow::anyhow!("allocation thread"))?;
    let text = std::fs::read_to_string(&out)?;
    let lines: Vec<Value> = text.lines().filter_map(|l| serde_json::from_str(l).ok()).collect();
    let kind = |v: &Value| v["kind"].as_str().unwrap_or("").to_owned();
    let steady_from = started + warmup.as_secs_f64();
    let count = |steady: bool, kinds: &[&str]| {
        lines
            .iter()
            .filter(|v| kinds.contains(&kind(v).as_str()))
            .filter(|v| (v["ts_unix"].as_f64().unwrap_or(0.0) >= steady_from) == steady)
            .count()
    };
    let writes = ["apply", "clear", "event", "evict"];
    Ok(json!({
        "decisions_before_steady": {"transitions": count(false, &["transition"]), "writes": count(false, &writes)},
        "decisions_in_steady_state": {"transitions": count(true, &["transition"]), "writes": count(true, &writes)},
        "stats": lines.iter().rev().find(|v| kind(v) == "stats"),
        "heap": allocations,
    }))
}

/// An in-memory API server holding the synthetic pods and budgets, and a fixture `/proc` at `proc-api`
/// whose cgroups name the UIDs the server gave the pods.
fn load_fake(dir: &Path, opts: &Args) -> anyhow::Result<FakeApi> {
    let fake = FakeApi::new();
    let pods: Value = serde_json::from_str(&std::fs::read_to_string(dir.join("pods.json"))?)?;
    let budgets: Value = serde_json::from_str(&std::fs::read_to_string(dir.join("budgets.json"))?)?;
    for item in pods["items"].as_array().into_iter().flatten().chain(budgets["items"].as_array().into_iter().flatten())
    {
        fake.put_object(item.clone())?;
    }
    // The in-memory API server gives every new object a UID of its own: the fixture /proc of this run
    // names the UIDs the pods got.
    let mut node = SyntheticNode::new(NODE, opts.gpus, opts.processes);
    for pod in &node.pods {
        let name = pod.metadata.name.clone().unwrap_or_default();
        let ours = pod.metadata.uid.clone().unwrap_or_default();
        let live = fake.get("pods", "team-a", &name).context("pod stored")?["metadata"]["uid"]
            .as_str()
            .context("uid")?
            .to_owned();
        for p in &mut node.processes {
            p.cgroup = p.cgroup.replace(&ours, &live).replace(&ours.replace('-', "_"), &live.replace('-', "_"));
        }
    }
    node.write_proc(&dir.join("proc-api"))?;
    Ok(fake)
}

fn is_write(verb: Verb) -> bool {
    matches!(verb, Verb::Create | Verb::Update | Verb::Patch | Verb::Delete | Verb::DeleteCollection)
}

fn writes_by_kind(fake: &FakeApi) -> Value {
    let mut out = serde_json::Map::new();
    for r in fake.requests().iter().filter(|r| is_write(r.verb)) {
        let key = format!(
            "{} {}{}",
            r.verb.as_str(),
            r.resource,
            r.subresource.as_deref().map(|s| format!("/{s}")).unwrap_or_default()
        );
        let n = out.get(&key).and_then(Value::as_u64).unwrap_or(0) + 1;
        out.insert(key, json!(n));
    }
    Value::Object(out)
}

async fn api(dir: &Path, opts: &Args, interval: Duration, total: Duration, warmup: Duration) -> anyhow::Result<Value> {
    gpubudget_daemon::init_tracing(gpubudget_daemon::LogFormat::Text);
    let fake = load_fake(dir, opts)?;
    let mut registry = Registry::default();
    let metrics = Metrics::new(&mut registry);
    let health = Health::new(&CHECKS);
    let shutdown = CancellationToken::new();
    let args = RunArgs::replay(NODE, dir.join("proc-api"), dir.join("sample.json"), interval);
    let allocations = allocation_window(warmup, total);
    let task = tokio::spawn(run_with(args, fake.client(), health.clone(), metrics, shutdown.clone()));
    tokio::time::sleep(warmup).await;
    let ready_at_warmup_end = health.is_ready();
    let before = writes_by_kind(&fake);
    let requests_before = fake.requests().len();
    fake.clear_requests();
    tokio::time::sleep(total.saturating_sub(warmup)).await;
    let after = writes_by_kind(&fake);
    let requests_after = fake.requests().len();
    shutdown.cancel();
    task.await?;
    let allocations = allocations.join().map_err(|_| anyhow::anyhow!("allocation thread"))?;
    let mut text = String::new();
    prometheus_client::encoding::text::encode(&mut text, &registry)?;
    let samples = text
        .lines()
        .find(|l| l.starts_with("gpubudget_sample_duration_seconds_count"))
        .and_then(|l| l.split_whitespace().last())
        .map(str::to_owned);
    Ok(json!({
        "ready_after_warmup": ready_at_warmup_end,
        "api_writes_before_steady": before,
        "api_requests_before_steady": requests_before,
        "api_writes_in_steady_state": after,
        "api_requests_in_steady_state": requests_after,
        "ticks": samples,
        "heap": allocations,
    }))
}

/// Serves `fake` over HTTP on 127.0.0.1 (watches stream); returns the address.
async fn serve(fake: FakeApi) -> anyhow::Result<std::net::SocketAddr> {
    use tower::Service as _;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    tokio::spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            let svc = fake.service();
            tokio::spawn(async move {
                let handler = hyper::service::service_fn(move |req: hyper::Request<hyper::body::Incoming>| {
                    let mut svc = svc.clone();
                    async move {
                        use http_body_util::BodyExt as _;
                        let (parts, body) = req.into_parts();
                        let bytes = body.collect().await.map(|c| c.to_bytes()).unwrap_or_default();
                        svc.call(hyper::Request::from_parts(parts, kube::client::Body::from(bytes))).await
                    }
                });
                let io = hyper_util::rt::TokioIo::new(stream);
                let _ = hyper::server::conn::http1::Builder::new().serve_connection(io, handler).await;
            });
        }
    });
    Ok(addr)
}

/// `--mode binary`: the real `gpubudget-agent run` as a child, against the in-memory API server in this
/// process, reached over HTTP: the child's CPU and memory are the agent's alone, API client included.
fn measure_binary(args: &Args, dir: &Path) -> anyhow::Result<Value> {
    let bin = match &args.agent_bin {
        Some(b) => b.clone(),
        None => std::env::current_exe()?.parent().and_then(Path::parent).context("exe dir")?.join("gpubudget-agent"),
    };
    let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
    let fake = load_fake(dir, args)?;
    let addr = runtime.block_on(serve(fake.clone()))?;
    let kubeconfig = dir.join("kubeconfig");
    std::fs::write(
        &kubeconfig,
        format!(
            "apiVersion: v1\nkind: Config\nclusters: [{{name: fake, cluster: {{server: 'http://{addr}'}}}}]\n\
             users: [{{name: fake, user: {{}}}}]\ncontexts: [{{name: fake, context: {{cluster: fake, user: fake}}}}]\n\
             current-context: fake\n"
        ),
    )?;
    let started = Instant::now();
    let mut child = Command::new(&bin)
        .env("KUBECONFIG", &kubeconfig)
        .env("RUST_LOG", "warn")
        .args(["run", "--node-name", NODE, "--admin-addr", "127.0.0.1:0"])
        .arg("--interval")
        .arg(format!("{}ms", args.interval_ms))
        .arg("--proc-root")
        .arg(dir.join("proc-api"))
        .arg("--sample-file")
        .arg(dir.join("sample.json"))
        .stdout(Stdio::null())
        .stderr(Stdio::inherit())
        .spawn()
        .with_context(|| format!("cannot start {}", bin.display()))?;
    let pid = child.id();
    std::thread::sleep(Duration::from_secs(args.warmup));
    let before = writes_by_kind(&fake);
    let requests_before = fake.requests().len();
    fake.clear_requests();
    let (ticks0, sched0) = cpu_seconds(pid)?;
    let t0 = Instant::now();
    std::thread::sleep(Duration::from_secs(args.seconds - args.warmup - 1));
    let (ticks1, sched1) = cpu_seconds(pid)?;
    let window = t0.elapsed().as_secs_f64();
    let whole = started.elapsed().as_secs_f64();
    let (rss, hwm) = memory_kib(pid)?;
    let after = writes_by_kind(&fake);
    let requests_after = fake.requests().len();
    child.kill()?;
    child.wait()?;
    Ok(json!({
        "mode": "binary",
        "agent": bin.display().to_string(),
        "steady_window_s": (window * 10.0).round() / 10.0,
        "cpu_percent_of_one_core_steady": {
            "schedstat": (sched1 - sched0) / window * 100.0,
            "utime_stime": (ticks1 - ticks0) / window * 100.0,
        },
        "cpu_percent_of_one_core_whole_run_including_start": sched1 / whole * 100.0,
        "rss_mib": rss as f64 / 1024.0,
        "peak_rss_vmhwm_mib": hwm as f64 / 1024.0,
        "api_writes_before_steady": before,
        "api_requests_before_steady": requests_before,
        "api_writes_in_steady_state": after,
        "api_requests_in_steady_state": requests_after,
    }))
}
