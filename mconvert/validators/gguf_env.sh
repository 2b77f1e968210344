#!/usr/bin/env bash
# Build (or reuse) the separate venv that runs llama.cpp through llama-cpp-python for `validate` / `verify` of
# a .gguf. Usage: gguf_env.sh [VENV_DIR]. Prints the interpreter path on its last line; reused when stamped.
#
# llama-cpp-python's own build compiles llama.cpp's `common` library and the multimodal `mtmd` tool too (about
# 180 objects); the bindings load only libllama and libggml*. So llama.cpp's `llama` target alone (about 70
# objects) is built from the sdist's vendored llama.cpp, and the Python bindings are installed with
# LLAMA_BUILD=OFF (nothing compiled) and given those libraries.
#
# The same sdist carries llama.cpp's own converter: convert_hf_to_gguf.py with the `conversion/` package and
# `gguf-py` it imports is kept at $VENV/llama.cpp-convert/ with what it needs (torch, transformers,
# sentencepiece): the peer `make bench` times `hf-to-gguf` against, and whose bytes
# tests/convert/deploy/test_gguf_peer.py compares with ours. Two stamps: STAMP says the libraries are built, CONVERT_STAMP (named after the version) that the
# converter is there too; a venv with the first alone is topped up without compiling anything again.
set -euo pipefail
VENV="${1:-${GGUF_VENV:-$HOME/.cache/mconvert/gguf-venv}}"
VERSION="0.3.36"
STAMP="$VENV/.mconvert-gguf-ok"
CONVERT_STAMP="$VENV/.mconvert-gguf-convert-$VERSION"
CONVERT_DIR="$VENV/llama.cpp-convert"
# The converter's own requirements file pins torch 2.11 and numpy 2.2; torch 2.13 (the CPU wheel the main venv
# uses) and the venv's numpy run it, and transformers is the main venv's 4.57.6.
CONVERT_REQS=(torch==2.13.0 transformers==4.57.6 "sentencepiece>=0.1.98,<0.3.0" "protobuf>=4.21.0,<5.0.0"
              safetensors tqdm pyyaml requests)
. "$(dirname "$0")/env_common.sh"

fetch_sdist() {  # WORK SRC: the sdist unpacked under a temporary directory removed on exit
  WORK="$(mktemp -d "${TMPDIR:-/tmp}/mconvert-gguf-env.XXXXXX")"
  trap 'rm -rf "$WORK"' EXIT
  "$VENV/bin/python" -m pip download -q --no-deps --no-binary :all: --no-build-isolation -d "$WORK" \
    "llama-cpp-python==$VERSION" >&2
  tar -xzf "$WORK"/llama_cpp_python-"$VERSION".tar.gz -C "$WORK"
  SRC="$WORK/llama_cpp_python-$VERSION"
}

install_converter() {  # copies the converter out of $SRC and installs its requirements into the venv
  local lc="$SRC/vendor/llama.cpp"
  rm -rf "$CONVERT_DIR"
  mkdir -p "$CONVERT_DIR"
  cp -a "$lc/convert_hf_to_gguf.py" "$lc/conversion" "$lc/gguf-py" "$CONVERT_DIR/"
  "$VENV/bin/python" -m pip install -q "${CONVERT_REQS[@]}" >&2
  "$VENV/bin/python" "$CONVERT_DIR/convert_hf_to_gguf.py" --help >/dev/null
}

if [ -f "$STAMP" ] && [ ! -f "$CONVERT_STAMP" ] && [ -x "$VENV/bin/python" ]; then
  exec 9>"$VENV.lock"
  flock 9
  if [ ! -f "$CONVERT_STAMP" ]; then
    fetch_sdist
    install_converter
    touch "$CONVERT_STAMP"
  fi
  echo "$VENV/bin/python"
  exit 0
fi
env_begin "$VENV" "$CONVERT_STAMP"
"$VENV/bin/pip" install -q numpy scikit-build-core >&2
fetch_sdist
GEN=()
if command -v ninja >/dev/null; then GEN=(-G Ninja); fi
# A native build picks up every instruction the build host advertises (AMX, AVX512-FP16 on some VMs) and dies
# with SIGILL where the hypervisor does not pass them through; AVX2/FMA/F16C is the portable set. $ORIGIN
# RPATHs let libllama find libggml* wherever the libraries are copied.
cmake -S "$SRC/vendor/llama.cpp" -B "$WORK/build" "${GEN[@]}" -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=ON \
  -DCMAKE_BUILD_RPATH_USE_ORIGIN=ON -DLLAMA_CURL=OFF -DLLAMA_BUILD_COMMON=OFF -DLLAMA_BUILD_TESTS=OFF \
  -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF \
  ${GGUF_CMAKE_ARGS:--DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON} >&2
cmake --build "$WORK/build" --target llama -j "${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}" >&2
CMAKE_ARGS="-DLLAMA_BUILD=OFF -DLLAVA_BUILD=OFF" "$VENV/bin/pip" install -q --no-deps --no-build-isolation "$SRC" >&2
"$VENV/bin/pip" install -q typing-extensions diskcache jinja2 >&2
LIB="$("$VENV/bin/python" -c 'import importlib.util, pathlib; print(pathlib.Path(importlib.util.find_spec("llama_cpp").origin).parent / "lib")')"
mkdir -p "$LIB"
find "$WORK/build/bin" -maxdepth 1 -name 'lib*.so*' -exec cp -a {} "$LIB/" \;
"$VENV/bin/python" -c "import llama_cpp; print('llama_cpp', llama_cpp.__version__)" >&2
install_converter
touch "$STAMP"
env_done "$VENV" "$CONVERT_STAMP"
