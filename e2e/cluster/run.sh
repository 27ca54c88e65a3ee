#!/usr/bin/env bash
# gpubudget end to end on a real cluster (kind, k3d, or a real one): installs the chart with the agent
# replaying a sample file instead of NVML, runs the user's stories, and asserts on real Events and
# GpuMemoryBudget status. See e2e/cluster/README.md.
#
#   KUBECONFIG=~/.kube/config e2e/cluster/run.sh
#
# Without KUBECONFIG, or when `kubectl version` cannot reach the cluster, it prints how to run it and exits 0.
# Environment: GPUBUDGET_E2E_REGISTRY (default "gpubudget"), GPUBUDGET_E2E_TAG (default "dev"): the images
# are <registry>/gpubudget-agent:<tag> and <registry>/gpubudget-operator:<tag>. HELM (default: helm in PATH,
# else the Helm .ci/helm.sh caches). GPUBUDGET_E2E_PAUSE_IMAGE (default registry.k8s.io/pause:3.10): the
# image of the test pods. GPUBUDGET_E2E_STEP_TIMEOUT (default 180 s per wait). GPUBUDGET_E2E_KEEP=1 keeps
# the namespaces and release for inspection.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
REPO=$(cd "$HERE/../.." && pwd)

usage() {
  cat <<EOF
skipped: gpubudget e2e/cluster needs a reachable cluster: $1
  To run it (kind as an example; any cluster of Kubernetes 1.33 or newer works):
    kind create cluster --image kindest/node:v1.33.1
    docker build -f docker/agent.Dockerfile -t gpubudget/gpubudget-agent:dev .
    docker build -f docker/operator.Dockerfile -t gpubudget/gpubudget-operator:dev .
    kind load docker-image gpubudget/gpubudget-agent:dev gpubudget/gpubudget-operator:dev
    KUBECONFIG=\$HOME/.kube/config e2e/cluster/run.sh
EOF
}

if [ -z "${KUBECONFIG:-}" ]; then
  usage "KUBECONFIG is not set"
  exit 0
fi
if ! kubectl version --request-timeout=10s >/dev/null 2>&1; then
  usage "kubectl version failed with KUBECONFIG=$KUBECONFIG"
  exit 0
fi

REGISTRY=${GPUBUDGET_E2E_REGISTRY:-gpubudget}
TAG=${GPUBUDGET_E2E_TAG:-dev}
PAUSE_IMAGE=${GPUBUDGET_E2E_PAUSE_IMAGE:-registry.k8s.io/pause:3.10}
STEP_TIMEOUT=${GPUBUDGET_E2E_STEP_TIMEOUT:-180}
# shellcheck source=../lib.sh
. "$REPO/e2e/lib.sh"
# shellcheck disable=SC2015 # both tests must hold
[ -n "$HELM" ] && [ -x "$HELM" ] || { echo "FAIL: no helm (3.10 or newer): put it in PATH, set HELM, or run bash .ci/helm.sh once" >&2; exit 1; }

ID=$(date +%s | tail -c 6)$RANDOM
ID=${ID:0:8}
NS=gpubudget-e2e-$ID           # the chart
NS_A=gpubudget-e2e-$ID-a       # the Evict and Warn stories (examples/llm-inference.yaml, examples/training-warn.yaml)
NS_B=gpubudget-e2e-$ID-b       # overlapping budgets (examples/namespace-wide.yaml + llm-inference)
RELEASE=gpubudget-e2e-$ID
AGENT_SA=$RELEASE-agent        # the chart's <fullname>-agent (the release name contains "gpubudget")
SAMPLE_CM=gpubudget-e2e-sample
WORK=$(mktemp -d "${TMPDIR:-/tmp}/gpubudget-e2e.XXXXXX")
CRD=gpumemorybudgets.gpubudget.io
CRD_EXISTED=$(kubectl get crd "$CRD" -o name 2>/dev/null || true)
FAILED=1
START=$SECONDS

