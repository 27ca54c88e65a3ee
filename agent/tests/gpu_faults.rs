//! One GPU failing never takes the others down (issue 12): the NVML sampler over a fake NVML with faults
//! injected — a GPU lost mid-run, one that never initialises, one that comes back, NVML itself gone — and
//! the lists merged without double counting (MPS clients, unavailable figures).

mod support;

use std::time::{Duration, Instant};

use gpubudget_agent::sample::nvml::{Listed, NvmlSampler, ProcessList, RefreshMode};
use gpubudget_agent::sample::{Backoff, Call, GpuHealth, SampleError, Snapshot};
use support::fake_nvml::{FakeGpu, FakeNvml, Fault};

const GI: u64 = 1 << 30;
const TICK: Duration = Duration::from_millis(250);

fn two_gpus() -> FakeNvml {
    FakeNvml::new(vec![
        FakeGpu::new("GPU-aaaa", 80 * GI).with(ProcessList::Compute, 100, Some(10 * GI)),
        FakeGpu::new("GPU-bbbb", 80 * GI).with(ProcessList::Compute, 200, Some(20 * GI)),
    ])
}

fn sampler(nvml: &FakeNvml, t0: Instant) -> NvmlSampler<FakeNvml> {
    NvmlSampler::with_backend(nvml.clone(), RefreshMode::Gated(Duration::from_secs(3)), t0).expect("sampler")
}

fn pids(snapshot: &Snapshot) -> Vec<(usize, u32, Option<u64>)> {
    snapshot.processes.iter().map(|p| (p.gpu, p.pid.expect("pid"), p.bytes)).collect()
}

fn failed(snapshot: &Snapshot, gpu: usize) -> Option<(SampleError, u32)> {
    match &snapshot.readings[gpu].health {
        GpuHealth::Sampled => None,
        GpuHealth::Failed { error, failures } => Some((error.clone(), *failures)),
    }
}

fn calls_on(nvml: &FakeNvml, gpu: u32) -> usize {
    nvml.take_calls().iter().filter(|c| c.ends_with(&format!(" {gpu}"))).count()
}

#[test]
fn a_gpu_lost_mid_run_fails_alone_is_retried_with_backoff_and_comes_back() {
    let nvml = two_gpus();
    let t0 = Instant::now();
    let mut s = sampler(&nvml, t0);
    let mut out = Snapshot::default();
    s.sample_at(t0, &mut out).expect("sample");
    assert_eq!(pids(&out), [(0, 100, Some(10 * GI)), (1, 200, Some(20 * GI))]);
    assert_eq!(out.sampled_gpus(), 2);

    // GPU 1 falls off the bus: the sample still succeeds, GPU 0 is as before, GPU 1 has no process and no
    // figure (nothing can be decided from it).
    nvml.with(|w| w.gpus[1].fault = Some(Fault::Lost));
    nvml.take_calls();
    let mut t = t0 + TICK;
    s.sample_at(t, &mut out).expect("one GPU lost is not a failed sample");
    assert_eq!(pids(&out), [(0, 100, Some(10 * GI))]);
    let (error, failures) = failed(&out, 1).expect("GPU 1 failed");
    assert_eq!((error.call, error.message.as_str()), (Call::DeviceByIndex, "GPU is lost"), "{error}");
    assert_eq!(failures, 1);
    assert_eq!(out.memory(1), None);
    assert!(out.memory(0).is_some());
    assert_eq!(out.sampled_gpus(), 1);
    assert_eq!(out.gpus.len(), 2, "a failed GPU keeps its place");

    // Retries back off: nothing is asked of GPU 1 before its retry is due, and each failed retry doubles
    // the wait (0.5 s, 1 s, 2 s, ...).
    nvml.take_calls();
    let mut delay = Backoff::MIN;
    let mut retry_at = t + delay;
    for round in 0..4 {
        while t + TICK < retry_at {
            t += TICK;
            s.sample_at(t, &mut out).expect("sample");
            assert_eq!(calls_on(&nvml, 1), 0, "round {round}: GPU 1 asked before its retry at {t:?}");
            assert!(failed(&out, 1).is_some());
            assert_eq!(pids(&out), [(0, 100, Some(10 * GI))], "GPU 0 enforced as before");
        }
        t = retry_at;
        s.sample_at(t, &mut out).expect("sample");
        assert!(calls_on(&nvml, 1) > 0, "round {round}: retried when due");
        assert_eq!(failed(&out, 1).expect("still lost").1, round + 2);
        delay *= 2;
        retry_at = t + delay;
    }

    // It comes back: at its next retry it is described again and sampled.
    nvml.with(|w| w.gpus[1].fault = None);
    s.sample_at(retry_at - Duration::from_millis(1), &mut out).expect("sample");
    assert!(failed(&out, 1).is_some(), "not before its retry");
    s.sample_at(retry_at, &mut out).expect("sample");
    assert_eq!(failed(&out, 1), None);
    assert_eq!(pids(&out), [(0, 100, Some(10 * GI)), (1, 200, Some(20 * GI))]);
    assert_eq!(out.sampled_gpus(), 2);

    // A later failure starts from the shortest backoff again.
    nvml.with(|w| w.gpus[1].fault = Some(Fault::Lost));
    let t = retry_at + TICK;
    s.sample_at(t, &mut out).expect("sample");
    nvml.with(|w| w.gpus[1].fault = None);
    s.sample_at(t + Backoff::MIN, &mut out).expect("sample");
    assert_eq!(failed(&out, 1), None, "retried after the shortest backoff");
}

