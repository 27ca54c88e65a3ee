#!/usr/bin/env bash
# Shares that hold against the tenant (issue 51) on a real kube-apiserver with the chart's RBAC and admission
# policies, no kubelet: the operator (status, the eviction webhook) and one agent (token bound to its Node, GPU usage
# replayed from a sample file, 80 GiB GPU); a tenant with `edit` in its namespace tries each door, KAI-Scheduler's
# binder (its ServiceAccount kai-scheduler/binder, which the chart exempts) binds, another scheduler's identity
# (pods/binding allowed, not exempt) tries too.
#
#   GPUBUDGET_E2E_APISERVER=1 KUBECONFIG=... GPUBUDGET_E2E_BIN=... e2e/apiserver/shares-tenant.sh [OUT]
#
# The story, each step asserted on real objects:
# 1. a GpuMemoryBudget `shares` {selector: {}, limit: 80Gi, share: {}, overLimitSeconds: 10};
# 2. the tenant creates `kai` (schedulerName kai-scheduler, gpu-fraction "0.25", not bound): allowed; a Binding of
#    its own (pods/binding, bindings): refused (RBAC); another scheduler's Binding carrying gpu-fraction: refused
#    (the policy); KAI's binder binds it: allowed;
# 3. on the bound pod the tenant's rewrite (gpu-fraction=1), removal, gpu-fraction-num-devices added, gpu-memory
#    instead, through the pod and pods/status: all refused; a label change: allowed;
# 4. the tenant creates pods already bound (spec.nodeName): schedulerName kai-scheduler with gpu-fraction "1",
#    gpu-memory, num-devices: refused; with another scheduler and gpu-fraction "1": allowed, and the agent gives it
#    no share (the budget's 80Gi, no gpubudget.io/share);
# 5. HAMi pods with nvidia.com/gpumem 20000, 2e4 and 3000: read back as the API server stores them (20k, 20e3, 3k)
#    and held to 20000, 20000 and 3000 MiB by the agent; hami-20000 at 20001 MiB: Over, naming "HAMi gpumem 20000 MiB";
# 6. the agent's defence in depth: KAI's binder (exempt) rewrites kai's gpu-fraction to 1: the agent keeps the
#    first share (20Gi), tells GpuMemoryShareChangeIgnored once, records what it ignored; kai at 30Gi is Over
#    "of 20Gi" and evicted 10 s later;
# 7. under pressure after a rewrite: two KAI pods at 0.5, bound by KAI's binder; the binder rewrites pa's share to 1;
#    pa at 50 GiB, pb at 28 GiB (1 GiB free): pa is relieved for pressure (EvictingForGpuMemory "under memory
#    pressure", at once), pb never: a rewrite buys no guarantee under pressure.
# OUT (optional) receives a copy of the output.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
REPO=$(cd "$HERE/../.." && pwd)
REALK8S=${REALK8S:-/work/shared/realk8s}
if [ -n "${1:-}" ] && [ -z "${SHARES_TEE:-}" ]; then
  SHARES_TEE=1 exec > >(tee "$1") 2>&1
fi

# shellcheck source=../lib.sh
. "$REPO/e2e/lib.sh"
control_plane_or_skip "shares that hold against the tenant" gpubudget-agent gpubudget-operator
STEP_TIMEOUT=${GPUBUDGET_E2E_STEP_TIMEOUT:-60}
POLL=0.5
GI=1073741824
MI=1048576

ID=$(date +%s | tail -c 5)$RANDOM
ID=${ID:0:7}
NS=gpubudget-st-$ID                 # the release's namespace (its ServiceAccounts)
NS_T=gpubudget-st-$ID-t             # the tenant's
NS_K=kai-scheduler                  # KAI's, as the chart's default shares.kai.namespace
NODE=gpubudget-st-$ID-n1
RELEASE=gpubudget-st-$ID
LEASE=$RELEASE-operator-mirrors
WORK=$(mktemp -d "${TMPDIR:-/tmp}/gpubudget-shares-tenant.XXXXXX")
RESULT=$WORK/doors.txt
PORT_BASE=$((20000 + RANDOM % 20000))
AGENT_ADMIN=127.0.0.1:$PORT_BASE
OPERATOR_ADMIN=127.0.0.1:$((PORT_BASE + 1))
WEBHOOK=127.0.0.1:$((PORT_BASE + 2))
AGENT_PID="" OPERATOR_PID=""
FAILED=1
START=$SECONDS
SUMMARY=()
TENANT=system:serviceaccount:$NS_T:tenant
BINDER=system:serviceaccount:$NS_K:binder
OTHER=system:serviceaccount:$NS:other-scheduler

