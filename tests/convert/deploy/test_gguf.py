"""GGUF export proven in llama.cpp itself (llama-cpp-python built from source in its own venv, `make gguf-env`).

The truth here is llama.cpp: a trainer checkpoint at TP=2 PP=2 goes through `megatron-to-gguf`, llama.cpp runs
the file, and its logits at every position are compared with transformers' on the `megatron-to-hf` export;
a file written without the q/k rope permutation must fail that comparison. Random transformers models of the
other families (Qwen3: qk-norm, tied head, head_dim != hidden/heads; Qwen2: qkv bias; Llama-3.x rope scaling)
go through `hf-to-gguf` the same way. The refusals and the streaming run without llama.cpp.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import transformers
from validate_common import WORK, hf_export, mcore_moe_ckpt, mcore_moe_export, trained_ckpt

from mconvert.cli import main as cli_main
from mconvert.convert.verbs import to_gguf
from mconvert.mappings.gguf_vocab import PRE_TOKENIZERS
from mconvert.io.atomic import file_manifest_path
from mconvert.errors import MConvertError
from mconvert.validators.gguf_runner import read_gguf_metadata, run_llama_cpp
from mconvert.validators.validate import validate
from mconvert.validators.verify_gguf import verify_gguf as verify

G = WORK / "gguf"
G.mkdir(parents=True, exist_ok=True)
REL_F32 = 1e-4  # llama.cpp f32 logits vs transformers', relative to the largest logit


# ---- builders -------------------------------------------------------------------------------------------
def _tokenizer_dir() -> Path:
    """The trainer's byte-level BPE tokenizer (tokenizer.json, tokenizer_config.json, ...)."""
    from mconvert.data import build_tokenizer, save_hf_tokenizer

    d = G / "tok"
    if not (d / "tokenizer.json").is_file():
        save_hf_tokenizer(build_tokenizer(), d)
    return d


def _hf_model(name: str, cfg: transformers.PretrainedConfig, tok_dir: Path | None = None) -> Path:
    """A random transformers model saved by `save_pretrained`, with the trainer's tokenizer (or `tok_dir`'s)
    beside it."""
    d = G / f"hf-{name}"
    if not (d / "config.json").is_file():
        torch.manual_seed(5)
        model = transformers.AutoModelForCausalLM.from_config(cfg)
        with torch.no_grad():  # weights larger than the default init, so logits spread and errors show
            for p in model.parameters():
                if p.dim() == 2:
                    p.normal_(0, 0.08)
        model.save_pretrained(d, safe_serialization=True)
        for f in (tok_dir or _tokenizer_dir()).iterdir():
            shutil.copy(f, d / f.name)
    return d


HF_CONFIGS = {
    "qwen3": lambda: transformers.Qwen3Config(
        hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2,
        head_dim=32, vocab_size=1000, max_position_embeddings=128, rms_norm_eps=1e-6, rope_theta=1000000.0,
        tie_word_embeddings=True),
    "qwen2": lambda: transformers.Qwen2Config(
        hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=1000, max_position_embeddings=128, rms_norm_eps=1e-6, rope_theta=1000000.0,
        tie_word_embeddings=False),
    "llama3": lambda: transformers.LlamaConfig(
        hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=64, vocab_size=1000, max_position_embeddings=128, rms_norm_eps=1e-5, rope_theta=500000.0,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 8192}, tie_word_embeddings=False),
}


def _gguf(src: Path, name: str, outtype: str, **kw) -> Path:
    out = G / f"{name}-{outtype}.gguf"
    if not out.is_file():
        to_gguf(src, out, outtype, verb="hf-to-gguf" if (src / "config.json").is_file() else "megatron-to-gguf", **kw)
    return out


@pytest.fixture(scope="module")
def trained() -> tuple[Path, Path]:
    """(TP=2 PP=2 trainer checkpoint, its megatron-to-hf export)."""
    return trained_ckpt("llama"), hf_export("llama")


def _rel(report, i: int = 0) -> float:
    m = report.results[i].metrics
    return m["max_abs"] / m["ref_scale"]


# ---- llama.cpp runs the files ----------------------------------------------------------------------------
@pytest.mark.gguf
@pytest.mark.timeout(1800)
def test_trained_tp2_pp2_checkpoint_f32_gguf_matches_transformers_in_llama_cpp(llama_cpp, trained):
    ckpt, hf = trained
    f32 = _gguf(ckpt, "llama", "f32")
    rep = validate(hf, [f32], device="cpu", n_tokens=32)
    assert rep.passed, rep.results[0].failures
    assert _rel(rep) < REL_F32, rep.results[0].metrics
    assert rep.results[0].metrics["top1"] == 1.0
    # the Megatron checkpoint itself (run at its own TP=2 PP=2) as the reference agrees too
    rep2 = validate(ckpt, [f32], device="cpu", n_tokens=32)
    assert rep2.passed and _rel(rep2) < REL_F32, rep2.results[0].metrics


