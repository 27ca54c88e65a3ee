#!/usr/bin/env bash
# No exemption a tenant can grant itself (issue 33, items 1–3) against a real kube-apiserver, no kubelet: one
# agent (token bound to its Node) with the chart's RBAC and admission policies, a tenant's manifests, and the
# API server's own admission (Priority), disruption controller (PodDisruptionBudgets) and Eviction API.
#
#   GPUBUDGET_E2E_APISERVER=1 KUBECONFIG=/tmp/realk8s/run/kubeconfig e2e/apiserver/tenant.sh [OUT]
#   GPUBUDGET_E2E_APISERVER=1 REALK8S_DIR=/tmp/realk8s e2e/apiserver/tenant.sh [OUT]   # starts it (up.sh), stops it
#
# The stories, as a hostile tenant would try them (edit rights in its own namespaces, nothing cluster-scoped):
# 1. critical priority: its pod asks for `priorityClassName: system-node-critical` (the API server admits it in
#    any namespace without a ResourceQuota scope) and holds 2Gi of its 1Gi budget: evicted after
#    overLimitSeconds all the same, and the events say why; the same in kube-system (the default
#    criticalNamespaces) is never evicted;
# 2. a PodDisruptionBudget (`maxUnavailable: 0`) on its unbudgeted pod filling the GPU: every pressure eviction
#    refused (the API's 429), then, after the node's bound (--pressure-blocked-timeout, 10 s here), the pod is
#    deleted with the pressure grace; the budgeted neighbour keeps its memory;
# 3. a label that opts into a looser cluster budget (a smaller limit, `Warn`, an hour over): the pod adds it
#    and is evicted after the administrator's overLimitSeconds all the same, the events naming the tightening.
# The test plays the kubelet (pod status, /proc, deleting a pod once its grace is over) and NVML (a sample file).
# OUT (optional) receives a copy of the output.
#
# Environment: as e2e/lib.sh says (GPUBUDGET_E2E_BIN, HELM, GPUBUDGET_E2E_STEP_TIMEOUT, GPUBUDGET_E2E_KEEP, REALK8S).
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
REPO=$(cd "$HERE/../.." && pwd)
REALK8S=${REALK8S:-/work/shared/realk8s}
if [ -n "${1:-}" ] && [ -z "${TENANT_TEE:-}" ]; then
  TENANT_TEE=1 exec > >(tee "$1") 2>&1
fi

# shellcheck source=../lib.sh
. "$REPO/e2e/lib.sh"
control_plane_or_skip "no self-granted exemption" gpubudget-agent
STEP_TIMEOUT=${GPUBUDGET_E2E_STEP_TIMEOUT:-60}
POLL=0.5
GI=1073741824

ID=$(date +%s | tail -c 5)$RANDOM
ID=${ID:0:7}
NS=gpubudget-tenant-$ID             # the release's namespace (its ServiceAccounts)
NS_A=gpubudget-tenant-$ID-a         # story 1: the tenant's critical pod
NS_B=gpubudget-tenant-$ID-b         # story 2: the PodDisruptionBudget, and the budgeted neighbour
NS_C=gpubudget-tenant-$ID-c         # story 3: the label and the cluster budgets
NODE=gpubudget-tenant-$ID-n1
RELEASE=gpubudget-tenant-$ID
WORK=$(mktemp -d "${TMPDIR:-/tmp}/gpubudget-tenant.XXXXXX")
ADMIN=127.0.0.1:$((20000 + RANDOM % 20000))
PIDS=()
FAILED=1
START=$SECONDS

