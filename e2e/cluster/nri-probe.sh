#!/usr/bin/env bash
# Contract check of gpubudget-nri (nri/) against a real containerd 2 with NRI: the realk8s node tier started with
# REALK8S_CONTAINERD=2 (/work/shared/realk8s/README.md, "Opt-in: containerd 2"). Runs the nri-probe example as a
# plugin on /var/run/nri/nri.sock (root) and checks, with busybox pods on node n1:
#   1. adjust:   the probe's GPUBUDGET_NRI_PROBE=<container name> reaches the container's /proc/<pid>/environ;
#   2. timing:   containerd's CRI CreateContainer time (its log) with the probe and without any plugin;
#   3. refusal:  the probe refuses creation -> what the pod and its events show, then the probe goes away;
#   4. killed:   the probe is SIGKILLed -> containerd goes on creating containers (time to Ready);
#   5. restart:  containerd restarts under a running probe -> the probe reconnects (run_forever's backoff).
# Needs: the API server (up.sh) and the node (REALK8S_CONTAINERD=2 node-up.sh) up; cargo; root.
# Skips unless GPUBUDGET_E2E_NRI=1. Never stops the API server or the node (step 5 restarts containerd only).
set -euo pipefail
if [ "${GPUBUDGET_E2E_NRI:-0}" != 1 ]; then
  echo "nri-probe.sh: skipped (set GPUBUDGET_E2E_NRI=1; needs the realk8s node tier with REALK8S_CONTAINERD=2)"
  exit 0
fi
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
D=${REALK8S_DIR:-/tmp/realk8s}; N=$D/run/node
export KUBECONFIG=${KUBECONFIG:-$D/run/kubeconfig} CONTAINERD_SUPPRESS_DEPRECATION_WARNINGS=1
export PATH=$D/containerd2/bin:$D/bin:$PATH
SOCK=${NRI_SOCKET:-/var/run/nri/nri.sock}; PODS=${NRI_PROBE_PODS:-5}
WORK=$(mktemp -d /tmp/nri-probe.XXXXXX); NS=nri-probe-$$; PROBE=
# shellcheck source=nri-lib.sh
. "$ROOT/e2e/cluster/nri-lib.sh"

kubectl get --raw /readyz >/dev/null 2>&1 || die "no API server (eval \"\$(bash /work/shared/realk8s/up.sh)\")"
[ -S "$SOCK" ] || die "no NRI socket $SOCK (REALK8S_CONTAINERD=2 bash /work/shared/realk8s/node-up.sh)"
ctr version 2>/dev/null | awk '/^Server/ {s=1} s && /Version: *v2\./ {ok=1} END {exit !ok}' || die "containerd 2 not running"
say "building the probe"
(cd "$ROOT" && CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-/tmp/nri-target} cargo build -q -p gpubudget-nri --example nri-probe)
BIN=${CARGO_TARGET_DIR:-/tmp/nri-target}/debug/examples/nri-probe

cleanup() {
  [ -z "$PROBE" ] || kill "$PROBE" 2>/dev/null || true
  kubectl delete namespace "$NS" --wait=false >/dev/null 2>&1 || true
  say "work dir (probe log, containerd log copies): $WORK"
}
trap cleanup EXIT
kubectl create namespace "$NS" >/dev/null; : > "$WORK/probe.log"

registrations() { grep -c 'registered with the NRI runtime' "$WORK/probe.log" 2>/dev/null || true; }
probe_start() { # probe_start [VAR=value...]: start the probe, wait for its registration
  local before; before=$(registrations)
  env "$@" "$BIN" "$SOCK" >> "$WORK/probe.log" 2>&1 & PROBE=$!
  for _ in $(seq 1 100); do [ "$(registrations)" -gt "$before" ] && return; sleep 0.1; done
  die "the probe did not register (see $WORK/probe.log)"
}
probe_stop() { kill "-${1:-TERM}" "$PROBE"; wait "$PROBE" 2>/dev/null || true; PROBE=; }
pod() { # pod NAME: a busybox pod on n1
  kubectl apply -f - >/dev/null <<YAML
apiVersion: v1
kind: Pod
metadata: {name: $1, namespace: $NS}
spec:
  nodeName: ${REALK8S_NODE_NAME:-n1}
  terminationGracePeriodSeconds: 0
  containers:
  - {name: c, image: "local/busybox:1", imagePullPolicy: Never, command: [sleep, "3600"]}
YAML
}
environ() { nri_environ "$NS" "$1"; }   # environ POD: the container's environment, read on the host
sandbox() { nri_sandbox "$NS" "$1"; }   # the pod's sandbox id
create_ms() { nri_create_ms "$@"; }     # create_ms LOG SANDBOX_ID...: CRI CreateContainer durations (ms)
median() { nri_pct 0.5; }

