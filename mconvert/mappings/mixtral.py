"""The Mixtral family: HF `MixtralForCausalLM`, Mistral's attention with a routed SwiGLU MLP in every layer.

HF Mixtral's `block_sparse_moe` routes each token to `num_experts_per_tok` of `num_local_experts` experts: softmax
over the router logits, top-k, renormalised over the k — the function of megatron-core's default router (top-k
of the logits, softmax over the k). `intermediate_size` is each expert's width (Megatron's
`moe_ffn_hidden_size`). Expert weights are per expert: `experts.{e}.w1` (gate), `w3` (up), `w2` (down).
"""

from __future__ import annotations

from typing import Any, NamedTuple

from mconvert.errors import MConvertError
from mconvert.mappings import llama, mistral
from mconvert.mappings.record import Family, GgufLayout, Plugin, Rule
from mconvert.mappings.fields import INT, NEUTRAL, Field, mapped
from mconvert.spec import ModelSpec

NAME = "mixtral"
L, H = llama.L, llama.H
X = L + "mlp.experts.local_experts.*."

# LLaMA's attention and norms; the dense MLP rows are replaced by the router and the per-expert MLPs
# (the second `*` is the global expert index).
DENSE_MLP = ("mlp.linear_fc1.weight", "mlp.linear_fc1.bias", "mlp.linear_fc2.weight", "mlp.linear_fc2.bias")
ATTENTION_TABLE = {k: v for k, v in llama.TABLE.table.items() if k.removeprefix(L) not in DENSE_MLP}


class Experts(NamedTuple):
    """A routed SwiGLU MLP's HF names (templates after the layer prefix `H`; `*` in an expert's name is its
    index): the router's weight and each expert's gate, up and down projections. The families with one differ
    only in these names; `table` and `gguf` give their rows."""

    router: str
    gate: str
    up: str
    down: str

    def table(self) -> dict[str, Rule]:
        """The name-table rows: the router, each expert's gate and up as one gated fc1, its down as fc2."""
        return {
            L + "mlp.router.weight": Rule((H + self.router,)),
            X + "linear_fc1.weight": Rule((H + self.gate, H + self.up), "gated"),
            X + "linear_fc2.weight": Rule((H + self.down,)),
        }

    def gguf(self) -> dict[str, str]:
        """llama.cpp's rows: the router as `ffn_gate_inp`, the experts stacked [experts, out, in] as
        `ffn_{gate,up,down}_exps`."""
        return {
            H + self.router: "blk.*.ffn_gate_inp.weight",
            H + self.gate: "blk.*.ffn_gate_exps.weight",
            H + self.up: "blk.*.ffn_up_exps.weight",
            H + self.down: "blk.*.ffn_down_exps.weight",
        }


EXPERTS = Experts("block_sparse_moe.gate.weight",
                  *(f"block_sparse_moe.experts.*.{w}.weight" for w in ("w1", "w3", "w2")))

TABLE = Plugin(
    family=NAME,
    table={**ATTENTION_TABLE, **EXPERTS.table()},
    hf_drops=llama.TABLE.hf_drops,
)

# Every field of transformers 4.57's MixtralConfig beyond the common ones: Mistral's (RoPE fields, the
# sliding window) and the routing fields.
MOE_NEUTRAL = Field(NEUTRAL, "training only (router loss, router logits output, jitter noise applied in training)")
HF_FIELDS: dict[str, Field] = {
    **mistral.HF_FIELDS,  # intermediate_size: the experts' width, read as ffn_hidden_size (no other MLP)
    "num_local_experts": mapped("num_experts", INT),
    "num_experts_per_tok": mapped("moe_router_topk", INT),
    "router_aux_loss_coef": MOE_NEUTRAL,
    "output_router_logits": MOE_NEUTRAL,
    "router_jitter_noise": MOE_NEUTRAL,
}


def check_moe_style(spec: ModelSpec, architecture: str) -> None:
    """Refuse what an HF MoE class of this kind cannot compute: no experts, linear biases, rope variants."""
    llama.check_rope_style(spec, architecture, qk_norm=spec.qk_layernorm)
    if not spec.is_moe:
        raise MConvertError(f"HF {architecture} routes every layer's MLP over experts; this {spec.family}-family "
                            "model has no num_experts")
    if spec.has_qkv_bias or spec.add_bias_linear:
        raise MConvertError(f"HF {architecture} has no linear biases; this model has them; conversion refused")


