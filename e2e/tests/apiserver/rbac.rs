//! Who may touch the cluster-scoped kinds (issue 23; formerly cluster-budget-rbac.sh and quota-rbac.sh): the CRDs
//! and the chart's RBAC (ServiceAccounts, ClusterRoles, bindings), then, by impersonation (`kubectl --as`):
//! tenants (alice: `admin` of a namespace; bob: `edit` there) cannot create, edit, delete nor even read a
//! ClusterGpuMemoryBudget or a ClusterGpuMemoryQuota (nor a quota's status), nor relabel their namespace out of a
//! namespaceSelector; a cluster-wide viewer (carol: the built-in `view`, which the chart's budgets-view role
//! aggregates into) reads them and writes nothing; the agent lists and watches cluster budgets and namespaces;
//! the operator reads quotas, writes their status, evicts and never writes a quota's spec; the CRDs' CEL rules and
//! schema refuse bad specs. No agent or operator runs. Every request and its answer is printed.

use std::fmt::Debug;

use k8s_openapi::api::authorization::v1::{ResourceAttributes, SelfSubjectAccessReview, SelfSubjectAccessReviewSpec};
use k8s_openapi::api::core::v1::Namespace;
use kube::api::{Api, ApiResource, DeleteParams, DynamicObject, Patch, PatchParams, PostParams};
use kube::core::GroupVersionKind;
use kube::{Client, ResourceExt};
use serde_json::{Value, json};

use crate::harness::{RBAC_AND_POLICIES, Run, table};

/// What a request should get.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Want {
    /// Done.
    Ok,
    /// Forbidden (403): RBAC.
    Denied,
    /// Invalid (422): the schema's or a CEL rule's refusal.
    Invalid,
    /// An unknown field refused by strict field validation (400, strict decoding).
    Unknown,
}

/// Prints the request and its answer; fails unless it is the one wanted.
fn expect<T: Debug>(run: &Run, want: Want, who: &str, what: &str, result: kube::Result<T>) {
    let answer = match &result {
        Ok(_) => "ok".to_owned(),
        Err(kube::Error::Api(s)) => format!("{} ({}): {}", s.reason, s.code, s.message),
        Err(e) => e.to_string(),
    };
    run.info(&format!("$ {what}    # as {who}, expect {want:?}"));
    run.info(&format!("  {answer}"));
    let code = match &result {
        Err(kube::Error::Api(s)) => Some(s.code),
        _ => None,
    };
    let got = match (result.is_ok(), code) {
        (true, _) => Some(Want::Ok),
        (false, Some(403)) => Some(Want::Denied),
        (false, Some(400 | 422)) if answer.contains("unknown field") => Some(Want::Unknown),
        (false, Some(422)) => Some(Want::Invalid),
        _ => None,
    };
    assert_eq!(got, Some(want), "{what} as {who}: {answer}");
}

/// `kubectl auth can-i VERB RESOURCE[/SUBRESOURCE] [-n NAMESPACE]` as `client`.
async fn can_i(client: &Client, verb: &str, resource: &str, namespace: Option<&str>) -> bool {
    let (resource, subresource) = match resource.split_once('/') {
        Some((r, s)) => (r, Some(s.to_owned())),
        None => (resource, None),
    };
    let (resource, group) = resource.split_once('.').unwrap_or((resource, ""));
    let review = SelfSubjectAccessReview {
        spec: SelfSubjectAccessReviewSpec {
            resource_attributes: Some(ResourceAttributes {
                verb: Some(verb.into()),
                group: Some(group.into()),
                resource: Some(resource.into()),
                subresource,
                namespace: namespace.map(str::to_owned),
                ..ResourceAttributes::default()
            }),
            ..SelfSubjectAccessReviewSpec::default()
        },
        ..SelfSubjectAccessReview::default()
    };
    let answer = Api::<SelfSubjectAccessReview>::all(client.clone())
        .create(&PostParams::default(), &review)
        .await
        .expect("an access review");
    answer.status.is_some_and(|s| s.allowed)
}

/// Fails unless `who` may (`want`) `verb` the resource.
async fn may(run: &Run, client: &Client, who: &str, verb: &str, resource: &str, namespace: Option<&str>, want: bool) {
    let allowed = can_i(client, verb, resource, namespace).await;
    let ns = namespace.map(|n| format!(" -n {n}")).unwrap_or_default();
    run.info(&format!("$ auth can-i {verb} {resource}{ns}    # as {who}: {}", if allowed { "yes" } else { "no" }));
    assert_eq!(allowed, want, "{who} may {verb} {resource}{ns}: {allowed}");
}

