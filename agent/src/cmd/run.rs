//! `gpubudget-agent run`: the DaemonSet.
//!
//! Two reflectors feed the decisions: every `GpuMemoryBudget` (all namespaces) and the pods of this node
//! only (`fieldSelector=spec.nodeName=<node>`), each object cut down to what the decisions read as it arrives
//! (`slim_pod`, `slim_budget`: no status of budgets, no spec of pods beyond node, priority and grace). The loop samples every interval, rebuilds its pod table
//! only when a cache changed, decides, and hands actions to the [`KubeExecutor`] (which never blocks the
//! loop). `/ready` is true once the GPU sampler works and both caches have synced; nothing is enforced
//! before the caches sync.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use anyhow::Context as _;
use futures::StreamExt as _;
use gpubudget_common::GpuMemoryBudget;
use gpubudget_daemon::{Health, serve_admin, shutdown_on_signal};
use k8s_openapi::api::core::v1::Pod;
use kube::runtime::reflector::{self, Store};
use kube::runtime::{WatchStreamExt as _, watcher};
use kube::{Api, Client};
use prometheus_client::registry::Registry;
use tokio_util::sync::CancellationToken;

use crate::act::kube::KubeExecutor;
use crate::attribute::ProcAttributor;
use crate::attribute::pods::{PodTable, PodView, slim_budget, slim_pod};
use crate::cli::RunArgs;
use crate::decide::Settings;
use crate::pipeline::Engine;
use crate::report::metrics::Metrics;
use crate::sample::file::RecordedSampler;
use crate::sample::nvml::NvmlSampler;
use crate::sample::{SamplerFactory, SamplerSlot};

/// Readiness checks.
pub const CHECKS: [&str; 3] = ["gpu", "pods", "budgets"];

/// The two caches the agent decides from.
#[derive(Debug, Clone)]
pub struct Caches {
    pods: Store<Pod>,
    budgets: Store<GpuMemoryBudget>,
    changes: Arc<AtomicU64>,
    pods_ready: Arc<AtomicBool>,
    budgets_ready: Arc<AtomicBool>,
}

/// What the agent's caches keep of an object, and which of its watch events can change the pod table.
trait Cached: Sized {
    fn slim(&mut self);

    /// Whether `event` can change the pod table (`seen`: what this watch saw before). Every event, unless the
    /// kind says otherwise.
    fn changes_table(_seen: &mut HashMap<String, Option<i64>>, _event: &watcher::Event<Self>) -> bool {
        true
    }
}

impl Cached for Pod {
    fn slim(&mut self) {
        slim_pod(self);
    }
}

impl Cached for GpuMemoryBudget {
    fn slim(&mut self) {
        slim_budget(self);
    }

    fn changes_table(seen: &mut HashMap<String, Option<i64>>, event: &watcher::Event<Self>) -> bool {
        budget_changes_table(seen, event)
    }
}

/// Whether a budget's watch event can change the pod table: a new budget, a deleted one, a new `generation`
/// (the API server moves it on spec changes only), or a relist. The operator's status writes move only
/// `resourceVersion`: they do not make every agent rebuild its table. Pure.
pub fn budget_changes_table(seen: &mut HashMap<String, Option<i64>>, event: &watcher::Event<GpuMemoryBudget>) -> bool {
    let key = |b: &GpuMemoryBudget| b.metadata.uid.clone().unwrap_or_else(|| b.key());
    match event {
        watcher::Event::Apply(b) | watcher::Event::InitApply(b) => {
            seen.insert(key(b), b.metadata.generation) != Some(b.metadata.generation)
        }
        watcher::Event::Delete(b) => {
            seen.remove(&key(b));
            true
        }
        watcher::Event::Init | watcher::Event::InitDone => true,
    }
}

fn spawn_reflector<K>(
    api: Api<K>,
    config: watcher::Config,
    name: &'static str,
    changes: Arc<AtomicU64>,
    ready: Arc<AtomicBool>,
    health: Health,
    shutdown: CancellationToken,
) -> Store<K>
where
    K: kube::Resource<DynamicType = ()>
        + Cached
        + Clone
        + serde::de::DeserializeOwned
        + std::fmt::Debug
        + Send
        + Sync
        + 'static,
{
    let (reader, writer) = reflector::store();
    let stream = watcher(api, config)
        .default_backoff()
        // Only what the decisions read is kept (managed fields alone are the largest part of most objects).
        .modify(K::slim)
        .reflect(writer);
    let mut seen = HashMap::new();
    let waiter = reader.clone();
    tokio::spawn(async move {
        if waiter.wait_until_ready().await.is_ok() {
            ready.store(true, Ordering::Release);
            health.set(name, true);
            tracing::info!(cache = name, "cache synced");
        }
    });
    tokio::spawn(async move {
        let mut stream = std::pin::pin!(stream);
        loop {
            tokio::select! {
                () = shutdown.cancelled() => break,
                event = stream.next() => match event {
                    Some(Ok(event)) => {
                        if K::changes_table(&mut seen, &event) {
                            changes.fetch_add(1, Ordering::AcqRel);
                        }
                    }
                    Some(Err(error)) => tracing::warn!(cache = name, %error, "watch failed; retrying with backoff"),
                    None => break,
                },
            }
        }
    });
    reader
}

