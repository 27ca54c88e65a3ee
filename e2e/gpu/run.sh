#!/usr/bin/env bash
# Real-GPU check of gpubudget-agent. Run as root on a host with an NVIDIA GPU, cgroup v2, python3 + torch:
#
#   cargo build -p gpubudget-agent --release && mkdir -p carry && cp target/release/gpubudget-agent carry/
#   OUT=/tmp/out bash e2e/gpu/run.sh
#
# It puts PyTorch processes into kubelet-shaped cgroups (containerd, systemd driver:
# /sys/fs/cgroup/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod<uid_>.slice/
# cri-containerd-<id>.scope), writes matching Pod and GpuMemoryBudget files, and runs the agent in standalone
# mode on them at the default pace (250 ms; 20 ms near a threshold: docs/agent.md, "Sampling pace"). Workloads:
#   team-a/hold     two containers holding a 2 GiB and a 1 GiB tensor (summed per pod; budget 8Gi: Within)
#   team-a/freed    allocated 6 GiB and freed it: torch allocated 0, reserved 6 GiB (budget 8Gi at 80 %: Near)
#   team-b/stepper  grows 256 MiB every 0.25 s past its 3Gi budget (overLimitSeconds 2, grace 30 s): Evicting
#   team-c/crosser  crosses its 2560Mi budget (action Warn) up and back down, CYCLES times, logging the time
#                   of each crossing right after torch.cuda.synchronize()
#   stray           a host process holding 512 MiB in no pod's cgroup: unattributed
# Then it checks (a) per-process bytes against nvidia-smi --query-compute-apps and the PID -> pod attribution,
# (b) the detection latency from each crossing to the agent's decision (p50, p99; target p99 <= 0.5 s), and
# the decisions (states, events, one eviction with the budget's grace). The summary table is printed last;
# logs go to $OUT. The cgroups are removed at the end.
set -euo pipefail
cd "$(dirname "$0")/../.."

OUT=${OUT:-$(mktemp -d /tmp/gpubudget-e2e-out.XXXX)}
AGENT=${GPUBUDGET_AGENT:-carry/gpubudget-agent}
INTERVAL=${GPUBUDGET_INTERVAL:-250ms}
CYCLES=${CYCLES:-30}
HOLD=${HOLD:-0.8}
WORK=$(mktemp -d /tmp/gpubudget-e2e.XXXX)
mkdir -p "$OUT"
AGENT_PID=

command -v nvidia-smi >/dev/null || { echo "nvidia-smi not found" >&2; exit 1; }
# shellcheck source=e2e/gpu/lib.sh
source e2e/gpu/lib.sh

