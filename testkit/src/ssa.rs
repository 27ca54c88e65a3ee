//! A small model of field ownership (`metadata.managedFields`) for server-side apply.
//!
//! Fields are tracked at leaf granularity: a leaf is a scalar, a list (lists are atomic), or an empty map.
//! Ownership lives in the object itself as `managedFields` entries in the real `FieldsV1` shape
//! (`{"f:spec": {"f:limit": {}}}`), so clients see what the server would show.

use std::collections::BTreeSet;

use serde_json::{Map, Value, json};

pub(crate) type Path = Vec<String>;
pub(crate) type Fields = BTreeSet<Path>;

/// Which part of an object a write addresses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Section {
    /// Everything (a resource without a status subresource).
    All,
    /// Everything but `.status` (the main resource of one with a status subresource).
    Main,
    /// Only `.status`.
    Status,
}

impl Section {
    pub(crate) fn subresource(self) -> Option<&'static str> {
        (self == Section::Status).then_some("status")
    }

    /// Whether a path belongs to the fields a manager can own in this section.
    fn covers(self, path: &[String]) -> bool {
        let top = path.first().map(String::as_str).unwrap_or_default();
        match top {
            "apiVersion" | "kind" => false,
            "metadata" => {
                self != Section::Status
                    && matches!(
                        path.get(1).map(String::as_str),
                        Some("labels" | "annotations" | "finalizers" | "ownerReferences")
                    )
            }
            "status" => self != Section::Main,
            _ => self != Section::Status,
        }
    }
}

fn collect(v: &Value, prefix: &mut Path, out: &mut Fields) {
    match v {
        Value::Object(map) if !map.is_empty() => {
            for (k, child) in map {
                prefix.push(k.clone());
                collect(child, prefix, out);
                prefix.pop();
            }
        }
        Value::Null => {}
        _ => {
            out.insert(prefix.clone());
        }
    }
}

/// The leaves of an object that a manager can own in `section`.
pub(crate) fn leaves(v: &Value, section: Section) -> Fields {
    let mut out = Fields::new();
    collect(v, &mut Vec::new(), &mut out);
    out.retain(|p| section.covers(p));
    out
}

pub(crate) fn get<'a>(v: &'a Value, path: &[String]) -> Option<&'a Value> {
    path.iter().try_fold(v, |v, k| v.get(k))
}

pub(crate) fn remove(v: &mut Value, path: &[String]) {
    let Some((last, parents)) = path.split_last() else { return };
    let mut v = v;
    for k in parents {
        match v.get_mut(k) {
            Some(next) => v = next,
            None => return,
        }
    }
    if let Some(map) = v.as_object_mut() {
        map.remove(last);
    }
}

/// Merges an applied configuration into an object: maps merge, everything else (lists included) replaces.
pub(crate) fn merge(target: &mut Value, applied: &Value) {
    match (target, applied) {
        (Value::Object(t), Value::Object(a)) => {
            for (k, v) in a {
                if v.is_null() {
                    continue;
                }
                match t.get_mut(k) {
                    Some(existing) if existing.is_object() && v.is_object() => merge(existing, v),
                    _ => {
                        t.insert(k.clone(), v.clone());
                    }
                }
            }
        }
        (t, a) => *t = a.clone(),
    }
}

fn to_fields_v1(fields: &Fields) -> Value {
    let mut root = Map::new();
    for path in fields {
        let mut node = &mut root;
        for k in path {
            node = node.entry(format!("f:{k}")).or_insert_with(|| json!({})).as_object_mut().expect("fields are maps");
        }
    }
    Value::Object(root)
}

fn from_fields_v1(v: &Value, prefix: &mut Path, out: &mut Fields) {
    let children: Vec<_> = v.as_object().into_iter().flatten().filter(|(k, _)| k.starts_with("f:")).collect();
    if children.is_empty() {
        if !prefix.is_empty() {
            out.insert(prefix.clone());
        }
        return;
    }
    for (k, child) in children {
        prefix.push(k[2..].to_owned());
        from_fields_v1(child, prefix, out);
        prefix.pop();
    }
}

/// One `managedFields` entry.
#[derive(Debug, Clone)]
pub(crate) struct Entry {
    pub(crate) manager: String,
    pub(crate) operation: String,
    pub(crate) subresource: Option<String>,
    pub(crate) api_version: String,
    pub(crate) time: String,
    pub(crate) fields: Fields,
}

impl Entry {
    fn is(&self, manager: &str, operation: &str, section: Section) -> bool {
        self.manager == manager && self.operation == operation && self.subresource.as_deref() == section.subresource()
    }
}

pub(crate) fn read(object: &Value) -> Vec<Entry> {
    let entries = object["metadata"]["managedFields"].as_array().cloned().unwrap_or_default();
    entries
        .iter()
        .map(|e| {
            let mut fields = Fields::new();
            from_fields_v1(&e["fieldsV1"], &mut Vec::new(), &mut fields);
            let s = |k: &str| e[k].as_str().unwrap_or_default().to_owned();
            Entry {
                manager: s("manager"),
                operation: s("operation"),
                subresource: e["subresource"].as_str().map(str::to_owned),
                api_version: s("apiVersion"),
                time: s("time"),
                fields,
            }
        })
        .collect()
}

pub(crate) fn write(object: &mut Value, entries: Vec<Entry>) {
    let list: Vec<Value> = entries
        .into_iter()
        .filter(|e| !e.fields.is_empty())
        .map(|e| {
            let mut v = json!({
                "manager": e.manager, "operation": e.operation, "apiVersion": e.api_version, "time": e.time,
                "fieldsType": "FieldsV1", "fieldsV1": to_fields_v1(&e.fields),
            });
            if let Some(sub) = e.subresource {
                v["subresource"] = Value::String(sub);
            }
            v
        })
        .collect();
    if let Some(meta) = object.get_mut("metadata").and_then(Value::as_object_mut) {
        if list.is_empty() {
            meta.remove("managedFields");
        } else {
            meta.insert("managedFields".into(), Value::Array(list));
        }
    }
}

