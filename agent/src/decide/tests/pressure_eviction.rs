//! Pressure on a GPU evicts the pod most over its budget (with a request: most above its request) at once,
//! one at a time, and never a pod within its budget (its request), critical or static; a pod no budget selects
//! as the node policy says (`Ranked`: guaranteed nothing; `Never`: never).

use super::*;
use crate::decide::NodeReason;
use crate::decide::pressure::{PressureSettings, Threshold, Unbudgeted};

const TOTAL: u64 = 80 * GI;

pub(super) fn budgets() -> Vec<GpuMemoryBudget> {
    ["grower: {limit: 8Gi, sel: grower}", "big: {limit: 40Gi, sel: n}", "warn: {limit: 1Gi, sel: w}"]
        .iter()
        .map(|spec| {
            let (name, rest) = spec.split_once(": ").expect("spec");
            let limit = rest.split("limit: ").nth(1).and_then(|r| r.split(',').next()).expect("limit");
            let sel = rest.split("sel: ").nth(1).and_then(|r| r.strip_suffix('}')).expect("sel");
            let action = if name == "warn" { "Warn" } else { "Evict" };
            serde_yaml::from_str(&format!(
                "apiVersion: gpubudget.io/v1alpha1\nkind: GpuMemoryBudget\nmetadata: {{name: {name}, namespace: team-a}}\n\
                 spec: {{selector: {{matchLabels: {{app: {sel}}}}}, limit: {limit}, action: {action}, overLimitSeconds: 600}}"
            ))
            .expect("budget")
        })
        .collect()
}

pub(super) fn view(name: &str, app: &str, extra_meta: &str, extra_spec: &str) -> PodView {
    let p: Pod = serde_yaml::from_str(&format!(
        "metadata: {{name: {name}, namespace: team-a, uid: uid-{name}, labels: {{app: {app}}}{extra_meta}}}\n\
         spec: {{nodeName: {NODE}, terminationGracePeriodSeconds: 3600, containers: []{extra_spec}}}"
    ))
    .expect("pod");
    PodView::from_pod(&p).expect("view")
}

pub(super) struct Node {
    pub(super) enforcer: Enforcer,
    pub(super) table: PodTable,
}

impl Node {
    pub(super) fn new(views: Vec<PodView>) -> Self {
        Self::with_budgets(views, &budgets())
    }

    pub(super) fn with_budgets(views: Vec<PodView>, budgets: &[GpuMemoryBudget]) -> Self {
        let mut settings = Settings::new(NODE);
        settings.pressure = PressureSettings {
            hard: Some(Threshold::Bytes(4 * GI)),
            soft: None,
            soft_grace_ms: 0,
            transition_ms: 1_000,
        };
        Self { enforcer: Enforcer::new(settings), table: PodTable::build(views, budgets, Some(NODE)) }
    }

    /// One tick: `bytes` per pod (table order) on GPU 0, the device's used bytes the sum plus `extra`;
    /// every write and eviction succeeds.
    pub(super) fn tick(&mut self, ms: u64, bytes: &[u64], extra: u64) -> Vec<Action> {
        self.tick_with(ms, bytes, extra, false)
    }

    /// [`Self::tick`], the evictions refused (429) when `refuse`.
    fn tick_with(&mut self, ms: u64, bytes: &[u64], extra: u64, refuse: bool) -> Vec<Action> {
        let usage: Vec<PodUsage> = bytes
            .iter()
            .map(|&b| PodUsage {
                total: b,
                holders: if b == 0 {
                    vec![]
                } else {
                    vec![Holder { container: None, pid: Some(1), gpu: 0, bytes: b, mps_client: None }]
                },
                unknown: 0,
            })
            .collect();
        let snapshot = Snapshot {
            gpus: vec![GpuInfo { label: "0".into(), total_bytes: TOTAL, ..GpuInfo::default() }],
            processes: Vec::new(),
            readings: vec![GpuReading::sampled(Some(DeviceMemory::from_used(
                bytes.iter().sum::<u64>() + extra,
                TOTAL,
            )))],
        };
        let mut out = Vec::new();
        self.enforcer.tick(at(ms), &self.table, &usage, &snapshot.gpus, &mut out);
        self.enforcer.pressure(at(ms), &self.table, &usage, &snapshot, &mut out);
        let feedback: Vec<Feedback> = out
            .iter()
            .filter_map(|a| match a {
                Action::Apply { pod, record, .. } => {
                    Some(Feedback::Written { uid: pod.uid.clone(), record: Some(record.clone()), ok: true })
                }
                Action::Evict { pod, .. } => Some(Feedback::Evicted {
                    uid: pod.uid.clone(),
                    outcome: if refuse { EvictOutcome::Blocked("PDB".into()) } else { EvictOutcome::Accepted },
                }),
                _ => None,
            })
            .collect();
        for f in feedback {
            self.enforcer.feedback(at(ms), f, &mut out);
        }
        out
    }
}

pub(super) fn evicted(actions: &[Action]) -> Vec<(String, Option<i64>)> {
    actions
        .iter()
        .filter_map(|a| match a {
            Action::Evict { pod, grace_seconds, .. } => Some((pod.name.to_string(), *grace_seconds)),
            _ => None,
        })
        .collect()
}

fn node_events(actions: &[Action]) -> Vec<NodeReason> {
    actions.iter().filter_map(|a| if let Action::NodeEvent { reason, .. } = a { Some(*reason) } else { None }).collect()
}

