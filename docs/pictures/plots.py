"""The plots of docs/pictures, drawn from the committed result files only (run by generate.sh).

    python3 docs/pictures/plots.py OUTDIR

neighbour.svg  the neighbour's GPU memory while an over-budget pod grows, at 0.25, 1 and 4 GiB/s: budgets alone,
               with pressure eviction, and under MPS without and with the cap the admission webhook sets.
               Read from the raw logs inside e2e/gpu/results/*.tgz (never extracted to disk), written by
               e2e/gpu/pressure.sh and e2e/gpu/mps-caps.sh with the workloads of e2e/gpu/pressure.py.
story.svg      the Evict story on the real node, and every story's place in the run, from
               e2e/cluster/results/*realk8s*.txt (written by e2e/cluster/realk8s.sh).

Everything drawn is a line of those files; nothing is interpolated or made up. Each figure says what it was
measured on. The SVG bytes depend only on the inputs and the pinned matplotlib (docs/pictures/requirements.txt):
svg.hashsalt is fixed and the date left out, so CI can regenerate and compare (.ci/pictures.sh).
"""

import json
import re
import sys
import tarfile
import textwrap
from pathlib import Path

import matplotlib

matplotlib.use("svg")
import matplotlib.patches  # noqa: E402
import matplotlib.pyplot as plt  # noqa: E402
import matplotlib.text  # noqa: E402
from matplotlib import font_manager  # noqa: E402

# Only the fonts matplotlib ships (its DejaVu Sans): a system font of the same name in another version would
# change the glyphs' paths, and so the bytes, from one machine to the next.
font_manager.fontManager.ttflist = [
    f for f in font_manager.fontManager.ttflist if f.fname.startswith(matplotlib.get_data_path())
]

REPO = Path(__file__).resolve().parents[2]
GPU_RESULTS = REPO / "e2e/gpu/results"
CLUSTER_RESULTS = REPO / "e2e/cluster/results"
GIB = 1 << 30

PRESSURE_TGZ = "2026-11-23-h100-pressure-logs.tgz"
CAPS_TGZ = "2026-11-24-h100-mps-caps-raw.tgz"
RATES = ["0.25", "1", "4"]

plt.rcParams.update(
    {
        "svg.hashsalt": "gpubudget",  # ids in the SVG are hashes of this, not random
        "svg.fonttype": "path",  # text as paths: the same on every machine
        "font.family": "DejaVu Sans",  # shipped with matplotlib
        "font.size": 9,
        "axes.titlesize": 9,
        "axes.spines.top": False,
        "axes.spines.right": False,
    }
)


def save(fig, path):
    fig.savefig(path, format="svg", metadata={"Date": None})
    plt.close(fig)


class Tarball:
    """The members of one results tarball, read in memory."""

    def __init__(self, name):
        self.name = name
        self.files = {}
        with tarfile.open(GPU_RESULTS / name) as tar:
            for member in tar.getmembers():
                if member.isfile():
                    self.files[member.name.removeprefix("./")] = tar.extractfile(member).read().decode()

    def jsonl(self, name):
        return [json.loads(line) for line in self.files.get(name, "").splitlines() if line.startswith("{")]

    def header(self):
        """date, gpu (name, driver, memory) and torch from the run's results.txt."""
        fields = {}
        for line in self.files["results.txt"].splitlines():
            key, _, value = line.partition(": ")
            if key in ("date", "gpu", "torch") and value:
                fields[key] = value
        return fields


