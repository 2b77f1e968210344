"""Crafted checkpoints for `mconvert train --resume`: a checkpoint of another model that differs only in a
field no shape shows (the rotary base), weights of another dtype or an int view of float bits, NaN weights,
a missing or damaged Adam state, a file of another iteration than the tracker names, damaged rng states and
data positions. Each is refused by file and key before a step is trained, never resumed into another model.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from safety_common import assert_one_line_error, run_cli
from scratch import scratch_dir

from mconvert.io.safeload import safe_load
from mconvert.layouts.megatron import save_rank_file
from mconvert.errors import MConvertError

WORK = scratch_dir("mconvert-rt3-", __name__)
MODEL = ["--num-layers", "1", "--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "4",
         "--device", "cpu"]
ITER1 = Path("iter_0000001") / "mp_rank_00" / "model_optim_rng.pt"


@pytest.fixture(scope="module")
def ckpt() -> Path:
    """A tiny-llama checkpoint the trainer saved at iteration 1 (TP=PP=1): the base every case damages."""
    from mconvert.trainer.train import TrainConfig, train

    root = WORK / "base"
    if not root.exists():
        train(TrainConfig(preset="tiny-llama", num_layers=1, seq_length=32, micro_batch_size=2, global_batch_size=4,
                          steps=1, save=str(root), device="cpu", quiet=True))
    return root


def _copy(ckpt: Path, name: str) -> Path:
    """A fresh copy of the base checkpoint under WORK/name."""
    dst = WORK / name
    shutil.rmtree(dst, ignore_errors=True)
    shutil.copytree(ckpt, dst)
    return dst


def _resume_config(root: Path, steps: int = 2, **kw):
    """The TrainConfig of a resume of the base model's run (`kw`: other options, --lr say)."""
    from mconvert.trainer.train import TrainConfig

    return TrainConfig(preset="tiny-llama", num_layers=1, seq_length=32, micro_batch_size=2, global_batch_size=4,
                       steps=steps, save=str(root), resume=True, device="cpu", quiet=True, **kw)


def _load_resume(root: Path, steps: int = 2) -> dict:
    """What rank 0 of a resume from `root` loads and checks before it builds its model."""
    from mconvert.data import build_tokenizer
    from mconvert.trainer.train import build_spec, load_resume

    cfg = _resume_config(root, steps)
    return load_resume(cfg, build_spec(cfg, build_tokenizer().get_vocab_size()), 0)


def _damaged(ckpt: Path, name: str, change) -> Path:
    dst = _copy(ckpt, name)
    f = dst / ITER1
    state = dict(safe_load(f))
    state["model"] = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in state["model"].items()}
    change(state)
    save_rank_file(f, state)
    (dst / "mconvert-manifest.json").unlink(missing_ok=True)
    return dst


def _first_weight(state: dict) -> str:
    return next(k for k, v in state["model"].items() if isinstance(v, torch.Tensor) and v.is_floating_point())


def _set_weight(state: dict, fn) -> None:
    k = _first_weight(state)
    state["model"][k] = fn(state["model"][k])


def _nan(t: torch.Tensor) -> torch.Tensor:
    t = t.clone()
    t.view(-1)[0] = float("nan")
    return t


def _first_state(state: dict) -> dict:
    return state["optimizer"]["state"][sorted(state["optimizer"]["state"])[0]]


