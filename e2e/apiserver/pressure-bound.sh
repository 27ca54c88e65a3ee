#!/usr/bin/env bash
# The pressure bound (issue 43, item 1) against a real kube-apiserver, no kubelet: one agent (token bound to its
# Node) with the chart's RBAC and admission policies, `--namespaced-budgets ClusterBound
# --pressure-blocked-timeout 20s`, a PodDisruptionBudget (`maxUnavailable: 0`) on each pressured pod, and the API
# server's own disruption controller and Eviction API.
#
#   GPUBUDGET_E2E_APISERVER=1 KUBECONFIG=/tmp/realk8s/run/kubeconfig e2e/apiserver/pressure-bound.sh [OUT]
#   GPUBUDGET_E2E_APISERVER=1 REALK8S_DIR=/tmp/realk8s e2e/apiserver/pressure-bound.sh [OUT]   # starts it, stops it
#
# The stories, one after the other on one replayed 80 GiB GPU (1 GiB free: under the default 5 % hard threshold),
# each beside the neighbour nb (1 GiB of the administrator's 70Gi cluster budget: owed 69 GiB, so harmed; since
# issue 52 a pod alone on its GPU is never relieved):
# a. a namespaced budget (tenant-written under ClusterBound; only it selects the pod) with
#    `blockedEvictionTimeoutSeconds: 86400`, the pod at 79 GiB: deleted with the pressure grace (5 s) after the
#    node's 20 s bound, never before, the event naming "the node's pressure blocked timeout" (before issue 43 the
#    budget's 86400 s was the bound);
# b. the same budget without the field: the baseline, ~20 s;
# c. an administrator's ClusterGpuMemoryBudget, limit 70Gi, no optional field, the pod at 79 GiB from the start:
#    over its budget and most over it under pressure; its evictions refused by the PodDisruptionBudget; deleted
#    after the node's bound;
# d. the same cluster budget, the pod first at 75 GiB (5 GiB free, no pressure): over its budget for its
#    overLimitSeconds (10 s), its budget's eviction refused (GpuMemoryEvictionBlocked); then 79 GiB: a pod whose
#    eviction by its budget a PodDisruptionBudget refuses is still a pressure candidate (before issue 43 it was
#    skipped, and never deleted while the card had 1 GiB free), deleted ~20 s after the pressure began.
# For each: the time from the pressure's start (the sample written) to the deletion (the API server's
# deletionTimestamp less the grace, and the first poll that saw it), the grace, the events' texts. The test plays
# the kubelet (pod status, /proc, the deleted pod's processes exit and the pod goes) and NVML (a sample file).
# OUT (optional) receives a copy of the output.
#
# Environment: as e2e/lib.sh says (GPUBUDGET_E2E_BIN, HELM, GPUBUDGET_E2E_STEP_TIMEOUT, GPUBUDGET_E2E_KEEP, REALK8S).
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
REPO=$(cd "$HERE/../.." && pwd)
REALK8S=${REALK8S:-/work/shared/realk8s}
if [ -n "${1:-}" ] && [ -z "${PRESSURE_BOUND_TEE:-}" ]; then
  PRESSURE_BOUND_TEE=1 exec > >(tee "$1") 2>&1
fi

# shellcheck source=../lib.sh
. "$REPO/e2e/lib.sh"
control_plane_or_skip "the pressure bound" gpubudget-agent
STEP_TIMEOUT=${GPUBUDGET_E2E_STEP_TIMEOUT:-60}
POLL=0.5
GI=1073741824
BOUND=20                            # --pressure-blocked-timeout

ID=$(date +%s | tail -c 5)$RANDOM
ID=${ID:0:7}
NS=gpubudget-pb-$ID                 # the release's namespace (its ServiceAccounts)
NS_T=gpubudget-pb-$ID-t             # stories a, b: namespaced budgets
NS_C=gpubudget-pb-$ID-c             # stories c, d: the administrator's cluster budget
NODE=gpubudget-pb-$ID-n1
RELEASE=gpubudget-pb-$ID
WORK=$(mktemp -d "${TMPDIR:-/tmp}/gpubudget-pressure-bound.XXXXXX")
ADMIN=127.0.0.1:$((20000 + RANDOM % 20000))
PIDS=()
FAILED=1
START=$SECONDS
SUMMARY=()

