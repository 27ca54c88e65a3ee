# shellcheck shell=bash disable=SC2154,SC2034 # sourced by run.sh: its variables and e2e/cluster/lib.sh's are set
# Attribution through real cgroups (GPUBUDGET_E2E_HOST_PROC only): the sample names host PIDs of pod multi (a
# forking shell and a solo container), the agent finds pod and container in /proc/<pid>/cgroup; solo is killed and
# restarted under a new container id and PID, which is charged.

[ -n "$HOST_PROC" ] || return 0
say "attribution through real cgroups: the sample names host PIDs, the agent finds pod and container in /proc/<pid>/cgroup"
ADMIN_PORT=$(kubectl get pod "$AGENT_POD" -n "$NS" -o jsonpath='{.spec.containers[0].ports[0].containerPort}')
# pod_metric POD CONTAINER: the agent's gpubudget_pod_gpu_memory_bytes for that container of NS_C (bytes).
pod_metric() {
  kubectl get --raw "/api/v1/namespaces/$NS/pods/$AGENT_POD:$ADMIN_PORT/proxy/metrics" \
    | grep '^gpubudget_pod_gpu_memory_bytes{' | grep -F "namespace=\"$NS_C\"" | grep -F "pod=\"$1\"" \
    | grep -F "container=\"$2\"" | awk '{print $2}'
}
pod_metric_is() { [ "$(pod_metric "$1" "$2")" = "$3" ]; }
# node_usage POD: what the GpuNodeUsage of the pod's node says it holds (#34: usage is there, not in the record).
node_usage() {
  kubectl get gpunodeusage "$(kubectl get pod "$1" -n "$NS_C" -o jsonpath='{.spec.nodeName}')" -o json \
    | jq -r --arg ns "$NS_C" --arg p "$1" '.spec.pods[] | select(.namespace == $ns and .name == $p) | .usageBytes'
}
node_usage_is() { [ "$(node_usage "$1")" = "$2" ]; }
wait_for "multi measured 5Gi (forker's shell and two children 1Gi each, solo 2Gi) in its node's GpuNodeUsage" \
  node_usage_is multi 5368709120
annotation_is "$NS_C" multi budget multi-audit || die "multi's record names budget $(annotation "$NS_C" multi budget)"
wait_for "agent metric: multi/forker 3Gi (three processes, one cgroup)" pod_metric_is multi forker 3221225472
wait_for "agent metric: multi/solo 2Gi" pod_metric_is multi solo 2147483648
OLD_SOLO=$(host_pids "$NS_C" multi solo)
OLD_SOLO_ID=$(container_id "$NS_C" multi solo)
kill -KILL "$OLD_SOLO"
info "killed solo (host PID $OLD_SOLO): the kubelet restarts the container under a new id"
solo_restarted() {
  [ "$(kubectl get pod multi -n "$NS_C" -o jsonpath='{.status.containerStatuses[?(@.name=="solo")].restartCount}')" -ge 1 ] \
    && [ -n "$(kubectl get pod multi -n "$NS_C" -o jsonpath='{.status.containerStatuses[?(@.name=="solo")].state.running}')" ]
}
wait_for "solo restarted (restartCount 1, running again)" solo_restarted
wait_for "the restarted solo has a process in its new cgroup" pid_count_is "$NS_C" multi solo 1
[ "$(container_id "$NS_C" multi solo)" != "$OLD_SOLO_ID" ] || die "solo kept its container id after the restart"
SOLO_BYTES=4Gi
write_sample 4 9Gi 45Gi
wait_for "multi measured 7Gi (the restarted solo's new PID charged 4Gi) in its node's GpuNodeUsage" node_usage_is multi 7516192768
wait_for "agent metric: multi/solo 4Gi (the new container, same name)" pod_metric_is multi solo 4294967296
pod_metric_is multi forker 3221225472 || die "forker's usage changed: $(pod_metric multi forker)"
info "multi: forker $(pod_metric multi forker), solo $(pod_metric multi solo) (new PID $(host_pids "$NS_C" multi solo), was $OLD_SOLO)"
