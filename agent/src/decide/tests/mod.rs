use std::sync::Arc;

use gpubudget_common::BudgetState;
use gpubudget_common::pod_record::PodRecord;

use super::*;
use crate::attribute::PodUsage;
use crate::attribute::pods::{PodTable, PodView};
use crate::attribute::usage::Holder;
use crate::sample::{DeviceMemory, GpuReading};
use crate::sample::{GpuInfo, Snapshot};
use gpubudget_common::GpuMemoryBudget;
use k8s_openapi::api::core::v1::Pod;
use proptest::prelude::*;

const GI: u64 = 1 << 30;
const NODE: &str = "gpu-node-1";

fn budget(extra: &str) -> GpuMemoryBudget {
    serde_yaml::from_str(&format!(
        "apiVersion: gpubudget.io/v1alpha1\nkind: GpuMemoryBudget\nmetadata: {{name: llm, namespace: team-a}}\n\
         spec: {{selector: {{}}, limit: 8Gi{extra}}}"
    ))
    .expect("budget")
}

fn pod(extra_meta: &str, extra_spec: &str) -> PodView {
    let p: Pod = serde_yaml::from_str(&format!(
        "metadata: {{name: llm-0, namespace: team-a, uid: uid-1{extra_meta}}}\n\
         spec: {{nodeName: {NODE}, terminationGracePeriodSeconds: 45, containers: []{extra_spec}}}"
    ))
    .expect("pod");
    PodView::from_pod(&p).expect("view")
}

fn table(view: PodView, budgets: &[GpuMemoryBudget]) -> PodTable {
    PodTable::build([view], budgets, Some(NODE))
}

fn gpus() -> Vec<GpuInfo> {
    vec![GpuInfo { label: "0".into(), ..GpuInfo::default() }]
}

fn usage(bytes: u64) -> Vec<PodUsage> {
    vec![PodUsage {
        total: bytes,
        holders: vec![Holder {
            container: Some(Arc::from("trainer")),
            pid: Some(4242),
            gpu: 0,
            bytes,
            mps_client: None,
        }],
        unknown: 0,
    }]
}

fn at(ms: u64) -> Now {
    Now { mono_ms: ms, wall: jiff::Timestamp::from_second(1_800_000_000 + (ms / 1000) as i64).expect("ts") }
}

/// Runs ticks, feeding back success for every write and `evict` for every eviction; returns all actions.
struct Harness {
    enforcer: Enforcer,
    table: PodTable,
    evict: Box<dyn FnMut() -> EvictOutcome>,
    write_ok: bool,
}

impl Harness {
    fn new(view: PodView, budgets: &[GpuMemoryBudget]) -> Self {
        Self {
            enforcer: Enforcer::new(Settings::new(NODE)),
            table: table(view, budgets),
            evict: Box::new(|| EvictOutcome::Accepted),
            write_ok: true,
        }
    }

    fn tick(&mut self, ms: u64, bytes: u64) -> Vec<Action> {
        let mut out = Vec::new();
        self.enforcer.tick(at(ms), &self.table, &usage(bytes), &gpus(), &mut out);
        let mut feedback = Vec::new();
        for a in &out {
            match a {
                Action::Apply { pod, record, .. } => feedback.push(Feedback::Written {
                    uid: pod.uid.clone(),
                    record: Some(record.clone()),
                    ok: self.write_ok,
                }),
                Action::Clear { pod } => {
                    feedback.push(Feedback::Written { uid: pod.uid.clone(), record: None, ok: self.write_ok })
                }
                Action::Evict { pod, .. } => {
                    feedback.push(Feedback::Evicted { uid: pod.uid.clone(), outcome: (self.evict)() })
                }
                // No PodDisruptionBudget stops a delete.
                Action::Delete { pod, .. } => {
                    feedback.push(Feedback::Evicted { uid: pod.uid.clone(), outcome: EvictOutcome::Accepted })
                }
                _ => {}
            }
        }
        for f in feedback {
            self.enforcer.feedback(at(ms), f, &mut out);
        }
        out
    }

    /// Ticks every 250 ms from `from` to `to` (inclusive) at a constant usage.
    fn run(&mut self, from: u64, to: u64, bytes: u64) -> Vec<Action> {
        (from..=to).step_by(250).flat_map(|ms| self.tick(ms, bytes)).collect()
    }
}

fn kinds(actions: &[Action]) -> Vec<String> {
    actions
        .iter()
        .map(|a| match a {
            Action::Transition { from, to, .. } => format!("{from}->{to}"),
            Action::Apply { record, .. } => format!("apply:{}", record.state),
            Action::Clear { .. } => "clear".into(),
            Action::Event { reason, .. } => reason.as_str().into(),
            Action::ContainerEvent { container, reason, .. } => format!("{container}:{}", reason.as_str()),
            Action::Evict { grace_seconds, .. } => format!("evict:{grace_seconds:?}"),
            Action::NodeEvent { reason, .. } => format!("node:{}", reason.as_str()),
            Action::Delete { grace_seconds, .. } => format!("delete:{grace_seconds:?}"),
            Action::WouldEvict { cause, set_by, .. } => format!("would-evict:{}:{}", cause.as_str(), set_by.as_str()),
        })
        .collect()
}

fn evicts(actions: &[Action]) -> usize {
    actions.iter().filter(|a| matches!(a, Action::Evict { .. })).count()
}

fn writes(actions: &[Action]) -> usize {
    actions.iter().filter(|a| matches!(a, Action::Apply { .. } | Action::Clear { .. })).count()
}

fn notes(actions: &[Action]) -> Vec<&str> {
    actions.iter().filter_map(|a| if let Action::Event { note, .. } = a { Some(note.as_str()) } else { None }).collect()
}

#[test]
fn climbs_to_evicting_in_the_contract_order() {
    let mut h = Harness::new(pod("", ""), &[budget(", evictionGracePeriodSeconds: 30")]);
    let first = h.tick(0, GI);
    assert_eq!(kinds(&first), ["apply:Within"], "a new pod's record is written once");
    // A move among Within, Near and Over is written 5 s after the last write at the soonest.
    let near = h.tick(250, 7_800_000_000);
    assert_eq!(kinds(&near), ["Within->Near", "GpuMemoryNearBudget"], "decided and told at once, written later");
    assert_eq!(kinds(&h.run(500, 4_750, 7_800_000_000)), Vec::<String>::new());
    assert_eq!(kinds(&h.tick(5_000, 7_800_000_000)), ["apply:Near"]);
    let over = h.tick(10_000, 9 * GI);
    assert_eq!(kinds(&over), ["Near->Over", "GpuMemoryOverBudget", "apply:Over"]);
    assert!(notes(&over)[0].starts_with("using 9Gi of 8Gi (budget team-a/llm); evicting if it stays over for 10s; held by trainer (pid 4242, GPU 0) 9Gi"), "{:?}", notes(&over));
    assert!(h.run(10_250, 19_750, 9 * GI).is_empty(), "nothing while the timer runs");
    let evicting = h.tick(20_000, 9 * GI);
    assert_eq!(kinds(&evicting), ["Over->Evicting", "apply:Evicting", "EvictingForGpuMemory"]);
    let Action::Apply { record, .. } = &evicting[1] else { panic!("apply") };
    assert_eq!(record.eviction_requested_at.as_deref(), Some("2027-01-15T08:00:20Z"));
    assert_eq!(&*record.node, NODE);
    assert_eq!(
        notes(&evicting)[0],
        "using 9Gi of 8Gi (budget team-a/llm) for 10s; evicting with 30s grace; held by trainer (pid 4242, GPU 0) 9Gi"
    );
    // The request follows once the record that says so has landed (the harness answers at once).
    assert_eq!(kinds(&h.tick(20_250, 9 * GI)), ["evict:Some(30)"]);
    // Accepted: never again, however long it stays over.
    let after = h.run(20_500, 120_000, 9 * GI);
    assert_eq!(evicts(&after), 0);
    assert_eq!(writes(&after), 0, "usage unchanged: no write");
}

