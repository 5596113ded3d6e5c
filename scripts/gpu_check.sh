#!/usr/bin/env bash
# The CUDA path on a lent GPU machine (the `device` tool of this workplace): a prepared check
# that fits its short lease. Run from the repository root there:
#
#   scripts/gpu_check.sh setup    # unpack what travelled, install the wheels, show the machine
#   scripts/gpu_check.sh probe    # GPU against CPU in one process (benchmarks/tools/gpu_probe.py)
#   scripts/gpu_check.sh tests    # the integration tests with every layer offloaded
#   scripts/gpu_check.sh bench    # benchmarks.compare (vs llama-server, CUDA) / core / prefix /
#                                 # chunking at 1, 16 and 64 concurrent
#   scripts/gpu_check.sh probe tests   # several stages in one call
#
# What it expects under .gpu/ (git-ignored, carried there in three calls: scripts/gpu_pack.sh
# lays it out and lists the calls; scripts/build_cuda_llama.sh makes cuda.tar.xz on any machine
# with nvcc, no GPU needed):
#   cuda.tar.xz      libllama/libggml*/libmtmd built with GGML_CUDA from llama-cpp-python's
#                    vendored llama.cpp, llama-server from the same build, libcudart
#   model.part*      the default GGUF, split (one call carries at most 64 MiB)
#   whl/             wheels the machine lacks (fastapi, uvicorn, openai, ...), Python 3.12
#   llama_cpp_py/    llama-cpp-python's Python package (the same version as requirements.txt)
# cuBLAS comes from the machine (PyTorch's nvidia-cublas wheel). Output goes to $OUT (or
# .gpu/out) as well as to stdout.
set -uo pipefail
ROOT=$(pwd)
G=$ROOT/.gpu
OUT=${OUT:-$G/out}
mkdir -p "$OUT" models
MODEL=models/SmolLM2-135M-Instruct.Q4_1.gguf
log() { echo ">> $(date +%T) $*"; }

# --- assemble what travelled in pieces (kept on the machine between calls) -------------------
# the model: its parts in path order, kept only if the whole has the sha256 that travelled
if [ ! -s "$MODEL" ] && [ -f "$G/model.sha256" ] && ls "$G"/*/model.part* >/dev/null 2>&1; then
    cat $(ls "$G"/*/model.part* | sort) > "$MODEL.tmp"
    if [ "$(sha256sum < "$MODEL.tmp" | cut -d' ' -f1)" = "$(cat "$G/model.sha256")" ]; then
        mv "$MODEL.tmp" "$MODEL"
    else
        rm -f "$MODEL.tmp"; log "model: not all parts here yet"
    fi
fi
[ -s "$MODEL" ] && log "model $(stat -c %s "$MODEL") bytes, sha256 verified"
if [ ! -d "$G/site" ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
        --target "$G/site" "$G"/*/whl/*.whl \
        && cp -r "$(ls -d "$G"/*/llama_cpp_py/llama_cpp | head -1)" "$G/site/" || rm -rf "$G/site"
