#!/usr/bin/env bash
# Every byte accounted for, on a real GPU (issue 12). Run as root on a host with an NVIDIA GPU, cgroup v2,
# python3 + torch, the MPS binaries (nvidia-cuda-mps-control) and util-linux's unshare:
#
#   cargo build -p gpubudget-agent --release && mkdir -p carry && cp target/release/gpubudget-agent carry/
#   OUT=/tmp/out GPUBUDGET_AGENT=carry/gpubudget-agent bash e2e/gpu/accounting.sh
#
# Three phases, pods in kubelet-shaped cgroups (e2e/gpu/lib.sh), the agent's `top --once --output json` and
# nvidia-smi read side by side in each:
#   plain  team-a/llm-0 holds 2 GiB (no MPS): the baseline of what no process accounts for.
#   mps    the MPS control daemon started (stopped at the end); team-a/llm-0 runs two MPS clients (2 and
#          4 GiB), team-b/embed-0 one (3 GiB). Per-client figures against nvidia-smi, each client charged to
#          its pod, the server unattributed; the agent (standalone, budgets llm 6Gi Evict, embed 8Gi) decides
#          to evict llm-0 (7+ GiB over MPS) and its /metrics are read.
#   blind  llm-0 holds 8 GiB (no MPS) and the agent runs in a PID namespace of its own (what a DaemonSet
#          without hostPID gets): NVML lists nothing, the 8 GiB are unaccounted, and the Node event names the
#          cause (--unaccounted-for 2s here).
# Results in $OUT/results.txt; the raw files beside it.
set -euo pipefail
cd "$(dirname "$0")/../.."

OUT=${OUT:-$(mktemp -d /tmp/gpubudget-accounting-out.XXXX)}
AGENT=${GPUBUDGET_AGENT:-carry/gpubudget-agent}
WORK=$(mktemp -d /tmp/gpubudget-accounting.XXXX)
mkdir -p "$OUT"
# shellcheck source=e2e/gpu/lib.sh
source e2e/gpu/lib.sh
export CUDA_MPS_PIPE_DIRECTORY=$WORK/mps-pipe CUDA_MPS_LOG_DIRECTORY=$WORK/mps-log
ADMIN=127.0.0.1:9409
cleanup() {
  lib_cleanup
  echo quit | nvidia-cuda-mps-control > /dev/null 2>&1
  tar -C "$WORK" -czf "$OUT/accounting-raw.tgz" . 2>/dev/null
  cp -f "$WORK/results.txt" "$OUT/" 2>/dev/null
  rm -rf "$WORK"
}
trap cleanup EXIT
[ -x "$AGENT" ] || die "no agent binary at $AGENT"
command -v nvidia-cuda-mps-control > /dev/null || die "no nvidia-cuda-mps-control"

pod team-a/llm-0 1a2b3c4d-0000-4000-8000-000000000121
pod team-b/embed-0 1a2b3c4d-0000-4000-8000-000000000122
cat > "$WORK/budgets.yaml" <<'YAML'
apiVersion: gpubudget.io/v1alpha1
kind: GpuMemoryBudget
metadata: {name: llm, namespace: team-a}
spec: {selector: {}, limit: 6Gi, overLimitSeconds: 0, evictionGracePeriodSeconds: 5}
---
apiVersion: gpubudget.io/v1alpha1
kind: GpuMemoryBudget
metadata: {name: embed, namespace: team-b}
spec: {selector: {}, limit: 8Gi}
YAML
HOLD=(python3 -u e2e/gpu/workload.py hold)

look() { # phase: what top and nvidia-smi say, side by side
  "$AGENT" top --once --output json --no-api > "$WORK/$1-top.json"
  nvidia-smi --query-compute-apps=pid,used_memory,process_name --format=csv,noheader,nounits > "$WORK/$1-smi.csv"
  nvidia-smi > "$WORK/$1-smi.txt"
}
agent() { # phase [flags]: the agent for a few seconds, its /metrics read while it runs
  local phase=$1; shift
  "$AGENT" standalone --budgets "$WORK/budgets.yaml" --pods "$WORK/pods.yaml" --node-name "$NODE" \
    --interval 250ms --duration 6s --admin-addr "$ADMIN" --output "$WORK/$phase-agent.jsonl" "$@" 2> "$WORK/$phase-agent.err" &
  local pid=$!
  sleep 4
  python3 -c "import urllib.request,sys; sys.stdout.write(urllib.request.urlopen('http://$ADMIN/metrics').read().decode())" \
    > "$WORK/$phase-metrics.txt" || say "no metrics from the agent"
  wait "$pid"
}

