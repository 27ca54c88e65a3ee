//! Observe or enforce (#54): whether the agent carries its evictions out, or only reports them as "would evict"
//! (events, metrics, `why`) and evicts nothing. Pure: the levels and their precedence, so the agent, `why` and
//! the docs say the same.
//!
//! The levels, each overriding the one before where set:
//! 1. the agent's default (`--enforcement`, `GPUBUDGET_ENFORCEMENT`, the chart's `agent.enforcement`);
//! 2. the node: the Node label [`NODE_LABEL`] (`Observe` or `Enforce`; administrators own Node labels);
//! 3. the budget: `spec.enforcement`, for its own evictions only (a pod over its limit, `action: Evict`).
//!
//! Namespace totals (`ClusterGpuMemoryQuota`) are the operator's evictions, across nodes: their mode is the
//! quota's own `spec.enforcement` where set, else the operator's `--enforcement` (the same chart value,
//! `agent.enforcement`), never a Node's label ([`for_quota`]). Only administrators write quotas.
//!
//! The node's mode ([`node`]) governs everything the node does beyond a budget's own limit: pressure relief,
//! and pods no budget selects. A budget's own evictions follow the budget's field where the rules applied to
//! the pod set it, else the node's mode ([`for_budget`]).
//!
//! Nothing a tenant writes loosens what an administrator set: `Enforce` is tighter than unset, unset tighter
//! than `Observe` ([`tightness`]); budgets selecting a pod are merged field by field to the tighter value
//! (`Budget::tighten`), so a namespaced budget's `Observe` never loosens a cluster budget's `Enforce`, nor a
//! cluster budget that leaves it to the node. A tenant may choose `Enforce` for its own pods.

use serde::{Deserialize, Serialize};

/// The Node label that sets a node's mode (`Observe` or `Enforce`); absent: the agent's default.
pub const NODE_LABEL: &str = "gpubudget.io/enforcement";

// Whether evictions are carried out. (A plain comment: a doc comment here would replace the description of the
// budget's field in the CRD.)
#[derive(Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq, Hash, schemars::JsonSchema)]
pub enum Enforcement {
    /// Report everything the agent would do (events `GpuMemoryWouldEvict`, `gpubudget_would_evict_total`,
    /// `kubectl gpubudget why`) and evict nothing.
    Observe,
    /// Evict (the default).
    #[default]
    Enforce,
}

impl Enforcement {
    /// `Observe` or `Enforce`.
    pub fn as_str(self) -> &'static str {
        match self {
            Enforcement::Observe => "Observe",
            Enforcement::Enforce => "Enforce",
        }
    }
}

impl std::fmt::Display for Enforcement {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::str::FromStr for Enforcement {
    type Err = String;

    /// `Observe` or `Enforce`, exactly (as the CRD's enum and a label value are written).
    fn from_str(text: &str) -> Result<Self, Self::Err> {
        match text {
            "Observe" => Ok(Enforcement::Observe),
            "Enforce" => Ok(Enforcement::Enforce),
            other => Err(format!("{other:?} is not an enforcement: Observe or Enforce")),
        }
    }
}

/// How tight a budget's `enforcement` is, for merging budgets field by field: `Observe` (0) < unset (1, the
/// node decides) < `Enforce` (2).
pub fn tightness(field: Option<Enforcement>) -> u8 {
    match field {
        Some(Enforcement::Observe) => 0,
        None => 1,
        Some(Enforcement::Enforce) => 2,
    }
}

/// The tighter of two budgets' `enforcement` ([`tightness`]).
pub fn tighter(a: Option<Enforcement>, b: Option<Enforcement>) -> Option<Enforcement> {
    if tightness(b) > tightness(a) { b } else { a }
}

/// Which level set a mode.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum SetBy {
    /// The agent's default (`--enforcement`).
    Agent,
    /// The Node's label [`NODE_LABEL`].
    Node,
    /// The rules applied to the pod: its budget's `spec.enforcement` (named as messages name the rules).
    Budget(String),
    /// The operator's default (`--enforcement`), for namespace totals.
    Operator,
}

