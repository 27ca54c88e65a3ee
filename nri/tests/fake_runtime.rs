//! Tests against a FAKE NRI runtime: [`FakeRuntime`] is written here from the wire definitions (NRI's mux frame
//! header, ttrpc's message header, `api.proto`'s messages and service names) — it is not containerd. It speaks
//! the runtime's side over one end of a `UnixStream::pair()`, with its own framing code (not the crate's), so a
//! framing bug in the crate is not mirrored here. The real runtime is checked by e2e/cluster/nri-probe.sh.
//! Time runs on tokio's paused clock; nothing sleeps.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use gpubudget_nri::api::{
    self, ConfigureRequest, ConfigureResponse, Container, ContainerAdjustment, ContainerUpdate, CreateContainerRequest,
    CreateContainerResponse, Event, EventMask, KeyValue, PodSandbox, StateChangeEvent, SynchronizeRequest,
    SynchronizeResponse,
};
use gpubudget_nri::ttrpc::{Request, Response, Status};
use gpubudget_nri::{Backoff, Error, Plugin, serve};
use prost::Message;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{UnixListener, UnixStream};
use tokio::sync::Notify;
use tokio::task::JoinHandle;
use tokio::time::Instant;

const PLUGIN_CONN: u32 = 1;
const RUNTIME_CONN: u32 = 2;
const REQUEST: u8 = 1;
const RESPONSE: u8 = 2;

/// The runtime side of NRI, faked from the wire definitions (see the module comment).
struct FakeRuntime {
    io: UnixStream,
    /// Each logical connection's bytes not yet taken as messages.
    inbox: HashMap<u32, Vec<u8>>,
    next_stream: u32,
}

impl FakeRuntime {
    fn new(io: UnixStream) -> FakeRuntime {
        FakeRuntime { io, inbox: HashMap::new(), next_stream: 1 }
    }

    async fn send_frame(&mut self, conn: u32, payload: &[u8]) {
        let mut frame = Vec::new();
        frame.extend_from_slice(&conn.to_be_bytes());
        frame.extend_from_slice(&(payload.len() as u32).to_be_bytes());
        frame.extend_from_slice(payload);
        self.io.write_all(&frame).await.unwrap();
    }

    /// A ttrpc message, framed as Go's bufio writer frames it: the first 4096 bytes, then the rest.
    async fn send_message(&mut self, conn: u32, stream: u32, kind: u8, data: &[u8]) {
        let mut message = Vec::new();
        message.extend_from_slice(&(data.len() as u32).to_be_bytes());
        message.extend_from_slice(&stream.to_be_bytes());
        message.extend_from_slice(&[kind, 0]);
        message.extend_from_slice(data);
        let (first, rest) = message.split_at(message.len().min(4096));
        self.send_frame(conn, first).await;
        if !rest.is_empty() {
            self.send_frame(conn, rest).await;
        }
    }

    /// The next ttrpc message on `conn` (stream id, type, data); `None` once the plugin closed the socket.
    async fn read_message(&mut self, conn: u32) -> Option<(u32, u8, Vec<u8>)> {
        loop {
            let buf = self.inbox.entry(conn).or_default();
            if buf.len() >= 10 {
                let len = u32::from_be_bytes(buf[0..4].try_into().unwrap()) as usize;
                if buf.len() >= 10 + len {
                    let stream = u32::from_be_bytes(buf[4..8].try_into().unwrap());
                    let (kind, data) = (buf[8], buf[10..10 + len].to_vec());
                    buf.drain(..10 + len);
                    return Some((stream, kind, data));
                }
            }
            let mut header = [0u8; 8];
            self.io.read_exact(&mut header).await.ok()?;
            let from = u32::from_be_bytes(header[0..4].try_into().unwrap());
            let mut payload = vec![0u8; u32::from_be_bytes(header[4..8].try_into().unwrap()) as usize];
            self.io.read_exact(&mut payload).await.ok()?;
            self.inbox.entry(from).or_default().extend_from_slice(&payload);
        }
    }

    /// Reads the plugin's RegisterPlugin call and answers it with `status` (None: success).
    async fn registration(&mut self, status: Option<Status>) -> api::RegisterPluginRequest {
        let (stream, kind, data) = self.read_message(RUNTIME_CONN).await.expect("a registration");
        assert_eq!((stream % 2, kind), (1, REQUEST));
        let req = Request::decode(&data[..]).unwrap();
        assert_eq!((req.service.as_str(), req.method.as_str()), ("nri.pkg.api.v1alpha1.Runtime", "RegisterPlugin"));
        let response = Response { status, payload: Default::default() };
        self.send_message(RUNTIME_CONN, stream, RESPONSE, &response.encode_to_vec()).await;
        api::RegisterPluginRequest::decode(req.payload).unwrap()
    }

