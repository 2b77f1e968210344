"""What a run leaves next to OUT, through the real CLI: a GGUF and its manifest are placed both or neither, and
the manifest's path is checked as OUT's is; `--force` over a symlink or a file leaves no hidden entry (and never
follows the link), nor does a dead run's leftover of either kind; a manifest linked from outside the input is
refused; a failed run removes the parent directories it created; a failure prints exactly one stderr line."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from safety_common import assert_one_line_error, make_hf_llama, run_cli
from test_safety_paths import tree_digest

from mconvert.io.atomic import MANIFEST, check_file_manifest, file_manifest_path
from mconvert.io.paths import TMP_TAG

pytestmark = pytest.mark.timeout(300)


def _with_nan(src: Path, dst: Path) -> Path:
    """A copy of HF dir `src` whose final norm holds a NaN (refused while the output is being written)."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    tensors = load_file(dst / "model.safetensors")
    tensors["model.norm.weight"][0] = float("nan")
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


@pytest.fixture(scope="module")
def fx(tmp_path_factory) -> dict[str, Path]:
    """{'hf': a one-layer llama with a tokenizer, 'nan': the same with a NaN, 'ckpt': hf converted to Megatron
    by mconvert (so it has a manifest)}."""
    from mconvert.convert.verbs import hf_to_megatron
    from mconvert.data import build_tokenizer, save_hf_tokenizer

    root = tmp_path_factory.mktemp("leftovers")
    hf = make_hf_llama(root / "hf", layers=1, hidden=32, ffn=64, heads=4, groups=2, vocab=1000)
    save_hf_tokenizer(build_tokenizer(), hf)
    ckpt = root / "ckpt"
    hf_to_megatron(hf, ckpt)
    return {"hf": hf, "nan": _with_nan(hf, root / "hf-nan"), "ckpt": ckpt}


def temps(parent: Path) -> list[str]:
    """Every hidden temporary entry of this tool in `parent`, whatever its type."""
    return sorted(p.name for p in parent.iterdir() if TMP_TAG in p.name)


# ---- F6: a GGUF and its manifest: both or neither ------------------------------------------------------------
@pytest.mark.parametrize("force", [False, True])
def test_gguf_manifest_path_holding_a_directory_is_refused_before_anything_is_written(tmp_path, capsys, fx, force):
    out = tmp_path / "m.gguf"
    side = file_manifest_path(out)
    side.mkdir()
    (side / "mine.txt").write_text("keep")
    code, _, err = run_cli(["hf-to-gguf", fx["hf"], out] + (["--force"] if force else []), capsys)
    line = assert_one_line_error(code, err, str(side), "is a directory")
    assert TMP_TAG not in line
    assert not os.path.lexists(out)
    assert (side / "mine.txt").read_text() == "keep"
    assert temps(tmp_path) == []


def test_stale_gguf_manifest_is_refused_without_force_and_replaced_with_it(tmp_path, capsys, fx):
    out = tmp_path / "m.gguf"
    side = file_manifest_path(out)
    side.write_text("stale")
    code, _, err = run_cli(["hf-to-gguf", fx["hf"], out], capsys)
    assert_one_line_error(code, err, str(side), "--force")
    assert not os.path.lexists(out) and side.read_text() == "stale"
    assert temps(tmp_path) == []
    code, _, err = run_cli(["hf-to-gguf", fx["hf"], out, "--force"], capsys)
    assert code == 0, err
    assert check_file_manifest(out) == []
    assert temps(tmp_path) == []


@pytest.mark.parametrize("force", [False, True])
def test_gguf_whose_manifest_cannot_be_placed_is_taken_back(tmp_path, capsys, fx, monkeypatch, force):
    """A directory appears at the manifest's path during the run: the second rename cannot happen, so the first
    is undone; with --force the previous OUT is back, byte for byte."""
    from mconvert.io import atomic

    out = tmp_path / "m.gguf"
    side = file_manifest_path(out)
    if force:
        out.write_bytes(b"previous gguf")
    real = atomic.write_manifest

    def then_a_directory(root, *a, **kw):
        path = real(root, *a, **kw)
        side.mkdir()
        return path

    monkeypatch.setattr(atomic, "write_manifest", then_a_directory)
    code, _, err = run_cli(["hf-to-gguf", fx["hf"], out] + (["--force"] if force else []), capsys)
    line = assert_one_line_error(code, err, str(side))
    assert TMP_TAG not in line
    if force:
        assert out.read_bytes() == b"previous gguf"
    else:
        assert not os.path.lexists(out)
    assert side.is_dir() and not any(side.iterdir())
    assert temps(tmp_path) == []


# ---- F7: --force over a symlink or a file, and leftovers of either kind ----------------------------------------
@pytest.mark.parametrize("kind", ["symlink", "file"])
def test_force_over_a_symlink_or_a_file_leaves_no_hidden_entry(tmp_path, capsys, fx, kind):
    precious = tmp_path / "precious"
    precious.mkdir()
    (precious / "f.txt").write_text("keep")
    out = tmp_path / "out"
    if kind == "symlink":
        out.symlink_to(precious)
    else:
        out.write_text("data")
    before = tree_digest(precious)
    code, _, err = run_cli(["hf-to-megatron", fx["hf"], out, "--force"], capsys)
    assert code == 0, err
    assert out.is_dir() and not out.is_symlink() and (out / MANIFEST).is_file()
    assert tree_digest(precious) == before
    assert temps(tmp_path) == []


