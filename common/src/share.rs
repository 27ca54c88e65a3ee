//! The share of GPU memory a pod was given by the tool that placed it, and what that share is on a node's
//! GPUs. A budget with `spec.share` takes each pod's limit from here (`Budget::for_share`). Pure: it reads a
//! pod (and its node's labels) and does arithmetic; nothing here reads a device.
//!
//! What is read (each one a [`ShareSource`]):
//! - **KAI-Scheduler**: the pod annotations `gpu-fraction` (a decimal in (0, 1]: that part of each GPU's
//!   memory), `gpu-memory` (MiB per GPU) and `gpu-fraction-num-devices` (how many GPUs get that share,
//!   default 1), read only on pods whose `schedulerName` is `kai-scheduler`: KAI placed those and reserved
//!   the share; on any other pod the annotations are anyone's words (a forged share would buy its pod a
//!   guarantee under pressure). Such pods request no GPU resource: KAI's binder hands out the devices.
//! - **HAMi**: per container, `nvidia.com/gpumem` (MiB per GPU) or `nvidia.com/gpumem-percentage` (percent of
//!   each GPU), times the container's `nvidia.com/gpu` count (default 1), from limits, else requests. They are
//!   Kubernetes quantities, read in every form the API server stores (it writes `20000` as `20k`) and required
//!   to be whole numbers.
//! - **The NVIDIA device plugin's MPS replicas**: on a node labelled `nvidia.com/gpu.sharing-strategy: mps`
//!   with `nvidia.com/gpu.replicas: R`, each replica of `nvidia.com/gpu` (or `nvidia.com/gpu.shared`) is 1/R
//!   of a GPU's memory, the MPS daemon's default pinned limit. Time-slicing replicas declare no memory share.
//!
//! Every value a tenant writes is bounded before it is read: a malformed or out-of-range one makes the pod's
//! share [`Declaration::Invalid`] with the reason, never a guess, for the budgets that read that source; a
//! budget that reads only other sources still gets their share.

use std::collections::BTreeMap;
use std::fmt;

use k8s_openapi::api::core::v1::{Container, Pod};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::quantity::HumanBytes;

/// KAI-Scheduler's annotation: the fraction of each GPU's memory the pod was given.
pub const KAI_FRACTION: &str = "gpu-fraction";
/// KAI-Scheduler's annotation: the GPU memory the pod was given, MiB per GPU.
pub const KAI_MEMORY: &str = "gpu-memory";
/// KAI-Scheduler's annotation: how many GPUs get the fraction (or memory); 1 when absent.
pub const KAI_NUM_DEVICES: &str = "gpu-fraction-num-devices";
/// KAI-Scheduler's scheduler name (its default `schedulerName`): its annotations are read only on such pods.
pub const KAI_SCHEDULER: &str = "kai-scheduler";
/// HAMi's resource: GPU memory per GPU, MiB.
pub const HAMI_MEMORY: &str = "nvidia.com/gpumem";
/// HAMi's resource: GPU memory per GPU, percent of the GPU.
pub const HAMI_PERCENTAGE: &str = "nvidia.com/gpumem-percentage";
/// The NVIDIA device plugin's GPU resource.
pub const GPU: &str = "nvidia.com/gpu";
/// The device plugin's resource for replicas of a shared GPU (`renameByDefault`).
pub const GPU_SHARED: &str = "nvidia.com/gpu.shared";
/// GPU feature discovery's label: how the device plugin shares each GPU (`none`, `time-slicing`, `mps`).
pub const SHARING_STRATEGY: &str = "nvidia.com/gpu.sharing-strategy";
/// GPU feature discovery's label: replicas per GPU.
pub const REPLICAS: &str = "nvidia.com/gpu.replicas";

/// The longest value read: a longer annotation or quantity is invalid, whatever it says.
pub const MAX_VALUE_LEN: usize = 32;
/// The most GPUs one declaration may name (KAI's `gpu-fraction-num-devices`, HAMi's `nvidia.com/gpu`).
pub const MAX_DEVICES: u32 = 64;
/// The most MiB per GPU a declaration may name (1 PiB, beyond any GPU).
pub const MAX_MIB: u64 = 1 << 30;
/// The most replicas per GPU read from the node's label.
pub const MAX_REPLICAS: u32 = 1024;

const MIB: u64 = 1 << 20;
/// A fraction is kept in millionths.
const MILLION: u64 = 1_000_000;

