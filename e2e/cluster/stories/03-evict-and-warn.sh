# shellcheck shell=bash disable=SC2154,SC2034 # sourced by run.sh: its variables and e2e/cluster/lib.sh's are set
# Stories 2 and 3, Evict and Warn, on one timeline (the same samples): usage rises near the limit, then over it;
# llm-evict (llm-inference: Evict) is evicted, trainer (training-audit: Warn) only gets events and stays Over.

say "Evict and Warn stories: usage rises to near the limit"
write_sample 2 7680Mi 35Gi
wait_for "GpuMemoryNearBudget on llm-evict (7.5Gi of 8Gi)" has_core_event "$NS_A" llm-evict GpuMemoryNearBudget
wait_for "GpuMemoryNearBudget on trainer (35Gi of 40Gi, warn at 80 %)" has_core_event "$NS_A" trainer GpuMemoryNearBudget
info "llm-evict: $(core_event_messages "$NS_A" llm-evict GpuMemoryNearBudget | tail -n1)"

say "usage goes over the limit"
[ -z "$HOST_PROC" ] || EVICT_CGROUP="pod$UID_EVICT/$(container_id "$NS_A" llm-evict main)"
write_sample 3 9Gi 45Gi
CROSSED_AT=$SECONDS
wait_for "GpuMemoryOverBudget on llm-evict (9Gi of 8Gi)" has_core_event "$NS_A" llm-evict GpuMemoryOverBudget
wait_for "GpuMemoryOverBudget on trainer (45Gi of 40Gi)" has_core_event "$NS_A" trainer GpuMemoryOverBudget
OVER_AT=$SECONDS
info "llm-evict: $(core_event_messages "$NS_A" llm-evict GpuMemoryOverBudget | tail -n1)"
core_event_messages "$NS_A" llm-evict GpuMemoryOverBudget | grep -q "llm-inference" \
  || die "the GpuMemoryOverBudget message does not name the budget llm-inference"

say "Evict story: after overLimitSeconds (10 s) the agent evicts llm-evict, with the budget's 30 s grace"
wait_for "EvictingForGpuMemory on llm-evict" has_core_event "$NS_A" llm-evict EvictingForGpuMemory
MSG=$(core_event_messages "$NS_A" llm-evict EvictingForGpuMemory | tail -n1)
info "llm-evict: $MSG"
[[ "$MSG" == *llm-inference* && "$MSG" == *8Gi* ]] || die "EvictingForGpuMemory message should name the budget and its 8Gi limit: $MSG"
wait_for "llm-evict evicted (terminating or gone)" pod_gone_or_terminating "$NS_A" llm-evict
if [ -n "$HOST_PROC" ]; then
  wait_for "llm-evict's container stopped (no host process left in its cgroup)" eval "! in_cgroup $EVICT_CGROUP"
  info "figure: sample over the limit written to llm-evict's container stopped: $((SECONDS - CROSSED_AT)) s (overLimitSeconds 10 s, the kubelet's ConfigMap refresh, the agent's sampling and the eviction included; polled every ${POLL} s)"
fi
wait_for "llm-inference status: EVICTED 1" status_is "$NS_A" llm-inference evictions 1
wait_for "llm-inference status: lastEviction names llm-evict" status_is "$NS_A" llm-inference lastEviction.pod llm-evict
kubectl get gmb -n "$NS_A" | sed 's/^/    /'

say "Warn story: trainer stays over 40Gi past overLimitSeconds (30 s), events only"
REMAINING=$((OVER_AT + 45 - SECONDS))
[ "$REMAINING" -le 0 ] || sleep "$REMAINING"
has_core_event "$NS_A" trainer EvictingForGpuMemory && die "trainer (action Warn) got an EvictingForGpuMemory event"
[ -z "$(kubectl get pod trainer -n "$NS_A" -o jsonpath='{.metadata.deletionTimestamp}')" ] || die "trainer (action Warn) is being deleted"
annotation_is "$NS_A" trainer state Over || die "trainer's recorded state is $(annotation "$NS_A" trainer state), not Over"
wait_for "training-audit status: OVER 1" status_is "$NS_A" training-audit podsOverBudget 1
[ "$(status_field "$NS_A" training-audit evictions)" = 0 ] || [ -z "$(status_field "$NS_A" training-audit evictions)" ] \
  || die "training-audit counts evictions: $(status_field "$NS_A" training-audit evictions)"
info "trainer is still running, Over, never evicted"
