use super::*;
use serde_json::json;

const NOW: &str = "2026-11-24T10:00:30Z";

fn now() -> Timestamp {
    NOW.parse().unwrap()
}

fn budget(name: &str, limit: &str, selector: serde_json::Value, extra: serde_json::Value) -> GpuMemoryBudget {
    let mut spec = json!({"selector": selector, "limit": limit});
    spec.as_object_mut().unwrap().extend(extra.as_object().cloned().unwrap_or_default());
    serde_json::from_value(json!({
        "apiVersion": "gpubudget.io/v1alpha1", "kind": "GpuMemoryBudget",
        "metadata": {"name": name, "namespace": "team-a"}, "spec": spec,
    }))
    .unwrap()
}

fn pod(state: Option<(&str, u64, &str)>, extra_meta: serde_json::Value, spec: serde_json::Value) -> Pod {
    let mut annotations = serde_json::Map::new();
    if let Some((state, usage, budget)) = state {
        annotations.insert("gpubudget.io/state".into(), state.into());
        annotations.insert("gpubudget.io/usage-bytes".into(), usage.to_string().into());
        annotations.insert("gpubudget.io/budget".into(), budget.into());
        annotations.insert("gpubudget.io/node".into(), "n1".into());
        if state == "Evicting" {
            annotations.insert("gpubudget.io/eviction-requested-at".into(), "2026-11-24T10:00:20Z".into());
        }
    }
    let mut meta = json!({"name": "llm-0", "namespace": "team-a", "uid": "u1", "labels": {"app": "llm"},
                          "annotations": annotations});
    meta.as_object_mut().unwrap().extend(extra_meta.as_object().cloned().unwrap_or_default());
    let mut s = json!({"nodeName": "n1", "containers": [{"name": "server", "image": "vllm",
                       "resources": {"limits": {"nvidia.com/gpu": "1"}}}]});
    s.as_object_mut().unwrap().extend(spec.as_object().cloned().unwrap_or_default());
    serde_json::from_value(json!({"metadata": meta, "spec": s, "status": {"phase": "Running"}})).unwrap()
}

fn event(reason: &str, uid: &str, at: &str, message: &str) -> Event {
    serde_json::from_value(json!({
        "metadata": {"name": format!("{reason}-{at}"), "namespace": "team-a"},
        "involvedObject": {"kind": "Pod", "name": "llm-0", "namespace": "team-a", "uid": uid},
        "reason": reason, "type": "Warning", "message": message, "reportingComponent": "gpubudget-agent",
        "eventTime": at,
    }))
    .unwrap()
}

static NO_SPECS: BTreeMap<(String, String), serde_json::Value> = BTreeMap::new();

fn input<'a>(pod: Option<&'a Pod>, budgets: Option<&'a [GpuMemoryBudget]>, events: &'a [Event]) -> WhyInput<'a> {
    WhyInput {
        namespace: "team-a",
        name: "llm-0",
        pod,
        budgets,
        specs: &NO_SPECS,
        cluster_budgets: Some(&[]),
        namespace_labels: None,
        events,
        now: now(),
        warnings: Vec::new(),
        critical_namespaces: &TEAM_A_CRITICAL,
        measured: None,
    }
}

/// The fixtures' namespace listed as critical, as tests before #33 assumed.
static TEAM_A_CRITICAL: std::sync::LazyLock<gpubudget_common::CriticalNamespaces> =
    std::sync::LazyLock::new(|| "kube-system,team-a".parse().expect("valid"));

fn overlapping() -> Vec<GpuMemoryBudget> {
    vec![
        // The wider budget waits longer: the smaller limit's rules are tightened by every budget selecting the
        // pod (#51), and these fixtures are about the overlap, not the tightening.
        budget("team-default", "20Gi", json!({}), json!({"overLimitSeconds": 60})),
        budget("llm-inference", "8Gi", json!({"matchLabels": {"app": "llm"}}), json!({"overLimitSeconds": 30})),
        budget("web", "1Gi", json!({"matchLabels": {"app": "web"}}), json!({})),
    ]
}

