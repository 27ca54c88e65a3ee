#!/usr/bin/env bash
# On the GPU machine, after the three up.sh calls: the README's user story on a real kubelet with a real GPU.
#   helm install the packaged chart (the agent's DaemonSet as the chart writes it: hostPID, runtime class nvidia,
#   non-root, read-only root; NVML from the driver), apply budgets, PyTorch pods (their processes in the
#   kubelet's cgroups), `kubectl get gpumemorybudgets`, pod events, an eviction the kubelet carries out, pressure
#   relieved before a neighbour within its budget meets CUDA OOM, `kubectl gpubudget why/top`, helm uninstall.
# Prints PASS or FAIL: <what>; every figure is a wall-clock reading on that machine.
#   bash e2e/gpu-node/story.sh
# The PyTorch pods run the machine's own python3 (the one that holds PyTorch; no image registry there): a
# privileged container with the host's / at /host runs it under chroot. Their processes are still the pods'
# (the kubelet's pod cgroups), which is what the agent attributes; privilege is the workload's, not gpubudget's.
set -uo pipefail
# shellcheck source=e2e/gpu-node/lib.sh
source "$(dirname "$0")/lib.sh"
machine_and_chart

say "budgets (kubectl apply)"
kubectl apply -f - <<YAML | sed 's/^/    /'
apiVersion: gpubudget.io/v1alpha1
kind: GpuMemoryBudget
metadata: {name: llm, namespace: $APP}
spec:
  selector: {matchLabels: {app: llm}}
  limit: 12Gi
  warnAtPercent: 80
  action: Evict
  overLimitSeconds: 10
---
apiVersion: gpubudget.io/v1alpha1
kind: GpuMemoryBudget
metadata: {name: serve, namespace: $APP}
spec:
  selector: {matchLabels: {app: serve}}
  limit: 24Gi
  request: 24Gi
  action: Evict
  overLimitSeconds: 60
---
apiVersion: gpubudget.io/v1alpha1
kind: GpuMemoryBudget
metadata: {name: batch, namespace: $APP}
spec:
  selector: {matchLabels: {app: batch}}
  limit: 16Gi
  action: Evict
  overLimitSeconds: 3600
YAML

say "story 1: a PyTorch pod grows past its 12Gi budget (Evict after 10 s over)"
torch_pod llm-grow llm stepper --step-mib 1024 --to-gib 16 --period 2 --hold 600
wait_for 120 "llm-grow Running" sh -c "kubectl get pod -n $APP llm-grow -o jsonpath='{.status.phase}' | grep -qx Running"
wait_for 60 "llm-grow's python process holds GPU memory" sh -c "gpu_pids_out=\$(nvidia-smi --query-compute-apps=pid --format=csv,noheader); [ -n \"\$gpu_pids_out\" ]"
PID1=$(nvidia-smi --query-compute-apps=pid --format=csv,noheader | head -n1 | tr -d ' ')
info "host PID $PID1, cgroup $(cut -d: -f3 /proc/"$PID1"/cgroup | head -n1) (pod uid $(kubectl get pod -n $APP llm-grow -o jsonpath='{.metadata.uid}'))"
wait_for 60 "GpuMemoryNearBudget on llm-grow (GPU used: see below)" event_is $APP llm-grow GpuMemoryNearBudget
info "GPU used now $(used_gib) GiB"
wait_for 60 "GpuMemoryOverBudget on llm-grow" event_is $APP llm-grow GpuMemoryOverBudget
OVER_AT=$(t); info "GPU used now $(used_gib) GiB"
wait_for 60 "EvictingForGpuMemory on llm-grow" event_is $APP llm-grow EvictingForGpuMemory
info "figure: Over to the eviction request: $(awk -v a="$OVER_AT" -v b="$(t)" 'BEGIN {printf "%.1f", b - a}') s (overLimitSeconds 10)"
wait_for 60 "the kubelet killed the container (Killing event)" event_is $APP llm-grow Killing
wait_for 60 "llm-grow's process is gone from the GPU" sh -c "! nvidia-smi --query-compute-apps=pid --format=csv,noheader | grep -qw $PID1"
wait_for 60 "llm-grow deleted" pod_gone $APP llm-grow
info "figure: Over to the process gone and the pod deleted: $(awk -v a="$OVER_AT" -v b="$(t)" 'BEGIN {printf "%.1f", b - a}') s; GPU used now $(used_gib) GiB"
events_table -n $APP --field-selector involvedObject.name=llm-grow

