//! What `gpubudget-demo` does, as a function: serves the in-memory API on 127.0.0.1, writes the kubeconfig, runs
//! the story ([`scenario::run`]) and prints every line through `print`. The binary prints them; the test of
//! docs/demo.md (`tests/demo.rs`) compares them with the sample the page shows, and `--update-doc` writes them
//! into it, so the page shows what the demo prints.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use anyhow::Context as _;
use gpubudget_testkit::{FakeApi, kubeconfig_yaml};
use tokio_util::sync::CancellationToken;

use crate::scenario::{self, Outcome, Until};
use crate::stack::{Stack, kubelet_like_api};

/// How the demo runs.
#[derive(Debug, Clone)]
pub struct Options {
    /// Where the in-memory API server listens (port 0: any free port).
    pub listen: SocketAddr,
    /// Where the kubeconfig for kubectl is written.
    pub kubeconfig: PathBuf,
    /// How long the story runs.
    pub until: Until,
}

/// Runs the demo until `until` or `shutdown`, printing each line through `print`; the in-memory API afterwards.
pub async fn session(
    options: Options,
    shutdown: CancellationToken,
    mut print: impl FnMut(&str),
) -> anyhow::Result<(Outcome, FakeApi)> {
    let fake = kubelet_like_api();
    let (addr, server) =
        fake.serve(options.listen).await.with_context(|| format!("cannot listen on {}", options.listen))?;
    let url = format!("http://{addr}");
    let path = &options.kubeconfig;
    std::fs::write(path, kubeconfig_yaml(&url)).with_context(|| format!("cannot write {}", path.display()))?;
    print(&format!("in-memory API server (a fake, not a cluster) at {url}"));
    print(&format!("kubeconfig written: export KUBECONFIG={}", path.display()));
    print("then: kubectl get gmb -A | kubectl get events -A -w | kubectl describe gmb -n team-a llm-inference\n");
    let config = kube::Config::new(url.parse().context("server URL")?);
    let client = kube::Client::try_from(config).context("client for the in-memory API server")?;
    let stack = Stack::new(fake).with_client(client);
    let stop = stack.shutdown();
    let relay = tokio::spawn(async move {
        shutdown.cancelled().await;
        stop.cancel();
    });
    let (outcome, stack) = scenario::run(stack, options.until, &mut print).await;
    relay.abort();
    let fake = stack.stop().await;
    server.abort();
    print("\nstopped");
    Ok((outcome, fake))
}

/// The command docs/demo.md shows the output of.
pub const DOC_COMMAND: &str = "cargo run -q -p gpubudget-demo -- --until-evicted";
/// The line before the sample in docs/demo.md.
pub const DOC_BEGIN: &str = "<!-- demo output: written by `cargo run -q -p gpubudget-demo -- --until-evicted --update-doc docs/demo.md`, checked by demo/tests/demo.rs -->";
/// The line after it.
pub const DOC_END: &str = "<!-- end of demo output -->";

/// The fenced sample of a page: the command, then what it printed.
pub fn doc_block(printed: &str) -> String {
    format!("```\n$ {DOC_COMMAND}\n{}\n```", printed.trim_end())
}

/// The sample between the markers of `doc` (fences included), if both are there.
pub fn sample_of(doc: &str) -> Option<&str> {
    let start = doc.find(DOC_BEGIN)? + DOC_BEGIN.len();
    let end = start + doc[start..].find(DOC_END)?;
    Some(doc[start..end].trim())
}

/// `doc` with the sample between its markers replaced by `printed`.
pub fn with_sample(doc: &str, printed: &str) -> anyhow::Result<String> {
    let old = sample_of(doc).with_context(|| format!("no `{DOC_BEGIN}` … `{DOC_END}` in the page"))?;
    let start = doc.find(old).expect("the sample is in the page");
    Ok(format!("{}{}{}", &doc[..start], doc_block(printed), &doc[start + old.len()..]))
}

/// Writes `printed` into the page at `path`, between its markers.
pub fn update_doc(path: &Path, printed: &str) -> anyhow::Result<()> {
    let doc = std::fs::read_to_string(path).with_context(|| format!("cannot read {}", path.display()))?;
    let new = with_sample(&doc, printed).with_context(|| path.display().to_string())?;
    std::fs::write(path, new).with_context(|| format!("cannot write {}", path.display()))
}

/// What a run prints that is the same on every run, in three parts: every line but the events and the tables, in
/// order, with the port, the kubeconfig's path and the times (measured on the wall clock, so ±0.2 s from one run
/// to the next) blanked; the tables (`kubectl get gmb -A` and what it showed), in order, times blanked; and the
/// event lines, sorted (two arriving in the same poll are printed in the API's order, which varies).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Comparable {
    /// Lines but events and tables.
    pub lines: Vec<String>,
    /// Each table, its lines joined.
    pub tables: Vec<String>,
    /// Event lines, sorted.
    pub events: Vec<String>,
}

