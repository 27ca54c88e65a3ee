//! The plugin's decisions and answers, called as the runtime calls them (`Plugin::create_container`); the wire
//! is gpubudget-nri's (its fake-runtime tests) and the real runtime's (e2e/cluster/nri-probe.sh,
//! e2e/cluster/runtime-caps.sh). Time runs on tokio's paused clock.

use std::collections::BTreeMap;

use gpubudget_common::GpuMemoryBudget;
use gpubudget_nri::Plugin as _;
use gpubudget_nri::api::{LinuxContainer, LinuxDevice};
use k8s_openapi::api::core::v1::Pod;

use super::*;
use crate::attribute::budgets::{BudgetIndex, ClusterIndex};
use crate::attribute::pods::PodView;

const GI: u64 = 1 << 30;

fn budget(extra: &str) -> GpuMemoryBudget {
    serde_yaml::from_str(&format!(
        "apiVersion: gpubudget.io/v1alpha1\nkind: GpuMemoryBudget\nmetadata: {{name: llm, namespace: team-a}}\n\
         spec: {{selector: {{}}, limit: 8Gi{extra}}}"
    ))
    .expect("budget")
}

/// The pod as the agent's cache has it (its spec does not matter here: the runtime's container does).
fn pod(uid: &str, extra_meta: &str) -> PodView {
    let p: Pod = serde_yaml::from_str(&format!(
        "metadata: {{name: llm-0, namespace: team-a, uid: {uid}{extra_meta}}}\nspec: {{nodeName: n1, containers: []}}"
    ))
    .expect("pod");
    PodView::from_pod(&p).expect("view")
}

fn view(pods: Vec<PodView>, budgets: &[GpuMemoryBudget], totals: &[u64]) -> View {
    let index = BudgetIndex::of(budgets);
    let table = PodTable::from_index(pods, &index, &ClusterIndex::default(), Some("n1"), totals);
    View { table: Arc::new(table), synced: true, gpus: u32::try_from(totals.len()).unwrap() }
}

fn sandbox(uid: &str) -> PodSandbox {
    PodSandbox { uid: uid.into(), name: "llm-0".into(), namespace: "team-a".into(), ..Default::default() }
}

fn container(env: &[&str], devices: &[&str]) -> Container {
    Container {
        name: "main".into(),
        env: env.iter().map(|e| (*e).to_owned()).collect(),
        linux: Some(LinuxContainer {
            devices: devices.iter().map(|p| LinuxDevice { path: (*p).into(), ..Default::default() }).collect(),
            ..Default::default()
        }),
        ..Default::default()
    }
}

fn env_of(a: &ContainerAdjustment) -> BTreeMap<String, String> {
    a.env.iter().map(|kv| (kv.key.clone(), kv.value.clone())).collect()
}

struct Rig {
    plugin: RuntimeCaps,
    publish: watch::Sender<View>,
    events: mpsc::UnboundedReceiver<Action>,
    made: Made,
}

fn rig(first: View, unresolved: Unresolved) -> Rig {
    let (publish, views) = watch::channel(first);
    let (tx, events) = mpsc::unbounded_channel();
    let made = Made::default();
    let settings = Settings { wait: Duration::from_secs(1), unresolved, mps_pipe: None };
    let plugin = RuntimeCaps::new(views, settings, RuntimeMetrics::default(), tx, made.clone());
    Rig { plugin, publish, events, made }
}

fn told(events: &mut mpsc::UnboundedReceiver<Action>) -> Vec<(Reason, String)> {
    told_on(events).into_iter().map(|(_, reason, note)| (reason, note)).collect()
}

/// The events told, each with the container it is on.
fn told_on(events: &mut mpsc::UnboundedReceiver<Action>) -> Vec<(String, Reason, String)> {
    let mut out = Vec::new();
    while let Ok(action) = events.try_recv() {
        let Action::ContainerEvent { container, reason, note, .. } = action else { panic!("{action:?}") };
        out.push((container, reason, note));
    }
    out
}

fn outcome(m: &RuntimeMetrics, outcome: &str) -> u64 {
    m.containers.get_or_create(&OutcomeLabels { outcome: outcome.into() }).get()
}

