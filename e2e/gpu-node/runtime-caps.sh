#!/usr/bin/env bash
# On the GPU machine, after the three up.sh calls of a pack made with GPU_NODE_CONTAINERD=2 (issue #53): caps set
# by the container runtime alone — containerd 2.3.4 with NRI, the chart's agent.runtimeCaps (the relay holds the NRI
# socket, the agent decides), an MPS control daemon, the caps webhook off — on a real kubelet with a real GPU.
#   1. who holds what, read from each process on the host: the relay UID 0 without capabilities, not in the host's
#      PID namespace, no API token; the agent non-root with host PIDs and no NRI socket;
#   2. a KAI-shaped pod (gpu-fraction 0.25, bound by nodeName, devices from the binder's ConfigMap, no GPU resource,
#      nothing in its spec about memory) made with CUDA_MPS_PINNED_DEVICE_MEM_LIMIT at 0.25 of the card (read back
#      from its process's /proc/<pid>/environ), told GpuMemoryCappedAtCreation once the runtime showed the container;
#      it grows 1 GiB/s and meets CUDA out of memory at its share under MPS, while a neighbour keeps allocating;
#   3. CRI CreateContainer over BENCH_PODS x BENCH_CONTAINERS GPU containers (containerd's log), with the relay and
#      with runtime caps off (helm upgrade), on this quiet machine: p50/p99 and what the plugin adds.
# Prints PASS or FAIL: <what>; every figure is a wall-clock reading on that machine.
#   bash e2e/gpu-node/runtime-caps.sh
set -uo pipefail
# shellcheck source=e2e/gpu-node/lib.sh
source "$(dirname "$0")/lib.sh"
# shellcheck source=e2e/cluster/nri-lib.sh
source "$REPO/e2e/cluster/nri-lib.sh"
export CONTAINERD_ADDRESS=/run/containerd-gk/containerd.sock CONTAINERD_SUPPRESS_DEPRECATION_WARNINGS=1
BENCH_PODS=${BENCH_PODS:-20}; BENCH_CONTAINERS=${BENCH_CONTAINERS:-10}
CLOG=$G/logs/containerd.log
containerd --version | grep -q ' v2\.' || die "containerd 2 is not the node's runtime (pack.sh with GPU_NODE_CONTAINERD=2)"
[ -S /var/run/nri/nri.sock ] || die "no NRI socket /var/run/nri/nri.sock"

say "an MPS control daemon on the host (the pods run the host's python3 under chroot: they reach its pipe directory)"
command -v nvidia-cuda-mps-control >/dev/null || die "nvidia-cuda-mps-control not found"
export CUDA_MPS_PIPE_DIRECTORY=/tmp/nvidia-mps CUDA_MPS_LOG_DIRECTORY=/tmp/nvidia-mps-log
mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
nvidia-cuda-mps-control -d || die "the MPS control daemon did not start"
trap 'echo quit | nvidia-cuda-mps-control >/dev/null 2>&1' EXIT
info "MPS control daemon up (pipe directory $CUDA_MPS_PIPE_DIRECTORY)"

REGS0=$(grep -c 'registered as \\"90-gpubudget\\"' "$CLOG" || true)
CHART_SETS="--set agent.runtimeCaps.enabled=true --set agent.runtimeCaps.mpsPipeDirectory=$CUDA_MPS_PIPE_DIRECTORY --set admissionCaps.enabled=false ${EXTRA_SETS:-}"
machine_and_chart
registered() { [ "$(grep -c 'registered as \\"90-gpubudget\\"' "$CLOG" || true)" -gt "$1" ]; }
relay_pod() { kubectl get pods -n $NS -l app.kubernetes.io/component=runtime-caps-relay -o jsonpath='{.items[0].metadata.name}'; }
agent_connected() { kubectl logs -n $NS "$(relay_pod)" | grep -E 'the agent (dis)?connected' | tail -n1 | grep -q 'the agent connected'; }
STEP_TIMEOUT=60 wait_for "the relay registered with containerd as 90-gpubudget" registered "$REGS0"
STEP_TIMEOUT=60 wait_for "the agent connected to the relay" agent_connected
kubectl get mutatingwebhookconfigurations -o name | grep -q gpubudget && die "a mutating webhook of the release is registered (admissionCaps.enabled=false)"

