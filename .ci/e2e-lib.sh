#!/usr/bin/env bash
# CI: the e2e scripts stand on one shell library, e2e/lib.sh (#55). Read from the files, nothing run against a
# cluster or a GPU:
#   - every e2e script sources e2e/lib.sh, directly or through the tier file it sources (e2e/cluster/lib.sh,
#     e2e/cluster/nri-lib.sh, e2e/gpu/lib.sh, e2e/gpu-node/lib.sh, each sourcing it); what a script sources is
#     what its `# shellcheck source=PATH` lines name where the next line sources a file (PATH from the script's
#     folder, else from the repository root); the stories (e2e/cluster/stories/) are sourced by run.sh, in its shell, and count as part of it;
#   - no function of e2e/lib.sh is defined again anywhere under e2e/, and no function of a tier file is defined
#     again in a script that sources it (which definition wins would depend on the order of the sources);
#   - every command a wait retries (`wait_for DESCRIPTION NAME ...`, `until_ok SECONDS NAME ...`) is a function some
#     e2e script or library defines, or a program (a wait on a function nobody defines retries "command not found"
#     until it times out: e2e/cluster lost condition_is so, found only on the real node);
#   - the library's own functions behave: say/info/pass/record_fail print their one format, failures_exit
#     exits 1 after a record_fail, wait_for gives up after STEP_TIMEOUT (status 1, "timed out"), die runs ON_DIE.
# Needs: bash, git, sed, grep.
set -euo pipefail
cd "$(dirname "$0")/.."

