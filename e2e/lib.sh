# Shell helpers shared by the end-to-end scripts (e2e/cluster/run.sh, e2e/apiserver/run.sh). Sourced, not run.
# The script sets START (its $SECONDS at start), STEP_TIMEOUT (seconds a wait_for may take) and POLL (seconds
# between two tries of wait_for) before calling them; kubectl talks to the cluster of KUBECONFIG.

say() { printf '\n=== [%3ds] %s\n' "$((SECONDS - START))" "$*"; }
info() { printf '    %s\n' "$*"; }
die() { printf 'FAIL: %s\n' "$*" >&2; exit 1; }

# wait_for DESCRIPTION COMMAND...: retries COMMAND (quietly) every POLL seconds until it succeeds or
# STEP_TIMEOUT passes.
wait_for() {
  local what=$1
  shift
  local deadline=$((SECONDS + STEP_TIMEOUT))
  until "$@" >/dev/null 2>&1; do
    [ "$SECONDS" -lt "$deadline" ] || die "timed out after ${STEP_TIMEOUT}s waiting for: $what"
    sleep "$POLL"
  done
  info "ok: $what"
}

# annotation NAMESPACE POD KEY: the pod's gpubudget.io/KEY annotation.
annotation() { kubectl get pod "$2" -n "$1" -o "jsonpath={.metadata.annotations.gpubudget\.io/$3}"; }
annotation_is() { [ "$(annotation "$1" "$2" "$3")" = "$4" ]; }
# status_field NAMESPACE BUDGET FIELD: a field of the budget's status.
status_field() { kubectl get gmb "$2" -n "$1" -o "jsonpath={.status.$3}"; }
status_is() { [ "$(status_field "$1" "$2" "$3")" = "$4" ]; }
# condition_is NAMESPACE BUDGET TYPE STATUS
condition_is() {
  [ "$(kubectl get gmb "$2" -n "$1" -o "jsonpath={.status.conditions[?(@.type==\"$3\")].status}")" = "$4" ]
}
uid() { kubectl get pod "$2" -n "$1" -o jsonpath='{.metadata.uid}'; }
