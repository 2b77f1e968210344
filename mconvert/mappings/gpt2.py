"""The GPT-2 family: HF `GPT2LMHeadModel` ⇄ Megatron, and its FasterTransformer `[gpt]` and TensorRT-LLM GPT forms.

HF GPT-2 stores its linear weights as Conv1D `[in, out]`; its head is tied to `transformer.wte` (vLLM always
ties it, whatever the config says).
"""

from __future__ import annotations

from typing import Any


from mconvert.errors import MConvertError
from mconvert.mappings.record import (
    DeployRule,
    Family,
    check_qk_norm,
    FTFile,
    FTKernels,
    FTLayout,
    GgufLayout,
    Plugin,
    Rule,
    TiedHeadMessages,
    TrtllmLayout,
    VllmFacts,
)
from mconvert.mappings.fields import INT, NUM, STR, Field, mapped, neutral, refused
from mconvert.spec import ModelSpec

NAME = "gpt2"
L, H = "decoder.layers.*.", "transformer.h.*."

PLUGIN = Plugin(
    family=NAME,
    table={
        "embedding.word_embeddings.weight": Rule(("transformer.wte.weight",), "vocab"),
        "embedding.position_embeddings.weight": Rule(("transformer.wpe.weight",)),
        L + "input_layernorm.weight": Rule((H + "ln_1.weight",)),
        L + "input_layernorm.bias": Rule((H + "ln_1.bias",)),
        L + "self_attention.linear_qkv.weight": Rule((H + "attn.c_attn.weight",), "qkv_conv1d"),
        L + "self_attention.linear_qkv.bias": Rule((H + "attn.c_attn.bias",), "qkv_conv1d"),
        L + "self_attention.linear_proj.weight": Rule((H + "attn.c_proj.weight",), "transpose"),
        L + "self_attention.linear_proj.bias": Rule((H + "attn.c_proj.bias",)),
        L + "pre_mlp_layernorm.weight": Rule((H + "ln_2.weight",)),
        L + "pre_mlp_layernorm.bias": Rule((H + "ln_2.bias",)),
        L + "mlp.linear_fc1.weight": Rule((H + "mlp.c_fc.weight",), "transpose"),
        L + "mlp.linear_fc1.bias": Rule((H + "mlp.c_fc.bias",)),
        L + "mlp.linear_fc2.weight": Rule((H + "mlp.c_proj.weight",), "transpose"),
        L + "mlp.linear_fc2.bias": Rule((H + "mlp.c_proj.bias",)),
        "decoder.final_layernorm.weight": Rule(("transformer.ln_f.weight",)),
        "decoder.final_layernorm.bias": Rule(("transformer.ln_f.bias",)),
        # the last stage's copy of the tied embedding (PP > 1): HF ties lm_head to wte
        "output_layer.weight": Rule(("lm_head.weight",), "vocab"),
    },
    hf_drops={
        H + "attn.bias": None,  # causal-mask buffer
        H + "attn.masked_bias": None,
    },
)

# config.json fields of transformers 4.57's GPT2Config
HF_FIELDS: dict[str, Field] = {
    "n_embd": mapped("hidden_size", INT),
    "n_layer": mapped("num_layers", INT),
    "n_head": mapped("num_attention_heads", INT),
    "n_inner": mapped("ffn_hidden_size", INT),
    "n_positions": mapped("max_position_embeddings", INT),
    "layer_norm_epsilon": mapped("norm_epsilon", NUM),
    "activation_function": mapped("activation", STR, "gelu_new", ("gelu", "gelu_new")),
    **neutral(
        "training only, or the sequence-classification head (not part of GPT2LMHeadModel)",
        "n_ctx", "resid_pdrop", "embd_pdrop", "attn_pdrop", "summary_type", "summary_use_proj",
        "summary_activation", "summary_first_dropout", "summary_proj_to_labels",
    ),
    "scale_attn_weights": refused("unscaled attention scores are not mapped", True),
    "scale_attn_by_inverse_layer_idx": refused("per-layer attention scaling is not mapped", False),
    "reorder_and_upcast_attn": refused("reordered attention is not mapped", False),
}


