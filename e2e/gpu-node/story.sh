#!/usr/bin/env bash
# On the GPU machine, after the three up.sh calls: the README's user story on a real kubelet with a real GPU.
#   helm install the packaged chart (the agent's DaemonSet as the chart writes it: hostPID, runtime class nvidia,
#   non-root, read-only root; NVML from the driver), apply budgets, PyTorch pods (their processes in the
#   kubelet's cgroups), `kubectl get gpumemorybudgets`, pod events, an eviction the kubelet carries out, pressure
#   relieved before a neighbour within its budget meets CUDA OOM, `kubectl gpubudget why/top`, helm uninstall.
# Prints PASS or FAIL: <what>; every figure is a wall-clock reading on that machine. Sizes come from the card
# (an H100's 80 GB or an H200's 141 GB): the pressure story's grower aims past what fits beside its neighbour.
# The chart runs at its defaults but for the images (values.yaml): hard threshold 5 %, unbudgetedPods Ranked.
#   bash e2e/gpu-node/story.sh          # stories 1-2, get/why/top, and story 3 started (a lone preallocator)
#   bash e2e/gpu-node/story.sh finish   # a later device call: story 3 checked after 10 minutes, helm uninstall
# The PyTorch pods run the machine's own python3 (the one that holds PyTorch; no image registry there): a
# privileged container with the host's / at /host runs it under chroot. Their processes are still the pods'
# (the kubelet's pod cgroups), which is what the agent attributes; privilege is the workload's, not gpubudget's.
set -uo pipefail
# shellcheck source=e2e/gpu-node/lib.sh
source "$(dirname "$0")/lib.sh"
LONE_FOR=${LONE_FOR:-600}   # story 3: how long the lone preallocator must run untouched (s)

# story 3, end: the lone preallocator ran LONE_FOR s untouched; then helm uninstall.
finish() {
  say "story 3 (end): vllm, alone at 95 % of the GPU with no budget, for $LONE_FOR s at the chart's defaults"
  local started age
  started=$(kubectl get pod -n $APP vllm -o jsonpath='{.status.startTime}') || die "no pod vllm: run story.sh first"
  age=$(( $(date +%s) - $(date -d "$started" +%s) ))
  while [ "$age" -lt "$LONE_FOR" ]; do
    kubectl get pod -n $APP vllm >/dev/null 2>&1 || die "vllm gone after $age s"
    has_core_event $APP vllm EvictingForGpuMemory && die "vllm evicted after $age s"
    sleep 5; age=$(( $(date +%s) - $(date -d "$started" +%s) ))
  done
  local phase
  phase=$(kubectl get pod -n $APP vllm -o jsonpath='{.status.phase} restarts={.status.containerStatuses[0].restartCount} deletion={.metadata.deletionTimestamp}')
  info "vllm after $age s: $phase; GPU used $(used_gib) of $CARD_GIB GiB; its events:"
  events_table -n $APP --field-selector involvedObject.name=vllm
  events_table -A --field-selector involvedObject.kind=Node | grep -E "Pressure|NoneHarmed" || true
  [ "$phase" = "Running restarts=0 deletion=" ] || die "vllm was not left alone: $phase"
  under_pressure || die "the GPU is not under pressure: the story proves nothing"
  info "the GPU is still under pressure (gpubudget_gpu_memory_pressure 1)"
  has_core_event $APP vllm EvictingForGpuMemory && die "vllm has an EvictingForGpuMemory event"
  kubectl get events -A --field-selector involvedObject.kind=Node,reason=GpuMemoryFullNoneHarmed -o name | grep -q . \
    || die "no GpuMemoryFullNoneHarmed on the Node"
  info "agent memory: $(grep -E 'VmHWM|VmRSS' /proc/"$(agent_pid)"/status | tr -s ' \n' ' ')"

  say "helm uninstall"
  AT=$(elapsed)
  helm uninstall gpubudget -n $NS --wait --timeout 120s | sed 's/^/    /' || die "helm uninstall failed"
  STEP_TIMEOUT=60 wait_for "no gpubudget pod left" sh -c "[ -z \"\$(kubectl get pods -n $NS -o name)\" ]"
  info "figure: helm uninstall to no gpubudget pod: $(awk -v a="$AT" -v b="$(elapsed)" 'BEGIN {printf "%.1f", b - a}') s; vllm still $(kubectl get pod -n $APP vllm -o jsonpath='{.status.phase}')"
  kubectl delete namespace $APP --wait=false >/dev/null
  printf '\nPASS: a pod alone at 95 %% of the GPU ran %s s untouched at the chart defaults; helm uninstall\n' "$age"
  exit 0
}
# under_pressure: the agent's gauge for GPU 0 is 1 (its admin port on the pod's address).
under_pressure() {
  local ip
  ip=$(kubectl get pods -n $NS -l app.kubernetes.io/component=agent -o jsonpath='{.items[0].status.podIP}')
  curl -fsS "http://$ip:9400/metrics" | grep -q '^gpubudget_gpu_memory_pressure{gpu="0"} 1$'
}
[ "${1:-}" = finish ] && { card_size; finish; }
machine_and_chart
# The pressure story's sizes: serve holds 18 GiB and jumps 3 GiB (2 on a card under 100 GiB, whose 5 % threshold
# is under 4 GiB); the grower aims at what would fill the card beside serve's base.
JUMP=$(awk -v c="$CARD_GIB" 'BEGIN {print (c >= 100 ? 3 : 2)}')
GROW_TO=$(awk -v c="$CARD_GIB" 'BEGIN {printf "%d", c - 18 + 0.999}')
info "card: $CARD_GIB GiB; pressure story: serve 18 GiB + $JUMP GiB jumps, batch grows to $GROW_TO GiB"

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
  action: Warn
