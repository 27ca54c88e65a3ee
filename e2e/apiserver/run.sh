#!/usr/bin/env bash
# gpubudget against a real kube-apiserver, no kubelet (e2e/apiserver/README.md says what this covers and what not).
#
#   GPUBUDGET_E2E_APISERVER=1 KUBECONFIG=/tmp/realk8s/run/kubeconfig e2e/apiserver/run.sh
#   GPUBUDGET_E2E_APISERVER=1 REALK8S_DIR=/tmp/realk8s e2e/apiserver/run.sh     # starts it (up.sh) and stops it
#
# The control plane (kube-apiserver + etcd + kube-controller-manager, /work/shared/realk8s or any cluster whose
# admin is in KUBECONFIG) gets the CRD and the chart's rendered RBAC, admission policies and eviction webhook
# (URL mode, pointing at the operator on 127.0.0.1 with a certificate made here). The release binaries run on
# this machine, each with its own identity: the operator with its ServiceAccount's token, the agent with a token
# bound to its Node. Nodes and pods are API objects; the test plays the kubelet (pod status, /proc, deleting a
# pod once its processes exited) and NVML (a sample file). It asserts on real objects: records, Events,
# evictions and their grace, `kubectl get gmb`, the policies' and the webhook's refusals.
#
# Environment: GPUBUDGET_E2E_BIN (default target/release; built with `cargo build --release` when missing),
# HELM (default: helm in PATH, else the Helm .ci/helm.sh caches), GPUBUDGET_E2E_STEP_TIMEOUT (default 60 s per
# wait), GPUBUDGET_E2E_KEEP=1 keeps the namespaces, nodes and processes' logs. REALK8S (default
# /work/shared/realk8s): where up.sh/down.sh are.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
REPO=$(cd "$HERE/../.." && pwd)
REALK8S=${REALK8S:-/work/shared/realk8s}

# shellcheck source=../lib.sh
. "$REPO/e2e/lib.sh"
control_plane_or_skip "gpubudget e2e/apiserver" gpubudget-agent gpubudget-operator
STEP_TIMEOUT=${GPUBUDGET_E2E_STEP_TIMEOUT:-60}

ID=$(date +%s | tail -c 5)$RANDOM
ID=${ID:0:7}
NS=gpubudget-api-$ID           # the chart's namespace (its ServiceAccounts)
NS_A=gpubudget-api-$ID-a       # Evict and Warn stories, node restriction, the tenant
NS_B=gpubudget-api-$ID-b       # overlapping budgets, operator down and back
NODE=gpubudget-api-$ID-n1      # the agent's node
NODE2=gpubudget-api-$ID-n2     # another node
RELEASE=gpubudget-api-$ID
AGENT_SA=$RELEASE-agent
OPERATOR_SA=$RELEASE-operator
# The mirrors' Lease (#43), as the chart names it (<operator fullname>-mirrors) and its Roles allow: the operator
# renews it while every budget has a current mirror; the agent reads the mirrors only while it is renewed.
MIRRORS_LEASE=$RELEASE-operator-mirrors
WORK=$(mktemp -d "${TMPDIR:-/tmp}/gpubudget-apiserver-e2e.XXXXXX")
CRD=gpumemorybudgets.gpubudget.io
CRD_EXISTED=$(kubectl get crd "$CRD" -o name 2>/dev/null || true)
# Ports on 127.0.0.1 for the binaries: admin (agent, operator) and the webhook.
PORT_BASE=$((20000 + RANDOM % 20000))
AGENT_ADMIN=127.0.0.1:$PORT_BASE
OPERATOR_ADMIN=127.0.0.1:$((PORT_BASE + 1))
WEBHOOK=127.0.0.1:$((PORT_BASE + 2))
AGENT_PID="" OPERATOR_PID="" EXTRA_PIDS=""
FAILED=1
START=$SECONDS

POLL=0.5


diagnostics() {
  say "diagnostics"
  for ns in "$NS_A" "$NS_B"; do
    kubectl get pods -n "$ns" -o wide --show-labels || true
    kubectl get events -n "$ns" --sort-by=.lastTimestamp || true
    kubectl get gmb -n "$ns" -o yaml || true
  done
  echo "--- operator log (last 60 lines)"; tail -n 60 "$WORK"/operator*.log 2>/dev/null || true
  echo "--- agent log (last 100 lines)"; tail -n 100 "$WORK"/agent*.log 2>/dev/null || true
}

cleanup() {
  local rc=$?
  [ "$FAILED" = 0 ] || diagnostics
  stop_process "$AGENT_PID"
  stop_process "$OPERATOR_PID"
  for pid in $EXTRA_PIDS; do stop_process "$pid"; done
  if [ "${GPUBUDGET_E2E_KEEP:-0}" = 1 ]; then
    say "keeping namespaces $NS $NS_A $NS_B, nodes $NODE $NODE2 and $WORK (GPUBUDGET_E2E_KEEP=1)"
  else
    say "cleanup"
    kubectl delete validatingwebhookconfiguration "$AGENT_SA-eviction" --ignore-not-found >/dev/null 2>&1 || true
    kubectl delete validatingadmissionpolicybinding,validatingadmissionpolicy -l "app.kubernetes.io/instance=$RELEASE" \
      --ignore-not-found >/dev/null 2>&1 || true
    kubectl delete clusterrolebinding,clusterrole -l "app.kubernetes.io/instance=$RELEASE" --ignore-not-found >/dev/null 2>&1 || true
    kubectl delete namespace "$NS" "$NS_A" "$NS_B" --wait=false --ignore-not-found >/dev/null 2>&1 || true
    kubectl delete node "$NODE" "$NODE2" --ignore-not-found >/dev/null 2>&1 || true
    [ -n "$CRD_EXISTED" ] || kubectl delete crd "$CRD" --wait=false --ignore-not-found >/dev/null 2>&1 || true
    rm -rf "$WORK"
  fi
  if [ "$STARTED_REALK8S" = 1 ]; then bash "$REALK8S/down.sh" >/dev/null 2>&1 || true; fi
  exit "$rc"
}
trap cleanup EXIT



say "control plane"
kubectl version 2>/dev/null | sed 's/^/    /'
SERVER_MINOR=$(kubectl version -o json 2>/dev/null | jq -r '.serverVersion.minor' | tr -dc 0-9)
[ "${SERVER_MINOR:-0}" -ge 32 ] || die "needs Kubernetes 1.32 or newer (ValidatingAdmissionPolicy, node-bound tokens); server minor ${SERVER_MINOR:-unknown}"
info "helm: $("$HELM" version --short)  binaries: $BIN  run id: $ID  work: $WORK"

say "CRD, the chart's RBAC, admission policies and eviction webhook (helm template; the webhook in URL mode)"
# Both CRDs: the agent watches ClusterGpuMemoryBudgets too, and is not ready before that list.
kubectl apply -f "$REPO/crds/" >/dev/null
kubectl wait --for=condition=Established "crd/$CRD" crd/clustergpumemorybudgets.gpubudget.io --timeout=60s >/dev/null
kubectl create namespace "$NS" >/dev/null
kubectl create namespace "$NS_A" >/dev/null
kubectl create namespace "$NS_B" >/dev/null
for ns in "$NS" "$NS_A" "$NS_B"; do   # pods need their namespace's default ServiceAccount (controller-manager)
  wait_for "ServiceAccount default in $ns" kubectl get serviceaccount default -n "$ns"
