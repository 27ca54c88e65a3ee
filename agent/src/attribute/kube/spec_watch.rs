//! Budgets' specs without their status (#34): every agent needs every budget's spec, and none needs its status,
//! which the operator rewrites as usage moves. A full watch hands every agent every status write (10 000
//! statuses written once: 10 000 objects decoded by each of the fleet's agents); this one watches the budgets'
//! metadata only and reads a budget's object only when its `metadata.generation` moves, which a status write
//! (the status subresource) never does. A status write still sends each agent one metadata event (a few hundred
//! bytes, no status in it: docs/performance.md has the figures).
//!
//! The first list of each start (and a relist that finds more than [`READ_ONE_BY_ONE_MAX`] budgets changed)
//! reads the full objects in one paged list instead of one read each. Reads that fail are retried with
//! backoff, and the budget keeps the spec it had until one succeeds.
//!
//! [`Generations`] is the pure part: what must be read, given what was read.

use std::collections::{BTreeSet, HashMap};
use std::fmt::Debug;
use std::time::Duration;

use futures::StreamExt as _;
use kube::api::ListParams;
use kube::api::PartialObjectMeta;
use kube::runtime::{WatchStreamExt as _, watcher};
use kube::{Api, Resource};
use serde::de::DeserializeOwned;
use tokio_util::sync::CancellationToken;

/// A read of budgets' objects (`{kind}` of `gpubudget_budget_spec_reads_total`).
#[derive(Debug, Clone, Copy, Hash, PartialEq, Eq)]
pub enum ReadKind {
    /// `get`: one budget, by name.
    Get,
    /// `list`: a page of a full list.
    List,
}

impl ReadKind {
    /// The label value.
    pub fn as_str(self) -> &'static str {
        match self {
            ReadKind::Get => "get",
            ReadKind::List => "list",
        }
    }
}

/// Whether a read was answered (`{result}` of `gpubudget_budget_spec_reads_total`).
#[derive(Debug, Clone, Copy, Hash, PartialEq, Eq)]
pub enum ReadResult {
    /// `ok`: answered (a budget gone included).
    Ok,
    /// `error`: not answered; retried with backoff.
    Error,
}

impl ReadResult {
    /// The label value.
    pub fn as_str(self) -> &'static str {
        match self {
            ReadResult::Ok => "ok",
            ReadResult::Error => "error",
        }
    }
}

gpubudget_daemon::label_values!(ReadKind, ReadResult);

/// A relist that finds more budgets changed than this reads them in one paged list, not one by one.
pub const READ_ONE_BY_ONE_MAX: usize = 32;
/// The first wait before a failed read is retried; it doubles up to [`RETRY_MAX`].
pub const RETRY_MIN: Duration = Duration::from_secs(1);
/// The longest wait between retries of a failed read.
pub const RETRY_MAX: Duration = Duration::from_secs(30);

/// A budget's namespace (empty for a cluster budget) and name.
pub type Key = (String, String);

/// Which object, at which spec: its UID (a budget deleted and created again under its name is another) and
/// `metadata.generation` (absent: read every time).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Seen {
    /// `metadata.uid`.
    pub uid: String,
    /// `metadata.generation`.
    pub generation: Option<i64>,
}

impl Seen {
    /// What `meta` says.
    pub fn of(meta: &kube::api::ObjectMeta) -> (Key, Self) {
        let key = (meta.namespace.clone().unwrap_or_default(), meta.name.clone().unwrap_or_default());
        (key, Self { uid: meta.uid.clone().unwrap_or_default(), generation: meta.generation })
    }
}

/// What a relist of metadata asks for.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Plan {
    /// Budgets whose spec must be read (new, or another generation or UID than the one read).
    pub read: Vec<Key>,
    /// Budgets known before and not listed: deleted while the watch was down.
    pub gone: Vec<Key>,
}

/// The spec each budget was last read at.
#[derive(Debug, Default)]
pub struct Generations {
    read: HashMap<Key, Seen>,
}

impl Generations {
    /// Whether a budget's spec must be read: not read yet, or read at another UID or generation.
    pub fn stale(&self, key: &Key, seen: &Seen) -> bool {
        seen.generation.is_none() || self.read.get(key) != Some(seen)
    }

    /// The budget's spec was read at `seen`.
    pub fn record(&mut self, key: Key, seen: Seen) {
        self.read.insert(key, seen);
    }

