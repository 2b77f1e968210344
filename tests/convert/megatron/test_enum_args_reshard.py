"""Real Megatron-LM checkpoints hold megatron enums in their args (`attention_backend=AttnBackend.auto`) and
megatron objects in their top-level entries; `safe_load` reads those classes as stand-ins. Re-sharding such a
checkpoint (torch and torch_dist output) writes them back under their original names and values.

The truth is `torch.save` of the real classes: a subprocess defines megatron's enum modules (same module
names, qualnames and values as megatron-core's) and writes the inputs; another loads our outputs with those
classes allowed and compares. The test process itself never has them, as mconvert never does.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch

from safety_common import PY, ROOT, base

# megatron-core's classes as far as pickle sees them: module, qualname, values / fields
FAKE_MEGATRON = '''
import argparse, dataclasses, enum, sys, types
def _mod(name):
    return sys.modules.setdefault(name, types.ModuleType(name))
for _n in ("megatron", "megatron.core", "megatron.core.transformer", "megatron.core.optimizer"):
    _mod(_n)
class AttnBackend(enum.Enum):
    flash = 1; fused = 2; unfused = 3; local = 4; auto = 5
class CudaGraphScope(enum.Enum):
    full_iteration = 1; attn = 2; mlp = 3
class ModelType(enum.Enum):
    encoder_or_decoder = 1; encoder_and_decoder = 2
@dataclasses.dataclass
class OptimizerConfig:
    lr: float = 1e-3
    optimizer: str = "adam"
    betas: tuple = (0.9, 0.999)
for _m, _c in (("megatron.core.transformer.enums", AttnBackend), ("megatron.core.transformer.enums", CudaGraphScope),
               ("megatron.core.enums", ModelType), ("megatron.core.optimizer.optimizer_config", OptimizerConfig)):
    _c.__module__, _c.__qualname__ = _m, _c.__name__
    setattr(_mod(_m), _c.__name__, _c)
ALLOWED = [argparse.Namespace, AttnBackend, CudaGraphScope, ModelType, OptimizerConfig]
def add_megatron_objects(args, top):
    """What Megatron-LM puts there: enum args (one member shared, a list of them) and top-level objects."""
    args.attention_backend = AttnBackend.auto
    args.cuda_graph_scope = [CudaGraphScope.attn, CudaGraphScope.mlp, CudaGraphScope.attn]
    top["rerun_state_machine"] = {"mode": ModelType.encoder_or_decoder, "backend": AttnBackend.auto,
                                  "cfg": OptimizerConfig(lr=3e-4, betas=(0.9, 0.95))}
def describe(st):
    """Everything megatron-typed in a loaded state, as JSON: the enum members by identity."""
    a, r = st["args"], st.get("rerun_state_machine", {})
    return {"attention_backend_is_auto": a.attention_backend is AttnBackend.auto,
            "cuda_graph_scope": [(type(m).__name__, m.name) for m in a.cuda_graph_scope],
            "scope_shared": a.cuda_graph_scope[0] is a.cuda_graph_scope[2] is CudaGraphScope.attn,
            "rerun_mode_is_member": r.get("mode") is ModelType.encoder_or_decoder,
            "rerun_backend_is_auto": r.get("backend") is AttnBackend.auto,
            "cfg": dataclasses.asdict(r["cfg"]) if "cfg" in r else None, "cfg_type": type(r.get("cfg")).__name__,
            "tp": a.tensor_model_parallel_size, "pp": a.pipeline_model_parallel_size,
            "args": sorted(k for k in vars(a))}
'''

WRITE = FAKE_MEGATRON + '''
import json, torch
from mconvert.io.safeload import safe_load
from pathlib import Path
ckpt, single = Path(sys.argv[1]), Path(sys.argv[2])
for f in sorted(ckpt.rglob("model_optim_rng.pt")):
    st = dict(safe_load(f))
    st["model"] = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in st["model"].items()}
    top = {}
    add_megatron_objects(st["args"], top)
    st.update(top)
    f.unlink()
    torch.save(st, f)
args, top = argparse.Namespace(num_layers=2, params_dtype=torch.bfloat16), {}
add_megatron_objects(args, top)
torch.save({"args": args, "iteration": 3, **top, "w": torch.arange(4.0)}, single)
'''

READ = FAKE_MEGATRON + '''
import json, torch
out = {}
for f in sys.argv[1:]:
    with torch.serialization.safe_globals(ALLOWED):
        out[f] = describe(torch.load(f, weights_only=True))  # as megatron-core loads it (safe globals)
print(json.dumps(out))
'''


def _run(code: str, *argv: object) -> str:
    env = {**os.environ, "PYTHONPATH": f"{ROOT}:{ROOT / 'tests' / 'helpers'}"}
    r = subprocess.run([PY, "-c", code, *map(str, argv)], capture_output=True, text=True, timeout=300, env=env,
                       cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    return r.stdout


@pytest.fixture(scope="module")
def inputs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A tiny TP=2 PP=2 checkpoint whose rank files hold megatron enums and objects, and one small file of
    them, both written by torch.save with the real classes."""
    d = tmp_path_factory.mktemp("enum-args")
    ckpt = d / "ckpt"
    shutil.copytree(base()["ckpt"], ckpt)
    (ckpt / "mconvert-manifest.json").unlink(missing_ok=True)  # rewritten rank files, as Megatron-LM writes them
    _run(WRITE, ckpt, d / "single.pt")
    return {"ckpt": ckpt, "single": d / "single.pt"}


