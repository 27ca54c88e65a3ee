//! `gpubudget-operator validate FILE...`: the API server's rules for `GpuMemoryBudget` and
//! `ClusterGpuMemoryBudget`, applied offline.
//!
//! The rules are not re-implemented here: the CEL rules (`x-kubernetes-validations`) and defaults are
//! taken from the generated CRD schema and evaluated with kube-cel, the same expressions the API server
//! runs. Around them: the structural checks the API server does before CEL (required fields, types,
//! unknown fields under strict field validation), and the operator's own reading of the spec
//! ([`Budget::from_spec`]), whose verdict tests hold equal to the CEL rules'.

use std::io::Read;
use std::path::PathBuf;

use gpubudget_common::quota;
use gpubudget_common::{Budget, ClusterGpuMemoryBudget, ClusterGpuMemoryQuota, GpuMemoryBudget};
use kube_cel::{CompiledSchema, Validator, compile_schema};
use serde_json::Value;

/// One problem found in one object.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Problem {
    /// `namespace/name` of the object (or `document N` when it has none).
    pub object: String,
    /// Dotted path of the field, e.g. `spec.limit`.
    pub field: String,
    /// What is wrong, for a person.
    pub message: String,
    /// Where the verdict came from.
    pub source: Source,
}

/// Which check found a problem.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Source {
    /// The document is not YAML, or not shaped like the schema (required, types, unknown fields).
    Structure,
    /// A CEL rule of the CRD.
    Cel,
    /// The operator's own reading of the spec.
    Spec,
}

impl std::fmt::Display for Problem {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {}: {}", self.object, self.field, self.message)
    }
}

/// The checker: each CRD's schema compiled once.
#[derive(Debug)]
pub struct Checker {
    kinds: [Kind; 3],
    validator: Validator,
}

/// One kind's schema, compiled.
#[derive(Debug)]
struct Kind {
    name: &'static str,
    schema: Value,
    compiled: CompiledSchema,
}

impl Kind {
    fn new(name: &'static str, crd: &Value) -> Self {
        let schema = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"].clone();
        let compiled = compile_schema(&schema);
        Self { name, schema, compiled }
    }
}

impl Default for Checker {
    fn default() -> Self {
        Self::new()
    }
}

impl Checker {
    /// Compiles the CRDs' schemas.
    pub fn new() -> Self {
        let kinds = [
            Kind::new("GpuMemoryBudget", &crate::crd::crd()),
            Kind::new("ClusterGpuMemoryBudget", &crate::crd::cluster_crd()),
            Kind::new("ClusterGpuMemoryQuota", &crate::crd::quota_crd()),
        ];
        Self { kinds, validator: Validator::new() }
    }

    /// Every problem in a YAML stream of one or more documents. Objects of other kinds are skipped.
    pub fn check_yaml(&self, text: &str) -> Vec<Problem> {
        let mut problems = Vec::new();
        for (index, document) in serde_yaml::Deserializer::from_str(text).enumerate() {
            let label = format!("document {}", index + 1);
            match Value::deserialize_yaml(document) {
                Ok(Value::Null) => {}
                Ok(value) => problems.extend(self.check_value(&value, &label)),
                Err(e) => {
                    problems.push(Problem {
                        object: label,
                        field: "(yaml)".into(),
                        message: format!("not valid YAML: {e}"),
                        source: Source::Structure,
                    });
                    // The parser cannot resynchronise after a syntax error.
                    break;
                }
            }
        }
        problems
    }

    /// Every problem in one object; `label` names it when it has no name.
    pub fn check_value(&self, value: &Value, label: &str) -> Vec<Problem> {
        let kind = value.get("kind").and_then(Value::as_str);
        let Some(kind) = self.kinds.iter().find(|k| Some(k.name) == kind) else { return Vec::new() };
        let object = match (
            value.pointer("/metadata/namespace").and_then(Value::as_str),
            value.pointer("/metadata/name").and_then(Value::as_str),
        ) {
            (Some(ns), Some(name)) => format!("{ns}/{name}"),
            (None, Some(name)) => name.to_owned(),
            _ => label.to_owned(),
        };
        let problem = |field: &str, message: String, source| Problem {
            object: object.clone(),
            field: field.into(),
            message,
            source,
        };
        let mut problems = Vec::new();
        if value.get("apiVersion").and_then(Value::as_str) != Some("gpubudget.io/v1alpha1") {
            problems.push(problem("apiVersion", "must be gpubudget.io/v1alpha1".into(), Source::Structure));
        }
        if value.pointer("/metadata/name").and_then(Value::as_str).is_none_or(str::is_empty) {
            problems.push(problem("metadata.name", "is required".into(), Source::Structure));
        }
        structural(&kind.schema, value, "", &mut |field, message| {
            problems.push(problem(field, message, Source::Structure));
        });
        if let Err(errors) = self.validator.validate_compiled(&kind.compiled, value, None) {
            for e in errors.iter() {
                problems.push(problem(&e.field_path, e.message.clone(), Source::Cel));
            }
        }
        // Structural problems stop the typed reading: its errors would repeat them.
        if !problems.iter().any(|p| p.source == Source::Structure) {
            let defaulted = kube_cel::apply_defaults(&kind.schema, value);
            let compiled = if kind.name == "GpuMemoryBudget" {
                serde_json::from_value::<GpuMemoryBudget>(defaulted).map(|budget| {
                    let ns = budget.metadata.namespace.as_deref().unwrap_or("default");
                    let name = budget.metadata.name.as_deref().unwrap_or_default();
                    Budget::from_spec(ns, name, &budget.spec)
                })
            } else if kind.name == "ClusterGpuMemoryQuota" {
                serde_json::from_value::<ClusterGpuMemoryQuota>(defaulted).map(|quota| quota::compile(&quota))
            } else {
                serde_json::from_value::<ClusterGpuMemoryBudget>(defaulted)
                    .map(|budget| Budget::compile_cluster(&budget))
            };
            match compiled {
                Ok(Ok(_)) => {}
                Ok(Err(e)) => {
                    let text = e.to_string();
                    let (field, message) = text.split_once(": ").unwrap_or(("spec", text.as_str()));
                    problems.push(problem(field, message.to_owned(), Source::Spec));
                }
                Err(e) => problems.push(problem("spec", e.to_string(), Source::Structure)),
            }
        }
        problems
    }

