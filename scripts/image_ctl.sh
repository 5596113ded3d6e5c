#!/usr/bin/env bash
# Run the CPU image in the background on the host network, or stop it:
#
#   scripts/image_ctl.sh run [PORT] [IMAGE] [NAME]    # waits until GET /health answers 200
#   scripts/image_ctl.sh stop [NAME]
#
# The container is named NAME (default pagedllama); PAGEDLLAMA_* variables of the caller are
# passed in. On the host network the server listens on $HOST (default 127.0.0.1: this machine
# only, as `make run`; HOST=0.0.0.0 for every interface).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/container_engine.sh
NAME=pagedllama

run() {
    local port=${1:-8000} image=${2:-localhost/pagedllama:cpu} env_args=()
    NAME=${3:-$NAME}
    for var in $(compgen -e | grep '^PAGEDLLAMA_' || true); do env_args+=(-e "$var"); done
    $ENGINE rm -f "$NAME" >/dev/null 2>&1 || true          # a stopped one from before
    $ENGINE run -d --name "$NAME" --network host -e "HOST=${HOST:-127.0.0.1}" -e "PORT=$port" \
        "${env_args[@]}" \
        "$image" >/dev/null
    echo ">> $NAME ($image) starting on port $port"
    for _ in $(seq 120); do
        if python3 -c "import urllib.request as u; u.urlopen('http://127.0.0.1:$port/health', timeout=2)" 2>/dev/null; then
            echo ">> healthy: http://127.0.0.1:$port   (make image-stop stops it)"
            return 0
        fi
        if [ "$($ENGINE inspect --format '{{.State.Running}}' "$NAME" 2>/dev/null)" != true ]; then
            echo "the container exited; its log:" >&2
            $ENGINE logs --tail 30 "$NAME" >&2 || true
            return 1
        fi
        sleep 1
    done
    echo "not healthy after 120 s; logs:" >&2
    $ENGINE logs --tail 30 "$NAME" >&2 || true
    return 1
}

stop() {
    NAME=${1:-$NAME}
    # SIGTERM: the server drains its running requests, then exits
    if $ENGINE stop --time 30 "$NAME" >/dev/null 2>&1; then
        echo ">> stopped $NAME"
    else
        echo ">> $NAME is not running"
    fi
    $ENGINE rm -f "$NAME" >/dev/null 2>&1 || true
}

case "${1:-}" in
    run) shift; run "$@" ;;
    stop) shift; stop "$@" ;;
    *) echo "usage: $0 run [PORT] [IMAGE] [NAME] | stop [NAME]" >&2; exit 2 ;;
esac
