//! `gpubudget-agent run`: the DaemonSet.
//!
//! Four watches feed the decisions: the pods of this node only (`fieldSelector=spec.nodeName=<node>`, listed
//! 100 at a time, each pod cut down by `slim_pod` to what the decisions read as it arrives) and every
//! `GpuMemoryBudget` (all namespaces), compiled as it arrives into a `BudgetCache`, with every
//! `ClusterGpuMemoryBudget` and the labels of every Namespace (their `namespaceSelector` reads them) in a
//! `ClusterCache`. The loop samples every interval, rebuilds its pod table only when a cache changed in a way the table reads (the operator's status
//! writes on budgets do not count, nor budgets of namespaces without pods here:
//! `gpubudget_pod_table_rebuilds_total`), decides, and hands actions to the [`KubeExecutor`] (which never blocks the
//! loop). `/ready` is true once the GPU sampler works and every cache has synced; nothing is enforced
//! before the caches sync.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::Context as _;
use futures::StreamExt as _;
use gpubudget_common::{ClusterGpuMemoryBudget, ClusterGpuMemoryBudgetMirror, GpuMemoryBudget, GpuMemoryBudgetMirror};
use gpubudget_daemon::{Health, serve_admin, shutdown_on_signal};
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{Namespace, Node, Pod};
use kube::runtime::reflector::{self, Store};
use kube::runtime::{WatchStreamExt as _, watcher};
use kube::{Api, Client};
use prometheus_client::registry::Registry;
use tokio::sync::{mpsc, watch};
use tokio_util::sync::CancellationToken;

use gpubudget_common::share::Declaration;

use crate::act::SpecReadLabels;
use crate::act::kube::KubeExecutor;
use crate::act::usage::UsageWriter;
use crate::attribute::ProcAttributor;
use crate::attribute::budgets::{BudgetCache, Change, ClusterCache};
use crate::attribute::driver_limits::DriverReader;
use crate::attribute::mirror_watch;
use crate::attribute::pods::{MIRROR_ANNOTATION, PodTable, PodView, slim_pod};
use crate::attribute::spec_watch::{Scoped, Source, SpecEvent};
use crate::cli::RunArgs;
use crate::decide::{Action, NodeReason, Settings, driver_limits};
use crate::pipeline::Engine;
use crate::report::metrics::{KindLabels, Metrics};
use crate::runtime_caps::{self, Made};
use crate::sample::file::RecordedSampler;
use crate::sample::nvml::NvmlSampler;
use crate::sample::{SamplerFactory, SamplerSlot};
use gpubudget_nvml_limits::DriverLimits;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;

/// Readiness checks.
pub const CHECKS: [&str; 3] = ["gpu", "pods", "budgets"];
/// The readiness checks as a gauge on `/metrics`: `gpubudget_ready{check}` (1 while the check passes).
pub const READY_METRIC: &str = "gpubudget_ready";

/// Pods, budgets and namespaces are listed this many at a time (a page of full objects is held while it is cut down or
/// compiled; kube's default is 500).
pub const LIST_PAGE_SIZE: u32 = 100;

/// How the budget caches read specs: the mirrors' Lease (`None`: the budgets always), and what they report.
#[derive(Debug)]
pub struct Mirroring {
    /// The Lease by which the operator vouches for the mirrors (namespace, name).
    pub lease: Option<(String, String)>,
    /// `gpubudget_budget_spec_reads_total`.
    pub spec_reads: Family<SpecReadLabels, Counter>,
    /// `gpubudget_budget_specs_from_mirrors`.
    pub specs_from_mirrors: Family<KindLabels, Gauge>,
    /// Events on the Node (going back to the budgets).
    pub node_events: mpsc::UnboundedSender<Action>,
}

/// The two caches the agent decides from.
#[derive(Debug, Clone)]
pub struct Caches {
    pods: Store<Pod>,
    budgets: Arc<Mutex<BudgetCache>>,
    cluster: Arc<Mutex<ClusterCache>>,
    changes: Arc<AtomicU64>,
    pods_ready: Arc<AtomicBool>,
    /// The Node's labels were asked for once (read or not): until then the node's enforcement is not known, and
    /// nothing is decided (#54: an observing node's label must be read before its first eviction).
    node_asked: Arc<AtomicBool>,
    /// The Node's labels that say how the device plugin shares its GPUs, and its enforcement label
    /// ([`node_sharing`]); `None` until read.
    sharing: Arc<Mutex<Option<BTreeMap<String, String>>>>,
    /// What the runtime made of pods' GPU containers (`--runtime-caps`): the table reads it as the pods' caps.
    made: Made,
}

