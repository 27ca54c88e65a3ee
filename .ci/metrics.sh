#!/usr/bin/env bash
# CI: the real binaries' /metrics against docs/metrics.md. The demo serves the in-memory API (a fake, not a
# cluster) with its budgets and pods; the real `gpubudget-operator run` and `gpubudget-agent run` (replaying the
# H100 recording, agent/tests/fixtures/h100-sample.json) run against it as separate processes; each admin port's
# /metrics is scraped once the component is ready, and every family in it must be a row of docs/metrics.md for
# that binary.
#
# One way only: a family with labels is not in /metrics until its first series (prometheus-client leaves empty
# families out), so a row can be missing here without being wrong. The other way, and types and labels, are
# demo/tests/metrics.rs (cargo test), which sets a series in every family of both registries. This script
# catches what that test cannot: a family registered by a binary outside those registries.
#
# Needs: the binaries `cargo test --workspace` builds (target/debug; built here if missing), bash's /dev/tcp.
set -euo pipefail
cd "$(dirname "$0")/.."

WORK=$(mktemp -d "${TMPDIR:-/tmp}/gpubudget-metrics.XXXXXX")
PIDS=()
# shellcheck disable=SC2329 # run by the EXIT trap below
cleanup() {
  for pid in "${PIDS[@]}"; do kill "$pid" 2>/dev/null || true; done
  wait 2>/dev/null || true
  rm -rf "$WORK"
}
trap cleanup EXIT
fail() {
  printf 'FAIL: %s\n' "$*" >&2
  for log in "$WORK"/*.log; do [ -e "$log" ] && { echo "--- $log"; tail -n 20 "$log"; } >&2; done
  exit 1
}

# As .ci/run builds (so that the binaries `cargo test --workspace` built there are reused, not rebuilt).
export CARGO_INCREMENTAL=${CARGO_INCREMENTAL:-0}
export CARGO_PROFILE_DEV_DEBUG=${CARGO_PROFILE_DEV_DEBUG:-line-tables-only}
export CARGO_PROFILE_TEST_DEBUG=${CARGO_PROFILE_TEST_DEBUG:-line-tables-only}
# The test profile's binaries (the same features as `cargo test --workspace`, so nothing is rebuilt after it).
cargo test --workspace --locked --no-run --quiet 2>/dev/null || cargo test --workspace --locked --no-run
BIN=target/debug
for b in gpubudget-demo gpubudget-operator gpubudget-agent; do
  [ -x "$BIN/$b" ] || cargo build --locked --quiet --bin "$b"
done

# HTTP/1.0 GET on 127.0.0.1:PORT; prints the body, fails unless the answer is 200.
get() {
  local response
  response=$( { exec 3<>"/dev/tcp/127.0.0.1/$1" && printf 'GET %s HTTP/1.0\r\nHost: localhost\r\n\r\n' "$2" >&3 && cat <&3; } 2>/dev/null ) || return 1
  [[ "$response" == "HTTP/1.1 200"* || "$response" == "HTTP/1.0 200"* ]] || return 1
  printf '%s\n' "${response#*$'\r\n\r\n'}"
}

# Polls until `get PORT PATH` answers 200, at most SECONDS seconds (a condition wait, not a fixed sleep).
wait_ok() {
  local deadline=$((SECONDS + $3))
  until get "$1" "$2" >/dev/null; do
    [ "$SECONDS" -lt "$deadline" ] || return 1
    sleep 0.2
  done
}

port=$((20000 + RANDOM % 20000))
AGENT_PORT=$port OPERATOR_PORT=$((port + 1))

"$BIN/gpubudget-demo" --listen 127.0.0.1:0 --kubeconfig "$WORK/kubeconfig" >"$WORK/demo.log" 2>&1 &
PIDS+=($!)
deadline=$((SECONDS + 60))
until grep -q "^in-memory API server" "$WORK/demo.log" && [ -s "$WORK/kubeconfig" ]; do
  [ "$SECONDS" -lt "$deadline" ] || fail "the demo's in-memory API did not start"
  sleep 0.2
done
export KUBECONFIG="$WORK/kubeconfig"

"$BIN/gpubudget-operator" run --admin-addr "127.0.0.1:$OPERATOR_PORT" >"$WORK/operator.log" 2>&1 &
PIDS+=($!)
mkdir -p "$WORK/proc"
"$BIN/gpubudget-agent" run --node-name gpu-node-1 --sample-file agent/tests/fixtures/h100-sample.json \
  --proc-root "$WORK/proc" --admin-addr "127.0.0.1:$AGENT_PORT" >"$WORK/agent.log" 2>&1 &
PIDS+=($!)

# The agent is ready once it has sampled the recording and its caches have listed; the operator's admin port
# serves /metrics from its start (it waits for the CRD to be established, which the in-memory API does not
# report, so it is never ready here: its families are registered all the same).
wait_ok "$AGENT_PORT" /ready 60 || fail "the agent was not ready within 60 s"
wait_ok "$OPERATOR_PORT" /metrics 60 || fail "the operator's /metrics did not answer within 60 s"

status=0
for component in agent operator; do
  port_var="${component^^}_PORT"
  metrics=$(get "${!port_var}" /metrics) || fail "$component: /metrics"
  families=$(printf '%s\n' "$metrics" | awk '$1 == "#" && $2 == "TYPE" { print $3, $4 }')
  [ -n "$families" ] || fail "$component: no family in /metrics"
  n=0 unlisted=0
  while read -r name type; do
    n=$((n + 1))
    queried=$name
    [ "$type" = counter ] && queried="${name}_total"
    if ! grep -qE "^\| \`$queried\` \| $type \|[^|]*\| $component \|" docs/metrics.md; then
      printf 'FAIL: %s exports %s (%s), which docs/metrics.md does not list for it\n' "$component" "$queried" "$type" >&2
      unlisted=$((unlisted + 1))
      status=1
    fi
  done <<<"$families"
  echo "$component: $n families in the real binary's /metrics, $unlisted of them not in docs/metrics.md"
done
exit "$status"
