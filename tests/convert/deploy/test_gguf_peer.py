"""`hf-to-gguf` against llama.cpp's own `convert_hf_to_gguf.py` (kept in the llama.cpp venv by `make gguf-env`).

For every family both convert, a small random transformers model goes through both at f32 and f16: every tensor's name, shape, ggml type and bytes must be identical, and the metadata keys
and values too, except the keys in METADATA_DIFFERENCES (asserted exactly, so a new difference fails; the same
table is in docs/deployment/gguf.md). Skipped only when the llama.cpp venv is absent.

The models carry a SentencePiece `tokenizer.model`, except the families whose llama.cpp converter reads only a
byte-level BPE `tokenizer.json` (gpt2, qwen3_moe, deepseek_v3, glm4_moe): those carry the trainer's GPT-2-regex BPE
(with GLM's added special tokens, which the GLM converter looks up). The DeepSeek-V3 and GLM-4.5 models are the
`megatron-to-hf` exports of the trainer's tiny presets with every weight moved off its init (DeepSeek-V3 with and
without its YaRN rope scaling), so they hold the MTP layer transformers' classes leave out (deepseek2 skips it, glm4moe writes it as a `nextn` block). llama.cpp's
converter names a BPE pre-tokenizer by the hash of its output on a fixed text, known only for published
vocabularies, and refuses any other; for such a vocabulary alone the peer is handed the name mconvert reads
from the split regex ("gpt-2"), everything else it writes by its own code.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers
from scratch import scratch_dir
from validate_common import glm_tokenizer, moved_off_init_ckpt

from mconvert.convert.verbs import to_gguf
from mconvert.validators.gguf_runner import GGUF_VENV, STAMP

WORK = scratch_dir("mconvert-gguf-peer-", __name__)
PEER_DIR = "llama.cpp-convert"  # where gguf_env.sh keeps the converter inside the venv
OUTTYPES = ("f32", "f16")
SPM_VOCAB = 320
BPE_VOCAB = 1000
BPE_FAMILIES = ("gpt2", "qwen3_moe", "deepseek_v3", "deepseek_v3-yarn", "glm4_moe", "deepseek_v2", "qwen2_moe")
# family (or family-variant) -> the trainer preset (or it and changes to its spec) whose megatron-to-hf export is
# the model (DeepSeek-style: MLA,
# MoE and MTP; `-yarn`: DeepSeek-V3's YaRN, whose `yarn_log_multiplier` both write)
EXPORTED = {"deepseek_v3": "tiny-deepseek-v3", "deepseek_v3-yarn": "tiny-deepseek-v3-yarn", "glm4_moe": "tiny-glm45",
            # DeepSeek-V2-Lite's shape (no q LoRA, softmax router; 27 layers, which llama.cpp's deepseek2 reads as
            # without q LoRA) and Qwen2-MoE's (the gated shared expert)
            "deepseek_v2": ("tiny-deepseek-v2-lite", {"num_layers": 27, "moe_layer_freq": (0,) + (1,) * 26}),
            "qwen2_moe": "tiny-qwen2-moe"}

# family -> its transformers config (every family both mconvert's GGUF export and llama.cpp's converter handle)
_SMALL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              vocab_size=SPM_VOCAB, max_position_embeddings=64, bos_token_id=1, eos_token_id=2)
CONFIGS = {
    # n_ctx: what published GPT-2 configs carry and llama.cpp's converter reads for the context length
    "gpt2": lambda: transformers.GPT2Config(n_embd=64, n_layer=2, n_head=4, n_positions=64, n_ctx=64, vocab_size=BPE_VOCAB,
                                            bos_token_id=0, eos_token_id=0),
    "llama": lambda: transformers.LlamaConfig(**_SMALL, rope_theta=500000.0, tie_word_embeddings=False),
    # llama3 rope scaling: the generated rope_freqs.weight, every branch of its rule taken by one of the 8 pairs
    "llama3": lambda: transformers.LlamaConfig(**_SMALL, rope_theta=500000.0, tie_word_embeddings=False,
                                               rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                             "high_freq_factor": 4.0,
                                                             "original_max_position_embeddings": 8192}),
    "mistral": lambda: transformers.MistralConfig(**_SMALL, sliding_window=None, tie_word_embeddings=False),
    "mixtral": lambda: transformers.MixtralConfig(**_SMALL, num_local_experts=4, num_experts_per_tok=2,
                                                  sliding_window=None, tie_word_embeddings=False),
    "qwen2": lambda: transformers.Qwen2Config(**_SMALL, rope_theta=1000000.0, tie_word_embeddings=False),
    "qwen3": lambda: transformers.Qwen3Config(**_SMALL, head_dim=32, rope_theta=1000000.0, tie_word_embeddings=True),
    "qwen3_moe": lambda: transformers.Qwen3MoeConfig(**{**_SMALL, "vocab_size": BPE_VOCAB}, head_dim=32,
                                                     moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
                                                     decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True,
                                                     tie_word_embeddings=False),
    "gemma2": lambda: transformers.Gemma2Config(**{**_SMALL, "max_position_embeddings": 64}, head_dim=16,
                                                query_pre_attn_scalar=16, sliding_window=8,
                                                attn_logit_softcapping=50.0, final_logit_softcapping=30.0),
    # six layers: llama.cpp's gemma3 windows every layer but each 6th
    "gemma3": lambda: transformers.Gemma3TextConfig(**{**_SMALL, "num_hidden_layers": 6}, head_dim=16,
                                                    query_pre_attn_scalar=16, sliding_window=8,
                                                    rope_local_base_freq=10000.0, rope_theta=1000000.0),
}

ALL = tuple(CONFIGS) + tuple(EXPORTED)
SPM = tuple(f for f in CONFIGS if f not in BPE_FAMILIES)
# metadata key ({arch}: the architecture's prefix) -> (the families whose files differ there, at f32 and f16
# alike; why). "absent" is what llama.cpp reads for a key the file does not hold (llama-model.cpp /
# llama-vocab.cpp), the same value in every row below except the name keys, which llama.cpp does not run on.
METADATA_DIFFERENCES: dict[str, tuple[tuple[str, ...], str]] = {
    "general.name": (ALL, "mconvert writes the source directory's name as given; the converter rewrites it from "
                          "its metadata heuristics (`hf-llama` -> `Hf Llama`)"),
    "general.size_label": (ALL, "the converter adds a parameter-count label (`168K`) for its file naming; "
                                "mconvert writes none"),
    "tokenizer.ggml.add_bos_token": (BPE_FAMILIES, "the converter's gguf-py writes false from a tokenizer.json "
                                                   "whose post-processor adds nothing; mconvert's (gguf 0.19) "
                                                   "leaves the key out, read as the gpt-2 pre-tokenizer's default, "
                                                   "false"),
    "tokenizer.ggml.add_eos_token": (BPE_FAMILIES, "as add_bos_token; absent reads as false"),
    "tokenizer.ggml.add_space_prefix": (SPM, "mconvert carries the SentencePiece model's add_dummy_prefix; the "
                                             "converter leaves it out, read as true for a SentencePiece vocabulary "
                                             "(a model with add_dummy_prefix false is tokenized right only by "
                                             "mconvert's file)"),
    "{arch}.attention.head_count_kv": (("gpt2",), "mconvert writes it for every family; the GPT-2 converter "
                                                  "leaves it out, read as head_count"),
    "{arch}.attention.key_length": (("gpt2", "mistral", "mixtral", "qwen2"),
                                    "mconvert writes the head size for every family; these converters only "
                                    "where it is not hidden / heads, which is what absent reads as"),
    "{arch}.attention.value_length": (("gpt2", "mistral", "mixtral", "qwen2"), "as key_length"),
    "{arch}.rope.dimension_count": (("gemma2", "gemma3", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe"),
                                    "mconvert writes the rotary width; the Qwen and Gemma converters leave it out, "
                                    "read as the head size (the value written)"),
    "{arch}.rope.freq_base": (("gemma2",), "mconvert writes the config's rope_theta; the Gemma 2 converter leaves it "
                                           "out, read as 10000 (a Gemma 2 with another rope_theta is computed right "
                                           "only from mconvert's file)"),
    "{arch}.vocab_size": (("gemma2", "gemma3", "glm4_moe", "gpt2", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe"),
                          "mconvert writes it for every family; these converters leave it out, read as the token "
                          "list's length, which is the embedding's rows here"),
    "{arch}.expert_weights_norm": (("deepseek_v2",), "mconvert writes false for a router that does not renormalise "
                                                     "its top-k weights; the DeepSeek converter writes the key only "
                                                     "when true, and deepseek2 reads absent as false"),
}

# runs convert_hf_to_gguf.py as its own `__main__`; a BPE vocabulary whose hash it does not know gets argv[1]'s
# pre-tokenizer name instead of NotImplementedError
SHIM = """
import runpy, sys
from pathlib import Path
script, pre = Path(sys.argv[2]), sys.argv[1]
sys.path[:0] = [str(script.parent / "gguf-py"), str(script.parent)]
from conversion.base import TextModel
known = TextModel.get_vocab_base_pre
def named(self, tokenizer):
    try:
        return known(self, tokenizer)
    except NotImplementedError:
        return pre