#[test]
fn the_most_over_pod_is_evicted_at_once_with_the_pressure_grace_and_the_record_says_evicting() {
    let mut node = Node::new(vec![view("grower", "grower", "", ""), view("neighbour", "n", "", "")]);
    // 20Gi of an 8Gi budget and 30Gi of a 40Gi one: 50Gi used, no pressure.
    let quiet = node.tick(0, &[20 * GI, 30 * GI], 0);
    assert!(evicted(&quiet).is_empty() && node_events(&quiet).is_empty(), "{quiet:#?}");
    // The grower climbs to 47Gi: 77Gi used, 3Gi free, under the 4Gi hard threshold. overLimitSeconds (600)
    // is not waited for.
    let first = node.tick(250, &[47 * GI, 30 * GI], 0);
    assert_eq!(node_events(&first), [NodeReason::Pressure]);
    assert!(node.enforcer.under_pressure(0));
    let record = first.iter().find_map(|a| match a {
        Action::Apply { pod, record, .. } if &*pod.name == "grower" => Some(record.clone()),
        _ => None,
    });
    assert_eq!(record.map(|r| r.state), Some(BudgetState::Evicting), "{first:#?}");
    let note = first
        .iter()
        .find_map(|a| match a {
            Action::Event { reason: Reason::Evicting, note, .. } => Some(note.clone()),
            _ => None,
        })
        .expect("an eviction event");
    assert!(note.contains("under memory pressure") && note.contains("most over its budget"), "{note}");
    // The request follows once the record landed; the pressure grace (5 s) applies, not the pod's 3600 s.
    let second = node.tick(500, &[47 * GI, 30 * GI], 0);
    assert_eq!(evicted(&second), [("grower".to_owned(), Some(5))]);
    // The neighbour within its budget is never touched, even while pressure lasts.
    let later: Vec<Action> = (3..20).flat_map(|k| node.tick(k * 250, &[47 * GI, 30 * GI], 0)).collect();
    assert!(evicted(&later).is_empty(), "{later:#?}");
    // The grower's processes exit: free memory comes back; the signal ends after the transition period.
    let back: Vec<Action> = (20..30).flat_map(|k| node.tick(k * 250, &[0, 30 * GI], 0)).collect();
    assert_eq!(node_events(&back), [NodeReason::PressureEnded]);
}

#[test]
fn one_at_a_time_per_gpu_while_the_first_still_holds_memory() {
    let views =
        vec![view("grower", "grower", "", ""), view("neighbour", "n", "", ""), view("second", "grower", "", "")];
    let mut node = Node::new(views);
    // Two pods over the 8Gi budget: 40Gi (32 over) and 36Gi (28 over) beside a neighbour at 1Gi of its 40Gi;
    // 77Gi used.
    let a = node.tick(0, &[40 * GI, GI, 36 * GI], 0);
    let b = node.tick(250, &[40 * GI, GI, 36 * GI], 0);
    assert_eq!(evicted(&[a, b].concat()), [("grower".to_owned(), Some(5))]);
    // The first still terminates (holds its memory): no second eviction however long it takes.
    let waiting: Vec<Action> = (2..40).flat_map(|k| node.tick(k * 250, &[40 * GI, GI, 36 * GI], 0)).collect();
    assert!(evicted(&waiting).is_empty(), "{waiting:#?}");
    // Its memory is reclaimed but the GPU is still short (the second grows to 76Gi): now the second.
    let next: Vec<Action> = (40..43).flat_map(|k| node.tick(k * 250, &[0, GI, 76 * GI], 0)).collect();
    assert_eq!(evicted(&next), [("second".to_owned(), Some(5))]);
}

#[test]
fn within_budget_critical_static_and_under_never_unbudgeted_pods_are_never_evicted_and_the_node_is_told_once() {
    let views = vec![
        view("neighbour", "n", "", ""),
        view("critical", "grower", "", ", priorityClassName: system-node-critical"),
        view("static", "grower", ", annotations: {kubernetes.io/config.mirror: abc}", ""),
        view("nobudget", "none", "", ""),
    ];
    let mut node = Node::new(views);
    node.enforcer.settings.unbudgeted_pods = Unbudgeted::Never;
    // Critical priority exempts in the namespaces the administrator lists (#33): here, the pod's.
    node.enforcer.settings.critical_namespaces = "team-a".parse().expect("valid");
    // In table order: critical 10Gi, neighbour 10Gi of its 40Gi (owed 30Gi), nobudget 38Gi, static 20Gi.
    let bytes = [10 * GI, 10 * GI, 38 * GI, 20 * GI];
    let all: Vec<Action> = (0..20).flat_map(|k| node.tick(k * 250, &bytes, 0)).collect();
    assert!(evicted(&all).is_empty(), "{all:#?}");
    assert_eq!(node_events(&all), [NodeReason::Pressure, NodeReason::Overcommitted]);
    let note = all
        .iter()
        .find_map(|a| match a {
            Action::NodeEvent { reason: NodeReason::Overcommitted, note } => Some(note.clone()),
            _ => None,
        })
        .expect("told");
    assert!(note.contains("add up to more than it holds") && note.contains("team-a/neighbour"), "{note}");
    assert!(note.contains("team-a/nobudget 38Gi (no budget, unbudgetedPods=Never)"), "{note}");
}