CASES = {
    # weights
    "int-view-weights": (lambda s: _set_weight(s, lambda t: t.view(torch.int32)), "torch.int32"),
    "bf16-weights": (lambda s: _set_weight(s, lambda t: t.to(torch.bfloat16)), "torch.bfloat16"),
    "nan-weights": (lambda s: _set_weight(s, _nan), "NaN"),
    "extra-weight": (lambda s: s["model"].__setitem__("bogus.weight", torch.zeros(2)), "'bogus.weight'"),
    # Adam state
    "no-optimizer": (lambda s: s.pop("optimizer"), "'optimizer'"),
    "empty-adam-state": (lambda s: s["optimizer"].__setitem__("state", {}), "exp_avg_sq"),
    "adam-wrong-shape": (lambda s: _first_state(s).__setitem__("exp_avg", torch.zeros(3)), "(3,)"),
    "adam-nan": (lambda s: _first_state(s).__setitem__("exp_avg_sq", _first_state(s)["exp_avg_sq"] * float("nan")),
                 "NaN"),
    "adam-negative-step": (lambda s: _first_state(s).__setitem__("step", torch.tensor(-5.0)), "step"),
    "adam-negative-sq": (lambda s: _first_state(s)["exp_avg_sq"].view(-1).__setitem__(-1, -1e-8), "negative"),
    "adam-inf-avg": (lambda s: _first_state(s)["exp_avg"].view(-1).__setitem__(0, float("inf")), "NaN or Inf"),
    "adam-ids-short": (lambda s: s["optimizer"]["param_groups"][0]["params"].pop(), "different lengths"),
    "adam-betas": (lambda s: [g.__setitem__("betas", (5.0, 0.9)) for g in s["optimizer"]["param_groups"]], "betas"),
    # iteration, data position, rng
    "iteration-not-tracker": (lambda s: s.__setitem__("iteration", -3), "iteration -3"),
    "iteration-text": (lambda s: s.__setitem__("iteration", "abc"), "iteration"),
    "no-iteration": (lambda s: s.pop("iteration"), "'iteration'"),
    "no-args": (lambda s: s.pop("args"), "'args'"),
    "consumed-negative": (lambda s: setattr(s["args"], "consumed_train_samples", -100), "consumed_train_samples"),
    "consumed-huge": (lambda s: setattr(s["args"], "consumed_train_samples", 10 ** 30), "consumed_train_samples"),
    "rng-empty": (lambda s: s.__setitem__("rng_state", []), "rng_state"),
    "rng-garbage": (lambda s: s.__setitem__("rng_state", [{"random_rng_state": 1}]), "rng_state"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_damaged_resume_is_refused_by_file(ckpt: Path, case: str) -> None:
    """Each damage is one MConvertError naming the rank file (checked in the process that resumes: the same
    functions every rank runs) before any step; before, most were a KeyError / RuntimeError of torch, and the
    int view, bf16, NaN weights and an empty Adam state trained on (exit 0)."""
    from mconvert.data import build_tokenizer, tokenize_corpus
    from mconvert.trainer.parallel import ParallelState
    from mconvert.trainer.train import _train, build_spec, load_resume

    change, needle = CASES[case]
    root = _damaged(ckpt, case, change)
    cfg = _resume_config(root)
    tok = build_tokenizer()
    spec = build_spec(cfg, tok.get_vocab_size())
    with pytest.raises(MConvertError) as e:
        ckpt_state = load_resume(cfg, spec, 0)
        _train(cfg, spec, tokenize_corpus(tok), ParallelState(device=torch.device("cpu")), ckpt_state)
    msg = str(e.value)
    assert "\n" not in msg and str(root / ITER1) in msg and needle.lower() in msg.lower(), msg
    assert not (root / "iter_0000002").exists()


def test_resume_into_other_rotary_base_is_refused(ckpt: Path, capsys, monkeypatch) -> None:
    """A Llama-3 checkpoint (rotary base 500000, llama3 rope scaling) of tiny-llama's sizes resumed as
    tiny-llama (base 10000): every shape matches, and the run used to train on with the other rotary
    frequencies and save them as the checkpoint's (exit 0). Every model field is compared now."""
    monkeypatch.setenv("TMPDIR", str(WORK))
    root = WORK / "llama3"
    if not root.exists():
        code, _, err = run_cli(["train", "--preset", "tiny-llama3", "--hidden-size", "128", "--ffn-hidden-size",
                                "256", "--steps", "1", "--save", root, *MODEL], capsys)
        assert code == 0, err
    code, _, err = run_cli(["train", "--preset", "tiny-llama", "--steps", "2", "--save", root, "--resume", *MODEL],
                           capsys)
    assert_one_line_error(code, err, "rotary_base=500000.0", "repeat the original flags")
    assert not (root / "iter_0000002").exists()


def test_resume_trains_at_the_given_lr(ckpt: Path) -> None:
    """`--lr` on resume is the rate Adam steps with (the log and the saved args say it): it used to keep the
    rate saved in the Adam groups while logging and saving --lr."""
    from mconvert.trainer.train import train

    losses = {}
    for lr in (1e-3, 0.5):
        root = _copy(ckpt, f"lr-{lr}")
        losses[lr] = train(_resume_config(root, steps=3, lr=lr))["losses"]
        group = safe_load(root / "iter_0000003" / "mp_rank_00" / "model_optim_rng.pt")["optimizer"]["param_groups"]
        assert all(g["lr"] == lr for g in group), (lr, [g["lr"] for g in group])
    assert losses[1e-3][0] == losses[0.5][0] and losses[1e-3][1] != losses[0.5][1], losses


# ---- to-onnx ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("rope", [{"rope_type": "dynamic", "factor": 2.0},
                                  {"rope_type": "yarn", "factor": 1.0, "attention_factor": 0.5}])
