//! No wrongful eviction, over 100 000 random traces driven through the agent's real decision code
//! (`PodTable::build` → budget resolution → `Enforcer::tick` / `Enforcer::feedback`).
//!
//! Each trace is a few pods and budgets on one node, and a sequence of ticks during which usage moves,
//! budgets are edited, created and deleted, pods relabel themselves, the API answers writes and
//! evictions late, wrongly or not at all, samples fail (the tick is skipped), the agent restarts (a
//! fresh `Enforcer` that only has the pods' annotations to go on), and pods forge the agent's
//! annotations on themselves. An independent oracle, written from the promises of issue 7 and not from
//! the code, checks every `Evict`:
//!
//! - the pod is bound to this node, not critical in a namespace the administrator lists (#33: half the traces
//!   list the pods' namespace), not terminating, and its budget (the smallest limit
//!   among those selecting it, computed by the oracle) says `action: Evict`, or another budget selecting it
//!   does (#51: the rules are no looser than any selecting budget's, `overLimitSeconds` the shortest);
//! - the promise of `common::state` (#11: dips no longer reset the timer): the sample the eviction follows
//!   was over the limit in force, and for some earlier sample `s` of the running agent, the time over the
//!   limit in `[s, now]` minus half the time at or under it is at least `overLimitSeconds` (each sample
//!   holding until the next; over or not by the limit in force at that sample). Computed from the whole
//!   sample history, not from a bank. A restart starts the history afresh, so a restart can only delay;
//! - no second request while one is in flight, and none at all once one was accepted (even after a
//!   restart);
//! - the `Evicting` record was applied first, in the same agent's life.

mod support;

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use gpubudget_agent::attribute::pods::{PodTable, PodView};
use gpubudget_agent::attribute::{Holder, PodUsage};
use gpubudget_agent::decide::Enforcer;
use gpubudget_agent::decide::{Action, EvictOutcome, Feedback, Now, Settings};
use gpubudget_agent::sample::GpuInfo;
use gpubudget_common::pod_record::PodRecord;
use gpubudget_common::{BudgetState, Enforcement, GpuMemoryBudget, GpuMemoryBudgetSpec};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector;
use proptest::prelude::*;
use proptest::test_runner::{Config, TestCaseError, TestRunner};

const GI: u64 = 1 << 30;
const NODE: &str = "gpu-node-1";
const TRACES: u32 = 100_000;

/// splitmix64: the trace is a function of one seed, so a failure is reproduced from the seed alone.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        support::splitmix64(&mut self.0)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
    fn chance(&mut self, percent: u64) -> bool {
        self.below(100) < percent
    }
}

#[derive(Debug, Clone, PartialEq)]
struct BudgetModel {
    name: String,
    /// `None`: selects every pod of the namespace; otherwise `tier=<value>`.
    tier: Option<&'static str>,
    limit: u64,
    evict: bool,
    over_limit_s: u64,
    warn_percent: i32,
    /// `spec.enforcement` (#54).
    enforcement: Option<Enforcement>,
}

impl BudgetModel {
    fn random(rng: &mut Rng, name: String) -> Self {
        Self {
            name,
            tier: [None, Some("a"), Some("b")][rng.below(3) as usize],
            limit: [4 * GI, 8 * GI, 12 * GI][rng.below(3) as usize],
            evict: rng.chance(75),
            over_limit_s: rng.below(4),
            warn_percent: 50 + rng.below(51) as i32,
            enforcement: [None, None, None, None, Some(Enforcement::Observe), Some(Enforcement::Enforce)]
                [rng.below(6) as usize],
        }
    }

    fn selects(&self, labels: &BTreeMap<String, String>) -> bool {
        self.tier.is_none_or(|t| labels.get("tier").map(String::as_str) == Some(t))
    }