#[test]
fn under_ranked_the_pod_no_budget_selects_goes_first_at_once_without_a_record_and_the_event_says_why() {
    // The table sorts by name: neighbour (30Gi of its 40Gi), nobudget (47Gi, no budget selects it).
    let mut node = Node::new(vec![view("neighbour", "n", "", ""), view("nobudget", "none", "", "")]);
    assert_eq!(node.enforcer.settings.unbudgeted_pods, Unbudgeted::Ranked, "the default");
    let first = node.tick(0, &[30 * GI, 47 * GI], 0);
    assert_eq!(evicted(&first), [("nobudget".to_owned(), Some(5))]);
    // Not counted as an eviction that missed its record (gpubudget_evictions_without_record_total).
    assert!(first.iter().any(|a| matches!(a, Action::Evict { recorded: true, .. })), "{first:#?}");
    // No record: no budget counts the eviction (and the agent writes nothing on pods without one).
    assert!(
        !first
            .iter()
            .any(|a| matches!(a, Action::Apply { pod, .. } | Action::Clear { pod } if &*pod.name == "nobudget")),
        "{first:#?}"
    );
    let note = note_of(&first, Reason::Evicting).expect("told");
    assert!(note.starts_with("no budget selects this pod; node policy unbudgetedPods=Ranked"), "{note}");
    assert!(
        note.contains(
            "GPU 0 is under memory pressure (3Gi free of 80Gi; pods within their guarantee there are owed 10Gi)"
        ),
        "{note}"
    );
    let began = first
        .iter()
        .find_map(|a| match a {
            Action::NodeEvent { reason: NodeReason::Pressure, note } => Some(note.clone()),
            _ => None,
        })
        .expect("began");
    assert!(began.contains("unbudgetedPods=Ranked"), "{began}");
    // While it terminates and holds its memory, nobody else goes (the neighbour is within its budget anyway).
    let waiting: Vec<Action> = (1..20).flat_map(|k| node.tick(k * 250, &[30 * GI, 47 * GI], 0)).collect();
    assert!(evicted(&waiting).is_empty(), "{waiting:#?}");
}

#[test]
fn under_ranked_a_refused_eviction_of_an_unbudgeted_pod_gives_the_turn_back_and_says_it_has_no_budget() {
    let mut node = Node::new(vec![view("neighbour", "n", "", ""), view("nobudget", "none", "", "")]);
    let first = node.tick_with(0, &[30 * GI, 47 * GI], 0, true);
    assert_eq!(evicted(&first), [("nobudget".to_owned(), Some(5))]);
    let note = note_of(&first, Reason::EvictionBlocked).expect("told");
    assert!(note.contains("using 47Gi, no budget selects this pod"), "{note}");
    // The backoff (5s) is waited out, then it is chosen again: never the neighbour within its budget.
    let backoff: Vec<Action> = (1..20).flat_map(|k| node.tick_with(k * 250, &[30 * GI, 47 * GI], 0, true)).collect();
    assert!(evicted(&backoff).is_empty(), "{backoff:#?}");
    let again: Vec<Action> = (20..23).flat_map(|k| node.tick(k * 250, &[30 * GI, 47 * GI], 0)).collect();
    assert_eq!(evicted(&again), [("nobudget".to_owned(), Some(5))]);
}

#[test]
fn a_pod_relabelled_out_of_every_selector_is_ranked_as_unbudgeted() {
    // grower is within its 8Gi budget at 6Gi; the neighbour 30Gi of its 40Gi.
    let mut node = Node::new(vec![view("grower", "grower", "", ""), view("neighbour", "n", "", "")]);
    assert!(evicted(&node.tick(0, &[6 * GI, 30 * GI], 0)).is_empty());
    // Relabelled out of its budget's selector, it grows to 47Gi: 77Gi used, 3Gi free, the neighbour owed 10Gi.
    node.table =
        PodTable::build(vec![view("grower", "gone", "", ""), view("neighbour", "n", "", "")], &budgets(), Some(NODE));
    let all: Vec<Action> = (1..4).flat_map(|k| node.tick(k * 250, &[47 * GI, 30 * GI], 0)).collect();
    assert_eq!(evicted(&all), [("grower".to_owned(), Some(5))]);
    assert!(note_of(&all, Reason::Evicting).is_some_and(|n| n.starts_with("no budget selects this pod")));
}

#[test]
fn off_by_default() {
    let mut node = Node::new(vec![view("grower", "grower", "", "")]);
    node.enforcer.settings.pressure = PressureSettings::OFF;
    let all: Vec<Action> = (0..10).flat_map(|k| node.tick(k * 250, &[79 * GI], 0)).collect();
    assert!(evicted(&all).is_empty() && node_events(&all).is_empty());
    assert_eq!(Settings::new(NODE).pressure, PressureSettings::OFF);
}

#[test]
fn a_budget_grace_caps_the_pressure_grace() {
    let mut node = Node::new(vec![]);
    node.enforcer.settings.pressure_grace_seconds = 30;
    let mut b = budgets();
    b[0].spec.eviction_grace_period_seconds = Some(2);
    node.table =
        PodTable::build(vec![view("grower", "grower", "", ""), view("neighbour", "n", "", "")], &b, Some(NODE));
    let all: Vec<Action> = (0..3).flat_map(|k| node.tick(k * 250, &[48 * GI, 30 * GI], 0)).collect();
    assert_eq!(evicted(&all), [("grower".to_owned(), Some(2))]);
}

/// Budgets with a request: `burst` (request 4Gi, limit 16Gi), `steady` (request 20Gi, limit 40Gi), and
/// `plain` (limit 40Gi, no request).
fn request_budgets() -> Vec<GpuMemoryBudget> {
    [("burst", "request: 4Gi, limit: 16Gi"), ("steady", "request: 20Gi, limit: 40Gi"), ("plain", "limit: 40Gi")]
        .iter()
        .map(|(name, sizes)| {
            serde_yaml::from_str(&format!(
                "apiVersion: gpubudget.io/v1alpha1\nkind: GpuMemoryBudget\nmetadata: {{name: {name}, namespace: team-a}}\n\
                 spec: {{selector: {{matchLabels: {{app: {name}}}}}, {sizes}, overLimitSeconds: 600}}"
            ))
            .expect("budget")
        })
        .collect()
}

fn note_of(actions: &[Action], wanted: Reason) -> Option<String> {
    actions.iter().find_map(|a| match a {
        Action::Event { reason, note, .. } if *reason == wanted => Some(note.clone()),
        _ => None,
    })
}

