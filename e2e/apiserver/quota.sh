#!/usr/bin/env bash
# Namespace totals (ClusterGpuMemoryQuota, issue 23 part 3) against a real kube-apiserver, no kubelet: the release
# operator as two leader-elected replicas and two release agents (one per node, each with a token bound to its
# Node) writing the records the totals are made of.
#
#   GPUBUDGET_E2E_APISERVER=1 KUBECONFIG=/tmp/realk8s/run/kubeconfig e2e/apiserver/quota.sh [OUT]
#   GPUBUDGET_E2E_APISERVER=1 REALK8S_DIR=/tmp/realk8s e2e/apiserver/quota.sh [OUT]   # starts it (up.sh), stops it
#
# The story, as a tenant would try it:
# - six small pods (1.5Gi each, far within their namespace's 16Gi budget) on two nodes: 9Gi of the namespace's
#   10Gi quota, Near; then each grows to 2Gi: 12Gi, Over, though no pod is over its own budget;
# - the leader is killed (SIGKILL, no hand-over) 3 s into the 10 s period; the other replica takes the Lease
#   and evicts, once, the pod that started last (on the other node from the one created last), with the
#   quota's grace, through the Eviction API, after the period: not restarted by the leader change, not repeated;
# - the other five stay; a namespace the quota does not select holds more and keeps all its pods;
# - `kubectl get cgmq` and the quota's status show the total, the state and the top holders.
# The test plays the kubelet (pod status with start times, /proc, deleting a pod once evicted) and NVML (one
# sample file per node). OUT (optional) receives a copy of the output.
#
# Environment: as e2e/lib.sh says (GPUBUDGET_E2E_BIN, HELM, GPUBUDGET_E2E_STEP_TIMEOUT, GPUBUDGET_E2E_KEEP, REALK8S).
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
REPO=$(cd "$HERE/../.." && pwd)
REALK8S=${REALK8S:-/work/shared/realk8s}
if [ -n "${1:-}" ] && [ -z "${QUOTA_TEE:-}" ]; then
  QUOTA_TEE=1 exec > >(tee "$1") 2>&1
fi

# shellcheck source=../lib.sh
. "$REPO/e2e/lib.sh"
control_plane_or_skip "namespace totals" gpubudget-agent gpubudget-operator
STEP_TIMEOUT=${GPUBUDGET_E2E_STEP_TIMEOUT:-60}
POLL=0.5
GI=1073741824

ID=$(date +%s | tail -c 5)$RANDOM
ID=${ID:0:7}
NS=gpubudget-quota-$ID            # the release's namespace (its ServiceAccounts, the Lease)
NS_Q=gpubudget-quota-$ID-q        # selected by the quota: six pods on two nodes
NS_R=gpubudget-quota-$ID-r        # not selected: holds more, keeps everything
NODES=("gpubudget-quota-$ID-n1" "gpubudget-quota-$ID-n2")
RELEASE=gpubudget-quota-$ID
QUOTA=gpubudget-quota-$ID
WORK=$(mktemp -d "${TMPDIR:-/tmp}/gpubudget-quota.XXXXXX")
PORT_BASE=$((20000 + RANDOM % 20000))
PIDS=()
FAILED=1
START=$SECONDS