/// Where a pod's declared share is read from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize, JsonSchema)]
pub enum ShareSource {
    /// KAI-Scheduler's `gpu-fraction` annotation (with `gpu-fraction-num-devices`).
    KaiFraction,
    /// KAI-Scheduler's `gpu-memory` annotation (MiB per GPU, with `gpu-fraction-num-devices`).
    KaiMemory,
    /// HAMi's `nvidia.com/gpumem` resource (MiB per GPU, times `nvidia.com/gpu`).
    HamiMemory,
    /// HAMi's `nvidia.com/gpumem-percentage` resource (percent of each GPU, times `nvidia.com/gpu`).
    HamiPercentage,
    /// The NVIDIA device plugin's MPS replicas: 1/replicas of a GPU per replica requested.
    MpsReplicas,
}

impl ShareSource {
    /// The source as messages and `kubectl get` name it: `KAI gpu-fraction`, `HAMi gpumem`, `MPS replicas`.
    pub fn name(self) -> &'static str {
        match self {
            ShareSource::KaiFraction => "KAI gpu-fraction",
            ShareSource::KaiMemory => "KAI gpu-memory",
            ShareSource::HamiMemory => "HAMi gpumem",
            ShareSource::HamiPercentage => "HAMi gpumem-percentage",
            ShareSource::MpsReplicas => "MPS replicas",
        }
    }

    /// Every source, in the order they are read.
    pub const ALL: [ShareSource; 5] = [
        ShareSource::KaiFraction,
        ShareSource::KaiMemory,
        ShareSource::HamiMemory,
        ShareSource::HamiPercentage,
        ShareSource::MpsReplicas,
    ];
}

/// Which sources a budget reads: a set of [`ShareSource`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Sources(u8);

impl Sources {
    /// Every source.
    pub const ALL: Sources = Sources(0b1_1111);

    /// The sources listed; an empty list means all of them.
    pub fn of(listed: &[ShareSource]) -> Self {
        if listed.is_empty() { Self::ALL } else { Self(listed.iter().fold(0, |m, s| m | Self::bit(*s))) }
    }

    fn bit(s: ShareSource) -> u8 {
        1 << (s as u8)
    }

    /// Whether `s` is read.
    pub fn has(self, s: ShareSource) -> bool {
        self.0 & Self::bit(s) != 0
    }
}

/// How much of a GPU one term of a declaration names.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Amount {
    /// Millionths of each GPU's memory (a fraction or a percentage).
    PerMillion(u32),
    /// MiB per GPU.
    Mib(u64),
    /// One replica of a GPU split into this many (MPS).
    Replica(u32),
    /// GPU replicas asked for, before the node's labels say whether they are MPS replicas and how many there
    /// are per GPU ([`Declaration::on_node`]).
    NodeReplicas,
}

/// One term of a declaration: `amount` on each of `devices` GPUs, from `source`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Term {
    /// Where it was read.
    pub source: ShareSource,
    /// How much per GPU (or per replica).
    pub amount: Amount,
    /// On how many GPUs (or replicas).
    pub devices: u32,
}

/// What a pod declares.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum Declaration {
    /// No share from any source read.
    None,
    /// A share: the sum of its terms (one per KAI pod, one per HAMi container, one for MPS replicas).
    Share(Vec<Term>),
    /// A value is malformed or out of range: under a budget that reads a faulty source the pod's share is
    /// unresolved, for that source's reason; a budget reading only other sources gets their `terms`.
    Invalid {
        /// The first fault of each faulty source, in the order read (at most one per source).
        faults: Vec<(ShareSource, String)>,
        /// The terms read well from the sources without a fault.
        terms: Vec<Term>,
    },
}

/// Why a declared share could not be resolved on a node. Its `Display` is the reason as messages tell it.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum ShareFault {
    /// A fraction or replica before NVML has told the node's GPU sizes: a moment at an agent's start, not a
    /// fault of the pod.
    NotKnownYet,
    /// GPU replicas asked for, not yet read against the node's labels ([`Declaration::on_node`]).
    ReplicasNotKnown,
    /// A value the pod declares, from a source the budget reads, is malformed or out of range: the pod's own
    /// fault (the first faulty source read, [`Declaration::fault`]).
    Invalid {
        /// The faulty source.
        source: ShareSource,
        /// Why, in words (`gpu-fraction: "lots" is not a decimal …`).
        why: String,
    },
}

