"""The table of e2e/gpu/pace.sh: detection latency and agent CPU, old pace against new. Usage: pace.py WORK."""

import os
import sys

from analyze import lines, pct  # e2e/gpu/analyze.py, beside this file

PRESSURE_TRANSITION_S = 0.5  # pace.sh's --pressure-transition: the end of pressure is told this much later


def latencies(marks, decisions, following, lag=0.0):
    """Seconds from each workload mark to the first decision after it (before the next mark + 1 s)."""
    out, missed = [], 0
    for k, mark in enumerate(marks):
        until = following[k]["t"] if k < len(following) else float("inf")
        hit = next((d for d in decisions if mark["t"] - 0.05 <= d <= until + 1), None)
        if hit is None:
            missed += 1
        else:
            out.append(hit - mark["t"] - lag)
    return out, missed


def row(label, values, missed):
    if not values:
        return f"| {label} | no data | | | |"
    extra = f", {missed} missed" if missed else ""
    return (f"| {label} | {len(values)}{extra} | {pct(values, 50) * 1000:.0f} ms | {pct(values, 99) * 1000:.0f} ms "
            f"| {max(values) * 1000:.0f} ms |")


def main(work):
    out = []
    crossings = [
        ("near", "team-n/near", "pods", {"Over"}, {"Near", "Within"}),
        ("far", "team-f/far", "pods", {"Over"}, {"Near", "Within"}),
    ]
    if os.path.exists(os.path.join(work, "near.jsonl")):
        out += ["", "Detection latency: from the workload's log line (after torch.cuda.synchronize()) to the decision.", "",
                "| crossing | agent | n | p50 | p99 | max |", "| --- | --- | --- | --- | --- | --- |"]
        for name, pod, run, up_to, down_to in crossings:
            log = lines(os.path.join(work, f"{name}.jsonl"))
            ups = [e for e in log if e["event"] == "up"]
            downs = [e for e in log if e["event"] == "down"]
            for agent in ("old", "new"):
                d = lines(os.path.join(work, f"{run}-{agent}.jsonl"))
                t = [x for x in d if x.get("kind") == "transition" and x.get("pod") == pod]
                up = [x["ts_unix"] for x in t if x["to"] in up_to]
                down = [x["ts_unix"] for x in t if x["to"] in down_to]
                out.append(row(f"{name}: pod crosses up | {agent}", *latencies(ups, up, downs)))
                out.append(row(f"{name}: pod back under | {agent}", *latencies(downs, down, ups[1:])))
        log = lines(os.path.join(work, "gpu.jsonl"))
        ups = [e for e in log if e["event"] == "up"]
        downs = [e for e in log if e["event"] == "down"]
        for agent in ("old", "new"):
            d = lines(os.path.join(work, f"gpu-{agent}.jsonl"))
            began = [x["ts_unix"] for x in d if x.get("kind") == "node_event" and x.get("reason") == "GpuMemoryPressure"]
            ended = [x["ts_unix"] for x in d
                     if x.get("kind") == "node_event" and x.get("reason") == "GpuMemoryPressureEnded"]
            out.append(row(f"gpu: free memory under the threshold | {agent}", *latencies(ups, began, downs)))
            out.append(row(f"gpu: back above (less the {PRESSURE_TRANSITION_S} s transition) | {agent}",
                           *latencies(downs, ended, ups[1:], PRESSURE_TRANSITION_S)))
    cpu = lines(os.path.join(work, "cpu.jsonl"))
    if cpu:
        out += ["", "Agent CPU (its threads' schedstat over the window), % of one core; both agents at once.", "",
                "| processes | pods | old (250 ms) | new (250 ms / 20 ms near) | new agent's interval |",
                "| --- | --- | --- | --- | --- |"]
        for c in cpu:
            old = 100 * c["old_ns"] / c["wall_ns"]
            new = 100 * c["new_ns"] / c["wall_ns"]
            out.append(f"| {c['processes']} | {c['case']} | {old:.2f} % | {new:.2f} % | {c['new_interval_s']} s |")
    for agent in ("old", "new"):
        for run in ("pods", "gpu", "cpu"):
            stats = next((x for x in lines(os.path.join(work, f"{run}-{agent}.jsonl")) if x.get("kind") == "stats"), None)
            if stats:
                t = stats["tick_us"]
                out.append(f"- {run} {agent}: {stats['ticks']} ticks ({stats.get('fast_ticks', 0)} fast), "
                           f"tick p50 {t['p50']} us, p99 {t['p99']} us")
    print("\n".join(out))


if __name__ == "__main__":
    main(sys.argv[1])
