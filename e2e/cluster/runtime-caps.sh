#!/usr/bin/env bash
# Caps set where the container is made (#45), on the real node tier: containerd 2.3.4 with NRI
# (/work/shared/realk8s/README.md, "Opt-in: containerd 2"), the chart's agent.runtimeCaps (#53: the relay DaemonSet
# alone holds the NRI socket, root without capabilities, no host PIDs, no token; the agent, non-root with host PIDs,
# decides over the relay's socket), replaying a sample file of two 80Gi GPUs (no GPU here: a "GPU container" is
# one whose final environment lists devices in NVIDIA_VISIBLE_DEVICES). The operator does not run and no caps webhook
# is registered: pods get nothing at admission. One namespace, budget {selector: {}, limit: 8Gi, admissionCaps:
# Enabled}. Checked in each container's process environment read on the host (/proc/<pid>/environ):
#   0. baseline: CRI CreateContainer time (containerd's log) of BENCH_PODS x BENCH_CONTAINERS GPU containers, no plugin;
#   1. setup: helm install, the operator scaled to 0, no mutating webhook of the release, the relay registered, the
#      agent connected; who holds which privilege, read from each process on the host;
#   2. cases: (a) NVIDIA_VISIBLE_DEVICES=0; (b) KAI-shaped (devices from a configMapKeyRef, envFrom); (c) a static pod;
#      (d) a hostile CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=80G,1=1G; (e) two GPU containers (=0 and =0,1); (f) no GPU:
#      the canonical values and GpuMemoryCappedAtCreation, (f) left alone;
#   3. benchmark: the same containers with the agent's plugin; its gpubudget_runtime_caps_seconds; the agent's RSS;
#   4. the agent SIGKILLed while pods are created: how many come up uncapped, what the agent says of them, time to
#      reconnect, a pod after it capped; 4b. the relay SIGKILLed likewise; 4c. the agent hung (SIGSTOP);
#   5. --runtime-caps-unresolved: a static pod the agent cannot resolve (its namespace does not exist, so the kubelet
#      can make no mirror pod): created uncapped (create), then refused (refuse); 5c. refuse with the agent away:
#      GPU pods refused (fail-closed), made capped once it is back; non-GPU pods unaffected;
#   6. containerd restarted under the relay: re-registration (containerd's log), a pod capped.
# Needs: root; the API server up (eval "$(REALK8S_ADVERTISE=10.88.0.1 bash up.sh)"; never stopped here); containerd 2
# built (build-containerd.sh); helm; the agent's release binary (GPUBUDGET_E2E_AGENT_BINARY, default
# $CARGO_TARGET_DIR/release/gpubudget-agent: cargo build --release --locked -p gpubudget-agent). Brings the node up
# (REALK8S_CONTAINERD=2 node-up.sh, the kubelet restarted with a static pod directory) unless it is up, and down
# (node-down.sh) at the end if it brought it up. Skips unless GPUBUDGET_E2E_NRI=1. See e2e/cluster/README.md,
# "Caps at container creation (NRI)".
set -euo pipefail
if [ "${GPUBUDGET_E2E_NRI:-0}" != 1 ]; then
  echo "runtime-caps.sh: skipped (set GPUBUDGET_E2E_NRI=1; needs the realk8s node tier with REALK8S_CONTAINERD=2)"
  exit 0
fi
HERE=$(cd "$(dirname "$0")" && pwd); REPO=$(cd "$HERE/../.." && pwd)
REALK8S=${REALK8S:-/work/shared/realk8s}; D=${REALK8S_DIR:-/tmp/realk8s}; N=$D/run/node; NODE=${REALK8S_NODE_NAME:-n1}
export KUBECONFIG=${KUBECONFIG:-$D/run/kubeconfig} CONTAINERD_SUPPRESS_DEPRECATION_WARNINGS=1 REALK8S_DIR=$D
export PATH=$D/containerd2/bin:$D/bin:$PATH
BENCH_PODS=${BENCH_PODS:-20}; BENCH_CONTAINERS=${BENCH_CONTAINERS:-10}; KILL_PODS=${KILL_PODS:-6}
START=$SECONDS; STEP_TIMEOUT=${GPUBUDGET_E2E_STEP_TIMEOUT:-120}; POLL=0.2
# shellcheck source=nri-lib.sh
. "$HERE/nri-lib.sh"
AGENT_BIN=${GPUBUDGET_E2E_AGENT_BINARY:-$RELEASE_DIR/gpubudget-agent}
[ -n "$HELM" ] || die "no helm"
[ -x "$AGENT_BIN" ] || die "no agent binary $AGENT_BIN (cargo build --release --locked -p gpubudget-agent)"
kubectl get --raw /readyz >/dev/null 2>&1 || die "no API server (eval \"\$(REALK8S_ADVERTISE=10.88.0.1 bash $REALK8S/up.sh)\")"
LABEL="real node tier: kubelet 1.32, containerd 2.3.4 built here, runc, cgroup v1, $(nproc)-core VM, no GPU (GPU containers by environment; usage replayed)"
ID=$(date +%s | tail -c 6)$RANDOM; ID=${ID:0:8}
NS=gpubudget-rc-$ID; T=gpubudget-rc-$ID-t; RELEASE=gpubudget-rc-$ID; TAG=rc-$ID
WORK=$(mktemp -d /tmp/runtime-caps.XXXXXX); STATIC=$WORK/static-pods
STARTED_NODE=0
now() { date +%s.%N; }
names() { local i; for i in $(seq 1 "$2"); do echo "$1-$i"; done; }   # names PREFIX N: PREFIX-1 .. PREFIX-N
mapfile -t BASE_PODS < <(names base "$BENCH_PODS"); mapfile -t WITH_PODS < <(names with "$BENCH_PODS")
mapfile -t OFF_PODS < <(names off "$BENCH_PODS"); mapfile -t KILLED_PODS < <(names kill "$KILL_PODS")

