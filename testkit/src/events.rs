//! One storage, two APIs: the real API server serves every Event both as core `v1` and as
//! `events.k8s.io/v1`, converting between them; so does the fake, for reads (get, list, watch).

use serde_json::{Map, Value};

use crate::object::Gr;

/// The same data under its `events.k8s.io/v1` and its core `v1` name, as the API server converts it.
const FIELDS: &[(&str, &str)] = &[
    ("regarding", "involvedObject"),
    ("related", "related"),
    ("note", "message"),
    ("reason", "reason"),
    ("type", "type"),
    ("action", "action"),
    ("eventTime", "eventTime"),
    ("series", "series"),
    ("reportingController", "reportingComponent"),
    ("reportingInstance", "reportingInstance"),
    ("deprecatedSource", "source"),
    ("deprecatedFirstTimestamp", "firstTimestamp"),
    ("deprecatedLastTimestamp", "lastTimestamp"),
    ("deprecatedCount", "count"),
];

const GROUPS: [&str; 2] = ["", "events.k8s.io"];

/// Whether `a` and `b` are the two Events resources.
pub(crate) fn mirrored(a: &Gr, b: &Gr) -> bool {
    a.plural == "events"
        && b.plural == "events"
        && a.group != b.group
        && [a, b].iter().all(|gr| GROUPS.contains(&gr.group.as_str()))
}

/// The other Events API's resource, for an Events resource.
pub(crate) fn mirror(gr: &Gr) -> Option<Gr> {
    GROUPS.iter().map(|g| Gr::new(g, "events")).find(|other| mirrored(gr, other))
}

/// An Event of the other Events API as `to` serves it.
pub(crate) fn convert(event: &Value, to: &Gr) -> Value {
    let core = to.group.is_empty();
    let mut out = Map::new();
    out.insert("apiVersion".into(), (if core { "v1" } else { "events.k8s.io/v1" }).into());
    out.insert("kind".into(), "Event".into());
    out.insert("metadata".into(), event["metadata"].clone());
    for &(new, old) in FIELDS {
        let (from, into) = if core { (new, old) } else { (old, new) };
        if let Some(v) = event.get(from).filter(|v| !v.is_null()) {
            out.insert(into.into(), v.clone());
        }
    }
    Value::Object(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn converts_both_ways() {
        let new = json!({"apiVersion": "events.k8s.io/v1", "kind": "Event", "metadata": {"name": "e"},
            "regarding": {"kind": "Pod", "name": "p"}, "note": "hi", "reason": "R", "type": "Warning",
            "reportingController": "c", "reportingInstance": "i", "series": {"count": 2, "lastObservedTime": "t"},
            "eventTime": "2025-01-01T00:00:00.000000Z", "deprecatedCount": 0, "related": null});
        let core = convert(&new, &Gr::new("", "events"));
        assert_eq!(
            core,
            json!({"apiVersion": "v1", "kind": "Event", "metadata": {"name": "e"},
                "involvedObject": {"kind": "Pod", "name": "p"}, "message": "hi", "reason": "R", "type": "Warning",
                "reportingComponent": "c", "reportingInstance": "i", "series": {"count": 2, "lastObservedTime": "t"},
                "eventTime": "2025-01-01T00:00:00.000000Z", "count": 0})
        );
        let mut back = convert(&core, &Gr::new("events.k8s.io", "events"));
        back["related"] = Value::Null;
        assert_eq!(back, new);
        assert_eq!(mirror(&Gr::new("", "events")), Some(Gr::new("events.k8s.io", "events")));
        assert_eq!(mirror(&Gr::new("events.k8s.io", "events")), Some(Gr::new("", "events")));
        assert_eq!(mirror(&Gr::new("example.com", "events")), None);
        assert_eq!(mirror(&Gr::new("", "pods")), None);
    }
}