    fn resource(&self) -> GpuMemoryBudget {
        let selector = LabelSelector {
            match_labels: self.tier.map(|t| BTreeMap::from([("tier".to_owned(), t.to_owned())])),
            ..LabelSelector::default()
        };
        let spec = GpuMemoryBudgetSpec {
            selector,
            limit: Quantity(self.limit.to_string()),
            request: None,
            warn_at_percent: self.warn_percent,
            action: if self.evict {
                gpubudget_common::BudgetAction::Evict
            } else {
                gpubudget_common::BudgetAction::Warn
            },
            over_limit_seconds: self.over_limit_s as i64,
            eviction_grace_period_seconds: None,
            blocked_eviction_timeout_seconds: None,
            admission_caps: Default::default(),
            share: None,
            enforcement: self.enforcement,
        };
        let mut b = GpuMemoryBudget::new(&self.name, spec);
        b.metadata.namespace = Some("team-a".into());
        b
    }
}

/// The oracle's resolution: the smallest limit among the budgets that select the pod, ties by name, with rules
/// no looser than any of them (#51): `Evict` if any says so, the shortest `overLimitSeconds`; `Enforce` if any
/// says so, else unset if any leaves it unset, else `Observe` (#54: a budget's `Observe` loosens no other).
fn applicable(budgets: &[BudgetModel], labels: &BTreeMap<String, String>) -> Option<BudgetModel> {
    let selecting = || budgets.iter().filter(|b| b.selects(labels));
    let named = selecting().min_by(|a, b| a.limit.cmp(&b.limit).then(a.name.cmp(&b.name)))?;
    Some(BudgetModel {
        evict: selecting().any(|b| b.evict),
        over_limit_s: selecting().map(|b| b.over_limit_s).min().unwrap_or(named.over_limit_s),
        enforcement: if selecting().any(|b| b.enforcement == Some(Enforcement::Enforce)) {
            Some(Enforcement::Enforce)
        } else if selecting().any(|b| b.enforcement.is_none()) {
            None
        } else {
            Some(Enforcement::Observe)
        },
        ..named.clone()
    })
}

#[derive(Debug, Clone)]
struct PodModel {
    uid: Arc<str>,
    name: String,
    node: Option<String>,
    labels: BTreeMap<String, String>,
    critical: bool,
    terminating: bool,
    /// The contract annotations on the server (what a restarted agent reads back).
    record: Option<PodRecord>,
    usage: u64,
}

impl PodModel {
    fn view(&self) -> PodView {
        PodView {
            uid: self.uid.clone(),
            namespace: Arc::from("team-a"),
            name: Arc::from(self.name.as_str()),
            node: self.node.clone(),
            labels: self.labels.clone(),
            critical: self.critical,
            terminating: self.terminating,
            termination_grace_seconds: Some(30),
            containers: Vec::new(),
            mirror_of: None,
            record: self.record.clone(),
            has_annotations: self.record.is_some(),
            caps_expected: false,
            mps_cap_mib: None,
            share: gpubudget_common::share::Declaration::None,
            runtime_caps: None,
        }
    }
}

fn labels(rng: &mut Rng) -> BTreeMap<String, String> {
    match rng.below(3) {
        0 => BTreeMap::new(),
        1 => BTreeMap::from([("tier".to_owned(), "a".to_owned())]),
        _ => BTreeMap::from([("tier".to_owned(), "b".to_owned())]),
    }
}

/// Usage values clustered around the limits, exactly at them included.
fn usage_value(rng: &mut Rng) -> u64 {
    let base = [0, 2 * GI, 4 * GI, 6 * GI, 8 * GI, 10 * GI, 12 * GI, 16 * GI][rng.below(8) as usize];
    match rng.below(4) {
        0 => base.saturating_sub(1),
        1 => base + 1,
        _ => base,
    }
}

/// What the oracle knows about a pod during one agent's life.
#[derive(Debug, Default, Clone)]
struct Seen {
    /// Every sample the running agent took of the pod: its time and whether it was over the limit in force.
    samples: Vec<(u64, bool)>,
    evicting_applied: bool,
}

#[allow(clippy::large_enum_variant)] // a test's queue of a few entries
enum Pending {
    Write { uid: Arc<str>, record: Option<PodRecord>, due: u64, ok: bool },
    Evict { uid: Arc<str>, due: u64, outcome: u8 },
}