say "story 2: pressure: serve (within its 24Gi) beside batch (16Gi, may stay over for an hour; growing to 62 GiB)"
torch_pod serve serve crosser --base-gib 18 --jump-gib 3 --cycles 100000 --hold 1
wait_for 120 "serve holds 18 GiB and cycles 3 GiB more" sh -c "kubectl logs -n $APP serve | grep -q '\"up\"'"
torch_pod batch batch stepper --step-mib 512 --to-gib 62 --period 0.5 --hold 600
wait_for 120 "batch Running" sh -c "kubectl get pod -n $APP batch -o jsonpath='{.status.phase}' | grep -qx Running"
wait_for 120 "batch over its budget: GpuMemoryOverBudget (not evicted: overLimitSeconds 3600)" event_is $APP batch GpuMemoryOverBudget
wait_for 180 "pressure: EvictingForGpuMemory on batch" event_is $APP batch EvictingForGpuMemory
info "GPU used when the script saw that event: $(used_gib) GiB (the event's message has it at the decision)"
wait_for 60 "batch deleted (the kubelet ended it)" pod_gone $APP batch
events_table -n $APP --field-selector involvedObject.name=batch
events_table -A --field-selector involvedObject.kind=Node | grep -i pressure
sleep 5
SERVE_PHASE=$(kubectl get pod -n $APP serve -o jsonpath='{.status.phase} restarts={.status.containerStatuses[0].restartCount}')
UPS=$(kubectl logs -n $APP serve | grep -c '"up"'); OOMS=$(kubectl logs -n $APP serve | grep -ci 'out of memory')
info "serve: $SERVE_PHASE, $UPS allocations of 3 GiB made, CUDA out of memory $OOMS times"
[ "$OOMS" = 0 ] && [ "${SERVE_PHASE%% *}" = Running ] || fail "serve met CUDA OOM or stopped: $SERVE_PHASE"

say "kubectl get gpumemorybudgets; kubectl gpubudget why / top"
kubectl get gpumemorybudgets -n $APP | sed 's/^/    /'
kubectl gpubudget why serve -n $APP 2>&1 | sed 's/^/    /'
kubectl gpubudget top -A 2>&1 | head -12 | sed 's/^/    /'
info "agent memory: $(grep -E 'VmHWM|VmRSS' /proc/"$APID"/status | tr -s ' \n' ' '), restarts $(kubectl get pod -n $NS "$AGENT" -o jsonpath='{.status.containerStatuses[0].restartCount}')"

say "helm uninstall"
AT=$(t)
helm uninstall gpubudget -n $NS --wait --timeout 120s | sed 's/^/    /' || fail "helm uninstall failed"
wait_for 60 "no gpubudget pod left" sh -c "[ -z \"\$(kubectl get pods -n $NS -o name)\" ]"
info "figure: helm uninstall to no gpubudget pod: $(awk -v a="$AT" -v b="$(t)" 'BEGIN {printf "%.1f", b - a}') s; serve still $(kubectl get pod -n $APP serve -o jsonpath='{.status.phase}')"
kubectl delete namespace $APP --wait=false >/dev/null
printf '\nPASS: helm install, budgets, Near/Over/Evict carried out by the kubelet, pressure relieved with the neighbour never OOM, get/why/top, helm uninstall on a real kubelet with an H100 (%s s)\n' "$(t)"
