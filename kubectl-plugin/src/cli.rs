//! The command line, with kubectl's connection flags.

use clap::{Args, Parser, Subcommand};

use crate::render::Output;
use crate::top::SortBy;

/// GPU memory budgets from kubectl: what pods hold (`top`) and why a pod got its budget, its state or its
/// eviction (`why`). Reads only the API: pods and the records gpubudget's agents write on them,
/// GpuMemoryBudgets and their status, and Events.
#[derive(Debug, Parser)]
#[command(name = "kubectl gpubudget", bin_name = "kubectl gpubudget", version)]
pub struct Cli {
    #[command(flatten)]
    pub connection: Connection,
    /// Output format: text (the default), json or yaml (a versioned document: docs/kubectl-plugin.md).
    #[arg(short = 'o', long, global = true, value_enum, default_value_t = Output::Text)]
    pub output: Output,
    #[command(subcommand)]
    pub command: Command,
}

/// kubectl's connection flags, with its meaning: `KUBECONFIG` (several files, merged) is honoured.
#[derive(Debug, Clone, Default, Args)]
pub struct Connection {
    /// Path to the kubeconfig file (default: $KUBECONFIG, else ~/.kube/config, else the in-cluster account).
    #[arg(long, global = true, value_name = "PATH")]
    pub kubeconfig: Option<std::path::PathBuf>,
    /// The kubeconfig context to use.
    #[arg(long, global = true, value_name = "NAME")]
    pub context: Option<String>,
    /// The kubeconfig cluster to use.
    #[arg(long, global = true, value_name = "NAME")]
    pub cluster: Option<String>,
    /// The kubeconfig user to use.
    #[arg(long, global = true, value_name = "NAME")]
    pub user: Option<String>,
    /// The namespace (default: the context's, else `default`).
    #[arg(short = 'n', long, global = true, value_name = "NAMESPACE")]
    pub namespace: Option<String>,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// GPU memory by pod across nodes, from the agents' records.
    Top(TopArgs),
    /// Which budget applies to a pod and why, its state, time over, caps, last events, and what happens next.
    Why(WhyArgs),
}

#[derive(Debug, Args)]
pub struct TopArgs {
    /// Every namespace (needs list on pods cluster-wide).
    #[arg(short = 'A', long)]
    pub all_namespaces: bool,
    /// Only pods with these labels (`app=llm,tier!=dev`), as `kubectl get -l`.
    #[arg(short = 'l', long, value_name = "SELECTOR")]
    pub selector: Option<String>,
    /// The order of the rows.
    #[arg(long, value_enum, default_value_t = SortBy::Usage)]
    pub sort_by: SortBy,
}

#[derive(Debug, Args)]
pub struct WhyArgs {
    /// The pod's name (`pod/NAME` works too); it may be gone.
    pub pod: String,
    /// The namespaces whose critical-priority pods gpubudget never evicts: the chart's `criticalNamespaces`
    /// (comma-separated; the agents' `GPUBUDGET_CRITICAL_NAMESPACES`). Elsewhere critical priority exempts
    /// nothing.
    #[arg(long, env = "GPUBUDGET_CRITICAL_NAMESPACES", default_value = "kube-system")]
    pub critical_namespaces: gpubudget_common::CriticalNamespaces,
}