POLL=2

diagnostics() {
  say "diagnostics"
  kubectl get pods -n "$NS" -o wide || true
  kubectl logs -n "$NS" -l app.kubernetes.io/component=operator --tail=100 --prefix || true
  kubectl logs -n "$NS" -l app.kubernetes.io/component=agent --tail=200 --prefix || true
  for ns in "$NS_A" "$NS_B"; do
    kubectl get pods -n "$ns" -o wide --show-labels || true
    kubectl get events -n "$ns" --sort-by=.lastTimestamp || true
    kubectl get gmb -n "$ns" -o yaml || true
  done
}

cleanup() {
  local rc=$?
  [ "$FAILED" = 0 ] || diagnostics
  if [ "${GPUBUDGET_E2E_KEEP:-0}" = 1 ]; then
    say "keeping namespaces $NS $NS_A $NS_B and release $RELEASE (GPUBUDGET_E2E_KEEP=1)"
  else
    say "cleanup"
    "$HELM" uninstall "$RELEASE" -n "$NS" --wait --timeout 2m >/dev/null 2>&1 || true
    kubectl delete namespace "$NS" "$NS_A" "$NS_B" --wait=false --ignore-not-found >/dev/null 2>&1 || true
    if [ -z "$CRD_EXISTED" ]; then
      kubectl delete crd "$CRD" --wait=false --ignore-not-found >/dev/null 2>&1 || true
    fi
  fi
  rm -rf "$WORK"
  exit "$rc"
}
trap cleanup EXIT


# event_messages NAMESPACE POD REASON: the messages of the pod's events with that reason.
event_messages() {
  kubectl get events -n "$1" --field-selector "involvedObject.kind=Pod,involvedObject.name=$2,reason=$3" \
    -o jsonpath='{range .items[*]}{.message}{"\n"}{end}'
}
has_event() { [ -n "$(event_messages "$@")" ]; }
pod_gone_or_terminating() {
  local out
  out=$(kubectl get pod "$2" -n "$1" -o jsonpath='{.metadata.deletionTimestamp}' 2>&1) && [ -n "$out" ] && return 0
  [[ "$out" == *NotFound* ]]
}

say "cluster"
kubectl version 2>/dev/null | sed 's/^/    /'
SERVER_MINOR=$(kubectl version -o json 2>/dev/null | sed -n 's/.*"minor": *"\([0-9]*\).*/\1/p' | tail -n1)
# shellcheck disable=SC2015 # both tests must hold
[ -n "$SERVER_MINOR" ] && [ "$SERVER_MINOR" -ge 33 ] || die "the chart supports Kubernetes 1.33 or newer (server minor: ${SERVER_MINOR:-unknown})"
if kubectl get daemonset -A -l app.kubernetes.io/name=gpubudget,app.kubernetes.io/component=agent -o name 2>/dev/null | grep -q .; then
  die "gpubudget is already installed in this cluster: its agents would enforce the test budgets too; use a cluster without it"
fi
info "helm: $("$HELM" version --short)  images: $REGISTRY/gpubudget-{agent,operator}:$TAG  run id: $ID"

