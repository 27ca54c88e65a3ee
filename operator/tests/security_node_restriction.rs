//! The agent's own-node restriction, tested against admission requests: the chart's
//! ValidatingAdmissionPolicy (charts/gpubudget/templates/node-restriction/policy.yaml), rendered from the
//! template by substituting its few template values, evaluated with the CEL of `kube-cel` (the Kubernetes
//! extension functions on `cel`), with `variables` evaluated in order and bound as the API server does and
//! `request.userInfo.extra` carrying the node the agent's token is bound to (through its pod, as the kubelet
//! projects it, or a Node-bound token).
//!
//! A request passes when the match condition does not match (another identity: the policy does not apply)
//! or every validation is true; an evaluation error denies (`failurePolicy: Fail`).

use std::collections::HashMap;
use std::sync::Arc;

use kube_cel::KubeCelExt;
use kube_cel::cel::objects::{Key, Map};
use kube_cel::cel::{Context, Program, Value};
use serde_json::{Value as Json, json};

const AGENT: &str = "system:serviceaccount:gpubudget:gpubudget-agent";
const NODE: &str = "gpu-node-1";
/// KAI-Scheduler's identities the chart exempts by default (values.yaml `shares.kai`).
const KAI: &str = "system:serviceaccount:kai-scheduler:kai-scheduler";
const KAI_BINDER: &str = "system:serviceaccount:kai-scheduler:binder";

/// A template's policies: the `if`/`end` and label-include lines dropped, the agent's user name substituted.
fn render(template: &str) -> Vec<serde_yaml::Value> {
    let rendered: String = template
        .lines()
        .filter(|l| !l.trim_start().starts_with("{{-"))
        .map(|l| {
            l.replace("{{ $agent }}", AGENT)
                .replace("{{ $name }}", "gpubudget-agent-node-restriction")
                .replace("{{ $who }}", &format!("['{KAI}', '{KAI_BINDER}']"))
        })
        .collect::<Vec<_>>()
        .join("\n");
    assert!(!rendered.contains("{{"), "an unrendered template value is left:\n{rendered}");
    serde_yaml::Deserializer::from_str(&rendered)
        .map(|d| serde::Deserialize::deserialize(d).expect("rendered YAML"))
        .filter(|d: &serde_yaml::Value| d["kind"] == "ValidatingAdmissionPolicy")
        .collect()
}

/// The chart's node-restriction policies (pods, events and the nodes' usage objects).
fn policies() -> Vec<serde_yaml::Value> {
    let docs = render(include_str!("../../charts/gpubudget/templates/node-restriction/policy.yaml"));
    assert_eq!(docs.len(), 3, "the pods, events and usage policies");
    docs
}

/// The policy that keeps the agent's records the agent's.
fn records_policy() -> serde_yaml::Value {
    let mut docs = render(include_str!("../../charts/gpubudget/templates/node-restriction/records-policy.yaml"));
    assert_eq!(docs.len(), 1, "one records policy");
    docs.remove(0)
}

fn policy(resource: &str) -> serde_yaml::Value {
    policies()
        .into_iter()
        .find(|p| p["spec"]["matchConstraints"]["resourceRules"][0]["resources"][0].as_str() == Some(resource))
        .expect("policy for the resource")
}

fn to_cel(value: &Json) -> Value {
    match value {
        Json::Null => Value::Null,
        Json::Bool(b) => Value::Bool(*b),
        Json::Number(n) => n.as_i64().map_or_else(|| Value::Float(n.as_f64().unwrap_or(0.0)), Value::Int),
        Json::String(s) => Value::String(Arc::new(s.clone())),
        Json::Array(items) => Value::List(Arc::new(items.iter().map(to_cel).collect())),
        Json::Object(map) => cel_map(map.iter().map(|(k, v)| (k.clone(), to_cel(v)))),
    }
}

fn cel_map(entries: impl IntoIterator<Item = (String, Value)>) -> Value {
    let map: HashMap<Key, Value> = entries.into_iter().map(|(k, v)| (Key::String(Arc::new(k)), v)).collect();
    Value::Map(Map { map: Arc::new(map) })
}

