"""Containment of paths from inside inputs, and outputs that never destroy an input or a newcomer.

Each test is one attack tried against the CLI: a file name inside an input that points outside it (index
`weight_map`, DCP `relative_path`, symlinked tokenizer / weight / rank files), a FIFO or a huge file where a
small one belongs, an OUT overlapping an input, an OUT that appears mid-run, SIGTERM / SIGHUP mid-run, and
leftovers of killed runs that a glob would confuse with a user's files. Each asserts the exact outcome: a
one-line refusal naming the file or key, the user's files byte-identical, nothing outside OUT written, no hang.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
import torch
from safety_common import big_llama_hf, PY, ROOT, assert_one_line_error, base, copy_of, rank_file, run_cli

pytestmark = pytest.mark.timeout(300)


def tree_digest(*roots: Path) -> dict[str, str]:
    """sha256 of every file under `roots` (symlinks as their target name): the user's files, before and after."""
    out = {}
    for root in roots:
        for p in sorted(root.rglob("*")) if root.is_dir() else [root]:
            if p.is_symlink():
                out[str(p)] = "-> " + os.readlink(p)
            elif p.is_file():
                out[str(p)] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


def siblings(out: Path) -> list[str]:
    """Everything in OUT's parent that belongs to OUT: OUT itself or a hidden temporary sibling."""
    return sorted(p.name for p in out.parent.iterdir() if p.name == out.name or p.name.startswith(f".{out.name}."))


def cli_subprocess(argv: list, timeout: float, **kw) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    env.pop("MCONVERT_DEBUG", None)
    return subprocess.run([PY, "-m", "mconvert.cli", *map(str, argv)], capture_output=True, text=True,
                          timeout=timeout, env=env, **kw)


def make_torch_dist(root: Path) -> Path:
    """A tiny-llama torch_dist checkpoint: args in common.pt, stacked global tensors saved by torch's own DCP."""
    from mconvert.mappings.families import preset

    spec = preset("tiny-llama")
    d = root / "iter_0000001"
    d.mkdir(parents=True)
    (root / "latest_checkpointed_iteration.txt").write_text("1")
    (d / "metadata.json").write_text(json.dumps({"sharded_backend": "torch_dist"}))
    torch.save({"args": spec.to_megatron_args(1, 1), "checkpoint_version": 3.0, "iteration": 1}, d / "common.pt")
    g = torch.Generator().manual_seed(0)
    state = {dcl.name: torch.randn(dcl.shape, generator=g) * 0.02
             for dcl in spec.embedding_params() + spec.final_params()}
    for dcl in spec.layer_params(0):
        name = dcl.name.replace("decoder.layers.0.", "decoder.layers.", 1)
        state[name] = torch.randn((spec.num_layers, *dcl.shape), generator=g) * 0.02
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import torch.distributed.checkpoint as dcp

        dcp.save(state, checkpoint_id=d)
    return root


# ---- file names from inside an input ---------------------------------------------------------------------
@pytest.mark.parametrize("how", ["dotdot", "absolute", "symlinked weight file"])
def test_index_weight_map_naming_a_file_outside_the_model_dir_is_refused(tmp_path, capsys, how):
    hf = copy_of("hf", tmp_path / "hf")
    outside = tmp_path / "x.safetensors"
    os.rename(hf / "model.safetensors", outside)
    from safetensors import safe_open

    with safe_open(str(outside), "pt") as h:
        keys = list(h.keys())
    name = {"dotdot": "../x.safetensors", "absolute": str(outside), "symlinked weight file": "model.safetensors"}[how]
    if how == "symlinked weight file":
        (hf / "model.safetensors").symlink_to(outside)
    (hf / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {k: name for k in keys}}))
    before = tree_digest(tmp_path)
    code, _, err = run_cli(["hf-to-megatron", hf, tmp_path / "out"], capsys)
    line = assert_one_line_error(code, err, "model.safetensors.index.json", "weight_map",
                                 "symlink" if how == "symlinked weight file" else name)
    assert "outside" in line
    assert tree_digest(tmp_path) == before and siblings(tmp_path / "out") == []