say "1. who holds what (read from each process on the host)"
RPID=$(nri_task_pid $NS "$(relay_pod)")
for who in "relay $RPID" "agent $APID"; do
  read -r name pid <<<"$who"
  set -- "$name" "$pid"
  info "$1: host PID $2, uid $(awk '/^Uid:/ {print $2}' /proc/"$2"/status), CapEff $(awk '/^CapEff:/ {print $2}' /proc/"$2"/status), host PID namespace $([ "$(readlink /proc/"$2"/ns/pid)" = "$(readlink /proc/$$/ns/pid)" ] && echo yes || echo no), API token $([ -e /proc/"$2"/root/var/run/secrets/kubernetes.io/serviceaccount/token ] && echo yes || echo no), NRI socket $([ -S /proc/"$2"/root/var/run/nri-host/nri.sock ] && echo yes || echo no)"
done
[ "$(awk '/^CapEff:/ {print $2}' /proc/"$RPID"/status)" = 0000000000000000 ] || die "the relay holds capabilities"
[ "$(readlink /proc/"$RPID"/ns/pid)" != "$(readlink /proc/$$/ns/pid)" ] || die "the relay is in the host's PID namespace"
[ ! -e /proc/"$RPID"/root/var/run/secrets/kubernetes.io/serviceaccount/token ] || die "the relay has an API token"
[ -S /proc/"$RPID"/root/var/run/nri-host/nri.sock ] || die "the relay has no NRI socket"
[ "$(awk '/^Uid:/ {print $2}' /proc/"$APID"/status)" != 0 ] || die "the agent runs as root"
[ ! -S /proc/"$APID"/root/var/run/nri-host/nri.sock ] && [ ! -S /proc/"$APID"/root/var/run/nri/nri.sock ] || die "the agent can reach the NRI socket"

say "2. one budget taking each pod's declared share, caps on, no webhook: a KAI-shaped pod at gpu-fraction 0.25"
kubectl apply -f - <<YAML | sed 's/^/    /'
apiVersion: gpubudget.io/v1alpha1
kind: GpuMemoryBudget
metadata: {name: shares, namespace: $APP}
spec: {selector: {}, limit: 80Gi, share: {}, admissionCaps: Enabled, overLimitSeconds: 600}
YAML
UUID=$(nvidia-smi --query-gpu=uuid --format=csv,noheader | head -n1)
TOTAL_MIB=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -n1)
kubectl apply -f - >/dev/null <<YAML
apiVersion: v1
kind: ConfigMap
metadata: {name: kai-q-shared-gpu-0, namespace: $APP}
data: {NVIDIA_VISIBLE_DEVICES: "$UUID", GPU_PORTION: "0.25"}
YAML
sleep 2   # the agent's table holds the budget (its watch)
NB_TO=$(awk -v c="$CARD_GIB" 'BEGIN {printf "%d", c * 0.45}')
say "serve: a neighbour (no share: the budget's 80Gi) allocating 1 GiB every 0.5 s toward $NB_TO GiB"
POD_ENV='{name: NVIDIA_VISIBLE_DEVICES, value: "0"}' POD_LIMITS='cpu: 1' POD_SPEC='nodeName: gpu-node' \
  torch_pod serve serve stepper --step-mib 1024 --to-gib "$NB_TO" --period 0.5 --hold 600
