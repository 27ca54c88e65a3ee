#!/usr/bin/env bash
# `kubectl gpubudget` against a real kube-apiserver (realk8s): as the admin creates them by hand, the CRD,
# budgets (two overlapping), pods carrying the agent's records (gpubudget.io/* annotations), the agent's
# events (events.k8s.io/v1, as its Recorder publishes them) and a pod that was evicted and is gone (its events
# and the budget's status.lastEviction remain). Then the plugin, found by kubectl on PATH, runs as a tenant
# (a ServiceAccount with the `edit` ClusterRole bound in its namespace, by token) and as the admin. No agent
# or operator runs: the records, events and status are what they would have written.
#
#   KUBECONFIG=/tmp/realk8s/run/kubeconfig e2e/apiserver/kubectl-plugin.sh [RESULT_FILE]
#
# Prints every command and its output (and writes them to RESULT_FILE when given). Environment:
# GPUBUDGET_E2E_BIN (a folder holding kubectl-gpubudget; default: builds target/debug), GPUBUDGET_E2E_KEEP=1.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
REPO=$(cd "$HERE/../.." && pwd)
[ -n "${KUBECONFIG:-}" ] || { echo "KUBECONFIG (the admin's) is not set" >&2; exit 1; }
# shellcheck source=../lib.sh
. "$REPO/e2e/lib.sh"
if [ -z "${GPUBUDGET_E2E_BIN:-}" ]; then
  (cd "$REPO" && cargo build -q -p kubectl-gpubudget)
  GPUBUDGET_E2E_BIN=$REPO/target/debug
fi
export PATH=$GPUBUDGET_E2E_BIN:$PATH
RESULT=${1:-/dev/null}
START=$SECONDS
A=gpubudget-kp-a B=gpubudget-kp-b
WORK=$(mktemp -d "${TMPDIR:-/tmp}/gpubudget-kubectl-plugin.XXXXXX")
ADMIN_KUBECONFIG=$KUBECONFIG
cleanup() {
  local rc=$?
  if [ "${GPUBUDGET_E2E_KEEP:-0}" != 1 ]; then
    KUBECONFIG=$ADMIN_KUBECONFIG kubectl delete namespace "$A" "$B" --wait=false >/dev/null 2>&1 || true
    KUBECONFIG=$ADMIN_KUBECONFIG kubectl delete clusterrole gpubudget-budgets-view --ignore-not-found >/dev/null 2>&1 || true
    rm -rf "$WORK"
  fi
  exit "$rc"
}
trap cleanup EXIT
: > "$RESULT"
# show WHO ARGS...: runs `kubectl gpubudget ARGS` with WHO's kubeconfig; prints (and records) it, and its exit status.
show() {
  local who=$1 rc=0
  shift
  local kc=$ADMIN_KUBECONFIG
  [ "$who" = admin ] || kc=$WORK/$who.kubeconfig
  { printf '\n$ kubectl gpubudget %s    # as %s\n' "$*" "$who"; KUBECONFIG=$kc kubectl gpubudget "$@" 2>&1 || rc=$?
    [ "$rc" = 0 ] || echo "(exit status $rc)"; } | tee -a "$RESULT"
}
ago() { date -u -d "-$1 seconds" +%Y-%m-%dT%H:%M:%S.000000Z; }
# event NS POD UID REASON AGO NOTE: the agent's event about a pod, as its Recorder publishes it.
event() {
  kubectl create -f - >/dev/null <<YAML
apiVersion: events.k8s.io/v1
kind: Event
metadata: {generateName: $2-, namespace: $1}
eventTime: "$(ago "$5")"
reportingController: gpubudget-agent
reportingInstance: n1
action: $( [ "$4" = EvictingForGpuMemory ] && echo Evict || echo Measure )
reason: $4
type: Warning
regarding: {apiVersion: v1, kind: Pod, namespace: $1, name: $2, uid: "$3"}
note: "$6"
YAML
}
# pod NS NAME LABELS STATE USAGE BUDGET [ENV-JSON] [EXTRA-ANNOTATIONS-JSON]: a pod on n1 with the agent's record.
pod() {
  local annotations
  annotations=$(jq -cn --arg s "$4" --arg u "$5" --arg b "$6" --argjson x "${8:-{\}}" \
    '{"gpubudget.io/state": $s, "gpubudget.io/usage-bytes": $u, "gpubudget.io/budget": $b, "gpubudget.io/node": "n1"} + $x')
  jq -n --arg ns "$1" --arg n "$2" --argjson l "$3" --argjson a "$annotations" --argjson env "${7:-[]}" \
    '{apiVersion: "v1", kind: "Pod", metadata: {name: $n, namespace: $ns, labels: $l, annotations: $a},
      spec: {nodeName: "n1", terminationGracePeriodSeconds: 20, containers: [{name: "server", image: "vllm/vllm-openai:v0.6",
             env: $env, resources: {limits: {"nvidia.com/gpu": "1"}}}]}}' | kubectl create -f - >/dev/null
  kubectl patch pod "$2" -n "$1" --subresource=status --type=merge -p '{"status":{"phase":"Running"}}' >/dev/null
  kubectl get pod "$2" -n "$1" -o jsonpath='{.metadata.uid}'
}