def test_to_onnx_refuses_unmapped_config_fields(capsys, monkeypatch, rope: dict) -> None:
    """An HF Llama with dynamic-NTK rope scaling (or a YaRN attention factor no mscale gives megatron-core): the dry
    run refused it, the real export did not.
    Dynamic NTK acts only past max_position_embeddings (64), so the 16-token logits check passed while the
    graph, traced at optimum's dummy length, left the scaling out (3e-3 off transformers at 100 tokens; exit 0).
    Now the export parses config.json as every verb does: one line, no OUT, nothing in the temporary dir."""
    import json

    from safety_common import make_hf_llama

    tmp = WORK / "tmpdir"
    tmp.mkdir(exist_ok=True)
    monkeypatch.setenv("TMPDIR", str(tmp))
    monkeypatch.setattr("tempfile.tempdir", None)
    hf = WORK / f"hf-{rope['rope_type']}"
    if not hf.exists():
        make_hf_llama(hf)
        cfg = json.loads((hf / "config.json").read_text())
        cfg["rope_scaling"] = rope
        (hf / "config.json").write_text(json.dumps(cfg))
    out = WORK / f"onnx-{rope['rope_type']}"
    for dry in ([], ["--dry-run"]):
        code, _, err = run_cli(["to-onnx", hf, out, *dry], capsys)
        assert_one_line_error(code, err, "config.json", "rope_scaling", rope["rope_type"])
        assert not out.exists()
        assert sorted(p.name for p in out.parent.iterdir() if p.name.startswith(f".{out.name}")) == []
        assert [p.name for p in tmp.iterdir() if not p.name.startswith("torchinductor_")] == []


# ---- plan ---------------------------------------------------------------------------------------------------
def test_plan_scaleout_work_follows_the_file_groups(capsys) -> None:
    """`plan --nodes N --procs-per-node P` kept a list of N·P ranks and walked every node: 10^7 nodes took 24 s
    and 500 MB, 10^12 ended in "out of memory". Ranks past the file groups write nothing, so the estimate now
    costs what the groups cost, and says how many processes are busy."""
    import json

    # 10^20 ranks: a list of them cannot be made at all, so the run finishing is the proof
    code, out, err = run_cli(["plan", "--preset", "llama3-405b", "--tp", "8", "--pp", "16", "--to", "hf",
                              "--nodes", str(10 ** 12), "--procs-per-node", str(10 ** 8), "--json"], capsys)
    assert code == 0, err
    s = json.loads(out)["scaleout"]
    assert s["processes"] == 10 ** 20 and s["busy_processes"] == s["file_groups"] > 0, s


@pytest.mark.parametrize("preset, tp, needle", [("tiny-llama", "3", "does not divide num_attention_heads=4"),
                                                ("tiny-llama", "1", "grouped-query attention"),
                                                ("tiny-qwen3", "1", "qk_layernorm")])
def test_plan_to_ft_refuses_what_the_verb_refuses(capsys, preset: str, tp: str, needle: str) -> None:
    """`plan --to ft` estimated files for an FT TP that does not divide the heads, and for models FT's loaders
    cannot hold (GQA, q/k norm), which `megatron-to-ft` refuses; it now applies the verb's own check."""
    code, _, err = run_cli(["plan", "--preset", preset, "--to", "ft", "--target-tp", tp], capsys)
    assert_one_line_error(code, err, needle)
    assert "--infer-tp" not in err  # megatron-to-ft's flag; plan's is --target-tp
    code, _, err = run_cli(["plan", "--preset", "tiny-gpt2", "--to", "ft", "--target-tp", "2", "--json"], capsys)
    assert code == 0, err


# ---- output paths -------------------------------------------------------------------------------------------
def test_dangling_symlink_at_out_is_an_existing_out(capsys) -> None:
    """A dangling symlink at OUT passed the up-front check (Path.exists follows the link): a real to-onnx
    exported and checked the whole model, then refused at the final rename as an OUT that "appeared while this
    run was in progress"; --dry-run said it would write. Now it is an existing OUT, refused before any work
    (dry run too), and the link stays as it was."""
    from safety_common import make_hf_llama

    hf = WORK / "hf-plain"
    if not hf.exists():
        make_hf_llama(hf)
    out = WORK / "dangling-out"
    out.unlink(missing_ok=True)
    out.symlink_to(WORK / "nowhere")
    for dry in (["--dry-run"], []):
        code, _, err = run_cli(["to-onnx", hf, out, *dry], capsys)
        assert_one_line_error(code, err, "already exists", "--force")
        assert out.is_symlink() and not (WORK / "nowhere").exists()


