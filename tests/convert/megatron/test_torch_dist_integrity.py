"""Megatron-LM's integrity manifest (`integrity.json`, `--verify-integrity`) beside torch_dist checkpoints.

Written: every torch_dist output carries it, and Megatron-LM's own `verify_integrity_manifest` (from a
Megatron-LM source tree, `MCONVERT_MEGATRON_LM=<checkout>`, or an installed megatron-core that has it) passes
on it, refuses it once a byte changes, and its `save_integrity_manifest` writes the same bytes.
Read: every verb that reads torch_dist refuses, in one line naming the file, a listed file whose sha256 differs
or that is missing, and refuses by name a manifest of another shape or one naming a file outside the
checkpoint; an intact manifest, none at all, and a file the manifest does not list (Megatron-LM checks only what
it lists) pass. `inspect` reads no tensor data: it checks the manifest's shape and files, not their digests.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from safety_common import _WORK, assert_one_line_error, make_hf_llama, run_cli

from mconvert.convert.verbs import hf_to_megatron

ITER = "release"
DATA = "__0_0.distcp"


@pytest.fixture(scope="module")
def dist() -> Path:
    """A torch_dist checkpoint of a transformers Llama (full multi-head attention) at TP=2, without mconvert's manifest (as Megatron-LM
    writes it: integrity.json is then the only witness of its bytes)."""
    from mconvert.data import build_tokenizer, save_hf_tokenizer

    out = _WORK / "integrity-dist"
    if not out.exists():  # no GQA: FasterTransformer takes it too; the trainer's tokenizer, which GGUF embeds
        hf = make_hf_llama(_WORK / "integrity-hf", groups=4, vocab=1000)
        save_hf_tokenizer(build_tokenizer(), hf)
        hf_to_megatron(hf, out, tp=2, format="torch_dist")
        (out / "mconvert-manifest.json").unlink()
    return out


def _copy(dist: Path, tmp: Path) -> Path:
    return Path(shutil.copytree(dist, tmp / "ckpt"))


def _flip(path: Path, at: int) -> None:
    with open(path, "r+b") as f:
        f.seek(at)
        b = f.read(1)
        f.seek(at)
        f.write(bytes([b[0] ^ 1]))


def _edit_manifest(ckpt: Path, fn) -> None:
    p = ckpt / ITER / "integrity.json"
    doc = json.loads(p.read_text())
    doc = fn(doc) or doc
    p.write_text(json.dumps(doc))


def test_torch_dist_output_lists_every_file_of_the_iteration_directory(dist: Path) -> None:
    it = dist / ITER
    doc = json.loads((it / "integrity.json").read_text())
    assert doc["algorithm"] == "sha256"
    on_disk = {p.name for p in it.iterdir() if p.is_file()} - {"integrity.json"}
    assert set(doc["files"]) == on_disk and {DATA, ".metadata", "common.pt", "metadata.json"} <= on_disk
    for name, digest in doc["files"].items():  # the data file's digest is taken while written, not read back
        assert digest == hashlib.sha256((it / name).read_bytes()).hexdigest(), name


def _megatron_lm() -> tuple[list[str], dict[str, str]] | None:
    """How to import Megatron-LM's integrity functions in a subprocess: (preamble lines, environment), or None."""
    probe = "from megatron.core.dist_checkpointing.validation import verify_integrity_manifest"
    if subprocess.run([sys.executable, "-c", probe], capture_output=True).returncode == 0:
        return [], dict(os.environ)
    src = os.environ.get("MCONVERT_MEGATRON_LM")
    if not src or not (Path(src) / "megatron/core/dist_checkpointing/validation.py").is_file():
        return None
    # megatron.core's __init__ imports its model code (triton kernels); the checkpointing modules need only the
    # package paths and its own import order, so the two packages are entered without running their __init__
    pre = ["import sys, types",
           f"for n, p in (('megatron', {src!r} + '/megatron'), ('megatron.core', {src!r} + '/megatron/core')):",
           "    m = types.ModuleType(n); m.__path__ = [p]; sys.modules[n] = m",
           "import megatron.core.tensor_parallel, megatron.core.utils"]
    return pre, dict(os.environ)


@pytest.mark.timeout(300)
def test_megatron_lms_own_check_passes_on_the_output(dist: Path, tmp_path: Path) -> None:
    how = _megatron_lm()
    if how is None:
        pytest.skip("Megatron-LM's verify_integrity_manifest is neither installed (megatron-core >= 0.18) nor "
                    "given as a source tree (MCONVERT_MEGATRON_LM=<Megatron-LM checkout>)")
    pre, env = how
    ours = _copy(dist, tmp_path) / ITER
    bad = Path(shutil.copytree(ours, tmp_path / "bad"))
    _flip(bad / DATA, 1000)
    theirs = Path(shutil.copytree(ours, tmp_path / "theirs"))
    (theirs / "integrity.json").unlink()
    script = "\n".join(pre + [
        "from megatron.core.dist_checkpointing.validation import save_integrity_manifest, verify_integrity_manifest",
        "from megatron.core.dist_checkpointing.core import CheckpointingException",
        f"verify_integrity_manifest({str(ours)!r})",
        "try:",
        f"    verify_integrity_manifest({str(bad)!r}); print('BAD PASSED')",
        "except CheckpointingException as e:",
        "    print('BAD REFUSED', str(e).splitlines()[1].strip())",
        f"save_integrity_manifest({str(theirs)!r})",
        "print('OK')",
    ])
    p = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=280)
    assert p.returncode == 0 and "OK" in p.stdout, p.stderr[-3000:]
    assert f"BAD REFUSED {DATA}: hash mismatch" in p.stdout, p.stdout
    assert (theirs / "integrity.json").read_bytes() == (ours / "integrity.json").read_bytes()


