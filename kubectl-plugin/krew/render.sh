#!/usr/bin/env bash
# Renders the krew manifest template (gpubudget.yaml beside this script) for one release, on stdout:
#   render.sh TAG OWNER/REPO SHA256SUMS > gpubudget.yaml
# TAG must be v<the manifest's spec.version> (the crate's version); SHA256SUMS is `sha256sum` output naming every
# archive the template lists. Fails, printing nothing, on a version mismatch, a missing or malformed checksum,
# or a placeholder left over. Used by .github/workflows/release.yml and checked by .ci/workflows.sh.
set -euo pipefail
fail() { printf 'render.sh: %s\n' "$*" >&2; exit 1; }
[ $# -eq 3 ] || fail "usage: render.sh TAG OWNER/REPO SHA256SUMS"
tag=$1 repo=$2 sums=$3
template="$(dirname "$0")/gpubudget.yaml"

version=$(sed -n 's/^  version: //p' "$template")
[ "$tag" = "$version" ] || fail "tag $tag is not the manifest's spec.version $version (bump the crates' version and the manifest together)"
[[ $repo =~ ^[A-Za-z0-9_.-]+/[A-Za-z0-9_.-]+$ ]] || fail "not an owner/repo: $repo"
[ -r "$sums" ] || fail "cannot read $sums"

# The template's leading comments are for this repository, not for krew users: replaced by one line.
out=$(printf '# kubectl gpubudget %s, rendered from kubectl-plugin/krew/gpubudget.yaml by render.sh\n' "$tag"
  sed -e '/^#/d' -e "s|{{TAG}}|$tag|g" -e "s|{{REPO}}|$repo|g" "$template")
archives=$(grep -o '{{SHA256:[^}]*}}' <<<"$out" | sed 's/^{{SHA256:\(.*\)}}$/\1/' | sort -u)
[ -n "$archives" ] || fail "no {{SHA256:…}} placeholder in $template"
for archive in $archives; do
  # sha256sum writes "<hex>  <name>" (or "<hex> *<name>" in binary mode).
  sum=$(awk -v f="$archive" '$2 == f || $2 == "*" f { print $1 }' "$sums")
  [[ $sum =~ ^[0-9a-f]{64}$ ]] || fail "no single sha256 for $archive in $sums"
  out=${out//"{{SHA256:$archive}}"/$sum}
done
! grep -n '{{' <<<"$out" >&2 || fail "placeholders left (above)"
printf '%s\n' "$out"
