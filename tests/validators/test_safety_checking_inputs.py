"""Crafted inputs to the checking verbs: GGUF headers for `verify` / `validate`, deployment configs that would
make the reference runners compute another model than the engine (FasterTransformer, TensorRT-LLM), a config
that states a coarser dtype than transformers computes in, torch_dist chunks that overlap and leave a gap, and
a tokenizer.json nested too deeply. Each is one line (or one ✗ line of a report), exit 1, never a pass.
"""

from __future__ import annotations

import io
import json
import pickle
import shutil
import struct
import time
from pathlib import Path

import pytest
import torch

from deploy_common import make_hf
from safety_common import assert_one_line_error, make_hf_llama, run_cli

from mconvert.mappings import families

# ---- GGUF headers, written byte by byte ---------------------------------------------------------------------
U32, STR, ARR, UINT8 = 4, 8, 9, 0


def _s(x: str | bytes) -> bytes:
    b = x.encode() if isinstance(x, str) else x
    return struct.pack("<Q", len(b)) + b


def _kv(key: str, vtype: int, raw: bytes) -> bytes:
    return _s(key) + struct.pack("<I", vtype) + raw


def _tensor(name: str, dims: list[int], ttype: int, offset: int) -> bytes:
    return (_s(name) + struct.pack("<I", len(dims)) + b"".join(struct.pack("<Q", d) for d in dims)
            + struct.pack("<IQ", ttype, offset))


def _gguf(kvs: list[bytes], tensors: list[bytes], data: bytes = b"", n_tensors: int | None = None,
          n_kv: int | None = None) -> bytes:
    head = b"GGUF" + struct.pack("<IQQ", 3, len(tensors) if n_tensors is None else n_tensors,
                                 len(kvs) if n_kv is None else n_kv) + b"".join(kvs) + b"".join(tensors)
    return head + b"\0" * (-len(head) % 32) + data


ARCH = _kv("general.architecture", STR, _s("llama"))
F32_TENSORS = [_tensor("a.weight", [8], 0, 0), _tensor("b.weight", [8], 0, 32)]  # 32 bytes each, apart

BAD_HEADERS = {
    "array_count_past_eof": (_gguf([ARCH, _kv("x", ARR, struct.pack("<IQ", UINT8, 1 << 62))], []), "'x'"),
    "tensor_count": (_gguf([ARCH], [], n_tensors=1 << 63), "tensors cannot fit"),
    "kv_count": (_gguf([ARCH], [], n_kv=1 << 63), "key/value pairs cannot fit"),
    "string_past_eof": (b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + _s("general.architecture")
                        + struct.pack("<IQ", STR, 1 << 40) + b"llama", "'general.architecture'"),
    "nested_array": (_gguf([ARCH, _kv("x", ARR, struct.pack("<IQ", ARR, 1) + struct.pack("<IQ", UINT8, 0))], []),
                     "array of ARRAY"),
    "unknown_value_type": (_gguf([ARCH, _kv("x", 99, b"\0" * 8)], []), "unknown value type 99"),
    "duplicate_key": (_gguf([ARCH, ARCH], []), "appears twice"),
    "alignment_zero": (_gguf([ARCH, _kv("general.alignment", U32, struct.pack("<I", 0))], []), "general.alignment"),
    "tensor_past_eof": (_gguf([ARCH], [_tensor("a.weight", [1 << 20], 0, 0)], b"\0" * 64), "past the end"),
    "tensors_overlap": (_gguf([ARCH], [_tensor("a.weight", [16], 0, 0), _tensor("b.weight", [8], 0, 32)],
                              b"\0" * 96), "overlap"),
    "misaligned": (_gguf([ARCH], [_tensor("a.weight", [8], 0, 4)], b"\0" * 64), "alignment"),
    "unknown_ggml_type": (_gguf([ARCH], [_tensor("a.weight", [8], 99, 0)], b"\0" * 64), "unknown ggml type 99"),
    "zero_dims": (_gguf([ARCH], [_tensor("token_embd.weight", [], 0, 0)], b"\0" * 64), "0 dimensions"),
    "big_endian": (b"GGUF" + struct.pack(">IQQ", 3, 0, 0), "big-endian"),
}