    /// The budget is gone; whether it was known.
    pub fn forget(&mut self, key: &Key) -> bool {
        self.read.remove(key).is_some()
    }

    /// Forgets everything (before a full list records what it reads).
    pub fn clear(&mut self) {
        self.read.clear();
    }

    /// What a relist that found `listed` asks for: each changed budget once, in key order.
    pub fn plan(&self, listed: &[(Key, Seen)]) -> Plan {
        let names: BTreeSet<&Key> = listed.iter().map(|(k, _)| k).collect();
        let read: BTreeSet<Key> = listed.iter().filter(|(k, s)| self.stale(k, s)).map(|(k, _)| k.clone()).collect();
        let mut gone: Vec<Key> = self.read.keys().filter(|k| !names.contains(k)).cloned().collect();
        gone.sort();
        Plan { read: read.into_iter().collect(), gone }
    }

    /// Budgets whose spec has been read.
    pub fn len(&self) -> usize {
        self.read.len()
    }

    /// No budget has been read.
    pub fn is_empty(&self) -> bool {
        self.read.is_empty()
    }
}

/// What the spec watch hands on: full-object watch events (a list as `Init`, `InitApply` …, `InitDone`; a
/// changed spec as `Apply`), and deletions by key.
#[derive(Debug)]
pub enum SpecEvent<K> {
    /// A full object, or the markers of a list.
    Event(watcher::Event<K>),
    /// The budget was deleted.
    Deleted(Key),
}

/// The resource in one namespace (the argument; empty for a cluster-scoped object).
pub type Scoped<K> = std::sync::Arc<dyn Fn(&str) -> Api<K> + Send + Sync>;

/// Where the spec watch reads from: every object (`all`, for the watch and lists) and one namespace's (for
/// reads by name; a cluster-scoped resource's is `all`).
pub struct Source<K> {
    /// All of the resource.
    pub all: Api<K>,
    /// The resource in a namespace (the argument; empty for a cluster-scoped object).
    pub scoped: Scoped<K>,
}

impl<K> std::fmt::Debug for Source<K> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Source").finish_non_exhaustive()
    }
}