say "1. adjust"
probe_start
pod adjusted && pod_ready "$NS" adjusted
if environ adjusted | grep -qx 'GPUBUDGET_NRI_PROBE=c'; then info "GPUBUDGET_NRI_PROBE=c is in the container's environ"
else record_fail "GPUBUDGET_NRI_PROBE missing from the container's environ"; fi

say "2. timing ($PODS pods with the probe, $PODS without)"
for i in $(seq 1 "$PODS"); do pod "with-$i"; pod_ready "$NS" "with-$i"; done
probe_stop
for i in $(seq 1 "$PODS"); do pod "without-$i"; pod_ready "$NS" "without-$i"; done
cp "$N/containerd.log" "$WORK/containerd-1.log"
with=$(for i in $(seq 1 "$PODS"); do create_ms "$WORK/containerd-1.log" "$(sandbox "with-$i")"; done | median)
without=$(for i in $(seq 1 "$PODS"); do create_ms "$WORK/containerd-1.log" "$(sandbox "without-$i")"; done | median)
probe_us=$(grep -o 'adjusted in [0-9]* µs' "$WORK/probe.log" | awk '{print $3}' | median)
info "CRI CreateContainer median: ${with} ms with the probe, ${without} ms without; probe handler median ${probe_us} µs"

say "3. refusal"
probe_start NRI_PROBE_REFUSE="gpubudget-probe refuses this container"
pod refused; sleep 20
kubectl -n "$NS" get pod refused -o jsonpath='{.status.containerStatuses[0].state}{"\n"}' | tee "$WORK/refused-state.json" >&2
kubectl -n "$NS" get events --field-selector involvedObject.name=refused \
  -o custom-columns=REASON:.reason,COUNT:.count,MESSAGE:.message --no-headers | tee "$WORK/refused-events.txt" >&2
grep -q 'gpubudget-probe refuses this container' "$WORK/refused-events.txt" || record_fail "the refusal reason is not in the pod's events"
refusals=$(grep -c 'refused in' "$WORK/probe.log" || true)
probe_stop; t0=$(date +%s.%N)
pod_ready "$NS" refused 120 && info "after the probe stopped the pod became Ready in $(echo "$(date +%s.%N) - $t0" | bc) s; probe refused $refusals creations"

say "4. probe killed (SIGKILL)"
probe_start; probe_stop KILL; t0=$(date +%s.%N)
pod after-kill
if pod_ready "$NS" after-kill 60; then info "a pod created after the kill was Ready in $(echo "$(date +%s.%N) - $t0" | bc) s"
  ! environ after-kill | grep -q GPUBUDGET_NRI_PROBE || record_fail "env set without a plugin?"
else record_fail "no container created after the plugin died"; fi

say "5. containerd restart under a running probe"
probe_start; before=$(registrations)
cp "$N/containerd.log" "$WORK/containerd-2.log"
kill "$(cat "$N/containerd.pid")"; t0=$(date +%s.%N)
while kill -0 "$(cat "$N/containerd.pid")" 2>/dev/null; do sleep 0.1; done
REALK8S_CONTAINERD=2 bash /work/shared/realk8s/node-up.sh >/dev/null 2>&1
for _ in $(seq 1 600); do [ "$(registrations)" -gt "$before" ] && break; sleep 0.1; done
if [ "$(registrations)" -gt "$before" ]; then
  info "the probe re-registered $(echo "$(date +%s.%N) - $t0" | bc) s after containerd was stopped"
else record_fail "the probe did not re-register within 60 s"; fi
if ! { pod after-restart && pod_ready "$NS" after-restart && environ after-restart | grep -qx 'GPUBUDGET_NRI_PROBE=c'; }; then
  record_fail "no adjustment after the containerd restart"
fi
grep -E 'connection|NRI|registered' "$WORK/probe.log" | tail -6 >&2
probe_stop
failures_exit
