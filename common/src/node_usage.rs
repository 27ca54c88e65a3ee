//! `GpuNodeUsage` (#34): what the GPU pods of one node hold, in one object per node, written by that node's
//! agent only (a ValidatingAdmissionPolicy holds it to the node bound into its token) and garbage-collected with
//! the Node (an owner reference). The operator reads usage from here; a pod's own record
//! ([`crate::pod_record`]) changes only with its state, budget or eviction, never for usage alone.
//!
//! The agent writes it at most once per `--usage-write-interval` (at least [`WRITE_INTERVAL_MIN`]: at most six
//! writes a minute whatever the pod count and churn), and only when a pod came or went or a pod's usage moved
//! by `--usage-write-change-percent` since the last write ([`Published::due`]).

use std::collections::HashMap;
use std::sync::Arc;

use kube::{CustomResource, KubeSchema};
use serde::{Deserialize, Serialize};

use crate::quantity::HumanBytes;

/// The most pods one object lists (the kubelet's own maximum is 110 by default; a node set to more lists the
/// pods holding most, and counts the rest in `podsNotListed`). About 150 bytes each: at most ~150 KiB.
pub const PODS_MAX: usize = 1000;
/// The shortest `--usage-write-interval`: at most six writes a minute per node.
pub const WRITE_INTERVAL_MIN_SECONDS: u64 = 10;
/// The object is rewritten at least this often even when nothing moved, so that its `observedAt` tells a
/// running agent from one that is gone or was rolled back to a version that does not write it.
pub const REFRESH_SECONDS: u64 = 600;
/// An object not rewritten for this long is not read: its agent is gone or does not write it any more (a
/// rollback), and the pods' records are newer.
pub const STALE_SECONDS: i64 = 1800;

/// Whether an object written at `observed_at` (RFC 3339) is read at `now`: written within [`STALE_SECONDS`]
/// (a time in the future, clocks apart, counts as fresh); never when the time does not parse.
pub fn fresh(observed_at: &str, now: k8s_openapi::jiff::Timestamp) -> bool {
    observed_at
        .parse::<k8s_openapi::jiff::Timestamp>()
        .is_ok_and(|at| now.duration_since(at).as_secs() <= STALE_SECONDS)
}

/// What the GPU pods of one node hold, as the gpubudget agent of that node measured it with NVML (the
/// framework's reserved pool plus about 0.5 GiB of CUDA context per process, not
/// torch.cuda.memory_allocated()). One object per node, named after the node, written by that node's agent
/// only, deleted with the Node. Read by the gpubudget operator (budget and quota status) and by
/// `kubectl gpubudget top` and `why`.
#[derive(CustomResource, KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Eq, Default)]
#[kube(
    group = "gpubudget.io",
    version = "v1alpha1",
    kind = "GpuNodeUsage",
    plural = "gpunodeusages",
    singular = "gpunodeusage",
    shortname = "gnu",
    category = "gpubudget",
    doc = "What the GPU pods of one node hold, as the gpubudget agent of that node measured it with NVML (the framework's reserved pool plus about 0.5 GiB of CUDA context per process). One object per node, named after it, written by that node's agent only and deleted with the Node.",
    derive = "PartialEq",
    printcolumn = r#"{"name":"Pods","type":"integer","jsonPath":".spec.podCount","description":"Pods the agent measured on the node"}"#,
    printcolumn = r#"{"name":"Total","type":"string","jsonPath":".spec.total","description":"GPU memory those pods hold together"}"#,
    printcolumn = r#"{"name":"Observed","type":"date","jsonPath":".spec.observedAt","description":"When the agent last wrote it"}"#
)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = Rule::new("self.nodeName == oldSelf.nodeName").message("nodeName cannot change"))]
pub struct GpuNodeUsageSpec {
    /// The node (the object's name too).
    #[schemars(length(max = 253))]
    pub node_name: String,
    /// When the agent wrote this (RFC 3339). The agent writes when something moved, not on a clock: an old
    /// time with an agent running means nothing moved since.
    pub observed_at: String,
    /// Pods measured: those listed and those not.
    pub pod_count: i64,
    /// GPU memory the measured pods hold together, human readable (`37.5Gi`).
    pub total: String,
    /// The pods holding GPU memory or under a budget, most first (at most 1000).
    #[schemars(length(max = 1000))]
    #[schemars(extend("x-kubernetes-list-type" = "atomic"))]
    pub pods: Vec<NodePodUsage>,
    /// Pods measured but not listed (over 1000 on the node): those holding least.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub pods_not_listed: i64,
}

