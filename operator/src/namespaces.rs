//! The namespaces' labels, which a `ClusterGpuMemoryBudget`'s `namespaceSelector` reads (#23).
//!
//! - [`NamespaceLabels`]: a pure cache, namespace → labels, that says what each watch event changed
//!   ([`Relabel`]: the labels before and after). A namespace it does not know has no labels (only a
//!   `namespaceSelector` of `{}`, or one of `NotIn`/`DoesNotExist` alone, selects it then), as in the agent.
//! - [`events`]: the metadata-only watch of every Namespace (`Api<PartialObjectMeta<Namespace>>`, listed
//!   [`LIST_PAGE_SIZE`] a page), whose events [`NamespaceLabels::apply_event`] takes.
//!
//! Any part of the operator that selects by namespace labels keeps its own `NamespaceLabels` and feeds it
//! from one stream of [`events`]; the relabels it returns say which cluster-wide objects to look at again.

use std::collections::{BTreeMap, HashMap, HashSet};

use k8s_openapi::api::core::v1::Namespace;
use kube::core::PartialObjectMeta;
use kube::runtime::watcher::{self, Event};
use kube::runtime::{WatchStreamExt, watcher::watcher};
use kube::{Api, Client};

/// Namespaces are listed this many at a time (as the agent lists pods, budgets and namespaces).
pub const LIST_PAGE_SIZE: u32 = 100;

/// No labels: what an unknown namespace has.
static NO_LABELS: BTreeMap<String, String> = BTreeMap::new();

/// A namespace whose labels changed (it appeared, was relabelled or went): before and after.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Relabel {
    /// The namespace.
    pub namespace: String,
    /// Its labels before (empty: it was unknown).
    pub before: BTreeMap<String, String>,
    /// Its labels now (empty: it is gone).
    pub after: BTreeMap<String, String>,
}

/// The namespaces' labels, as the watch last said.
#[derive(Debug, Default)]
pub struct NamespaceLabels {
    labels: HashMap<String, BTreeMap<String, String>>,
    resync: Option<HashSet<String>>,
    listed: bool,
}

impl NamespaceLabels {
    /// An empty cache.
    pub fn new() -> Self {
        Self::default()
    }

    /// The labels of `namespace` (empty when unknown).
    pub fn get(&self, namespace: &str) -> &BTreeMap<String, String> {
        self.labels.get(namespace).unwrap_or(&NO_LABELS)
    }

    /// The namespaces known, with their labels.
    pub fn iter(&self) -> impl Iterator<Item = (&str, &BTreeMap<String, String>)> {
        self.labels.iter().map(|(name, labels)| (name.as_str(), labels))
    }

    /// Namespaces known.
    pub fn len(&self) -> usize {
        self.labels.len()
    }

    /// No namespace known.
    pub fn is_empty(&self) -> bool {
        self.labels.is_empty()
    }

    /// Whether the watch has listed every namespace once.
    pub fn listed(&self) -> bool {
        self.listed
    }

    /// A namespace was created or changed (or listed): its relabel, if its labels changed.
    pub fn apply(&mut self, namespace: &str, labels: BTreeMap<String, String>) -> Option<Relabel> {
        if let Some(seen) = self.resync.as_mut() {
            seen.insert(namespace.to_owned());
        }
        let before = self.labels.insert(namespace.to_owned(), labels.clone());
        match before {
            Some(before) if before == labels => None,
            before => {
                Some(Relabel { namespace: namespace.to_owned(), before: before.unwrap_or_default(), after: labels })
                    .filter(|r| r.before != r.after)
            }
        }
    }

    /// A namespace was deleted: its relabel (to no labels), if it had labels.
    pub fn delete(&mut self, namespace: &str) -> Option<Relabel> {
        let before = self.labels.remove(namespace)?;
        (!before.is_empty()).then(|| Relabel { namespace: namespace.to_owned(), before, after: BTreeMap::new() })
    }

