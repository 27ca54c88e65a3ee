use super::*;
use proptest::prelude::*;

fn budget(limit: &str, request: Option<&str>, caps: bool) -> Budget {
    let request = request.map(|r| format!(", request: {r}")).unwrap_or_default();
    let caps = if caps { ", admissionCaps: Enabled" } else { "" };
    let spec = serde_yaml::from_str(&format!("{{selector: {{}}, limit: {limit}{request}{caps}}}")).expect("spec");
    Budget::from_spec("team-a", "llm", &spec).expect("valid")
}

fn pod(yaml: &str) -> Pod {
    serde_yaml::from_str(yaml).expect("pod fixture")
}

fn apply(pod: &Pod, patch: &[Value]) -> Pod {
    let mut doc = serde_json::to_value(pod).expect("json");
    let patch: json_patch::Patch = serde_json::from_value(Value::Array(patch.to_vec())).expect("patch");
    json_patch::patch(&mut doc, &patch).expect("patch applies");
    serde_json::from_value(doc).expect("still a pod")
}

fn env_of(pod: &Pod, container: usize) -> Vec<(String, String)> {
    pod.spec.as_ref().expect("spec").containers[container]
        .env
        .iter()
        .flatten()
        .map(|e| (e.name.clone(), e.value.clone().unwrap_or_else(|| "<from>".into())))
        .collect()
}

/// Whole GPUs: `nvidia.com/gpu: n` as `n` devices needs a node that does not share them.
fn whole(n: u64) -> GpuLimits {
    GpuLimits { count: n, replicas: None }
}

const TWO_CONTAINERS: &str = r#"
metadata: {generateName: trainer-, namespace: team-a, labels: {app: llm}}
spec:
  nodeSelector: {nvidia.com/gpu.sharing-strategy: none}
  containers:
  - name: main
    image: pytorch
    resources: {limits: {nvidia.com/gpu: "2", memory: 8Gi}}
    env:
    - {name: OTHER, value: x}
    - {name: CUDA_MPS_PINNED_DEVICE_MEM_LIMIT, value: "0=4G,1=99G"}
  - name: sidecar
    image: logger
    resources: {limits: {memory: 1Gi}}
    env: [{name: NVIDIA_GPU_MEMORY_LIMIT, value: "999999"}]
"#;

#[test]
fn gpu_containers_are_those_with_a_positive_gpu_limit() {
    let count = |pairs: &[(&str, &str)]| limit_devices(pairs.iter().copied());
    assert_eq!(count(&[("nvidia.com/gpu", "2"), ("memory", "8Gi")]), 2);
    assert_eq!(count(&[("nvidia.com/gpu.shared", "1")]), 1);
    assert_eq!(count(&[("nvidia.com/mig-1g.10gb", "2"), ("nvidia.com/gpu", "1")]), 3, "MIG devices count");
    assert_eq!(count(&[("nvidia.com/mig-", "1")]), 0);
    assert_eq!(count(&[("nvidia.com/gpu", "0")]), 0);
    assert_eq!(count(&[("nvidia.com/gpu", "lots")]), 0);
    assert_eq!(count(&[("amd.com/gpu", "1")]), 0);
    assert_eq!(devices(whole(100_000), None, false), Some(Devices::Unknown(Unknown::TooMany)));
    let p = pod(TWO_CONTAINERS);
    let found = gpu_containers(&p);
    assert_eq!(found.len(), 1);
    assert_eq!((found[0].path.as_str(), found[0].gpu.devices), ("/spec/containers/0", Devices::Known(2)));
    assert_eq!(found[0].gpu.mps_limit, Some(EnvValue::Literal("0=4G,1=99G".into())));
}

