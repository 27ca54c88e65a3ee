//! Pods no budget selects, on a shared GPU under memory pressure (issue 23), against the agent's real
//! attribution (`/proc/<pid>/cgroup` → pod), usage, pod table (budget resolution) and decision code
//! (`Enforcer::tick` → `Enforcer::pressure` → `Enforcer::watch_gpus` → `Enforcer::feedback`). Time is the
//! decisions' own monotonic clock, given per tick: no sleeps, no wall clock. docs/security.md lists the
//! stories with the tests here.
//!
//! - a namespace with no budget fills the GPU: under the node policy `Ranked` (the default) it is evicted before
//!   the budgeted neighbour, which is within its budget; under `Never` nobody is, and the Node is told;
//! - a pod that relabels itself out of every selector is treated as a pod no budget selects;
//! - a critical pod no budget selects is still never evicted;
//! - the memory such pods hold is told on the Node once per episode (`GpuMemoryUnbudgeted`).

use std::collections::BTreeMap;
use std::sync::Arc;

use gpubudget_agent::attribute::pods::{ContainerView, PodTable, PodView};
use gpubudget_agent::attribute::procfs::write_fake_process;
use gpubudget_agent::attribute::{ProcAttributor, Usage};
use gpubudget_agent::decide::Enforcer;
use gpubudget_agent::decide::pressure::{PressureSettings, Threshold, Unbudgeted};
use gpubudget_agent::decide::{Action, EvictOutcome, Feedback, NodeReason, Now, Reason, Settings};
use gpubudget_agent::sample::{DeviceMemory, GpuInfo, GpuReading, ProcessSample, Snapshot};
use gpubudget_common::GpuMemoryBudget;

const GI: u64 = 1 << 30;
const TOTAL: u64 = 80 * GI;
const NODE: &str = "gpu-node-1";

/// A pod of this node and its one GPU process (PID `pid`, in the container `cid`).
struct Spec {
    uid: &'static str,
    namespace: &'static str,
    name: &'static str,
    cid: String,
    pid: u32,
}

const NEIGHBOUR: usize = 0;
const FILLER: usize = 1;
const CRITICAL: usize = 2;

fn specs() -> [Spec; 3] {
    [
        Spec {
            uid: "1b2c3d4e-5f60-4a7b-8c9d-0e1f2a3b4c5d",
            namespace: "team-a",
            name: "neighbour",
            cid: "a".repeat(64),
            pid: 100,
        },
        Spec {
            uid: "2b2c3d4e-5f60-4a7b-8c9d-0e1f2a3b4c5d",
            namespace: "free",
            name: "filler",
            cid: "b".repeat(64),
            pid: 200,
        },
        Spec {
            uid: "3b2c3d4e-5f60-4a7b-8c9d-0e1f2a3b4c5d",
            namespace: "kube-system",
            name: "dcgm",
            cid: "c".repeat(64),
            pid: 300,
        },
    ]
}

fn view(spec: &Spec, labels: &[(&str, &str)], critical: bool) -> PodView {
    PodView {
        uid: Arc::from(spec.uid),
        namespace: Arc::from(spec.namespace),
        name: Arc::from(spec.name),
        node: Some(NODE.into()),
        labels: labels.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned())).collect::<BTreeMap<_, _>>(),
        critical,
        terminating: false,
        termination_grace_seconds: Some(30),
        containers: vec![ContainerView { id: spec.cid.clone(), name: Arc::from("main") }],
        mirror_of: None,
        record: None,
        has_annotations: false,
        caps_expected: false,
        mps_cap_mib: None,
        share: gpubudget_common::share::Declaration::None,
        runtime_caps: None,
    }
}

/// The budgets: team-a's (40Gi, `app: llm`). The namespaces `free` and `kube-system` have none.
fn budgets() -> Vec<GpuMemoryBudget> {
    vec![
        serde_yaml::from_str(
            "apiVersion: gpubudget.io/v1alpha1\nkind: GpuMemoryBudget\nmetadata: {name: llm, namespace: team-a}\n\
             spec: {selector: {matchLabels: {app: llm}}, limit: 40Gi, overLimitSeconds: 600}",
        )
        .expect("budget"),
    ]
}

/// The node: fake `/proc` with one process per pod, the pods (`views`), the agent's decisions.
struct Node {
    /// The fake `/proc` (kept for the node's life).
    _proc: tempfile::TempDir,
    attributor: ProcAttributor,
    usage: Usage,
    enforcer: Enforcer,
    table: PodTable,
    /// Every action so far.
    log: Vec<Action>,
}

