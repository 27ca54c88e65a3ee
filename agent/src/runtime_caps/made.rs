//! What the runtime made of pods' GPU containers, as the agent learned it: per pod UID and container name how the
//! driver holds each one (read from the environment the runtime gave it) and how many devices it sees; and, per
//! container being made, what the agent asked the runtime for, until the runtime shows the container it made
//! (the confirmation, #53). The pod table reads it ([`Made::summary`]); the loop prunes it with the pods present.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex, PoisonError};

use gpubudget_common::caps::{ContainerCap, Uncapped};
use gpubudget_common::pod_record::RuntimeCapsRecord;

use crate::attribute::pods::MpsCap;

/// Containers asked for and not yet confirmed, at most: beyond it the oldest asks are forgotten (their containers
/// are then judged as found when the runtime shows them). A node makes far fewer at once.
pub const MAX_EXPECTED: usize = 4096;

/// What the agent asked the runtime to make of one GPU container, told once the runtime shows the container.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Expect {
    /// Capped: the budget and the values, as the event says them.
    Capped {
        /// Which budget, and its limit (`budget team-a/llm (8Gi)`).
        how: String,
    },
    /// Left uncapped at creation: the event's note.
    Uncapped {
        /// Why, for the user (the event's message).
        note: String,
    },
}

/// One GPU container as the runtime made it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MadeContainer {
    /// The runtime's ID of the container the runtime showed made (empty: not shown yet).
    pub confirmed: String,
    /// How the driver holds it (`Uncapped(Unconfirmed)` until the runtime showed it).
    pub held: ContainerCap,
    /// The devices it sees (0: unknown).
    pub devices: u32,
}

#[derive(Debug, Default)]
struct State {
    pods: HashMap<Arc<str>, BTreeMap<String, MadeContainer>>,
    /// By container ID: the pod's UID and what was asked, in the order asked.
    expected: HashMap<String, (Arc<str>, Expect, u64)>,
    asked: u64,
}

/// The shared state (cheap to clone: one lock, held for a lookup or an insert).
#[derive(Debug, Clone, Default)]
pub struct Made(Arc<Mutex<State>>);

impl Made {
    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.0.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Remembers how the driver holds container `name` of the pod with UID `uid`.
    pub fn remember(&self, uid: &str, name: &str, held: ContainerCap, devices: u32) {
        self.confirm(uid, "", name, held, devices);
    }

    /// Remembers how the driver holds the container with ID `id` as the runtime showed it made: what was asked for
    /// it no longer counts.
    pub fn confirm(&self, uid: &str, id: &str, name: &str, held: ContainerCap, devices: u32) {
        let uid: Arc<str> = Arc::from(uid.to_ascii_lowercase());
        let mut s = self.state();
        s.expected.remove(id);
        let c = MadeContainer { confirmed: id.to_owned(), held, devices };
        s.pods.entry(uid).or_default().insert(name.to_owned(), c);
    }

    /// Remembers what was asked for the container with ID `id` of the pod `uid`, and counts the container
    /// unconfirmed meanwhile.
    /// An ask that comes after the runtime already showed that container (the answer was late) changes nothing.
    pub fn expect(&self, uid: &str, id: &str, name: &str, devices: u32, expect: Expect) {
        let mut s = self.state();
        let key = uid.to_ascii_lowercase();
        if s.pods.get(key.as_str()).and_then(|p| p.get(name)).is_some_and(|c| !id.is_empty() && c.confirmed == id) {
            return;
        }
        let c =
            MadeContainer { confirmed: String::new(), held: ContainerCap::Uncapped(Uncapped::Unconfirmed), devices };
        s.pods.entry(Arc::from(key.as_str())).or_default().insert(name.to_owned(), c);
        if s.expected.len() >= MAX_EXPECTED {
            let oldest = s.expected.iter().min_by_key(|(_, (_, _, n))| *n).map(|(k, _)| k.clone());
            if let Some(k) = oldest {
                s.expected.remove(&k);
            }
        }
        s.asked += 1;
        let n = s.asked;
        s.expected.insert(id.to_owned(), (Arc::from(key), expect, n));
    }

    /// What was asked for the container with ID `id`, forgotten once read.
    pub fn take_expected(&self, id: &str) -> Option<Expect> {
        self.state().expected.remove(id).map(|(_, e, _)| e)
    }

    /// Forgets the pods (and their asks) for which `here` is false: those no longer on the node.
    pub fn retain_pods(&self, here: impl Fn(&str) -> bool) {
        let mut s = self.state();
        s.pods.retain(|uid, _| here(uid));
        s.expected.retain(|_, (uid, _, _)| here(uid));
    }

    /// Whether nothing is remembered.
    pub fn is_empty(&self) -> bool {
        let s = self.state();
        s.pods.is_empty() && s.expected.is_empty()
    }

    /// What the pod with UID `uid`'s GPU containers as the runtime made them come to ([`summary`]), if the runtime
    /// made any.
    pub fn summary(&self, uid: &str) -> Option<(RuntimeCapsRecord, Option<MpsCap>)> {
        self.state().pods.get(uid).map(summary)
    }
}