#[test]
fn over_an_evict_budget_with_an_overlap_says_when_it_is_evicted() {
    let budgets = overlapping();
    let p = pod(Some(("Over", 9 << 30, "llm-inference")), json!({}), json!({"terminationGracePeriodSeconds": 10}));
    let events = [
        event(reason::NEAR, "u1", "2026-11-24T10:00:00.000000Z", "using 7.5Gi of 8Gi (budget team-a/llm-inference)"),
        event(reason::OVER, "u1", "2026-11-24T10:00:10.000000Z", "using 9Gi of 8Gi (budget team-a/llm-inference)"),
    ];
    let r = why(input(Some(&p), Some(&budgets), &events)).unwrap();
    assert_eq!(r.budget.as_ref().map(|b| b.name.as_str()), Some("llm-inference"));
    let matched: Vec<(&str, bool)> = r.matched.iter().map(|m| (m.name.as_str(), m.applies)).collect();
    assert_eq!(matched, [("llm-inference", true), ("team-default", false)]);
    assert!(
        r.why
            .starts_with("2 budgets in team-a select this pod: llm-inference (8Gi), team-default (20Gi); the smallest"),
        "{}",
        r.why
    );
    assert_eq!(r.record.as_ref().and_then(|x| x.percent), Some(112.5));
    assert_eq!((r.over_since.as_deref(), r.over_for_seconds), (Some("2026-11-24T10:00:10Z"), Some(20)));
    assert_eq!((r.next.action, r.next.at.as_deref()), ("Evict", Some("2026-11-24T10:00:40Z")));
    assert!(r.next.message.contains("(in 10s)") && r.next.message.contains("10s grace"), "{}", r.next.message);
    assert!(
        r.admission.summary.starts_with("none set at admission: the GPU container server sets none"),
        "{}",
        r.admission.summary
    );
    assert_eq!(r.events.len(), 2);
    assert!(r.warnings.is_empty(), "{:?}", r.warnings);
    let text = crate::render::why_text(&r, now());
    assert!(text.contains("Over for:") && text.contains("20s (since 2026-11-24T10:00:10Z)"), "{text}");
    assert!(text.contains("llm-inference (limit 8Gi, action Evict, warnAtPercent 90, overLimitSeconds 30)"), "{text}");
}

#[test]
fn past_due_and_unknown_since() {
    let budgets = overlapping();
    let p = pod(Some(("Over", 9 << 30, "llm-inference")), json!({}), json!({}));
    let events = [event(reason::OVER, "u1", "2026-11-24T09:00:00.000000Z", "over")];
    let r = why(input(Some(&p), Some(&budgets), &events)).unwrap();
    assert_eq!((r.next.action, r.next.at.as_deref()), ("Evict", Some(NOW)));
    assert!(r.next.message.starts_with("evicted at the agent's next sample"), "{}", r.next.message);
    let r = why(input(Some(&p), Some(&budgets), &[])).unwrap();
    assert_eq!((r.next.action, r.next.at.as_deref(), r.over_since.as_deref()), ("Evict", None, None));
    assert!(r.next.message.contains("the events that say since when are gone"), "{}", r.next.message);
}

