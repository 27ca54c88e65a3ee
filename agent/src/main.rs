use std::process::ExitCode;

use clap::Parser as _;
use gpubudget_agent::cli::Cli;

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> ExitCode {
    let cli = Cli::parse();
    gpubudget_daemon::init_tracing(cli.log_format);
    match gpubudget_agent::dispatch(cli).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("gpubudget-agent: {error:#}");
            ExitCode::FAILURE
        }
    }
}