/// A gpubudget.io cluster-scoped kind.
fn resource(kind: &str, plural: &str) -> ApiResource {
    ApiResource::from_gvk_with_plural(&GroupVersionKind::gvk("gpubudget.io", "v1alpha1", kind), plural)
}

/// `kubectl create -f` of a cluster-scoped object as `client`: a POST with strict field validation (an unknown
/// field refused, not dropped).
async fn create(client: &Client, kind: &str, plural: &str, name: &str, spec: Value) -> kube::Result<Value> {
    let object = json!({"apiVersion": "gpubudget.io/v1alpha1", "kind": kind, "metadata": {"name": name}, "spec": spec});
    let request = http::Request::post(format!("/apis/gpubudget.io/v1alpha1/{plural}?fieldValidation=Strict"))
        .header("Content-Type", "application/json")
        .body(serde_json::to_vec(&object).expect("json"))
        .expect("a request");
    client.request::<Value>(request).await
}

/// The tenants' namespace, its tenants (alice admin, bob edit) and carol viewing cluster-wide; the chart's RBAC
/// in the release namespace. Returns (the tenants' namespace, the release's name and namespace).
async fn setup(run: &mut Run, prefix: &str) -> (String, String, String) {
    let id = run.id.clone();
    run.say("as the admin: the CRDs, the chart's RBAC, the tenants' namespace (tier=tenant), alice (admin), bob (edit), carol (view)");
    run.apply_crds().await;
    let release = format!("{prefix}-{id}");
    let release_ns = run.namespace(&release).await;
    run.apply_chart(&release, &release_ns, RBAC_AND_POLICIES, None).await;
    let ns = run.namespace(&format!("{prefix}-{id}-team")).await;
    let tier = json!({"metadata": {"labels": {"gpubudget.io/tier": format!("tenant-{id}")}}});
    Api::<Namespace>::all(run.admin.clone())
        .patch(&ns, &PatchParams::default(), &Patch::Merge(&tier))
        .await
        .expect("labelled");
    for (name, role, user) in [("alice-admin", "admin", "alice"), ("bob-edit", "edit", "bob")] {
        let binding = json!({"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
            "metadata": {"name": name, "namespace": ns},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": role},
            "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": user}]});
        run.apply(&binding, &ns).await;
    }
    let carol = format!("{prefix}-{id}-carol-view");
    run.apply(
        &json!({"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding", "metadata": {"name": carol},
                "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "view"},
                "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": "carol"}]}),
        "",
    )
    .await;
    run.owns("rbac.authorization.k8s.io", "v1", "ClusterRoleBinding", None, &carol);
    (ns, release, release_ns)
}

/// Tenants may not move their namespace out of a namespaceSelector.
async fn no_relabelling(run: &Run, who: &str, client: &Client, ns: &str) {
    let unlabel = json!({"metadata": {"labels": {"gpubudget.io/tier": null}}});
    let result =
        Api::<Namespace>::all(client.clone()).patch(ns, &PatchParams::default(), &Patch::Merge(&unlabel)).await;
    expect(run, Want::Denied, who, &format!("label namespace {ns} gpubudget.io/tier-"), result);
}

