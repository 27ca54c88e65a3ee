#!/usr/bin/env bash
# Sourced by e2e/gpu-node/story.sh, shares.sh, shares-rewrite.sh and runtime-caps.sh, on the GPU machine after the
# three up.sh calls: e2e/lib.sh (sourced here: say, info, die, wait_for, has_core_event, pod_gone, ...; a die runs
# diagnose first, ON_DIE), then the cluster's paths, PyTorch pods, and the chart's install (machine_and_chart).
# shellcheck disable=SC2034 # NS, APP, AGENT and APID are the sourcing scripts'
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd); REPO=$(cd "$HERE/../.." && pwd)
POLL=0.2
# shellcheck source=../lib.sh
. "$REPO/e2e/lib.sh"
ON_DIE=diagnose
G=${GPU_NODE_K8S_DIR:-/tmp/gpu-node-k8s}
export PATH=$G/bin:$PATH KUBECONFIG=$G/run/kubeconfig
PY=$(command -v python3); NS=gpubudget-system; APP=ml
diagnose() {
  echo "--- diagnosis"; kubectl get pods -A -o wide 2>&1 | head -30
  kubectl get events -A --sort-by=.lastTimestamp 2>&1 | tail -30
  for c in agent operator; do
    kubectl logs -n $NS -l app.kubernetes.io/component=$c --tail=30 --all-containers 2>&1 | sed "s/^/  $c: /"
  done
  for p in $(kubectl get pods -n $APP -o name 2>/dev/null); do kubectl logs -n $APP "$p" --tail=5 2>&1 | sed "s|^|  $p: |"; done
  tail -5 "$G/logs/nvidia-runtime.log" "$G/logs/kubelet.log" 2>/dev/null
}
# events_table KUBECTL-ARGS...: the events, oldest first: reason, who reported it (the kubelet's source, or the
# agent's reportingComponent, which its events.k8s.io/v1 events carry instead) and the message.
events_table() {
  kubectl get events "$@" --sort-by=.lastTimestamp \
    -o custom-columns=REASON:.reason,SOURCE:.source.component,REPORTER:.reportingComponent,MESSAGE:.message \
    | cut -c1-280 | sed 's/^/    /'
}
# card_size: CARD_GIB, the GPU's memory in GiB as NVML totals it (79.6 on an H100, 140.4 on an H200).
card_size() { CARD_GIB=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -n1 | awk '{printf "%.1f", $1 / 1024}'); }
# agent_pid: the host PID of `gpubudget-agent run` (not the runtime-caps relay, the same binary).
agent_pid() {
  local p
  for p in /proc/[0-9]*; do
    [ "$(readlink "$p/exe" 2>/dev/null)" = /usr/local/bin/gpubudget-agent ] || continue
    [ "$(tr '\0' '\n' < "$p/cmdline" 2>/dev/null | sed -n 2p)" = run ] && echo "${p#/proc/}"
  done | head -n1
}
gpu_pids() { nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader,nounits; }
used_gib() { nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits | awk '{printf "%.1f", $1 / 1024}'; }
# torch_pod NAME APP GPU-ARGS...: a PyTorch pod running e2e/gpu/workload.py with the host's python3. Shaped by
# POD_META (more metadata fields, flow YAML: `annotations: {gpu-fraction: "0.5"}`), POD_SPEC (more spec fields:
# `schedulerName: kai-scheduler, nodeName: gpu-node`), POD_ENV (more env items, flow YAML) and POD_LIMITS (the
# container's limits; default one GPU).
torch_pod() {
  local name=$1 app=$2 args; shift 2; args=$(printf '"%s", ' "$@"); args=${args%, }
  kubectl apply -f - >/dev/null <<YAML || die "pod $name not created"
apiVersion: v1
kind: Pod
metadata: {name: $name, namespace: $APP, labels: {app: $app}${POD_META:+, $POD_META}}
spec:
  restartPolicy: Never
  terminationGracePeriodSeconds: 5
  hostPID: true
  ${POD_SPEC:+$POD_SPEC}
  containers:
    - name: torch
      image: local/busybox:1
      imagePullPolicy: Never
      command: [/bin/chroot, /host, $PY, -u, $REPO/e2e/gpu/workload.py, $args]
      env: [{name: LD_LIBRARY_PATH, value: "${LD_LIBRARY_PATH:-}"}${POD_ENV:+, $POD_ENV}]
      resources: {limits: {${POD_LIMITS:-nvidia.com/gpu: 1}}}
      securityContext: {privileged: true}
      volumeMounts: [{name: host, mountPath: /host}]
  volumes: [{name: host, hostPath: {path: /}}]
YAML
}