@pytest.mark.gguf
@pytest.mark.timeout(1800)
def test_f16_bf16_and_q8_0_ggufs_meet_their_documented_tolerances(llama_cpp, trained):
    ckpt, hf = trained
    files = [_gguf(ckpt, "llama", t) for t in ("f16", "bf16", "q8_0")]
    assert [read_gguf_metadata(f)["file_type_name"] for f in files] == ["MOSTLY_F16", "MOSTLY_BF16", "MOSTLY_Q8_0"]
    rep = validate(hf, files, device="cpu", n_tokens=32)
    got = {r.path.rsplit("-", 1)[-1]: (r.tolerance["dtype"], r.metrics) for r in rep.results}
    print(json.dumps({k: {"row": v[0], "rel": v[1]["max_abs"] / v[1]["ref_scale"], "mean_abs": v[1]["mean_abs"],
                          "kl": v[1]["kl"], "top1": v[1]["top1"]} for k, v in got.items()}, indent=1))
    assert [r.tolerance["dtype"] for r in rep.results] == ["float16", "bfloat16", "q8_0"]
    assert rep.passed, [r.failures for r in rep.results]


@pytest.mark.gguf
@pytest.mark.timeout(1800)
def test_gguf_without_the_qk_permutation_fails_the_comparison(llama_cpp, trained):
    ckpt, hf = trained
    bad = _gguf(ckpt, "llama-noperm", "f32", permute=False)
    rep = validate(hf, [bad], device="cpu", n_tokens=32)
    assert not rep.passed
    assert any(f.startswith("max abs") for f in rep.results[0].failures), rep.results[0].failures


@pytest.mark.gguf
@pytest.mark.timeout(1800)
def test_verify_gguf_loads_round_trips_the_tokenizer_and_greedy_tokens_equal(llama_cpp, trained, capsys):
    ckpt, hf = trained
    f32 = _gguf(ckpt, "llama", "f32")
    rep = verify(f32, against=hf, device="cpu")
    by = {c.name: c for c in rep.checks}
    assert rep.passed, [(c.name, c.message) for c in rep.errors()]
    for name in ("manifest", "metadata", "tensors", "load", "tokenizer", "greedy", "logits"):
        assert by[name].status == "ok", (name, by[name].message)
    # the verdict names the engine whose loading was checked
    import io

    from rich.console import Console

    from mconvert.validators.verify import render_verify

    shown = io.StringIO()
    render_verify(rep, Console(file=shown, width=200))
    assert shown.getvalue().strip().splitlines()[-1].startswith("READY for llama.cpp"), shown.getvalue()
    # the CLI: exit 0 and the JSON report
    try:
        cli_main(["verify", str(f32), "--against", str(hf), "--device", "cpu", "--json"])
    except SystemExit as e:
        assert e.code in (0, None)
    assert json.loads(capsys.readouterr().out)["passed"] is True


@pytest.mark.gguf
@pytest.mark.timeout(1800)
def test_verify_names_a_gguf_whose_bytes_changed_after_export(llama_cpp, trained):
    ckpt, _ = trained
    f32 = _gguf(ckpt, "llama", "f32")
    bad = G / "changed.gguf"
    shutil.copy(f32, bad)
    shutil.copy(file_manifest_path(f32), file_manifest_path(bad).with_name(f"{bad.name}.mconvert-manifest.json"))
    m = json.loads(file_manifest_path(bad).read_text())
    m["files"] = {bad.name: m["files"][f32.name]}
    file_manifest_path(bad).write_text(json.dumps(m))
    with open(bad, "r+b") as f:  # one byte inside the last tensor's data
        f.seek(-100, 2)
        b = f.read(1)
        f.seek(-100, 2)
        f.write(bytes([b[0] ^ 0x40]))
    rep = verify(bad)
    assert [c.name for c in rep.errors()] == ["manifest"], [(c.name, c.message) for c in rep.checks]
    assert "blake3 differs" in rep.errors()[0].message


@pytest.mark.gguf
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("family", sorted(HF_CONFIGS))
def test_hf_to_gguf_other_families_match_transformers_in_llama_cpp(llama_cpp, family):
    hf = _hf_model(family, HF_CONFIGS[family]())
    f32 = _gguf(hf, family, "f32")
    meta = read_gguf_metadata(f32)
    arch = {"qwen3": "qwen3", "qwen2": "qwen2", "llama3": "llama"}[family]
    assert meta["general.architecture"] == arch
    assert ("rope_freqs.weight" in meta["tensors"]) == (family == "llama3")
    assert ("output.weight" in meta["tensors"]) == (family != "qwen3")  # tied: llama.cpp reuses token_embd
    rep = validate(hf, [f32], device="cpu", n_tokens=96 if family == "llama3" else 32)
    assert rep.passed, rep.results[0].failures
    assert _rel(rep) < REL_F32, rep.results[0].metrics


