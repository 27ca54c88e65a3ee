//! The demo: three budgets, four pods, usage replayed from the H100 recording and then moved the way a
//! user would see it move. One pod climbs over its budget and is evicted; one crosses a `Warn` budget
//! (events and status, never an eviction); one is matched by two budgets (the smaller applies, both say
//! so); a host process holds memory no pod is charged for.
//!
//! What it prints is what a user watches: the budgets as `kubectl get gmb -A` prints them, each time
//! they change, and the pod events as they happen.

use std::collections::HashSet;
use std::time::{Duration, Instant};

use gpubudget_common::quantity::HumanBytes;
use gpubudget_common::text::kubectl_get;
use gpubudget_testkit::FakeApi;
use serde_json::{Value, json};

use crate::stack::{GI, MI, Stack, put_example, put_pod};

/// The recording the real-GPU check took on the H100 (`gpubudget-agent capture --attribute`).
pub const H100_SAMPLE: &str = include_str!("../../agent/tests/fixtures/h100-sample.json");

/// A process of the recording: `(pid, bytes)`.
fn recorded(pid: u32) -> (u32, u64) {
    let sample: Value = serde_json::from_str(H100_SAMPLE).expect("the recording parses");
    let bytes = sample["gpus"][0]["processes"]
        .as_array()
        .and_then(|ps| ps.iter().find(|p| p["pid"] == pid))
        .and_then(|p| p["used_bytes"].as_u64())
        .unwrap_or_else(|| panic!("pid {pid} is in the recording"));
    (pid, bytes)
}

/// The pods of the demo and their processes (PIDs of the recording).
struct Pods {
    llm: (String, [u32; 2]),
    finetune: (String, u32),
    llm_b: (String, u32),
    host: u32,
}

/// The CRD, as `kubectl` discovers it.
const CRD: &str = include_str!("../../crds/gpumemorybudgets.gpubudget.io.yaml");

/// Puts the demo's CRD, namespaces and budgets (those of `examples/`) into `fake`.
pub fn put_budgets(fake: &FakeApi) {
    fake.apply_yaml(CRD).expect("CRD stored");
    for ns in ["team-a", "team-b"] {
        fake.put_object(json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}}))
            .expect("namespace stored");
    }
    put_example(fake, "llm-inference.yaml", "team-a", |_| {});
    put_example(fake, "training-warn.yaml", "team-a", |_| {});
    put_example(fake, "namespace-wide.yaml", "team-b", |_| {});
    put_example(fake, "llm-inference.yaml", "team-b", |_| {});
}

/// Puts the CRD, the namespaces, budgets and pods into `fake`, and the pods' processes into the fixture
/// `/proc` of `stack`; usage starts at the recording's figures.
fn populate(stack: &Stack) -> Pods {
    let fake = &stack.fake;
    put_budgets(fake);

    let cid = |c: &str| c.repeat(32);
    let llm = put_pod(fake, "team-a", "llm-0", json!({"app": "llm"}), &cid("1f"));
    let finetune = put_pod(fake, "team-a", "finetune-0", json!({"job-type": "finetune"}), &cid("2a"));
    let llm_b = put_pod(fake, "team-b", "llm-b-0", json!({"app": "llm"}), &cid("3b"));
    // The recording's processes, moved into these pods' cgroups: the 2 GiB tensor + context (1304) and a
    // worker (1311) serve llm-0; the 6 GiB allocated-then-freed trainer (1319, reserved pool kept) is
    // finetune-0; 1333 is llm-b-0; 1334 stays a host process.
    stack.process(1304, &llm, &cid("1f"));
    stack.process(1311, &llm, &cid("1f"));
    stack.process(1319, &finetune, &cid("2a"));
    stack.process(1333, &llm_b, &cid("3b"));
    let pods = Pods { llm: (llm, [1304, 1311]), finetune: (finetune, 1319), llm_b: (llm_b, 1333), host: 1334 };
    stack.set_usage(&[recorded(1304), recorded(1311), recorded(1319), recorded(1333), recorded(1334)]);
    pods
}

/// One step of the story: after `at` from the start, NVML reports this (`None` for a pod whose processes
/// are gone). `llm` is the server process of llm-0 (its worker keeps the recording's figure).
struct Step {
    at: Duration,
    say: &'static str,
    llm: Option<u64>,
    finetune: u64,
    llm_b: u64,
}

fn steps() -> Vec<Step> {
    let s = Duration::from_secs;
    vec![
        Step {
            at: s(3),
            say: "llm-0 loads its weights: 6Gi of its 8Gi budget",
            llm: Some(6 * GI),
            finetune: 20 * GI,
            llm_b: 4 * GI,
        },
        Step {
            at: s(6),
            say: "llm-0 reaches 7.5Gi (Near); finetune-0 33Gi of a 40Gi Warn budget (Near at 80%); llm-b-0 7.5Gi, matched by two budgets",
            llm: Some(7 * GI + 512 * MI),
            finetune: 33 * GI,
            llm_b: 7 * GI + 512 * MI,
        },
        Step {
            at: s(9),
            say: "llm-0 grows its KV cache to 9Gi: over its 8Gi budget for overLimitSeconds (10s) means eviction; finetune-0 41Gi: over, but its budget only warns",
            llm: Some(9 * GI),
            finetune: 41 * GI,
            llm_b: 7 * GI + 512 * MI,
        },
    ]
}

