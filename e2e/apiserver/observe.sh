#!/usr/bin/env bash
# Observe first (issue 54) against a real kube-apiserver, no kubelet: one agent (token bound to its Node) with the
# chart's RBAC and admission policies, started as the chart starts it with `agent.enforcement=Observe`
# (GPUBUDGET_ENFORCEMENT=Observe), and the API server's own Eviction API and CEL validation.
#
#   GPUBUDGET_E2E_APISERVER=1 KUBECONFIG=/tmp/realk8s/run/kubeconfig e2e/apiserver/observe.sh [OUT]
#   GPUBUDGET_E2E_APISERVER=1 REALK8S_DIR=/tmp/realk8s e2e/apiserver/observe.sh [OUT]   # starts it, stops it
#
# The user's story, on one replayed 80 GiB GPU:
# a. a pod over its Evict budget (8Gi, overLimitSeconds 2) at 9 GiB for 20 s: not evicted; GpuMemoryWouldEvict
#    once, naming the agent's default; its record stays Over, no eviction time; gpubudget_would_evict_total counts
#    it, gpubudget_evictions_total nothing; `kubectl gpubudget why` answers WouldEvict;
# b. GPU memory pressure where a neighbour is harmed: a pod no budget selects at 43 GiB beside `serve` (request
#    30Gi) at 27 GiB and llm, 1 GiB free: not evicted for 20 s; GpuMemoryWouldEvict (pressure) once;
# c. the API server refuses `enforcement: observe` (the CRD's enum);
# d. the budget of (a) switched to `enforcement: Enforce`: its pod is evicted;
# e. the Node labelled `gpubudget.io/enforcement=Enforce`: the pod of (b) is evicted for pressure.
# The test plays the kubelet (pod status, /proc) and NVML (a sample file). OUT (optional) receives a copy of the
# output.
#
# Environment: as run.sh (GPUBUDGET_E2E_BIN, HELM, GPUBUDGET_E2E_STEP_TIMEOUT, GPUBUDGET_E2E_KEEP, REALK8S).
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
REPO=$(cd "$HERE/../.." && pwd)
REALK8S=${REALK8S:-/work/shared/realk8s}
if [ -n "${1:-}" ] && [ -z "${OBSERVE_TEE:-}" ]; then
  OBSERVE_TEE=1 exec > >(tee "$1") 2>&1
fi

# shellcheck source=../lib.sh
. "$REPO/e2e/lib.sh"
control_plane_or_skip "observe first" gpubudget-agent kubectl-gpubudget
STEP_TIMEOUT=${GPUBUDGET_E2E_STEP_TIMEOUT:-60}
POLL=0.5
GI=1073741824

ID=$(date +%s | tail -c 5)$RANDOM
ID=${ID:0:7}
NS=gpubudget-ob-$ID                 # the release's namespace (its ServiceAccounts)
NS_W=gpubudget-ob-$ID-w             # the workloads
NODE=gpubudget-ob-$ID-n1
RELEASE=gpubudget-ob-$ID
WORK=$(mktemp -d "${TMPDIR:-/tmp}/gpubudget-observe.XXXXXX")
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
    kubectl get events.v1.events.k8s.io -A -o json 2>/dev/null | jq -r '.items[] | "\(.regarding.name) \(.reason) \(.note)"' | grep -F "$ID" | cut -c1-300 || true
    echo "--- agent log (last 60 lines)"; tail -n 60 "$WORK/agent.log" 2>/dev/null || true
  fi
  for pid in "${PIDS[@]}"; do stop_process "$pid"; done
  if [ "${GPUBUDGET_E2E_KEEP:-0}" = 1 ]; then
    say "keeping the namespaces, the node and $WORK (GPUBUDGET_E2E_KEEP=1)"
  else
    kubectl delete namespace "$NS" "$NS_W" --wait=false --ignore-not-found >/dev/null 2>&1 || true
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
for ns in "$NS" "$NS_W"; do kubectl create namespace "$ns" >/dev/null; done
apply_crd_and_chart "$RELEASE" "$NS" "ServiceAccount ClusterRole ClusterRoleBinding Role RoleBinding ValidatingAdmissionPolicy ValidatingAdmissionPolicyBinding"
for ns in "$NS" "$NS_W"; do wait_for "ServiceAccount default in $ns" kubectl get serviceaccount default -n "$ns"; done
kubectl create -f - >/dev/null <<EOF
apiVersion: v1
kind: Node
metadata: {name: $NODE, labels: {nvidia.com/gpu.present: "true", e2e.gpubudget.io/run: "$ID"}}
EOF

