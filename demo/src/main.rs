//! `gpubudget-demo`: the whole system on this machine, no cluster and no GPU needed. See the crate docs.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;

use clap::Parser;
use gpubudget_demo::scenario::Until;
use gpubudget_demo::session::{self, Options};
use tokio_util::sync::CancellationToken;

/// gpubudget in one process: an in-memory API server on 127.0.0.1 (kubectl works against it), the
/// operator, the agent, and GPU usage replayed from an H100 recording. Ctrl-C stops it.
#[derive(Debug, Parser)]
#[command(name = "gpubudget-demo", version, about)]
struct Args {
    /// Where the in-memory API server listens (port 0: any free port).
    #[arg(long, env = "GPUBUDGET_DEMO_LISTEN", default_value = "127.0.0.1:0")]
    listen: SocketAddr,
    /// Where to write the kubeconfig for kubectl (default: gpubudget-demo.kubeconfig in the temp dir).
    #[arg(long, env = "GPUBUDGET_DEMO_KUBECONFIG")]
    kubeconfig: Option<PathBuf>,
    /// Stop once the eviction is counted instead of running until Ctrl-C.
    #[arg(long, env = "GPUBUDGET_DEMO_UNTIL_EVICTED")]
    until_evicted: bool,
    /// Also write what it printed into this page, between its demo-output markers (docs/demo.md); with
    /// --until-evicted.
    #[arg(long, value_name = "PAGE", requires = "until_evicted")]
    update_doc: Option<PathBuf>,
    /// Components' logs too (warnings are always shown).
    #[arg(long, env = "GPUBUDGET_DEMO_VERBOSE")]
    verbose: bool,
}

#[tokio::main]
async fn main() -> ExitCode {
    let args = Args::parse();
    let filter = if args.verbose { "info" } else { "warn" };
    gpubudget_daemon::init_tracing_with(gpubudget_daemon::LogFormat::Text, filter);
    let options = Options {
        listen: args.listen,
        kubeconfig: args.kubeconfig.unwrap_or_else(|| std::env::temp_dir().join("gpubudget-demo.kubeconfig")),
        until: if args.until_evicted { Until::Evicted } else { Until::Shutdown },
    };
    let shutdown = CancellationToken::new();
    tokio::spawn({
        let shutdown = shutdown.clone();
        async move {
            if tokio::signal::ctrl_c().await.is_ok() {
                shutdown.cancel();
            }
        }
    });
    let mut printed = String::new();
    let result = session::session(options, shutdown, |line| {
        println!("{line}");
        printed.push_str(line);
        printed.push('\n');
    })
    .await;
    match result {
        Ok((outcome, _)) if outcome.evicted || !args.until_evicted => {
            if let Some(page) = args.update_doc {
                if let Err(error) = session::update_doc(&page, &printed) {
                    eprintln!("gpubudget-demo: {error:#}");
                    return ExitCode::FAILURE;
                }
                eprintln!("gpubudget-demo: {} updated", page.display());
            }
            ExitCode::SUCCESS
        }
        Ok(_) => {
            eprintln!("gpubudget-demo: stopped before the eviction was counted");
            ExitCode::FAILURE
        }
        Err(error) => {
            eprintln!("gpubudget-demo: {error:#}");
            ExitCode::FAILURE
        }
    }
}
