# shellcheck shell=bash disable=SC2154,SC2034 # sourced by run.sh: its variables and e2e/cluster/lib.sh's are set
# Story 6, operator rollout: `helm upgrade` rolls the two operator replicas while dry-run evictions as the agent
# check the eviction webhook answers throughout; roll, over its Evict budget just before, is evicted during the
# rollout at the first request and counted once by the new leader.

probe_setup
operator_pods() { kubectl get pods -n "$NS" -l app.kubernetes.io/component=operator -o jsonpath='{range .items[*]}{.metadata.name}{"\n"}{end}'; }
lease_holder() { kubectl get lease "$LEASE" -n "$NS" -o jsonpath='{.spec.holderIdentity}'; }

say "operator rollout: two replicas, helm upgrade with a changed operator value, while the agent's evictions are checked"
LEASE=$("$HELM" get values "$RELEASE" -n "$NS" -a -o json | jq -r '.operator.leaderElection.leaseName')
OLD_OPERATORS=$(operator_pods)
[ "$(echo "$OLD_OPERATORS" | wc -l)" = 2 ] || die "expected the chart's 2 operator replicas, found: $OLD_OPERATORS"
wait_for "an operator replica holds the Lease $LEASE" bash -c "kubectl get lease $LEASE -n $NS -o jsonpath='{.spec.holderIdentity}' | grep -qxF '$OLD_OPERATORS'"
OLD_HOLDER=$(lease_holder)
ROLL_NODE=$(kubectl get pod roll -n "$NS_A" -o jsonpath='{.spec.nodeName}')
TRAINER_NODE=$(kubectl get pod trainer -n "$NS_A" -o jsonpath='{.spec.nodeName}')
info "operator replicas: $(echo "$OLD_OPERATORS" | paste -sd' ' -), leader $OLD_HOLDER; webhook failurePolicy $(kubectl get validatingwebhookconfiguration "$RELEASE-agent-eviction" -o jsonpath='{.webhooks[0].failurePolicy}'), strategy $(kubectl get deploy "$RELEASE-operator" -n "$NS" -o jsonpath='{.spec.strategy.rollingUpdate}')"
agent_tokens "$TRAINER_NODE"
EVICTIONS_BEFORE=$(agent_evictions "$ROLL_NODE")
# roll goes over roll-evict (8Gi, Evict after 10 s) just before the rollout: the agent evicts it during it.
ROLL_BYTES=9Gi
write_sample 6 9Gi 45Gi
wait_for "GpuMemoryOverBudget on roll (9Gi of 8Gi, evicted 10 s later)" has_core_event "$NS_A" roll GpuMemoryOverBudget
start_probes "$WORK/probes-rollout" "$NS_A" trainer
sleep 4 # the upgrade takes about 5 s here: roll's eviction falls within it
ROLLOUT_AT=$SECONDS
ROLLOUT_WALL=$(date -u +%TZ)
"$HELM" upgrade "$RELEASE" "$CHART" -n "$NS" --reuse-values --set-string operator.podAnnotations.rollout=e2e \
  --wait --timeout "$((STEP_TIMEOUT))s" >/dev/null || die "helm upgrade (operator) did not become ready"
old_operators_gone() { ! operator_pods | grep -qxF "$OLD_OPERATORS"; }
wait_for "both old operator pods gone" old_operators_gone
ROLLOUT_S=$((SECONDS - ROLLOUT_AT))
GONE_WALL=$(date -u +%TZ)
sleep 5 # and a few more probes against the new replicas alone
stop_probes
NEW_OPERATORS=$(operator_pods)
info "helm upgrade (a changed operator.podAnnotations value): $(echo "$OLD_OPERATORS" | paste -sd' ' -) replaced by $(echo "$NEW_OPERATORS" | paste -sd' ' -) in ${ROLLOUT_S} s (upgrade to the old pods gone)"
probe_check "$WORK/probes-rollout" "during the operator rollout (one bound and one unbound dry-run eviction of trainer, back to back, from 4 s before the upgrade to 5 s after the old pods were gone)"
wait_for "roll evicted by the agent (terminating or gone)" pod_gone_or_terminating "$NS_A" roll
ROLL_EVENT=$(kubectl get events -n "$NS_A" --field-selector involvedObject.name=roll,reason=EvictingForGpuMemory -o json \
  | jq -r '.items[0] | (.eventTime // .firstTimestamp) | sub("^[^T]*T"; "") | sub("\\.[0-9]*"; "")')
info "roll: EvictingForGpuMemory at $ROLL_EVENT (helm upgrade started at $ROLLOUT_WALL, the old operator pods were gone at $GONE_WALL)"
wait_for "the Lease moved to a new replica" bash -c "kubectl get lease $LEASE -n $NS -o jsonpath='{.spec.holderIdentity}' | grep -qxF '$NEW_OPERATORS'"
info "leader: $OLD_HOLDER -> $(lease_holder)"
wait_for "roll-evict status: EVICTED 1, written by the new leader" status_is "$NS_A" roll-evict evictions 1
status_is "$NS_A" roll-evict lastEviction.pod roll || die "roll-evict's lastEviction names $(status_field "$NS_A" roll-evict lastEviction.pod)"
sleep 5
status_is "$NS_A" roll-evict evictions 1 || die "roll-evict counts $(status_field "$NS_A" roll-evict evictions) evictions of one pod"
has_core_event "$NS_A" roll GpuMemoryEvictionBlocked && die "the agent's eviction of roll was refused: $(core_event_messages "$NS_A" roll GpuMemoryEvictionBlocked)"
EVICTIONS_AFTER=$(agent_evictions "$ROLL_NODE")
info "agent's eviction requests by result: before [$EVICTIONS_BEFORE], after [$EVICTIONS_AFTER]"
before_accepted=$(echo "$EVICTIONS_BEFORE" | sed -n 's/.*accepted=\([0-9]*\).*/\1/p')
after_accepted=$(echo "$EVICTIONS_AFTER" | sed -n 's/.*accepted=\([0-9]*\).*/\1/p')
[ "$((after_accepted - ${before_accepted:-0}))" = 1 ] || die "the agent's accepted evictions went from ${before_accepted:-0} to $after_accepted (expected one more: roll)"
# shellcheck disable=SC2001 # a regular expression (digits only), which ${var//} cannot say
[ "$(echo "$EVICTIONS_BEFORE" | sed 's/accepted=[0-9]*//')" = "$(echo "$EVICTIONS_AFTER" | sed 's/accepted=[0-9]*//')" ] \
  || die "the agent's refused or failed evictions changed during the rollout: [$EVICTIONS_BEFORE] -> [$EVICTIONS_AFTER]"
info "roll evicted once, accepted at the first request, counted once (roll-evict EVICTED 1, lastEviction roll)"
