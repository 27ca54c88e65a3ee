#!/usr/bin/env python3
"""Checks the output of e2e/gpu/run.sh and prints the summary table (last). Exit status 1 if a check fails.

Reads, in the work directory: expected.json (pods, processes), pids (name pid), <name>.log (workloads),
smi.csv (nvidia-smi --query-compute-apps=pid,used_memory, MiB), top.json (gpubudget-agent top --once
--output json --no-api), decisions.jsonl (gpubudget-agent standalone).
"""
import json
import math
import os
import sys

MIB = 1 << 20
GIB = 1 << 30
# Lines carry the wall-clock time they were written, after the tick's NVML call (up to ~30 ms while another
# process allocates); the agent's own timers run on the monotonic clock of the tick's start.
JITTER = 0.05


def human(n):
    for unit, scale in (("Gi", GIB), ("Mi", MIB)):
        if n >= scale:
            return f"{n / scale:.1f}{unit}"
    return f"{n}B"


def pct(values, p):
    """Nearest-rank percentile."""
    s = sorted(values)
    if not s:
        return float("nan")
    return s[max(1, math.ceil(p / 100 * len(s))) - 1]


def lines(path):
    out = []
    if not os.path.exists(path):
        return out
    with open(path) as f:
        for line in f:
            line = line.strip()
            if line.startswith("{"):
                try:
                    out.append(json.loads(line))
                except json.JSONDecodeError:
                    pass
    return out


