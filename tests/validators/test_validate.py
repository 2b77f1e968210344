"""`mconvert validate`: every correct export of a trained model, in every format and at several TP/PP, computes
the logits of the checkpoint run natively at its own TP/PP (truth: the trainer's model across processes,
transformers, onnxruntime, the FT reference runner); broken ones fail with a non-zero exit."""

from __future__ import annotations

import json
import pytest
import torch

from mconvert.cli import main
from mconvert.validators.compare import TOLERANCES, compare_logits, judge, perplexity, tolerance_for
from mconvert.validators.formats import detect_format
from mconvert.validators.validate import SCHEMA, validate
from validate_common import broken, ft_export, hf_export, onnx_export, resharded, trained_ckpt, trtllm_export


def _cli(capsys, *args: str) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as e:
        main([*map(str, args)])
        raise SystemExit(0)
    out = capsys.readouterr()
    return e.value.code or 0, out.out, " ".join(out.err.split())  # rich wraps at the terminal width


@pytest.mark.slow
def test_every_llama_format_and_layout_matches_the_native_checkpoint(tmp_path):
    ref = trained_ckpt("llama")  # TP=2 PP=2, run natively across 4 processes
    others = [hf_export("llama"), resharded("llama", 1, 1), resharded("llama", 2, 1), onnx_export("llama"),
              trtllm_export("llama", 2)]
    plot = tmp_path / "err.png"
    rep = validate(ref, others, device="cpu", plot=plot)
    assert [r.format for r in rep.results] == ["hf", "megatron", "megatron", "onnx", "trtllm"]
    assert [(r.layout["tp"], r.layout["pp"]) for r in rep.results[1:3]] == [(1, 1), (2, 1)]
    for r in rep.results:
        assert r.passed, (r.path, r.failures)
        assert r.metrics["max_abs"] <= 1e-5 and r.metrics["top1"] == 1.0
        assert abs(r.perplexity - rep.reference.perplexity) <= 1e-4 * rep.reference.perplexity
    # hidden states per layer are comparable between the native run and transformers
    assert rep.results[0].per_layer_max_abs and len(rep.results[0].per_layer_max_abs) == 3
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert rep.passed


@pytest.mark.slow
def test_every_gpt2_format_and_layout_matches_the_native_checkpoint(capsys):
    ref = trained_ckpt("gpt2")  # TP=2 PP=1
    others = [hf_export("gpt2"), ft_export("gpt2", 1), ft_export("gpt2", 2), onnx_export("gpt2"),
              resharded("gpt2", 1, 2), trtllm_export("gpt2", 2), ft_export("gpt2", 2, "fp16")]
    rc, out, _ = _cli(capsys, "validate", ref, *others, "--device", "cpu", "--json")
    assert rc == 0
    rep = json.loads(out)
    assert rep["schema"] == SCHEMA and rep["passed"] and rep["reference"]["layout"]["tp"] == 2
    assert [r["format"] for r in rep["results"]] == ["hf", "ft", "ft", "onnx", "megatron", "trtllm", "ft"]
    for r in rep["results"][:6]:
        assert r["passed"] and r["metrics"]["max_abs"] <= 1e-5, r
    fp16 = rep["results"][6]  # FT's fp16 weights: judged by the fp16 row, and it needs it
    assert fp16["dtype"] == "float16" and fp16["tolerance"]["dtype"] == "float16" and fp16["passed"], fp16
    assert fp16["metrics"]["max_abs"] > rep["tolerances"]["float32"]["atol"]
    print({k: fp16["metrics"][k] for k in ("max_abs", "mean_abs", "kl", "top1")})


@pytest.mark.slow
def test_broken_export_fails_validate_with_nonzero_exit(capsys):
    good, bad = hf_export("llama"), broken("weight-perturbed-1e-3")
    rc, out, err = _cli(capsys, "validate", good, good, bad, "--device", "cpu")
    assert rc == 1
    assert "FAIL" in err and "PASS" in err and "1 of 2 model(s) differ" in err


def test_bf16_export_passes_with_the_loose_bf16_row_only():
    from mconvert.convert.verbs import megatron_to_hf
    from validate_common import WORK

    out = WORK / "hf-llama-bf16"
    if not out.exists():
        megatron_to_hf(trained_ckpt("llama"), out, dtype="bf16")
    rep = validate(hf_export("llama"), [out], device="cpu")
    r = rep.results[0]
    assert r.dtype == "bfloat16" and r.tolerance["dtype"] == "bfloat16" and r.passed, r.failures
    # the same numbers would fail the fp32 row: the rows are not interchangeable
    assert r.metrics["max_abs"] > TOLERANCES["float32"].max_abs_limit(r.metrics["ref_scale"])


