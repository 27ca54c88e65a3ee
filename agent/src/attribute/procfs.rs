//! PID → container, read from `<proc root>/<pid>/cgroup` and cached.
//!
//! A process does not change pods, so a PID's answer is kept until the PID disappears or is reused. Reuse
//! is caught by the process start time (`/proc/<pid>/stat` field 22), read when a PID first appears in the
//! GPU's process list and again every [`ProcAttributor::REVALIDATE_MS`]. A PID listed in consecutive
//! rounds is not re-read in between: for it to be reused, its process would have to exit, the kernel hand
//! its PID (out of `pid_max`, 4 million by default) to a new process, and that process create a CUDA
//! context, all within one sampling interval. A PID missing from one round is forgotten and looked at
//! afresh when it comes back. A PID found in no pod is looked at again after
//! [`ProcAttributor::NEGATIVE_RECHECK_MS`], in case it was seen before its runtime moved it into its
//! container's cgroup. Buffers are reused: a steady round reads no file and allocates nothing.

use std::collections::HashMap;
use std::fmt::Write as _;
use std::io::Read as _;
use std::path::Path;

use std::sync::Arc;

use super::cgroup::{ContainerRef, container_cgroup_v2, parse_cgroup_file};

#[derive(Debug)]
struct Entry {
    start_time: u64,
    owner: Option<ContainerRef>,
    /// The container's cgroup v2 path ([`container_cgroup_v2`]), for the driver's limits.
    cgroup: Option<Arc<str>>,
    /// When the cgroup file was read.
    checked_ms: u64,
    /// When the start time was read.
    validated_ms: u64,
    /// The last round the PID was looked up in.
    seen: u64,
}

/// What a process is, as far as `/proc` says.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Lookup<'a> {
    /// In a pod's cgroup.
    Pod(&'a ContainerRef),
    /// Alive, in no pod's cgroup (a host process, or one whose cgroup is not visible).
    NoPod,
    /// No such process under the proc root (exited, or another PID namespace).
    Gone,
}

/// File reads done so far, for tests and the performance notes.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct ReadCounts {
    /// `/proc/<pid>/stat` reads.
    pub stat: u64,
    /// `/proc/<pid>/cgroup` reads.
    pub cgroup: u64,
}

/// Attributes PIDs to containers through a proc filesystem (`/proc`, or the host's mounted elsewhere).
#[derive(Debug)]
pub struct ProcAttributor {
    root: String,
    entries: HashMap<u32, Entry>,
    path: String,
    buf: Vec<u8>,
    generation: u64,
    reads: ReadCounts,
}

impl ProcAttributor {
    /// How long a "no pod" answer is trusted before the cgroup file is read again.
    pub const NEGATIVE_RECHECK_MS: u64 = 5_000;
    /// How often the start time of a PID present in every round is read again anyway.
    pub const REVALIDATE_MS: u64 = 10_000;

    /// An attributor reading under `root` (e.g. `/proc` or `/host/proc`).
    pub fn new(root: &Path) -> Self {
        Self {
            root: root.to_string_lossy().trim_end_matches('/').to_owned(),
            entries: HashMap::new(),
            path: String::with_capacity(64),
            buf: Vec::with_capacity(4096),
            generation: 0,
            reads: ReadCounts::default(),
        }
    }

    /// Starts a sampling round; PIDs not looked up before [`Self::end_round`] are forgotten then.
    pub fn begin_round(&mut self) {
        self.generation += 1;
    }

    /// Forgets PIDs that were not looked up in this round (their processes left the GPU).
    pub fn end_round(&mut self) {
        let generation = self.generation;
        self.entries.retain(|_, e| e.seen == generation);
    }

    /// Reads so far.
    pub fn reads(&self) -> ReadCounts {
        self.reads
    }

    /// PIDs currently cached.
    pub fn cached(&self) -> usize {
        self.entries.len()
    }

