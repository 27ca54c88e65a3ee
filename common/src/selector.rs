//! Label selectors, compiled once and matched without allocation.

use std::collections::BTreeMap;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector;

/// Why a label selector cannot be used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SelectorError {
    /// An operator other than the four Kubernetes defines.
    #[error("matchExpressions[{index}].operator {operator:?} is not one of In, NotIn, Exists, DoesNotExist")]
    UnknownOperator {
        /// Position in `matchExpressions`.
        index: usize,
        /// The operator as written.
        operator: String,
    },
    /// `In`/`NotIn` without values, or `Exists`/`DoesNotExist` with values.
    #[error("matchExpressions[{index}].values must be {expected} for operator {operator}")]
    Values {
        /// Position in `matchExpressions`.
        index: usize,
        /// The operator as written.
        operator: String,
        /// "non-empty" or "empty".
        expected: &'static str,
    },
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Requirement {
    In(String, Vec<String>),
    NotIn(String, Vec<String>),
    Exists(String),
    DoesNotExist(String),
}

/// A validated label selector. An empty selector matches every set of labels.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Selector {
    requirements: Vec<Requirement>,
}

impl Selector {
    /// Compiles a Kubernetes `LabelSelector`, rejecting unknown operators and misplaced values.
    pub fn compile(selector: &LabelSelector) -> Result<Self, SelectorError> {
        let mut requirements: Vec<Requirement> =
            selector.match_labels.iter().flatten().map(|(k, v)| Requirement::In(k.clone(), vec![v.clone()])).collect();
        for (index, expr) in selector.match_expressions.iter().flatten().enumerate() {
            let values = expr.values.clone().unwrap_or_default();
            let needs_values = matches!(expr.operator.as_str(), "In" | "NotIn");
            let requirement = match expr.operator.as_str() {
                "In" => Requirement::In(expr.key.clone(), values.clone()),
                "NotIn" => Requirement::NotIn(expr.key.clone(), values.clone()),
                "Exists" => Requirement::Exists(expr.key.clone()),
                "DoesNotExist" => Requirement::DoesNotExist(expr.key.clone()),
                other => {
                    return Err(SelectorError::UnknownOperator { index, operator: other.to_owned() });
                }
            };
            if needs_values == values.is_empty() {
                return Err(SelectorError::Values {
                    index,
                    operator: expr.operator.clone(),
                    expected: if needs_values { "non-empty" } else { "empty" },
                });
            }
            requirements.push(requirement);
        }
        Ok(Self { requirements })
    }

    /// Whether these labels satisfy every requirement.
    pub fn matches(&self, labels: &BTreeMap<String, String>) -> bool {
        self.requirements.iter().all(|r| match r {
            Requirement::In(k, vs) => labels.get(k).is_some_and(|v| vs.contains(v)),
            Requirement::NotIn(k, vs) => labels.get(k).is_none_or(|v| !vs.contains(v)),
            Requirement::Exists(k) => labels.contains_key(k),
            Requirement::DoesNotExist(k) => !labels.contains_key(k),
        })
    }

    /// True for `{}`: every pod in the namespace.
    pub fn is_everything(&self) -> bool {
        self.requirements.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn selector(yaml: &str) -> Result<Selector, SelectorError> {
        Selector::compile(&serde_yaml::from_str::<LabelSelector>(yaml).expect("fixture parses"))
    }

    fn labels(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned())).collect()
    }

    #[test]
    fn every_operator_matches_like_kubernetes() {
        let s = selector(
            "matchLabels: {app: llm}\nmatchExpressions:\n- {key: tier, operator: In, values: [gold, silver]}\n\
             - {key: env, operator: NotIn, values: [dev]}\n- {key: gpu, operator: Exists}\n\
             - {key: legacy, operator: DoesNotExist}\n",
        )
        .expect("valid");
        assert!(s.matches(&labels(&[("app", "llm"), ("tier", "gold"), ("gpu", "")])));
        assert!(s.matches(&labels(&[("app", "llm"), ("tier", "silver"), ("gpu", "h100"), ("env", "prod")])));
        assert!(!s.matches(&labels(&[("app", "llm"), ("tier", "gold")])), "gpu must exist");
        assert!(!s.matches(&labels(&[("app", "llm"), ("tier", "bronze"), ("gpu", "")])), "tier In");
        assert!(!s.matches(&labels(&[("app", "llm"), ("tier", "gold"), ("gpu", ""), ("env", "dev")])), "NotIn");
        assert!(!s.matches(&labels(&[("app", "llm"), ("tier", "gold"), ("gpu", ""), ("legacy", "1")])));
        assert!(!s.matches(&labels(&[("app", "web"), ("tier", "gold"), ("gpu", "")])), "matchLabels");
    }

    #[test]
    fn empty_selector_matches_everything() {
        let s = selector("{}").expect("valid");
        assert!(s.is_everything());
        assert!(s.matches(&labels(&[])));
        assert!(s.matches(&labels(&[("a", "b")])));
    }

    #[test]
    fn rejects_bad_operators_and_values() {
        assert_eq!(
            selector("matchExpressions: [{key: a, operator: Equals, values: [x]}]"),
            Err(SelectorError::UnknownOperator { index: 0, operator: "Equals".into() })
        );
        assert!(matches!(
            selector("matchExpressions: [{key: a, operator: Exists}, {key: a, operator: In}]"),
            Err(SelectorError::Values { index: 1, expected: "non-empty", .. })
        ));
        assert!(matches!(
            selector("matchExpressions: [{key: a, operator: DoesNotExist, values: [x]}]"),
            Err(SelectorError::Values { index: 0, expected: "empty", .. })
        ));
    }

    proptest! {
        #[test]
        fn not_in_is_the_complement_of_in(value in "[a-c]", set in proptest::collection::vec("[a-c]", 1..3)) {
            let mk = |op: &str| {
                let expr = k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelectorRequirement {
                    key: "k".into(),
                    operator: op.into(),
                    values: Some(set.clone()),
                };
                Selector::compile(&LabelSelector { match_expressions: Some(vec![expr]), ..Default::default() })
            };
            let l = labels(&[("k", value.as_str())]);
            prop_assert_ne!(mk("In").expect("valid").matches(&l), mk("NotIn").expect("valid").matches(&l));
        }
    }
}
