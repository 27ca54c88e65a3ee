//! The fake API server driven through the real kube `Api`, watcher, reflector, controller and recorder.

use std::sync::Arc;
use std::time::Duration;

use futures::{StreamExt, TryStreamExt};
use gpubudget_common::{GpuMemoryBudget, GpuMemoryBudgetSpec, GpuMemoryBudgetStatus};
use gpubudget_testkit::{FakeApi, Verb};
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{Event as CoreEvent, Pod};
use k8s_openapi::api::policy::v1::Eviction;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{DeleteOptions as K8sDeleteOptions, ObjectMeta};
use kube::api::{Api, DeleteParams, EvictParams, ListParams, Patch, PatchParams, PostParams, WatchEvent, WatchParams};
use kube::core::PartialObjectMeta;
use kube::runtime::events::{Event, EventType, Recorder, Reporter};
use kube::runtime::{Controller, WatchStreamExt, controller::Action, reflector, watcher};
use kube::{Resource, ResourceExt};
use serde_json::{Value, json};

const WAIT: Duration = Duration::from_secs(5);

fn pod(name: &str, labels: Value, node: &str) -> Pod {
    serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "labels": labels},
        "spec": {"nodeName": node, "containers": [{"name": "main", "image": "busybox"}]},
    }))
    .unwrap()
}

fn budget(name: &str, limit: &str) -> GpuMemoryBudget {
    let spec: GpuMemoryBudgetSpec = serde_json::from_value(json!({"selector": {}, "limit": limit})).unwrap();
    GpuMemoryBudget::new(name, spec)
}

fn code<T: std::fmt::Debug>(result: kube::Result<T>) -> u16 {
    match result {
        Err(kube::Error::Api(status)) => status.code,
        other => panic!("expected an API error, got {other:?}"),
    }
}

async fn next<S: futures::Stream + Unpin>(stream: &mut S) -> S::Item {
    tokio::time::timeout(WAIT, stream.next()).await.expect("no event in time").expect("stream ended")
}

#[tokio::test]
async fn crud_with_conflicts_and_not_found() {
    let fake = FakeApi::new();
    let pods: Api<Pod> = Api::default_namespaced(fake.client());
    let mut p = pod("p", json!({"app": "llm"}), "n1");
    p.status = Some(serde_json::from_value(json!({"phase": "Running"})).unwrap());
    let created = pods.create(&PostParams::default(), &p).await.unwrap();
    assert_eq!(created.metadata.namespace.as_deref(), Some("default"));
    assert!(created.metadata.uid.is_some() && created.metadata.creation_timestamp.is_some());
    assert_eq!(created.metadata.generation, Some(1));
    // The real server resets a new pod's status.
    assert_eq!(created.status.as_ref().unwrap().phase.as_deref(), Some("Pending"));
    assert_eq!(code(pods.create(&PostParams::default(), &p).await), 409);

    let mut stale = created.clone();
    let mut fresh = pods.get("p").await.unwrap();
    fresh.labels_mut().insert("tier".into(), "gold".into());
    let replaced = pods.replace("p", &PostParams::default(), &fresh).await.unwrap();
    assert_ne!(replaced.resource_version(), created.resource_version());
    stale.labels_mut().insert("tier".into(), "silver".into());
    assert_eq!(code(pods.replace("p", &PostParams::default(), &stale).await), 409);

    let patch = json!({"metadata": {"annotations": {"a": "1"}, "resourceVersion": created.resource_version()}});
    assert_eq!(code(pods.patch("p", &PatchParams::default(), &Patch::Merge(&patch)).await), 409);
    let patched = pods
        .patch("p", &PatchParams::default(), &Patch::Strategic(json!({"metadata": {"annotations": {"a": "1"}}})))
        .await
        .unwrap();
    assert_eq!(patched.annotations()["a"], "1");
    assert_eq!(patched.labels()["tier"], "gold");

    let deleted = pods.delete("p", &DeleteParams::default()).await.unwrap();
    assert!(deleted.is_left(), "a pod delete returns the pod");
    assert_eq!(code(pods.get("p").await), 404);
    assert_eq!(code(pods.delete("p", &DeleteParams::default()).await), 404);
    assert!(pods.get_opt("p").await.unwrap().is_none());

    let leases: Api<Lease> = Api::default_namespaced(fake.client());
    let lease: Lease =
        serde_json::from_value(json!({"metadata": {"name": "l"}, "spec": {"holderIdentity": "a"}})).unwrap();
    leases.create(&PostParams::default(), &lease).await.unwrap();
    assert!(leases.delete("l", &DeleteParams::default()).await.unwrap().is_right(), "other deletes answer a Status");
    assert_eq!(fake.count(Verb::Create, "pods"), 2);
    assert_eq!(fake.count(Verb::Create, "leases.coordination.k8s.io"), 1);
}