cleanup() {
  local rc=$?
  if [ "$FAILED" != 0 ]; then
    say "diagnostics"
    kubectl get pods -A -l "e2e.gpubudget.io/run=$ID" -o wide || true
    kubectl get pdb -n "$NS_B" -o yaml || true
    echo "--- agent log (last 60 lines)"; tail -n 60 "$WORK/agent.log" 2>/dev/null || true
  fi
  for pid in "${PIDS[@]}"; do stop_process "$pid"; done
  if [ "${GPUBUDGET_E2E_KEEP:-0}" = 1 ]; then
    say "keeping the namespaces, the node, the cluster budgets and $WORK (GPUBUDGET_E2E_KEEP=1)"
  else
    kubectl delete cgmb "$RELEASE-admin" "$RELEASE-lax" --ignore-not-found >/dev/null 2>&1 || true
    kubectl delete pod -n kube-system "$RELEASE-sys" --grace-period=0 --force --ignore-not-found >/dev/null 2>&1 || true
    kubectl delete gmb -n kube-system "$RELEASE-sys" --ignore-not-found >/dev/null 2>&1 || true
    kubectl delete namespace "$NS" "$NS_A" "$NS_B" "$NS_C" --wait=false --ignore-not-found >/dev/null 2>&1 || true
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
for ns in "$NS" "$NS_A" "$NS_B" "$NS_C"; do kubectl create namespace "$ns" >/dev/null; done
kubectl label namespace "$NS_C" "e2e.gpubudget.io/cluster-budgets=$ID" >/dev/null
apply_crd_and_chart "$RELEASE" "$NS" "ServiceAccount ClusterRole ClusterRoleBinding Role RoleBinding ValidatingAdmissionPolicy ValidatingAdmissionPolicyBinding"
for ns in "$NS" "$NS_A" "$NS_B" "$NS_C"; do wait_for "ServiceAccount default in $ns" kubectl get serviceaccount default -n "$ns"; done
kubectl create -f - >/dev/null <<EOF
apiVersion: v1
kind: Node
metadata: {name: $NODE, labels: {nvidia.com/gpu.present: "true", e2e.gpubudget.io/run: "$ID"}}
EOF

say "the tenant's manifests (and the administrator's cluster budgets)"
kubectl apply -f - <<EOF | sed 's/^/    /'
apiVersion: gpubudget.io/v1alpha1
kind: GpuMemoryBudget
metadata: {name: small, namespace: $NS_A}
spec: {selector: {}, limit: 1Gi, overLimitSeconds: 2}
---
apiVersion: gpubudget.io/v1alpha1
kind: GpuMemoryBudget
metadata: {name: $RELEASE-sys, namespace: kube-system}
spec: {selector: {matchLabels: {e2e.gpubudget.io/run: "$ID"}}, limit: 1Gi, overLimitSeconds: 2}
---
apiVersion: gpubudget.io/v1alpha1
kind: GpuMemoryBudget
metadata: {name: neighbour, namespace: $NS_B}
spec: {selector: {matchLabels: {app: neighbour}}, limit: 10Gi}
---
apiVersion: policy/v1
kind: PodDisruptionBudget
metadata: {name: never, namespace: $NS_B}
spec: {maxUnavailable: 0, selector: {matchLabels: {app: filler}}}
---
apiVersion: gpubudget.io/v1alpha1
kind: ClusterGpuMemoryBudget
metadata: {name: $RELEASE-admin}
spec:
  namespaceSelector: {matchLabels: {e2e.gpubudget.io/cluster-budgets: "$ID"}}
  selector: {}
  limit: 8Gi
  overLimitSeconds: 3
  blockedEvictionTimeoutSeconds: 30
---
apiVersion: gpubudget.io/v1alpha1
kind: ClusterGpuMemoryBudget
metadata: {name: $RELEASE-lax}
spec:
  namespaceSelector: {matchLabels: {e2e.gpubudget.io/cluster-budgets: "$ID"}}
  selector: {matchLabels: {tier: batch}}
  limit: 6Gi
  action: Warn
  overLimitSeconds: 3600
  evictionGracePeriodSeconds: 3600
EOF

# make_pod NAMESPACE NAME LABELS [SPEC]: a running pod on the node (the test is its kubelet).
make_pod() {
  kubectl create -f - >/dev/null <<EOF
apiVersion: v1
kind: Pod
metadata: {name: $2, namespace: $1, labels: {e2e.gpubudget.io/run: "$ID", $3}}
spec:
  nodeName: $NODE
  terminationGracePeriodSeconds: 60
  containers: [{name: main, image: registry.k8s.io/pause:3.10}]
  ${4:-}
EOF
  pod_running "$1" "$2"
}
make_pod "$NS_A" critical "app: critical" "priorityClassName: system-node-critical"
make_pod kube-system "$RELEASE-sys" "app: sys" "priorityClassName: system-node-critical"
make_pod "$NS_C" labelled "tier: batch"
make_pod "$NS_B" neighbour "app: neighbour"
make_pod "$NS_B" filler "app: filler"
PRIORITY=$(kubectl get pod critical -n "$NS_A" -o jsonpath='{.spec.priority}')
info "the API server admitted $NS_A/critical with system-node-critical: priority $PRIORITY"
[ "$PRIORITY" = 2000001000 ] || die "priority $PRIORITY"

declare -A PID_OF NS_OF=([critical]=$NS_A [$RELEASE-sys]=kube-system [labelled]=$NS_C [neighbour]=$NS_B [filler]=$NS_B)
pid=6100
for pod in critical "$RELEASE-sys" labelled neighbour filler; do
  pid=$((pid + 1))
  fake_process "$WORK/proc" "$pid" "${NS_OF[$pod]}" "$pod"
  PID_OF[$pod]=$pid
done
# sample POD=BYTES...: the GPU's processes, written atomically as NVML would report them (80Gi GPU).
sample() {
  local procs="" kv used=0
  for kv in "$@"; do
    procs+="${procs:+, }{\"pid\": ${PID_OF[${kv%%=*}]}, \"used_bytes\": ${kv#*=}}"
    used=$((used + ${kv#*=}))
  done
  # memory_used_bytes: the device's figure, from which free memory (the pressure signal) is read.
  cat > "$WORK/sample.tmp" <<EOF
{"version": 1, "gpus": [{"index": 0, "uuid": "GPU-e2e00000-0000-0000-0000-000000000033", "name": "replayed e2e GPU",
 "memory_total_bytes": 85899345920, "memory_used_bytes": $used, "processes": [$procs]}]}
EOF
  mv "$WORK/sample.tmp" "$WORK/sample.json"
}
sample critical=$((2 * GI)) "$RELEASE-sys=$((2 * GI))" labelled=$((7 * GI)) neighbour=$((8 * GI))

say "the agent (defaults: criticalNamespaces kube-system; --pressure-blocked-timeout 10s for a short test)"
token_kubeconfig "$WORK/agent.kubeconfig" agent \
  "$(kubectl create token "$RELEASE-agent" -n "$NS" --duration=1h --bound-object-kind Node --bound-object-name "$NODE")"
KUBECONFIG=$WORK/agent.kubeconfig RUST_LOG=info "$BIN/gpubudget-agent" run --node-name "$NODE" \
  --proc-root "$WORK/proc" --sample-file "$WORK/sample.json" --interval 250ms --admin-addr "$ADMIN" \
  --pressure-blocked-timeout 10s > "$WORK/agent.log" 2>&1 &
PIDS+=($!)
wait_for "agent ready" ready "$ADMIN"
T_START=$SECONDS

say "1. critical priority in the tenant's namespace: evicted over its budget; in kube-system: never"
wait_for "$NS_A/critical terminating (evicted)" terminating "$NS_A" critical
info "evicted $((SECONDS - T_START)) s after the agent started (overLimitSeconds 2)"
OVER=$(event_messages "$NS_A" critical GpuMemoryOverBudget | head -n1)
info "GpuMemoryOverBudget: $OVER"
grep -q "criticalNamespaces: kube-system" <<<"$OVER" || die "the over event does not say why critical priority exempts nothing"
wait_for "EvictingForGpuMemory on $NS_A/critical" has_event "$NS_A" critical EvictingForGpuMemory
info "EvictingForGpuMemory: $(event_messages "$NS_A" critical EvictingForGpuMemory | head -n1 | cut -c1-260)"
wait_for "GpuMemoryOverBudget on kube-system/$RELEASE-sys" has_event kube-system "$RELEASE-sys" GpuMemoryOverBudget
SYS=$(event_messages kube-system "$RELEASE-sys" GpuMemoryOverBudget | head -n1)
info "kube-system: $SYS"
grep -q "critical and is never evicted" <<<"$SYS" || die "kube-system's critical pod: $SYS"

say "3. the tenant's label opts into a smaller-limit cluster budget that says Warn and an hour over"
wait_for "$NS_C/labelled terminating (evicted after the administrator's 3 s, not Warn)" terminating "$NS_C" labelled
LABELLED=$(event_messages "$NS_C" labelled GpuMemoryOverBudget | head -n1)
info "GpuMemoryOverBudget: $LABELLED"
grep -q "budget $RELEASE-lax, tightened by ClusterGpuMemoryBudget/$RELEASE-admin (action, overLimitSeconds" <<<"$LABELLED" \
  || die "the event does not name the tightening: $LABELLED"
GRACE=$(kubectl get pod labelled -n "$NS_C" -o jsonpath='{.metadata.deletionGracePeriodSeconds}')
[ "$GRACE" = 30 ] || die "labelled's grace is $GRACE: not the administrator's 30 (lax says 3600)"
info "evicted with ${GRACE}s grace (lax's 3600 s tightened to the default 30 s of admin)"
[ "$(annotation "$NS_C" labelled budget)" = "ClusterGpuMemoryBudget/$RELEASE-lax" ] || die "record: $(annotation "$NS_C" labelled budget)"
if [ -x "$BIN/kubectl-gpubudget" ]; then
  "$BIN/kubectl-gpubudget" why labelled -n "$NS_C" > "$WORK/why.txt" 2>&1 || true
  sed 's/^/    /' "$WORK/why.txt" | head -n 20
  grep -q "tightened by" "$WORK/why.txt" || die "kubectl gpubudget why does not name the tightening"
fi

say "the kubelet's part: evicted pods' processes exit, the pods are deleted"
for ns_pod in "$NS_A/critical" "$NS_C/labelled"; do
  kubectl delete pod "${ns_pod#*/}" -n "${ns_pod%/*}" --grace-period=0 --force >/dev/null 2>&1
done
sleep 2
terminating kube-system "$RELEASE-sys" && die "kube-system's critical pod evicted"

say "2. the unbudgeted pod fills the GPU (68Gi: 78Gi of 80Gi used, 2Gi free); its PodDisruptionBudget refuses every eviction"
wait_for "the PodDisruptionBudget allows no disruption" bash -c \
  "[ \"\$(kubectl get pdb never -n '$NS_B' -o jsonpath='{.status.disruptionsAllowed}')\" = 0 ] && [ \"\$(kubectl get pdb never -n '$NS_B' -o jsonpath='{.status.currentHealthy}')\" = 1 ]"
PRESSED=$SECONDS
sample "$RELEASE-sys=$((2 * GI))" neighbour=$((8 * GI)) filler=$((68 * GI))
wait_for "GpuMemoryEvictionBlocked on filler (the API's 429)" has_event "$NS_B" filler GpuMemoryEvictionBlocked
info "refused: $(event_messages "$NS_B" filler GpuMemoryEvictionBlocked | head -n1 | cut -c1-200)"
terminating "$NS_B" filler && die "filler deleted before the bound"
STEP_TIMEOUT=$((STEP_TIMEOUT + 30)) wait_for "filler terminating (deleted after the bound)" terminating "$NS_B" filler
DELETED_AFTER=$((SECONDS - PRESSED))
[ "$DELETED_AFTER" -ge 10 ] || die "filler deleted ${DELETED_AFTER}s after the pressure began, before the 10 s bound"
GRACE=$(kubectl get pod filler -n "$NS_B" -o jsonpath='{.metadata.deletionGracePeriodSeconds}')
[ "$GRACE" = 5 ] || die "filler's grace is $GRACE, not the pressure grace 5"
wait_for "DeletingForGpuMemory on filler" has_event "$NS_B" filler DeletingForGpuMemory
info "deleted ${DELETED_AFTER}s after the pressure began (bound 10 s, retries every 5–10 s), grace $GRACE"
info "DeletingForGpuMemory: $(event_messages "$NS_B" filler DeletingForGpuMemory | head -n1 | cut -c1-260)"
info "refusals before it: $(event_occurrences "$NS_B" filler GpuMemoryEvictionBlocked)"
terminating "$NS_B" neighbour && die "the budgeted neighbour (8Gi of its 10Gi) was evicted"

FAILED=0
say "PASS: a tenant's critical priority, a PodDisruptionBudget and a label bought no exemption ($((SECONDS - START)) s)"