#[test]
fn a_gpu_that_never_initialises_does_not_stop_the_others_and_joins_when_it_can() {
    let nvml = two_gpus();
    nvml.with(|w| w.gpus[0].fault = Some(Fault::Undescribable));
    let t0 = Instant::now();
    let mut s = sampler(&nvml, t0);
    let mut out = Snapshot::default();
    s.sample_at(t0, &mut out).expect("sample");
    assert_eq!(out.gpus.len(), 2);
    assert_eq!((out.gpus[0].label.as_str(), out.gpus[0].uuid.as_str()), ("0", ""), "a stand-in for GPU 0");
    assert!(failed(&out, 0).is_some());
    assert_eq!(pids(&out), [(1, 200, Some(20 * GI))]);

    nvml.with(|w| w.gpus[0].fault = None);
    let mut t = t0;
    for _ in 0..8 {
        t += TICK;
        s.sample_at(t, &mut out).expect("sample");
    }
    assert_eq!(failed(&out, 0), None);
    assert_eq!(out.gpus[0].uuid, "GPU-aaaa", "described once it works");
    assert_eq!(pids(&out), [(0, 100, Some(10 * GI)), (1, 200, Some(20 * GI))]);
}

#[test]
fn nvml_itself_gone_fails_the_whole_sample() {
    let nvml = two_gpus();
    let t0 = Instant::now();
    let mut s = sampler(&nvml, t0);
    let mut out = Snapshot::default();
    s.sample_at(t0, &mut out).expect("sample");
    nvml.with(|w| w.gpus[1].fault = Some(Fault::DriverGone));
    let error = s.sample_at(t0 + Duration::from_secs(4), &mut out).expect_err("driver gone");
    assert!(error.fatal, "{error}");
}

#[test]
fn a_list_that_fails_fails_its_gpu_only() {
    let nvml = two_gpus();
    nvml.with(|w| w.gpus[0].fault = Some(Fault::MpsListFails));
    let t0 = Instant::now();
    let mut s = sampler(&nvml, t0);
    let mut out = Snapshot::default();
    s.sample_at(t0, &mut out).expect("sample");
    let (error, _) = failed(&out, 0).expect("GPU 0 failed");
    assert_eq!(error.call, Call::MpsRunningComputeProcesses, "{error}");
    assert_eq!(pids(&out), [(1, 200, Some(20 * GI))]);
}

#[test]
fn mps_clients_are_listed_once_and_counted() {
    // As driver 580 lists them on an H100: the MPS server and its clients on the compute list, the clients
    // on the MPS list too (same figures). And a client only on the MPS list (drivers that list it there
    // alone) is still charged.
    let nvml = FakeNvml::new(vec![
        FakeGpu::new("GPU-aaaa", 80 * GI)
            .with(ProcessList::Compute, 511, Some(66 << 20))
            .with(ProcessList::Compute, 473, Some(2658 << 20))
            .with(ProcessList::Compute, 474, Some(4706 << 20))
            .with(ProcessList::Mps, 473, Some(2658 << 20))
            .with(ProcessList::Mps, 474, Some(4706 << 20))
            .with(ProcessList::Mps, 475, Some(1 << 30)),
    ]);
    let t0 = Instant::now();
    let mut s = sampler(&nvml, t0);
    let mut out = Snapshot::default();
    s.sample_at(t0, &mut out).expect("sample");
    assert_eq!(
        pids(&out),
        [(0, 511, Some(66 << 20)), (0, 473, Some(2658 << 20)), (0, 474, Some(4706 << 20)), (0, 475, Some(1 << 30))]
    );
    assert_eq!(out.readings[0].mps_clients, 3);
    let listed: u64 = out.processes.iter().map(|p| p.charged()).sum();
    assert_eq!(out.memory(0).expect("memory").used, listed, "every byte counted once");

    // A GPU without the MPS query is sampled as before.
    nvml.with(|w| {
        w.gpus[0].no_mps = true;
        w.gpus[0].processes.retain(|(l, _)| *l == ProcessList::Compute);
    });
    s.sample_at(t0 + Duration::from_secs(3), &mut out).expect("sample");
    assert_eq!(out.processes.len(), 3);
    assert_eq!(failed(&out, 0), None);
}

