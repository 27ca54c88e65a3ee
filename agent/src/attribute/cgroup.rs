//! `/proc/<pid>/cgroup` → pod UID and container ID. Pure: text in, answer out, never a panic.
//!
//! The parser does not anchor on one layout. It scans the path's segments for the pod's cgroup, which
//! every kubelet names the same way up to a few spellings:
//!
//! - cgroupfs driver: a segment `pod<UID>` (`/kubepods/burstable/pod<UID>/<container>`, Guaranteed pods
//!   without the QoS level, and any prefix above it: `/kubelet/kubepods/…` under kind, `/docker/<id>/…`
//!   for a node inside a container);
//! - systemd driver: a slice `<anything>kubepods<anything>-pod<UID with _>.slice`
//!   (`kubepods-burstable-pod…`, `kubepods-pod…` for Guaranteed, `kubelet-kubepods-besteffort-pod…` under
//!   kind);
//! - containerd with the systemd driver seen from inside `containerd.service`:
//!   `…/kubepods-besteffort-pod<UID>.slice:cri-containerd:<container>` (slice, prefix and name in one
//!   segment).
//!
//! The owner is the **outermost** pod on the path: the pod whose cgroup the kubelet made. A container that
//! may write its own cgroup subtree can create `…/cri-containerd-<id>.scope/kubepods-pod<other UID>.slice/…`
//! under its container and move a process there; that process is still its container's.
//!
//! The container is the segment right under that pod's: `cri-containerd-<id>.scope`, `crio-<id>.scope`,
//! `docker-<id>.scope`, or a bare `<id>` (cgroupfs). Anything deeper (`…/<id>/init`, crun's
//! `…/crio-<id>.scope/container`, a tenant's own subtree with whatever names) belongs to that container. `crio-conmon-<id>.scope` is CRI-O's monitor process: it
//! belongs to the pod but to no container.
//!
//! Paths may be relative to the reader's cgroup namespace: an agent in its own cgroup namespace (the
//! default for containers on cgroup v2) sees `0::/../../kubepods-burstable-pod….slice/cri-containerd-….scope`
//! for its neighbours, and `0::/` for processes of its own container. Scanning segments handles both; the
//! second has no pod, so it is unattributed.
//!
//! For cgroup v1 (one line per hierarchy), the first line that names a pod and a container wins, then the
//! first that names a pod.

/// The pod (and container, when the path names one) a process belongs to.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct ContainerRef {
    /// The pod UID, lowercase, with hyphens (`1b2c…-…`), or the 32-hex-digit hash of a static pod.
    pub pod_uid: String,
    /// The container ID (hex, lowercase), as in `status.containerStatuses[].containerID` after the scheme.
    pub container_id: Option<String>,
}

/// Parses the whole content of a `/proc/<pid>/cgroup` file (v1, v2 or hybrid).
pub fn parse_cgroup_file(content: &str) -> Option<ContainerRef> {
    let mut pod_only: Option<ContainerRef> = None;
    for line in content.lines() {
        let mut fields = line.splitn(3, ':');
        let (Some(_hierarchy), Some(_controllers), Some(path)) = (fields.next(), fields.next(), fields.next()) else {
            continue;
        };
        match parse_cgroup_path(path.trim_end()) {
            Some(found) if found.container_id.is_some() => return Some(found),
            Some(found) if pod_only.is_none() => pod_only = Some(found),
            _ => {}
        }
    }
    pod_only
}

/// Parses one cgroup path (the third field of a line).
pub fn parse_cgroup_path(path: &str) -> Option<ContainerRef> {
    let segments: Vec<&str> = path.split('/').filter(|s| !s.is_empty() && *s != "." && *s != "..").collect();
    // The OUTERMOST pod segment wins. That is the cgroup the kubelet of this node made; everything below a
    // container's cgroup is the container's own subtree, which a container allowed to write it can fill
    // with any names, a neighbour's pod UID or a made-up one included. Taking an inner segment would let
    // it charge its memory to the neighbour, or to no one (docs/security.md, "Hostile pods").
    let (index, pod) = segments.iter().enumerate().find_map(|(i, s)| pod_in_segment(s).map(|p| (i, p)))?;
    let container_id = match pod.inline_container {
        Some(id) => Some(id),
        None => segments.get(index + 1).and_then(|s| container_in_segment(s)),
    };
    Some(ContainerRef { pod_uid: pod.uid, container_id })
}

struct PodSegment {
    uid: String,
    inline_container: Option<String>,
}

