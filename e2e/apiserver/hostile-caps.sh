#!/usr/bin/env bash
# A tenant who cannot stall the operator (issue 32, item 2) against a real kube-apiserver, no kubelet: the
# operator's caps webhook and eviction check served from one process, a tenant sending hostile pod creates
# (`kubectl create --dry-run=server`, a 1.6 MB CUDA_MPS_PINNED_DEVICE_MEM_LIMIT of 150 000 entries) in a loop,
# and the eviction check's latency measured while it does.
#
#   GPUBUDGET_E2E_APISERVER=1 KUBECONFIG=/tmp/realk8s/run/kubeconfig e2e/apiserver/hostile-caps.sh [OUT]
#   GPUBUDGET_E2E_APISERVER=1 REALK8S_DIR=/tmp/realk8s e2e/apiserver/hostile-caps.sh [OUT]   # starts it, stops it
#
# What it measures, on the real API server: the eviction check (POST /validate-eviction, the request the API
# server sends for each of the agent's evictions: a node-bound agent identity, a pod looked up through the API
# server) answered N times in a row (GPUBUDGET_E2E_HOSTILE_N, default 300) over one keep-alive TLS connection, as
# the API server holds one: p50/p99/max idle, then while W tenant loops (GPUBUDGET_E2E_HOSTILE_WORKERS, default
# 4) send the hostile creates; how many hostile creates went through and what the webhook made of the value.
# The chart is rendered with `helm template` (Kubernetes 1.33), its webhooks pointed at the operator on 127.0.0.1
# (URL mode, a certificate made here). OUT (optional) receives a copy of the output.
#
# Environment: as e2e/lib.sh says (GPUBUDGET_E2E_BIN, HELM, GPUBUDGET_E2E_STEP_TIMEOUT, GPUBUDGET_E2E_KEEP, REALK8S).
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
REPO=$(cd "$HERE/../.." && pwd)
REALK8S=${REALK8S:-/work/shared/realk8s}
if [ -n "${1:-}" ] && [ -z "${HOSTILE_TEE:-}" ]; then
  HOSTILE_TEE=1 exec > >(tee "$1") 2>&1
fi

# shellcheck source=../lib.sh
. "$REPO/e2e/lib.sh"
control_plane_or_skip "a hostile tenant against the operator" gpubudget-operator
STEP_TIMEOUT=${GPUBUDGET_E2E_STEP_TIMEOUT:-60}
POLL=0.5
N=${GPUBUDGET_E2E_HOSTILE_N:-300}
WORKERS=${GPUBUDGET_E2E_HOSTILE_WORKERS:-4}

ID=$(date +%s | tail -c 5)$RANDOM
ID=${ID:0:7}
NS=gpubudget-hostile-$ID          # the release's namespace
NS_A=gpubudget-hostile-$ID-a      # a budget with caps: the tenant's, and the pod the eviction check looks up
NODE=gpubudget-hostile-$ID-n1
RELEASE=gpubudget-hostile-$ID
WORK=$(mktemp -d "${TMPDIR:-/tmp}/gpubudget-hostile.XXXXXX")
PORT_BASE=$((20000 + RANDOM % 20000))
OPERATOR_ADMIN=127.0.0.1:$PORT_BASE
WEBHOOK=127.0.0.1:$((PORT_BASE + 1))
PIDS=()
FAILED=1
START=$SECONDS

cleanup() {
  local rc=$?
  [ -f "$WORK/stop" ] || touch "$WORK/stop" 2>/dev/null || true
  if [ "$FAILED" != 0 ]; then
    say "diagnostics"
    echo "--- operator log (last 40 lines)"; tail -n 40 "$WORK/operator.log" 2>/dev/null || true
  fi
  for pid in "${PIDS[@]}"; do stop_process "$pid"; done
  if [ "${GPUBUDGET_E2E_KEEP:-0}" = 1 ]; then
    say "keeping the namespaces, the cluster objects of $RELEASE and $WORK (GPUBUDGET_E2E_KEEP=1)"
  else
    kubectl delete namespace "$NS" "$NS_A" --wait=false --ignore-not-found >/dev/null 2>&1 || true
    kubectl delete node "$NODE" --ignore-not-found >/dev/null 2>&1 || true
    delete_release_objects "$RELEASE" mutatingwebhookconfiguration,validatingwebhookconfiguration,validatingadmissionpolicy,validatingadmissionpolicybinding,clusterrole,clusterrolebinding
    rm -rf "$WORK"
  fi
  if [ "$STARTED_REALK8S" = 1 ]; then bash "$REALK8S/down.sh" >/dev/null 2>&1 || true; fi
  exit "$rc"
}
trap cleanup EXIT

