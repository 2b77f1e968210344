"""The byte path (`.bin` inputs, one CRC pass, transposes into a buffer), each against an answer we did not
compute: transformers' own `.bin` writer, torch's merge and transpose ops, torch.save's bytes and the CRC-32
it stored."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers

from mconvert.errors import MConvertError
from safety_common import load_rank, save_rank, sha_tree


@pytest.fixture(scope="module")
def hf_pair(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Path]]:
    """Per family: an HF directory (safetensors, ours) and the same model re-saved by transformers as
    `pytorch_model.bin` with our config and tokenizer files beside it."""
    from mconvert.convert.verbs import megatron_to_hf
    from mconvert.trainer.train import TrainConfig, train

    out = {}
    for preset in ("tiny-gpt2", "tiny-llama"):
        root = tmp_path_factory.mktemp(preset)
        train(TrainConfig(preset=preset, tp=2, pp=2, steps=1, save=str(root / "ck"), force=True, quiet=True,
                          device="cpu"))
        megatron_to_hf(root / "ck", root / "hf")
        model = transformers.AutoModelForCausalLM.from_pretrained(root / "hf")
        model.save_pretrained(root / "bin", safe_serialization=False)
        for p in (root / "hf").iterdir():  # the same config and tokenizer: only the weight format differs
            if not p.name.endswith(".safetensors") and not p.name.startswith(("mconvert-manifest", "model.safe")):
                shutil.copy(p, root / "bin" / p.name)
        assert not list((root / "bin").glob("*.safetensors")) and (root / "bin" / "pytorch_model.bin").is_file()
        out[preset] = (root / "hf", root / "bin")
    return out


@pytest.mark.timeout(300)
@pytest.mark.parametrize("preset", ["tiny-gpt2", "tiny-llama"])
def test_bin_input_streams_the_same_rank_files_as_safetensors(hf_pair: dict[str, tuple[Path, Path]], tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch, preset: str) -> None:
    """A pytorch_model.bin written by transformers previews from its zip offsets like safetensors does, so its
    rank files are streamed (no spool) and come out byte-identical to those of the safetensors input."""
    from mconvert.convert import verbs
    from mconvert.convert.megatron.writer import MegatronWriter

    hf, bin_dir = hf_pair[preset]
    streamed: list[int] = []
    real_open = MegatronWriter._open_stage
    monkeypatch.setattr(MegatronWriter, "_open_stage", lambda self, p: (streamed.append(p), real_open(self, p))[1])
    monkeypatch.setattr(MegatronWriter, "_spool", lambda self, p, t: pytest.fail("the .bin input was spooled"))
    verbs.hf_to_megatron(bin_dir, tmp_path / "from-bin", tp=2, pp=2)
    assert sorted(streamed) == [0, 1]
    verbs.hf_to_megatron(hf, tmp_path / "from-st", tp=2, pp=2)
    assert sha_tree(tmp_path / "from-bin") == sha_tree(tmp_path / "from-st")


@pytest.mark.parametrize("preset", ["tiny-gpt2", "tiny-llama"])
def test_bin_preview_is_what_is_read(hf_pair: dict[str, tuple[Path, Path]], preset: str) -> None:
    """The `.bin` source's preview (names in order, shapes, dtypes) is what read_mcore then returns, and each
    tensor read by offset equals torch.load's."""
    from mconvert.convert.sources import open_source

    _, bin_dir = hf_pair[preset]
    loaded = torch.load(bin_dir / "pytorch_model.bin", weights_only=True)
    src = open_source(bin_dir)
    try:
        assert src.can_preview()
        for unit in src.units():
            want = src.preview(unit)
            got = src.read_mcore(unit)
            assert [(n, tuple(t.shape), t.dtype) for n, t in want.items()] == \
                [(n, tuple(t.shape), t.dtype) for n, t in got.items()], unit
            for k, t in src.read_hf(unit).items():
                assert torch.equal(t, loaded[k]), k
    finally:
        src.close()


def test_legacy_pickle_bin_has_no_preview_and_still_converts(hf_pair: dict[str, tuple[Path, Path]],
                                                             tmp_path: Path) -> None:
    """A `.bin` in torch's legacy (non-zip) format has no offsets to preview from: the writer takes its general
    path and the rank files are still those of the safetensors input."""
    from mconvert.convert import verbs
    from mconvert.convert.sources import open_source

    hf, bin_dir = hf_pair["tiny-llama"]
    legacy = tmp_path / "legacy"
    shutil.copytree(bin_dir, legacy)
    state = torch.load(legacy / "pytorch_model.bin", weights_only=True)
    torch.save(state, legacy / "pytorch_model.bin", _use_new_zipfile_serialization=False)
    src = open_source(legacy)
    try:
        assert not src.can_preview()
    finally:
        src.close()
    verbs.hf_to_megatron(legacy, tmp_path / "a", tp=2, pp=1)
    verbs.hf_to_megatron(hf, tmp_path / "b", tp=2, pp=1)
    assert sha_tree(tmp_path / "a") == sha_tree(tmp_path / "b")


