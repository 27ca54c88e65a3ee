//! Hostile pods against the agent's real attribution, usage and decision code (docs/security.md lists
//! each attack with the test here that shows it fails).

use std::collections::BTreeMap;
use std::sync::Arc;

use gpubudget_agent::attribute::ProcAttributor;
use gpubudget_agent::attribute::Usage;
use gpubudget_agent::attribute::pods::{ContainerView, PodTable, PodView};
use gpubudget_agent::attribute::procfs::write_fake_process;
use gpubudget_agent::decide::Enforcer;
use gpubudget_agent::decide::{Action, Feedback, Now, Settings};
use gpubudget_agent::sample::{GpuInfo, ProcessSample, Snapshot};
use gpubudget_common::pod_record::PodRecord;
use gpubudget_common::{BudgetState, GpuMemoryBudget};

const GI: u64 = 1 << 30;
const NODE: &str = "gpu-node-1";
const UID_A: &str = "1b2c3d4e-5f60-4a7b-8c9d-0e1f2a3b4c5d";
const UID_B: &str = "2b2c3d4e-5f60-4a7b-8c9d-0e1f2a3b4c5d";
const CID_A: &str = "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa";
const CID_B: &str = "bbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbb";

fn budget(name: &str, limit: &str, selector: &str) -> GpuMemoryBudget {
    serde_yaml::from_str(&format!(
        "apiVersion: gpubudget.io/v1alpha1\nkind: GpuMemoryBudget\nmetadata: {{name: {name}, namespace: team-a}}\n\
         spec: {{selector: {selector}, limit: {limit}, overLimitSeconds: 10}}"
    ))
    .expect("budget")
}

fn pod(uid: &str, name: &str, cid: &str, labels: &[(&str, &str)]) -> PodView {
    PodView {
        uid: Arc::from(uid),
        namespace: Arc::from("team-a"),
        name: Arc::from(name),
        node: Some(NODE.into()),
        labels: labels.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned())).collect::<BTreeMap<_, _>>(),
        critical: false,
        terminating: false,
        termination_grace_seconds: Some(30),
        containers: vec![ContainerView { id: cid.into(), name: Arc::from("main") }],
        mirror_of: None,
        record: None,
        has_annotations: false,
        caps_expected: false,
        mps_cap_mib: None,
        share: gpubudget_common::share::Declaration::None,
        runtime_caps: None,
    }
}

fn cgroup(uid: &str, cid: &str) -> String {
    format!("0::/kubepods.slice/kubepods-pod{}.slice/cri-containerd-{cid}.scope\n", uid.replace('-', "_"))
}

fn snapshot(processes: &[(u32, u64)]) -> Snapshot {
    Snapshot {
        readings: Vec::new(),
        gpus: vec![GpuInfo { label: "0".into(), ..GpuInfo::default() }],
        processes: processes
            .iter()
            .map(|&(pid, bytes)| ProcessSample {
                gpu: 0,
                pid: Some(pid),
                bytes: Some(bytes),
                direct: None,
                mps_client: None,
            })
            .collect(),
    }
}

fn at(ms: u64) -> Now {
    Now { mono_ms: ms, wall: jiff::Timestamp::from_second(1_800_000_000 + (ms / 1000) as i64).expect("ts") }
}

/// Ticks the enforcer with every write succeeding; returns the evicted pod names. An eviction request
/// follows its `Evicting` record once that has landed, at the next tick: the helper runs that tick at once.
fn tick(enforcer: &mut Enforcer, ms: u64, table: &PodTable, usage: &Usage) -> Vec<String> {
    let gpus = [GpuInfo { label: "0".into(), ..GpuInfo::default() }];
    let mut evicted = Vec::new();
    for _ in 0..2 {
        let mut out = Vec::new();
        enforcer.tick(at(ms), table, &usage.pods, &gpus, &mut out);
        for a in &out {
            match a {
                Action::Apply { pod, record, .. } => enforcer.feedback(
                    at(ms),
                    Feedback::Written { uid: pod.uid.clone(), record: Some(record.clone()), ok: true },
                    &mut Vec::new(),
                ),
                Action::Evict { pod, .. } => evicted.push(pod.name.to_string()),
                _ => {}
            }
        }
    }
    evicted
}