#[test]
fn warn_budgets_critical_pods_and_within_are_never_evicted() {
    let warn = [budget("audit", "8Gi", json!({}), json!({"action": "Warn"}))];
    let p = pod(Some(("Over", 9 << 30, "audit")), json!({}), json!({}));
    let r = why(input(Some(&p), Some(&warn), &[])).unwrap();
    assert_eq!(r.next.action, "Nothing");
    assert!(r.next.message.contains("action is Warn"), "{}", r.next.message);
    assert!(
        r.why
            == "audit is the only budget in team-a that selects this pod; its selector: {} (every pod in the namespace)",
        "{}",
        r.why
    );

    let budgets = overlapping();
    let critical =
        pod(Some(("Over", 9 << 30, "llm-inference")), json!({}), json!({"priorityClassName": "system-node-critical"}));
    let r = why(input(Some(&critical), Some(&budgets), &[])).unwrap();
    assert_eq!(r.next.action, "Nothing");
    assert!(r.pod.never_evicted.as_deref().is_some_and(|n| n.contains("critical")), "{:?}", r.pod);
    // #33: outside the namespaces the administrator lists, critical priority exempts nothing, and why says so.
    let default = gpubudget_common::CriticalNamespaces::default();
    let r = why(WhyInput { critical_namespaces: &default, ..input(Some(&critical), Some(&budgets), &[]) }).unwrap();
    assert_eq!(r.pod.never_evicted, None);
    assert_ne!(r.next.action, "Nothing", "{:?}", r.next);
    assert!(
        r.warnings
            .iter()
            .any(|w| w.contains("this pod has critical priority") && w.contains("criticalNamespaces: kube-system")),
        "{:?}",
        r.warnings
    );
    let within = pod(Some(("Within", 1 << 30, "llm-inference")), json!({}), json!({}));
    let r = why(input(Some(&within), Some(&budgets), &[])).unwrap();
    assert_eq!(r.next.action, "Nothing");
    assert!(r.next.message.contains("Near at 90% of 8Gi = 7.2Gi"), "{}", r.next.message);
}

#[test]
fn evicting_and_refused_with_and_without_a_timeout() {
    let plain = overlapping();
    let p = pod(Some(("Evicting", 9 << 30, "llm-inference")), json!({}), json!({}));
    let r = why(input(Some(&p), Some(&plain), &[])).unwrap();
    assert_eq!((r.next.action, r.next.at.as_deref()), ("Evict", Some("2026-11-24T10:00:20Z")));
    assert!(r.next.message.contains("eviction requested at 2026-11-24T10:00:20Z (10s ago)"), "{}", r.next.message);
    let blocked = [event(reason::BLOCKED, "u1", "2026-11-24T10:00:21.000000Z", "eviction refused: PDB")];
    let r = why(input(Some(&p), Some(&plain), &blocked)).unwrap();
    assert_eq!((r.next.action, r.next.at.as_deref()), ("Evict", None));
    assert!(r.next.message.contains("no blockedEvictionTimeoutSeconds"), "{}", r.next.message);
    let timed = [budget("llm-inference", "8Gi", json!({}), json!({"blockedEvictionTimeoutSeconds": 600}))];
    let r = why(input(Some(&p), Some(&timed), &blocked)).unwrap();
    assert_eq!((r.next.action, r.next.at.as_deref()), ("Delete", Some("2026-11-24T10:10:20Z")));
    let terminating = pod(
        Some(("Evicting", 9 << 30, "llm-inference")),
        json!({"deletionTimestamp": "2026-11-24T10:00:50Z"}),
        json!({}),
    );
    let r = why(input(Some(&terminating), Some(&plain), &[])).unwrap();
    assert_eq!((r.next.action, r.next.at.as_deref()), ("Terminate", Some("2026-11-24T10:00:50Z")));
}

