# syntax=docker/dockerfile:1
# gpubudget node agent. Build from the repository root (BuildKit, the default since Docker 23):
#   docker build -f docker/agent.Dockerfile -t <registry>/gpubudget-agent:<tag> .
#
# The runtime base is glibc (Debian bookworm-slim): nvml-wrapper dlopens libnvidia-ml.so.1 at run time, which
# the NVIDIA container runtime mounts into the container (runtimeClassName nvidia, NVIDIA_DRIVER_CAPABILITIES
# =utility) and registers with the container's ldconfig. A musl or scratch image could not load it. The image
# carries no NVIDIA library itself, so it runs anywhere; without NVML it reports so (or replays a sample).
ARG RUST_VERSION=1.89

FROM rust:${RUST_VERSION}-bookworm AS build
WORKDIR /src
COPY . .
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/src/target \
    cargo build --release --locked -p gpubudget-agent \
    && install -D -m 0755 target/release/gpubudget-agent /out/gpubudget-agent

FROM debian:bookworm-slim
COPY --from=build /out/gpubudget-agent /usr/local/bin/gpubudget-agent
# Non-root (the chart sets the same): reading /proc/<pid>/cgroup and NVML need no root (docs/operations.md).
# A UID of its own (the chart's default too): see charts/gpubudget/values.yaml agent.podSecurityContext.
USER 64001:64001
ENTRYPOINT ["/usr/local/bin/gpubudget-agent"]
CMD ["run"]
