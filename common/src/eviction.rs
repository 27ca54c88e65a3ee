//! The body of an eviction request (`POST .../pods/{name}/eviction`), for the agent and the operator.

use k8s_openapi::api::policy::v1::Eviction;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{DeleteOptions, ObjectMeta, Preconditions};

/// A typed `policy/v1 Eviction` that carries the grace period (kube 5.0's `Api::evict` writes
/// `delete_options` in snake case, which the API server ignores, dropping the grace period) and the pod's
/// UID as a precondition: only the pod that was measured goes, not a new one that took its name (a
/// StatefulSet's).
pub fn eviction_body(namespace: &str, name: &str, uid: &str, grace_seconds: Option<i64>) -> Eviction {
    Eviction {
        metadata: ObjectMeta {
            name: Some(name.to_owned()),
            namespace: Some(namespace.to_owned()),
            ..ObjectMeta::default()
        },
        delete_options: Some(DeleteOptions {
            grace_period_seconds: grace_seconds.map(|g| g.max(0)),
            preconditions: Some(Preconditions { uid: Some(uid.to_owned()), resource_version: None }),
            ..DeleteOptions::default()
        }),
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_body_carries_the_grace_and_uid_in_camel_case() {
        let body = serde_json::to_value(super::eviction_body("team-a", "p", "u-1", Some(-3))).expect("json");
        assert_eq!(body["deleteOptions"]["gracePeriodSeconds"], 0);
        assert_eq!(body["deleteOptions"]["preconditions"]["uid"], "u-1");
        assert_eq!(body["metadata"]["namespace"], "team-a");
    }
}
