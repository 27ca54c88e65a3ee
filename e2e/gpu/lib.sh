# shellcheck shell=bash
# The tier file of every real-GPU script with fake pods (accounting.sh, cap-in-force.sh, driver-limits.sh,
# kai-shares.sh, mps-caps.sh, multi.sh, pace.sh, pressure.sh, run.sh): e2e/lib.sh (sourced here: say, info, die,
# until_ok, wait_for, ...; POLL 0.1 s), then kubelet-shaped cgroups for fake pods (containerd, systemd driver),
# processes started inside them, and the cleanup. Source it from the repository root after `set -euo pipefail`;
# needs root and cgroup v2 (it makes the kubepods cgroups).
#
#   WORK=...; source e2e/gpu/lib.sh
#   pod team-a/llm-0 <uid>          # makes the pod's cgroup and its containers', appends it to $WORK/pods.yaml
#   CONTAINERS="main sidecar" POD_GRACE=3600 pod ...   # more containers than `main`; another grace than 30 s
#   start NAME team-a/llm-0 ENV... -- python3 ... # a process in its `main` container's cgroup; PID in PID_NAME
#   scope team-a/llm-0 [CONTAINER]  # a container's cgroup directory (default `main`)
#   workloads_ready NAME...         # each has logged its "ready" line (60 s at most)
POLL=0.1
# shellcheck source=../lib.sh
. "$(dirname "${BASH_SOURCE[0]}")/../lib.sh"
CG=/sys/fs/cgroup
NODE=${NODE:-gpu-e2e}
PIDS=()
CGROUPS=()
declare -A UID_OF=()

# cid NAMESPACE/POD/CONTAINER: the container's ID, as containerd's 64 hex digits (a hash of the name).
cid() { printf '%s' "$1" | sha256sum | cut -c1-64; }

[ "$(id -u)" = 0 ] || die "run as root (cgroups are created under $CG)"
[ "$(stat -fc %T $CG)" = cgroup2fs ] || die "cgroup v2 is needed at $CG"
BURSTABLE=$CG/kubepods.slice/kubepods-burstable.slice
for d in $CG/kubepods.slice "$BURSTABLE"; do [ -d "$d" ] || { mkdir "$d"; CGROUPS+=("$d"); }; done

pod_dir() { local uid=${UID_OF[$1]}; echo "$BURSTABLE/kubepods-burstable-pod${uid//-/_}.slice"; }
scope() { echo "$(pod_dir "$1")/cri-containerd-$(cid "$1/${2:-main}").scope"; }

# pod NAMESPACE/NAME UID [META] [SPEC] [CONTAINER]: the pod's cgroups and its object in $WORK/pods.yaml, with the
# containers $CONTAINERS (default `main`) and terminationGracePeriodSeconds $POD_GRACE (default 30). META, SPEC,
# CONTAINER: more fields of its metadata, spec and each container, flow-style (`annotations: {gpu-fraction:
# "0.5"}`), to shape it as a scheduler leaves it.
pod() {
  local key=$1 c containers="" statuses=""
  UID_OF[$key]=$2
  [ -d "$(pod_dir "$key")" ] || { mkdir "$(pod_dir "$key")"; CGROUPS+=("$(pod_dir "$key")"); }
  for c in ${CONTAINERS:-main}; do
    [ -d "$(scope "$key" "$c")" ] || { mkdir "$(scope "$key" "$c")"; CGROUPS+=("$(scope "$key" "$c")"); }
    containers+="${containers:+, }{name: $c, image: pytorch${5:+, $5}}"
    statuses+="${statuses:+, }{name: $c, containerID: 'containerd://$(cid "$key/$c")', image: pytorch, imageID: pytorch, ready: true, restartCount: 0}"
  done
  cat >> "$WORK/pods.yaml" <<YAML
---
apiVersion: v1
kind: Pod
metadata: {name: ${key#*/}, namespace: ${key%/*}, uid: $2, labels: {app: ${key#*/}}${3:+, $3}}
spec: {nodeName: $NODE, terminationGracePeriodSeconds: ${POD_GRACE:-30}, ${4:+$4, }containers: [$containers]}
status:
  phase: Running
  containerStatuses: [$statuses]
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

# note TEXT...: the line printed and kept in $WORK/results.txt.
note() { printf '%s\n' "$*" | tee -a "$WORK/results.txt"; }
# smi_used PID: the MiB nvidia-smi shows that process using (nothing when it shows none).
smi_used() { nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader,nounits | awk -F', ' -v p="$1" '$1 == p {print $2}'; }

# Kills what was started and removes the cgroups made (deepest first).
lib_cleanup() {
  set +e
  stop_all
  for dir in $(printf '%s\n' "${CGROUPS[@]}" | sort -r); do rmdir "$dir" 2>/dev/null; done
}