/// Watches `source`'s metadata and hands `on` what changed in specs, until `shutdown`; `failed` gets every
/// watch failure (after it is logged). Each read is told to `reads` (its [`ReadKind`] and whether
/// it was answered), which counts it (`gpubudget_budget_spec_reads_total`).
pub fn spawn<K, F, E>(
    source: Source<K>,
    page_size: u32,
    name: &'static str,
    shutdown: CancellationToken,
    reads: impl Fn(ReadKind, ReadResult) + Send + 'static,
    mut on: F,
    mut failed: E,
) where
    K: Resource<DynamicType = ()> + Clone + DeserializeOwned + Debug + Send + Sync + 'static,
    F: FnMut(SpecEvent<K>) + Send + 'static,
    E: FnMut(&watcher::Error) + Send + 'static,
{
    let config = watcher::Config::default().page_size(page_size);
    // An `Api` of `PartialObjectMeta` asks for metadata only (the API server sends no spec and no status).
    let metadata = Api::<PartialObjectMeta<K>>::all(source.all.clone().into_client());
    let stream = watcher(metadata, config).default_backoff();
    tokio::spawn(async move {
        let mut stream = std::pin::pin!(stream);
        let mut reader = Reader { source, page_size, name, generations: Generations::default(), reads };
        let mut relist: Option<Vec<(Key, Seen)>> = None;
        let mut listed_once = false;
        // Reads that failed, retried at `retry_at` with a doubling wait; a full list when `full`.
        let mut pending: BTreeSet<Key> = BTreeSet::new();
        let mut full_pending = false;
        let mut wait = RETRY_MIN;
        let retry = tokio::time::sleep(Duration::ZERO);
        tokio::pin!(retry);
        loop {
            let retrying = full_pending || !pending.is_empty();
            tokio::select! {
                () = shutdown.cancelled() => break,
                () = &mut retry, if retrying => {
                    let ok = if full_pending {
                        reader.list(&mut on).await
                    } else {
                        let keys = std::mem::take(&mut pending);
                        pending = reader.read_each(keys, &mut on).await;
                        pending.is_empty()
                    };
                    if ok {
                        full_pending = false;
                        wait = RETRY_MIN;
                    } else {
                        wait = (wait * 2).min(RETRY_MAX);
                        retry.as_mut().reset(tokio::time::Instant::now() + wait);
                    }
                }
                event = stream.next() => {
                    let before = full_pending || !pending.is_empty();
                    match event {
                        None => break,
                        Some(Err(error)) => {
                            tracing::warn!(cache = name, %error, "watch failed; retrying with backoff");
                            failed(&error);
                        }
                        Some(Ok(watcher::Event::Init)) => relist = Some(Vec::new()),
                        Some(Ok(watcher::Event::InitApply(meta))) => {
                            relist.get_or_insert_with(Vec::new).push(Seen::of(&meta.metadata));
                        }
                        Some(Ok(watcher::Event::InitDone)) => {
                            let listed = relist.take().unwrap_or_default();
                            let plan = reader.generations.plan(&listed);
                            if !listed_once || plan.read.len() > READ_ONE_BY_ONE_MAX {
                                listed_once = true;
                                pending.clear();
                                full_pending = !reader.list(&mut on).await;
                            } else {
                                for key in plan.gone {
                                    reader.generations.forget(&key);
                                    pending.remove(&key);
                                    on(SpecEvent::Deleted(key));
                                }
                                pending.extend(plan.read);
                                let keys = std::mem::take(&mut pending);
                                pending = reader.read_each(keys, &mut on).await;
                            }
                        }
                        Some(Ok(watcher::Event::Apply(meta))) => {
                            let (key, seen) = Seen::of(&meta.metadata);
                            if reader.generations.stale(&key, &seen) && !full_pending {
                                pending.insert(key);
                                let keys = std::mem::take(&mut pending);
                                pending = reader.read_each(keys, &mut on).await;
                            }
                        }
                        Some(Ok(watcher::Event::Delete(meta))) => {
                            let (key, _) = Seen::of(&meta.metadata);
                            reader.generations.forget(&key);
                            pending.remove(&key);
                            on(SpecEvent::Deleted(key));
                        }
                    }
                    let after = full_pending || !pending.is_empty();
                    if after && !before {
                        wait = RETRY_MIN;
                        retry.as_mut().reset(tokio::time::Instant::now() + wait);
                    }
                }
            }
        }
    });
}

/// Reads budgets' objects and records what it read.
struct Reader<K, R> {
    source: Source<K>,
    page_size: u32,
    name: &'static str,
    generations: Generations,
    reads: R,
}

