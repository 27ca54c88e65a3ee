# shellcheck shell=bash disable=SC2154,SC2034 # sourced by run.sh: its variables and e2e/cluster/lib.sh's are set
# The setup every story builds on (always runs first): the cluster checked (Kubernetes version, no gpubudget
# installed), the test namespaces and pods, the first replayed sample, `helm install --wait` of the chart, what runs
# checked to be what was built (GPUBUDGET_E2E_HOST_PROC), and the budgets. Sets CHART, AGENT_POD, UID_*.

say "cluster"
kubectl version 2>/dev/null | sed 's/^/    /'
SERVER_MINOR=$(kubectl version -o json 2>/dev/null | sed -n 's/.*"minor": *"\([0-9]*\).*/\1/p' | tail -n1)
# shellcheck disable=SC2015 # both tests must hold
[ -n "$SERVER_MINOR" ] && [ "$SERVER_MINOR" -ge 32 ] || die "the chart supports Kubernetes 1.32 or newer (server minor: ${SERVER_MINOR:-unknown})"
# The chart as it is: its kubeVersion admits 1.32, the version every real run used. GPUBUDGET_E2E_CHART: a
# packaged chart (the release's .tgz, as e2e/cluster/realk8s.sh makes it) instead of the directory.
CHART=${GPUBUDGET_E2E_CHART:-$REPO/charts/gpubudget}
if kubectl get daemonset -A -l app.kubernetes.io/name=gpubudget,app.kubernetes.io/component=agent -o name 2>/dev/null | grep -q .; then
  die "gpubudget is already installed in this cluster: its agents would enforce the test budgets too; use a cluster without it"
fi
info "helm: $("$HELM" version --short)  chart: ${CHART#"$REPO"/}  images: $REGISTRY/gpubudget-{agent,operator}:$TAG  run id: $ID"

say "namespaces and test pods (pause containers; their GPU usage comes from the replayed sample)"
kubectl create namespace "$NS" >/dev/null
# The agent mounts the host's /proc (hostPath): the chart's namespace needs Pod Security level privileged.
kubectl label namespace "$NS" pod-security.kubernetes.io/enforce=privileged >/dev/null
kubectl create namespace "$NS_A" >/dev/null
kubectl create namespace "$NS_B" >/dev/null
make_pod "$NS_A" llm-evict app=llm                # Evict story: 6Gi → 7.5Gi → 9Gi of 8Gi
make_pod "$NS_A" trainer job-type=training        # Warn story: 20Gi → 35Gi → 45Gi of 40Gi (Warn, 80 %)
make_pod "$NS_B" llm-b app=llm                    # matched by llm-inference (8Gi) and team-b-default (20Gi)
make_pod "$NS_B" other-b tier=batch               # matched by team-b-default only
make_pod "$NS_A" roll app=roll                    # operator rollout story: evicted (roll-evict, 8Gi) during the rollout
[ "$DRAIN" != 1 ] || make_pod "$NS_A" countdown app=countdown # drain story: over an Evict budget, 3600 s to go
if [ -n "$HOST_PROC" ]; then
  # Attribution through real cgroups: two containers, one a shell that forks two children. Their GPU usage is
  # replayed per host PID, so the agent must find pod and container from /proc/<pid>/cgroup as the kubelet
  # laid it out.
  kubectl create namespace "$NS_C" >/dev/null
  kubectl apply -f - >/dev/null <<EOF
apiVersion: v1
kind: Pod
metadata:
  name: multi
  namespace: $NS_C
  labels: {app: multi, e2e.gpubudget.io/run: "$ID"}
spec:
  terminationGracePeriodSeconds: 2
  securityContext: {runAsNonRoot: true, runAsUser: 65534, runAsGroup: 65534, seccompProfile: {type: RuntimeDefault}}
  containers:
    - name: forker
      image: $SHELL_IMAGE
      imagePullPolicy: IfNotPresent
      command: [/bin/sh, -c, "/bin/sleep 86400 & /bin/sleep 86400 & wait"]
      resources: {requests: {cpu: 5m, memory: 8Mi}, limits: {memory: 32Mi}}
      securityContext: {allowPrivilegeEscalation: false, capabilities: {drop: [ALL]}}
    - name: solo
      image: $SHELL_IMAGE
      imagePullPolicy: IfNotPresent
      command: [/bin/sleep, "86400"]
      resources: {requests: {cpu: 5m, memory: 8Mi}, limits: {memory: 32Mi}}
      securityContext: {allowPrivilegeEscalation: false, capabilities: {drop: [ALL]}}
EOF
  # The rollout story: sleep as PID 1 of its container ignores SIGTERM, so an evicted slow pod stays
  # terminating for its whole grace period (the budget's 90 s).
  kubectl apply -f - >/dev/null <<EOF
apiVersion: v1
kind: Pod
metadata:
  name: slow
  namespace: $NS_C
  labels: {app: slow, e2e.gpubudget.io/run: "$ID"}
spec:
  securityContext: {runAsNonRoot: true, runAsUser: 65534, runAsGroup: 65534, seccompProfile: {type: RuntimeDefault}}
  containers:
    - name: main
      image: $SHELL_IMAGE
      imagePullPolicy: IfNotPresent
      command: [/bin/sleep, "86400"]
      resources: {requests: {cpu: 5m, memory: 8Mi}, limits: {memory: 32Mi}}
      securityContext: {allowPrivilegeEscalation: false, capabilities: {drop: [ALL]}}