impl Node {
    fn new(policy: Unbudgeted, views: Vec<PodView>) -> Self {
        let dir = tempfile::tempdir().expect("tempdir");
        for s in specs() {
            let cgroup = format!(
                "0::/kubepods.slice/kubepods-pod{}.slice/cri-containerd-{}.scope\n",
                s.uid.replace('-', "_"),
                s.cid
            );
            write_fake_process(dir.path(), s.pid, 1, &cgroup).expect("fixture");
        }
        let mut settings = Settings::new(NODE);
        // Pressure under 4Gi free; memory no budget covers told at 8Gi for 60s.
        settings.pressure = PressureSettings {
            hard: Some(Threshold::Bytes(4 * GI)),
            soft: None,
            soft_grace_ms: 0,
            transition_ms: 10_000,
        };
        settings.accounting.threshold = Some(Threshold::Bytes(8 * GI));
        settings.unbudgeted_pods = policy;
        let attributor = ProcAttributor::new(dir.path());
        let table = PodTable::build(views, &budgets(), Some(NODE));
        Self {
            _proc: dir,
            attributor,
            usage: Usage::default(),
            enforcer: Enforcer::new(settings),
            table,
            log: Vec::new(),
        }
    }

    /// One sample at `ms`: `bytes` per pod of [`specs`] on GPU 0 (0: no process listed), the device's used
    /// bytes their sum. Every write succeeds and every eviction is accepted; returns this tick's actions.
    fn tick(&mut self, ms: u64, bytes: [u64; 3]) -> Vec<Action> {
        let processes = specs()
            .iter()
            .zip(bytes)
            .filter(|(_, b)| *b > 0)
            .map(|(s, b)| ProcessSample { gpu: 0, pid: Some(s.pid), bytes: Some(b), direct: None, mps_client: None })
            .collect();
        let snapshot = Snapshot {
            gpus: vec![GpuInfo { label: "0".into(), uuid: "GPU-0".into(), total_bytes: TOTAL, ..GpuInfo::default() }],
            readings: vec![GpuReading::sampled(Some(DeviceMemory::from_used(bytes.iter().sum(), TOTAL)))],
            processes,
        };
        self.usage.compute(&snapshot, &self.table, &mut self.attributor, ms);
        let now =
            Now { mono_ms: ms, wall: jiff::Timestamp::from_second(1_800_000_000 + (ms / 1000) as i64).expect("ts") };
        let mut out = Vec::new();
        self.enforcer.tick(now, &self.table, &self.usage.pods, &snapshot.gpus, &mut out);
        self.enforcer.pressure(now, &self.table, &self.usage.pods, &snapshot, &mut out);
        self.enforcer.watch_gpus(now, &snapshot, &self.table, &self.usage, &mut out);
        let feedback: Vec<Feedback> = out
            .iter()
            .filter_map(|a| match a {
                Action::Apply { pod, record, .. } => {
                    Some(Feedback::Written { uid: pod.uid.clone(), record: Some(record.clone()), ok: true })
                }
                Action::Evict { pod, .. } => {
                    Some(Feedback::Evicted { uid: pod.uid.clone(), outcome: EvictOutcome::Accepted })
                }
                _ => None,
            })
            .collect();
        for f in feedback {
            self.enforcer.feedback(now, f, &mut out);
        }
        self.log.extend(out.iter().cloned());
        out
    }

    fn evicted(&self) -> Vec<String> {
        self.log
            .iter()
            .filter_map(|a| match a {
                Action::Evict { pod, .. } => Some(pod.to_string()),
                _ => None,
            })
            .collect()
    }

    fn node_note(&self, reason: NodeReason) -> Vec<String> {
        self.log
            .iter()
            .filter_map(|a| match a {
                Action::NodeEvent { reason: r, note } if *r == reason => Some(note.clone()),
                _ => None,
            })
            .collect()
    }

    fn pod_note(&self, name: &str, reason: Reason) -> Option<String> {
        self.log.iter().find_map(|a| match a {
            Action::Event { pod, reason: r, note } if *r == reason && &*pod.name == name => Some(note.clone()),
            _ => None,
        })
    }
}

fn pods(neighbour_labels: &[(&str, &str)]) -> Vec<PodView> {
    let s = specs();
    vec![view(&s[NEIGHBOUR], neighbour_labels, false), view(&s[FILLER], &[], false), view(&s[CRITICAL], &[], true)]
}

/// The filler of a namespace without a budget grows, 1Gi a second, from 10Gi until the GPU is short, beside a
/// neighbour holding 30Gi of its 40Gi budget and a critical pod holding 2Gi; then stays.
fn fill(node: &mut Node) {
    for s in 0..=40u64 {
        let filler = (10 + s).min(47) * GI;
        node.tick(s * 1_000, [30 * GI, filler, 2 * GI]);
    }
    for k in 41..=120u64 {
        node.tick(k * 1_000, [30 * GI, 47 * GI, 2 * GI]);
    }
}

