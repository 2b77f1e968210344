"""A tokenizer directory with `auto_map` (code shipped beside the checkpoint) never gets its code run and never
makes transformers ask `[y/N]`: on a terminal that would answer "y" at once, with stdin closed, in every verb
that loads a tokenizer. The shipped code writes a marker file when imported; the marker must never appear.
"""

from __future__ import annotations

import json
import os
import pty
import re
import select
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from safety_common import ROOT, base, make_hf_llama

pytestmark = pytest.mark.timeout(300)

EVIL = '''import pathlib
pathlib.Path({marker!r}).write_text("checkpoint code ran")
from transformers import PreTrainedTokenizerFast


class EvilTokenizer(PreTrainedTokenizerFast):
    pass
'''


def _evil_tokenizer(d: Path, marker: Path, tokenizer_class: str) -> Path:
    """A real tokenizer (ours, saved by transformers) whose tokenizer_config.json points at shipped code."""
    from mconvert.data import build_tokenizer, save_hf_tokenizer

    d.mkdir(parents=True, exist_ok=True)
    save_hf_tokenizer(build_tokenizer(vocab_size=300), d)
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg.update(tokenizer_class=tokenizer_class, auto_map={"AutoTokenizer": [None, "tokenization_evil.EvilTokenizer"]})
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    (d / "tokenization_evil.py").write_text(EVIL.format(marker=str(marker)))
    return d


_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")  # rich colours and cursor moves on a terminal


def _run(argv: list, on_tty: bool, timeout: float = 240) -> tuple[int, str]:
    """`mconvert ARGV` in a fresh process: on a pseudo-terminal that has already typed "y<Enter>", or with
    stdin closed. (exit code, everything it printed)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    env.pop("MCONVERT_DEBUG", None)
    cmd = [sys.executable, "-c", "from mconvert.cli import main; main()", *map(str, argv)]
    if not on_tty:
        r = subprocess.run(cmd, stdin=subprocess.DEVNULL, capture_output=True, text=True, env=env, timeout=timeout)
        return r.returncode, r.stdout + r.stderr
    master, slave = pty.openpty()
    os.write(master, b"y\n")  # a user who would say yes: any prompt is answered at once
    p = subprocess.Popen(cmd, stdin=slave, stdout=slave, stderr=slave, env=env, close_fds=True)
    os.close(slave)
    out, t0 = b"", time.monotonic()
    poller = select.poll()  # not select.select: a long test session may hold descriptors above FD_SETSIZE
    poller.register(master, select.POLLIN)
    while True:
        if poller.poll(1000):
            try:
                chunk = os.read(master, 65536)
            except OSError:  # EIO: the child closed the terminal
                chunk = b""
            if not chunk and p.poll() is not None:
                break
            out += chunk
        elif p.poll() is not None:
            break
        if time.monotonic() - t0 > timeout:
            p.kill()
            raise AssertionError(f"hung: {out.decode(errors='replace')[-2000:]}")
    os.close(master)
    return p.wait(), _ANSI.sub("", out.decode(errors="replace"))


def _cases(tmp: Path, marker: Path, tokenizer_class: str) -> dict[str, list]:
    tok = _evil_tokenizer(tmp / "tok", marker, tokenizer_class)
    plain = make_hf_llama(tmp / "plain", layers=1, vocab=320)  # room for the tokenizer's 300 ids
    hf = tmp / "hf"
    shutil.copytree(plain, hf)
    for f in tok.iterdir():
        shutil.copy(f, hf / f.name)
    return {
        "megatron-to-hf --tokenizer": ["megatron-to-hf", base()["ckpt"], tmp / "out", "--tokenizer", tok],
        "validate": ["validate", hf, plain, "--device", "cpu", "--tokens", "8"],
    }


@pytest.mark.parametrize("on_tty", [True, False], ids=["tty-answering-y", "stdin-closed"])
@pytest.mark.parametrize("verb", ["megatron-to-hf --tokenizer", "validate"])
def test_tokenizer_code_is_refused_by_name(verb, on_tty, tmp_path):
    """tokenizer_class names only the shipped class: refused naming the directory and auto_map."""
    marker = tmp_path / "MARKER"
    argv = _cases(tmp_path, marker, "EvilTokenizer")[verb]
    code, out = _run(argv, on_tty)
    assert not marker.exists(), out
    assert "[y/N]" not in out and "Do you wish to run the custom code" not in out, out
    lines = [ln for ln in out.splitlines() if ln.strip()]
    errors = [ln for ln in lines if ln.startswith("error:")]
    assert code == 1 and len(errors) == 1 and "Traceback" not in out, out
    assert "auto_map" in errors[0] and str(tmp_path / ("tok" if "tokenizer" in verb else "hf")) in errors[0], out
    assert not (tmp_path / "out").exists()


def test_tokenizer_with_a_known_class_loads_without_its_code(tmp_path):
    """tokenizer_class is one transformers has: the tokenizer is used as that class; the shipped code is not run."""
    marker = tmp_path / "MARKER"
    argv = _cases(tmp_path, marker, "PreTrainedTokenizerFast")["validate"]
    code, out = _run(argv, on_tty=True)
    assert not marker.exists(), out
    assert "[y/N]" not in out and "Traceback" not in out, out
    assert code == 0 and "PASS" in out, out
