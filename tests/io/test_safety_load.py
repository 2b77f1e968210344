"""Safe loading: one weights-only loader with one allow-list, and nothing in mconvert that bypasses it.

A pickle payload inside an otherwise valid checkpoint is refused by name and never runs; real Megatron
objects (megatron-core's own enums, configs, RNG state, TE extra state) load.
"""

from __future__ import annotations

import argparse
import ast
import io
import os
import random
import signal
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
from safety_common import PY, ROOT, assert_one_line_error, base, copy_of, load_rank, rank_file, run_cli

from mconvert.io.safeload import safe_load
from mconvert.io.unpickler import ALLOW_LIST
from mconvert.errors import MConvertError

PACKAGE = ROOT / "mconvert"


# ---- nothing bypasses safe_load ----------------------------------------------------------------------
def _calls(tree: ast.AST):
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            yield node


def _dotted(node: ast.AST) -> str:
    if isinstance(node, ast.Attribute):
        return f"{_dotted(node.value)}.{node.attr}"
    if isinstance(node, ast.Name):
        return node.id
    return "?"


LOADERS = ("mconvert/io/safeload.py", "mconvert/io/unpickler.py")  # the one loader and its restricted unpickler


def test_no_module_of_mconvert_loads_pickles_any_other_way():
    """Scan every source file: torch.load only in safeload.py (pickle only there and in its unpickler.py), never weights_only=False, no pickle/dill/
    numpy allow_pickle, no `from torch import load` aliasing."""
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(ROOT)
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module in ("torch", "torch.serialization", "pickle",
                                                                    "dill", "cloudpickle", "joblib"):
                names = {a.name for a in node.names}
                if names & {"load", "loads", "Unpickler", "_load"}:
                    offenders.append(f"{rel}:{node.lineno}: from {node.module} import {sorted(names)}")
            if isinstance(node, ast.Import):  # pickling (writing) is fine; these modules only ever load
                for a in node.names:
                    if a.name in ("dill", "cloudpickle", "joblib", "marshal"):
                        offenders.append(f"{rel}:{node.lineno}: import {a.name}")
            if isinstance(node, ast.ClassDef) and rel.as_posix() not in LOADERS:
                for b in node.bases:
                    if _dotted(b).endswith("Unpickler"):
                        offenders.append(f"{rel}:{node.lineno}: class {node.name}({_dotted(b)})")
        for call in _calls(tree):
            name = _dotted(call.func)
            kw = {k.arg: k.value for k in call.keywords}
            wo = kw.get("weights_only")
            if isinstance(wo, ast.Constant) and wo.value is not True:
                offenders.append(f"{rel}:{call.lineno}: {name}(weights_only={wo.value!r})")
            if name.endswith("torch.load") or name in ("torch.serialization.load",):
                if rel.as_posix() not in LOADERS:
                    offenders.append(f"{rel}:{call.lineno}: {name}( outside safeload.py")
                elif not (isinstance(wo, ast.Constant) and wo.value is True):
                    offenders.append(f"{rel}:{call.lineno}: torch.load without weights_only=True")
            if name.split(".")[0] in ("pickle", "_pickle", "dill") and name.split(".")[-1] in ("load", "loads",
                                                                                               "Unpickler"):
                if rel.as_posix() not in LOADERS:
                    offenders.append(f"{rel}:{call.lineno}: {name}(")
            if name.endswith(".read_metadata") or name.split(".")[-1] in ("dcp_to_torch_save", "torch_save_to_dcp"):
                offenders.append(f"{rel}:{call.lineno}: {name}( unpickles with pickle.load (use "
                                 "safeload.safe_load_dcp_metadata)")
            ap = kw.get("allow_pickle")
            if isinstance(ap, ast.Constant) and ap.value is True:
                offenders.append(f"{rel}:{call.lineno}: {name}(allow_pickle=True)")
    assert not offenders, "\n".join(offenders)


def test_scan_catches_a_bypass(tmp_path):
    """The scanner itself works: a planted bypass is found (guards against a scan that checks nothing)."""
    bad = "import torch\nx = torch.load('a.pt', weights_only=False)\n"
    calls = [(_dotted(c.func), {k.arg: getattr(k.value, 'value', None) for k in c.keywords})
             for c in _calls(ast.parse(bad))]
    assert ("torch.load", {"weights_only": False}) in calls