@pytest.mark.gguf
@pytest.mark.timeout(1800)
def test_llama3_gguf_without_rope_freqs_differs_so_the_scaling_is_probed(llama_cpp):
    """The control of the llama3 case above: the same weights without the scaling differ in llama.cpp."""
    hf = _hf_model("llama3", HF_CONFIGS["llama3"]())
    plain = G / "hf-llama3-unscaled"
    if not plain.exists():
        shutil.copytree(hf, plain)
        cfg = json.loads((plain / "config.json").read_text())
        cfg.pop("rope_scaling")
        (plain / "config.json").write_text(json.dumps(cfg))
    f32 = _gguf(plain, "llama3-unscaled", "f32")
    rep = validate(hf, [f32], device="cpu", n_tokens=96)
    assert not rep.passed


@pytest.mark.gguf
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("pre", ["llama-bpe", "qwen2"])
def test_split_regex_pretokenizers_tokenize_in_llama_cpp_as_in_transformers(llama_cpp, pre):
    """Each regex of the pre-tokenizer table, in a BPE trained with it, tokenizes in llama.cpp as in
    transformers: the table's names are the regexes llama.cpp applies."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    from mconvert.data import EOS, corpus_text
    from mconvert.validators.verify_gguf import ROUND_TRIP_TEXTS

    regex = next(k for k, v in PRE_TOKENIZERS.items() if v == pre)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(regex), "isolated"),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(corpus_text().split("\n\n"), trainers.BpeTrainer(
        vocab_size=1000, min_frequency=2, special_tokens=[EOS], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    hf = G / f"hf-pre-{pre}"
    if not hf.exists():
        src = _hf_model("qwen3", HF_CONFIGS["qwen3"]())
        shutil.copytree(src, hf)
        for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
            (hf / f).unlink(missing_ok=True)
        transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS).save_pretrained(hf)
    f = _gguf(hf, f"pre-{pre}", "f32")
    assert read_gguf_metadata(f)["tokenizer.ggml.pre"] == pre
    fast = transformers.PreTrainedTokenizerFast(tokenizer_file=str(hf / "tokenizer.json"))
    result, _ = run_llama_cpp(f, {"tokenize": list(ROUND_TRIP_TEXTS)})
    assert result["tokenize"] == [fast(t, add_special_tokens=False)["input_ids"] for t in ROUND_TRIP_TEXTS]


# ---- without llama.cpp: refusals, atomic output, streaming ---------------------------------------------------
def _refused(capsys, argv: list[str]) -> str:
    with pytest.raises(SystemExit) as e:
        cli_main(argv)
    assert e.value.code == 1
    err = capsys.readouterr().err
    assert err.startswith("error: ") and len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    return err


def _no_output(out: Path) -> None:
    assert not out.exists() and not file_manifest_path(out).exists()
    assert not [p for p in out.parent.iterdir() if p.name.startswith(f".{out.name}.mconvert-tmp-")]


@pytest.mark.timeout(300)
def test_gpt2_with_erf_gelu_is_refused_by_name_and_nothing_is_written(capsys):
    hf = _hf_model("gpt2-erf", transformers.GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=1000,
                                                       n_positions=64, activation_function="gelu"))
    out = G / "refused-gpt2.gguf"
    err = _refused(capsys, ["hf-to-gguf", str(hf), str(out)])
    assert "activation 'gelu' has no GGUF form: llama.cpp's gpt2 architecture applies tanh-approximated" in err
    _no_output(out)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("outtype,value", [("f16", 1e6), ("q8_0", 1e8)])
def test_a_weight_the_outtype_turns_into_inf_is_refused_by_name(capsys, outtype, value):
    """f16 holds magnitudes up to 65504, and q8_0 stores each block's scale (largest magnitude / 127) in float16:
    a weight beyond them was written as Inf with exit 0. Refused naming the HF tensor, nothing written; bf16
    keeps it."""
    from safetensors.torch import load_file, save_file

    hf = G / f"hf-big-{outtype}"
    shutil.rmtree(hf, ignore_errors=True)
    shutil.copytree(_hf_model("qwen3", HF_CONFIGS["qwen3"]()), hf)
    key = "model.layers.1.mlp.down_proj.weight"
    f = next(p for p in hf.glob("*.safetensors") if key in load_file(p))
    state = load_file(f)
    state[key][3, 5] = value
    save_file(state, f, metadata={"format": "pt"})
    out = G / f"refused-big-{outtype}.gguf"
    err = _refused(capsys, ["hf-to-gguf", str(hf), str(out), "--outtype", outtype])
    assert key in err and f"{value:.6g}" in err and "Inf" in err and "--outtype bf16 or f32" in err, err
    _no_output(out)
    ok = G / f"big-{outtype}-bf16.gguf"
    to_gguf(hf, ok, "bf16", verb="hf-to-gguf", force=True)
    assert ok.is_file()


@pytest.mark.timeout(300)
def test_qwen2_with_llama3_rope_scaling_is_refused_by_name(capsys):
    cfg = HF_CONFIGS["qwen2"]()
    cfg.rope_scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                        "original_max_position_embeddings": 8192}
    hf = _hf_model("qwen2-llama3", cfg)
    out = G / "refused-qwen2.gguf"
    err = _refused(capsys, ["hf-to-gguf", str(hf), str(out), "--outtype", "f32"])
    assert "rope scaling llama3" in err and "qwen2" in err and "rope_freqs" in err
    _no_output(out)


def _tokenizer_variant(name: str, edit) -> Path:
    d = G / f"hf-tok-{name}"
    if not d.exists():
        shutil.copytree(_hf_model("qwen3", HF_CONFIGS["qwen3"]()), d)
        tj = json.loads((d / "tokenizer.json").read_text())
        edit(tj)
        (d / "tokenizer.json").write_text(json.dumps(tj))
    return d


@pytest.mark.timeout(300)
@pytest.mark.parametrize("kind,edit,words", [
    ("metaspace", lambda tj: tj.update(pre_tokenizer={"type": "Metaspace", "replacement": "▁",
                                                      "prepend_scheme": "always", "split": True}),
     "pre-tokenizer step 'Metaspace' has no llama.cpp form"),
    ("unknown-regex", lambda tj: tj.update(pre_tokenizer={"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": "\\p{L}+|\\s+"}, "behavior": "Isolated", "invert": False},
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}]}),
     "pre-tokenizer regex '\\\\p{L}+|\\\\s+' matches none llama.cpp names"),
    ("prefix-space", lambda tj: tj["pre_tokenizer"].update(add_prefix_space=True),
     "add_prefix_space=true has no llama.cpp pre-tokenizer"),
])
def test_tokenizers_llama_cpp_cannot_reproduce_are_refused_by_name(capsys, kind, edit, words):
    hf = _tokenizer_variant(kind, edit)
    out = G / f"refused-{kind}.gguf"
    err = _refused(capsys, ["hf-to-gguf", str(hf), str(out)])
    assert words in err and "tokenizer.json" in err, err
    _no_output(out)


@pytest.mark.timeout(300)
def test_outtype_and_existing_output_are_refused_before_work(capsys):
    hf = _hf_model("qwen3", HF_CONFIGS["qwen3"]())
    out = G / "bad-outtype.gguf"
    assert "--outtype 'q4_0': choose f32, f16, bf16, q8_0" in _refused(capsys, ["hf-to-gguf", str(hf), str(out),
                                                                               "--outtype", "q4_0"])
    _no_output(out)
    there = G / "there.gguf"
    there.write_bytes(b"keep me")
    assert "output already exists; pass --force" in _refused(capsys, ["hf-to-gguf", str(hf), str(there)])
    assert there.read_bytes() == b"keep me"


@pytest.mark.timeout(300)
def test_writer_streams_each_unit_to_disk_before_the_next_is_read(monkeypatch):
    """The header is written first and every unit's tensors are on disk when the next unit is read: the
    writer never holds more than the unit in hand."""
    from mconvert.convert.deploy import gguf as gguf_mod

    hf = _hf_model("qwen3", HF_CONFIGS["qwen3"]())
    sizes: list[tuple[object, int]] = []
    real_add = gguf_mod.GgufWriter.add

    def add(self, unit, tensors):
        real_add(self, unit, tensors)
        self._file.drain()
        sizes.append((unit, self.path.stat().st_size))

    monkeypatch.setattr(gguf_mod.GgufWriter, "add", add)
    out = G / "streamed.gguf"
    out.unlink(missing_ok=True)
    to_gguf(hf, out, "f32", verb="hf-to-gguf", force=True)
    assert [u for u, _ in sizes] == ["embedding", 0, 1, "final"]
    grown = [b - a for (_, a), (_, b) in zip(sizes, sizes[1:])]
    layer = 4 * sum(n for n in (128 * 256, 64 * 128, 64 * 128, 256 * 128, 3 * 256 * 128))  # q, k, v, o, mlp
    assert all(g >= layer * 0.99 for g in grown[:2]), (grown, layer)  # each layer's bytes land with its unit
    assert sizes[-1][1] == out.stat().st_size


@pytest.mark.timeout(300)
def test_metadata_states_the_model_as_its_config_does():
    hf = _hf_model("llama3", HF_CONFIGS["llama3"]())
    meta = read_gguf_metadata(_gguf(hf, "llama3", "f32"))
    cfg = json.loads((hf / "config.json").read_text())
    want = {"llama.context_length": cfg["max_position_embeddings"], "llama.embedding_length": cfg["hidden_size"],
            "llama.block_count": cfg["num_hidden_layers"], "llama.feed_forward_length": cfg["intermediate_size"],
            "llama.attention.head_count": cfg["num_attention_heads"],
            "llama.attention.head_count_kv": cfg["num_key_value_heads"], "llama.rope.dimension_count": cfg["head_dim"],
            "llama.vocab_size": cfg["vocab_size"], "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "gpt-2"}
    assert {k: meta.get(k) for k in want} == want
    assert meta["llama.rope.freq_base"] == pytest.approx(cfg["rope_theta"])
    assert meta["llama.attention.layer_norm_rms_epsilon"] == pytest.approx(cfg["rms_norm_eps"])
    assert meta["n_vocab"] == cfg["vocab_size"] and meta["tokenizer.ggml.eos_token_id"] == 0



def test_a_familys_metadata_hook_writes_its_keys_under_its_architecture(tmp_path, monkeypatch):
    """`GgufLayout.metadata(spec)`: the keys a family's llama.cpp architecture reads beyond the common ones are
    written under `{arch}.`, typed as llama.cpp reads them (int: uint32, float: float32, bool, str), and read back
    by the header reader; the experts' width of a family reading `expert_feed_forward_length` is its expert width."""
    import dataclasses

    from mconvert.convert.deploy import gguf as gguf_mod
    from mconvert.mappings.families import preset
    from mconvert.mappings.record import EXPERT_FF_KEY, expert_width_key

    real = gguf_mod.gguf_layout
    own = {"made_up.window": 7, "made_up.softcap": 0.5, "made_up.flag": True, "made_up.kind": "x"}
    monkeypatch.setattr(gguf_mod, "gguf_layout", lambda spec: dataclasses.replace(real(spec), metadata=lambda s: own))
    hf = _hf_model("llama3", HF_CONFIGS["llama3"]())
    meta = read_gguf_metadata(to_gguf(hf, tmp_path / "own.gguf", "f32", verb="hf-to-gguf")["output"])
    assert {k: meta.get(f"llama.{k}") for k in own} == own
    moe = preset("tiny-qwen3-moe")
    assert expert_width_key(moe) == {EXPERT_FF_KEY: moe.expert_ffn_hidden_size} and expert_width_key(preset("tiny-llama")) == {}


