#!/usr/bin/env bash
# The release, dry: runs the steps of .github/workflows/release.yml on this machine, end to end where a machine
# without the forge can, on a clean clone of the committed tree, and writes what it made (each file's size and
# SHA-256, the SHA256SUMS, the rendered krew manifest, the release notes) into a result file. Nothing is pushed,
# signed or uploaded. docs/release.md says what only the forge does.
#
#   bash release/dry-run.sh [RESULT]      # default release/results/<UTC date>-dry-run.txt
#
# Each workflow step with a `run:` block is run as the workflow has it: its script is read from release.yml
# (python3 with PyYAML), with the workflow's environment and stand-ins for what GitHub supplies (GITHUB_OUTPUT,
# RUNNER_TEMP, GITHUB_PATH; OWNER and REPO: $OWNER, default dry-run, and $REPO, default dry-run/gpubudget). Where a
# step cannot run as written here, the result file lists the change under "substitutions" and why. The images
# are not built with Buildx (that needs a Docker daemon, and the Dockerfiles' base images from a registry): each
# is assembled as an OCI image (linux/amd64) from the same release binary the Dockerfile builds (`cargo build
# --release --locked -p gpubudget-<component>`, read from the Dockerfile), with the Dockerfile's ENTRYPOINT, CMD
# and USER, and its entrypoint is run from the unpacked image as that user (chroot, as root) with --version.
#
# Needs: git, cargo with the x86_64-unknown-linux-musl target (rustup target add x86_64-unknown-linux-musl) and
# a musl C compiler for ring (Debian: apt-get install musl-tools),
# python3 with PyYAML, npm (the workflow installs Helm from npm) or HELM=/path/to/helm 3.10.1, sha256sum, tar,
# gzip, ldd, and root for the chroot check (without root the check is skipped and the result says so).
# CARGO_TARGET_DIR is honoured (a warm one saves the release builds). A step that fails stops the run, and no
# result file is written: a committed result never says FAIL.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
export LC_ALL=C
DATE=$(date -u +%Y-%m-%d)
RESULT=${1:-$ROOT/release/results/$DATE-dry-run.txt}
OWNER=${OWNER:-dry-run}
REPO=${REPO:-dry-run/gpubudget}
WORKFLOW=.github/workflows/release.yml
COMMIT=$(git rev-parse HEAD)
DIRTY=$(git status --porcelain --untracked-files=no | wc -l)

