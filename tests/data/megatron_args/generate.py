"""Regenerate the real `args` Namespace of every Megatron-LM release as test data (not part of the test run).

For each release below, the tree of Megatron-LM at that tag is exported (from a bare clone given by
--repo) into a temporary directory outside the repository, and a subprocess with that tree first on
sys.path (so it shadows any installed megatron-core) runs the release's own
`megatron/training/arguments.py`: `parse_args()` on a realistic GPT command line, then `validate_args()`,
then the tokenizer build that sets `padded_vocab_size`, then what the training loop adds before it saves
(`args.model_type`). The resulting Namespace is written to `<release>_<shape>.json` next to this file, each
value that JSON cannot hold in a tagged form (see `encode`).

What runs on CPU only through a stub, and why (see `_CHILD`):
- `torch.cuda` device queries (`get_device_capability`, `get_device_properties`, `get_device_name`,
  `device_count`, `current_device`): validate_args and import-time kernel selection ask them; the answer is
  an H100, as a real run has. `torch.cuda.is_available()` stays False, so nothing is placed on a GPU.
- `megatron.core.utils.is_te_min_version` / `get_te_version` answer Transformer Engine 2.8 (the container a real
  run uses has it; here Transformer Engine is absent, and megatron-core's own `HAVE_TE` guards see that).
- `triton` (CUDA-only, absent from CPU torch), `six` and `einops` (pure Python, absent from this venv): imported
  at module level by kernels and tokenizers that parse_args never runs; each gets a module whose every
  attribute is an inert object. torch's own probes for triton run first, so torch sees it absent.
- `typing.override` on Python 3.11 (main needs 3.12): a marker decorator, given as the identity.
- `torch.distributed` is never initialised: RANK=0 and WORLD_SIZE come from the environment as torchrun
  sets them.

Each JSON also holds `argparse_defaults` (what parse_args gives with no option) and `given` (the fields the
command line changed), from which the defaults table is derived.

Usage: python tests/data/megatron_args/generate.py --repo /path/to/Megatron-LM.git [--only main]
Then regenerate the defaults table: python -m mconvert.mappings.megatron_releases --write
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent

# The newest patch of every minor release from core_v0.9 on, and the newest main of the clone.
RELEASES = (
    "core_v0.9.0", "core_v0.10.0", "core_v0.11.0", "core_v0.12.3", "core_v0.13.1", "core_v0.14.0",
    "core_v0.15.3", "core_v0.16.1", "core_v0.17.1", "core_v0.18.2", "core_v0.19.0", "main",
)

# A Llama-3-8B-shaped run (GQA, SwiGLU, RMSNorm, rope, untied, bf16) on TP=2 x PP=2 x DP=2, and a
# Mixtral-8x22B-shaped MoE on TP=4 x EP=2 (DP=2). The two differ in every size and parallel degree, so a value
# validate_args derives from them is told apart from a default (see mconvert.mappings.megatron_releases).
_RUN = """
    --normalization RMSNorm --norm-epsilon 1e-5 --swiglu --position-embedding-type rope --group-query-attention
    --untie-embeddings-and-output-weights --disable-bias-linear --bf16 --attention-dropout 0.0 --hidden-dropout 0.0
    --tokenizer-type NullTokenizer --micro-batch-size 1 --lr 3e-4 --min-lr 3e-5 --lr-decay-style cosine
    --lr-warmup-iters 100 --train-iters 1000 --weight-decay 0.1 --clip-grad 1.0 --use-distributed-optimizer
    --mock-data --save /tmp/ckpt --save-interval 500 --ckpt-format torch_dist --log-interval 10 --eval-iters 0
    --sequence-parallel
"""
SHAPES = {
    "dense": (_RUN + """--num-layers 32 --hidden-size 4096 --num-attention-heads 32 --num-query-groups 8
              --ffn-hidden-size 14336 --seq-length 8192 --max-position-embeddings 8192 --rotary-base 500000
              --vocab-size 128256 --global-batch-size 128
              --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2""", 8),
    "moe": (_RUN + """--num-layers 56 --hidden-size 6144 --num-attention-heads 48 --num-query-groups 8
            --ffn-hidden-size 16384 --seq-length 4096 --max-position-embeddings 65536 --rotary-base 1000000
            --vocab-size 32768 --global-batch-size 256
            --tensor-model-parallel-size 4 --pipeline-model-parallel-size 1 --expert-model-parallel-size 2
            --num-experts 8 --moe-router-topk 2 --moe-grouped-gemm --moe-token-dispatcher-type alltoall
            --moe-router-load-balancing-type aux_loss --moe-aux-loss-coeff 1e-2""", 8),
}

_CHILD = r'''
import enum, importlib, importlib.abc, importlib.machinery, json, math, os, sys, types, dataclasses
tree, argv, out = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
sys.path.insert(0, tree)

import typing
if not hasattr(typing, "override"):  # main needs Python 3.12's typing.override, a marker decorator
    typing.override = lambda f: f

import torch
# validate_args asks the GPU which kernels it can run; answer as an H100 would
torch.cuda.get_device_name = lambda *a, **k: "NVIDIA H100 80GB HBM3"
torch.cuda.get_device_capability = lambda *a, **k: (9, 0)
torch.cuda.device_count = lambda: 8
torch.cuda.current_device = lambda: 0
torch.cuda.get_device_properties = lambda *a, **k: types.SimpleNamespace(
    major=9, minor=0, name="NVIDIA H100 80GB HBM3", total_memory=80 << 30, multi_processor_count=132)

_STUBBED = []
class _Any:
    """Whatever a CUDA-only module's import-time code asks of it: decorators, attributes, base classes."""
    def __init__(self, name): self._name = name
    def __getattr__(self, k):
        if k.startswith("__"):
            raise AttributeError(k)
        return _Any(f"{self._name}.{k}")
    def __call__(self, *a, **k):
        return a[0] if len(a) == 1 and callable(a[0]) and not k else _Any(self._name + "()")
    def __mro_entries__(self, bases): return (object,)
    def __getitem__(self, k): return _Any(self._name + "[]")
    def __bool__(self): return False

