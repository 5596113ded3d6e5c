#!/usr/bin/env bash
# Build llama-cpp-python, at the version requirements.txt pins, from its sdist with this
# project's patches to the llama.cpp it vendors (scripts/patches/*.patch, each says why), as a
# wheel cached by version, patches and CMAKE_ARGS. `make setup` installs that wheel before the
# rest of the requirements, so pip finds llama-cpp-python satisfied.
#
#   scripts/build_llama_cpp_python.sh [PYTHON]     # prints the wheel's path on the last line
#
# CMAKE_ARGS passes through (the Makefile's: no AMX); JOBS sets the build jobs (default: the
# cores this process may use); PAGEDLLAMA_WHEEL_CACHE the cache folder (default
# ~/.cache/pagedllama/wheels). The first build takes several minutes on 2 cores.
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
. "$ROOT/scripts/llama_source.sh"
PYTHON=${1:-$ROOT/.venv/bin/python}
JOBS=${JOBS:-$(nproc)}
CMAKE_ARGS=${CMAKE_ARGS:-}
# the Python package needs libllama and ggml only (not the multimodal library)
CMAKE_ARGS="$CMAKE_ARGS -DLLAVA_BUILD=OFF"

PATCHES=("$ROOT"/scripts/patches/*.patch)
KEY=$( (cat "${PATCHES[@]}"; echo "$CMAKE_ARGS") | sha256sum | cut -c1-16)
CACHE=${PAGEDLLAMA_WHEEL_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/pagedllama/wheels}
CACHE=$CACHE/llama_cpp_python-$LLAMA_CPP_PYTHON_VERSION-$KEY

wheel() { find "$CACHE" -maxdepth 1 -name 'llama_cpp_python-*.whl' 2>/dev/null | head -n 1; }
if [ -n "$(wheel)" ]; then
    wheel
    exit 0
fi

WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
SRC=$(llama_source "$WORK" "$PYTHON")
for p in "${PATCHES[@]}"; do
    echo ">> applying $(basename "$p")" >&2
    patch -d "$SRC" -p1 --forward --quiet < "$p"
done
mkdir -p "$CACHE"
echo ">> building llama-cpp-python $LLAMA_CPP_PYTHON_VERSION (patched) into $CACHE" >&2
CMAKE_ARGS="$CMAKE_ARGS" CMAKE_BUILD_PARALLEL_LEVEL=$JOBS \
    "$PYTHON" -m pip wheel --quiet --no-deps -w "$WORK/wheel" "$SRC" >&2
mv "$WORK"/wheel/llama_cpp_python-*.whl "$CACHE"/
wheel
