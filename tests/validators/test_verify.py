"""`mconvert verify`: each broken export (made from a correct one the way a buggy converter would write it,
manifest included) is caught by the check named for it, with a non-zero exit; correct exports pass."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from mconvert.cli import main
from mconvert.validators.verify import SCHEMA, verify
from validate_common import BROKEN, WORK, _remanifest, broken, hf_export, mcore_moe_ckpt, mcore_moe_export, trained_ckpt


def _cli_json(capsys, *args) -> tuple[int, dict]:
    with pytest.raises(SystemExit) as e:
        main([*map(str, args), "--json"])
        raise SystemExit(0)
    return e.value.code or 0, json.loads(capsys.readouterr().out)


# the layout bugs of Megatron sharding are checked against the native TP=2 PP=2 checkpoint itself;
# the rest against the correct HF export (same numbers, no process start)
_AGAINST_CKPT = {"gqa-groups-permuted", "swiglu-halves-swapped"}


@pytest.mark.parametrize("kind", sorted(BROKEN))
def test_broken_export_is_caught_by_name(kind, capsys):
    d = broken(kind)
    fam = "gpt2" if kind == "untied-gpt2-head" else "llama"
    against = trained_ckpt(fam) if kind in _AGAINST_CKPT else hf_export(fam)
    rc, rep = _cli_json(capsys, "verify", d, "--against", against, "--device", "cpu")
    assert rc == 1
    assert rep["schema"] == SCHEMA and not rep["passed"]
    assert BROKEN[kind] in rep["errors"], rep["errors"]
    assert "manifest" not in rep["errors"]  # the manifest is consistent: the named check caught it


def test_layout_bugs_are_diagnosed_down_to_the_tensor():
    rep = verify(broken("gqa-groups-permuted"), against=trained_ckpt("llama"), device="cpu")
    diag = {c.name: c.message for c in rep.checks}["weights-vs-checkpoint"]
    assert "k_proj" in diag and "GQA" in diag
    rep = verify(broken("swiglu-halves-swapped"), against=hf_export("llama"), device="cpu")
    diag = {c.name: c.message for c in rep.checks}["weights-vs-checkpoint"]
    assert "gate_proj" in diag and "SwiGLU" in diag


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_correct_export_passes_against_its_native_checkpoint(family, capsys):
    rc, rep = _cli_json(capsys, "verify", hf_export(family), "--against", trained_ckpt(family), "--device", "cpu")
    assert rc == 0 and rep["passed"], [c for c in rep["checks"] if c["status"] == "error"]
    names = {c["name"]: c["status"] for c in rep["checks"]}
    for n in ("architecture", "weights-strict", "weight-files", "dtypes", "finite", "tied-head", "tokenizer",
              "generation-config", "manifest", "config-vs-checkpoint", "logits"):
        assert names[n] == "ok", (n, rep["checks"])
    assert rep["logits"]["results"][0]["metrics"]["max_abs"] <= 1e-5


def test_sharded_export_passes():
    rep = verify(hf_export("llama", "200KB"), device="cpu")
    assert rep.passed, [c for c in rep.checks if c.status == "error"]
    assert "shard(s)" in {c.name: c.message for c in rep.checks}["weight-files"]


def _variant(name: str) -> object:
    d = WORK / "broken" / name
    if d.exists():
        shutil.rmtree(d)
    shutil.copytree(hf_export("llama"), d)
    return d


def test_nan_weight_is_named():
    d = _variant("nan")
    t = load_file(str(d / "model.safetensors"))
    t["model.layers.0.mlp.up_proj.weight"][3, 5] = float("nan")
    save_file(t, str(d / "model.safetensors"), metadata={"format": "pt"})
    rep = verify(_remanifest(d))
    msg = {c.name: c.message for c in rep.errors()}
    assert "model.layers.0.mlp.up_proj.weight" in msg["finite"]


def test_edited_file_without_new_manifest_is_caught_by_the_manifest():
    d = _variant("tampered")
    cfg = json.loads((d / "config.json").read_text())
    cfg["rope_theta"] = 500000.0
    (d / "config.json").write_text(json.dumps(cfg))
    rep = verify(d)
    assert "config.json" in {c.name: c.message for c in rep.errors()}["manifest"]


def test_missing_tokenizer_and_bad_eos_are_named():
    d = _variant("no-tokenizer")
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (d / f).unlink(missing_ok=True)
    g = json.loads((d / "generation_config.json").read_text())
    g["eos_token_id"] = 50256
    (d / "generation_config.json").write_text(json.dumps(g))
    rep = verify(_remanifest(d))
    names = {c.name for c in rep.errors()}
    assert {"tokenizer", "generation-config"} <= names


def test_dtype_inconsistent_with_config_is_named():
    d = _variant("dtype")
    t = load_file(str(d / "model.safetensors"))
    t["model.norm.weight"] = t["model.norm.weight"].to(torch.bfloat16)
    save_file(t, str(d / "model.safetensors"), metadata={"format": "pt"})
    rep = verify(_remanifest(d))
    assert "dtypes" in {c.name for c in rep.errors()}


def test_missing_eps_and_rope_fields_are_named():
    d = _variant("fields")
    cfg = json.loads((d / "config.json").read_text())
    del cfg["rms_norm_eps"], cfg["rope_theta"]
    (d / "config.json").write_text(json.dumps(cfg))
    rep = verify(_remanifest(d))
    msg = {c.name: c.message for c in rep.errors()}["config-fields"]
    assert "rms_norm_eps" in msg and "rope_theta" in msg


def test_not_a_directory_is_one_line(capsys, tmp_path):
    with pytest.raises(SystemExit) as e:
        main(["verify", str(tmp_path / "nope")])
    assert e.value.code == 1
    err = capsys.readouterr().err
    assert "not a directory" in err and "Traceback" not in err


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_moe_export_of_megatron_cores_checkpoint_verifies_against_it(family, capsys):
    """The architecture comes from the family records; the logits are megatron-core's rank files run natively at
    their TP × EP. megatron-core's checkpoint carries no tokenizer, so only the tokenizer checks fail."""
    rc, rep = _cli_json(capsys, "verify", mcore_moe_export(family), "--against", mcore_moe_ckpt(family),
                        "--device", "cpu")
    assert rc == 1 and set(rep["errors"]) == {"tokenizer", "generation-config"}, rep["checks"]
    names = {c["name"]: c["status"] for c in rep["checks"]}
    for n in ("architecture", "config-fields", "head-dim", "weights-strict", "dtypes", "finite", "manifest",
              "config-vs-checkpoint", "logits"):
        assert names[n] == "ok", (n, rep["checks"])
    m = rep["logits"]["results"][0]["metrics"]
    assert m["max_abs"] <= 1e-4 and m["top1"] == 1.0


def test_moe_export_with_two_experts_swapped_fails_the_logits_check(capsys):
    d = WORK / "broken" / "mixtral-experts-swapped"
    if d.exists():
        shutil.rmtree(d)
    shutil.copytree(mcore_moe_export("mixtral"), d)
    f = d / "model.safetensors"
    t = load_file(str(f))
    for w in ("w1", "w2", "w3"):  # experts 1 and 2 of layer 0 trade places; the router keeps its rows
        a, b = (f"model.layers.0.block_sparse_moe.experts.{e}.{w}.weight" for e in (1, 2))
        t[a], t[b] = t[b], t[a]
    save_file(t, str(f), metadata={"format": "pt"})
    _remanifest(d)
    rc, rep = _cli_json(capsys, "verify", d, "--against", mcore_moe_ckpt("mixtral"), "--device", "cpu")
    assert rc == 1 and "logits" in rep["errors"] and "manifest" not in rep["errors"], rep["errors"]