    /// The container of `pid` at `now_ms` (a monotonic clock in milliseconds).
    pub fn lookup(&mut self, pid: u32, now_ms: u64) -> Lookup<'_> {
        let generation = self.generation;
        let steady = self.entries.get(&pid).is_some_and(|e| {
            e.seen + 1 >= generation
                && now_ms.saturating_sub(e.validated_ms) < Self::REVALIDATE_MS
                && (e.owner.is_some() || now_ms.saturating_sub(e.checked_ms) < Self::NEGATIVE_RECHECK_MS)
        });
        if !steady {
            let Some(start_time) = self.read_start_time(pid) else {
                self.entries.remove(&pid);
                return Lookup::Gone;
            };
            let known = self.entries.get_mut(&pid).filter(|e| e.start_time == start_time && e.seen + 1 >= generation);
            match known {
                Some(e) if e.owner.is_some() || now_ms.saturating_sub(e.checked_ms) < Self::NEGATIVE_RECHECK_MS => {
                    e.validated_ms = now_ms;
                }
                _ => {
                    let (owner, cgroup) = self.read_owner(pid);
                    if owner.is_none() && self.read_start_time(pid).is_none() {
                        self.entries.remove(&pid);
                        return Lookup::Gone;
                    }
                    let entry =
                        Entry { start_time, owner, cgroup, checked_ms: now_ms, validated_ms: now_ms, seen: generation };
                    self.entries.insert(pid, entry);
                }
            }
        }
        match self.entries.get_mut(&pid) {
            Some(entry) => {
                entry.seen = generation;
                match &entry.owner {
                    Some(owner) => Lookup::Pod(owner),
                    None => Lookup::NoPod,
                }
            }
            None => Lookup::Gone,
        }
    }

    fn read_into_buf(&mut self, pid: u32, file: &str) -> bool {
        self.path.clear();
        let _ = write!(self.path, "{}/{pid}/{file}", self.root);
        self.buf.clear();
        match std::fs::File::open(&self.path) {
            Ok(mut f) => f.read_to_end(&mut self.buf).is_ok(),
            Err(_) => false,
        }
    }

    fn read_start_time(&mut self, pid: u32) -> Option<u64> {
        self.reads.stat += 1;
        if !self.read_into_buf(pid, "stat") {
            return None;
        }
        parse_start_time(&self.buf)
    }

    fn read_owner(&mut self, pid: u32) -> (Option<ContainerRef>, Option<Arc<str>>) {
        self.reads.cgroup += 1;
        if !self.read_into_buf(pid, "cgroup") {
            return (None, None);
        }
        let Ok(text) = std::str::from_utf8(&self.buf) else { return (None, None) };
        let owner = parse_cgroup_file(text);
        let cgroup = owner.as_ref().and_then(|_| container_cgroup_v2(text)).map(Arc::from);
        (owner, cgroup)
    }

    /// The container cgroup (v2, from the hierarchy's root) of a PID looked up in this round, when its
    /// `/proc/<pid>/cgroup` tells it ([`container_cgroup_v2`]).
    pub fn cgroup_of(&self, pid: u32) -> Option<&Arc<str>> {
        self.entries.get(&pid).filter(|e| e.seen == self.generation).and_then(|e| e.cgroup.as_ref())
    }
}

/// The start time (field 22, clock ticks since boot) from the content of `/proc/<pid>/stat`. The command
/// name (field 2) may hold spaces and parentheses, so fields are counted after its last `)`.
pub fn parse_start_time(stat: &[u8]) -> Option<u64> {
    let close = stat.iter().rposition(|b| *b == b')')?;
    let rest = std::str::from_utf8(stat.get(close + 1..)?).ok()?;
    // Fields after the name start at field 3; field 22 is the 20th of them.
    rest.split_ascii_whitespace().nth(19)?.parse().ok()
}

/// The command name of process `pid` (`<proc root>/<pid>/comm`), or empty when it cannot be read.
pub fn command(proc_root: &Path, pid: Option<u32>) -> String {
    pid.and_then(|p| std::fs::read_to_string(proc_root.join(p.to_string()).join("comm")).ok())
        .map(|c| c.trim().to_owned())
        .unwrap_or_default()
}

/// Writes a fake process into a proc tree (tests and the e2e fixtures).
pub fn write_fake_process(root: &Path, pid: u32, start_time: u64, cgroup: &str) -> std::io::Result<()> {
    let dir = root.join(pid.to_string());
    std::fs::create_dir_all(&dir)?;
    let stat = format!(
        "{pid} (python3 my) worker) S 1 {pid} {pid} 0 -1 4194560 100 0 0 0 5 3 0 0 20 0 12 0 {start_time} 1000000 500 \
         18446744073709551615 1 1 0 0 0 0 0 16781312 17642 0 0 0 17 3 0 0 0 0 0\n"
    );
    std::fs::write(dir.join("stat"), stat)?;
    std::fs::write(dir.join("comm"), "python3\n")?;
    std::fs::write(dir.join("cgroup"), cgroup)
}

