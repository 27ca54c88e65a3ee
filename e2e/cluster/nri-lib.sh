# shellcheck shell=bash
# Helpers of the NRI checks on the realk8s node tier with containerd 2 (nri-probe.sh, runtime-caps.sh): sourced, not
# run. They read the node from the host: containerd 2's `ctr` (the caller puts /tmp/realk8s/containerd2/bin first in
# PATH and sets CONTAINERD_SUPPRESS_DEPRECATION_WARNINGS=1), /proc, and containerd's log; kubectl for pod status.
# Sources e2e/lib.sh (say, info, die, record_fail, wait_for, pod_ready, ...), so a script needs only this file.
# shellcheck source=../lib.sh
. "$(dirname "${BASH_SOURCE[0]}")/../lib.sh"

# nri_task_pid NAMESPACE POD [CONTAINER]: the host PID of the container's task (the pod's first container when none is
# named). Nothing (status 1) while the container has no id.
nri_task_pid() {
  local cid
  if [ -n "${3:-}" ]; then
    cid=$(kubectl -n "$1" get pod "$2" -o jsonpath="{.status.containerStatuses[?(@.name==\"$3\")].containerID}")
  else
    cid=$(kubectl -n "$1" get pod "$2" -o jsonpath='{.status.containerStatuses[0].containerID}')
  fi
  cid=${cid#containerd://}
  [ -n "$cid" ] || return 1
  ctr -n k8s.io task ls | awk -v c="$cid" '$1 == c {print $2}'
}
# nri_environ NAMESPACE POD [CONTAINER]: the container's environment as its process has it, read on the host
# (/proc/<pid>/environ), one KEY=value a line.
nri_environ() {
  local pid
  pid=$(nri_task_pid "$@") && [ -n "$pid" ] || return 1
  tr '\0' '\n' < "/proc/$pid/environ"
}
# nri_sandbox NAMESPACE POD: the ids of the pod's sandboxes (one, unless the pod was made again under its name).
nri_sandbox() {
  ctr -n k8s.io containers ls -q \
    "labels.\"io.cri-containerd.kind\"==sandbox,labels.\"io.kubernetes.pod.name\"==$2,labels.\"io.kubernetes.pod.namespace\"==$1"
}
# nri_create_ms LOG SANDBOX_ID...: CRI CreateContainer durations (ms, one a line) of the containers of those sandboxes,
# from containerd's log: from "CreateContainer within sandbox X for container name:N" to its "... returns container id"
# (paired by sandbox and container name, so a pod's several containers each count).
nri_create_ms() {
  python3 - "$@" <<'PY'
import re, sys, datetime
log, sandboxes = sys.argv[1], set(sys.argv[2:])
t = lambda l: datetime.datetime.fromisoformat(re.search(r'time="([^"]+)"', l).group(1)[:26])
start = {}
for line in open(log, errors="replace"):
    m = re.search(r'CreateContainer within sandbox \\"(\w+)\\" for (?:container )?(?:&ContainerMetadata\{)?name:\\?"?([\w.-]+)', line)
    if not m or m.group(1) not in sandboxes: continue
    key = m.groups()
    if 'returns container id' in line:
        if key in start: print(round((t(line) - start.pop(key)).total_seconds() * 1000, 1))
    elif 'returns' not in line and 'failed' not in line:
        start[key] = t(line)
PY
}
# nri_pct Q: the Q-quantile (nearest rank, 0 < Q <= 1) of the numbers on stdin; "n/a" when there are none.
nri_pct() { sort -n | awk -v q="$1" '{v[NR] = $1} END {if (!NR) {print "n/a"; exit} i = int(NR * q); if (i < NR * q) i++; if (i < 1) i = 1; print v[i]}'; }
