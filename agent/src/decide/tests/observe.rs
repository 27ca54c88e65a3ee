//! Observe mode (#54): every eviction the agent would make is told (`GpuMemoryWouldEvict`, `Action::WouldEvict`
//! for the metric), once per episode, and none is made; the node's label overrides the agent's default, a budget's
//! `spec.enforcement` its own evictions, and a tenant's `Observe` never loosens a cluster budget's `Enforce`.

use super::*;
use crate::decide::EvictCause;
use gpubudget_common::Enforcement;
use gpubudget_common::enforcement::Level;

fn harness(agent: Enforcement, label: Option<Enforcement>, budget_extra: &str) -> Harness {
    let mut h = Harness::new(pod("", ""), &[budget(budget_extra)]);
    h.enforcer.settings.enforcement = agent;
    h.table.node_enforcement = label;
    h
}

fn would(actions: &[Action]) -> Vec<(EvictCause, Level)> {
    actions
        .iter()
        .filter_map(|a| match a {
            Action::WouldEvict { cause, set_by, .. } => Some((*cause, *set_by)),
            _ => None,
        })
        .collect()
}

fn note_of(actions: &[Action], wanted: Reason) -> Option<String> {
    actions.iter().find_map(|a| match a {
        Action::Event { reason, note, .. } if *reason == wanted => Some(note.clone()),
        _ => None,
    })
}

/// Nothing the agent did says the pod was evicted or is being evicted: no request, no delete, no `Evicting`
/// record or state, no eviction time, no `EvictingForGpuMemory` event.
fn nothing_enforced(actions: &[Action]) {
    for a in actions {
        match a {
            Action::Evict { .. } | Action::Delete { .. } => panic!("enforced in observe mode: {a:?}"),
            Action::Apply { record, .. } => {
                assert_ne!(record.state, BudgetState::Evicting, "{a:?}");
                assert_eq!(record.eviction_requested_at, None, "{a:?}");
            }
            Action::Transition { to, .. } => assert_ne!(*to, BudgetState::Evicting, "{a:?}"),
            Action::Event { reason, .. } => {
                assert!(!matches!(reason, Reason::Evicting | Reason::Deleting | Reason::RecordNotWritten), "{a:?}")
            }
            _ => {}
        }
    }
}

#[test]
fn observe_tells_what_it_would_evict_once_per_episode_and_evicts_nothing() {
    let mut h = harness(Enforcement::Observe, None, "");
    let mut all = h.run(0, 9_750, 9 * GI);
    assert!(would(&all).is_empty(), "not before overLimitSeconds: {:?}", kinds(&all));
    let over = note_of(&all, Reason::OverBudget).expect("told over");
    assert!(over.contains("observe mode (the agent's default, --enforcement"), "{over}");
    assert!(over.contains("would be evicted if it stays over for 10s, and is not"), "{over}");
    let due = h.tick(10_000, 9 * GI);
    assert_eq!(kinds(&due), ["GpuMemoryWouldEvict", "would-evict:budget:agent"]);
    let note = note_of(&due, Reason::WouldEvict).expect("would evict");
    assert!(
        note.starts_with(
            "would be evicted (observe mode: the agent's default, --enforcement (chart value agent.enforcement); \
             nothing is evicted): using 9Gi of 8Gi (budget team-a/llm) for 10s"
        ),
        "{note}"
    );
    assert!(!Reason::WouldEvict.is_warning(), "nothing happened to the pod");
    // However long it stays over: told once, nothing evicted, the record says Over.
    let later = h.run(10_250, 300_000, 9 * GI);
    assert!(would(&later).is_empty() && notes(&later).is_empty(), "{:?}", kinds(&later));
    assert_eq!(h.enforcer.state_of("uid-1"), Some(BudgetState::Over));
    all.extend(due);
    all.extend(later);
    // Back under, then over again: a new episode, told again.
    let back = h.run(300_250, 320_000, GI);
    assert!(kinds(&back).contains(&"GpuMemoryWithinBudget".to_owned()), "{:?}", kinds(&back));
    let again = h.run(320_250, 331_000, 9 * GI);
    assert_eq!(would(&again), [(EvictCause::Budget, Level::Agent)]);
    all.extend(back);
    all.extend(again);
    nothing_enforced(&all);
}

