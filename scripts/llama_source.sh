# Sourced by the build scripts: llama.cpp's source as llama-cpp-python's sdist vendors it, at the
# version requirements.txt pins (LLAMA_CPP_PYTHON_VERSION overrides), i.e. the llama.cpp our
# engine links against.
#
#   llama_source DEST [PYTHON]   # unpacks DEST/llama_cpp_python-VERSION once; prints its path

LLAMA_CPP_PYTHON_VERSION=${LLAMA_CPP_PYTHON_VERSION:-$(sed -n \
    's/^llama-cpp-python==\([^ ;#]*\).*/\1/p' "$(dirname "${BASH_SOURCE[0]}")/../requirements.txt")}
: "${LLAMA_CPP_PYTHON_VERSION:?cannot read the llama-cpp-python pin from requirements.txt}"

llama_source() {
    local dest=$1 python=${2:-python3}
    local src=$dest/llama_cpp_python-$LLAMA_CPP_PYTHON_VERSION
    if [ ! -d "$src/vendor/llama.cpp" ]; then
        "$python" -m pip download --no-deps --no-binary :all: \
            "llama-cpp-python==$LLAMA_CPP_PYTHON_VERSION" -d "$dest" >&2 || return
        # (|| return: a caller's `set -e` does not reach inside its $(...))
        tar -xzf "$dest/llama_cpp_python-$LLAMA_CPP_PYTHON_VERSION.tar.gz" -C "$dest" || return
    fi
    echo "$src"
}
