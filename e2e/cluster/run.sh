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
# GPUBUDGET_E2E_HOST_PROC=/proc: the script runs on the cluster's only node (e2e/cluster/realk8s.sh does): the
# replayed sample then names the host PIDs of the test pods' processes, found from their cgroups, and the
# attribution story (several containers, forked children, a restarted container) runs; it needs
# GPUBUDGET_E2E_SHELL_IMAGE (an image with /bin/sh and /bin/sleep). GPUBUDGET_E2E_ALLOW_KUBE_1_32=1 installs a
# copy of the chart whose kubeVersion also admits 1.32 (the chart itself keeps >=1.33), for a 1.32 test node.
# GPUBUDGET_E2E_DRAIN=1 also runs the node-drain story on a one-node cluster (skipped on more): `kubectl drain` of
# the node (every pod on it is evicted, the node is cordoned, then uncordoned): only for a test cluster
# (realk8s.sh sets it).
# GPUBUDGET_E2E_ADVERTISE_GPU=1: for the caps-at-admission story, the test node's status is patched to advertise
# the extended resources nvidia.com/gpu and nvidia.com/gpu.shared (one each; removed at the end): only for a test
# cluster without GPUs (realk8s.sh sets it). Without it the story runs only where a node already advertises both.
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
HOST_PROC=${GPUBUDGET_E2E_HOST_PROC:-}
SHELL_IMAGE=${GPUBUDGET_E2E_SHELL_IMAGE:-}
ALLOW_132=${GPUBUDGET_E2E_ALLOW_KUBE_1_32:-0}
DRAIN=${GPUBUDGET_E2E_DRAIN:-0}
ADVERTISE_GPU=${GPUBUDGET_E2E_ADVERTISE_GPU:-0}
[ -z "$HOST_PROC" ] || [ -n "$SHELL_IMAGE" ] || { echo "FAIL: GPUBUDGET_E2E_HOST_PROC needs GPUBUDGET_E2E_SHELL_IMAGE" >&2; exit 1; }
# shellcheck source=../lib.sh
. "$REPO/e2e/lib.sh"
# shellcheck disable=SC2015 # both tests must hold
[ -n "$HELM" ] && [ -x "$HELM" ] || { echo "FAIL: no helm (3.10 or newer): put it in PATH, set HELM, or run bash .ci/helm.sh once" >&2; exit 1; }

ID=$(date +%s | tail -c 6)$RANDOM
ID=${ID:0:8}
NS=gpubudget-e2e-$ID           # the chart
NS_A=gpubudget-e2e-$ID-a       # the Evict and Warn stories (examples/llm-inference.yaml, examples/training-warn.yaml)
NS_B=gpubudget-e2e-$ID-b       # overlapping budgets (examples/namespace-wide.yaml + llm-inference)
NS_C=gpubudget-e2e-$ID-c       # attribution through real cgroups (GPUBUDGET_E2E_HOST_PROC only)
NS_D=gpubudget-e2e-$ID-d       # caps at admission
RELEASE=gpubudget-e2e-$ID
AGENT_SA=$RELEASE-agent        # the chart's <fullname>-agent (the release name contains "gpubudget")
SAMPLE_CM=gpubudget-e2e-sample
WORK=$(mktemp -d "${TMPDIR:-/tmp}/gpubudget-e2e.XXXXXX")
CRD=gpumemorybudgets.gpubudget.io
CRD_EXISTED=$(kubectl get crd "$CRD" -o name 2>/dev/null || true)
FAILED=1
START=$SECONDS
PROBE_PID=""   # the eviction-probe loop running in the background, if any
DRAINED=""     # the node the drain story cordoned, until it is uncordoned
ADVERTISED=""  # the node whose status the caps story patched to advertise GPUs, until the patch is undone

POLL=2

diagnostics() {
  say "diagnostics"
  kubectl get pods -n "$NS" -o wide || true
  kubectl logs -n "$NS" -l app.kubernetes.io/component=operator --tail=100 --prefix || true
  kubectl logs -n "$NS" -l app.kubernetes.io/component=agent --tail=200 --prefix || true
  for ns in "$NS_A" "$NS_B" ${HOST_PROC:+"$NS_C"} "$NS_D"; do
    kubectl get pods -n "$ns" -o wide --show-labels || true
    kubectl get events -n "$ns" --sort-by=.lastTimestamp || true
    kubectl get gmb -n "$ns" -o yaml || true
  done
}

cleanup() {
  local rc=$?
  if [ -n "$PROBE_PID" ]; then touch "$WORK/stop-probes"; wait "$PROBE_PID" 2>/dev/null || true; fi
  [ "$FAILED" = 0 ] || diagnostics
  if [ -n "$DRAINED" ]; then kubectl uncordon "$DRAINED" >/dev/null 2>&1 || true; fi
  if [ -n "$ADVERTISED" ]; then unadvertise_gpu "$ADVERTISED" >/dev/null 2>&1 || true; fi
  if [ "${GPUBUDGET_E2E_KEEP:-0}" = 1 ]; then
    say "keeping namespaces $NS $NS_A $NS_B ${HOST_PROC:+$NS_C }and release $RELEASE (GPUBUDGET_E2E_KEEP=1)"
  else
    say "cleanup"
    "$HELM" uninstall "$RELEASE" -n "$NS" --wait --timeout 2m >/dev/null 2>&1 || true
    kubectl delete namespace "$NS" "$NS_A" "$NS_B" ${HOST_PROC:+"$NS_C"} "$NS_D" --wait=false --ignore-not-found >/dev/null 2>&1 || true
    if [ -z "$CRD_EXISTED" ]; then
      kubectl delete crd "$CRD" --wait=false --ignore-not-found >/dev/null 2>&1 || true
    fi
  fi
  rm -rf "$WORK"
  exit "$rc"
}
trap cleanup EXIT
# GPU_RESOURCES: the extended resources the caps story advertises on a test node (JSON Pointer names: / is ~1).
GPU_RESOURCES="nvidia.com~1gpu nvidia.com~1gpu.shared"
# unadvertise_gpu NODE: removes what the caps story added to the node's status capacity and allocatable (each
# path on its own: one the kubelet already dropped must not keep the others).
unadvertise_gpu() {
  local r f
  for r in $GPU_RESOURCES; do
    for f in capacity allocatable; do
      kubectl patch node "$1" --subresource=status --type=json -p "[{\"op\":\"remove\",\"path\":\"/status/$f/$r\"}]" >/dev/null 2>&1 || true
    done
  done
}


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
pod_gone() { [[ "$(kubectl get pod "$2" -n "$1" -o name 2>&1)" == *NotFound* ]]; }

say "cluster"
kubectl version 2>/dev/null | sed 's/^/    /'
SERVER_MINOR=$(kubectl version -o json 2>/dev/null | sed -n 's/.*"minor": *"\([0-9]*\).*/\1/p' | tail -n1)
MIN_MINOR=33
[ "$ALLOW_132" != 1 ] || MIN_MINOR=32
# shellcheck disable=SC2015 # both tests must hold
[ -n "$SERVER_MINOR" ] && [ "$SERVER_MINOR" -ge "$MIN_MINOR" ] || die "the chart supports Kubernetes 1.33 or newer (server minor: ${SERVER_MINOR:-unknown})"
CHART=$REPO/charts/gpubudget
if [ "$SERVER_MINOR" -lt 33 ]; then
  # For this test only: a copy of the chart whose kubeVersion admits 1.32; charts/gpubudget keeps >=1.33.
  cp -r "$CHART" "$WORK/chart"
  CHART=$WORK/chart
  sed -i -E 's/^kubeVersion: .*/kubeVersion: ">=1.32.0-0"/' "$CHART/Chart.yaml"
  info "Kubernetes 1.$SERVER_MINOR allowed for this test (GPUBUDGET_E2E_ALLOW_KUBE_1_32=1): a copy of the chart with kubeVersion >=1.32.0-0"
