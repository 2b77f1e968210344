"""Integrity: every verb that writes an OUT goes through atomic_output_dir and leaves a manifest with the sha256
of every file; check_manifest (what `mconvert verify` reports) catches a flipped byte, a missing file, a
changed size, an added file and a tampered manifest."""

from __future__ import annotations

import ast
import json
import shutil
from functools import lru_cache
from pathlib import Path

import pytest
from safety_common import _WORK, ROOT, base, copy_of, run_cli

from mconvert.io.atomic import MANIFEST, check_manifest

CLI = ROOT / "mconvert" / "cli.py"


def _verbs_with_force() -> dict[str, tuple[str, str]]:
    """verb -> (library module, function) for every CLI verb that takes --force (i.e. writes an OUT)."""
    tree = ast.parse(CLI.read_text())
    out = {}
    for fn in tree.body:
        if not isinstance(fn, ast.FunctionDef):
            continue
        verb = next((d.args[0].value for d in fn.decorator_list if isinstance(d, ast.Call) and d.args
                     and isinstance(d.args[0], ast.Constant) and _name(d.func).endswith("command")), None)
        if verb is None or "force" not in {a.arg for a in fn.args.args}:
            continue
        imports = {a.asname or a.name: node.module for node in ast.walk(fn) if isinstance(node, ast.ImportFrom)
                   for a in node.names}
        called = [_name(c.func) for c in ast.walk(fn) if isinstance(c, ast.Call)]
        target = next(c for c in called if c in imports and imports[c].startswith("mconvert."))
        out[verb] = (imports[target], target)
    return out


def _name(node: ast.AST) -> str:
    if isinstance(node, ast.Attribute):
        return f"{_name(node.value)}.{node.attr}"
    return node.id if isinstance(node, ast.Name) else "?"


def _uses_atomic(module: str, func: str, depth: int = 3) -> bool:
    """Whether `module.func` reaches an atomic output (`*atomic_output_dir`, or `atomic_output_file` for one-file
    formats) within `depth` calls, following names imported from other mconvert modules (the driver loop)."""
    trees: dict[str, tuple[dict, dict]] = {}

    def parsed(mod: str) -> tuple[dict, dict]:
        if mod not in trees:
            path = ROOT / (mod.replace(".", "/") + ".py")
            tree = ast.parse(path.read_text()) if path.is_file() else ast.parse("")
            fns = {f.name: f for f in ast.walk(tree) if isinstance(f, ast.FunctionDef)}
            imported = {a.asname or a.name: node.module for node in ast.walk(tree)
                        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("mconvert.")
                        for a in node.names}
            trees[mod] = (fns, imported)
        return trees[mod]

    todo, seen = [(module, func)], set()
    for _ in range(depth + 1):
        nxt = []
        for mod, name in todo:
            fns, imported = parsed(mod)
            if (mod, name) in seen:
                continue
            seen.add((mod, name))
            if name not in fns:
                if name in imported:
                    nxt.append((imported[name], name))
                continue
            for c in ast.walk(fns[name]):
                if isinstance(c, ast.Call):
                    n = _name(c.func)
                    if n.endswith(("atomic_output_dir", "atomic_output_file")):
                        return True
                    nxt.append((mod, n.split(".")[-1]))
        todo = nxt
    return False


def test_every_verb_that_writes_an_output_uses_atomic_output_dir():
    verbs = _verbs_with_force()
    verbs.pop("train")  # a training run commits through the tracker file instead (next test)
    expected = {"megatron-to-hf", "hf-to-megatron", "reshard", "megatron-to-ft", "megatron-to-trtllm", "to-onnx",
                "megatron-to-gguf", "hf-to-gguf"}
    missing = expected - set(verbs)
    assert not missing, f"verbs not found with --force: {missing}"
    bad = [f"{v}: {m}.{f}" for v, (m, f) in sorted(verbs.items()) if not _uses_atomic(m, f)]
    assert not bad, f"verbs writing OUT without atomic_output_dir: {bad}"


