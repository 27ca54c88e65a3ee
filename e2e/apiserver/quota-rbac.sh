#!/usr/bin/env bash
# ClusterGpuMemoryQuota (#23 part 3, namespace totals) against a real kube-apiserver (realk8s): the CRDs from
# crds/ and the chart's RBAC (helm template: ClusterRoles, bindings, ServiceAccounts), then
#   - a tenant (alice: `admin` of namespace cgmq-team by RoleBinding; bob: `edit` there), by impersonation
#     (`--as`), cannot create, edit, delete or read a quota, nor write its status (to reset the period banked
#     there or drop the eviction under way);
#   - a cluster-wide viewer (carol: the built-in `view`, which the chart's budgets-view role aggregates into)
#     reads it (`kubectl get cgmq`, the printer columns) and writes nothing;
#   - the operator's ServiceAccount reads quotas, writes their status (a real status patch), evicts and deletes
#     pods, lists and watches namespaces, and cannot write a quota's spec;
#   - the CRD's rules (the budgets' CEL rules, shared) refuse bad specs, each with its message, and fields a quota
#     has not (a request) are refused as unknown.
# No agent or operator runs.
#
#   KUBECONFIG=/tmp/realk8s/run/kubeconfig e2e/apiserver/quota-rbac.sh [RESULT_FILE]
#
# Prints every command and its output (and writes them to RESULT_FILE when given); fails (exit 1) at the first
# answer that is not the expected one. GPUBUDGET_E2E_KEEP=1 keeps what it created.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
REPO=$(cd "$HERE/../.." && pwd)
[ -n "${KUBECONFIG:-}" ] || { echo "KUBECONFIG (the admin's) is not set" >&2; exit 1; }
# shellcheck source=../lib.sh
. "$REPO/e2e/lib.sh"
[ -n "$HELM" ] || die "no helm: run bash .ci/helm.sh once (it installs Helm 3.10.1 into /tmp/gpubudget-ci-cache)"
RESULT=${1:-/dev/null}
START=$SECONDS
STEP_TIMEOUT=30 POLL=1
NS=cgmq-team RELEASE=gpubudget-cgmq RELEASE_NS=gpubudget-cgmq
cleanup() {
  local rc=$?
  if [ "${GPUBUDGET_E2E_KEEP:-0}" != 1 ]; then
    kubectl delete namespace "$NS" "$RELEASE_NS" --wait=false --ignore-not-found >/dev/null 2>&1 || true
    kubectl delete clusterrolebinding cgmq-carol-view --ignore-not-found >/dev/null 2>&1 || true
    kubectl delete cgmq tenant-totals --ignore-not-found >/dev/null 2>&1 || true
    "$HELM" template "$RELEASE" "$REPO/charts/gpubudget" -n "$RELEASE_NS" --kube-version 1.33.0 \
      | yq -y 'select(.kind == "ClusterRole" or .kind == "ClusterRoleBinding")' \
      | kubectl delete -f - --ignore-not-found >/dev/null 2>&1 || true
  fi
  exit "$rc"
}
trap cleanup EXIT
: > "$RESULT"
cgmq() { # cgmq NAME SPEC-FLOW: a ClusterGpuMemoryQuota manifest on stdin for `kubectl create -f -`
  printf 'apiVersion: gpubudget.io/v1alpha1\nkind: ClusterGpuMemoryQuota\nmetadata: {name: %s}\nspec: %s\n' "$1" "$2"
}
# A status write as the operator makes it: server-side apply of /status (a PATCH, no GET), forcing ownership.
STATUS_APPLY=(apply --server-side --force-conflicts --field-manager=gpubudget-operator/quota --subresource=status -f -)
STATUS='apiVersion: gpubudget.io/v1alpha1
kind: ClusterGpuMemoryQuota
metadata: {name: tenant-totals}
status: {namespacesOver: 0, evictions: 0}'

say "as the admin: the CRDs, the chart's RBAC, namespace $NS (tier=tenant), tenants alice (admin) and bob (edit), viewer carol" | tee -a "$RESULT"
info "$(date -u +%FT%TZ); real kube-apiserver $(kubectl version -o json | jq -r '.serverVersion.gitVersion') (realk8s), $(nproc)-core VM; gpubudget $(git -C "$REPO" rev-parse --short HEAD)" | tee -a "$RESULT"
kubectl delete namespace "$NS" --ignore-not-found --timeout=120s >/dev/null
kubectl create namespace "$RELEASE_NS" --dry-run=client -o yaml | kubectl apply -f - >/dev/null
apply_crd_and_chart "$RELEASE" "$RELEASE_NS" "ServiceAccount ClusterRole ClusterRoleBinding Role RoleBinding"
kubectl create namespace "$NS" >/dev/null
kubectl label namespace "$NS" gpubudget.io/tier=tenant >/dev/null
kubectl create rolebinding alice-admin -n "$NS" --clusterrole=admin --user=alice >/dev/null
kubectl create rolebinding bob-edit -n "$NS" --clusterrole=edit --user=bob >/dev/null
kubectl create clusterrolebinding cgmq-carol-view --clusterrole=view --user=carol >/dev/null
OPERATOR=system:serviceaccount:$RELEASE_NS:$RELEASE-operator
aggregated() { [ "$(kubectl auth can-i list clustergpumemoryquotas.gpubudget.io --as=carol)" = yes ]; }
wait_for "view to aggregate the chart's budgets-view rule (cgmq read)" aggregated | tee -a "$RESULT"
expect ok admin create -f - <<<"$(cgmq tenant-totals '{namespaceSelector: {matchLabels: {gpubudget.io/tier: tenant}}, limit: 64Gi, overLimitSeconds: 60}')"
expect ok admin get cgmq

