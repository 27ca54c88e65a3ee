//! The real-cluster suite (e2e/cluster/run.sh) as a cargo test. It installs the chart into the cluster of
//! `KUBECONFIG`, so it runs only when asked with `GPUBUDGET_E2E_CLUSTER=1`: a `KUBECONFIG` that happens to
//! be set never sends `cargo test --workspace` to a cluster. Skipped, it says how to run it. It never talks
//! to the in-memory fake.

use std::path::Path;
use std::process::Command;

/// The switch that lets this test touch a cluster.
const SWITCH: &str = "GPUBUDGET_E2E_CLUSTER";

#[test]
fn user_stories_on_a_real_cluster() {
    if std::env::var(SWITCH).as_deref() != Ok("1") {
        eprintln!(
            "skipped: the real-cluster suite runs only when asked. To run it (it installs the chart into the \
             cluster of KUBECONFIG): {SWITCH}=1 KUBECONFIG=~/.kube/config cargo test -p gpubudget-e2e --test cluster \
             -- --nocapture (see e2e/cluster/README.md for building and loading the images)"
        );
        return;
    }
    let kubeconfig = std::env::var_os("KUBECONFIG").unwrap_or_else(|| panic!("{SWITCH}=1 but KUBECONFIG is not set"));
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("cluster/run.sh");
    let status = Command::new("bash").arg(&script).env("KUBECONFIG", kubeconfig).status().expect("bash runs");
    assert!(status.success(), "{} failed: {status}", script.display());
}