def test_a_gguf_without_its_tokenizer_is_refused(tmp_path):
    hf = tmp_path / "hf"
    shutil.copytree(_hf_model("qwen3", HF_CONFIGS["qwen3"]()), hf)
    for f in hf.glob("*token*"):
        f.unlink()
    with pytest.raises(MConvertError, match="GGUF embeds one — pass --tokenizer DIR"):
        to_gguf(hf, tmp_path / "x.gguf", "f32", verb="hf-to-gguf")
    _no_output(tmp_path / "x.gguf")


# ---- SentencePiece tokenizers ------------------------------------------------------------------------------
SPM_VOCAB = 800  # pieces in the SentencePiece model; one added special token follows, then padding rows
SPM_ROWS = 816
SPM_SPECIAL = "<|im_end|>"
SPM_USER = "<tool>"  # a user-defined piece of the SentencePiece model: matched whole in any text
# plain texts: leading / repeated spaces, digits, characters outside the pieces (byte fallback), newlines
SPM_TEXTS = ("The otter sat down near Max.", "   three leading spaces,  two inside and trailing  ",
             "digits 12345 and 3.14159", "naïve café — 日本語 🙂", "line one\nline two\n\n  indented", "x",
             f"call {SPM_USER} now,{SPM_USER}twice")