done
# The webhook's serving certificate, for 127.0.0.1 (the operator runs on this machine, not behind a Service).
mkdir -p "$WORK/tls" "$WORK/proc"
webhook_cert "$WORK/tls"
CA_BUNDLE=$(base64 -w0 < "$WORK/tls/ca.crt")
# Rendered for 1.33 (the chart's floor is 1.32); the kinds rendered here are served the same by 1.32.
"$HELM" template "$RELEASE" "$REPO/charts/gpubudget" -n "$NS" --kube-version 1.33.0 > "$WORK/chart.yaml"
# shellcheck disable=SC2016 # $url and $ca are yq's variables
yq -y --arg url "https://$WEBHOOK/validate-eviction" --arg ca "$CA_BUNDLE" '
  select(.kind == "ServiceAccount" or .kind == "ClusterRole" or .kind == "ClusterRoleBinding" or .kind == "Role"
         or .kind == "RoleBinding" or .kind == "ValidatingAdmissionPolicy" or .kind == "ValidatingAdmissionPolicyBinding"
         or .kind == "ValidatingWebhookConfiguration")
  | if .kind == "ValidatingWebhookConfiguration"
    then .webhooks |= map(.clientConfig = {url: $url, caBundle: $ca}) else . end' "$WORK/chart.yaml" > "$WORK/applied.yaml"
kubectl apply -f "$WORK/applied.yaml" | sed 's/^/    /'
[ "$(yq -r 'select(.kind == "ValidatingAdmissionPolicy") | .metadata.name' "$WORK/applied.yaml" | grep -c .)" = 5 ] \
  || die "expected the chart's five admission policies (node restriction of pods, events and usage objects, records, caps record)"

say "nodes, pods (API objects; the test is their kubelet), identities"
for n in "$NODE" "$NODE2"; do
  kubectl create -f - >/dev/null <<EOF
apiVersion: v1
kind: Node
metadata: {name: $n, labels: {nvidia.com/gpu.present: "true", e2e.gpubudget.io/run: "$ID"}}
EOF
  kubectl patch node "$n" --subresource=status --type=merge \
    -p '{"status":{"conditions":[{"type":"Ready","status":"True","reason":"KubeletReady","message":"played by the e2e test"}]}}' >/dev/null
done
# make_pod NAMESPACE NAME NODE LABELS(k=v,...): a running pod with one container "main", as the kubelet reports
# it; prints nothing. Its container ID is 64 hex digits derived from the name.
make_pod() {
  local labels="" kv
  IFS=, read -ra kvs <<<"$4"
  for kv in "${kvs[@]}"; do [ -n "$kv" ] && labels+="    ${kv%%=*}: \"${kv#*=}\""$'\n'; done
  kubectl create -f - >/dev/null <<EOF
apiVersion: v1
kind: Pod
metadata:
  name: $2
  namespace: $1
  labels:
    e2e.gpubudget.io/run: "$ID"
${labels}spec:
  nodeName: $3
  terminationGracePeriodSeconds: 60
  containers: [{name: main, image: registry.k8s.io/pause:3.10}]
EOF
  pod_running "$1" "$2"
}
# process PID NAMESPACE POD: a process of the pod's container in the fixture /proc, with the kubelet's cgroup
# (systemd driver, containerd, burstable QoS), as on a real node.
process() { fake_process "$WORK/proc" "$@"; }
make_pod "$NS_A" llm-evict "$NODE" app=llm              # Evict: 6Gi → 7.5Gi → 9Gi of 8Gi (two processes)
make_pod "$NS_A" trainer "$NODE" job-type=training      # Warn: 20Gi → 35Gi → 45Gi of 40Gi (warn at 80 %)
make_pod "$NS_A" remote-a "$NODE2" app=llm              # on the other node: never the agent's
make_pod "$NS_B" llm-b "$NODE" app=llm                  # llm-inference (8Gi) and team-b-default (20Gi)
make_pod "$NS_B" other-b "$NODE" tier=batch             # team-b-default only
process 4101 "$NS_A" llm-evict
process 4102 "$NS_A" llm-evict
process 4103 "$NS_A" trainer
process 4104 "$NS_B" llm-b
process 4105 "$NS_B" other-b
process 4106 "$NS_A" remote-a                           # sampled here, but its pod is not on this node

# write_sample EVICT_A EVICT_B TRAINER LLM_B [OTHER_B [DEVICE_USED [HELD]]]: what NVML reports (bytes per process,
# and the device's used bytes when given and not empty: the pressure signal), written atomically.
write_sample() {
  local other=${5:-2147483648} used=""
  [ -n "${6:-}" ] && used="\"memory_used_bytes\": $6,"
  cat > "$WORK/sample.tmp" <<EOF
{"version": 1, "gpus": [{"index": 0, "uuid": "GPU-e2e00000-0000-0000-0000-000000000000", "name": "replayed e2e GPU",
 "memory_total_bytes": 85520809984, $used "processes": [
  {"pid": 4101, "used_bytes": $1}, {"pid": 4102, "used_bytes": $2}, {"pid": 4103, "used_bytes": $3},
  {"pid": 4104, "used_bytes": $4}, {"pid": 4105, "used_bytes": $other}, {"pid": 4106, "used_bytes": 53687091200},
  {"pid": 4107, "used_bytes": ${7:-0}}]}]}
EOF
  mv "$WORK/sample.tmp" "$WORK/sample.json"
}
GI=1073741824
write_sample $((5 * GI)) $((1 * GI)) $((20 * GI)) $((1 * GI))

# kubeconfig NAME TOKEN: a kubeconfig for the control plane of KUBECONFIG with that bearer token.
SERVER=$(kubectl config view --minify -o jsonpath='{.clusters[0].cluster.server}')
CA_DATA=$(kubectl config view --raw --minify -o jsonpath='{.clusters[0].cluster.certificate-authority-data}')
kubeconfig() {
  local tls="insecure-skip-tls-verify: true"
  [ -z "$CA_DATA" ] || tls="certificate-authority-data: $CA_DATA"
  cat > "$WORK/$1.kubeconfig" <<EOF
apiVersion: v1
kind: Config
clusters: [{name: e2e, cluster: {server: "$SERVER", $tls}}]
users: [{name: $1, user: {token: "$2"}}]
contexts: [{name: e2e, context: {cluster: e2e, user: $1, namespace: default}}]
current-context: e2e
EOF
  chmod 600 "$WORK/$1.kubeconfig"
  echo "$WORK/$1.kubeconfig"
}
OPERATOR_KC=$(kubeconfig operator "$(kubectl create token "$OPERATOR_SA" -n "$NS" --duration=2h)")
AGENT_KC=$(kubeconfig agent "$(kubectl create token "$AGENT_SA" -n "$NS" --duration=2h --bound-object-kind Node --bound-object-name "$NODE")")
AGENT2_KC=$(kubeconfig agent-n2 "$(kubectl create token "$AGENT_SA" -n "$NS" --duration=2h --bound-object-kind Node --bound-object-name "$NODE2")")
UNBOUND_KC=$(kubeconfig agent-unbound "$(kubectl create token "$AGENT_SA" -n "$NS" --duration=2h)")
kubectl create serviceaccount tenant -n "$NS_A" >/dev/null
kubectl create rolebinding tenant-edit -n "$NS_A" --clusterrole=edit --serviceaccount="$NS_A:tenant" >/dev/null
TENANT_KC=$(kubeconfig tenant "$(kubectl create token tenant -n "$NS_A" --duration=2h)")
WHO=$(kubectl --kubeconfig "$AGENT_KC" auth whoami -o json | jq -r '.status.userInfo.extra["authentication.kubernetes.io/node-name"][0]')
[ "$WHO" = "$NODE" ] || die "the agent's token does not carry its node: $WHO"
info "agent: $(kubectl --kubeconfig "$AGENT_KC" auth whoami -o jsonpath='{.status.userInfo.username}') bound to node $WHO"

