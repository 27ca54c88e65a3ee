//! Budgets' specs from their mirrors (#34, [`gpubudget_common::mirror`]): the operator copies each budget's
//! spec into a mirror that changes only with the spec, so an agent that reads the mirrors receives nothing when
//! the operator writes a status.
//!
//! An agent starts on the budgets themselves ([`super::spec_watch`]: metadata, a read when the generation
//! moves) and watches the mirrors beside them. Once the budgets have listed, at least one exists, and every
//! one has a mirror of its UID at its generation ([`Switch::ready`]: an operator is mirroring them all), the
//! specs the agent holds are exactly the mirrors' and it stops the budget watch: from then on the mirrors alone
//! feed its cache, as full-object watch events of budgets rebuilt from them. Until then (an operator that writes
//! no mirrors: an older one, `--budget-mirrors=false`, the mirror CRDs not installed) it behaves as before.
//! With no budget at all it stays on the budgets: there is no status to spare, and a budget created while no
//! operator mirrors would otherwise go unseen.

use std::collections::HashMap;
use std::fmt::Debug;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::StreamExt as _;
use gpubudget_common::mirror::{Copied, DELETED_ANNOTATION, Key, MISSING_BOUND, Mirrored, Vouch, covers};
use k8s_openapi::api::coordination::v1::Lease;
use kube::runtime::{WatchStreamExt as _, watcher};
use kube::{Api, Resource};
use serde::de::DeserializeOwned;
use tokio_util::sync::CancellationToken;

use super::spec_watch::{self, SpecEvent};

/// How often, at most, an agent still on the budgets checks whether the mirrors cover them (a check is
/// linear in the budgets).
pub const CHECK_EVERY: Duration = Duration::from_secs(1);

fn key_of(meta: &kube::api::ObjectMeta) -> Key {
    (meta.namespace.clone().unwrap_or_default(), meta.name.clone().unwrap_or_default())
}

/// What has been seen of one side (the budgets, or the mirrors): each object's UID and generation, and
/// whether a list has completed (none open now).
#[derive(Debug, Default)]
struct Side {
    seen: HashMap<Key, Copied>,
    relist: Option<HashMap<Key, Copied>>,
    listed: bool,
}

impl Side {
    fn apply(&mut self, key: Key, copied: Option<Copied>) {
        let seen = self.relist.as_mut().unwrap_or(&mut self.seen);
        match copied {
            Some(c) => seen.insert(key, c),
            None => seen.remove(&key),
        };
    }

    fn begin(&mut self) {
        self.relist = Some(HashMap::new());
    }

    fn end(&mut self) {
        if let Some(listed) = self.relist.take() {
            self.seen = listed;
            self.listed = true;
        }
    }

    fn settled(&self) -> bool {
        self.listed && self.relist.is_none()
    }
}

/// The pure part: when an agent may read the mirrors alone.
#[derive(Debug, Default)]
pub struct Switch {
    budgets: Side,
    mirrors: Side,
}

impl Switch {
    /// A budget watch event, as the cache receives it.
    pub fn budget<K: Resource>(&mut self, event: &SpecEvent<K>) {
        match event {
            SpecEvent::Event(watcher::Event::Init) => self.budgets.begin(),
            SpecEvent::Event(watcher::Event::InitDone) => self.budgets.end(),
            SpecEvent::Event(watcher::Event::InitApply(b) | watcher::Event::Apply(b)) => {
                self.budgets.apply(key_of(b.meta()), Copied::of_budget(b.meta()));
            }
            SpecEvent::Event(watcher::Event::Delete(b)) => self.budgets.apply(key_of(b.meta()), None),
            SpecEvent::Deleted(key) => self.budgets.apply(key.clone(), None),
        }
    }

    /// A mirror watch event (`kind`: the budget kind the mirrors copy).
    pub fn mirror<M: Resource>(&mut self, event: &watcher::Event<M>, kind: &str) {
        match event {
            watcher::Event::Init => self.mirrors.begin(),
            watcher::Event::InitDone => self.mirrors.end(),
            watcher::Event::InitApply(m) | watcher::Event::Apply(m) => {
                self.mirrors.apply(key_of(m.meta()), Copied::of_mirror(m.meta(), kind));
            }
            watcher::Event::Delete(m) => self.mirrors.apply(key_of(m.meta()), None),
        }
    }