fi
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
make_pod "$NS_A" roll app=roll                    # operator rollout story: evicted (roll-evict, 8Gi) during the rollout
[ "$DRAIN" != 1 ] || make_pod "$NS_A" countdown app=countdown # drain story: over an Evict budget, 3600 s to go
if [ -n "$HOST_PROC" ]; then
  # Attribution through real cgroups: two containers, one a shell that forks two children. Their GPU usage is
  # replayed per host PID, so the agent must find pod and container from /proc/<pid>/cgroup as the kubelet
  # laid it out.
  kubectl create namespace "$NS_C" >/dev/null
  kubectl apply -f - >/dev/null <<EOF
apiVersion: v1
kind: Pod
metadata:
  name: multi
  namespace: $NS_C
  labels: {app: multi, e2e.gpubudget.io/run: "$ID"}
spec:
  terminationGracePeriodSeconds: 2
  securityContext: {runAsNonRoot: true, runAsUser: 65534, runAsGroup: 65534, seccompProfile: {type: RuntimeDefault}}
  containers:
    - name: forker
      image: $SHELL_IMAGE
      imagePullPolicy: IfNotPresent
      command: [/bin/sh, -c, "/bin/sleep 86400 & /bin/sleep 86400 & wait"]
      resources: {requests: {cpu: 5m, memory: 8Mi}, limits: {memory: 32Mi}}
      securityContext: {allowPrivilegeEscalation: false, capabilities: {drop: [ALL]}}
    - name: solo
      image: $SHELL_IMAGE
      imagePullPolicy: IfNotPresent
      command: [/bin/sleep, "86400"]
      resources: {requests: {cpu: 5m, memory: 8Mi}, limits: {memory: 32Mi}}
      securityContext: {allowPrivilegeEscalation: false, capabilities: {drop: [ALL]}}
EOF
  # The rollout story: sleep as PID 1 of its container ignores SIGTERM, so an evicted slow pod stays
  # terminating for its whole grace period (the budget's 90 s).
  kubectl apply -f - >/dev/null <<EOF
apiVersion: v1
kind: Pod
metadata:
  name: slow
  namespace: $NS_C
  labels: {app: slow, e2e.gpubudget.io/run: "$ID"}
spec:
  securityContext: {runAsNonRoot: true, runAsUser: 65534, runAsGroup: 65534, seccompProfile: {type: RuntimeDefault}}
  containers:
    - name: main
      image: $SHELL_IMAGE
      imagePullPolicy: IfNotPresent
      command: [/bin/sleep, "86400"]
      resources: {requests: {cpu: 5m, memory: 8Mi}, limits: {memory: 32Mi}}
      securityContext: {allowPrivilegeEscalation: false, capabilities: {drop: [ALL]}}
EOF
fi
for ns in "$NS_A" "$NS_B" ${HOST_PROC:+"$NS_C"}; do
  kubectl wait --for=condition=Ready pod --all -n "$ns" --timeout="${STEP_TIMEOUT}s" >/dev/null \
    || die "test pods in $ns did not become Ready (image $PAUSE_IMAGE pullable?)"
done
UID_EVICT=$(uid "$NS_A" llm-evict)
UID_TRAINER=$(uid "$NS_A" trainer)
UID_LLM_B=$(uid "$NS_B" llm-b)
UID_OTHER_B=$(uid "$NS_B" other-b)
info "pods ready: llm-evict=$UID_EVICT trainer=$UID_TRAINER llm-b=$UID_LLM_B other-b=$UID_OTHER_B"

# container_id NAMESPACE POD CONTAINER: the container's runtime id, without its scheme (containerd://).
container_id() {
  kubectl get pod "$2" -n "$1" -o jsonpath="{.status.containerStatuses[?(@.name==\"$3\")].containerID}" | sed 's|^[a-z-]*://||'
}
# host_pids NAMESPACE POD CONTAINER: the host PIDs in the container's cgroup, found as an operator on the node
# would: every $HOST_PROC/<pid>/cgroup naming the pod's UID (cgroupfs: pod<uid>, systemd: pod<uid with _>) and
# the container's id. Nothing (and status 1) when the pod or container is gone.
host_pids() {
  local pod_uid cid
  pod_uid=$(uid "$1" "$2" 2>/dev/null) && [ -n "$pod_uid" ] || return 1
  cid=$(container_id "$1" "$2" "$3") && [ -n "$cid" ] || return 1
  # A process that exits during the scan makes grep exit 2 (its file is gone): not an error here.
  { grep -l -E "pod(${pod_uid}|${pod_uid//-/_})[/.].*${cid}" "$HOST_PROC"/[0-9]*/cgroup 2>/dev/null || true; } \
    | sed -E 's|.*/([0-9]+)/cgroup$|\1|' | sort -n
}
# entries NAMESPACE POD CONTAINER BYTES: the sample's process entries for one container. With HOST_PROC, one
# entry per host PID of the container (so a container of three processes holds 3 x BYTES), attributed by the
# agent through /proc/<pid>/cgroup; without, one entry naming the pod by UID and the container by name.
entries() {
  local pod_uid pid
  if [ -n "$HOST_PROC" ]; then
    for pid in $(host_pids "$@"); do printf '{"pid": %s, "used_bytes": "%s"}\n' "$pid" "$4"; done
  else
    pod_uid=$(uid "$1" "$2" 2>/dev/null) && [ -n "$pod_uid" ] || return 0
    printf '{"pod_uid": "%s", "container": "%s", "used_bytes": "%s"}\n' "$pod_uid" "$3" "$4"
  fi
}
pid_count_is() { [ "$(host_pids "$1" "$2" "$3" | wc -l)" = "$4" ]; }
# in_cgroup PATTERN: some host process's cgroup names PATTERN (fixed string).
in_cgroup() { grep -qsF "$1" "$HOST_PROC"/[0-9]*/cgroup; }
SOLO_BYTES=2Gi
SLOW_BYTES=1Gi
ROLL_BYTES=1Gi
# write_sample PHASE EVICT TRAINER: the sample file the agents replay (every agent reads the same file and
# charges only the pods on its own node), as a ConfigMap; then nudge the agent pods so the kubelet refreshes
# the mounted file at once instead of at its next periodic sync.
write_sample() {
  local procs
  procs=$({
    entries "$NS_A" llm-evict main "$2"
    entries "$NS_A" trainer main "$3"
    entries "$NS_B" llm-b main 1Gi
    entries "$NS_B" other-b main 2Gi
    entries "$NS_A" roll main "$ROLL_BYTES"
    [ "$DRAIN" != 1 ] || entries "$NS_A" countdown main 9Gi
    if [ -n "$HOST_PROC" ]; then
      entries "$NS_C" multi forker 1Gi
      entries "$NS_C" multi solo "$SOLO_BYTES"
      entries "$NS_C" slow main "$SLOW_BYTES"
    fi
  } | paste -sd, -)
  cat > "$WORK/sample.json" <<EOF
{
  "version": 1,
  "host": "gpubudget-e2e-$ID phase $1",
  "gpus": [
    {"index": 0, "uuid": "GPU-e2e00000-0000-0000-0000-000000000000", "name": "replayed e2e GPU",
     "memory_total_bytes": "80Gi",
     "processes": [$procs]}
  ]
}
EOF
  kubectl create configmap "$SAMPLE_CM" -n "$NS" --from-file=sample.json="$WORK/sample.json" \
    --dry-run=client -o yaml | kubectl apply -f - >/dev/null
  kubectl annotate pods -n "$NS" -l app.kubernetes.io/component=agent "e2e.gpubudget.io/sample-phase=$1" \
    --overwrite >/dev/null 2>&1 || true
  info "sample phase $1: llm-evict $2, trainer $3, llm-b 1Gi, other-b 2Gi${HOST_PROC:+, multi: forker 1Gi per process, solo $SOLO_BYTES (by host PID: $(grep -o '"pid"' "$WORK/sample.json" | wc -l) processes)}"
}
if [ -n "$HOST_PROC" ]; then
  wait_for "multi/forker runs its shell and two forked children (3 host PIDs in its cgroup)" pid_count_is "$NS_C" multi forker 3
  for c in "$NS_A llm-evict main" "$NS_A trainer main" "$NS_B llm-b main" "$NS_B other-b main" "$NS_C multi forker" "$NS_C multi solo"; do
    # shellcheck disable=SC2086 # NAMESPACE POD CONTAINER
    info "host PIDs of ${c#* }: $(host_pids $c | paste -sd' ' -)"
  done