    /// Sends a Plugin-service request; returns its stream id.
    async fn send_request(&mut self, method: &str, payload: Vec<u8>) -> u32 {
        let stream = self.next_stream;
        self.next_stream += 2;
        let req = Request {
            service: "nri.pkg.api.v1alpha1.Plugin".into(),
            method: method.into(),
            payload: payload.into(),
            timeout_nano: 2_000_000_000,
            metadata: Vec::new(),
        };
        self.send_message(PLUGIN_CONN, stream, REQUEST, &req.encode_to_vec()).await;
        stream
    }

    /// The next response on the plugin connection: its stream id and the decoded response.
    async fn read_response(&mut self) -> (u32, Response) {
        let (stream, kind, data) = self.read_message(PLUGIN_CONN).await.expect("a response");
        assert_eq!(kind, RESPONSE);
        (stream, Response::decode(&data[..]).unwrap())
    }

    /// A unary call: the decoded answer, or the error status.
    async fn call<Rsp: Message + Default>(&mut self, method: &str, req: impl Message) -> Result<Rsp, Status> {
        let stream = self.send_request(method, req.encode_to_vec()).await;
        let (answered, response) = self.read_response().await;
        assert_eq!(answered, stream);
        match response.status.filter(|s| s.code != 0) {
            Some(status) => Err(status),
            None => Ok(Rsp::decode(response.payload).unwrap()),
        }
    }
}

/// A plugin that records what it is told. It sets `GPUBUDGET_TEST=<container name>` and removes `REMOVE_ME`,
/// refuses containers named `refused`, and waits for `gate` with containers named `slow`.
#[derive(Debug, Default)]
struct Recorder {
    seen: Mutex<Vec<String>>,
    gate: Notify,
}

impl Recorder {
    fn seen(&self) -> Vec<String> {
        self.seen.lock().unwrap().clone()
    }
    fn record(&self, what: String) {
        self.seen.lock().unwrap().push(what);
    }
}

impl Plugin for Recorder {
    async fn configure(&self, req: ConfigureRequest) -> EventMask {
        self.record(format!("configure {} {}", req.runtime_name, req.request_timeout));
        EventMask::of(&[Event::CreateContainer, Event::StopContainer])
    }

    async fn synchronize(&self, pods: Vec<PodSandbox>, containers: Vec<Container>) -> Vec<ContainerUpdate> {
        let ids: Vec<&str> = containers.iter().map(|c| c.id.as_str()).collect();
        self.record(format!("synchronize {} pods, containers {}", pods.len(), ids.join(",")));
        vec![ContainerUpdate { container_id: containers[0].id.clone(), ..Default::default() }]
    }

    async fn create_container(&self, pod: PodSandbox, container: Container) -> Result<ContainerAdjustment, String> {
        self.record(format!("create {}/{}", pod.name, container.name));
        match container.name.as_str() {
            "refused" => return Err("no GPU budget left for refused".into()),
            "slow" => self.gate.notified().await,
            _ => {}
        }
        let mut adjust = ContainerAdjustment::default();
        adjust.add_env("GPUBUDGET_TEST", container.name).remove_env("REMOVE_ME");
        Ok(adjust)
    }

    async fn state_change(&self, event: StateChangeEvent) {
        let name = event.container.map(|c| c.name).unwrap_or_default();
        self.record(format!("state_change {:?} {name}", Event::try_from(event.event).unwrap()));
    }
}

/// Starts `serve` on one end of a socket pair and returns the fake runtime on the other.
fn start(plugin: Arc<Recorder>) -> (FakeRuntime, JoinHandle<Result<(), Error>>) {
    let (plugin_end, runtime_end) = UnixStream::pair().unwrap();
    let task =
        tokio::spawn(async move { serve(plugin_end, "gpubudget-test", "10", plugin, std::future::pending()).await });
    (FakeRuntime::new(runtime_end), task)
}

/// Starts the plugin and takes it through registration and Configure.
async fn configured(plugin: Arc<Recorder>) -> (FakeRuntime, JoinHandle<Result<(), Error>>) {
    let (mut runtime, task) = start(plugin);
    runtime.registration(None).await;
    let _: ConfigureResponse = runtime.call("Configure", ConfigureRequest::default()).await.unwrap();
    (runtime, task)
}

