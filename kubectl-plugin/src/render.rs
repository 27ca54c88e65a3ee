//! The text output: `top`'s table and `why`'s report, as kubectl prints (two spaces between columns).

use jiff::Timestamp;
use serde::Serialize;

use crate::format::human_duration;
use crate::report::{TopRow, WhyReport};

/// `-o`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum Output {
    /// A table (`top`) or a report (`why`) for people.
    #[default]
    Text,
    /// The report as JSON (`kubectl-gpubudget.gpubudget.io/v1`, documented in docs/kubectl-plugin.md).
    Json,
    /// The same as YAML.
    Yaml,
}

/// A serialized document, JSON or YAML, ending with a newline.
pub fn document<T: Serialize>(value: &T, output: Output) -> String {
    match output {
        Output::Yaml => serde_yaml::to_string(value).unwrap_or_default(),
        _ => serde_json::to_string_pretty(value).unwrap_or_default() + "\n",
    }
}

pub use gpubudget_common::text::table;

/// `top`'s table; `namespaces` adds the NAMESPACE column (with `-A`).
pub fn top_table(rows: &[TopRow], namespaces: bool) -> String {
    let mut cells = vec![
        ["NAMESPACE", "POD", "NODE", "USAGE", "LIMIT", "%", "STATE", "BUDGET"]
            .iter()
            .skip(usize::from(!namespaces))
            .map(|s| (*s).to_owned())
            .collect::<Vec<_>>(),
    ];
    for r in rows {
        let mut row = Vec::with_capacity(8);
        if namespaces {
            row.push(r.namespace.clone());
        }
        row.extend([
            r.name.clone(),
            r.node.clone().unwrap_or_else(|| "<none>".into()),
            r.usage.clone(),
            r.limit.clone().unwrap_or_else(|| "<unknown>".into()),
            r.percent.map_or_else(|| "-".into(), |p| format!("{}%", p.round())),
            r.state.to_string(),
            r.budget.clone(),
        ]);
        cells.push(row);
    }
    table(&cells)
}

fn age(now: Timestamp, time: Option<&str>) -> String {
    time.and_then(|t| t.parse::<Timestamp>().ok())
        .map_or_else(|| "<unknown>".into(), |t| human_duration(now.duration_since(t).as_secs()))
}

/// The spec fields shown first, in this order; any other field follows by name.
const SPEC_ORDER: [&str; 7] = [
    "limit",
    "request",
    "action",
    "warnAtPercent",
    "overLimitSeconds",
    "evictionGracePeriodSeconds",
    "blockedEvictionTimeoutSeconds",
];

/// A budget spec's fields as `(name, value)`, the selector left out (shown elsewhere). A field added to the
/// spec (issue 22's `request`, say) is shown without a change here.
pub fn spec_fields(spec: &serde_json::Value) -> Vec<(String, String)> {
    let mut fields: Vec<(String, String)> = spec
        .as_object()
        .into_iter()
        .flatten()
        .filter(|(k, _)| *k != "selector")
        .map(|(k, v)| (k.clone(), v.as_str().map_or_else(|| v.to_string(), str::to_owned)))
        .collect();
    fields.sort_by_key(|(k, _)| (SPEC_ORDER.iter().position(|o| o == k).unwrap_or(SPEC_ORDER.len()), k.clone()));
    fields
}