#[test]
fn grace_defaults_to_the_pods_own_capped_at_30s() {
    let grace = |pod_grace: &str| {
        let mut view = pod("", "");
        view.termination_grace_seconds = pod_grace.parse().ok();
        let mut h = Harness::new(view, &[budget(", overLimitSeconds: 0")]);
        let mut out = h.tick(0, 9 * GI);
        out.extend(h.tick(250, 9 * GI));
        let evict = kinds(&out).into_iter().find(|k| k.starts_with("evict:")).expect("evicted");
        let note = notes(&out).into_iter().find(|n| n.contains("evicting with")).expect("note").to_owned();
        (evict, note)
    };
    let (evict, note) = grace("20");
    assert_eq!(evict, "evict:Some(20)");
    assert!(note.contains("evicting with the pod's 20s grace"), "{note}");
    // #11: a pod asking for an hour does not hold its memory for an hour.
    let (evict, note) = grace("3600");
    assert_eq!(evict, "evict:Some(30)");
    assert!(
        note.contains("evicting with 30s grace (the pod asks for 3600s; capped when the budget sets none)"),
        "{note}"
    );
}

#[test]
fn usage_alone_never_rewrites_the_record() {
    // #34: a pod's record moves with its state, budget or eviction; usage goes to the node's GpuNodeUsage.
    let mut h = Harness::new(pod("", ""), &[budget("")]);
    let first = h.tick(0, 4 * GI);
    assert_eq!(writes(&first), 1);
    let Some(Action::Apply { record, .. }) = first.first() else { panic!("{:?}", kinds(&first)) };
    assert_eq!((record.state, record.usage_bytes), (BudgetState::Within, 4 * GI), "the usage of the write");
    // Usage moving by 10–50 % for ten minutes, within the limit: no write at all.
    let moving: Vec<Action> = (1..2400u64).flat_map(|i| h.tick(i * 250, 4 * GI + (i % 5) * GI / 2)).collect();
    assert!(moving.is_empty(), "{:?}", kinds(&moving));
    // Near the limit (90 % of 8 GiB): the state moved, so the record is written, once.
    let near = h.run(2400 * 250, 2400 * 250 + 60_000, 7 * GI + GI / 2);
    assert_eq!(writes(&near), 1, "{:?}", kinds(&near));
}

#[test]
fn a_state_change_right_after_a_write_waits_for_the_spacing() {
    let mut h = Harness::new(pod("", ""), &[budget(", action: Warn")]);
    assert_eq!(writes(&h.tick(0, GI)), 1);
    assert_eq!(writes(&h.tick(250, 2 * GI)), 0, "usage alone: never");
    assert_eq!(writes(&h.tick(30_000, 2 * GI)), 0, "usage alone, 30 s later: never");
    assert_eq!(writes(&h.tick(30_250, 7 * GI + GI / 2)), 1, "Near: the last write was 30 s ago");
    assert_eq!(writes(&h.tick(30_500, 9 * GI)), 0, "Over 250 ms after the last write waits");
    assert_eq!(writes(&h.run(30_750, 35_000, 9 * GI)), 0);
    assert_eq!(writes(&h.tick(35_250, 9 * GI)), 1, "… 5 s after it");
}

#[test]
fn warn_critical_terminating_and_foreign_pods_are_never_evicted() {
    let cases = [
        (pod("", ""), budget(", action: Warn, overLimitSeconds: 0")),
        (pod("", ", priorityClassName: system-node-critical"), budget(", overLimitSeconds: 0")),
        (pod("", ", priority: 2000000001"), budget(", overLimitSeconds: 0")),
        (pod(", deletionTimestamp: '2026-01-01T00:00:00Z'", ""), budget(", overLimitSeconds: 0")),
        // A static pod's mirror (#11): evicting it would delete only the mirror.
        (
            pod(", annotations: {kubernetes.io/config.mirror: 0123456789abcdef0123456789abcdef}", ""),
            budget(", overLimitSeconds: 0"),
        ),
    ];
    for (view, b) in cases {
        let name = format!("{view:?}");
        let mut h = Harness::new(view, &[b]);
        // Critical priority exempts in the namespaces the administrator lists (#33): here, the pod's.
        h.enforcer.settings.critical_namespaces = "kube-system,team-a".parse().expect("valid");
        let out = h.run(0, 60_000, 20 * GI);
        assert_eq!(evicts(&out), 0, "{name}");
        assert!(!notes(&out).iter().any(|n| n.contains("evicting with")), "{name}");
    }
    // A pod of another node (as if a watch leaked one) is never acted on.
    let mut other = pod("", "");
    other.node = Some("elsewhere".into());
    let mut enforcer = Enforcer::new(Settings::new(NODE));
    let t = PodTable::build([other], &[budget(", overLimitSeconds: 0")], None);
    let mut out = Vec::new();
    for ms in (0..20_000).step_by(250) {
        enforcer.tick(at(ms), &t, &usage(20 * GI), &gpus(), &mut out);
    }
    assert_eq!(evicts(&out), 0);
    // Warn and critical messages say so.
    let mut h = Harness::new(pod("", ""), &[budget(", action: Warn")]);
    assert!(notes(&h.tick(0, 9 * GI))[0].contains("action is Warn: not evicted for being over its limit"));
    let mut h = Harness::new(pod("", ", priorityClassName: system-cluster-critical"), &[budget("")]);
    h.enforcer.settings.critical_namespaces = "team-a".parse().expect("valid");
    assert!(notes(&h.tick(0, 9 * GI))[0].contains("critical and is never evicted"));
    let mut h = Harness::new(pod(", annotations: {kubernetes.io/config.mirror: abc}", ""), &[budget("")]);
    assert!(notes(&h.tick(0, 9 * GI))[0].contains("static pod (evicting its mirror would delete only the mirror)"));
}

