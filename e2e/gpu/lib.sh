# shellcheck shell=bash
# The tier file of the real-GPU scripts with fake pods (accounting.sh, cap-in-force.sh, driver-limits.sh,
# kai-shares.sh, mps-caps.sh, multi.sh, pace.sh): e2e/lib.sh (sourced here: say, info, die, until_ok, wait_for, ...;
# POLL 0.1 s), then kubelet-shaped cgroups for fake pods, processes started inside them, and the cleanup. Source it
# from the repository root after `set -euo pipefail`; needs root and cgroup v2 (it makes the kubepods cgroups).
#
#   WORK=...; source e2e/gpu/lib.sh
#   pod team-a/llm-0 <uid>          # makes the pod's cgroup and its container's, appends it to $WORK/pods.yaml
#   start NAME team-a/llm-0 ENV... -- python3 ... # a process in that container's cgroup; its PID in PID_NAME
#   workloads_ready NAME...         # each has logged its "ready" line (60 s at most)
POLL=0.1
# shellcheck source=../lib.sh
. "$(dirname "${BASH_SOURCE[0]}")/../lib.sh"
CG=/sys/fs/cgroup
NODE=${NODE:-gpu-e2e}
PIDS=()
CGROUPS=()
declare -A UID_OF=()

cid() { printf '%s' "$1" | sha256sum | cut -c1-64; }

[ "$(id -u)" = 0 ] || die "run as root (cgroups are created under $CG)"
BURSTABLE=$CG/kubepods.slice/kubepods-burstable.slice
for d in $CG/kubepods.slice "$BURSTABLE"; do [ -d "$d" ] || { mkdir "$d"; CGROUPS+=("$d"); }; done

pod_dir() { local uid=${UID_OF[$1]}; echo "$BURSTABLE/kubepods-burstable-pod${uid//-/_}.slice"; }
scope() { echo "$(pod_dir "$1")/cri-containerd-$(cid "$1").scope"; }

# pod NAMESPACE/NAME UID [META] [SPEC] [CONTAINER]: the pod's cgroups and its object (one container, `main`) in
# $WORK/pods.yaml. META, SPEC, CONTAINER: more fields of its metadata, spec and container, flow-style
# (`annotations: {gpu-fraction: "0.5"}`), to shape it as a scheduler leaves it.
pod() {
  local key=$1
  UID_OF[$key]=$2
  for d in "$(pod_dir "$key")" "$(scope "$key")"; do [ -d "$d" ] || { mkdir "$d"; CGROUPS+=("$d"); }; done
  cat >> "$WORK/pods.yaml" <<YAML
---
apiVersion: v1
kind: Pod
metadata: {name: ${key#*/}, namespace: ${key%/*}, uid: $2, labels: {app: ${key#*/}}${3:+, $3}}
spec: {nodeName: $NODE, terminationGracePeriodSeconds: 30, ${4:+$4, }containers: [{name: main, image: pytorch${5:+, $5}}]}
status:
  phase: Running
  containerStatuses: [{name: main, containerID: 'containerd://$(cid "$key")', image: pytorch, imageID: pytorch, ready: true, restartCount: 0}]
YAML
}

# start NAME NAMESPACE/POD [VAR=value ...] -- COMMAND...: runs COMMAND in the pod's container cgroup with
# those variables; stdout to $WORK/NAME.jsonl; its PID in $PID_NAME.
start() {
  local name=$1 key=$2 vars=()
  shift 2
  while [ "$1" != "--" ]; do vars+=("$1"); shift; done
  shift
  # shellcheck disable=SC2016 # $$, $0 and $@ belong to the inner sh
  env "${vars[@]}" sh -c 'echo $$ > "$0/cgroup.procs" && exec "$@"' "$(scope "$key")" "$@" \
    > "$WORK/$name.jsonl" 2> "$WORK/$name.err" &
  PIDS+=($!)
  printf -v "PID_$name" '%s' "$!"
}

# workloads_ready NAME...: waits (60 s at most) until each has logged its "ready" line.
workloads_ready() {
  local name
  for name in "$@"; do
    until_ok 60 grep -q '"ready"' "$WORK/$name.jsonl" || die "$name never became ready: $(tail -3 "$WORK/$name.err")"
  done
}

stop_all() {
  for pid in "${PIDS[@]}"; do kill -9 "$pid" 2>/dev/null || true; done
  wait 2>/dev/null || true
  PIDS=()
}

# Kills what was started and removes the cgroups made (deepest first).
lib_cleanup() {
  set +e
  stop_all
  for dir in $(printf '%s\n' "${CGROUPS[@]}" | sort -r); do rmdir "$dir" 2>/dev/null; done
}
