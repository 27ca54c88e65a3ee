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
HERE=$(cd "$(dirname "$0")" && pwd); REPO=$(cd "$HERE/../.." && pwd)
G=${GPU_NODE_K8S_DIR:-/tmp/gpu-node-k8s}
export PATH=$G/bin:$PATH KUBECONFIG=$G/run/kubeconfig
PY=$(command -v python3); NS=gpubudget-system; APP=ml; T0=$(date +%s.%N)
t() { awk -v a="$T0" -v b="$(date +%s.%N)" 'BEGIN {printf "%.1f", b - a}'; }
say() { printf '\n### [%s s] %s\n' "$(t)" "$*"; }
info() { printf '    [%s s] %s\n' "$(t)" "$*"; }
fail() { printf '\nFAIL: %s\n' "$*"; diagnose; exit 1; }
diagnose() {
  echo "--- diagnosis"; kubectl get pods -A -o wide 2>&1 | head -30
  kubectl get events -A --sort-by=.lastTimestamp 2>&1 | tail -30
  for c in agent operator; do
    kubectl logs -n $NS -l app.kubernetes.io/component=$c --tail=30 --all-containers 2>&1 | sed "s/^/  $c: /"
  done
  for p in $(kubectl get pods -n $APP -o name 2>/dev/null); do kubectl logs -n $APP "$p" --tail=5 2>&1 | sed "s|^|  $p: |"; done
  tail -5 "$G/logs/nvidia-runtime.log" "$G/logs/kubelet.log" 2>/dev/null
}
wait_for() { # SECONDS DESCRIPTION CMD...: poll every 0.2 s
  local limit=$1 what=$2 end; shift 2; end=$(awk -v s="$(date +%s.%N)" -v l="$limit" 'BEGIN {printf "%.3f", s + l}')
  until "$@" >/dev/null 2>&1; do
    awk -v e="$end" -v n="$(date +%s.%N)" 'BEGIN {exit !(n > e)}' && fail "$what (not within $limit s)"
    sleep 0.2
  done
  info "$what"
}
event_is() { # NAMESPACE POD REASON: the pod has an event with that reason
  kubectl get events -n "$1" --field-selector "involvedObject.name=$2,reason=$3" -o name | grep -q .
}
pod_gone() { ! kubectl get pod -n "$1" "$2" >/dev/null 2>&1; }
# events_table KUBECTL-ARGS...: the events, oldest first: reason, who reported it (the kubelet's source, or the
# agent's reportingComponent, which its events.k8s.io/v1 events carry instead) and the message.
events_table() {
  kubectl get events "$@" --sort-by=.lastTimestamp \
    -o custom-columns=REASON:.reason,SOURCE:.source.component,REPORTER:.reportingComponent,MESSAGE:.message \
    | cut -c1-280 | sed 's/^/    /'
}
gpu_pids() { nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader,nounits; }
used_gib() { nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits | awk '{printf "%.1f", $1 / 1024}'; }
torch_pod() { # NAME APP GPU-ARGS...: a PyTorch pod running e2e/gpu/workload.py with the host's python3
  local name=$1 app=$2 args; shift 2; args=$(printf '"%s", ' "$@"); args=${args%, }
  kubectl apply -f - >/dev/null <<YAML || fail "pod $name not created"
apiVersion: v1
kind: Pod
metadata: {name: $name, namespace: $APP, labels: {app: $app}}
spec:
  restartPolicy: Never
  terminationGracePeriodSeconds: 5
  hostPID: true
  containers:
    - name: torch
      image: local/busybox:1
      imagePullPolicy: Never
      command: [/bin/chroot, /host, $PY, -u, $REPO/e2e/gpu/workload.py, $args]
      env: [{name: LD_LIBRARY_PATH, value: "${LD_LIBRARY_PATH:-}"}]
      resources: {limits: {nvidia.com/gpu: "1"}}
      securityContext: {privileged: true}
      volumeMounts: [{name: host, mountPath: /host}]
  volumes: [{name: host, hostPath: {path: /}}]
YAML
}

say "the machine and the cluster"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | sed 's/^/    GPU: /'
kubectl version 2>/dev/null | sed 's/^/    /'
kubectl get node gpu-node -o wide | sed 's/^/    /'
echo "    gpubudget commit: $(cat "$G/commit")  chart: $(basename "$G"/gpubudget-*.tgz)  $(helm version --short)"
[ -z "$(gpu_pids)" ] || fail "the GPU already has processes: $(gpu_pids | paste -sd' ')"
# The pods run python3 with an empty environment but for LD_LIBRARY_PATH (the host's): check that it finds CUDA.
env -i LD_LIBRARY_PATH="${LD_LIBRARY_PATH:-}" "$PY" -c 'import torch; torch.cuda.init(); print("    PyTorch", torch.__version__, "sees", torch.cuda.get_device_name(0))' \
  || fail "the host's python3 does not reach CUDA with LD_LIBRARY_PATH=${LD_LIBRARY_PATH:-} alone"

say "helm install the packaged chart (images built from this checkout's release binaries, pullPolicy Never)"
kubectl create namespace $NS >/dev/null
kubectl label namespace $NS pod-security.kubernetes.io/enforce=privileged >/dev/null
kubectl create namespace $APP >/dev/null
kubectl label namespace $APP pod-security.kubernetes.io/enforce=privileged >/dev/null
AT=$(t)
helm install gpubudget "$G"/gpubudget-*.tgz -n $NS -f "$HERE/values.yaml" --wait --timeout 180s \
  || fail "helm install did not become ready"
info "figure: helm install --wait, every agent and operator pod ready: $(awk -v a="$AT" -v b="$(t)" 'BEGIN {printf "%.1f", b - a}') s"
kubectl get pods -n $NS -o wide | sed 's/^/    /'
AGENT=$(kubectl get pods -n $NS -l app.kubernetes.io/component=agent -o jsonpath='{.items[0].metadata.name}')
kubectl get pod -n $NS "$AGENT" -o jsonpath='{.spec.runtimeClassName} hostPID={.spec.hostPID} runAsUser={.spec.securityContext.runAsUser} readOnlyRoot={.spec.containers[0].securityContext.readOnlyRootFilesystem}{"\n"}' \
  | sed 's/^/    agent pod spec: runtimeClassName=/'
grep . "$G/logs/nvidia-runtime.log" | sed 's/^/    nvidia runtime stand-in: /'
APID=$(for p in /proc/[0-9]*; do [ "$(readlink "$p/exe" 2>/dev/null)" = /usr/local/bin/gpubudget-agent ] && echo "${p#/proc/}"; done | head -n1)
[ -n "$APID" ] || fail "no gpubudget-agent process on the host"
info "agent: host PID $APID, uid $(awk '/^Uid:/ {print $2}' /proc/"$APID"/status), cgroup $(cut -d: -f3 /proc/"$APID"/cgroup | head -n1)"
grep -q libnvidia-ml /proc/"$APID"/maps || fail "the agent has not loaded libnvidia-ml.so.1"
info "agent has NVML loaded: $(grep -o '/[^ ]*libnvidia-ml[^ ]*' /proc/"$APID"/maps | sort -u | head -n1)"
kubectl logs -n $NS "$AGENT" | grep -iE "nvml|gpu|sampl" | head -5 | cut -c1-220 | sed 's/^/    agent log: /'

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