fi
write_sample 1 6Gi 20Gi

say "helm install (release $RELEASE in $NS)"
INSTALL_AT=$SECONDS
"$HELM" install "$RELEASE" "$CHART" -n "$NS" -f "$HERE/values.yaml" \
  --set "image.registry=$REGISTRY" --set-string "agent.image.tag=$TAG" --set-string "operator.image.tag=$TAG" \
  --wait --timeout "$((STEP_TIMEOUT + 120))s" >/dev/null || die "helm install did not become ready"
info "figure: helm install --wait to every agent and operator replica ready: $((SECONDS - INSTALL_AT)) s"
kubectl get pods -n "$NS" -o wide | sed 's/^/    /'
AGENT_POD=$(kubectl get pods -n "$NS" -l app.kubernetes.io/component=agent -o jsonpath='{.items[0].metadata.name}')
if [ -n "$HOST_PROC" ]; then
  # What runs is what was built: the binary, the user and the entrypoint (e2e/cluster/realk8s.sh names the
  # binaries; .ci/dockerfiles.sh keeps docker/*.Dockerfile, the chart and realk8s.sh in agreement).
  for comp in agent operator; do
    pod=$(kubectl get pods -n "$NS" -l "app.kubernetes.io/component=$comp" -o jsonpath='{.items[0].metadata.name}')
    pid=$(host_pids "$NS" "$pod" "$comp" | head -n1)
    [ -n "$pid" ] || die "no host PID found for the $comp container of $pod"
    exe=$(readlink "$HOST_PROC/$pid/exe")
    user=$(awk '/^Uid:/ {print $2}' "$HOST_PROC/$pid/status"):$(awk '/^Gid:/ {print $2}' "$HOST_PROC/$pid/status")
    want=$(sed -n 's/^USER //p' "$REPO/docker/$comp.Dockerfile")
    [ "$exe" = "/usr/local/bin/gpubudget-$comp" ] || die "$comp runs $exe, not /usr/local/bin/gpubudget-$comp (the Dockerfile's entrypoint)"
    [ "$user" = "$want" ] || die "$comp runs as $user, not $want (docker/$comp.Dockerfile USER)"
    bin_var=GPUBUDGET_E2E_$(echo "$comp" | tr a-z A-Z)_BINARY
    if [ -n "${!bin_var:-}" ]; then
      cmp -s "$HOST_PROC/$pid/exe" "${!bin_var}" || die "$comp runs a binary other than ${!bin_var}"
    fi
    info "$comp ($pod): host PID $pid runs $exe as $user${!bin_var:+, the same bytes as ${!bin_var}}"
  done
fi

say "budgets from examples/ (namespaces rewritten to the test namespaces)"
apply_example() { # FILE NAMESPACE
  sed -E "s/^([[:space:]]*namespace:[[:space:]]*).*/\1$2/" "$REPO/examples/$1" | kubectl apply -f - | sed 's/^/    /'
}
apply_example llm-inference.yaml "$NS_A"
apply_example training-warn.yaml "$NS_A"
apply_example namespace-wide.yaml "$NS_B"
apply_example llm-inference.yaml "$NS_B"
apply_budget() { # NAME NAMESPACE SPEC (flow-style YAML)
  printf 'apiVersion: gpubudget.io/v1alpha1\nkind: GpuMemoryBudget\nmetadata: {name: %s, namespace: %s}\nspec: %s\n' "$1" "$2" "$3" \
    | kubectl apply -f - | sed 's/^/    /'
}
apply_budget roll-evict "$NS_A" '{selector: {matchLabels: {app: roll}}, limit: 8Gi, action: Evict, overLimitSeconds: 10}'
if [ "$DRAIN" = 1 ]; then
  apply_budget countdown-evict "$NS_A" '{selector: {matchLabels: {app: countdown}}, limit: 8Gi, action: Evict, overLimitSeconds: 3600}'
fi
if [ -n "$HOST_PROC" ]; then
  apply_budget multi-audit "$NS_C" '{selector: {matchLabels: {app: multi}}, limit: 40Gi, action: Warn, overLimitSeconds: 30}'
  apply_budget slow-evict "$NS_C" '{selector: {matchLabels: {app: slow}}, limit: 8Gi, action: Evict, overLimitSeconds: 10, evictionGracePeriodSeconds: 90}'
fi

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
[ -z "$HOST_PROC" ] || EVICT_CGROUP="pod$UID_EVICT/$(container_id "$NS_A" llm-evict main)"
write_sample 3 9Gi 45Gi
CROSSED_AT=$SECONDS
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
if [ -n "$HOST_PROC" ]; then
  wait_for "llm-evict's container stopped (no host process left in its cgroup)" eval "! in_cgroup $EVICT_CGROUP"
  info "figure: sample over the limit written to llm-evict's container stopped: $((SECONDS - CROSSED_AT)) s (overLimitSeconds 10 s, the kubelet's ConfigMap refresh, the agent's sampling and the eviction included; polled every ${POLL} s)"
fi
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

if [ -n "$HOST_PROC" ]; then
  say "attribution through real cgroups: the sample names host PIDs, the agent finds pod and container in /proc/<pid>/cgroup"
  ADMIN_PORT=$(kubectl get pod "$AGENT_POD" -n "$NS" -o jsonpath='{.spec.containers[0].ports[0].containerPort}')
  # pod_metric POD CONTAINER: the agent's gpubudget_pod_gpu_memory_bytes for that container of NS_C (bytes).
  pod_metric() {
    kubectl get --raw "/api/v1/namespaces/$NS/pods/$AGENT_POD:$ADMIN_PORT/proxy/metrics" \
      | grep '^gpubudget_pod_gpu_memory_bytes{' | grep -F "namespace=\"$NS_C\"" | grep -F "pod=\"$1\"" \
      | grep -F "container=\"$2\"" | awk '{print $2}'
  }
  pod_metric_is() { [ "$(pod_metric "$1" "$2")" = "$3" ]; }
  wait_for "multi recorded 5Gi under multi-audit (forker's shell and two children 1Gi each, solo 2Gi)" \
    annotation_is "$NS_C" multi usage-bytes 5368709120
  annotation_is "$NS_C" multi budget multi-audit || die "multi's record names budget $(annotation "$NS_C" multi budget)"
  wait_for "agent metric: multi/forker 3Gi (three processes, one cgroup)" pod_metric_is multi forker 3221225472
  wait_for "agent metric: multi/solo 2Gi" pod_metric_is multi solo 2147483648
  OLD_SOLO=$(host_pids "$NS_C" multi solo)
  OLD_SOLO_ID=$(container_id "$NS_C" multi solo)
  kill -KILL "$OLD_SOLO"
  info "killed solo (host PID $OLD_SOLO): the kubelet restarts the container under a new id"
  solo_restarted() {
    [ "$(kubectl get pod multi -n "$NS_C" -o jsonpath='{.status.containerStatuses[?(@.name=="solo")].restartCount}')" -ge 1 ] \
      && [ -n "$(kubectl get pod multi -n "$NS_C" -o jsonpath='{.status.containerStatuses[?(@.name=="solo")].state.running}')" ]
  }
  wait_for "solo restarted (restartCount 1, running again)" solo_restarted
  wait_for "the restarted solo has a process in its new cgroup" pid_count_is "$NS_C" multi solo 1
  [ "$(container_id "$NS_C" multi solo)" != "$OLD_SOLO_ID" ] || die "solo kept its container id after the restart"
  SOLO_BYTES=4Gi
  write_sample 4 9Gi 45Gi
  wait_for "multi recorded 7Gi (the restarted solo's new PID charged 4Gi)" annotation_is "$NS_C" multi usage-bytes 7516192768
  wait_for "agent metric: multi/solo 4Gi (the new container, same name)" pod_metric_is multi solo 4294967296
  pod_metric_is multi forker 3221225472 || die "forker's usage changed: $(pod_metric multi forker)"
  info "multi: forker $(pod_metric multi forker), solo $(pod_metric multi solo) (new PID $(host_pids "$NS_C" multi solo), was $OLD_SOLO)"