impl fmt::Display for ShareFault {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ShareFault::NotKnownYet => f.write_str("the node's GPU memory is not known yet"),
            ShareFault::ReplicasNotKnown => f.write_str("the node's MPS replicas are not known"),
            ShareFault::Invalid { why, .. } => f.write_str(why),
        }
    }
}

impl std::error::Error for ShareFault {}

impl ShareFault {
    /// Whether the pod's own declaration is at fault ([`ShareFault::Invalid`]), not the node's state.
    pub fn is_pods(&self) -> bool {
        matches!(self, ShareFault::Invalid { .. })
    }
}

/// A declared share on this node's GPUs.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Resolved {
    /// Bytes in all.
    pub bytes: u64,
    /// How it was reached, for messages: `KAI gpu-fraction 0.5 of 79.6Gi = 39.8Gi`.
    pub text: String,
    /// The sources its terms were read from, each once, in [`ShareSource::ALL`]'s order.
    pub sources: Vec<ShareSource>,
}

/// How a budget's rules for one pod came from its declared share: what the agent applies, records on the pod
/// (`gpubudget.io/share`) and says in messages; status, `why` and `top` read it back.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct HeldShare {
    /// The pod's limit, bytes: its share (at most the budget's limit), or the budget's limit where unresolved.
    pub limit_bytes: u64,
    /// The sources the share was read from; empty where it is unresolved.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub sources: Vec<ShareSource>,
    /// How, in words: `KAI gpu-fraction 0.5 of 79.6Gi = 39.8Gi`, or `share unresolved: <why>; held to …`.
    pub note: String,
    /// Where the pod's declaration changed after this share was first held and would loosen it (#51): how, in
    /// words (`the share declared now (KAI gpu-fraction 1 of 80Gi = 80Gi) is more`); the change is ignored.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ignored: Option<String>,
}

impl HeldShare {
    /// The longest note kept: longer ones (many HAMi containers) are cut, ending in `…`.
    pub const NOTE_MAX: usize = 300;
    /// The longest annotation read back: more than any the agent writes (two notes, every character escaped).
    pub const ANNOTATION_MAX: usize = 6 * Self::NOTE_MAX;

    /// A held share; the note is cut at [`Self::NOTE_MAX`] bytes (on a character boundary).
    pub fn new(limit_bytes: u64, sources: Vec<ShareSource>, note: String) -> Self {
        Self { limit_bytes, sources, note: cut(note, Self::NOTE_MAX), ignored: None }
    }

    /// Whether the share was resolved (else the budget's own limit holds the pod).
    pub fn resolved(&self) -> bool {
        !self.sources.is_empty()
    }

    /// The annotation's value (JSON).
    pub fn to_annotation(&self) -> String {
        serde_json::to_string(self).unwrap_or_default()
    }

    /// This share, kept over a later declaration that would loosen it (`why`, cut at [`Self::NOTE_MAX`]).
    pub fn kept_over(mut self, why: String) -> Self {
        self.ignored = Some(cut(why, Self::NOTE_MAX));
        self
    }

    /// Reads the annotation's value; `None` when it is longer than any the agent writes or not this JSON.
    pub fn from_annotation(value: &str) -> Option<Self> {
        (value.len() <= Self::ANNOTATION_MAX).then(|| serde_json::from_str(value).ok()).flatten()
    }
}

/// `text` cut to at most `max` bytes on a character boundary, ending in `…` where it was cut.
fn cut(mut text: String, max: usize) -> String {
    if text.len() > max {
        let mut end = max - '…'.len_utf8();
        while !text.is_char_boundary(end) {
            end -= 1;
        }
        text.truncate(end);
        text.push('…');
    }
    text
}

/// Reads the pod's declared share from the sources in `sources`. `node_labels`: the labels of the pod's node
/// (for MPS replicas); `None` when unknown (then MPS replicas are not read).
pub fn declared(pod: &Pod, node_labels: Option<&BTreeMap<String, String>>, sources: Sources) -> Declaration {
    declared_by_pod(pod, sources).on_node(node_labels)
}