/// Runs a watch with the default backoff until `shutdown`, handing each event to `on`.
fn spawn_watch<K, F>(api: Api<K>, config: watcher::Config, name: &'static str, shutdown: CancellationToken, on: F)
where
    K: kube::Resource<DynamicType = ()> + Clone + serde::de::DeserializeOwned + std::fmt::Debug + Send + 'static,
    F: FnMut(watcher::Event<K>) + Send + 'static,
{
    spawn_watch_or(api, config, name, shutdown, on, |_| {});
}

/// [`spawn_watch`], handing each failure to `failed` too (after it is logged).
fn spawn_watch_or<K, F, E>(
    api: Api<K>,
    config: watcher::Config,
    name: &'static str,
    shutdown: CancellationToken,
    mut on: F,
    mut failed: E,
) where
    K: kube::Resource<DynamicType = ()> + Clone + serde::de::DeserializeOwned + std::fmt::Debug + Send + 'static,
    F: FnMut(watcher::Event<K>) + Send + 'static,
    E: FnMut(&watcher::Error) + Send + 'static,
{
    let stream = watcher(api, config).default_backoff();
    tokio::spawn(async move {
        let mut stream = std::pin::pin!(stream);
        loop {
            tokio::select! {
                () = shutdown.cancelled() => break,
                event = stream.next() => match event {
                    Some(Ok(event)) => on(event),
                    Some(Err(error)) => {
                        tracing::warn!(cache = name, %error, "watch failed; retrying with backoff");
                        failed(&error);
                    }
                    None => break,
                },
            }
        }
    });
}

impl Caches {
    /// Starts the watches: the pods of `node` (into a reflector, each pod cut down by [`slim_pod`] as it
    /// arrives), every budget (compiled into a [`BudgetCache`]), and the cluster budgets with the namespaces'
    /// labels they select by (a [`ClusterCache`]).
    pub fn start(
        client: Client,
        node: &str,
        health: Health,
        mirroring: Mirroring,
        shutdown: CancellationToken,
    ) -> Self {
        let Mirroring { lease, spec_reads, specs_from_mirrors, node_events } = mirroring;
        let lease = lease.map(|(namespace, name)| (Api::<Lease>::namespaced(client.clone(), &namespace), name));
        let changes = Arc::new(AtomicU64::new(0));
        let pods_ready = Arc::new(AtomicBool::new(false));
        let (pods, mut writer) = reflector::store::<Pod>();
        {
            let (changes, ready, health) = (changes.clone(), pods_ready.clone(), health.clone());
            spawn_watch(
                Api::<Pod>::all(client.clone()),
                watcher::Config::default().fields(&format!("spec.nodeName={node}")).page_size(LIST_PAGE_SIZE),
                "pods",
                shutdown.clone(),
                move |event: watcher::Event<Pod>| {
                    let listed = matches!(event, watcher::Event::InitDone);
                    writer.apply_watcher_event(&event.modify(slim_pod));
                    changes.fetch_add(1, Ordering::AcqRel);
                    if listed && !ready.swap(true, Ordering::AcqRel) {
                        health.set("pods", true);
                        tracing::info!(cache = "pods", "cache synced");
                    }
                },
            );
        }
        let sharing = Arc::new(Mutex::new(None));
        let node_asked = Arc::new(AtomicBool::new(false));
        {
            let (sharing, changes, shutdown) = (sharing.clone(), changes.clone(), shutdown.clone());
            let asked = node_asked.clone();
            let (nodes, node) = (Api::<Node>::all(client.clone()), node.to_owned());
            tokio::spawn(async move {
                let mut every = tokio::time::interval(NODE_SHARING_EVERY);
                every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
                loop {
                    tokio::select! {
                        () = shutdown.cancelled() => break,
                        _ = every.tick() => {}
                    }
                    if let Some(labels) = node_sharing(&nodes, &node).await {
                        let mut known = lock(&sharing);
                        if known.as_ref() != Some(&labels) {
                            tracing::info!(
                                %node,
                                ?labels,
                                "the Node's GPU sharing and enforcement labels: the pods' shares and evictions follow them"
                            );
                            *known = Some(labels);
                            changes.fetch_add(1, Ordering::AcqRel);
                        }
                    }
                    // After the labels are in: a table built once this is set reads them.
                    asked.store(true, Ordering::Release);
                }
            });
        }
        let budgets = Arc::new(Mutex::new(BudgetCache::default()));
        let cluster = Arc::new(Mutex::new(ClusterCache::default()));
        // `budgets` is ready once the namespaced budgets, the cluster budgets and the namespaces have listed.
        let announce = {
            let (budgets, cluster, health) = (budgets.clone(), cluster.clone(), health.clone());
            let announced = Arc::new(AtomicBool::new(false));
            move || {
                let synced = lock(&budgets).synced() && lock(&cluster).synced();
                if synced && !announced.swap(true, Ordering::AcqRel) {
                    health.set("budgets", true);
                    tracing::info!(cache = "budgets", budgets = lock(&budgets).index().len(), "cache synced");
                }
            }
        };
        {
            let (changes, cache, announce) = (changes.clone(), cluster.clone(), announce.clone());
            let (absent_changes, absent_cache, absent_announce) = (changes.clone(), cluster.clone(), announce.clone());
            let all = Api::<ClusterGpuMemoryBudget>::all(client.clone());
            let scoped: Scoped<ClusterGpuMemoryBudget> = {
                let all = all.clone();
                Arc::new(move |_: &str| all.clone())
            };
            mirror_watch::spawn(
                move || Source { all: all.clone(), scoped: scoped.clone() },
                Api::<ClusterGpuMemoryBudgetMirror>::all(client.clone()),
                lease.clone(),
                LIST_PAGE_SIZE,
                "clusterbudgets",
                shutdown.clone(),
                counted(&spec_reads),
                from_mirrors(&specs_from_mirrors, "ClusterGpuMemoryBudget", node_events.clone()),
                move |event| {
                    let changed = match event {
                        SpecEvent::Event(event) => lock(&cache).apply_budget(&event),
                        SpecEvent::Deleted((_, name)) => lock(&cache).forget_budget(&name),
                    };
                    if changed {
                        changes.fetch_add(1, Ordering::AcqRel);
                    }
                    announce();
                },
                // The ClusterGpuMemoryBudget CRD not installed (an upgrade whose CRDs were not applied first: Helm
                // installs crds/ on first install only): namespaced budgets are enforced all the same, and the
                // watch keeps trying, so cluster budgets are enforced once the CRD is there.
                move |error| {
                    if is_not_found(error) && lock(&absent_cache).budgets_absent() {
                        tracing::warn!(
                            "the ClusterGpuMemoryBudget CRD is not installed (apply charts/gpubudget/crds/): \
                             enforcing namespaced budgets only until it is"
                        );
                        absent_changes.fetch_add(1, Ordering::AcqRel);
                        absent_announce();
                    }
                },
            );
        }
        {
            let (changes, cache, announce, pods) = (changes.clone(), cluster.clone(), announce.clone(), pods.clone());
            spawn_watch(
                Api::<Namespace>::all(client.clone()),
                watcher::Config::default().page_size(LIST_PAGE_SIZE),
                "namespaces",
                shutdown.clone(),
                move |event: watcher::Event<Namespace>| {
                    if rebuilds(&pods, &lock(&cache).apply_namespace(&event)) {
                        changes.fetch_add(1, Ordering::AcqRel);
                    }
                    announce();
                },
            );
        }
        {
            let (changes, cache, pods) = (changes.clone(), budgets.clone(), pods.clone());
            let scoped: Scoped<GpuMemoryBudget> = {
                let client = client.clone();
                Arc::new(move |namespace: &str| Api::<GpuMemoryBudget>::namespaced(client.clone(), namespace))
            };
            let all = Api::<GpuMemoryBudget>::all(client.clone());
            mirror_watch::spawn(
                move || Source { all: all.clone(), scoped: scoped.clone() },
                Api::<GpuMemoryBudgetMirror>::all(client),
                lease,
                LIST_PAGE_SIZE,
                "budgets",
                shutdown,
                counted(&spec_reads),
                from_mirrors(&specs_from_mirrors, "GpuMemoryBudget", node_events),
                move |event| {
                    let mut cache = lock(&cache);
                    let change = match event {
                        SpecEvent::Event(event) => cache.apply(&event),
                        SpecEvent::Deleted((namespace, name)) => cache.forget(&namespace, &name),
                    };
                    if rebuilds(&pods, &change) {
                        changes.fetch_add(1, Ordering::AcqRel);
                    }
                    drop(cache);
                    announce();
                },
                |_| {},
            );
        }
        Self { pods, budgets, cluster, changes, pods_ready, node_asked, sharing, made: Made::default() }
    }

    fn budgets(&self) -> std::sync::MutexGuard<'_, BudgetCache> {
        lock(&self.budgets)
    }

    /// Every cache has its first full list.
    pub fn synced(&self) -> bool {
        self.pods_ready.load(Ordering::Acquire)
            && self.node_asked.load(Ordering::Acquire)
            && self.budgets().synced()
            && lock(&self.cluster).synced()
    }

    /// A counter that moves on every change of either cache that can change the pod table.
    pub fn generation(&self) -> u64 {
        self.changes.load(Ordering::Acquire)
    }

    /// Where what the runtime made is remembered (shared with the NRI plugin).
    pub fn made(&self) -> Made {
        self.made.clone()
    }

    /// The pod table of `node` now, its GPUs holding `gpu_totals` bytes each.
    pub fn table(&self, node: &str, gpu_totals: &[u64]) -> PodTable {
        let pods = self.pods.state();
        let cluster = lock(&self.cluster);
        let sharing = lock(&self.sharing).clone();
        let made = &self.made;
        // The runtime's containers are what the pods' processes started with (their caps win over the spec's);
        // those of pods no longer here are forgotten (a static pod's by its mirror's annotation).
        if !made.is_empty() {
            let here: std::collections::HashSet<String> = pods
                .iter()
                .flat_map(|p| {
                    let meta = &p.metadata;
                    let mirror = meta.annotations.as_ref().and_then(|a| a.get(MIRROR_ANNOTATION));
                    meta.uid.iter().chain(mirror).map(|u| u.to_ascii_lowercase())
                })
                .collect();
            made.retain_pods(|uid| here.contains(uid));
        }
        let label = sharing.as_ref().and_then(|l| l.get(gpubudget_common::enforcement::NODE_LABEL));
        let node_enforcement = gpubudget_common::enforcement::parse_label(label.map(String::as_str)).ok().flatten();
        let mut table = PodTable::from_index(
            pods.iter().filter_map(|p| PodView::from_pod(p)).map(|mut v| {
                v.share = std::mem::replace(&mut v.share, Declaration::None).on_node(sharing.as_ref());
                let by_runtime = made.summary(&v.uid).or_else(|| v.mirror_of.as_deref().and_then(|m| made.summary(m)));
                if let Some((record, cap)) = by_runtime {
                    v.mps_cap_mib = cap;
                    v.runtime_caps = Some(record);
                }
                v
            }),
            self.budgets().index(),
            cluster.index(),
            Some(node),
            gpu_totals,
        );
        table.node_enforcement = node_enforcement;
        table
    }
}

