#!/usr/bin/env bash
# The user's whole story on the shared real node (../shared/realk8s: kubelet 1.32, containerd, runc), in one
# command: builds the release binaries, makes the two images from them, brings up the control plane and the
# node only if they are not up (and stops only what it started), runs e2e/cluster/run.sh with the replayed
# sample naming real host PIDs, and prints PASS. See e2e/cluster/README.md.
#
#   bash e2e/cluster/realk8s.sh            # REALK8S (default /work/shared/realk8s) holds up.sh, node-up.sh, image.sh
#   bash e2e/cluster/realk8s.sh caps       # only these stories of run.sh (and the setup and what they need)
#
# The images: the same binaries the Dockerfiles build (`cargo build --release --locked -p <crate>`, default
# features), at the Dockerfiles' ENTRYPOINT path, on this machine's glibc (image.sh adds the libraries ldd
# names). image.sh writes no USER: the chart's runAsUser/runAsGroup (the Dockerfiles' USER, which
# .ci/dockerfiles.sh checks) set it, and run.sh checks the running processes' UID, path and bytes.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
REPO=$(cd "$HERE/../.." && pwd)
# shellcheck source=../lib.sh
. "$REPO/e2e/lib.sh"
REALK8S=${REALK8S:-/work/shared/realk8s}
TAG=${GPUBUDGET_E2E_TAG:-realk8s}
export REALK8S_DIR=${REALK8S_DIR:-/tmp/realk8s}
export KUBECONFIG=$REALK8S_DIR/run/kubeconfig
for f in up.sh node-up.sh image.sh; do
  [ -f "$REALK8S/$f" ] || die "$REALK8S/$f not found (set REALK8S to the realk8s scripts)"
done

say "release binaries (the Dockerfiles' build: cargo build --release --locked -p <crate>)"
(cd "$REPO" && cargo build --release --locked -p gpubudget-agent -p gpubudget-operator)
REL=$RELEASE_DIR

STARTED_CP=0
STARTED_NODE=0
stop_started() {
  local rc=$?
  if [ "$STARTED_NODE" = 1 ]; then bash "$REALK8S/node-down.sh" >/dev/null 2>&1 || true; fi
  if [ "$STARTED_CP" = 1 ]; then bash "$REALK8S/down.sh" >/dev/null 2>&1 || true; fi
  exit "$rc"
}
trap stop_started EXIT

say "the real node"
if ! kubectl get --raw /readyz >/dev/null 2>&1; then
  eval "$(REALK8S_ADVERTISE=10.88.0.1 bash "$REALK8S/up.sh")"
  STARTED_CP=1
fi
if [ "$(kubectl get node "${REALK8S_NODE_NAME:-n1}" -o jsonpath='{.status.conditions[?(@.type=="Ready")].status}' 2>/dev/null)" != True ]; then
  bash "$REALK8S/node-up.sh"
  STARTED_NODE=1
fi
kubectl get nodes -o wide | sed 's/^/    /'

say "images from the release binaries (entrypoint as in docker/*.Dockerfile)"
for comp in agent operator; do
  entry=$(sed -n 's/^ENTRYPOINT \["\([^"]*\)"\]$/\1/p' "$REPO/docker/$comp.Dockerfile")
  [ "$entry" = "/usr/local/bin/gpubudget-$comp" ] || die "docker/$comp.Dockerfile ENTRYPOINT: '$entry'"
  bash "$REALK8S/image.sh" "gpubudget/gpubudget-$comp:$TAG" "$entry" "$REL/gpubudget-$comp=$entry" \
    | sed 's/^/    /'
done

say "the chart as a release ships it (helm package, as .github/workflows/release.yml does)"
PKG=$(mktemp -d)
helm package "$REPO/charts/gpubudget" -d "$PKG" | sed 's/^/    /'

say "e2e/cluster/run.sh on the node"
GPUBUDGET_E2E_CHART=$(ls "$PKG"/gpubudget-*.tgz) \
GPUBUDGET_E2E_TAG=$TAG \
  GPUBUDGET_E2E_DRAIN=1 \
  GPUBUDGET_E2E_ADVERTISE_GPU=1 \
  GPUBUDGET_E2E_HOST_PROC=/proc \
  GPUBUDGET_E2E_SHELL_IMAGE=local/busybox:1 \
  GPUBUDGET_E2E_AGENT_BINARY=$REL/gpubudget-agent \
  GPUBUDGET_E2E_OPERATOR_BINARY=$REL/gpubudget-operator \
  bash "$HERE/run.sh" "$@"
