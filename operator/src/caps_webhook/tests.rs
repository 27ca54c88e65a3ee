use super::*;
use gpubudget_common::caps::{ANNOTATION, MEMORY_LIMIT, MPS_LIMIT, Outcome};
use serde_json::{Value, json};

fn budget(name: &str, limit: &str, selector: &str, caps: bool) -> Budget {
    let caps = if caps { ", admissionCaps: Enabled" } else { "" };
    let spec = serde_yaml::from_str(&format!("{{selector: {selector}, limit: {limit}{caps}}}")).expect("spec");
    Budget::from_spec("team-a", name, &spec).expect("valid")
}

fn review(operation: &str, resource: &str, sub: Option<&str>, object: Value) -> AdmissionRequest<DynamicObject> {
    let review = json!({
        "apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
        "request": {
            "uid": "req-1", "kind": {"group": "", "version": "v1", "kind": "Pod"},
            "resource": {"group": "", "version": "v1", "resource": resource},
            "subResource": sub, "requestKind": {"group": "", "version": "v1", "kind": "Pod"},
            "name": "", "namespace": "team-a", "operation": operation,
            "userInfo": {"username": "alice"}, "object": object, "dryRun": false,
        }
    });
    let review: AdmissionReview<DynamicObject> = serde_json::from_value(review).expect("review fixture");
    review.try_into().expect("request")
}

fn gpu_pod(labels: Value, annotations: Value, env: Value) -> Value {
    json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"generateName": "trainer-", "namespace": "team-a", "labels": labels, "annotations": annotations},
        "spec": {"containers": [
            {"name": "main", "image": "pytorch", "resources": {"limits": {"nvidia.com/gpu": "1"}}, "env": env},
        ]},
    })
}

/// The pod after the response's patch, as the API server would store it.
fn patched(object: &Value, response: &AdmissionResponse) -> Value {
    let review = serde_json::to_value(response.clone().into_review()).expect("json");
    let mut pod = object.clone();
    if let Some(bytes) = &response.patch {
        assert_eq!(review["response"]["patchType"], "JSONPatch");
        let patch: json_patch::Patch = serde_json::from_slice(bytes).expect("a JSON patch");
        json_patch::patch(&mut pod, &patch).expect("applies");
    }
    pod
}

fn env(pod: &Value) -> Vec<(String, String)> {
    pod["spec"]["containers"][0]["env"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|e| {
            (e["name"].as_str().unwrap_or_default().to_owned(), e["value"].as_str().unwrap_or("<from>").to_owned())
        })
        .collect()
}

#[test]
fn a_pod_created_under_a_caps_budget_gets_the_variables_and_the_record() {
    let object = gpu_pod(json!({"app": "llm"}), json!({}), json!([{"name": MPS_LIMIT, "value": "0=2G"}]));
    let budgets = [budget("llm", "8Gi", "{matchLabels: {app: llm}}", true)];
    let (response, verdict) = decide(&review("CREATE", "pods", None, object.clone()), &budgets, &BTreeMap::new());
    assert!(response.allowed);
    let Verdict::Capped(record) = &verdict else { panic!("{verdict:?}") };
    assert_eq!(record.containers[0].env[MPS_LIMIT], Outcome::Kept, "the user's smaller value is kept");
    let pod = patched(&object, &response);
    assert_eq!(env(&pod), [(MPS_LIMIT.into(), "0=2048M".into()), (MEMORY_LIMIT.into(), "8192".into())]);
    let annotation = pod["metadata"]["annotations"][ANNOTATION].as_str().expect("annotation");
    assert_eq!(&serde_json::from_str::<Record>(annotation).expect("record"), record);
    assert_eq!(verdict.label(), crate::metrics::CapsResult::Capped);
}