    /// Whether the mirrors alone may feed the cache: both sides listed with no list open, at least one budget,
    /// and a mirror of each at its UID and generation (so the cache holds exactly the mirrors' specs).
    pub fn ready(&self) -> bool {
        self.budgets.settled()
            && self.mirrors.settled()
            && !self.budgets.seen.is_empty()
            && covers(&self.budgets.seen, &self.mirrors.seen)
    }
}

/// A mirror watch event as the budget cache takes it: budgets rebuilt from the mirrors (a mirror that names no
/// budget counts as absent).
pub fn as_budget_event<K: Mirrored>(event: watcher::Event<K::Mirror>) -> Option<SpecEvent<K>> {
    Some(match event {
        watcher::Event::Init => SpecEvent::Event(watcher::Event::Init),
        watcher::Event::InitDone => SpecEvent::Event(watcher::Event::InitDone),
        watcher::Event::InitApply(m) => SpecEvent::Event(watcher::Event::InitApply(K::from_mirror(&m)?)),
        // Marked by the operator as its budget's deletion: the budget is gone.
        watcher::Event::Apply(m) if marked_deleted(m.meta()) => SpecEvent::Deleted(key_of(m.meta())),
        watcher::Event::Apply(m) => match K::from_mirror(&m) {
            Some(b) => SpecEvent::Event(watcher::Event::Apply(b)),
            None => SpecEvent::Deleted(key_of(m.meta())),
        },
        watcher::Event::Delete(m) => SpecEvent::Deleted(key_of(m.meta())),
    })
}

/// How often an agent reads the mirrors' Lease ([`Vouch`]).
pub const LEASE_POLL: Duration = Duration::from_secs(5);

/// The mirrors' Lease an agent reads, by which the operator vouches that every budget has a current mirror.
pub type LeaseSource = (Api<Lease>, String);

/// The Lease's `renewTime` and `leaseDurationSeconds` (`None` without them: it vouches for nothing).
fn lease_state(lease: &Lease) -> Option<(String, u64)> {
    let spec = lease.spec.as_ref()?;
    let renewed = spec.renew_time.as_ref()?;
    let seconds = u64::try_from(spec.lease_duration_seconds?).ok()?;
    // What moves is compared with the last one seen, never with this node's clock.
    Some((renewed.0.to_string(), seconds))
}

