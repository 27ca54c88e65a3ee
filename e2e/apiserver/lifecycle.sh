#!/usr/bin/env bash
# The chart's lifecycle against a real kube-apiserver, no kubelet: helm install → helm upgrade (new image tags,
# changed values) → helm rollback → helm uninstall, while budgets are enforced (issue 24, part 3).
#
#   GPUBUDGET_E2E_APISERVER=1 KUBECONFIG=/tmp/realk8s/run/kubeconfig e2e/apiserver/lifecycle.sh
#   GPUBUDGET_E2E_APISERVER=1 REALK8S_DIR=/tmp/realk8s e2e/apiserver/lifecycle.sh   # starts it (up.sh) and stops it
#
# What it checks, on real objects:
# - every step succeeds with Helm (3.10 and newer) and keeps every budget, its spec and its status (evictions,
#   lastEviction) as they were;
# - a rollout of the agent and of the operator, modelled as in the core stories of e2e/tests/apiserver (the
#   release binaries run on this machine out of cluster, so a rollout is a stop and a start of them, with the new values), in the middle of an
#   eviction's grace period and of another pod's overLimitSeconds: no pod is evicted twice, none early, a Warn
#   budget's pod and a pod of another node never; each eviction is counted once;
# - after uninstall, no ValidatingWebhookConfiguration, ValidatingAdmissionPolicy or binding, ClusterRole or
#   ClusterRoleBinding of the release remains; what stays is what docs/operations.md says stays: the CRD, the
#   budgets with their status, the pods' gpubudget.io/ records.
# The chart runs with a post-renderer that points the eviction webhook at the operator on 127.0.0.1 (URL mode, a
# certificate made here: no kube-proxy carries a Service here), and from a copy whose kubeVersion admits the
# 1.32 control plane of /work/shared/realk8s (the chart requires 1.33; the kinds it installs are served alike).
#
# Across versions (#34): GPUBUDGET_E2E_FROM=<dir> holding an older release's `bin/gpubudget-{agent,operator}` and
# `chart/` installs that version first; the upgrade applies this checkout's CRDs (docs/operations.md: Helm never
# upgrades them) and moves to this chart and these binaries; the rollback returns to the older ones. The same
# checks hold across both directions: the older agent's Evicting record is neither forgotten nor acted on twice.
#
# Environment: as e2e/lib.sh says (GPUBUDGET_E2E_BIN, HELM, GPUBUDGET_E2E_STEP_TIMEOUT, GPUBUDGET_E2E_KEEP, REALK8S),
# GPUBUDGET_E2E_FROM.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
REPO=$(cd "$HERE/../.." && pwd)
REALK8S=${REALK8S:-/work/shared/realk8s}

# shellcheck source=../lib.sh
. "$REPO/e2e/lib.sh"
control_plane_or_skip "the chart lifecycle" gpubudget-agent gpubudget-operator
STEP_TIMEOUT=${GPUBUDGET_E2E_STEP_TIMEOUT:-60}
POLL=0.5

ID=$(date +%s | tail -c 5)$RANDOM
ID=${ID:0:7}
NS=gpubudget-lc-$ID             # the release's namespace
NS_A=gpubudget-lc-$ID-a         # the tenant's pods and budgets
NODE=gpubudget-lc-$ID-n1
NODE2=gpubudget-lc-$ID-n2
RELEASE=gpubudget-lc-$ID
AGENT_SA=$RELEASE-agent
OPERATOR_SA=$RELEASE-operator
CRD=gpumemorybudgets.gpubudget.io
CRD_EXISTED=$(kubectl get crd "$CRD" -o name 2>/dev/null || true)
WORK=$(mktemp -d "${TMPDIR:-/tmp}/gpubudget-lifecycle.XXXXXX")
PORT_BASE=$((20000 + RANDOM % 20000))
AGENT_ADMIN=127.0.0.1:$PORT_BASE
OPERATOR_ADMIN=127.0.0.1:$((PORT_BASE + 1))
WEBHOOK=127.0.0.1:$((PORT_BASE + 2))
AGENT_PID="" OPERATOR_PID=""
FAILED=1
START=$SECONDS
GI=1073741824

