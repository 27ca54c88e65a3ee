//! The fake served over HTTP to the real `kubectl`, and the discovery, Table and Event documents kubectl
//! reads. The tests that run kubectl print a message and pass where `kubectl` is not on PATH; `KUBECTL`
//! names another binary (`KUBECTL=kubectl.1.32`).

use std::path::PathBuf;
use std::process::Command;
use std::time::Duration;

use futures::{StreamExt, TryStreamExt};
use gpubudget_common::{ClusterGpuMemoryBudget, GpuMemoryBudget};
use gpubudget_testkit::{FakeApi, kubeconfig_yaml};
use k8s_openapi::api::core::v1::{Event as CoreEvent, Pod};
use k8s_openapi::api::events::v1::Event as NewEvent;
use kube::api::{Api, ListParams, PostParams, WatchEvent, WatchParams};
use kube::runtime::events::{Event, EventType, Recorder, Reporter};
use kube::{CustomResourceExt, Resource};
use serde_json::{Value, json};
use tokio::task::JoinHandle;

/// What `kubectl get` sends.
const TABLE: &str =
    "application/json;as=Table;v=v1;g=meta.k8s.io,application/json;as=Table;v=v1beta1;g=meta.k8s.io,application/json";

/// A fake with the GpuMemoryBudget CRD, a budget, a pod of it, and Events about both published through
/// kube's `Recorder` (`events.k8s.io/v1`), as the agent and the operator publish them.
async fn cluster() -> FakeApi {
    let fake = FakeApi::new();
    fake.put_object(serde_json::to_value(GpuMemoryBudget::crd()).unwrap()).unwrap();
    fake.put_object(json!({
        "apiVersion": "gpubudget.io/v1alpha1", "kind": "GpuMemoryBudget",
        "metadata": {"name": "llm", "namespace": "team-a"},
        "spec": {"selector": {"matchLabels": {"app": "llm"}}, "limit": "8Gi", "action": "Evict"},
        "status": {"matchedPods": 3, "podsOverBudget": 1, "evictions": 2},
    }))
    .unwrap();
    fake.put_object(json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": "llm-0", "namespace": "team-a", "labels": {"app": "llm"}},
        "spec": {"nodeName": "n1", "containers": [{"name": "main", "image": "vllm"}]},
        "status": {"phase": "Running", "podIP": "10.0.0.7",
                   "containerStatuses": [{"name": "main", "ready": true, "restartCount": 0, "state": {"running": {}}}]},
    }))
    .unwrap();
    let reporter = Reporter { controller: "gpubudget-agent".into(), instance: Some("n1".into()) };
    let recorder = Recorder::new(fake.client(), reporter);
    let event = |reason: &str, note: &str| Event {
        type_: EventType::Warning,
        reason: reason.into(),
        note: Some(note.into()),
        action: "Evict".into(),
        secondary: None,
    };
    let pod: Pod = fake.typed("team-a", "llm-0").unwrap();
    let budget: GpuMemoryBudget = fake.typed("team-a", "llm").unwrap();
    recorder.publish(&event("OverBudget", "llm-0 uses 9Gi of 8Gi"), &pod.object_ref(&())).await.unwrap();
    recorder.publish(&event("BudgetEvicted", "evicted llm-0 for 9Gi of 8Gi"), &budget.object_ref(&())).await.unwrap();
    fake
}

fn binary() -> String {
    std::env::var("KUBECTL").unwrap_or_else(|_| "kubectl".to_owned())
}

/// `kubectl` with a kubeconfig for the fake served on 127.0.0.1; `None` (after saying so) without kubectl.
struct Kubectl {
    dir: tempfile::TempDir,
    kubeconfig: PathBuf,
    server: JoinHandle<()>,
}

impl Kubectl {
    async fn start(fake: &FakeApi) -> Option<Kubectl> {
        if Command::new(binary()).args(["version", "--client"]).output().is_err() {
            eprintln!("SKIPPED: `{}` is not on PATH, so the fake is not checked against the real kubectl", binary());
            return None;
        }
        let (addr, server) = fake.serve("127.0.0.1:0").await.unwrap();
        let dir = tempfile::tempdir().unwrap();
        let kubeconfig = dir.path().join("kubeconfig");
        std::fs::write(&kubeconfig, kubeconfig_yaml(&format!("http://{addr}"))).unwrap();
        Some(Kubectl { dir, kubeconfig, server })
    }

