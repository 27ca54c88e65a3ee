//! docs/metrics.md is the one table of metrics, and it is what the binaries export: the agent's and the
//! operator's registries, built as their `run` builds them, are served by the admin port's router
//! (`gpubudget_daemon::admin::router`, what `/metrics` answers) and scraped over HTTP; every family found must
//! be a row of the table with the same type, labels and binary, and every row must be found.
//!
//! A family with labels is not in `/metrics` until its first label value is set (prometheus-client leaves empty
//! families out), so before the scrape one series is set in every family of the agent's and the operator's
//! `Metrics`. Those structs are destructured without `..`: a family added to either does not compile here until
//! it is given a series, so it cannot hide from the check. No clock, no scenario: it runs in milliseconds.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use gpubudget_agent::act::{
    Counters, EvictionResult, ResultLabels, SetByLabel, SpecReadLabels, WriteKind, WriteLabels, WriteResult,
};
use gpubudget_agent::attribute::kube::{BudgetKind, ReadKind, ReadResult};
use gpubudget_agent::report::metrics::{
    BudgetLabels, CallLabels, ContainerLabels, DriverLimitsLabels, DriverLimitsResult, GpuLabels, KindLabels,
    Metrics as AgentMetrics, PodLabels, StateLabel, StateLabels,
};
use gpubudget_daemon::Health;
use gpubudget_demo::stack::{agent_registry, operator_registry};
use gpubudget_operator::controller::{CHECK_BUDGETS, CHECK_PODS};
use gpubudget_operator::error::ErrorLabel;
use gpubudget_operator::metrics::{
    CapsResult, CapsResultLabels, ErrorLabels, Metrics as OperatorMetrics, MirrorWrite, MirrorWriteLabels,
};
use prometheus_client::registry::Registry;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const TABLE: &str = include_str!("../../docs/metrics.md");

/// One metric as the table lists it and as the check finds it.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
struct Row {
    /// The name queried: a counter's with `_total`.
    name: String,
    kind: String,
    labels: BTreeSet<String>,
    binary: String,
}

/// The rows of docs/metrics.md's table.
fn documented() -> Vec<Row> {
    let mut rows = Vec::new();
    for line in TABLE.lines().filter(|l| l.starts_with("| `")) {
        let cells: Vec<&str> = line.trim_matches('|').split('|').map(str::trim).collect();
        assert!(cells.len() >= 5, "a row of five cells: {line}");
        rows.push(Row {
            name: cells[0].trim_matches('`').to_owned(),
            kind: cells[1].to_owned(),
            labels: cells[2].split(',').map(str::trim).filter(|l| !l.is_empty()).map(str::to_owned).collect(),
            binary: cells[3].to_owned(),
        });
    }
    rows
}

/// The families of a `/metrics` text: type from `# TYPE`, labels from the samples (a histogram's `le` left out).
fn families(text: &str, binary: &str) -> Vec<Row> {
    let mut found: BTreeMap<String, Row> = BTreeMap::new();
    for line in text.lines() {
        if let Some(decl) = line.strip_prefix("# TYPE ") {
            let (name, kind) = decl.split_once(' ').expect("# TYPE name type");
            let queried = if kind == "counter" { format!("{name}_total") } else { name.to_owned() };
            let row = Row { name: queried, kind: kind.to_owned(), labels: BTreeSet::new(), binary: binary.to_owned() };
            found.insert(name.to_owned(), row);
        } else if !line.starts_with('#') && !line.is_empty() {
            let end = line.find(['{', ' ']).unwrap_or(line.len());
            let family = found
                .iter_mut()
                .filter(|(name, _)| line[..end].starts_with(name.as_str()))
                .max_by_key(|(name, _)| name.len())
                .map(|(_, row)| row)
                .unwrap_or_else(|| panic!("a sample of no declared family: {line}"));
            if let Some(labels) = line[end..].strip_prefix('{').and_then(|l| l.split_once('}')).map(|(l, _)| l) {
                for pair in labels.split(',').filter(|p| !p.is_empty()) {
                    let key = pair.split_once('=').expect("label=value").0;
                    if key != "le" {
                        family.labels.insert(key.to_owned());
                    }
                }
            }
        }
    }
    found.into_values().collect()
}

