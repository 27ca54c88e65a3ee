//! The plugin side of NRI: the [`Plugin`] trait and the connection that serves it.

use std::future::Future;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::BytesMut;
use prost::Message as _;
use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt};
use tokio::net::UnixStream;
use tokio::sync::mpsc;
use tokio::task::JoinSet;
use tokio::time::{self, Instant};
use tracing::{debug, info, warn};

use crate::Error;
use crate::api::{self, Container, ContainerAdjustment, ContainerUpdate, EventMask, PodSandbox, StateChangeEvent};
use crate::mux::{self, FrameReader, PLUGIN_SERVICE_CONN, RUNTIME_SERVICE_CONN};
use crate::ttrpc::{self, Code, Message, Status, TYPE_REQUEST, TYPE_RESPONSE};

/// How long the plugin waits for the runtime to answer its registration (the runtime's own default).
pub const REGISTRATION_TIMEOUT: Duration = Duration::from_secs(5);
/// The NRI version this crate's messages follow, sent at registration (the runtime only logs it).
pub const NRI_VERSION: &str = "v0.12.0";

/// What an NRI plugin decides. Every method but [`configure`](Plugin::configure) has a default that changes
/// nothing. Calls run concurrently, each in its own task; the runtime gives each a deadline (2 s by default): a
/// call that misses it makes the runtime drop the plugin and carry on without it.
pub trait Plugin: Send + Sync + 'static {
    /// The runtime's first call: which events to receive. An empty mask subscribes to *every* event (the
    /// runtime's rule).
    fn configure(&self, req: api::ConfigureRequest) -> impl Future<Output = EventMask> + Send;

    /// The pods and containers that exist when the plugin connects (parts the runtime split are joined here);
    /// returns updates to existing containers.
    fn synchronize(
        &self,
        _pods: Vec<PodSandbox>,
        _containers: Vec<Container>,
    ) -> impl Future<Output = Vec<ContainerUpdate>> + Send {
        async { Vec::new() }
    }

    /// A container is about to be created: its adjustment, or `Err(reason)` to refuse the creation (the runtime
    /// fails the container with the reason).
    fn create_container(
        &self,
        _pod: PodSandbox,
        _container: Container,
    ) -> impl Future<Output = Result<ContainerAdjustment, String>> + Send {
        async { Ok(ContainerAdjustment::default()) }
    }

    /// A container's resources are about to change; returns updates.
    fn update_container(&self, _req: api::UpdateContainerRequest) -> impl Future<Output = Vec<ContainerUpdate>> + Send {
        async { Vec::new() }
    }

    /// A container is stopping; returns updates to other containers.
    fn stop_container(
        &self,
        _pod: PodSandbox,
        _container: Container,
    ) -> impl Future<Output = Vec<ContainerUpdate>> + Send {
        async { Vec::new() }
    }

    /// Any other subscribed event (pod run/stop/remove, container post-create, start, post-start, post-update,
    /// remove, pod updates).
    fn state_change(&self, _event: StateChangeEvent) -> impl Future<Output = ()> + Send {
        async {}
    }

    /// The runtime is shutting the plugin down; it closes the connection next.
    fn shutdown(&self) -> impl Future<Output = ()> + Send {
        async {}
    }
}

/// Connects to the runtime's NRI socket and serves `plugin` there until the runtime closes the connection
/// (`Ok`), the connection fails (`Err`) or `shutdown` completes (`Ok`). See [`serve`].
pub async fn run<P: Plugin>(
    socket: &Path,
    name: &str,
    idx: &str,
    plugin: Arc<P>,
    shutdown: impl Future<Output = ()>,
) -> Result<(), Error> {
    let stream = UnixStream::connect(socket)
        .await
        .map_err(|source| Error::Connect { path: socket.display().to_string(), source })?;
    serve(stream, name, idx, plugin, shutdown).await
}

