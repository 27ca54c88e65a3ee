#!/usr/bin/env bash
# Budget mirrors turned off, and the operator gone, against a real kube-apiserver, no kubelet (issue 43, item 2):
# the operator (out of cluster, its ServiceAccount's token, POD_NAMESPACE the release's, no leader election as
# the core stories of e2e/tests/apiserver run it) keeps the mirrors' Lease; the agent (token bound to its Node)
# runs with `--mirrors-lease`.
#
#   GPUBUDGET_E2E_APISERVER=1 KUBECONFIG=/tmp/realk8s/run/kubeconfig e2e/apiserver/mirrors-off.sh [OUT]
#   GPUBUDGET_E2E_APISERVER=1 REALK8S_DIR=/tmp/realk8s e2e/apiserver/mirrors-off.sh [OUT]   # starts it, stops it
#
# 1. Mirrors on: budget `a` (16Gi) over pod pa (10 GiB, Within); the agent reads the mirrors
#    (gpubudget_budget_specs_from_mirrors{kind="GpuMemoryBudget"} 1), the Lease is renewed; `a`'s status says
#    enforcedGeneration and NodesCurrent True/MirrorCurrent.
# 2. The operator restarted with `--budget-mirrors=false` (what `helm upgrade --set operator.budgetMirrors=false`
#    does: the operator restarted, the agents not): the Lease deleted, the agent's gauge 0 and a Warning
#    GpuBudgetMirrorsNotCurrent on its Node, timed; every mirror then deleted by hand.
# 3. A new budget `b` (4Gi) over pod pb (10 GiB, no budget before), and `a` tightened to 4Gi: the time to
#    GpuMemoryOverBudget on each; `a`'s status: enforcedGeneration its generation, NodesCurrent True/ReadDirectly;
#    the eviction events name the generation they acted under.
# 4. Mirrors on again, then the operator killed (SIGKILL: nothing deletes the Lease) and budget `c` (16Gi over pod
#    pc at 10 GiB) tightened to 4Gi while its mirror still says 16Gi: the time until the agent goes back to the
#    budgets (the Lease no longer renewed under its eyes) and enforces the edit.
# The test plays the kubelet (pod status, /proc) and NVML (a sample file). OUT (optional) receives a copy of
# the output.
#
# Environment: as e2e/lib.sh says (GPUBUDGET_E2E_BIN, HELM, GPUBUDGET_E2E_STEP_TIMEOUT, GPUBUDGET_E2E_KEEP, REALK8S).
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
REPO=$(cd "$HERE/../.." && pwd)
REALK8S=${REALK8S:-/work/shared/realk8s}
if [ -n "${1:-}" ] && [ -z "${MIRRORS_OFF_TEE:-}" ]; then
  MIRRORS_OFF_TEE=1 exec > >(tee "$1") 2>&1
fi

# shellcheck source=../lib.sh
. "$REPO/e2e/lib.sh"
control_plane_or_skip "budget mirrors off" gpubudget-agent gpubudget-operator
STEP_TIMEOUT=${GPUBUDGET_E2E_STEP_TIMEOUT:-60}
POLL=0.5
GI=1073741824

ID=$(date +%s | tail -c 5)$RANDOM
ID=${ID:0:7}
NS=gpubudget-mo-$ID                 # the release's namespace (its ServiceAccounts, the Leases)
NS_A=gpubudget-mo-$ID-a             # the budgets and pods
NODE=gpubudget-mo-$ID-n1
RELEASE=gpubudget-mo-$ID
LEASE=$RELEASE-operator-mirrors     # the chart's name: <operator fullname>-mirrors
WORK=$(mktemp -d "${TMPDIR:-/tmp}/gpubudget-mirrors-off.XXXXXX")
PORT_BASE=$((20000 + RANDOM % 20000))
AGENT_ADMIN=127.0.0.1:$PORT_BASE
OPERATOR_ADMIN=127.0.0.1:$((PORT_BASE + 1))
AGENT_PID="" OPERATOR_PID=""
FAILED=1
START=$SECONDS
SUMMARY=()

