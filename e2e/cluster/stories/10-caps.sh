# shellcheck shell=bash disable=SC2154,SC2034 # sourced by run.sh: its variables and e2e/cluster/lib.sh's are set
# Story 7, caps at admission: a GPU pod created under a budget with admissionCaps: Enabled runs with the driver's
# caps in its containers' environment. Where no node advertises nvidia.com/gpu and nvidia.com/gpu.shared,
# GPUBUDGET_E2E_ADVERTISE_GPU=1 patches a test node's status to (undone at the end, or by the exit handler). Sets
# CAPS_PASSED when it ran.

say "caps at admission: a GPU pod created under a budget with admissionCaps: Enabled runs with the driver's caps in its environment"
# allocatable_gpus NODE: "<nvidia.com/gpu>/<nvidia.com/gpu.shared>" the node advertises as allocatable.
allocatable_gpus() {
  kubectl get node "$1" -o json | jq -r '.status.allocatable | "\(.["nvidia.com/gpu"] // 0)/\(.["nvidia.com/gpu.shared"] // 0)"'
}
CAPS_NODE=$(kubectl get nodes -o json | jq -r '[.items[] | select((.status.allocatable["nvidia.com/gpu"] // "0") != "0"
  and (.status.allocatable["nvidia.com/gpu.shared"] // "0") != "0") | .metadata.name] | first // empty')
if [ -z "$CAPS_NODE" ] && [ "$ADVERTISE_GPU" = 1 ] && [ -n "$SHELL_IMAGE" ]; then
  # A test node without GPUs: advertise one of each through the node's status, as Kubernetes documents for an
  # extended resource ("Advertise Extended Resources for a Node"). Nothing allocates a device for a resource no
  # device plugin registered: the kubelet admits the pod against the node's allocatable and runs it as it is.
  CAPS_NODE=$(kubectl get pod "$AGENT_POD" -n "$NS" -o jsonpath='{.spec.nodeName}')
  ADVERTISED=$CAPS_NODE
  ops=""
  for r in $GPU_RESOURCES; do
    ops+="{\"op\":\"add\",\"path\":\"/status/capacity/$r\",\"value\":\"1\"},{\"op\":\"add\",\"path\":\"/status/allocatable/$r\",\"value\":\"1\"},"
  done
  kubectl patch node "$CAPS_NODE" --subresource=status --type=json -p "[${ops%,}]" >/dev/null
  advertises() { [ "$(allocatable_gpus "$CAPS_NODE")" = 1/1 ]; }
  wait_for "$CAPS_NODE advertises nvidia.com/gpu 1 and nvidia.com/gpu.shared 1 (allocatable)" advertises
fi
if [ -z "$SHELL_IMAGE" ]; then
  info "skipped: the story needs GPUBUDGET_E2E_SHELL_IMAGE (an image with /bin/sh and /bin/sleep)"
  return 0
fi
if [ -z "$CAPS_NODE" ]; then
  info "skipped: no node advertises nvidia.com/gpu and nvidia.com/gpu.shared (GPUBUDGET_E2E_ADVERTISE_GPU=1 patches a test node's status to)"
  return 0
fi
kubectl create namespace "$NS_D" >/dev/null
apply_budget capped "$NS_D" '{selector: {matchLabels: {app: capped}}, limit: 6Gi, request: 4Gi, admissionCaps: Enabled}'
caps_labelled() { [ "$(kubectl get namespace "$NS_D" -o jsonpath='{.metadata.labels.gpubudget\.io/admission-caps}')" = enabled ]; }
wait_for "the leader labels $NS_D gpubudget.io/admission-caps=enabled (the webhook's namespaceSelector)" caps_labelled
# Two GPU containers, as a user writes them: main asks for a whole GPU and sets nothing; side asks for a
# shared one and sets its own, smaller MPS cap (kept: the webhook never raises a user's value).
kubectl apply -f - >/dev/null <<EOF
apiVersion: v1
kind: Pod
metadata:
  name: capped
  namespace: $NS_D
  labels: {app: capped, e2e.gpubudget.io/run: "$ID"}
spec:
  terminationGracePeriodSeconds: 1
  securityContext: {runAsNonRoot: true, runAsUser: 65534, runAsGroup: 65534, seccompProfile: {type: RuntimeDefault}}
  containers:
    - name: main
      image: $SHELL_IMAGE
      imagePullPolicy: IfNotPresent
      command: [/bin/sleep, "86400"]
      resources: {requests: {cpu: 5m, memory: 8Mi}, limits: {memory: 32Mi, nvidia.com/gpu: 1}}
      securityContext: {allowPrivilegeEscalation: false, capabilities: {drop: [ALL]}}
    - name: side
      image: $SHELL_IMAGE
      imagePullPolicy: IfNotPresent
      command: [/bin/sleep, "86400"]
      env: [{name: CUDA_MPS_PINNED_DEVICE_MEM_LIMIT, value: "0=2048M"}]
      resources: {requests: {cpu: 5m, memory: 8Mi}, limits: {memory: 32Mi, nvidia.com/gpu.shared: 1}}
      securityContext: {allowPrivilegeEscalation: false, capabilities: {drop: [ALL]}}
EOF
kubectl wait --for=condition=Ready pod/capped -n "$NS_D" --timeout="${STEP_TIMEOUT}s" >/dev/null \
  || die "pod capped (asking for nvidia.com/gpu and nvidia.com/gpu.shared) did not become Ready on $CAPS_NODE"
info "capped runs on $(kubectl get pod capped -n "$NS_D" -o jsonpath='{.spec.nodeName}') (node allocatable nvidia.com/gpu / gpu.shared: $(allocatable_gpus "$CAPS_NODE"))"
# caps_env CONTAINER: the gpubudget variables in the running container's environment, sorted, as its processes
# see it (kubectl exec, through the kubelet and the runtime; not the pod spec).
caps_env() {
  kubectl exec capped -n "$NS_D" -c "$1" -- /bin/sh -c 'export -p' \
    | sed -nE "s/^export (CUDA_MPS_PINNED_DEVICE_MEM_LIMIT|NVIDIA_GPU_MEMORY_LIMIT|NVIDIA_GPU_MEMORY_REQUEST)='?([^']*)'?$/\1=\2/p" | sort
}
for c in main side; do caps_env "$c" | sed "s/^/    kubectl exec capped -c $c: /"; done
[ "$(caps_env main)" = "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=6144M
NVIDIA_GPU_MEMORY_LIMIT=6144
NVIDIA_GPU_MEMORY_REQUEST=4096" ] || die "capped/main's environment does not carry the budget's caps (6Gi, request 4Gi)"
[ "$(caps_env side)" = "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=2048M
NVIDIA_GPU_MEMORY_LIMIT=6144
NVIDIA_GPU_MEMORY_REQUEST=4096" ] || die "capped/side's environment: the user's smaller MPS cap not kept, or a cap missing"
CAPS_RECORD=$(annotation "$NS_D" capped caps)
info "gpubudget.io/caps: $CAPS_RECORD"
echo "$CAPS_RECORD" | jq -e '.budget == "capped" and .limitMib == 6144 and .requestMib == 4096
  and ([.containers[] | "\(.name):\(.devices):\(.env.CUDA_MPS_PINNED_DEVICE_MEM_LIMIT)"] | sort) == ["main:1:set", "side:1:kept"]' >/dev/null \
  || die "unexpected gpubudget.io/caps record on capped: $CAPS_RECORD"
capped_counts() { [ "$(kubectl get gmb capped -n "$NS_D" -o jsonpath='{.status.matchedPods}/{.status.podsCapped}/{.status.podsUncapped}')" = 1/1/0 ]; }
wait_for "capped status: MATCHED 1, CAPPED 1 (read from the containers' environment), UNCAPPED 0" capped_counts
kubectl get gmb capped -n "$NS_D" -o wide | sed 's/^/    /'
kubectl delete pod capped -n "$NS_D" --wait=false >/dev/null
wait_for "capped deleted (the drain story counts every test pod)" pod_gone "$NS_D" capped
if [ -n "$ADVERTISED" ]; then
  unadvertise_gpu "$ADVERTISED"
  no_gpu_left() { [ "$(kubectl get node "$ADVERTISED" -o json | jq '[.status.capacity, .status.allocatable | keys[] | select(startswith("nvidia.com/"))] | length')" = 0 ]; }
  wait_for "$ADVERTISED no longer advertises nvidia.com/gpu or nvidia.com/gpu.shared" no_gpu_left
  ADVERTISED=""
fi
CAPS_PASSED=1