/// Serves `plugin` over an already connected NRI socket: registers as `name` with index `idx` (two digits,
/// `00`..`99`; lower runs first), then answers the runtime's calls, each in its own task, so a slow handler
/// delays neither the reading of the socket nor other calls. Returns `Ok` when the runtime closes the connection
/// or `shutdown` completes; in-flight calls are abandoned then.
pub async fn serve<S: AsyncRead + AsyncWrite + Send + 'static, P: Plugin>(
    stream: S,
    name: &str,
    idx: &str,
    plugin: Arc<P>,
    shutdown: impl Future<Output = ()>,
) -> Result<(), Error> {
    let (rd, wr) = tokio::io::split(stream);
    let mut reader = FrameReader::new(rd);
    let (out, out_rx) = mpsc::channel(64);
    let writer = write_frames(wr, out_rx);
    let registration = api::RegisterPluginRequest {
        plugin_name: name.to_owned(),
        plugin_idx: idx.to_owned(),
        nri_version: NRI_VERSION.to_owned(),
    };
    let request = ttrpc::Request {
        service: api::RUNTIME_SERVICE.to_owned(),
        method: "RegisterPlugin".to_owned(),
        payload: registration.encode_to_vec().into(),
        timeout_nano: REGISTRATION_TIMEOUT.as_nanos() as i64,
        metadata: Vec::new(),
    };
    const REGISTRATION_STREAM: u32 = 1;
    let _ = out.send(frames(RUNTIME_SERVICE_CONN, REGISTRATION_STREAM, TYPE_REQUEST, request.encode_to_vec())).await;
    let registration_deadline = time::sleep(REGISTRATION_TIMEOUT);
    let mut registered = false;

    let (mut from_runtime, mut to_plugin) = (BytesMut::new(), BytesMut::new());
    let sync = Arc::new(Mutex::new(SyncParts::default()));
    let mut calls = JoinSet::new();
    tokio::pin!(shutdown, writer, registration_deadline);
    loop {
        tokio::select! {
            () = &mut shutdown => return Ok(()),
            result = &mut writer => return result,
            () = &mut registration_deadline, if !registered => {
                return Err(Error::RegistrationTimeout(REGISTRATION_TIMEOUT));
            }
            Some(joined) = calls.join_next() => {
                if let Err(e) = joined {
                    // The runtime gets no answer and drops the plugin at its deadline.
                    warn!(error = %e, "an NRI call's handler panicked");
                }
            }
            frame = reader.next() => {
                let Some(frame) = frame? else { return Ok(()) };
                match frame.conn {
                    PLUGIN_SERVICE_CONN => {
                        to_plugin.extend_from_slice(&frame.payload);
                        while let Some(msg) = Message::decode(&mut to_plugin)? {
                            if msg.kind != TYPE_REQUEST || msg.stream_id % 2 == 0 {
                                return Err(Error::Protocol(format!(
                                    "message type {} on stream {} of the plugin service", msg.kind, msg.stream_id
                                )));
                            }
                            calls.spawn(answer(plugin.clone(), sync.clone(), msg, out.clone()));
                        }
                    }
                    RUNTIME_SERVICE_CONN => {
                        from_runtime.extend_from_slice(&frame.payload);
                        while let Some(msg) = Message::decode(&mut from_runtime)? {
                            if msg.kind != TYPE_RESPONSE || msg.stream_id != REGISTRATION_STREAM || registered {
                                return Err(Error::Protocol(format!(
                                    "message type {} on stream {} of the runtime service", msg.kind, msg.stream_id
                                )));
                            }
                            let response = ttrpc::Response::decode(msg.data)
                                .map_err(|source| Error::Decode { what: "RegisterPlugin response", source })?;
                            if let Some(status) = response.status.filter(|s| s.code != Code::Ok as i32) {
                                return Err(Error::Registration(status));
                            }
                            registered = true;
                            info!(name, idx, "registered with the NRI runtime");
                        }
                    }
                    other => debug!(conn = other, "dropping a frame for an unknown mux connection"),
                }
            }
        }
    }
}

/// Synchronize parts received so far (the runtime sends `more: true` on all but the last).
#[derive(Debug, Default)]
struct SyncParts {
    pods: Vec<PodSandbox>,
    containers: Vec<Container>,
}