def test_bin_missing_tensor_is_named(hf_pair: dict[str, tuple[Path, Path]], tmp_path: Path) -> None:
    """An index that lists a tensor its .bin file lacks: one MConvertError naming the file and the tensor."""
    import json

    from mconvert.convert.verbs import hf_to_megatron

    _, bin_dir = hf_pair["tiny-llama"]
    d = tmp_path / "bin"
    shutil.copytree(bin_dir, d)
    state = torch.load(d / "pytorch_model.bin", weights_only=True)
    gone = next(k for k in state if k.endswith("input_layernorm.weight"))
    wmap = {k: "pytorch_model.bin" for k in state}
    del state[gone]
    torch.save(state, d / "pytorch_model.bin")
    (d / "pytorch_model.bin.index.json").write_text(json.dumps({"weight_map": wmap}))
    with pytest.raises(MConvertError, match=f"pytorch_model.bin: tensor '{gone}' is missing"):
        hf_to_megatron(d, tmp_path / "out", tp=1, pp=1)
    assert not (tmp_path / "out").exists()



# ---- the input's CRC-32 taken on the bytes the conversion reads (io.crc.ZipRecords) ------------------------
@pytest.fixture(scope="module")
def rank_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A TP=2 PP=2 checkpoint with optimizer states (records megatron-to-hf never reads)."""
    from mconvert.trainer.train import TrainConfig, train

    ck = tmp_path_factory.mktemp("crc") / "ck"
    train(TrainConfig(preset="tiny-llama", tp=2, pp=2, steps=1, save=str(ck), force=True, quiet=True, device="cpu"))
    return ck


def _records(path: Path) -> list[tuple[int, int, int, str]]:
    """(data offset, size, stored CRC-32, name) of every stored entry, from zipfile's own parse."""
    import struct
    import zipfile

    out = []
    raw = path.read_bytes()
    with zipfile.ZipFile(path) as z:
        for i in z.infolist():
            n, m = struct.unpack("<HH", raw[i.header_offset + 26:i.header_offset + 30])
            out.append((i.header_offset + 30 + n + m, i.compress_size, i.CRC, i.filename))
    return out


def test_each_input_byte_is_crc_checked_once(rank_ckpt: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """megatron-to-hf checks the CRC-32 of every record of every rank file, and reads none twice for it: the
    records it converts are checked on the bytes it reads (their CRC equal to zipfile's), the others (optimizer
    states, rng, the pickle) by the background pass."""
    import zlib

    from mconvert.convert.verbs import megatron_to_hf
    from mconvert.io import crc

    second_pass: dict[str, set[int]] = {}
    inline: dict[str, set[int]] = {}
    real_check, real_saw = crc.ZipRecords._check, crc.ZipRecords.saw

    def check(self: Any, starts: list[int]) -> None:
        second_pass.setdefault(str(self.path), set()).update(starts)
        real_check(self, starts)

    def saw(self: Any, pos: int, data: memoryview) -> None:
        before = set(self.done)
        real_saw(self, pos, data)
        inline.setdefault(str(self.path), set()).update(set(self.done) - before)

    monkeypatch.setattr(crc.ZipRecords, "_check", check)
    monkeypatch.setattr(crc.ZipRecords, "saw", saw)
    monkeypatch.setattr(crc, "_CRC_CHECKED", set())
    megatron_to_hf(rank_ckpt, tmp_path / "hf")
    files = sorted(rank_ckpt.rglob("model_optim_rng.pt"))
    assert len(files) == 4
    for f in files:
        key = str(f.resolve())
        stored = {off: (size, crc) for off, size, crc, _ in _records(f) if crc}
        raw = f.read_bytes()
        assert all(zlib.crc32(raw[o:o + n]) == c for o, (n, c) in stored.items())  # the truth we compare with
        got_inline, got_second = inline.get(key, set()), second_pass.get(key, set())
        assert got_inline, f"{f}: no record was checked on the bytes read"
        assert not got_inline & got_second, f"{f}: records read twice for the CRC check"
        assert got_inline | got_second == set(stored), f"{f}: records never checked"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("which", ["converted", "unread"])
def test_flipped_bit_in_any_record_is_refused(rank_ckpt: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                              which: str) -> None:
    """A flipped bit in a tensor megatron-to-hf converts, or in one it never reads (an optimizer state), is
    refused by the CRC-32 check by name, and no output is left."""
    from mconvert.convert.verbs import megatron_to_hf
    from mconvert.io import crc, safeload

    monkeypatch.setattr(crc, "_CRC_CHECKED", set())
    ck = tmp_path / "ck"
    shutil.copytree(rank_ckpt, ck)
    rank = sorted(ck.rglob("model_optim_rng.pt"))[1]
    state = safeload.safe_load(rank)
    model_bytes = {t.untyped_storage().nbytes() for t in state["model"].values() if isinstance(t, torch.Tensor)}
    data = [r for r in _records(rank) if "/data/" in r[3] and r[1] >= 64]
    # the first data record is a model weight (pickled first); the last, a tensor of the optimizer's state
    off, size, _, name = data[0] if which == "converted" else data[-1]
    assert size in model_bytes if which == "converted" else state.get("optimizer")
    raw = bytearray(rank.read_bytes())
    raw[off + size // 2] ^= 0x10
    rank.write_bytes(bytes(raw))
    crc._CRC_CHECKED.clear()  # the load above checked the file as it was
    with pytest.raises(MConvertError, match=f"{name}.*CRC-32"):
        megatron_to_hf(ck, tmp_path / "hf")
    assert not (tmp_path / "hf").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".hf")]


