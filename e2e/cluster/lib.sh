# shellcheck shell=bash disable=SC2154 # the run's variables are set by run.sh
# The real-cluster suite's own helpers (e2e/cluster/run.sh and its stories/), on top of e2e/lib.sh (sourced here;
# output, failure, waits and the events' helpers are its: core v1 Events are has_core_event and
# core_event_messages). Sourced, not run; defining them runs nothing; they use the run's variables, which run.sh
# sets (NS, NS_A..NS_D, ID, RELEASE, AGENT_SA, SAMPLE_CM, WORK, HOST_PROC, DRAIN, PAUSE_IMAGE, ...).
# shellcheck source=../lib.sh
. "$(dirname "${BASH_SOURCE[0]}")/../lib.sh"

diagnostics() {
  say "diagnostics"
  kubectl get pods -n "$NS" -o wide || true
  kubectl logs -n "$NS" -l app.kubernetes.io/component=operator --tail=100 --prefix || true
  kubectl logs -n "$NS" -l app.kubernetes.io/component=agent --tail=200 --prefix || true
  for ns in "$NS_A" "$NS_B" ${HOST_PROC:+"$NS_C"} "$NS_D"; do
    kubectl get pods -n "$ns" -o wide --show-labels || true
    kubectl get events -n "$ns" --sort-by=.lastTimestamp || true
    kubectl get gmb -n "$ns" -o yaml || true
  done
}

cleanup() {
  local rc=$?
  if [ -n "$PROBE_PID" ]; then touch "$WORK/stop-probes"; wait "$PROBE_PID" 2>/dev/null || true; fi
  [ "$FAILED" = 0 ] || diagnostics
  if [ -n "$DRAINED" ]; then kubectl uncordon "$DRAINED" >/dev/null 2>&1 || true; fi
  if [ -n "$ADVERTISED" ]; then unadvertise_gpu "$ADVERTISED" >/dev/null 2>&1 || true; fi
  if [ -n "${MPS_LABELLED:-}" ]; then
    kubectl label node "$MPS_LABELLED" nvidia.com/gpu.sharing-strategy- nvidia.com/gpu.replicas- >/dev/null 2>&1 || true
  fi
  if [ "${GPUBUDGET_E2E_KEEP:-0}" = 1 ]; then
    say "keeping namespaces $NS $NS_A $NS_B ${HOST_PROC:+$NS_C }and release $RELEASE (GPUBUDGET_E2E_KEEP=1)"
  else
    say "cleanup"
    "$HELM" uninstall "$RELEASE" -n "$NS" --wait --timeout 2m >/dev/null 2>&1 || true
    kubectl delete namespace "$NS" "$NS_A" "$NS_B" ${HOST_PROC:+"$NS_C"} "$NS_D" "$NS_K" --wait=false --ignore-not-found >/dev/null 2>&1 || true
    if [ -z "$CRD_EXISTED" ]; then
      kubectl delete crd "$CRD" --wait=false --ignore-not-found >/dev/null 2>&1 || true
    fi
  fi
  rm -rf "$WORK"
  exit "$rc"
}
# GPU_RESOURCES: the extended resources the caps story advertises on a test node (JSON Pointer names: / is ~1).
GPU_RESOURCES="nvidia.com~1gpu nvidia.com~1gpu.shared"
# unadvertise_gpu NODE: removes what the caps story added to the node's status capacity and allocatable (each
# path on its own: one the kubelet already dropped must not keep the others).
unadvertise_gpu() {
  local r f
  for r in $GPU_RESOURCES; do
    for f in capacity allocatable; do
      kubectl patch node "$1" --subresource=status --type=json -p "[{\"op\":\"remove\",\"path\":\"/status/$f/$r\"}]" >/dev/null 2>&1 || true
    done
  done
}

