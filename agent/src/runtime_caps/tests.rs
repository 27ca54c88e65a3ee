//! The decisions and answers, called as the relay calls them (create, then the runtime's confirmation); the
//! relay and the channel between them over a real unix socket pair (their own tests below); the NRI wire is
//! gpubudget-nri's (its fake-runtime tests) and the real runtime's (e2e/cluster/nri-probe.sh,
//! e2e/cluster/runtime-caps.sh). Time runs on tokio's paused clock.

use std::collections::BTreeMap;

use gpubudget_common::GpuMemoryBudget;
use gpubudget_common::caps::Uncapped;
use gpubudget_common::pod_record::RuntimeCapsRecord;
use gpubudget_nri::Plugin as _;
use gpubudget_nri::api::{LinuxContainer, LinuxDevice};
use k8s_openapi::api::core::v1::Pod;

use super::*;
use crate::attribute::budgets::{BudgetIndex, ClusterIndex};
use crate::attribute::pods::{MpsCap, PodView};

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

const WAIT: Duration = Duration::from_secs(1);

/// The environment the runtime makes `env` with after `a` (a removal is `-NAME`; a set replaces every entry).
fn applied(env: &[String], a: &ContainerAdjustment) -> Vec<String> {
    let touched = |kv: &String| {
        let key = kv.split_once('=').map_or(kv.as_str(), |(k, _)| k);
        a.env.iter().any(|e| e.key.trim_start_matches('-') == key)
    };
    let mut out: Vec<String> = env.iter().filter(|kv| !touched(kv)).cloned().collect();
    out.extend(a.env.iter().filter(|e| !e.key.starts_with('-')).map(|e| format!("{}={}", e.key, e.value)));
    out
}