#[derive(Debug, PartialEq)]
enum Verdict {
    /// The policy does not apply (another identity).
    NotMatched,
    Allowed,
    /// Denied, with the message.
    Denied(String),
}

fn eval(ctx: &Context<'_>, expression: &str) -> Result<Value, String> {
    let program = Program::compile(expression).map_err(|e| format!("compile {expression}: {e}"))?;
    program.execute(ctx).map_err(|e| format!("evaluate {expression}: {e}"))
}

/// Evaluates a policy against one admission request, as the API server does.
fn admit(policy: &serde_yaml::Value, request: Json, object: Json, old: Json) -> Verdict {
    let mut ctx = Context::default().with_all();
    ctx.add_variable_from_value("request", to_cel(&request));
    ctx.add_variable_from_value("object", to_cel(&object));
    ctx.add_variable_from_value("oldObject", to_cel(&old));
    let spec = &policy["spec"];
    for condition in spec["matchConditions"].as_sequence().into_iter().flatten() {
        match eval(&ctx, condition["expression"].as_str().expect("expression")) {
            Ok(Value::Bool(true)) => {}
            Ok(Value::Bool(false)) => return Verdict::NotMatched,
            other => return Verdict::Denied(format!("match condition: {other:?}")),
        }
    }
    let mut variables: Vec<(String, Value)> = Vec::new();
    for variable in spec["variables"].as_sequence().into_iter().flatten() {
        let name = variable["name"].as_str().expect("name").to_owned();
        // Lazily evaluated by the API server: an error only matters where the variable is used.
        let value = eval(&ctx, variable["expression"].as_str().expect("expression")).unwrap_or(Value::Null);
        variables.push((name, value));
        ctx.add_variable_from_value("variables", cel_map(variables.clone()));
    }
    for validation in spec["validations"].as_sequence().expect("validations") {
        let expression = validation["expression"].as_str().expect("expression");
        match eval(&ctx, expression) {
            Ok(Value::Bool(true)) => {}
            Ok(Value::Bool(false)) => {
                let message = validation["messageExpression"]
                    .as_str()
                    .and_then(|m| match eval(&ctx, m) {
                        Ok(Value::String(s)) => Some((*s).clone()),
                        _ => None,
                    })
                    .or_else(|| validation["message"].as_str().map(str::to_owned))
                    .unwrap_or_default();
                return Verdict::Denied(message);
            }
            other => return Verdict::Denied(format!("{expression}: {other:?}")),
        }
    }
    Verdict::Allowed
}

fn request(user: &str, node: Option<&str>, operation: &str) -> Json {
    let mut user_info = json!({"username": user, "uid": "u", "groups": ["system:serviceaccounts"]});
    if let Some(node) = node {
        user_info["extra"] = json!({"authentication.kubernetes.io/node-name": [node]});
    }
    json!({"operation": operation, "name": "llm-0", "namespace": "team-a", "userInfo": user_info})
}

fn pod(node: &str) -> Json {
    json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": "llm-0", "namespace": "team-a", "labels": {"app": "llm"},
                     "annotations": {"owner": "team-a"}},
        "spec": {"nodeName": node, "containers": [{"name": "main", "image": "x"}]}
    })
}

fn with_annotation(mut pod: Json, key: &str, value: &str) -> Json {
    pod["metadata"]["annotations"][key] = json!(value);
    pod
}

#[test]
fn the_agent_may_write_its_records_on_its_own_nodes_pods() {
    let p = policy("pods");
    let old = pod(NODE);
    let new =
        with_annotation(with_annotation(old.clone(), "gpubudget.io/state", "Evicting"), "gpubudget.io/node", NODE);
    assert_eq!(admit(&p, request(AGENT, Some(NODE), "UPDATE"), new.clone(), old.clone()), Verdict::Allowed);
    // Removing its record again (a pod that lost its budget).
    assert_eq!(admit(&p, request(AGENT, Some(NODE), "UPDATE"), old.clone(), new), Verdict::Allowed);
    // A no-op update.
    assert_eq!(admit(&p, request(AGENT, Some(NODE), "UPDATE"), old.clone(), old), Verdict::Allowed);
}

