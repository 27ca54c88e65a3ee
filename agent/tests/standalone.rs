//! The binary end to end without GPUs or an API server: `standalone` and `top` over a replayed sample file
//! and a fake `/proc` tree in a tempdir.

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use gpubudget_agent::attribute::procfs::write_fake_process;
use serde_json::Value;

const BIN: &str = env!("CARGO_BIN_EXE_gpubudget-agent");
const UID_A: &str = "8e1f7a2b-9c3d-4e5f-a6b7-c8d9e0f1a2b3";
const UID_B: &str = "2b3c4d5e-6f70-4182-93a4-b5c6d7e8f901";

fn cid(c: char) -> String {
    std::iter::repeat_n(c, 64).collect()
}

fn setup(dir: &Path) {
    let proc_root = dir.join("proc");
    let cgroup = format!(
        "0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{}.slice/cri-containerd-{}.scope\n",
        UID_A.replace('-', "_"),
        cid('a')
    );
    write_fake_process(&proc_root, 100, 1000, &cgroup).expect("fixture");
    write_fake_process(&proc_root, 101, 1000, "0::/user.slice/user-0.slice/session-1.scope\n").expect("fixture");
    std::fs::write(
        dir.join("pods.yaml"),
        format!(
            "apiVersion: v1\nkind: Pod\nmetadata: {{name: llm-0, namespace: team-a, uid: {UID_A}, labels: {{app: llm}}}}\n\
             spec: {{nodeName: n1, containers: [{{name: trainer, image: x}}]}}\n\
             status: {{containerStatuses: [{{name: trainer, containerID: 'containerd://{}', image: x, imageID: x, ready: true, restartCount: 0}}]}}\n\
             ---\napiVersion: v1\nkind: Pod\nmetadata: {{name: web-0, namespace: team-a, uid: {UID_B}}}\n\
             spec: {{nodeName: n1, containers: [{{name: web, image: x}}]}}\n\
             ---\napiVersion: v1\nkind: Pod\nmetadata: {{name: elsewhere, namespace: team-a, uid: 00000000-0000-0000-0000-000000000009}}\n\
             spec: {{nodeName: n2, containers: []}}\n",
            cid('a')
        ),
    )
    .expect("pods");
    std::fs::write(
        dir.join("budgets.yaml"),
        "apiVersion: gpubudget.io/v1alpha1\nkind: GpuMemoryBudget\nmetadata: {name: llm, namespace: team-a}\n\
         spec: {selector: {matchLabels: {app: llm}}, limit: 8Gi, overLimitSeconds: 0, evictionGracePeriodSeconds: 30}\n\
         ---\napiVersion: gpubudget.io/v1alpha1\nkind: GpuMemoryBudget\nmetadata: {name: wide, namespace: team-a}\n\
         spec: {selector: {}, limit: 16Gi}\n",
    )
    .expect("budgets");
}

fn sample(pid_bytes: &str) -> String {
    format!(
        r#"{{"gpus": [{{"index": 0, "uuid": "GPU-1", "name": "Fake", "memory_total_bytes": "80Gi", "processes": [
            {{"pid": 100, "used_bytes": "{pid_bytes}"}},
            {{"pid": 101, "used_bytes": "2Gi"}},
            {{"namespace": "team-a", "pod": "web-0", "container": "web", "used_bytes": "1Gi"}},
            {{"pod_uid": "00000000-0000-0000-0000-000000000009", "used_bytes": "1Gi"}}
        ]}}]}}"#
    )
}

fn lines(path: &Path) -> Vec<Value> {
    std::fs::read_to_string(path)
        .expect("output")
        .lines()
        .map(|l| serde_json::from_str(l).expect("a JSON line"))
        .collect()
}

