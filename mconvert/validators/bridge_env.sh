#!/usr/bin/env bash
# Build (or reuse) the separate venv that runs Megatron-Bridge on CPU for the Bridge interop tests.
# Megatron-Bridge pins transformers 5.x and a newer megatron-core than the project venv, so it cannot
# share it. Only the modules its checkpoint and HF-conversion paths import are installed: its GPU-only
# and logging dependencies (Transformer Engine, flashinfer, wandb, mlflow, ...) stay out, and the tests
# stub the few names those paths touch. Bridge and megatron-core declare Python >= 3.12; their wheels
# run on the 3.11 the CPU torch wheel is built for, hence --ignore-requires-python on those two alone.
# Usage: bridge_env.sh [VENV_DIR]. Prints the interpreter path on its last line; reused when stamped.
set -euo pipefail
VENV="${1:-${BRIDGE_VENV:-$HOME/.cache/mconvert/bridge-venv}}"
STAMP="$VENV/.mconvert-bridge-ok"
. "$(dirname "$0")/env_common.sh"
env_begin "$VENV" "$STAMP"
PIP=("$VENV/bin/pip" install -q)
# The CPU wheel on disk; every later install keeps it (no CUDA torch is ever pulled).
"${PIP[@]}" torch==2.13.0 >&2
"${PIP[@]}" --no-deps --ignore-requires-python megatron-core==0.19.2 megatron-bridge==0.6.2 >&2
# What the checkpoint and HF-conversion paths import (triton: megatron-core imports its kernels' module at start;
# nvidia-modelopt, datasets, megatron-energon, tensorboard: Megatron-Bridge's training package imports them).
"${PIP[@]}" "torch==2.13.0" "transformers==5.12.1" "packaging>=24.2" numpy safetensors accelerate \
  "omegaconf==2.3.1" "hydra-core==1.3.8" "pyyaml==6.0.4" einops rich tqdm regex six typing-extensions \
  sentencepiece "triton==3.9.0" "nvidia-modelopt==0.47.0" requests "datasets==5.2.0" "megatron-energon==7.4.1" \
  "tensorboard==2.21.0" >&2
"$VENV/bin/python" -c "import torch, transformers; assert '+cpu' in torch.__version__, torch.__version__; \
print('bridge venv ok', transformers.__version__)" >&2
env_done "$VENV" "$STAMP"