say "namespaces and test pods (pause containers; their GPU usage comes from the replayed sample)"
kubectl create namespace "$NS" >/dev/null
# The agent mounts the host's /proc (hostPath): the chart's namespace needs Pod Security level privileged.
kubectl label namespace "$NS" pod-security.kubernetes.io/enforce=privileged >/dev/null
kubectl create namespace "$NS_A" >/dev/null
kubectl create namespace "$NS_B" >/dev/null
make_pod() { # NAMESPACE NAME LABELS(k=v,...)
  local labels="" kv
  IFS=, read -ra kvs <<<"$3"
  for kv in "${kvs[@]}"; do [ -n "$kv" ] && labels+="    ${kv%%=*}: \"${kv#*=}\""$'\n'; done
  kubectl apply -f - >/dev/null <<EOF
apiVersion: v1
kind: Pod
metadata:
  name: $2
  namespace: $1
  labels:
    e2e.gpubudget.io/run: "$ID"
${labels}spec:
  terminationGracePeriodSeconds: 5
  containers:
    - name: main
      image: $PAUSE_IMAGE
      resources:
        requests: {cpu: 5m, memory: 8Mi}
        limits: {memory: 32Mi}
      securityContext:
        allowPrivilegeEscalation: false
        runAsNonRoot: true
        runAsUser: 65535
        capabilities: {drop: [ALL]}
        seccompProfile: {type: RuntimeDefault}
EOF
}
make_pod "$NS_A" llm-evict app=llm                # Evict story: 6Gi → 7.5Gi → 9Gi of 8Gi
make_pod "$NS_A" trainer job-type=training        # Warn story: 20Gi → 35Gi → 45Gi of 40Gi (Warn, 80 %)
make_pod "$NS_B" llm-b app=llm                    # matched by llm-inference (8Gi) and team-b-default (20Gi)
make_pod "$NS_B" other-b tier=batch               # matched by team-b-default only
for ns in "$NS_A" "$NS_B"; do
  kubectl wait --for=condition=Ready pod --all -n "$ns" --timeout="${STEP_TIMEOUT}s" >/dev/null \
    || die "test pods in $ns did not become Ready (image $PAUSE_IMAGE pullable?)"
done
UID_EVICT=$(uid "$NS_A" llm-evict)
UID_TRAINER=$(uid "$NS_A" trainer)
UID_LLM_B=$(uid "$NS_B" llm-b)
UID_OTHER_B=$(uid "$NS_B" other-b)
info "pods ready: llm-evict=$UID_EVICT trainer=$UID_TRAINER llm-b=$UID_LLM_B other-b=$UID_OTHER_B"

# write_sample PHASE EVICT TRAINER: the sample file the agents replay (every agent reads the same file and
# charges only the pods on its own node), as a ConfigMap; then nudge the agent pods so the kubelet refreshes
# the mounted file at once instead of at its next periodic sync.
write_sample() {
  cat > "$WORK/sample.json" <<EOF
{
  "version": 1,
  "host": "gpubudget-e2e-$ID phase $1",
  "gpus": [
    {"index": 0, "uuid": "GPU-e2e00000-0000-0000-0000-000000000000", "name": "replayed e2e GPU",
     "memory_total_bytes": "80Gi",
     "processes": [
       {"pod_uid": "$UID_EVICT", "container": "main", "used_bytes": "$2"},
       {"pod_uid": "$UID_TRAINER", "container": "main", "used_bytes": "$3"},
       {"pod_uid": "$UID_LLM_B", "container": "main", "used_bytes": "1Gi"},
       {"pod_uid": "$UID_OTHER_B", "container": "main", "used_bytes": "2Gi"}
     ]}
  ]
}
EOF
  kubectl create configmap "$SAMPLE_CM" -n "$NS" --from-file=sample.json="$WORK/sample.json" \
    --dry-run=client -o yaml | kubectl apply -f - >/dev/null
  kubectl annotate pods -n "$NS" -l app.kubernetes.io/component=agent "e2e.gpubudget.io/sample-phase=$1" \
    --overwrite >/dev/null 2>&1 || true
  info "sample phase $1: llm-evict $2, trainer $3, llm-b 1Gi, other-b 2Gi"
}
write_sample 1 6Gi 20Gi

say "helm install (release $RELEASE in $NS)"
"$HELM" install "$RELEASE" "$REPO/charts/gpubudget" -n "$NS" -f "$HERE/values.yaml" \
  --set "image.registry=$REGISTRY" --set-string "agent.image.tag=$TAG" --set-string "operator.image.tag=$TAG" \
  --wait --timeout "$((STEP_TIMEOUT + 120))s" >/dev/null || die "helm install did not become ready"