say "as the admin: the CRD, namespaces $A and $B, budgets, pods with records, the agent's events" | tee -a "$RESULT"
info "$(date -u +%FT%TZ); real kube-apiserver $(kubectl version -o json | jq -r '.serverVersion.gitVersion') (realk8s), $(nproc)-core VM; $(kubectl gpubudget --version) ($(git -C "$REPO" rev-parse --short HEAD))" | tee -a "$RESULT"
# A previous run's namespaces (their pods go once the pod GC removes pods of the node that does not exist).
kubectl delete namespace "$A" "$B" --ignore-not-found --timeout=120s >/dev/null
kubectl apply -f "$REPO/crds/gpumemorybudgets.gpubudget.io.yaml" >/dev/null
kubectl wait --for=condition=Established crd/gpumemorybudgets.gpubudget.io --timeout=60s >/dev/null
kubectl create namespace "$A" >/dev/null
kubectl create namespace "$B" >/dev/null
kubectl apply -f - >/dev/null <<YAML
apiVersion: gpubudget.io/v1alpha1
kind: GpuMemoryBudget
metadata: {name: llm-inference, namespace: $A}
spec: {selector: {matchLabels: {app: llm}}, limit: 8Gi, overLimitSeconds: 60, blockedEvictionTimeoutSeconds: 600}
---
apiVersion: gpubudget.io/v1alpha1
kind: GpuMemoryBudget
metadata: {name: team-default, namespace: $A}
spec: {selector: {}, limit: 20Gi, action: Warn}
---
apiVersion: gpubudget.io/v1alpha1
kind: GpuMemoryBudget
metadata: {name: other-team, namespace: $B}
spec: {selector: {}, limit: 4Gi}
YAML
GI=1073741824
LLM=$(pod "$A" llm-0 '{"app":"llm"}' Over $((9 * GI)) llm-inference)
FT=$(pod "$A" finetune-0 '{"app":"finetune"}' Near $((19 * GI)) team-default \
  '[{"name":"CUDA_MPS_PINNED_DEVICE_MEM_LIMIT","value":"0=16G"},{"name":"NVIDIA_GPU_MEMORY_LIMIT","value":"20480"}]')
pod "$B" b-0 '{"app":"b"}' Within $((GI / 2)) other-team >/dev/null
OLD=$(pod "$A" llm-1 '{"app":"llm"}' Evicting $((19 * GI / 2)) llm-inference '[]' \
  "{\"gpubudget.io/eviction-requested-at\": \"$(date -u -d -100sec +%Y-%m-%dT%H:%M:%SZ)\"}")
