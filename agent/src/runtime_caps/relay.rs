//! The relay (`gpubudget-agent runtime-caps-relay`): the only part of gpubudget that holds the container runtime's
//! NRI socket. Whoever holds that socket can add hooks, mounts and devices to every new container, so the process
//! holding it has nothing else: no host PIDs, no API token, no port, no decision. It registers with the runtime as
//! a plugin, listens on a local socket for the agent (one at a time; the newest connection wins), and for each GPU
//! container asks the agent ([`super::wire`]), checks the answer (only [`runtime::ADJUSTABLE`] variables) and hands
//! it to the runtime. Containers that see no GPU are answered at once, without asking.
//!
//! Without an agent (not connected, or silent past the runtime's deadline less a margin) a GPU container gets what
//! `--runtime-caps-unresolved` says: `create` — made uncapped, and told by the agent when it connects (the relay
//! remembers the GPU containers the runtime made and hands them over then); `refuse` — refused with the reason, the
//! kubelet retries. Containers that see no GPU are never refused.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use futures::StreamExt as _;
use gpubudget_nri::api::{self, Container, ContainerAdjustment, EventMask, PodSandbox, StateChangeEvent};
use tokio::net::{UnixListener, UnixStream};
use tokio::sync::{mpsc, oneshot};
use tokio_util::sync::CancellationToken;

use super::Unresolved;
use super::wire::{self, Answer, Call, Ctr, Pod, Request, Response};

/// GPU containers the relay remembers to hand a (re)connecting agent, at most (a node runs far fewer).
pub const MAX_KNOWN: usize = 8192;
/// What the relay keeps of the runtime's per-request deadline for itself (its own hop and the answer's way back).
pub const MARGIN: Duration = Duration::from_millis(250);
/// The runtime's per-request deadline when it does not say (containerd's default).
pub const DEFAULT_REQUEST_TIMEOUT: Duration = Duration::from_secs(2);

/// The relay's settings.
#[derive(Debug, Clone)]
pub struct RelaySettings {
    /// What a GPU container gets when no agent answers in time.
    pub unresolved: Unresolved,
    /// Namespaces whose containers are never refused (the release's own: its agent must start).
    pub never_refuse: gpubudget_common::CriticalNamespaces,
    /// The only user ID the relay accepts a connection from (the agent's), checked with the socket's peer
    /// credentials; `None`: any (the socket's mode, 0660 with the relay's group, still applies).
    pub agent_uid: Option<u32>,
}

/// Why no agent answered.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Unanswered {
    /// None connected.
    #[error("the agent is not connected to the runtime-caps relay")]
    NotConnected,
    /// Connected, silent past the deadline.
    #[error("the agent did not answer within {0:?}")]
    Late(Duration),
    /// The agent's answer asked for more than runtime caps change.
    #[error("the agent's answer was refused by the relay: {0}")]
    Refused(String),
}

/// The connected agent: where to write questions, and who waits for which answer.
#[derive(Debug, Clone)]
struct Agent {
    serial: u64,
    lines: mpsc::Sender<String>,
    waiting: Arc<Mutex<HashMap<u64, oneshot::Sender<Answer>>>>,
    gone: CancellationToken,
}

/// The relay: an NRI plugin of the runtime on one side, the agent's server on the other.
#[derive(Debug)]
pub struct Relay {
    settings: RelaySettings,
    request_timeout_ms: AtomicU64,
    agent: Mutex<Option<Agent>>,
    /// The GPU containers the runtime made, by container ID.
    known: Mutex<HashMap<String, (Pod, Ctr)>>,
    ids: AtomicU64,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

impl Relay {
    /// A relay with no agent yet.
    pub fn new(settings: RelaySettings) -> Relay {
        Relay {
            settings,
            request_timeout_ms: AtomicU64::new(DEFAULT_REQUEST_TIMEOUT.as_millis() as u64),
            agent: Mutex::new(None),
            known: Mutex::new(HashMap::new()),
            ids: AtomicU64::new(0),
        }
    }

    /// How long the agent has to answer a creation: the runtime's deadline less [`MARGIN`].
    pub fn budget(&self) -> Duration {
        Duration::from_millis(self.request_timeout_ms.load(Ordering::Relaxed)).saturating_sub(MARGIN)
    }

