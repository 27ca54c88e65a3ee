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
use kube::api::{Api, DeleteParams, DynamicObject, Patch, PatchParams, PostParams};
use kube::{Client, ResourceExt};
use serde_json::{Value, json};

use crate::harness::{RBAC_AND_POLICIES, Run, gpubudget_resource, table};

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

/// A cluster-scoped gpubudget.io kind: who may write and read it, and what its CRD's rules refuse.
struct Kind {
    /// The kind.
    kind: &'static str,
    /// Its short name, as the printed `kubectl` lines say it (`cgmb`).
    short: &'static str,
    /// A limit no tenant may give itself (what the refused writes ask for).
    limit: &'static str,
    /// The status the operator writes, where the story checks who may write it.
    status: Option<Value>,
}

impl Kind {
    /// `<plural>.gpubudget.io`, as `kubectl auth can-i` names it.
    fn rule(&self) -> String {
        format!("{}.gpubudget.io", gpubudget_resource(self.kind).plural)
    }

    /// The kind as `client`.
    fn api(&self, client: &Client) -> Api<DynamicObject> {
        Api::all_with(client.clone(), &gpubudget_resource(self.kind))
    }

    /// `kubectl create -f` of one as `client`: a POST with strict field validation (an unknown field refused, not
    /// dropped).
    async fn create(&self, client: &Client, name: &str, spec: Value) -> kube::Result<Value> {
        let object =
            json!({"apiVersion": "gpubudget.io/v1alpha1", "kind": self.kind, "metadata": {"name": name}, "spec": spec});
        let plural = gpubudget_resource(self.kind).plural;
        let request = http::Request::post(format!("/apis/gpubudget.io/v1alpha1/{plural}?fieldValidation=Strict"))
            .header("Content-Type", "application/json")
            .body(serde_json::to_vec(&object).expect("json"))
            .expect("a request");
        client.request::<Value>(request).await
    }

    /// A status write as the operator makes it, as `client`: server-side apply of /status (a PATCH, no GET),
    /// forcing ownership.
    async fn write_status(&self, client: &Client, name: &str) -> kube::Result<DynamicObject> {
        let status = self.status.clone().expect("a kind whose status the story writes");
        let object = json!({"apiVersion": "gpubudget.io/v1alpha1", "kind": self.kind, "metadata": {"name": name},
            "status": status});
        let apply = PatchParams::apply("gpubudget-operator/quota").force();
        self.api(client).patch_status(name, &apply, &Patch::Apply(&object)).await
    }
}

/// A story on one cluster-scoped kind: the run, the tenants' namespace (alice admin, bob edit), the chart's
/// release, carol viewing cluster-wide, and the one object the admin created.
struct Story {
    run: Run,
    kind: Kind,
    /// The tenants' namespace.
    ns: String,
    /// The chart's release and its namespace.
    release: (String, String),
    carol: Client,
    /// The admin's object.
    name: String,
}

