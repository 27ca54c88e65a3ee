# shellcheck shell=bash disable=SC2154,SC2034 # sourced by run.sh: its variables and e2e/cluster/lib.sh's are set
# The agent rollout (GPUBUDGET_E2E_HOST_PROC only): `helm upgrade` replaces the agent while the evicted pod slow is
# in its 90 s grace period: no second eviction, the record kept, slow-evict EVICTED 1. Sets AGENT_POD (the new agent).

[ -n "$HOST_PROC" ] || return 0
say "agent rollout while an evicted pod is in its grace period: no second eviction, no lost record"
SLOW_BYTES=9Gi
write_sample 5 9Gi 45Gi
wait_for "EvictingForGpuMemory on slow (9Gi of 8Gi, slow-evict: Evict, grace 90 s)" has_core_event "$NS_C" slow EvictingForGpuMemory
wait_for "slow terminating (sleep ignores SIGTERM: it stays for its 90 s grace)" pod_gone_or_terminating "$NS_C" slow
REQUESTED=$(annotation "$NS_C" slow eviction-requested-at)
STATE=$(annotation "$NS_C" slow state)
info "slow's record: state $STATE, eviction-requested-at $REQUESTED"
OLD_AGENT=$AGENT_POD
"$HELM" upgrade "$RELEASE" "$CHART" -n "$NS" --reuse-values --set-string agent.podAnnotations.rollout=e2e \
  --wait --timeout "$((STEP_TIMEOUT))s" >/dev/null || die "helm upgrade did not become ready"
AGENT_POD=$(kubectl get pods -n "$NS" -l app.kubernetes.io/component=agent -o jsonpath='{.items[0].metadata.name}')
[ "$AGENT_POD" != "$OLD_AGENT" ] || die "helm upgrade did not replace the agent pod $OLD_AGENT"
info "helm upgrade (a changed agent.podAnnotations value): agent $OLD_AGENT replaced by $AGENT_POD, ready"
[ -n "$(kubectl get pod slow -n "$NS_C" -o jsonpath='{.metadata.deletionTimestamp}' 2>/dev/null)" ] \
  || die "slow finished its grace period before the new agent was ready: the story did not test a rollout within it"
sleep 15 # the new agent samples slow (still over) several times
[ "$(core_event_count "$NS_C" slow EvictingForGpuMemory)" = 1 ] || die "slow got $(core_event_count "$NS_C" slow EvictingForGpuMemory) EvictingForGpuMemory events"
annotation_is "$NS_C" slow eviction-requested-at "$REQUESTED" || die "slow's eviction-requested-at changed: $(annotation "$NS_C" slow eviction-requested-at), was $REQUESTED"
annotation_is "$NS_C" slow state "$STATE" || die "slow's state changed: $(annotation "$NS_C" slow state), was $STATE"
status_is "$NS_C" slow-evict evictions 1 || die "slow-evict counts $(status_field "$NS_C" slow-evict evictions) evictions"
info "after the rollout: one EvictingForGpuMemory, the record kept (state $STATE, eviction-requested-at $REQUESTED), slow-evict EVICTED 1"
