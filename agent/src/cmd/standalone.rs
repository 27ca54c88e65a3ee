//! `gpubudget-agent standalone`: the agent's decisions without an API server. Budgets and pods come from
//! files (re-read when they change), GPU usage from NVML or a sample file, and every decision is written
//! as a JSON line with a timestamp (`ts`, RFC 3339 with milliseconds, and `ts_unix`). Evictions are
//! logged as requested and taken as accepted. The real-GPU check (`e2e/gpu/run.sh`) runs this.
//!
//! Lines (`kind`): `start`; `transition` (state change: `from`, `to`, `usage_bytes`, `limit_bytes`,
//! `budget`); `apply` (the annotations that would be written); `event` (`reason`, `type`, `note`);
//! `evict` (`grace_period_seconds`); `clear`; `usage` (with `--log-usage`); `sample_error`; `stats` (at
//! exit: tick and sampling times).

use std::collections::HashMap;
use std::io::Write;
use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::Context as _;
use gpubudget_common::GpuMemoryBudget;
use k8s_openapi::api::core::v1::Pod;
use prometheus_client::registry::Registry;
use serde::de::DeserializeOwned;
use serde_json::json;

use crate::act::log::{LogExecutor, timestamp_fields};
use crate::attribute::ProcAttributor;
use crate::attribute::pods::{PodTable, PodView};
use crate::cli::StandaloneArgs;
use crate::decide::Settings;
use crate::pipeline::Engine;
use crate::report::metrics::Metrics;
use crate::sample::SamplerSlot;
use crate::sample::file::FileWatch;

/// Reads Kubernetes objects from YAML or JSON: one or several documents, each an object or a `…List`.
pub fn load_objects<T: DeserializeOwned>(path: &Path) -> anyhow::Result<Vec<T>> {
    let text = std::fs::read_to_string(path).with_context(|| format!("cannot read {}", path.display()))?;
    parse_objects(&text).with_context(|| format!("in {}", path.display()))
}

/// [`load_objects`] on text.
pub fn parse_objects<T: DeserializeOwned>(text: &str) -> anyhow::Result<Vec<T>> {
    let mut out = Vec::new();
    for (n, document) in serde_yaml::Deserializer::from_str(text).enumerate() {
        let value = serde_yaml::Value::deserialize(document).with_context(|| format!("document {}", n + 1))?;
        if value.is_null() {
            continue;
        }
        let is_list = value.get("kind").and_then(|k| k.as_str()).is_some_and(|k| k.ends_with("List"));
        let items = match (is_list, value.get("items")) {
            (true, Some(serde_yaml::Value::Sequence(items))) => items.clone(),
            _ => vec![value],
        };
        for (i, item) in items.into_iter().enumerate() {
            out.push(serde_yaml::from_value(item).with_context(|| format!("document {}, object {}", n + 1, i + 1))?);
        }
    }
    Ok(out)
}

use serde::Deserialize as _;

struct Inputs {
    pods: FileWatch,
    budgets: FileWatch,
}

impl Inputs {
    fn changed(&mut self) -> anyhow::Result<bool> {
        let a = self.pods.changed().with_context(|| format!("{}", self.pods.path().display()))?;
        let b = self.budgets.changed().with_context(|| format!("{}", self.budgets.path().display()))?;
        Ok(a || b)
    }

    /// With `filter`, pods of other nodes are left out; the others (and, without it, all) are on `node`, whose
    /// GPUs hold `gpu_totals` bytes each (a declared share of a GPU resolves against them).
    fn table(&self, node: &str, filter: bool, gpu_totals: &[u64]) -> anyhow::Result<PodTable> {
        let pods: Vec<Pod> = load_objects(self.pods.path())?;
        let budgets: Vec<GpuMemoryBudget> = load_objects(self.budgets.path())?;
        let views = pods.iter().filter_map(PodView::from_pod).filter_map(|mut v| {
            if filter && v.node.as_deref().is_some_and(|n| n != node) {
                return None;
            }
            v.node = Some(node.to_owned());
            Some(v)
        });
        let index = crate::attribute::budgets::BudgetIndex::of(&budgets);
        Ok(PodTable::from_index(views, &index, &Default::default(), Some(node), gpu_totals))
    }
}

