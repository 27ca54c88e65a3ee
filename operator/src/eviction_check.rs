//! The eviction check (`POST /validate-eviction`): the agent of a node may evict only pods of its node.
//!
//! An eviction request (`CREATE pods/eviction`) names a pod, not its node, so an admission policy cannot
//! check it; this webhook looks the pod up and compares its `spec.nodeName` with the node the requester's
//! service-account token is bound to (user extra `authentication.kubernetes.io/node-name`: set for a token
//! bound to a pod, as the kubelet projects it, or to a Node, as `kubectl create token --bound-object-kind
//! Node` mints it). The
//! chart sends only the agent's requests here (`matchConditions`), so other evictions (`kubectl drain`,
//! the cluster autoscaler) never depend on the operator.
//!
//! The decision ([`decide`]) is a pure function of the request and the pod looked up:
//!
//! | requester | pod | verdict |
//! |---|---|---|
//! | token bound to node N | on node N | allowed |
//! | token bound to node N | on another node, unscheduled, not found, or lookup failed | denied, saying why |
//! | a service account without a node claim (or with several) | — | denied |
//! | any other identity (a person, a controller's client certificate) | — | allowed |
//!
//! Served over TLS (`tls.crt`, `tls.key` from `--webhook-cert-dir`, re-read when they change, so a rotated
//! certificate is picked up without a restart).
//!
//! On shutdown (SIGTERM: a rollout, a drain) the check keeps answering for [`SHUTDOWN_DRAIN`], and every
//! answer in that time closes its connection (`Connection: close`): the API server keeps sending requests to a
//! terminating replica until kube-proxy has removed it from the Service, and on the keep-alive connections it
//! already holds to it after that. Closing an idle keep-alive connection at the moment the API server sends a
//! request on it fails that request (`EOF`), and with `failurePolicy: Fail` the agent's eviction with it: seen
//! once in 408 requests during a `kubectl drain` on a real kubelet before this drain existed.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::{Arc, RwLock};
use std::time::{Duration, SystemTime};

use axum::extract::State;
use axum::routing::post;
use axum::{Json, Router};
use hyper_util::rt::TokioIo;
use hyper_util::service::TowerToHyperService;
use k8s_openapi::api::authentication::v1::UserInfo;
use k8s_openapi::api::core::v1::Pod;
use kube::core::DynamicObject;
use kube::core::admission::{AdmissionRequest, AdmissionResponse, AdmissionReview, Operation};
use kube::{Api, Client};
use tokio_rustls::TlsAcceptor;
use tokio_rustls::rustls::crypto::{CryptoProvider, ring};
use tokio_rustls::rustls::pki_types::pem::PemObject;
use tokio_rustls::rustls::pki_types::{CertificateDer, PrivateKeyDer};
use tokio_rustls::rustls::server::{ClientHello, ResolvesServerCert};
use tokio_rustls::rustls::sign::CertifiedKey;
use tokio_rustls::rustls::{self, ServerConfig};
use tokio_util::sync::CancellationToken;

/// The user-info extra a node-bound credential carries: the node of the pod a service-account token is bound
/// to (what the kubelet projects), or the node itself (`kubectl create token --bound-object-kind Node`).
pub const NODE_NAME_EXTRA: &str = "authentication.kubernetes.io/node-name";
/// The path the chart's `ValidatingWebhookConfiguration` calls.
pub const PATH: &str = "/validate-eviction";

/// Who asks.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Requester {
    /// A credential bound to a node (a token bound to a pod on it, or to the Node object).
    Node(String),
    /// A service account whose credential names no node (bound to neither a pod nor a Node).
    Unbound(String),
    /// Anyone else.
    Other,
}

/// Reads the requester from the request's user info.
pub fn requester(user: &UserInfo) -> Requester {
    let username = user.username.clone().unwrap_or_default();
    match user.extra.as_ref().and_then(|e| e.get(NODE_NAME_EXTRA)).map(Vec::as_slice) {
        Some([node]) if !node.is_empty() => Requester::Node(node.clone()),
        Some(_) => Requester::Unbound(username),
        None if username.starts_with("system:serviceaccount:") => Requester::Unbound(username),
        None => Requester::Other,
    }
}

