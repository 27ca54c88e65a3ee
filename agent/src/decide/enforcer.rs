//! The [`Enforcer`]: what the agent remembers between ticks, and the tick itself, which hands each pod to
//! its budget's state machine ([`super::pod`]) or clears what no budget covers any more. The pressure step
//! is in [`super::pressure::step`], the executors' reports in [`Enforcer::feedback`].

use std::sync::Arc;

use gpubudget_common::BudgetState;
use gpubudget_common::enforcement::{self, Mode};

use super::pod::{Context, PodMemory};
use super::pressure::step::GpuPressure;
use super::{Action, Now, Settings, cadence, gpus};
use crate::FastMap;
use crate::attribute::pods::PodTable;
use crate::attribute::{PodUsage, Usage};
use crate::sample::{GpuInfo, Snapshot};
use gpubudget_common::quantity::HumanBytes;

/// Remembers each pod between ticks and decides what to do.
#[derive(Debug)]
pub struct Enforcer {
    pub(in crate::decide) settings: Settings,
    pub(in crate::decide) pods: FastMap<Arc<str>, PodMemory>,
    pub(in crate::decide) generation: u64,
    /// Per GPU of the snapshot: the pressure signal.
    pub(in crate::decide) gpus: Vec<GpuPressure>,
    /// Per GPU: health and accounting, told on the Node.
    pub(in crate::decide) watch: gpus::GpuWatch,
    /// How soon the next sample comes ([`cadence`]).
    pub(in crate::decide) pace: cadence::Pace,
    /// This node's mode (#54): its label's, else the agent's `--enforcement`; set at each [`Self::tick`].
    pub(in crate::decide) node_mode: Mode,
}

impl Enforcer {
    /// An enforcer with these settings and no memory (a fresh start).
    pub fn new(settings: Settings) -> Self {
        let settings_enforcement = settings.enforcement;
        Self {
            settings,
            pods: FastMap::default(),
            generation: 0,
            gpus: Vec::new(),
            watch: gpus::GpuWatch::default(),
            pace: cadence::Pace::default(),
            node_mode: enforcement::node(settings_enforcement, None),
        }
    }

    /// Looks at each GPU's health and accounting ([`gpus`]): Node events for a GPU whose sample fails or
    /// recovers, memory no process accounts for, figures NVML does not give, and memory held by pods no budget
    /// selects. `usage` is this sample's, attributed to `table`'s pods.
    pub fn watch_gpus(
        &mut self,
        now: Now,
        snapshot: &Snapshot,
        table: &PodTable,
        usage: &Usage,
        out: &mut Vec<Action>,
    ) {
        let settings = &self.settings.accounting;
        self.watch.observe(settings, now.mono_ms, snapshot, &usage.unaccounted, out);
        let pods = |g: usize| unbudgeted_pods(table, &usage.pods, g);
        let held = gpus::UnbudgetedMemory { bytes: &usage.unbudgeted, policy: self.settings.unbudgeted_pods };
        self.watch.observe_unbudgeted(settings, now.mono_ms, snapshot, held, pods, out);
    }

    /// This node's mode (#54) as of the last tick: observe or enforce, and which level set it.
    pub fn node_mode(&self) -> &Mode {
        &self.node_mode
    }

    /// The settings.
    pub fn settings(&self) -> &Settings {
        &self.settings
    }

    /// The state the agent holds for a pod (for `top` and metrics).
    pub fn state_of(&self, uid: &str) -> Option<BudgetState> {
        self.pods.get(uid).filter(|m| !m.last_budget.is_empty()).map(|m| m.tracker.state)
    }

    /// How many milliseconds after the last tick the next sample is due ([`cadence`]), and why it is the fast
    /// pace.
    pub fn next_sample_ms(&self) -> (u64, Option<cadence::Urgency>) {
        (self.pace.next_ms(&self.settings.cadence), self.pace.fast())
    }

    /// Records what a whole tick cost (microseconds), for the fast pace's bound on the agent's CPU.
    pub fn tick_cost_us(&mut self, micros: u64) {
        self.pace.cost(micros);
    }

    /// Whether only a tenant-written budget selects pod `i` of `table` (#33): namespaced budgets are
    /// [`ClusterBound`](crate::decide::pressure::NamespacedBudgets::ClusterBound) and no cluster budget
    /// selects it.
    pub(in crate::decide) fn tenant_only(&self, table: &PodTable, i: usize) -> bool {
        self.settings.namespaced_budgets == crate::decide::pressure::NamespacedBudgets::ClusterBound
            && table.budget(i).is_some()
            && !table.cluster_selects(i)
    }

    /// Pods remembered.
    pub fn len(&self) -> usize {
        self.pods.len()
    }

    /// Whether no pod is remembered.
    pub fn is_empty(&self) -> bool {
        self.pods.is_empty()
    }

    /// Decides this tick. `usage` is indexed like `table.pods`; `gpus` are the snapshot's (for messages).
    pub fn tick(&mut self, now: Now, table: &PodTable, usage: &[PodUsage], gpus: &[GpuInfo], out: &mut Vec<Action>) {
        self.generation += 1;
        self.pace.begin(now.mono_ms);
        self.node_mode = enforcement::node(self.settings.enforcement, table.node_enforcement);
        let empty = PodUsage::default();
        for (i, view) in table.pods.iter().enumerate() {
            let pod_usage = usage.get(i).unwrap_or(&empty);
            match table.budget(i) {
                Some(budget) => {
                    let tenant_only = self.tenant_only(table, i);
                    let cx = Context { view, budget, tenant_only, usage: pod_usage, gpus };
                    self.tick_pod(now, &cx, out);
                }
                None => self.tick_unbudgeted(now, view, out),
            }
        }
        let generation = self.generation;
        self.pods.retain(|_, m| m.seen == generation);
    }
}

/// The pods no budget selects that hold memory on GPU `g` (`usage` indexed like `table.pods`), the largest
/// first: `ns/a 30Gi, ns/b 10Gi`, at most five named.
fn unbudgeted_pods(table: &PodTable, usage: &[PodUsage], g: usize) -> String {
    let mut pods: Vec<(u64, String)> = table
        .pods
        .iter()
        .enumerate()
        .filter(|(i, _)| table.budget(*i).is_none())
        .filter_map(|(i, view)| {
            let bytes: u64 = usage.get(i)?.holders.iter().filter(|h| h.gpu == g).map(|h| h.bytes).sum();
            (bytes > 0).then(|| (bytes, view.key()))
        })
        .collect();
    pods.sort_by(|a, b| b.0.cmp(&a.0).then_with(|| a.1.cmp(&b.1)));
    let mut named: Vec<String> = pods.iter().take(5).map(|(b, k)| format!("{k} {}", HumanBytes(*b))).collect();
    if pods.len() > 5 {
        named.push(format!("and {} more", pods.len() - 5));
    }
    named.join(", ")
}