def _data_pkl(data: bytes) -> bytes:
    with zipfile.ZipFile(io.BytesIO(data)) as z:
        return z.read(next(n for n in z.namelist() if n.endswith("/data.pkl")))


@pytest.mark.timeout(600)
def test_stand_ins_pickle_back_to_the_bytes_torch_save_wrote(inputs: dict[str, Path]) -> None:
    """safe_load, then repickle.save: the pickle program is byte-identical to the one torch.save wrote from
    the real classes (enum members as `E(value)`, shared members shared, a dataclass as NEWOBJ + state), and
    megatron's modules are never imported on the way (megatron-core is installed in this venv)."""
    from mconvert.io import repickle
    from mconvert.io.safeload import safe_load
    from mconvert.io.unpickler import StandIn

    before = {m for m in sys.modules if m.split(".")[0] == "megatron"}
    st = safe_load(inputs["single"])
    assert isinstance(st["args"].attention_backend, StandIn) and st["args"].attention_backend.value == 5
    buf = io.BytesIO()
    repickle.save(st, buf)
    assert {m for m in sys.modules if m.split(".")[0] == "megatron"} == before
    assert _data_pkl(buf.getvalue()) == _data_pkl(inputs["single"].read_bytes())


def test_without_stand_ins_the_bytes_are_torch_saves() -> None:
    """A state without stand-ins takes the C pickler: the same bytes as torch.save (byte-identical outputs)."""
    from mconvert.io import repickle

    state = {"args": argparse.Namespace(num_layers=2, name="x", dtype=torch.float16), "iteration": 7,
             "model": {"a": torch.arange(6.0).view(2, 3), "b": torch.ones(2, dtype=torch.bfloat16)}, "l": [1, (2, "x")]}
    ours, theirs = io.BytesIO(), io.BytesIO()
    repickle.save(state, ours)
    torch.save(state, theirs)
    assert ours.getvalue() == theirs.getvalue()


@pytest.mark.timeout(900)
@pytest.mark.parametrize("fmt", ["torch", "torch_dist"])
def test_reshard_keeps_megatron_enum_args(inputs: dict[str, Path], tmp_path: Path, fmt: str) -> None:
    """Reshard TP=2 PP=2 -> TP=1 PP=2 of a checkpoint with enum args: the output loads, with megatron's classes,
    to the same members and objects as the input (only the parallel sizes change), and safe_load reads it."""
    from mconvert.convert.verbs import reshard
    from mconvert.io.safeload import safe_load
    from mconvert.io.unpickler import StandIn

    out = tmp_path / "out"
    reshard(inputs["ckpt"], out, tp=1, pp=2, format=fmt)
    src = sorted(inputs["ckpt"].rglob("model_optim_rng.pt"))[0]
    files = sorted(out.rglob("common.pt" if fmt == "torch_dist" else "model_optim_rng.pt"))
    assert len(files) == (1 if fmt == "torch_dist" else 2)
    got = json.loads(_run(READ, src, *files).strip().splitlines()[-1])
    want = got.pop(str(src))
    assert want["attention_backend_is_auto"] and want["rerun_backend_is_auto"]  # the truth is what we think
    for f in files:
        assert got[str(f)] == {**want, "tp": 1, "pp": 2}, f
        st = safe_load(f)
        assert isinstance(st["args"].attention_backend, StandIn) and st["args"].attention_backend.value == 5


SET_MODEL_TYPE = FAKE_MEGATRON + '''
import torch
from mconvert.io.safeload import safe_load
from pathlib import Path
for f in sorted(Path(sys.argv[1]).rglob("model_optim_rng.pt")):
    st = dict(safe_load(f))
    st["model"] = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in st["model"].items()}
    st["args"].model_type = ModelType[sys.argv[2]]
    f.unlink()
    torch.save(st, f)
'''


@pytest.mark.timeout(600)
@pytest.mark.parametrize("member", ["encoder_or_decoder", "encoder_and_decoder"])
def test_model_type_arg_of_megatron_lms_training_loop(tmp_path: Path, member: str) -> None:
    """Megatron-LM's `get_model` stores `args.model_type = ModelType.encoder_or_decoder` in every GPT checkpoint:
    such a checkpoint converts; an encoder-decoder one is refused naming the arg, with nothing written."""
    ckpt = tmp_path / "ckpt"
    shutil.copytree(base()["ckpt"], ckpt)
    (ckpt / "mconvert-manifest.json").unlink(missing_ok=True)
    _run(SET_MODEL_TYPE, ckpt, member)
    out = tmp_path / "hf"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    r = subprocess.run([PY, "-m", "mconvert.cli", "megatron-to-hf", str(ckpt), str(out)], capture_output=True,
                       text=True, timeout=300, env=env, cwd=ROOT)
    if member == "encoder_or_decoder":
        assert r.returncode == 0, r.stderr[-2000:]
        assert (out / "config.json").is_file()
    else:
        lines = r.stderr.strip().splitlines()
        assert r.returncode == 1 and "Traceback" not in r.stderr and len(lines) == 1, r.stderr
        assert "model_type" in lines[0] and "encoder_or_decoder" in lines[0] and "conversion refused" in lines[0]
        assert not out.exists()
