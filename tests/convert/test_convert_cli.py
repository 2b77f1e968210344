"""The conversion verbs through the CLI: --dry-run writes nothing, --force, --json reports, --dtype,
--max-shard-size, tokenizer carrying (vocab from the tokenizer when args lack it), inspect."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
import transformers

from mconvert.cli import main
from mconvert.io.safeload import safe_load


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = 0
    try:
        main(list(argv))
    except SystemExit as e:
        code = int(e.code or 0)
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.fixture(scope="module")
def hf_llama(tmp_path_factory) -> Path:
    cfg = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=1000, max_position_embeddings=32)
    torch.manual_seed(0)
    d = tmp_path_factory.mktemp("hf")
    transformers.LlamaForCausalLM(cfg).save_pretrained(d)
    return d


def test_dry_run_writes_nothing_and_reports_plan(capsys, hf_llama, tmp_path):
    code, out, _ = run(capsys, "hf-to-megatron", str(hf_llama), str(tmp_path / "mg"), "--tp", "2", "--pp", "2",
                       "--dry-run", "--json")
    assert code == 0 and not (tmp_path / "mg").exists()
    rep = json.loads(out)
    assert rep["dry_run"] and len(rep["files"]) == 4 and rep["peak_memory_bytes"] > rep["largest_unit_bytes"] > 0
    assert {f["path"] for f in rep["files"]} == {f"mp_rank_0{t}_00{p}/model_optim_rng.pt" for t in (0, 1) for p in (0, 1)}


def test_convert_force_dtype_shards_and_inspect(capsys, hf_llama, tmp_path):
    mg, hf = tmp_path / "mg", tmp_path / "hf"
    assert run(capsys, "hf-to-megatron", str(hf_llama), str(mg), "--tp", "2", "--pp", "2")[0] == 0
    code, _, err = run(capsys, "hf-to-megatron", str(hf_llama), str(mg), "--tp", "2")
    assert code == 1 and "already exists; pass --force" in err and "Traceback" not in err
    assert run(capsys, "hf-to-megatron", str(hf_llama), str(mg), "--tp", "2", "--pp", "2", "--force")[0] == 0
    code, out, _ = run(capsys, "megatron-to-hf", str(mg), str(hf), "--dtype", "bf16", "--max-shard-size", "40KB",
                       "--json")
    assert code == 0
    rep = json.loads(out)
    shards = sorted(hf.glob("model-*.safetensors"))
    assert len(shards) > 1 and (hf / "model.safetensors.index.json").is_file()
    for p in shards:  # at most 40 KB of tensors, unless a single tensor is larger than that
        t = load_file(p)
        assert sum(v.numel() * v.element_size() for v in t.values()) <= 40_000 or len(t) == 1
    assert json.loads((hf / "config.json").read_text())["torch_dtype"] == "bfloat16" and rep["dtype"] == "bfloat16"
    want = load_file(hf_llama / "model.safetensors")
    got = {}
    for p in shards:
        got.update(load_file(p))
    assert sorted(got) == sorted(want) and all(torch.equal(got[k], want[k].bfloat16()) for k in want)
    transformers.AutoModelForCausalLM.from_pretrained(hf)  # loads through the index
    code, out, _ = run(capsys, "inspect", str(mg), "--json")
    info = json.loads(out)
    assert info["format"] == "megatron" and (info["tp"], info["pp"]) == (2, 2)
    qkv = next(p for p in info["params"] if p["name"].endswith("linear_qkv.weight"))
    assert qkv["kind"] == "qkv" and qkv["rank_shapes"]["1"] == [(4 + 2 * 2) * 8 // 2, 32]
    assert "all-reduce" in next(p for p in info["params"] if p["name"].endswith("linear_proj.weight"))["collective"]
    assert run(capsys, "inspect", str(mg))[0] == 0
    code, _, err = run(capsys, "reshard", str(mg), str(tmp_path / "r"), "--tp", "3")
    assert code == 1 and "TP=3" in err


def test_tokenizer_is_carried_and_sets_the_vocab(capsys, hf_llama, tmp_path):
    from mconvert.data import build_tokenizer, save_hf_tokenizer

    tok_dir = tmp_path / "tok"
    tok_dir.mkdir()
    save_hf_tokenizer(build_tokenizer(), tok_dir)
    mg = tmp_path / "mg"
    run(capsys, "hf-to-megatron", str(hf_llama), str(mg), "--tp", "2")
    for f in (mg / "release").glob("*/model_optim_rng.pt"):  # args without vocab_size: Megatron-LM's usual
        st = dict(safe_load(f))
        del st["args"].vocab_size
        torch.save(st, f.with_suffix(".tmp"))
        f.with_suffix(".tmp").replace(f)
    (mg / "mconvert-manifest.json").unlink()  # the files changed on purpose
    code, out, _ = run(capsys, "megatron-to-hf", str(mg), str(tmp_path / "nope"), "--json")
    assert code == 0 and "vocab size unknown" in json.loads(out)["warnings"][0]
    code, out, _ = run(capsys, "megatron-to-hf", str(mg), str(tmp_path / "hf"), "--tokenizer", str(tok_dir), "--json")
    assert code == 0 and json.loads(out)["warnings"] == []
    hf = tmp_path / "hf"
    assert (hf / "tokenizer.json").is_file() and json.loads((hf / "config.json").read_text())["vocab_size"] == 1000
    assert "eos_token_id" in json.loads((hf / "generation_config.json").read_text())
