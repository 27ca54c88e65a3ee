//! Command line: `run` (the controller), `crd` (generate or check the CRD), `validate FILE...`.

use std::path::PathBuf;

use clap::{Parser, Subcommand};

/// gpubudget operator.
#[derive(Debug, Parser)]
#[command(name = "gpubudget-operator", version, about)]
pub struct Cli {
    /// What to do.
    #[command(subcommand)]
    pub command: Command,
}

/// Subcommands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Run the operator: GpuMemoryBudget status, leader election, the admin port and the eviction check.
    Run(crate::run::RunArgs),
    /// Print the GpuMemoryBudget CRD, or write/check the committed copies.
    Crd {
        /// Write crds/ and the chart's copy under --root.
        #[arg(long, conflicts_with = "check")]
        write: bool,
        /// Exit non-zero if the committed copies under --root differ from the types.
        #[arg(long)]
        check: bool,
        /// Repository root.
        #[arg(long, default_value = ".", env = "GPUBUDGET_REPO_ROOT")]
        root: PathBuf,
    },
    /// Check GpuMemoryBudget YAML files (multi-document) with the rules the API server enforces.
    Validate {
        /// Files to check; `-` reads standard input.
        #[arg(required = true)]
        files: Vec<PathBuf>,
    },
}

/// Runs a command; returns the process exit code.
pub fn dispatch(cli: Cli) -> anyhow::Result<i32> {
    match cli.command {
        Command::Run(args) => crate::run::run(args),
        Command::Crd { write: true, root, .. } => {
            for path in crate::crd::write(&root)? {
                eprintln!("wrote {}", path.display());
            }
            Ok(0)
        }
        Command::Crd { check: true, root, .. } => {
            let drifted = crate::crd::drifted(&root)?;
            for path in &drifted {
                eprintln!(
                    "{} differs from the Rust types; run `cargo run -p gpubudget-operator -- crd --write`",
                    path.display()
                );
            }
            Ok(i32::from(!drifted.is_empty()))
        }
        Command::Crd { .. } => {
            print!("{}", crate::crd::yaml()?);
            Ok(0)
        }
        Command::Validate { files } => crate::validate::run(&files),
    }
}
