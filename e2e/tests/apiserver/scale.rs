//! The footprint measurements (formerly scale.sh, scale-operator.sh and load.py): not pass/fail stories but figures
//! for docs/performance.md, printed as `RESULT` lines; they fail only when what they wait for never comes.
//!
//! - [`agent`]: N budgets in the cluster and the operator running, then for each pod count a Node with that many
//!   pods and a fresh agent bound to it (the chart's RBAC and admission policies, a node-bound token), which writes
//!   every pod's first record at once: its resident memory (peak and settled), its TCP connections to the API
//!   server (most at once while writing, and 5 s after), the time until every pod had its record, the bytes its
//!   watches received, its table rebuilds; then its CPU over an idle window, whether it reads the mirrors only,
//!   optional streams of budget writes and optional write-load phases. The budgets are all Within (no events, no
//!   evictions): what is measured is the records.
//! - [`operator`]: the operator at 10 000 pods and 1 000 budgets (the workload of operator/examples/scale.rs):
//!   time until `/ready` and until every budget has a status, RSS, status writes in an idle window, record → status
//!   latency, and optionally the API server's own rate for the same status writes without the operator.

use std::collections::{BTreeMap, HashSet};
use std::future::Future;
use std::process::Command;
use std::str::FromStr;
use std::sync::Mutex;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use futures::{StreamExt, stream};
use gpubudget_common::GpuMemoryBudget;
use gpubudget_demo::stack::SampleFile;
use k8s_openapi::api::core::v1::{Node, Pod};
use kube::api::{Api, ApiResource, DeleteParams, DynamicObject, ListParams, Patch, PatchParams, PostParams};
use kube::{Client, ResourceExt};
use serde_json::{Value, json};

use crate::harness::{
    Binary, GI, Identity, OperatorRun, RBAC_AND_POLICIES, Run, http_get, latencies, metric, metrics, mirrors_lease,
};

/// The agent measurement's tenant namespaces.
const TEAMS: usize = 10;

// --- options and bulk requests

/// The environment variable `name` parsed, else `default`.
fn env_or<T: FromStr>(name: &str, default: T) -> T {
    std::env::var(name).ok().and_then(|v| v.trim().parse().ok()).unwrap_or(default)
}

/// The whitespace-separated words of the environment variable `name`.
fn env_words(name: &str) -> Vec<String> {
    std::env::var(name).unwrap_or_default().split_whitespace().map(str::to_owned).collect()
}

/// Runs `jobs`, `at_once` at a time (the load's fixed concurrency); a job that fails panics.
async fn at_once<F: Future<Output = ()>>(at_once: usize, jobs: impl IntoIterator<Item = F>) {
    stream::iter(jobs).buffer_unordered(at_once).collect::<Vec<()>>().await;
}

/// `request` retried (five tries, 0.2 s more between each) when the API server is busy (429, 5xx) or the
/// connection fails; any other refusal fails at once.
async fn retried<T, Fut: Future<Output = kube::Result<T>>>(what: &str, mut request: impl FnMut() -> Fut) -> T {
    let mut attempt = 0;
    loop {
        attempt += 1;
        match request().await {
            Ok(t) => return t,
            Err(kube::Error::Api(s)) if s.code != 429 && s.code < 500 => panic!("{what}: {} {}", s.code, s.message),
            Err(e) if attempt >= 5 => panic!("{what}: gave up: {e}"),
            Err(_) => tokio::time::sleep(Duration::from_millis(200 * attempt)).await,
        }
    }
}

/// The budgets of `ns` (all namespaces without), as dynamic objects.
fn budgets_api(client: &Client, ns: Option<&str>) -> Api<DynamicObject> {
    let resource = ApiResource::erase::<GpuMemoryBudget>(&());
    match ns {
        Some(ns) => Api::namespaced_with(client.clone(), ns, &resource),
        None => Api::all_with(client.clone(), &resource),
    }
}

/// A budget `name` in `ns` selecting `selector`, with `limit` and a 30 s grace.
async fn create_budget(client: &Client, ns: &str, name: &str, selector: Value, limit: &str) {
    let budget: DynamicObject = serde_json::from_value(json!({"apiVersion": "gpubudget.io/v1alpha1",
        "kind": "GpuMemoryBudget", "metadata": {"name": name, "namespace": ns},
        "spec": {"selector": selector, "limit": limit, "evictionGracePeriodSeconds": 30}}))
    .expect("a budget");
    let api = budgets_api(client, Some(ns));
    retried(&format!("budget {ns}/{name}"), || async { api.create(&PostParams::default(), &budget).await }).await;
}

/// Merge-patches the spec of every budget of `names` with `spec`, 8 at a time: a fleet-wide edit, as an admin's
/// script or a GitOps sync of every budget would make it.
async fn edit_all(run: &Run, names: &[(String, String)], spec: Value) {
    let t0 = Instant::now();
    let patch = json!({"spec": spec});
    at_once(
        8,
        names.iter().map(|(ns, name)| {
            let (api, patch) = (budgets_api(&run.admin, Some(ns)), &patch);
            async move {
                retried(name, || async { api.patch(name, &PatchParams::default(), &Patch::Merge(patch)).await }).await;
            }
        }),
    )
    .await;
    run.info(&format!("{} budgets patched with {spec} in {:.1} s", names.len(), t0.elapsed().as_secs_f64()));
}

/// Seconds since 1970 (for values no earlier run wrote).
fn unix() -> Duration {
    SystemTime::now().duration_since(UNIX_EPOCH).expect("after 1970")
}

// --- what the process spends, from /proc and ss

/// A `/proc/<pid>/status` field in kB (`VmRSS`, `VmHWM`).
fn status_kib(status: &str, key: &str) -> u64 {
    status
        .lines()
        .find_map(|l| l.strip_prefix(key)?.strip_prefix(':')?.split_whitespace().next()?.parse().ok())
        .unwrap_or(0)
}

/// A process's `VmRSS` or `VmHWM` in MiB.
fn mib(pid: u32, key: &str) -> f64 {
    status_kib(&std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default(), key) as f64 / 1024.0
}

/// User and system CPU time in clock ticks (10 ms) from a `/proc/<pid>/stat` line: fields 14 and 15, counted after
/// the command's closing parenthesis (which may hold spaces).
fn stat_ticks(stat: &str) -> u64 {
    let after = stat.rsplit_once(')').map_or("", |(_, rest)| rest);
    let fields: Vec<&str> = after.split_whitespace().collect();
    [11, 12].iter().filter_map(|&i| fields.get(i)?.parse::<u64>().ok()).sum()
}

/// A process's CPU time in ms (10 ms resolution).
fn cpu_ms(pid: u32) -> u64 {
    stat_ticks(&std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default()) * 10
}

/// The CPU time of a process's threads alive now, in µs (the scheduler's nanosecond account,
/// `/proc/<pid>/task/*/schedstat`; a thread that exited is not in it, so [`threads`] is printed with it).
fn cpu_us(pid: u32) -> u64 {
    let tasks = std::fs::read_dir(format!("/proc/{pid}/task")).into_iter().flatten().flatten();
    let ns: u64 = tasks
        .filter_map(|t| std::fs::read_to_string(t.path().join("schedstat")).ok())
        .filter_map(|s| s.split_whitespace().next()?.parse::<u64>().ok())
        .sum();
    ns / 1000
}

/// A process's threads.
fn threads(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/task")).map_or(0, |d| d.count())
}