def to_hf(spec: ModelSpec) -> dict[str, Any]:
    """MixtralConfig fields: expert count, top-k and expert width, the window (every layer; null for none); no
    q/k norm."""
    check_moe_style(spec, FAMILY.architecture)
    if spec.qk_layernorm:
        raise MConvertError(f"HF {FAMILY.architecture} has no per-head q/k norm and this model has "
                            "qk_layernorm=True; use the qwen3_moe family; conversion refused")
    return {**llama.rope_fields(spec), "intermediate_size": spec.expert_ffn_hidden_size,
            "sliding_window": llama.hf_sliding_window(spec),
            "num_local_experts": spec.num_experts, "num_experts_per_tok": spec.moe_router_topk,
            "router_jitter_noise": 0.0}


def from_hf(cfg: dict[str, Any], common: dict[str, Any], source: str) -> ModelSpec:
    """A MixtralConfig dict -> ModelSpec (no bias; every layer routed; MixtralConfig's window defaults to none)."""
    base = llama.rope_spec(cfg, common, add_bias_linear=False, add_qkv_bias=False, source=source)
    return base.replace(num_experts=int(cfg.get("num_local_experts", 8)),
                        moe_router_topk=int(cfg.get("num_experts_per_tok", 2)),
                        window_size=llama.window_from_hf(cfg.get("sliding_window"), source))


def recognise(fields: dict[str, Any]) -> bool:
    """Megatron args without model_family: experts without q/k norm are Mixtral-style."""
    return fields.get("num_experts") is not None and not fields["qk_layernorm"]


PRESETS = {
    # 4 experts, top-2, expert width 128 (HF Mixtral holds no other MLP width): EP 2 and 4 both divide them
    "tiny-mixtral": llama.rope_preset(NAME, num_layers=2, hidden_size=128, num_attention_heads=4,
                                      num_query_groups=2, ffn_hidden_size=128, vocab_size=1000,
                                      max_position_embeddings=128, num_experts=4, moe_router_topk=2),
    # DeepSeek-V3's routed sizes (its 58 MoE layers, 256 experts of width 2048, top-8, hidden 7168, vocab
    # 129280) in this family's layout: ~670 B parameters, for `plan` estimates from shapes only. DeepSeek-V3
    # itself (MLA, sigmoid router with expert bias, shared experts, dense first layers) is the deepseek_v3 family.
    "moe-671b": llama.rope_preset(NAME, num_layers=58, hidden_size=7168, num_attention_heads=128,
                                  num_query_groups=8, kv_channels=128, ffn_hidden_size=2048, vocab_size=129280,
                                  max_position_embeddings=4096, rotary_base=10000.0, params_dtype="bfloat16",
                                  num_experts=256, moe_router_topk=8),
}

# llama.cpp's LLAMA architecture with experts (convert_hf_to_gguf.py's LlamaModel takes MixtralForCausalLM):
# LLaMA's attention and norm names, the router as `ffn_gate_inp`, and every expert's w1 / w3 / w2 stacked
# [experts, out, in] into `ffn_gate_exps` / `ffn_up_exps` / `ffn_down_exps`; `feed_forward_length` is the
# experts' width. llama.cpp routes as HF Mixtral does: softmax, top-k, renormalised over the k.
DENSE_GGUF = tuple(H + f"mlp.{p}.{k}" for p in ("gate_proj", "up_proj", "down_proj") for k in ("weight", "bias"))
GGUF_TENSORS: dict[str, str] = {
    **{k: v for k, v in llama.GGUF_TENSORS.items() if k not in DENSE_GGUF},
    **EXPERTS.gguf(),
}
GGUF = GgufLayout(arch="llama", tensors=GGUF_TENSORS, permute_qk=True, rope_freqs=True)

FAMILY = Family(**llama.rope_family(
    NAME, "Mixtral", plugin=TABLE, hf_fields=HF_FIELDS, to_hf=to_hf, from_hf=from_hf, presets=PRESETS,
    recognise=recognise, recognise_order=6,
    ft=None,  # FasterTransformer has no MoE form here
    trtllm=None,  # no confirmed TensorRT-LLM MoE layout
    gguf=GGUF,
    hf_window="every",
    moe=True,
))