cleanup() {
  local rc=$?
  if [ "$FAILED" != 0 ]; then
    say "diagnostics"
    kubectl get pods -A -l "e2e.gpubudget.io/run=$ID" -o wide || true
    kubectl get pdb -A -l "e2e.gpubudget.io/run=$ID" || true
    kubectl get events.v1.events.k8s.io -n "$NS_T" -o json 2>/dev/null | jq -r '.items[] | "\(.regarding.name) \(.reason) \(.note)"' | cut -c1-300 || true
    kubectl get events.v1.events.k8s.io -n "$NS_C" -o json 2>/dev/null | jq -r '.items[] | "\(.regarding.name) \(.reason) \(.note)"' | cut -c1-300 || true
    echo "--- agent log (last 80 lines)"; tail -n 80 "$WORK/agent.log" 2>/dev/null || true
  fi
  for pid in "${PIDS[@]}"; do stop_process "$pid"; done
  if [ "${GPUBUDGET_E2E_KEEP:-0}" = 1 ]; then
    say "keeping the namespaces, the node, the cluster budget and $WORK (GPUBUDGET_E2E_KEEP=1)"
  else
    kubectl delete cgmb "$RELEASE-admin" --ignore-not-found >/dev/null 2>&1 || true
    kubectl delete namespace "$NS" "$NS_T" "$NS_C" --wait=false --ignore-not-found >/dev/null 2>&1 || true
    kubectl delete node "$NODE" --ignore-not-found >/dev/null 2>&1 || true
    delete_release_objects "$RELEASE"
    rm -rf "$WORK"
  fi
  if [ "$STARTED_REALK8S" = 1 ]; then bash "$REALK8S/down.sh" >/dev/null 2>&1 || true; fi
  exit "$rc"
}
trap cleanup EXIT

say "control plane, CRDs, the chart's RBAC and admission policies, one node"
kubectl version 2>/dev/null | sed 's/^/    /'
info "helm: $("$HELM" version --short)  binaries: $BIN  run id: $ID  work: $WORK"
for ns in "$NS" "$NS_T" "$NS_C"; do kubectl create namespace "$ns" >/dev/null; done
kubectl label namespace "$NS_C" "e2e.gpubudget.io/cluster-budgets=$ID" >/dev/null
apply_crd_and_chart "$RELEASE" "$NS" "ServiceAccount ClusterRole ClusterRoleBinding Role RoleBinding ValidatingAdmissionPolicy ValidatingAdmissionPolicyBinding"
for ns in "$NS" "$NS_T" "$NS_C"; do wait_for "ServiceAccount default in $ns" kubectl get serviceaccount default -n "$ns"; done
kubectl create -f - >/dev/null <<EOF
apiVersion: v1
kind: Node
metadata: {name: $NODE, labels: {nvidia.com/gpu.present: "true", e2e.gpubudget.io/run: "$ID"}}
EOF

# make_pod NAMESPACE NAME: a running pod on the node (the test is its kubelet), labelled app=NAME, with a
# PodDisruptionBudget that never allows its eviction.
make_pod() {
  kubectl create -f - >/dev/null <<EOF
apiVersion: v1
kind: Pod
metadata: {name: $2, namespace: $1, labels: {e2e.gpubudget.io/run: "$ID", app: $2}}
spec:
  nodeName: $NODE
  terminationGracePeriodSeconds: 60
  containers: [{name: main, image: registry.k8s.io/pause:3.10}]
---
apiVersion: policy/v1
kind: PodDisruptionBudget
metadata: {name: $2, namespace: $1, labels: {e2e.gpubudget.io/run: "$ID"}}
spec: {maxUnavailable: 0, selector: {matchLabels: {app: $2}}}
EOF
  pod_running "$1" "$2"
  wait_for "the PodDisruptionBudget of $1/$2 allows no disruption (1 healthy)" bash -c \
    "[ \"\$(kubectl get pdb $2 -n '$1' -o jsonpath='{.status.disruptionsAllowed}/{.status.currentHealthy}')\" = 0/1 ]"
}