/// What the lookup of the pod to evict found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Lookup {
    /// The pod runs (or is bound to run) on this node.
    OnNode(String),
    /// The pod has no node yet.
    Unscheduled,
    /// No such pod.
    NotFound,
    /// The lookup failed.
    Failed(String),
}

/// The pod a request evicts, when it is an eviction: `(namespace, name)`.
pub fn target(request: &AdmissionRequest<DynamicObject>) -> Option<(String, String)> {
    let is_eviction = request.operation == Operation::Create
        && request.resource.group.is_empty()
        && request.resource.resource == "pods"
        && request.sub_resource.as_deref() == Some("eviction");
    if !is_eviction {
        return None;
    }
    Some((request.namespace.clone()?, request.name.clone()))
}

/// Whether the request needs the pod looked up before [`decide`] can answer.
pub fn needs_lookup(request: &AdmissionRequest<DynamicObject>) -> bool {
    target(request).is_some() && matches!(requester(&request.user_info), Requester::Node(_))
}

/// The verdict. `pod` is the lookup of [`target`]'s pod, when [`needs_lookup`] says it is needed.
pub fn decide(request: &AdmissionRequest<DynamicObject>, pod: Option<&Lookup>) -> AdmissionResponse {
    let response = AdmissionResponse::from(request);
    let Some((namespace, name)) = target(request) else { return response };
    let node = match requester(&request.user_info) {
        Requester::Other => return response,
        Requester::Unbound(user) => {
            return forbid(
                response,
                format!(
                    "{user} may evict only pods of its own node, and its credential names no node (user extra \
                     {NODE_NAME_EXTRA}); only a service-account token bound to a pod (as the kubelet projects \
                     it) or to a node (kubectl create token --bound-object-kind Node) names one"
                ),
            );
        }
        Requester::Node(node) => node,
    };
    let why = match pod {
        Some(Lookup::OnNode(on)) if *on == node => return response,
        Some(Lookup::OnNode(on)) => format!("pod {namespace}/{name} runs on node {on}"),
        Some(Lookup::Unscheduled) => format!("pod {namespace}/{name} is not scheduled to a node"),
        Some(Lookup::NotFound) => format!("pod {namespace}/{name} does not exist"),
        Some(Lookup::Failed(error)) => format!("pod {namespace}/{name} could not be looked up ({error})"),
        None => format!("pod {namespace}/{name} was not looked up"),
    };
    forbid(response, format!("the gpubudget agent of node {node} may evict only pods of node {node}: {why}"))
}

fn forbid(response: AdmissionResponse, message: String) -> AdmissionResponse {
    let mut response = response.deny(message);
    response.result.code = 403;
    response.result.reason = "Forbidden".to_owned();
    response
}

/// Looks up a pod's node.
#[derive(Clone)]
pub struct PodLookup {
    client: Client,
}

impl std::fmt::Debug for PodLookup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PodLookup").finish_non_exhaustive()
    }
}

impl PodLookup {
    /// Looks pods up through `client` (a live GET: the operator's cache holds no `spec.nodeName`).
    pub fn new(client: Client) -> Self {
        Self { client }
    }

    async fn lookup(&self, namespace: &str, name: &str) -> Lookup {
        let api: Api<Pod> = Api::namespaced(self.client.clone(), namespace);
        match api.get_opt(name).await {
            Ok(Some(pod)) => match pod.spec.and_then(|s| s.node_name).filter(|n| !n.is_empty()) {
                Some(node) => Lookup::OnNode(node),
                None => Lookup::Unscheduled,
            },
            Ok(None) => Lookup::NotFound,
            Err(error) => Lookup::Failed(error.to_string()),
        }
    }
}

async fn validate_eviction(
    State(pods): State<PodLookup>,
    Json(review): Json<AdmissionReview<DynamicObject>>,
) -> Json<AdmissionReview<DynamicObject>> {
    let request: AdmissionRequest<DynamicObject> = match review.try_into() {
        Ok(request) => request,
        Err(error) => {
            tracing::warn!(%error, "eviction check: malformed AdmissionReview");
            return Json(AdmissionResponse::invalid(error.to_string()).into_review());
        }
    };
    let lookup = match target(&request) {
        Some((namespace, name)) if needs_lookup(&request) => Some(pods.lookup(&namespace, &name).await),
        _ => None,
    };
    let response = decide(&request, lookup.as_ref());
    let user = request.user_info.username.as_deref().unwrap_or_default();
    if response.allowed {
        tracing::debug!(user, namespace = ?request.namespace, pod = %request.name, "eviction allowed");
    } else {
        tracing::warn!(user, namespace = ?request.namespace, pod = %request.name, reason = %response.result.message, "eviction denied");
    }
    Json(response.into_review())
}