/// `ss`'s established TCP connections to the API server's port, with their processes (`info`: and TCP info).
fn ss(api_port: u16, info: bool) -> String {
    let out = Command::new("ss")
        .args([if info { "-tnpiH" } else { "-tnpH" }, "state", "established", &format!("( dport = :{api_port} )")])
        .output()
        .expect("ss runs");
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// `(local port, bytes received)` of each of `pid`'s connections in the output of `ss -tnpiH`: a socket's line
/// names the process, the next line with `bytes_received:` is its TCP info.
fn sockets_of(ss: &str, pid: u32) -> BTreeMap<String, u64> {
    let tag = format!("pid={pid},");
    let (mut port, mut sockets) = (None, BTreeMap::new());
    for line in ss.lines() {
        if line.contains(&tag) {
            port = line.split_whitespace().nth(2).and_then(|local| local.rsplit(':').next()).map(str::to_owned);
        } else if let (Some(p), Some(at)) = (&port, line.find("bytes_received:")) {
            let digits: String = line[at + 15..].chars().take_while(char::is_ascii_digit).collect();
            sockets.insert(p.clone(), digits.parse().unwrap_or(0));
            port = None;
        }
    }
    sockets
}

/// Bytes received since `before` on the connections open in `now`; one that closed in between (an idle write
/// connection leaves the pool after 90 s) is not counted.
fn received_since(before: &BTreeMap<String, u64>, now: &BTreeMap<String, u64>) -> i64 {
    now.iter().map(|(port, &bytes)| bytes as i64 - before.get(port).copied().unwrap_or(0) as i64).sum()
}

/// The process's connections to the API server now.
fn connections(api_port: u16, pid: u32) -> usize {
    let tag = format!("pid={pid},");
    ss(api_port, false).lines().filter(|l| l.contains(&tag)).count()
}

// --- metrics

/// The value of the metric line named exactly `name` (labels included), 0 when missing.
fn value(text: &str, name: &str) -> f64 {
    metric(text, &format!("{name} ")).and_then(|v| v.parse().ok()).unwrap_or(0.0)
}

/// The sum of every series of the metric `name` (whatever its labels).
fn sum(text: &str, name: &str) -> f64 {
    text.lines()
        .filter(|l| l.strip_prefix(name).is_some_and(|rest| rest.starts_with(['{', ' '])))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum::<f64>()
        + 0.0 // an empty sum is -0
}

/// The agent's API writes so far by kind (`gpubudget_api_writes_total`), and `all`.
fn writes_by_kind(text: &str) -> BTreeMap<String, f64> {
    let mut kinds = BTreeMap::new();
    for line in text.lines().filter(|l| l.starts_with("gpubudget_api_writes_total{")) {
        let Some(kind) = line.split("kind=\"").nth(1).and_then(|rest| rest.split('"').next()) else { continue };
        let n: f64 = line.rsplit(' ').next().and_then(|v| v.parse().ok()).unwrap_or(0.0);
        *kinds.entry(kind.to_owned()).or_insert(0.0) += n;
        *kinds.entry("all".to_owned()).or_insert(0.0) += n;
    }
    kinds
}

/// Each kind's writes between two [`writes_by_kind`] readings, per minute: `apply=12/min all=12/min `.
fn per_minute(before: &BTreeMap<String, f64>, after: &BTreeMap<String, f64>, secs: f64) -> String {
    let all = after.get("all").copied().unwrap_or(0.0) - before.get("all").copied().unwrap_or(0.0);
    let kinds = after.iter().filter(|(k, _)| *k != "all");
    let mut line: String = kinds
        .map(|(k, n)| format!("{k}={:.0}/min ", (n - before.get(k).copied().unwrap_or(0.0)) * 60.0 / secs))
        .collect();
    line.push_str(&format!("all={:.0}/min ", all * 60.0 / secs));
    line
}

// --- the agent

/// What the agent measurement holds across its pod counts.
struct AgentScale {
    ns: String,
    release: String,
    /// The budgets the agent's node can see (with the elsewhere stream's 100).
    budgets: usize,
    names: Vec<(String, String)>,
    elsewhere: Vec<(String, String)>,
    operator_identity: Identity,
    operator_admin: String,
    agent_admin: String,
    api_port: u16,
    results: Vec<String>,
}

impl AgentScale {
    fn result(&mut self, run: &Run, line: String) {
        run.info(&line);
        self.results.push(line);
    }

    fn start_operator(&self, run: &Run) -> Binary {
        let lease = mirrors_lease(&self.release);
        run.spawn_operator(&OperatorRun {
            identity: &self.operator_identity,
            ns: &self.ns,
            pod: "scale-operator",
            admin: &self.operator_admin,
            webhook: None,
            extra: &["--mirrors-lease-name", &lease],
            rust_log: "info",
            log: "operator.log",
        })
    }

    async fn agent_metric(&self, name: &str) -> f64 {
        value(&metrics(&self.agent_admin).await, name)
    }
}

/// The agent's footprint (formerly scale.sh). Options: `GPUBUDGET_E2E_PODS` (the pod counts, default "110 1000"),
/// `GPUBUDGET_E2E_BUDGETS` (1000), `GPUBUDGET_E2E_STREAM` ("status spec elsewhere": the streams after each count;
/// elsewhere: spec changes of 100 budgets in a namespace without pods on the node), `GPUBUDGET_E2E_STREAM_RATE`
/// (writes a second, 20), `GPUBUDGET_E2E_WRITES=1` (the write-load phases, [`write_load`]),
/// `GPUBUDGET_E2E_IDLE_SECONDS` (30: the idle CPU window), `GPUBUDGET_E2E_SETTLE_SECONDS` (0: a wait before it, for
/// the operator's status writes that the records cause to reach the agent first), `GPUBUDGET_E2E_PERF=PREFIX` (a
/// perf profile of the idle window, `PREFIX-BUDGETS.data`).
pub async fn agent() {
    let counts: Vec<usize> = env_words("GPUBUDGET_E2E_PODS").iter().filter_map(|w| w.parse().ok()).collect();
    let counts = if counts.is_empty() { vec![110, 1000] } else { counts };
    let budgets: usize = env_or("GPUBUDGET_E2E_BUDGETS", 1000);
    let streams = env_words("GPUBUDGET_E2E_STREAM");
    let mut run = Run::start("gpubudget-apiserver-scale", &["gpubudget-operator", "gpubudget-agent"]).await;
    let ns = format!("gpubudget-scale-{}", run.id);
    let release = ns.clone();
    run.say(&format!("CRD, the chart's RBAC and admission policies; {budgets} budgets in {TEAMS} namespaces"));
    run.namespace(&ns).await;
    run.apply_crds().await;
    run.apply_chart(&release, &ns, RBAC_AND_POLICIES, None).await;
    for t in 0..TEAMS {
        run.namespace(&format!("{ns}-t{t}")).await;
    }
    // Budget i: namespace t(i % TEAMS), selects app=app-(i / TEAMS); the limits are far above the usage. Four at a
    // time (as four kubectl, each creating one object at a time).
    let names: Vec<(String, String)> =
        (0..budgets).map(|i| (format!("{ns}-t{}", i % TEAMS), format!("budget-{i}"))).collect();
    let t0 = Instant::now();
    at_once(
        4,
        names.iter().enumerate().map(|(i, (bns, name))| {
            let selector = json!({"matchLabels": {"app": format!("app-{}", i / TEAMS)}});
            create_budget(&run.admin, bns, name, selector, "40Gi")
        }),
    )
    .await;
    run.info(&format!("{budgets} budgets created in {} s", t0.elapsed().as_secs()));
    let mut elsewhere = Vec::new();
    if streams.iter().any(|s| s == "elsewhere") {
        // 100 more in a namespace without pods on any measured node: their spec changes must rebuild nothing there.
        let other = run.namespace(&format!("{ns}-elsewhere")).await;
        elsewhere = (0..100).map(|i| (other.clone(), format!("budget-{i}"))).collect();
        for (bns, name) in &elsewhere {
            create_budget(&run.admin, bns, name, json!({}), "40Gi").await;
        }
    }
    let kubeconfig = kube::Config::infer().await.expect("the admin's config");
    let token = run.token(&ns, &format!("{release}-operator"), None).await;
    let mut scale = AgentScale {
        budgets: budgets + elsewhere.len(),
        names,
        elsewhere,
        operator_identity: run.identity("scale-operator", &token).await,
        operator_admin: run.addr(1),
        agent_admin: run.addr(2),
        api_port: kubeconfig.cluster_url.port_u16().unwrap_or(443),
        results: Vec::new(),
        ns,
        release,
    };

    // The operator runs throughout (its ServiceAccount's token), so the budgets carry a status as they would in a
    // cluster, and the agents' budget watches see its writes.
    let t0 = Instant::now();
    let mut operator = scale.start_operator(&run);
    let all = budgets_api(&run.admin, None);
    let with_status = || async {
        let list = all.list(&ListParams::default()).await.expect("budgets listed");
        let ours = list.items.iter().filter(|b| b.namespace().is_some_and(|n| n.starts_with(&scale.ns)));
        ours.filter(|b| !b.data["status"]["observedGeneration"].is_null()).count()
    };
    run.timed_within("every budget has a status", t0, Duration::from_secs(600), || async {
        with_status().await >= scale.budgets
    })
    .await;
    run.info(&format!(
        "operator: every budget has a status {} s after its start; RSS {:.1} MiB",
        t0.elapsed().as_secs(),
        mib(operator.pid(), "VmRSS")
    ));

    for pods in counts {
        measure(&mut run, &mut scale, &mut operator, &format!("n{pods}"), pods).await;
    }
    run.say(&format!("results ({})", run.bin().display()));
    for line in &scale.results {
        run.info(line);
    }
    run.info(&format!("operator RSS at the end: {:.1} MiB", mib(operator.pid(), "VmRSS")));
}

/// A node with `pods` pods (pod j: namespace t(j % TEAMS), app=app-((j / TEAMS) % (budgets / TEAMS))) and a fresh
/// agent bound to it.
async fn measure(run: &mut Run, s: &mut AgentScale, operator: &mut Binary, label: &str, pods: usize) {
    let node = format!("gpubudget-scale-{}-{label}", run.id);
    run.say(&format!("{label}: {pods} pods on node {node}"));
    let node_uid = run.node(&node).await;
    let per_team = (s.budgets / TEAMS).max(1);
    let all_pods: Vec<(String, String)> =
        (0..pods).map(|j| (format!("{}-t{}", s.ns, j % TEAMS), format!("{node}-p{j}"))).collect();
    let t0 = Instant::now();
    // One at a time, as `kubectl create -f` of a list.
    for (j, (pns, name)) in all_pods.iter().enumerate() {
        create_pod(&run.admin, pns, name, &format!("app-{}", (j / TEAMS) % per_team), &node).await;
    }
    run.info(&format!("{pods} pods created in {} s", t0.elapsed().as_secs()));
    let sample = SampleFile::new(run.file(&format!("sample-{label}.json")));
    usage(&sample, &all_pods, 1.0, 0);
    let token = run.token(&s.ns, &format!("{}-agent", s.release), Some((&node, &node_uid))).await;
    let identity = run.identity(&format!("scale-agent-{label}"), &token).await;
    let started = Instant::now();
    let lease = format!("{}/{}", s.ns, mirrors_lease(&s.release));
    let proc_root = run.proc_root();
    let args: [&str; 13] = [
        "run",
        "--node-name",
        &node,
        "--proc-root",
        proc_root.to_str().expect("utf-8"),
        "--sample-file",
        sample.path().to_str().expect("utf-8"),
        "--interval",
        "250ms",
        "--admin-addr",
        &s.agent_admin,
        "--mirrors-lease",
        &lease,
    ];
    let env = [("KUBECONFIG", identity.path()), ("RUST_LOG", "info")];
    let mut agent = run.spawn("gpubudget-agent", &args, &env, &format!("agent-{label}.log"));
    let pid = agent.pid();
    // Every 200 ms until every pod has its record: connections to the API server.
    let (mut max_conn, mut done_at) = (0, None);
    while started.elapsed() < Duration::from_secs(300) {
        max_conn = max_conn.max(connections(s.api_port, pid));
        let applies = s.agent_metric("gpubudget_api_writes_total{kind=\"apply\",result=\"ok\"}").await;
        // Every pod's first record; without budgets there is none to write, so the agent being ready will do.
        let ready = s.budgets == 0 && http_get(&s.agent_admin, "/ready").await.is_some_and(|(code, _)| code == 200);
        if applies >= pods as f64 || ready {
            done_at = Some(started.elapsed().as_secs());
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let peak_during = mib(pid, "VmHWM");
    tokio::time::sleep(Duration::from_secs(5)).await;
    let conn = connections(s.api_port, pid);
    let rss = mib(pid, "VmRSS");
    let on_node = Api::<Pod>::all(run.admin.clone())
        .list(&ListParams::default().fields(&format!("spec.nodeName={node}")))
        .await
        .expect("pods listed");
    let recorded = on_node.items.iter().filter(|p| p.annotations().contains_key("gpubudget.io/state")).count();
    let m = metrics(&s.agent_admin).await;
    let received: u64 = sockets_of(&ss(s.api_port, true), pid).values().sum();
    s.result(
        run,
        format!(
            "RESULT {label:<6} pods={pods:<5} budgets={} records={recorded}/{pods} in {}s  peak_rss={peak_during:.1}MiB  \
             rss_5s_after={rss:.1}MiB  max_conns={max_conn}  conns_5s_after={conn}  apply_errors={}  \
             received={:.1}MiB  rebuilds={}",
            s.budgets,
            done_at.map_or("timeout".to_owned(), |t| t.to_string()),
            value(&m, "gpubudget_api_writes_total{kind=\"apply\",result=\"error\"}"),
            received as f64 / 1_048_576.0,
            value(&m, "gpubudget_pod_table_rebuilds_total"),
        ),
    );
    idle(run, s, pid, label).await;
    // #34: with the operator's mirrors the agent closes its budget watch once every budget is mirrored; the streams
    // below then measure what reaches it with the mirrors alone.
    let mut waited = 0;
    let mirrored = "gpubudget_budget_specs_from_mirrors{kind=\"GpuMemoryBudget\"}";
    while s.agent_metric(mirrored).await != 1.0 && waited < 60 && s.budgets != 0 {
        tokio::time::sleep(Duration::from_secs(1)).await;
        waited += 1;
    }
    let only_mirrors = if s.agent_metric(mirrored).await == 1.0 { "yes" } else { "no" };
    let mirror_writes =
        value(&metrics(&s.operator_admin).await, "gpubudget_operator_mirror_writes_total{result=\"written\"}");
    s.result(
        run,
        format!(
            "MIRRORS {label:<6} budgets={}  agent reads the mirrors only: {only_mirrors} (waited {waited} s)  operator \
             mirror writes: {mirror_writes}",
            s.budgets
        ),
    );
    for kind in env_words("GPUBUDGET_E2E_STREAM") {
        stream_budget_writes(run, s, pid, label, &kind).await;
    }
    if std::env::var("GPUBUDGET_E2E_WRITES").as_deref() == Ok("1") {
        write_load(run, s, operator, (label, pid), &all_pods, &sample).await;
    }
    agent.stop();
}

/// A pod `name` in `ns` on `node` labelled app=`app` (no kubelet: no status), its container `main`.
async fn create_pod(client: &Client, ns: &str, name: &str, app: &str, node: &str) {
    let pod: Pod = serde_json::from_value(json!({"apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": ns, "labels": {"app": app}},
        "spec": {"nodeName": node, "terminationGracePeriodSeconds": 30,
                 "containers": [{"name": "main", "image": "registry.k8s.io/pause:3.10"}]}}))
    .expect("a pod");
    let api = Api::<Pod>::namespaced(client.clone(), ns);
    retried(&format!("pod {ns}/{name}"), || async { api.create(&PostParams::default(), &pod).await }).await;
}

/// The replayed sample: pod j holds (1 + j % 8) GiB × `factor`; with `crossing` (30, 37 or 42 GiB: Within, Near,
/// Over of the 40Gi budgets) every tenth pod holds that instead.
fn usage(sample: &SampleFile, pods: &[(String, String)], factor: f64, crossing: u64) {
    let entries: Vec<(&str, &str, &str, u64)> = pods
        .iter()
        .enumerate()
        .map(|(j, (ns, pod))| {
            let gib = if crossing > 0 && j % 10 == 0 { crossing as f64 } else { (1 + j % 8) as f64 * factor };
            (ns.as_str(), pod.as_str(), "main", (gib * GI as f64) as u64)
        })
        .collect();
    sample.set_named_usage(&entries);
}

/// The agent's CPU over the idle window with nothing changing (sampling, replayed, and deciding every 250 ms): at
/// 10 ms resolution, in the scheduler's µs, and split into the time inside its ticks
/// (`gpubudget_sample_duration_seconds`: sample, attribution, decisions and metrics) and outside.
async fn idle(run: &Run, s: &mut AgentScale, pid: u32, label: &str) {
    let idle: u64 = env_or("GPUBUDGET_E2E_IDLE_SECONDS", 30);
    let settle: u64 = env_or("GPUBUDGET_E2E_SETTLE_SECONDS", 0);
    tokio::time::sleep(Duration::from_secs(settle)).await;
    let m0 = metrics(&s.agent_admin).await;
    let (c0, u0, th0) = (cpu_ms(pid), cpu_us(pid), threads(pid));
    let sockets0 = sockets_of(&ss(s.api_port, true), pid);
    if let Ok(prefix) = std::env::var("GPUBUDGET_E2E_PERF") {
        // A CPU profile over the window (perf's samples add to the CPU measured).
        let out = format!("{prefix}-{}.data", s.budgets);
        let secs = idle.to_string();
        let perf: [&str; 12] =
            ["record", "-q", "-F", "4999", "-g", "-p", &pid.to_string(), "-o", &out, "--", "sleep", &secs];
        let perf = perf.map(str::to_owned);
        let status = tokio::task::spawn_blocking(move || {
            Command::new("perf").args(perf).stderr(std::process::Stdio::null()).status()
        })
        .await;
        match status {
            Ok(Ok(status)) if status.success() => run.info(&format!("perf profile of the window: {out}")),
            other => run.info(&format!("no perf profile: {other:?}")),
        }
    } else {
        tokio::time::sleep(Duration::from_secs(idle)).await;
    }
    let m1 = metrics(&s.agent_admin).await;
    let us = cpu_us(pid).saturating_sub(u0);
    let ticks =
        value(&m1, "gpubudget_sample_duration_seconds_count") - value(&m0, "gpubudget_sample_duration_seconds_count");
    let tick_us = (value(&m1, "gpubudget_sample_duration_seconds_sum")
        - value(&m0, "gpubudget_sample_duration_seconds_sum"))
        * 1e6;
    let received = received_since(&sockets0, &sockets_of(&ss(s.api_port, true), pid));
    s.result(
        run,
        format!(
            "IDLE   {label:<6} budgets={}  agent_cpu={}ms in {idle} s ({} ticks) after {settle} s settling, received \
             {received} bytes",
            s.budgets,
            cpu_ms(pid) - c0,
            idle * 4
        ),
    );
    let ticks_n = (ticks as u64).max(1);
    s.result(
        run,
        format!(
            "IDLE   {label:<6} budgets={}  agent_cpu_us={us} (threads {th0} -> {})  ticks={ticks}  inside_ticks_us={:.0}  \
             per_tick_us={}  outside_per_tick_us={}  table_rebuilds={}",
            s.budgets,
            threads(pid),
            tick_us,
            us / ticks_n,
            (us as f64 - tick_us) as i64 / ticks_n as i64,
            value(&m1, "gpubudget_pod_table_rebuilds_total") - value(&m0, "gpubudget_pod_table_rebuilds_total"),
        ),
    );
}

/// A steady stream of budget writes for 30 s at `GPUBUDGET_E2E_STREAM_RATE` (20/s), round robin, one at a time:
/// `status` patches status.matchedPods (what the operator's status writes look like to a watcher); `spec` sets
/// spec.overLimitSeconds to a value no earlier write gave (a change of what is enforced); `elsewhere`: spec changes
/// of budgets in a namespace without pods on the node. Then what the agent received, rebuilt and spent on them.
async fn stream_budget_writes(run: &Run, s: &mut AgentScale, pid: u32, label: &str, kind: &str) {
    let rate: f64 = env_or("GPUBUDGET_E2E_STREAM_RATE", 20.0);
    let sockets0 = sockets_of(&ss(s.api_port, true), pid);
    let (r0, c0) = (s.agent_metric("gpubudget_pod_table_rebuilds_total").await, cpu_ms(pid));
    let (names, status) = match kind {
        "elsewhere" => (&s.elsewhere, false),
        "status" => (&s.names, true),
        _ => (&s.names, false),
    };
    let (t0, mut i) = (Instant::now(), 0usize);
    while t0.elapsed() < Duration::from_secs(30) {
        let (ns, name) = &names[i % names.len()];
        let api = budgets_api(&run.admin, Some(ns));
        if status {
            let patch = json!({"status": {"matchedPods": 1000 + i}});
            retried(name, || async { api.patch_status(name, &PatchParams::default(), &Patch::Merge(&patch)).await })
                .await;
        } else {
            let patch = json!({"spec": {"overLimitSeconds": 30 + (unix().as_millis() % 1_000_000) as u64}});
            retried(name, || async { api.patch(name, &PatchParams::default(), &Patch::Merge(&patch)).await }).await;
        }
        i += 1;
        let next = t0 + Duration::from_secs_f64(i as f64 / rate);
        tokio::time::sleep_until(next.into()).await;
    }
    let elapsed = t0.elapsed().as_secs_f64();
    run.info(&format!("{i} {kind} writes in {elapsed:.1} s ({:.1}/s)", i as f64 / elapsed));
    tokio::time::sleep(Duration::from_secs(1)).await;
    let received = received_since(&sockets0, &sockets_of(&ss(s.api_port, true), pid));
    s.result(
        run,
        format!(
            "STREAM {label:<6} {kind:<6} {rate}/s for 30 s: received={:.1}KiB  rebuilds=+{}  agent_cpu={}ms  \
             rss={:.1}MiB  peak_rss={:.1}MiB",
            received as f64 / 1024.0,
            s.agent_metric("gpubudget_pod_table_rebuilds_total").await - r0,
            cpu_ms(pid) - c0,
            mib(pid, "VmRSS"),
            mib(pid, "VmHWM"),
        ),
    );
}

/// The agent's write load (issue 25, `GPUBUDGET_E2E_WRITES=1`): every API write it makes (records, events,
/// evictions: gpubudget_api_writes_total) per phase, as writes a minute: `steady` (60 s, nothing moves), `usage`
/// (60 s, every pod's usage moves by 20 % every 5 s), `crossing` (60 s, a tenth of the pods cycle Within → Near →
/// Over every 5 s), `flapping` (60 s, a tenth of the pods swing between 30 and 37 GiB, Within and Near, every
/// second, as a tenant trying to make its node write would), `pod-churn` (60 s, a pod deleted and another created
/// every 6 s), `budgets-edited` (every budget's limit raised at once, no pod's state changes; 60 s from the edit),
/// `budgets-tightened` (every budget set to 1Gi with action Warn at once: every pod goes Over; 60 s),
/// `operator-restart` (the operator stopped and started again; 60 s). docs/performance.md multiplies them out to a
/// fleet.
async fn write_load(
    run: &Run,
    s: &mut AgentScale,
    operator: &mut Binary,
    (label, pid): (&str, u32),
    pods: &[(String, String)],
    sample: &SampleFile,
) {
    run.say(&format!("{label}: write load ({} pods)", pods.len()));
    let sleep = |secs: u64| tokio::time::sleep(Duration::from_secs(secs));
    let admin = s.agent_admin.clone();
    let mark = || async { (writes_by_kind(&metrics(&admin).await), Instant::now()) };
    let mut lines = Vec::new();
    sleep(35).await; // past the first records' 30 s minimum interval
    let m = mark().await;
    sleep(60).await;
    lines.push(phase(run, &admin, label, "steady", m).await);
    let m = mark().await;
    for i in 1..=12 {
        usage(sample, pods, if i % 2 == 0 { 1.0 } else { 1.2 }, 0);
        sleep(5).await;
    }
    lines.push(phase(run, &admin, label, "usage", m).await);
    usage(sample, pods, 1.0, 0);
    sleep(35).await;
    let m = mark().await;
    for i in 0..12 {
        usage(sample, pods, 1.0, [30, 37, 42][i % 3]);
        sleep(5).await;
    }
    lines.push(phase(run, &admin, label, "crossing", m).await);
    usage(sample, pods, 1.0, 0);
    sleep(35).await;
    let m = mark().await;
    for i in 1..=60 {
        usage(sample, pods, 1.0, if i % 2 == 0 { 30 } else { 37 });
        sleep(1).await;
    }
    lines.push(phase(run, &admin, label, "flapping", m).await);
    usage(sample, pods, 1.0, 0);
    sleep(35).await;
    let m = mark().await;
    let node = format!("gpubudget-scale-{}-{label}", run.id);
    let per_team = (s.budgets / TEAMS).max(1);
    for (j, (ns, name)) in pods.iter().enumerate().take(10) {
        let api = Api::<Pod>::namespaced(run.admin.clone(), ns);
        api.delete(name, &DeleteParams::default()).await.expect("pod deleted");
        create_pod(&run.admin, ns, &format!("{name}-churn"), &format!("app-{}", (j / TEAMS) % per_team), &node).await;
        sleep(6).await;
    }
    lines.push(phase(run, &admin, label, "pod-churn", m).await);
    sleep(30).await;
    let m = mark().await;
    edit_all(run, &s.names, json!({"limit": "48Gi"})).await;
    sleep(60).await;
    lines.push(phase(run, &admin, label, "budgets-edited", m).await);
    let m = mark().await;
    edit_all(run, &s.names, json!({"limit": "1Gi", "action": "Warn"})).await;
    sleep(60).await;
    lines.push(phase(run, &admin, label, "budgets-tightened", m).await);
    let m = mark().await;
    operator.stop();
    *operator = s.start_operator(run);
    sleep(60).await;
    lines.push(phase(run, &admin, label, "operator-restart", m).await);
    s.results.extend(lines);
    let (rss, peak) = (mib(pid, "VmRSS"), mib(pid, "VmHWM"));
    run.info(&format!("agent RSS after the write phases: {rss:.1} MiB (peak {peak:.1} MiB)"));
}

/// A write-load phase's line, printed: the agent's writes a minute since `mark` (its writes by kind, and when).
async fn phase(run: &Run, admin: &str, label: &str, name: &str, (w0, t0): (BTreeMap<String, f64>, Instant)) -> String {
    let w1 = writes_by_kind(&metrics(admin).await);
    let secs = t0.elapsed().as_secs_f64();
    let line = format!("WRITES {label:<6} {name:<17} ({secs:3.0} s): {}", per_minute(&w0, &w1, secs));
    run.info(&line);
    line
}

// --- the operator

/// The operator measurement's population: `PREFIX-<n>` namespaces, `budgets_per_ns` budgets and `per_ns` pods each,
/// bound to `nodes` Nodes.
#[derive(Debug, Clone)]
struct Population {
    prefix: String,
    namespaces: usize,
    per_ns: usize,
    budgets_per_ns: usize,
    nodes: usize,
}

impl Population {
    fn ns(&self, n: usize) -> String {
        format!("{}-{n}", self.prefix)
    }

    fn node(&self, i: usize) -> String {
        format!("{}-node-{i}", self.prefix)
    }

    /// Every budget, `(namespace, name)`.
    fn budgets(&self) -> Vec<(String, String)> {
        let each = |n| (0..self.budgets_per_ns).map(move |b| (n, b));
        (0..self.namespaces).flat_map(each).map(|(n, b)| (self.ns(n), format!("budget-{b}"))).collect()
    }

    /// Pod k's app label: budgets 1.. of its namespace select app-<b>; budget-0 selects every pod.
    fn app_of(&self, k: usize) -> String {
        format!("app-{}", 1 + k % (self.budgets_per_ns.saturating_sub(1)).max(1))
    }
}

/// The agent's record of a pod, applied as the agent applies it (server-side apply as `gpubudget-agent/<node>`).
async fn apply_record(client: &Client, ns: &str, pod: &str, usage: u64, budget: &str, node: &str) {
    let record = json!({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": pod, "namespace": ns,
        "annotations": {"gpubudget.io/state": "Within", "gpubudget.io/usage-bytes": usage.to_string(),
                        "gpubudget.io/budget": budget, "gpubudget.io/node": node}}});
    let api = Api::<Pod>::namespaced(client.clone(), ns);
    let params = PatchParams::apply(&format!("gpubudget-agent/{node}")).force();
    retried(&format!("record of {ns}/{pod}"), || async { api.patch(pod, &params, &Patch::Apply(&record)).await }).await;
}

/// The pods, 8 at a time, each with six labels, a 1.5 KB last-applied annotation and the agent's record; with
/// `missing`, only those not there (a kept population after pods were lost).
async fn create_pods(run: &Run, p: &Population, missing: bool) {
    let present: Mutex<HashSet<(usize, String)>> = Mutex::new(HashSet::new());
    if missing {
        at_once(
            8,
            (0..p.namespaces).map(|n| {
                let (api, present) = (Api::<Pod>::namespaced(run.admin.clone(), &p.ns(n)), &present);
                async move {
                    let pods = retried("pods", || async { api.list(&ListParams::default()).await }).await;
                    present.lock().expect("lock").extend(pods.items.iter().map(|pod| (n, pod.name_any())));
                }
            }),
        )
        .await;
    }
    let present = present.into_inner().expect("lock");
    let last_applied = "x".repeat(1500);
    let t0 = Instant::now();
    let each = |n| (0..p.per_ns).map(move |k| (n, k));
    let jobs = (0..p.namespaces).flat_map(each).filter(|(n, k)| !present.contains(&(*n, format!("pod-{k:05}"))));
    at_once(
        8,
        jobs.map(|(n, k)| {
            let (ns, name, node, app) =
                (p.ns(n), format!("pod-{k:05}"), p.node((n * p.per_ns + k) % p.nodes), p.app_of(k));
            let pod: Pod = serde_json::from_value(json!({"apiVersion": "v1", "kind": "Pod",
                "metadata": {"name": name, "namespace": ns,
                    "labels": {"app": app, "team": ns, "tier": "inference", "version": "v1.2.3",
                               "pod-template-hash": "5d8f7c9b6", "app.kubernetes.io/managed-by": "helm"},
                    "annotations": {"kubectl.kubernetes.io/last-applied-configuration": last_applied,
                                    "prometheus.io/scrape": "true"}},
                "spec": {"nodeName": node, "terminationGracePeriodSeconds": 30,
                         "containers": [{"name": "main", "image": "registry.k8s.io/pause:3.10"}]}}))
            .expect("a pod");
            let api = Api::<Pod>::namespaced(run.admin.clone(), &ns);
            async move {
                retried(&format!("pod {ns}/{name}"), || async { api.create(&PostParams::default(), &pod).await }).await;
                let budget = app.replace("app-", "budget-");
                apply_record(&run.admin, &ns, &name, (1 + k as u64 % 6) * GI, &budget, &node).await;
            }
        }),
    )
    .await;
    let there = if present.is_empty() { String::new() } else { format!(" ({} were there)", present.len()) };
    run.info(&format!(
        "{} pods created with records in {:.1} s{there}",
        p.namespaces * p.per_ns - present.len(),
        t0.elapsed().as_secs_f64()
    ));
}

/// One GpuNodeUsage per node (#34), as the agents write them (server-side apply under the node's field manager):
/// every pod of the node with its UID and a usage of its record's plus 1 GiB, so that statuses read from these
/// objects show it.
async fn node_usages(run: &mut Run, p: &Population) {
    let by_node: Mutex<BTreeMap<String, Vec<Value>>> = Mutex::new(BTreeMap::new());
    at_once(
        8,
        (0..p.namespaces).map(|n| {
            let (api, by_node) = (Api::<Pod>::namespaced(run.admin.clone(), &p.ns(n)), &by_node);
            async move {
                for pod in retried("pods", || async { api.list(&ListParams::default()).await }).await.items {
                    let usage = pod.annotations().get("gpubudget.io/usage-bytes").and_then(|u| u.parse::<u64>().ok());
                    let entry = json!({"namespace": pod.namespace(), "name": pod.name_any(), "uid": pod.uid(),
                        "usageBytes": usage.unwrap_or(0) + GI});
                    let node = pod.spec.as_ref().and_then(|s| s.node_name.clone()).unwrap_or_default();
                    by_node.lock().expect("lock").entry(node).or_default().push(entry);
                }
            }
        }),
    )
    .await;
    let by_node = by_node.into_inner().expect("lock");
    let now = jiff::Timestamp::now().round(jiff::Unit::Second).expect("rounds").to_string();
    let resource = ApiResource::erase::<gpubudget_common::GpuNodeUsage>(&());
    let t0 = Instant::now();
    let api = Api::<DynamicObject>::all_with(run.admin.clone(), &resource);
    at_once(
        8,
        by_node.iter().map(|(node, pods)| {
            let mut pods = pods.clone();
            let bytes = |e: &Value| e["usageBytes"].as_u64().unwrap_or(0);
            pods.sort_by(|a, b| {
                bytes(b).cmp(&bytes(a)).then_with(|| {
                    (a["namespace"].as_str(), a["name"].as_str()).cmp(&(b["namespace"].as_str(), b["name"].as_str()))
                })
            });
            let total: u64 = pods.iter().map(bytes).sum();
            let object: DynamicObject = serde_json::from_value(json!({"apiVersion": "gpubudget.io/v1alpha1",
                "kind": "GpuNodeUsage", "metadata": {"name": node},
                "spec": {"nodeName": node, "observedAt": now, "podCount": pods.len(),
                         "total": format!("{}Gi", total / GI), "pods": pods}}))
            .expect("a GpuNodeUsage");
            let (api, params) = (&api, PatchParams::apply(&format!("gpubudget-agent/{node}")).force());
            async move {
                retried(node, || async { api.patch(node, &params, &Patch::Apply(&object)).await }).await;
            }
        }),
    )
    .await;
    let pods: usize = by_node.values().map(Vec::len).sum();
    run.info(&format!(
        "{} GpuNodeUsage objects ({pods} pods) written in {:.1} s",
        by_node.len(),
        t0.elapsed().as_secs_f64()
    ));
    for node in by_node.keys() {
        run.owns("gpubudget.io", "v1alpha1", "GpuNodeUsage", None, node);
    }
}

/// The operator at scale (formerly scale-operator.sh). Options: `GPUBUDGET_E2E_NAMESPACES` (100),
/// `GPUBUDGET_E2E_PODS_PER_NS` (100), `GPUBUDGET_E2E_BUDGETS_PER_NS` (10), `GPUBUDGET_E2E_CHANGES` (100; issue 25's
/// envelope is 1000 150 10 100: 150 000 pods and 10 000 budgets), `GPUBUDGET_E2E_NODES` (50),
/// `GPUBUDGET_E2E_NODE_USAGE=1`, `GPUBUDGET_E2E_IDLE_SECONDS` (30), `GPUBUDGET_E2E_CEILING=1`,
/// `GPUBUDGET_E2E_REUSE=PREFIX` with `GPUBUDGET_E2E_KEEP=1` (e2e/apiserver/README.md).
pub async fn operator() {
    let mut run = Run::start("gpubudget-apiserver-opscale", &["gpubudget-operator"]).await;
    let reuse = std::env::var("GPUBUDGET_E2E_REUSE").ok().filter(|r| !r.is_empty());
    let p = Population {
        prefix: reuse.clone().unwrap_or_else(|| format!("gpubudget-op-{}", run.id)),
        namespaces: env_or("GPUBUDGET_E2E_NAMESPACES", 100),
        per_ns: env_or("GPUBUDGET_E2E_PODS_PER_NS", 100),
        budgets_per_ns: env_or("GPUBUDGET_E2E_BUDGETS_PER_NS", 10),
        nodes: env_or("GPUBUDGET_E2E_NODES", 50),
    };
    let changes: usize = env_or("GPUBUDGET_E2E_CHANGES", 100);
    let budgets = p.namespaces * p.budgets_per_ns;
    let release = p.prefix.clone();
    run.say(&format!(
        "CRD, the operator's RBAC; {} namespaces × {} budgets, × {} pods with records",
        p.namespaces, p.budgets_per_ns, p.per_ns
    ));
    // Removed with the run unless GPUBUDGET_E2E_KEEP=1 (which keeps them for GPUBUDGET_E2E_REUSE).
    for n in 0..p.namespaces {
        run.owns("", "v1", "Namespace", None, &p.ns(n));
    }
    run.owns("", "v1", "Namespace", None, &p.prefix);
    for i in 0..p.nodes {
        run.owns("", "v1", "Node", None, &p.node(i));
    }
    run.owns_release(&release);
    // The Node objects the pods are bound to: without them the controller manager's pod garbage collector deletes
    // the pods as orphans (10 a second), and every deletion is a real change of two budgets' statuses.
    let nodes = Api::<Node>::all(run.admin.clone());
    let create_nodes = at_once(
        4,
        (0..p.nodes).map(|i| {
            let (nodes, name) = (&nodes, p.node(i));
            let node = json!({"apiVersion": "v1", "kind": "Node",
                "metadata": {"name": name, "labels": {"e2e.gpubudget.io/run": p.prefix}}});
            async move {
                let params = PatchParams::apply("gpubudget-e2e").force();
                retried(&name, || async { nodes.patch(&name, &params, &Patch::Apply(&node)).await }).await;
            }
        }),
    );
    if reuse.is_some() {
        run.info(&format!("reusing {}'s objects; their statuses removed", p.prefix));
        create_nodes.await;
        create_pods(&run, &p, true).await;
        run.info(&status_ceiling(&run, &p, "clear", 16).await);
    } else {
        let namespaces = Api::<k8s_openapi::api::core::v1::Namespace>::all(run.admin.clone());
        let namespace = |name: String| {
            let namespaces = &namespaces;
            async move {
                let ns = serde_json::from_value(json!({"metadata": {"name": name}})).expect("a namespace");
                retried(&name, || async { namespaces.create(&PostParams::default(), &ns).await }).await;
            }
        };
        namespace(p.prefix.clone()).await;
        run.apply_crds().await;
        run.apply_chart(&release, &p.prefix, &["ServiceAccount", "ClusterRole", "ClusterRoleBinding"], None).await;
        at_once(8, (0..p.namespaces).map(|n| namespace(p.ns(n)))).await;
        let t0 = Instant::now();
        let names = p.budgets();
        at_once(
            8,
            names.iter().map(|(ns, name)| {
                let b = name.trim_start_matches("budget-");
                let selector = if b == "0" { json!({}) } else { json!({"matchLabels": {"app": format!("app-{b}")}}) };
                create_budget(&run.admin, ns, name, selector, if b == "0" { "64Gi" } else { "40Gi" })
            }),
        )
        .await;
        run.info(&format!("{} budgets created in {:.1} s", names.len(), t0.elapsed().as_secs_f64()));
        create_nodes.await;
        create_pods(&run, &p, false).await;
        if std::env::var("GPUBUDGET_E2E_KEEP").as_deref() == Ok("1") {
            run.info(&format!("kept: rerun with GPUBUDGET_E2E_REUSE={}", p.prefix));
        }
    }
    if std::env::var("GPUBUDGET_E2E_NODE_USAGE").as_deref() == Ok("1") {
        node_usages(&mut run, &p).await;
    }

    run.say("the operator starts");
    let token = run.token(&p.prefix, &format!("{release}-operator"), None).await;
    let identity = run.identity("scale-operator", &token).await;
    let admin = run.addr(1);
    let t0 = Instant::now();
    let mut operator = run.spawn_operator(&OperatorRun {
        identity: &identity,
        ns: &p.prefix,
        pod: "scale-operator",
        admin: &admin,
        webhook: None,
        extra: &[],
        rust_log: "warn",
        log: "operator.log",
    });
    let pid = operator.pid();
    let status_writes = || async { sum(&metrics(&admin).await, "gpubudget_operator_status_writes_total") };
    // "Every status" is read from the operator's own status-write counter (one write per budget at start), then
    // checked with one list of the budgets: polling a list of 10 000 budgets would load the API server it measures.
    let mut ready_at = None;
    let all = budgets_api(&run.admin, None);
    let prefix = format!("{}-", p.prefix);
    let with_status = || async {
        let list = all.list(&ListParams::default()).await.expect("budgets listed");
        let ours = list.items.iter().filter(|b| b.namespace().is_some_and(|n| n.starts_with(&prefix)));
        ours.filter(|b| !b.data["status"]["observedGeneration"].is_null()).count() as f64
    };
    let mut converged = None;
    loop {
        let alive = std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|s| !s.contains(") Z "));
        assert!(alive, "the operator exited: {}", operator.log_text());
        if ready_at.is_none() && http_get(&admin, "/ready").await.is_some_and(|(code, _)| code == 200) {
            ready_at = Some(t0.elapsed().as_secs_f64());
        }
        if ready_at.is_some() {
            if converged.is_none() && status_writes().await >= budgets as f64 {
                converged = Some(t0.elapsed().as_secs_f64());
            }
            if converged.is_some() && with_status().await >= budgets as f64 {
                break;
            }
        }
        assert!(t0.elapsed() < Duration::from_secs(3600), "no convergence");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let (ready_at, converged) = (ready_at.expect("ready"), converged.expect("converged"));
    let m = metrics(&admin).await;
    let mut results = vec![format!(
        "RESULT operator pods={} budgets={budgets} ready={ready_at:.1}s every_status={converged:.1}s (after ready: \
         {:.1}s; list checked at {:.1}s) rss={:.1}MiB peak={:.1}MiB events={} mirror_writes={}",
        p.namespaces * p.per_ns,
        converged - ready_at,
        t0.elapsed().as_secs_f64(),
        mib(pid, "VmRSS"),
        mib(pid, "VmHWM"),
        sum(&m, "gpubudget_operator_events_total"),
        sum(&m, "gpubudget_operator_mirror_writes_total"),
    )];
    run.info(&results[0]);
    let idle: u64 = env_or("GPUBUDGET_E2E_IDLE_SECONDS", 30);
    let w0 = status_writes().await;
    tokio::time::sleep(Duration::from_secs(idle)).await;
    results.push(format!(
        "RESULT idle {idle}s: status_writes={} rss={:.1}MiB",
        status_writes().await - w0,
        mib(pid, "VmRSS")
    ));
    run.info(&results[1]);

    run.say(&format!("record -> status, {changes} changes"));
    results.push(format!("RESULT {}", record_latency(&run, &p, changes).await));
    let m = metrics(&admin).await;
    results.push(format!(
        "RESULT end rss={:.1}MiB peak={:.1}MiB reconciles={} status_writes={}",
        mib(pid, "VmRSS"),
        mib(pid, "VmHWM"),
        sum(&m, "gpubudget_operator_reconciles_total"),
        sum(&m, "gpubudget_operator_status_writes_total")
    ));
    for line in &results[2..] {
        run.info(line);
    }
    match operator.stop() {
        Some(status) => run.info(&format!("operator exit after SIGTERM: {status}")),
        None => run.info("operator had exited"),
    }
    if std::env::var("GPUBUDGET_E2E_CEILING").as_deref() == Ok("1") {
        run.say("the API server's own rate for these status writes (operator stopped)");
        results.push(format!("RESULT {}", list_ceiling(&run.admin).await));
        run.info(&results[results.len() - 1]);
        for mode in ["apply", "apply-events", "merge"] {
            results.push(format!("RESULT {}", status_ceiling(&run, &p, mode, 16).await));
            run.info(&results[results.len() - 1]);
        }
    }
    let head = Command::new("git").args(["rev-parse", "--short", "HEAD"]).current_dir(crate::harness::repo()).output();
    let head = head.map(|o| String::from_utf8_lossy(&o.stdout).trim().to_owned()).unwrap_or_default();
    run.say(&format!("results ({}, {head})", run.bin().display()));
    for line in &results {
        run.info(line);
    }
}

/// Record → status latency: a new, highest usage on one pod (the agent's record, applied as the agent applies it)
/// until its budget's status.topPods[0] shows it, polled every 2 ms; `changes` times, over pods spread by a prime
/// stride.
async fn record_latency(run: &Run, p: &Population, changes: usize) -> String {
    let mut times = Vec::new();
    for c in 0..changes {
        let i = (c * 7919) % (p.namespaces * p.per_ns);
        let (n, k) = (i / p.per_ns, i % p.per_ns);
        let (ns, budget) = (p.ns(n), p.app_of(k).replace("app-", "budget-"));
        // Above every other pod's usage, and above what an earlier run over kept objects wrote (a record applied
        // again unchanged is no change at all, and its status would show it at once).
        let usage = 7 * GI + (unix().as_secs() % 1_000_000) * 1000 + c as u64;
        let api = budgets_api(&run.admin, Some(&ns));
        let t0 = Instant::now();
        apply_record(&run.admin, &ns, &format!("pod-{k:05}"), usage, &budget, &p.node(0)).await;
        loop {
            let b = retried(&budget, || async { api.get(&budget).await }).await;
            if b.data["status"]["topPods"][0]["usageBytes"].as_u64() == Some(usage) {
                break;
            }
            assert!(t0.elapsed() < Duration::from_secs(30), "change {c} never converged");
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        times.push(t0.elapsed().as_secs_f64() * 1e3);
    }
    format!("record -> status: {}", latencies(&mut times))
}

/// The API server's own rate for this CRD's status writes, without the operator: every budget's status (the one the
/// operator wrote, read first, with matchedPods moved so each write is a real change) written once, `threads` at a
/// time, as the operator writes it (`apply`: server-side apply as gpubudget-operator, forced, with the
/// resourceVersion precondition; `apply-events`: the same with the Overlapping Warning the operator publishes after
/// a first status that says so) or as a JSON merge patch (`merge`); `clear` removes every status. Writes a second.
async fn status_ceiling(run: &Run, p: &Population, mode: &str, threads: usize) -> String {
    let names = p.budgets();
    let current: Mutex<BTreeMap<(String, String), (String, Value)>> = Mutex::new(BTreeMap::new());
    if mode != "clear" {
        at_once(
            threads,
            names.iter().map(|(ns, name)| {
                let (api, current) = (budgets_api(&run.admin, Some(ns)), &current);
                async move {
                    let b = retried(name, || async { api.get(name).await }).await;
                    let rv = b.resource_version().unwrap_or_default();
                    current.lock().expect("lock").insert((ns.clone(), name.clone()), (rv, b.data["status"].clone()));
                }
            }),
        )
        .await;
    }
    let current = current.into_inner().expect("lock");
    let t0 = Instant::now();
    at_once(
        threads,
        names.iter().map(|(ns, name)| {
            let api = budgets_api(&run.admin, Some(ns));
            let (rv, mut status) = current.get(&(ns.clone(), name.clone())).cloned().unwrap_or_default();
            let admin = &run.admin;
            async move {
                if mode == "clear" {
                    let patch = json!({"status": null});
                    retried(name, || async {
                        api.patch_status(name, &PatchParams::default(), &Patch::Merge(&patch)).await
                    })
                    .await;
                    return;
                }
                if !status.is_object() {
                    status = json!({});
                }
                status["matchedPods"] = json!(status["matchedPods"].as_i64().unwrap_or(0) + 1);
                if mode == "merge" {
                    let patch = json!({"metadata": {"resourceVersion": rv}, "status": status});
                    retried(name, || async {
                        api.patch_status(name, &PatchParams::default(), &Patch::Merge(&patch)).await
                    })
                    .await;
                    return;
                }
                let body = json!({"apiVersion": "gpubudget.io/v1alpha1", "kind": "GpuMemoryBudget",
                    "metadata": {"name": name, "namespace": ns, "resourceVersion": rv}, "status": status});
                let params = PatchParams::apply("gpubudget-operator").force();
                let written =
                    retried(name, || async { api.patch_status(name, &params, &Patch::Apply(&body)).await }).await;
                let conditions = status["conditions"].as_array().cloned().unwrap_or_default();
                let overlapping =
                    conditions.iter().find(|c| c["type"] == "Overlapping" && c["status"] == "True").cloned();
                // One events.k8s.io/v1 create after the status write, as the operator's reconcile does
                // (status::notices).
                if let (true, Some(condition)) = (mode == "apply-events", overlapping) {
                    let note: String = condition["message"].as_str().unwrap_or_default().chars().take(1024).collect();
                    let now = jiff::Timestamp::now().strftime("%Y-%m-%dT%H:%M:%S.000000Z").to_string();
                    let nanos = unix().as_nanos();
                    let event: k8s_openapi::api::events::v1::Event = serde_json::from_value(json!({
                        "metadata": {"name": format!("{name}.{nanos:x}"), "namespace": ns},
                        "eventTime": now, "reportingController": "gpubudget-operator",
                        "reportingInstance": "gpubudget-e2e", "action": "Reconcile", "reason": "Overlapping",
                        "type": "Warning", "note": note,
                        "regarding": {"apiVersion": "gpubudget.io/v1alpha1", "kind": "GpuMemoryBudget",
                                      "namespace": ns, "name": name, "uid": written.uid()}}))
                    .expect("an event");
                    let events = Api::<k8s_openapi::api::events::v1::Event>::namespaced(admin.clone(), ns);
                    retried("event", || async { events.create(&PostParams::default(), &event).await }).await;
                }
            }
        }),
    )
    .await;
    let elapsed = t0.elapsed().as_secs_f64();
    format!(
        "status-ceiling mode={mode} threads={threads} writes={} seconds={elapsed:.1} rate={:.0}/s",
        names.len(),
        names.len() as f64 / elapsed
    )
}

/// The API server's own time to hand a client what the operator lists before its first status: every active pod
/// (full objects, 500 a page, kube's default), and 100 a page the budgets, cluster budgets, namespaces, nodes' usage
/// objects and both kinds of mirrors (metadata only for namespaces and mirrors, as the operator asks), all at once,
/// as the operator's watches start together; the wall time and the bytes.
async fn list_ceiling(client: &Client) -> String {
    let lists: [(&str, u32, &str, bool); 7] = [
        ("/api/v1/pods", 500, "fieldSelector=status.phase%21%3DSucceeded%2Cstatus.phase%21%3DFailed", false),
        ("/apis/gpubudget.io/v1alpha1/gpumemorybudgets", 100, "", false),
        ("/apis/gpubudget.io/v1alpha1/clustergpumemorybudgets", 100, "", false),
        ("/api/v1/namespaces", 100, "", true),
        ("/apis/gpubudget.io/v1alpha1/gpunodeusages", 100, "", false),
        ("/apis/gpubudget.io/v1alpha1/gpumemorybudgetmirrors", 100, "", true),
        ("/apis/gpubudget.io/v1alpha1/clustergpumemorybudgetmirrors", 100, "", true),
    ];
    let totals: Mutex<BTreeMap<String, (usize, usize)>> = Mutex::new(BTreeMap::new());
    let t0 = Instant::now();
    at_once(
        lists.len(),
        lists.iter().map(|&(path, limit, query, meta_only)| {
            let totals = &totals;
            async move {
                let (mut items, mut size, mut token) = (0, 0, String::new());
                loop {
                    let mut url = format!("{path}?limit={limit}");
                    if !query.is_empty() {
                        url.push_str(&format!("&{query}"));
                    }
                    if !token.is_empty() {
                        url.push_str(&format!("&continue={}", form_encoded(&token)));
                    }
                    let accept = if meta_only {
                        "application/json;as=PartialObjectMetadataList;g=meta.k8s.io;v=v1,application/json"
                    } else {
                        "application/json"
                    };
                    let request = || {
                        let r = http::Request::get(&url).header("Accept", accept).body(Vec::new());
                        client.request_text(r.expect("a request"))
                    };
                    let text = retried(path, request).await;
                    let page: Value = serde_json::from_str(&text).expect("json");
                    items += page["items"].as_array().map_or(0, Vec::len);
                    size += text.len();
                    token = page["metadata"]["continue"].as_str().unwrap_or_default().to_owned();
                    if token.is_empty() {
                        break;
                    }
                }
                let kind = path.rsplit('/').next().expect("a name").to_owned();
                totals.lock().expect("lock").insert(kind, (items, size));
            }
        }),
    )
    .await;
    let elapsed = t0.elapsed().as_secs_f64();
    let totals = totals.into_inner().expect("lock");
    let what: Vec<String> = totals.iter().map(|(k, (n, _))| format!("{k}={n}")).collect();
    let bytes: usize = totals.values().map(|(_, b)| b).sum();
    format!("list-ceiling seconds={elapsed:.1} bytes={:.0}MiB {}", bytes as f64 / 1_048_576.0, what.join(" "))
}

/// A continue token as a query value (percent-encoded but for unreserved characters).
fn form_encoded(text: &str) -> String {
    text.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => (b as char).to_string(),
            _ => format!("%{b:02X}"),
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ss_sockets_of_one_process_with_their_bytes_received() {
        let ss = "0 0 127.0.0.1:40100 127.0.0.1:6443 users:((\"gpubudget-agent\",pid=42,fd=9))\n\
                  \t cubic rtt:0.1 bytes_sent:10 bytes_received:12345 segs_out:3\n\
                  0 0 127.0.0.1:40200 127.0.0.1:6443 users:((\"kubectl\",pid=420,fd=3))\n\
                  \t cubic bytes_received:999\n\
                  0 0 127.0.0.1:40300 127.0.0.1:6443 users:((\"gpubudget-agent\",pid=42,fd=10))\n\
                  \t cubic bytes_received:5\n";
        let sockets = sockets_of(ss, 42);
        assert_eq!(sockets, BTreeMap::from([("40100".to_owned(), 12345), ("40300".to_owned(), 5)]));
        let later = BTreeMap::from([("40100".to_owned(), 12400), ("40400".to_owned(), 7)]);
        assert_eq!(received_since(&sockets, &later), 55 + 7, "a closed connection is not counted, a new one whole");
    }

    #[test]
    fn proc_figures_are_read_from_status_and_stat() {
        assert_eq!(status_kib("Name:\tx\nVmHWM:\t  20480 kB\nVmRSS:\t  10240 kB\n", "VmRSS"), 10240);
        assert_eq!(status_kib("VmRSS:\t1 kB\n", "VmHWM"), 0);
        let stat = "42 (a (b) c) S 1 42 42 0 -1 4194560 100 0 0 0 7 3 0 0 20 0 4 0";
        assert_eq!(stat_ticks(stat), 10, "utime 7 + stime 3, after the command's last parenthesis");
    }

    #[test]
    fn metrics_are_read_exactly_summed_and_split_by_kind() {
        let text = "gpubudget_api_writes_total{kind=\"apply\",result=\"ok\"} 110\n\
                    gpubudget_api_writes_total{kind=\"apply\",result=\"error\"} 2\n\
                    gpubudget_api_writes_total{kind=\"event\",result=\"ok\"} 3\n\
                    gpubudget_api_writes_total_extra 100\n\
                    gpubudget_pod_table_rebuilds_total 4\n";
        assert_eq!(value(text, "gpubudget_pod_table_rebuilds_total"), 4.0);
        assert_eq!(value(text, "gpubudget_api_writes_total{kind=\"apply\",result=\"error\"}"), 2.0);
        assert_eq!(sum(text, "gpubudget_api_writes_total"), 115.0);
        assert_eq!(sum(text, "gpubudget_missing").to_string(), "0", "not -0");
        let before = writes_by_kind(text);
        assert_eq!(before["apply"], 112.0);
        assert_eq!(before["all"], 115.0);
        let after = BTreeMap::from([("apply".to_owned(), 122.0), ("event".to_owned(), 3.0), ("all".to_owned(), 125.0)]);
        assert_eq!(per_minute(&before, &after, 30.0), "apply=20/min event=0/min all=20/min ");
    }

    #[test]
    fn a_population_names_its_budgets_pods_apps_and_nodes() {
        let p = Population { prefix: "op".into(), namespaces: 2, per_ns: 3, budgets_per_ns: 10, nodes: 5 };
        assert_eq!(p.budgets().len(), 20);
        assert_eq!(p.budgets()[11], ("op-1".to_owned(), "budget-1".to_owned()));
        assert_eq!((p.app_of(0), p.app_of(8), p.app_of(9)), ("app-1".into(), "app-9".into(), "app-1".into()));
        assert_eq!(p.node(4), "op-node-4");
        assert_eq!(form_encoded("a b/=c"), "a%20b%2F%3Dc");
    }
}