/// What the pod itself declares, its GPU replicas kept as [`Amount::NodeReplicas`] until
/// [`Declaration::on_node`] reads its node's labels: the agent keeps this (its node's labels may change).
pub fn declared_by_pod(pod: &Pod, sources: Sources) -> Declaration {
    let mut terms = Vec::new();
    let mut faults: Vec<(ShareSource, String)> = Vec::new();
    let mut fault = |source: ShareSource, why: String| {
        if !faults.iter().any(|(s, _)| *s == source) {
            faults.push((source, why));
        }
    };
    let by_kai = pod.spec.as_ref().and_then(|s| s.scheduler_name.as_deref()) == Some(KAI_SCHEDULER);
    let annotations = pod.metadata.annotations.as_ref().filter(|_| by_kai);
    let annotation = |k: &str| annotations.and_then(|a| a.get(k)).map(String::as_str);
    let kai_devices = || -> Result<u32, String> {
        annotation(KAI_NUM_DEVICES).map_or(Ok(1), |v| count(KAI_NUM_DEVICES, v, MAX_DEVICES))
    };
    if sources.has(ShareSource::KaiFraction)
        && let Some(v) = annotation(KAI_FRACTION)
    {
        match (fraction(v), kai_devices()) {
            (Ok(f), Ok(devices)) => {
                terms.push(Term { source: ShareSource::KaiFraction, amount: Amount::PerMillion(f), devices })
            }
            (Err(e), _) | (_, Err(e)) => fault(ShareSource::KaiFraction, e),
        }
    }
    if sources.has(ShareSource::KaiMemory)
        && let Some(v) = annotation(KAI_MEMORY)
    {
        match (count(KAI_MEMORY, v, u32::MAX).map(u64::from), kai_devices()) {
            (Ok(mib), Ok(devices)) if mib <= MAX_MIB => {
                terms.push(Term { source: ShareSource::KaiMemory, amount: Amount::Mib(mib), devices })
            }
            (Ok(_), Ok(_)) => fault(ShareSource::KaiMemory, format!("{KAI_MEMORY}: {v} MiB is more than any GPU")),
            (Err(e), _) | (_, Err(e)) => fault(ShareSource::KaiMemory, e),
        }
    }
    let spec = pod.spec.as_ref();
    for c in spec.map(|s| s.containers.as_slice()).unwrap_or_default() {
        match hami_term(c, sources) {
            Ok(Some(t)) => terms.push(t),
            Ok(None) => {}
            Err((source, e)) => fault(source, format!("container {}: {e}", bounded(&c.name))),
        }
    }
    if sources.has(ShareSource::MpsReplicas) {
        // Whether these are MPS replicas is the node's to say (`on_node`): until then a value that is no whole
        // number makes the count unreadable (past MAX_DEVICES), which `on_node` tells only on an MPS node.
        let mut asked = 0u32;
        for c in spec.map(|s| s.containers.as_slice()).unwrap_or_default() {
            for r in [GPU, GPU_SHARED] {
                if let Some(v) = resource(c, r) {
                    let n = whole(v).map_or(u32::MAX, |n| u32::try_from(n).unwrap_or(u32::MAX - 1).min(u32::MAX - 1));
                    asked = asked.saturating_add(n);
                }
            }
        }
        if asked > 0 {
            terms.push(Term { source: ShareSource::MpsReplicas, amount: Amount::NodeReplicas, devices: asked });
        }
    }
    Declaration::of(terms, faults)
}

impl Declaration {
    /// `terms` and `faults` as one declaration: [`Declaration::Invalid`] with any fault, else a share or none.
    fn of(terms: Vec<Term>, faults: Vec<(ShareSource, String)>) -> Declaration {
        match (terms.is_empty(), faults.is_empty()) {
            (_, false) => Declaration::Invalid { faults, terms },
            (true, true) => Declaration::None,
            (false, true) => Declaration::Share(terms),
        }
    }

    /// A declaration whose only value, from `source`, is malformed for this reason.
    pub fn invalid(source: ShareSource, why: impl Into<String>) -> Declaration {
        Declaration::Invalid { faults: vec![(source, why.into())], terms: Vec::new() }
    }

    /// Why a budget reading `sources` cannot resolve this declaration because of the pod's own values (the
    /// first faulty source it reads, [`ShareFault::Invalid`]); `None` when every source it reads is well formed.
    pub fn fault(&self, sources: Sources) -> Option<ShareFault> {
        match self {
            Declaration::Invalid { faults, .. } => faults
                .iter()
                .find(|(s, _)| sources.has(*s))
                .map(|(source, why)| ShareFault::Invalid { source: *source, why: why.clone() }),
            _ => None,
        }
    }
}