fn is_zero(n: &i64) -> bool {
    *n == 0
}

/// One pod and what it holds.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct NodePodUsage {
    /// Namespace.
    #[schemars(length(max = 63))]
    pub namespace: String,
    /// Name.
    #[schemars(length(max = 253))]
    pub name: String,
    /// `metadata.uid`: a pod of the same name later is another.
    #[schemars(length(max = 128))]
    pub uid: String,
    /// GPU memory it holds, bytes.
    pub usage_bytes: i64,
}

/// A pod as the agent measured it: namespace, name, UID, bytes.
pub type Measured<'a> = (&'a str, &'a str, &'a Arc<str>, u64);

/// The spec of `node`'s object for these pods (any order): the [`PODS_MAX`] holding most listed, most first
/// (then by namespace and name), the rest counted.
pub fn spec_of<'a>(node: &str, observed_at: String, pods: impl IntoIterator<Item = Measured<'a>>) -> GpuNodeUsageSpec {
    let mut pods: Vec<Measured<'a>> = pods.into_iter().collect();
    let total = pods.iter().map(|p| p.3).fold(0u64, u64::saturating_add);
    let count = pods.len();
    if count > PODS_MAX {
        pods.select_nth_unstable_by(PODS_MAX, |a, b| b.3.cmp(&a.3));
        pods.truncate(PODS_MAX);
    }
    pods.sort_by(|a, b| b.3.cmp(&a.3).then_with(|| (a.0, a.1).cmp(&(b.0, b.1))));
    GpuNodeUsageSpec {
        node_name: node.to_owned(),
        observed_at,
        pod_count: i64::try_from(count).unwrap_or(i64::MAX),
        total: HumanBytes(total).to_string(),
        pods: pods
            .iter()
            .map(|(namespace, name, uid, bytes)| NodePodUsage {
                namespace: (*namespace).to_owned(),
                name: (*name).to_owned(),
                uid: uid.to_string(),
                usage_bytes: i64::try_from(*bytes).unwrap_or(i64::MAX),
            })
            .collect(),
        pods_not_listed: i64::try_from(count.saturating_sub(PODS_MAX)).unwrap_or(i64::MAX),
    }
}

/// Whether `new` differs from `old` by `percent` of `old` or more (and at all).
pub fn percent_changed(old: u64, new: u64, percent: u64) -> bool {
    let diff = u128::from(old.abs_diff(new));
    diff * 100 >= u128::from(old) * u128::from(percent) && diff > 0
}

/// What the agent last wrote into its node's object, and when: decides the next write.
#[derive(Debug, Default)]
pub struct Published {
    /// Bytes by pod UID, as written.
    pods: HashMap<Arc<str>, u64>,
    /// When it was written (monotonic ms); `None` before the first write of this start.
    at_ms: Option<u64>,
}

impl Published {
    /// Whether the object should be written now: never within `interval_ms` of the last write; then when a
    /// pod came or went or a pod's usage moved by `percent` since it was written, or [`REFRESH_SECONDS`]
    /// passed. The first write of a start is due at once (the object may hold what an earlier agent wrote).
    pub fn due<'a>(
        &self,
        now_ms: u64,
        interval_ms: u64,
        percent: u64,
        pods: impl IntoIterator<Item = (&'a Arc<str>, u64)>,
    ) -> bool {
        let Some(at) = self.at_ms else { return true };
        let since = now_ms.saturating_sub(at);
        if since < interval_ms {
            return false;
        }
        if since >= REFRESH_SECONDS * 1000 {
            return true;
        }
        let mut seen = 0usize;
        for (uid, bytes) in pods {
            seen += 1;
            match self.pods.get(uid) {
                Some(&old) if !percent_changed(old, bytes, percent) => {}
                _ => return true,
            }
        }
        seen != self.pods.len()
    }

