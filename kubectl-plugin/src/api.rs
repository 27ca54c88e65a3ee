//! Everything the plugin reads from the API server: the only I/O besides printing.

use std::collections::{BTreeMap, HashMap};

use gpubudget_common::{ClusterGpuMemoryBudget, GpuMemoryBudget, GpuNodeUsage};
use k8s_openapi::api::core::v1::{Event, Namespace, Pod};
use kube::api::{Api, ApiResource, DynamicObject, ListParams};
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::{Client, Config};

use crate::cli::Connection;
use crate::error::{BUDGETS, CLUSTER_BUDGETS, Error, NODE_USAGES};

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

/// Budgets as listed: typed, and each one's spec as stored.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Budgets {
    /// Those that parse as this plugin's `GpuMemoryBudget`.
    pub items: Vec<GpuMemoryBudget>,
    /// Each budget's `spec` as the API server returned it, by `(namespace, name)`: a field newer than this
    /// plugin (a CRD upgraded first) is kept, and shown.
    pub specs: BTreeMap<(String, String), serde_json::Value>,
    /// One line per budget that does not parse (a newer, incompatible CRD), saying why.
    pub unreadable: Vec<String>,
}

impl Budgets {
    /// From the objects of a list, untyped: one budget that does not parse does not hide the others.
    pub fn from_objects(objects: impl IntoIterator<Item = serde_json::Value>) -> Self {
        let mut out = Self::default();
        for object in objects {
            let key = |field: &str| object["metadata"][field].as_str().unwrap_or_default().to_owned();
            let (namespace, name) = (key("namespace"), key("name"));
            match serde_json::from_value::<GpuMemoryBudget>(object.clone()) {
                Ok(budget) => {
                    out.specs.insert((namespace, name), object["spec"].clone());
                    out.items.push(budget);
                }
                Err(error) => {
                    out.unreadable.push(format!("budget {namespace}/{name} cannot be read by this plugin: {error}"))
                }
            }
        }
        out
    }
}

/// Budgets in `namespace` (`None`: every namespace).
pub async fn budgets(client: &Client, namespace: Option<&str>) -> Result<Budgets, Error> {
    let resource = ApiResource::erase::<GpuMemoryBudget>(&());
    let api: Api<DynamicObject> = match namespace {
        Some(ns) => Api::namespaced_with(client.clone(), ns, &resource),
        None => Api::all_with(client.clone(), &resource),
    };
    let list = api.list(&ListParams::default()).await.map_err(|e| Error::from_kube(e, "list", BUDGETS, namespace))?;
    Ok(Budgets::from_objects(list.items.into_iter().map(|o| serde_json::to_value(o).unwrap_or_default())))
}

/// Every `ClusterGpuMemoryBudget` (#23); none when their CRD is not installed (a 404).
pub async fn cluster_budgets(client: &Client) -> Result<Vec<ClusterGpuMemoryBudget>, Error> {
    let api: Api<ClusterGpuMemoryBudget> = Api::all(client.clone());
    match api.list(&ListParams::default()).await {
        Ok(list) => Ok(list.items),
        Err(kube::Error::Api(status)) if status.code == 404 => Ok(Vec::new()),
        Err(e) => Err(Error::from_kube(e, "list", CLUSTER_BUDGETS, None)),
    }
}

/// What the nodes' `GpuNodeUsage` say each pod holds, by pod UID (#34): `node`'s only, or every node's. None
/// when their CRD is not installed (a 404; agents before #34 kept usage in the pods' records).
pub async fn measured(client: &Client, node: Option<&str>) -> Result<HashMap<String, u64>, Error> {
    let api: Api<GpuNodeUsage> = Api::all(client.clone());
    let objects = match node {
        Some(node) => api.get_opt(node).await.map(|o| o.into_iter().collect::<Vec<_>>()),
        None => api.list(&ListParams::default()).await.map(|l| l.items),
    };
    let verb = if node.is_some() { "get" } else { "list" };
    match objects {
        Ok(objects) => Ok(objects
            .into_iter()
            .flat_map(|o| o.spec.pods)
            .map(|p| (p.uid, u64::try_from(p.usage_bytes).unwrap_or(0)))
            .collect()),
        Err(kube::Error::Api(status)) if status.code == 404 => Ok(HashMap::new()),
        Err(e) => Err(Error::from_kube(e, verb, NODE_USAGES, None)),
    }
}

/// The labels of a namespace (cluster budgets select by them); none when it does not exist.
pub async fn namespace_labels(client: &Client, namespace: &str) -> Result<BTreeMap<String, String>, Error> {
    let api: Api<Namespace> = Api::all(client.clone());
    let namespace = api.get_opt(namespace).await.map_err(|e| Error::from_kube(e, "get", "namespaces", None))?;
    Ok(namespace.and_then(|n| n.metadata.labels).unwrap_or_default())
}

/// Events (core `v1`) whose involved object is the pod `name` in `namespace`, of any UID.
pub async fn pod_events(client: &Client, namespace: &str, name: &str) -> Result<Vec<Event>, Error> {
    let api: Api<Event> = Api::namespaced(client.clone(), namespace);
    let params = ListParams::default().fields(&format!("involvedObject.kind=Pod,involvedObject.name={name}"));
    api.list(&params).await.map(|l| l.items).map_err(|e| Error::from_kube(e, "list", "events", Some(namespace)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn budgets_keep_their_stored_spec_and_one_bad_one_hides_no_other() {
        let good = json!({"apiVersion": "gpubudget.io/v1alpha1", "kind": "GpuMemoryBudget",
            "metadata": {"name": "llm", "namespace": "a"}, "spec": {"selector": {}, "limit": "8Gi", "request": "6Gi"}});
        let bad = json!({"apiVersion": "gpubudget.io/v1alpha1", "kind": "GpuMemoryBudget",
            "metadata": {"name": "odd", "namespace": "a"}, "spec": {"selector": {}, "limit": "1Gi", "action": "Throttle"}});
        let b = Budgets::from_objects([good, bad]);
        assert_eq!(b.items.len(), 1);
        assert_eq!(b.specs[&("a".to_owned(), "llm".to_owned())]["request"], "6Gi", "a field newer than the plugin");
        assert_eq!(b.unreadable.len(), 1);
        assert!(b.unreadable[0].starts_with("budget a/odd cannot be read by this plugin: "), "{:?}", b.unreadable);
    }
}
