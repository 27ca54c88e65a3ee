#!/usr/bin/env bash
# On the GPU machine, after the three up.sh calls (issue #44): one budget that takes each pod's declared share,
# on a real kubelet with a real GPU and an MPS control daemon, with the admission webhook's caps.
#   - a HAMi-shaped pod (nvidia.com/gpu: 1, nvidia.com/gpumem: 10240) grows 1 GiB/s toward 30 GiB: the webhook
#     wrote its share as the MPS cap (CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=10240M, read back from the process's
#     /proc/<pid>/environ) and the driver stops it with CUDA out of memory at its share; it is never Over.
#   - a KAI-shaped pod (gpu-fraction 0.5, schedulerName kai-scheduler, bound by nodeName, no GPU resource: KAI's
#     binder hands out devices; a fraction's size is the node's to know, so no cap at admission) grows past
#     0.5 of the card: Over at its share (KAI gpu-fraction 0.5 of <card> = …), evicted 10 s later.
#   - kubectl get gmb (SHARE column), the pods' gpubudget.io/share records, kubectl gpubudget why / top.
# Prints PASS or FAIL: <what>; every figure is a wall-clock reading on that machine.
#   bash e2e/gpu-node/shares.sh
set -uo pipefail
# shellcheck source=e2e/gpu-node/lib.sh
source "$(dirname "$0")/lib.sh"

say "an MPS control daemon on the host (the pods run the host's python3 under chroot: they reach its pipe directory)"
command -v nvidia-cuda-mps-control >/dev/null || die "nvidia-cuda-mps-control not found"
export CUDA_MPS_PIPE_DIRECTORY=/tmp/nvidia-mps CUDA_MPS_LOG_DIRECTORY=/tmp/nvidia-mps-log
mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
nvidia-cuda-mps-control -d || die "the MPS control daemon did not start"
trap 'echo quit | nvidia-cuda-mps-control >/dev/null 2>&1' EXIT
info "MPS control daemon up (pipe directory $CUDA_MPS_PIPE_DIRECTORY)"

machine_and_chart
# HAMi's device plugin would advertise nvidia.com/gpumem; nothing runs it here, so the node's status says it.
kubectl patch node gpu-node --subresource=status --type=merge \
  -p '{"status":{"capacity":{"nvidia.com/gpumem":"81920"},"allocatable":{"nvidia.com/gpumem":"81920"}}}' >/dev/null \
  || die "cannot advertise nvidia.com/gpumem"

say "one budget for every pod of the namespace: each pod's limit is its declared share; caps at admission"
kubectl apply -f - <<YAML | sed 's/^/    /'
apiVersion: gpubudget.io/v1alpha1
kind: GpuMemoryBudget
metadata: {name: shares, namespace: $APP}
spec:
  selector: {}
  limit: 80Gi
  share: {}
  admissionCaps: Enabled
  overLimitSeconds: 10
YAML
STEP_TIMEOUT=60 wait_for "the operator opened the namespace to the caps webhook" \
  sh -c "kubectl get namespace $APP -o jsonpath='{.metadata.labels.gpubudget\.io/admission-caps}' | grep -qx enabled"

say "hami: nvidia.com/gpumem 10240 (MiB) on one GPU, grows 1 GiB/s toward 30 GiB"
POD_LIMITS='nvidia.com/gpu: 1, nvidia.com/gpumem: 10240' torch_pod hami hami stepper --step-mib 1024 --to-gib 30 --period 1 --hold 600
say "kai-half: gpu-fraction 0.5, bound by nodeName as KAI's binder binds, grows 1 GiB/s toward 60 GiB"
POD_META='annotations: {gpu-fraction: "0.5"}' POD_LIMITS='cpu: 1' \
  POD_SPEC=$'schedulerName: kai-scheduler\n  nodeName: gpu-node' \
  torch_pod kai-half kai stepper --step-mib 1024 --to-gib 60 --period 1 --hold 600
CAP=$(kubectl get pod -n $APP hami -o jsonpath='{.spec.containers[0].env[?(@.name=="CUDA_MPS_PINNED_DEVICE_MEM_LIMIT")].value}')
LIM=$(kubectl get pod -n $APP hami -o jsonpath='{.spec.containers[0].env[?(@.name=="NVIDIA_GPU_MEMORY_LIMIT")].value}')
info "hami's spec as admitted: CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=$CAP NVIDIA_GPU_MEMORY_LIMIT=$LIM"
[ "$CAP" = 0=10240M ] || die "the webhook did not cap hami at its share: '$CAP'"
KCAP=$(kubectl get pod -n $APP kai-half -o jsonpath='{.spec.containers[0].env[?(@.name=="CUDA_MPS_PINNED_DEVICE_MEM_LIMIT")].value}')
info "kai-half's spec as admitted: CUDA_MPS_PINNED_DEVICE_MEM_LIMIT='$KCAP' (a fraction, no GPU resource: uncapped)"
kubectl get pod -n $APP kai-half -o jsonpath='{.metadata.annotations.gpubudget\.io/caps}' | cut -c1-300 | sed 's/^/    kai-half caps record: /'; echo

