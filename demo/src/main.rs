//! `gpubudget-demo`: the whole system on this machine, no cluster and no GPU needed. See the crate docs.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context as _;
use clap::Parser;
use gpubudget_demo::scenario::{self, Until};
use gpubudget_demo::stack::{Stack, kubelet_like_api};
use gpubudget_testkit::kubeconfig_yaml;

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
    /// Components' logs too (warnings are always shown).
    #[arg(long, env = "GPUBUDGET_DEMO_VERBOSE")]
    verbose: bool,
}

async fn demo(args: Args) -> anyhow::Result<bool> {
    let fake = kubelet_like_api();
    let (addr, server) = fake.serve(args.listen).await.with_context(|| format!("cannot listen on {}", args.listen))?;
    let url = format!("http://{addr}");
    let path = args.kubeconfig.unwrap_or_else(|| std::env::temp_dir().join("gpubudget-demo.kubeconfig"));
    std::fs::write(&path, kubeconfig_yaml(&url)).with_context(|| format!("cannot write {}", path.display()))?;
    println!("in-memory API server (a fake, not a cluster) at {url}");
    println!("kubeconfig written: export KUBECONFIG={}", path.display());
    println!("then: kubectl get gmb -A | kubectl get events -A -w | kubectl describe gmb -n team-a llm-inference\n");
    let config = kube::Config::new(url.parse().context("server URL")?);
    let client = kube::Client::try_from(config).context("client for the in-memory API server")?;
    let stack = Stack::new(fake).with_client(client);
    let shutdown = stack.shutdown();
    tokio::spawn({
        let shutdown = shutdown.clone();
        async move {
            if tokio::signal::ctrl_c().await.is_ok() {
                shutdown.cancel();
            }
        }
    });
    let until = if args.until_evicted { Until::Evicted } else { Until::Shutdown };
    let (outcome, stack) = scenario::run(stack, until, |line| println!("{line}")).await;
    stack.stop().await;
    server.abort();
    println!("\nstopped");
    Ok(outcome.evicted)
}

#[tokio::main]
async fn main() -> ExitCode {
    let args = Args::parse();
    let filter = if args.verbose { "info" } else { "warn" };
    gpubudget_daemon::init_tracing_with(gpubudget_daemon::LogFormat::Text, filter);
    let until_evicted = args.until_evicted;
    match demo(args).await {
        Ok(evicted) if evicted || !until_evicted => ExitCode::SUCCESS,
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
