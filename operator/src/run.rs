//! `gpubudget-operator run`: the status controller, the admin port, leader election and the eviction
//! check, as tasks sharing one shutdown signal. The process exits non-zero when any of them dies.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use gpubudget_daemon::{Health, LogFormat, serve_admin, shutdown_on_signal};
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::runtime::wait::{Condition, await_condition, conditions};
use kube::{Api, Client};
use prometheus_client::registry::Registry;
use tokio::sync::watch;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

use crate::caps_webhook;
use crate::controller::{self, CHECK_BUDGETS, CHECK_PODS, Context, Settings};
use crate::eviction_check::{self, PodLookup};
use crate::leader::{self, CHECK_LEASE, Election};
use crate::metrics::Metrics;
use crate::quota::{self, QuotaSettings};

/// Readiness check: the GpuMemoryBudget CRD is established.
pub const CHECK_CRD: &str = "crd-established";
/// The CRD the operator serves.
pub const CRD_NAME: &str = "gpumemorybudgets.gpubudget.io";
/// How long tasks get to finish after SIGTERM before the process exits anyway.
pub const SHUTDOWN_GRACE: Duration = Duration::from_secs(20);

/// `run`'s flags (each also read from its environment variable).
#[derive(Debug, Clone, clap::Args)]
pub struct RunArgs {
    /// Address of the admin port: /live, /ready, /metrics.
    #[arg(long, env = "GPUBUDGET_ADMIN_ADDR", default_value = "0.0.0.0:9400")]
    pub admin_addr: SocketAddr,
    /// Elect a leader through a Lease; only the leader writes status (needed with more than one replica).
    #[arg(long, env = "GPUBUDGET_LEADER_ELECTION", default_value_t = false, num_args = 0..=1,
          default_missing_value = "true", action = clap::ArgAction::Set)]
    pub leader_election: bool,
    /// Copy each budget's spec into its mirror (GpuMemoryBudgetMirror, ClusterGpuMemoryBudgetMirror), which the
    /// agents watch instead of the budgets, so that status writes never reach them (docs/performance.md). Off:
    /// agents watch the budgets' metadata, one event per status write each.
    #[arg(long, env = "GPUBUDGET_BUDGET_MIRRORS", default_value_t = true, num_args = 0..=1,
          default_missing_value = "true", action = clap::ArgAction::Set)]
    pub budget_mirrors: bool,
    /// Name of the Lease (in the operator's namespace).
    #[arg(long, env = "GPUBUDGET_LEASE_NAME", default_value = "gpubudget-operator")]
    pub lease_name: String,
    /// Name of the Lease (in the operator's namespace) by which the leader vouches that every budget has a
    /// current mirror: agents read the mirrors only while it is renewed, and the budgets themselves otherwise.
    /// Empty: none is kept (agents then never read the mirrors).
    #[arg(long, env = "GPUBUDGET_MIRRORS_LEASE_NAME", default_value = "gpubudget-mirrors")]
    pub mirrors_lease_name: String,
    /// Serve the webhooks (POST /validate-eviction, POST /mutate-pod-caps) on this address.
    #[arg(long, env = "GPUBUDGET_WEBHOOK_ADDR")]
    pub webhook_addr: Option<SocketAddr>,
    /// Directory holding the webhooks' tls.crt and tls.key (without it: plain HTTP, for tests only).
    #[arg(long, env = "GPUBUDGET_WEBHOOK_CERT_DIR")]
    pub webhook_cert_dir: Option<PathBuf>,
    /// Log format.
    #[arg(long, env = "GPUBUDGET_LOG_FORMAT", value_enum, default_value = "text")]
    pub log_format: LogFormat,
    /// The namespaces whose critical-priority pods (system-node-critical, system-cluster-critical) are never
    /// evicted for a namespace total, comma-separated; empty: none. Elsewhere critical priority exempts nothing.
    #[arg(long, env = "GPUBUDGET_CRITICAL_NAMESPACES", default_value = "kube-system")]
    pub critical_namespaces: gpubudget_common::CriticalNamespaces,
    /// Budgets reconciled (and their statuses written) at once. The API server's write rate bounds how fast
    /// every status is written after a start (docs/performance.md, "Scale table").
    #[arg(long, env = "GPUBUDGET_STATUS_CONCURRENCY", default_value_t = 16, value_parser = clap::value_parser!(u16).range(1..=256))]
    pub status_concurrency: u16,
    /// "Enforce" carries a ClusterGpuMemoryQuota's evictions out; "Observe" only tells the pod it would evict
    /// (NamespaceGpuMemoryWouldEvict, status.namespaces[].wouldEvict) and evicts nothing. A quota's own
    /// spec.enforcement overrides it. The chart sets it from agent.enforcement, as the agents' default.
    #[arg(long, env = "GPUBUDGET_ENFORCEMENT", default_value = "Enforce", value_parser = gpubudget_common::enforcement::parse_flag)]
    pub enforcement: gpubudget_common::Enforcement,
    /// This replica's pod name (the Downward API's metadata.name): the lease identity and events' instance.
    #[arg(long, env = "POD_NAME")]
    pub pod_name: Option<String>,
    /// This replica's namespace (metadata.namespace): where the Lease lives.
    #[arg(long, env = "POD_NAMESPACE")]
    pub pod_namespace: Option<String>,
}