# make_pod NAMESPACE NAME LABELS(k=v,...) [META] [SPEC] [CONTAINER] [LIMITS]: a pause pod; META, SPEC and CONTAINER
# are more fields of its metadata, spec and container (YAML lines, e.g. "schedulerName: kai-scheduler"), LIMITS
# more resource limits (flow style, e.g. "nvidia.com/gpu: \"1\""), to shape it as a scheduler leaves it.
make_pod() {
  local labels="" kv
  IFS=, read -ra kvs <<<"$3"
  for kv in "${kvs[@]}"; do [ -n "$kv" ] && labels+="    ${kv%%=*}: \"${kv#*=}\""$'\n'; done
  indent() { [ -z "$2" ] || printf '%s\n' "$2" | sed "s/^/$1/"; }
  kubectl apply -f - >/dev/null <<EOF
apiVersion: v1
kind: Pod
metadata:
  name: $2
  namespace: $1
$(indent "  " "${4:-}")
  labels:
    e2e.gpubudget.io/run: "$ID"
${labels}spec:
$(indent "  " "${5:-}")
  terminationGracePeriodSeconds: 5
  containers:
    - name: main
      image: $PAUSE_IMAGE
$(indent "      " "${6:-}")
      resources:
        requests: {cpu: 5m, memory: 8Mi}
        limits: {memory: 32Mi${7:+, $7}}
      securityContext:
        allowPrivilegeEscalation: false
        runAsNonRoot: true
        runAsUser: 65535
        capabilities: {drop: [ALL]}
        seccompProfile: {type: RuntimeDefault}
EOF
}
# container_id NAMESPACE POD CONTAINER: the container's runtime id, without its scheme (containerd://).
container_id() {
  kubectl get pod "$2" -n "$1" -o jsonpath="{.status.containerStatuses[?(@.name==\"$3\")].containerID}" | sed 's|^[a-z-]*://||'
}
# host_pids NAMESPACE POD CONTAINER: the host PIDs in the container's cgroup, found as an operator on the node
# would: every $HOST_PROC/<pid>/cgroup naming the pod's UID (cgroupfs: pod<uid>, systemd: pod<uid with _>) and
# the container's id. Nothing (and status 1) when the pod or container is gone.
host_pids() {
  local pod_uid cid
  pod_uid=$(uid "$1" "$2" 2>/dev/null) && [ -n "$pod_uid" ] || return 1
  cid=$(container_id "$1" "$2" "$3") && [ -n "$cid" ] || return 1
  # A process that exits during the scan makes grep exit 2 (its file is gone): not an error here.
  { grep -l -E "pod(${pod_uid}|${pod_uid//-/_})[/.].*${cid}" "$HOST_PROC"/[0-9]*/cgroup 2>/dev/null || true; } \
    | sed -E 's|.*/([0-9]+)/cgroup$|\1|' | sort -n
}
# entries NAMESPACE POD CONTAINER BYTES: the sample's process entries for one container. With HOST_PROC, one
# entry per host PID of the container (so a container of three processes holds 3 x BYTES), attributed by the
# agent through /proc/<pid>/cgroup; without, one entry naming the pod by UID and the container by name.
entries() {
  local pod_uid pid
  if [ -n "$HOST_PROC" ]; then
    for pid in $(host_pids "$@"); do printf '{"pid": %s, "used_bytes": "%s"}\n' "$pid" "$4"; done
  else
    pod_uid=$(uid "$1" "$2" 2>/dev/null) && [ -n "$pod_uid" ] || return 0
    printf '{"pod_uid": "%s", "container": "%s", "used_bytes": "%s"}\n' "$pod_uid" "$3" "$4"
  fi
}
pid_count_is() { [ "$(host_pids "$1" "$2" "$3" | wc -l)" = "$4" ]; }
# in_cgroup PATTERN: some host process's cgroup names PATTERN (fixed string).
in_cgroup() { grep -qsF "$1" "$HOST_PROC"/[0-9]*/cgroup; }
SOLO_BYTES=2Gi
SLOW_BYTES=1Gi
ROLL_BYTES=1Gi
# write_sample PHASE EVICT TRAINER: the sample file the agents replay (every agent reads the same file and
# charges only the pods on its own node), as a ConfigMap; then nudge the agent pods so the kubelet refreshes
# the mounted file at once instead of at its next periodic sync.
write_sample() {
  local procs
  procs=$({
    entries "$NS_A" llm-evict main "$2"
    entries "$NS_A" trainer main "$3"
    entries "$NS_B" llm-b main 1Gi
    entries "$NS_B" other-b main 2Gi
    entries "$NS_A" roll main "$ROLL_BYTES"
    [ "$DRAIN" != 1 ] || entries "$NS_A" countdown main 9Gi
    if [ -n "${KAI_HALF_BYTES:-}" ]; then
      entries "$NS_K" kai-half main "$KAI_HALF_BYTES"
      entries "$NS_K" kai-quarter main "$KAI_QUARTER_BYTES"
      entries "$NS_K" hami main "$HAMI_BYTES"
    fi
    [ -z "${MPS_BYTES:-}" ] || entries "$NS_K" mps main "$MPS_BYTES"
    if [ -n "$HOST_PROC" ]; then
      entries "$NS_C" multi forker 1Gi
      entries "$NS_C" multi solo "$SOLO_BYTES"
      entries "$NS_C" slow main "$SLOW_BYTES"
    fi
  } | paste -sd, -)
  cat > "$WORK/sample.json" <<EOF
{
  "version": 1,
  "host": "gpubudget-e2e-$ID phase $1",
  "gpus": [
    {"index": 0, "uuid": "GPU-e2e00000-0000-0000-0000-000000000000", "name": "replayed e2e GPU",
     "memory_total_bytes": "80Gi",
     "processes": [$procs]}
  ]
}
EOF
  kubectl create configmap "$SAMPLE_CM" -n "$NS" --from-file=sample.json="$WORK/sample.json" \
    --dry-run=client -o yaml | kubectl apply -f - >/dev/null
  kubectl annotate pods -n "$NS" -l app.kubernetes.io/component=agent "e2e.gpubudget.io/sample-phase=$1" \
    --overwrite >/dev/null 2>&1 || true
  info "sample phase $1: llm-evict $2, trainer $3, llm-b 1Gi, other-b 2Gi${HOST_PROC:+, multi: forker 1Gi per process, solo $SOLO_BYTES (by host PID: $(grep -o '"pid"' "$WORK/sample.json" | wc -l) processes)}"
}
apply_budget() { # NAME NAMESPACE SPEC (flow-style YAML)
  printf 'apiVersion: gpubudget.io/v1alpha1\nkind: GpuMemoryBudget\nmetadata: {name: %s, namespace: %s}\nspec: %s\n' "$1" "$2" "$3" \
    | kubectl apply -f - | sed 's/^/    /'
}

