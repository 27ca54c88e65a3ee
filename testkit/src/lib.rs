//! An in-memory **fake** of the Kubernetes API server for gpubudget's tests. It is not a cluster and
//! nothing here schedules, runs or admits anything; it answers the HTTP requests that `kube`'s `Api`,
//! watchers, reflectors, controllers and event recorder send, the way the real API server answers them,
//! so the code under test runs unchanged against a real [`kube::Client`].
//!
//! ```no_run
//! # async fn demo() {
//! use gpubudget_testkit::{FakeApi, Verb};
//! use k8s_openapi::api::core::v1::Pod;
//! let fake = FakeApi::new();
//! fake.apply_yaml("apiVersion: v1\nkind: Pod\nmetadata: {name: p, namespace: default}\n").unwrap();
//! let pods: kube::Api<Pod> = kube::Api::default_namespaced(fake.client());
//! assert!(pods.get("p").await.is_ok());
//! assert_eq!(fake.count(Verb::Get, "pods"), 1);
//! # }
//! ```
//!
//! Resources are named the way `kubectl` names them: `pods`, `events.events.k8s.io`,
//! `gpumemorybudgets.gpubudget.io`. A bare plural means the core group's resource if there is one, else the
//! first group that has it; in filters ([`FakeApi::count`], [`FakeApi::fail_next`]) a bare plural matches
//! every group, `plural/subresource` (`pods/eviction`, `gpumemorybudgets/status`) a subresource and `*`
//! anything. Cluster-scoped objects live in namespace `""`.
//!
//! What is modelled and what is not is listed in the crate's README.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::task::{Context, Poll};
use std::time::Duration;

use http::{Request, Response};
use http_body_util::BodyExt;
use serde_json::{Value, json};
use tokio::task::JoinHandle;
use tower::Service;

mod defaults;
mod discovery;
mod events;
mod object;
mod select;
mod server;
mod ssa;
mod store;
mod table;

use object::{Gr, meta_str};
pub use server::ResponseBody;
use store::{Change, EvictionBlock, Fault, State};

/// A request verb, as RBAC names them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Verb {
    Get,
    List,
    Watch,
    Create,
    Update,
    Patch,
    Delete,
    DeleteCollection,
}

impl Verb {
    /// `get`, `list`, `watch`, `create`, `update`, `patch`, `delete` or `deletecollection`.
    pub fn as_str(self) -> &'static str {
        match self {
            Verb::Get => "get",
            Verb::List => "list",
            Verb::Watch => "watch",
            Verb::Create => "create",
            Verb::Update => "update",
            Verb::Patch => "patch",
            Verb::Delete => "delete",
            Verb::DeleteCollection => "deletecollection",
        }
    }
}

/// One request the fake answered.
#[derive(Debug, Clone, PartialEq)]
pub struct RecordedRequest {
    pub method: String,
    pub path: String,
    /// The raw query string (percent-encoded).
    pub query: String,
    pub content_type: Option<String>,
    pub accept: Option<String>,
    /// The body as JSON (YAML for apply patches is converted); a body that is neither is a JSON string.
    pub body: Option<Value>,
    /// The HTTP status answered (200 for a watch that was opened).
    pub status: u16,
    pub verb: Verb,
    pub group: String,
    /// The plural (`pods`).
    pub resource: String,
    pub subresource: Option<String>,
    pub namespace: Option<String>,
    pub name: Option<String>,
    /// Warnings answered in `Warning` headers (unknown fields of an eviction body).
    pub warnings: Vec<String>,
}

impl RecordedRequest {
    /// A decoded query parameter (`fieldManager`, `labelSelector`, ...).
    pub fn param(&self, key: &str) -> Option<String> {
        form_urlencoded::parse(self.query.as_bytes()).find(|(k, _)| k == key).map(|(_, v)| v.into_owned())
    }
}

/// An Event about a pod, from either Events API, reduced to what assertions need.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EventSummary {
    /// `v1` or `events.k8s.io/v1`.
    pub api_version: String,
    /// `Normal` or `Warning`.
    pub type_: String,
    pub reason: String,
    /// `message` (core) or `note` (events.k8s.io).
    pub message: String,
    pub action: String,
    /// `reportingController` (events.k8s.io), `reportingComponent` or `source.component` (core).
    pub reporting_controller: String,
    pub reporting_instance: String,
    /// `series.count` (events.k8s.io) or `count` (core); 1 when absent.
    pub count: i64,
}