#[tokio::test]
async fn generation_status_subresource_and_generate_name() {
    let fake = FakeApi::new();
    let budgets: Api<GpuMemoryBudget> = Api::namespaced(fake.client(), "team-a");
    let mut b = budget("b", "8Gi");
    b.status = Some(GpuMemoryBudgetStatus { matched_pods: 9, ..Default::default() });
    let created = budgets.create(&PostParams::default(), &b).await.unwrap();
    assert_eq!(created.metadata.generation, Some(1));
    assert!(created.status.is_none(), "status is not writable through the main resource");

    let spec_patch = json!({"spec": {"limit": "4Gi"}, "status": {"matchedPods": 3}});
    let patched = budgets.patch("b", &PatchParams::default(), &Patch::Merge(&spec_patch)).await.unwrap();
    assert_eq!(patched.metadata.generation, Some(2));
    assert!(patched.status.is_none());

    let status_patch = json!({"spec": {"limit": "1Gi"}, "status": {"matchedPods": 3}});
    let patched = budgets.patch_status("b", &PatchParams::default(), &Patch::Merge(&status_patch)).await.unwrap();
    assert_eq!(patched.metadata.generation, Some(2), "status writes leave the generation alone");
    assert_eq!(patched.spec.limit.0, "4Gi", "the status subresource only writes .status");
    assert_eq!(patched.status.as_ref().unwrap().matched_pods, 3);
    let rv = patched.resource_version();
    let again = budgets.patch_status("b", &PatchParams::default(), &Patch::Merge(&status_patch)).await.unwrap();
    assert_eq!(again.resource_version(), rv, "a write that changes nothing is not a write");

    let mut replaced = again.clone();
    replaced.status.as_mut().unwrap().evictions = 2;
    let replaced = budgets.replace_status("b", &PostParams::default(), &replaced).await.unwrap();
    assert_eq!(replaced.status.unwrap().evictions, 2);
    assert_eq!(fake.typed::<GpuMemoryBudget>("team-a", "b").unwrap().status.unwrap().evictions, 2);

    let mut generated = budget("", "1Gi");
    generated.metadata.generate_name = Some("gen-".into());
    let g = budgets.create(&PostParams::default(), &generated).await.unwrap();
    assert!(g.name_any().starts_with("gen-") && g.name_any().len() == 9, "{}", g.name_any());
}

#[tokio::test]
async fn label_and_field_selectors() {
    let fake = FakeApi::new();
    fake.apply_yaml(
        r#"
apiVersion: v1
kind: Pod
metadata: {name: a, namespace: team-a, labels: {app: llm, tier: gold}}
spec: {nodeName: n1}
---
apiVersion: v1
kind: Pod
metadata: {name: b, namespace: team-a, labels: {app: llm, tier: silver, canary: "true"}}
spec: {nodeName: n2}
---
apiVersion: v1
kind: Pod
metadata: {name: c, namespace: team-b, labels: {app: web}}
spec: {nodeName: n1}
"#,
    )
    .unwrap();
    let all: Api<Pod> = Api::all(fake.client());
    let names = |list: kube::core::ObjectList<Pod>| list.items.iter().map(|p| p.name_any()).collect::<Vec<_>>();
    let list = |l: &str, f: &str| {
        let mut lp = ListParams::default();
        if !l.is_empty() {
            lp = lp.labels(l);
        }
        if !f.is_empty() {
            lp = lp.fields(f);
        }
        let all = all.clone();
        async move { names(all.list(&lp).await.unwrap()) }
    };
    assert_eq!(list("", "").await, ["a", "b", "c"]);
    assert_eq!(list("app=llm,tier!=gold", "").await, ["b"]);
    assert_eq!(list("tier in (gold,silver),!canary", "").await, ["a"]);
    assert_eq!(list("app notin (web),canary", "").await, ["b"]);
    assert_eq!(list("", "spec.nodeName=n1").await, ["a", "c"]);
    assert_eq!(list("app", "spec.nodeName=n1,metadata.namespace!=team-a").await, ["c"]);
    let in_ns: Api<Pod> = Api::namespaced(fake.client(), "team-a");
    let one = in_ns.list(&ListParams::default().fields("metadata.name=b")).await.unwrap();
    assert_eq!(names(one.clone()), ["b"]);
    assert!(one.metadata.resource_version.is_some());
    assert_eq!(code(in_ns.list(&ListParams::default().labels("a in (x")).await), 400);
}

#[tokio::test]
async fn watcher_sees_changes_and_recovers_from_disconnects_and_expiry() {
    let fake = FakeApi::new();
    let pods: Api<Pod> = Api::default_namespaced(fake.client());
    let mut events = watcher(pods.clone(), watcher::Config::default()).boxed();
    assert!(matches!(next(&mut events).await.unwrap(), watcher::Event::Init));
    assert!(matches!(next(&mut events).await.unwrap(), watcher::Event::InitDone));

    pods.create(&PostParams::default(), &pod("p", json!({}), "n1")).await.unwrap();
    assert!(matches!(next(&mut events).await.unwrap(), watcher::Event::Apply(p) if p.name_any() == "p"));
    fake.set_pod_labels("default", "p", [("app", "llm")]);
    match next(&mut events).await.unwrap() {
        watcher::Event::Apply(p) => assert_eq!(p.labels()["app"], "llm"),
        other => panic!("{other:?}"),
    }

    // A dropped connection: the watcher resumes from its resourceVersion and misses nothing.
    fake.disconnect_watches();
    pods.create(&PostParams::default(), &pod("q", json!({}), "n1")).await.unwrap();
    assert!(matches!(next(&mut events).await.unwrap(), watcher::Event::Apply(p) if p.name_any() == "q"));
    pods.delete("p", &DeleteParams::default()).await.unwrap();
    assert!(matches!(next(&mut events).await.unwrap(), watcher::Event::Delete(p) if p.name_any() == "p"));
    assert_eq!(fake.count(Verb::List, "pods"), 1);
    assert!(fake.count(Verb::Watch, "pods") >= 2);

    // A change the watcher did not see and then history compacted past it: the resumed watch gets
    // 410 Expired and the watcher re-lists. (The watcher reconnects when next polled.)
    fake.disconnect_watches();
    pods.create(&PostParams::default(), &pod("r", json!({}), "n1")).await.unwrap();
    fake.compact_history();
    let mut seen = Vec::new();
    while !seen.iter().any(|e: &String| e == "InitDone") {
        match next(&mut events).await {
            Ok(watcher::Event::InitApply(p)) => seen.push(p.name_any()),
            Ok(watcher::Event::InitDone) => seen.push("InitDone".into()),
            Ok(_) => {}
            Err(e) => seen.push(format!("error: {e}")),
        }
    }
    assert!(seen[0].contains("410") || seen[0].contains("too old"), "{seen:?}");
    assert_eq!(&seen[1..], ["q", "r", "InitDone"]);
    assert_eq!(fake.count(Verb::List, "pods"), 2);
}