#[test]
fn the_agent_may_not_write_pods_of_another_node() {
    let p = policy("pods");
    let old = pod("gpu-node-2");
    let new = with_annotation(old.clone(), "gpubudget.io/state", "Evicting");
    let verdict = admit(&p, request(AGENT, Some(NODE), "UPDATE"), new, old);
    assert!(matches!(&verdict, Verdict::Denied(m) if m.contains("not on its node")), "{verdict:?}");
    // Moving a pod onto its node does not help: the old object's node counts, and the spec is frozen.
    let old = pod("gpu-node-2");
    let verdict = admit(&p, request(AGENT, Some(NODE), "UPDATE"), pod(NODE), old);
    assert!(matches!(verdict, Verdict::Denied(_)), "{verdict:?}");
}

#[test]
fn the_agent_may_change_nothing_but_its_annotations() {
    let p = policy("pods");
    let old = pod(NODE);
    let mut labels = old.clone();
    labels["metadata"]["labels"]["app"] = json!("other");
    let mut spec = old.clone();
    spec["spec"]["containers"][0]["image"] = json!("evil");
    let other_annotation = with_annotation(old.clone(), "owner", "someone-else");
    let new_annotation = with_annotation(old.clone(), "example.com/x", "1");
    let mut removed = old.clone();
    removed["metadata"]["annotations"] = json!({});
    let mut finalizers = old.clone();
    finalizers["metadata"]["finalizers"] = json!(["example.com/block"]);
    for (what, new, needle) in [
        ("labels", labels, "labels"),
        ("spec", spec, "spec"),
        ("another annotation", other_annotation, "annotations"),
        ("a new foreign annotation", new_annotation, "annotations"),
        ("removing a foreign annotation", removed, "annotations"),
        ("finalizers", finalizers, "finalizers"),
    ] {
        let verdict = admit(&p, request(AGENT, Some(NODE), "UPDATE"), new, old.clone());
        assert!(matches!(&verdict, Verdict::Denied(m) if m.contains(needle)), "{what}: {verdict:?}");
    }
}

#[test]
fn the_agent_may_delete_only_its_own_nodes_pods_never_create_nor_act_without_a_node_bound_token() {
    let p = policy("pods");
    // DELETE: the fallback after evictions were refused for blockedEvictionTimeoutSeconds (#11).
    assert_eq!(admit(&p, request(AGENT, Some(NODE), "DELETE"), Json::Null, pod(NODE)), Verdict::Allowed);
    let verdict = admit(&p, request(AGENT, Some(NODE), "DELETE"), Json::Null, pod("gpu-node-2"));
    assert!(matches!(&verdict, Verdict::Denied(m) if m.contains("not on its node")), "{verdict:?}");
    let verdict = admit(&p, request(AGENT, None, "DELETE"), Json::Null, pod(NODE));
    assert!(matches!(&verdict, Verdict::Denied(m) if m.contains("carries no node")), "{verdict:?}");
    let verdict = admit(&p, request(AGENT, Some(NODE), "CREATE"), pod(NODE), Json::Null);
    assert!(matches!(&verdict, Verdict::Denied(m) if m.contains("never CREATE")), "{verdict:?}");
    // A token without the node claim (a legacy secret token, or Kubernetes < 1.32).
    let old = pod(NODE);
    let new = with_annotation(old.clone(), "gpubudget.io/state", "Over");
    let verdict = admit(&p, request(AGENT, None, "UPDATE"), new, old);
    assert!(matches!(&verdict, Verdict::Denied(m) if m.contains("carries no node")), "{verdict:?}");
}

