"""Wrong shapes of every file mconvert reads, and hostile text in paths: each ends in exactly one `error:` line
on stderr naming the file or key, exit code 1, no traceback, no OUT. Built by damaging correct outputs of
transformers and of our own writers, then fed to the real CLI entry point of every verb that reads the file.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Callable

import pytest
import torch
from safety_common import _WORK, assert_one_line_error, base, copy_of, load_rank, make_hf_llama, run_cli, save_rank

pytestmark = pytest.mark.timeout(120)


@lru_cache(maxsize=None)
def _made(kind: str) -> Path:
    """A correct directory of `kind` written by our own writers from the base model, built once."""
    from mconvert.convert.verbs import megatron_to_ft
    from mconvert.convert.verbs import megatron_to_trtllm
    from mconvert.data import build_tokenizer, save_hf_tokenizer

    out = _WORK / f"made-{kind}"
    if kind == "trtllm":
        megatron_to_trtllm(base()["hf"], out, 1)
    elif kind == "ft":  # FT's LLaMA layout has no GQA: an MHA model
        megatron_to_ft(make_hf_llama(_WORK / "mha-hf", groups=4), out, 1)
    elif kind == "tok":
        out.mkdir()
        save_hf_tokenizer(build_tokenizer(vocab_size=300), out)
    elif kind == "dist":  # a torch_dist iteration dir as megatron-core lays it out (metadata.json + common.pt)
        d = out / "iter_0000001"
        d.mkdir(parents=True)
        (out / "latest_checkpointed_iteration.txt").write_text("1")
        (d / "metadata.json").write_text(json.dumps({"sharded_backend": "torch_dist", "sharded_backend_version": 1,
                                                     "common_backend": "torch", "common_backend_version": 1}))
        torch.save(_common(), d / "common.pt")
    return out


def _common(**over: object) -> dict:
    """common.pt of a torch_dist iteration as megatron-core writes it (args, checkpoint_version, iteration)."""
    from mconvert.mappings.families import preset

    return {"args": preset("tiny-llama").to_megatron_args(1, 1), "checkpoint_version": 3.0, "iteration": 1, **over}


def _copy(kind: str, dst: Path) -> Path:
    if kind in ("hf", "ckpt", "ref"):
        return copy_of(kind, dst, manifest=kind == "ref")
    shutil.copytree(_made(kind), dst)
    return dst


def _write(path: Path, obj: object) -> None:
    path.write_text(obj if isinstance(obj, str) else json.dumps(obj))


def _to_bin(d: Path) -> None:
    """The HF dir as transformers' older pickle format (pytorch_model.bin) instead of safetensors."""
    from safetensors.torch import load_file

    torch.save(load_file(d / "model.safetensors"), d / "pytorch_model.bin")
    (d / "model.safetensors").unlink()


def _edit_all_ranks(ckpt: Path, fn: Callable[[dict], object]) -> None:
    for f in sorted((ckpt / "release").glob("mp_rank_*/model_optim_rng.pt")):
        state = load_rank(f)
        save_rank(f, fn(state))


@dataclass
class Case:
    kind: str  # what is damaged: hf | ckpt | ref | trtllm | ft | tok | dist
    damage: Callable[[Path], object]  # edits the copy in place
    verbs: tuple[str, ...]
    names: str  # the file (relative to the copy) or key the one line must name


def _argv(verb: str, src: Path, tmp: Path) -> list:
    out = tmp / "out"
    if verb == "megatron-to-hf --tokenizer":
        return ["megatron-to-hf", base()["ckpt"], out, "--tokenizer", src]
    if verb == "validate":
        return ["validate", base()["hf"], src, "--device", "cpu", "--tokens", "8"]
    if verb == "plan --bandwidth-file":
        return ["plan", "--preset", "tiny-llama", "--to", "hf", "--bandwidth-file", src]
    if verb in ("inspect", "verify"):
        return [verb, src]
    if verb == "reshard --with-optimizer":
        return ["reshard", src, out, "--tp", "1", "--pp", "1", "--with-optimizer"]
    extra = {"megatron-to-ft": ["--infer-tp", "1"], "reshard": ["--tp", "1", "--pp", "1"]}.get(verb, [])
    return [verb, src, out, *extra]


_IDX = "model.safetensors.index.json"
_RANK = "release/mp_rank_00_000/model_optim_rng.pt"
_TO_HF = ("megatron-to-hf", "reshard", "inspect")

