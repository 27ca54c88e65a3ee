//! The standalone executor: every action becomes one JSON line with a timestamp, and is reported as done
//! (writes succeed, evictions are accepted), so decisions follow the same path as against an API server.

use std::io::Write;

use serde_json::{Value, json};

use crate::decide::{Action, EvictOutcome, Feedback};

/// Wall-clock fields every line carries: `ts` (RFC 3339, milliseconds) and `ts_unix` (seconds, float).
pub fn timestamp_fields(now: jiff::Timestamp) -> (String, f64) {
    let ts = now.round(jiff::Unit::Millisecond).unwrap_or(now).to_string();
    let unix = now.as_millisecond() as f64 / 1000.0;
    (ts, unix)
}

/// One line for an action.
pub fn action_line(action: &Action, now: jiff::Timestamp) -> Value {
    let (ts, ts_unix) = timestamp_fields(now);
    let mut line = match action.pod() {
        Some(pod) => json!({"ts": ts, "ts_unix": ts_unix, "pod": pod.to_string(), "uid": &*pod.uid}),
        None => json!({"ts": ts, "ts_unix": ts_unix}),
    };
    let extra = match action {
        Action::Transition { from, to, usage, limit, budget, .. } => json!({
            "kind": "transition", "from": from.as_str(), "to": to.as_str(),
            "usage_bytes": usage, "limit_bytes": limit, "budget": budget,
        }),
        Action::Apply { record, driver, .. } => {
            json!({"kind": "apply", "annotations": super::annotations(record, driver.as_ref())})
        }
        Action::Clear { .. } => json!({"kind": "clear"}),
        Action::Event { reason, note, .. } => json!({
            "kind": "event", "reason": reason.as_str(),
            "type": if reason.is_warning() { "Warning" } else { "Normal" }, "note": note,
        }),
        Action::ContainerEvent { container, reason, note, .. } => json!({
            "kind": "event", "container": container, "reason": reason.as_str(),
            "type": if reason.is_warning() { "Warning" } else { "Normal" }, "note": note,
        }),
        Action::Evict { grace_seconds, .. } => json!({"kind": "evict", "grace_period_seconds": grace_seconds}),
        Action::NodeEvent { reason, note } => json!({
            "kind": "node_event", "reason": reason.as_str(),
            "type": if reason.is_warning() { "Warning" } else { "Normal" }, "note": note,
        }),
        Action::Delete { grace_seconds, .. } => json!({"kind": "delete", "grace_period_seconds": grace_seconds}),
        Action::WouldEvict { cause, set_by, .. } => {
            json!({"kind": "would_evict", "cause": cause.as_str(), "set_by": set_by.as_str()})
        }
    };
    if let (Some(line), Some(extra)) = (line.as_object_mut(), extra.as_object()) {
        line.extend(extra.clone());
    }
    line
}

/// Writes actions as JSON lines and reports them done.
#[derive(Debug)]
pub struct LogExecutor<W: Write> {
    out: W,
}

impl<W: Write> LogExecutor<W> {
    /// Writes to `out`.
    pub fn new(out: W) -> Self {
        Self { out }
    }

    /// Writes any line (used for stats and errors too).
    pub fn line(&mut self, value: &Value) -> std::io::Result<()> {
        serde_json::to_writer(&mut self.out, value)?;
        self.out.write_all(b"\n")?;
        self.out.flush()
    }

    /// Logs the actions; returns the feedback an API would have given.
    pub fn apply(
        &mut self,
        actions: impl IntoIterator<Item = Action>,
        now: jiff::Timestamp,
    ) -> std::io::Result<Vec<Feedback>> {
        let mut feedback = Vec::new();
        for action in actions {
            self.line(&action_line(&action, now))?;
            match action {
                Action::Apply { pod, record, .. } => {
                    feedback.push(Feedback::Written { uid: pod.uid, record: Some(record), ok: true });
                }
                Action::Clear { pod } => feedback.push(Feedback::Written { uid: pod.uid, record: None, ok: true }),
                Action::Evict { pod, .. } | Action::Delete { pod, .. } => {
                    feedback.push(Feedback::Evicted { uid: pod.uid, outcome: EvictOutcome::Accepted });
                }
                Action::Transition { .. }
                | Action::WouldEvict { .. }
                | Action::Event { .. }
                | Action::ContainerEvent { .. }
                | Action::NodeEvent { .. } => {}
            }
        }
        Ok(feedback)
    }

    /// The writer back.
    pub fn into_inner(self) -> W {
        self.out
    }
}
