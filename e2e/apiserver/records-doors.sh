#!/usr/bin/env bash
# Records through another door, and one release per cluster (issue 43, findings 5 and 6) against a real
# kube-apiserver, no kubelet: the chart's records and caps record policies on every door to a pod's annotations,
# the kubelet's and the agent's writes still passing, and a second release refused at install.
#
#   GPUBUDGET_E2E_APISERVER=1 KUBECONFIG=/tmp/realk8s/run/kubeconfig e2e/apiserver/records-doors.sh [OUT]
#   GPUBUDGET_E2E_APISERVER=1 REALK8S_DIR=/tmp/realk8s e2e/apiserver/records-doors.sh [OUT]   # starts it, stops it
#
# What it checks, as a tenant with `pods` (create, patch, update), `pods/status` (patch, update), `pods/binding`
# and `bindings` (create) and `pods/ephemeralcontainers` (patch) in its namespace:
# 0. before (the policies of the commit checked out, HEAD): refused through pods, but gpubudget.io/state and
#    gpubudget.io/caps through pods/status, and gpubudget.io/state through a pods/binding, are taken;
# 1. after (the working tree's chart, installed with `helm install`): every key the records use
#    (common/src/pod_record.rs, and gpubudget.io/caps) refused through pods/status by patch and by update, through
#    pods by patch and update, through pods/binding and the legacy bindings resource, each answer naming the
#    door; pods/ephemeralcontainers takes the change and drops the annotation (its strategy resets metadata);
# 2. what must still pass: the tenant's own status writes, the kubelet's (system:node:<node>, the system:node
#    role) status patch and update of a pod carrying the agent's record, a binding without gpubudget.io/ keys,
#    and the agent's records (the agent binary, its token bound to the node);
# 3. one release per cluster: a second `helm install` fails, naming the first; the first's `helm upgrade` passes;
#    policies another install left (a second release's, applied with kubectl) refuse the agent's record, and the
#    agent says so on its Node (GpuBudgetWriteDenied, naming the policy) and counts the write `denied`.
# The chart is a copy whose kubeVersion admits 1.32 (the chart's own floor since 2026-11-27; HEAD's older chart kept >=1.33). OUT (optional)
# receives a copy of the output.
#
# Environment: as e2e/lib.sh says (GPUBUDGET_E2E_BIN, HELM, GPUBUDGET_E2E_STEP_TIMEOUT, GPUBUDGET_E2E_KEEP, REALK8S).
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
REPO=$(cd "$HERE/../.." && pwd)
REALK8S=${REALK8S:-/work/shared/realk8s}
if [ -n "${1:-}" ] && [ -z "${DOORS_TEE:-}" ]; then
  DOORS_TEE=1 exec > >(tee "$1") 2>&1
fi

# shellcheck source=../lib.sh
. "$REPO/e2e/lib.sh"
control_plane_or_skip "records through every door" gpubudget-agent
STEP_TIMEOUT=${GPUBUDGET_E2E_STEP_TIMEOUT:-60}
POLL=0.5
GI=1073741824

ID=$(date +%s | tail -c 5)$RANDOM
ID=${ID:0:7}
A=gpubudget-doors-$ID               # the release (its namespace too)
B=gpubudget-doors-$ID-b             # a second release (its namespace too)
OLD=gpubudget-doors-$ID-old         # HEAD's policies, for the "before"
NS_T=gpubudget-doors-$ID-t          # the tenant's namespace
NODE=gpubudget-doors-$ID-n1
TENANT=system:serviceaccount:$NS_T:tenant
WORK=$(mktemp -d "${TMPDIR:-/tmp}/gpubudget-doors.XXXXXX")
ADMIN=127.0.0.1:$((20000 + RANDOM % 20000))
AGENT_PID=""
FAILED=1
START=$SECONDS
REFUSED=0
PASSED=0

