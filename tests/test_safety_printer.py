"""The one error path: whatever a path, key or exception holds, a failure prints exactly one `error:` line
that shows it verbatim but escaped (rich markup brackets kept as text, control characters as visible escapes),
and an unexpected exception (a bug) is one line too, with the traceback only under MCONVERT_DEBUG=1.
"""

from __future__ import annotations

import pytest
import torch
from safety_common import assert_one_line_error, base, copy_of, load_rank, rank_file, run_cli, save_rank

from mconvert.errors import escape_controls

pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize("raw,shown", [
    ("a\nb", "a\\nb"), ("a\rb", "a\\rb"), ("a\tb", "a\\tb"), ("\x1b[31mred", "\\x1b[31mred"), ("\x00", "\\x00"),
    ("\x7f", "\\x7f"), ("\x9b2J", "\\x9b2J"), ("\x85", "\\x85"), ("line\u2028sep", "line\\u2028sep"),
    ("abc\u202edcba", "abc\\u202edcba"), ("[v2] ünïcödé 模型 \\x", "[v2] ünïcödé 模型 \\x"),
])
def test_escape_controls(raw, shown):
    assert escape_controls(raw) == shown


# Names a user (or an attacker handing over a checkpoint) can choose: each must come out as one line, verbatim.
HOSTILE = {
    "markup": "ckpt[v2][/x][bold]",
    "closing tag only": "[/]",
    "newline forging a second error line": "ckpt\nerror: everything is fine",
    "carriage return hiding the path": "ckpt\rerror: fine",
    "ESC clearing the screen": "ckpt\x1b[2J\x1b[Hx",
    "C1 CSI": "ckpt\x9b31m",
    "bidi override": "ckpt\u202etxt.exe",
    "emoji code": "ckpt:smile:",
}


@pytest.mark.parametrize("name", list(HOSTILE))
def test_hostile_path_is_one_escaped_line(name, tmp_path, capsys):
    src = tmp_path / HOSTILE[name]
    src.mkdir(parents=True)  # an empty directory: not a checkpoint ("/" in a name makes a subdirectory)
    code, _, err = run_cli(["megatron-to-hf", src, tmp_path / "out"], capsys)
    line = assert_one_line_error(code, err, "not a checkpoint")
    assert code == 1
    assert escape_controls(str(src)) in line, (line, str(src))
    assert not any(ch in err.rstrip("\n") for ch in "\n\r\x1b\x9b\u202e"), repr(err)
    assert not (tmp_path / "out").exists()


def test_hostile_key_in_a_rank_file_is_escaped(tmp_path, capsys):
    """A key name carrying ESC sequences and a newline: the refusal names it, escaped, on one line."""
    ckpt = copy_of("ckpt", tmp_path / "ckpt")
    evil = "decoder.layers.0.\x1b[2J\x1b[31mEVIL\nerror: forged"
    f = rank_file(ckpt, 0, 0)
    state = load_rank(f)
    state["model"][evil] = torch.zeros(2)
    save_rank(f, state)
    code, _, err = run_cli(["megatron-to-hf", ckpt, tmp_path / "out"], capsys)
    line = assert_one_line_error(code, err, str(f), "EVIL")
    assert "\x1b" not in err and "forged" in line and not (tmp_path / "out").exists()


def test_a_bug_is_one_line_and_the_traceback_is_on_request(tmp_path, capsys, monkeypatch):
    """An exception mconvert does not expect (here: injected into the HF reader) is a bug: one line naming its
    type and message, exit 1, the hint to set MCONVERT_DEBUG=1; with it set the exception propagates."""
    import mconvert.convert.hf.source as hf

    def boom(*a, **k):
        raise ZeroDivisionError("injected [/x] \x1b[31m")

    monkeypatch.setattr(hf.HFSource, "_index", boom)
    monkeypatch.delenv("MCONVERT_DEBUG", raising=False)
    code, _, err = run_cli(["hf-to-megatron", base()["hf"], tmp_path / "out"], capsys)
    assert code == 1 and "Traceback" not in err
    assert err.splitlines() == ["error: internal error (ZeroDivisionError: injected [/x] \\x1b[31m); "
                                "set MCONVERT_DEBUG=1 for the traceback and report it"], err
    monkeypatch.setenv("MCONVERT_DEBUG", "1")
    with pytest.raises(ZeroDivisionError):
        run_cli(["hf-to-megatron", base()["hf"], tmp_path / "out"], capsys)
    assert not (tmp_path / "out").exists()