/// Splitting the work into many processes (on one GPU or several) does not split the budget: usage is
/// summed per pod.
#[test]
fn many_small_processes_are_summed_per_pod() {
    let dir = tempfile::tempdir().expect("tempdir");
    for pid in 100..164 {
        write_fake_process(dir.path(), pid, 1, &cgroup(UID_A, CID_A)).expect("fixture");
    }
    let table = PodTable::build([pod(UID_A, "a", CID_A, &[])], &[budget("b", "8Gi", "{}")], Some(NODE));
    let mut attributor = ProcAttributor::new(dir.path());
    let mut usage = Usage::default();
    // 64 processes of 256 MiB: 16 GiB, each far under the 8 GiB budget.
    let processes: Vec<(u32, u64)> = (100..164).map(|pid| (pid, GI / 4)).collect();
    usage.compute(&snapshot(&processes), &table, &mut attributor, 0);
    assert_eq!(usage.pods[0].total, 16 * GI);
    assert_eq!(usage.pods[0].holders.len(), 64);
    let mut enforcer = Enforcer::new(Settings::new(NODE));
    assert!(tick(&mut enforcer, 0, &table, &usage).is_empty());
    assert_eq!(tick(&mut enforcer, 10_000, &table, &usage), ["a"], "the sum is over the budget: evicted");
}

/// A process forked after a sample is charged at the next sample (its cgroup is its parent's); a new
/// process that exits between the NVML read and the /proc read is charged to no one; a PID reused by
/// another pod's process is charged to the new owner, not the old.
#[test]
fn forks_exits_and_pid_reuse_are_charged_to_the_right_pod() {
    let dir = tempfile::tempdir().expect("tempdir");
    write_fake_process(dir.path(), 100, 1, &cgroup(UID_A, CID_A)).expect("fixture");
    let table = PodTable::build(
        [pod(UID_A, "a", CID_A, &[]), pod(UID_B, "b", CID_B, &[])],
        &[budget("b", "8Gi", "{}")],
        Some(NODE),
    );
    let mut attributor = ProcAttributor::new(dir.path());
    let mut usage = Usage::default();
    usage.compute(&snapshot(&[(100, 6 * GI)]), &table, &mut attributor, 0);
    assert_eq!((usage.pods[0].total, usage.pods[1].total), (6 * GI, 0));
    // Fork after the sample: the child appears in the next one.
    write_fake_process(dir.path(), 101, 2, &cgroup(UID_A, CID_A)).expect("fixture");
    usage.compute(&snapshot(&[(100, 6 * GI), (101, 3 * GI)]), &table, &mut attributor, 250);
    assert_eq!(usage.pods[0].total, 9 * GI);
    // A new PID 102 exits between the NVML read and the /proc read: charged to no one.
    usage.compute(&snapshot(&[(100, 6 * GI), (101, 3 * GI), (102, GI)]), &table, &mut attributor, 500);
    assert_eq!((usage.pods[0].total, usage.pods[1].total), (9 * GI, 0));
    assert_eq!(usage.unattributed, [GI]);
    // PID 101 exits; NVML stops listing it, then the kernel hands the number to a process of pod b
    // (another start time) at once: charged to its new owner.
    std::fs::remove_dir_all(dir.path().join("101")).expect("exit");
    usage.compute(&snapshot(&[(100, 6 * GI)]), &table, &mut attributor, 750);
    write_fake_process(dir.path(), 101, 77, &cgroup(UID_B, CID_B)).expect("fixture");
    usage.compute(&snapshot(&[(100, 6 * GI), (101, 2 * GI)]), &table, &mut attributor, 1_000);
    assert_eq!((usage.pods[0].total, usage.pods[1].total), (6 * GI, 2 * GI), "PID 101 is pod b's now");
    // PID 100 reused while listed in every round: caught by the start time, re-read every 10 s.
    write_fake_process(dir.path(), 100, 99, &cgroup(UID_B, CID_B)).expect("fixture");
    usage.compute(&snapshot(&[(100, 5 * GI), (101, 2 * GI)]), &table, &mut attributor, 20_000);
    assert_eq!((usage.pods[0].total, usage.pods[1].total), (0, 7 * GI), "charged to the PID's new owner");
}

