//! Label and field selectors, parsed from the query string the way the API server reads them.

use serde_json::Value;

/// One requirement of a label selector.
#[derive(Debug, Clone, PartialEq)]
enum Requirement {
    Eq(String, String),
    NotEq(String, String),
    In(String, Vec<String>),
    NotIn(String, Vec<String>),
    Exists(String),
    NotExists(String),
    Gt(String, i64),
    Lt(String, i64),
}

/// A parsed `labelSelector` (`a=b,c!=d,e in (x,y),f notin (z),g,!h`, also `==`, `>` and `<`).
#[derive(Debug, Clone, Default, PartialEq)]
pub(crate) struct LabelSelector(Vec<Requirement>);

/// A parsed `fieldSelector`: dotted paths compared with `=`, `==` or `!=`. A missing field reads as "".
#[derive(Debug, Clone, Default, PartialEq)]
pub(crate) struct FieldSelector(Vec<(Vec<String>, bool, String)>);

/// Splits on commas that are not inside parentheses.
fn split_terms(s: &str) -> Vec<&str> {
    let (mut depth, mut start, mut out) = (0i32, 0, Vec::new());
    for (i, c) in s.char_indices() {
        match c {
            '(' => depth += 1,
            ')' => depth -= 1,
            ',' if depth == 0 => {
                out.push(&s[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    out.push(&s[start..]);
    out.into_iter().map(str::trim).filter(|t| !t.is_empty()).collect()
}

fn key(k: &str) -> Result<String, String> {
    let k = k.trim();
    if k.is_empty() || k.contains(char::is_whitespace) || k.contains(['(', ')', '!', '=']) {
        return Err(format!("invalid label key {k:?}"));
    }
    Ok(k.to_owned())
}

impl LabelSelector {
    pub(crate) fn parse(s: &str) -> Result<Self, String> {
        let mut reqs = Vec::new();
        for term in split_terms(s) {
            let req = if let Some(rest) = term.strip_prefix('!') {
                Requirement::NotExists(key(rest)?)
            } else if let Some(open) = term.find('(') {
                let close = term.rfind(')').filter(|c| *c > open).ok_or_else(|| format!("unclosed '(' in {term:?}"))?;
                let mut words = term[..open].split_whitespace();
                let (k, op) = (words.next().unwrap_or_default(), words.next().unwrap_or_default());
                let values: Vec<String> = term[open + 1..close].split(',').map(|v| v.trim().to_owned()).collect();
                match op {
                    "in" => Requirement::In(key(k)?, values),
                    "notin" => Requirement::NotIn(key(k)?, values),
                    _ => return Err(format!("unknown operator {op:?} in {term:?}")),
                }
            } else if let Some((k, v)) = term.split_once("!=") {
                Requirement::NotEq(key(k)?, v.trim().to_owned())
            } else if let Some((k, v)) = term.split_once("==").or_else(|| term.split_once('=')) {
                Requirement::Eq(key(k)?, v.trim().to_owned())
            } else if let Some((k, v)) = term.split_once('>') {
                Requirement::Gt(key(k)?, v.trim().parse().map_err(|_| format!("not an integer in {term:?}"))?)
            } else if let Some((k, v)) = term.split_once('<') {
                Requirement::Lt(key(k)?, v.trim().parse().map_err(|_| format!("not an integer in {term:?}"))?)
            } else {
                Requirement::Exists(key(term)?)
            };
            reqs.push(req);
        }
        Ok(Self(reqs))
    }

    pub(crate) fn matches(&self, object: &Value) -> bool {
        let labels = &object["metadata"]["labels"];
        let get = |k: &str| labels.get(k).and_then(Value::as_str);
        self.0.iter().all(|r| match r {
            Requirement::Eq(k, v) => get(k) == Some(v),
            Requirement::NotEq(k, v) => get(k) != Some(v),
            Requirement::In(k, vs) => get(k).is_some_and(|l| vs.iter().any(|v| v == l)),
            Requirement::NotIn(k, vs) => get(k).is_none_or(|l| vs.iter().all(|v| v != l)),
            Requirement::Exists(k) => get(k).is_some(),
            Requirement::NotExists(k) => get(k).is_none(),
            Requirement::Gt(k, n) => get(k).and_then(|l| l.parse::<i64>().ok()).is_some_and(|l| l > *n),
            Requirement::Lt(k, n) => get(k).and_then(|l| l.parse::<i64>().ok()).is_some_and(|l| l < *n),
        })
    }
}

/// The value of a dotted path as a field selector sees it.
pub(crate) fn field_value(object: &Value, path: &[String]) -> String {
    let mut v = object;
    for segment in path {
        match v.get(segment) {
            Some(next) => v = next,
            None => return String::new(),
        }
    }
    match v {
        Value::String(s) => s.clone(),
        Value::Null => String::new(),
        other => other.to_string(),
    }
}

impl FieldSelector {
    pub(crate) fn parse(s: &str) -> Result<Self, String> {
        let mut terms = Vec::new();
        for term in split_terms(s) {
            let (path, equal, value) = if let Some((p, v)) = term.split_once("!=") {
                (p, false, v)
            } else if let Some((p, v)) = term.split_once("==").or_else(|| term.split_once('=')) {
                (p, true, v)
            } else {
                return Err(format!("invalid field selector term {term:?}"));
            };
            let path: Vec<String> = path.trim().split('.').map(str::to_owned).collect();
            if path.iter().any(String::is_empty) {
                return Err(format!("invalid field path in {term:?}"));
            }
            terms.push((path, equal, value.trim().to_owned()));
        }
        Ok(Self(terms))
    }

    pub(crate) fn matches(&self, object: &Value) -> bool {
        self.0.iter().all(|(path, equal, value)| (field_value(object, path) == *value) == *equal)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn labels(l: Value) -> Value {
        json!({"metadata": {"labels": l}})
    }

    #[test]
    fn set_based_and_equality_requirements() {
        let sel = LabelSelector::parse("a=b, c!=d,e in (x, y),f notin (z),g,!h,n>3").unwrap();
        let ok = labels(json!({"a": "b", "e": "y", "g": "", "n": "4"}));
        assert!(sel.matches(&ok));
        for bad in [
            json!({"a": "x", "e": "y", "g": "", "n": "4"}),
            json!({"a": "b", "c": "d", "e": "y", "g": "", "n": "4"}),
            json!({"a": "b", "e": "q", "g": "", "n": "4"}),
            json!({"a": "b", "e": "y", "f": "z", "g": "", "n": "4"}),
            json!({"a": "b", "e": "y", "n": "4"}),
            json!({"a": "b", "e": "y", "g": "", "h": "1", "n": "4"}),
            json!({"a": "b", "e": "y", "g": "", "n": "3"}),
        ] {
            assert!(!sel.matches(&labels(bad.clone())), "{bad}");
        }
        assert!(LabelSelector::parse("").unwrap().matches(&json!({})));
        assert!(LabelSelector::parse("a in (x").is_err());
        assert!(LabelSelector::parse("a foo (x)").is_err());
    }

    #[test]
    fn field_selectors_compare_dotted_paths() {
        let pod = json!({"metadata": {"name": "p"}, "spec": {"nodeName": "n1"}, "count": 3});
        assert!(FieldSelector::parse("metadata.name=p,spec.nodeName==n1").unwrap().matches(&pod));
        assert!(FieldSelector::parse("spec.nodeName!=n2,count=3").unwrap().matches(&pod));
        assert!(FieldSelector::parse("status.phase=").unwrap().matches(&pod));
        assert!(!FieldSelector::parse("metadata.name!=p").unwrap().matches(&pod));
        assert!(FieldSelector::parse("nonsense").is_err());
    }
}
