//! Server-side printing: the `meta.k8s.io/v1` `Table` that `kubectl get` asks for
//! (`Accept: application/json;as=Table;v=v1;g=meta.k8s.io`), with the columns the real server prints:
//! a CRD's `additionalPrinterColumns`, the built-in printers' for pods and events, NAME and AGE otherwise.

use std::iter;

use k8s_openapi::jiff::Timestamp;
use serde_json::{Value, json};

use crate::events;
use crate::object::{Gr, meta_str, partial};

/// How objects of one resource become table rows.
#[derive(Debug, Clone)]
pub(crate) struct Printer {
    columns: Vec<Value>,
    cells: Cells,
    include: Include,
}

#[derive(Debug, Clone)]
enum Cells {
    /// The name, then one JSONPath and type per column (custom resources, and the NAME/AGE default).
    Paths(Vec<(String, String)>),
    Pod,
    Event,
}

/// What each row carries as `object` (the `includeObject` parameter).
#[derive(Debug, Clone, Copy)]
enum Include {
    None,
    Metadata,
    Object,
}

fn column(name: &str, type_: &str, format: &str, priority: i64, description: &str) -> Value {
    json!({"name": name, "type": type_, "format": format, "description": description, "priority": priority})
}

impl Printer {
    /// The printer for a resource; `include_object` is the request's `includeObject`, `defined` the
    /// `additionalPrinterColumns` of the CRD's version being read (`None`: no CRD, or it defines none; then
    /// NAME and AGE).
    pub(crate) fn new(gr: &Gr, include_object: Option<&str>, defined: Option<Vec<Value>>) -> Printer {
        let include = match include_object {
            Some("None") => Include::None,
            Some("Object") => Include::Object,
            _ => Include::Metadata,
        };
        let name = column("Name", "string", "name", 0, "Name of the object");
        let plain = |n: &str, priority: i64| column(n, "string", "", priority, "");
        let (columns, cells) = match (gr.group.as_str(), gr.plural.as_str()) {
            ("", "pods") => {
                let names = ["Ready", "Status", "Restarts", "Age"];
                let wide = ["IP", "Node"];
                let columns = iter::once(name)
                    .chain(names.iter().map(|n| plain(n, 0)))
                    .chain(wide.iter().map(|n| plain(n, 1)))
                    .collect();
                (columns, Cells::Pod)
            }
            ("" | "events.k8s.io", "events") => {
                let columns = [
                    ("Last Seen", 0),
                    ("Type", 0),
                    ("Reason", 0),
                    ("Object", 0),
                    ("Subobject", 1),
                    ("Source", 1),
                    ("Message", 0),
                    ("First Seen", 1),
                    ("Count", 1),
                ]
                .iter()
                .map(|&(n, p)| plain(n, p))
                .chain(iter::once(column("Name", "string", "name", 1, "Name of the object")))
                .collect();
                (columns, Cells::Event)
            }
            _ => {
                let defined = defined.unwrap_or_else(|| {
                    vec![json!({"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"})]
                });
                let s = |c: &Value, k: &str| c[k].as_str().unwrap_or_default().to_owned();
                let columns = iter::once(name)
                    .chain(defined.iter().map(|c| {
                        column(
                            &s(c, "name"),
                            &s(c, "type"),
                            &s(c, "format"),
                            c["priority"].as_i64().unwrap_or(0),
                            &s(c, "description"),
                        )
                    }))
                    .collect();
                (columns, Cells::Paths(defined.iter().map(|c| (s(c, "jsonPath"), s(c, "type"))).collect()))
            }
        };
        Printer { columns, cells, include }
    }