#[test]
fn other_identities_are_not_this_policys_concern() {
    let p = policy("pods");
    let old = pod("gpu-node-2");
    let mut new = with_annotation(old.clone(), "gpubudget.io/state", "Evicting");
    new["spec"]["containers"][0]["image"] = json!("other");
    for user in ["system:serviceaccount:gpubudget:gpubudget-operator", "alice", "system:node:gpu-node-1"] {
        assert_eq!(admit(&p, request(user, Some(NODE), "UPDATE"), new.clone(), old.clone()), Verdict::NotMatched);
    }
    // An agent of another release (another service account name) is another identity too.
    let other = "system:serviceaccount:other:gpubudget-agent";
    assert_eq!(admit(&p, request(other, Some(NODE), "UPDATE"), new, old), Verdict::NotMatched);
}

#[test]
fn the_agents_events_must_name_its_own_node() {
    let p = policy("events");
    let event = |instance: &str| {
        json!({"apiVersion": "events.k8s.io/v1", "kind": "Event", "metadata": {"name": "e", "namespace": "team-a"},
               "reportingController": "gpubudget-agent", "reportingInstance": instance, "reason": "GpuMemoryOverBudget",
               "regarding": {"apiVersion": "v1", "kind": "Pod", "namespace": "team-a", "name": "p"}})
    };
    assert_eq!(admit(&p, request(AGENT, Some(NODE), "CREATE"), event(NODE), Json::Null), Verdict::Allowed);
    // #11 hardening: about a pod of the event's namespace, or its own Node; nothing else.
    let about = |kind: &str, namespace: Option<&str>, name: &str| {
        let mut e = event(NODE);
        e["regarding"] = json!({"kind": kind, "name": name});
        if let Some(ns) = namespace {
            e["regarding"]["namespace"] = json!(ns);
        }
        e
    };
    let own_node = about("Node", None, NODE);
    assert_eq!(admit(&p, request(AGENT, Some(NODE), "CREATE"), own_node, Json::Null), Verdict::Allowed);
    for (what, e) in [
        ("another node", about("Node", None, "gpu-node-2")),
        ("a pod of another namespace", about("Pod", Some("team-b"), "p")),
        ("a budget", about("GpuMemoryBudget", Some("team-a"), "b")),
        ("nothing", {
            let mut e = event(NODE);
            e.as_object_mut().unwrap().remove("regarding");
            e
        }),
    ] {
        let verdict = admit(&p, request(AGENT, Some(NODE), "CREATE"), e, Json::Null);
        assert!(matches!(&verdict, Verdict::Denied(m) if m.contains("may be about pods")), "{what}: {verdict:?}");
    }
    let verdict = admit(&p, request(AGENT, Some(NODE), "CREATE"), event("gpu-node-2"), Json::Null);
    assert!(matches!(&verdict, Verdict::Denied(m) if m.contains("reportingInstance")), "{verdict:?}");
    let mut foreign = event(NODE);
    foreign["reportingController"] = json!("kubelet");
    assert!(matches!(admit(&p, request(AGENT, Some(NODE), "CREATE"), foreign, Json::Null), Verdict::Denied(_)));
    assert_eq!(admit(&p, request("alice", None, "CREATE"), event("x"), Json::Null), Verdict::NotMatched);
}

#[test]
fn no_one_but_the_agent_writes_records() {
    let p = records_policy();
    let tenant = "system:serviceaccount:team-a:deployer";
    let plain = pod(NODE);
    let forged = with_annotation(
        with_annotation(pod(NODE), "gpubudget.io/state", "Evicting"),
        "gpubudget.io/eviction-requested-at",
        "2026-11-21T18:00:00Z",
    );
    // A tenant creating a pod with a forged record, or forging one on an existing pod: refused.
    assert!(
        matches!(admit(&p, request(tenant, None, "CREATE"), forged.clone(), Json::Null), Verdict::Denied(m) if m.contains("only the agent"))
    );
    assert!(matches!(admit(&p, request(tenant, None, "UPDATE"), forged.clone(), plain.clone()), Verdict::Denied(_)));
    // Changing or removing the agent's record: refused too.
    let recorded = with_annotation(pod(NODE), "gpubudget.io/state", "Over");
    let edited = with_annotation(pod(NODE), "gpubudget.io/state", "Within");
    assert!(matches!(admit(&p, request(tenant, None, "UPDATE"), edited, recorded.clone()), Verdict::Denied(_)));
    assert!(matches!(admit(&p, request(tenant, None, "UPDATE"), plain.clone(), recorded.clone()), Verdict::Denied(_)));
    // Everything else a tenant does to a pod is none of this policy's business, the record kept as it was.
    assert_eq!(admit(&p, request(tenant, None, "CREATE"), plain.clone(), Json::Null), Verdict::Allowed);
    let relabelled = {
        let mut p = recorded.clone();
        p["metadata"]["labels"]["app"] = json!("other");
        p["metadata"]["annotations"]["owner"] = json!("team-b");
        p
    };
    assert_eq!(admit(&p, request(tenant, None, "UPDATE"), relabelled, recorded.clone()), Verdict::Allowed);
    // The agent itself is not matched (its own policy governs it).
    assert_eq!(admit(&p, request(AGENT, Some(NODE), "UPDATE"), forged, plain), Verdict::NotMatched);
}