#[test]
fn with_requests_the_pod_most_above_its_request_is_evicted_and_one_within_it_never() {
    // The table sorts pods by name: burst, plain, steady.
    let views = vec![view("burst", "burst", "", ""), view("plain", "plain", "", ""), view("steady", "steady", "", "")];
    let mut node = Node::with_budgets(views, &request_budgets());
    // burst: 12Gi, within its 16Gi limit but 8Gi above its 4Gi request; plain: 30Gi, within its limit (no
    // request); steady: 20Gi, within its request. 62Gi + 15Gi held by no pod: 3Gi free, under the 4Gi threshold.
    let first = node.tick(0, &[12 * GI, 30 * GI, 20 * GI], 15 * GI);
    let note = note_of(&first, Reason::Evicting).expect("an eviction event");
    assert!(note.contains("8Gi above its request of 4Gi") && note.contains("most above its request"), "{note}");
    assert!(note.starts_with("using 12Gi of 16Gi (budget team-a/burst)"), "{note}");
    let second = node.tick(250, &[12 * GI, 30 * GI, 20 * GI], 15 * GI);
    assert_eq!(evicted(&second), [("burst".to_owned(), Some(5))]);
    // burst's memory is back and the GPU is still short: steady (at its request) and plain (within its
    // limit) are never evicted; the Node is told what they are guaranteed.
    let rest: Vec<Action> = (2..30).flat_map(|k| node.tick(k * 250, &[0, 30 * GI, 20 * GI], 27 * GI)).collect();
    assert!(evicted(&rest).is_empty(), "{rest:#?}");
    let told = rest
        .iter()
        .find_map(|a| match a {
            Action::NodeEvent { reason: NodeReason::Overcommitted, note } => Some(note.clone()),
            _ => None,
        })
        .expect("told");
    assert!(told.contains("team-a/steady 20Gi (request 20Gi, limit 40Gi)"), "{told}");
    assert!(told.contains("team-a/plain 30Gi (limit 40Gi)") && told.contains("above its request"), "{told}");
}

#[test]
fn a_pod_back_within_its_request_before_the_request_goes_out_is_not_evicted() {
    let views = vec![view("burst", "burst", "", ""), view("steady", "steady", "", "")];
    let mut node = Node::with_budgets(views, &request_budgets());
    // burst 6Gi above its request, steady 10Gi short of its 20Gi request, 3Gi free.
    let first = node.tick(0, &[10 * GI, 10 * GI], 57 * GI);
    assert!(note_of(&first, Reason::Evicting).is_some(), "{first:#?}");
    // Its record landed, but it is back at 4Gi (its request) before the eviction request goes out.
    let after: Vec<Action> = (1..10).flat_map(|k| node.tick(k * 250, &[4 * GI, 10 * GI], 63 * GI)).collect();
    assert!(evicted(&after).is_empty(), "{after:#?}");
    let record = after.iter().rev().find_map(|a| match a {
        Action::Apply { record, .. } => Some(record.clone()),
        _ => None,
    });
    assert_eq!(record.map(|r| (r.state, r.eviction_requested_at)), Some((BudgetState::Within, None)));
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(200))]
    /// Random usage under random pressure, with requests: no eviction is ever requested, no pod deleted, and
    /// no eviction decided for a pod at or within its request at that tick; pods without one keep the old
    /// rule (over their limit).
    #[test]
    fn never_within_the_request(
        steps in proptest::collection::vec((proptest::collection::vec(0u64..44, 3), 0u64..40, any::<bool>()), 1..60)
    ) {
        // In table order (by name).
        let names = ["burst", "plain", "steady"];
        let guaranteed = [4 * GI, 40 * GI, 20 * GI];
        let views = names.iter().map(|n| view(n, n, "", "")).collect();
        let mut node = Node::with_budgets(views, &request_budgets());
        let mut gone = [false; 3];
        for (k, (gib, extra, refuse)) in steps.iter().enumerate() {
            let bytes: Vec<u64> = (0..3).map(|i| if gone[i] { 0 } else { gib[i] * GI }).collect();
            let out = node.tick_with(k as u64 * 250, &bytes, extra * GI, *refuse);
            for a in &out {
                let (Action::Event { pod, reason: Reason::Evicting | Reason::Deleting, .. }
                | Action::Evict { pod, .. }
                | Action::Delete { pod, .. }) = a else { continue };
                let i = names.iter().position(|n| **n == *pod.name).expect("a pod of the test");
                prop_assert!(bytes[i] > guaranteed[i], "{a:?} at {} (guaranteed {})", bytes[i], guaranteed[i]);
                if matches!(a, Action::Evict { .. }) && !*refuse {
                    gone[i] = true;
                }
            }
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(300))]
    /// Random usage, device totals and refusals: a pressure eviction is only ever decided for a pod over its
    /// budget (never the pod within its budget; a `Warn` one as any other, #52), only where the pods within
    /// their budget are owed more than is free (less the claim slack), and never while another pod's eviction on
    /// the GPU is in flight (decided and not refused, its memory not yet back).
    #[test]
    fn never_within_never_unharmed_one_in_flight(
        steps in proptest::collection::vec((proptest::collection::vec(0u64..48, 4), 0u64..8, any::<bool>()), 1..80)
    ) {
        let names = ["g1", "g2", "n", "w"];
        let mut node = Node::new(vec![
            view("g1", "grower", "", ""),
            view("g2", "grower", "", ""),
            view("n", "n", "", ""),
            view("w", "w", "", ""),
        ]);
        let limits = [8 * GI, 8 * GI, 40 * GI, GI];
        let mut gone = [false; 4];
        // The pod whose pressure eviction is in flight, and whether its request went out.
        let mut in_flight: Option<(usize, bool)> = None;
        for (k, (gib, extra, refuse)) in steps.iter().enumerate() {
            let bytes: Vec<u64> = (0..4).map(|i| if gone[i] { 0 } else { gib[i] * GI }).collect();
            // Over: its memory is back. Or cancelled: back within its budget before the request went out.
            if in_flight.is_some_and(|(i, sent)| bytes[i] == 0 || (!sent && bytes[i] <= limits[i])) {
                in_flight = None;
            }
            let out = node.tick_with(k as u64 * 250, &bytes, extra * GI, *refuse);
            for a in &out {
                match a {
                    Action::Event { pod, reason: Reason::Evicting, .. } => {
                        let i = names.iter().position(|n| **n == *pod.name).expect("a pod of the test");
                        prop_assert!(bytes[i] > limits[i], "{} chosen within its budget", pod.name);
                        let owed: u64 = (0..4).filter(|&j| bytes[j] > 0).map(|j| limits[j].saturating_sub(bytes[j])).sum();
                        let free = TOTAL.saturating_sub(bytes.iter().sum::<u64>() + extra * GI);
                        prop_assert!(owed > 0 && owed + crate::decide::pressure::CLAIM_SLACK > free,
                            "{} chosen with nobody harmed: owed {owed}, free {free}", pod.name);
                        prop_assert!(in_flight.is_none(), "{} chosen while {:?} is in flight", pod.name, in_flight.map(|(j, _)| names[j]));
                        in_flight = Some((i, false));
                    }
                    Action::Evict { pod, .. } => {
                        let i = names.iter().position(|n| **n == *pod.name).expect("a pod of the test");
                        if *refuse {
                            in_flight = None;
                        } else {
                            gone[i] = true;
                            if in_flight.is_some_and(|(j, _)| j == i) {
                                in_flight = Some((i, true));
                            }
                        }
                    }
                    _ => {}
                }
            }
        }
    }
}

