"""The catalogue of bad inputs: each one is built by damaging a correct checkpoint (transformers model ->
our hf-to-megatron at TP=2 PP=2) and fed to the real CLI entry point. Every case must end with exit code 1,
exactly one `error:` line on stderr naming the file or key (and, where there is one, what to do), no
traceback, and no OUT directory.
"""

from __future__ import annotations

import json
import resource
import shutil
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Callable

import pytest
import torch
from safety_common import (
    _WORK,
    assert_one_line_error,
    base,
    copy_of,
    hf_tensors,
    is_root,
    load_rank,
    make_hf_llama,
    mount_tmpfs,
    rank_file,
    run_cli,
    save_rank,
    umount,
)

ACTIONS = ("pass ", "re-copy", "remove", "pick", "choose", "fix", "free", "raise", "convert an earlier", "use ",
           "write ", "check", "re-export")

FC1 = "decoder.layers.0.mlp.linear_fc1.weight"
FC2 = "decoder.layers.0.mlp.linear_fc2.weight"


@dataclass
class Case:
    build: Callable[[Path], list]  # tmp dir -> argv (OUT is tmp / "out")
    expect: tuple[str, ...]  # substrings of the one error line ("{tmp}" is replaced)
    action: bool = True  # the line says what to do


def _ckpt(tmp: Path) -> Path:
    return copy_of("ckpt", tmp / "ckpt")


def _to_hf(tmp: Path, ckpt: Path, *extra: str) -> list:
    return ["megatron-to-hf", ckpt, tmp / "out", *extra]


def _edit_rank(ckpt: Path, tp: int, pp: int, fn: Callable[[dict], None]) -> Path:
    f = rank_file(ckpt, tp, pp)
    state = load_rank(f)
    fn(state)
    save_rank(f, state)
    return f


def _truncate(f: Path, keep: float = 0.5) -> Path:
    data = f.read_bytes()
    f.write_bytes(data[: int(len(data) * keep)])
    return f


@lru_cache(maxsize=None)
def _odd_hf() -> Path:
    """6 heads, 3 KV groups, ffn 100, 3 layers: TP 4 / 2 / 3 and PP 2 each break one divisibility rule."""
    return make_hf_llama(_WORK / "odd-hf", layers=3, hidden=96, ffn=100, heads=6, groups=3)


def missing_rank_dir(tmp):
    c = _ckpt(tmp)
    shutil.rmtree(c / "release" / "mp_rank_01_001")
    return _to_hf(tmp, c)


def extra_rank_dir(tmp):
    c = _ckpt(tmp)
    shutil.copytree(c / "release" / "mp_rank_01_001", c / "release" / "mp_rank_02_001")
    return _to_hf(tmp, c)


def mixed_rank_dir_names(tmp):
    c = _ckpt(tmp)
    shutil.copytree(c / "release" / "mp_rank_01_000", c / "release" / "mp_rank_01")
    return _to_hf(tmp, c)


def truncated_pt(tmp):
    c = _ckpt(tmp)
    _truncate(rank_file(c, 1, 0))
    return _to_hf(tmp, c)


def empty_pt(tmp):
    c = _ckpt(tmp)
    rank_file(c, 0, 1).write_bytes(b"")
    return _to_hf(tmp, c)


def truncated_safetensors(tmp):
    h = copy_of("hf", tmp / "hf")
    _truncate(h / "model.safetensors")
    return ["hf-to-megatron", h, tmp / "out"]


def mismatched_tp_shapes(tmp):
    c = _ckpt(tmp)
    _edit_rank(c, 1, 0, lambda s: s["model"].__setitem__(FC1, s["model"][FC1][:-2].clone()))
    return _to_hf(tmp, c)


def args_differ_between_ranks(tmp):
    c = _ckpt(tmp)
    _edit_rank(c, 1, 1, lambda s: setattr(s["args"], "ffn_hidden_size", 96))
    return _to_hf(tmp, c)