def run_of(tar, prefix):
    """One case: the grower's, the neighbour's and the agent's lines, with times relative to the grower's jump."""
    grower = tar.jsonl(f"{prefix}grower.jsonl")
    neighbour = tar.jsonl(f"{prefix}neighbour.jsonl")
    agent = tar.jsonl(f"{prefix}agent.jsonl")
    jump = next(e for e in grower if e["event"] == "jumped")
    t0 = jump["t"]
    run = {"t0": t0, "total": jump["total"]}
    run["grower"] = [(e["t"] - t0, e["bytes"] / GIB, e["event"]) for e in grower if "bytes" in e]
    run["holding"] = [(e["t"] - t0, e["bytes"] / GIB) for e in neighbour if e["event"] == "holding"]
    run["oom"] = [(e["t"] - t0, e["held"] / GIB) for e in neighbour if e["event"] == "oom"]
    first = [t for t, _ in run["oom"] if t >= 0]
    run["first_oom"] = first[0] if first else None
    evicting = [
        e
        for e in agent
        if e.get("kind") == "event" and e.get("reason") == "EvictingForGpuMemory" and "grower" in e.get("pod", "")
    ]
    run["evicting"] = evicting[0]["ts_unix"] - t0 if evicting else None
    if evicting:
        free = re.search(r"\(([0-9.]+\s*[KMGT]i)B? free of", evicting[0]["note"])
        run["evicting_free"] = free.group(1) if free else None
    grower_oom = [t for t, _, kind in run["grower"] if kind == "oom" and t >= 0]
    run["grower_first_oom"] = grower_oom[0] if grower_oom else None
    return run


def neighbour_figure(out):
    pressure = Tarball(PRESSURE_TGZ)
    caps = Tarball(CAPS_TGZ)
    ph, ch = pressure.header(), caps.header()
    rows = [
        (pressure, "r{rate}-off-", "budgets alone\n(pressure eviction off)", ph),
        (pressure, "r{rate}-on-", "with pressure eviction\n(5 %, sampled every 250 ms)", ph),
        (caps, "r{rate}_uncapped_", "under MPS, no cap\n(pressure eviction off)", ch),
        (caps, "r{rate}_capped_", "under MPS, capped at 55Gi\n(pressure eviction off)", ch),
    ]
    fig, axes = plt.subplots(len(rows), len(RATES), figsize=(12, 12), sharey=True, sharex="col")
    ends = [0.0] * len(RATES)  # the last logged second of each column, so no panel is cut short
    for r, (tar, pattern, label, header) in enumerate(rows):
        for c, rate in enumerate(RATES):
            ax = axes[r][c]
            prefix = pattern.format(rate=rate.replace(".", "p") if tar is caps else rate)
            run = run_of(tar, prefix)
            t = [p[0] for p in run["grower"]]
            ax.step(t, [p[1] for p in run["grower"]], where="post", color="#b8860b", lw=1.4, label="the grower's tensors")
            if run["holding"]:
                ax.plot(*zip(*run["holding"]), "o", ms=3.5, color="#2e7d32", label="the neighbour got its 16 GiB")
            if run["oom"]:
                ax.plot(*zip(*run["oom"]), "x", ms=7, mew=2, color="#c62828", label="the neighbour met CUDA out of memory")
            ax.axhline(run["total"] / GIB, color="#777777", lw=0.8, ls=":")
            ax.axvline(0, color="#999999", lw=0.6)
            notes = []
            if run["first_oom"] is not None:
                notes.append(f"neighbour's first CUDA OOM {run['first_oom']:.1f} s")
            else:
                notes.append("neighbour never met CUDA OOM")
            if run["evicting"] is not None:
                ax.axvline(run["evicting"], color="#1565c0", lw=1.2, ls="--")
                notes.append(f"eviction decided {run['evicting']:.1f} s ({run['evicting_free']} free)")
            if "capped" in prefix and "uncapped" not in prefix and run["grower_first_oom"] is not None:
                notes.append(f"grower met OOM at its cap {run['grower_first_oom']:.1f} s")
            ax.set_title(f"{rate} GiB/s\n" + "\n".join(notes), loc="left")
            ax.set_ylim(0, 82)
            ends[c] = max(ends[c], *(p[0] for key in ("grower", "holding", "oom") for p in run[key]))
            if c == 0:
                ax.set_ylabel(f"{label}\n\nGiB of tensors held")
            if r == len(rows) - 1:
                ax.set_xlabel("seconds after the grower's jump")
    for c, end in enumerate(ends):
        axes[0][c].set_xlim(-4, end + 1)
    handles, labels = axes[0][0].get_legend_handles_labels()
    handles.append(plt.Line2D([], [], color="#1565c0", ls="--"))
    labels.append("the agent decides the grower's eviction")
    handles.append(plt.Line2D([], [], color="#777777", ls=":"))
    labels.append("the card's memory (CUDA's total)")
    fig.legend(handles, labels, loc="lower center", ncol=3, frameon=False, bbox_to_anchor=(0.5, 0.05))
    gpu, driver, memory = ph["gpu"].split(", ")
    fig.suptitle(
        "A pod over its budget (the grower, 8Gi; 55Gi when capped) fills the GPU; its neighbour, within its 40Gi,\n"
        f"cycles 16 GiB. {gpu} ({memory}), driver {driver}, torch {ph['torch']}; the agent in standalone mode.",
        fontsize=10,
    )
    fig.text(
        0.01,
        0.005,
        f"Rows 1-2: e2e/gpu/pressure.sh on {ph['date']}, e2e/gpu/results/{PRESSURE_TGZ}.\n"
        f"Rows 3-4: e2e/gpu/mps-caps.sh on {ch['date']} (MPS control daemon running), e2e/gpu/results/{CAPS_TGZ}.\n"
        "One run per panel. Each point is a line a workload logged: the grower after each 256 MiB chunk, the neighbour "
        "once per cycle (16 GiB held, or CUDA OOM\nwith what it got). NVML counts each process's CUDA context on top "
        "(about 0.5 GiB). Not plotted: the H200 re-run of 2026-11-26 (1 and 4 GiB/s,\n"
        "e2e/gpu/results/2026-11-26-h200-pressure-f7e2a96.txt; its raw logs are not committed), and a cap with pressure "
        "eviction on (never run).",
        fontsize=7.5,
        va="bottom",
    )
    fig.tight_layout(rect=(0, 0.1, 1, 0.95))
    check_layout(fig, "neighbour.svg")
    save(fig, out / "neighbour.svg")