start_operator() {
  KUBECONFIG=$OPERATOR_KC POD_NAMESPACE=$NS POD_NAME=operator-e2e RUST_LOG=info,gpubudget_operator=debug \
    "$BIN/gpubudget-operator" run --admin-addr "$OPERATOR_ADMIN" --webhook-addr "$WEBHOOK" \
    --webhook-cert-dir "$WORK/tls" --mirrors-lease-name "$MIRRORS_LEASE" >> "$WORK/operator.log" 2>&1 &
  OPERATOR_PID=$!
  wait_for "operator ready (pid $OPERATOR_PID)" ready "$OPERATOR_ADMIN"
}
AGENT_RUNS=0
start_agent() {
  AGENT_RUNS=$((AGENT_RUNS + 1))
  KUBECONFIG=$AGENT_KC RUST_LOG=info,gpubudget_agent=debug "$BIN/gpubudget-agent" run --node-name "$NODE" \
    --proc-root "$WORK/proc" --sample-file "$WORK/sample.json" --interval 250ms --admin-addr "$AGENT_ADMIN" \
    --mirrors-lease "$NS/$MIRRORS_LEASE" > "$WORK/agent-$AGENT_RUNS.log" 2>&1 &
  AGENT_PID=$!
  wait_for "agent ready (pid $AGENT_PID, run $AGENT_RUNS)" ready "$AGENT_ADMIN"
}
say "the release binaries, out of cluster, each with its own identity"
start_operator
start_agent

say "budgets from examples/ (namespaces rewritten)"
apply_example() { # FILE NAMESPACE
  sed -E "s/^([[:space:]]*namespace:[[:space:]]*).*/\1$2/" "$REPO/examples/$1" | kubectl apply -f - | sed 's/^/    /'
}
apply_example llm-inference.yaml "$NS_A"
apply_example training-warn.yaml "$NS_A"
apply_example namespace-wide.yaml "$NS_B"
apply_example llm-inference.yaml "$NS_B"

say "records: what the agent attributes through /proc, on the pods of its node only"
wait_for "llm-evict recorded Within at 6Gi under llm-inference on $NODE" bash -c \
  "[ \"\$(kubectl get pod llm-evict -n $NS_A -o jsonpath='{.metadata.annotations.gpubudget\.io/state}/{.metadata.annotations.gpubudget\.io/usage-bytes}/{.metadata.annotations.gpubudget\.io/budget}/{.metadata.annotations.gpubudget\.io/node}')\" = Within/$((6 * GI))/llm-inference/$NODE ]"
wait_for "trainer recorded under training-audit" annotation_is "$NS_A" trainer budget training-audit
wait_for "llm-b recorded under llm-inference (the smaller of two budgets)" annotation_is "$NS_B" llm-b budget llm-inference
wait_for "other-b recorded under team-b-default" annotation_is "$NS_B" other-b budget team-b-default
[ -z "$(annotation "$NS_A" remote-a state)" ] || die "remote-a (node $NODE2) got a record from the agent of $NODE"
MANAGERS=$(kubectl get pod llm-evict -n "$NS_A" --show-managed-fields -o json | jq -r '[.metadata.managedFields[].manager] | join(",")')
[[ "$MANAGERS" == *"gpubudget-agent/$NODE"* ]] || die "no field manager gpubudget-agent/$NODE on llm-evict: $MANAGERS"
info "field managers of llm-evict: $MANAGERS"

say "usage: one GpuNodeUsage per node (#34), named after it, owned by its Node, the pods' bytes in it"
# usage_of POD: the bytes the GpuNodeUsage of NODE gives for the pod (empty when not listed).
usage_of() {
  kubectl get gpunodeusage "$NODE" -o json 2>/dev/null | jq -r --arg p "$1" '.spec.pods[] | select(.name == $p) | .usageBytes'
}
wait_for "GpuNodeUsage $NODE lists llm-evict at 6Gi" bash -c "[ \"\$(kubectl get gpunodeusage $NODE -o json | jq -r '.spec.pods[] | select(.name == \"llm-evict\") | .usageBytes')\" = $((6 * GI)) ]"
OWNER=$(kubectl get gpunodeusage "$NODE" -o jsonpath='{.metadata.ownerReferences[0].kind}/{.metadata.ownerReferences[0].name}/{.metadata.ownerReferences[0].uid}')
[ "$OWNER" = "Node/$NODE/$(kubectl get node "$NODE" -o jsonpath='{.metadata.uid}')" ] || die "GpuNodeUsage $NODE's owner: $OWNER"
[ -z "$(usage_of remote-a)" ] || die "the GpuNodeUsage of $NODE lists remote-a (node $NODE2)"
USAGE_MANAGERS=$(kubectl get gpunodeusage "$NODE" --show-managed-fields -o json | jq -r '[.metadata.managedFields[].manager] | join(",")')
[ "$USAGE_MANAGERS" = "gpubudget-agent/$NODE" ] || die "field managers of GpuNodeUsage $NODE: $USAGE_MANAGERS"
kubectl get gpunodeusages | sed 's/^/    /'

say "Near: llm-evict 7.5Gi of 8Gi, trainer 35Gi of 40Gi (Warn, 80 %)"
write_sample $((6 * GI)) $((3 * GI / 2)) $((35 * GI)) $((1 * GI))
wait_for "GpuMemoryNearBudget on llm-evict" has_event "$NS_A" llm-evict GpuMemoryNearBudget
wait_for "GpuMemoryNearBudget on trainer" has_event "$NS_A" trainer GpuMemoryNearBudget
MSG=$(event_messages "$NS_A" llm-evict GpuMemoryNearBudget | tail -n1)
info "llm-evict: $MSG"
[[ "$MSG" == *"7.5Gi of 8Gi"* && "$MSG" == *"pid 4101"* && "$MSG" == *"pid 4102"* ]] \
  || die "the Near message should give 7.5Gi of 8Gi and both processes: $MSG"