/// The container's cgroup v2 path from the hierarchy's root (`/kubepods.slice/…/cri-containerd-<id>.scope`),
/// from the whole content of `/proc/<pid>/cgroup`: the `0::` line's path cut after the container's segment
/// (the driver's per-cgroup limits are set on that cgroup). A path relative to the reader's cgroup namespace
/// (`/../../kubepods-burstable-pod<uid>.slice/…`, the agent in its own cgroup namespace) is rebuilt from the
/// systemd pod slice's name, which spells its ancestors (`a-b-c.slice` is in `a.slice/a-b.slice`); a relative
/// cgroupfs path cannot be rebuilt. `None` then, and for no `0::` line, no pod, no container, or the
/// `slice:runtime:id` form.
pub fn container_cgroup_v2(content: &str) -> Option<String> {
    let path = content.lines().find_map(|l| l.strip_prefix("0::"))?.trim_end();
    let segments: Vec<&str> = path.split('/').filter(|s| !s.is_empty() && *s != ".").collect();
    let relative = segments.contains(&"..");
    let segments: Vec<&str> = segments.into_iter().filter(|s| *s != "..").collect();
    let (index, pod) = segments.iter().enumerate().find_map(|(i, s)| pod_in_segment(s).map(|p| (i, p)))?;
    if pod.inline_container.is_some() {
        return None;
    }
    let container = *segments.get(index + 1)?;
    container_in_segment(container)?;
    let mut out = String::new();
    if relative {
        let slice = segments[index].strip_suffix(".slice")?;
        let mut end = 0;
        for part in slice.split('-') {
            end += part.len();
            out.push('/');
            out.push_str(&slice[..end]);
            out.push_str(".slice");
            end += 1;
        }
    } else {
        for s in &segments[..=index] {
            out.push('/');
            out.push_str(s);
        }
    }
    out.push('/');
    out.push_str(container);
    Some(out)
}

/// `pod<UID>` (cgroupfs), `…kubepods…-pod<UID_>.slice` (systemd) or `…-pod<UID_>.slice:<prefix>:<id>`.
fn pod_in_segment(segment: &str) -> Option<PodSegment> {
    if let Some(rest) = segment.strip_prefix("pod") {
        return normalize_uid(rest).map(|uid| PodSegment { uid, inline_container: None });
    }
    let (slice, inline) = match segment.split_once(':') {
        Some((slice, rest)) => (slice, Some(rest)),
        None => (segment, None),
    };
    let name = slice.strip_suffix(".slice")?;
    let at = name.rfind("-pod")?;
    if !name[..at].contains("kubepods") {
        return None;
    }
    let uid = normalize_uid(&name[at + 4..])?;
    let inline_container = inline.and_then(|rest| rest.rsplit(':').next()).and_then(container_id);
    Some(PodSegment { uid, inline_container })
}

/// The container ID in the segment under the pod's cgroup, if it is a container's.
fn container_in_segment(segment: &str) -> Option<String> {
    let name = segment.strip_suffix(".scope").unwrap_or(segment);
    if name.starts_with("crio-conmon-") {
        return None;
    }
    // `cri-containerd-<id>`, `crio-<id>`, `docker-<id>`, `<id>`, or another runtime's `<prefix>-<id>`.
    let id = name.rsplit(['-', '_', ':']).next().unwrap_or(name);
    container_id(id)
}

/// A container ID: at least 12 hex digits (runtimes use 64), returned lowercase.
fn container_id(text: &str) -> Option<String> {
    let ok = (12..=128).contains(&text.len()) && text.bytes().all(|b| b.is_ascii_hexdigit());
    ok.then(|| text.to_ascii_lowercase())
}