fn container(id: &str, name: &str) -> Container {
    Container { id: id.into(), pod_sandbox_id: "sb".into(), name: name.into(), ..Default::default() }
}

fn create(name: &str) -> CreateContainerRequest {
    CreateContainerRequest {
        pod: Some(PodSandbox { name: "pod".into(), ..Default::default() }),
        container: Some(container("c1", name)),
    }
}

#[tokio::test(start_paused = true)]
async fn fake_runtime_receives_registration_then_configure_and_synchronize() {
    let plugin = Arc::new(Recorder::default());
    let (mut runtime, _task) = start(plugin.clone());
    let reg = runtime.registration(None).await;
    assert_eq!((reg.plugin_name.as_str(), reg.plugin_idx.as_str()), ("gpubudget-test", "10"));
    assert!(!reg.nri_version.is_empty());

    let req = ConfigureRequest { runtime_name: "fake".into(), request_timeout: 2000, ..Default::default() };
    let configured: ConfigureResponse = runtime.call("Configure", req).await.unwrap();
    assert_eq!(configured.events, 1 << 3 | 1 << 9, "CreateContainer (4) and StopContainer (10) as bits e-1");

    let sync = SynchronizeRequest {
        pods: vec![PodSandbox { id: "sb".into(), ..Default::default() }],
        containers: vec![container("c1", "a"), container("c2", "b")],
        more: false,
    };
    let synced: SynchronizeResponse = runtime.call("Synchronize", sync).await.unwrap();
    assert_eq!(synced.update.len(), 1);
    assert_eq!(synced.update[0].container_id, "c1");
    assert_eq!(plugin.seen(), ["configure fake 2000", "synchronize 1 pods, containers c1,c2"]);
}

#[tokio::test(start_paused = true)]
async fn fake_runtime_gets_split_synchronize_joined_for_the_plugin() {
    let plugin = Arc::new(Recorder::default());
    let (mut runtime, _task) = configured(plugin.clone()).await;
    let first = SynchronizeRequest { containers: vec![container("c1", "a")], more: true, ..Default::default() };
    let part: SynchronizeResponse = runtime.call("Synchronize", first).await.unwrap();
    assert!(part.more && part.update.is_empty(), "a part is answered with more and no updates");
    let last = SynchronizeRequest { containers: vec![container("c2", "b")], more: false, ..Default::default() };
    let done: SynchronizeResponse = runtime.call("Synchronize", last).await.unwrap();
    assert!(!done.more);
    assert_eq!(plugin.seen()[1], "synchronize 0 pods, containers c1,c2");
}

#[tokio::test(start_paused = true)]
async fn fake_runtime_gets_an_adjustment_setting_and_removing_env() {
    let (mut runtime, _task) = configured(Arc::new(Recorder::default())).await;
    let created: CreateContainerResponse = runtime.call("CreateContainer", create("trainer")).await.unwrap();
    let env = created.adjust.unwrap().env;
    assert_eq!(
        env,
        [
            KeyValue { key: "GPUBUDGET_TEST".into(), value: "trainer".into() },
            KeyValue { key: "-REMOVE_ME".into(), value: String::new() },
        ]
    );
}

#[tokio::test(start_paused = true)]
async fn fake_runtime_gets_a_refusal_as_an_error_status() {
    let (mut runtime, _task) = configured(Arc::new(Recorder::default())).await;
    let refused = runtime.call::<CreateContainerResponse>("CreateContainer", create("refused")).await.unwrap_err();
    assert_eq!(refused.code, 7, "PermissionDenied");
    assert_eq!(refused.message, "no GPU budget left for refused");
}

#[tokio::test(start_paused = true)]
async fn fake_runtime_sees_a_slow_handler_block_no_other_call() {
    let plugin = Arc::new(Recorder::default());
    let (mut runtime, _task) = configured(plugin.clone()).await;
    let slow = runtime.send_request("CreateContainer", create("slow").encode_to_vec()).await;
    let event = StateChangeEvent { event: Event::PostStartContainer as i32, pod: None, container: None };
    let quick = runtime.send_request("StateChange", event.encode_to_vec()).await;
    let (first, _) = runtime.read_response().await;
    assert_eq!(first, quick, "the state change is answered while CreateContainer waits");
    plugin.gate.notify_one();
    let (second, response) = runtime.read_response().await;
    assert_eq!(second, slow);
    assert!(response.status.is_none());
}

