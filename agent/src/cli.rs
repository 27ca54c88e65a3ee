//! Command line: `run` (the DaemonSet), `top`, `capture`, `standalone`.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use crate::decide::Settings;
use crate::decide::cadence::Cadence;
use crate::decide::gpus::AccountingSettings;
use crate::decide::pressure::{NamespacedBudgets, PressureSettings, Threshold, Unbudgeted};
use crate::runtime_caps::Unresolved;
use clap::{Args, Parser, Subcommand, ValueEnum};
use gpubudget_common::{CriticalNamespaces, Enforcement};
use gpubudget_daemon::LogFormat;

/// gpubudget node agent: GPU memory per pod from NVML, enforced against GpuMemoryBudgets.
#[derive(Debug, Parser)]
#[command(name = "gpubudget-agent", version, about)]
pub struct Cli {
    /// Log format (logs go to stderr).
    #[arg(long, global = true, env = "GPUBUDGET_LOG_FORMAT", value_enum, default_value = "text")]
    pub log_format: LogFormat,
    /// What to do.
    #[command(subcommand)]
    pub command: Command,
}

/// Subcommands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Run the agent: sample, attribute, enforce; admin port with /live, /ready, /metrics.
    Run(RunArgs),
    /// Show GPU memory by pod, container and process on this host.
    Top(TopArgs),
    /// Write a sample file from NVML (replay it with --sample-file or top --sample).
    Capture(CaptureArgs),
    /// Enforce budgets and pods read from files, without an API server: decisions as JSON lines.
    Standalone(StandaloneArgs),
    /// Whether this node's NVML has the driver's per-cgroup GPU memory limits (R615), and what they are for
    /// given cgroups.
    DriverLimits(DriverLimitsArgs),
    /// Hold the container runtime's NRI socket for `run --runtime-caps`, and nothing else: relay each GPU
    /// container's creation to the agent over a local socket, let back only its MPS and memory-limit variables.
    RuntimeCapsRelay(RelayArgs),
}

/// The relay's options (`runtime-caps-relay`).
#[derive(Debug, Clone, Args)]
pub struct RelayArgs {
    /// The container runtime's NRI socket.
    #[arg(long, env = "GPUBUDGET_NRI_SOCKET", default_value = "/var/run/nri/nri.sock")]
    pub nri_socket: PathBuf,
    /// Where to listen for the agent (`run --runtime-caps-socket`): a socket made with mode 0660.
    #[arg(long, env = "GPUBUDGET_RUNTIME_CAPS_SOCKET", default_value = "/run/gpubudget/runtime-caps.sock")]
    pub listen: PathBuf,
    /// The agent's user ID: a connection from any other user is refused (unset: any user that may open the
    /// socket).
    #[arg(long, env = "GPUBUDGET_RUNTIME_CAPS_AGENT_UID")]
    pub agent_uid: Option<u32>,
    /// What a GPU container gets when the agent does not answer in time: `create` (uncapped; the agent tells it
    /// when it connects) or `refuse` (the runtime fails it with the reason; the kubelet retries with back-off).
    #[arg(long = "unresolved", env = "GPUBUDGET_RUNTIME_CAPS_UNRESOLVED", value_enum, default_value_t = Unresolved::Create)]
    pub unresolved: Unresolved,
    /// Namespaces whose containers are never refused, comma-separated: the release's own (its agent sees every GPU
    /// and must start) and the critical ones (a device plugin's pods).
    #[arg(long, env = "GPUBUDGET_RUNTIME_CAPS_NEVER_REFUSE", default_value = "kube-system")]
    pub never_refuse: CriticalNamespaces,
}

/// Sampling options shared by the subcommands.
#[derive(Debug, Clone, Args)]
pub struct SampleArgs {
    /// Where the host's proc filesystem is (NVML reports host PIDs).
    #[arg(long, env = "GPUBUDGET_PROC_ROOT", default_value = "/proc")]
    pub proc_root: PathBuf,
    /// Sampling interval ("250ms", "1s") while no pod and no GPU is close to a threshold.
    #[arg(long, env = "GPUBUDGET_INTERVAL", default_value = "250ms", value_parser = parse_duration)]
    pub interval: Duration,
    /// Sampling interval while a budgeted pod is at or near its warning threshold (or rising toward it), or a
    /// GPU's free memory is near its pressure threshold (or falling toward it): at most --interval. "auto":
    /// 20ms, or --interval where that is shorter; "off": always --interval.
    #[arg(long, env = "GPUBUDGET_INTERVAL_NEAR", default_value = "auto", value_parser = parse_near_interval)]
    pub interval_near: NearInterval,
}

