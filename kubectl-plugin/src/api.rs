//! Everything the plugin reads from the API server: the only I/O besides printing.

use gpubudget_common::GpuMemoryBudget;
use k8s_openapi::api::core::v1::{Event, Pod};
use kube::api::{Api, ListParams};
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::{Client, Config};

use crate::cli::Connection;
use crate::error::Error;

/// The budgets' resource, as errors name it.
pub const BUDGETS: &str = "gpumemorybudgets.gpubudget.io";

/// A client for the connection flags, and the namespace they pick.
pub async fn connect(flags: &Connection) -> Result<(Client, String), Error> {
    let options =
        KubeConfigOptions { context: flags.context.clone(), cluster: flags.cluster.clone(), user: flags.user.clone() };
    let config = match &flags.kubeconfig {
        Some(path) => {
            let file = Kubeconfig::read_from(path).map_err(|e| Error::Config(format!("{}: {e}", path.display())))?;
            Config::from_custom_kubeconfig(file, &options).await.map_err(|e| Error::Config(e.to_string()))?
        }
        None if flags.context.is_some() || flags.cluster.is_some() || flags.user.is_some() => {
            Config::from_kubeconfig(&options).await.map_err(|e| Error::Config(e.to_string()))?
        }
        None => Config::infer().await.map_err(|e| Error::Config(e.to_string()))?,
    };
    let namespace = flags.namespace.clone().unwrap_or_else(|| config.default_namespace.clone());
    let client = Client::try_from(config).map_err(|e| Error::Config(e.to_string()))?;
    Ok((client, namespace))
}

/// Pods in `namespace` (`None`: every namespace) matching `selector`.
pub async fn pods(client: &Client, namespace: Option<&str>, selector: Option<&str>) -> Result<Vec<Pod>, Error> {
    let api: Api<Pod> = match namespace {
        Some(ns) => Api::namespaced(client.clone(), ns),
        None => Api::all(client.clone()),
    };
    let mut params = ListParams::default();
    if let Some(s) = selector {
        params = params.labels(s);
    }
    api.list(&params).await.map(|l| l.items).map_err(|e| Error::from_kube(e, "list", "pods", namespace))
}

/// One pod; `None` when it does not exist.
pub async fn pod(client: &Client, namespace: &str, name: &str) -> Result<Option<Pod>, Error> {
    let api: Api<Pod> = Api::namespaced(client.clone(), namespace);
    api.get_opt(name).await.map_err(|e| Error::from_kube(e, "get", "pods", Some(namespace)))
}

/// Budgets in `namespace` (`None`: every namespace).
pub async fn budgets(client: &Client, namespace: Option<&str>) -> Result<Vec<GpuMemoryBudget>, Error> {
    let api: Api<GpuMemoryBudget> = match namespace {
        Some(ns) => Api::namespaced(client.clone(), ns),
        None => Api::all(client.clone()),
    };
    api.list(&ListParams::default()).await.map(|l| l.items).map_err(|e| Error::from_kube(e, "list", BUDGETS, namespace))
}

/// Events (core `v1`) whose involved object is the pod `name` in `namespace`, of any UID.
pub async fn pod_events(client: &Client, namespace: &str, name: &str) -> Result<Vec<Event>, Error> {
    let api: Api<Event> = Api::namespaced(client.clone(), namespace);
    let params = ListParams::default().fields(&format!("involvedObject.kind=Pod,involvedObject.name={name}"));
    api.list(&params).await.map(|l| l.items).map_err(|e| Error::from_kube(e, "list", "events", Some(namespace)))
}
