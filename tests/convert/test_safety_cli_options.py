"""Numeric options are checked before any work: a bad size, count or hyper-parameter is one `error:` line that
names the option, a non-zero exit, and no output (or `--save`) directory.

Every case runs the CLI in-process and is refused before a rank process starts or a file is written.
"""

from __future__ import annotations

import pytest
from safety_common import assert_one_line_error, base, run_cli

pytestmark = pytest.mark.timeout(120)

TRAIN_BAD = [
    (["--tp", "0"], "--tp"),
    (["--tp", "-1"], "--tp"),
    (["--pp", "0"], "--pp"),
    (["--dp", "-2"], "--dp"),
    (["--ep", "0"], "--ep"),
    (["--steps", "-1"], "--steps"),
    (["--save-interval", "0"], "--save-interval"),
    (["--seed", "-1"], "--seed"),
    (["--seed", str(2**32)], "--seed"),
    (["--lr", "nan"], "--lr"),
    (["--lr", "inf"], "--lr"),
    (["--lr", "0"], "--lr"),
    (["--lr", "-1e-3"], "--lr"),
    (["--weight-decay", "nan"], "--weight-decay"),
    (["--weight-decay", "inf"], "--weight-decay"),
    (["--weight-decay", "-0.1"], "--weight-decay"),
    (["--preset", "tiny-mixtral", "--moe-aux-loss-coeff", "nan"], "--moe-aux-loss-coeff"),
    (["--preset", "tiny-mixtral", "--moe-aux-loss-coeff", "-1"], "--moe-aux-loss-coeff"),
    (["--micro-batch-size", "0"], "--micro-batch-size"),
    (["--micro-batch-size", "-4"], "--micro-batch-size"),
    (["--global-batch-size", "0"], "--global-batch-size"),
    (["--global-batch-size", "-16"], "--global-batch-size"),
    (["--global-batch-size", "10"], "--global-batch-size"),
    (["--seq-length", "0"], "--seq-length"),
    (["--seq-length", "-1"], "--seq-length"),
    (["--seq-length", "129"], "--seq-length"),  # tiny-llama: max_position_embeddings 128
    (["--preset", "tiny-gpt2", "--seq-length", "1000"], "--seq-length"),
    (["--seq-length", "50000", "--max-position-embeddings", "60000"], "--seq-length"),  # longer than the corpus
    (["--tp", "2", "--sequence-parallel", "--seq-length", "63"], "--seq-length"),
    (["--num-layers", "0"], "--num-layers"),
    (["--hidden-size", "-64"], "--hidden-size"),
    (["--num-attention-heads", "0"], "--num-attention-heads"),
    (["--num-query-groups", "0"], "--num-query-groups"),
    (["--ffn-hidden-size", "0"], "--ffn-hidden-size"),
    (["--max-position-embeddings", "0"], "--max-position-embeddings"),
    (["--kv-channels", "-8"], "--kv-channels"),
    (["--preset", "tiny-mixtral", "--num-experts", "0"], "--num-experts"),
    (["--preset", "tiny-mixtral", "--moe-topk", "0"], "--moe-topk"),
    (["--preset", "tiny-mixtral", "--moe-topk", "-1"], "--moe-topk"),
    (["--preset", "tiny-mixtral", "--moe-ffn-hidden-size", "0"], "--moe-ffn-hidden-size"),
]


@pytest.mark.parametrize("extra,option", TRAIN_BAD, ids=[" ".join(a) for a, _ in TRAIN_BAD])
def test_train_refuses_bad_numbers_up_front(tmp_path, capsys, extra, option):
    save = tmp_path / "nested" / "save"
    code, _, err = run_cli(["train", "--steps", "1", "--save", save, *extra], capsys)
    assert_one_line_error(code, err, option)
    assert not (tmp_path / "nested").exists()  # nothing written, not even the tokenizer files


def test_train_failure_in_a_rank_leaves_no_save_dir(tmp_path, capsys, monkeypatch):
    """A run that fails inside a rank before its first checkpoint removes the --save directory it made."""
    from mconvert.trainer import train as trainer

    def failing_launch(fn, args, nprocs, device=None, log_dir=None):
        cfg = args[0]
        assert (tmp_path / "nested" / "save" / "tokenizer.json").exists()  # the run had started writing
        (tmp_path / "nested" / "save" / "iter_0000001" / "mp_rank_00").mkdir(parents=True)  # a save under way
        raise trainer.MConvertError(f"rank 0 failed: ValueError: boom ({cfg.save})")

    monkeypatch.setattr(trainer, "launch", failing_launch)
    code, _, err = run_cli(["train", "--steps", "1", "--save", tmp_path / "nested" / "save"], capsys)
    assert_one_line_error(code, err, "rank 0 failed")
    assert not (tmp_path / "nested").exists()


def test_train_failure_keeps_what_was_there(tmp_path, capsys, monkeypatch):
    """Into an existing directory, a failing run removes only the files and directories it created."""
    from mconvert.trainer import train as trainer

    save = tmp_path / "save"
    save.mkdir()
    (save / "notes.txt").write_text("mine")

    def failing_launch(fn, args, nprocs, device=None, log_dir=None):
        (save / "iter_0000001").mkdir()
        raise trainer.MConvertError("rank 0 failed: ValueError: boom")

    monkeypatch.setattr(trainer, "launch", failing_launch)
    code, _, err = run_cli(["train", "--steps", "1", "--save", save], capsys)
    assert_one_line_error(code, err, "rank 0 failed")
    assert sorted(p.name for p in save.iterdir()) == ["notes.txt"]