@pytest.mark.parametrize("case", sorted(BAD_HEADERS))
def test_crafted_gguf_header_is_one_line_at_once(case, tmp_path, capsys):
    """Counts, lengths and offsets are checked against the file's size before use: an array whose count runs
    past the end is refused at once (gguf-py's reader loops on it without end, its memory growing)."""
    blob, words = BAD_HEADERS[case]
    f = tmp_path / "m.gguf"
    f.write_bytes(blob)
    t0 = time.monotonic()
    code, out, err = run_cli(["verify", f], capsys)
    assert time.monotonic() - t0 < 20
    assert_one_line_error(code, err, str(f), "not a readable GGUF file", words)


def test_a_well_formed_header_reads(tmp_path):
    from mconvert.validators.gguf_runner import read_gguf_metadata

    f = tmp_path / "m.gguf"
    f.write_bytes(_gguf([ARCH, _kv("tokenizer.ggml.tokens", ARR, struct.pack("<IQ", STR, 2) + _s("a") + _s("b"))],
                        F32_TENSORS, b"\0" * 64))
    meta = read_gguf_metadata(f)
    assert meta["general.architecture"] == "llama" and meta["n_vocab"] == 2
    assert meta["tensors"] == {"a.weight": ((8,), "F32"), "b.weight": ((8,), "F32")}


def test_gguf_tolerance_follows_the_tensor_types_not_the_stated_file_type(tmp_path):
    """A file of f32 tensors that states `general.file_type` MOSTLY_Q8_0 is judged by the f32 row: the q8_0 row
    let a 1 %-perturbed f32 model pass `validate`."""
    from mconvert.validators.gguf_runner import gguf_dtype, read_gguf_metadata

    f = tmp_path / "m.gguf"
    f.write_bytes(_gguf([ARCH, _kv("general.file_type", U32, struct.pack("<I", 7))], F32_TENSORS, b"\0" * 64))
    meta = read_gguf_metadata(f)
    assert meta["file_type_name"] == "MOSTLY_Q8_0"
    assert gguf_dtype(meta) == "float32"


# ---- deployment configs the runners would compute differently ---------------------------------------------
@pytest.fixture(scope="module")
def deploy(tmp_path_factory) -> dict[str, Path]:
    """A tiny HF Llama with its TensorRT-LLM export, a tiny HF GPT-2 with its FasterTransformer export."""
    from mconvert.convert.verbs import megatron_to_ft
    from mconvert.convert.verbs import megatron_to_trtllm

    d = tmp_path_factory.mktemp("rt2-deploy")
    llama = make_hf_llama(d / "llama")
    megatron_to_trtllm(llama, d / "trt")
    gpt2 = make_hf(families.preset("tiny-gpt2"), d / "gpt2")
    megatron_to_ft(gpt2, d / "ft", infer_tp=1)
    return {"llama": llama, "trt": d / "trt", "gpt2": gpt2, "ft": next((d / "ft").glob("*-gpu"))}


TRT_EDITS = {
    "hidden_act": (lambda c: c.update(hidden_act="gelu"), "hidden_act"),
    "quant_algo": (lambda c: c["quantization"].update(quant_algo="W8A16"), "quantization.quant_algo"),
    "kv_cache_quant_algo": (lambda c: c["quantization"].update(kv_cache_quant_algo="INT8"),
                            "quantization.kv_cache_quant_algo"),
    "pp_size": (lambda c: c["mapping"].update(pp_size=2, world_size=2), "mapping.pp_size"),
    "num_experts": (lambda c: c["moe"].update(num_experts=4, top_k=2), "moe.num_experts"),
    "qk_layernorm": (lambda c: c.update(qk_layernorm=True), "qk_layernorm"),
    "position_embedding_type": (lambda c: c.update(position_embedding_type="rope_gptj"), "position_embedding_type"),
    "residual_mlp": (lambda c: c.update(residual_mlp=True), "residual_mlp"),
    "unknown_field": (lambda c: c.update(parallel_attention=True), "parallel_attention"),
}


