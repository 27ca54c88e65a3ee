# shellcheck shell=bash disable=SC2154,SC2034 # sourced by run.sh: its variables and e2e/cluster/lib.sh's are set
# Story 8, node drain (GPUBUDGET_E2E_DRAIN=1, on a one-node cluster; skipped with a message on more): `kubectl drain`
# of the agent's node while dry-run evictions check the webhook; nothing the drain evicts counts, the operator's
# PodDisruptionBudget keeps one replica until `--disable-eviction`, then the node is uncordoned (also by the exit
# handler). Sets DRAIN_PASSED when it ran.
# needs: agent-rollout (with GPUBUDGET_E2E_HOST_PROC it waits for the pod slow that story evicted)

NODES=$(kubectl get nodes -o name | wc -l)
[ "$DRAIN" = 1 ] || return 0
if [ "$NODES" != 1 ]; then
  say "node drain: skipped: the story needs a one-node cluster (every test pod and both operator replicas on the drained node); this one has $NODES"
  return 0
fi
[ -n "${API_SERVER:-}" ] || probe_setup # the operator rollout story sets the probes up, unless it did not run
DRAIN_NODE=$(kubectl get pod "$AGENT_POD" -n "$NS" -o jsonpath='{.spec.nodeName}')
say "node drain: kubectl drain $DRAIN_NODE (the agent's node); gpubudget's webhook never sees it, the agent stays, nothing it evicts counts as a budget's eviction"
wait_for "countdown Over under countdown-evict (9Gi of 8Gi; Evict, but only after 3600 s)" annotation_is "$NS_A" countdown state Over
# budget_counts: "ns/name=EVICTED/MATCHED/OVER ..." for every budget of this run.
budget_counts() {
  kubectl get gmb -A -o json | jq -r --arg p "gpubudget-e2e-$ID-" '[.items[] | select(.metadata.namespace | startswith($p))
    | "\(.metadata.namespace | ltrimstr($p))/\(.metadata.name)=\(.status.evictions // 0)/\(.status.matchedPods // 0)/\(.status.podsOverBudget // 0)"] | sort | join(" ")'
}
evictions_only() { echo "$1" | tr ' ' '\n' | cut -d/ -f1-2 | paste -sd' ' -; }
[ -z "$HOST_PROC" ] || wait_for "slow gone (evicted in the agent rollout story, 90 s grace)" pod_gone "$NS_C" slow
COUNTS_BEFORE=$(budget_counts)
AGENT_BEFORE=$(agent_on "$DRAIN_NODE")
AGENT_EVICTIONS_BEFORE=$(agent_evictions "$DRAIN_NODE")
info "budgets (EVICTED/MATCHED/OVER) before: $COUNTS_BEFORE"
agent_tokens "$DRAIN_NODE"
start_probes "$WORK/probes-drain" "$NS" "$AGENT_BEFORE"
sleep 1
DRAIN_AT=$SECONDS
DRAINED=$DRAIN_NODE
kubectl drain "$DRAIN_NODE" --ignore-daemonsets --force --timeout=25s > "$WORK/drain.log" 2>&1 &
DRAIN_PID=$!
test_pods_gone() { [ -z "$(kubectl get pods -n "$NS_A" -o name; kubectl get pods -n "$NS_B" -o name; [ -z "$HOST_PROC" ] || kubectl get pods -n "$NS_C" -o name)" ]; }
wait_for "every test pod evicted by the drain and gone" test_pods_gone
info "figure: kubectl drain to every test pod gone: $((SECONDS - DRAIN_AT)) s"
DRAIN_RC=0
wait "$DRAIN_PID" || DRAIN_RC=$?
info "kubectl drain exited $DRAIN_RC after $((SECONDS - DRAIN_AT)) s: $(grep -c 'evicted$' "$WORK/drain.log") pods evicted"
stop_probes
running_operators() { kubectl get pods -n "$NS" -l app.kubernetes.io/component=operator --field-selector status.phase=Running -o name | wc -l; }
# One node: the replacement of the first operator replica evicted cannot be scheduled (cordoned), so the
# PodDisruptionBudget (maxUnavailable 1) refuses the last one's eviction: the eviction check stays up.
[ "$DRAIN_RC" != 0 ] || die "kubectl drain of the only node completed: the operator's PodDisruptionBudget should have kept one replica"
grep -q "disruption budget" "$WORK/drain.log" || { sed 's/^/    /' "$WORK/drain.log"; die "kubectl drain failed, but not on the operator's PodDisruptionBudget"; }
[ "$(running_operators)" = 1 ] || die "expected one operator replica left running by its PodDisruptionBudget, found $(running_operators)"
info "the drain waited on the last operator replica (its PodDisruptionBudget): $(grep -m1 'disruption budget' "$WORK/drain.log" | cut -c1-160)"
[ "$(agent_on "$DRAIN_NODE")" = "$AGENT_BEFORE" ] || die "the agent pod $AGENT_BEFORE of $DRAIN_NODE was replaced by the drain"
[ -z "$(kubectl get pod "$AGENT_BEFORE" -n "$NS" -o jsonpath='{.metadata.deletionTimestamp}')" ] || die "the drain evicted the agent"
info "the agent ($AGENT_BEFORE, a DaemonSet pod: --ignore-daemonsets) stays on the cordoned node"
probe_check "$WORK/probes-drain" "during the drain (dry-run evictions of the agent's own pod)"
# Nothing of the drain counts: the operator (whichever replica leads) drops the pods from MATCHED and OVER,
# counts no eviction; the agent forgets them (no metric series left) and requested no eviction.
all_unmatched() { [ "$(budget_counts | tr ' ' '\n' | cut -d/ -f3- | sort -u)" = "0/0" ]; }
wait_for "every budget: MATCHED 0, OVER 0 (the drained pods are gone)" all_unmatched
COUNTS_AFTER=$(budget_counts)
[ "$(evictions_only "$COUNTS_AFTER")" = "$(evictions_only "$COUNTS_BEFORE")" ] \
  || die "the drain changed the budgets' eviction counts: $COUNTS_BEFORE -> $COUNTS_AFTER"
