# shellcheck shell=bash
# The one shell library of the end-to-end scripts: every e2e script sources it (e2e/cluster/*.sh and stories/,
# e2e/gpu/*.sh, e2e/gpu-node/*.sh), directly or through its tier's file (e2e/cluster/lib.sh,
# e2e/cluster/nri-lib.sh, e2e/gpu/lib.sh, e2e/gpu-node/lib.sh), which only adds that tier's setup and helpers and
# redefines none of these (.ci/e2e-lib.sh checks it, and these functions). Sourced, not run. Bash is kept for
# machine setup (a node, containerd, a GPU); the stories on a real API server are Rust (e2e/tests/apiserver.rs).
#
# Output and failure, one format for every tier:
#   say MESSAGE...          a step: a blank line, then "=== [<seconds since the lib was sourced> s] MESSAGE"
#   info MESSAGE...         a line under it: "    [<seconds> s] MESSAGE"
#   die MESSAGE...          fatal: "FAIL: MESSAGE" on stderr, then the function ON_DIE names (if set: a tier's
#                           diagnosis), then exit 1
#   record_fail MESSAGE...  not fatal: "    FAIL: MESSAGE", and FAILED=1 with MESSAGE appended to FAILURES; the
#                           script goes on and exits nonzero at its end (failures_exit)
#   pass MESSAGE...         "    PASS: MESSAGE"
#   failures_exit           the end of a recording script: say "PASS (N s since START)", or the FAILURES listed,
#                           say "FAILED (N s)" and exit 1
#   elapsed                 the seconds since the lib was sourced (one decimal)
# Waiting, one signature:
#   wait_for DESCRIPTION COMMAND...   COMMAND retried (quietly) every POLL seconds until it succeeds (then info
#                           "ok: DESCRIPTION"), or die after STEP_TIMEOUT seconds. One wait with its own bound:
#                           STEP_TIMEOUT=30 wait_for ...
#   until_ok SECONDS COMMAND...       the same without a word: status 0 once COMMAND succeeded, 1 after SECONDS
# The script may set START (its $SECONDS at start; default: when the lib was sourced), STEP_TIMEOUT (default
# GPUBUDGET_E2E_STEP_TIMEOUT, else 60) and POLL (default 1) before or after sourcing it.
#
# A process's CPU: cpu_ns PID (ns over all its threads, from /proc: the GPU tier's cost and pace figures).
# The Kubernetes helpers below (pods, events, annotations, budgets' status) talk to the cluster of KUBECONFIG.
# Sourcing it sets HELM (below): $HELM, else helm in PATH, else the Helm .ci/helm.sh caches.
# RELEASE_DIR: where `cargo build --release` puts the binaries (CARGO_TARGET_DIR/release, else target/release).
# (Sourced again, as a tier's file and a script may both source it, it keeps what is set.)
E2E_T0=${E2E_T0:-$(date +%s.%N)}
START=${START:-$SECONDS}
STEP_TIMEOUT=${STEP_TIMEOUT:-${GPUBUDGET_E2E_STEP_TIMEOUT:-60}}
POLL=${POLL:-1}
FAILED=${FAILED:-0}
[ -n "${FAILURES+set}" ] || FAILURES=()
# Where `cargo build --release` puts this checkout's binaries: $CARGO_TARGET_DIR/release when set, else target/release.
RELEASE_DIR=${RELEASE_DIR:-${CARGO_TARGET_DIR:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)/target}/release}

elapsed() { awk -v a="$E2E_T0" -v b="$(date +%s.%N)" 'BEGIN {printf "%.1f", b - a}'; }
say() { printf '\n=== [%s s] %s\n' "$(elapsed)" "$*"; }
info() { printf '    [%s s] %s\n' "$(elapsed)" "$*"; }
die() {
  printf 'FAIL: %s\n' "$*" >&2
  [ -z "${ON_DIE:-}" ] || "$ON_DIE" || true
  exit 1
}
record_fail() { printf '    FAIL: %s\n' "$*"; FAILED=1; FAILURES+=("$*"); }
pass() { printf '    PASS: %s\n' "$*"; }
failures_exit() {
  if [ "$FAILED" = 0 ]; then say "PASS ($((SECONDS - START)) s)"; return 0; fi
  [ "${#FAILURES[@]}" = 0 ] || printf '    %s\n' "${FAILURES[@]}"
  say "FAILED ($((SECONDS - START)) s)"
  exit 1
}

