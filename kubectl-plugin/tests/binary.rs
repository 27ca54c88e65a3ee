//! The real `kubectl-gpubudget` binary against the in-memory API (gpubudget-testkit, a fake, not a cluster)
//! served over HTTP with a kubeconfig, as kubectl would run it: pods with the agent's records, overlapping
//! budgets, the agent's events published through kube's `Recorder` (`events.k8s.io/v1`, as the agent does),
//! a pod that was evicted and is gone, RBAC refusals.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use gpubudget_common::GpuMemoryBudget;
use gpubudget_common::pod_record::PodRecord;
use gpubudget_common::{BudgetState, crd::EvictionRecord};
use gpubudget_testkit::{FakeApi, Verb, kubeconfig_yaml};
use k8s_openapi::api::core::v1::ObjectReference;
use kube::CustomResourceExt;
use kube::runtime::events::{Event, EventType, Recorder, Reporter};
use serde_json::{Value, json};

fn pod(ns: &str, name: &str, uid: &str, labels: Value, record: Option<PodRecord>) -> Value {
    let annotations = record.map(|r| r.to_annotations()).unwrap_or_default();
    json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": ns, "uid": uid, "labels": labels, "annotations": annotations},
        "spec": {"nodeName": "n1", "containers": [{"name": "server", "image": "vllm",
                 "resources": {"limits": {"nvidia.com/gpu": "1"}},
                 "env": [{"name": "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT", "value": "0=8G"}]}]},
        "status": {"phase": "Running"},
    })
}

fn record(state: BudgetState, usage: u64, budget: &str, node: &str) -> Option<PodRecord> {
    Some(PodRecord {
        state,
        usage_bytes: usage,
        budget: budget.into(),
        node: node.into(),
        eviction_requested_at: None,
        cap_not_in_force: None,
        share: None,
        runtime_caps: None,
    })
}

fn budget(ns: &str, name: &str, limit: &str, selector: Value, status: Value) -> Value {
    json!({
        "apiVersion": "gpubudget.io/v1alpha1", "kind": "GpuMemoryBudget",
        "metadata": {"name": name, "namespace": ns},
        "spec": {"selector": selector, "limit": limit}, "status": status,
    })
}

fn pod_ref(ns: &str, name: &str, uid: &str) -> ObjectReference {
    ObjectReference {
        api_version: Some("v1".into()),
        kind: Some("Pod".into()),
        name: Some(name.into()),
        namespace: Some(ns.into()),
        uid: Some(uid.into()),
        ..ObjectReference::default()
    }
}