cleanup() {
  local rc=$?
  if [ "$FAILED" != 0 ]; then
    say "diagnostics"
    kubectl get pods,gmb,gmbmirror -n "$NS_A" -o wide || true
    kubectl get lease -n "$NS" -o yaml || true
    echo "--- operator log (last 40 lines)"; tail -n 40 "$WORK/operator.log" 2>/dev/null || true
    echo "--- agent log (last 80 lines)"; tail -n 80 "$WORK/agent.log" 2>/dev/null || true
  fi
  stop_process "$AGENT_PID"
  stop_process "$OPERATOR_PID"
  if [ "${GPUBUDGET_E2E_KEEP:-0}" = 1 ]; then
    say "keeping the namespaces, the node and $WORK (GPUBUDGET_E2E_KEEP=1)"
  else
    kubectl delete namespace "$NS" "$NS_A" --wait=false --ignore-not-found >/dev/null 2>&1 || true
    kubectl delete node "$NODE" --ignore-not-found >/dev/null 2>&1 || true
    delete_release_objects "$RELEASE"
    rm -rf "$WORK"
  fi
  if [ "$STARTED_REALK8S" = 1 ]; then bash "$REALK8S/down.sh" >/dev/null 2>&1 || true; fi
  exit "$rc"
}
trap cleanup EXIT

say "control plane, CRDs, the chart's RBAC (its mirrors Roles included) and admission policies, one node"
kubectl version 2>/dev/null | sed 's/^/    /'
info "helm: $("$HELM" version --short)  binaries: $BIN  run id: $ID  work: $WORK"
for ns in "$NS" "$NS_A"; do kubectl create namespace "$ns" >/dev/null; done
apply_crd_and_chart "$RELEASE" "$NS" "ServiceAccount ClusterRole ClusterRoleBinding Role RoleBinding ValidatingAdmissionPolicy ValidatingAdmissionPolicyBinding"
kubectl get role,rolebinding -n "$NS" -o name | sed 's/^/    /'
kubectl get role "$RELEASE-operator-mirrors" "$RELEASE-agent-mirrors" -n "$NS" >/dev/null || die "the chart's mirrors Roles were not applied"
for ns in "$NS" "$NS_A"; do wait_for "ServiceAccount default in $ns" kubectl get serviceaccount default -n "$ns"; done
kubectl create -f - >/dev/null <<EOF
apiVersion: v1
kind: Node
metadata: {name: $NODE, labels: {nvidia.com/gpu.present: "true", e2e.gpubudget.io/run: "$ID"}}
EOF