struct World {
    rng: Rng,
    budgets: Vec<BudgetModel>,
    pods: Vec<PodModel>,
    enforcer: Enforcer,
    seen: HashMap<Arc<str>, Seen>,
    pending: Vec<Pending>,
    in_flight: HashMap<Arc<str>, u32>,
    accepted: Vec<Arc<str>>,
    /// Monotonic clock of the current agent (restarts at 0 with it); `wall` never goes back.
    mono: u64,
    wall_ms: u64,
    next_uid: u32,
    log: Vec<String>,
    evictions: u64,
    /// Evictions observe mode told and did not make (#54).
    would_evicts: u64,
    /// The last table built, and what it was built from (rebuilt only when that changes, as the agent
    /// does).
    cache: Option<(Vec<PodView>, Vec<BudgetModel>, Arc<PodTable>)>,
    /// Whether the administrator lists the pods' namespace (team-a) as critical (#33): only then does
    /// critical priority exempt them.
    critical_listed: bool,
    /// The node observes (#54: the agent's `--enforcement Observe`): only a budget that says `Enforce` evicts.
    node_observes: bool,
}

/// The agent's settings: team-a among the critical namespaces or not; observing or enforcing.
fn settings(critical_listed: bool, node_observes: bool) -> Settings {
    let mut settings = Settings::new(NODE);
    if node_observes {
        settings.enforcement = Enforcement::Observe;
    }
    if critical_listed {
        settings.critical_namespaces = "kube-system,team-a".parse().expect("valid");
    }
    settings
}

fn fail(world: &World, why: String) -> TestCaseError {
    let tail: Vec<&String> = world.log.iter().rev().take(40).collect();
    TestCaseError::fail(format!("{why}\nlast steps (newest first):\n{tail:#?}"))
}

impl World {
    fn new(seed: u64) -> Self {
        let mut rng = Rng(seed);
        let budgets = (0..1 + rng.below(3)).map(|i| BudgetModel::random(&mut rng, format!("b{i}"))).collect();
        let critical_listed = rng.chance(50);
        let node_observes = rng.chance(20);
        let mut world = Self {
            rng,
            budgets,
            pods: Vec::new(),
            enforcer: Enforcer::new(settings(critical_listed, node_observes)),
            critical_listed,
            node_observes,
            seen: HashMap::new(),
            pending: Vec::new(),
            in_flight: HashMap::new(),
            accepted: Vec::new(),
            mono: 0,
            wall_ms: 1_800_000_000_000,
            next_uid: 0,
            log: Vec::new(),
            evictions: 0,
            would_evicts: 0,
            cache: None,
        };
        for _ in 0..1 + world.rng.below(4) {
            world.add_pod();
        }
        world
    }

    fn add_pod(&mut self) {
        self.next_uid += 1;
        let node = match self.rng.below(10) {
            0 => Some("gpu-node-2".to_owned()),
            1 => None,
            _ => Some(NODE.to_owned()),
        };
        let pod = PodModel {
            uid: Arc::from(format!("uid-{}", self.next_uid)),
            name: format!("p{}", self.next_uid),
            node,
            labels: labels(&mut self.rng),
            critical: self.rng.chance(10),
            terminating: false,
            record: None,
            usage: usage_value(&mut self.rng),
        };
        self.pods.push(pod);
    }

    fn now(&self) -> Now {
        Now {
            mono_ms: self.mono,
            wall: jiff::Timestamp::from_millisecond(self.wall_ms as i64).expect("wall clock in range"),
        }
    }

    fn advance(&mut self, ms: u64) {
        self.mono += ms;
        self.wall_ms += ms;
    }