WORK=$(mktemp -d "${TMPDIR:-/tmp}/gpubudget-release-dry-run.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
LOG=$WORK/log.txt
REPORT=$WORK/report.txt
: >"$REPORT"
fail() {
  printf 'FAIL (release/dry-run.sh): %s\n' "$*" >&2
  [ -s "$LOG" ] && tail -n 40 "$LOG" >&2
  echo "no result written (a committed result never says FAIL); the steps that passed:" >&2
  cat "$REPORT" >&2
  exit 1
}
report() { printf '%s\n' "$*" >>"$REPORT"; }
SUBSTITUTIONS=()
substitution() { SUBSTITUTIONS+=("$*"); }

# The script of a step of release.yml (by job and step name or id), and the workflow's own env, as shell.
step_script() {
  python3 - "$WORKFLOW" "$1" "$2" <<'PY'
import sys, yaml
wf = yaml.safe_load(open(sys.argv[1]))
steps = wf["jobs"][sys.argv[2]]["steps"]
hit = [s for s in steps if sys.argv[3] in (s.get("name"), s.get("id"))]
assert len(hit) == 1 and "run" in hit[0], f"no run: step {sys.argv[3]!r} in job {sys.argv[2]!r}"
print(hit[0]["run"])
PY
}
workflow_env() {
  python3 - "$WORKFLOW" <<'PY'
import shlex, sys, yaml
for k, v in yaml.safe_load(open(sys.argv[1])).get("env", {}).items():
    print(f"export {k}={shlex.quote(str(v))}")
PY
}

# Runs a step of the workflow in directory $1 (job $2, step $3), with the changes $4... (sed expressions, each
# listed in the result), timing it.
run_step() {
  local dir=$1 job=$2 name=$3
  shift 3
  local script
  script=$(step_script "$job" "$name") || fail "release.yml: no step '$name' in job '$job'"
  for expr in "$@"; do
    local before=$script
    script=$(sed -e "$expr" <<<"$script")
    [ "$script" != "$before" ] || fail "release.yml step '$name': the change '$expr' no longer applies (the workflow changed: update dry-run.sh)"
  done
  local t0=$SECONDS
  (cd "$dir" && bash -euo pipefail -c "$script") >>"$LOG" 2>&1 || fail "release.yml job $job, step '$name'"
  report "$(printf 'PASS  %-46s %4d s   release.yml job %s, step %s' "$job: $name" $((SECONDS - t0)) "$job" "'$name'")"
}
timed() { # timed LABEL WHAT COMMAND...
  local label=$1 what=$2
  shift 2
  local t0=$SECONDS
  "$@" >>"$LOG" 2>&1 || fail "$label"
  report "$(printf 'PASS  %-46s %4d s   %s' "$label" $((SECONDS - t0)) "$what")"
}

# --- a clean clone of the committed tree, as the forge checks it out ---------------------------------------------
SRC=$WORK/src
git clone -q --no-local --no-checkout "$ROOT" "$SRC"
git -C "$SRC" checkout -q --detach "$COMMIT"
if [ -n "${CARGO_TARGET_DIR:-}" ]; then
  # The workflow reads target/<triple>/release/…: the tree's target/ is the warm one.
  mkdir -p "$CARGO_TARGET_DIR"
  ln -s "$CARGO_TARGET_DIR" "$SRC/target"
  unset CARGO_TARGET_DIR
fi
eval "$(workflow_env)"
VERSION=$(sed -n '/^\[workspace\.package\]/,/^\[/s/^version = "\(.*\)"$/\1/p' Cargo.toml)
export TAG=v$VERSION OWNER REPO
export SOURCE_DATE_EPOCH
SOURCE_DATE_EPOCH=$(git log -1 --format=%ct "$COMMIT")
export RUNNER_TEMP=$WORK/runner GITHUB_OUTPUT=$WORK/github-output GITHUB_PATH=$WORK/github-path
mkdir -p "$RUNNER_TEMP"
: >"$GITHUB_OUTPUT"
: >"$GITHUB_PATH"

# --- job version --------------------------------------------------------------------------------------------------
run_step "$SRC" version version
if ! grep -qx "version=$VERSION" "$GITHUB_OUTPUT" || ! grep -qx "owner=$OWNER" "$GITHUB_OUTPUT"; then
  fail "the version step wrote $(tr '\n' ' ' <"$GITHUB_OUTPUT")"
fi
export VERSION

# --- job images (Buildx is the forge's: assembled from the release binaries instead) ------------------------------
IMAGES=$WORK/images
mkdir -p "$IMAGES"
for comp in agent operator; do
  df=$SRC/docker/$comp.Dockerfile
  build=$(grep -o 'cargo build --release --locked -p gpubudget-[a-z]*' "$df") || fail "$df: no cargo build line"
  timed "images: $comp: release binary" "\`$build\` (the Dockerfile's build, native x86_64 glibc)" \
    bash -c "cd '$SRC' && $build"
  entry=$(sed -n 's/^ENTRYPOINT \["\([^"]*\)"\]$/\1/p' "$df")
  cmd=$(sed -n 's/^CMD \["\([^"]*\)"\]$/\1/p' "$df")
  user=$(sed -n 's/^USER //p' "$df")
  base=$(sed -n 's/^FROM \([^ ]*\)$/\1/p' "$df" | tail -n1)
  [ -n "$entry" ] && [ -n "$cmd" ] && [ -n "$user" ] || fail "$df: ENTRYPOINT, CMD or USER not found"
  out=$IMAGES/gpubudget-$comp-$VERSION-linux-amd64.oci.tar
  timed "images: $comp: OCI image" "from the binary and the libraries ldd names; ENTRYPOINT $entry, CMD $cmd, USER $user (the Dockerfile's; its base $base not pulled)" \
    python3 "$ROOT/release/oci_image.py" "$out" "ghcr.io/$OWNER/gpubudget-$comp:$VERSION" "$entry" "$cmd" "$user" \
    "$SRC/target/release/gpubudget-$comp=$entry"
  if [ "$(id -u)" = 0 ] && command -v chroot >/dev/null; then
    rootfs=$WORK/rootfs-$comp
    python3 "$ROOT/release/oci_image.py" --unpack "$out" "$rootfs" || fail "images: $comp: cannot unpack $out"
    version_out=$(chroot --userspec="$user" "$rootfs" "$entry" --version 2>&1) || fail "images: $comp: $entry --version in the image: $version_out"
    report "$(printf 'PASS  %-46s %4d s   %s' "images: $comp: runs" 0 "chroot --userspec=$user <unpacked image> $entry --version: $version_out")"
  else
    substitution "images: $comp: the entrypoint was not run from the unpacked image (not root, or no chroot here)"
  fi
done
substitution "job images: Buildx (docker/build-push-action) needs a Docker daemon and the base images from a registry; this machine has the docker CLI ($(docker --version 2>/dev/null || echo none)) and no daemon. Each image was assembled as an OCI image for linux/amd64 from the release binary the Dockerfile builds, with its ENTRYPOINT, CMD and USER; the Dockerfile's base image (debian:bookworm-slim, distroless/cc) is replaced by the glibc libraries ldd names, and the build's toolchain is this machine's ($(cargo --version)), not rust:\${RUST_VERSION}-bookworm."

# --- job plugin: the linux/amd64 leg (static musl, as the workflow builds it; without cross) -----------------------
export TARGET=x86_64-unknown-linux-musl CROSS=false
MUSL_CC=$(command -v x86_64-linux-musl-gcc || command -v musl-gcc || echo none)
MUSL_CC="$MUSL_CC ($(dpkg -S "$(readlink -f "$MUSL_CC")" 2>/dev/null | cut -d: -f1 || true))"
if ! command -v x86_64-linux-musl-gcc >/dev/null && command -v musl-gcc >/dev/null; then
  # ring's C and assembly for musl: cross's image brings a musl toolchain; here Debian's musl-tools.
  export CC_x86_64_unknown_linux_musl=musl-gcc
  substitution "job plugin: CC_x86_64_unknown_linux_musl=musl-gcc (Debian's musl-tools) for ring's C code, where cross's image brings its own musl toolchain."
fi
run_step "$SRC" plugin build
run_step "$SRC" plugin "smoke test (native targets)"
file "$SRC/out/$PLUGIN" | grep -q 'statically linked\|static-pie linked' || fail "$PLUGIN is not static: $(file "$SRC/out/$PLUGIN")"
substitution "job plugin: only its linux/amd64 leg ran (the target x86_64-unknown-linux-musl built with cargo, CROSS=false: cross runs its build in a container, which needs a Docker daemon; ring's C code built with this machine's musl compiler, in tools above, not the one in cross's image); linux/arm64 (cross) and darwin amd64/arm64 (a macOS runner) are the forge's."
# actions/download-artifact: each leg's artifact in plugins/plugin-<os>-<arch>/.
mkdir -p "$SRC/plugins/plugin-linux-amd64"
cp "$SRC/out/$PLUGIN" "$SRC/plugins/plugin-linux-amd64/$PLUGIN"

# --- job release ----------------------------------------------------------------------------------------------------
if [ -n "${HELM:-}" ]; then
  mkdir -p "$RUNNER_TEMP/bin"
  ln -s "$HELM" "$RUNNER_TEMP/bin/helm"
  echo "$RUNNER_TEMP/bin" >>"$GITHUB_PATH"
  substitution "job release, step helm: HELM=$HELM ($("$HELM" version --short)) instead of the npm install"
else
  run_step "$SRC" release helm
fi
PATH=$(tr '\n' ':' <"$GITHUB_PATH")$PATH
export PATH
HELM_VERSION=$(helm version --short)
run_step "$SRC" release "plugin archives" 's/-eq 4 \]/-eq 1 ]/'
substitution "job release, step plugin archives: expects 1 archive, not 4 (-eq 4 → -eq 1): the other three legs of job plugin are the forge's."
run_step "$SRC" release chart
# render.sh fills a checksum for every platform of the template: here only linux/amd64 was built, so the
# template is cut to that platform (in the clone) before the step runs render.sh.
python3 - "$SRC/kubectl-plugin/krew/gpubudget.yaml" <<'PY'
import re, sys
path = sys.argv[1]
text = open(path).read()
head, _, platforms = text.partition("  platforms:\n")
entries = re.split(r"(?m)^(?=    - selector:)", platforms)
kept = [e for e in entries if not e.startswith("    - selector:") or "linux-amd64" in e]
assert len(entries) - len(kept) == 3, "the template has not four platforms"
open(path, "w").write(head + "  platforms:\n" + "".join(kept))
PY
run_step "$SRC" release "checksums and krew manifest"
substitution "job release, step checksums and krew manifest: the krew template cut to its linux/amd64 platform (the one archive built here) before render.sh; the forge renders all four."
run_step "$SRC" release "release notes"
[ -s "$SRC/notes.md" ] || fail "no release notes"

# --- what it made ----------------------------------------------------------------------------------------------------
DIST=$SRC/dist
{
  echo "gpubudget release dry-run: .github/workflows/release.yml's steps on this machine (bash release/dry-run.sh)"
  echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  echo "commit: $COMMIT$([ "$DIRTY" = 0 ] || echo " (the working tree had $DIRTY uncommitted changes: not in the dry-run, which clones the commit)")"
  echo "tag: $TAG (the crates' version); owner: $OWNER, repository: $REPO (stand-ins for github.repository_owner and github.repository)"
  echo "machine: $(nproc) CPU cores, $(uname -m), $(sed -n 's/^PRETTY_NAME="\(.*\)"$/\1/p' /etc/os-release), kernel $(uname -r); docker: $(docker --version 2>/dev/null || echo none), daemon: $(docker info >/dev/null 2>&1 && echo running || echo none)"
  echo "tools: $(cargo --version); helm $HELM_VERSION; $(python3 --version); $(tar --version | head -n1); $(gzip --version | head -n1); musl C compiler for ring: $MUSL_CC"
  echo "took: $SECONDS s in all (the release builds reuse CARGO_TARGET_DIR's dependencies where it is set)"
  echo
  echo "steps (every one PASS, or there is no result file):"
  sed 's/^/  /' "$REPORT"
  echo
  echo "release files (dist/, what the GitHub release would carry), bytes and sha256:"
  (cd "$DIST" && for f in *; do printf '  %10d  %s  %s\n' "$(stat -c %s "$f")" "$(sha256sum "$f" | cut -c1-64)" "$f"; done)
  echo
  echo "images (not pushed; OCI archives of linux/amd64 only, assembled here: see substitutions), bytes and sha256:"
  (cd "$IMAGES" && for f in *.oci.tar; do
    printf '  %10d  %s  %s\n' "$(stat -c %s "$f")" "$(sha256sum "$f" | cut -c1-64)" "$f"
    printf '              manifest %s\n' "$(tar -xOf "$f" index.json | python3 -c 'import json,sys; print(json.load(sys.stdin)["manifests"][0]["digest"])')"
  done)
  echo
  echo "SHA256SUMS (dist/SHA256SUMS as written):"
  sed 's/^/  /' "$DIST/SHA256SUMS"
  echo
  echo "the krew manifest (dist/gpubudget.yaml), platforms:"
  grep -E '^\s+(uri|sha256):' "$DIST/gpubudget.yaml" | sed 's/^ */  /'
  echo
  echo "the chart (dist/gpubudget-$VERSION.tgz): $(tar -xOzf "$DIST/gpubudget-$VERSION.tgz" gpubudget/Chart.yaml | grep -E '^(version|appVersion|home):' | tr '\n' ' ')"
  echo "  images it renders: $(helm template gpubudget "$DIST/gpubudget-$VERSION.tgz" --namespace gpubudget --kube-version 1.37.0 | sed -n 's/^ *image: //p' | tr -d '"' | sort -u | tr '\n' ' ')"
  echo "  CRDs in gpubudget-crds-$VERSION.yaml: $(grep -c '^kind: CustomResourceDefinition$' "$DIST/gpubudget-crds-$VERSION.yaml")"
  echo
  echo "the release notes (notes.md): $(wc -l <"$SRC/notes.md") lines, the CHANGELOG.md section of $VERSION then the install commands; first lines:"
  sed '/./,$!d' "$SRC/notes.md" | head -n 4 | sed 's/^/  | /'
  echo
  echo "substitutions (what ran otherwise than on the forge, and why):"
  for s in "${SUBSTITUTIONS[@]}"; do printf '  - %s\n' "$s"; done
  echo
  echo "not run here (only the forge can; docs/release.md, \"What only the forge does\"):"
  echo "  - the tag push that starts the workflow, and GitHub's checkout and artifact actions"
  echo "  - job images: Buildx for linux/amd64 and linux/arm64 (QEMU) from the base images, the SBOM and provenance"
  echo "    attestations (signed by the forge), the push to ghcr.io with the job's GITHUB_TOKEN"
  echo "  - job plugin: linux/arm64 (cross) and darwin amd64/arm64 (macOS runner)"
  echo "  - job release: helm registry login and helm push of the chart to oci://ghcr.io/<owner>/charts; the GitHub"
  echo "    release (softprops/action-gh-release) with its files; making the ghcr.io packages public"
  echo "  - after the release: the krew-index pull request, if the plugin is to be in krew's index"
} >"$WORK/result.txt"
! grep -q 'FAIL' "$WORK/result.txt" || fail "the result says FAIL somewhere"
mkdir -p "$(dirname "$RESULT")"
cp "$WORK/result.txt" "$RESULT"
echo "release dry-run: every step PASS; result written to $RESULT"
