"""mconvert's GGUF bytes (`io.gguf_file`) against gguf-py's `GGUFWriter`, llama.cpp's own writer: the same
key-values and tensors give the same file, byte for byte, and q8_0 blocks equal gguf-py's quantizer's."""

from __future__ import annotations

import math
import shutil
import struct
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
import transformers

from mconvert.convert.verbs import to_gguf
from mconvert.errors import MConvertError
from mconvert.io.gguf_file import (ARRAY, BOOL, FLOAT32, FLOAT64, INT8, INT16, INT32, INT64, STRING, UINT8, UINT16,
                                   UINT32, UINT64, GgufFile, KeyValue, TensorInfo, quantize_q8_0,
                                   to_float16, to_float32)


def _gguf_py(path: Path, kvs: list[KeyValue], tensors: list[tuple[TensorInfo, np.ndarray]]) -> None:
    """`path` as gguf-py's GGUFWriter writes these key-values and tensors."""
    w = gguf.GGUFWriter(path, "llama")
    w.kv_data[0].clear()  # the architecture key comes from `kvs`, in their order
    for kv in kvs:
        w.add_key_value(kv.key, kv.value, gguf.GGUFValueType(kv.type),
                        None if kv.sub_type is None else gguf.GGUFValueType(kv.sub_type))
    for t, data in tensors:
        w.add_tensor_info(t.name, t.shape, np.dtype(np.float32), data.nbytes, raw_dtype=gguf.GGMLQuantizationType(t.type))
    w.write_header_to_file(path)
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for _, data in tensors:
        w.write_tensor_data(data)
    w.close()


def _ours(path: Path, kvs: list[KeyValue], tensors: list[tuple[TensorInfo, np.ndarray]]) -> None:
    f = GgufFile(path, kvs, [t for t, _ in tensors])
    for _, data in tensors:
        f.write(data)
    f.close()


def test_every_value_type_and_tensor_type_is_written_as_gguf_py_writes_it(tmp_path):
    rng = np.random.default_rng(0)
    kvs = [KeyValue("general.architecture", "llama", STRING), KeyValue("u8", 7, UINT8), KeyValue("i8", -7, INT8),
           KeyValue("u16", 65535, UINT16), KeyValue("i16", -3, INT16), KeyValue("u32", 1 << 31, UINT32),
           KeyValue("i32", -(1 << 31), INT32), KeyValue("f32", 0.1, FLOAT32), KeyValue("b", True, BOOL),
           KeyValue("u64", 1 << 63, UINT64), KeyValue("i64", -(1 << 62), INT64), KeyValue("f64", 0.1, FLOAT64),
           KeyValue("s", "h\u00e9llo \u2581 \U0001f600", STRING), KeyValue("empty-ish", " ", STRING),
           KeyValue("strs", ["a", "", "\u2581b", "<0x0A>"], ARRAY, STRING),
           KeyValue("ints", [1, -2, 3], ARRAY), KeyValue("floats", [0.5, -1e-30, 3.25], ARRAY, FLOAT32),
           KeyValue("types", [1, 2, 3, 6], ARRAY, INT32), KeyValue("bools", [True, False], ARRAY),
           KeyValue("bytes", b"\x00\xff", ARRAY), KeyValue("nested", [[1, 2], [3]], ARRAY)]
    f32 = rng.standard_normal((3, 5)).astype(np.float32)  # 60 bytes: padded to 64
    f16 = rng.standard_normal((7,)).astype(np.float16)  # 14 bytes
    q8 = quantize_q8_0(rng.standard_normal((2, 64)).astype(np.float32))
    bf16 = gguf.quants.quantize(rng.standard_normal((2, 3)).astype(np.float32), gguf.GGMLQuantizationType.BF16)
    tensors = [(TensorInfo("a.weight", (3, 5), 0), f32), (TensorInfo("b", (7,), 1), f16),
               (TensorInfo("c", (2, 64), 8), q8), (TensorInfo("d", (2, 3), 30), bf16)]
    _gguf_py(tmp_path / "theirs.gguf", kvs, tensors)
    _ours(tmp_path / "ours.gguf", kvs, tensors)
    assert (tmp_path / "ours.gguf").read_bytes() == (tmp_path / "theirs.gguf").read_bytes()
    # no tensors: the header alone, as gguf-py writes it
    _gguf_py(tmp_path / "theirs0.gguf", kvs[:3], [])
    _ours(tmp_path / "ours0.gguf", kvs[:3], [])
    assert (tmp_path / "ours0.gguf").read_bytes() == (tmp_path / "theirs0.gguf").read_bytes()