/// The chart's policy that keeps the caps webhook's record (`gpubudget.io/caps`) as written at creation.
fn caps_record_policy() -> serde_yaml::Value {
    let mut docs = render(include_str!("../../charts/gpubudget/templates/operator/caps-record-policy.yaml"));
    assert_eq!(docs.len(), 1, "one caps record policy");
    docs.remove(0)
}

#[test]
fn no_one_adds_changes_or_removes_the_caps_record_after_creation() {
    let p = caps_record_policy();
    assert!(p["spec"]["matchConditions"].is_null(), "it applies to every identity, the operator's included");
    let tenant = "system:serviceaccount:team-a:deployer";
    let record = r#"{"budget":"llm","limitMib":8192,"containers":[]}"#;
    let plain = pod(NODE);
    let capped = with_annotation(pod(NODE), "gpubudget.io/caps", record);
    let forged = with_annotation(pod(NODE), "gpubudget.io/caps", r#"{"budget":"llm","limitMib":1,"containers":[]}"#);
    let denied = |v: Verdict| matches!(v, Verdict::Denied(m) if m.contains("cannot be added, changed or removed"));
    // Adding one to a pod created without (the webhook was down): refused.
    assert!(denied(admit(&p, request(tenant, None, "UPDATE"), capped.clone(), plain.clone())));
    // Changing or removing the webhook's: refused, whoever asks.
    assert!(denied(admit(&p, request(tenant, None, "UPDATE"), forged.clone(), capped.clone())));
    assert!(denied(admit(&p, request(tenant, None, "UPDATE"), plain.clone(), capped.clone())));
    assert!(denied(admit(&p, request(AGENT, Some(NODE), "UPDATE"), forged, capped.clone())));
    // Any other update, the record kept as it was: allowed.
    let relabelled = {
        let mut p = capped.clone();
        p["metadata"]["labels"]["app"] = json!("other");
        p
    };
    assert_eq!(admit(&p, request(tenant, None, "UPDATE"), relabelled, capped.clone()), Verdict::Allowed);
    assert_eq!(admit(&p, request(tenant, None, "UPDATE"), plain.clone(), plain), Verdict::Allowed);
}

#[test]
fn the_agents_records_policy_leaves_the_caps_record_to_admission() {
    // At creation the caps webhook writes gpubudget.io/caps in the creator's request: the agent's records
    // policy must let that through (and still refuse the agent's own keys).
    let p = records_policy();
    let tenant = "system:serviceaccount:team-a:deployer";
    let capped = with_annotation(pod(NODE), "gpubudget.io/caps", r#"{"budget":"llm"}"#);
    assert_eq!(admit(&p, request(tenant, None, "CREATE"), capped.clone(), Json::Null), Verdict::Allowed);
    let both = with_annotation(capped, "gpubudget.io/state", "Within");
    assert!(matches!(admit(&p, request(tenant, None, "CREATE"), both, Json::Null), Verdict::Denied(_)));
}

fn usage_request(node: Option<&str>, operation: &str, name: &str) -> Json {
    let mut r = request(AGENT, node, operation);
    r["name"] = json!(name);
    r["namespace"] = json!("");
    r
}

fn usage(name: &str, node_name: &str, owner: Option<&str>) -> Json {
    let mut o = json!({
        "apiVersion": "gpubudget.io/v1alpha1", "kind": "GpuNodeUsage",
        "metadata": {"name": name},
        "spec": {"nodeName": node_name, "observedAt": "2026-11-26T23:00:00Z", "podCount": 0, "total": "0", "pods": []}
    });
    if let Some(owner) = owner {
        o["metadata"]["ownerReferences"] = json!([{"apiVersion": "v1", "kind": "Node", "name": owner, "uid": "n"}]);
    }
    o
}

/// #34: an agent writes the usage object of its own node only, naming its node, owned by its Node.
#[test]
fn the_agent_writes_only_its_own_nodes_usage_object() {
    let p = policy("gpunodeusages");
    let own = usage(NODE, NODE, Some(NODE));
    assert_eq!(admit(&p, usage_request(Some(NODE), "CREATE", NODE), own.clone(), Json::Null), Verdict::Allowed);
    assert_eq!(admit(&p, usage_request(Some(NODE), "UPDATE", NODE), own.clone(), own.clone()), Verdict::Allowed);
    let unowned = usage(NODE, NODE, None);
    assert_eq!(admit(&p, usage_request(Some(NODE), "CREATE", NODE), unowned, Json::Null), Verdict::Allowed);
    assert_eq!(admit(&p, usage_request(Some(NODE), "DELETE", NODE), Json::Null, own.clone()), Verdict::Allowed);
    let other = "gpu-node-2";
    for (what, req, object, needle) in [
        (
            "another node's object",
            usage_request(Some(NODE), "UPDATE", other),
            usage(other, other, None),
            "may write only",
        ),
        (
            "its object naming another node",
            usage_request(Some(NODE), "UPDATE", NODE),
            usage(NODE, other, None),
            "spec.nodeName",
        ),
        ("another node as owner", usage_request(Some(NODE), "UPDATE", NODE), usage(NODE, NODE, Some(other)), "owner"),
        ("deleting another node's", usage_request(Some(NODE), "DELETE", other), Json::Null, "may write only"),
        ("no node in the token", usage_request(None, "CREATE", NODE), usage(NODE, NODE, None), "carries no node"),
    ] {
        let verdict = admit(&p, req, object, own.clone());
        assert!(matches!(&verdict, Verdict::Denied(m) if m.contains(needle)), "{what}: {verdict:?}");
    }
    // Not the agent: RBAC decides (only the agent and administrators may write them).
    let mut admin = usage_request(None, "UPDATE", other);
    admin["userInfo"]["username"] = json!("alice");
    assert_eq!(admit(&p, admin, usage(other, NODE, None), Json::Null), Verdict::NotMatched);
}

/// The chart's policies that fix a KAI-Scheduler share once the pod is bound (#51): the pods one and the Bindings
/// one.
fn shares_policies() -> (serde_yaml::Value, serde_yaml::Value) {
    let mut docs = render(include_str!("../../charts/gpubudget/templates/node-restriction/shares-policy.yaml"));
    assert_eq!(docs.len(), 2, "the pods and Bindings policies");
    let binding = docs.remove(1);
    (docs.remove(0), binding)
}

fn kai_pod(node: Option<&str>, annotations: Json) -> Json {
    let mut p = json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": "llm-0", "namespace": "team-a", "annotations": annotations},
        "spec": {"schedulerName": "kai-scheduler", "containers": [{"name": "main", "image": "x"}]}
    });
    if let Some(node) = node {
        p["spec"]["nodeName"] = json!(node);
    }
    p
}