cleanup() {
  local rc=$?
  set +e
  if [ "$FAILED" != 0 ] || [ "$rc" != 0 ]; then
    say "diagnostics (work dir $WORK)"
    kubectl logs -n "$NS" -l app.kubernetes.io/component=agent --tail=60 --prefix 2>/dev/null
    kubectl logs -n "$NS" -l app.kubernetes.io/component=runtime-caps-relay --tail=30 --prefix 2>/dev/null
    kubectl get pods -n "$T" -o wide 2>/dev/null
    kubectl get events -n "$T" --sort-by=.lastTimestamp 2>/dev/null | tail -n 40
  fi
  say "cleanup"
  rm -f "$STATIC"/*.yaml
  "$HELM" uninstall "$RELEASE" -n "$NS" --wait --timeout 2m >/dev/null 2>&1
  kubectl delete namespace "$T" "$NS" --wait=false --ignore-not-found >/dev/null 2>&1
  # Gone before the node stops (a pod of a stopped node never finishes terminating, nor then its namespace).
  kubectl wait --for=delete namespace "$T" "$NS" --timeout=90s >/dev/null 2>&1 \
    || kubectl delete pods --all -n "$NS" --force --grace-period=0 >/dev/null 2>&1
  ctr -n k8s.io images rm "docker.io/gpubudget/gpubudget-agent:$TAG" >/dev/null 2>&1
  if [ "$STARTED_NODE" = 1 ]; then bash "$REALK8S/node-down.sh" >/dev/null 2>&1; info "node-down.sh: node $NODE stopped"; fi
  info "logs kept in $WORK"
  exit "$rc"
}
trap cleanup EXIT

# --- the node: containerd 2 with NRI, the kubelet with a static pod directory ---
say "the node ($LABEL)"
mkdir -p "$STATIC"
if [ "$(kubectl get node "$NODE" -o jsonpath='{.status.conditions[?(@.type=="Ready")].status}' 2>/dev/null)" != True ]; then
  REALK8S_CONTAINERD=2 bash "$REALK8S/node-up.sh" >/dev/null
  STARTED_NODE=1
fi
ctr version 2>/dev/null | awk '/^Server/ {s=1} s && /Version: *v2\./ {ok=1} END {exit !ok}' || die "containerd 2 is not the node's runtime (node-down.sh; REALK8S_CONTAINERD=2 node-up.sh)"
[ -S /var/run/nri/nri.sock ] || die "no NRI socket /var/run/nri/nri.sock"
# node-up.sh's kubelet has no static pod directory: the same kubelet again (same arguments, pid file, log) with its
# configuration plus staticPodPath. node-down.sh stops it by the pid file as before.
KUBELET_PID=$(cat "$N/kubelet.pid")
mapfile -d '' KUBELET_ARGS < "/proc/$KUBELET_PID/cmdline"
{ cat "$N/kubelet.yaml"; echo "staticPodPath: $STATIC"; } > "$WORK/kubelet.yaml"
for i in "${!KUBELET_ARGS[@]}"; do
  case ${KUBELET_ARGS[$i]} in --config=*) KUBELET_ARGS[i]=--config=$WORK/kubelet.yaml ;; esac
done
kill "$KUBELET_PID"; while kill -0 "$KUBELET_PID" 2>/dev/null; do sleep 0.1; done
nohup "${KUBELET_ARGS[@]}" >> "$N/kubelet.log" 2>&1 & echo $! > "$N/kubelet.pid"
kubelet_healthy() { curl -fsS http://127.0.0.1:10248/healthz >/dev/null; }
wait_for "the kubelet (again, staticPodPath $STATIC) is healthy" kubelet_healthy
wait_for "node $NODE Ready" kubectl wait --for=condition=Ready "node/$NODE" --timeout=5s
REG_NEEDLE='registered as \"90-gpubudget\"'
registrations_in_log() { grep -cF "$REG_NEEDLE" "$N/containerd.log" || true; }
[ "$(grep -c 'registered as' "$N/containerd.log" || true)" = 0 ] || info "note: containerd's log already shows NRI registrations: $(grep -o 'registered as \\"[^\\]*' "$N/containerd.log" | sort | uniq -c | paste -sd' ' -)"

# --- the images, namespaces, the replayed sample ---
say "image from the release binary, namespaces, the sample (two 80Gi GPUs, no process)"
bash "$REALK8S/image.sh" "gpubudget/gpubudget-agent:$TAG" /usr/local/bin/gpubudget-agent \
  "$AGENT_BIN=/usr/local/bin/gpubudget-agent" | sed 's/^/    /'
info "agent binary $AGENT_BIN, sha256 $(sha256sum "$AGENT_BIN" | cut -c1-16)…"
kubectl create namespace "$NS" >/dev/null
kubectl label namespace "$NS" pod-security.kubernetes.io/enforce=privileged >/dev/null
kubectl create namespace "$T" >/dev/null
gpu() { printf '{"index": %s, "uuid": "GPU-rc000000-0000-0000-0000-00000000000%s", "name": "replayed 80Gi", "memory_total_bytes": "80Gi", "processes": []}' "$1" "$1"; }
printf '{"version": 1, "host": "runtime-caps %s", "gpus": [%s, %s]}\n' "$ID" "$(gpu 0)" "$(gpu 1)" > "$WORK/sample.json"
kubectl create configmap gpubudget-e2e-sample -n "$NS" --from-file=sample.json="$WORK/sample.json" >/dev/null

# pod NAME [ENV_YAML_OF_EACH_CONTAINER] [CONTAINERS] [EXTRA_SPEC]: a busybox pod on the node, CONTAINERS containers
# (default 1: c; more: c0..cN-1), each with the env lines given (flow-style YAML list items).
pod() {
  local name=$1 env=${2:-} n=${3:-1} extra=${4:-} i cname containers=""
  for i in $(seq 0 $((n - 1))); do
    if [ "$n" = 1 ]; then cname=c; else cname=c$i; fi
    containers+="  - {name: $cname, image: local/busybox:1, imagePullPolicy: Never, command: [sleep, \"3600\"], env: [$env]}"$'\n'
  done
  kubectl apply -f - >/dev/null <<YAML
apiVersion: v1
kind: Pod
metadata: {name: $name, namespace: $T, labels: {e2e.gpubudget.io/run: "$ID"}}
spec:
  nodeName: $NODE
  terminationGracePeriodSeconds: 0
$extra
  containers:
$containers
YAML
}
# env_of NAMESPACE POD [CONTAINER] VAR: the variable's value in the process's environment ("<unset>" when absent).
env_of() {
  local var=${*: -1} args=("${@:1:$#-1}") out
  out=$(nri_environ "${args[@]}" | sed -n "s/^$var=//p" | tail -n1)
  echo "${out:-<unset>}"
}
# expect_env WHAT NAMESPACE POD CONTAINER VAR VALUE
expect_env() {
  local got
  got=$(env_of "$2" "$3" "$4" "$5")
  if [ "$got" = "$6" ]; then pass "$1: $5=$got"; else record_fail "$1: $5 is '$got', want '$6'"; fi
}
capped_event() { # capped_event POD: the pod's GpuMemoryCappedAtCreation events, "<count> <note>" a line
  kubectl get events.v1.events.k8s.io -n "$T" -o json | jq -r --arg p "$1" \
    '.items[] | select(.regarding.name == $p and .reason == "GpuMemoryCappedAtCreation") | "\(.series.count // 1) \(.note)"'
}
# --- baseline without any plugin ---
BENCH_ENV='{name: NVIDIA_VISIBLE_DEVICES, value: "0"}'
bench() { # bench PREFIX: BENCH_PODS pods of BENCH_CONTAINERS GPU containers, one after another (each Ready first)
  local i
  for i in $(seq 1 "$BENCH_PODS"); do pod "$1-$i" "$BENCH_ENV" "$BENCH_CONTAINERS"; pod_ready "$T" "$1-$i" 120; done
}
bench_ms() { # bench_ms PREFIX LOG: the CreateContainer durations of the bench pods, from LOG
  local i sb=()
  for i in $(seq 1 "$BENCH_PODS"); do mapfile -t -O "${#sb[@]}" sb < <(nri_sandbox "$T" "$1-$i"); done
  nri_create_ms "$2" "${sb[@]}"
}
stats() { # stats FILE: "n N, p50 X ms, p99 Y ms, max Z ms"
  echo "n $(wc -l < "$1"), p50 $(nri_pct 0.5 < "$1") ms, p99 $(nri_pct 0.99 < "$1") ms, max $(nri_pct 1 < "$1") ms"
}
delete_pods() { # delete_pods NAME...: deleted, waited for
  kubectl delete pod -n "$T" "$@" --wait=true --timeout=120s >/dev/null
}
say "0. baseline: $BENCH_PODS pods x $BENCH_CONTAINERS GPU containers, no NRI plugin connected"
# Connected now: registrations less closed connections in containerd's log (a plugin of an earlier run may still
# show when containerd restarted under it).
connected() { echo $(($(registrations_in_log) - $(grep -cF 'connection to plugin \"90-gpubudget\" closed' "$N/containerd.log" || true))); }
[ "$(connected)" -le 0 ] || die "a gpubudget plugin is connected to this containerd"
bench base
cp "$N/containerd.log" "$WORK/containerd-baseline.log"
bench_ms base "$WORK/containerd-baseline.log" > "$WORK/base.ms"
info "figure: CRI CreateContainer without plugin: $(stats "$WORK/base.ms") [$LABEL]"
delete_pods "${BASE_PODS[@]}"

# --- 1. the chart, with the agent's plugin; no operator, no caps webhook ---
say "1. helm install: agent.runtimeCaps.enabled=true, admissionCaps.enabled=false, the operator scaled to 0"
t0=$(now)
"$HELM" install "$RELEASE" "$REPO/charts/gpubudget" -n "$NS" -f "$HERE/values.yaml" \
  --set image.registry=gpubudget --set-string "agent.image.tag=$TAG" --set-string "operator.image.tag=$TAG" \
  --set agent.runtimeCaps.enabled=true --set admissionCaps.enabled=false --set operator.replicas=1 >/dev/null
kubectl scale deployment -n "$NS" -l app.kubernetes.io/component=operator --replicas=0 >/dev/null
kubectl rollout status daemonset -n "$NS" -l 'app.kubernetes.io/component in (agent,runtime-caps-relay)' --timeout=120s >/dev/null
kubectl wait --for=delete pod -n "$NS" -l app.kubernetes.io/component=operator --timeout=60s >/dev/null 2>&1 || true
# upgrade SET...: helm upgrade --reuse-values with these --set values; the operator scaled to 0 again (the upgrade
# applies the Deployment's replicas: 1), the agent rolled out.
upgrade() {
  local sets=() v
  for v in "$@"; do sets+=(--set "$v"); done
  "$HELM" upgrade "$RELEASE" "$REPO/charts/gpubudget" -n "$NS" --reuse-values "${sets[@]}" >/dev/null
  kubectl scale deployment -n "$NS" -l app.kubernetes.io/component=operator --replicas=0 >/dev/null
  kubectl rollout status daemonset -n "$NS" -l app.kubernetes.io/component=agent --timeout=120s >/dev/null
  kubectl get daemonset -n "$NS" -l app.kubernetes.io/component=runtime-caps-relay -o name | grep -q . \
    && kubectl rollout status daemonset -n "$NS" -l app.kubernetes.io/component=runtime-caps-relay --timeout=120s >/dev/null
  kubectl wait --for=delete pod -n "$NS" -l app.kubernetes.io/component=operator --timeout=60s >/dev/null 2>&1 || true
}
agent_pod() { kubectl get pods -n "$NS" -l app.kubernetes.io/component=agent -o jsonpath='{.items[0].metadata.name}'; }
relay_pod() { kubectl get pods -n "$NS" -l app.kubernetes.io/component=runtime-caps-relay -o jsonpath='{.items[0].metadata.name}'; }
registered() { [ "$(registrations_in_log)" -gt "$1" ]; }
# agent_away / agent_back: the agent's DaemonSet kept off the node (its pod deleted, the relay without an agent), then
# restored and the agent connected again.
agent_ds() { kubectl get daemonset -n "$NS" -l app.kubernetes.io/component=agent -o jsonpath='{.items[0].metadata.name}'; }
agent_gone() { [ -z "$(kubectl get pods -n "$NS" -l app.kubernetes.io/component=agent -o name)" ] && ! agent_connected 0; }
agent_away() {
  kubectl patch daemonset -n "$NS" "$(agent_ds)" -p '{"spec":{"template":{"spec":{"nodeSelector":{"e2e.gpubudget.io/away":"yes"}}}}}' >/dev/null
  wait_for "the agent gone and disconnected" agent_gone
}
agent_back() {
  kubectl patch daemonset -n "$NS" "$(agent_ds)" --type=json -p '[{"op":"remove","path":"/spec/template/spec/nodeSelector/e2e.gpubudget.io~1away"}]' >/dev/null
  wait_for "the agent back and connected" agent_connected 0
}
# The agent's connections to the relay, from the relay's log (this relay pod's, all its restarts).
agent_connections() { { kubectl logs -n "$NS" "$(relay_pod)" 2>/dev/null; kubectl logs -n "$NS" "$(relay_pod)" --previous 2>/dev/null; } | grep -c 'the agent connected' || true; }
# connected_since N: more than N connections, the last one not followed by a disconnection.
agent_connected() { local l; l=$(kubectl logs -n "$NS" "$(relay_pod)" 2>/dev/null | grep -E 'the agent (dis)?connected' | tail -n1); [[ "$l" == *"the agent connected"* ]] && [ "$(agent_connections)" -gt "${1:-0}" ]; }
wait_for "the relay registered with containerd (its log: registered as \"90-gpubudget\")" registered 0
wait_for "the agent connected to the relay (the relay's log)" agent_connected 0
info "figure: helm install to the relay registered and the agent connected: $(since "$t0") s"
AGENT=$(agent_pod); RELAY=$(relay_pod)
AGENT_PID=$(nri_task_pid "$NS" "$AGENT"); RELAY_PID=$(nri_task_pid "$NS" "$RELAY")
cmp -s "/proc/$AGENT_PID/exe" "$AGENT_BIN" || record_fail "the agent runs a binary other than $AGENT_BIN"
cmp -s "/proc/$RELAY_PID/exe" "$AGENT_BIN" || record_fail "the relay runs a binary other than $AGENT_BIN"
# #53: who holds what, read from each process on the host (not from the chart's text).
say "1b. least privilege: the NRI socket, host PIDs and the API token never in one container"
uid_of() { awk '/^Uid:/ {print $2}' "/proc/$1/status"; }
capeff() { awk '/^CapEff:/ {print $2}' "/proc/$1/status"; }
mnt_of() { awk -v m="$2" '$5 ~ m"$" {print $6}' "/proc/$1/mountinfo"; }     # mnt_of PID MOUNTPOINT: its mount options
has_token() { [ -e "/proc/$1/root/var/run/secrets/kubernetes.io/serviceaccount/token" ]; }
host_pidns() { [ "$(readlink "/proc/$1/ns/pid")" = "$(readlink /proc/$$/ns/pid)" ]; }
nri_mounted() { [ -S "/proc/$1/root/var/run/nri-host/nri.sock" ] || [ -S "/proc/$1/root/var/run/nri/nri.sock" ] || [ -S "/proc/$1/root/run/nri/nri.sock" ]; }
yes_no() { if "$@"; then echo yes; else echo no; fi; }
for who in "relay $RELAY_PID" "agent $AGENT_PID"; do
  read -r name pid <<<"$who"
  info "$name (host PID $pid): uid $(uid_of "$pid"), CapEff $(capeff "$pid"), host PID namespace $(yes_no host_pidns "$pid"), API token $(yes_no has_token "$pid"), NRI socket directory mounted $(yes_no nri_mounted "$pid")$( [ "$name" = relay ] && echo ", mount options $(mnt_of "$pid" /var/run/nri-host)")"
done
[ "$(uid_of "$RELAY_PID")" = 0 ] || record_fail "the relay does not run as root (the NRI socket is root's)"
if [ "$(capeff "$RELAY_PID")" = 0000000000000000 ]; then pass "the relay holds no capability (CapEff 0)"; else record_fail "the relay holds capabilities: CapEff $(capeff "$RELAY_PID")"; fi
host_pidns "$RELAY_PID" && record_fail "the relay is in the host's PID namespace"
has_token "$RELAY_PID" && record_fail "the relay has an API token"
nri_mounted "$RELAY_PID" || record_fail "the relay has no NRI socket directory mounted"
if [[ "$(mnt_of "$RELAY_PID" /var/run/nri-host)" == ro* ]]; then pass "the NRI socket directory is read-only in the relay"; else record_fail "the NRI socket directory is writable in the relay"; fi
if [ "$(uid_of "$AGENT_PID")" != 0 ]; then pass "the agent runs non-root (uid $(uid_of "$AGENT_PID"))"; else record_fail "the agent runs as root"; fi
host_pidns "$AGENT_PID" || record_fail "the agent is not in the host's PID namespace (NVML would see no pod's process)"
has_token "$AGENT_PID" || record_fail "the agent has no API token"
# Every pod of the release: none with both the NRI directory and host PIDs or a token.
both=$(kubectl get pods -n "$NS" -o json | jq -r '.items[] | select(any(.spec.volumes[]?; .hostPath.path == "/var/run/nri")) | select(.spec.hostPID == true or .spec.automountServiceAccountToken != false) | .metadata.name')
if [ -z "$both" ]; then pass "no pod of the release holds the NRI socket with host PIDs or a token"; else record_fail "pods with the NRI socket and host PIDs or a token: $both"; fi
# The agent cannot reach the runtime's socket: not in its mount namespace at all.
if nri_mounted "$AGENT_PID"; then record_fail "the NRI socket is in the agent's filesystem"; else pass "the agent's filesystem has no NRI socket"; fi
[ "$(kubectl get pods -n "$NS" -l app.kubernetes.io/component=operator -o name | wc -l)" = 0 ] || record_fail "an operator pod exists"
kubectl get mutatingwebhookconfigurations -o name | grep -q "$RELEASE" && record_fail "a mutating webhook of the release is registered"
AGENT_URL() { echo "http://$(kubectl get pod -n "$NS" "$(agent_pod)" -o jsonpath='{.status.podIP}'):9400"; }
metrics() { curl -fsS --max-time 5 "$(AGENT_URL)/metrics"; }
rss() { awk '/^VmRSS:/ {print $2 " kB"}' "/proc/$(nri_task_pid "$NS" "$(agent_pod)")/status"; }
metric() { metrics | awk -v m="$1" '$1 == m {print $2}'; }  # metric 'name{labels}': its value
apply_budget() {
  printf 'apiVersion: gpubudget.io/v1alpha1\nkind: GpuMemoryBudget\nmetadata: {name: %s, namespace: %s}\nspec: %s\n' "$1" "$2" "$3" \
    | kubectl apply -f - >/dev/null
}
apply_budget all "$T" '{selector: {}, limit: 8Gi, admissionCaps: Enabled}'
# The agent knows the budget once its table holds it: a GPU probe pod comes up capped.
pod probe "$BENCH_ENV"; pod_ready "$T" probe
if [ "$(env_of "$T" probe c CUDA_MPS_PINNED_DEVICE_MEM_LIMIT)" != 0=8192M ]; then
  info "probe pod uncapped (the budget not in the agent's table yet?): again"
  delete_pods probe; pod probe "$BENCH_ENV"; pod_ready "$T" probe
fi
expect_env "probe" "$T" probe c CUDA_MPS_PINNED_DEVICE_MEM_LIMIT 0=8192M
[ -z "$(kubectl get namespace "$T" -o jsonpath='{.metadata.labels.gpubudget\.io/admission-caps}')" ] \
  || record_fail "namespace $T is labelled for the caps webhook (another release's operator?)"

# --- 2. the cases ---
say "2. GPU containers made by the runtime with the caps, whatever the pod says"
# (b) KAI-shaped: the devices from the binder's ConfigMap (configMapKeyRef), an envFrom ConfigMap.
kubectl apply -f - >/dev/null <<YAML
apiVersion: v1
kind: ConfigMap
metadata: {name: kai-x7k2mqz-shared-gpu-0, namespace: $T}
data: {NVIDIA_VISIBLE_DEVICES: GPU-rc000000-0000-0000-0000-000000000000, GPU_PORTION: "0.50", RUNAI_NUM_OF_GPUS: "0.50"}
---
apiVersion: v1
kind: ConfigMap
metadata: {name: kai-x7k2mqz-shared-gpu-0-evar, namespace: $T}
data: {KAI_EVAR_SEEN: "yes"}
---
apiVersion: v1
kind: Pod
metadata:
  name: kai
  namespace: $T
  labels: {kai.scheduler/queue: default-queue, e2e.gpubudget.io/run: "$ID"}
  annotations: {gpu-fraction: "0.5", runai/shared-gpu-configmap: kai-x7k2mqz-shared-gpu, received-resource-type: Fraction}
spec:
  schedulerName: kai-scheduler
  nodeName: $NODE
  terminationGracePeriodSeconds: 0
  containers:
  - name: c
    image: local/busybox:1
    imagePullPolicy: Never
    command: [sleep, "3600"]
    env:
    - {name: NVIDIA_VISIBLE_DEVICES, valueFrom: {configMapKeyRef: {name: kai-x7k2mqz-shared-gpu-0, key: NVIDIA_VISIBLE_DEVICES}}}
    - {name: RUNAI_NUM_OF_GPUS, valueFrom: {configMapKeyRef: {name: kai-x7k2mqz-shared-gpu-0, key: RUNAI_NUM_OF_GPUS}}}
    - {name: GPU_PORTION, valueFrom: {configMapKeyRef: {name: kai-x7k2mqz-shared-gpu-0, key: GPU_PORTION}}}
    envFrom:
    - configMapRef: {name: kai-x7k2mqz-shared-gpu-0-evar, optional: false}
YAML
# (c) a static pod: the kubelet reads it from its directory; its mirror pod is $NAME-$NODE.
cat > "$STATIC/static-gpu.yaml" <<YAML
apiVersion: v1
kind: Pod
metadata: {name: static-gpu, namespace: $T}
spec:
  terminationGracePeriodSeconds: 0
  containers:
  - {name: c, image: local/busybox:1, imagePullPolicy: Never, command: [sleep, "3600"], env: [$BENCH_ENV]}
YAML
pod plain "$BENCH_ENV"                                                                                   # (a)
pod hostile "$BENCH_ENV, {name: CUDA_MPS_PINNED_DEVICE_MEM_LIMIT, value: \"0=80G,1=1G\"}, {name: NVIDIA_GPU_MEMORY_LIMIT, value: \"81920\"}" # (d)
kubectl apply -f - >/dev/null <<YAML
apiVersion: v1
kind: Pod
metadata: {name: two, namespace: $T}
spec:
  nodeName: $NODE
  terminationGracePeriodSeconds: 0
  containers:
  - {name: g1, image: local/busybox:1, imagePullPolicy: Never, command: [sleep, "3600"], env: [{name: NVIDIA_VISIBLE_DEVICES, value: "0"}]}
  - {name: g2, image: local/busybox:1, imagePullPolicy: Never, command: [sleep, "3600"], env: [{name: NVIDIA_VISIBLE_DEVICES, value: "0,1"}]}
YAML
pod nogpu "{name: SOMETHING, value: else}"                                                               # (f)
pod allgpu '{name: NVIDIA_VISIBLE_DEVICES, value: all}'                    # all: the node's GPUs (2 in the sample)
for p in plain kai hostile two nogpu allgpu; do pod_ready "$T" "$p"; done
pod_ready "$T" "static-gpu-$NODE" 90
# Admission gave nothing: no caps record, and the specs hold what was written (plain: only its device list).
for p in plain kai hostile two nogpu "static-gpu-$NODE"; do
  [ -z "$(kubectl get pod -n "$T" "$p" -o jsonpath='{.metadata.annotations.gpubudget\.io/caps}')" ] \
    || record_fail "$p: has a gpubudget.io/caps record: something capped it at admission"
done
[ "$(kubectl get pod -n "$T" plain -o jsonpath='{.spec.containers[0].env[*].name}')" = NVIDIA_VISIBLE_DEVICES ] \
  || record_fail "plain: its spec's env was changed at admission"
expect_env "(a) plain NVIDIA_VISIBLE_DEVICES=0" "$T" plain c CUDA_MPS_PINNED_DEVICE_MEM_LIMIT 0=8192M
expect_env "(a)" "$T" plain c NVIDIA_GPU_MEMORY_LIMIT 8192
expect_env "(a) no request in the budget" "$T" plain c NVIDIA_GPU_MEMORY_REQUEST "<unset>"
expect_env "(b) KAI-shaped: the devices resolved from the ConfigMap" "$T" kai c NVIDIA_VISIBLE_DEVICES GPU-rc000000-0000-0000-0000-000000000000
expect_env "(b) KAI-shaped: envFrom kept" "$T" kai c KAI_EVAR_SEEN yes
expect_env "(b) KAI-shaped" "$T" kai c CUDA_MPS_PINNED_DEVICE_MEM_LIMIT 0=8192M
expect_env "(b) KAI-shaped" "$T" kai c NVIDIA_GPU_MEMORY_LIMIT 8192
expect_env "(c) static pod" "$T" "static-gpu-$NODE" c CUDA_MPS_PINNED_DEVICE_MEM_LIMIT 0=8192M
expect_env "(c) static pod" "$T" "static-gpu-$NODE" c NVIDIA_GPU_MEMORY_LIMIT 8192
expect_env "(d) hostile 0=80G,1=1G replaced" "$T" hostile c CUDA_MPS_PINNED_DEVICE_MEM_LIMIT 0=8192M
expect_env "(d) hostile NVIDIA_GPU_MEMORY_LIMIT=81920 replaced" "$T" hostile c NVIDIA_GPU_MEMORY_LIMIT 8192
expect_env "(e) two containers, g1 (=0)" "$T" two g1 CUDA_MPS_PINNED_DEVICE_MEM_LIMIT 0=8192M
expect_env "(e) two containers, g2 (=0,1)" "$T" two g2 CUDA_MPS_PINNED_DEVICE_MEM_LIMIT 0=8192M,1=8192M
expect_env "(e) g2" "$T" two g2 NVIDIA_GPU_MEMORY_LIMIT 8192
expect_env "NVIDIA_VISIBLE_DEVICES=all on a node of 2 GPUs" "$T" allgpu c CUDA_MPS_PINNED_DEVICE_MEM_LIMIT 0=8192M,1=8192M
expect_env "(f) no GPU: left alone" "$T" nogpu c CUDA_MPS_PINNED_DEVICE_MEM_LIMIT "<unset>"
expect_env "(f) no GPU: left alone" "$T" nogpu c NVIDIA_GPU_MEMORY_LIMIT "<unset>"
# The hostile value twice in the process's environment would be a runtime bug (the last one wins at getenv, but a
# reader of /proc/<pid>/environ could take the first): exactly one entry of each.
n=$(nri_environ "$T" hostile c | grep -c '^CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=' || true)
if [ "$n" = 1 ]; then pass "(d) one CUDA_MPS_PINNED_DEVICE_MEM_LIMIT entry in environ"; else record_fail "(d) $n CUDA_MPS_PINNED_DEVICE_MEM_LIMIT entries in environ"; fi
# has_capped_event POD [N]: N occurrences at least (an event's series counts each).
has_capped_event() { [ "$(capped_event "$1" | awk '{n += $1} END {print n + 0}')" -ge "${2:-1}" ]; }
for p in plain kai hostile "static-gpu-$NODE" "two 2"; do
  # shellcheck disable=SC2086 # POD [COUNT]
  if until_ok 30 has_capped_event $p; then
    pass "event GpuMemoryCappedAtCreation on ${p% *}: $(capped_event "${p% *}" | head -n2 | paste -sd'|' -)"
  else record_fail "no event GpuMemoryCappedAtCreation on ${p% *} in 30 s"; fi
done
# Two containers, two events (#53: each on its container, spec.containers{NAME}): g2's own caps (two devices).
if capped_event two | grep -q 'container g2 capped.*=0=8192M,1=8192M '; then pass "(e) the event tells g2's caps"
else record_fail "(e) no event names g2 ('container g2 capped ... 0=8192M,1=8192M'): pod two's events: $(capped_event two | paste -sd'|' -)"; fi
paths=$(kubectl get events.v1.events.k8s.io -n "$T" -o json | jq -r '.items[] | select(.regarding.name == "two" and .reason == "GpuMemoryCappedAtCreation") | .regarding.fieldPath' | sort | paste -sd' ' -)
if [ "$paths" = "spec.containers{g1} spec.containers{g2}" ]; then pass "(e) one event per container: $paths"
else record_fail "(e) the events of pod two regard '$paths', not spec.containers{g1} and spec.containers{g2}"; fi
if [ -z "$(capped_event nogpu)" ]; then pass "(f) no event on the non-GPU pod"; else record_fail "(f) an event on the non-GPU pod"; fi
info "outcomes: $(metrics | sed -n 's/^gpubudget_runtime_caps_containers_total{outcome="\([a-z_]*\)"} \([0-9]*\).*/\1=\2/p' | paste -sd' ' -)"

# --- 3. benchmark with the plugin ---
say "3. benchmark: $BENCH_PODS pods x $BENCH_CONTAINERS GPU containers with the agent's plugin"
metrics > "$WORK/metrics-before"
bench with
metrics > "$WORK/metrics-after"
info "figure: the agent's RSS after the benchmark: $(rss) [$LABEL]"
cp "$N/containerd.log" "$WORK/containerd-with.log"
bench_ms with "$WORK/containerd-with.log" > "$WORK/with.ms"
info "figure: CRI CreateContainer with the plugin: $(stats "$WORK/with.ms") [$LABEL]"
# The plugin's own time, from its histogram (bucket upper bounds; the difference over the benchmark).
python3 - "$WORK/metrics-before" "$WORK/metrics-after" <<'PY' | sed 's/^/    /'
import re, sys
def read(p):
    b = {}
    for l in open(p):
        m = re.match(r'gpubudget_runtime_caps_seconds_bucket\{le="([^"]+)"\} (\S+)', l)
        if m: b[m.group(1)] = float(m.group(2))
    return b
b0, b1 = read(sys.argv[1]), read(sys.argv[2])
les = sorted(b1, key=lambda k: float('inf') if k == '+Inf' else float(k))
d = [(le, b1[le] - b0.get(le, 0)) for le in les]
n = d[-1][1]
def q(x):
    for le, c in d:
        if c >= x * n: return le
print(f"figure: gpubudget_runtime_caps_seconds over the benchmark: {n:.0f} calls, p50 <= {q(0.5)} s, p99 <= {q(0.99)} s; "
      + "buckets " + " ".join(f"le{le}:{c:.0f}" for le, c in d))
PY
say "3b. the same with the agent running and its plugin off (helm upgrade agent.runtimeCaps.enabled=false)"
upgrade agent.runtimeCaps.enabled=false
delete_pods "${WITH_PODS[@]}"
bench off
cp "$N/containerd.log" "$WORK/containerd-off.log"
bench_ms off "$WORK/containerd-off.log" > "$WORK/off.ms"
delete_pods "${OFF_PODS[@]}"
info "figure: CRI CreateContainer, agent without plugin: $(stats "$WORK/off.ms") [$LABEL]"
info "figure: CRI CreateContainer, agent with plugin:    $(stats "$WORK/with.ms")"
info "figure: CRI CreateContainer, no agent:             $(stats "$WORK/base.ms")"
diff_ms() { awk -v a="$(nri_pct "$1" < "$2")" -v b="$(nri_pct "$1" < "$3")" 'BEGIN {printf "%.1f", a - b}'; }
added=$(diff_ms 0.99 "$WORK/with.ms" "$WORK/off.ms")
info "figure: added by the plugin (with - agent without plugin): p50 $(diff_ms 0.5 "$WORK/with.ms" "$WORK/off.ms") ms, p99 ${added} ms (target p99 <= 5 ms)"
# p99 of 200 is the 2nd largest: on this VM it moves by tens of ms between runs of one configuration (compare the no-agent
# and agent-without-plugin figures), so the assertion is on the median; p99 is reported as it came.
added50=$(diff_ms 0.5 "$WORK/with.ms" "$WORK/off.ms")
if awk -v a="$added50" 'BEGIN {exit !(a <= 5)}'; then pass "p50 added ${added50} ms <= 5 ms (p99 added ${added} ms, noise: see above)"
else record_fail "p50 added ${added50} ms > 5 ms"; fi
before=$(registrations_in_log)
upgrade agent.runtimeCaps.enabled=true
wait_for "the relay registered again" registered "$before"
wait_for "the agent connected to the new relay" agent_connected 0


# --- 4. the agent killed while pods are created ---
say "4a. the cap-in-force check judges a runtime-capped pod: pod judged's process replayed as no MPS client (1Gi)"
pod judged "$BENCH_ENV"; pod_ready "$T" judged
expect_env "judged, capped by this agent" "$T" judged c CUDA_MPS_PINNED_DEVICE_MEM_LIMIT 0=8192M
# write_sample PROCESSES_JSON: the replayed sample, two 80Gi GPUs, these processes on GPU 0; the agent pod nudged so
# the kubelet refreshes the mounted ConfigMap at once.
write_sample() {
  printf '{"version": 1, "host": "runtime-caps %s", "gpus": [%s, %s]}\n' "$ID" "$(gpu 0 | sed "s/\"processes\": \[\]/\"processes\": [$1]/")" "$(gpu 1)" > "$WORK/sample.json"
  kubectl create configmap gpubudget-e2e-sample -n "$NS" --from-file=sample.json="$WORK/sample.json" --dry-run=client -o yaml | kubectl apply -f - >/dev/null
  kubectl annotate pods -n "$NS" -l app.kubernetes.io/component=agent "e2e.gpubudget.io/sample=$(date +%s%N)" --overwrite >/dev/null
}
proc_of() { # proc_of POD [MPS_CLIENT]: a 1Gi process of its container c (default: no MPS client)
  printf '{"pod_uid": "%s", "container": "c", "used_bytes": "1Gi", "mps_client": %s}' "$(uid "$T" "$1")" "${2:-false}"
}
rc_record() { kubectl get pod -n "$T" "$1" -o jsonpath='{.metadata.annotations.gpubudget\.io/runtime-caps}'; }
not_in_force_is() { [ "$(metric gpubudget_pods_cap_not_in_force)" = "$1" ]; }
write_sample "$(proc_of judged)"
if until_ok 60 not_in_force_is 1; then
  pass "gpubudget_pods_cap_not_in_force 1; judged's record: $(kubectl get pod -n "$T" judged -o jsonpath='{.metadata.annotations.gpubudget\.io/cap-not-in-force}' | cut -c1-160)"