/// Whether a change of the budgets or namespaces changes the pod table of a node with `pods`: a change in a
/// namespace without pods here does not (a pod that arrives there later is a pod change, and the table built
/// then reads the budgets and labels as they are).
fn rebuilds(pods: &reflector::Store<Pod>, change: &Change) -> bool {
    match change {
        Change::Nothing => false,
        Change::In(namespace) => {
            pods.state().iter().any(|p| p.metadata.namespace.as_deref() == Some(namespace.as_str()))
        }
        Change::Everything => true,
    }
}

/// The list or watch was answered 404: the resource (a CRD) is not installed.
fn is_not_found(error: &watcher::Error) -> bool {
    match error {
        watcher::Error::InitialListFailed(kube::Error::Api(status))
        | watcher::Error::WatchStartFailed(kube::Error::Api(status))
        | watcher::Error::WatchFailed(kube::Error::Api(status)) => status.code == 404,
        watcher::Error::WatchError(status) => status.code == 404,
        _ => false,
    }
}

/// Sets `gpubudget_budget_specs_from_mirrors{kind}`; going back to the budgets is told on the Node.
fn from_mirrors(
    gauge: &Family<KindLabels, Gauge>,
    kind: &'static str,
    node_events: mpsc::UnboundedSender<Action>,
) -> impl Fn(bool, Option<&str>) + Send + 'static {
    let gauge = gauge.clone();
    move |mirrors, why| {
        gauge.get_or_create(&KindLabels { kind: kind.to_owned() }).set(i64::from(mirrors));
        if let Some(why) = why {
            let note = format!(
                "{kind}: reading the budgets themselves again, not their mirrors: {why}; every budget's current \
                 spec is enforced on this node once they have listed"
            );
            let _ = node_events.send(Action::NodeEvent { reason: NodeReason::MirrorsNotCurrent, note });
        }
    }
}

