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
    pub fn metric_label(&self) -> ErrorLabel {
        match self {
            Error::Kube(kube::Error::Api(status)) => match status.code {
                403 => ErrorLabel::ApiForbidden,
                404 => ErrorLabel::ApiNotFound,
                409 => ErrorLabel::Conflict,
                429 => ErrorLabel::ApiThrottled,
                500..=599 => ErrorLabel::ApiUnavailable,
                _ => ErrorLabel::ApiRejected,
            },
            Error::Kube(_) => ErrorLabel::ApiUnreachable,
            Error::Conflict => ErrorLabel::Conflict,
            Error::InvalidSpec(_) => ErrorLabel::InvalidSpec,
            Error::Unnamed => ErrorLabel::Unnamed,
            Error::Serialize(_) => ErrorLabel::Serialize,
        }
    }

    /// Whether retrying can help (else the object waits for a change).
    pub fn is_transient(&self) -> bool {
        !matches!(self, Error::InvalidSpec(_) | Error::Unnamed | Error::Serialize(_))
    }
}

/// The kind of a reconcile failure, as `gpubudget_operator_reconcile_failures_total{error}` names it
/// ([`Error::metric_label`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ErrorLabel {
    /// `api_forbidden`: HTTP 403.
    ApiForbidden,
    /// `api_not_found`: HTTP 404.
    ApiNotFound,
    /// `conflict`: HTTP 409, the budget changed while its status was computed.
    Conflict,
    /// `api_throttled`: HTTP 429.
    ApiThrottled,
    /// `api_unavailable`: HTTP 5xx.
    ApiUnavailable,
    /// `api_rejected`: any other refusal.
    ApiRejected,
    /// `api_unreachable`: no answer.
    ApiUnreachable,
    /// `invalid_spec`.
    InvalidSpec,
    /// `unnamed`.
    Unnamed,
    /// `serialize`.
    Serialize,
}

impl ErrorLabel {
    /// The label value.
    pub fn as_str(self) -> &'static str {
        match self {
            ErrorLabel::ApiForbidden => "api_forbidden",
            ErrorLabel::ApiNotFound => "api_not_found",
            ErrorLabel::Conflict => "conflict",
            ErrorLabel::ApiThrottled => "api_throttled",
            ErrorLabel::ApiUnavailable => "api_unavailable",
            ErrorLabel::ApiRejected => "api_rejected",
            ErrorLabel::ApiUnreachable => "api_unreachable",
            ErrorLabel::InvalidSpec => "invalid_spec",
            ErrorLabel::Unnamed => "unnamed",
            ErrorLabel::Serialize => "serialize",
        }
    }
}

gpubudget_daemon::label_values!(ErrorLabel);

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
        assert_eq!(api(409).metric_label(), ErrorLabel::Conflict);
        assert!(matches!(api(409), Error::Conflict));
        assert_eq!(api(403).metric_label(), ErrorLabel::ApiForbidden);
        assert_eq!(api(503).metric_label(), ErrorLabel::ApiUnavailable);
        assert_eq!(api(422).metric_label(), ErrorLabel::ApiRejected);
        assert!(api(503).is_transient());
        let invalid = Error::InvalidSpec(SpecError::ZeroLimit);
        assert_eq!(invalid.metric_label(), ErrorLabel::InvalidSpec);
        assert!(!invalid.is_transient());
    }
}