else record_fail "judged (capped by the runtime, its process no MPS client) not reported cap-not-in-force in 60 s"; fi

say "4. the agent SIGKILLed while $KILL_PODS GPU pods are created, one every 0.5 s"
before=$(agent_connections)
AGENT_PID=$(nri_task_pid "$NS" "$(agent_pod)")
t0=$(now); kill -KILL "$AGENT_PID"
for p in "${KILLED_PODS[@]}"; do pod "$p" "$BENCH_ENV"; sleep 0.5; done
wait_for "the agent connected to the relay again (the relay's log)" agent_connected "$before"
for i in $(seq 1 "$KILL_PODS"); do pod_ready "$T" "kill-$i"; done
# From containerd's log: when the agent registered again, and when each kill-N container was created (since the kill).
log_offsets() { # log_offsets T0 NAME=SANDBOX...: "registered <s>" and "<name> <s>" (CreateContainer start)
  python3 - "$N/containerd.log" "$@" <<'PY'
import re, sys, datetime
log, t0, pods = sys.argv[1], float(sys.argv[2]), dict(a.split("=", 1) for a in sys.argv[3:])
ts = lambda l: datetime.datetime.fromisoformat(re.search(r'time="([^"]+)"', l).group(1)[:26]).replace(tzinfo=datetime.timezone.utc).timestamp() - t0
reg = None
for line in open(log, errors="replace"):
    if reg is None and 'registered as \\"90-gpubudget\\"' in line and ts(line) > 0: reg = ts(line); print(f"registered {reg:.2f}")
    m = re.search(r'CreateContainer within sandbox \\"(\w+)\\" for container', line)
    for name, sb in pods.items():
        if m and m.group(1) == sb: print(f"{name} {ts(line):.2f}")
PY
}
pairs=(); for p in "${KILLED_PODS[@]}"; do pairs+=("$p=$(nri_sandbox "$T" "$p" | head -n1)"); done
mapfile -t offsets < <(log_offsets "$t0" "${pairs[@]}")
# When the agent connected again: the relay's log line, by the kubelet's timestamp.
conn_at=$(kubectl logs -n "$NS" "$(relay_pod)" --timestamps | grep 'the agent connected' | tail -n1 | awk '{print $1}')
reg_s=$(awk -v a="$(date -d "$conn_at" +%s.%N)" -v b="$t0" 'BEGIN {printf "%.2f", a - b}')
info "figure: SIGKILL to the agent connected to the relay again: ${reg_s} s (the relay's log)"
printf '%s\n' "${offsets[@]}" | awk '$1 != "registered" {print $1, $2}' > "$WORK/kill-created"
uncapped=0
while read -r p at; do  # at: its CreateContainer, seconds after the kill
  v=$(env_of "$T" "$p" c CUDA_MPS_PINNED_DEVICE_MEM_LIMIT)
  ev=$(kubectl get events -n "$T" --field-selector "involvedObject.name=$p" -o jsonpath='{range .items[*]}{.reason}{" "}{end}')
  info "$p (CreateContainer at +${at} s): CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=$v; events: ${ev:-none}"
  [ "$v" = 0=8192M ] || uncapped=$((uncapped + 1))