/// #33: critical priority in a namespace the administrator does not list (a tenant's, by default every
/// namespace but kube-system) exempts nothing: the pod is evicted over its budget like any other, and the
/// events say why.
#[test]
fn a_tenants_critical_pod_is_enforced_like_any_other_and_told_why() {
    for spec in [
        ", priorityClassName: system-node-critical",
        ", priorityClassName: system-cluster-critical",
        ", priority: 2000000001",
    ] {
        let mut h = Harness::new(pod("", spec), &[budget(", overLimitSeconds: 1")]);
        assert_eq!(h.enforcer.settings.critical_namespaces, gpubudget_common::CriticalNamespaces::default());
        let out = h.run(0, 3_000, 20 * GI);
        assert_eq!(evicts(&out), 1, "{spec}: {:?}", kinds(&out));
        let over = notes(&out).into_iter().find(|n| n.contains("evicting if it stays over")).expect("over event");
        assert!(over.contains("critical priority exempts only pods of the namespaces the administrator lists (criticalNamespaces: kube-system)"), "{over}");
        let evicting = notes(&out).into_iter().find(|n| n.contains("evicting with")).expect("evicting event");
        assert!(evicting.contains("so it is enforced like any other"), "{evicting}");
    }
}

#[test]
fn blocked_evictions_retry_with_backoff_one_at_a_time() {
    let mut h = Harness::new(pod("", ""), &[budget(", overLimitSeconds: 0")]);
    h.evict =
        Box::new(|| EvictOutcome::Blocked("Cannot evict pod as it would violate the pod's disruption budget.".into()));
    assert_eq!(evicts(&h.tick(0, 9 * GI)), 0, "the record first");
    let first = h.tick(250, 9 * GI);
    assert_eq!(evicts(&first), 1);
    let blocked: Vec<&str> = notes(&first).into_iter().filter(|n| n.starts_with("eviction refused")).collect();
    assert_eq!(
        blocked,
        [
            "eviction refused: Cannot evict pod as it would violate the pod's disruption budget.; using 9Gi of 8Gi (budget team-a/llm); retrying in 5s"
        ]
    );
    assert!(kinds(&first).contains(&"GpuMemoryEvictionBlocked".to_owned()));
    // Retries at 5 s, 15 s (5+10), 35 s (+20), 75 s (+40), then every 60 s.
    let mut times = Vec::new();
    for ms in (500..=200_250).step_by(250) {
        if evicts(&h.tick(ms, 9 * GI)) > 0 {
            times.push(ms - 250);
        }
    }
    assert_eq!(times, [5_000, 15_000, 35_000, 75_000, 135_000, 195_000]);

    // One in flight: while a request is out, none other is made.
    let mut enforcer = Enforcer::new(Settings::new(NODE));
    let t = table(pod("", ""), &[budget(", overLimitSeconds: 0")]);
    let mut out = Vec::new();
    for ms in (0..60_000).step_by(250) {
        let start = out.len();
        enforcer.tick(at(ms), &t, &usage(9 * GI), &gpus(), &mut out);
        // The records land; the eviction request gets no answer.
        let written: Vec<Feedback> = out[start..]
            .iter()
            .filter_map(|a| match a {
                Action::Apply { pod, record, .. } => {
                    Some(Feedback::Written { uid: pod.uid.clone(), record: Some(record.clone()), ok: true })
                }
                _ => None,
            })
            .collect();
        for f in written {
            enforcer.feedback(at(ms), f, &mut out);
        }
    }
    assert_eq!(evicts(&out), 1, "no feedback yet: still in flight");
    out.clear();
    enforcer.feedback(
        at(60_000),
        Feedback::Evicted { uid: Arc::from("uid-1"), outcome: EvictOutcome::Failed("timeout".into()) },
        &mut out,
    );
    assert_eq!(kinds(&out), ["GpuMemoryEvictionBlocked"], "every refusal is told");
    assert!(notes(&out)[0].starts_with("eviction refused: timeout;"), "{:?}", notes(&out));
    out.clear();
    enforcer.tick(at(64_000), &t, &usage(9 * GI), &gpus(), &mut out);
    assert_eq!(evicts(&out), 0);
    enforcer.tick(at(65_000), &t, &usage(9 * GI), &gpus(), &mut out);
    assert_eq!(evicts(&out), 1);
}

/// A PodDisruptionBudget that never allows a disruption (`maxUnavailable: 0`, or two of them: the API's
/// 500) holds the memory for as long as it refuses, unless the budget sets `blockedEvictionTimeoutSeconds`:
/// once evictions were refused that long, the pod is deleted with the eviction's grace period (#11).
#[test]
fn evictions_refused_past_the_timeout_delete_the_pod() {
    let mut h = Harness::new(
        pod("", ""),
        &[budget(", overLimitSeconds: 0, evictionGracePeriodSeconds: 20, blockedEvictionTimeoutSeconds: 60")],
    );
    h.evict = Box::new(|| {
        EvictOutcome::Blocked(
            "This pod has more than one PodDisruptionBudget, which the eviction subresource does not support.".into(),
        )
    });
    h.tick(0, 9 * GI);
    let mut all = Vec::new();
    let mut deleted_at = None;
    for ms in (250..=120_000).step_by(250) {
        let out = h.tick(ms, 9 * GI);
        if out.iter().any(|a| matches!(a, Action::Delete { .. })) {
            deleted_at.get_or_insert(ms);
        }
        all.extend(out);
    }
    // Refused first at 250 ms; retries at 5 s, 15 s, 35 s; deleted at 60 s after the first refusal, between
    // two retries (the backoff does not postpone it).
    assert_eq!(deleted_at, Some(60_250), "{:?}", kinds(&all));
    assert_eq!(all.iter().filter(|a| matches!(a, Action::Delete { .. })).count(), 1);
    let delete = all.iter().position(|a| matches!(a, Action::Delete { .. })).expect("delete");
    assert_eq!(kinds(&all[delete - 1..=delete]), ["DeletingForGpuMemory", "delete:Some(20)"]);
    assert!(
        notes(&all[delete - 1..delete])[0].starts_with(
            "evictions refused for 60s (blockedEvictionTimeoutSeconds 60): deleting the pod with 20s grace"
        ),
        "{:?}",
        notes(&all[delete - 1..delete])
    );
    assert_eq!(evicts(&all), 4, "refused at 0.25, 5.25, 15.25, 35.25 s");
    // Without the field, PodDisruptionBudgets are respected for ever.
    let mut h = Harness::new(pod("", ""), &[budget(", overLimitSeconds: 0")]);
    h.evict = Box::new(|| EvictOutcome::Blocked("pdb".into()));
    let all = h.run(0, 600_000, 9 * GI);
    assert!(!all.iter().any(|a| matches!(a, Action::Delete { .. })), "{:?}", kinds(&all));
}