say "phase plain: one process, no MPS"
start plain team-a/llm-0 -- "${HOLD[@]}" --gib 2
workloads_ready plain
look plain
stop_all

say "phase mps: the MPS control daemon, three clients in two pods"
mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
nvidia-cuda-mps-control -d
start a1 team-a/llm-0 -- "${HOLD[@]}" --gib 2
start a2 team-a/llm-0 -- "${HOLD[@]}" --gib 4
start b1 team-b/embed-0 -- "${HOLD[@]}" --gib 3
workloads_ready a1 a2 b1
look mps
agent mps
stop_all
echo quit | nvidia-cuda-mps-control
sleep 2

say "phase blind: the agent in its own PID namespace"
start blind team-a/llm-0 -- "${HOLD[@]}" --gib 8
workloads_ready blind
unshare --pid --fork --mount-proc "$AGENT" top --once --output json --no-api > "$WORK/blind-top.json"
nvidia-smi --query-compute-apps=pid,used_memory,process_name --format=csv,noheader,nounits > "$WORK/blind-smi.csv"
unshare --pid --fork --mount-proc "$AGENT" standalone --budgets "$WORK/budgets.yaml" --pods "$WORK/pods.yaml" \
  --node-name "$NODE" --interval 250ms --duration 4s --unaccounted-for 2s --output "$WORK/blind-agent.jsonl" 2> "$WORK/blind-agent.err"
stop_all

{ echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  echo "gpu: $(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | head -1)"
  echo "agent: $("$AGENT" --version)"; echo "torch: $(python3 -c 'import torch; print(torch.__version__)')"; } > "$WORK/results.txt"
python3 - "$WORK" >> "$WORK/results.txt" <<'PY'
import json, sys
work = sys.argv[1]
MIB = 1 << 20
def load(path):
    try:
        return json.load(open(path))
    except (FileNotFoundError, json.JSONDecodeError):
        return None
def lines(path):
    try:
        return [json.loads(l) for l in open(path) if l.strip().startswith("{")]
    except FileNotFoundError:
        return []
def smi(phase):
    out = {}
    try:
        for row in open(f"{work}/{phase}-smi.csv"):
            pid, mib, name = [x.strip() for x in row.split(",", 2)]
            out[int(pid)] = (int(mib), name)
    except FileNotFoundError:
        pass
    return out
for phase in ("plain", "mps", "blind"):
    top, s = load(f"{work}/{phase}-top.json"), smi(phase)
    print(f"\n## {phase}")
    if not top:
        print("(no top output)"); continue
    for g in top["gpus"]:
        un = g.get("unaccounted_bytes")
        print(f"GPU {g['gpu']} {g['state']}: processes {g['used_bytes'] / MIB:.0f} MiB, unaccounted "
              f"{'-' if un is None else f'{un / MIB:.0f} MiB'}, MPS clients {g['mps_clients']}, without figures {g['unavailable']}")
    print("| pid | command | pod (UID) | agent (MiB) | nvidia-smi (MiB) |")
    print("| --- | --- | --- | --- | --- |")
    for p in top["processes"]:
        theirs = s.get(p["pid"], ("–", ""))[0]
        mine = "n/a" if p["bytes"] is None else f"{p['bytes'] / MIB:.0f}"
        print(f"| {p['pid']} | {p['command']} | {p['pod'][-3:] if p['pod'] else '(no pod)'} | {mine} | {theirs} |")
    missing = [pid for pid in s if pid not in {p['pid'] for p in top['processes']}]
    print(f"nvidia-smi processes the agent did not list: {missing or 'none'}")
    for p in top["pods"]:
        split = ", ".join(f"GPU {k}: {v / MIB:.0f} MiB" for k, v in p["by_gpu"].items())
        print(f"pod …{p['uid'][-3:]}: {p['used_bytes'] / MIB:.0f} MiB ({split})")
    for line in lines(f"{work}/{phase}-agent.jsonl"):
        if line.get("kind") in ("event", "node_event", "evict"):
            print(f"agent {line['kind']}: {line.get('reason', '')} {line.get('pod', '')} {line.get('note', '')}".rstrip())
    try:
        for m in open(f"{work}/{phase}-metrics.txt"):
            if m.startswith(("gpubudget_gpu_unaccounted_bytes", "gpubudget_gpu_processes_unavailable", "gpubudget_gpu_sampled", "gpubudget_pod_gpu_memory_bytes")):
                print("metric " + m.rstrip())
    except FileNotFoundError:
        pass
PY
cat "$WORK/results.txt"