declare -A PID_OF
NEXT_PID=8100
make_pod() { # NAME: a running pod labelled app=NAME, with its process in the fixture /proc
  kubectl create -f - >/dev/null <<EOF
apiVersion: v1
kind: Pod
metadata: {name: $1, namespace: $NS_A, labels: {e2e.gpubudget.io/run: "$ID", app: $1}}
spec:
  nodeName: $NODE
  terminationGracePeriodSeconds: 30
  containers: [{name: main, image: registry.k8s.io/pause:3.10}]
EOF
  pod_running "$NS_A" "$1"
  NEXT_PID=$((NEXT_PID + 1))
  fake_process "$WORK/proc" "$NEXT_PID" "$NS_A" "$1"
  PID_OF[$1]=$NEXT_PID
}
sample() { # [POD=BYTES]...: the GPU's processes (80 GiB GPU, no pressure at these figures)
  local procs="" kv used=0
  for kv in "$@"; do
    procs+="${procs:+, }{\"pid\": ${PID_OF[${kv%%=*}]}, \"used_bytes\": ${kv#*=}}"
    used=$((used + ${kv#*=}))
  done
  cat > "$WORK/sample.tmp" <<EOF
{"version": 1, "gpus": [{"index": 0, "uuid": "GPU-e2e00000-0000-0000-0000-000000000143", "name": "replayed e2e GPU",
 "memory_total_bytes": 85899345920, "memory_used_bytes": $used, "processes": [$procs]}]}
EOF
  mv "$WORK/sample.tmp" "$WORK/sample.json"
}
mkdir -p "$WORK/proc"
make_pod pa
make_pod pb
sample pa=$((10 * GI)) pb=$((10 * GI))

token_kubeconfig "$WORK/operator.kubeconfig" operator "$(kubectl create token "$RELEASE-operator" -n "$NS" --duration=2h)"
token_kubeconfig "$WORK/agent.kubeconfig" agent \
  "$(kubectl create token "$RELEASE-agent" -n "$NS" --duration=2h --bound-object-kind Node --bound-object-name "$NODE")"
OPERATOR_RUNS=0
start_operator() { # [--budget-mirrors=false]
  OPERATOR_RUNS=$((OPERATOR_RUNS + 1))
  echo "=== operator run $OPERATOR_RUNS: $*" >> "$WORK/operator.log"
  KUBECONFIG=$WORK/operator.kubeconfig POD_NAMESPACE=$NS POD_NAME=operator-e2e RUST_LOG=info \
    "$BIN/gpubudget-operator" run --admin-addr "$OPERATOR_ADMIN" --mirrors-lease-name "$LEASE" "$@" \
    >> "$WORK/operator.log" 2>&1 &
  OPERATOR_PID=$!
  wait_for "operator ready (pid $OPERATOR_PID${1:+, $1})" ready "$OPERATOR_ADMIN"
}

gauge() { curl -fsS "http://$AGENT_ADMIN/metrics" | awk '/^gpubudget_budget_specs_from_mirrors\{kind="GpuMemoryBudget"\}/ {print $2}'; }
gauge_is() { [ "$(gauge)" = "$1" ]; }
lease_renew() { kubectl get lease "$LEASE" -n "$NS" -o jsonpath='{.spec.renewTime}' 2>/dev/null; }
lease_gone() { ! kubectl get lease "$LEASE" -n "$NS" >/dev/null 2>&1; }
lease_there() { kubectl get lease "$LEASE" -n "$NS" >/dev/null 2>&1; }
node_events() { # REASON: the Node's events.k8s.io Events with that reason, one line each: occurrences (a repeat is
  # counted into the first event's series, which keeps its first note), last seen, note
  kubectl get events.v1.events.k8s.io -A -o json \
    | jq -r --arg node "$NODE" --arg reason "$1" '.items[] | select(.regarding.kind == "Node" and .regarding.name == $node and .reason == $reason)
        | "\(.series.count // 1) \(.series.lastObservedTime // .eventTime) \(.note)"'
}
node_event_count() { node_events "$1" | awk '{n += $1} END {print n + 0}'; }
node_event_more() { [ "$(node_event_count "$1")" -gt "$2" ]; }
condition() { # BUDGET: NodesCurrent's status/reason
  kubectl get gmb "$1" -n "$NS_A" -o jsonpath='{.status.conditions[?(@.type=="NodesCurrent")].status}/{.status.conditions[?(@.type=="NodesCurrent")].reason}'
}
condition_message() { kubectl get gmb "$1" -n "$NS_A" -o jsonpath='{.status.conditions[?(@.type=="NodesCurrent")].message}'; }
generation() { kubectl get gmb "$1" -n "$NS_A" -o jsonpath='{.metadata.generation}'; }
enforced() { kubectl get gmb "$1" -n "$NS_A" -o jsonpath='{.status.enforcedGeneration}'; }
status_says() { # BUDGET STATUS/REASON: enforcedGeneration is the generation and NodesCurrent says STATUS/REASON
  [ "$(enforced "$1")" = "$(generation "$1")" ] && [ "$(condition "$1")" = "$2" ]
}
# since and timed: e2e/lib.sh.
show_status() { # BUDGET
  info "gmb $1: generation $(generation "$1"), status.enforcedGeneration $(enforced "$1"), NodesCurrent $(condition "$1"): $(condition_message "$1")"
}

say "1. mirrors on: the operator (--mirrors-lease-name $LEASE) and the agent (--mirrors-lease $NS/$LEASE)"
start_operator
KUBECONFIG=$WORK/agent.kubeconfig RUST_LOG=info "$BIN/gpubudget-agent" run --node-name "$NODE" \
  --proc-root "$WORK/proc" --sample-file "$WORK/sample.json" --interval 250ms --admin-addr "$AGENT_ADMIN" \
  --mirrors-lease "$NS/$LEASE" > "$WORK/agent.log" 2>&1 &
AGENT_PID=$!
wait_for "agent ready (pid $AGENT_PID)" ready "$AGENT_ADMIN"
kubectl apply -f - <<EOF | sed 's/^/    /'
apiVersion: gpubudget.io/v1alpha1
kind: GpuMemoryBudget
metadata: {name: a, namespace: $NS_A}
spec: {selector: {matchLabels: {app: pa}}, limit: 16Gi}
EOF
wait_for "gmbmirror a written" kubectl get gmbmirror a -n "$NS_A"
wait_for "the Lease $NS/$LEASE renewed" lease_there
wait_for "the agent reads the mirrors (gauge 1)" gauge_is 1
wait_for "pa recorded Within under a" bash -c "[ \"\$(kubectl get pod pa -n $NS_A -o jsonpath='{.metadata.annotations.gpubudget\.io/state}/{.metadata.annotations.gpubudget\.io/budget}')\" = Within/a ]"
wait_for "a's status: enforcedGeneration its generation, NodesCurrent True/MirrorCurrent" status_says a True/MirrorCurrent
kubectl get lease "$LEASE" -n "$NS" -o jsonpath='{.spec}' | sed 's/^/    lease spec: /'; echo
show_status a
info "kubectl get gmb a -o jsonpath={.status.enforcedGeneration}: $(enforced a)"
R1=$(lease_renew); sleep 11; R2=$(lease_renew)
[ "$R1" != "$R2" ] || die "the Lease was not renewed in 11 s ($R1)"
info "renewTime $R1 → $R2 (every 10 s)"
NOT_CURRENT_BEFORE=$(node_event_count GpuBudgetMirrorsNotCurrent)
info "GpuBudgetMirrorsNotCurrent on the Node so far: $NOT_CURRENT_BEFORE"

say "2. the operator restarted with --budget-mirrors=false (helm upgrade --set operator.budgetMirrors=false); the agent not"
STOPPED=$(date +%s.%N)
stop_process "$OPERATOR_PID"
info "operator stopped (SIGTERM) in $(since "$STOPPED")s; the Lease is $(lease_there && echo 'still there' || echo gone)"
RESTARTED=$(date +%s.%N)
start_operator --budget-mirrors=false
T_LEASE=$(timed "the Lease deleted (since the new operator started)" "$RESTARTED" lease_gone)
T_GAUGE=$(timed "the agent's gauge 0 (since the new operator started)" "$RESTARTED" gauge_is 0)
T_EVENT=$(timed "GpuBudgetMirrorsNotCurrent on the Node (since the new operator started)" "$RESTARTED" \
  node_event_more GpuBudgetMirrorsNotCurrent "$NOT_CURRENT_BEFORE")
info "since the old operator stopped: gauge 0 by $(since "$STOPPED")s at the latest"
node_events GpuBudgetMirrorsNotCurrent | sed 's/^/    GpuBudgetMirrorsNotCurrent (occurrences, last seen, note): /'
grep "not vouching for the mirrors" "$WORK/operator.log" | tail -n1 | sed 's/\x1b\[[0-9;]*m//g' | cut -c1-300 | sed 's/^/    operator: /'
SUMMARY+=("mirrors off (operator restarted with --budget-mirrors=false): Lease deleted ${T_LEASE}s, agent gauge 0 ${T_GAUGE}s, Node event ${T_EVENT}s after the new operator started")
wait_for "a's status: NodesCurrent True/ReadDirectly" status_says a True/ReadDirectly
show_status a
info "every mirror deleted by hand: kubectl delete gmbmirror -A --all; kubectl delete cgmbmirror --all"
kubectl get gmbmirror -A --no-headers 2>/dev/null | sed 's/^/    before: /'
kubectl delete gmbmirror -A --all | sed 's/^/    /'
kubectl delete cgmbmirror --all | sed 's/^/    /'
sleep 2
gauge_is 0 || die "the agent reads the mirrors again: gauge $(gauge)"

say "3. budget b (4Gi) over pb at 10 GiB, and a tightened from 16Gi to 4Gi: read from the budgets themselves"
EDITED=$(date +%s.%N)
kubectl apply -f - <<EOF | sed 's/^/    /'
apiVersion: gpubudget.io/v1alpha1
kind: GpuMemoryBudget
metadata: {name: b, namespace: $NS_A}
spec: {selector: {matchLabels: {app: pb}}, limit: 4Gi}
EOF
kubectl patch gmb a -n "$NS_A" --type=merge -p '{"spec":{"limit":"4Gi"}}' | sed 's/^/    /'
T_B=$(timed "GpuMemoryOverBudget on pb (new budget b)" "$EDITED" has_event "$NS_A" pb GpuMemoryOverBudget)
T_A=$(timed "GpuMemoryOverBudget on pa (a tightened)" "$EDITED" has_event "$NS_A" pa GpuMemoryOverBudget)
SUMMARY+=("mirrors off, every mirror deleted: GpuMemoryOverBudget ${T_B}s after budget b was created (pb), ${T_A}s after a was tightened (pa)")
for pod in pa pb; do info "$pod: $(event_messages "$NS_A" "$pod" GpuMemoryOverBudget | head -n1)"; done
gmbmirror_left=$(kubectl get gmbmirror -n "$NS_A" --no-headers 2>/dev/null | wc -l)
info "gmbmirrors in $NS_A now: $gmbmirror_left (mirrors off: none written)"
wait_for "a's status after the edit: enforcedGeneration $(generation a), NodesCurrent True/ReadDirectly" status_says a True/ReadDirectly
show_status a
wait_for "b's status: NodesCurrent True/ReadDirectly" status_says b True/ReadDirectly
show_status b
wait_for "EvictingForGpuMemory on pa (overLimitSeconds 10)" has_event "$NS_A" pa EvictingForGpuMemory
EVICTING=$(event_messages "$NS_A" pa EvictingForGpuMemory | head -n1)
info "pa: $EVICTING"
[[ "$EVICTING" == *"; under generation $(generation a) of budget $NS_A/a" ]] \
  || die "the eviction does not name generation $(generation a) of $NS_A/a: $EVICTING"
wait_for "EvictingForGpuMemory on pb" has_event "$NS_A" pb EvictingForGpuMemory
info "pb: $(event_messages "$NS_A" pb EvictingForGpuMemory | head -n1)"
# The kubelet's part: the evicted pods' processes exit, the pods go.
sample
rm -rf "$WORK/proc/${PID_OF[pa]}" "$WORK/proc/${PID_OF[pb]}"
kubectl delete pod pa pb -n "$NS_A" --grace-period=0 --force >/dev/null 2>&1

say "4. mirrors on again; then the operator killed (SIGKILL) and a budget edited while its mirror still has the old spec"
stop_process "$OPERATOR_PID"
make_pod pc
sample pc=$((10 * GI))
kubectl apply -f - <<EOF | sed 's/^/    /'
apiVersion: gpubudget.io/v1alpha1
kind: GpuMemoryBudget
metadata: {name: c, namespace: $NS_A}
spec: {selector: {matchLabels: {app: pc}}, limit: 16Gi}
EOF
RESTARTED=$(date +%s.%N)
start_operator
T_BACK=$(timed "the agent reads the mirrors again (gauge 1, since the operator started with mirrors on)" "$RESTARTED" gauge_is 1)
wait_for "gmbmirror c written" kubectl get gmbmirror c -n "$NS_A"
wait_for "pc recorded Within under c" bash -c "[ \"\$(kubectl get pod pc -n $NS_A -o jsonpath='{.metadata.annotations.gpubudget\.io/state}/{.metadata.annotations.gpubudget\.io/budget}')\" = Within/c ]"
wait_for "c's status: NodesCurrent True/MirrorCurrent" status_says c True/MirrorCurrent
show_status c
NOT_CURRENT_BEFORE=$(node_event_count GpuBudgetMirrorsNotCurrent)
kill -KILL "$OPERATOR_PID"
KILLED=$(date +%s.%N)
wait "$OPERATOR_PID" 2>/dev/null || true
OPERATOR_PID=""
info "operator killed (SIGKILL): the Lease stays, renewed last at $(lease_renew)"
kubectl patch gmb c -n "$NS_A" --type=merge -p '{"spec":{"limit":"4Gi"}}' | sed 's/^/    /'
EDITED=$(date +%s.%N)
info "c tightened to 4Gi (generation $(generation c)); its mirror still says $(kubectl get gmbmirror c -n "$NS_A" -o jsonpath='{.spec.budget.limit}')"
sleep 3
has_event "$NS_A" pc GpuMemoryOverBudget && die "pc judged over 3 s after the edit, while the agent should read the stale mirror"
STEP_TIMEOUT=90
T_FALL=$(timed "the agent back on the budgets (gauge 0, since the kill)" "$KILLED" gauge_is 0)
T_OVER=$(timed "GpuMemoryOverBudget on pc (c's edit enforced, since the edit)" "$EDITED" has_event "$NS_A" pc GpuMemoryOverBudget)
info "since the kill: $(since "$KILLED")s; the Lease $(lease_there && echo "still there, renewed last at $(lease_renew)" || echo gone)"
T_EVENT=$(timed "a new GpuBudgetMirrorsNotCurrent on the Node (since the kill)" "$KILLED" \
  node_event_more GpuBudgetMirrorsNotCurrent "$NOT_CURRENT_BEFORE")
node_events GpuBudgetMirrorsNotCurrent | sed 's/^/    GpuBudgetMirrorsNotCurrent (occurrences, last seen, note): /'
info "(a repeat is counted into the first event's series; the agent's log gives each reason:)"
grep "the mirrors are not current" "$WORK/agent.log" | sed 's/\x1b\[[0-9;]*m//g' | cut -c1-300 | sed 's/^/    agent: /'
info "pc: $(event_messages "$NS_A" pc GpuMemoryOverBudget | head -n1)"
SUMMARY+=("mirrors back on: the agent read them again ${T_BACK}s after the operator started")
SUMMARY+=("operator SIGKILLed with mirrors on: the agent back on the budgets ${T_FALL}s after the kill; c's edit (16Gi → 4Gi, made right after the kill) enforced (GpuMemoryOverBudget) ${T_OVER}s after the edit")
sample
rm -rf "$WORK/proc/${PID_OF[pc]}"

FAILED=0
say "summary (real kube-apiserver, operator and agent out of cluster, replayed GPU sample)"
for line in "${SUMMARY[@]}"; do info "$line"; done
say "PASS: with the mirrors off, or their operator gone, the agent enforces every budget's current spec ($((SECONDS - START)) s)"
