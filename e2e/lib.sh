# shellcheck shell=bash
# The one shell library of the end-to-end scripts: every e2e script sources it (e2e/cluster/*.sh and stories/,
# e2e/apiserver/*.sh, e2e/gpu/*.sh, e2e/gpu-node/*.sh), directly or through its tier's file (e2e/cluster/lib.sh,
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
# The Kubernetes helpers below (the chart, pods, events, annotations, budgets' status) talk to the cluster of
# KUBECONFIG. Environment: GPUBUDGET_E2E_BIN (default target/release; built with `cargo build --release` when
# missing), HELM (default: helm in PATH, else the Helm .ci/helm.sh caches), GPUBUDGET_E2E_STEP_TIMEOUT,
# GPUBUDGET_E2E_KEEP=1 keeps the namespaces, nodes and processes' logs, REALK8S (default /work/shared/realk8s):
# where up.sh/down.sh are. Sourcing it sets HELM (below).
# (Sourced again, as a tier's file and a script may both source it, it keeps what is set.)
E2E_T0=${E2E_T0:-$(date +%s.%N)}
START=${START:-$SECONDS}
STEP_TIMEOUT=${STEP_TIMEOUT:-${GPUBUDGET_E2E_STEP_TIMEOUT:-60}}
POLL=${POLL:-1}
FAILED=${FAILED:-0}
[ -n "${FAILURES+set}" ] || FAILURES=()

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

# control_plane_or_skip WHAT BINARY...: exits 0 with a "skipped:" line unless GPUBUDGET_E2E_APISERVER=1 and a
# control plane answers (KUBECONFIG's, else one up.sh starts from REALK8S_DIR: STARTED_REALK8S=1, for the
# script's cleanup to stop it); then BIN (GPUBUDGET_E2E_BIN, default target/release) holds the release BINARYs
# (built when missing) and HELM is there. WHAT names the run in the skip line. Needs REPO and REALK8S.
control_plane_or_skip() {
  local what=$1 missing=()
  shift
  if [ "${GPUBUDGET_E2E_APISERVER:-0}" != 1 ]; then
    echo "skipped: $what on a real kube-apiserver runs with GPUBUDGET_E2E_APISERVER=1 (see the header of $0)"
    exit 0
  fi
  STARTED_REALK8S=0
  if [ -z "${KUBECONFIG:-}" ]; then
    if [ -n "${REALK8S_DIR:-}" ] && [ -x "$REALK8S_DIR/bin/kube-apiserver" ] && [ -f "$REALK8S/up.sh" ]; then
      eval "$(bash "$REALK8S/up.sh")"
      # shellcheck disable=SC2034 # read by the sourcing scripts' cleanup
      STARTED_REALK8S=1
    else
      echo "skipped: KUBECONFIG is not set, and REALK8S_DIR has no kube-apiserver built. To run $0: build one once"
      echo "  (bash $REALK8S/build.sh <git dir of a Kubernetes source snapshot>, ~8 min on 2 cores; $REALK8S/README.md),"
      echo "  then GPUBUDGET_E2E_APISERVER=1 REALK8S_DIR=/tmp/realk8s $0 (starts and stops it), or with one up:"
      echo "  GPUBUDGET_E2E_APISERVER=1 KUBECONFIG=/tmp/realk8s/run/kubeconfig $0"
      exit 0
    fi
  fi
  kubectl version --request-timeout=10s >/dev/null 2>&1 || { echo "skipped: kubectl version failed with KUBECONFIG=$KUBECONFIG"; exit 0; }
  BIN=${GPUBUDGET_E2E_BIN:-$REPO/target/release}
  local binary
  for binary in "$@"; do [ -x "$BIN/$binary" ] || missing+=(-p "$binary"); done
  [ "${#missing[@]}" = 0 ] || (cd "$REPO" && cargo build --release "${missing[@]}")
  # shellcheck disable=SC2015 # both tests must hold
  [ -n "$HELM" ] && [ -x "$HELM" ] || die "no helm (3.10 or newer): put it in PATH, set HELM, or run bash .ci/helm.sh once"
}

# annotation NAMESPACE POD KEY: the pod's gpubudget.io/KEY annotation.
annotation() { kubectl get pod "$2" -n "$1" -o "jsonpath={.metadata.annotations.gpubudget\.io/$3}"; }
annotation_is() { [ "$(annotation "$1" "$2" "$3")" = "$4" ]; }
# status_field NAMESPACE BUDGET FIELD: a field of the budget's status.
status_field() { kubectl get gmb "$2" -n "$1" -o "jsonpath={.status.$3}"; }
status_is() { [ "$(status_field "$1" "$2" "$3")" = "$4" ]; }
uid() { kubectl get pod "$2" -n "$1" -o jsonpath='{.metadata.uid}'; }

