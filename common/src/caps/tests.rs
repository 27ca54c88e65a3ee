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

const TWO_CONTAINERS: &str = r#"
metadata: {generateName: trainer-, namespace: team-a, labels: {app: llm}}
spec:
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
    let count = |pairs: &[(&str, &str)]| device_count(pairs.iter().copied());
    assert_eq!(count(&[("nvidia.com/gpu", "2"), ("memory", "8Gi")]), 2);
    assert_eq!(count(&[("nvidia.com/gpu.shared", "1")]), 1);
    assert_eq!(count(&[("nvidia.com/gpu", "0")]), 0);
    assert_eq!(count(&[("nvidia.com/gpu", "lots")]), 0);
    assert_eq!(count(&[("amd.com/gpu", "1")]), 0);
    assert_eq!(count(&[("nvidia.com/gpu", "100000")]), MAX_DEVICES);
    let p = pod(TWO_CONTAINERS);
    let found = gpu_containers(&p);
    assert_eq!(found.len(), 1);
    assert_eq!((found[0].0.as_str(), found[0].2.devices), ("/spec/containers/0", 2));
    assert_eq!(found[0].2.mps_limit, Some(EnvValue::Literal("0=4G,1=99G".into())));
}

#[test]
fn caps_are_whole_mib_rounded_down_and_need_the_opt_in() {
    assert_eq!(Caps::of(&budget("8Gi", Some("6Gi"), true)), Some(Caps { limit_mib: 8192, request_mib: Some(6144) }));
    assert_eq!(Caps::of(&budget("8G", None, true)), Some(Caps { limit_mib: 7629, request_mib: None }));
    assert_eq!(Caps::of(&budget("8Gi", None, false)), None);
    assert_eq!(Caps::of(&budget("1000Ki", None, true)), None, "under 1 MiB cannot be written");
}

#[test]
fn the_mps_variable_has_one_entry_per_device_and_keeps_smaller_ones() {
    assert_eq!(merge_mps(None, 2, 8192), "0=8192M,1=8192M");
    // A bare amount is ignored by the driver: replaced by per-device entries.
    assert_eq!(merge_mps(Some("4G"), 1, 8192), "0=8192M");
    assert_eq!(merge_mps(Some("0=4G"), 1, 8192), "0=4G");
    assert_eq!(merge_mps(Some("0=16G"), 1, 8192), "0=8192M");
    assert_eq!(merge_mps(Some("0=8G"), 1, 8192), "0=8G", "equal to the cap is kept");
    assert_eq!(merge_mps(Some("0=lots"), 1, 8192), "0=8192M");
    assert_eq!(merge_mps(Some("0=4G,1=99G"), 2, 8192), "0=4G,1=8192M");
    assert_eq!(merge_mps(Some(" 1=1000M , 0=2000M"), 2, 8192), "0=2000M,1=1000M");
    // A device named twice: kept only if both fit, as the smaller.
    assert_eq!(merge_mps(Some("0=2G,0=3G"), 1, 8192), "0=2G");
    assert_eq!(merge_mps(Some("0=2G,0=30G"), 1, 8192), "0=8192M");
    // UUIDs and ordinals the container does not see: kept when they fit, dropped when not.
    assert_eq!(merge_mps(Some("GPU-ab12=2G,GPU-cd34=20G,5=1G"), 1, 8192), "0=8192M,GPU-ab12=2G,5=1G");
    // Bytes without a unit, and units read the largest way (binary), rounded up to MiB.
    assert_eq!(merge_mps(Some("0=1048577"), 1, 1), "0=1M");
    assert_eq!(merge_mps(Some("0=1048576"), 1, 1), "0=1048576");
}

