//! The pod's Events, read through the core `v1` Events API (the agent publishes `events.k8s.io/v1`; the API
//! server serves both), reduced to rows, and what they say about time over the limit.

use jiff::Timestamp;
use k8s_openapi::api::core::v1::Event;
use serde::Serialize;

/// The reasons of the agent's pod events (`agent/src/decide`, `Reason::as_str`; a test keeps them equal).
pub mod reason {
    /// At or above `warnAtPercent` of the limit.
    pub const NEAR: &str = "GpuMemoryNearBudget";
    /// Over the limit.
    pub const OVER: &str = "GpuMemoryOverBudget";
    /// Eviction requested.
    pub const EVICTING: &str = "EvictingForGpuMemory";
    /// Eviction refused (a PodDisruptionBudget, the eviction check).
    pub const BLOCKED: &str = "GpuMemoryEvictionBlocked";
    /// Back under the limit or the warning threshold.
    pub const WITHIN: &str = "GpuMemoryWithinBudget";
    /// The Evicting record could not be written in time.
    pub const RECORD_FAILED: &str = "GpuMemoryEvictionRecordFailed";
    /// Evictions refused for `blockedEvictionTimeoutSeconds`: the pod is deleted.
    pub const DELETING: &str = "DeletingForGpuMemory";
    /// The budget's action or overLimitSeconds changed while the pod was over.
    pub const BUDGET_CHANGED: &str = "GpuMemoryBudgetChanged";
    /// The pod's declared GPU memory share cannot be read: held to its budget's limit.
    pub const SHARE_UNRESOLVED: &str = "GpuMemoryShareUnresolved";
    /// The pod's declared share changed after placement and would loosen it: ignored, held to the first (#51).
    pub const SHARE_CHANGE_IGNORED: &str = "GpuMemoryShareChangeIgnored";
    /// The container runtime created a GPU container with the budget's caps (`--runtime-caps`).
    pub const CAPPED_AT_CREATION: &str = "GpuMemoryCappedAtCreation";
    /// A GPU container was created without an MPS cap (`--runtime-caps`).
    pub const NOT_CAPPED_AT_CREATION: &str = "GpuMemoryNotCappedAtCreation";
    /// Observe mode (#54): the pod would be evicted now, and is not.
    pub const WOULD_EVICT: &str = "GpuMemoryWouldEvict";
    /// Every reason above.
    pub const ALL: [&str; 13] = [
        NEAR,
        OVER,
        EVICTING,
        BLOCKED,
        WITHIN,
        RECORD_FAILED,
        DELETING,
        BUDGET_CHANGED,
        SHARE_UNRESOLVED,
        SHARE_CHANGE_IGNORED,
        CAPPED_AT_CREATION,
        NOT_CAPPED_AT_CREATION,
        WOULD_EVICT,
    ];
}

/// One Event about the pod.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct EventRow {
    /// First occurrence (RFC 3339).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub first_time: Option<String>,
    /// Last occurrence (RFC 3339): `series.lastObservedTime`, else `lastTimestamp`, else the first.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub last_time: Option<String>,
    /// `Normal` or `Warning`.
    #[serde(rename = "type")]
    pub type_: String,
    pub reason: String,
    pub message: String,
    /// How many times it happened (a series counts its repeats).
    pub count: i64,
    /// The reporting controller (`gpubudget-agent`, `kubelet`...).
    pub source: String,
    /// True for an event of an earlier pod of the same name (a StatefulSet's replacement, say).
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub earlier_pod: bool,
}

fn times(event: &Event) -> (Option<Timestamp>, Option<Timestamp>) {
    let first = event
        .event_time
        .as_ref()
        .map(|t| t.0)
        .or_else(|| event.first_timestamp.as_ref().map(|t| t.0))
        .or_else(|| event.metadata.creation_timestamp.as_ref().map(|t| t.0));
    let last = event
        .series
        .as_ref()
        .and_then(|s| s.last_observed_time.as_ref().map(|t| t.0))
        .or_else(|| event.last_timestamp.as_ref().map(|t| t.0))
        .or(first);
    (first, last)
}