    /// kubectl's stdout; panics with its stderr unless it succeeds without complaint (discovery
    /// trouble, for one, is logged to stderr). Allowed: "No resources found", and the warning that `ev`
    /// also names `events.events.k8s.io`, which kubectl prints against a real cluster too.
    async fn run(&self, args: &[&str]) -> String {
        let mut command = self.command(args);
        let output = tokio::task::spawn_blocking(move || command.output()).await.unwrap().unwrap();
        let stderr = String::from_utf8_lossy(&output.stderr);
        let quiet = stderr.lines().all(|l| {
            l.starts_with("No resources found")
                || l == r#"Warning: short name "ev" could also match lower priority resource events.events.k8s.io"#
        });
        assert!(output.status.success() && quiet, "kubectl {args:?}: {}\n{stderr}", output.status);
        String::from_utf8(output.stdout).unwrap()
    }

    fn command(&self, args: &[&str]) -> Command {
        let mut command = Command::new(binary());
        command.env("KUBECONFIG", &self.kubeconfig).arg("--cache-dir").arg(self.dir.path().join("cache")).args(args);
        command
    }
}

impl Drop for Kubectl {
    fn drop(&mut self) {
        self.server.abort();
    }
}

/// The words of each line.
fn words(text: &str) -> Vec<Vec<&str>> {
    text.lines().map(|l| l.split_whitespace().collect()).collect()
}

/// The gmb CRD's printer column names, as kubectl prints them in the header (priority 0 only: the others
/// need `-o wide`).
fn printer_columns() -> Vec<String> {
    let crd = serde_json::to_value(GpuMemoryBudget::crd()).unwrap();
    let columns = crd["spec"]["versions"][0]["additionalPrinterColumns"].as_array().unwrap().clone();
    columns
        .iter()
        .filter(|c| c["priority"].as_i64().unwrap_or(0) == 0)
        .map(|c| c["name"].as_str().unwrap().to_uppercase())
        .collect()
}

#[tokio::test]
async fn kubectl_gets_budgets_with_printer_columns_and_pods() {
    let fake = cluster().await;
    let Some(kubectl) = Kubectl::start(&fake).await else { return };
    let mut header = vec!["NAME".to_owned()];
    header.extend(printer_columns());
    assert_eq!(header[1..9], ["REQUEST", "LIMIT", "ACTION", "MATCHED", "OVER", "CAPPED", "SHARE", "EVICTED"]);

    let out = kubectl.run(&["get", "gmb", "-n", "team-a"]).await;
    println!("$ kubectl get gmb -n team-a\n{out}");
    let lines = words(&out);
    assert_eq!(lines[0], header);
    // No request set, no admissionCaps: kubectl leaves the REQUEST and CAPPED cells empty (the API's are null).
    assert_eq!(lines[1][..6], ["llm", "8Gi", "Evict", "3", "1", "2"]);
    assert!(lines[1][6].ends_with('s'), "an age in seconds: {out}");
    assert_eq!(lines.len(), 2);

    let out = kubectl.run(&["get", "gmb", "-A"]).await;
    println!("$ kubectl get gmb -A\n{out}");
    let lines = words(&out);
    assert_eq!(lines[0][..2], ["NAMESPACE", "NAME"]);
    assert_eq!(lines[1][..7], ["team-a", "llm", "8Gi", "Evict", "3", "1", "2"]);

    let yaml: Value = serde_yaml::from_str(&kubectl.run(&["get", "gmb", "-n", "team-a", "-o", "yaml"]).await).unwrap();
    assert_eq!(yaml["items"][0]["spec"]["limit"], "8Gi");
    assert_eq!(yaml["items"][0]["status"]["evictions"], 2);
    let one: Value =
        serde_yaml::from_str(&kubectl.run(&["get", "gpumemorybudget", "llm", "-n", "team-a", "-o", "yaml"]).await)
            .unwrap();
    assert_eq!(one["metadata"]["name"], "llm");

    let out = kubectl.run(&["get", "pods", "-n", "team-a", "-o", "wide"]).await;
    println!("$ kubectl get pods -n team-a -o wide\n{out}");
    let lines = words(&out);
    assert_eq!(lines[0], ["NAME", "READY", "STATUS", "RESTARTS", "AGE", "IP", "NODE"]);
    assert_eq!([&lines[1][..4], &lines[1][5..]].concat(), ["llm-0", "1/1", "Running", "0", "10.0.0.7", "n1"]);
    assert_eq!(words(&kubectl.run(&["get", "po", "-A"]).await)[1][..2], ["team-a", "llm-0"]);
    assert!(kubectl.run(&["get", "pods"]).await.is_empty(), "no pods in default (the message goes to stderr)");
}