EV=$(events "$NS_A" llm-evict GpuMemoryNearBudget | jq -r '.[0] | "\(.type) \(.reportingController) \(.reportingInstance) \(.action)"')
[ "$EV" = "Warning gpubudget-agent $NODE Measure" ] || die "Near event: type, reportingController, reportingInstance, action = $EV"

say "Over: llm-evict 9Gi of 8Gi (Evict, overLimitSeconds 10, grace 30 s), trainer 45Gi of 40Gi (Warn)"
write_sample $((7 * GI)) $((2 * GI)) $((45 * GI)) $((1 * GI))
wait_for "GpuMemoryOverBudget on llm-evict" has_event "$NS_A" llm-evict GpuMemoryOverBudget
OVER_AT=$SECONDS
wait_for "GpuMemoryOverBudget on trainer" has_event "$NS_A" trainer GpuMemoryOverBudget
MSG=$(event_messages "$NS_A" llm-evict GpuMemoryOverBudget | tail -n1)
info "llm-evict: $MSG"
[[ "$MSG" == *"9Gi of 8Gi"* && "$MSG" == *"evicting if it stays over for 10s"* ]] || die "Over message: $MSG"
MSG=$(event_messages "$NS_A" trainer GpuMemoryOverBudget | tail -n1)
[[ "$MSG" == *"action is Warn: not evicted for being over its limit"* ]] || die "trainer's Over message: $MSG"

say "eviction: after 10 s over, through the Eviction API (the webhook allows the agent's own node), grace 30 s"
wait_for "llm-evict terminating" terminating "$NS_A" llm-evict
GRACE=$(kubectl get pod llm-evict -n "$NS_A" -o jsonpath='{.metadata.deletionGracePeriodSeconds}')
[ "$GRACE" = 30 ] || die "deletionGracePeriodSeconds $GRACE, not the budget's 30 (the pod's own is 60)"
# When the API server took the eviction (deletionTimestamp - grace, whole seconds) against when the agent
# published GpuMemoryOverBudget (eventTime, microseconds): at least overLimitSeconds apart, less one second for
# the truncation.
DELETION=$(kubectl get pod llm-evict -n "$NS_A" -o jsonpath='{.metadata.deletionTimestamp}')
OVER_EVENT=$(events "$NS_A" llm-evict GpuMemoryOverBudget | jq -r '.[0].eventTime')
EVICTED_AFTER=$(( $(date -d "$DELETION" +%s) - GRACE - $(date -d "$OVER_EVENT" +%s) ))
[ "$EVICTED_AFTER" -ge 9 ] || die "llm-evict was evicted ${EVICTED_AFTER}s after its Over event, before overLimitSeconds (10 s)"
info "evicted ${EVICTED_AFTER}s after the Over event, deletionGracePeriodSeconds $GRACE (budget 30, pod 60)"
wait_for "EvictingForGpuMemory on llm-evict" has_event "$NS_A" llm-evict EvictingForGpuMemory
MSG=$(event_messages "$NS_A" llm-evict EvictingForGpuMemory)
info "llm-evict: $MSG"
[[ "$MSG" == *"evicting with 30s grace"* && "$MSG" == *llm-inference* ]] || die "Evicting message: $MSG"
annotation_is "$NS_A" llm-evict state Evicting || die "llm-evict's state is $(annotation "$NS_A" llm-evict state)"
REQUESTED_AT=$(annotation "$NS_A" llm-evict eviction-requested-at)
[ -n "$REQUESTED_AT" ] || die "no eviction-requested-at on llm-evict"
grep -q "agent-eviction.gpubudget.io\|eviction denied" "$WORK/operator.log" && die "the webhook denied an eviction of the agent's own node"

say "the agent restarted in the middle of the grace period: no event repeated, no second eviction"
stop_process "$AGENT_PID"
start_agent
sleep 3
[ "$(event_occurrences "$NS_A" llm-evict EvictingForGpuMemory)" = 1 ] \
  || die "EvictingForGpuMemory on llm-evict: $(events "$NS_A" llm-evict EvictingForGpuMemory)"
[ "$(event_occurrences "$NS_A" llm-evict GpuMemoryOverBudget)" = 1 ] || die "GpuMemoryOverBudget repeated after the restart"
[ "$(event_occurrences "$NS_A" llm-evict GpuMemoryNearBudget)" = 1 ] || die "GpuMemoryNearBudget repeated after the restart"
ACCEPTED=$(cat "$WORK"/agent-*.log | grep "eviction requested and accepted" | grep -c "llm-evict" || true)
[ "$ACCEPTED" = 1 ] || die "$ACCEPTED accepted evictions of llm-evict in the agent's logs (both runs)"
annotation_is "$NS_A" llm-evict eviction-requested-at "$REQUESTED_AT" || die "eviction-requested-at changed after the restart"
info "one EvictingForGpuMemory event, one accepted eviction, record unchanged ($REQUESTED_AT)"

say "the kubelet's part: the processes exit on SIGTERM, the pod is deleted; the operator counts one eviction"
write_sample 0 0 $((45 * GI)) $((1 * GI))
rm -rf "$WORK/proc/4101" "$WORK/proc/4102"
kubectl delete pod llm-evict -n "$NS_A" --grace-period=0 --force >/dev/null 2>&1
wait_for "llm-inference EVICTED 1" status_is "$NS_A" llm-inference evictions 1
wait_for "llm-inference lastEviction names llm-evict" status_is "$NS_A" llm-inference lastEviction.pod llm-evict
gmb_row() { kubectl get gmb "$2" -n "$1" --no-headers | tr -s ' ' | cut -d' ' -f1-6; }
gmb_row_is() { [ "$(gmb_row "$1" "$2")" = "$3" ]; }
# No request set, no admissionCaps, no share: kubectl leaves the REQUEST, CAPPED and SHARE cells empty (tr -s squeezes them out).
# MATCHED counts remote-a (app=llm, on the other node): the operator reports every pod a budget selects.
wait_for "kubectl get gmb: llm-inference 8Gi Evict, MATCHED 1 (remote-a), OVER 0, EVICTED 1" gmb_row_is "$NS_A" llm-inference "llm-inference 8Gi Evict 1 0 1"
kubectl get gmb -n "$NS_A" | tee "$WORK/gmb-a.txt" | sed 's/^/    /'
HEADER=$(head -n1 "$WORK/gmb-a.txt" | tr -s ' ')
[ "$HEADER" = "NAME REQUEST LIMIT ACTION MATCHED OVER CAPPED SHARE EVICTED AGE" ] || die "kubectl get gmb columns: $HEADER"
kubectl get gmb llm-inference -n "$NS_A" -o jsonpath='{.status.lastEviction}' | sed 's/^/    lastEviction: /'; echo

