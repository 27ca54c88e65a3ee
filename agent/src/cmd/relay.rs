//! `gpubudget-agent runtime-caps-relay`: wires the relay ([`crate::runtime_caps::relay`]) to the runtime's NRI
//! socket and to the agent's socket. No Kubernetes client, no NVML, no port.

use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use gpubudget_daemon::shutdown_on_signal;

use crate::cli::RelayArgs;
use crate::runtime_caps::relay::{self, Relay, RelayPlugin, RelaySettings};
use crate::runtime_caps::{PLUGIN_INDEX, PLUGIN_NAME};

/// Runs the relay until SIGTERM.
pub async fn run(args: RelayArgs) -> anyhow::Result<()> {
    let shutdown = shutdown_on_signal();
    let listener = relay::bind(&args.listen).with_context(|| format!("listening on {}", args.listen.display()))?;
    let settings = RelaySettings {
        unresolved: args.unresolved,
        never_refuse: args.never_refuse.clone(),
        agent_uid: args.agent_uid,
    };
    let relay = Arc::new(Relay::new(settings));
    tracing::info!(nri = %args.nri_socket.display(), listen = %args.listen.display(), agent_uid = ?args.agent_uid, unresolved = ?args.unresolved, "runtime caps relay: starting");
    tokio::spawn(relay.clone().serve_agents(listener, shutdown.clone()));
    let backoff = gpubudget_nri::Backoff::new(Duration::from_millis(250), Duration::from_secs(2));
    let plugin = Arc::new(RelayPlugin(relay));
    gpubudget_nri::run_forever(
        &args.nri_socket,
        PLUGIN_NAME,
        PLUGIN_INDEX,
        plugin,
        backoff,
        shutdown.cancelled_owned(),
    )
    .await;
    let _ = std::fs::remove_file(&args.listen);
    Ok(())
}