/// #11 scenario 6: a budget edit does not act on time already spent over the limit. Switching Warn → Evict,
/// or lowering overLimitSeconds, while a pod has been over for a minute, starts the period afresh (an
/// event says so) instead of evicting on the next sample.
#[test]
fn a_budget_edit_starts_the_period_afresh() {
    for (before, after) in [
        (", action: Warn, overLimitSeconds: 10", ", action: Evict, overLimitSeconds: 10"),
        (", overLimitSeconds: 600", ", overLimitSeconds: 10"),
    ] {
        let mut h = Harness::new(pod("", ""), &[budget(before)]);
        let out = h.run(0, 60_000, 9 * GI);
        assert_eq!(evicts(&out), 0, "{before}");
        h.table = table(pod("", ""), &[budget(after)]);
        let edited = h.tick(60_250, 9 * GI);
        assert_eq!(evicts(&edited), 0, "{before} → {after}: {:?}", kinds(&edited));
        assert!(kinds(&edited).contains(&"GpuMemoryBudgetChanged".to_owned()), "{:?}", kinds(&edited));
        let note = notes(&edited).into_iter().find(|n| n.starts_with("budget team-a/llm changed")).expect("note");
        assert!(note.contains("the over-limit period starts afresh"), "{note}");
        // A full overLimitSeconds after the edit, not before.
        assert_eq!(evicts(&h.run(60_500, 70_000, 9 * GI)), 0, "{before} → {after}");
        assert_eq!(evicts(&h.run(70_250, 70_500, 9 * GI)), 1, "{before} → {after}");
    }
    // An edit while under the limit has nothing to say.
    let mut h = Harness::new(pod("", ""), &[budget(", overLimitSeconds: 10")]);
    h.run(0, 5_000, 2 * GI);
    h.table = table(pod("", ""), &[budget(", overLimitSeconds: 5")]);
    assert!(!kinds(&h.tick(5_250, 2 * GI)).contains(&"GpuMemoryBudgetChanged".to_owned()));
}

/// #11: the eviction check (nodeRestriction's webhook) refusing or unreachable is named as such.
#[test]
fn an_unreachable_eviction_check_is_named() {
    let mut h = Harness::new(pod("", ""), &[budget(", overLimitSeconds: 0")]);
    h.evict = Box::new(|| {
        EvictOutcome::Failed(
            "Internal error occurred: failed calling webhook \"evictions.gpubudget.io\": connection refused".into(),
        )
    });
    let out = h.run(0, 500, 9 * GI);
    let blocked: Vec<&str> = notes(&out).into_iter().filter(|n| n.starts_with("eviction refused")).collect();
    assert_eq!(blocked.len(), 1, "{:?}", kinds(&out));
    assert!(blocked[0].contains("could not be reached: is the operator up?"), "{blocked:?}");
}

#[test]
fn a_blocked_eviction_stops_when_usage_comes_back() {
    let mut h = Harness::new(pod("", ""), &[budget(", overLimitSeconds: 0")]);
    h.evict = Box::new(|| EvictOutcome::Blocked("PDB".into()));
    assert_eq!(evicts(&h.tick(0, 9 * GI)), 0);
    assert_eq!(evicts(&h.tick(250, 9 * GI)), 1);
    let back = h.tick(500, 2 * GI);
    assert_eq!(kinds(&back), ["Evicting->Within", "GpuMemoryWithinBudget", "apply:Within"]);
    // #11: no eviction happened, so the record no longer says one was requested (a later deletion of the
    // pod for another reason must not be counted as an eviction).
    let Action::Apply { record, .. } = &back[2] else { panic!("apply") };
    assert_eq!(record.eviction_requested_at, None);
    assert_eq!(evicts(&h.run(750, 60_000, 2 * GI)), 0);
    // Over again: the timer and the request start afresh (record first, then the request).
    assert_eq!(evicts(&h.tick(60_250, 9 * GI)), 0);
    assert_eq!(evicts(&h.tick(60_500, 9 * GI)), 1);
}

#[test]
fn a_restart_repeats_no_event_and_never_evicts_earlier() {
    let annotations = ", annotations: {gpubudget.io/state: Over, gpubudget.io/usage-bytes: '9663676416', \
                       gpubudget.io/budget: llm, gpubudget.io/node: gpu-node-1}";
    let mut h = Harness::new(pod(annotations, ""), &[budget("")]);
    let first = h.tick(0, 9 * GI);
    assert!(first.is_empty(), "same state, usage within 5 %: nothing to say or write: {:?}", kinds(&first));
    assert_eq!(evicts(&h.run(250, 9_750, 9 * GI)), 0, "the timer starts at the restart");
    assert_eq!(evicts(&h.tick(10_000, 9 * GI)), 0, "due: the record goes first");
    assert_eq!(evicts(&h.tick(10_250, 9 * GI)), 1);
    // A record written by another node's agent is not ours: no seeding from it.
    let foreign = annotations.replace("gpu-node-1", "gpu-node-9");
    let mut h = Harness::new(pod(&foreign, ""), &[budget("")]);
    assert_eq!(kinds(&h.tick(0, 9 * GI)), ["Within->Over", "GpuMemoryOverBudget", "apply:Over"]);
}

#[test]
fn an_unreadable_share_is_told_once_and_the_pod_held_to_the_budgets_limit() {
    use gpubudget_common::share::Declaration;
    let mut view = pod("", "");
    view.share = Declaration::invalid(
        gpubudget_common::share::ShareSource::KaiFraction,
        "gpu-fraction: \"1e400\" is not a decimal greater than 0 and at most 1",
    );
    let mut h = Harness::new(view, &[budget(", share: {}")]);
    let told = |out: &[Action]| {
        out.iter()
            .filter_map(|a| match a {
                Action::Event { reason: Reason::ShareUnresolved, note, .. } => Some(note.clone()),
                _ => None,
            })
            .collect::<Vec<_>>()
    };
    let out = h.tick(0, GI);
    let first = told(&out);
    assert_eq!(first.len(), 1);
    // The record says so too: status counts the pod unresolved, `why` and `top` show the reason.
    let held = out.iter().find_map(|a| if let Action::Apply { record, .. } = a { record.share.clone() } else { None });
    let held = held.expect("the record carries the share");
    assert!(!held.resolved() && held.limit_bytes == 8 * GI && held.note.contains("\"1e400\""), "{held:?}");
    assert!(first[0].contains("\"1e400\" is not a decimal") && first[0].contains("held to the budget's limit 8Gi"));
    assert!((1..40).all(|i| told(&h.tick(i * 250, GI)).is_empty()), "told once");
    assert_eq!(h.table.budget(0).map(|b| b.limit_bytes), Some(8 * GI), "held to the budget's limit");
    // Before the node's GPUs are known a fraction is unresolved too, but that is the agent's moment, not the pod's.
    use gpubudget_common::share::ShareSource;
    let mut view = pod("", "");
    view.share = Declaration::Share(vec![gpubudget_common::share::Term {
        source: ShareSource::KaiFraction,
        amount: gpubudget_common::share::Amount::PerMillion(500_000),
        devices: 1,
    }]);
    let mut h = Harness::new(view.clone(), &[budget(", share: {}")]);
    assert!(told(&h.tick(0, GI)).is_empty());
    // Once the GPU's size is known, the share is the pod's limit, and its record says how it came.
    let wide: GpuMemoryBudget = serde_yaml::from_str(
        "apiVersion: gpubudget.io/v1alpha1\nkind: GpuMemoryBudget\nmetadata: {name: llm, namespace: team-a}\n\
         spec: {selector: {}, limit: 80Gi, share: {}}",
    )
    .expect("budget");
    let index = crate::attribute::budgets::BudgetIndex::of([&wide]);
    h.table = PodTable::from_index([view], &index, &Default::default(), Some(NODE), &[80 * GI]);
    let out = h.tick(250, 41 * GI);
    assert_eq!(kinds(&out), ["Within->Over", "GpuMemoryOverBudget"], "written 5 s after the last write");
    assert!(notes(&out)[0].starts_with("using 41Gi of 40Gi"), "{:?}", notes(&out));
    let written = h.tick(5_000, 41 * GI);
    let Some(Action::Apply { record, .. }) = written.last() else { panic!("apply: {:?}", kinds(&written)) };
    let held = record.share.as_ref().expect("the record carries the share");
    assert_eq!((held.limit_bytes, held.sources.as_slice()), (40 * GI, &[ShareSource::KaiFraction][..]));
    assert_eq!(held.note, "KAI gpu-fraction 0.5 of 80Gi = 40Gi");
}