cleanup() {
  local rc=$?
  if [ "$FAILED" != 0 ]; then
    say "diagnostics"
    kubectl get pods,gmb -n "$NS_A" -o wide || true
    kubectl get events -n "$NS_A" --sort-by=.lastTimestamp || true
    echo "--- operator log (last 40 lines)"; tail -n 40 "$WORK"/operator-*.log 2>/dev/null || true
    echo "--- agent log (last 60 lines)"; tail -n 60 "$WORK"/agent-*.log 2>/dev/null || true
  fi
  stop_process "$AGENT_PID"
  stop_process "$OPERATOR_PID"
  if [ "${GPUBUDGET_E2E_KEEP:-0}" = 1 ]; then
    say "keeping $NS $NS_A, nodes, release and $WORK (GPUBUDGET_E2E_KEEP=1)"
  else
    "$HELM" uninstall "$RELEASE" -n "$NS" >/dev/null 2>&1 || true
    kubectl delete namespace "$NS" "$NS_A" --wait=false --ignore-not-found >/dev/null 2>&1 || true
    kubectl delete node "$NODE" "$NODE2" --ignore-not-found >/dev/null 2>&1 || true
    [ -n "$CRD_EXISTED" ] || kubectl delete crd "$CRD" --wait=false --ignore-not-found >/dev/null 2>&1 || true
    rm -rf "$WORK"
  fi
  if [ "$STARTED_REALK8S" = 1 ]; then bash "$REALK8S/down.sh" >/dev/null 2>&1 || true; fi
  exit "$rc"
}
trap cleanup EXIT

