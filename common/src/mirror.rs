//! Budget mirrors (#34): the spec of each budget, copied by the operator into an object that nothing else
//! writes, so that agents can watch specs without receiving the operator's status writes.
//!
//! A budget's status moves with usage (the operator rewrites it); its spec moves when a person edits it. Every
//! agent needs every spec and no status, but a watch of the budgets delivers each status write to each agent
//! (even a metadata-only watch: one event per write). The operator therefore keeps one mirror per budget, of the
//! same name (and namespace): `spec.budget` is the budget's spec, the controller owner reference names the
//! budget and its UID (so the mirror goes with the budget), and [`GENERATION_ANNOTATION`] the budget's
//! `metadata.generation` it was copied at. A mirror is written only when that generation or UID moves, so a
//! status write costs an agent nothing.
//!
//! The agent watches the budgets (metadata only) until every budget it sees has a current mirror, then the
//! mirrors alone ([`covers`]); until then, and where no operator writes mirrors (an older one, or the CRDs not
//! installed), it behaves as before.

use std::collections::HashMap;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference};
use kube::{CustomResource, Resource};
use serde::{Deserialize, Serialize};

use crate::crd::{ClusterGpuMemoryBudget, ClusterGpuMemoryBudgetSpec, GpuMemoryBudget, GpuMemoryBudgetSpec};

/// The budget's `metadata.generation` a mirror was copied at.
pub const GENERATION_ANNOTATION: &str = "gpubudget.io/budget-generation";

/// Set by the operator on a mirror just before it deletes it because its budget was deleted: an agent reading
/// the mirrors then forgets the budget. A mirror deleted without it (by hand, or by the garbage collector)
/// leaves the budget's spec in force on the nodes, which read the budgets themselves again if its mirror does
/// not come back within [`MISSING_BOUND`].
pub const DELETED_ANNOTATION: &str = "gpubudget.io/budget-deleted";

/// How long the operator renews the mirrors' Lease for ([`Vouch`]): an agent reads the mirrors only while the
/// Lease was renewed within this many seconds, as the agent's own clock measures it.
pub const VOUCH_SECONDS: u64 = 30;
/// How often the operator's leader renews the mirrors' Lease while it vouches for them.
pub const VOUCH_RENEW: std::time::Duration = std::time::Duration::from_secs(10);
/// How long a budget may go without a current mirror (created, edited, or its mirror deleted) before the
/// operator stops vouching for the mirrors; and how long an agent keeps a budget whose mirror was deleted
/// without [`DELETED_ANNOTATION`] before it reads the budgets themselves again.
pub const MISSING_BOUND: std::time::Duration = std::time::Duration::from_secs(30);

/// An agent's view of the mirrors' Lease, by which the operator vouches that every budget has a current mirror
/// (pure: the agent's clock in milliseconds is an argument). The Lease counts only while it moves: its
/// `renewTime` is compared with the last one seen, never with this node's wall clock, so skew between the
/// operator's node and this one cannot make stale mirrors look current. A Lease seen for the first time, or
/// unchanged for its `leaseDurationSeconds` (at most [`VOUCH_SECONDS`] × 2), or gone, vouches for nothing.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Vouch {
    /// The last `renewTime` seen, when this agent first saw it (ms), and the lease's duration (ms).
    last: Option<(String, u64, u64)>,
    /// The renewal before it was seen: the Lease has moved at least once under this agent's eyes.
    moved: bool,
}

impl Vouch {
    /// What one read of the Lease showed at `now_ms`: its `renewTime` (as written) and `leaseDurationSeconds`,
    /// or `None` when it is absent.
    pub fn observe(&mut self, lease: Option<(&str, u64)>, now_ms: u64) {
        let Some((renewed, seconds)) = lease else {
            *self = Self::default();
            return;
        };
        let duration_ms = seconds.clamp(1, VOUCH_SECONDS * 2) * 1000;
        match &mut self.last {
            Some((seen, _, duration)) if seen == renewed => *duration = duration_ms,
            Some(last) => {
                *last = (renewed.to_owned(), now_ms, duration_ms);
                self.moved = true;
            }
            None => self.last = Some((renewed.to_owned(), now_ms, duration_ms)),
        }
    }

    /// Whether the operator vouches for the mirrors at `now_ms`: the Lease was renewed under this agent's eyes
    /// within its duration.
    pub fn fresh(&self, now_ms: u64) -> bool {
        self.moved && self.last.as_ref().is_some_and(|(_, since, duration)| now_ms.saturating_sub(*since) < *duration)
    }

