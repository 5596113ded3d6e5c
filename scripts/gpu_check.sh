#!/usr/bin/env bash
# Check pagedllama's CUDA path on a machine with an NVIDIA GPU (docs/gpu.md). Run it from the
# repository root, after `make setup` (the virtual environment and the default model):
#
#   scripts/gpu_check.sh setup       # the machine, the GPU, and whether llama.cpp offers GPU offload
#   scripts/gpu_check.sh probe       # the GPU against the CPU in one process (gpu_probe)
#   scripts/gpu_check.sh tests       # the integration tests with every layer on the GPU
#   scripts/gpu_check.sh cpu-tests   # the exactness tests with the model kept on the CPU
#   scripts/gpu_check.sh bench       # benchmarks.compare against llama-server (both on the GPU),
#                                    # core, prefix and chunking at 1, 16 and 64 streams
#   scripts/gpu_check.sh setup probe tests bench   # several stages, in order (default: setup)
#
# Where the CUDA build of llama.cpp comes from, first match wins:
#   1. LLAMA_CPP_LIB_PATH is set: llama-cpp-python loads libllama (and libggml*) from there.
#   2. CUDA_TARBALL (default .gpu/cuda.tar.xz) exists: a tarball made by
#      scripts/build_cuda_llama.sh, on this machine or on any other machine with nvcc (no GPU
#      is needed to compile) and copied here. It is unpacked once into .gpu/cuda and loaded
#      through LLAMA_CPP_LIB_PATH; its llama-server (same build) is the peer of `bench`.
#      cuBLAS comes from this machine: the CUDA toolkit, or the nvidia-cublas wheel (set
#      CUBLAS_DIR when it is somewhere the search below does not look).
#   3. Otherwise the llama-cpp-python installed in the Python environment, which must have been
#      built with CMAKE_ARGS="-DGGML_CUDA=on" (docs/gpu.md, "Building"). `bench` then needs a
#      CUDA llama-server: LLAMA_SERVER_BIN, or where benchmarks.compare looks for one.
#
# Settings: PYTHON (default .venv/bin/python, else python3), THREADS (llama.cpp threads per
# server, default 4), TEST_SECONDS (default 900), TEST_WORKERS (pytest-xdist workers, default 8,
# used only when pytest-xdist is installed). Every stage's output also goes to OUT (default
# .gpu/out), one file per command.
set -uo pipefail
ROOT=$(pwd)
[ -f "$ROOT/scripts/gpu_check.sh" ] || { echo "run from the repository root" >&2; exit 2; }
G=$ROOT/.gpu
OUT=${OUT:-$G/out}
mkdir -p "$OUT"
if [ -z "${PYTHON:-}" ]; then
    if [ -x "$ROOT/.venv/bin/python" ]; then PYTHON=$ROOT/.venv/bin/python; else PYTHON=python3; fi
fi
MODEL=models/SmolLM2-135M-Instruct.Q4_1.gguf
GEMMA=models/gemma-3-270m-q4_k_m.gguf
THREADS=${THREADS:-4}
log() { echo ">> $(date +%T) $*"; }

# --- which llama.cpp ----------------------------------------------------------------------------
CUDA_TARBALL=${CUDA_TARBALL:-$G/cuda.tar.xz}
if [ -z "${LLAMA_CPP_LIB_PATH:-}" ] && [ -f "$CUDA_TARBALL" ]; then
    if [ ! -e "$G/cuda/.unpacked" ] || [ "$CUDA_TARBALL" -nt "$G/cuda/.unpacked" ]; then
        rm -rf "$G/cuda" && mkdir -p "$G/cuda" && tar -xJf "$CUDA_TARBALL" -C "$G/cuda" \
            && touch "$G/cuda/.unpacked"
    fi
    export LLAMA_CPP_LIB_PATH=$G/cuda
    : "${LLAMA_SERVER_BIN:=$G/cuda/llama-server}"
fi
if [ -n "${LLAMA_CPP_LIB_PATH:-}" ]; then
    if [ -z "${CUBLAS_DIR:-}" ]; then
        SITE=$("$PYTHON" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])" 2>/dev/null)
        CUBLAS=$(find /usr/local /opt /usr/lib ${SITE:+"$SITE/nvidia"} -name 'libcublas.so.*' \
                 2>/dev/null | grep -v "/.gpu/" | sort | head -1)
        CUBLAS_DIR=${CUBLAS:+$(dirname "$CUBLAS")}
    fi
    DRIVER_DIR=/usr/local/nvidia/lib64   # where some container runtimes put libcuda.so.1
    [ -d "$DRIVER_DIR" ] || DRIVER_DIR=
    export LD_LIBRARY_PATH=$LLAMA_CPP_LIB_PATH${CUBLAS_DIR:+:$CUBLAS_DIR}${DRIVER_DIR:+:$DRIVER_DIR}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
fi
[ -n "${LLAMA_SERVER_BIN:-}" ] && export LLAMA_SERVER_BIN
export PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1