#[test]
fn a_share_budget_caps_an_absolute_share_and_a_fraction_at_its_limit() {
    let spec = serde_yaml::from_str("{selector: {}, limit: 80Gi, share: {}, admissionCaps: Enabled}").expect("spec");
    let budgets = [Budget::from_spec("team-a", "shares", &spec).expect("valid")];
    let mut hami = gpu_pod(json!({}), json!({}), json!([]));
    hami["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpumem"] = json!("10240");
    let (response, _) = decide(&review("CREATE", "pods", None, hami.clone()), &budgets, &BTreeMap::new());
    // The share is the pod's request too (its scheduler reserved it).
    let want: [(String, String); 3] = [
        (MPS_LIMIT.into(), "0=10240M".into()),
        (MEMORY_LIMIT.into(), "10240".into()),
        (gpubudget_common::caps::MEMORY_REQUEST.into(), "10240".into()),
    ];
    assert_eq!(env(&patched(&hami, &response)), want);
    // A KAI fraction's size is the node's to know: capped at the budget's limit, never at a guess.
    let mut kai = gpu_pod(json!({}), json!({"gpu-fraction": "0.5"}), json!([]));
    kai["spec"]["schedulerName"] = json!("kai-scheduler");
    let (response, _) = decide(&review("CREATE", "pods", None, kai.clone()), &budgets, &BTreeMap::new());
    assert_eq!(
        env(&patched(&kai, &response)),
        [(MPS_LIMIT.into(), "0=81920M".into()), (MEMORY_LIMIT.into(), "81920".into())]
    );
}

#[test]
fn the_budget_that_applies_decides_even_without_caps() {
    let object = gpu_pod(json!({"app": "llm"}), json!({}), json!([]));
    // The smaller limit applies (as for eviction), with rules no looser than the other budget's (#51): its caps
    // disabled do not turn off the wider budget's, so the pod is capped at the smaller limit.
    let budgets = [budget("wide", "16Gi", "{}", true), budget("llm", "8Gi", "{matchLabels: {app: llm}}", false)];
    let (response, verdict) = decide(&review("CREATE", "pods", None, object.clone()), &budgets, &BTreeMap::new());
    assert!(response.allowed && matches!(&verdict, Verdict::Capped(r) if r.budget == "llm" && r.limit_mib == 8192));
    assert_eq!(env(&patched(&object, &response))[1], (MEMORY_LIMIT.into(), "8192".into()));
    // Alone, the budget without caps sets nothing.
    let alone = [budget("llm", "8Gi", "{matchLabels: {app: llm}}", false)];
    let (response, verdict) = decide(&review("CREATE", "pods", None, object.clone()), &alone, &BTreeMap::new());
    assert_eq!((response.allowed, verdict), (true, Verdict::NoCaps));
    assert_eq!(patched(&object, &response), object);
    // A pod the caps budget alone selects gets its limit.
    let other = gpu_pod(json!({"app": "batch"}), json!({}), json!([]));
    let (response, _) = decide(&review("CREATE", "pods", None, other.clone()), &budgets, &BTreeMap::new());
    assert_eq!(env(&patched(&other, &response))[1], (MEMORY_LIMIT.into(), "16384".into()));
}

#[test]
fn a_record_written_by_the_pods_author_never_survives_creation() {
    let forged = json!({ANNOTATION: "{\"budget\":\"llm\",\"limitMib\":1,\"containers\":[]}"});
    // Under a caps budget: replaced by the real record.
    let object = gpu_pod(json!({"app": "llm"}), forged.clone(), json!([]));
    let budgets = [budget("llm", "8Gi", "{}", true)];
    let (response, _) = decide(&review("CREATE", "pods", None, object.clone()), &budgets, &BTreeMap::new());
    let pod = patched(&object, &response);
    let record: Record =
        serde_json::from_str(pod["metadata"]["annotations"][ANNOTATION].as_str().expect("a")).expect("record");
    assert_eq!((record.limit_mib, record.containers.len()), (8192, 1));
    // Without one: removed.
    let (response, verdict) = decide(&review("CREATE", "pods", None, object.clone()), &[], &BTreeMap::new());
    assert_eq!(verdict, Verdict::NoCaps);
    assert!(patched(&object, &response)["metadata"]["annotations"].get(ANNOTATION).is_none());
}

