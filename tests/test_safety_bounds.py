"""Sizes in config.json / the Megatron args are checked against the tensors present before anything is allocated.

Truth we did not write: the weights are saved by transformers (and converted to Megatron by hf-to-megatron);
only the size fields are edited, as a broken or hostile config would. Each case ends in one line naming the
field, its value and what the tensors hold, fast (no per-layer loop over the claimed layer count) and with
nothing written.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from safety_common import assert_one_line_error, copy_of, load_rank, rank_file, run_cli, save_rank

from mconvert.convert.bounds import check_memory
from mconvert.errors import MConvertError


def _hf_with(tmp: Path, **changes) -> Path:
    hf = copy_of("hf", tmp / "hf")
    cfg = json.loads((hf / "config.json").read_text())
    cfg.update(changes)
    (hf / "config.json").write_text(json.dumps(cfg))
    return hf


# the base model: 2 layers, hidden 64, 4 heads of 16, 2 KV heads, ffn 128, vocab 100 (safety_common.make_hf_llama)
HF_CASES = {
    "a billion layers": ({"num_hidden_layers": 10**9}, ["num_hidden_layers=1000000000", "2 layers"]),
    "fewer layers than the weights": ({"num_hidden_layers": 1}, ["num_hidden_layers=1", "2 layers"]),
    "vocab one short of the embedding": ({"vocab_size": 99}, ["vocab_size=99", "[100, 64]"]),
    "vocab one beyond the embedding": ({"vocab_size": 101}, ["vocab_size=101", "[100, 64]"]),
    "hidden 2^40": ({"hidden_size": 2**40}, ["hidden_size=1099511627776", "[100, 64]"]),
    "heads": ({"num_attention_heads": 8}, ["num_attention_heads=8", "[64, 64]"]),
    "kv heads": ({"num_key_value_heads": 4}, ["num_key_value_heads=4", "k_proj", "[32, 64]"]),
    "ffn": ({"intermediate_size": 256}, ["intermediate_size=256", "the config implies"]),
}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("case", sorted(HF_CASES))
def test_hf_sizes_that_contradict_the_tensors_are_refused(case: str, tmp_path: Path, capsys) -> None:
    changes, expect = HF_CASES[case]
    hf = _hf_with(tmp_path, **changes)
    code, _, err = run_cli(["hf-to-megatron", hf, tmp_path / "mg", "--tp", "2"], capsys)
    assert_one_line_error(code, err, str(hf / "config.json"), *expect)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("verb", ["hf-to-megatron"])
def test_dry_run_on_a_billion_layers_answers_in_under_a_second(verb: str, tmp_path: Path, capsys) -> None:
    hf = _hf_with(tmp_path, num_hidden_layers=10**9)
    run_cli([verb, hf, tmp_path / "warm", "--dry-run"], capsys)  # imports of the verb's modules
    t0 = time.perf_counter()
    code, _, err = run_cli([verb, hf, tmp_path / "out", "--dry-run"], capsys)
    elapsed = time.perf_counter() - t0
    assert_one_line_error(code, err, "num_hidden_layers=1000000000")
    assert elapsed < 1.0, f"{elapsed:.2f} s"


def _megatron_with(tmp: Path, **changes) -> Path:
    ckpt = copy_of("ckpt", tmp / "mg")
    for t in range(2):
        for p in range(2):
            f = rank_file(ckpt, t, p)
            state = load_rank(f)
            for k, v in changes.items():
                setattr(state["args"], k, v)
            save_rank(f, state)
    return ckpt


MEGATRON_CASES = {
    "a billion layers": ({"num_layers": 10**9}, ["num_layers=1000000000", "2 layers"]),
    "hidden 2^40": ({"hidden_size": 2**40}, ["hidden_size=1099511627776"]),
    "ffn": ({"ffn_hidden_size": 256}, ["ffn_hidden_size=256", "linear_fc1"]),
    "query groups": ({"num_query_groups": 4}, ["num_query_groups=4", "linear_qkv"]),
}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("case", sorted(MEGATRON_CASES))
def test_megatron_sizes_that_contradict_the_tensors_are_refused(case: str, tmp_path: Path, capsys) -> None:
    changes, expect = MEGATRON_CASES[case]
    ckpt = _megatron_with(tmp_path, **changes)
    t0 = time.perf_counter()
    code, _, err = run_cli(["megatron-to-hf", ckpt, tmp_path / "out", "--dry-run"], capsys)
    assert_one_line_error(code, err, "mp_rank_00_000/model_optim_rng.pt", *expect)
    assert time.perf_counter() - t0 < 5.0
    code, _, err = run_cli(["megatron-to-hf", ckpt, tmp_path / "out"], capsys)
    assert_one_line_error(code, err, *expect)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mg"]


def test_a_unit_larger_than_the_memory_available_is_refused_before_reading() -> None:
    with pytest.raises(MConvertError, match=r"x/config.json: converting the embedding needs about 3.0 GiB .* "
                                            r"but 2.0 GiB is available"):
        check_memory({"embedding": 2**30, 0: 2**20}, "x/config.json", available=2 * 2**30)
    check_memory({"embedding": 2**30}, "x/config.json", available=4 * 2**30)