impl SampleArgs {
    /// The sampling pace these flags ask for: an error when --interval-near is longer than --interval.
    pub fn cadence(&self) -> Result<Cadence, String> {
        let ms = |d: Duration| u64::try_from(d.as_millis()).unwrap_or(u64::MAX).max(1);
        let relaxed = ms(self.interval);
        let fast = match self.interval_near {
            NearInterval::Off => return Ok(Cadence::fixed(relaxed)),
            NearInterval::Auto => Cadence::DEFAULT.fast_ms.min(relaxed),
            NearInterval::Every(d) => ms(d),
        };
        match fast {
            fast if fast <= relaxed => Ok(Cadence { relaxed_ms: relaxed, fast_ms: fast, ..Cadence::DEFAULT }),
            fast => Err(format!(
                "--interval-near ({fast}ms) must not be longer than --interval ({relaxed}ms); \"off\" samples at \
                 --interval always"
            )),
        }
    }
}

/// `--interval-near`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NearInterval {
    /// The default fast interval (20 ms), or `--interval` where that is shorter.
    Auto,
    /// Always `--interval`.
    Off,
    /// This interval (at most `--interval`).
    Every(Duration),
}

/// Parses `--interval-near`.
fn parse_near_interval(text: &str) -> Result<NearInterval, String> {
    match text.trim() {
        "auto" => Ok(NearInterval::Auto),
        "off" => Ok(NearInterval::Off),
        other => parse_duration(other).map(NearInterval::Every),
    }
}

/// GPU memory pressure eviction (docs/agent.md, "Pressure"): the kubelet's node-pressure eviction, per GPU.
#[derive(Debug, Clone, Args)]
pub struct PressureArgs {
    /// Free memory on a GPU under this is pressure at once: bytes ("4Gi") or a percentage of the GPU ("5%");
    /// "off" disables the hard threshold.
    #[arg(long, env = "GPUBUDGET_PRESSURE_HARD", default_value = "5%", value_parser = parse_threshold)]
    pub pressure_hard: MaybeThreshold,
    /// Free memory under this for --pressure-soft-grace is pressure ("off": no soft threshold).
    #[arg(long, env = "GPUBUDGET_PRESSURE_SOFT", default_value = "off", value_parser = parse_threshold)]
    pub pressure_soft: MaybeThreshold,
    /// How long the soft threshold must hold.
    #[arg(long, env = "GPUBUDGET_PRESSURE_SOFT_GRACE", default_value = "10s", value_parser = parse_duration)]
    pub pressure_soft_grace: Duration,
    /// How long free memory must stay above the thresholds before the pressure ends.
    #[arg(long, env = "GPUBUDGET_PRESSURE_TRANSITION", default_value = "10s", value_parser = parse_duration)]
    pub pressure_transition: Duration,
    /// Termination grace of a pod evicted for pressure, seconds (its budget's evictionGracePeriodSeconds,
    /// when lower, wins).
    #[arg(long, env = "GPUBUDGET_PRESSURE_GRACE_SECONDS", default_value_t = 5, value_parser = clap::value_parser!(i64).range(0..=3600))]
    pub pressure_grace_seconds: i64,
    /// What pressure does to pods no budget selects (a namespace without a budget, a pod relabelled out of
    /// every selector): "Ranked" counts all their usage as above their guarantee, so they go before any pod
    /// within its budget (critical and static pods excepted); "Never" never evicts them for pressure.
    #[arg(long, env = "GPUBUDGET_UNBUDGETED_PODS", value_enum, default_value = "Ranked")]
    pub unbudgeted_pods: UnbudgetedPods,
    /// A pressure eviction refused (by a PodDisruptionBudget) this long deletes the pod with its grace, as the
    /// kubelet's node-pressure eviction does; for pods without a budget and budgets without their own
    /// blockedEvictionTimeoutSeconds. At most 1h.
    #[arg(long, env = "GPUBUDGET_PRESSURE_BLOCKED_TIMEOUT", default_value = "60s", value_parser = parse_blocked_timeout)]
    pub pressure_blocked_timeout: Duration,
    /// Who writes namespaced GpuMemoryBudgets: "Trusted" (administrators only: a budget's request, else its
    /// limit, is a guarantee under pressure and its Warn keeps the pod) or "ClusterBound" (tenants may write
    /// them: under pressure a pod is guaranteed only what a cluster budget selecting it allows, and nothing
    /// where none does).
    #[arg(long, env = "GPUBUDGET_NAMESPACED_BUDGETS", value_enum, default_value = "Trusted")]
    pub namespaced_budgets: NamespacedBudgetsArg,
    /// The namespaces whose critical-priority pods (system-node-critical, system-cluster-critical) are never
    /// evicted, comma-separated; empty: none. Elsewhere critical priority exempts nothing.
    #[arg(long, env = "GPUBUDGET_CRITICAL_NAMESPACES", default_value = "kube-system")]
    pub critical_namespaces: CriticalNamespaces,
    /// "Enforce" carries evictions out; "Observe" only reports what would be evicted (events
    /// GpuMemoryWouldEvict, gpubudget_would_evict_total, kubectl gpubudget why) and evicts nothing. The
    /// default of this node: its label gpubudget.io/enforcement overrides it, and a budget's spec.enforcement
    /// its own evictions (docs/operations.md, "Observe first").
    #[arg(long, env = "GPUBUDGET_ENFORCEMENT", default_value = "Enforce", value_parser = gpubudget_common::enforcement::parse_flag)]
    pub enforcement: Enforcement,
}