setup() {
    log "setup"
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv \
        || echo "nvidia-smi failed: no NVIDIA driver here?"
    grep -m1 "model name" /proc/cpuinfo; echo "cores: $(nproc)"
    "$PYTHON" --version
    echo "llama.cpp libraries: ${LLAMA_CPP_LIB_PATH:-the ones inside llama-cpp-python}"
    if [ -n "${LLAMA_CPP_LIB_PATH:-}" ]; then
        echo "cuBLAS: ${CUBLAS_DIR:-not found (set CUBLAS_DIR)}"
        for lib in "$LLAMA_CPP_LIB_PATH"/libggml-cuda.so*; do
            [ -f "$lib" ] && ldd "$lib" | grep -E "not found|cublas|cudart|libcuda"
            break
        done
    fi
    [ -n "${LLAMA_SERVER_BIN:-}" ] && [ -x "$LLAMA_SERVER_BIN" ] \
        && "$LLAMA_SERVER_BIN" --list-devices 2>&1 | tail -n 3
    [ -s "$MODEL" ] && echo "model: $MODEL" || echo "model: $MODEL missing (make setup fetches it)"
    "$PYTHON" -c "import llama_cpp as C; C.llama_backend_init(); \
print('llama-cpp-python', C.__version__, '| GPU offload offered:', bool(C.llama_supports_gpu_offload()))"
}

probe() {
    log "probe"
    timeout 300 "$PYTHON" -m benchmarks.tools.gpu_probe 2>&1 | tee "$OUT/probe.txt"
}

# pytest arguments shared by `tests` and `cpu-tests`: xdist and a per-test timeout when the
# plugins are installed (make setup does not install them); what this machine lacks is left out.
pytest_args() {
    ARGS=(-q -p no:cacheprovider -rfE --tb=short)
    if "$PYTHON" -c "import xdist" 2>/dev/null; then
        ARGS+=(-n "${TEST_WORKERS:-8}" --dist loadfile)
    fi
    "$PYTHON" -c "import pytest_timeout" 2>/dev/null && ARGS+=(--timeout 300)
    if [ ! -s "$GEMMA" ]; then   # `make models` fetches it
        ARGS+=(-k "not gemma" --ignore=tests/test_multimodel.py)
    fi
    if ! command -v haproxy >/dev/null && [ ! -x /usr/sbin/haproxy ]; then   # make cluster's router
        ARGS+=(--ignore=tests/test_cluster.py --ignore=tests/test_cluster_routes.py
               --deselect tests/test_benchmarks.py::test_cluster_compares_routing_by_key_and_round_robin)
    fi
}

tests() {
    # The integration tests, every layer on the GPU (llama.cpp's default with a CUDA build). The
    # exactness tests and the ones that time a CPU premise skip themselves here (tests/devices.py);
    # the unit tests do not touch llama.cpp's kernels (make test runs them).
    log "tests (all layers on the GPU)"
    pytest_args
    PAGEDLLAMA_THREADS=$THREADS timeout "${TEST_SECONDS:-900}" "$PYTHON" -m pytest "${ARGS[@]}" \
        --ignore=tests/unit tests 2>&1 | tee "$OUT/pytest.log" | tail -n 30
    echo "pytest rc ${PIPESTATUS[0]}"
}

cpu_tests() {
    # The same build with the models kept on the CPU: the exactness tests run again and must pass.
    log "tests with PAGEDLLAMA_GPU_LAYERS=0 (the models on the CPU)"
    pytest_args
    PAGEDLLAMA_GPU_LAYERS=0 PAGEDLLAMA_THREADS=$THREADS timeout "${TEST_SECONDS:-900}" \
        "$PYTHON" -m pytest "${ARGS[@]}" tests/test_engine.py tests/test_api.py tests/test_openai_n.py \
        2>&1 | tee "$OUT/pytest-cpu.log" | tail -n 30
    echo "pytest rc ${PIPESTATUS[0]}"
}

bench() {
    # Both servers on the GPU: llama-server with every layer offloaded (-ngl 999). Without a
    # llama-server binary, compare prints SKIPPED and the other benchmarks still run.
    local PEER=(--peer-args "-ngl 999")
    [ -n "${LLAMA_SERVER_BIN:-}" ] && PEER+=(--peer-bin "$LLAMA_SERVER_BIN")
    log "benchmarks.compare --parallel 16 (ours against llama-server)"
    timeout 900 "$PYTHON" -m benchmarks.compare "${PEER[@]}" --threads "$THREADS" --parallel 16 \
        --disable-tqdm 2>&1 | tee "$OUT/compare16.txt" | tail -n 30
    log "benchmarks.core (server against the raw llama_decode loop)"
    timeout 600 "$PYTHON" -m benchmarks.core --streams 1,16,64 --n-seq-max 64 --input-len 64 \
        --output-len 128 --threads "$THREADS" --reps 1 --disable-tqdm 2>&1 \
        | tee "$OUT/core.txt" | tail -n 25
    log "benchmarks.compare --parallel 64"
    timeout 600 "$PYTHON" -m benchmarks.compare "${PEER[@]}" --threads "$THREADS" --parallel 64 \
        --n-ctx 1024 --workloads random-16 --concurrent-prompts 256 --disable-tqdm 2>&1 \
        | tee "$OUT/compare64.txt" | tail -n 20
    log "benchmarks.prefix"
    timeout 600 "$PYTHON" -m benchmarks.prefix --threads "$THREADS" 2>&1 \
        | tee "$OUT/prefix.txt" | tail -n 20
    log "benchmarks.chunking"
    timeout 600 "$PYTHON" -m benchmarks.chunking --threads "$THREADS" --chunks 16,256 \
        --max-batch-tokens 1024 2>&1 | tee "$OUT/chunking.txt" | tail -n 20
}

for stage in "${@:-setup}"; do
    case $stage in
        setup|probe|tests|bench) "$stage" ;;
        cpu-tests) cpu_tests ;;
        *) echo "unknown stage $stage (setup, probe, tests, cpu-tests, bench)" >&2; exit 2 ;;
    esac
done
log "done"
