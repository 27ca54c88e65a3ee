# shellcheck shell=bash disable=SC2154,SC2034 # sourced by run.sh: its variables and e2e/cluster/lib.sh's are set
# Declared shares: a HAMi pod (nvidia.com/gpumem: 10240), a device-plugin MPS replica, and two pods shaped as
# KAI-Scheduler leaves them (the gpu-fraction annotation, schedulerName
# kai-scheduler, devices from ConfigMaps, no nvidia.com/gpu; bound to the node as KAI's binder binds them), one
# budget with `share: {}` and no per-pod limit. The replayed GPU has 80Gi: kai-half's share is 40Gi, kai-quarter's
# 20Gi. kai-half goes over its share and is evicted, every message naming the share; kai-quarter, at 15Gi, is not.

say "declared shares: kai-half (gpu-fraction 0.5), kai-quarter (0.25) and hami (gpumem 10240) under one budget with share: {}"
kubectl create namespace "$NS_K" >/dev/null
NODE_K=$(kubectl get nodes -o jsonpath='{.items[0].metadata.name}')
for pod in kai-half:0.5 kai-quarter:0.25; do
  name=${pod%%:*}
  kubectl apply -f - >/dev/null <<YAML
apiVersion: v1
kind: ConfigMap
metadata: {name: $name-shared-gpu-0, namespace: $NS_K}
data: {NVIDIA_VISIBLE_DEVICES: GPU-e2e00000-0000-0000-0000-000000000000, GPU_PORTION: "${pod#*:}"}
---
apiVersion: v1
kind: ConfigMap
metadata: {name: $name-shared-gpu-0-evar, namespace: $NS_K}
YAML
  make_pod "$NS_K" "$name" runai-gpu-group=3c6e0b8a-1f2d-4c5e-8a9b-0d1e2f3a4b5c \
    "annotations: {gpu-fraction: \"${pod#*:}\", received-resource-type: Fraction}" \
    "schedulerName: kai-scheduler"$'\n'"nodeName: $NODE_K" \
    "env: [{name: NVIDIA_VISIBLE_DEVICES, valueFrom: {configMapKeyRef: {name: $name-shared-gpu-0, key: NVIDIA_VISIBLE_DEVICES}}}]"$'\n'"envFrom: [{configMapRef: {name: $name-shared-gpu-0-evar, optional: false}}]"
done
# A HAMi pod as its scheduler leaves it (common/tests/fixtures/shares/hami-gpumem.yaml): 10240 MiB of one GPU,
# bound by HAMi (the kubelet admits extended resources its node does not advertise).
make_pod "$NS_K" hami "" "annotations: {hami.io/vgpu-node: $NODE_K, hami.io/bind-phase: success}" \
  "schedulerName: hami-scheduler"$'\n'"nodeName: $NODE_K" "" 'nvidia.com/gpu: "1", nvidia.com/gpumem: "10240"'
kubectl wait --for=condition=Ready pod --all -n "$NS_K" --timeout="${STEP_TIMEOUT}s" >/dev/null \
  || die "the KAI-shaped pods in $NS_K did not become Ready"
apply_budget shares "$NS_K" '{selector: {}, limit: 80Gi, share: {}, action: Evict, overLimitSeconds: 10}'
KAI_HALF_BYTES=30Gi KAI_QUARTER_BYTES=15Gi HAMI_BYTES=8Gi
write_sample k1 9Gi 45Gi
wait_for "shares MATCHED 3" status_is "$NS_K" shares matchedPods 3
kubectl get gmb -n "$NS_K" | sed 's/^/    /'