#[test]
fn only_pod_creations_are_touched_and_trouble_never_refuses_a_pod() {
    let object = gpu_pod(json!({}), json!({}), json!([]));
    let budgets = [budget("llm", "8Gi", "{}", true)];
    for (operation, resource, sub) in
        [("UPDATE", "pods", None), ("CREATE", "pods", Some("binding")), ("CREATE", "configmaps", None)]
    {
        let (response, verdict) = decide(&review(operation, resource, sub, object.clone()), &budgets, &BTreeMap::new());
        assert_eq!((response.allowed, response.patch.is_none(), verdict), (true, true, Verdict::NotPodCreate));
    }
    let broken = json!({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p"}, "spec": {"containers": "nope"}});
    let (response, verdict) = decide(&review("CREATE", "pods", None, broken), &budgets, &BTreeMap::new());
    assert!(response.allowed && response.patch.is_none());
    assert!(matches!(&verdict, Verdict::Failed(why) if why.contains("cannot be read")), "{verdict:?}");
    assert_eq!(verdict.label(), crate::metrics::CapsResult::Failed);
}

fn cluster_budget(name: &str, limit: &str, namespace_selector: &str, caps: bool) -> Budget {
    let caps = if caps { ", admissionCaps: Enabled" } else { "" };
    let resource: gpubudget_common::ClusterGpuMemoryBudget = serde_yaml::from_str(&format!(
        "apiVersion: gpubudget.io/v1alpha1\nkind: ClusterGpuMemoryBudget\nmetadata: {{name: {name}}}\n\
         spec: {{namespaceSelector: {namespace_selector}, selector: {{}}, limit: {limit}{caps}}}\n"
    ))
    .expect("fixture");
    Budget::compile_cluster(&resource).expect("valid")
}

/// #23: a ClusterGpuMemoryBudget with `admissionCaps: Enabled` caps the pods it applies to, read with the
/// namespace's labels at admission; a namespace it does not select, or a tighter namespaced budget without
/// caps, is not capped by it.
#[test]
fn a_cluster_budget_with_caps_caps_the_pods_it_applies_to() {
    let object = gpu_pod(json!({"app": "llm"}), json!({}), json!([]));
    let tenants: BTreeMap<String, String> = [("tier".to_owned(), "tenant".to_owned())].into();
    let cluster = cluster_budget("tenants", "16Gi", "{matchLabels: {tier: tenant}}", true);
    let (response, verdict) =
        decide(&review("CREATE", "pods", None, object.clone()), std::slice::from_ref(&cluster), &tenants);
    let Verdict::Capped(record) = &verdict else { panic!("{verdict:?}") };
    assert_eq!((record.budget.as_str(), record.limit_mib), ("ClusterGpuMemoryBudget/tenants", 16384));
    assert!(env(&patched(&object, &response)).contains(&(MEMORY_LIMIT.into(), "16384".into())));
    // The namespace is not (or no longer) labelled for it: no caps.
    let (_, verdict) =
        decide(&review("CREATE", "pods", None, object.clone()), std::slice::from_ref(&cluster), &BTreeMap::new());
    assert_eq!(verdict, Verdict::NoCaps);
    // A namespaced budget tighter in every field takes over: its caps (here enabled) at its limit.
    let both = [budget("llm", "8Gi", "{}", true), cluster.clone()];
    let (_, verdict) = decide(&review("CREATE", "pods", None, object.clone()), &both, &tenants);
    let Verdict::Capped(record) = &verdict else { panic!("{verdict:?}") };
    assert_eq!((record.budget.as_str(), record.limit_mib), ("llm", 8192));
    // One without caps is looser than the cluster budget (caps off): it cannot take over, the cluster caps hold.
    let both = [budget("llm", "8Gi", "{}", false), cluster];
    let (_, verdict) = decide(&review("CREATE", "pods", None, object), &both, &tenants);
    let Verdict::Capped(record) = &verdict else { panic!("{verdict:?}") };
    assert_eq!((record.budget.as_str(), record.limit_mib), ("ClusterGpuMemoryBudget/tenants", 16384));
}

fn ephemeral_review(old: Value, new: Value) -> AdmissionRequest<DynamicObject> {
    let review = json!({
        "apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
        "request": {
            "uid": "req-2", "kind": {"group": "", "version": "v1", "kind": "Pod"},
            "resource": {"group": "", "version": "v1", "resource": "pods"},
            "subResource": "ephemeralcontainers", "requestKind": {"group": "", "version": "v1", "kind": "Pod"},
            "name": "trainer-x", "namespace": "team-a", "operation": "UPDATE",
            "userInfo": {"username": "alice"}, "object": new, "oldObject": old, "dryRun": false,
        }
    });
    let review: AdmissionReview<DynamicObject> = serde_json::from_value(review).expect("review fixture");
    review.try_into().expect("request")
}

/// #32 item 3: `kubectl debug` adds ephemeral containers through `pods/ephemeralcontainers`; a new one that
/// gets a GPU through `NVIDIA_VISIBLE_DEVICES` is capped there; one without a GPU is left alone.
#[test]
fn ephemeral_gpu_containers_are_capped_when_they_are_added() {
    let old = gpu_pod(json!({"app": "llm"}), json!({}), json!([]));
    let mut new = old.clone();
    new["spec"]["ephemeralContainers"] = json!([
        {"name": "debug", "image": "cuda", "env": [{"name": "NVIDIA_VISIBLE_DEVICES", "value": "0"}]},
    ]);
    let budgets = [budget("llm", "8Gi", "{}", true)];
    let (response, verdict) = decide(&ephemeral_review(old.clone(), new.clone()), &budgets, &BTreeMap::new());
    let Verdict::Capped(record) = &verdict else { panic!("{verdict:?}") };
    assert_eq!(record.containers[0].name, "debug");
    let pod = patched(&new, &response);
    let env: Vec<(&str, &str)> = pod["spec"]["ephemeralContainers"][0]["env"]
        .as_array()
        .expect("env")
        .iter()
        .map(|e| (e["name"].as_str().unwrap_or_default(), e["value"].as_str().unwrap_or_default()))
        .collect();
    assert_eq!(env, [("NVIDIA_VISIBLE_DEVICES", "0"), (MPS_LIMIT, "0=8192M"), (MEMORY_LIMIT, "8192")]);
    assert_eq!(pod["metadata"], new["metadata"], "the record is not touched at the subresource");
    // A shell without a GPU: nothing to do.
    let mut shell = old.clone();
    shell["spec"]["ephemeralContainers"] = json!([{"name": "sh", "image": "busybox"}]);
    let (response, verdict) = decide(&ephemeral_review(old, shell), &budgets, &BTreeMap::new());
    assert_eq!((verdict, response.patch.is_none()), (Verdict::NotPodCreate, true));
}

/// #32 item 2: a 1.5 MB value (the API server accepts 3 MB bodies) is replaced unread; the decision stays
/// linear (its time is in `cargo bench -p gpubudget-operator --bench caps`).
#[test]
fn a_huge_value_is_replaced_by_the_canonical_one() {
    let huge: String = (0..200_000).map(|i| format!("{}=1024M,", i % 7)).collect();
    assert!(huge.len() > 1_500_000);
    let object = gpu_pod(json!({}), json!({}), json!([{"name": MPS_LIMIT, "value": huge}]));
    let budgets = [budget("llm", "8Gi", "{}", true)];
    let (response, verdict) = decide(&review("CREATE", "pods", None, object.clone()), &budgets, &BTreeMap::new());
    let Verdict::Capped(record) = &verdict else { panic!("{verdict:?}") };
    assert_eq!(record.containers[0].env[MPS_LIMIT], Outcome::Replaced);
    assert!(response.patch.as_ref().is_some_and(|p| p.len() < 2_000), "the patch does not carry the value back");
    assert_eq!(env(&patched(&object, &response))[0], (MPS_LIMIT.into(), "0=8192M".into()));
}
