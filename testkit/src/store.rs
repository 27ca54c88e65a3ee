//! The object store, its resourceVersion clock, the event history and the open watches.

use std::borrow::Cow;
use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use bytes::Bytes;
use futures::channel::mpsc::{UnboundedReceiver, UnboundedSender, unbounded};
use k8s_openapi::jiff::{SignedDuration, Timestamp};
use serde_json::{Value, json};

use crate::events;
use crate::object::{Gr, meta_str, partial};
use crate::select::{FieldSelector, LabelSelector};
use crate::table::Printer;
use crate::{EventSummary, RecordedRequest, Verb};

/// How many changes the history keeps for watches that resume from an older resourceVersion.
const HISTORY: usize = 10_000;

/// What the fake knows about a resource type.
#[derive(Debug, Clone)]
pub(crate) struct Info {
    pub(crate) api_version: String,
    pub(crate) kind: String,
    pub(crate) namespaced: bool,
    pub(crate) status: bool,
    /// What kubectl also accepts for the plural, space-separated (`crd crds`), as discovery lists it.
    pub(crate) short_names: &'static str,
}

/// Resources known from the start: (apiVersion, plural, kind, namespaced, status subresource, short names).
const KNOWN: &[(&str, &str, &str, bool, bool, &str)] = &[
    ("v1", "pods", "Pod", true, true, "po"),
    ("v1", "events", "Event", true, false, "ev"),
    ("v1", "nodes", "Node", false, true, "no"),
    ("v1", "namespaces", "Namespace", false, true, "ns"),
    ("v1", "configmaps", "ConfigMap", true, false, "cm"),
    ("v1", "secrets", "Secret", true, false, ""),
    ("v1", "services", "Service", true, true, "svc"),
    ("v1", "serviceaccounts", "ServiceAccount", true, false, "sa"),
    ("events.k8s.io/v1", "events", "Event", true, false, "ev"),
    ("coordination.k8s.io/v1", "leases", "Lease", true, false, ""),
    ("gpubudget.io/v1alpha1", "gpumemorybudgets", "GpuMemoryBudget", true, true, "gmb"),
    ("gpubudget.io/v1alpha1", "clustergpumemoryquotas", "ClusterGpuMemoryQuota", false, true, "cgmq"),
    ("apiextensions.k8s.io/v1", "customresourcedefinitions", "CustomResourceDefinition", false, true, "crd crds"),
    ("apps/v1", "deployments", "Deployment", true, true, "deploy"),
    ("apps/v1", "daemonsets", "DaemonSet", true, true, "ds"),
    ("apps/v1", "replicasets", "ReplicaSet", true, true, "rs"),
    ("apps/v1", "statefulsets", "StatefulSet", true, true, "sts"),
    ("policy/v1", "poddisruptionbudgets", "PodDisruptionBudget", true, true, "pdb"),
    ("scheduling.k8s.io/v1", "priorityclasses", "PriorityClass", false, false, "pc"),
    ("rbac.authorization.k8s.io/v1", "clusterroles", "ClusterRole", false, false, ""),
    ("rbac.authorization.k8s.io/v1", "clusterrolebindings", "ClusterRoleBinding", false, false, ""),
];

/// Groups served by Kubernetes itself; anything else is a custom resource (which always has a generation).
const BUILTIN_GROUPS: &[&str] = &[
    "",
    "apps",
    "batch",
    "policy",
    "autoscaling",
    "coordination.k8s.io",
    "events.k8s.io",
    "networking.k8s.io",
    "rbac.authorization.k8s.io",
    "storage.k8s.io",
    "scheduling.k8s.io",
    "discovery.k8s.io",
    "node.k8s.io",
    "apiextensions.k8s.io",
    "admissionregistration.k8s.io",
    "certificates.k8s.io",
    "resource.k8s.io",
];

pub(crate) fn group_of(api_version: &str) -> &str {
    api_version.split_once('/').map_or("", |(g, _)| g)
}

pub(crate) fn now() -> String {
    Timestamp::now().strftime("%Y-%m-%dT%H:%M:%SZ").to_string()
}