fn stamp(t: Option<Timestamp>) -> Option<String> {
    t.map(|t| t.round(jiff::Unit::Second).unwrap_or(t).to_string())
}

/// The events as rows, oldest last occurrence first; those of a pod with another UID than `current_uid`
/// (when known) are marked `earlier_pod`.
pub fn rows(events: &[Event], current_uid: Option<&str>) -> Vec<EventRow> {
    let mut timed: Vec<(Option<Timestamp>, EventRow)> = events
        .iter()
        .map(|e| {
            let (first, last) = times(e);
            let uid = e.involved_object.uid.as_deref().filter(|u| !u.is_empty());
            let source = e
                .reporting_component
                .clone()
                .filter(|c| !c.is_empty())
                .or_else(|| e.source.as_ref().and_then(|s| s.component.clone()))
                .unwrap_or_default();
            let count = e.series.as_ref().and_then(|s| s.count).or(e.count).filter(|c| *c > 0).unwrap_or(1);
            let row = EventRow {
                first_time: stamp(first),
                last_time: stamp(last),
                type_: e.type_.clone().unwrap_or_default(),
                reason: e.reason.clone().unwrap_or_default(),
                message: e.message.clone().unwrap_or_default(),
                count: i64::from(count),
                source,
                earlier_pod: matches!((current_uid, uid), (Some(c), Some(u)) if c != u),
            };
            (last, row)
        })
        .collect();
    timed.sort_by(|a, b| a.0.cmp(&b.0).then_with(|| a.1.reason.cmp(&b.1.reason)));
    timed.into_iter().map(|(_, r)| r).collect()
}

fn parse(t: &Option<String>) -> Option<Timestamp> {
    t.as_deref().and_then(|t| t.parse().ok())
}

/// When the current pod last went over its limit, from its events: the last occurrence of the agent's
/// `GpuMemoryOverBudget` that no `GpuMemoryWithinBudget` followed. `None` when the events do not say (none
/// yet, or expired: the API server keeps events an hour by default).
pub fn over_since(rows: &[EventRow]) -> Option<Timestamp> {
    let mut since = None;
    for row in rows.iter().filter(|r| !r.earlier_pod) {
        match row.reason.as_str() {
            reason::OVER => since = parse(&row.last_time),
            reason::WITHIN => since = None,
            _ => {}
        }
    }
    since
}

/// Observe mode (#54): the current pod's last `GpuMemoryWouldEvict` event, when no `GpuMemoryWithinBudget` came
/// after it: when, and which level set observe mode (the words of its message, `the Node's label
/// gpubudget.io/enforcement`).
pub fn would_evict(rows: &[EventRow]) -> Option<(Timestamp, String)> {
    let mut last = None;
    for row in rows.iter().filter(|r| !r.earlier_pod) {
        match row.reason.as_str() {
            reason::WOULD_EVICT => {
                let set_by = row
                    .message
                    .split_once("observe mode: ")
                    .and_then(|(_, rest)| rest.split_once("; nothing is evicted"))
                    .map_or("observe mode", |(by, _)| by);
                last = parse(&row.last_time).map(|t| (t, set_by.to_owned()));
            }
            reason::WITHIN => last = None,
            _ => {}
        }
    }
    last
}

/// The last occurrence of `reason` among the current pod's events.
pub fn last_of(rows: &[EventRow], reason: &str) -> Option<Timestamp> {
    rows.iter().filter(|r| !r.earlier_pod && r.reason == reason).filter_map(|r| parse(&r.last_time)).max()
}

