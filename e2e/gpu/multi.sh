#!/usr/bin/env bash
# A pod on two GPUs, for real (issue 12). Run as root on a host with two NVIDIA GPUs, cgroup v2, python3 + torch:
#
#   cargo build -p gpubudget-agent --release && mkdir -p carry && cp target/release/gpubudget-agent carry/
#   OUT=/tmp/out GPUBUDGET_AGENT=carry/gpubudget-agent bash e2e/gpu/multi.sh
#
# team-a/spread-0 (budget 30Gi, Evict, overLimitSeconds 20) holds 20 GiB on GPU 0 and 20 GiB on GPU 1: over in
# total, under on each GPU. team-b/single-0 (budget 16Gi) holds 10 GiB on GPU 1. The agent runs standalone
# with /metrics; the script stands in for the kubelet. Timeline:
#   1. all up: the agent says spread-0 is over (the event names both GPUs); top and /metrics show the split;
#   2. spread-0's GPU 1 process is killed: only GPU 1's share of spread-0 changes (single-0 is untouched), and
#      spread-0 is back within its budget;
#   3. a new 20 GiB process of spread-0 on GPU 1: over again, and evicted (its processes then killed).
# Results in $OUT/results.txt; raw files in $OUT/multi-raw.tgz.
set -euo pipefail
cd "$(dirname "$0")/../.."

OUT=${OUT:-$(mktemp -d /tmp/gpubudget-multi-out.XXXX)}
AGENT=${GPUBUDGET_AGENT:-carry/gpubudget-agent}
WORK=$(mktemp -d /tmp/gpubudget-multi.XXXX)
mkdir -p "$OUT"
# shellcheck source=e2e/gpu/lib.sh
source e2e/gpu/lib.sh
ADMIN=127.0.0.1:9409
AGENT_PID=""
cleanup() {
  [ -z "$AGENT_PID" ] || kill "$AGENT_PID" 2>/dev/null
  lib_cleanup
  tar -C "$WORK" -czf "$OUT/multi-raw.tgz" . 2>/dev/null
  cp -f "$WORK/results.txt" "$OUT/" 2>/dev/null
  rm -rf "$WORK"
}
trap cleanup EXIT
[ -x "$AGENT" ] || die "no agent binary at $AGENT"
[ "$(nvidia-smi -L | wc -l)" -ge 2 ] || die "needs two GPUs"

pod team-a/spread-0 1a2b3c4d-0000-4000-8000-000000000131
pod team-b/single-0 1a2b3c4d-0000-4000-8000-000000000132
cat > "$WORK/budgets.yaml" <<'YAML'
apiVersion: gpubudget.io/v1alpha1
kind: GpuMemoryBudget
metadata: {name: spread, namespace: team-a}
spec: {selector: {}, limit: 30Gi, overLimitSeconds: 20, evictionGracePeriodSeconds: 5}
---
apiVersion: gpubudget.io/v1alpha1
kind: GpuMemoryBudget
metadata: {name: single, namespace: team-b}
spec: {selector: {}, limit: 16Gi}
YAML
HOLD=(python3 -u e2e/gpu/workload.py hold)
now() { date +%s.%N; }
look() { # step: top, /metrics and nvidia-smi
  "$AGENT" top --once --output json --no-api > "$WORK/$1-top.json"
  python3 -c "import urllib.request,sys; sys.stdout.write(urllib.request.urlopen('http://$ADMIN/metrics').read().decode())" \
    > "$WORK/$1-metrics.txt" || say "no metrics"
  nvidia-smi --query-compute-apps=gpu_uuid,pid,used_memory --format=csv,noheader,nounits > "$WORK/$1-smi.csv"
}
has() { grep -q "$1" "$WORK/agent.jsonl" 2>/dev/null; }
until_said() { until_ok "$2" has "$1" || die "agent never said $1"; } # until_said PATTERN SECONDS


say "step 1: spread-0 on GPU 0 and GPU 1 (20 GiB each), single-0 on GPU 1 (10 GiB)"
start s0 team-a/spread-0 CUDA_VISIBLE_DEVICES=0 -- "${HOLD[@]}" --gib 20
start s1 team-a/spread-0 CUDA_VISIBLE_DEVICES=1 -- "${HOLD[@]}" --gib 20
start x1 team-b/single-0 CUDA_VISIBLE_DEVICES=1 -- "${HOLD[@]}" --gib 10
workloads_ready s0 s1 x1
"$AGENT" standalone --budgets "$WORK/budgets.yaml" --pods "$WORK/pods.yaml" --node-name "$NODE" --interval 250ms \
  --admin-addr "$ADMIN" --log-usage --output "$WORK/agent.jsonl" 2> "$WORK/agent.err" &
