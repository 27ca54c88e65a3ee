//! `gpubudget-agent run`: the DaemonSet, wired. The [`Index`] (attribute/kube) keeps the node's pods, the budgets
//! and the Node's labels current; the loop samples every interval, rebuilds its pod table only when the index's
//! generation moved (`gpubudget_pod_table_rebuilds_total`), decides, and hands actions to the [`KubeExecutor`]
//! (which never blocks the loop). `/ready` is true once the GPU sampler works and every cache has synced; nothing
//! is enforced before the caches sync.

use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use gpubudget_daemon::{Health, serve_admin, shutdown_on_signal};
use gpubudget_nvml_limits::DriverLimits;
use kube::Client;
use prometheus_client::registry::Registry;
use tokio::sync::{mpsc, watch};
use tokio_util::sync::CancellationToken;

use crate::act::SpecReadLabels;
use crate::act::kube::KubeExecutor;
use crate::act::usage::UsageWriter;
use crate::attribute::ProcAttributor;
use crate::attribute::driver_limits::DriverReader;
use crate::attribute::kube::{FromMirrors, Index, Mirroring, SpecRead};
use crate::attribute::pods::PodTable;
use crate::cli::RunArgs;
use crate::decide::{Action, NodeReason, Settings, driver_limits};
use crate::pipeline::Engine;
use crate::report::metrics::{KindLabels, Metrics};
use crate::runtime_caps::{self, Made};
use crate::sample::file::RecordedSampler;
use crate::sample::nvml::NvmlSampler;
use crate::sample::{SamplerFactory, SamplerSlot};

/// Readiness checks.
pub const CHECKS: [&str; 3] = ["gpu", "pods", "budgets"];
/// The readiness checks as a gauge on `/metrics`: `gpubudget_ready{check}` (1 while the check passes).
pub const READY_METRIC: &str = "gpubudget_ready";

/// Sets `gpubudget_budget_specs_from_mirrors{kind}`; going back to the budgets is told on the Node.
fn from_mirrors(metrics: &Metrics, node_events: mpsc::UnboundedSender<Action>) -> FromMirrors {
    let gauge = metrics.specs_from_mirrors.clone();
    Arc::new(move |kind, mirrors, why| {
        gauge.get_or_create(&KindLabels { kind }).set(i64::from(mirrors));
        if let Some(why) = why {
            let note = format!(
                "{kind}: reading the budgets themselves again, not their mirrors: {why}; every budget's current \
                 spec is enforced on this node once they have listed"
            );
            let _ = node_events.send(Action::NodeEvent { reason: NodeReason::MirrorsNotCurrent, note });
        }
    })
}

/// Counts a budget spec read in `gpubudget_budget_spec_reads_total{kind,result}`.
fn counted(metrics: &Metrics) -> SpecRead {
    let reads = metrics.spec_reads.clone();
    Arc::new(move |kind, result| {
        reads.get_or_create(&SpecReadLabels { kind, result }).inc();
    })
}

/// The sampler factory for `--sample-file` or NVML.
pub fn sampler_factory(sample_file: Option<&std::path::Path>) -> SamplerFactory {
    match sample_file {
        Some(path) => RecordedSampler::factory(path.to_owned()),
        None => NvmlSampler::factory(),
    }
}