/// A pod UID as written in a cgroup name: `8-4-4-4-12` hex groups joined by `-` (cgroupfs) or `_`
/// (systemd), or 32 hex digits (a static pod's hash). Returned lowercase with hyphens.
pub fn normalize_uid(text: &str) -> Option<String> {
    let bytes = text.as_bytes();
    if bytes.len() == 32 && bytes.iter().all(u8::is_ascii_hexdigit) {
        return Some(text.to_ascii_lowercase());
    }
    if bytes.len() != 36 {
        return None;
    }
    let separator = bytes[8];
    if separator != b'-' && separator != b'_' {
        return None;
    }
    let mut out = String::with_capacity(36);
    for (i, &b) in bytes.iter().enumerate() {
        if matches!(i, 8 | 13 | 18 | 23) {
            if b != separator {
                return None;
            }
            out.push('-');
        } else if b.is_ascii_hexdigit() {
            out.push(char::from(b.to_ascii_lowercase()));
        } else {
            return None;
        }
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const UID: &str = "1b2c3d4e-5f6a-7b8c-9d0e-1f2a3b4c5d6e";
    const CID: &str = "a3f1c2d4e5b60718293a4b5c6d7e8f90a1b2c3d4e5f60718293a4b5c6d7e8f90";

    fn expect(path: &str, pod: Option<&str>, container: Option<&str>) {
        let got = parse_cgroup_path(path);
        assert_eq!(got.as_ref().map(|r| r.pod_uid.as_str()), pod, "{path}");
        assert_eq!(got.as_ref().and_then(|r| r.container_id.as_deref()), container, "{path}");
    }

    #[test]
    fn main_layouts() {
        let u = UID.replace('-', "_");
        expect(
            &format!(
                "/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{u}.slice/cri-containerd-{CID}.scope"
            ),
            Some(UID),
            Some(CID),
        );
        expect(&format!("/kubepods.slice/kubepods-pod{u}.slice/crio-{CID}.scope"), Some(UID), Some(CID));
        expect(&format!("/kubepods/burstable/pod{UID}/{CID}"), Some(UID), Some(CID));
        expect(&format!("/kubepods/pod{UID}/{CID}"), Some(UID), Some(CID));
        expect(&format!("/kubepods/besteffort/pod{UID}"), Some(UID), None);
    }

    #[test]
    fn variations() {
        let u = UID.replace('-', "_");
        // cgroup namespace of the reader: relative path.
        expect(
            &format!("/../../../kubepods-besteffort.slice/kubepods-besteffort-pod{u}.slice/cri-containerd-{CID}.scope"),
            Some(UID),
            Some(CID),
        );
        // containerd with the systemd driver, seen inside containerd.service.
        expect(
            &format!("/system.slice/containerd.service/kubepods-burstable-pod{u}.slice:cri-containerd:{CID}"),
            Some(UID),
            Some(CID),
        );
        // crun's nested leaf, runc's init leaf.
        expect(&format!("/kubepods.slice/kubepods-pod{u}.slice/crio-{CID}.scope/container"), Some(UID), Some(CID));
        expect(&format!("/kubepods/burstable/pod{UID}/{CID}/init"), Some(UID), Some(CID));
        // CRI-O's monitor belongs to the pod, not to a container.
        expect(&format!("/kubepods.slice/kubepods-pod{u}.slice/crio-conmon-{CID}.scope"), Some(UID), None);
        // Uppercase and static-pod hashes.
        expect(&format!("/kubepods/pod{}/{CID}", UID.to_uppercase()), Some(UID), Some(CID));
        expect(
            "/kubepods/pod0123456789abcdef0123456789abcdef/0123456789ab",
            Some("0123456789abcdef0123456789abcdef"),
            Some("0123456789ab"),
        );
        // Not pods.
        expect("/", None, None);
        expect(&format!("/system.slice/docker-{CID}.scope"), None, None);
        expect("/user.slice/user-1000.slice/session-3.scope", None, None);
        expect(&format!("/system.slice/podman-pod{u}.slice/{CID}"), None, None);
        expect("/kubepods/burstable/podnot-a-uid/abc", None, None);
    }

    /// A container that writes its own cgroup subtree and names a neighbour's pod (or a made-up one) in it
    /// is still charged: the outermost pod is the kubelet's, the segment under it the container.
    #[test]
    fn a_subtree_under_a_container_belongs_to_that_container() {
        let u = UID.replace('-', "_");
        let other = "9f8e7d6c-5b4a-4938-8271-605f4e3d2c1b";
        let o = other.replace('-', "_");
        let other_cid = "b".repeat(64);
        let own = format!(
            "/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{u}.slice/cri-containerd-{CID}.scope"
        );
        for nested in [
            format!("/kubepods-pod{o}.slice/cri-containerd-{other_cid}.scope"),
            format!("/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{o}.slice/crio-{other_cid}.scope"),
            format!("/pod{other}/{other_cid}"),
            format!("/kubepods/pod{other}"),
            "/kubepods-pod0123456789abcdef0123456789abcdef.slice/docker-cafecafecafe.scope".to_owned(),
            format!("/x/y/kubepods-pod{o}.slice:cri-containerd:{other_cid}"),
        ] {
            expect(&format!("{own}{nested}"), Some(UID), Some(CID));
            expect(&format!("/../..{own}{nested}"), Some(UID), Some(CID));
            expect(&format!("/kubepods/burstable/pod{UID}/{CID}{nested}"), Some(UID), Some(CID));
        }
    }

    #[test]
    fn v1_prefers_a_line_with_a_container() {
        let content = format!(
            "12:pids:/\n11:memory:/kubepods/burstable/pod{UID}\n10:cpu,cpuacct:/kubepods/burstable/pod{UID}/{CID}\n0::/\n"
        );
        let r = parse_cgroup_file(&content).expect("pod");
        assert_eq!((r.pod_uid.as_str(), r.container_id.as_deref()), (UID, Some(CID)));
        assert_eq!(parse_cgroup_file("0::/\n"), None);
        assert_eq!(parse_cgroup_file(""), None);
        assert_eq!(parse_cgroup_file("garbage"), None);
    }

    /// The corpus of real-world files (tests/fixtures/cgroup_corpus.txt): every block gives its answer.
    #[test]
    fn corpus() {
        let text = include_str!("../../tests/fixtures/cgroup_corpus.txt");
        let mut blocks: Vec<(String, String, String)> = Vec::new();
        for line in text.lines() {
            if let Some(header) = line.strip_prefix("== ") {
                let fields: Vec<&str> = header.split_whitespace().collect();
                let value = |key: &str| {
                    fields.iter().find_map(|f| f.strip_prefix(key)).map(str::to_owned).expect("header field")
                };
                blocks.push((value("pod="), value("container="), String::new()));
            } else if let Some(block) = blocks.last_mut().filter(|_| !line.starts_with('#')) {
                block.2.push_str(line);
                block.2.push('\n');
            }
        }
        assert!(blocks.len() >= 30, "{} blocks", blocks.len());
        for (pod, container, content) in &blocks {
            let got = parse_cgroup_file(content);
            let want_pod = (pod != "-").then_some(pod.as_str());
            let want_container = (container != "-").then_some(container.as_str());
            assert_eq!(got.as_ref().map(|r| r.pod_uid.as_str()), want_pod, "{content}");
            assert_eq!(got.as_ref().and_then(|r| r.container_id.as_deref()), want_container, "{content}");
        }
    }

    #[test]
    fn container_cgroups_for_the_drivers_limits() {
        let u = UID.replace('-', "_");
        let full = format!(
            "/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{u}.slice/cri-containerd-{CID}.scope"
        );
        // Absolute: cut after the container (a nested leaf is the container's).
        assert_eq!(container_cgroup_v2(&format!("0::{full}\n")), Some(full.clone()));
        assert_eq!(container_cgroup_v2(&format!("0::{full}/init\n")), Some(full.clone()));
        assert_eq!(
            container_cgroup_v2(&format!("0::/kubepods/burstable/pod{UID}/{CID}\n")),
            Some(format!("/kubepods/burstable/pod{UID}/{CID}"))
        );
        // Relative to the agent's cgroup namespace: rebuilt from the systemd slice's name (kind's prefix too).
        assert_eq!(
            container_cgroup_v2(&format!("0::/../../kubepods-burstable-pod{u}.slice/cri-containerd-{CID}.scope\n")),
            Some(full)
        );
        assert_eq!(
            container_cgroup_v2(&format!("0::/../kubelet-kubepods-pod{u}.slice/cri-containerd-{CID}.scope\n")),
            Some(format!(
                "/kubelet.slice/kubelet-kubepods.slice/kubelet-kubepods-pod{u}.slice/cri-containerd-{CID}.scope"
            ))
        );
        // Cannot be told: relative cgroupfs, no container, v1 only, the inline form.
        assert_eq!(container_cgroup_v2(&format!("0::/../../pod{UID}/{CID}\n")), None);
        assert_eq!(container_cgroup_v2(&format!("0::/kubepods/burstable/pod{UID}\n")), None);
        assert_eq!(container_cgroup_v2(&format!("4:memory:/kubepods/pod{UID}/{CID}\n")), None);
        assert_eq!(
            container_cgroup_v2(&format!(
                "0::/system.slice/containerd.service/kubepods-pod{u}.slice:cri-containerd:{CID}"
            )),
            None
        );
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(3_000))]

        /// Any content: no panic, and an answer is an absolute path without `.` or `..` segments that names
        /// the same pod and container as the parser.
        #[test]
        fn container_cgroups_are_clean_paths(content in "0::(/(\\.\\.|kubepods(-[a-z]{1,5})?(-pod[0-9a-f_]{36})?\\.slice|pod[0-9a-f-]{36}|cri-containerd-[0-9a-f]{12}\\.scope|[a-z.]{1,6})){0,7}\n") {
            if let Some(path) = container_cgroup_v2(&content) {
                prop_assert!(path.starts_with('/'));
                prop_assert!(path.split('/').skip(1).all(|s| !s.is_empty() && s != "." && s != ".."), "{}", path);
                let line = content.trim_end().trim_start_matches("0::");
                let parsed = parse_cgroup_path(line);
                prop_assert!(parsed.is_some_and(|r| r.container_id.is_some()));
                prop_assert_eq!(parse_cgroup_path(&path), parse_cgroup_path(line));
            }
        }

        #[test]
        fn never_panics(content in "\\PC{0,400}") {
            let _ = parse_cgroup_file(&content);
        }

        #[test]
        fn never_panics_on_path_shaped_noise(
            parts in proptest::collection::vec(
                prop_oneof![
                    Just("kubepods".to_owned()), Just("..".to_owned()), Just(".slice".to_owned()),
                    Just("-pod".to_owned()), Just("pod".to_owned()), Just(":".to_owned()), Just("/".to_owned()),
                    Just("_".to_owned()), "[0-9a-f_-]{0,40}", "\\PC{0,6}",
                ],
                0..24,
            )
        ) {
            let path: String = parts.concat();
            let _ = parse_cgroup_file(&format!("0::{path}"));
        }

        /// Every kubelet spelling of a pod and container is recovered exactly, whatever is above it.
        #[test]
        fn recovers_generated_layouts(
            uid in "[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}",
            cid in "[0-9a-f]{64}",
            qos in prop_oneof![Just(""), Just("burstable"), Just("besteffort")],
            systemd in any::<bool>(),
            runtime in prop_oneof![Just("cri-containerd-"), Just("crio-"), Just("docker-")],
            up in 0usize..4,
            prefix in prop_oneof![Just(""), Just("/kubelet.slice"), Just("/docker/abc")],
        ) {
            let dots = "/..".repeat(up);
            let path = if systemd {
                let u = uid.replace('-', "_");
                let (qos_slice, pod_slice) = if qos.is_empty() {
                    (String::new(), format!("kubepods-pod{u}.slice"))
                } else {
                    (format!("/kubepods-{qos}.slice"), format!("kubepods-{qos}-pod{u}.slice"))
                };
                format!("{dots}{prefix}/kubepods.slice{qos_slice}/{pod_slice}/{runtime}{cid}.scope")
            } else {
                let q = if qos.is_empty() { String::new() } else { format!("/{qos}") };
                format!("{dots}{prefix}/kubepods{q}/pod{uid}/{cid}")
            };
            let got = parse_cgroup_file(&format!("0::{path}\n")).expect("parsed");
            prop_assert_eq!(got.pod_uid, uid);
            prop_assert_eq!(got.container_id, Some(cid));
        }

        /// Whatever a container writes below its own cgroup (segments naming other pods and containers,
        /// noise), the answer is that container's pod and container.
        #[test]
        fn a_containers_subtree_never_changes_the_owner(
            uid in "[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}",
            cid in "[0-9a-f]{64}",
            systemd in any::<bool>(),
            below in proptest::collection::vec(
                prop_oneof![
                    "pod[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}",
                    "kubepods-pod[0-9a-f]{8}_[0-9a-f]{4}_[0-9a-f]{4}_[0-9a-f]{4}_[0-9a-f]{12}\\.slice",
                    "kubepods-burstable-pod[0-9a-f]{32}\\.slice(:cri-containerd:[0-9a-f]{64})?",
                    "(cri-containerd-|crio-|docker-)?[0-9a-f]{12,64}(\\.scope)?",
                    Just("kubepods".to_owned()), Just("..".to_owned()), Just("init".to_owned()),
                    "[a-z0-9_.:-]{1,20}",
                ],
                1..8,
            ),
        ) {
            let own = if systemd {
                format!("/kubepods.slice/kubepods-pod{}.slice/cri-containerd-{cid}.scope", uid.replace('-', "_"))
            } else {
                format!("/kubepods/besteffort/pod{uid}/{cid}")
            };
            let path = format!("{own}/{}", below.join("/"));
            let got = parse_cgroup_file(&format!("0::{path}\n")).expect("parsed");
            prop_assert_eq!(got.pod_uid, uid, "{}", path);
            prop_assert_eq!(got.container_id, Some(cid), "{}", path);
        }
    }
}