    /// The problems a person should read: a field flagged by a CEL rule is not repeated by the
    /// operator's own reading of it.
    pub fn report(problems: &[Problem]) -> Vec<&Problem> {
        problems
            .iter()
            .filter(|p| {
                let shadowed_by = |source: Source| {
                    problems.iter().any(|q| q.source == source && q.object == p.object && p.field.starts_with(&q.field))
                };
                match p.source {
                    Source::Structure => true,
                    // The API server does not run a field's CEL rules on a value of the wrong type.
                    Source::Cel => !shadowed_by(Source::Structure),
                    Source::Spec => !shadowed_by(Source::Cel),
                }
            })
            .collect()
    }
}

trait DeserializeYaml: Sized {
    fn deserialize_yaml(d: serde_yaml::Deserializer<'_>) -> Result<Self, serde_yaml::Error>;
}

impl DeserializeYaml for Value {
    fn deserialize_yaml(d: serde_yaml::Deserializer<'_>) -> Result<Self, serde_yaml::Error> {
        serde::Deserialize::deserialize(d)
    }
}

/// The OpenAPI checks the API server makes before CEL, for the subset of OpenAPI the CRD uses:
/// required properties, JSON types, enums, and unknown fields (which `kubectl apply` rejects under its
/// default strict field validation).
fn structural(schema: &Value, value: &Value, path: &str, report: &mut dyn FnMut(&str, String)) {
    let at = |name: &str| if path.is_empty() { name.to_owned() } else { format!("{path}.{name}") };
    if value.is_null() {
        if !schema.get("nullable").and_then(Value::as_bool).unwrap_or(false) && !path.is_empty() {
            report(path, "must not be null".into());
        }
        return;
    }
    let int_or_string = schema.get("x-kubernetes-int-or-string").and_then(Value::as_bool).unwrap_or(false);
    let type_ok = match schema.get("type").and_then(Value::as_str) {
        _ if int_or_string => value.is_string() || value.is_i64() || value.is_u64(),
        Some("object") => value.is_object(),
        Some("array") => value.is_array(),
        Some("string") => value.is_string(),
        Some("integer") => value.is_i64() || value.is_u64(),
        Some("number") => value.is_number(),
        Some("boolean") => value.is_boolean(),
        _ => true,
    };
    if !type_ok {
        let want = if int_or_string { "an integer or a string" } else { schema["type"].as_str().unwrap_or("?") };
        report(path, format!("must be {want}, got {value}"));
        return;
    }
    if let Some(options) = schema.get("enum").and_then(Value::as_array)
        && !options.contains(value)
    {
        let names: Vec<String> = options.iter().map(|o| o.to_string()).collect();
        report(path, format!("{value} is not one of {}", names.join(", ")));
    }
    if let Some(map) = value.as_object() {
        let properties = schema.get("properties").and_then(Value::as_object);
        for required in schema.get("required").and_then(Value::as_array).into_iter().flatten() {
            if let Some(name) = required.as_str()
                && !map.contains_key(name)
            {
                report(&at(name), "is required".into());
            }
        }
        for (key, child) in map {
            if path.is_empty() && matches!(key.as_str(), "apiVersion" | "kind" | "metadata") {
                continue;
            }
            match (properties.and_then(|p| p.get(key)), schema.get("additionalProperties")) {
                (Some(sub), _) => structural(sub, child, &at(key), report),
                (None, Some(extra)) if extra.is_object() => structural(extra, child, &at(key), report),
                (None, _) if properties.is_some() => report(&at(key), "is not a field of GpuMemoryBudget".into()),
                _ => {}
            }
        }
    }
    if let (Some(items), Some(list)) = (schema.get("items"), value.as_array()) {
        if let Some(max) = schema.get("maxItems").and_then(Value::as_u64)
            && list.len() as u64 > max
        {
            report(path, format!("has {} items, more than {max}", list.len()));
        }
        for (i, item) in list.iter().enumerate() {
            structural(items, item, &format!("{path}[{i}]"), report);
        }
    }
}

/// Checks files (`-` is standard input), prints each problem, and returns the exit code: 0 when every
/// object is valid, 1 when any problem was found.
pub fn run(files: &[PathBuf]) -> anyhow::Result<i32> {
    let checker = Checker::new();
    let mut failed = 0usize;
    for file in files {
        let text = if file.as_os_str() == "-" {
            let mut text = String::new();
            std::io::stdin().read_to_string(&mut text)?;
            text
        } else {
            std::fs::read_to_string(file).map_err(|e| anyhow::anyhow!("{}: {e}", file.display()))?
        };
        let problems = checker.check_yaml(&text);
        for p in Checker::report(&problems) {
            println!("{}: {p}", file.display());
            failed += 1;
        }
    }
    if failed == 0 {
        eprintln!("all GpuMemoryBudgets valid");
        Ok(0)
    } else {
        eprintln!("{failed} problem(s) found");
        Ok(1)
    }
}