@pytest.mark.parametrize("direct", [False, True])
def test_a_positional_file_written_in_any_order_and_in_slices_is_gguf_pys(tmp_path, monkeypatch, direct):
    """A positional GgufFile (an MoE layer's stacked experts, one expert's slice at a time): the tensors written
    last first, each stacked one a slice per expert with the slices of its three stacks interleaved as experts
    come, give gguf-py's file byte for byte, and the manifest digest recorded is blake3's of it (buffered, and
    O_DIRECT where the file system takes it)."""
    import blake3

    from mconvert.io import gguf_file
    from mconvert.io.atomic import digests_under

    if direct:
        monkeypatch.setattr(gguf_file, "DIRECT_MIN_BYTES", 0)
    rng = np.random.default_rng(1)
    kvs = [KeyValue("general.architecture", "llama", STRING)]
    experts = 5
    stacks = [quantize_q8_0(rng.standard_normal((experts, 3, 64)).astype(np.float32)) for _ in range(2)]
    stacks.append(rng.standard_normal((experts, 7, 3)).astype(np.float32))  # 84 bytes per expert: unaligned
    tensors = [(TensorInfo("norm", (7,), 0), rng.standard_normal((7,)).astype(np.float32)),
               (TensorInfo("gate_exps", (experts, 3, 64), 8), stacks[0]),
               (TensorInfo("up_exps", (experts, 3, 64), 8), stacks[1]),
               (TensorInfo("down_exps", (experts, 7, 3), 0), stacks[2]),
               (TensorInfo("shexp", (4, 9), 1), rng.standard_normal((4, 9)).astype(np.float16))]
    _gguf_py(tmp_path / "theirs.gguf", kvs, tensors)
    f = GgufFile(tmp_path / "ours.gguf", kvs, [t for t, _ in tensors], positional=True)
    f.write_at(4, tensors[4][1])
    f.write_at(0, tensors[0][1])
    for e in range(experts):
        for i in (1, 2, 3):
            per = tensors[i][0].nbytes // experts
            f.write_at(i, tensors[i][1][e], e * per)
    digest = f.close()
    data = (tmp_path / "ours.gguf").read_bytes()
    assert data == (tmp_path / "theirs.gguf").read_bytes()
    assert digest == blake3.blake3(data).hexdigest()
    assert digests_under(tmp_path)[str((tmp_path / "ours.gguf").resolve())][3] == digest  # what the manifest takes


@pytest.mark.parametrize("value", [[1, "a"], [1, 2.0], [True, 1], []])
def test_an_array_gguf_py_refuses_is_refused(tmp_path, value):
    kvs = [KeyValue("general.architecture", "llama", STRING), KeyValue("bad", value, ARRAY)]
    with pytest.raises(ValueError):
        _gguf_py(tmp_path / "theirs.gguf", kvs, [])
    with pytest.raises(MConvertError, match="array"):
        _ours(tmp_path / "ours.gguf", kvs, [])


def test_q8_0_blocks_equal_gguf_pys_quantizer_bit_for_bit():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(300, 256, generator=g) * torch.logspace(-6, 4, 300).unsqueeze(1)
    x[0] = 0  # a zero block: scale 0, values 0
    x[1, :32] = torch.arange(32) / 2 - 8  # exact halves: rounded away from zero
    x[2, :32] = 6.5e4  # a scale near float16's top
    x[3, :32] = 1e-9  # a scale below float16's normals
    x[4, :32] = 127
    x[4, 1] = float(np.nextafter(np.float32(0.5), np.float32(0)))  # just below a half: rounded down
    x[4, 2] = -0.0
    want = gguf.quants.quantize(x.numpy(), gguf.GGMLQuantizationType.Q8_0)
    for rows in (7, 4096):  # one chunk and several, with a short last one
        have = quantize_q8_0(x.numpy(), rows=rows)
        assert have.shape == want.shape and np.array_equal(have, want)
    # every half-integer up to 127.5 in units of the scale, and its float32 neighbours: the rounding's edges
    rng = np.random.default_rng(3)
    grid = (rng.integers(-255, 256, (2048, 32)) / 2).astype(np.float32)
    grid[:, 0] = 127
    for g in (grid, np.nextafter(grid, np.float32(0)), np.nextafter(grid, np.float32(300))):
        assert np.array_equal(quantize_q8_0(g), gguf.quants.quantize(g, gguf.GGMLQuantizationType.Q8_0))
    # float16 and bfloat16 (its raw bits) sources: gguf-py quantizes their float32 values
    for src in (x.half(), x.bfloat16()):
        want = gguf.quants.quantize(src.float().numpy(), gguf.GGMLQuantizationType.Q8_0)
        arr = src.numpy() if src.dtype == torch.float16 else src.view(torch.int16).numpy().view(np.uint16)
        assert np.array_equal(quantize_q8_0(arr, rows=7), want)