TextModel.get_vocab_base_pre = named
sys.argv = sys.argv[2:]
runpy.run_path(str(script), run_name="__main__")
"""


# prints, for each llama3 rope scaling on stdin (JSON), the rope_freqs tensor the converter's own
# `LlamaModel.generate_extra_tensors` yields for it (hex of its float32 bytes)
ROPE_FREQS = """
import json, sys, types
from pathlib import Path
script = Path(sys.argv[1])
sys.path[:0] = [str(script.parent / "gguf-py"), str(script.parent)]
from conversion.llama import LlamaModel
out = []
for c in json.loads(sys.stdin.read()):
    me = types.SimpleNamespace(hparams={"head_dim": c["head_dim"]}, format_tensor_name=lambda t: t.name,
                               rope_parameters={"rope_type": "llama3", **{k: v for k, v in c.items() if k != "head_dim"}})
    (_, t), = LlamaModel.generate_extra_tensors(me)
    out.append(t.numpy().tobytes().hex())
print(json.dumps(out))
"""


@pytest.fixture(scope="session")
def peer() -> tuple[Path, Path]:
    """(the llama.cpp venv's interpreter, convert_hf_to_gguf.py); the test is skipped without the venv."""
    venv = Path(os.environ.get("GGUF_VENV", GGUF_VENV))
    if not (venv / STAMP).is_file():
        pytest.skip(f"no llama.cpp venv at {venv} (make gguf-env)")
    script = venv / PEER_DIR / "convert_hf_to_gguf.py"
    assert script.is_file(), f"{venv} predates the converter peer: run `make gguf-env` to top it up"
    return venv / "bin" / "python", script


@pytest.fixture(scope="session")
def spm_tokenizer() -> Path:
    """A SentencePiece BPE `tokenizer.model` trained on the corpus, saved by transformers' LlamaTokenizerFast."""
    import sentencepiece as spm

    from mconvert.data import corpus_text

    raw, d = WORK / "spm-raw", WORK / "spm-tok"
    raw.mkdir(parents=True, exist_ok=True)
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(corpus_text().splitlines()), model_prefix=str(raw / "sp"), model_type="bpe",
        vocab_size=SPM_VOCAB, byte_fallback=True, normalization_rule_name="identity", remove_extra_whitespaces=False,
        add_dummy_prefix=True, split_digits=True, unk_id=0, bos_id=1, eos_id=2, pad_id=-1, num_threads=1,
        minloglevel=2)
    transformers.LlamaTokenizerFast(vocab_file=str(raw / "sp.model"), legacy=True).save_pretrained(d)
    return d


