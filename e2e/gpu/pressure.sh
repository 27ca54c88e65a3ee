#!/usr/bin/env bash
# Pressure eviction on a real GPU (issue 14). Run as root on a host with an NVIDIA GPU, cgroup v2, python3 + torch:
#
#   cargo build -p gpubudget-agent --release && mkdir -p carry && cp target/release/gpubudget-agent carry/
#   OUT=/tmp/out GPUBUDGET_AGENT=carry/gpubudget-agent bash e2e/gpu/pressure.sh
#
# Two pods in kubelet-shaped cgroups (as e2e/gpu/run.sh makes them), the agent in standalone mode at 250 ms:
#   team-n/neighbour  budget 40Gi; cycles 16 GiB: allocate, hold 1 s, free and empty_cache, 0.5 s, again
#   team-g/grower     budget 8Gi (overLimitSeconds 600: the budget's own timer never fires in a run); jumps to
#                     JUMP GiB (default: the card's memory less 28 GiB), then climbs at RATE GiB/s
# For each RATE (RATES, GiB/s) the case runs three times (MODES): pressure eviction off (--pressure-hard off),
# and on (the default hard threshold, 5 % of the GPU; pressure grace GRACE s) at the old pace (a fixed 250 ms:
# --interval-near off) and at the new one (250 ms, 20 ms while the GPU's free memory is near the threshold or
# falling toward it: issue 36). The script stands in for the kubelet: when
# the agent decides to evict the grower it sends SIGTERM to its processes at once and SIGKILL after the grace.
# Measured per case: when the neighbour first met CUDA OOM (seconds after the grower's jump); with pressure on,
# the free memory when the eviction was decided (the agent's event) and the time from the free memory crossing
# the threshold (the grower's own mem_get_info after each chunk) to the decision. Table last; logs in $OUT.
set -euo pipefail
cd "$(dirname "$0")/../.."

OUT=${OUT:-$(mktemp -d /tmp/gpubudget-pressure-out.XXXX)}
AGENT=${GPUBUDGET_AGENT:-carry/gpubudget-agent}
RATES=${RATES:-"0.25 1 4"}
MODES=${MODES:-"off old new"}
JUMP=${JUMP:-}  # default: the card's memory less 28 GiB (about 7 GiB of climbing before the 5 % threshold)
GRACE=${GRACE:-2}
WORK=$(mktemp -d /tmp/gpubudget-pressure.XXXX)
mkdir -p "$OUT"
# shellcheck source=e2e/gpu/lib.sh
source e2e/gpu/lib.sh
# shellcheck disable=SC2329 # run by the EXIT trap below
cleanup() {
  set +e
  stop_all
  cp -f "$WORK/results.txt" "$OUT/" 2>/dev/null  # the raw lines are in logs.tgz (the device tool returns 8 files)
  tar -C "$WORK" -czf "$OUT/logs.tgz" . 2>/dev/null
  lib_cleanup
  rm -rf "$WORK"
}
trap cleanup EXIT

[ -x "$AGENT" ] || die "no agent binary at $AGENT"
GPU=$(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | head -1)
TOTAL_MIB=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
JUMP=${JUMP:-$(( TOTAL_MIB / 1024 - 28 ))}

: > "$WORK/pods.yaml"
POD_GRACE=3600 pod team-n/neighbour 1a2b3c4d-0000-4000-8000-000000000001
POD_GRACE=3600 pod team-g/grower 1a2b3c4d-0000-4000-8000-000000000002
cat > "$WORK/budgets.yaml" <<'EOF'
apiVersion: gpubudget.io/v1alpha1
kind: GpuMemoryBudget
metadata: {name: serving, namespace: team-n}
spec: {selector: {}, limit: 40Gi}
---
apiVersion: gpubudget.io/v1alpha1
kind: GpuMemoryBudget
metadata: {name: batch, namespace: team-g}
spec: {selector: {}, limit: 8Gi, overLimitSeconds: 600}
EOF

# case_start NAME NAMESPACE/POD ARGS...: pressure.py in the pod, as $CASE's NAME (lib.sh's start: its lines in
# $WORK/${CASE}_NAME.jsonl, its PID in PID_${CASE}_NAME).
case_start() {
  local name=${CASE}_$1 pod=$2
  shift 2
  start "$name" "$pod" -- python3 -u e2e/gpu/pressure.py "$@"
}