# --- The agent's evictions, probed: dry-run evictions through the API server as the agent's service account ---
# The chart sends the agent's evictions (and only those: matchConditions on its username) to the operator's
# webhook, failurePolicy Fail, behind a Service of the operator pods. A probe POSTs a policy/v1 Eviction with
# dryRun=All (admission runs, webhooks included, since the webhook declares sideEffects None; nothing is evicted)
# twice: with a token of the agent's service account bound to the pod's node (the webhook must allow: 201) and
# with one bound to nothing (the webhook must deny, saying why: 403). Anything else (500 "failed calling webhook"
# because no replica answered, a timeout) is a failure: the agent's eviction would have been refused.
# probe_setup: what the probes and agent_metrics reach the API server with: API_SERVER and CURL_TLS (curl's
# TLS options), and AGENT_ADMIN_PORT (the agent's admin port, for its /metrics through the API server's proxy).
probe_setup() {
  API_SERVER=$(kubectl config view --raw --minify -o jsonpath='{.clusters[0].cluster.server}')
  CURL_TLS=(--insecure)
  if [ "$(kubectl config view --raw --minify -o jsonpath='{.clusters[0].cluster.insecure-skip-tls-verify}')" != true ]; then
    CA_FILE=$(kubectl config view --raw --minify -o jsonpath='{.clusters[0].cluster.certificate-authority}')
    if [ -z "$CA_FILE" ]; then
      CA_FILE=$WORK/api-ca.crt
      kubectl config view --raw --minify -o jsonpath='{.clusters[0].cluster.certificate-authority-data}' | base64 -d > "$CA_FILE"
    fi
    CURL_TLS=(--cacert "$CA_FILE")
  fi
  AGENT_ADMIN_PORT=$(kubectl get pod "$AGENT_POD" -n "$NS" -o jsonpath='{.spec.containers[0].ports[0].containerPort}')
}
# probe_eviction TOKEN NAMESPACE POD: one dry-run eviction; prints "<http code> <seconds> <message>".
probe_eviction() {
  local out body=$WORK/probe.$BASHPID
  out=$(curl -sS "${CURL_TLS[@]}" --max-time 15 -o "$body" -w '%{http_code} %{time_total}' -X POST \
    -H "Authorization: Bearer $1" -H 'Content-Type: application/json' \
    --data "{\"apiVersion\":\"policy/v1\",\"kind\":\"Eviction\",\"metadata\":{\"name\":\"$3\",\"namespace\":\"$2\"}}" \
    "$API_SERVER/api/v1/namespaces/$2/pods/$3/eviction?dryRun=All" 2>/dev/null) || true
  printf '%s %s\n' "${out:-000 0}" "$(jq -r '.message // empty' "$body" 2>/dev/null | tr '\n' ' ' | cut -c1-300)"
}
# agent_tokens NODE: BOUND_TOKEN (the agent's service account, bound to NODE, as the kubelet's projected token
# names it) and UNBOUND_TOKEN (the same account, bound to nothing).
agent_tokens() {
  BOUND_TOKEN=$(kubectl create token "$AGENT_SA" -n "$NS" --bound-object-kind Node --bound-object-name "$1" --duration 1h)
  UNBOUND_TOKEN=$(kubectl create token "$AGENT_SA" -n "$NS" --duration 1h)
}
# probe_classify WHO LINE: "allowed|denied|FAILED(WHO) LINE" for a line of probe_eviction.
probe_classify() {
  case "$1:$2" in
    bound:201\ *) echo "allowed $2" ;;
    unbound:403\ *"denied the request"*"may evict only pods of its own node"*) echo "denied $2" ;;
    *) echo "FAILED($1) $2" ;;
  esac
}
# start_probes LOG NAMESPACE POD: in the background until stop_probes, a bound and an unbound probe of the pod
# after another (pause 0.1 s), one classified line each in LOG.
start_probes() {
  rm -f "$WORK/stop-probes"
  : > "$1"
  (
    while [ ! -e "$WORK/stop-probes" ]; do
      probe_classify bound "$(probe_eviction "$BOUND_TOKEN" "$2" "$3")" >> "$1"
      probe_classify unbound "$(probe_eviction "$UNBOUND_TOKEN" "$2" "$3")" >> "$1"
      sleep 0.1
    done
  ) &
  PROBE_PID=$!
}
stop_probes() { touch "$WORK/stop-probes"; wait "$PROBE_PID" || true; PROBE_PID=""; }
# probe_summary LOG: "N requests (A allowed, D denied by the webhook), F failed; latency p50 X ms, p99 Y ms, max Z ms".
probe_summary() {
  awk '{n++; if ($1 ~ /^FAILED/) f++; else if ($1 == "allowed") a++; else d++; print $3}
       END {printf "%d %d %d %d\n", n, a, d, f > "/dev/stderr"}' "$1" 2>"$WORK/probe-counts" | sort -n > "$WORK/probe-latency"
  read -r n a d f < "$WORK/probe-counts"
  pct() { awk -v q="$1" '{v[NR] = $1} END {i = int(NR * q); if (i < NR * q) i++; if (i < 1) i = 1; printf "%d", v[i] * 1000}' "$WORK/probe-latency"; }
  echo "$n requests ($a allowed, $d denied by the webhook), $f failed; latency p50 $(pct 0.5) ms, p99 $(pct 0.99) ms, max $(pct 1) ms"
  PROBE_TOTAL=$n PROBE_FAILED=$f
}
# probe_check LOG WHAT: the summary; every failure printed and fatal.
probe_check() {
  probe_summary "$1" > "$WORK/probe-summary"
  info "figure: the agent's evictions checked $2: $(cat "$WORK/probe-summary")"
  [ "$PROBE_TOTAL" -gt 0 ] || die "no eviction probe ran $2"
  if [ "$PROBE_FAILED" != 0 ]; then
    grep '^FAILED' "$1" | head -n 10 | sed 's/^/    /'
    die "$PROBE_FAILED of $PROBE_TOTAL of the agent's evictions were not answered by the eviction check $2"
  fi
}
# agent_on NODE: the agent pod of that node.
agent_on() {
  kubectl get pods -n "$NS" -l app.kubernetes.io/component=agent --field-selector "spec.nodeName=$1" -o jsonpath='{.items[0].metadata.name}'
}
# agent_metrics NODE: the /metrics of that node's agent.
agent_metrics() { kubectl get --raw "/api/v1/namespaces/$NS/pods/$(agent_on "$1"):$AGENT_ADMIN_PORT/proxy/metrics"; }
# agent_evictions NODE: that agent's eviction requests by result ("accepted=N blocked=N ..."), from
# gpubudget_evictions_total.
agent_evictions() {
  agent_metrics "$1" | sed -n 's/^gpubudget_evictions_total{result="\([a-z]*\)"} \([0-9]*\).*/\1=\2/p' | sort | paste -sd' ' -
}