/// team-a: llm-0 over its 8Gi budget (also matched by the 20Gi namespace default), finetune-0 near, web
/// without a record; llm-old evicted and gone. team-b: one pod.
async fn cluster() -> FakeApi {
    let fake = FakeApi::new();
    // The CRD of a newer gpubudget, with a spec field this plugin does not know (the API server prunes fields
    // its schema lacks, as the fake does).
    let mut crd = serde_json::to_value(GpuMemoryBudget::crd()).unwrap();
    crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]["request"] =
        json!({"type": "string"});
    fake.put_object(crd).unwrap();
    let mut llm = budget("team-a", "llm-inference", "8Gi", json!({"matchLabels": {"app": "llm"}}), json!({}));
    // A spec field newer than this plugin (issue 22's request, the CRD upgraded first).
    llm["spec"]["request"] = json!("6Gi");
    let last = EvictionRecord {
        pod: "llm-old".into(),
        node: Some("n2".into()),
        time: "2026-11-24T09:00:00Z".into(),
        usage: "9.5Gi".into(),
    };
    llm["status"] = json!({"evictions": 1, "lastEviction": last});
    for object in [
        llm,
        budget("team-a", "team-default", "20Gi", json!({}), json!({})),
        budget("team-b", "b-default", "4Gi", json!({}), json!({})),
        // Newer than this plugin: an action it does not know makes the budget unreadable, not the list.
        json!({"apiVersion": "gpubudget.io/v1alpha1", "kind": "GpuMemoryBudget", "metadata": {"name": "odd", "namespace": "team-b"},
               "spec": {"selector": {}, "limit": "1Gi", "action": "Throttle"}}),
        pod(
            "team-a",
            "llm-0",
            "uid-llm-0",
            json!({"app": "llm"}),
            record(BudgetState::Over, 9 << 30, "llm-inference", "n1"),
        ),
        pod(
            "team-a",
            "finetune-0",
            "uid-ft",
            json!({"app": "ft"}),
            record(BudgetState::Near, 19 << 30, "team-default", "n2"),
        ),
        pod("team-a", "web", "uid-web", json!({"app": "web"}), None),
        pod("team-b", "b-0", "uid-b", json!({"app": "b"}), record(BudgetState::Within, 1 << 30, "b-default", "n1")),
    ] {
        fake.put_object(object).unwrap();
    }
    let recorder =
        Recorder::new(fake.client(), Reporter { controller: "gpubudget-agent".into(), instance: Some("n1".into()) });
    let warn = |reason: &str, note: &str| Event {
        type_: EventType::Warning,
        reason: reason.into(),
        note: Some(note.into()),
        action: "Measure".into(),
        secondary: None,
    };
    // The fake gives each pod its own UID, as the API server does.
    let live = fake.get("pods", "team-a", "llm-0").unwrap()["metadata"]["uid"].as_str().unwrap().to_owned();
    for (r, name, uid, reason, note) in [
        (
            &recorder,
            "llm-0",
            live.as_str(),
            "GpuMemoryOverBudget",
            "using 9Gi of 8Gi (budget team-a/llm-inference); evicting if it stays over for 10s",
        ),
        (
            &recorder,
            "llm-old",
            "uid-old",
            "GpuMemoryOverBudget",
            "using 9.5Gi of 8Gi (budget team-a/llm-inference); evicting if it stays over for 10s",
        ),
        (
            &recorder,
            "llm-old",
            "uid-old",
            "EvictingForGpuMemory",
            "using 9.5Gi of 8Gi (budget team-a/llm-inference) for 10s; evicting with 30s grace",
        ),
    ] {
        r.publish(&warn(reason, note), &pod_ref("team-a", name, uid)).await.unwrap();
    }
    fake
}

struct Served {
    _dir: tempfile::TempDir,
    kubeconfig: PathBuf,
    server: tokio::task::JoinHandle<()>,
}

impl Drop for Served {
    fn drop(&mut self) {
        self.server.abort();
    }
}

/// Serves the fake and writes a kubeconfig whose context's namespace is `namespace`.
async fn serve(fake: &FakeApi, namespace: &str) -> Served {
    let (addr, server) = fake.serve("127.0.0.1:0").await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let kubeconfig = dir.path().join("kubeconfig");
    let yaml =
        kubeconfig_yaml(&format!("http://{addr}")).replace("namespace: default", &format!("namespace: {namespace}"));
    std::fs::write(&kubeconfig, yaml).unwrap();
    Served { _dir: dir, kubeconfig, server }
}

async fn run(kubeconfig: Option<&Path>, args: &[&str]) -> Output {
    let mut command = Command::new(env!("CARGO_BIN_EXE_kubectl-gpubudget"));
    command.env_remove("KUBECONFIG").env("HOME", "/nonexistent").args(args);
    if let Some(k) = kubeconfig {
        command.env("KUBECONFIG", k);
    }
    tokio::task::spawn_blocking(move || command.output()).await.unwrap().unwrap()
}

/// stdout of a run that must succeed.
async fn ok(kubeconfig: &Path, args: &[&str]) -> String {
    let out = run(Some(kubeconfig), args).await;
    let (stdout, stderr) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "kubectl-gpubudget {args:?}: {}\n{stdout}\n{stderr}", out.status);
    println!("$ kubectl gpubudget {}\n{stdout}{stderr}", args.join(" "));
    stdout.into_owned()
}

/// stderr of a run that must fail.
async fn fails(kubeconfig: &Path, args: &[&str]) -> String {
    let out = run(Some(kubeconfig), args).await;
    assert!(!out.status.success(), "kubectl-gpubudget {args:?} should fail");
    String::from_utf8_lossy(&out.stderr).into_owned()
}

fn words(text: &str) -> Vec<Vec<&str>> {
    text.lines().map(|l| l.split_whitespace().collect()).collect()
}

