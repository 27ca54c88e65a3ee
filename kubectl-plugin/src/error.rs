//! The plugin's errors, each saying what was asked of whom and what to do.

/// The budgets' resource, as errors name it (a 404 on it means the CRD is not installed).
pub const BUDGETS: &str = "gpumemorybudgets.gpubudget.io";
/// The cluster budgets' resource, as errors name it.
pub const CLUSTER_BUDGETS: &str = "clustergpumemorybudgets.gpubudget.io";
/// The nodes' usage objects (#34), as RBAC names them.
pub const NODE_USAGES: &str = "gpunodeusages.gpubudget.io";

/// Where a request went: `in namespace team-a`, or `at the cluster scope` (`-A`).
pub fn scope(namespace: Option<&str>) -> String {
    match namespace {
        Some(ns) => format!("in namespace {ns}"),
        None => "at the cluster scope (all namespaces)".to_owned(),
    }
}

/// What went wrong.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// No usable kubeconfig, context or in-cluster configuration.
    #[error("cannot configure a client: {0}")]
    Config(String),
    /// RBAC refused a request (HTTP 403).
    #[error(
        "forbidden: cannot {verb} {resource} {scope}: RBAC does not allow it for you ({message}); ask an admin for \
         \"{verb}\" on \"{resource}\" there{hint}"
    )]
    Forbidden { verb: &'static str, resource: &'static str, scope: String, message: String, hint: &'static str },
    /// The credentials were rejected (HTTP 401).
    #[error(
        "unauthorized: the API server rejected the credentials of this context ({0}); log in again or pick another --context"
    )]
    Unauthorized(String),
    /// The resource is not served (the CRD is not installed).
    #[error("the API server does not serve {resource}: {why}")]
    NotServed { resource: &'static str, why: &'static str },
    /// No pod, no event about one, no budget's last eviction of one.
    #[error(
        "pod {name} not found in namespace {namespace}, and no event or budget names it (events last an hour by \
         default: an older eviction is only in the budget's status.lastEviction, which names the last one)"
    )]
    PodNotFound { namespace: String, name: String },
    /// Any other failure of a request.
    #[error("cannot {verb} {resource} {scope}: {message}")]
    Api { verb: &'static str, resource: &'static str, scope: String, message: String },
}

impl Error {
    /// The error of a failed request: `verb` on `resource` in `namespace` (`None`: cluster scope).
    pub fn from_kube(error: kube::Error, verb: &'static str, resource: &'static str, namespace: Option<&str>) -> Self {
        let scope = scope(namespace);
        match error {
            kube::Error::Api(status) if status.code == 403 => Error::Forbidden {
                verb,
                resource,
                message: status.message,
                hint: if namespace.is_none() { ", or name your namespace with -n NAMESPACE" } else { "" },
                scope,
            },
            kube::Error::Api(status) if status.code == 401 => Error::Unauthorized(status.message),
            kube::Error::Api(status) if status.code == 404 && resource == BUDGETS => Error::NotServed {
                resource,
                why: "the GpuMemoryBudget CRD is not installed (kubectl apply -f crds/ or install the chart)",
            },
            other => Error::Api { verb, resource, scope, message: other.to_string() },
        }
    }

    /// True for a 403: the caller may go on without this resource.
    pub fn is_forbidden(&self) -> bool {
        matches!(self, Error::Forbidden { .. })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn status(code: u16) -> kube::Error {
        kube::Error::Api(
            kube::core::Status::failure("pods is forbidden: User \"x\" cannot list", "Forbidden")
                .with_code(code)
                .boxed(),
        )
    }

    #[test]
    fn forbidden_names_the_verb_the_resource_and_the_scope() {
        let e = Error::from_kube(status(403), "list", "pods", None);
        let text = e.to_string();
        assert!(e.is_forbidden());
        assert!(text.starts_with("forbidden: cannot list pods at the cluster scope (all namespaces)"), "{text}");
        assert!(text.contains("ask an admin for \"list\" on \"pods\" there, or name your namespace with -n"), "{text}");
        let text = Error::from_kube(status(403), "get", "pods", Some("team-a")).to_string();
        assert!(text.contains("cannot get pods in namespace team-a") && !text.contains("-n NAMESPACE"), "{text}");
        assert!(matches!(Error::from_kube(status(401), "get", "pods", None), Error::Unauthorized(_)));
        assert!(matches!(Error::from_kube(status(404), "list", BUDGETS, None), Error::NotServed { .. }));
        assert!(matches!(Error::from_kube(status(500), "list", "pods", None), Error::Api { .. }));
    }
}
