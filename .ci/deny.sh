#!/usr/bin/env bash
# cargo-deny: licenses, bans and sources against deny.toml (docs/security.md, "Supply chain"). Advisories need
# the RustSec database from github.com, which this build network cannot reach: they are not checked here.
#
# Needs: cargo and crates.io. cargo-deny is installed (pinned, --locked) under $GPUBUDGET_CI_CACHE (default
# /tmp/gpubudget-ci-cache) the first time: about 10 minutes of compiling on 2 cores, then cached.
set -euo pipefail
cd "$(dirname "$0")/.."

CARGO_DENY_VERSION=0.20.2
CACHE=${GPUBUDGET_CI_CACHE:-/tmp/gpubudget-ci-cache}
ROOT="$CACHE/cargo-deny-$CARGO_DENY_VERSION"
DENY="$ROOT/bin/cargo-deny"

if [ ! -x "$DENY" ]; then
  echo "installing cargo-deny $CARGO_DENY_VERSION into $ROOT"
  cargo install cargo-deny --version "$CARGO_DENY_VERSION" --locked --root "$ROOT" --target-dir "$CACHE/cargo-deny-target" --quiet
  rm -rf "$CACHE/cargo-deny-target"
fi
"$DENY" --version
# cargo-deny reads `cargo metadata` for every platform: fetch every crate of Cargo.lock first (a build fetches
# only the host's; windows-sys and friends would be missing on a fresh machine), then check offline.
cargo fetch --locked --quiet
# --offline: Cargo.lock and the local registry cache are enough for these three checks.
"$DENY" --offline check licenses bans sources
