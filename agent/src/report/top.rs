//! What `gpubudget-agent top` shows of one sample: GPU memory by GPU, pod, container and process ([`build_view`]),
//! with what the driver caps each pod at ([`add_driver_limits`]), as an aligned table ([`render_table`]) or JSON.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use gpubudget_common::pod_record::DriverLimitsRecord;
use gpubudget_common::quantity::HumanBytes;
use gpubudget_common::text::table;
use serde::Serialize;

use crate::attribute::driver_limits::DriverView;
use crate::attribute::pods::PodTable;
use crate::attribute::procfs;
use crate::attribute::{Owner, Usage};
use crate::decide::driver_limits::{compare, record};
use crate::decide::pressure::Threshold;
use crate::sample::{GpuHealth, Snapshot};

/// A GPU row.
#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
pub struct GpuRow {
    /// `0`, `0/mig1`.
    pub gpu: String,
    /// Product name.
    pub name: String,
    /// UUID.
    pub uuid: String,
    /// `ok`, or `failed: <call>: <error>` (nothing is decided from a failed GPU; it is retried).
    pub state: String,
    /// Sum of its processes, bytes.
    pub used_bytes: u64,
    /// The device's used bytes that no listed process accounts for, when known.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub unaccounted_bytes: Option<u64>,
    /// Bytes held by known pods that no budget selects (`gpubudget_unbudgeted_bytes`); only with names from the
    /// API server (without it, no pod's budget is known).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub unbudgeted_bytes: Option<u64>,
    /// Processes whose figure NVML reports as unavailable.
    pub unavailable: u32,
    /// Processes listed as MPS clients.
    pub mps_clients: u32,
    /// Its memory, bytes.
    pub total_bytes: u64,
    /// Free memory as the device reports it (total minus its used bytes), when known.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub free_bytes: Option<u64>,
    /// Free memory is under the hard pressure threshold.
    pub pressure: bool,
}

/// A pod row.
#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
pub struct PodRow {
    /// `namespace/name`, or the UID when the pod is not known.
    pub pod: String,
    /// UID.
    pub uid: String,
    /// Bytes over its processes and GPUs.
    pub used_bytes: u64,
    /// Bytes per GPU label.
    pub by_gpu: BTreeMap<String, u64>,
    /// Processes whose figure NVML reports as unavailable (not in `used_bytes`).
    pub unknown: u32,
    /// `namespace/name` of its budget.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub budget: Option<String>,
    /// The budget's limit.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub limit_bytes: Option<u64>,
    /// The budget's request (never evicted within it); absent when the budget sets none.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub request_bytes: Option<u64>,
    /// What the NVIDIA driver caps the pod at (R615 per-cgroup limits), where the node's driver can tell.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub driver: Option<DriverLimitsRecord>,
}

/// A process row.
#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
pub struct ProcessRow {
    /// PID.
    pub pid: Option<u32>,
    /// GPU label.
    pub gpu: String,
    /// Bytes on that GPU; `None` where NVML reports the figure as unavailable.
    pub bytes: Option<u64>,
    /// `namespace/name`, the pod UID, or empty for no pod.
    pub pod: String,
    /// Container name or short ID.
    pub container: String,
    /// The process's command name (from `/proc/<pid>/comm`).
    pub command: String,
}

/// What `top` shows.
#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
pub struct View {
    /// When.
    pub taken_at: String,
    /// Whether names came from the API server.
    pub names_from_api: bool,
    /// GPUs.
    pub gpus: Vec<GpuRow>,
    /// Pods, largest first.
    pub pods: Vec<PodRow>,
    /// Processes, by pod then largest first.
    pub processes: Vec<ProcessRow>,
}

