#!/usr/bin/env bash
# Budgets whose limit is each pod's declared share (issue 44) against a real kube-apiserver, no kubelet: the operator
# (status, the caps webhook, the eviction webhook) and one agent (token bound to its Node, GPU usage replayed from a
# sample file, 80 GiB GPU) with the chart's RBAC and admission policies; pods shaped as KAI-Scheduler, HAMi and the
# NVIDIA device plugin leave them (common/tests/fixtures/shares/), created by a tenant (`edit` in its namespace)
# and bound by spec.nodeName (no scheduler: the API server checks no Node capacity for them).
#
#   GPUBUDGET_E2E_APISERVER=1 KUBECONFIG=/tmp/realk8s/run/kubeconfig e2e/apiserver/shares.sh [OUT]
#   GPUBUDGET_E2E_APISERVER=1 REALK8S_DIR=/tmp/realk8s e2e/apiserver/shares.sh [OUT]   # starts it (up.sh), stops it
#
# The story, each step asserted on real objects:
# 1. a GpuMemoryBudget `shares` {selector: {}, limit: 80Gi, share: {}, admissionCaps: Enabled, overLimitSeconds: 10};
# 2. the tenant's pods: kai-half (gpu-fraction "0.5") and kai-quarter ("0.25"), schedulerName kai-scheduler, no GPU
#    resource, NVIDIA_VISIBLE_DEVICES from a ConfigMap (valueFrom) and an envFrom ConfigMap, as KAI's webhook and
#    binder leave them; hami (nvidia.com/gpu: 1, nvidia.com/gpumem: 10240, as HAMi's scheduler leaves it); kai-nan
#    (gpu-fraction "NaN", which KAI's own webhook admits);
# 3. at admission (the operator's webhook): hami gets CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=10240M and
#    NVIDIA_GPU_MEMORY_LIMIT=10240 (its absolute share, not the 80Gi limit); the KAI pods (a fraction: capped at the
#    limit) are recorded uncapped, with the reason (their devices come from a ConfigMap);
# 4. the agent resolves and records each share (`gpubudget.io/share`), tells kai-nan's once
#    (GpuMemoryShareUnresolved); the budget's status: SHARE `KAI gpu-fraction 2, HAMi gpumem 1, unresolved 1` (by
#    source, in the CRD's order), podsOnShare 3, podsShareUnresolved 1, CAPPED 1, UNCAPPED 3;
# 5. kai-half at 44Gi (over its 40Gi share, within the 80Gi limit) and hami at 12Gi (over its 10Gi): Over, the
#    messages naming the shares, both evicted 10 s later (hami's MPS cap told not in force, #32: counted uncapped
#    from then on); kai-quarter at 15Gi of its 20Gi: no event;
# 6. a plain budget {selector: {}, limit: 30Gi} added: the smallest limit wins with shares: kai-quarter stays under
#    `shares` (its 20Gi share < 30Gi), kai-nan (unresolved: held to 80Gi) moves to the plain one; both budgets'
#    status; `kubectl gpubudget why kai-quarter` (its Share: line) and `kubectl gpubudget top`;
# 7. the Node labelled as GPU feature discovery labels it for MPS (sharing-strategy mps, replicas 4) and a pod
#    asking nvidia.com/gpu: 1 at 22Gi: the agent (not restarted) reads the labels within its 60 s period and holds
#    the pod to "MPS replica of 4 per GPU of 80Gi = 20Gi" (Over); the time from the label to the Over event.
# (kai-half had to go before the plain budget came: its 40Gi share is larger than 30Gi, so the plain budget would
# hold it, rightly, and its messages would not name its share.)
# OUT (optional) receives a copy of the output.
#
# Environment: as e2e/lib.sh says (GPUBUDGET_E2E_BIN, HELM, GPUBUDGET_E2E_STEP_TIMEOUT, GPUBUDGET_E2E_KEEP, REALK8S).
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
REPO=$(cd "$HERE/../.." && pwd)
REALK8S=${REALK8S:-/work/shared/realk8s}
if [ -n "${1:-}" ] && [ -z "${SHARES_TEE:-}" ]; then
  SHARES_TEE=1 exec > >(tee "$1") 2>&1
fi

# shellcheck source=../lib.sh
. "$REPO/e2e/lib.sh"
control_plane_or_skip "budgets on declared shares" gpubudget-agent gpubudget-operator kubectl-gpubudget
STEP_TIMEOUT=${GPUBUDGET_E2E_STEP_TIMEOUT:-60}
POLL=0.5
GI=1073741824
export PATH=$BIN:$PATH              # kubectl finds kubectl-gpubudget there