/// [`Comparable`] of a printed text.
pub fn comparable(printed: &str) -> Comparable {
    let mut out = Comparable::default();
    let mut table: Option<String> = None;
    for line in printed.lines().map(str::trim_end) {
        let mut words = line.split_whitespace();
        let second = words.nth(1);
        if line.starts_with("team-") && matches!(second, Some("Warning" | "Normal")) {
            out.events.push(line.to_owned());
            continue;
        }
        let line = blank_varying(line);
        if line.starts_with("$ kubectl get gmb -A") {
            out.tables.extend(table.take());
            table = Some(line);
        } else if let Some(t) = table.as_mut() {
            if line.is_empty() {
                // The blank line after a table ends it (and is the table's: a run may show a table more).
                out.tables.extend(table.take());
            } else {
                t.push('\n');
                t.push_str(&line);
            }
        } else {
            out.tables.extend(table.take());
            out.lines.push(line);
        }
    }
    out.tables.extend(table);
    out.events.sort();
    out
}

/// Where a page's sample (`shown`) and a run (`run`) disagree; none when they agree. A run may print a table more
/// than the page (a state that lasted two polls on a loaded machine: the operator writes the statuses one by one),
/// never one fewer or another: every table the page shows, in its order, and the same last one.
pub fn disagreements(shown: &Comparable, run: &Comparable) -> Vec<String> {
    let mut out = Vec::new();
    if shown.lines != run.lines {
        out.push(format!(
            "lines (times, port, path blanked), the page's then the run's:\n{:#?}\n{:#?}",
            shown.lines, run.lines
        ));
    }
    if shown.events != run.events {
        out.push(format!("events (sorted), the page's then the run's:\n{:#?}\n{:#?}", shown.events, run.events));
    }
    let mut rest = run.tables.iter();
    let in_order = shown.tables.iter().all(|t| rest.any(|r| r == t));
    if !in_order || shown.tables.last() != run.tables.last() {
        out.push(format!(
            "tables, the page's then the run's:\n{}\n\n{}",
            shown.tables.join("\n\n"),
            run.tables.join("\n\n")
        ));
    }
    out
}

/// A line with the port, the kubeconfig's path and a time (`--- 19.4s`, `# at 11.4s`) blanked.
fn blank_varying(line: &str) -> String {
    const URL: &str = "http://127.0.0.1:";
    if let Some(at) = line.find(URL) {
        return format!("{}{URL}PORT", &line[..at]);
    }
    if let Some(at) = line.find("export KUBECONFIG=") {
        return format!("{}export KUBECONFIG=PATH", &line[..at]);
    }
    if let Some(rest) = line.strip_prefix("---") {
        let rest = rest.trim_start();
        if let Some((time, tail)) = rest.split_once("s ")
            && time.parse::<f64>().is_ok()
        {
            return format!("--- TIME {}", tail.trim_start());
        }
    }
    if let Some((head, time)) = line.rsplit_once("# at ")
        && time.strip_suffix('s').is_some_and(|t| t.parse::<f64>().is_ok())
    {
        return format!("{head}# at TIME");
    }
    line.to_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ports_paths_times_and_event_order_are_what_may_differ() {
        let a = "in-memory API server (a fake, not a cluster) at http://127.0.0.1:36155\n\
                 kubeconfig written: export KUBECONFIG=/tmp/x\n\n--- 19.4s  llm-0 is terminating\n\
                 $ kubectl get gmb -A     # at 11.4s\nNAMESPACE   NAME\n\
                 team-a   Warning  GpuMemoryOverBudget      pod/llm-0  a\n\
                 team-b   Warning  GpuMemoryNearBudget      pod/llm-b-0  b\n";
        let b = "in-memory API server (a fake, not a cluster) at http://127.0.0.1:4\n\
                 kubeconfig written: export KUBECONFIG=/tmp/gpubudget-demo.kubeconfig\n\n--- 19.6s  llm-0 is terminating\n\
                 $ kubectl get gmb -A     # at 11.2s\nNAMESPACE   NAME\n\
                 team-b   Warning  GpuMemoryNearBudget      pod/llm-b-0  b\n\
                 team-a   Warning  GpuMemoryOverBudget      pod/llm-0  a\n";
        let agree = |x: &str, y: &str| disagreements(&comparable(x), &comparable(y)).is_empty();
        assert_eq!(comparable(a), comparable(b));
        assert!(agree(a, b));
        let c = b.replace("NAMESPACE   NAME", "NAMESPACE   NAME   SHARE");
        assert!(!agree(a, &c), "a table's columns are compared");
        let d = b.replace("pod/llm-0  a", "pod/llm-0  changed");
        assert!(!agree(a, &d), "an event's text is compared");
        let e = b.replace("terminating", "gone");
        assert!(!agree(a, &e));
        // A run may show a table more (an intermediate state), not one fewer.
        let more = b.replace("$ kubectl", "$ kubectl get gmb -A     # at 10.0s\nNAMESPACE   OTHER\n\n$ kubectl");
        assert!(agree(a, &more), "{:?}", disagreements(&comparable(a), &comparable(&more)));
        assert!(!agree(&more, a), "the page's table is missing from the run");
    }

    #[test]
    fn the_sample_is_replaced_between_the_markers() {
        let doc = format!("intro\n\n{DOC_BEGIN}\n```\nold\n```\n{DOC_END}\n\nafter\n");
        let new = with_sample(&doc, "line 1\nline 2\n").unwrap();
        assert_eq!(
            new,
            format!("intro\n\n{DOC_BEGIN}\n```\n$ {DOC_COMMAND}\nline 1\nline 2\n```\n{DOC_END}\n\nafter\n")
        );
        assert_eq!(sample_of(&new).unwrap(), doc_block("line 1\nline 2"));
        assert!(with_sample("no markers", "x").is_err());
    }
}