def args_differ_on_a_later_stage(tmp):
    c = _ckpt(tmp)  # TP rank 0 of stage 1: checked as its keys are read, before the other ranks
    _edit_rank(c, 0, 1, lambda s: setattr(s["args"], "ffn_hidden_size", 96))
    return _to_hf(tmp, c)


def checkpoint_version_differs_on_a_later_stage(tmp):
    c = _ckpt(tmp)
    _edit_rank(c, 0, 1, lambda s: s.__setitem__("checkpoint_version", 1.0))
    return _to_hf(tmp, c)


def unknown_key(tmp):
    c = _ckpt(tmp)
    _edit_rank(c, 0, 0, lambda s: s["model"].__setitem__("decoder.layers.0.mlp.router.weight", torch.zeros(2, 2)))
    return _to_hf(tmp, c)


def unknown_key_on_tp_rank_1(tmp):
    c = _ckpt(tmp)
    _edit_rank(c, 1, 0, lambda s: s["model"].__setitem__("decoder.layers.0.mlp.router.weight", torch.zeros(2, 2)))
    return _to_hf(tmp, c)


def missing_key(tmp):
    c = _ckpt(tmp)
    for t in range(2):
        _edit_rank(c, t, 0, lambda s: s["model"].pop(FC2))
    return _to_hf(tmp, c)


def missing_key_on_tp_rank_1(tmp):
    c = _ckpt(tmp)
    _edit_rank(c, 1, 0, lambda s: s["model"].pop(FC2))
    return _to_hf(tmp, c)


def nan_weight(tmp):
    c = _ckpt(tmp)

    def poison(s):
        k = next(k for k in s["model"] if k.endswith("linear_proj.weight"))
        s["model"][k][0, 0] = float("nan")

    _edit_rank(c, 1, 1, poison)
    return _to_hf(tmp, c)


def inf_weight(tmp):
    c = _ckpt(tmp)
    _edit_rank(c, 0, 0, lambda s: s["model"]["embedding.word_embeddings.weight"].__setitem__((3, 3), float("inf")))
    return _to_hf(tmp, c)


def nan_in_hf_input(tmp):
    from safetensors.torch import save_file

    h = copy_of("hf", tmp / "hf")
    t = hf_tensors(h)
    t["model.layers.1.mlp.up_proj.weight"][0, 0] = float("nan")
    save_file(t, h / "model.safetensors", metadata={"format": "pt"})
    return ["hf-to-megatron", h, tmp / "out"]


def int_weight_on_one_rank(tmp):
    c = _ckpt(tmp)
    _edit_rank(c, 1, 0, lambda s: s["model"].__setitem__(FC1, s["model"][FC1].view(torch.int32).clone()))
    return _to_hf(tmp, c)


def int_weight_in_hf_input(tmp):
    h = copy_of("hf", tmp / "hf")
    f = h / "model.safetensors"
    raw = bytearray(f.read_bytes())
    at = raw.find(b'"F32"', raw.find(b'"model.layers.0.mlp.up_proj.weight"'))
    raw[at + 1: at + 2] = b"I"  # same size, so safetensors itself accepts it
    f.write_bytes(bytes(raw))
    return ["hf-to-megatron", h, tmp / "out"]


def nan_in_hf_bin_input(tmp):
    h = copy_of("hf", tmp / "hf")
    t = hf_tensors(h)
    t["model.norm.weight"][5] = float("inf")
    (h / "model.safetensors").unlink()
    torch.save(t, h / "pytorch_model.bin")
    return ["hf-to-megatron", h, tmp / "out"]


def bit_flip_inside_a_tensor(tmp):
    c = _ckpt(tmp)  # no manifest, as Megatron-LM writes it: torch's per-entry CRC-32 is the only witness
    f = rank_file(c, 0, 1)
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0x04
    f.write_bytes(bytes(data))
    return _to_hf(tmp, c)