/// One series in every family of the agent's metrics.
fn touch_agent(metrics: &AgentMetrics) {
    let AgentMetrics {
        pod_memory,
        pod_budget,
        pod_state,
        act,
        nvml_errors,
        unattributed,
        unbudgeted,
        gpu_free,
        gpu_pressure,
        gpu_sampled,
        gpu_unaccounted,
        gpu_unavailable,
        gpu_total,
        gpu_budgeted,
        sample_duration,
        table_rebuilds,
        sample_interval,
        driver_limits_available,
        caps_not_in_force,
        driver_applied,
        pod_driver_hard,
        pod_driver_soft,
        spec_reads,
        specs_from_mirrors,
        runtime,
    } = metrics;
    let s = |v: &str| v.to_owned();
    let pod = || PodLabels { namespace: s("team-a"), pod: s("llm-0") };
    let gpu = || GpuLabels { gpu: s("0") };
    _ = pod_memory.get_or_create(&ContainerLabels {
        namespace: s("team-a"),
        pod: s("llm-0"),
        container: s("c"),
        gpu: s("0"),
    });
    _ = pod_budget.get_or_create(&BudgetLabels { namespace: s("team-a"), pod: s("llm-0"), budget: s("b") });
    _ = pod_state.get_or_create(&StateLabels {
        namespace: s("team-a"),
        pod: s("llm-0"),
        state: StateLabel(gpubudget_common::BudgetState::Within),
    });
    let Counters { evictions, api_writes, evictions_without_record, would_evict } = act;
    _ = would_evict.get_or_create(&gpubudget_agent::act::WouldEvictLabels {
        cause: gpubudget_agent::decide::EvictCause::Budget,
        set_by: SetByLabel(gpubudget_common::enforcement::Level::Agent),
    });
    _ = evictions.get_or_create(&ResultLabels { result: EvictionResult::Accepted });
    _ = api_writes.get_or_create(&WriteLabels { kind: WriteKind::Apply, result: WriteResult::Ok });
    _ = spec_reads.get_or_create(&SpecReadLabels { kind: ReadKind::Get, result: ReadResult::Ok });
    _ = specs_from_mirrors.get_or_create(&KindLabels { kind: BudgetKind::Namespaced });
    evictions_without_record.get();
    _ = nvml_errors.get_or_create(&CallLabels { call: gpubudget_agent::sample::Call::Init });
    for family in [
        unattributed,
        unbudgeted,
        gpu_free,
        gpu_pressure,
        gpu_sampled,
        gpu_unaccounted,
        gpu_unavailable,
        gpu_total,
        gpu_budgeted,
    ] {
        _ = family.get_or_create(&gpu());
    }
    sample_duration.observe(0.001);
    table_rebuilds.get();
    sample_interval.get();
    driver_limits_available.get();
    caps_not_in_force.get();
    _ = driver_applied.get_or_create(&DriverLimitsLabels { result: DriverLimitsResult::Applied });
    _ = pod_driver_hard.get_or_create(&pod());
    _ = pod_driver_soft.get_or_create(&pod());
    let gpubudget_agent::runtime_caps::RuntimeMetrics { containers, seconds, registrations } = runtime;
    _ = containers.get_or_create(&gpubudget_agent::runtime_caps::OutcomeLabels {
        outcome: gpubudget_agent::runtime_caps::Outcome::Capped,
    });
    seconds.observe(0.000_1);
    registrations.get();
}