/// [`spec_watch::spawn`] on `source`, with `mirrors` watched beside it: once [`Switch::ready`] and the
/// operator vouches for the mirrors (its `lease` renewed under this agent's eyes: [`Vouch`]), the budget watch
/// stops and the mirrors feed `on`. Whenever the mirrors stop being current (the Lease not renewed or deleted:
/// the operator down, mirrors off, a mirror write failing; or a mirror deleted without
/// [`DELETED_ANNOTATION`] and not back within [`MISSING_BOUND`]) it reads the budgets again, from a fresh
/// list, and the mirrors from a fresh list too. Without a `lease` it never reads the mirrors. `mirrored` is
/// told each time the source changes (`true`: mirrors), with the reason when it goes back to the budgets.
#[allow(clippy::too_many_arguments)]
pub fn spawn<K, F, E>(
    source: impl Fn() -> spec_watch::Source<K> + Send + 'static,
    mirrors: Api<K::Mirror>,
    lease: Option<LeaseSource>,
    page_size: u32,
    name: &'static str,
    shutdown: CancellationToken,
    reads: impl Fn(spec_watch::ReadKind, spec_watch::ReadResult) + Send + Sync + 'static,
    mirrored: impl Fn(bool, Option<&str>) + Send + 'static,
    on: F,
    failed: E,
) where
    K: Mirrored + Clone + DeserializeOwned + Debug + Send + Sync + 'static,
    K::Mirror: Clone + DeserializeOwned + Debug + Send + 'static,
    F: FnMut(SpecEvent<K>) + Send + 'static,
    E: FnMut(&watcher::Error) + Send + 'static,
{
    // One state for both watches, locked while a change reaches the cache: the budget watch's events are applied
    // on its own task as they are read (no queue of full objects between the two), and none is applied once the
    // mirrors feed the cache.
    let shared = Arc::new(Mutex::new(Shared { switch: Switch::default(), on_mirrors: false, dirty: false, on }));
    let reads = Arc::new(reads);
    let failed = Arc::new(Mutex::new(failed));
    let budget_watch = {
        let shared = shared.clone();
        move |token: CancellationToken| {
            let (shared, reads, failed) = (shared.clone(), reads.clone(), failed.clone());
            spec_watch::spawn(
                source(),
                page_size,
                name,
                token,
                move |kind, result| reads(kind, result),
                move |event| {
                    let mut s = lock(&shared);
                    if !s.on_mirrors {
                        s.switch.budget(&event);
                        s.dirty = true;
                        (s.on)(event);
                    }
                },
                move |error| (lock(&failed))(error),
            );
        }
    };
    let mut watching = shutdown.child_token();
    budget_watch(watching.clone());
    let config = watcher::Config::default().page_size(page_size);
    let kind = K::kind(&()).into_owned();
    tokio::spawn(async move {
        let mut stream = watcher(mirrors.clone(), config.clone()).default_backoff().boxed();
        let mut on_mirrors = false;
        let mut warned = false;
        let mut vouch = Vouch::default();
        let mut was_fresh = false;
        // Mirrors deleted without the operator's mark while their budgets stay in force: since when.
        let mut missing: HashMap<Key, tokio::time::Instant> = HashMap::new();
        let clock = tokio::time::Instant::now();
        let now_ms = move || u64::try_from(clock.elapsed().as_millis()).unwrap_or(u64::MAX);
        mirrored(false, None);
        let mut check = tokio::time::interval(CHECK_EVERY);
        check.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut poll = tokio::time::interval(LEASE_POLL);
        poll.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            let mut fall_back: Option<String> = None;
            tokio::select! {
                () = shutdown.cancelled() => break,
                event = stream.next() => match event {
                    None => break,
                    Some(Ok(event)) => {
                        let mut s = lock(&shared);
                        if s.on_mirrors {
                            match &event {
                                // Deleted without the operator's mark: the budget stays in force until its mirror
                                // is back, or for the bound.
                                watcher::Event::Delete(m) if !marked_deleted(m.meta()) => {
                                    missing.entry(key_of(m.meta())).or_insert_with(tokio::time::Instant::now);
                                }
                                watcher::Event::Apply(m) | watcher::Event::InitApply(m) => {
                                    missing.remove(&key_of(m.meta()));
                                    if let Some(event) = as_budget_event::<K>(event) {
                                        (s.on)(event);
                                    }
                                }
                                _ => {
                                    if let Some(event) = as_budget_event::<K>(event) {
                                        (s.on)(event);
                                    }
                                }
                            }
                        } else {
                            s.switch.mirror(&event, &kind);
                            s.dirty = true;
                        }
                    }
                    Some(Err(error)) => {
                        // Before a switch a missing CRD is expected (an older operator): said once.
                        if on_mirrors || !warned {
                            warned = true;
                            tracing::warn!(cache = name, %error, "mirror watch failed; retrying with backoff");
                        }
                    }
                },
                _ = poll.tick(), if lease.is_some() => {
                    if let Some((api, lease_name)) = &lease {
                        match api.get_opt(lease_name).await {
                            Ok(got) => {
                                let state = got.as_ref().and_then(lease_state);
                                vouch.observe(state.as_ref().map(|(r, s)| (r.as_str(), *s)), now_ms());
                            }
                            // Unreadable: vouches for nothing once its last renewal is older than its duration.
                            Err(error) => tracing::debug!(cache = name, %error, "cannot read the mirrors' Lease"),
                        }
                    }
                    if on_mirrors {
                        fall_back = vouch.why_not(now_ms());
                        if fall_back.is_none() {
                            let bound = tokio::time::Instant::now() - MISSING_BOUND;
                            if let Some((key, _)) = missing.iter().find(|(_, since)| **since <= bound) {
                                fall_back = Some(format!(
                                    "the mirror of budget {}/{} was deleted {}s ago and not written again",
                                    key.0,
                                    key.1,
                                    MISSING_BOUND.as_secs()
                                ));
                            }
                        }
                    }
                }
                _ = check.tick(), if !on_mirrors => {
                    let mut s = lock(&shared);
                    // The check is linear in the budgets: made when something changed, or the Lease just came.
                    let (dirty, fresh) = (std::mem::take(&mut s.dirty), vouch.fresh(now_ms()));
                    let came = fresh && !was_fresh;
                    was_fresh = fresh;
                    if fresh && (dirty || came) && s.switch.ready() {
                        s.on_mirrors = true;
                        // What the switch kept (two maps of every budget) is not needed any more.
                        s.switch = Switch::default();
                        drop(s);
                        on_mirrors = true;
                        missing.clear();
                        watching.cancel();
                        mirrored(true, None);
                        tracing::info!(cache = name, "every budget has a current mirror and the operator vouches \
                            for them: reading the mirrors only (status writes no longer reach this agent)");
                    }
                }
            }
            if let Some(why) = fall_back {
                // Back to the budgets: a fresh list of each (the switch rebuilds both sides), the cache replaced
                // by the budgets' list when it ends.
                let mut s = lock(&shared);
                s.on_mirrors = false;
                s.switch = Switch::default();
                s.dirty = true;
                drop(s);
                on_mirrors = false;
                missing.clear();
                watching = shutdown.child_token();
                budget_watch(watching.clone());
                stream = watcher(mirrors.clone(), config.clone()).default_backoff().boxed();
                mirrored(false, Some(&why));
                tracing::warn!(cache = name, reason = %why, "the mirrors are not current: reading the budgets themselves again");
            }
        }
    });
}