#[test]
fn standalone_decides_from_files_and_follows_sample_file_updates() {
    let dir = tempfile::tempdir().expect("tempdir");
    setup(dir.path());
    let sample_path = dir.path().join("sample.json");
    std::fs::write(&sample_path, sample("4Gi")).expect("sample");
    let out = dir.path().join("decisions.jsonl");
    let mut child = Command::new(BIN)
        .args(["standalone", "--node-name", "n1", "--interval", "50ms", "--duration", "1500ms", "--log-usage"])
        .arg("--budgets")
        .arg(dir.path().join("budgets.yaml"))
        .arg("--pods")
        .arg(dir.path().join("pods.yaml"))
        .arg("--proc-root")
        .arg(dir.path().join("proc"))
        .arg("--sample-file")
        .arg(&sample_path)
        .arg("--output")
        .arg(&out)
        .spawn()
        .expect("runs");
    // A wall-clock wait, and it must be: the agent is a child process (the binary itself) ticking on the
    // wall clock, which no tokio clock here controls. 600 ms is a dozen 50 ms ticks on the 4Gi sample
    // before the 9Gi one replaces it.
    std::thread::sleep(Duration::from_millis(600));
    // A ConfigMap-style update: a new file renamed over the old one.
    let next = dir.path().join("next.json");
    std::fs::write(&next, sample("9Gi")).expect("sample");
    std::fs::rename(&next, &sample_path).expect("rename");
    assert!(child.wait().expect("exits").success());

    let lines = lines(&out);
    assert_eq!(lines[0]["kind"], "start");
    assert_eq!(lines[0]["pods"], 2, "the other node's pod is left out");
    assert!(lines.iter().all(|l| l["ts"].is_string() && l["ts_unix"].is_f64()));
    let llm: Vec<&Value> = lines.iter().filter(|l| l["pod"] == "team-a/llm-0").collect();
    let kinds: Vec<&str> = llm.iter().filter_map(|l| l["kind"].as_str()).filter(|k| *k != "usage").collect();
    assert_eq!(
        kinds,
        ["apply", "transition", "apply", "event", "evict"],
        "first record, then Within->Evicting: the record with eviction-requested-at, the event, the request"
    );
    let transition = llm.iter().find(|l| l["kind"] == "transition").expect("transition");
    assert_eq!((transition["from"].as_str(), transition["to"].as_str()), (Some("Within"), Some("Evicting")));
    let apply = llm.iter().filter(|l| l["kind"] == "apply").nth(1).expect("apply");
    assert_eq!(apply["annotations"]["gpubudget.io/state"], "Evicting");
    assert!(apply["annotations"]["gpubudget.io/eviction-requested-at"].is_string());
    assert_eq!(apply["annotations"]["gpubudget.io/node"], "n1");
    let event = llm.iter().find(|l| l["kind"] == "event").expect("event");
    assert_eq!(event["reason"], "EvictingForGpuMemory");
    assert_eq!(
        event["note"],
        "using 9Gi of 8Gi (budget team-a/llm) for 0s; evicting with 30s grace; held by trainer (pid 100, GPU 0) 9Gi"
    );
    assert_eq!(llm.iter().find(|l| l["kind"] == "evict").expect("evict")["grace_period_seconds"], 30);
    // Usage lines: the pod named directly in the sample file is charged; the host process is not.
    let web = lines.iter().find(|l| l["kind"] == "usage" && l["pod"] == "team-a/web-0").expect("web usage");
    assert_eq!(web["usage_bytes"], 1u64 << 30);
    let stats = lines.last().expect("stats");
    assert_eq!(stats["kind"], "stats");
    assert!(stats["sampled"].as_u64().expect("n") >= 10);
    assert_eq!(stats["proc_reads"]["cgroup"], 2, "each PID's cgroup read once: {stats}");
}

#[test]
fn top_shows_pods_by_uid_without_an_api_server() {
    let dir = tempfile::tempdir().expect("tempdir");
    setup(dir.path());
    let sample_path = dir.path().join("sample.json");
    std::fs::write(&sample_path, sample("9Gi")).expect("sample");
    let run = |output: &str| {
        let out = Command::new(BIN)
            .args(["top", "--once", "--no-api", "--output", output])
            .arg("--sample")
            .arg(&sample_path)
            .arg("--proc-root")
            .arg(dir.path().join("proc"))
            .output()
            .expect("runs");
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        String::from_utf8(out.stdout).expect("utf-8")
    };
    let json: Value = serde_json::from_str(&run("json")).expect("json");
    let processes = json["processes"].as_array().expect("processes");
    let p100 = processes.iter().find(|p| p["pid"] == 100).expect("pid 100");
    assert_eq!((p100["pod"].as_str(), p100["container"].as_str()), (Some(UID_A), Some("aaaaaaaaaaaa")));
    assert_eq!(p100["bytes"], 9u64 << 30);
    assert_eq!(p100["command"], "python3", "from /proc/<pid>/comm");
    let p101 = processes.iter().find(|p| p["pid"] == 101).expect("pid 101");
    assert_eq!(p101["pod"], "");
    assert_eq!(json["gpus"][0]["used_bytes"], (9u64 + 2 + 1 + 1) << 30);
    let table = run("table");
    assert!(table.contains("(no pod)") && table.contains(UID_A) && table.contains("9Gi"), "{table}");
    assert!(table.contains("pods are shown by UID"), "{table}");
}