def test_leftover_links_and_files_of_dead_runs_are_removed_without_following(tmp_path, capsys, fx):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    alive = os.getppid()
    precious = tmp_path / "precious"
    precious.mkdir()
    (precious / "f.txt").write_text("keep")
    before = tree_digest(precious)
    (tmp_path / f".out{TMP_TAG}{dead.pid}").symlink_to(precious)  # a dead --force run's swapped-out link
    (tmp_path / f".out{TMP_TAG}gone-{dead.pid}").write_text("old")  # and a swapped-out file
    (tmp_path / f".out{TMP_TAG}{alive}").write_text("a run in progress")
    out = tmp_path / "out"
    code, _, err = run_cli(["hf-to-megatron", fx["hf"], out], capsys)
    assert code == 0, err
    assert temps(tmp_path) == [f".out{TMP_TAG}{alive}"]
    assert tree_digest(precious) == before


# ---- F10: the input's manifest stays inside the input -----------------------------------------------------------
def test_input_manifest_symlinked_outside_the_input_is_refused(tmp_path, capsys, fx):
    ck = tmp_path / "ck"
    shutil.copytree(fx["ckpt"], ck)
    outside = tmp_path / "outside.json"
    (ck / MANIFEST).rename(outside)
    (ck / MANIFEST).symlink_to(outside)
    out = tmp_path / "out"
    code, _, err = run_cli(["megatron-to-hf", ck, out], capsys)
    assert_one_line_error(code, err, str(ck / MANIFEST), "outside")
    assert not os.path.lexists(out) and temps(tmp_path) == []


# ---- F12: a failed run removes the parents it created, and only those ------------------------------------------
@pytest.mark.parametrize("verb,name", [("hf-to-megatron", "out"), ("hf-to-gguf", "m.gguf")])
def test_failed_run_removes_the_parent_directories_it_created(tmp_path, capsys, fx, verb, name):
    existing = tmp_path / "a"
    existing.mkdir()
    out = existing / "b" / "c" / name
    code, _, err = run_cli([verb, fx["nan"], out], capsys)
    assert_one_line_error(code, err, "nan")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a"]
    assert list(existing.iterdir()) == []


# ---- F13: exactly one stderr line, no empty line left by the progress display -----------------------------------
@pytest.mark.parametrize("damage", ["nan", "generation_config"])
def test_failure_while_writing_prints_exactly_one_line(tmp_path, capsys, fx, damage):
    if damage == "nan":
        src = fx["nan"]
    else:
        src = tmp_path / "hf"
        shutil.copytree(fx["hf"], src)
        (src / "generation_config.json").write_text('{"a": ' + "[" * 50000 + "]" * 50000 + "}")
    out = tmp_path / "out"
    code, _, err = run_cli(["hf-to-megatron", src, out], capsys)
    assert code == 1
    assert err.startswith("error: ") and err.endswith("\n") and err.count("\n") == 1, repr(err)
    assert not os.path.lexists(out) and temps(tmp_path) == [] and sorted(os.listdir(tmp_path)) == (
        ["hf"] if damage != "nan" else [])


def test_manifest_of_a_successful_gguf_lists_only_the_file(tmp_path, capsys, fx):
    out = tmp_path / "m.gguf"
    code, _, err = run_cli(["hf-to-gguf", fx["hf"], out], capsys)
    assert code == 0, err
    assert list(json.loads(file_manifest_path(out).read_text())["files"]) == [out.name]
    assert sorted(os.listdir(tmp_path)) == ["m.gguf", file_manifest_path(out).name]


# ---- a file placed without renameat2 (other OS, old kernel, a file system without it): the hard-link path ------
@pytest.mark.parametrize("appears", [None, "gguf", "manifest"])
def test_gguf_placed_by_the_hard_link_fallback(tmp_path, capsys, fx, monkeypatch, appears):
    """Without RENAME_NOREPLACE a file is put in place by a hard link, which never replaces anything either: the
    GGUF and its manifest land both; a file that appears at either path just before it is placed stays the
    user's, one line names it, and the GGUF is taken back (neither of ours stays)."""
    import mconvert.io.atomic as atomic

    out = tmp_path / "m.gguf"
    side = file_manifest_path(out)
    mine = {"gguf": out, "manifest": side}.get(appears or "")

    def no_renameat2(a: Path, b: Path, flags: int) -> bool:
        if mine is not None and Path(b) == mine.absolute() and not mine.exists():
            mine.write_text("the user's file\n")  # made by someone else just before the commit step
        return False

    monkeypatch.setattr(atomic, "_renameat2", no_renameat2)
    code, _, err = run_cli(["hf-to-gguf", fx["hf"], out], capsys)
    if mine is None:
        assert code == 0, err
        assert check_file_manifest(out) == [] and sorted(os.listdir(tmp_path)) == ["m.gguf", side.name]
        return
    assert_one_line_error(code, err, str(mine), "appeared while this run was in progress")
    assert sorted(os.listdir(tmp_path)) == [mine.name] and mine.read_text() == "the user's file\n"