def iteration_not_found(tmp):
    return _to_hf(tmp, base()["ckpt"], "--iteration", "5")


def tracker_names_absent_iteration(tmp):
    c = _ckpt(tmp)
    (c / "latest_checkpointed_iteration.txt").write_text("7")
    return _to_hf(tmp, c)


def unreadable_tracker(tmp):
    c = _ckpt(tmp)
    (c / "latest_checkpointed_iteration.txt").write_bytes(b"\xff\xfe\x00\x13garbage")
    return _to_hf(tmp, c)


def output_exists(tmp):
    (tmp / "out").mkdir()
    (tmp / "out" / "precious.txt").write_text("mine")
    return _to_hf(tmp, base()["ckpt"])


def tp_does_not_divide_heads(tmp):
    return ["hf-to-megatron", _odd_hf(), tmp / "out", "--tp", "4"]


def tp_and_groups_do_not_divide(tmp):
    return ["hf-to-megatron", _odd_hf(), tmp / "out", "--tp", "2"]


def tp_does_not_divide_ffn(tmp):
    return ["hf-to-megatron", _odd_hf(), tmp / "out", "--tp", "3"]


def pp_does_not_divide_layers(tmp):
    return ["hf-to-megatron", _odd_hf(), tmp / "out", "--pp", "2"]


def reshard_tp_does_not_divide_heads(tmp):
    return ["reshard", base()["ckpt"], tmp / "out", "--tp", "3"]


def unsupported_hf_architecture(tmp):
    h = copy_of("hf", tmp / "hf")
    cfg = json.loads((h / "config.json").read_text())
    cfg.update(architectures=["BertForMaskedLM"], model_type="bert")
    (h / "config.json").write_text(json.dumps(cfg))
    return ["hf-to-megatron", h, tmp / "out"]


def unsupported_megatron_architecture(tmp):
    c = _ckpt(tmp)
    for t in range(2):
        for p in range(2):
            _edit_rank(c, t, p, lambda s: setattr(s["args"], "num_experts", 8))
    return _to_hf(tmp, c)


def not_a_checkpoint(tmp):
    (tmp / "empty").mkdir()
    return _to_hf(tmp, tmp / "empty")


def unreadable_config_json(tmp):
    h = copy_of("hf", tmp / "hf")
    (h / "config.json").write_text("{not json")
    return ["hf-to-megatron", h, tmp / "out"]


def input_changed_since_mconvert_wrote_it(tmp):
    c = copy_of("ckpt", tmp / "ckpt", manifest=True)
    f = rank_file(c, 1, 1)
    data = bytearray(f.read_bytes())
    data[-4096] ^= 0x10  # inside tensor data: only the manifest can tell
    f.write_bytes(bytes(data))
    return _to_hf(tmp, c)