fi

if [ "$(kubectl get validatingadmissionpolicy -o name 2>/dev/null | grep -c "$RELEASE-agent-node-restriction" || true)" -gt 0 ]; then
  say "node restriction: the agent's identity without its node-bound token can neither annotate nor evict"
  if kubectl auth can-i impersonate serviceaccounts >/dev/null 2>&1; then
    AS="system:serviceaccount:$NS:$AGENT_SA"
    # The write the agent makes: a server-side apply of gpubudget.io/* annotations (kubectl sends the PATCH
    # without reading the pod first; the agent may not get pods, so `kubectl annotate` would be refused by RBAC).
    if OUT=$(kubectl --as="$AS" apply --server-side --field-manager="gpubudget-agent/$NODE_EVICT" --force-conflicts -f - 2>&1 <<EOF
apiVersion: v1
kind: Pod
metadata:
  name: other-b
  namespace: $NS_B
  annotations: {gpubudget.io/state: Over}
EOF
    ); then
      die "the agent's identity without a node claim annotated other-b: $OUT"
    fi
    [[ "$OUT" == *"gpubudget agent"* ]] || die "annotation refused, but not by the node-restriction policy: $OUT"
    info "server-side apply of an annotation refused: ${OUT##*: }"
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

if [ -n "$HOST_PROC" ]; then
  say "agent rollout while an evicted pod is in its grace period: no second eviction, no lost record"
  # event_count NAMESPACE POD REASON: how many times the pod got that event (a repeated event counts as many).
  event_count() {
    kubectl get events -n "$1" --field-selector "involvedObject.kind=Pod,involvedObject.name=$2,reason=$3" \
      -o jsonpath='{range .items[*]}{.count}{"\n"}{end}' | awk '{n += ($1 == "" ? 1 : $1)} END {print n + 0}'
  }
  SLOW_BYTES=9Gi
  write_sample 5 9Gi 45Gi
  wait_for "EvictingForGpuMemory on slow (9Gi of 8Gi, slow-evict: Evict, grace 90 s)" has_event "$NS_C" slow EvictingForGpuMemory
  wait_for "slow terminating (sleep ignores SIGTERM: it stays for its 90 s grace)" pod_gone_or_terminating "$NS_C" slow
  REQUESTED=$(annotation "$NS_C" slow eviction-requested-at)
  STATE=$(annotation "$NS_C" slow state)
  info "slow's record: state $STATE, eviction-requested-at $REQUESTED"
  OLD_AGENT=$AGENT_POD
  "$HELM" upgrade "$RELEASE" "$CHART" -n "$NS" --reuse-values --set-string agent.podAnnotations.rollout=e2e \
    --wait --timeout "$((STEP_TIMEOUT))s" >/dev/null || die "helm upgrade did not become ready"
  AGENT_POD=$(kubectl get pods -n "$NS" -l app.kubernetes.io/component=agent -o jsonpath='{.items[0].metadata.name}')
  [ "$AGENT_POD" != "$OLD_AGENT" ] || die "helm upgrade did not replace the agent pod $OLD_AGENT"
  info "helm upgrade (a changed agent.podAnnotations value): agent $OLD_AGENT replaced by $AGENT_POD, ready"
  [ -n "$(kubectl get pod slow -n "$NS_C" -o jsonpath='{.metadata.deletionTimestamp}' 2>/dev/null)" ] \
    || die "slow finished its grace period before the new agent was ready: the story did not test a rollout within it"
  sleep 15 # the new agent samples slow (still over) several times
  [ "$(event_count "$NS_C" slow EvictingForGpuMemory)" = 1 ] || die "slow got $(event_count "$NS_C" slow EvictingForGpuMemory) EvictingForGpuMemory events"
  annotation_is "$NS_C" slow eviction-requested-at "$REQUESTED" || die "slow's eviction-requested-at changed: $(annotation "$NS_C" slow eviction-requested-at), was $REQUESTED"
  annotation_is "$NS_C" slow state "$STATE" || die "slow's state changed: $(annotation "$NS_C" slow state), was $STATE"
  status_is "$NS_C" slow-evict evictions 1 || die "slow-evict counts $(status_field "$NS_C" slow-evict evictions) evictions"
  info "after the rollout: one EvictingForGpuMemory, the record kept (state $STATE, eviction-requested-at $REQUESTED), slow-evict EVICTED 1"
fi

if [ -n "$HOST_PROC" ]; then
  say "memory of the agent and operator pods (their cgroups, cgroup v1 memory controller) against the chart's requests and limits"
  for comp in agent operator; do
    for pod in $(kubectl get pods -n "$NS" -l "app.kubernetes.io/component=$comp" -o jsonpath='{.items[*].metadata.name}'); do
      pid=$(host_pids "$NS" "$pod" "$comp" | head -n1)
      cg=/sys/fs/cgroup/memory$(awk -F: '$2 ~ /(^|,)memory(,|$)/ {print $3}' "$HOST_PROC/$pid/cgroup")
      [ -r "$cg/memory.stat" ] || { info "no cgroup v1 memory controller for $pod ($cg): not measured"; continue; }
      rss=$(awk '$1 == "total_rss" {print $2}' "$cg/memory.stat")
      peak=$(cat "$cg/memory.max_usage_in_bytes")
      usage=$(cat "$cg/memory.usage_in_bytes")
      vmrss=$(awk '/^VmRSS:/ {print $2}' "$HOST_PROC/$pid/status")
      res=$(kubectl get pod "$pod" -n "$NS" -o jsonpath="{.spec.containers[?(@.name==\"$comp\")].resources.requests.memory}/{.spec.containers[?(@.name==\"$comp\")].resources.limits.memory}")
      info "figure: $comp $pod: cgroup rss $((rss / 1048576)) MiB, usage (with page cache) $((usage / 1048576)) MiB, peak $((peak / 1048576)) MiB, process VmRSS $((vmrss / 1024)) MiB; request/limit $res"
    done
  done
fi