#[test]
fn unavailable_figures_are_kept_unknown_and_counted() {
    let nvml = FakeNvml::new(vec![
        FakeGpu::new("GPU-aaaa", 80 * GI)
            .with(ProcessList::Compute, 10, None)
            .with(ProcessList::Compute, 11, None)
            .with(ProcessList::Graphics, 11, Some(GI))
            .with(ProcessList::Compute, 12, Some(3 * GI)),
    ]);
    let t0 = Instant::now();
    let mut s = sampler(&nvml, t0);
    let mut out = Snapshot::default();
    s.sample_at(t0, &mut out).expect("sample");
    assert_eq!(pids(&out), [(0, 10, None), (0, 11, Some(GI)), (0, 12, Some(3 * GI))], "a known figure wins");
    assert_eq!(out.readings[0].unavailable, 1);
    assert_eq!(out.processes[0].charged(), 0);
}

#[test]
fn listed_struct_round_trips() {
    // The fake's lists are NVML's: a PID on two lists is one process.
    let gpu = FakeGpu::new("x", GI)
        .with(ProcessList::Compute, 1, Some(5))
        .with(ProcessList::Graphics, 1, Some(7))
        .with(ProcessList::Compute, 2, Some(1));
    assert_eq!(gpu.used(), 8);
    assert_eq!(gpu.processes[0].1, Listed { pid: 1, bytes: Some(5) });
}

mod pipeline {
    //! The whole pipeline over the fake NVML: what a failed GPU means for pods, readiness, events, metrics.

    use super::*;
    use gpubudget_agent::attribute::ProcAttributor;
    use gpubudget_agent::attribute::pods::{PodTable, PodView};
    use gpubudget_agent::attribute::procfs::write_fake_process;
    use gpubudget_agent::decide::{Action, EvictOutcome, Feedback, NodeReason, Settings};
    use gpubudget_agent::pipeline::Engine;
    use gpubudget_agent::report::metrics::Metrics;
    use gpubudget_agent::sample::{Sampler, SamplerSlot, monotonic_now};
    use gpubudget_common::GpuMemoryBudget;
    use k8s_openapi::api::core::v1::Pod;
    use prometheus_client::registry::Registry;

    const PODS: [(&str, char); 3] = [("on-0", 'a'), ("on-1", 'b'), ("on-both", 'c')];

    fn uid(c: char) -> String {
        format!("0000000{c}-0000-4000-8000-00000000000{c}")
    }

    /// Three pods over an 8 GiB Evict budget (overLimitSeconds 0): `on-0` holds 10 GiB on GPU 0, `on-1`
    /// 10 GiB on GPU 1, `on-both` 5 GiB on each (over in total, under on each GPU).
    fn node(dir: &std::path::Path) -> (FakeNvml, PodTable) {
        let mut pods = Vec::new();
        for (i, (name, c)) in PODS.iter().enumerate() {
            let cid: String = std::iter::repeat_n(*c, 64).collect();
            let cgroup = format!(
                "0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{}.slice/cri-containerd-{cid}.scope\n",
                uid(*c).replace('-', "_")
            );
            for pid in [100 + i as u32, 200 + i as u32] {
                write_fake_process(dir, pid, 1000, &cgroup).expect("fixture");
            }
            let pod: Pod = serde_yaml::from_str(&format!(
                "metadata: {{name: {name}, namespace: team-a, uid: {}, labels: {{app: llm}}}}\n\
                 spec: {{nodeName: n1, containers: [{{name: main, image: x}}]}}\n\
                 status: {{phase: Running, containerStatuses: [{{name: main, containerID: 'containerd://{cid}', image: x, imageID: x, ready: true, restartCount: 0}}]}}",
                uid(*c)
            ))
            .expect("pod");
            pods.push(pod);
        }
        let budget: GpuMemoryBudget = serde_yaml::from_str(
            "apiVersion: gpubudget.io/v1alpha1\nkind: GpuMemoryBudget\nmetadata: {name: llm, namespace: team-a, generation: 1}\n\
             spec: {selector: {matchLabels: {app: llm}}, limit: 8Gi, overLimitSeconds: 0}",
        )
        .expect("budget");
        let nvml = FakeNvml::new(vec![
            FakeGpu::new("GPU-aaaa", 80 * GI).with(ProcessList::Compute, 100, Some(10 * GI)).with(
                ProcessList::Compute,
                102,
                Some(5 * GI),
            ),
            FakeGpu::new("GPU-bbbb", 80 * GI).with(ProcessList::Compute, 201, Some(10 * GI)).with(
                ProcessList::Compute,
                202,
                Some(5 * GI),
            ),
        ]);
        (nvml, PodTable::build(pods.iter().filter_map(PodView::from_pod), &[budget], Some("n1")))
    }