impl Declaration {
    /// This declaration on a node labelled `node_labels` (`None`: not known): GPU replicas asked for are MPS
    /// replicas only where GPU feature discovery labels the node as sharing its GPUs by MPS, each 1/replicas of
    /// a GPU; elsewhere they declare no share (time-slicing, whole GPUs).
    pub fn on_node(self, node_labels: Option<&BTreeMap<String, String>>) -> Declaration {
        let (terms, faults) = match self {
            Declaration::Share(terms) => (terms, Vec::new()),
            Declaration::Invalid { faults, terms } => (terms, faults),
            Declaration::None => return Declaration::None,
        };
        if !terms.iter().any(|t| t.amount == Amount::NodeReplicas) {
            return Declaration::of(terms, faults);
        }
        // A fault of the replicas leaves the other sources' terms standing.
        let mps_fault = |terms: Vec<Term>, mut faults: Vec<(ShareSource, String)>, why: String| {
            faults.push((ShareSource::MpsReplicas, why));
            Declaration::of(terms.into_iter().filter(|t| t.amount != Amount::NodeReplicas).collect(), faults)
        };
        let mps = node_labels.filter(|l| l.get(SHARING_STRATEGY).map(String::as_str) == Some("mps"));
        let replicas = match mps.map(|l| l.get(REPLICAS).map(|v| count(REPLICAS, v, MAX_REPLICAS))) {
            None => None,
            Some(Some(Ok(r))) => Some(r),
            Some(Some(Err(e))) => return mps_fault(terms, faults, format!("the node's {e}")),
            Some(None) => {
                let why = format!("the node shares GPUs by MPS but has no {REPLICAS} label");
                return mps_fault(terms, faults, why);
            }
        };
        if replicas.is_some()
            && let Some(t) = terms.iter().find(|t| t.amount == Amount::NodeReplicas && t.devices > MAX_DEVICES)
        {
            let devices = t.devices;
            let why = format!(
                "{GPU} and {GPU_SHARED}: the replicas asked for are not whole numbers adding up to at most {MAX_DEVICES} \
                 (read {})",
                if devices == u32::MAX { "a value that is no whole number".to_owned() } else { devices.to_string() }
            );
            return mps_fault(terms, faults, why);
        }
        let terms: Vec<Term> = terms
            .into_iter()
            .filter_map(|t| match t.amount {
                Amount::NodeReplicas => replicas.map(|r| Term { amount: Amount::Replica(r), ..t }),
                _ => Some(t),
            })
            .collect();
        Declaration::of(terms, faults)
    }
}

/// HAMi's share in one container: `nvidia.com/gpumem` or `nvidia.com/gpumem-percentage` times its
/// `nvidia.com/gpu` (1 when absent); a fault names the source it spoils.
fn hami_term(c: &Container, sources: Sources) -> Result<Option<Term>, (ShareSource, String)> {
    let devices = || resource(c, GPU).map_or(Ok(1), |v| quantity_count(GPU, v, MAX_DEVICES));
    if sources.has(ShareSource::HamiMemory)
        && let Some(v) = resource(c, HAMI_MEMORY)
    {
        let at = |e| (ShareSource::HamiMemory, e);
        let mib = u64::from(quantity_count(HAMI_MEMORY, v, u32::MAX).map_err(at)?);
        if mib > MAX_MIB {
            return Err(at(format!("{HAMI_MEMORY}: {} MiB is more than any GPU", bounded(v))));
        }
        let devices = devices().map_err(at)?;
        return Ok(Some(Term { source: ShareSource::HamiMemory, amount: Amount::Mib(mib), devices }));
    }
    if sources.has(ShareSource::HamiPercentage)
        && let Some(v) = resource(c, HAMI_PERCENTAGE)
    {
        let at = |e| (ShareSource::HamiPercentage, e);
        let pct = quantity_count(HAMI_PERCENTAGE, v, 100).map_err(at)?;
        let amount = Amount::PerMillion(pct * 10_000);
        return Ok(Some(Term { source: ShareSource::HamiPercentage, amount, devices: devices().map_err(at)? }));
    }
    Ok(None)
}

/// A container's limit for `name`, else its request, as written.
fn resource<'a>(c: &'a Container, name: &str) -> Option<&'a str> {
    let r = c.resources.as_ref()?;
    let pick = |m: Option<&'a BTreeMap<String, k8s_openapi::apimachinery::pkg::api::resource::Quantity>>| {
        m.and_then(|m| m.get(name)).map(|q| q.0.as_str())
    };
    pick(r.limits.as_ref()).or_else(|| pick(r.requests.as_ref()))
}