say "control plane, CRDs, the chart's RBAC, admission policies and webhooks (URL mode), one node, one pod"
kubectl version 2>/dev/null | sed 's/^/    /'
info "operator: $BIN/gpubudget-operator  run id: $ID  checks per run: $N  hostile loops: $WORKERS"
for ns in "$NS" "$NS_A"; do kubectl create namespace "$ns" >/dev/null; done
webhook_cert "$WORK/tls"
kubectl apply -f "$REPO/crds/" >/dev/null
kubectl wait --for=condition=Established crd/gpumemorybudgets.gpubudget.io crd/clustergpumemorybudgets.gpubudget.io \
  crd/clustergpumemoryquotas.gpubudget.io --timeout=60s >/dev/null
# shellcheck disable=SC2016 # $k, $caps, $evict and $ca are yq's variables
"$HELM" template "$RELEASE" "$REPO/charts/gpubudget" -n "$NS" --kube-version 1.33.0 \
  | yq -y --arg caps "https://$WEBHOOK/mutate-pod-caps" --arg evict "https://$WEBHOOK/validate-eviction" \
      --arg ca "$(base64 -w0 < "$WORK/tls/ca.crt")" \
      'select(. != null) | select(.kind as $k | ["ServiceAccount", "ClusterRole", "ClusterRoleBinding",
        "ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding", "MutatingWebhookConfiguration"] | index($k) != null)
       | if .kind == "MutatingWebhookConfiguration" then .webhooks |= map(.clientConfig = {url: $caps, caBundle: $ca}) else . end' \
  > "$WORK/chart.yaml"
kubectl apply -f "$WORK/chart.yaml" >/dev/null
kubectl create -f - >/dev/null <<EOF
apiVersion: v1
kind: Node
metadata: {name: $NODE, labels: {e2e.gpubudget.io/run: "$ID"}}
EOF
kubectl apply -f - >/dev/null <<EOF
apiVersion: gpubudget.io/v1alpha1
kind: GpuMemoryBudget
metadata: {name: capped, namespace: $NS_A}
spec: {selector: {}, limit: 8Gi, admissionCaps: Enabled}
EOF
OPERATOR_KC=$WORK/operator.kubeconfig
token_kubeconfig "$OPERATOR_KC" operator "$(kubectl create token "$RELEASE-operator" -n "$NS" --duration=1h)"
KUBECONFIG=$OPERATOR_KC POD_NAMESPACE=$NS POD_NAME=operator-1 RUST_LOG=info \
  "$BIN/gpubudget-operator" run --admin-addr "$OPERATOR_ADMIN" --webhook-addr "$WEBHOOK" \
  --webhook-cert-dir "$WORK/tls" > "$WORK/operator.log" 2>&1 &
PIDS+=($!)
wait_for "operator ready" ready "$OPERATOR_ADMIN"
labelled() { [ "$(kubectl get namespace "$NS_A" -o jsonpath='{.metadata.labels.gpubudget\.io/admission-caps}')" = enabled ]; }
wait_for "the operator labels $NS_A for the caps webhook" labelled
kubectl create -n "$NS_A" -f - >/dev/null <<EOF
apiVersion: v1
kind: Pod
metadata: {name: victim}
spec:
  nodeName: $NODE
  containers: [{name: main, image: local/busybox:1, resources: {limits: {nvidia.com/gpu: "1"}}}]
EOF
info "victim's MPS cap set at admission: $(kubectl get pod victim -n "$NS_A" -o json | jq -r '.spec.containers[0].env[]? | select(.name == "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT") | .value')"

# The hostile pod: one GPU container whose MPS value is 150 000 entries (1.6 MB, under the API server's 3 MB).
python3 - "$WORK/hostile.json" <<'EOF'
import json, sys
value = ",".join(f"{i % 7}={100000 + i % 50}M" for i in range(150_000))
pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"generateName": "hostile-"},
       "spec": {"containers": [{"name": "main", "image": "local/busybox:1",
                                "env": [{"name": "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT", "value": value}],
                                "resources": {"limits": {"nvidia.com/gpu": "1"}}}]}}
json.dump(pod, open(sys.argv[1], "w"))
EOF
info "hostile pod: $(wc -c < "$WORK/hostile.json") bytes"
ONE=$(kubectl create --dry-run=server -n "$NS_A" -f "$WORK/hostile.json" -o json)
info "what the webhook makes of its value (dry run): $(jq -r '.spec.containers[0].env[] | select(.name == "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT") | .value' <<<"$ONE" | cut -c1-80)"