accepted() { cat "$WORK"/agent-*.log | grep "eviction requested and accepted" | grep -c "$1" || true; }
# The budgets' specs and status that must survive every step (condition times and observedGeneration aside).
budgets_state() {
  kubectl get gmb -n "$NS_A" -o json | jq -S '[.items[] | {name: .metadata.name, uid: .metadata.uid, spec,
    evictions: .status.evictions, lastEviction: .status.lastEviction, podsOverBudget: .status.podsOverBudget,
    conditions: [(.status.conditions // [])[] | {type, status, reason}]}]'
}
# The release's cluster-scoped admission and RBAC objects, one "kind/name" a line.
release_cluster_objects() {
  kubectl get validatingwebhookconfiguration,validatingadmissionpolicy,validatingadmissionpolicybinding,clusterrole,clusterrolebinding \
    -o json | jq -r --arg r "$RELEASE" '.items[] | select(.metadata.name | startswith($r)) | "\(.kind)/\(.metadata.name)"' | sort
}

say "control plane, helm"
kubectl version 2>/dev/null | sed 's/^/    /'
info "helm: $("$HELM" version --short 2>/dev/null)  binaries: $BIN  run id: $ID"

# The chart as installed here: a copy admitting 1.32, and a post-renderer for the webhook's URL mode.
mkdir -p "$WORK/tls" "$WORK/proc"
cp -r "$REPO/charts/gpubudget" "$WORK/chart"
sed -i 's/^kubeVersion: .*/kubeVersion: ">=1.32.0-0"/' "$WORK/chart/Chart.yaml"
FROM=${GPUBUDGET_E2E_FROM:-}
FIRST_CHART=$WORK/chart FIRST_BIN=$BIN
if [ -n "$FROM" ]; then
  [ -x "$FROM/bin/gpubudget-agent" ] && [ -x "$FROM/bin/gpubudget-operator" ] && [ -f "$FROM/chart/Chart.yaml" ] \
    || die "GPUBUDGET_E2E_FROM=$FROM needs bin/gpubudget-agent, bin/gpubudget-operator and chart/"
  cp -r "$FROM/chart" "$WORK/chart-from"
  sed -i 's/^kubeVersion: .*/kubeVersion: ">=1.32.0-0"/' "$WORK/chart-from/Chart.yaml"
  FIRST_CHART=$WORK/chart-from FIRST_BIN=$FROM/bin
  info "across versions: install $FROM (agent $("$FROM/bin/gpubudget-agent" --version)), upgrade to this checkout"
fi
RUN_BIN=$FIRST_BIN
webhook_cert "$WORK/tls"
cat > "$WORK/post-render.sh" <<EOF
#!/usr/bin/env bash
exec yq -y --arg url "https://$WEBHOOK/validate-eviction" --arg ca "$(base64 -w0 < "$WORK/tls/ca.crt")" \
  'select(. != null) | if .kind == "ValidatingWebhookConfiguration" then .webhooks |= map(.clientConfig = {url: \$url, caBundle: \$ca}) else . end'
EOF
chmod +x "$WORK/post-render.sh"
# Helm with a private copy of the admin kubeconfig (Helm warns about a group-readable one).
kubectl config view --raw > "$WORK/admin.kubeconfig"
chmod 600 "$WORK/admin.kubeconfig"
helm__() { "$HELM" --kubeconfig "$WORK/admin.kubeconfig" "$@"; }
helm_() { helm__ "$@" -n "$NS" --post-renderer "$WORK/post-render.sh"; }

say "helm install (revision 1: image tag 0.1.0, interval 250ms)"
kubectl create namespace "$NS" >/dev/null
kubectl create namespace "$NS_A" >/dev/null
wait_for "ServiceAccount default in $NS_A" kubectl get serviceaccount default -n "$NS_A"
helm_ install "$RELEASE" "$FIRST_CHART" --set agent.image.tag=0.1.0 --set operator.image.tag=0.1.0 | sed 's/^/    /'
kubectl wait --for=condition=Established "crd/$CRD" --timeout=60s >/dev/null
release_cluster_objects > "$WORK/objects-installed.txt"
sed 's/^/    /' "$WORK/objects-installed.txt"
# As many admission policies as bindings, as the chart renders them (the node restriction's, the records', the
# caps record's: their number grew with the issues), and the eviction webhook.
POLICIES=$(grep -c '^ValidatingAdmissionPolicy/' "$WORK/objects-installed.txt" || true)
RENDERED=$(helm__ get manifest "$RELEASE" -n "$NS" | grep -c "^kind: ValidatingAdmissionPolicy$" || true)
[ "$POLICIES" -ge 3 ] && [ "$POLICIES" = "$RENDERED" ] || die "$POLICIES admission policies installed, $RENDERED rendered"
[ "$(grep -c '^ValidatingAdmissionPolicyBinding/' "$WORK/objects-installed.txt")" = "$POLICIES" ] || die "a policy without its binding"
grep -q '^ValidatingWebhookConfiguration/' "$WORK/objects-installed.txt" || die "no webhook configuration"

say "nodes, pods (API objects; the test is their kubelet), the binaries with the chart's identities"
for n in "$NODE" "$NODE2"; do
  kubectl create -f - >/dev/null <<EOF
apiVersion: v1
kind: Node
metadata: {name: $n, labels: {e2e.gpubudget.io/run: "$ID"}}
EOF
  kubectl patch node "$n" --subresource=status --type=merge \
    -p '{"status":{"conditions":[{"type":"Ready","status":"True","reason":"KubeletReady","message":"played by the e2e test"}]}}' >/dev/null
done
make_pod() { # NAME NODE LABEL(k=v): a running pod with one container "main", as the kubelet reports it
  kubectl create -f - >/dev/null <<EOF
apiVersion: v1
kind: Pod
metadata: {name: $1, namespace: $NS_A, labels: {e2e.gpubudget.io/run: "$ID", ${3%%=*}: "${3#*=}"}}
spec:
  nodeName: $2
  terminationGracePeriodSeconds: 60
  containers: [{name: main, image: registry.k8s.io/pause:3.10}]
EOF
  pod_running "$NS_A" "$1"
}
process() { fake_process "$WORK/proc" "$1" "$NS_A" "$2"; } # PID POD
make_pod first "$NODE" app=llm        # llm-inference (Evict, 8Gi, 10 s, grace 30 s): evicted before the upgrade
make_pod second "$NODE" app=llm       # goes over just before the upgrade: its 10 s run across the rollout
make_pod trainer "$NODE" job-type=training   # training-audit (Warn, 40Gi): over all along, never evicted
make_pod remote "$NODE2" app=llm      # another node's pod: never this agent's
process 4201 first
process 4202 second
process 4203 trainer
process 4204 remote
write_sample() { # FIRST SECOND TRAINER (bytes)
  cat > "$WORK/sample.tmp" <<EOF
{"version": 1, "gpus": [{"index": 0, "uuid": "GPU-1c000000-0000-0000-0000-000000000000", "name": "replayed e2e GPU",
 "memory_total_bytes": 85520809984, "processes": [{"pid": 4201, "used_bytes": $1}, {"pid": 4202, "used_bytes": $2},
 {"pid": 4203, "used_bytes": $3}, {"pid": 4204, "used_bytes": $((20 * GI))}]}]}
EOF
  mv "$WORK/sample.tmp" "$WORK/sample.json"
}
write_sample $((2 * GI)) $((2 * GI)) $((45 * GI))
kubeconfig() { # NAME TOKEN: a kubeconfig of KUBECONFIG's server with that bearer token
  token_kubeconfig "$WORK/$1.kubeconfig" "$1" "$2"
  echo "$WORK/$1.kubeconfig"
}
OPERATOR_KC=$(kubeconfig operator "$(kubectl create token "$OPERATOR_SA" -n "$NS" --duration=2h)")
AGENT_KC=$(kubeconfig agent "$(kubectl create token "$AGENT_SA" -n "$NS" --duration=2h --bound-object-kind Node --bound-object-name "$NODE")")
RUNS=0
start_binaries() { # INTERVAL: the operator, then the agent (a new "pod" of each, as a rollout starts them)
  RUNS=$((RUNS + 1))
  KUBECONFIG=$OPERATOR_KC POD_NAMESPACE=$NS POD_NAME=operator-$RUNS RUST_LOG=info \
    "$RUN_BIN/gpubudget-operator" run --admin-addr "$OPERATOR_ADMIN" --webhook-addr "$WEBHOOK" \
    --webhook-cert-dir "$WORK/tls" > "$WORK/operator-$RUNS.log" 2>&1 &
  OPERATOR_PID=$!
  wait_for "operator ready (run $RUNS)" ready "$OPERATOR_ADMIN"
  KUBECONFIG=$AGENT_KC RUST_LOG=info "$RUN_BIN/gpubudget-agent" run --node-name "$NODE" --proc-root "$WORK/proc" \
    --sample-file "$WORK/sample.json" --interval "$1" --admin-addr "$AGENT_ADMIN" > "$WORK/agent-$RUNS.log" 2>&1 &
  AGENT_PID=$!
  wait_for "agent ready (run $RUNS, interval $1)" ready "$AGENT_ADMIN"
}
stop_binaries() { # the rollout stops the old pods (SIGTERM, as the kubelet does)
  stop_process "$AGENT_PID"; AGENT_PID=""
  stop_process "$OPERATOR_PID"; OPERATOR_PID=""
}
start_binaries 250ms
for f in llm-inference.yaml training-warn.yaml; do
  sed -E "s/^([[:space:]]*namespace:[[:space:]]*).*/\1$NS_A/" "$REPO/examples/$f" | kubectl apply -f - | sed 's/^/    /'
done

say "enforcement before the upgrade: first evicted (grace 30 s), trainer over (Warn)"
write_sample $((9 * GI)) $((2 * GI)) $((45 * GI))
wait_for "first terminating" terminating "$NS_A" first
wait_for "trainer recorded Over" annotation_is "$NS_A" trainer state Over
wait_for "llm-inference EVICTED 1" status_is "$NS_A" llm-inference evictions 1
REQUESTED_AT=$(annotation "$NS_A" first eviction-requested-at)
[ -n "$REQUESTED_AT" ] || die "no eviction-requested-at on first"
wait_for "training-audit OVER 1" status_is "$NS_A" training-audit podsOverBudget 1
budgets_state > "$WORK/budgets-before.json"

say "second goes over; helm upgrade (revision 2: tag 0.2.0, interval 500ms, log text) and the rollout within its 10 s and first's grace"
write_sample $((9 * GI)) $((9 * GI)) $((45 * GI))
wait_for "GpuMemoryOverBudget on second" has_event "$NS_A" second GpuMemoryOverBudget
OVER_SECOND=$(date +%s)
if [ -n "$FROM" ]; then
  # docs/operations.md: Helm installs a chart's CRDs on first install only; an upgrade applies them first.
  kubectl apply --server-side --force-conflicts -f "$REPO/charts/gpubudget/crds/" | sed 's/^/    /'
fi
# Not --reuse-values: a newer chart's new values would be missing (Helm does not merge its defaults then).
helm_ upgrade "$RELEASE" "$WORK/chart" --set agent.image.tag=0.2.0 --set operator.image.tag=0.2.0 \
  --set agent.interval=500ms --set logFormat=text | sed -n '1,3s/^/    /p'
[ "$(kubectl get ds "$RELEASE-agent" -n "$NS" -o jsonpath='{.spec.template.spec.containers[0].image}')" = "example.invalid/gpubudget/gpubudget-agent:0.2.0" ] \
  || die "the agent DaemonSet's image is not 0.2.0 after the upgrade"
terminating "$NS_A" first || die "first is not in its grace period at the rollout"
stop_binaries
ROLLED=$(date +%s)
RUN_BIN=$BIN
start_binaries 500ms
info "rollout: the old binaries stopped $((ROLLED - OVER_SECOND)) s after second went over; first still in its grace"
terminating "$NS_A" second && [ "$(( $(date +%s) - OVER_SECOND ))" -lt 10 ] && die "second evicted before overLimitSeconds"
wait_for "second terminating (after the rollout, its timer started afresh)" terminating "$NS_A" second
DELETION=$(kubectl get pod second -n "$NS_A" -o jsonpath='{.metadata.deletionTimestamp}')
GRACE=$(kubectl get pod second -n "$NS_A" -o jsonpath='{.metadata.deletionGracePeriodSeconds}')
EVICTED_AFTER=$(( $(date -d "$DELETION" +%s) - GRACE - OVER_SECOND ))
[ "$EVICTED_AFTER" -ge 9 ] || die "second evicted ${EVICTED_AFTER}s after going over (overLimitSeconds 10)"
info "second evicted ${EVICTED_AFTER}s after going over (overLimitSeconds 10; a restart can only delay)"
sleep 3
[ "$(accepted first)" = 1 ] || die "$(accepted first) accepted evictions of first across the rollout"
[ "$(event_occurrences "$NS_A" first EvictingForGpuMemory)" = 1 ] || die "EvictingForGpuMemory on first repeated"
annotation_is "$NS_A" first eviction-requested-at "$REQUESTED_AT" || die "first's eviction-requested-at changed"
if [ -n "$FROM" ]; then
  # #34: the new agent publishes the node's usage in its GpuNodeUsage; the older one's records were read as its own.
  wait_for "the node's GpuNodeUsage, written by the upgraded agent" kubectl get gpunodeusage "$NODE"
  info "GpuNodeUsage $NODE: $(kubectl get gpunodeusage "$NODE" -o jsonpath='{.spec.podCount} pods, {.spec.total} in all')"
fi
wait_for "llm-inference EVICTED 2 (first, second: each once)" status_is "$NS_A" llm-inference evictions 2

say "the kubelet's part: first and second exit, their pods are deleted"
write_sample 0 0 $((45 * GI))
rm -rf "$WORK/proc/4201" "$WORK/proc/4202"
kubectl delete pod first second -n "$NS_A" --grace-period=0 --force >/dev/null 2>&1
sleep 3
[ "$(status_field "$NS_A" llm-inference evictions)" = 2 ] || die "llm-inference counts $(status_field "$NS_A" llm-inference evictions)"
budgets_state > "$WORK/budgets-upgraded.json"
jq -e '[.[] | select(.name == "training-audit")] == [input[] | select(.name == "training-audit")]' \
  "$WORK/budgets-before.json" "$WORK/budgets-upgraded.json" >/dev/null || die "training-audit changed across the upgrade"
jq -e '[.[] | .uid] == [input[] | .uid]' "$WORK/budgets-before.json" "$WORK/budgets-upgraded.json" >/dev/null \
  || die "a budget was recreated across the upgrade"

say "helm rollback to revision 1, and its rollout"
helm__ rollback "$RELEASE" 1 -n "$NS" | sed 's/^/    /'
[ "$(kubectl get ds "$RELEASE-agent" -n "$NS" -o jsonpath='{.spec.template.spec.containers[0].image}')" = "example.invalid/gpubudget/gpubudget-agent:0.1.0" ] \
  || die "the agent DaemonSet's image is not 0.1.0 after the rollback"
stop_binaries
RUN_BIN=$FIRST_BIN
start_binaries 250ms
sleep 5
budgets_state > "$WORK/budgets-rolledback.json"
diff <(jq -S . "$WORK/budgets-upgraded.json") <(jq -S . "$WORK/budgets-rolledback.json") \
  || die "budgets or their status changed across the rollback"
[ "$(release_cluster_objects)" = "$(cat "$WORK/objects-installed.txt")" ] || die "the cluster-scoped objects differ after the rollback"
terminating "$NS_A" trainer && die "trainer (Warn) was evicted"
terminating "$NS_A" remote && die "remote (another node) was evicted"
[ -z "$(annotation "$NS_A" remote state)" ] || die "remote got a record from this agent"
helm__ history "$RELEASE" -n "$NS" | sed 's/^/    /'

say "helm uninstall: what goes, what stays"
stop_binaries
helm__ uninstall "$RELEASE" -n "$NS" | sed 's/^/    /'
LEFT=$(release_cluster_objects)
[ -z "$LEFT" ] || die "left behind by helm uninstall: $LEFT"
info "gone: webhook configuration, $POLICIES admission policies and their bindings, ClusterRoles and bindings of $RELEASE"
for kind in daemonset deployment serviceaccount role rolebinding secret service poddisruptionbudget; do
  n=$(kubectl get "$kind" -n "$NS" -l "app.kubernetes.io/instance=$RELEASE" -o name | wc -l)
  [ "$n" = 0 ] || die "$n $kind of the release left in $NS"
done
kubectl get crd "$CRD" >/dev/null || die "the CRD was removed (docs/operations.md: helm uninstall leaves it)"
budgets_state > "$WORK/budgets-uninstalled.json"
diff <(jq -S . "$WORK/budgets-rolledback.json") <(jq -S . "$WORK/budgets-uninstalled.json") \
  || die "budgets or their status changed with the uninstall"
annotation_is "$NS_A" trainer state Over || die "trainer's record is gone"
info "stays (documented): CRD $CRD, budgets $(jq -r '[.[] | "\(.name) (evictions \(.evictions // 0))"] | join(", ")' "$WORK/budgets-uninstalled.json"), the pods' gpubudget.io/ records"
kubectl get gmb -n "$NS_A" | sed 's/^/    /'

FAILED=0
say "PASS: install, upgrade (rollout mid grace and mid overLimitSeconds: one eviction each, none early), rollback, uninstall (nothing admission- or RBAC-related left; CRD, budgets, status, records stay) ($((SECONDS - START)) s)"