cleanup() {
  local rc=$?
  if [ "$FAILED" != 0 ]; then
    say "diagnostics"
    kubectl get pods -n "$NS_T" -o wide || true
    echo "--- agent log (last 40 lines)"; tail -n 40 "$WORK/agent.log" 2>/dev/null || true
  fi
  stop_process "$AGENT_PID"
  if [ "${GPUBUDGET_E2E_KEEP:-0}" = 1 ]; then
    say "keeping the releases, namespaces, the node and $WORK (GPUBUDGET_E2E_KEEP=1)"
  else
    "$HELM" uninstall "$A" -n "$A" >/dev/null 2>&1 || true
    "$HELM" uninstall "$B" -n "$B" >/dev/null 2>&1 || true
    kubectl get validatingadmissionpolicy,validatingadmissionpolicybinding,clusterrole,clusterrolebinding -o name 2>/dev/null \
      | grep -E "/($A|$B|$OLD)-" | xargs -r kubectl delete --ignore-not-found >/dev/null 2>&1 || true
    kubectl delete clusterrolebinding "$A-nodes" "$A-nodes-read" --ignore-not-found >/dev/null 2>&1 || true
    kubectl delete clusterrole "$A-nodes-read" --ignore-not-found >/dev/null 2>&1 || true
    kubectl delete namespace "$A" "$B" "$NS_T" --wait=false --ignore-not-found >/dev/null 2>&1 || true
    kubectl delete node "$NODE" --ignore-not-found >/dev/null 2>&1 || true
    rm -rf "$WORK"
  fi
  if [ "$STARTED_REALK8S" = 1 ]; then bash "$REALK8S/down.sh" >/dev/null 2>&1 || true; fi
  exit "$rc"
}
trap cleanup EXIT

# attempt WANT NEEDLE WHO KUBECTL-ARGS...: kubectl as WHO (tenant; kubelet: system:node:NODE in system:nodes;
# admin), printed with its answer. WANT ok: exit status 0; denied: Forbidden, and NEEDLE in the answer.
attempt() {
  local want=$1 needle=$2 who=$3 rc=0 out
  shift 3
  local as=()
  case $who in
    tenant) as=(--as="$TENANT") ;;
    kubelet) as=(--as="system:node:$NODE" --as-group=system:nodes --as-group=system:authenticated) ;;
    admin) ;;
    *) die "attempt: who is $who" ;;
  esac
  out=$(kubectl "${as[@]}" "$@" 2>&1) || rc=$?
  out=$(grep -v '^WARNING: Kubernetes configuration file is' <<<"$out" || true)
  printf '\n    $ kubectl %s    # as %s, expect %s\n' "$*" "$who" "$want"
  # shellcheck disable=SC2001 # every line of a multi-line output indented
  sed 's/^/      /' <<<"$out" | cut -c1-400
  # shellcheck disable=SC2015 # die when any of the tests fails
  case $want in
    ok) [ "$rc" = 0 ] || die "expected success: kubectl $* as $who"
        PASSED=$((PASSED + 1)) ;;
    denied) [ "$rc" != 0 ] && grep -qi forbidden <<<"$out" && grep -qF -- "$needle" <<<"$out" \
              || die "expected Forbidden with '$needle': kubectl $* as $who"
            REFUSED=$((REFUSED + 1)) ;;
  esac
}
ann() { kubectl get pod "$1" -n "$NS_T" -o json | jq -c '.metadata.annotations // {} | with_entries(select(.key | startswith("gpubudget.io/")))'; }
# binding POD [KEY=VALUE]: a Binding of POD to NODE, as JSON, with that annotation.
binding() {
  local annotations='{}'
  [ -z "${2:-}" ] || annotations=$(jq -nc --arg k "${2%%=*}" --arg v "${2#*=}" '{($k): $v}')
  jq -nc --arg pod "$1" --arg node "$NODE" --argjson a "$annotations" \
    '{apiVersion: "v1", kind: "Binding", metadata: {name: $pod, annotations: $a}, target: {apiVersion: "v1", kind: "Node", name: $node}}'
}
# status_put WHO POD FILTER WANT NEEDLE: an update (PUT) of POD's status subresource with the object read now and
# the jq FILTER applied.
status_put() {
  kubectl get pod "$2" -n "$NS_T" -o json | jq "$3" > "$WORK/put.json"
  attempt "$4" "$5" "$1" replace --subresource=status -n "$NS_T" -f "$WORK/put.json"
}
pod_put() {
  kubectl get pod "$2" -n "$NS_T" -o json | jq "$3" > "$WORK/put.json"
  attempt "$4" "$5" "$1" replace -n "$NS_T" -f "$WORK/put.json"
}
# tenant_pod NAME [bound]: a pod the tenant creates (bound: spec.nodeName NODE).
tenant_pod() {
  local node=""
  [ "${2:-}" != bound ] || node="nodeName: $NODE,"
  kubectl --as="$TENANT" create -f - >/dev/null <<EOF
apiVersion: v1
kind: Pod
metadata: {name: $1, namespace: $NS_T, labels: {app: $1}}
spec: {$node terminationGracePeriodSeconds: 5, containers: [{name: main, image: registry.k8s.io/pause:3.10}]}
EOF
}

