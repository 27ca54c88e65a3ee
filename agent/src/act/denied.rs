//! Writes the API server refuses for good (issue 43): a `403 Forbidden` (RBAC, an admission policy or webhook)
//! or a `422` an admission policy or webhook gave, on the agent's record writes and on its node's
//! `GpuNodeUsage`. Retrying does not help, and an agent whose records are refused enforces nothing the
//! operator can count, so the agent says so on its **Node**: a Warning event `GpuBudgetWriteDenied` naming
//! the policy and its message, at most once per [`NOTICE_INTERVAL`] per policy (the writes themselves are
//! counted in `gpubudget_api_writes_total{result="denied"}`). The usual cause is a second gpubudget release,
//! or policies left by another install: each release's records policy admits only its own agent
//! (docs/operations.md, "One release per cluster").

use std::collections::HashMap;
use std::sync::{Mutex, PoisonError};
use std::time::Duration;

use k8s_openapi::api::core::v1::ObjectReference;
use kube::runtime::events::{Event, EventType, Recorder};
use tokio::time::Instant;

/// The Node event's reason.
pub const REASON: &str = "GpuBudgetWriteDenied";

/// The least time between two Node events for the same policy.
pub const NOTICE_INTERVAL: Duration = Duration::from_secs(600);

/// An event's note is at most 1 KiB (events.k8s.io/v1).
const NOTE_MAX_BYTES: usize = 1024;

/// A write the API server refused for good.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Denial {
    /// The HTTP status: 403 or 422.
    pub code: u16,
    /// The admission policy or webhook that refused, when the message names one (else RBAC, or unknown).
    pub policy: Option<String>,
    /// The API server's message.
    pub message: String,
}

impl Denial {
    /// The denial in a write's error; `None` for anything a retry may get through (500, 409, 429, a timeout,
    /// a 422 no admission check gave).
    pub fn of(error: &kube::Error) -> Option<Self> {
        match error {
            kube::Error::Api(status) => Self::classify(status.code, &status.message),
            _ => None,
        }
    }

    /// The pure classification of an API answer by its status code and message.
    pub fn classify(code: u16, message: &str) -> Option<Self> {
        let policy = policy_name(message);
        let by_admission = policy.is_some();
        match code {
            403 => Some(Self { code, policy, message: message.to_owned() }),
            422 if by_admission => Some(Self { code, policy, message: message.to_owned() }),
            _ => None,
        }
    }

    /// What the Node events are rate-limited by: the policy, else the status code.
    pub fn key(&self) -> String {
        self.policy.clone().unwrap_or_else(|| format!("HTTP {}", self.code))
    }

    /// The Node event's note: what was refused (`what`, e.g. "the record of pod team-a/llm-0"), by whom,
    /// the message, and the likely cause; at most 1 KiB.
    pub fn note(&self, what: &str) -> String {
        let by = self
            .policy
            .as_deref()
            .map_or_else(|| format!("HTTP {}", self.code), |p| format!("{p} (HTTP {})", self.code));
        let note = format!(
            "the API server refused {what}, by {by}: {}. The agent retries with backoff; each refusal counts in \
             gpubudget_api_writes_total{{result=\"denied\"}}, and this event comes at most every {} minutes per \
             policy. A second gpubudget release, or policies left by another install, refuse this agent's writes: \
             one release per cluster (docs/operations.md)",
            self.message.trim_end_matches('.'),
            NOTICE_INTERVAL.as_secs() / 60
        );
        truncate(note, NOTE_MAX_BYTES)
    }
}

/// The policy or webhook a refusal names: `ValidatingAdmissionPolicy 'NAME' [with binding 'B'] denied
/// request: ...` (the API server's wording, k8s.io/apiserver policy/validating/dispatcher.go), or
/// `admission webhook "NAME" denied the request: ...` (webhook/errors/statuserror.go).
pub fn policy_name(message: &str) -> Option<String> {
    let quoted = |rest: &str, quote: char| {
        rest.split_once(quote).map(|(name, _)| name.to_owned()).filter(|name| !name.is_empty())
    };
    if let Some((_, rest)) = message.split_once("ValidatingAdmissionPolicy '") {
        return quoted(rest, '\'').map(|name| format!("ValidatingAdmissionPolicy {name}"));
    }
    if let Some((_, rest)) = message.split_once("admission webhook \"") {
        return quoted(rest, '"').map(|name| format!("admission webhook {name}"));
    }
    None
}

fn truncate(mut text: String, max: usize) -> String {
    if text.len() > max {
        let mut end = max.saturating_sub(3);
        while !text.is_char_boundary(end) {
            end -= 1;
        }
        text.truncate(end);
        text.push_str("...");
    }
    text
}

/// When each policy was last told about on the Node.
#[derive(Debug, Default)]
pub struct Notices {
    last: Mutex<HashMap<String, Instant>>,
}

