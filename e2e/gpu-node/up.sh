#!/usr/bin/env bash
# On the GPU machine, as root:  bash e2e/gpu-node/up.sh carry/gpu-node/N   (N = 1, 2, 3: one per device call)
# Unpacks a part pack.sh made into $G (default /tmp/gpu-node-k8s), which outlives the call on a warm machine.
# Once all three parts are there it starts a one-node Kubernetes 1.32 (each process in its own session, so it
# outlives the call too; idempotent): etcd, kube-apiserver, kube-controller-manager, kube-scheduler; containerd
# 1.6 (or 2 with NRI on /var/run/nri/nri.sock, whichever pack.sh packed) with runc and the `nvidia` runtime handler (e2e/gpu-node/nvidia-runtime, a stand-in for the NVIDIA
# Container Toolkit's runtime); the kubelet, registered as node gpu-node with the label GPU feature discovery
# puts on GPU nodes. No kube-proxy and no iptables there: the `kubernetes` Service's address 10.96.0.1 is put on
# the loopback device and the API server listens on :443, so pods reach it at that address as kube-proxy would
# route them; the API server calls webhooks at their endpoints (--enable-aggregator-routing).
# Prints `export KUBECONFIG=...`.
set -uo pipefail
PART=${1:?usage: up.sh carry/gpu-node/N}
HERE=$(cd "$(dirname "$0")" && pwd)
# shellcheck source=../lib.sh
. "$HERE/../lib.sh"
G=${GPU_NODE_K8S_DIR:-/tmp/gpu-node-k8s}; B=$G/bin; W=$G/run
NODE=gpu-node; NODE_IP=10.77.0.1; SVC_IP=10.96.0.1; SOCK=/run/containerd-gk/containerd.sock
mkdir -p "$B" "$G/cni" "$G/net.d" "$G/images" "$W/certs" "$G/logs"
for f in "$PART"/*.xz; do
  n=$(basename "${f%.xz}")
  case $n in
    *.tar) xz -dc "$f" > "$G/images/$n" ;;
    bridge|host-local|loopback) xz -dc "$f" > "$G/cni/$n"; chmod +x "$G/cni/$n" ;;
    *) xz -dc "$f" > "$B/$n"; chmod +x "$B/$n" ;;
  esac
done
for f in "$PART"/*.tgz "$PART"/sa.key "$PART"/sa.pub "$PART"/commit; do [ -f "$f" ] && cp "$f" "$G/"; done
echo "unpacked $PART into $G"
for b in etcd kube-apiserver kube-controller-manager kube-scheduler kubelet containerd runc ctr kubectl helm; do
  [ -x "$B/$b" ] || { echo "waiting for the other parts ($b not yet there)"; exit 0; }
done
export PATH=$B:$PATH KUBECONFIG=$W/kubeconfig
started() { [ -f "$W/$1.pid" ] && kill -0 "$(cat "$W/$1.pid")" 2>/dev/null; }
start() { # NAME CMD...: in its own session (outlives the device call), pid in $W/NAME.pid, log in $G/logs
  local name=$1; shift
  started "$name" && return
  setsid "$@" > "$G/logs/$name.log" 2>&1 < /dev/null & echo $! > "$W/$name.pid"
}

say "the machine"
uname -r; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
NVML=$(ldconfig -p 2>/dev/null | awk '/libnvidia-ml\.so\.1 .*x86-64/ {print $NF; exit}')
for f in /usr/lib/x86_64-linux-gnu /usr/local/nvidia/lib64 /usr/lib64; do
  [ -z "$NVML" ] && [ -e "$f/libnvidia-ml.so.1" ] && NVML=$f/libnvidia-ml.so.1
done
[ -n "$NVML" ] && NVML=$(readlink -f "$NVML"); echo "NVML: ${NVML:-none found, so the agent container gets no libnvidia-ml.so.1}"; stat -c '  %n %A %t:%T' /dev/nvidia*
stat -fc 'cgroup fs: %T' /sys/fs/cgroup

# Addresses: the node's (not loopback, so the kubelet accepts it) and the kubernetes Service's, on lo.
for a in $NODE_IP $SVC_IP; do busybox ip addr show dev lo | grep -q " $a/" || busybox ip addr add "$a/32" dev lo; done

cp "$G/sa.key" "$G/sa.pub" "$W/certs/"
echo "admin-token,admin,admin,system:masters" > "$W/certs/tokens.csv"
start etcd etcd --name e --data-dir "$W/etcd" --listen-client-urls http://127.0.0.1:24790 \
  --advertise-client-urls http://127.0.0.1:24790 --listen-peer-urls http://127.0.0.1:24800 \
  --initial-advertise-peer-urls http://127.0.0.1:24800 --initial-cluster e=http://127.0.0.1:24800
start kube-apiserver kube-apiserver --etcd-servers=http://127.0.0.1:24790 --bind-address=0.0.0.0 --secure-port=443 \
  --advertise-address=$NODE_IP --cert-dir="$W/certs" --token-auth-file="$W/certs/tokens.csv" \
  --authorization-mode=RBAC --service-account-key-file="$W/certs/sa.pub" \
  --service-account-signing-key-file="$W/certs/sa.key" --service-account-issuer=https://kubernetes.default.svc \
  --service-cluster-ip-range=10.96.0.0/16 --allow-privileged=true --enable-aggregator-routing=true \
  --kubelet-preferred-address-types=InternalIP
cat > "$W/kubeconfig" <<KC
apiVersion: v1
kind: Config
clusters: [{name: gpu-node, cluster: {server: "https://127.0.0.1:443", insecure-skip-tls-verify: true}}]
users: [{name: admin, user: {token: admin-token}}]
contexts: [{name: gpu-node, context: {cluster: gpu-node, user: admin}}]
current-context: gpu-node
KC
chmod 600 "$W/kubeconfig"
for _ in $(seq 90); do kubectl get --raw /readyz >/dev/null 2>&1 && break; sleep 1; done
kubectl get --raw /readyz >/dev/null || { tail -20 "$G/logs/kube-apiserver.log"; die "kube-apiserver not ready"; }
start kube-controller-manager kube-controller-manager --kubeconfig="$W/kubeconfig" --bind-address=127.0.0.1 \
  --secure-port=11257 --controllers=serviceaccount,serviceaccount-token,namespace,garbagecollector,disruption,podgc,replicaset,deployment,daemonset,clusterrole-aggregation,root-ca-cert-publisher,endpoint,endpointslice,endpointslicemirroring \
  --service-account-private-key-file="$W/certs/sa.key" --root-ca-file="$W/certs/apiserver.crt" \
  --use-service-account-credentials=false --leader-elect=false
start kube-scheduler kube-scheduler --kubeconfig="$W/kubeconfig" --bind-address=127.0.0.1 --secure-port=11259 \
  --leader-elect=false

# containerd 1.6 (restarted with this config when up.sh runs again): runc (default) and `nvidia` (the stand-in, then runc), cgroupfs, CNI bridge with a default
# route through the node (so pods reach 10.96.0.1 on its loopback).
sed -e "s|@RUNC@|$B/runc|" -e "s|@NVML@|$NVML|" -e "s|@LOG@|$G/logs/nvidia-runtime.log|" \
  -e "1s|.*|#!$(command -v python3)|" "$HERE/nvidia-runtime" > "$B/nvidia-runtime"; chmod +x "$B/nvidia-runtime"
if "$B/containerd" --version | grep -q ' v2\.'; then
# containerd 2 (config version 3): the same runtimes, and NRI on (the runtime-caps relay's socket, #53).
cat > "$G/containerd.toml" <<TOML
version = 3
root = "/var/lib/containerd-gk2"
state = "/run/containerd-gk"
[grpc]
  address = "$SOCK"
[plugins."io.containerd.cri.v1.images"]
  snapshotter = "overlayfs"
  [plugins."io.containerd.cri.v1.images".pinned_images]
    sandbox = "registry.k8s.io/pause:3.10"
[plugins."io.containerd.cri.v1.runtime"]
  restrict_oom_score_adj = true
  [plugins."io.containerd.cri.v1.runtime".containerd]
    default_runtime_name = "runc"
    [plugins."io.containerd.cri.v1.runtime".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      runtime_path = "$B/containerd-shim-runc-v2"
      [plugins."io.containerd.cri.v1.runtime".containerd.runtimes.runc.options]
        BinaryName = "$B/runc"
        SystemdCgroup = false
    [plugins."io.containerd.cri.v1.runtime".containerd.runtimes.nvidia]
      runtime_type = "io.containerd.runc.v2"
      runtime_path = "$B/containerd-shim-runc-v2"
      [plugins."io.containerd.cri.v1.runtime".containerd.runtimes.nvidia.options]
        BinaryName = "$B/nvidia-runtime"
        SystemdCgroup = false
  [plugins."io.containerd.cri.v1.runtime".cni]
    bin_dirs = ["$G/cni"]
    conf_dir = "$G/net.d"
[plugins."io.containerd.nri.v1.nri"]
  disable = false
  disable_connections = false
  socket_path = "/var/run/nri/nri.sock"
TOML
else
cat > "$G/containerd.toml" <<TOML
version = 2
root = "/var/lib/containerd-gk"
state = "/run/containerd-gk"
[grpc]
  address = "$SOCK"
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "registry.k8s.io/pause:3.10"
  # These VMs lack CAP_SYS_RESOURCE: an oom_score_adj below the runtime's own fails (runc reports "can't get
  # final child's PID from pipe"), so containerd clamps it.
  restrict_oom_score_adj = true
  [plugins."io.containerd.grpc.v1.cri".containerd]
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        BinaryName = "$B/runc"
        SystemdCgroup = false
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.nvidia]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.nvidia.options]
        BinaryName = "$B/nvidia-runtime"
        SystemdCgroup = false
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "$G/cni"
    conf_dir = "$G/net.d"
TOML
fi
cat > "$G/net.d/10-gpu-node.conflist" <<JSON
{"cniVersion": "0.4.0", "name": "gpu-node", "plugins": [
  {"type": "bridge", "bridge": "cni0", "isGateway": true, "isDefaultGateway": true, "ipam": {"type": "host-local",
   "ranges": [[{"subnet": "10.88.0.0/16", "gateway": "10.88.0.1"}]]}}, {"type": "loopback"}]}
JSON
start containerd containerd --config "$G/containerd.toml"
for _ in $(seq 40); do ctr -a $SOCK version >/dev/null 2>&1 && break; sleep 0.5; done
for t in "$G"/images/*.tar; do ctr -a $SOCK -n k8s.io images import "$t" >/dev/null || info "FAIL: import $t"; done
ctr -a $SOCK -n k8s.io images ls -q | grep -v '^sha256:' | sed 's/^/  image: /'

cat > "$G/kubelet.yaml" <<YAML
apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
cgroupDriver: cgroupfs
containerRuntimeEndpoint: unix://$SOCK
readOnlyPort: 0
authentication: {anonymous: {enabled: true}, webhook: {enabled: false}}
authorization: {mode: AlwaysAllow}
failSwapOn: false
resolvConf: /etc/resolv.conf
evictionHard: {memory.available: "100Mi", nodefs.available: "1%", imagefs.available: "1%"}
imageGCHighThresholdPercent: 100
YAML
start kubelet kubelet --config="$G/kubelet.yaml" --kubeconfig="$W/kubeconfig" --hostname-override=$NODE \
  --node-ip=$NODE_IP --root-dir=/var/lib/kubelet-gk
for _ in $(seq 60); do kubectl get node $NODE >/dev/null 2>&1 && break; sleep 1; done
kubectl wait --for=condition=Ready node/$NODE --timeout=120s >/dev/null || {
  tail -30 "$G/logs/kubelet.log"; die "node not ready"; }
# No node-lifecycle controller runs, so nothing lifts the kubelet's first not-ready taint.
kubectl taint node $NODE node.kubernetes.io/not-ready:NoSchedule- >/dev/null 2>&1 || true
# What GPU feature discovery and the NVIDIA runtime's installer leave on a GPU node: the label the chart's agent
# selects, and the RuntimeClass `nvidia`. The device plugin with time-slicing (4 replicas) would advertise
# nvidia.com/gpu: 4; nothing runs it here, so the node's status says it.
kubectl label node $NODE nvidia.com/gpu.present=true --overwrite >/dev/null
kubectl apply -f - >/dev/null <<YAML
apiVersion: node.k8s.io/v1
kind: RuntimeClass
metadata: {name: nvidia}
handler: nvidia
YAML
kubectl patch node $NODE --subresource=status --type=merge \
  -p '{"status":{"capacity":{"nvidia.com/gpu":"4"},"allocatable":{"nvidia.com/gpu":"4"}}}' >/dev/null
kubectl get nodes -o wide
echo "export KUBECONFIG=$KUBECONFIG"