/// The pod table reads and prunes it through the index ([`crate::attribute::kube::Index::table`]).
impl crate::attribute::kube::RuntimeMade for Made {
    fn is_empty(&self) -> bool {
        Made::is_empty(self)
    }

    fn retain_pods(&self, here: impl Fn(&str) -> bool) {
        Made::retain_pods(self, here);
    }

    fn summary(&self, uid: &str) -> Option<(RuntimeCapsRecord, Option<MpsCap>)> {
        Made::summary(self, uid)
    }
}

/// What a pod's GPU containers as the runtime made them come to: the record (capped at the largest, or the first
/// uncapped one and why) and, when every one is capped, the cap the agent's cap-in-force check judges.
pub fn summary(containers: &BTreeMap<String, MadeContainer>) -> (RuntimeCapsRecord, Option<MpsCap>) {
    let mut cap: Option<MpsCap> = None;
    let (mut capped, mut uncapped) = (Vec::new(), Vec::new());
    for (name, c) in containers {
        match c.held {
            ContainerCap::Uncapped(why) => uncapped.push(format!("container {name}: {why}")),
            ContainerCap::Capped { max_mib } => {
                capped.push((name.clone(), max_mib));
                let m = cap.get_or_insert(MpsCap { mib: max_mib, devices: c.devices });
                m.mib = m.mib.max(max_mib);
                m.devices = m.devices.min(c.devices);
            }
        }
    }
    if !uncapped.is_empty() {
        let each =
            uncapped.into_iter().chain(capped.iter().map(|(n, mib)| format!("container {n}: capped at {mib} MiB")));
        return (RuntimeCapsRecord::uncapped(each.collect::<Vec<_>>().join("; ")), None);
    }
    (RuntimeCapsRecord::capped(capped), cap)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_container_asked_capped_counts_uncapped_until_the_runtime_shows_it() {
        let made = Made::default();
        made.expect("UID-1", "c1", "main", 1, Expect::Capped { how: "budget a/b (8Gi)".into() });
        let (record, cap) = made.summary("uid-1").expect("remembered");
        assert_eq!(record, RuntimeCapsRecord::uncapped(format!("container main: {}", Uncapped::Unconfirmed)));
        assert_eq!(cap, None);
        assert_eq!(made.take_expected("c1"), Some(Expect::Capped { how: "budget a/b (8Gi)".into() }));
        assert_eq!(made.take_expected("c1"), None, "read once");
        made.confirm("uid-1", "c1", "main", ContainerCap::Capped { max_mib: 8192 }, 1);
        assert_eq!(made.summary("uid-1").map(|s| s.1), Some(Some(MpsCap { mib: 8192, devices: 1 })));
        // The agent's answer to that creation, arriving late (it was stopped): what the runtime showed stays.
        made.expect("uid-1", "c1", "main", 1, Expect::Capped { how: String::new() });
        assert_eq!(made.summary("uid-1").map(|s| s.1), Some(Some(MpsCap { mib: 8192, devices: 1 })));
        assert_eq!(made.take_expected("c1"), None);
        // A new container of that name (a restart) is asked for again.
        made.expect("uid-1", "c2", "main", 1, Expect::Capped { how: String::new() });
        assert_eq!(made.summary("uid-1").map(|s| s.1), Some(None));
    }

    #[test]
    fn the_record_names_each_gpu_container() {
        let made = Made::default();
        made.confirm("uid-1", "a", "init", ContainerCap::Capped { max_mib: 4096 }, 1);
        made.confirm("uid-1", "b", "main", ContainerCap::Capped { max_mib: 8192 }, 2);
        let (record, _) = made.summary("uid-1").expect("remembered");
        assert_eq!(record, RuntimeCapsRecord::capped([("init".to_owned(), 4096), ("main".to_owned(), 8192)]));
        made.confirm("uid-1", "c", "sidecar", ContainerCap::Uncapped(Uncapped::NoMps), 1);
        let (record, cap) = made.summary("uid-1").expect("remembered");
        assert_eq!(cap, None);
        assert_eq!(
            record,
            RuntimeCapsRecord::uncapped(
                "container sidecar: no CUDA_MPS_PINNED_DEVICE_MEM_LIMIT; container init: capped at 4096 MiB; \
                 container main: capped at 8192 MiB"
                    .to_owned()
            )
        );
    }

    #[test]
    fn pods_gone_are_forgotten_with_their_asks_and_asks_are_bounded() {
        let made = Made::default();
        for i in 0..MAX_EXPECTED + 10 {
            made.expect("uid-1", &format!("c{i}"), &format!("n{i}"), 1, Expect::Uncapped { note: String::new() });
        }
        assert_eq!(made.take_expected("c0"), None, "the oldest forgotten beyond the bound");
        assert!(made.take_expected(&format!("c{}", MAX_EXPECTED + 9)).is_some());
        made.retain_pods(|uid| uid != "uid-1");
        assert!(made.is_empty());
    }
}