    /// A `Table` of these objects.
    pub(crate) fn table<'a>(&self, objects: impl IntoIterator<Item = &'a Value>, resource_version: &str) -> Value {
        let rows: Vec<Value> = objects.into_iter().map(|o| self.row(o)).collect();
        json!({"kind": "Table", "apiVersion": "meta.k8s.io/v1", "metadata": {"resourceVersion": resource_version},
               "columnDefinitions": self.columns, "rows": rows})
    }

    fn row(&self, object: &Value) -> Value {
        let cells: Vec<Value> = match &self.cells {
            Cells::Paths(paths) => iter::once(meta_str(object, "name").into())
                .chain(paths.iter().map(|(path, type_)| typed_cell(select(object, path), type_)))
                .collect(),
            Cells::Pod => pod_cells(object),
            Cells::Event if object["apiVersion"] == "events.k8s.io/v1" => {
                event_cells(&events::convert(object, &Gr::new("", "events")))
            }
            Cells::Event => event_cells(object),
        };
        let mut row = json!({"cells": cells});
        match self.include {
            Include::None => {}
            Include::Metadata => row["object"] = partial(object),
            Include::Object => row["object"] = object.clone(),
        }
        row
    }
}

/// A cell of a CRD column, the way the API server types it; `null` when missing (kubectl 1.32 prints it
/// empty).
fn typed_cell(value: Option<&Value>, type_: &str) -> Value {
    let Some(v) = value.filter(|v| !v.is_null()) else { return Value::Null };
    match type_ {
        "integer" => v.as_i64().or_else(|| v.as_f64().map(|f| f as i64)).map_or(Value::Null, Value::from),
        "number" => v.as_f64().map_or(Value::Null, Value::from),
        "boolean" => v.as_bool().map_or(Value::Null, Value::from),
        "date" => v.as_str().map_or(Value::Null, |s| s.parse().map_or("<invalid>".into(), |t| since(t).into())),
        "string" => v.as_str().map_or_else(|| v.to_string(), str::to_owned).into(),
        _ => Value::Null,
    }
}

/// The first value a simple JSONPath selects: `.a.b`, `.a[0]`, `.a[*].b`, `.a['x.y']`,
/// `.a[?(@.type=="Ready")].status`.
pub(crate) fn select<'a>(object: &'a Value, path: &str) -> Option<&'a Value> {
    let (mut v, mut rest) = (object, path.trim().trim_start_matches('{').trim_end_matches('}'));
    while !rest.is_empty() {
        if let Some(r) = rest.strip_prefix('[') {
            let end = r.find(']')?;
            let inner = r[..end].trim();
            v = if let Some(filter) = inner.strip_prefix("?(@").and_then(|f| f.strip_suffix(')')) {
                let (key, want) = filter.split_once("==")?;
                let want = want.trim().trim_matches(['"', '\'']);
                let text = |x: &Value| x.as_str().map_or_else(|| x.to_string(), str::to_owned);
                v.as_array()?.iter().find(|item| select(item, key.trim()).is_some_and(|x| text(x) == want))?
            } else if inner == "*" {
                v.as_array()?.first()?
            } else if let Ok(i) = inner.parse::<usize>() {
                v.get(i)?
            } else {
                v.get(inner.trim_matches(['"', '\'']))?
            };
            rest = &r[end + 1..];
        } else {
            let r = rest.strip_prefix('.').unwrap_or(rest);
            let end = r.find(['.', '[']).unwrap_or(r.len());
            v = v.get(&r[..end])?;
            rest = &r[end..];
        }
    }
    Some(v)
}

/// The age of a timestamp the way the real server prints it; `<unknown>` when unset.
fn age(timestamp: &Value) -> Value {
    timestamp.as_str().and_then(|s| s.parse().ok()).map_or_else(|| "<unknown>".to_owned(), since).into()
}

fn since(t: Timestamp) -> String {
    human_duration(Timestamp::now().duration_since(t).as_secs())
}

/// Kubernetes' `duration.HumanDuration`: 45s, 3m20s, 12m, 5h3m, 20h, 3d4h, 30d, 2y30d, 9y.
pub(crate) fn human_duration(seconds: i64) -> String {
    if seconds < -1 {
        return "<invalid>".into();
    }
    let s = seconds.max(0);
    let (m, h, d) = (s / 60, s / 3600, s / 86_400);
    let two = |a: i64, unit_a: &str, b: i64, unit_b: &str| {
        if b == 0 { format!("{a}{unit_a}") } else { format!("{a}{unit_a}{b}{unit_b}") }
    };
    match () {
        () if s < 120 => format!("{s}s"),
        () if m < 10 => two(m, "m", s % 60, "s"),
        () if m < 180 => format!("{m}m"),
        () if h < 8 => two(h, "h", m % 60, "m"),
        () if h < 48 => format!("{h}h"),
        () if h < 24 * 8 => two(d, "d", h % 24, "h"),
        () if h < 24 * 365 * 2 => format!("{d}d"),
        () if h < 24 * 365 * 8 => two(d / 365, "y", d % 365, "d"),
        () => format!("{}y", d / 365),
    }
}