/// Whether the operator marked a mirror as its budget's deletion ([`DELETED_ANNOTATION`]).
fn marked_deleted(meta: &kube::api::ObjectMeta) -> bool {
    meta.annotations.as_ref().is_some_and(|a| a.contains_key(DELETED_ANNOTATION))
}

/// What both watches share: the switch, whether the mirrors feed the cache, and the cache's entry point.
struct Shared<F> {
    switch: Switch,
    on_mirrors: bool,
    /// Something changed since the last check.
    dirty: bool,
    on: F,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

#[cfg(test)]
mod tests {
    use super::*;
    use gpubudget_common::{GpuMemoryBudget, GpuMemoryBudgetMirror};
    use proptest::prelude::*;

    fn budget(name: &str, uid: &str, generation: i64) -> GpuMemoryBudget {
        serde_yaml::from_str(&format!(
            "metadata: {{name: {name}, namespace: a, uid: {uid}, generation: {generation}}}\n\
             spec: {{selector: {{}}, limit: 8Gi}}"
        ))
        .expect("budget")
    }

    fn mirror(b: &GpuMemoryBudget) -> GpuMemoryBudgetMirror {
        b.mirror().expect("mirror")
    }

    type Budgets = Vec<GpuMemoryBudget>;

    fn list_budgets(s: &mut Switch, budgets: &Budgets) {
        s.budget::<GpuMemoryBudget>(&SpecEvent::Event(watcher::Event::Init));
        for b in budgets {
            s.budget(&SpecEvent::Event(watcher::Event::InitApply(b.clone())));
        }
        s.budget::<GpuMemoryBudget>(&SpecEvent::Event(watcher::Event::InitDone));
    }

    fn list_mirrors(s: &mut Switch, mirrors: &[GpuMemoryBudgetMirror]) {
        s.mirror::<GpuMemoryBudgetMirror>(&watcher::Event::Init, "GpuMemoryBudget");
        for m in mirrors {
            s.mirror(&watcher::Event::InitApply(m.clone()), "GpuMemoryBudget");
        }
        s.mirror::<GpuMemoryBudgetMirror>(&watcher::Event::InitDone, "GpuMemoryBudget");
    }

    #[test]
    fn switches_only_once_an_operator_mirrors_every_budget_at_its_generation() {
        let (x, y) = (budget("x", "ux", 1), budget("y", "uy", 4));
        let mut s = Switch::default();
        assert!(!s.ready(), "nothing listed");
        list_budgets(&mut s, &vec![x.clone(), y.clone()]);
        assert!(!s.ready(), "mirrors not listed (CRD missing, or not yet)");
        list_mirrors(&mut s, &[mirror(&x)]);
        assert!(!s.ready(), "y has no mirror: an older operator, or not written yet");
        s.mirror(&watcher::Event::Apply(mirror(&budget("y", "uy", 3))), "GpuMemoryBudget");
        assert!(!s.ready(), "y's mirror is of an older generation");
        s.mirror(&watcher::Event::Apply(mirror(&y)), "GpuMemoryBudget");
        assert!(s.ready());
        // y edited: its mirror lags until the operator writes it.
        s.budget(&SpecEvent::Event(watcher::Event::Apply(budget("y", "uy", 5))));
        assert!(!s.ready());
        s.mirror(&watcher::Event::Apply(mirror(&budget("y", "uy", 5))), "GpuMemoryBudget");
        assert!(s.ready());
        // A budget deleted and created again under its name (another UID) waits for its own mirror.
        s.budget(&SpecEvent::Event(watcher::Event::Apply(budget("x", "ux2", 1))));
        assert!(!s.ready());
    }