# ---- HF config ⇄ ModelSpec ---------------------------------------------------------------------------
def to_hf(spec: ModelSpec) -> dict[str, Any]:
    """GPT2Config fields; refuses what GPT2LMHeadModel cannot compute."""
    if spec.normalization != "LayerNorm" or spec.gated or spec.position_embedding_type != "learned_absolute":
        raise MConvertError("a gpt2-family model needs LayerNorm, GeLU and learned absolute positions")
    if not spec.add_bias_linear:
        raise MConvertError("HF GPT-2 always has linear biases; this model has add_bias_linear=False")
    if spec.head_dim * spec.num_attention_heads != spec.hidden_size or spec.num_groups != spec.num_attention_heads:
        raise MConvertError("HF GPT-2 needs MHA with head_dim = hidden/heads")
    check_qk_norm(spec, FAMILY.architecture, False)
    return dict(
        n_embd=spec.hidden_size,
        n_layer=spec.num_layers,
        n_head=spec.num_attention_heads,
        n_inner=spec.ffn_hidden_size,
        n_positions=spec.max_position_embeddings,
        n_ctx=spec.max_position_embeddings,
        vocab_size=spec.vocab_size,
        layer_norm_epsilon=spec.norm_epsilon,
        activation_function=spec.activation,
        tie_word_embeddings=spec.tie_embeddings,
        scale_attn_weights=True,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )


def from_hf(cfg: dict[str, Any], common: dict[str, Any], source: str) -> ModelSpec:
    """A GPT2Config dict -> ModelSpec (`common`: the fields every family reads the same way)."""
    hidden = int(cfg["n_embd"])
    return ModelSpec(
        num_layers=int(cfg["n_layer"]),
        hidden_size=hidden,
        num_attention_heads=int(cfg["n_head"]),
        ffn_hidden_size=int(cfg.get("n_inner") or 4 * hidden),
        max_position_embeddings=int(cfg["n_positions"]),
        normalization="LayerNorm",
        norm_epsilon=float(cfg.get("layer_norm_epsilon", 1e-5)),
        activation=cfg.get("activation_function") or "gelu_new",  # its values are checked by the field table
        position_embedding_type="learned_absolute",
        add_bias_linear=True,
        # transformers' GPT2Config default is tied; an untied one keeps its own lm_head
        tie_embeddings=bool(cfg.get("tie_word_embeddings", True)),
        **common,
    )


def recognise(fields: dict[str, Any]) -> bool:
    """Megatron args without model_family: LayerNorm, no SwiGLU and learned positions are GPT-2."""
    return (fields["activation"] != "swiglu" and fields["normalization"] == "LayerNorm"
            and fields["position_embedding_type"] != "rope")


# ---- vLLM -----------------------------------------------------------------------------------------------
def _config_checks(cfg: dict[str, Any]) -> tuple[list[str], list[str]]:
    problems = []
    if cfg.get("tie_word_embeddings") is False:
        problems.append("tie_word_embeddings=false: vLLM always ties GPT-2's head to wte (untied GPT-2 head)")
    return problems, []


VLLM = VllmFacts(
    required={"n_positions": "max positions", "layer_norm_epsilon": "LayerNorm eps", "n_embd": "hidden",
              "n_head": "heads", "n_layer": "layers", "vocab_size": "vocab"},
    eps_key="layer_norm_epsilon",
    head_dim=lambda cfg: int(cfg.get("n_embd", 0)) // max(int(cfg.get("n_head", 1)), 1),
    config_checks=_config_checks,
    rope=False,
    always_ties_head=TiedHeadMessages(
        differs="untied GPT-2 head: lm_head.weight differs from transformer.wte.weight, but vLLM always ties "
                "GPT-2's head to wte — it would serve a different model",
        untied="untied GPT-2 head: tie_word_embeddings=false, but vLLM always ties GPT-2's head to wte",
        ok="GPT-2 head tied to wte (as vLLM serves it)",
    ),
    untied_export_warning="UNTIED GPT-2: vLLM always ties GPT-2's lm_head to wte, so this model will NOT be "
                          "served correctly by vLLM (transformers reads lm_head.weight)",
)


# ---- FasterTransformer [gpt] ----------------------------------------------------------------------------
def _ft_holds(spec: ModelSpec) -> bool:
    return (spec.normalization == "LayerNorm" and not spec.gated
            and spec.position_embedding_type == "learned_absolute")