say "Warn: trainer stays over 40Gi past overLimitSeconds (30 s), events only"
REMAINING=$((OVER_AT + 40 - SECONDS))
[ "$REMAINING" -le 0 ] || sleep "$REMAINING"
has_event "$NS_A" trainer EvictingForGpuMemory && die "trainer (action Warn) got an EvictingForGpuMemory event"
terminating "$NS_A" trainer && die "trainer (action Warn) is being deleted"
annotation_is "$NS_A" trainer state Over || die "trainer's recorded state is $(annotation "$NS_A" trainer state), not Over"
wait_for "training-audit OVER 1" status_is "$NS_A" training-audit podsOverBudget 1
wait_for "kubectl get gmb: training-audit 40Gi Warn, MATCHED 1, OVER 1, EVICTED 0" gmb_row_is "$NS_A" training-audit "training-audit 40Gi Warn 1 1 0"
info "trainer is still running, Over, never evicted"

say "overlapping budgets: llm-b is matched by llm-inference (8Gi) and team-b-default (20Gi)"
wait_for "llm-inference Overlapping=True" condition_is "$NS_B" llm-inference Overlapping True
wait_for "team-b-default Overlapping=True" condition_is "$NS_B" team-b-default Overlapping True
wait_for "llm-inference MATCHED 1 (llm-b: the smaller limit wins)" status_is "$NS_B" llm-inference matchedPods 1
wait_for "team-b-default MATCHED 1 (other-b)" status_is "$NS_B" team-b-default matchedPods 1
kubectl get gmb -n "$NS_B" | sed 's/^/    /'
[ "$(kubectl get events -n "$NS_B" --field-selector involvedObject.kind=GpuMemoryBudget,reason=Overlapping -o name | wc -l)" -ge 2 ] \
  || die "no Overlapping events on both budgets"

say "node restriction, by the real admission policies and webhook"
# refused EXPECTED-TEXT DESCRIPTION COMMAND...: the command must fail, saying EXPECTED-TEXT.
refused() {
  local expect=$1 what=$2 out
  shift 2
  if out=$("$@" 2>&1); then die "$what was allowed: $out"; fi
  [[ "$out" == *"$expect"* ]] || die "$what was refused, but not for the expected reason ($expect): $out"
  info "refused: $what: ${out:0:220}"
}
# annotate KUBECONFIG NAMESPACE POD KEY=VALUE: a merge patch of one annotation (a value "null" removes it),
# sent as the PATCH alone (kubectl patch reads the pod first, and the agent may not get pods); the API's answer
# goes to stderr when refused.
annotate() {
  local value=\"${4#*=}\" server token body code
  [ "${4#*=}" != null ] || value=null
  server=$(kubectl --kubeconfig "$1" config view --raw -o jsonpath='{.clusters[0].cluster.server}')
  token=$(kubectl --kubeconfig "$1" config view --raw -o jsonpath='{.users[0].user.token}')
  body=$(mktemp)
  code=$(curl -sk -o "$body" -w '%{http_code}' -X PATCH -H "Authorization: Bearer $token" \
    -H 'Content-Type: application/merge-patch+json' --data "{\"metadata\":{\"annotations\":{\"${4%%=*}\":$value}}}" \
    "$server/api/v1/namespaces/$2/pods/$3")
  if [ "$code" -ge 300 ]; then cat "$body" >&2; rm -f "$body"; return 1; fi
  rm -f "$body"
}
printf '{"apiVersion":"policy/v1","kind":"Eviction","metadata":{"name":"%s","namespace":"%s"}}' remote-a "$NS_A" > "$WORK/evict-remote.json"
printf '{"apiVersion":"policy/v1","kind":"Eviction","metadata":{"name":"%s","namespace":"%s"}}' other-b "$NS_B" > "$WORK/evict-other-b.json"
# Own node: allowed (the agent's records and its eviction above went through the same checks).
annotate "$AGENT_KC" "$NS_B" other-b gpubudget.io/e2e-probe=own-node >/dev/null \
  || die "the agent could not annotate a pod of its own node"
annotate "$AGENT_KC" "$NS_B" other-b gpubudget.io/e2e-probe=null >/dev/null
info "allowed: the agent of $NODE annotates other-b (on $NODE)"
refused "not on its node" "the agent of $NODE annotating remote-a (on $NODE2)" \
  annotate "$AGENT_KC" "$NS_A" remote-a gpubudget.io/state=Over
refused "may evict only pods of node $NODE" "the agent of $NODE evicting remote-a (on $NODE2)" \
  kubectl --kubeconfig "$AGENT_KC" create --raw "/api/v1/namespaces/$NS_A/pods/remote-a/eviction" -f "$WORK/evict-remote.json"
refused "not on its node" "the agent of $NODE2 annotating other-b (on $NODE)" \
  annotate "$AGENT2_KC" "$NS_B" other-b gpubudget.io/state=Over
refused "may evict only pods of node $NODE2" "the agent of $NODE2 evicting other-b (on $NODE)" \
  kubectl --kubeconfig "$AGENT2_KC" create --raw "/api/v1/namespaces/$NS_B/pods/other-b/eviction" -f "$WORK/evict-other-b.json"
refused "carries no node" "the agent's identity with an unbound token annotating other-b" \
  annotate "$UNBOUND_KC" "$NS_B" other-b gpubudget.io/state=Over
refused "gpubudget" "the agent's identity with an unbound token evicting other-b" \
  kubectl --kubeconfig "$UNBOUND_KC" create --raw "/api/v1/namespaces/$NS_B/pods/other-b/eviction" -f "$WORK/evict-other-b.json"
refused "which is not on its node" "the agent of $NODE deleting remote-a (on $NODE2; it may delete pods of its own node only, after blockedEvictionTimeoutSeconds)" \
  kubectl --kubeconfig "$AGENT_KC" delete pod remote-a -n "$NS_A" --wait=false
cat > "$WORK/forged-event.yaml" <<EOF
apiVersion: events.k8s.io/v1
kind: Event
metadata: {name: forged-$ID, namespace: $NS_B}
eventTime: "$(date -u +%Y-%m-%dT%H:%M:%S.000000Z)"
reportingController: gpubudget-agent
reportingInstance: $NODE
action: Evict
reason: EvictingForGpuMemory
type: Warning
note: forged by the agent of another node
regarding: {apiVersion: v1, kind: Pod, name: other-b, namespace: $NS_B}
EOF
refused "must have reportingController gpubudget-agent and reportingInstance $NODE2" \
  "the agent of $NODE2 publishing an event as $NODE" kubectl --kubeconfig "$AGENT2_KC" create -f "$WORK/forged-event.yaml"
refused "only the agent may set, change or remove them" "the tenant (edit in $NS_A) forging trainer's record" \
  annotate "$TENANT_KC" "$NS_A" trainer gpubudget.io/state=Within
refused "only the agent may set, change or remove them" "the tenant creating a pod with a record" \
  kubectl --kubeconfig "$TENANT_KC" run forged -n "$NS_A" --image=registry.k8s.io/pause:3.10 \
  --annotations=gpubudget.io/eviction-requested-at=2026-01-01T00:00:00Z