# shellcheck disable=SC2329 # called by cleanup, which the EXIT trap runs
collect() {
  # At most 8 files come back from $OUT.
  cp -f "$WORK/decisions.jsonl" "$WORK/agent.log" "$WORK/top.json" "$WORK/sample.json" "$WORK/summary.txt" "$OUT/" 2>/dev/null || true
  for f in "$WORK"/*.log; do
    [ -e "$f" ] || continue
    case "$(basename "$f")" in agent.log) continue ;; esac
    sed "s/^/$(basename "$f" .log) /" "$f"
  done > "$OUT/workloads.log" 2>/dev/null || true
  { echo "## environment"; cat "$WORK/env.txt" 2>/dev/null
    echo "## pods.yaml"; cat "$WORK/pods.yaml" 2>/dev/null
    echo "## budgets.yaml"; cat "$WORK/budgets.yaml" 2>/dev/null
    echo "## expected.json"; cat "$WORK/expected.json" 2>/dev/null
    echo "## pids"; cat "$WORK/pids" 2>/dev/null
    echo "## /proc/<pid>/cgroup"; cat "$WORK/cgroups.txt" 2>/dev/null
    echo "## nvidia-smi --query-compute-apps=pid,used_memory"; cat "$WORK/smi.csv" 2>/dev/null
    echo "## gpubudget-agent top --once"; cat "$WORK/top.txt" 2>/dev/null
    echo "## steady-state tick cost (10 ms interval, 5 s)"; cat "$WORK/idle-stats.json" 2>/dev/null
    echo "## latency.json"; cat "$WORK/latency.json" 2>/dev/null; echo
  } > "$OUT/setup.txt"
}

# shellcheck disable=SC2329 # run by the EXIT trap below
cleanup() {
  set +e
  [ -n "$AGENT_PID" ] && kill "$AGENT_PID" 2>/dev/null
  for pid in "${PIDS[@]}"; do kill "$pid" 2>/dev/null; done
  sleep 1
  stop_all
  collect
  local made=${#CGROUPS[@]}
  lib_cleanup # removes the cgroups made, deepest first (rmdir refuses non-empty directories)
  rm -rf "$WORK"
  say "cleaned up (cgroups removed: $(printf '%s\n' "${CGROUPS[@]}" | while read -r d; do [ -d "$d" ] || echo x; done | wc -l)/$made)"
}
trap cleanup EXIT
trap 'say "FAIL: line $LINENO: $BASH_COMMAND exited with $?"' ERR

# --- 1. the machine --------------------------------------------------------------------------------------
[ -x "$AGENT" ] || die "no agent binary at $AGENT (build it with cargo build -p gpubudget-agent --release)"
GPU=$(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | head -1)
TORCH=$(python3 -c 'import torch; assert torch.cuda.is_available(), "no CUDA"; print(torch.__version__)') || die "python3 with torch and CUDA needed"
{ echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"; echo "gpu: $GPU"; echo "torch: $TORCH"; echo "kernel: $(uname -r)"
  echo "agent: $("$AGENT" --version)"; echo "interval: $INTERVAL, cycles: $CYCLES, hold: $HOLD s"
  echo "own cgroup: $(cat /proc/self/cgroup)"; } > "$WORK/env.txt"
cat "$WORK/env.txt"

# --- 2. pods, budgets, cgroups -----------------------------------------------------------------------------
: > "$WORK/pods.yaml"
CONTAINERS="main sidecar" pod team-a/hold 8e1f7a2b-9c3d-4e5f-a6b7-c8d9e0f1a2b3
pod team-a/freed 2b3c4d5e-6f70-4182-93a4-b5c6d7e8f901
pod team-b/stepper 9f8e7d6c-5b4a-4938-8271-605f4e3d2c1b
pod team-c/crosser 5a1e3c9d-7b2f-4e8a-9c61-0d3f2b7a8e41
cat > "$WORK/budgets.yaml" <<'EOF'
apiVersion: gpubudget.io/v1alpha1
kind: GpuMemoryBudget
metadata: {name: team-default, namespace: team-a}
spec: {selector: {}, limit: 8Gi, warnAtPercent: 80}
---
apiVersion: gpubudget.io/v1alpha1
kind: GpuMemoryBudget
metadata: {name: stepper, namespace: team-b}
spec: {selector: {matchLabels: {app: stepper}}, limit: 3Gi, overLimitSeconds: 2, evictionGracePeriodSeconds: 30}
---
apiVersion: gpubudget.io/v1alpha1
kind: GpuMemoryBudget
metadata: {name: crosser, namespace: team-c}
spec: {selector: {}, limit: 2560Mi, action: Warn}
EOF
cat > "$WORK/expected.json" <<EOF
{"machine": "$GPU, torch $TORCH",
 "pods": {"team-a/hold": {"uid": "${UID_OF[team-a/hold]}"}, "team-a/freed": {"uid": "${UID_OF[team-a/freed]}"},
          "team-b/stepper": {"uid": "${UID_OF[team-b/stepper]}"}, "team-c/crosser": {"uid": "${UID_OF[team-c/crosser]}"}},
 "processes": {"hold-main": {"pod": "team-a/hold", "container": "main"}, "hold-sidecar": {"pod": "team-a/hold", "container": "sidecar"},
               "freed-main": {"pod": "team-a/freed", "container": "main"}, "stepper-main": {"pod": "team-b/stepper", "container": "main"},
               "crosser-main": {"pod": "team-c/crosser", "container": "main"}, "stray": {}}}
EOF

# --- 3. the agent, then the workloads ----------------------------------------------------------------------
"$AGENT" standalone --budgets "$WORK/budgets.yaml" --pods "$WORK/pods.yaml" --node-name "$NODE" \
  --interval "$INTERVAL" --log-usage --output "$WORK/decisions.jsonl" 2> "$WORK/agent.log" &
AGENT_PID=$!
say "agent started (pid $AGENT_PID, interval $INTERVAL)"

: > "$WORK/pids"
# workload NAME NAMESPACE/POD CONTAINER|"" WORKLOAD ARGS...: e2e/gpu/workload.py in that container's cgroup (none:
# a host process in no pod), its output in $WORK/NAME.log, "NAME PID" in $WORK/pids.
workload() {
  local name=$1 pod=$2 container=$3; shift 3
  if [ -n "$pod" ]; then
    # The shell moves itself into the container's cgroup, then becomes python: the process never runs
    # CUDA outside it, as with a real container runtime.
    sh -c 'echo $$ > "$0/cgroup.procs" && exec "$@"' "$(scope "$pod" "$container")" python3 -u e2e/gpu/workload.py "$@" > "$WORK/$name.log" 2>&1 &
  else
    python3 -u e2e/gpu/workload.py "$@" > "$WORK/$name.log" 2>&1 &
  fi
  PIDS+=($!)
  echo "$name $!" >> "$WORK/pids"
}
GO="$WORK/go"
workload hold-main team-a/hold main hold --gib 2
workload hold-sidecar team-a/hold sidecar hold --gib 1
workload freed-main team-a/freed main freed --gib 6
workload stepper-main team-b/stepper main stepper --step-mib 256 --to-gib 4 --period 0.25 --hold 4 --go "$GO"
workload crosser-main team-c/crosser main crosser --base-gib 1 --jump-gib 2 --cycles "$CYCLES" --hold "$HOLD" --go "$GO"
workload stray "" "" hold --gib 0.5
say "workloads started: $(tr '\n' ' ' < "$WORK/pids")"

for _ in $(seq 1 240); do
  ready=$({ grep -l '"event": "ready"' "$WORK"/*-main.log "$WORK"/hold-sidecar.log "$WORK"/stray.log 2>/dev/null || true; } | wc -l)
  [ "$ready" -eq 6 ] && break
  for pid in "${PIDS[@]}"; do kill -0 "$pid" 2>/dev/null || { tail -5 "$WORK"/*.log; die "a workload exited early"; }; done
  sleep 0.5
done
[ "$ready" -eq 6 ] || die "workloads not ready after 120 s"
while read -r name pid; do echo "$name $pid $(cat /proc/"$pid"/cgroup)"; done < "$WORK/pids" | tee "$WORK/cgroups.txt"
sleep 1.5

# --- 4. (a): bytes per process, the agent against nvidia-smi -----------------------------------------------
nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader,nounits > "$WORK/smi.csv"
"$AGENT" top --once --output json --no-api > "$WORK/top.json"
nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader,nounits > "$WORK/smi2.csv"
cmp -s "$WORK/smi.csv" "$WORK/smi2.csv" || say "note: nvidia-smi changed during the comparison"
"$AGENT" top --once --no-api > "$WORK/top.txt"
"$AGENT" capture --attribute --output "$WORK/sample.json"
cat "$WORK/top.txt"

# --- 5. (b): crossings --------------------------------------------------------------------------------------
touch "$GO"
say "go: stepper grows, crosser crosses $CYCLES times"
deadline=$(( $(date +%s) + 60 + CYCLES * 3 ))
until grep -q '"event": "done"' "$WORK/crosser-main.log" && grep -q '"event": "done"' "$WORK/stepper-main.log"; do
  [ "$(date +%s)" -lt "$deadline" ] || die "crossings did not finish in time"
  sleep 0.5
done
sleep 1
kill -TERM "$AGENT_PID"
wait "$AGENT_PID" || say "agent exited with $?"
AGENT_PID=
say "agent stopped; $(wc -l < "$WORK/decisions.jsonl") decision lines"

# The cost of a tick in steady state (every process holding still), sampled every 10 ms for 5 s.
"$AGENT" standalone --budgets "$WORK/budgets.yaml" --pods "$WORK/pods.yaml" --node-name "$NODE" \
  --interval 10ms --duration 5s --output "$WORK/idle.jsonl" 2>/dev/null
grep '"kind":"stats"' "$WORK/idle.jsonl" > "$WORK/idle-stats.json" || true

# --- 6. the verdict -----------------------------------------------------------------------------------------
set +e
python3 e2e/gpu/analyze.py "$WORK"
status=$?
set -e
exit $status
