//! What the caps webhook makes of hostile `CUDA_MPS_PINNED_DEVICE_MEM_LIMIT` values (issue 32), for the check
//! on a real GPU under an MPS daemon (`e2e/gpu/caps-values.sh`): for each value a tenant might write into a
//! one-GPU container, the value the webhook writes (`caps::admit` under a budget with `admissionCaps: Enabled`)
//! and whether gpubudget counts the *written* value, and the *raw* one (a pod created while the webhook was
//! down), as capped. One tab-separated line per value: `name`, `raw`, `raw verdict`, `written`, `written verdict`.
//!
//! ```sh
//! cargo run -q -p gpubudget-operator --example caps_values -- 3Gi > values.tsv
//! ```

use gpubudget_common::caps::{self, ContainerCap, GpuContainer};
use gpubudget_common::{Budget, GpuMemoryBudget};
use k8s_openapi::api::core::v1::Pod;

/// Values a tenant might write, with a name: every spelling measured on the H100 (FIELD_NOTES), honoured or
/// ignored by the driver, and a few more.
const VALUES: &[(&str, &str)] = &[
    ("canonical-larger", "0=65536M"),
    ("canonical-smaller", "0=2048M"),
    ("lower-m", "0=2048m"),
    ("MB", "0=2048MB"),
    ("MiB", "0=2048MiB"),
    ("Mi", "0=2048Mi"),
    ("G", "0=2G"),
    ("g", "0=2g"),
    ("Gi", "0=2Gi"),
    ("GB", "0=2GB"),
    ("spaces-around-eq", "0 = 2048M"),
    ("leading-zeros", "0=02048M"),
    ("duplicate-larger-last", "0=2048M,0=60000M"),
    ("K", "0=2097152K"),
    ("bytes", "0=2147483648"),
    ("zero", "0=0"),
    ("zero-M", "0=0M"),
    ("leading-space", " 0=2048M"),
    ("unseen-ordinal", "0=1000M,7=1M"),
    ("unseen-only", "1=2048M"),
    ("junk-entry", "0=2048M,junk"),
    ("no-device", "2G"),
    ("T", "0=1T"),
    ("unicode-digit", "0=２048M"),
    ("huge", "0=99999999999999999999M"),
];

fn main() -> anyhow::Result<()> {
    let limit = std::env::args().nth(1).unwrap_or_else(|| "3Gi".into());
    let budget: GpuMemoryBudget = serde_yaml::from_str(&format!(
        "apiVersion: gpubudget.io/v1alpha1\nkind: GpuMemoryBudget\nmetadata: {{name: b, namespace: t}}\n\
         spec: {{selector: {{}}, limit: {limit}, admissionCaps: Enabled}}"
    ))?;
    let budget = Budget::compile(&budget)?;
    for (name, raw) in VALUES {
        let pod = serde_json::json!({
            "apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p", "namespace": "t"},
            "spec": {"containers": [{"name": "main", "image": "x",
                "env": [{"name": caps::MPS_LIMIT, "value": raw}],
                "resources": {"limits": {"nvidia.com/gpu": "1"}}}]},
        });
        let admission = caps::admit(&serde_json::from_value::<Pod>(pod.clone())?, Some(&budget));
        let patch: json_patch::Patch = serde_json::from_value(serde_json::Value::Array(admission.patch))?;
        let mut written = pod.clone();
        json_patch::patch(&mut written, &patch)?;
        let verdict = |pod: &serde_json::Value| -> anyhow::Result<(String, String)> {
            let pod: Pod = serde_json::from_value(pod.clone())?;
            let container = &pod.spec.as_ref().map(|s| s.containers.clone()).unwrap_or_default()[0];
            let value = caps::env_value(container.env.as_deref().unwrap_or_default(), caps::MPS_LIMIT)
                .and_then(|v| v.literal().map(str::to_owned))
                .unwrap_or_default();
            let held = GpuContainer::of(container, None).map(|c| caps::held(&c));
            let said = match held {
                Some(ContainerCap::Capped { max_mib }) => format!("capped {max_mib} MiB"),
                Some(ContainerCap::Uncapped(why)) => format!("uncapped: {why}"),
                None => "not a GPU container".into(),
            };
            Ok((value, said))
        };
        let (raw_value, raw_verdict) = verdict(&pod)?;
        let (written_value, written_verdict) = verdict(&written)?;
        println!("{name}\t{raw_value}\t{raw_verdict}\t{written_value}\t{written_verdict}");
    }
    Ok(())
}