/// Ticks every 250 ms from `from_ms` to `to_ms`, evictions refused; the time of each action.
fn refused_run(node: &mut Node, from_ms: u64, to_ms: u64, bytes: &[u64]) -> Vec<(u64, Action)> {
    (from_ms..=to_ms)
        .step_by(250)
        .flat_map(|ms| node.tick_with(ms, bytes, 0, true).into_iter().map(move |a| (ms, a)))
        .collect()
}

/// The first `DeletingForGpuMemory` note of a run.
fn deleting_note(actions: &[(u64, Action)]) -> String {
    actions
        .iter()
        .find_map(|(_, a)| match a {
            Action::Event { reason: Reason::Deleting, note, .. } => Some(note.clone()),
            _ => None,
        })
        .expect("told")
}

fn deletes(actions: &[(u64, Action)]) -> Vec<(u64, String, Option<i64>)> {
    actions
        .iter()
        .filter_map(|(ms, a)| match a {
            Action::Delete { pod, grace_seconds } => Some((*ms, pod.name.to_string(), *grace_seconds)),
            _ => None,
        })
        .collect()
}

/// #33: a PodDisruptionBudget (`maxUnavailable: 0`) refusing every pressure eviction of a pod no budget
/// selects holds pressure relief back for the node's bound (60 s by default) only: then the pod is deleted
/// with the pressure grace, once, and the event says why. The neighbour within its budget is never touched.
#[test]
fn a_pressure_eviction_refused_for_the_node_bound_ends_in_a_delete() {
    let mut node = Node::new(vec![view("neighbour", "n", "", ""), view("nobudget", "none", "", "")]);
    assert_eq!(node.enforcer.settings.pressure_blocked_timeout_ms, 60_000, "the default");
    let all = refused_run(&mut node, 0, 90_000, &[30 * GI, 47 * GI]);
    let gone = deletes(&all);
    assert_eq!(gone.len(), 1, "{gone:?}");
    let (ms, name, grace) = &gone[0];
    assert_eq!((name.as_str(), *grace), ("nobudget", Some(5)));
    assert!((60_000..=70_000).contains(ms), "deleted at {ms} ms, the first refusal at 0");
    assert!(all.iter().all(|(_, a)| !matches!(a, Action::Evict { pod, .. } if &*pod.name == "neighbour")));
    let note = deleting_note(&all);
    assert!(note.contains("(the node's pressure blocked timeout: 60s): deleting the pod with 5s grace"), "{note}");
    // Refused evictions before it: several, every one told.
    assert!(evicted(&all.iter().map(|(_, a)| a.clone()).collect::<Vec<_>>()).len() >= 3);
}

/// #33: a budgeted pod above its guarantee whose pressure evictions are refused is deleted after its budget's
/// own blockedEvictionTimeoutSeconds when it sets one, else after the node's bound; the record says Evicting
/// with the time asked, so the budget counts it.
#[test]
fn a_budgeted_pods_refused_pressure_eviction_ends_after_its_own_timeout_or_the_nodes() {
    for (own, after) in [(None, 60_000), (Some(10), 10_000)] {
        let mut b = budgets();
        b[0].spec.blocked_eviction_timeout_seconds = own;
        let mut node = Node::with_budgets(vec![view("grower", "grower", "", ""), view("neighbour", "n", "", "")], &b);
        // grower 47Gi of its 8Gi; the neighbour 30Gi of its 40Gi: 3Gi free.
        let all = refused_run(&mut node, 0, 90_000, &[47 * GI, 30 * GI]);
        let gone = deletes(&all);
        assert_eq!(gone.len(), 1, "{own:?}: {gone:?}");
        assert_eq!(gone[0].1, "grower");
        assert!((after..=after + 10_000).contains(&gone[0].0), "{own:?}: deleted at {} ms", gone[0].0);
        let recorded = all.iter().rev().find_map(|(_, a)| match a {
            Action::Apply { pod, record, .. } if &*pod.name == "grower" => Some(record.clone()),
            _ => None,
        });
        let recorded = recorded.expect("a record");
        assert_eq!(recorded.state, BudgetState::Evicting);
        assert!(recorded.eviction_requested_at.is_some());
    }
}