    /// Whether an agent is connected.
    pub fn connected(&self) -> bool {
        lock(&self.agent).is_some()
    }

    /// Asks the agent, waiting at most `within` for its answer.
    pub async fn ask(&self, call: Call, within: Duration) -> Result<Answer, Unanswered> {
        let agent = lock(&self.agent).clone().ok_or(Unanswered::NotConnected)?;
        let id = self.ids.fetch_add(1, Ordering::Relaxed);
        let line = serde_json::to_string(&Request { id, call }).expect("a request serializes");
        let (tx, rx) = oneshot::channel();
        lock(&agent.waiting).insert(id, tx);
        let asked = async {
            agent.lines.send(line).await.map_err(|_| Unanswered::NotConnected)?;
            rx.await.map_err(|_| Unanswered::NotConnected)
        };
        let answer = tokio::time::timeout(within, asked).await.unwrap_or(Err(Unanswered::Late(within)));
        lock(&agent.waiting).remove(&id);
        answer
    }

    /// Tells the agent, without waiting for it (the runtime's call returns at once).
    fn tell(self: &Arc<Self>, call: Call) {
        if !self.connected() {
            return;
        }
        let relay = self.clone();
        tokio::spawn(async move {
            if let Err(e) = relay.ask(call, Duration::from_secs(10)).await {
                tracing::debug!(error = %e, "runtime caps relay: a notice to the agent went unanswered");
            }
        });
    }

    /// Takes `stream` as the agent's connection (replacing any earlier one), hands it the GPU containers the runtime
    /// made, and serves it until it closes.
    pub async fn attach(self: Arc<Self>, stream: UnixStream) {
        let serial = self.ids.fetch_add(1, Ordering::Relaxed);
        let (rd, wr) = stream.into_split();
        let (lines, mut queue) = mpsc::channel::<String>(256);
        let agent = Agent { serial, lines, waiting: Arc::default(), gone: CancellationToken::new() };
        if let Some(old) = lock(&self.agent).replace(agent.clone()) {
            old.gone.cancel();
        }
        tracing::info!("runtime caps relay: the agent connected");
        let writer = async {
            let _ = wire::write_lines(wr, &mut queue).await;
        };
        let reader = async {
            let mut frames = wire::lines(rd);
            while let Some(Ok(line)) = frames.next().await {
                match serde_json::from_str::<Response>(&line) {
                    Ok(r) => {
                        if let Some(waiter) = lock(&agent.waiting).remove(&r.id) {
                            let _ = waiter.send(r.answer);
                        }
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, "runtime caps relay: not an answer; closing the agent's connection");
                        break;
                    }
                }
            }
        };
        let known: Vec<(Pod, Ctr)> = lock(&self.known).values().cloned().collect();
        for (pod, container) in known {
            self.tell(Call::Existing { pod, container });
        }
        tokio::select! {
            () = writer => {}
            () = reader => {}
            () = agent.gone.cancelled() => {}
        }
        let mut current = lock(&self.agent);
        if current.as_ref().is_some_and(|a| a.serial == serial) {
            *current = None;
            tracing::warn!("runtime caps relay: the agent disconnected");
        }
    }

    /// Accepts the agent's connections on `listener` until `shutdown`: only from `agent_uid` where set.
    pub async fn serve_agents(self: Arc<Self>, listener: UnixListener, shutdown: CancellationToken) {
        loop {
            let stream = tokio::select! {
                () = shutdown.cancelled() => return,
                accepted = listener.accept() => match accepted {
                    Ok((stream, _)) => stream,
                    Err(e) => {
                        tracing::warn!(error = %e, "runtime caps relay: accept failed");
                        tokio::time::sleep(Duration::from_millis(100)).await;
                        continue;
                    }
                },
            };
            let uid = stream.peer_cred().map(|c| c.uid()).ok();
            if let Some(want) = self.settings.agent_uid.filter(|want| uid != Some(*want)) {
                tracing::warn!(?uid, want, "runtime caps relay: a connection from another user refused");
                continue;
            }
            tokio::spawn(self.clone().attach(stream));
        }
    }