cleanup() {
  local rc=$?
  if [ "$FAILED" != 0 ]; then
    say "diagnostics"
    kubectl get pods -n "$NS_Q" -o wide || true
    kubectl get cgmq "$QUOTA" -o yaml || true
    for f in "$WORK"/operator-*.log; do echo "--- $f (last 40 lines)"; tail -n 40 "$f" 2>/dev/null || true; done
    for f in "$WORK"/agent-*.log; do echo "--- $f (last 20 lines)"; tail -n 20 "$f" 2>/dev/null || true; done
  fi
  for pid in "${PIDS[@]}"; do stop_process "$pid"; done
  if [ "${GPUBUDGET_E2E_KEEP:-0}" = 1 ]; then
    say "keeping the namespaces, nodes, the quota, the cluster objects of $RELEASE and $WORK (GPUBUDGET_E2E_KEEP=1)"
  else
    kubectl delete cgmq "$QUOTA" --ignore-not-found >/dev/null 2>&1 || true
    kubectl delete namespace "$NS" "$NS_Q" "$NS_R" --wait=false --ignore-not-found >/dev/null 2>&1 || true
    kubectl delete node "${NODES[@]}" --ignore-not-found >/dev/null 2>&1 || true
    delete_release_objects "$RELEASE"
    rm -rf "$WORK"
  fi
  if [ "$STARTED_REALK8S" = 1 ]; then bash "$REALK8S/down.sh" >/dev/null 2>&1 || true; fi
  exit "$rc"
}
trap cleanup EXIT

say "control plane, CRDs, the chart's RBAC and admission policies"
kubectl version 2>/dev/null | sed 's/^/    /'
info "helm: $("$HELM" version --short)  binaries: $BIN  run id: $ID  work: $WORK"
kubectl create namespace "$NS" >/dev/null
kubectl create namespace "$NS_Q" >/dev/null
kubectl create namespace "$NS_R" >/dev/null
apply_crd_and_chart "$RELEASE" "$NS" "ServiceAccount ClusterRole ClusterRoleBinding Role RoleBinding ValidatingAdmissionPolicy ValidatingAdmissionPolicyBinding"
for ns in "$NS" "$NS_Q" "$NS_R"; do
  wait_for "ServiceAccount default in $ns" kubectl get serviceaccount default -n "$ns"
done
for n in "${NODES[@]}"; do
  kubectl create -f - >/dev/null <<EOF
apiVersion: v1
kind: Node
metadata: {name: $n, labels: {nvidia.com/gpu.present: "true", e2e.gpubudget.io/run: "$ID"}}
EOF
done
# Each namespace has a budget far above any pod's usage: records are written, nothing is over its own budget.
for ns in "$NS_Q" "$NS_R"; do
  kubectl apply -f - >/dev/null <<EOF
apiVersion: gpubudget.io/v1alpha1
kind: GpuMemoryBudget
metadata: {name: per-pod, namespace: $ns}
spec: {selector: {}, limit: 16Gi}
EOF
done
kubectl label namespace "$NS_Q" "e2e.gpubudget.io/quota=$ID" >/dev/null
kubectl apply -f - <<EOF | sed 's/^/    /'
apiVersion: gpubudget.io/v1alpha1
kind: ClusterGpuMemoryQuota
metadata: {name: $QUOTA}
spec:
  namespaceSelector: {matchLabels: {e2e.gpubudget.io/quota: "$ID"}}
  limit: 10Gi
  warnAtPercent: 80
  overLimitSeconds: 10
  evictionGracePeriodSeconds: 7
EOF

say "pods (API objects; the test is their kubelet): six in $NS_Q on two nodes, two in $NS_R"
T0=$(date -u +%s)
# make_pod NAMESPACE NAME NODE START_OFFSET_S: a running pod whose status.startTime is T0 - 600 + offset.
make_pod() {
  kubectl create -f - >/dev/null <<EOF
apiVersion: v1
kind: Pod
metadata: {name: $2, namespace: $1, labels: {e2e.gpubudget.io/run: "$ID"}}
spec:
  nodeName: $3
  terminationGracePeriodSeconds: 60
  containers: [{name: main, image: registry.k8s.io/pause:3.10}]
EOF
  pod_running "$1" "$2" "$(date -u -d "@$((T0 - 600 + $4))" +%Y-%m-%dT%H:%M:%SZ)"
}
# Created q-1 … q-6 in that order, but q-4 (on the second node) started last: the start time decides.
N1=${NODES[0]} N2=${NODES[1]}
make_pod "$NS_Q" q-1 "$N1" 10;  make_pod "$NS_Q" q-2 "$N2" 20;  make_pod "$NS_Q" q-3 "$N1" 30
make_pod "$NS_Q" q-4 "$N2" 90;  make_pod "$NS_Q" q-5 "$N1" 50;  make_pod "$NS_Q" q-6 "$N2" 60
make_pod "$NS_R" r-1 "$N1" 70;  make_pod "$NS_R" r-2 "$N2" 80
# Processes: PIDs 5101… in /proc of the pod's node.
declare -A PID_OF NODE_OF
pid=5100
for pod in q-1 q-2 q-3 q-4 q-5 q-6 r-1 r-2; do
  pid=$((pid + 1))
  ns=$NS_Q; [[ $pod == r-* ]] && ns=$NS_R
  node=$(kubectl get pod "$pod" -n "$ns" -o jsonpath='{.spec.nodeName}')
  fake_process "$WORK/proc-$node" "$pid" "$ns" "$pod"
  PID_OF[$pod]=$pid NODE_OF[$pod]=$node
