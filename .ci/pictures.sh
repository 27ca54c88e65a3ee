#!/usr/bin/env bash
# The pictures stay what their sources say (docs/pictures/generate.sh): the architecture diagram from
# architecture.dot, the plots from the committed real-GPU and real-node results. Regenerates them all, fails
# when a committed SVG differs from what its sources give (or one is missing or not committed), or when a picture
# is not readable (generate.sh's checks: a text cut off, outside its box or on another, an edge through a label,
# bars or lines drawn on one another; docs/pictures/README.md), and checks that a second run gives the same bytes.
#
# Needs: Debian's graphviz and fonts-dejavu-core (apt-get, as root or through sudo, when dot is missing);
# python3 with pip, for the pinned packages of docs/pictures/requirements.txt (in a venv, or `pip --target`
# where python3-venv is missing), cached in $GPUBUDGET_CI_CACHE (default /tmp/gpubudget-ci-cache).
# A drift after a Graphviz or package upgrade (not a source change): regenerate with
# `bash docs/pictures/generate.sh` and commit the SVGs.
set -euo pipefail
cd "$(dirname "$0")/.."

CACHE=${GPUBUDGET_CI_CACHE:-/tmp/gpubudget-ci-cache}
REQUIREMENTS=docs/pictures/requirements.txt
WORK=$(mktemp -d "${TMPDIR:-/tmp}/gpubudget-pictures-ci.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
fail() { printf 'FAIL (.ci/pictures.sh): %s\n' "$*" >&2; exit 1; }

if ! command -v dot >/dev/null 2>&1 || ! fc-list 2>/dev/null | grep -q 'DejaVuSans\.ttf'; then
  SUDO=()
  [ "$(id -u)" = 0 ] || SUDO=(sudo)
  "${SUDO[@]}" env DEBIAN_FRONTEND=noninteractive apt-get update -qq
  "${SUDO[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends graphviz fonts-dejavu-core >/dev/null
fi
echo "dot: $(dot -V 2>&1)"

# The packages, pinned: a venv keyed by the requirements' contents, so a changed pin installs afresh.
KEY=$(sha256sum "$REQUIREMENTS" | cut -c1-12)
VENV="$CACHE/pictures-$KEY"
PY="$VENV/bin/python"
export PIP_ROOT_USER_ACTION=ignore PIP_DISABLE_PIP_VERSION_CHECK=1
if ! "$PY" -c 'import matplotlib' 2>/dev/null; then
  rm -rf "$VENV"
  mkdir -p "$CACHE"
  if python3 -m venv "$VENV" >/dev/null 2>&1 && "$PY" -m pip --version >/dev/null 2>&1; then
    "$PY" -m pip install --quiet -r "$REQUIREMENTS"
  else
    # No python3-venv (ensurepip) on this machine: install into a private directory instead.
    rm -rf "$VENV"
    python3 -m pip install --quiet --target "$VENV/lib" -r "$REQUIREMENTS"
    mkdir -p "$VENV/bin"
    # shellcheck disable=SC2016 # $PYTHONPATH and $@ belong to the wrapper
    printf '#!/bin/sh\nPYTHONPATH="%s${PYTHONPATH:+:$PYTHONPATH}" exec python3 "$@"\n' "$VENV/lib" > "$PY"
    chmod +x "$PY"
  fi
  "$PY" -c 'import matplotlib' || fail "matplotlib did not install from $REQUIREMENTS"
fi
echo "matplotlib: $("$PY" -c 'import matplotlib; print(matplotlib.__version__)')"

PYTHON="$PY" bash docs/pictures/generate.sh
untracked=$(git status --porcelain --untracked-files=all -- 'docs/pictures/*.svg' | grep '^??' || true)
[ -z "$untracked" ] || fail "pictures generated but not committed: $untracked"
git diff --exit-code --stat -- 'docs/pictures/*.svg' \
  || fail "the committed pictures differ from what their sources give: run bash docs/pictures/generate.sh and commit"

PYTHON="$PY" bash docs/pictures/generate.sh "$WORK/again" >/dev/null
for svg in docs/pictures/*.svg; do
  cmp -s "$svg" "$WORK/again/$(basename "$svg")" || fail "$svg: a second run gave other bytes (not deterministic)"
done
echo "pictures: $(find docs/pictures -maxdepth 1 -name '*.svg' | wc -l) SVGs regenerated from their sources, no drift, the same bytes twice"