/// Counts a budget spec read in `gpubudget_budget_spec_reads_total{kind,result}`.
fn counted(reads: &Family<SpecReadLabels, Counter>) -> impl Fn(&'static str, bool) + Send + 'static {
    let reads = reads.clone();
    move |kind, ok| {
        let result = if ok { "ok" } else { "error" };
        reads.get_or_create(&SpecReadLabels { kind: kind.to_owned(), result: result.to_owned() }).inc();
    }
}

/// A cache's lock, even if a watch task panicked holding it (the cache is whole between events).
fn lock<T>(cache: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    cache.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// The sampler factory for `--sample-file` or NVML.
pub fn sampler_factory(sample_file: Option<&std::path::Path>) -> SamplerFactory {
    match sample_file {
        Some(path) => RecordedSampler::factory(path.to_owned()),
        None => NvmlSampler::factory(),
    }
}

/// How often the Node's GPU sharing labels are read again: GPU feature discovery changes them when an
/// administrator changes the device plugin's sharing (rarely); a `get` of one Node needs no watch on all Nodes.
const NODE_SHARING_EVERY: Duration = Duration::from_secs(60);

/// The labels of `node` that say how the device plugin shares its GPUs (GPU feature discovery's strategy and
/// replicas; a share budget reads a pod's MPS replicas from them) and whether it enforces or observes (#54:
/// `gpubudget.io/enforcement`, warned about when it is neither `Observe` nor `Enforce`), or `None`, with a warning, when the Node
/// cannot be read in 10 s (the last labels read stay).
async fn node_sharing(nodes: &Api<Node>, node: &str) -> Option<BTreeMap<String, String>> {
    use gpubudget_common::enforcement;
    use gpubudget_common::share::{REPLICAS, SHARING_STRATEGY};
    match tokio::time::timeout(Duration::from_secs(10), nodes.get_metadata(node)).await {
        Ok(Ok(n)) => {
            let mut labels = n.metadata.labels.unwrap_or_default();
            labels.retain(|k, _| k == SHARING_STRATEGY || k == REPLICAS || k == enforcement::NODE_LABEL);
            if let Err(why) = enforcement::parse_label(labels.get(enforcement::NODE_LABEL).map(String::as_str)) {
                tracing::warn!(%node, %why, "the agent's --enforcement applies on this node");
            }
            Some(labels)
        }
        Ok(Err(error)) => {
            tracing::warn!(%node, %error, "cannot read the Node's labels: MPS replicas' shares as last read");
            None
        }
        Err(_) => {
            tracing::warn!(%node, "the Node's labels not read in 10s: MPS replicas' shares as last read");
            None
        }
    }
}

/// The agent's main loop, until `shutdown`.
pub async fn run_with(args: RunArgs, client: Client, health: Health, metrics: Metrics, shutdown: CancellationToken) {
    let node = args.node_name.clone();
    // The driver's per-cgroup limits, once per start (not when replaying a sample file: no driver then).
    let detected = args.sample_file.is_none().then(DriverLimits::open);
    let (node_events_tx, mut node_events) = mpsc::unbounded_channel();
    let caches = Caches::start(
        client.clone(),
        &node,
        health.clone(),
        Mirroring {
            lease: args.mirrors_lease.clone(),
            spec_reads: metrics.spec_reads.clone(),
            specs_from_mirrors: metrics.specs_from_mirrors.clone(),
            node_events: node_events_tx.clone(),
        },
        shutdown.clone(),
    );
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
            caches.made(),
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
                let synced = caches.synced();
                if synced {
                    let generation = caches.generation();
                    if !seen.as_ref().is_some_and(|(g, totals)| *g == generation && engine.gpu_totals_are(totals)) {
                        let totals = engine.gpu_totals();
                        table = Arc::new(caches.table(&node, &totals));
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
