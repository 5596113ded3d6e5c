# Sourced by the image scripts: ENGINE_NAME (podman, else docker; CONTAINER_ENGINE overrides),
# ENGINE (the command to run it) and BUILD_FLAGS. podman here runs containers with runc and cgroupfs and no default ulimits
# (docker/containers.conf): crun refuses hybrid cgroup hierarchies and some VMs cannot raise
# the default ulimits. It builds in docker format: the OCI format has no HEALTHCHECK.
ENGINE=${CONTAINER_ENGINE:-$(command -v podman || command -v docker || true)}
[ -n "$ENGINE" ] || { echo "neither podman nor docker is installed" >&2; exit 1; }
ENGINE_NAME=$(basename "$ENGINE")
ENGINE=$ENGINE_NAME
BUILD_FLAGS=()
if [ "$ENGINE_NAME" = podman ]; then
    export CONTAINERS_CONF=${CONTAINERS_CONF:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)/docker/containers.conf}
    command -v runc >/dev/null && ENGINE="podman --runtime runc"
    BUILD_FLAGS=(--format docker)
fi