run_case() { # rate off|old|new
  local rate=$1 mode=$2 hard near
  CASE=r${rate//./p}_$mode  # names become shell variables (start's PID_<name>): no '.' or '-'
  local grower=PID_${CASE}_grower
  hard=$([ "$mode" = off ] && echo off || echo 5%)
  near=$([ "$mode" = new ] && echo auto || echo off)
  case_start neighbour team-n/neighbour neighbour --gib 16 --hold 1 --pause 0.5
  for _ in $(seq 1 120); do grep -q '"ready"' "$WORK/${CASE}_neighbour.jsonl" 2>/dev/null && break; sleep 0.5; done
  "$AGENT" standalone --budgets "$WORK/budgets.yaml" --pods "$WORK/pods.yaml" --node-name "$NODE" --interval 250ms \
    --interval-near "$near" --pressure-hard "$hard" --pressure-grace-seconds "$GRACE" --output "$WORK/${CASE}_agent.jsonl" 2> "$WORK/${CASE}_agent.err" &
  local agent=$!
  PIDS+=("$agent")
  sleep 2
  case_start grower team-g/grower grower --jump-gib "$JUMP" --rate "$rate"
  local t0 deadline evicted=""
  t0=$(date +%s.%N)
  # Long enough to fill the card at this rate, then some.
  deadline=$(python3 -c "print($t0 + 20 + 14 / $rate)")
  while python3 -c "import sys,time; sys.exit(0 if time.time() < $deadline else 1)"; do
    if [ -z "$evicted" ] && grep -q '"kind":"evict".*team-g/grower\|team-g/grower.*"kind":"evict"' "$WORK/${CASE}_agent.jsonl" 2>/dev/null; then
      evicted=$(date +%s.%N)
      # The kubelet's part: SIGTERM at once, SIGKILL after the grace.
      kill -TERM "${!grower}" 2>/dev/null || true
      ( sleep "$GRACE"; kill -KILL "${!grower}" 2>/dev/null || true ) &
      say "$CASE: grower evicted; terminating it"
    fi
    if [ "$mode" = off ] && grep -q '"oom"' "$WORK/${CASE}_neighbour.jsonl"; then
      sleep 2; break
    fi
    if [ -n "$evicted" ] && python3 -c "import sys,time; sys.exit(0 if time.time() > $evicted + $GRACE + 6 else 1)"; then
      break
    fi
    sleep 0.05
  done
  stop_all
  say "$CASE done"
}

{ echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"; echo "gpu: $GPU"; echo "agent: $("$AGENT" --version)"
  echo "torch: $(python3 -c 'import torch; print(torch.__version__)')"; echo "rates: $RATES GiB/s, jump $JUMP GiB, pressure grace $GRACE s"; } > "$WORK/results.txt"
for rate in $RATES; do
  for mode in $MODES; do run_case "$rate" "$mode"; done
done

python3 - "$WORK" "$RATES" "$MODES" >> "$WORK/results.txt" <<'PY'
import json, re, sys, glob, os
work, rates, modes = sys.argv[1], sys.argv[2].split(), sys.argv[3].split()
SAID = {"off": "off", "old": "on, fixed 250 ms", "new": "on, 250 ms / 20 ms near"}
GIB = 1 << 30
def lines(path):
    try:
        return [json.loads(l) for l in open(path) if l.strip().startswith("{")]
    except FileNotFoundError:
        return []
print()
print("| rate | pressure eviction | neighbour's first CUDA OOM (s after the jump) | eviction decided (s after the jump) | free memory at the decision | threshold crossed → decision |")
print("| --- | --- | --- | --- | --- | --- |")
for rate in rates:
    for mode in modes:
        case = "r" + rate.replace(".", "p") + "_" + mode
        n, g, a = (lines(f"{work}/{case}_{x}.jsonl") for x in ("neighbour", "grower", "agent"))
        jump = next((e for e in g if e["event"] == "jumped"), None)
        if not jump:
            print(f"| {rate} GiB/s | {SAID[mode]} | (grower never started) | | | |"); continue
        t0, total = jump["t"], jump["total"]
        threshold = total * 5 // 100
        oom = next((e["t"] - t0 for e in n if e["event"] == "oom" and e["t"] >= t0), None)
        ev = next((e for e in a if e.get("kind") == "event" and e.get("reason") == "EvictingForGpuMemory" and "grower" in e.get("pod", "")), None)
        decided = ev["ts_unix"] - t0 if ev else None
        free = None
        if ev:
            m = re.search(r"\(([0-9.]+)(Ki|Mi|Gi|Ti)? free of", ev.get("note", ""))
            if m:
                free = f"{m.group(1)}{m.group(2) or ''}"
        crossed = next((e["t"] for e in g if e["event"] in ("grew", "oom") and e.get("free", total) < threshold), None)
        lag = f"{ev['ts_unix'] - crossed:.3f} s" if ev and crossed else "–"
        f = lambda x: "never" if x is None else f"{x:.1f}"
        on = mode != "off"
        print(f"| {rate} GiB/s | {SAID[mode]} | {f(oom)} | {f(decided) if on else '–'} | {free or '–'} | {lag if on else '–'} |")
PY
cat "$WORK/results.txt"
