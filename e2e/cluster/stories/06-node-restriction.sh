# shellcheck shell=bash disable=SC2154,SC2034 # sourced by run.sh: its variables and e2e/cluster/lib.sh's are set
# Story 5, node restriction (when the chart's nodeRestriction is on, the default): the agent's service account
# without its node-bound token can neither annotate a pod (the admission policy) nor evict one (the webhook). Sets AS
# when it ran (the PASS line names it then).
# needs: records

[ "$(kubectl get validatingadmissionpolicy -o name 2>/dev/null | grep -c "$RELEASE-agent-node-restriction" || true)" -gt 0 ] || return 0
say "node restriction: the agent's identity without its node-bound token can neither annotate nor evict"
if ! kubectl auth can-i impersonate serviceaccounts >/dev/null 2>&1; then
  info "skipped: you may not impersonate service accounts (kubectl auth can-i impersonate serviceaccounts)"
  return 0
fi
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