/// A container made as the runtime makes it: asked, the answer applied, then shown made (`PostCreateContainer`).
async fn make(plugin: &RuntimeCaps, pod: PodSandbox, mut c: Container) -> Result<ContainerAdjustment, String> {
    if c.id.is_empty() {
        c.id = format!("id-{}", c.name);
    }
    let a = plugin.create(&pod, &c, WAIT).await?;
    c.env = applied(&c.env, &a);
    plugin.created(&pod, &c).await;
    Ok(a)
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
    let never_refuse = "kube-system".parse().expect("namespaces");
    let settings = Settings { wait: Duration::from_secs(1), unresolved, mps_pipe: None, never_refuse };
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

fn outcome(m: &RuntimeMetrics, outcome: Outcome) -> u64 {
    m.containers.get_or_create(&OutcomeLabels { outcome }).get()
}

/// A pod created while the webhook was down (nothing in its spec), or whose author wrote a hostile value: the
/// container the runtime makes carries the budget's canonical caps, and the agent judges the pod by them.
#[tokio::test]
async fn a_gpu_container_gets_its_budgets_caps_whatever_the_pod_wrote() {
    let caps = budget(", admissionCaps: Enabled");
    let mut r = rig(view(vec![pod("uid-1", "")], &[caps], &[80 * GI]), Unresolved::Create);
    let hostile = container(&["NVIDIA_VISIBLE_DEVICES=0", "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=80G,1=1G"], &[]);
    let a = make(&r.plugin, sandbox("uid-1"), hostile).await.expect("created");
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
    assert_eq!(
        r.made.summary("uid-1").expect("remembered"),
        (RuntimeCapsRecord::capped([("main".to_owned(), 8192)]), Some(MpsCap { mib: 8192, devices: 1 }))
    );
    assert_eq!(outcome(&r.plugin.metrics, Outcome::Capped), 1);
}

/// A budget taking each pod's share, and a KAI pod at `gpu-fraction` 0.5 (uid `uid-k`).
fn kai_half() -> (GpuMemoryBudget, PodView) {
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
    (shares, PodView::from_pod(&kai).expect("view"))
}

/// KAI's binder hands the devices through a ConfigMap: the runtime's environment has the list; the share is a
/// fraction, which only the node can size: the cap is the share on this node's GPU.
#[tokio::test]
async fn a_fraction_is_capped_at_its_share_on_this_nodes_gpu() {
    let (shares, kai) = kai_half();
    let v = view(vec![kai], &[shares], &[80 * GI]);
    let r = rig(v, Unresolved::Create);
    let made = container(&["NVIDIA_VISIBLE_DEVICES=GPU-8a1d-0f"], &[]);
    let a = make(&r.plugin, sandbox("uid-k"), made).await.expect("created");
    assert_eq!(env_of(&a)["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"], "0=40960M");
}

/// #51: before the node knows its GPUs' sizes a fraction is unknown, not the budget's limit: the container waits
/// (bounded) for the table that sizes it, and is capped at its share; past the wait, the administrator's choice.
#[tokio::test(start_paused = true)]
async fn a_fraction_waits_for_the_gpus_sizes_instead_of_the_limit() {
    let (shares, kai) = kai_half();
    let not_sized = view(vec![kai.clone()], std::slice::from_ref(&shares), &[]);
    let made = container(&["NVIDIA_VISIBLE_DEVICES=GPU-8a1d-0f"], &[]);
    assert!(
        matches!(decide(&not_sized, &sandbox("uid-k"), &made, None), Decision::Unknown(NotKnown::ShareNotSized { .. })),
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
    let a = make(&r.plugin, sandbox("uid-k"), made.clone()).await.expect("created");
    assert_eq!(
        (env_of(&a)["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"].as_str(), started.elapsed()),
        ("0=40960M", Duration::from_millis(400))
    );
    let r = rig(not_sized, Unresolved::Refuse);
    let refused = make(&r.plugin, sandbox("uid-k"), made).await.expect_err("refused after the wait");
    assert!(refused.contains("the node's GPU memory is not known yet"), "{refused}");
}

/// Device nodes are what the process sees (CDI, the device plugin); a static pod is found by its mirror.
#[tokio::test]
async fn device_nodes_count_and_a_static_pod_is_found_by_its_mirror() {
    let caps = budget(", admissionCaps: Enabled");
    let mirror = pod("uid-mirror", ", annotations: {kubernetes.io/config.mirror: static-hash}");
    let r = rig(view(vec![mirror], &[caps], &[80 * GI, 80 * GI]), Unresolved::Refuse);
    let made = container(&["NVIDIA_VISIBLE_DEVICES=all"], &["/dev/nvidiactl", "/dev/nvidia0", "/dev/nvidia1"]);
    let a = make(&r.plugin, sandbox("static-hash"), made).await.expect("created");
    assert_eq!(env_of(&a)["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"], "0=8192M,1=8192M");
}

/// What is not a GPU container, or has no budget with caps, is left exactly as it is.
#[tokio::test]
async fn no_gpu_no_budget_or_caps_off_are_left_alone() {
    let off = budget("");
    let r = rig(view(vec![pod("uid-1", "")], &[off], &[80 * GI]), Unresolved::Refuse);
    let plain = container(&["PATH=/bin", "NVIDIA_VISIBLE_DEVICES=void"], &["/dev/nvidiactl"]);
    assert_eq!(make(&r.plugin, sandbox("uid-1"), plain).await, Ok(ContainerAdjustment::default()));
    let gpu = container(&["NVIDIA_VISIBLE_DEVICES=0", "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=1G"], &[]);
    assert_eq!(make(&r.plugin, sandbox("uid-1"), gpu.clone()).await, Ok(ContainerAdjustment::default()));
    let r = rig(view(vec![pod("uid-1", "")], &[], &[80 * GI]), Unresolved::Refuse);
    assert_eq!(make(&r.plugin, sandbox("uid-1"), gpu).await, Ok(ContainerAdjustment::default()));
    assert_eq!(
        (outcome(&r.plugin.metrics, Outcome::NoBudget), outcome(&r.plugin.metrics, Outcome::UnresolvedRefused)),
        (1, 0)
    );
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
    let a = make(&r.plugin, sandbox("uid-1"), gpu.clone()).await.expect("created");
    assert_eq!(
        (env_of(&a)["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"].as_str(), started.elapsed()),
        ("0=8192M", Duration::from_millis(300))
    );
    // Never known: refused after the wait, with the reason.
    let r = rig(view(vec![], std::slice::from_ref(&caps), &[80 * GI]), Unresolved::Refuse);
    let started = tokio::time::Instant::now();
    let refused = make(&r.plugin, sandbox("uid-2"), gpu.clone()).await.expect_err("refused");
    assert_eq!(started.elapsed(), Duration::from_secs(1));
    assert!(
        refused.contains("not in the agent's table yet") && refused.contains("--runtime-caps-unresolved=refuse"),
        "{refused}"
    );
    // Or created uncapped, and told on the pod.
    let mut r = rig(View { synced: false, ..View::default() }, Unresolved::Create);
    assert_eq!(make(&r.plugin, sandbox("uid-3"), gpu).await, Ok(ContainerAdjustment::default()));
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
    for c in [away, before] {
        r.plugin.existing(&sandbox, &c).await;
    }
    // #53: the uncapped one is told on its container, where users look, not only in the record.
    let told = told_on(&mut r.events);
    assert_eq!(told.len(), 1, "{told:?}");
    assert_eq!((told[0].0.as_str(), told[0].1), ("sidecar", Reason::NotCappedAtCreation));
    assert!(told[0].2.starts_with("container sidecar was made while the agent was not connected"), "{}", told[0].2);
    let later = container(&["NVIDIA_VISIBLE_DEVICES=0"], &[]);
    make(&r.plugin, sandbox, later).await.expect("created");
    let (record, cap) = r.made.summary("uid-1").expect("remembered");
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
    make(&r.plugin, sandbox("uid-1"), g1).await.expect("created");
    make(&r.plugin, sandbox("uid-1"), g2).await.expect("created");
    let told = told_on(&mut r.events);
    let on: Vec<(&str, Reason)> = told.iter().map(|(c, reason, _)| (c.as_str(), *reason)).collect();
    assert_eq!(on, [("g1", Reason::CappedAtCreation), ("g2", Reason::CappedAtCreation)]);
    assert!(told[0].2.contains("container g1 capped") && told[0].2.contains("=0=8192M "), "{}", told[0].2);
    assert!(told[1].2.contains("container g2 capped") && told[1].2.contains("=0=8192M,1=8192M "), "{}", told[1].2);
}

/// #53: a container counts capped only once the runtime shows the container it made with the caps; one the runtime
/// made without them (it dropped the answer: past its deadline, another plugin's conflict) is told uncapped.
#[tokio::test]
async fn capped_is_what_the_runtime_made_not_what_was_asked() {
    let caps = budget(", admissionCaps: Enabled");
    let mut r = rig(view(vec![pod("uid-1", "")], &[caps], &[80 * GI]), Unresolved::Create);
    let mut c = container(&["NVIDIA_VISIBLE_DEVICES=0"], &[]);
    c.id = "ctr-1".into();
    let a = r.plugin.create(&sandbox("uid-1"), &c, WAIT).await.expect("answered");
    assert!(env_of(&a).contains_key("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"));
    // Asked, not yet shown made: uncapped, unconfirmed; nothing told yet.
    let (record, cap) = r.made.summary("uid-1").expect("remembered");
    assert_eq!(record, RuntimeCapsRecord::uncapped(format!("container main: {}", Uncapped::Unconfirmed)));
    assert_eq!(cap, None);
    assert!(told(&mut r.events).is_empty(), "nothing told before the runtime shows the container");
    // The runtime made it as it was (the adjustment not applied).
    r.plugin.created(&sandbox("uid-1"), &c).await;
    let events = told(&mut r.events);
    assert_eq!(events.len(), 1);
    assert_eq!(events[0].0, Reason::NotCappedAtCreation);
    assert!(events[0].1.contains("the runtime made it without the caps it was given"), "{}", events[0].1);
    let (record, cap) = r.made.summary("uid-1").expect("remembered");
    assert!(matches!(record, RuntimeCapsRecord::Uncapped(_)) && cap.is_none(), "{record:?}");
}

/// What is told from what was asked and what the runtime made (pure).
#[test]
fn confirmation_tells_what_the_runtime_made() {
    let capped = ContainerCap::Capped { max_mib: 8192 };
    let uncapped = ContainerCap::Uncapped(Uncapped::NoMps);
    let env = ["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=8192M".to_owned(), "PATH=/bin".to_owned()];
    let asked = || Some(Expect::Capped { how: "budget a/b (8Gi)".into() });
    let (reason, note) = confirmation("main", &env, asked(), capped, &Decision::NoBudget).expect("told");
    assert_eq!(reason, Reason::CappedAtCreation);
    assert!(note.ends_with("budget a/b (8Gi): CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=8192M"), "{note}");
    assert_eq!(
        confirmation("main", &env, asked(), uncapped, &Decision::NoBudget).map(|t| t.0),
        Some(Reason::NotCappedAtCreation)
    );
    let note = Some(Expect::Uncapped { note: "why".into() });
    assert_eq!(
        confirmation("main", &env, note, capped, &Decision::NoBudget),
        Some((Reason::NotCappedAtCreation, "why".into()))
    );
    // Not asked (the relay answered alone): told only where a budget sets caps.
    assert_eq!(confirmation("main", &env, None, uncapped, &Decision::NoBudget), None);
    assert_eq!(confirmation("main", &env, None, uncapped, &Decision::CapsOff), None);
}

mod relay {
    //! The relay and the agent's channel, over real unix sockets (a pair, or a listener in a temporary directory).

    use super::*;
    use crate::runtime_caps::relay::{Relay, RelayPlugin, RelaySettings, Unanswered};
    use crate::runtime_caps::wire::{Call, Ctr, Pod, Response};
    use futures::StreamExt as _;
    use gpubudget_nri::api;
    use tokio::io::AsyncWriteExt as _;
    use tokio::net::UnixStream;
    use tokio_util::codec::{FramedRead, LinesCodec};
    use tokio_util::sync::CancellationToken;

    fn relay(unresolved: Unresolved) -> Arc<Relay> {
        Arc::new(Relay::new(RelaySettings {
            unresolved,
            never_refuse: "gpubudget".parse().expect("ns"),
            agent_uid: None,
        }))
    }

    fn gpu(name: &str, env: &[&str]) -> Container {
        let mut c = container(env, &[]);
        c.name = name.into();
        c.id = format!("id-{name}");
        c.env.push("DB_PASSWORD=hunter2".into());
        c
    }

    /// A connected agent: the relay on one end of a socket pair, the agent's channel on the other.
    async fn connected(relay: &Arc<Relay>, caps: Arc<RuntimeCaps>) -> CancellationToken {
        let (a, b) = UnixStream::pair().expect("pair");
        tokio::spawn(relay.clone().attach(a));
        let stop = CancellationToken::new();
        let s = stop.clone();
        tokio::spawn(async move { channel::serve(b, caps, &s).await });
        while !relay.connected() {
            tokio::task::yield_now().await;
        }
        stop
    }

    #[tokio::test]
    async fn the_runtime_gets_the_agents_caps_through_the_relay_and_the_agent_sees_no_secret() {
        let caps = budget(", admissionCaps: Enabled");
        let mut r = rig(view(vec![pod("uid-1", "")], &[caps], &[80 * GI]), Unresolved::Create);
        let made = r.made.clone();
        let relay = relay(Unresolved::Refuse);
        let _stop = connected(&relay, Arc::new(r.plugin)).await;
        let plugin = RelayPlugin(relay.clone());
        let c = gpu("main", &["NVIDIA_VISIBLE_DEVICES=0", "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=80G"]);
        let a = plugin.create_container(sandbox("uid-1"), c.clone()).await.expect("created");
        assert_eq!(env_of(&a)["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"], "0=8192M");
        // The runtime shows the container made: the agent confirms it and tells it.
        let mut shown = c.clone();
        shown.env = applied(&c.env, &a);
        let event = api::StateChangeEvent {
            event: api::Event::PostCreateContainer as i32,
            pod: Some(sandbox("uid-1")),
            container: Some(shown),
        };
        plugin.state_change(event).await;
        let action = r.events.recv().await.expect("told");
        let Action::ContainerEvent { reason, note, .. } = action else { panic!("{action:?}") };
        assert_eq!(reason, Reason::CappedAtCreation);
        assert!(!note.contains("hunter2"), "{note}");
        assert_eq!(made.summary("uid-1").map(|s| s.0), Some(RuntimeCapsRecord::capped([("main".to_owned(), 8192)])));
        // A container that sees no GPU is answered without asking.
        let plain = container(&["PATH=/bin"], &[]);
        assert_eq!(plugin.create_container(sandbox("uid-1"), plain).await, Ok(ContainerAdjustment::default()));
    }

    /// Without an agent, or with one past the deadline, a GPU container gets the administrator's choice; a container
    /// without a GPU never is refused.
    #[tokio::test(start_paused = true)]
    async fn no_agent_or_a_late_one_gets_the_unresolved_choice() {
        let c = gpu("main", &["NVIDIA_VISIBLE_DEVICES=0"]);
        let refuse = RelayPlugin(relay(Unresolved::Refuse));
        let why = refuse.create_container(sandbox("uid-1"), c.clone()).await.expect_err("refused");
        assert!(why.contains("not connected") && why.contains("refuse"), "{why}");
        let plain = container(&["PATH=/bin"], &[]);
        assert_eq!(refuse.create_container(sandbox("uid-1"), plain).await, Ok(ContainerAdjustment::default()));
        let create = RelayPlugin(relay(Unresolved::Create));
        assert_eq!(create.create_container(sandbox("uid-1"), c.clone()).await, Ok(ContainerAdjustment::default()));
        // An agent that never answers: the relay answers the runtime before the runtime's deadline (2 s).
        let relay = relay(Unresolved::Refuse);
        let (a, _silent) = UnixStream::pair().expect("pair");
        tokio::spawn(relay.clone().attach(a));
        while !relay.connected() {
            tokio::task::yield_now().await;
        }
        let started = tokio::time::Instant::now();
        let why = RelayPlugin(relay.clone()).create_container(sandbox("uid-1"), c).await.expect_err("refused");
        assert_eq!(started.elapsed(), Duration::from_millis(1750), "the runtime's 2 s less the relay's margin");
        assert!(why.contains(&Unanswered::Late(Duration::from_millis(1750)).to_string()), "{why}");
    }

    /// The release's own pods (the agent sees every GPU) and the critical namespaces are never refused, or no agent
    /// could ever start under `refuse`.
    #[tokio::test]
    async fn the_agent_itself_is_never_refused() {
        let refuse = RelayPlugin(relay(Unresolved::Refuse));
        let mut agent = sandbox("uid-agent");
        agent.namespace = "gpubudget".into();
        let c = gpu("agent", &["NVIDIA_VISIBLE_DEVICES=all"]);
        assert_eq!(refuse.create_container(agent, c.clone()).await, Ok(ContainerAdjustment::default()));
        assert!(refuse.create_container(sandbox("uid-1"), c).await.is_err(), "any other namespace is refused");
    }

    /// The agent stopped while a container was made (the relay answered alone), then resumed: it handles the late
    /// creation and the runtime's showing at once, in either order, and tells the container uncapped.
    #[tokio::test(start_paused = true)]
    async fn a_container_made_while_the_agent_hung_is_told_when_it_resumes() {
        let caps = budget(", admissionCaps: Enabled");
        let mut r = rig(view(vec![], std::slice::from_ref(&caps), &[80 * GI]), Unresolved::Create);
        let c = gpu("main", &["NVIDIA_VISIBLE_DEVICES=0"]);
        let (pod, wire_c) = (Pod::of(&sandbox("uid-1")), Ctr::of(&c).expect("gpu"));
        let plugin = Arc::new(r.plugin);
        // The pod reaches the agent's table only after it resumes.
        let publish = r.publish.clone();
        let later = view(vec![super::pod("uid-1", "")], std::slice::from_ref(&caps), &[80 * GI]);
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(200)).await;
            publish.send_replace(later);
        });
        let create =
            channel::answer(&plugin, Call::Create { pod: pod.clone(), container: wire_c.clone(), wait_ms: 1500 });
        let created = channel::answer(&plugin, Call::Created { pod, container: wire_c });
        let (_late, _) = tokio::join!(create, created);
        let told = told_on(&mut r.events);
        assert_eq!(told.len(), 1, "{told:?}");
        assert_eq!((told[0].0.as_str(), told[0].1), ("main", Reason::NotCappedAtCreation));
        let (record, _) = r.made.summary("uid-1").expect("remembered");
        let RuntimeCapsRecord::Uncapped(why) = record else { panic!("{record:?}") };
        assert!(
            why.contains("no CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"),
            "what the runtime made, not the late answer: {why}"
        );
    }

    /// A compromised agent can set a GPU container's caps or refuse it, nothing else: an answer naming any other
    /// variable is not passed to the runtime.
    #[tokio::test]
    async fn an_answer_beyond_the_caps_never_reaches_the_runtime() {
        let relay = relay(Unresolved::Create);
        let (a, b) = UnixStream::pair().expect("pair");
        tokio::spawn(relay.clone().attach(a));
        tokio::spawn(async move {
            let (rd, mut wr) = b.into_split();
            let mut lines = FramedRead::new(rd, LinesCodec::new());
            while let Some(Ok(line)) = lines.next().await {
                let req: wire::Request = serde_json::from_str(&line).expect("request");
                let answer =
                    wire::Answer::Adjust { set: vec![("LD_PRELOAD".into(), "/evil.so".into())], remove: vec![] };
                let mut out = serde_json::to_string(&Response { id: req.id, answer }).expect("json");
                out.push('\n');
                wr.write_all(out.as_bytes()).await.expect("write");
            }
        });
        while !relay.connected() {
            tokio::task::yield_now().await;
        }
        let c = gpu("main", &["NVIDIA_VISIBLE_DEVICES=0"]);
        let a = RelayPlugin(relay).create_container(sandbox("uid-1"), c).await.expect("created, unadjusted");
        assert_eq!(a, ContainerAdjustment::default());
    }

    /// The GPU containers the runtime made while no agent was connected are handed to the agent when it connects,
    /// and the uncapped ones told.
    #[tokio::test]
    async fn containers_made_without_the_agent_are_told_when_it_connects() {
        let caps = budget(", admissionCaps: Enabled");
        let mut r = rig(view(vec![pod("uid-1", "")], &[caps], &[80 * GI]), Unresolved::Create);
        let relay = relay(Unresolved::Create);
        let plugin = RelayPlugin(relay.clone());
        let c = gpu("late", &["NVIDIA_VISIBLE_DEVICES=0"]);
        assert_eq!(plugin.create_container(sandbox("uid-1"), c.clone()).await, Ok(ContainerAdjustment::default()));
        let event = api::StateChangeEvent {
            event: api::Event::PostCreateContainer as i32,
            pod: Some(sandbox("uid-1")),
            container: Some(c.clone()),
        };
        plugin.state_change(event).await;
        let _stop = connected(&relay, Arc::new(r.plugin)).await;
        let action = r.events.recv().await.expect("told");
        let Action::ContainerEvent { container, reason, note, .. } = action else { panic!("{action:?}") };
        assert_eq!((container.as_str(), reason), ("late", Reason::NotCappedAtCreation));
        assert!(note.contains("was made while the agent was not connected"), "{note}");
        // Removed containers are not handed over again.
        let removed = api::StateChangeEvent {
            event: api::Event::RemoveContainer as i32,
            pod: Some(sandbox("uid-1")),
            container: Some(c),
        };
        plugin.state_change(removed).await;
        let call = Call::Existing { pod: Pod::default(), container: Ctr::default() };
        assert!(matches!(relay.ask(call, Duration::from_secs(1)).await, Ok(wire::Answer::Done)));
    }

    /// The relay's socket admits the agent's user only, with mode 0660.
    #[tokio::test]
    async fn the_socket_is_the_relays_and_its_groups() {
        use std::os::unix::fs::PermissionsExt as _;
        let dir = tempfile::tempdir().expect("dir");
        let path = dir.path().join("runtime-caps.sock");
        std::fs::write(&path, b"stale").expect("stale file");
        let listener = crate::runtime_caps::relay::bind(&path).expect("bound over a stale file");
        assert_eq!(std::fs::metadata(&path).expect("socket").permissions().mode() & 0o777, 0o660);
        let me = {
            use std::os::unix::fs::MetadataExt as _;
            std::fs::metadata(&path).expect("socket").uid()
        };
        let stop = CancellationToken::new();
        let only = |uid| {
            let never_refuse = Default::default();
            Arc::new(Relay::new(RelaySettings { unresolved: Unresolved::Create, never_refuse, agent_uid: Some(uid) }))
        };
        let (other, mine) = (only(me.wrapping_add(1)), only(me));
        tokio::spawn(other.clone().serve_agents(listener, stop.clone()));
        let _refused = UnixStream::connect(&path).await.expect("connect");
        let path2 = dir.path().join("mine.sock");
        let listener = crate::runtime_caps::relay::bind(&path2).expect("bound");
        tokio::spawn(mine.clone().serve_agents(listener, stop.clone()));
        let _admitted = UnixStream::connect(&path2).await.expect("connect");
        while !mine.connected() {
            tokio::task::yield_now().await;
        }
        assert!(!other.connected(), "a connection from another user is refused");
        stop.cancel();
    }
}
