#!/usr/bin/env bash
# The operator at 10 000 pods and 1 000 budgets against a real kube-apiserver (docs/performance.md, next to
# the in-memory figures of operator/examples/scale.rs, whose workload this repeats): 100 namespaces, 10
# budgets each (budget-0 selects every pod of its namespace, budget-1..9 select app-1..9), 100 pods each
# spread over 50 nodes, every pod with six labels, a 1.5 KB last-applied annotation and the agent's record
# (applied as the agent applies it). Then the release operator starts with its ServiceAccount's token and the
# chart's RBAC. Prints: time until /ready and until every budget has a status, RSS then (and peak), record
# -> status latency (a new highest usage on one pod until its budget's topPods[0] shows it) p50/p99, RSS at
# the end, reconciles and status writes from its metrics.
#
#   KUBECONFIG=/tmp/realk8s/run/kubeconfig e2e/apiserver/scale-operator.sh [NAMESPACES PODS_PER_NS BUDGETS_PER_NS CHANGES]
#
# Defaults 100 100 10 100 (issue 25's envelope: 1000 150 10 100, 150 000 pods and 10 000 budgets). After every
# status is written, GPUBUDGET_E2E_IDLE_SECONDS (default 30) with nothing changing: the status writes in that
# window (none expected). "Every status" is read from the operator's own status-write counter (one write per
# budget at start), then checked with one list of the budgets: polling a list of 10 000 budgets would load the
# API server it measures. GPUBUDGET_E2E_CEILING=1: once the operator is stopped, every budget's status is
# rewritten by load.py (server-side apply as the operator does; the same with the Overlapping Warning event the
# operator publishes after a first status that says so; then JSON merge patch; 16 at a time, as the operator's
# reconciles): the API server's own rate for these writes, to compare the operator's with; before them, the time
# it takes to list what the operator lists before its first status (load.py list-ceiling).
# GPUBUDGET_E2E_NODES (default 50): the nodes the pods are bound to and their records name (created as Node
# objects). GPUBUDGET_E2E_NODE_USAGE=1 (#34): one GpuNodeUsage per node listing its pods (each at its record's
# usage plus 1 GiB), written before the operator starts, so that it watches and applies them too. GPUBUDGET_E2E_REUSE=PREFIX runs the
# operator again over the objects an earlier run kept (GPUBUDGET_E2E_KEEP=1 prints its PREFIX), their statuses
# removed first, so every budget is written again (at 150 000 pods, creating them takes longer than the run).
# Environment: GPUBUDGET_E2E_BIN (default target/release), HELM, GPUBUDGET_E2E_KEEP=1.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
REPO=$(cd "$HERE/../.." && pwd)
[ -n "${KUBECONFIG:-}" ] || { echo "KUBECONFIG (the admin's) is not set" >&2; exit 1; }
BIN=${GPUBUDGET_E2E_BIN:-$REPO/target/release}
# shellcheck source=../lib.sh
. "$REPO/e2e/lib.sh"
NAMESPACES=${1:-100} PER_NS=${2:-100} BUDGETS_PER_NS=${3:-10} CHANGES=${4:-100}
ID=$(date +%s | tail -c 5)$RANDOM
ID=${ID:0:7}
P=${GPUBUDGET_E2E_REUSE:-gpubudget-op-$ID}
RELEASE=$P
WORK=$(mktemp -d "${TMPDIR:-/tmp}/gpubudget-apiserver-opscale.XXXXXX")
export GPUBUDGET_API GPUBUDGET_TOKEN
GPUBUDGET_API=$(kubectl config view --minify -o jsonpath='{.clusters[0].cluster.server}')
GPUBUDGET_TOKEN=$(kubectl config view --raw --minify -o jsonpath='{.users[0].user.token}')
ADMIN=127.0.0.1:$((20000 + RANDOM % 20000))
OPERATOR_PID=""
START=$SECONDS
mib() { awk -v k="$1:" '$1 == k {printf "%.1f", $2 / 1024}' "/proc/$OPERATOR_PID/status"; }
cleanup() {
  local rc=$?
  [ -z "$OPERATOR_PID" ] || kill "$OPERATOR_PID" 2>/dev/null || true
  if [ "${GPUBUDGET_E2E_KEEP:-0}" != 1 ]; then
    kubectl delete clusterrolebinding,clusterrole -l "app.kubernetes.io/instance=$RELEASE" --ignore-not-found >/dev/null 2>&1 || true
    kubectl delete nodes -l "e2e.gpubudget.io/run=$P" --wait=false >/dev/null 2>&1 || true
    kubectl get gpunodeusages -o name 2>/dev/null | grep -F "/$P-node-" | xargs -r kubectl delete --wait=false >/dev/null 2>&1 || true
    for n in $(seq 0 $((NAMESPACES - 1))); do kubectl delete namespace "$P-$n" --wait=false >/dev/null 2>&1 || true; done
    kubectl delete namespace "$P" --wait=false >/dev/null 2>&1 || true
    rm -rf "$WORK"
  fi
  exit "$rc"
}
trap cleanup EXIT