/// #33: where tenants may write namespaced budgets (`--namespaced-budgets ClusterBound`), a tenant who writes
/// `action: Warn` and `limit: 1Ti` for its own pod buys nothing under pressure: guaranteed nothing, it goes
/// before the neighbour an administrator's cluster budget protects. Where only administrators write them
/// (`Trusted`, the default), the same budget is honoured: nothing may be evicted, and the Node is told.
#[test]
fn a_tenant_written_budget_buys_no_immunity_under_pressure() {
    let tenant: GpuMemoryBudget = serde_yaml::from_str(
        "apiVersion: gpubudget.io/v1alpha1\nkind: GpuMemoryBudget\nmetadata: {name: mine, namespace: team-a}\n\
         spec: {selector: {matchLabels: {app: greedy}}, limit: 1Ti, action: Warn}",
    )
    .expect("budget");
    let admin: gpubudget_common::ClusterGpuMemoryBudget = serde_yaml::from_str(
        "apiVersion: gpubudget.io/v1alpha1\nkind: ClusterGpuMemoryBudget\nmetadata: {name: admin}\n\
         spec: {namespaceSelector: {}, selector: {matchLabels: {app: n}}, limit: 40Gi}",
    )
    .expect("cluster budget");
    let table = || {
        PodTable::from_index(
            vec![view("greedy", "greedy", "", ""), view("neighbour", "n", "", "")],
            &crate::attribute::budgets::BudgetIndex::of([&tenant]),
            &crate::attribute::budgets::ClusterIndex::of([&admin], []),
            Some(NODE),
            &[],
        )
    };
    // greedy 47Gi under its tenant's 1Ti Warn budget; the neighbour 30Gi of its administrator's 40Gi: 3Gi free.
    let bytes = [47 * GI, 30 * GI];
    let mut trusted = Node::new(vec![]);
    trusted.table = table();
    let all: Vec<Action> = (0..8).flat_map(|k| trusted.tick(k * 250, &bytes, 0)).collect();
    assert!(evicted(&all).is_empty(), "{all:#?}");
    assert_eq!(node_events(&all), [NodeReason::Pressure, NodeReason::Overcommitted]);
    let mut bound = Node::new(vec![]);
    bound.enforcer.settings.namespaced_budgets = crate::decide::pressure::NamespacedBudgets::ClusterBound;
    bound.table = table();
    let all: Vec<Action> = (0..8).flat_map(|k| bound.tick(k * 250, &bytes, 0)).collect();
    assert_eq!(evicted(&all), [("greedy".to_owned(), Some(5))]);
    let note = note_of(&all, Reason::Evicting).expect("told");
    assert!(note.contains("namespacedBudgets=ClusterBound"), "{note}");
    // The neighbour, within its administrator's budget, is never chosen, whatever the pressure.
    let later: Vec<Action> = (8..40).flat_map(|k| bound.tick(k * 250, &[0, 39 * GI], 38 * GI)).collect();
    assert!(evicted(&later).is_empty(), "{later:#?}");
}

/// #33: a budget only a tenant wrote (`ClusterBound`) cannot give its own pod a day of grace to hold the memory
/// while it terminates: its eviction gets 30 s at most, and the event says so. An administrator's allows up to
/// its own: the pod gets the 3600 s it asks for (a budget's grace is a most, never more than the pod asks).
#[test]
fn a_tenant_written_budget_cannot_buy_a_long_grace() {
    let mut b = budgets();
    b[0].spec.eviction_grace_period_seconds = Some(86_400);
    b[0].spec.over_limit_seconds = 0;
    for (policy, want) in [
        (crate::decide::pressure::NamespacedBudgets::ClusterBound, 30),
        (crate::decide::pressure::NamespacedBudgets::Trusted, 3_600),
    ] {
        let mut node = Node::with_budgets(vec![view("grower", "grower", "", "")], &b);
        node.enforcer.settings.namespaced_budgets = policy;
        // 9Gi of its 8Gi, the GPU far from pressure.
        let all: Vec<Action> = (0..4).flat_map(|k| node.tick(k * 250, &[9 * GI], 0)).collect();
        assert_eq!(evicted(&all), [("grower".to_owned(), Some(want))], "{policy:?}");
        if want == 30 {
            let note = note_of(&all, Reason::Evicting).expect("told");
            assert!(
                note.contains("30s grace (the budget asks for 86400s; capped for a budget only a tenant wrote)"),
                "{note}"
            );
        }
    }
}

/// A budget cannot lengthen the node's bound under pressure: a `blockedEvictionTimeoutSeconds` of a day (the
/// most the API takes, and a tenant may write it where tenants edit budgets) leaves the pod deleted after the
/// node's 60 s, and the event names the node's bound. A shorter one still shortens it (the test above).
#[test]
fn a_budgets_own_long_timeout_never_lengthens_the_nodes_pressure_bound() {
    let mut b = budgets();
    b[0].spec.blocked_eviction_timeout_seconds = Some(86_400);
    let mut node = Node::with_budgets(vec![view("grower", "grower", "", ""), view("neighbour", "n", "", "")], &b);
    let all = refused_run(&mut node, 0, 90_000, &[47 * GI, 30 * GI]);
    let gone = deletes(&all);
    assert_eq!(gone.len(), 1, "{gone:?}");
    assert_eq!(gone[0].1, "grower");
    assert!((60_000..=70_000).contains(&gone[0].0), "deleted at {} ms", gone[0].0);
    let note = deleting_note(&all);
    assert!(note.contains("the node's pressure blocked timeout: 60s"), "{note}");
}