def test_resume_with_steps_0_is_refused(ckpt: Path, capsys) -> None:
    """`--resume --steps 0` saved the iteration-1 weights and Adam state as iter_0000000 (iteration 0, no
    samples consumed) and moved the tracker back to 0, exit 0: a later resume continued a mislabelled model."""
    root = _copy(ckpt, "steps0")
    code, _, err = run_cli(["train", "--preset", "tiny-llama", "--steps", "0", "--save", root, "--resume", *MODEL],
                           capsys)
    assert_one_line_error(code, err, "--steps 0", "--resume")
    assert (root / "latest_checkpointed_iteration.txt").read_text().strip() == "1"
    assert not (root / "iter_0000000").exists()


def test_to_onnx_reports_the_dtype_of_the_graph(capsys) -> None:
    """A bf16 HF Llama whose config.json states `torch_dtype: bfloat16`: the graph optimum writes holds fp32
    initializers (both exporters load the model in fp32), but the report said bfloat16, and the dry run's
    weight_bytes counted 2 bytes a parameter. The report now names the graph's dtype."""
    import json

    import onnx

    from safety_common import make_hf_llama

    hf = WORK / "hf-bf16"
    if not hf.exists():
        make_hf_llama(hf)
        from safetensors.torch import load_file, save_file
        f = hf / "model.safetensors"
        save_file({k: v.to(torch.bfloat16) for k, v in load_file(f).items()}, str(f), metadata={"format": "pt"})
        cfg = json.loads((hf / "config.json").read_text())
        cfg.pop("dtype", None)
        cfg["torch_dtype"] = "bfloat16"
        (hf / "config.json").write_text(json.dumps(cfg))
    out = WORK / "onnx-bf16"
    shutil.rmtree(out, ignore_errors=True)
    code, stdout, err = run_cli(["to-onnx", hf, out, "--dry-run", "--json"], capsys)
    assert code == 0, err
    dry = json.loads(stdout)
    from mconvert.convert.sources import open_source
    with open_source(hf, verify=False) as src:
        params = src.spec.num_parameters()
    assert dry["dtype"] == "float32" and dry["weight_bytes"] == 4 * params, dry
    code, stdout, err = run_cli(["to-onnx", hf, out, "--json"], capsys)
    assert code == 0, err
    assert json.loads(stdout)["dtype"] == "float32"
    graph = onnx.load(str(out / "model.onnx"), load_external_data=False).graph
    assert {t.data_type for t in graph.initializer} == {onnx.TensorProto.FLOAT}


def test_resume_from_a_broken_tracker_names_no_flag_train_lacks(ckpt: Path) -> None:
    """The conversions' tracker errors end "or pass --iteration"; `train` has no such flag, so a resume's error
    says only what to fix in the file."""
    root = _copy(ckpt, "tracker")
    (root / "latest_checkpointed_iteration.txt").write_text("one\n")
    with pytest.raises(MConvertError) as e:
        _load_resume(root)
    assert "latest_checkpointed_iteration.txt" in str(e.value) and "--iteration" not in str(e.value), str(e.value)


def test_to_onnx_of_an_hf_directory_refuses_iteration(capsys) -> None:
    """`--iteration` chooses among a Megatron checkpoint's iter_* directories; given with an HF directory it was
    ignored (the directory exported as is, exit 0). Now one line naming the option, no OUT."""
    from safety_common import make_hf_llama

    hf = WORK / "hf-iteration"
    if not hf.exists():
        make_hf_llama(hf)
    out = WORK / "onnx-iteration"
    for dry in ([], ["--dry-run"]):
        code, _, err = run_cli(["to-onnx", hf, out, "--iteration", "5", *dry], capsys)
        assert_one_line_error(code, err, "--iteration 5", "HuggingFace directory")
        assert not out.exists()


def test_resume_from_a_tracker_naming_a_missing_iteration_says_so(ckpt: Path) -> None:
    """A tracker naming an iteration whose directory is gone was reported as "the checkpoint does not have
    TP=1 PP=1 EP=1 shards", which sends the user after the wrong flags."""
    root = _copy(ckpt, "tracker-missing")
    (root / "latest_checkpointed_iteration.txt").write_text("7\n")
    with pytest.raises(MConvertError) as e:
        _load_resume(root, steps=9)
    assert "names iteration 7" in str(e.value) and "iter_0000007" in str(e.value), str(e.value)
    assert "shards" not in str(e.value)


def test_resume_takes_args_saved_as_a_dict(ckpt: Path) -> None:
    """Rank files whose `args` is a dict (the conversions read them so) resume like a Namespace's: the run's
    checks compare the fields, rather than reading every one as None ("tensor_model_parallel_size=None")."""
    root = _damaged(ckpt, "args-dict", lambda s: s.__setitem__("args", dict(vars(s["args"]))))
    state = _load_resume(root)
    assert state["args"].tensor_model_parallel_size == 1 and state["iteration"] == 1
