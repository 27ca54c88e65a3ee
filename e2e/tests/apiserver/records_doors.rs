//! Records through another door, and one release per cluster (issue 43, findings 5 and 6; formerly
//! records-doors.sh): the chart's records and caps record policies on every door to a pod's annotations, the
//! kubelet's and the agent's writes still passing, and a second release refused at install. A tenant with `pods`
//! (create, patch, update), `pods/status` (patch, update), `pods/binding` and `bindings` (create) and
//! `pods/ephemeralcontainers` (patch) in its namespace; the kubelet is the admin impersonating
//! `system:node:<node>` in `system:nodes` (the `system:node` role bound to that group by RBAC: this control plane
//! runs no Node authorizer).
//! 0. before: the records and caps record policies as they were before issue 43 (the chart's, matching the
//!    `pods` resource only): refused through pods, but gpubudget.io/state and gpubudget.io/caps through
//!    pods/status, and gpubudget.io/state through a pods/binding, are taken;
//! 1. after (the chart installed with `helm install`): every key the records use (common/src/pod_record.rs, and
//!    gpubudget.io/caps) refused through pods/status by patch and by update, through pods by patch and update,
//!    through pods/binding and the legacy bindings resource, each answer naming the door; pods/ephemeralcontainers
//!    takes the change and drops the annotation (its strategy resets metadata);
//! 2. what must still pass: the tenant's own status writes, the kubelet's status patch and update of a pod
//!    carrying the agent's record, a binding without gpubudget.io/ keys, and the agent's records (the agent binary,
//!    its token bound to the node); the admin's forged record through pods/status is refused;
//! 3. one release per cluster: a second `helm install` fails, naming the first; the first's `helm upgrade` passes;
//!    policies another install left (a second release's, applied as the admin) refuse the agent's record, and the
//!    agent says so on its Node (GpuBudgetWriteDenied, naming the policy) and counts the write `denied`.
//!
//! Helm runs as a subprocess (install, upgrade, template), as the script ran it. The script's "before" was the
//! chart of the commit checked out, older than the fix when it was written; here the current chart's two policies
//! are narrowed to the `pods` resource, which is what they matched before.

use std::time::{Duration, Instant};

use k8s_openapi::api::admissionregistration::v1::ValidatingAdmissionPolicy;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, PostParams};
use kube::{Client, ResourceExt};
use serde_json::{Value, json};

use crate::harness::{
    GI, Run, Workloads, allowed, annotate, annotation, bind, binding, bindings, forbidden, metric, metrics, patch_pod,
};

/// The `gpubudget.io/` annotations of a pod, as JSON.
fn records(pod: &Pod) -> String {
    let ours: serde_json::Map<String, Value> = pod
        .annotations()
        .iter()
        .filter(|(k, _)| k.starts_with("gpubudget.io/"))
        .map(|(k, v)| (k.clone(), Value::from(v.as_str())))
        .collect();
    Value::Object(ours).to_string()
}

/// The admission policies of a rendering and their bindings.
fn policies(rendered: Vec<Value>) -> Vec<Value> {
    rendered
        .into_iter()
        .filter(|v| v["kind"].as_str().is_some_and(|k| k.starts_with("ValidatingAdmissionPolicy")))
        .collect()
}

/// The doors tried, and how many were refused and allowed as they must be.
struct Doors<'a> {
    run: &'a Run,
    refused: u32,
    passed: u32,
}

impl Doors<'_> {
    fn refused<T: std::fmt::Debug>(&mut self, what: &str, expected: &str, result: kube::Result<T>) {
        forbidden(self.run, what, expected, result);
        self.refused += 1;
    }

    fn allowed<T>(&mut self, what: &str, result: kube::Result<T>) -> T {
        let t = allowed(self.run, what, result);
        self.passed += 1;
        t
    }
}

/// A pod the tenant creates, labelled app=NAME (the run's label too); bound to `node` when given.
async fn tenant_pod(client: &Client, run: &Run, ns: &str, name: &str, node: Option<&str>) -> Pod {
    let mut spec = json!({"terminationGracePeriodSeconds": 5,
        "containers": [{"name": "main", "image": "registry.k8s.io/pause:3.10"}]});
    if let Some(node) = node {
        spec["nodeName"] = node.into();
    }
    let pod: Pod = serde_json::from_value(json!({"metadata": {"name": name, "namespace": ns,
        "labels": {"app": name, "e2e.gpubudget.io/run": run.id}}, "spec": spec}))
    .expect("a pod");
    Api::<Pod>::namespaced(client.clone(), ns)
        .create(&PostParams::default(), &pod)
        .await
        .unwrap_or_else(|e| panic!("the tenant creates {name}: {e}"))
}