# apply_crd_and_chart RELEASE NAMESPACE KINDS [WEBHOOK CA_FILE]: the CRDs from crds/ (waited for until established),
# then the chart as `helm template` renders it for Kubernetes 1.33 into NAMESPACE, only the objects whose kind is one
# of KINDS (space-separated), applied. With WEBHOOK (HOST:PORT, the operator run on this machine) and CA_FILE, the
# webhook configurations among them are put in URL mode: https://WEBHOOK<the chart's path>, trusting CA_FILE
# (webhook_cert's ca.crt). HELM is the helm binary; REPO the repository root.
apply_crd_and_chart() {
  local ca=""
  [ -z "${5:-}" ] || ca=$(base64 -w0 < "$5")
  kubectl apply -f "$REPO/crds/" >/dev/null
  kubectl wait --for=condition=Established crd/gpumemorybudgets.gpubudget.io crd/clustergpumemorybudgets.gpubudget.io \
    crd/clustergpumemoryquotas.gpubudget.io crd/gpumemorybudgetmirrors.gpubudget.io \
    crd/clustergpumemorybudgetmirrors.gpubudget.io --timeout=60s >/dev/null
  # shellcheck disable=SC2016 # jq's variables
  "$HELM" template "$1" "$REPO/charts/gpubudget" -n "$2" --kube-version 1.33.0 \
    | yq -y --arg kinds "$3" --arg host "${4:-}" --arg ca "$ca" '
        select(.kind as $k | ($kinds | split(" ") | index($k)) != null)
        | if $host != "" and (.kind | endswith("WebhookConfiguration"))
          then .webhooks |= map(.clientConfig = {url: ("https://" + $host + .clientConfig.service.path), caBundle: $ca})
          else . end' \
    | kubectl apply -f - >/dev/null
}

# token_kubeconfig FILE USER TOKEN: the kubeconfig of KUBECONFIG written to FILE, with this bearer token as USER.
token_kubeconfig() {
  kubectl config view --raw --minify > "$1"
  KUBECONFIG=$1 kubectl config set-credentials "$2" --token="$3" >/dev/null
  KUBECONFIG=$1 kubectl config set-context --current --user="$2" >/dev/null
}