@pytest.fixture(scope="session")
def bpe_tokenizer() -> Path:
    """The trainer's byte-level BPE (GPT-2's split regex) as transformers saves it."""
    from mconvert.data import build_tokenizer, save_hf_tokenizer

    d = WORK / "bpe-tok"
    save_hf_tokenizer(build_tokenizer(BPE_VOCAB), d)
    return d


@pytest.fixture(scope="session")
def models(spm_tokenizer, bpe_tokenizer) -> dict[str, Path]:
    """family -> a random model saved by transformers' `save_pretrained` (float32), the tokenizer beside it."""
    out = {}
    for family, cfg in CONFIGS.items():
        d = WORK / f"hf-{family}"
        torch.manual_seed(3)
        model = transformers.AutoModelForCausalLM.from_config(cfg(), dtype=torch.float32)
        model.save_pretrained(d, safe_serialization=True)
        for f in (bpe_tokenizer if family in BPE_FAMILIES else spm_tokenizer).iterdir():
            shutil.copy(f, d / f.name)
        out[family] = d
    from mconvert.convert.verbs import megatron_to_hf

    for family, name in EXPORTED.items():
        out[family] = WORK / f"hf-{family}"
        name, changes = name if isinstance(name, tuple) else (name, {})
        megatron_to_hf(moved_off_init_ckpt(name, **changes), out[family], tokenizer=glm_tokenizer())
    return out