ID=$(date +%s | tail -c 5)$RANDOM
ID=${ID:0:7}
NS=gpubudget-sh-$ID                 # the release's namespace (its ServiceAccounts)
NS_T=gpubudget-sh-$ID-t             # the tenant's
NODE=gpubudget-sh-$ID-n1
RELEASE=gpubudget-sh-$ID
LEASE=$RELEASE-operator-mirrors     # as the chart names the mirrors' Lease
WORK=$(mktemp -d "${TMPDIR:-/tmp}/gpubudget-shares.XXXXXX")
PORT_BASE=$((20000 + RANDOM % 20000))
AGENT_ADMIN=127.0.0.1:$PORT_BASE
OPERATOR_ADMIN=127.0.0.1:$((PORT_BASE + 1))
WEBHOOK=127.0.0.1:$((PORT_BASE + 2))
AGENT_PID="" OPERATOR_PID=""
FAILED=1
START=$SECONDS
SUMMARY=()

cleanup() {
  local rc=$?
  if [ "$FAILED" != 0 ]; then
    say "diagnostics"
    kubectl get pods,gmb -n "$NS_T" -o wide || true
    kubectl get events.v1.events.k8s.io -n "$NS_T" -o json 2>/dev/null \
      | jq -r '.items[] | "\(.regarding.name) \(.reason) \(.series.count // 1) \(.note)"' | cut -c1-300 || true
    echo "--- operator log (last 40 lines)"; tail -n 40 "$WORK/operator.log" 2>/dev/null || true
    echo "--- agent log (last 80 lines)"; tail -n 80 "$WORK/agent.log" 2>/dev/null || true
  fi
  stop_process "$AGENT_PID"
  stop_process "$OPERATOR_PID"
  if [ "${GPUBUDGET_E2E_KEEP:-0}" = 1 ]; then
    say "keeping the namespaces, the node, the cluster objects of $RELEASE and $WORK (GPUBUDGET_E2E_KEEP=1)"
  else
    kubectl delete namespace "$NS" "$NS_T" --wait=false --ignore-not-found >/dev/null 2>&1 || true
    kubectl delete node "$NODE" --ignore-not-found >/dev/null 2>&1 || true
    delete_release_objects "$RELEASE" mutatingwebhookconfiguration,validatingwebhookconfiguration,validatingadmissionpolicy,validatingadmissionpolicybinding,clusterrole,clusterrolebinding
    rm -rf "$WORK"
  fi
  if [ "$STARTED_REALK8S" = 1 ]; then bash "$REALK8S/down.sh" >/dev/null 2>&1 || true; fi
  exit "$rc"
}
trap cleanup EXIT

say "control plane, CRDs, the chart (RBAC, admission policies, caps and eviction webhooks in URL mode), one node"
kubectl version 2>/dev/null | sed 's/^/    /'
info "helm: $("$HELM" version --short)  binaries: $BIN  run id: $ID  work: $WORK"
info "on: a real kube-apiserver $(kubectl version -o json 2>/dev/null | jq -r .serverVersion.gitVersion) with etcd, no kubelet (pods bound by spec.nodeName, their status patched), GPU usage replayed from a sample file; this machine: $(nproc) cores, $(uname -sr)"
for ns in "$NS" "$NS_T"; do kubectl create namespace "$ns" >/dev/null; done
webhook_cert "$WORK/tls"
apply_crd_and_chart "$RELEASE" "$NS" "ServiceAccount ClusterRole ClusterRoleBinding Role RoleBinding ValidatingAdmissionPolicy \
ValidatingAdmissionPolicyBinding MutatingWebhookConfiguration ValidatingWebhookConfiguration" "$WEBHOOK" "$WORK/tls/ca.crt"
kubectl get mutatingwebhookconfiguration,validatingwebhookconfiguration -o json \
  | jq -r --arg r "$RELEASE" '.items[] | select(.metadata.name | startswith($r)) | .kind + "/" + .metadata.name + ": " + ([.webhooks[] | .clientConfig.url] | join(", "))' \
  | sed 's/^/    /'
for ns in "$NS" "$NS_T"; do wait_for "ServiceAccount default in $ns" kubectl get serviceaccount default -n "$ns"; done
# The Node as an API object, without the extended resources of its pods (nvidia.com/gpu, nvidia.com/gpumem): the
# API server admits pods bound by spec.nodeName without looking at the Node's capacity (the kubelet would).
kubectl create -f - >/dev/null <<EOF
apiVersion: v1
kind: Node
metadata: {name: $NODE, labels: {nvidia.com/gpu.present: "true", e2e.gpubudget.io/run: "$ID"}}
EOF
kubectl patch node "$NODE" --subresource=status --type=merge \
  -p '{"status":{"conditions":[{"type":"Ready","status":"True","reason":"KubeletReady","message":"played by the e2e test"}]}}' >/dev/null