impl Story {
    /// As the admin: the CRDs, the chart's RBAC in the release namespace, the tenants' namespace and its tenants,
    /// carol (once `view` aggregates the chart's read rule), and the object `<name>-<id>` selecting the tenants'
    /// namespace, `spec` besides.
    async fn start(prefix: &str, kind: Kind, name: &str, spec: Value) -> Self {
        let mut run = Run::start(prefix, &[]).await;
        let id = run.id.clone();
        run.say("as the admin: the CRDs, the chart's RBAC, the tenants' namespace (tier=tenant), alice (admin), bob (edit), carol (view)");
        run.apply_crds().await;
        let release = format!("{prefix}-{id}");
        let release_ns = run.namespace(&release).await;
        run.apply_chart(&release, &release_ns, RBAC_AND_POLICIES, None).await;
        let ns = run.namespace(&format!("{prefix}-{id}-team")).await;
        let tier = format!("tenant-{id}");
        run.label_namespace(&ns, "gpubudget.io/tier", &tier).await;
        for (name, role, user) in [("alice-admin", "admin", "alice"), ("bob-edit", "edit", "bob")] {
            let binding = json!({"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
                "metadata": {"name": name, "namespace": ns},
                "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": role},
                "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": user}]});
            run.apply(&binding, &ns).await;
        }
        let viewer = format!("{prefix}-{id}-carol-view");
        run.apply(
            &json!({"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding", "metadata": {"name": viewer},
                    "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "view"},
                    "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": "carol"}]}),
            "",
        )
        .await;
        run.owns("rbac.authorization.k8s.io", "v1", "ClusterRoleBinding", None, &viewer);
        let carol = run.as_user("carol").await;
        let what = format!("view to aggregate the chart's budgets-view rule ({} read)", kind.short);
        let rule = kind.rule();
        run.until(&what, || can_i(&carol, "list", &rule, None)).await;
        let name = format!("{name}-{id}");
        run.owns("gpubudget.io", "v1alpha1", kind.kind, None, &name);
        let mut full = json!({"namespaceSelector": {"matchLabels": {"gpubudget.io/tier": tier}}});
        full.as_object_mut().expect("an object").extend(spec.as_object().expect("an object").clone());
        let created = kind.create(&run.admin, &name, full).await;
        expect(&run, Want::Ok, "admin", &format!("create {} {name}", kind.short), created);
        Self { run, kind, ns, release: (release, release_ns), carol, name }
    }

    /// Tenants (alice, bob): may not create, edit, delete or read the kind (nor write its status, where the story
    /// checks it), each write refused (`mine`: the spec of the one each tries to create); no relabelling of their
    /// namespace.
    async fn tenants_refused(&self, mine: Value) {
        let (run, kind, name) = (&self.run, &self.kind, &self.name);
        let short = kind.short;
        for who in ["alice", "bob"] {
            let client = run.as_user(who).await;
            for verb in ["create", "update", "patch", "delete", "get", "list", "watch"] {
                may(run, &client, who, verb, &kind.rule(), None, false).await;
            }
            if kind.status.is_some() {
                may(run, &client, who, "patch", &format!("{}/status", kind.rule()), None, false).await;
            }
            let api = kind.api(&client);
            let theirs = format!("mine-{who}-{}", run.id);
            let created = kind.create(&client, &theirs, mine.clone()).await;
            expect(run, Want::Denied, who, &format!("create {short} {theirs}"), created);
            for patch in [json!({"spec": {"limit": kind.limit}}), json!({"spec": {"action": "Warn"}})] {
                let patched = api.patch(name, &PatchParams::default(), &Patch::Merge(&patch)).await;
                expect(run, Want::Denied, who, &format!("patch {short} {name} {patch}"), patched);
            }
            if kind.status.is_some() {
                let what = format!("apply {short} {name} --subresource=status");
                expect(run, Want::Denied, who, &what, kind.write_status(&client, name).await);
            }
            let deleted = api.delete(name, &DeleteParams::default()).await;
            expect(run, Want::Denied, who, &format!("delete {short} {name}"), deleted);
            expect(run, Want::Denied, who, &format!("get {short} {name}"), api.get(name).await);
            no_relabelling(run, who, &client, &self.ns).await;
        }
    }

    /// carol, viewing cluster-wide: reads the object, and its printer columns (`columns`); writes nothing.
    async fn viewer_reads(&self, columns: &str) {
        let (run, kind, name, carol) = (&self.run, &self.kind, &self.name, &self.carol);
        let short = kind.short;
        let api = kind.api(carol);
        expect(run, Want::Ok, "carol", &format!("get {short} {name}"), api.get(name).await);
        let limit = json!({"spec": {"limit": kind.limit}});
        let patched = api.patch(name, &PatchParams::default(), &Patch::Merge(&limit)).await;
        expect(run, Want::Denied, "carol", &format!("patch {short} {name}"), patched);
        if kind.status.is_some() {
            let what = format!("apply {short} {name} --subresource=status");
            expect(run, Want::Denied, "carol", &what, kind.write_status(carol, name).await);
        }
        let deleted = api.delete(name, &DeleteParams::default()).await;
        expect(run, Want::Denied, "carol", &format!("delete {short} {name}"), deleted);
        let path = format!("/apis/gpubudget.io/v1alpha1/{}", gpubudget_resource(kind.kind).plural);
        let (got, rows) = table(carol, &path).await;
        assert_eq!(got.join(" "), columns, "kubectl get {short} columns");
        run.info(&format!("columns: {}", got.join(" ")));
        let row = rows.iter().find(|r| r[0] == *name).unwrap_or_else(|| panic!("{name}'s row"));
        run.info(&format!("row: {}", row.join(" | ")));
    }

    /// The admin's creates of `specs`, each refused by the CRD's rules (422).
    async fn bad_specs(&self, specs: Vec<Value>) {
        let bad = format!("bad-{}", self.run.id);
        for spec in specs {
            let what = format!("create {} {bad} {spec}", self.kind.short);
            expect(&self.run, Want::Invalid, "admin", &what, self.kind.create(&self.run.admin, &bad, spec).await);
        }
    }
}

/// Tenants may not move their namespace out of a namespaceSelector.
async fn no_relabelling(run: &Run, who: &str, client: &Client, ns: &str) {
    let unlabel = json!({"metadata": {"labels": {"gpubudget.io/tier": null}}});
    let result =
        Api::<Namespace>::all(client.clone()).patch(ns, &PatchParams::default(), &Patch::Merge(&unlabel)).await;
    expect(run, Want::Denied, who, &format!("label namespace {ns} gpubudget.io/tier-"), result);
}

