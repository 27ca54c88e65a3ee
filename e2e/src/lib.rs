//! End-to-end tests for gpubudget. The tests live in `tests/`:
//! - `story.rs`: the user's stories in one process, on the `gpubudget-demo` harness (in-memory API);
//! - `cluster.rs` runs `cluster/run.sh` against the cluster in `KUBECONFIG`, only with
//!   `GPUBUDGET_E2E_CLUSTER=1` (skipped otherwise, saying how);
//! - `gpu/run.sh` is the real-GPU check, run by hand on a GPU machine (see docs/performance.md).