/// A metadata-only watch resumed from a compacted resourceVersion gets the 410 `Expired` Status, not a
/// metadata form of it, and the watcher re-lists (the agent's budget watch is metadata-only, #34).
#[tokio::test]
async fn a_metadata_watch_from_an_expired_version_gets_the_status_and_relists() {
    let fake = FakeApi::new();
    fake.apply_yaml("apiVersion: v1\nkind: Pod\nmetadata: {name: p}\n").unwrap();
    let pods: Api<PartialObjectMeta<Pod>> = Api::default_namespaced(fake.client());
    let mut events = watcher(pods, watcher::Config::default()).boxed();
    let mut next = async || tokio::time::timeout(Duration::from_secs(5), events.try_next()).await.expect("in time");
    while !matches!(next().await, Ok(Some(watcher::Event::InitDone))) {}
    fake.disconnect_watches();
    fake.apply_yaml("apiVersion: v1\nkind: Pod\nmetadata: {name: q}\n").unwrap();
    fake.compact_history();
    let mut seen = Vec::new();
    while !seen.iter().any(|e: &String| e == "InitDone") {
        assert!(seen.len() < 20, "no relist: {seen:?}");
        match next().await {
            Ok(Some(watcher::Event::InitApply(p))) => seen.push(p.name_any()),
            Ok(Some(watcher::Event::InitDone)) => seen.push("InitDone".into()),
            Ok(_) => {}
            Err(e) => seen.push(format!("error: {e}")),
        }
    }
    assert!(seen[0].contains("410") || seen[0].contains("too old"), "{seen:?}");
    assert_eq!(&seen[1..], ["p", "q", "InitDone"]);
}

#[tokio::test]
async fn raw_watch_filters_replays_and_times_out() {
    let fake = FakeApi::new();
    let pods: Api<Pod> = Api::default_namespaced(fake.client());
    pods.create(&PostParams::default(), &pod("p", json!({"app": "llm"}), "n1")).await.unwrap();
    let rv = pods.list(&ListParams::default()).await.unwrap().metadata.resource_version.unwrap();
    pods.create(&PostParams::default(), &pod("q", json!({"app": "web"}), "n1")).await.unwrap();
    // Replays from an older resourceVersion, only what the selector matches; an object that stops
    // matching is reported DELETED, as the real watch cache does.
    let wp = WatchParams::default().labels("app=llm").timeout(1);
    let mut stream = pods.watch(&wp, &rv).await.unwrap().boxed();
    fake.set_pod_labels("default", "q", [("app", "llm")]);
    fake.set_pod_labels("default", "p", [("app", "web")]);
    let mut seen = Vec::new();
    while let Some(event) = stream.try_next().await.unwrap() {
        seen.push(match event {
            WatchEvent::Added(p) => format!("ADDED {}", p.name_any()),
            WatchEvent::Modified(p) => format!("MODIFIED {}", p.name_any()),
            WatchEvent::Deleted(p) => format!("DELETED {}", p.name_any()),
            WatchEvent::Bookmark(_) => "BOOKMARK".into(),
            WatchEvent::Error(e) => format!("ERROR {}", e.code),
        });
    }
    assert_eq!(seen, ["ADDED q", "DELETED p"], "the stream ends after timeoutSeconds");

    // resourceVersion 0 starts with the current state; bookmarks come when allowed.
    let mut stream = pods.watch(&WatchParams::default().timeout(1), "0").await.unwrap().boxed();
    assert!(matches!(stream.try_next().await.unwrap(), Some(WatchEvent::Added(_))));
    assert!(matches!(stream.try_next().await.unwrap(), Some(WatchEvent::Added(_))));
    fake.send_bookmarks();
    match stream.try_next().await.unwrap() {
        Some(WatchEvent::Bookmark(b)) => assert_eq!(b.metadata.resource_version, fake.resource_version().to_string()),
        other => panic!("{other:?}"),
    }
}

#[tokio::test]
async fn streaming_list_watcher() {
    let fake = FakeApi::new();
    fake.apply_yaml("apiVersion: v1\nkind: Pod\nmetadata: {name: p}\n").unwrap();
    let pods: Api<Pod> = Api::default_namespaced(fake.client());
    let mut events = watcher(pods, watcher::Config::default().streaming_lists()).boxed();
    assert!(matches!(next(&mut events).await.unwrap(), watcher::Event::Init));
    assert!(matches!(next(&mut events).await.unwrap(), watcher::Event::InitApply(p) if p.name_any() == "p"));
    assert!(matches!(next(&mut events).await.unwrap(), watcher::Event::InitDone));
    assert_eq!(fake.count(Verb::List, "pods"), 0);
}