    /// One random change of the world between ticks.
    fn perturb(&mut self) {
        if self.pods.is_empty() {
            self.add_pod();
        }
        let r = self.rng.below(100);
        match r {
            0..=39 => {
                // Usage moves (most steps keep it, so runs over the limit last).
                let i = self.rng.below(self.pods.len() as u64) as usize;
                self.pods[i].usage = usage_value(&mut self.rng);
                self.log.push(format!("usage {} = {}", self.pods[i].uid, self.pods[i].usage));
            }
            40..=45 if !self.budgets.is_empty() => {
                let i = self.rng.below(self.budgets.len() as u64) as usize;
                let name = self.budgets[i].name.clone();
                self.budgets[i] = BudgetModel::random(&mut self.rng, name);
                self.log.push(format!("edit {:?}", self.budgets[i]));
            }
            46..=47 => {
                let i = self.rng.below(self.budgets.len() as u64 + 1) as usize;
                if i < self.budgets.len() && self.rng.chance(50) {
                    let b = self.budgets.remove(i);
                    self.log.push(format!("delete budget {}", b.name));
                } else if self.budgets.len() < 4 {
                    let name = format!("b{}", self.rng.below(6));
                    self.budgets.retain(|b| b.name != name);
                    let b = BudgetModel::random(&mut self.rng, name);
                    self.log.push(format!("create {b:?}"));
                    self.budgets.push(b);
                }
            }
            48..=53 => {
                // A pod relabels itself (a tenant may: it owns its pod).
                let i = self.rng.below(self.pods.len() as u64) as usize;
                self.pods[i].labels = labels(&mut self.rng);
                self.log.push(format!("relabel {} {:?}", self.pods[i].uid, self.pods[i].labels));
            }
            54 => {
                // A pod forges the agent's record on itself: `Evicting` with a request time, this node.
                let i = self.rng.below(self.pods.len() as u64) as usize;
                let pod = &mut self.pods[i];
                pod.record = Some(PodRecord {
                    state: BudgetState::Evicting,
                    usage_bytes: 99 * GI,
                    budget: "b0".into(),
                    node: NODE.into(),
                    eviction_requested_at: Some("2020-01-01T00:00:00Z".into()),
                    cap_not_in_force: None,
                    share: None,
                    runtime_caps: None,
                });
                self.log.push(format!("forge record on {}", pod.uid));
            }
            55..=56 => {
                // The agent restarts: memory gone, a new monotonic clock; pending answers are lost.
                // What was already sent reaches the server; only the answers are lost.
                for p in std::mem::take(&mut self.pending) {
                    match p {
                        Pending::Write { uid, record, ok: true, .. } => {
                            if let Some(pod) = self.pods.iter_mut().find(|p| p.uid == uid) {
                                pod.record = record;
                            }
                        }
                        Pending::Evict { uid, outcome: 0, .. } => {
                            self.accepted.push(uid.clone());
                            if let Some(pod) = self.pods.iter_mut().find(|p| p.uid == uid) {
                                pod.terminating = true;
                            }
                        }
                        Pending::Evict { uid, outcome: 2, .. } => self.pods.retain(|p| p.uid != uid),
                        _ => {}
                    }
                }
                if self.pods.is_empty() {
                    self.add_pod();
                }
                self.enforcer = Enforcer::new(settings(self.critical_listed, self.node_observes));
                self.seen.clear();
                self.in_flight.clear();
                self.mono = self.rng.below(1000);
                self.log.push("agent restart".into());
            }
            57 if self.pods.len() < 5 => {
                self.add_pod();
                self.log.push(format!("new pod uid-{}", self.next_uid));
            }
            58 if self.pods.len() > 1 => {
                let i = self.rng.below(self.pods.len() as u64) as usize;
                let p = self.pods.remove(i);
                self.log.push(format!("pod {} deleted", p.uid));
            }
            _ => {}
        }
    }

    fn table(&mut self) -> Arc<PodTable> {
        let views: Vec<PodView> = self.pods.iter().map(PodModel::view).collect();
        if let Some((v, b, table)) = &self.cache
            && *v == views
            && *b == self.budgets
        {
            return table.clone();
        }
        let budgets: Vec<GpuMemoryBudget> = self.budgets.iter().map(BudgetModel::resource).collect();
        // No node filter: pods of other nodes reach the decisions, which must refuse them on their own.
        let table = Arc::new(PodTable::build(views.iter().cloned(), &budgets, None));
        self.cache = Some((views, self.budgets.clone(), table.clone()));
        table
    }