pid_of() { # POD: the host PID of the pod's GPU process (its cgroup, /kubepods/<qos>/pod<UID>/<id>, names the pod)
  local uid p; uid=$(kubectl get pod -n $APP "$1" -o jsonpath='{.metadata.uid}')
  for p in $(gpu_pids | cut -d, -f1); do grep -q "pod$uid" /proc/"$p"/cgroup 2>/dev/null && { echo "$p"; return 0; }; done
  return 1
}
STEP_TIMEOUT=120 wait_for "hami's process holds GPU memory" pid_of hami
HPID=$(pid_of hami)
info "hami: host PID $HPID; its environment: $(tr '\0' '\n' < /proc/"$HPID"/environ | grep -E '^(CUDA_MPS_PINNED_DEVICE_MEM_LIMIT|NVIDIA_GPU_MEMORY_LIMIT)=' | paste -sd' ')"
tr '\0' '\n' < /proc/"$HPID"/environ | grep -qx 'CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=10240M' || die "hami's process does not carry the cap"
PEAK=0
hami_done() { # records hami's highest NVML figure (MiB) until its log says CUDA out of memory
  local m; m=$(gpu_pids | awk -F', *' -v p="$HPID" '$1 == p {print $2}')
  [ -n "$m" ] && [ "$m" -gt "$PEAK" ] && PEAK=$m
  kubectl logs -n $APP hami 2>/dev/null | grep -qi 'out of memory'
}
until hami_done; do
  kubectl get pod -n $APP hami -o jsonpath='{.status.phase}' | grep -qx Failed && break
  awk -v e="$(elapsed)" 'BEGIN {exit !(e > 600)}' && die "hami never met CUDA OOM"
  sleep 0.2
done
kubectl logs -n $APP hami | grep -qi 'out of memory' || die "hami stopped without CUDA OOM: $(kubectl logs -n $APP hami | tail -3)"
LAST=$(kubectl logs -n $APP hami | grep '"step"' | tail -n1 | python3 -c 'import json,sys; d=json.loads(sys.stdin.read()); print("%.1f GiB reserved" % (d["reserved"] / 2**30))')
info "figure: hami met CUDA out of memory at its share: last step held $LAST; its highest NVML figure $PEAK MiB (cap 10240 MiB, its context counts)"
kubectl logs -n $APP hami | grep -i 'out of memory' | head -n1 | cut -c1-220 | sed 's/^/    hami: /'
has_core_event $APP hami GpuMemoryOverBudget && die "hami was judged over its share (the cap held it within)"

STEP_TIMEOUT=180 wait_for "GpuMemoryOverBudget on kai-half" has_core_event $APP kai-half GpuMemoryOverBudget
OVER_AT=$(elapsed); info "GPU used now $(used_gib) GiB"
kubectl get events -n $APP --field-selector involvedObject.name=kai-half,reason=GpuMemoryOverBudget -o jsonpath='{.items[0].message}{"\n"}' \
  | tee /tmp/kai-half-over.txt | sed 's/^/    message: /'
grep -q 'KAI gpu-fraction 0.5 of' /tmp/kai-half-over.txt || die "the Over event does not name kai-half's share"
kubectl get pod -n $APP kai-half -o jsonpath='{.metadata.annotations.gpubudget\.io/share}{"\n"}' | sed 's/^/    kai-half gpubudget.io\/share: /'
kubectl get gpumemorybudgets -n $APP | sed 's/^/    /'
kubectl get gmb -n $APP shares -o jsonpath='{.status.share} podsOnShare={.status.podsOnShare} podsCapped={.status.podsCapped} podsUncapped={.status.podsUncapped}{"\n"}' | sed 's/^/    status: /'
kubectl gpubudget why kai-half -n $APP 2>&1 | sed 's/^/    /'
kubectl gpubudget top -n $APP 2>&1 | sed 's/^/    /'
STEP_TIMEOUT=60 wait_for "EvictingForGpuMemory on kai-half" has_core_event $APP kai-half EvictingForGpuMemory
info "figure: Over to the eviction request: $(awk -v a="$OVER_AT" -v b="$(elapsed)" 'BEGIN {printf "%.1f", b - a}') s (overLimitSeconds 10)"
STEP_TIMEOUT=60 wait_for "kai-half deleted" pod_gone $APP kai-half
events_table -n $APP

say "after: kubectl get gmb; the agent's memory"
kubectl get gpumemorybudgets -n $APP | sed 's/^/    /'
info "agent memory: $(grep -E 'VmHWM|VmRSS' /proc/"$APID"/status | tr -s ' \n' ' '), restarts $(kubectl get pod -n $NS "$AGENT" -o jsonpath='{.status.containerStatuses[0].restartCount}')"
helm uninstall gpubudget -n $NS --wait --timeout 120s >/dev/null || die "helm uninstall failed"
kubectl delete namespace $APP --wait=false >/dev/null
printf '\nPASS: one share budget on a real kubelet with an H100 and MPS: the HAMi share capped at admission met CUDA OOM at 10240 MiB (never Over); the KAI fraction Over at its share and evicted (%s s)\n' "$(elapsed)"
