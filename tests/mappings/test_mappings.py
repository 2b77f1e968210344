"""Mappings: pure layout transforms, wildcard registry, key normalization, plugin tables (both directions)."""

from __future__ import annotations

import pytest
import torch

from hf_ref import hf_model_shapes
from mconvert.errors import MConvertError
from mconvert.mappings import from_hf, hf_names, hf_unit, to_hf
from mconvert.mappings import transforms as T
from mconvert.mappings.keys import canonical_key, flatten
from mconvert.mappings.wildcards import Registry
from mconvert.mappings.families import hf_config, preset, presets
from mconvert.mappings.plugin import unit_hf_shapes


def test_qkv_separate_roundtrip_and_group_layout():
    nq, ng, hd, H = 8, 2, 3, 5
    q, k, v = torch.randn(nq * hd, H), torch.randn(ng * hd, H), torch.randn(ng * hd, H)
    fused = T.separate_to_qkv(q, k, v, nq, ng, hd)
    # per group: nq/ng query heads, then the group's key head, then its value head
    g1 = fused.view(ng, nq // ng + 2, hd, H)[1]
    assert torch.equal(g1[: nq // ng].reshape(-1, H), q[(nq // ng) * hd: 2 * (nq // ng) * hd])
    assert torch.equal(g1[nq // ng], k[hd:2 * hd]) and torch.equal(g1[-1], v[hd:])
    q2, k2, v2 = T.qkv_to_separate(fused, nq, ng, hd)
    assert torch.equal(q, q2) and torch.equal(k, k2) and torch.equal(v, v2)
    with pytest.raises(MConvertError, match="heads=8, groups=4"):
        T.qkv_to_separate(fused, nq, 4, hd)


def test_gpt2_conv1d_qkv_order():
    nh, hd = 4, 2
    H = nh * hd
    c_attn = torch.randn(H, 3 * H)  # HF Conv1D [in, out], out = [q | k | v], each [nh, hd]
    mc = T.conv1d_to_qkv(c_attn, nh, hd)
    assert mc.shape == (3 * H, H)
    # Megatron rows: head h -> [q_h, k_h, v_h]
    assert torch.equal(mc.view(nh, 3, hd, H)[2, 1], c_attn.t()[H + 2 * hd: H + 3 * hd])
    assert torch.equal(T.qkv_to_conv1d(mc, nh, hd), c_attn)
    bias = torch.randn(3 * H)
    assert torch.equal(T.qkv_to_conv1d(T.conv1d_to_qkv(bias, nh, hd), nh, hd), bias)


def test_gated_and_tp_split_are_per_rank_halves():
    gate, up = torch.arange(8.0).view(8, 1), 100 + torch.arange(8.0).view(8, 1)
    full = T.halves_to_gated(gate, up)
    shards = T.split(full, "gated", 2)
    assert torch.equal(shards[0], torch.cat([gate[:4], up[:4]]))  # [gate_r; up_r]
    assert torch.equal(T.merge(shards, "gated"), full)
    naive = torch.cat(shards).chunk(2)[0]  # the classic bug: cat ranks, then chunk
    assert not torch.equal(naive, gate)
    g2, u2 = T.gated_to_halves(full)
    assert torch.equal(g2, gate) and torch.equal(u2, up)


def test_vocab_pad_and_strip():
    t = torch.randn(10, 3)
    padded = T.pad_vocab(t, 16, 10)
    assert padded.shape == (16, 3) and torch.equal(padded[:10], t) and not padded[10:].any()
    stored = torch.randn(16, 3)
    assert T.pad_vocab(stored, 16, 10) is stored  # same padded size: rows kept as stored
    assert torch.equal(T.strip_vocab(stored, 10), stored[:10])
    with pytest.raises(MConvertError):
        T.strip_vocab(t, 11)


def test_registry_compiles_wildcards():
    reg = Registry({"decoder.layers.*.mlp.linear_fc1.weight": "a", "embedding.word_embeddings.weight": "b"})
    assert reg.match("decoder.layers.12.mlp.linear_fc1.weight") == ("decoder.layers.*.mlp.linear_fc1.weight", "a", 12)
    assert reg.match("embedding.word_embeddings.weight")[2] is None
    assert reg.match("decoder.layers.x.mlp.linear_fc1.weight") is None


@pytest.mark.parametrize("raw,canon", [
    ("decoder.layers.3.self_attention.linear_qkv.weight", "decoder.layers.3.self_attention.linear_qkv.weight"),
    ("decoder.layers.0.self_attention.linear_qkv.layer_norm_weight", "decoder.layers.0.input_layernorm.weight"),
    ("decoder.layers.0.mlp.linear_fc1.layer_norm_bias", "decoder.layers.0.pre_mlp_layernorm.bias"),
    ("language_model.embedding.word_embeddings.weight", "embedding.word_embeddings.weight"),
    ("language_model.encoder.layers.1.input_norm.weight", "decoder.layers.1.input_layernorm.weight"),
    ("language_model.transformer.layers.1.input_layernorm.bias", "decoder.layers.1.input_layernorm.bias"),
    ("language_model.encoder.layers.2.self_attention.query_key_value.bias", "decoder.layers.2.self_attention.linear_qkv.bias"),
    ("language_model.encoder.layers.2.self_attention.dense.weight", "decoder.layers.2.self_attention.linear_proj.weight"),
    ("language_model.encoder.layers.2.post_attention_norm.weight", "decoder.layers.2.pre_mlp_layernorm.weight"),
    ("language_model.encoder.layers.2.post_attention_layernorm.weight", "decoder.layers.2.pre_mlp_layernorm.weight"),
    ("language_model.encoder.layers.2.mlp.dense_h_to_4h.weight", "decoder.layers.2.mlp.linear_fc1.weight"),
    ("language_model.encoder.layers.2.mlp.dense_4h_to_h.bias", "decoder.layers.2.mlp.linear_fc2.bias"),
    ("language_model.encoder.final_norm.weight", "decoder.final_layernorm.weight"),
    ("language_model.encoder.final_layernorm.bias", "decoder.final_layernorm.bias"),
    ("language_model.output_layer.weight", "output_layer.weight"),
    ("word_embeddings_for_head.weight", "output_layer.weight"),
    ("decoder.layers.0.self_attention.linear_qkv._extra_state", None),
    ("decoder.layers.0.self_attention.core_attention._extra_state", None),
    ("decoder.layers.0.self_attention.rotary_pos_emb.inv_freq", None),
    ("language_model.encoder.layers.0.attention.masked_bias", None),
])
def test_every_key_spelling_normalizes(raw, canon):
    assert canonical_key(raw) == canon


def test_legacy_nested_dict_flattens():
    w = torch.zeros(2)
    nested = {"language_model": {"embedding": {"word_embeddings": {"weight": w}},
                                 "encoder": {"layers.0.self_attention.query_key_value.weight": w}},
              "word_embeddings_for_head": {"weight": w}}
    flat = flatten(nested)
    assert set(map(canonical_key, flat)) == {"embedding.word_embeddings.weight", "output_layer.weight",
                                             "decoder.layers.0.self_attention.linear_qkv.weight"}


@pytest.mark.parametrize("name", ["tiny-gpt2", "tiny-llama", "tiny-qwen2", "tiny-mistral"])
def test_plugin_to_hf_from_hf_roundtrip(name):
    """to_hf gives, unit by unit, exactly the names and shapes of transformers' own model for the preset's
    config (built on the meta device), and from_hf takes them back to the Megatron tensors."""
    spec = preset(name)
    want = hf_model_shapes(hf_config(spec))
    got: dict[str, tuple[int, ...]] = {}
    g = torch.Generator().manual_seed(0)
    for unit in ["embedding", *range(spec.num_layers), "final"]:
        decls = {"embedding": spec.embedding_params(), "final": spec.final_params()}.get(unit) or spec.layer_params(unit)
        mc = {d.name: torch.randn(d.shape, generator=g) for d in decls}
        hf = to_hf(spec, unit, mc)
        assert sorted(hf) == sorted(hf_names(spec, unit))
        assert {k: tuple(v.shape) for k, v in hf.items()} == {k: want.get(k) for k in hf}, unit
        got.update({k: tuple(v.shape) for k, v in hf.items()})
        assert all(hf_unit(spec, k) == unit for k in hf)
        back = from_hf(spec, unit, hf)
        for k, v in mc.items():
            if k == "embedding.word_embeddings.weight" or k == "output_layer.weight":
                v = v[: spec.vocab_size]
            assert torch.equal(back[k], v), k
    assert got == want


def test_unmapped_hf_key_is_an_error_naming_it():
    spec = preset("tiny-llama")
    with pytest.raises(MConvertError, match="model.layers.0.self_attn.q_norm.weight"):
        hf_unit(spec, "model.layers.0.self_attn.q_norm.weight", source="x.safetensors")
    assert hf_unit(spec, "model.layers.3.self_attn.rotary_emb.inv_freq") is None  # explicit drop


def test_rotary_interleaved_q_k_reordered_for_hf(monkeypatch):
    """Megatron rotary_interleaved=True, applied by megatron-core's own RoPE, gives the attention scores
    transformers' rotate_half RoPE gives on the converted q/k rows (and the unconverted rows do not)."""
    from megatron.core.models.common.embeddings import rope_utils as mcore_rope
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    nq, ng, hd, H, S = 4, 2, 8, 32, 7
    spec = preset("tiny-llama").replace(hidden_size=H, num_attention_heads=nq, num_query_groups=ng, kv_channels=hd,
                                        rotary_interleaved=True)
    g = torch.Generator().manual_seed(3)
    q_m, k_m, v_m = torch.randn(nq * hd, H, generator=g), torch.randn(ng * hd, H, generator=g), torch.randn(ng * hd, H)
    x = torch.randn(S, H, generator=g)

    rope = RotaryEmbedding(kv_channels=hd, rotary_percent=1.0, rotary_interleaved=True, rotary_base=10000,
                           use_cpu_initialization=True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: torch.device("cpu"))  # megatron-core on CPU
    emb = rope.get_emb(S)  # [S, 1, 1, hd], interleaved frequencies
    qm = mcore_rope._apply_rotary_pos_emb_bshd((x @ q_m.T).view(S, 1, nq, hd), emb, rotary_interleaved=True)
    km = mcore_rope._apply_rotary_pos_emb_bshd((x @ k_m.T).view(S, 1, ng, hd), emb, rotary_interleaved=True)
    want = torch.einsum("sbhd,tbhd->hst", qm, km.repeat_interleave(nq // ng, dim=2))

    cfg = LlamaConfig(hidden_size=H, num_attention_heads=nq, num_key_value_heads=ng, head_dim=hd)
    cos, sin = LlamaRotaryEmbedding(cfg)(x[None], torch.arange(S)[None])

    def hf_scores(q_w, k_w):
        q = (x @ q_w.T).view(1, S, nq, hd).transpose(1, 2)
        k = (x @ k_w.T).view(1, S, ng, hd).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        return (q @ k.repeat_interleave(nq // ng, dim=1).transpose(-1, -2))[0]

    fused = T.separate_to_qkv(q_m, k_m, v_m, nq, ng, hd)
    hf = to_hf(spec, 0, {**{d.name: torch.zeros(d.shape) for d in spec.layer_params(0)},
                         "decoder.layers.0.self_attention.linear_qkv.weight": fused})
    q_h, k_h = hf["model.layers.0.self_attn.q_proj.weight"], hf["model.layers.0.self_attn.k_proj.weight"]
    assert torch.allclose(hf_scores(q_h, k_h), want, atol=1e-4)
    assert not torch.allclose(hf_scores(q_m, k_m), want, atol=1e-2)  # without the reorder: wrong
    back = from_hf(spec, 0, hf)["decoder.layers.0.self_attention.linear_qkv.weight"]
    assert torch.equal(back, fused)


@pytest.mark.parametrize("name", [n for n in presets() if n.startswith("tiny-")])
def test_shape_rules_give_what_to_hf_gives(name):
    """`unit_hf_shapes` (the plugin's shape rules, what a GGUF header and a source's shape check are planned
    from without torch) names, orders and shapes every unit's HF tensors as `to_hf` makes them from meta
    tensors (`to_hf` itself is held to transformers' models in `test_plugin_to_hf_from_hf_roundtrip`)."""
    spec = preset(name)
    for unit in spec.units(False):
        mc = {d.name: torch.empty(d.shape, device="meta") for d in spec.unit_params(unit)}
        want = [(k, tuple(v.shape)) for k, v in to_hf(spec, unit, mc).items()]
        assert list(unit_hf_shapes(spec, unit).items()) == want, unit
