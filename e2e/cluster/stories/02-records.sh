# shellcheck shell=bash disable=SC2154,SC2034 # sourced by run.sh: its variables and e2e/cluster/lib.sh's are set
# Story 1, records: each pod gets the agent's annotations (state, usage, budget, node). Sets NODE_EVICT.

say "the agents record what they replay (state, usage, budget annotations)"
wait_for "llm-evict recorded Within at 6Gi under llm-inference" \
  bash -c "[ \"\$(kubectl get pod llm-evict -n $NS_A -o jsonpath='{.metadata.annotations.gpubudget\.io/state}/{.metadata.annotations.gpubudget\.io/usage-bytes}/{.metadata.annotations.gpubudget\.io/budget}')\" = Within/6442450944/llm-inference ]"
wait_for "trainer recorded under training-audit" annotation_is "$NS_A" trainer budget training-audit
wait_for "llm-b recorded under llm-inference (the smaller of two budgets)" annotation_is "$NS_B" llm-b budget llm-inference
wait_for "other-b recorded under team-b-default" annotation_is "$NS_B" other-b budget team-b-default
NODE_EVICT=$(kubectl get pod llm-evict -n "$NS_A" -o jsonpath='{.spec.nodeName}')
annotation_is "$NS_A" llm-evict node "$NODE_EVICT" || die "llm-evict's record names node $(annotation "$NS_A" llm-evict node), not $NODE_EVICT"