# ---- transposes (io.transpose.copy_transposed: OpenBLAS's somatcopy where numpy bundles it, else torch) ----------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("shape", [(1, 5000), (67, 129), (300, 4096), (4096, 3)])
def test_copy_transposed_is_torch_transpose_bit_for_bit(dtype: torch.dtype, shape: tuple[int, int]) -> None:
    """Into a fresh matrix and into a column band of a wider one, the bits equal torch's `t().contiguous()`,
    denormals, infinities and signed zeros included."""
    from mconvert.io.transpose import copy_transposed, transposed

    g = torch.Generator().manual_seed(shape[0] * 7 + shape[1])
    src = torch.randn(shape, generator=g).to(dtype)
    flat = src.view(-1)
    flat[::97] = 0.0
    flat[1::97] = -0.0
    flat[2::97] = float("inf")
    flat[3::97] = torch.finfo(dtype).tiny / 4  # a denormal
    want = src.t().contiguous()
    bits = torch.int16 if dtype.itemsize == 2 else torch.int32 if dtype.itemsize == 4 else torch.int64
    assert torch.equal(transposed(src).view(bits), want.view(bits))
    wide = torch.zeros((shape[1], shape[0] + 9), dtype=dtype)
    copy_transposed(src, out=wide[:, 4:4 + shape[0]])
    assert torch.equal(wide[:, 4:4 + shape[0]].contiguous().view(bits), want.view(bits))
    assert not wide[:, :4].any() and not wide[:, 4 + shape[0]:].any()  # nothing written outside the band
    band = torch.randn((shape[0], shape[1] + 5), generator=g).to(dtype)[:, 2:2 + shape[1]]  # rows strided
    assert torch.equal(transposed(band), band.t().contiguous())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_copy_transposed_fills_the_callers_buffer_and_refuses_a_wrong_one(dtype: torch.dtype) -> None:
    """`copy_transposed(src, out=buf)` writes torch's `src.t()` into `buf` and returns it; a buffer of another
    shape or dtype is refused, not cast or resized."""
    from mconvert.io.transpose import copy_transposed

    src = torch.randn(70, 90).to(dtype)
    buf = torch.empty(90, 70, dtype=dtype)
    assert copy_transposed(src, out=buf) is buf
    assert torch.equal(buf, src.t().contiguous())
    with pytest.raises(MConvertError, match="transposed copy"):
        copy_transposed(src, out=torch.empty(90, 70, dtype=torch.float64))
    with pytest.raises(MConvertError, match="transposed copy"):
        copy_transposed(src, out=torch.empty(70, 90, dtype=dtype))


@pytest.mark.parametrize("nh,hd", [(4, 8), (12, 64)])
def test_qkv_conv1d_regroup_equals_the_reshape_formula(nh: int, hd: int) -> None:
    """GPT-2's c_attn regrouping done per head block equals the reshape/transpose formula it replaces, both
    ways, on fp32 (the fast path) and bf16 (torch's path)."""
    from mconvert.mappings.transforms import conv1d_to_qkv, qkv_to_conv1d

    h = nh * hd
    for dtype in (torch.float32, torch.bfloat16):
        qkv = torch.randn(3 * h, h).to(dtype)
        want = qkv.reshape(nh, 3, hd, h).transpose(0, 1).reshape(3 * h, h).t().contiguous()
        got = qkv_to_conv1d(qkv, nh, hd)
        assert got.is_contiguous() and torch.equal(got, want)
        back = conv1d_to_qkv(got, nh, hd)
        assert back.is_contiguous() and torch.equal(back, qkv)
        bias = torch.randn(3 * h).to(dtype)
        assert torch.equal(conv1d_to_qkv(qkv_to_conv1d(bias, nh, hd), nh, hd), bias)