QUANTITY = {"Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30}


def quantity(text):
    m = re.fullmatch(r"([0-9.]+)(Ki|Mi|Gi)", text)
    return float(m.group(1)) * QUANTITY[m.group(2)] / GIB


def story_run(path):
    """Sections (start second, title) and the Evict story's figures of one realk8s.sh result."""
    text = path.read_text()
    sections, phases = [], []
    for line in text.splitlines():
        # "=== [ 12s] title" (before #55) or "=== [12.2 s] title" (e2e/lib.sh since); realk8s.sh's own sections
        # come before run.sh's and run.sh's clock starts again at 0: keep run.sh's.
        m = re.match(r"=== \[\s*([0-9.]+) ?s\] (.*)", line)
        if m:
            start = round(float(m.group(1)))
            if sections and start < sections[-1][0]:
                sections, phases = [], []
            sections.append((start, m.group(2)))
            continue
        m = re.search(r"sample phase (\d+): llm-evict (\S+),", line)
        if m:
            phases.append((sections[-1][0], int(m.group(1)), quantity(m.group(2))))
    over = re.search(r"GpuMemoryOverBudget on llm-evict \((\S+) of (\S+)\)", text)
    warn = re.search(r"llm-evict: using \S+ of \S+ \(budget [^)]*\), at or above the (\d+)% warning", text)
    stopped = re.search(r"sample over the limit written to llm-evict's container stopped: (\d+) s", text)
    over_limit = re.search(r"after overLimitSeconds \((\d+) s\) the agent evicts llm-evict", text)
    node = re.search(r"\n\s+n1\s+Ready\s+\S+\s+\S+\s+(v\S+)\s+\S+\s+\S+\s+(.+?)\s{2,}(\S+)\s+(containerd://\S+)", text)
    return {
        "file": path.name,
        # The file's name: what the caption and docs/pictures/README.md cite (a commit in a first line may be
        # another than the one the file is named after).
        "label": path.name.removesuffix(".txt"),
        "sections": sections,
        "phases": phases,
        "limit": quantity(over.group(2)),
        "warn_percent": int(warn.group(1)) if warn else None,
        "stopped_after": int(stopped.group(1)),
        "over_limit_seconds": int(over_limit.group(1)),
        "node": f"kubelet {node.group(1)}, {node.group(4).replace('://', ' ')}, {node.group(2)}" if node else "",
    }


def short(title):
    """A section's title up to its first parenthesis or colon: the story's name, never cut (a long one is wrapped)."""
    title = re.sub(r"\s*\(.*", "", title)
    return re.sub(r":.*", "", title)


def wrapped(text, width):
    return "\n".join(textwrap.wrap(text, width, break_on_hyphens=False))


STATES = [("Within", "#8fbf8f"), ("Near", "#ef9a3c"), ("Over", "#d84b4b")]


def story_figure(out):
    # By date; on one date, the file without a commit in its name was written first (git log).
    paths = sorted(CLUSTER_RESULTS.glob("*realk8s*.txt"), key=lambda p: (p.name[:10], len(p.name)))
    runs = [story_run(p) for p in paths]
    # Every committed run, each its own colour (tab10, then tab20, are fixed: the picture is reproducible).
    colors = list(plt.get_cmap("tab10" if len(runs) <= 10 else "tab20").colors)
    assert len(runs) <= len(colors), f"{len(runs)} runs: more than {len(colors)} colours"
    stops = sorted(run["stopped_after"] for run in runs)
    n = len(runs)
    fig, (top, bottom) = plt.subplots(
        2, 1, figsize=(11, 13.5), gridspec_kw={"height_ratios": [1, 1.9]}, constrained_layout=True
    )

    # The Evict story, one lane per run (so that no run hides another): llm-evict's replayed usage, each sample
    # phase a bar coloured by the state it means, aligned at the sample that goes over the limit; the square: the
    # container stopped.
    run = runs[-1]
    limit, warn_percent = run["limit"], run["warn_percent"] or 100
    assert all(r["limit"] == limit and (r["warn_percent"] or 100) == warn_percent for r in runs), "one budget in all runs"

    def state(v):
        return "Over" if v > limit else "Near" if v >= limit * warn_percent / 100 else "Within"

    fill = dict(STATES)
    first = 0
    for i, run in enumerate(runs):
        over_at = next(t for t, _, v in run["phases"] if v > run["limit"])
        phases = [(t - over_at, v) for t, _, v in run["phases"] if t <= over_at]
        stop = run["stopped_after"]
        ends = [t for t, _ in phases[1:]] + [stop]
        for (start, v), end in zip(phases, ends):
            top.barh(i, end - start, left=start, height=0.62, color=fill[state(v)], edgecolor="white", lw=0.8)
            top.text((start + end) / 2, i, f"{v:g}Gi", ha="center", va="center", fontsize=7.5)
        top.plot([stop], [i], "s", color="black", ms=6)
        top.text(stop + 0.6, i, f"stopped {stop} s after", va="center", fontsize=8)
        first = min(first, phases[0][0])
    top.axvspan(0, run["over_limit_seconds"], color="#c62828", alpha=0.08, lw=0)
    top.axvline(0, color="#c62828", lw=0.8)
    top.text(0.3, -0.5, f"overLimitSeconds: {run['over_limit_seconds']} s", color="#c62828", fontsize=8, va="bottom")
    top.set_yticks(range(n))
    top.set_yticklabels([r["label"] for r in runs], fontsize=8)
    for label, color in zip(top.get_yticklabels(), colors):
        label.set_color(color)
    top.set_ylim(n - 0.4, -1.3)
    top.set_xlim(first - 1, max(stops) + 10)
    top.set_xlabel("seconds after the over-limit sample was written (kubectl apply of the ConfigMap the agent replays)")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for _, c in STATES]
    handles.append(plt.Line2D([], [], marker="s", color="black", ls=""))
    top.legend(
        handles,
        [
            f"Within: below {warn_percent} % of the limit",
            f"Near: at or above {warn_percent} %",
            f"Over the limit ({limit:g}Gi, Evict)",
            "the container stopped",
        ],
        loc="upper left",
        bbox_to_anchor=(0, -0.12),
        ncol=4,
        frameon=False,
        fontsize=8,
    )
    top.set_title(
        "The Evict story: llm-evict (budget llm-inference: 8Gi, Evict) goes Near, then Over, and is evicted; one "
        "row per run.\nEach bar is a replayed sample phase, placed at the run.sh section that wrote it (whole "
        "seconds); the square: the container\nstopped (no host process left in its cgroup; polled every 2 s). The "
        "events' own times are not in the logs: run.sh checks them,\nit does not time them.",
        loc="left",
    )

    # Every story of the run, every run: where each section started and ended.
    titles = []
    for run in runs:
        for _, title in run["sections"]:
            if short(title) not in titles and not title.startswith(("PASS", "cleanup")):
                titles.append(short(title))
    height = 0.8 / len(runs)
    for i, (run, color) in enumerate(zip(runs, colors)):
        secs = run["sections"]
        for (start, title), (end, _) in zip(secs, secs[1:]):
            if title.startswith(("PASS", "cleanup")):
                continue
            y = titles.index(short(title)) - 0.4 + i * height
            bottom.barh(y, max(end - start, 0.6), left=start, height=height * 0.9, color=color, align="edge")
        passed = next((t for t, title in secs if title.startswith("PASS")), None)
        bottom.plot([], [], color=color, lw=6, label=f"{run['label']} (PASS at {passed} s) — {run['file']}")
        over_at = next(t for t, n, v in run["phases"] if v > run["limit"])
        evict_row = next(j for j, t in enumerate(titles) if t.startswith("Evict story"))
        bottom.plot([over_at + run["stopped_after"]], [evict_row - 0.4 + (i + 0.5) * height], "s", color="black", ms=4)
    bottom.set_yticks(range(len(titles)))
    bottom.set_yticklabels([wrapped(t, 34) for t in titles], fontsize=8)
    bottom.set_ylim(len(titles) - 0.5, -0.5)
    bottom.set_xlabel("seconds since run.sh started (its section stamps)")
    bottom.set_title(
        f"Every story of the run (e2e/cluster/run.sh on the real node), all {n} committed runs, one colour each;\n"
        f"the black square: llm-evict's container stopped ({stops[0]}–{stops[-1]} s after going over)",
        loc="left",
    )
    bottom.legend(loc="upper center", bbox_to_anchor=(0.5, -0.06), frameon=False, fontsize=8)
    fig.suptitle(
        f"bash e2e/cluster/realk8s.sh: one real node, {runs[-1]['node']};\n"
        "the chart installed by helm, images from the release binaries; GPU usage replayed by host PID (no GPU)",
        fontsize=10,
    )
    check_layout(fig, "story.svg")
    save(fig, out / "story.svg")