def _f32(x: float) -> float:
    return struct.unpack("<f", struct.pack("<f", x))[0]


def _ggml_q8_0_block(values: list[float]) -> bytes:
    """One block as ggml's `quantize_row_q8_0_ref` computes it, in scalar Python: float32 steps emulated by
    rounding each exact double result to float32 (a float32 quotient or product is exact in a double first),
    C's roundf as floor(|v| + 1/2) with v's sign (exact in a double for |v| <= 127), the scale packed as
    IEEE half by struct (round to nearest even)."""
    amax = max(abs(v) for v in values)
    d = _f32(amax / 127)
    inv = _f32(1 / d) if d else 0.0
    qs = [int(math.copysign(math.floor(abs(_f32(v * inv)) + 0.5), v)) for v in values]
    return struct.pack("<e", d) + struct.pack("<32b", *qs)


def _crafted_blocks(rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Blocks that reach each rule's edges, by source type: every finite float16 (subnormals, +-0, +-65504) in
    order and shuffled; exact halves of the scale and their float32 neighbours at many scales; a block's
    largest magnitude negative, or both signs of it; zero and -0 blocks; bfloat16 and float32 patterns across
    their exponent range, subnormals among them."""
    halves = np.arange(1 << 16, dtype=np.uint16).view(np.float16)
    halves = halves[np.isfinite(halves)]
    halves = halves[:halves.size // 32 * 32]
    f16 = [halves.reshape(-1, 32), rng.permutation(halves).reshape(-1, 32)]
    ties = []
    for e in range(-14, 5):  # scales 2^e: amax 127 * 2^e, every half unit of the scale
        grid = (rng.integers(-254, 255, (64, 32)) / 2 * 2.0 ** e).astype(np.float32)
        for near in (grid, np.nextafter(grid, np.float32(0)), np.nextafter(grid, np.float32(1e9))):
            near[:, 0] = 127 * 2.0 ** e  # the scale 2^e exactly, its 1/scale too
            near[::2, 0] *= -1
            ties.append(near)
    ties = np.concatenate(ties)
    special = np.zeros((4, 32), dtype=np.float32)
    special[1] = -0.0
    special[2, :] = rng.standard_normal(32)
    special[2, 5], special[2, 9] = -7.25, 7.25
    special[3, :] = rng.standard_normal(32)
    special[3, 17] = -9.5
    bf_bits = rng.integers(0, 1 << 15, 64 * 32, dtype=np.uint16)
    bf_bits = (bf_bits % (148 << 7)) | (rng.integers(0, 2, bf_bits.size, dtype=np.uint16) << 15)  # |x| < 2^21
    f32_bits = rng.integers(0, 1 << 31, 64 * 32, dtype=np.uint32) % np.uint32(147 << 23)  # |x| < 2^20
    f32_bits |= rng.integers(0, 2, f32_bits.size, dtype=np.uint32) << np.uint32(31)
    f32 = np.concatenate([ties, special, f32_bits.view(np.float32).reshape(-1, 32)])
    f32[-3:, 0] = 1.0  # blocks of subnormals beside a normal largest value
    f32[-3:, 1:] = np.float32(1e-40)
    return {"float16": np.concatenate([*f16, ties.astype(np.float16)]),
            "bfloat16": np.concatenate([bf_bits.reshape(-1, 32), (ties.view(np.uint32) >> 16).astype(np.uint16)]),
            "float32": f32}


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_q8_0_equals_ggmls_scalar_rules_and_gguf_py_on_crafted_blocks(dtype):
    """The block maxima taken on the magnitudes' bits, the float32 rounding and the signs put back on the int8
    values, against a scalar reading of ggml's reference quantizer and against gguf-py's, block by block."""
    x = _crafted_blocks(np.random.default_rng(4))[dtype]
    values = (x.astype(np.uint32) << 16).view(np.float32) if dtype == "bfloat16" else x.astype(np.float32)
    want = b"".join(_ggml_q8_0_block([float(v) for v in row]) for row in values)
    assert np.array_equal(gguf.quants.quantize(values, gguf.GGMLQuantizationType.Q8_0).reshape(-1),
                          np.frombuffer(want, dtype=np.uint8))
    for rows in (None, 5):  # one slice; several with a short last one
        assert quantize_q8_0(x, rows=rows).tobytes() == want
    wide = np.ascontiguousarray(x.reshape(-1, 128).T)  # rows of 32 blocks' worth, read through a transposed view
    assert np.array_equal(quantize_q8_0(wide.T, rows=3), quantize_q8_0(x.reshape(-1, 128)))


@pytest.mark.parametrize("bad", [np.inf, -np.inf, np.nan])
@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_q8_0_refuses_nan_and_inf_by_name(bad, dtype):
    x = np.ones((3, 64), dtype=dtype)
    x[2, 40] = bad
    with pytest.raises(MConvertError, match=r"^w: holds NaN or Inf values"):
        quantize_q8_0(x, name="w", rows=1)


def test_bf16_and_f16_casts_equal_torchs_and_refuse_overflow():
    """float16 widened to float32 exactly as numpy's astype, bfloat16 bits as torch widens them; float32 to
    float16 rounded as numpy's astype (gguf-py's cast); a value float16 cannot hold refused by name."""
    g = torch.Generator().manual_seed(2)
    x = torch.randn(64, 96, generator=g) * torch.logspace(-8, 4, 64).unsqueeze(1)
    halves = np.arange(1 << 16, dtype=np.uint16).view(np.float16)
    halves = halves[np.isfinite(halves)]  # every finite float16, subnormals and -0 among them
    assert np.array_equal(to_float32(halves).view(np.uint32), halves.astype(np.float32).view(np.uint32))
    bf = x.bfloat16()
    bits = bf.view(torch.int16).numpy().view(np.uint16)
    assert np.array_equal(to_float32(bits), bf.float().numpy())
    assert np.array_equal(to_float16(bits, "w", "fix"), bf.float().numpy().astype(np.float16))
    assert np.array_equal(to_float16(x.numpy(), "w", "fix"), x.numpy().astype(np.float16))
    assert np.array_equal(to_float16(x.numpy(), "w", "fix").view(np.uint16), x.half().numpy().view(np.uint16))
    ok = np.array([65519.9], dtype=np.float32)  # rounds down to float16's largest value
    assert to_float16(ok, "w", "fix")[0] == 65504
    with pytest.raises(MConvertError, match=r"^w: holds values up to 65520, beyond what float16 holds"):
        to_float16(np.array([-1.0, 65520.0], dtype=np.float32), "w", "fix")
    with pytest.raises(MConvertError, match=r"^w: holds values up to .*q8_0's float16 block scales"):
        quantize_q8_0(np.full((1, 32), 1e8, dtype=np.float32), name="w")


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory) -> Path:
    """A tiny random transformers Llama with the trainer's byte-level BPE tokenizer beside it."""
    from mconvert.data import build_tokenizer, save_hf_tokenizer

    d = tmp_path_factory.mktemp("gguf-file") / "hf-llama"
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=1000, max_position_embeddings=64,
                                   tie_word_embeddings=False)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(d, safe_serialization=True)
    tok = d.parent / "tok"
    save_hf_tokenizer(build_tokenizer(), tok)
    for f in tok.iterdir():
        shutil.copy(f, d / f.name)
    return d