EOF
fi
for ns in "$NS_A" "$NS_B" ${HOST_PROC:+"$NS_C"}; do
  kubectl wait --for=condition=Ready pod --all -n "$ns" --timeout="${STEP_TIMEOUT}s" >/dev/null \
    || die "test pods in $ns did not become Ready (image $PAUSE_IMAGE pullable?)"
done
UID_EVICT=$(uid "$NS_A" llm-evict)
UID_TRAINER=$(uid "$NS_A" trainer)
UID_LLM_B=$(uid "$NS_B" llm-b)
UID_OTHER_B=$(uid "$NS_B" other-b)
info "pods ready: llm-evict=$UID_EVICT trainer=$UID_TRAINER llm-b=$UID_LLM_B other-b=$UID_OTHER_B"
if [ -n "$HOST_PROC" ]; then
  wait_for "multi/forker runs its shell and two forked children (3 host PIDs in its cgroup)" pid_count_is "$NS_C" multi forker 3
  for c in "$NS_A llm-evict main" "$NS_A trainer main" "$NS_B llm-b main" "$NS_B other-b main" "$NS_C multi forker" "$NS_C multi solo"; do
    # shellcheck disable=SC2086 # NAMESPACE POD CONTAINER
    info "host PIDs of ${c#* }: $(host_pids $c | paste -sd' ' -)"
  done
fi
write_sample 1 6Gi 20Gi

if [ -n "$CRD_EXISTED" ]; then
  # Left by an earlier run or release: Helm installs crds/ on a first install only and never changes them, so
  # apply this checkout's CRDs first, as docs/operations.md says an upgrade does.
  say "the CRDs already exist: applying this checkout's (charts/gpubudget/crds), as an upgrade does"
  kubectl apply --server-side --force-conflicts -f "$REPO/charts/gpubudget/crds/" | sed 's/^/    /'
fi

say "helm install (release $RELEASE in $NS)"
INSTALL_AT=$SECONDS
"$HELM" install "$RELEASE" "$CHART" -n "$NS" -f "$HERE/values.yaml" \
  --set "image.registry=$REGISTRY" --set-string "agent.image.tag=$TAG" --set-string "operator.image.tag=$TAG" \
  --wait --timeout "$((STEP_TIMEOUT + 120))s" >/dev/null || die "helm install did not become ready"
info "figure: helm install --wait to every agent and operator replica ready: $((SECONDS - INSTALL_AT)) s"
kubectl get pods -n "$NS" -o wide | sed 's/^/    /'
AGENT_POD=$(kubectl get pods -n "$NS" -l app.kubernetes.io/component=agent -o jsonpath='{.items[0].metadata.name}')
if [ -n "$HOST_PROC" ]; then
  # What runs is what was built: the binary, the user and the entrypoint (e2e/cluster/realk8s.sh names the
  # binaries; .ci/dockerfiles.sh keeps docker/*.Dockerfile, the chart and realk8s.sh in agreement).
  for comp in agent operator; do
    pod=$(kubectl get pods -n "$NS" -l "app.kubernetes.io/component=$comp" -o jsonpath='{.items[0].metadata.name}')
    pid=$(host_pids "$NS" "$pod" "$comp" | head -n1)
    [ -n "$pid" ] || die "no host PID found for the $comp container of $pod"
    exe=$(readlink "$HOST_PROC/$pid/exe")
    user=$(awk '/^Uid:/ {print $2}' "$HOST_PROC/$pid/status"):$(awk '/^Gid:/ {print $2}' "$HOST_PROC/$pid/status")
    want=$(sed -n 's/^USER //p' "$REPO/docker/$comp.Dockerfile")
    [ "$exe" = "/usr/local/bin/gpubudget-$comp" ] || die "$comp runs $exe, not /usr/local/bin/gpubudget-$comp (the Dockerfile's entrypoint)"
    [ "$user" = "$want" ] || die "$comp runs as $user, not $want (docker/$comp.Dockerfile USER)"
    bin_var=GPUBUDGET_E2E_$(echo "$comp" | tr '[:lower:]' '[:upper:]')_BINARY
    if [ -n "${!bin_var:-}" ]; then
      cmp -s "$HOST_PROC/$pid/exe" "${!bin_var}" || die "$comp runs a binary other than ${!bin_var}"
    fi
    info "$comp ($pod): host PID $pid runs $exe as $user${!bin_var:+, the same bytes as ${!bin_var}}"
  done
fi

say "budgets from examples/ (namespaces rewritten to the test namespaces)"
apply_example() { # FILE NAMESPACE
  sed -E "s/^([[:space:]]*namespace:[[:space:]]*).*/\1$2/" "$REPO/examples/$1" | kubectl apply -f - | sed 's/^/    /'
}
apply_example llm-inference.yaml "$NS_A"
apply_example training-warn.yaml "$NS_A"
apply_example namespace-wide.yaml "$NS_B"
apply_example llm-inference.yaml "$NS_B"
apply_budget roll-evict "$NS_A" '{selector: {matchLabels: {app: roll}}, limit: 8Gi, action: Evict, overLimitSeconds: 10}'
if [ "$DRAIN" = 1 ]; then
  apply_budget countdown-evict "$NS_A" '{selector: {matchLabels: {app: countdown}}, limit: 8Gi, action: Evict, overLimitSeconds: 3600}'
fi
if [ -n "$HOST_PROC" ]; then
  apply_budget multi-audit "$NS_C" '{selector: {matchLabels: {app: multi}}, limit: 40Gi, action: Warn, overLimitSeconds: 30}'
  apply_budget slow-evict "$NS_C" '{selector: {matchLabels: {app: slow}}, limit: 8Gi, action: Evict, overLimitSeconds: 10, evictionGracePeriodSeconds: 90}'
fi
