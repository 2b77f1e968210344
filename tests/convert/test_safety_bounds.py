"""Sizes in config.json / the Megatron args are checked against the tensors present before anything is allocated.

Truth we did not write: the weights are saved by transformers (and converted to Megatron by hf-to-megatron);
only the size fields are edited, as a broken or hostile config would. Each case ends in one line naming the
field, its value and what the tensors hold, with no per-layer loop over the claimed layer count, no tensor
sized from the claimed sizes, and nothing written.
"""

from __future__ import annotations

import gc
import shutil
import json
import sys
from pathlib import Path

import pytest
import torch
from safety_common import assert_one_line_error, copy_of, load_rank, rank_file, run_cli, save_rank

from torch.utils._python_dispatch import TorchDispatchMode

import mconvert
from mconvert.convert.bounds import check_memory
from mconvert.errors import MConvertError


def _hf_with(tmp: Path, **changes) -> Path:
    hf = copy_of("hf", tmp / "hf")
    cfg = json.loads((hf / "config.json").read_text())
    cfg.update(changes)
    (hf / "config.json").write_text(json.dumps(cfg))
    return hf


# the base model: 2 layers, hidden 64, 4 heads of 16, 2 KV heads, ffn 128, vocab 100 (safety_common.make_hf_llama)
HF_CASES = {
    "a billion layers": ({"num_hidden_layers": 10**9}, ["num_hidden_layers=1000000000", "2 layers"]),
    "fewer layers than the weights": ({"num_hidden_layers": 1}, ["num_hidden_layers=1", "2 layers"]),
    "vocab one short of the embedding": ({"vocab_size": 99}, ["vocab_size=99", "[100, 64]"]),
    "vocab one beyond the embedding": ({"vocab_size": 101}, ["vocab_size=101", "[100, 64]"]),
    "hidden 2^40": ({"hidden_size": 2**40}, ["hidden_size=1099511627776", "[100, 64]"]),
    "heads": ({"num_attention_heads": 8}, ["num_attention_heads=8", "[64, 64]"]),
    "kv heads": ({"num_key_value_heads": 4}, ["num_key_value_heads=4", "k_proj", "[32, 64]"]),
    "ffn": ({"intermediate_size": 256}, ["intermediate_size=256", "the config implies"]),
}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("case", sorted(HF_CASES))
def test_hf_sizes_that_contradict_the_tensors_are_refused(case: str, tmp_path: Path, capsys) -> None:
    changes, expect = HF_CASES[case]
    hf = _hf_with(tmp_path, **changes)
    code, _, err = run_cli(["hf-to-megatron", hf, tmp_path / "mg", "--tp", "2"], capsys)
    assert_one_line_error(code, err, str(hf / "config.json"), *expect)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]


def _lines_run(fn) -> int:
    """Lines of mconvert's own code that `fn()` executes on this thread: a loop there adds lines per iteration.
    Other code is left out: the standard library's thread hand-offs vary from run to run."""
    package = str(Path(mconvert.__file__).parent)
    count = 0

    def lines(frame, event, arg):
        nonlocal count
        count += event == "line"
        return lines

    def calls(frame, event, arg):
        return lines(frame, event, arg) if frame.f_code.co_filename.startswith(package) else None

    previous = sys.gettrace()
    gc.collect()
    gc.disable()  # a collection runs finalizers at allocation-dependent moments
    sys.settrace(calls)
    try:
        fn()
    finally:
        sys.settrace(previous)
        gc.enable()
    return count


def _megatron_with(tmp: Path, **changes) -> Path:
    ckpt = copy_of("ckpt", tmp / "mg")
    for t in range(2):
        for p in range(2):
            f = rank_file(ckpt, t, p)
            state = load_rank(f)
            for k, v in changes.items():
                setattr(state["args"], k, v)
            save_rank(f, state)
    return ckpt


LAYER_FIELD = {"hf-to-megatron": "num_hidden_layers", "megatron-to-hf": "num_layers"}


@pytest.mark.timeout(60)  # a per-layer loop over a billion layers does not end: the timeout reports it
@pytest.mark.parametrize("verb", sorted(LAYER_FIELD))
def test_dry_run_work_does_not_grow_with_the_claimed_layer_count(verb: str, tmp_path: Path, capsys) -> None:
    field = LAYER_FIELD[verb]

    def refusal(layers: int, where: str) -> None:
        src = (_hf_with(tmp_path / where, **{field: layers}) if verb == "hf-to-megatron" else
               _megatron_with(tmp_path / where, **{field: layers}))
        code, _, err = run_cli([verb, src, tmp_path / where / "out", "--dry-run"], capsys)
        assert_one_line_error(code, err, f"{field}={layers}", "2 layers")

    # paths of one length; even claims (PP=2) whose counts and halves have one digit count each, so the
    # messages (they name the last stage's first layer) are as long as each other
    refusal(2002, "w")  # imports and caches of the verb's modules
    few, many = _lines_run(lambda: refusal(2002, "a")), _lines_run(lambda: refusal(9998, "b"))
    assert few == many, f"{many - few} more lines of mconvert for 7996 more claimed layers: a per-layer loop"
    refusal(10**9, "c")