fn percentile(sorted: &[u32], p: f64) -> u32 {
    if sorted.is_empty() {
        return 0;
    }
    let rank = ((p / 100.0) * (sorted.len() as f64)).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

fn summary(mut values: Vec<u32>) -> serde_json::Value {
    values.sort_unstable();
    json!({
        "p50": percentile(&values, 50.0),
        "p99": percentile(&values, 99.0),
        "max": values.last().copied().unwrap_or(0),
        "n": values.len(),
    })
}

/// Runs until the duration passes or a signal arrives.
pub async fn run(args: StandaloneArgs) -> anyhow::Result<()> {
    let shutdown = gpubudget_daemon::shutdown_on_signal();
    let out: Box<dyn Write + Send> = match &args.output {
        Some(path) => Box::new(std::io::BufWriter::new(
            std::fs::File::create(path).with_context(|| format!("cannot create {}", path.display()))?,
        )),
        None => Box::new(std::io::stdout()),
    };
    let mut executor = LogExecutor::new(out);
    let mut inputs = Inputs { pods: FileWatch::new(&args.pods), budgets: FileWatch::new(&args.budgets) };
    inputs.changed()?;
    let filter = args.node_name.is_some();
    let node = args.node_name.clone().unwrap_or_else(|| "standalone".to_owned());
    let mut table = inputs.table(&node, filter, &[])?;
    for (budget, error) in &table.invalid_budgets {
        tracing::warn!(%budget, %error, "budget not enforced: invalid spec");
    }
    let mut registry = Registry::default();
    let mut engine = Engine::new(
        SamplerSlot::new(crate::cmd::run::sampler_factory(args.sample_file.as_deref())),
        ProcAttributor::new(&args.sample.proc_root),
        {
            let mut settings = Settings::new(&node);
            args.pressure.apply(&mut settings);
            args.accounting.apply(&mut settings);
            // Checked by `dispatch` before anything starts.
            settings.cadence = args.sample.cadence().unwrap_or(settings.cadence);
            settings
        },
        Metrics::new(&mut registry),
    );
    let health = gpubudget_daemon::Health::new(&["gpu"]);
    health.register(&mut registry, crate::cmd::run::READY_METRIC);
    if let Some(addr) = args.admin_addr {
        let (health, registry, shutdown) = (health.clone(), std::sync::Arc::new(registry), shutdown.clone());
        tokio::spawn(async move {
            if let Err(error) = gpubudget_daemon::serve_admin(addr, health, registry, shutdown).await {
                tracing::error!(%error, "admin port failed");
            }
        });
    }
    let (ts, ts_unix) = timestamp_fields(jiff::Timestamp::now());
    executor.line(&json!({
        "ts": ts, "ts_unix": ts_unix, "kind": "start", "node": &node,
        "interval_ms": args.sample.interval.as_millis() as u64,
        "interval_near_ms": engine.enforcer.settings().cadence.fast_ms,
        "pods": table.pods.len(),
        // The budgets read, not the tightened rules resolution adds for pods (#33).
        "budgets": table.budgets.iter().filter(|b| b.tightened_by.is_none()).count(),
        "source": args.sample_file.as_ref().map_or_else(|| "nvml".to_owned(), |p| format!("file:{}", p.display())),
    }))?;

    let deadline = args.duration.map(|d| Instant::now() + d);
    // The first tick at once; each next one when the engine's pace says (decide::cadence).
    let next = tokio::time::sleep(Duration::ZERO);
    tokio::pin!(next);
    let (mut ticks, mut sampled, mut fast) = (0u64, 0u64, 0u64);
    let mut built_for: Vec<u64> = Vec::new();
    let mut sample_us: Vec<u32> = Vec::new();
    let mut tick_us: Vec<u32> = Vec::new();
    let mut last_usage: HashMap<std::sync::Arc<str>, u64> = HashMap::new();
    let mut last_error: Option<String> = None;
    loop {
        tokio::select! {
            () = shutdown.cancelled() => break,
            () = &mut next => {}
        }
        let started = tokio::time::Instant::now();
        if deadline.is_some_and(|d| Instant::now() >= d) {
            break;
        }
        // Built again when the files change, and once NVML has told the GPUs' sizes (or they change).
        let sizes_changed = !engine.gpu_totals_are(&built_for);
        match inputs.changed() {
            Ok(changed) if changed || sizes_changed => match inputs.table(&node, filter, &engine.gpu_totals()) {
                Ok(t) => {
                    table = t;
                    built_for = engine.gpu_totals();
                }
                Err(error) => {
                    tracing::warn!(error = format!("{error:#}"), "cannot reload pods or budgets; keeping the last")
                }
            },
            Ok(_) => {}
            Err(error) => tracing::warn!(error = format!("{error:#}"), "cannot check pods or budgets"),
        }
        let report = engine.tick(&table, true);
        ticks += 1;
        health.set("gpu", engine.enforcing());
        if report.sampled {
            sampled += 1;
            last_error = None;
            let cap = 1_000_000;
            if sample_us.len() < cap {
                sample_us.push(u32::try_from(report.sample_time.as_micros()).unwrap_or(u32::MAX));
                tick_us.push(u32::try_from(report.tick_time.as_micros()).unwrap_or(u32::MAX));
            }
        } else if let Some(error) = engine.slot.last_error() {
            let text = error.to_string();
            if last_error.as_deref() != Some(text.as_str()) {
                let (ts, ts_unix) = timestamp_fields(jiff::Timestamp::now());
                executor.line(&json!({"ts": ts, "ts_unix": ts_unix, "kind": "sample_error", "call": error.call.as_str(), "message": error.message}))?;
                last_error = Some(text);
            }
        }
        // Actions, then the feedback they produce, until nothing is left.
        loop {
            let actions: Vec<_> = engine.take_actions().collect();
            if actions.is_empty() {
                break;
            }
            for feedback in executor.apply(actions, jiff::Timestamp::now())? {
                engine.feedback(feedback);
            }
        }
        if args.log_usage && report.sampled {
            for (i, view) in table.pods.iter().enumerate() {
                if table.budget(i).is_none() {
                    continue;
                }
                let usage = &engine.usage.pods[i];
                if last_usage.get(&view.uid) == Some(&usage.total) {
                    continue;
                }
                last_usage.insert(view.uid.clone(), usage.total);
                let (ts, ts_unix) = timestamp_fields(jiff::Timestamp::now());
                let holders: Vec<_> = usage
                    .holders
                    .iter()
                    .map(|h| {
                        json!({
                            "container": h.container.as_deref(), "pid": h.pid,
                            "gpu": engine.snapshot.gpus.get(h.gpu).map(|g| g.label.as_str()), "bytes": h.bytes,
                        })
                    })
                    .collect();
                executor.line(&json!({
                    "ts": ts, "ts_unix": ts_unix, "kind": "usage", "pod": view.key(), "uid": &*view.uid,
                    "usage_bytes": usage.total, "state": engine.enforcer.state_of(&view.uid).map(|s| s.as_str()),
                    "holders": holders,
                }))?;
            }
        }
        let interval = engine.next_sample();
        fast += u64::from(interval < args.sample.interval);
        next.as_mut().reset(started + interval);
    }
    let (ts, ts_unix) = timestamp_fields(jiff::Timestamp::now());
    let reads = engine.attributor.reads();
    executor.line(&json!({
        "ts": ts, "ts_unix": ts_unix, "kind": "stats", "ticks": ticks, "sampled": sampled, "fast_ticks": fast,
        "sample_us": summary(sample_us), "tick_us": summary(tick_us),
        "proc_reads": {"stat": reads.stat, "cgroup": reads.cgroup},
    }))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn loads_documents_and_lists() {
        let text = "apiVersion: v1\nkind: Pod\nmetadata: {name: a, uid: u1}\n---\n\
                    apiVersion: v1\nkind: PodList\nitems:\n- metadata: {name: b, uid: u2}\n- metadata: {name: c, uid: u3}\n---\n";
        let pods: Vec<Pod> = parse_objects(text).expect("parses");
        let names: Vec<&str> = pods.iter().filter_map(|p| p.metadata.name.as_deref()).collect();
        assert_eq!(names, ["a", "b", "c"]);
        let json = r#"{"apiVersion":"v1","kind":"List","items":[{"metadata":{"name":"j"}}]}"#;
        assert_eq!(parse_objects::<Pod>(json).expect("json").len(), 1);
        assert!(parse_objects::<Pod>("metadata: [").is_err());
    }

    #[test]
    fn percentiles() {
        let v: Vec<u32> = (1..=100).collect();
        assert_eq!((percentile(&v, 50.0), percentile(&v, 99.0)), (50, 99));
        assert_eq!(percentile(&[], 50.0), 0);
        assert_eq!(percentile(&[7], 99.0), 7);
    }
}