#[test]
fn no_budget_no_record_and_unreadable_budgets() {
    let budgets = [budget("web", "1Gi", json!({"matchLabels": {"app": "web"}}), json!({}))];
    let p = pod(None, json!({}), json!({}));
    let r = why(input(Some(&p), Some(&budgets), &[])).unwrap();
    assert_eq!((r.budget.is_none(), r.next.action), (true, "Nothing"));
    assert_eq!(r.why, "no valid GpuMemoryBudget in team-a selects this pod (its labels: app=llm)");
    let all = overlapping();
    let r = why(input(Some(&p), Some(&all), &[])).unwrap();
    assert!(
        r.next.message.starts_with("nothing yet: no agent has recorded GPU memory for this pod"),
        "{}",
        r.next.message
    );
    let p = pod(Some(("Near", 7 << 30, "llm-inference")), json!({}), json!({}));
    let r = why(input(Some(&p), None, &[])).unwrap();
    assert_eq!(r.budget.as_ref().map(|b| (b.name.as_str(), b.limit_bytes)), Some(("llm-inference", None)));
    assert_eq!(r.next.action, "Unknown");
    assert!(r.why.contains("could not be read; the agent's record names budget llm-inference"), "{}", r.why);
}

#[test]
fn a_stale_record_and_an_invalid_budget_are_told() {
    let mut budgets = overlapping();
    budgets.push(budget("broken", "8 GiB", json!({}), json!({})));
    let p = pod(Some(("Within", 1 << 30, "team-default")), json!({}), json!({}));
    let r = why(input(Some(&p), Some(&budgets), &[])).unwrap();
    assert_eq!(r.warnings.len(), 2, "{:?}", r.warnings);
    assert!(r.warnings[0].starts_with("budget team-a/broken is invalid and not enforced: spec.limit"));
    assert!(r.warnings[1].contains("record names budget team-default, but the budgets now resolve to llm-inference"));
}

/// The tenant's question: the pod was evicted and deleted; its events and the budget's status remain.
#[test]
fn an_evicted_pod_that_is_gone_is_answered_from_events_and_status() {
    let mut budgets = overlapping();
    budgets[1].status = Some(
        serde_json::from_value(json!({
            "evictions": 1,
            "lastEviction": {"pod": "llm-0", "node": "n1", "time": "2026-11-24T09:59:50Z", "usage": "9Gi"},
        }))
        .unwrap(),
    );
    let events = [
        event(reason::OVER, "u0", "2026-11-24T09:59:40.000000Z", "using 9Gi of 8Gi (budget team-a/llm-inference)"),
        event(
            reason::EVICTING,
            "u0",
            "2026-11-24T09:59:50.000000Z",
            "using 9Gi of 8Gi (budget team-a/llm-inference) for 10s; evicting",
        ),
        event("Killing", "u0", "2026-11-24T09:59:51.000000Z", "Stopping container server"),
    ];
    let r = why(input(None, Some(&budgets), &events)).unwrap();
    assert!(!r.pod.exists);
    assert_eq!(r.budget.as_ref().map(|b| b.name.as_str()), Some("llm-inference"));
    assert!(r.why.contains("budget llm-inference evicted it"), "{}", r.why);
    assert_eq!(r.last_eviction.as_ref().map(|l| l.usage.as_str()), Some("9Gi"));
    assert_eq!(r.next.action, "Gone");
    assert!(r.next.message.contains("evicted at 2026-11-24T09:59:50Z using 9Gi on n1"), "{}", r.next.message);
    assert_eq!(r.events.len(), 3);
    // Without the budgets (a tenant without list on them): the events still name the budget.
    let r = why(input(None, None, &events)).unwrap();
    assert_eq!(r.budget.as_ref().map(|b| b.name.as_str()), Some("llm-inference"));
    assert!(r.next.message.contains(reason::EVICTING), "{}", r.next.message);
    assert_eq!(why(input(None, Some(&budgets[..1]), &[])), Err(NotFound));
}