@pytest.mark.parametrize("outtype", ["f32", "f16", "q8_0"])
def test_hf_to_gguf_file_equals_gguf_pys_writer_given_its_key_values_and_tensors(llama_dir, tmp_path, outtype):
    """The whole file of a real conversion, read back by gguf-py's reader and written again by its writer."""
    out = tmp_path / "ours.gguf"
    to_gguf(llama_dir, out, outtype=outtype, verb="hf-to-gguf")
    r = gguf.GGUFReader(out)
    kvs = []
    for f in r.fields.values():
        if f.name.startswith("GGUF."):
            continue
        vtype = f.types[0]
        sub = f.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        kvs.append(KeyValue(f.name, f.contents(), int(vtype), None if sub is None else int(sub)))
    tensors = [(TensorInfo(t.name, tuple(int(d) for d in reversed(t.shape)), int(t.tensor_type)),
                np.array(t.data)) for t in r.tensors]
    assert {int(t.tensor_type) for t in r.tensors} >= ({8} if outtype == "q8_0" else {0, 1} if outtype == "f16" else {0})
    _gguf_py(tmp_path / "theirs.gguf", kvs, tensors)
    assert out.read_bytes() == (tmp_path / "theirs.gguf").read_bytes()


def test_float64_is_narrowed_to_float32_and_refused_past_its_range():
    x = np.array([[1e-3, -2.5], [3.0, 1e30]])
    assert np.array_equal(to_float32(x), x.astype(np.float32))
    with pytest.raises(MConvertError, match=r"^w: holds values up to 1e\+300, beyond what float32 holds"):
        to_float32(np.array([1.0, -1e300]), "w")
