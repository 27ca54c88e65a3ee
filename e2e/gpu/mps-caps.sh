#!/usr/bin/env bash
# Caps the driver enforces, on a real GPU (issue 22 part 4). Run as root on a host with an NVIDIA GPU, cgroup v2,
# python3 + torch and the MPS binaries (nvidia-cuda-mps-control):
#
#   cargo build -p gpubudget-agent --release && mkdir -p carry && cp target/release/gpubudget-agent carry/
#   OUT=/tmp/out GPUBUDGET_AGENT=carry/gpubudget-agent bash e2e/gpu/mps-caps.sh
#
# The MPS control daemon runs for the whole script. Pods in kubelet-shaped cgroups (e2e/gpu/lib.sh); the agent in
# standalone mode at 250 ms with pressure eviction off, so whatever protects the neighbour here is the cap alone.
# A cap is what the admission webhook puts in a GPU container's environment for a budget with caps on
# (common/src/caps.rs): CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=<MiB>M, MiB = floor(limit / 1 MiB).
#   syntax     one client capped with 0=4096M, one with 0=4G: where each meets CUDA OOM and what NVML shows.
#   rates      for each RATE (GiB/s): the pressure table's two pods (e2e/gpu/pressure.sh): team-n/neighbour
#              (budget 40Gi, no cap) cycles 16 GiB; team-g/grower jumps to JUMP GiB, then climbs at RATE until
#              the card is full. Run twice: `uncapped` (the grower's budget without caps: no variable) and
#              `capped` (its budget CAP_GIB, default the card less 24 GiB, with caps: the variable set).
#              Measured: the neighbour's first CUDA OOM, the grower's first CUDA OOM and what it held then
#              (tensors, and NVML's figure as the agent recorded it), the agent's events for both pods.
#   pair       team-g/pair, budget 8Gi with caps, two processes (an MPS cap is per process): each capped at
#              0=8192M holds 7 GiB, the pod holds about 15 GiB; the agent evicts it (overLimitSeconds 2).
# Results in $OUT/results.txt; raw files in $OUT/mps-caps-raw.tgz.
set -euo pipefail
cd "$(dirname "$0")/../.."

OUT=${OUT:-$(mktemp -d /tmp/gpubudget-mps-caps-out.XXXX)}
AGENT=${GPUBUDGET_AGENT:-carry/gpubudget-agent}
RATES=${RATES:-"0.25 1 4"}
WORK=$(mktemp -d /tmp/gpubudget-mps-caps.XXXX)
mkdir -p "$OUT"
# shellcheck source=e2e/gpu/lib.sh
source e2e/gpu/lib.sh
export CUDA_MPS_PIPE_DIRECTORY=$WORK/mps-pipe CUDA_MPS_LOG_DIRECTORY=$WORK/mps-log
cleanup() {
  lib_cleanup
  echo quit | nvidia-cuda-mps-control > /dev/null 2>&1
  tar -C "$WORK" -czf "$OUT/mps-caps-raw.tgz" . 2>/dev/null
  cp -f "$WORK/results.txt" "$OUT/" 2>/dev/null
  rm -rf "$WORK"
}
trap cleanup EXIT
[ -x "$AGENT" ] || die "no agent binary at $AGENT"
command -v nvidia-cuda-mps-control > /dev/null || die "no nvidia-cuda-mps-control"

GPU=$(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | head -1)
TOTAL_GIB=$(( $(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1) / 1024 ))
JUMP=${JUMP:-$(( TOTAL_GIB - 28 ))}
CAP_GIB=${CAP_GIB:-$(( TOTAL_GIB - 24 ))}
# The webhook's rule (common/src/caps.rs): whole MiB, rounded down, per device ordinal the container sees.
mps_cap() { echo "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=$(( $1 / 1048576 ))M"; }
GIB=1073741824