declare -A PID_OF
NEXT_PID=7100
# sample [POD=BYTES]: the GPU's processes, written atomically as NVML would report them (80 GiB GPU, the
# device's used bytes the sum: the pressure signal).
sample() {
  local procs="" kv used=0
  for kv in "$@"; do
    procs+="${procs:+, }{\"pid\": ${PID_OF[${kv%%=*}]}, \"used_bytes\": ${kv#*=}}"
    used=$((used + ${kv#*=}))
  done
  cat > "$WORK/sample.tmp" <<EOF
{"version": 1, "gpus": [{"index": 0, "uuid": "GPU-e2e00000-0000-0000-0000-000000000043", "name": "replayed e2e GPU",
 "memory_total_bytes": 85899345920, "memory_used_bytes": $used, "processes": [$procs]}]}
EOF
  mv "$WORK/sample.tmp" "$WORK/sample.json"
}
# process NAMESPACE POD: the pod's process in the fixture /proc.
process() {
  NEXT_PID=$((NEXT_PID + 1))
  fake_process "$WORK/proc" "$NEXT_PID" "$1" "$2"
  PID_OF[$2]=$NEXT_PID
}
mkdir -p "$WORK/proc"
sample

say "the agent: --namespaced-budgets ClusterBound --pressure-blocked-timeout ${BOUND}s (pressure grace 5 s, hard threshold 5 %)"
token_kubeconfig "$WORK/agent.kubeconfig" agent \
  "$(kubectl create token "$RELEASE-agent" -n "$NS" --duration=1h --bound-object-kind Node --bound-object-name "$NODE")"
KUBECONFIG=$WORK/agent.kubeconfig RUST_LOG=info "$BIN/gpubudget-agent" run --node-name "$NODE" \
  --proc-root "$WORK/proc" --sample-file "$WORK/sample.json" --interval 250ms --admin-addr "$ADMIN" \
  --namespaced-budgets ClusterBound --pressure-blocked-timeout "${BOUND}s" > "$WORK/agent.log" 2>&1 &
PIDS+=($!)
wait_for "agent ready" ready "$ADMIN"

pressure_metric() { curl -fsS "http://$ADMIN/metrics" | awk '/^gpubudget_gpu_memory_pressure\{/ {print $2}'; }
no_pressure() { [ "$(pressure_metric)" = 0 ]; }
under_pressure() { [ "$(pressure_metric)" = 1 ]; }
recorded() { [ -n "$(annotation "$1" "$2" state)" ]; }

# watch_deletion STORY NAMESPACE POD PRESSED_AT(epoch, fractional): waits for the pod to be deleted; dies if that
# happens before the bound; prints and records the figures and the events.
watch_deletion() {
  local story=$1 ns=$2 pod=$3 pressed=$4 seen deleted grace api_at blocked
  local deadline=$((SECONDS + BOUND + 60))
  until terminating "$ns" "$pod"; do
    [ "$SECONDS" -lt "$deadline" ] || die "$ns/$pod not deleted $((BOUND + 60)) s after the pressure began"
    sleep 0.25
  done
  seen=$(date +%s.%N)
  deleted=$(kubectl get pod "$pod" -n "$ns" -o jsonpath='{.metadata.deletionTimestamp}')
  grace=$(kubectl get pod "$pod" -n "$ns" -o jsonpath='{.metadata.deletionGracePeriodSeconds}')
  api_at=$(( $(date -d "$deleted" +%s) - grace ))
  local after_seen after_api
  after_seen=$(awk -v a="$seen" -v b="$pressed" 'BEGIN {printf "%.1f", a - b}')
  after_api=$(awk -v a="$api_at" -v b="$pressed" 'BEGIN {printf "%.1f", a - b}')
  info "$ns/$pod terminating: seen ${after_seen}s after the pressure began; deleted by the API server at ${after_api}s (deletionTimestamp $deleted less grace ${grace}s; whole seconds)"
  awk -v s="$after_seen" -v b="$BOUND" 'BEGIN {exit !(s + 0 >= b - 1)}' \
    || die "$ns/$pod deleted ${after_seen}s after the pressure began, before the ${BOUND} s bound"
  [ "$grace" = 5 ] || die "$ns/$pod's grace is $grace, not the pressure grace 5"
  wait_for "DeletingForGpuMemory on $ns/$pod" has_event "$ns" "$pod" DeletingForGpuMemory
  blocked=$(event_occurrences "$ns" "$pod" GpuMemoryEvictionBlocked)
  local reason
  for reason in GpuMemoryOverBudget EvictingForGpuMemory GpuMemoryEvictionBlocked DeletingForGpuMemory; do
    event_messages "$ns" "$pod" "$reason" | head -n 2 | while IFS= read -r line; do info "$reason: $line"; done
  done
  local refused
  refused=$(grep "eviction blocked (HTTP 429)" "$WORK/agent.log" | grep -c "$ns/$pod" || true)
  info "GpuMemoryEvictionBlocked events (series counted): $blocked; refusals (HTTP 429) in the agent's log: $refused"
  grep "evictions refused too long: pod deleted" "$WORK/agent.log" | grep "$ns/$pod" | sed 's/\x1b\[[0-9;]*m//g' | cut -c1-240 | sed 's/^/    agent: /'
  SUMMARY+=("$story: deleted ${after_api}s (API, whole seconds) / ${after_seen}s (first seen) after the pressure began, grace $grace, $refused refusals (429) before it")
  DELETING=$(event_messages "$ns" "$pod" DeletingForGpuMemory | head -n1)
}

# kubelet NAMESPACE POD: the deleted pod's processes exit, the pod goes; then the GPU's pressure ends.
kubelet() {
  rm -rf "${WORK:?}/proc/${PID_OF[$2]}"
  sample nb=$GI
  kubectl delete pod "$2" -n "$1" --grace-period=0 --force >/dev/null 2>&1
  wait_for "the GPU's pressure ended (gpubudget_gpu_memory_pressure 0, after the 10 s transition)" no_pressure
}

# namespaced_story LETTER POD EXTRA_SPEC: a namespaced budget (limit 80Gi: the pod is within it) selecting only POD.
namespaced_story() {
  local letter=$1 pod=$2 extra=$3
  make_pod "$NS_T" "$pod"
  kubectl apply -f - <<EOF | sed 's/^/    /'
apiVersion: gpubudget.io/v1alpha1
kind: GpuMemoryBudget
metadata: {name: $pod, namespace: $NS_T}
spec: {selector: {matchLabels: {app: $pod}}, limit: 80Gi$extra}
EOF
  process "$NS_T" "$pod"
  sample "$pod=$((GI))" nb=$GI
  wait_for "$NS_T/$pod recorded (1 GiB, no pressure)" recorded "$NS_T" "$pod"
  info "spec: $(kubectl get gmb "$pod" -n "$NS_T" -o jsonpath='{.spec}')"
  PRESSED=$(date +%s.%N)
  sample "$pod=$((78 * GI))" nb=$GI
  wait_for "GpuMemoryEvictionBlocked on $NS_T/$pod (the PodDisruptionBudget refuses the pressure eviction)" \
    has_event "$NS_T" "$pod" GpuMemoryEvictionBlocked
  info "first refusal $(awk -v a="$(date +%s.%N)" -v b="$PRESSED" 'BEGIN {printf "%.1f", a - b}')s after the pressure began"
  watch_deletion "$letter" "$NS_T" "$pod" "$PRESSED"
  [[ "$DELETING" == *"the node's pressure blocked timeout: ${BOUND}s"* ]] \
    || die "story $letter: the deletion event does not name the node's ${BOUND} s bound: $DELETING"
  kubelet "$NS_T" "$pod"
}

say "the administrator's ClusterGpuMemoryBudget: limit 70Gi, no optional field set (overLimitSeconds 10), and its pod nb, the neighbour"
kubectl apply -f - <<EOF | sed 's/^/    /'
apiVersion: gpubudget.io/v1alpha1
kind: ClusterGpuMemoryBudget
metadata: {name: $RELEASE-admin}
spec:
  namespaceSelector: {matchLabels: {e2e.gpubudget.io/cluster-budgets: "$ID"}}
  selector: {}
  limit: 70Gi
EOF

make_pod "$NS_C" nb
process "$NS_C" nb
sample nb=$GI
wait_for "$NS_C/nb recorded under the cluster budget" annotation_is "$NS_C" nb budget "ClusterGpuMemoryBudget/$RELEASE-admin"
info "the neighbour nb: 1 GiB of its 70Gi, owed 69 GiB: every story's pressure harms it (#52: relief only where a neighbour is harmed)"

say "a. a namespaced budget (tenant-written under ClusterBound) with blockedEvictionTimeoutSeconds 86400; the pod at 78 GiB beside nb (1 GiB free)"
namespaced_story "a (namespaced budget, blockedEvictionTimeoutSeconds 86400)" pa ", blockedEvictionTimeoutSeconds: 86400"

say "b. the same, blockedEvictionTimeoutSeconds unset (the baseline)"
namespaced_story "b (namespaced budget, field unset)" pb ""

say "c. the pod at 78 GiB from the start beside nb: over its 70Gi, and the card at 1 GiB free"
make_pod "$NS_C" pc
process "$NS_C" pc
sample pc=$((GI)) nb=$GI
wait_for "$NS_C/pc recorded under the cluster budget" annotation_is "$NS_C" pc budget "ClusterGpuMemoryBudget/$RELEASE-admin"
PRESSED=$(date +%s.%N)
sample pc=$((78 * GI)) nb=$GI
wait_for "GpuMemoryEvictionBlocked on $NS_C/pc" has_event "$NS_C" pc GpuMemoryEvictionBlocked
info "first refusal $(awk -v a="$(date +%s.%N)" -v b="$PRESSED" 'BEGIN {printf "%.1f", a - b}')s after the pressure began"
watch_deletion "c (cluster budget 70Gi, 79 GiB from the start)" "$NS_C" pc "$PRESSED"
kubelet "$NS_C" pc

say "d. the pod first at 74 GiB beside nb (5 GiB free: no pressure), over its 70Gi: its budget's eviction refused; then 78 GiB"
make_pod "$NS_C" pd
process "$NS_C" pd
sample pd=$((GI)) nb=$GI
wait_for "$NS_C/pd recorded under the cluster budget" annotation_is "$NS_C" pd budget "ClusterGpuMemoryBudget/$RELEASE-admin"
OVER=$(date +%s.%N)
sample pd=$((74 * GI)) nb=$GI
wait_for "GpuMemoryOverBudget on $NS_C/pd" has_event "$NS_C" pd GpuMemoryOverBudget
wait_for "GpuMemoryEvictionBlocked on $NS_C/pd (its budget's eviction, after overLimitSeconds)" \
  has_event "$NS_C" pd GpuMemoryEvictionBlocked
info "its budget's eviction refused $(awk -v a="$(date +%s.%N)" -v b="$OVER" 'BEGIN {printf "%.1f", a - b}')s after going over: $(event_messages "$NS_C" pd GpuMemoryEvictionBlocked | head -n1 | cut -c1-240)"
under_pressure && die "the GPU is under pressure at 75 GiB of 80"
terminating "$NS_C" pd && die "pd deleted before any pressure"
sleep 5
info "record: $(annotation "$NS_C" pd state), refusals so far: $(event_occurrences "$NS_C" pd GpuMemoryEvictionBlocked)"
PRESSED=$(date +%s.%N)
sample pd=$((78 * GI)) nb=$GI
wait_for "the GPU under pressure (1 GiB free)" under_pressure
watch_deletion "d (cluster budget 70Gi, its eviction refused before the pressure)" "$NS_C" pd "$PRESSED"
kubelet "$NS_C" pd

FAILED=0
say "summary (--pressure-blocked-timeout ${BOUND}s, real kube-apiserver, replayed 80 GiB GPU)"
for line in "${SUMMARY[@]}"; do info "$line"; done
say "PASS: under pressure a PodDisruptionBudget holds relief back the node's bound at most, whatever the budget says ($((SECONDS - START)) s)"