# machine_and_chart: what runs there, then helm install of the packaged chart (values.yaml), its pods checked.
machine_and_chart() {
  say "the machine and the cluster"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | sed 's/^/    GPU: /'
  card_size
  kubectl version 2>/dev/null | sed 's/^/    /'
  kubectl get node gpu-node -o wide | sed 's/^/    /'
  echo "    gpubudget commit: $(cat "$G/commit")  chart: $(basename "$G"/gpubudget-*.tgz)  $(helm version --short)"
  [ -z "$(gpu_pids)" ] || die "the GPU already has processes: $(gpu_pids | paste -sd' ')"
  # The pods run python3 with an empty environment but for LD_LIBRARY_PATH (the host's): check that it finds CUDA.
  env -i LD_LIBRARY_PATH="${LD_LIBRARY_PATH:-}" "$PY" -c 'import torch; torch.cuda.init(); print("    PyTorch", torch.__version__, "sees", torch.cuda.get_device_name(0))' \
    || die "the host's python3 does not reach CUDA with LD_LIBRARY_PATH=${LD_LIBRARY_PATH:-} alone"

  say "helm install the packaged chart (images built from this checkout's release binaries, pullPolicy Never)"
  kubectl create namespace $NS >/dev/null
  kubectl label namespace $NS pod-security.kubernetes.io/enforce=privileged >/dev/null
  kubectl create namespace $APP >/dev/null
  kubectl label namespace $APP pod-security.kubernetes.io/enforce=privileged >/dev/null
  AT=$(elapsed)
  # shellcheck disable=SC2086 # CHART_SETS: more --set flags, split on spaces
  helm install gpubudget "$G"/gpubudget-*.tgz -n $NS -f "$HERE/values.yaml" ${CHART_SETS:-} --wait --timeout 180s \
    || die "helm install did not become ready"
  info "figure: helm install --wait, every agent and operator pod ready: $(awk -v a="$AT" -v b="$(elapsed)" 'BEGIN {printf "%.1f", b - a}') s"
  kubectl get pods -n $NS -o wide | sed 's/^/    /'
  AGENT=$(kubectl get pods -n $NS -l app.kubernetes.io/component=agent -o jsonpath='{.items[0].metadata.name}')
  kubectl get pod -n $NS "$AGENT" -o jsonpath='{.spec.runtimeClassName} hostPID={.spec.hostPID} runAsUser={.spec.securityContext.runAsUser} readOnlyRoot={.spec.containers[0].securityContext.readOnlyRootFilesystem}{"\n"}' \
    | sed 's/^/    agent pod spec: runtimeClassName=/'
  grep . "$G/logs/nvidia-runtime.log" | sed 's/^/    nvidia runtime stand-in: /'
  APID=$(agent_pid)
  [ -n "$APID" ] || die "no gpubudget-agent process on the host"
  info "agent: host PID $APID, uid $(awk '/^Uid:/ {print $2}' /proc/"$APID"/status), cgroup $(cut -d: -f3 /proc/"$APID"/cgroup | head -n1)"
  grep -q libnvidia-ml /proc/"$APID"/maps || die "the agent has not loaded libnvidia-ml.so.1"
  info "agent has NVML loaded: $(grep -o '/[^ ]*libnvidia-ml[^ ]*' /proc/"$APID"/maps | sort -u | head -n1)"
  kubectl logs -n $NS "$AGENT" | grep -iE "nvml|gpu|sampl" | head -5 | cut -c1-220 | sed 's/^/    agent log: /'
}