@pytest.mark.parametrize("how", ["absolute", "dotdot"])
def test_torch_dist_relative_path_outside_the_iteration_dir_is_refused(tmp_path, capsys, how):
    from torch.distributed.checkpoint import FileSystemReader

    ckpt = make_torch_dist(tmp_path / "ckpt")
    d = ckpt / "iter_0000001"
    outside = tmp_path / "elsewhere.distcp"
    os.rename(d / "__0_0.distcp", outside)
    md = FileSystemReader(str(d)).read_metadata()  # our own file, built above: torch's reader is the reference
    rel = str(outside) if how == "absolute" else "../../elsewhere.distcp"
    for info in md.storage_data.values():
        info.relative_path = rel
    (d / ".metadata").write_bytes(pickle.dumps(md))
    before = tree_digest(tmp_path)
    code, _, err = run_cli(["megatron-to-hf", ckpt, tmp_path / "out"], capsys)
    assert_one_line_error(code, err, str(d / ".metadata"), "relative_path", rel, "outside")
    assert tree_digest(tmp_path) == before and siblings(tmp_path / "out") == []


def test_torch_dist_reference_checkpoint_converts(tmp_path, capsys):
    # the fixture of the two tests above is a valid checkpoint: only the attack makes them fail
    ckpt = make_torch_dist(tmp_path / "ckpt")
    code, _, err = run_cli(["megatron-to-hf", ckpt, tmp_path / "out"], capsys)
    assert code == 0, err
    assert (tmp_path / "out" / "model.safetensors").is_file()


@pytest.mark.parametrize("verb", ["megatron-to-hf", "reshard"])
def test_tokenizer_file_symlinked_outside_is_refused_and_not_copied(tmp_path, capsys, verb):
    secret = tmp_path / "secret.txt"
    secret.write_text("SSH PRIVATE KEY\n")
    tok = tmp_path / "tok"
    tok.mkdir()
    (tok / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}))
    (tok / "tokenizer.json").symlink_to(secret)
    if verb == "megatron-to-hf":
        ckpt, extra = base()["ckpt"], ["--tokenizer", tok]
    else:  # the tokenizer found beside the checkpoint is carried by reshard
        ckpt = copy_of("ckpt", tmp_path / "ckpt")
        (ckpt / "tokenizer_config.json").write_text((tok / "tokenizer_config.json").read_text())
        (ckpt / "tokenizer.json").symlink_to(secret)
        tok, extra = ckpt, ["--tp", "1", "--pp", "1"]
    before = tree_digest(tmp_path)
    code, _, err = run_cli([verb, ckpt, tmp_path / "out", *extra], capsys)
    assert_one_line_error(code, err, str(tok / "tokenizer.json"), "symlink", "outside")
    assert tree_digest(tmp_path) == before and siblings(tmp_path / "out") == []


def test_rank_dir_symlinked_outside_the_checkpoint_is_refused(tmp_path, capsys):
    ckpt = copy_of("ckpt", tmp_path / "ckpt")
    rank_dir = rank_file(ckpt, 1, 1).parent
    os.rename(rank_dir, tmp_path / "stray")
    rank_dir.symlink_to(tmp_path / "stray", target_is_directory=True)
    before = tree_digest(tmp_path)
    code, _, err = run_cli(["megatron-to-hf", ckpt, tmp_path / "out"], capsys)
    assert_one_line_error(code, err, "mp_rank_01_001", "symlink", "outside")
    assert tree_digest(tmp_path) == before and siblings(tmp_path / "out") == []