/// Errors of the direct (non-HTTP) store helpers.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("invalid YAML: {0}")]
    Yaml(#[from] serde_yaml::Error),
    #[error("invalid object: {0}")]
    Invalid(String),
}

/// A kubeconfig for a fake served at `server_url` (`http://127.0.0.1:PORT`, see [`FakeApi::serve`]):
/// cluster, user and context `gpubudget-demo`, namespace `default`, no credentials.
pub fn kubeconfig_yaml(server_url: &str) -> String {
    const NAME: &str = "gpubudget-demo";
    let config = json!({
        "apiVersion": "v1", "kind": "Config", "current-context": NAME,
        "clusters": [{"name": NAME, "cluster": {"server": server_url}}],
        "users": [{"name": NAME, "user": {}}],
        "contexts": [{"name": NAME, "context": {"cluster": NAME, "user": NAME, "namespace": "default"}}],
    });
    serde_yaml::to_string(&config).expect("a JSON value is valid YAML")
}

/// Whether a resource pattern (see the crate docs) matches a request's resource.
pub(crate) fn resource_matches(pattern: &str, group: &str, plural: &str, sub: Option<&str>) -> bool {
    if pattern == "*" {
        return true;
    }
    let (resource, sub_pattern) = match pattern.split_once('/') {
        Some((r, s)) => (r, Some(s)),
        None => (pattern, None),
    };
    let (p, g) = match resource.split_once('.') {
        Some((p, g)) => (p, Some(g)),
        None => (resource, None),
    };
    p == plural && g.is_none_or(|g| g == group) && (sub_pattern == sub || (sub_pattern == Some("*") && sub.is_some()))
}

#[derive(Debug, Default)]
struct Shared {
    state: Mutex<State>,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// The fake API server. Clones share the same state.
#[derive(Debug, Clone, Default)]
pub struct FakeApi {
    shared: Arc<Shared>,
}

/// The fake as a `tower::Service`, for [`kube::Client::new`] (what [`FakeApi::client`] does).
#[derive(Debug, Clone)]
pub struct FakeService {
    shared: Arc<Shared>,
}

impl tower::Service<Request<kube::client::Body>> for FakeService {
    type Response = Response<ResponseBody>;
    type Error = Infallible;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, Infallible>> + Send>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: Request<kube::client::Body>) -> Self::Future {
        let shared = self.shared.clone();
        Box::pin(async move {
            let (parts, body) = request.into_parts();
            let bytes = body.collect().await.map(|c| c.to_bytes()).unwrap_or_default();
            let latency = {
                let mut state = shared.lock();
                state.in_flight += 1;
                state.max_in_flight = state.max_in_flight.max(state.in_flight);
                state.latency
            };
            if !latency.is_zero() {
                tokio::time::sleep(latency).await;
            }
            let mut state = shared.lock();
            state.in_flight -= 1;
            Ok(server::respond(&mut state, Request::from_parts(parts, bytes)))
        })
    }
}

impl FakeApi {
    /// An empty fake. Status subresources are registered for pods, nodes, namespaces, services,
    /// gpumemorybudgets, customresourcedefinitions and the apps workloads; not for leases or events.
    pub fn new() -> Self {
        Self::default()
    }

    /// Registers a status subresource for `resource` (`plural` or `plural.group`).
    pub fn with_status_subresource(self, resource: &str) -> Self {
        {
            let mut state = self.state();
            let gr = state.resolve(resource);
            state.set_status_subresource(gr);
        }
        self
    }