pub(crate) fn later(seconds: i64) -> String {
    let t = Timestamp::now().checked_add(SignedDuration::from_secs(seconds)).unwrap_or_else(|_| Timestamp::now());
    t.strftime("%Y-%m-%dT%H:%M:%SZ").to_string()
}

static UIDS: AtomicU64 = AtomicU64::new(1);

fn new_uid() -> String {
    let n = UIDS.fetch_add(1, Ordering::Relaxed);
    format!("{:08x}-7e57-4000-8000-{:012x}", std::process::id(), n)
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Change {
    Added,
    Modified,
    Deleted,
}

#[derive(Debug)]
struct HistoryEntry {
    rv: u64,
    gr: Gr,
    change: Change,
    object: Value,
    prev: Option<Value>,
}

/// What a watch asked for.
#[derive(Debug, Clone)]
pub(crate) struct WatchSpec {
    pub(crate) gr: Gr,
    pub(crate) namespace: Option<String>,
    pub(crate) labels: LabelSelector,
    pub(crate) fields: FieldSelector,
    pub(crate) meta_only: bool,
    pub(crate) bookmarks: bool,
    /// Objects sent as one-row `Table`s (`kubectl get -w`).
    pub(crate) table: Option<Printer>,
}

impl WatchSpec {
    pub(crate) fn matches(&self, object: &Value) -> bool {
        self.namespace.as_deref().is_none_or(|ns| meta_str(object, "namespace") == ns)
            && self.labels.matches(object)
            && self.fields.matches(object)
    }

    fn line(&self, kind: &str, object: &Value) -> Bytes {
        // An ERROR carries a Status, in every form of watch (a metadata-only watch included), as the API
        // server sends it.
        let object = match &self.table {
            _ if kind == "ERROR" => object.clone(),
            Some(printer) => printer.table([object], meta_str(object, "resourceVersion")),
            None if self.meta_only => partial(object),
            None => object.clone(),
        };
        let mut line = serde_json::to_vec(&json!({"type": kind, "object": object})).unwrap_or_default();
        line.push(b'\n');
        Bytes::from(line)
    }

    fn translate(&self, e: &HistoryEntry) -> Option<Bytes> {
        let (object, prev) = if e.gr == self.gr {
            (Cow::Borrowed(&e.object), e.prev.as_ref().map(Cow::Borrowed))
        } else if events::mirrored(&e.gr, &self.gr) {
            let convert = |o: &Value| Cow::Owned(events::convert(o, &self.gr));
            (convert(&e.object), e.prev.as_ref().map(convert))
        } else {
            return None;
        };
        let now = self.matches(&object);
        let kind = match e.change {
            Change::Added => now.then_some("ADDED")?,
            Change::Deleted => now.then_some("DELETED")?,
            Change::Modified => match (prev.is_some_and(|p| self.matches(&p)), now) {
                (true, true) => "MODIFIED",
                (false, true) => "ADDED",
                (true, false) => "DELETED",
                (false, false) => return None,
            },
        };
        Some(self.line(kind, &object))
    }
}

#[derive(Debug)]
struct OpenWatch {
    spec: WatchSpec,
    tx: UnboundedSender<Bytes>,
}

/// Whether evictions are refused with 429 as a PodDisruptionBudget would.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum EvictionBlock {
    Next(usize),
    Always,
}

#[derive(Debug, Clone)]
pub(crate) struct Fault {
    pub(crate) verb: Verb,
    pub(crate) resource: String,
    pub(crate) remaining: usize,
    pub(crate) code: u16,
}