YAML

say "story 1: a PyTorch pod grows past its 12Gi budget (Evict after 10 s over)"
torch_pod llm-grow llm stepper --step-mib 1024 --to-gib 16 --period 2 --hold 600
STEP_TIMEOUT=120 wait_for "llm-grow Running" sh -c "kubectl get pod -n $APP llm-grow -o jsonpath='{.status.phase}' | grep -qx Running"
STEP_TIMEOUT=60 wait_for "llm-grow's python process holds GPU memory" sh -c "gpu_pids_out=\$(nvidia-smi --query-compute-apps=pid --format=csv,noheader); [ -n \"\$gpu_pids_out\" ]"
PID1=$(nvidia-smi --query-compute-apps=pid --format=csv,noheader | head -n1 | tr -d ' ')
info "host PID $PID1, cgroup $(cut -d: -f3 /proc/"$PID1"/cgroup | head -n1) (pod uid $(kubectl get pod -n $APP llm-grow -o jsonpath='{.metadata.uid}'))"
STEP_TIMEOUT=60 wait_for "GpuMemoryNearBudget on llm-grow (GPU used: see below)" has_core_event $APP llm-grow GpuMemoryNearBudget
info "GPU used now $(used_gib) GiB"
STEP_TIMEOUT=60 wait_for "GpuMemoryOverBudget on llm-grow" has_core_event $APP llm-grow GpuMemoryOverBudget
OVER_AT=$(elapsed); info "GPU used now $(used_gib) GiB"
STEP_TIMEOUT=60 wait_for "EvictingForGpuMemory on llm-grow" has_core_event $APP llm-grow EvictingForGpuMemory
info "figure: Over to the eviction request: $(awk -v a="$OVER_AT" -v b="$(elapsed)" 'BEGIN {printf "%.1f", b - a}') s (overLimitSeconds 10)"
STEP_TIMEOUT=60 wait_for "the kubelet killed the container (Killing event)" has_core_event $APP llm-grow Killing
STEP_TIMEOUT=60 wait_for "llm-grow's process is gone from the GPU" sh -c "! nvidia-smi --query-compute-apps=pid --format=csv,noheader | grep -qw $PID1"
STEP_TIMEOUT=60 wait_for "llm-grow deleted" pod_gone $APP llm-grow
info "figure: Over to the process gone and the pod deleted: $(awk -v a="$OVER_AT" -v b="$(elapsed)" 'BEGIN {printf "%.1f", b - a}') s; GPU used now $(used_gib) GiB"
events_table -n $APP --field-selector involvedObject.name=llm-grow