/// #51: a tenant (`edit`: may patch pods) cannot rewrite, add or remove a bound KAI pod's share, through the pod
/// or its status; KAI's own identities can; an unbound pod's annotations and every other change are untouched.
#[test]
fn a_bound_pods_kai_share_is_fixed_but_for_kai() {
    let (p, _) = shares_policies();
    let tenant = "system:serviceaccount:team-a:deployer";
    let placed = kai_pod(Some(NODE), json!({"gpu-fraction": "0.25", "owner": "team-a"}));
    let fixed = |m: &str| m.contains("fixed once the pod is bound");
    for (what, new) in [
        ("rewritten", json!({"gpu-fraction": "1", "owner": "team-a"})),
        ("removed", json!({"owner": "team-a"})),
        ("num-devices added", json!({"gpu-fraction": "0.25", "gpu-fraction-num-devices": "8", "owner": "team-a"})),
        ("gpu-memory instead", json!({"gpu-memory": "81920", "owner": "team-a"})),
    ] {
        let updated = kai_pod(Some(NODE), new);
        let v = admit(&p, request(tenant, None, "UPDATE"), updated.clone(), placed.clone());
        assert!(matches!(&v, Verdict::Denied(m) if fixed(m)), "{what}: {v:?}");
        assert_eq!(
            admit(&p, request(KAI_BINDER, None, "UPDATE"), updated.clone(), placed.clone()),
            Verdict::NotMatched
        );
    }
    let relabelled = kai_pod(Some(NODE), json!({"gpu-fraction": "0.25", "owner": "team-b"}));
    assert_eq!(admit(&p, request(tenant, None, "UPDATE"), relabelled, placed.clone()), Verdict::Allowed);
    let pending = kai_pod(None, json!({"gpu-fraction": "0.25"}));
    let edited = kai_pod(None, json!({"gpu-fraction": "0.5"}));
    assert_eq!(admit(&p, request(tenant, None, "UPDATE"), edited, pending.clone()), Verdict::Allowed, "not placed yet");
    assert_eq!(admit(&p, request(tenant, None, "CREATE"), pending, Json::Null), Verdict::Allowed, "KAI places it");
    // A pod another scheduler places reads no KAI share (the agent's rule): none of this policy's concern.
    let mut other = kai_pod(Some(NODE), json!({"gpu-fraction": "1"}));
    other["spec"]["schedulerName"] = json!("default-scheduler");
    assert_eq!(admit(&p, request(tenant, None, "UPDATE"), other, placed), Verdict::NotMatched);
}