def test_vocab_padding_left_in_is_named(capsys):
    rc, _, err = _cli(capsys, "validate", hf_export("llama"), broken("vocab-padding-left-in"), "--device", "cpu")
    assert rc == 1 and "vocab padding left in" in err


def test_text_file_is_tokenized_by_the_tokenizer_beside_the_model(tmp_path):
    text = tmp_path / "t.txt"
    text.write_text("the model computes what we trained " * 20)
    rep = validate(hf_export("llama"), [hf_export("llama")], device="cpu", n_tokens=16, text_file=text)
    assert rep.tokens["seq_len"] == 16 and rep.tokens["source"].startswith("tokenizer at")
    assert rep.tokens["text"] == str(text) and rep.passed


def test_device_cuda_without_gpu_is_one_clear_line(capsys):
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    rc, _, err = _cli(capsys, "validate", hf_export("llama"), hf_export("llama"), "--device", "cuda")
    assert rc == 1
    assert err.startswith("error: --device cuda") and "no CUDA GPU" in err and "Traceback" not in err


def test_tokens_beyond_max_positions_refused(capsys):
    rc, _, err = _cli(capsys, "validate", hf_export("llama"), hf_export("llama"), "--tokens", "4096")
    assert rc == 1 and "max_position_embeddings" in err


def test_detect_format_of_every_layout():
    assert detect_format(trained_ckpt("gpt2")) == "megatron"
    assert detect_format(hf_export("gpt2")) == "hf"
    assert detect_format(ft_export("gpt2", 2)) == "ft"
    assert detect_format(onnx_export("gpt2")) == "onnx"
    assert detect_format(trtllm_export("gpt2", 2)) == "trtllm"


def test_tolerance_rows_follow_the_less_precise_dtype():
    assert tolerance_for("float32", "float32").dtype == "float32"
    assert tolerance_for("float32", "bfloat16").dtype == "bfloat16"
    assert tolerance_for("float16", "float32").dtype == "float16"
    assert tolerance_for("bfloat16", "float16").dtype == "bfloat16"
    assert TOLERANCES["float32"].atol < TOLERANCES["float16"].atol < TOLERANCES["bfloat16"].atol


def test_metrics_against_closed_forms():
    ref = torch.zeros(1, 3, 4)
    other = ref.clone()
    other[0, 1, 2] = 0.5
    m = compare_logits(ref, other)
    assert m.max_abs == 0.5 and m.mean_abs == pytest.approx(0.5 / 12)
    p = torch.full((4,), 0.25, dtype=torch.float64)
    q = torch.softmax(torch.tensor([0, 0, 0.5, 0], dtype=torch.float64), 0)
    assert m.kl == pytest.approx(float((p * (p / q).log()).sum()) / 3)
    assert m.per_position_max_abs == [0.0, 0.5, 0.0] and m.top1 == pytest.approx(2 / 3)  # position 1 flips
    # uniform logits: perplexity equals the vocabulary size
    assert perplexity(ref, torch.tensor([[0, 1, 2]])) == pytest.approx(4.0)
    assert judge(m, TOLERANCES["float32"]) and not judge(compare_logits(ref, ref), TOLERANCES["float32"])


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_any_source_runs_through_the_transformers_class(family):
    # the path torch_dist checkpoints take: full tensors from the Source loaded into the transformers class
    from mconvert.validators.runners import hf_logits, source_logits

    tokens = torch.randint(0, 1000, (2, 12), generator=torch.Generator().manual_seed(0))
    got = source_logits(trained_ckpt(family), tokens, "cpu")
    want, _, _ = hf_logits(hf_export(family), tokens, "cpu")
    assert (got - want).abs().max() <= 1e-5


def test_torch_dist_checkpoint_is_described_without_a_tp_pp_layout(tmp_path):
    # names only (the torch_dist reader itself is tested by the conversion tests): common.pt args are read
    from mconvert.mappings.families import preset
    from mconvert.validators.formats import describe

    d = tmp_path / "iter_0000007"
    d.mkdir()
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("7")
    torch.save({"args": preset("tiny-llama").to_megatron_args(), "iteration": 7}, d / "common.pt")
    (d / "metadata.json").write_text('{"sharded_backend": "torch_dist"}')
    info = describe(tmp_path)
    assert (info.format, info.vocab_size, info.dtype, info.layout) == ("megatron-torch_dist", 1000, "float32",
                                                                        {"iteration": 7})