@pytest.mark.parametrize("case", sorted(TRT_EDITS))
def test_trtllm_config_field_the_runner_does_not_compute_is_refused(case, deploy, tmp_path, capsys):
    """Each of these changes what TensorRT-LLM builds while the reference runner ignored it: `validate` passed."""
    edit, key = TRT_EDITS[case]
    trt = tmp_path / "trt"
    shutil.copytree(deploy["trt"], trt)
    (trt / "mconvert-manifest.json").unlink()
    cfg = json.loads((trt / "config.json").read_text())
    edit(cfg)
    (trt / "config.json").write_text(json.dumps(cfg))
    code, out, err = run_cli(["validate", deploy["llama"], trt, "--device", "cpu"], capsys)
    assert_one_line_error(code, err, str(trt / "config.json"), key)


FT_EDITS = {
    "activation_type": "activation_type = Relu",
    "layernorm_type": "layernorm_type = post_layernorm",
    "int8_mode": "int8_mode = 1",
    "has_positional_encoding": "has_positional_encoding = False",
    "use_attention_linear_bias": "use_attention_linear_bias = True",
    "has_post_decoder_layernorm": "has_post_decoder_layernorm = False",
    "unknown_field": "shared_embedding = 3",
}


@pytest.mark.parametrize("case", sorted(FT_EDITS))
def test_ft_config_field_the_runner_does_not_compute_is_refused(case, deploy, tmp_path, capsys):
    ft = tmp_path / deploy["ft"].name
    shutil.copytree(deploy["ft"], ft)
    ini = ft / "config.ini"
    ini.write_text(ini.read_text().replace("[gpt]\n", f"[gpt]\n{FT_EDITS[case]}\n", 1))
    code, out, err = run_cli(["validate", deploy["gpt2"], ft, "--device", "cpu", "--json"], capsys)
    [res] = json.loads(out)["results"]
    assert code == 1 and not res["passed"], out
    assert str(ini) in res["error"] and FT_EDITS[case].split()[0] in res["error"], res["error"]


def test_ft_export_with_every_field_mconvert_writes_still_checks(deploy):
    from mconvert.convert.deploy.fastertransformer import check_ft_dir

    assert check_ft_dir(deploy["ft"]) == []


def _trt_config(tmp_path: Path, preset: str, edit) -> Path:
    from mconvert.layouts.trtllm import trtllm_config

    cfg = json.loads(json.dumps(trtllm_config(families.preset(preset), 1, "float32")))  # as written on disk
    edit(cfg)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    return path


# fields that change nothing the runner computes, or are unset; each passes the checker
TRT_PASSES = {
    "quantization_options_while_quant_algo_null": ("tiny-llama", lambda c: c["quantization"].update(
        group_size=64, has_zero_point=True, exclude_modules=["lm_head"], quant_algo=None)),
    "moe_routing_while_no_experts": ("tiny-llama", lambda c: c["moe"].update(top_k=2, normalization_mode=1)),
    "other_parallel_sizes_at_one": ("tiny-llama", lambda c: c["mapping"].update(attn_tp_size=1, moe_cluster_size=1)),
    "parallel_flags_off": ("tiny-llama", lambda c: c["mapping"].update(enable_attention_dp=False, cp_config={})),
    "unknown_field_empty_object": ("tiny-llama", lambda c: c.update(producer={})),
    "unknown_field_empty_list": ("tiny-llama", lambda c: c.update(runtime_defaults=[])),
    "unknown_field_null_or_false": ("tiny-llama", lambda c: c.update(runtime_defaults=None, fp8_lm_head=False)),
    "another_tanh_gelu_name": ("tiny-gpt2", lambda c: c.update(hidden_act="gelu_pytorch_tanh")),
    "gpt_fixed_fields_absent": ("tiny-gpt2", lambda c: [c.pop(k) for k in ("gpt_variant", "q_scaling", "rotary_pct")]),
}