/// Parses `--pressure-blocked-timeout`: a duration of at most an hour.
fn parse_blocked_timeout(text: &str) -> Result<Duration, String> {
    let d = parse_duration(text)?;
    if d > Duration::from_secs(3600) {
        return Err(format!("{text:?}: at most 1h (a PodDisruptionBudget may hold pressure relief back that long)"));
    }
    Ok(d)
}

/// `--namespaced-budgets` (docs/security.md, "No exemption a tenant can grant itself").
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum NamespacedBudgetsArg {
    /// Administrators write them (the chart's default RBAC).
    #[value(name = "Trusted", alias = "trusted")]
    Trusted,
    /// Tenants may write them.
    #[value(name = "ClusterBound", alias = "clusterbound")]
    ClusterBound,
}

impl From<NamespacedBudgetsArg> for NamespacedBudgets {
    fn from(arg: NamespacedBudgetsArg) -> Self {
        match arg {
            NamespacedBudgetsArg::Trusted => Self::Trusted,
            NamespacedBudgetsArg::ClusterBound => Self::ClusterBound,
        }
    }
}

/// `--unbudgeted-pods` (docs/agent.md, "Pressure").
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum UnbudgetedPods {
    /// Ranked as guaranteed nothing (the default: it protects the budgeted neighbour).
    #[value(name = "Ranked", alias = "ranked")]
    Ranked,
    /// Never evicted for pressure.
    #[value(name = "Never", alias = "never")]
    Never,
}

impl From<UnbudgetedPods> for Unbudgeted {
    fn from(arg: UnbudgetedPods) -> Self {
        match arg {
            UnbudgetedPods::Ranked => Self::Ranked,
            UnbudgetedPods::Never => Self::Never,
        }
    }
}

impl Default for PressureArgs {
    /// The flags' own defaults (one place: the `default_value`s above; their environment variables apply, as
    /// they do to `run`).
    fn default() -> Self {
        #[derive(Parser)]
        struct Defaults {
            #[command(flatten)]
            pressure: PressureArgs,
        }
        Defaults::parse_from(["defaults"]).pressure
    }
}

impl PressureArgs {
    /// The decision settings.
    pub fn apply(&self, settings: &mut Settings) {
        let ms = |d: Duration| u64::try_from(d.as_millis()).unwrap_or(u64::MAX);
        settings.pressure = PressureSettings {
            hard: self.pressure_hard.0,
            soft: self.pressure_soft.0,
            soft_grace_ms: ms(self.pressure_soft_grace),
            transition_ms: ms(self.pressure_transition),
        };
        settings.pressure_grace_seconds = self.pressure_grace_seconds;
        settings.unbudgeted_pods = self.unbudgeted_pods.into();
        settings.pressure_blocked_timeout_ms = ms(self.pressure_blocked_timeout);
        settings.namespaced_budgets = self.namespaced_budgets.into();
        settings.critical_namespaces = self.critical_namespaces.clone();
        settings.enforcement = self.enforcement;
    }
}

/// When memory that no listed process accounts for is told on the Node (docs/agent.md, "GPU states").
#[derive(Debug, Clone, Args)]
pub struct AccountingArgs {
    /// A GPU's used memory that no listed process accounts for, at or above this (bytes, "2Gi", or a
    /// percentage of the GPU, "5%") for --unaccounted-for, gets one warning Event on the Node naming the
    /// likely cause; "off": never.
    #[arg(long, env = "GPUBUDGET_UNACCOUNTED_THRESHOLD", default_value = "2Gi", value_parser = parse_threshold)]
    pub unaccounted_threshold: MaybeThreshold,
    /// How long it must last.
    #[arg(long, env = "GPUBUDGET_UNACCOUNTED_FOR", default_value = "60s", value_parser = parse_duration)]
    pub unaccounted_for: Duration,
}