done

# sample Q_BYTES R_BYTES [GONE_POD]: every q pod holds Q_BYTES, every r pod R_BYTES (GONE_POD's process exited),
# written atomically into each node's sample file, as NVML would report it.
sample() {
  local node pod procs
  for node in "${NODES[@]}"; do
    procs=""
    for pod in q-1 q-2 q-3 q-4 q-5 q-6 r-1 r-2; do
      [ "${NODE_OF[$pod]}" = "$node" ] && [ "$pod" != "${3:-}" ] || continue
      local bytes=$1; [[ $pod == r-* ]] && bytes=$2
      procs+="${procs:+, }{\"pid\": ${PID_OF[$pod]}, \"used_bytes\": $bytes}"
    done
    cat > "$WORK/sample-$node.tmp" <<EOF
{"version": 1, "gpus": [{"index": 0, "uuid": "GPU-e2e00000-0000-0000-0000-00000000000${node: -1}", "name": "replayed e2e GPU",
 "memory_total_bytes": 85520809984, "processes": [$procs]}]}
EOF
    mv "$WORK/sample-$node.tmp" "$WORK/sample-$node.json"
  done
}
sample $((3 * GI / 2)) $((8 * GI))

say "two agents, one per node (tokens bound to their Node), and two operator replicas (leader election)"
webhook_cert "$WORK/tls"
OPERATOR_KC=$WORK/operator.kubeconfig
token_kubeconfig "$OPERATOR_KC" operator "$(kubectl create token "$RELEASE-operator" -n "$NS" --duration=1h)"
i=0
for node in "${NODES[@]}"; do
  i=$((i + 1))
  token_kubeconfig "$WORK/agent-$i.kubeconfig" "agent-$i" \
    "$(kubectl create token "$RELEASE-agent" -n "$NS" --duration=1h --bound-object-kind Node --bound-object-name "$node")"
  KUBECONFIG=$WORK/agent-$i.kubeconfig RUST_LOG=info "$BIN/gpubudget-agent" run --node-name "$node" \
    --proc-root "$WORK/proc-$node" --sample-file "$WORK/sample-$node.json" --interval 250ms \
    --admin-addr "127.0.0.1:$((PORT_BASE + i))" > "$WORK/agent-$i.log" 2>&1 &
  PIDS+=($!)
done
declare -A OP_PID OP_ADMIN
k=0
for r in a b; do
  k=$((k + 1))
  OP_ADMIN[$r]=127.0.0.1:$((PORT_BASE + 10 + k * 2))
  KUBECONFIG=$OPERATOR_KC POD_NAMESPACE=$NS POD_NAME=operator-$r RUST_LOG=info \
    "$BIN/gpubudget-operator" run --leader-election --admin-addr "${OP_ADMIN[$r]}" \
    --webhook-addr "127.0.0.1:$((PORT_BASE + 11 + k * 2))" --webhook-cert-dir "$WORK/tls" \
    > "$WORK/operator-$r.log" 2>&1 &
  OP_PID[$r]=$!
  PIDS+=($!)
