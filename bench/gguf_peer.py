"""The GGUF section of `make bench`: `hf-to-gguf` against llama.cpp's own `convert_hf_to_gguf.py` (kept in the
llama.cpp venv by `make gguf-env`), interleaved with `cp` of the same bytes, on Llama-style HF models written
here (random float16 weights, a SentencePiece tokenizer trained on the corpus: both converters read it as is).

A figure against a peer is a ratio measured in the same run, round by round (A B A B ...), so load from other
processes hits both sides alike; CPU seconds do not count the time a process waits for a core and are the
figure to trust on a loaded host.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from procmon import row_figures

# name -> (hidden, ffn, layers, heads, kv heads, vocab): a ~1.3 GB and a ~0.3 GB float16 Llama
MODELS = {
    "llama-1.3gb": (2048, 5632, 12, 16, 4, 32000),
    "llama-0.3gb": (1024, 2816, 8, 16, 4, 32000),
}
# (model, outtype) pairs timed; the targets: >= 3x at >= 1 GB, >= 2x at 0.3 GB
RUNS = (("llama-1.3gb", "f16"), ("llama-1.3gb", "q8_0"), ("llama-0.3gb", "f16"), ("llama-0.3gb", "q8_0"))
SPEEDUP_TARGET = {"llama-1.3gb": 3.0, "llama-0.3gb": 2.0}
SPM_VOCAB = 320
GB = 10**9

_BUILD = r"""
import json, sys
from pathlib import Path
import sentencepiece as spm, torch, transformers
from safetensors.torch import save_file
from mconvert.data import corpus_text
out, (h, f, n, heads, kv, vocab), spm_vocab = Path(sys.argv[1]), json.loads(sys.argv[2]), int(sys.argv[3])
out.mkdir(parents=True)
raw = out.parent / (out.name + "-spm")
raw.mkdir()
spm.SentencePieceTrainer.train(sentence_iterator=iter(corpus_text().splitlines()), model_prefix=str(raw / "sp"),
    model_type="bpe", vocab_size=spm_vocab, byte_fallback=True, normalization_rule_name="identity",
    remove_extra_whitespaces=False, add_dummy_prefix=True, split_digits=True, unk_id=0, bos_id=1, eos_id=2,
    pad_id=-1, num_threads=1, minloglevel=2)
transformers.LlamaTokenizerFast(vocab_file=str(raw / "sp.model"), legacy=True).save_pretrained(out)
cfg = transformers.LlamaConfig(hidden_size=h, intermediate_size=f, num_hidden_layers=n, num_attention_heads=heads,
    num_key_value_heads=kv, vocab_size=vocab, max_position_embeddings=4096, bos_token_id=1, eos_token_id=2,
    tie_word_embeddings=False, torch_dtype="float16", architectures=["LlamaForCausalLM"])
cfg.save_pretrained(out)
hd = h // heads
shapes = {"model.embed_tokens.weight": (vocab, h), "model.norm.weight": (h,), "lm_head.weight": (vocab, h)}
for i in range(n):
    p = f"model.layers.{i}."
    shapes.update({p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
                   p + "self_attn.q_proj.weight": (h, h), p + "self_attn.k_proj.weight": (kv * hd, h),
                   p + "self_attn.v_proj.weight": (kv * hd, h), p + "self_attn.o_proj.weight": (h, h),
                   p + "mlp.gate_proj.weight": (f, h), p + "mlp.up_proj.weight": (f, h),
                   p + "mlp.down_proj.weight": (h, f)})
