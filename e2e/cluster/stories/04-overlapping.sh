# shellcheck shell=bash disable=SC2154,SC2034 # sourced by run.sh: its variables and e2e/cluster/lib.sh's are set
# Story 4, overlapping budgets: both budgets of namespace b say Overlapping=True, each matches its pod.

say "overlapping budgets: llm-b is matched by llm-inference (8Gi) and team-b-default (20Gi)"
wait_for "llm-inference Overlapping=True" condition_is "$NS_B" llm-inference Overlapping True
wait_for "team-b-default Overlapping=True" condition_is "$NS_B" team-b-default Overlapping True
wait_for "llm-inference MATCHED 1 (llm-b: the smaller limit wins)" status_is "$NS_B" llm-inference matchedPods 1
wait_for "team-b-default MATCHED 1 (other-b)" status_is "$NS_B" team-b-default matchedPods 1
kubectl get gmb -n "$NS_B" | sed 's/^/    /'
info "$(kubectl get gmb team-b-default -n "$NS_B" -o jsonpath='{.status.conditions[?(@.type=="Overlapping")].message}')"
