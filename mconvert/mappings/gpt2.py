"""GPT-2 plugin: canonical mcore names ⇄ HF GPT2LMHeadModel names (Conv1D weights are stored [in, out])."""

from mconvert.mappings.plugin import Plugin, Rule

L, H = "decoder.layers.*.", "transformer.h.*."

PLUGIN = Plugin(
    family="gpt2",
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
