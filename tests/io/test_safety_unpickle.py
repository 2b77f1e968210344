"""Unpickling cannot change anything outside the file it reads, and every walk over a loaded object ends.

Each attack is a real file handed to the CLI: a torch_dist `.metadata` whose BUILD targets a class (it rebinds
`pathlib.PosixPath` so that every path reads '.', and the `--force` cleanup then empties the directory the user
runs from), rank files / `.bin` files whose BUILD or `_rebuild_from_type_v2` targets a shared object (the
`signal.SIGINT` enum member, numpy's cached float32 dtype), and self-referencing or exponentially shared
containers. Then an opcode-level fuzz of the restricted unpickler.
"""

from __future__ import annotations

import argparse
import builtins
import copyreg
import dataclasses
import io
import json
import os
import pathlib
import pickle
import pickletools
import random
import re
import shutil
import signal
import subprocess
import sys
import types
import warnings
import zipfile
from collections import OrderedDict
from pathlib import Path

import numpy as np
import pytest
import torch
from safety_common import (PY, ROOT, assert_one_line_error, base, copy_of, load_rank, make_hf_llama, rank_file,
                           run_cli)

from mconvert.io import unpickler
from mconvert.io.safeload import MAX_DEPTH, MAX_OBJECTS, check_tree, safe_load, safe_load_dcp_metadata
from mconvert.errors import MConvertError


# ---- pickle program pieces (each pushes exactly one value) --------------------------------------------------
def _g(module: str, name: str) -> bytes:
    return b"c" + module.encode() + b"\n" + name.encode() + b"\n"


def _s(text: str) -> bytes:
    raw = text.encode()
    return b"X" + len(raw).to_bytes(4, "little") + raw


def _attrs(**kv: str) -> bytes:
    return b"}(" + b"".join(_s(k) + _s(v) for k, v in kv.items()) + b"u"


SIGINT_RENAMED = _attrs(_name_="HACKED")
ATTACKS = {
    # REDUCE / NEWOBJ signal.Signals(2) give the process-wide SIGINT member; BUILD would rename it
    "build-shared-enum": (_g("signal", "Signals") + b"K\x02\x85R" + SIGINT_RENAMED + b"b",
                          "BUILD into a signal.Signals"),
    "newobj-shared-enum": (_g("signal", "Signals") + b"K\x02\x85\x81" + SIGINT_RENAMED + b"b",
                           "BUILD into a signal.Signals"),
    # torch sets the state of whatever func(*args) returns, here the shared SIGINT member
    "rebuild-from-type": (_g("torch._tensor", "_rebuild_from_type_v2") + b"(" + _g("signal", "Signals")
                          + _g("signal", "Signals") + b"K\x02\x85" + SIGINT_RENAMED + b"tR",
                          "_rebuild_from_type_v2 around class signal.Signals"),
    # np.dtype('f4') without copy=True is numpy's own float32 descriptor
    "shared-dtype": (_g("numpy", "dtype") + _s("f4") + b"\x85R" + b"(K\x03" + _s(">")
                     + b"NNNJ\xff\xff\xff\xffJ\xff\xff\xff\xffK\x00tb", "BUILD into a numpy"),
    "build-on-class": (_g("argparse", "Namespace") + b"N" + _attrs(parse_args="x") + b"\x86b",
                       "BUILD into class argparse.Namespace"),
}


def _watched() -> dict[str, object]:
    """Process-wide objects an attack would change, by name."""
    from torch.distributed.checkpoint import metadata as dcp_md

    out: dict[str, object] = {c.__qualname__: c for c in (
        pathlib.PosixPath, pathlib.PurePath, pathlib.Path, argparse.Namespace, types.SimpleNamespace, OrderedDict,
        unpickler.StandIn, dcp_md.Metadata, dcp_md.TensorStorageMetadata, dcp_md.MetadataIndex,
        dcp_md.TensorProperties, dcp_md.ChunkStorageMetadata)}
    out.update({"builtins": builtins, "copyreg": copyreg})
    out.update({f"signal.{m.name}": m for m in signal.Signals})
    return out


