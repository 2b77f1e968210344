"""Write failures keep their cause in every writer: a disk that fills up mid-file (a real 64 KiB tmpfs when
the tests run as root, else ENOSPC raised by the write calls themselves) and a permission refused on a file
inside OUT. Each ends in one `error:` line naming OUT, the OS's reason and what to do; nothing is left behind.
"""

from __future__ import annotations

import builtins
import errno
import os
from functools import lru_cache
from pathlib import Path

import pytest
from safety_common import _WORK, assert_one_line_error, base, make_hf_llama, mount_tmpfs, run_cli, umount

pytestmark = pytest.mark.timeout(180)


@lru_cache(maxsize=None)
def _mha_hf() -> Path:
    """FasterTransformer's LLaMA layout has no GQA: an MHA model for megatron-to-ft."""
    return make_hf_llama(_WORK / "write-errors-mha", groups=4)


def _argv(verb: str, out: Path) -> list:
    b = base()
    return {
        "megatron-to-hf": ["megatron-to-hf", b["ckpt"], out],
        "hf-to-megatron": ["hf-to-megatron", b["hf"], out, "--tp", "2"],
        "reshard": ["reshard", b["ckpt"], out, "--tp", "1", "--pp", "1"],
        "megatron-to-trtllm": ["megatron-to-trtllm", b["ckpt"], out, "--tp", "2"],
        "megatron-to-ft": ["megatron-to-ft", _mha_hf(), out, "--infer-tp", "2"],
    }[verb]


VERBS = ("megatron-to-hf", "hf-to-megatron", "reshard", "megatron-to-trtllm", "megatron-to-ft")


def _failing_open(monkeypatch, under: Path, code: int, after_bytes: int = 0) -> None:
    """Files opened for writing below `under` fail with `code`: at open (after_bytes=0) or once more than
    `after_bytes` bytes went through one file object (a disk filling up mid-file)."""
    real_open, real_os_open = builtins.open, os.open
    prefix = str(under.parent / f".{under.name}")

    def inside(path) -> bool:
        return isinstance(path, (str, Path)) and str(path).startswith((str(under) + os.sep, prefix))

    class Filling:
        def __init__(self, f):
            self._f, self._n = f, 0

        def write(self, b):
            self._n += len(b)
            if self._n > after_bytes:
                raise OSError(code, os.strerror(code))
            return self._f.write(b)

        def __getattr__(self, k):
            return getattr(self._f, k)

        def __enter__(self):
            return self

        def __exit__(self, *a):
            self._f.close()

    def fake_open(path, mode="r", *a, **k):
        if inside(path) and any(c in mode for c in "wax+"):
            if not after_bytes:
                raise OSError(code, os.strerror(code), str(path))
            return Filling(real_open(path, mode, *a, **k))
        return real_open(path, mode, *a, **k)

    def fake_os_open(path, flags, *a, **k):
        if inside(path) and flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT):
            raise OSError(code, os.strerror(code), str(path))
        return real_os_open(path, flags, *a, **k)

    monkeypatch.setattr(builtins, "open", fake_open)
    monkeypatch.setattr(os, "open", fake_os_open)


@pytest.mark.parametrize("verb", VERBS)
def test_disk_full_keeps_its_cause(verb, tmp_path, capsys, monkeypatch):
    base()
    _argv(verb, tmp_path)  # fixtures built before the disk is "full"
    small = tmp_path / "small"
    mounted = mount_tmpfs(small, "size=64k")
    try:
        if not mounted:
            _failing_open(monkeypatch, small / "out", errno.ENOSPC, after_bytes=32 << 10)
        code, _, err = run_cli(_argv(verb, small / "out"), capsys)
        line = assert_one_line_error(code, err, f"{small}/out", "disk full", "free space")
        assert "never written" not in line and "internal" not in line, line
        assert not (small / "out").exists() and not list(small.iterdir()), list(small.iterdir())
    finally:
        if mounted:
            umount(small)


@pytest.mark.parametrize("verb", VERBS)
def test_permission_refused_keeps_its_cause(verb, tmp_path, capsys, monkeypatch):
    base()
    _argv(verb, tmp_path)
    out = tmp_path / "out"
    _failing_open(monkeypatch, out, errno.EACCES)
    code, _, err = run_cli(_argv(verb, out), capsys)
    monkeypatch.undo()
    assert_one_line_error(code, err, str(out), "permission denied", "choose another output path")
    assert not out.exists() and not list(tmp_path.glob(".out*"))


def test_read_only_filesystem_keeps_its_cause(tmp_path, capsys):
    ro = tmp_path / "ro"
    if not mount_tmpfs(ro, "ro,size=64k"):
        pytest.skip("needs root and mount for a read-only filesystem")
    try:
        code, _, err = run_cli(_argv("megatron-to-trtllm", ro / "out"), capsys)
        assert_one_line_error(code, err, f"{ro}/out", "read-only file system", "choose another output path")
    finally:
        umount(ro)
