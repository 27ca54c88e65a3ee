//! Leader election through a `coordination.k8s.io` Lease (kube-lease-manager): only the leader writes
//! status. Followers keep their caches warm and take over within the lease duration.

use std::time::Duration;

use gpubudget_daemon::Health;
use kube::Client;
use kube_lease_manager::{LeaseManagerBuilder, LeaseParams};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

/// Readiness check: the lease is being contended for (this replica leads or stands by).
pub const CHECK_LEASE: &str = "leader-election";
/// How long a lease lasts without renewal: the longest a dead leader delays its successor.
pub const LEASE_SECONDS: u64 = 15;
/// The leader renews this long before the lease expires.
pub const GRACE_SECONDS: u64 = 5;

/// Which Lease, and who this replica is.
#[derive(Debug, Clone)]
pub struct Election {
    /// Lease name.
    pub lease_name: String,
    /// Lease namespace (the operator's own).
    pub namespace: String,
    /// This replica's identity (its pod name).
    pub identity: String,
    /// Lease duration, seconds ([`LEASE_SECONDS`]).
    pub lease_seconds: u64,
    /// Renewal margin, seconds, less than `lease_seconds` ([`GRACE_SECONDS`]).
    pub grace_seconds: u64,
}

impl Election {
    /// An election for `lease_name` in `namespace` as `identity`, with the default timings.
    pub fn new(lease_name: impl Into<String>, namespace: impl Into<String>, identity: impl Into<String>) -> Self {
        Self {
            lease_name: lease_name.into(),
            namespace: namespace.into(),
            identity: identity.into(),
            lease_seconds: LEASE_SECONDS,
            grace_seconds: GRACE_SECONDS,
        }
    }
}

/// Takes part in the election until `shutdown`; `leader` says whether this replica holds the lease. On
/// shutdown it stops leading first (so no write follows), then releases the lease for a fast hand-over.
pub async fn run(
    client: Client,
    election: Election,
    leader: watch::Sender<bool>,
    health: Health,
    shutdown: CancellationToken,
) -> anyhow::Result<()> {
    // Valid by construction (kube-lease-manager panics otherwise): duration ≥ 2, 1 ≤ grace < duration.
    let duration = election.lease_seconds.max(2);
    let grace = election.grace_seconds.clamp(1, duration - 1);
    let mut delay = Duration::from_secs(1);
    let manager = loop {
        let built = LeaseManagerBuilder::new(client.clone(), &election.lease_name)
            .with_namespace(&election.namespace)
            .with_parameters(LeaseParams::new(&election.identity, duration, grace))
            .build()
            .await;
        match built {
            Ok(manager) => break manager,
            Err(error) => {
                tracing::warn!(%error, lease = %election.lease_name, namespace = %election.namespace, "cannot set up the leader lease; retrying");
                tokio::select! {
                    () = shutdown.cancelled() => return Ok(()),
                    () = tokio::time::sleep(delay) => {}
                }
                delay = (delay * 2).min(Duration::from_secs(30));
            }
        }
    };
    let (mut state, handle) = manager.watch().await;
    health.set(CHECK_LEASE, true);
    tracing::info!(lease = %election.lease_name, namespace = %election.namespace, identity = %election.identity, "leader election: standing by");
    loop {
        let leading = *state.borrow_and_update();
        if leader.send_replace(leading) != leading {
            if leading {
                tracing::info!(identity = %election.identity, "leader election: this replica leads and writes status");
            } else {
                tracing::info!(identity = %election.identity, "leader election: another replica leads; standing by");
            }
        }
        tokio::select! {
            () = shutdown.cancelled() => break,
            changed = state.changed() => if changed.is_err() {
                leader.send_replace(false);
                health.set(CHECK_LEASE, false);
                let outcome = handle.await;
                anyhow::bail!("the lease manager stopped: {outcome:?}");
            }
        }
    }
    leader.send_replace(false);
    drop(state);
    match tokio::time::timeout(Duration::from_secs(5), handle).await {
        Ok(Ok(Ok(_))) => tracing::info!("leader lease released"),
        Ok(Ok(Err(error))) => tracing::warn!(%error, "cannot release the leader lease; it expires by itself"),
        Ok(Err(error)) => tracing::warn!(%error, "lease manager task failed"),
        Err(_) => tracing::warn!("releasing the leader lease timed out; it expires by itself"),
    }
    Ok(())
}