/// The usage a step means, as NVML would list it.
fn usage_of(pods: &Pods, step: &Step) -> Vec<(u32, u64)> {
    let worker = recorded(pods.llm.1[1]).1;
    let mut out = Vec::new();
    if let Some(total) = step.llm {
        out.push((pods.llm.1[0], total.saturating_sub(worker)));
        out.push((pods.llm.1[1], worker));
    }
    out.push((pods.finetune.1, step.finetune));
    out.push((pods.llm_b.1, step.llm_b));
    out.push(recorded(pods.host));
    out
}

/// The budgets as `kubectl get gmb -A` prints them against the in-memory API, less `AGE` (it changes every
/// second): the Table the API answers kubectl with (the CRD's `additionalPrinterColumns`), printed as kubectl
/// prints it. No column is kept here: a column added to the CRD shows up.
pub fn budgets_table(fake: &FakeApi) -> String {
    kubectl_text(&fake.table("gpumemorybudgets", None), true, &["Age"])
}

/// What `kubectl get` prints for a server-side `meta.k8s.io/v1` `Table`: the columns of priority 0 (the
/// others need `-o wide`) but those named in `leave_out`, names upper-cased, `NAMESPACE` first with `-A`
/// (`all_namespaces`, read from each row's object metadata), a missing cell (`null`: the column's JSONPath
/// found nothing) empty, as kubectl 1.32 prints it (checked against it by `tests/tables.rs`).
pub fn kubectl_text(table: &Value, all_namespaces: bool, leave_out: &[&str]) -> String {
    let definitions = table["columnDefinitions"].as_array().map(Vec::as_slice).unwrap_or_default();
    let shown: Vec<usize> = (0..definitions.len())
        .filter(|&i| {
            let c = &definitions[i];
            c["priority"].as_i64().unwrap_or(0) == 0 && !leave_out.contains(&c["name"].as_str().unwrap_or_default())
        })
        .collect();
    let namespace = all_namespaces.then(|| "NAMESPACE".to_owned());
    let header = namespace
        .into_iter()
        .chain(shown.iter().map(|&i| definitions[i]["name"].as_str().unwrap_or_default().to_uppercase()));
    let mut rows = vec![header.collect::<Vec<_>>()];
    for row in table["rows"].as_array().into_iter().flatten() {
        let cell = |v: &Value| match v {
            Value::Null => String::new(),
            Value::String(s) => s.clone(),
            other => other.to_string(),
        };
        let namespace = all_namespaces.then(|| cell(&row["object"]["metadata"]["namespace"]));
        rows.push(namespace.into_iter().chain(shown.iter().map(|&i| cell(&row["cells"][i]))).collect());
    }
    kubectl_get(&rows)
}

/// Events not printed yet, as `kubectl get events -A -w` prints them (oldest first).
fn new_events(fake: &FakeApi, seen: &mut HashSet<String>) -> Vec<String> {
    let mut events = fake.list("events.events.k8s.io", None);
    events.sort_by_key(|e| e["metadata"]["resourceVersion"].as_str().and_then(|v| v.parse::<u64>().ok()));
    events
        .into_iter()
        .filter(|e| seen.insert(format!("{}/{}", e["metadata"]["namespace"], e["metadata"]["name"])))
        .map(|e| {
            let object = format!(
                "{}/{}",
                e["regarding"]["kind"].as_str().unwrap_or_default().to_ascii_lowercase(),
                e["regarding"]["name"].as_str().unwrap_or_default()
            );
            format!(
                "{:<8} {:<8} {:<24} {:<18} {}",
                e["metadata"]["namespace"].as_str().unwrap_or_default(),
                e["type"].as_str().unwrap_or_default(),
                e["reason"].as_str().unwrap_or_default(),
                object,
                e["note"].as_str().unwrap_or_default()
            )
        })
        .collect()
}

/// How long the demo runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Until {
    /// Until the shutdown signal (Ctrl-C).
    Shutdown,
    /// Until the eviction and the status that counts it, then stops (tests, CI).
    Evicted,
}

/// What the demo saw, for tests.
#[derive(Debug, Default)]
pub struct Outcome {
    /// Every line it printed.
    pub transcript: String,
    /// It saw llm-0 evicted and counted in the budget's status.
    pub evicted: bool,
}