def _segments(line):
    """The straight pieces of a drawn line, in display coordinates."""
    xy = line.get_transform().transform(line.get_path().vertices)
    return list(zip(xy[:-1], xy[1:]))


def _shared_length(a, b, tolerance=1.5):
    """How long two horizontal or vertical segments lie on one another (display units)."""
    (ax0, ay0), (ax1, ay1) = a
    (bx0, by0), (bx1, by1) = b
    for along, across in ((0, 1), (1, 0)):
        pa, pb = (ax0, ay0), (bx0, by0)
        qa, qb = (ax1, ay1), (bx1, by1)
        if abs(pa[across] - qa[across]) < 1e-6 and abs(pb[across] - qb[across]) < 1e-6:
            if abs(pa[across] - pb[across]) <= tolerance:
                lo = max(min(pa[along], qa[along]), min(pb[along], qb[along]))
                hi = min(max(pa[along], qa[along]), max(pb[along], qb[along]))
                if hi - lo > 0:
                    return hi - lo
    return 0.0


def check_layout(fig, name):
    """Fails (and so generate.sh and CI) where a picture would be hard to read: a text outside the figure (a title
    cut off), a text cut short with "…", two texts on one another, two bars on one another, or two series' lines
    drawn on one another for more than a few points (one hides the other). Measured with the renderer's own
    extents of the laid-out figure (DejaVu Sans), not estimated."""
    fig.draw_without_rendering()
    frame = fig.bbox
    problems = []
    # Tick labels outside their axis' view are not drawn (matplotlib keeps them, visible, where they were).
    hidden = set()
    for ax in fig.axes:
        for axis in (ax.xaxis, ax.yaxis):
            lo, hi = sorted(axis.get_view_interval())
            for tick in axis.get_major_ticks() + axis.get_minor_ticks():
                if not lo - 1e-9 <= tick.get_loc() <= hi + 1e-9:
                    hidden.update((id(tick.label1), id(tick.label2)))
    texts = []
    for t in fig.findobj(matplotlib.text.Text):
        if not t.get_visible() or not t.get_text().strip() or id(t) in hidden:
            continue
        box = t.get_window_extent()
        texts.append((t.get_text(), box))
        if "…" in t.get_text():
            problems.append(f"cut short: {t.get_text()!r}")
        if box.x0 < frame.x0 - 0.5 or box.y0 < frame.y0 - 0.5 or box.x1 > frame.x1 + 0.5 or box.y1 > frame.y1 + 0.5:
            problems.append(f"outside the figure ({box.bounds} in {frame.bounds}): {t.get_text()!r}")
    for i, (a, box_a) in enumerate(texts):
        for b, box_b in texts[i + 1 :]:
            w = min(box_a.x1, box_b.x1) - max(box_a.x0, box_b.x0)
            h = min(box_a.y1, box_b.y1) - max(box_a.y0, box_b.y0)
            if w > 1 and h > 1:
                problems.append(f"texts overlap: {a!r} {box_a.bounds} and {b!r} {box_b.bounds}")
    for ax in fig.axes:
        bars = [bar.get_window_extent() for container in ax.containers for bar in container.patches]
        for i, a in enumerate(bars):
            for b in bars[i + 1 :]:
                if min(a.x1, b.x1) - max(a.x0, b.x0) > 0.5 and min(a.y1, b.y1) - max(a.y0, b.y0) > 0.5:
                    problems.append(f"bars overlap in {ax.get_title(loc='left')[:40]!r}: {a.bounds} and {b.bounds}")
        lines = [ln for ln in ax.get_lines() if not ln.get_label().startswith("_") and ln.get_linestyle() not in ("None", "")]
        for i, a in enumerate(lines):
            for b in lines[i + 1 :]:
                shared = sum(_shared_length(sa, sb) for sa in _segments(a) for sb in _segments(b))
                if shared > 3:
                    problems.append(f"lines drawn on one another for {shared:.0f} pt: {a.get_label()!r} and {b.get_label()!r}")
    if problems:
        raise SystemExit(f"plots.py: {name} is not readable:\n  " + "\n  ".join(problems))


def main():
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).parent
    out.mkdir(parents=True, exist_ok=True)
    neighbour_figure(out)
    story_figure(out)


if __name__ == "__main__":
    main()
