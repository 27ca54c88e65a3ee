#!/usr/bin/env bash
# The committed release dry runs (release/results/*-dry-run.txt, written by `bash release/dry-run.sh`,
# docs/release.md "A release, dry") say what a passing run says: no FAIL anywhere, every step PASS, and each line
# of their SHA256SUMS names a release file they list, with the same sum. The dry run itself is not run here: its
# release builds take longer than CI's budget. Its scripts must still parse (bash -n, python3 compile). Needs
# bash, grep, sed, awk and python3 only.
set -euo pipefail
cd "$(dirname "$0")/.."
fail() { printf 'FAIL (.ci/release-results.sh): %s\n' "$*" >&2; exit 1; }

bash -n release/dry-run.sh || fail "release/dry-run.sh does not parse"
python3 -c 'import ast, sys; ast.parse(open(sys.argv[1]).read())' release/oci_image.py \
  || fail "release/oci_image.py does not parse"

shopt -s nullglob
results=(release/results/*-dry-run.txt)
[ "${#results[@]}" -gt 0 ] || fail "no release/results/*-dry-run.txt"
for r in "${results[@]}"; do
  ! grep -n 'FAIL' "$r" || fail "$r says FAIL (a committed result never does: rerun release/dry-run.sh)"
  steps=$(sed -n '/^steps /,/^$/p' "$r" | sed '1d;/^$/d')
  [ -n "$steps" ] || fail "$r: no steps"
  ! grep -v '^  PASS  ' <<<"$steps" || fail "$r: a step line above is not PASS"
  files=$(sed -n '/^release files /,/^$/p' "$r" | sed '1d;/^$/d')
  sums=$(sed -n '/^SHA256SUMS /,/^$/p' "$r" | sed '1d;/^$/d')
  [ -n "$files" ] && [ -n "$sums" ] || fail "$r: no release files or no SHA256SUMS"
  while read -r sum name; do
    awk -v s="$sum" -v n="$name" '$2 == s && $3 == n { found = 1 } END { exit !found }' <<<"$files" \
      || fail "$r: SHA256SUMS names $name ($sum), which the release files do not list with that sum"
  done <<<"$sums"
  echo "$r: $(wc -l <<<"$steps") steps PASS, $(wc -l <<<"$sums") files in SHA256SUMS, each listed with its sum"
done