fn text(v: &Value) -> &str {
    v.as_str().unwrap_or_default()
}

fn first_non_empty<'a>(values: impl IntoIterator<Item = &'a Value>) -> &'a str {
    values.into_iter().map(text).find(|s| !s.is_empty()).unwrap_or_default()
}

/// NAME, READY, STATUS, RESTARTS, AGE, IP, NODE, as the real pod printer has them.
fn pod_cells(pod: &Value) -> Vec<Value> {
    let statuses = pod["status"]["containerStatuses"].as_array().map(Vec::as_slice).unwrap_or_default();
    let containers = pod["spec"]["containers"].as_array().map_or(0, Vec::len);
    let ready = statuses.iter().filter(|s| s["ready"] == true).count();
    let restarts: i64 = statuses.iter().filter_map(|s| s["restartCount"].as_i64()).sum();
    let container_reason = statuses
        .iter()
        .rev()
        .find_map(|s| ["waiting", "terminated"].iter().map(|k| text(&s["state"][k]["reason"])).find(|r| !r.is_empty()));
    let status = match container_reason {
        _ if !pod["metadata"]["deletionTimestamp"].is_null() => "Terminating",
        Some(reason) => reason,
        None => Some(first_non_empty([&pod["status"]["reason"], &pod["status"]["phase"]]))
            .filter(|s| !s.is_empty())
            .unwrap_or("Pending"),
    };
    let or_none = |v: &Value| Some(text(v)).filter(|s| !s.is_empty()).unwrap_or("<none>").to_owned();
    vec![
        meta_str(pod, "name").into(),
        format!("{ready}/{containers}").into(),
        status.into(),
        restarts.into(),
        age(&pod["metadata"]["creationTimestamp"]),
        or_none(&pod["status"]["podIP"]).into(),
        or_none(&pod["spec"]["nodeName"]).into(),
    ]
}