/// A pod over its budget whose eviction by the budget a PodDisruptionBudget refuses (no
/// blockedEvictionTimeoutSeconds: the budget alone would retry for ever) is still relieved under pressure: the
/// node's bound ends the stall, counted from the first refusal while the GPU is under pressure.
#[test]
fn a_pod_whose_budget_eviction_is_refused_is_still_relieved_under_pressure() {
    let mut b = budgets();
    b[0].spec.over_limit_seconds = 0;
    assert_eq!(b[0].spec.blocked_eviction_timeout_seconds, None);
    let mut node = Node::with_budgets(vec![view("grower", "grower", "", ""), view("neighbour", "n", "", "")], &b);
    // Over its budget with the card far from pressure: the budget's eviction is refused, again and again.
    let calm = refused_run(&mut node, 0, 20_000, &[9 * GI, 30 * GI]);
    assert!(!evicted(&calm.iter().map(|(_, a)| a.clone()).collect::<Vec<_>>()).is_empty());
    assert!(deletes(&calm).is_empty(), "no bound of its own: never deleted for the budget");
    // It grows until the card is short (3 GiB free, the neighbour owed 10 GiB): pressure, the node's 60 s bound.
    let all = refused_run(&mut node, 20_250, 120_000, &[47 * GI, 30 * GI]);
    let gone = deletes(&all);
    assert_eq!(gone.len(), 1, "{gone:?}");
    assert_eq!(gone[0].1, "grower");
    assert!((80_250..=90_250).contains(&gone[0].0), "deleted at {} ms, pressure from 20 250", gone[0].0);
    assert!(all.iter().all(
        |(_, a)| !matches!(a, Action::Evict { pod, .. } | Action::Delete { pod, .. } if &*pod.name == "neighbour")
    ));
}

/// An eviction names the generation of the spec it acted under, so one taken under a spec since edited (a node
/// still reading a mirror that lags) is told as such.
#[test]
fn an_eviction_names_the_spec_generation_it_acted_under() {
    let mut b = budgets();
    b[0].metadata.generation = Some(7);
    b[0].spec.over_limit_seconds = 0;
    let mut node = Node::with_budgets(vec![view("grower", "grower", "", "")], &b);
    let all: Vec<Action> = (0..4).flat_map(|k| node.tick(k * 250, &[9 * GI], 0)).collect();
    let note = note_of(&all, Reason::Evicting).expect("evicting");
    assert!(note.ends_with("; under generation 7 of budget team-a/grower"), "{note}");
}

fn node_notes(actions: &[Action], wanted: NodeReason) -> Vec<String> {
    actions
        .iter()
        .filter_map(|a| match a {
            Action::NodeEvent { reason, note } if *reason == wanted => Some(note.clone()),
            _ => None,
        })
        .collect()
}

/// #52: a pod alone on its GPU holding 95 % of it (vLLM at `--gpu-memory-utilization 0.95`, TensorFlow) is never
/// evicted for pressure, whatever its budget or none (the default `Ranked` policy): there is no neighbour to
/// protect. Ten minutes of ticks; the Node is told once, and why.
#[test]
fn a_pod_alone_holding_most_of_its_gpu_is_never_relieved() {
    for (app, name) in [("none", "vllm"), ("grower", "grower")] {
        let mut node = Node::new(vec![view(name, app, "", "")]);
        assert_eq!(node.enforcer.settings.unbudgeted_pods, Unbudgeted::Ranked);
        let all: Vec<Action> = (0..2_400).flat_map(|k| node.tick(k * 250, &[77 * GI], 0)).collect();
        assert!(evicted(&all).is_empty(), "{name}: {:#?}", evicted(&all));
        assert!(!all.iter().any(|a| matches!(a, Action::Delete { .. })));
        assert!(node.enforcer.under_pressure(0), "3Gi free of 80Gi is pressure, but harms no one");
        let told = node_notes(&all, NodeReason::FullNoneHarmed);
        assert_eq!(told.len(), 1, "{told:?}");
        assert!(told[0].contains("one pod holds it alone") && told[0].contains(&format!("team-a/{name} 77Gi")));
        assert!(note_of(&all, Reason::Evicting).is_none());
    }
}

/// #52: a preallocating pod (no budget) beside a neighbour whose guarantee still fits in what is free (it holds
/// its 8Gi limit, or is 1Gi short with 3Gi free) is left alone; beside a neighbour that does not fit (owed 10Gi,
/// 3Gi free) it is relieved.
#[test]
fn a_preallocator_beside_a_neighbour_that_fits_is_left_alone_and_one_that_does_not_gets_relief() {
    let budgets: Vec<GpuMemoryBudget> = ["small: 8Gi", "large: 40Gi"]
        .iter()
        .map(|s| {
            let (name, limit) = s.split_once(": ").expect("spec");
            serde_yaml::from_str(&format!(
                "apiVersion: gpubudget.io/v1alpha1\nkind: GpuMemoryBudget\nmetadata: {{name: {name}, namespace: team-a}}\n\
                 spec: {{selector: {{matchLabels: {{app: {name}}}}}, limit: {limit}, overLimitSeconds: 600}}"
            ))
            .expect("budget")
        })
        .collect();
    for (app, held, want_evicted) in [("small", 8 * GI, false), ("small", 7 * GI, false), ("large", 30 * GI, true)] {
        let views = vec![view("neighbour", app, "", ""), view("vllm", "none", "", "")];
        let mut node = Node::with_budgets(views, &budgets);
        let vllm = 77 * GI - held;
        let all: Vec<Action> = (0..40).flat_map(|k| node.tick(k * 250, &[held, vllm], 0)).collect();
        let gone = evicted(&all);
        if want_evicted {
            assert_eq!(gone, [("vllm".to_owned(), Some(5))]);
        } else {
            assert!(gone.is_empty(), "{app} at {held}: {gone:?}");
            let told = node_notes(&all, NodeReason::FullNoneHarmed);
            assert!(told.len() == 1 && told[0].contains("fits in what is free"), "{told:?}");
        }
    }
}