pod team-n/neighbour 1a2b3c4d-0000-4000-8000-000000000221
pod team-g/grower 1a2b3c4d-0000-4000-8000-000000000222
pod team-g/pair 1a2b3c4d-0000-4000-8000-000000000223
pod team-s/syntax 1a2b3c4d-0000-4000-8000-000000000224
# The grower's budget selects app=grower, the pair's app=pair (lib.sh labels each pod app=<name>).
cat > "$WORK/budgets.yaml" <<YAML
apiVersion: gpubudget.io/v1alpha1
kind: GpuMemoryBudget
metadata: {name: serving, namespace: team-n}
spec: {selector: {}, limit: 40Gi}
---
apiVersion: gpubudget.io/v1alpha1
kind: GpuMemoryBudget
metadata: {name: batch, namespace: team-g}
spec: {selector: {matchLabels: {app: grower}}, limit: ${CAP_GIB}Gi, overLimitSeconds: 600}
---
apiVersion: gpubudget.io/v1alpha1
kind: GpuMemoryBudget
metadata: {name: pairs, namespace: team-g}
spec: {selector: {matchLabels: {app: pair}}, limit: 8Gi, overLimitSeconds: 2, evictionGracePeriodSeconds: 5}
YAML
agent() { # case: the agent until killed, pressure eviction off
  "$AGENT" standalone --budgets "$WORK/budgets.yaml" --pods "$WORK/pods.yaml" --node-name "$NODE" --interval 250ms \
    --pressure-hard off --log-usage --output "$WORK/${1}_agent.jsonl" 2> "$WORK/${1}_agent.err" &
  PIDS+=($!)
}
PRESSURE=(python3 -u e2e/gpu/pressure.py)
first() { grep -m1 "$2" "$WORK/$1.jsonl" 2>/dev/null || true; }
has_line() { [ -n "$(first "$1" "$2")" ]; }     # has_line NAME PATTERN
until_line() { until_ok "$3" has_line "$1" "$2"; } # until_line NAME PATTERN SECONDS: status 1 when it never came

mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
nvidia-cuda-mps-control -d
sleep 1
{ echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"; echo "gpu: $GPU"; echo "agent: $("$AGENT" --version)"
  echo "torch: $(python3 -c 'import torch; print(torch.__version__)')"
  echo "MPS control daemon: running; rates $RATES GiB/s, jump $JUMP GiB, the grower's capped budget ${CAP_GIB}Gi"; } > "$WORK/results.txt"

say "syntax: 0=4096M and 0=4G"
for spec in 4096M 4G; do
  name=syntax_$spec
  start "$name" team-s/syntax "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=$spec" -- "${PRESSURE[@]}" grower --jump-gib 0 --rate 16
  until_line "$name" '"oom"' 60 || die "$name: no CUDA OOM within 60 s: $(tail -3 "$WORK/$name.err")"
  pid_var=PID_$name; pid=${!pid_var}
  # The python process is the client (start execs it); NVML's figure for it at the cap.
  echo "$spec $(first "$name" '"oom"' | python3 -c 'import json,sys; print(json.load(sys.stdin)["bytes"])') $(smi_used "$pid")" >> "$WORK/syntax.txt"
  stop_all
done

