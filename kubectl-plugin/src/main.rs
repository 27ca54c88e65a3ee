//! `kubectl-gpubudget`: see the library's documentation and docs/kubectl-plugin.md.

use std::process::ExitCode;

use clap::Parser;
use kubectl_gpubudget::cli::{Cli, Command};
use kubectl_gpubudget::error::Error;
use kubectl_gpubudget::render::{self, Output};
use kubectl_gpubudget::report::{API_VERSION, TopReport};
use kubectl_gpubudget::{api, top, why};

#[tokio::main(flavor = "current_thread")]
async fn main() -> ExitCode {
    let cli = Cli::parse();
    match run(cli).await {
        Ok(text) => {
            print!("{text}");
            ExitCode::SUCCESS
        }
        Err(error) => {
            eprintln!("error: {error}");
            ExitCode::FAILURE
        }
    }
}

/// A resource the command can do without: its error becomes a warning.
fn optional<T>(result: Result<T, Error>, warnings: &mut Vec<String>, without: &str) -> Result<Option<T>, Error> {
    match result {
        Ok(value) => Ok(Some(value)),
        Err(error) if error.is_forbidden() => {
            warnings.push(format!("{error}; {without}"));
            Ok(None)
        }
        Err(error) => Err(error),
    }
}

async fn run(cli: Cli) -> Result<String, Error> {
    let (client, namespace) = api::connect(&cli.connection).await?;
    match cli.command {
        Command::Top(args) => {
            let scope = (!args.all_namespaces).then_some(namespace.as_str());
            let pods = api::pods(&client, scope, args.selector.as_deref()).await?;
            let mut warnings = Vec::new();
            let budgets = optional(api::budgets(&client, scope).await, &mut warnings, "LIMIT and % are left out")?
                .unwrap_or_default();
            warnings.extend(budgets.unreadable.iter().cloned());
            let cluster = optional(
                api::cluster_budgets(&client).await,
                &mut warnings,
                "LIMIT and % of pods under a ClusterGpuMemoryBudget are left out",
            )?
            .unwrap_or_default();
            let measured = optional(
                api::measured(&client, None).await,
                &mut warnings,
                "USAGE is each pod's record's, written at its last state change (its budget's status has the latest)",
            )?
            .unwrap_or_default();
            let mut rows = top::rows(&pods, &top::limits(&budgets.items, &cluster), &measured);
            top::sort(&mut rows, args.sort_by);
            let report = TopReport { api_version: API_VERSION, kind: "GpuMemoryTop", pods: rows, warnings };
            Ok(match cli.output {
                Output::Text => {
                    let mut out = if report.pods.is_empty() {
                        String::new()
                    } else {
                        render::top_table(&report.pods, args.all_namespaces)
                    };
                    for w in &report.warnings {
                        eprintln!("warning: {w}");
                    }
                    if report.pods.is_empty() {
                        eprintln!(
                            "No pod with a gpubudget record {}.",
                            if args.all_namespaces {
                                "in any namespace".to_owned()
                            } else {
                                format!("in namespace {namespace}")
                            }
                        );
                        out.clear();
                    }
                    out
                }
                other => render::document(&report, other),
            })
        }
        Command::Why(args) => {
            let name = args.pod.strip_prefix("pod/").or_else(|| args.pod.strip_prefix("pods/")).unwrap_or(&args.pod);
            let pod = api::pod(&client, &namespace, name).await?;
            let mut warnings = Vec::new();
            let budgets = optional(
                api::budgets(&client, Some(&namespace)).await,
                &mut warnings,
                "which budget applies is taken from the agent's record, without the overlap",
            )?;
            warnings.extend(budgets.iter().flat_map(|b| b.unreadable.iter().cloned()));
            let specs = budgets.as_ref().map(|b| b.specs.clone()).unwrap_or_default();
            let events = optional(api::pod_events(&client, &namespace, name).await, &mut warnings, "no events shown")?
                .unwrap_or_default();
            let cluster_budgets = optional(
                api::cluster_budgets(&client).await,
                &mut warnings,
                "a ClusterGpuMemoryBudget may apply without being shown",
            )?;
            let namespace_labels = match cluster_budgets.as_ref().is_some_and(|c| !c.is_empty()) {
                true => optional(
                    api::namespace_labels(&client, &namespace).await,
                    &mut warnings,
                    "cluster budgets are matched as if the namespace had no labels",
                )?,
                false => None,
            };
            let node = pod.as_ref().and_then(|p| p.spec.as_ref()?.node_name.clone());
            let measured = match node {
                Some(node) => optional(
                    api::measured(&client, Some(&node)).await,
                    &mut warnings,
                    "the usage shown is the pod's record's, written at its last state change (its budget's status \
                     has the latest)",
                )?,
                None => None,
            };
            let uid = pod.as_ref().and_then(|p| p.metadata.uid.clone()).unwrap_or_default();
            let now = jiff::Timestamp::now();
            let report = why::why(why::WhyInput {
                measured: measured.and_then(|m| m.get(&uid).copied()),
                namespace: &namespace,
                name,
                pod: pod.as_ref(),
                budgets: budgets.as_ref().map(|b| b.items.as_slice()),
                specs: &specs,
                cluster_budgets: cluster_budgets.as_deref(),
                namespace_labels: namespace_labels.as_ref(),
                events: &events,
                now,
                warnings,
                critical_namespaces: &args.critical_namespaces,
            })
            .map_err(|why::NotFound| Error::PodNotFound { namespace: namespace.clone(), name: name.to_owned() })?;
            Ok(match cli.output {
                Output::Text => render::why_text(&report, now),
                other => render::document(&report, other),
            })
        }
    }
}