/// A field of the spec newer than this plugin (issue 22's `request`, with the CRD upgraded first) is shown
/// from the spec as stored.
#[test]
fn a_new_optional_spec_field_shows_without_a_change() {
    let budgets = [budget("llm", "8Gi", json!({}), json!({}))];
    let specs = BTreeMap::from([(
        ("team-a".to_owned(), "llm".to_owned()),
        json!({"selector": {}, "limit": "8Gi", "request": "6Gi"}),
    )]);
    let p = pod(Some(("Within", 1 << 30, "llm")), json!({}), json!({}));
    let r = why(WhyInput { specs: &specs, ..input(Some(&p), Some(&budgets), &[]) }).unwrap();
    assert_eq!(r.budget.as_ref().unwrap().spec["request"], "6Gi");
    let text = crate::render::why_text(&r, now());
    assert!(
        text.contains("llm (limit 8Gi, request 6Gi, action Evict, warnAtPercent 90, overLimitSeconds 10)"),
        "{text}"
    );
}

/// #23: `why` reads the cluster budgets with the namespace's labels: one applies over a looser namespaced
/// budget, is named `ClusterGpuMemoryBudget/<name>` (as the agent's record names it) with both selectors,
/// and its spec is shown; a namespace it does not select leaves it out.
#[test]
fn a_cluster_budget_is_shown_and_applies_as_resolved() {
    let tenants: ClusterGpuMemoryBudget = serde_json::from_value(json!({
        "apiVersion": "gpubudget.io/v1alpha1", "kind": "ClusterGpuMemoryBudget", "metadata": {"name": "tenants"},
        "spec": {"namespaceSelector": {"matchLabels": {"tier": "tenant"}}, "selector": {}, "limit": "16Gi"},
    }))
    .unwrap();
    let budgets = vec![budget("team-default", "20Gi", json!({}), json!({}))];
    let p = pod(Some(("Within", 4 << 30, "ClusterGpuMemoryBudget/tenants")), json!({}), json!({}));
    let labels: BTreeMap<String, String> = [("tier".to_owned(), "tenant".to_owned())].into();
    let clusters = [tenants];
    let base = input(Some(&p), Some(&budgets), &[]);
    let r =
        why(WhyInput { cluster_budgets: Some(&clusters), namespace_labels: Some(&labels), ..base.clone() }).unwrap();
    let names: Vec<(&str, bool)> = r.matched.iter().map(|m| (m.name.as_str(), m.applies)).collect();
    assert_eq!(names, [("ClusterGpuMemoryBudget/tenants", true), ("team-default", false)]);
    assert!(r.matched[0].selector.starts_with("namespaceSelector "), "{}", r.matched[0].selector);
    assert!(r.why.contains("no looser in any field than the cluster budget"), "{}", r.why);
    let shown = r.budget.expect("the applying budget");
    assert_eq!((shown.name.as_str(), shown.limit_bytes), ("ClusterGpuMemoryBudget/tenants", Some(16 << 30)));
    assert!(r.warnings.is_empty(), "the record names the budget that applies: {:?}", r.warnings);
    // Not a tenant namespace: the namespaced budget applies, and the record is stale.
    let r = why(WhyInput { cluster_budgets: Some(&clusters), namespace_labels: None, ..base }).unwrap();
    assert_eq!(r.matched.iter().map(|m| m.name.as_str()).collect::<Vec<_>>(), ["team-default"]);
    assert!(r.warnings.iter().any(|w| w.contains("now resolve to team-default")), "{:?}", r.warnings);
}

/// #34: the pod's node's `GpuNodeUsage` gives the usage `why` shows; without it, the record's.
#[test]
fn the_usage_shown_is_the_nodes_object_where_it_could_be_read() {
    let budgets = overlapping();
    let p = pod(Some(("Within", 2 << 30, "llm-inference")), json!({}), json!({}));
    let r = why(input(Some(&p), Some(&budgets), &[])).unwrap();
    assert_eq!(r.record.as_ref().map(|x| (x.usage_bytes, x.percent)), Some((2 << 30, Some(25.0))));
    let r = why(WhyInput { measured: Some(6 << 30), ..input(Some(&p), Some(&budgets), &[]) }).unwrap();
    let record = r.record.expect("record");
    assert_eq!((record.usage_bytes, record.usage.as_str(), record.percent), (6 << 30, "6Gi", Some(75.0)));
}

