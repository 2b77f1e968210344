"""The streaming I/O (mconvert/io/): each proven against torch.save,
safetensors' own loader or transforms.merge — the formats' and the pure shard math's own answers."""

from __future__ import annotations

import argparse
import hashlib
import os
from pathlib import Path

import blake3
import pytest
import torch
from safetensors.torch import load_file

from mconvert.convert.base import units_of
from mconvert.convert.megatron.source import MegatronSource
from mconvert.convert.megatron.writer import MegatronWriter
from mconvert.io.safeload import safe_load
from mconvert.io.safetensors import SafetensorsStream
from mconvert.io.torchsave import Spool, TensorIndex, save_spooled
from mconvert.mappings.keys import flatten, unit_of
from mconvert.mappings.transforms import merge
from mconvert.mappings.families import preset


def _sha(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def test_spooled_save_is_byte_identical_to_torch_save(tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(0)
    shared = torch.randn(10, generator=g)
    rng = torch.get_rng_state()

    def state(model: dict) -> dict:
        return {"args": argparse.Namespace(a=1, b="x"), "checkpoint_version": 3.0, "iteration": 0, "model": model,
                "rng_state": [{"torch_rng_state": rng, "np": None}], "extra": (shared, shared[2:5].clone())}

    real = {"w": torch.randn(300, 70, generator=g), "b": torch.randn(7, generator=g).bfloat16(),
            "e": torch.empty(0), "x._extra_state": None, "h": torch.randn(3, 4, generator=g).half()}
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    torch.save(state(real), tmp_path / "a" / "model_optim_rng.pt")
    spool = Spool(tmp_path / "b" / ".spool")
    parked = {k: spool.park(v) if isinstance(v, torch.Tensor) else v for k, v in real.items()}
    save_spooled(state(parked), tmp_path / "b" / "model_optim_rng.pt", spool)
    spool.close()
    assert _sha(tmp_path / "a") == _sha(tmp_path / "b")  # CRCs and .data/serialization_id included


@pytest.mark.parametrize("name,tp,pp", [("tiny-gpt2", 2, 2), ("tiny-llama", 2, 1), ("tiny-qwen2", 4, 2)])
def test_megatron_writer_spooled_equals_buffered(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str,
                                                 tp: int, pp: int) -> None:
    """The writer's spooled rank files are the files its stage-buffered torch.save path writes, byte for byte."""
    spec = preset(name)

    def write(root: Path) -> None:
        g = torch.Generator().manual_seed(1)
        w = MegatronWriter(root, spec, tp, pp)
        for unit in units_of(spec):
            decls = (spec.embedding_params() if unit == "embedding" else spec.final_params() if unit == "final"
                     else spec.layer_params(int(unit)))
            w.add(unit, {d.name: torch.randn(d.shape, generator=g) for d in decls})
        w.close()

    write(tmp_path / "spooled")
    assert not list((tmp_path / "spooled").rglob(".spool*"))

    class NoSpool:
        def park(self, t: torch.Tensor) -> torch.Tensor:
            return t

    monkeypatch.setattr(MegatronWriter, "_spool", lambda self, p, t: NoSpool())
    write(tmp_path / "buffered")
    assert _sha(tmp_path / "spooled") == _sha(tmp_path / "buffered")


def test_safetensors_stream_is_read_back_by_safetensors(tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(2)
    ts = {"a": torch.randn(3, 5, generator=g), "b": torch.randn(7, generator=g).bfloat16(),
          "c": torch.randn(4, 2, generator=g).half().t(), "d": torch.arange(10)[2:5]}
    path = tmp_path / "m.safetensors"
    w = SafetensorsStream(path, [(k, v.dtype, tuple(v.shape)) for k, v in ts.items()], {"format": "pt"})
    for k, v in ts.items():
        w.add(k, v)
    digest = w.close()
    got = load_file(path)
    assert all(torch.equal(got[k], ts[k]) for k in ts)
    assert digest == blake3.blake3(path.read_bytes()).hexdigest()  # the manifest's default hash
    w = SafetensorsStream(tmp_path / "x.safetensors", [("a", torch.float32, (3, 5))])
    with pytest.raises(Exception, match="planned from the model config"):
        w.add("a", torch.zeros(5, 3))
    w.abort()


def test_tensor_index_reads_what_torch_load_reads(tmp_path: Path) -> None:
    a = torch.randn(10, 6)
    torch.save({"model": {"w": a, "wt": a.t(), "sl": a[2:5], "b": torch.randn(3).bfloat16()},
                "rng": torch.get_rng_state(), "args": 1}, tmp_path / "v.pt")
    st = safe_load(tmp_path / "v.pt")
    idx = TensorIndex.build(tmp_path / "v.pt", st, st["model"])
    assert idx is not None
    fd = os.open(tmp_path / "v.pt", os.O_RDONLY)
    try:
        for k, v in st["model"].items():
            x = idx.read(fd, k)
            assert torch.equal(x, v) and x.stride() == v.stride()
    finally:
        os.close(fd)


@pytest.mark.parametrize("name,tp,pp", [("tiny-llama", 2, 2), ("tiny-gpt2", 2, 1), ("tiny-qwen2", 4, 1)])
def test_source_reads_equal_merge_of_the_loaded_shards(tmp_path: Path, name: str, tp: int, pp: int) -> None:
    """pread-into-place merging (column / qkv / vocab / gated) gives what transforms.merge gives."""
    spec = preset(name)
    g = torch.Generator().manual_seed(3)
    w = MegatronWriter(tmp_path / "ck", spec, tp, pp)
    for unit in units_of(spec):
        decls = (spec.embedding_params() if unit == "embedding" else spec.final_params() if unit == "final"
                 else spec.layer_params(int(unit)))
        w.add(unit, {d.name: torch.randn(d.shape, generator=g) for d in decls})
    w.close()
    src = MegatronSource(tmp_path / "ck")
    for unit in src.units():
        got = src.read_mcore(unit)
        p, c = src.location(unit)
        loaded = [flatten(safe_load(src.files[(t, p)])["model"]) for t in range(src.tp)]
        for raw, cname in src._keymaps[(p, c)].items():
            if unit_of(cname) == unit:
                want = merge([m[raw] for m in loaded], spec.split_kind(cname), cname)
                assert torch.equal(got[cname], want), cname
