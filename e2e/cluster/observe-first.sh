#!/usr/bin/env bash
# The README's first install on the real node tier (#54): `helm install ... --set agent.enforcement=Observe` (the
# README's one command, with this tier's images and its replayed sample), a budget, a pod over it: told what would
# be evicted, nothing evicted; then that one budget switched to `enforcement: Enforce`, and it acts. Real kubelet,
# containerd and runc (/work/shared/realk8s, node-up.sh), the chart's agent and operator (eviction webhook
# included) from binaries built here, the agent replaying a sample of one 80Gi GPU (no GPU here).
#   GPUBUDGET_E2E_OBSERVE=1 bash e2e/cluster/observe-first.sh
# Needs: root; the API server and the node up (eval "$(REALK8S_ADVERTISE=10.88.0.1 bash up.sh)"; node-up.sh); helm;
# the binaries (GPUBUDGET_E2E_BIN, default $CARGO_TARGET_DIR/release: gpubudget-agent, gpubudget-operator,
# kubectl-gpubudget). Skips unless GPUBUDGET_E2E_OBSERVE=1.
set -euo pipefail
if [ "${GPUBUDGET_E2E_OBSERVE:-0}" != 1 ]; then
  echo "observe-first.sh: skipped (set GPUBUDGET_E2E_OBSERVE=1; needs the realk8s node tier)"
  exit 0
fi
HERE=$(cd "$(dirname "$0")" && pwd); REPO=$(cd "$HERE/../.." && pwd)
REALK8S=${REALK8S:-/work/shared/realk8s}; D=${REALK8S_DIR:-/tmp/realk8s}; NODE=${REALK8S_NODE_NAME:-n1}
export KUBECONFIG=${KUBECONFIG:-$D/run/kubeconfig} CONTAINERD_SUPPRESS_DEPRECATION_WARNINGS=1 REALK8S_DIR=$D
START=$SECONDS; STEP_TIMEOUT=${GPUBUDGET_E2E_STEP_TIMEOUT:-120}; POLL=0.2
# shellcheck source=../lib.sh
. "$REPO/e2e/lib.sh"
BIN=${GPUBUDGET_E2E_BIN:-$RELEASE_DIR}
[ -n "$HELM" ] || die "no helm"
for b in gpubudget-agent gpubudget-operator kubectl-gpubudget; do [ -x "$BIN/$b" ] || die "no $BIN/$b"; done
kubectl get --raw /readyz >/dev/null 2>&1 || die "no API server"
[ "$(kubectl get node "$NODE" -o jsonpath='{.status.conditions[?(@.type=="Ready")].status}')" = True ] || die "node $NODE not Ready (node-up.sh)"
LABEL="real node tier: kubelet 1.32, $(kubectl get node "$NODE" -o jsonpath='{.status.nodeInfo.containerRuntimeVersion}'), runc, $(nproc)-core VM, no GPU (usage replayed)"
ID=$(date +%s | tail -c 6)$RANDOM; ID=${ID:0:8}
NS=gpubudget-of-$ID; T=gpubudget-of-$ID-t; TAG=of-$ID
cleanup() {
  local rc=$?
  set +e
  [ "$rc" = 0 ] || { kubectl logs -n "$NS" -l app.kubernetes.io/component=agent --tail=40 2>/dev/null; kubectl get events -n "$T" 2>/dev/null | tail -20; }
  "$HELM" uninstall gpubudget -n "$NS" --wait --timeout 2m >/dev/null 2>&1
  kubectl delete namespace "$T" "$NS" --wait=true --timeout=90s >/dev/null 2>&1
  kubectl label node "$NODE" gpubudget.io/enforcement- >/dev/null 2>&1
  exit "$rc"
}
trap cleanup EXIT

say "the node ($LABEL); images from $BIN"
for c in agent operator; do
  bash "$REALK8S/image.sh" "gpubudget/gpubudget-$c:$TAG" "/usr/local/bin/gpubudget-$c" "$BIN/gpubudget-$c=/usr/local/bin/gpubudget-$c" | sed 's/^/    /'
done
kubectl create namespace "$NS" >/dev/null
kubectl label namespace "$NS" pod-security.kubernetes.io/enforce=privileged >/dev/null
kubectl create namespace "$T" >/dev/null
gpu() { printf '{"index": 0, "uuid": "GPU-of000000-0000-0000-0000-000000000000", "name": "replayed 80Gi", "memory_total_bytes": "80Gi", "processes": [%s]}' "$1"; }
write_sample() { # PROCESSES_JSON: the replayed sample; the agent pod nudged so the kubelet refreshes the ConfigMap
  printf '{"version": 1, "host": "observe-first %s", "gpus": [%s]}\n' "$ID" "$(gpu "$1")" > "/tmp/of-$ID.json"
  kubectl create configmap gpubudget-e2e-sample -n "$NS" --from-file=sample.json="/tmp/of-$ID.json" --dry-run=client -o yaml | kubectl apply -f - >/dev/null 2>&1
  kubectl annotate pods -n "$NS" -l app.kubernetes.io/component=agent "e2e.gpubudget.io/sample=$(date +%s%N)" --overwrite >/dev/null 2>&1 || true
}
write_sample ""