say "story 2: pressure: serve (within its 24Gi) beside batch (16Gi, action Warn: never evicted for its own limit; growing to $GROW_TO GiB)"
torch_pod serve serve crosser --base-gib 18 --jump-gib "$JUMP" --cycles 100000 --hold 1
STEP_TIMEOUT=120 wait_for "serve holds 18 GiB and cycles $JUMP GiB more" sh -c "kubectl logs -n $APP serve | grep -q '\"up\"'"
torch_pod batch batch stepper --step-mib 512 --to-gib "$GROW_TO" --period 0.5 --hold 600
STEP_TIMEOUT=120 wait_for "batch Running" sh -c "kubectl get pod -n $APP batch -o jsonpath='{.status.phase}' | grep -qx Running"
STEP_TIMEOUT=120 wait_for "batch over its budget: GpuMemoryOverBudget (not evicted for it: action Warn)" has_core_event $APP batch GpuMemoryOverBudget
STEP_TIMEOUT=180 wait_for "pressure: EvictingForGpuMemory on batch" has_core_event $APP batch EvictingForGpuMemory
info "GPU used when the script saw that event: $(used_gib) GiB (the event's message has it at the decision)"
STEP_TIMEOUT=60 wait_for "batch deleted (the kubelet ended it)" pod_gone $APP batch
events_table -n $APP --field-selector involvedObject.name=batch
events_table -A --field-selector involvedObject.kind=Node | grep -i pressure
sleep 5
SERVE_PHASE=$(kubectl get pod -n $APP serve -o jsonpath='{.status.phase} restarts={.status.containerStatuses[0].restartCount}')
UPS=$(kubectl logs -n $APP serve | grep -c '"up"'); OOMS=$(kubectl logs -n $APP serve | grep -ci 'out of memory')
info "serve: $SERVE_PHASE, $UPS allocations of $JUMP GiB made, CUDA out of memory $OOMS times"
kubectl get events -n $APP --field-selector involvedObject.name=batch,reason=EvictingForGpuMemory -o jsonpath='{.items[0].message}' \
  | grep -q "its budget's action is Warn" || die "batch's eviction does not say Warn did not keep it"
[ "$OOMS" = 0 ] && [ "${SERVE_PHASE%% *}" = Running ] || die "serve met CUDA OOM or stopped: $SERVE_PHASE"

say "kubectl get gpumemorybudgets; kubectl gpubudget why / top"
kubectl get gpumemorybudgets -n $APP | sed 's/^/    /'
kubectl gpubudget why serve -n $APP 2>&1 | sed 's/^/    /'
kubectl gpubudget top -A 2>&1 | head -12 | sed 's/^/    /'
info "agent memory: $(grep -E 'VmHWM|VmRSS' /proc/"$APID"/status | tr -s ' \n' ' '), restarts $(kubectl get pod -n $NS "$AGENT" -o jsonpath='{.status.containerStatuses[0].restartCount}')"

say "story 3 (start): serve leaves; vllm, no budget, alone, preallocates 95 % of the GPU (what --gpu-memory-utilization 0.95 does)"
kubectl delete pod -n $APP serve --wait=true --timeout=60s >/dev/null || die "serve not deleted"
STEP_TIMEOUT=60 wait_for "no process on the GPU" sh -c "[ -z \"\$(nvidia-smi --query-compute-apps=pid --format=csv,noheader)\" ]"
PRE=$(awk -v c="$CARD_GIB" 'BEGIN {printf "%.1f", c * 0.95 - 0.5}')   # + a CUDA context of ~0.5 GiB: 95 % of the card
torch_pod vllm vllm hold --gib "$PRE"
STEP_TIMEOUT=180 wait_for "vllm holds $PRE GiB (+ its CUDA context)" sh -c "kubectl logs -n $APP vllm | grep -q '\"ready\"'"
info "GPU used $(used_gib) of $CARD_GIB GiB"
# The agent's own word that the GPU is under pressure now (the Node events of story 2's episode are still there, and
# an event series keeps its first note).
STEP_TIMEOUT=60 wait_for "the GPU under pressure (gpubudget_gpu_memory_pressure 1 on the agent's admin port)" under_pressure
events_table -A --field-selector involvedObject.kind=Node,reason=GpuMemoryFullNoneHarmed
sleep 30
has_core_event $APP vllm EvictingForGpuMemory && die "vllm evicted"
info "vllm untouched so far; \`story.sh finish\` checks it after $LONE_FOR s and uninstalls"
printf '\nPASS (part 1): helm install, budgets, Near/Over/Evict carried out by the kubelet, pressure relieved (a Warn grower) with the neighbour never OOM, get/why/top, a lone preallocator left alone so far, on a real kubelet with a %s (%s s)\n' "$(nvidia-smi --query-gpu=name --format=csv,noheader)" "$(elapsed)"
exit 0