impl Notices {
    /// Whether a refusal by `key` is to be told now (and, if so, remembers it): the first time, and then once
    /// [`NOTICE_INTERVAL`] has passed since it was last told.
    pub fn due(&self, key: &str, now: Instant) -> bool {
        let mut last = self.last.lock().unwrap_or_else(PoisonError::into_inner);
        match last.get(key) {
            Some(at) if now.saturating_duration_since(*at) < NOTICE_INTERVAL => false,
            _ => {
                last.insert(key.to_owned(), now);
                true
            }
        }
    }
}

/// Tells a refusal on `node` (a Warning event about the Node), when [`Notices::due`]; logs it always.
pub async fn tell(recorder: &Recorder, notices: &Notices, node: &str, denial: &Denial, what: &str) {
    tracing::warn!(%node, code = denial.code, policy = denial.policy.as_deref().unwrap_or(""), message = %denial.message,
        "the API server refused {what} for good");
    if !notices.due(&denial.key(), Instant::now()) {
        return;
    }
    let event = Event {
        type_: EventType::Warning,
        reason: REASON.into(),
        note: Some(denial.note(what)),
        action: "Write".into(),
        secondary: None,
    };
    let reference = ObjectReference {
        api_version: Some("v1".into()),
        kind: Some("Node".into()),
        name: Some(node.to_owned()),
        ..ObjectReference::default()
    };
    if let Err(error) = recorder.publish(&event, &reference).await {
        tracing::warn!(%node, reason = REASON, %error, "cannot publish event");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// As the real kube-apiserver 1.32 words a refusal by the chart's records policy (measured:
    /// e2e/apiserver/results/2026-11-27-records-doors.txt).
    const BY_POLICY: &str = "pods \"llm-0\" is forbidden: ValidatingAdmissionPolicy 'other-gpubudget-agent-records' \
        with binding 'other-gpubudget-agent-records' denied request: gpubudget.io/ annotations on pods are the \
        gpubudget agent's records: only the agent may set, change or remove them (refused through pods)";

    #[test]
    fn a_policys_refusal_is_a_denial_naming_the_policy() {
        let d = Denial::classify(403, BY_POLICY).expect("denied");
        assert_eq!(d.policy.as_deref(), Some("ValidatingAdmissionPolicy other-gpubudget-agent-records"));
        assert_eq!(d.key(), "ValidatingAdmissionPolicy other-gpubudget-agent-records");
        let note = d.note("the record of pod team-a/llm-0");
        assert!(note.contains("other-gpubudget-agent-records (HTTP 403)"), "{note}");
        assert!(note.contains("only the agent may set, change or remove them"), "{note}");
        assert!(note.contains("one release per cluster"), "{note}");
        // A policy with reason Invalid answers 422; without a binding name, the API server's other wording.
        let invalid = "ValidatingAdmissionPolicy 'p' denied request: no";
        assert_eq!(Denial::classify(422, invalid).and_then(|d| d.policy), Some("ValidatingAdmissionPolicy p".into()));
        let webhook = "admission webhook \"deny.example.com\" denied the request: no";
        assert_eq!(
            Denial::classify(403, webhook).and_then(|d| d.policy),
            Some("admission webhook deny.example.com".into())
        );
    }

    #[test]
    fn rbac_is_a_denial_and_retryable_answers_are_not() {
        let rbac = "pods \"llm-0\" is forbidden: User \"system:serviceaccount:gpubudget:x\" cannot patch resource";
        let d = Denial::classify(403, rbac).expect("denied");
        assert_eq!((d.key(), d.policy), ("HTTP 403".to_owned(), None));
        for (code, message) in [
            (500, "etcd timeout"),
            (409, "the object has been modified"),
            (429, "too many requests"),
            (422, "metadata.annotations: Too long: must have at most 262144 bytes"),
            (404, "not found"),
        ] {
            assert_eq!(Denial::classify(code, message), None, "{code} {message}");
        }
        assert!(Denial::of(&kube::Error::LinesCodecMaxLineLengthExceeded).is_none());
    }

    #[test]
    fn a_long_message_makes_a_note_of_at_most_1_kib() {
        let d = Denial::classify(403, &format!("ValidatingAdmissionPolicy 'p' denied request: {}", "é".repeat(2000)))
            .expect("denied");
        let note = d.note("the record of pod team-a/llm-0");
        assert!(note.len() <= NOTE_MAX_BYTES && note.ends_with("..."), "{}", note.len());
    }

    #[test]
    fn each_policy_is_told_once_per_interval() {
        let notices = Notices::default();
        let t0 = Instant::now();
        assert!(notices.due("a", t0));
        assert!(!notices.due("a", t0 + Duration::from_secs(1)));
        assert!(notices.due("b", t0 + Duration::from_secs(1)), "another policy is told at once");
        assert!(!notices.due("a", t0 + NOTICE_INTERVAL - Duration::from_millis(1)));
        assert!(notices.due("a", t0 + NOTICE_INTERVAL));
        assert!(!notices.due("a", t0 + NOTICE_INTERVAL + Duration::from_secs(1)));
    }
}