/// One series in every family of the operator's metrics.
fn touch_operator(metrics: &OperatorMetrics) {
    let OperatorMetrics {
        reconciles,
        failures,
        duration,
        budgets,
        budgets_invalid,
        pods,
        matched_pods,
        status_writes,
        mirror_writes,
        events,
        leader,
        caps_admissions,
        namespace_label_writes,
        quota_eviction_requests,
        quota_evictions,
        quota_would_evict,
        quota_namespaces_over,
    } = metrics;
    _ = failures.get_or_create(&ErrorLabels { error: ErrorLabel::Conflict });
    _ = caps_admissions.get_or_create(&CapsResultLabels { result: CapsResult::Capped });
    _ = mirror_writes.get_or_create(&MirrorWriteLabels { result: MirrorWrite::Written });
    duration.observe(0.001);
    for counter in [
        reconciles,
        status_writes,
        events,
        namespace_label_writes,
        quota_eviction_requests,
        quota_evictions,
        quota_would_evict,
    ] {
        counter.get();
    }
    for gauge in [budgets, budgets_invalid, pods, matched_pods, leader, quota_namespaces_over] {
        gauge.get();
    }
}

/// `GET /metrics` from the admin port's router, served on 127.0.0.1.
async fn scrape(health: Health, registry: Registry) -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let router = gpubudget_daemon::admin::router(health, Arc::new(registry));
    let server = tokio::spawn(async move { axum::serve(listener, router).await });
    let mut stream = tokio::net::TcpStream::connect(addr).await.unwrap();
    stream.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").await.unwrap();
    let mut response = String::new();
    stream.read_to_string(&mut response).await.unwrap();
    server.abort();
    assert!(response.starts_with("HTTP/1.1 200"), "{response}");
    response.split_once("\r\n\r\n").map(|(_, body)| body.to_owned()).unwrap_or_default()
}

#[tokio::test]
async fn docs_metrics_md_lists_exactly_the_families_the_binaries_export() {
    let (registry, metrics, health) = agent_registry();
    touch_agent(&metrics);
    let agent = scrape(health, registry).await;
    let (registry, metrics, health) = operator_registry(&[CHECK_PODS, CHECK_BUDGETS]);
    touch_operator(&metrics);
    let operator = scrape(health, registry).await;

    let mut exported: Vec<Row> = families(&agent, "agent").into_iter().chain(families(&operator, "operator")).collect();
    exported.sort();
    let mut listed = documented();
    listed.sort();
    let missing: Vec<&Row> = exported.iter().filter(|r| !listed.contains(r)).collect();
    let stale: Vec<&Row> = listed.iter().filter(|r| !exported.contains(r)).collect();
    assert!(
        missing.is_empty() && stale.is_empty(),
        "docs/metrics.md disagrees with /metrics.\nexported, not in the table (or listed differently): {missing:#?}\n\
         in the table, exported by neither binary (or differently): {stale:#?}"
    );
    assert!(exported.len() >= 39, "{} families: {exported:#?}", exported.len());
}

#[test]
fn families_are_read_with_their_type_and_labels() {
    let text = "# HELP a_errors x.\n# TYPE a_errors counter\na_errors_total{call=\"init\"} 1\n\
                # TYPE a_errors_seconds histogram\na_errors_seconds_bucket{le=\"0.1\"} 0\na_errors_seconds_sum 0\n\
                # TYPE g gauge\ng{gpu=\"0\",check=\"x\"} 1\n# EOF\n";
    let rows = families(text, "agent");
    let row = |name: &str, kind: &str, labels: &[&str]| Row {
        name: name.into(),
        kind: kind.into(),
        labels: labels.iter().map(|l| (*l).to_owned()).collect(),
        binary: "agent".into(),
    };
    assert_eq!(
        rows,
        [
            row("a_errors_total", "counter", &["call"]),
            row("a_errors_seconds", "histogram", &[]),
            row("g", "gauge", &["check", "gpu"])
        ]
    );
    let table = documented();
    assert!(table.contains(&Row {
        name: "gpubudget_api_writes_total".into(),
        kind: "counter".into(),
        labels: ["kind", "result"].map(str::to_owned).into(),
        binary: "agent".into(),
    }));
}