@pytest.mark.parametrize("case", sorted(TRT_PASSES))
def test_trtllm_config_field_that_changes_nothing_the_runner_computes_passes(case, tmp_path):
    from mconvert.convert.deploy.trtllm import read_trtllm_config

    preset, edit = TRT_PASSES[case]
    read_trtllm_config(_trt_config(tmp_path, preset, edit))


TRT_REFUSALS = {
    "unknown_field_non_empty_object": ("tiny-llama", lambda c: c.update(producer={"name": "modelopt"}), "producer"),
    "parallel_flag_on": ("tiny-llama", lambda c: c["mapping"].update(enable_attention_dp=True),
                         "mapping.enable_attention_dp"),
    "other_parallel_size": ("tiny-llama", lambda c: c["mapping"].update(attn_tp_size=2), "mapping.attn_tp_size"),
    "gpt_variant": ("tiny-gpt2", lambda c: c.update(gpt_variant="starcoder2"), "gpt_variant"),
    "q_scaling": ("tiny-gpt2", lambda c: c.update(q_scaling=0.5), "q_scaling"),
    "gated_act_for_gpt": ("tiny-gpt2", lambda c: c.update(hidden_act="silu"), "hidden_act"),
}


@pytest.mark.parametrize("key", ["hidden_act", "position_embedding_type"])
def test_trtllm_config_null_activation_or_positions_is_refused_by_name(key, tmp_path):
    """null leaves the choice to TensorRT-LLM's own default, not to what the runner computes: refused by name,
    where an absent or null field elsewhere in the table passes."""
    from mconvert.convert.deploy.trtllm import read_trtllm_config
    from mconvert.errors import MConvertError

    path = _trt_config(tmp_path, "tiny-llama", lambda c: c.update({key: None}))
    with pytest.raises(MConvertError) as e:
        read_trtllm_config(path)
    assert "\n" not in str(e.value) and str(e.value).startswith(f"{path}: {key}"), str(e.value)


@pytest.mark.parametrize("case", sorted(TRT_REFUSALS))
def test_trtllm_config_field_the_runner_does_not_read_is_refused_by_name(case, tmp_path):
    from mconvert.convert.deploy.trtllm import read_trtllm_config
    from mconvert.errors import MConvertError

    preset, edit, key = TRT_REFUSALS[case]
    path = _trt_config(tmp_path, preset, edit)
    with pytest.raises(MConvertError) as e:
        read_trtllm_config(path)
    line = str(e.value)
    assert "\n" not in line and line.startswith(f"{path}: TensorRT-LLM field {key}="), line
    if case == "parallel_flag_on":  # the value as config.json spells it
        assert f"{key}=true " in line, line
    assert line.endswith("validation refused — re-export it with `mconvert megatron-to-trtllm`"), line


def _ft_section(preset: str) -> tuple[str, dict[str, str]]:
    from mconvert.convert.deploy.fastertransformer import ft_config

    section = {"tiny-gpt2": "gpt", "tiny-llama": "llama"}[preset]
    return section, dict(ft_config(families.preset(preset), section, 1, "fp32", "src")[section])


FT_TRUE, FT_FALSE = ("true", "True", "1", "yes", "ON", " on "), ("false", "FALSE", "0", "no", "off", "", "None", "null")