/// Answers one call of the runtime: decodes, dispatches to the plugin, queues the response.
async fn answer<P: Plugin>(plugin: Arc<P>, sync: Arc<Mutex<SyncParts>>, msg: Message, out: mpsc::Sender<BytesMut>) {
    let started = Instant::now();
    let (method, result) = match ttrpc::Request::decode(msg.data) {
        Ok(req) if req.service == api::PLUGIN_SERVICE => {
            let result = dispatch(&*plugin, &sync, &req.method, req.payload).await;
            (req.method, result)
        }
        Ok(req) => (req.method, Err(Status::new(Code::Unimplemented, format!("service {} not found", req.service)))),
        Err(e) => (String::new(), Err(Status::new(Code::InvalidArgument, format!("decoding the request: {e}")))),
    };
    let response = match result {
        // The Response envelope adds a tag and a length (at most 6 bytes) to the payload.
        Ok(payload) if ttrpc::check_len(payload.len() + 16).is_ok() => {
            ttrpc::Response { status: None, payload: payload.into() }
        }
        Ok(payload) => ttrpc::Response {
            status: Some(Status::new(Code::ResourceExhausted, format!("{} bytes of response", payload.len()))),
            payload: Default::default(),
        },
        Err(status) => ttrpc::Response { status: Some(status), payload: Default::default() },
    };
    debug!(method, micros = started.elapsed().as_micros() as u64, ok = response.status.is_none(), "answered");
    // The only failure: the connection is gone, and `serve` reports why.
    let _ = out.send(frames(PLUGIN_SERVICE_CONN, msg.stream_id, TYPE_RESPONSE, response.encode_to_vec())).await;
}

/// Runs one `Plugin` service method; the encoded response message, or the error status to answer with.
async fn dispatch<P: Plugin>(
    plugin: &P,
    sync: &Mutex<SyncParts>,
    method: &str,
    payload: bytes::Bytes,
) -> Result<Vec<u8>, Status> {
    fn decode<M: prost::Message + Default>(payload: bytes::Bytes) -> Result<M, Status> {
        M::decode(payload).map_err(|e| Status::new(Code::InvalidArgument, format!("decoding the request: {e}")))
    }
    let encoded = match method {
        "Configure" => {
            let events = plugin.configure(decode(payload)?).await;
            api::ConfigureResponse { events: events.0 }.encode_to_vec()
        }
        "Synchronize" => {
            let req: api::SynchronizeRequest = decode(payload)?;
            let parts = {
                let mut parts = sync.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
                parts.pods.extend(req.pods);
                parts.containers.extend(req.containers);
                if req.more {
                    return Ok(api::SynchronizeResponse { update: Vec::new(), more: true }.encode_to_vec());
                }
                std::mem::take(&mut *parts)
            };
            let update = plugin.synchronize(parts.pods, parts.containers).await;
            api::SynchronizeResponse { update, more: false }.encode_to_vec()
        }
        "CreateContainer" => {
            let req: api::CreateContainerRequest = decode(payload)?;
            let adjust = plugin
                .create_container(req.pod.unwrap_or_default(), req.container.unwrap_or_default())
                .await
                .map_err(|reason| Status::new(Code::PermissionDenied, reason))?;
            api::CreateContainerResponse { adjust: Some(adjust), ..Default::default() }.encode_to_vec()
        }
        "UpdateContainer" => {
            let update = plugin.update_container(decode(payload)?).await;
            api::UpdateContainerResponse { update, evict: Vec::new() }.encode_to_vec()
        }
        "StopContainer" => {
            let req: api::StopContainerRequest = decode(payload)?;
            let update = plugin.stop_container(req.pod.unwrap_or_default(), req.container.unwrap_or_default()).await;
            api::StopContainerResponse { update }.encode_to_vec()
        }
        "StateChange" => {
            plugin.state_change(decode(payload)?).await;
            Vec::new()
        }
        "Shutdown" => {
            plugin.shutdown().await;
            Vec::new()
        }
        // Accepts every adjustment: only reached when `configure` subscribed to everything.
        "ValidateContainerAdjustment" => Vec::new(),
        other => {
            let event = lifecycle_event(other)
                .ok_or_else(|| Status::new(Code::Unimplemented, format!("method {other} not found")))?;
            let req: api::PodContainerRequest = decode(payload)?;
            let event = StateChangeEvent { event: event as i32, pod: req.pod, container: req.container };
            plugin.state_change(event).await;
            Vec::new() // Each of these calls' responses is an empty message.
        }
    };
    Ok(encoded)
}