AGENT_PID=$!
until_said GpuMemoryOverBudget 20
sleep 1
look step1

say "step 2: spread-0's GPU 1 process killed"
echo "{\"event\": \"killed\", \"t\": $(now)}" > "$WORK/kill.jsonl"
# shellcheck disable=SC2154 # PID_s1 is set by lib.sh's start (printf -v)
kill -9 "$PID_s1"
until_said GpuMemoryWithinBudget 10
sleep 1
look step2

say "step 3: spread-0 back on GPU 1; waiting for its eviction"
start s1b team-a/spread-0 CUDA_VISIBLE_DEVICES=1 -- "${HOLD[@]}" --gib 20
workloads_ready s1b
echo "{\"event\": \"back\", \"t\": $(now)}" >> "$WORK/kill.jsonl"
until_said '"kind":"evict"' 60
echo "{\"event\": \"evicted\", \"t\": $(now)}" >> "$WORK/kill.jsonl"
look step3
# shellcheck disable=SC2154 # set by lib.sh's start (printf -v)
kill -TERM "$PID_s0" "$PID_s1b" 2>/dev/null || true
sleep 3
look step4
kill "$AGENT_PID"; wait "$AGENT_PID" 2>/dev/null || true; AGENT_PID=""

{ echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  nvidia-smi --query-gpu=index,name,driver_version,memory.total,uuid --format=csv,noheader | sed 's/^/gpu: /'
  echo "agent: $("$AGENT" --version)"; echo "torch: $(python3 -c 'import torch; print(torch.__version__)')"; } > "$WORK/results.txt"
python3 - "$WORK" >> "$WORK/results.txt" <<'PY'
import json, sys
work = sys.argv[1]
GIB = 1 << 30
def lines(path):
    try:
        return [json.loads(l) for l in open(path) if l.strip().startswith("{")]
    except FileNotFoundError:
        return []
agent = lines(f"{work}/agent.jsonl")
marks = {e["event"]: e["t"] for e in lines(f"{work}/kill.jsonl")}
print("\n| step | pod | total | GPU 0 | GPU 1 | top vs nvidia-smi |")
print("| --- | --- | --- | --- | --- | --- |")
for step in ("step1", "step2", "step3", "step4"):
    try:
        top = json.load(open(f"{work}/{step}-top.json"))
    except (FileNotFoundError, json.JSONDecodeError):
        continue
    smi = {}
    for row in open(f"{work}/{step}-smi.csv"):
        uuid, pid, mib = [x.strip() for x in row.split(",")]
        smi[int(pid)] = int(mib)
    diffs = [abs((p["bytes"] or 0) / (1 << 20) - smi[p["pid"]]) for p in top["processes"] if p["pid"] in smi]
    agree = f"{len(diffs)} processes, max diff {max(diffs):.0f} MiB" if diffs else "–"
    for p in top["pods"]:
        g = p["by_gpu"]
        name = {"131": "spread-0", "132": "single-0"}.get(p["uid"][-3:], p["uid"])
        print(f"| {step} | {name} | {p['used_bytes'] / GIB:.2f} GiB | {g.get('0', 0) / GIB:.2f} GiB | {g.get('1', 0) / GIB:.2f} GiB | {agree} |")
print()
for e in agent:
    if e.get("kind") in ("event", "evict", "node_event", "transition"):
        t = e.get("ts_unix", 0)
        rel = ", ".join(f"{t - v:+.2f} s from {k}" for k, v in marks.items() if abs(t - v) < 120)
        print(f"- {e['kind']} {e.get('reason', '')} {e.get('pod', '')} {e.get('from', '')}{'→' if e.get('to') else ''}{e.get('to', '')} [{rel}] {e.get('note', '')}".rstrip())
print()
for step in ("step1", "step2"):
    try:
        for m in open(f"{work}/{step}-metrics.txt"):
            if m.startswith(("gpubudget_pod_gpu_memory_bytes", "gpubudget_gpu_sampled", "gpubudget_gpu_unaccounted_bytes")):
                print(f"{step} metric {m.rstrip()}")
    except FileNotFoundError:
        pass
PY
cat "$WORK/results.txt"