/// The agent's main loop, until `shutdown`.
pub async fn run_with(args: RunArgs, client: Client, health: Health, metrics: Metrics, shutdown: CancellationToken) {
    let node = args.node_name.clone();
    // The driver's per-cgroup limits, once per start (not when replaying a sample file: no driver then).
    let detected = args.sample_file.is_none().then(DriverLimits::open);
    let (node_events_tx, mut node_events) = mpsc::unbounded_channel();
    let index = Index::start(
        client.clone(),
        &node,
        health.clone(),
        Mirroring {
            lease: args.mirrors_lease.clone(),
            spec_read: counted(&metrics),
            from_mirrors: from_mirrors(&metrics, node_events_tx.clone()),
        },
        shutdown.clone(),
    );
    // What the runtime made of the pods' GPU containers (`--runtime-caps`): the table reads it as the pods' caps.
    let made = Made::default();
    // The table each decision reads, also published to the runtime's plugin (`--runtime-caps`).
    let (view, views) = watch::channel(runtime_caps::View::default());
    if args.runtime_caps.enabled {
        let a = &args.runtime_caps;
        let settings = runtime_caps::Settings {
            wait: a.wait,
            unresolved: a.unresolved,
            mps_pipe: a.mps_pipe.clone(),
            never_refuse: a.never_refuse.clone(),
        };
        let plugin = Arc::new(runtime_caps::RuntimeCaps::new(
            views,
            settings,
            metrics.runtime.clone(),
            node_events_tx,
            made.clone(),
        ));
        let (socket, stop) = (a.socket.clone(), shutdown.clone());
        tracing::info!(socket = %socket.display(), wait = ?a.wait, unresolved = ?a.unresolved, "runtime caps: connecting to the relay");
        // Its own thread and runtime: a container's creation waits on no tick (NVML calls block their worker), no
        // watch and no API write (measured on the GPU node: a shared worker added tens of ms to a p99, #53).
        let spawned = std::thread::Builder::new().name("runtime-caps".into()).spawn(move || {
            match tokio::runtime::Builder::new_current_thread().enable_all().build() {
                Ok(rt) => rt.block_on(runtime_caps::channel::run_forever(&socket, plugin, stop)),
                Err(e) => tracing::error!(error = %e, "runtime caps: no runtime for the relay's channel"),
            }
        });
        if let Err(e) = spawned {
            tracing::error!(error = %e, "runtime caps: no thread for the relay's channel");
        }
    }
    let mut engine = Engine::new(
        SamplerSlot::new(sampler_factory(args.sample_file.as_deref())),
        ProcAttributor::new(&args.sample.proc_root),
        {
            let mut settings = Settings::new(&node);
            args.pressure.apply(&mut settings);
            args.accounting.apply(&mut settings);
            args.records.apply(&mut settings);
            // Checked by `dispatch` before anything starts.
            settings.cadence = args.sample.cadence().unwrap_or(settings.cadence);
            settings
        },
        metrics.clone(),
    );
    let (mut executor, mut feedback) = KubeExecutor::new(client.clone(), &node, metrics.act.clone());
    // The interval and percentage the engine was given (`RecordArgs::apply`): one source for both.
    let mut usage_writer = {
        let settings = engine.enforcer.settings();
        UsageWriter::new(
            client,
            &node,
            metrics.act.clone(),
            settings.usage_min_interval_ms,
            settings.usage_change_percent,
        )
    };
    if let Some(detected) = detected {
        metrics.driver_limits_available.set(i64::from(detected.is_ok()));
        match detected {
            Ok(limits) => {
                tracing::info!(
                    driver = limits.driver_version().unwrap_or_default(),
                    cgroup_root = %args.cgroup_root.display(),
                    apply = args.apply_driver_limits,
                    "driver limits: available (per-cgroup GPU memory limits are read back)"
                );
                let apply = args.apply_driver_limits && limits.can_set();
                if args.apply_driver_limits && !apply {
                    tracing::warn!(
                        "--apply-driver-limits: this driver's NVML has no nvmlDeviceSetMemoryLimits_v1; limits are only read"
                    );
                }
                let mut reader = DriverReader::new(Box::new(limits), args.cgroup_root.clone());
                reader.apply = apply;
                engine.driver = Some(reader);
            }
            Err(why) => {
                tracing::info!(reason = %why, "driver limits: unavailable; eviction only");
                executor.dispatch([driver_limits::unavailable(&why)]);
            }
        }
    }
    // The first tick at once; each next one when the engine's pace says (decide::cadence).
    let next = tokio::time::sleep(Duration::ZERO);
    tokio::pin!(next);
    let mut table = Arc::new(PodTable::default());
    // The caches' generation and the GPUs' sizes the table was built for (a share of a GPU resolves
    // against them, so the table is built again once NVML has answered, or a GPU changes).
    let mut seen: Option<(u64, Vec<u64>)> = None;
    tracing::info!(%node, interval = ?args.sample.interval, interval_near = ?args.sample.interval_near, proc_root = %args.sample.proc_root.display(), enforcement = %args.pressure.enforcement, "agent running");
    loop {
        tokio::select! {
            () = shutdown.cancelled() => break,
            Some(action) = node_events.recv() => executor.dispatch([action]),
            Some(report) = feedback.recv() => {
                engine.feedback(report);
                executor.dispatch(engine.take_actions());
            }
            () = &mut next => {
                let started = tokio::time::Instant::now();
                let synced = index.synced();
                if synced {
                    let generation = index.generation();
                    if !seen.as_ref().is_some_and(|(g, totals)| *g == generation && engine.gpu_totals_are(totals)) {
                        let totals = engine.gpu_totals();
                        table = Arc::new(index.table(&node, &totals, &made));
                        let gpus = u32::try_from(totals.len()).unwrap_or(u32::MAX);
                        view.send_replace(runtime_caps::View { table: table.clone(), synced, gpus });
                        seen = Some((generation, totals));
                        metrics.table_rebuilds.inc();
                        for (budget, error) in &table.invalid_budgets {
                            tracing::debug!(%budget, %error, "budget not enforced: invalid spec");
                        }
                        executor.retain(|uid| table.find_uid(uid).is_some());
                    }
                }
                engine.tick(&table, synced);
                if synced {
                    usage_writer.tick(engine.now(), &table, &engine.usage.pods);
                }
                health.set("gpu", engine.enforcing());
                executor.dispatch(engine.take_actions());
                next.as_mut().reset(started + engine.next_sample());
            }
        }
    }
    tracing::info!("agent stopped");
}

/// `gpubudget-agent run`.
pub async fn run(args: RunArgs) -> anyhow::Result<()> {
    let shutdown = shutdown_on_signal();
    let mut registry = Registry::default();
    let metrics = Metrics::new(&mut registry);
    let health = Health::new(&CHECKS);
    health.register(&mut registry, READY_METRIC);
    let admin = tokio::spawn(serve_admin(args.admin_addr, health.clone(), Arc::new(registry), shutdown.clone()));
    let mut config = kube::Config::infer().await.context("cannot configure the Kubernetes client")?;
    // No retries inside the client: the decisions retry every write with their own backoff, and a 429 on an
    // eviction is an answer (a PodDisruptionBudget refused it) that must reach them at once. kube's default
    // retry layer would resend it for a while, hiding the refusal and holding one of the write slots (found on
    // a real API server by e2e/apiserver; the in-memory API's client has no such layer).
    config.default_retry = false;
    let client = Client::try_from(config).context("cannot build the Kubernetes client")?;
    run_with(args, client, health, metrics, shutdown.clone()).await;
    shutdown.cancel();
    admin.await.context("admin port task")?.context("admin port")?;
    Ok(())
}