pub async fn cluster_budgets() {
    let kind = Kind { kind: "ClusterGpuMemoryBudget", short: "cgmb", limit: "64Gi", status: None };
    let spec = json!({"selector": {}, "limit": "8Gi", "request": "4Gi", "overLimitSeconds": 30});
    let story = Story::start("gpubudget-cgmb", kind, "tenants", spec).await;
    let (run, ns) = (&story.run, &story.ns);

    run.say("tenants: no write, no read of the cluster kind; no relabelling of their namespace");
    story.tenants_refused(json!({"selector": {}, "limit": "64Gi"})).await;
    let alice = run.as_user("alice").await;
    may(run, &alice, "alice", "get", "pods", Some(ns), true).await;
    may(run, &alice, "alice", "create", "gpumemorybudgets.gpubudget.io", Some(ns), false).await;

    run.say("carol, view cluster-wide: reads the cluster budget (the printer columns), writes nothing");
    story.viewer_reads("NAME REQUEST LIMIT ACTION MATCHED OVER CAPPED SHARE EVICTED AGE").await;

    run.say("the agent's ServiceAccount: list and watch cluster budgets and namespaces, nothing more");
    let (release, release_ns) = &story.release;
    let agent = run.as_user(&format!("system:serviceaccount:{release_ns}:{release}-agent")).await;
    let rule = story.kind.rule();
    for verb in ["list", "watch"] {
        may(run, &agent, "the agent", verb, &rule, None, true).await;
        may(run, &agent, "the agent", verb, "namespaces", None, true).await;
    }
    for verb in ["create", "update", "patch", "delete"] {
        may(run, &agent, "the agent", verb, &rule, None, false).await;
        may(run, &agent, "the agent", verb, "namespaces", None, false).await;
    }

    run.say("the CRD's rules refuse bad specs (the same CEL rules as GpuMemoryBudget, and namespaceSelector's)");
    story
        .bad_specs(vec![
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
        ])
        .await;
    run.say(&format!(
        "PASS: tenants (admin, edit of a namespace) cannot create, edit, delete or read a ClusterGpuMemoryBudget nor \
         relabel their namespace; a cluster-wide viewer reads it; the agent lists and watches; bad specs are refused \
         ({} s)",
        run.elapsed()
    ));
}

pub async fn quotas() {
    let status = json!({"namespacesOver": 0, "evictions": 0});
    let kind = Kind { kind: "ClusterGpuMemoryQuota", short: "cgmq", limit: "1Ti", status: Some(status) };
    let spec = json!({"limit": "64Gi", "overLimitSeconds": 60});
    let story = Story::start("gpubudget-cgmq", kind, "tenant-totals", spec).await;
    let (run, kind, ns, name) = (&story.run, &story.kind, &story.ns, &story.name);

    run.say("tenants: no write, no read of the quota or its status");
    story.tenants_refused(json!({"limit": "1Ti"})).await;

    run.say("carol, view cluster-wide: reads the quota (the printer columns), writes nothing");
    story.viewer_reads("NAME LIMIT ACTION NAMESPACES OVER EVICTED AGE").await;

    run.say("the operator's ServiceAccount: reads quotas, writes their status, evicts; never writes a quota's spec");
    let (release, release_ns) = &story.release;
    let operator = run.as_user(&format!("system:serviceaccount:{release_ns}:{release}-operator")).await;
    let (who, rule) = ("the operator", kind.rule());
    for verb in ["get", "list", "watch"] {
        may(run, &operator, who, verb, &rule, None, true).await;
    }
    may(run, &operator, who, "patch", &format!("{rule}/status"), None, true).await;
    may(run, &operator, who, "create", "pods/eviction", Some(ns), true).await;
    may(run, &operator, who, "delete", "pods", Some(ns), true).await;
    may(run, &operator, who, "list", "namespaces", None, true).await;
    may(run, &operator, who, "watch", "namespaces", None, true).await;
    for verb in ["create", "update", "patch", "delete"] {
        may(run, &operator, who, verb, &rule, None, false).await;
    }
    let what = format!("apply cgmq {name} --subresource=status");
    expect(run, Want::Ok, who, &what, kind.write_status(&operator, name).await);
    let limit = json!({"spec": {"limit": "1Ti"}});
    let patched = kind.api(&operator).patch(name, &PatchParams::default(), &Patch::Merge(&limit)).await;
    expect(run, Want::Denied, who, &format!("patch cgmq {name}"), patched);

    run.say("the CRD's rules refuse bad specs (the budgets' CEL rules and namespaceSelector's, shared)");
    story
        .bad_specs(vec![
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
        ])
        .await;
    let bad = format!("bad-{}", run.id);
    let spec = json!({"limit": "1Gi", "request": "1Gi"});
    let what = format!("create cgmq {bad} {spec}");
    expect(run, Want::Unknown, "admin", &what, kind.create(&run.admin, &bad, spec).await);
    let created = kind.api(&run.admin).get_opt(&bad).await.expect("read");
    assert!(created.is_none(), "a refused quota was stored: {:?}", created.map(|c| c.name_any()));
    run.say(&format!(
        "PASS: tenants (admin, edit of a namespace) cannot create, edit, delete or read a ClusterGpuMemoryQuota nor \
         write its status; a cluster-wide viewer reads it; the operator writes its status and evicts, never its spec; \
         bad specs are refused ({} s)",
        run.elapsed()
    ));
}