/// #23: `kubectl get cgmb` (cluster-scoped: no NAMESPACE column, even with `-A`) prints the gmb columns.
#[tokio::test]
async fn kubectl_gets_cluster_budgets_with_the_same_columns() {
    let fake = cluster().await;
    fake.put_object(serde_json::to_value(ClusterGpuMemoryBudget::crd()).unwrap()).unwrap();
    fake.put_object(json!({
        "apiVersion": "gpubudget.io/v1alpha1", "kind": "ClusterGpuMemoryBudget",
        "metadata": {"name": "tenants"},
        "spec": {"namespaceSelector": {"matchLabels": {"tier": "tenant"}}, "selector": {}, "limit": "16Gi",
                 "request": "4Gi", "action": "Evict"},
        "status": {"matchedPods": 7, "podsOverBudget": 2, "evictions": 5},
    }))
    .unwrap();
    let Some(kubectl) = Kubectl::start(&fake).await else { return };
    let mut header = vec!["NAME".to_owned()];
    header.extend(printer_columns());
    for args in [&["get", "cgmb"][..], &["get", "clustergpumemorybudgets", "-A"]] {
        let out = kubectl.run(args).await;
        println!("$ kubectl {}\n{out}", args.join(" "));
        let lines = words(&out);
        assert_eq!(lines[0], header, "the gmb columns");
        assert_eq!(lines[1][..7], ["tenants", "4Gi", "16Gi", "Evict", "7", "2", "5"]);
        assert_eq!(lines.len(), 2);
    }
    let all: Value = serde_yaml::from_str(&kubectl.run(&["get", "cgmb", "-o", "yaml"]).await).unwrap();
    assert_eq!(all["items"][0]["spec"]["namespaceSelector"]["matchLabels"]["tier"], "tenant");
}

#[tokio::test]
async fn kubectl_gets_events_by_field_and_describes() {
    let fake = cluster().await;
    let Some(kubectl) = Kubectl::start(&fake).await else { return };

    let out = kubectl.run(&["get", "events", "-A"]).await;
    println!("$ kubectl get events -A\n{out}");
    let lines = words(&out);
    assert_eq!(lines[0], ["NAMESPACE", "LAST", "SEEN", "TYPE", "REASON", "OBJECT", "MESSAGE"]);
    assert_eq!(lines.len(), 3, "{out}");
    assert!(lines.iter().any(|l| l[2..5] == ["Warning", "OverBudget", "pod/llm-0"]), "{out}");
    assert!(lines.iter().any(|l| l[2..5] == ["Warning", "BudgetEvicted", "gpumemorybudget/llm"]), "{out}");

    let out = kubectl.run(&["get", "events", "-n", "team-a", "--field-selector", "involvedObject.kind=Pod"]).await;
    println!("$ kubectl get events -n team-a --field-selector involvedObject.kind=Pod\n{out}");
    assert!(out.contains("OverBudget") && out.contains("llm-0 uses 9Gi of 8Gi"), "{out}");
    assert!(!out.contains("BudgetEvicted"), "{out}");
    let out = kubectl.run(&["get", "ev", "-A", "--field-selector", "involvedObject.kind=GpuMemoryBudget"]).await;
    assert!(out.contains("BudgetEvicted") && !out.contains("OverBudget"), "{out}");

    let out = kubectl.run(&["describe", "gmb", "llm", "-n", "team-a"]).await;
    println!("$ kubectl describe gmb llm -n team-a\n{out}");
    assert_eq!(words(&out)[0], ["Name:", "llm"]);
    assert!(out.contains("Limit:") && out.contains("8Gi"), "{out}");
    let events = out.split_once("\nEvents:").expect("an Events section").1;
    assert!(events.contains("BudgetEvicted") && events.contains("evicted llm-0 for 9Gi of 8Gi"), "{out}");
    assert!(events.contains("gpubudget-agent"), "the reporting controller as the source: {out}");
    assert!(!events.contains("OverBudget"), "{out}");

    let out = kubectl.run(&["describe", "pod", "llm-0", "-n", "team-a"]).await;
    println!("$ kubectl describe pod llm-0 -n team-a\n{out}");
    assert!(out.contains("Node:") && out.contains("n1"), "{out}");
    let events = out.split_once("\nEvents:").expect("an Events section").1;
    assert!(events.contains("OverBudget") && !events.contains("BudgetEvicted"), "{out}");
}