/// A real recording (`record --attribute` on an H100, e2e/gpu/run.sh) replays: every process that was in a
/// pod's cgroup carries its pod UID and container ID, so it is charged without `/proc`.
#[test]
fn a_real_h100_recording_replays() {
    let fixture = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/h100-sample.json");
    let empty_proc = tempfile::tempdir().expect("tempdir");
    let out = Command::new(BIN)
        .args(["top", "--once", "--no-api", "--output", "json"])
        .arg("--sample")
        .arg(&fixture)
        .arg("--proc-root")
        .arg(empty_proc.path())
        .output()
        .expect("runs");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let view: Value = serde_json::from_slice(&out.stdout).expect("json");
    assert_eq!(view["gpus"][0]["name"], "NVIDIA H100 80GB HBM3");
    let pods = view["pods"].as_array().expect("pods");
    assert_eq!(pods.len(), 4);
    assert_eq!(pods[0]["uid"], UID_B, "the 6 GiB allocated-then-freed pod is the largest");
    assert_eq!(pods[0]["used_bytes"], 7_082_082_304u64);
    let two_containers = pods.iter().find(|p| p["uid"] == UID_A).expect("pod with two containers");
    assert_eq!(two_containers["used_bytes"], 2_787_115_008u64 + 1_713_373_184);
    let stray = view["processes"].as_array().expect("processes").iter().filter(|p| p["pod"] == "").count();
    assert_eq!(stray, 1, "the host process stays unattributed");
}

#[test]
fn without_a_node_name_every_pod_of_the_file_is_here() {
    let dir = tempfile::tempdir().expect("tempdir");
    setup(dir.path());
    let sample_path = dir.path().join("sample.json");
    std::fs::write(&sample_path, sample("1Gi")).expect("sample");
    let out = dir.path().join("decisions.jsonl");
    let status = Command::new(BIN)
        .env_remove("NODE_NAME")
        .args(["standalone", "--interval", "50ms", "--duration", "300ms"])
        .arg("--budgets")
        .arg(dir.path().join("budgets.yaml"))
        .arg("--pods")
        .arg(dir.path().join("pods.yaml"))
        .arg("--proc-root")
        .arg(dir.path().join("proc"))
        .arg("--sample-file")
        .arg(&sample_path)
        .arg("--output")
        .arg(&out)
        .status()
        .expect("runs");
    assert!(status.success());
    let lines = lines(&out);
    assert_eq!(lines[0]["pods"], 3);
    assert!(lines.iter().any(|l| l["kind"] == "apply" && l["pod"] == "team-a/elsewhere"));
}

#[test]
fn top_shows_failed_gpus_the_split_per_gpu_and_figures_nvml_does_not_give() {
    let dir = tempfile::tempdir().expect("tempdir");
    setup(dir.path());
    let sample_path = dir.path().join("sample.json");
    std::fs::write(
        &sample_path,
        r#"{"gpus": [
          {"index": 0, "uuid": "GPU-0", "memory_total_bytes": "80Gi", "memory_used_bytes": "7Gi",
           "processes": [{"pid": 100, "used_bytes": "5Gi"}]},
          {"index": 1, "uuid": "GPU-1", "memory_total_bytes": "80Gi", "memory_used_bytes": "3Gi",
           "processes": [{"pid": 100, "used_bytes": "3Gi"}, {"pid": 101, "used_bytes": 0, "unavailable": true}]},
          {"index": 2, "uuid": "GPU-2", "memory_total_bytes": "80Gi", "error": "GPU is lost",
           "processes": [{"pid": 100, "used_bytes": "50Gi"}]}
        ]}"#,
    )
    .expect("sample");
    let run = |output: &str| {
        let out = Command::new(BIN)
            .args(["top", "--once", "--no-api", "--output", output, "--sample"])
            .arg(&sample_path)
            .arg("--proc-root")
            .arg(dir.path().join("proc"))
            .output()
            .expect("runs");
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        String::from_utf8(out.stdout).expect("utf-8")
    };
    let json: Value = serde_json::from_str(&run("json")).expect("json");
    let gpus = json["gpus"].as_array().expect("gpus");
    assert_eq!(
        gpus.iter().map(|g| g["state"].as_str().expect("state")).collect::<Vec<_>>(),
        ["ok", "ok", "failed: sample_file: GPU is lost"]
    );
    assert_eq!(gpus[0]["unaccounted_bytes"], 2u64 << 30, "7Gi used, 5Gi listed");
    assert_eq!(gpus[1]["unavailable"], 1);
    assert!(gpus[2].get("unaccounted_bytes").is_none(), "a failed GPU has no figures");
    let pod = json["pods"].as_array().expect("pods").iter().find(|p| p["uid"] == UID_A).expect("pod A");
    assert_eq!(pod["used_bytes"], 8u64 << 30, "GPU 2's 50Gi are not counted");
    assert_eq!(pod["by_gpu"], serde_json::json!({"0": 5u64 << 30, "1": 3u64 << 30}));
    let p101 = json["processes"].as_array().expect("processes").iter().find(|p| p["pid"] == 101).expect("pid 101");
    assert!(p101["bytes"].is_null());
    let table = run("table");
    for text in ["failed: sample_file: GPU is lost", "0: 5Gi, 1: 3Gi", "n/a", "UNACCOUNTED", "(1 without figures)"] {
        assert!(table.contains(text), "{text:?} missing from\n{table}");
    }
}