#[test]
fn admission_patches_only_the_gpu_containers_variables_and_records_it() {
    let p = pod(TWO_CONTAINERS);
    let admission = admit(&p, Some(&budget("8Gi", Some("6Gi"), true)));
    assert_eq!(
        admission.patch,
        vec![
            json!({"op": "replace", "path": "/spec/containers/0/env/1",
                   "value": {"name": MPS_LIMIT, "value": "0=4G,1=8192M"}}),
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
            (MPS_LIMIT.into(), "0=4G,1=8192M".into()),
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

fn gpu(devices: u32, mps: Option<&str>, limit: Option<&str>) -> GpuContainer {
    GpuContainer {
        name: "main".into(),
        devices,
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
    assert_eq!(assess(&[gpu(1, Some("0=8192M,GPU-x=9G"), None)], caps), Assessment::AboveLimit);
    assert_eq!(
        assess(&[gpu(1, Some("0=1G"), None), gpu(1, None, None)], caps),
        Assessment::Uncapped,
        "every GPU container counts"
    );
}

// ---- properties --------------------------------------------------------------------------------------

fn amount() -> impl Strategy<Value = String> {
    prop_oneof![
        (1u64..40_000).prop_map(|m| format!("{m}M")),
        (1u64..40).prop_map(|g| format!("{g}G")),
        (1u64..1 << 34).prop_map(|b| b.to_string()),
        Just("lots".to_owned()),
    ]
}

fn mps_text() -> impl Strategy<Value = Option<String>> {
    let entry = prop_oneof![
        (0u32..4, amount()).prop_map(|(d, a)| format!("{d}={a}")),
        amount(),
        amount().prop_map(|a| format!("GPU-1234={a}")),
    ];
    proptest::option::of(proptest::collection::vec(entry, 1..4).prop_map(|v| v.join(",")))
}

fn mib_text() -> impl Strategy<Value = Option<String>> {
    proptest::option::of(prop_oneof![(1u64..40_000).prop_map(|m| m.to_string()), Just("8Gi".to_owned())])
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
        "spec": {"containers": [
            {"name": "main", "resources": {"limits": {"nvidia.com/gpu": devices.to_string()}}, "env": env},
            {"name": "cpu", "env": [{"name": MEMORY_LIMIT, "value": "123456"}]},
        ]},
    }))
    .expect("pod")
}

proptest! {
    #[test]
    fn caps_never_exceed_the_budget_apply_once_and_keep_smaller_values(
        devices in 1u32..4,
        mps in mps_text(),
        limit in mib_text(),
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
        let containers: Vec<GpuContainer> = gpu_containers(&once).into_iter().map(|(_, _, g)| g).collect();
        prop_assert_eq!(assess(&containers, caps), Assessment::Capped);
        let main = &containers[0];
        if let Some(EnvValue::Literal(v)) = &main.memory_limit {
            prop_assert!(v.parse::<u64>().is_ok_and(|v| v <= limit_mib));
        } else {
            prop_assert!(false, "no limit variable");
        }
        // Applying twice changes no container (the record then says "kept" for what the first set).
        let twice = apply(&once, &admit(&once, Some(&b)).patch);
        prop_assert_eq!(&twice.spec, &once.spec);
        // A user's smaller value survives as written.
        if let Some(l) = limit.as_ref().filter(|l| l.parse::<u64>().is_ok_and(|v| v <= limit_mib)) {
            prop_assert_eq!(main.memory_limit.clone(), Some(EnvValue::Literal(l.clone())));
        }
        let out = match &main.mps_limit { Some(EnvValue::Literal(v)) => v.clone(), _ => String::new() };
        for entry in mps.iter().flat_map(|m| mps_entries(m)) {
            let alone = entry.device.parse::<u32>().is_ok_and(|d| d < devices)
                && mps_entries(mps.as_deref().unwrap_or_default()).iter().filter(|e| e.device == entry.device).count() == 1;
            if alone && entry.mib.is_some_and(|m| m <= limit_mib) {
                prop_assert!(out.split(',').any(|e| e == entry.text), "{} lost from {}", entry.text, out);
            }
        }
        // Nothing else is touched; the annotation is ours.
        prop_assert_eq!(&env_of(&once, 0)[0], &("KEEP".to_owned(), "me".to_owned()));
        prop_assert_eq!(env_of(&once, 1), env_of(&p, 1));
        let record: Record = serde_json::from_str(&once.metadata.annotations.clone().unwrap_or_default()[ANNOTATION])
            .expect("our record");
        prop_assert_eq!(record.budget, "b");
    }
}
