//! The [`Enforcer`]: what the agent remembers between ticks, and the tick itself, which hands each pod to
//! its budget's state machine ([`super::pod`]) or clears what no budget covers any more. The pressure step
//! is in [`super::pressure::step`], the executors' reports in [`Enforcer::feedback`].

use std::collections::HashMap;
use std::sync::Arc;

use gpubudget_common::BudgetState;

use super::pod::{Context, PodMemory};
use super::pressure::step::GpuPressure;
use super::{Action, Now, Settings, gpus};
use crate::attribute::PodUsage;
use crate::attribute::pods::PodTable;
use crate::sample::{GpuInfo, Snapshot};

/// Remembers each pod between ticks and decides what to do.
#[derive(Debug)]
pub struct Enforcer {
    pub(in crate::decide) settings: Settings,
    pub(in crate::decide) pods: HashMap<Arc<str>, PodMemory>,
    pub(in crate::decide) generation: u64,
    /// Per GPU of the snapshot: the pressure signal.
    pub(in crate::decide) gpus: Vec<GpuPressure>,
    /// Per GPU: health and accounting, told on the Node.
    pub(in crate::decide) watch: gpus::GpuWatch,
}

impl Enforcer {
    /// An enforcer with these settings and no memory (a fresh start).
    pub fn new(settings: Settings) -> Self {
        Self { settings, pods: HashMap::new(), generation: 0, gpus: Vec::new(), watch: gpus::GpuWatch::default() }
    }

    /// Looks at each GPU's health and accounting ([`gpus`]): Node events for a GPU whose sample fails or
    /// recovers, memory no process accounts for, and figures NVML does not give. `unaccounted` per GPU of
    /// the snapshot ([`crate::attribute::Usage::unaccounted`]).
    pub fn watch_gpus(&mut self, now: Now, snapshot: &Snapshot, unaccounted: &[Option<u64>], out: &mut Vec<Action>) {
        self.watch.observe(&self.settings.accounting, now.mono_ms, snapshot, unaccounted, out);
    }

    /// The settings.
    pub fn settings(&self) -> &Settings {
        &self.settings
    }

    /// The state the agent holds for a pod (for `top` and metrics).
    pub fn state_of(&self, uid: &str) -> Option<BudgetState> {
        self.pods.get(uid).filter(|m| !m.last_budget.is_empty()).map(|m| m.tracker.state)
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
        let empty = PodUsage::default();
        for (i, view) in table.pods.iter().enumerate() {
            let pod_usage = usage.get(i).unwrap_or(&empty);
            match table.budget(i) {
                Some(budget) => {
                    let cx = Context { view, budget, usage: pod_usage, gpus };
                    self.tick_pod(now, &cx, out);
                }
                None => self.tick_unbudgeted(now, view, out),
            }
        }
        let generation = self.generation;
        self.pods.retain(|_, m| m.seen == generation);
    }
}
