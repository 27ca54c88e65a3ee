//! gpubudget node agent: samples GPU memory per process through NVML, attributes processes to pods
//! through `/proc/<pid>/cgroup`, and enforces `GpuMemoryBudget`s with events, pod annotations and the
//! Eviction API.
//!
//! - [`gpu`]: samplers (NVML, sample files);
//! - [`attribution`]: cgroup parsing and the PID cache;
//! - [`pods`]: the node's pods, joined by UID and container ID, with their budgets;
//! - [`enforce`]: per-pod usage, the pure decisions, the executors;
//! - [`synthetic`]: a synthetic node for the benchmarks and the soak harness;
//! - [`engine`]: one tick of the loop; [`run`], [`standalone`], [`top`], [`record`]: the subcommands.

pub mod attribution;
pub mod cli;
pub mod enforce;
pub mod engine;
pub mod gpu;
pub mod metrics;
pub mod pods;
pub mod record;
pub mod run;
pub mod standalone;
pub mod synthetic;
pub mod top;

/// Runs a parsed command line.
pub async fn dispatch(cli: cli::Cli) -> anyhow::Result<()> {
    match cli.command {
        cli::Command::Run(args) => run::run(args).await,
        cli::Command::Top(args) => top::run(args).await,
        cli::Command::Record(args) => record::run(args),
        cli::Command::Standalone(args) => standalone::run(args).await,
    }
}