def test_native_runner_refuses_a_rank_file_symlinked_outside_the_checkpoint(tmp_path):
    # validate / verify --against run the checkpoint natively: their rank-file reads are contained too
    from mconvert.errors import MConvertError
    from mconvert.trainer.infer import read_checkpoint_args

    ckpt = copy_of("ckpt", tmp_path / "ckpt")
    first = rank_file(ckpt, 0, 0)
    os.rename(first, tmp_path / "stray.pt")
    first.symlink_to(tmp_path / "stray.pt")
    with pytest.raises(MConvertError, match="symlink leading outside"):
        read_checkpoint_args(ckpt)


def test_verify_reports_an_index_naming_a_file_outside_the_model_dir(tmp_path, capsys):
    hf = copy_of("ref", tmp_path / "hf")
    os.rename(hf / "model.safetensors", tmp_path / "x.safetensors")
    from safetensors import safe_open

    with safe_open(str(tmp_path / "x.safetensors"), "pt") as h:
        wmap = {k: "../x.safetensors" for k in h.keys()}
    (hf / "model.safetensors.index.json").write_text(json.dumps({"weight_map": wmap}))
    code, out, _ = run_cli(["verify", hf, "--json"], capsys)
    report = json.loads(out)
    assert code == 1 and "weight-files" in report["errors"]
    msg = next(c["message"] for c in report["checks"] if c["name"] == "weight-files")
    assert "'../x.safetensors'" in msg and "outside" in msg, msg


def test_trtllm_rank_file_symlinked_outside_is_a_problem(tmp_path):
    from mconvert.convert.deploy.trtllm import check_trtllm_dir
    from mconvert.convert.verbs import megatron_to_trtllm

    megatron_to_trtllm(base()["hf"], tmp_path / "trt", tp=1)
    assert check_trtllm_dir(tmp_path / "trt") == []
    f = tmp_path / "trt" / "rank0.safetensors"
    os.rename(f, tmp_path / "rank0.safetensors")
    f.symlink_to(tmp_path / "rank0.safetensors")
    problems = check_trtllm_dir(tmp_path / "trt")
    assert len(problems) == 1 and "rank0.safetensors" in problems[0] and "outside" in problems[0], problems


@pytest.mark.parametrize("where", ["weight file", "config.ini"])
def test_ft_file_symlinked_outside_is_refused(tmp_path, where):
    from deploy_common import make_hf

    from mconvert.convert.deploy.fastertransformer import check_ft_dir

    from mconvert.convert.verbs import megatron_to_ft
    from mconvert.errors import MConvertError
    from mconvert.mappings.families import preset
    from mconvert.validators.ft_runner import ft_logits

    megatron_to_ft(make_hf(preset("tiny-gpt2"), tmp_path / "hf"), tmp_path / "ft", 1)
    ft = tmp_path / "ft" / "1-gpu"
    assert check_ft_dir(tmp_path / "ft") == []
    f = ft / ("model.wte.bin" if where == "weight file" else "config.ini")
    os.rename(f, tmp_path / f.name)
    f.symlink_to(tmp_path / f.name)
    problems = check_ft_dir(tmp_path / "ft")
    assert len(problems) == 1 and str(f) in problems[0] and "outside" in problems[0], problems
    with pytest.raises(MConvertError, match="outside"):
        ft_logits(tmp_path / "ft", torch.zeros(1, 4, dtype=torch.long))


# ---- special and oversized files ---------------------------------------------------------------------------
@pytest.mark.parametrize("where", ["hf weight file", "rank file", "tracker", "tokenizer.json"])
def test_fifo_where_a_file_belongs_is_refused_without_hanging(tmp_path, where):
    if where == "hf weight file":
        d = copy_of("hf", tmp_path / "in")
        fifo, argv = d / "model.safetensors", ["hf-to-megatron", d, tmp_path / "out"]
    else:
        d = copy_of("ckpt", tmp_path / "in")
        argv = ["megatron-to-hf", d, tmp_path / "out"]
        fifo = {"rank file": rank_file(d, 1, 0), "tracker": d / "latest_checkpointed_iteration.txt",
                "tokenizer.json": d / "tokenizer.json"}[where]
    fifo.unlink(missing_ok=True)
    os.mkfifo(fifo)
    r = cli_subprocess(argv, timeout=120)  # a hang fails here, with TimeoutExpired
    assert_one_line_error(r.returncode, r.stderr, str(fifo), "FIFO", "not a regular file")
    assert siblings(tmp_path / "out") == []