say "kai-half goes to 44Gi, over its 40Gi share, hami to 12Gi, over its 10Gi (the budget's limit is 80Gi); kai-quarter stays at 15Gi"
KAI_HALF_BYTES=44Gi HAMI_BYTES=12Gi
write_sample k2 9Gi 45Gi
wait_for "GpuMemoryOverBudget on kai-half" has_core_event "$NS_K" kai-half GpuMemoryOverBudget
MSG=$(core_event_messages "$NS_K" kai-half GpuMemoryOverBudget | tail -n1)
info "kai-half: $MSG"
[[ "$MSG" == *"KAI gpu-fraction 0.5 of 80Gi = 40Gi"* ]] || die "the Over message does not name kai-half's share: $MSG"
wait_for "GpuMemoryOverBudget on hami" has_core_event "$NS_K" hami GpuMemoryOverBudget
MSG=$(core_event_messages "$NS_K" hami GpuMemoryOverBudget | tail -n1)
info "hami: $MSG"
[[ "$MSG" == *"HAMi gpumem 10240 MiB = 10Gi"* ]] || die "the Over message does not name hami's share: $MSG"
wait_for "EvictingForGpuMemory on kai-half (10 s over)" has_core_event "$NS_K" kai-half EvictingForGpuMemory
wait_for "EvictingForGpuMemory on hami" has_core_event "$NS_K" hami EvictingForGpuMemory
wait_for "kai-half evicted (terminating or gone)" pod_gone_or_terminating "$NS_K" kai-half
has_core_event "$NS_K" kai-quarter GpuMemoryOverBudget && die "kai-quarter (15Gi of its 20Gi share) went Over"
has_core_event "$NS_K" kai-quarter GpuMemoryNearBudget && die "kai-quarter (15Gi of 20Gi, warn at 90 %) went Near"
[ -z "$(kubectl get pod kai-quarter -n "$NS_K" -o jsonpath='{.metadata.deletionTimestamp}')" ] || die "kai-quarter is being deleted"
wait_for "hami evicted (terminating or gone)" pod_gone_or_terminating "$NS_K" hami
wait_for "shares status: EVICTED 2" status_is "$NS_K" shares evictions 2
kubectl get gmb -n "$NS_K" | sed 's/^/    /'
info "kai-quarter: Running, never Near or Over, at 15Gi of its 20Gi share"
KAI_HALF_BYTES="" KAI_QUARTER_BYTES="" HAMI_BYTES=""

say "MPS replicas: the node labelled as GPU feature discovery labels it when the device plugin shares by MPS (4 replicas)"
kubectl label node "$NODE_K" nvidia.com/gpu.sharing-strategy=mps nvidia.com/gpu.replicas=4 --overwrite >/dev/null
MPS_LABELLED=$NODE_K
# The agent reads its Node's labels when it starts (the sharing strategy changes only with the device plugin's
# configuration): restart it, as a device plugin reconfiguration would be followed by.
OLD_AGENT=$AGENT_POD
kubectl delete pod "$AGENT_POD" -n "$NS" --wait=true >/dev/null
agent_replaced() {
  local p
  p=$(kubectl get pods -n "$NS" -l app.kubernetes.io/component=agent -o jsonpath='{.items[0].metadata.name}')
  [ -n "$p" ] && [ "$p" != "$OLD_AGENT" ] && kubectl wait --for=condition=Ready "pod/$p" -n "$NS" --timeout=1s >/dev/null 2>&1
}
wait_for "the agent replaced, ready" agent_replaced
AGENT_POD=$(kubectl get pods -n "$NS" -l app.kubernetes.io/component=agent -o jsonpath='{.items[0].metadata.name}')
# A device-plugin MPS replica: nvidia.com/gpu: 1 on that node (bound, as the scheduler would).
make_pod "$NS_K" mps app=mps "" "nodeName: $NODE_K" "" 'nvidia.com/gpu: "1"'
kubectl wait --for=condition=Ready pod/mps -n "$NS_K" --timeout="${STEP_TIMEOUT}s" >/dev/null || die "the MPS-replica pod did not become Ready"
MPS_BYTES=22Gi
write_sample k3 9Gi 45Gi
wait_for "GpuMemoryOverBudget on mps (22Gi of its 20Gi replica)" has_core_event "$NS_K" mps GpuMemoryOverBudget
MSG=$(core_event_messages "$NS_K" mps GpuMemoryOverBudget | tail -n1)
info "mps: $MSG"
[[ "$MSG" == *"MPS replica of 4 per GPU of 80Gi = 20Gi"* ]] || die "the Over message does not name the replica's share: $MSG"
wait_for "mps evicted (terminating or gone)" pod_gone_or_terminating "$NS_K" mps
MPS_BYTES=""
kubectl label node "$NODE_K" nvidia.com/gpu.sharing-strategy- nvidia.com/gpu.replicas- >/dev/null
MPS_LABELLED=""
