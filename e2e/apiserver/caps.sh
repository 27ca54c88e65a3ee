#!/usr/bin/env bash
# Caps set at admission against a real kube-apiserver, no kubelet (issue 22, part 5): the operator's
# mutating webhook (POST /mutate-pod-caps), scoped by the namespace label the operator keeps, the chart's caps
# record policy, a tenant's attempts at the record, the operator down, and the webhook's cost per pod create.
#
#   GPUBUDGET_E2E_APISERVER=1 KUBECONFIG=/tmp/realk8s/run/kubeconfig e2e/apiserver/caps.sh [OUT]
#   GPUBUDGET_E2E_APISERVER=1 REALK8S_DIR=/tmp/realk8s e2e/apiserver/caps.sh [OUT]   # starts it (up.sh), stops it
#
# What it checks, on real objects:
# - the operator labels the namespace of a budget with `admissionCaps: Enabled` (and only it);
# - a GPU pod a tenant creates there gets CUDA_MPS_PINNED_DEVICE_MEM_LIMIT (one entry per device),
#   NVIDIA_GPU_MEMORY_LIMIT and NVIDIA_GPU_MEMORY_REQUEST, and the gpubudget.io/caps record;
# - a user's smaller values are kept (in canonical form: 0=2G is written 0=2048M, #32);
# - a GPU pod in a namespace without such a budget gets nothing and never reaches the webhook (the operator's
#   gpubudget_operator_caps_admissions_total does not move);
# - the tenant (`edit` in its namespace, by token) cannot forge the record: one written at creation is replaced
#   by the webhook's; adding, changing or removing it afterwards is refused by the chart's policy;
# - the operator down: pods are still created (failurePolicy Ignore), without the variables, and once the
#   operator is back its status counts them uncapped (a record forged meanwhile does not make one capped);
# - pod-create latency, p50/p99 of N sequential creates (GPUBUDGET_E2E_CAPS_N, default 200) in a namespace the
#   webhook serves and in one it does not.
# The chart is rendered with `helm template` (Kubernetes 1.33), its MutatingWebhookConfiguration pointed at the
# operator on 127.0.0.1 (URL mode, a certificate made here). OUT (optional) receives a copy of the output.
#
# Environment: as e2e/lib.sh says (GPUBUDGET_E2E_BIN, HELM, GPUBUDGET_E2E_STEP_TIMEOUT, GPUBUDGET_E2E_KEEP, REALK8S).
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
REPO=$(cd "$HERE/../.." && pwd)
REALK8S=${REALK8S:-/work/shared/realk8s}
if [ -n "${1:-}" ] && [ -z "${CAPS_TEE:-}" ]; then
  CAPS_TEE=1 exec > >(tee "$1") 2>&1
fi

# shellcheck source=../lib.sh
. "$REPO/e2e/lib.sh"
control_plane_or_skip "caps at admission" gpubudget-operator
STEP_TIMEOUT=${GPUBUDGET_E2E_STEP_TIMEOUT:-60}
POLL=0.5
N=${GPUBUDGET_E2E_CAPS_N:-200}

ID=$(date +%s | tail -c 5)$RANDOM
ID=${ID:0:7}
NS=gpubudget-caps-$ID             # the release's namespace
NS_A=gpubudget-caps-$ID-a         # a budget with caps; the tenant's
NS_B=gpubudget-caps-$ID-b         # no budget
NS_L1=gpubudget-caps-$ID-l1       # latency: served by the webhook
NS_L2=gpubudget-caps-$ID-l2       # latency: not served
RELEASE=gpubudget-caps-$ID
OPERATOR_SA=$RELEASE-operator
CRD=gpumemorybudgets.gpubudget.io
CRD_EXISTED=$(kubectl get crd "$CRD" -o name 2>/dev/null || true)
WORK=$(mktemp -d "${TMPDIR:-/tmp}/gpubudget-caps.XXXXXX")
PORT_BASE=$((20000 + RANDOM % 20000))
OPERATOR_ADMIN=127.0.0.1:$PORT_BASE
WEBHOOK=127.0.0.1:$((PORT_BASE + 1))
OPERATOR_PID=""
FAILED=1
START=$SECONDS
RUNS=0