#[tokio::test]
async fn top_lists_recorded_pods_sorted_in_a_namespace_and_across() {
    let fake = cluster().await;
    let s = serve(&fake, "team-a").await;
    let out = ok(&s.kubeconfig, &["top"]).await;
    let lines = words(&out);
    assert_eq!(lines[0], ["POD", "NODE", "USAGE", "LIMIT", "%", "STATE", "BUDGET"]);
    assert_eq!(lines[1], ["finetune-0", "n2", "19Gi", "20Gi", "95%", "Near", "team-default"]);
    assert_eq!(lines[2], ["llm-0", "n1", "9Gi", "8Gi", "113%", "Over", "llm-inference"]);
    assert_eq!(lines.len(), 3, "web has no record: {out}");

    let out = ok(&s.kubeconfig, &["top", "--sort-by", "percent"]).await;
    assert_eq!(words(&out)[1][0], "llm-0");
    let out = ok(&s.kubeconfig, &["top", "-l", "app=llm"]).await;
    assert_eq!(words(&out).len(), 2);
    let out = ok(&s.kubeconfig, &["top", "-A", "--sort-by", "name"]).await;
    let names: Vec<(&str, &str)> = words(&out)[1..].iter().map(|l| (l[0], l[1])).collect();
    assert_eq!(names, [("team-a", "finetune-0"), ("team-a", "llm-0"), ("team-b", "b-0")]);
    let out = run(Some(&s.kubeconfig), &["top", "-n", "team-b"]).await;
    assert!(out.status.success());
    assert_eq!(words(&String::from_utf8_lossy(&out.stdout))[1][..5], ["b-0", "n1", "1Gi", "4Gi", "25%"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.starts_with("warning: budget team-b/odd cannot be read by this plugin: unknown variant `Throttle`"),
        "{stderr}"
    );

    let json: Value = serde_json::from_str(&ok(&s.kubeconfig, &["top", "-o", "json"]).await).unwrap();
    assert_eq!(
        (json["apiVersion"].as_str(), json["kind"].as_str()),
        (Some("kubectl-gpubudget.gpubudget.io/v1"), Some("GpuMemoryTop"))
    );
    assert_eq!(json["pods"][0]["usageBytes"], 19u64 << 30);
    assert_eq!(json["pods"][1]["percent"], 112.5);
    let yaml: Value = serde_yaml::from_str(&ok(&s.kubeconfig, &["-o", "yaml", "top", "-A"]).await).unwrap();
    assert_eq!(yaml["pods"].as_array().map(Vec::len), Some(3));
}

#[tokio::test]
async fn why_answers_for_a_live_pod_and_for_an_evicted_one_that_is_gone() {
    let fake = cluster().await;
    let s = serve(&fake, "default").await;
    let out = ok(&s.kubeconfig, &["why", "llm-0", "-n", "team-a"]).await;
    assert!(out.contains("2 budgets in team-a select this pod: llm-inference (8Gi), team-default (20Gi)"), "{out}");
    assert!(out.contains("Over: using 9Gi of 8Gi (112.5%)"), "{out}");
    assert!(out.contains("Over for:"), "from the OverBudget event: {out}");
    assert!(
        out.contains("llm-inference (limit 8Gi, request 6Gi, action Evict, warnAtPercent 90"),
        "a newer spec field: {out}"
    );
    assert!(out.contains("evicted at 20"), "when: {out}");
    assert!(out.contains("the driver caps each MPS client process at 8Gi on device 0"), "{out}");
    assert!(out.contains("GpuMemoryOverBudget") && out.contains("gpubudget-agent"), "{out}");

    let json: Value =
        serde_json::from_str(&ok(&s.kubeconfig, &["why", "pod/llm-0", "-n", "team-a", "-o", "json"]).await).unwrap();
    assert_eq!(json["kind"], "GpuMemoryWhy");
    assert_eq!(json["budget"]["spec"]["limit"], "8Gi");
    assert_eq!(json["matched"][1]["name"], "team-default");
    assert_eq!(json["next"]["action"], "Evict");
    assert_eq!(json["admission"]["caps"][0]["bytes"], 8u64 << 30);

    // The tenant's question: the pod is gone; its events and the budget's status answer it.
    let out = ok(&s.kubeconfig, &["why", "llm-old", "-n", "team-a"]).await;
    assert!(out.contains("gone: answered from its events"), "{out}");
    assert!(out.contains("budget llm-inference evicted it"), "{out}");
    assert!(out.contains("evicted at 2026-11-24T09:00:00Z using 9.5Gi on n2"), "{out}");
    assert!(out.contains("EvictingForGpuMemory"), "{out}");

    let err = fails(&s.kubeconfig, &["why", "nope", "-n", "team-a"]).await;
    assert!(err.starts_with("error: pod nope not found in namespace team-a"), "{err}");
}

#[tokio::test]
async fn rbac_refusals_name_the_verb_and_the_resource() {
    let fake = cluster().await;
    let s = serve(&fake, "team-a").await;
    fake.fail_next(Verb::List, "pods", 1, 403);
    let err = fails(&s.kubeconfig, &["top", "-A"]).await;
    assert!(err.contains("forbidden: cannot list pods at the cluster scope (all namespaces)"), "{err}");
    assert!(err.contains("or name your namespace with -n NAMESPACE"), "{err}");

    // Budgets unreadable: top goes on without the limits, and says so.
    fake.fail_next(Verb::List, "gpumemorybudgets", 1, 403);
    let out = run(Some(&s.kubeconfig), &["top"]).await;
    let (stdout, stderr) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "{stderr}");
    assert_eq!(words(&stdout)[2], ["llm-0", "n1", "9Gi", "<unknown>", "-", "Over", "llm-inference"]);
    assert!(
        stderr.contains("warning: forbidden: cannot list gpumemorybudgets.gpubudget.io in namespace team-a"),
        "{stderr}"
    );

    fake.fail_next(Verb::Get, "pods", 1, 403);
    let err = fails(&s.kubeconfig, &["why", "llm-0"]).await;
    assert!(err.contains("forbidden: cannot get pods in namespace team-a"), "{err}");
    fake.fail_next(Verb::List, "gpumemorybudgets", 1, 403);
    let out = ok(&s.kubeconfig, &["why", "llm-0"]).await;
    assert!(
        out.contains("the budgets of team-a could not be read; the agent's record names budget llm-inference"),
        "{out}"
    );
    assert!(out.contains("Warning:") && out.contains("cannot list gpumemorybudgets.gpubudget.io"), "{out}");
}

