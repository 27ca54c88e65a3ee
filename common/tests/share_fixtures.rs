//! Pods as the GPU-sharing tools leave them (common/tests/fixtures/shares, each citing the tool's source),
//! read as a node would: the declared share and what it comes to on an H100.

use std::collections::BTreeMap;

use gpubudget_common::share::{Declaration, Sources, declared, resolve};
use k8s_openapi::api::core::v1::{Node, Pod};
use serde::Deserialize;

/// An H100's memory as NVML reports it.
const H100: u64 = 81_559 << 20;
const MIB: u64 = 1 << 20;

/// The pods of a fixture file, by name, and the labels of the Node document if it has one.
fn fixture(file: &str) -> (BTreeMap<String, Pod>, Option<BTreeMap<String, String>>) {
    let path = format!("{}/tests/fixtures/shares/{file}", env!("CARGO_MANIFEST_DIR"));
    let text = std::fs::read_to_string(&path).expect("fixture");
    let (mut pods, mut node) = (BTreeMap::new(), None);
    for doc in serde_yaml::Deserializer::from_str(&text) {
        let value = serde_yaml::Value::deserialize(doc).expect("yaml");
        match value.get("kind").and_then(|k| k.as_str()) {
            Some("Pod") => {
                let pod: Pod = serde_yaml::from_value(value).expect("pod");
                pods.insert(pod.metadata.name.clone().expect("name"), pod);
            }
            Some("Node") => node = serde_yaml::from_value::<Node>(value).expect("node").metadata.labels,
            _ => {}
        }
    }
    (pods, node)
}

/// The one pod of a fixture: its share on one H100.
fn share_of(file: &str) -> Result<(u64, String), String> {
    let (pods, node) = fixture(file);
    assert_eq!(pods.len(), 1, "{file}: one pod");
    let pod = pods.values().next().expect("pod");
    match declared(pod, node.as_ref(), Sources::ALL) {
        Declaration::Share(terms) => resolve(&terms, &[H100]).map(|r| (r.bytes, r.text)).map_err(|e| e.to_string()),
        Declaration::None => Err("none".into()),
        Declaration::Invalid { faults, .. } => Err(format!("invalid: {}", faults[0].1)),
    }
}

#[test]
fn kai_fractions_and_memory_after_the_binder() {
    assert_eq!(share_of("kai-fraction.yaml"), Ok((H100 / 2, "KAI gpu-fraction 0.5 of 79.6Gi = 39.8Gi".into())));
    let (bytes, text) = share_of("kai-fraction-multi.yaml").expect("resolves");
    assert_eq!((bytes, text.as_str()), (H100 / 4 * 2, "KAI gpu-fraction 0.25 × 2 GPUs of 79.6Gi = 39.8Gi"));
    assert_eq!(share_of("kai-memory.yaml"), Ok((20_000 * MIB, "KAI gpu-memory 20000 MiB = 19.5Gi".into())));
}

#[test]
fn hami_memory_and_percentage() {
    assert_eq!(share_of("hami-gpumem.yaml"), Ok((20_000 * MIB, "HAMi gpumem 20000 MiB = 19.5Gi".into())));
    let (bytes, text) = share_of("hami-gpumem-percentage.yaml").expect("resolves");
    assert_eq!(bytes, H100 / 4 * 2);
    assert_eq!(text, "HAMi gpumem-percentage 25 × 2 GPUs of 79.6Gi = 39.8Gi");
}

#[test]
fn device_plugin_mps_replicas_have_a_share_and_time_slicing_none() {
    assert_eq!(
        share_of("device-plugin-mps.yaml"),
        Ok((H100 / 4, "MPS replica of 4 per GPU of 79.6Gi = 19.9Gi".into()))
    );
    assert_eq!(share_of("device-plugin-time-slicing.yaml"), Err("none".into()));
}

#[test]
fn a_dra_claim_is_not_read_yet() {
    assert_eq!(share_of("dra-claim.yaml"), Err("none".into()));
}

#[test]
fn hostile_values_are_unresolved_and_forged_ones_ignored() {
    let (pods, node) = fixture("hostile.yaml");
    assert!(pods.len() >= 14);
    for (name, pod) in &pods {
        let d = declared(pod, node.as_ref(), Sources::ALL);
        match name.as_str() {
            // Annotations on a pod KAI did not place, and HAMi's allocation annotations: nobody's share.
            "hostile-kai-bypass" | "hostile-hami-forged-alloc" => assert_eq!(d, Declaration::None, "{name}"),
            _ => {
                let why = d.fault(Sources::ALL).unwrap_or_else(|| panic!("{name}: {d:?}")).to_string();
                assert!(why.len() < 200, "{name}: a bounded reason: {why}");
            }
        }
    }
}

/// #51: every fixture's pods as a real API server stored them (`stored/`, kube-apiserver 1.32: `20000` became `20k`)
/// declare exactly what they declare as written, hostile ones included (unresolved both ways).
#[test]
fn the_api_servers_stored_form_declares_the_same_share() {
    let dir = format!("{}/tests/fixtures/shares", env!("CARGO_MANIFEST_DIR"));
    let mut compared = 0;
    for entry in std::fs::read_dir(format!("{dir}/stored")).expect("stored fixtures") {
        let path = entry.expect("entry").path();
        let name = path.file_stem().and_then(|s| s.to_str()).expect("name").to_owned();
        let list: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&path).expect("read")).expect("json");
        let (written, node) = fixture(&format!("{name}.yaml"));
        let items = list["items"].as_array().expect("items");
        assert_eq!(items.len(), written.len(), "{name}: every pod stored");
        for item in items {
            let stored: Pod = serde_json::from_value(item.clone()).expect("pod");
            let pod_name = stored.metadata.name.clone().expect("name");
            let as_written = declared(&written[&pod_name], node.as_ref(), Sources::ALL);
            let as_stored = declared(&stored, node.as_ref(), Sources::ALL);
            match (&as_written, &as_stored) {
                (Declaration::Invalid { .. }, Declaration::Invalid { .. }) => {
                    assert_eq!(as_written.fault(Sources::ALL).is_some(), as_stored.fault(Sources::ALL).is_some())
                }
                _ => assert_eq!(as_written, as_stored, "{name}/{pod_name}"),
            }
            compared += 1;
        }
    }
    assert!(compared >= 24, "{compared} pods compared");
}
