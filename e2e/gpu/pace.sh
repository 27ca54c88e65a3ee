#!/usr/bin/env bash
# The sampling pace on a real GPU (issue 36): the old default (a fixed 250 ms) and the new one (250 ms, 20 ms
# near a threshold) side by side, two agents in standalone mode watching the same processes at once. Run as
# root on a host with an NVIDIA GPU, cgroup v2, python3 + torch:
#
#   cargo build -p gpubudget-agent --release && mkdir -p carry && cp target/release/gpubudget-agent carry/
#   OUT=/tmp/out PARTS="latency" bash e2e/gpu/pace.sh     # or PARTS=cpu, or both (the default)
#
# latency: crossings, CYCLES each (PyTorch processes in kubelet-shaped cgroups, e2e/gpu/lib.sh):
#   near  team-n/near crosses its 2560Mi budget (warnAtPercent 50, Warn) up and back, from Near (1 GiB held
#         + the CUDA context, ~1.5 GiB) to Over (+2 GiB) and back: a pod near its threshold
#   far   team-f/far the same under a budget with the default 90 % warning: it crosses from Within (~60 %),
#         where the new pace is relaxed: no faster than the old one, by design
#   gpu   a process in no pod does the same with the agents' hard pressure threshold 1 GiB under the GPU's
#         free memory: the GPU crosses its pressure threshold (its free memory is under twice the threshold,
#         so it is near by the new pace's rule) and back
#   Latency: from the workload's own log line, written right after torch.cuda.synchronize(), to the agent's
#   decision line (a pod's transition; the GPU's GpuMemoryPressure node event).
# cpu: for N in COUNTS (6 16 64) processes, each in a pod of its own holding 64 MiB: the agents' CPU over
#   WINDOW s (≥ 60) from their threads' schedstat, first with every pod far within its budget (idle: the
#   relaxed pace), then with every pod at Near (budget warnAtPercent 1: the fast pace, every process steady).
# The table is printed last and written to $OUT/pace.txt; raw lines to $OUT.
set -euo pipefail
cd "$(dirname "$0")/../.."

OUT=${OUT:-$(mktemp -d /tmp/gpubudget-pace-out.XXXX)}
AGENT=${GPUBUDGET_AGENT:-carry/gpubudget-agent}
PARTS=${PARTS:-"latency cpu"}
CYCLES=${CYCLES:-30}
COUNTS=${COUNTS:-"6 16 64"}
WINDOW=${WINDOW:-60}
WORK=$(mktemp -d /tmp/gpubudget-pace.XXXX)
mkdir -p "$OUT"
# shellcheck source=e2e/gpu/lib.sh
source e2e/gpu/lib.sh
AGENTS=()

cleanup() {
  set +e
  for pid in "${AGENTS[@]}"; do kill "$pid" 2>/dev/null; done
  lib_cleanup
  cp -f "$WORK/pace.txt" "$OUT/" 2>/dev/null
  tar -C "$WORK" -czf "$OUT/pace-raw.tgz" . 2>/dev/null
  rm -rf "$WORK"
}
trap cleanup EXIT

[ -x "$AGENT" ] || die "no agent binary at $AGENT"
GPU=$(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | head -1)
{ echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"; echo "gpu: $GPU"; echo "agent: $("$AGENT" --version)"
  echo "torch: $(python3 -c 'import torch; print(torch.__version__)')"; echo "cpu: $(nproc) cores, $(uname -r)"
  echo "old: --interval 250ms --interval-near off; new: --interval 250ms (--interval-near auto: 20ms)"; } > "$WORK/pace.txt"

# agents NAME EXTRA...: the old and the new agent on $WORK/pods.yaml and $WORK/budgets.yaml, decisions in
# $WORK/NAME-old.jsonl and $WORK/NAME-new.jsonl; the new one's admin port on 127.0.0.1:9411.
agents() {
  local name=$1; shift
  "$AGENT" standalone --budgets "$WORK/budgets.yaml" --pods "$WORK/pods.yaml" --node-name "$NODE" \
    --interval 250ms --interval-near off "$@" --output "$WORK/$name-old.jsonl" 2> "$WORK/$name-old.err" &
  AGENTS+=($!); OLD=$!
  "$AGENT" standalone --budgets "$WORK/budgets.yaml" --pods "$WORK/pods.yaml" --node-name "$NODE" \
    --interval 250ms --admin-addr 127.0.0.1:9411 "$@" --output "$WORK/$name-new.jsonl" 2> "$WORK/$name-new.err" &
  AGENTS+=($!); NEW=$!
}
stop_agents() {
  for pid in "${AGENTS[@]}"; do kill -TERM "$pid" 2>/dev/null || true; wait "$pid" 2>/dev/null || true; done
  AGENTS=()
}
interval_now() {
  python3 -c 'import urllib.request; print(urllib.request.urlopen("http://127.0.0.1:9411/metrics", timeout=2).read().decode())' \
    2>/dev/null | awk '/^gpubudget_sample_interval_seconds /{print $2}'
}
# until NAME EVENT: waits (CYCLES × 4 + 60 s at most) until NAME's log has that event.
until_logged() {
  until_ok $((CYCLES * 4 + 60)) grep -q "\"event\": \"$2\"" "$WORK/$1.jsonl" || die "$1 did not log $2 in time"
}