    /// Why the mirrors are not vouched for at `now_ms`, for messages (`None` when they are).
    pub fn why_not(&self, now_ms: u64) -> Option<String> {
        match &self.last {
            _ if self.fresh(now_ms) => None,
            None => Some(
                "the operator's mirrors Lease is absent (mirrors off, or not every budget has a current \
                           mirror)"
                    .to_owned(),
            ),
            Some(_) if !self.moved => Some(
                "the operator's mirrors Lease has not been renewed since this agent \
                                            first read it"
                    .to_owned(),
            ),
            Some((_, since, _)) => Some(format!(
                "the operator's mirrors Lease was last renewed {}s ago (operator down, or a mirror write failing)",
                now_ms.saturating_sub(*since) / 1000
            )),
        }
    }
}
/// The operator's copy of a `GpuMemoryBudget`'s spec, for the gpubudget agents: same name and namespace,
/// owned by the budget. Written by the operator only, rewritten when the budget's spec changes: do not edit (the
/// agents enforce what a mirror says until then).
#[derive(CustomResource, Serialize, Deserialize, Clone, Debug, PartialEq, schemars::JsonSchema)]
#[kube(
    group = "gpubudget.io",
    version = "v1alpha1",
    kind = "GpuMemoryBudgetMirror",
    plural = "gpumemorybudgetmirrors",
    singular = "gpumemorybudgetmirror",
    shortname = "gmbmirror",
    doc = "The gpubudget operator's copy of a GpuMemoryBudget's spec, read by the gpubudget agents so that the budget's status writes never reach them. Same name and namespace as the budget, owned by it, rewritten only when its spec changes. Written by the operator only: do not edit (the agents enforce what it says until the budget's spec changes).",
    namespaced,
    derive = "PartialEq",
    printcolumn = r#"{"name":"Generation","type":"string","jsonPath":".metadata.annotations.gpubudget\\.io/budget-generation","description":"The budget's metadata.generation this copy was made at"}"#,
    printcolumn = r#"{"name":"Age","type":"date","jsonPath":".metadata.creationTimestamp"}"#
)]
pub struct GpuMemoryBudgetMirrorSpec {
    /// The budget's spec, as it was at the generation in the `gpubudget.io/budget-generation` annotation.
    pub budget: GpuMemoryBudgetSpec,
}

/// The operator's copy of a `ClusterGpuMemoryBudget`'s spec, for the gpubudget agents: same name, owned by the
/// budget. Written by the operator only, rewritten when the budget's spec changes: do not edit (the agents enforce
/// what a mirror says until then).
#[derive(CustomResource, Serialize, Deserialize, Clone, Debug, PartialEq, schemars::JsonSchema)]
#[kube(
    group = "gpubudget.io",
    version = "v1alpha1",
    kind = "ClusterGpuMemoryBudgetMirror",
    plural = "clustergpumemorybudgetmirrors",
    singular = "clustergpumemorybudgetmirror",
    shortname = "cgmbmirror",
    doc = "The gpubudget operator's copy of a ClusterGpuMemoryBudget's spec, read by the gpubudget agents so that the budget's status writes never reach them. Same name as the budget, owned by it, rewritten only when its spec changes. Written by the operator only: do not edit (the agents enforce what it says until the budget's spec changes).",
    derive = "PartialEq",
    printcolumn = r#"{"name":"Generation","type":"string","jsonPath":".metadata.annotations.gpubudget\\.io/budget-generation","description":"The budget's metadata.generation this copy was made at"}"#,
    printcolumn = r#"{"name":"Age","type":"date","jsonPath":".metadata.creationTimestamp"}"#
)]
pub struct ClusterGpuMemoryBudgetMirrorSpec {
    /// The budget's spec, as it was at the generation in the `gpubudget.io/budget-generation` annotation.
    pub budget: ClusterGpuMemoryBudgetSpec,
}

/// Which budget, at which spec: its UID and `metadata.generation`.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Copied {
    /// The budget's `metadata.uid` (a budget deleted and created again under its name is another).
    pub uid: String,
    /// The budget's `metadata.generation`.
    pub generation: i64,
}

impl Copied {
    /// What a budget's metadata says (`None` without a UID or generation: nothing to compare a copy with).
    pub fn of_budget(meta: &ObjectMeta) -> Option<Self> {
        Some(Self { uid: meta.uid.clone().filter(|u| !u.is_empty())?, generation: meta.generation? })
    }