# ---- what real Megatron files carry loads ----------------------------------------------------------
def test_megatron_lm_objects_load_with_the_allow_list_only(tmp_path):
    """A rank file carrying megatron-core's own classes (args enums, OptimizerConfig, rerun state), numpy and
    python RNG state, TE io.BytesIO extra state, PosixPath and signal args loads — and the answer does not
    depend on megatron-core having registered its classes process-wide (it does, on import)."""
    from megatron.core.enums import ModelType
    from megatron.core.optimizer import OptimizerConfig
    from megatron.core.rerun_state_machine import RerunDiagnostic, RerunMode, RerunState
    from megatron.core.transformer.enums import AttnBackend

    args = argparse.Namespace(
        num_layers=2, attention_backend=AttnBackend.auto, model_type=ModelType.encoder_or_decoder,
        params_dtype=torch.bfloat16, exit_signal=signal.SIGTERM, save=Path("/ckpt"), rerun_mode=RerunMode.DISABLED,
    )
    state = {
        "args": args, "checkpoint_version": 3.0, "iteration": 7,
        "model": {"w": torch.ones(3, dtype=torch.bfloat16), "w._extra_state": io.BytesIO(b"fp8-meta"),
                  "b._extra_state": None},
        "optimizer": {"state": {0: {"exp_avg": torch.zeros(3), "step": torch.tensor(2.0)}},
                      "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.95), "params": [0]}], "cfg": OptimizerConfig(lr=3e-4)},
        "rng_state": [{"random_rng_state": random.getstate(), "np_rng_state": np.random.get_state(),
                       "torch_rng_state": torch.get_rng_state()}],
        "rerun_state_machine": {"state": RerunState.NOT_RUNNING_YET, "diag": RerunDiagnostic.CORRECT_RESULT},
    }
    path = tmp_path / "model_optim_rng.pt"
    torch.save(state, path)
    before = set(map(repr, torch.serialization.get_safe_globals()))
    out = safe_load(path)
    assert set(map(repr, torch.serialization.get_safe_globals())) == before  # restored
    a = out["args"]
    assert a.num_layers == 2 and a.params_dtype is torch.bfloat16 and a.save == Path("/ckpt")
    assert a.exit_signal == signal.SIGTERM and a.attention_backend.value == AttnBackend.auto.value
    assert out["optimizer"]["cfg"].lr == 3e-4
    assert out["model"]["w._extra_state"].getvalue() == b"fp8-meta"
    np_state = state["rng_state"][0]["np_rng_state"]
    assert np.array_equal(out["rng_state"][0]["np_rng_state"][1], np_state[1])
    assert out["rng_state"][0]["random_rng_state"] == state["rng_state"][0]["random_rng_state"]
    assert torch.equal(out["model"]["w"], torch.ones(3, dtype=torch.bfloat16))


def test_legacy_non_zip_torch_file_loads(tmp_path):
    path = tmp_path / "old.pt"
    torch.save({"args": argparse.Namespace(num_layers=1), "model": {"w": torch.arange(3.0)}}, path,
               _use_new_zipfile_serialization=False)
    out = safe_load(path)
    assert out["args"].num_layers == 1 and torch.equal(out["model"]["w"], torch.arange(3.0))


# ---- payloads are refused by name and never run ----------------------------------------------------
class _System:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


class _Open:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (str(self.marker), "w"))


class _Exec:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (exec, (f"open({str(self.marker)!r}, 'w').close()",))


PAYLOADS = {"os.system": (_System, "system"), "builtins.open": (_Open, "open"), "builtins.exec": (_Exec, "exec")}


@pytest.mark.parametrize("legacy", [False, True], ids=["zip", "legacy-pickle"])
@pytest.mark.parametrize("kind", sorted(PAYLOADS))
def test_payload_is_refused_naming_the_global(tmp_path, kind, legacy):
    cls, word = PAYLOADS[kind]
    marker = tmp_path / "MARKER"
    path = tmp_path / "model_optim_rng.pt"
    # nested inside the args Namespace, where a real checkpoint has plenty of harmless objects
    state = {"args": argparse.Namespace(num_layers=2, hook=cls(marker)), "model": {"w": torch.zeros(2)}}
    torch.save(state, path, _use_new_zipfile_serialization=not legacy)
    with pytest.raises(MConvertError) as ei:
        safe_load(path)
    msg = str(ei.value)
    assert str(path) in msg and "refuses to unpickle global" in msg and word in msg, msg
    assert "\n" not in msg
    assert not marker.exists()


def test_every_allowed_global_is_data_not_code():
    """The allow-list names classes that only build data (no os/subprocess/builtins callables)."""
    for name in ALLOW_LIST:
        root = name.split(".")[0]
        assert root in ("argparse", "types", "_io", "io", "builtins", "numpy", "megatron", "pathlib", "signal"), name
        assert name not in ("builtins.eval", "builtins.exec", "builtins.open", "builtins.getattr",
                            "builtins.__import__"), name


def _plant_payload(ckpt: Path, marker: Path) -> Path:
    """Replace TP 0 / PP 0's rank file by the same state plus a payload object next to the args."""
    f = rank_file(ckpt, 0, 0)
    state = load_rank(f)
    state["args"].evil = _Open(marker)
    torch.save(state, f)
    return f


@pytest.mark.parametrize("verb", ["megatron-to-hf", "inspect", "reshard"])
def test_payload_in_checkpoint_is_refused_by_the_cli(tmp_path, capsys, verb):
    ckpt = copy_of("ckpt", tmp_path / "ckpt")
    marker = tmp_path / "MARKER"
    f = _plant_payload(ckpt, marker)
    out = tmp_path / "out"
    argv = {"megatron-to-hf": [verb, ckpt, out], "inspect": [verb, ckpt], "reshard": [verb, ckpt, out, "--tp", "1"]}
    code, _, err = run_cli(argv[verb], capsys)
    assert_one_line_error(code, err, str(f), "refuses to unpickle global", "io.open")
    assert not marker.exists()
    assert not out.exists()