run_case() { # rate uncapped|capped
  local rate=$1 mode=$2 case env=()
  case=r${rate//./p}_$mode  # names become shell variables (start's PID_<name>): no '.' or '-'

  [ "$mode" = capped ] && env=("$(mps_cap $(( CAP_GIB * GIB )))")
  start "${case}_neighbour" team-n/neighbour -- "${PRESSURE[@]}" neighbour --gib 16 --hold 1 --pause 0.5
  workloads_ready "${case}_neighbour"
  agent "$case"
  sleep 2
  start "${case}_grower" team-g/grower "${env[@]}" -- "${PRESSURE[@]}" grower --jump-gib "$JUMP" --rate "$rate"
  until_line "${case}_grower" '"jumped"' 60 || die "$case: the grower never jumped: $(tail -3 "$WORK/${case}_grower.err")"
  # Long enough to fill the card at this rate uncapped, then some; uncapped ends 2 s after the neighbour's OOM.
  local end
  end=$(python3 -c "print(int($SECONDS + 20 + 14 / $rate))")
  while [ $SECONDS -lt "$end" ]; do
    if [ "$mode" = uncapped ] && [ -n "$(first "${case}_neighbour" '"oom"')" ]; then sleep 2; break; fi
    sleep 0.1
  done
  stop_all
  say "$case done"
}

for rate in $RATES; do
  for mode in uncapped capped; do
    run_case "$rate" "$mode"
  done
done

say "pair: two capped clients in one pod, over its budget together"
CAP8=$(mps_cap $(( 8 * GIB )))
agent pair
start pair_a team-g/pair "$CAP8" -- python3 -u e2e/gpu/workload.py hold --gib 7
start pair_b team-g/pair "$CAP8" -- python3 -u e2e/gpu/workload.py hold --gib 7
workloads_ready pair_a pair_b
until_line pair_agent '"EvictingForGpuMemory"' 30 || say "pair: no eviction decided within 30 s"
stop_all

python3 - "$WORK" "$RATES" "$CAP_GIB" >> "$WORK/results.txt" <<'PY'
import json, sys
work, rates, cap_gib = sys.argv[1], sys.argv[2].split(), int(sys.argv[3])
GIB, MIB = 1 << 30, 1 << 20
def lines(path):
    try:
        return [json.loads(l) for l in open(path) if l.strip().startswith("{")]
    except FileNotFoundError:
        return []
print("\nsyntax (one MPS client, the variable as written; tensors held at its first CUDA OOM; NVML's figure then):")
for line in open(f"{work}/syntax.txt"):
    spec, held, used = (line.split() + ["?", "?"])[:3]
    print(f"  0={spec}: {int(held) / MIB:.0f} MiB of tensors, {used} MiB in NVML")
print()
print("| rate | grower | neighbour's first CUDA OOM (s after the jump) | grower's first CUDA OOM (s after the jump) | grower's tensors then | grower's usage as the agent recorded it (max) | agent's events |")
print("| --- | --- | --- | --- | --- | --- | --- |")
for rate in rates:
    for mode in ("uncapped", "capped"):
        case = f"r{rate.replace('.', 'p')}_{mode}"
        n, g, a = (lines(f"{work}/{case}_{x}.jsonl") for x in ("neighbour", "grower", "agent"))
        jump = next((e for e in g if e["event"] == "jumped"), None)
        if not jump:
            print(f"| {rate} GiB/s | {mode} | (grower never jumped) | | | | |"); continue
        t0 = jump["t"]
        n_oom = next((e["t"] - t0 for e in n if e["event"] == "oom" and e["t"] >= t0), None)
        g_oom = next((e for e in g if e["event"] == "oom"), None)
        usage = max((e.get("usage_bytes", 0) for e in a if e.get("kind") == "usage" and "grower" in e.get("pod", "")), default=0)
        events = sorted({f"{e['reason']} {e['pod'].split('/')[-1]}" for e in a if e.get("kind") == "event"})
        f = lambda x: "never" if x is None else f"{x:.1f}"
        print(f"| {rate} GiB/s | {mode} | {f(n_oom)} | {f(g_oom['t'] - t0 if g_oom else None)} | "
              f"{g_oom['bytes'] / GIB:.2f} GiB | {usage / GIB:.2f} GiB | {', '.join(events) or '–'} |" if g_oom else
              f"| {rate} GiB/s | {mode} | {f(n_oom)} | never | – | {usage / GIB:.2f} GiB | {', '.join(events) or '–'} |")
a = lines(f"{work}/pair_agent.jsonl")
usage = max((e.get("usage_bytes", 0) for e in a if e.get("kind") == "usage" and "pair" in e.get("pod", "")), default=0)
ev = [e for e in a if e.get("kind") == "event" and "pair" in e.get("pod", "")]
print(f"\npair (two clients, each 0=8192M, 7 GiB each, budget 8Gi): the pod's usage as recorded {usage / GIB:.2f} GiB; "
      f"events: {', '.join(e['reason'] for e in ev) or 'none'}")
PY
cat "$WORK/results.txt"
