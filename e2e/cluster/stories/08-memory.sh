# shellcheck shell=bash disable=SC2154,SC2034 # sourced by run.sh: its variables and e2e/cluster/lib.sh's are set
# Figures (GPUBUDGET_E2E_HOST_PROC only): the agent's and operator's memory from their pod cgroups against the
# chart's requests and limits.

[ -n "$HOST_PROC" ] || return 0
say "memory of the agent and operator pods (their cgroups, cgroup v1 memory controller) against the chart's requests and limits"
for comp in agent operator; do
  for pod in $(kubectl get pods -n "$NS" -l "app.kubernetes.io/component=$comp" -o jsonpath='{.items[*].metadata.name}'); do
    pid=$(host_pids "$NS" "$pod" "$comp" | head -n1)
    cg=/sys/fs/cgroup/memory$(awk -F: '$2 ~ /(^|,)memory(,|$)/ {print $3}' "$HOST_PROC/$pid/cgroup")
    [ -r "$cg/memory.stat" ] || { info "no cgroup v1 memory controller for $pod ($cg): not measured"; continue; }
    rss=$(awk '$1 == "total_rss" {print $2}' "$cg/memory.stat")
    peak=$(cat "$cg/memory.max_usage_in_bytes")
    usage=$(cat "$cg/memory.usage_in_bytes")
    vmrss=$(awk '/^VmRSS:/ {print $2}' "$HOST_PROC/$pid/status")
    res=$(kubectl get pod "$pod" -n "$NS" -o jsonpath="{.spec.containers[?(@.name==\"$comp\")].resources.requests.memory}/{.spec.containers[?(@.name==\"$comp\")].resources.limits.memory}")
    info "figure: $comp $pod: cgroup rss $((rss / 1048576)) MiB, usage (with page cache) $((usage / 1048576)) MiB, peak $((peak / 1048576)) MiB, process VmRSS $((vmrss / 1024)) MiB; request/limit $res"
  done
done