#[tokio::test]
async fn kubectl_watches_events() {
    let fake = cluster().await;
    let Some(kubectl) = Kubectl::start(&fake).await else { return };
    let mut watch = kubectl.command(&["get", "events", "-A", "--field-selector", "involvedObject.kind=Pod", "-w"]);
    let mut child = KillOnDrop(watch.stdout(std::process::Stdio::piped()).spawn().unwrap());
    let stdout = std::io::BufReader::new(child.0.stdout.take().unwrap());
    let (tx, mut lines) = tokio::sync::mpsc::unbounded_channel();
    tokio::task::spawn_blocking(move || {
        use std::io::BufRead;
        stdout.lines().map_while(Result::ok).try_for_each(|l| tx.send(l))
    });
    let mut next = async || tokio::time::timeout(Duration::from_secs(20), lines.recv()).await.ok().flatten();
    let header = next().await.expect("the header");
    assert!(header.starts_with("NAMESPACE") && header.contains("REASON"), "{header}");
    assert!(next().await.expect("the first event").contains("OverBudget"));

    let pod: Pod = fake.typed("team-a", "llm-0").unwrap();
    let recorder = Recorder::new(fake.client(), Reporter { controller: "gpubudget-agent".into(), instance: None });
    let event = Event {
        type_: EventType::Warning,
        reason: "Evicting".into(),
        note: Some("now".into()),
        action: "Evict".into(),
        secondary: None,
    };
    recorder.publish(&event, &pod.object_ref(&())).await.unwrap();
    let line = next().await.expect("the new event");
    println!("$ kubectl get events -A --field-selector involvedObject.kind=Pod -w\n{header}\n...\n{line}");
    assert!(line.contains("Evicting") && line.contains("pod/llm-0"), "{line}");
}

/// A child process that is killed when the test ends, passed or not.
struct KillOnDrop(std::process::Child);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        _ = self.0.kill();
        _ = self.0.wait();
    }
}

#[tokio::test]
async fn served_over_http_to_a_kube_client() {
    let fake = cluster().await;
    let (addr, server) = fake.serve("127.0.0.1:0").await.unwrap();
    let kubeconfig = kube::config::Kubeconfig::from_yaml(&kubeconfig_yaml(&format!("http://{addr}"))).unwrap();
    assert_eq!(kubeconfig.current_context.as_deref(), Some("gpubudget-demo"));
    let config = kube::Config::from_custom_kubeconfig(kubeconfig, &Default::default()).await.unwrap();
    let client = kube::Client::try_from(config).unwrap();
    let pods: Api<Pod> = Api::namespaced(client.clone(), "team-a");
    assert_eq!(pods.get("llm-0").await.unwrap().spec.unwrap().node_name.as_deref(), Some("n1"));
    let mut watch = pods.watch(&WatchParams::default(), "0").await.unwrap().boxed();
    assert!(
        matches!(watch.try_next().await.unwrap(), Some(WatchEvent::Added(p)) if p.metadata.name.as_deref() == Some("llm-0"))
    );
    let discovery = kube::Discovery::new(client).run().await.unwrap();
    let gvk = kube::api::GroupVersionKind::gvk("gpubudget.io", "v1alpha1", "GpuMemoryBudget");
    let (resource, caps) = discovery.resolve_gvk(&gvk).expect("the CRD's kind is discovered");
    assert_eq!((resource.plural.as_str(), caps.scope), ("gpumemorybudgets", kube::discovery::Scope::Namespaced));
    server.abort();
    assert!(server.await.unwrap_err().is_cancelled());
    assert!(pods.get("llm-0").await.is_err(), "the server is gone");
}

