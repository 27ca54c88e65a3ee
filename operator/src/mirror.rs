//! The budgets' mirrors (#34, [`gpubudget_common::mirror`]): the leader copies each budget's spec into a
//! mirror of the same name whenever the budget's generation or UID differs from the mirror's, in the budget's
//! reconcile, before its status. The mirrors' metadata is watched (what each copies, a few dozen bytes each),
//! so a restart rewrites none that are current, and a mirror deleted by hand is written again at once.
//! Mirrors of deleted budgets go with them (the owner reference: the garbage collector).
//!
//! Without the mirror CRDs (an upgrade whose CRDs were not applied) the watch fails, the mirrors count as
//! listed and unavailable, and nothing is written: agents then keep watching the budgets themselves.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{PoisonError, RwLock};

use futures::StreamExt as _;
use gpubudget_common::mirror::{Copied, DELETED_ANNOTATION, Mirrored};
use gpubudget_common::{ClusterGpuMemoryBudget, ClusterGpuMemoryBudgetMirror, GpuMemoryBudget, GpuMemoryBudgetMirror};
use kube::api::{PartialObjectMeta, Patch, PatchParams};
use kube::runtime::watcher::{self, Event};
use kube::runtime::{WatchStreamExt as _, watcher as watch_stream};
use kube::{Api, Client, Resource};
use tokio_util::sync::CancellationToken;

use crate::pods::ObjKey;

/// What the mirrors of one budget kind copy, as their watch shows it, and what the budgets are (to know which
/// lag: [`Mirrors::lagging`]).
#[derive(Debug, Default)]
pub struct Mirrors {
    copies: RwLock<HashMap<ObjKey, Copied>>,
    budgets: RwLock<Side>,
    /// Whether mirrors can be written: their CRDs answer (unknown until the first list or failure).
    available: AtomicBool,
}

impl Mirrors {
    /// Whether `key`'s mirror copies `budget` at its UID and generation.
    pub fn current(&self, key: &ObjKey, budget: &Copied) -> bool {
        self.copies.read().unwrap_or_else(PoisonError::into_inner).get(key) == Some(budget)
    }

    /// Whether mirrors are written (their CRDs installed).
    pub fn available(&self) -> bool {
        self.available.load(Ordering::Acquire)
    }

    /// A budget watch event: the budget `key` is at `copied` (`None`: deleted).
    pub fn budget(&self, key: ObjKey, copied: Option<Copied>) {
        let mut side = self.budgets.write().unwrap_or_else(PoisonError::into_inner);
        let map = match &mut side.relist {
            Some(relist) => relist,
            None => &mut side.seen,
        };
        match copied {
            Some(copied) => map.insert(key, copied),
            None => map.remove(&key),
        };
    }

    /// The budget watch begins a list.
    pub fn budgets_begin(&self) {
        self.budgets.write().unwrap_or_else(PoisonError::into_inner).relist = Some(HashMap::new());
    }

    /// The budget watch ended its list.
    pub fn budgets_end(&self) {
        let mut side = self.budgets.write().unwrap_or_else(PoisonError::into_inner);
        if let Some(listed) = side.relist.take() {
            side.seen = listed;
        }
    }

    /// The budgets whose mirror does not copy them at their UID and generation (none while mirrors are not
    /// written). Linear in the budgets.
    pub fn lagging(&self) -> Vec<ObjKey> {
        let side = self.budgets.read().unwrap_or_else(PoisonError::into_inner);
        let copies = self.copies.read().unwrap_or_else(PoisonError::into_inner);
        side.seen.iter().filter(|(k, c)| copies.get(*k) != Some(*c)).map(|(k, _)| k.clone()).collect()
    }

    /// The generation `key`'s mirror copies, when it copies the budget of UID `uid` (what nodes reading the
    /// mirrors enforce).
    pub fn copied_generation(&self, key: &ObjKey, uid: &str) -> Option<i64> {
        let copies = self.copies.read().unwrap_or_else(PoisonError::into_inner);
        copies.get(key).filter(|c| c.uid == uid).map(|c| c.generation)
    }

    fn record(&self, key: ObjKey, copied: Option<Copied>) {
        let mut copies = self.copies.write().unwrap_or_else(PoisonError::into_inner);
        match copied {
            Some(copied) => copies.insert(key, copied),
            None => copies.remove(&key),
        };
    }
}

/// The budgets as their watch shows them (a list replaces them whole at its end).
#[derive(Debug, Default)]
struct Side {
    seen: HashMap<ObjKey, Copied>,
    relist: Option<HashMap<ObjKey, Copied>>,
}