say "kai-quarter: gpu-fraction 0.25, devices from the binder's ConfigMap, grows 1 GiB/s toward $(awk -v c="$CARD_GIB" 'BEGIN {printf "%d", c * 0.5}') GiB"
POD_META='annotations: {gpu-fraction: "0.25"}' POD_LIMITS='cpu: 1' \
  POD_ENV='{name: NVIDIA_VISIBLE_DEVICES, valueFrom: {configMapKeyRef: {name: kai-q-shared-gpu-0, key: NVIDIA_VISIBLE_DEVICES}}}' \
  POD_SPEC=$'schedulerName: kai-scheduler\n  nodeName: gpu-node' \
  torch_pod kai-quarter kai stepper --step-mib 1024 --to-gib "$(awk -v c="$CARD_GIB" 'BEGIN {printf "%d", c * 0.5}')" --period 1 --hold 600
SPEC_CAP=$(kubectl get pod -n $APP kai-quarter -o jsonpath='{.spec.containers[0].env[?(@.name=="CUDA_MPS_PINNED_DEVICE_MEM_LIMIT")].value}')
[ -z "$SPEC_CAP" ] || die "kai-quarter's spec carries a cap ($SPEC_CAP): something capped it at admission"
info "kai-quarter's spec: no CUDA_MPS_PINNED_DEVICE_MEM_LIMIT (webhook off; a fraction is the node's to size)"
pid_of() { # POD: the host PID of the pod's GPU process
  local uid p; uid=$(kubectl get pod -n $APP "$1" -o jsonpath='{.metadata.uid}')
  for p in $(gpu_pids | cut -d, -f1); do grep -q "pod$uid" /proc/"$p"/cgroup 2>/dev/null && { echo "$p"; return 0; }; done
  return 1
}
STEP_TIMEOUT=120 wait_for "kai-quarter's process holds GPU memory" pid_of kai-quarter
KPID=$(pid_of kai-quarter); SPID=$(pid_of serve)
KENV=$(tr '\0' '\n' < /proc/"$KPID"/environ | grep -E '^(CUDA_MPS_PINNED_DEVICE_MEM_LIMIT|NVIDIA_GPU_MEMORY_LIMIT|CUDA_MPS_PIPE_DIRECTORY|NVIDIA_VISIBLE_DEVICES)=' | paste -sd' ')
info "kai-quarter: host PID $KPID; its environment, as the runtime made it: $KENV"
CAP=$(tr '\0' '\n' < /proc/"$KPID"/environ | sed -n 's/^CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=\([0-9]*\)M$/\1/p')
[ -n "$CAP" ] || die "kai-quarter's process carries no runtime cap"
awk -v c="$CAP" -v t="$TOTAL_MIB" 'BEGIN {exit !(c <= t * 0.25 + 1 && c >= t * 0.25 - 64)}' \
  || die "kai-quarter's cap $CAP MiB is not 0.25 of the card's $TOTAL_MIB MiB"
info "figure: the runtime's cap ${CAP} MiB = 0.25 of the card's ${TOTAL_MIB} MiB (nvidia-smi's total; the agent's NVML total)"
STEP_TIMEOUT=30 wait_for "GpuMemoryCappedAtCreation on kai-quarter (told once the runtime showed the container made)" has_core_event $APP kai-quarter GpuMemoryCappedAtCreation
kubectl get events -n $APP --field-selector involvedObject.name=kai-quarter,reason=GpuMemoryCappedAtCreation -o jsonpath='{.items[0].message}{"\n"}' | cut -c1-300 | sed 's/^/    event: /'
PEAK=0
kai_done() {
  local m; m=$(gpu_pids | awk -F', *' -v p="$KPID" '$1 == p {print $2}')
  [ -n "$m" ] && [ "$m" -gt "$PEAK" ] && PEAK=$m
  kubectl logs -n $APP kai-quarter 2>/dev/null | grep -qi 'out of memory'
}
until kai_done; do
  kubectl get pod -n $APP kai-quarter -o jsonpath='{.status.phase}' | grep -qx Failed && break
  awk -v e="$(elapsed)" 'BEGIN {exit !(e > 600)}' && die "kai-quarter never met CUDA OOM"
  sleep 0.2