    fn deliver(&mut self) -> Result<(), TestCaseError> {
        let now = self.now();
        if self.pending.is_empty() {
            return Ok(());
        }
        let mono = self.mono;
        let (due, later): (Vec<Pending>, Vec<Pending>) = std::mem::take(&mut self.pending).into_iter().partition(|p| {
            let (Pending::Write { due, .. } | Pending::Evict { due, .. }) = p;
            *due <= mono
        });
        self.pending = later;
        let mut out = Vec::new();
        for p in due {
            match p {
                Pending::Write { uid, record, ok, .. } => {
                    if ok && let Some(pod) = self.pods.iter_mut().find(|p| p.uid == uid) {
                        pod.record = record.clone();
                    }
                    self.enforcer.feedback(now, Feedback::Written { uid, record, ok }, &mut out);
                }
                Pending::Evict { uid, outcome, .. } => {
                    if let Some(n) = self.in_flight.get_mut(&uid) {
                        *n -= 1;
                    }
                    let outcome = match outcome {
                        0 => {
                            // Accepted: the API server sets the deletion timestamp.
                            self.accepted.push(uid.clone());
                            if let Some(pod) = self.pods.iter_mut().find(|p| p.uid == uid) {
                                pod.terminating = true;
                            }
                            EvictOutcome::Accepted
                        }
                        1 => EvictOutcome::Blocked(
                            "Cannot evict pod as it would violate the pod's disruption budget.".into(),
                        ),
                        2 => {
                            self.pods.retain(|p| p.uid != uid);
                            EvictOutcome::Gone
                        }
                        _ => EvictOutcome::Failed("500 Internal Server Error".into()),
                    };
                    self.log.push(format!("eviction of {uid} answered {outcome:?}"));
                    self.enforcer.feedback(now, Feedback::Evicted { uid, outcome }, &mut out);
                }
            }
        }
        self.check(&out, &HashMap::new())
    }

    /// Checks one batch of actions against the oracle. `over_ok`: per UID, whether this tick's sample
    /// may be an eviction tick (the oracle's verdict, computed before the tick).
    fn check(&mut self, out: &[Action], allowed: &HashMap<Arc<str>, Result<(), String>>) -> Result<(), TestCaseError> {
        for action in out {
            match action {
                Action::Apply { pod, record, .. } => {
                    if record.state == BudgetState::Evicting && record.eviction_requested_at.is_some() {
                        self.seen.entry(pod.uid.clone()).or_default().evicting_applied = true;
                    }
                    let (due, ok) = (self.mono + self.rng.below(1500), self.rng.chance(85));
                    self.pending.push(Pending::Write { uid: pod.uid.clone(), record: Some(record.clone()), due, ok });
                }
                Action::Clear { pod } => {
                    let (due, ok) = (self.mono + self.rng.below(1500), self.rng.chance(85));
                    self.pending.push(Pending::Write { uid: pod.uid.clone(), record: None, due, ok });
                }
                // Observe mode (#54): nothing is sent; only where the oracle's rules would allow the eviction.
                Action::WouldEvict { pod, .. } => {
                    if !self.node_observes && self.budgets.iter().all(|b| b.enforcement != Some(Enforcement::Observe)) {
                        return Err(fail(self, format!("would-evict of {pod} where nothing observes")));
                    }
                    self.would_evicts += 1;
                }
                // A delete after refused evictions is an eviction to the oracle: the same checks.
                Action::Evict { pod, .. } | Action::Delete { pod, .. } => {
                    self.evictions += 1;
                    match allowed.get(&pod.uid) {
                        Some(Ok(())) => {}
                        Some(Err(why)) => return Err(fail(self, format!("wrongful eviction of {pod}: {why}"))),
                        None => return Err(fail(self, format!("eviction of {pod} outside a tick"))),
                    }
                    if self.accepted.contains(&pod.uid) {
                        return Err(fail(self, format!("second eviction of {pod} after one was accepted")));
                    }
                    let n = self.in_flight.entry(pod.uid.clone()).or_default();
                    *n += 1;
                    if *n > 1 {
                        return Err(fail(self, format!("two eviction requests in flight for {pod}")));
                    }
                    if !self.seen.get(&pod.uid).is_some_and(|s| s.evicting_applied) {
                        return Err(fail(self, format!("eviction of {pod} before its Evicting record")));
                    }
                    let due = self.mono + [0, 250, 2000, 20_000][self.rng.below(4) as usize];
                    let outcome = self.rng.below(4) as u8;
                    self.pending.push(Pending::Evict { uid: pod.uid.clone(), due, outcome });
                }
                Action::Transition { .. }
                | Action::Event { .. }
                | Action::ContainerEvent { .. }
                | Action::NodeEvent { .. } => {}
            }
        }
        Ok(())
    }