say "control plane, CRDs, the tenant (pods, pods/status, pods/binding, bindings, pods/ephemeralcontainers), one node"
kubectl version 2>/dev/null | sed 's/^/    /'
info "helm: $("$HELM" version --short)  binaries: $BIN  run id: $ID  work: $WORK"
for ns in "$A" "$B" "$NS_T"; do kubectl create namespace "$ns" >/dev/null; done
kubectl apply -f "$REPO/crds/" >/dev/null
kubectl wait --for=condition=Established crd/gpumemorybudgets.gpubudget.io crd/clustergpumemorybudgets.gpubudget.io \
  crd/gpumemorybudgetmirrors.gpubudget.io crd/clustergpumemorybudgetmirrors.gpubudget.io crd/gpunodeusages.gpubudget.io \
  --timeout=60s >/dev/null
kubectl create -f - >/dev/null <<EOF
apiVersion: v1
kind: Node
metadata: {name: $NODE, labels: {nvidia.com/gpu.present: "true"}}
---
apiVersion: v1
kind: ServiceAccount
metadata: {name: tenant, namespace: $NS_T}
---
apiVersion: rbac.authorization.k8s.io/v1
kind: Role
metadata: {name: tenant, namespace: $NS_T}
rules:
  - {apiGroups: [""], resources: [pods], verbs: [get, list, watch, create, delete, patch, update]}
  - {apiGroups: [""], resources: [pods/status], verbs: [get, patch, update]}
  - {apiGroups: [""], resources: [pods/binding, bindings], verbs: [create]}
  - {apiGroups: [""], resources: [pods/ephemeralcontainers], verbs: [get, patch, update]}
---
apiVersion: rbac.authorization.k8s.io/v1
kind: RoleBinding
metadata: {name: tenant, namespace: $NS_T}
roleRef: {apiGroup: rbac.authorization.k8s.io, kind: Role, name: tenant}
subjects: [{kind: ServiceAccount, name: tenant, namespace: $NS_T}]
---
# What the Node authorizer gives a kubelet, here by RBAC (this control plane runs RBAC only).
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRoleBinding
metadata: {name: $A-nodes}
roleRef: {apiGroup: rbac.authorization.k8s.io, kind: ClusterRole, name: "system:node"}
subjects: [{apiGroup: rbac.authorization.k8s.io, kind: Group, name: "system:nodes"}]
---
# kubectl patch reads pods/status first, which system:node does not grant (the kubelet patches without reading).
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRole
metadata: {name: $A-nodes-read}
rules: [{apiGroups: [""], resources: [pods/status], verbs: [get]}]
---
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRoleBinding
metadata: {name: $A-nodes-read}
roleRef: {apiGroup: rbac.authorization.k8s.io, kind: ClusterRole, name: $A-nodes-read}
subjects: [{apiGroup: rbac.authorization.k8s.io, kind: Group, name: "system:nodes"}]
EOF
wait_for "ServiceAccount default in $NS_T" kubectl get serviceaccount default -n "$NS_T"
# A copy of the chart that admits the 1.32 control plane, and HEAD's chart for the "before".
cp -r "$REPO/charts/gpubudget" "$WORK/chart"
sed -i 's/^kubeVersion: .*/kubeVersion: ">=1.32.0-0"/' "$WORK/chart/Chart.yaml"
mkdir -p "$WORK/head"
git -C "$REPO" archive HEAD charts/gpubudget | tar -x -C "$WORK/head"
info "HEAD: $(git -C "$REPO" rev-parse --short HEAD); the chart under test: the working tree"