impl Default for AccountingArgs {
    /// The flags' own defaults.
    fn default() -> Self {
        #[derive(Parser)]
        struct Defaults {
            #[command(flatten)]
            accounting: AccountingArgs,
        }
        Defaults::parse_from(["defaults"]).accounting
    }
}

impl AccountingArgs {
    /// The decision settings.
    pub fn apply(&self, settings: &mut Settings) {
        settings.accounting = AccountingSettings {
            threshold: self.unaccounted_threshold.0,
            after_ms: u64::try_from(self.unaccounted_for.as_millis()).unwrap_or(u64::MAX),
        };
    }
}

/// How often the node's `GpuNodeUsage` is rewritten (docs/agent.md, "Write load"): the knob that bounds what a
/// node sends the API server when usage keeps moving. A pod's record is written for its state, budget and
/// eviction only (at once, whatever these say), never for usage alone (#34).
#[derive(Debug, Clone, Args)]
pub struct RecordArgs {
    /// The node's usage object is written at most this often, whatever the pod count (10s to 1h: at most six
    /// writes a minute).
    #[arg(long, env = "GPUBUDGET_USAGE_WRITE_INTERVAL", default_value = "30s", value_parser = parse_usage_write_interval)]
    pub usage_write_interval: Duration,
    /// … and only when a pod came or went, or a pod's usage moved by at least this percentage of the value last
    /// written (1 to 100).
    #[arg(long, env = "GPUBUDGET_USAGE_WRITE_CHANGE_PERCENT", default_value_t = 5, value_parser = clap::value_parser!(u64).range(1..=100))]
    pub usage_write_change_percent: u64,
}

/// A usage write interval: a duration of 10 s to 1 h (at most six writes a minute per node; over an hour the
/// object stops being a reading).
fn parse_usage_write_interval(text: &str) -> Result<Duration, String> {
    let d = parse_duration(text)?;
    let min = gpubudget_common::node_usage::WRITE_INTERVAL_MIN_SECONDS;
    if (Duration::from_secs(min)..=Duration::from_secs(3600)).contains(&d) {
        Ok(d)
    } else {
        Err(format!("{text}: the usage write interval must be between {min}s and 3600s"))
    }
}

impl Default for RecordArgs {
    /// The flags' own defaults.
    fn default() -> Self {
        #[derive(Parser)]
        struct Defaults {
            #[command(flatten)]
            records: RecordArgs,
        }
        Defaults::parse_from(["defaults"]).records
    }
}

impl RecordArgs {
    /// The decision settings.
    pub fn apply(&self, settings: &mut Settings) {
        settings.usage_min_interval_ms = u64::try_from(self.usage_write_interval.as_millis()).unwrap_or(u64::MAX);
        settings.usage_change_percent = self.usage_write_change_percent;
    }
}

/// A pressure threshold, or none ("off").
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MaybeThreshold(pub Option<Threshold>);

/// Parses a threshold, or "off".
pub fn parse_threshold(text: &str) -> Result<MaybeThreshold, String> {
    match text.trim() {
        "off" | "" => Ok(MaybeThreshold(None)),
        other => Threshold::parse(other).map(|t| MaybeThreshold(Some(t))),
    }
}

/// `run`.
#[derive(Debug, Clone, Args)]
pub struct RunArgs {
    /// This node's name (from the downward API).
    #[arg(long, env = "NODE_NAME")]
    pub node_name: String,
    #[command(flatten)]
    pub sample: SampleArgs,
    /// Admin port address (/live, /ready, /metrics).
    #[arg(long, env = "GPUBUDGET_ADMIN_ADDR", default_value = "0.0.0.0:9400")]
    pub admin_addr: SocketAddr,
    /// Replay this sample file instead of NVML (re-read when it changes).
    #[arg(long, env = "GPUBUDGET_SAMPLE_FILE")]
    pub sample_file: Option<PathBuf>,
    /// Where the host's cgroup v2 hierarchy is, as the NVIDIA driver sees it: pods' container cgroups are
    /// named to the driver under it when their limits are read (driver R615 or newer).
    #[arg(long, env = "GPUBUDGET_CGROUP_ROOT", default_value = "/sys/fs/cgroup")]
    pub cgroup_root: PathBuf,
    /// Set the driver's per-cgroup GPU memory limits (R615 or newer) from the budget where a pod's budget has
    /// caps enabled and its container cgroup has no hard limit or a larger one (created while the webhook was
    /// down, or before the budget): hard = the limit, soft = the request, per container and GPU, as the
    /// webhook's `NVIDIA_GPU_MEMORY_LIMIT`/`_REQUEST` would have. Never raises a limit. Needs root.
    #[arg(long, env = "GPUBUDGET_APPLY_DRIVER_LIMITS")]
    pub apply_driver_limits: bool,
    /// The Lease (`NAMESPACE/NAME`) by which the operator vouches that every budget has a current mirror: the
    /// agent reads the budgets' mirrors instead of the budgets only while the operator renews it, and reads the
    /// budgets themselves again within about a minute of it stopping. Unset: always the budgets.
    #[arg(long, env = "GPUBUDGET_MIRRORS_LEASE", value_parser = parse_lease)]
    pub mirrors_lease: Option<(String, String)>,
    #[command(flatten)]
    pub pressure: PressureArgs,
    #[command(flatten)]
    pub accounting: AccountingArgs,
    #[command(flatten)]
    pub records: RecordArgs,
    #[command(flatten)]
    pub runtime_caps: RuntimeCapsArgs,
}

