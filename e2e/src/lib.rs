//! End-to-end tests for gpubudget. The tests live in `tests/`:
//! - `story.rs`: the user's stories in one process, on the `gpubudget-demo` harness (in-memory API);
//! - `apiserver.rs` (with its harness and stories in `tests/apiserver/`) drives the release binaries against a real
//!   kube-apiserver over a `kube::Client`, and `cluster.rs` runs `cluster/run.sh` against the cluster in
//!   `KUBECONFIG`: both ignored unless asked (`-- --ignored` with
//!   `GPUBUDGET_E2E_APISERVER=1` or `GPUBUDGET_E2E_CLUSTER=1`; the ignore reason says how);
//! - `gpu/run.sh` is the real-GPU check, run by hand on a GPU machine (see docs/performance.md).
//!
//! The library holds what the real API server tier's harness shares with its Helm post-renderer
//! (`src/bin/gpubudget-e2e-url-mode.rs`): the chart's webhooks put in URL mode, for an operator run on this machine.

use serde_json::{Value, json};

/// Puts the webhooks of a `ValidatingWebhookConfiguration` or `MutatingWebhookConfiguration` in URL mode,
/// `https://<host><the webhook's path>` with `ca_bundle` (base64) as their CA, instead of the chart's Service: an
/// operator on this machine (`host`: `127.0.0.1:<port>`) serves them, no kube-proxy carries a Service there.
/// Returns whether `object` was such a configuration; any other object is left as it is.
pub fn url_mode(object: &mut Value, host: &str, ca_bundle: &str) -> bool {
    if !object["kind"].as_str().is_some_and(|k| k.ends_with("WebhookConfiguration")) {
        return false;
    }
    for hook in object["webhooks"].as_array_mut().into_iter().flatten() {
        let path = hook["clientConfig"]["service"]["path"].as_str().unwrap_or("/").to_owned();
        hook["clientConfig"] = json!({"url": format!("https://{host}{path}"), "caBundle": ca_bundle});
    }
    true
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_webhook_configuration_is_put_in_url_mode_keeping_each_path() {
        let mut config = json!({"kind": "ValidatingWebhookConfiguration", "webhooks": [
            {"name": "a", "clientConfig": {"service": {"name": "s", "namespace": "n", "path": "/validate-eviction",
                "port": 443}, "caBundle": "old"}},
            {"name": "b", "clientConfig": {"service": {"name": "s", "namespace": "n"}}}]});
        assert!(url_mode(&mut config, "127.0.0.1:9443", "Q0E="));
        assert_eq!(
            config["webhooks"][0]["clientConfig"],
            json!({"url": "https://127.0.0.1:9443/validate-eviction", "caBundle": "Q0E="})
        );
        assert_eq!(config["webhooks"][1]["clientConfig"]["url"], "https://127.0.0.1:9443/");
        let mut other = json!({"kind": "ConfigMap", "data": {"webhooks": "x"}});
        assert!(!url_mode(&mut other, "127.0.0.1:9443", "Q0E="));
        assert_eq!(other, json!({"kind": "ConfigMap", "data": {"webhooks": "x"}}));
    }
}