done
for i in 1 2; do wait_for "agent $i ready" ready "127.0.0.1:$((PORT_BASE + i))"; done
holder() { kubectl get lease gpubudget-operator -n "$NS" -o jsonpath='{.spec.holderIdentity}' 2>/dev/null; }
has_holder() { [ -n "$(holder)" ]; }
holder_is() { [ "$(holder)" = "$1" ]; }
wait_for "a leader" has_holder
info "leader: $(holder)"

quota_ns() { kubectl get cgmq "$QUOTA" -o json | jq -r --arg ns "$1" ".status.namespaces[]? | select(.namespace == \$ns) | $2"; }
quota_ns_is() { [ "$(quota_ns "$1" "$2")" = "$3" ]; }
recorded() { [ -n "$(annotation "$NS_Q" "$1" usage-bytes)" ]; }
for pod in q-1 q-2 q-3 q-4 q-5 q-6; do wait_for "$pod recorded" recorded "$pod"; done

say "Near: six pods × 1.5Gi = 9Gi of the namespace's 10Gi (each within its own 16Gi budget)"
wait_for "the quota's status: $NS_Q Near at 9Gi" quota_ns_is "$NS_Q" '"\(.state) \(.total)"' "Near 9Gi"
[ -z "$(quota_ns "$NS_R" .state)" ] || die "$NS_R (not selected) is in the quota's status"
wait_for "NamespaceGpuMemoryNear on the quota" bash -c \
  "kubectl get events.v1.events.k8s.io -A -o json | jq -e --arg q '$QUOTA' '[.items[] | select(.regarding.name == \$q and .reason == \"NamespaceGpuMemoryNear\")] | length > 0' >/dev/null"

