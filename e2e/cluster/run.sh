#!/usr/bin/env bash
# shellcheck disable=SC2034 # the run's variables are read by the stories, sourced below
# gpubudget end to end on a real cluster (kind, k3d, or a real one): installs the chart with the agent
# replaying a sample file instead of NVML, runs the user's stories, and asserts on real Events and
# GpuMemoryBudget status. See e2e/cluster/README.md.
#
#   KUBECONFIG=~/.kube/config e2e/cluster/run.sh              # every story, in order
#   KUBECONFIG=~/.kube/config e2e/cluster/run.sh caps drain   # the setup, these stories and those they need
#
# Each story is a file of stories/ (NN-name.sh, run in the order of NN, sourced into this shell: a story leaves what
# later ones read in the run's variables); the helpers they share are in lib.sh (which sources ../lib.sh, the one
# shell library of the e2e scripts: say, info, die, wait_for, ...). A story named on the
# command line runs after stories/01-setup.sh and after the stories its "# needs:" line names.
#
# Without KUBECONFIG, or when `kubectl version` cannot reach the cluster, it prints how to run it and exits 0.
# Environment: GPUBUDGET_E2E_REGISTRY (default "gpubudget"), GPUBUDGET_E2E_TAG (default "dev"): the images
# are <registry>/gpubudget-agent:<tag> and <registry>/gpubudget-operator:<tag>. HELM (default: helm in PATH,
# else the Helm .ci/helm.sh caches). GPUBUDGET_E2E_PAUSE_IMAGE (default registry.k8s.io/pause:3.10): the
# image of the test pods. GPUBUDGET_E2E_STEP_TIMEOUT (default 180 s per wait). GPUBUDGET_E2E_KEEP=1 keeps
# the namespaces and release for inspection. GPUBUDGET_E2E_CHART: the chart to install (default charts/gpubudget;
# realk8s.sh passes the .tgz `helm package` makes, as a release ships it).
# GPUBUDGET_E2E_HOST_PROC=/proc: the script runs on the cluster's only node (e2e/cluster/realk8s.sh does): the
# replayed sample then names the host PIDs of the test pods' processes, found from their cgroups, and the
# attribution story (several containers, forked children, a restarted container) runs; it needs
# GPUBUDGET_E2E_SHELL_IMAGE (an image with /bin/sh and /bin/sleep).
# GPUBUDGET_E2E_DRAIN=1 also runs the node-drain story on a one-node cluster (skipped on more): `kubectl drain` of
# the node (every pod on it is evicted, the node is cordoned, then uncordoned): only for a test cluster
# (realk8s.sh sets it).
# GPUBUDGET_E2E_ADVERTISE_GPU=1: for the caps-at-admission story, the test node's status is patched to advertise
# the extended resources nvidia.com/gpu and nvidia.com/gpu.shared (one each; removed at the end): only for a test
# cluster without GPUs (realk8s.sh sets it). Without it the story runs only where a node already advertises both.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
REPO=$(cd "$HERE/../.." && pwd)
# shellcheck source=lib.sh
. "$HERE/lib.sh"

usage() {
  cat <<EOF
skipped: gpubudget e2e/cluster needs a reachable cluster: $1
  To run it (kind as an example; any cluster of Kubernetes 1.32 or newer works):
    kind create cluster --image kindest/node:v1.33.1
    docker build -f docker/agent.Dockerfile -t gpubudget/gpubudget-agent:dev .
    docker build -f docker/operator.Dockerfile -t gpubudget/gpubudget-operator:dev .
    kind load docker-image gpubudget/gpubudget-agent:dev gpubudget/gpubudget-operator:dev
    KUBECONFIG=\$HOME/.kube/config e2e/cluster/run.sh
EOF
}