cleanup() {
  local rc=$?
  if [ "$FAILED" != 0 ]; then
    say "diagnostics"
    kubectl get pods,gmb -n "$NS_A" -o wide || true
    echo "--- operator log (last 40 lines)"; tail -n 40 "$WORK"/operator-*.log 2>/dev/null || true
  fi
  stop_process "$OPERATOR_PID"
  if [ "${GPUBUDGET_E2E_KEEP:-0}" = 1 ]; then
    say "keeping the namespaces, the cluster objects of $RELEASE and $WORK (GPUBUDGET_E2E_KEEP=1)"
  else
    kubectl delete namespace "$NS" "$NS_A" "$NS_B" "$NS_L1" "$NS_L2" --wait=false --ignore-not-found >/dev/null 2>&1 || true
    delete_release_objects "$RELEASE" mutatingwebhookconfiguration,validatingadmissionpolicy,validatingadmissionpolicybinding,clusterrole,clusterrolebinding
    [ -n "$CRD_EXISTED" ] || kubectl delete crd "$CRD" --wait=false --ignore-not-found >/dev/null 2>&1 || true
    rm -rf "$WORK"
  fi
  if [ "$STARTED_REALK8S" = 1 ]; then bash "$REALK8S/down.sh" >/dev/null 2>&1 || true; fi
  exit "$rc"
}
trap cleanup EXIT

# gpu_pod NAME [ENV_JSON] [ANNOTATIONS_JSON]: a pod with one container asking for 2 GPUs, as JSON, pinned to
# nodes that do not share them (without, 2 may be replicas of one card: no MPS cap is written).
gpu_pod() {
  jq -n --arg name "$1" --argjson env "${2:-[]}" --argjson ann "${3:-{\}}" '{apiVersion: "v1", kind: "Pod",
    metadata: {name: $name, annotations: $ann},
    spec: {nodeSelector: {"nvidia.com/gpu.sharing-strategy": "none"},
           containers: [{name: "main", image: "local/busybox:1", env: $env,
                         resources: {limits: {"nvidia.com/gpu": "2"}}}]}}'
}
# env_of NAMESPACE POD: the container's env as NAME=VALUE lines.
env_of() { kubectl get pod "$2" -n "$1" -o json | jq -r '.spec.containers[0].env // [] | .[] | "\(.name)=\(.value)"'; }
caps_record() { kubectl get pod "$2" -n "$1" -o jsonpath='{.metadata.annotations.gpubudget\.io/caps}'; }
admissions() { # the operator's caps_admissions_total, all results
  curl -fsS "http://$OPERATOR_ADMIN/metrics" | awk '/^gpubudget_operator_caps_admissions_total/ {s += $2} END {print s + 0}'
}
labelled() { [ "$(kubectl get namespace "$1" -o jsonpath='{.metadata.labels.gpubudget\.io/admission-caps}')" = enabled ]; }
start_operator() {
  RUNS=$((RUNS + 1))
  KUBECONFIG=$OPERATOR_KC POD_NAMESPACE=$NS POD_NAME=operator-$RUNS RUST_LOG=info \
    "$BIN/gpubudget-operator" run --admin-addr "$OPERATOR_ADMIN" --webhook-addr "$WEBHOOK" \
    --webhook-cert-dir "$WORK/tls" > "$WORK/operator-$RUNS.log" 2>&1 &
  OPERATOR_PID=$!
  wait_for "operator ready (run $RUNS)" ready "$OPERATOR_ADMIN"
}

say "control plane, chart"
kubectl version 2>/dev/null | sed 's/^/    /'
info "helm: $("$HELM" version --short 2>/dev/null)  operator: $BIN/gpubudget-operator  run id: $ID  creates per latency run: $N"
for ns in "$NS" "$NS_A" "$NS_B" "$NS_L1" "$NS_L2"; do kubectl create namespace "$ns" >/dev/null; done
webhook_cert "$WORK/tls"
# Both CRDs: the agent watches ClusterGpuMemoryBudgets too, and is not ready before that list.
kubectl apply -f "$REPO/crds/" >/dev/null
kubectl wait --for=condition=Established "crd/$CRD" crd/clustergpumemorybudgets.gpubudget.io --timeout=60s >/dev/null
# shellcheck disable=SC2016 # $k, $url and $ca are yq's variables
"$HELM" template "$RELEASE" "$REPO/charts/gpubudget" -n "$NS" --kube-version 1.33.0 \
  | yq -y --arg url "https://$WEBHOOK/mutate-pod-caps" --arg ca "$(base64 -w0 < "$WORK/tls/ca.crt")" \
      'select(. != null) | select(.kind as $k | ["ServiceAccount", "ClusterRole", "ClusterRoleBinding",
        "ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding", "MutatingWebhookConfiguration"] | index($k) != null)
       | if .kind == "MutatingWebhookConfiguration" then .webhooks |= map(.clientConfig = {url: $url, caBundle: $ca}) else . end' \
  > "$WORK/chart.yaml"