class _LargestTensor(TorchDispatchMode):
    """Records the most elements of any tensor an aten op makes off the meta device (loads included)."""

    def __init__(self) -> None:
        super().__init__()
        self.numel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                self.numel = max(self.numel, t.numel())
        return out


MEGATRON_CASES = {
    "a billion layers": ({"num_layers": 10**9}, ["num_layers=1000000000", "2 layers"]),
    "hidden 2^40": ({"hidden_size": 2**40}, ["hidden_size=1099511627776"]),
    "ffn": ({"ffn_hidden_size": 256}, ["ffn_hidden_size=256", "linear_fc1"]),
    "query groups": ({"num_query_groups": 4}, ["num_query_groups=4", "linear_qkv"]),
}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("case", sorted(MEGATRON_CASES))
def test_megatron_sizes_that_contradict_the_tensors_are_refused(case: str, tmp_path: Path, capsys) -> None:
    changes, expect = MEGATRON_CASES[case]
    ckpt = _megatron_with(tmp_path, **changes)
    held = max(t.numel() for f in ckpt.glob("release/*/model_optim_rng.pt")
               for t in load_rank(f)["model"].values() if isinstance(t, torch.Tensor))
    with _LargestTensor() as made:  # the refusal comes from the shapes: nothing is sized from the args
        code, _, err = run_cli(["megatron-to-hf", ckpt, tmp_path / "out", "--dry-run"], capsys)
    assert_one_line_error(code, err, "mp_rank_00_000/model_optim_rng.pt", *expect)
    assert 0 < made.numel <= held, f"a tensor of {made.numel} elements; the files hold at most {held}"
    code, _, err = run_cli(["megatron-to-hf", ckpt, tmp_path / "out"], capsys)
    assert_one_line_error(code, err, *expect)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mg"]


def test_a_unit_larger_than_the_memory_available_is_refused_before_reading() -> None:
    with pytest.raises(MConvertError, match=r"x/config.json: converting the embedding needs about 3.0 GiB .* "
                                            r"but 2.0 GiB is available"):
        check_memory({"embedding": 2**30, 0: 2**20}, "x/config.json", available=2 * 2**30)
    check_memory({"embedding": 2**30}, "x/config.json", available=4 * 2**30)


def _corrupt_rank_file(path: Path) -> Path:
    """A torch.save file whose tensor record fails its stored CRC-32 (one bit flipped in the data)."""
    import zipfile

    torch.save({"model": {"w": torch.arange(4096, dtype=torch.float32)}}, path)
    with zipfile.ZipFile(path) as z:
        info = next(i for i in z.infolist() if i.filename.endswith("/data/0"))
    data = bytearray(path.read_bytes())
    head = info.header_offset
    start = head + 30 + int.from_bytes(data[head + 26:head + 28], "little") + int.from_bytes(data[head + 28:head + 30],
                                                                                           "little")
    data[start + 100] ^= 1
    path.write_bytes(bytes(data))
    return path


def _cancel_when(taken: bool, explain: bool, claimed: bool, path: Path) -> tuple[int, set[str], str | None]:
    """`DeferredCRC.cancel` with the background thread in a chosen state: `taken` — it has taken the file's
    check off its queue and waits for the release; else — it is busy (a gate task) and the check is still
    queued. Returns the lines of mconvert `cancel` ran on this thread, the records checked, the error raised."""
    import threading
    import time

    from mconvert.io.crc import DeferredCRC

    d = DeferredCRC()
    gate = threading.Event()
    d.submit(path, lambda _p: gate.wait(30))
    if taken:
        gate.set()
    assert d.add_zip(path)
    recs = next(iter(d.records.values()))
    if claimed:  # a reader indexed the file and claimed its tensor record (the release is left to cancel)
        recs.claimed.update(o for o, (_, _, name) in recs.entries.items() if name.endswith("/data/0"))
    if taken:
        deadline = time.monotonic() + 30
        while not d._futures[-1].running():  # the check is off the queue, waiting for `released`
            assert time.monotonic() < deadline
            time.sleep(0.001)
    else:
        threading.Timer(0.2, gate.set).start()  # the gate opens while cancel waits for it
    error = None

    def cancel() -> None:
        nonlocal error
        try:
            d.cancel(explain=explain)
        except MConvertError as e:
            error = str(e)

    lines = _lines_run(cancel)
    d.close()
    return lines, {recs.entries[o][2].rsplit("/", 1)[1] for o in recs.done}, error