/// Caps set where the container is made (#45): the agent decides for the relay that holds the runtime's NRI
/// socket (`runtime-caps-relay`, #53).
#[derive(Debug, Clone, Args, Default)]
pub struct RuntimeCapsArgs {
    /// Connect to the runtime-caps relay and write each GPU container's caps (its budget's, with
    /// `admissionCaps: Enabled`) into its environment as the runtime makes it: from the container the runtime
    /// builds (final environment, device nodes), whichever way the pod was created.
    #[arg(long = "runtime-caps", env = "GPUBUDGET_RUNTIME_CAPS")]
    pub enabled: bool,
    /// The relay's socket (`runtime-caps-relay --listen`).
    #[arg(
        long = "runtime-caps-socket",
        env = "GPUBUDGET_RUNTIME_CAPS_SOCKET",
        default_value = "/run/gpubudget/runtime-caps.sock"
    )]
    pub socket: PathBuf,
    /// How long a GPU container waits for its pod's budget to be known (at most 1.5s: the runtime gives the
    /// plugin 2 s per request, then drops it and creates the container unadjusted).
    #[arg(long = "runtime-caps-wait", env = "GPUBUDGET_RUNTIME_CAPS_WAIT", default_value = "1s", value_parser = parse_runtime_wait)]
    pub wait: Duration,
    /// What a GPU container whose budget is still not known then gets: `create` (uncapped, reported) or `refuse`
    /// (the runtime fails it with the reason; the kubelet retries with back-off).
    #[arg(long = "runtime-caps-unresolved", env = "GPUBUDGET_RUNTIME_CAPS_UNRESOLVED", value_enum, default_value_t = Unresolved::Create)]
    pub unresolved: Unresolved,
    /// The node's MPS pipe directory, set in every capped container (where the node runs an MPS daemon there).
    #[arg(long = "runtime-caps-mps-pipe-directory", env = "GPUBUDGET_RUNTIME_CAPS_MPS_PIPE_DIRECTORY")]
    pub mps_pipe: Option<String>,
    /// Namespaces whose containers are never refused, comma-separated (as the relay's `--never-refuse`).
    #[arg(
        long = "runtime-caps-never-refuse",
        env = "GPUBUDGET_RUNTIME_CAPS_NEVER_REFUSE",
        default_value = "kube-system"
    )]
    pub never_refuse: CriticalNamespaces,
}

fn parse_runtime_wait(text: &str) -> Result<Duration, String> {
    let d = parse_duration(text)?;
    (d <= Duration::from_millis(1500)).then_some(d).ok_or_else(|| {
        format!("{text}: at most 1.5s (the runtime drops a plugin that takes 2 s and creates the container unadjusted)")
    })
}

/// `NAMESPACE/NAME`, each a DNS label or subdomain as Kubernetes names them.
fn parse_lease(text: &str) -> Result<(String, String), String> {
    let valid = |part: &str| {
        !part.is_empty()
            && part.len() <= 253
            && part.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'.')
    };
    match text.split_once('/') {
        Some((namespace, name)) if valid(namespace) && valid(name) => Ok((namespace.to_owned(), name.to_owned())),
        _ => Err(format!("{text:?}: expected NAMESPACE/NAME of a Lease, e.g. gpubudget/gpubudget-mirrors")),
    }
}