/// The budget (`namespace/name`) the agent's messages name, from the newest event that names one: the
/// messages say `(budget team-a/llm-inference)`. For a pod that is gone and whose record went with it.
pub fn budget_named(rows: &[EventRow]) -> Option<String> {
    rows.iter().rev().find_map(|r| {
        let rest = r.message.split_once("(budget ")?.1;
        let key = rest.split_once(')')?.0;
        Some(key.split_once('/').map_or(key, |(_, name)| name).to_owned())
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn event(reason: &str, uid: &str, first: &str, last: Option<&str>, message: &str) -> Event {
        let mut e = json!({
            "metadata": {"name": format!("e-{reason}-{first}"), "namespace": "team-a"},
            "involvedObject": {"kind": "Pod", "name": "llm-0", "namespace": "team-a", "uid": uid},
            "reason": reason, "type": "Warning", "message": message, "reportingComponent": "gpubudget-agent",
            "eventTime": first,
        });
        if let Some(last) = last {
            e["series"] = json!({"count": 3, "lastObservedTime": last});
        }
        serde_json::from_value(e).unwrap()
    }

    #[test]
    fn rows_are_ordered_by_last_occurrence_and_mark_earlier_pods() {
        let events = [
            event(reason::OVER, "u2", "2026-11-24T10:00:05.000000Z", None, "using 9Gi of 8Gi (budget team-a/llm)"),
            event(reason::NEAR, "u2", "2026-11-24T10:00:00.000000Z", Some("2026-11-24T10:00:01.000000Z"), "near"),
            event(reason::EVICTING, "u1", "2026-11-24T09:00:00.000000Z", None, "evicting (budget team-a/old)"),
        ];
        let rows = rows(&events, Some("u2"));
        let reasons: Vec<&str> = rows.iter().map(|r| r.reason.as_str()).collect();
        assert_eq!(reasons, [reason::EVICTING, reason::NEAR, reason::OVER]);
        assert!(rows[0].earlier_pod && !rows[1].earlier_pod);
        assert_eq!((rows[1].count, rows[1].last_time.as_deref()), (3, Some("2026-11-24T10:00:01Z")));
        assert_eq!(rows[2].source, "gpubudget-agent");
        assert_eq!(budget_named(&rows).as_deref(), Some("llm"));
        assert_eq!(over_since(&rows).map(|t| t.to_string()).as_deref(), Some("2026-11-24T10:00:05Z"));
        // Every event counts when the pod is gone (no current UID).
        assert!(super::rows(&events, None).iter().all(|r| !r.earlier_pod));
    }

    #[test]
    fn a_return_under_the_limit_ends_the_time_over() {
        let mut events = vec![
            event(reason::OVER, "u", "2026-11-24T10:00:00.000000Z", Some("2026-11-24T10:05:00.000000Z"), "over"),
            event(reason::WITHIN, "u", "2026-11-24T10:00:30.000000Z", Some("2026-11-24T10:05:30.000000Z"), "back"),
        ];
        assert_eq!(over_since(&rows(&events, Some("u"))), None);
        events.push(event(reason::OVER, "u", "2026-11-24T10:06:00.000000Z", None, "again"));
        // The series' last occurrence is the latest time it went over.
        assert_eq!(
            over_since(&rows(&events, Some("u"))).map(|t| t.to_string()).as_deref(),
            Some("2026-11-24T10:06:00Z")
        );
        assert_eq!(over_since(&rows(&events, Some("other"))), None, "another pod's events say nothing");
        assert_eq!(
            last_of(&rows(&events, Some("u")), reason::WITHIN).map(|t| t.to_string()).as_deref(),
            Some("2026-11-24T10:05:30Z")
        );
    }

    /// The reasons here are the agent's, letter for letter.
    #[test]
    fn reasons_are_the_agents() {
        use gpubudget_agent::decide::Reason as R;
        let agent = [
            R::NearBudget,
            R::OverBudget,
            R::Evicting,
            R::EvictionBlocked,
            R::WithinBudget,
            R::RecordNotWritten,
            R::Deleting,
            R::BudgetChanged,
            R::ShareUnresolved,
            R::ShareChangeIgnored,
            R::CappedAtCreation,
            R::NotCappedAtCreation,
            R::WouldEvict,
        ]
        .map(R::as_str);
        assert_eq!(agent, reason::ALL);
    }
}