/// The webhook's router (exposed for tests).
pub fn router(pods: PodLookup) -> Router {
    Router::new().route(PATH, post(validate_eviction)).with_state(pods)
}

/// `app`, whose answers close their connection once `draining` is cancelled.
fn draining(app: Router, draining: CancellationToken) -> Router {
    app.layer(axum::middleware::map_response(move |mut response: axum::response::Response| {
        let draining = draining.is_cancelled();
        async move {
            if draining {
                response
                    .headers_mut()
                    .insert(axum::http::header::CONNECTION, axum::http::HeaderValue::from_static("close"));
            }
            response
        }
    }))
}

/// A certificate resolver that re-reads `tls.crt` and `tls.key` when they change on disk (a mounted Secret
/// is updated in place when cert-manager or the chart rotates it).
#[derive(Debug)]
pub struct CertReloader {
    dir: PathBuf,
    current: RwLock<(Option<SystemTime>, Arc<CertifiedKey>)>,
}

impl CertReloader {
    /// Loads `dir/tls.crt` and `dir/tls.key`.
    pub fn load(dir: &Path) -> anyhow::Result<Self> {
        let key = load_pair(dir)?;
        Ok(Self { dir: dir.to_owned(), current: RwLock::new((modified(dir), Arc::new(key))) })
    }

    /// Re-reads the files if their modification time changed; keeps the old pair if the new one is bad.
    pub fn refresh(&self) {
        let stamp = modified(&self.dir);
        if self.current.read().map(|c| c.0 == stamp).unwrap_or(true) {
            return;
        }
        match load_pair(&self.dir) {
            Ok(key) => {
                if let Ok(mut current) = self.current.write() {
                    *current = (stamp, Arc::new(key));
                    tracing::info!(dir = %self.dir.display(), "webhook certificate reloaded");
                }
            }
            Err(error) => {
                tracing::warn!(%error, "webhook certificate changed but cannot be loaded; keeping the old one")
            }
        }
    }
}

impl ResolvesServerCert for CertReloader {
    fn resolve(&self, _hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        self.current.read().ok().map(|c| c.1.clone())
    }
}

fn modified(dir: &Path) -> Option<SystemTime> {
    let crt = std::fs::metadata(dir.join("tls.crt")).and_then(|m| m.modified()).ok()?;
    let key = std::fs::metadata(dir.join("tls.key")).and_then(|m| m.modified()).ok()?;
    Some(crt.max(key))
}

fn provider() -> Arc<CryptoProvider> {
    Arc::new(ring::default_provider())
}

fn load_pair(dir: &Path) -> anyhow::Result<CertifiedKey> {
    let read = |name: &str| {
        let path = dir.join(name);
        std::fs::read(&path).map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))
    };
    let chain = CertificateDer::pem_slice_iter(&read("tls.crt")?)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| anyhow::anyhow!("tls.crt: {e}"))?;
    anyhow::ensure!(!chain.is_empty(), "tls.crt holds no certificate");
    let key = PrivateKeyDer::from_pem_slice(&read("tls.key")?).map_err(|e| anyhow::anyhow!("tls.key: {e}"))?;
    Ok(CertifiedKey::from_der(chain, key, &provider())?)
}

/// The TLS server configuration over a reloading certificate.
pub fn tls_config(certs: Arc<CertReloader>) -> anyhow::Result<ServerConfig> {
    let mut config = ServerConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()?
        .with_no_client_auth()
        .with_cert_resolver(certs);
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(config)
}

/// Serves the webhooks (`app`: [`router`], merged with the caps webhook's) until `shutdown`: over TLS with
/// `cert_dir`'s pair, or plain HTTP without one (tests).
pub async fn serve(
    addr: SocketAddr,
    cert_dir: Option<PathBuf>,
    app: Router,
    shutdown: CancellationToken,
) -> anyhow::Result<()> {
    let listener = tokio::net::TcpListener::bind(addr).await?;
    serve_on(listener, cert_dir, app, shutdown).await
}