impl RunArgs {
    /// `run` replaying `sample_file` (attributed through `proc_root`) every `interval`, admin port on an
    /// ephemeral loopback port: how tests, the soak harness and the in-memory story run the agent.
    pub fn replay(node: &str, proc_root: PathBuf, sample_file: PathBuf, interval: Duration) -> Self {
        Self {
            node_name: node.to_owned(),
            sample: SampleArgs { proc_root, interval, interval_near: NearInterval::Off },
            admin_addr: SocketAddr::from(([127, 0, 0, 1], 0)),
            sample_file: Some(sample_file),
            cgroup_root: PathBuf::from("/sys/fs/cgroup"),
            apply_driver_limits: false,
            mirrors_lease: None,
            pressure: PressureArgs::default(),
            accounting: AccountingArgs::default(),
            records: RecordArgs::default(),
            runtime_caps: RuntimeCapsArgs::default(),
        }
    }
}

/// Output format of `top`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Output {
    /// An aligned table.
    Table,
    /// One JSON document per refresh.
    Json,
}

/// `top`.
#[derive(Debug, Clone, Args)]
pub struct TopArgs {
    /// Print once and exit.
    #[arg(long)]
    pub once: bool,
    /// A GPU whose free memory is under this is shown as under pressure (as the agent's
    /// --pressure-hard; "off": never).
    #[arg(long, env = "GPUBUDGET_PRESSURE_HARD", default_value = "5%", value_parser = parse_threshold)]
    pub pressure_hard: MaybeThreshold,
    /// Output format.
    #[arg(long, value_enum, default_value = "table")]
    pub output: Output,
    #[command(flatten)]
    pub sample: SampleArgs,
    /// Replay a sample file instead of NVML.
    #[arg(long = "sample", value_name = "FILE")]
    pub sample_file: Option<PathBuf>,
    /// The host's cgroup v2 hierarchy, as the NVIDIA driver sees it (for the driver's limits, R615 or newer).
    #[arg(long, env = "GPUBUDGET_CGROUP_ROOT", default_value = "/sys/fs/cgroup")]
    pub cgroup_root: PathBuf,
    /// Node whose pods give names (default: NODE_NAME, else this host's name).
    #[arg(long, env = "NODE_NAME")]
    pub node_name: Option<String>,
    /// Do not ask the API server for pod names (show UIDs).
    #[arg(long)]
    pub no_api: bool,
}

/// `capture`.
#[derive(Debug, Clone, Args)]
pub struct CaptureArgs {
    /// Where to write (default: stdout).
    #[arg(long, short)]
    pub output: Option<PathBuf>,
    /// Also resolve each PID through /proc and write its pod UID and container ID, so the file can be
    /// replayed on another host.
    #[arg(long)]
    pub attribute: bool,
    /// Proc root (with --attribute).
    #[arg(long, env = "GPUBUDGET_PROC_ROOT", default_value = "/proc")]
    pub proc_root: PathBuf,
}

/// `driver-limits`.
#[derive(Debug, Clone, Args)]
pub struct DriverLimitsArgs {
    /// The GPU (UUID, as `nvidia-smi -L` shows it) the cgroups are read on.
    #[arg(long)]
    pub gpu: Option<String>,
    /// Cgroups to read, by their full sysfs path (`/sys/fs/cgroup/kubepods.slice/…/cri-containerd-<id>.scope`).
    pub cgroups: Vec<PathBuf>,
    /// The NVML library to open.
    #[arg(long, default_value = gpubudget_nvml_limits::LIBRARY)]
    pub library: PathBuf,
}

/// `standalone`.
#[derive(Debug, Clone, Args)]
pub struct StandaloneArgs {
    /// GpuMemoryBudgets: YAML or JSON, several documents or a List.
    #[arg(long)]
    pub budgets: PathBuf,
    /// Pods (with metadata.uid and status.containerStatuses): YAML or JSON, several documents or a List.
    #[arg(long)]
    pub pods: PathBuf,
    /// This node's name: pods bound to another node are ignored. Without it, every pod of the file is
    /// taken as running here.
    #[arg(long, env = "NODE_NAME")]
    pub node_name: Option<String>,
    #[command(flatten)]
    pub sample: SampleArgs,
    /// Replay a sample file instead of NVML.
    #[arg(long, env = "GPUBUDGET_SAMPLE_FILE")]
    pub sample_file: Option<PathBuf>,
    /// Stop after this long ("90s"); default: until SIGTERM or Ctrl-C.
    #[arg(long, value_parser = parse_duration)]
    pub duration: Option<Duration>,
    /// Write the JSON lines here (default: stdout).
    #[arg(long, short)]
    pub output: Option<PathBuf>,
    /// Also write a "usage" line per pod with a budget whenever its usage changes.
    #[arg(long)]
    pub log_usage: bool,
    /// Serve `/live`, `/ready` and `/metrics` here too (as `run` does), e.g. `127.0.0.1:9400`.
    #[arg(long, env = "GPUBUDGET_ADMIN_ADDR")]
    pub admin_addr: Option<SocketAddr>,
    #[command(flatten)]
    pub pressure: PressureArgs,
    #[command(flatten)]
    pub accounting: AccountingArgs,
}