def _f4() -> tuple:
    d = np.dtype("f4")
    return d.byteorder, d.str, d.itemsize, d.alignment


@pytest.fixture
def unchanged():
    """Fail when a process-wide object changed during the test, after repairing it: a rebound PosixPath would
    otherwise make pytest's own clean-up remove the working directory."""
    owners = _watched()
    before = {k: dict(vars(o)) for k, o in owners.items()}
    f4 = _f4()
    yield
    changed = [k for k, o in owners.items() if dict(vars(o)) != before[k]]
    for k in changed:
        o, now = owners[k], dict(vars(owners[k]))
        for name in now:
            if name not in before[k]:
                delattr(o, name)
            elif now[name] is not before[k][name]:
                setattr(o, name, before[k][name])
    assert not changed, f"process-wide objects changed: {changed}"
    assert _f4() == f4 and signal.Signals.SIGINT.name == "SIGINT"


def _into_top_dict(pkl: bytes, key: str, value_ops: bytes) -> bytes:
    """Add `key: <value_ops>` to the top-level dict of a torch.save pickle (right after its first MARK), so
    the program stays one torch's own unpickler runs (it has no POP)."""
    for op, _, pos in pickletools.genops(pkl):
        if op.name == "MARK":
            return pkl[: pos + 1] + _s(key) + value_ops + pkl[pos + 1:]
    raise AssertionError("no MARK")


def _rewrite_zip(path: Path, edit) -> None:
    """Rewrite the data.pkl of a torch zip with `edit(bytes) -> bytes` (torch's own writer, so the records
    keep the alignment torch.load expects)."""
    with zipfile.ZipFile(path) as z:
        recs = {i.filename.split("/", 1)[1]: z.read(i.filename) for i in z.infolist()}
    w = torch._C.PyTorchFileWriter(str(path))
    for name, data in recs.items():
        if name in ("data.pkl", ".data/version", "version", ".data/serialization_id", "byteorder"):
            continue
        w.write_record(name, data, len(data))
    pkl = edit(recs["data.pkl"])
    w.write_record("data.pkl", pkl, len(pkl))
    w.write_record("byteorder", b"little", 6)
    w.write_end_of_file()


def _save_over(obj, path: Path) -> None:
    """torch.save onto a file `obj` was memory-mapped from: a new inode, so the mapped pages stay valid."""
    torch.save(obj, path.with_suffix(".new"))
    os.replace(path.with_suffix(".new"), path)


# ---- fixtures: a torch_dist checkpoint, an HF .bin ----------------------------------------------------------
@pytest.fixture(scope="module")
def torch_dist_ckpt(tmp_path_factory) -> Path:
    """The tiny base checkpoint re-saved as torch_dist: stacked layers through DCP, args in common.pt."""
    import torch.distributed.checkpoint as dcp

    from mconvert.convert.sources import open_source

    src = open_source(base()["ckpt"])
    flat: dict[str, torch.Tensor] = {}
    stacked: dict[str, list[torch.Tensor]] = {}
    for u in src.units():
        for k, t in src.read_mcore(u).items():
            m = re.match(r"decoder\.layers\.(\d+)\.(.*)", k)
            if m:
                stacked.setdefault(m.group(2), []).append(t.clone())
            else:
                flat[k] = t.clone()
    flat.update({f"decoder.layers.{k}": torch.stack(v) for k, v in stacked.items()})
    root = tmp_path_factory.mktemp("dist") / "ckpt"
    d = root / "iter_0000001"
    d.mkdir(parents=True)
    (root / "latest_checkpointed_iteration.txt").write_text("1")
    (d / "metadata.json").write_text(json.dumps({"sharded_backend": "torch_dist"}))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(flat, checkpoint_id=d)
    args = argparse.Namespace(**vars(src.args))
    args.tensor_model_parallel_size = args.pipeline_model_parallel_size = 1
    torch.save({"args": args, "checkpoint_version": 3.0, "iteration": 1}, d / "common.pt")
    return root


