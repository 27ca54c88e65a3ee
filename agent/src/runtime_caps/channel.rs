//! The agent's end of the relay's channel ([`super::wire`]): connects to the relay's socket, answers each question
//! in its own task (a creation waiting for its pod's budget delays no other), and reconnects with back-off.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt as _;
use tokio::net::UnixStream;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use super::RuntimeCaps;
use super::wire::{self, Answer, Call, Request, Response};

/// The answer to one question of the relay.
pub async fn answer(caps: &RuntimeCaps, call: Call) -> Answer {
    match call {
        Call::Existing { pod, container } => {
            caps.existing(&pod.to_nri(), &container.to_nri()).await;
            Answer::Done
        }
        Call::Create { pod, container, wait_ms } => {
            let result = caps.create(&pod.to_nri(), &container.to_nri(), Duration::from_millis(wait_ms)).await;
            Answer::of(result)
        }
        Call::Created { pod, container } => {
            caps.created(&pod.to_nri(), &container.to_nri()).await;
            Answer::Done
        }
    }
}

/// Serves the relay on `stream` until it closes or `shutdown`.
pub async fn serve(stream: UnixStream, caps: Arc<RuntimeCaps>, shutdown: &CancellationToken) -> Result<(), String> {
    let (rd, wr) = stream.into_split();
    let (out, mut queue) = mpsc::channel::<String>(256);
    let writer = async { wire::write_lines(wr, &mut queue).await.map_err(|e| format!("writing to the relay: {e}")) };
    let reader = async {
        let mut frames = wire::lines(rd);
        while let Some(line) = frames.next().await {
            let line = line.map_err(|e| format!("reading from the relay: {e}"))?;
            let request: Request =
                serde_json::from_str(&line).map_err(|e| format!("not a question of the relay: {e}"))?;
            let (caps, out) = (caps.clone(), out.clone());
            tokio::spawn(async move {
                let answer = self::answer(&caps, request.call).await;
                let line = serde_json::to_string(&Response { id: request.id, answer }).expect("an answer serializes");
                let _ = out.send(line).await;
            });
        }
        Ok(())
    };
    tokio::select! {
        () = shutdown.cancelled() => Ok(()),
        r = writer => r,
        r = reader => r,
    }
}

/// Connects to the relay at `socket` and serves it, again and again with back-off, until `shutdown`.
pub async fn run_forever(socket: &Path, caps: Arc<RuntimeCaps>, shutdown: CancellationToken) {
    let mut backoff = gpubudget_nri::Backoff::new(Duration::from_millis(100), Duration::from_secs(2));
    loop {
        let started = tokio::time::Instant::now();
        let ended = match UnixStream::connect(socket).await {
            Ok(stream) => {
                tracing::info!(socket = %socket.display(), "runtime caps: connected to the relay");
                caps.metrics.registrations.inc();
                serve(stream, caps.clone(), &shutdown).await
            }
            Err(e) => Err(format!("connecting to {}: {e}", socket.display())),
        };
        if shutdown.is_cancelled() {
            return;
        }
        match ended {
            Ok(()) => tracing::warn!("runtime caps: the relay closed the connection"),
            Err(e) => tracing::warn!(error = %e, "runtime caps: no connection to the relay"),
        }
        if started.elapsed() >= Duration::from_secs(2) {
            backoff.reset();
        }
        tokio::select! {
            () = shutdown.cancelled() => return,
            () = tokio::time::sleep(backoff.next_delay()) => {}
        }
    }
}
