#!/usr/bin/env bash
# Build the CPU image with podman or docker (whichever exists):
#
#   scripts/build_image.sh [IMAGE]       # IMAGE defaults to localhost/pagedllama:cpu
#   DOCKERFILE=docker/Dockerfile.router scripts/build_image.sh localhost/pagedllama-router:haproxy-2.6
#
# BASE_IMAGE (default python:3.11-slim) is the base; if it is neither present nor pullable
# and was not asked for by name, a local base is made from Debian's packages
# (scripts/base_image.sh) and used instead. Prints the build time and the image size.
set -euo pipefail
cd "$(dirname "$0")/.."

IMAGE=${1:-localhost/pagedllama:cpu}
DEFAULT_BASE=python:3.11-slim
LOCAL_BASE=localhost/bookworm-python:3.11
BASE=${BASE_IMAGE:-$DEFAULT_BASE}
source scripts/container_engine.sh

have_image() { $ENGINE image inspect "$1" >/dev/null 2>&1; }

if ! have_image "$BASE" && ! timeout 120 $ENGINE pull "$BASE" >/dev/null 2>&1; then
    if [ -n "${BASE_IMAGE:-}" ]; then
        echo "base image $BASE is neither present nor pullable" >&2
        exit 1
    fi
    echo ">> $BASE cannot be pulled (no registry in reach): making $LOCAL_BASE from Debian packages"
    [ "$ENGINE_NAME" = podman ] || { echo "a local base needs podman (podman import)" >&2; exit 1; }
    scripts/base_image.sh "$LOCAL_BASE"
    BASE=$LOCAL_BASE
fi

# pip behind a TLS-inspecting proxy (PIP_CERT set on the host): that bundle is mounted for the
# build steps only (podman build -v), never copied into a layer
CA_FLAGS=()
if [ -n "${PIP_CERT:-}" ] && [ -f "$PIP_CERT" ] && [ "$ENGINE_NAME" = podman ]; then
    CA_FLAGS=(-v "$PIP_CERT:/tmp/pip-ca.crt:ro" --build-arg PIP_CA_BUNDLE=/tmp/pip-ca.crt)
fi

echo ">> building $IMAGE from $BASE with $ENGINE (the server's image compiles llama.cpp: minutes)"
start=$(date +%s)
$ENGINE build "${BUILD_FLAGS[@]}" "${CA_FLAGS[@]}" --network host --build-arg "BASE=$BASE" \
    -f "${DOCKERFILE:-docker/Dockerfile}" -t "$IMAGE" .
echo ">> built $IMAGE in $(( $(date +%s) - start )) s; size: $($ENGINE image inspect \
    --format '{{.Size}}' "$IMAGE" | awk '{printf "%.0f MB", $1 / 1e6}')"