@pytest.mark.parametrize("field,at,other", [
    ("has_positional_encoding", FT_TRUE, FT_FALSE), ("has_post_decoder_layernorm", FT_TRUE, FT_FALSE),
    ("has_pre_decoder_layernorm", FT_FALSE, FT_TRUE), ("use_attention_linear_bias", FT_FALSE, FT_TRUE),
    ("use_gptj_residual", FT_FALSE, FT_TRUE), ("has_adapters", FT_FALSE, FT_TRUE),
    ("int8_mode", FT_FALSE, FT_TRUE), ("prompt_learning_type", FT_FALSE, FT_TRUE),
])
def test_ft_boolean_field_passes_at_its_value_in_every_spelling_and_not_at_the_other(field, at, other):
    from mconvert.convert.deploy.fastertransformer import check_ft_fields

    section, cfg = _ft_section("tiny-gpt2")
    ini = Path("/ft/1-gpu/config.ini")
    for spelling in at:
        assert check_ft_fields(section, {**cfg, field: spelling}, ini) == [], spelling
    for spelling in other:
        [problem] = check_ft_fields(section, {**cfg, field: spelling}, ini)
        assert problem.startswith(f"{ini} [gpt]: FasterTransformer field {field}={spelling.strip()} "), problem
        assert problem.endswith("validation refused — re-export the directory"), problem


@pytest.mark.parametrize("preset,act,other", [("tiny-gpt2", "GeLU", "silu"), ("tiny-llama", "SiLU", "gelu")])
def test_ft_activation_type_is_the_one_the_section_mlp_computes(preset, act, other):
    """FT's LLaMA MLP is SiLU-gated whatever activation_type says, GPT's is tanh-GeLU: the other name is refused."""
    from mconvert.convert.deploy.fastertransformer import check_ft_fields

    section, cfg = _ft_section(preset)
    ini = Path("/ft/1-gpu/config.ini")
    assert check_ft_fields(section, {**cfg, "activation_type": act}, ini) == []
    [problem] = check_ft_fields(section, {**cfg, "activation_type": other}, ini)
    assert f"[{section}]: FasterTransformer field activation_type={other} " in problem, problem  # as written


@pytest.mark.parametrize("value,passes", [("0", True), ("", True), ("off", True), ("3", False), ("on", False)])
def test_ft_unknown_field_passes_only_unset(value, passes):
    from mconvert.convert.deploy.fastertransformer import check_ft_fields

    section, cfg = _ft_section("tiny-gpt2")
    problems = check_ft_fields(section, {**cfg, "shared_embedding": value}, Path("/ft/1-gpu/config.ini"))
    assert (problems == []) == passes, problems
    assert passes or "shared_embedding=" in problems[0]


def test_hf_config_stating_a_coarser_dtype_than_transformers_computes_in_is_judged_by_the_computed_one(
        deploy, tmp_path, capsys):
    """`torch_dtype: bfloat16` beside `dtype: float32`: transformers computes in float32 (`dtype` wins), so the
    float32 row applies; the bf16 row let a 1 %-perturbed model pass."""
    from safetensors.torch import load_file, save_file

    hf = tmp_path / "hf"
    shutil.copytree(deploy["llama"], hf)
    f = hf / "model.safetensors"
    g = torch.Generator().manual_seed(0)
    state = {k: (v * (1 + 0.01 * torch.randn(v.shape, generator=g)) if v.dim() == 2 and "layers" in k else v)
             for k, v in load_file(f).items()}
    save_file(state, f, metadata={"format": "pt"})
    cfg = json.loads((hf / "config.json").read_text())
    cfg.update(torch_dtype="bfloat16", dtype="float32")
    (hf / "config.json").write_text(json.dumps(cfg))
    code, out, err = run_cli(["validate", deploy["llama"], hf, "--device", "cpu", "--json"], capsys)
    [res] = json.loads(out)["results"]
    assert code == 1 and not res["passed"] and res["dtype"] == "float32", res