say "0. before: HEAD's records and caps record policies (resources: [pods] only)"
"$HELM" template "$OLD" "$WORK/head/charts/gpubudget" -n "$A" --kube-version 1.33.0 \
  | yq -y 'select(.kind == "ValidatingAdmissionPolicy" or .kind == "ValidatingAdmissionPolicyBinding")
           | select(.metadata.name | test("-records$|-caps-record$"))' > "$WORK/head-policies.yaml"
kubectl apply -f "$WORK/head-policies.yaml" | sed 's/^/    /'
sleep 2 # the policies reach the admission plugin's informer
tenant_pod before-bound bound
tenant_pod before-unbound
attempt denied "only the agent may set" tenant annotate pod before-bound -n "$NS_T" gpubudget.io/state=Evicting
attempt ok "" tenant patch pod before-bound -n "$NS_T" --subresource=status --type=merge \
  -p '{"metadata":{"annotations":{"gpubudget.io/state":"Evicting","gpubudget.io/caps":"{\"budget\":\"forged\"}"}}}'
binding before-unbound gpubudget.io/state=Evicting > "$WORK/binding.json"
attempt ok "" tenant create --raw "/api/v1/namespaces/$NS_T/pods/before-unbound/binding" -f "$WORK/binding.json"
info "before-bound:   $(ann before-bound)"
info "before-unbound: $(ann before-unbound)   (bound to $(kubectl get pod before-unbound -n "$NS_T" -o jsonpath='{.spec.nodeName}'))"
[ "$(annotation "$NS_T" before-bound state)" = Evicting ] || die "the door was not open before"
kubectl delete -f "$WORK/head-policies.yaml" >/dev/null
kubectl delete pod before-bound before-unbound -n "$NS_T" --grace-period=0 --force >/dev/null 2>&1

say "1. after: the working tree's chart, installed as release $A (helm install)"
"$HELM" install "$A" "$WORK/chart" -n "$A" > "$WORK/install-a.txt" 2>&1 || { cat "$WORK/install-a.txt"; die "helm install $A"; }
head -n 6 "$WORK/install-a.txt" | sed 's/^/    /'
kubectl get validatingadmissionpolicy -o name | grep "/$A-" | sed 's/^/    /'
sleep 2
tenant_pod t-bound bound
tenant_pod t-unbound
tenant_pod t-unbound-2
for key in state usage-bytes budget node eviction-requested-at cap-not-in-force driver-limits; do
  attempt denied "refused through pods/status" tenant patch pod t-bound -n "$NS_T" --subresource=status \
    --type=merge -p "{\"metadata\":{\"annotations\":{\"gpubudget.io/$key\":\"1\"}}}"
done
attempt denied "gpubudget.io/caps records what the gpubudget caps webhook did" tenant patch pod t-bound -n "$NS_T" \
  --subresource=status --type=merge -p '{"metadata":{"annotations":{"gpubudget.io/caps":"{\"budget\":\"forged\"}"}}}'
grep -q "refused through pods/status" <<<"$(kubectl --as="$TENANT" patch pod t-bound -n "$NS_T" --subresource=status \
  --type=merge -p '{"metadata":{"annotations":{"gpubudget.io/caps":"x"}}}' 2>&1)" || die "the caps answer names no door"
status_put tenant t-bound '.metadata.annotations["gpubudget.io/state"] = "Evicting"' denied "refused through pods/status"
status_put tenant t-bound '.metadata.annotations["gpubudget.io/caps"] = "{}"' denied "refused through pods/status"
attempt denied "refused through pods)" tenant annotate pod t-bound -n "$NS_T" gpubudget.io/state=Evicting
attempt denied "cannot be added, changed or removed" tenant annotate pod t-bound -n "$NS_T" gpubudget.io/caps=x
pod_put tenant t-bound '.metadata.annotations["gpubudget.io/eviction-requested-at"] = "2026-11-27T00:00:00Z"' denied "refused through pods)"
binding t-unbound gpubudget.io/state=Evicting > "$WORK/binding.json"
attempt denied "refused through pods/binding" tenant create --raw "/api/v1/namespaces/$NS_T/pods/t-unbound/binding" -f "$WORK/binding.json"
binding t-unbound gpubudget.io/caps=x > "$WORK/binding.json"
attempt denied "refused through pods/binding" tenant create --raw "/api/v1/namespaces/$NS_T/pods/t-unbound/binding" -f "$WORK/binding.json"
binding t-unbound gpubudget.io/node=x > "$WORK/binding.json"
attempt denied "refused through bindings" tenant create --raw "/api/v1/namespaces/$NS_T/bindings" -f "$WORK/binding.json"
attempt ok "" tenant patch pod t-bound -n "$NS_T" --subresource=ephemeralcontainers --type=strategic \
  -p '{"metadata":{"annotations":{"gpubudget.io/state":"Evicting"}},"spec":{"ephemeralContainers":[{"name":"dbg","image":"local/busybox:1"}]}}'