/// Builds the view of one sample.
pub fn build_view(
    snapshot: &Snapshot,
    table: &PodTable,
    usage: &Usage,
    proc_root: &std::path::Path,
    names: bool,
    pressure_hard: Option<Threshold>,
) -> View {
    let gpus = snapshot
        .gpus
        .iter()
        .enumerate()
        .map(|(i, g)| {
            let reading = snapshot.readings.get(i).cloned().unwrap_or_default();
            let free_bytes = snapshot.memory(i).map(|m| m.free);
            GpuRow {
                gpu: g.label.clone(),
                name: g.name.clone(),
                uuid: g.uuid.clone(),
                state: match &reading.health {
                    GpuHealth::Sampled => "ok".to_owned(),
                    GpuHealth::Failed { error, .. } => format!("failed: {error}"),
                },
                used_bytes: snapshot.processes.iter().filter(|p| p.gpu == i).map(|p| p.charged()).sum(),
                unaccounted_bytes: usage.unaccounted.get(i).copied().flatten(),
                unbudgeted_bytes: names.then(|| usage.unbudgeted.get(i).copied().unwrap_or(0)),
                unavailable: reading.unavailable,
                mps_clients: reading.mps_clients,
                total_bytes: g.total_bytes,
                free_bytes,
                pressure: free_bytes.zip(pressure_hard).is_some_and(|(f, t)| f < t.bytes(g.total_bytes)),
            }
        })
        .collect();
    let mut pods: BTreeMap<String, PodRow> = BTreeMap::new();
    let mut processes = Vec::new();
    for (process, owner) in snapshot.processes.iter().zip(&usage.owners) {
        let gpu = snapshot.gpus.get(process.gpu).map(|g| g.label.clone()).unwrap_or_default();
        let (pod, uid, container, budget) = match owner {
            Owner::Pod { pod, container } => {
                let view = &table.pods[*pod];
                let budget = table.budget(*pod).map(|b| (b.key(), b.limit_bytes, b.request_bytes));
                (view.key(), view.uid.to_string(), container.as_deref().unwrap_or("").to_owned(), budget)
            }
            Owner::UnknownPod { uid, container } => {
                let short = container.as_deref().map(|c| c.chars().take(12).collect()).unwrap_or_default();
                (uid.clone(), uid.clone(), short, None)
            }
            Owner::NoPod => (String::new(), String::new(), String::new(), None),
        };
        if !uid.is_empty() {
            let row = pods.entry(uid.clone()).or_insert_with(|| PodRow {
                pod: pod.clone(),
                uid,
                used_bytes: 0,
                by_gpu: BTreeMap::new(),
                unknown: 0,
                budget: budget.as_ref().map(|b| b.0.clone()),
                limit_bytes: budget.as_ref().map(|b| b.1),
                request_bytes: budget.and_then(|b| b.2),
                driver: None,
            });
            row.used_bytes += process.charged();
            *row.by_gpu.entry(gpu.clone()).or_insert(0) += process.charged();
            row.unknown += u32::from(process.bytes.is_none());
        }
        processes.push(ProcessRow {
            pid: process.pid,
            gpu,
            bytes: process.bytes,
            pod,
            container,
            command: procfs::command(proc_root, process.pid),
        });
    }
    let mut pods: Vec<PodRow> = pods.into_values().collect();
    pods.sort_by(|a, b| b.used_bytes.cmp(&a.used_bytes).then_with(|| a.pod.cmp(&b.pod)));
    processes.sort_by(|a, b| {
        (a.pod.is_empty(), &a.pod, std::cmp::Reverse(a.bytes), a.pid).cmp(&(
            b.pod.is_empty(),
            &b.pod,
            std::cmp::Reverse(b.bytes),
            b.pid,
        ))
    });
    View { taken_at: jiff::Timestamp::now().to_string(), names_from_api: names, gpus, pods, processes }
}

/// Adds what the driver caps each pod at (`views` indexed like `table.pods`), and how that disagrees with its
/// budget ([`compare`]), to the view's pod rows.
pub fn add_driver_limits(view: &mut View, table: &PodTable, views: &[Option<DriverView>]) {
    for row in &mut view.pods {
        let Some(i) = table.find_uid(&row.uid) else { continue };
        let Some(v) = views.get(i).copied().flatten().filter(|v| v.answered() > 0) else { continue };
        let verdict =
            table.budget(i).and_then(|b| compare(b.limit_bytes, b.request_bytes, table.pods[i].caps_expected, &v));
        row.driver = Some(record(&v, verdict));
    }
}

/// The DRIVER CAP cell: `8Gi (soft 4Gi)`, `none`, `1 of 2 pairs`.
fn driver_cell(driver: Option<&DriverLimitsRecord>) -> String {
    let Some(d) = driver else { return "-".to_owned() };
    let hard = match d.hard_bytes {
        Some(h) => HumanBytes(h).to_string(),
        None if d.capped == 0 => "none".to_owned(),
        None => format!("{} of {} pairs", d.capped, d.pairs),
    };
    match d.soft_bytes {
        Some(s) => format!("{hard} (soft {})", HumanBytes(s)),
        None => hard,
    }
}