g = torch.Generator().manual_seed(0)
sd = {k: (torch.randn(s, generator=g) * 0.02).half() for k, s in shapes.items()}
save_file(sd, str(out / "model.safetensors"), metadata={"format": "pt"})
"""


def converter(venv: Path | None = None) -> tuple[Path, Path] | None:
    """(the llama.cpp venv's interpreter, convert_hf_to_gguf.py), or None when `make gguf-env` has not kept it."""
    venv = venv or Path(os.environ.get("GGUF_VENV", Path.home() / ".cache" / "mconvert" / "gguf-venv"))
    script = venv / "llama.cpp-convert" / "convert_hf_to_gguf.py"
    return (venv / "bin" / "python", script) if script.is_file() else None


def build_model(name: str, dest: Path, layers: int | None = None) -> None:
    """A Llama-style HF model of MODELS[name] (at `layers` layers when given) at `dest` (in a child process: torch
    stays out of the bench's)."""
    dims = list(MODELS[name])
    dims[2] = layers or dims[2]
    r = subprocess.run([sys.executable, "-c", _BUILD, str(dest), json.dumps(dims), str(SPM_VOCAB)],
                       capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"bench: building {name} failed:\n{r.stderr[-2000:]}")


def command(op: str, src: Path, out: Path, mconvert: list[str]) -> list[str]:
    """`hf-to-gguf:OUTTYPE` (ours) or `llama.cpp:OUTTYPE` (the peer), writing OUT/model.gguf."""
    who, outtype = op.split(":")
    mk = ["sh", "-c", 'mkdir -p "$0" && exec "$@"', str(out)]
    if who == "hf-to-gguf":
        return [*mk, *mconvert, "hf-to-gguf", str(src), str(out / "model.gguf"), "--outtype", outtype]
    conv = converter()
    assert conv is not None
    return [*mk, str(conv[0]), str(conv[1]), str(src), "--outfile", str(out / "model.gguf"), "--outtype", outtype]


def figures(rows: dict[str, dict[str, Any]], src_bytes: dict[str, int]) -> dict[str, Any]:
    """Per (model, outtype): ours, the peer's and cp's wall s, CPU s, s/GB, × cp, and the peer's time over ours."""
    out = {}
    for model, outtype in RUNS:
        gbs = src_bytes[model] / GB
        cp = rows[f"cp {model}"]
        r = {"model": model, "outtype": outtype, "bytes": src_bytes[model]}
        for side, label in (("ours", f"hf-to-gguf {model} {outtype}"), ("peer", f"llama.cpp {model} {outtype}"),
                            ("cp", f"cp {model}")):
            r[side] = row_figures(rows[label], gbs, cp["wall_s"])
        r["speedup"] = r["peer"]["wall_s"] / r["ours"]["wall_s"]
        r["cpu_speedup"] = r["peer"]["cpu_s"] / r["ours"]["cpu_s"]
        r["target"] = SPEEDUP_TARGET[model]
        out[f"{model} {outtype}"] = r
    return out


# ---- per byte on the same Llama: megatron-to-hf, reshard, hf-to-megatron and hf-to-gguf at TP4 PP2 against cp ----
LLAMA_TP, LLAMA_PP = 4, 2
PER_BYTE_MODEL = "llama-1.3gb"
SHALLOW_LAYERS = 4  # the same width at this depth: the marginal cost per extra GB is the difference of the two
# verb -> (the cp row of its input, which input): Megatron-side verbs read the rank files, HF-side ones the HF dir
PER_BYTE_VERBS = {"megatron-to-hf": ("cp", "megatron"), "reshard": ("cp", "megatron"),
                  "hf-to-megatron": ("cp hf", "hf"), "hf-to-gguf": ("cp hf", "hf")}


def per_byte_jobs(hf: Path, ckpt: Path, tag: str = "") -> list[tuple[str, str, Path]]:
    """(label, op, src) rows of the per-byte section, each with the cp of its own input beside it; `tag` tells
    one depth's rows from another's."""
    return [(f"cp llama{tag} megatron", "cp", ckpt), (f"megatron-to-hf llama{tag}", "megatron-to-hf", ckpt),
            (f"reshard llama{tag}", "reshard", ckpt), (f"cp llama{tag} hf", "cp", hf),
            (f"hf-to-megatron llama{tag}", "hf-to-megatron", hf), (f"hf-to-gguf llama{tag}", "hf-to-gguf:f16", hf)]


def marginal_figures(lo: dict[str, Any], hi: dict[str, Any]) -> dict[str, Any]:
    """Per verb, from its `per_byte_figures` rows at two depths: wall and CPU seconds per extra GB of input
    (start-up cancels), cp's of the same input likewise, and the verb's as a multiple of cp's."""
    out = {}
    for verb in hi:
        extra = (hi[verb]["bytes"] - lo[verb]["bytes"]) / GB
        if extra <= 0:
            continue
        r = {f"{who}_{fig}_s_per_gb": (hi[verb][f"{who}_{fig}_s"] - lo[verb][f"{who}_{fig}_s"]) / extra
             for who in ("ours", "cp") for fig in ("wall", "cpu")}
        r["x_cp_wall"] = r["ours_wall_s_per_gb"] / r["cp_wall_s_per_gb"] if r["cp_wall_s_per_gb"] > 0 else float("inf")
        r["x_cp_cpu"] = r["ours_cpu_s_per_gb"] / r["cp_cpu_s_per_gb"] if r["cp_cpu_s_per_gb"] > 0 else float("inf")
        out[verb] = r
    return out


def per_byte_figures(rows: dict[str, dict[str, Any]], in_bytes: dict[str, int], tag: str = "") -> dict[str, Any]:
    """Per verb: wall and CPU s, both per GB of its input, and as multiples of cp's of the same input in the
    same run (wall and CPU)."""
    out = {}
    for verb, (cp_row, side) in PER_BYTE_VERBS.items():
        if f"{verb} llama{tag}" not in rows:
            continue
        gbs = in_bytes[side] / GB
        cp_label = f"cp llama{tag} megatron" if cp_row == "cp" else f"cp llama{tag} hf"
        r, cp = rows[f"{verb} llama{tag}"], rows[cp_label]
        out[verb] = {
            "bytes": in_bytes[side],
            **{f"{who}_{k}": x[k] for who, x in (("ours", r), ("cp", cp)) for k in ("wall_s", "cpu_s")},
            "ours_wall_s_per_gb": r["wall_s"] / gbs, "ours_cpu_s_per_gb": r["cpu_s"] / gbs,
            "cp_wall_s_per_gb": cp["wall_s"] / gbs, "cp_cpu_s_per_gb": cp["cpu_s"] / gbs,
            "x_cp_wall": r["wall_s"] / cp["wall_s"], "x_cp_cpu": r["cpu_s"] / max(cp["cpu_s"], 1e-9),
            "peak_rss": r["peak_rss"],
        }
    return out