[ -z "$(annotation "$NS_T" t-bound state)" ] || die "pods/ephemeralcontainers kept a gpubudget.io/ annotation"
info "pods/ephemeralcontainers: the container added, the annotation dropped by the API server (t-bound: $(ann t-bound))"
info "t-unbound: $(ann t-unbound), node '$(kubectl get pod t-unbound -n "$NS_T" -o jsonpath='{.spec.nodeName}')'"

say "2. what must still pass: the tenant's and the kubelet's status writes, a plain binding, the agent's records"
attempt ok "" tenant patch pod t-bound -n "$NS_T" --subresource=status --type=merge \
  -p '{"status":{"conditions":[{"type":"example.com/Warm","status":"True"}]}}'
binding t-unbound-2 > "$WORK/binding.json"
attempt ok "" admin create --raw "/api/v1/namespaces/$NS_T/pods/t-unbound-2/binding" -f "$WORK/binding.json"
info "t-unbound-2 bound to '$(kubectl get pod t-unbound-2 -n "$NS_T" -o jsonpath='{.spec.nodeName}')' (the scheduler's kind of binding)"
# The agent: its token bound to the node, a budget selecting t-bound, t-bound running and holding 2Gi.
kubectl apply -f - >/dev/null <<EOF
apiVersion: gpubudget.io/v1alpha1
kind: GpuMemoryBudget
metadata: {name: small, namespace: $NS_T}
spec: {selector: {matchLabels: {app: t-bound}}, limit: 4Gi, action: Warn}
EOF
pod_running "$NS_T" t-bound
fake_process "$WORK/proc" 7101 "$NS_T" t-bound
sample() {
  cat > "$WORK/sample.tmp" <<EOF
{"version": 1, "gpus": [{"index": 0, "uuid": "GPU-e2e00000-0000-0000-0000-000000000043", "name": "replayed e2e GPU",
 "memory_total_bytes": 85899345920, "memory_used_bytes": $1, "processes": [{"pid": 7101, "used_bytes": $1}]}]}
EOF
  mv "$WORK/sample.tmp" "$WORK/sample.json"
}
sample $((2 * GI))
token_kubeconfig "$WORK/agent.kubeconfig" agent \
  "$(kubectl create token "$A-agent" -n "$A" --duration=1h --bound-object-kind Node --bound-object-name "$NODE")"
KUBECONFIG=$WORK/agent.kubeconfig RUST_LOG=info "$BIN/gpubudget-agent" run --node-name "$NODE" \
  --proc-root "$WORK/proc" --sample-file "$WORK/sample.json" --interval 250ms --admin-addr "$ADMIN" \
  > "$WORK/agent.log" 2>&1 &
AGENT_PID=$!
wait_for "agent ready" ready "$ADMIN"
wait_for "the agent's record on t-bound (state Within)" annotation_is "$NS_T" t-bound state Within
info "t-bound: $(ann t-bound)"
attempt denied "refused through pods/status" tenant patch pod t-bound -n "$NS_T" --subresource=status --type=merge \
  -p '{"metadata":{"annotations":{"gpubudget.io/state":"Over"}}}'
status_put tenant t-bound '.metadata.annotations |= with_entries(select(.key | startswith("gpubudget.io/") | not))' \
  denied "refused through pods/status"
attempt denied "refused through pods/status" admin patch pod t-bound -n "$NS_T" --subresource=status --type=merge \
  -p '{"metadata":{"annotations":{"gpubudget.io/usage-bytes":"0"}}}'