def test_torch_dist_fixture_converts(torch_dist_ckpt, tmp_path, capsys):
    """The fixture is a checkpoint the reader accepts (so the attacks below are refused for what they add)."""
    code, _, err = run_cli(["megatron-to-hf", torch_dist_ckpt, tmp_path / "out"], capsys)
    assert code == 0, err


@pytest.fixture(scope="module")
def hf_bin(tmp_path_factory) -> Path:
    import transformers

    src = make_hf_llama(tmp_path_factory.mktemp("hfst") / "hf")
    out = tmp_path_factory.mktemp("hfbin") / "hf"
    transformers.LlamaForCausalLM.from_pretrained(src).save_pretrained(out, safe_serialization=False)
    assert (out / "pytorch_model.bin").is_file()
    return out


# ---- attack 1: the torch_dist `.metadata` that rebinds pathlib.PosixPath -----------------------------------
def _rebinding_metadata(ckpt: Path) -> Path:
    md = ckpt / "iter_0000001" / ".metadata"
    raw = md.read_bytes()
    md.write_bytes(raw[:2] + _g("pathlib", "PosixPath") + b"N" + _attrs(_str=".") + b"\x86b0" + raw[2:])
    return md


@pytest.mark.timeout(120)
def test_dcp_metadata_that_rebinds_posixpath_is_refused_and_force_deletes_nothing(torch_dist_ckpt, tmp_path):
    """`mconvert megatron-to-hf CKPT OUT --force`, run from a directory holding the user's files (a separate
    process, so that a regression empties only that directory): exit 1, one line naming `.metadata` and the
    opcode, the working directory and the old OUT intact."""
    ckpt = tmp_path / "ckpt"
    shutil.copytree(torch_dist_ckpt, ckpt)
    md = _rebinding_metadata(ckpt)
    work, out = tmp_path / "work", tmp_path / "out"
    work.mkdir()
    (work / "precious.txt").write_text("keep")
    out.mkdir()
    (out / "old.txt").write_text("old output")
    env = {k: v for k, v in os.environ.items() if k != "MCONVERT_DEBUG"}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    r = subprocess.run([PY, "-m", "mconvert.cli", "megatron-to-hf", str(ckpt), str(out), "--force"], cwd=work,
                       capture_output=True, text=True, env=env, timeout=100)
    assert_one_line_error(r.returncode, r.stderr, str(md), "refuses to unpickle", "BUILD into class pathlib.PosixPath")
    assert r.returncode == 1
    assert (work / "precious.txt").read_text() == "keep" and (out / "old.txt").read_text() == "old output"


@pytest.mark.timeout(60)
def test_dcp_metadata_attack_leaves_posixpath_unchanged_in_the_loading_process(torch_dist_ckpt, tmp_path,
                                                                                unchanged):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(torch_dist_ckpt, ckpt)
    md = _rebinding_metadata(ckpt)
    with pytest.raises(MConvertError, match="BUILD into class pathlib.PosixPath"):
        safe_load_dcp_metadata(md)
    assert "_str" not in vars(pathlib.PosixPath) and str(pathlib.Path("a/b")) == "a/b"


@pytest.mark.parametrize("target", ["pathlib.PosixPath", "torch.distributed.checkpoint.metadata.Metadata",
                                    "collections.OrderedDict"])