/// A value as it may appear in a message: at most [`MAX_VALUE_LEN`] characters, quoted.
fn bounded(v: &str) -> String {
    if v.chars().count() <= MAX_VALUE_LEN {
        format!("{v:?}")
    } else {
        format!("{:?}… ({} characters)", v.chars().take(MAX_VALUE_LEN).collect::<String>(), v.chars().count())
    }
}

/// A whole number in 1..=max, digits only.
fn count(name: &str, v: &str, max: u32) -> Result<u32, String> {
    let bad = || format!("{name}: {} is not a whole number from 1 to {max}", bounded(v));
    if v.is_empty() || v.len() > MAX_VALUE_LEN || !v.bytes().all(|b| b.is_ascii_digit()) {
        return Err(bad());
    }
    match v.parse::<u64>() {
        Ok(n) if n >= 1 && n <= u64::from(max) => Ok(n as u32),
        _ => Err(bad()),
    }
}

/// A Kubernetes quantity that is a whole number (`20000`, `20k`, `2e4`: the API server stores an extended
/// resource's `20000` as `20k`), at most [`MAX_VALUE_LEN`] characters; `None` otherwise.
fn whole(v: &str) -> Option<u64> {
    (v.len() <= MAX_VALUE_LEN).then(|| crate::quantity::parse_whole(v).ok()).flatten()
}

/// A whole number in 1..=max written as a Kubernetes quantity ([`whole`]).
fn quantity_count(name: &str, v: &str, max: u32) -> Result<u32, String> {
    match whole(v) {
        Some(n) if n >= 1 && n <= u64::from(max) => Ok(n as u32),
        _ => Err(format!("{name}: {} is not a whole number from 1 to {max}", bounded(v))),
    }
}

/// A decimal fraction in (0, 1] (`0.5`, `.25`, `1`), in millionths: digits with one optional point, at most six
/// decimals.
fn fraction(v: &str) -> Result<u32, String> {
    let bad = || format!("{KAI_FRACTION}: {} is not a decimal greater than 0 and at most 1", bounded(v));
    if v.is_empty() || v.len() > MAX_VALUE_LEN {
        return Err(bad());
    }
    let (whole, decimals) = v.split_once('.').unwrap_or((v, ""));
    if !whole.bytes().all(|b| b.is_ascii_digit())
        || !decimals.bytes().all(|b| b.is_ascii_digit())
        || (whole.is_empty() && decimals.is_empty())
        || decimals.len() > 6
    {
        return Err(bad());
    }
    let whole: u64 = if whole.is_empty() { 0 } else { whole.parse().map_err(|_| bad())? };
    let decimals: u64 = format!("{decimals:0<6}").parse().map_err(|_| bad())?;
    let millionths = whole.checked_mul(MILLION).and_then(|w| w.checked_add(decimals)).ok_or_else(bad)?;
    if millionths == 0 || millionths > MILLION {
        return Err(bad());
    }
    Ok(millionths as u32)
}

impl Term {
    /// Bytes on a node whose GPUs each hold at least `gpu_bytes` (the smallest GPU there).
    fn bytes(&self, gpu_bytes: Option<u64>) -> Result<u64, ShareFault> {
        let per = match self.amount {
            Amount::Mib(mib) => mib * MIB,
            Amount::PerMillion(pm) => {
                let total = gpu_bytes.ok_or(ShareFault::NotKnownYet)?;
                ((u128::from(total) * u128::from(pm)) / u128::from(MILLION)) as u64
            }
            Amount::Replica(r) => gpu_bytes.ok_or(ShareFault::NotKnownYet)? / u64::from(r),
            Amount::NodeReplicas => return Err(ShareFault::ReplicasNotKnown),
        };
        Ok(per.saturating_mul(u64::from(self.devices)))
    }
}

impl fmt::Display for Term {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let times = if self.devices > 1 { format!(" × {} GPUs", self.devices) } else { String::new() };
        match (self.source, self.amount) {
            (ShareSource::KaiFraction, Amount::PerMillion(pm)) => write!(f, "KAI gpu-fraction {}{times}", decimal(pm)),
            (ShareSource::HamiPercentage, Amount::PerMillion(pm)) => {
                write!(f, "HAMi gpumem-percentage {}{times}", decimal(pm * 100).trim_end_matches('.'))
            }
            (ShareSource::KaiMemory, Amount::Mib(m)) => write!(f, "KAI gpu-memory {m} MiB{times}"),
            (ShareSource::HamiMemory, Amount::Mib(m)) => write!(f, "HAMi gpumem {m} MiB{times}"),
            (_, Amount::Replica(r)) => write!(f, "MPS replica{} of {r} per GPU", plural_count(self.devices)),
            (_, Amount::NodeReplicas) => {
                write!(f, "GPU replica{} (MPS if the node says so)", plural_count(self.devices))
            }
            (s, a) => write!(f, "{s:?} {a:?}{times}"),
        }
    }
}

