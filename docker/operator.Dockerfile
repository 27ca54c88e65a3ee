# syntax=docker/dockerfile:1
# gpubudget operator. Build from the repository root (BuildKit, the default since Docker 23):
#   docker build -f docker/operator.Dockerfile -t <registry>/gpubudget-operator:<tag> .
#
# The operator needs no NVIDIA library: a distroless glibc image (libc and libgcc only, no shell), non-root.
# TLS to the API server uses rustls with the service account's CA, so no system CA bundle is needed.
ARG RUST_VERSION=1.89

FROM rust:${RUST_VERSION}-bookworm AS build
WORKDIR /src
COPY . .
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/src/target \
    cargo build --release --locked -p gpubudget-operator \
    && install -D -m 0755 target/release/gpubudget-operator /out/gpubudget-operator

FROM gcr.io/distroless/cc-debian12:nonroot
COPY --from=build /out/gpubudget-operator /usr/local/bin/gpubudget-operator
USER 65532:65532
ENTRYPOINT ["/usr/local/bin/gpubudget-operator"]
CMD ["run"]