#[test]
fn the_nodes_label_overrides_the_agents_default_both_ways() {
    // An enforcing agent on a node labelled Observe: told, not evicted, and the note names the label.
    let mut h = harness(Enforcement::Enforce, Some(Enforcement::Observe), "");
    let out = h.run(0, 20_000, 9 * GI);
    nothing_enforced(&out);
    assert_eq!(would(&out), [(EvictCause::Budget, Level::Node)]);
    let note = note_of(&out, Reason::WouldEvict).expect("told");
    assert!(note.contains("observe mode: the Node's label gpubudget.io/enforcement;"), "{note}");
    // An observing agent on a node labelled Enforce evicts.
    let mut h = harness(Enforcement::Observe, Some(Enforcement::Enforce), "");
    let out = h.run(0, 20_000, 9 * GI);
    assert!(would(&out).is_empty(), "{:?}", kinds(&out));
    assert_eq!(evicts(&out), 1, "{:?}", kinds(&out));
}

#[test]
fn a_budget_set_to_enforce_evicts_on_an_observing_node_and_one_set_to_observe_does_not_on_an_enforcing_one() {
    let mut h = harness(Enforcement::Observe, Some(Enforcement::Observe), ", enforcement: Enforce");
    let out = h.run(0, 20_000, 9 * GI);
    assert!(would(&out).is_empty(), "{:?}", kinds(&out));
    assert_eq!(evicts(&out), 1, "{:?}", kinds(&out));
    assert!(kinds(&out).contains(&"apply:Evicting".to_owned()));
    let mut h = harness(Enforcement::Enforce, None, ", enforcement: Observe");
    let out = h.run(0, 20_000, 9 * GI);
    nothing_enforced(&out);
    assert_eq!(would(&out), [(EvictCause::Budget, Level::Budget)]);
    let note = note_of(&out, Reason::WouldEvict).expect("told");
    assert!(note.contains("observe mode: spec.enforcement of budget team-a/llm;"), "{note}");
}

#[test]
fn warn_and_critical_pods_are_not_even_would_be_evicted() {
    let mut h = harness(Enforcement::Observe, None, ", action: Warn");
    let out = h.run(0, 60_000, 9 * GI);
    assert!(would(&out).is_empty(), "{:?}", kinds(&out));
    let mut h = Harness::new(pod("", ", priorityClassName: system-node-critical"), &[budget("")]);
    h.enforcer.settings.enforcement = Enforcement::Observe;
    h.enforcer.settings.critical_namespaces = "team-a".parse().expect("namespaces");
    let out = h.run(0, 60_000, 9 * GI);
    assert!(would(&out).is_empty(), "{:?}", kinds(&out));
}

#[test]
fn switching_to_enforce_starts_the_period_afresh_then_evicts() {
    let mut h = harness(Enforcement::Observe, None, "");
    let observed = h.run(0, 60_000, 9 * GI);
    assert_eq!(would(&observed), [(EvictCause::Budget, Level::Agent)]);
    // The administrator labels the node Enforce: an hour over in observe mode is not acted on at once.
    h.table.node_enforcement = Some(Enforcement::Enforce);
    let switched = h.tick(60_250, 9 * GI);
    let note = note_of(&switched, Reason::BudgetChanged).expect("told");
    assert!(
        note.contains("enforcement Observe → Enforce (set by the Node's label gpubudget.io/enforcement)"),
        "{note}"
    );
    assert_eq!(evicts(&switched), 0);
    let soon = h.run(60_500, 70_000, 9 * GI);
    assert_eq!(evicts(&soon), 0, "{:?}", kinds(&soon));
    let then = h.run(70_250, 71_000, 9 * GI);
    assert_eq!(evicts(&then), 1, "{:?}", kinds(&then));
}

#[test]
fn an_eviction_under_way_when_the_node_turns_to_observe_is_dropped_before_its_request() {
    let mut h = harness(Enforcement::Enforce, None, "");
    h.write_ok = false;
    let out = h.run(0, 10_000, 9 * GI);
    assert!(kinds(&out).contains(&"EvictingForGpuMemory".to_owned()), "{:?}", kinds(&out));
    assert_eq!(evicts(&out), 0, "its record has not landed");
    h.table.node_enforcement = Some(Enforcement::Observe);
    h.write_ok = true;
    let after = h.run(10_250, 60_000, 9 * GI);
    assert_eq!(evicts(&after), 0, "{:?}", kinds(&after));
    assert!(after.iter().all(|a| !matches!(a, Action::Apply { record, .. } if record.eviction_requested_at.is_some())));
    assert_eq!(would(&after), [(EvictCause::Budget, Level::Node)], "told once the new period ran out");
}