    fn state(&self) -> MutexGuard<'_, State> {
        self.shared.lock()
    }

    /// A real `kube::Client` talking to this fake, default namespace `default`. Needs a Tokio runtime.
    pub fn client(&self) -> kube::Client {
        kube::Client::new(self.service(), "default")
    }

    pub fn service(&self) -> FakeService {
        FakeService { shared: self.shared.clone() }
    }

    /// Serves the fake over plain HTTP/1.1 on `addr` (`"127.0.0.1:0"`: any free port), for clients in
    /// other processes such as `kubectl` (see [`kubeconfig_yaml`]). Returns the address bound and the
    /// server task: aborting it closes the listener and every connection, watches included.
    pub async fn serve(&self, addr: impl tokio::net::ToSocketAddrs) -> std::io::Result<(SocketAddr, JoinHandle<()>)> {
        let listener = tokio::net::TcpListener::bind(addr).await?;
        let local = listener.local_addr()?;
        let fake = self.service();
        let task = tokio::spawn(async move {
            let mut connections = tokio::task::JoinSet::new();
            loop {
                let Ok((stream, _)) = listener.accept().await else { continue };
                while connections.try_join_next().is_some() {}
                let fake = fake.clone();
                let service = hyper::service::service_fn(move |request: Request<hyper::body::Incoming>| {
                    let mut fake = fake.clone();
                    async move {
                        let (parts, body) = request.into_parts();
                        let bytes = body.collect().await.map(|c| c.to_bytes()).unwrap_or_default();
                        fake.call(Request::from_parts(parts, kube::client::Body::from(bytes))).await
                    }
                });
                let connection = hyper::server::conn::http1::Builder::new()
                    .serve_connection(hyper_util::rt::TokioIo::new(stream), service);
                connections.spawn(async move { _ = connection.await });
            }
        });
        Ok((local, task))
    }

    // ---- the store, directly (these fire watch events like API writes) ----

    /// The stored object (`""` namespace for cluster-scoped ones).
    pub fn get(&self, resource: &str, namespace: &str, name: &str) -> Option<Value> {
        let state = self.state();
        state.get(&state.resolve(resource), namespace, name).cloned()
    }

    /// Stored objects of a resource, in one namespace or all, ordered by namespace and name.
    pub fn list(&self, resource: &str, namespace: Option<&str>) -> Vec<Value> {
        let state = self.state();
        state.list(&state.resolve(resource), namespace).into_iter().cloned().collect()
    }

    /// The `meta.k8s.io/v1` `Table` the fake answers `kubectl get <resource>` with (in one namespace, or all
    /// for `None`: `-A`): the same printer columns, cells and row order as over HTTP, each row with the object's
    /// metadata (`includeObject=Metadata`, kubectl's default).
    pub fn table(&self, resource: &str, namespace: Option<&str>) -> Value {
        self.state().table(resource, namespace)
    }

    /// The stored object as a typed resource (`None` when absent or when it does not deserialize).
    pub fn typed<K>(&self, namespace: &str, name: &str) -> Option<K>
    where
        K: kube::Resource<DynamicType = ()> + serde::de::DeserializeOwned,
    {
        let state = self.state();
        let object = state.get(&Gr::new(&K::group(&()), &K::plural(&())), namespace, name)?;
        serde_json::from_value(object.clone()).ok()
    }

    /// Creates or replaces an object in the store as given, status included (no admission, no status
    /// stripping, no managed fields). Without a namespace a namespaced object goes to `default`.
    pub fn put_object(&self, mut object: Value) -> Result<Value, Error> {
        let field = |k: &str| object[k].as_str().filter(|s| !s.is_empty()).map(str::to_owned);
        let (Some(api_version), Some(kind)) = (field("apiVersion"), field("kind")) else {
            return Err(Error::Invalid("apiVersion and kind are required".into()));
        };
        if meta_str(&object, "name").is_empty() {
            return Err(Error::Invalid(format!("a {kind} without metadata.name")));
        }
        let mut state = self.state();
        let (gr, namespaced) = state.resource_for(&api_version, &kind);
        if !namespaced {
            object["metadata"].as_object_mut().map(|m| m.remove("namespace"));
        } else if meta_str(&object, "namespace").is_empty() {
            object["metadata"]["namespace"] = "default".into();
        }
        state.learn(&gr, &object, namespaced);
        let (ns, name) = (meta_str(&object, "namespace").to_owned(), meta_str(&object, "name").to_owned());
        Ok(match state.get(&gr, &ns, &name).cloned() {
            Some(live) => {
                if object["metadata"]["managedFields"].is_null() && !live["metadata"]["managedFields"].is_null() {
                    object["metadata"]["managedFields"] = live["metadata"]["managedFields"].clone();
                }
                state.update(&gr, &live, object, false)
            }
            None => state.insert_new(&gr, object),
        })
    }

    /// [`put_object`](Self::put_object) for each document of a multi-document YAML string.
    pub fn apply_yaml(&self, yaml: &str) -> Result<Vec<Value>, Error> {
        let mut out = Vec::new();
        for document in serde_yaml::Deserializer::from_str(yaml) {
            let object: Value = serde::Deserialize::deserialize(document)?;
            if !object.is_null() {
                out.push(self.put_object(object)?);
            }
        }
        Ok(out)
    }

    /// Changes a stored object in place (a MODIFIED event unless nothing changed). `None` if absent.
    pub fn modify(&self, resource: &str, namespace: &str, name: &str, f: impl FnOnce(&mut Value)) -> Option<Value> {
        let mut state = self.state();
        let gr = state.resolve(resource);
        let live = state.get(&gr, namespace, name)?.clone();
        let mut new = live.clone();
        f(&mut new);
        Some(state.update(&gr, &live, new, false))
    }

    /// Replaces a pod's labels. `false` if the pod does not exist.
    pub fn set_pod_labels<I, K, V>(&self, namespace: &str, name: &str, labels: I) -> bool
    where
        I: IntoIterator<Item = (K, V)>,
        K: Into<String>,
        V: Into<String>,
    {
        let labels: serde_json::Map<String, Value> =
            labels.into_iter().map(|(k, v)| (k.into(), Value::String(v.into()))).collect();
        self.modify("pods", namespace, name, |pod| pod["metadata"]["labels"] = Value::Object(labels)).is_some()
    }

    /// Removes an object at once (a DELETED event), ignoring finalizers and grace periods.
    pub fn delete_object(&self, resource: &str, namespace: &str, name: &str) -> bool {
        let mut state = self.state();
        let gr = state.resolve(resource);
        let Some(live) = state.get(&gr, namespace, name).cloned() else { return false };
        state.commit(&gr, live, Change::Deleted);
        true
    }

    /// What the kubelet does when a terminating pod has stopped: removes a pod that has a
    /// deletionTimestamp and no finalizers. `false` if there is no such pod.
    pub fn finish_deletion(&self, namespace: &str, pod: &str) -> bool {
        let mut state = self.state();
        let gr = Gr::new("", "pods");
        match state.get(&gr, namespace, pod).cloned() {
            Some(live)
                if !live["metadata"]["deletionTimestamp"].is_null()
                    && live["metadata"]["finalizers"].as_array().is_none_or(Vec::is_empty) =>
            {
                state.commit(&gr, live, Change::Deleted);
                true
            }
            _ => false,
        }
    }

    /// The current resourceVersion (every write increments it).
    pub fn resource_version(&self) -> u64 {
        self.state().rv
    }

    // ---- behaviour ----

    /// Graceful pod deletion: DELETE (and eviction) of a pod sets deletionTimestamp and
    /// deletionGracePeriodSeconds (from the request, else the pod's terminationGracePeriodSeconds, else 30)
    /// and leaves the pod until [`finish_deletion`](Self::finish_deletion). A grace period of 0 deletes at
    /// once. Off by default: pods go at once.
    pub fn set_graceful_pod_deletion(&self, enabled: bool) {
        self.state().graceful_pods = enabled;
    }

    /// Refuses the next `n` evictions with 429, as a PodDisruptionBudget would.
    pub fn block_evictions(&self, n: usize) {
        self.state().eviction_block = (n > 0).then_some(EvictionBlock::Next(n));
    }

    /// Refuses every eviction with 429 until [`allow_evictions`](Self::allow_evictions).
    pub fn block_all_evictions(&self) {
        self.state().eviction_block = Some(EvictionBlock::Always);
    }

    pub fn allow_evictions(&self) {
        self.state().eviction_block = None;
    }

    /// Answers the next `n` requests of `verb` on `resource` (a pattern, see the crate docs) with `code`
    /// and a metav1 Status body, before they reach the store. A watch given 410 gets it the way the real
    /// server reports an expired resourceVersion: an ERROR event on a 200 stream.
    pub fn fail_next(&self, verb: Verb, resource: &str, n: usize, code: u16) {
        if n > 0 {
            self.state().faults.push(Fault { verb, resource: resource.to_owned(), remaining: n, code });
        }
    }

    pub fn clear_faults(&self) {
        self.state().faults.clear();
    }

    /// Delays every answer by `latency`.
    pub fn set_latency(&self, latency: Duration) {
        self.state().latency = latency;
    }

    /// The most requests answered at once (each counted from its arrival until its answer starts; with
    /// [`Self::set_latency`], that is at least the latency) since the fake began or the last
    /// [`Self::reset_max_in_flight`].
    pub fn max_in_flight(&self) -> usize {
        self.state().max_in_flight
    }

    /// Starts [`Self::max_in_flight`] afresh.
    pub fn reset_max_in_flight(&self) {
        let mut state = self.state();
        state.max_in_flight = state.in_flight;
    }

    /// Ends every open watch stream cleanly, as an API server restart or a load balancer would. Clients
    /// resume from their last resourceVersion and are replayed what they missed.
    pub fn disconnect_watches(&self) {
        self.state().disconnect_watches();
    }

    /// Sends a BOOKMARK with the current resourceVersion to every watch that allowed bookmarks.
    pub fn send_bookmarks(&self) {
        self.state().send_bookmarks();
    }

    /// Forgets the change history: a watch resuming from an older resourceVersion gets 410 Expired
    /// (and a kube watcher re-lists).
    pub fn compact_history(&self) {
        self.state().compact_history();
    }

    /// Watch streams still open.
    pub fn open_watches(&self) -> usize {
        self.state().open_watches()
    }

    /// Watch streams still open on `resource` (`plural` or `plural.group`), each as whether it asks for
    /// metadata only.
    pub fn open_watches_on(&self, resource: &str) -> Vec<bool> {
        let mut state = self.state();
        let gr = state.resolve(resource);
        state.open_watches_on(&gr)
    }

    // ---- observation ----

    pub fn requests(&self) -> Vec<RecordedRequest> {
        self.state().requests.clone()
    }

    pub fn clear_requests(&self) {
        self.state().requests.clear();
    }

    /// How many requests of `verb` on `resource` (a pattern, see the crate docs) were answered.
    pub fn count(&self, verb: Verb, resource: &str) -> usize {
        let state = self.state();
        state
            .requests
            .iter()
            .filter(|r| r.verb == verb && resource_matches(resource, &r.group, &r.resource, r.subresource.as_deref()))
            .count()
    }

    /// The body of every eviction request, as sent, in order (refused ones included).
    pub fn evictions(&self) -> Vec<Value> {
        self.state().evictions.clone()
    }

    /// Events about a pod from both Events APIs (core v1 `involvedObject`, events.k8s.io `regarding`),
    /// oldest first.
    pub fn events_for(&self, namespace: &str, pod: &str) -> Vec<EventSummary> {
        self.state().events_for(namespace, pod)
    }

    /// Polls `condition` every 10 ms of tokio's clock until it holds (true) or `timeout` passes (false). On a
    /// paused clock (`#[tokio::test(start_paused = true)]`) the wait takes no wall-clock time: the clock moves
    /// from timer to timer whenever the runtime has nothing else to run.
    pub async fn wait_until(&self, timeout: Duration, mut condition: impl FnMut(&FakeApi) -> bool) -> bool {
        wait_for(timeout, || condition(self)).await
    }
}