    /// `pods` were written at `now_ms`.
    pub fn written<'a>(&mut self, now_ms: u64, pods: impl IntoIterator<Item = (&'a Arc<str>, u64)>) {
        self.pods.clear();
        self.pods.extend(pods.into_iter().map(|(uid, bytes)| (uid.clone(), bytes)));
        self.at_ms = Some(now_ms);
    }

    /// When the last write was (monotonic ms).
    pub fn at_ms(&self) -> Option<u64> {
        self.at_ms
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn uid(n: usize) -> Arc<str> {
        Arc::from(format!("uid-{n}"))
    }

    #[test]
    fn the_spec_lists_the_pods_holding_most_and_counts_the_rest() {
        let uids: Vec<Arc<str>> = (0..PODS_MAX + 5).map(uid).collect();
        let names: Vec<String> = (0..PODS_MAX + 5).map(|i| format!("p{i}")).collect();
        let pods = (0..PODS_MAX + 5).map(|i| ("ns", names[i].as_str(), &uids[i], i as u64));
        let spec = spec_of("n1", "2026-11-26T23:00:00Z".into(), pods);
        assert_eq!((spec.pods.len(), spec.pods_not_listed, spec.pod_count), (PODS_MAX, 5, (PODS_MAX + 5) as i64));
        assert_eq!(spec.pods[0].usage_bytes, (PODS_MAX + 4) as i64, "most first");
        assert_eq!(spec.pods[PODS_MAX - 1].usage_bytes, 5, "the five holding least are not listed");
        let small = spec_of("n1", String::new(), [("b", "x", &uids[0], 1 << 30), ("a", "y", &uids[1], 1 << 30)]);
        assert_eq!(small.pods.iter().map(|p| p.namespace.as_str()).collect::<Vec<_>>(), ["a", "b"], "ties by name");
        assert_eq!((small.total.as_str(), small.pods_not_listed), ("2Gi", 0));
    }

    #[test]
    fn a_write_is_due_for_a_move_a_new_or_a_gone_pod_never_within_the_interval() {
        let (a, b) = (uid(1), uid(2));
        let mut p = Published::default();
        assert!(p.due(0, 30_000, 5, []), "the first write of a start, even of no pod");
        p.written(1_000, [(&a, 100), (&b, 100)]);
        assert!(!p.due(2_000, 30_000, 5, [(&a, 900)]), "within the interval: nothing");
        assert!(!p.due(40_000, 30_000, 5, [(&a, 104), (&b, 96)]), "moves under 5 %");
        assert!(p.due(40_000, 30_000, 5, [(&a, 105), (&b, 100)]), "a move of 5 %");
        assert!(p.due(40_000, 30_000, 5, [(&a, 100)]), "a pod went");
        assert!(p.due(40_000, 30_000, 5, [(&a, 100), (&b, 100), (&uid(3), 0)]), "a pod came");
        assert!(!p.due(40_000, 30_000, 5, [(&b, 100), (&a, 100)]), "the same, in another order");
        assert!(p.due(1_000 + REFRESH_SECONDS * 1000, 30_000, 5, [(&a, 100), (&b, 100)]), "refreshed");
    }

    #[test]
    fn an_object_not_refreshed_for_half_an_hour_is_not_read() {
        let now: k8s_openapi::jiff::Timestamp = "2026-11-26T23:00:00Z".parse().expect("time");
        assert!(fresh("2026-11-26T22:50:00Z", now), "within the refresh");
        assert!(fresh("2026-11-26T22:30:00Z", now), "30 min: the bound");
        assert!(!fresh("2026-11-26T22:29:59Z", now), "older: a gone or rolled-back agent's");
        assert!(fresh("2026-11-26T23:05:00Z", now), "a clock ahead");
        assert!(!fresh("yesterday", now));
    }

    proptest! {
        /// Whatever the pods do, writes are at least the interval apart: at most 60 / interval a minute.
        #[test]
        fn writes_are_never_closer_than_the_interval(
            ticks in proptest::collection::vec((1..5_000u64, proptest::collection::vec(0..4u64, 0..6)), 1..200),
            interval_s in 10..60u64,
        ) {
            let uids: Vec<Arc<str>> = (0..6).map(uid).collect();
            let mut p = Published::default();
            let mut now = 0u64;
            let mut last: Option<u64> = None;
            for (step, usage) in ticks {
                now += step;
                let pods: Vec<(&Arc<str>, u64)> = usage.iter().enumerate().map(|(i, u)| (&uids[i], u << 30)).collect();
                if p.due(now, interval_s * 1000, 5, pods.iter().copied()) {
                    if let Some(l) = last { prop_assert!(now - l >= interval_s * 1000); }
                    last = Some(now);
                    p.written(now, pods.iter().copied());
                    prop_assert!(!p.due(now + interval_s * 1000, interval_s * 1000, 5, pods.iter().copied()),
                        "nothing moved: not due again before the refresh");
                }
            }
        }
    }
}
