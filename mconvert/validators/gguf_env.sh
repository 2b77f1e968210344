#!/usr/bin/env bash
# Build (or reuse) the separate venv that runs llama.cpp through llama-cpp-python for `validate`/`verify` of a
# .gguf. llama-cpp-python compiles llama.cpp from source; it gets its own venv so that the project venv needs no
# compiler. Usage: gguf_env.sh [VENV_DIR]. Prints the interpreter path on its last line; reused when stamped.
set -euo pipefail
VENV="${1:-${GGUF_VENV:-$HOME/.cache/mconvert/gguf-venv}}"
PY="${PY:-python3}"
STAMP="$VENV/.mconvert-gguf-ok"
if [ -f "$STAMP" ] && [ -x "$VENV/bin/python" ]; then
  echo "$VENV/bin/python"
  exit 0
fi
mkdir -p "$(dirname "$VENV")"
LOCK="$VENV.lock"
exec 9>"$LOCK"
flock 9
if [ -f "$STAMP" ] && [ -x "$VENV/bin/python" ]; then
  echo "$VENV/bin/python"
  exit 0
fi
rm -rf "$VENV"
"$PY" -m venv "$VENV"
"$VENV/bin/pip" install -q --upgrade pip >&2
"$VENV/bin/pip" install -q numpy >&2
# A native build picks up every instruction the build host advertises (AMX, AVX512-FP16 on some VMs) and
# dies with SIGILL where the hypervisor does not pass them through; AVX2/FMA/F16C is the portable set.
CMAKE_ARGS="${GGUF_CMAKE_ARGS:--DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DLLAMA_CURL=OFF}" \
  CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-2}" \
  "$VENV/bin/pip" install -q --no-binary llama-cpp-python "llama-cpp-python==0.3.36" >&2
"$VENV/bin/python" -c "import llama_cpp; print('llama_cpp', llama_cpp.__version__)" >&2
touch "$STAMP"
echo "$VENV/bin/python"