#[tokio::test]
async fn metadata_watcher_and_reflector() {
    let fake = FakeApi::new();
    fake.apply_yaml(
        "apiVersion: v1\nkind: Pod\nmetadata: {name: p, labels: {app: llm}, annotations: {gpubudget.io/state: Near}}\nspec: {nodeName: n1}\n",
    )
    .unwrap();
    let pods: Api<Pod> = Api::default_namespaced(fake.client());
    let meta_api: Api<PartialObjectMeta<Pod>> = Api::default_namespaced(fake.client());
    let mut meta = watcher(meta_api, watcher::Config::default()).applied_objects().boxed();
    let p = next(&mut meta).await.unwrap();
    assert_eq!(p.labels()["app"], "llm");
    assert_eq!(p.annotations()["gpubudget.io/state"], "Near");
    fake.modify("pods", "default", "p", |p| p["metadata"]["annotations"]["gpubudget.io/state"] = json!("Over"));
    assert_eq!(next(&mut meta).await.unwrap().annotations()["gpubudget.io/state"], "Over");
    let list = fake.requests().into_iter().find(|r| r.verb == Verb::List).unwrap();
    assert!(list.accept.unwrap().contains("as=PartialObjectMetadataList"));
    let listed = pods.list_metadata(&ListParams::default()).await.unwrap();
    assert_eq!(listed.types.kind, "PartialObjectMetadataList");
    assert_eq!(listed.items[0].types.as_ref().unwrap().kind, "PartialObjectMetadata");
    assert_eq!(pods.get_metadata("p").await.unwrap().labels()["app"], "llm");

    let (reader, writer) = reflector::store();
    let stream = reflector(writer, watcher(pods.clone(), watcher::Config::default().labels("app=llm")));
    tokio::spawn(stream.for_each(|_| async {}));
    tokio::time::timeout(WAIT, reader.wait_until_ready()).await.unwrap().unwrap();
    assert_eq!(reader.state().len(), 1);
    pods.create(&PostParams::default(), &pod("q", json!({"app": "llm"}), "n1")).await.unwrap();
    pods.create(&PostParams::default(), &pod("r", json!({"app": "web"}), "n1")).await.unwrap();
    assert!(fake.wait_until(WAIT, |_| reader.state().len() == 2).await);
}

/// A `metadata.uid` in an applied configuration is a precondition: a pod that took the name is not written.
#[tokio::test]
async fn apply_with_a_uid_is_refused_for_another_pod_of_that_name() {
    let fake = FakeApi::new();
    fake.apply_yaml("apiVersion: v1\nkind: Pod\nmetadata: {name: p}\n").unwrap();
    let uid = fake.get("pods", "default", "p").unwrap()["metadata"]["uid"].as_str().unwrap().to_owned();
    let pods: Api<Pod> = Api::default_namespaced(fake.client());
    let body = |uid: &str| {
        json!({"apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": "p", "uid": uid, "annotations": {"gpubudget.io/state": "Over"}}})
    };
    pods.patch("p", &PatchParams::apply("m"), &Patch::Apply(&body(&uid))).await.expect("same pod");
    let err = pods.patch("p", &PatchParams::apply("m"), &Patch::Apply(&body("other"))).await.expect_err("replaced");
    assert!(
        matches!(&err, kube::Error::Api(s) if s.code == 409 && s.message.contains("Precondition failed: UID")),
        "{err}"
    );
}

