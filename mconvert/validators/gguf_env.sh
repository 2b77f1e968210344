#!/usr/bin/env bash
# Build (or reuse) the separate venv that runs llama.cpp through llama-cpp-python for `validate` / `verify` of
# a .gguf. Usage: gguf_env.sh [VENV_DIR]. Prints the interpreter path on its last line; reused when stamped.
#
# llama-cpp-python's own build compiles llama.cpp's `common` library and the multimodal `mtmd` tool too (about
# 180 objects); the bindings load only libllama and libggml*. So llama.cpp's `llama` target alone (about 70
# objects) is built from the sdist's vendored llama.cpp, and the Python bindings are installed with
# LLAMA_BUILD=OFF (nothing compiled) and given those libraries.
set -euo pipefail
VENV="${1:-${GGUF_VENV:-$HOME/.cache/mconvert/gguf-venv}}"
VERSION="0.3.36"
STAMP="$VENV/.mconvert-gguf-ok"
. "$(dirname "$0")/env_common.sh"
env_begin "$VENV" "$STAMP"
"$VENV/bin/pip" install -q numpy scikit-build-core >&2
WORK="$(mktemp -d "${TMPDIR:-/tmp}/mconvert-gguf-env.XXXXXX")"
trap 'rm -rf "$WORK"' EXIT
"$VENV/bin/pip" download -q --no-deps --no-binary :all: --no-build-isolation -d "$WORK" \
  "llama-cpp-python==$VERSION" >&2
tar -xzf "$WORK"/llama_cpp_python-"$VERSION".tar.gz -C "$WORK"
SRC="$WORK/llama_cpp_python-$VERSION"
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
env_done "$VENV" "$STAMP"
