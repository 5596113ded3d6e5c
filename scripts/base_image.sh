#!/usr/bin/env bash
# Make a local base image with Python 3.11 from Debian's packages, for machines where no
# container registry is reachable but a Debian mirror is (debootstrap + podman import):
#
#   scripts/base_image.sh [IMAGE]        # IMAGE defaults to localhost/bookworm-python:3.11
#
# The mirror is the one apt on this machine already uses (/etc/apt/sources.list*). Debian
# 12 (bookworm) ships Python 3.11, the version of the default base, python:3.11-slim.
# Needs root, podman and debootstrap. Does nothing if the image exists.
set -euo pipefail

IMAGE=${1:-localhost/bookworm-python:3.11}
SUITE=${SUITE:-bookworm}
ENGINE=${CONTAINER_ENGINE:-podman}

if $ENGINE image exists "$IMAGE" 2>/dev/null; then
    echo "$IMAGE exists"
    exit 0
fi

mirror() {
    local uri
    uri=$(grep -hs '^URIs:' /etc/apt/sources.list.d/*.sources | awk '{print $2}' |
          grep -v security | head -n1 || true)
    if [ -z "$uri" ]; then
        uri=$(grep -hs '^deb ' /etc/apt/sources.list /etc/apt/sources.list.d/*.list |
              grep -v security | awk '{print $2}' | grep -i debian | head -n1 || true)
    fi
    [ -n "$uri" ] || { echo "no Debian mirror found in apt's sources" >&2; exit 1; }
    echo "$uri"
}

ROOTFS=$(mktemp -d /tmp/pagedllama-rootfs.XXXXXX)
trap 'rm -rf "$ROOTFS"' EXIT
MIRROR=$(mirror)
echo ">> debootstrap $SUITE from $MIRROR into $ROOTFS"
debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates,passwd \
    "$SUITE" "$ROOTFS" "$MIRROR" >/dev/null
# the image's apt uses the same mirror for the build's own apt-get install
echo "deb $MIRROR $SUITE main" > "$ROOTFS/etc/apt/sources.list"
rm -rf "$ROOTFS"/var/lib/apt/lists/* "$ROOTFS"/var/cache/apt/archives/*.deb
tar -C "$ROOTFS" -c . | $ENGINE import --change 'CMD ["/bin/bash"]' - "$IMAGE" >/dev/null
echo "$IMAGE"