@pytest.mark.parametrize("op", ["BUILD", "SETITEM", "APPEND"])
def test_dcp_metadata_never_mutates_an_allowed_class(torch_dist_ckpt, tmp_path, target, op, unchanged):
    mod, name = target.rsplit(".", 1)
    prog = {"BUILD": b"N" + _attrs(x="y") + b"\x86b", "SETITEM": _s("x") + _s("y") + b"s", "APPEND": _s("x") + b"a"}
    md = tmp_path / ".metadata"
    raw = (torch_dist_ckpt / "iter_0000001" / ".metadata").read_bytes()
    md.write_bytes(raw[:2] + _g(mod, name) + prog[op] + b"0" + raw[2:])
    with pytest.raises(MConvertError, match=rf"^{re.escape(str(md))}: refuses to unpickle {op} into class "
                                            rf"{re.escape(target)}"):
        safe_load_dcp_metadata(md)


# ---- attack 2: BUILD / _rebuild_from_type_v2 into shared objects through torch's weights-only path ---------
@pytest.mark.timeout(120)
@pytest.mark.parametrize("attack", sorted(ATTACKS))
@pytest.mark.parametrize("verb", ["megatron-to-hf", "reshard"])
def test_rank_file_that_mutates_a_shared_object_is_refused(tmp_path, capsys, attack, verb, unchanged):
    ckpt = copy_of("ckpt", tmp_path / "ckpt")
    f = rank_file(ckpt, 0, 0)
    ops, what = ATTACKS[attack]
    _rewrite_zip(f, lambda pkl: _into_top_dict(pkl, "rerun_state_machine", ops))
    out = tmp_path / "out"
    argv = [verb, ckpt, out] + (["--tp", "1"] if verb == "reshard" else [])
    code, _, err = run_cli(argv, capsys)
    assert_one_line_error(code, err, str(f), "refuses to unpickle", what)
    assert code == 1 and not out.exists()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("attack", ["build-shared-enum", "rebuild-from-type"])
def test_hf_bin_that_mutates_a_shared_object_is_refused(hf_bin, tmp_path, capsys, attack, unchanged):
    hf = tmp_path / "hf"
    shutil.copytree(hf_bin, hf)
    ops, what = ATTACKS[attack]
    _rewrite_zip(hf / "pytorch_model.bin", lambda pkl: _into_top_dict(pkl, "x", ops))
    code, _, err = run_cli(["hf-to-megatron", hf, tmp_path / "out"], capsys)
    assert_one_line_error(code, err, str(hf / "pytorch_model.bin"), "refuses to unpickle", what)
    assert code == 1 and not (tmp_path / "out").exists()


def test_legacy_pickle_file_is_checked_the_same_way(tmp_path, unchanged):
    path = tmp_path / "old.pt"
    torch.save({"args": argparse.Namespace(num_layers=1), "w": torch.zeros(2)}, path,
               _use_new_zipfile_serialization=False)
    data = path.read_bytes()
    bounds, start = [], 0
    for _ in range(5):  # magic, protocol, sys info, the object, storage keys
        end = start + [pos for op, _, pos in pickletools.genops(data[start:]) if op.name == "STOP"][0] + 1
        bounds.append((start, end))
        start = end
    s, e = bounds[3]
    path.write_bytes(data[:s] + _into_top_dict(data[s:e], "x", ATTACKS["build-shared-enum"][0]) + data[e:])
    with pytest.raises(MConvertError, match="refuses to unpickle BUILD into a signal.Signals"):
        safe_load(path)


def test_real_megatron_objects_still_load_fresh(tmp_path):
    """What a rank file legitimately builds — Namespace, OrderedDict with _metadata, numpy RNG state and scalars,
    signals, paths, BytesIO, a dtype — loads, and a dtype given state is a new one, not numpy's cached one."""
    sd = OrderedDict(w=torch.ones(2))
    sd._metadata = OrderedDict({"": {"version": 1}})
    state = {"args": argparse.Namespace(exit_signal=signal.SIGTERM, save=Path("/c"), f=np.float32(2.5)), "model": sd,
             "rng": np.random.RandomState(0).get_state(), "x": io.BytesIO(b"te"), "d": np.dtype(">f4")}
    torch.save(state, tmp_path / "a.pt")
    out = safe_load(tmp_path / "a.pt")
    assert out["args"].exit_signal is signal.SIGTERM and out["args"].save == Path("/c")
    assert out["model"]._metadata == {"": {"version": 1}} and out["x"].getvalue() == b"te"
    assert np.array_equal(out["rng"][1], state["rng"][1]) and out["args"].f == np.float32(2.5)
    assert out["d"] == np.dtype(">f4") and np.dtype("f4").byteorder == "="


