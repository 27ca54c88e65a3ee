#!/usr/bin/env bash
# The agent's footprint against a real kube-apiserver (docs/performance.md): 1 000 (or 10 000) budgets in the
# cluster, then an agent with 110 pods on its node and one with 1 000, each started fresh so it writes every
# pod's first record at once. Prints the agent's resident memory (peak and settled), its TCP connections to
# the API server (most at once while writing, and 5 s after), how long until every pod had its record, the
# bytes its watches received and its table rebuilds. With GPUBUDGET_E2E_STREAM, then a steady stream of
# budget writes for 30 s (`status`: what the operator's status writes look like; `spec`: changes of what is
# enforced), with what the agent received, rebuilt and spent on it.
#
#   KUBECONFIG=/tmp/realk8s/run/kubeconfig e2e/apiserver/scale.sh [POD COUNTS...]   # default: 110 1000
#
# Environment: GPUBUDGET_E2E_BIN (default target/release), HELM, GPUBUDGET_E2E_BUDGETS (default 1000),
# GPUBUDGET_E2E_STREAM ("status spec elsewhere": the streams to run after each count; elsewhere: spec changes
# of 100 budgets in a namespace without pods on the node), GPUBUDGET_E2E_STREAM_RATE
# (writes per second, default 20), GPUBUDGET_E2E_WRITES=1 (then the agent's write load, below),
# GPUBUDGET_E2E_IDLE_SECONDS (default 30: the agent's CPU with nothing changing, after its records; in 10 ms
# steps, in microseconds and split into the time inside its ticks and outside),
# GPUBUDGET_E2E_SETTLE_SECONDS (default 0: a wait before that window, for the operator's status writes that the
# records cause to reach the agent's budget watch first),
# GPUBUDGET_E2E_PERF=PREFIX (a perf profile of that window, PREFIX-BUDGETS.data), GPUBUDGET_E2E_KEEP=1.
# The agent runs with the chart's RBAC and admission policies and a node-bound token, as in the core stories (e2e/tests/apiserver); its budgets are all Within (no events, no evictions): what is measured is the records.
#
# GPUBUDGET_E2E_WRITES=1: the agent's write load (issue 25), every API write it makes (records, events,
# evictions: gpubudget_api_writes_total) per phase, as writes per minute: `steady` (60 s, nothing moves),
# `usage` (60 s, every pod's usage moves by 20 % every 5 s), `crossing` (60 s, a tenth of the pods cycle
# Within -> Near -> Over every 5 s), `flapping` (60 s, a tenth of the pods swing between 30 and 37 GiB, Within and Near, every
# second, as a tenant trying to make its node write would), `pod-churn` (60 s, a pod deleted and another created every 6 s),
# `budgets-edited` (every budget's limit raised at once, no pod's state changes; 60 s from the edit),
# `budgets-tightened` (every budget set to 1Gi with action Warn at once: every pod goes Over; 60 s),
# `operator-restart` (the operator killed and started again; 60 s). docs/performance.md multiplies them out to a fleet.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
REPO=$(cd "$HERE/../.." && pwd)
[ -n "${KUBECONFIG:-}" ] || { echo "KUBECONFIG (the admin's) is not set" >&2; exit 1; }
BIN=${GPUBUDGET_E2E_BIN:-$REPO/target/release}
# shellcheck source=../lib.sh
. "$REPO/e2e/lib.sh"
BUDGETS=${GPUBUDGET_E2E_BUDGETS:-1000}
COUNTS=("$@")
[ "${#COUNTS[@]}" -gt 0 ] || COUNTS=(110 1000)
ID=$(date +%s | tail -c 5)$RANDOM
ID=${ID:0:7}
NS=gpubudget-scale-$ID
RELEASE=gpubudget-scale-$ID
TEAMS=10
WORK=$(mktemp -d "${TMPDIR:-/tmp}/gpubudget-apiserver-scale.XXXXXX")
SERVER=$(kubectl config view --minify -o jsonpath='{.clusters[0].cluster.server}')
ADMIN_TOKEN=$(kubectl config view --raw --minify -o jsonpath='{.users[0].user.token}')
API_PORT=${SERVER##*:}
API_PORT=${API_PORT%%/*}
ADMIN=127.0.0.1:$((20000 + RANDOM % 20000))
OPERATOR_ADMIN=127.0.0.1:$((20000 + RANDOM % 20000))
AGENT_PID="" OPERATOR_PID=""
STREAMS=${GPUBUDGET_E2E_STREAM:-}
WRITES=${GPUBUDGET_E2E_WRITES:-0}
RATE=${GPUBUDGET_E2E_STREAM_RATE:-20}
IDLE=${GPUBUDGET_E2E_IDLE_SECONDS:-30}
SETTLE=${GPUBUDGET_E2E_SETTLE_SECONDS:-0}
START=$SECONDS
# sockets PID: "local-port bytes-received" of each of the agent's open connections to the API server.
sockets() {
  ss -tnpiH state established "( dport = :$API_PORT )" 2>/dev/null \
    | awk -v pid="pid=$1," 'index($0, pid) {n = split($3, a, ":"); port = a[n]; next}
                            port != "" && /bytes_received:/ {match($0, /bytes_received:[0-9]+/); print port, substr($0, RSTART + 15, RLENGTH - 15); port = ""}'
}
# received PID: bytes received on the agent's open connections (its watches among them).
received() { sockets "$1" | awk '{s += $2} END {printf "%d\n", s}'; }
# received_since PID FILE: bytes received since FILE (a `sockets` listing) on the connections open now; a
# connection that closed in between (an idle write connection leaves the pool after 90 s) is not counted.
received_since() { sockets "$1" | awk 'NR == FNR {before[$1] = $2; next} {s += $2 - before[$1]} END {printf "%d\n", s}' "$2" -; }
cpu_ms() { awk '{print ($14 + $15) * 10}' "/proc/$1/stat"; }
# cpu_us PID: the CPU time of PID's threads alive now, in microseconds (the scheduler's nanosecond account,
# /proc/PID/task/*/schedstat; a thread that exited is not in it, so `threads` is printed with it).
cpu_us() { cat /proc/"$1"/task/*/schedstat 2>/dev/null | awk '{s += $1} END {printf "%d\n", s / 1000}'; }
# shellcheck disable=SC2012 # the entries are thread IDs: digits only
threads() { ls /proc/"$1"/task | wc -l; }
metric() { curl -fsS "http://$ADMIN/metrics" | awk -v m="$1" '$1 == m {print $2}'; }
# writes: the agent's API writes so far, by kind and in all ("apply=110 event=3 all=113").
writes() {
  curl -fsS "http://$ADMIN/metrics" | awk '$1 ~ /^gpubudget_api_writes_total[{]/ {
    match($1, /kind="[a-z]*"/); k = substr($1, RSTART + 6, RLENGTH - 7); n[k] += $2; all += $2 }
    END {for (k in n) printf "%s=%d ", k, n[k]; printf "all=%d\n", all}'
}
# per_minute BEFORE AFTER SECONDS: each kind's writes between two `writes` lines, per minute.
per_minute() {
  awk -v a="$1" -v b="$2" -v s="$3" 'BEGIN {
    split(a, x, " "); for (i in x) {split(x[i], kv, "="); before[kv[1]] = kv[2]}
    split(b, y, " "); for (i in y) {split(y[i], kv, "="); k = kv[1]; printf "%s=%.0f/min ", k, (kv[2] - before[k]) * 60 / s}
  }'
}
start_operator() {
  KUBECONFIG=$WORK/operator.kubeconfig POD_NAMESPACE=$NS RUST_LOG=info "$BIN/gpubudget-operator" run \
    --admin-addr "$OPERATOR_ADMIN" --mirrors-lease-name "$RELEASE-operator-mirrors" >> "$WORK/operator.log" 2>&1 &
  OPERATOR_PID=$!
}
cleanup() {
  local rc=$?
  [ -z "$AGENT_PID" ] || kill "$AGENT_PID" 2>/dev/null || true
  [ -z "$OPERATOR_PID" ] || kill "$OPERATOR_PID" 2>/dev/null || true
  if [ "${GPUBUDGET_E2E_KEEP:-0}" != 1 ]; then
    kubectl delete validatingadmissionpolicybinding,validatingadmissionpolicy,clusterrolebinding,clusterrole \
      -l "app.kubernetes.io/instance=$RELEASE" --ignore-not-found >/dev/null 2>&1 || true
    for t in $(seq 0 $((TEAMS - 1))); do kubectl delete namespace "$NS-t$t" --wait=false >/dev/null 2>&1 || true; done
    kubectl delete namespace "$NS" "$NS-elsewhere" --wait=false --ignore-not-found >/dev/null 2>&1 || true
    kubectl delete nodes -l "e2e.gpubudget.io/run=$ID" >/dev/null 2>&1 || true
    rm -rf "$WORK"
  fi
  exit "$rc"
}
trap cleanup EXIT

say "CRD, the chart's RBAC and admission policies; $BUDGETS budgets in $TEAMS namespaces"
kubectl create namespace "$NS" >/dev/null
apply_crd_and_chart "$RELEASE" "$NS" \
  "ServiceAccount ClusterRole ClusterRoleBinding Role RoleBinding ValidatingAdmissionPolicy ValidatingAdmissionPolicyBinding"
for t in $(seq 0 $((TEAMS - 1))); do kubectl create namespace "$NS-t$t" >/dev/null; done
# Budget i: namespace t(i % TEAMS), selects app=app-(i / TEAMS); the limits are far above the usage.
python3 - "$NS" "$TEAMS" "$BUDGETS" > "$WORK/budgets.json" <<'EOF'
import json, sys
ns, teams, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
items = [{"apiVersion": "gpubudget.io/v1alpha1", "kind": "GpuMemoryBudget",
          "metadata": {"name": f"budget-{i}", "namespace": f"{ns}-t{i % teams}"},
          "spec": {"selector": {"matchLabels": {"app": f"app-{i // teams}"}}, "limit": "40Gi",
                   "evictionGracePeriodSeconds": 30}} for i in range(n)]
print(json.dumps({"apiVersion": "v1", "kind": "List", "items": items}))
EOF
T0=$SECONDS
# Four kubectl at once (one creates one object at a time).
jq -c '.items[]' "$WORK/budgets.json" | split -n r/4 - "$WORK/budgets-part-"
for part in "$WORK"/budgets-part-*; do
  [ -s "$part" ] || continue # none with GPUBUDGET_E2E_BUDGETS=0
  jq -s '{apiVersion: "v1", kind: "List", items: .}' "$part" | kubectl create -f - >/dev/null &
done
wait
jq -r '.items[] | .metadata.namespace + "/" + .metadata.name' "$WORK/budgets.json" > "$WORK/budget-names.txt"
info "$BUDGETS budgets created in $((SECONDS - T0)) s"
if [[ " $STREAMS " == *" elsewhere "* ]]; then
  # 100 more in a namespace without pods on any measured node: their spec changes must rebuild nothing there.
  kubectl create namespace "$NS-elsewhere" >/dev/null
  for i in $(seq 0 99); do
    printf '{"apiVersion":"gpubudget.io/v1alpha1","kind":"GpuMemoryBudget","metadata":{"name":"budget-%s","namespace":"%s"},"spec":{"selector":{},"limit":"40Gi"}}\n' "$i" "$NS-elsewhere"
  done | jq -s '{apiVersion: "v1", kind: "List", items: .}' | kubectl create -f - >/dev/null
  seq 0 99 | sed "s|^|$NS-elsewhere/budget-|" > "$WORK/elsewhere-names.txt"
  BUDGETS=$((BUDGETS + 100))
fi

# The operator runs throughout (its ServiceAccount's token), so the budgets carry a status as they would in a
# cluster, and the agents' budget watches see its writes.
token_kubeconfig "$WORK/operator.kubeconfig" scale-operator "$(kubectl create token "$RELEASE-operator" -n "$NS" --duration=1h)"
T0=$SECONDS
start_operator
with_status() { kubectl get gmb -A -o json | jq '[.items[] | select(.status.observedGeneration != null)] | length'; }
until [ "$(with_status)" -ge "$BUDGETS" ]; do
  [ $((SECONDS - T0)) -lt 600 ] || { echo "FAIL: budgets without status after 600 s: $(with_status) of $BUDGETS" >&2; exit 1; }
  sleep 1
done
info "operator: every budget has a status $((SECONDS - T0)) s after its start; RSS $(awk '/VmRSS/ {printf "%.1f", $2 / 1024}' "/proc/$OPERATOR_PID/status") MiB"

# measure LABEL PODS: a node with PODS pods (pod j: namespace t(j % TEAMS), app=app-((j / TEAMS) % (BUDGETS/TEAMS)))
# and a fresh agent bound to it.
measure() {
  local label=$1 pods=$2 node="gpubudget-scale-$ID-$1"
  say "$label: $pods pods on node $node"
  kubectl create -f - >/dev/null <<EOF
apiVersion: v1
kind: Node
metadata: {name: $node, labels: {e2e.gpubudget.io/run: "$ID"}}
EOF
  python3 - "$NS" "$TEAMS" "$BUDGETS" "$pods" "$node" "$WORK/pods-$label.json" "$WORK/sample-$label.json" <<'EOF'
import json, sys
ns, teams, budgets, n, node, pods_out, sample_out = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5], sys.argv[6], sys.argv[7]
per_team = max(1, budgets // teams)
items, procs = [], []
for j in range(n):
    pns, name = f"{ns}-t{j % teams}", f"{node}-p{j}"
    items.append({"apiVersion": "v1", "kind": "Pod",
                  "metadata": {"name": name, "namespace": pns, "labels": {"app": f"app-{(j // teams) % per_team}"}},
                  "spec": {"nodeName": node, "terminationGracePeriodSeconds": 30,
                           "containers": [{"name": "main", "image": "registry.k8s.io/pause:3.10"}]}})
    procs.append({"namespace": pns, "pod": name, "container": "main", "used_bytes": (1 + j % 8) << 30})
json.dump({"apiVersion": "v1", "kind": "List", "items": items}, open(pods_out, "w"))
json.dump({"version": 1, "gpus": [{"index": 0, "uuid": "GPU-scale", "name": "replayed", "memory_total_bytes": 85520809984,
           "processes": procs}]}, open(sample_out, "w"))
EOF
  local t0=$SECONDS
  kubectl create -f "$WORK/pods-$label.json" >/dev/null
  info "$pods pods created in $((SECONDS - t0)) s"
  local token
  token=$(kubectl create token "$RELEASE-agent" -n "$NS" --duration=1h --bound-object-kind Node --bound-object-name "$node")
  token_kubeconfig "$WORK/agent-$label.kubeconfig" scale-agent "$token"
  mkdir -p "$WORK/proc"
  local started=$SECONDS
  KUBECONFIG=$WORK/agent-$label.kubeconfig RUST_LOG=info "$BIN/gpubudget-agent" run --node-name "$node" \
    --proc-root "$WORK/proc" --sample-file "$WORK/sample-$label.json" --interval 250ms --admin-addr "$ADMIN" \
    --mirrors-lease "$NS/$RELEASE-operator-mirrors" > "$WORK/agent-$label.log" 2>&1 &
  AGENT_PID=$!
  # Sample every 200 ms until every pod has its record: RSS, connections to the API server.
  local max_conn=0 conn rss=0 done_at="" applies=0 deadline=$((SECONDS + 300))
  while [ "$SECONDS" -lt "$deadline" ]; do
    conn=$(ss -tnpH state established "( dport = :$API_PORT )" 2>/dev/null | grep -c "pid=$AGENT_PID," || true)
    [ "$conn" -le "$max_conn" ] || max_conn=$conn
    applies=$(curl -fsS "http://$ADMIN/metrics" 2>/dev/null | sed -n 's/^gpubudget_api_writes_total{kind="apply",result="ok"} \([0-9]*\).*/\1/p' || true)
    # Every pod's first record; without budgets there is none to write, so the agent being ready will do.
    if [ "${applies:-0}" -ge "$pods" ] || { [ "$BUDGETS" = 0 ] && curl -fsS "http://$ADMIN/ready" >/dev/null 2>&1; }; then
      done_at=$((SECONDS - started)); break
    fi
    sleep 0.2
  done
  local peak_during
  peak_during=$(awk '/VmHWM/ {print $2}' "/proc/$AGENT_PID/status")
  sleep 5
  conn=$(ss -tnpH state established "( dport = :$API_PORT )" 2>/dev/null | grep -c "pid=$AGENT_PID," || true)
  rss=$(awk '/VmRSS/ {print $2}' "/proc/$AGENT_PID/status")
  local recorded
  recorded=$(kubectl get pods -A --field-selector "spec.nodeName=$node" -o json \
    | jq '[.items[] | select(.metadata.annotations["gpubudget.io/state"] != null)] | length')
  local errors
  errors=$(curl -fsS "http://$ADMIN/metrics" | sed -n 's/^gpubudget_api_writes_total{kind="apply",result="error"} \([0-9]*\).*/\1/p')
  printf '    RESULT %-6s pods=%-5s budgets=%s records=%s/%s in %ss  peak_rss=%.1fMiB  rss_5s_after=%.1fMiB  max_conns=%s  conns_5s_after=%s  apply_errors=%s  received=%.1fMiB  rebuilds=%s\n' \
    "$label" "$pods" "$BUDGETS" "$recorded" "$pods" "${done_at:-timeout}" "$(echo "$peak_during / 1024" | bc -l)" \
    "$(echo "$rss / 1024" | bc -l)" "$max_conn" "$conn" "${errors:-0}" "$(echo "$(received "$AGENT_PID") / 1048576" | bc -l)" \
    "$(metric gpubudget_pod_table_rebuilds_total)" | tee -a "$WORK/results.txt"
  # The agent's CPU over IDLE seconds with nothing changing: sampling (replayed) and deciding every 250 ms.
  sleep "$SETTLE"
  # Besides the CPU time at 10 ms resolution (/proc/PID/stat), the scheduler's microseconds and the time the
  # agent measured inside its ticks (gpubudget_sample_duration_seconds: wall time of sample, attribution,
  # decisions and metrics), so that what the agent spends outside its ticks shows.
  local c0 u0 t0 n0 th0 rb0
  c0=$(cpu_ms "$AGENT_PID") u0=$(cpu_us "$AGENT_PID") th0=$(threads "$AGENT_PID")
  t0=$(metric gpubudget_sample_duration_seconds_sum) n0=$(metric gpubudget_sample_duration_seconds_count)
  rb0=$(metric gpubudget_pod_table_rebuilds_total)
  sockets "$AGENT_PID" > "$WORK/idle.sockets"
  if [ -n "${GPUBUDGET_E2E_PERF:-}" ]; then
    # A CPU profile of the agent over the window (perf's samples add to the CPU measured).
    perf record -q -F 4999 -g -p "$AGENT_PID" -o "$GPUBUDGET_E2E_PERF-$BUDGETS.data" -- sleep "$IDLE" 2>/dev/null
  else
    sleep "$IDLE"
  fi
  local us ticks tick_us
  us=$(( $(cpu_us "$AGENT_PID") - u0 ))
  ticks=$(echo "$(metric gpubudget_sample_duration_seconds_count) - $n0" | bc)
  tick_us=$(echo "($(metric gpubudget_sample_duration_seconds_sum) - $t0) * 1000000 / 1" | bc)
  printf '    IDLE   %-6s budgets=%s  agent_cpu=%sms in %s s (%s ticks) after %s s settling, received %s bytes\n' "$label" "$BUDGETS" \
    "$(( $(cpu_ms "$AGENT_PID") - c0 ))" "$IDLE" "$((IDLE * 4))" "$SETTLE" "$(received_since "$AGENT_PID" "$WORK/idle.sockets")" | tee -a "$WORK/results.txt"
  printf '    IDLE   %-6s budgets=%s  agent_cpu_us=%s (threads %s -> %s)  ticks=%s  inside_ticks_us=%s  per_tick_us=%s  outside_per_tick_us=%s  table_rebuilds=%s\n' \
    "$label" "$BUDGETS" "$us" "$th0" "$(threads "$AGENT_PID")" "$ticks" "$tick_us" "$((us / ticks))" "$(( (us - tick_us) / ticks ))" \
    "$(echo "$(metric gpubudget_pod_table_rebuilds_total) - $rb0" | bc)" | tee -a "$WORK/results.txt"
  # #34: with the operator's mirrors the agent closes its budget watch once every budget is mirrored; the
  # streams below then measure what reaches it with the mirrors alone.
  local waited=0
  mirrored() { metric 'gpubudget_budget_specs_from_mirrors{kind="GpuMemoryBudget"}'; }
  while [ "$(mirrored)" != 1 ] && [ "$waited" -lt 60 ] && [ "$BUDGETS" != 0 ]; do sleep 1; waited=$((waited + 1)); done
  printf '    MIRRORS %-6s budgets=%s  agent reads the mirrors only: %s (waited %s s)  operator mirror writes: %s\n' "$label" "$BUDGETS" \
    "$([ "$(mirrored)" = 1 ] && echo yes || echo no)" "$waited" \
    "$(curl -fsS "http://$OPERATOR_ADMIN/metrics" | awk '$1 == "gpubudget_operator_mirror_writes_total{result=\"written\"}" {print $2}')" \
    | tee -a "$WORK/results.txt"
  local kind
  for kind in $STREAMS; do
    local r0 c0
    sockets "$AGENT_PID" > "$WORK/sockets-before"
    r0=$(metric gpubudget_pod_table_rebuilds_total) c0=$(cpu_ms "$AGENT_PID")
    local names=$WORK/budget-names.txt write=$kind
    [ "$kind" != elsewhere ] || names=$WORK/elsewhere-names.txt write=spec
    info "$(GPUBUDGET_API=$SERVER GPUBUDGET_TOKEN=$ADMIN_TOKEN python3 "$HERE/load.py" stream "$write" "$names" "$RATE" 30)"
    sleep 1
    printf '    STREAM %-6s %-6s %s/s for 30 s: received=%.1fKiB  rebuilds=+%s  agent_cpu=%sms  rss=%.1fMiB  peak_rss=%.1fMiB\n' \
      "$label" "$kind" "$RATE" "$(echo "$(received_since "$AGENT_PID" "$WORK/sockets-before") / 1024" | bc -l)" \
      "$(( $(metric gpubudget_pod_table_rebuilds_total) - r0 ))" "$(( $(cpu_ms "$AGENT_PID") - c0 ))" \
      "$(awk '/VmRSS/ {print $2 / 1024}' "/proc/$AGENT_PID/status")" "$(awk '/VmHWM/ {print $2 / 1024}' "/proc/$AGENT_PID/status")" \
      | tee -a "$WORK/results.txt"
  done
  [ "$WRITES" != 1 ] || write_load "$label" "$pods"
  kill "$AGENT_PID"
  wait "$AGENT_PID" 2>/dev/null || true
  AGENT_PID=""
}

# sample LABEL FACTOR [CROSSING]: rewrites the replayed sample: pod j holds (1 + j % 8) GiB x FACTOR; with
# CROSSING (30, 37 or 42 GiB: Within, Near, Over of the 40Gi budgets) every tenth pod holds that instead.
sample() {
  python3 - "$WORK/pods-$1.json" "$WORK/sample-$1.json" "$2" "${3:-0}" <<'EOF'
import json, os, sys
pods, out, factor, crossing = json.load(open(sys.argv[1]))["items"], sys.argv[2], float(sys.argv[3]), int(sys.argv[4])
procs = []
for j, p in enumerate(pods):
    gib = crossing if crossing and j % 10 == 0 else (1 + j % 8) * factor
    procs.append({"namespace": p["metadata"]["namespace"], "pod": p["metadata"]["name"], "container": "main",
                  "used_bytes": int(gib * (1 << 30))})
json.dump({"version": 1, "gpus": [{"index": 0, "uuid": "GPU-scale", "name": "replayed", "memory_total_bytes": 85520809984,
           "processes": procs}]}, open(out + ".new", "w"))
os.replace(out + ".new", out)
EOF
}

# write_load LABEL PODS: the agent's writes per minute in each phase (GPUBUDGET_E2E_WRITES).
write_load() {
  local label=$1 pods=$2 w0 w1 t0 t i
  # mark: the start of a phase. phase NAME SECONDS: waits SECONDS, then prints the writes per minute since the mark.
  mark() { w0=$(writes); t0=$(date +%s.%N); }
  phase() {
    sleep "$2"
    w1=$(writes)
    local s
    s=$(echo "$(date +%s.%N) - $t0" | bc -l)
    printf '    WRITES %-6s %-17s (%3.0f s): %s\n' "$label" "$1" "$s" "$(per_minute "$w0" "$w1" "$s")" | tee -a "$WORK/results.txt"
  }
  say "$label: write load ($pods pods)"
  sleep 35 # past the first records' 30 s minimum interval
  mark; phase steady 60
  mark
  for i in $(seq 1 12); do sample "$label" "$([ $((i % 2)) = 0 ] && echo 1 || echo 1.2)"; sleep 5; done
  phase usage 0
  sample "$label" 1; sleep 35
  mark
  for i in $(seq 1 12); do sample "$label" 1 "$(echo "30 37 42" | cut -d' ' -f$(( (i - 1) % 3 + 1 )))"; sleep 5; done
  phase crossing 0
  sample "$label" 1; sleep 35
  mark
  for i in $(seq 1 60); do sample "$label" 1 "$([ $((i % 2)) = 0 ] && echo 30 || echo 37)"; sleep 1; done
  phase flapping 0
  sample "$label" 1; sleep 35
  mark
  jq -c '.items[]' "$WORK/pods-$label.json" > "$WORK/churn-pods"
  for i in $(seq 1 10); do
    t=$(sed -n "${i}p" "$WORK/churn-pods")
    kubectl delete pod -n "$(jq -r .metadata.namespace <<< "$t")" "$(jq -r .metadata.name <<< "$t")" --wait=false >/dev/null
    jq '.metadata.name += "-churn"' <<< "$t" | kubectl create -f - >/dev/null
    sleep 6
  done
  phase pod-churn 0
  sleep 30
  mark
  info "$(GPUBUDGET_API=$SERVER GPUBUDGET_TOKEN=$ADMIN_TOKEN python3 "$HERE/load.py" edit-all "$WORK/budget-names.txt" '{"limit":"48Gi"}')"
  phase budgets-edited 60
  mark
  info "$(GPUBUDGET_API=$SERVER GPUBUDGET_TOKEN=$ADMIN_TOKEN python3 "$HERE/load.py" edit-all "$WORK/budget-names.txt" '{"limit":"1Gi","action":"Warn"}')"
  phase budgets-tightened 60
  mark
  kill "$OPERATOR_PID"; wait "$OPERATOR_PID" 2>/dev/null || true
  start_operator
  phase operator-restart 60
  info "agent RSS after the write phases: $(awk '/VmRSS/ {printf "%.1f", $2 / 1024}' "/proc/$AGENT_PID/status") MiB (peak $(awk '/VmHWM/ {printf "%.1f", $2 / 1024}' "/proc/$AGENT_PID/status") MiB)"
}

for n in "${COUNTS[@]}"; do measure "n$n" "$n"; done
say "results ($BIN)"
cat "$WORK/results.txt"
info "operator RSS at the end: $(awk '/VmRSS/ {printf "%.1f", $2 / 1024}' "/proc/$OPERATOR_PID/status") MiB"
