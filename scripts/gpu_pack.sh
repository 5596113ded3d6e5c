#!/usr/bin/env bash
# Lay out .gpu/ (git-ignored) for scripts/gpu_check.sh on a lent GPU machine, in three loads
# that each fit one device call (at most 64 MiB with the working tree):
#   .gpu/a   cuda.tar.xz (scripts/build_cuda_llama.sh), wheels for Python 3.12, llama-cpp-python's
#            Python package, the model's first bytes; .gpu/model.sha256
#   .gpu/b   the model's next 64,000,000 bytes
#   .gpu/c   the rest of the model
# Then, with the device tool (each call right after the last: a machine idle for 30 s goes back):
#   run  carry [".gpu/a", ".gpu/model.sha256"]   bash scripts/gpu_check.sh setup
#   run  carry [".gpu/b"]                        true
#   run  carry [".gpu/c"]                        bash scripts/gpu_check.sh probe tests bench
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
G=$ROOT/.gpu
MODEL=$ROOT/models/SmolLM2-135M-Instruct.Q4_1.gguf
PY=${PYTHON:-$ROOT/.venv/bin/python}
LIMIT=$((64 * 1024 * 1024))

[ -f "$G/cuda.tar.xz" ] || [ -f "$G/a/cuda.tar.xz" ] || { echo "run scripts/build_cuda_llama.sh first" >&2; exit 1; }
mkdir -p "$G/a/whl" "$G/b" "$G/c"
[ -f "$G/cuda.tar.xz" ] && mv "$G/cuda.tar.xz" "$G/a/"

# What the machine's Python 3.12 lacks (its PyTorch image has numpy, psutil, prometheus_client,
# pyyaml, jinja2, httpx, requests, pytest, pytest-xdist, hypothesis: KINDS.md of the device tool).
platforms=()
for n in 17 24 27 28 31 34 35; do platforms+=(--platform "manylinux_2_${n}_x86_64"); done
"$PY" -m pip download --quiet --only-binary=:all: --python-version 3.12 --implementation cp \
    "${platforms[@]}" --platform manylinux2014_x86_64 -d "$G/a/whl" \
    $(grep -E "^(fastapi|uvicorn|sse-starlette|gguf|jsonschema|llguidance)==" "$ROOT/requirements.txt") \
    "$(grep -E "^openai==" "$ROOT/requirements-dev.txt")" diskcache
rm -f "$G"/a/whl/{numpy,charset_normalizer,requests,urllib3,certifi,idna,pyyaml,tqdm}-*

SITE=$("$PY" -c "import llama_cpp, os; print(os.path.dirname(llama_cpp.__file__))")
rm -rf "$G/a/llama_cpp_py" && mkdir -p "$G/a/llama_cpp_py"
cp -r "$SITE" "$G/a/llama_cpp_py/llama_cpp"
rm -rf "$G"/a/llama_cpp_py/llama_cpp/{lib,__pycache__,server}

# the model: as much of it in .gpu/a as fits beside the rest, 64,000,000 bytes in .gpu/b
rm -f "$G"/{a,b,c}/model.part*
tree=$(cd "$ROOT" && git ls-files -z | xargs -0 du -cb | awk 'END { print $1 }')
room=$((LIMIT - tree - $(du -sb "$G/a" | cut -f1) - 512 * 1024))
sha256sum "$MODEL" | cut -d' ' -f1 > "$G/model.sha256"
part() { dd if="$MODEL" of="$1" bs=1M iflag=skip_bytes,count_bytes skip="$2" ${3:+count=$3} status=none; }
part "$G/a/model.part0" 0 "$room"
part "$G/b/model.part1" "$room" 64000000
part "$G/c/model.part2" $((room + 64000000))
[ "$(cat "$G"/a/model.part0 "$G"/b/model.part1 "$G"/c/model.part2 | sha256sum | cut -d' ' -f1)" \
    = "$(cat "$G/model.sha256")" ]
du -sb "$G/a" "$G/b" "$G/c"
