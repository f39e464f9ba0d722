# The prefixlb image: one static binary on a distroless base, run as a
# non-root user. The Qwen3 tokenizer ("--tokenizer=qwen3") and the
# dashboard are embedded in the binary; any other tokenizer is a mounted
# model directory. Build and push: docs/kubernetes.md.
#
#   docker build -t ghcr.io/OWNER/prefixlb:TAG .
#   docker buildx build --platform linux/amd64,linux/arm64 -t ghcr.io/OWNER/prefixlb:TAG --push .

# The toolchain go.mod asks for (its go line).
ARG GO_VERSION=1.26.8

FROM --platform=$BUILDPLATFORM golang:${GO_VERSION}-bookworm AS build
ARG TARGETOS=linux
ARG TARGETARCH=amd64
WORKDIR /src
# Modules first, so a source change does not download them again.
COPY go.mod go.sum ./
RUN go mod download
COPY cmd ./cmd
COPY internal ./internal
# Static (no cgo: every dependency is pure Go), reproducible paths,
# cross-compiled for the target platform on the build platform.
RUN CGO_ENABLED=0 GOOS=$TARGETOS GOARCH=$TARGETARCH \
    go build -trimpath -ldflags='-s -w' -o /out/prefixlb ./cmd/prefixlb

# distroless/static: CA certificates, tzdata, /etc/passwd with nonroot
# (uid 65532), no shell and no package manager.
FROM gcr.io/distroless/static-debian12:nonroot
COPY --from=build /out/prefixlb /usr/local/bin/prefixlb
USER 65532:65532
# epp: gRPC ext-proc 9002, gRPC health 9003, metrics 9090 (deploy/epp.yaml);
# serve listens where --listen says.
EXPOSE 9002 9003 9090
ENTRYPOINT ["/usr/local/bin/prefixlb"]