fn plural_count(n: u32) -> String {
    if n == 1 { String::new() } else { format!("s × {n}") }
}

/// Millionths as a short decimal: 500000 → `0.5`.
fn decimal(pm: u32) -> String {
    let whole = pm / 1_000_000;
    let frac = format!("{:06}", pm % 1_000_000);
    let frac = frac.trim_end_matches('0');
    if frac.is_empty() { whole.to_string() } else { format!("{whole}.{frac}") }
}

/// What `terms` come to on a node whose GPUs hold `gpu_totals` bytes each (the smallest counts, so that a
/// fraction is never looser than on the GPU the pod got). Fractions and replicas need the totals; MiB do not.
pub fn resolve(terms: &[Term], gpu_totals: &[u64]) -> Result<Resolved, ShareFault> {
    let smallest = gpu_totals.iter().copied().filter(|t| *t > 0).min();
    let mut bytes = 0u64;
    let mut parts = Vec::with_capacity(terms.len());
    for t in terms {
        bytes = bytes.saturating_add(t.bytes(smallest)?);
        parts.push(t.to_string());
    }
    let of = match (terms.iter().any(|t| !matches!(t.amount, Amount::Mib(_))), smallest) {
        (true, Some(s)) => format!(" of {}", HumanBytes(s)),
        _ => String::new(),
    };
    let sources = ShareSource::ALL.into_iter().filter(|s| terms.iter().any(|t| t.source == *s)).collect();
    Ok(Resolved { bytes, text: format!("{}{of} = {}", parts.join(" + "), HumanBytes(bytes)), sources })
}

impl ShareSource {
    /// The short code a [`Declaration`] is written with in the agent's memory ([`Declaration::encode`]).
    fn code(self) -> &'static str {
        match self {
            ShareSource::KaiFraction => "kf",
            ShareSource::KaiMemory => "km",
            ShareSource::HamiMemory => "hm",
            ShareSource::HamiPercentage => "hp",
            ShareSource::MpsReplicas => "mr",
        }
    }

    /// The source written with `code` ([`ShareSource::code`]).
    fn of_code(code: &str) -> Result<ShareSource, DecodeError> {
        ShareSource::ALL.into_iter().find(|s| s.code() == code).ok_or_else(|| DecodeError::Source(code.to_owned()))
    }
}

/// Why [`Declaration::decode`] refused a text: what in it is not what [`Declaration::encode`] writes.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum DecodeError {
    /// Neither `none`, `share:…` nor `invalid:…`.
    #[error("{0:?} is none of `none`, `share:…`, `invalid:…`")]
    Form(String),
    /// A term is not `<source>/<p|m|r|n><number>/<devices>` (`kf/p500000/1`).
    #[error("the term {0:?} is not <source>/<p|m|r|n><number>/<devices>")]
    Term(String),
    /// A source code is none of [`ShareSource`]'s (`kf`, `km`, `hm`, `hp`, `mr`).
    #[error("{0:?} names no share source")]
    Source(String),
    /// A line after `invalid:` is not `<source>:<why>`.
    #[error("the fault {0:?} is not <source>:<why>")]
    Fault(String),
    /// `invalid:` with no fault.
    #[error("`invalid:` names no fault")]
    NoFault,
}