#[test]
fn events_are_not_repeated_within_the_cooldown() {
    let mut h = Harness::new(pod("", ""), &[budget(", action: Warn")]);
    let mut out = Vec::new();
    for i in 0..40u64 {
        // Over, then well under, every 1.5 s: 40 crossings in a minute.
        out.extend(h.tick(i * 1500, if i % 2 == 0 { 9 * GI } else { GI }));
    }
    let transitions = out.iter().filter(|a| matches!(a, Action::Transition { .. })).count();
    assert_eq!(transitions, 40, "every crossing is a decision");
    let over_events = out.iter().filter(|a| matches!(a, Action::Event { reason: Reason::OverBudget, .. })).count();
    assert_eq!(over_events, 1, "one OverBudget event per minute");
    // Written: the first record at 0, then a crossing only 5 s after the last write at the soonest; with
    // one every 1.5 s that is every 7.5 s (0, 7.5, …, 52.5 s), not 40 times.
    assert_eq!(writes(&out), 8, "a pod swinging across its limit cannot make its node write every tick");
}

#[test]
fn losing_the_budget_clears_the_record_once() {
    let annotations = ", annotations: {gpubudget.io/state: Near, gpubudget.io/usage-bytes: '1', \
                       gpubudget.io/budget: llm, gpubudget.io/node: gpu-node-1}";
    let mut h = Harness::new(pod(annotations, ""), &[]);
    assert_eq!(kinds(&h.run(0, 5_000, GI)), ["clear"]);
    // Not ours (no record of this node): left alone.
    let mut h = Harness::new(pod(&annotations.replace("gpu-node-1", "x"), ""), &[]);
    assert!(h.run(0, 5_000, GI).is_empty());
}

#[test]
fn failed_writes_are_retried_with_backoff() {
    let mut h = Harness::new(pod("", ""), &[budget("")]);
    h.write_ok = false;
    let mut times = Vec::new();
    for ms in (0..=20_000).step_by(250) {
        if writes(&h.tick(ms, GI)) > 0 {
            times.push(ms);
        }
    }
    assert_eq!(times, [0, 1_000, 3_000, 7_000, 15_000]);
    h.write_ok = true;
    assert_eq!(writes(&h.run(20_250, 31_000, GI)), 1);
    assert!(h.run(31_250, 100_000, GI).is_empty());
}

/// A record write the tenant can break (#11: annotations filling 256 KiB, a webhook refusing the update) does
/// not hold the eviction: after 3 failed attempts it goes ahead without the record, says so, and the record
/// is still retried while the pod terminates.
#[test]
fn the_eviction_waits_for_its_record_three_attempts_only() {
    let mut h = Harness::new(pod("", ""), &[budget(", overLimitSeconds: 0")]);
    h.tick(0, GI);
    h.write_ok = false;
    let mut evicted_at = None;
    let mut all = Vec::new();
    for ms in (250..=40_000).step_by(250) {
        let out = h.tick(ms, 9 * GI);
        if evicts(&out) > 0 {
            evicted_at.get_or_insert(ms);
        }
        all.extend(out);
    }
    // Attempts at 250 (due), 1 250, 3 250 (backoff 1 s, 2 s): the request follows the third failure.
    assert_eq!(evicted_at, Some(3_500), "{:?}", kinds(&all));
    assert_eq!(evicts(&all), 1, "one request");
    let evict = all.iter().find(|a| matches!(a, Action::Evict { .. })).expect("evict");
    assert!(matches!(evict, Action::Evict { recorded: false, .. }), "{evict:?}");
    let failed: Vec<&str> = all
        .iter()
        .filter_map(|a| match a {
            Action::Event { reason: Reason::RecordNotWritten, note, .. } => Some(note.as_str()),
            _ => None,
        })
        .collect();
    assert_eq!(failed.len(), 1, "{:?}", kinds(&all));
    assert!(failed[0].starts_with("the Evicting record could not be written (3 failed attempts in 3s)"), "{failed:?}");
    // The record is still retried after the eviction (backoff up to 30 s), and lands once the API takes it.
    let retries =
        all.iter().skip_while(|a| !matches!(a, Action::Evict { .. })).filter(|a| matches!(a, Action::Apply { .. }));
    assert!(retries.count() >= 2);
    h.write_ok = true;
    let out = h.run(40_250, 75_000, 9 * GI);
    let landed: Vec<_> = out.iter().filter(|a| matches!(a, Action::Apply { .. })).collect();
    assert_eq!(landed.len(), 1, "{:?}", kinds(&out));
    let Action::Apply { record, .. } = landed[0] else { unreachable!() };
    assert_eq!((record.state, record.eviction_requested_at.is_some()), (BudgetState::Evicting, true));
}

/// A write that hangs rather than fails: the eviction waits for it 30 s at most.
#[test]
fn the_eviction_waits_for_its_record_thirty_seconds_at_most() {
    let mut h = Harness::new(pod("", ""), &[budget(", overLimitSeconds: 0")]);
    h.tick(0, GI);
    // The Evicting apply goes out and no answer comes.
    let mut out = Vec::new();
    h.enforcer.tick(at(250), &h.table, &usage(9 * GI), &gpus(), &mut out);
    assert_eq!(kinds(&out), ["Within->Evicting", "apply:Evicting", "EvictingForGpuMemory"]);
    for ms in (500..30_250).step_by(250) {
        out.clear();
        h.enforcer.tick(at(ms), &h.table, &usage(9 * GI), &gpus(), &mut out);
        assert_eq!(evicts(&out), 0, "{ms} ms");
    }
    out.clear();
    h.enforcer.tick(at(30_250), &h.table, &usage(9 * GI), &gpus(), &mut out);
    assert_eq!(kinds(&out), ["GpuMemoryEvictionRecordFailed", "evict:Some(30)"]);
}