done
kubectl logs -n $APP kai-quarter | grep -qi 'out of memory' || die "kai-quarter stopped without CUDA OOM: $(kubectl logs -n $APP kai-quarter | tail -3)"
LAST=$(kubectl logs -n $APP kai-quarter | grep '"step"' | tail -n1 | python3 -c 'import json,sys; d=json.loads(sys.stdin.read()); print("%.1f GiB reserved" % (d["reserved"] / 2**30))')
info "figure: kai-quarter met CUDA out of memory at its share: last step held $LAST; its highest NVML figure $PEAK MiB (cap $CAP MiB; NVML counts its context too)"
kubectl logs -n $APP kai-quarter | grep -i 'out of memory' | head -n1 | cut -c1-220 | sed 's/^/    kai-quarter: /'
SERVE_STEPS=$(kubectl logs -n $APP serve | grep -c '"step"')
info "serve meanwhile: $SERVE_STEPS allocations of 1 GiB, $(kubectl logs -n $APP serve | grep -ci 'out of memory') CUDA OOM, GPU used $(used_gib) GiB"
kubectl logs -n $APP serve | grep -qi 'out of memory' && die "serve met CUDA OOM"
STEP_TIMEOUT=120 wait_for "serve reached its $NB_TO GiB" sh -c "kubectl logs -n $APP serve | grep -q '\"top\"'"
info "serve: $(kubectl logs -n $APP serve | grep -c '"step"') allocations, 0 CUDA OOM; environment $(tr '\0' '\n' < /proc/"$SPID"/environ | grep -E '^CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=' )"
kubectl get gpumemorybudgets -n $APP | sed 's/^/    /'
kubectl get pod -n $APP kai-quarter -o jsonpath='{.metadata.annotations.gpubudget\.io/runtime-caps}{"\n"}' | sed 's/^/    kai-quarter gpubudget.io\/runtime-caps: /'
kubectl gpubudget why serve -n $APP 2>&1 | sed 's/^/    /'
events_table -n $APP
kubectl delete pod -n $APP kai-quarter serve --wait=true --timeout=60s >/dev/null

