#!/usr/bin/env bash
# Sampling cost against the number of CUDA processes on one GPU (issue 13). Run as root on a host with an
# NVIDIA GPU and python3 + torch:
#
#   cargo build -p gpubudget-agent --release && mkdir -p carry && cp target/release/gpubudget-agent carry/
#   OUT=/tmp/out GPUBUDGET_AGENT=carry/gpubudget-agent bash e2e/gpu/cost.sh
#   GPUS=2 COUNTS="0 128" ... bash e2e/gpu/cost.sh      # two GPUs, 2 × 64 processes
#
# For N = 0, 16, 64 PyTorch processes (each holding a small tensor and sleeping), it runs
# `gpubudget-agent standalone --interval 250ms` (no pods, no budgets: sampling and the tick alone) in each
# of three NVML modes (GPUBUDGET_NVML_REFRESH, see agent/src/sample/nvml.rs):
#   always   both process lists at every sample: what the agent did before the gate (the "before")
#   gated    the default: lists only when memory_info's used bytes moved, and every 2 s regardless
#   never    memory_info alone, no list: the floor
# Each run lasts WARM + WINDOW seconds (2 + 18); the agent's CPU is read over the window from
# /proc/<pid>/stat (utime+stime, clock ticks) and from the sum of /proc/<pid>/task/*/schedstat (ns).
# Sample times come from the sampler itself (GPUBUDGET_NVML_STATS=1: p50, p99 of sample(), first sample
# left out) and from the agent's stats line (sample_us: the whole SamplerSlot::sample, first one included).
set -euo pipefail
cd "$(dirname "$0")/../.."

OUT=${OUT:-$(mktemp -d /tmp/gpubudget-cost.XXXX)}
AGENT=${GPUBUDGET_AGENT:-carry/gpubudget-agent}
COUNTS=${COUNTS:-"0 16 64"}
MODES=${MODES:-"always gated never"}
WARM=${WARM:-2}
WINDOW=${WINDOW:-18}
GPUS=${GPUS:-1}
WORK=$(mktemp -d /tmp/gpubudget-cost.XXXX)
mkdir -p "$OUT"
PIDS=()
HZ=$(getconf CLK_TCK)

# shellcheck source=e2e/lib.sh
source e2e/lib.sh
cleanup() {
  set +e
  for pid in "${PIDS[@]}"; do kill "$pid" 2>/dev/null; done
  sleep 1
  for pid in "${PIDS[@]}"; do kill -9 "$pid" 2>/dev/null; done
  wait 2>/dev/null
  cp -f "$WORK/cost.txt" "$WORK/cost.jsonl" "$OUT/" 2>/dev/null
  cat "$WORK"/agent-*.log > "$OUT/cost-agent.log" 2>/dev/null
  rm -rf "$WORK"
}
trap cleanup EXIT

[ -x "$AGENT" ] || die "no agent binary at $AGENT"
GPU="$(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | head -1) (x$(nvidia-smi -L | wc -l); processes spread over $GPUS)"
: > "$WORK/pods.yaml"
: > "$WORK/budgets.yaml"

cpu_ticks() { awk '{print $14 + $15}' "/proc/$1/stat"; }

