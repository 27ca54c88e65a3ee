//! The caps webhook's `matchCondition` (charts/gpubudget/templates/node-restriction/webhook.yaml), evaluated
//! with the CEL of `kube-cel` as the API server does: it must send every pod with a container that may use a
//! GPU, by every way one gets there (#32 item 3), and may skip the others.

use std::collections::HashMap;
use std::sync::Arc;

use kube_cel::KubeCelExt;
use kube_cel::cel::objects::{Key, Map};
use kube_cel::cel::{Context, Program, Value};
use serde_json::{Value as Json, json};

const TEMPLATE: &str = include_str!("../../charts/gpubudget/templates/node-restriction/webhook.yaml");

/// The rendered expression: the template's `$gpu` predicate substituted into the condition.
fn condition() -> String {
    let gpu_line = TEMPLATE.lines().find(|l| l.contains("{{- $gpu := ")).expect("the $gpu predicate");
    let gpu = gpu_line.split_once("$gpu := \"").expect("quoted").1.rsplit_once("\" }}").expect("closed").0;
    let start = TEMPLATE.find("- name: asks-for-a-gpu").expect("the condition");
    let lines: Vec<&str> = TEMPLATE[start..]
        .lines()
        .skip(2)
        .take_while(|l| !l.trim_start().starts_with("clientConfig:"))
        .map(str::trim)
        .collect();
    let expression = lines.join(" ").replace("{{ $gpu }}", gpu);
    assert!(!expression.contains("{{"), "{expression}");
    expression
}

fn to_cel(value: &Json) -> Value {
    match value {
        Json::Null => Value::Null,
        Json::Bool(b) => Value::Bool(*b),
        Json::Number(n) => n.as_i64().map_or_else(|| Value::Float(n.as_f64().unwrap_or(0.0)), Value::Int),
        Json::String(s) => Value::String(Arc::new(s.clone())),
        Json::Array(items) => Value::List(Arc::new(items.iter().map(to_cel).collect())),
        Json::Object(map) => {
            let map: HashMap<Key, Value> =
                map.iter().map(|(k, v)| (Key::String(Arc::new(k.clone())), to_cel(v))).collect();
            Value::Map(Map { map: Arc::new(map) })
        }
    }
}

fn sent(pod: &Json) -> bool {
    let mut ctx = Context::default().with_all();
    ctx.add_variable_from_value("object", to_cel(pod));
    let program = Program::compile(&condition()).expect("compiles");
    match program.execute(&ctx) {
        Ok(Value::Bool(b)) => b,
        other => panic!("{other:?}"),
    }
}

fn pod(containers: Json, extra: Json) -> Json {
    let mut pod = json!({"metadata": {"name": "p"}, "spec": {"containers": containers}});
    if let (Some(spec), Json::Object(extra)) = (pod["spec"].as_object_mut(), extra) {
        spec.extend(extra);
    }
    pod
}

#[test]
fn every_way_to_a_gpu_is_sent_to_the_webhook() {
    let cpu = json!([{"name": "web", "resources": {"limits": {"cpu": "1"}}, "env": [{"name": "A", "value": "1"}]}]);
    assert!(!sent(&pod(cpu.clone(), json!({}))), "a CPU pod is not sent");
    for (what, container) in [
        ("gpu", json!({"name": "c", "resources": {"limits": {"nvidia.com/gpu": "1"}}})),
        ("shared", json!({"name": "c", "resources": {"limits": {"nvidia.com/gpu.shared": "1"}}})),
        ("mig", json!({"name": "c", "resources": {"limits": {"nvidia.com/mig-1g.10gb": "1"}}})),
        ("dra", json!({"name": "c", "resources": {"claims": [{"name": "gpu"}]}})),
        ("env", json!({"name": "c", "env": [{"name": "NVIDIA_VISIBLE_DEVICES", "value": "all"}]})),
    ] {
        assert!(sent(&pod(json!([container.clone()]), json!({}))), "{what} in a container");
        assert!(sent(&pod(cpu.clone(), json!({"initContainers": [container.clone()]}))), "{what} in an init container");
        assert!(
            sent(&pod(cpu.clone(), json!({"ephemeralContainers": [container]}))),
            "{what} in an ephemeral container"
        );
    }
    let mut forged = pod(cpu, json!({}));
    forged["metadata"]["annotations"] = json!({"gpubudget.io/caps": "{}"});
    assert!(sent(&forged), "a forged record is sent, to be removed");
}
