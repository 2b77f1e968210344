"""`mconvert train` end to end through the console script: elastic launch, loss lines, --json, --comm-report,
HF tokenizer files in the checkpoint root (loaded by transformers), and one-line user errors."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

from mconvert.layouts.megatron import read_latest
from mconvert.io.safeload import safe_load

pytestmark = pytest.mark.slow
MCONVERT = [sys.executable, "-m", "mconvert.cli"]


def test_train_cli_tp2_pp2_json_and_tokenizer(tmp_path):
    ckpt = tmp_path / "ckpt"
    cmd = MCONVERT + ["train", "--preset", "tiny-llama", "--tp", "2", "--pp", "2", "--dp", "1", "--steps", "3",
                      "--save", str(ckpt), "--seq-length", "32", "--micro-batch-size", "2",
                      "--global-batch-size", "8", "--comm-report", "--json"]
    (tmp_path / "tmp").mkdir()
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env={**os.environ, "TMPDIR": str(tmp_path / "tmp")})
    assert res.returncode == 0, res.stderr[-2000:]
    # the launch leaves nothing in the temporary directory (the elastic agent's logs, the forkserver's socket
    # directory, the ranks' status files); torchinductor_USER is torch's compile cache, kept by torch by design
    assert [p.name for p in (tmp_path / "tmp").iterdir() if not p.name.startswith("torchinductor_")] == []
    out = json.loads(res.stdout)
    assert len(out["losses"]) == 3
    assert "iteration      3/3 | loss" in res.stderr  # loss per step (stderr under --json)
    seen = {(r["collective"], r["group"]) for r in out["comm"]}
    assert {("all-reduce", "TP"), ("send/recv", "PP"), ("broadcast", "TP")} <= seen
    assert read_latest(ckpt) == 3
    assert sorted(p.name for p in (ckpt / "iter_0000003").iterdir()) == [
        "mp_rank_00_000", "mp_rank_00_001", "mp_rank_01_000", "mp_rank_01_001"]

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(ckpt)
    assert len(tok) == 1000 and tok.eos_token == "<|endoftext|>" == tok.bos_token
    assert tok.decode(tok("The cat sat down near Anna.")["input_ids"]) == "The cat sat down near Anna."

    # a second run into the same directory without --resume is a one-line user error
    code, err = _cli_error(cmd[3:])
    assert code == 1 and err.startswith("error:") and "--resume" in err and len(err.splitlines()) == 1

    # --force replaces the checkpoint only when the new run has saved: one killed mid-run leaves it whole
    before = {p: p.read_bytes() for p in ckpt.rglob("*") if p.is_file()}
    long_run = cmd[:cmd.index("--steps") + 1] + ["400"] + cmd[cmd.index("--steps") + 2:-2] + ["--force"]
    proc = subprocess.Popen(long_run, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                            start_new_session=True)
    for line in proc.stdout:  # kill once training is under way
        if "iteration      2/400" in line:
            break
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=60)
    assert {p: p.read_bytes() for p in ckpt.rglob("*") if p.is_file()} == before
    replace = cmd[:cmd.index("--steps") + 1] + ["2"] + cmd[cmd.index("--steps") + 2:-2] + ["--force"]
    res = subprocess.run(replace, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    assert read_latest(ckpt) == 2 and not (ckpt / "iter_0000003").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".ckpt")]  # no temporary sibling left
    assert safe_load(ckpt / "iter_0000002" / "mp_rank_00_000" / "model_optim_rng.pt")["args"].save == str(ckpt)


def _cli_error(argv: list[str]) -> tuple[int, str]:
    """Run the CLI in-process (errors stop before any process is launched); exit code and stderr."""
    import contextlib
    import io

    from mconvert import cli

    buf = io.StringIO()
    cli.console.file = buf
    try:
        with contextlib.redirect_stderr(buf), pytest.raises(SystemExit) as exc:
            cli.main(argv)
    finally:
        cli.console.file = None
    return exc.value.code, buf.getvalue().strip()


def test_train_cli_one_line_errors(tmp_path):
    save = tmp_path / "x"
    code, err = _cli_error(["train", "--preset", "tiny-llama", "--tp", "4", "--steps", "1", "--save", str(save)])
    assert code == 1 and "num_query_groups" in err and "Traceback" not in err
    assert not save.exists()  # refused before anything was written
    code, err = _cli_error(["train", "--steps", "1", "--save", str(save), "--resume"])
    assert code == 1 and "nothing to resume" in err
    code, err = _cli_error(["train", "--global-batch-size", "10", "--micro-batch-size", "4"])
    assert code == 1 and "global-batch-size" in err


def _run_module_main(argv: list[str]) -> None:
    from mconvert.trainer import main

    main.main(argv)


def test_torchrun_module_entry_point(tmp_path):
    """`python -m mconvert.trainer.main` is what torchrun starts on every rank (multi-node form); here the same
    elastic agent starts it twice on one node (TP=1 PP=2): rank 0 writes the tokenizer and the tracker."""
    from mconvert.trainer.main import parse
    from mconvert.trainer.train import launch

    argv = ["--preset", "tiny-gpt2", "--pp", "2", "--steps", "2", "--save", str(tmp_path / "ck"), "--seq-length",
            "32", "--micro-batch-size", "2", "--global-batch-size", "4", "--quiet"]
    cfg = parse(argv)
    assert (cfg.pp, cfg.steps, cfg.seq_length, cfg.quiet, cfg.resume) == (2, 2, 32, True, False)
    launch(_run_module_main, (argv,), 2)
    assert read_latest(tmp_path / "ck") == 2
    assert (tmp_path / "ck" / "tokenizer.json").is_file()
    assert (tmp_path / "ck" / "iter_0000002" / "mp_rank_00_001" / "model_optim_rng.pt").is_file()