cleanup() {
  local rc=$?
  if [ "$FAILED" != 0 ]; then
    say "diagnostics"
    kubectl get pods,gmb -n "$NS_T" -o wide || true
    kubectl get events.v1.events.k8s.io -n "$NS_T" -o json 2>/dev/null \
      | jq -r '.items[] | "\(.regarding.name) \(.reason) \(.series.count // 1) \(.note)"' | cut -c1-300 || true
    echo "--- operator log (last 30 lines)"; tail -n 30 "$WORK/operator.log" 2>/dev/null || true
    echo "--- agent log (last 60 lines)"; tail -n 60 "$WORK/agent.log" 2>/dev/null || true
  fi
  stop_process "$AGENT_PID"
  stop_process "$OPERATOR_PID"
  if [ "${GPUBUDGET_E2E_KEEP:-0}" = 1 ]; then
    say "keeping the namespaces, the node, the cluster objects of $RELEASE and $WORK (GPUBUDGET_E2E_KEEP=1)"
  else
    kubectl delete namespace "$NS" "$NS_T" --wait=false --ignore-not-found >/dev/null 2>&1 || true
    kubectl delete node "$NODE" --ignore-not-found >/dev/null 2>&1 || true
    kubectl delete clusterrole,clusterrolebinding "e2e-binder-$ID" --ignore-not-found >/dev/null 2>&1 || true
    delete_release_objects "$RELEASE" validatingwebhookconfiguration,validatingadmissionpolicy,validatingadmissionpolicybinding,clusterrole,clusterrolebinding
    rm -rf "$WORK"
  fi
  if [ "$STARTED_REALK8S" = 1 ]; then bash "$REALK8S/down.sh" >/dev/null 2>&1 || true; fi
  exit "$rc"
}
trap cleanup EXIT

say "control plane, CRDs, the chart (RBAC, admission policies, eviction webhook in URL mode), one node"
info "on: a real kube-apiserver $(kubectl version -o json 2>/dev/null | jq -r .serverVersion.gitVersion) with etcd, no kubelet; binaries: $BIN; this machine: $(nproc) cores, $(uname -sr)"
for ns in "$NS" "$NS_T"; do kubectl create namespace "$ns" >/dev/null; done
kubectl get namespace "$NS_K" >/dev/null 2>&1 || kubectl create namespace "$NS_K" >/dev/null
webhook_cert "$WORK/tls"
apply_crd_and_chart "$RELEASE" "$NS" "ServiceAccount ClusterRole ClusterRoleBinding Role RoleBinding ValidatingAdmissionPolicy \
ValidatingAdmissionPolicyBinding ValidatingWebhookConfiguration" "$WEBHOOK" "$WORK/tls/ca.crt"
kubectl get validatingadmissionpolicy -o name | grep "$RELEASE" | sed 's/^/    /'
for ns in "$NS" "$NS_T"; do wait_for "ServiceAccount default in $ns" kubectl get serviceaccount default -n "$ns"; done
kubectl create -f - >/dev/null <<EOF
apiVersion: v1
kind: Node
metadata: {name: $NODE, labels: {nvidia.com/gpu.present: "true", e2e.gpubudget.io/run: "$ID"}}
EOF
kubectl patch node "$NODE" --subresource=status --type=merge \
  -p '{"status":{"conditions":[{"type":"Ready","status":"True","reason":"KubeletReady","message":"played by the e2e test"}]}}' >/dev/null
kubectl create serviceaccount tenant -n "$NS_T" >/dev/null
kubectl create rolebinding tenant-edit -n "$NS_T" --clusterrole=edit --serviceaccount="$NS_T:tenant" >/dev/null
kubectl get serviceaccount binder -n "$NS_K" >/dev/null 2>&1 || kubectl create serviceaccount binder -n "$NS_K" >/dev/null
kubectl create serviceaccount other-scheduler -n "$NS" >/dev/null
# What a scheduler's binder may do: bind pods, and patch them (KAI's binder writes annotations).
kubectl create clusterrole "e2e-binder-$ID" --verb=create --resource=pods/binding,bindings >/dev/null
kubectl patch clusterrole "e2e-binder-$ID" --type=json \
  -p '[{"op":"add","path":"/rules/-","value":{"apiGroups":[""],"resources":["pods"],"verbs":["get","patch","update"]}}]' >/dev/null