info "budgets after: $COUNTS_AFTER (evictions as before)"
no_pod_series() { ! agent_metrics "$DRAIN_NODE" | grep -E '^gpubudget_pod_' | grep -qF "namespace=\"gpubudget-e2e-$ID-"; }
wait_for "the agent's metrics hold no series of the drained pods" no_pod_series
[ "$(agent_evictions "$DRAIN_NODE")" = "$AGENT_EVICTIONS_BEFORE" ] \
  || die "the agent requested evictions during the drain: [$AGENT_EVICTIONS_BEFORE] -> [$(agent_evictions "$DRAIN_NODE")]"
has_core_event "$NS_A" countdown EvictingForGpuMemory && die "countdown (due in 3600 s) got an EvictingForGpuMemory event"
info "countdown (over its Evict budget when drained) is not counted; the agent's eviction requests unchanged [$AGENT_EVICTIONS_BEFORE]"
say "node drain, finished without the PodDisruptionBudget (--disable-eviction): no operator runs"
kubectl drain "$DRAIN_NODE" --ignore-daemonsets --force --disable-eviction --timeout=60s > "$WORK/drain2.log" 2>&1 \
  || { sed 's/^/    /' "$WORK/drain2.log"; die "kubectl drain --disable-eviction failed"; }
wait_for "no operator replica running" bash -c "[ \"\$(kubectl get pods -n $NS -l app.kubernetes.io/component=operator --field-selector status.phase=Running -o name)\" = '' ]"
LINE=$(probe_eviction "$BOUND_TOKEN" "$NS" "$AGENT_BEFORE")
[[ "$LINE" == 500\ *"failed calling webhook"* ]] || die "with no operator, the agent's eviction was not refused as failurePolicy Fail says: $LINE"
info "the agent's eviction, no operator running: refused (failurePolicy Fail): ${LINE#* * }"
printf '{"apiVersion":"policy/v1","kind":"Eviction","metadata":{"name":"%s","namespace":"%s"}}' "$AGENT_BEFORE" "$NS" > "$WORK/eviction.json"
kubectl create --raw "/api/v1/namespaces/$NS/pods/$AGENT_BEFORE/eviction?dryRun=All" -f "$WORK/eviction.json" >/dev/null \
  || die "with no operator, an administrator's eviction was refused"
info "an administrator's eviction (dry run) goes through: only the agent's evictions are sent to the webhook"
UNCORDON_AT=$SECONDS
kubectl uncordon "$DRAIN_NODE" >/dev/null
DRAINED=""
wait_for "the operator Deployment available again (2 replicas ready)" \
  bash -c "[ \"\$(kubectl get deploy $RELEASE-operator -n $NS -o jsonpath='{.status.readyReplicas}')\" = 2 ]"
answered() { [[ "$(probe_eviction "$BOUND_TOKEN" "$NS" "$AGENT_BEFORE")" == 201\ * ]]; }
wait_for "the agent's eviction allowed again" answered
info "figure: uncordon to the eviction check answering again with both replicas ready: $((SECONDS - UNCORDON_AT)) s"
DRAIN_PASSED=1