done < "$WORK/kill-created"
info "figure: $uncapped of $KILL_PODS pods run uncapped: those whose CreateContainer came before the agent connected again (+${reg_s} s; the relay's fail-open, --runtime-caps-unresolved=create)"
wait_for "the agent Ready again" kubectl wait --for=condition=Ready -n "$NS" "pod/$(agent_pod)" --timeout=5s
# #53: each pod made uncapped meanwhile is told on its container once the agent is back (the relay hands it the GPU
# containers the runtime made).
not_capped_event() { kubectl get events.v1.events.k8s.io -n "$T" -o json | jq -r --arg p "$1" \
  '.items[] | select(.regarding.name == $p and .reason == "GpuMemoryNotCappedAtCreation") | "\(.regarding.fieldPath) \(.note)"'; }
while read -r p _; do
  [ "$(env_of "$T" "$p" c CUDA_MPS_PINNED_DEVICE_MEM_LIMIT)" = 0=8192M ] && continue
  told_uncapped() { [ -n "$(not_capped_event "$p")" ]; }
  if until_ok 30 told_uncapped; then pass "$p, made uncapped while the agent was away, is told: $(not_capped_event "$p" | head -n1 | cut -c1-200)"
  else record_fail "$p was made uncapped while the agent was away and has no GpuMemoryNotCappedAtCreation event"; fi