/// An update (PUT) of the pod's status subresource as `client`, with the object read now and `change` applied.
async fn status_put(
    run: &Run,
    client: &Client,
    ns: &str,
    pod: &str,
    change: impl FnOnce(&mut Pod),
) -> kube::Result<Pod> {
    let mut object = run.pod(ns, pod).await;
    change(&mut object);
    Api::<Pod>::namespaced(client.clone(), ns).replace_status(pod, &PostParams::default(), &object).await
}

/// An update (PUT) of the pod as `client`, with the object read now and `change` applied.
async fn pod_put(run: &Run, client: &Client, ns: &str, pod: &str, change: impl FnOnce(&mut Pod)) -> kube::Result<Pod> {
    let mut object = run.pod(ns, pod).await;
    change(&mut object);
    Api::<Pod>::namespaced(client.clone(), ns).replace(pod, &PostParams::default(), &object).await
}

pub async fn through_every_door() {
    let mut run = Run::start("gpubudget-rd", &["gpubudget-agent"]).await;
    let id = run.id.clone();
    let a = format!("gpubudget-rd-{id}"); // the release (its namespace too)
    let b = format!("{a}-b"); // a second release (its namespace too)
    let old = format!("{a}-old"); // the policies before issue 43
    // What the story renders or installs, known to the run before it borrows it (deleted with it).
    let before = policies(run.render_chart(&old, &a));
    let left = policies(run.render_chart(&b, &b));
    for release in [&a, &b, &format!("{b}-2")] {
        run.owns_release(release);
    }
    run.say("control plane, CRDs, the tenant (pods, pods/status, pods/binding, bindings, pods/ephemeralcontainers), one node");
    run.apply_crds().await;
    run.namespace(&a).await;
    run.namespace(&b).await;
    let ns_t = run.namespace(&format!("{a}-t")).await;
    let node = format!("{a}-n1");
    let node_uid = run.node(&node).await;
    run.apply(
        &json!({"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "tenant", "namespace": ns_t}}),
        &ns_t,
    )
    .await;
    run.apply(
        &json!({"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role",
            "metadata": {"name": "tenant", "namespace": ns_t},
            "rules": [
                {"apiGroups": [""], "resources": ["pods"],
                 "verbs": ["get", "list", "watch", "create", "delete", "patch", "update"]},
                {"apiGroups": [""], "resources": ["pods/status"], "verbs": ["get", "patch", "update"]},
                {"apiGroups": [""], "resources": ["pods/binding", "bindings"], "verbs": ["create"]},
                {"apiGroups": [""], "resources": ["pods/ephemeralcontainers"], "verbs": ["get", "patch", "update"]}]}),
        &ns_t,
    )
    .await;
    run.apply(
        &json!({"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
            "metadata": {"name": "tenant", "namespace": ns_t},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "tenant"},
            "subjects": [{"kind": "ServiceAccount", "name": "tenant", "namespace": ns_t}]}),
        &ns_t,
    )
    .await;
    // What the Node authorizer gives a kubelet, here by RBAC (this control plane runs RBAC only).
    let nodes_binding = format!("{a}-nodes");
    run.owns("rbac.authorization.k8s.io", "v1", "ClusterRoleBinding", None, &nodes_binding);
    run.apply(
        &json!({"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
            "metadata": {"name": nodes_binding},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "system:node"},
            "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "Group", "name": "system:nodes"}]}),
        &ns_t,
    )
    .await;
    let tenant_name = format!("system:serviceaccount:{ns_t}:tenant");
    let kubelet_name = format!("system:node:{node}");
    let tenant = run.as_user(&tenant_name).await;
    let kubelet = run.as_member(&kubelet_name, &["system:nodes", "system:authenticated"]).await;
    let admin = run.admin.clone();
    run.info(&format!("the tenant {tenant_name}, the kubelet {kubelet_name} (system:nodes)"));
    let mut doors = Doors { run: &run, refused: 0, passed: 0 };
    let pods = |c: &Client| Api::<Pod>::namespaced(c.clone(), &ns_t);
    let pp = PatchParams::default();

    run.say("0. before: the records and caps record policies as they were before issue 43 (resources: [pods] only)");
    let before: Vec<Value> = before
        .into_iter()
        .filter(|v| {
            v["metadata"]["name"].as_str().is_some_and(|n| n.ends_with("-records") || n.ends_with("-caps-record"))
        })
        .map(|mut v| {
            if v["kind"] == "ValidatingAdmissionPolicy" {
                let rules = v["spec"]["matchConstraints"]["resourceRules"].as_array_mut().expect("resource rules");
                rules.retain(|r| r["resources"].as_array().is_some_and(|rs| rs.contains(&json!("pods"))));
                for r in rules.iter_mut() {
                    r["resources"] = json!(["pods"]);
                }
            }
            v
        })
        .collect();
    for v in &before {
        run.apply(v, &a).await;
        run.info(&format!(
            "{}/{} applied",
            v["kind"].as_str().unwrap_or_default(),
            v["metadata"]["name"].as_str().unwrap_or_default()
        ));
    }
    assert_eq!(before.len(), 4, "the records and caps record policies and their bindings");
    tokio::time::sleep(Duration::from_secs(5)).await; // the policies reach the admission plugin
    tenant_pod(&tenant, &run, &ns_t, "before-bound", Some(&node)).await;
    tenant_pod(&tenant, &run, &ns_t, "before-unbound", None).await;
    let what = "the tenant annotates before-bound gpubudget.io/state=Evicting";
    doors.refused(
        what,
        "only the agent may set",
        patch_pod(&tenant, &ns_t, "before-bound", annotate("gpubudget.io/state", Some("Evicting"))).await,
    );
    let forged = json!({"metadata": {"annotations": {"gpubudget.io/state": "Evicting", "gpubudget.io/caps": "{\"budget\":\"forged\"}"}}});
    let what = "the tenant writes gpubudget.io/state and gpubudget.io/caps on before-bound through pods/status";
    doors.allowed(what, pods(&tenant).patch_status("before-bound", &pp, &Patch::Merge(&forged)).await);
    let what = "the tenant binds before-unbound through pods/binding carrying gpubudget.io/state=Evicting";
    doors.allowed(
        what,
        bind(&tenant, &binding(&ns_t, "before-unbound", &node, json!({"gpubudget.io/state": "Evicting"}))).await,
    );
    let bound = run.pod(&ns_t, "before-bound").await;
    let unbound = run.pod(&ns_t, "before-unbound").await;
    let unbound_node = unbound.spec.as_ref().and_then(|s| s.node_name.clone()).unwrap_or_default();
    run.info(&format!("before-bound:   {}", records(&bound)));
    run.info(&format!("before-unbound: {}   (bound to {unbound_node})", records(&unbound)));
    assert_eq!(annotation(&bound, "state").as_deref(), Some("Evicting"), "the door was not open before");
    assert_eq!(annotation(&unbound, "state").as_deref(), Some("Evicting"), "the binding's door was not open before");
    for v in &before {
        run.delete(v).await;
    }
    let now = DeleteParams { grace_period_seconds: Some(0), ..DeleteParams::default() };
    for name in ["before-bound", "before-unbound"] {
        pods(&admin).delete(name, &now).await.expect("deleted");
    }

    run.say(&format!("1. after: the chart, installed as release {a} (helm install)"));
    let (ok, out) = run.helm("install", &a, &a);
    assert!(ok, "helm install {a}: {out}");
    for line in out.lines().take(6) {
        run.info(line);
    }
    let instance = ListParams::default().labels(&format!("app.kubernetes.io/instance={a}"));
    let installed = Api::<ValidatingAdmissionPolicy>::all(admin.clone()).list(&instance).await.expect("policies");
    let names: Vec<String> = installed.items.iter().map(ResourceExt::name_any).collect();
    for name in &names {
        run.info(&format!("ValidatingAdmissionPolicy/{name}"));
    }
    for policy in ["agent-records", "operator-caps-record"] {
        assert!(names.contains(&format!("{a}-{policy}")), "helm install {a} left no {a}-{policy}: {names:?}");
    }
    tokio::time::sleep(Duration::from_secs(5)).await; // the policies reach the admission plugin
    let t_bound = tenant_pod(&tenant, &run, &ns_t, "t-bound", Some(&node)).await;
    tenant_pod(&tenant, &run, &ns_t, "t-unbound", None).await;
    tenant_pod(&tenant, &run, &ns_t, "t-unbound-2", None).await;
    let status_door = "refused through pods/status";
    for key in ["state", "usage-bytes", "budget", "node", "eviction-requested-at", "cap-not-in-force", "driver-limits"]
    {
        let what = format!("the tenant patches gpubudget.io/{key} on t-bound through pods/status");
        let patch = annotate(&format!("gpubudget.io/{key}"), Some("1"));
        doors.refused(&what, status_door, pods(&tenant).patch_status("t-bound", &pp, &Patch::Merge(&patch)).await);
    }
    let caps = "gpubudget.io/caps records what the gpubudget caps webhook did";
    let what = "the tenant patches gpubudget.io/caps on t-bound through pods/status";
    let patch = annotate("gpubudget.io/caps", Some("{\"budget\":\"forged\"}"));
    doors.refused(what, caps, pods(&tenant).patch_status("t-bound", &pp, &Patch::Merge(&patch)).await);
    let what = "the tenant patches gpubudget.io/caps=x on t-bound through pods/status (the answer names the door)";
    let patch = annotate("gpubudget.io/caps", Some("x"));
    doors.refused(what, status_door, pods(&tenant).patch_status("t-bound", &pp, &Patch::Merge(&patch)).await);
    let set = |key: &'static str, value: &'static str| {
        move |p: &mut Pod| {
            p.annotations_mut().insert(key.to_owned(), value.to_owned());
        }
    };
    let what = "the tenant updates t-bound's status with gpubudget.io/state=Evicting";
    doors.refused(
        what,
        status_door,
        status_put(&run, &tenant, &ns_t, "t-bound", set("gpubudget.io/state", "Evicting")).await,
    );
    let what = "the tenant updates t-bound's status with gpubudget.io/caps={}";
    doors.refused(what, status_door, status_put(&run, &tenant, &ns_t, "t-bound", set("gpubudget.io/caps", "{}")).await);
    let what = "the tenant annotates t-bound gpubudget.io/state=Evicting";
    let patch = annotate("gpubudget.io/state", Some("Evicting"));
    doors.refused(what, "refused through pods)", patch_pod(&tenant, &ns_t, "t-bound", patch).await);
    let what = "the tenant annotates t-bound gpubudget.io/caps=x";
    let patch = annotate("gpubudget.io/caps", Some("x"));
    doors.refused(what, "cannot be added, changed or removed", patch_pod(&tenant, &ns_t, "t-bound", patch).await);
    let what = "the tenant updates t-bound with gpubudget.io/eviction-requested-at";
    let change = set("gpubudget.io/eviction-requested-at", "2026-11-27T00:00:00Z");
    doors.refused(what, "refused through pods)", pod_put(&run, &tenant, &ns_t, "t-bound", change).await);
    let binding_door = "refused through pods/binding";
    for (key, value) in [("gpubudget.io/state", "Evicting"), ("gpubudget.io/caps", "x")] {
        let what = format!("the tenant binds t-unbound through pods/binding carrying {key}={value}");
        let carrying = binding(&ns_t, "t-unbound", &node, json!({key: value}));
        doors.refused(&what, binding_door, bind(&tenant, &carrying).await);
    }
    let what = "the tenant binds t-unbound through bindings carrying gpubudget.io/node=x";
    let carrying = binding(&ns_t, "t-unbound", &node, json!({"gpubudget.io/node": "x"}));
    doors.refused(what, "refused through bindings", bindings(&tenant, &carrying).await);
    let patch = json!({"metadata": {"annotations": {"gpubudget.io/state": "Evicting"}},
        "spec": {"ephemeralContainers": [{"name": "dbg", "image": "local/busybox:1"}]}});
    let what = "the tenant adds an ephemeral container to t-bound, with gpubudget.io/state=Evicting";
    let p = doors.allowed(
        what,
        pods(&tenant).patch_subresource("ephemeralcontainers", "t-bound", &pp, &Patch::Strategic(&patch)).await,
    );
    let debug = p
        .spec
        .as_ref()
        .and_then(|s| s.ephemeral_containers.as_ref())
        .is_some_and(|e| e.iter().any(|c| c.name == "dbg"));
    assert!(debug, "pods/ephemeralcontainers did not add the container");
    let p = run.pod(&ns_t, "t-bound").await;
    assert_eq!(annotation(&p, "state"), None, "pods/ephemeralcontainers kept a gpubudget.io/ annotation");
    run.info(&format!(
        "pods/ephemeralcontainers: the container added, the annotation dropped by the API server (t-bound: {})",
        records(&p)
    ));
    let p = run.pod(&ns_t, "t-unbound").await;
    let unbound_node = p.spec.as_ref().and_then(|s| s.node_name.clone()).unwrap_or_default();
    run.info(&format!("t-unbound: {}, node '{unbound_node}'", records(&p)));
    assert_eq!(unbound_node, "", "a refused binding bound t-unbound");

    run.say(
        "2. what must still pass: the tenant's and the kubelet's status writes, a plain binding, the agent's records",
    );
    let warm = json!({"status": {"conditions": [{"type": "example.com/Warm", "status": "True"}]}});
    doors.allowed(
        "the tenant's own status condition on t-bound",
        pods(&tenant).patch_status("t-bound", &pp, &Patch::Merge(&warm)).await,
    );
    let what = "the admin binds t-unbound-2 through pods/binding (no gpubudget.io/ keys)";
    doors.allowed(what, bind(&admin, &binding(&ns_t, "t-unbound-2", &node, json!({}))).await);
    let p = run.pod(&ns_t, "t-unbound-2").await;
    let bound_to = p.spec.as_ref().and_then(|s| s.node_name.clone()).unwrap_or_default();
    run.info(&format!("t-unbound-2 bound to '{bound_to}' (the scheduler's kind of binding)"));
    assert_eq!(bound_to, node, "t-unbound-2 not bound");
    // The agent: its token bound to the node, a budget selecting t-bound, t-bound running and holding 2Gi.
    run.apply(
        &json!({"apiVersion": "gpubudget.io/v1alpha1", "kind": "GpuMemoryBudget",
            "metadata": {"name": "small", "namespace": ns_t},
            "spec": {"selector": {"matchLabels": {"app": "t-bound"}}, "limit": "4Gi", "action": "Warn"}}),
        &ns_t,
    )
    .await;
    let mut w = Workloads::new(&run, &ns_t, &node, 7100);
    w.running("t-bound", &t_bound.uid().expect("a uid")).await;
    w.sample(&[("t-bound", 2 * GI)]);
    let agent = run.chart_agent(&a, &a, (&node, &node_uid), "agent").await;
    let agent_admin = run.addr(0);
    let _agent = run.start_agent(&agent, &node, &agent_admin, &[], &[("RUST_LOG", "info")], "agent.log").await;
    let p = run.record_is(&ns_t, "t-bound", "state", "Within").await;
    run.info(&format!("t-bound: {}", records(&p)));
    let what = "the tenant patches gpubudget.io/state=Over on t-bound through pods/status";
    let patch = annotate("gpubudget.io/state", Some("Over"));
    doors.refused(what, status_door, pods(&tenant).patch_status("t-bound", &pp, &Patch::Merge(&patch)).await);
    let what = "the tenant updates t-bound's status without the agent's records";
    let strip = |p: &mut Pod| p.annotations_mut().retain(|k, _| !k.starts_with("gpubudget.io/"));
    doors.refused(what, status_door, status_put(&run, &tenant, &ns_t, "t-bound", strip).await);
    let what = "the admin patches gpubudget.io/usage-bytes=0 on t-bound through pods/status";
    let patch = annotate("gpubudget.io/usage-bytes", Some("0"));
    doors.refused(what, status_door, pods(&admin).patch_status("t-bound", &pp, &Patch::Merge(&patch)).await);
    let probe = json!({"status": {"conditions": [{"type": "Ready", "status": "False", "reason": "KubeletProbe"}]}});
    let what = "the kubelet patches t-bound's status (strategic: Ready False)";
    doors.allowed(what, pods(&kubelet).patch_status("t-bound", &pp, &Patch::Strategic(&probe)).await);
    let what = "the kubelet updates t-bound's status (Ready True)";
    let ready = |p: &mut Pod| {
        let status = p.status.get_or_insert_default();
        status.conditions =
            Some(vec![serde_json::from_value(json!({"type": "Ready", "status": "True"})).expect("a condition")]);
    };
    doors.allowed(what, status_put(&run, &kubelet, &ns_t, "t-bound", ready).await);
    let p = run.pod(&ns_t, "t-bound").await;
    run.info(&format!("t-bound after the kubelet's writes: {}", records(&p)));
    assert_eq!(annotation(&p, "state").as_deref(), Some("Within"), "the agent's record changed");

    run.say("3. one release per cluster");
    let (ok, out) = run.helm("install", &b, &b);
    for line in out.lines() {
        run.info(line);
    }
    assert!(!ok, "a second release installed");
    let first = format!("belongs to release \"{a}\" in namespace \"{a}\"");
    assert!(
        out.contains("gpubudget is already installed in this cluster: ") && out.contains(&first),
        "the second install failed without naming the first release: {out}"
    );
    run.info(&format!("ok: helm install {b} refused, naming release {a}"));
    let (ok, out) = run.helm("upgrade", &a, &a);
    assert!(ok, "helm upgrade {a}: {out}");
    run.info(&format!("ok: helm upgrade {a}: {}", out.lines().find(|l| l.starts_with("STATUS")).unwrap_or_default()));
    // Policies another install left: release B's, applied without Helm (as an old chart or a kubectl apply would).
    for v in &left {
        run.apply(v, &b).await;
        run.info(&format!(
            "{}/{} applied",
            v["kind"].as_str().unwrap_or_default(),
            v["metadata"]["name"].as_str().unwrap_or_default()
        ));
    }
    let (ok, out) = run.helm("install", &format!("{b}-2"), &b);
    for line in out.lines() {
        run.info(line);
    }
    assert!(!ok, "a release installed next to another install's policies");
    tokio::time::sleep(Duration::from_secs(5)).await; // the policies reach the admission plugin
    let due = Instant::now();
    w.sample(&[("t-bound", 5 * GI)]); // over its 4Gi: the agent writes an Over record, which B's records policy refuses
    let denied = "GpuBudgetWriteDenied";
    let (r, n) = (&run, node.as_str());
    let told_on = move || async move { !r.node_events(n, denied).await.is_empty() };
    let t_told = run.timed(&format!("{denied} on Node {node}"), due, told_on).await;
    let event = run.object_events("Node", &node, denied).await.remove(0);
    let note = event.message.clone().unwrap_or_default();
    run.info(&format!(
        "told {t_told:.1} s after the refused write was due: {} {denied} on Node {node}:",
        event.type_.as_deref().unwrap_or_default()
    ));
    run.info(&format!("  {note}"));
    assert_eq!(event.type_.as_deref(), Some("Warning"), "{denied} is not a Warning");
    let named = format!("ValidatingAdmissionPolicy {b}-agent-records (HTTP 403)");
    assert!(note.contains(&named), "the event does not name B's records policy: {note}");
    let p = run.pod(&ns_t, "t-bound").await;
    assert_eq!(annotation(&p, "state").as_deref(), Some("Within"), "a refused record landed");
    tokio::time::sleep(Duration::from_secs(10)).await;
    let counted = metric(&metrics(&agent_admin).await, "gpubudget_api_writes_total{kind=\"apply\",result=\"denied\"}");
    let counted: u64 = counted.and_then(|c| c.parse().ok()).unwrap_or(0);
    let told: i32 = run.node_events(&node, denied).await.iter().map(|(count, _)| count).sum();
    run.info(&format!(
        "10 s later: gpubudget_api_writes_total{{kind=\"apply\",result=\"denied\"}} {counted}, {denied} told {told} time(s)"
    ));
    assert!(counted >= 2, "expected several denied writes: {counted}");
    assert_eq!(told, 1, "expected one {denied} event");
    for v in &left {
        run.delete(v).await;
    }
    run.record_is(&ns_t, "t-bound", "state", "Over").await;
    run.info("ok: the Over record lands once the other install's policies are gone");

    let (refused, passed) = (doors.refused, doors.passed);
    run.say(&format!(
        "PASS: {refused} writes through pods, pods/status, pods/binding and bindings refused, {passed} allowed as they \
         must; one release per cluster ({} s)",
        run.elapsed()
    ));
}
