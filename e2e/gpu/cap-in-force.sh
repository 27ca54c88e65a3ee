#!/usr/bin/env bash
# Is a pod's MPS cap in force? (issue 32 item 4), on a real GPU with an MPS control daemon. Run as root on a host
# with an NVIDIA GPU, cgroup v2, python3 + torch and nvidia-cuda-mps-control:
#
#   cargo build -p gpubudget-agent --release && mkdir -p carry && cp target/release/gpubudget-agent carry/
#   OUT=/tmp/out GPUBUDGET_AGENT=carry/gpubudget-agent bash e2e/gpu/cap-in-force.sh
#
# Every pod (kubelet-shaped cgroups, e2e/gpu/lib.sh) carries what the webhook writes under a budget with caps:
# `nvidia.com/gpu: 1` and CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=3072M, so gpubudget counts it *capped*. Each process
# asks for 6 GiB in 1 GiB tensors and holds what it got. The agent runs in standalone mode at 250 ms (budget 16Gi,
# Warn: no budget event gets in the way). Cases:
#   variable   MPS server without a default: `capped` (variable as written), `unset` (env -u: an MPS client
#              without a cap), `elsewhere` (CUDA_MPS_PIPE_DIRECTORY elsewhere: no MPS at all)
#   default    the same three under the server default `set_default_device_pinned_mem_limit 0 3G`
#   no-mps     the control daemon stopped: `capped` again (the variable is read by nobody)
#   slack      NVML's figure for a capped client at its first CUDA OOM, caps 1024M, 3072M and 8192M
# The check: the agent says GpuMemoryCapNotInForce (and the record's gpubudget.io/cap-not-in-force) exactly for
# the processes that got more than the cap (and for no client that got at most its cap). Results in
# $OUT/results.txt, raw files in $OUT/cap-in-force-raw.tgz.
set -euo pipefail
cd "$(dirname "$0")/../.."

OUT=${OUT:-$(mktemp -d /tmp/gpubudget-cap-in-force-out.XXXX)}
AGENT=${GPUBUDGET_AGENT:-carry/gpubudget-agent}
WORK=$(mktemp -d /tmp/gpubudget-cap-in-force.XXXX)
mkdir -p "$OUT"
# shellcheck source=e2e/gpu/lib.sh
source e2e/gpu/lib.sh
export CUDA_MPS_PIPE_DIRECTORY=$WORK/mps-pipe CUDA_MPS_LOG_DIRECTORY=$WORK/mps-log
ELSEWHERE=$WORK/elsewhere-pipe
cleanup() {
  lib_cleanup
  echo quit | nvidia-cuda-mps-control > /dev/null 2>&1
  cp -f "$WORK/results.txt" "$OUT/" 2>/dev/null
  tar -C "$WORK" -czf "$OUT/cap-in-force-raw.tgz" --exclude mps-pipe --exclude elsewhere-pipe . 2>/dev/null
  rm -rf "$WORK"
}
trap cleanup EXIT
[ -x "$AGENT" ] || die "no agent binary at $AGENT"
command -v nvidia-cuda-mps-control > /dev/null || die "no nvidia-cuda-mps-control"
mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY" "$ELSEWHERE"
R=$WORK/results.txt

# A GPU pod as the webhook leaves it under a budget with caps (limit 3Gi): one GPU, the canonical MPS value.
capped_pod() { # NAMESPACE/NAME UID MIB
  pod "$1" "$2"
  python3 - "$WORK/pods.yaml" "$3" <<'PY'
import sys
path, mib = sys.argv[1], sys.argv[2]
text = open(path).read()
head, sep, last = text.rpartition("---\n")
last = last.replace("containers: [{name: main, image: pytorch}]",
    "containers: [{name: main, image: pytorch, resources: {limits: {nvidia.com/gpu: '1'}}, "
    f"env: [{{name: CUDA_MPS_PINNED_DEVICE_MEM_LIMIT, value: '0={mib}M'}}]}}]")
open(path, "w").write(head + sep + last)
PY
}
cat > "$WORK/client.py" <<'EOF'
import json, os, sys, time
print(json.dumps({"event": "start", "t": time.time(), "pid": os.getpid()}), flush=True)
import torch
step, total = int(sys.argv[1]), int(sys.argv[2])  # MiB
held, oom = [], False
try:
    while len(held) * step < total:
        held.append(torch.empty(step << 20, dtype=torch.uint8, device="cuda"))
        torch.cuda.synchronize()