#[tokio::test]
async fn server_side_apply_of_objects_and_status() {
    let fake = FakeApi::new();
    let pods: Api<Pod> = Api::default_namespaced(fake.client());
    let ssa = |m: &str| PatchParams::apply(m);
    let applied = json!({"apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": "p", "annotations": {"gpubudget.io/state": "Near", "gpubudget.io/node": "n1"}}});
    let created = pods.patch("p", &ssa("gpubudget-agent/n1"), &Patch::Apply(&applied)).await.unwrap();
    assert_eq!(created.annotations().len(), 2);
    let created_req = fake.requests().pop().unwrap();
    assert_eq!((created_req.status, created_req.content_type.as_deref()), (201, Some("application/apply-patch+yaml")));
    assert_eq!(created_req.param("fieldManager").as_deref(), Some("gpubudget-agent/n1"));
    let managers = created.managed_fields();
    assert_eq!(
        (managers[0].manager.as_deref(), managers[0].operation.as_deref()),
        (Some("gpubudget-agent/n1"), Some("Apply"))
    );

    // Omitting an annotation the manager applied before removes it; another manager's stays.
    pods.patch("p", &PatchParams::default(), &Patch::Merge(json!({"metadata": {"labels": {"x": "1"}}}))).await.unwrap();
    let applied = json!({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p", "annotations": {"gpubudget.io/state": "Over"}}});
    let updated = pods.patch("p", &ssa("gpubudget-agent/n1"), &Patch::Apply(&applied)).await.unwrap();
    assert_eq!(
        updated.annotations().iter().collect::<Vec<_>>(),
        [(&"gpubudget.io/state".to_owned(), &"Over".to_owned())]
    );
    assert_eq!(updated.labels()["x"], "1");

    // Another manager changing the field conflicts unless forced.
    let other = json!({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p", "annotations": {"gpubudget.io/state": "Within"}}});
    assert_eq!(code(pods.patch("p", &ssa("someone-else"), &Patch::Apply(&other)).await), 409);
    let forced = pods.patch("p", &ssa("someone-else").force(), &Patch::Apply(&other)).await.unwrap();
    assert_eq!(forced.annotations()["gpubudget.io/state"], "Within");
    let no_manager = http::Request::patch("/api/v1/namespaces/default/pods/p")
        .header("content-type", "application/apply-patch+yaml")
        .body(serde_json::to_vec(&other).unwrap())
        .unwrap();
    assert_eq!(code(fake.client().request::<Pod>(no_manager).await), 422, "apply needs a field manager");

    // Status through the status subresource, by apply; an omitted status field goes away.
    let budgets: Api<GpuMemoryBudget> = Api::default_namespaced(fake.client());
    budgets.create(&PostParams::default(), &budget("b", "8Gi")).await.unwrap();
    let status = |s: Value| json!({"apiVersion": "gpubudget.io/v1alpha1", "kind": "GpuMemoryBudget", "status": s});
    let op = PatchParams::apply("gpubudget-operator").force();
    let b =
        budgets.patch_status("b", &op, &Patch::Apply(status(json!({"matchedPods": 2, "evictions": 1})))).await.unwrap();
    assert_eq!(b.status.as_ref().unwrap().evictions, 1);
    let b = budgets.patch_status("b", &op, &Patch::Apply(status(json!({"matchedPods": 3})))).await.unwrap();
    let stored = fake.get("gpumemorybudgets", "default", "b").unwrap();
    assert_eq!(stored["status"], json!({"matchedPods": 3}), "evictions was the operator's and is omitted now");
    assert_eq!(b.status.unwrap().matched_pods, 3);
    let entry =
        b.metadata.managed_fields.unwrap().into_iter().find(|e| e.operation.as_deref() == Some("Apply")).unwrap();
    assert_eq!((entry.manager.as_deref(), entry.subresource.as_deref()), (Some("gpubudget-operator"), Some("status")));
    assert_eq!(b.metadata.generation, Some(1));
    assert_eq!(code(budgets.patch_status("missing", &op, &Patch::Apply(status(json!({})))).await), 404);
}

#[tokio::test]
async fn eviction_is_recorded_and_deletes_gracefully() {
    let fake = FakeApi::new();
    fake.set_graceful_pod_deletion(true);
    let pods: Api<Pod> = Api::default_namespaced(fake.client());
    let mut p = pod("p", json!({}), "n1");
    p.spec.as_mut().unwrap().termination_grace_period_seconds = Some(45);
    pods.create(&PostParams::default(), &p).await.unwrap();

    // kube 5.0's `Api::evict` sends `delete_options` (snake case) and no apiVersion/kind. The real API
    // server ignores the unknown field (with a warning), so the grace period asked for is lost and the
    // pod's own terminationGracePeriodSeconds applies.
    let ep = EvictParams {
        delete_options: Some(DeleteParams { grace_period_seconds: Some(30), ..Default::default() }),
        ..Default::default()
    };
    let status = pods.evict("p", &ep).await.unwrap();
    assert_eq!(status.code, 201);
    let body = &fake.evictions()[0];
    assert_eq!(body["delete_options"]["gracePeriodSeconds"], 30);
    assert_eq!(body["metadata"]["name"], "p");
    assert!(body.get("deleteOptions").is_none() && body.get("kind").is_none());
    assert_eq!(fake.requests().last().unwrap().warnings, [r#"unknown field "delete_options""#]);
    let terminating = pods.get("p").await.unwrap();
    assert!(terminating.metadata.deletion_timestamp.is_some());
    assert_eq!(
        terminating.metadata.deletion_grace_period_seconds,
        Some(45),
        "the grace period in delete_options is lost"
    );
    let conditions = terminating.status.unwrap().conditions.unwrap();
    assert!(
        conditions
            .iter()
            .any(|c| c.type_ == "DisruptionTarget" && c.reason.as_deref() == Some("EvictionByEvictionAPI"))
    );
    assert!(fake.finish_deletion("default", "p"));
    assert_eq!(code(pods.get("p").await), 404);
    assert_eq!(code(pods.evict("p", &ep).await), 404);

    // A policy/v1 Eviction body posted to the subresource carries the grace period.
    pods.create(&PostParams::default(), &p).await.unwrap();
    let eviction = Eviction {
        metadata: ObjectMeta { name: Some("p".into()), namespace: Some("default".into()), ..Default::default() },
        delete_options: Some(K8sDeleteOptions { grace_period_seconds: Some(30), ..Default::default() }),
    };
    let status: kube::core::Status =
        pods.create_subresource("eviction", "p", &PostParams::default(), &eviction).await.unwrap();
    assert_eq!(status.code, 201);
    let body = fake.evictions().pop().unwrap();
    assert_eq!((body["kind"].as_str(), body["apiVersion"].as_str()), (Some("Eviction"), Some("policy/v1")));
    assert_eq!(body["deleteOptions"]["gracePeriodSeconds"], 30);
    assert!(fake.requests().last().unwrap().warnings.is_empty());
    assert_eq!(pods.get("p").await.unwrap().metadata.deletion_grace_period_seconds, Some(30));
    assert_eq!(fake.count(Verb::Create, "pods/eviction"), 3);

    // Without graceful mode a pod goes at once.
    fake.set_graceful_pod_deletion(false);
    pods.create(&PostParams::default(), &pod("q", json!({}), "n1")).await.unwrap();
    pods.evict("q", &EvictParams::default()).await.unwrap();
    assert!(fake.get("pods", "default", "q").is_none());
}

#[tokio::test]
async fn blocked_evictions_answer_429() {
    let fake = FakeApi::new();
    let pods: Api<Pod> = Api::default_namespaced(fake.client());
    pods.create(&PostParams::default(), &pod("p", json!({}), "n1")).await.unwrap();
    fake.block_evictions(2);
    for _ in 0..2 {
        match pods.evict("p", &EvictParams::default()).await {
            Err(kube::Error::Api(s)) => {
                assert_eq!((s.code, s.reason.as_str()), (429, "TooManyRequests"));
                assert!(s.message.contains("disruption budget"));
            }
            other => panic!("{other:?}"),
        }
    }
    assert!(fake.get("pods", "default", "p").is_some());
    pods.evict("p", &EvictParams::default()).await.unwrap();
    assert_eq!(fake.evictions().len(), 3);
    fake.block_all_evictions();
    pods.create(&PostParams::default(), &pod("q", json!({}), "n1")).await.unwrap();
    assert_eq!(code(pods.evict("q", &EvictParams::default()).await), 429);
    fake.allow_evictions();
    pods.evict("q", &EvictParams::default()).await.unwrap();
}

#[tokio::test]
async fn injected_faults_give_status_errors() {
    let fake = FakeApi::new();
    let pods: Api<Pod> = Api::default_namespaced(fake.client());
    pods.create(&PostParams::default(), &pod("p", json!({}), "n1")).await.unwrap();
    fake.fail_next(Verb::Get, "pods", 2, 500);
    fake.fail_next(Verb::List, "*", 1, 429);
    fake.fail_next(Verb::Patch, "pods/status", 1, 409);
    fake.fail_next(Verb::Delete, "pods", 1, 504);
    match pods.get("p").await {
        Err(kube::Error::Api(s)) => {
            assert_eq!((s.code, s.reason.as_str(), s.status.is_some()), (500, "InternalError", true))
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(code(pods.get("p").await), 500);
    assert!(pods.get("p").await.is_ok());
    assert_eq!(code(pods.list(&ListParams::default()).await), 429);
    let status = Patch::Merge(json!({"status": {"phase": "Running"}}));
    assert_eq!(code(pods.patch_status("p", &PatchParams::default(), &status).await), 409);
    assert!(pods.patch("p", &PatchParams::default(), &Patch::Merge(json!({}))).await.is_ok(), "only /status fails");
    assert_eq!(code(pods.delete("p", &DeleteParams::default()).await), 504);
    assert!(fake.get("pods", "default", "p").is_some());
    let statuses: Vec<u16> = fake.requests().iter().map(|r| r.status).collect();
    assert_eq!(statuses, [201, 500, 500, 200, 429, 409, 200, 504]);

    fake.set_latency(Duration::from_millis(100));
    let started = std::time::Instant::now();
    pods.get("p").await.unwrap();
    assert!(started.elapsed() >= Duration::from_millis(100));
    fake.set_latency(Duration::ZERO);

    // A 410 on a watch comes the way the real server sends it; the watcher re-lists.
    fake.fail_next(Verb::Watch, "pods", 1, 410);
    let mut events = watcher(pods.clone(), watcher::Config::default()).boxed();
    let mut errors = 0;
    loop {
        match next(&mut events).await {
            Err(_) => errors += 1,
            Ok(watcher::Event::InitDone) if errors == 1 => break,
            Ok(_) => {}
        }
    }
    assert_eq!(fake.count(Verb::List, "pods"), 3);
}

#[tokio::test]
async fn recorder_events_show_up_in_events_for() {
    let fake = FakeApi::new();
    let pods: Api<Pod> = Api::namespaced(fake.client(), "team-a");
    let p = pods.create(&PostParams::default(), &pod("p", json!({}), "n1")).await.unwrap();
    let reporter = Reporter { controller: "gpubudget-agent".into(), instance: Some("n1".into()) };
    let recorder = Recorder::new(fake.client(), reporter);
    let event = Event {
        type_: EventType::Warning,
        reason: "OverBudget".into(),
        note: Some("uses 9Gi of 8Gi".into()),
        action: "Warn".into(),
        secondary: None,
    };
    recorder.publish(&event, &p.object_ref(&())).await.unwrap();
    recorder.publish(&event, &p.object_ref(&())).await.unwrap();
    let core: Api<CoreEvent> = Api::namespaced(fake.client(), "team-a");
    let legacy: CoreEvent = serde_json::from_value(json!({
        "metadata": {"name": "e1"}, "involvedObject": {"kind": "Pod", "name": "p", "namespace": "team-a"},
        "reason": "Evicted", "message": "evicted", "type": "Warning", "reportingComponent": "kubelet", "reportingInstance": "n1",
    }))
    .unwrap();
    core.create(&PostParams::default(), &legacy).await.unwrap();

    let events = fake.events_for("team-a", "p");
    assert_eq!(events.len(), 2, "{events:?}");
    let new = events.iter().find(|e| e.api_version == "events.k8s.io/v1").unwrap();
    assert_eq!(
        (new.reason.as_str(), new.message.as_str(), new.type_.as_str()),
        ("OverBudget", "uses 9Gi of 8Gi", "Warning")
    );
    assert_eq!(
        (new.reporting_controller.as_str(), new.reporting_instance.as_str(), new.count),
        ("gpubudget-agent", "n1", 2)
    );
    let old = events.iter().find(|e| e.api_version == "v1").unwrap();
    assert_eq!((old.reason.as_str(), old.reporting_controller.as_str()), ("Evicted", "kubelet"));
    assert_eq!(fake.count(Verb::Create, "events.events.k8s.io"), 1);
    assert_eq!(fake.count(Verb::Patch, "events"), 1);
    assert!(fake.events_for("team-a", "other").is_empty());
}

#[tokio::test]
async fn json_patch_finalizers_and_dry_run() {
    let fake = FakeApi::new();
    let client = fake.client();
    let pods: Api<Pod> = Api::default_namespaced(client.clone());
    let mut p = pod("p", json!({}), "n1");
    p.metadata.finalizers = Some(vec!["example.com/hold".into()]);
    pods.create(&PostParams::default(), &p).await.unwrap();

    let ops = json!([{"op": "add", "path": "/metadata/labels/x", "value": "1"}]);
    let request = http::Request::patch("/api/v1/namespaces/default/pods/p")
        .header("content-type", "application/json-patch+json")
        .body(serde_json::to_vec(&ops).unwrap())
        .unwrap();
    let patched: Pod = client.request(request).await.unwrap();
    assert_eq!(patched.labels()["x"], "1");
    let failing = json!([{"op": "test", "path": "/metadata/labels/x", "value": "2"}]);
    let request = http::Request::patch("/api/v1/namespaces/default/pods/p")
        .header("content-type", "application/json-patch+json")
        .body(serde_json::to_vec(&failing).unwrap())
        .unwrap();
    assert_eq!(code(client.request::<Pod>(request).await), 422);

    let dry = PostParams { dry_run: true, ..Default::default() };
    pods.create(&dry, &pod("dry", json!({}), "n1")).await.unwrap();
    assert!(fake.get("pods", "default", "dry").is_none());

    // A finalizer holds a deleted object until it is removed.
    pods.delete("p", &DeleteParams::default()).await.unwrap();
    let held = pods.get("p").await.unwrap();
    assert!(held.metadata.deletion_timestamp.is_some());
    let precondition = DeleteParams {
        preconditions: Some(kube::api::Preconditions { uid: Some("nope".into()), resource_version: None }),
        ..Default::default()
    };
    assert_eq!(code(pods.delete("p", &precondition).await), 409);
    pods.patch("p", &PatchParams::default(), &Patch::Merge(json!({"metadata": {"finalizers": null}}))).await.unwrap();
    assert!(fake.get("pods", "default", "p").is_none());
}

#[tokio::test]
async fn a_controller_reconciles_budgets() {
    #[derive(Debug, thiserror::Error)]
    #[error(transparent)]
    struct Failed(#[from] kube::Error);

    let fake = FakeApi::new();
    fake.apply_yaml(
        "apiVersion: gpubudget.io/v1alpha1\nkind: GpuMemoryBudget\nmetadata: {name: b, namespace: team-a}\nspec: {selector: {}, limit: 8Gi}\n",
    )
    .unwrap();
    let budgets: Api<GpuMemoryBudget> = Api::all(fake.client());
    async fn reconcile(b: Arc<GpuMemoryBudget>, client: Arc<kube::Client>) -> Result<Action, Failed> {
        let api: Api<GpuMemoryBudget> = Api::namespaced((*client).clone(), &b.namespace().unwrap());
        let status = json!({"apiVersion": "gpubudget.io/v1alpha1", "kind": "GpuMemoryBudget",
                            "status": {"observedGeneration": b.metadata.generation, "matchedPods": 0}});
        api.patch_status(&b.name_any(), &PatchParams::apply("gpubudget-operator"), &Patch::Apply(status)).await?;
        Ok(Action::await_change())
    }
    let controller = Controller::new(budgets, watcher::Config::default())
        .run(reconcile, |_, _, _| Action::await_change(), Arc::new(fake.client()))
        .for_each(|_| async {});
    tokio::spawn(controller);
    let observed =
        |fake: &FakeApi| fake.get("gpumemorybudgets", "team-a", "b").unwrap()["status"]["observedGeneration"].clone();
    assert!(fake.wait_until(WAIT, |f| observed(f) == 1).await);
    fake.modify("gpumemorybudgets", "team-a", "b", |b| b["spec"]["limit"] = json!("4Gi"));
    assert!(fake.wait_until(WAIT, |f| observed(f) == 2).await);
}

#[tokio::test]
async fn lease_manager_elects_one_leader_through_apply_conflicts() {
    let fake = FakeApi::new();
    let manager = |id: &str| {
        kube_lease_manager::LeaseManagerBuilder::new(fake.client(), "gpubudget-operator")
            .with_identity(id)
            .with_duration(2)
            .with_grace(1)
            .build()
    };
    let (a, b) = (manager("a").await.unwrap(), manager("b").await.unwrap());
    assert!(tokio::time::timeout(WAIT, a.changed()).await.unwrap().unwrap());
    assert!(
        tokio::time::timeout(Duration::from_millis(300), b.changed()).await.is_err(),
        "b must not lead while a does"
    );
    let holder =
        |f: &FakeApi| f.get("leases", "default", "gpubudget-operator").unwrap()["spec"]["holderIdentity"].clone();
    assert_eq!(holder(&fake), "a");
    a.release().await.unwrap();
    assert!(tokio::time::timeout(WAIT, b.changed()).await.unwrap().unwrap());
    assert_eq!(holder(&fake), "b");
}

#[tokio::test]
async fn cluster_scoped_crds_direct_writes_and_delete_collection() {
    use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
    use kube::CustomResourceExt;
    let fake = FakeApi::new();
    let crds: Api<CustomResourceDefinition> = Api::all(fake.client());
    crds.create(&PostParams::default(), &GpuMemoryBudget::crd()).await.unwrap();
    let stored = fake.get("customresourcedefinitions", "", "gpumemorybudgets.gpubudget.io").unwrap();
    assert!(stored["metadata"].get("namespace").is_none());
    assert_eq!(crds.get("gpumemorybudgets.gpubudget.io").await.unwrap().metadata.generation, Some(1));
    assert_eq!(fake.requests()[0].path, "/apis/apiextensions.k8s.io/v1/customresourcedefinitions");

    let pods: Api<Pod> = Api::default_namespaced(fake.client());
    let mut events = pods.watch(&WatchParams::default().timeout(1), "0").await.unwrap().boxed();
    let written = fake
        .apply_yaml("apiVersion: v1\nkind: Pod\nmetadata: {name: a, labels: {app: x}}\nstatus: {phase: Running}\n---\napiVersion: v1\nkind: Pod\nmetadata: {name: b}\n")
        .unwrap();
    assert_eq!(written.len(), 2);
    assert_eq!(fake.typed::<Pod>("default", "a").unwrap().status.unwrap().phase.as_deref(), Some("Running"));
    fake.apply_yaml("apiVersion: v1\nkind: Pod\nmetadata: {name: a, labels: {app: x}}\nstatus: {phase: Succeeded}\n")
        .unwrap();
    let kinds: Vec<&str> = [next(&mut events).await, next(&mut events).await, next(&mut events).await]
        .iter()
        .map(|e| match e.as_ref().unwrap() {
            WatchEvent::Added(_) => "ADDED",
            WatchEvent::Modified(_) => "MODIFIED",
            _ => "other",
        })
        .collect();
    assert_eq!(kinds, ["ADDED", "ADDED", "MODIFIED"]);

    let gone = pods.delete_collection(&DeleteParams::default(), &ListParams::default().labels("!app")).await.unwrap();
    assert_eq!(gone.left().unwrap().items.len(), 1);
    assert_eq!(fake.list("pods", None).len(), 1);
    assert!(fake.delete_object("pods", "default", "a"));
    assert!(fake.list("pods", Some("default")).is_empty());
}

/// #23: a cluster-scoped custom resource is stored without a namespace however it is written (`put_object`
/// with its CRD known, or the API), so GET by name, list, status writes and `fake.get(.., "", name)` find it.
#[tokio::test]
async fn cluster_scoped_custom_resources_are_found_by_name() {
    use gpubudget_common::ClusterGpuMemoryBudget;
    use kube::CustomResourceExt;
    let fake = FakeApi::new().with_status_subresource("clustergpumemorybudgets.gpubudget.io");
    fake.put_object(serde_json::to_value(ClusterGpuMemoryBudget::crd()).unwrap()).unwrap();
    fake.put_object(json!({
        "apiVersion": "gpubudget.io/v1alpha1", "kind": "ClusterGpuMemoryBudget",
        "metadata": {"name": "seeded"},
        "spec": {"namespaceSelector": {}, "selector": {}, "limit": "16Gi"},
    }))
    .unwrap();
    let api: Api<ClusterGpuMemoryBudget> = Api::all(fake.client());
    let seeded = api.get("seeded").await.expect("GET by name");
    assert_eq!((seeded.metadata.namespace, seeded.spec.budget.limit.0.as_str()), (None, "16Gi"));
    let mut created: ClusterGpuMemoryBudget = serde_json::from_value(json!({
        "apiVersion": "gpubudget.io/v1alpha1", "kind": "ClusterGpuMemoryBudget",
        "metadata": {"name": "created"},
        "spec": {"namespaceSelector": {"matchLabels": {"tier": "tenant"}}, "selector": {}, "limit": "8Gi"},
    }))
    .unwrap();
    created = api.create(&PostParams::default(), &created).await.expect("create");
    assert_eq!(created.metadata.namespace, None);
    assert_eq!(api.get("created").await.expect("GET by name").metadata.uid, created.metadata.uid);
    let names: Vec<String> =
        api.list(&ListParams::default()).await.unwrap().items.iter().map(|b| b.name_any()).collect();
    assert_eq!(names, ["created", "seeded"]);
    let patch =
        json!({"apiVersion": "gpubudget.io/v1alpha1", "kind": "ClusterGpuMemoryBudget", "status": {"matchedPods": 3}});
    let written = api.patch_status("seeded", &PatchParams::apply("t").force(), &Patch::Apply(&patch)).await.unwrap();
    assert_eq!(written.status.map(|s| s.matched_pods), Some(3));
    assert_eq!(fake.get("clustergpumemorybudgets", "", "seeded").unwrap()["status"]["matchedPods"], 3);
    assert!(fake.get("clustergpumemorybudgets", "default", "seeded").is_none(), "never under a namespace");
}

/// A stored CRD with a status subresource gives its resource one (without `with_status_subresource`): a
/// status write leaves the generation alone, a main write leaves the status alone.
#[tokio::test]
async fn a_stored_crds_status_subresource_is_served() {
    use gpubudget_common::ClusterGpuMemoryBudget;
    use kube::CustomResourceExt;
    let fake = FakeApi::new();
    fake.put_object(serde_json::to_value(ClusterGpuMemoryBudget::crd()).unwrap()).unwrap();
    fake.put_object(json!({
        "apiVersion": "gpubudget.io/v1alpha1", "kind": "ClusterGpuMemoryBudget",
        "metadata": {"name": "b"}, "spec": {"namespaceSelector": {}, "selector": {}, "limit": "16Gi"},
    }))
    .unwrap();
    let api: Api<ClusterGpuMemoryBudget> = Api::all(fake.client());
    let generation = api.get("b").await.unwrap().metadata.generation;
    let patch =
        json!({"apiVersion": "gpubudget.io/v1alpha1", "kind": "ClusterGpuMemoryBudget", "status": {"matchedPods": 3}});
    let written = api.patch_status("b", &PatchParams::apply("t").force(), &Patch::Apply(&patch)).await.unwrap();
    assert_eq!((written.metadata.generation, written.status.map(|s| s.matched_pods)), (generation, Some(3)));
}
