//! Structural defaulting, as the API server applies a CRD's OpenAPI `default`s to the custom resources it
//! serves (on create, update, patch and apply, and on every read of a stored object): a property absent
//! from an object that exists, or `null` where the schema does not allow `nullable`, gets the schema's
//! `default`; then every value is defaulted by its own schema (`properties`, `additionalProperties`,
//! `items`), defaults just set included. A property whose parent object is absent gets nothing
//! (`spec.action` is defaulted only in an object that has a `spec`).
//!
//! Not modelled: pruning of unknown fields, and `x-kubernetes-*` extensions other than what the walk above
//! reads.

use serde_json::Value;

/// Applies `schema`'s defaults to `value` (a CRD version's `schema.openAPIV3Schema` and an object of it).
pub(crate) fn apply(schema: &Value, value: &mut Value) {
    match value {
        Value::Object(object) => {
            let properties = schema["properties"].as_object();
            for (name, property) in properties.into_iter().flatten() {
                let Some(default) = property.get("default") else { continue };
                let nullable = property["nullable"] == true;
                match object.get(name) {
                    None => {}
                    Some(Value::Null) if !nullable => {}
                    Some(_) => continue,
                }
                object.insert(name.clone(), default.clone());
            }
            for (name, v) in object.iter_mut() {
                match properties.and_then(|p| p.get(name)) {
                    Some(property) => apply(property, v),
                    None if schema["additionalProperties"].is_object() => apply(&schema["additionalProperties"], v),
                    None => {}
                }
            }
        }
        Value::Array(items) if schema["items"].is_object() => {
            for item in items {
                apply(&schema["items"], item);
            }
        }
        _ => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn schema() -> Value {
        json!({"type": "object", "properties": {
            "spec": {"type": "object", "properties": {
                "action": {"type": "string", "default": "Evict"},
                "seconds": {"type": "integer", "default": 10},
                "note": {"type": "string", "nullable": true, "default": "n"},
                "selector": {"type": "object", "default": {}, "properties": {
                    "mode": {"type": "string", "default": "All"}}},
                "rules": {"type": "array", "items": {"type": "object", "properties": {
                    "weight": {"type": "integer", "default": 1}}}},
                "byName": {"type": "object", "additionalProperties": {"type": "object", "properties": {
                    "on": {"type": "boolean", "default": false}}}}}},
            "status": {"type": "object", "properties": {"count": {"type": "integer", "default": 0}}}}})
    }

    #[test]
    fn absent_and_non_nullable_null_fields_get_their_defaults_as_the_api_server_sets_them() {
        let mut o = json!({"spec": {"action": "Warn", "seconds": null, "note": null,
            "rules": [{}, {"weight": 5}], "byName": {"a": {}, "b": {"on": true}}}});
        apply(&schema(), &mut o);
        assert_eq!(
            o,
            json!({"spec": {"action": "Warn", "seconds": 10, "note": null, "selector": {"mode": "All"},
                "rules": [{"weight": 1}, {"weight": 5}], "byName": {"a": {"on": false}, "b": {"on": true}}}}),
            "a set value is kept, a non-nullable null is defaulted, a nullable null is kept, a default is itself \
             defaulted, array items and additionalProperties are walked; status is absent, so nothing in it"
        );
        let mut again = o.clone();
        apply(&schema(), &mut again);
        assert_eq!(again, o, "defaulting twice changes nothing");
    }

    #[test]
    fn a_value_of_another_type_than_its_schema_is_left_alone() {
        let mut o = json!({"spec": "text", "status": {"count": 3}});
        apply(&schema(), &mut o);
        assert_eq!(o, json!({"spec": "text", "status": {"count": 3}}));
    }
}