grow_to() { # n: start processes until n run, wait until all are ready
  local n=$1
  while [ "${#PIDS[@]}" -lt "$n" ]; do
    local i=${#PIDS[@]}
    # Spread over the GPUs: process i on GPU i mod $GPUS (GPUS=2 for the two-GPU check, COUNTS="0 128").
    CUDA_VISIBLE_DEVICES=$((i % GPUS)) python3 -u e2e/gpu/workload.py hold --gib 0.0625 > "$WORK/w$i.log" 2>&1 &
    PIDS+=($!)
  done
  for _ in $(seq 1 600); do
    local ready
    ready=$({ grep -l '"event": "ready"' "$WORK"/w*.log 2>/dev/null || true; } | wc -l)
    [ "$ready" -ge "$n" ] && break
    sleep 0.5
  done
  [ "$n" -eq 0 ] || [ "$ready" -ge "$n" ] || die "only $ready of $n workloads ready"
  sleep 1
}

measure() { # n mode
  local n=$1 mode=$2 log="$WORK/agent-$1-${2//[:]/_}.log" jsonl="$WORK/run.jsonl"
  GPUBUDGET_NVML_REFRESH=$mode GPUBUDGET_NVML_STATS=1 "$AGENT" standalone --budgets "$WORK/budgets.yaml" \
    --pods "$WORK/pods.yaml" --interval 250ms --duration "$((WARM + WINDOW + 1))s" --output "$jsonl" 2> "$log" &
  local pid=$!
  sleep "$WARM"
  local t0 c0 n0 t1 c1 n1
  t0=$(date +%s.%N); c0=$(cpu_ticks "$pid"); n0=$(cpu_ns "$pid")
  sleep "$WINDOW"
  t1=$(date +%s.%N); c1=$(cpu_ticks "$pid"); n1=$(cpu_ns "$pid")
  wait "$pid" || say "agent exited with $? (n=$n, mode=$mode)"
  local procs stats nvml
  procs=$(nvidia-smi --query-compute-apps=pid --format=csv,noheader | wc -l)
  stats=$(grep '"kind":"stats"' "$jsonl" || echo '{}')
  nvml=$(grep '"kind":"nvml_stats"' "$log" | tail -1 || echo '{}')
  python3 - "$n" "$mode" "$procs" "$t0" "$t1" "$c0" "$c1" "$n0" "$n1" "$HZ" "$stats" "$nvml" >> "$WORK/cost.jsonl" <<'PY'
import json, sys
n, mode, procs, t0, t1, c0, c1, n0, n1, hz, stats, nvml = sys.argv[1:]
window = float(t1) - float(t0)
print(json.dumps({"n": int(n), "mode": mode, "nvidia_smi_processes": int(procs), "window_s": round(window, 2),
                  "cpu_stat_pct": round(100 * (int(c1) - int(c0)) / int(hz) / window, 3),
                  "cpu_schedstat_pct": round(100 * (int(n1) - int(n0)) / 1e9 / window, 3),
                  "stats": json.loads(stats), "nvml": json.loads(nvml or "{}")}))
PY
  say "n=$n mode=$mode done"
}

{ echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"; echo "gpu: $GPU"; echo "kernel: $(uname -r)"
  echo "agent: $("$AGENT" --version)"; echo "interval: 250ms, window: ${WARM}s warm-up + ${WINDOW}s measured"; } > "$WORK/cost.txt"
: > "$WORK/cost.jsonl"
for n in $COUNTS; do
  grow_to "$n"
  for mode in $MODES; do measure "$n" "$mode"; done
done
for extra in ${EXTRA:-}; do # "n:mode", e.g. 64:gated:2s, run after the counts
  measure "${extra%%:*}" "${extra#*:}"
done

python3 - "$WORK/cost.jsonl" >> "$WORK/cost.txt" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
floor = {r["n"]: r["nvml"].get("p50_us") for r in rows if r["mode"] == "never"}
print()
print("| N | mode | NVML processes | sample p50 | sample p99 | vs floor (p50) | tick p50 (agent) | agent CPU, % of a core (stat / schedstat) | lists: full / on change / skipped |")
print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
for r in rows:
    v, s = r["nvml"], r["stats"]
    f = floor.get(r["n"])
    ratio = f"{v['p50_us'] / f:.1f}×" if f and v.get("p50_us") is not None else "–"
    lists = f"{v.get('full', 0)} / {v.get('changed', 0)} / {v.get('skips', 0)}"
    print(f"| {r['n']} | {r['mode']} | {r['nvidia_smi_processes']} | {v.get('p50_us', '?')} µs | {v.get('p99_us', '?')} µs "
          f"| {ratio} | {s.get('tick_us', {}).get('p50', '?')} µs | {r['cpu_stat_pct']:.2f} / {r['cpu_schedstat_pct']:.2f} | {lists} |")
PY
cat "$WORK/cost.txt"