#[derive(Debug)]
pub(crate) struct State {
    pub(crate) rv: u64,
    objects: BTreeMap<Gr, BTreeMap<(String, String), Value>>,
    history: VecDeque<HistoryEntry>,
    /// Watches may resume from this resourceVersion or a later one.
    oldest_rv: u64,
    watches: Vec<OpenWatch>,
    infos: HashMap<Gr, Info>,
    pub(crate) seq: u64,
    pub(crate) graceful_pods: bool,
    pub(crate) eviction_block: Option<EvictionBlock>,
    pub(crate) faults: Vec<Fault>,
    pub(crate) requests: Vec<RecordedRequest>,
    pub(crate) evictions: Vec<Value>,
    /// Warnings for the request being served (`Warning` headers).
    pub(crate) warnings: Vec<String>,
    pub(crate) latency: Duration,
    /// Requests being answered now, and the most at once since the last reset.
    pub(crate) in_flight: usize,
    pub(crate) max_in_flight: usize,
}

impl Default for State {
    fn default() -> Self {
        let infos = KNOWN
            .iter()
            .map(|&(av, plural, kind, namespaced, status, short_names)| {
                let info = Info { api_version: av.into(), kind: kind.into(), namespaced, status, short_names };
                (Gr::new(group_of(av), plural), info)
            })
            .collect();
        State {
            rv: 1,
            objects: BTreeMap::new(),
            history: VecDeque::new(),
            oldest_rv: 1,
            watches: Vec::new(),
            infos,
            seq: 0,
            graceful_pods: false,
            eviction_block: None,
            faults: Vec::new(),
            requests: Vec::new(),
            evictions: Vec::new(),
            warnings: Vec::new(),
            latency: Duration::ZERO,
            in_flight: 0,
            max_in_flight: 0,
        }
    }
}

impl State {
    pub(crate) fn info(&self, gr: &Gr) -> Option<&Info> {
        self.infos.get(gr)
    }

    /// Every resource type the fake knows (built in, or learned from an object).
    pub(crate) fn infos(&self) -> impl Iterator<Item = (&Gr, &Info)> {
        self.infos.iter()
    }

    /// The stored CRD that defines a resource (the real server serves a custom resource from its CRD).
    pub(crate) fn crd(&self, gr: &Gr) -> Option<&Value> {
        self.list(&Gr::new("apiextensions.k8s.io", "customresourcedefinitions"), None).into_iter().find(|crd| {
            crd["spec"]["group"] == gr.group.as_str() && crd["spec"]["names"]["plural"] == gr.plural.as_str()
        })
    }

    /// One version of a stored CRD (`spec.versions[]` whose `name` is `version`).
    pub(crate) fn crd_version(&self, gr: &Gr, version: &str) -> Option<&Value> {
        self.crd(gr)?["spec"]["versions"].as_array()?.iter().find(|v| v["name"] == version)
    }