done < "$WORK/kill-created"
# What the agent says of them once back: its log and metrics (the runtime told it nothing at creation).
kubectl logs -n "$NS" "$(agent_pod)" | grep -E 'runtime caps|kill-[0-9]' | tail -n 8 | sed 's/^/    agent: /'
info "after: outcomes $(metrics | sed -n 's/^gpubudget_runtime_caps_containers_total{outcome="\([a-z_]*\)"} \([0-9]*\).*/\1=\2/p' | paste -sd' ' -); connections to the relay $(metric gpubudget_runtime_caps_registrations_total)"
# The pods capped before the restart, and those created uncapped while it was down, with a process that is no MPS
# client: what the restarted agent judges (the runtime's caps it gave lived in its memory).
write_sample "$(proc_of judged),$(proc_of kill-1),$(proc_of allgpu true)"
seen_judged() { metrics | grep -q "^gpubudget_pod_gpu_memory_bytes{.*pod=\"judged\""; }
until_ok 60 seen_judged || record_fail "the restarted agent does not charge judged's replayed process"
# Expected: judged (capped before the kill) and kill-1 if it was capped (by the agent back); kill-1 made uncapped is
# no capped pod whose cap fails, so not counted.
want=1; [ "$(env_of "$T" kill-1 c CUDA_MPS_PINNED_DEVICE_MEM_LIMIT)" != 0=8192M ] || want=2
judged_record() { kubectl get pod -n "$T" judged -o jsonpath='{.metadata.annotations.gpubudget\.io/cap-not-in-force}'; }
judged_told() { [ -n "$(judged_record)" ]; }
if until_ok 20 not_in_force_is "$want" && judged_told; then
  pass "after the restart: gpubudget_pods_cap_not_in_force $want (judged, capped before the kill, still judged; its record: $(judged_record | cut -c1-60)…)"
