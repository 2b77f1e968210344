"""An instruct-style HF model directory written entirely by transformers' own `save_pretrained`: a tiny Llama
(GQA, pad id, an eos list in config.json), a slow-compatible GPT-2 BPE tokenizer with added and special tokens,
a default and a named chat template, and a generation config with an eos list and sampling defaults. Built once
per test process (the tokenizer tests and the vLLM tests share it)."""

from __future__ import annotations

import shutil
from functools import lru_cache
from pathlib import Path

import torch
from scratch import scratch_dir

WORK = scratch_dir("mconvert-tokens-", __name__)

CHAT = ("{{ bos_token }}{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
TOOL_CHAT = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
MESSAGES = [{"role": "system", "content": "You are a story teller."},
            {"role": "user", "content": "Tell me about the little fox and the river."}]
# Files of a saved model that are not tokenizer files
MODEL_FILES = {"config.json", "generation_config.json", "model.safetensors"}


@lru_cache(maxsize=None)
def instruct_hf() -> Path:
    """The directory (see the module docstring); trained weights are not needed: every check compares two
    runs of the same weights."""
    import transformers
    from mconvert.data import build_tokenizer

    out = WORK / "instruct-hf"
    raw = WORK / "bpe"
    raw.mkdir()
    build_tokenizer().save_model(str(raw))  # vocab.json + merges.txt of the shipped BPE
    tok = transformers.GPT2TokenizerFast(vocab_file=str(raw / "vocab.json"), merges_file=str(raw / "merges.txt"),
                                         bos_token="<|endoftext|>", eos_token="<|endoftext|>",
                                         unk_token="<|endoftext|>", pad_token="<|pad|>",
                                         additional_special_tokens=["<|im_start|>", "<|im_end|>"])
    tok.add_tokens(["<tool>", "</tool>"])  # ordinary added tokens (added_tokens.json in the slow form)
    tok.chat_template = {"default": CHAT, "tool_use": TOOL_CHAT}
    tok.save_pretrained(str(out))
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    cfg = transformers.LlamaConfig(
        vocab_size=len(tok), hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, bos_token_id=tok.bos_token_id,
        eos_token_id=[tok.eos_token_id, im_end], pad_token_id=tok.pad_token_id, tie_word_embeddings=False)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(cfg).save_pretrained(str(out))
    transformers.GenerationConfig(bos_token_id=tok.bos_token_id, eos_token_id=[tok.eos_token_id, im_end],
                                  pad_token_id=tok.pad_token_id, do_sample=True, temperature=0.6,
                                  top_p=0.9).save_pretrained(str(out))
    return out


@lru_cache(maxsize=None)
def chain() -> dict[str, Path]:
    """HF (transformers) -> Megatron TP2 PP2 -> HF, and the same checkpoint resharded to TP1 PP1 -> HF."""
    from mconvert.convert.verbs import hf_to_megatron, megatron_to_hf, reshard

    hf = instruct_hf()
    mg, mg1 = WORK / "mg-tp2pp2", WORK / "mg-tp1pp1"
    hf_to_megatron(hf, mg, tp=2, pp=2)
    reshard(mg, mg1, tp=1, pp=1)
    out, out1 = WORK / "hf-back", WORK / "hf-back-resharded"
    megatron_to_hf(mg, out)
    megatron_to_hf(mg1, out1)
    return {"hf": hf, "mg": mg, "mg1": mg1, "out": out, "out1": out1}


def tokenizer_file_names(d: Path) -> set[str]:
    """Every file of `d` that is not a model file (relative names, folders walked)."""
    return {str(p.relative_to(d)) for p in d.rglob("*") if p.is_file()} - MODEL_FILES


def model_and_tokenizer(tmp_path: Path) -> tuple[Path, Path]:
    """A copy of the instruct model (weights, config, generation config) and of its tokenizer, each in a
    directory of its own."""
    src = instruct_hf()
    hf, tok = tmp_path / "hf", tmp_path / "tok"
    hf.mkdir()
    for f in MODEL_FILES:
        shutil.copy(src / f, hf / f)
    shutil.copytree(src, tok, ignore=lambda d, names: [n for n in names if n in MODEL_FILES])
    return hf, tok