fail() { printf 'FAIL (.ci/e2e-lib.sh): %s\n' "$*" >&2; exit 1; }
LIB=e2e/lib.sh
# defs FILE...: the names of the functions the files define (NAME() {, at any indentation).
defs() { sed -nE 's/^[[:space:]]*([A-Za-z_][A-Za-z0-9_]*)\(\)[[:space:]]*\{.*/\1/p' "$@" | sort -u; }
# sources FILE: the files its `# shellcheck source=` lines name where the next line sources a file (`. ` or
# `source `), as paths from the repository root.
sources() {
  local dir path
  dir=$(dirname "$1")
  # shellcheck disable=SC2013 # the paths are words
  for path in $(awk '/^[[:space:]]*(\.|source)[[:space:]]/ && p != "" {print p} {p = ""}
                     match($0, /^[[:space:]]*# shellcheck source=[^ ]+/) {p = substr($0, RSTART, RLENGTH); sub(/.*source=/, "", p)}' "$1"); do
    [ "$path" != /dev/null ] || continue
    if [ -f "$dir/$path" ]; then realpath --relative-to=. "$dir/$path"; else echo "$path"; fi
  done
}
# closure FILE: the files it sources, and those they source, transitively.
closure() {
  local todo=("$1") seen=" " f s
  while [ "${#todo[@]}" -gt 0 ]; do
    f=${todo[0]}; todo=("${todo[@]:1}")
    for s in $(sources "$f"); do
      [[ "$seen" == *" $s "* ]] && continue
      seen+="$s "; todo+=("$s"); echo "$s"
    done
  done
}

mapfile -t scripts < <(git ls-files -- 'e2e/*.sh' 'e2e/**/*.sh' | sort -u)
[ "${#scripts[@]}" -gt 0 ] || fail "no e2e script"
lib_defs=$(defs "$LIB")
[ -n "$lib_defs" ] || fail "no function in $LIB"
checked=0
for script in "${scripts[@]}"; do
  [ "$script" != "$LIB" ] || continue
  case $script in e2e/cluster/stories/*) continue ;; esac
  files=("$script")
  [ "$script" != e2e/cluster/run.sh ] || files+=(e2e/cluster/stories/*.sh)
  # Redefined from e2e/lib.sh, anywhere.
  again=$(comm -12 <(echo "$lib_defs") <(defs "${files[@]}"))
  [ -z "$again" ] || fail "$script defines again what $LIB defines: $(echo "$again" | paste -sd' ' -)"
  libs=$(closure "$script")
  grep -qx "$LIB" <<<"$libs" || fail "$script does not source $LIB (directly or through its tier's file; its shellcheck source= lines say: $(echo "$libs" | paste -sd' ' -))"
  for lib in $libs; do
    [ "$lib" != "$LIB" ] || continue
    again=$(comm -12 <(defs "$lib") <(defs "${files[@]}"))
    [ -z "$again" ] || fail "$script defines again what $lib (which it sources) defines: $(echo "$again" | paste -sd' ' -)"
  done
  checked=$((checked + 1))
done

# What the waits retry: a function defined under e2e/, or one of the programs the scripts wait on.
all_defs=$(defs "${scripts[@]}")
programs=" bash sh kubectl grep test eval curl "
waited=0
while IFS=: read -r file name; do
  waited=$((waited + 1))
  grep -qx "$name" <<<"$all_defs" || [[ "$programs" == *" $name "* ]] \
    || fail "$file waits on $name, which no e2e script or library defines (and is not one of:$programs)"
done < <(awk '!/^[[:space:]]*#/ {print FILENAME ":" $0}' "${scripts[@]}" \
           | sed -nE 's/^([^:]+):.*(wait_for[[:space:]]+("[^"]*"|'"'"'[^'"'"']*'"'"')|until_ok[[:space:]]+[^[:space:]]+)[[:space:]]+([A-Za-z_][A-Za-z0-9_-]*).*/\1:\4/p')
[ "$waited" -gt 0 ] || fail "no wait found in the e2e scripts"

# The functions themselves, in a shell of their own each time (die and failures_exit exit).
run() { bash -c "set -euo pipefail; . $LIB; $1" 2>&1; }
out=$(run 'say a step; info a line; pass it held; record_fail it broke')
grep -qxE '=== \[[0-9]+\.[0-9] s\] a step' <<<"$out" || fail "say: '$out'"
grep -qxE '    \[[0-9]+\.[0-9] s\] a line' <<<"$out" || fail "info: '$out'"
grep -qx '    PASS: it held' <<<"$out" || fail "pass: '$out'"
grep -qx '    FAIL: it broke' <<<"$out" || fail "record_fail: '$out'"
out=$(run 'record_fail one; record_fail two; failures_exit; echo not reached') && fail "failures_exit after a record_fail exited 0: '$out'"
grep -q 'not reached' <<<"$out" && fail "failures_exit went on after a record_fail: '$out'"
grep -qE '=== \[.*\] FAILED \([0-9]+ s\)' <<<"$out" || fail "failures_exit: no FAILED line: '$out'"
out=$(run 'pass fine; failures_exit') || fail "failures_exit without a record_fail exited nonzero: '$out'"
grep -qE '=== \[.*\] PASS \([0-9]+ s\)' <<<"$out" || fail "failures_exit: no PASS line: '$out'"
out=$(run 'POLL=0.1 STEP_TIMEOUT=1 wait_for "a file that never comes" test -e /nonexistent/e2e-lib; echo not reached') \
  && fail "wait_for did not give up: '$out'"
grep -qx 'FAIL: timed out after 1s waiting for: a file that never comes' <<<"$out" || fail "wait_for's timeout: '$out'"
# shellcheck disable=SC2016 # expanded by the inner bash
out=$(run 'n=0; bump() { n=$((n + 1)); [ "$n" -ge 3 ]; }; POLL=0.1 STEP_TIMEOUT=5 wait_for "three tries" bump') \
  || fail "wait_for failed on a command that succeeds on its third try: '$out'"
grep -qE '^    \[.*\] ok: three tries$' <<<"$out" || fail "wait_for's ok line: '$out'"
out=$(run 'POLL=0.1; until_ok 1 false || echo gave up') || fail "until_ok: '$out'"
[ "$out" = "gave up" ] || fail "until_ok printed or did not give up: '$out'"
out=$(run 'why() { echo diagnosed; }; ON_DIE=why; die it broke; echo not reached') && fail "die exited 0: '$out'"
[ "$out" = $'FAIL: it broke\ndiagnosed' ] || fail "die: '$out'"

echo "e2e scripts: $checked on $LIB (and their stories), no function defined twice, $waited waits on defined functions or programs; $(echo "$lib_defs" | wc -l) functions in $LIB, its output, waits and failures as documented"