latency() {
  : > "$WORK/pods.yaml"
  pod team-n/near 7a000000-0000-4000-8000-000000000001
  pod team-f/far 7a000000-0000-4000-8000-000000000002
  cat > "$WORK/budgets.yaml" <<'YAML'
apiVersion: gpubudget.io/v1alpha1
kind: GpuMemoryBudget
metadata: {name: near, namespace: team-n}
spec: {selector: {}, limit: 2560Mi, warnAtPercent: 50, action: Warn}
---
apiVersion: gpubudget.io/v1alpha1
kind: GpuMemoryBudget
metadata: {name: far, namespace: team-f}
spec: {selector: {}, limit: 2560Mi, action: Warn}
YAML
  local args=(crosser --base-gib 1 --jump-gib 2 --cycles "$CYCLES" --hold 0.8 --linger 600)
  start near team-n/near -- python3 -u e2e/gpu/workload.py "${args[@]}" --go "$WORK/go-near"
  start far team-f/far -- python3 -u e2e/gpu/workload.py "${args[@]}" --go "$WORK/go-far"
  workloads_ready near far
  agents pods --pressure-hard off
  sleep 3
  touch "$WORK/go-near"; say "near: $CYCLES crossings"
  until_logged near "done"
  # shellcheck disable=SC2154 # PID_near is set by lib.sh's start (printf -v)
  kill -9 "$PID_near"
  sleep 3  # the near pod's processes gone: the new pace relaxes after its 2 s hold
  echo "new agent's interval before the far crossings: $(interval_now) s" >> "$WORK/pace.txt"
  touch "$WORK/go-far"; say "far: $CYCLES crossings"
  until_logged far "done"
  sleep 1
  stop_agents
  # shellcheck disable=SC2154 # PID_far is set by lib.sh's start (printf -v)
  kill -9 "$PID_far"
  sleep 2

  # The GPU: a process in no pod; the hard threshold 1 GiB under the free memory it leaves.
  python3 -u e2e/gpu/workload.py crosser --base-gib 1 --jump-gib 2 --cycles "$CYCLES" --hold 1.2 --linger 600 \
    --go "$WORK/go-gpu" > "$WORK/gpu.jsonl" 2> "$WORK/gpu.err" &
  PIDS+=($!)
  until_logged gpu ready
  sleep 1
  local free; free=$(nvidia-smi --query-gpu=memory.free --format=csv,noheader,nounits | head -1)
  echo "gpu phase: ${free} MiB free at rest, hard threshold $((free - 1024))Mi" >> "$WORK/pace.txt"
  agents gpu --pressure-hard "$((free - 1024))Mi" --pressure-transition 500ms
  sleep 3
  touch "$WORK/go-gpu"; say "gpu: $CYCLES crossings"
  until_logged gpu "done"
  sleep 1
  stop_agents
  stop_all
}

# window LABEL N: both agents' CPU over WINDOW s, as a JSON line in $WORK/cpu.jsonl.
window() {
  sleep 5  # the budgets re-read, the pace settled
  local o0 n0 o1 n1 t0 t1
  o0=$(cpu_ns "$OLD"); n0=$(cpu_ns "$NEW"); t0=$(date +%s%N)
  sleep "$WINDOW"
  o1=$(cpu_ns "$OLD"); n1=$(cpu_ns "$NEW"); t1=$(date +%s%N)
  printf '{"case": "%s", "processes": %s, "old_ns": %s, "new_ns": %s, "wall_ns": %s, "new_interval_s": "%s"}\n' \
    "$1" "$2" $((o1 - o0)) $((n1 - n0)) $((t1 - t0)) "$(interval_now)" >> "$WORK/cpu.jsonl"
  say "cpu $1 at $2 processes: old $(( (o1 - o0) / 1000000 )) ms, new $(( (n1 - n0) / 1000000 )) ms in $WINDOW s"
}

cpu() {
  : > "$WORK/pods.yaml"
  budgets() { # limit warnAtPercent
    printf 'apiVersion: gpubudget.io/v1alpha1\nkind: GpuMemoryBudget\nmetadata: {name: cost, namespace: cost}\nspec: {selector: {}, limit: %s, warnAtPercent: %s, action: Warn}\n' "$1" "$2" > "$WORK/budgets.yaml.new"
    mv "$WORK/budgets.yaml.new" "$WORK/budgets.yaml"
  }
  budgets 64Gi 90
  agents cpu
  local have=0
  for n in $COUNTS; do
    local names=()
    while [ "$have" -lt "$n" ]; do
      pod "cost/p$have" "$(printf '7b000000-0000-4000-8000-%012d' "$have")"
      start "p$have" "cost/p$have" -- python3 -u e2e/gpu/workload.py hold --gib 0.0625
      names+=("p$have"); have=$((have + 1))
    done
    workloads_ready "${names[@]}"
    budgets 64Gi 90   # every pod far within: idle
    window idle "$n"
    budgets 16Gi 1    # every pod at Near, steady: the fast pace
    window near "$n"
  done
  stop_agents
  stop_all
}

for part in $PARTS; do "$part"; done
python3 e2e/gpu/pace.py "$WORK" >> "$WORK/pace.txt"
cat "$WORK/pace.txt"