/// Since when each lagging budget has had no current mirror (pure: times are arguments).
#[derive(Debug, Default)]
pub struct Lag {
    since: HashMap<ObjKey, tokio::time::Instant>,
}

impl Lag {
    /// The budgets lagging now; returns the one lagging longest and for how long.
    pub fn update(&mut self, lagging: Vec<ObjKey>, now: tokio::time::Instant) -> Option<(ObjKey, std::time::Duration)> {
        let mut next = HashMap::with_capacity(lagging.len());
        for key in lagging {
            let since = self.since.get(&key).copied().unwrap_or(now);
            next.insert(key, since);
        }
        self.since = next;
        self.since.iter().min_by_key(|(_, since)| **since).map(|(k, since)| (k.clone(), now - *since))
    }
}

/// A budget kind whose mirrors the operator writes.
pub trait MirrorOwner:
    Mirrored<
    Mirror: Resource<DynamicType = ()>
                + serde::Serialize
                + serde::de::DeserializeOwned
                + Clone
                + std::fmt::Debug
                + Send
                + Sync
                + 'static,
>
{
    /// Its kind's mirrors, of the two a context keeps (`[namespaced, cluster]`).
    fn mirrors(both: &[Mirrors; 2]) -> &Mirrors;
    /// The mirror's API (in the budget's namespace for a namespaced budget).
    fn mirror_api(client: Client, key: &ObjKey) -> Api<Self::Mirror>;
}

impl MirrorOwner for GpuMemoryBudget {
    fn mirrors(both: &[Mirrors; 2]) -> &Mirrors {
        &both[0]
    }
    fn mirror_api(client: Client, key: &ObjKey) -> Api<GpuMemoryBudgetMirror> {
        Api::namespaced(client, &key.namespace)
    }
}

impl MirrorOwner for ClusterGpuMemoryBudget {
    fn mirrors(both: &[Mirrors; 2]) -> &Mirrors {
        &both[1]
    }
    fn mirror_api(client: Client, _key: &ObjKey) -> Api<ClusterGpuMemoryBudgetMirror> {
        Api::all(client)
    }
}

/// Writes `budget`'s mirror if it is not current (server-side apply, forced: the operator owns every field of
/// a mirror). `Ok(false)`: nothing to write (current, or mirrors unavailable).
pub async fn ensure<K: MirrorOwner>(
    budget: &K,
    key: &ObjKey,
    mirrors: &Mirrors,
    client: Client,
    field_manager: &str,
) -> Result<bool, kube::Error> {
    let Some(copied) = Copied::of_budget(budget.meta()) else { return Ok(false) };
    if !mirrors.available() || mirrors.current(key, &copied) {
        return Ok(false);
    }
    let Some(mirror) = budget.mirror() else { return Ok(false) };
    let mut patch = serde_json::to_value(&mirror).map_err(kube::Error::SerdeError)?;
    patch["apiVersion"] = K::Mirror::api_version(&()).into();
    patch["kind"] = K::Mirror::kind(&()).into();
    let params = PatchParams::apply(field_manager).force();
    K::mirror_api(client, key).patch(&key.name, &params, &Patch::Apply(&patch)).await?;
    // The watch will show it; recording it now keeps a reconcile that runs before then from writing it again.
    mirrors.record(key.clone(), Some(copied));
    Ok(true)
}

/// Deletes the mirror of `key`, a budget just deleted, in the background (the garbage collector would too,
/// through the owner reference, but later and only where one runs). A mirror already gone is fine. It is
/// marked [`DELETED_ANNOTATION`] first, so that agents reading the mirrors forget the budget at once (a mirror
/// deleted without the mark leaves the budget in force on the nodes).
pub fn forget<K: MirrorOwner>(key: &ObjKey, mirrors: &Mirrors, client: Client) {
    if !mirrors.available() {
        return;
    }
    let (api, name) = (K::mirror_api(client, key), key.name.clone());
    tokio::spawn(async move {
        let mark = serde_json::json!({"metadata": {"annotations": {DELETED_ANNOTATION: "true"}}});
        match api.patch(&name, &PatchParams::default(), &Patch::Merge(&mark)).await {
            Ok(_) => {}
            Err(kube::Error::Api(e)) if e.code == 404 => return,
            Err(error) => tracing::debug!(%error, mirror = %name, "cannot mark a deleted budget's mirror; deleting it"),
        }
        match api.delete(&name, &kube::api::DeleteParams::default()).await {
            Ok(_) => {}
            Err(kube::Error::Api(e)) if e.code == 404 => {}
            Err(error) => {
                tracing::debug!(%error, mirror = %name, "cannot delete a deleted budget's mirror; the garbage collector will");
            }
        }
    });
}

