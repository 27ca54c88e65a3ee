//! One shutdown signal for the whole process.

use tokio_util::sync::CancellationToken;

/// A token cancelled on SIGTERM or Ctrl-C. Every task selects on it (or a child token) and returns.
pub fn shutdown_on_signal() -> CancellationToken {
    let token = CancellationToken::new();
    let trigger = token.clone();
    tokio::spawn(async move {
        let ctrl_c = tokio::signal::ctrl_c();
        #[cfg(unix)]
        {
            match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
                Ok(mut term) => {
                    tokio::select! {
                        _ = ctrl_c => tracing::info!("interrupt received, shutting down"),
                        _ = term.recv() => tracing::info!("SIGTERM received, shutting down"),
                        () = trigger.cancelled() => return,
                    }
                }
                Err(error) => {
                    tracing::warn!(%error, "cannot listen for SIGTERM; only Ctrl-C stops the process");
                    tokio::select! {
                        _ = ctrl_c => tracing::info!("interrupt received, shutting down"),
                        () = trigger.cancelled() => return,
                    }
                }
            }
        }
        #[cfg(not(unix))]
        {
            let _ = ctrl_c.await;
        }
        trigger.cancel();
    });
    token
}
