//! End-to-end tests for gpubudget. The tests live in `tests/`:
//! - `cluster.rs` runs `cluster/run.sh` against the cluster in `KUBECONFIG` (skipped without one);
//! - `gpu/run.sh` is the real-GPU check, run by hand on a GPU machine (see docs/performance.md).
