//! gpubudget in one process, on any machine: the in-memory API (gpubudget-testkit, served over HTTP on
//! 127.0.0.1 so `kubectl` can talk to it), the operator, the agent, and GPU usage replayed from the H100
//! recording through a kubelet-shaped `/proc`.
//!
//! - [`stack`]: the harness (also what the in-process tests run on);
//! - [`scenario`]: the demo's budgets, pods and usage over time, and what it prints;
//! - [`session`]: the binary's run (the API served, the kubeconfig, the story), and docs/demo.md's sample of it.

pub mod scenario;
pub mod session;
pub mod stack;
