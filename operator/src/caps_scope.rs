//! The caps webhook's scope (`crate::caps_webhook`): the chart's `MutatingWebhookConfiguration` sends only
//! pods of namespaces labelled [`NAMESPACE_LABEL`], and the leader keeps that label on exactly the namespaces
//! holding a budget with `admissionCaps: Enabled`, or selected by a `ClusterGpuMemoryBudget` with caps
//! enabled ([`label_namespaces`]).
//!
//! The labeller is given what it reads (the wanted namespaces, leadership, the caches' sync) as watches, and
//! the counter it writes, by whoever runs it (the controller, from its context); it knows nothing of the
//! controller or the webhook. Which labels to change is a pure function ([`namespaces_to_label`]).

use std::collections::BTreeSet;
use std::time::Duration;

use k8s_openapi::api::core::v1::Namespace;
use kube::api::{ListParams, Patch, PatchParams};
use kube::{Api, Client};
use prometheus_client::metrics::counter::Counter;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

/// The label the leader keeps on namespaces holding a budget with `admissionCaps: Enabled`; the webhook's
/// `namespaceSelector` matches it.
pub const NAMESPACE_LABEL: &str = "gpubudget.io/admission-caps";
/// The label's value.
pub const NAMESPACE_LABEL_VALUE: &str = "enabled";
/// The field manager of the namespace label (server-side apply).
pub const LABEL_FIELD_MANAGER: &str = "gpubudget-operator-caps";

/// What [`label_namespaces`] reads and writes.
pub struct Labeller {
    /// The client it labels with.
    pub client: Client,
    /// The namespaces that should carry the label, as they change.
    pub wanted: watch::Receiver<BTreeSet<String>>,
    /// Whether this replica may write (leads, or election is off), as it changes.
    pub leader: watch::Receiver<bool>,
    /// Whether the caches have listed, as it changes (until then `wanted` is not known in full).
    pub synced: watch::Receiver<bool>,
    /// Counts each label set or removed (`gpubudget_operator_caps_namespace_label_writes_total`).
    pub writes: Counter,
}

impl std::fmt::Debug for Labeller {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Labeller").finish_non_exhaustive()
    }
}

/// The namespace label changes that make the labelled set equal to `wanted`: (label these, unlabel these).
pub fn namespaces_to_label(labelled: &BTreeSet<String>, wanted: &BTreeSet<String>) -> (Vec<String>, Vec<String>) {
    (wanted.difference(labelled).cloned().collect(), labelled.difference(wanted).cloned().collect())
}

/// Keeps [`NAMESPACE_LABEL`] on exactly the namespaces holding a budget with caps enabled, while this
/// replica leads and its caches have listed. Labels are set by server-side apply with
/// [`LABEL_FIELD_MANAGER`] and removed by a merge patch (whoever wrote them). On becoming leader it lists the labelled
/// namespaces first, so a label left by a previous leader for a budget since deleted is removed. Failures
/// are logged and retried after [`LABEL_RETRY`]. Returns when `shutdown` is cancelled.
pub async fn label_namespaces(labeller: Labeller, shutdown: CancellationToken) {
    let Labeller { client, wanted: mut wanted_rx, mut leader, mut synced, writes } = labeller;
    let api: Api<Namespace> = Api::all(client);
    let mut labelled: Option<BTreeSet<String>> = None;
    loop {
        let ready = *leader.borrow_and_update() && *synced.borrow_and_update();
        if !ready {
            labelled = None;
        } else {
            let wanted = wanted_rx.borrow_and_update().clone();
            match sync_labels(&api, &writes, labelled.take(), &wanted).await {
                Ok(now) => labelled = Some(now),
                Err(error) => {
                    tracing::warn!(%error, "cannot label the namespaces of caps-enabled budgets; retrying");
                    tokio::select! {
                        () = shutdown.cancelled() => return,
                        () = tokio::time::sleep(LABEL_RETRY) => continue,
                    }
                }
            }
        }
        tokio::select! {
            () = shutdown.cancelled() => return,
            () = changed(&mut wanted_rx) => {}
            () = changed(&mut leader) => {}
            () = changed(&mut synced) => {}
        }
    }
}

/// Waits for the next change; never returns once the sender is gone (a value that cannot change any more,
/// such as leadership without election, must not end the labeller, nor with it the controller).
async fn changed<T>(rx: &mut tokio::sync::watch::Receiver<T>) {
    if rx.changed().await.is_err() {
        std::future::pending::<()>().await;
    }
}

/// How long after a failed label write the labeller tries again.
pub const LABEL_RETRY: Duration = Duration::from_secs(5);

async fn sync_labels(
    api: &Api<Namespace>,
    writes: &Counter,
    labelled: Option<BTreeSet<String>>,
    wanted: &BTreeSet<String>,
) -> Result<BTreeSet<String>, kube::Error> {
    let mut labelled = match labelled {
        Some(known) => known,
        None => {
            let selector = format!("{NAMESPACE_LABEL}={NAMESPACE_LABEL_VALUE}");
            let list = api.list_metadata(&ListParams::default().labels(&selector)).await?;
            list.items.into_iter().filter_map(|n| n.metadata.name).collect()
        }
    };
    let (add, remove) = namespaces_to_label(&labelled, wanted);
    for (name, label) in add.iter().map(|n| (n, true)).chain(remove.iter().map(|n| (n, false))) {
        let written = if label {
            let body = serde_json::json!({"apiVersion": "v1", "kind": "Namespace",
                "metadata": {"name": name, "labels": {NAMESPACE_LABEL: NAMESPACE_LABEL_VALUE}}});
            api.patch(name, &PatchParams::apply(LABEL_FIELD_MANAGER).force(), &Patch::Apply(&body)).await
        } else {
            // A merge patch, not an apply: the label goes even if someone else (or a manager of another
            // name) wrote it; the label is the webhook's scope and nothing else's.
            let body = serde_json::json!({"metadata": {"labels": {NAMESPACE_LABEL: null}}});
            let params = PatchParams { field_manager: Some(LABEL_FIELD_MANAGER.into()), ..PatchParams::default() };
            api.patch(name, &params, &Patch::Merge(&body)).await
        };
        match written {
            Ok(_) => {}
            // A namespace being deleted (or gone) needs no label.
            Err(kube::Error::Api(e)) if !label && e.code == 404 => {}
            Err(error) => return Err(error),
        }
        writes.inc();
        tracing::info!(namespace = %name, label = NAMESPACE_LABEL, set = label, "caps webhook scope changed");
        if label {
            labelled.insert(name.clone());
        } else {
            labelled.remove(name);
        }
    }
    Ok(labelled)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn labels_follow_the_namespaces_with_caps_budgets() {
        let set = |names: &[&str]| names.iter().map(|n| (*n).to_owned()).collect::<BTreeSet<String>>();
        assert_eq!(
            namespaces_to_label(&set(&["a", "b"]), &set(&["b", "c"])),
            (vec!["c".to_owned()], vec!["a".to_owned()])
        );
        assert_eq!(namespaces_to_label(&set(&["a"]), &set(&["a"])), (vec![], vec![]));
    }
}