/// Runs the story on `stack` (operator and agent started here), printing through `print`, until `until`.
pub async fn run(mut stack: Stack, until: Until, mut print: impl FnMut(&str)) -> (Outcome, Stack) {
    let mut outcome = Outcome::default();
    let mut say = |line: &str, outcome: &mut Outcome| {
        print(line);
        outcome.transcript.push_str(line);
        outcome.transcript.push('\n');
    };
    let pods = populate(&stack);
    stack.start_operator();
    stack.start_agent(Duration::from_millis(250));
    if !stack.ready(Duration::from_secs(30)).await {
        say(&format!("not ready after 30s: {}", stack.readiness()), &mut outcome);
        return (outcome, stack);
    }
    // The operator's first status of every budget, so that the first table printed is a whole one (not the
    // moment between two status writes): what it prints is then the same on every run, but its times
    // (docs/demo.md's sample is checked against it: tests/demo.rs).
    let statused =
        |f: &FakeApi| f.list("gpumemorybudgets", None).iter().all(|b| b["status"]["matchedPods"].is_number());
    if !stack.fake.wait_until(Duration::from_secs(30), statused).await {
        say("no status on every budget after 30s", &mut outcome);
        return (outcome, stack);
    }
    say(
        "operator and agent ready; usage replayed from the H100 recording (llm-0 4.2Gi, finetune-0 6.6Gi, llm-b-0 1.6Gi, a host process 1.1Gi)",
        &mut outcome,
    );
    let start = Instant::now();
    let shutdown = stack.shutdown();
    let mut steps = steps().into_iter().peekable();
    let (mut seen, mut last_table, mut previous_poll) = (HashSet::new(), String::new(), String::new());
    let mut evicted_at: Option<Instant> = None;
    let mut kubelet_done = false;
    let mut tick = tokio::time::interval(Duration::from_millis(200));
    loop {
        tokio::select! {
            () = shutdown.cancelled() => break,
            _ = tick.tick() => {}
        }
        if let Some(step) = steps.next_if(|s| start.elapsed() >= s.at) {
            say(&format!("\n--- {:>4.1}s  {}", start.elapsed().as_secs_f64(), step.say), &mut outcome);
            stack.set_usage(&usage_of(&pods, &step));
        }
        for line in new_events(&stack.fake, &mut seen) {
            say(&line, &mut outcome);
        }
        // The kubelet's part: a pod being deleted stops its processes a moment later (SIGTERM), then is gone.
        let llm = stack.fake.get("pods", "team-a", "llm-0");
        if evicted_at.is_none() && llm.as_ref().is_some_and(|p| p["metadata"]["deletionTimestamp"].is_string()) {
            evicted_at = Some(Instant::now());
            say(
                &format!(
                    "\n--- {:>4.1}s  llm-0 is terminating (evicted); its processes exit on SIGTERM",
                    start.elapsed().as_secs_f64()
                ),
                &mut outcome,
            );
        }
        if !kubelet_done && evicted_at.is_some_and(|t| t.elapsed() >= Duration::from_secs(2)) {
            kubelet_done = true;
            let step = Step { at: Duration::ZERO, say: "", llm: None, finetune: 41 * GI, llm_b: 7 * GI + 512 * MI };
            stack.set_usage(&usage_of(&pods, &step));
            stack.fake.finish_deletion("team-a", "llm-0");
            say(
                &format!(
                    "\n--- {:>4.1}s  llm-0 is gone; its {} are free for its neighbours",
                    start.elapsed().as_secs_f64(),
                    HumanBytes(9 * GI)
                ),
                &mut outcome,
            );
        }
        // A table is printed once it held for two polls (200 ms): the operator writes the budgets' statuses one
        // by one, and the moment between two writes is no state worth showing (nor the same on every run).
        let table = budgets_table(&stack.fake);
        let print_table = |table: &str, outcome: &mut Outcome, say: &mut dyn FnMut(&str, &mut Outcome)| {
            say(
                &format!("\n$ kubectl get gmb -A     # at {:.1}s\n{}", start.elapsed().as_secs_f64(), table.trim_end()),
                outcome,
            );
        };
        if table != last_table && table == previous_poll {
            print_table(&table, &mut outcome, &mut say);
            last_table.clone_from(&table);
        }
        previous_poll = table;
        let counted = stack
            .fake
            .list("gpumemorybudgets", Some("team-a"))
            .iter()
            .any(|b| b["metadata"]["name"] == "llm-inference" && b["status"]["evictions"] == 1);
        if counted && kubelet_done && !outcome.evicted {
            outcome.evicted = true;
            if until == Until::Evicted {
                // The table that counts the eviction, even if it has not held for two polls yet.
                let table = budgets_table(&stack.fake);
                if table != last_table {
                    print_table(&table, &mut outcome, &mut say);
                }
                break;
            }
            say("\n(the story is over; the system keeps running: try kubectl, or Ctrl-C to stop)", &mut outcome);
        }
    }
    (outcome, stack)
}