kubectl create serviceaccount tenant -n "$NS_T" >/dev/null
kubectl create rolebinding tenant-edit -n "$NS_T" --clusterrole=edit --serviceaccount="$NS_T:tenant" >/dev/null
token_kubeconfig "$WORK/tenant.kubeconfig" tenant "$(kubectl create token tenant -n "$NS_T" --duration=2h)"
token_kubeconfig "$WORK/operator.kubeconfig" operator "$(kubectl create token "$RELEASE-operator" -n "$NS" --duration=2h)"
token_kubeconfig "$WORK/agent.kubeconfig" agent \
  "$(kubectl create token "$RELEASE-agent" -n "$NS" --duration=2h --bound-object-kind Node --bound-object-name "$NODE")"
tenant() { KUBECONFIG=$WORK/tenant.kubeconfig kubectl -n "$NS_T" "$@"; }

declare -A PID_OF
NEXT_PID=4400
mkdir -p "$WORK/proc"
# running POD: the kubelet's part for a pod the tenant created: status Running, its process in the fixture /proc.
running() {
  pod_running "$NS_T" "$1"
  NEXT_PID=$((NEXT_PID + 1))
  fake_process "$WORK/proc" "$NEXT_PID" "$NS_T" "$1"
  PID_OF[$1]=$NEXT_PID
}
# sample [POD=BYTES]...: what NVML reports, written atomically: one 80 GiB GPU, the pods' processes (no device
# used bytes: no pressure signal).
sample() {
  local procs="" kv
  for kv in "$@"; do procs+="${procs:+, }{\"pid\": ${PID_OF[${kv%%=*}]}, \"used_bytes\": ${kv#*=}}"; done
  cat > "$WORK/sample.tmp" <<EOF
{"version": 1, "gpus": [{"index": 0, "uuid": "GPU-e2e00000-0000-0000-0000-000000000044", "name": "replayed e2e GPU",
 "memory_total_bytes": $((80 * GI)), "processes": [$procs]}]}
EOF
  mv "$WORK/sample.tmp" "$WORK/sample.json"
}
# kubelet POD: an evicted pod's process exits and the pod goes.
kubelet() {
  rm -rf "${WORK:?}/proc/${PID_OF[$1]}"
  kubectl delete pod "$1" -n "$NS_T" --grace-period=0 --force >/dev/null 2>&1
}
sample