kubectl apply -f "$WORK/chart.yaml" | sed 's/^/    /'
kubectl create serviceaccount tenant -n "$NS_A" >/dev/null
kubectl create rolebinding tenant-edit -n "$NS_A" --clusterrole=edit --serviceaccount="$NS_A:tenant" >/dev/null
kubeconfig() { # NAME TOKEN: a kubeconfig of KUBECONFIG's server with that bearer token
  token_kubeconfig "$WORK/$1.kubeconfig" "$1" "$2"
  echo "$WORK/$1.kubeconfig"
}
OPERATOR_KC=$(kubeconfig operator "$(kubectl create token "$OPERATOR_SA" -n "$NS" --duration=2h)")
TENANT_KC=$(kubeconfig tenant "$(kubectl create token tenant -n "$NS_A" --duration=2h)")
tenant() { KUBECONFIG=$TENANT_KC kubectl -n "$NS_A" "$@"; }

say "operator; a budget with admissionCaps: Enabled in $NS_A labels that namespace only"
start_operator
kubectl apply -n "$NS_A" -f - >/dev/null <<EOF
apiVersion: gpubudget.io/v1alpha1
kind: GpuMemoryBudget
metadata: {name: llm}
spec: {selector: {}, limit: 8Gi, request: 6Gi, admissionCaps: Enabled}
EOF
wait_for "$NS_A labelled gpubudget.io/admission-caps=enabled" labelled "$NS_A"
labelled "$NS_B" && die "$NS_B was labelled"
info "ok: $NS_B not labelled"

say "a tenant's GPU pod in $NS_A gets the variables and the record"
gpu_pod plain | tenant create -f - >/dev/null
env_of "$NS_A" plain | sed 's/^/    env: /'
[ "$(env_of "$NS_A" plain)" = "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=8192M,1=8192M
NVIDIA_GPU_MEMORY_LIMIT=8192
NVIDIA_GPU_MEMORY_REQUEST=6144" ] || die "unexpected env on $NS_A/plain"
info "record: $(caps_record "$NS_A" plain)"
caps_record "$NS_A" plain | jq -e '.budget == "llm" and .limitMib == 8192 and .requestMib == 6144' >/dev/null \
  || die "unexpected record"
info "ok: three variables, one MPS entry per device, the record"

say "a user's smaller values are kept"
gpu_pod smaller '[{"name": "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT", "value": "0=2G,1=20G"},
                  {"name": "NVIDIA_GPU_MEMORY_LIMIT", "value": "1000"}]' | tenant create -f - >/dev/null
env_of "$NS_A" smaller | sed 's/^/    env: /'
[ "$(env_of "$NS_A" smaller)" = "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=2048M,1=8192M
NVIDIA_GPU_MEMORY_LIMIT=1000
NVIDIA_GPU_MEMORY_REQUEST=6144" ] || die "unexpected env on $NS_A/smaller"
info "ok: 0=2G kept as 0=2048M, 1000 kept, 1=20G lowered"

say "a GPU pod in $NS_B (no budget) gets nothing and never reaches the webhook"
before=$(admissions)
gpu_pod outside | kubectl create -n "$NS_B" -f - >/dev/null
[ -z "$(env_of "$NS_B" outside)" ] || die "$NS_B/outside got env"
after=$(admissions)
info "webhook answers before/after: $before/$after"
[ "$before" = "$after" ] || die "the webhook was called for $NS_B"
info "ok: no variables, no webhook call"

say "the tenant cannot forge the record"
gpu_pod forged-at-create '[]' '{"gpubudget.io/caps": "{\"budget\":\"llm\",\"limitMib\":99999,\"containers\":[]}"}' \
  | tenant create -f - >/dev/null
caps_record "$NS_A" forged-at-create | jq -e '.limitMib == 8192 and (.containers | length) == 1' >/dev/null \
  || die "a record written at creation survived: $(caps_record "$NS_A" forged-at-create)"
info "ok: written at creation: replaced by the webhook's ($(caps_record "$NS_A" forged-at-create | jq -c '{limitMib, containers: [.containers[].name]}'))"
refused() { # DESCRIPTION COMMAND...: the tenant's command fails with the policy's message
  local out
  if out=$("$@" 2>&1); then die "$1 was allowed"; fi
  case "$out" in
    *"cannot be added, changed or removed"*) info "ok: refused: $(echo "$out" | head -n1 | cut -c1-150)" ;;
    *) die "refused for another reason: $out" ;;
  esac
}
refused tenant annotate pod plain --overwrite 'gpubudget.io/caps={"budget":"llm","limitMib":1}'
refused tenant annotate pod plain 'gpubudget.io/caps-'
tenant annotate pod plain example.com/note=fine >/dev/null
info "ok: another annotation: allowed"

