//! The real-cluster suite (e2e/cluster/run.sh) as a cargo test. It needs a cluster in KUBECONFIG; without
//! one it is skipped and says how to run it. It never talks to the in-memory fake.

use std::path::Path;
use std::process::Command;

#[test]
fn user_stories_on_a_real_cluster() {
    let Some(kubeconfig) = std::env::var_os("KUBECONFIG") else {
        eprintln!(
            "skipped: no cluster (KUBECONFIG is not set). To run the real-cluster suite: \
             KUBECONFIG=~/.kube/config cargo test -p gpubudget-e2e --test cluster -- --nocapture \
             (see e2e/cluster/README.md for building and loading the images)"
        );
        return;
    };
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("cluster/run.sh");
    let status = Command::new("bash").arg(&script).env("KUBECONFIG", kubeconfig).status().expect("bash runs");
    assert!(status.success(), "{} failed: {status}", script.display());
}