kubectl create clusterrolebinding "e2e-binder-$ID" --clusterrole="e2e-binder-$ID" \
  --serviceaccount="$NS_K:binder" --serviceaccount="$NS:other-scheduler" >/dev/null
token_kubeconfig "$WORK/operator.kubeconfig" operator "$(kubectl create token "$RELEASE-operator" -n "$NS" --duration=2h)"
token_kubeconfig "$WORK/agent.kubeconfig" agent \
  "$(kubectl create token "$RELEASE-agent" -n "$NS" --duration=2h --bound-object-kind Node --bound-object-name "$NODE")"

declare -A PID_OF
NEXT_PID=5100
mkdir -p "$WORK/proc"
running() {
  pod_running "$NS_T" "$1"
  NEXT_PID=$((NEXT_PID + 1))
  fake_process "$WORK/proc" "$NEXT_PID" "$NS_T" "$1"
  PID_OF[$1]=$NEXT_PID
}
# sample [POD=BYTES]...: the GPU's processes. With USED=1 the device's used bytes too (their sum): the pressure
# signal, for step 7 only (steps 1-6 hold more than the card in all, with no pressure meant).
sample() {
  local procs="" kv used=0
  for kv in "$@"; do
    procs+="${procs:+, }{\"pid\": ${PID_OF[${kv%%=*}]}, \"used_bytes\": ${kv#*=}}"
    used=$((used + ${kv#*=}))
  done
  local device=""
  [ "${USED:-0}" = 1 ] && device="\"memory_used_bytes\": $used, "
  cat > "$WORK/sample.tmp" <<EOF
{"version": 1, "gpus": [{"index": 0, "uuid": "GPU-e2e00000-0000-0000-0000-000000000051", "name": "replayed e2e GPU",
 "memory_total_bytes": $((80 * GI)), $device"processes": [$procs]}]}
EOF
  mv "$WORK/sample.tmp" "$WORK/sample.json"
}
sample
share_of() { annotation "$NS_T" "$1" share; }
held() { share_of "$1" | jq -e --argjson l "$2" --arg n "$3" '.limitBytes == $l and .note == $n' >/dev/null; }
recorded() { [ -n "$(annotation "$NS_T" "$1" state)" ]; }
# pod_yaml NAME SCHEDULER NODE ANNOTATIONS LIMITS
pod_yaml() {
  cat <<EOF
apiVersion: v1
kind: Pod
metadata: {name: $1, namespace: $NS_T, labels: {e2e.gpubudget.io/run: "$ID"}, annotations: $4}
spec:
  schedulerName: $2
  ${3:+nodeName: $3}
  containers: [{name: main, image: nvidia/cuda:12.4.1-base-ubuntu22.04, resources: {limits: $5}}]
EOF
}
# server_denied WHO KUBECTL-ARGS...: as `expect denied`, and the refusal is the API server's (RBAC or admission),
# not kubectl's own.
server_denied() {
  expect denied "$@"
  tail -n 3 "$RESULT" | grep -q 'Error from server (Forbidden)' || die "not refused by the API server: kubectl ${*:2}"
}
binding_json() { # POD ANNOTATIONS(json)
  printf '{"apiVersion":"v1","kind":"Binding","metadata":{"name":"%s","namespace":"%s","annotations":%s},"target":{"apiVersion":"v1","kind":"Node","name":"%s"}}' \
    "$1" "$NS_T" "$2" "$NODE"
}

say "the release binaries, out of cluster: the operator (eviction webhook on $WEBHOOK) and the agent (bound to $NODE)"
KUBECONFIG=$WORK/operator.kubeconfig POD_NAMESPACE=$NS POD_NAME=operator-e2e RUST_LOG=info \
  "$BIN/gpubudget-operator" run --admin-addr "$OPERATOR_ADMIN" --webhook-addr "$WEBHOOK" \
  --webhook-cert-dir "$WORK/tls" --mirrors-lease-name "$LEASE" > "$WORK/operator.log" 2>&1 &
OPERATOR_PID=$!
wait_for "operator ready (pid $OPERATOR_PID)" ready "$OPERATOR_ADMIN"
KUBECONFIG=$WORK/agent.kubeconfig RUST_LOG=info "$BIN/gpubudget-agent" run --node-name "$NODE" \
  --proc-root "$WORK/proc" --sample-file "$WORK/sample.json" --interval 250ms --admin-addr "$AGENT_ADMIN" \
  --mirrors-lease "$NS/$LEASE" > "$WORK/agent.log" 2>&1 &
AGENT_PID=$!
wait_for "agent ready (pid $AGENT_PID)" ready "$AGENT_ADMIN"

say "1. the budget: {selector: {}, limit: 80Gi, share: {}, overLimitSeconds: 10}"
kubectl apply -f - <<EOF | sed 's/^/    /'
apiVersion: gpubudget.io/v1alpha1
kind: GpuMemoryBudget
metadata: {name: shares, namespace: $NS_T}
spec: {selector: {}, limit: 80Gi, share: {}, overLimitSeconds: 10}
EOF

say "2. a KAI pod created unbound; who may bind it"
pod_yaml kai kai-scheduler "" '{gpu-fraction: "0.25"}' '{}' > "$WORK/kai.yaml"
expect ok "$TENANT" create -f "$WORK/kai.yaml"
binding_json kai '{}' > "$WORK/bind-plain.json"
binding_json kai '{"gpu-fraction":"1"}' > "$WORK/bind-share.json"
server_denied "$TENANT" create --raw "/api/v1/namespaces/$NS_T/pods/kai/binding" -f "$WORK/bind-plain.json"
server_denied "$TENANT" create --validate=false -f "$WORK/bind-plain.json"
server_denied "$OTHER" create --raw "/api/v1/namespaces/$NS_T/pods/kai/binding" -f "$WORK/bind-share.json"
server_denied "$OTHER" create --validate=false -f "$WORK/bind-share.json"
T0=$(date +%s.%N)
expect ok "$BINDER" create --raw "/api/v1/namespaces/$NS_T/pods/kai/binding" -f "$WORK/bind-plain.json"
[ "$(kubectl get pod kai -n "$NS_T" -o jsonpath='{.spec.nodeName}')" = "$NODE" ] || die "kai is not bound to $NODE"
running kai
sample kai=$((10 * GI))
wait_for "kai held to 20Gi (KAI gpu-fraction 0.25 of 80Gi = 20Gi)" held kai $((20 * GI)) "KAI gpu-fraction 0.25 of 80Gi = 20Gi"
SUMMARY+=("kai bound by KAI's binder → its share recorded by the agent: $(since "$T0")s")

say "3. the tenant on the bound pod: rewrite, removal, num-devices, gpu-memory, through the pod and pods/status"
for t in 1 2 3; do
  T1=$(date +%s.%N)
  server_denied "$TENANT" annotate pod kai -n "$NS_T" gpu-fraction=1 --overwrite
  SUMMARY+=("refused rewrite $t: $(since "$T1")s round trip (kubectl, impersonated)")
done
server_denied "$TENANT" annotate pod kai -n "$NS_T" gpu-fraction-
server_denied "$TENANT" annotate pod kai -n "$NS_T" gpu-fraction-num-devices=8
server_denied "$TENANT" annotate pod kai -n "$NS_T" gpu-memory=81920
server_denied "$TENANT" patch pod kai -n "$NS_T" --type=merge -p '{"metadata":{"annotations":{"gpu-fraction":null,"gpu-memory":"81920"}}}'
server_denied "$TENANT" patch pod kai -n "$NS_T" --subresource=status --type=merge -p '{"metadata":{"annotations":{"gpu-fraction":"1"}}}'
expect ok "$TENANT" label pod kai -n "$NS_T" team=a
[ "$(kubectl get pod kai -n "$NS_T" -o jsonpath='{.metadata.annotations.gpu-fraction}')" = 0.25 ] || die "kai's gpu-fraction changed"
info "ok: kai's gpu-fraction is still 0.25"

say "4. pods created already bound (spec.nodeName): they never passed KAI"
pod_yaml bypass kai-scheduler "$NODE" '{gpu-fraction: "1"}' '{}' > "$WORK/bypass.yaml"
server_denied "$TENANT" create -f "$WORK/bypass.yaml"
pod_yaml bypass-mem kai-scheduler "$NODE" '{gpu-memory: "81920"}' '{}' > "$WORK/bypass-mem.yaml"
server_denied "$TENANT" create -f "$WORK/bypass-mem.yaml"
pod_yaml bypass-n kai-scheduler "$NODE" '{gpu-fraction-num-devices: "4"}' '{}' > "$WORK/bypass-n.yaml"
server_denied "$TENANT" create -f "$WORK/bypass-n.yaml"
pod_yaml bypass-default default-scheduler "$NODE" '{gpu-fraction: "1"}' '{}' > "$WORK/bypass-default.yaml"
expect ok "$TENANT" create -f "$WORK/bypass-default.yaml"
running bypass-default
sample kai=$((10 * GI)) bypass-default=$((30 * GI))
wait_for "bypass-default recorded" recorded bypass-default
sleep 2
[ -z "$(share_of bypass-default)" ] || die "bypass-default got a share: $(share_of bypass-default)"
[ "$(annotation "$NS_T" bypass-default state)" = Within ] || die "bypass-default: $(annotation "$NS_T" bypass-default state)"
info "ok: bypass-default (another scheduler, gpu-fraction 1) at 30Gi: Within under the budget's 80Gi, no gpubudget.io/share"

say "5. HAMi's nvidia.com/gpumem as the API server stores it"
for v in 20000 2e4 3000; do
  name=hami-$(tr -d '+' <<<"$v")
  pod_yaml "$name" hami-scheduler "$NODE" '{}' "{nvidia.com/gpu: \"1\", nvidia.com/gpumem: \"$v\"}" > "$WORK/$name.yaml"
  expect ok "$TENANT" create -f "$WORK/$name.yaml"
  stored=$(kubectl get pod "$name" -n "$NS_T" -o json | jq -r '.spec.containers[0].resources.limits["nvidia.com/gpumem"]')
  info "$name: written $v, stored $stored"
  SUMMARY+=("nvidia.com/gpumem $v stored as $stored")
  running "$name"
done
sample kai=$((10 * GI)) bypass-default=$((30 * GI)) hami-20000=$((19 * GI)) hami-2e4=$((19 * GI)) hami-3000=$((2 * GI))
wait_for "hami-20000 held to 20000 MiB" held hami-20000 $((20000 * MI)) "HAMi gpumem 20000 MiB = 19.5Gi"
wait_for "hami-2e4 held to 20000 MiB" held hami-2e4 $((20000 * MI)) "HAMi gpumem 20000 MiB = 19.5Gi"
wait_for "hami-3000 held to 3000 MiB" held hami-3000 $((3000 * MI)) "HAMi gpumem 3000 MiB = 2.9Gi"
for name in hami-20000 hami-2e4 hami-3000; do info "$name: gpubudget.io/share $(share_of "$name")"; done
T2=$(date +%s.%N)
sample kai=$((10 * GI)) bypass-default=$((30 * GI)) hami-20000=$((20001 * MI)) hami-2e4=$((19 * GI)) hami-3000=$((2 * GI))
T_HAMI=$(timed "GpuMemoryOverBudget on hami-20000 at 20001 MiB" "$T2" has_event "$NS_T" hami-20000 GpuMemoryOverBudget)
MSG=$(event_messages "$NS_T" hami-20000 GpuMemoryOverBudget | tail -n1)
info "hami-20000: $MSG"
[[ "$MSG" == *"HAMi gpumem 20000 MiB = 19.5Gi"* ]] || die "hami-20000's Over message does not name its share: $MSG"
SUMMARY+=("hami-20000 at 20001 MiB → Over event ${T_HAMI}s after the sample")

say "6. the agent's defence in depth: KAI's binder (exempt from the policy) rewrites kai's share to 1"
T3=$(date +%s.%N)
expect ok "$BINDER" annotate pod kai -n "$NS_T" gpu-fraction=1 --overwrite
T_IGN=$(timed "GpuMemoryShareChangeIgnored on kai" "$T3" has_event "$NS_T" kai GpuMemoryShareChangeIgnored)
info "kai: $(events "$NS_T" kai GpuMemoryShareChangeIgnored | jq -r '.[0] | "\(.type) \(.reason): \(.note)"')"
[ "$(events "$NS_T" kai GpuMemoryShareChangeIgnored | jq -r '.[0].type')" = Warning ] || die "not a Warning"
wait_for "kai's record keeps 20Gi and says what it ignored" bash -c \
  "kubectl get pod kai -n $NS_T -o jsonpath='{.metadata.annotations.gpubudget\.io/share}' | jq -e '.limitBytes == $((20 * GI)) and (.ignored | test(\"KAI gpu-fraction 1 of 80Gi\"))'"
info "kai: gpubudget.io/share $(share_of kai)"
SUMMARY+=("exempt rewrite → GpuMemoryShareChangeIgnored ${T_IGN}s")
T4=$(date +%s.%N)
sample kai=$((30 * GI)) bypass-default=$((30 * GI)) hami-20000=$((19 * GI)) hami-2e4=$((19 * GI)) hami-3000=$((2 * GI))
T_OVER=$(timed "GpuMemoryOverBudget on kai at 30Gi" "$T4" has_event "$NS_T" kai GpuMemoryOverBudget)
MSG=$(event_messages "$NS_T" kai GpuMemoryOverBudget | tail -n1)
info "kai: $MSG"
[[ "$MSG" == *"of 20Gi"* ]] || die "kai is not held to 20Gi: $MSG"
wait_for "kai terminating (evicted)" terminating "$NS_T" kai
OVER_AT=$(events "$NS_T" kai GpuMemoryOverBudget | jq -r '.[0].eventTime')
DELETION=$(kubectl get pod kai -n "$NS_T" -o jsonpath='{.metadata.deletionTimestamp}')
GRACE=$(kubectl get pod kai -n "$NS_T" -o jsonpath='{.metadata.deletionGracePeriodSeconds}')
AFTER=$(( $(date -d "$DELETION" +%s) - GRACE - $(date -d "$OVER_AT" +%s) ))
[ "$AFTER" -ge 9 ] || die "kai evicted ${AFTER}s after Over"
info "kai evicted ${AFTER}s after its Over event"
SUMMARY+=("kai at 30Gi (rewritten to 1 by an exempt identity): Over ${T_OVER}s after the sample, evicted ${AFTER}s after Over")
[ "$(event_occurrences "$NS_T" kai GpuMemoryShareChangeIgnored)" = 1 ] || die "GpuMemoryShareChangeIgnored repeated"
info "ok: GpuMemoryShareChangeIgnored told once"

say "7. under pressure after a rewrite: pa and pb at gpu-fraction 0.5, pa's share rewritten to 1 by KAI's binder"
USED=1 sample bypass-default=$((GI))
for p in pa pb; do
  pod_yaml "$p" kai-scheduler "" '{gpu-fraction: "0.5"}' '{}' > "$WORK/$p.yaml"
  expect ok "$TENANT" create -f "$WORK/$p.yaml"
  binding_json "$p" '{}' > "$WORK/bind-$p.json"
  expect ok "$BINDER" create --raw "/api/v1/namespaces/$NS_T/pods/$p/binding" -f "$WORK/bind-$p.json"
  running "$p"
done
USED=1 sample bypass-default=$((GI)) pa=$((10 * GI)) pb=$((10 * GI))
wait_for "pa held to 40Gi (KAI gpu-fraction 0.5 of 80Gi = 40Gi)" held pa $((40 * GI)) "KAI gpu-fraction 0.5 of 80Gi = 40Gi"
wait_for "pb held to 40Gi" held pb $((40 * GI)) "KAI gpu-fraction 0.5 of 80Gi = 40Gi"
expect ok "$BINDER" annotate pod pa -n "$NS_T" gpu-fraction=1 --overwrite
wait_for "GpuMemoryShareChangeIgnored on pa" has_event "$NS_T" pa GpuMemoryShareChangeIgnored
T5=$(date +%s.%N)
USED=1 sample bypass-default=$((GI)) pa=$((50 * GI)) pb=$((28 * GI))
wait_for "pa terminating (relieved)" terminating "$NS_T" pa
T_PRESS=$(since "$T5")
MSG=$(event_messages "$NS_T" pa EvictingForGpuMemory | head -n1)
info "pa: $MSG"
[[ "$MSG" == *"under memory pressure"* ]] || die "pa was not relieved for pressure: $MSG"
terminating "$NS_T" pb && die "pb, within its 0.5, was evicted"
sleep 3
terminating "$NS_T" pb && die "pb, within its 0.5, was evicted"
SUMMARY+=("pa rewritten to 1, at 50 GiB beside pb at 28 GiB (1 GiB free): relieved for pressure, seen terminating ${T_PRESS}s after the sample; pb kept")

say "summary"
for line in "${SUMMARY[@]}"; do info "$line"; done
FAILED=0
say "PASS ($((SECONDS - START)) s)"