impl std::fmt::Display for SetBy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            SetBy::Agent => f.write_str("the agent's default, --enforcement (chart value agent.enforcement)"),
            SetBy::Node => write!(f, "the Node's label {NODE_LABEL}"),
            SetBy::Budget(rules) => write!(f, "spec.enforcement of {rules}"),
            SetBy::Operator => f.write_str("the operator's default, --enforcement (chart value agent.enforcement)"),
        }
    }
}

impl SetBy {
    /// The level alone, without the rules that name a budget.
    pub fn level(&self) -> Level {
        match self {
            SetBy::Agent => Level::Agent,
            SetBy::Node => Level::Node,
            SetBy::Budget(_) => Level::Budget,
            SetBy::Operator => Level::Operator,
        }
    }
}

/// The level that set a mode ([`SetBy`] without the budget's name): a metric's label.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Level {
    /// The agent's default.
    Agent,
    /// The Node's label.
    Node,
    /// The budget's (or quota's) `spec.enforcement`.
    Budget,
    /// The operator's default, for namespace totals.
    Operator,
}

impl Level {
    /// `agent`, `node`, `budget` or `operator` (a metric's label).
    pub fn as_str(self) -> &'static str {
        match self {
            Level::Agent => "agent",
            Level::Node => "node",
            Level::Budget => "budget",
            Level::Operator => "operator",
        }
    }
}

/// A mode and the level that set it.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Mode {
    /// Observe or enforce.
    pub enforcement: Enforcement,
    /// Who said so.
    pub set_by: SetBy,
}

impl Mode {
    /// Whether evictions are only reported.
    pub fn observes(&self) -> bool {
        self.enforcement == Enforcement::Observe
    }
}

/// The node's mode: its label's where set, else the agent's default.
pub fn node(agent: Enforcement, label: Option<Enforcement>) -> Mode {
    match label {
        Some(enforcement) => Mode { enforcement, set_by: SetBy::Node },
        None => Mode { enforcement: agent, set_by: SetBy::Agent },
    }
}

/// The mode of a budget's own evictions of a pod: `field` (the `enforcement` of the rules applied to it, merged
/// to the tighter value over every budget that selects it), named `rules`, where set; else the node's.
pub fn for_budget(node: &Mode, field: Option<Enforcement>, rules: impl FnOnce() -> String) -> Mode {
    match field {
        Some(enforcement) => Mode { enforcement, set_by: SetBy::Budget(rules()) },
        None => node.clone(),
    }
}

/// The mode of a namespace total's evictions: the quota's own `spec.enforcement` where set (named `quota`), else
/// the operator's default. A Node's label plays no part: a namespace total spans nodes.
pub fn for_quota(operator: Enforcement, field: Option<Enforcement>, quota: &str) -> Mode {
    match field {
        Some(enforcement) => Mode { enforcement, set_by: SetBy::Budget(format!("ClusterGpuMemoryQuota {quota}")) },
        None => Mode { enforcement: operator, set_by: SetBy::Operator },
    }
}

/// Parses a `--enforcement` flag (agent and operator): `Observe` or `Enforce`, in any case.
pub fn parse_flag(text: &str) -> Result<Enforcement, String> {
    match text.to_ascii_lowercase().as_str() {
        "observe" => Ok(Enforcement::Observe),
        "enforce" => Ok(Enforcement::Enforce),
        _ => Err(format!("{text:?}: Observe or Enforce")),
    }
}

