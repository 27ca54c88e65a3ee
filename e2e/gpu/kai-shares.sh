#!/usr/bin/env bash
# Two pods shaped as KAI-Scheduler leaves them, at gpu-fraction 0.5 and 0.25 of one GPU, under one budget with
# `share: {}` (issue 44), on a real GPU. Run as root on a host with an NVIDIA GPU, cgroup v2, python3 + torch:
#
#   cargo build -p gpubudget-agent --release && mkdir -p carry && xz -c target/release/gpubudget-agent > carry/agent.xz
#   OUT=/tmp/out GPUBUDGET_AGENT_XZ=carry/agent.xz bash e2e/gpu/kai-shares.sh
#
# The pods sit in kubelet-shaped cgroups (as e2e/gpu/run.sh makes them); the agent runs standalone at 250 ms
# and reads the two pods and the budget from files. team-k/half grows 2 GiB a second toward 50 GiB, past its
# share (0.5 of the GPU as NVML reports it); team-k/quarter holds 12 GiB and allocates 3 GiB more every 2 s,
# within its share (0.25). Expected: half goes Near, Over and is evicted 10 s after going over (the script
# plays the kubelet: SIGTERM on the agent's eviction), every message naming the share ("KAI gpu-fraction 0.5
# of …"); quarter is never over and never meets CUDA OOM. Prints PASS or FAIL; results.txt and logs in $OUT.
# shellcheck disable=SC2154 # PID_<name> are set by start (e2e/gpu/lib.sh)
set -euo pipefail
cd "$(dirname "$0")/../.."

OUT=${OUT:-$(mktemp -d /tmp/gpubudget-kai-out.XXXX)}
WORK=$(mktemp -d /tmp/gpubudget-kai.XXXX)
AGENT=$WORK/gpubudget-agent
mkdir -p "$OUT"
# shellcheck source=e2e/gpu/lib.sh
source e2e/gpu/lib.sh
# say_result MESSAGE...: say, and the line kept in results.txt.
say_result() { say "$@" | tee -a "$WORK/results.txt"; }
cleanup() {
  lib_cleanup
  cp -f "$WORK/results.txt" "$OUT/" 2>/dev/null
  tar -C "$WORK" --exclude=gpubudget-agent -czf "$OUT/logs.tgz" . 2>/dev/null
  rm -rf "$WORK"
}
trap cleanup EXIT

if [ -n "${GPUBUDGET_AGENT_XZ:-}" ]; then xz -dc "$GPUBUDGET_AGENT_XZ" > "$AGENT"; else cp "${GPUBUDGET_AGENT:?}" "$AGENT"; fi
chmod +x "$AGENT"
say_result "gpu: $(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | head -1)"
say_result "agent: $("$AGENT" --version)  torch: $(python3 -c 'import torch; print(torch.__version__)')"

# As KAI leaves a fractional pod (common/tests/fixtures/shares/kai-fraction.yaml): the annotation, its
# scheduler, the devices from a ConfigMap, no nvidia.com/gpu.
kai_pod() { # NAME UID FRACTION
  pod "team-k/$1" "$2" "annotations: {gpu-fraction: \"$3\", received-resource-type: Fraction}" \
    "schedulerName: kai-scheduler" \
    "env: [{name: NVIDIA_VISIBLE_DEVICES, valueFrom: {configMapKeyRef: {name: $1-shared-gpu-0, key: NVIDIA_VISIBLE_DEVICES}}}], envFrom: [{configMapRef: {name: $1-shared-gpu-0-evar, optional: false}}]"
}
kai_pod half 4a1b0000-0000-4000-8000-000000000001 0.5
kai_pod quarter 4a1b0000-0000-4000-8000-000000000002 0.25
# Sizes from the card (an H100's 80 GB, an H200's 141 GB, #52): the budget's limit is the card, half grows 20 GiB past
# its share (0.5 of the card).
CARD_GIB=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1 | awk '{printf "%d", $1 / 1024}')
HALF_TO=$(( CARD_GIB / 2 + 20 ))
cat > "$WORK/budgets.yaml" <<EOF
apiVersion: gpubudget.io/v1alpha1
kind: GpuMemoryBudget
metadata: {name: shares, namespace: team-k}
spec: {selector: {}, limit: ${CARD_GIB}Gi, share: {}, action: Evict, overLimitSeconds: 10}
EOF

start quarter team-k/quarter -- python3 -u e2e/gpu/workload.py crosser --base-gib 12 --jump-gib 3 --cycles 100000 --hold 1
workloads_ready quarter
"$AGENT" standalone --budgets "$WORK/budgets.yaml" --pods "$WORK/pods.yaml" --node-name "$NODE" --interval 250ms \
  --output "$WORK/agent.jsonl" 2> "$WORK/agent.err" &
PIDS+=($!)
sleep 2
start half team-k/half -- python3 -u e2e/gpu/workload.py stepper --step-mib 2048 --to-gib "$HALF_TO" --period 1 --hold 600
T0=$(date +%s.%N)
evicted=""
while python3 -c "import sys,time; sys.exit(0 if time.time() < $T0 + 90 else 1)"; do
  if [ -z "$evicted" ] && grep -q '"kind":"evict".*team-k/half\|team-k/half.*"kind":"evict"' "$WORK/agent.jsonl" 2>/dev/null; then
    evicted=$(date +%s.%N)
    kill -TERM "$PID_half" 2>/dev/null || true   # the kubelet's part
    say_result "half evicted by the agent after $(python3 -c "print(f'{$evicted - $T0:.1f}')") s of growth; SIGTERM sent"
  fi
  if [ -n "$evicted" ] && python3 -c "import sys,time; sys.exit(0 if time.time() > $evicted + 10 else 1)"; then break; fi
  sleep 0.1
done

say_result "the agent's events:"
python3 - "$WORK" <<'PY' | tee -a "$WORK/results.txt"
import json, sys
work = sys.argv[1]
for line in open(f"{work}/agent.jsonl"):
    if not line.startswith("{"):
        continue
    e = json.loads(line)
    if e.get("kind") == "event" and e.get("pod", "").startswith("team-k/"):
        print(f"  {e['ts_unix']:.2f} {e['pod']} {e['reason']}: {e.get('note', '')[:230]}")
PY
ups=$(grep -c '"up"' "$WORK/quarter.jsonl" || true)
ooms=$(grep -ci 'out of memory' "$WORK/quarter.err" || true)
alive=$(kill -0 "$PID_quarter" 2>/dev/null && echo running || echo stopped)
say_result "quarter: $ups allocations of 3 GiB, CUDA out of memory $ooms times, $alive"
top=$(grep '"step"' "$WORK/half.jsonl" | tail -1 | python3 -c 'import json,sys; print(round(json.loads(sys.stdin.read())["reserved"] / 2**30, 1))' 2>/dev/null || echo "?")
say_result "half: reserved $top GiB at its last step"
grep -q 'team-k/half.*GpuMemoryOverBudget.*KAI gpu-fraction 0.5 of' "$WORK/results.txt" || die "no Over event for half naming its KAI share"
[ -n "$evicted" ] || die "half was not evicted"
if grep -q 'team-k/quarter.*GpuMemoryOverBudget' "$WORK/results.txt"; then die "quarter went over"; fi
[ "$ooms" = 0 ] && [ "$alive" = running ] || die "quarter met CUDA OOM or stopped"
say_result "PASS: half held to its KAI share (0.5) and evicted; quarter (0.25) never over, never CUDA OOM"