say "tenants: no write, no read of the quota or its status" | tee -a "$RESULT"
for who in alice bob; do
  for verb in create update patch delete get list watch; do
    expect no "$who" auth can-i "$verb" clustergpumemoryquotas.gpubudget.io
  done
  expect no "$who" auth can-i patch clustergpumemoryquotas.gpubudget.io --subresource=status
  expect denied "$who" create -f - <<<"$(cgmq "mine-$who" '{limit: 1Ti}')"
  expect denied "$who" patch cgmq tenant-totals --type=merge -p '{"spec":{"limit":"1Ti"}}'
  expect denied "$who" patch cgmq tenant-totals --type=merge -p '{"spec":{"action":"Warn"}}'
  expect denied "$who" "${STATUS_APPLY[@]}" <<<"$STATUS"
  expect denied "$who" delete cgmq tenant-totals
  expect denied "$who" get cgmq tenant-totals
  expect denied "$who" label namespace "$NS" gpubudget.io/tier-
done

say "carol, view cluster-wide: reads the quota (the printer columns), writes nothing" | tee -a "$RESULT"
expect ok carol get cgmq
expect denied carol patch cgmq tenant-totals --type=merge -p '{"spec":{"limit":"1Ti"}}'
expect denied carol "${STATUS_APPLY[@]}" <<<"$STATUS"
expect denied carol delete cgmq tenant-totals
COLUMNS=$(kubectl get cgmq --as=carol 2>/dev/null | sed -n 1p | tr -s ' ')
[ "$COLUMNS" = "NAME LIMIT ACTION NAMESPACES OVER EVICTED AGE" ] || die "columns: $COLUMNS"
info "columns: $COLUMNS" | tee -a "$RESULT"

say "the operator's ServiceAccount: reads quotas, writes their status, evicts; never writes a quota's spec" | tee -a "$RESULT"
for verb in get list watch; do
  expect yes "$OPERATOR" auth can-i "$verb" clustergpumemoryquotas.gpubudget.io
done
expect yes "$OPERATOR" auth can-i patch clustergpumemoryquotas.gpubudget.io --subresource=status
expect yes "$OPERATOR" auth can-i create pods --subresource=eviction -n "$NS"
expect yes "$OPERATOR" auth can-i delete pods -n "$NS"
expect yes "$OPERATOR" auth can-i list namespaces
expect yes "$OPERATOR" auth can-i watch namespaces
for verb in create update patch delete; do
  expect no "$OPERATOR" auth can-i "$verb" clustergpumemoryquotas.gpubudget.io
done
expect ok "$OPERATOR" "${STATUS_APPLY[@]}" <<<"$STATUS"
expect denied "$OPERATOR" patch cgmq tenant-totals --type=merge -p '{"spec":{"limit":"1Ti"}}'

say "the CRD's rules refuse bad specs (the budgets' CEL rules and namespaceSelector's, shared)" | tee -a "$RESULT"
for spec in \
  '{limit: "0"}' \
  '{limit: 8 GiB}' \
  '{limit: 1Gi, warnAtPercent: 0}' \
  '{limit: 1Gi, overLimitSeconds: -1}' \
  '{limit: 1Gi, evictionGracePeriodSeconds: 0}' \
  '{limit: 1Gi, blockedEvictionTimeoutSeconds: 90000}' \
  '{limit: 1Gi, action: Kill}' \
  '{namespaceSelector: {matchExpressions: [{key: tier, operator: Equals, values: [x]}]}, limit: 1Gi}' \
  '{namespaceSelector: {matchExpressions: [{key: tier, operator: In}]}, limit: 1Gi}' \
  '{selector: {matchExpressions: [{key: app, operator: Exists, values: [x]}]}, limit: 1Gi}' \
  '{selector: {}}'; do
  expect invalid admin create -f - <<<"$(cgmq bad "$spec")"
done
expect unknown admin create -f - <<<"$(cgmq bad '{limit: 1Gi, request: 1Gi}')"
expect ok admin explain cgmq.spec.limit

say "PASS: tenants (admin, edit of a namespace) cannot create, edit, delete or read a ClusterGpuMemoryQuota nor write its status; a cluster-wide viewer reads it; the operator writes its status and evicts, never its spec; bad specs are refused ($((SECONDS - START)) s)" | tee -a "$RESULT"