# kai_pod NAME FRACTION: a pod as KAI-Scheduler's webhook and binder leave it (common/tests/fixtures/shares/
# kai-fraction.yaml: the annotation, schedulerName kai-scheduler, env from the "-0" ConfigMap the binder fills,
# envFrom the empty "-evar" one, the volume, no GPU resource), created unbound and bound to the node by a Binding
# (#51); the ConfigMaps first.
kai_pod() {
  local cm=$1-x7k2mqz-shared-gpu
  tenant create -f - >/dev/null <<EOF
apiVersion: v1
kind: ConfigMap
metadata: {name: $cm-0}
data: {NVIDIA_VISIBLE_DEVICES: GPU-e2e00000-0000-0000-0000-000000000044, GPU_PORTION: "$2", RUNAI_NUM_OF_GPUS: "$2"}
---
apiVersion: v1
kind: ConfigMap
metadata: {name: $cm-0-evar}
---
apiVersion: v1
kind: Pod
metadata:
  name: $1
  labels: {e2e.gpubudget.io/run: "$ID", kai.scheduler/queue: default-queue, runai-gpu-group: 3c6e0b8a-1f2d-4c5e-8a9b-0d1e2f3a4b5c}
  annotations: {gpu-fraction: "$2", pod-group-name: pg-$1, runai/shared-gpu-configmap: $cm, received-resource-type: Fraction}
spec:
  schedulerName: kai-scheduler
  containers:
  - name: main
    image: nvidia/cuda:12.4.1-base-ubuntu22.04
    command: ["sleep", "infinity"]
    env:
    - {name: NVIDIA_VISIBLE_DEVICES, valueFrom: {configMapKeyRef: {name: $cm-0, key: NVIDIA_VISIBLE_DEVICES}}}
    - {name: RUNAI_NUM_OF_GPUS, valueFrom: {configMapKeyRef: {name: $cm-0, key: RUNAI_NUM_OF_GPUS}}}
    - {name: GPU_PORTION, valueFrom: {configMapKeyRef: {name: $cm-0, key: GPU_PORTION}}}
    envFrom: [{configMapRef: {name: $cm-0-evar, optional: false}}]
    resources: {}
  volumes: [{name: $cm-0-vol, configMap: {name: $cm-0}}]
EOF
  # Bound as KAI's binder binds it (a Binding; #51: the chart refuses a KAI pod created already bound with a share).
  printf '{"apiVersion":"v1","kind":"Binding","metadata":{"name":"%s","namespace":"%s"},"target":{"apiVersion":"v1","kind":"Node","name":"%s"}}' \
    "$1" "$NS_T" "$NODE" | kubectl create --raw "/api/v1/namespaces/$NS_T/pods/$1/binding" -f - >/dev/null
  running "$1"
}
# gpu_pod NAME RESOURCES [SCHEDULER ANNOTATIONS]: a pod with one container "main" whose limits are RESOURCES (flow
# map), bound to the node.
gpu_pod() {
  local annotations=${4:-"{}"}
  tenant create -f - >/dev/null <<EOF
apiVersion: v1
kind: Pod
metadata:
  name: $1
  labels: {e2e.gpubudget.io/run: "$ID"}
  annotations: $annotations
spec:
  schedulerName: ${3:-default-scheduler}
  nodeName: $NODE
  containers:
  - name: main
    image: nvidia/cuda:12.4.1-base-ubuntu22.04
    command: ["sleep", "infinity"]
    resources: {limits: $2}
EOF
  running "$1"
}
# env_of POD: the container's env as NAME=VALUE lines (valueFrom: NAME<-configMapKeyRef NAME/KEY).
env_of() {
  kubectl get pod "$1" -n "$NS_T" -o json | jq -r '.spec.containers[0].env // [] | .[]
    | if .valueFrom then "\(.name)<-configMapKeyRef \(.valueFrom.configMapKeyRef.name)/\(.valueFrom.configMapKeyRef.key)" else "\(.name)=\(.value)" end'
}
env_is() { env_of "$1" | grep -qx "$2"; }
caps_record() { kubectl get pod "$1" -n "$NS_T" -o jsonpath='{.metadata.annotations.gpubudget\.io/caps}'; }
share_of() { annotation "$NS_T" "$1" share; }
# held POD LIMIT_BYTES NOTE: the pod's gpubudget.io/share says that limit and note.
held() { share_of "$1" | jq -e --argjson l "$2" --arg n "$3" '.limitBytes == $l and .note == $n' >/dev/null; }
budget_is() { annotation_is "$NS_T" "$1" budget "$2"; }
at() { date -u +%H:%M:%S; }
show_gmb() { kubectl get gmb -n "$NS_T" -o wide | sed 's/^/    /'; }
show_status() { # BUDGET
  kubectl get gmb "$1" -n "$NS_T" -o json | jq -c '.status | {matchedPods, podsOverBudget, podsCapped, podsUncapped,
    podsOnShare, podsShareUnresolved, share, evictions}' | sed "s/^/    status of $1: /"
}
# share_status BUDGET SHARE ON_SHARE UNRESOLVED MATCHED: the budget's status says so.
share_status() {
  [ "$(kubectl get gmb "$1" -n "$NS_T" -o jsonpath='{.status.share}|{.status.podsOnShare}|{.status.podsShareUnresolved}|{.status.matchedPods}')" = "$2|$3|$4|$5" ]
}
labelled() { [ "$(kubectl get namespace "$NS_T" -o jsonpath='{.metadata.labels.gpubudget\.io/admission-caps}')" = enabled ]; }
epoch() { date -d "$1" +%s.%N; }
# evicted POD OVER_EVENT_TIME: waits for the pod's eviction; checks it came overLimitSeconds (10) after the Over event
# (the API server's deletionTimestamp less the grace, whole seconds); prints the figures; plays the kubelet.
evicted() {
  wait_for "$1 terminating" terminating "$NS_T" "$1"
  local deletion grace after
  deletion=$(kubectl get pod "$1" -n "$NS_T" -o jsonpath='{.metadata.deletionTimestamp}')
  grace=$(kubectl get pod "$1" -n "$NS_T" -o jsonpath='{.metadata.deletionGracePeriodSeconds}')
  after=$(( $(date -d "$deletion" +%s) - grace - $(date -d "$2" +%s) ))
  [ "$after" -ge 9 ] || die "$1 was evicted ${after}s after its Over event, before overLimitSeconds (10 s)"
  wait_for "EvictingForGpuMemory on $1" has_event "$NS_T" "$1" EvictingForGpuMemory
  info "$1 evicted ${after}s after its Over event (deletionTimestamp $deletion less grace ${grace}s), at $(at)"
  info "EvictingForGpuMemory: $(event_messages "$NS_T" "$1" EvictingForGpuMemory | head -n1)"
  SUMMARY+=("$1: evicted ${after}s after its Over event (whole seconds), grace ${grace}s")
  kubelet "$1"
}

say "the release binaries, out of cluster: the operator (webhooks on $WEBHOOK) and the agent (bound to $NODE)"
KUBECONFIG=$WORK/operator.kubeconfig POD_NAMESPACE=$NS POD_NAME=operator-e2e RUST_LOG=info \
  "$BIN/gpubudget-operator" run --admin-addr "$OPERATOR_ADMIN" --webhook-addr "$WEBHOOK" \
  --webhook-cert-dir "$WORK/tls" --mirrors-lease-name "$LEASE" > "$WORK/operator.log" 2>&1 &