until_ok() {
  local deadline=$((SECONDS + $1))
  shift
  until "$@" >/dev/null 2>&1; do
    [ "$SECONDS" -lt "$deadline" ] || return 1
    sleep "$POLL"
  done
}
wait_for() {
  local what=$1
  shift
  until_ok "$STEP_TIMEOUT" "$@" || die "timed out after ${STEP_TIMEOUT}s waiting for: $what"
  info "ok: $what"
}

# The helm binary: $HELM, else helm from PATH, else the one .ci/helm.sh installs (empty when none).
HELM=${HELM:-$(command -v helm || find /tmp/gpubudget-ci-cache/helm -type f -name helm 2>/dev/null | head -n1 || true)}

# annotation NAMESPACE POD KEY: the pod's gpubudget.io/KEY annotation.
annotation() { kubectl get pod "$2" -n "$1" -o "jsonpath={.metadata.annotations.gpubudget\.io/$3}"; }
annotation_is() { [ "$(annotation "$1" "$2" "$3")" = "$4" ]; }
# status_field NAMESPACE BUDGET FIELD: a field of the budget's status.
status_field() { kubectl get gmb "$2" -n "$1" -o "jsonpath={.status.$3}"; }
status_is() { [ "$(status_field "$1" "$2" "$3")" = "$4" ]; }
# condition_is NAMESPACE BUDGET TYPE STATUS: the budget's status condition TYPE has that status.
condition_is() {
  [ "$(kubectl get gmb "$2" -n "$1" -o "jsonpath={.status.conditions[?(@.type==\"$3\")].status}")" = "$4" ]
}
uid() { kubectl get pod "$2" -n "$1" -o jsonpath='{.metadata.uid}'; }

# since EPOCH: seconds (one decimal) from EPOCH (`date +%s.%N`, fractional) to now.
since() { awk -v a="$(date +%s.%N)" -v b="$1" 'BEGIN {printf "%.1f", a - b}'; }

# events NAMESPACE POD REASON: the pod's events.k8s.io/v1 Events with that reason, as a JSON array.
events() {
  kubectl get events.v1.events.k8s.io -n "$1" -o json \
    | jq -c --arg pod "$2" --arg reason "$3" '[.items[] | select(.regarding.name == $pod and .reason == $reason)]'
}
event_count() { events "$@" | jq 'length'; }
event_messages() { events "$@" | jq -r '.[].note'; }
has_event() { [ "$(event_count "$@")" -gt 0 ]; }
# core_event_messages NAMESPACE POD REASON: the messages of the pod's core v1 Events (by involvedObject) with that
# reason: the kubelet's and kubectl's events, and the agent's on a real cluster, are core ones.
core_event_messages() {
  kubectl get events -n "$1" --field-selector "involvedObject.kind=Pod,involvedObject.name=$2,reason=$3" \
    -o jsonpath='{range .items[*]}{.message}{"\n"}{end}'
}
has_core_event() { [ -n "$(core_event_messages "$@")" ]; }
# core_event_count NAMESPACE POD REASON: how many times the pod got that core v1 Event (a repeat counts as many).
core_event_count() {
  kubectl get events -n "$1" --field-selector "involvedObject.kind=Pod,involvedObject.name=$2,reason=$3" \
    -o jsonpath='{range .items[*]}{.count}{"\n"}{end}' | awk '{n += ($1 == "" ? 1 : $1)} END {print n + 0}'
}
terminating() { [ -n "$(kubectl get pod "$2" -n "$1" -o jsonpath='{.metadata.deletionTimestamp}')" ]; }
# pod_ready NAMESPACE POD [SECONDS]: kubectl wait for the pod's Ready condition (default 60 s); its status.
pod_ready() { kubectl -n "$1" wait --for=condition=Ready "pod/$2" --timeout="${3:-60}s" >/dev/null; }
# pod_gone NAMESPACE POD: the API server answers NotFound for it; pod_gone_or_terminating: that, or it is terminating.
pod_gone() { [[ "$(kubectl get pod "$2" -n "$1" -o name 2>&1)" == *NotFound* ]]; }
pod_gone_or_terminating() {
  local out
  out=$(kubectl get pod "$2" -n "$1" -o jsonpath='{.metadata.deletionTimestamp}' 2>&1) && [ -n "$out" ] && return 0
  [[ "$out" == *NotFound* ]]
}
# ready HOST:PORT: a binary's admin port answers /ready with 200.
ready() { curl -fsS "http://$1/ready" >/dev/null; }
# cpu_ns PID: the CPU time the process has used, in ns (the sum over its threads' /proc/PID/task/*/schedstat).
cpu_ns() { cat /proc/"$1"/task/*/schedstat 2>/dev/null | awk '{s += $1} END {print s + 0}'; }