# The usage object (#34): each agent writes only the one named after its node, naming its node, owned by it.
usage_body() { # NAME NODE_NAME
  printf '{"apiVersion":"gpubudget.io/v1alpha1","kind":"GpuNodeUsage","metadata":{"name":"%s"},"spec":{"nodeName":"%s","observedAt":"%s","podCount":0,"total":"0","pods":[]}}' \
    "$1" "$2" "$(date -u +%Y-%m-%dT%H:%M:%SZ)"
}
apply_usage() { # KUBECONFIG NAME NODE_NAME
  usage_body "$2" "$3" | kubectl --kubeconfig "$1" apply --server-side --force-conflicts --field-manager "e2e-$(basename "$1")" -f -
}
refused "spec.nodeName must be $NODE2" "the agent of $NODE2 writing its own object naming $NODE" \
  apply_usage "$AGENT2_KC" "$NODE2" "$NODE"
apply_usage "$AGENT2_KC" "$NODE2" "$NODE2" >/dev/null || die "the agent of $NODE2 could not write its own GpuNodeUsage"
info "allowed: the agent of $NODE2 writes GpuNodeUsage $NODE2"
refused "may write only the GpuNodeUsage $NODE2, not $NODE" "the agent of $NODE2 writing GpuNodeUsage $NODE" \
  apply_usage "$AGENT2_KC" "$NODE" "$NODE"
refused "carries no node" "the agent's identity with an unbound token writing GpuNodeUsage $NODE" \
  apply_usage "$UNBOUND_KC" "$NODE" "$NODE"
refused "forbidden" "the tenant (edit in $NS_A) writing GpuNodeUsage $NODE" apply_usage "$TENANT_KC" "$NODE" "$NODE"
refused "forbidden" "the tenant (edit in $NS_A) reading the nodes' usage" kubectl --kubeconfig "$TENANT_KC" get gpunodeusages
# Owned by its Node (the agent's own writes name it as owner): deleted with the Node, at the end of the run.
usage_body "$NODE2" "$NODE2" \
  | jq --arg uid "$(kubectl get node "$NODE2" -o jsonpath='{.metadata.uid}')" --arg n "$NODE2" \
    '.metadata.ownerReferences = [{"apiVersion": "v1", "kind": "Node", "name": $n, "uid": $uid}]' \
  | kubectl --kubeconfig "$AGENT2_KC" apply --server-side --force-conflicts --field-manager e2e-agent2 -f - >/dev/null \
  || die "the agent of $NODE2 could not name its Node as its usage object's owner"
annotate "$TENANT_KC" "$NS_A" trainer team.example/owner=me >/dev/null \
  || die "the tenant could not set its own annotation on its pod"
info "allowed: the tenant's own annotations on its pods"
terminating "$NS_B" other-b && die "other-b is being deleted"
terminating "$NS_A" remote-a && die "remote-a is being deleted"
annotation_is "$NS_A" trainer state Over || die "trainer's record changed: $(annotation "$NS_A" trainer state)"

say "mirrors (#34): the operator copies each budget's spec; the agent reads the mirrors alone, so no status write reaches it"
wait_for "the operator vouches for the mirrors (Lease $NS/$MIRRORS_LEASE)" kubectl get lease "$MIRRORS_LEASE" -n "$NS"
wait_for "the agent reads the mirrors only (--mirrors-lease $NS/$MIRRORS_LEASE renewed under its eyes)" bash -c \
  "curl -fsS http://$AGENT_ADMIN/metrics | grep -q '^gpubudget_budget_specs_from_mirrors{kind=\"GpuMemoryBudget\"} 1'"
MIRROR=$(kubectl get gmbmirror llm-inference -n "$NS_A" -o json)
BUDGET=$(kubectl get gmb llm-inference -n "$NS_A" -o json)
[ "$(jq -c .spec.budget <<<"$MIRROR")" = "$(jq -c .spec <<<"$BUDGET")" ] || die "the mirror's spec is not the budget's"
[ "$(jq -r '.metadata.ownerReferences[0] | "\(.kind)/\(.uid)/\(.controller)"' <<<"$MIRROR")" = "GpuMemoryBudget/$(jq -r .metadata.uid <<<"$BUDGET")/true" ] \
  || die "the mirror is not owned by its budget"
[ "$(jq -r '.metadata.annotations["gpubudget.io/budget-generation"]' <<<"$MIRROR")" = "$(jq -r .metadata.generation <<<"$BUDGET")" ] \
  || die "the mirror's generation is not the budget's"
info "gmbmirror/llm-inference: the budget's spec at generation $(jq -r .metadata.generation <<<"$BUDGET"), owned by it"
jq --arg ns "$NS_A" '.metadata = {name: "forged", namespace: $ns}' <<<"$MIRROR" > "$WORK/forged-mirror.json"
refused "forbidden" "the tenant (edit in $NS_A) writing a mirror" \
  kubectl --kubeconfig "$TENANT_KC" create -f "$WORK/forged-mirror.json"
refused "forbidden" "the agent writing a mirror" kubectl --kubeconfig "$AGENT_KC" create -f "$WORK/forged-mirror.json"
refused "forbidden" "the tenant (edit in $NS_A) deleting a mirror" \
  kubectl --kubeconfig "$TENANT_KC" delete gmbmirror llm-inference -n "$NS_A"
kubectl delete gmbmirror llm-inference -n "$NS_A" >/dev/null
wait_for "a mirror deleted by hand is written again by the operator" kubectl get gmbmirror llm-inference -n "$NS_A"

say "operator down: the agent records and warns; its eviction waits for the webhook (failurePolicy Fail)"
stop_process "$OPERATOR_PID"
OPERATOR_PID=""
write_sample 0 0 $((45 * GI)) $((9 * GI))
wait_for "GpuMemoryOverBudget on llm-b (operator down)" has_event "$NS_B" llm-b GpuMemoryOverBudget
OVER_B=$SECONDS
wait_for "llm-b recorded Evicting (the agent decided alone)" annotation_is "$NS_B" llm-b state Evicting
sleep 3
terminating "$NS_B" llm-b && die "llm-b was evicted while the webhook was down (failurePolicy Fail)"
grep "llm-b" "$WORK/agent-$AGENT_RUNS.log" | grep -q "eviction request failed" \
  || die "the agent did not report a failed eviction of llm-b while the operator was down"
info "$(grep "llm-b" "$WORK/agent-$AGENT_RUNS.log" | grep "eviction request failed" | head -n1 | cut -c1-240)"
say "operator back: the agent's retry goes through, counted once"
start_operator
wait_for "llm-b terminating" terminating "$NS_B" llm-b
info "evicted $((SECONDS - OVER_B))s after going over (retries back off 5 s, doubling)"
[ "$(kubectl get pod llm-b -n "$NS_B" -o jsonpath='{.metadata.deletionGracePeriodSeconds}')" = 30 ] || die "llm-b's grace is not 30"
wait_for "llm-inference ($NS_B) EVICTED 1" status_is "$NS_B" llm-inference evictions 1
write_sample 0 0 $((45 * GI)) 0
rm -rf "$WORK/proc/4104"
kubectl delete pod llm-b -n "$NS_B" --grace-period=0 --force >/dev/null 2>&1
sleep 3
[ "$(status_field "$NS_B" llm-inference evictions)" = 1 ] || die "llm-inference ($NS_B) counts $(status_field "$NS_B" llm-inference evictions)"
[ "$(status_field "$NS_A" llm-inference evictions)" = 1 ] || die "llm-inference ($NS_A) recounted after the operator's restart"
[ "$(event_occurrences "$NS_B" llm-b EvictingForGpuMemory)" = 1 ] || die "EvictingForGpuMemory on llm-b: $(events "$NS_B" llm-b EvictingForGpuMemory)"
ACCEPTED=$(grep "eviction requested and accepted" "$WORK/agent-$AGENT_RUNS.log" | grep -c "llm-b" || true)
[ "$ACCEPTED" = 1 ] || die "$ACCEPTED accepted evictions of llm-b"
kubectl get gmb -A | grep -E "^NAMESPACE|$ID" | sed 's/^/    /'