def test_train_failure_after_a_checkpoint_keeps_it(tmp_path, capsys, monkeypatch):
    """A checkpoint the run committed (the tracker names it) stays; a later save that did not finish goes."""
    from mconvert.trainer import train as trainer

    save = tmp_path / "save"

    def failing_launch(fn, args, nprocs, device=None, log_dir=None):
        (save / "iter_0000002" / "mp_rank_00").mkdir(parents=True)
        (save / "latest_checkpointed_iteration.txt").write_text("2")
        (save / "iter_0000004").mkdir()
        raise trainer.MConvertError("rank 0 failed: ValueError: boom")

    monkeypatch.setattr(trainer, "launch", failing_launch)
    code, _, err = run_cli(["train", "--steps", "4", "--save-interval", "2", "--save", save], capsys)
    assert_one_line_error(code, err, "rank 0 failed")
    names = sorted(p.name for p in save.iterdir())
    assert "iter_0000002" in names and "latest_checkpointed_iteration.txt" in names and "tokenizer.json" in names
    assert "iter_0000004" not in names


@pytest.mark.parametrize("verb", ["hf-to-megatron", "reshard"])
@pytest.mark.parametrize("option,value", [("--vpp", "0"), ("--vpp", "-1"), ("--tp", "0"), ("--tp", "-1"),
                                          ("--pp", "0"), ("--pp", "-2"), ("--ep", "0")])
def test_layout_options_below_one(tmp_path, capsys, verb, option, value):
    src = base()["hf" if verb == "hf-to-megatron" else "ckpt"]
    out = tmp_path / "out"
    code, _, err = run_cli([verb, src, out, option, value], capsys)
    assert_one_line_error(code, err, f"{option} must be >= 1")
    assert not out.exists()


@pytest.mark.parametrize("verb,option,value", [
    ("megatron-to-trtllm", "--tp", "0"), ("megatron-to-trtllm", "--tp", "-1"),
    ("megatron-to-ft", "--tp", "0"), ("megatron-to-ft", "--infer-tp", "-1"),
])
def test_deploy_tp_below_one(tmp_path, capsys, verb, option, value):
    out = tmp_path / "out"
    code, _, err = run_cli([verb, base()["ckpt"], out, option, value], capsys)
    assert_one_line_error(code, err, "must be >= 1", option)
    assert not out.exists()


@pytest.mark.parametrize("option,value,words", [
    ("--rtol", "0", "--rtol must be > 0"), ("--rtol", "-1", "--rtol must be > 0"), ("--rtol", "nan", "--rtol must"),
    ("--rtol", "1", "below 1"), ("--rtol", "1e308", "below 1"),
    ("--opset", "0", "--opset must be >= 1"),
])
def test_onnx_tolerance_and_opset_are_checked_before_the_export(tmp_path, capsys, option, value, words):
    out = tmp_path / "out"
    code, _, err = run_cli(["to-onnx", base()["ref"], out, option, value], capsys)
    assert_one_line_error(code, err, words)
    assert not out.exists()


PLAN_BAD = [
    (["--to", "hf", "--tp", "0"], "--tp"),
    (["--to", "hf", "--pp", "-1"], "--pp"),
    (["--to", "hf", "--ep", "0"], "--ep"),
    (["--to", "megatron", "--target-tp", "0"], "--target-tp"),
    (["--to", "megatron", "--target-pp", "-1"], "--target-pp"),
    (["--to", "megatron", "--target-ep", "0"], "--target-ep"),
    (["--to", "ft", "--target-tp", "0"], "--target-tp"),
    (["--to", "trtllm", "--target-tp", "-1"], "--target-tp"),
    (["--to", "hf", "--first-stage-layers", "0"], "--first-stage-layers"),
    (["--to", "hf", "--last-stage-layers", "-1"], "--last-stage-layers"),
    (["--to", "hf", "--nodes", "0"], "--nodes"),
    (["--to", "hf", "--procs-per-node", "0"], "--procs-per-node"),
    (["--to", "hf", "--nodes", "1", "--disk-gb-per-s", "inf"], "--disk-gb-per-s"),
    (["--to", "hf", "--nodes", "1", "--disk-gb-per-s", "0"], "--disk-gb-per-s"),
    (["--to", "hf", "--nodes", "1", "--network-gb-per-s", "nan"], "--network-gb-per-s"),
]


@pytest.mark.parametrize("extra,option", PLAN_BAD, ids=[" ".join(a) for a, _ in PLAN_BAD])
def test_plan_refuses_bad_numbers(capsys, extra, option):
    code, out, err = run_cli(["plan", "--preset", "tiny-llama", *extra], capsys)
    assert_one_line_error(code, err, option)
    assert out == ""


def test_train_refuses_a_device_it_cannot_use(tmp_path, capsys):
    import torch

    save = tmp_path / "save"
    code, _, err = run_cli(["train", "--steps", "1", "--save", save, "--device", "tpu"], capsys)
    assert_one_line_error(code, err, "--device")
    if torch.cuda.device_count() < 2:
        code, _, err = run_cli(["train", "--steps", "1", "--save", save, "--device", "cuda", "--tp", "2"], capsys)
        assert_one_line_error(code, err, "--device cuda")
    assert not save.exists()