CATALOGUE: dict[str, Case] = {
    "missing rank directory": Case(missing_rank_dir, ("{tmp}/ckpt/release", "TP rank 1, PP rank 1 is missing")),
    "extra rank directory": Case(extra_rank_dir, ("mp_rank_02_001", "the args say TP=2, PP=2", "remove")),
    "mp_rank_TT beside mp_rank_TT_PPP": Case(mixed_rank_dir_names, ("mp_rank_01", "remove the stray one")),
    "truncated .pt": Case(truncated_pt, ("{tmp}/ckpt/release/mp_rank_01_000/model_optim_rng.pt", "truncated")),
    "empty .pt": Case(empty_pt, ("{tmp}/ckpt/release/mp_rank_00_001/model_optim_rng.pt", "empty")),
    "truncated safetensors": Case(truncated_safetensors, ("{tmp}/hf/model.safetensors", "truncated")),
    "TP shards of one parameter with mismatched shapes": Case(
        mismatched_tp_shapes, ("mp_rank_01_000/model_optim_rng.pt", FC1, "(126, 64)", "(128, 64)")),
    "args differ between ranks": Case(
        args_differ_between_ranks, ("mp_rank_01_001/model_optim_rng.pt", "ffn_hidden_size=96", "128")),
    "args differ on a later stage's TP rank 0": Case(
        args_differ_on_a_later_stage, ("mp_rank_00_001/model_optim_rng.pt", "ffn_hidden_size=96", "128")),
    "checkpoint_version differs on a later stage": Case(
        checkpoint_version_differs_on_a_later_stage, ("mp_rank_00_001/model_optim_rng.pt", "checkpoint_version 1.0",
                                                      "different runs")),
    "unknown key": Case(unknown_key, ("mp_rank_00_000/model_optim_rng.pt", "decoder.layers.0.mlp.router.weight",
                                      "unmapped key"), action=False),
    "unknown key on TP rank 1 only": Case(
        unknown_key_on_tp_rank_1, ("mp_rank_01_000/model_optim_rng.pt", "decoder.layers.0.mlp.router.weight")),
    "missing key": Case(missing_key, (FC2, "is missing")),
    "missing key on TP rank 1 only": Case(missing_key_on_tp_rank_1, ("mp_rank_01_000/model_optim_rng.pt", FC2)),
    "NaN weight": Case(nan_weight, ("mp_rank_01_001/model_optim_rng.pt", "linear_proj.weight", "NaN or Inf")),
    "Inf weight": Case(inf_weight, ("mp_rank_00_000/model_optim_rng.pt", "embedding.word_embeddings.weight")),
    "NaN in an HF input": Case(nan_in_hf_input, ("{tmp}/hf/model.safetensors", "model.layers.1.mlp.up_proj.weight")),
    "integer weights on one TP rank": Case(int_weight_on_one_rank, ("mp_rank_01_000/model_optim_rng.pt", FC1,
                                                                    "torch.int32")),
    "integer weights in an HF input": Case(int_weight_in_hf_input, ("{tmp}/hf/model.safetensors", "torch.int32")),
    "Inf in an HF pytorch_model.bin": Case(nan_in_hf_bin_input, ("{tmp}/hf/pytorch_model.bin", "model.norm.weight")),
    "one bit flipped inside a tensor (.pt)": Case(bit_flip_inside_a_tensor, ("mp_rank_00_001/model_optim_rng.pt",
                                                                           "CRC-32", "re-copy")),
    "iteration not found": Case(iteration_not_found, ("iter_0000005", "available: release")),
    "tracker names an absent iteration": Case(tracker_names_absent_iteration,
                                              ("latest_checkpointed_iteration.txt", "iteration 7", "--iteration")),
    "unreadable latest_checkpointed_iteration.txt": Case(
        unreadable_tracker, ("{tmp}/ckpt/latest_checkpointed_iteration.txt", "--iteration")),
    "output exists": Case(output_exists, ("{tmp}/out", "already exists", "--force")),
    "TP does not divide heads": Case(tp_does_not_divide_heads, ("TP=4", "num_attention_heads=6")),
    "TP and query groups do not divide": Case(tp_and_groups_do_not_divide, ("TP=2", "num_query_groups=3")),
    "TP does not divide ffn": Case(tp_does_not_divide_ffn, ("TP=3", "ffn_hidden_size=100")),
    "PP does not divide layers": Case(pp_does_not_divide_layers, ("PP=2", "num_layers=3")),
    "reshard: TP does not divide heads": Case(reshard_tp_does_not_divide_heads, ("TP=3", "num_attention_heads=4")),
    "unsupported HF architecture": Case(unsupported_hf_architecture,
                                        ("{tmp}/hf/config.json", "BertForMaskedLM", "supported:"), action=False),
    "unsupported Megatron architecture (MoE)": Case(
        unsupported_megatron_architecture, ("mp_rank_00_000/model_optim_rng.pt", "num_experts=8"), action=False),
    "not a checkpoint": Case(not_a_checkpoint, ("{tmp}/empty", "not a checkpoint"), action=False),
    "unreadable config.json": Case(unreadable_config_json, ("{tmp}/hf/config.json", "unreadable config")),
    "input changed after mconvert wrote it": Case(
        input_changed_since_mconvert_wrote_it, ("mp_rank_01_001/model_optim_rng.pt", "blake3 differs")),
}