CASES: dict[str, Case] = {
    "config.json is an array": Case("hf", lambda d: _write(d / "config.json", []),
                                    ("hf-to-megatron", "megatron-to-trtllm", "megatron-to-ft", "inspect", "verify",
                                     "validate", "to-onnx"), "config.json"),
    "config.json is a string": Case("hf", lambda d: _write(d / "config.json", "\"llama\""),
                                    ("hf-to-megatron", "verify"), "config.json"),
    "config.json nested 100000 deep": Case("hf", lambda d: _write(d / "config.json", "[" * 100000 + "]" * 100000),
                                           ("hf-to-megatron", "verify"), "config.json"),
    "config.json not UTF-8": Case("hf", lambda d: (d / "config.json").write_bytes(b'{"a": "\xff\xfe"}'),
                                  ("hf-to-megatron", "verify"), "config.json"),
    "index is an array": Case("hf", lambda d: _write(d / _IDX, []), ("hf-to-megatron", "verify"), _IDX),
    "index weight_map is an array": Case("hf", lambda d: _write(d / _IDX, {"weight_map": ["model.safetensors"]}),
                                         ("hf-to-megatron", "verify", "megatron-to-trtllm"), _IDX),
    "index weight_map values are numbers": Case(
        "hf", lambda d: _write(d / _IDX, {"weight_map": {"model.norm.weight": 3}}), ("hf-to-megatron", "verify"),
        "model.norm.weight"),
    "bin index weight_map is a string": Case("hf", lambda d: (_to_bin(d), _write(d / "pytorch_model.bin.index.json",
                                                                                  {"weight_map": "x"})),
                                             ("hf-to-megatron",), "pytorch_model.bin.index.json"),
    "generation_config.json is an array": Case("ref", lambda d: _write(d / "generation_config.json", [1, 2]),
                                               ("verify",), "generation_config.json"),
    "tokenizer_config.json is an array": Case("tok", lambda d: _write(d / "tokenizer_config.json", []),
                                              ("megatron-to-hf --tokenizer",), "tokenizer_config.json"),
    "special_tokens_map.json is a string": Case("tok", lambda d: _write(d / "special_tokens_map.json", "\"x\""),
                                                ("megatron-to-hf --tokenizer",), "special_tokens_map.json"),
    "tokenizer.json is an array": Case("tok", lambda d: _write(d / "tokenizer.json", []),
                                       ("megatron-to-hf --tokenizer",), "tokenizer"),
    "rank file top level is a list": Case("ckpt", lambda d: _edit_all_ranks(d, lambda s: [s["model"]]),
                                          _TO_HF, "mp_rank_00_000/model_optim_rng.pt"),
    "rank file model is a tensor": Case("ckpt", lambda d: _edit_all_ranks(d, lambda s: {**s, "model": torch.zeros(3)}),
                                        _TO_HF, "'model'"),
    "rank file without args": Case("ckpt", lambda d: _edit_all_ranks(d, lambda s: {k: v for k, v in s.items()
                                                                                  if k != "args"}),
                                   _TO_HF, "'args'"),
    "rank file args is a list": Case("ckpt", lambda d: _edit_all_ranks(d, lambda s: {**s, "args": [1, 2]}),
                                     _TO_HF, "args"),
    "rank file optimizer is a list": Case("ckpt", lambda d: _edit_all_ranks(d, lambda s: {**s, "optimizer": [1]}),
                                          ("reshard --with-optimizer",), "optimizer"),
    "manifest is an array": Case("ref", lambda d: _write(d / "mconvert-manifest.json", []),
                                 ("hf-to-megatron", "verify"), "mconvert-manifest.json"),
    "manifest files is an array": Case("ref", lambda d: _write(d / "mconvert-manifest.json", {"files": ["x"]}),
                                       ("hf-to-megatron",), "mconvert-manifest.json"),
    "torch_dist metadata.json is an array": Case("dist", lambda d: _write(d / "iter_0000001/metadata.json", []),
                                                 ("megatron-to-hf", "inspect"), "metadata.json"),
    "torch_dist common.pt is a list": Case("dist", lambda d: torch.save([1, 2], d / "iter_0000001/common.pt"),
                                           ("megatron-to-hf", "inspect"), "common.pt"),
    "torch_dist common.pt checkpoint_version is text": Case(
        "dist", lambda d: torch.save(_common(checkpoint_version="3.0"), d / "iter_0000001/common.pt"),
        ("megatron-to-hf",), "checkpoint_version"),
    "TensorRT-LLM config.json is an array": Case("trtllm", lambda d: _write(d / "config.json", []),
                                                 ("validate",), "config.json"),
    "TensorRT-LLM config mapping is an array": Case(
        "trtllm", lambda d: _write(d / "config.json", {**json.loads((d / "config.json").read_text()), "mapping": [1]}),
        ("validate",), "mapping"),
    "TensorRT-LLM config hidden_size is text": Case(
        "trtllm",
        lambda d: _write(d / "config.json", {**json.loads((d / "config.json").read_text()), "hidden_size": "big"}),
        ("validate",), "hidden_size"),
    "FT config.ini without a section": Case("ft", lambda d: (d / "1-gpu/config.ini").write_text("head_num = 4\n"),
                                            ("validate",), "config.ini"),
    "FT config.ini text where ints belong": Case(
        "ft", lambda d: (d / "1-gpu/config.ini").write_text(
            (d / "1-gpu/config.ini").read_text().replace("head_num = ", "head_num = many")), ("validate",),
        "head_num"),
    "bandwidth file is an array": Case("tok", lambda d: _write(d / "bw.json", []), ("plan --bandwidth-file",),
                                       "bw.json"),
    "bandwidth ratio_to_cp is an array": Case("tok", lambda d: _write(d / "bw.json", {"copy_bytes_per_s": 1e9,
                                                                                      "ratio_to_cp": [1]}),
                                              ("plan --bandwidth-file",), "ratio_to_cp"),
}

_SRC_FILE = {"bandwidth file is an array": "bw.json", "bandwidth ratio_to_cp is an array": "bw.json"}


@pytest.mark.parametrize("name,verb", [(n, v) for n, c in CASES.items() for v in c.verbs])
def test_wrong_shape_is_one_line(name: str, verb: str, tmp_path: Path, capsys) -> None:
    case = CASES[name]
    src = _copy(case.kind, tmp_path / "src")
    case.damage(src)
    argv = _argv(verb, src / _SRC_FILE.get(name, ""), tmp_path)
    code, _, err = run_cli(argv, capsys)
    assert code == 1, (code, err)
    lines = [ln.strip() for ln in err.splitlines() if ln.strip()]
    if verb in ("verify", "validate") and not lines[0].startswith("error:"):
        # report verbs: a model or file that cannot be read is one failed check, named on its own ✗ line
        assert "Traceback" not in err and lines[-1].startswith(("NOT READY", "FAIL")), err
        assert any(case.names in ln for ln in lines if ln.startswith("✗")), err
    else:
        assert_one_line_error(code, err, case.names)
    assert "internal error" not in err, err
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out*"))