else
  record_fail "after the restart gpubudget_pods_cap_not_in_force is $(metric gpubudget_pods_cap_not_in_force), want $want; judged's record: '$(judged_record | cut -c1-80)': the cap the runtime gave judged before the restart is forgotten"
fi
# What the agent back records of what the runtime made before it (gpubudget.io/runtime-caps, where it writes one).
allgpu_capped() { [[ "$(rc_record allgpu)" == '{"capped"'* ]]; }
if until_ok 20 allgpu_capped; then pass "after the restart allgpu (NVIDIA_VISIBLE_DEVICES=all, capped before) recorded $(rc_record allgpu)"
else record_fail "after the restart allgpu (NVIDIA_VISIBLE_DEVICES=all, capped 0=8192M,1=8192M before) recorded '$(rc_record allgpu)'"; fi
info "gpubudget.io/runtime-caps after the restart: judged '$(rc_record judged)', kill-1 '$(rc_record kill-1)', allgpu '$(rc_record allgpu)'"
info "kill-1 (process no MPS client): events $(kubectl get events -n "$T" --field-selector involvedObject.name=kill-1 -o jsonpath='{range .items[*]}{.reason}{" "}{end}')"
write_sample ""
pod after-kill "$BENCH_ENV"; pod_ready "$T" after-kill
expect_env "a pod after the agent is back" "$T" after-kill c CUDA_MPS_PINNED_DEVICE_MEM_LIMIT 0=8192M
delete_pods "${KILLED_PODS[@]}" after-kill