# ---- classes of a newer megatron-core inside args: inert values, never imported or called ------------------
_FUTURE = "megatron.core.transformer.enums_of_a_future_release"


@pytest.fixture
def future_module(monkeypatch):
    """A megatron-core module mconvert has never heard of, importable only while the checkpoint is saved."""
    mod = types.ModuleType(_FUTURE)
    monkeypatch.setitem(sys.modules, _FUTURE, mod)
    return mod


def _args_file(path: Path, value, future_module=None) -> Path:
    torch.save({"args": argparse.Namespace(num_layers=2, newer_option=value), "model": {"w": torch.ones(2)}}, path)
    if future_module is not None:
        del sys.modules[_FUTURE]
    return path


def test_an_unknown_megatron_enum_in_args_loads_as_its_class_path_and_value(tmp_path, future_module, unchanged):
    import enum

    from mconvert.mappings.megatron_releases import encode

    scope = enum.Enum("InferenceCudaGraphScope", [("none", 1), ("block", 2)], module=_FUTURE,
                      qualname="InferenceCudaGraphScope")
    future_module.InferenceCudaGraphScope = scope
    out = safe_load(_args_file(tmp_path / "a.pt", [scope.block, scope.none], future_module))["args"].newer_option
    assert all(isinstance(v, unpickler.StandIn) for v in out) and [v.value for v in out] == [2, 1]
    assert encode(out[0]) == {"__py__": "enum", "class": f"{_FUTURE}.InferenceCudaGraphScope", "value": 2}
    assert _FUTURE not in sys.modules  # named, never imported


def test_an_unknown_megatron_dataclass_in_args_loads_as_its_fields(tmp_path, future_module, unchanged):
    @dataclasses.dataclass
    class CudaGraphConfig:
        scope: str = "attn"
        sizes: tuple = (1, 2)

    CudaGraphConfig.__module__, CudaGraphConfig.__qualname__ = _FUTURE, "CudaGraphConfig"
    future_module.CudaGraphConfig = CudaGraphConfig
    out = safe_load(_args_file(tmp_path / "a.pt", CudaGraphConfig(), future_module))["args"].newer_option
    assert isinstance(out, unpickler.StandIn) and (out.scope, out.sizes) == ("attn", (1, 2))


_INERT_ATTACKS = {
    # a call that is no enum value: a megatron name standing for a function would be called with it
    "unknown-class-called-with-a-list": (_g(_FUTURE, "Thing") + b"(]tR", "arguments other than an enum value"),
    "unknown-class-called-with-an-object": (_g(_FUTURE, "Thing") + b"(" + _g(_FUTURE, "Other") + b")Rt" + b"R",
                                            "arguments other than an enum value"),
    # the class itself as a value: a callable handed to whoever reads args
    "unknown-class-as-a-value": (_g(_FUTURE, "Thing"), f"class {_FUTURE}.Thing as a value"),
    # state that would make the stand-in something else
    "unknown-class-given-a-dunder": (_g(_FUTURE, "Thing") + b")\x81" + _attrs(__class__="x") + b"b", "state key"),
    # a REDUCE of a callable that is not a megatron class, inside args
    "os-system-in-args": (_g("os", "system") + _s("true") + b"\x85R", "global 'os.system'"),
    "eval-in-args": (_g("builtins", "eval") + _s("1") + b"\x85R", "global 'builtins.eval'"),
}