/// A pod created while the webhook was down (nothing in its spec), or whose author wrote a hostile value: the
/// container the runtime makes carries the budget's canonical caps, and the agent judges the pod by them.
#[tokio::test]
async fn a_gpu_container_gets_its_budgets_caps_whatever_the_pod_wrote() {
    let caps = budget(", admissionCaps: Enabled");
    let mut r = rig(view(vec![pod("uid-1", "")], &[caps], &[80 * GI]), Unresolved::Create);
    let hostile = container(&["NVIDIA_VISIBLE_DEVICES=0", "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=80G,1=1G"], &[]);
    let a = r.plugin.create_container(sandbox("uid-1"), hostile).await.expect("created");
    let env = env_of(&a);
    assert_eq!(
        env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"], "0=8192M",
        "an entry for a device it does not see voids the value: replaced"
    );
    assert_eq!(env["NVIDIA_GPU_MEMORY_LIMIT"], "8192");
    let events = told(&mut r.events);
    assert_eq!(events.len(), 1);
    assert_eq!(events[0].0, Reason::CappedAtCreation);
    assert!(
        events[0].1.contains("budget team-a/llm (8Gi): CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=8192M"),
        "{}",
        events[0].1
    );
    let made = r.made.lock().unwrap().get("uid-1").cloned().expect("remembered");
    assert_eq!(summary(&made), (RuntimeCapsRecord::Capped { max_mib: 8192 }, Some(MpsCap { mib: 8192, devices: 1 })));
    assert_eq!(outcome(&r.plugin.metrics, "capped"), 1);
}

/// KAI's binder hands the devices through a ConfigMap: the runtime's environment has the list; the share is a
/// fraction, which only the node can size: the cap is the share on this node's GPU.
#[tokio::test]
async fn a_fraction_is_capped_at_its_share_on_this_nodes_gpu() {
    let shares: GpuMemoryBudget = serde_yaml::from_str(
        "apiVersion: gpubudget.io/v1alpha1\nkind: GpuMemoryBudget\nmetadata: {name: shares, namespace: team-a}\n\
         spec: {selector: {}, limit: 80Gi, share: {}, admissionCaps: Enabled}",
    )
    .expect("budget");
    let kai: Pod = serde_yaml::from_str(
        "metadata: {name: llm-0, namespace: team-a, uid: uid-k, annotations: {gpu-fraction: '0.5'}}\n\
         spec: {nodeName: n1, schedulerName: kai-scheduler, containers: [{name: main, image: x}]}",
    )
    .expect("pod");
    let v = view(vec![PodView::from_pod(&kai).expect("view")], &[shares], &[80 * GI]);
    let r = rig(v, Unresolved::Create);
    let made = container(&["NVIDIA_VISIBLE_DEVICES=GPU-8a1d-0f"], &[]);
    let a = r.plugin.create_container(sandbox("uid-k"), made).await.expect("created");
    assert_eq!(env_of(&a)["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"], "0=40960M");
}

/// #51: before the node knows its GPUs' sizes a fraction is unknown, not the budget's limit: the container waits
/// (bounded) for the table that sizes it, and is capped at its share; past the wait, the administrator's choice.
#[tokio::test(start_paused = true)]
async fn a_fraction_waits_for_the_gpus_sizes_instead_of_the_limit() {
    let shares: GpuMemoryBudget = serde_yaml::from_str(
        "apiVersion: gpubudget.io/v1alpha1\nkind: GpuMemoryBudget\nmetadata: {name: shares, namespace: team-a}\n\
         spec: {selector: {}, limit: 80Gi, share: {}, admissionCaps: Enabled}",
    )
    .expect("budget");
    let kai: Pod = serde_yaml::from_str(
        "metadata: {name: llm-0, namespace: team-a, uid: uid-k, annotations: {gpu-fraction: '0.5'}}\n\
         spec: {nodeName: n1, schedulerName: kai-scheduler, containers: [{name: main, image: x}]}",
    )
    .expect("pod");
    let kai = PodView::from_pod(&kai).expect("view");
    let not_sized = view(vec![kai.clone()], std::slice::from_ref(&shares), &[]);
    let made = container(&["NVIDIA_VISIBLE_DEVICES=GPU-8a1d-0f"], &[]);
    assert!(
        matches!(decide(&not_sized, &sandbox("uid-k"), &made, None), Decision::Unknown(why) if why.contains("not known yet")),
        "not capped at the limit"
    );
    let r = rig(not_sized.clone(), Unresolved::Refuse);
    let sized = view(vec![kai], std::slice::from_ref(&shares), &[80 * GI]);
    let publish = r.publish.clone();
    tokio::spawn(async move {
        tokio::time::sleep(Duration::from_millis(400)).await;
        publish.send_replace(sized);
    });
    let started = tokio::time::Instant::now();
    let a = r.plugin.create_container(sandbox("uid-k"), made.clone()).await.expect("created");
    assert_eq!(
        (env_of(&a)["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"].as_str(), started.elapsed()),
        ("0=40960M", Duration::from_millis(400))
    );
    let r = rig(not_sized, Unresolved::Refuse);
    let refused = r.plugin.create_container(sandbox("uid-k"), made).await.expect_err("refused after the wait");
    assert!(refused.contains("the node's GPU memory is not known yet"), "{refused}");
}

