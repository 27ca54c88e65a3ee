//! CRD schema defaults: the fake applies the stored CRD's OpenAPI `default`s as the API server does, on every
//! kind of write, so a budget that omits a defaulted field reads back (and prints in `kubectl get`) with it.

use gpubudget_testkit::{FakeApi, Verb};
use kube::api::{Api, ApiResource, DynamicObject, GroupVersionKind, Patch, PatchParams, PostParams};
use serde_json::{Value, json};

/// The generated CRD, as `kubectl apply -f crds/` installs it.
const CRD: &str = include_str!("../../crds/gpumemorybudgets.gpubudget.io.yaml");

fn budgets(fake: &FakeApi) -> Api<DynamicObject> {
    let gvk = GroupVersionKind::gvk("gpubudget.io", "v1alpha1", "GpuMemoryBudget");
    Api::namespaced_with(fake.client(), "team-a", &ApiResource::from_gvk(&gvk))
}

fn budget(name: &str, spec: Value) -> DynamicObject {
    serde_json::from_value(json!({"apiVersion": "gpubudget.io/v1alpha1", "kind": "GpuMemoryBudget",
        "metadata": {"name": name, "namespace": "team-a"}, "spec": spec}))
    .unwrap()
}

fn spec() -> Value {
    json!({"selector": {"matchLabels": {"app": "llm"}}, "limit": "8Gi"})
}

fn stored(fake: &FakeApi, name: &str) -> Value {
    fake.get("gpumemorybudgets", "team-a", name).unwrap_or_else(|| panic!("{name} is stored"))
}

#[tokio::test]
async fn every_write_applies_the_crds_defaults_and_keeps_what_was_set() {
    let fake = FakeApi::new();
    fake.apply_yaml(CRD).unwrap();
    let api = budgets(&fake);

    let created = api.create(&PostParams::default(), &budget("plain", spec())).await.unwrap();
    let defaulted = json!({"selector": {"matchLabels": {"app": "llm"}}, "limit": "8Gi", "action": "Evict",
        "overLimitSeconds": 10, "warnAtPercent": 90});
    assert_eq!(created.data["spec"], defaulted, "the create's answer");
    assert_eq!(stored(&fake, "plain")["spec"], defaulted, "the stored object");

    let mut warn = spec();
    warn["action"] = "Warn".into();
    warn["overLimitSeconds"] = 0.into();
    api.create(&PostParams::default(), &budget("warn", warn)).await.unwrap();
    assert_eq!(stored(&fake, "warn")["spec"]["action"], "Warn", "a value set is kept");
    assert_eq!(stored(&fake, "warn")["spec"]["overLimitSeconds"], 0, "a zero set is kept");

    let dry = PostParams { dry_run: true, ..PostParams::default() };
    let answered = api.create(&dry, &budget("dry", spec())).await.unwrap();
    assert_eq!(answered.data["spec"]["action"], "Evict", "a dry run answers the defaulted object");
    assert!(fake.get("gpumemorybudgets", "team-a", "dry").is_none());

    // A merge patch that nulls a defaulted (not nullable) field: it is defaulted again.
    let null = json!({"spec": {"action": null, "warnAtPercent": 75}});
    api.patch("warn", &PatchParams::default(), &Patch::Merge(&null)).await.unwrap();
    assert_eq!(stored(&fake, "warn")["spec"]["action"], "Evict");
    assert_eq!(stored(&fake, "warn")["spec"]["warnAtPercent"], 75);

    // Server-side apply of a budget that omits them.
    let apply = PatchParams::apply("tester");
    api.patch("applied", &apply, &Patch::Apply(&budget("applied", spec()))).await.unwrap();
    assert_eq!(stored(&fake, "applied")["spec"], defaulted);

    // The status subresource: its counts default to 0 once a status exists.
    let status =
        json!({"apiVersion": "gpubudget.io/v1alpha1", "kind": "GpuMemoryBudget", "status": {"matchedPods": 2}});
    api.patch_status("plain", &apply, &Patch::Apply(&status)).await.unwrap();
    let s = &stored(&fake, "plain")["status"];
    assert_eq!((&s["matchedPods"], &s["podsOverBudget"], &s["evictions"]), (&json!(2), &json!(0), &json!(0)), "{s}");
    assert_eq!(fake.count(Verb::Patch, "gpumemorybudgets/status"), 1);

    // The direct store helpers too: the real server defaults what it reads from storage.
    fake.put_object(serde_json::to_value(budget("put", spec())).unwrap()).unwrap();
    assert_eq!(stored(&fake, "put")["spec"], defaulted);
}

#[tokio::test]
async fn without_the_crd_nothing_is_defaulted() {
    let fake = FakeApi::new();
    budgets(&fake).create(&PostParams::default(), &budget("plain", spec())).await.unwrap();
    assert_eq!(stored(&fake, "plain")["spec"], spec());
}