#[cfg(test)]
mod tests {
    use super::*;

    const UID: &str = "5a1e3c9d-7b2f-4e8a-9c61-0d3f2b7a8e41";
    const CID: &str = "a3f1c2d4e5b60718293a4b5c6d7e8f90a1b2c3d4e5f60718293a4b5c6d7e8f90";

    fn cgroup_line(uid: &str, cid: &str) -> String {
        format!("0::/kubepods/burstable/pod{uid}/{cid}\n")
    }

    #[test]
    fn start_time_survives_odd_command_names() {
        let stat = b"42 (a (b) c) S 1 42 42 0 -1 4194560 1 0 0 0 0 0 0 0 20 0 1 0 987654 1 1 18446744073709551615";
        assert_eq!(parse_start_time(stat), Some(987_654));
        assert_eq!(parse_start_time(b"42 (x) S 1"), None);
        assert_eq!(parse_start_time(b""), None);
        assert_eq!(parse_start_time(b"\xff)\xfe"), None);
    }

    #[test]
    fn caches_until_the_pid_goes_or_is_reused() {
        let dir = tempfile::tempdir().expect("tempdir");
        write_fake_process(dir.path(), 100, 5_000, &cgroup_line(UID, CID)).expect("fixture");
        write_fake_process(dir.path(), 200, 6_000, "0::/system.slice/sshd.service\n").expect("fixture");
        let mut a = ProcAttributor::new(dir.path());

        a.begin_round();
        assert!(
            matches!(a.lookup(100, 0), Lookup::Pod(r) if r.pod_uid == UID && r.container_id.as_deref() == Some(CID))
        );
        assert_eq!(a.lookup(200, 0), Lookup::NoPod);
        assert_eq!(a.lookup(300, 0), Lookup::Gone);
        a.end_round();
        assert_eq!(a.reads().cgroup, 2);

        // Steady state: nothing is read.
        let reads = a.reads();
        for tick in 1..=19 {
            a.begin_round();
            assert!(matches!(a.lookup(100, tick * 250), Lookup::Pod(_)));
            a.lookup(200, tick * 250);
            a.end_round();
        }
        assert_eq!(a.reads(), reads, "no file read while the answer cannot have changed");

        // A "no pod" answer is re-checked after a while: the process was moved into a pod's cgroup.
        std::fs::write(dir.path().join("200/cgroup"), cgroup_line(UID, CID)).expect("move");
        a.begin_round();
        assert!(matches!(a.lookup(100, 5_500), Lookup::Pod(_)));
        assert!(matches!(a.lookup(200, 5_500), Lookup::Pod(_)));
        a.end_round();

        // The start time is read again every REVALIDATE_MS: PID reuse (same PID, new start time, another
        // container) is caught then at the latest.
        let other = "b".repeat(64);
        write_fake_process(dir.path(), 100, 9_999, &cgroup_line(UID, &other)).expect("reuse");
        a.begin_round();
        assert!(matches!(a.lookup(100, 6_000), Lookup::Pod(r) if r.container_id.as_deref() == Some(CID)));
        a.end_round();
        a.begin_round();
        let at = ProcAttributor::REVALIDATE_MS + 1;
        assert!(matches!(a.lookup(100, at), Lookup::Pod(r) if r.container_id.as_deref() == Some(other.as_str())));
        a.end_round();
        assert_eq!(a.cached(), 1, "PID 200 was not looked up this round and is forgotten");

        // A PID absent from a round is read afresh when it comes back (reuse caught at once).
        write_fake_process(dir.path(), 100, 12_345, &cgroup_line(UID, CID)).expect("reuse again");
        a.begin_round();
        a.end_round();
        a.begin_round();
        assert!(matches!(a.lookup(100, at + 500), Lookup::Pod(r) if r.container_id.as_deref() == Some(CID)));
        a.end_round();

        // The PID disappears (and is not in the next round's list either).
        std::fs::remove_dir_all(dir.path().join("100")).expect("rm");
        a.begin_round();
        a.end_round();
        a.begin_round();
        assert_eq!(a.lookup(100, 21_000), Lookup::Gone);
        a.end_round();
        assert_eq!(a.cached(), 0);
    }
}