def test_trainer_commits_checkpoints_through_renames_and_the_tracker():
    """`train --save` is Megatron's model: rank files are written to a temporary name and renamed
    (layout.save_rank_file), the tracker file is replaced last (layout.write_latest) — a killed save leaves
    the tracker on the previous complete iteration. No other write of a .pt in the trainer."""
    for path in sorted((ROOT / "mconvert" / "trainer").rglob("*.py")):
        calls = {_name(c.func) for c in ast.walk(ast.parse(path.read_text())) if isinstance(c, ast.Call)}
        assert "torch.save" not in calls, f"{path}: torch.save outside layout.save_rank_file"
    calls = {_name(c.func) for c in ast.walk(ast.parse((ROOT / "mconvert/trainer/train.py").read_text()))
             if isinstance(c, ast.Call)}
    assert {"save_rank_file", "write_latest"} <= calls


@lru_cache(maxsize=None)
def _tiny_gpt2() -> Path:
    import torch
    import transformers

    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_embd=64, n_layer=2, n_head=2, n_inner=256, vocab_size=100, n_positions=64)
    out = _WORK / "gpt2-hf"
    transformers.GPT2LMHeadModel(cfg).save_pretrained(out)
    return out


@pytest.mark.parametrize("verb", ["megatron-to-hf", "hf-to-megatron", "reshard", "megatron-to-trtllm",
                                  "megatron-to-ft"])
def test_verb_writes_a_manifest_of_every_file(verb, tmp_path, capsys):
    b = base()
    out = tmp_path / "out"
    argv = {
        "megatron-to-hf": [verb, b["ckpt"], out],
        "hf-to-megatron": [verb, b["hf"], out, "--tp", "2"],
        "reshard": [verb, b["ckpt"], out, "--tp", "1", "--pp", "2"],
        "megatron-to-trtllm": [verb, b["ckpt"], out, "--tp", "2"],
        "megatron-to-ft": [verb, _tiny_gpt2(), out, "--infer-tp", "2", "--allow-approx-gelu"],
    }[verb]
    code, _, err = run_cli(argv, capsys)
    assert code == 0, err
    listed = json.loads((out / MANIFEST).read_text())["files"]
    on_disk = {str(p.relative_to(out)) for p in out.rglob("*") if p.is_file() and p.name != MANIFEST}
    assert set(listed) == on_disk and on_disk
    assert check_manifest(out) == []


@pytest.fixture
def hf_copy(tmp_path) -> Path:
    return copy_of("ref", tmp_path / "hf", manifest=True)


def test_flipped_byte_is_detected(hf_copy):
    f = hf_copy / "model.safetensors"
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0x01  # one bit inside a tensor: same size, still a valid file
    f.write_bytes(bytes(data))
    problems = check_manifest(hf_copy)
    assert len(problems) == 1 and "blake3 differs" in problems[0] and str(f) in problems[0]


def test_missing_file_is_detected(hf_copy):
    (hf_copy / "generation_config.json").unlink()
    assert any("missing" in p and "generation_config.json" in p for p in check_manifest(hf_copy))


def test_changed_size_is_detected(hf_copy):
    with open(hf_copy / "config.json", "a") as f:
        f.write(" ")
    assert any("size" in p and "config.json" in p for p in check_manifest(hf_copy))


def test_added_file_is_detected(hf_copy):
    shutil.copy(hf_copy / "model.safetensors", hf_copy / "model-extra.safetensors")
    assert any("not in the manifest" in p and "model-extra.safetensors" in p for p in check_manifest(hf_copy))


def test_missing_or_tampered_manifest(hf_copy):
    m = hf_copy / MANIFEST
    doc = json.loads(m.read_text())
    doc["files"]["../../etc/passwd"] = {"sha256": "0" * 64, "bytes": 1}
    m.write_text(json.dumps(doc))
    assert any("outside" in p for p in check_manifest(hf_copy))
    m.write_text("{broken")
    assert "unreadable manifest" in check_manifest(hf_copy)[0]
    m.unlink()
    assert "no mconvert-manifest.json" in check_manifest(hf_copy)[0]


def test_intact_output_has_no_problems():
    assert check_manifest(base()["ref"]) == [] and check_manifest(base()["ckpt"]) == []


def test_verify_reports_a_corrupted_file(hf_copy, capsys):
    """D's `mconvert verify` turns the manifest check into a failing report line."""
    f = hf_copy / "model.safetensors"
    data = bytearray(f.read_bytes())
    data[-10] ^= 0xFF
    f.write_bytes(bytes(data))
    code, out, err = run_cli(["verify", hf_copy, "--json"], capsys)
    assert code != 0
    assert "blake3 differs" in out + err