@pytest.mark.parametrize("attack", sorted(_INERT_ATTACKS))
def test_a_call_or_callable_among_unknown_megatron_classes_in_args_is_refused(tmp_path, capsys, attack,
                                                                              unchanged):
    ckpt = copy_of("ckpt", tmp_path / "ckpt")
    f = rank_file(ckpt, 0, 0)
    state = load_rank(f)
    state["args"].newer_option = "PLACEHOLDER"
    _save_over(state, f)
    ops, what = _INERT_ATTACKS[attack]
    _rewrite_zip(f, lambda pkl: pkl.replace(_s("PLACEHOLDER"), ops, 1))
    code, _, err = run_cli(["megatron-to-hf", ckpt, tmp_path / "out"], capsys)
    assert_one_line_error(code, err, str(f), "refuses to unpickle", what)
    assert code == 1 and not (tmp_path / "out").exists()


# ---- attack 3: walks that would not end ----------------------------------------------------------------------
def _cycle() -> list:
    a: list = [1]
    a.append({"again": a})
    return a


def _dag(depth: int = 60) -> list:
    a: list = [0]
    for _ in range(depth):
        a = [a, a]
    return a


HANGS = {"cycle": (_cycle, "contains itself"), "dag": (_dag, f"more than {MAX_OBJECTS} objects")}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", sorted(HANGS))
@pytest.mark.parametrize("verb", ["megatron-to-hf", "reshard"])
def test_rank_file_with_a_walk_that_never_ends_is_refused(tmp_path, capsys, kind, verb):
    ckpt = copy_of("ckpt", tmp_path / "ckpt")
    f = rank_file(ckpt, 0, 0)
    state = load_rank(f)
    make, what = HANGS[kind]
    state["args"].data_path = make()
    torch.save(state, f)
    out = tmp_path / "out"
    code, _, err = run_cli([verb, ckpt, out] + (["--tp", "1"] if verb == "reshard" else []), capsys)
    assert_one_line_error(code, err, str(f), what)  # the walk's own limit ended it; a walk that spins meets the timeout
    assert code == 1 and not out.exists()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", sorted(HANGS))
def test_torch_dist_common_pt_with_a_walk_that_never_ends_is_refused(torch_dist_ckpt, tmp_path, capsys, kind):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(torch_dist_ckpt, ckpt)
    common = ckpt / "iter_0000001" / "common.pt"
    c = safe_load(common)
    make, what = HANGS[kind]
    c["args"].blend = make()
    _save_over(c, common)
    code, _, err = run_cli(["megatron-to-hf", ckpt, tmp_path / "out"], capsys)
    assert_one_line_error(code, err, str(common), what)
    assert code == 1


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", sorted(HANGS))
def test_hf_bin_with_a_walk_that_never_ends_is_refused(hf_bin, tmp_path, capsys, kind):
    hf = tmp_path / "hf"
    shutil.copytree(hf_bin, hf)
    sd = dict(safe_load(hf / "pytorch_model.bin"))
    make, what = HANGS[kind]
    sd["extra"] = make()
    _save_over(sd, hf / "pytorch_model.bin")
    code, _, err = run_cli(["hf-to-megatron", hf, tmp_path / "out"], capsys)
    assert_one_line_error(code, err, str(hf / "pytorch_model.bin"), what)
    assert code == 1


@pytest.mark.timeout(60)
def test_exponential_tuple_used_as_a_dict_key_is_refused_before_hashing(tmp_path):
    """Hashing a tuple walks all of it, and unpickling hashes every dict key: a 60-deep tuple DAG as a key would
    spin inside the unpickler itself (torch's too). Refused while the tuples are made."""
    prog = b")q\x00"  # ()  -> memo 0
    for i in range(60):  # t[i+1] = (t[i], t[i])
        prog += b"h" + bytes([i]) + b"h" + bytes([i]) + b"\x86q" + bytes([i + 1])
    prog += b"}h" + bytes([60]) + b"Ns"  # {t[60]: None}
    path = tmp_path / "a.pt"
    torch.save({"w": torch.zeros(1)}, path)
    _rewrite_zip(path, lambda pkl: _into_top_dict(pkl, "k", prog))
    with pytest.raises(MConvertError, match=rf"more than {MAX_OBJECTS} objects"):  # hashing it first meets the timeout
        safe_load(path)