    /// Whether the resource has a status subresource: registered so, or its stored CRD says so.
    pub(crate) fn has_status(&self, gr: &Gr) -> bool {
        self.infos.get(gr).is_some_and(|i| i.status)
            || self.crd(gr).is_some_and(|crd| {
                crd["spec"]["versions"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .any(|v| v["subresources"]["status"].is_object())
            })
    }

    /// The `Table` a list of `resource` answers at the version the fake knows it by (see [`FakeApi::table`]).
    ///
    /// [`FakeApi::table`]: crate::FakeApi::table
    pub(crate) fn table(&self, resource: &str, namespace: Option<&str>) -> Value {
        let gr = self.resolve(resource);
        let api_version = self.info(&gr).map(|i| i.api_version.as_str()).unwrap_or_default();
        let version = api_version.rsplit('/').next().unwrap_or_default();
        let objects = self.served(&gr, namespace);
        self.printer(&gr, version, None).table(objects.iter().map(|o| &**o), &self.rv.to_string())
    }

    /// Applies the `default`s of the stored CRD's schema for the object's version, as the API server does
    /// for the custom resources it serves; nothing for resources without a stored CRD.
    pub(crate) fn default_fields(&self, gr: &Gr, object: &mut Value) {
        let version = object["apiVersion"].as_str().map(|av| av.rsplit('/').next().unwrap_or(av).to_owned());
        let schema = version.and_then(|v| self.crd_version(gr, &v)).map(|v| &v["schema"]["openAPIV3Schema"]);
        if let Some(schema) = schema.filter(|s| s.is_object()) {
            crate::defaults::apply(schema, object);
        }
    }

    /// The printer for a resource at an API version (a stored CRD's `additionalPrinterColumns` for it);
    /// `include_object` is the request's `includeObject`.
    pub(crate) fn printer(&self, gr: &Gr, version: &str, include_object: Option<&str>) -> Printer {
        let columns = self.crd_version(gr, version).and_then(|v| v["additionalPrinterColumns"].as_array());
        Printer::new(gr, include_object, columns.filter(|c| !c.is_empty()).cloned())
    }

    pub(crate) fn set_status_subresource(&mut self, gr: Gr) {
        let info = self.infos.entry(gr).or_insert_with(|| Info {
            api_version: String::new(),
            kind: String::new(),
            namespaced: true,
            status: false,
            short_names: "",
        });
        info.status = true;
    }

    /// Learns a resource's apiVersion and kind from an object written through the API.
    pub(crate) fn learn(&mut self, gr: &Gr, object: &Value, namespaced: bool) {
        let (av, kind) = (object["apiVersion"].as_str(), object["kind"].as_str());
        let info = self.infos.entry(gr.clone()).or_insert_with(|| Info {
            api_version: String::new(),
            kind: String::new(),
            namespaced,
            status: false,
            short_names: "",
        });
        if let (Some(av), Some(kind), true) = (av, kind, info.kind.is_empty()) {
            info.api_version = av.to_owned();
            info.kind = kind.to_owned();
            // Registered before its kind was known (`with_status_subresource`): the scope is learned now.
            info.namespaced = namespaced;
        }
    }

    /// Generation is tracked for resources with a status subresource and for all custom resources.
    pub(crate) fn tracks_generation(&self, gr: &Gr) -> bool {
        self.has_status(gr) || !BUILTIN_GROUPS.contains(&gr.group.as_str())
    }

    /// Resolves `plural`, `plural.group` (as kubectl spells it) to a resource. An unqualified plural is the
    /// core group's if there is one, otherwise the first group that has it.
    pub(crate) fn resolve(&self, resource: &str) -> Gr {
        if let Some((plural, group)) = resource.split_once('.') {
            return Gr::new(group, plural);
        }
        let mut groups: Vec<&Gr> =
            self.infos.keys().chain(self.objects.keys()).filter(|gr| gr.plural == resource).collect();
        groups.sort();
        groups.first().map_or_else(|| Gr::new("", resource), |gr| (*gr).clone())
    }

    /// The resource for an object's apiVersion and kind, and whether it is namespaced: a stored CRD's
    /// plural and scope (as the real server, which serves a custom resource from its CRD), else known kinds,
    /// else the lower-case plural of the kind, namespaced.
    pub(crate) fn resource_for(&self, api_version: &str, kind: &str) -> (Gr, bool) {
        let group = group_of(api_version);
        let crds = self.list(&Gr::new("apiextensions.k8s.io", "customresourcedefinitions"), None);
        if let Some(spec) =
            crds.iter().map(|crd| &crd["spec"]).find(|s| s["group"] == group && s["names"]["kind"] == kind)
            && let Some(plural) = spec["names"]["plural"].as_str()
        {
            return (Gr::new(group, plural), spec["scope"] != "Cluster");
        }
        if let Some((gr, info)) = self.infos.iter().find(|(gr, i)| gr.group == group && i.kind == kind) {
            return (gr.clone(), info.namespaced);
        }
        let lower = kind.to_lowercase();
        let plural = if lower.ends_with('s') || lower.ends_with("ch") || lower.ends_with('x') {
            format!("{lower}es")
        } else if let Some(stem) = lower.strip_suffix('y').filter(|s| !s.ends_with(['a', 'e', 'o', 'u'])) {
            format!("{stem}ies")
        } else {
            format!("{lower}s")
        };
        (Gr::new(group, &plural), true)
    }

    pub(crate) fn get(&self, gr: &Gr, ns: &str, name: &str) -> Option<&Value> {
        self.objects.get(gr)?.get(&(ns.to_owned(), name.to_owned()))
    }

    pub(crate) fn list(&self, gr: &Gr, ns: Option<&str>) -> Vec<&Value> {
        let Some(map) = self.objects.get(gr) else { return Vec::new() };
        map.iter().filter(|((o_ns, _), _)| ns.is_none_or(|ns| ns == o_ns)).map(|(_, v)| v).collect()
    }

    /// Objects as the API serves them, ordered by namespace and name: for the two Events APIs, those of
    /// both (the other's converted), since the real server keeps them in one storage.
    pub(crate) fn served(&self, gr: &Gr, ns: Option<&str>) -> Vec<Cow<'_, Value>> {
        let mut out: Vec<Cow<'_, Value>> = self.list(gr, ns).into_iter().map(Cow::Borrowed).collect();
        if let Some(other) = events::mirror(gr) {
            out.extend(self.list(&other, ns).into_iter().map(|o| Cow::Owned(events::convert(o, gr))));
            fn key(o: &Value) -> (&str, &str) {
                (meta_str(o, "namespace"), meta_str(o, "name"))
            }
            out.sort_by(|a, b| key(a).cmp(&key(b)));
            out.dedup_by(|a, b| key(a) == key(b));
        }
        out
    }