/// #32: the node's word that the cap is not in force is shown, never the cap alone.
#[test]
fn a_cap_the_node_saw_fail_is_shown_as_not_in_force() {
    let budgets = overlapping();
    let env = json!({"containers": [{"name": "server", "image": "vllm", "resources": {"limits": {"nvidia.com/gpu": "1"}},
                     "env": [{"name": "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT", "value": "0=8192M"}]}]});
    let held = pod(Some(("Within", 2 << 30, "llm-inference")), json!({}), env.clone());
    let r = why(input(Some(&held), Some(&budgets), &[])).unwrap();
    assert_eq!(r.record.as_ref().and_then(|x| x.cap_not_in_force.clone()), None);
    assert!(!crate::render::why_text(&r, now()).contains("Cap in force"));
    let mut escaped = held.clone();
    escaped.metadata.annotations.as_mut().unwrap().insert(
        "gpubudget.io/cap-not-in-force".into(),
        "process 8 on GPU 0 (6Gi as NVML counts it) is not a client of the GPU's MPS server".into(),
    );
    let r = why(input(Some(&escaped), Some(&budgets), &[])).unwrap();
    let text = crate::render::why_text(&r, now());
    assert!(
        text.contains("Cap in force:") && text.contains("NO, the agent on the node saw: process 8 on GPU 0"),
        "{text}"
    );
}

/// `why` says when the nodes may enforce another spec of the pod's budget than its current one.
#[test]
fn why_says_when_the_nodes_enforce_an_older_spec() {
    let status = |observed: i64, enforced: Option<i64>, nodes_current: Option<(&str, &str)>| {
        serde_json::from_value::<gpubudget_common::crd::GpuMemoryBudgetStatus>(json!({
            "observedGeneration": observed,
            "enforcedGeneration": enforced,
            "conditions": nodes_current.map(|(s, m)| vec![json!({
                "type": "NodesCurrent", "status": s, "reason": "r", "message": m,
                "lastTransitionTime": NOW,
            })]).unwrap_or_default(),
        }))
        .unwrap()
    };
    let current = status(4, Some(4), Some(("True", "current")));
    assert_eq!(nodes_generation_warning("llm", Some(4), Some(&current)), None);
    let behind = status(4, Some(3), Some(("False", "its mirror copies generation 3")));
    let w = nodes_generation_warning("llm", Some(4), Some(&behind)).expect("a warning");
    assert!(
        w.contains("the nodes enforce generation 3 of budget llm, not its current generation 4: its mirror"),
        "{w}"
    );
    let stale = status(3, Some(3), Some(("True", "current")));
    let w = nodes_generation_warning("llm", Some(4), Some(&stale)).expect("a warning");
    assert!(w.contains("status was not written for it (is the operator up?)"), "{w}");
    assert!(nodes_generation_warning("llm", Some(4), None).is_some(), "no status at all");
    let older_operator = status(4, None, None);
    assert_eq!(nodes_generation_warning("llm", Some(4), Some(&older_operator)), None, "an older operator says nothing");
}