OPERATOR_PID=$!
wait_for "operator ready (pid $OPERATOR_PID)" ready "$OPERATOR_ADMIN"
KUBECONFIG=$WORK/agent.kubeconfig RUST_LOG=info "$BIN/gpubudget-agent" run --node-name "$NODE" \
  --proc-root "$WORK/proc" --sample-file "$WORK/sample.json" --interval 250ms --admin-addr "$AGENT_ADMIN" \
  --mirrors-lease "$NS/$LEASE" > "$WORK/agent.log" 2>&1 &
AGENT_PID=$!
AGENT_STARTED=$(date +%s.%N)
wait_for "agent ready (pid $AGENT_PID, started at $(at))" ready "$AGENT_ADMIN"

say "1. the budget: {selector: {}, limit: 80Gi, share: {}, admissionCaps: Enabled, overLimitSeconds: 10}"
kubectl apply -f - <<EOF | sed 's/^/    /'
apiVersion: gpubudget.io/v1alpha1
kind: GpuMemoryBudget
metadata: {name: shares, namespace: $NS_T}
spec: {selector: {}, limit: 80Gi, share: {}, admissionCaps: Enabled, overLimitSeconds: 10}
EOF
wait_for "$NS_T labelled gpubudget.io/admission-caps=enabled by the operator" labelled

say "2. the tenant's pods, shaped as the tools leave them, bound to $NODE"
kai_pod kai-half 0.5
kai_pod kai-quarter 0.25
gpu_pod hami '{nvidia.com/gpu: "1", nvidia.com/gpumem: "10240"}' hami-scheduler \
  "{hami.io/vgpu-node: $NODE, hami.io/vgpu-devices-allocated: \"GPU-e2e00000-0000-0000-0000-000000000044,NVIDIA,10240,0:;\", hami.io/bind-phase: success}"
kai_pod kai-nan NaN
kubectl get pods -n "$NS_T" -o custom-columns='NAME:.metadata.name,SCHEDULER:.spec.schedulerName,NODE:.spec.nodeName,PHASE:.status.phase,LIMITS:.spec.containers[0].resources.limits,FRACTION:.metadata.annotations.gpu-fraction' \
  | sed 's/^/    /'
info "the Node advertises no nvidia.com/gpu nor nvidia.com/gpumem: capacity $(kubectl get node "$NODE" -o jsonpath='{.status.capacity}')"

say "3. caps at admission: hami's absolute share is its cap; the KAI pods' fraction, capped at the limit, uncapped where their devices come from a ConfigMap"
env_of hami | sed 's/^/    hami env: /'
env_is hami "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=10240M" || die "hami has no CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=10240M"
env_is hami "NVIDIA_GPU_MEMORY_LIMIT=10240" || die "hami has no NVIDIA_GPU_MEMORY_LIMIT=10240"
info "hami caps record: $(caps_record hami)"
caps_record hami | jq -e '.budget == "shares" and .limitMib == 10240 and ([.containers[] | select(.uncapped)] | length) == 0' >/dev/null \
  || die "hami's caps record: $(caps_record hami)"
for pod in kai-half kai-quarter kai-nan; do
  env_of "$pod" | sed "s/^/    $pod env: /"
  env_is "$pod" "NVIDIA_GPU_MEMORY_LIMIT=81920" || die "$pod is not capped at the budget's limit (NVIDIA_GPU_MEMORY_LIMIT=81920)"
  env_of "$pod" | grep -q '^CUDA_MPS_PINNED_DEVICE_MEM_LIMIT' && die "$pod got an MPS cap though its devices are not in the pod"
  info "$pod caps record: $(caps_record "$pod")"
  caps_record "$pod" | jq -e '.limitMib == 81920 and (.containers[0].uncapped | test("valueFrom"))' >/dev/null \
    || die "$pod's caps record does not say it is uncapped because of valueFrom: $(caps_record "$pod")"
done
info "ok: hami capped at its 10240 MiB share; the KAI pods NVIDIA_GPU_MEMORY_LIMIT=81920 (the limit), no MPS cap, recorded uncapped with the reason"