/// `why`'s report for people.
pub fn why_text(r: &WhyReport, now: Timestamp) -> String {
    let mut lines: Vec<(String, String)> = Vec::new();
    let mut add = |k: &str, v: String| lines.push((k.to_owned(), v));
    let p = &r.pod;
    let mut pod = format!("{}/{}", p.namespace, p.name);
    if p.exists {
        pod.push_str(&format!(
            " on {} ({})",
            p.node.as_deref().unwrap_or("no node yet"),
            p.phase.as_deref().unwrap_or("no phase")
        ));
    } else {
        pod.push_str(" (gone: answered from its events and the budgets' status)");
    }
    add("Pod:", pod);
    match &r.budget {
        Some(b) => {
            let mut text = b.name.clone();
            let fields = spec_fields(&b.spec);
            if !fields.is_empty() {
                text.push_str(&format!(
                    " ({})",
                    fields.iter().map(|(k, v)| format!("{k} {v}")).collect::<Vec<_>>().join(", ")
                ));
            }
            if let Some(invalid) = &b.invalid {
                text.push_str(&format!(" — invalid, not enforced: {invalid}"));
            }
            add("Budget:", text);
        }
        None => add("Budget:", "none".into()),
    }
    add("Why:", r.why.clone());
    if let Some(share) = &r.share {
        add("Share:", share.clone());
    }
    if let Some(rec) = &r.record {
        let mut text = format!("{}: using {}", rec.state, rec.usage);
        if let Some(b) = rec.limit_bytes.or_else(|| r.budget.as_ref().and_then(|b| b.limit_bytes)) {
            text.push_str(&format!(" of {}", gpubudget_common::quantity::HumanBytes(b)));
        }
        if let Some(pct) = rec.percent {
            text.push_str(&format!(" ({pct}%)"));
        }
        text.push_str(&format!(", recorded by the agent on {}", if rec.node.is_empty() { "?" } else { &rec.node }));
        if let Some(at) = &rec.eviction_requested_at {
            text.push_str(&format!("; eviction requested at {at}"));
        }
        add("State:", text);
    } else if p.exists {
        add("State:", "no record from an agent (no GPU memory seen for this pod)".into());
    }
    if let (Some(since), Some(secs)) = (&r.over_since, r.over_for_seconds) {
        add("Over for:", format!("{} (since {since})", human_duration(secs)));
    }
    if let Some(never) = &p.never_evicted {
        add("Protected:", never.clone());
    }
    add("Cap:", r.admission.summary.clone());
    if let Some(made) = r.record.as_ref().and_then(|rec| rec.runtime_caps.clone()) {
        add("Made:", made);
    }
    if let Some(why) = r.record.as_ref().and_then(|rec| rec.cap_not_in_force.as_ref()) {
        add("Cap in force:", format!("NO, the agent on the node saw: {why}"));
    }
    add("Next:", r.next.message.clone());
    if let Some(l) = &r.last_eviction {
        add(
            "Evicted:",
            format!(
                "at {} using {} on {} (the budget's status.lastEviction)",
                l.time,
                l.usage,
                l.node.as_deref().unwrap_or("?")
            ),
        );
    }
    for w in &r.warnings {
        add("Warning:", w.clone());
    }
    let width = lines.iter().map(|(k, _)| k.len()).max().unwrap_or(0);
    let mut out: String = lines.iter().map(|(k, v)| format!("{k:<width$}  {v}\n")).collect();
    out.push_str(&format!("Events (last {}):\n", r.events.len()));
    if r.events.is_empty() {
        out.push_str("  <none>\n");
    } else {
        let mut cells = vec![["LAST SEEN", "TYPE", "REASON", "FROM", "MESSAGE"].map(str::to_owned).to_vec()];
        for e in &r.events {
            let mut reason = e.reason.clone();
            if e.count > 1 {
                reason.push_str(&format!(" (x{})", e.count));
            }
            let mut message = e.message.clone();
            if e.earlier_pod {
                message.insert_str(0, "[earlier pod of this name] ");
            }
            cells.push(vec![age(now, e.last_time.as_deref()), e.type_.clone(), reason, e.source.clone(), message]);
        }
        out.extend(table(&cells).lines().map(|l| format!("  {l}\n")));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spec_fields_show_every_field_but_the_selector_a_new_one_too() {
        let spec = serde_json::json!({"selector": {}, "limit": "8Gi", "request": "6Gi", "warnAtPercent": 90, "action": "Evict"});
        let fields = spec_fields(&spec);
        assert!(fields.contains(&("request".into(), "6Gi".into())), "{fields:?}");
        assert!(fields.contains(&("warnAtPercent".into(), "90".into())));
        assert!(!fields.iter().any(|(k, _)| k == "selector"));
        let names: Vec<&str> = fields.iter().map(|(k, _)| k.as_str()).collect();
        assert_eq!(names, ["limit", "request", "action", "warnAtPercent"]);
        let later = spec_fields(&serde_json::json!({"limit": "1Gi", "zNew": true, "aNew": 1}));
        assert_eq!(later.iter().map(|(k, _)| k.as_str()).collect::<Vec<_>>(), ["limit", "aNew", "zNew"]);
    }
}