    /// Applies one event of [`events`]; returns the relabels it made (a re-list ends with those of the
    /// namespaces it no longer lists).
    pub fn apply_event(&mut self, event: &Event<PartialObjectMeta<Namespace>>) -> Vec<Relabel> {
        match event {
            Event::Init => {
                self.resync = Some(HashSet::new());
                Vec::new()
            }
            Event::InitApply(ns) | Event::Apply(ns) => match &ns.metadata.name {
                Some(name) => self.apply(name, ns.metadata.labels.clone().unwrap_or_default()).into_iter().collect(),
                None => Vec::new(),
            },
            Event::Delete(ns) => ns.metadata.name.as_deref().and_then(|name| self.delete(name)).into_iter().collect(),
            Event::InitDone => {
                self.listed = true;
                let Some(seen) = self.resync.take() else { return Vec::new() };
                let gone: Vec<String> = self.labels.keys().filter(|n| !seen.contains(*n)).cloned().collect();
                gone.iter().filter_map(|name| self.delete(name)).collect()
            }
        }
    }
}

/// The metadata-only watch of every Namespace, listed [`LIST_PAGE_SIZE`] a page, retried with backoff.
pub fn events(
    client: Client,
) -> impl futures::Stream<Item = watcher::Result<Event<PartialObjectMeta<Namespace>>>> + Send {
    // `Api<PartialObjectMeta<_>>` asks for metadata only.
    let api: Api<PartialObjectMeta<Namespace>> = Api::all(client);
    watcher(api, watcher::Config::default().page_size(LIST_PAGE_SIZE)).default_backoff()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn labels(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned())).collect()
    }

    fn ns(name: &str, pairs: &[(&str, &str)]) -> PartialObjectMeta<Namespace> {
        let mut meta = PartialObjectMeta::<Namespace>::default();
        meta.metadata.name = Some(name.to_owned());
        meta.metadata.labels = Some(labels(pairs));
        meta
    }

    #[test]
    fn relabels_say_before_and_after_and_nothing_when_unchanged() {
        let mut cache = NamespaceLabels::new();
        assert!(cache.get("team-a").is_empty(), "unknown: no labels");
        let r = cache.apply_event(&Event::Apply(ns("team-a", &[("tier", "tenant")])));
        assert_eq!(
            r,
            [Relabel { namespace: "team-a".into(), before: labels(&[]), after: labels(&[("tier", "tenant")]) }]
        );
        assert!(cache.apply_event(&Event::Apply(ns("team-a", &[("tier", "tenant")]))).is_empty());
        assert!(cache.apply_event(&Event::Apply(ns("bare", &[]))).is_empty(), "no labels before or after");
        let r = cache.apply_event(&Event::Apply(ns("team-a", &[("tier", "system")])));
        assert_eq!((r[0].before.get("tier"), r[0].after.get("tier")), (Some(&"tenant".into()), Some(&"system".into())));
        assert_eq!(cache.get("team-a"), &labels(&[("tier", "system")]));
        let r = cache.apply_event(&Event::Delete(ns("team-a", &[])));
        assert_eq!(r[0].after, labels(&[]));
        assert_eq!(cache.len(), 1);
    }

    #[test]
    fn a_relist_forgets_the_namespaces_it_does_not_list() {
        let mut cache = NamespaceLabels::new();
        for event in [Event::Init, Event::InitApply(ns("a", &[("x", "1")])), Event::InitApply(ns("b", &[("x", "1")]))] {
            cache.apply_event(&event);
        }
        assert!(!cache.listed());
        assert!(cache.apply_event(&Event::InitDone).is_empty());
        assert!(cache.listed());
        cache.apply_event(&Event::Init);
        cache.apply_event(&Event::InitApply(ns("a", &[("x", "1")])));
        let gone = cache.apply_event(&Event::InitDone);
        assert_eq!(gone.iter().map(|r| r.namespace.as_str()).collect::<Vec<_>>(), ["b"]);
        assert_eq!(cache.get("b"), &labels(&[]));
    }
}