#[tokio::test(start_paused = true)]
async fn fake_runtime_lifecycle_calls_reach_state_change_and_unknown_ones_are_unimplemented() {
    let plugin = Arc::new(Recorder::default());
    let (mut runtime, _task) = configured(plugin.clone()).await;
    let start = api::PodContainerRequest { pod: None, container: Some(container("c1", "worker")) };
    let _: api::Empty = runtime.call("StartContainer", start).await.unwrap();
    let unknown = runtime.call::<api::Empty>("NoSuchMethod", api::Empty {}).await.unwrap_err();
    assert_eq!(unknown.code, 12, "Unimplemented: the runtime falls back to StateChange on this code");
    assert_eq!(plugin.seen()[1], "state_change StartContainer worker");
}

#[tokio::test(start_paused = true)]
async fn fake_runtime_message_spanning_frames_is_reassembled() {
    let plugin = Arc::new(Recorder::default());
    let (mut runtime, _task) = configured(plugin.clone()).await;
    let mut big = container("c-big", "big");
    big.annotations.insert("a".into(), "x".repeat(20_000));
    let sync = SynchronizeRequest { containers: vec![big], ..Default::default() };
    let _: SynchronizeResponse = runtime.call("Synchronize", sync).await.unwrap();
    assert_eq!(plugin.seen()[1], "synchronize 0 pods, containers c-big");
}

#[tokio::test(start_paused = true)]
async fn fake_runtime_closing_the_connection_ends_serve() {
    let (runtime, task) = configured(Arc::new(Recorder::default())).await;
    drop(runtime);
    task.await.unwrap().expect("a clean end");
}

#[tokio::test(start_paused = true)]
async fn fake_runtime_refusing_registration_ends_serve_with_its_status() {
    let (mut runtime, task) = start(Arc::new(Recorder::default()));
    runtime.registration(Some(Status { code: 3, message: "invalid plugin index".into() })).await;
    let err = task.await.unwrap().unwrap_err();
    assert_eq!(err.label(), "registration_refused");
    assert!(err.to_string().contains("invalid plugin index"), "{err}");
}

#[tokio::test(start_paused = true)]
async fn fake_runtime_never_answering_registration_times_out_after_5_s() {
    let (_runtime, task) = start(Arc::new(Recorder::default()));
    let started = Instant::now();
    let err = task.await.unwrap().unwrap_err();
    assert_eq!(err.label(), "registration_timeout");
    assert_eq!(started.elapsed(), Duration::from_secs(5));
}

#[tokio::test(start_paused = true)]
async fn fake_runtime_sending_an_oversized_frame_ends_serve_with_an_error() {
    let (mut runtime, task) = configured(Arc::new(Recorder::default())).await;
    runtime.io.write_all(&[0, 0, 0, 1, 0x7f, 0xff, 0xff, 0xff]).await.unwrap();
    assert_eq!(task.await.unwrap().unwrap_err().label(), "frame_too_large");
}

#[tokio::test(start_paused = true)]
async fn fake_runtime_frames_for_unknown_connections_are_dropped() {
    let (mut runtime, _task) = configured(Arc::new(Recorder::default())).await;
    runtime.send_frame(7, b"whatever").await;
    runtime.send_frame(0, b"reserved").await;
    let created: CreateContainerResponse = runtime.call("CreateContainer", create("after")).await.unwrap();
    assert_eq!(created.adjust.unwrap().env[0].value, "after");
}

#[tokio::test(start_paused = true)]
async fn run_forever_reconnects_with_backoff_until_shutdown() {
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("nri.sock");
    let listener = UnixListener::bind(&socket).unwrap();
    let stop = Arc::new(Notify::new());
    let stopped = stop.clone();
    let plugin = Arc::new(Recorder::default());
    let backoff = Backoff::new(Duration::from_millis(100), Duration::from_secs(1));
    let task = tokio::spawn(async move {
        gpubudget_nri::run_forever(&socket, "gpubudget-test", "10", plugin, backoff, stopped.notified()).await
    });
    let mut accepted = Vec::new();
    for _ in 0..3 {
        let (io, _) = listener.accept().await.unwrap();
        accepted.push(Instant::now());
        let mut runtime = FakeRuntime::new(io);
        runtime.registration(None).await;
        drop(runtime); // the runtime goes away: the plugin reconnects after its backoff
    }
    let gaps: Vec<Duration> = accepted.windows(2).map(|w| w[1] - w[0]).collect();
    assert_eq!(gaps, [Duration::from_millis(100), Duration::from_millis(200)]);
    stop.notify_one();
    task.await.unwrap();
}