except torch.cuda.OutOfMemoryError:
    oom = True
except Exception as e:
    print(json.dumps({"event": "error", "t": time.time(), "error": str(e).splitlines()[0][:160]}), flush=True)
print(json.dumps({"event": "ready", "t": time.time(), "pid": os.getpid(), "held_mib": len(held) * step,
                  "oom": oom, "reserved_mib": torch.cuda.memory_reserved() >> 20}), flush=True)
time.sleep(3600)
EOF
cat > "$WORK/budgets.yaml" <<'YAML'
apiVersion: gpubudget.io/v1alpha1
kind: GpuMemoryBudget
metadata: {name: caps, namespace: team-c}
spec: {selector: {}, limit: 16Gi, action: Warn}
YAML
agent() { # case
  "$AGENT" standalone --budgets "$WORK/budgets.yaml" --pods "$WORK/pods.yaml" --node-name "$NODE" --interval 250ms \
    --pressure-hard off --log-usage --output "$WORK/${1}_agent.jsonl" 2> "$WORK/${1}_agent.err" &
  PIDS+=($!)
}
mps_on() { nvidia-cuda-mps-control -d; sleep 1; }
mps_off() { echo quit | nvidia-cuda-mps-control > /dev/null 2>&1 || true; sleep 2; }

note "# e2e/gpu/cap-in-force.sh, $(date -u +%Y-%m-%dT%H:%M:%SZ)"
note "gpu: $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | head -1)"
note "agent: $("$AGENT" --version)"
note "torch: $(python3 -c 'import torch; print(torch.__version__)')"
N=0
for name in capped unset elsewhere; do
  N=$((N + 1)); capped_pod "team-c/$name" "1a2b3c4d-0000-4000-8000-00000000032$N" 3072
done
for mib in 1024 3072 8192; do
  N=$((N + 1)); capped_pod "team-s/slack-$mib" "1a2b3c4d-0000-4000-8000-00000000032$N" "$mib"
done

# run_case CASE: the three processes of the `variable` and `default` cases, the agent watching; 25 s.
run_case() {
  local case=$1
  agent "$case"
  sleep 1
  start "${case}_capped" team-c/capped CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=3072M -- python3 -u "$WORK/client.py" 1024 6144
  start "${case}_unset" team-c/unset -- env -u CUDA_MPS_PINNED_DEVICE_MEM_LIMIT python3 -u "$WORK/client.py" 1024 6144
  start "${case}_elsewhere" team-c/elsewhere CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=3072M \
    CUDA_MPS_PIPE_DIRECTORY="$ELSEWHERE" -- python3 -u "$WORK/client.py" 1024 6144
  workloads_ready "${case}_capped" "${case}_unset" "${case}_elsewhere"
  for p in capped unset elsewhere; do
    pid_var=PID_${case}_$p
    echo "$case $p $(smi_used "${!pid_var}")" >> "$WORK/nvml.txt"
  done
  sleep 20
  stop_all
}

say "variable: the MPS server without a default"
mps_on
run_case variable
mps_off
say "default: the server default caps every client at 3G (set before the server starts: it applies to new servers)"
mps_on
echo "set_default_device_pinned_mem_limit 0 3G" | nvidia-cuda-mps-control
run_case default
mps_off

say "no-mps: the control daemon stopped"
agent nomps
sleep 1
start nomps_capped team-c/capped CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=3072M -- python3 -u "$WORK/client.py" 1024 6144
workloads_ready nomps_capped
pid_var=PID_nomps_capped
echo "nomps capped $(smi_used "${!pid_var}")" >> "$WORK/nvml.txt"
sleep 10
stop_all

