//! The real-cluster suite (e2e/cluster/run.sh) as a cargo test. It installs the chart into the cluster of
//! `KUBECONFIG`, so it runs only when asked: it is ignored by a plain `cargo test` (which lists it with how
//! to run it), and runs with `-- --ignored` and `GPUBUDGET_E2E_CLUSTER=1`. Without the switch it never
//! touches a cluster, whatever `KUBECONFIG` says: asked to run without it (`--include-ignored`), it fails
//! saying how to run it (on the shared real node: `bash e2e/cluster/realk8s.sh`) rather than pass without
//! running. It never talks to the in-memory fake.

use std::path::Path;
use std::process::Command;

/// The switch that lets this test touch a cluster.
const SWITCH: &str = "GPUBUDGET_E2E_CLUSTER";

/// What a run without the switch says: the two ways to run this tier for real.
fn not_asked_message() -> String {
    format!(
        "not run: the real-cluster suite touches a cluster only with {SWITCH}=1. On the shared real node (realk8s: \
         kubelet, containerd; builds the release binaries and the images, brings the node up if needed, runs every \
         story and prints PASS): bash e2e/cluster/realk8s.sh. On a cluster of your own (it installs the chart into \
         the cluster of KUBECONFIG; images built and loaded as e2e/cluster/README.md says): {SWITCH}=1 \
         KUBECONFIG=~/.kube/config cargo test -p gpubudget-e2e --test cluster -- --ignored --nocapture"
    )
}

#[test]
#[ignore = "opt-in, installs the chart into the cluster of KUBECONFIG: GPUBUDGET_E2E_CLUSTER=1 \
            KUBECONFIG=~/.kube/config cargo test -p gpubudget-e2e --test cluster -- --ignored --nocapture; on the \
            shared real node: bash e2e/cluster/realk8s.sh (e2e/cluster/README.md)"]
fn user_stories_on_a_real_cluster() {
    assert!(std::env::var(SWITCH).as_deref() == Ok("1"), "{}", not_asked_message());
    let kubeconfig = std::env::var_os("KUBECONFIG").unwrap_or_else(|| panic!("{SWITCH}=1 but KUBECONFIG is not set"));
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("cluster/run.sh");
    let status = Command::new("bash").arg(&script).env("KUBECONFIG", kubeconfig).status().expect("bash runs");
    assert!(status.success(), "{} failed: {status}", script.display());
}

/// The message of a run without the switch names scripts that exist, so following it runs the tier.
#[test]
fn the_not_asked_message_names_scripts_that_exist() {
    let message = not_asked_message();
    let repo = Path::new(env!("CARGO_MANIFEST_DIR")).parent().expect("e2e/ is in the repository");
    for script in ["e2e/cluster/realk8s.sh", "e2e/cluster/README.md"] {
        assert!(message.contains(script), "the message does not name {script}: {message}");
        assert!(repo.join(script).is_file(), "{script}, named by the message, does not exist");
    }
    assert!(message.contains("bash e2e/cluster/realk8s.sh"), "the message does not say how to run it: {message}");
}