/// Parses "250ms", "1s", "1.5s", "2m", "1h".
pub fn parse_duration(text: &str) -> Result<Duration, String> {
    let text = text.trim();
    let split = text.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(text.len());
    let (number, unit) = text.split_at(split);
    let value: f64 = number.parse().map_err(|_| format!("{text:?} is not a duration such as 250ms or 1s"))?;
    let seconds = match unit.trim() {
        "ms" => value / 1000.0,
        "s" => value,
        "m" => value * 60.0,
        "h" => value * 3600.0,
        _ => return Err(format!("{text:?}: give a unit (ms, s, m, h), as in 250ms or 1s")),
    };
    if !seconds.is_finite() || seconds <= 0.0 || seconds > 86_400.0 {
        return Err(format!("{text:?} must be more than 0 and at most a day"));
    }
    Ok(Duration::from_secs_f64(seconds))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations() {
        assert_eq!(parse_duration("250ms"), Ok(Duration::from_millis(250)));
        assert_eq!(parse_duration("1s"), Ok(Duration::from_secs(1)));
        assert_eq!(parse_duration("1.5s"), Ok(Duration::from_millis(1500)));
        assert_eq!(parse_duration("2m"), Ok(Duration::from_secs(120)));
        assert!(parse_duration("250").is_err());
        assert!(parse_duration("0s").is_err());
        assert!(parse_duration("fast").is_err());
        assert!(parse_duration("").is_err());
    }

    #[test]
    fn the_charts_flags_and_env_parse() {
        let cli = Cli::try_parse_from([
            "gpubudget-agent",
            "run",
            "--node-name",
            "n1",
            "--proc-root",
            "/host/proc",
            "--interval",
            "1s",
            "--admin-addr",
            "0.0.0.0:9400",
            "--sample-file",
            "/var/run/gpubudget/replay/sample.json",
            "--log-format",
            "json",
        ])
        .expect("parses");
        let Command::Run(run) = cli.command else { panic!("run") };
        assert_eq!(run.node_name, "n1");
        assert_eq!(run.sample.interval, Duration::from_secs(1));
        assert_eq!(run.sample.cadence(), Ok(Cadence { relaxed_ms: 1_000, fast_ms: 20, ..Cadence::DEFAULT }));
        assert_eq!(cli.log_format, LogFormat::Json);
        use clap::CommandFactory;
        Cli::command().debug_assert();
    }

    #[test]
    fn the_sampling_pace_defaults_to_the_decisions_and_a_near_interval_longer_than_the_interval_is_refused() {
        let sample = |extra: &[&str]| {
            let mut argv = vec!["gpubudget-agent", "run", "--node-name", "n1"];
            argv.extend_from_slice(extra);
            match Cli::try_parse_from(argv).expect("parses").command {
                Command::Run(run) => run.sample.cadence(),
                _ => panic!("run"),
            }
        };
        assert_eq!(sample(&[]), Ok(Cadence::DEFAULT));
        assert_eq!(sample(&["--interval-near", "off"]), Ok(Cadence::fixed(250)));
        assert_eq!(sample(&["--interval", "100ms", "--interval-near", "100ms"]), Ok(Cadence::fixed(100)));
        // The default follows a shorter --interval (an interval set before --interval-near existed still runs).
        assert_eq!(sample(&["--interval", "10ms"]), Ok(Cadence::fixed(10)));
        assert_eq!(
            sample(&["--interval", "1s", "--interval-near", "50ms"]).map(|c| (c.relaxed_ms, c.fast_ms)),
            Ok((1_000, 50))
        );
        let error = sample(&["--interval", "100ms", "--interval-near", "200ms"]).expect_err("refused");
        assert!(error.contains("--interval-near (200ms) must not be longer than --interval (100ms)"), "{error}");
        assert!(
            Cli::try_parse_from(["gpubudget-agent", "run", "--node-name", "n", "--interval-near", "fast"]).is_err()
        );
    }

    #[test]
    fn accounting_defaults_are_the_flags_and_the_decision_defaults() {
        let mut settings = Settings::new("n1");
        settings.accounting.after_ms = 1;
        AccountingArgs::default().apply(&mut settings);
        assert_eq!(settings.accounting, AccountingSettings::DEFAULT);
        assert_eq!(parse_threshold("off"), Ok(MaybeThreshold(None)));
    }

    #[test]
    fn record_defaults_are_the_decision_defaults_and_bad_values_are_refused() {
        let mut settings = Settings::new("n1");
        let defaults = (settings.usage_min_interval_ms, settings.usage_change_percent);
        settings.usage_min_interval_ms = 1;
        settings.usage_change_percent = 1;
        RecordArgs::default().apply(&mut settings);
        assert_eq!((settings.usage_min_interval_ms, settings.usage_change_percent), defaults);
        let run = |extra: &[&str]| {
            let mut argv = vec!["gpubudget-agent", "run", "--node-name", "n1"];
            argv.extend_from_slice(extra);
            Cli::try_parse_from(argv).map(|cli| match cli.command {
                Command::Run(run) => run.records,
                _ => panic!("run"),
            })
        };
        let wide = run(&["--usage-write-interval", "2m", "--usage-write-change-percent", "20"]).expect("parses");
        wide.apply(&mut settings);
        assert_eq!((settings.usage_min_interval_ms, settings.usage_change_percent), (120_000, 20));
        for bad in
            [["--usage-write-interval", "1s"], ["--usage-write-interval", "2h"], ["--usage-write-change-percent", "0"]]
        {
            let error = run(&bad).expect_err("refused").to_string();
            assert!(error.contains(bad[0]), "{error}");
        }
        assert!(
            run(&["--usage-write-interval", "1s"]).expect_err("refused").to_string().contains("between 10s and 3600s")
        );
    }

    #[test]
    fn pressure_defaults_are_the_flags_and_off_disables() {
        let d = PressureArgs::default();
        assert_eq!(d.pressure_hard, MaybeThreshold(Some(Threshold::Percent(5))));
        assert_eq!(d.pressure_soft, MaybeThreshold(None));
        assert_eq!((d.pressure_soft_grace, d.pressure_transition), (Duration::from_secs(10), Duration::from_secs(10)));
        assert_eq!(d.pressure_grace_seconds, 5);
        assert_eq!(d.unbudgeted_pods, UnbudgetedPods::Ranked);
        let mut settings = Settings::new("n1");
        settings.unbudgeted_pods = Unbudgeted::Never;
        d.apply(&mut settings);
        assert_eq!(settings.unbudgeted_pods, Settings::new("n1").unbudgeted_pods, "the flag's default is decide's");
        #[derive(Parser)]
        struct P {
            #[command(flatten)]
            pressure: PressureArgs,
        }
        for (text, want) in
            [("Never", UnbudgetedPods::Never), ("never", UnbudgetedPods::Never), ("ranked", UnbudgetedPods::Ranked)]
        {
            let parsed = P::try_parse_from(["p", "--unbudgeted-pods", text]).expect("parses").pressure;
            assert_eq!(parsed.unbudgeted_pods, want);
        }
        assert!(P::try_parse_from(["p", "--unbudgeted-pods", "sometimes"]).is_err());
        // #33: the defaults are decide's; bad values are named.
        let defaults = Settings::new("n1");
        assert_eq!(settings.pressure_blocked_timeout_ms, defaults.pressure_blocked_timeout_ms);
        assert_eq!(settings.namespaced_budgets, defaults.namespaced_budgets);
        assert_eq!(settings.critical_namespaces, defaults.critical_namespaces);
        assert_eq!((settings.enforcement, defaults.enforcement), (Enforcement::Enforce, Enforcement::Enforce));
        let parsed = P::try_parse_from([
            "p",
            "--pressure-blocked-timeout",
            "2m",
            "--namespaced-budgets",
            "ClusterBound",
            "--critical-namespaces",
            "kube-system,gpu-system",
            "--enforcement",
            "observe",
        ])
        .expect("parses")
        .pressure;
        parsed.apply(&mut settings);
        assert_eq!(settings.pressure_blocked_timeout_ms, 120_000);
        assert_eq!(settings.namespaced_budgets, NamespacedBudgets::ClusterBound);
        assert!(settings.critical_namespaces.exempts("gpu-system"));
        assert_eq!(settings.enforcement, Enforcement::Observe);
        for (flag, bad, says) in [
            ("--pressure-blocked-timeout", "2h", "at most 1h"),
            ("--critical-namespaces", "Team_A", "is not a namespace name"),
            ("--namespaced-budgets", "Tenants", "invalid value"),
            ("--enforcement", "DryRun", "Observe or Enforce"),
        ] {
            let error = P::try_parse_from(["p", flag, bad]).err().expect(bad).to_string();
            assert!(error.contains(says), "{flag} {bad}: {error}");
        }
        assert_eq!(parse_threshold("off"), Ok(MaybeThreshold(None)));
        assert_eq!(parse_threshold("4Gi"), Ok(MaybeThreshold(Some(Threshold::Bytes(4 << 30)))));
        assert!(parse_threshold("lots").is_err());
    }
}
