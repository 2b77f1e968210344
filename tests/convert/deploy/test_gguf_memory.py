"""GGUF of a mixture of experts: memory is bounded by one expert, not by one layer of experts.

llama.cpp stacks a layer's routed experts into one tensor per projection ([experts, out, in]); the GGUF writer
takes the layer as its dense part and one expert at a time and writes each expert's slice of the stacked
tensors at its offset; a final unit with an MoE MTP layer the file keeps comes a parameter at a time. Measured as
`test_moe_memory.py` measures the other verbs (`memory_probe`: a fresh process, a warm-up run, peak RSS over the
RSS before the verb) on one MoE layer of 8 and of 48 experts of the same width (6.3 MB each in fp32; the 48-expert
layer is 302 MB) — Mixtral's, and GLM-4.5's with its MoE MTP layer of as many experts: megatron-to-gguf from
TP=2 EP=2 rank files and hf-to-gguf of their HF export, at f32 and q8_0. The control runs the same hf-to-gguf with the writer fed whole
layers (`GgufWriter.splits_experts` off): its peak grows by about the 40 experts more, which is what the probe
would see if the writer held a layer; streamed, it grows by at most the output's write queue. The megatron-to-gguf file is the hf-to-gguf file of its export (every
tensor byte for byte, every key but the name, which is the source directory's).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from mconvert.convert.megatron.writer import megatron_writer
from mconvert.io import hashing
from mconvert.mappings.families import preset
from memory_probe import peak_over_baseline

pytestmark = pytest.mark.slow
H, F = 256, 2048
MANY = 48
EXPERT_BYTES = 3 * H * F * 4  # gate, up [F, H] and down [H, F] in fp32: 6.3 MB
SLACK = 32 << 20  # interpreter, allocator and page-cache noise between two runs of one verb
# the writes queued for the output file at most (`io.hashing.RandomDirectFile`'s staging queue): arrays kept
# alive until staged, as many at 8 experts as the layer has, up to this at more
QUEUE = hashing._SharedWrites.QUEUED

VERBS = r"""
from mconvert.convert.deploy import gguf


def whole_layers(s, o, **kw):  # the control: the writer fed whole MoE layers, as before it split them
    gguf.GgufWriter.splits_experts = False
    try:
        return verbs.to_gguf(s, o, "f32", verb="hf-to-gguf", **kw)
    finally:
        gguf.GgufWriter.splits_experts = True


TOK = mg + ".tok"
VERBS = {  # verb -> (its source, the call); megatron-to-hf first: it writes the hf-to-gguf source
    "megatron-to-hf": ("{mg}", lambda s, o, **kw: verbs.megatron_to_hf(s, o, tokenizer=TOK,
                                                                           max_shard_size="8MB", **kw)),
    "megatron-to-gguf": ("{mg}", lambda s, o, **kw: verbs.to_gguf(s, o, "f32", tokenizer=TOK, **kw)),
    "hf-to-gguf": ("{out}/megatron-to-hf", lambda s, o, **kw: verbs.to_gguf(s, o, "f32", verb="hf-to-gguf", **kw)),
    "hf-to-gguf q8_0": ("{out}/megatron-to-hf", lambda s, o, **kw: verbs.to_gguf(s, o, "q8_0", verb="hf-to-gguf",
                                                                                  **kw)),
    "hf-to-gguf, whole layers (control)": ("{out}/megatron-to-hf", whole_layers),
}
"""


# the model -> its one-layer spec of E experts of width F: Mixtral's layer; GLM-4.5's layer and MoE MTP layer, which
# the GGUF keeps (llama.cpp's nextn block), so its final unit holds as many experts as the layer
SPECS = {
    "mixtral": lambda e: preset("tiny-mixtral").replace(num_layers=1, hidden_size=H, ffn_hidden_size=F, num_experts=e,
                                                        num_attention_heads=4, num_query_groups=2, vocab_size=512),
    "glm4_moe with its MTP layer": lambda e: preset("tiny-glm45").replace(
        num_layers=1, moe_layer_freq=(1,), hidden_size=H, moe_ffn_hidden_size=F, moe_shared_expert_intermediate_size=F,
        num_experts=e, vocab_size=512),
}


def _ckpt(root: Path, model: str, experts: int) -> Path:
    """A TP=2 EP=2 Megatron checkpoint of `model` (`SPECS`), written one expert at a time, with a byte-level BPE
    tokenizer beside it (`.tok`)."""
    from mconvert.data import build_tokenizer, save_hf_tokenizer

    spec = SPECS[model](experts)
    w = megatron_writer(root, spec, tp=2, pp=1, ep=2)
    g = torch.Generator().manual_seed(experts)
    for unit in spec.units(split_experts=True):
        w.add(unit, {d.name: torch.randn(d.shape, generator=g) * 0.02 for d in spec.unit_params(unit)})
    w.close()
    save_hf_tokenizer(build_tokenizer(512), root.with_name(root.name + ".tok"))
    return root


def _contents(path: Path) -> tuple[dict, dict]:
    """(metadata but the name, which is the source directory's; tensor -> (shape, type, bytes)) as gguf-py
    reads them."""
    import gguf

    r = gguf.GGUFReader(path)
    meta = {k: f.contents() for k, f in r.fields.items() if k != "general.name"}
    return meta, {t.name: (tuple(t.shape), t.tensor_type, bytes(t.data)) for t in r.tensors}


@pytest.mark.timeout(900)
@pytest.mark.parametrize("model", SPECS)
def test_gguf_of_an_moe_layer_holds_one_expert_not_the_layer(tmp_path: Path, model: str) -> None:
    warm = _ckpt(tmp_path / "warm", model, 8)
    deltas: dict[str, dict[int, int]] = {}
    for experts in (8, MANY):
        out = tmp_path / f"out{experts}"
        same = ("megatron-to-gguf", "hf-to-gguf, whole layers (control)")  # the hf-to-gguf file every way
        mg = _ckpt(tmp_path / f"mg{experts}", model, experts)
        got = peak_over_baseline(VERBS, mg, warm, out, keep=("hf-to-gguf", *same))
        for verb, r in got.items():
            deltas.setdefault(verb, {})[experts] = r["delta"]
        want = _contents(out / "hf-to-gguf")
        for verb in same:
            assert _contents(out / verb) == want, (experts, verb)
        del want
        for p in (mg, out):  # GBs at 48 experts
            shutil.rmtree(p)
    print(f"\n{model}: peak RSS over baseline (MB), 8 vs {MANY} experts of 6.3 MB (the {MANY}-expert layer "
          f"{MANY * EXPERT_BYTES / 1e6:.0f} MB): "
          + ", ".join(f"{v} {d[8] / 1e6:.1f} vs {d[MANY] / 1e6:.1f}" for v, d in deltas.items()))
    more = (MANY - 8) * EXPERT_BYTES
    control = deltas.pop("hf-to-gguf, whole layers (control)")
    assert control[MANY] - control[8] > 0.8 * more, control  # the probe sees a layer held whole
    for verb, d in deltas.items():  # one expert at a time: the experts more cost at most the write queue more
        assert d[MANY] - d[8] < EXPERT_BYTES + SLACK + QUEUE < 0.8 * more, (verb, d)
