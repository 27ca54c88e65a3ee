#!/usr/bin/env bash
# ClusterGpuMemoryBudget (#23) against a real kube-apiserver (realk8s): the CRDs from crds/ and the chart's RBAC
# (helm template: ClusterRoles, bindings, ServiceAccounts), then
#   - a tenant (alice: `admin` of namespace cgmb-team by RoleBinding; bob: `edit` there), by impersonation
#     (`--as`), cannot create, edit, delete, nor even read a ClusterGpuMemoryBudget (a namespace's role grants
#     nothing on a cluster-scoped kind), nor relabel its namespace out of the budget's namespaceSelector;
#   - a cluster-wide viewer (carol: the built-in `view` ClusterRole by ClusterRoleBinding, which the chart's
#     budgets-view role aggregates into) can read it (`kubectl get cgmb`, the printer columns) and not write it;
#   - the agent's ServiceAccount can list and watch it and the namespaces, and not write them;
#   - the CRD's CEL rules and schema refuse bad specs, each with its message.
# No agent or operator runs.
#
#   KUBECONFIG=/tmp/realk8s/run/kubeconfig e2e/apiserver/cluster-budget-rbac.sh [RESULT_FILE]
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
NS=cgmb-team RELEASE=gpubudget-cgmb RELEASE_NS=gpubudget-cgmb
cleanup() {
  local rc=$?
  if [ "${GPUBUDGET_E2E_KEEP:-0}" != 1 ]; then
    kubectl delete namespace "$NS" "$RELEASE_NS" --wait=false --ignore-not-found >/dev/null 2>&1 || true
    kubectl delete clusterrolebinding cgmb-carol-view --ignore-not-found >/dev/null 2>&1 || true
    kubectl delete cgmb tenants --ignore-not-found >/dev/null 2>&1 || true
    "$HELM" template "$RELEASE" "$REPO/charts/gpubudget" -n "$RELEASE_NS" --kube-version 1.33.0 \
      | yq -y 'select(.kind == "ClusterRole" or .kind == "ClusterRoleBinding")' \
      | kubectl delete -f - --ignore-not-found >/dev/null 2>&1 || true
  fi
  exit "$rc"
}
trap cleanup EXIT
: > "$RESULT"
cgmb() { # cgmb NAME SPEC-FLOW: a ClusterGpuMemoryBudget manifest on stdin for `kubectl create -f -`
  printf 'apiVersion: gpubudget.io/v1alpha1\nkind: ClusterGpuMemoryBudget\nmetadata: {name: %s}\nspec: %s\n' "$1" "$2"
}

say "as the admin: the CRDs, the chart's RBAC, namespace $NS (tier=tenant), tenants alice (admin) and bob (edit), viewer carol" | tee -a "$RESULT"
info "$(date -u +%FT%TZ); real kube-apiserver $(kubectl version -o json | jq -r '.serverVersion.gitVersion') (realk8s), $(nproc)-core VM; gpubudget $(git -C "$REPO" rev-parse --short HEAD)" | tee -a "$RESULT"
kubectl delete namespace "$NS" --ignore-not-found --timeout=120s >/dev/null
kubectl create namespace "$RELEASE_NS" --dry-run=client -o yaml | kubectl apply -f - >/dev/null
apply_crd_and_chart "$RELEASE" "$RELEASE_NS" "ServiceAccount ClusterRole ClusterRoleBinding Role RoleBinding"
kubectl create namespace "$NS" >/dev/null
kubectl label namespace "$NS" gpubudget.io/tier=tenant >/dev/null
kubectl create rolebinding alice-admin -n "$NS" --clusterrole=admin --user=alice >/dev/null
kubectl create rolebinding bob-edit -n "$NS" --clusterrole=edit --user=bob >/dev/null
kubectl create clusterrolebinding cgmb-carol-view --clusterrole=view --user=carol >/dev/null
AGENT=system:serviceaccount:$RELEASE_NS:$RELEASE-agent
aggregated() { [ "$(kubectl auth can-i list clustergpumemorybudgets.gpubudget.io --as=carol)" = yes ]; }
wait_for "view to aggregate the chart's budgets-view rule (cgmb read)" aggregated | tee -a "$RESULT"
expect ok admin create -f - <<<"$(cgmb tenants '{namespaceSelector: {matchLabels: {gpubudget.io/tier: tenant}}, selector: {}, limit: 8Gi, request: 4Gi, overLimitSeconds: 30}')"
expect ok admin get cgmb