impl<K, R> Reader<K, R>
where
    K: Resource<DynamicType = ()> + Clone + DeserializeOwned + Debug + Send + Sync + 'static,
    R: Fn(ReadKind, ReadResult),
{
    fn count(&self, kind: ReadKind, result: ReadResult) {
        (self.reads)(kind, result);
    }

    /// Reads every object in pages and hands them on as a list; whether the list completed (if not, what was
    /// handed on is an unfinished relist, which the cache keeps apart until a list completes).
    async fn list(&mut self, on: &mut impl FnMut(SpecEvent<K>)) -> bool {
        self.generations.clear();
        on(SpecEvent::Event(watcher::Event::Init));
        let mut params = ListParams::default().limit(self.page_size);
        loop {
            let page = match self.source.all.list(&params).await {
                Ok(page) => page,
                Err(error) => {
                    self.count(ReadKind::List, ReadResult::Error);
                    tracing::warn!(cache = self.name, %error, "cannot list budgets' specs; retrying with backoff");
                    return false;
                }
            };
            self.count(ReadKind::List, ReadResult::Ok);
            let next = page.metadata.continue_.clone().filter(|c| !c.is_empty());
            for object in page.items {
                let (key, seen) = Seen::of(object.meta());
                self.generations.record(key, seen);
                on(SpecEvent::Event(watcher::Event::InitApply(object)));
            }
            match next {
                Some(token) => params = params.continue_token(&token),
                None => break,
            }
        }
        on(SpecEvent::Event(watcher::Event::InitDone));
        true
    }

    /// Reads each budget of `keys`; those whose read failed.
    async fn read_each(&mut self, keys: BTreeSet<Key>, on: &mut impl FnMut(SpecEvent<K>)) -> BTreeSet<Key> {
        let mut failed = BTreeSet::new();
        for key in keys {
            match (self.source.scoped)(&key.0).get_opt(&key.1).await {
                Ok(Some(object)) => {
                    self.count(ReadKind::Get, ReadResult::Ok);
                    let (key, seen) = Seen::of(object.meta());
                    self.generations.record(key, seen);
                    on(SpecEvent::Event(watcher::Event::Apply(object)));
                }
                Ok(None) => {
                    self.count(ReadKind::Get, ReadResult::Ok);
                    self.generations.forget(&key);
                    on(SpecEvent::Deleted(key));
                }
                Err(error) => {
                    self.count(ReadKind::Get, ReadResult::Error);
                    tracing::warn!(cache = self.name, budget = %format!("{}/{}", key.0, key.1), %error,
                        "cannot read a budget's spec; retrying with backoff");
                    failed.insert(key);
                }
            }
        }
        failed
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn key(ns: &str, name: &str) -> Key {
        (ns.to_owned(), name.to_owned())
    }

    fn seen(uid: &str, generation: i64) -> Seen {
        Seen { uid: uid.to_owned(), generation: Some(generation) }
    }

    #[test]
    fn a_status_write_reads_nothing_a_spec_change_reads_once() {
        let mut g = Generations::default();
        let (k, s1) = (key("a", "llm"), seen("u1", 1));
        assert!(g.stale(&k, &s1), "never read");
        g.record(k.clone(), s1.clone());
        assert!(!g.stale(&k, &s1), "a status write: same generation");
        assert!(g.stale(&k, &seen("u1", 2)), "a spec change");
        assert!(g.stale(&k, &seen("u2", 1)), "deleted and created again under its name");
        assert!(g.stale(&k, &Seen { uid: "u1".into(), generation: None }), "no generation: always read");
        assert!(g.forget(&k));
        assert!(!g.forget(&k));
        assert!(g.is_empty());
    }

    #[test]
    fn a_relist_reads_what_changed_and_drops_what_went() {
        let mut g = Generations::default();
        for (ns, name, generation) in [("a", "x", 1), ("a", "y", 3), ("", "admin", 2)] {
            g.record(key(ns, name), seen(&format!("{ns}{name}"), generation));
        }
        let listed = vec![
            (key("a", "x"), seen("ax", 1)),     // unchanged (its status moved, maybe)
            (key("a", "y"), seen("ay", 4)),     // spec changed while the watch was down
            (key("b", "new"), seen("bnew", 1)), // created while down
            (key("b", "new"), seen("bnew", 1)), // listed twice: read once
        ];
        let plan = g.plan(&listed);
        assert_eq!(plan.read, [key("a", "y"), key("b", "new")]);
        assert_eq!(plan.gone, [key("", "admin")]);
        assert_eq!(g.len(), 3);
    }

    proptest! {
        /// After a relist's plan is carried out (read what it says, drop what went), what was read is exactly
        /// what was listed, whatever was known before.
        #[test]
        fn carrying_out_a_plan_leaves_exactly_the_listed_specs(
            known in proptest::collection::vec((0..4u8, 0..4u8, 1..3i64), 0..12),
            listed in proptest::collection::vec((0..4u8, 0..4u8, 1..3i64), 0..12),
        ) {
            let mut g = Generations::default();
            for (ns, name, generation) in &known {
                g.record(key(&ns.to_string(), &name.to_string()), seen("u", *generation));
            }
            let listed: Vec<(Key, Seen)> = listed.iter()
                .map(|(ns, name, generation)| (key(&ns.to_string(), &name.to_string()), seen("u", *generation)))
                .collect();
            // The API server lists each object once.
            let mut unique: HashMap<Key, Seen> = HashMap::new();
            for (k, s) in &listed { unique.entry(k.clone()).or_insert_with(|| s.clone()); }
            let listed: Vec<(Key, Seen)> = unique.clone().into_iter().collect();
            let plan = g.plan(&listed);
            for k in &plan.gone { prop_assert!(!unique.contains_key(k)); g.forget(k); }
            for k in &plan.read { g.record(k.clone(), unique[k].clone()); }
            prop_assert_eq!(g.len(), unique.len());
            for (k, s) in &unique { prop_assert!(!g.stale(k, s), "{:?} read", k); }
            // A second relist of the same finds nothing to do.
            prop_assert_eq!(g.plan(&listed), Plan::default());
        }
    }
}