say "slack: NVML's figure for a capped client at its first CUDA OOM (256 MiB steps)"
mps_on
for mib in 1024 3072 8192; do
  start "slack_$mib" "team-s/slack-$mib" "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=${mib}M" -- python3 -u "$WORK/client.py" 256 $((mib + 4096))
  workloads_ready "slack_$mib"
  pid_var=PID_slack_$mib
  echo "slack $mib $(smi_used "${!pid_var}")" >> "$WORK/nvml.txt"
  stop_all
done
mps_off

python3 - "$WORK" >> "$R" <<'PY'
import json, sys
work = sys.argv[1]
def lines(path):
    try:
        return [json.loads(l) for l in open(path) if l.strip().startswith("{")]
    except FileNotFoundError:
        return []
nvml = {}
for line in open(f"{work}/nvml.txt"):
    parts = line.split()
    nvml[(parts[0], parts[1])] = parts[2] if len(parts) > 2 else "?"
bad = []
print("\n| case | process | tensors it got (MiB) | CUDA OOM | NVML (MiB) | agent: cap in force? | seconds from the first sample showing it to the event | record |")
print("|---|---|---|---|---|---|---|---|")
for case, procs in (("variable", ("capped", "unset", "elsewhere")), ("default", ("capped", "unset", "elsewhere")),
                    ("nomps", ("capped",))):
    agent = lines(f"{work}/{case}_agent.jsonl")
    for p in procs:
        c = lines(f"{work}/{case}_{p}.jsonl")
        start = next((e["t"] for e in c if e["event"] == "start"), None)
        ready = next((e for e in c if e["event"] == "ready"), {})
        held = ready.get("held_mib", "?")
        ev = next((e for e in agent if e.get("kind") == "event" and e.get("reason") == "GpuMemoryCapNotInForce"
                   and e.get("pod", "").endswith("/" + p)), None)
        rec = next((e for e in agent if e.get("kind") == "apply" and e.get("pod", "").endswith("/" + p)
                    and "gpubudget.io/cap-not-in-force" in e.get("annotations", {})), None)
        said = ("NOT in force: " + ("not an MPS client" if "not a client" in ev["note"] else "above its cap")
                if ev else "in force (nothing told)")
        # From the first sample that showed it (the process on the GPU for "not a client", past cap + 64 MiB for
        # "above its cap") to the event.
        usage = [e for e in agent if e.get("kind") == "usage" and e.get("pod", "").endswith("/" + p)
                 and (start is None or e["ts_unix"] >= start)]
        bound = (3072 + 64) << 20 if ev and "not a client" not in ev["note"] else 0
        seen = next((e["ts_unix"] for e in usage if e.get("usage_bytes", 0) > bound), None)
        delay = f"{ev['ts_unix'] - seen:.2f}" if ev and seen else "–"
        print(f"| {case} | {p} | {held} | {ready.get('oom', '?')} | {nvml.get((case, p), '?')} | {said} | {delay} | "
              f"{'cap-not-in-force written' if rec else '–'} |")
        # Truth: more than the cap (3072 MiB of tensors can never fit under 0=3072M with the context) means uncapped.
        uncapped = isinstance(held, int) and held > 3072
        if uncapped != bool(ev):
            bad.append(f"{case}/{p}: got {held} MiB, agent said {'not in force' if ev else 'in force'}")
print("\nslack: NVML's figure for a capped client at its first CUDA OOM")
for mib in (1024, 3072, 8192):
    c = lines(f"{work}/slack_{mib}.jsonl")
    ready = next((e for e in c if e["event"] == "ready"), {})
    used = nvml.get(("slack", str(mib)), "?")
    over = int(used) - mib if used.isdigit() else "?"
    print(f"  cap {mib} MiB: tensors {ready.get('held_mib', '?')} MiB, OOM {ready.get('oom', '?')}, NVML {used} MiB "
          f"(cap + {over} MiB)")
print("\nverdict:", "every process told truthfully" if not bad else "WRONG: " + "; ".join(bad))
PY
cat "$R"
grep -q "every process told truthfully" "$R" || exit 1