def _ft_refuse(spec: ModelSpec, infer_tp: int, allow_approx_gelu: bool) -> None:
    if not spec.add_bias_linear:
        raise MConvertError(
            "FasterTransformer's GPT loader reads every linear bias; this model has add_bias_linear=False"
        )
    if spec.num_groups != spec.num_attention_heads:
        raise MConvertError("FasterTransformer's GPT layout is MHA only; this model uses grouped-query attention")
    if spec.activation == "gelu" and not allow_approx_gelu:
        raise MConvertError(
            "FasterTransformer's GPT computes only the tanh GeLU (HF gelu_new), this model uses the exact "
            "erf GeLU (Megatron without --openai-gelu); pass --allow-approx-gelu to write it anyway"
        )


def _ft_expected_files(cfg: dict[str, Any]) -> list[FTFile]:
    nh, hd = int(cfg["head_num"]), int(cfg["size_per_head"])
    H, F, L, V = nh * hd, int(cfg["inter_size"]), int(cfg["num_layer"]), int(cfg["vocab_size"])
    t = int(cfg["tensor_para_size"])
    files = [
        FTFile("model.wpe.bin", (int(cfg["max_pos_seq_len"]), H)),
        FTFile("model.wte.bin", (V, H)),
        FTFile("model.final_layernorm.bias.bin", (H,)),
        FTFile("model.final_layernorm.weight.bin", (H,)),
        FTFile("model.lm_head.weight.bin", (V, H), optional=True),
    ]
    for i in range(L):
        p = f"model.layers.{i}."
        files += [
            FTFile(p + "input_layernorm.bias.bin", (H,)),
            FTFile(p + "input_layernorm.weight.bin", (H,)),
            FTFile(p + "attention.dense.bias.bin", (H,)),
            FTFile(p + "post_attention_layernorm.bias.bin", (H,)),
            FTFile(p + "post_attention_layernorm.weight.bin", (H,)),
            FTFile(p + "mlp.dense_4h_to_h.bias.bin", (H,)),
        ]
        for r in range(t):
            files += [
                FTFile(p + f"attention.query_key_value.bias.{r}.bin", (3, H // t)),
                FTFile(p + f"mlp.dense_h_to_4h.bias.{r}.bin", (F // t,)),
                FTFile(p + f"attention.query_key_value.weight.{r}.bin", (H, 3, H // t)),
                FTFile(p + f"attention.dense.weight.{r}.bin", (H // t, H)),
                FTFile(p + f"mlp.dense_h_to_4h.weight.{r}.bin", (H, F // t)),
                FTFile(p + f"mlp.dense_4h_to_h.weight.{r}.bin", (F // t, H)),
            ]
    return files


_FT_L = "model.layers.*."
FT_FILES: dict[str, DeployRule | None] = {  # FT's converters: every 2-D weight `[in, out]`, QKV `[H, 3, H/t]`
    "embedding.word_embeddings.weight": DeployRule(("model.wte.bin",)),
    "embedding.position_embeddings.weight": DeployRule(("model.wpe.bin",)),
    L + "input_layernorm.weight": DeployRule((_FT_L + "input_layernorm.weight.bin",)),
    L + "input_layernorm.bias": DeployRule((_FT_L + "input_layernorm.bias.bin",)),
    L + "self_attention.linear_qkv.weight": DeployRule((_FT_L + "attention.query_key_value.weight.{r}.bin",),
                                                       "qkv_stack_t"),
    L + "self_attention.linear_qkv.bias": DeployRule((_FT_L + "attention.query_key_value.bias.{r}.bin",),
                                                     "qkv_stack_t"),
    L + "self_attention.linear_proj.weight": DeployRule((_FT_L + "attention.dense.weight.{r}.bin",), "split_t"),
    L + "self_attention.linear_proj.bias": DeployRule((_FT_L + "attention.dense.bias.bin",)),
    L + "pre_mlp_layernorm.weight": DeployRule((_FT_L + "post_attention_layernorm.weight.bin",)),
    L + "pre_mlp_layernorm.bias": DeployRule((_FT_L + "post_attention_layernorm.bias.bin",)),
    L + "mlp.linear_fc1.weight": DeployRule((_FT_L + "mlp.dense_h_to_4h.weight.{r}.bin",), "split_t"),
    L + "mlp.linear_fc1.bias": DeployRule((_FT_L + "mlp.dense_h_to_4h.bias.{r}.bin",), "split_t"),
    L + "mlp.linear_fc2.weight": DeployRule((_FT_L + "mlp.dense_4h_to_h.weight.{r}.bin",), "split_t"),
    L + "mlp.linear_fc2.bias": DeployRule((_FT_L + "mlp.dense_4h_to_h.bias.bin",)),
    "decoder.final_layernorm.weight": DeployRule(("model.final_layernorm.weight.bin",)),
    "decoder.final_layernorm.bias": DeployRule(("model.final_layernorm.bias.bin",)),
    # FT's GPT loader: a present lm_head file unties the head (a tied model declares no head, so none is written)
    "output_layer.weight": DeployRule(("model.lm_head.weight.bin",)),
}


FT = FTLayout(
    section="gpt",
    required_fields=(
        "model_name", "head_num", "size_per_head", "inter_size", "num_layer", "max_pos_seq_len", "vocab_size",
        "layernorm_eps", "start_id", "end_id", "weight_data_type", "tensor_para_size",
    ),
    holds=_ft_holds,
    refuse=_ft_refuse,
    expected_files=_ft_expected_files,
    files=FT_FILES,
    config_fields=lambda spec: dict(max_pos_seq_len=spec.max_position_embeddings, has_adapters=False,
                                    adapter_inter_size=0),
    kernels=FTKernels(embedding="model.wte.bin", positions="model.wpe.bin", norm="LayerNorm", biases=True,
                      mlp=("mlp.dense_h_to_4h", "mlp.dense_4h_to_h"), head_optional=True),
    model_name="gpt",
)


# ---- TensorRT-LLM GPT -----------------------------------------------------------------------------------
def _trt_refuse(spec: ModelSpec) -> None:
    if spec.activation != "gelu_new":
        raise MConvertError(
            "TensorRT-LLM's GPT computes the tanh GeLU; this model uses the exact erf GeLU (no --openai-gelu)"
        )
    if spec.num_groups != spec.num_attention_heads or not spec.add_bias_linear:
        raise MConvertError("GPT-2 style export needs MHA with linear biases")
    if spec.head_dim * spec.num_attention_heads != spec.hidden_size:
        raise MConvertError("TensorRT-LLM's GPT needs head_size = hidden/heads")


_T = "transformer.layers.*."
TRT_TENSORS: dict[str, DeployRule | None] = {  # TensorRT-LLM's GPT: Linear `[out, in]`
    "embedding.word_embeddings.weight": DeployRule(("transformer.vocab_embedding.weight",)),
    "embedding.position_embeddings.weight": DeployRule(("transformer.position_embedding.weight",)),
    L + "input_layernorm.weight": DeployRule((_T + "input_layernorm.weight",)),
    L + "input_layernorm.bias": DeployRule((_T + "input_layernorm.bias",)),
    L + "self_attention.linear_qkv.weight": DeployRule((_T + "attention.qkv.weight",), "qkv_cat"),
    L + "self_attention.linear_qkv.bias": DeployRule((_T + "attention.qkv.bias",), "qkv_cat"),
    L + "self_attention.linear_proj.weight": DeployRule((_T + "attention.dense.weight",), "split"),
    L + "self_attention.linear_proj.bias": DeployRule((_T + "attention.dense.bias",)),
    L + "pre_mlp_layernorm.weight": DeployRule((_T + "post_layernorm.weight",)),
    L + "pre_mlp_layernorm.bias": DeployRule((_T + "post_layernorm.bias",)),
    L + "mlp.linear_fc1.weight": DeployRule((_T + "mlp.fc.weight",), "split"),
    L + "mlp.linear_fc1.bias": DeployRule((_T + "mlp.fc.bias",), "split"),
    L + "mlp.linear_fc2.weight": DeployRule((_T + "mlp.proj.weight",), "split"),
    L + "mlp.linear_fc2.bias": DeployRule((_T + "mlp.proj.bias",)),
    "decoder.final_layernorm.weight": DeployRule(("transformer.ln_f.weight",)),
    "decoder.final_layernorm.bias": DeployRule(("transformer.ln_f.bias",)),
    "output_layer.weight": DeployRule(("lm_head.weight",), "vocab_padded"),
}


TRTLLM = TrtllmLayout(
    architecture="GPT2LMHeadModel",
    hidden_act=lambda spec: spec.activation,
    position_embedding_type="learned_absolute",
    config_fields=lambda spec: dict(gpt_variant="gpt2", bias=True, q_scaling=1.0, embedding_scale=None,
                                    apply_query_key_layer_scaling=False, rotary_pct=1.0, rotary_base=10000.0,
                                    rotary_scaling=None),
    refuse=_trt_refuse,
    tensors=TRT_TENSORS,
    aliases=("GPTForCausalLM",),
    norm="LayerNorm",
    gated=False,
    # TensorRT-LLM's ACT2FN maps each of these to its tanh-approximated gelu
    hidden_acts=("gelu_new", "gelu", "gelu_fast", "gelu_pytorch_tanh", "openai-gelu"),
    fixed={"gpt_variant": "gpt2", "q_scaling": 1.0, "embedding_scale": None, "apply_query_key_layer_scaling": False,
           "rotary_pct": 1.0},
    bias_keys=("bias", "bias"),
    bias_default=True,
)


# ---- presets --------------------------------------------------------------------------------------------
def _gpt2(**kw: Any) -> ModelSpec:
    return ModelSpec(family=NAME, activation="gelu_new", **kw)


PRESETS = {
    "tiny-gpt2": _gpt2(num_layers=2, hidden_size=64, num_attention_heads=2, ffn_hidden_size=256, vocab_size=1000,
                       max_position_embeddings=128),
    # ~100M parameters, for quick benchmarks
    "gpt2-100m": _gpt2(num_layers=12, hidden_size=768, num_attention_heads=12, ffn_hidden_size=3072,
                       vocab_size=50257, max_position_embeddings=1024),
    # ~1B parameters (~4 GB fp32), the `make bench` model; same shapes as GPT-2 XL's width
    "gpt2-1b": _gpt2(num_layers=16, hidden_size=2048, num_attention_heads=16, ffn_hidden_size=8192,
                     vocab_size=50257, max_position_embeddings=1024),
}

# ---- GGUF (llama.cpp) -----------------------------------------------------------------------------------
# llama.cpp's GPT2 architecture (convert_hf_to_gguf.py's GPT2Model): gguf-py's TensorNameMap names; the Conv1D
# weights ([in, out]) are written transposed, as llama.cpp reads [out, in]; a tied head is not written
# (llama.cpp then reads token_embd as the head).
GGUF_TENSORS: dict[str, str] = {
    "transformer.wte.weight": "token_embd.weight",
    "transformer.wpe.weight": "position_embd.weight",
    "transformer.ln_f.weight": "output_norm.weight",
    "transformer.ln_f.bias": "output_norm.bias",
    "lm_head.weight": "output.weight",
    **{H + f"{hf}.{kind}": f"blk.*.{gg}.{kind}" for hf, gg in (
        ("ln_1", "attn_norm"), ("attn.c_attn", "attn_qkv"), ("attn.c_proj", "attn_output"), ("ln_2", "ffn_norm"),
        ("mlp.c_fc", "ffn_up"), ("mlp.c_proj", "ffn_down")) for kind in ("weight", "bias")},
}


def _gguf_refuse(spec: ModelSpec) -> None:
    """llama.cpp's GPT2 graph applies tanh-approximated GeLU (HF's gelu_new) only."""
    if spec.activation != "gelu_new":
        raise MConvertError(f"activation {spec.activation!r} has no GGUF form: llama.cpp's gpt2 architecture applies "
                            "tanh-approximated GeLU (gelu_new) only; conversion refused")


# ggml-cpu's f32 GeLU rounds its input to f16 and reads its value from a table of f16 values
# (GGML_GELU_FP16), so even an f32 GPT-2 file computes at f16 precision in llama.cpp.
GGUF = GgufLayout(arch="gpt2", tensors=GGUF_TENSORS, permute_qk=False, refuse=_gguf_refuse,
                  transposed=frozenset(H + f"{m}.weight" for m in ("attn.c_attn", "attn.c_proj", "mlp.c_fc",
                                                                   "mlp.c_proj")),
                  compute_dtype="float16")


FAMILY = Family(
    name=NAME,
    architecture="GPT2LMHeadModel",
    model_type="gpt2",
    base_architecture="GPT2Model",
    plugin=PLUGIN,
    hf_fields=HF_FIELDS,
    to_hf=to_hf,
    from_hf=from_hf,
    vllm=VLLM,
    presets=PRESETS,
    recognise=recognise,
    recognise_order=0,
    ft=FT,
    trtllm=TRTLLM,
    gguf=GGUF,
)