    /// What a mirror's metadata says it copies: its controller owner's UID (of kind `owner_kind`) and the
    /// generation annotation. `None` when either is missing or malformed: such a mirror copies nothing.
    pub fn of_mirror(meta: &ObjectMeta, owner_kind: &str) -> Option<Self> {
        let owner =
            meta.owner_references.as_ref()?.iter().find(|o| o.controller == Some(true) && o.kind == owner_kind)?;
        let generation = meta.annotations.as_ref()?.get(GENERATION_ANNOTATION)?.parse().ok()?;
        (!owner.uid.is_empty()).then(|| Self { uid: owner.uid.clone(), generation })
    }
}

/// A budget kind and its mirror: how one is made from the other.
pub trait Mirrored: Resource<DynamicType = ()> + Clone + Sized {
    /// The mirror kind.
    type Mirror: Resource<DynamicType = ()> + Clone;

    /// The mirror of this budget (`None` without a name, UID or generation).
    fn mirror(&self) -> Option<Self::Mirror>;

    /// The budget as a mirror tells it: name, namespace, UID and generation of the budget, its spec, no status
    /// (`None` when the mirror names no budget: see [`Copied::of_mirror`]).
    fn from_mirror(mirror: &Self::Mirror) -> Option<Self>;
}

/// The metadata of the mirror of the budget described by `meta` (`None` without a name, UID or generation).
fn mirror_meta<K: Resource<DynamicType = ()>>(meta: &ObjectMeta) -> Option<ObjectMeta> {
    let copied = Copied::of_budget(meta)?;
    let name = meta.name.clone().filter(|n| !n.is_empty())?;
    Some(ObjectMeta {
        name: Some(name.clone()),
        namespace: meta.namespace.clone(),
        annotations: Some([(GENERATION_ANNOTATION.to_owned(), copied.generation.to_string())].into()),
        owner_references: Some(vec![OwnerReference {
            api_version: K::api_version(&()).into_owned(),
            kind: K::kind(&()).into_owned(),
            name,
            uid: copied.uid,
            controller: Some(true),
            block_owner_deletion: None,
        }]),
        ..ObjectMeta::default()
    })
}

/// The budget's metadata as a mirror tells it.
fn budget_meta<K: Resource<DynamicType = ()>>(mirror: &ObjectMeta) -> Option<ObjectMeta> {
    let copied = Copied::of_mirror(mirror, &K::kind(&()))?;
    Some(ObjectMeta {
        name: mirror.name.clone(),
        namespace: mirror.namespace.clone(),
        uid: Some(copied.uid),
        generation: Some(copied.generation),
        ..ObjectMeta::default()
    })
}

impl Mirrored for GpuMemoryBudget {
    type Mirror = GpuMemoryBudgetMirror;

    fn mirror(&self) -> Option<GpuMemoryBudgetMirror> {
        let metadata = mirror_meta::<Self>(&self.metadata)?;
        Some(GpuMemoryBudgetMirror { metadata, spec: GpuMemoryBudgetMirrorSpec { budget: self.spec.clone() } })
    }

    fn from_mirror(mirror: &GpuMemoryBudgetMirror) -> Option<Self> {
        Some(Self { metadata: budget_meta::<Self>(&mirror.metadata)?, spec: mirror.spec.budget.clone(), status: None })
    }
}

impl Mirrored for ClusterGpuMemoryBudget {
    type Mirror = ClusterGpuMemoryBudgetMirror;

    fn mirror(&self) -> Option<ClusterGpuMemoryBudgetMirror> {
        let metadata = mirror_meta::<Self>(&self.metadata)?;
        Some(ClusterGpuMemoryBudgetMirror {
            metadata,
            spec: ClusterGpuMemoryBudgetMirrorSpec { budget: self.spec.clone() },
        })
    }

    fn from_mirror(mirror: &ClusterGpuMemoryBudgetMirror) -> Option<Self> {
        Some(Self { metadata: budget_meta::<Self>(&mirror.metadata)?, spec: mirror.spec.budget.clone(), status: None })
    }
}

/// A budget's namespace (empty for a cluster budget) and name.
pub type Key = (String, String);