/// Device nodes are what the process sees (CDI, the device plugin); a static pod is found by its mirror.
#[tokio::test]
async fn device_nodes_count_and_a_static_pod_is_found_by_its_mirror() {
    let caps = budget(", admissionCaps: Enabled");
    let mirror = pod("uid-mirror", ", annotations: {kubernetes.io/config.mirror: static-hash}");
    let r = rig(view(vec![mirror], &[caps], &[80 * GI, 80 * GI]), Unresolved::Refuse);
    let made = container(&["NVIDIA_VISIBLE_DEVICES=all"], &["/dev/nvidiactl", "/dev/nvidia0", "/dev/nvidia1"]);
    let a = r.plugin.create_container(sandbox("static-hash"), made).await.expect("created");
    assert_eq!(env_of(&a)["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"], "0=8192M,1=8192M");
}

/// What is not a GPU container, or has no budget with caps, is left exactly as it is.
#[tokio::test]
async fn no_gpu_no_budget_or_caps_off_are_left_alone() {
    let off = budget("");
    let r = rig(view(vec![pod("uid-1", "")], &[off], &[80 * GI]), Unresolved::Refuse);
    let plain = container(&["PATH=/bin", "NVIDIA_VISIBLE_DEVICES=void"], &["/dev/nvidiactl"]);
    assert_eq!(r.plugin.create_container(sandbox("uid-1"), plain).await, Ok(ContainerAdjustment::default()));
    let gpu = container(&["NVIDIA_VISIBLE_DEVICES=0", "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=1G"], &[]);
    assert_eq!(r.plugin.create_container(sandbox("uid-1"), gpu.clone()).await, Ok(ContainerAdjustment::default()));
    let r = rig(view(vec![pod("uid-1", "")], &[], &[80 * GI]), Unresolved::Refuse);
    assert_eq!(r.plugin.create_container(sandbox("uid-1"), gpu).await, Ok(ContainerAdjustment::default()));
    assert_eq!((outcome(&r.plugin.metrics, "no_budget"), outcome(&r.plugin.metrics, "unresolved_refused")), (1, 0));
}

/// A pod the agent does not know yet waits for the next table (within the wait); past it, the administrator's
/// choice: created uncapped and told, or refused with the reason.
#[tokio::test(start_paused = true)]
async fn an_unknown_pod_waits_for_its_budget_then_is_created_or_refused_as_configured() {
    let caps = budget(", admissionCaps: Enabled");
    let gpu = container(&["NVIDIA_VISIBLE_DEVICES=0"], &[]);
    // Known 300 ms later: capped.
    let r = rig(View::default(), Unresolved::Refuse);
    let later = view(vec![pod("uid-1", "")], std::slice::from_ref(&caps), &[80 * GI]);
    let publish = r.publish.clone();
    tokio::spawn(async move {
        tokio::time::sleep(Duration::from_millis(300)).await;
        publish.send_replace(later);
    });
    let started = tokio::time::Instant::now();
    let a = r.plugin.create_container(sandbox("uid-1"), gpu.clone()).await.expect("created");
    assert_eq!(
        (env_of(&a)["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"].as_str(), started.elapsed()),
        ("0=8192M", Duration::from_millis(300))
    );
    // Never known: refused after the wait, with the reason.
    let r = rig(view(vec![], std::slice::from_ref(&caps), &[80 * GI]), Unresolved::Refuse);
    let started = tokio::time::Instant::now();
    let refused = r.plugin.create_container(sandbox("uid-2"), gpu.clone()).await.expect_err("refused");
    assert_eq!(started.elapsed(), Duration::from_secs(1));
    assert!(
        refused.contains("not in the agent's table yet") && refused.contains("--runtime-caps-unresolved=refuse"),
        "{refused}"
    );
    // Or created uncapped, and told on the pod.
    let mut r = rig(View { synced: false, ..View::default() }, Unresolved::Create);
    assert_eq!(r.plugin.create_container(sandbox("uid-3"), gpu).await, Ok(ContainerAdjustment::default()));
    let events = told(&mut r.events);
    assert_eq!(events[0].0, Reason::NotCappedAtCreation);
    assert!(events[0].1.contains("caches have not synced"), "{}", events[0].1);
}