# texts with special tokens, parsed as such by both sides
SPM_SPECIAL_TEXTS = (f"Hello{SPM_SPECIAL} world", f"<s> start and end </s>{SPM_SPECIAL}")


def _spm_tokenizer_dir() -> Path:
    """A llama-2-style SentencePiece tokenizer: a BPE `tokenizer.model` trained on the corpus by sentencepiece
    (identity normalizer, byte fallback, digits split, `<unk> <s> </s>` at 0-2) and saved by transformers'
    LlamaTokenizer / LlamaTokenizerFast with one added special token."""
    import sentencepiece as spm

    from mconvert.data import corpus_text

    d = G / "spm-tok"
    if (d / "tokenizer.json").is_file():
        return d
    raw = G / "spm-raw"
    raw.mkdir(parents=True, exist_ok=True)
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(corpus_text().splitlines()), model_prefix=str(raw / "sp"), model_type="bpe",
        vocab_size=SPM_VOCAB, byte_fallback=True, normalization_rule_name="identity",
        remove_extra_whitespaces=False, add_dummy_prefix=True, split_digits=True, allow_whitespace_only_pieces=True,
        unk_id=0, bos_id=1, eos_id=2, pad_id=-1, num_threads=1, minloglevel=2, user_defined_symbols=[SPM_USER])
    slow = transformers.LlamaTokenizer(vocab_file=str(raw / "sp.model"), legacy=True)
    slow.add_special_tokens({"additional_special_tokens": [SPM_SPECIAL]})
    slow.save_pretrained(raw / "slow")
    transformers.LlamaTokenizerFast.from_pretrained(raw / "slow", legacy=True).save_pretrained(d)
    return d