/// Runs the operator until SIGTERM; returns the exit code.
pub fn run(args: RunArgs) -> anyhow::Result<i32> {
    gpubudget_daemon::init_tracing(args.log_format);
    // A few workers are plenty (the work is a few reconciles a second); one per core of a big node would
    // only add threads and allocator arenas to the resident memory.
    let workers = std::thread::available_parallelism().map_or(2, |n| n.get().clamp(1, 4));
    let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(workers).enable_all().build()?;
    runtime.block_on(serve(args))
}

type Task = (&'static str, anyhow::Result<()>);

async fn named(name: &'static str, task: impl Future<Output = anyhow::Result<()>>) -> Task {
    (name, task.await)
}

async fn serve(args: RunArgs) -> anyhow::Result<i32> {
    eviction_check::install_crypto_provider();
    let shutdown = shutdown_on_signal();
    let mut checks = vec![CHECK_CRD, CHECK_PODS, CHECK_BUDGETS];
    if args.leader_election {
        checks.push(CHECK_LEASE);
    }
    let health = Health::new(&checks);
    let mut registry = Registry::default();
    let metrics = Metrics::register(&mut registry);
    health.register(&mut registry, crate::metrics::READY_METRIC);
    let client =
        Client::try_default().await.map_err(|e| anyhow::anyhow!("cannot configure a Kubernetes client: {e}"))?;
    let identity =
        args.pod_name.clone().or_else(|| std::env::var("HOSTNAME").ok()).unwrap_or_else(|| "gpubudget-operator".into());
    let namespace = args.pod_namespace.clone().unwrap_or_else(|| client.default_namespace().to_owned());
    tracing::info!(version = env!("CARGO_PKG_VERSION"), %identity, %namespace, leader_election = args.leader_election, enforcement = %args.enforcement, "gpubudget operator starting");

    let mut tasks: JoinSet<Task> = JoinSet::new();
    tasks.spawn(named("admin", {
        let (health, registry, shutdown) = (health.clone(), Arc::new(registry), shutdown.clone());
        async move { Ok(serve_admin(args.admin_addr, health, registry, shutdown).await?) }
    }));
    // Without election this replica always writes; the sender lives as long as the process.
    let (leader_tx, leader_rx) = watch::channel(!args.leader_election);
    if args.leader_election {
        let election = Election::new(args.lease_name.clone(), namespace.clone(), identity.clone());
        tasks.spawn(named(
            "leader-election",
            leader::run(client.clone(), election, leader_tx.clone(), health.clone(), shutdown.clone()),
        ));
    }
    let settings = Settings {
        instance: Some(identity),
        concurrency: args.status_concurrency,
        critical_namespaces: args.critical_namespaces.clone(),
        mirrors: args.budget_mirrors,
        mirrors_lease: (!args.mirrors_lease_name.is_empty())
            .then(|| (namespace.clone(), args.mirrors_lease_name.clone())),
        ..Settings::default()
    };
    let ctx = Arc::new(Context::new(client.clone(), metrics, leader_rx, settings));
    if let Some(addr) = args.webhook_addr {
        let app = eviction_check::router(PodLookup::new(client.clone())).merge(caps_webhook::router(ctx.clone()));
        tasks
            .spawn(named("webhook", eviction_check::serve(addr, args.webhook_cert_dir.clone(), app, shutdown.clone())));
    }
    let quota_settings = QuotaSettings { enforcement: args.enforcement, ..QuotaSettings::default() };
    tasks.spawn(named("quota", quota::run(ctx.clone(), quota_settings, shutdown.clone())));
    tasks.spawn(named("controller", {
        let (health, shutdown) = (health.clone(), shutdown.clone());
        async move {
            if wait_for_crd(client, &health, &shutdown).await? {
                controller::run(ctx, health, shutdown).await?;
            }
            Ok(())
        }
    }));

    let code = supervise(tasks, &shutdown).await;
    drop(leader_tx);
    tracing::info!(code, "gpubudget operator stopped");
    Ok(code)
}

/// Waits for every task; the first that fails (or returns before shutdown) cancels the others. Returns the
/// exit code: 0 after a clean shutdown, 1 when a task died.
async fn supervise(mut tasks: JoinSet<Task>, shutdown: &CancellationToken) -> i32 {
    let mut code = 0;
    let deadline = async {
        shutdown.cancelled().await;
        tokio::time::sleep(SHUTDOWN_GRACE).await;
    };
    let mut deadline = std::pin::pin!(deadline);
    loop {
        let joined = tokio::select! {
            joined = tasks.join_next() => joined,
            () = &mut deadline => {
                tracing::warn!(left = tasks.len(), "tasks did not stop within {SHUTDOWN_GRACE:?}; exiting");
                tasks.abort_all();
                return code.max(1);
            }
        };
        let Some(joined) = joined else { return code };
        match joined {
            Ok((_, Ok(()))) if shutdown.is_cancelled() => {}
            Ok((name, Ok(()))) => {
                tracing::error!(task = name, "a critical task stopped; shutting down");
                code = 1;
                shutdown.cancel();
            }
            Ok((name, Err(error))) => {
                tracing::error!(task = name, error = format!("{error:#}"), "a critical task failed; shutting down");
                code = 1;
                shutdown.cancel();
            }
            Err(error) => {
                tracing::error!(%error, "a critical task panicked; shutting down");
                code = 1;
                shutdown.cancel();
            }
        }
    }
}

/// Waits until the GpuMemoryBudget CRD is established, saying so while it is missing. `Ok(false)`: shut
/// down while waiting.
pub async fn wait_for_crd(client: Client, health: &Health, shutdown: &CancellationToken) -> anyhow::Result<bool> {
    let api: Api<CustomResourceDefinition> = Api::all(client);
    let mut said = false;
    loop {
        match api.get_opt(CRD_NAME).await {
            Ok(Some(crd)) if conditions::is_crd_established().matches_object(Some(&crd)) => break,
            Ok(Some(_)) if !said => tracing::info!(crd = CRD_NAME, "waiting for the CRD to be established"),
            Ok(None) => tracing::warn!(
                crd = CRD_NAME,
                "the GpuMemoryBudget CRD is not installed; waiting for it (the Helm chart installs it, or \
                 `gpubudget-operator crd | kubectl apply -f -`)"
            ),
            Ok(Some(_)) => {}
            Err(error) => tracing::warn!(crd = CRD_NAME, %error, "cannot read the CRD; retrying"),
        }
        said = true;
        // Wake on the CRD's change, or re-check (and say it again) after a while.
        let established = await_condition(api.clone(), CRD_NAME, conditions::is_crd_established());
        tokio::select! {
            () = shutdown.cancelled() => return Ok(false),
            result = tokio::time::timeout(Duration::from_secs(60), established) => match result {
                Ok(Ok(_)) => break,
                Ok(Err(error)) => {
                    tracing::warn!(%error, "watching the CRD failed; retrying");
                    tokio::time::sleep(Duration::from_secs(5)).await;
                }
                Err(_) => {}
            },
        }
    }
    tracing::info!(crd = CRD_NAME, "CRD established");
    health.set(CHECK_CRD, true);
    Ok(true)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn waits(shutdown: &CancellationToken) -> impl Future<Output = anyhow::Result<()>> + use<> {
        let shutdown = shutdown.clone();
        async move {
            shutdown.cancelled().await;
            Ok(())
        }
    }

    #[test]
    fn status_concurrency_defaults_to_16_and_refuses_0_and_more_than_256() {
        use clap::Parser;
        let parse = |args: &[&str]| crate::cli::Cli::try_parse_from([&["gpubudget-operator", "run"], args].concat());
        let concurrency = |args: &[&str]| match parse(args).map(|cli| cli.command) {
            Ok(crate::cli::Command::Run(run)) => Ok(run.status_concurrency),
            Ok(_) => unreachable!("run parses as run"),
            Err(error) => Err(error.to_string()),
        };
        assert_eq!(concurrency(&[]), Ok(16));
        assert_eq!(concurrency(&["--status-concurrency", "64"]), Ok(64));
        for bad in ["0", "257", "many"] {
            let error = concurrency(&["--status-concurrency", bad]).expect_err(bad);
            assert!(error.contains("--status-concurrency"), "{error}");
        }
    }

    #[tokio::test]
    async fn a_failing_task_stops_the_others_and_the_process_fails() {
        let shutdown = CancellationToken::new();
        let mut tasks = JoinSet::new();
        tasks.spawn(named("admin", waits(&shutdown)));
        tasks.spawn(named("controller", async { anyhow::bail!("the pod watch ended") }));
        assert_eq!(supervise(tasks, &shutdown).await, 1);
        assert!(shutdown.is_cancelled());
    }

    #[tokio::test]
    async fn a_task_that_returns_early_is_a_failure_too() {
        let shutdown = CancellationToken::new();
        let mut tasks = JoinSet::new();
        tasks.spawn(named("admin", waits(&shutdown)));
        tasks.spawn(named("webhook", async { Ok(()) }));
        assert_eq!(supervise(tasks, &shutdown).await, 1);
    }

    #[tokio::test]
    async fn a_clean_shutdown_exits_zero() {
        let shutdown = CancellationToken::new();
        let mut tasks = JoinSet::new();
        tasks.spawn(named("admin", waits(&shutdown)));
        tasks.spawn(named("controller", waits(&shutdown)));
        let stop = shutdown.clone();
        tokio::spawn(async move { stop.cancel() });
        assert_eq!(supervise(tasks, &shutdown).await, 0);
    }

    #[tokio::test(start_paused = true)]
    async fn a_task_that_ignores_shutdown_is_abandoned_after_the_grace() {
        let shutdown = CancellationToken::new();
        let mut tasks = JoinSet::new();
        tasks.spawn(named("stuck", async {
            std::future::pending::<()>().await;
            Ok(())
        }));
        shutdown.cancel();
        assert_eq!(supervise(tasks, &shutdown).await, 1);
    }
}
