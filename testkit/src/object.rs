//! What every part of the fake names and reads objects by: a resource's group and plural ([`Gr`]), an
//! object's metadata fields, and its metadata-only form. A leaf: it uses no other module of the crate.

use serde_json::{Value, json};

/// A group and resource (plural), e.g. `("", "pods")` or `("gpubudget.io", "gpumemorybudgets")`.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub(crate) struct Gr {
    pub(crate) group: String,
    pub(crate) plural: String,
}

impl Gr {
    pub(crate) fn new(group: &str, plural: &str) -> Self {
        Gr { group: group.to_owned(), plural: plural.to_owned() }
    }
}

impl std::fmt::Display for Gr {
    /// The way the API server names a resource in messages: `pods`, `gpumemorybudgets.gpubudget.io`.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.group.is_empty() { f.write_str(&self.plural) } else { write!(f, "{}.{}", self.plural, self.group) }
    }
}

/// A string field of the object's metadata (`name`, `namespace`, `resourceVersion`), `""` when unset.
pub(crate) fn meta_str<'a>(object: &'a Value, field: &str) -> &'a str {
    object["metadata"][field].as_str().unwrap_or_default()
}

/// The metadata-only form of an object (what `as=PartialObjectMetadata` asks for).
pub(crate) fn partial(object: &Value) -> Value {
    json!({"kind": "PartialObjectMetadata", "apiVersion": "meta.k8s.io/v1", "metadata": object["metadata"]})
}
