//! gpubudget node agent. The code follows the data, one stage per module, each using only the stages
//! before it:
//!
//! 1. [`sample`] — what the GPUs hold, per process (NVML, or a replayed sample file);
//! 2. [`attribute`] — what Kubernetes says of the node's pods and budgets ([`attribute::kube`]), PID → container →
//!    pod (the `/proc` join), and the pure per-pod sum;
//! 3. [`decide`] — the pure decisions (records, events, evictions); no I/O, no logging;
//! 4. [`act`] — the executors that carry decisions out (the API server, or JSON lines);
//! 5. [`report`] — the metrics, and what `top` shows.
//!
//! Beside the tick, [`runtime_caps`] is an edge of its own: an input of the node's state (what the runtime made)
//! and an actor at each container's creation (NRI), through a relay that alone holds the runtime's socket.
//!
//! [`pipeline`] runs stages 1–3 and 5 once per tick; [`cmd`] holds the subcommands (`run`, `top`,
//! `capture`, `standalone`) that wire the pipeline to its inputs and an executor, and nothing more.

pub mod sample;

pub mod attribute;

pub mod decide;

pub mod act;

pub mod report;

pub mod runtime_caps;

pub mod cli;
pub mod cmd;
pub mod pipeline;

pub use cmd::dispatch;

/// A hash map for what a tick looks up per pod and per process (keys are UIDs and names from the API server;
/// foldhash, seeded per process, instead of SipHash).
pub type FastMap<K, V> = std::collections::HashMap<K, V, foldhash::fast::RandomState>;