def _spm_model() -> Path:
    cfg = transformers.LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=SPM_ROWS, max_position_embeddings=128,
                                   bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    return _hf_model("spm-llama", cfg, _spm_tokenizer_dir())


@pytest.mark.gguf
@pytest.mark.timeout(1800)
def test_sentencepiece_llama_tokenizes_in_llama_cpp_as_transformers_and_logits_match(llama_cpp):
    hf = _spm_model()
    f32 = _gguf(hf, "spm-llama", "f32")
    meta = read_gguf_metadata(f32)
    assert {k: meta.get(k) for k in ("tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.ggml.bos_token_id",
                                     "tokenizer.ggml.eos_token_id", "tokenizer.ggml.unknown_token_id",
                                     "tokenizer.ggml.add_bos_token", "tokenizer.ggml.add_space_prefix", "n_vocab")} == {
        "tokenizer.ggml.model": "llama", "tokenizer.ggml.pre": "default", "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2, "tokenizer.ggml.unknown_token_id": 0, "tokenizer.ggml.add_bos_token": True,
        "tokenizer.ggml.add_space_prefix": True, "n_vocab": SPM_ROWS}
    fast = transformers.LlamaTokenizerFast.from_pretrained(hf)
    slow = transformers.LlamaTokenizer.from_pretrained(hf, legacy=True)
    want = [fast(t, add_special_tokens=False)["input_ids"] for t in SPM_TEXTS]
    assert want == [slow(t, add_special_tokens=False)["input_ids"] for t in SPM_TEXTS]  # the truth agrees with itself
    assert any(fast.convert_ids_to_tokens(i).startswith("<0x") for ids in want for i in ids)  # bytes fallback probed
    want_special = [fast(t, add_special_tokens=False)["input_ids"] for t in SPM_SPECIAL_TEXTS]
    result, _ = run_llama_cpp(f32, {"tokenize": list(SPM_TEXTS), "tokenize_special": list(SPM_SPECIAL_TEXTS),
                                    "detokenize": want})
    assert result["tokenize"] == want
    assert result["tokenize_special"] == want_special
    assert result["detokenize"] == [fast.decode(ids) for ids in want]
    rep = validate(hf, [f32], device="cpu", n_tokens=32)
    assert rep.passed, rep.results[0].failures
    assert _rel(rep) < REL_F32 and rep.results[0].metrics["top1"] == 1.0, rep.results[0].metrics


def _spm_variant(name: str, edit) -> Path:
    """The SentencePiece model with one proto field changed (or bytes replaced), beside the same HF model."""
    from sentencepiece import sentencepiece_model_pb2 as pb

    d = G / f"hf-spm-{name}"
    if not d.exists():
        shutil.copytree(_spm_model(), d)
        data = (d / "tokenizer.model").read_bytes()
        if callable(edit):
            m = pb.ModelProto()
            m.ParseFromString(data)
            edit(m)
            data = m.SerializeToString()
        else:
            data = edit
        (d / "tokenizer.model").write_bytes(data)
    return d


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name,edit,words", [
    ("garbage", b"\x0a\xff\xff\xff\xff\x0f not a model", "tokenizer.model: not a SentencePiece model"),
    ("unigram", lambda m: setattr(m.trainer_spec, "model_type", 1),
     "SentencePiece model type UNIGRAM has no GGUF form"),
    ("no-bytes", lambda m: [setattr(m.trainer_spec, "byte_fallback", False)] + [
        setattr(p, "type", 4) for p in m.pieces if p.type == 6],  # byte pieces become plain user-defined ones
     "SentencePiece model without byte_fallback has no GGUF form"),
    ("marked-user-piece", lambda m: setattr(next(p for p in m.pieces if p.piece == "\u2581Max"), "type", 4),
     "user-defined SentencePiece piece '\u2581Max' holds the word-boundary mark"),
    ("squeeze", lambda m: setattr(m.normalizer_spec, "remove_extra_whitespaces", True),
     "SentencePiece remove_extra_whitespaces=true has no GGUF form (llama.cpp keeps runs of spaces)"),
])
def test_sentencepiece_models_llama_cpp_cannot_reproduce_are_refused_by_name(capsys, name, edit, words):
    hf = _spm_variant(name, edit)
    out = G / f"refused-spm-{name}.gguf"
    err = _refused(capsys, ["hf-to-gguf", str(hf), str(out)])
    assert words in err, err
    _no_output(out)


