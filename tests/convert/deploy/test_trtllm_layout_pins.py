"""TensorRT-LLM rank files pinned tensor by tensor against truth mconvert did not write.

The values come from transformers' own models (`GPT2LMHeadModel`, `LlamaForCausalLM` with GQA and with MHA;
tiny, every parameter drawn from a fixed-seed generator, fp32). The layout comes from TensorRT-LLM's own
checkpoint converters (NVIDIA/TensorRT-LLM), re-derived here with plain torch indexing (no upstream code is
copied, and nothing is imported from mconvert's writer, layout tables or runner):

- `tensorrt_llm/models/convert_utils.py`: `split` / `split_matrix_tp` are `torch.chunk(v, tp, dim)[rank]`;
  `dup_kv_weight` repeats each KV head `tp // num_kv_heads` times in a row (head 0, head 0, head 1, ...);
  `split_qkv_tp` (MHA) reshapes the fused `[q; k; v]` to `[3, H, H]` and chunks the middle axis.
- `tensorrt_llm/models/llama/convert.py` `load_weights_from_hf_model`: `attention.qkv.weight` of rank r =
  cat(chunk_r(q_proj), chunk_r(dup(k_proj)), chunk_r(dup(v_proj))); `attention.dense` = o_proj chunked on
  dim 1; `get_prefix_and_param_name_map`: `mlp.fc` = gate_proj, `mlp.gate` = up_proj, `mlp.proj` = down_proj
  (fc/gate chunked on dim 0, proj on dim 1); `input_layernorm` / `post_layernorm` (= post_attention_layernorm)
  and `transformer.ln_f` (= model.norm) whole; `transformer.vocab_embedding` whole (use_parallel_embedding
  False); `lm_head` zero-padded to `pad_vocab_size(V, tp)` rows, then chunked on dim 0.
- `tensorrt_llm/models/gpt/convert.py` `load_weights_from_hf_model` (gpt_variant gpt2): every Conv1D weight
  transposed to `[out, in]`; `split_qkv` cuts the fused c_attn rows into q, k, v and takes the rank's chunk of
  each (bias alike); `split(..., is_column=False)` chunks c_proj weights on dim 1 and leaves their 1-D biases
  whole; c_fc weight and bias chunked on dim 0; `transformer.position_embedding` = wpe whole; `lm_head` from
  wte (share_embedding_table False), padded and chunked like LLaMA's.
- config.json: `LLaMAConfig.from_hugging_face` (`tensorrt_llm/models/llama/config.py`: rotary_scaling =
  hf rope_scaling verbatim, rotary_base = rope_theta, norm_epsilon = rms_norm_eps, head_size = head_dim) and
  `GPTConfig.from_hugging_face` (`tensorrt_llm/models/gpt/config.py`: norm_epsilon = layer_norm_epsilon,
  max_position_embeddings = n_positions, intermediate_size = n_inner or 4·n_embd, hidden_act =
  activation_function, num_key_value_heads = n_head), `architecture` = hf architectures[0].

Each model is saved by `save_pretrained` (safetensors), converted by `mconvert hf-to-megatron --tp 2 --pp 2`
and `mconvert megatron-to-trtllm --tp T`; every rank file, read with the `safetensors` package, must hold
exactly the upstream names, each tensor `torch.equal` (fp32) to the slice computed here.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers
from safetensors import safe_open

from mconvert.cli import main as cli_main

VOCAB = 1001  # odd: lm_head needs TensorRT-LLM's zero-row padding at every TP
LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 8192}


def _gpt2() -> transformers.PreTrainedModel:
    cfg = transformers.GPT2Config(n_embd=64, n_head=4, n_layer=2, n_positions=32, vocab_size=VOCAB,
                                  layer_norm_epsilon=1e-5, activation_function="gelu_new")
    return transformers.GPT2LMHeadModel(cfg)


def _llama(nkv: int, rope_theta: float, rope_scaling: dict) -> transformers.PreTrainedModel:
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=nkv, head_dim=16, vocab_size=VOCAB, max_position_embeddings=64,
                                   rms_norm_eps=1e-6, rope_theta=rope_theta, rope_scaling=dict(rope_scaling),
                                   tie_word_embeddings=False)
    return transformers.LlamaForCausalLM(cfg)


MODELS = {
    "gpt2": _gpt2,
    # 2 KV heads for 4 query heads: TP=2 gives each rank its own KV head, TP=4 duplicates each KV head
    "llama_gqa": lambda: _llama(2, 500000.0, LLAMA3_SCALING),
    # MHA takes llama/convert.py's other branch (split_qkv_tp)
    "llama_mha": lambda: _llama(4, 10000.0, {"rope_type": "linear", "factor": 4.0}),
}
CASES = [("gpt2", 2), ("llama_gqa", 2), ("llama_gqa", 4), ("llama_mha", 2)]


def _run(argv: list[str]) -> None:
    try:
        cli_main([str(a) for a in argv])
    except SystemExit as e:  # the entry exits only on failure
        raise AssertionError(f"mconvert {argv[0]} exited {e.code}") from e


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """name -> (transformers state_dict, its saved dir, Megatron checkpoint); (name, tp) -> TensorRT-LLM dir."""
    out: dict = {}
    for name, make in MODELS.items():
        tmp = tmp_path_factory.mktemp(f"pin_{name}")
        model = make().float().eval()
        g = torch.Generator().manual_seed(1234)
        with torch.no_grad():  # every tensor random (norms too), so any misplaced slice differs
            for p in model.parameters():
                p.copy_(torch.randn(p.shape, generator=g))
        model.save_pretrained(tmp / "hf", safe_serialization=True)
        sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
        _run(["hf-to-megatron", tmp / "hf", tmp / "mg", "--tp", "2", "--pp", "2"])
        out[name] = (sd, tmp / "hf", tmp / "mg")
    for name, tp in CASES:
        trt = out[name][2].parent / f"trt{tp}"
        _run(["megatron-to-trtllm", out[name][2], trt, "--tp", str(tp)])
        out[(name, tp)] = trt
    return out


# ---- the expected per-rank tensors, from the upstream converters' definitions --------------------------
def _chunk(x: torch.Tensor, tp: int, r: int, dim: int = 0) -> torch.Tensor:
    """convert_utils.split / split_matrix_tp and gpt/convert.py split: torch.chunk(x, tp, dim)[r]."""
    return torch.chunk(x, tp, dim=dim)[r]


def _padded_head(w: torch.Tensor, tp: int, r: int) -> torch.Tensor:
    """lm_head: zero rows up to _utils.pad_vocab_size(V, tp) = ceil(V / tp)·tp, then row chunk r."""
    rows = -(-w.shape[0] // tp) * tp
    padded = torch.cat([w, w.new_zeros(rows - w.shape[0], w.shape[1])])
    return _chunk(padded, tp, r)


def _heads(x: torch.Tensor, heads: list[int], hd: int) -> torch.Tensor:
    """The rows of the listed heads (each head = hd consecutive rows), in list order."""
    return torch.cat([x[h * hd:(h + 1) * hd] for h in heads])


def _kv_heads_of_rank(nkv: int, tp: int, r: int) -> list[int]:
    """llama/convert.py: with nkv < tp, dup_kv_weight lays KV head h out tp // nkv times in a row, so rank r's
    chunk is head r // (tp // nkv); otherwise rank r's chunk holds heads r·nkv/tp .. (r+1)·nkv/tp - 1."""
    if nkv < tp:
        return [r // (tp // nkv)]
    per = nkv // tp
    return list(range(r * per, (r + 1) * per))


def _expected_llama(sd: dict, cfg: transformers.PretrainedConfig, tp: int, r: int) -> dict[str, torch.Tensor]:
    nq, nkv, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    q_heads = list(range(r * nq // tp, (r + 1) * nq // tp))
    kv = _kv_heads_of_rank(nkv, tp, r)
    want = {"transformer.vocab_embedding.weight": sd["model.embed_tokens.weight"],
            "transformer.ln_f.weight": sd["model.norm.weight"],
            "lm_head.weight": _padded_head(sd["lm_head.weight"], tp, r)}
    for i in range(cfg.num_hidden_layers):
        h, t = f"model.layers.{i}.", f"transformer.layers.{i}."
        want[t + "attention.qkv.weight"] = torch.cat([_heads(sd[h + "self_attn.q_proj.weight"], q_heads, hd),
                                                      _heads(sd[h + "self_attn.k_proj.weight"], kv, hd),
                                                      _heads(sd[h + "self_attn.v_proj.weight"], kv, hd)])
        want[t + "attention.dense.weight"] = _chunk(sd[h + "self_attn.o_proj.weight"], tp, r, dim=1)
        want[t + "mlp.fc.weight"] = _chunk(sd[h + "mlp.gate_proj.weight"], tp, r)  # param_name_map: fc = gate_proj
        want[t + "mlp.gate.weight"] = _chunk(sd[h + "mlp.up_proj.weight"], tp, r)  # gate = up_proj
        want[t + "mlp.proj.weight"] = _chunk(sd[h + "mlp.down_proj.weight"], tp, r, dim=1)
        want[t + "input_layernorm.weight"] = sd[h + "input_layernorm.weight"]
        want[t + "post_layernorm.weight"] = sd[h + "post_attention_layernorm.weight"]
    return want


def _expected_gpt2(sd: dict, cfg: transformers.PretrainedConfig, tp: int, r: int) -> dict[str, torch.Tensor]:
    H = cfg.n_embd
    want = {"transformer.vocab_embedding.weight": sd["transformer.wte.weight"],
            "transformer.position_embedding.weight": sd["transformer.wpe.weight"],
            "transformer.ln_f.weight": sd["transformer.ln_f.weight"],
            "transformer.ln_f.bias": sd["transformer.ln_f.bias"],
            "lm_head.weight": _padded_head(sd["transformer.wte.weight"], tp, r)}
    for i in range(cfg.n_layer):
        h, t = f"transformer.h.{i}.", f"transformer.layers.{i}."
        qkv_w = sd[h + "attn.c_attn.weight"].t()  # Conv1D [in, out] -> Linear [out, in]; rows q | k | v
        qkv_b = sd[h + "attn.c_attn.bias"]
        want[t + "attention.qkv.weight"] = torch.cat([_chunk(qkv_w[j * H:(j + 1) * H], tp, r) for j in range(3)])
        want[t + "attention.qkv.bias"] = torch.cat([_chunk(qkv_b[j * H:(j + 1) * H], tp, r) for j in range(3)])
        want[t + "attention.dense.weight"] = _chunk(sd[h + "attn.c_proj.weight"].t(), tp, r, dim=1)
        want[t + "attention.dense.bias"] = sd[h + "attn.c_proj.bias"]  # row-parallel bias: whole
        want[t + "mlp.fc.weight"] = _chunk(sd[h + "mlp.c_fc.weight"].t(), tp, r)
        want[t + "mlp.fc.bias"] = _chunk(sd[h + "mlp.c_fc.bias"], tp, r)
        want[t + "mlp.proj.weight"] = _chunk(sd[h + "mlp.c_proj.weight"].t(), tp, r, dim=1)
        want[t + "mlp.proj.bias"] = sd[h + "mlp.c_proj.bias"]
        for ln, name in (("ln_1", "input_layernorm"), ("ln_2", "post_layernorm")):
            want[t + f"{name}.weight"] = sd[h + f"{ln}.weight"]
            want[t + f"{name}.bias"] = sd[h + f"{ln}.bias"]
    return want


def _expected(built: dict, name: str, tp: int, r: int) -> dict[str, torch.Tensor]:
    sd, hf, _ = built[name]
    cfg = transformers.AutoConfig.from_pretrained(hf)
    return (_expected_gpt2 if name == "gpt2" else _expected_llama)(sd, cfg, tp, r)


def _rank_file(trt: Path, r: int) -> dict[str, torch.Tensor]:
    with safe_open(trt / f"rank{r}.safetensors", "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


# ---- the pins -----------------------------------------------------------------------------------------
@pytest.mark.timeout(300)
@pytest.mark.parametrize("name,tp", CASES)
def test_every_rank_tensor_is_the_upstream_slice_of_the_transformers_model(built, name, tp) -> None:
    trt = built[(name, tp)]
    assert sorted(p.name for p in trt.glob("rank*.safetensors")) == [f"rank{r}.safetensors" for r in range(tp)]
    for r in range(tp):
        got, want = _rank_file(trt, r), _expected(built, name, tp, r)
        assert sorted(got) == sorted(want), f"rank {r}: names differ from TensorRT-LLM's converter"
        for k, w in want.items():
            assert got[k].dtype == torch.float32, f"rank {r} {k}: {got[k].dtype}"
            assert got[k].shape == w.shape, f"rank {r} {k}: shape {tuple(got[k].shape)} != {tuple(w.shape)}"
            assert torch.equal(got[k], w), f"rank {r} {k}: values are not TensorRT-LLM's slice"


@pytest.mark.timeout(300)
def test_kv_heads_are_duplicated_per_rank_when_tp_exceeds_them(built) -> None:
    """TP=4 over 2 KV heads: ranks 0 and 1 attend with KV head 0, ranks 2 and 3 with KV head 1, each rank's
    qkv rows = its 1 query head, then 1 K head, then 1 V head (dup_kv_weight + split)."""
    sd, _, _ = built["llama_gqa"]
    hd = 16
    k = sd["model.layers.1.self_attn.k_proj.weight"]
    v = sd["model.layers.1.self_attn.v_proj.weight"]
    q = sd["model.layers.1.self_attn.q_proj.weight"]
    for r in range(4):
        qkv = _rank_file(built[("llama_gqa", 4)], r)["transformer.layers.1.attention.qkv.weight"]
        assert qkv.shape == (3 * hd, 64)
        kv_head = r // 2
        assert torch.equal(qkv[:hd], q[r * hd:(r + 1) * hd])
        assert torch.equal(qkv[hd:2 * hd], k[kv_head * hd:(kv_head + 1) * hd])
        assert torch.equal(qkv[2 * hd:], v[kv_head * hd:(kv_head + 1) * hd])


@pytest.mark.parametrize("name,tp", CASES)
def test_config_json_is_what_from_hugging_face_stores(built, name, tp) -> None:
    """The fields TensorRT-LLM's GPTConfig / LLaMAConfig.from_hugging_face derive from the transformers config
    (AutoConfig of the saved model, as they read it) and Mapping(tp_size=tp, pp_size=1).to_dict()."""
    _, hf, _ = built[name]
    hc = transformers.AutoConfig.from_pretrained(hf)
    cfg = json.loads((built[(name, tp)] / "config.json").read_text())
    assert cfg["architecture"] == hc.architectures[0]
    assert cfg["dtype"] == "float32"
    assert cfg["vocab_size"] == hc.vocab_size == VOCAB  # unpadded: the padding lives in lm_head only
    assert cfg["mapping"]["tp_size"] == tp
    assert cfg["mapping"]["pp_size"] == 1
    assert cfg["mapping"]["world_size"] == tp
    assert cfg["use_parallel_embedding"] is False  # vocab_embedding whole on every rank
    if name == "gpt2":
        want = dict(hidden_size=hc.n_embd, num_attention_heads=hc.n_head, num_key_value_heads=hc.n_head,
                    num_hidden_layers=hc.n_layer, intermediate_size=hc.n_inner or 4 * hc.n_embd,
                    norm_epsilon=hc.layer_norm_epsilon, max_position_embeddings=hc.n_positions,
                    hidden_act=hc.activation_function, position_embedding_type="learned_absolute")
    else:
        want = dict(hidden_size=hc.hidden_size, num_attention_heads=hc.num_attention_heads,
                    num_key_value_heads=hc.num_key_value_heads, num_hidden_layers=hc.num_hidden_layers,
                    intermediate_size=hc.intermediate_size, head_size=hc.head_dim, norm_epsilon=hc.rms_norm_eps,
                    max_position_embeddings=hc.max_position_embeddings, hidden_act=hc.hidden_act,
                    position_embedding_type="rope_gpt_neox", rotary_base=hc.rope_theta,
                    rotary_scaling=hc.rope_scaling, tie_word_embeddings=hc.tie_word_embeddings)
        assert hc.rope_scaling["rope_type"] in ("llama3", "linear")  # the scaling under test reached the config
    for k, v in want.items():
        assert cfg.get(k) == v, f"config.json {k} = {cfg.get(k)!r}, TensorRT-LLM's from_hugging_face: {v!r}"