kubectl get pods -n "$NS" -o wide | sed 's/^/    /'

say "budgets from examples/ (namespaces rewritten to the test namespaces)"
apply_example() { # FILE NAMESPACE
  sed -E "s/^([[:space:]]*namespace:[[:space:]]*).*/\1$2/" "$REPO/examples/$1" | kubectl apply -f - | sed 's/^/    /'
}
apply_example llm-inference.yaml "$NS_A"
apply_example training-warn.yaml "$NS_A"
apply_example namespace-wide.yaml "$NS_B"
apply_example llm-inference.yaml "$NS_B"

say "the agents record what they replay (state, usage, budget annotations)"
wait_for "llm-evict recorded Within at 6Gi under llm-inference" \
  bash -c "[ \"\$(kubectl get pod llm-evict -n $NS_A -o jsonpath='{.metadata.annotations.gpubudget\.io/state}/{.metadata.annotations.gpubudget\.io/usage-bytes}/{.metadata.annotations.gpubudget\.io/budget}')\" = Within/6442450944/llm-inference ]"
wait_for "trainer recorded under training-audit" annotation_is "$NS_A" trainer budget training-audit
wait_for "llm-b recorded under llm-inference (the smaller of two budgets)" annotation_is "$NS_B" llm-b budget llm-inference
wait_for "other-b recorded under team-b-default" annotation_is "$NS_B" other-b budget team-b-default
NODE_EVICT=$(kubectl get pod llm-evict -n "$NS_A" -o jsonpath='{.spec.nodeName}')
annotation_is "$NS_A" llm-evict node "$NODE_EVICT" || die "llm-evict's record names node $(annotation "$NS_A" llm-evict node), not $NODE_EVICT"

say "Evict and Warn stories: usage rises to near the limit"
write_sample 2 7680Mi 35Gi
wait_for "GpuMemoryNearBudget on llm-evict (7.5Gi of 8Gi)" has_event "$NS_A" llm-evict GpuMemoryNearBudget
wait_for "GpuMemoryNearBudget on trainer (35Gi of 40Gi, warn at 80 %)" has_event "$NS_A" trainer GpuMemoryNearBudget
info "llm-evict: $(event_messages "$NS_A" llm-evict GpuMemoryNearBudget | tail -n1)"

say "usage goes over the limit"
write_sample 3 9Gi 45Gi
wait_for "GpuMemoryOverBudget on llm-evict (9Gi of 8Gi)" has_event "$NS_A" llm-evict GpuMemoryOverBudget
wait_for "GpuMemoryOverBudget on trainer (45Gi of 40Gi)" has_event "$NS_A" trainer GpuMemoryOverBudget
OVER_AT=$SECONDS
info "llm-evict: $(event_messages "$NS_A" llm-evict GpuMemoryOverBudget | tail -n1)"
event_messages "$NS_A" llm-evict GpuMemoryOverBudget | grep -q "llm-inference" \
  || die "the GpuMemoryOverBudget message does not name the budget llm-inference"

say "Evict story: after overLimitSeconds (10 s) the agent evicts llm-evict, with the budget's 30 s grace"
wait_for "EvictingForGpuMemory on llm-evict" has_event "$NS_A" llm-evict EvictingForGpuMemory
MSG=$(event_messages "$NS_A" llm-evict EvictingForGpuMemory | tail -n1)
info "llm-evict: $MSG"
[[ "$MSG" == *llm-inference* && "$MSG" == *8Gi* ]] || die "EvictingForGpuMemory message should name the budget and its 8Gi limit: $MSG"
wait_for "llm-evict evicted (terminating or gone)" pod_gone_or_terminating "$NS_A" llm-evict
wait_for "llm-inference status: EVICTED 1" status_is "$NS_A" llm-inference evictions 1
wait_for "llm-inference status: lastEviction names llm-evict" status_is "$NS_A" llm-inference lastEviction.pod llm-evict
kubectl get gmb -n "$NS_A" | sed 's/^/    /'