impl Declaration {
    /// How the agent keeps a pod's declaration in its memory once the pod's containers and annotations are
    /// dropped from its cache (`attribute::pods::slim_pod`): `none`, `share:kf/p500000/1,hm/m20000/2`, or
    /// `invalid:` with one line per faulty source (`kf:<why>`) and, where other sources were read well, a last
    /// line `share:…`. A reason holds no line break: every value in it is quoted with its escapes (a line break
    /// written anyway becomes a space). [`Declaration::decode`] reads it back; the form is pinned by a test
    /// (`a_declaration_is_encoded_as_it_always_was`).
    pub fn encode(&self) -> String {
        use fmt::Write as _;
        let write_terms = |out: &mut String, terms: &[Term]| {
            out.push_str("share:");
            for (i, t) in terms.iter().enumerate() {
                let (kind, n) = match t.amount {
                    Amount::PerMillion(pm) => ("p", u64::from(pm)),
                    Amount::Mib(m) => ("m", m),
                    Amount::Replica(r) => ("r", u64::from(r)),
                    Amount::NodeReplicas => ("n", 0),
                };
                let _ = write!(out, "{}{}/{kind}{n}/{}", if i > 0 { "," } else { "" }, t.source.code(), t.devices);
            }
        };
        let mut out = String::new();
        match self {
            Declaration::None => out.push_str("none"),
            Declaration::Share(terms) => write_terms(&mut out, terms),
            Declaration::Invalid { faults, terms } => {
                out.push_str("invalid:");
                for (i, (source, why)) in faults.iter().enumerate() {
                    let why = why.replace(['\n', '\r'], " ");
                    let _ = write!(out, "{}{}:{why}", if i > 0 { "\n" } else { "" }, source.code());
                }
                if !terms.is_empty() {
                    out.push('\n');
                    write_terms(&mut out, terms);
                }
            }
        }
        out
    }

    /// Reads back what [`Declaration::encode`] wrote; what is not that form is refused, saying what is wrong.
    pub fn decode(text: &str) -> Result<Declaration, DecodeError> {
        if text == "none" {
            return Ok(Declaration::None);
        }
        if let Some(lines) = text.strip_prefix("invalid:") {
            let (mut faults, mut terms) = (Vec::new(), Vec::new());
            for line in lines.split('\n') {
                if let Some(t) = line.strip_prefix("share:") {
                    terms = decode_terms(t)?;
                    continue;
                }
                let (code, why) = line.split_once(':').ok_or_else(|| DecodeError::Fault(line.to_owned()))?;
                faults.push((ShareSource::of_code(code)?, why.to_owned()));
            }
            return if faults.is_empty() {
                Err(DecodeError::NoFault)
            } else {
                Ok(Declaration::Invalid { faults, terms })
            };
        }
        match text.strip_prefix("share:") {
            Some(terms) => decode_terms(terms).map(Declaration::Share),
            None => Err(DecodeError::Form(text.to_owned())),
        }
    }
}

/// The terms after `share:` ([`Declaration::encode`]), at least one.
fn decode_terms(terms: &str) -> Result<Vec<Term>, DecodeError> {
    let term = |t: &str| -> Result<Term, DecodeError> {
        let bad = || DecodeError::Term(t.to_owned());
        let mut parts = t.split('/');
        let source = ShareSource::of_code(parts.next().ok_or_else(bad)?)?;
        let (kind, n) = parts.next().and_then(|a| a.split_at_checked(1)).ok_or_else(bad)?;
        let devices = parts.next().and_then(|d| d.parse().ok()).ok_or_else(bad)?;
        let amount = match kind {
            "p" => n.parse().ok().map(Amount::PerMillion),
            "m" => n.parse().ok().map(Amount::Mib),
            "r" => n.parse().ok().filter(|r| *r > 0).map(Amount::Replica),
            "n" if n == "0" => Some(Amount::NodeReplicas),
            _ => None,
        }
        .ok_or_else(bad)?;
        if parts.next().is_some() {
            return Err(bad());
        }
        Ok(Term { source, amount, devices })
    };
    terms.split(',').map(term).collect()
}

impl Declaration {
    /// The share this declaration gives under a budget reading `sources`, on GPUs of `gpu_totals` bytes:
    /// `None` when it declares nothing those sources read; `Some(Err(why))` when it cannot be resolved (a
    /// source it reads is faulty, [`ShareFault::Invalid`], or the node's GPUs are not known yet,
    /// [`ShareFault::NotKnownYet`]). A faulty source the budget does not read spoils nothing.
    pub fn under(&self, sources: Sources, gpu_totals: &[u64]) -> Option<Result<Resolved, ShareFault>> {
        if let Some(fault) = self.fault(sources) {
            return Some(Err(fault));
        }
        let terms = match self {
            Declaration::None => return None,
            Declaration::Share(terms) | Declaration::Invalid { terms, .. } => terms,
        };
        // GPU replicas not yet read against the node's labels declare nothing (as on an unknown node).
        let read: Vec<Term> =
            terms.iter().copied().filter(|t| sources.has(t.source) && t.amount != Amount::NodeReplicas).collect();
        (!read.is_empty()).then(|| resolve(&read, gpu_totals))
    }
}

#[cfg(test)]
mod tests;
