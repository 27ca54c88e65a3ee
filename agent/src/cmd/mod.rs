//! The subcommands: [`run`] (the DaemonSet), [`top`] (GPU memory by pod on this host), [`capture`]
//! (write a sample file from NVML), [`standalone`] (enforce files, decisions as JSON lines) and [`relay`] (the
//! runtime-caps relay, holding the runtime's NRI socket).

pub mod capture;
pub mod driver_limits;
pub mod relay;
pub mod run;
pub mod standalone;
pub mod top;

use crate::cli;

/// Runs a parsed command line.
pub async fn dispatch(cli: cli::Cli) -> anyhow::Result<()> {
    // Flags that depend on each other, checked before anything starts.
    if let cli::Command::Run(cli::RunArgs { sample, .. })
    | cli::Command::Standalone(cli::StandaloneArgs { sample, .. }) = &cli.command
    {
        sample.cadence().map_err(anyhow::Error::msg)?;
    }
    match cli.command {
        cli::Command::Run(args) => run::run(args).await,
        cli::Command::Top(args) => top::run(args).await,
        cli::Command::Capture(args) => capture::run(args),
        cli::Command::Standalone(args) => standalone::run(args).await,
        cli::Command::DriverLimits(args) => driver_limits::run(&args),
        cli::Command::RuntimeCapsRelay(args) => relay::run(args).await,
    }
}