# The stories: every one, or the setup, those named, and what they need; in the suite's order either way.
ALL_STORIES=()
for story in "$HERE"/stories/[0-9][0-9]-*.sh; do
  story=${story##*/}
  story=${story#[0-9][0-9]-}
  ALL_STORIES+=("${story%.sh}")
done
story_file() { local f=("$HERE"/stories/[0-9][0-9]-"$1".sh); [ ! -f "${f[0]}" ] || echo "${f[0]}"; }
declare -A WANTED=()
want() { # STORY: it and the stories its "# needs:" line names
  local need
  [ -n "$(story_file "$1")" ] || die "no story $1 (the stories: ${ALL_STORIES[*]})"
  # shellcheck disable=SC2013 # the needs are words
  for need in $(sed -n 's/^# needs: \([a-z -]*\).*/\1/p' "$(story_file "$1")"); do want "$need"; done
  WANTED[$1]=1
}
if [ "$#" = 0 ]; then
  for story in "${ALL_STORIES[@]}"; do WANTED[$story]=1; done
else
  want setup
  for story in "$@"; do want "$story"; done
fi

if [ -z "${KUBECONFIG:-}" ]; then
  usage "KUBECONFIG is not set"
  exit 0
fi
if ! kubectl version --request-timeout=10s >/dev/null 2>&1; then
  usage "kubectl version failed with KUBECONFIG=$KUBECONFIG"
  exit 0
fi

REGISTRY=${GPUBUDGET_E2E_REGISTRY:-gpubudget}
TAG=${GPUBUDGET_E2E_TAG:-dev}
PAUSE_IMAGE=${GPUBUDGET_E2E_PAUSE_IMAGE:-registry.k8s.io/pause:3.10}
STEP_TIMEOUT=${GPUBUDGET_E2E_STEP_TIMEOUT:-180}
HOST_PROC=${GPUBUDGET_E2E_HOST_PROC:-}
SHELL_IMAGE=${GPUBUDGET_E2E_SHELL_IMAGE:-}
DRAIN=${GPUBUDGET_E2E_DRAIN:-0}
ADVERTISE_GPU=${GPUBUDGET_E2E_ADVERTISE_GPU:-0}
[ -z "$HOST_PROC" ] || [ -n "$SHELL_IMAGE" ] || die "GPUBUDGET_E2E_HOST_PROC needs GPUBUDGET_E2E_SHELL_IMAGE"
# shellcheck disable=SC2015 # both tests must hold
[ -n "$HELM" ] && [ -x "$HELM" ] || die "no helm (3.10 or newer): put it in PATH, set HELM, or run bash .ci/helm.sh once"

ID=$(date +%s | tail -c 6)$RANDOM
ID=${ID:0:8}
NS=gpubudget-e2e-$ID           # the chart
NS_A=gpubudget-e2e-$ID-a       # the Evict and Warn stories (examples/llm-inference.yaml, examples/training-warn.yaml)
NS_B=gpubudget-e2e-$ID-b       # overlapping budgets (examples/namespace-wide.yaml + llm-inference)
NS_C=gpubudget-e2e-$ID-c       # attribution through real cgroups (GPUBUDGET_E2E_HOST_PROC only)
NS_D=gpubudget-e2e-$ID-d       # caps at admission
NS_K=gpubudget-e2e-$ID-k       # declared shares: pods shaped as KAI-Scheduler leaves them
RELEASE=gpubudget-e2e-$ID
AGENT_SA=$RELEASE-agent        # the chart's <fullname>-agent (the release name contains "gpubudget")
SAMPLE_CM=gpubudget-e2e-sample
WORK=$(mktemp -d "${TMPDIR:-/tmp}/gpubudget-e2e.XXXXXX")
CRD=gpumemorybudgets.gpubudget.io
CRD_EXISTED=$(kubectl get crd "$CRD" -o name 2>/dev/null || true)
FAILED=1
START=$SECONDS
PROBE_PID=""   # the eviction-probe loop running in the background, if any
DRAINED=""     # the node the drain story cordoned, until it is uncordoned
ADVERTISED=""  # the node whose status the caps story patched to advertise GPUs, until the patch is undone

POLL=2
trap cleanup EXIT

for story in "${ALL_STORIES[@]}"; do
  if [ -n "${WANTED[$story]:-}" ]; then
    # shellcheck source=/dev/null # one of stories/
    . "$(story_file "$story")"
  fi
done

FAILED=0
if [ "$#" = 0 ]; then
  say "PASS: Evict, Warn, overlapping budgets$( [ -n "${AS:-}" ] && echo ", node restriction")${HOST_PROC:+, attribution through real cgroups, agent rollout}, operator rollout${CAPS_PASSED:+, caps at admission}${DRAIN_PASSED:+, node drain}, helm uninstall ($((SECONDS - START)) s)"
else
  say "PASS: $(for story in "${ALL_STORIES[@]}"; do [ -z "${WANTED[$story]:-}" ] || printf '%s ' "$story"; done)($((SECONDS - START)) s)"
fi