async fn get(fake: &FakeApi, path: &str, accept: Option<&str>) -> Value {
    let mut request = http::Request::get(path);
    if let Some(accept) = accept {
        request = request.header(http::header::ACCEPT, accept);
    }
    fake.client().request(request.body(Vec::new()).unwrap()).await.unwrap()
}

fn find<'a>(list: &'a Value, name: &str) -> &'a Value {
    let resources = list["resources"].as_array().unwrap();
    resources.iter().find(|r| r["name"] == name).unwrap_or_else(|| panic!("no {name} in {list}"))
}

#[tokio::test]
async fn discovery_lists_built_in_resources_and_every_stored_crd() {
    let fake = cluster().await;
    fake.put_object(json!({
        "apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition",
        "metadata": {"name": "widgets.example.com"},
        "spec": {"group": "example.com", "scope": "Cluster",
                 "names": {"plural": "widgets", "singular": "widget", "kind": "Widget", "shortNames": ["wd"]},
                 "versions": [{"name": "v1beta1", "served": true, "storage": false},
                              {"name": "v1", "served": true, "storage": true, "subresources": {"status": {}}},
                              {"name": "v0", "served": false, "storage": false}]},
    }))
    .unwrap();
    assert_eq!(get(&fake, "/version", None).await["major"], "1");
    assert_eq!(get(&fake, "/api", None).await["versions"], json!(["v1"]));

    let core = get(&fake, "/api/v1", None).await;
    assert_eq!((core["kind"].as_str(), core["groupVersion"].as_str()), (Some("APIResourceList"), Some("v1")));
    let pods = find(&core, "pods");
    assert_eq!((pods["kind"].as_str(), pods["namespaced"].as_bool()), (Some("Pod"), Some(true)));
    assert_eq!(pods["shortNames"], json!(["po"]));
    assert!(pods["verbs"].as_array().unwrap().contains(&json!("watch")));
    assert_eq!(find(&core, "pods/status")["verbs"], json!(["get", "patch", "update"]));
    assert_eq!(find(&core, "pods/eviction")["kind"], "Eviction");
    assert_eq!(find(&core, "events")["shortNames"], json!(["ev"]));
    assert_eq!(
        (find(&core, "nodes")["namespaced"].as_bool(), &find(&core, "nodes")["shortNames"]),
        (Some(false), &json!(["no"]))
    );
    assert_eq!(find(&core, "namespaces")["shortNames"], json!(["ns"]));

    let groups = get(&fake, "/apis", None).await;
    assert_eq!(groups["kind"], "APIGroupList");
    let group = |name: &str| groups["groups"].as_array().unwrap().iter().find(|g| g["name"] == name).cloned();
    for name in ["events.k8s.io", "coordination.k8s.io", "policy", "apiextensions.k8s.io", "gpubudget.io"] {
        assert!(group(name).is_some(), "{name} in {groups}");
    }
    let widgets = group("example.com").unwrap();
    assert_eq!(widgets["preferredVersion"], json!({"groupVersion": "example.com/v1", "version": "v1"}));
    assert_eq!(widgets["versions"].as_array().unwrap().len(), 2, "v0 is not served");

    let gmb = get(&fake, "/apis/gpubudget.io/v1alpha1", None).await;
    let budgets = find(&gmb, "gpumemorybudgets");
    assert_eq!((budgets["kind"].as_str(), budgets["namespaced"].as_bool()), (Some("GpuMemoryBudget"), Some(true)));
    assert_eq!((&budgets["shortNames"], &budgets["categories"]), (&json!(["gmb"]), &json!(["gpubudget"])));
    find(&gmb, "gpumemorybudgets/status");
    let v1 = get(&fake, "/apis/example.com/v1", None).await;
    assert_eq!(
        (find(&v1, "widgets")["namespaced"].as_bool(), &find(&v1, "widgets")["shortNames"]),
        (Some(false), &json!(["wd"]))
    );
    find(&v1, "widgets/status");
    assert!(get(&fake, "/apis/example.com/v1beta1", None).await["resources"].as_array().unwrap().len() == 1);
    for missing in ["/apis/example.com/v0", "/apis/nope.io/v1", "/openapi/v2"] {
        let request = http::Request::get(missing).body(Vec::new()).unwrap();
        match fake.client().request::<Value>(request).await {
            Err(kube::Error::Api(status)) => assert_eq!(status.code, 404),
            other => panic!("{missing}: {other:?}"),
        }
    }
    assert_eq!(find(&get(&fake, "/apis/events.k8s.io/v1", None).await, "events")["kind"], "Event");
}