say "CRD, the operator's RBAC; $NAMESPACES namespaces × $BUDGETS_PER_NS budgets, × $PER_NS pods with records"
NODES=${GPUBUDGET_E2E_NODES:-50}
# The Node objects the pods are bound to: without them the controller manager's pod garbage collector deletes
# the pods as orphans (10 a second), and every deletion is a real change of two budgets' statuses.
create_nodes() {
  local part
  for part in 0 1 2 3; do
    seq "$part" 4 $((NODES - 1)) | awk -v p="$P" '{printf "{\"apiVersion\":\"v1\",\"kind\":\"Node\",\"metadata\":{\"name\":\"%s-node-%d\",\"labels\":{\"e2e.gpubudget.io/run\":\"%s\"}}}\n", p, $1, p}' \
      | jq -s '{apiVersion: "v1", kind: "List", items: .}' | kubectl apply -f - >/dev/null 2>&1 &
  done
  wait
}
if [ -n "${GPUBUDGET_E2E_REUSE:-}" ]; then
  info "reusing $P's objects; their statuses removed"
  create_nodes
  info "$(python3 "$HERE/load.py" pods "$P" "$NAMESPACES" "$PER_NS" "$BUDGETS_PER_NS" "$NODES" --records --missing)"
  info "$(python3 "$HERE/load.py" status-ceiling "$P" "$NAMESPACES" "$BUDGETS_PER_NS" clear 16)"
else
  kubectl create namespace "$P" >/dev/null
  apply_crd_and_chart "$RELEASE" "$P" "ServiceAccount ClusterRole ClusterRoleBinding"
  for n in $(seq 0 $((NAMESPACES - 1))); do echo "{\"apiVersion\":\"v1\",\"kind\":\"Namespace\",\"metadata\":{\"name\":\"$P-$n\"}}"; done \
    | jq -s '{apiVersion: "v1", kind: "List", items: .}' | kubectl create -f - >/dev/null
  info "$(python3 "$HERE/load.py" budgets "$P" "$NAMESPACES" "$BUDGETS_PER_NS")"
  create_nodes
  info "$(python3 "$HERE/load.py" pods "$P" "$NAMESPACES" "$PER_NS" "$BUDGETS_PER_NS" "$NODES" --records)"
  [ "${GPUBUDGET_E2E_KEEP:-0}" != 1 ] || info "kept: rerun with GPUBUDGET_E2E_REUSE=$P"
fi
BUDGETS=$((NAMESPACES * BUDGETS_PER_NS))
if [ "${GPUBUDGET_E2E_NODE_USAGE:-0}" = 1 ]; then
  info "$(python3 "$HERE/load.py" node-usage "$P" "$NAMESPACES" "$NODES")"
fi

say "the operator starts"
token_kubeconfig "$WORK/operator.kubeconfig" scale-operator "$(kubectl create token "$RELEASE-operator" -n "$P" --duration=1h)"
T0=$(date +%s.%N)
KUBECONFIG=$WORK/operator.kubeconfig POD_NAMESPACE=$P RUST_LOG=warn "$BIN/gpubudget-operator" run \
  --admin-addr "$ADMIN" > "$WORK/operator.log" 2>&1 &