pub async fn cluster_budgets() {
    const KIND: &str = "ClusterGpuMemoryBudget";
    const PLURAL: &str = "clustergpumemorybudgets";
    let mut run = Run::start("gpubudget-cgmb", &[]).await;
    let (ns, release, release_ns) = setup(&mut run, "gpubudget-cgmb").await;
    let carol = run.as_user("carol").await;
    run.until("view to aggregate the chart's budgets-view rule (cgmb read)", || {
        can_i(&carol, "list", "clustergpumemorybudgets.gpubudget.io", None)
    })
    .await;
    let name = format!("tenants-{}", run.id);
    run.owns("gpubudget.io", "v1alpha1", KIND, None, &name);
    let spec = json!({"namespaceSelector": {"matchLabels": {"gpubudget.io/tier": format!("tenant-{}", run.id)}},
        "selector": {}, "limit": "8Gi", "request": "4Gi", "overLimitSeconds": 30});
    expect(
        &run,
        Want::Ok,
        "admin",
        &format!("create cgmb {name}"),
        create(&run.admin, KIND, PLURAL, &name, spec).await,
    );

    run.say("tenants: no write, no read of the cluster kind; no relabelling of their namespace");
    for who in ["alice", "bob"] {
        let client = run.as_user(who).await;
        for verb in ["create", "update", "patch", "delete", "get", "list", "watch"] {
            may(&run, &client, who, verb, "clustergpumemorybudgets.gpubudget.io", None, false).await;
        }
        let api = Api::<DynamicObject>::all_with(client.clone(), &resource(KIND, PLURAL));
        let mine = format!("mine-{who}-{}", run.id);
        expect(
            &run,
            Want::Denied,
            who,
            &format!("create cgmb {mine}"),
            create(&client, KIND, PLURAL, &mine, json!({"selector": {}, "limit": "64Gi"})).await,
        );
        for patch in [json!({"spec": {"limit": "64Gi"}}), json!({"spec": {"action": "Warn"}})] {
            expect(
                &run,
                Want::Denied,
                who,
                &format!("patch cgmb {name} {patch}"),
                api.patch(&name, &PatchParams::default(), &Patch::Merge(&patch)).await,
            );
        }
        expect(
            &run,
            Want::Denied,
            who,
            &format!("delete cgmb {name}"),
            api.delete(&name, &DeleteParams::default()).await,
        );
        expect(&run, Want::Denied, who, &format!("get cgmb {name}"), api.get(&name).await);
        no_relabelling(&run, who, &client, &ns).await;
    }
    let alice = run.as_user("alice").await;
    may(&run, &alice, "alice", "get", "pods", Some(&ns), true).await;
    may(&run, &alice, "alice", "create", "gpumemorybudgets.gpubudget.io", Some(&ns), false).await;

    run.say("carol, view cluster-wide: reads the cluster budget (the printer columns), writes nothing");
    let api = Api::<DynamicObject>::all_with(carol.clone(), &resource(KIND, PLURAL));
    expect(&run, Want::Ok, "carol", &format!("get cgmb {name}"), api.get(&name).await);
    expect(
        &run,
        Want::Denied,
        "carol",
        &format!("patch cgmb {name}"),
        api.patch(&name, &PatchParams::default(), &Patch::Merge(&json!({"spec": {"limit": "64Gi"}}))).await,
    );
    expect(
        &run,
        Want::Denied,
        "carol",
        &format!("delete cgmb {name}"),
        api.delete(&name, &DeleteParams::default()).await,
    );
    let (columns, rows) = table(&carol, "/apis/gpubudget.io/v1alpha1/clustergpumemorybudgets").await;
    assert_eq!(
        columns.join(" "),
        "NAME REQUEST LIMIT ACTION MATCHED OVER CAPPED SHARE EVICTED AGE",
        "kubectl get cgmb columns"
    );
    run.info(&format!("columns: {}", columns.join(" ")));
    let row = rows.iter().find(|r| r[0] == name).expect("the budget's row");
    run.info(&format!("row: {}", row.join(" | ")));

    run.say("the agent's ServiceAccount: list and watch cluster budgets and namespaces, nothing more");
    let agent_name = format!("system:serviceaccount:{release_ns}:{release}-agent");
    let agent = run.as_user(&agent_name).await;
    for verb in ["list", "watch"] {
        may(&run, &agent, "the agent", verb, "clustergpumemorybudgets.gpubudget.io", None, true).await;
        may(&run, &agent, "the agent", verb, "namespaces", None, true).await;
    }
    for verb in ["create", "update", "patch", "delete"] {
        may(&run, &agent, "the agent", verb, "clustergpumemorybudgets.gpubudget.io", None, false).await;
        may(&run, &agent, "the agent", verb, "namespaces", None, false).await;
    }

    run.say("the CRD's rules refuse bad specs (the same CEL rules as GpuMemoryBudget, and namespaceSelector's)");
    for spec in [
        json!({"selector": {}, "limit": "1Gi", "request": "2Gi"}),
        json!({"selector": {}, "limit": "0"}),
        json!({"selector": {}, "limit": "8 GiB"}),
        json!({"selector": {}, "limit": "1Gi", "warnAtPercent": 0}),
        json!({"selector": {}, "limit": "1Gi", "overLimitSeconds": -1}),
        json!({"selector": {}, "limit": "1Gi", "evictionGracePeriodSeconds": 0}),
        json!({"selector": {}, "limit": "1Gi", "action": "Kill"}),
        json!({"namespaceSelector": {"matchExpressions": [{"key": "tier", "operator": "Equals", "values": ["x"]}]}, "selector": {}, "limit": "1Gi"}),
        json!({"namespaceSelector": {"matchExpressions": [{"key": "tier", "operator": "In"}]}, "selector": {}, "limit": "1Gi"}),
        json!({"limit": "1Gi"}),
    ] {
        let bad = format!("bad-{}", run.id);
        expect(
            &run,
            Want::Invalid,
            "admin",
            &format!("create cgmb {bad} {spec}"),
            create(&run.admin, KIND, PLURAL, &bad, spec).await,
        );
    }
    run.say(&format!(
        "PASS: tenants (admin, edit of a namespace) cannot create, edit, delete or read a ClusterGpuMemoryBudget nor \
         relabel their namespace; a cluster-wide viewer reads it; the agent lists and watches; bad specs are refused \
         ({} s)",
        run.elapsed()
    ));
}

