"""Start-up: the verbs that need no tensor (`--help`, a verb's `--help`, `plan`) never import torch, and a
conversion verb freezes its imports out of the cyclic collector's reach before its first tensor."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from safety_common import ROOT

# Runs the CLI in a fresh interpreter (after BEFORE), then prints REPORT as JSON on stderr.
_FRESH = """
import gc, json, sys
BEFORE
from mconvert.cli import main
try:
    main(sys.argv[1:])
except SystemExit as e:
    code = e.code
else:
    code = 0
print(json.dumps(REPORT), file=sys.stderr)
"""
# which heavy packages it imported (Python's own record)
_PROBE = _FRESH.replace("BEFORE", 'heavy = ("torch", "transformers", "numpy", "safetensors", "onnx", "megatron")').replace(
    "REPORT", '{"rc": code, "loaded": sorted(m for m in heavy if m in sys.modules)}')


def _probe(*argv: str) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    r = subprocess.run([sys.executable, "-c", _PROBE, *argv], env=env, capture_output=True, text=True, timeout=120)
    return json.loads(r.stderr.strip().splitlines()[-1])


@pytest.mark.timeout(300)
@pytest.mark.parametrize("argv", [
    ("--help",),
    ("megatron-to-hf", "--help"),
    ("megatron-to-trtllm", "--help"),
    ("plan", "--preset", "llama3-405b", "--tp", "8", "--pp", "16", "--to", "hf", "--json"),
    ("plan", "--preset", "gpt2-1b", "--tp", "2", "--to", "ft", "--target-tp", "2", "--nodes", "1",
     "--procs-per-node", "2", "--json"),
    ("plan", "--preset", "llama3-405b", "--tp", "8", "--pp", "16", "--to", "trtllm", "--target-tp", "8", "--json"),
    ("plan", "--preset", "no-such-model", "--to", "hf"),  # a refusal, too, is one line without torch
])
def test_verbs_without_tensors_do_not_import_torch(argv: tuple[str, ...]) -> None:
    got = _probe(*argv)
    assert got["rc"] == (1 if "no-such-model" in argv else 0), got
    assert got["loaded"] == [], f"{argv}: imported {got['loaded']}"


def test_a_conversion_verb_freezes_its_imports() -> None:
    """`tuning.apply` (what every conversion verb runs before its first tensor) moves the imported objects to
    the permanent generation and raises the young-generation threshold."""
    # `alive` holds every object the collector tracks once torch is imported, so none is freed before the freeze;
    # get_objects() lists the collectable generations only, so an object frozen is no longer in it.
    code = ("import gc, json; from mconvert.io import tuning; import torch; alive = gc.get_objects(); "
            "young0 = gc.get_threshold()[0]; tuning.apply(); left = {id(o) for o in gc.get_objects()}; "
            "print(json.dumps([len(alive), sum(id(o) in left for o in alive), gc.get_freeze_count(), "
            "young0, gc.get_threshold()[0]]))")
    r = subprocess.run([sys.executable, "-c", code], env={**os.environ, "PYTHONPATH": str(ROOT)},
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    alive, not_frozen, frozen, young0, young = json.loads(r.stdout)
    assert alive and not_frozen == 0  # every object alive after the imports is out of the collector's reach
    assert frozen >= alive
    assert young > young0  # young collections come less often than before


# Runs one conversion through the CLI in a fresh interpreter, counting the cyclic collector's runs by generation.
_GC_PROBE = _FRESH.replace("BEFORE", """runs = [0, 0, 0]
gc.callbacks.append(lambda phase, info: phase == "stop" and runs.__setitem__(info["generation"],
                                                                         runs[info["generation"]] + 1))""").replace(
    "REPORT", '{"rc": code, "runs": runs}')


@pytest.mark.timeout(300)
def test_a_conversion_never_walks_the_import_graph(tmp_path) -> None:
    """From the interpreter's start to its exit, a conversion verb runs no full collection: the collector is
    paused while torch and the engine import (which otherwise triggers several, each walking everything imported
    so far), and `tuning.apply` freezes the imports without one."""
    from safety_common import base

    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    r = subprocess.run([sys.executable, "-c", _GC_PROBE, "megatron-to-hf", str(base()["ckpt"]), str(tmp_path / "o")],
                       env=env, capture_output=True, text=True, timeout=240)
    got = json.loads(r.stderr.strip().splitlines()[-1])
    assert got["rc"] == 0, r.stderr[-2000:]
    assert got["runs"][2] == 0, got
    assert got["runs"][0] > 0, got  # the collector is back on for the conversion (young collections)
    assert (tmp_path / "o" / "model.safetensors").is_file()


def test_the_collector_is_back_after_a_verb_that_stops_early(capsys) -> None:
    """An in-process caller of `main` gets the collector back as it was, whether the verb stopped before its
    engine loaded (a usage error) or ran."""
    import gc

    from mconvert.cli import main

    assert gc.isenabled()
    with pytest.raises(SystemExit):
        main(["megatron-to-hf", "--no-such-flag"])
    assert gc.isenabled()
    gc.disable()
    try:
        with pytest.raises(SystemExit):
            main(["megatron-to-hf", "--no-such-flag"])
        assert not gc.isenabled()  # a caller that runs without the collector keeps it off
    finally:
        gc.enable()


def test_verbs_import_no_deployment_format() -> None:
    """`convert/verbs.py` imports a deployment format's writer (FasterTransformer, TensorRT-LLM, GGUF, ONNX) only
    inside the verb that writes it (the torch-free layouts `plan` reads are light): megatron-to-hf does not pay
    for them."""
    code = ("import json, sys; import mconvert.convert.verbs; "
            "print(json.dumps(sorted(m for m in sys.modules if m.startswith(('mconvert.convert.deploy.', 'gguf', "
            "'onnx', 'optimum')) and not m.endswith('_layout'))))")
    r = subprocess.run([sys.executable, "-c", code], env={**os.environ, "PYTHONPATH": str(ROOT)},
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert json.loads(r.stdout) == []


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("outtype", "scaling"), [("f16", None), ("q8_0", None), ("q8_0", "llama3")])
def test_hf_to_gguf_never_imports_torch(tmp_path, outtype, scaling) -> None:
    """`hf-to-gguf` of a safetensors HF directory (and its `--dry-run`) runs without torch: the directory is
    read as numpy arrays (`convert/hf/arrays.py`) into the numpy GGUF writer, a llama3-scaled model's
    `rope_freqs.weight` computed in numpy too; the file it writes is a GGUF that gguf-py reads with every
    tensor."""
    import gguf
    from safety_common import make_hf_llama

    from mconvert.data import build_tokenizer, save_hf_tokenizer

    tok = tmp_path / "tok"
    save_hf_tokenizer(build_tokenizer(), tok)
    hf = make_hf_llama(tmp_path / "hf", vocab=1000)
    if scaling == "llama3":
        cfg = json.loads((hf / "config.json").read_text())
        cfg["rope_scaling"] = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                               "original_max_position_embeddings": 8192}
        (hf / "config.json").write_text(json.dumps(cfg))
    args = ("--outtype", outtype, "--tokenizer", str(tok))
    dry = _probe("hf-to-gguf", str(hf), str(tmp_path / "dry.gguf"), *args, "--dry-run")
    assert dry["rc"] == 0 and "torch" not in dry["loaded"], dry
    assert not (tmp_path / "dry.gguf").exists()
    got = _probe("hf-to-gguf", str(hf), str(tmp_path / "m.gguf"), *args)
    assert got["rc"] == 0, got
    assert "torch" not in got["loaded"] and "transformers" not in got["loaded"], got
    names = {t.name for t in gguf.GGUFReader(tmp_path / "m.gguf").tensors}
    assert len(names) > 10 and ("rope_freqs.weight" in names) == (scaling == "llama3")