# since EPOCH: seconds (one decimal) from EPOCH (`date +%s.%N`, fractional) to now.
since() { awk -v a="$(date +%s.%N)" -v b="$1" 'BEGIN {printf "%.1f", a - b}'; }
# stop_process PID: SIGTERM, then wait (at most 25 s), then SIGKILL. Nothing when PID is empty or gone.
stop_process() {
  local pid=$1
  [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null || return 0
  kill -TERM "$pid"
  for _ in $(seq 1 50); do kill -0 "$pid" 2>/dev/null || return 0; sleep 0.5; done
  kill -KILL "$pid" 2>/dev/null || true
}

# events NAMESPACE POD REASON: the pod's events.k8s.io/v1 Events with that reason, as a JSON array.
events() {
  kubectl get events.v1.events.k8s.io -n "$1" -o json \
    | jq -c --arg pod "$2" --arg reason "$3" '[.items[] | select(.regarding.name == $pod and .reason == $reason)]'
}
event_count() { events "$@" | jq 'length'; }
# occurrences: every event counted with its series (a repeat aggregated by the recorder is a series count).
event_occurrences() { events "$@" | jq '[.[] | (.series.count // 1)] | add // 0'; }
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

# webhook_cert DIR: a CA (ca.crt, ca.key) and a serving certificate for 127.0.0.1 (tls.crt, tls.key) in DIR, for
# the operator's eviction webhook run on this machine (URL mode).
webhook_cert() {
  mkdir -p "$1"
  openssl req -x509 -newkey rsa:2048 -nodes -days 1 -subj "/CN=gpubudget-e2e-ca" -keyout "$1/ca.key" \
    -out "$1/ca.crt" 2>/dev/null
  openssl req -newkey rsa:2048 -nodes -subj "/CN=gpubudget-operator-webhook" -keyout "$1/tls.key" \
    -out "$1/tls.csr" 2>/dev/null
  printf 'subjectAltName=IP:127.0.0.1\nextendedKeyUsage=serverAuth\n' > "$1/ext"
  openssl x509 -req -in "$1/tls.csr" -CA "$1/ca.crt" -CAkey "$1/ca.key" -CAcreateserial -days 1 \
    -extfile "$1/ext" -out "$1/tls.crt" 2>/dev/null
}

# fake_container_id NAMESPACE POD: the 64 hex digits the test's pods report as their container "main"'s ID, derived from
# NAMESPACE/POD (fake_process names the same one in the process's cgroup).
fake_container_id() { printf '%s' "$1/$2" | sha256sum | cut -c1-64; }

# pod_running NAMESPACE POD [START_TIME]: the kubelet's part for a pod the test created: status Running and Ready,
# its container "main" running with fake_container_id's ID, and status.startTime when START_TIME (RFC 3339) is given.
pod_running() {
  local started=""
  [ -z "${3:-}" ] || started="\"startTime\":\"$3\","
  kubectl patch pod "$2" -n "$1" --subresource=status --type=merge -p "{\"status\":{\"phase\":\"Running\", $started
    \"conditions\":[{\"type\":\"Ready\",\"status\":\"True\"}],
    \"containerStatuses\":[{\"name\":\"main\",\"containerID\":\"containerd://$(fake_container_id "$1" "$2")\",
    \"image\":\"registry.k8s.io/pause:3.10\",\"imageID\":\"x\",\"ready\":true,\"restartCount\":0,\"started\":true,
    \"state\":{\"running\":{}}}]}}" >/dev/null
}

# fake_process PROC_ROOT PID NAMESPACE POD: a process of the pod's container "main" in a fixture /proc, with the
# kubelet's cgroup (systemd driver, containerd, burstable QoS), as on a real node. The container ID is 64 hex
# digits derived from NAMESPACE/POD (the test's pods report the same one).
fake_process() {
  local dir=$1/$2 uid cid
  uid=$(uid "$3" "$4" | tr - _)
  cid=$(fake_container_id "$3" "$4")
  mkdir -p "$dir"
  printf '%s (python3) S 1 %s %s 0 -1 4194560 100 0 0 0 5 3 0 0 20 0 12 0 %s 1000000 500 18446744073709551615 1 1 0 0 0 0 0 16781312 17642 0 0 0 17 3 0 0 0 0 0\n' \
    "$2" "$2" "$2" "$((100000 + $2))" > "$dir/stat"
  echo python3 > "$dir/comm"
  echo "0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod$uid.slice/cri-containerd-$cid.scope" > "$dir/cgroup"
}

# expect OUTCOME WHO COMMAND...: runs `kubectl COMMAND` as WHO (admin: no --as); prints (and records) it and its
# answer (appended to $RESULT); OUTCOME `ok` wants exit status 0, `denied` a Forbidden answer, `invalid` an Invalid
# one (CEL/schema), `unknown` a refused unknown field (kubectl's strict field validation), `yes`/`no` what
# `auth can-i` prints.
expect() {
  local want=$1 who=$2 rc=0 out
  shift 2
  local as=()
  [ "$who" = admin ] || as=(--as="$who")
  # (kubectl's warning about a group-readable kubeconfig is left out of the record.)
  out=$(kubectl "${as[@]}" "$@" 2>&1 | grep -v '^WARNING: Kubernetes configuration file is') || rc=$?
  { printf '\n$ kubectl %s    # as %s, expect %s\n' "$*" "$who" "$want"; printf '%s\n' "$out"
    [ "$rc" = 0 ] || echo "(exit status $rc)"; } | tee -a "$RESULT"
  # shellcheck disable=SC2015 # die when either test fails
  case $want in
    ok) [ "$rc" = 0 ] || die "expected success: kubectl $* as $who" ;;
    denied) [ "$rc" != 0 ] && grep -q 'Forbidden\|forbidden' <<<"$out" || die "expected Forbidden: kubectl $* as $who" ;;
    invalid) [ "$rc" != 0 ] && grep -q 'Invalid value\|is invalid' <<<"$out" || die "expected Invalid: kubectl $* as $who" ;;
    unknown) [ "$rc" != 0 ] && grep -q 'unknown field' <<<"$out" || die "expected an unknown field: kubectl $* as $who" ;;
    no) [ "$(tail -n1 <<<"$out")" = no ] || die "expected no: kubectl $* as $who" ;;
    yes) [ "$(tail -n1 <<<"$out")" = yes ] || die "expected yes: kubectl $* as $who" ;;
  esac
}