#[test]
fn forgets_pods_that_are_gone() {
    let mut h = Harness::new(pod("", ""), &[budget("")]);
    h.tick(0, GI);
    assert_eq!(h.enforcer.len(), 1);
    let mut out = Vec::new();
    h.enforcer.tick(at(250), &PodTable::default(), &[], &gpus(), &mut out);
    assert!(h.enforcer.is_empty() && out.is_empty());
}

#[test]
fn notes_stay_under_the_api_limit() {
    let holders: Vec<Holder> = (0..50)
        .map(|i| Holder {
            container: Some(Arc::from("c".repeat(300))),
            pid: Some(i),
            gpu: 0,
            bytes: u64::from(i),
            mps_client: None,
        })
        .collect();
    let summary = holders_summary(&holders, &gpus());
    assert!(summary.ends_with("and 45 more"), "{summary}");
    assert!(bounded("é".repeat(2000)).len() <= 1024);
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(300))]

    /// Whatever a tenant does with its usage (a value every 250 ms, Warn so nothing is evicted): its pod's
    /// record is written at most once per `state_min_interval_ms` (plus the first), and once the usage holds
    /// still for that long the record says the state the pod is in.
    #[test]
    fn record_writes_are_spaced_and_end_true(gib in proptest::collection::vec(0u64..12, 1..480)) {
        let mut h = Harness::new(pod("", ""), &[budget(", action: Warn")]);
        let (mut out, mut t) = (Vec::new(), 0);
        for g in &gib {
            out.extend(h.tick(t, g * GI));
            t += 250;
        }
        let spacing = Settings::new(NODE).state_min_interval_ms;
        let bound = 1 + (t / spacing) as usize;
        prop_assert!(writes(&out) <= bound, "{} writes in {} ms", writes(&out), t);
        let last = *gib.last().expect("one at least") * GI;
        for _ in 0..=spacing / 250 {
            out.extend(h.tick(t, last));
            t += 250;
        }
        let state = out.iter().rev().find_map(|a| match a { Action::Transition { to, .. } => Some(*to), _ => None });
        let written = out.iter().rev().find_map(|a| match a { Action::Apply { record, .. } => Some(record.state), _ => None });
        prop_assert_eq!(written, Some(state.unwrap_or(BudgetState::Within)));
    }

    /// Whatever the usage and the API answers: at most one eviction request in flight; an eviction only
    /// as `common::state` promises (`due_is_justified`: over now, and over for overLimitSeconds more than
    /// half the time at or under, in some window); the Evicting record goes out before the first request;
    /// nothing for Warn.
    #[test]
    fn eviction_invariants(
        steps in proptest::collection::vec((0u64..12, any::<bool>(), 0u8..4), 1..300),
        warn in any::<bool>(),
        delay in 0i64..4,
    ) {
        let extra = format!(", overLimitSeconds: {delay}{}", if warn { ", action: Warn" } else { "" });
        let t = table(pod("", ""), &[budget(&extra)]);
        let mut enforcer = Enforcer::new(Settings::new(NODE));
        let mut in_flight = 0usize;
        let mut now = 0u64;
        let mut history: Vec<(u64, u64)> = Vec::new();
        let mut evicting_applied = false;
        for (gib, answer_now, outcome) in steps {
            now += 250;
            let bytes = gib * GI;
            history.push((now, bytes));
            let mut out = Vec::new();
            enforcer.tick(at(now), &t, &usage(bytes), &gpus(), &mut out);
            for a in &out {
                match a {
                    Action::Apply { record, .. } if record.state == BudgetState::Evicting => evicting_applied = true,
                    Action::Evict { .. } => {
                        prop_assert!(!warn);
                        prop_assert!(evicting_applied);
                        in_flight += 1;
                        prop_assert!(in_flight <= 1);
                        let overs: Vec<(u64, bool)> = history.iter().map(|&(at, u)| (at, u > 8 * GI)).collect();
                        prop_assert!(gpubudget_common::state::due_is_justified(&overs, delay as u64 * 1000));
                    }
                    _ => {}
                }
            }
            if answer_now && in_flight > 0 {
                let outcome = match outcome {
                    0 => EvictOutcome::Accepted,
                    1 => EvictOutcome::Blocked("pdb".into()),
                    2 => EvictOutcome::Gone,
                    _ => EvictOutcome::Failed("x".into()),
                };
                in_flight -= 1;
                enforcer.feedback(at(now), Feedback::Evicted { uid: Arc::from("uid-1"), outcome }, &mut out);
            }
            for a in &out {
                if let Action::Apply { pod, record, .. } = a {
                    enforcer.feedback(at(now), Feedback::Written { uid: pod.uid.clone(), record: Some(record.clone()), ok: true }, &mut Vec::new());
                }
            }
        }
    }
}

mod observe;
mod pressure_eviction;

#[test]
fn driver_limits_disagreements_are_told_once_per_pod_per_kind() {
    use super::driver_limits::{Disagreement, DriverView};
    let mut h = Harness::new(pod("", ""), &[budget("")]);
    let told = |out: &[Action]| -> Vec<String> {
        out.iter()
            .filter_map(|a| match a {
                Action::Event { reason: Reason::DriverLimitsDisagree, note, .. } => Some(note.clone()),
                _ => None,
            })
            .collect()
    };
    // Two GPUs with the 8Gi limit each: the driver allows 16Gi.
    let above = DriverView { pairs: 2, hard_pairs: 2, hard_sum: 16 * GI, ..DriverView::default() };
    let mut out = h.tick(0, GI);
    h.enforcer.driver_limits(&h.table, &[Some(above)], &mut out);
    let first = told(&out);
    assert_eq!(first.len(), 1, "{out:?}");
    assert!(first[0].starts_with("driver allows more than the budget") && first[0].contains("budget team-a/llm"));
    assert!(matches!(h.enforcer.driver_disagreement("uid-1"), Some(Disagreement::HardAboveLimit { .. })));
    // Steady, agreeing, then the same kind again: nothing more told.
    let agree = DriverView { pairs: 1, hard_pairs: 1, hard_sum: 8 * GI, ..DriverView::default() };
    for (t, view) in [(250, above), (500, agree), (750, above)] {
        let mut out = h.tick(t, GI);
        h.enforcer.driver_limits(&h.table, &[Some(view)], &mut out);
        assert!(told(&out).is_empty(), "{out:?}");
        if view == agree {
            assert_eq!(h.enforcer.driver_disagreement("uid-1"), None);
        }
    }
    // Another kind is told, once.
    let partly = DriverView { pairs: 2, hard_pairs: 1, hard_sum: 4 * GI, ..DriverView::default() };
    let mut out = h.tick(1_000, GI);
    h.enforcer.driver_limits(&h.table, &[Some(partly)], &mut out);
    assert_eq!(told(&out).len(), 1);
    assert!(told(&out)[0].contains("caps 1 of the pod's 2"));
    // Not read this tick: no verdict, nothing told.
    let mut out = h.tick(1_250, GI);
    h.enforcer.driver_limits(&h.table, &[None], &mut out);
    assert!(told(&out).is_empty());
    assert_eq!(h.enforcer.driver_disagreement("uid-1"), None);
}