say "3. CRI CreateContainer: $BENCH_PODS pods x $BENCH_CONTAINERS GPU containers (NVIDIA_VISIBLE_DEVICES=0, busybox), with the relay, then with runtime caps off"
bench() { # PREFIX: the pods one after another, each Ready before the next
  local i j containers
  for i in $(seq 1 "$BENCH_PODS"); do
    containers=""
    for j in $(seq 1 "$BENCH_CONTAINERS"); do
      containers+="  - {name: c$j, image: local/busybox:1, imagePullPolicy: Never, command: [sleep, \"3600\"], env: [{name: NVIDIA_VISIBLE_DEVICES, value: \"0\"}]}"$'\n'
    done
    printf 'apiVersion: v1\nkind: Pod\nmetadata: {name: %s-%s, namespace: %s}\nspec:\n  nodeName: gpu-node\n  terminationGracePeriodSeconds: 0\n  containers:\n%s' \
      "$1" "$i" "$APP" "$containers" | kubectl apply -f - >/dev/null
    kubectl wait -n $APP --for=condition=Ready "pod/$1-$i" --timeout=120s >/dev/null || die "pod $1-$i not Ready"
  done
}
bench_ms() { # PREFIX: the CreateContainer durations of its containers (ms, one a line)
  local i sb=()
  for i in $(seq 1 "$BENCH_PODS"); do mapfile -t -O "${#sb[@]}" sb < <(nri_sandbox $APP "$1-$i"); done
  nri_create_ms "$CLOG" "${sb[@]}"
}
stats() { echo "n $(wc -l < "$1"), p50 $(nri_pct 0.5 < "$1") ms, p99 $(nri_pct 0.99 < "$1") ms, max $(nri_pct 1 < "$1") ms"; }
W=$(mktemp -d)
sleep "${SETTLE:-20}"   # the GPU pods' teardown (their MPS clients, the MPS server) done before the clock runs
# throttled PID: "<nr_throttled> <throttled_usec>" of the process's cgroup (v2): a CPU limit holds it back this often.
throttled() { awk '$1 == "nr_throttled" {n = $2} $1 == "throttled_usec" {u = $2} END {print n + 0, u + 0}' "/sys/fs/cgroup$(cut -d: -f3 /proc/"$1"/cgroup | head -n1)/cpu.stat" 2>/dev/null; }
RPID=$(nri_task_pid $NS "$(relay_pod)"); APID=$(agent_pid)
read -r rt0 ru0 < <(throttled "$RPID"); read -r at0 au0 < <(throttled "$APID")
bench with; bench_ms with > "$W/with.ms"
read -r rt1 ru1 < <(throttled "$RPID"); read -r at1 au1 < <(throttled "$APID")
info "figure: CPU throttling over the benchmark (the chart's CPU limits): relay $((rt1 - rt0)) periods, $(((ru1 - ru0) / 1000)) ms; agent $((at1 - at0)) periods, $(((au1 - au0) / 1000)) ms"
capped=$(for i in $(seq 1 "$BENCH_PODS"); do nri_environ $APP "with-$i" c1; done | grep -c '^CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=' || true)
info "figure: with the relay: $(stats "$W/with.ms"); $capped of $BENCH_PODS first containers capped"
[ "$capped" = "$BENCH_PODS" ] || die "not every benchmark container was capped with the relay on"
kubectl delete pods -n $APP --all --wait=true --timeout=180s >/dev/null
helm upgrade gpubudget "$G"/gpubudget-*.tgz -n $NS --reuse-values --set agent.runtimeCaps.enabled=false --wait --timeout 180s >/dev/null || die "helm upgrade"
relay_gone() { [ -z "$(kubectl get pods -n $NS -l app.kubernetes.io/component=runtime-caps-relay -o name)" ]; }
STEP_TIMEOUT=60 wait_for "the relay gone" relay_gone
bench off; bench_ms off > "$W/off.ms"
info "figure: runtime caps off: $(stats "$W/off.ms")"
diff_ms() { awk -v a="$(nri_pct "$1" < "$W/with.ms")" -v b="$(nri_pct "$1" < "$W/off.ms")" 'BEGIN {printf "%.1f", a - b}'; }
ADD50=$(diff_ms 0.5); ADD99=$(diff_ms 0.99)
info "figure: added by runtime caps (relay + agent) to CRI CreateContainer: p50 ${ADD50} ms, p99 ${ADD99} ms ($(nproc) cores; goal p99 <= 5 ms)"
awk -v a="$ADD99" 'BEGIN {exit !(a <= 5)}' || die "p99 added ${ADD99} ms > 5 ms"
kubectl delete pods -n $APP --all --wait=true --timeout=180s >/dev/null

info "agent memory: $(grep -E 'VmHWM' /proc/"$(agent_pid)"/status | tr -s ' \n' ' ')"
helm uninstall gpubudget -n $NS --wait --timeout 120s >/dev/null || die "helm uninstall failed"
kubectl delete namespace $APP --wait=false >/dev/null
printf '\nPASS: runtime caps on a real kubelet with containerd 2.3.4 and NRI, an MPS daemon, no webhook: the relay alone holds the NRI socket; a KAI fraction 0.25 capped by the runtime at %s MiB met CUDA OOM at its share while its neighbour allocated %s GiB; CreateContainer p99 added %s ms (%s s)\n' "$CAP" "$SERVE_STEPS" "$ADD99" "$(elapsed)"