@pytest.mark.parametrize("claimed", [False, True], ids=["loaded-whole", "indexed"])
@pytest.mark.parametrize("explain", [False, True], ids=["dropped", "explained"])
def test_cancel_does_not_depend_on_how_far_the_background_thread_got(explain: bool, claimed: bool,
                                                                     tmp_path: Path) -> None:
    """The mechanism under the dry-run test above: a refusal cancels the background CRC checks, and what cancel
    checks and runs must not depend on whether the background thread had taken a check off its queue."""
    path = _corrupt_rank_file(tmp_path / "model_optim_rng.pt")
    queued = _cancel_when(False, explain, claimed, path)
    taken = _cancel_when(True, explain, claimed, path)
    assert queued == taken, f"check still queued: {queued}; taken by the background thread: {taken}"
    lines, checked, error = taken
    if not explain:  # nothing is committed and the conversion did not fail on its input: nothing is checked
        assert checked == set() and error is None
    elif not claimed:  # loaded whole: the corrupt record can have caused the failure, and explains it
        assert error is not None and "data/0 fails the CRC-32 check" in error
    else:  # the reader claimed the tensor (checked as it is read): the pickle is checked, the tensor not re-read
        assert "data.pkl" in checked and "0" not in checked and error is None


# ---- the expert count: a config claiming millions of experts (issue 34, item 1) ---------------------------------
@pytest.fixture(scope="module")
def moe(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A tiny Mixtral (4 experts) saved by transformers, and its Megatron torch (EP=2) and torch_dist conversions,
    without mconvert's manifests (as other tools write them: the edited count is then the only change)."""
    import transformers

    from mconvert.convert.verbs import hf_to_megatron

    root = tmp_path_factory.mktemp("moe")
    cfg = transformers.MixtralConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                                     num_key_value_heads=2, vocab_size=100, num_local_experts=4,
                                     num_experts_per_tok=2, max_position_embeddings=64, tie_word_embeddings=False)
    torch.manual_seed(0)
    transformers.MixtralForCausalLM(cfg).save_pretrained(root / "hf")
    hf_to_megatron(root / "hf", root / "torch", ep=2)
    hf_to_megatron(root / "hf", root / "torch_dist", format="torch_dist")
    for d in ("torch", "torch_dist"):
        (root / d / "mconvert-manifest.json").unlink()
        (root / d / "release" / "integrity.json").unlink(missing_ok=True)
    return {"hf": root / "hf", "torch": root / "torch", "torch_dist": root / "torch_dist"}


def _with_experts(moe: dict[str, Path], kind: str, dst: Path, n: int) -> Path:
    shutil.copytree(moe[kind], dst)
    if kind == "hf":
        cfg = json.loads((dst / "config.json").read_text())
        cfg["num_local_experts"] = n
        (dst / "config.json").write_text(json.dumps(cfg))
    elif kind == "torch":
        for f in sorted(dst.rglob("model_optim_rng.pt")):
            state = load_rank(f)
            state["args"].num_experts = n
            save_rank(f, state)
    else:
        common = dst / "release" / "common.pt"
        state = load_rank(common)
        state["args"].num_experts = n
        save_rank(common, state)
    return dst


EXPERT_FIELD = {"hf": "num_local_experts", "torch": "num_experts", "torch_dist": "num_experts"}


@pytest.mark.timeout(120)  # a per-expert loop over a billion experts does not end: the timeout reports it
@pytest.mark.parametrize("verb", ["convert --dry-run", "inspect"])
@pytest.mark.parametrize("kind", sorted(EXPERT_FIELD))
def test_a_claimed_expert_count_is_refused_on_the_router_before_any_per_expert_work(kind: str, verb: str, moe,
                                                                                  tmp_path: Path, capsys) -> None:
    field = EXPERT_FIELD[kind]

    def run(n: int, where: str) -> None:
        src = _with_experts(moe, kind, tmp_path / where, n)
        argv = (["inspect", src] if verb == "inspect" else
                ["hf-to-megatron" if kind == "hf" else "megatron-to-hf", src, tmp_path / f"{where}-out", "--dry-run"])
        code, _, err = run_cli(argv, capsys)
        if n == 4:  # the benign neighbour: the count the router holds
            assert code == 0, err
        else:
            assert_one_line_error(code, err, f"{field}={n}" if kind != "torch_dist" else "router.weight",
                                  "[4, 64]", f"[{n}, 64]")

    run(4, "ok")
    run(1_000_000, "w")  # imports and caches of the verb's modules
    few, many = _lines_run(lambda: run(1_000_000, "a")), _lines_run(lambda: run(9_000_000, "b"))
    assert few == many, f"{many - few} more lines of mconvert for 8 million more claimed experts: a per-expert loop"
    run(10**9, "c")