    /// One tick: the oracle records the sample and its verdict, then the agent decides.
    fn tick(&mut self) -> Result<(), TestCaseError> {
        let table = self.table();
        let mut allowed: HashMap<Arc<str>, Result<(), String>> = HashMap::new();
        let mut usage = Vec::with_capacity(table.pods.len());
        for view in &table.pods {
            let pod = self.pods.iter().find(|p| p.uid == view.uid).expect("table pods come from the world");
            usage.push(PodUsage {
                total: pod.usage,
                holders: vec![Holder {
                    container: Some(Arc::from("main")),
                    pid: Some(7),
                    gpu: 0,
                    bytes: pod.usage,
                    mps_client: None,
                }],
                unknown: 0,
            });
            let seen = self.seen.entry(pod.uid.clone()).or_default();
            let budget = applicable(&self.budgets, &pod.labels);
            let over = budget.as_ref().is_some_and(|b| pod.usage > b.limit);
            seen.samples.push((self.mono, over));
            let verdict = match budget {
                None => Err("no budget selects it".to_owned()),
                Some(b) if !b.evict => Err(format!("its budget {} is action: Warn", b.name)),
                Some(b)
                    if b.enforcement == Some(Enforcement::Observe)
                        || (b.enforcement.is_none() && self.node_observes) =>
                {
                    Err(format!("observe mode (budget {:?}, node observes {})", b.enforcement, self.node_observes))
                }
                Some(_) if pod.critical && self.critical_listed => {
                    Err("it is critical in a listed namespace".to_owned())
                }
                Some(_) if pod.terminating => Err("it is terminating".to_owned()),
                Some(_) if pod.node.as_deref() != Some(NODE) => Err(format!("it is on node {:?}", pod.node)),
                Some(b) if !over => Err(format!("usage {} is not over {}", pod.usage, b.limit)),
                Some(b) => {
                    if gpubudget_common::state::due_is_justified(&seen.samples, b.over_limit_s * 1000) {
                        Ok(())
                    } else {
                        Err(format!(
                            "over − ½ under < overLimitSeconds {} in every window (now {}): {:?}",
                            b.over_limit_s, self.mono, seen.samples
                        ))
                    }
                }
            };
            allowed.insert(pod.uid.clone(), verdict);
        }
        // Pods that left the table (deleted) are forgotten by the agent and by the oracle alike.
        self.seen.retain(|uid, _| allowed.contains_key(uid));
        let gpus = [GpuInfo { label: "0".into(), ..GpuInfo::default() }];
        let mut out = Vec::new();
        self.enforcer.tick(self.now(), &table, &usage, &gpus, &mut out);
        if !out.is_empty() {
            self.log.push(format!("tick at {}: {} actions", self.mono, out.len()));
        }
        self.check(&out, &allowed)
    }
}

fn run_trace(seed: u64) -> Result<u64, TestCaseError> {
    let mut world = World::new(seed);
    let steps = 10 + world.rng.below(40);
    for _ in 0..steps {
        world.perturb();
        let dt = match world.rng.below(10) {
            0 => 1000 + world.rng.below(3000),
            1 => 1 + world.rng.below(249),
            _ => 250,
        };
        world.advance(dt);
        world.deliver()?;
        // A failed sample skips the tick: nothing is decided, and the over-limit timer is not reset.
        if world.rng.chance(5) {
            world.log.push(format!("sample failed at {}", world.mono));
            continue;
        }
        world.tick()?;
    }
    Ok(world.evictions)
}

