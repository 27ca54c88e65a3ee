//! Helpers for the text of events: whole seconds, who holds a pod's memory, the API server's size limit.

use gpubudget_common::quantity::HumanBytes;

use crate::attribute::Holder;
use crate::sample::GpuInfo;

/// Whole seconds, rounded to the nearest, for messages.
pub(in crate::decide) fn seconds(ms: u64) -> u64 {
    ms.saturating_add(500) / 1000
}

/// "trainer (pid 4242, GPU 0) 9.1Gi, sidecar (pid 4300, GPU 1) 100Mi"; the largest first, at most five.
pub fn holders_summary(holders: &[Holder], gpus: &[GpuInfo]) -> String {
    let mut sorted: Vec<&Holder> = holders.iter().collect();
    sorted.sort_by(|a, b| b.bytes.cmp(&a.bytes).then(a.pid.cmp(&b.pid)));
    let mut parts: Vec<String> = sorted
        .iter()
        .take(5)
        .map(|h| {
            let container = h.container.as_deref().unwrap_or("(pod)");
            let gpu = gpus.get(h.gpu).map_or("?", |g| g.label.as_str());
            match h.pid {
                Some(pid) => format!("{container} (pid {pid}, GPU {gpu}) {}", HumanBytes(h.bytes)),
                None => format!("{container} (GPU {gpu}) {}", HumanBytes(h.bytes)),
            }
        })
        .collect();
    if sorted.len() > 5 {
        parts.push(format!("and {} more", sorted.len() - 5));
    }
    if parts.is_empty() { "no GPU process".to_owned() } else { parts.join(", ") }
}

/// Event notes are limited to 1 kB by the API server.
pub(in crate::decide) fn bounded(mut note: String) -> String {
    const MAX: usize = 1024;
    if note.len() > MAX {
        let mut cut = MAX - 3;
        while !note.is_char_boundary(cut) {
            cut -= 1;
        }
        note.truncate(cut);
        note.push_str("...");
    }
    note
}