    /// What a GPU container gets when no agent answered.
    fn unresolved(&self, pod: &PodSandbox, c: &Container, why: &Unanswered) -> Result<ContainerAdjustment, String> {
        match self.settings.unresolved.for_namespace(&self.settings.never_refuse, &pod.namespace) {
            Unresolved::Create => {
                tracing::warn!(container = %c.name, %why, "runtime caps relay: GPU container created uncapped (--runtime-caps-unresolved=create)");
                Ok(ContainerAdjustment::default())
            }
            Unresolved::Refuse => Err(format!(
                "gpubudget: GPU container {} not created: {why} (--runtime-caps-unresolved=refuse; the kubelet retries)",
                c.name
            )),
        }
    }

    fn remember(&self, pod: Pod, c: Ctr) {
        let mut known = lock(&self.known);
        if known.len() < MAX_KNOWN || known.contains_key(&c.id) {
            known.insert(c.id.clone(), (pod, c));
        } else {
            tracing::warn!(max = MAX_KNOWN, "runtime caps relay: too many GPU containers to remember");
        }
    }
}

/// The relay as the runtime's plugin.
#[derive(Debug, Clone)]
pub struct RelayPlugin(pub Arc<Relay>);

impl gpubudget_nri::Plugin for RelayPlugin {
    async fn configure(&self, req: api::ConfigureRequest) -> EventMask {
        tracing::info!(runtime = %req.runtime_name, version = %req.runtime_version, request_timeout_ms = req.request_timeout, "runtime caps relay: registered with the container runtime");
        if let Ok(ms @ 1..) = u64::try_from(req.request_timeout) {
            self.0.request_timeout_ms.store(ms, Ordering::Relaxed);
        }
        EventMask::of(&[api::Event::CreateContainer, api::Event::PostCreateContainer, api::Event::RemoveContainer])
    }

    async fn synchronize(&self, pods: Vec<PodSandbox>, containers: Vec<Container>) -> Vec<api::ContainerUpdate> {
        let pod_of: HashMap<&str, &PodSandbox> = pods.iter().map(|p| (p.id.as_str(), p)).collect();
        lock(&self.0.known).clear();
        let mut gpu = 0;
        for c in &containers {
            let (Some(pod), Some(ctr)) = (pod_of.get(c.pod_sandbox_id.as_str()), Ctr::of(c)) else { continue };
            gpu += 1;
            self.0.remember(Pod::of(pod), ctr.clone());
            self.0.tell(Call::Existing { pod: Pod::of(pod), container: ctr });
        }
        tracing::info!(
            pods = pods.len(),
            containers = containers.len(),
            gpu_containers = gpu,
            "runtime caps relay: the runtime's containers read"
        );
        Vec::new()
    }

    async fn create_container(&self, pod: PodSandbox, container: Container) -> Result<ContainerAdjustment, String> {
        let Some(ctr) = Ctr::of(&container) else { return Ok(ContainerAdjustment::default()) };
        let within = self.0.budget();
        let wait_ms = within.saturating_sub(MARGIN).as_millis() as u64;
        let call = Call::Create { pod: Pod::of(&pod), container: ctr, wait_ms };
        let answer = self.0.ask(call, within).await;
        match answer.and_then(|a| a.into_nri().map_err(Unanswered::Refused)) {
            Ok(result) => result,
            Err(why) => self.0.unresolved(&pod, &container, &why),
        }
    }

    async fn state_change(&self, event: StateChangeEvent) {
        let (Some(pod), Some(c)) = (event.pod.as_ref(), event.container.as_ref()) else { return };
        match api::Event::try_from(event.event) {
            Ok(api::Event::PostCreateContainer) => {
                if let Some(ctr) = Ctr::of(c) {
                    self.0.remember(Pod::of(pod), ctr.clone());
                    self.0.tell(Call::Created { pod: Pod::of(pod), container: ctr });
                }
            }
            Ok(api::Event::RemoveContainer) => {
                lock(&self.0.known).remove(&c.id);
            }
            _ => {}
        }
    }
}

/// Binds the agent's socket at `path` (a stale one removed), readable and writable by the relay's user and group
/// only (0660: the chart runs the relay with the agent's group).
pub fn bind(path: &PathBuf) -> std::io::Result<UnixListener> {
    use std::os::unix::fs::PermissionsExt as _;
    match std::fs::remove_file(path) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(e),
        _ => {}
    }
    let listener = UnixListener::bind(path)?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o660))?;
    Ok(listener)
}
