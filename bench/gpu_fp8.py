"""Block-scaled FP8 export (`megatron-to-hf --fp8-blocks`) run by transformers' own FP8 kernels on a GPU.

transformers' FineGrainedFP8 path needs CUDA with compute capability >= 8.9 and every linear's input width a
multiple of 128, so the model here is a random DeepseekV3 sized for it. The FP8 model's logits are compared with
the bf16 model it came from (the kernels quantize activations too, so agreement is within FP8 round-off, not
exact), and with mconvert's own dequantization of the same file (hf-to-megatron reads it back)."""
import json
import subprocess
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, DeepseekV3Config, DeepseekV3ForCausalLM

work = Path(sys.argv[1] if len(sys.argv) > 1 else "/tmp/fp8g")
work.mkdir(parents=True, exist_ok=True)


def m(*args):
    subprocess.run([sys.executable, "-c", "from mconvert.cli import run; run()", *map(str, args)], check=True)


torch.manual_seed(0)
cfg = DeepseekV3Config(vocab_size=512, hidden_size=256, intermediate_size=512, moe_intermediate_size=128,
                       num_hidden_layers=3, num_attention_heads=2, num_key_value_heads=2, n_shared_experts=1,
                       n_routed_experts=4, num_experts_per_tok=2, first_k_dense_replace=1, q_lora_rank=128,
                       kv_lora_rank=128, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, n_group=1,
                       topk_group=1, max_position_embeddings=256, tie_word_embeddings=False)
ref = DeepseekV3ForCausalLM(cfg).to(torch.bfloat16)
with torch.no_grad():  # a non-zero expert bias so the router's correction is exercised
    for layer in ref.model.layers[1:]:
        layer.mlp.gate.e_score_correction_bias.normal_(0, 0.1)
ref.save_pretrained(work / "bf16")
if not (work / "meg").exists():
    m("hf-to-megatron", work / "bf16", work / "meg")
for name, extra in (("fp8", ["--fp8-blocks"]), ("back", [])):
    if not (work / name).exists():
        m("megatron-to-hf", work / "meg", work / name, *extra)
if not (work / "fp8-meg").exists():
    m("hf-to-megatron", work / "fp8", work / "fp8-meg")
if not (work / "fp8-deq").exists():
    m("megatron-to-hf", work / "fp8-meg", work / "fp8-deq")
print(json.dumps(json.loads((work / "fp8" / "config.json").read_text()).get("quantization_config")))

ids = torch.randint(0, cfg.vocab_size, (2, 48), generator=torch.Generator().manual_seed(1)).cuda()


def logits(path, **kw):
    model = AutoModelForCausalLM.from_pretrained(path, **kw).cuda().eval()
    with torch.no_grad():
        out = model(ids).logits.float()
    kinds = sorted({type(mod).__name__ for mod in model.modules() if "Linear" in type(mod).__name__})
    return out, kinds


base, _ = logits(work / "bf16", dtype=torch.bfloat16)
back, _ = logits(work / "back", dtype=torch.bfloat16)
fp8, kinds = logits(work / "fp8")
deq, _ = logits(work / "fp8-deq", dtype=torch.bfloat16)
print("fp8 model linears:", kinds)
assert "FP8Linear" in kinds, "transformers did not load the export as FP8"
rel = lambda a, b: ((a - b).norm() / b.norm()).item()  # noqa: E731
top1 = lambda a, b: (a.argmax(-1) == b.argmax(-1)).float().mean().item()  # noqa: E731
report = {"bf16 round trip max|d|": (back - base).abs().max().item(),
          "fp8 vs bf16 rel": rel(fp8, base), "fp8 vs bf16 top1": top1(fp8, base),
          "fp8 vs our dequant rel": rel(fp8, deq), "our dequant vs bf16 rel": rel(deq, base)}
print(json.dumps(report, indent=1))
ok = report["bf16 round trip max|d|"] == 0 and report["fp8 vs bf16 rel"] < 0.1 and report["fp8 vs our dequant rel"] < 0.1
print("FP8 GPU CHECK", "PASS" if ok else "FAIL")
sys.exit(0 if ok else 1)