/// Renders the view as an aligned table.
pub fn render_table(view: &View) -> String {
    let mut out = String::new();
    let mut gpus = vec![vec![
        "GPU".to_owned(),
        "NAME".into(),
        "STATE".into(),
        "USED".into(),
        "UNACCOUNTED".into(),
        "NO BUDGET".into(),
        "TOTAL".into(),
        "FREE".into(),
    ]];
    gpus.extend(view.gpus.iter().map(|g| {
        let free = g.free_bytes.map_or_else(|| "-".to_owned(), |f| HumanBytes(f).to_string());
        let free = if g.pressure { format!("{free} (memory pressure)") } else { free };
        let mut unaccounted = g.unaccounted_bytes.map_or_else(|| "-".to_owned(), |u| HumanBytes(u).to_string());
        if g.unavailable > 0 {
            let _ = write!(unaccounted, " ({} without figures)", g.unavailable);
        }
        let state =
            if g.mps_clients > 0 { format!("{} (MPS: {} clients)", g.state, g.mps_clients) } else { g.state.clone() };
        vec![
            g.gpu.clone(),
            g.name.clone(),
            state,
            HumanBytes(g.used_bytes).to_string(),
            unaccounted,
            g.unbudgeted_bytes.map_or_else(|| "-".to_owned(), |u| HumanBytes(u).to_string()),
            HumanBytes(g.total_bytes).to_string(),
            free,
        ]
    }));
    out.push_str(&table(&gpus));
    out.push('\n');
    // The REQUEST column only when some budget sets a request: without one the table is as it was.
    let requests = view.pods.iter().any(|p| p.request_bytes.is_some());
    let bytes_or_dash = |b: Option<u64>| b.map_or_else(|| "-".to_owned(), |b| HumanBytes(b).to_string());
    let mut header = vec!["POD".to_owned(), "USED".into(), "BY GPU".into()];
    if requests {
        header.push("REQUEST".into());
    }
    header.extend(["LIMIT".into(), "BUDGET".into()]);
    // The DRIVER CAP column only where the node's driver has per-cgroup limits (R615 or newer).
    let driver = view.pods.iter().any(|p| p.driver.is_some());
    if driver {
        header.push("DRIVER CAP".into());
    }
    let mut pods = vec![header];
    pods.extend(view.pods.iter().map(|p| {
        let mut by_gpu: Vec<String> = p.by_gpu.iter().map(|(g, b)| format!("{g}: {}", HumanBytes(*b))).collect();
        if p.unknown > 0 {
            by_gpu.push(format!("{} without figures", p.unknown));
        }
        let mut row = vec![p.pod.clone(), HumanBytes(p.used_bytes).to_string(), by_gpu.join(", ")];
        if requests {
            // "20Gi (+4Gi)": how far above its request the pod is, the figure pressure eviction ranks by.
            let request = match p.request_bytes {
                Some(r) if p.used_bytes > r => format!("{} (+{})", HumanBytes(r), HumanBytes(p.used_bytes - r)),
                r => bytes_or_dash(r),
            };
            row.push(request);
        }
        row.extend([bytes_or_dash(p.limit_bytes), p.budget.clone().unwrap_or_else(|| "-".into())]);
        if driver {
            row.push(driver_cell(p.driver.as_ref()));
        }
        row
    }));
    out.push_str(&table(&pods));
    for p in &view.pods {
        if let Some(note) = p.driver.as_ref().and_then(|d| d.note.as_deref()) {
            let _ = writeln!(out, "{}: {note}", p.pod);
        }
    }
    out.push('\n');
    let mut procs =
        vec![vec!["POD".to_owned(), "CONTAINER".into(), "PID".into(), "GPU".into(), "MEMORY".into(), "COMMAND".into()]];
    procs.extend(view.processes.iter().map(|p| {
        vec![
            if p.pod.is_empty() { "(no pod)".to_owned() } else { p.pod.clone() },
            if p.container.is_empty() { "-".to_owned() } else { p.container.clone() },
            p.pid.map_or_else(|| "-".to_owned(), |p| p.to_string()),
            p.gpu.clone(),
            p.bytes.map_or_else(|| "n/a".to_owned(), |b| HumanBytes(b).to_string()),
            p.command.clone(),
        ]
    }));
    out.push_str(&table(&procs));
    if !view.names_from_api {
        out.push_str("\n(no API server: pods are shown by UID)\n");
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    const GI: u64 = 1 << 30;

    fn pod(name: &str, used: u64, request: Option<u64>) -> PodRow {
        PodRow {
            pod: format!("team-a/{name}"),
            uid: format!("uid-{name}"),
            used_bytes: used,
            by_gpu: [("0".to_owned(), used)].into(),
            unknown: 0,
            budget: Some("team-a/b".into()),
            limit_bytes: Some(32 * GI),
            request_bytes: request,
            driver: None,
        }
    }

    fn view(pods: Vec<PodRow>) -> View {
        View { taken_at: String::new(), names_from_api: true, gpus: Vec::new(), pods, processes: Vec::new() }
    }

    #[test]
    fn the_no_budget_column_shows_what_pods_no_budget_selects_hold_and_a_dash_without_names() {
        let gpu = |unbudgeted_bytes| GpuRow {
            gpu: "0".into(),
            name: "H100".into(),
            uuid: "GPU-0".into(),
            state: "ok".into(),
            used_bytes: 70 * GI,
            unaccounted_bytes: Some(0),
            unbudgeted_bytes,
            unavailable: 0,
            mps_clients: 0,
            total_bytes: 80 * GI,
            free_bytes: Some(10 * GI),
            pressure: false,
        };
        let mut v = view(Vec::new());
        v.gpus = vec![gpu(Some(40 * GI))];
        let text = render_table(&v);
        let header = text.lines().next().expect("header");
        assert!(header.contains("UNACCOUNTED  NO BUDGET  TOTAL"), "{text}");
        assert!(text.lines().nth(1).is_some_and(|l| l.contains("0B           40Gi       80Gi")), "{text}");
        assert!(serde_json::to_string(&v).expect("json").contains("\"unbudgeted_bytes\":42949672960"));
        // Without the API server no pod's budget is known: a dash, and nothing in the JSON.
        v.gpus = vec![gpu(None)];
        assert!(render_table(&v).lines().nth(1).is_some_and(|l| l.contains("0B           -          80Gi")));
        assert!(!serde_json::to_string(&v).expect("json").contains("unbudgeted_bytes"));
    }

    #[test]
    fn the_request_column_shows_only_with_a_request_and_how_far_above_it() {
        let without = render_table(&view(vec![pod("a", 24 * GI, None)]));
        assert!(without.contains("POD       USED  BY GPU   LIMIT  BUDGET\n"), "{without}");
        assert!(!without.contains("REQUEST"), "{without}");
        let json = serde_json::to_string(&view(vec![pod("a", 24 * GI, None)])).expect("json");
        assert!(!json.contains("request_bytes"), "{json}");
        let with = render_table(&view(vec![pod("a", 24 * GI, Some(20 * GI)), pod("b", 8 * GI, Some(20 * GI))]));
        assert!(with.contains("REQUEST"), "{with}");
        assert!(with.lines().any(|l| l.starts_with("team-a/a") && l.contains("20Gi (+4Gi)  32Gi")), "{with}");
        assert!(with.lines().any(|l| l.starts_with("team-a/b") && l.contains("20Gi         32Gi")), "{with}");
    }

    #[test]
    fn the_driver_cap_column_shows_only_where_the_driver_tells_with_its_disagreement() {
        let without = render_table(&view(vec![pod("a", 24 * GI, None)]));
        assert!(!without.contains("DRIVER CAP"), "{without}");
        let mut capped = pod("a", 24 * GI, None);
        capped.driver = Some(DriverLimitsRecord {
            pairs: 2,
            capped: 2,
            hard_bytes: Some(48 * GI),
            soft_bytes: None,
            note: Some("driver allows more than the budget (…)".into()),
        });
        let mut partly = pod("b", 8 * GI, None);
        partly.driver = Some(DriverLimitsRecord { pairs: 2, capped: 1, ..DriverLimitsRecord::default() });
        let mut soft = pod("c", 8 * GI, None);
        soft.driver = Some(DriverLimitsRecord {
            pairs: 1,
            capped: 1,
            hard_bytes: Some(8 * GI),
            soft_bytes: Some(4 * GI),
            note: None,
        });
        let text = render_table(&view(vec![capped, partly, soft, pod("d", GI, None)]));
        assert!(text.contains("DRIVER CAP"), "{text}");
        assert!(text.lines().any(|l| l.starts_with("team-a/a") && l.trim_end().ends_with("48Gi")), "{text}");
        assert!(text.lines().any(|l| l.starts_with("team-a/b") && l.trim_end().ends_with("1 of 2 pairs")), "{text}");
        assert!(text.lines().any(|l| l.starts_with("team-a/c") && l.trim_end().ends_with("8Gi (soft 4Gi)")), "{text}");
        assert!(text.lines().any(|l| l.starts_with("team-a/d") && l.trim_end().ends_with('-')), "{text}");
        assert!(text.contains("team-a/a: driver allows more than the budget"), "{text}");
    }
}