    fn engine(nvml: &FakeNvml, proc_root: &std::path::Path, registry: &mut Registry) -> Engine {
        let fake = nvml.clone();
        let slot = SamplerSlot::new(Box::new(move || {
            let sampler = NvmlSampler::with_backend(fake.clone(), RefreshMode::Always, monotonic_now())?;
            Ok(Box::new(sampler) as Box<dyn Sampler>)
        }));
        Engine::new(slot, ProcAttributor::new(proc_root), Settings::new("n1"), Metrics::new(registry))
    }

    fn evicted(actions: &[Action]) -> Vec<String> {
        actions
            .iter()
            .filter_map(|a| if let Action::Evict { pod, .. } = a { Some(pod.name.to_string()) } else { None })
            .collect()
    }

    fn node_events(actions: &[Action]) -> Vec<(NodeReason, String)> {
        actions
            .iter()
            .filter_map(
                |a| if let Action::NodeEvent { reason, note } = a { Some((*reason, note.clone())) } else { None },
            )
            .collect()
    }

    fn encode(registry: &Registry) -> String {
        let mut out = String::new();
        prometheus_client::encoding::text::encode(&mut out, registry).expect("encodes");
        out
    }

    /// Runs `ticks` ticks 20 ms apart on tokio's paused clock (the engine's and the sampler's), every write and
    /// eviction answered as accepted; the actions decided.
    async fn run(engine: &mut Engine, table: &PodTable, ticks: usize) -> Vec<Action> {
        let mut all = Vec::new();
        for _ in 0..ticks {
            engine.tick(table, true);
            let actions: Vec<Action> = engine.take_actions().collect();
            for action in &actions {
                let feedback = match action {
                    Action::Apply { pod, record, .. } => {
                        Feedback::Written { uid: pod.uid.clone(), record: Some(record.clone()), ok: true }
                    }
                    Action::Evict { pod, .. } => {
                        Feedback::Evicted { uid: pod.uid.clone(), outcome: EvictOutcome::Accepted }
                    }
                    _ => continue,
                };
                engine.feedback(feedback);
            }
            all.extend(actions);
            all.extend(engine.take_actions());
            tokio::time::advance(Duration::from_millis(20)).await;
        }
        all
    }

    #[tokio::test(start_paused = true)]
    async fn nothing_is_decided_from_a_failed_gpu_and_the_others_are_enforced() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (nvml, table) = node(dir.path());
        nvml.with(|w| w.gpus[1].fault = Some(Fault::Lost));
        let mut registry = Registry::default();
        let mut engine = engine(&nvml, dir.path(), &mut registry);
        let actions = run(&mut engine, &table, 10).await;
        assert!(engine.enforcing(), "enforcing on GPU 0");
        // on-0 is over on the sampled GPU: evicted. on-1's and on-both's bytes on GPU 1 are not seen, so
        // neither is over: nothing is decided from the failed GPU.
        assert_eq!(evicted(&actions), ["on-0"]);
        let told = node_events(&actions);
        assert_eq!(told.iter().filter(|(r, _)| *r == NodeReason::GpuSampleFailed).count(), 1, "{told:?}");
        assert!(told[0].1.starts_with("GPU 1 (GPU-bbbb): sample failed"), "{}", told[0].1);
        let text = encode(&registry);
        for line in ["gpubudget_gpu_sampled{gpu=\"0\"} 1", "gpubudget_gpu_sampled{gpu=\"1\"} 0"] {
            assert!(text.contains(line), "{line} missing from\n{text}");
        }
        assert!(text.contains("gpubudget_nvml_errors_total{call=\"device_by_index\"}"), "{text}");