#[tokio::test]
async fn kubeconfig_and_context_flags_work_as_kubectls() {
    let fake = cluster().await;
    let s = serve(&fake, "team-b").await;
    // --kubeconfig without KUBECONFIG; the context's namespace is the default one.
    let out = run(None, &["top", "--kubeconfig", s.kubeconfig.to_str().unwrap()]).await;
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(words(&String::from_utf8_lossy(&out.stdout))[1][0], "b-0");

    // Two contexts: the current one points nowhere, --context picks the served one.
    let served = std::fs::read_to_string(&s.kubeconfig).unwrap();
    let mut config: Value = serde_yaml::from_str(&served).unwrap();
    config["clusters"]
        .as_array_mut()
        .unwrap()
        .push(json!({"name": "dead", "cluster": {"server": "http://127.0.0.1:1"}}));
    config["contexts"]
        .as_array_mut()
        .unwrap()
        .push(json!({"name": "dead", "context": {"cluster": "dead", "user": "gpubudget-demo"}}));
    config["current-context"] = json!("dead");
    let two = s.kubeconfig.with_file_name("two");
    std::fs::write(&two, serde_yaml::to_string(&config).unwrap()).unwrap();
    let err = fails(&two, &["top"]).await;
    assert!(err.starts_with("error: cannot list pods in namespace default:"), "{err}");
    let out = ok(&two, &["top", "--context", "gpubudget-demo"]).await;
    assert_eq!(words(&out)[1][0], "b-0");
    let err = fails(&two, &["top", "--context", "missing"]).await;
    assert!(err.starts_with("error: cannot configure a client:"), "{err}");

    let out = run(None, &["top"]).await;
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).starts_with("error: cannot configure a client"));
}

/// The krew manifest installs this binary under the plugin's name.
#[test]
fn krew_manifest_names_this_binary() {
    let manifest: Value =
        serde_yaml::from_str(include_str!("../krew/gpubudget.yaml")).expect("the krew manifest is YAML");
    assert_eq!(manifest["kind"], "Plugin");
    assert_eq!(manifest["metadata"]["name"], "gpubudget");
    for platform in manifest["spec"]["platforms"].as_array().unwrap() {
        assert_eq!(platform["bin"], "kubectl-gpubudget");
    }
    assert_eq!(manifest["spec"]["version"], format!("v{}", env!("CARGO_PKG_VERSION")));
}