say "Over: each pod grows to 2Gi: 12Gi of 10Gi; no pod is over its own budget"
GREW_AT=$SECONDS
sample $((2 * GI)) $((8 * GI))
# The totals are the agents' records: a usage change within a state is rewritten at most every
# --usage-write-interval (30 s by default), so the namespace is seen over up to that late.
STEP_TIMEOUT=$((STEP_TIMEOUT + 30)) wait_for "the quota's status: $NS_Q Over at 12Gi" quota_ns_is "$NS_Q" '"\(.state) \(.total)"' "Over 12Gi"
OVER_AT=$SECONDS
info "seen over $((OVER_AT - GREW_AT)) s after the pods grew (records rewritten for usage at most every 30 s, a pass every 5 s)"
kubectl get cgmq "$QUOTA" > "$WORK/cgmq.txt"
sed 's/^/    /' "$WORK/cgmq.txt"
HEADER=$(head -n1 "$WORK/cgmq.txt" | tr -s ' ')
[ "$HEADER" = "NAME LIMIT ACTION NAMESPACES OVER EVICTED AGE" ] || die "kubectl get cgmq columns: $HEADER"
info "top holders: $(quota_ns "$NS_Q" '[.topPods[] | "\(.name)@\(.node // "?")"] | join(" ")')"

say "the leader is killed 3 s into the period (SIGKILL: no hand-over; its Lease runs out after 15 s)"
sleep 3
LEADER=$(holder)
SURVIVOR=operator-a; [ "$LEADER" = operator-a ] && SURVIVOR=operator-b
kill -KILL "${OP_PID[${LEADER#operator-}]}"
KILLED_AT=$SECONDS
info "killed $LEADER; $SURVIVOR waits for the Lease"
terminating "$NS_Q" q-4 && die "q-4 evicted before the period was over"
wait_for "the Lease moves to $SURVIVOR" holder_is "$SURVIVOR"
info "Lease held by $SURVIVOR $((SECONDS - KILLED_AT)) s after the kill"
STEP_TIMEOUT=$((STEP_TIMEOUT + 30)) wait_for "q-4 (started last, on $N2) terminating" terminating "$NS_Q" q-4
EVICTED_AFTER=$((SECONDS - OVER_AT))
[ "$EVICTED_AFTER" -ge 10 ] || die "q-4 evicted ${EVICTED_AFTER}s after the namespace went over, before overLimitSeconds (10 s)"
GRACE=$(kubectl get pod q-4 -n "$NS_Q" -o jsonpath='{.metadata.deletionGracePeriodSeconds}')
[ "$GRACE" = 7 ] || die "q-4's grace is $GRACE, not the quota's 7 (the pod's own is 60)"
info "q-4 evicted ${EVICTED_AFTER}s after the namespace went over (the leader killed 3 s in), grace $GRACE"
wait_for "NamespaceGpuMemoryEvicting on q-4" has_event "$NS_Q" q-4 NamespaceGpuMemoryEvicting
info "q-4: $(event_messages "$NS_Q" q-4 NamespaceGpuMemoryEvicting | head -n1 | cut -c1-220)"

say "one eviction, one pod: the others and the namespace the quota does not select keep theirs"
sleep 6   # more than one pass (5 s) of the new leader with q-4 going
for pod in q-1 q-2 q-3 q-5 q-6; do terminating "$NS_Q" "$pod" && die "$pod evicted too"; done
for pod in r-1 r-2; do terminating "$NS_R" "$pod" && die "$pod ($NS_R, 16Gi, not selected) evicted"; done
[ "$(event_occurrences "$NS_Q" q-4 NamespaceGpuMemoryEvicting)" = 1 ] \
  || die "NamespaceGpuMemoryEvicting on q-4: $(events "$NS_Q" q-4 NamespaceGpuMemoryEvicting)"
REQUESTS=$(curl -fsS "http://${OP_ADMIN[${SURVIVOR#operator-}]}/metrics" \
  | awk '/^gpubudget_operator_quota_eviction_requests_total/ {s += $2} END {print s + 0}')
[ "$REQUESTS" = 1 ] || die "$SURVIVOR asked for $REQUESTS evictions"
info "$SURVIVOR asked for 1 eviction; $(grep -c "evict" "$WORK/operator-${LEADER#operator-}.log" || true) log lines of $LEADER mention an eviction"

say "the kubelet's part: q-4's process exits, the pod is deleted; 10Gi left, at the limit: nothing more goes"
sample $((2 * GI)) $((8 * GI)) q-4
rm -rf "$WORK/proc-$N2/${PID_OF[q-4]}"
kubectl delete pod q-4 -n "$NS_Q" --grace-period=0 --force >/dev/null 2>&1
quota_field_is() { [ "$(kubectl get cgmq "$QUOTA" -o "jsonpath={.status.$1}")" = "$2" ]; }
# At the limit is not over it (no time banked); the state keeps Over until the total is below the limit less
# the hysteresis, as for one pod.
wait_for "the quota's status: $NS_Q at 10Gi, 5 pods, not over the limit" quota_ns_is "$NS_Q" '"\(.total) \(.pods) \(.lastOver)"' "10Gi 5 false"
wait_for "the quota counts one eviction" quota_field_is evictions 1
kubectl get cgmq "$QUOTA" | sed 's/^/    /'
info "$NS_Q: $(quota_ns "$NS_Q" '"\(.state) \(.total) of \(.limit), \(.pods) pods, \(.overMillis) ms over banked"')"
sleep 12   # longer than overLimitSeconds
for pod in q-1 q-2 q-3 q-5 q-6; do terminating "$NS_Q" "$pod" && die "$pod evicted after the namespace was back within"; done

FAILED=0
say "PASS: a namespace total reached by six small pods on two nodes, the leader killed mid-period: one eviction (the latest start) by the new leader after the period, with the quota's grace; neighbours and an unselected namespace untouched ($((SECONDS - START)) s)"