def _read(path: Path) -> tuple[dict, dict]:
    """(metadata key -> value, tensor name -> (shape, ggml type, bytes)) of a GGUF, read by gguf-py."""
    import gguf

    r = gguf.GGUFReader(path)
    arch = r.fields["general.architecture"].contents()
    meta = {}
    for k, f in r.fields.items():
        if k.startswith("GGUF."):  # the header (version, counts) rather than metadata
            continue
        v = f.contents()
        # `{arch}.` for the architecture's own prefix: one table row covers the key in every family
        meta[k.replace(f"{arch}.", "{arch}.", 1) if k.startswith(f"{arch}.") else k] = \
            tuple(v) if isinstance(v, list) else v
    tensors = {t.name: (tuple(int(x) for x in t.shape), t.tensor_type.name, np.asarray(t.data).tobytes())
               for t in r.tensors}
    return meta, tensors


def _convert_both(peer, hf: Path, family: str, outtype: str) -> tuple[Path, Path]:
    ours, theirs = WORK / f"{family}-{outtype}-mconvert.gguf", WORK / f"{family}-{outtype}-llama.cpp.gguf"
    to_gguf(hf, ours, outtype, verb="hf-to-gguf")
    py, script = peer
    r = subprocess.run([str(py), "-c", SHIM, "gpt-2", str(script), str(hf), "--outfile", str(theirs), "--outtype", outtype],
                       capture_output=True, text=True, timeout=600, stdin=subprocess.DEVNULL)
    assert r.returncode == 0, f"convert_hf_to_gguf.py failed on {family}:\n{r.stderr[-3000:]}"
    return ours, theirs


@pytest.mark.gguf
@pytest.mark.timeout(1800)
def test_hf_to_gguf_writes_llama_cpp_converters_tensors_byte_for_byte(peer, models):
    differences: dict[str, dict[str, tuple]] = {}  # key -> "family outtype" -> (ours, theirs)
    for family, hf in models.items():
        for outtype in OUTTYPES:
            ours, theirs = _convert_both(peer, hf, family, outtype)
            (m_ours, t_ours), (m_theirs, t_theirs) = _read(ours), _read(theirs)
            where = f"{family} {outtype}"
            if family.endswith("-yarn"):  # the key both must write alike, and the scaling type it goes with
                assert m_theirs["{arch}.rope.scaling.yarn_log_multiplier"] > 0, where
                assert m_theirs["{arch}.rope.scaling.type"] == "yarn", where
            assert sorted(t_ours) == sorted(t_theirs), (where, set(t_ours) ^ set(t_theirs))
            for name, (shape, qtype, data) in t_theirs.items():
                assert t_ours[name][:2] == (shape, qtype), (where, name, t_ours[name][:2], (shape, qtype))
                assert t_ours[name][2] == data, f"{where}: {name} bytes differ"
            for k in sorted(set(m_ours) | set(m_theirs)):
                a, b = m_ours.get(k, "<absent>"), m_theirs.get(k, "<absent>")
                if a != b:
                    differences.setdefault(k, {})[where] = (a, b)
    got = {k: tuple(sorted({w.split()[0] for w in v})) for k, v in differences.items()}
    want = {k: tuple(sorted(fams)) for k, (fams, _) in METADATA_DIFFERENCES.items()}
    assert all(len(v) == 2 * len(got[k]) for k, v in differences.items()), "f32 and f16 differ differently"
    assert got == want, {k: (got.get(k), want.get(k), next(iter(differences.get(k, {"": None}).items())))
                         for k in set(got) | set(want) if got.get(k) != want.get(k)}


@pytest.mark.gguf
@pytest.mark.timeout(900)
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_a_half_precision_source_is_written_as_llama_cpp_writes_it(peer, models, dtype):
    """The float16 or bfloat16 checkpoint a user downloads, read as numpy arrays (bfloat16 as its raw bits): f16
    written as it is or narrowed, f32 widened, q8_0 quantized from its float32 values give the converter's
    bytes."""
    d = WORK / f"hf-llama-{dtype}"
    transformers.AutoModelForCausalLM.from_pretrained(models["llama"], dtype=getattr(torch, dtype)).save_pretrained(d)
    for f in (models["llama"]).iterdir():
        if not (d / f.name).exists():
            shutil.copy(f, d / f.name)
    for outtype in (*OUTTYPES, "q8_0"):
        ours, theirs = _convert_both(peer, d, f"llama-{dtype}", outtype)
        t_ours, t_theirs = _read(ours)[1], _read(theirs)[1]
        assert t_ours.keys() == t_theirs.keys()
        assert all(t_ours[k] == v for k, v in t_theirs.items()), \
            (outtype, [k for k, v in t_theirs.items() if t_ours[k] != v][:5])