#[tokio::test]
async fn tables_for_custom_resources_pods_events_and_the_rest() {
    let fake = cluster().await;
    let table = get(&fake, "/apis/gpubudget.io/v1alpha1/namespaces/team-a/gpumemorybudgets", Some(TABLE)).await;
    assert_eq!((table["kind"].as_str(), table["apiVersion"].as_str()), (Some("Table"), Some("meta.k8s.io/v1")));
    let names: Vec<&str> =
        table["columnDefinitions"].as_array().unwrap().iter().map(|c| c["name"].as_str().unwrap()).collect();
    assert_eq!(
        names,
        [
            "Name",
            "Request",
            "Limit",
            "Action",
            "Enforcement",
            "Matched",
            "Over",
            "Capped",
            "Uncapped",
            "Share",
            "Evicted",
            "Age"
        ]
    );
    assert_eq!(table["columnDefinitions"][0]["format"], "name");
    // #54: shown with -o wide only.
    assert_eq!(table["columnDefinitions"][4]["priority"], 1);
    assert_eq!(table["columnDefinitions"][5]["type"], "integer");
    let row = &table["rows"][0];
    assert_eq!(
        row["cells"].as_array().unwrap()[..11],
        [
            json!("llm"),
            json!(null),
            json!("8Gi"),
            json!("Evict"),
            json!(null),
            json!(3),
            json!(1),
            json!(null),
            json!(null),
            json!(null),
            json!(2)
        ]
    );
    assert!(row["cells"][11].as_str().unwrap().ends_with('s'));
    assert_eq!(row["object"]["kind"], "PartialObjectMetadata");
    assert_eq!(row["object"]["metadata"]["namespace"], "team-a");
    assert!(row["object"].get("spec").is_none());

    let one = get(
        &fake,
        "/apis/gpubudget.io/v1alpha1/namespaces/team-a/gpumemorybudgets/llm?includeObject=Object",
        Some(TABLE),
    )
    .await;
    assert_eq!(one["rows"].as_array().unwrap().len(), 1);
    assert_eq!(one["rows"][0]["object"]["spec"]["limit"], "8Gi");
    let plain = get(&fake, "/apis/gpubudget.io/v1alpha1/namespaces/team-a/gpumemorybudgets/llm", None).await;
    assert_eq!(plain["kind"], "GpuMemoryBudget", "JSON unless a Table is asked for");

    let pods = get(&fake, "/api/v1/pods", Some(TABLE)).await;
    let cells = pods["rows"][0]["cells"].as_array().unwrap();
    assert_eq!(cells[..4], [json!("llm-0"), json!("1/1"), json!("Running"), json!(0)]);

    let events =
        get(&fake, "/api/v1/namespaces/team-a/events?fieldSelector=involvedObject.kind%3DPod", Some(TABLE)).await;
    assert_eq!(events["rows"].as_array().unwrap().len(), 1);
    let cells = events["rows"][0]["cells"].as_array().unwrap();
    assert_eq!(
        cells[1..7],
        [
            json!("Warning"),
            json!("OverBudget"),
            json!("pod/llm-0"),
            json!(""),
            json!("gpubudget-agent, n1"),
            json!("llm-0 uses 9Gi of 8Gi")
        ]
    );

    fake.put_object(json!({"apiVersion": "coordination.k8s.io/v1", "kind": "Lease", "metadata": {"name": "leader", "namespace": "gpubudget"}})).unwrap();
    let leases = get(&fake, "/apis/coordination.k8s.io/v1/leases", Some(TABLE)).await;
    let names: Vec<&str> =
        leases["columnDefinitions"].as_array().unwrap().iter().map(|c| c["name"].as_str().unwrap()).collect();
    assert_eq!(names, ["Name", "Age"]);
    assert_eq!(leases["rows"][0]["cells"][0], "leader");
}