# budget NAME SPEC: a namespaced budget selecting app=NAME.
budget() {
  kubectl apply -f - <<EOF | sed 's/^/    /'
apiVersion: gpubudget.io/v1alpha1
kind: GpuMemoryBudget
metadata: {name: $1, namespace: $NS_W}
spec: {selector: {matchLabels: {app: $1}}, $2}
EOF
}
# make_pod NAME: a running pod on the node (the test is its kubelet), labelled app=NAME.
make_pod() {
  kubectl create -f - >/dev/null <<EOF
apiVersion: v1
kind: Pod
metadata: {name: $1, namespace: $NS_W, labels: {e2e.gpubudget.io/run: "$ID", app: $1}}
spec:
  nodeName: $NODE
  terminationGracePeriodSeconds: 60
  containers: [{name: main, image: registry.k8s.io/pause:3.10}]
EOF
  pod_running "$NS_W" "$1"
  NEXT_PID=$((NEXT_PID + 1))
  fake_process "$WORK/proc" "$NEXT_PID" "$NS_W" "$1"
  PID_OF[$1]=$NEXT_PID
}

declare -A PID_OF
NEXT_PID=7400
# sample [POD=BYTES]: the GPU's processes, written atomically as NVML would report them (80 GiB GPU, the
# device's used bytes the sum: the pressure signal).
sample() {
  local procs="" kv used=0
  for kv in "$@"; do
    procs+="${procs:+, }{\"pid\": ${PID_OF[${kv%%=*}]}, \"used_bytes\": ${kv#*=}}"
    used=$((used + ${kv#*=}))
  done
  cat > "$WORK/sample.tmp" <<EOF
{"version": 1, "gpus": [{"index": 0, "uuid": "GPU-e2e00000-0000-0000-0000-000000000054", "name": "replayed e2e GPU",
 "memory_total_bytes": 85899345920, "memory_used_bytes": $used, "processes": [$procs]}]}
EOF
  mv "$WORK/sample.tmp" "$WORK/sample.json"
}
metric() { curl -fsS "http://$ADMIN/metrics" | awk -v m="$1" 'index($0, m) == 1 {print $2}'; }
pressure_metric() { metric 'gpubudget_gpu_memory_pressure{'; }
under_pressure() { [ "$(pressure_metric)" = 1 ]; }
mkdir -p "$WORK/proc"
sample

say "the agent as the chart starts it with agent.enforcement=Observe (GPUBUDGET_ENFORCEMENT=Observe)"
token_kubeconfig "$WORK/agent.kubeconfig" agent \
  "$(kubectl create token "$RELEASE-agent" -n "$NS" --duration=1h --bound-object-kind Node --bound-object-name "$NODE")"
KUBECONFIG=$WORK/agent.kubeconfig RUST_LOG=info GPUBUDGET_ENFORCEMENT=Observe "$BIN/gpubudget-agent" run \
  --node-name "$NODE" --proc-root "$WORK/proc" --sample-file "$WORK/sample.json" --interval 250ms \
  --admin-addr "$ADMIN" > "$WORK/agent.log" 2>&1 &
PIDS+=($!)
wait_for "agent ready" ready "$ADMIN"

say "a. llm over its Evict budget (8Gi, overLimitSeconds 2) at 9 GiB, for 20 s"
budget llm "limit: 8Gi, overLimitSeconds: 2"
make_pod llm
OVER=$(date +%s.%N)
sample llm=$((9 * GI))
wait_for "GpuMemoryWouldEvict on llm" has_event "$NS_W" llm GpuMemoryWouldEvict
told=$(since "$OVER")
for _ in $(seq 1 20); do
  terminating "$NS_W" llm && die "llm was evicted in observe mode"
  sleep 1
done
has_event "$NS_W" llm EvictingForGpuMemory && die "an EvictingForGpuMemory on llm"
n=$(event_occurrences "$NS_W" llm GpuMemoryWouldEvict)
[ "$n" = 1 ] || die "GpuMemoryWouldEvict told $n times in one episode"
msg=$(event_messages "$NS_W" llm GpuMemoryWouldEvict | head -n1)
info "GpuMemoryWouldEvict ${told}s after going over: $msg"
[[ "$msg" == "would be evicted (observe mode: the agent's default, --enforcement (chart value agent.enforcement); nothing is evicted): using 9Gi of 8Gi (budget $NS_W/llm) for "* ]] \
  || die "unexpected note: $msg"
state=$(annotation "$NS_W" llm state)
requested=$(annotation "$NS_W" llm eviction-requested-at)
[ "$state" = Over ] && [ -z "$requested" ] || die "llm's record: state $state, eviction-requested-at '$requested'"
would=$(metric 'gpubudget_would_evict_total{cause="budget",set_by="agent"}')
[ "$would" = 1 ] || die "gpubudget_would_evict_total{cause=budget,set_by=agent} is '$would'"
[ -z "$(metric 'gpubudget_evictions_total{')" ] || die "gpubudget_evictions_total counts an eviction"
next=$("$BIN/kubectl-gpubudget" why -n "$NS_W" llm -o json | jq -r '.next.action + ": " + .next.message')
info "kubectl gpubudget why: $next"
[[ "$next" == "WouldEvict: would be evicted (observe mode: the agent's default"* ]] || die "why says: $next"
SUMMARY+=("a: llm at 9 of 8 GiB, overLimitSeconds 2: GpuMemoryWouldEvict once (${told}s after going over), not evicted in 20 s; record Over without eviction time; would_evict_total 1, evictions_total none; why: WouldEvict")

say "b. pressure: nb (no budget) at 43 GiB beside serve (request 30Gi) at 27 GiB and llm: 1 GiB free, serve owed 3, for 20 s"
budget serve "limit: 30Gi, request: 30Gi"
make_pod serve
make_pod nb
sample llm=$((9 * GI)) serve=$((27 * GI)) nb=$((43 * GI))
wait_for "the GPU under pressure" under_pressure
wait_for "GpuMemoryWouldEvict on nb" has_event "$NS_W" nb GpuMemoryWouldEvict
for _ in $(seq 1 20); do
  terminating "$NS_W" nb && die "nb was evicted in observe mode"
  sleep 1
done
n=$(event_occurrences "$NS_W" nb GpuMemoryWouldEvict)
[ "$n" = 1 ] || die "nb's GpuMemoryWouldEvict told $n times in one episode"
has_event "$NS_W" serve GpuMemoryWouldEvict && die "serve (within its request) was named"
msg=$(event_messages "$NS_W" nb GpuMemoryWouldEvict | head -n1)
info "GpuMemoryWouldEvict: ${msg:0:300}"
[[ "$msg" == *"GPU 0 is under memory pressure"*"no budget selects it"* ]] || die "unexpected note: $msg"
would=$(metric 'gpubudget_would_evict_total{cause="pressure",set_by="agent"}')
[ "$would" = 1 ] || die "gpubudget_would_evict_total{cause=pressure,set_by=agent} is '$would'"
n=$(event_occurrences "$NS_W" llm GpuMemoryWouldEvict)
[ "$n" = 1 ] || die "llm's GpuMemoryWouldEvict told $n times (once per episode)"
SUMMARY+=("b: nb (no budget, 43 GiB) beside serve owed 3 GiB with 1 GiB free: GpuMemoryWouldEvict (pressure) once, not evicted in 20 s; serve never named")

say "c. the API server refuses enforcement: observe (the CRD's enum)"
if out=$(budget llm "limit: 8Gi, overLimitSeconds: 2, enforcement: observe" 2>&1); then die "accepted: $out"; fi
info "refused: $(printf '%s' "$out" | tr '\n' ' ' | cut -c1-240)"
[[ "$out" == *'Unsupported value: "observe"'* ]] || die "refused for another reason: $out"
SUMMARY+=("c: enforcement: observe refused by the API server (enum Observe, Enforce)")

say "d. llm's budget switched to enforcement: Enforce"
SWITCHED=$(date +%s.%N)
budget llm "limit: 8Gi, overLimitSeconds: 2, enforcement: Enforce"
wait_for "llm evicted (terminating)" terminating "$NS_W" llm
after=$(since "$SWITCHED")
info "llm terminating ${after}s after the switch: $(event_messages "$NS_W" llm EvictingForGpuMemory | head -n1 | cut -c1-200)"
has_event "$NS_W" llm GpuMemoryBudgetChanged || die "no GpuMemoryBudgetChanged for the switch"
terminating "$NS_W" nb && die "nb evicted while the node observes"
# The kubelet's part: llm's processes exit and it goes; nb grows so that serve is still short.
rm -rf "${WORK:?}/proc/${PID_OF[llm]}"
kubectl delete pod llm -n "$NS_W" --grace-period=0 --force >/dev/null 2>&1 || true
sample serve=$((27 * GI)) nb=$((51 * GI))
sleep 3
terminating "$NS_W" nb && die "nb evicted while the node observes"
SUMMARY+=("d: llm's budget switched to Enforce: llm evicted ${after}s later (the period started afresh: GpuMemoryBudgetChanged); nb still not")

say "e. the Node labelled gpubudget.io/enforcement=Enforce (read within 60 s)"
LABELLED=$(date +%s.%N)
kubectl label node "$NODE" gpubudget.io/enforcement=Enforce >/dev/null
STEP_TIMEOUT=90 wait_for "nb evicted for pressure (terminating)" terminating "$NS_W" nb
after=$(since "$LABELLED")
info "nb terminating ${after}s after the label: $(event_messages "$NS_W" nb EvictingForGpuMemory | head -n1 | cut -c1-200)"
terminating "$NS_W" serve && die "serve was evicted"
SUMMARY+=("e: the Node labelled Enforce: nb evicted for pressure ${after}s later (the label is read every 60 s); serve kept")

FAILED=0
say "summary (real kube-apiserver, replayed 80 GiB GPU, GPUBUDGET_ENFORCEMENT=Observe)"
for line in "${SUMMARY[@]}"; do info "$line"; done
say "PASS: observing evicts nothing and tells what it would; a budget, then a node, switched to Enforce act ($((SECONDS - START)) s)"