/// The real event printer's cells, for a core v1 Event: LAST SEEN, TYPE, REASON, OBJECT, SUBOBJECT,
/// SOURCE, MESSAGE, FIRST SEEN, COUNT, NAME.
fn event_cells(e: &Value) -> Vec<Value> {
    let set = |v: &Value| !text(v).is_empty();
    let first = age(if set(&e["firstTimestamp"]) { &e["firstTimestamp"] } else { &e["eventTime"] });
    let mut last = if set(&e["lastTimestamp"]) { age(&e["lastTimestamp"]) } else { first.clone() };
    let mut count = e["count"].as_i64().unwrap_or(0).max(1);
    if e["series"].is_object() {
        last = age(&e["series"]["lastObservedTime"]);
        count = e["series"]["count"].as_i64().unwrap_or(count);
    }
    let about = &e["involvedObject"];
    let kind = text(&about["kind"]).to_lowercase();
    let object = if set(&about["name"]) { format!("{kind}/{}", text(&about["name"])) } else { kind };
    let component = first_non_empty([&e["source"]["component"], &e["reportingComponent"]]);
    let host = first_non_empty([&e["source"]["host"], &e["reportingInstance"]]);
    let source = if host.is_empty() { component.to_owned() } else { format!("{component}, {host}") };
    vec![
        last,
        text(&e["type"]).into(),
        text(&e["reason"]).into(),
        object.into(),
        text(&about["fieldPath"]).into(),
        source.into(),
        text(&e["message"]).into(),
        first,
        count.into(),
        meta_str(e, "name").into(),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn simple_json_paths() {
        let o = json!({"spec": {"limit": "8Gi", "a.b": 1}, "status": {"conditions": [
            {"type": "Progressing", "status": "False"}, {"type": "Ready", "status": "True"}]}});
        assert_eq!(select(&o, ".spec.limit"), Some(&json!("8Gi")));
        assert_eq!(select(&o, "{.spec.limit}"), Some(&json!("8Gi")));
        assert_eq!(select(&o, ".spec['a.b']"), Some(&json!(1)));
        assert_eq!(select(&o, ".status.conditions[1].type"), Some(&json!("Ready")));
        assert_eq!(select(&o, ".status.conditions[*].type"), Some(&json!("Progressing")));
        assert_eq!(select(&o, r#".status.conditions[?(@.type=="Ready")].status"#), Some(&json!("True")));
        assert_eq!(select(&o, ".status.conditions[?(@.type=='Gone')].status"), None);
        assert_eq!(select(&o, ".spec.missing"), None);
        assert_eq!(select(&o, ".status.conditions[7]"), None);
    }

    #[test]
    fn cells_are_typed_like_the_api_servers() {
        assert_eq!(typed_cell(Some(&json!(3.0)), "integer"), json!(3));
        assert_eq!(typed_cell(Some(&json!("x")), "integer"), Value::Null);
        assert_eq!(typed_cell(Some(&json!(3)), "string"), json!("3"));
        assert_eq!(typed_cell(Some(&json!(true)), "boolean"), json!(true));
        assert_eq!(typed_cell(None, "string"), Value::Null);
        assert_eq!(typed_cell(Some(&json!("yesterday")), "date"), json!("<invalid>"));
        assert_eq!(age(&Value::Null), json!("<unknown>"));
    }

    #[test]
    fn human_durations_match_kubernetes() {
        let cases = [
            (-5, "<invalid>"),
            (-1, "0s"),
            (0, "0s"),
            (119, "119s"),
            (120, "2m"),
            (200, "3m20s"),
            (600, "10m"),
            (179 * 60, "179m"),
            (3 * 3600, "3h"),
            (5 * 3600 + 180, "5h3m"),
            (20 * 3600, "20h"),
            (3 * 86_400 + 4 * 3600, "3d4h"),
            (30 * 86_400, "30d"),
            (2 * 365 * 86_400 + 30 * 86_400, "2y30d"),
            (9 * 365 * 86_400, "9y"),
        ];
        for (seconds, want) in cases {
            assert_eq!(human_duration(seconds), want, "{seconds}s");
        }
    }

    #[test]
    fn pods_and_events_print_like_the_built_in_printers() {
        let created = Timestamp::now() - k8s_openapi::jiff::SignedDuration::from_secs(76 * 3600 + 30);
        let pod = json!({"metadata": {"name": "p", "creationTimestamp": created.to_string()},
            "spec": {"nodeName": "n1", "containers": [{"name": "a"}, {"name": "b"}]},
            "status": {"phase": "Running", "containerStatuses": [
                {"ready": true, "restartCount": 2, "state": {"running": {}}},
                {"ready": false, "restartCount": 1, "state": {"waiting": {"reason": "CrashLoopBackOff"}}}]}});
        let cells = pod_cells(&pod);
        assert_eq!(cells[..4], [json!("p"), json!("1/2"), json!("CrashLoopBackOff"), json!(3)]);
        assert_eq!(cells[4..], [json!("3d4h"), json!("<none>"), json!("n1")]);

        let event = json!({"apiVersion": "events.k8s.io/v1", "metadata": {"name": "e"}, "type": "Warning",
            "reason": "OverBudget", "note": "uses 9Gi", "regarding": {"kind": "Pod", "name": "p"},
            "reportingController": "gpubudget-agent", "reportingInstance": "n1",
            "eventTime": "2020-01-01T00:00:00.000000Z", "series": {"count": 4, "lastObservedTime": "2020-01-01T00:00:00.000000Z"}});
        let printer = Printer::new(&Gr::new("events.k8s.io", "events"), Some("None"), None);
        let row = printer.row(&event);
        assert!(row.get("object").is_none());
        let cells = row["cells"].as_array().unwrap();
        assert_eq!(cells.len(), printer.columns.len());
        assert_eq!(
            cells[1..],
            [
                json!("Warning"),
                json!("OverBudget"),
                json!("pod/p"),
                json!(""),
                json!("gpubudget-agent, n1"),
                json!("uses 9Gi"),
                cells[0].clone(),
                json!(4),
                json!("e")
            ]
        );
    }
}