def test_usage_error_is_clicks_message_not_a_traceback(tmp_path, capsys):
    code, _, err = run_cli(["megatron-to-hf", base()["ckpt"], tmp_path / "out", "--no-such-flag"], capsys)
    assert code == 2 and "No such option" in err and "Traceback" not in err


@pytest.mark.parametrize("name", list(CATALOGUE))
def test_catalogue(name, tmp_path, capsys):
    case = CATALOGUE[name]
    base()
    argv = case.build(tmp_path)
    existed = (tmp_path / "out").exists()
    code, _, err = run_cli(argv, capsys)
    line = assert_one_line_error(code, err, *(s.replace("{tmp}", str(tmp_path)) for s in case.expect))
    if case.action:
        assert any(a in line.lower() for a in ACTIONS), f"no advice in {line!r}"
    if existed:
        assert (tmp_path / "out" / "precious.txt").read_text() == "mine"
    else:
        assert not (tmp_path / "out").exists()
    assert not list(tmp_path.glob(".out.mconvert-tmp-*")), "temporary output left behind"


def test_force_replaces_an_existing_output(tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "precious.txt").write_text("mine")
    code, _, err = run_cli(["megatron-to-hf", base()["ckpt"], out, "--force"], capsys)
    assert code == 0, err
    assert not (out / "precious.txt").exists()
    ref = hf_tensors(base()["ref"])
    got = hf_tensors(out)
    assert ref.keys() == got.keys() and all(torch.equal(ref[k], got[k]) for k in ref)


# ---- output not writable, disk full -----------------------------------------------------------------
def test_output_not_writable(tmp_path, capsys):
    ro = tmp_path / "ro"
    mounted = mount_tmpfs(ro, "ro,size=64k")
    if not mounted:
        if is_root():
            pytest.skip("root without mount: permissions cannot stop root")
        ro.chmod(0o555)
    try:
        code, _, err = run_cli(["megatron-to-hf", base()["ckpt"], ro / "out"], capsys)
        assert_one_line_error(code, err, f"{ro}/out", "cannot write", "choose another output path")
        assert not (ro / "out").exists()
    finally:
        umount(ro) if mounted else ro.chmod(0o755)


def test_disk_full_on_a_tiny_filesystem(tmp_path, capsys):
    """A 64 KiB tmpfs: the safetensors write hits ENOSPC mid-file; one line, and the partial output is gone."""
    small = tmp_path / "small"
    base()
    if not mount_tmpfs(small, "size=64k"):
        pytest.skip("needs root and mount to make a tiny tmpfs (the file-size-limit test covers the write path)")
    try:
        code, _, err = run_cli(["megatron-to-hf", base()["ckpt"], small / "out"], capsys)
        assert_one_line_error(code, err, f"{small}/out", "disk full", "free space")
        assert not (small / "out").exists() and not list(small.iterdir()), list(small.iterdir())
    finally:
        umount(small)


@pytest.mark.parametrize("verb", ["megatron-to-hf", "hf-to-megatron"])
def test_file_size_limit_hits_the_write_path(tmp_path, capsys, verb):
    """RLIMIT_FSIZE (works without root): writes past 64 KiB fail with EFBIG (Python ignores SIGXFSZ)."""
    b = base()
    src = b["ckpt"] if verb == "megatron-to-hf" else b["hf"]
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (64 << 10, hard))
    try:
        code, _, err = run_cli([verb, src, tmp_path / "out"], capsys)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    assert_one_line_error(code, err, f"{tmp_path}/out", "file-size limit", "ulimit -f")
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out.*"))