pub async fn quotas() {
    const KIND: &str = "ClusterGpuMemoryQuota";
    const PLURAL: &str = "clustergpumemoryquotas";
    let mut run = Run::start("gpubudget-cgmq", &[]).await;
    let (ns, release, release_ns) = setup(&mut run, "gpubudget-cgmq").await;
    let carol = run.as_user("carol").await;
    run.until("view to aggregate the chart's budgets-view rule (cgmq read)", || {
        can_i(&carol, "list", "clustergpumemoryquotas.gpubudget.io", None)
    })
    .await;
    let name = format!("tenant-totals-{}", run.id);
    run.owns("gpubudget.io", "v1alpha1", KIND, None, &name);
    let spec = json!({"namespaceSelector": {"matchLabels": {"gpubudget.io/tier": format!("tenant-{}", run.id)}},
        "limit": "64Gi", "overLimitSeconds": 60});
    expect(
        &run,
        Want::Ok,
        "admin",
        &format!("create cgmq {name}"),
        create(&run.admin, KIND, PLURAL, &name, spec).await,
    );
    // A status write as the operator makes it: server-side apply of /status (a PATCH, no GET), forcing ownership.
    let status = json!({"apiVersion": "gpubudget.io/v1alpha1", "kind": KIND, "metadata": {"name": name},
        "status": {"namespacesOver": 0, "evictions": 0}});
    let write_status = |client: &Client| {
        let api = Api::<DynamicObject>::all_with(client.clone(), &resource(KIND, PLURAL));
        let (name, status) = (name.clone(), status.clone());
        async move {
            api.patch_status(&name, &PatchParams::apply("gpubudget-operator/quota").force(), &Patch::Apply(&status))
                .await
        }
    };

    run.say("tenants: no write, no read of the quota or its status");
    for who in ["alice", "bob"] {
        let client = run.as_user(who).await;
        for verb in ["create", "update", "patch", "delete", "get", "list", "watch"] {
            may(&run, &client, who, verb, "clustergpumemoryquotas.gpubudget.io", None, false).await;
        }
        may(&run, &client, who, "patch", "clustergpumemoryquotas.gpubudget.io/status", None, false).await;
        let api = Api::<DynamicObject>::all_with(client.clone(), &resource(KIND, PLURAL));
        let mine = format!("mine-{who}-{}", run.id);
        expect(
            &run,
            Want::Denied,
            who,
            &format!("create cgmq {mine}"),
            create(&client, KIND, PLURAL, &mine, json!({"limit": "1Ti"})).await,
        );
        for patch in [json!({"spec": {"limit": "1Ti"}}), json!({"spec": {"action": "Warn"}})] {
            expect(
                &run,
                Want::Denied,
                who,
                &format!("patch cgmq {name} {patch}"),
                api.patch(&name, &PatchParams::default(), &Patch::Merge(&patch)).await,
            );
        }
        expect(
            &run,
            Want::Denied,
            who,
            &format!("apply cgmq {name} --subresource=status"),
            write_status(&client).await,
        );
        expect(
            &run,
            Want::Denied,
            who,
            &format!("delete cgmq {name}"),
            api.delete(&name, &DeleteParams::default()).await,
        );
        expect(&run, Want::Denied, who, &format!("get cgmq {name}"), api.get(&name).await);
        no_relabelling(&run, who, &client, &ns).await;
    }

    run.say("carol, view cluster-wide: reads the quota (the printer columns), writes nothing");
    let api = Api::<DynamicObject>::all_with(carol.clone(), &resource(KIND, PLURAL));
    expect(&run, Want::Ok, "carol", &format!("get cgmq {name}"), api.get(&name).await);
    expect(
        &run,
        Want::Denied,
        "carol",
        &format!("patch cgmq {name}"),
        api.patch(&name, &PatchParams::default(), &Patch::Merge(&json!({"spec": {"limit": "1Ti"}}))).await,
    );
    expect(&run, Want::Denied, "carol", &format!("apply cgmq {name} --subresource=status"), write_status(&carol).await);
    expect(
        &run,
        Want::Denied,
        "carol",
        &format!("delete cgmq {name}"),
        api.delete(&name, &DeleteParams::default()).await,
    );
    let (columns, rows) = table(&carol, "/apis/gpubudget.io/v1alpha1/clustergpumemoryquotas").await;
    assert_eq!(columns.join(" "), "NAME LIMIT ACTION NAMESPACES OVER EVICTED AGE", "kubectl get cgmq columns");
    run.info(&format!("columns: {}", columns.join(" ")));
    let row = rows.iter().find(|r| r[0] == name).expect("the quota's row");
    run.info(&format!("row: {}", row.join(" | ")));

    run.say("the operator's ServiceAccount: reads quotas, writes their status, evicts; never writes a quota's spec");
    let operator_name = format!("system:serviceaccount:{release_ns}:{release}-operator");
    let operator = run.as_user(&operator_name).await;
    let who = "the operator";
    for verb in ["get", "list", "watch"] {
        may(&run, &operator, who, verb, "clustergpumemoryquotas.gpubudget.io", None, true).await;
    }
    may(&run, &operator, who, "patch", "clustergpumemoryquotas.gpubudget.io/status", None, true).await;
    may(&run, &operator, who, "create", "pods/eviction", Some(&ns), true).await;
    may(&run, &operator, who, "delete", "pods", Some(&ns), true).await;
    may(&run, &operator, who, "list", "namespaces", None, true).await;
    may(&run, &operator, who, "watch", "namespaces", None, true).await;
    for verb in ["create", "update", "patch", "delete"] {
        may(&run, &operator, who, verb, "clustergpumemoryquotas.gpubudget.io", None, false).await;
    }
    expect(&run, Want::Ok, who, &format!("apply cgmq {name} --subresource=status"), write_status(&operator).await);
    let api = Api::<DynamicObject>::all_with(operator.clone(), &resource(KIND, PLURAL));
    expect(
        &run,
        Want::Denied,
        who,
        &format!("patch cgmq {name}"),
        api.patch(&name, &PatchParams::default(), &Patch::Merge(&json!({"spec": {"limit": "1Ti"}}))).await,
    );

    run.say("the CRD's rules refuse bad specs (the budgets' CEL rules and namespaceSelector's, shared)");
    for spec in [
        json!({"limit": "0"}),
        json!({"limit": "8 GiB"}),
        json!({"limit": "1Gi", "warnAtPercent": 0}),
        json!({"limit": "1Gi", "overLimitSeconds": -1}),
        json!({"limit": "1Gi", "evictionGracePeriodSeconds": 0}),
        json!({"limit": "1Gi", "blockedEvictionTimeoutSeconds": 90000}),
        json!({"limit": "1Gi", "action": "Kill"}),
        json!({"namespaceSelector": {"matchExpressions": [{"key": "tier", "operator": "Equals", "values": ["x"]}]}, "limit": "1Gi"}),
        json!({"namespaceSelector": {"matchExpressions": [{"key": "tier", "operator": "In"}]}, "limit": "1Gi"}),
        json!({"selector": {"matchExpressions": [{"key": "app", "operator": "Exists", "values": ["x"]}]}, "limit": "1Gi"}),
        json!({"selector": {}}),
    ] {
        let bad = format!("bad-{}", run.id);
        expect(
            &run,
            Want::Invalid,
            "admin",
            &format!("create cgmq {bad} {spec}"),
            create(&run.admin, KIND, PLURAL, &bad, spec).await,
        );
    }
    let bad = format!("bad-{}", run.id);
    let spec = json!({"limit": "1Gi", "request": "1Gi"});
    expect(
        &run,
        Want::Unknown,
        "admin",
        &format!("create cgmq {bad} {spec}"),
        create(&run.admin, KIND, PLURAL, &bad, spec).await,
    );
    let created =
        Api::<DynamicObject>::all_with(run.admin.clone(), &resource(KIND, PLURAL)).get_opt(&bad).await.expect("read");
    assert!(created.is_none(), "a refused quota was stored: {:?}", created.map(|c| c.name_any()));
    run.say(&format!(
        "PASS: tenants (admin, edit of a namespace) cannot create, edit, delete or read a ClusterGpuMemoryQuota nor \
         write its status; a cluster-wide viewer reads it; the operator writes its status and evicts, never its spec; \
         bad specs are refused ({} s)",
        run.elapsed()
    ));
}