def test_huge_tracker_file_is_refused_before_reading(tmp_path, capsys):
    ckpt = copy_of("ckpt", tmp_path / "ckpt")
    tracker = ckpt / "latest_checkpointed_iteration.txt"
    with open(tracker, "r+b") as f:
        f.truncate(6 << 30)  # sparse: 6 GB that take no disk
    before = _bytes_read()
    code, _, err = run_cli(["megatron-to-hf", ckpt, tmp_path / "out"], capsys)
    read = _bytes_read() - before
    assert_one_line_error(code, err, str(tracker), f"{6 << 30:,} bytes", "limit 64")
    # every read syscall of this process counts, whatever API makes it: the refusal comes from the size
    # fstat reports, and what the run reads besides (the modules it imports) is a small fraction of the file
    assert read < 64 << 20, f"the run read {read:,} bytes: the tracker was read before its size was checked"


def _bytes_read() -> int:
    """Bytes this process has read through read syscalls (`rchar` of /proc/self/io), from any file."""
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("rchar:"))


def test_open_regular_never_blocks_on_a_fifo(tmp_path):
    from mconvert.io.paths import read_json
    from mconvert.errors import MConvertError

    os.mkfifo(tmp_path / "config.json")
    with pytest.raises(MConvertError, match="FIFO"):
        read_json(tmp_path / "config.json")


# ---- outputs ---------------------------------------------------------------------------------------------
OVERLAPS = [(v, w) for v in ("megatron-to-hf", "reshard", "hf-to-megatron")
            for w in ("equal", "parent of the input", "inside the input")] + [("megatron-to-hf", "the tokenizer dir")]


@pytest.mark.parametrize(("verb", "where"), OVERLAPS)
def test_output_overlapping_an_input_is_refused_even_with_force(tmp_path, capsys, where, verb):
    src = copy_of("hf" if verb == "hf-to-megatron" else "ckpt", tmp_path / "work" / "in")
    tok = tmp_path / "tok"
    tok.mkdir()
    (tok / "tokenizer_config.json").write_text("{}")
    out = {"equal": src, "parent of the input": tmp_path / "work", "inside the input": src / "sub",
           "the tokenizer dir": tok}[where]
    extra = ["--tokenizer", tok] if verb == "megatron-to-hf" else []
    before = tree_digest(tmp_path)
    code, _, err = run_cli([verb, src, out, "--force", *extra], capsys)
    line = assert_one_line_error(code, err, str(out), "input")
    assert any(w in line for w in ("is the input", "contains the input", "lies inside the input")), line
    assert tree_digest(tmp_path) == before
    assert not any(p.name.startswith(f".{out.name}.mconvert-tmp-") for p in out.parent.iterdir())


@pytest.mark.parametrize("syscall", ["renameat2", "fallback"])
def test_output_appearing_during_the_run_is_left_intact(tmp_path, capsys, monkeypatch, syscall):
    import mconvert.io.atomic as atomic

    out = tmp_path / "out"
    real = atomic.write_manifest

    def user_creates_out(root, *a, **kw):  # the commit step is reached: someone makes OUT just now
        out.mkdir()
        (out / "precious.txt").write_text("the user's file\n")
        return real(root, *a, **kw)

    monkeypatch.setattr(atomic, "write_manifest", user_creates_out)
    if syscall == "fallback":
        monkeypatch.setattr(atomic, "_renameat2", lambda a, b, flags: False)
    code, _, err = run_cli(["megatron-to-hf", base()["ckpt"], out], capsys)
    assert_one_line_error(code, err, str(out), "appeared while this run was in progress")
    assert sorted(p.name for p in out.iterdir()) == ["precious.txt"]
    assert (out / "precious.txt").read_text() == "the user's file\n"
    assert siblings(out) == ["out"]