say "tenants: no write, no read of the cluster kind; no relabelling of their namespace" | tee -a "$RESULT"
for who in alice bob; do
  for verb in create update patch delete get list watch; do
    expect no "$who" auth can-i "$verb" clustergpumemorybudgets.gpubudget.io
  done
  expect denied "$who" create -f - <<<"$(cgmb "mine-$who" '{selector: {}, limit: 64Gi}')"
  expect denied "$who" patch cgmb tenants --type=merge -p '{"spec":{"limit":"64Gi"}}'
  expect denied "$who" patch cgmb tenants --type=merge -p '{"spec":{"action":"Warn"}}'
  expect denied "$who" delete cgmb tenants
  expect denied "$who" get cgmb tenants
  expect denied "$who" label namespace "$NS" gpubudget.io/tier-
done
expect yes alice auth can-i get pods -n "$NS"
expect no alice auth can-i create gpumemorybudgets.gpubudget.io -n "$NS"

say "carol, view cluster-wide: reads the cluster budget (the printer columns), writes nothing" | tee -a "$RESULT"
expect ok carol get cgmb
expect ok carol get clustergpumemorybudgets -o wide
expect denied carol patch cgmb tenants --type=merge -p '{"spec":{"limit":"64Gi"}}'
expect denied carol delete cgmb tenants
COLUMNS=$(kubectl get cgmb --as=carol | head -1 | tr -s ' ')
[ "$COLUMNS" = "NAME REQUEST LIMIT ACTION MATCHED OVER CAPPED EVICTED AGE" ] || die "columns: $COLUMNS"
info "columns: $COLUMNS" | tee -a "$RESULT"

say "the agent's ServiceAccount: list and watch cluster budgets and namespaces, nothing more" | tee -a "$RESULT"
for verb in list watch; do
  expect yes "$AGENT" auth can-i "$verb" clustergpumemorybudgets.gpubudget.io
  expect yes "$AGENT" auth can-i "$verb" namespaces
done
for verb in create update patch delete; do
  expect no "$AGENT" auth can-i "$verb" clustergpumemorybudgets.gpubudget.io
  expect no "$AGENT" auth can-i "$verb" namespaces
done

say "the CRD's rules refuse bad specs (the same CEL rules as GpuMemoryBudget, and namespaceSelector's)" | tee -a "$RESULT"
for spec in \
  '{selector: {}, limit: 1Gi, request: 2Gi}' \
  '{selector: {}, limit: "0"}' \
  '{selector: {}, limit: 8 GiB}' \
  '{selector: {}, limit: 1Gi, warnAtPercent: 0}' \
  '{selector: {}, limit: 1Gi, overLimitSeconds: -1}' \
  '{selector: {}, limit: 1Gi, evictionGracePeriodSeconds: 0}' \
  '{selector: {}, limit: 1Gi, action: Kill}' \
  '{namespaceSelector: {matchExpressions: [{key: tier, operator: Equals, values: [x]}]}, selector: {}, limit: 1Gi}' \
  '{namespaceSelector: {matchExpressions: [{key: tier, operator: In}]}, selector: {}, limit: 1Gi}' \
  '{limit: 1Gi}'; do
  expect invalid admin create -f - <<<"$(cgmb bad "$spec")"
done
expect ok admin explain cgmb.spec.namespaceSelector

say "PASS: tenants (admin, edit of a namespace) cannot create, edit, delete or read a ClusterGpuMemoryBudget nor relabel their namespace; a cluster-wide viewer reads it; the agent lists and watches; bad specs are refused ($((SECONDS - START)) s)" | tee -a "$RESULT"