say "4b. the relay SIGKILLed while $KILL_PODS GPU pods are created: the runtime's own fail-open, told once it is back"
mapfile -t RELAY_KILLED < <(names rkill "$KILL_PODS")
before=$(registrations_in_log)
RELAY_PID=$(nri_task_pid "$NS" "$(relay_pod)")
t0=$(now); kill -KILL "$RELAY_PID"
for p in "${RELAY_KILLED[@]}"; do pod "$p" "$BENCH_ENV"; sleep 0.5; done
wait_for "the relay registered again (containerd's log)" registered "$before"
info "figure: SIGKILL to the relay registered again: within $(since "$t0") s (the pods were created meanwhile, 3 s)"
wait_for "the agent connected to the restarted relay" agent_connected 0
for p in "${RELAY_KILLED[@]}"; do pod_ready "$T" "$p"; done
runcapped=0
for p in "${RELAY_KILLED[@]}"; do
  [ "$(env_of "$T" "$p" c CUDA_MPS_PINNED_DEVICE_MEM_LIMIT)" = 0=8192M ] && continue
  runcapped=$((runcapped + 1))
  told_uncapped() { [ -n "$(not_capped_event "$p")" ]; }
  if until_ok 30 told_uncapped; then pass "$p, made while the relay was away, is told: $(not_capped_event "$p" | head -n1 | cut -c1-200)"
  else record_fail "$p was made uncapped while the relay was away and has no GpuMemoryNotCappedAtCreation event"; fi
done
info "figure: $runcapped of $KILL_PODS pods made while the relay restarted run uncapped, each told"
delete_pods "${RELAY_KILLED[@]}"

say "4c. the agent hung (SIGSTOP) while a GPU pod is created: the relay answers within the runtime's 2 s"
before=$(registrations_in_log); restarts0=$(kubectl get pod -n "$NS" "$(agent_pod)" -o jsonpath='{.status.containerStatuses[0].restartCount}')
AGENT_PID=$(nri_task_pid "$NS" "$(agent_pod)")
kill -STOP "$AGENT_PID"; t0=$(now)
pod hung "$BENCH_ENV"; pod_ready "$T" hung
info "figure: pod hung Ready $(since "$t0") s after the agent stopped; its CRI CreateContainer: $(nri_create_ms "$N/containerd.log" "$(nri_sandbox "$T" hung | head -n1)") ms"
v=$(env_of "$T" hung c CUDA_MPS_PINNED_DEVICE_MEM_LIMIT)
if [ "$v" = "<unset>" ]; then pass "hung agent: the relay answered in time, the container made unadjusted (fail-open), CUDA_MPS_PINNED_DEVICE_MEM_LIMIT unset"
else info "hung agent: CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=$v"; fi
if [ "$(registrations_in_log)" = "$before" ]; then pass "the relay stayed registered (the runtime did not drop it)"; else record_fail "the relay was dropped by the runtime while the agent hung"; fi
kill -CONT "$AGENT_PID"
told_hung() { [ -n "$(not_capped_event hung)" ]; }
if until_ok 30 told_hung; then pass "hung, made uncapped while the agent hung, is told once it resumes: $(not_capped_event hung | head -n1 | cut -c1-200)"
else record_fail "hung was made uncapped and has no GpuMemoryNotCappedAtCreation event 30 s after SIGCONT"; fi
info "agent restarts $restarts0 -> $(kubectl get pod -n "$NS" "$(agent_pod)" -o jsonpath='{.status.containerStatuses[0].restartCount}')"
wait_for "the agent connected" agent_connected 0
pod after-hang "$BENCH_ENV"; pod_ready "$T" after-hang
expect_env "a pod after the agent resumed" "$T" after-hang c CUDA_MPS_PINNED_DEVICE_MEM_LIMIT 0=8192M
delete_pods hung after-hang

say "4d. the agent away (its DaemonSet kept off the node) while GPU pods are made: uncapped at once (create), each told when it is back"
agent_away
mapfile -t AWAY_PODS < <(names away "$KILL_PODS")
t0=$(now)
for p in "${AWAY_PODS[@]}"; do pod "$p" "$BENCH_ENV"; done
for p in "${AWAY_PODS[@]}"; do pod_ready "$T" "$p"; done
info "figure: $KILL_PODS GPU pods Ready $(since "$t0") s after creation with no agent (the relay answers alone)"
n=0; for p in "${AWAY_PODS[@]}"; do [ "$(env_of "$T" "$p" c CUDA_MPS_PINNED_DEVICE_MEM_LIMIT)" = "<unset>" ] && n=$((n + 1)); done
if [ "$n" = "$KILL_PODS" ]; then pass "all $KILL_PODS made uncapped while the agent was away"; else record_fail "$n of $KILL_PODS made uncapped while the agent was away"; fi
t0=$(now); agent_back
for p in "${AWAY_PODS[@]}"; do
  told_uncapped() { [ -n "$(not_capped_event "$p")" ]; }
  if until_ok 30 told_uncapped; then pass "$p told: $(not_capped_event "$p" | head -n1 | cut -c1-160)"
  else record_fail "$p was made uncapped while the agent was away and has no GpuMemoryNotCappedAtCreation event"; fi