/// A pod held to its declared share: `why` says the budget its node applied (not the smaller spec limit of
/// another), its own limit and how the share gave it; before any agent has recorded it, what it declares.
#[test]
fn why_names_the_share_its_node_applied() {
    let budgets = vec![
        budget("shares", "80Gi", json!({}), json!({"share": {}})),
        budget("team-default", "30Gi", json!({}), json!({})),
    ];
    let held = r#"{"limitBytes":21474836480,"sources":["KaiFraction"],"note":"KAI gpu-fraction 0.25 of 80Gi = 20Gi"}"#;
    let kai = json!({"annotations": {
        "gpubudget.io/state": "Over", "gpubudget.io/usage-bytes": (22u64 << 30).to_string(),
        "gpubudget.io/budget": "shares", "gpubudget.io/node": "n1", "gpubudget.io/share": held,
        "gpu-fraction": "0.25"}});
    let p = pod(None, kai, json!({"schedulerName": "kai-scheduler", "containers": [{"name": "w", "image": "x"}]}));
    let r = why(input(Some(&p), Some(&budgets), &[])).unwrap();
    assert_eq!(r.budget.as_ref().map(|b| b.name.as_str()), Some("shares"));
    assert_eq!(r.matched.iter().find(|m| m.applies).map(|m| m.name.as_str()), Some("shares"));
    assert_eq!(
        r.why,
        "2 budgets in team-a select this pod: shares (20Gi, this pod's share), team-default (30Gi); the smallest limit \
         applies (equal limits: the name that sorts first), so shares; shares takes each pod's declared share as its \
         limit, as the pod's node resolved it"
    );
    assert_eq!(
        r.share.as_deref(),
        Some("limit 20Gi from its declared share: KAI gpu-fraction 0.25 of 80Gi = 20Gi (resolved by its node's agent)")
    );
    assert!(
        r.warnings.iter().all(|w| !w.contains("resolve to")),
        "no false 'budgets now resolve to': {:?}",
        r.warnings
    );
    let record = r.record.as_ref().expect("record");
    assert_eq!((record.limit_bytes, record.percent), (Some(20 << 30), Some(110.0)));
    assert!(r.next.message.contains("over 20Gi"), "{}", r.next.message);
    let text = crate::render::why_text(&r, now());
    assert!(text.contains("using 22Gi of 20Gi (110%)"), "{text}");

    // #51: the tenant's later declaration was ignored by its node's agent: why says so, and the limit stays the first.
    let kept = r#"{"limitBytes":21474836480,"sources":["KaiFraction"],"note":"KAI gpu-fraction 0.25 of 80Gi = 20Gi","ignored":"the share declared now (KAI gpu-fraction 1 of 80Gi = 80Gi) is more"}"#;
    let rewritten = json!({"annotations": {
        "gpubudget.io/state": "Over", "gpubudget.io/usage-bytes": (22u64 << 30).to_string(),
        "gpubudget.io/budget": "shares", "gpubudget.io/node": "n1", "gpubudget.io/share": kept,
        "gpu-fraction": "1"}});
    let p =
        pod(None, rewritten, json!({"schedulerName": "kai-scheduler", "containers": [{"name": "w", "image": "x"}]}));
    let r = why(input(Some(&p), Some(&budgets), &[])).unwrap();
    assert_eq!(
        r.share.as_deref(),
        Some(
            "limit 20Gi from its declared share: KAI gpu-fraction 0.25 of 80Gi = 20Gi (resolved by its node's agent); its \
             declaration changed since and is ignored (the share declared now (KAI gpu-fraction 1 of 80Gi = 80Gi) is \
             more): a share is fixed when the pod is placed and only tightens"
        )
    );

    // Not recorded yet: an absolute share is known here, a fraction only on the node, a bad one says why.
    let said = |meta: serde_json::Value, spec: serde_json::Value| {
        let p = pod(None, meta, spec);
        why(input(Some(&p), Some(&budgets[..1]), &[])).unwrap().share.unwrap()
    };
    let hami = json!({"containers": [{"name": "w", "image": "x",
                      "resources": {"limits": {"nvidia.com/gpu": "1", "nvidia.com/gpumem": "10240"}}}]});
    assert_eq!(
        said(json!({}), hami),
        "its declared share HAMi gpumem 10240 MiB = 10Gi is its limit (at most the budget's 80Gi) once its node's \
         agent sees it"
    );
    let kai_spec = json!({"schedulerName": "kai-scheduler", "containers": [{"name": "w", "image": "x"}]});
    let fraction = said(json!({"annotations": {"gpu-fraction": "0.5"}}), kai_spec.clone());
    assert!(fraction.starts_with("its declared share is a part of a GPU"), "{fraction}");
    let bad = said(json!({"annotations": {"gpu-fraction": "NaN"}}), kai_spec);
    assert!(bad.starts_with("its declared share is unresolved: ") && bad.contains("NaN"), "{bad}");
    let none = said(json!({}), json!({}));
    assert!(none.contains("declares none it reads"), "{none}");
}