/// [`FakeApi::wait_until`] for a condition on something else than the fake (a component's health, its
/// metrics).
pub async fn wait_for(timeout: Duration, mut condition: impl FnMut() -> bool) -> bool {
    let deadline = tokio::time::Instant::now() + timeout;
    loop {
        if condition() {
            return true;
        }
        if tokio::time::Instant::now() >= deadline {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Lets `window` of tokio's **paused** clock pass, for the assertions that something does *not* happen in a
/// window ("still one eviction after 800 ms"). The runtime moves the clock from timer to timer and runs every
/// task woken in between, so each tick, retry and timeout of the code under test that falls in the window
/// runs, in order, as it would on the wall clock; the call itself takes no wall-clock time.
///
/// # Panics
///
/// Unless the clock is paused (`#[tokio::test(start_paused = true)]`): it is never a wall-clock wait.
#[cfg(feature = "paused-clock")]
pub async fn pass_time(window: Duration) {
    use futures::FutureExt;
    // `advance` panics ("time is not frozen") on a clock that runs; by zero it moves nothing.
    let paused = std::panic::AssertUnwindSafe(tokio::time::advance(Duration::ZERO)).catch_unwind().await;
    assert!(paused.is_ok(), "pass_time needs tokio's paused clock (#[tokio::test(start_paused = true)])");
    tokio::time::sleep(window).await;
}
