//! The namespaces' labels, from a metadata-only watch: what a quota's `namespaceSelector` reads. Only an
//! administrator can label a namespace, so a tenant cannot move its namespace out of a quota.
//!
//! Minimal on purpose (a name → labels map fed by a watch); one namespace cache for the whole operator is
//! the aim, and this one has the shape to be merged into it.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, PoisonError, RwLock};

use futures::StreamExt;
use k8s_openapi::api::core::v1::Namespace;
use kube::core::PartialObjectMeta;
use kube::runtime::WatchStreamExt;
use kube::runtime::watcher::{self, Event};
use kube::{Api, Client};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

/// The labels of every namespace, kept up to date by [`Namespaces::run`].
#[derive(Debug, Clone, Default)]
pub struct Namespaces {
    labels: Arc<RwLock<HashMap<String, BTreeMap<String, String>>>>,
    listed: Arc<watch::Sender<bool>>,
}

impl Namespaces {
    /// An empty cache, not yet listed.
    pub fn new() -> Self {
        Self::default()
    }

    /// A namespace's labels (empty when unknown).
    pub fn labels(&self, namespace: &str) -> BTreeMap<String, String> {
        self.labels.read().unwrap_or_else(PoisonError::into_inner).get(namespace).cloned().unwrap_or_default()
    }

    /// Whether the first list is in.
    pub fn is_listed(&self) -> bool {
        *self.listed.borrow()
    }

    /// Watches the namespaces' metadata into the cache until `shutdown`.
    pub async fn run(&self, client: Client, shutdown: CancellationToken) {
        let api: Api<PartialObjectMeta<Namespace>> = Api::all(client);
        let config = watcher::Config::default().page_size(100);
        let mut stream = std::pin::pin!(watcher::watcher(api, config).default_backoff());
        let mut resync: Option<HashMap<String, BTreeMap<String, String>>> = None;
        loop {
            let next = tokio::select! {
                () = shutdown.cancelled() => return,
                next = stream.next() => next,
            };
            let event = match next {
                Some(Ok(event)) => event,
                Some(Err(error)) => {
                    tracing::warn!(%error, "namespace watch failed; retrying with backoff");
                    continue;
                }
                None => return,
            };
            let mut labels = self.labels.write().unwrap_or_else(PoisonError::into_inner);
            match event {
                Event::Init => resync = Some(HashMap::new()),
                Event::InitApply(ns) => {
                    if let (Some(name), Some(fresh)) = (ns.metadata.name, resync.as_mut()) {
                        fresh.insert(name, ns.metadata.labels.unwrap_or_default());
                    }
                }
                Event::InitDone => {
                    if let Some(fresh) = resync.take() {
                        *labels = fresh;
                    }
                    self.listed.send_replace(true);
                }
                Event::Apply(ns) => {
                    if let Some(name) = ns.metadata.name {
                        labels.insert(name, ns.metadata.labels.unwrap_or_default());
                    }
                }
                Event::Delete(ns) => {
                    if let Some(name) = ns.metadata.name {
                        labels.remove(&name);
                    }
                }
            }
        }
    }
}
