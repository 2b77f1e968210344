#!/usr/bin/env bash
# The GPU paths of the trainer and validate, for the device machine (run from the repo root there).
# Its image has torch (CUDA) but not mconvert's pins; carry them as wheels in .whl/ (git-excluded), made here with
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \
#     transformers==4.57.6 huggingface_hub==0.36.2 tokenizers==0.22.2 blake3==1.0.11 isal==1.9.1 gguf==0.19.0 \
#     typer==0.29.2 pydantic==2.14.4 pydantic_core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 \
#     typing_extensions==4.16.0 megatron-core==0.16.1 click==8.5.1 markdown-it-py==4.3.0 mdurl==0.1.2 psutil==7.2.2 \
#     pygments==2.21.0 pyyaml==6.0.4 regex==2026.11.19 rich==15.0.0 safetensors==0.8.0 shellingham==1.5.4 tqdm==4.70.1 \
#     hf-xet==1.8.0 accelerate==1.12.0
# and run it with carry [".whl"]: `EXTRA_PRESETS="tiny-mistral-swa tiny-llama-yarn tiny-deepseek-v3" bash bench/gpu_check.sh`
# (PRESETS replaces the default three).
set -x
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
m() { python3 -c 'from mconvert.cli import run; run()' "$@"; }
nvidia-smi -L; python3 -c 'import torch, transformers; print(torch.__version__, transformers.__version__, torch.cuda.is_available())'
W=/tmp/w; rm -rf $W; mkdir -p $W
rc=0
for preset in ${PRESETS:-tiny-llama tiny-gpt2 tiny-mixtral} ${EXTRA_PRESETS:-}; do
  m train --preset $preset --steps 20 --device cuda --save $W/$preset 2>&1 | tail -5 || rc=1
  m megatron-to-hf $W/$preset $W/$preset-hf 2>&1 | tail -3 || rc=1
  m validate $W/$preset $W/$preset-hf --device cuda 2>&1 | tail -15; [ ${PIPESTATUS[0]} = 0 ] || rc=1
  m validate $W/$preset $W/$preset-hf --device cpu 2>&1 | tail -4
done
# resume on GPU from the CPU-format checkpoint
[ -d $W/tiny-llama ] && { m train --preset tiny-llama --steps 30 --device cuda --save $W/tiny-llama --resume 2>&1 | tail -3 || rc=1; }
# block-scaled FP8 export run by transformers' own FP8 kernels (needs compute capability >= 8.9)
python3 bench/gpu_fp8.py $W/fp8 2>&1 | tail -12; [ ${PIPESTATUS[0]} = 0 ] || rc=1
echo "GPU CHECK rc=$rc"
exit $rc
