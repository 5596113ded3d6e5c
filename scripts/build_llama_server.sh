#!/usr/bin/env bash
# Build llama.cpp's `llama-server` (the peer for benchmarks/compare.py) from the
# llama-cpp-python sdist on PyPI, i.e. the same llama.cpp our engine links against.
#
#   scripts/build_llama_server.sh [DEST]      # DEST defaults to .peer/ (git-ignored)
#
# Prints the binary's path on the last line. Takes several minutes of CPU on 2 cores;
# JOBS=N sets the parallel build jobs (default 2). Nothing here is committed.
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
. "$ROOT/scripts/llama_source.sh"
DEST=${1:-$ROOT/.peer}
JOBS=${JOBS:-2}
PYTHON=${PYTHON:-$ROOT/.venv/bin/python}
[ -x "$PYTHON" ] || PYTHON=python3

mkdir -p "$DEST"
DEST=$(cd "$DEST" && pwd)
SRC=$(llama_source "$DEST" "$PYTHON")

# No AMX: Xeons that report it in these VMs crash in ggml's AMX kernels (see the Makefile).
NO_AMX="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
cmake -S "$SRC/vendor/llama.cpp" -B "$DEST/build" \
    -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF -DGGML_NATIVE=ON \
    -DCMAKE_C_FLAGS="$NO_AMX" -DCMAKE_CXX_FLAGS="$NO_AMX"
cmake --build "$DEST/build" --target llama-server -j"$JOBS"

BIN=$DEST/build/bin/llama-server
"$BIN" --version >&2 || true
echo "$BIN"