/// A Node label's value read as a mode: `None` where absent; an error, in words, where it is neither `Observe` nor
/// `Enforce` (the agent's default applies then, and says so).
pub fn parse_label(value: Option<&str>) -> Result<Option<Enforcement>, String> {
    value.map(str::parse).transpose().map_err(|e| format!("the Node's label {NODE_LABEL}: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn any_field() -> impl Strategy<Value = Option<Enforcement>> {
        prop_oneof![Just(None), Just(Some(Enforcement::Observe)), Just(Some(Enforcement::Enforce))]
    }

    fn any_mode() -> impl Strategy<Value = Enforcement> {
        prop_oneof![Just(Enforcement::Observe), Just(Enforcement::Enforce)]
    }

    #[test]
    fn the_node_label_overrides_the_agent_default_and_the_budget_its_own_evictions() {
        let observe_node = node(Enforcement::Enforce, Some(Enforcement::Observe));
        assert_eq!((observe_node.enforcement, &observe_node.set_by), (Enforcement::Observe, &SetBy::Node));
        let default = node(Enforcement::Observe, None);
        assert_eq!((default.enforcement, &default.set_by), (Enforcement::Observe, &SetBy::Agent));
        let budget = for_budget(&observe_node, Some(Enforcement::Enforce), || "budget team-a/llm".into());
        assert_eq!(budget.enforcement, Enforcement::Enforce);
        assert_eq!(budget.set_by.to_string(), "spec.enforcement of budget team-a/llm");
        assert_eq!(for_budget(&observe_node, None, || unreachable!()), observe_node);
    }

    #[test]
    fn a_quota_follows_its_own_field_else_the_operator_never_a_node() {
        let own = for_quota(Enforcement::Observe, Some(Enforcement::Enforce), "tenant-totals");
        assert_eq!(own.enforcement, Enforcement::Enforce);
        assert_eq!(own.set_by.to_string(), "spec.enforcement of ClusterGpuMemoryQuota tenant-totals");
        let default = for_quota(Enforcement::Observe, None, "tenant-totals");
        assert_eq!(
            (default.enforcement, &default.set_by, default.set_by.level()),
            (Enforcement::Observe, &SetBy::Operator, Level::Operator)
        );
        assert!(for_quota(Enforcement::Enforce, Some(Enforcement::Observe), "q").observes());
    }

    #[test]
    fn a_flag_is_read_in_any_case_and_anything_else_refused() {
        assert_eq!(parse_flag("observe"), Ok(Enforcement::Observe));
        assert_eq!(parse_flag("ENFORCE"), Ok(Enforcement::Enforce));
        assert_eq!(parse_flag("Observe"), Ok(Enforcement::Observe));
        assert_eq!(parse_flag("dry-run"), Err("\"dry-run\": Observe or Enforce".to_owned()));
    }

    #[test]
    fn a_label_is_read_exactly() {
        assert_eq!(parse_label(None), Ok(None));
        assert_eq!(parse_label(Some("Observe")), Ok(Some(Enforcement::Observe)));
        assert_eq!(parse_label(Some("Enforce")), Ok(Some(Enforcement::Enforce)));
        let err = parse_label(Some("observe")).expect_err("case matters, as in the CRD's enum");
        assert!(err.contains(NODE_LABEL) && err.contains("Observe or Enforce"), "{err}");
    }

    proptest! {
        /// Merging is a maximum: commutative, never looser than either side, so a tenant's field never loosens
        /// an administrator's, whichever is merged into which.
        #[test]
        fn merging_never_loosens(a in any_field(), b in any_field()) {
            let merged = tighter(a, b);
            prop_assert_eq!(merged, tighter(b, a));
            prop_assert!(tightness(merged) >= tightness(a) && tightness(merged) >= tightness(b));
            prop_assert!(merged == a || merged == b);
        }

        /// A tighter field never evicts less, on any node: where the looser one enforces, so does it.
        #[test]
        fn a_tighter_field_enforces_wherever_a_looser_one_does(
            agent in any_mode(), label in prop::option::of(any_mode()), a in any_field(), b in any_field()
        ) {
            let n = node(agent, label);
            let (tight, loose) = if tightness(a) >= tightness(b) { (a, b) } else { (b, a) };
            let enforces = |f| !for_budget(&n, f, || "b".into()).observes();
            prop_assert!(!enforces(loose) || enforces(tight));
        }

        /// Only the levels set decide, the nearest first.
        #[test]
        fn the_nearest_level_set_decides(agent in any_mode(), label in prop::option::of(any_mode()), field in any_field()) {
            let mode = for_budget(&node(agent, label), field, || "b".into());
            prop_assert_eq!(mode.enforcement, field.or(label).unwrap_or(agent));
            let level = if field.is_some() { Level::Budget } else if label.is_some() { Level::Node } else { Level::Agent };
            prop_assert_eq!(mode.set_by.level(), level);
        }
    }
}