# ---- GPT-2's Conv1D shards, read and transposed a block of rows at a time (megatron.merge_transposed_into) ------
@pytest.fixture(scope="module")
def gpt2_tp2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from mconvert.trainer.train import TrainConfig, train

    ck = tmp_path_factory.mktemp("conv1d") / "ck"
    train(TrainConfig(preset="tiny-gpt2", tp=2, pp=1, steps=1, save=str(ck), force=True, quiet=True, device="cpu"))
    return ck


def _conv1d_record(rank: Path, which: str) -> tuple[str, int, int]:
    """(key, data offset, size) of layer 0's `which` weight in a rank file."""
    from mconvert.io import safeload

    state = safeload.safe_load(rank)
    key = next(k for k in state["model"] if k.endswith(f"layers.0.{which}.weight"))
    size = state["model"][key].untyped_storage().nbytes()
    data = [r for r in _records(rank) if "/data/" in r[3] and r[1] == size]
    for off, _, _, _ in data:  # the record holding this tensor's bytes
        raw = rank.read_bytes()[off:off + size]
        if torch.equal(torch.frombuffer(bytearray(raw), dtype=torch.float32).view_as(state["model"][key]),
                       state["model"][key]):
            return key, off, size
    raise AssertionError(f"no record of {key}")


@pytest.mark.timeout(300)
def test_conv1d_shards_transposed_by_blocks_write_the_bytes_of_whole_shards(
        gpt2_tp2: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Blocks of one row, and of a few rows that end inside a QKV head's rows, give the HF files (manifest
    included) that transposing each whole shard gives; the blocks path is the one taken."""
    from mconvert.convert.megatron import source as megatron
    from mconvert.convert.verbs import megatron_to_hf

    offsets: list[int] = []
    real = megatron.LazyModel.read_into

    def read_into(self: Any, key: str, dst: torch.Tensor, start: int = 0) -> bool:
        offsets.append(start)
        return real(self, key, dst, start)

    with monkeypatch.context() as m:
        m.setattr(megatron, "_transposed_in_blocks", lambda *a, **k: False)
        megatron_to_hf(gpt2_tp2, tmp_path / "whole")
    whole = sha_tree(tmp_path / "whole")
    manifest = (tmp_path / "whole" / "mconvert-manifest.json").read_bytes()
    monkeypatch.setattr(megatron.LazyModel, "read_into", read_into)
    for block in (1, 1000, megatron.TRANSPOSE_BLOCK):
        offsets.clear()
        with monkeypatch.context() as m:
            m.setattr(megatron, "TRANSPOSE_BLOCK", block)
            megatron_to_hf(gpt2_tp2, tmp_path / str(block))
        assert sha_tree(tmp_path / str(block)) == whole, block
        assert (tmp_path / str(block) / "mconvert-manifest.json").read_bytes() == manifest
        assert block == megatron.TRANSPOSE_BLOCK or any(offsets), "no shard was read by rows"


@pytest.mark.timeout(300)
def test_a_nan_or_a_flipped_bit_in_a_later_block_is_refused(gpt2_tp2: Path, tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """Read a row at a time, TP rank 1's fc1 weight with a NaN in its last row is refused by file and key, and
    one with a bit flipped in its last row by the CRC-32 of its record; neither leaves an output."""
    from mconvert.convert.megatron import source as megatron
    from mconvert.convert.verbs import megatron_to_hf
    from mconvert.io import crc

    monkeypatch.setattr(megatron, "TRANSPOSE_BLOCK", 1)
    for case in ("nan", "bit"):
        ck = tmp_path / case / "ck"
        shutil.copytree(gpt2_tp2, ck)
        rank = next(ck.rglob("mp_rank_01*/model_optim_rng.pt"))
        if case == "nan":
            state = load_rank(rank)
            key = next(k for k in state["model"] if k.endswith("layers.0.mlp.linear_fc1.weight"))
            state["model"][key][-1, -1] = float("nan")
            save_rank(rank.with_name("new.pt"), state)
            rank.with_name("new.pt").replace(rank)
            want = rf"mp_rank_01.*'{key}' holds NaN or Inf"
        else:
            key, off, size = _conv1d_record(rank, "mlp.linear_fc1")
            raw = bytearray(rank.read_bytes())
            raw[off + size - 3] ^= 0x10
            rank.write_bytes(bytes(raw))
            want = r"mp_rank_01.*fails the CRC-32 check"
        monkeypatch.setattr(crc, "_CRC_CHECKED", set())
        with pytest.raises(MConvertError, match=want):
            megatron_to_hf(ck, tmp_path / case / "hf")
        assert not (tmp_path / case / "hf").exists()
