//! End-to-end tests for gpubudget. The tests live in `tests/`:
//! - `story.rs`: the user's stories in one process, on the `gpubudget-demo` harness (in-memory API);
//! - `apiserver.rs` (with its harness and stories in `tests/apiserver/`) drives the release binaries against a real
//!   kube-apiserver over a `kube::Client`, and `cluster.rs` runs `cluster/run.sh` against the cluster in
//!   `KUBECONFIG`: both ignored unless asked (`-- --ignored` with
//!   `GPUBUDGET_E2E_APISERVER=1` or `GPUBUDGET_E2E_CLUSTER=1`; the ignore reason says how);
//! - `gpu/run.sh` is the real-GPU check, run by hand on a GPU machine (see docs/performance.md).
