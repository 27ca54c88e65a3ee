//! The demo prints the budgets as `kubectl get gmb -A` shows them against the in-memory API, less `AGE`: from
//! the Table the API answers kubectl with (the CRD's printer columns), not from a copy of them. Where `kubectl`
//! is on PATH (`KUBECTL` names another binary), the real kubectl's output is compared line for line.

use std::process::Command;
use std::time::Duration;

use gpubudget_demo::scenario::{budgets_table, put_budgets};
use gpubudget_demo::stack::{Stack, kubelet_like_api};
use gpubudget_testkit::kubeconfig_yaml;
use serde_json::Value;

const CRD: &str = include_str!("../../crds/gpumemorybudgets.gpubudget.io.yaml");

/// NAMESPACE, then the CRD's printer columns kubectl shows without `-o wide`, less AGE: read from the
/// generated CRD.
fn expected_header() -> Vec<String> {
    let crd: Value = serde_yaml::from_str(CRD).unwrap();
    let columns = crd["spec"]["versions"][0]["additionalPrinterColumns"].as_array().unwrap();
    let shown = columns.iter().filter(|c| c["priority"].as_i64().unwrap_or(0) == 0 && c["name"] != "Age");
    ["NAMESPACE", "NAME"]
        .map(str::to_owned)
        .into_iter()
        .chain(shown.map(|c| c["name"].as_str().unwrap().to_uppercase()))
        .collect()
}

/// `kubectl get gmb -A` against the fake served on 127.0.0.1, with its AGE column cut off; `None` without kubectl.
async fn real_kubectl(fake: &gpubudget_testkit::FakeApi) -> Option<String> {
    let binary = std::env::var("KUBECTL").unwrap_or_else(|_| "kubectl".to_owned());
    if Command::new(&binary).args(["version", "--client"]).output().is_err() {
        eprintln!("`{binary}` is not on PATH: the demo's table is not compared with the real kubectl's");
        return None;
    }
    let (addr, server) = fake.serve("127.0.0.1:0").await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let kubeconfig = dir.path().join("kubeconfig");
    std::fs::write(&kubeconfig, kubeconfig_yaml(&format!("http://{addr}"))).unwrap();
    let mut command = Command::new(&binary);
    command.env("KUBECONFIG", &kubeconfig).arg("--cache-dir").arg(dir.path().join("cache")).args(["get", "gmb", "-A"]);
    let output = tokio::task::spawn_blocking(move || command.output()).await.unwrap().unwrap();
    server.abort();
    assert!(output.status.success(), "kubectl: {}", String::from_utf8_lossy(&output.stderr));
    let text = String::from_utf8(output.stdout).unwrap();
    let age = text.lines().next().and_then(|h| h.find("AGE")).expect("an AGE column");
    Some(text.lines().map(|l| format!("{}\n", l.get(..age).unwrap_or(l).trim_end())).collect())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_demos_budget_table_is_what_kubectl_get_gmb_shows() {
    let fake = kubelet_like_api();
    put_budgets(&fake);
    let mut stack = Stack::new(fake);
    stack.start_operator();
    let counted = stack
        .fake
        .wait_until(Duration::from_secs(20), |f| {
            f.list("gpumemorybudgets", None).iter().all(|b| b["status"]["matchedPods"].is_number())
        })
        .await;
    let fake = stack.stop().await;
    assert!(counted, "the operator wrote no status: {:#?}", fake.list("gpumemorybudgets", None));

    let printed = budgets_table(&fake);
    println!("{printed}");
    let lines: Vec<Vec<&str>> = printed.lines().map(|l| l.split_whitespace().collect()).collect();
    assert_eq!(lines[0], expected_header(), "{printed}");
    assert!(lines[0].contains(&"REQUEST") && lines[0].contains(&"CAPPED"), "{printed}");
    assert_eq!(lines.len(), 5, "four budgets:\n{printed}");
    let default = lines.iter().find(|l| l[..2] == ["team-b", "team-b-default"]).expect("the namespace-wide budget");
    // examples/namespace-wide.yaml sets no action: the CRD's default, applied by the API, is what shows.
    assert_eq!(
        default[..4],
        ["team-b", "team-b-default", "20Gi", "Evict"],
        "REQUEST empty, ACTION defaulted:\n{printed}"
    );

    if let Some(kubectl) = real_kubectl(&fake).await {
        assert_eq!(printed, kubectl, "the demo's table (left) and kubectl's, AGE cut off (right)");
    }
}