def test_check_tree_limits_name_the_file():
    deep: list = []
    cur = deep
    for _ in range(MAX_DEPTH + 1):
        cur.append([])
        cur = cur[0]
    with pytest.raises(MConvertError, match=rf"^f\.pt: nesting deeper than {MAX_DEPTH} levels"):
        check_tree("f.pt", {"a": deep})
    check_tree("f.pt", {"shared": [[1, 2]] * 1000})  # sharing within the limit loads
    with pytest.raises(MConvertError, match=r"^f\.pt: more than 10 objects"):
        check_tree("f.pt", [[1, 2]] * 6, max_objects=10)


# ---- opcode-level fuzz ---------------------------------------------------------------------------------------
SNIPPETS = [v[0] for v in ATTACKS.values()] + [
    _g("os", "system") + _s("true") + b"\x85R",
    _g("builtins", "eval") + _s("1") + b"\x85R",
    _g("builtins", "getattr") + _g("pathlib", "PosixPath") + _s("home") + b"\x86R",
    _s("pathlib") + _s("PosixPath") + b"\x93N" + _attrs(_str=".") + b"\x86b",  # STACK_GLOBAL + BUILD on a class
    _s("posix") + _s("system") + b"\x93" + _s("true") + b"\x85R",
    b"(" + _s("x") + b"ipathlib\nPosixPath\n",  # INST
    b"(" + _g("pathlib", "PosixPath") + _s("x") + b"o",  # OBJ
    _g("pathlib", "PosixPath") + _s("x") + b"\x85R" + b"N" + _attrs(_str="/") + b"\x86b",
    _g("argparse", "Namespace") + b")\x81" + b"}(" + _s("__class__") + _g("types", "SimpleNamespace") + b"ub",
    _g("argparse", "Namespace") + _s("k") + _s("v") + b"s",
    _g("collections", "OrderedDict") + b"(" + _s("k") + _s("v") + b"u",
    _g("argparse", "Namespace") + _s("x") + b"a",
    _g("copyreg", "_reconstructor") + _g("pathlib", "PosixPath") + _g("builtins", "object") + b"N\x87R"
    + b"N" + _attrs(_str=".") + b"\x86b",
    _g("builtins", "set") + b"]\x85R" + _s("x") + b"a",
    _g("numpy", "dtype") + _s("O") + b"\x85R",
    _g("builtins", "bytearray") + b"J\x00\x00\x00\x40\x85R",
    b"]" + _g("argparse", "Namespace") + b"a" + b"N" + _attrs(x="y") + b"b",
    _g("torch._utils", "_rebuild_parameter") + b"(" + _g("signal", "Signals") + b"\x89}tR",
    _g("argparse", "Namespace") + b")R" + _attrs(x="y") + b"b" + _attrs(z="w") + b"b",  # a second BUILD
]
BENIGN = [  # what real saves write: fresh objects given state once
    _g("argparse", "Namespace") + b")\x81" + _attrs(x="y") + b"b",
    _g("collections", "OrderedDict") + b")R(" + _s("k") + _s("v") + b"u",
    _g("numpy", "dtype") + _s("f4") + b"\x89\x88\x87R" + b"(K\x03" + _s("<")
    + b"NNNJ\xff\xff\xff\xffJ\xff\xff\xff\xffK\x00tb",
]