say "the operator down: pods are still created, without caps, and reported uncapped"
stop_process "$OPERATOR_PID"
OPERATOR_PID=""
gpu_pod while-down | tenant create -f - >/dev/null
gpu_pod forged-while-down '[]' '{"gpubudget.io/caps": "{\"budget\":\"llm\",\"limitMib\":8192,\"containers\":[]}"}' \
  | tenant create -f - >/dev/null
[ -z "$(env_of "$NS_A" while-down)" ] || die "caps set while the operator was down?"
info "ok: created without variables (failurePolicy Ignore)"
refused tenant annotate pod while-down 'gpubudget.io/caps={"budget":"llm","limitMib":8192,"containers":[]}'
start_operator
wait_for "status: 3 capped, 2 uncapped" bash -c "[ \"\$(kubectl get gmb llm -n $NS_A -o jsonpath='{.status.podsCapped}/{.status.podsUncapped}')\" = 3/2 ]"
kubectl get gmb -n "$NS_A" -o wide | sed 's/^/    /'

say "pod-create latency: $N sequential creates each, with and without the webhook"
kubectl apply -n "$NS_L1" -f - >/dev/null <<EOF
apiVersion: gpubudget.io/v1alpha1
kind: GpuMemoryBudget
metadata: {name: llm}
spec: {selector: {}, limit: 8Gi, admissionCaps: Enabled}
EOF
wait_for "$NS_L1 labelled" labelled "$NS_L1"
cat > "$WORK/latency.py" <<'PY'
import http.client, json, os, ssl, statistics, sys, time, urllib.parse
url = urllib.parse.urlparse(os.environ["API"])
ctx = ssl.create_default_context(); ctx.check_hostname = False; ctx.verify_mode = ssl.CERT_NONE
c = http.client.HTTPSConnection(url.hostname, url.port, context=ctx, timeout=30)
ns, n, tag = sys.argv[1], int(sys.argv[2]), sys.argv[3]
headers = {"Authorization": "Bearer " + os.environ["TOKEN"], "Content-Type": "application/json"}
times = []
for i in range(-10, n):  # 10 warm-up creates, not counted
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": f"lat-{i + 10}"},
           "spec": {"containers": [{"name": "main", "image": "local/busybox:1",
                                    "resources": {"limits": {"nvidia.com/gpu": "1"}}}]}}
    t = time.perf_counter()
    c.request("POST", f"/api/v1/namespaces/{ns}/pods", body=json.dumps(pod), headers=headers)
    r = c.getresponse(); body = r.read()
    ms = (time.perf_counter() - t) * 1000
    if r.status != 201:
        sys.exit(f"create failed: {r.status} {body[:200]!r}")
    if i >= 0:
        times.append(ms)
    capped = b"CUDA_MPS_PINNED_DEVICE_MEM_LIMIT" in body
q = statistics.quantiles(times, n=100)
print(f"{tag}: n={len(times)} p50={q[49]:.1f} ms p90={q[89]:.1f} ms p99={q[98]:.1f} ms mean={statistics.mean(times):.1f} ms max={max(times):.1f} ms capped={capped}")
PY
API=$(kubectl config view --minify -o jsonpath='{.clusters[0].cluster.server}')
ADMIN_TOKEN=$(kubectl config view --raw --minify -o jsonpath='{.users[0].user.token}')
for round in 1 2; do
  API=$API TOKEN=$ADMIN_TOKEN python3 "$WORK/latency.py" "$NS_L2" "$N" "round $round, without the webhook ($NS_L2)" | sed 's/^/    /'
  kubectl delete pods --all -n "$NS_L2" --wait=false >/dev/null
  API=$API TOKEN=$ADMIN_TOKEN python3 "$WORK/latency.py" "$NS_L1" "$N" "round $round, with the webhook    ($NS_L1)" | sed 's/^/    /'
  kubectl delete pods --all -n "$NS_L1" --wait=false >/dev/null
  sleep 2
done
info "operator: caps admissions answered: $(admissions) (this run); $(curl -fsS "http://$OPERATOR_ADMIN/metrics" | grep '^gpubudget_operator_caps_admissions_total' | tr '\n' ' ')"

FAILED=0
say "PASS ($((SECONDS - START)) s)"