/// A tenant's namespaced budget saying Observe does not loosen the administrator's cluster budget saying
/// Enforce: the cluster budget applies, and the pod is evicted on an observing node.
#[test]
fn a_tenants_observe_does_not_loosen_a_cluster_budgets_enforce() {
    let tenant = budget(", enforcement: Observe");
    let admin: gpubudget_common::ClusterGpuMemoryBudget = serde_yaml::from_str(
        "apiVersion: gpubudget.io/v1alpha1\nkind: ClusterGpuMemoryBudget\nmetadata: {name: admin}\n\
         spec: {namespaceSelector: {}, selector: {}, limit: 8Gi, enforcement: Enforce}",
    )
    .expect("cluster budget");
    let mut h = Harness::new(pod("", ""), &[]);
    h.table = PodTable::from_index(
        [pod("", "")],
        &crate::attribute::budgets::BudgetIndex::of([&tenant]),
        &crate::attribute::budgets::ClusterIndex::of([&admin], []),
        Some(NODE),
        &[],
    );
    h.enforcer.settings.enforcement = Enforcement::Observe;
    let out = h.run(0, 20_000, 9 * GI);
    assert!(would(&out).is_empty(), "{:?}", kinds(&out));
    assert_eq!(evicts(&out), 1, "{:?}", kinds(&out));
}

/// Pressure relief follows the node: observing, the pod that would be chosen is told once (and none after it
/// while it holds its memory), a pod no budget selects included, and nothing is evicted; a budget's own
/// `Observe` does not keep its pod from relief on an enforcing node.
#[test]
fn pressure_relief_is_observed_as_the_node_says() {
    use super::pressure_eviction::{Node, evicted};
    let mut node = Node::new(vec![
        super::pressure_eviction::view("grower", "grower", "", ""),
        super::pressure_eviction::view("neighbour", "n", "", ""),
        super::pressure_eviction::view("nobudget", "none", "", ""),
    ]);
    node.enforcer.settings.enforcement = Enforcement::Observe;
    // grower 20Gi of its 8Gi, neighbour 30Gi of its 40Gi, nobudget 27Gi: 77Gi used, 3Gi free.
    let bytes = [20 * GI, 30 * GI, 27 * GI];
    let all: Vec<Action> = (0..200).flat_map(|k| node.tick(k * 250, &bytes, 0)).collect();
    nothing_enforced(&all);
    assert!(evicted(&all).is_empty());
    assert_eq!(would(&all), [(EvictCause::Pressure, Level::Agent)], "one pod, once: {:?}", kinds(&all));
    let note = note_of(&all, Reason::WouldEvict).expect("told");
    assert!(note.contains("nothing is evicted): GPU 0 is under memory pressure"), "{note}");
    assert!(note.contains("no budget selects it"), "nobudget goes first: {note}");
    let began = all
        .iter()
        .find_map(|a| match a {
            Action::NodeEvent { reason: NodeReason::Pressure, note } => Some(note.clone()),
            _ => None,
        })
        .expect("pressure told");
    assert!(began.contains("telling which pod would be evicted (observe mode"), "{began}");
    // The pressure ends and comes back: told again.
    let _: Vec<Action> = (200..220).flat_map(|k| node.tick(k * 250, &[20 * GI, 30 * GI, 0], 0)).collect();
    let again: Vec<Action> = (220..224).flat_map(|k| node.tick(k * 250, &bytes, 0)).collect();
    assert_eq!(would(&again), [(EvictCause::Pressure, Level::Agent)], "{:?}", kinds(&again));
    // Labelled Enforce: relief acts at once.
    node.table.node_enforcement = Some(Enforcement::Enforce);
    let enforced: Vec<Action> = (224..228).flat_map(|k| node.tick(k * 250, &bytes, 0)).collect();
    assert_eq!(evicted(&enforced), [("nobudget".to_owned(), Some(5))], "{:?}", kinds(&enforced));

    // On an enforcing node, a budget whose own evictions are observed is relieved all the same.
    let budgets: Vec<GpuMemoryBudget> = super::pressure_eviction::budgets()
        .into_iter()
        .map(|mut b| {
            b.spec.enforcement = Some(Enforcement::Observe);
            b
        })
        .collect();
    let mut node = Node::with_budgets(
        vec![
            super::pressure_eviction::view("grower", "grower", "", ""),
            super::pressure_eviction::view("neighbour", "n", "", ""),
        ],
        &budgets,
    );
    let all: Vec<Action> = (0..4).flat_map(|k| node.tick(k * 250, &[47 * GI, 30 * GI], 0)).collect();
    assert_eq!(evicted(&all), [("grower".to_owned(), Some(5))], "{:?}", kinds(&all));
}