#[test]
fn a_pod_the_webhook_capped_but_the_driver_holds_no_limit_for_is_told_once() {
    use super::driver_limits::{Disagreement, DriverView};
    let record = r#"{"budget":"llm","limitMib":8192,"containers":[{"name":"m","devices":1,"env":{"NVIDIA_GPU_MEMORY_LIMIT":"set"}}]}"#;
    let uncapped = DriverView { pairs: 1, ..DriverView::default() };
    let told = |h: &mut Harness, t: u64| -> usize {
        let mut out = h.tick(t, GI);
        h.enforcer.driver_limits(&h.table, &[Some(uncapped)], &mut out);
        out.iter().filter(|a| matches!(a, Action::Event { reason: Reason::DriverLimitsDisagree, .. })).count()
    };
    // Capped at admission: the missing driver limit is told, once.
    let mut h = Harness::new(pod(&format!(", annotations: {{gpubudget.io/caps: '{record}'}}"), ""), &[budget("")]);
    assert_eq!(told(&mut h, 0), 1);
    assert_eq!(h.enforcer.driver_disagreement("uid-1"), Some(Disagreement::Missing));
    assert_eq!(told(&mut h, 250), 0);
    // Not capped at admission: eviction only, nothing to tell.
    let mut h = Harness::new(pod("", ""), &[budget("")]);
    assert_eq!(told(&mut h, 0), 0);
    assert_eq!(h.enforcer.driver_disagreement("uid-1"), None);
}

#[test]
fn the_record_carries_the_drivers_limits_once_known_at_most_as_often_as_usage() {
    use super::driver_limits::DriverView;
    let mut h = Harness::new(pod("", ""), &[budget("")]);
    let applied = |out: &[Action]| -> Vec<Option<gpubudget_common::pod_record::DriverLimitsRecord>> {
        out.iter()
            .filter_map(|a| match a {
                Action::Apply { driver, .. } => Some(driver.clone()),
                _ => None,
            })
            .collect()
    };
    // The first record (no driver reading yet), then the driver's limits arrive.
    assert_eq!(applied(&h.tick(0, GI)), vec![None]);
    let capped = DriverView { pairs: 1, hard_pairs: 1, hard_sum: 12 * GI, ..DriverView::default() };
    let mut quiet = Vec::new();
    for t in (250..30_000).step_by(250) {
        let mut out = h.tick(t, GI);
        h.enforcer.driver_limits(&h.table, &[Some(capped)], &mut out);
        quiet.extend(applied(&out));
    }
    assert!(quiet.is_empty(), "not rewritten before usage would be: {quiet:?}");
    let out = h.tick(30_000, GI);
    let written = applied(&out);
    assert_eq!(written.len(), 1);
    let record = written[0].clone().expect("driver limits in the record");
    assert_eq!((record.pairs, record.capped, record.hard_bytes), (1, 1, Some(12 * GI)));
    assert!(record.note.as_deref().is_some_and(|n| n.starts_with("driver allows more than the budget")));
    // Written and unchanged: not again.
    for t in (30_250..70_000).step_by(250) {
        let mut out = h.tick(t, GI);
        h.enforcer.driver_limits(&h.table, &[Some(capped)], &mut out);
        assert!(applied(&out).is_empty());
    }
}

/// #32: a capped pod whose process is no client of the MPS server is told at once (event, record, count); the
/// breach lasts as long as that process; a pod whose processes are clients stays quiet.
#[test]
fn a_capped_pod_whose_process_is_no_mps_client_is_told_and_recorded_at_once() {
    let mut view = pod("", "");
    view.mps_cap_mib = Some(crate::attribute::pods::MpsCap { mib: 3072, devices: 1 });
    let capped = table(view, &[budget("")]);
    let mut enforcer = Enforcer::new(Settings::new(NODE));
    let usage_of = |procs: &[(u32, Option<bool>)]| {
        let holders: Vec<Holder> = procs
            .iter()
            .map(|&(pid, mps_client)| Holder { container: None, pid: Some(pid), gpu: 0, bytes: GI, mps_client })
            .collect();
        vec![PodUsage { total: GI * holders.len() as u64, holders, unknown: 0 }]
    };
    let mut step = |ms: u64, procs: &[(u32, Option<bool>)]| {
        let mut out = Vec::new();
        enforcer.tick(at(ms), &capped, &usage_of(procs), &gpus(), &mut out);
        let applied: Vec<PodRecord> = out
            .iter()
            .filter_map(|a| match a {
                Action::Apply { record, .. } => Some(record.clone()),
                _ => None,
            })
            .collect();
        for record in &applied {
            let uid: Arc<str> = Arc::from("uid-1");
            enforcer.feedback(at(ms), Feedback::Written { uid, record: Some(record.clone()), ok: true }, &mut out);
        }
        let told: Vec<String> = out
            .iter()
            .filter_map(|a| match a {
                Action::Event { reason: Reason::CapNotInForce, note, .. } => Some(note.clone()),
                _ => None,
            })
            .collect();
        (applied, told, enforcer.caps_not_in_force())
    };
    // A client of the MPS server: in force.
    let (applied, told, count) = step(0, &[(7, Some(true))]);
    assert!(told.is_empty() && count == 0);
    assert_eq!(applied.iter().map(|r| r.cap_not_in_force.clone()).collect::<Vec<_>>(), [None]);
    // Process 8 went around the server: told and recorded in the same tick.
    let (applied, told, count) = step(250, &[(7, Some(true)), (8, Some(false))]);
    assert_eq!((told.len(), count), (1, 1), "{told:?}");
    assert!(told[0].contains("process 8 on GPU 0") && told[0].contains("budget team-a/llm"), "{}", told[0]);
    let recorded = applied.last().and_then(|r| r.cap_not_in_force.clone()).expect("recorded at once");
    assert!(recorded.contains("not a client of the GPU's MPS server"), "{recorded}");
    // While it runs: nothing more, whatever else comes and goes.
    for ms in (500..=20_000).step_by(250) {
        let (applied, told, count) = step(ms, &[(7, Some(true)), (8, Some(false)), (9, Some(false))]);
        assert!(applied.is_empty() && told.is_empty() && count == 1, "at {ms}: {applied:?} {told:?}");
    }
    // It exits: the cap is back in force, the record says so (spaced like a state move), the count drops.
    let cleared: Vec<PodRecord> =
        (20_250..=40_000).step_by(250).flat_map(|ms| step(ms, &[(7, Some(true))]).0).collect();
    assert_eq!(cleared.iter().map(|r| r.cap_not_in_force.is_some()).collect::<Vec<_>>(), [false]);
    assert_eq!(enforcer.caps_not_in_force(), 0);
    // An uncapped pod is never told, whatever its processes are.
    let mut plain = Enforcer::new(Settings::new(NODE));
    let mut out = Vec::new();
    plain.tick(at(0), &table(pod("", ""), &[budget("")]), &usage_of(&[(8, Some(false))]), &gpus(), &mut out);
    assert!(!out.iter().any(|a| matches!(a, Action::Event { reason: Reason::CapNotInForce, .. })));
}

