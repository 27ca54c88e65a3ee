#!/usr/bin/env bash
# On the GPU machine, after the three up.sh calls (issue #51): a share is fixed when the pod is placed. Two
# KAI-shaped pods at gpu-fraction 0.5 under one share budget; after both are placed, the annotation of one of them
# (the "rewriter") is rewritten to gpu-fraction 1, as an identity the chart's admission policy lets through would
# (values.yaml turns the policy off here: this is the agent's own defence, the policy's test is
# shares_tenant_on_a_real_api_server, e2e/tests/apiserver/shares_tenant.rs). Then the rewriter grows past half the card.
#   - the agent keeps the share it first resolved: GpuMemoryShareChangeIgnored on the rewriter, its record still
#     "KAI gpu-fraction 0.5 of <card>";
#   - the rewriter goes Over at its placed share and is evicted overLimitSeconds (10 s) later;
#   - the neighbour, holding half the card less 30 GiB and allocating 3 GiB more every 2 s, never meets CUDA OOM.
# Sizes come from the card. Prints PASS or FAIL: <what>; every figure is a wall-clock reading on that machine.
#   bash e2e/gpu-node/shares-rewrite.sh
set -uo pipefail
# shellcheck source=e2e/gpu-node/lib.sh
source "$(dirname "$0")/lib.sh"
machine_and_chart
HALF=$(awk -v c="$CARD_GIB" 'BEGIN {printf "%.1f", c / 2}')
BASE=$(awk -v h="$HALF" 'BEGIN {printf "%d", h - 30}')
TO=$(awk -v h="$HALF" 'BEGIN {printf "%d", h + 15}')
info "card $CARD_GIB GiB: each pod's share 0.5 = $HALF GiB; neighbour $BASE GiB + 3 GiB jumps; rewriter grows 1 GiB/s toward $TO GiB"

say "one budget for every pod of the namespace: each pod's limit (and request) is its declared share"
kubectl apply -f - <<YAML | sed 's/^/    /'
apiVersion: gpubudget.io/v1alpha1
kind: GpuMemoryBudget
metadata: {name: shares, namespace: $APP}
spec:
  selector: {}
  limit: 200Gi
  share: {}
  overLimitSeconds: 10
YAML

rm -f /tmp/go-rewriter
say "neighbour and rewriter: gpu-fraction 0.5 each, bound by nodeName as KAI's binder binds"
POD_META='annotations: {gpu-fraction: "0.5"}' POD_LIMITS='cpu: 1' POD_SPEC=$'schedulerName: kai-scheduler\n  nodeName: gpu-node' \
  torch_pod neighbour kai crosser --base-gib "$BASE" --jump-gib 3 --cycles 100000 --hold 1
POD_META='annotations: {gpu-fraction: "0.5"}' POD_LIMITS='cpu: 1' POD_SPEC=$'schedulerName: kai-scheduler\n  nodeName: gpu-node' \
  torch_pod rewriter kai stepper --step-mib 1024 --to-gib "$TO" --period 1 --hold 600 --go /tmp/go-rewriter
STEP_TIMEOUT=120 wait_for "the neighbour holds $BASE GiB and jumps 3 GiB" sh -c "kubectl logs -n $APP neighbour | grep -q '\"up\"'"
share_of() { kubectl get pod -n $APP "$1" -o jsonpath='{.metadata.annotations.gpubudget\.io/share}'; }
STEP_TIMEOUT=120 wait_for "the rewriter's record holds its placed share" sh -c "kubectl get pod -n $APP rewriter -o jsonpath='{.metadata.annotations.gpubudget\.io/share}' | grep -q 'gpu-fraction 0.5'"
info "rewriter's gpubudget.io/share: $(share_of rewriter)"

say "the rewrite: gpu-fraction 1 on the placed rewriter (a tenant would be refused by the chart's policy; here it is off)"
kubectl annotate pod -n $APP rewriter gpu-fraction=1 --overwrite | sed 's/^/    /'
STEP_TIMEOUT=60 wait_for "GpuMemoryShareChangeIgnored on the rewriter" has_core_event $APP rewriter GpuMemoryShareChangeIgnored
kubectl get events -n $APP --field-selector involvedObject.name=rewriter,reason=GpuMemoryShareChangeIgnored -o jsonpath='{.items[0].message}{"\n"}' | cut -c1-300 | sed 's/^/    message: /'
sleep 2
info "rewriter's gpubudget.io/share after the rewrite: $(share_of rewriter)"
share_of rewriter | grep -q 'gpu-fraction 0.5' || die "the record no longer holds the placed share"

say "the rewriter grows past its placed share"
touch /tmp/go-rewriter
STEP_TIMEOUT=180 wait_for "GpuMemoryOverBudget on the rewriter" has_core_event $APP rewriter GpuMemoryOverBudget
OVER_AT=$(elapsed); info "GPU used now $(used_gib) GiB"
kubectl get events -n $APP --field-selector involvedObject.name=rewriter,reason=GpuMemoryOverBudget -o jsonpath='{.items[0].message}{"\n"}' \
  | tee /tmp/rewriter-over.txt | cut -c1-300 | sed 's/^/    message: /'
grep -q "gpu-fraction 0.5 of" /tmp/rewriter-over.txt || die "Over is not judged at the placed share"
kubectl gpubudget why rewriter -n $APP 2>&1 | sed 's/^/    /'
STEP_TIMEOUT=60 wait_for "EvictingForGpuMemory on the rewriter" has_core_event $APP rewriter EvictingForGpuMemory
info "figure: Over to the eviction request: $(awk -v a="$OVER_AT" -v b="$(elapsed)" 'BEGIN {printf "%.1f", b - a}') s (overLimitSeconds 10)"
kubectl get events -n $APP --field-selector involvedObject.name=rewriter,reason=EvictingForGpuMemory -o jsonpath='{.items[0].message}{"\n"}' | cut -c1-300 | sed 's/^/    message: /'
STEP_TIMEOUT=60 wait_for "the rewriter deleted" pod_gone $APP rewriter
sleep 5
PHASE=$(kubectl get pod -n $APP neighbour -o jsonpath='{.status.phase} restarts={.status.containerStatuses[0].restartCount}')
UPS=$(kubectl logs -n $APP neighbour | grep -c '"up"'); OOMS=$(kubectl logs -n $APP neighbour | grep -ci 'out of memory')
info "neighbour: $PHASE, $UPS allocations of 3 GiB, CUDA out of memory $OOMS times"
[ "$OOMS" = 0 ] && [ "${PHASE%% *}" = Running ] || die "the neighbour met CUDA OOM or stopped: $PHASE"
events_table -n $APP
kubectl get gpumemorybudgets -n $APP | sed 's/^/    /'
info "agent memory: $(grep -E 'VmHWM|VmRSS' /proc/"$APID"/status | tr -s ' \n' ' ')"
helm uninstall gpubudget -n $NS --wait --timeout 120s >/dev/null || die "helm uninstall failed"
kubectl delete namespace $APP --wait=false >/dev/null
printf '\nPASS: a KAI share rewritten after placement was kept at its placed 0.5; the rewriter was Over and evicted at it, the neighbour never met CUDA OOM, on a real kubelet with a %s (%s s)\n' "$(nvidia-smi --query-gpu=name --format=csv,noheader)" "$(elapsed)"
