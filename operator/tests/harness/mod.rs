//! The operator's controller run in-process against the in-memory API (gpubudget-testkit), shared by the
//! integration tests that need one (`mod harness;`). Each test binary uses part of it.
#![allow(dead_code)]

use std::sync::Arc;
use std::time::Duration;

use gpubudget_daemon::Health;
use gpubudget_operator::controller::{self, CHECK_BUDGETS, CHECK_PODS, Context, Settings};
use gpubudget_operator::metrics::Metrics;
use gpubudget_testkit::{FakeApi, wait_for};
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

/// How long a test waits for anything.
pub const WAIT: Duration = Duration::from_secs(10);

/// One operator replica: its context, its health, the leadership it is told, and its task.
pub struct Operator {
    pub ctx: Arc<Context>,
    pub health: Health,
    pub leader: watch::Sender<bool>,
    pub shutdown: CancellationToken,
    task: JoinHandle<anyhow::Result<()>>,
}

impl Operator {
    /// Starts the controller on `fake`, leader or not.
    pub fn start(fake: &FakeApi, leader: bool) -> Self {
        Self::start_with(fake, leader, Settings::default())
    }

    /// [`Operator::start`] with these settings (retries always start after 20 ms).
    pub fn start_with(fake: &FakeApi, leader: bool, settings: Settings) -> Self {
        let (tx, rx) = watch::channel(leader);
        let settings = Settings { min_backoff: Duration::from_millis(20), instance: Some("test".into()), ..settings };
        let ctx = Arc::new(Context::new(fake.client(), Metrics::default(), rx, settings));
        let health = Health::new(&[CHECK_PODS, CHECK_BUDGETS]);
        let shutdown = CancellationToken::new();
        let task = tokio::spawn(controller::run(ctx.clone(), health.clone(), shutdown.clone()));
        Self { ctx, health, leader: tx, shutdown, task }
    }

    /// Signals shutdown and waits for a clean stop.
    pub async fn stop(self) {
        self.shutdown.cancel();
        tokio::time::timeout(WAIT, self.task).await.expect("stops in time").expect("joins").expect("runs cleanly");
    }

    /// Waits until both caches have synced.
    pub async fn synced(&self) {
        assert!(wait_for(WAIT, || self.health.is_ready()).await, "caches never synced: {}", self.health.report());
    }
}

/// What the agent writes on a pod (its record), as the agent's annotations.
pub fn record(
    fake: &FakeApi,
    namespace: &str,
    name: &str,
    state: &str,
    usage: u64,
    budget: &str,
    evicted_at: Option<&str>,
) {
    fake.modify("pods", namespace, name, |pod| {
        let annotations = &mut pod["metadata"]["annotations"];
        annotations["gpubudget.io/state"] = state.into();
        annotations["gpubudget.io/usage-bytes"] = usage.to_string().into();
        annotations["gpubudget.io/budget"] = budget.into();
        annotations["gpubudget.io/node"] = "gpu-1".into();
        if let Some(at) = evicted_at {
            annotations["gpubudget.io/eviction-requested-at"] = at.into();
        }
    })
    .expect("pod exists");
}