# --- The agent's evictions, probed: dry-run evictions through the API server as the agent's service account ---
# The chart sends the agent's evictions (and only those: matchConditions on its username) to the operator's
# webhook, failurePolicy Fail, behind a Service of the operator pods. A probe POSTs a policy/v1 Eviction with
# dryRun=All (admission runs, webhooks included, since the webhook declares sideEffects None; nothing is evicted)
# twice: with a token of the agent's service account bound to the pod's node (the webhook must allow: 201) and
# with one bound to nothing (the webhook must deny, saying why: 403). Anything else (500 "failed calling webhook"
# because no replica answered, a timeout) is a failure: the agent's eviction would have been refused.
API_SERVER=$(kubectl config view --raw --minify -o jsonpath='{.clusters[0].cluster.server}')
CURL_TLS=(--insecure)
if [ "$(kubectl config view --raw --minify -o jsonpath='{.clusters[0].cluster.insecure-skip-tls-verify}')" != true ]; then
  CA_FILE=$(kubectl config view --raw --minify -o jsonpath='{.clusters[0].cluster.certificate-authority}')
  if [ -z "$CA_FILE" ]; then
    CA_FILE=$WORK/api-ca.crt
    kubectl config view --raw --minify -o jsonpath='{.clusters[0].cluster.certificate-authority-data}' | base64 -d > "$CA_FILE"
  fi
  CURL_TLS=(--cacert "$CA_FILE")
fi
# probe_eviction TOKEN NAMESPACE POD: one dry-run eviction; prints "<http code> <seconds> <message>".
probe_eviction() {
  local out body=$WORK/probe.$BASHPID
  out=$(curl -sS "${CURL_TLS[@]}" --max-time 15 -o "$body" -w '%{http_code} %{time_total}' -X POST \
    -H "Authorization: Bearer $1" -H 'Content-Type: application/json' \
    --data "{\"apiVersion\":\"policy/v1\",\"kind\":\"Eviction\",\"metadata\":{\"name\":\"$3\",\"namespace\":\"$2\"}}" \
    "$API_SERVER/api/v1/namespaces/$2/pods/$3/eviction?dryRun=All" 2>/dev/null) || true
  printf '%s %s\n' "${out:-000 0}" "$(jq -r '.message // empty' "$body" 2>/dev/null | tr '\n' ' ' | cut -c1-300)"
}
# agent_tokens NODE: BOUND_TOKEN (the agent's service account, bound to NODE, as the kubelet's projected token
# names it) and UNBOUND_TOKEN (the same account, bound to nothing).
agent_tokens() {
  BOUND_TOKEN=$(kubectl create token "$AGENT_SA" -n "$NS" --bound-object-kind Node --bound-object-name "$1" --duration 1h)
  UNBOUND_TOKEN=$(kubectl create token "$AGENT_SA" -n "$NS" --duration 1h)
}
# probe_classify WHO LINE: "allowed|denied|FAILED(WHO) LINE" for a line of probe_eviction.
probe_classify() {
  case "$1:$2" in
    bound:201\ *) echo "allowed $2" ;;
    unbound:403\ *"denied the request"*"may evict only pods of its own node"*) echo "denied $2" ;;
    *) echo "FAILED($1) $2" ;;
  esac
}
# start_probes LOG NAMESPACE POD: in the background until stop_probes, a bound and an unbound probe of the pod
# after another (pause 0.1 s), one classified line each in LOG.
start_probes() {
  rm -f "$WORK/stop-probes"
  : > "$1"
  (
    while [ ! -e "$WORK/stop-probes" ]; do
      probe_classify bound "$(probe_eviction "$BOUND_TOKEN" "$2" "$3")" >> "$1"
      probe_classify unbound "$(probe_eviction "$UNBOUND_TOKEN" "$2" "$3")" >> "$1"
      sleep 0.1
    done
  ) &
  PROBE_PID=$!
}
stop_probes() { touch "$WORK/stop-probes"; wait "$PROBE_PID" || true; PROBE_PID=""; }
# probe_summary LOG: "N requests (A allowed, D denied by the webhook), F failed; latency p50 X ms, p99 Y ms, max Z ms".
probe_summary() {
  awk '{n++; if ($1 ~ /^FAILED/) f++; else if ($1 == "allowed") a++; else d++; print $3}
       END {printf "%d %d %d %d\n", n, a, d, f > "/dev/stderr"}' "$1" 2>"$WORK/probe-counts" | sort -n > "$WORK/probe-latency"
  read -r n a d f < "$WORK/probe-counts"
  pct() { awk -v q="$1" '{v[NR] = $1} END {i = int(NR * q); if (i < NR * q) i++; if (i < 1) i = 1; printf "%d", v[i] * 1000}' "$WORK/probe-latency"; }
  echo "$n requests ($a allowed, $d denied by the webhook), $f failed; latency p50 $(pct 0.5) ms, p99 $(pct 0.99) ms, max $(pct 1) ms"
  PROBE_TOTAL=$n PROBE_FAILED=$f
}
# probe_check LOG WHAT: the summary; every failure printed and fatal.
probe_check() {
  probe_summary "$1" > "$WORK/probe-summary"
  info "figure: the agent's evictions checked $2: $(cat "$WORK/probe-summary")"
  [ "$PROBE_TOTAL" -gt 0 ] || die "no eviction probe ran $2"
  if [ "$PROBE_FAILED" != 0 ]; then
    grep '^FAILED' "$1" | head -n 10 | sed 's/^/    /'
    die "$PROBE_FAILED of $PROBE_TOTAL of the agent's evictions were not answered by the eviction check $2"
  fi
}
operator_pods() { kubectl get pods -n "$NS" -l app.kubernetes.io/component=operator -o jsonpath='{range .items[*]}{.metadata.name}{"\n"}{end}'; }
lease_holder() { kubectl get lease "$LEASE" -n "$NS" -o jsonpath='{.spec.holderIdentity}'; }
AGENT_ADMIN_PORT=$(kubectl get pod "$AGENT_POD" -n "$NS" -o jsonpath='{.spec.containers[0].ports[0].containerPort}')
# agent_on NODE: the agent pod of that node.
agent_on() {
  kubectl get pods -n "$NS" -l app.kubernetes.io/component=agent --field-selector "spec.nodeName=$1" -o jsonpath='{.items[0].metadata.name}'
}
# agent_metrics NODE: the /metrics of that node's agent.
agent_metrics() { kubectl get --raw "/api/v1/namespaces/$NS/pods/$(agent_on "$1"):$AGENT_ADMIN_PORT/proxy/metrics"; }
# agent_evictions NODE: that agent's eviction requests by result ("accepted=N blocked=N ..."), from
# gpubudget_evictions_total.
agent_evictions() {
  agent_metrics "$1" | sed -n 's/^gpubudget_evictions_total{result="\([a-z]*\)"} \([0-9]*\).*/\1=\2/p' | sort | paste -sd' ' -
}

say "operator rollout: two replicas, helm upgrade with a changed operator value, while the agent's evictions are checked"
LEASE=$("$HELM" get values "$RELEASE" -n "$NS" -a -o json | jq -r '.operator.leaderElection.leaseName')
OLD_OPERATORS=$(operator_pods)
[ "$(echo "$OLD_OPERATORS" | wc -l)" = 2 ] || die "expected the chart's 2 operator replicas, found: $OLD_OPERATORS"
wait_for "an operator replica holds the Lease $LEASE" bash -c "kubectl get lease $LEASE -n $NS -o jsonpath='{.spec.holderIdentity}' | grep -qxF '$OLD_OPERATORS'"
OLD_HOLDER=$(lease_holder)
ROLL_NODE=$(kubectl get pod roll -n "$NS_A" -o jsonpath='{.spec.nodeName}')
TRAINER_NODE=$(kubectl get pod trainer -n "$NS_A" -o jsonpath='{.spec.nodeName}')
info "operator replicas: $(echo "$OLD_OPERATORS" | paste -sd' ' -), leader $OLD_HOLDER; webhook failurePolicy $(kubectl get validatingwebhookconfiguration "$RELEASE-agent-eviction" -o jsonpath='{.webhooks[0].failurePolicy}'), strategy $(kubectl get deploy "$RELEASE-operator" -n "$NS" -o jsonpath='{.spec.strategy.rollingUpdate}')"
agent_tokens "$TRAINER_NODE"
EVICTIONS_BEFORE=$(agent_evictions "$ROLL_NODE")
# roll goes over roll-evict (8Gi, Evict after 10 s) just before the rollout: the agent evicts it during it.
ROLL_BYTES=9Gi
write_sample 6 9Gi 45Gi
wait_for "GpuMemoryOverBudget on roll (9Gi of 8Gi, evicted 10 s later)" has_event "$NS_A" roll GpuMemoryOverBudget
start_probes "$WORK/probes-rollout" "$NS_A" trainer
sleep 4 # the upgrade takes about 5 s here: roll's eviction falls within it
ROLLOUT_AT=$SECONDS
ROLLOUT_WALL=$(date -u +%TZ)
"$HELM" upgrade "$RELEASE" "$CHART" -n "$NS" --reuse-values --set-string operator.podAnnotations.rollout=e2e \
  --wait --timeout "$((STEP_TIMEOUT))s" >/dev/null || die "helm upgrade (operator) did not become ready"
