"""The one format detector (`convert/detect.py`), used by the conversion verbs and the validators: the cases on
which their former rules differed, each refused or named the same way by both."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mconvert.convert.detect import CHECKPOINTS, FORMATS, detect_format
from mconvert.convert.sources import detect_format as source_format
from mconvert.errors import MConvertError
from mconvert.validators.formats import detect_format as validator_format


def _touch(p: Path, text: str = "") -> Path:
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(text)
    return p


def test_a_tracker_root_holding_torch_dist_is_torch_dist_for_both(tmp_path):
    """Megatron-LM writes torch_dist under the same tracker file as torch: the iteration dir decides."""
    _touch(tmp_path / "latest_checkpointed_iteration.txt", "7")
    _touch(tmp_path / "iter_0000007" / "metadata.json", "{}")
    _touch(tmp_path / "iter_0000007" / "common.pt")
    assert source_format(tmp_path) == validator_format(tmp_path) == "megatron-torch_dist"
    assert source_format(tmp_path / "iter_0000007") == "megatron-torch_dist"


def test_a_tracker_root_holding_rank_dirs_is_megatron_torch(tmp_path):
    _touch(tmp_path / "latest_checkpointed_iteration.txt", "release")
    _touch(tmp_path / "release" / "mp_rank_00" / "model_optim_rng.pt")
    assert source_format(tmp_path) == validator_format(tmp_path) == "megatron"


def test_config_json_without_weights_is_refused_by_both_naming_the_weights(tmp_path):
    _touch(tmp_path / "config.json", json.dumps({"architectures": ["LlamaForCausalLM"]}))
    for detect in (source_format, validator_format):
        with pytest.raises(MConvertError, match=r"config.json but no weights \(\*.safetensors, pytorch_model"):
            detect(tmp_path)


def test_an_empty_directory_is_not_a_checkpoint_for_both(tmp_path):
    for detect in (source_format, validator_format):
        with pytest.raises(MConvertError, match="not a checkpoint .no latest_checkpointed_iteration.txt"):
            detect(tmp_path)


@pytest.mark.parametrize("make, fmt, what", [
    (lambda d: _touch(d / "2-gpu" / "config.ini", "[gpt]\n"), "ft", "a FasterTransformer directory"),
    (lambda d: _touch(d / "model.onnx"), "onnx", "an ONNX directory"),
    (lambda d: (_touch(d / "config.json", json.dumps({"architecture": "LlamaForCausalLM"})),
                _touch(d / "rank0.safetensors")), "trtllm", "a TensorRT-LLM checkpoint"),
])
def test_a_deployment_dir_is_named_by_the_validators_and_refused_by_name_by_the_converters(tmp_path, make, fmt, what):
    make(tmp_path)
    assert validator_format(tmp_path) == fmt
    with pytest.raises(MConvertError, match=f"{what} .{fmt}.; this reads a Megatron checkpoint or a HuggingFace directory$"):
        source_format(tmp_path)


def test_a_file_is_refused_and_an_onnx_file_is_onnx_for_the_validators(tmp_path):
    f = _touch(tmp_path / "model.onnx")
    assert detect_format(f, accept=FORMATS) == "onnx"
    with pytest.raises(MConvertError, match="a file, not a model directory"):
        detect_format(f, accept=CHECKPOINTS)
    with pytest.raises(MConvertError, match="no such file or directory"):
        detect_format(tmp_path / "absent")