def main(work):
    expected = json.load(open(os.path.join(work, "expected.json")))
    pids = {}
    for line in open(os.path.join(work, "pids")):
        name, pid = line.split()
        pids[name] = int(pid)
    logs = {name: lines(os.path.join(work, f"{name}.log")) for name in pids}
    rows = []  # (check, ok: True/False/None, detail)

    # (a) bytes per process, nvidia-smi vs the agent (top --output json), and attribution.
    smi = {}
    for line in open(os.path.join(work, "smi.csv")):
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 2 and parts[0].isdigit() and parts[1].isdigit():
            smi[int(parts[0])] = int(parts[1])
    top = json.load(open(os.path.join(work, "top.json")))
    agent_bytes = {}
    agent_pod = {}
    for p in top["processes"]:
        if p.get("pid") is not None:
            agent_bytes[p["pid"]] = agent_bytes.get(p["pid"], 0) + p["bytes"]
            agent_pod[p["pid"]] = p.get("pod", "")
    diffs, missing, detail_rows = [], [], []
    for name, pid in sorted(pids.items()):
        if pid not in smi or pid not in agent_bytes:
            missing.append(name)
            continue
        diff = agent_bytes[pid] / MIB - smi[pid]
        diffs.append(abs(diff))
        detail_rows.append(f"{name}: pid {pid} nvidia-smi {smi[pid]} MiB, agent {agent_bytes[pid]} B ({agent_bytes[pid] / MIB:.1f} MiB)")
    extra = sorted(set(smi) - set(agent_bytes))
    ok_a = not missing and not extra and all(d < 1 for d in diffs)
    rows.append(("(a) per-process bytes = nvidia-smi", ok_a,
                 f"{len(diffs)}/{len(pids)} processes, max diff {max(diffs or [0]):.2f} MiB"
                 + (f"; missing {missing}" if missing else "") + (f"; only in nvidia-smi {extra}" if extra else "")))
    wrong = []
    for name, want in expected["processes"].items():
        pid = pids.get(name)
        want_uid = expected["pods"][want["pod"]]["uid"] if want.get("pod") else ""
        if agent_pod.get(pid, None) != want_uid:
            wrong.append(f"{name}: got {agent_pod.get(pid)!r}, want {want_uid!r}")
    attributed = sum(1 for w in expected["processes"].values() if w.get("pod"))
    rows.append(("(a) PID -> pod through kubelet cgroups", not wrong,
                 f"{attributed} in their pod's cgroup, {len(expected['processes']) - attributed} host process unattributed"
                 + (f"; wrong: {wrong}" if wrong else "")))

    # Reserved, not allocated, is what counts.
    freed_ready = next((e for e in logs.get("freed-main", []) if e["event"] == "ready"), None)
    freed_pid = pids.get("freed-main")
    if freed_ready and freed_pid in agent_bytes:
        ok = freed_ready["allocated"] == 0 and agent_bytes[freed_pid] >= freed_ready["reserved"]
        rows.append(("freed 6 GiB: reserved != allocated, counted", ok,
                     f"torch allocated {human(freed_ready['allocated'])}, reserved {human(freed_ready['reserved'])}; "
                     f"NVML {human(agent_bytes[freed_pid])}"))
    else:
        rows.append(("freed 6 GiB: reserved != allocated, counted", False, "no data"))

    # Decisions.
    decisions = lines(os.path.join(work, "decisions.jsonl"))
    transitions = [d for d in decisions if d.get("kind") == "transition"]
    by_pod = {}
    for t in transitions:
        by_pod.setdefault(t["pod"], []).append(t)

    def states(pod):
        return [t["to"] for t in by_pod.get(pod, [])]

    hold_final = (states("team-a/hold") or ["Within"])[-1]
    rows.append(("two containers summed, under budget", hold_final == "Within",
                 f"team-a/hold stays {hold_final}; " + ", ".join(
                     f"{u['usage_bytes'] and human(u['usage_bytes'])}" for u in
                     [d for d in decisions if d.get("kind") == "usage" and d["pod"] == "team-a/hold"][-1:])))
    rows.append(("freed pod near its budget", "Near" in states("team-a/freed"),
                 f"team-a/freed: {' -> '.join(['Within'] + states('team-a/freed'))}"))

    step = by_pod.get("team-b/stepper", [])
    over_t = next((t["ts_unix"] for t in step if t["to"] == "Over"), None)
    evict_t = next((t["ts_unix"] for t in step if t["to"] == "Evicting"), None)
    evicts = [d for d in decisions if d.get("kind") == "evict" and d["pod"] == "team-b/stepper"]
    took = (evict_t - over_t) if over_t is not None and evict_t is not None else float("nan")
    ok = (states("team-b/stepper")[:3] == ["Near", "Over", "Evicting"] and len(evicts) == 1
          and evicts[0].get("grace_period_seconds") == 30 and 2.0 - JITTER <= took <= 2.5)
    rows.append(("grows past budget: Near, Over, Evicting", ok,
                 f"{' -> '.join(['Within'] + states('team-b/stepper'))}; over->evicting "
                 f"{took:.2f} s (overLimitSeconds 2); "
                 f"{len(evicts)} eviction, grace {evicts[0].get('grace_period_seconds') if evicts else None}s"))

    reasons = sorted({d["reason"] for d in decisions if d.get("kind") == "event"})
    want_reasons = {"GpuMemoryNearBudget", "GpuMemoryOverBudget", "EvictingForGpuMemory", "GpuMemoryWithinBudget"}
    rows.append(("event reasons", want_reasons <= set(reasons), ", ".join(reasons)))

    # (b) detection latency over the crossings.
    crosser = logs.get("crosser-main", [])
    cross = by_pod.get("team-c/crosser", [])
    ups = [e for e in crosser if e["event"] == "up"]
    downs = [e for e in crosser if e["event"] == "down"]

    def latencies(events, to_states, next_events):
        out, missed = [], 0
        for k, e in enumerate(events):
            until = next_events[k]["t"] if k < len(next_events) else float("inf")
            hit = next((t["ts_unix"] for t in cross if t["to"] in to_states and e["t"] - 0.1 <= t["ts_unix"] <= until + 1), None)
            if hit is None:
                missed += 1
            else:
                out.append(hit - e["t"])
        return out, missed

    up_lat, up_missed = latencies(ups, {"Over"}, downs)
    down_lat, down_missed = latencies(downs, {"Within", "Near"}, ups[1:])
    ok = len(up_lat) >= 20 and up_missed == 0 and pct(up_lat, 99) <= 0.5
    rows.append((f"(b) detection latency, crossing up (n={len(up_lat)})", ok,
                 f"p50 {pct(up_lat, 50):.3f} s, p99 {pct(up_lat, 99):.3f} s, max {max(up_lat or [float('nan')]):.3f} s"
                 + (f", {up_missed} missed" if up_missed else "")))
    rows.append((f"    detection latency, back under (n={len(down_lat)})", None,
                 f"p50 {pct(down_lat, 50):.3f} s, p99 {pct(down_lat, 99):.3f} s, max {max(down_lat or [float('nan')]):.3f} s"
                 + (f", {down_missed} missed" if down_missed else "")))

    stats = next((d for d in decisions if d.get("kind") == "stats"), None)
    start = next((d for d in decisions if d.get("kind") == "start"), {})
    if stats:
        s, t = stats["sample_us"], stats["tick_us"]
        rows.append(("cost per tick during the run (1 GPU)", None,
                     f"NVML sample p50 {s['p50']} us, p99 {s['p99']} us; whole tick p50 {t['p50']} us, p99 {t['p99']} us; "
                     f"{stats['sampled']}/{stats['ticks']} ticks at {start.get('interval_ms')} ms "
                     f"({stats.get('fast_ticks', 0)} of them at {start.get('interval_near_ms')} ms, near a threshold); "
                     f"/proc reads: {stats['proc_reads']['stat']} stat, {stats['proc_reads']['cgroup']} cgroup"))

    idle = lines(os.path.join(work, "idle-stats.json"))
    if idle:
        s, t = idle[0]["sample_us"], idle[0]["tick_us"]
        rows.append(("cost per tick, steady state (10 ms)", None,
                     f"NVML sample p50 {s['p50']} us, p99 {s['p99']} us, max {s['max']} us; whole tick p50 {t['p50']} us, "
                     f"p99 {t['p99']} us; n={s['n']}"))

    with open(os.path.join(work, "latency.json"), "w") as f:
        json.dump({"up": up_lat, "down": down_lat}, f)
    width = max(len(r[0]) for r in rows)
    text = ["", "=== gpubudget real-GPU check: " + expected.get("machine", ""),
            *detail_rows, "", f"{'check':<{width}}  result  detail"]
    for check, ok, detail in rows:
        result = "info" if ok is None else ("PASS" if ok else "FAIL")
        text.append(f"{check:<{width}}  {result:<6}  {detail}")
    failed = [r for r in rows if r[1] is False]
    text.append("")
    text.append("ALL CHECKS PASSED" if not failed else f"{len(failed)} CHECK(S) FAILED")
    summary = "\n".join(text) + "\n"
    with open(os.path.join(work, "summary.txt"), "w") as f:
        f.write(summary)
    print(summary)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