        // GPU 1 comes back: on-1 (10 GiB) and on-both (5 + 5 GiB, under on each GPU, over in total) are over.
        nvml.with(|w| w.gpus[1].fault = None);
        let started = tokio::time::Instant::now();
        let mut actions = Vec::new();
        while started.elapsed() < Duration::from_secs(3) && evicted(&actions).len() < 2 {
            actions.extend(run(&mut engine, &table, 1).await);
        }
        let mut back = evicted(&actions);
        back.sort();
        assert_eq!(back, ["on-1", "on-both"]);
        assert!(node_events(&actions).iter().any(|(r, _)| *r == NodeReason::GpuSampleRecovered));
        assert!(encode(&registry).contains("gpubudget_gpu_sampled{gpu=\"1\"} 1"));
    }

    #[tokio::test(start_paused = true)]
    async fn readiness_is_enforcing_on_at_least_one_gpu() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (nvml, table) = node(dir.path());
        let mut registry = Registry::default();
        let mut engine = engine(&nvml, dir.path(), &mut registry);
        assert!(!engine.enforcing(), "not before a sample");
        run(&mut engine, &table, 1).await;
        assert!(engine.enforcing());
        nvml.with(|w| w.gpus[0].fault = Some(Fault::Lost));
        run(&mut engine, &table, 1).await;
        assert!(engine.enforcing(), "one GPU left");
        nvml.with(|w| w.gpus[1].fault = Some(Fault::Lost));
        let actions = run(&mut engine, &table, 3).await;
        assert!(!engine.enforcing(), "no GPU sampled: not ready");
        assert!(evicted(&actions).is_empty());
        nvml.with(|w| w.gpus.iter_mut().for_each(|g| g.fault = None));
        let started = tokio::time::Instant::now();
        while !engine.enforcing() && started.elapsed() < Duration::from_secs(3) {
            run(&mut engine, &table, 1).await;
        }
        assert!(engine.enforcing(), "ready again once a GPU is back");
    }
}

/// #32: which processes are MPS clients is read when a process appears (never guessed from an older list), and
/// carried between lists; a GPU that answers no MPS list says nothing either way.
#[test]
fn a_process_that_appears_is_checked_against_the_mps_list_at_once() {
    let nvml = FakeNvml::new(vec![FakeGpu::new("GPU-aaaa", 80 * GI).with(ProcessList::Compute, 473, Some(GI)).with(
        ProcessList::Mps,
        473,
        Some(GI),
    )]);
    let t0 = Instant::now();
    let mut s = sampler(&nvml, t0);
    let mut out = Snapshot::default();
    let clients = |out: &Snapshot| -> Vec<(u32, Option<bool>)> {
        out.processes.iter().map(|p| (p.pid.expect("pid"), p.mps_client)).collect()
    };
    s.sample_at(t0, &mut out).expect("sample");
    assert_eq!(clients(&out), [(473, Some(true))]);
    // A process that went around the server appears on the compute list only; the next sample reads the MPS
    // list with it.
    nvml.with(|w| w.gpus[0].processes.push((ProcessList::Compute, Listed { pid: 480, bytes: Some(2 * GI) })));
    s.sample_at(t0 + Duration::from_millis(250), &mut out).expect("sample");
    assert_eq!(clients(&out), [(473, Some(true)), (480, Some(false))]);
    // A new client is not taken for one that went around it.
    nvml.with(|w| {
        w.gpus[0].processes.push((ProcessList::Compute, Listed { pid: 481, bytes: Some(GI) }));
        w.gpus[0].processes.push((ProcessList::Mps, Listed { pid: 481, bytes: Some(GI) }));
    });
    s.sample_at(t0 + Duration::from_millis(500), &mut out).expect("sample");
    assert_eq!(clients(&out), [(473, Some(true)), (480, Some(false)), (481, Some(true))]);
    // Figures move, no process comes or goes: whatever lists are read, each keeps what it is.
    nvml.with(|w| w.gpus[0].processes.iter_mut().for_each(|(_, l)| l.bytes = l.bytes.map(|b| b + GI)));
    s.sample_at(t0 + Duration::from_millis(750), &mut out).expect("sample");
    assert_eq!(clients(&out), [(473, Some(true)), (480, Some(false)), (481, Some(true))]);
    // Without the MPS query, nothing is known.
    nvml.with(|w| {
        w.gpus[0].no_mps = true;
        w.gpus[0].processes.retain(|(l, _)| *l == ProcessList::Compute);
        w.gpus[0].processes.push((ProcessList::Compute, Listed { pid: 482, bytes: Some(GI) }));
    });
    s.sample_at(t0 + Duration::from_secs(4), &mut out).expect("sample");
    assert!(out.processes.iter().all(|p| p.mps_client.is_none()), "{:?}", clients(&out));
}
