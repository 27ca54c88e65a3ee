//! What a reconcile can fail with, and how each failure is labelled in metrics and events.

use gpubudget_common::SpecError;

/// A reconcile failure.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The Kubernetes API failed or refused a request (transient: retried with backoff).
    #[error("Kubernetes API: {0}")]
    Kube(#[source] kube::Error),
    /// The status write lost a race: the budget changed since it was read (retried once the cache has the
    /// newer version).
    #[error("the budget changed while its status was computed; retrying")]
    Conflict,
    /// The budget's spec cannot be enforced: its status says so (Ready=False) and it waits for a change.
    #[error("invalid spec: {0}")]
    InvalidSpec(#[source] SpecError),
    /// The object has no name or namespace.
    #[error("the object has no name or namespace")]
    Unnamed,
    /// The status could not be serialized.
    #[error("serializing the status: {0}")]
    Serialize(#[source] serde_json::Error),
}

impl Error {
    /// A stable, low-cardinality label: the `error` label of
    /// `gpubudget_operator_reconcile_failures_total` and the reason of failure events.
    pub fn metric_label(&self) -> &'static str {
        match self {
            Error::Kube(kube::Error::Api(status)) => match status.code {
                403 => "api_forbidden",
                404 => "api_not_found",
                409 => "conflict",
                429 => "api_throttled",
                500..=599 => "api_unavailable",
                _ => "api_rejected",
            },
            Error::Kube(_) => "api_unreachable",
            Error::Conflict => "conflict",
            Error::InvalidSpec(_) => "invalid_spec",
            Error::Unnamed => "unnamed",
            Error::Serialize(_) => "serialize",
        }
    }

    /// Whether retrying can help (else the object waits for a change).
    pub fn is_transient(&self) -> bool {
        !matches!(self, Error::InvalidSpec(_) | Error::Unnamed | Error::Serialize(_))
    }
}

impl From<kube::Error> for Error {
    fn from(error: kube::Error) -> Self {
        match &error {
            kube::Error::Api(status) if status.code == 409 => Error::Conflict,
            _ => Error::Kube(error),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn api(code: u16) -> Error {
        Error::from(kube::Error::Api(Box::new(kube::core::Status::failure("x", "y").with_code(code))))
    }

    #[test]
    fn labels_are_stable_and_transience_is_right() {
        assert_eq!(api(409).metric_label(), "conflict");
        assert!(matches!(api(409), Error::Conflict));
        assert_eq!(api(403).metric_label(), "api_forbidden");
        assert_eq!(api(503).metric_label(), "api_unavailable");
        assert_eq!(api(422).metric_label(), "api_rejected");
        assert!(api(503).is_transient());
        let invalid = Error::InvalidSpec(SpecError::ZeroLimit);
        assert_eq!(invalid.metric_label(), "invalid_spec");
        assert!(!invalid.is_transient());
    }
}