OPERATOR_PID=$!
READY_AT=""
metric() { curl -fsS "http://$ADMIN/metrics" 2>/dev/null | awk -v m="$1" '$1 ~ "^"m {s += $2} END {print s + 0}'; }
with_status() {
  kubectl get gmb -A -o json | jq --arg p "$P-" \
    '[.items[] | select((.metadata.namespace | startswith($p)) and .status.observedGeneration != null)] | length'
}
# every_budget COMMAND: waits until the count COMMAND prints reaches BUDGETS (and /ready answered): lib.sh's wait_for
# with the operator's readiness time taken on the way, and an hour to converge.
every_budget() {
  until [ -n "$READY_AT" ] && [ "$("$@")" -ge "$BUDGETS" ]; do
    kill -0 "$OPERATOR_PID" || { cat "$WORK/operator.log"; die "the operator exited"; }
    if [ -z "$READY_AT" ] && ready "$ADMIN" 2>/dev/null; then READY_AT=$(since "$T0"); fi
    [ "$((SECONDS - START))" -lt 3600 ] || die "no convergence"
    sleep 0.2
  done
}
every_budget metric gpubudget_operator_status_writes_total
CONVERGED=$(since "$T0")
every_budget with_status
printf '    RESULT operator pods=%s budgets=%s ready=%ss every_status=%ss (after ready: %ss; list checked at %ss) rss=%sMiB peak=%sMiB events=%s mirror_writes=%s\n' \
  "$((NAMESPACES * PER_NS))" "$BUDGETS" "$READY_AT" "$CONVERGED" "$(echo "$CONVERGED - $READY_AT" | bc -l | xargs printf '%.1f')" \
  "$(since "$T0")" "$(mib VmRSS)" "$(mib VmHWM)" "$(metric gpubudget_operator_events_total)" \
  "$(metric gpubudget_operator_mirror_writes_total)" | tee "$WORK/results.txt"
IDLE=${GPUBUDGET_E2E_IDLE_SECONDS:-30}
W0=$(metric gpubudget_operator_status_writes_total)
sleep "$IDLE"
printf '    RESULT idle %ss: status_writes=%s rss=%sMiB\n' "$IDLE" \
  "$(($(metric gpubudget_operator_status_writes_total) - W0))" "$(mib VmRSS)" | tee -a "$WORK/results.txt"

say "record -> status, $CHANGES changes"
python3 "$HERE/load.py" record-latency "$P" "$NAMESPACES" "$PER_NS" "$BUDGETS_PER_NS" "$CHANGES" | sed 's/^/    RESULT /' | tee -a "$WORK/results.txt"
M=$(curl -fsS "http://$ADMIN/metrics")
printf '    RESULT end rss=%sMiB peak=%sMiB reconciles=%s status_writes=%s\n' "$(mib VmRSS)" "$(mib VmHWM)" \
  "$(echo "$M" | awk '/^gpubudget_operator_reconciles_total/ {s += $2} END {print s + 0}')" \
  "$(echo "$M" | awk '/^gpubudget_operator_status_writes_total/ {s += $2} END {print s + 0}')" | tee -a "$WORK/results.txt"
kill -TERM "$OPERATOR_PID"
# shellcheck disable=SC2015 # info does not fail
wait "$OPERATOR_PID" && info "operator exited 0 after SIGTERM" || info "operator exit: $?"
OPERATOR_PID=""
if [ "${GPUBUDGET_E2E_CEILING:-0}" = 1 ]; then
  say "the API server's own rate for these status writes (operator stopped)"
  python3 "$HERE/load.py" list-ceiling | sed 's/^/    RESULT /' | tee -a "$WORK/results.txt"
  for mode in apply apply-events merge; do
    python3 "$HERE/load.py" status-ceiling "$P" "$NAMESPACES" "$BUDGETS_PER_NS" "$mode" 16 | sed 's/^/    RESULT /' \
      | tee -a "$WORK/results.txt"
  done
fi
say "results ($BIN, $(git -C "$REPO" rev-parse --short HEAD))"
cat "$WORK/results.txt"
