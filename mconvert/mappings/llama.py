"""LLaMA plugin (shared by mistral and qwen2): canonical mcore names ⇄ HF Llama/Mistral/Qwen2 names."""

from mconvert.mappings.plugin import Plugin, Rule

L, H = "decoder.layers.*.", "model.layers.*."
QKV = (H + "self_attn.q_proj", H + "self_attn.k_proj", H + "self_attn.v_proj")
FC1 = (H + "mlp.gate_proj", H + "mlp.up_proj")

PLUGIN = Plugin(
    family="llama",
    table={
        "embedding.word_embeddings.weight": Rule(("model.embed_tokens.weight",), "vocab"),
        L + "input_layernorm.weight": Rule((H + "input_layernorm.weight",)),
        L + "self_attention.linear_qkv.weight": Rule(tuple(n + ".weight" for n in QKV), "qkv"),
        L + "self_attention.linear_qkv.bias": Rule(tuple(n + ".bias" for n in QKV), "qkv"),  # qwen2, llama bias
        L + "self_attention.linear_proj.weight": Rule((H + "self_attn.o_proj.weight",)),
        L + "self_attention.linear_proj.bias": Rule((H + "self_attn.o_proj.bias",)),
        L + "pre_mlp_layernorm.weight": Rule((H + "post_attention_layernorm.weight",)),
        L + "mlp.linear_fc1.weight": Rule(tuple(n + ".weight" for n in FC1), "gated"),
        L + "mlp.linear_fc1.bias": Rule(tuple(n + ".bias" for n in FC1), "gated"),
        L + "mlp.linear_fc2.weight": Rule((H + "mlp.down_proj.weight",)),
        L + "mlp.linear_fc2.bias": Rule((H + "mlp.down_proj.bias",)),
        "decoder.final_layernorm.weight": Rule(("model.norm.weight",)),
        "output_layer.weight": Rule(("lm_head.weight",), "vocab"),
    },
    hf_drops={
        H + "self_attn.rotary_emb.inv_freq": None,  # rotary buffer in older transformers saves
    },
)