/// A namespace with no budget fills the GPU: under `Ranked` (the default) the pod is evicted, at once and
/// before the budgeted neighbour (within its budget, never evicted), with an event that says why; the
/// critical pod with no budget is never evicted.
#[test]
fn a_namespace_without_a_budget_filling_the_gpu_is_evicted_before_the_budgeted_neighbour() {
    assert_eq!(Settings::new(NODE).unbudgeted_pods, Unbudgeted::Ranked, "the default protects the neighbour");
    let mut node = Node::new(Unbudgeted::Ranked, pods(&[("app", "llm")]));
    fill(&mut node);
    // 30 + 45 + 2 = 77Gi at 35s: 3Gi free, under 4Gi.
    assert_eq!(node.evicted(), ["free/filler"], "once, the filler only");
    let note = node.pod_note("filler", Reason::Evicting).expect("told");
    assert!(note.starts_with("no budget selects this pod; node policy unbudgetedPods=Ranked"), "{note}");
    assert!(
        note.contains(
            "GPU 0 is under memory pressure (3Gi free of 80Gi; pods within their guarantee there are owed 10Gi)"
        ),
        "{note}"
    );
    assert!(note.contains("held by main (pid 200, GPU 0) 45Gi"), "{note}");
    // Nothing written on the filler (no budget counts the eviction); the neighbour is told nothing but its
    // own record.
    assert!(!node.log.iter().any(|a| matches!(a, Action::Apply { pod, .. } if &*pod.name == "filler")));
    assert!(node.pod_note("neighbour", Reason::Evicting).is_none());
    // The memory held by pods no budget covers (45Gi) was told on the Node, once.
    let told = node.node_note(NodeReason::Unbudgeted);
    assert_eq!(told.len(), 1, "{told:?}");
    assert!(told[0].contains("free/filler") && told[0].contains("unbudgetedPods=Ranked"), "{}", told[0]);
}

/// The same node under `Never` (the behaviour before the policy): nobody is evicted, the GPU stays short,
/// and the Node says why, naming the pod no budget selects and the policy.
#[test]
fn under_never_the_pod_without_a_budget_is_left_and_the_node_says_why() {
    let mut node = Node::new(Unbudgeted::Never, pods(&[("app", "llm")]));
    fill(&mut node);
    assert!(node.evicted().is_empty(), "{:?}", node.evicted());
    let overcommitted = node.node_note(NodeReason::Overcommitted);
    assert_eq!(overcommitted.len(), 1, "once per episode: {overcommitted:?}");
    assert!(overcommitted[0].contains("free/filler 45Gi (no budget, unbudgetedPods=Never)"), "{}", overcommitted[0]);
    let told = node.node_note(NodeReason::Unbudgeted);
    assert!(told.len() == 1 && told[0].contains("starve a budgeted neighbour"), "{told:?}");
}

/// A pod that relabels itself out of every selector is a pod no budget selects: when it then fills the GPU,
/// under `Ranked` it goes first, and its budgeted neighbour stays.
#[test]
fn a_pod_relabelled_out_of_every_selector_is_treated_as_unbudgeted() {
    let s = specs();
    // A tenant of team-a (the filler's process, in team-a) starts under the neighbour's 40Gi budget.
    let tenant = Spec { namespace: "team-a", name: "tenant", ..specs().into_iter().nth(FILLER).expect("filler") };
    let labelled = |app: &str| {
        vec![
            view(&s[NEIGHBOUR], &[("app", "llm")], false),
            view(&tenant, &[("app", app)], false),
            view(&s[CRITICAL], &[], true),
        ]
    };
    let mut node = Node::new(Unbudgeted::Ranked, labelled("llm"));
    // Within its budget at 10Gi.
    for k in 0..10u64 {
        node.tick(k * 1_000, [30 * GI, 10 * GI, 2 * GI]);
    }
    assert!(node.evicted().is_empty());
    // It relabels itself out of the selector (no budget of team-a selects `app: free-ride`), then grows to
    // 45Gi: 77Gi in use, 3Gi free. Its budget would have caught it at 40Gi after 600s; no budget does now.
    node.table = PodTable::build(labelled("free-ride"), &budgets(), Some(NODE));
    for k in 10..20u64 {
        node.tick(k * 1_000, [30 * GI, 45 * GI, 2 * GI]);
    }
    assert_eq!(node.evicted(), ["team-a/tenant"], "the relabelled pod, not its neighbour");
    let note = node.pod_note("tenant", Reason::Evicting).expect("told");
    assert!(note.starts_with("no budget selects this pod; node policy unbudgetedPods=Ranked"), "{note}");
}

/// Under `Ranked`, a critical pod no budget selects is still never evicted: when it alone is what fills
/// the GPU, nobody is, and the Node is told.
#[test]
fn a_critical_pod_without_a_budget_is_never_evicted_under_ranked() {
    let mut node = Node::new(Unbudgeted::Ranked, pods(&[("app", "llm")]));
    for k in 0..20u64 {
        node.tick(k * 1_000, [30 * GI, 0, 47 * GI]);
    }
    assert!(node.evicted().is_empty(), "{:?}", node.evicted());
    let overcommitted = node.node_note(NodeReason::Overcommitted);
    assert!(overcommitted.len() == 1 && overcommitted[0].contains("kube-system/dcgm 47Gi"), "{overcommitted:?}");
}