/// Whether the mirrors cover the budgets: every budget has a mirror of its UID at its generation. Mirrors of
/// budgets not listed (deleted, waiting for the garbage collector) do not matter: a mirror's owner is gone, the
/// agent never sees a budget twice. Linear in the budgets.
pub fn covers(budgets: &HashMap<Key, Copied>, mirrors: &HashMap<Key, Copied>) -> bool {
    budgets.iter().all(|(key, copied)| mirrors.get(key) == Some(copied))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn budget(yaml: &str) -> GpuMemoryBudget {
        serde_yaml::from_str(yaml).expect("budget")
    }

    const LLM: &str = "
apiVersion: gpubudget.io/v1alpha1
kind: GpuMemoryBudget
metadata: {name: llm, namespace: team-a, uid: u-1, generation: 3, labels: {x: y}, resourceVersion: '42'}
spec: {selector: {matchLabels: {app: llm}}, limit: 8Gi, action: Evict}
status: {matchedPods: 4}
";

    #[test]
    fn a_mirror_copies_the_spec_and_names_its_budget_and_generation() {
        let b = budget(LLM);
        let m = b.mirror().expect("mirror");
        assert_eq!(m.metadata.name.as_deref(), Some("llm"));
        assert_eq!(m.metadata.namespace.as_deref(), Some("team-a"));
        assert_eq!(
            m.metadata.annotations.as_ref().and_then(|a| a.get(GENERATION_ANNOTATION)).map(String::as_str),
            Some("3")
        );
        let owner = &m.metadata.owner_references.as_ref().expect("owner")[0];
        assert_eq!((owner.kind.as_str(), owner.uid.as_str(), owner.controller), ("GpuMemoryBudget", "u-1", Some(true)));
        assert_eq!(owner.api_version, "gpubudget.io/v1alpha1");
        assert_eq!(m.spec.budget, b.spec);
        // Nothing of the budget's own metadata (labels, resourceVersion) and no status travels.
        assert!(m.metadata.labels.is_none() && m.metadata.resource_version.is_none());

        let back = GpuMemoryBudget::from_mirror(&m).expect("budget");
        assert_eq!(back.spec, b.spec);
        assert_eq!(back.status, None);
        assert_eq!(Copied::of_budget(&back.metadata), Copied::of_budget(&b.metadata));
        assert_eq!((back.metadata.name, back.metadata.namespace), (b.metadata.name, b.metadata.namespace));
    }

    #[test]
    fn a_cluster_mirror_is_cluster_scoped_and_owned_by_the_cluster_budget() {
        let b: ClusterGpuMemoryBudget = serde_yaml::from_str(
            "metadata: {name: admin, uid: c-1, generation: 1}\n\
             spec: {namespaceSelector: {matchLabels: {t: gpu}}, selector: {}, limit: 20Gi}",
        )
        .expect("cluster budget");
        let m = b.mirror().expect("mirror");
        assert_eq!(m.metadata.namespace, None);
        assert_eq!(m.metadata.owner_references.as_ref().expect("owner")[0].kind, "ClusterGpuMemoryBudget");
        let back = ClusterGpuMemoryBudget::from_mirror(&m).expect("budget");
        assert_eq!(back.spec, b.spec);
        assert_eq!(back.metadata.uid.as_deref(), Some("c-1"));
        // A namespaced budget's kind does not read a cluster budget's mirror.
        assert_eq!(Copied::of_mirror(&m.metadata, "GpuMemoryBudget"), None);
    }

    #[test]
    fn no_mirror_without_uid_or_generation_and_no_budget_from_a_mirror_naming_none() {
        let mut b = budget(LLM);
        b.metadata.generation = None;
        assert!(b.mirror().is_none());
        let mut b = budget(LLM);
        b.metadata.uid = Some(String::new());
        assert!(b.mirror().is_none());

        let good = budget(LLM).mirror().expect("mirror");
        let mut m = good.clone();
        m.metadata.annotations = Some([(GENERATION_ANNOTATION.to_owned(), "three".to_owned())].into());
        assert!(GpuMemoryBudget::from_mirror(&m).is_none(), "a generation that does not parse");
        let mut m = good.clone();
        m.metadata.owner_references.as_mut().expect("owner")[0].controller = Some(false);
        assert!(GpuMemoryBudget::from_mirror(&m).is_none(), "no controller owner");
        let mut m = good;
        m.metadata.annotations = None;
        assert!(GpuMemoryBudget::from_mirror(&m).is_none(), "no generation");
    }

    fn key(n: u8) -> Key {
        ("ns".to_owned(), format!("b{n}"))
    }

    #[test]
    fn mirrors_cover_the_budgets_only_at_each_ones_uid_and_generation() {
        let c = |uid: &str, generation| Copied { uid: uid.to_owned(), generation };
        let budgets: HashMap<Key, Copied> = [(key(1), c("u1", 2)), (key(2), c("u2", 1))].into();
        let mut mirrors: HashMap<Key, Copied> =
            [(key(1), c("u1", 2)), (key(2), c("u2", 1)), (key(9), c("u9", 1))].into();
        assert!(covers(&budgets, &mirrors), "a leftover mirror does not matter");
        mirrors.insert(key(1), c("u1", 1));
        assert!(!covers(&budgets, &mirrors), "an older generation");
        mirrors.insert(key(1), c("old", 2));
        assert!(!covers(&budgets, &mirrors), "a budget deleted and created again");
        mirrors.remove(&key(1));
        assert!(!covers(&budgets, &mirrors), "no mirror");
        assert!(covers(&HashMap::new(), &HashMap::new()), "no budget: nothing to wait for");
    }

    #[test]
    fn the_lease_vouches_only_while_it_moves_under_the_agents_eyes() {
        let mut v = Vouch::default();
        assert!(!v.fresh(0) && v.why_not(0).is_some_and(|w| w.contains("absent")));
        v.observe(Some(("t1", 30)), 1_000);
        assert!(!v.fresh(1_000), "first seen: when was it renewed? not known on this clock");
        v.observe(Some(("t1", 30)), 9_000);
        assert!(!v.fresh(9_000));
        v.observe(Some(("t2", 30)), 11_000);
        assert!(v.fresh(11_000) && v.fresh(40_999));
        assert!(!v.fresh(41_000), "not renewed for its duration");
        assert!(v.why_not(41_000).is_some_and(|w| w.contains("30s ago")), "{:?}", v.why_not(41_000));
        v.observe(Some(("t3", 30)), 45_000);
        assert!(v.fresh(45_000));
        v.observe(None, 46_000);
        assert!(!v.fresh(46_000), "deleted: vouches for nothing at once");
        v.observe(Some(("t4", 30)), 47_000);
        assert!(!v.fresh(47_000), "back: it must move again first");
        // A duration the Lease's writer set huge is held to twice the operator's.
        let mut v = Vouch::default();
        v.observe(Some(("a", 86_400)), 0);
        v.observe(Some(("b", 86_400)), 1_000);
        assert!(v.fresh(60_999) && !v.fresh(61_000));
    }

    proptest! {
        /// Fresh only after a renewal seen moving, and never longer than the duration after the last one.
        #[test]
        fn the_lease_is_never_fresh_past_its_duration(steps in proptest::collection::vec((0..3u8, 0..20_000u64), 0..40)) {
            let mut v = Vouch::default();
            let (mut now, mut last_move): (u64, Option<u64>) = (0, None);
            let mut prev: Option<String> = None;
            for (what, dt) in steps {
                now += dt;
                let lease = match what { 0 => None, 1 => Some(prev.clone().unwrap_or_else(|| "x".into())), _ => Some(format!("t{now}")) };
                match (&lease, &prev) {
                    (None, _) => last_move = None,
                    (Some(l), Some(p)) if l != p => last_move = Some(now),
                    _ => {}
                }
                if lease.is_none() { prev = None; } else { prev.clone_from(&lease); }
                v.observe(lease.as_deref().map(|l| (l, 30)), now);
                if v.fresh(now) {
                    prop_assert!(last_move.is_some_and(|m| now - m < 30_000));
                }
            }
        }
    }

    proptest! {
        /// A mirror made from a budget always reads back as that budget's key, UID, generation and spec.
        #[test]
        fn a_mirror_reads_back_as_its_budget(generation in 1..i64::MAX, uid in "[a-z0-9-]{1,36}", name in "[a-z][a-z0-9-]{0,20}") {
            let mut b = budget(LLM);
            b.metadata.generation = Some(generation);
            b.metadata.uid = Some(uid);
            b.metadata.name = Some(name);
            let m = b.mirror().expect("mirror");
            let back = GpuMemoryBudget::from_mirror(&m).expect("budget");
            prop_assert_eq!(Copied::of_mirror(&m.metadata, "GpuMemoryBudget"), Copied::of_budget(&b.metadata));
            prop_assert_eq!(back.metadata.name, b.metadata.name);
            prop_assert_eq!(back.spec, b.spec);
        }
    }
}