@pytest.mark.gguf
@pytest.mark.timeout(1200)
@pytest.mark.parametrize("family", ["deepseek_v3", "glm4_moe"])
def test_deepseek_style_bf16_and_q8_0_are_llama_cpp_converters_bytes(peer, models, family):
    """The DeepSeek MoE families at bf16 and q8_0 (gguf-py's rounding and 32-blocks, the router, expert bias and
    norms kept F32, MLA's `attn_k_b` / `attn_v_b` and the stacked experts quantized): the converter's tensors byte
    for byte, and its metadata but for the rows of METADATA_DIFFERENCES."""
    allowed = {k.replace("{arch}.", "") for k, (fams, _) in METADATA_DIFFERENCES.items() if family in fams}
    for outtype in ("bf16", "q8_0"):
        ours, theirs = _convert_both(peer, models[family], family, outtype)
        (m_ours, t_ours), (m_theirs, t_theirs) = _read(ours), _read(theirs)
        assert t_ours.keys() == t_theirs.keys(), (outtype, set(t_ours) ^ set(t_theirs))
        assert {t[1] for t in t_theirs.values()} >= {"F32", outtype.upper()}, outtype  # both types are in play
        for name, theirs_t in t_theirs.items():
            assert t_ours[name][:2] == theirs_t[:2], (outtype, name, t_ours[name][:2], theirs_t[:2])
            assert t_ours[name][2] == theirs_t[2], f"{family} {outtype}: {name} bytes differ"
        differ = {k for k in set(m_ours) | set(m_theirs) if m_ours.get(k) != m_theirs.get(k)}
        assert {k.replace("{arch}.", "") for k in differ} <= allowed, (outtype, differ)


@pytest.mark.gguf
@pytest.mark.timeout(300)
def test_llama3_rope_freqs_are_the_converters_float32_steps(peer):
    """`rope_freqs.weight` (numpy, no torch) against the converter's own `generate_extra_tensors` (torch
    scalars) for Llama 3.1's and 3.2's published scalings and a grid of bases, head sizes, factors and bounds
    (a quotient like 4096 / 3.7 that float32 rounds before it is compared): every float32 step alike. The grid's
    head sizes give fewer pairs than a vector of torch's power kernel holds, so torch computes each with the C
    library's powf, as here (whole vectors go through SLEEF's, within 1 ulp of it)."""
    import types

    from mconvert.convert.deploy.gguf import rope_freqs

    published = [dict(head_dim=128, rope_theta=500000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                      original_max_position_embeddings=8192),
                 dict(head_dim=64, rope_theta=500000.0, factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
                      original_max_position_embeddings=8192)]
    grid = [dict(head_dim=d, rope_theta=b, factor=f, low_freq_factor=lo, high_freq_factor=hi,
                 original_max_position_embeddings=n)
            for d in (8, 16, 24, 30) for b in (10000.0, 500000.0, 1000000.0, 7.5e6) for f in (4.0, 8.0, 32.0)
            for lo, hi in ((1.0, 4.0), (1.5, 3.7)) for n in (2048, 4096, 8192)]
    configs = published + grid
    py, script = peer
    r = subprocess.run([str(py), "-c", ROPE_FREQS, str(script)], input=json.dumps(configs), capture_output=True,
                       text=True, timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]
    theirs = json.loads(r.stdout.strip().splitlines()[-1])
    branches = set()
    for c, want in zip(configs, theirs, strict=True):
        spec = types.SimpleNamespace(head_dim=c["head_dim"], rotary_base=c["rope_theta"], rope_scaling_factor=c["factor"],
                                     rope_low_freq_factor=c["low_freq_factor"],
                                     rope_high_freq_factor=c["high_freq_factor"],
                                     rope_original_max_position_embeddings=c["original_max_position_embeddings"])
        ours = rope_freqs(spec)
        assert ours.dtype == np.float32 and ours.tobytes().hex() == want, c
        branches |= {"1" if v == 1 else "factor" if v == c["factor"] else "smooth" for v in ours.tolist()}
    assert branches == {"1", "factor", "smooth"}