/// With runtime caps, `why` says what the runtime made of the pod's GPU containers, from its agent's record.
#[test]
fn why_says_what_the_runtime_made() {
    let budgets = vec![budget("llm", "8Gi", json!({}), json!({"admissionCaps": "Enabled"}))];
    let made = |value: &str| {
        let meta = json!({"annotations": {
            "gpubudget.io/state": "Within", "gpubudget.io/usage-bytes": "0", "gpubudget.io/budget": "llm",
            "gpubudget.io/node": "n1", "gpubudget.io/runtime-caps": value}});
        let p = pod(None, meta, json!({}));
        crate::render::why_text(&why(input(Some(&p), Some(&budgets), &[])).unwrap(), now())
    };
    let capped = made(r#"{"capped":{"maxMib":8192}}"#);
    assert!(capped.contains("Made:") && capped.contains("at most 8192 MiB"), "{capped}");
    let uncapped = made(r#"{"uncapped":"container main: no CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"}"#);
    assert!(uncapped.contains("made by the container runtime without a cap: container main"), "{uncapped}");
}

/// #54: in observe mode `why` says the pod would be evicted, by which level's word, and never that it is being
/// evicted; back within its budget it says so no more. A budget set to Observe says so before any event.
#[test]
fn observe_mode_says_would_be_evicted_and_by_whom() {
    let budgets = overlapping();
    let p = pod(Some(("Over", 9 << 30, "llm-inference")), json!({}), json!({}));
    let would = "would be evicted (observe mode: the Node's label gpubudget.io/enforcement; nothing is evicted): \
                 using 9Gi of 8Gi for 30s";
    let events = [
        event(reason::OVER, "u1", "2026-11-24T09:59:40.000000Z", "using 9Gi of 8Gi (budget team-a/llm-inference)"),
        event(reason::WOULD_EVICT, "u1", "2026-11-24T10:00:10.000000Z", would),
    ];
    let r = why(input(Some(&p), Some(&budgets), &events)).unwrap();
    assert_eq!((r.next.action, r.next.at.as_deref()), ("WouldEvict", None));
    assert!(
        r.next.message.starts_with(
            "would be evicted (observe mode: the Node's label gpubudget.io/enforcement): the agent said so at \
             2026-11-24T10:00:10Z and evicts nothing"
        ),
        "{}",
        r.next.message
    );
    let back = [
        events[0].clone(),
        events[1].clone(),
        event(reason::WITHIN, "u1", "2026-11-24T10:00:20.000000Z", "back under the limit"),
    ];
    let p = pod(Some(("Within", 1 << 30, "llm-inference")), json!({}), json!({}));
    let r = why(input(Some(&p), Some(&budgets), &back)).unwrap();
    assert_eq!(r.next.action, "Nothing", "{}", r.next.message);
    // A budget set to Observe: over it, nothing is evicted, and why says so before any event.
    let observing = [budget(
        "llm-inference",
        "8Gi",
        json!({"matchLabels": {"app": "llm"}}),
        json!({"overLimitSeconds": 30, "enforcement": "Observe"}),
    )];
    let p = pod(Some(("Over", 9 << 30, "llm-inference")), json!({}), json!({}));
    let r = why(input(Some(&p), Some(&observing), &events[..1])).unwrap();
    assert_eq!(r.next.action, "Nothing", "{}", r.next.message);
    assert!(
        r.next.message.contains("it would be evicted, and is not: the budget's enforcement is Observe"),
        "{}",
        r.next.message
    );
}