# ---- mixture of experts and GPT-2 ------------------------------------------------------------------------
@pytest.mark.gguf
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("family,arch", [("mixtral", "llama"), ("qwen3_moe", "qwen3moe")])
def test_megatron_core_moe_checkpoint_gguf_matches_transformers_in_llama_cpp(llama_cpp, family, arch):
    """megatron-core's own MoE checkpoint (EP=2 rank files) -> GGUF f32: the experts stacked per layer, llama.cpp's
    logits within 1e-4 of transformers' on the megatron-to-hf export and its greedy tokens equal."""
    from mconvert.validators.runners import source_model

    ckpt, hf = mcore_moe_ckpt(family), mcore_moe_export(family)
    f32 = _gguf(ckpt, f"moe-{family}", "f32", tokenizer=_tokenizer_dir())
    meta = read_gguf_metadata(f32)
    cfg = json.loads((hf / "config.json").read_text())
    experts = cfg.get("num_local_experts", cfg.get("num_experts"))
    width = cfg.get("moe_intermediate_size", cfg["intermediate_size"])
    assert meta["general.architecture"] == arch
    assert (meta[f"{arch}.expert_count"], meta[f"{arch}.expert_used_count"]) == (experts, cfg["num_experts_per_tok"])
    assert meta["tensors"]["blk.1.ffn_down_exps.weight"][0] == (experts, cfg["hidden_size"], width)
    assert meta["tensors"]["blk.1.ffn_gate_inp.weight"] == ((experts, cfg["hidden_size"]), "F32")
    rep = validate(hf, [f32], device="cpu", n_tokens=32)
    print(json.dumps({f"{family}_rel": _rel(rep)}))
    assert rep.passed, rep.results[0].failures
    assert _rel(rep) < REL_F32 and rep.results[0].metrics["top1"] == 1.0, rep.results[0].metrics
    # q8_0: every tensor, the 3-D expert stacks included, dequantizes (gguf-py) to the f32 file's values within
    # one 8-bit step of its largest value
    import gguf
    import numpy as np

    q8 = _gguf(ckpt, f"moe-{family}", "q8_0", tokenizer=_tokenizer_dir())
    exact = {t.name: np.asarray(t.data, dtype=np.float32) for t in gguf.GGUFReader(str(f32)).tensors}
    for t in gguf.GGUFReader(str(q8)).tensors:
        x = exact[t.name]
        y = gguf.quants.dequantize(t.data, t.tensor_type).reshape(x.shape)
        assert np.abs(x - y).max() <= np.abs(x).max() / 127, t.name
        assert t.tensor_type.name == ("F32" if t.name.endswith(("_norm.weight", "ffn_gate_inp.weight")) else "Q8_0")
    prompt = [5, 17, 300, 42, 7, 99, 250, 3]
    got, _ = run_llama_cpp(f32, {"generate": {"prompt": prompt, "max_tokens": 12}})
    model, ids = source_model(hf, "cpu"), torch.tensor([prompt])
    with torch.inference_mode():
        want = model.generate(ids, max_new_tokens=12, do_sample=False, min_new_tokens=12)[0, len(prompt):].tolist()
    assert got["generate"] == want


@pytest.mark.gguf
@pytest.mark.timeout(1800)
def test_moe_gguf_with_the_experts_stacked_out_of_order_fails_the_comparison(llama_cpp, monkeypatch):
    """The control of the MoE case: the same file with each layer's experts stacked in reverse order (the
    router unchanged) differs in llama.cpp, so the comparison above probes the stacking order."""
    from mconvert.convert.deploy import gguf as gguf_mod

    real = gguf_mod.plan_tensors

    def reversed_experts(*a, **kw):
        return [t if len(t.hf) < 2 else gguf_mod.GgufTensor(t.name, t.hf[::-1], t.unit, t.shape, t.qtype)
                for t in real(*a, **kw)]

    monkeypatch.setattr(gguf_mod, "plan_tensors", reversed_experts)
    bad = _gguf(mcore_moe_ckpt("mixtral"), "moe-mixtral-reversed", "f32", tokenizer=_tokenizer_dir())
    rep = validate(mcore_moe_export("mixtral"), [bad], device="cpu", n_tokens=32)
    assert not rep.passed and any(f.startswith("max abs") for f in rep.results[0].failures), rep.results[0].metrics