/// Runs `TRACES / 4` random traces; four tests share the 100 000 so the harness runs them in parallel.
fn random_traces() {
    let cases = TRACES / 4;
    let mut runner =
        TestRunner::new(Config { cases, failure_persistence: None, max_shrink_iters: 64, ..Config::default() });
    let evictions = std::cell::Cell::new(0u64);
    runner
        .run(&any::<u64>(), |seed| {
            let n = run_trace(seed).map_err(|e| TestCaseError::fail(format!("seed {seed}: {e}")))?;
            evictions.set(evictions.get() + n);
            Ok(())
        })
        .expect("no wrongful eviction");
    // The traces must reach evictions often, or they prove nothing.
    assert!(evictions.get() > u64::from(cases) / 10, "only {} evictions in {cases} traces", evictions.get());
}

#[test]
fn no_wrongful_eviction_random_traces_1_of_4() {
    random_traces();
}

#[test]
fn no_wrongful_eviction_random_traces_2_of_4() {
    random_traces();
}

#[test]
fn no_wrongful_eviction_random_traces_3_of_4() {
    random_traces();
}

#[test]
fn no_wrongful_eviction_random_traces_4_of_4() {
    random_traces();
}

/// The oracle can fail: an agent that evicted on the first sample over the limit would be caught.
#[test]
fn the_oracle_catches_an_early_eviction() {
    let mut world = World::new(1);
    world.budgets = vec![BudgetModel {
        name: "b0".into(),
        tier: None,
        limit: 4 * GI,
        evict: true,
        over_limit_s: 3,
        warn_percent: 90,
        enforcement: None,
    }];
    world.pods.truncate(1);
    world.pods[0].node = Some(NODE.into());
    world.pods[0].critical = false;
    world.pods[0].usage = 8 * GI;
    world.tick().expect("a sample over the limit is no eviction yet");
    let uid = world.pods[0].uid.clone();
    world.seen.entry(uid.clone()).or_default().evicting_applied = true;
    let pod = gpubudget_agent::decide::PodRef { uid: uid.clone(), namespace: "team-a".into(), name: "p".into() };
    let mut allowed = HashMap::new();
    allowed.insert(uid, Err("over only since 0".to_owned()));
    let err = world.check(&[Action::Evict { pod, grace_seconds: None, recorded: true }], &allowed).expect_err("caught");
    assert!(err.to_string().contains("wrongful eviction"), "{err}");
}

/// #54: on an observing node, a pod over its limit far longer than `overLimitSeconds` is never evicted by the agent,
/// and the oracle would catch an eviction there.
#[test]
fn an_observing_node_evicts_nothing_and_the_oracle_would_catch_it() {
    let mut world = World::new(1);
    world.node_observes = true;
    world.enforcer = Enforcer::new(settings(world.critical_listed, true));
    world.budgets = vec![BudgetModel {
        name: "b0".into(),
        tier: None,
        limit: 4 * GI,
        evict: true,
        over_limit_s: 1,
        warn_percent: 90,
        enforcement: None,
    }];
    world.pods.truncate(1);
    world.pods[0].node = Some(NODE.into());
    world.pods[0].critical = false;
    world.pods[0].terminating = false;
    world.pods[0].usage = 8 * GI;
    for _ in 0..40 {
        world.tick().expect("no eviction in observe mode");
        world.mono += 500;
        world.wall_ms += 500;
    }
    assert_eq!((world.evictions, world.would_evicts), (0, 1), "told once, not evicted");
    let uid = world.pods[0].uid.clone();
    let pod = gpubudget_agent::decide::PodRef { uid: uid.clone(), namespace: "team-a".into(), name: "p".into() };
    let mut allowed = HashMap::new();
    allowed.insert(uid, Err("observe mode".to_owned()));
    let err = world.check(&[Action::Evict { pod, grace_seconds: None, recorded: true }], &allowed).expect_err("caught");
    assert!(err.to_string().contains("wrongful eviction"), "{err}");
}

/// A seed that is known to exercise restarts, forged records and evictions stays fixed here.
#[test]
fn a_fixed_set_of_seeds() {
    let mut total = 0;
    for seed in 0..2_000 {
        total += run_trace(seed).unwrap_or_else(|e| panic!("{e}"));
    }
    println!("{total} eviction requests in 2000 fixed traces");
    assert!(total > 100, "{total}");
}