/// The event of a lifecycle call whose request is a pod and a container and whose response is empty.
fn lifecycle_event(method: &str) -> Option<api::Event> {
    use api::Event::*;
    Some(match method {
        "RunPodSandbox" => RunPodSandbox,
        "StopPodSandbox" => StopPodSandbox,
        "RemovePodSandbox" => RemovePodSandbox,
        "UpdatePodSandbox" => UpdatePodSandbox,
        "PostUpdatePodSandbox" => PostUpdatePodSandbox,
        "PostCreateContainer" => PostCreateContainer,
        "StartContainer" => StartContainer,
        "PostStartContainer" => PostStartContainer,
        "PostUpdateContainer" => PostUpdateContainer,
        "RemoveContainer" => RemoveContainer,
        _ => return None,
    })
}

/// One ttrpc message as the mux frames that carry it.
fn frames(conn: mux::ConnId, stream_id: u32, kind: u8, data: Vec<u8>) -> BytesMut {
    let message = Message { stream_id, kind, flags: 0, data: data.into() }.encode();
    let mut out = BytesMut::with_capacity(message.len() + 2 * mux::HEADER_LEN);
    mux::encode(conn, &message, &mut out);
    out
}

/// Writes queued messages, each whole, so concurrent answers never interleave their frames.
async fn write_frames<W: AsyncWrite>(wr: W, mut queue: mpsc::Receiver<BytesMut>) -> Result<(), Error> {
    tokio::pin!(wr);
    while let Some(frames) = queue.recv().await {
        wr.write_all(&frames).await?;
    }
    Ok(())
}

/// Bounded exponential backoff between connection attempts: `initial`, doubling up to `max`.
#[derive(Debug, Clone)]
pub struct Backoff {
    initial: Duration,
    max: Duration,
    last: Option<Duration>,
}

impl Backoff {
    /// A backoff from `initial` to `max`.
    pub fn new(initial: Duration, max: Duration) -> Backoff {
        Backoff { initial, max: max.max(initial), last: None }
    }

    /// The next delay.
    pub fn next_delay(&mut self) -> Duration {
        let next = self.last.map_or(self.initial, |last| (last * 2).min(self.max));
        self.last = Some(next);
        next
    }

    /// Starts over at `initial`.
    pub fn reset(&mut self) {
        self.last = None;
    }
}

impl Default for Backoff {
    /// 250 ms doubling up to 30 s.
    fn default() -> Backoff {
        Backoff::new(Duration::from_millis(250), Duration::from_secs(30))
    }
}

/// [`run`] again and again, waiting out `backoff` between attempts, until `shutdown` completes. A connection
/// that lasted at least the backoff's maximum starts the backoff over. Each ended connection is logged (a
/// warning with the error's [`label`](Error::label) for failures).
pub async fn run_forever<P: Plugin>(
    socket: &Path,
    name: &str,
    idx: &str,
    plugin: Arc<P>,
    mut backoff: Backoff,
    shutdown: impl Future<Output = ()>,
) {
    tokio::pin!(shutdown);
    loop {
        let started = Instant::now();
        let result = tokio::select! {
            () = &mut shutdown => return,
            result = run(socket, name, idx, plugin.clone(), std::future::pending()) => result,
        };
        match result {
            Ok(()) => info!("the NRI runtime closed the connection"),
            Err(e) => warn!(error = %e, label = e.label(), "NRI connection failed"),
        }
        if started.elapsed() >= backoff.max {
            backoff.reset();
        }
        tokio::select! {
            () = &mut shutdown => return,
            () = time::sleep(backoff.next_delay()) => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_doubles_up_to_the_maximum_and_resets() {
        let mut b = Backoff::new(Duration::from_millis(100), Duration::from_millis(500));
        let delays: Vec<u64> = (0..5).map(|_| b.next_delay().as_millis() as u64).collect();
        assert_eq!(delays, [100, 200, 400, 500, 500]);
        b.reset();
        assert_eq!(b.next_delay(), Duration::from_millis(100));
    }
}