# check LABEL: N eviction-check requests over one keep-alive TLS connection; prints p50/p99/max and the verdicts.
cat > "$WORK/check.py" <<'EOF'
import http.client, json, ssl, sys, time
addr, ca, ns, node, sa, n, label = sys.argv[1:8]
host, port = addr.rsplit(":", 1)
ctx = ssl.create_default_context(cafile=ca)
conn = http.client.HTTPSConnection(host, int(port), context=ctx, timeout=30)
times, verdicts = [], {}
for i in range(int(n)):
    body = json.dumps({"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": {
        "uid": f"u-{i}", "kind": {"group": "policy", "version": "v1", "kind": "Eviction"},
        "resource": {"group": "", "version": "v1", "resource": "pods"}, "subResource": "eviction",
        "name": "victim", "namespace": ns, "operation": "CREATE",
        "userInfo": {"username": sa, "groups": ["system:serviceaccounts"],
                     "extra": {"authentication.kubernetes.io/node-name": [node]}},
        "object": {"apiVersion": "policy/v1", "kind": "Eviction", "metadata": {"name": "victim", "namespace": ns}},
        "dryRun": False}})
    t0 = time.perf_counter()
    try:
        conn.request("POST", "/validate-eviction", body, {"Content-Type": "application/json"})
        resp = conn.getresponse()
        answer = json.loads(resp.read())
        verdict = "allowed" if answer["response"]["allowed"] else "denied"
    except Exception as e:  # a failed call is what failurePolicy Fail turns into a refused eviction
        verdict = f"error: {type(e).__name__}"
        conn.close()
        conn = http.client.HTTPSConnection(host, int(port), context=ctx, timeout=30)
    times.append((time.perf_counter() - t0) * 1000)
    verdicts[verdict] = verdicts.get(verdict, 0) + 1
    time.sleep(0.01)
times.sort()
q = lambda p: times[min(len(times) - 1, int(p * len(times)))]
print(f"{label}: n={len(times)} p50={q(0.5):.1f} ms p99={q(0.99):.1f} ms max={times[-1]:.1f} ms verdicts={verdicts}")
EOF
AGENT_USER=system:serviceaccount:$NS:$RELEASE-agent
check() { python3 "$WORK/check.py" "$WEBHOOK" "$WORK/tls/ca.crt" "$NS_A" "$NODE" "$AGENT_USER" "$N" "$1"; }

say "the eviction check, idle"
IDLE=$(check idle); info "$IDLE"

say "the eviction check while $WORKERS tenant loops send hostile dry-run creates"
hostile_loop() {
  local n=0 ok=0
  while [ ! -f "$WORK/stop" ]; do
    n=$((n + 1))
    kubectl create --dry-run=server -n "$NS_A" -f "$WORK/hostile.json" -o name >/dev/null 2>&1 && ok=$((ok + 1))
  done
  echo "$n $ok" > "$WORK/loop-$1.count"
}
for w in $(seq 1 "$WORKERS"); do hostile_loop "$w" & PIDS+=($!); done
sleep 3
T0=$SECONDS
LOADED=$(check "under hostile creates"); info "$LOADED"
ELAPSED=$((SECONDS - T0))
touch "$WORK/stop"
for pid in "${PIDS[@]:1}"; do wait "$pid" 2>/dev/null || true; done
TOTAL=0 OK=0
for w in $(seq 1 "$WORKERS"); do read -r n ok < "$WORK/loop-$w.count"; TOTAL=$((TOTAL + n)); OK=$((OK + ok)); done
info "hostile creates: $TOTAL sent ($OK admitted by the dry run) in about $((ELAPSED + 3)) s"
METRICS=$(curl -fsS "http://$OPERATOR_ADMIN/metrics" | grep '^gpubudget_operator_caps_admissions_total' | sed 's/^/      /')
info "the caps webhook's answers:"; echo "$METRICS"
grep -q "verdicts={'allowed': $N}" <<<"$LOADED" || die "the eviction check did not allow every request under load: $LOADED"
P99=$(sed -E 's/.*p99=([0-9.]+) ms.*/\1/' <<<"$LOADED")
awk -v p="$P99" 'BEGIN { exit !(p < 1000) }' || die "p99 $P99 ms under load"

FAILED=0
say "PASS: the eviction check kept answering while a tenant sent hostile creates ($((SECONDS - START)) s)"