/// The containers the runtime lists when the agent (re)connects are judged as they are: one made uncapped while the
/// agent was away makes its pod uncapped, whatever its other containers got.
#[tokio::test]
async fn containers_made_while_the_agent_was_away_are_judged_as_they_are() {
    let caps = budget(", admissionCaps: Enabled");
    let mut r = rig(view(vec![pod("uid-1", "")], &[caps], &[80 * GI]), Unresolved::Create);
    let mut away = container(&["NVIDIA_VISIBLE_DEVICES=0"], &[]);
    away.name = "sidecar".into();
    away.pod_sandbox_id = "sb-1".into();
    // One made capped by an earlier run of the agent: nothing to tell.
    let mut before = container(&["NVIDIA_VISIBLE_DEVICES=0", "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=8192M"], &[]);
    before.name = "before".into();
    before.pod_sandbox_id = "sb-1".into();
    let sandbox = PodSandbox { id: "sb-1".into(), ..sandbox("uid-1") };
    assert!(r.plugin.synchronize(vec![sandbox.clone()], vec![away, before]).await.is_empty());
    // #53: the uncapped one is told on its container, where users look, not only in the record.
    let told = told_on(&mut r.events);
    assert_eq!(told.len(), 1, "{told:?}");
    assert_eq!((told[0].0.as_str(), told[0].1), ("sidecar", Reason::NotCappedAtCreation));
    assert!(told[0].2.starts_with("container sidecar was made while the agent was not connected"), "{}", told[0].2);
    let later = container(&["NVIDIA_VISIBLE_DEVICES=0"], &[]);
    r.plugin.create_container(sandbox, later).await.expect("created");
    let made = r.made.lock().unwrap().get("uid-1").cloned().expect("remembered");
    let (record, cap) = summary(&made);
    assert_eq!(cap, None, "not every GPU container is capped: no cap for the pod");
    let RuntimeCapsRecord::Uncapped(why) = record else { panic!("{record:?}") };
    assert!(why.starts_with("container sidecar: no CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"), "{why}");
}

/// #53: a pod with several GPU containers gets one event per container, each naming its own caps (an init
/// container's cap no longer hides the main container's: the events API groups a pod's events by reason).
#[tokio::test]
async fn each_gpu_container_is_told_on_itself_with_its_own_caps() {
    let caps = budget(", admissionCaps: Enabled");
    let mut r = rig(view(vec![pod("uid-1", "")], &[caps], &[80 * GI, 80 * GI]), Unresolved::Create);
    let mut g1 = container(&["NVIDIA_VISIBLE_DEVICES=0"], &[]);
    g1.name = "g1".into();
    let mut g2 = container(&["NVIDIA_VISIBLE_DEVICES=0,1"], &[]);
    g2.name = "g2".into();
    r.plugin.create_container(sandbox("uid-1"), g1).await.expect("created");
    r.plugin.create_container(sandbox("uid-1"), g2).await.expect("created");
    let told = told_on(&mut r.events);
    let on: Vec<(&str, Reason)> = told.iter().map(|(c, reason, _)| (c.as_str(), *reason)).collect();
    assert_eq!(on, [("g1", Reason::CappedAtCreation), ("g2", Reason::CappedAtCreation)]);
    assert!(told[0].2.contains("container g1 capped") && told[0].2.contains("=0=8192M "), "{}", told[0].2);
    assert!(told[1].2.contains("container g2 capped") && told[1].2.contains("=0=8192M,1=8192M "), "{}", told[1].2);
}