say "Warn story: trainer stays over 40Gi past overLimitSeconds (30 s), events only"
REMAINING=$((OVER_AT + 45 - SECONDS))
[ "$REMAINING" -le 0 ] || sleep "$REMAINING"
has_event "$NS_A" trainer EvictingForGpuMemory && die "trainer (action Warn) got an EvictingForGpuMemory event"
[ -z "$(kubectl get pod trainer -n "$NS_A" -o jsonpath='{.metadata.deletionTimestamp}')" ] || die "trainer (action Warn) is being deleted"
annotation_is "$NS_A" trainer state Over || die "trainer's recorded state is $(annotation "$NS_A" trainer state), not Over"
wait_for "training-audit status: OVER 1" status_is "$NS_A" training-audit podsOverBudget 1
[ "$(status_field "$NS_A" training-audit evictions)" = 0 ] || [ -z "$(status_field "$NS_A" training-audit evictions)" ] \
  || die "training-audit counts evictions: $(status_field "$NS_A" training-audit evictions)"
info "trainer is still running, Over, never evicted"

say "overlapping budgets: llm-b is matched by llm-inference (8Gi) and team-b-default (20Gi)"
wait_for "llm-inference Overlapping=True" condition_is "$NS_B" llm-inference Overlapping True
wait_for "team-b-default Overlapping=True" condition_is "$NS_B" team-b-default Overlapping True
wait_for "llm-inference MATCHED 1 (llm-b: the smaller limit wins)" status_is "$NS_B" llm-inference matchedPods 1
wait_for "team-b-default MATCHED 1 (other-b)" status_is "$NS_B" team-b-default matchedPods 1
kubectl get gmb -n "$NS_B" | sed 's/^/    /'
info "$(kubectl get gmb team-b-default -n "$NS_B" -o jsonpath='{.status.conditions[?(@.type=="Overlapping")].message}')"

if [ "$(kubectl get validatingadmissionpolicy -o name 2>/dev/null | grep -c "$RELEASE-agent-node-restriction" || true)" -gt 0 ]; then
  say "node restriction: the agent's identity without its node-bound token can neither annotate nor evict"
  if kubectl auth can-i impersonate serviceaccounts >/dev/null 2>&1; then
    AS="system:serviceaccount:$NS:$AGENT_SA"
    if OUT=$(kubectl --as="$AS" annotate pod other-b -n "$NS_B" gpubudget.io/state=Over --overwrite 2>&1); then
      die "the agent's identity without a node claim annotated other-b: $OUT"
    fi
    [[ "$OUT" == *"gpubudget agent"* ]] || die "annotation refused, but not by the node-restriction policy: $OUT"
    info "annotate refused: ${OUT##*: }"
    printf '{"apiVersion":"policy/v1","kind":"Eviction","metadata":{"name":"other-b","namespace":"%s"}}' "$NS_B" > "$WORK/eviction.json"
    if OUT=$(kubectl --as="$AS" create --raw "/api/v1/namespaces/$NS_B/pods/other-b/eviction" -f "$WORK/eviction.json" 2>&1); then
      die "the agent's identity without a node claim evicted other-b: $OUT"
    fi
    [[ "$OUT" == *"agent-eviction.gpubudget.io"* || "$OUT" == *gpubudget* ]] || die "eviction refused, but not by the gpubudget webhook: $OUT"
    info "eviction refused: ${OUT##*: }"
    [ -z "$(kubectl get pod other-b -n "$NS_B" -o jsonpath='{.metadata.deletionTimestamp}')" ] || die "other-b is being deleted"
  else
    info "skipped: you may not impersonate service accounts (kubectl auth can-i impersonate serviceaccounts)"
  fi
fi

FAILED=0
say "PASS: Evict, Warn, overlapping budgets$( [ -n "${AS:-}" ] && echo ", node restriction") ($((SECONDS - START)) s)"