# ---- torch_dist chunks ------------------------------------------------------------------------------------------
def test_torch_dist_chunks_that_overlap_and_leave_a_gap_are_refused(deploy, tmp_path, capsys):
    """Chunk sizes summing to the tensor's size do not prove coverage: [0, H-1) and [H-2, H-1) sum to H and leave
    element H-1 as `torch.empty` left it; megatron-to-hf converted it (exit 0)."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex

    from mconvert.convert.verbs import hf_to_megatron

    dist = tmp_path / "dist"
    hf_to_megatron(deploy["llama"], dist, format="torch_dist")
    (dist / "mconvert-manifest.json").unlink()
    d = dist / "release"
    (d / "integrity.json").unlink()  # as Megatron-LM writes it without --verify-integrity
    md = pickle.loads((d / ".metadata").read_bytes())  # the test's own file, written just above
    key = "decoder.final_layernorm.weight"
    tmd = md.state_dict_metadata[key]
    [idx] = [i for i in md.storage_data if i.fqn == key]
    info = md.storage_data.pop(idx)
    raw = (d / info.relative_path).read_bytes()[info.offset:info.offset + info.length]
    full = torch.load(io.BytesIO(raw), weights_only=True)
    h = full.numel()
    blob, chunks = b"", []
    for start, t in ((0, full[:h - 1].clone()), (h - 2, full[h - 2:h - 1].clone())):
        buf = io.BytesIO()
        torch.save(t, buf)
        chunks.append((start, t.numel(), len(blob), len(buf.getvalue())))
        blob += buf.getvalue()
    (d / "__extra.distcp").write_bytes(blob)
    tmd.chunks = [ChunkStorageMetadata(offsets=torch.Size([o]), sizes=torch.Size([n])) for o, n, _, _ in chunks]
    for o, _, at, n in chunks:
        md.storage_data[MetadataIndex(fqn=key, offset=torch.Size([o]), index=None)] = _StorageInfo(
            relative_path="__extra.distcp", offset=at, length=n)
    (d / ".metadata").write_bytes(pickle.dumps(md))
    out_dir = tmp_path / "out"
    code, out, err = run_cli(["megatron-to-hf", dist, out_dir], capsys)
    assert_one_line_error(code, err, str(d / ".metadata"), key, "overlap")
    assert not out_dir.exists() and not list(tmp_path.glob(".out.mconvert-tmp-*"))


@pytest.fixture(scope="module")
def dist_llama(deploy, tmp_path_factory) -> Path:
    """A torch_dist checkpoint of the deploy llama, without either manifest (as Megatron-LM writes it without
    --verify-integrity: an edited `.metadata` is then not caught as changed bytes)."""
    from mconvert.convert.verbs import hf_to_megatron

    dist = tmp_path_factory.mktemp("dist-lie") / "dist"
    hf_to_megatron(deploy["llama"], dist, format="torch_dist")
    (dist / "mconvert-manifest.json").unlink()
    (dist / "release" / "integrity.json").unlink()
    return dist


@pytest.mark.parametrize("declared", [torch.int64, torch.float16, torch.bfloat16, None],
                         ids=["int64", "float16", "bfloat16", "as saved"])
@pytest.mark.parametrize("verb", ["reshard", "megatron-to-hf", "megatron-to-hf --dtype fp32"])
def test_torch_dist_metadata_declaring_another_dtype_than_its_chunks_is_refused(dist_llama, tmp_path, capsys,
                                                                              declared, verb):
    """`.metadata` says a float32 weight is int64 / float16 / bf16: DCP's reader copies each saved chunk into a
    tensor of the declared dtype, converting it silently (int64: zeros) — `reshard` wrote that under a fresh
    manifest with exit 0. The chunk's own dtype must be the declared one; the intact file converts."""
    dist = Path(shutil.copytree(dist_llama, tmp_path / "dist"))
    md_file = dist / "release" / ".metadata"
    key = "decoder.layers.mlp.linear_fc2.weight"
    if declared is not None:
        md = pickle.loads(md_file.read_bytes())  # the test's own file, written by the fixture
        assert md.state_dict_metadata[key].properties.dtype == torch.float32
        md.state_dict_metadata[key].properties.dtype = declared
        md_file.write_bytes(pickle.dumps(md))
    name, *extra = verb.split()
    argv = [name, dist, tmp_path / "out", *extra] + (["--tp", "1"] if name == "reshard" else [])
    code, _, err = run_cli(argv, capsys)
    if declared is None:
        assert code == 0, err
        return
    assert_one_line_error(code, err, str(md_file), key, f"declared {declared}", "holds torch.float32", "re-copy")
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out.mconvert-tmp-*"))