say "a PodDisruptionBudget that never allows it (maxUnavailable 0): refused, then deleted after blockedEvictionTimeoutSeconds"
make_pod "$NS_B" held "$NODE" app=held
process 4107 "$NS_B" held
kubectl apply -f - <<EOF | sed 's/^/    /'
apiVersion: policy/v1
kind: PodDisruptionBudget
metadata: {name: held, namespace: $NS_B}
spec: {maxUnavailable: 0, selector: {matchLabels: {app: held}}}
---
apiVersion: gpubudget.io/v1alpha1
kind: GpuMemoryBudget
metadata: {name: held, namespace: $NS_B}
spec: {selector: {matchLabels: {app: held}}, limit: 1Gi, overLimitSeconds: 0, evictionGracePeriodSeconds: 5,
       blockedEvictionTimeoutSeconds: 5}
EOF
write_sample 0 0 $((45 * GI)) 0 0 "" $((2 * GI))
wait_for "GpuMemoryEvictionBlocked on held (the PodDisruptionBudget refuses)" has_event "$NS_B" held GpuMemoryEvictionBlocked
BLOCKED_AT=$SECONDS
info "$(event_messages "$NS_B" held GpuMemoryEvictionBlocked | head -n1 | cut -c1-200)"
terminating "$NS_B" held && die "held was evicted through its PodDisruptionBudget"
wait_for "DeletingForGpuMemory on held" has_event "$NS_B" held DeletingForGpuMemory
wait_for "held terminating" terminating "$NS_B" held
info "deleted $((SECONDS - BLOCKED_AT))s after the first refusal: $(event_messages "$NS_B" held DeletingForGpuMemory | head -n1 | cut -c1-160)"
[ "$(kubectl get pod held -n "$NS_B" -o jsonpath='{.metadata.deletionGracePeriodSeconds}')" = 5 ] \
  || die "held's grace is $(kubectl get pod held -n "$NS_B" -o jsonpath='{.metadata.deletionGracePeriodSeconds}'), not the budget's 5"
write_sample 0 0 $((45 * GI)) 0
rm -rf "$WORK/proc/4107"
kubectl delete pod held -n "$NS_B" --grace-period=0 --force >/dev/null 2>&1


say "pressure: the GPU fills (2.6 GiB free of 79.6, under the 5 % threshold); other-b, 25Gi of its 20Gi budget, goes at once"
node_event_seen() { [ "$(kubectl get events -A --field-selector "involvedObject.kind=Node,involvedObject.name=$NODE,reason=$1" -o json | jq '.items | length')" -gt 0 ]; }
write_sample 0 0 $((45 * GI)) 0 $((25 * GI)) $((77 * GI))
wait_for "GpuMemoryPressure on node $NODE" node_event_seen GpuMemoryPressure
PRESSURE_AT=$SECONDS
wait_for "other-b terminating" terminating "$NS_B" other-b
info "evicted $((SECONDS - PRESSURE_AT))s after the Node event (team-b-default's overLimitSeconds is 10 s)"
[ "$(kubectl get pod other-b -n "$NS_B" -o jsonpath='{.metadata.deletionGracePeriodSeconds}')" = 5 ] \
  || die "other-b's grace is $(kubectl get pod other-b -n "$NS_B" -o jsonpath='{.metadata.deletionGracePeriodSeconds}'), not the pressure grace 5"
event_messages "$NS_B" other-b EvictingForGpuMemory | grep -q "under memory pressure" \
  || die "other-b's eviction event does not say pressure: $(event_messages "$NS_B" other-b EvictingForGpuMemory)"
info "$(event_messages "$NS_B" other-b EvictingForGpuMemory | head -n1 | cut -c1-200)"
terminating "$NS_A" trainer && die "trainer (Warn budget) was evicted for pressure"
wait_for "team-b-default ($NS_B) EVICTED 1" status_is "$NS_B" team-b-default evictions 1
write_sample 0 0 $((45 * GI)) 0 0 $((45 * GI))
rm -rf "$WORK/proc/4105"
kubectl delete pod other-b -n "$NS_B" --grace-period=0 --force >/dev/null 2>&1
wait_for "GpuMemoryPressureEnded on node $NODE (after the 10 s transition)" node_event_seen GpuMemoryPressureEnded

say "one GPU of two lost: nothing is decided from it, the other GPU is enforced; back, it is"
make_pod "$NS_B" lost-b "$NODE" app=llm                # llm-inference (8Gi, overLimitSeconds 10)
process 4108 "$NS_B" lost-b
# write_two_gpus LOST_B_BYTES [ERROR]: GPU 0 holds the trainer's 45Gi; GPU 1 holds lost-b's process, or fails.
write_two_gpus() {
  local err=""
  [ -z "${2:-}" ] || err="\"error\": \"$2\","
  cat > "$WORK/sample.tmp" <<EOF
{"version": 1, "gpus": [
 {"index": 0, "uuid": "GPU-e2e00000-0000-0000-0000-000000000000", "name": "replayed e2e GPU", "memory_total_bytes": 85520809984,
  "memory_used_bytes": $((45 * GI)), "processes": [{"pid": 4103, "used_bytes": $((45 * GI))}]},
 {"index": 1, "uuid": "GPU-e2e00000-0000-0000-0000-000000000001", "name": "replayed e2e GPU", "memory_total_bytes": 85520809984,
  $err "processes": [{"pid": 4108, "used_bytes": $1}]}]}
EOF
  mv "$WORK/sample.tmp" "$WORK/sample.json"
}
write_two_gpus $((30 * GI)) "GPU is lost"
wait_for "GpuSampleFailed on node $NODE" node_event_seen GpuSampleFailed
info "$(kubectl get events -A --field-selector "involvedObject.kind=Node,involvedObject.name=$NODE,reason=GpuSampleFailed" -o json | jq -r '.items[0].message' | cut -c1-200)"
wait_for "lost-b recorded (from the GPU that is sampled: nothing)" annotation_is "$NS_B" lost-b state Within
ready "$AGENT_ADMIN" || die "the agent is not ready with one GPU of two sampled"
curl -fsS "http://$AGENT_ADMIN/metrics" | grep -q '^gpubudget_gpu_sampled{gpu="1"} 0' || die "gpubudget_gpu_sampled{gpu=\"1\"} is not 0"
sleep 13   # past overLimitSeconds: whatever GPU 1 held, nothing was decided from it
has_event "$NS_B" lost-b GpuMemoryOverBudget && die "lost-b judged from a GPU whose sample failed"
terminating "$NS_B" lost-b && die "lost-b evicted from a GPU whose sample failed"
write_two_gpus $((30 * GI))
wait_for "GpuSampleRecovered on node $NODE" node_event_seen GpuSampleRecovered
BACK_AT=$SECONDS
wait_for "GpuMemoryOverBudget on lost-b (30Gi of 8Gi, GPU 1 sampled again)" has_event "$NS_B" lost-b GpuMemoryOverBudget
wait_for "lost-b terminating" terminating "$NS_B" lost-b
info "evicted $((SECONDS - BACK_AT))s after GPU 1 came back (overLimitSeconds 10)"
wait_for "llm-inference ($NS_B) EVICTED 2" status_is "$NS_B" llm-inference evictions 2
write_sample 0 0 $((45 * GI)) 0 0 $((45 * GI))
rm -rf "$WORK/proc/4108"
kubectl delete pod lost-b -n "$NS_B" --grace-period=0 --force >/dev/null 2>&1