# This API server may hold the CRDs of an earlier run: Helm installs CRDs only where none exist, so they are applied
# first, as docs/operations.md says for an upgrade (a fresh cluster gets them from helm install itself).
kubectl apply --server-side --force-conflicts -f "$REPO/charts/gpubudget/crds/" >/dev/null
say "1. the README's install, observing: helm install ... --set agent.enforcement=Observe"
t0=$(date +%s.%N)
"$HELM" install gpubudget "$REPO/charts/gpubudget" -n "$NS" -f "$HERE/values.yaml" \
  --set image.registry=gpubudget --set-string "agent.image.tag=$TAG" --set-string "operator.image.tag=$TAG" \
  --set agent.enforcement=Observe --wait --timeout 180s >/dev/null
info "figure: helm install --wait (agent and both operator replicas ready): $(since "$t0") s"
[ "$(kubectl get daemonset -n "$NS" -l app.kubernetes.io/component=agent -o jsonpath='{.items[0].spec.template.spec.containers[0].env[?(@.name=="GPUBUDGET_ENFORCEMENT")].value}')" = Observe ] \
  || die "the agent does not observe (GPUBUDGET_ENFORCEMENT)"

say "2. a budget (Evict after 5 s) and a pod over it: told what would be evicted, nothing evicted"
kubectl apply -f - >/dev/null <<YAML
apiVersion: gpubudget.io/v1alpha1
kind: GpuMemoryBudget
metadata: {name: llm, namespace: $T}
spec: {selector: {matchLabels: {app: llm}}, limit: 8Gi, action: Evict, overLimitSeconds: 5}
---
apiVersion: v1
kind: Pod
metadata: {name: llm, namespace: $T, labels: {app: llm}}
spec:
  nodeName: $NODE
  terminationGracePeriodSeconds: 0
  containers: [{name: main, image: local/busybox:1, imagePullPolicy: Never, command: [sleep, "3600"]}]
YAML
kubectl wait -n "$T" --for=condition=Ready pod/llm --timeout=60s >/dev/null
UIDL=$(kubectl get pod -n "$T" llm -o jsonpath='{.metadata.uid}')
write_sample "{\"pod_uid\": \"$UIDL\", \"container\": \"main\", \"used_bytes\": \"9Gi\"}"
t0=$(date +%s.%N)
wait_for "GpuMemoryOverBudget on llm (9Gi of 8Gi)" has_event "$T" llm GpuMemoryOverBudget
wait_for "GpuMemoryWouldEvict on llm" has_event "$T" llm GpuMemoryWouldEvict
info "figure: the sample written to GpuMemoryWouldEvict: $(since "$t0") s (overLimitSeconds 5, the kubelet's ConfigMap refresh included)"
info "llm: $(event_messages "$T" llm GpuMemoryWouldEvict | head -n1)"
sleep 20
! has_event "$T" llm EvictingForGpuMemory || record_fail "llm got EvictingForGpuMemory while observing"
if [ -z "$(kubectl get pod -n "$T" llm -o jsonpath='{.metadata.deletionTimestamp}')" ]; then pass "llm Running 20 s after it was due, not evicted"; else record_fail "llm is being deleted while observing"; fi
kubectl get gmb -n "$T" | sed 's/^/    /'
"$BIN/kubectl-gpubudget" why llm -n "$T" 2>&1 | sed 's/^/    why: /' | head -12

say "3. that one budget switched to enforcing: spec.enforcement: Enforce"
t0=$(date +%s.%N)
kubectl patch gmb -n "$T" llm --type=merge -p '{"spec":{"enforcement":"Enforce"}}' >/dev/null
wait_for "EvictingForGpuMemory on llm" has_event "$T" llm EvictingForGpuMemory
info "figure: the switch to EvictingForGpuMemory: $(since "$t0") s (the over-limit period starts afresh at the switch: overLimitSeconds 5)"
wait_for "llm evicted (terminating or gone)" pod_gone_or_terminating "$T" llm
info "figure: the switch to llm terminating or gone: $(since "$t0") s"
events_of() { kubectl get events -n "$T" --field-selector involvedObject.name=llm --sort-by=.lastTimestamp -o custom-columns=REASON:.reason,MESSAGE:.message | cut -c1-200 | sed 's/^/    /'; }
events_of
say "summary [$LABEL]"
failures_exit