# ---- tokenizer.json ---------------------------------------------------------------------------------------------
def test_tokenizer_json_nested_too_deeply_is_one_line_for_gguf(deploy, tmp_path, capsys):
    hf = tmp_path / "hf"
    shutil.copytree(deploy["llama"], hf)
    (hf / "tokenizer.json").write_text("[" * 100_000 + "]" * 100_000)
    out = tmp_path / "m.gguf"
    code, _, err = run_cli(["hf-to-gguf", hf, out], capsys)
    assert_one_line_error(code, err, str(hf / "tokenizer.json"), "nested too deeply")
    assert not out.exists() and not list(tmp_path.glob(".m.gguf*"))


# ---- the iteration a checkpoint stores ----------------------------------------------------------------------------
def _at_iteration_5(src: Path, dst: Path, stored, dist: bool) -> Path:
    """A copy of `src` (a release checkpoint) moved to iter_0000005 (tracker 5) whose rank files / common.pt store
    `stored` as their `iteration`."""
    from safety_common import load_rank, save_rank

    shutil.copytree(src, dst)
    (dst / "mconvert-manifest.json").unlink(missing_ok=True)
    (dst / "release").rename(dst / "iter_0000005")
    (dst / "latest_checkpointed_iteration.txt").write_text("5")
    files = [dst / "iter_0000005" / "common.pt"] if dist else sorted(dst.rglob("model_optim_rng.pt"))
    for f in files:
        state = load_rank(f)
        state["iteration"] = stored
        save_rank(f, state)
    return dst


@pytest.mark.parametrize("stored", [True, 2.5, -3, "7", 7, 5], ids=["True", "2.5", "-3", "'7'", "7 in iter 5", "5"])
@pytest.mark.parametrize("fmt", ["torch", "torch_dist"])
def test_a_stored_iteration_that_is_no_iteration_or_not_its_directorys_is_refused(dist_llama, tmp_path, capsys,
                                                                                  stored, fmt):
    """Rank files / common.pt storing `iteration` True, 2.5, -3 were written as is (tracker `True`,
    `iter_-000003`, which no loader opens); 7 inside iter_0000005 renumbered the checkpoint. The benign
    neighbour (5 in iter_0000005) re-shards into iter_0000005."""
    from safety_common import copy_of

    src = copy_of("ckpt", tmp_path / "base") if fmt == "torch" else dist_llama
    ckpt = _at_iteration_5(src, tmp_path / "ckpt", stored, fmt == "torch_dist")
    where = ckpt / "iter_0000005" / ("common.pt" if fmt == "torch_dist" else "mp_rank_00_000/model_optim_rng.pt")
    code, _, err = run_cli(["reshard", ckpt, tmp_path / "out", "--tp", "1", "--pp", "1"], capsys)
    if stored == 5:
        assert code == 0, err
        assert (tmp_path / "out" / "latest_checkpointed_iteration.txt").read_text() == "5"
        assert (tmp_path / "out" / "iter_0000005").is_dir()
        return
    expect = ("'iteration' is 7 but the file lies in iter_0000005" if stored == 7 else
              f"iteration {stored!r} is not a training iteration")
    assert_one_line_error(code, err, str(where), expect, "re-copy")
    assert not (tmp_path / "out").exists()