/// Who wrote what: the context of one write.
#[derive(Debug, Clone)]
pub(crate) struct Writer<'a> {
    pub(crate) manager: &'a str,
    pub(crate) section: Section,
    pub(crate) api_version: &'a str,
    pub(crate) time: &'a str,
}

fn upsert<'e>(entries: &'e mut Vec<Entry>, w: &Writer<'_>, operation: &str) -> &'e mut Entry {
    let i = match entries.iter().position(|e| e.is(w.manager, operation, w.section)) {
        Some(i) => i,
        None => {
            entries.push(Entry {
                manager: w.manager.to_owned(),
                operation: operation.to_owned(),
                subresource: w.section.subresource().map(str::to_owned),
                api_version: w.api_version.to_owned(),
                time: w.time.to_owned(),
                fields: Fields::new(),
            });
            entries.len() - 1
        }
    };
    &mut entries[i]
}

/// Records an `Update` (create, replace, patch) from `old` to `new`: the writer takes the fields it changed.
pub(crate) fn record_update(old: &Value, new: &mut Value, w: &Writer<'_>) {
    let (before, after) = (leaves(old, w.section), leaves(new, w.section));
    let changed: Fields = after.iter().filter(|p| get(old, p) != get(new, p)).cloned().collect();
    let gone: Fields = before.difference(&after).cloned().collect();
    if changed.is_empty() && gone.is_empty() {
        return;
    }
    let mut entries = read(old);
    for e in &mut entries {
        e.fields.retain(|p| !changed.contains(p) && !gone.contains(p));
    }
    let entry = upsert(&mut entries, w, "Update");
    entry.fields.extend(changed);
    entry.time = w.time.to_owned();
    write(new, entries);
}

/// Server-side apply of `config` onto `live`. Returns the conflicts (`(manager, .path)`) when there are
/// some and `force` is false; otherwise updates `live` and its managed fields.
pub(crate) fn apply(
    live: &mut Value,
    config: &Value,
    w: &Writer<'_>,
    force: bool,
) -> Result<(), Vec<(String, String)>> {
    let applied = leaves(config, w.section);
    let mut entries = read(live);
    let mut conflicts: BTreeSet<(String, Path)> = BTreeSet::new();
    for path in &applied {
        if get(live, path).is_some_and(|current| Some(current) != get(config, path)) {
            for e in entries.iter().filter(|e| e.manager != w.manager && e.fields.contains(path)) {
                conflicts.insert((e.manager.clone(), path.clone()));
            }
        }
    }
    if !conflicts.is_empty() && !force {
        return Err(conflicts.into_iter().map(|(m, p)| (m, format!(".{}", p.join(".")))).collect());
    }
    for e in &mut entries {
        e.fields.retain(|p| !conflicts.contains(&(e.manager.clone(), p.clone())));
    }
    let previous = entries.iter().find(|e| e.is(w.manager, "Apply", w.section)).map(|e| e.fields.clone());
    for path in previous.unwrap_or_default().difference(&applied) {
        let owned_elsewhere = entries.iter().any(|e| !e.is(w.manager, "Apply", w.section) && e.fields.contains(path));
        if !owned_elsewhere {
            remove(live, path);
        }
    }
    merge(live, config);
    let entry = upsert(&mut entries, w, "Apply");
    if entry.fields != applied {
        entry.time = w.time.to_owned();
    }
    entry.fields = applied;
    write(live, entries);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn writer(manager: &str) -> Writer<'_> {
        Writer { manager, section: Section::Main, api_version: "v1", time: "t" }
    }

    #[test]
    fn fields_v1_round_trips() {
        let obj = json!({"metadata": {"name": "x", "labels": {"a": "1"}}, "spec": {"l": [1], "m": {"k": true}}});
        let fields = leaves(&obj, Section::All);
        let v1 = to_fields_v1(&fields);
        assert_eq!(v1, json!({"f:metadata": {"f:labels": {"f:a": {}}}, "f:spec": {"f:l": {}, "f:m": {"f:k": {}}}}));
        let mut back = Fields::new();
        from_fields_v1(&v1, &mut Vec::new(), &mut back);
        assert_eq!(back, fields);
    }

    #[test]
    fn apply_removes_own_omitted_fields_and_reports_conflicts() {
        let mut live = json!({"metadata": {"name": "x"}});
        apply(&mut live, &json!({"metadata": {"labels": {"a": "1", "b": "2"}}}), &writer("m1"), false).unwrap();
        apply(&mut live, &json!({"metadata": {"labels": {"a": "1"}}}), &writer("m1"), false).unwrap();
        assert_eq!(live["metadata"]["labels"], json!({"a": "1"}));
        let err = apply(&mut live, &json!({"metadata": {"labels": {"a": "2"}}}), &writer("m2"), false).unwrap_err();
        assert_eq!(err, vec![("m1".to_owned(), ".metadata.labels.a".to_owned())]);
        apply(&mut live, &json!({"metadata": {"labels": {"a": "2"}}}), &writer("m2"), true).unwrap();
        assert_eq!(live["metadata"]["labels"]["a"], "2");
        // m1 lost the field to m2, so m1 omitting it no longer removes it.
        apply(&mut live, &json!({"metadata": {"labels": {"c": "3"}}}), &writer("m1"), false).unwrap();
        assert_eq!(live["metadata"]["labels"], json!({"a": "2", "c": "3"}));
    }
}