/// #52: `action: Warn` keeps a pod from eviction for its own limit, not from pressure relief: a Warn grower
/// (limit 10Gi, request 1Gi) at 50Gi beside a pod within its Evict budget (limit and request 30Gi) at 28Gi, 2Gi
/// free, is evicted; the neighbour never is. The event says why Warn did not keep it.
#[test]
fn a_warn_grower_is_relieved_when_its_neighbour_is_short() {
    let budgets: Vec<GpuMemoryBudget> =
        [("warn", "limit: 10Gi, request: 1Gi, action: Warn"), ("serve", "limit: 30Gi, request: 30Gi")]
            .iter()
            .map(|(name, spec)| {
                serde_yaml::from_str(&format!(
            "apiVersion: gpubudget.io/v1alpha1\nkind: GpuMemoryBudget\nmetadata: {{name: {name}, namespace: team-a}}\n\
                 spec: {{selector: {{matchLabels: {{app: {name}}}}}, {spec}, overLimitSeconds: 600}}"
        ))
        .expect("budget")
            })
            .collect();
    let mut node = Node::with_budgets(vec![view("grower", "warn", "", ""), view("serve", "serve", "", "")], &budgets);
    let all: Vec<Action> = (0..20).flat_map(|k| node.tick(k * 250, &[50 * GI, 28 * GI], 0)).collect();
    assert_eq!(evicted(&all), [("grower".to_owned(), Some(5))]);
    let note = note_of(&all, Reason::Evicting).expect("told");
    assert!(
        note.contains("its budget's action is Warn, which does not keep memory a neighbour is guaranteed"),
        "{note}"
    );
    assert!(note.contains("pods within their guarantee there are owed 2Gi"), "{note}");
    // Alone (the neighbour gone), the same Warn pod is left alone however full the card.
    let mut alone = Node::with_budgets(vec![view("grower", "warn", "", "")], &budgets);
    let all: Vec<Action> = (0..20).flat_map(|k| alone.tick(k * 250, &[78 * GI], 0)).collect();
    assert!(evicted(&all).is_empty(), "{all:#?}");
}

/// The flapping neighbour of #52: an administrator's 40Gi budget (overLimitSeconds far away) over a pod holding
/// 70Gi behind a PodDisruptionBudget (every eviction refused), node bound 20 s; the neighbour (its own 40Gi
/// budget) alternates 12 s at 8Gi (2Gi free) and 14 s at nothing, as one that meets CUDA OOM, frees and
/// restarts. The bound counts the pressure in all: deleted in the second episode, once 20 s of pressure have
/// passed, not never (the clock no longer restarts with each episode).
#[test]
fn the_bound_counts_pressure_across_episodes_of_a_flapping_neighbour() {
    let mut node = Node::new(vec![view("hog", "n", "", ""), view("neighbour", "n", "", "")]);
    node.enforcer.settings.pressure_blocked_timeout_ms = 20_000;
    let mut all = Vec::new();
    for cycle in 0..5u64 {
        let start = cycle * 26_000;
        all.extend(refused_run(&mut node, start, start + 11_750, &[70 * GI, 8 * GI]));
        all.extend(refused_run(&mut node, start + 12_000, start + 25_750, &[70 * GI, 0]));
        if !deletes(&all).is_empty() {
            break;
        }
    }
    let gone = deletes(&all);
    assert_eq!(gone.len(), 1, "{gone:?}");
    assert_eq!(gone[0].1, "hog");
    // 11.75 s of pressure in the first episode (counted from the first refusal), 8.25 s more from 26 s.
    assert!((34_000..=35_000).contains(&gone[0].0), "deleted at {} ms", gone[0].0);
    let note = deleting_note(&all);
    assert!(note.contains("short of its guarantee for 20s in all"), "{note}");
    assert!(all.iter().all(|(_, a)| !matches!(a, Action::Evict { pod, .. } if &*pod.name == "neighbour")));
}

/// The refusals are forgotten when the pod is back within its guarantee, or after ten minutes in which its GPU
/// harmed no one: then the bound counts afresh.
#[test]
fn refused_pressure_is_forgotten_within_the_guarantee_or_after_a_quiet_window() {
    for (quiet_bytes, quiet_ms) in [([30 * GI, 8 * GI], 30_000), ([70 * GI, 0], 601_000)] {
        let mut node = Node::new(vec![view("hog", "n", "", ""), view("neighbour", "n", "", "")]);
        node.enforcer.settings.pressure_blocked_timeout_ms = 20_000;
        let mut all = refused_run(&mut node, 0, 11_750, &[70 * GI, 8 * GI]);
        // Within its 40Gi (and no pressure), or over it with nobody harmed, for a while.
        all.extend(refused_run(&mut node, 12_000, 12_000 + quiet_ms, &quiet_bytes));
        let again = 12_250 + quiet_ms;
        all.extend(refused_run(&mut node, again, again + 30_000, &[70 * GI, 8 * GI]));
        let gone = deletes(&all);
        assert_eq!(gone.len(), 1, "{gone:?}");
        assert!(
            gone[0].0 >= again + 20_000,
            "{quiet_bytes:?}: deleted {} ms after pressure came back",
            gone[0].0 - again
        );
    }
}