    /// One object as the API serves it (see [`served`](Self::served)).
    pub(crate) fn served_one(&self, gr: &Gr, ns: &str, name: &str) -> Option<Cow<'_, Value>> {
        self.get(gr, ns, name).map(Cow::Borrowed).or_else(|| {
            let other = events::mirror(gr)?;
            self.get(&other, ns, name).map(|o| Cow::Owned(events::convert(o, gr)))
        })
    }

    /// Stores a change under a new resourceVersion, records it and tells the watches.
    pub(crate) fn commit(&mut self, gr: &Gr, mut object: Value, change: Change) -> Value {
        self.rv += 1;
        object["metadata"]["resourceVersion"] = Value::String(self.rv.to_string());
        let key = (meta_str(&object, "namespace").to_owned(), meta_str(&object, "name").to_owned());
        let map = self.objects.entry(gr.clone()).or_default();
        let prev = match change {
            Change::Deleted => map.remove(&key),
            _ => map.insert(key, object.clone()),
        };
        let entry = HistoryEntry { rv: self.rv, gr: gr.clone(), change, object: object.clone(), prev };
        self.watches.retain(|w| w.spec.translate(&entry).is_none_or(|line| w.tx.unbounded_send(line).is_ok()));
        self.history.push_back(entry);
        if self.history.len() > HISTORY
            && let Some(old) = self.history.pop_front()
        {
            self.oldest_rv = old.rv;
        }
        object
    }

    /// Creates a new object: its CRD's schema defaults, uid, creationTimestamp, generation; keeps what else the
    /// caller set.
    pub(crate) fn insert_new(&mut self, gr: &Gr, mut object: Value) -> Value {
        self.default_fields(gr, &mut object);
        let meta = &mut object["metadata"];
        meta["uid"] = Value::String(new_uid());
        meta["creationTimestamp"] = Value::String(now());
        if self.tracks_generation(gr) {
            meta["generation"] = json!(1);
        } else if let Some(m) = meta.as_object_mut() {
            m.remove("generation");
        }
        self.commit(gr, object, Change::Added)
    }

    /// Writes `new` over `live`: its CRD's schema defaults applied, identity metadata carried over, generation
    /// bumped when anything outside metadata (and status, when it is a subresource) changed; an unchanged
    /// object is not written; a terminating object whose finalizers are all gone is removed.
    pub(crate) fn update(&mut self, gr: &Gr, live: &Value, mut new: Value, dry_run: bool) -> Value {
        self.default_fields(gr, &mut new);
        for key in ["uid", "creationTimestamp", "deletionTimestamp", "deletionGracePeriodSeconds", "namespace", "name"]
        {
            match live["metadata"].get(key) {
                Some(v) => new["metadata"][key] = v.clone(),
                None => _ = new["metadata"].as_object_mut().map(|m| m.remove(key)),
            }
        }
        new["metadata"]["resourceVersion"] = live["metadata"]["resourceVersion"].clone();
        if let Some(generation) = live["metadata"]["generation"].as_i64() {
            let strip = |v: &Value| {
                let mut v = v.clone();
                if let Some(m) = v.as_object_mut() {
                    m.remove("metadata");
                    if self.has_status(gr) {
                        m.remove("status");
                    }
                }
                v
            };
            let bump = i64::from(strip(live) != strip(&new));
            new["metadata"]["generation"] = json!(generation + bump);
        }
        if without_times(&new) == without_times(live) || dry_run {
            return if dry_run { new } else { live.clone() };
        }
        let finalized = !new["metadata"]["deletionTimestamp"].is_null()
            && new["metadata"]["finalizers"].as_array().is_none_or(Vec::is_empty);
        if finalized && (gr.plural != "pods" || new["metadata"]["deletionGracePeriodSeconds"].as_i64() == Some(0)) {
            return self.commit(gr, new, Change::Deleted);
        }
        self.commit(gr, new, Change::Modified)
    }

    /// Marks an object as terminating (deletionTimestamp, grace period, generation bump).
    pub(crate) fn mark_terminating(&mut self, gr: &Gr, live: &Value, grace: i64) -> Value {
        let mut new = live.clone();
        new["metadata"]["deletionTimestamp"] = Value::String(later(grace));
        new["metadata"]["deletionGracePeriodSeconds"] = json!(grace);
        if let Some(g) = live["metadata"]["generation"].as_i64() {
            new["metadata"]["generation"] = json!(g + 1);
        }
        self.commit(gr, new, Change::Modified)
    }

    pub(crate) fn new_name_suffix(&mut self) -> String {
        const ALPHABET: &[u8] = b"bcdfghjklmnpqrstvwxz2456789";
        self.seq += 1;
        let mut n = self.seq + 7_777;
        (0..5)
            .map(|_| {
                let c = ALPHABET[(n % ALPHABET.len() as u64) as usize] as char;
                n /= ALPHABET.len() as u64;
                c
            })
            .collect()
    }

    /// Opens a watch at `resource_version`: replays history after it (or synthesises ADDED events for
    /// the current state for "" and "0", or with `sendInitialEvents`), then streams live changes.
    /// A resourceVersion older than the history gives a 410 `Expired` ERROR event, as the real server does.
    pub(crate) fn open_watch(&mut self, spec: WatchSpec, rv: &str, initial_events: bool) -> UnboundedReceiver<Bytes> {
        let (tx, rx) = unbounded();
        let send = |line: Bytes| _ = tx.unbounded_send(line);
        if rv.is_empty() || rv == "0" || initial_events {
            for object in self.served(&spec.gr, spec.namespace.as_deref()) {
                if spec.matches(&object) {
                    send(spec.line("ADDED", &object));
                }
            }
            if initial_events && spec.bookmarks {
                send(self.bookmark(&spec, true));
            }
        } else {
            let from = rv.parse::<u64>().unwrap_or(0);
            if from < self.oldest_rv {
                let status = json!({
                    "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure", "code": 410,
                    "reason": "Expired", "message": format!("too old resource version: {rv} ({})", self.oldest_rv),
                });
                send(spec.line("ERROR", &status));
                return rx;
            }
            for e in self.history.iter().filter(|e| e.rv > from) {
                if let Some(line) = spec.translate(e) {
                    send(line);
                }
            }
        }
        self.watches.push(OpenWatch { spec, tx });
        rx
    }

    fn bookmark(&self, spec: &WatchSpec, initial_end: bool) -> Bytes {
        let (av, kind) = match (spec.meta_only, self.infos.get(&spec.gr)) {
            (true, _) | (_, None) => ("meta.k8s.io/v1".to_owned(), "PartialObjectMetadata".to_owned()),
            (false, Some(i)) => (i.api_version.clone(), i.kind.clone()),
        };
        let mut metadata = json!({"resourceVersion": self.rv.to_string()});
        if initial_end {
            metadata["annotations"] = json!({"k8s.io/initial-events-end": "true"});
        }
        let spec = WatchSpec { meta_only: false, table: None, ..spec.clone() };
        spec.line("BOOKMARK", &json!({"apiVersion": av, "kind": kind, "metadata": metadata}))
    }

    pub(crate) fn send_bookmarks(&mut self) {
        let lines: Vec<_> =
            self.watches.iter().map(|w| w.spec.bookmarks.then(|| self.bookmark(&w.spec, false))).collect();
        let mut lines = lines.into_iter();
        self.watches.retain(|w| lines.next().flatten().is_none_or(|line| w.tx.unbounded_send(line).is_ok()));
    }

    pub(crate) fn disconnect_watches(&mut self) {
        self.watches.clear();
    }

    pub(crate) fn open_watches(&mut self) -> usize {
        self.watches.retain(|w| !w.tx.is_closed());
        self.watches.len()
    }

    /// Open watches on `gr`, as whether each asks for metadata only.
    pub(crate) fn open_watches_on(&mut self, gr: &Gr) -> Vec<bool> {
        self.watches.retain(|w| !w.tx.is_closed());
        self.watches.iter().filter(|w| w.spec.gr == *gr).map(|w| w.spec.meta_only).collect()
    }

    pub(crate) fn compact_history(&mut self) {
        self.history.clear();
        self.oldest_rv = self.rv;
    }

    /// Events of both APIs about one pod, oldest first.
    pub(crate) fn events_for(&self, namespace: &str, pod: &str) -> Vec<EventSummary> {
        let s = |v: &Value| v.as_str().unwrap_or_default().to_owned();
        let mut out: Vec<(String, EventSummary)> = Vec::new();
        for e in self.list(&Gr::new("", "events"), Some(namespace)) {
            let about = &e["involvedObject"];
            if about["name"] == pod && about["kind"].as_str().is_none_or(|k| k == "Pod") {
                let when = [&e["eventTime"], &e["firstTimestamp"], &e["metadata"]["creationTimestamp"]]
                    .into_iter()
                    .find_map(|t| t.as_str())
                    .unwrap_or_default();
                let summary = EventSummary {
                    api_version: "v1".into(),
                    type_: s(&e["type"]),
                    reason: s(&e["reason"]),
                    message: s(&e["message"]),
                    action: s(&e["action"]),
                    reporting_controller: s(if e["reportingComponent"].is_string() {
                        &e["reportingComponent"]
                    } else {
                        &e["source"]["component"]
                    }),
                    reporting_instance: s(&e["reportingInstance"]),
                    count: e["count"].as_i64().unwrap_or(1),
                };
                out.push((when.to_owned(), summary));
            }
        }
        for e in self.list(&Gr::new("events.k8s.io", "events"), Some(namespace)) {
            let about = &e["regarding"];
            if about["name"] == pod && about["kind"].as_str().is_none_or(|k| k == "Pod") {
                let when = [&e["eventTime"], &e["metadata"]["creationTimestamp"]].into_iter().find_map(|t| t.as_str());
                let summary = EventSummary {
                    api_version: "events.k8s.io/v1".into(),
                    type_: s(&e["type"]),
                    reason: s(&e["reason"]),
                    message: s(&e["note"]),
                    action: s(&e["action"]),
                    reporting_controller: s(&e["reportingController"]),
                    reporting_instance: s(&e["reportingInstance"]),
                    count: e["series"]["count"].as_i64().unwrap_or(1),
                };
                out.push((when.unwrap_or_default().to_owned(), summary));
            }
        }
        out.sort_by(|a, b| a.0.cmp(&b.0));
        out.into_iter().map(|(_, e)| e).collect()
    }
}

/// An object with the volatile parts removed, to tell whether a write changes anything.
fn without_times(v: &Value) -> Value {
    let mut v = v.clone();
    if let Some(entries) = v["metadata"]["managedFields"].as_array_mut() {
        for e in entries {
            if let Some(e) = e.as_object_mut() {
                e.remove("time");
            }
        }
    }
    v
}