/// Relabelling itself out of a small budget into a bigger one does not work while both select it
/// (the smallest limit applies), and relabelling never restarts nor escapes the timer while the budget
/// that applies is unchanged.
#[test]
fn relabelling_picks_the_smallest_budget() {
    let budgets = [budget("small", "4Gi", "{}"), budget("big", "64Gi", "{matchLabels: {tier: big}}")];
    let table = PodTable::build([pod(UID_A, "a", CID_A, &[("tier", "big")])], &budgets, Some(NODE));
    assert_eq!(table.budget(0).map(|b| b.name.as_str()), Some("small"));
    let usage = Usage {
        pods: vec![gpubudget_agent::attribute::PodUsage { total: 6 * GI, holders: vec![], unknown: 0 }],
        ..Usage::default()
    };
    let mut enforcer = Enforcer::new(Settings::new(NODE));
    assert!(tick(&mut enforcer, 0, &table, &usage).is_empty());
    // It relabels itself half-way through the grace period: same budget applies, same timer.
    let relabelled = PodTable::build([pod(UID_A, "a", CID_A, &[("tier", "other")])], &budgets, Some(NODE));
    assert!(tick(&mut enforcer, 5_000, &relabelled, &usage).is_empty());
    assert_eq!(tick(&mut enforcer, 10_000, &relabelled, &usage), ["a"]);
}

/// A pod that writes the agent's record on itself (`gpubudget.io/state: Evicting`, a request time, this
/// node) neither gets itself nor another pod evicted early, and does not stop its own eviction.
#[test]
fn a_forged_record_neither_evicts_early_nor_prevents_eviction() {
    let forged = PodRecord {
        state: BudgetState::Evicting,
        usage_bytes: 100 * GI,
        budget: "b".into(),
        node: NODE.into(),
        eviction_requested_at: Some("2020-01-01T00:00:00Z".into()),
        cap_not_in_force: None,
        share: None,
        runtime_caps: None,
    };
    let mut a = pod(UID_A, "a", CID_A, &[]);
    a.record = Some(forged.clone());
    a.has_annotations = true;
    let mut b = pod(UID_B, "b", CID_B, &[]);
    b.record = Some(PodRecord { budget: "b".into(), ..forged });
    b.has_annotations = true;
    let table = PodTable::build([a, b], &[budget("b", "8Gi", "{}")], Some(NODE));
    // a is over its budget, b is under.
    let usage = Usage {
        pods: vec![
            gpubudget_agent::attribute::PodUsage { total: 9 * GI, holders: vec![], unknown: 0 },
            gpubudget_agent::attribute::PodUsage { total: GI, holders: vec![], unknown: 0 },
        ],
        ..Usage::default()
    };
    let mut enforcer = Enforcer::new(Settings::new(NODE));
    for ms in (0..10_000).step_by(250) {
        assert!(tick(&mut enforcer, ms, &table, &usage).is_empty(), "nothing before 10 s over the limit ({ms} ms)");
    }
    assert_eq!(tick(&mut enforcer, 10_000, &table, &usage), ["a"], "only the pod over its budget, on time");
}

/// A container that may write its own cgroup subtree creates, under its container's cgroup, a cgroup that
/// names its neighbour's pod (or a made-up pod) and moves its CUDA process there (#11). The memory is still
/// its own: the outermost pod on the path is the one the kubelet made. The neighbour is not charged nor
/// evicted; the tenant is.
#[test]
fn a_nested_cgroup_naming_a_neighbour_is_charged_to_its_own_pod() {
    let dir = tempfile::tempdir().expect("tempdir");
    let own = cgroup(UID_A, CID_A);
    let own = own.trim_end();
    // Names the neighbour (b) and its container.
    let at_neighbour = format!("{own}/kubepods-pod{}.slice/cri-containerd-{CID_B}.scope\n", UID_B.replace('-', "_"));
    write_fake_process(dir.path(), 100, 1, &at_neighbour).expect("fixture");
    // Names a pod that does not exist (charged to no one, before #11).
    write_fake_process(
        dir.path(),
        101,
        1,
        &format!("{own}/kubepods/pod00000000-0000-0000-0000-000000000000/0123456789ab\n"),
    )
    .expect("fixture");
    let table = PodTable::build(
        [pod(UID_A, "a", CID_A, &[]), pod(UID_B, "b", CID_B, &[])],
        &[budget("b", "8Gi", "{}")],
        Some(NODE),
    );
    let mut attributor = ProcAttributor::new(dir.path());
    let mut usage = Usage::default();
    usage.compute(&snapshot(&[(100, 6 * GI), (101, 3 * GI)]), &table, &mut attributor, 0);
    assert_eq!((usage.pods[0].total, usage.pods[1].total), (9 * GI, 0), "both processes are a's");
    assert_eq!(usage.unattributed, [0], "nothing is charged to no one");
    let mut enforcer = Enforcer::new(Settings::new(NODE));
    assert!(tick(&mut enforcer, 0, &table, &usage).is_empty());
    assert_eq!(tick(&mut enforcer, 10_000, &table, &usage), ["a"], "the tenant is evicted, not its neighbour");
}