class _Missing(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """A module for a CUDA-only package that is not installed (and only those) whose every attribute is `_Any`."""
    ROOTS = ("triton", "six", "einops")
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in self.ROOTS:
            _STUBBED.append(name)
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
    def create_module(self, spec):
        m = types.ModuleType(spec.name); m.__path__ = []; m.__version__ = "3.4.0"; m.__file__ = os.devnull
        m.__getattr__ = lambda k, n=spec.name: _Any(f"{n}.{k}")
        return m
    def exec_module(self, module):
        pass
# torch probes for triton itself: let it find none before the stub exists
import torch.utils.flop_counter, torch.distributed.tensor, torch._dynamo, torch._inductor.codegen.triton  # noqa: E401
sys.meta_path.append(_Missing())

import megatron.core.utils as mcu
mcu.is_te_min_version = lambda *a, **k: True
if hasattr(mcu, "get_te_version"):
    from packaging.version import Version
    mcu.get_te_version = lambda: Version("2.8.0")
import megatron.training.arguments as A
for name in ("is_te_min_version", "get_te_version"):
    if hasattr(A, name):
        setattr(A, name, getattr(mcu, name))
sys.argv = ["pretrain_gpt.py"]
defaults = vars(A.parse_args()).copy()  # argparse's defaults: no option given
sys.argv = ["pretrain_gpt.py", *argv]
args = A.parse_args()
given = sorted(k for k, v in vars(args).items() if k not in defaults or defaults[k] != v)
A.validate_args(args, {})
from megatron.training.global_vars import _build_tokenizer
_build_tokenizer(args)  # what set_global_variables runs: sets padded_vocab_size
from megatron.core.enums import ModelType
args.model_type = ModelType.encoder_or_decoder  # set by the training loop (pretrain) before any save

def encode(v):
    if v is None or isinstance(v, (bool, int, str)):
        return v
    if isinstance(v, float):
        return v if math.isfinite(v) else {"__py__": "float", "repr": repr(v)}
    if isinstance(v, enum.Enum):
        return {"__py__": "enum", "class": f"{type(v).__module__}.{type(v).__qualname__}", "name": v.name,
                "value": encode(v.value)}
    if isinstance(v, torch.dtype):
        return {"__py__": "torch.dtype", "name": str(v).removeprefix("torch.")}
    if isinstance(v, (list,)):
        return [encode(x) for x in v]
    if isinstance(v, tuple):
        return {"__py__": "tuple", "items": [encode(x) for x in v]}
    if isinstance(v, dict):
        return {"__py__": "dict", "items": [[encode(k), encode(x)] for k, x in v.items()]}
    if isinstance(v, (set, frozenset)):
        return {"__py__": "set", "items": sorted((encode(x) for x in v), key=repr)}
    if dataclasses.is_dataclass(v) and not isinstance(v, type):
        return {"__py__": "dataclass", "class": f"{type(v).__module__}.{type(v).__qualname__}",
                "fields": {f.name: encode(getattr(v, f.name)) for f in dataclasses.fields(v)}}
    if callable(v):
        return {"__py__": "callable", "name": f"{getattr(v, '__module__', '?')}.{getattr(v, '__qualname__', repr(v))}"}
    return {"__py__": "object", "class": f"{type(v).__module__}.{type(v).__qualname__}", "repr": repr(v)}

ns = {k: encode(v) for k, v in sorted(vars(args).items())}
with open(out, "w") as f:
    json.dump({"release": os.environ["MLM_RELEASE"], "argv": argv, "stubbed_imports": sorted(set(_STUBBED)),
               "fields": len(ns), "given": given, "args": ns,
               "argparse_defaults": {k: encode(v) for k, v in sorted(defaults.items())}}, f, indent=1)
    f.write("\n")
'''


def export(repo: str, tag: str, dest: Path) -> None:
    """The `megatron/` tree of `tag` from the bare clone `repo`, written under `dest`."""
    archive = subprocess.run(["git", "--git-dir", repo, "archive", tag, "megatron"], check=True,
                             capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True)


def generate(repo: str, release: str, shape: str, work: Path) -> dict:
    tree = work / release
    if not tree.exists():
        tree.mkdir()
        export(repo, release, tree)
    argv, world = SHAPES[shape]
    out = HERE / f"{release}_{shape}.json"
    env = {**os.environ, "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": str(world), "MLM_RELEASE": release,
           "CUDA_DEVICE_MAX_CONNECTIONS": "1"}
    env.pop("PYTHONPATH", None)
    r = subprocess.run([sys.executable, "-c", _CHILD, str(tree), json.dumps(argv.split()), str(out)], env=env,
                       capture_output=True, text=True, cwd=work)
    if r.returncode:
        sys.exit(f"{release} {shape}: parse/validate failed\n{r.stderr[-4000:]}")
    return json.loads(out.read_text())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repo", required=True, help="a bare clone of github.com/NVIDIA/Megatron-LM (its git dir)")
    p.add_argument("--only", nargs="*", default=RELEASES, help="releases to regenerate (default: all)")
    ns = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="mlm-trees-") as d:
        for release in ns.only:
            for shape in SHAPES:
                data = generate(ns.repo, release, shape, Path(d))
                print(f"{release:14} {shape:6} {data['fields']} fields")


if __name__ == "__main__":
    main()