def _valid_pickles() -> list[tuple[str, bytes]]:
    """Pickles we produce: args Namespace (protocol 2, as torch.save), a rank-file-like dict (protocol 2 and 4)."""
    from mconvert.mappings.families import preset

    args = preset("tiny-llama").to_megatron_args(1, 1)
    rank = {"args": args, "model": OrderedDict(w=1.0), "iteration": 3,
            "rng_state": [{"np": np.random.RandomState(0).get_state()}],
            "opt": {"state": {0: {"step": 1}}, "param_groups": [{"params": [0], "betas": (0.9, 0.95)}]}}
    rank["model"]._metadata = OrderedDict({"": {"version": 1}})
    return [("args-p2", pickle.dumps({"args": args}, protocol=2)), ("rank-p2", pickle.dumps(rank, protocol=2)),
            ("rank-p4", pickle.dumps(rank, protocol=4))]


def _made_of_data(obj) -> None:
    """An accepted result holds no module and no callable but the allow-listed globals themselves."""
    allowed = {id(g.obj) for g in unpickler._torch_check_policy().values()}
    allowed |= {id(g.obj) for g in unpickler.dcp_policy().values()}
    todo, seen = [obj], set()
    while todo:
        o = todo.pop()
        if id(o) in seen:
            continue
        seen.add(id(o))
        assert not isinstance(o, types.ModuleType), o
        if isinstance(o, type):
            assert id(o) in allowed or issubclass(o, unpickler.StandIn), o
        elif isinstance(o, (types.FunctionType, types.BuiltinFunctionType)):
            assert id(o) in allowed, o
        elif isinstance(o, dict):
            todo += [*o.keys(), *o.values(), *getattr(o, "__dict__", {}).values()]
        elif isinstance(o, (list, tuple, set, frozenset)):
            todo += list(o)
        elif isinstance(getattr(o, "__dict__", None), dict):
            todo += list(o.__dict__.values())


FUZZ_CASES = 3000


@pytest.mark.timeout(120)
def test_opcode_fuzz_never_mutates_and_only_refuses_in_one_line(torch_dist_ckpt, unchanged):
    """Insert call / state / item opcodes on allowed and forbidden names at random opcode boundaries of valid
    pickles (a fixed seed and count, so every machine runs the same cases): every outcome is one MConvertError
    line naming the file, or a result made of data; no watched process-wide object changes (checked after every
    case, and by the fixture)."""
    rng = random.Random(11)
    md = (torch_dist_ckpt / "iter_0000001" / ".metadata").read_bytes()
    cases = [(name, data, "torch") for name, data in _valid_pickles()] + [("dcp", md, "dcp")]
    f4, refused, accepted = _f4(), 0, 0
    for n in range(FUZZ_CASES):
        name, data, mode = cases[n % len(cases)]
        cuts = [pos for _, _, pos in pickletools.genops(data)]
        pos = rng.choice(cuts[1:])
        snippet = rng.choice(SNIPPETS if rng.random() < 0.8 else BENIGN) + (b"0" if rng.random() < 0.5 else b"")
        mutated = data[:pos] + snippet + data[pos:]
        try:
            if mode == "dcp":
                obj = unpickler.restricted_unpickle(Path("fuzz.pkl"), io.BytesIO(mutated), unpickler.dcp_policy(),
                                         stand_ins="megatron.")
            else:
                obj = unpickler.restricted_unpickle(Path("fuzz.pkl"), io.BytesIO(mutated), unpickler._torch_check_policy(),
                                         persistent=unpickler._stub_storage)
        except MConvertError as e:
            assert str(e).startswith("fuzz.pkl: ") and "\n" not in str(e), str(e)
            refused += 1
        else:
            _made_of_data(obj)
            accepted += 1
        assert signal.Signals.SIGINT.name == "SIGINT" and "_str" not in vars(pathlib.PosixPath), (name, pos, snippet)
        assert _f4() == f4 and "parse_args" not in vars(argparse.Namespace), (name, pos, snippet)
    assert refused > 100 and accepted > 10, (refused, accepted)