say "4. usage replayed (GPU of 80Gi): kai-half 30Gi, kai-quarter 15Gi, hami 8Gi, kai-nan 5Gi: the shares recorded"
sample kai-half=$((30 * GI)) kai-quarter=$((15 * GI)) hami=$((8 * GI)) kai-nan=$((5 * GI))
wait_for "kai-half held to 40Gi (KAI gpu-fraction 0.5 of 80Gi = 40Gi)" held kai-half $((40 * GI)) "KAI gpu-fraction 0.5 of 80Gi = 40Gi"
wait_for "kai-quarter held to 20Gi (KAI gpu-fraction 0.25 of 80Gi = 20Gi)" held kai-quarter $((20 * GI)) "KAI gpu-fraction 0.25 of 80Gi = 20Gi"
wait_for "hami held to 10Gi (HAMi gpumem 10240 MiB = 10Gi)" held hami $((10 * GI)) "HAMi gpumem 10240 MiB = 10Gi"
wait_for "kai-nan recorded" bash -c "kubectl get pod kai-nan -n $NS_T -o jsonpath='{.metadata.annotations.gpubudget\.io/share}' | grep -q ."
for pod in kai-half kai-quarter hami kai-nan; do
  info "$pod: state $(annotation "$NS_T" "$pod" state), budget $(annotation "$NS_T" "$pod" budget), gpubudget.io/share $(share_of "$pod")"
  budget_is "$pod" shares || die "$pod is recorded under $(annotation "$NS_T" "$pod" budget), not shares"