say "two operator replicas (leader election, as the chart runs them): the leader crashes; the other answers the eviction check at once, then takes the Lease"
stop_process "$OPERATOR_PID"
OPERATOR_PID=""
WEBHOOK_A=127.0.0.1:$((PORT_BASE + 3)) WEBHOOK_B=127.0.0.1:$((PORT_BASE + 4))
ADMIN_A=127.0.0.1:$((PORT_BASE + 5)) ADMIN_B=127.0.0.1:$((PORT_BASE + 6)) FRONT=127.0.0.1:$((PORT_BASE + 7))
start_replica() { # NAME ADMIN WEBHOOK: prints the PID
  KUBECONFIG=$OPERATOR_KC POD_NAMESPACE=$NS POD_NAME=$1 RUST_LOG=info,gpubudget_operator=debug \
    "$BIN/gpubudget-operator" run --leader-election --admin-addr "$2" --webhook-addr "$3" \
    --webhook-cert-dir "$WORK/tls" --mirrors-lease-name "$MIRRORS_LEASE" >> "$WORK/operator-$1.log" 2>&1 &
  echo $!
}
REPLICA_A=$(start_replica operator-a "$ADMIN_A" "$WEBHOOK_A")
REPLICA_B=$(start_replica operator-b "$ADMIN_B" "$WEBHOOK_B")
EXTRA_PIDS="$REPLICA_A $REPLICA_B"
holder() { kubectl get lease gpubudget-operator -n "$NS" -o jsonpath='{.spec.holderIdentity}' 2>/dev/null; }
holder_is() { [ "$(holder)" = "$1" ]; }
has_holder() { [ -n "$(holder)" ]; }
both_ready() { ready "$ADMIN_A" && ready "$ADMIN_B"; }
wait_for "a leader" has_holder
wait_for "both replicas ready (the follower too: it serves the eviction check)" both_ready
LEADER=$(holder)
if [ "$LEADER" = operator-a ]; then
  DEAD=$REPLICA_A SURVIVOR=operator-b SURVIVOR_ADMIN=$ADMIN_B SURVIVOR_WEBHOOK=$WEBHOOK_B
else
  DEAD=$REPLICA_B SURVIVOR=operator-a SURVIVOR_ADMIN=$ADMIN_A SURVIVOR_WEBHOOK=$WEBHOOK_A
fi
LEADER_WEBHOOK=$([ "$LEADER" = operator-a ] && echo "$WEBHOOK_A" || echo "$WEBHOOK_B")
# The Service in front of the replicas: each connection to the first that accepts it, the leader tried first
# (a Service does not know who leads; the eviction check does not need the leader).
python3 "$HERE/failover.py" "$FRONT" "$LEADER_WEBHOOK" "$SURVIVOR_WEBHOOK" > "$WORK/failover.log" 2>&1 &
EXTRA_PIDS="$EXTRA_PIDS $!"
kubectl patch validatingwebhookconfiguration "$AGENT_SA-eviction" --type=json \
  -p "[{\"op\": \"replace\", \"path\": \"/webhooks/0/clientConfig/url\", \"value\": \"https://$FRONT/validate-eviction\"}]" >/dev/null
kill -KILL "$DEAD"
info "leader $LEADER killed (SIGKILL: no hand-over; its Lease runs out after 15 s)"
KILLED_AT=$SECONDS
make_pod "$NS_B" ha-b "$NODE" app=llm
process 4109 "$NS_B" ha-b
write_two_gpus 0
sed -i "s/{\"pid\": 4108, \"used_bytes\": 0}/{\"pid\": 4109, \"used_bytes\": $((9 * GI))}/" "$WORK/sample.json"
grep -q '"pid": 4109' "$WORK/sample.json" || die "the sample does not hold ha-b's process"
wait_for "GpuMemoryOverBudget on ha-b (9Gi of 8Gi)" has_event "$NS_B" ha-b GpuMemoryOverBudget
wait_for "ha-b terminating (the eviction allowed by $SURVIVOR)" terminating "$NS_B" ha-b
EVICTED_AT=$((SECONDS - KILLED_AT))
grep -q "connection -> $SURVIVOR_WEBHOOK" "$WORK/failover.log" || die "no eviction check reached $SURVIVOR"
wait_for "the Lease moves to $SURVIVOR" holder_is "$SURVIVOR"
MOVED_AT=$((SECONDS - KILLED_AT))
wait_for "llm-inference ($NS_B) EVICTED 3 (written by the new leader)" status_is "$NS_B" llm-inference evictions 3
info "after the leader's crash: ha-b evicted at ${EVICTED_AT}s, the Lease held by $SURVIVOR at ${MOVED_AT}s, the eviction counted at $((SECONDS - KILLED_AT))s"
curl -fsS "http://$SURVIVOR_ADMIN/metrics" | grep -q '^gpubudget_operator_leader 1' || die "$SURVIVOR does not say it leads"
[ "$(event_occurrences "$NS_B" ha-b EvictingForGpuMemory)" = 1 ] || die "EvictingForGpuMemory on ha-b: $(events "$NS_B" ha-b EvictingForGpuMemory)"
rm -rf "$WORK/proc/4109"
kubectl delete pod ha-b -n "$NS_B" --grace-period=0 --force >/dev/null 2>&1

say "a Node deleted: the garbage collector deletes its GpuNodeUsage with it"
kubectl get gpunodeusage "$NODE2" >/dev/null || die "no GpuNodeUsage $NODE2 to collect"
kubectl delete pod remote-a -n "$NS_A" --grace-period=0 --force >/dev/null 2>&1 || true
kubectl delete node "$NODE2" >/dev/null
wait_for "GpuNodeUsage $NODE2 deleted with Node $NODE2" bash -c "! kubectl get gpunodeusage $NODE2 >/dev/null 2>&1"

FAILED=0
say "PASS: records, mirrors, events, Evict with the budget's grace, Warn, overlaps, node restriction both ways, usage objects (own node only, collected with the Node), operator down and back, agent restart mid-grace, pressure eviction, a PodDisruptionBudget escalated, a GPU lost and back, two operator replicas with the leader crashed ($((SECONDS - START)) s)"