VERBS = {  # every verb that reads a torch_dist checkpoint's tensors: argv after the checkpoint
    "megatron-to-hf": lambda t: ["megatron-to-hf", "{ckpt}", t / "out"],
    "reshard": lambda t: ["reshard", "{ckpt}", t / "out", "--tp", "1", "--format", "torch_dist"],
    "megatron-to-gguf": lambda t: ["megatron-to-gguf", "{ckpt}", t / "out.gguf"],
    "megatron-to-ft": lambda t: ["megatron-to-ft", "{ckpt}", t / "out"],
    "megatron-to-trtllm": lambda t: ["megatron-to-trtllm", "{ckpt}", t / "out"],
    "validate": lambda t: ["validate", "{ckpt}", _WORK / "integrity-hf", "--device", "cpu"],  # against transformers
}


def _argv(verb: str, ckpt: Path, tmp: Path) -> list:
    return [ckpt if a == "{ckpt}" else a for a in VERBS[verb](tmp)]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("verb", sorted(VERBS))
def test_every_reading_verb_refuses_a_changed_byte_and_passes_the_intact_checkpoint(verb: str, dist: Path,
                                                                                   tmp_path: Path, capsys) -> None:
    ckpt = _copy(dist, tmp_path)
    code, _, err = run_cli(_argv(verb, ckpt, tmp_path), capsys)
    assert code == 0, err  # the benign neighbour: the manifest as written
    for p in tmp_path.iterdir():
        if p.name != "ckpt":
            shutil.rmtree(p) if p.is_dir() else p.unlink()
    _flip(ckpt / ITER / DATA, (ckpt / ITER / DATA).stat().st_size // 2)
    code, _, err = run_cli(_argv(verb, ckpt, tmp_path), capsys)
    assert_one_line_error(code, err, f"{ckpt / ITER / DATA}: sha256 differs from Megatron-LM's integrity manifest",
                          str(ckpt / ITER / "integrity.json"), "re-copy")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def _missing(ckpt: Path) -> None:
    (ckpt / ITER / "metadata.json").unlink()


BAD = {  # damage -> what the one error line says
    "a listed file missing": (_missing, ["metadata.json: listed in", "integrity.json but missing"]),
    "md5": (lambda c: _edit_manifest(c, lambda d: d.update(algorithm="md5")),
            ["integrity.json: not a Megatron-LM integrity manifest", 'algorithm "md5"']),
    "files a list": (lambda c: _edit_manifest(c, lambda d: d.update(files=[DATA])),
                     ["not a Megatron-LM integrity manifest", "'files' is a JSON list"]),
    "a list": (lambda c: _edit_manifest(c, lambda d: [d]), ["not a Megatron-LM integrity manifest", "a JSON list"]),
    "digest not hex": (lambda c: _edit_manifest(c, lambda d: d["files"].update({DATA: "ABC"})),
                       [f"entry '{DATA}'", "not a lowercase sha256 hex digest"]),
    "parent path": (lambda c: _edit_manifest(c, lambda d: d["files"].update({"../hf_token_ids.json": "0" * 64})),
                    ["integrity.json: entry", "'../hf_token_ids.json' points outside"]),
    "absolute path": (lambda c: _edit_manifest(c, lambda d: d["files"].update({"/etc/hostname": "0" * 64})),
                      ["integrity.json: entry", "'/etc/hostname' points outside"]),
    "symlink out": (lambda c: (c / ITER / "link").symlink_to(c / "hf_token_ids.json") or _edit_manifest(
        c, lambda d: d["files"].update({"link": "0" * 64})), ["link is a symlink leading outside"]),
    "not JSON": (lambda c: (c / ITER / "integrity.json").write_text("{"), ["not valid JSON"]),
}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("case", sorted(BAD))
@pytest.mark.parametrize("verb", ["megatron-to-hf", "inspect"])
def test_a_manifest_of_another_shape_or_reaching_outside_is_refused_by_name(case: str, verb: str, dist: Path,
                                                                           tmp_path: Path, capsys) -> None:
    ckpt = _copy(dist, tmp_path)
    damage, expect = BAD[case]
    damage(ckpt)
    argv = ["inspect", ckpt] if verb == "inspect" else _argv(verb, ckpt, tmp_path)
    code, _, err = run_cli(argv, capsys)
    assert_one_line_error(code, err, *expect)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


NEIGHBOURS = {
    "no manifest": lambda c: (c / ITER / "integrity.json").unlink(),
    "a file it does not list": lambda c: (c / ITER / "notes.txt").write_text("added after the save"),
    "no algorithm key (megatron-core reads it as sha256)": lambda c: _edit_manifest(c, lambda d: d.pop("algorithm") and None),
    "an empty listing": lambda c: _edit_manifest(c, lambda d: d.update(files={})),
}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("case", sorted(NEIGHBOURS))
def test_what_megatron_lm_accepts_passes(case: str, dist: Path, tmp_path: Path, capsys) -> None:
    ckpt = _copy(dist, tmp_path)
    NEIGHBOURS[case](ckpt)
    code, _, err = run_cli(["megatron-to-hf", ckpt, tmp_path / "out"], capsys)
    assert code == 0, err


def test_inspect_reads_no_tensor_data_so_it_does_not_hash_it(dist: Path, tmp_path: Path, capsys) -> None:
    ckpt = _copy(dist, tmp_path)
    _flip(ckpt / ITER / DATA, 1000)
    code, out, err = run_cli(["inspect", ckpt, "--json"], capsys)
    assert code == 0, err
    assert "integrity.json" in {f["path"] for f in json.loads(out)["files"]}
