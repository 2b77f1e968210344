"""The one dtype table and the one safetensors header codec, checked against torch, numpy and safetensors' own
library (truth mconvert did not write)."""

from __future__ import annotations

import numpy as np
import pytest
import safetensors.torch as st_torch
import torch
from safetensors.torch import load_file, save_file

from mconvert import dtypes
from mconvert.io.safetensors import SafetensorsRandomWriter, SafetensorsReader, SafetensorsStream
from mconvert.errors import MConvertError


@pytest.mark.parametrize("row", dtypes.TABLE, ids=lambda r: r.name)
def test_dtype_row_agrees_with_torch_numpy_and_safetensors(row):
    assert st_torch._TYPES[row.safetensors] is row.torch  # safetensors' own code -> torch dtype
    assert torch.empty((), dtype=row.torch).element_size() == row.itemsize
    assert row.torch.is_floating_point == row.floating
    if row.numpy is not None:
        assert np.dtype(row.numpy).itemsize == row.itemsize
        assert torch.from_numpy(np.zeros(2, dtype=row.np)).dtype is row.torch
    for name in (row.name, *row.aliases, f"torch.{row.name}"):
        assert dtypes.lookup(name) is row
    assert dtypes.of_torch(row.torch) is row and dtypes.of_safetensors(row.safetensors) is row


@pytest.mark.parametrize("row", dtypes.TABLE, ids=lambda r: r.name)
def test_dtype_row_agrees_with_onnx_and_onnxruntime(row):
    """The ONNX element type of each row is onnx's own, for the same numpy type; onnxruntime's spelling of an
    input of that type (read from a one-node graph) finds the same row."""
    import onnx
    import onnxruntime as ort
    from onnx import TensorProto, helper

    code = TensorProto.DataType.Value(row.onnx)
    if row.numpy is not None:
        assert helper.tensor_dtype_to_np_dtype(code) == row.np
    assert dtypes.of_onnx(row.onnx) is row
    graph = helper.make_graph([helper.make_node("Identity", ["x"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", code, [1])],
                              [helper.make_tensor_value_info("y", code, [1])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    assert dtypes.of_onnx(sess.get_inputs()[0].type) is row
    assert onnx.checker.check_model(model) is None


def test_dtype_choices_refuse_what_a_verb_does_not_write_by_name():
    assert dtypes.choose("bf16") == "bfloat16" and dtypes.choose("AUTO") == "auto"
    assert dtypes.choose("fp16", ("float32", "float16"), auto=False) == "float16"
    assert dtypes.choices() == ["auto", "fp32", "bf16", "fp16"]
    with pytest.raises(MConvertError, match=r"^--dtype 'bf16': choose fp32 or fp16 \(FT\)$"):
        dtypes.choose("bf16", ("float32", "float16"), auto=False, why="FT")
    with pytest.raises(MConvertError, match=r"^--dtype 'torch.float32': choose auto, fp32, bf16 or fp16$"):
        dtypes.choose("torch.float32")


def test_unknown_dtypes_have_no_row():
    assert dtypes.lookup("fp8") is None and dtypes.of_safetensors("F8_E5M2") is None
    assert dtypes.of_safetensors("F8_E4M3") in dtypes.STORED_ONLY  # block-scaled FP8 weights, read with scales
    assert dtypes.of_torch(torch.complex64) is None and dtypes.canonical("fp8") == "fp8"


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    out = {}
    for i, row in enumerate(dtypes.TABLE):
        x = torch.randn(3, 5, generator=g) * 50
        out[f"t{i}.{row.name}"] = x > 0 if row.torch is torch.bool else x.to(row.torch)
    out["scalar"] = torch.tensor(1.5)
    out["empty"] = torch.zeros(0, 4)
    return out


def test_stream_writes_what_safetensors_loads(tmp_path):
    ts = _tensors()
    w = SafetensorsStream(tmp_path / "a.safetensors", [(k, v.dtype, tuple(v.shape)) for k, v in ts.items()],
                          {"format": "pt"})
    for k, v in ts.items():
        w.add(k, v)
    w.close()
    got = load_file(tmp_path / "a.safetensors")
    assert set(got) == set(ts) and all(got[k].dtype is v.dtype and torch.equal(got[k], v) for k, v in ts.items())


def test_random_writer_in_any_order_is_what_safetensors_loads(tmp_path):
    ts = _tensors()
    entries = [(k, ts[k].dtype, tuple(ts[k].shape)) for k in sorted(ts)]
    w = SafetensorsRandomWriter(tmp_path / "r.safetensors", entries, {"format": "pt"})
    for k in reversed(sorted(ts)):
        w.write(k, ts[k])
    w.close()
    got = load_file(tmp_path / "r.safetensors")
    assert all(torch.equal(got[k], v) for k, v in ts.items())


def test_random_writer_refuses_a_file_with_a_tensor_missing(tmp_path):
    w = SafetensorsRandomWriter(tmp_path / "m.safetensors", [("a", torch.float32, (2,)), ("b", torch.float32, (2,))])
    w.write("a", torch.ones(2))
    with pytest.raises(MConvertError, match=r"tensors never written: \['b'\]"):
        w.close()


def test_reader_reads_what_safetensors_writes(tmp_path):
    ts = _tensors()
    save_file(ts, tmp_path / "s.safetensors", metadata={"format": "pt"})
    r = SafetensorsReader(tmp_path / "s.safetensors")
    try:
        assert set(r.keys()) == set(ts) and r.metadata == {"format": "pt"}
        assert all(r.get(k).dtype is v.dtype and torch.equal(r.get(k), v) for k, v in ts.items())
    finally:
        r.close()


@pytest.mark.timeout(60)
def test_reader_refuses_a_truncated_file_by_name(tmp_path):
    save_file({"w": torch.ones(64, 64)}, tmp_path / "t.safetensors")
    raw = (tmp_path / "t.safetensors").read_bytes()
    (tmp_path / "t.safetensors").write_bytes(raw[:-100])
    with pytest.raises(MConvertError, match=r"t\.safetensors: unreadable safetensors file \(data section holds"):
        SafetensorsReader(tmp_path / "t.safetensors")
