# Shell helpers shared by the end-to-end scripts (e2e/cluster/run.sh, e2e/apiserver/*.sh). Sourced, not run.
# The script sets START (its $SECONDS at start), STEP_TIMEOUT (seconds a wait_for may take) and POLL (seconds
# between two tries of wait_for) before calling them; kubectl talks to the cluster of KUBECONFIG. Sourcing it sets
# HELM (below).

# The helm binary: $HELM, else helm from PATH, else the one .ci/helm.sh installs (empty when none).
HELM=${HELM:-$(command -v helm || find /tmp/gpubudget-ci-cache/helm -type f -name helm 2>/dev/null | head -n1 || true)}

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

# apply_crd_and_chart RELEASE NAMESPACE KINDS: the CRD from crds/ (waited for until established), then the chart
# as `helm template` renders it for Kubernetes 1.33 into NAMESPACE, only the objects whose kind is one of KINDS
# (space-separated), applied. HELM is the helm binary; REPO the repository root.
apply_crd_and_chart() {
  kubectl apply -f "$REPO/crds/gpumemorybudgets.gpubudget.io.yaml" >/dev/null
  kubectl wait --for=condition=Established crd/gpumemorybudgets.gpubudget.io --timeout=60s >/dev/null
  "$HELM" template "$1" "$REPO/charts/gpubudget" -n "$2" --kube-version 1.33.0 \
    | yq -y --arg kinds "$3" 'select(.kind as $k | ($kinds | split(" ") | index($k)) != null)' \
    | kubectl apply -f - >/dev/null
}

# token_kubeconfig FILE USER TOKEN: the kubeconfig of KUBECONFIG written to FILE, with this bearer token as USER.
token_kubeconfig() {
  kubectl config view --raw --minify > "$1"
  KUBECONFIG=$1 kubectl config set-credentials "$2" --token="$3" >/dev/null
  KUBECONFIG=$1 kubectl config set-context --current --user="$2" >/dev/null
}