/// #32 item 5: what `--apply-driver-limits` did is told on the pod: a limit read back as Normal, a refusal as a
/// Warning naming the driver's answer.
#[test]
fn applied_driver_limits_are_told_and_refusals_are_warnings() {
    use crate::attribute::driver_limits::Applied;
    use gpubudget_nvml_limits::{Limits, Reading};
    let t = table(pod("", ""), &[budget(", admissionCaps: Enabled")]);
    let mut enforcer = Enforcer::new(Settings::new(NODE));
    let mut out = Vec::new();
    enforcer.tick(at(0), &t, &usage(GI), &gpus(), &mut out);
    out.clear();
    let ok = Applied {
        pod: 0,
        gpu: 0,
        cgroup: "/kubepods.slice/kubepods-podx.slice/cri-containerd-abc.scope".into(),
        before: None,
        asked: (0, 8 * GI),
        outcome: Ok(Reading::Set(Limits { soft: 0, hard: 8 * GI, used: 0 })),
    };
    let refused = Applied { outcome: Err("nvmlDeviceSetMemoryLimits_v1 failed (nvmlReturn_t 4)".into()), ..ok.clone() };
    let ignored = Applied { outcome: Ok(Reading::NotSet), ..ok.clone() };
    enforcer.driver_applied(at(0), &t, &[ok, refused, ignored], &gpus(), &mut out);
    let told: Vec<(&str, bool, &str)> = out
        .iter()
        .filter_map(|a| match a {
            Action::Event { reason, note, .. } => Some((reason.as_str(), reason.is_warning(), note.as_str())),
            _ => None,
        })
        .collect();
    assert_eq!(told.len(), 2, "the second refusal waits for the cooldown: {told:?}");
    assert_eq!((told[0].0, told[0].1), ("GpuMemoryDriverLimitsApplied", false));
    assert!(
        told[0].2.contains("hard 8Gi (it had none)") && told[0].2.contains("cri-containerd-abc.scope"),
        "{}",
        told[0].2
    );
    assert_eq!((told[1].0, told[1].1), ("GpuMemoryDriverLimitsNotApplied", true));
    assert!(told[1].2.contains("nvmlReturn_t 4") && told[1].2.contains("enforced by eviction"), "{}", told[1].2);
}

/// What status counts besides the state is written too once it changes (a container made by the runtime after the
/// pod's first record), spaced as a move is.
#[test]
fn what_the_runtime_made_reaches_the_record_after_the_first_write() {
    use gpubudget_common::pod_record::RuntimeCapsRecord;
    let mut h = Harness::new(pod("", ""), &[budget("")]);
    assert_eq!(kinds(&h.tick(0, GI)), ["apply:Within"]);
    let mut view = h.table.pods[0].clone();
    view.runtime_caps = Some(RuntimeCapsRecord::capped([("main".to_owned(), 8192)]));
    h.table = table(view, &[budget("")]);
    assert!(h.run(250, 4_750, GI).is_empty(), "not before 5 s after the last write");
    let out = h.tick(5_000, GI);
    let Some(Action::Apply { record, .. }) = out.first() else { panic!("{:?}", kinds(&out)) };
    assert_eq!(record.runtime_caps, Some(RuntimeCapsRecord::capped([("main".to_owned(), 8192)])));
    assert!(h.run(5_250, 20_000, GI).is_empty(), "written once");
}

/// #51, the issue's case: KAI placed the pod at gpu-fraction 0.25 of an 80Gi GPU (the agent held it to 20Gi and
/// recorded so), then its tenant rewrote the annotation to 1 (or removed it). The pod at 30Gi is still over 20Gi,
/// evicted in time, and told once that the change was ignored; after a restart the record holds it the same.
#[test]
fn a_rewritten_share_is_ignored_and_told_once() {
    use gpubudget_common::share::HeldShare;
    let first = HeldShare::new(
        20 * GI,
        vec![gpubudget_common::share::ShareSource::KaiFraction],
        "KAI gpu-fraction 0.25 of 80Gi = 20Gi".into(),
    );
    let wide: GpuMemoryBudget = serde_yaml::from_str(
        "apiVersion: gpubudget.io/v1alpha1\nkind: GpuMemoryBudget\nmetadata: {name: llm, namespace: team-a}\n\
         spec: {selector: {}, limit: 80Gi, share: {}}",
    )
    .expect("budget");
    let index = crate::attribute::budgets::BudgetIndex::of([&wide]);
    for annotations in ["{gpu-fraction: '1'}", "{}", "{gpu-fraction: lots}"] {
        let p: Pod = serde_yaml::from_str(&format!(
            "metadata: {{name: llm-0, namespace: team-a, uid: uid-1, annotations: {annotations}}}\n\
             spec: {{nodeName: {NODE}, schedulerName: kai-scheduler, containers: [{{name: c, image: i}}]}}"
        ))
        .expect("pod");
        let mut view = PodView::from_pod(&p).expect("view");
        view.record = Some(PodRecord {
            state: BudgetState::Within,
            usage_bytes: 0,
            budget: "llm".into(),
            node: NODE.into(),
            eviction_requested_at: None,
            cap_not_in_force: None,
            share: Some(first.clone()),
            runtime_caps: None,
        });
        for gpus in [&[80 * GI][..], &[]] {
            let table = PodTable::from_index([view.clone()], &index, &Default::default(), Some(NODE), gpus);
            let rules = table.budget(0).expect("applies");
            let held = rules.held_share.as_ref().expect("held");
            assert_eq!((rules.limit_bytes, &held.note), (20 * GI, &first.note), "{annotations}");
            // A removal or garbage is known at once; a larger fraction once the GPU's size is.
            assert_eq!(held.ignored.is_some(), !gpus.is_empty() || !annotations.contains("'1'"), "{annotations}");
            assert!(rules.guaranteed_bytes() <= 20 * GI);
        }
        let mut h = Harness::new(view.clone(), &[]);
        h.table = PodTable::from_index([view], &index, &Default::default(), Some(NODE), &[80 * GI]);
        let out = h.tick(0, 30 * GI);
        let told: Vec<&str> = out
            .iter()
            .filter_map(|a| match a {
                Action::Event { reason: Reason::ShareChangeIgnored, note, .. } => Some(note.as_str()),
                _ => None,
            })
            .collect();
        assert_eq!(told.len(), 1, "{annotations}: {:?}", kinds(&out));
        assert!(
            told[0].contains("is ignored: a share is fixed when the pod is placed and only tightens"),
            "{}",
            told[0]
        );
        assert!(kinds(&out).contains(&"Within->Over".to_owned()), "{annotations}: {:?}", kinds(&out));
        assert!(notes(&out).iter().any(|n| n.starts_with("using 30Gi of 20Gi")), "{:?}", notes(&out));
        let later = h.run(250, 15_000, 30 * GI);
        assert_eq!(evicts(&later), 1, "{annotations}: evicted after overLimitSeconds");
        assert!(
            later.iter().all(|a| !matches!(a, Action::Event { reason: Reason::ShareChangeIgnored, .. })),
            "told once"
        );
    }
}
