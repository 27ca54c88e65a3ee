#!/usr/bin/env bash
# The Dockerfiles stay true (no container engine needed): what docker/*.Dockerfile builds, what the chart runs
# and what the real-node tier (e2e/cluster/realk8s.sh) runs must agree, for the agent and the operator:
#   - the binary: `cargo build --release --locked -p gpubudget-<comp>` with the crate's default features, in
#     the Dockerfile and in realk8s.sh (no --features, --all-features or --no-default-features in either);
#   - the entrypoint: /usr/local/bin/gpubudget-<comp>, where the Dockerfile copies the binary; realk8s.sh
#     reads it from the Dockerfile; the chart sets no `command:` (it would override the entrypoint);
#   - the arguments: the Dockerfile's CMD ["run"] is the chart's args ["run"];
#   - the user: the Dockerfile's USER uid:gid is the chart's default podSecurityContext runAsUser:runAsGroup
#     (the real-node tier's images carry no USER; the chart's securityContext sets it, and run.sh checks the
#     running process's UID against the Dockerfile).
set -euo pipefail
cd "$(dirname "$0")/.."

fail() { printf 'FAIL (.ci/dockerfiles.sh): %s\n' "$*" >&2; exit 1; }
FEATURE_FLAGS='--(features|all-features|no-default-features)|(^|[[:space:]])-F[[:space:]]'

REALK8S=e2e/cluster/realk8s.sh
build=$(grep -E 'cargo build --release' "$REALK8S") || fail "$REALK8S: no cargo build --release line"
! grep -Eq -- "$FEATURE_FLAGS" <<<"$build" || fail "$REALK8S builds with feature flags: $build"
grep -q 'sed -n .s/^ENTRYPOINT' "$REALK8S" || fail "$REALK8S no longer reads the entrypoint from the Dockerfile"

for comp in agent operator; do
  df=docker/$comp.Dockerfile
  bin=/usr/local/bin/gpubudget-$comp
  case $comp in
    agent) template=charts/gpubudget/templates/agent/daemonset.yaml ;;
    operator) template=charts/gpubudget/templates/operator/deployment.yaml ;;
  esac

  line=$(grep -E 'cargo build --release' "$df") || fail "$df: no cargo build --release"
  grep -Eq -- "--locked -p gpubudget-$comp([[:space:]]|$)" <<<"$line" || fail "$df builds something else: $line"
  ! grep -Eq -- "$FEATURE_FLAGS" <<<"$line" || fail "$df builds with feature flags ($line); realk8s.sh builds the defaults"
  grep -Eq -- "-p gpubudget-$comp([[:space:])]|$)" <<<"$build" || fail "$REALK8S does not build gpubudget-$comp"

  [ "$(sed -n 's/^ENTRYPOINT //p' "$df")" = "[\"$bin\"]" ] || fail "$df: ENTRYPOINT is not [\"$bin\"]"
  grep -Eq "^COPY --from=build /out/gpubudget-$comp $bin\$" "$df" || fail "$df does not copy the binary to $bin"
  cmd=$(sed -n 's/^CMD //p' "$df")
  args=$(sed -n 's/^[[:space:]]*args: //p' "$template" | head -n1)
  [ -n "$cmd" ] && [ "$cmd" = "$args" ] || fail "$df CMD $cmd differs from the chart's args $args ($template)"
  ! grep -Eq '^[[:space:]]*command:' "$template" || fail "$template sets command:, overriding the image's entrypoint"

  user=$(sed -n 's/^USER //p' "$df")
  section=$(sed -n "/^$comp:/,/^[a-z]/p" charts/gpubudget/values.yaml)
  uid=$(sed -n 's/^[[:space:]]*runAsUser: *\([0-9]*\).*/\1/p' <<<"$section" | head -n1)
  gid=$(sed -n 's/^[[:space:]]*runAsGroup: *\([0-9]*\).*/\1/p' <<<"$section" | head -n1)
  [ "$user" = "$uid:$gid" ] || fail "$df USER $user differs from the chart's $comp runAsUser:runAsGroup $uid:$gid"
  echo "$comp: cargo build --release --locked -p gpubudget-$comp (default features), entrypoint $bin, args $cmd, user $user: Dockerfile, chart and realk8s.sh agree"
done