#[tokio::test]
async fn both_events_apis_serve_one_storage() {
    let fake = cluster().await;
    let core: Api<CoreEvent> = Api::all(fake.client());
    let about_pods = core.list(&ListParams::default().fields("involvedObject.kind=Pod")).await.unwrap();
    assert_eq!(about_pods.items.len(), 1);
    let e = &about_pods.items[0];
    assert_eq!((e.reason.as_deref(), e.message.as_deref()), (Some("OverBudget"), Some("llm-0 uses 9Gi of 8Gi")));
    assert_eq!(
        (e.reporting_component.as_deref(), e.reporting_instance.as_deref()),
        (Some("gpubudget-agent"), Some("n1"))
    );
    assert_eq!(e.involved_object.name.as_deref(), Some("llm-0"));
    let uid = fake.get("pods", "team-a", "llm-0").unwrap()["metadata"]["uid"].as_str().unwrap().to_owned();
    let selector = format!("involvedObject.name=llm-0,involvedObject.namespace=team-a,involvedObject.uid={uid}");
    assert_eq!(core.list(&ListParams::default().fields(&selector)).await.unwrap().items.len(), 1);
    let in_team: Api<CoreEvent> = Api::namespaced(fake.client(), "team-a");
    let name = e.metadata.name.clone().unwrap();
    assert_eq!(in_team.get(&name).await.unwrap().involved_object.kind.as_deref(), Some("Pod"));
    assert_eq!(fake.list("events", None).len(), 0, "the store keeps them where they were written");

    // And the other way: a core Event through events.k8s.io.
    let legacy: CoreEvent = serde_json::from_value(json!({
        "metadata": {"name": "kubelet-1"}, "involvedObject": {"kind": "Pod", "name": "llm-0", "namespace": "team-a"},
        "reason": "Killing", "message": "Stopping container main", "type": "Normal", "count": 1,
        "source": {"component": "kubelet", "host": "n1"},
    }))
    .unwrap();
    let mut watch =
        in_team.watch(&WatchParams::default().fields("involvedObject.kind=Pod"), "0").await.unwrap().boxed();
    assert!(
        matches!(watch.try_next().await.unwrap(), Some(WatchEvent::Added(e)) if e.reason.as_deref() == Some("OverBudget"))
    );
    in_team.create(&PostParams::default(), &legacy).await.unwrap();
    assert!(
        matches!(watch.try_next().await.unwrap(), Some(WatchEvent::Added(e)) if e.reason.as_deref() == Some("Killing"))
    );
    let new: Api<NewEvent> = Api::namespaced(fake.client(), "team-a");
    let killing = new.get("kubelet-1").await.unwrap();
    assert_eq!(
        (killing.note.as_deref(), killing.regarding.unwrap().name.as_deref()),
        (Some("Stopping container main"), Some("llm-0"))
    );
    assert_eq!(killing.deprecated_source.unwrap().component.as_deref(), Some("kubelet"));
    assert_eq!(new.list(&ListParams::default()).await.unwrap().items.len(), 3);

    // A recorder event published while a core watch is open arrives converted.
    let pod: Pod = fake.typed("team-a", "llm-0").unwrap();
    let recorder = Recorder::new(fake.client(), Reporter { controller: "gpubudget-operator".into(), instance: None });
    let event = Event {
        type_: EventType::Normal,
        reason: "Matched".into(),
        note: None,
        action: "Match".into(),
        secondary: None,
    };
    recorder.publish(&event, &pod.object_ref(&())).await.unwrap();
    assert!(
        matches!(watch.try_next().await.unwrap(), Some(WatchEvent::Added(e)) if e.reason.as_deref() == Some("Matched") && e.reporting_component.as_deref() == Some("gpubudget-operator"))
    );
}

#[tokio::test]
async fn table_watches_send_one_row_tables() {
    let fake = cluster().await;
    let request = http::Request::get("/api/v1/namespaces/team-a/events?watch=true&resourceVersion=0")
        .header(http::header::ACCEPT, TABLE)
        .body(Vec::new())
        .unwrap();
    let mut events = fake.client().request_events::<Value>(request).await.unwrap().boxed();
    for _ in 0..2 {
        let Some(WatchEvent::Added(table)) = events.try_next().await.unwrap() else { panic!("not ADDED") };
        assert_eq!(table["kind"], "Table");
        assert_eq!(table["rows"].as_array().unwrap().len(), 1);
        assert_eq!(
            table["rows"][0]["cells"].as_array().unwrap().len(),
            table["columnDefinitions"].as_array().unwrap().len()
        );
    }
}