    #[test]
    fn never_switches_without_a_budget_or_while_a_list_is_open() {
        let x = budget("x", "ux", 1);
        let mut s = Switch::default();
        list_budgets(&mut s, &Vec::new());
        list_mirrors(&mut s, &[]);
        assert!(!s.ready(), "no budget: a budget created later would have no operator to mirror it");
        list_budgets(&mut s, &vec![x.clone()]);
        list_mirrors(&mut s, &[mirror(&x)]);
        assert!(s.ready());
        s.budget::<GpuMemoryBudget>(&SpecEvent::Event(watcher::Event::Init));
        assert!(!s.ready(), "a budget relist under way");
        s.budget(&SpecEvent::Event(watcher::Event::InitApply(x.clone())));
        s.budget::<GpuMemoryBudget>(&SpecEvent::Event(watcher::Event::InitDone));
        assert!(s.ready());
        s.mirror::<GpuMemoryBudgetMirror>(&watcher::Event::Init, "GpuMemoryBudget");
        assert!(!s.ready(), "a mirror relist under way");
    }

    #[test]
    fn a_mirror_event_reaches_the_cache_as_its_budget() {
        let b = budget("x", "ux", 2);
        match as_budget_event::<GpuMemoryBudget>(watcher::Event::Apply(mirror(&b))) {
            Some(SpecEvent::Event(watcher::Event::Apply(got))) => {
                assert_eq!(
                    (&got.spec, &got.metadata.uid, got.metadata.generation),
                    (&b.spec, &b.metadata.uid, Some(2))
                );
            }
            other => panic!("{other:?}"),
        }
        match as_budget_event::<GpuMemoryBudget>(watcher::Event::Delete(mirror(&b))) {
            Some(SpecEvent::Deleted(key)) => assert_eq!(key, ("a".to_owned(), "x".to_owned())),
            other => panic!("{other:?}"),
        }
        // A mirror that names no budget (edited by hand) counts as absent, never as a budget.
        let mut broken = mirror(&b);
        broken.metadata.owner_references = None;
        assert!(matches!(
            as_budget_event::<GpuMemoryBudget>(watcher::Event::Apply(broken.clone())),
            Some(SpecEvent::Deleted(_))
        ));
        assert!(as_budget_event::<GpuMemoryBudget>(watcher::Event::InitApply(broken)).is_none());
    }

    proptest! {
        /// Whenever the switch says ready, every budget the cache was given has a mirror of the same UID and
        /// generation (whatever order the two watches delivered in).
        #[test]
        fn ready_means_every_budget_has_its_current_mirror(
            steps in proptest::collection::vec((any::<bool>(), 0..4u8, 1..4i64, any::<bool>()), 0..40),
        ) {
            let mut s = Switch::default();
            list_budgets(&mut s, &Vec::new());
            list_mirrors(&mut s, &[]);
            let mut budgets: HashMap<String, GpuMemoryBudget> = HashMap::new();
            let mut mirrors: HashMap<String, Copied> = HashMap::new();
            for (is_budget, n, generation, delete) in steps {
                let name = format!("b{n}");
                let b = budget(&name, &format!("u{n}"), generation);
                if is_budget {
                    if delete {
                        budgets.remove(&name);
                        s.budget::<GpuMemoryBudget>(&SpecEvent::Deleted(("a".into(), name)));
                    } else {
                        budgets.insert(name, b.clone());
                        s.budget(&SpecEvent::Event(watcher::Event::Apply(b)));
                    }
                } else if delete {
                    mirrors.remove(&name);
                    s.mirror(&watcher::Event::Delete(mirror(&b)), "GpuMemoryBudget");
                } else {
                    mirrors.insert(name, Copied::of_budget(&b.metadata).expect("copied"));
                    s.mirror(&watcher::Event::Apply(mirror(&b)), "GpuMemoryBudget");
                }
                if s.ready() {
                    prop_assert!(!budgets.is_empty());
                    for (name, b) in &budgets {
                        let copied = Copied::of_budget(&b.metadata);
                        prop_assert_eq!(mirrors.get(name), copied.as_ref());
                    }
                }
            }
        }
    }
}