old_operators_gone() { ! operator_pods | grep -qxF "$OLD_OPERATORS"; }
wait_for "both old operator pods gone" old_operators_gone
ROLLOUT_S=$((SECONDS - ROLLOUT_AT))
GONE_WALL=$(date -u +%TZ)
sleep 5 # and a few more probes against the new replicas alone
stop_probes
NEW_OPERATORS=$(operator_pods)
info "helm upgrade (a changed operator.podAnnotations value): $(echo "$OLD_OPERATORS" | paste -sd' ' -) replaced by $(echo "$NEW_OPERATORS" | paste -sd' ' -) in ${ROLLOUT_S} s (upgrade to the old pods gone)"
probe_check "$WORK/probes-rollout" "during the operator rollout (one bound and one unbound dry-run eviction of trainer, back to back, from 4 s before the upgrade to 5 s after the old pods were gone)"
wait_for "roll evicted by the agent (terminating or gone)" pod_gone_or_terminating "$NS_A" roll
ROLL_EVENT=$(kubectl get events -n "$NS_A" --field-selector involvedObject.name=roll,reason=EvictingForGpuMemory -o json \
  | jq -r '.items[0] | (.eventTime // .firstTimestamp) | sub("^[^T]*T"; "") | sub("\\.[0-9]*"; "")')
info "roll: EvictingForGpuMemory at $ROLL_EVENT (helm upgrade started at $ROLLOUT_WALL, the old operator pods were gone at $GONE_WALL)"
wait_for "the Lease moved to a new replica" bash -c "kubectl get lease $LEASE -n $NS -o jsonpath='{.spec.holderIdentity}' | grep -qxF '$NEW_OPERATORS'"
info "leader: $OLD_HOLDER -> $(lease_holder)"
wait_for "roll-evict status: EVICTED 1, written by the new leader" status_is "$NS_A" roll-evict evictions 1
status_is "$NS_A" roll-evict lastEviction.pod roll || die "roll-evict's lastEviction names $(status_field "$NS_A" roll-evict lastEviction.pod)"
sleep 5
status_is "$NS_A" roll-evict evictions 1 || die "roll-evict counts $(status_field "$NS_A" roll-evict evictions) evictions of one pod"
has_event "$NS_A" roll GpuMemoryEvictionBlocked && die "the agent's eviction of roll was refused: $(event_messages "$NS_A" roll GpuMemoryEvictionBlocked)"
EVICTIONS_AFTER=$(agent_evictions "$ROLL_NODE")
info "agent's eviction requests by result: before [$EVICTIONS_BEFORE], after [$EVICTIONS_AFTER]"
before_accepted=$(echo "$EVICTIONS_BEFORE" | sed -n 's/.*accepted=\([0-9]*\).*/\1/p')
after_accepted=$(echo "$EVICTIONS_AFTER" | sed -n 's/.*accepted=\([0-9]*\).*/\1/p')
[ "$((after_accepted - ${before_accepted:-0}))" = 1 ] || die "the agent's accepted evictions went from ${before_accepted:-0} to $after_accepted (expected one more: roll)"
[ "$(echo "$EVICTIONS_BEFORE" | sed 's/accepted=[0-9]*//')" = "$(echo "$EVICTIONS_AFTER" | sed 's/accepted=[0-9]*//')" ] \
  || die "the agent's refused or failed evictions changed during the rollout: [$EVICTIONS_BEFORE] -> [$EVICTIONS_AFTER]"
info "roll evicted once, accepted at the first request, counted once (roll-evict EVICTED 1, lastEviction roll)"