impl Caches {
    /// Starts the reflectors: all budgets, and the pods of `node`.
    pub fn start(client: Client, node: &str, health: Health, shutdown: CancellationToken) -> Self {
        let changes = Arc::new(AtomicU64::new(0));
        let pods_ready = Arc::new(AtomicBool::new(false));
        let budgets_ready = Arc::new(AtomicBool::new(false));
        let pods = spawn_reflector(
            Api::<Pod>::all(client.clone()),
            watcher::Config::default().fields(&format!("spec.nodeName={node}")),
            "pods",
            changes.clone(),
            pods_ready.clone(),
            health.clone(),
            shutdown.clone(),
        );
        let budgets = spawn_reflector(
            Api::<GpuMemoryBudget>::all(client),
            watcher::Config::default(),
            "budgets",
            changes.clone(),
            budgets_ready.clone(),
            health,
            shutdown,
        );
        Self { pods, budgets, changes, pods_ready, budgets_ready }
    }

    /// Both caches have their first full list.
    pub fn synced(&self) -> bool {
        self.pods_ready.load(Ordering::Acquire) && self.budgets_ready.load(Ordering::Acquire)
    }

    /// A counter that moves on every change of either cache.
    pub fn generation(&self) -> u64 {
        self.changes.load(Ordering::Acquire)
    }

    /// The pod table of `node` now.
    pub fn table(&self, node: &str) -> PodTable {
        let pods = self.pods.state();
        let budgets = self.budgets.state();
        PodTable::build(pods.iter().filter_map(|p| PodView::from_pod(p)), budgets.iter().map(|b| &**b), Some(node))
    }
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
    let caches = Caches::start(client.clone(), &node, health.clone(), shutdown.clone());
    let mut engine = Engine::new(
        SamplerSlot::new(sampler_factory(args.sample_file.as_deref())),
        ProcAttributor::new(&args.sample.proc_root),
        {
            let mut settings = Settings::new(&node);
            args.pressure.apply(&mut settings);
            args.accounting.apply(&mut settings);
            settings
        },
        metrics.clone(),
    );
    let (mut executor, mut feedback) = KubeExecutor::new(client, &node, metrics.act.clone());
    let mut interval = tokio::time::interval(args.sample.interval);
    interval.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut table = PodTable::default();
    let mut seen: Option<u64> = None;
    tracing::info!(%node, interval = ?args.sample.interval, proc_root = %args.sample.proc_root.display(), "agent running");
    loop {
        tokio::select! {
            () = shutdown.cancelled() => break,
            Some(report) = feedback.recv() => {
                engine.feedback(report);
                executor.dispatch(engine.take_actions());
            }
            _ = interval.tick() => {
                let synced = caches.synced();
                if synced {
                    let generation = caches.generation();
                    if seen != Some(generation) {
                        seen = Some(generation);
                        table = caches.table(&node);
                        for (budget, error) in &table.invalid_budgets {
                            tracing::debug!(%budget, %error, "budget not enforced: invalid spec");
                        }
                        executor.retain(|uid| table.find_uid(uid).is_some());
                    }
                }
                engine.tick(&table, synced);
                health.set("gpu", engine.enforcing());
                executor.dispatch(engine.take_actions());
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

#[cfg(test)]
mod tests {
    use super::*;

    fn budget(uid: &str, generation: i64, matched: i64) -> GpuMemoryBudget {
        serde_json::from_value(serde_json::json!({
            "apiVersion": "gpubudget.io/v1alpha1", "kind": "GpuMemoryBudget",
            "metadata": {"name": "b", "namespace": "ns", "uid": uid, "generation": generation},
            "spec": {"selector": {}, "limit": "8Gi"},
            "status": {"matchedPods": matched},
        }))
        .expect("budget")
    }

    /// A status write (same generation) changes nothing for the agent; a spec change, a new budget, a deletion
    /// and a relist do.
    #[test]
    fn only_spec_changes_new_and_deleted_budgets_rebuild_the_table() {
        let mut seen = HashMap::new();
        let mut changes = |e: watcher::Event<GpuMemoryBudget>| budget_changes_table(&mut seen, &e);
        assert!(changes(watcher::Event::Init));
        assert!(changes(watcher::Event::InitApply(budget("u1", 1, 0))));
        assert!(changes(watcher::Event::InitDone));
        assert!(!changes(watcher::Event::Apply(budget("u1", 1, 3))), "a status write");
        assert!(!changes(watcher::Event::Apply(budget("u1", 1, 4))), "another status write");
        assert!(changes(watcher::Event::Apply(budget("u1", 2, 4))), "a spec change");
        assert!(changes(watcher::Event::Apply(budget("u2", 1, 0))), "a new budget");
        assert!(changes(watcher::Event::Delete(budget("u2", 1, 0))), "a deletion");
        assert!(changes(watcher::Event::Apply(budget("u2", 1, 0))), "created again");
    }
}