class _GgmlGelu(torch.nn.Module):
    """ggml-cpu's f32 GeLU as llama.cpp computes it: the input rounded to f16, the tanh form read from a table
    of f16 values (GGML_GELU_FP16), 0 below -10 and the identity above 10."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.nn.functional.gelu(x.half().float(), approximate="tanh").half().float()
        return torch.where(x <= -10, torch.zeros_like(x), torch.where(x >= 10, x, y))


@pytest.mark.gguf
@pytest.mark.timeout(1800)
def test_gpt2_checkpoint_gguf_matches_transformers_in_llama_cpp(llama_cpp):
    """The trained GPT-2 (TP=2) -> GGUF f32: Conv1D weights transposed, learned positions, LayerNorm biases.
    llama.cpp's logits are within 1e-4 of transformers', and closer still once transformers' GeLU is the one
    ggml-cpu computes (an f16 table); `verify` passes every check, the logits judged by the f16 row that this
    GeLU earns on larger models."""
    from mconvert.validators.gguf_runner import gguf_logits
    from mconvert.validators.runners import source_model

    ckpt, hf = trained_ckpt("gpt2"), hf_export("gpt2")
    f32 = _gguf(ckpt, "gpt2", "f32")
    meta = read_gguf_metadata(f32)
    assert meta["general.architecture"] == "gpt2" and meta["tokenizer.ggml.pre"] == "gpt-2"
    assert meta["tensors"]["position_embd.weight"][1] == "F32" and "output.weight" not in meta["tensors"]
    tokens = torch.randint(0, 1000, (2, 32), generator=torch.Generator().manual_seed(3))
    got = gguf_logits(f32, tokens)
    model = source_model(hf, "cpu")
    with torch.inference_mode():
        plain = model(input_ids=tokens).logits.float()
        for block in model.transformer.h:
            block.mlp.act = _GgmlGelu()
        emulated = model(input_ids=tokens).logits.float()
    scale = emulated.abs().max()
    rel, rel_plain = float((got - emulated).abs().max() / scale), float((got - plain).abs().max() / scale)
    print(json.dumps({"gpt2_rel_vs_ggml_gelu": rel, "gpt2_rel_vs_transformers": rel_plain}))
    assert rel_plain < REL_F32
    assert rel < rel_plain / 2  # the f16 GeLU table is a visible part of the difference, not noise
    rep = verify(f32, against=hf, device="cpu")
    by = {c.name: c for c in rep.checks}
    for name in ("metadata", "tensors", "load", "tokenizer", "greedy", "logits"):
        assert by[name].status == "ok", (name, by[name].message)
    assert rep.logits["results"][0]["tolerance"]["dtype"] == "float16"


# ---- Gemma: llama.cpp's gemma2 / gemma3 (norms stored as 1 + w, GeGLU, sliding and full layers) ---------------
def _gemma_hf(name: str) -> Path:
    """tiny-gemma3 (q/k norm, two rope bases, linear scaling on the full layer), tiny-gemma2 (both soft-caps) at
    the attention scale llama.cpp fixes (1/sqrt(head_dim)); random transformers models with the trainer's
    tokenizer."""
    from deploy_common import make_hf

    from mconvert.mappings.families import preset

    d = G / f"hf-{name}"
    if not (d / "config.json").is_file():
        make_hf(preset(name).replace(softmax_scale=64 ** -0.5), d)
        for f in _tokenizer_dir().iterdir():
            shutil.copy(f, d / f.name)
    return d


@pytest.mark.gguf
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("name,arch", [("tiny-gemma3", "gemma3"), ("tiny-gemma2", "gemma2")])
def test_gemma_gguf_matches_transformers_in_llama_cpp_past_the_window(llama_cpp, name, arch):
    hf = _gemma_hf(name)
    f32 = _gguf(hf, name, "f32")
    meta = read_gguf_metadata(f32)
    assert meta["general.architecture"] == arch and meta[f"{arch}.attention.sliding_window"] == 16
    rep = validate(hf, [f32], device="cpu", n_tokens=32)
    assert rep.tokens["beyond_window"], rep.tokens
    assert rep.passed, rep.results[0].failures  # judged at f16: llama.cpp's GeLU reads an f16 table


@pytest.mark.gguf
@pytest.mark.timeout(1800)
def test_gemma_gguf_without_the_plus_one_on_the_norms_fails_the_comparison(llama_cpp, monkeypatch):
    import dataclasses

    import mconvert.convert.deploy.gguf as gguf_mod

    real = gguf_mod.gguf_layout
    monkeypatch.setattr(gguf_mod, "gguf_layout", lambda spec: dataclasses.replace(real(spec), norm_shift=0.0))
    hf = _gemma_hf("tiny-gemma3")
    out = G / "tiny-gemma3-no-shift.gguf"
    out.unlink(missing_ok=True)
    to_gguf(hf, out, "f32", verb="hf-to-gguf")
    rep = validate(hf, [out], device="cpu", n_tokens=32)
    assert not rep.passed and _rel(rep) > 100 * REL_F32, rep.results[0].metrics


def test_gemma_gguf_refuses_what_llama_cpp_fixes_by_name(capsys):
    from mconvert.convert.deploy.gguf import gguf_layout
    from mconvert.mappings.families import preset

    with pytest.raises(MConvertError, match="query_pre_attn_scalar 48"):
        gguf_layout(preset("tiny-gemma2"))  # llama.cpp scales by 1/sqrt(head_dim) below its 27B
    with pytest.raises(MConvertError, match="each 6-th"):
        gguf_layout(preset("tiny-gemma3").replace(window_pattern=(1, 0) * 3))
    with pytest.raises(MConvertError, match="rope_local_base_freq"):
        gguf_layout(preset("tiny-gemma3").replace(rotary_base_local=20_000.0))