say "caps at admission: a GPU pod created under a budget with admissionCaps: Enabled runs with the driver's caps in its environment"
# allocatable_gpus NODE: "<nvidia.com/gpu>/<nvidia.com/gpu.shared>" the node advertises as allocatable.
allocatable_gpus() {
  kubectl get node "$1" -o json | jq -r '.status.allocatable | "\(.["nvidia.com/gpu"] // 0)/\(.["nvidia.com/gpu.shared"] // 0)"'
}
CAPS_NODE=$(kubectl get nodes -o json | jq -r '[.items[] | select((.status.allocatable["nvidia.com/gpu"] // "0") != "0"
  and (.status.allocatable["nvidia.com/gpu.shared"] // "0") != "0") | .metadata.name] | first // empty')
if [ -z "$CAPS_NODE" ] && [ "$ADVERTISE_GPU" = 1 ] && [ -n "$SHELL_IMAGE" ]; then
  # A test node without GPUs: advertise one of each through the node's status, as Kubernetes documents for an
  # extended resource ("Advertise Extended Resources for a Node"). Nothing allocates a device for a resource no
  # device plugin registered: the kubelet admits the pod against the node's allocatable and runs it as it is.
  CAPS_NODE=$(kubectl get pod "$AGENT_POD" -n "$NS" -o jsonpath='{.spec.nodeName}')
  ADVERTISED=$CAPS_NODE
  ops=""
  for r in $GPU_RESOURCES; do
    ops+="{\"op\":\"add\",\"path\":\"/status/capacity/$r\",\"value\":\"1\"},{\"op\":\"add\",\"path\":\"/status/allocatable/$r\",\"value\":\"1\"},"
  done
  kubectl patch node "$CAPS_NODE" --subresource=status --type=json -p "[${ops%,}]" >/dev/null
  advertises() { [ "$(allocatable_gpus "$CAPS_NODE")" = 1/1 ]; }
  wait_for "$CAPS_NODE advertises nvidia.com/gpu 1 and nvidia.com/gpu.shared 1 (allocatable)" advertises
fi
if [ -z "$SHELL_IMAGE" ]; then
  info "skipped: the story needs GPUBUDGET_E2E_SHELL_IMAGE (an image with /bin/sh and /bin/sleep)"
elif [ -z "$CAPS_NODE" ]; then
  info "skipped: no node advertises nvidia.com/gpu and nvidia.com/gpu.shared (GPUBUDGET_E2E_ADVERTISE_GPU=1 patches a test node's status to)"
else
  kubectl create namespace "$NS_D" >/dev/null
  apply_budget capped "$NS_D" '{selector: {matchLabels: {app: capped}}, limit: 6Gi, request: 4Gi, admissionCaps: Enabled}'
  caps_labelled() { [ "$(kubectl get namespace "$NS_D" -o jsonpath='{.metadata.labels.gpubudget\.io/admission-caps}')" = enabled ]; }
  wait_for "the leader labels $NS_D gpubudget.io/admission-caps=enabled (the webhook's namespaceSelector)" caps_labelled
  # Two GPU containers, as a user writes them: main asks for a whole GPU and sets nothing; side asks for a
  # shared one and sets its own, smaller MPS cap (kept: the webhook never raises a user's value).
  kubectl apply -f - >/dev/null <<EOF
apiVersion: v1
kind: Pod
metadata:
  name: capped
  namespace: $NS_D
  labels: {app: capped, e2e.gpubudget.io/run: "$ID"}
spec:
  terminationGracePeriodSeconds: 1
  securityContext: {runAsNonRoot: true, runAsUser: 65534, runAsGroup: 65534, seccompProfile: {type: RuntimeDefault}}
  containers:
    - name: main
      image: $SHELL_IMAGE
      imagePullPolicy: IfNotPresent
      command: [/bin/sleep, "86400"]
      resources: {requests: {cpu: 5m, memory: 8Mi}, limits: {memory: 32Mi, nvidia.com/gpu: 1}}
      securityContext: {allowPrivilegeEscalation: false, capabilities: {drop: [ALL]}}
    - name: side
      image: $SHELL_IMAGE
      imagePullPolicy: IfNotPresent
      command: [/bin/sleep, "86400"]
      env: [{name: CUDA_MPS_PINNED_DEVICE_MEM_LIMIT, value: "0=2048M"}]
      resources: {requests: {cpu: 5m, memory: 8Mi}, limits: {memory: 32Mi, nvidia.com/gpu.shared: 1}}
      securityContext: {allowPrivilegeEscalation: false, capabilities: {drop: [ALL]}}
EOF
  kubectl wait --for=condition=Ready pod/capped -n "$NS_D" --timeout="${STEP_TIMEOUT}s" >/dev/null \
    || die "pod capped (asking for nvidia.com/gpu and nvidia.com/gpu.shared) did not become Ready on $CAPS_NODE"
  info "capped runs on $(kubectl get pod capped -n "$NS_D" -o jsonpath='{.spec.nodeName}') (node allocatable nvidia.com/gpu / gpu.shared: $(allocatable_gpus "$CAPS_NODE"))"
  # caps_env CONTAINER: the gpubudget variables in the running container's environment, sorted, as its processes
  # see it (kubectl exec, through the kubelet and the runtime; not the pod spec).
  caps_env() {
    kubectl exec capped -n "$NS_D" -c "$1" -- /bin/sh -c 'export -p' \
      | sed -nE "s/^export (CUDA_MPS_PINNED_DEVICE_MEM_LIMIT|NVIDIA_GPU_MEMORY_LIMIT|NVIDIA_GPU_MEMORY_REQUEST)='?([^']*)'?$/\1=\2/p" | sort
  }
  for c in main side; do caps_env "$c" | sed "s/^/    kubectl exec capped -c $c: /"; done
  [ "$(caps_env main)" = "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=6144M
NVIDIA_GPU_MEMORY_LIMIT=6144
NVIDIA_GPU_MEMORY_REQUEST=4096" ] || die "capped/main's environment does not carry the budget's caps (6Gi, request 4Gi)"
  [ "$(caps_env side)" = "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=2048M
NVIDIA_GPU_MEMORY_LIMIT=6144
NVIDIA_GPU_MEMORY_REQUEST=4096" ] || die "capped/side's environment: the user's smaller MPS cap not kept, or a cap missing"
  CAPS_RECORD=$(annotation "$NS_D" capped caps)
  info "gpubudget.io/caps: $CAPS_RECORD"
  echo "$CAPS_RECORD" | jq -e '.budget == "capped" and .limitMib == 6144 and .requestMib == 4096
    and ([.containers[] | "\(.name):\(.devices):\(.env.CUDA_MPS_PINNED_DEVICE_MEM_LIMIT)"] | sort) == ["main:1:set", "side:1:kept"]' >/dev/null \
    || die "unexpected gpubudget.io/caps record on capped: $CAPS_RECORD"
  capped_counts() { [ "$(kubectl get gmb capped -n "$NS_D" -o jsonpath='{.status.matchedPods}/{.status.podsCapped}/{.status.podsUncapped}')" = 1/1/0 ]; }
  wait_for "capped status: MATCHED 1, CAPPED 1 (read from the containers' environment), UNCAPPED 0" capped_counts
  kubectl get gmb capped -n "$NS_D" -o wide | sed 's/^/    /'
  kubectl delete pod capped -n "$NS_D" --wait=false >/dev/null
  wait_for "capped deleted (the drain story counts every test pod)" pod_gone "$NS_D" capped
  if [ -n "$ADVERTISED" ]; then
    unadvertise_gpu "$ADVERTISED"
    no_gpu_left() { [ "$(kubectl get node "$ADVERTISED" -o json | jq '[.status.capacity, .status.allocatable | keys[] | select(startswith("nvidia.com/"))] | length')" = 0 ]; }
    wait_for "$ADVERTISED no longer advertises nvidia.com/gpu or nvidia.com/gpu.shared" no_gpu_left
    ADVERTISED=""
  fi
  CAPS_PASSED=1
fi

NODES=$(kubectl get nodes -o name | wc -l)
if [ "$DRAIN" = 1 ] && [ "$NODES" != 1 ]; then
  say "node drain: skipped: the story needs a one-node cluster (every test pod and both operator replicas on the drained node); this one has $NODES"
elif [ "$DRAIN" = 1 ]; then
  DRAIN_NODE=$(kubectl get pod "$AGENT_POD" -n "$NS" -o jsonpath='{.spec.nodeName}')
  say "node drain: kubectl drain $DRAIN_NODE (the agent's node); gpubudget's webhook never sees it, the agent stays, nothing it evicts counts as a budget's eviction"
  wait_for "countdown Over under countdown-evict (9Gi of 8Gi; Evict, but only after 3600 s)" annotation_is "$NS_A" countdown state Over
  # budget_counts: "ns/name=EVICTED/MATCHED/OVER ..." for every budget of this run.
  budget_counts() {
    kubectl get gmb -A -o json | jq -r --arg p "gpubudget-e2e-$ID-" '[.items[] | select(.metadata.namespace | startswith($p))
      | "\(.metadata.namespace | ltrimstr($p))/\(.metadata.name)=\(.status.evictions // 0)/\(.status.matchedPods // 0)/\(.status.podsOverBudget // 0)"] | sort | join(" ")'
  }
  evictions_only() { echo "$1" | tr ' ' '\n' | cut -d/ -f1-2 | paste -sd' ' -; }
  [ -z "$HOST_PROC" ] || wait_for "slow gone (evicted in the agent rollout story, 90 s grace)" pod_gone "$NS_C" slow
  COUNTS_BEFORE=$(budget_counts)
  AGENT_BEFORE=$(agent_on "$DRAIN_NODE")
  AGENT_EVICTIONS_BEFORE=$(agent_evictions "$DRAIN_NODE")
  info "budgets (EVICTED/MATCHED/OVER) before: $COUNTS_BEFORE"
  agent_tokens "$DRAIN_NODE"
  start_probes "$WORK/probes-drain" "$NS" "$AGENT_BEFORE"
  sleep 1
  DRAIN_AT=$SECONDS
  DRAINED=$DRAIN_NODE
  kubectl drain "$DRAIN_NODE" --ignore-daemonsets --force --timeout=25s > "$WORK/drain.log" 2>&1 &
  DRAIN_PID=$!
  test_pods_gone() { [ -z "$(kubectl get pods -n "$NS_A" -o name; kubectl get pods -n "$NS_B" -o name; [ -z "$HOST_PROC" ] || kubectl get pods -n "$NS_C" -o name)" ]; }
  wait_for "every test pod evicted by the drain and gone" test_pods_gone
  info "figure: kubectl drain to every test pod gone: $((SECONDS - DRAIN_AT)) s"
  DRAIN_RC=0
  wait "$DRAIN_PID" || DRAIN_RC=$?
  info "kubectl drain exited $DRAIN_RC after $((SECONDS - DRAIN_AT)) s: $(grep -c 'evicted$' "$WORK/drain.log") pods evicted"
  stop_probes
  running_operators() { kubectl get pods -n "$NS" -l app.kubernetes.io/component=operator --field-selector status.phase=Running -o name | wc -l; }
  # One node: the replacement of the first operator replica evicted cannot be scheduled (cordoned), so the
  # PodDisruptionBudget (maxUnavailable 1) refuses the last one's eviction: the eviction check stays up.
  [ "$DRAIN_RC" != 0 ] || die "kubectl drain of the only node completed: the operator's PodDisruptionBudget should have kept one replica"
  grep -q "disruption budget" "$WORK/drain.log" || { sed 's/^/    /' "$WORK/drain.log"; die "kubectl drain failed, but not on the operator's PodDisruptionBudget"; }
  [ "$(running_operators)" = 1 ] || die "expected one operator replica left running by its PodDisruptionBudget, found $(running_operators)"
  info "the drain waited on the last operator replica (its PodDisruptionBudget): $(grep -m1 'disruption budget' "$WORK/drain.log" | cut -c1-160)"
  [ "$(agent_on "$DRAIN_NODE")" = "$AGENT_BEFORE" ] || die "the agent pod $AGENT_BEFORE of $DRAIN_NODE was replaced by the drain"
  [ -z "$(kubectl get pod "$AGENT_BEFORE" -n "$NS" -o jsonpath='{.metadata.deletionTimestamp}')" ] || die "the drain evicted the agent"
  info "the agent ($AGENT_BEFORE, a DaemonSet pod: --ignore-daemonsets) stays on the cordoned node"
  probe_check "$WORK/probes-drain" "during the drain (dry-run evictions of the agent's own pod)"
  # Nothing of the drain counts: the operator (whichever replica leads) drops the pods from MATCHED and OVER,
  # counts no eviction; the agent forgets them (no metric series left) and requested no eviction.
  all_unmatched() { [ "$(budget_counts | tr ' ' '\n' | cut -d/ -f3- | sort -u)" = "0/0" ]; }
  wait_for "every budget: MATCHED 0, OVER 0 (the drained pods are gone)" all_unmatched
  COUNTS_AFTER=$(budget_counts)
  [ "$(evictions_only "$COUNTS_AFTER")" = "$(evictions_only "$COUNTS_BEFORE")" ] \
    || die "the drain changed the budgets' eviction counts: $COUNTS_BEFORE -> $COUNTS_AFTER"
  info "budgets after: $COUNTS_AFTER (evictions as before)"
  no_pod_series() { ! agent_metrics "$DRAIN_NODE" | grep -E '^gpubudget_pod_' | grep -qF "namespace=\"gpubudget-e2e-$ID-"; }
  wait_for "the agent's metrics hold no series of the drained pods" no_pod_series
  [ "$(agent_evictions "$DRAIN_NODE")" = "$AGENT_EVICTIONS_BEFORE" ] \
    || die "the agent requested evictions during the drain: [$AGENT_EVICTIONS_BEFORE] -> [$(agent_evictions "$DRAIN_NODE")]"
  has_event "$NS_A" countdown EvictingForGpuMemory && die "countdown (due in 3600 s) got an EvictingForGpuMemory event"
  info "countdown (over its Evict budget when drained) is not counted; the agent's eviction requests unchanged [$AGENT_EVICTIONS_BEFORE]"
  say "node drain, finished without the PodDisruptionBudget (--disable-eviction): no operator runs"
  kubectl drain "$DRAIN_NODE" --ignore-daemonsets --force --disable-eviction --timeout=60s > "$WORK/drain2.log" 2>&1 \
    || { sed 's/^/    /' "$WORK/drain2.log"; die "kubectl drain --disable-eviction failed"; }
  wait_for "no operator replica running" bash -c "[ \"\$(kubectl get pods -n $NS -l app.kubernetes.io/component=operator --field-selector status.phase=Running -o name)\" = '' ]"
  LINE=$(probe_eviction "$BOUND_TOKEN" "$NS" "$AGENT_BEFORE")
  [[ "$LINE" == 500\ *"failed calling webhook"* ]] || die "with no operator, the agent's eviction was not refused as failurePolicy Fail says: $LINE"
  info "the agent's eviction, no operator running: refused (failurePolicy Fail): ${LINE#* * }"
  printf '{"apiVersion":"policy/v1","kind":"Eviction","metadata":{"name":"%s","namespace":"%s"}}' "$AGENT_BEFORE" "$NS" > "$WORK/eviction.json"
  kubectl create --raw "/api/v1/namespaces/$NS/pods/$AGENT_BEFORE/eviction?dryRun=All" -f "$WORK/eviction.json" >/dev/null \
    || die "with no operator, an administrator's eviction was refused"
  info "an administrator's eviction (dry run) goes through: only the agent's evictions are sent to the webhook"
  UNCORDON_AT=$SECONDS
  kubectl uncordon "$DRAIN_NODE" >/dev/null
  DRAINED=""
  wait_for "the operator Deployment available again (2 replicas ready)" \
    bash -c "[ \"\$(kubectl get deploy $RELEASE-operator -n $NS -o jsonpath='{.status.readyReplicas}')\" = 2 ]"
  answered() { [[ "$(probe_eviction "$BOUND_TOKEN" "$NS" "$AGENT_BEFORE")" == 201\ * ]]; }
  wait_for "the agent's eviction allowed again" answered
  info "figure: uncordon to the eviction check answering again with both replicas ready: $((SECONDS - UNCORDON_AT)) s"
  DRAIN_PASSED=1
fi

say "helm uninstall: nothing of the chart is left that could refuse a request"
make_pod "$NS_B" last tier=batch # a pod that outlived every story (the drain story evicts the others)
kubectl wait --for=condition=Ready pod/last -n "$NS_B" --timeout="${STEP_TIMEOUT}s" >/dev/null || die "pod last did not become Ready"
"$HELM" uninstall "$RELEASE" -n "$NS" --wait --timeout 2m >/dev/null || die "helm uninstall failed"
LEFT=$(kubectl get validatingwebhookconfigurations,mutatingwebhookconfigurations,validatingadmissionpolicies,validatingadmissionpolicybindings -o name 2>/dev/null | grep -F "$RELEASE" || true)
[ -z "$LEFT" ] || die "left after helm uninstall: $LEFT"
wait_for "no pod of the release left in $NS" bash -c "[ -z \"\$(kubectl get pods -n $NS -o name)\" ]"
kubectl annotate pod last -n "$NS_B" gpubudget.io/state=Over --overwrite >/dev/null \
  || die "a gpubudget.io annotation was refused after helm uninstall"
printf '{"apiVersion":"policy/v1","kind":"Eviction","metadata":{"name":"last","namespace":"%s"}}' "$NS_B" > "$WORK/eviction.json"
kubectl create --raw "/api/v1/namespaces/$NS_B/pods/last/eviction" -f "$WORK/eviction.json" >/dev/null \
  || die "an eviction was refused after helm uninstall"
info "no webhook or admission policy of $RELEASE left; an eviction and a gpubudget.io annotation go through"

FAILED=0
say "PASS: Evict, Warn, overlapping budgets$( [ -n "${AS:-}" ] && echo ", node restriction")${HOST_PROC:+, attribution through real cgroups, agent rollout}, operator rollout${CAPS_PASSED:+, caps at admission}${DRAIN_PASSED:+, node drain}, helm uninstall ($((SECONDS - START)) s)"