@pytest.mark.slow
def test_payload_refused_by_a_real_process_and_debug_shows_the_traceback(tmp_path):
    """`python -m mconvert.cli megatron-to-hf` on the poisoned checkpoint: exit 1, one line, no marker.
    With MCONVERT_DEBUG=1 the same refusal shows a traceback instead."""
    base()
    ckpt = copy_of("ckpt", tmp_path / "ckpt")
    marker = tmp_path / "MARKER"
    f = _plant_payload(ckpt, marker)
    env = {k: v for k, v in os.environ.items() if k != "MCONVERT_DEBUG"}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    cmd = [PY, "-m", "mconvert.cli", "megatron-to-hf", str(ckpt), str(tmp_path / "out")]
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 1, r.stderr
    assert_one_line_error(r.returncode, r.stderr, str(f), "io.open")
    r2 = subprocess.run(cmd, capture_output=True, text=True, env={**env, "MCONVERT_DEBUG": "1"}, timeout=120)
    assert r2.returncode != 0
    assert "Traceback (most recent call last)" in r2.stderr and "MConvertError" in r2.stderr
    assert not marker.exists() and not (tmp_path / "out").exists()


def test_debug_env_reraises_in_process(tmp_path, monkeypatch):
    from mconvert.cli import main

    monkeypatch.setenv("MCONVERT_DEBUG", "1")
    with pytest.raises(MConvertError, match="no such file or directory"):
        main(["megatron-to-hf", str(tmp_path / "nope"), str(tmp_path / "out")])


def test_loading_does_not_leave_the_allow_list_widened(tmp_path):
    torch.save({"w": torch.zeros(1)}, tmp_path / "a.pt")
    before = set(map(repr, torch.serialization.get_safe_globals()))
    safe_load(tmp_path / "a.pt")
    assert set(map(repr, torch.serialization.get_safe_globals())) == before


def test_a_tensor_with_overlapping_strides_is_refused(tmp_path):
    """Found by the byte fuzz: a damaged stride in the pickle (64 -> 0..63) kept the tensor inside its storage
    and silently produced a different weight. Overlap is refused; transposed or sliced views still load."""
    base = torch.arange(4096.0)
    good = {"t": base.reshape(64, 64).t(), "s": base.reshape(64, 64)[:, :32], "e": torch.zeros(0)}
    torch.save({"model": good}, tmp_path / "good.pt")
    out = safe_load(tmp_path / "good.pt")["model"]
    assert all(torch.equal(out[k], good[k]) for k in good)
    bad = {"decoder.layers.0.mlp.linear_fc2.weight": base.as_strided((64, 64), (17, 1))}
    torch.save({"model": bad}, tmp_path / "bad.pt")
    with pytest.raises(MConvertError, match=r"model\.decoder\.layers\.0\.mlp\.linear_fc2\.weight.*overlap"):
        safe_load(tmp_path / "bad.pt")



# ---- torch_dist: DCP's `.metadata` is a bare pickle in torch -------------------------------------------
def test_dcp_metadata_loads_like_torchs_reader(tmp_path):
    import warnings

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader

    from mconvert.io.safeload import safe_load_dcp_metadata

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"a": torch.zeros(3, 4), "b": {"c": torch.ones(2, dtype=torch.bfloat16)}, "x": b"extra"},
                 checkpoint_id=tmp_path)
    ours, torchs = safe_load_dcp_metadata(tmp_path / ".metadata"), FileSystemReader(tmp_path).read_metadata()
    assert ours.state_dict_metadata == torchs.state_dict_metadata and ours.storage_data == torchs.storage_data


@pytest.mark.parametrize("verb", ["megatron-to-hf", "inspect"])
def test_payload_in_torch_dist_metadata_is_refused(tmp_path, capsys, verb):
    """A torch_dist iteration dir whose `.metadata` would create a marker when pickle.load-ed (as torch's own
    FileSystemReader.read_metadata does) is refused by name."""
    import json
    import pickle

    from mconvert.mappings.families import preset

    d = tmp_path / "ckpt" / "iter_0000001"
    d.mkdir(parents=True)
    (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").write_text("1")
    (d / "metadata.json").write_text(json.dumps({"sharded_backend": "torch_dist", "sharded_backend_version": 1,
                                                 "common_backend": "torch", "common_backend_version": 1}))
    torch.save({"args": preset("tiny-llama").to_megatron_args(1, 1), "checkpoint_version": 3.0, "iteration": 1},
               d / "common.pt")
    marker = tmp_path / "MARKER"
    (d / ".metadata").write_bytes(pickle.dumps(_Open(marker)))
    argv = [verb, tmp_path / "ckpt"] + ([tmp_path / "out"] if verb != "inspect" else [])
    code, _, err = run_cli(argv, capsys)
    assert_one_line_error(code, err, str(d / ".metadata"), "refuses to unpickle global", "open")
    assert not marker.exists() and not (tmp_path / "out").exists()