attempt ok "" kubelet patch pod t-bound -n "$NS_T" --subresource=status --type=strategic \
  -p '{"status":{"conditions":[{"type":"Ready","status":"False","reason":"KubeletProbe"}]}}'
status_put kubelet t-bound '.status.conditions = [{"type":"Ready","status":"True"}]' ok ""
RECORD=$(ann t-bound)
info "t-bound after the kubelet's writes: $RECORD"
jq -e '."gpubudget.io/state" == "Within"' <<<"$RECORD" >/dev/null || die "the agent's record changed"

say "3. one release per cluster"
rc=0
"$HELM" install "$B" "$WORK/chart" -n "$B" > "$WORK/install-b.txt" 2>&1 || rc=$?
sed 's/^/    /' "$WORK/install-b.txt"
[ "$rc" != 0 ] || die "a second release installed"
grep -q "gpubudget is already installed in this cluster: .* belongs to release \"$A\" in namespace \"$A\"" "$WORK/install-b.txt" \
  || die "the second install failed without naming the first release"
info "ok: helm install $B refused (exit status $rc), naming release $A"
"$HELM" upgrade "$A" "$WORK/chart" -n "$A" > "$WORK/upgrade-a.txt" 2>&1 || { cat "$WORK/upgrade-a.txt"; die "helm upgrade $A"; }
info "ok: helm upgrade $A: $(grep -m1 '^STATUS' "$WORK/upgrade-a.txt")"
# Policies another install left: release B's, applied without Helm (as an old chart or a kubectl apply would).
"$HELM" template "$B" "$WORK/chart" -n "$B" --kube-version 1.33.0 \
  | yq -y 'select(.kind == "ValidatingAdmissionPolicy" or .kind == "ValidatingAdmissionPolicyBinding")' > "$WORK/b-policies.yaml"
kubectl apply -f "$WORK/b-policies.yaml" | sed 's/^/    /'
rc=0
"$HELM" install "$B-2" "$WORK/chart" -n "$B" > "$WORK/install-b2.txt" 2>&1 || rc=$?
sed 's/^/    /' "$WORK/install-b2.txt"
[ "$rc" != 0 ] || die "a release installed next to another install's policies"
sleep 2
T0=$SECONDS
sample $((5 * GI)) # over its 4Gi: the agent writes an Over record, which B's records policy refuses
node_denied() {
  kubectl get events.v1.events.k8s.io -n default -o json \
    | jq -c --arg node "$NODE" '[.items[] | select(.regarding.kind == "Node" and .regarding.name == $node and .reason == "GpuBudgetWriteDenied")]'
}
node_told() { [ "$(node_denied | jq length)" -gt 0 ]; }
wait_for "GpuBudgetWriteDenied on Node $NODE" node_told
NOTE=$(node_denied | jq -r '.[0].note')
info "told $((SECONDS - T0)) s after the refused write was due: $(node_denied | jq -r '.[0].type') GpuBudgetWriteDenied on Node $NODE:"
info "  $NOTE"
grep -q "ValidatingAdmissionPolicy $B-agent-records (HTTP 403)" <<<"$NOTE" || die "the event does not name B's records policy"
[ "$(annotation "$NS_T" t-bound state)" = Within ] || die "a refused record landed"
sleep 10
DENIED=$(curl -fsS "http://$ADMIN/metrics" | sed -n 's/^gpubudget_api_writes_total{kind="apply",result="denied"} \([0-9]*\).*/\1/p')
TOLD=$(node_denied | jq '[.[] | (.series.count // 1)] | add // 0')
info "10 s later: gpubudget_api_writes_total{kind=\"apply\",result=\"denied\"} $DENIED, GpuBudgetWriteDenied told $TOLD time(s)"
[ "${DENIED:-0}" -ge 2 ] && [ "$TOLD" = 1 ] || die "expected several denied writes and one event"
kubectl delete -f "$WORK/b-policies.yaml" >/dev/null
wait_for "the Over record lands once the other install's policies are gone" annotation_is "$NS_T" t-bound state Over

FAILED=0
say "PASS: $REFUSED writes through pods, pods/status, pods/binding and bindings refused, $PASSED allowed as they must; one release per cluster ($((SECONDS - START)) s)"