/// #32 item 3: every way a container gets a GPU, and when the number of devices it sees is known.
#[test]
fn every_way_to_a_gpu_and_its_device_count() {
    let lit = |v: &str| EnvValue::Literal(v.into());
    let unknown = |why| Some(Devices::Unknown(why));
    // NVIDIA_VISIBLE_DEVICES without a limit.
    assert_eq!(devices(whole(0), Some(&lit("0,1")), false), Some(Devices::Known(2)));
    assert_eq!(devices(whole(0), Some(&lit("GPU-8d4c9c1e-aaaa")), false), Some(Devices::Known(1)));
    assert_eq!(devices(whole(0), Some(&lit("MIG-0a1b-2c,MIG-GPU-1234/1/0")), false), Some(Devices::Known(2)));
    assert_eq!(devices(whole(0), Some(&lit("all")), false), unknown(Unknown::All));
    for none in ["", "none", "void"] {
        assert_eq!(devices(whole(0), Some(&lit(none)), false), None, "{none:?}");
    }
    assert_eq!(devices(whole(0), Some(&EnvValue::FromSource), false), unknown(Unknown::VisibleFromSource));
    assert_eq!(devices(whole(0), Some(&lit("0,GPU-12")), false), unknown(Unknown::VisibleMixed));
    assert_eq!(devices(whole(0), Some(&lit("0,0")), false), unknown(Unknown::VisibleMixed));
    assert_eq!(devices(whole(0), Some(&lit("ALL")), false), unknown(Unknown::VisibleUnreadable));
    assert_eq!(devices(whole(0), Some(&lit(" 0")), false), unknown(Unknown::VisibleUnreadable));
    assert_eq!(devices(whole(0), Some(&lit(&"0,".repeat(100_000))), false), unknown(Unknown::VisibleUnreadable));
    // With a limit: the list must agree, `all` never does (1 limit + all must not be capped on device 0 only).
    assert_eq!(devices(whole(1), Some(&lit("all")), false), unknown(Unknown::All));
    assert_eq!(devices(whole(1), Some(&lit("GPU-1")), false), Some(Devices::Known(1)));
    assert_eq!(devices(whole(1), Some(&lit("0,1")), false), unknown(Unknown::Disagree { limits: 1, listed: 2 }));
    assert_eq!(
        devices(whole(2), Some(&lit("none")), false),
        Some(Devices::Known(2)),
        "the device plugin's list decides"
    );
    // A DRA claim: unknown, whatever else.
    assert_eq!(devices(whole(0), None, true), unknown(Unknown::Claim));
    assert_eq!(devices(whole(1), None, true), unknown(Unknown::Claim));
    assert_eq!(devices(whole(0), None, false), None);

    let p = pod(r#"
metadata: {name: p, namespace: team-a}
spec:
  resourceClaims: [{name: gpus, resourceClaimTemplateName: one-gpu}]
  containers:
  - {name: mig, resources: {limits: {nvidia.com/mig-1g.10gb: "1"}}}
  - {name: env, env: [{name: NVIDIA_VISIBLE_DEVICES, value: "0,1"}]}
  - {name: dra, resources: {claims: [{name: gpus}]}}
  - {name: cpu, env: [{name: NVIDIA_VISIBLE_DEVICES, value: none}]}
  ephemeralContainers:
  - {name: debug, image: cuda, env: [{name: NVIDIA_VISIBLE_DEVICES, value: all}]}
"#);
    let all = gpu_containers(&p);
    let found: Vec<(&str, Kind, Devices)> = all.iter().map(|f| (f.gpu.name.as_str(), f.kind, f.gpu.devices)).collect();
    assert_eq!(
        found,
        [
            ("mig", Kind::Main, Devices::Known(1)),
            ("env", Kind::Main, Devices::Known(2)),
            ("dra", Kind::Main, Devices::Unknown(Unknown::Claim)),
            ("debug", Kind::Ephemeral, Devices::Unknown(Unknown::All)),
        ]
    );
}

#[test]
fn caps_are_whole_mib_rounded_down_and_need_the_opt_in() {
    assert_eq!(Caps::of(&budget("8Gi", Some("6Gi"), true)), Some(Caps { limit_mib: 8192, request_mib: Some(6144) }));
    assert_eq!(Caps::of(&budget("8G", None, true)), Some(Caps { limit_mib: 7629, request_mib: None }));
    assert_eq!(Caps::of(&budget("8Gi", None, false)), None);
    assert_eq!(Caps::of(&budget("1000Ki", None, true)), None, "under 1 MiB cannot be written");
}

/// The measured table (an H100, driver 580.159.04, an MPS daemon, a client asking 6 GiB in 1 GiB steps under a
/// ~3 GiB cap, 2026-11-26): what the driver honours and what makes it ignore the whole value.
pub(super) const HONOURED: &[&str] = &[
    "0=3072M",
    "0=3072m",
    "0=3072MB",
    "0=3072MiB",
    "0=3072Mi",
    "0=3G",
    "0=3g",
    "0=3Gi",
    "0=3GB",
    "0 =3072M",
    "0= 3072M",
    "0 = 3072M",
    "0=03072M",
    "0=3072M,",
    "0=3072M,0=6000M",
    "0=6000M,0=3072M",
];
/// Values the driver ignores entirely in a process seeing one device.
pub(super) const IGNORED: &[&str] = &[
    "0=3145728K",
    "0=3221225472",
    "0=0",
    "0=0M",
    " 0=3072M",
    "1=3072M",
    "0=3072M,1=3072M",
    "0=3072M,junk",
    "3G",
    "0=lots",
    "",
    ",",
    "0=3072M,,",
    "0=3072M, 0=3072M",
    "0=3T",
    "0=3GiB",
    "0=99999999999999999999999G",
    "0=3072M ",
    "٠=3072M",
    "0=３072M",
    "0=1000M,7=1M",
];

#[test]
fn the_driver_reads_only_what_was_seen_honoured() {
    for value in HONOURED {
        let read = read_mps(value, 1).unwrap_or_else(|e| panic!("{value:?}: {e}"));
        assert!(read.per_device[0].is_some_and(|a| a.high_mib <= 3072 && a.low_mib >= 2861), "{value:?}: {read:?}");
    }
    for value in IGNORED {
        assert!(read_mps(value, 1).is_err(), "{value:?} is ignored by the driver");
    }
    let sixty_four: Vec<String> = (0..64).map(|i| format!("{i}=3072M")).collect();
    assert_eq!(
        read_mps(&sixty_four.join(","), 1),
        Err(Ignored::Unseen { entry: 2, ordinal: 1, devices: 1 }),
        "64 entries in a 1-GPU process"
    );
    assert!(read_mps(&sixty_four.join(","), 64).is_ok());
    assert_eq!(read_mps("0=3072M,junk", 1), Err(Ignored::Malformed(2)));
    assert_eq!(read_mps("0=3145728K", 1), Err(Ignored::Unit(1)));
    assert_eq!(read_mps("0=0M", 1), Err(Ignored::Zero(1)));
    assert_eq!(read_mps(&"0=1M,".repeat(30_000), 1), Err(Ignored::TooLong));
    // Duplicates: the smaller wins; a UUID entry is read but says nothing of which device it is.
    assert_eq!(read_mps("0=2G,0=3000M", 1).expect("honoured").per_device[0].map(|a| a.high_mib), Some(2048));
    assert!(read_mps("GPU-8d4c=2G,0=1G", 1).expect("honoured").names_uuid);
    // `MB`/`GB` may be decimal: the smaller reading is kept for the cap written, the larger for the verdict.
    assert_eq!(read_mps("0=1000MB", 1).expect("read").per_device[0], Some(Amount { low_mib: 953, high_mib: 1000 }));
    assert_eq!(mps_amount_bytes("4G"), Some(4 << 30));
    assert_eq!(mps_amount_bytes("1024"), None, "bytes are ignored by the driver");
}

#[test]
fn the_mps_variable_is_canonical_for_the_devices_seen_and_keeps_smaller_caps() {
    assert_eq!(merge_mps(None, 2, 8192), "0=8192M,1=8192M");
    // A bare amount is ignored by the driver: replaced by per-device entries.
    assert_eq!(merge_mps(Some("4G"), 1, 8192), "0=8192M");
    assert_eq!(merge_mps(Some("0=4G"), 1, 8192), "0=4096M", "kept, in canonical form");
    assert_eq!(merge_mps(Some("0=16G"), 1, 8192), "0=8192M");
    assert_eq!(merge_mps(Some("0=8G"), 1, 8192), "0=8192M", "equal to the cap");
    assert_eq!(merge_mps(Some("0=lots"), 1, 8192), "0=8192M");
    assert_eq!(merge_mps(Some("0=4G,1=99G"), 2, 8192), "0=4096M,1=8192M");
    assert_eq!(merge_mps(Some("1=1000M,0=2000M"), 2, 8192), "0=2000M,1=1000M");
    assert_eq!(merge_mps(Some("0=2G,0=3G"), 1, 8192), "0=2048M", "duplicates: the smaller, as the driver");
    assert_eq!(merge_mps(Some("0=2G,0=30G"), 1, 8192), "0=2048M");
    // What the driver would ignore entirely gives the user nothing: the budget's cap everywhere.
    assert_eq!(merge_mps(Some("0=1000M,7=1M"), 1, 8192), "0=8192M", "an unseen ordinal voids the user's value");
    assert_eq!(merge_mps(Some("0=0"), 1, 8192), "0=8192M");
    assert_eq!(merge_mps(Some("0=1000M,junk"), 1, 8192), "0=8192M");
    // UUID entries are never kept; the ordinal entries beside them are.
    assert_eq!(merge_mps(Some("GPU-ab12=2G,0=1G"), 1, 8192), "0=1024M");
    // The smaller reading of MB, at least 1 MiB.
    assert_eq!(merge_mps(Some("0=1000MB"), 1, 8192), "0=953M");
    assert_eq!(merge_mps(Some("0=1MB"), 1, 8192), "0=1M");
}

#[test]
fn admission_patches_only_the_gpu_containers_variables_and_records_it() {
    let p = pod(TWO_CONTAINERS);
    let admission = admit(&p, Some(&budget("8Gi", Some("6Gi"), true)));
    assert_eq!(
        admission.patch,
        vec![
            json!({"op": "replace", "path": "/spec/containers/0/env/1",
                   "value": {"name": MPS_LIMIT, "value": "0=4096M,1=8192M"}}),
            json!({"op": "add", "path": "/spec/containers/0/env/-", "value": {"name": MEMORY_LIMIT, "value": "8192"}}),
            json!({"op": "add", "path": "/spec/containers/0/env/-", "value": {"name": MEMORY_REQUEST, "value": "6144"}}),
            json!({"op": "add", "path": "/metadata/annotations", "value": {ANNOTATION: serde_json::to_string(
                admission.record.as_ref().expect("record")).expect("json")}}),
        ]
    );
    let record = admission.record.expect("record");
    assert_eq!((record.budget.as_str(), record.limit_mib, record.request_mib), ("llm", 8192, Some(6144)));
    assert_eq!(record.containers.len(), 1);
    assert_eq!(record.containers[0].env[MPS_LIMIT], Outcome::Lowered);
    assert_eq!(record.containers[0].env[MEMORY_LIMIT], Outcome::Set);
    let patched = apply(&p, &admission.patch);
    assert_eq!(
        env_of(&patched, 0),
        [
            ("OTHER".into(), "x".into()),
            (MPS_LIMIT.into(), "0=4096M,1=8192M".into()),
            (MEMORY_LIMIT.into(), "8192".into()),
            (MEMORY_REQUEST.into(), "6144".into())
        ]
    );
    // The sidecar asks for no GPU: its (absurd) variable is not ours to touch.
    assert_eq!(env_of(&patched, 1), [(MEMORY_LIMIT.into(), "999999".into())]);
    let back: Record = serde_json::from_str(&patched.metadata.annotations.expect("annotations")[ANNOTATION])
        .expect("the annotation is the record");
    assert_eq!(back, record);
    assert!(record.summary().contains("limit 8192 MiB"), "{}", record.summary());
}

#[test]
fn value_from_and_unreadable_values_are_replaced_smaller_ones_kept() {
    let p = pod(r#"
metadata: {name: p, namespace: team-a, annotations: {gpubudget.io/caps: '{"budget":"forged"}'}}
spec:
  initContainers:
  - name: warmup
    resources: {limits: {nvidia.com/gpu.shared: "1"}}
    env:
    - {name: CUDA_MPS_PINNED_DEVICE_MEM_LIMIT, valueFrom: {configMapKeyRef: {name: c, key: k}}}
    - {name: NVIDIA_GPU_MEMORY_LIMIT, value: "1024"}
  containers:
  - name: main
    resources: {limits: {nvidia.com/gpu: "1"}}
    env: [{name: NVIDIA_GPU_MEMORY_LIMIT, value: "8 GiB"}]
"#);
    let admission = admit(&p, Some(&budget("8Gi", None, true)));
    let record = admission.record.clone().expect("record");
    let outcomes: Vec<_> = record.containers.iter().map(|c| (c.name.as_str(), c.env.clone())).collect();
    assert_eq!(outcomes[0].0, "warmup");
    assert_eq!(outcomes[0].1[MPS_LIMIT], Outcome::Replaced);
    assert_eq!(outcomes[0].1[MEMORY_LIMIT], Outcome::Kept);
    assert_eq!(outcomes[1].1[MEMORY_LIMIT], Outcome::Replaced);
    assert!(!outcomes[1].1.contains_key(MEMORY_REQUEST), "no request without the budget's");
    let patched = apply(&p, &admission.patch);
    let init = &patched.spec.as_ref().expect("spec").init_containers.as_ref().expect("init")[0];
    assert_eq!(
        env_value(init.env.as_deref().unwrap_or_default(), MPS_LIMIT),
        Some(EnvValue::Literal("0=8192M".into()))
    );
    assert_eq!(
        env_value(init.env.as_deref().unwrap_or_default(), MEMORY_LIMIT),
        Some(EnvValue::Literal("1024".into()))
    );
    assert_eq!(env_of(&patched, 0), [(MEMORY_LIMIT.into(), "8192".into()), (MPS_LIMIT.into(), "0=8192M".into())]);
    // The forged annotation is replaced by the record.
    let annotation = &patched.metadata.annotations.expect("annotations")[ANNOTATION];
    assert_eq!(serde_json::from_str::<Record>(annotation).expect("record"), record);
}

#[test]
fn without_a_capping_budget_only_a_forged_record_is_removed() {
    let plain = pod(TWO_CONTAINERS);
    assert_eq!(admit(&plain, None), Admission { patch: vec![], record: None });
    assert_eq!(admit(&plain, Some(&budget("8Gi", None, false))).patch, Vec::<Value>::new());
    let forged = pod("metadata: {name: p, annotations: {gpubudget.io/caps: x, keep: y}}\nspec: {containers: []}\n");
    let admission = admit(&forged, Some(&budget("8Gi", None, false)));
    assert_eq!(admission.patch, vec![json!({"op": "remove", "path": "/metadata/annotations/gpubudget.io~1caps"})]);
    let patched = apply(&forged, &admission.patch);
    assert_eq!(patched.metadata.annotations.expect("kept").keys().collect::<Vec<_>>(), ["keep"]);
}

#[test]
fn a_pod_without_gpu_containers_is_recorded_and_untouched() {
    let p = pod("metadata: {name: p}\nspec: {containers: [{name: web, resources: {limits: {cpu: '1'}}}]}\n");
    let admission = admit(&p, Some(&budget("8Gi", None, true)));
    assert_eq!(admission.patch.len(), 1, "only the annotation: {:?}", admission.patch);
    assert!(admission.record.expect("record").summary().ends_with("no GPU container"));
}

/// #32: where the device count is unknown no MPS value is written (the user's is removed: an entry for a
/// device the container does not see voids it, and one it sees may be above the budget); the MiB variables
/// are (they do not depend on the count), and the record says why the container has no MPS cap.
#[test]
fn a_container_whose_device_count_is_unknown_gets_no_mps_value() {
    let p = pod(r#"
metadata: {name: p, namespace: team-a}
spec:
  containers:
  - name: all
    resources: {limits: {nvidia.com/gpu: "1"}}
    env:
    - {name: CUDA_MPS_PINNED_DEVICE_MEM_LIMIT, value: "0=80G"}
    - {name: NVIDIA_VISIBLE_DEVICES, value: all}
    - {name: CUDA_MPS_PINNED_DEVICE_MEM_LIMIT, value: "0=1G"}
    - {name: NVIDIA_GPU_MEMORY_LIMIT, value: "+1"}
  - name: dra
    resources: {claims: [{name: gpu}]}
"#);
    let admission = admit(&p, Some(&budget("8Gi", None, true)));
    let record = admission.record.clone().expect("record");
    assert_eq!(record.containers[0].env[MPS_LIMIT], Outcome::Removed);
    assert_eq!(record.containers[0].env[MEMORY_LIMIT], Outcome::Replaced, "+1 is not the canonical form");
    assert!(record.containers[0].uncapped.as_deref().is_some_and(|w| w.contains("NVIDIA_VISIBLE_DEVICES=all")));
    assert!(!record.containers[1].env.contains_key(MPS_LIMIT));
    assert!(record.containers[1].uncapped.as_deref().is_some_and(|w| w.contains("DRA")));
    assert!(record.summary().contains("no MPS cap: a DRA resource claim"), "{}", record.summary());
    let patched = apply(&p, &admission.patch);
    assert_eq!(
        env_of(&patched, 0),
        [(VISIBLE_DEVICES.into(), "all".into()), (MEMORY_LIMIT.into(), "8192".into())],
        "every MPS entry removed, the limit canonical"
    );
    assert_eq!(env_of(&patched, 1), [(MEMORY_LIMIT.into(), "8192".into())]);
    let counted: Vec<GpuContainer> = gpu_containers(&patched).into_iter().map(|f| f.gpu).collect();
    assert_eq!(PodCaps::of(&counted), PodCaps::Uncapped(Uncapped::Devices(Unknown::All)));
}

/// #32 item 3: ephemeral containers arrive through `pods/ephemeralcontainers`; the new GPU ones are capped
/// there, existing ones and the annotation are left alone.
#[test]
fn new_ephemeral_gpu_containers_are_capped_at_the_subresource() {
    let old = pod(r#"
metadata: {name: p, namespace: team-a, annotations: {gpubudget.io/caps: '{"budget":"llm"}'}}
spec:
  containers: [{name: main, resources: {limits: {nvidia.com/gpu: "1"}}}]
  ephemeralContainers:
  - {name: old-debug, env: [{name: NVIDIA_VISIBLE_DEVICES, value: "0"}]}
"#);
    let mut new = old.clone();
    let added: Vec<k8s_openapi::api::core::v1::EphemeralContainer> = serde_json::from_value(json!([
        {"name": "debug", "env": [{"name": VISIBLE_DEVICES, "value": "GPU-1,GPU-2"}, {"name": MPS_LIMIT, "value": "1=1G"}]},
        {"name": "shell"},
    ]))
    .expect("ephemeral");
    new.spec.as_mut().expect("spec").ephemeral_containers.as_mut().expect("list").extend(added);
    let admission = admit_ephemeral(&new, &old, Some(&budget("8Gi", None, true)));
    let record = admission.record.clone().expect("record");
    assert_eq!(record.containers.iter().map(|c| c.name.as_str()).collect::<Vec<_>>(), ["debug"]);
    assert_eq!(record.containers[0].env[MPS_LIMIT], Outcome::Lowered, "device 0 had no entry");
    assert!(
        admission
            .patch
            .iter()
            .all(|op| op["path"].as_str().is_some_and(|p| p.starts_with("/spec/ephemeralContainers/1/")))
    );
    let patched = apply(&new, &admission.patch);
    let debug = &patched.spec.as_ref().expect("spec").ephemeral_containers.as_ref().expect("list")[1];
    assert_eq!(
        env_value(debug.env.as_deref().unwrap_or_default(), MPS_LIMIT),
        Some(EnvValue::Literal("0=8192M,1=1024M".into()))
    );
    assert_eq!(patched.metadata.annotations, old.metadata.annotations, "the record is not touched there");
    assert_eq!(admit_ephemeral(&new, &old, None), Admission { patch: vec![], record: None });
}

fn gpu(devices: u32, mps: Option<&str>, limit: Option<&str>) -> GpuContainer {
    GpuContainer {
        name: "main".into(),
        devices: Devices::Known(devices),
        mps_limit: mps.map(|m| EnvValue::Literal(m.into())),
        memory_limit: limit.map(|m| EnvValue::Literal(m.into())),
        memory_request: None,
    }
}

#[test]
fn running_pods_are_assessed_from_their_environment() {
    let caps = Caps { limit_mib: 8192, request_mib: None };
    assert_eq!(assess(&[], caps), Assessment::NoGpu);
    assert_eq!(assess(&[gpu(2, Some("0=8192M,1=4G"), Some("8192"))], caps), Assessment::Capped);
    assert_eq!(assess(&[gpu(2, Some("0=8192M"), None)], caps), Assessment::Uncapped, "device 1 uncapped");
    assert_eq!(assess(&[gpu(1, Some("8G"), None)], caps), Assessment::Uncapped, "a bare amount is ignored");
    assert_eq!(assess(&[gpu(1, None, Some("8192"))], caps), Assessment::Uncapped, "no MPS cap");
    let from = GpuContainer { mps_limit: Some(EnvValue::FromSource), ..gpu(1, None, None) };
    assert_eq!(assess(&[from], caps), Assessment::Uncapped, "valueFrom cannot be read");
    assert_eq!(assess(&[gpu(1, Some("0=16384M"), Some("16384"))], caps), Assessment::AboveLimit);
    assert_eq!(assess(&[gpu(1, Some("0=8192M"), Some("16384"))], caps), Assessment::AboveLimit);
    assert_eq!(assess(&[gpu(1, Some("0=8192M,GPU-x=9G"), None)], caps), Assessment::Uncapped, "a UUID entry");
    // The driver's reading (#32): values it ignores count uncapped, whatever they say.
    for ignored in ["0=1000M,7=1M", "0=0", "0=3145728K", "0=3221225472", "0=1G,junk", " 0=1G"] {
        assert_eq!(assess(&[gpu(1, Some(ignored), None)], caps), Assessment::Uncapped, "{ignored:?}");
    }
    let unknown = GpuContainer { devices: Devices::Unknown(Unknown::All), ..gpu(1, Some("0=1G"), None) };
    assert_eq!(assess(&[unknown], caps), Assessment::Uncapped, "NVIDIA_VISIBLE_DEVICES=all");
    assert_eq!(
        PodCaps::of(&[gpu(1, Some("0=1000M,7=1M"), None)]),
        PodCaps::Uncapped(Uncapped::Ignored(Ignored::Unseen { entry: 2, ordinal: 7, devices: 1 }))
    );
    assert_eq!(
        PodCaps::of(&[gpu(1, Some("0=1000M,7=1M"), None)]).reason().map(|r| r.to_string()).as_deref(),
        Some(
            "the driver ignores its CUDA_MPS_PINNED_DEVICE_MEM_LIMIT: entry 2 names device 7, which a container seeing 1 device(s) does not see"
        )
    );
    assert_eq!(PodCaps::of(&[gpu(2, Some("0=1G,1=2G"), Some("1000"))]), PodCaps::Capped { max_mib: 2048 });
    assert_eq!(
        assess(&[gpu(1, Some("0=1G"), None), gpu(1, None, None)], caps),
        Assessment::Uncapped,
        "every GPU container counts"
    );
}

// ---- properties --------------------------------------------------------------------------------------

/// One generated MPS entry and what the driver makes of it (by construction, not by `read_mps`).
#[derive(Debug, Clone)]
enum Truth {
    /// Honoured if the ordinal is seen: the cap's (low, high) MiB.
    Entry { ordinal: u32, low: u64, high: u64 },
    /// Honoured, names a GPU by UUID.
    Uuid,
    /// Makes the driver ignore the whole value.
    Breaks,
}

fn honoured_entry() -> impl Strategy<Value = (String, Truth)> {
    let unit = prop_oneof![
        Just(("M", 1u64, false)),
        Just(("m", 1, false)),
        Just(("Mi", 1, false)),
        Just(("MiB", 1, false)),
        Just(("MB", 1, true)),
        Just(("G", 1024, false)),
        Just(("g", 1024, false)),
        Just(("Gi", 1024, false)),
        Just(("GB", 1024, true)),
    ];
    (0u32..6, 0usize..3, 0usize..3, 0usize..3, 1u64..100_000, unit).prop_map(
        |(ordinal, sa, sb, zeros, n, (u, mult, dec))| {
            let text = format!("{ordinal}{}={}{}{n}{u}", " ".repeat(sa), " ".repeat(sb), "0".repeat(zeros));
            let high = n * mult;
            let low = if dec { n * if mult == 1 { 1_000_000 } else { 1_000_000_000 } / MIB } else { high };
            (text, Truth::Entry { ordinal, low, high })
        },
    )
}

fn breaking_entry() -> impl Strategy<Value = (String, Truth)> {
    prop_oneof![
        (0u32..2, 1u64..1 << 40).prop_map(|(d, n)| format!("{d}={n}K")),
        (0u32..2, 1u64..1 << 40).prop_map(|(d, n)| format!("{d}={n}")),
        (0u32..2, prop_oneof![Just("0"), Just("0M"), Just("00G")]).prop_map(|(d, z)| format!("{d}={z}")),
        (0u32..2, 1u64..100).prop_map(|(d, n)| format!("{d}={n}T")),
        (0u32..2, 1u64..100).prop_map(|(d, n)| format!(" {d}={n}G")),
        (1u64..100).prop_map(|n| format!("{n}G")),
        "[^=,]{1,8}",
        "[^=, 0-9A-Za-z]{1,3}=1G",
        (0u32..2, "[0-9]{21,30}").prop_map(|(d, n)| format!("{d}={n}G")),
    ]
    .prop_map(|text| (text, Truth::Breaks))
}

fn hostile_mps() -> impl Strategy<Value = (String, Vec<Truth>)> {
    let entry = prop_oneof![
        6 => honoured_entry(),
        1 => breaking_entry(),
        1 => (1u64..20_000).prop_map(|n| (format!("GPU-8d4c9c1e-0b2f={n}M"), Truth::Uuid)),
    ];
    (proptest::collection::vec(entry, 1..6), any::<bool>()).prop_map(|(entries, trailing)| {
        let mut text = entries.iter().map(|(t, _)| t.as_str()).collect::<Vec<_>>().join(",");
        if trailing {
            text.push(',');
        }
        (text, entries.into_iter().map(|(_, t)| t).collect())
    })
}

/// The driver's reading of a generated value in a process seeing `devices`: `None` if it ignores it, else
/// per device the (low, high) cap and whether a UUID entry is present.
type Reading = (Vec<Option<(u64, u64)>>, bool);

fn oracle(truths: &[Truth], devices: u32) -> Option<Reading> {
    let mut per = vec![None; devices as usize];
    let mut uuid = false;
    for t in truths {
        match t {
            Truth::Breaks => return None,
            Truth::Uuid => uuid = true,
            Truth::Entry { ordinal, low, high } => {
                let slot: &mut Option<(u64, u64)> = per.get_mut(*ordinal as usize)?;
                *slot = Some(slot.map_or((*low, *high), |(l, h)| (l.min(*low), h.min(*high))));
            }
        }
    }
    Some((per, uuid))
}

/// `<i>=<MiB>M` for exactly `0..devices`, each in `1..=cap`.
fn canonical(value: &str, devices: u32, cap: u64) -> Result<Vec<u64>, String> {
    let parts: Vec<&str> = value.split(',').collect();
    if parts.len() != devices as usize {
        return Err(format!("{value:?}: {} entries for {devices} devices", parts.len()));
    }
    parts
        .iter()
        .enumerate()
        .map(|(i, p)| {
            let mib = p.strip_prefix(&format!("{i}=")).and_then(|r| r.strip_suffix('M')).ok_or(format!("{p:?}"))?;
            let mib: u64 = mib.parse().map_err(|_| format!("{p:?}"))?;
            if mib.to_string() != *mib.to_string() || !(1..=cap).contains(&mib) {
                return Err(format!("{p:?} not in 1..={cap}"));
            }
            Ok(mib)
        })
        .collect()
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 2000, ..ProptestConfig::default() })]

    /// #32 item 1: whatever the user wrote, the MPS value written is canonical for exactly the devices seen,
    /// never above the budget, the smaller of the user's honoured cap and the budget's; and the "capped"
    /// verdict is given exactly to values the driver honours at most at the budget on every device.
    #[test]
    fn hostile_mps_values_come_out_canonical_and_the_verdict_follows_the_driver(
        (text, truths) in hostile_mps(),
        devices in 1u32..4,
        cap in 1u64..100_000,
    ) {
        let truth = oracle(&truths, devices);
        let read = read_mps(&text, devices);
        prop_assert_eq!(read.is_ok(), truth.is_some(), "{:?}: {:?}", text, read);
        let out = merge_mps(Some(&text), devices, cap);
        let written = canonical(&out, devices, cap).map_err(TestCaseError::fail)?;
        for (i, mib) in written.iter().enumerate() {
            let user = truth.as_ref().and_then(|(per, _)| per[i]);
            prop_assert_eq!(*mib, user.map_or(cap, |(low, _)| low.clamp(1, cap)), "device {} of {:?}", i, text);
        }
        // What was written reads back as itself: honoured, the same caps.
        let back = read_mps(&out, devices).map_err(|e| TestCaseError::fail(e.to_string()))?;
        prop_assert!(back.per_device.iter().zip(&written).all(|(a, w)| a.is_some_and(|a| a.high_mib == *w)));
        prop_assert_eq!(merge_mps(Some(&out), devices, cap), out.clone(), "idempotent");
        // The verdict.
        let c = GpuContainer { mps_limit: Some(EnvValue::Literal(text.clone())), ..gpu(devices, None, None) };
        let capped_at_most = |max: u64| truth.as_ref().is_some_and(|(per, uuid)| {
            !uuid && per.iter().all(|p| p.is_some_and(|(_, high)| high <= max))
        });
        let caps = Caps { limit_mib: cap, request_mib: None };
        prop_assert_eq!(assess(std::slice::from_ref(&c), caps) == Assessment::Capped, capped_at_most(cap), "{:?}", text);
        let capped = matches!(held(&c), ContainerCap::Capped { .. });
        prop_assert_eq!(capped, capped_at_most(u64::MAX), "{:?}", text);
    }

    /// The MiB variables: whatever the user wrote (signs, spaces, unicode digits, huge numbers, 0), the
    /// value written is a plain positive decimal, the smaller of the user's (read strictly) and the cap.
    #[test]
    fn hostile_mib_values_come_out_plain_decimals_at_most_the_cap(
        user in prop_oneof![
            (1u64..100_000).prop_map(|v| v.to_string()),
            (1u64..100_000).prop_map(|v| format!("+{v}")),
            (1u64..100_000).prop_map(|v| format!(" {v}")),
            (1u64..100_000).prop_map(|v| format!("{v} ")),
            (1u64..100_000).prop_map(|v| format!("00{v}")),
            Just("0".to_owned()), Just("".to_owned()), Just("٣".to_owned()), Just("8 GiB".to_owned()),
            "[0-9]{21,40}", "\\PC{0,12}",
        ],
        cap in 1u64..100_000,
    ) {
        let (out, outcome) = merge_mib(Some(&EnvValue::Literal(user.clone())), cap);
        let v: u64 = out.parse().map_err(|_| TestCaseError::fail(out.clone()))?;
        prop_assert!(v >= 1 && v <= cap && out == v.to_string(), "{:?} -> {:?}", user, out);
        let strict = user.bytes().all(|b| b.is_ascii_digit()) && user.trim_start_matches('0').parse::<u64>().is_ok_and(|u| u > 0);
        if strict {
            prop_assert_eq!(v, user.trim_start_matches('0').parse::<u64>().unwrap_or(0).min(cap));
        } else {
            prop_assert_eq!((v, outcome), (cap, Outcome::Replaced), "{:?}", user);
        }
    }

    #[test]
    fn caps_never_exceed_the_budget_apply_once_and_keep_smaller_values(
        devices in 1u32..4,
        mps in proptest::option::of(hostile_mps().prop_map(|(t, _)| t)),
        limit in proptest::option::of(prop_oneof![(1u64..40_000).prop_map(|m| m.to_string()), Just("8Gi".to_owned()), Just("+1".to_owned())]),
        limit_mib in 1u64..40_000,
        request_pct in proptest::option::of(0u64..=100),
        forged in any::<bool>(),
    ) {
        let limit_bytes = limit_mib * MIB + 12_345;
        let request = request_pct.map(|p| limit_bytes / 100 * p);
        let spec = serde_json::from_value(json!({
            "selector": {}, "limit": limit_bytes.to_string(), "admissionCaps": "Enabled",
            "request": request.map(|r| r.to_string()),
        })).expect("spec");
        let b = Budget::from_spec("team-a", "b", &spec).expect("valid");
        let p = generated_pod(devices, mps.clone(), limit.clone(), forged);
        let once = apply(&p, &admit(&p, Some(&b)).patch);
        // Never above the budget: the environment reads as capped at most at the budget, on every device.
        let caps = Caps::of(&b).expect("caps");
        let containers: Vec<GpuContainer> = gpu_containers(&once).into_iter().map(|f| f.gpu).collect();
        prop_assert_eq!(assess(&containers, caps), Assessment::Capped);
        let main = &containers[0];
        let Some(EnvValue::Literal(written)) = &main.mps_limit else { return Err(TestCaseError::fail("no MPS")) };
        canonical(written, devices, limit_mib).map_err(TestCaseError::fail)?;
        if let Some(EnvValue::Literal(v)) = &main.memory_limit {
            prop_assert!(strict_mib(v).is_some_and(|v| v <= limit_mib) && !v.starts_with('0'));
        } else {
            prop_assert!(false, "no limit variable");
        }
        // Applying twice changes no container.
        let twice = apply(&once, &admit(&once, Some(&b)).patch);
        prop_assert_eq!(&twice.spec, &once.spec);
        // A user's smaller value survives.
        if let Some(l) = limit.as_ref().and_then(|l| strict_mib(l)).filter(|v| *v <= limit_mib) {
            prop_assert_eq!(main.memory_limit.clone(), Some(EnvValue::Literal(l.to_string())));
        }
        // Nothing else is touched; the annotation is ours.
        prop_assert_eq!(&env_of(&once, 0)[0], &("KEEP".to_owned(), "me".to_owned()));
        prop_assert_eq!(env_of(&once, 1), env_of(&p, 1));
        let record: Record = serde_json::from_str(&once.metadata.annotations.clone().unwrap_or_default()[ANNOTATION])
            .expect("our record");
        prop_assert_eq!(record.budget, "b");
    }
}

/// #32 item 2: a value as large as the API server accepts (1.5 MB) is replaced unread, at once.
#[test]
fn a_huge_value_is_replaced_without_being_read() {
    let huge = (0..200_000).map(|i| format!("{}=1024M", i % 7)).collect::<Vec<_>>().join(",");
    assert!(huge.len() > 1_500_000);
    assert_eq!(read_mps(&huge, 1), Err(Ignored::TooLong));
    assert_eq!(merge_mps(Some(&huge), 2, 8192), "0=8192M,1=8192M");
    let c = GpuContainer { mps_limit: Some(EnvValue::Literal(huge)), ..gpu(1, None, None) };
    assert_eq!(held(&c), ContainerCap::Uncapped(Uncapped::Ignored(Ignored::TooLong)));
}

fn generated_pod(devices: u32, mps: Option<String>, limit: Option<String>, forged: bool) -> Pod {
    let mut env = vec![json!({"name": "KEEP", "value": "me"})];
    if let Some(m) = mps {
        env.push(json!({"name": MPS_LIMIT, "value": m}));
    }
    if let Some(l) = limit {
        env.push(json!({"name": MEMORY_LIMIT, "value": l}));
    }
    let annotations = if forged { json!({ANNOTATION: "{\"budget\":\"x\"}"}) } else { json!({}) };
    serde_json::from_value(json!({
        "metadata": {"name": "p", "namespace": "team-a", "annotations": annotations},
        "spec": {"nodeSelector": {"nvidia.com/gpu.replicas": "1"}, "containers": [
            {"name": "main", "resources": {"limits": {"nvidia.com/gpu": devices.to_string()}}, "env": env},
            {"name": "cpu", "env": [{"name": MEMORY_LIMIT, "value": "123456"}]},
        ]},
    }))
    .expect("pod")
}

// ---- caps counted only where the driver will read them: replicas and envFrom -----------------------------

/// The single GPU container of a pod: what the caps module reads of it.
fn only(p: &Pod) -> GpuContainer {
    let found = gpu_containers(p);
    assert_eq!(found.len(), 1, "one GPU container");
    found[0].gpu.clone()
}

/// A pod shaped as the NVIDIA device plugin's sharing leaves it: `limits` and `node_selector` as YAML flow
/// maps, and the MPS value a pod the webhook never saw may carry.
fn plugin_pod(limits: &str, node_selector: &str, mps: &str) -> Pod {
    pod(&format!(
        r#"
metadata: {{name: p, namespace: team-a}}
spec:
  nodeSelector: {node_selector}
  containers:
  - name: main
    image: pytorch
    resources: {{limits: {limits}}}
    env: [{{name: CUDA_MPS_PINNED_DEVICE_MEM_LIMIT, value: "{mps}"}}]
"#
    ))
}

/// Replicas of one card (time-slicing with `renameByDefault: false` keeps `nvidia.com/gpu`; renamed replicas
/// are `nvidia.com/gpu.shared`; MPS sharing's replicas likewise): a container asking for two may see one device,
/// the `0=...,1=...` it would get names an ordinal it does not see, and the driver ignores the whole variable.
/// So no MPS value is written there and such a pod is counted uncapped, with the reason; one replica is one
/// device (ordinal 0 either way); a pod pinned to unshared nodes by the GPU feature discovery's labels keeps its
/// whole GPUs.
#[test]
fn replicas_of_one_card_are_not_counted_as_distinct_devices() {
    let replicas = |resource, count| Devices::Unknown(Unknown::Replicas { resource, count });
    let two = "0=3072M,1=3072M";
    // Time-slicing, name kept: `nvidia.com/gpu: 2` may be one card twice.
    let sliced = plugin_pod(r#"{nvidia.com/gpu: "2"}"#, "{}", two);
    assert_eq!(only(&sliced).devices, replicas(Replicated::Gpu, 2));
    assert_eq!(
        PodCaps::of_pod(&sliced),
        PodCaps::Uncapped(Uncapped::Devices(Unknown::Replicas { resource: Replicated::Gpu, count: 2 })),
        "counted uncapped, not capped on a guess"
    );
    let labelled = |selector| only(&plugin_pod(r#"{nvidia.com/gpu: "2"}"#, selector, two)).devices;
    assert_eq!(labelled("{nvidia.com/gpu.replicas: '4'}"), replicas(Replicated::Gpu, 2));
    assert_eq!(labelled("{nvidia.com/gpu.sharing-strategy: time-slicing}"), replicas(Replicated::Gpu, 2));
    assert_eq!(labelled("{nvidia.com/gpu.sharing-strategy: none}"), Devices::Known(2), "pinned to unshared nodes");
    assert_eq!(labelled("{nvidia.com/gpu.replicas: '1'}"), Devices::Known(2));
    assert_eq!(labelled("{nvidia.com/mig-1g.10gb.replicas: '1'}"), replicas(Replicated::Gpu, 2), "another resource");
    // Renamed replicas: never distinct, whatever the node.
    let shared = plugin_pod(r#"{nvidia.com/gpu.shared: "2"}"#, "{nvidia.com/gpu.sharing-strategy: none}", two);
    assert_eq!(only(&shared).devices, replicas(Replicated::Shared, 2));
    assert!(matches!(PodCaps::of_pod(&shared), PodCaps::Uncapped(Uncapped::Devices(Unknown::Replicas { .. }))));
    // MIG devices replicated alike.
    let mig = |selector| only(&plugin_pod(r#"{nvidia.com/mig-1g.10gb: "2"}"#, selector, two)).devices;
    assert_eq!(mig("{}"), replicas(Replicated::Mig, 2));
    assert_eq!(mig("{nvidia.com/mig-1g.10gb.sharing-strategy: none}"), Devices::Known(2));
    // One replica is one device: an MPS replica (`nvidia.com/gpu.shared: 1`) or a time-sliced `nvidia.com/gpu: 1`.
    let one = plugin_pod(r#"{nvidia.com/gpu.shared: "1"}"#, "{}", "0=3072M");
    assert_eq!(PodCaps::of_pod(&one), PodCaps::Capped { max_mib: 3072 });
    let one = plugin_pod(r#"{nvidia.com/gpu: "1"}"#, "{nvidia.com/gpu.sharing-strategy: mps}", "0=3072M");
    assert_eq!(PodCaps::of_pod(&one), PodCaps::Capped { max_mib: 3072 });
    // A list in NVIDIA_VISIBLE_DEVICES does not settle it: a runtime that ignores the variable (the GPU
    // Operator's CDI default for unprivileged containers) uses the device plugin's list.
    let mut listed = plugin_pod(r#"{nvidia.com/gpu.shared: "2"}"#, "{}", two);
    listed.spec.as_mut().expect("spec").containers[0].env.as_mut().expect("env").push(EnvVar {
        name: VISIBLE_DEVICES.into(),
        value: Some("0,1".into()),
        value_from: None,
    });
    assert_eq!(only(&listed).devices, replicas(Replicated::Shared, 2));

    // Admission: no MPS value (the user's removed), the MiB variables set, the reason recorded.
    let admission = admit(&sliced, Some(&budget("8Gi", None, true)));
    let record = admission.record.clone().expect("record");
    assert_eq!(record.containers[0].env[MPS_LIMIT], Outcome::Removed);
    assert_eq!(record.containers[0].env[MEMORY_LIMIT], Outcome::Set);
    let why = record.containers[0].uncapped.clone().expect("uncapped");
    assert!(why.contains("nvidia.com/gpu: 2 may be replicas of one card"), "{why}");
    let patched = apply(&sliced, &admission.patch);
    assert_eq!(env_of(&patched, 0), [(MEMORY_LIMIT.into(), "8192".into())]);
    let why = admit(&shared, Some(&budget("8Gi", None, true))).record.expect("record").containers[0].uncapped.clone();
    assert!(why.is_some_and(|w| w.contains("nvidia.com/gpu.shared: 2")));
    // One replica: capped at ordinal 0.
    let one = plugin_pod(r#"{nvidia.com/gpu.shared: "1"}"#, "{}", "0=80G");
    let patched = apply(&one, &admit(&one, Some(&budget("8Gi", None, true))).patch);
    assert_eq!(env_of(&patched, 0)[0], (MPS_LIMIT.into(), "0=8192M".into()));
    assert_eq!(PodCaps::of_pod(&patched), PodCaps::Capped { max_mib: 8192 });
}

/// A GPU-sharing scheduler's ConfigMap (`envFrom`, holding `NVIDIA_VISIBLE_DEVICES=all`, as KAI's are) or a
/// `valueFrom` sets the device list outside the pod: a 1-GPU container may see every GPU of its node, so it
/// is not capped on device 0 only. `env` wins over `envFrom`, and a prefix that none of the variables starts
/// with sets none of them.
#[test]
fn a_scheduler_config_map_in_env_from_makes_the_device_count_unknown() {
    let with = |env_from: &str, env: &str| {
        pod(&format!(
            r#"
metadata: {{name: p, namespace: team-a}}
spec:
  containers:
  - name: main
    image: pytorch
    resources: {{limits: {{nvidia.com/gpu: "1"}}}}
    envFrom: {env_from}
    env: [{{name: CUDA_MPS_PINNED_DEVICE_MEM_LIMIT, value: "0=3072M"}}{env}]
"#
        ))
    };
    let from_env_from = |entry, secret| Devices::Unknown(Unknown::VisibleFromEnvFrom { entry, secret });
    let kai = with("[{configMapRef: {name: gpu-sharing}}]", "");
    assert_eq!(only(&kai).devices, from_env_from(0, false));
    assert_eq!(
        PodCaps::of_pod(&kai),
        PodCaps::Uncapped(Uncapped::Devices(Unknown::VisibleFromEnvFrom { entry: 0, secret: false })),
        "written 0=3072M, but its other GPUs would be uncapped: counted uncapped"
    );
    let secret = with("[{configMapRef: {name: app}, prefix: APP_}, {secretRef: {name: s}}]", "");
    assert_eq!(only(&secret).devices, from_env_from(1, true));
    assert_eq!(only(&with("[{configMapRef: {name: c}, prefix: NVIDIA_}]", "")).devices, from_env_from(0, false));
    // A prefix none of the variables starts with, or the variable in env: the count is known.
    assert_eq!(only(&with("[{configMapRef: {name: app}, prefix: APP_}]", "")).devices, Devices::Known(1));
    assert_eq!(
        only(&with("[{configMapRef: {name: c}, prefix: NVIDIA_VISIBLE_DEVICES}]", "")).devices,
        Devices::Known(1)
    );
    let pinned = with("[{configMapRef: {name: gpu-sharing}}]", ", {name: NVIDIA_VISIBLE_DEVICES, value: '3'}");
    assert_eq!(only(&pinned).devices, Devices::Known(1), "env wins over envFrom");
    assert_eq!(PodCaps::of_pod(&pinned), PodCaps::Capped { max_mib: 3072 });
    // valueFrom (configMapKeyRef, fieldRef...): unknown too.
    let key_ref =
        with("[]", ", {name: NVIDIA_VISIBLE_DEVICES, valueFrom: {configMapKeyRef: {name: gpu-sharing, key: devices}}}");
    assert_eq!(only(&key_ref).devices, Devices::Unknown(Unknown::VisibleFromSource));
    // envFrom alone does not make a GPU container (no more than its image's ENV does).
    let cpu = pod("metadata: {name: p}\nspec: {containers: [{name: web, envFrom: [{configMapRef: {name: app}}]}]}\n");
    assert!(gpu_containers(&cpu).is_empty());

    // Admission: no MPS value, the user's removed, the reason names the ConfigMap; the MiB variables are set in
    // env, which overrides whatever the ConfigMap holds.
    let admission = admit(&kai, Some(&budget("8Gi", Some("4Gi"), true)));
    let record = admission.record.clone().expect("record");
    let c = &record.containers[0];
    assert_eq!(
        (c.env[MPS_LIMIT], c.env[MEMORY_LIMIT], c.env[MEMORY_REQUEST]),
        (Outcome::Removed, Outcome::Set, Outcome::Set)
    );
    let why = c.uncapped.clone().expect("uncapped");
    assert!(why.contains("envFrom entry 0") && why.contains("ConfigMap gpu-sharing"), "{why}");
    let patched = apply(&kai, &admission.patch);
    assert_eq!(env_of(&patched, 0), [(MEMORY_LIMIT.into(), "8192".into()), (MEMORY_REQUEST.into(), "4096".into())]);
    assert!(matches!(
        PodCaps::of_pod(&patched),
        PodCaps::Uncapped(Uncapped::Devices(Unknown::VisibleFromEnvFrom { .. }))
    ));
    assert!(
        admit(&secret, Some(&budget("8Gi", None, true))).record.expect("record").containers[0]
            .uncapped
            .as_deref()
            .is_some_and(|w| w.contains("Secret s")),
    );
    let key_ref = admit(&key_ref, Some(&budget("8Gi", None, true))).record.expect("record");
    assert!(key_ref.containers[0].uncapped.as_deref().is_some_and(|w| w.contains("valueFrom")));
}

/// The MPS variable from `envFrom` (the device count known): not in the pod, so counted uncapped until the
/// webhook writes it in `env`, which wins; an `envFrom` MiB variable is overridden the same way, never merged.
#[test]
fn an_mps_value_from_env_from_is_uncapped_until_env_overrides_it() {
    let p = pod(r#"
metadata: {name: p, namespace: team-a}
spec:
  containers:
  - name: main
    resources: {limits: {nvidia.com/gpu: "1"}}
    envFrom: [{configMapRef: {name: caps}, prefix: CUDA_MPS_}, {secretRef: {name: s}, prefix: NVIDIA_GPU_}]
"#);
    let c = only(&p);
    assert_eq!(c.devices, Devices::Known(1));
    assert_eq!(c.mps_limit, Some(EnvValue::FromEnvFrom { entry: 0, secret: false }));
    assert_eq!(c.memory_limit, Some(EnvValue::FromEnvFrom { entry: 1, secret: true }));
    assert_eq!(PodCaps::of_pod(&p), PodCaps::Uncapped(Uncapped::MpsFromEnvFrom { entry: 0, secret: false }));
    let admission = admit(&p, Some(&budget("8Gi", None, true)));
    let record = admission.record.clone().expect("record");
    assert_eq!(
        (record.containers[0].env[MPS_LIMIT], record.containers[0].env[MEMORY_LIMIT]),
        (Outcome::Set, Outcome::Set)
    );
    let patched = apply(&p, &admission.patch);
    assert_eq!(env_of(&patched, 0), [(MPS_LIMIT.into(), "0=8192M".into()), (MEMORY_LIMIT.into(), "8192".into())]);
    assert_eq!(PodCaps::of_pod(&patched), PodCaps::Capped { max_mib: 8192 });
}

/// Bounded: a tenant's envFrom list and prefixes are read once per variable, in linear time.
#[test]
fn long_env_from_lists_are_read_in_linear_time() {
    let sources: Vec<Value> = (0..100_000)
        .map(|i| json!({"configMapRef": {"name": format!("c{i}")}, "prefix": "X".repeat(1 + i % 300)}))
        .collect();
    let p: Pod = serde_json::from_value(json!({
        "metadata": {"name": "p"},
        "spec": {"containers": [{"name": "main", "resources": {"limits": {"nvidia.com/gpu": "1"}}, "envFrom": sources}]},
    }))
    .expect("pod");
    let started = std::time::Instant::now();
    assert_eq!(only(&p).devices, Devices::Known(1), "no prefix could set a variable");
    let admission = admit(&p, Some(&budget("8Gi", None, true)));
    assert!(admission.record.is_some());
    assert!(started.elapsed() < std::time::Duration::from_secs(5), "{:?}", started.elapsed());
}

/// The kubelet's environment, as Kubernetes builds it: each `envFrom` source's keys (prefixed) in order, the
/// later winning; then `env`, which wins over all of them.
fn kubelet_env(env: &[(String, String)], env_from: &[(String, Vec<(String, String)>)]) -> BTreeMap<String, String> {
    let mut out = BTreeMap::new();
    for (prefix, data) in env_from {
        for (key, value) in data {
            out.insert(format!("{prefix}{key}"), value.clone());
        }
    }
    for (name, value) in env {
        out.insert(name.clone(), value.clone());
    }
    out
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 1000, ..ProptestConfig::default() })]

    /// Whatever the ConfigMaps hold: a literal the caps module reads is the value the process gets, a variable
    /// it reads as absent is absent, and one it reads as `envFrom`'s is one some content could set.
    #[test]
    fn the_environment_is_read_as_the_kubelet_builds_it(
        env in proptest::collection::vec((0usize..5, "[0-9]{0,2}"), 0..4),
        env_from in proptest::collection::vec(
            (prop_oneof![Just(String::new()), Just("NVIDIA_".to_owned()), Just("CUDA_MPS_".to_owned()),
                         Just("APP_".to_owned()), Just(VISIBLE_DEVICES.to_owned()), "[A-Z_]{0,4}"],
             proptest::collection::vec((0usize..6, "[0-9]{1,2}"), 0..4)),
            0..4),
    ) {
        let names = [VISIBLE_DEVICES, MPS_LIMIT, MEMORY_LIMIT, MEMORY_REQUEST, "OTHER"];
        let env: Vec<(String, String)> = env.into_iter().map(|(n, v)| (names[n].to_owned(), v)).collect();
        // Keys a ConfigMap may hold: the suffixes of the variables after some prefix, and others.
        let env_from: Vec<(String, Vec<(String, String)>)> = env_from
            .into_iter()
            .map(|(prefix, data)| {
                let data = data
                    .into_iter()
                    .filter_map(|(k, v)| {
                        let key = names.get(k).and_then(|n| n.strip_prefix(prefix.as_str())).unwrap_or("KEY");
                        (!key.is_empty()).then(|| (key.to_owned(), v))
                    })
                    .collect();
                (prefix, data)
            })
            .collect();
        let vars: Vec<EnvVar> =
            env.iter().map(|(n, v)| EnvVar { name: n.clone(), value: Some(v.clone()), value_from: None }).collect();
        let sources: Vec<EnvFromSource> = env_from
            .iter()
            .map(|(prefix, _)| EnvFromSource {
                prefix: Some(prefix.clone()).filter(|p| !p.is_empty()),
                config_map_ref: Some(Default::default()),
                secret_ref: None,
            })
            .collect();
        let built = kubelet_env(&env, &env_from);
        for name in VARIABLES {
            match container_value(&vars, &sources, name) {
                Some(EnvValue::Literal(v)) => prop_assert_eq!(built.get(name), Some(&v), "{}", name),
                None => prop_assert!(!built.contains_key(name), "{} set by envFrom, read as absent", name),
                Some(EnvValue::FromEnvFrom { entry, .. }) => {
                    let prefix = &env_from[entry as usize].0;
                    prop_assert!(env_from_may_set(prefix, name) && !env.iter().any(|(n, _)| n == name));
                }
                Some(EnvValue::FromSource) => prop_assert!(false, "no valueFrom here"),
            }
        }
    }

    /// A count of devices is only ever one the process sees for certain: with a resource asked more than once,
    /// only a non-`.shared` one on nodes the pod is pinned to as unshared.
    #[test]
    fn replicas_never_count_as_distinct_devices(
        limits in proptest::collection::vec((0usize..4, 0u64..4), 1..4),
        pinned in proptest::collection::vec(any::<bool>(), 4),
    ) {
        let names = ["nvidia.com/gpu", "nvidia.com/gpu.shared", "nvidia.com/mig-1g.10gb", "nvidia.com/mig-2g.20gb.shared"];
        let mut map = BTreeMap::new();
        for (n, c) in &limits {
            map.insert(names[*n].to_owned(), c.to_string());
        }
        let selector: BTreeMap<String, String> = names
            .iter()
            .zip(&pinned)
            .filter(|(_, p)| **p)
            .map(|(n, _)| (format!("{n}.sharing-strategy"), "none".to_owned()))
            .collect();
        let read = gpu_limits(map.iter().map(|(k, v)| (k.as_str(), v.as_str())), Some(&selector));
        let total: u64 = map.values().map(|v| v.parse::<u64>().unwrap_or(0)).sum();
        prop_assert_eq!(read.count, total);
        let certain = map.iter().all(|(name, count)| {
            let count: u64 = count.parse().unwrap_or(0);
            count <= 1 || (!name.ends_with(".shared") && selector.contains_key(&format!("{name}.sharing-strategy")))
        });
        prop_assert_eq!(read.replicas.is_none(), certain, "{:?}", map);
        match devices(read, None, false) {
            Some(Devices::Known(n)) => prop_assert!(certain && u64::from(n) == total),
            Some(Devices::Unknown(_)) => prop_assert!(!certain),
            None => prop_assert_eq!(total, 0),
        }
    }
}