event "$A" finetune-0 "$FT" GpuMemoryNearBudget 300 "using 19Gi of 20Gi (budget $A/team-default), at or above the 90% warning threshold; held by server (pid 4242, GPU 0) 19Gi"
event "$A" llm-0 "$LLM" GpuMemoryNearBudget 60 "using 7.5Gi of 8Gi (budget $A/llm-inference), at or above the 90% warning threshold; held by server (pid 1304, GPU 0) 7.5Gi"
event "$A" llm-0 "$LLM" GpuMemoryOverBudget 25 "using 9Gi of 8Gi (budget $A/llm-inference); evicting if it stays over for 60s; held by server (pid 1304, GPU 0) 9Gi"
event "$A" llm-1 "$OLD" GpuMemoryOverBudget 160 "using 9.5Gi of 8Gi (budget $A/llm-inference); evicting if it stays over for 60s; held by server (pid 1311, GPU 0) 9.5Gi"
event "$A" llm-1 "$OLD" EvictingForGpuMemory 100 "using 9.5Gi of 8Gi (budget $A/llm-inference) for 60s; evicting with the pod's 20s grace; held by server (pid 1311, GPU 0) 9.5Gi"
# What the operator writes once it counts the eviction; then the pod is gone (no kubelet here: deleted at once).
kubectl patch gmb llm-inference -n "$A" --subresource=status --type=merge -p "{\"status\":{\"evictions\":1,\"lastEviction\":
  {\"pod\":\"llm-1\",\"node\":\"n1\",\"time\":\"$(date -u -d -100sec +%Y-%m-%dT%H:%M:%SZ)\",\"usage\":\"9.5Gi\"}}}" >/dev/null
kubectl delete pod llm-1 -n "$A" --grace-period=0 --force >/dev/null 2>&1
info "budgets: $(kubectl get gmb -A --no-headers | awk '{print $1"/"$2" "$3}' | paste -sd, -)" | tee -a "$RESULT"

say "a tenant: ServiceAccount alice in $A with the edit ClusterRole bound there (a RoleBinding), by token" | tee -a "$RESULT"
kubectl create serviceaccount alice -n "$A" >/dev/null
kubectl create rolebinding alice-edit -n "$A" --clusterrole=edit --serviceaccount="$A:alice" >/dev/null
token_kubeconfig "$WORK/alice.kubeconfig" alice "$(kubectl create token alice -n "$A" --duration=1h)"
KUBECONFIG=$WORK/alice.kubeconfig kubectl config set-context --current --namespace="$A" >/dev/null
info "alice may list gpumemorybudgets in $A: $(kubectl auth can-i list gpumemorybudgets.gpubudget.io -n "$A" --as=system:serviceaccount:$A:alice || true)" | tee -a "$RESULT"
show alice top
show alice why llm-0
show alice top -A
show alice why b-0 -n "$B"

say "the admin applies the chart's budgets-view ClusterRole: read access to budgets aggregated into view (so edit, admin)" | tee -a "$RESULT"
"$HELM" template gpubudget "$REPO/charts/gpubudget" --show-only templates/budgets-view.yaml | kubectl apply -f - >/dev/null
wait_for_alice() { [ "$(kubectl auth can-i list gpumemorybudgets.gpubudget.io -n "$A" --as=system:serviceaccount:$A:alice)" = yes ]; }
STEP_TIMEOUT=30 POLL=1 wait_for "the edit role to aggregate the budget rule" wait_for_alice | tee -a "$RESULT"
show alice top --sort-by percent
show alice why llm-0
show alice why llm-1
show alice why finetune-0 -o yaml
show alice why nope

say "as the admin, cluster-wide" | tee -a "$RESULT"
show admin top -A
show admin top -A -l app=llm -o json
say "done" | tee -a "$RESULT"