def test_output_absent_at_commit_is_written_by_the_fallback_rename(tmp_path, capsys, monkeypatch):
    import mconvert.io.atomic as atomic

    monkeypatch.setattr(atomic, "_renameat2", lambda a, b, flags: False)
    code, _, err = run_cli(["megatron-to-hf", base()["ckpt"], tmp_path / "out"], capsys)
    assert code == 0, err
    assert atomic.check_manifest(tmp_path / "out") == [] and siblings(tmp_path / "out") == ["out"]


@pytest.fixture(scope="module")
def slow_hf() -> Path:
    """A ~30 MB Llama HF dir: converting it takes long enough to be signalled mid-run."""
    return big_llama_hf()


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP], ids=["SIGTERM", "SIGHUP"])
def test_sigterm_and_sighup_mid_run_leave_neither_output_nor_temporary(tmp_path, slow_hf, sig):
    out = tmp_path / "out"
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    env.pop("MCONVERT_DEBUG", None)
    # a run started under nohup inherits SIGHUP ignored (and mconvert keeps an ignored signal ignored): the child
    # starts with the default disposition, as from a terminal
    proc = subprocess.Popen([PY, "-m", "mconvert.cli", "hf-to-megatron", str(slow_hf), str(out), "--tp", "2"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env,
                            preexec_fn=lambda: signal.signal(sig, signal.SIG_DFL))
    tmp = tmp_path / f".out.mconvert-tmp-{proc.pid}"
    deadline = time.monotonic() + 120
    while not tmp.is_dir() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.002)
    assert tmp.is_dir(), f"the run never created {tmp}"
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + sig, (proc.returncode, err[-2000:])
    assert "Traceback" not in err, err
    assert siblings(out) == []


def test_leftovers_are_found_by_exact_name_and_removed_only_when_their_run_is_dead(tmp_path, capsys):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    alive = os.getppid()  # pytest's parent: alive throughout
    out = tmp_path / "out"
    made = {
        f".out.mconvert-tmp-{dead.pid}": False,  # a killed run's: removed
        f".out.mconvert-tmp-{alive}": True,  # a run in progress: kept
        f".out.mconvert-tmp-notes-{dead.pid}": True,  # a user's: not our name
        f".out.mconvert-tmp-old-backup-{dead.pid}": True,  # a user's: not our name (a glob would rename it to OUT)
        f".out[1].mconvert-tmp-{dead.pid}": True,  # another OUT's: a glob for `out[1]` would not match, ours must
        # not remove this one when writing `out`
    }
    for name in made:
        (tmp_path / name).mkdir()
        (tmp_path / name / "f.txt").write_text(name)
    code, _, err = run_cli(["megatron-to-hf", base()["ckpt"], out], capsys)
    assert code == 0, err
    for name, kept in made.items():
        assert (tmp_path / name).is_dir() == kept, name
        if kept:
            assert (tmp_path / name / "f.txt").read_text() == name


@pytest.mark.parametrize("kind", ["dir", "file"])
def test_a_signal_landing_right_after_the_temporary_directory_is_made_removes_it(tmp_path, monkeypatch, kind):
    """The temporary directory is made inside the block that removes it: a SIGTERM / SIGHUP whose handler runs
    on the very next line (what the test above hits when the signal wins the race) leaves nothing behind."""
    from mconvert.io import atomic

    made = atomic._make_tmp

    def made_then_signalled(tmp, out):
        made(tmp, out)
        atomic._raise_terminated(signal.SIGHUP, None)

    monkeypatch.setattr(atomic, "_make_tmp", made_then_signalled)
    opener = atomic.atomic_output_dir if kind == "dir" else atomic.atomic_output_file
    with pytest.raises(SystemExit) as e:
        with opener(tmp_path / "out"):
            pass
    assert e.value.code == 128 + signal.SIGHUP
    assert sorted(p.name for p in tmp_path.iterdir()) == []