done
share_of kai-nan | jq -e --argjson l $((80 * GI)) '.limitBytes == $l and (.sources // [] | length) == 0
  and (.note | startswith("share unresolved:") and endswith("held to the budget'"'"'s limit 80Gi"))' >/dev/null \
  || die "kai-nan's share record: $(share_of kai-nan)"
wait_for "GpuMemoryShareUnresolved on kai-nan" has_event "$NS_T" kai-nan GpuMemoryShareUnresolved
info "kai-nan: $(events "$NS_T" kai-nan GpuMemoryShareUnresolved | jq -r '.[0] | "\(.type) \(.reason) (\(.reportingController) on \(.reportingInstance)): \(.note)"')"
[ "$(events "$NS_T" kai-nan GpuMemoryShareUnresolved | jq -r '.[0].type')" = Warning ] || die "GpuMemoryShareUnresolved is not a Warning"
wait_for "status of shares: SHARE 'KAI gpu-fraction 2, HAMi gpumem 1, unresolved 1', podsOnShare 3, podsShareUnresolved 1, MATCHED 4" \
  share_status shares "KAI gpu-fraction 2, HAMi gpumem 1, unresolved 1" 3 1 4
wait_for "status of shares: CAPPED 1 (hami), UNCAPPED 3 (the KAI pods)" bash -c \
  "[ \"\$(kubectl get gmb shares -n $NS_T -o jsonpath='{.status.podsCapped}/{.status.podsUncapped}')\" = 1/3 ]"
show_gmb
show_status shares

say "5. kai-half to 44Gi (over its 40Gi share, within the 80Gi limit), hami to 12Gi (over its 10Gi); kai-quarter stays at 15Gi of 20Gi"
OVER_SAMPLE=$(date +%s.%N)
info "sample written at $(at)"
sample kai-half=$((44 * GI)) kai-quarter=$((15 * GI)) hami=$((12 * GI)) kai-nan=$((5 * GI))
T_HALF=$(timed "GpuMemoryOverBudget on kai-half" "$OVER_SAMPLE" has_event "$NS_T" kai-half GpuMemoryOverBudget)
T_HAMI=$(timed "GpuMemoryOverBudget on hami" "$OVER_SAMPLE" has_event "$NS_T" hami GpuMemoryOverBudget)
MSG=$(event_messages "$NS_T" kai-half GpuMemoryOverBudget | tail -n1)
info "kai-half: $MSG"
[[ "$MSG" == *"KAI gpu-fraction 0.5 of 80Gi = 40Gi"* ]] || die "kai-half's Over message does not name its share: $MSG"
MSG=$(event_messages "$NS_T" hami GpuMemoryOverBudget | tail -n1)
info "hami: $MSG"
[[ "$MSG" == *"HAMi gpumem 10240 MiB = 10Gi"* ]] || die "hami's Over message does not name its share: $MSG"
SUMMARY+=("Over events after the sample: kai-half ${T_HALF}s, hami ${T_HAMI}s (first poll that saw them)")
wait_for "status of shares: OVER 2" status_is "$NS_T" shares podsOverBudget 2
# hami holds 12Gi under an MPS cap of 10240 MiB: the agent tells that cap not in force (#32), and status counts the
# pod uncapped from then on.
wait_for "GpuMemoryCapNotInForce on hami" has_event "$NS_T" hami GpuMemoryCapNotInForce
info "hami: gpubudget.io/cap-not-in-force $(annotation "$NS_T" hami cap-not-in-force)"
info "hami: GpuMemoryCapNotInForce: $(event_messages "$NS_T" hami GpuMemoryCapNotInForce | head -n1)"
wait_for "status of shares: CAPPED 0, UNCAPPED 4 (hami's cap not in force)" bash -c \
  "[ \"\$(kubectl get gmb shares -n $NS_T -o jsonpath='{.status.podsCapped}/{.status.podsUncapped}')\" = 0/4 ]"
show_gmb
evicted kai-half "$(events "$NS_T" kai-half GpuMemoryOverBudget | jq -r '.[0].eventTime')"
evicted hami "$(events "$NS_T" hami GpuMemoryOverBudget | jq -r '.[0].eventTime')"
sample kai-quarter=$((15 * GI)) kai-nan=$((5 * GI))
for reason in GpuMemoryNearBudget GpuMemoryOverBudget; do
  has_event "$NS_T" kai-quarter "$reason" && die "kai-quarter (15Gi of its 20Gi share) got $reason"
done
terminating "$NS_T" kai-quarter && die "kai-quarter is being deleted"
annotation_is "$NS_T" kai-quarter state Within || die "kai-quarter's state: $(annotation "$NS_T" kai-quarter state)"
info "ok: kai-quarter Within at 15Gi of its 20Gi share, no event, not deleted"
wait_for "status of shares: EVICTED 2" status_is "$NS_T" shares evictions 2
wait_for "status of shares: SHARE 'KAI gpu-fraction 1, unresolved 1' once the evicted pods are gone" \
  share_status shares "KAI gpu-fraction 1, unresolved 1" 1 1 2
show_gmb

say "6. a plain budget {selector: {}, limit: 30Gi}: the smallest limit wins, with each pod's share as its limit"
kubectl apply -f - <<EOF | sed 's/^/    /'
apiVersion: gpubudget.io/v1alpha1
kind: GpuMemoryBudget
metadata: {name: plain, namespace: $NS_T}
spec: {selector: {}, limit: 30Gi}
EOF
PLAIN_AT=$(date +%s.%N)
T_PLAIN=$(timed "kai-nan (unresolved: held to 80Gi) recorded under plain (30Gi)" "$PLAIN_AT" budget_is kai-nan plain)
SUMMARY+=("plain budget created → kai-nan recorded under it: ${T_PLAIN}s")
budget_is kai-quarter shares || die "kai-quarter is recorded under $(annotation "$NS_T" kai-quarter budget), not shares (20Gi < 30Gi)"
held kai-quarter $((20 * GI)) "KAI gpu-fraction 0.25 of 80Gi = 20Gi" || die "kai-quarter's share record: $(share_of kai-quarter)"
info "kai-quarter: budget shares, gpubudget.io/share $(share_of kai-quarter)"
info "kai-nan: budget plain, gpubudget.io/share '$(share_of kai-nan)'"
wait_for "status of shares: SHARE 'KAI gpu-fraction 1', podsOnShare 1, podsShareUnresolved 0, MATCHED 1" \
  share_status shares "KAI gpu-fraction 1" 1 0 1
wait_for "status of plain: MATCHED 1 (kai-nan)" status_is "$NS_T" plain matchedPods 1
[ -z "$(status_field "$NS_T" plain share)" ] || die "the plain budget has a share status: $(status_field "$NS_T" plain share)"
show_gmb
show_status shares
show_status plain
for b in shares plain; do
  info "$b: Overlapping=$(kubectl get gmb "$b" -n "$NS_T" -o jsonpath='{.status.conditions[?(@.type=="Overlapping")].status}'): $(kubectl get gmb "$b" -n "$NS_T" -o jsonpath='{.status.conditions[?(@.type=="Overlapping")].message}' | cut -c1-220)"
done
[ "$(event_occurrences "$NS_T" kai-nan GpuMemoryShareUnresolved)" = 1 ] \
  || die "GpuMemoryShareUnresolved on kai-nan: $(event_occurrences "$NS_T" kai-nan GpuMemoryShareUnresolved) occurrences, not 1"
info "ok: GpuMemoryShareUnresolved on kai-nan told once (series included)"
# usage_is POD BYTES: the node's GpuNodeUsage (written at most every 30 s, #34) lists the pod at BYTES.
usage_is() {
  [ "$(kubectl get gpunodeusage "$NODE" -o json | jq -r --arg p "$1" '.spec.pods[] | select(.name == $p) | .usageBytes')" = "$2" ]
}
wait_for "GpuNodeUsage $NODE lists kai-quarter at 15Gi (what top and why read for usage)" usage_is kai-quarter $((15 * GI))
echo "    \$ kubectl gpubudget why kai-quarter -n $NS_T"
kubectl gpubudget why kai-quarter -n "$NS_T" > "$WORK/why.txt"
sed 's/^/    | /' "$WORK/why.txt"
grep -q '^ *Share: .*KAI gpu-fraction 0.25 of 80Gi = 20Gi' "$WORK/why.txt" || die "why has no Share: line naming kai-quarter's share"
grep -Eq '^ *Budget: .*shares' "$WORK/why.txt" || die "why does not name the budget shares"
echo "    \$ kubectl gpubudget top -n $NS_T"
kubectl gpubudget top -n "$NS_T" > "$WORK/top.txt"
sed 's/^/    | /' "$WORK/top.txt"
grep -Ew 'kai-quarter' "$WORK/top.txt" | grep -qw '20Gi' || die "top does not show kai-quarter's own limit 20Gi"

say "7. MPS: the Node labelled as GPU feature discovery labels it (sharing-strategy mps, 4 replicas); a pod asking nvidia.com/gpu: 1 at 22Gi"
gpu_pod mps '{nvidia.com/gpu: "1"}'
info "mps at admission: env [$(env_of mps | tr '\n' ' ')], caps record '$(caps_record mps)' (plain, 30Gi, applies there: a replica's share needs the node's labels, which the webhook does not read)"
sample kai-quarter=$((15 * GI)) kai-nan=$((5 * GI)) mps=$((22 * GI))
wait_for "mps recorded Within under plain (30Gi) while the node shares nothing" bash -c \
  "[ \"\$(kubectl get pod mps -n $NS_T -o jsonpath='{.metadata.annotations.gpubudget\.io/state}/{.metadata.annotations.gpubudget\.io/budget}')\" = Within/plain ]"
kubectl label node "$NODE" nvidia.com/gpu.sharing-strategy=mps nvidia.com/gpu.replicas=4 nvidia.com/gpu.count=1 \
  nvidia.com/mps.capable=true nvidia.com/gpu.product=NVIDIA-H100-80GB-HBM3-SHARED >/dev/null
LABELLED=$(date +%s.%N)
kubectl patch node "$NODE" --subresource=status --type=merge \
  -p '{"status":{"capacity":{"nvidia.com/gpu":"4"},"allocatable":{"nvidia.com/gpu":"4"}}}' >/dev/null
PHASE=$(awk -v l="$LABELLED" -v s="$AGENT_STARTED" 'BEGIN {printf "%.1f", (l - s) - 60 * int((l - s) / 60)}')
info "labelled at $(at), $(since "$AGENT_STARTED")s after the agent started (the agent reads its Node every 60 s from its start: ${PHASE}s into a period)"
T_MPS=$(STEP_TIMEOUT=90 timed "GpuMemoryOverBudget on mps (22Gi of its 20Gi replica)" "$LABELLED" has_event "$NS_T" mps GpuMemoryOverBudget)
MPS_EVENT=$(events "$NS_T" mps GpuMemoryOverBudget | jq -r '.[0].eventTime')
T_MPS_EVENT=$(awk -v a="$(epoch "$MPS_EVENT")" -v b="$LABELLED" 'BEGIN {printf "%.1f", a - b}')
MSG=$(event_messages "$NS_T" mps GpuMemoryOverBudget | tail -n1)
info "mps: $MSG"
[[ "$MSG" == *"MPS replica of 4 per GPU of 80Gi = 20Gi"* ]] || die "mps's Over message does not name its replica's share: $MSG"
budget_is mps shares || die "mps is recorded under $(annotation "$NS_T" mps budget), not shares"
info "mps: gpubudget.io/share $(share_of mps)"
wait_for "status of shares: SHARE 'KAI gpu-fraction 1, MPS replicas 1', podsOnShare 2, MATCHED 2" \
  share_status shares "KAI gpu-fraction 1, MPS replicas 1" 2 0 2
show_gmb
kill -0 "$AGENT_PID" && [ "$(grep -c "agent running" "$WORK/agent.log")" = 1 ] || die "the agent was restarted"
info "ok: the agent (pid $AGENT_PID) was not restarted; its reads of the Node's sharing labels that changed something:"
grep "the Node's GPU sharing labels" "$WORK/agent.log" | sed 's/\x1b\[[0-9;]*m//g' | cut -c1-220 | sed 's/^/    agent: /'
SUMMARY+=("MPS: label → Over event ${T_MPS_EVENT}s (its eventTime), ${T_MPS}s (first poll); the label came ${PHASE}s into the agent's 60 s period")
evicted mps "$MPS_EVENT"
sample kai-quarter=$((15 * GI)) kai-nan=$((5 * GI))
wait_for "status of shares: EVICTED 3" status_is "$NS_T" shares evictions 3
show_gmb
[ "$(event_occurrences "$NS_T" kai-nan GpuMemoryShareUnresolved)" = 1 ] || die "GpuMemoryShareUnresolved on kai-nan repeated"
kubectl label node "$NODE" nvidia.com/gpu.sharing-strategy- nvidia.com/gpu.replicas- >/dev/null

say "summary"
for line in "${SUMMARY[@]}"; do info "$line"; done
FAILED=0
say "PASS ($((SECONDS - START)) s)"