done
info "figure: every pod made while the agent was away told $(since "$t0") s after its DaemonSet was restored"
rc_uncapped() { [[ "$(rc_record "${AWAY_PODS[0]}")" == '{"uncapped"'* ]]; }
if until_ok 30 rc_uncapped; then pass "${AWAY_PODS[0]} recorded $(rc_record "${AWAY_PODS[0]}" | cut -c1-120)"; else record_fail "${AWAY_PODS[0]} recorded '$(rc_record "${AWAY_PODS[0]}")'"; fi
delete_pods "${AWAY_PODS[@]}"

# --- 5. a pod the agent cannot resolve ---
say "5. --runtime-caps-unresolved: a static GPU pod in a namespace that does not exist (no mirror pod can be made)"
ghost_pod() { # ghost_pod NAME: the static pod's manifest, namespace gpubudget-rc-$ID-ghost (never created)
  cat > "$STATIC/$1.yaml" <<YAML
apiVersion: v1
kind: Pod
metadata: {name: $1, namespace: $T-ghost}
spec:
  terminationGracePeriodSeconds: 0
  containers:
  - {name: c, image: local/busybox:1, imagePullPolicy: Never, command: [sleep, "3600"], env: [$BENCH_ENV]}
YAML
}
ghost_running() { # ghost_running NAME: the id of its running container, read from containerd
  ctr -n k8s.io containers ls -q "labels.\"io.kubernetes.pod.name\"==$1-$NODE,labels.\"io.kubernetes.container.name\"==c" | head -n1
}
task_env() { ctr -n k8s.io task ls | awk -v c="$1" '$1 == c {print $2}' | { read -r pid && tr '\0' '\n' < "/proc/$pid/environ"; }; }
count() { metric "gpubudget_runtime_caps_containers_total{outcome=\"$1\"}"; }
created0=$(count unresolved_created); created0=${created0:-0}
ghost_pod ghost-create
ghost_up() { [ -n "$(ghost_running "$1")" ] && [ -n "$(task_env "$(ghost_running "$1")")" ]; }
wait_for "ghost-create runs (unresolved=create)" ghost_up ghost-create
v=$(task_env "$(ghost_running ghost-create)" | sed -n 's/^CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=//p')
if [ -z "$v" ]; then pass "create: the unresolvable GPU pod runs uncapped (CUDA_MPS_PINNED_DEVICE_MEM_LIMIT unset)"
else record_fail "create: the unresolvable pod has CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=$v"; fi
info "unresolved_created: ${created0} -> $(count unresolved_created); agent: $(kubectl logs -n "$NS" "$(agent_pod)" | grep 'created uncapped' | tail -n1 | cut -c1-300)"
rm -f "$STATIC/ghost-create.yaml"
say "5b. helm upgrade --set agent.runtimeCaps.unresolved=refuse"
before=$(registrations_in_log)
upgrade agent.runtimeCaps.unresolved=refuse
wait_for "the new relay registered" registered "$before"
wait_for "the new agent connected to it" agent_connected 0
ghost_pod ghost-refuse
refused() { grep -q "not created: pod $T-ghost/ghost-refuse-$NODE .* is not in the agent.s table" "$N/kubelet.log"; }
t0=$(now)
wait_for "the kubelet logs the refusal of ghost-refuse" refused
info "refused after $(since "$t0") s: $(grep "$T-ghost/ghost-refuse" "$N/kubelet.log" | grep -o 'gpubudget: GPU container[^"]*' | tail -n1)"
if [ -z "$(ghost_running ghost-refuse)" ] || [ -z "$(task_env "$(ghost_running ghost-refuse)")" ]; then
  pass "refuse: no container of the unresolvable pod runs"; else record_fail "refuse: a container of the unresolvable pod runs"; fi
refused_n() { [ "$(count unresolved_refused)" -ge 1 ]; }
until_ok 10 refused_n || record_fail "refuse: gpubudget_runtime_caps_containers_total{outcome=\"unresolved_refused\"} did not move"
info "unresolved_refused: $(count unresolved_refused)"
pod after-refuse "$BENCH_ENV"; pod_ready "$T" after-refuse
expect_env "refuse mode: a resolvable pod still capped" "$T" after-refuse c CUDA_MPS_PINNED_DEVICE_MEM_LIMIT 0=8192M
rm -f "$STATIC/ghost-refuse.yaml"
say "5c. refuse with the agent away (its DaemonSet kept off the node): GPU containers refused, others made"
agent_away
pod away-gpu "$BENCH_ENV"; pod away-plain "{name: SOMETHING, value: else}"
pod_ready "$T" away-plain && pass "a container without a GPU is made with the agent away (refuse mode)"
refused_away() { kubectl get events -n "$T" --field-selector involvedObject.name=away-gpu -o jsonpath='{.items[*].message}' | grep -q 'agent is not connected to the runtime-caps relay'; }
if until_ok 30 refused_away; then pass "the GPU container is refused with the reason: $(kubectl get events -n "$T" --field-selector involvedObject.name=away-gpu -o jsonpath='{.items[*].message}' | grep -o 'gpubudget: GPU container[^;]*' | head -n1)"
else record_fail "away-gpu was not refused with the agent away"; fi
t0=$(now)
agent_back
info "figure: agent DaemonSet restored to connected: $(since "$t0") s"
pod_ready "$T" away-gpu 330
info "figure: the refused GPU pod Ready $(since "$t0") s after the agent was restored (the kubelet's back-off between attempts)"
expect_env "refused while the agent was away, made capped once it is back" "$T" away-gpu c CUDA_MPS_PINNED_DEVICE_MEM_LIMIT 0=8192M
delete_pods away-gpu away-plain

# --- 6. containerd restarted under the agent ---
say "6. containerd restarted under the relay"
# The relay's own log counts its registrations (containerd's log starts afresh when node-up.sh restarts it).
relay_registrations() { kubectl logs -n "$NS" "$(relay_pod)" | grep -c 'registered with the container runtime' || true; }
relay_registered() { [ "$(relay_registrations)" -gt "$1" ]; }
regs0=$(relay_registrations)
cp "$N/containerd.log" "$WORK/containerd-before-restart.log"
CPID=$(cat "$N/containerd.pid"); t0=$(now); kill "$CPID"
while kill -0 "$CPID" 2>/dev/null; do sleep 0.1; done
REALK8S_CONTAINERD=2 bash "$REALK8S/node-up.sh" >/dev/null 2>&1
info "containerd back after $(since "$t0") s (node-up.sh)"
wait_for "the relay registered again (its log)" relay_registered "$regs0"
info "figure: containerd stopped to the relay registered again: $(since "$t0") s (node-up.sh restarts containerd in it); containerd's log since its restart: $(registrations_in_log) registration"
wait_for "the agent still connected" agent_connected 0
pod after-restart "$BENCH_ENV"; pod_ready "$T" after-restart
expect_env "a pod after the containerd restart" "$T" after-restart c CUDA_MPS_PINNED_DEVICE_MEM_LIMIT 0=8192M
cp "$N/containerd.log" "$WORK/containerd-after-restart.log"
kubectl logs -n "$NS" "$(agent_pod)" > "$WORK/agent.log" 2>&1 || true

[ "$(kubectl get pods -n "$NS" -l app.kubernetes.io/component=operator -o name | wc -l)" = 0 ] || record_fail "an operator pod exists at the end"
say "summary [$LABEL]"
failures_exit