fi
TARBALL=$(ls "$G"/cuda.tar.xz "$G"/*/cuda.tar.xz 2>/dev/null | head -1)
if [ ! -e "$G/cuda/llama-server" ] && [ -n "$TARBALL" ]; then
    mkdir -p "$G/cuda" && tar -xJf "$TARBALL" -C "$G/cuda"
fi
CUBLAS_DIR=$(dirname "$(find /opt /usr -name 'libcublas.so.13*' 2>/dev/null | grep -v /.gpu/ | head -1)")
export PYTHONPATH=$G/site:$ROOT
export LD_LIBRARY_PATH=$G/cuda:$CUBLAS_DIR:/usr/local/nvidia/lib64:${LD_LIBRARY_PATH:-}
export LLAMA_CPP_LIB_PATH=$G/cuda
export LLAMA_SERVER_BIN=$G/cuda/llama-server
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 HF_HUB_OFFLINE=1

setup() {
    log "setup"
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm --format=csv
    grep -m1 "model name" /proc/cpuinfo; nproc
    grep -o -m1 -w "avx2\|avx512f" /proc/cpuinfo | sort -u | tr '\n' ' '; echo
    python3 --version; echo "cublas: $CUBLAS_DIR"
    [ -e "$G/cuda/libggml-cuda.so" ] && ldd "$G/cuda/libggml-cuda.so" | grep -E "not found|cublas|cudart|libcuda"
    [ -x "$LLAMA_SERVER_BIN" ] && "$LLAMA_SERVER_BIN" --list-devices 2>&1 | tail -n 3
    python3 -c "import fastapi, uvicorn, sse_starlette, openai, jsonschema, llguidance, gguf, llama_cpp; print('imports ok')"
}

probe() {
    log "probe"
    timeout 120 python3 -m benchmarks.tools.gpu_probe 2>&1 | tee "$OUT/probe.txt"
}

tests() {
    # Not here: the unit tests (no model), what needs the Gemma file (241 MiB, more than a call
    # carries), sglang-router or langchain/instructor (not installed there).
    log "tests (all layers offloaded: llama.cpp's default n_gpu_layers -1)"
    PAGEDLLAMA_THREADS=${THREADS:-4} timeout "${TEST_SECONDS:-210}" python3 -m pytest -q \
        -p no:cacheprovider -n "${TEST_WORKERS:-8}" --dist loadfile --timeout 150 -o addopts="" \
        -rfE --tb=short -k "not gemma" \
        --deselect tests/test_multimodel.py::test_models_lists_both_with_their_gguf_facts \
        --deselect tests/test_multimodel.py::test_concurrent_requests_to_both_models_answer \
        --deselect tests/test_multimodel.py::test_chat_to_a_model_without_a_template_is_a_clear_400 \
        --deselect tests/test_benchmarks.py::test_cluster_compares_routing_by_key_and_round_robin \
        --deselect tests/test_benchmarks.py::test_router_split_counts_where_the_router_sends_each_prefix \
        --ignore=tests/unit --ignore=tests/test_cluster.py --ignore=tests/test_clients_structured.py \
        ${TEST_PATHS:-tests} 2>&1 | tee "$OUT/pytest.log" | tail -n 30
    echo "pytest rc ${PIPESTATUS[0]}"
}

bench() {
    local T=${THREADS:-4} PEER=(--peer-bin "$LLAMA_SERVER_BIN" --peer-args "-ngl 999")
    log "benchmarks.compare --parallel 16 (ours vs llama-server, both CUDA)"
    timeout 120 python3 -m benchmarks.compare "${PEER[@]}" --threads "$T" --parallel 16 \
        --disable-tqdm 2>&1 | tee "$OUT/compare16.txt" | tail -n 30
    log "benchmarks.core (server vs raw loop)"
    timeout 60 python3 -m benchmarks.core --streams 1,16,64 --n-seq-max 64 --input-len 64 \
        --output-len 128 --threads "$T" --reps 1 --disable-tqdm 2>&1 | tee "$OUT/core.txt" | tail -n 25
    log "benchmarks.compare --parallel 64"
    timeout 60 python3 -m benchmarks.compare "${PEER[@]}" --threads "$T" --parallel 64 \
        --n-ctx 1024 --workloads random-16 --concurrent-prompts 256 --disable-tqdm 2>&1 \
        | tee "$OUT/compare64.txt" | tail -n 20
    log "benchmarks.prefix"
    timeout 45 python3 -m benchmarks.prefix --threads "$T" 2>&1 | tee "$OUT/prefix.txt" | tail -n 20
    log "benchmarks.chunking"
    timeout 60 python3 -m benchmarks.chunking --threads "$T" --chunks 16,256 --max-batch-tokens 1024 2>&1 \
        | tee "$OUT/chunking.txt" | tail -n 20
}

for stage in "${@:-setup}"; do "$stage"; done
log "done"