/// How often the certificate files are checked for a change.
pub const CERT_REFRESH: Duration = Duration::from_secs(30);

/// How long the check keeps answering after the shutdown signal (each answer then closing its connection):
/// long enough for kube-proxy to take the replica out of the Service and for the API server to use up its
/// keep-alive connections to it. Within the operator's 20 s shutdown grace and the pod's 30 s termination grace.
pub const SHUTDOWN_DRAIN: Duration = Duration::from_secs(5);

/// [`serve`] on a bound listener.
pub async fn serve_on(
    listener: tokio::net::TcpListener,
    cert_dir: Option<PathBuf>,
    app: Router,
    shutdown: CancellationToken,
) -> anyhow::Result<()> {
    serve_on_with(listener, cert_dir, app, shutdown, CERT_REFRESH, SHUTDOWN_DRAIN).await
}

/// [`serve_on`], checking the certificate files every `refresh` and answering for `drain` after `shutdown`.
pub async fn serve_on_with(
    listener: tokio::net::TcpListener,
    cert_dir: Option<PathBuf>,
    app: Router,
    shutdown: CancellationToken,
    refresh: Duration,
    drain: Duration,
) -> anyhow::Result<()> {
    let app = draining(app, shutdown.clone());
    // Cancelled `drain` after `shutdown`: then no connection is accepted and the open ones are closed.
    let closing = CancellationToken::new();
    let closed_after_drain = {
        let (shutdown, closing) = (shutdown.clone(), closing.clone());
        async move {
            shutdown.cancelled().await;
            tracing::info!("webhooks draining: answering for {drain:?}, closing each connection after its answer");
            tokio::time::sleep(drain).await;
            closing.cancel();
        }
    };
    let Some(dir) = cert_dir else {
        tracing::warn!(addr = %listener.local_addr()?, "webhooks serving plain HTTP (no certificate directory)");
        axum::serve(listener, app).with_graceful_shutdown(closed_after_drain).await?;
        return Ok(());
    };
    let mut closed_after_drain = std::pin::pin!(closed_after_drain);
    let certs = Arc::new(CertReloader::load(&dir)?);
    let acceptor = TlsAcceptor::from(Arc::new(tls_config(certs.clone())?));
    tracing::info!(addr = %listener.local_addr()?, cert_dir = %dir.display(), "webhooks serving HTTPS");
    let mut refresh = tokio::time::interval(refresh);
    let connections = tokio_util::task::TaskTracker::new();
    loop {
        let (stream, peer) = tokio::select! {
            () = &mut closed_after_drain => break,
            _ = refresh.tick() => { certs.refresh(); continue }
            accepted = listener.accept() => match accepted {
                Ok(accepted) => accepted,
                Err(error) => {
                    tracing::warn!(%error, "webhook accept failed");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            },
        };
        let acceptor = acceptor.clone();
        let service = TowerToHyperService::new(app.clone());
        let closing = closing.clone();
        connections.spawn(async move {
            let tls = match tokio::time::timeout(Duration::from_secs(10), acceptor.accept(stream)).await {
                Ok(Ok(tls)) => tls,
                Ok(Err(error)) => return tracing::debug!(%peer, %error, "webhook TLS handshake failed"),
                Err(_) => return tracing::debug!(%peer, "webhook TLS handshake timed out"),
            };
            let conn = hyper::server::conn::http1::Builder::new().serve_connection(TokioIo::new(tls), service);
            let mut conn = std::pin::pin!(conn);
            tokio::select! {
                result = conn.as_mut() => {
                    if let Err(error) = result { tracing::debug!(%peer, %error, "webhook connection"); }
                }
                () = closing.cancelled() => {
                    conn.as_mut().graceful_shutdown();
                    let _ = tokio::time::timeout(Duration::from_secs(5), conn).await;
                }
            }
        });
    }
    connections.close();
    let _ = tokio::time::timeout(Duration::from_secs(5), connections.wait()).await;
    Ok(())
}

/// Installs the process-wide rustls provider (ring) if none is; harmless when called twice.
pub fn install_crypto_provider() {
    let _ = rustls::crypto::ring::default_provider().install_default();
}

#[cfg(test)]
mod tests {
    use super::*;

    fn review(
        user: &str,
        node: Option<&[&str]>,
        sub_resource: Option<&str>,
        operation: &str,
    ) -> AdmissionRequest<DynamicObject> {
        let extra = node.map(|n| serde_json::json!({ NODE_NAME_EXTRA: n })).unwrap_or(serde_json::json!({}));
        let body = serde_json::json!({
            "apiVersion": "admission.k8s.io/v1",
            "kind": "AdmissionReview",
            "request": {
                "uid": "705ab4f5-6393-11e8-b7cc-42010a800002",
                "kind": {"group": "policy", "version": "v1", "kind": "Eviction"},
                "resource": {"group": "", "version": "v1", "resource": "pods"},
                "subResource": sub_resource,
                "name": "llm-0",
                "namespace": "team-a",
                "operation": operation,
                "userInfo": {"username": user, "groups": ["system:serviceaccounts"], "extra": extra},
                "object": {"apiVersion": "policy/v1", "kind": "Eviction", "metadata": {"name": "llm-0", "namespace": "team-a"}},
                "dryRun": false
            }
        });
        let review: AdmissionReview<DynamicObject> = serde_json::from_value(body).expect("parses");
        review.try_into().expect("has a request")
    }

    const AGENT: &str = "system:serviceaccount:gpubudget:gpubudget-agent";

    #[test]
    fn own_node_is_allowed() {
        let req = review(AGENT, Some(&["gpu-1"]), Some("eviction"), "CREATE");
        assert!(needs_lookup(&req));
        let r = decide(&req, Some(&Lookup::OnNode("gpu-1".into())));
        assert!(r.allowed);
        assert_eq!(r.uid, "705ab4f5-6393-11e8-b7cc-42010a800002");
    }

    #[test]
    fn other_node_is_denied_with_the_reason() {
        let req = review(AGENT, Some(&["gpu-1"]), Some("eviction"), "CREATE");
        let r = decide(&req, Some(&Lookup::OnNode("gpu-2".into())));
        assert!(!r.allowed);
        assert_eq!((r.result.code, r.result.reason.as_str()), (403, "Forbidden"));
        assert_eq!(
            r.result.message,
            "the gpubudget agent of node gpu-1 may evict only pods of node gpu-1: pod team-a/llm-0 runs on node gpu-2"
        );
    }

    #[test]
    fn missing_or_ambiguous_claims_are_denied() {
        let req = review(AGENT, None, Some("eviction"), "CREATE");
        assert!(!needs_lookup(&req));
        let r = decide(&req, None);
        assert!(!r.allowed);
        assert!(r.result.message.contains("credential names no node"), "{}", r.result.message);
        let req = review(AGENT, Some(&["gpu-1", "gpu-2"]), Some("eviction"), "CREATE");
        assert!(!decide(&req, None).allowed);
    }

    #[test]
    fn unknown_unscheduled_or_unreadable_pods_are_denied() {
        let req = review(AGENT, Some(&["gpu-1"]), Some("eviction"), "CREATE");
        for (lookup, says) in [
            (Lookup::NotFound, "does not exist"),
            (Lookup::Unscheduled, "is not scheduled"),
            (Lookup::Failed("timeout".into()), "could not be looked up (timeout)"),
        ] {
            let r = decide(&req, Some(&lookup));
            assert!(!r.allowed && r.result.message.contains(says), "{lookup:?}: {}", r.result.message);
        }
        assert!(!decide(&req, None).allowed);
    }

    #[test]
    fn other_identities_and_other_requests_are_allowed() {
        let admin = review("kubernetes-admin", None, Some("eviction"), "CREATE");
        assert!(!needs_lookup(&admin));
        assert!(decide(&admin, None).allowed);
        let not_eviction = review(AGENT, Some(&["gpu-1"]), None, "CREATE");
        assert!(!needs_lookup(&not_eviction));
        assert!(decide(&not_eviction, None).allowed);
        let update = review(AGENT, Some(&["gpu-1"]), Some("eviction"), "UPDATE");
        assert!(decide(&update, None).allowed);
    }
}
