#!/usr/bin/env bash
# CI for the chart's alerts: the PrometheusRule as the chart renders it (metrics.prometheusRule.enabled) is
# extracted to a rule file, `promtool check rules` and `promtool test rules charts/gpubudget/ci/alerts-test.yaml`
# run on it. That the alerts' series exist in the binaries' /metrics is demo/tests/alerts.rs (cargo test).
#
# Needs: promtool (Debian's `prometheus` package: installed here with apt-get when missing, as root), helm (as
# .ci/helm.sh installs it into $GPUBUDGET_CI_CACHE; run first when missing), python3 with PyYAML.
set -euo pipefail
cd "$(dirname "$0")/.."

CHART=charts/gpubudget
CACHE=${GPUBUDGET_CI_CACHE:-/tmp/gpubudget-ci-cache}
WORK=$(mktemp -d "${TMPDIR:-/tmp}/gpubudget-promtool.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
fail() { printf 'FAIL: %s\n' "$*" >&2; exit 1; }

if ! command -v promtool >/dev/null 2>&1; then
  [ "$(id -u)" = 0 ] || fail "promtool missing: install Debian's prometheus package (apt-get install prometheus)"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  # --no-install-recommends: promtool only (the package's server is installed but not started in CI).
  apt-get install -y -qq --no-install-recommends prometheus >/dev/null
fi
echo "promtool: $(promtool --version 2>&1 | head -n1)"

HELM=$(find "$CACHE/helm" -type f -name helm 2>/dev/null | head -n1 || true)
if [ -z "$HELM" ]; then
  bash .ci/helm.sh >/dev/null
  HELM=$(find "$CACHE/helm" -type f -name helm | head -n1)
fi
python3 -c 'import yaml' 2>/dev/null || fail "python3 without PyYAML (Debian: python3-yaml)"

"$HELM" template gpubudget "$CHART" --namespace gpubudget --kube-version 1.33.0 \
  --set metrics.prometheusRule.enabled=true --show-only templates/prometheusrule.yaml > "$WORK/rendered.yaml"
python3 - "$WORK/rendered.yaml" "$WORK/alerts.rules.yaml" <<'PY'
import sys, yaml
doc = yaml.safe_load(open(sys.argv[1]))
assert doc["kind"] == "PrometheusRule", doc["kind"]
yaml.safe_dump(doc["spec"], open(sys.argv[2], "w"), sort_keys=False)
PY
cp "$CHART/ci/alerts-test.yaml" "$WORK/"
promtool check rules "$WORK/alerts.rules.yaml"
(cd "$WORK" && promtool test rules alerts-test.yaml)

# Every alert is tested and has its runbook section in docs/operations.md.
python3 - "$WORK/alerts.rules.yaml" "$CHART/ci/alerts-test.yaml" docs/operations.md <<'PY'
import re, sys, yaml
rules = [r for g in yaml.safe_load(open(sys.argv[1]))["groups"] for r in g["rules"]]
tests = yaml.safe_load(open(sys.argv[2]))["tests"]
fired = {t["alertname"] for test in tests for t in test.get("alert_rule_test", []) if t.get("exp_alerts")}
anchors = {re.sub(r"[^a-z0-9-]", "", l[4:].strip().lower().replace(" ", "-")) for l in open(sys.argv[3]) if l.startswith("### ")}
errors = []
for r in rules:
    name = r["alert"]
    if name not in fired:
        errors.append(f"{name}: no test in which it fires")
    runbook = r.get("annotations", {}).get("runbook", "")
    if runbook != f"docs/operations.md#{name.lower()}" or name.lower() not in anchors:
        errors.append(f"{name}: no runbook section '### {name}' in docs/operations.md (annotation: {runbook!r})")
if errors:
    sys.exit("\n".join("FAIL " + e for e in errors))
print(f"{len(rules)} alerts: each fires in a test and has its runbook")
PY