/// Watches the metadata of `K`'s mirrors into `mirrors` until `shutdown`. `listed` is called once, at the
/// first list or at the first failure before one (the CRD missing: mirrors unavailable); `deleted` with the
/// key of each mirror deleted (its budget, if it still exists, is reconciled and writes it again).
pub async fn watch<K: MirrorOwner>(
    client: Client,
    mirrors: &Mirrors,
    shutdown: CancellationToken,
    mut listed: impl FnMut(),
    mut deleted: impl FnMut(ObjKey),
) {
    // Metadata only: what each mirror copies is in its owner reference and annotation.
    let api: Api<PartialObjectMeta<K::Mirror>> = Api::all(client);
    let mut stream = std::pin::pin!(
        watch_stream(api, watcher::Config::default().page_size(crate::namespaces::LIST_PAGE_SIZE)).default_backoff()
    );
    let kind = K::kind(&());
    let key = |meta: &PartialObjectMeta<K::Mirror>| {
        Some(ObjKey::new(meta.metadata.namespace.clone().unwrap_or_default(), meta.metadata.name.clone()?))
    };
    let mut once = Some(());
    let mut relist: Option<HashMap<ObjKey, Copied>> = None;
    loop {
        let next = tokio::select! {
            () = shutdown.cancelled() => return,
            next = stream.next() => next,
        };
        match next {
            None => return,
            Some(Err(error)) => {
                if once.take().is_some() {
                    tracing::warn!(%error, kind = %kind, "cannot watch budget mirrors (CRD not installed?): \
                        agents keep watching the budgets themselves; retrying");
                    listed();
                }
            }
            Some(Ok(Event::Init)) => relist = Some(HashMap::new()),
            Some(Ok(Event::InitApply(meta))) => {
                if let (Some(k), Some(c)) = (key(&meta), Copied::of_mirror(&meta.metadata, &kind)) {
                    relist.get_or_insert_with(HashMap::new).insert(k, c);
                }
            }
            Some(Ok(Event::InitDone)) => {
                let listed_now = relist.take().unwrap_or_default();
                *mirrors.copies.write().unwrap_or_else(PoisonError::into_inner) = listed_now;
                mirrors.available.store(true, Ordering::Release);
                if once.take().is_some() {
                    listed();
                }
            }
            Some(Ok(Event::Apply(meta))) => {
                if let Some(k) = key(&meta) {
                    mirrors.record(k, Copied::of_mirror(&meta.metadata, &kind));
                }
            }
            Some(Ok(Event::Delete(meta))) => {
                if let Some(k) = key(&meta) {
                    mirrors.record(k.clone(), None);
                    deleted(k);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn copied(uid: &str, generation: i64) -> Option<Copied> {
        Some(Copied { uid: uid.to_owned(), generation })
    }

    /// The budgets whose mirror does not copy them now, and since when: what the leader vouches by.
    #[tokio::test(start_paused = true)]
    async fn lagging_budgets_are_found_and_timed_from_when_they_first_lagged() {
        let mirrors = Mirrors::default();
        let (a, b) = (ObjKey::new("ns", "a"), ObjKey::new("ns", "b"));
        mirrors.budgets_begin();
        mirrors.budget(a.clone(), copied("ua", 1));
        mirrors.budget(b.clone(), copied("ub", 2));
        mirrors.budgets_end();
        mirrors.record(a.clone(), copied("ua", 1));
        mirrors.record(b.clone(), copied("ub", 1));
        assert_eq!(mirrors.lagging(), std::slice::from_ref(&b), "b's mirror copies generation 1 of 2");
        assert_eq!(mirrors.copied_generation(&b, "ub"), Some(1));
        assert_eq!(mirrors.copied_generation(&b, "another uid"), None, "a budget created again under its name");

        let mut lag = Lag::default();
        let start = tokio::time::Instant::now();
        assert_eq!(lag.update(mirrors.lagging(), start), Some((b.clone(), Duration::ZERO)));
        tokio::time::advance(Duration::from_secs(20)).await;
        // a edited too: b has lagged longest.
        mirrors.budget(a.clone(), copied("ua", 2));
        let now = tokio::time::Instant::now();
        assert_eq!(lag.update(mirrors.lagging(), now), Some((b.clone(), Duration::from_secs(20))));
        // b written: a alone lags, from when it began.
        mirrors.record(b.clone(), copied("ub", 2));
        tokio::time::advance(Duration::from_secs(15)).await;
        let now = tokio::time::Instant::now();
        assert_eq!(lag.update(mirrors.lagging(), now), Some((a.clone(), Duration::from_secs(15))));
        // A deleted budget lags no more.
        mirrors.budget(a, None);
        assert_eq!(lag.update(mirrors.lagging(), now), None);
    }
}