/// #51: a pod created already bound (spec.nodeName) never passed KAI: it may not declare KAI's share; a Binding
/// may not carry the share annotations into the pod (the API server merges them); KAI's identities may.
#[test]
fn a_pod_that_bypassed_kai_declares_no_kai_share() {
    let (p, binding) = shares_policies();
    let tenant = "system:serviceaccount:team-a:deployer";
    for annotations in
        [json!({"gpu-fraction": "1"}), json!({"gpu-memory": "81920"}), json!({"gpu-fraction-num-devices": "2"})]
    {
        let bound = kai_pod(Some(NODE), annotations.clone());
        let v = admit(&p, request(tenant, None, "CREATE"), bound.clone(), Json::Null);
        assert!(matches!(&v, Verdict::Denied(m) if m.contains("never passed KAI-Scheduler")), "{annotations}: {v:?}");
        assert_eq!(admit(&p, request(KAI, None, "CREATE"), bound, Json::Null), Verdict::NotMatched);
        let b = json!({"apiVersion": "v1", "kind": "Binding", "metadata": {"name": "llm-0", "annotations": annotations},
                       "target": {"kind": "Node", "name": NODE}});
        let v = admit(&binding, request(tenant, None, "CREATE"), b.clone(), Json::Null);
        assert!(matches!(&v, Verdict::Denied(m) if m.contains("merges them into the pod")), "{v:?}");
        assert_eq!(admit(&binding, request(KAI_BINDER, None, "CREATE"), b, Json::Null), Verdict::NotMatched);
    }
    let plain = kai_pod(Some(NODE), json!({"owner": "team-a"}));
    assert_eq!(admit(&p, request(tenant, None, "CREATE"), plain, Json::Null), Verdict::Allowed);
    let b = json!({"apiVersion": "v1", "kind": "Binding", "metadata": {"name": "llm-0"}, "target": {"kind": "Node", "name": NODE}});
    assert_eq!(admit(&binding, request(tenant, None, "CREATE"), b, Json::Null), Verdict::Allowed);
}
