"""What FasterTransformer can hold: the one refusal that both `megatron-to-ft` and `plan --to ft` apply (a
layer below the writer, so the planner reaches it without importing the converter)."""

from __future__ import annotations

from mconvert.errors import MConvertError
from mconvert.mappings import families
from mconvert.mappings.record import FTLayout
from mconvert.spec import ModelSpec


def ft_layout(spec: ModelSpec, infer_tp: int, allow_approx_gelu: bool = False,
              option: str = "--infer-tp") -> FTLayout:
    """The FT section of a model FT can represent exactly at `infer_tp`; one-line refusal otherwise, naming
    `option`, the caller's flag for the inference TP (`plan` calls it --target-tp)."""
    spec.refuse_unmapped("FasterTransformer")
    nh, hd, H = spec.num_attention_heads, spec.head_dim, spec.hidden_size
    if infer_tp < 1:
        raise MConvertError(f"{option} must be >= 1 (got {infer_tp})")
    if nh * hd != H:
        raise MConvertError(
            f"FasterTransformer needs head_num·size_per_head = hidden ({nh}·{hd} != {H}); it cannot hold this model"
        )
    if nh % infer_tp:
        raise MConvertError(f"{option} {infer_tp} does not divide num_attention_heads={nh}; pick a divisor")
    if spec.ffn_hidden_size % infer_tp:
        raise MConvertError(f"{option} {infer_tp} does not divide ffn_hidden_size={spec.ffn_hidden_size}")
    layout = families.of(spec).ft
    if layout is None or not layout.holds(spec):
        raise MConvertError(
            f"FasterTransformer has no layout for {spec.normalization} + {spec.activation} + "
            f"{spec.position_embedding_type} positions ({spec.family}); supported: GPT-2 style and LLaMA style"
        )
    layout.refuse(spec, infer_tp, allow_approx_gelu)
    return layout
