"""Conversion on torchrun: two processes write exactly the bytes one process writes (every file, the manifest
included), each rank writes only the files it owns, and a failing rank leaves no output at all."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from mconvert.io import world as world_state
from mconvert.io.atomic import MANIFEST, check_manifest
from mconvert.convert.scaleout import World, world_from_env
from mconvert.errors import MConvertError
from safety_common import ROOT, base, flip_record_padding
from scratch import scratch_dir

pytestmark = pytest.mark.slow

SHARD = "40KB"  # several shards from the tiny model, so that both ranks own some
# torchrun's agent keeps its workers' logs in a directory of its own in the temporary directory unless given one
AGENT_LOGS = scratch_dir("mconvert-torchrun-logs-", __name__)


def _tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _torchrun(args: list[str | Path], timeout: int = 240, module: bool = True) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    for k in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           "--log-dir", str(AGENT_LOGS),
                           *(["-m", "mconvert.cli"] if module else []), *map(str, args)], env=env, capture_output=True, text=True,
                          timeout=timeout)


@pytest.fixture(scope="module")
def one_process(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The three conversion verbs run in one process (the library API)."""
    from mconvert.convert.verbs import hf_to_megatron, megatron_to_hf, reshard

    d = tmp_path_factory.mktemp("one")
    megatron_to_hf(base()["ckpt"], d / "hf", max_shard_size=SHARD)
    hf_to_megatron(base()["ref"], d / "mg", tp=2, pp=2)
    reshard(base()["ckpt"], d / "rs", tp=1, pp=2, with_optimizer=False)
    return {"hf": d / "hf", "mg": d / "mg", "rs": d / "rs"}


_SCRIPT = """
import sys
from mconvert.convert.verbs import hf_to_megatron, megatron_to_hf, reshard
ckpt, ref, out, shard = sys.argv[1:]
megatron_to_hf(ckpt, out + "/hf", max_shard_size=shard)
hf_to_megatron(ref, out + "/mg", tp=2, pp=2)
reshard(ckpt, out + "/rs", tp=1, pp=2)
"""


@pytest.mark.timeout(600)
def test_two_processes_write_the_one_process_bytes(one_process: dict[str, Path], tmp_path: Path) -> None:
    """megatron-to-hf, hf-to-megatron and reshard in one torchrun job of two processes (one process group)."""
    script = tmp_path / "job.py"
    script.write_text(_SCRIPT)
    (tmp_path / "out").mkdir()
    r = _torchrun([script, base()["ckpt"], base()["ref"], tmp_path / "out", SHARD], module=False)
    assert r.returncode == 0, r.stderr[-3000:]
    assert sorted(os.listdir(tmp_path / "out")) == ["hf", "mg", "rs"]  # no temporary directory or status left
    for verb in ("hf", "mg", "rs"):
        got, want = _tree(tmp_path / "out" / verb), _tree(one_process[verb])
        assert want and sorted(got) == sorted(want), verb
        assert [k for k in want if got[k] != want[k]] == [], verb  # manifest included
        assert check_manifest(tmp_path / "out" / verb) == []


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.timeout(600)
def test_two_machines_write_the_one_process_bytes(one_process: dict[str, Path], tmp_path: Path) -> None:
    """Two torchrun agents, each a machine of one process (`--nnodes 2`, a c10d rendezvous, LOCAL_WORLD_SIZE
    1 on each), sharing a file system: the same bytes as one process, for the three verbs."""
    script = tmp_path / "job.py"
    script.write_text(_SCRIPT)
    (tmp_path / "out").mkdir()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    for k in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    endpoint = f"127.0.0.1:{_free_port()}"
    agents = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
                                "--log-dir", str(AGENT_LOGS),
                                "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "--rdzv-id", tmp_path.name,
                                str(script), str(base()["ckpt"]), str(base()["ref"]), str(tmp_path / "out"), SHARD],
                               env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    try:
        errs = [a.communicate(timeout=180)[1] for a in agents]
    finally:
        for a in agents:
            a.kill()
    assert [a.returncode for a in agents] == [0, 0], "\n".join(e[-2000:] for e in errs)
    assert sorted(os.listdir(tmp_path / "out")) == ["hf", "mg", "rs"]
    for verb in ("hf", "mg", "rs"):
        got, want = _tree(tmp_path / "out" / verb), _tree(one_process[verb])
        assert want and sorted(got) == sorted(want), verb
        assert [k for k in want if got[k] != want[k]] == [], verb


@pytest.mark.parametrize("rank", [0, 1])
def test_each_rank_writes_only_its_own_files(one_process: dict[str, Path], tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch, rank: int) -> None:
    """A rank's part of the job alone: the shards / stages it owns, byte-identical to the one-process files;
    rank 0 alone writes index, config, tracker and tokenizer. megatron-to-hf reads only the parameters with
    a tensor in its own shards (a layer split over two shards is not read whole by both processes)."""
    from safetensors import safe_open

    from mconvert.convert.verbs import hf_to_megatron, megatron_to_hf
    from mconvert.convert.megatron.source import MegatronSource

    monkeypatch.setattr(world_state, "_WORLD", World(rank, 2))
    parts: list[set[str]] = []
    real = MegatronSource.hf_part_tasks

    def recording(self, unit, only=None):
        names, one, elements = real(self, unit, only)

        def read(name):
            part = one(name)
            parts.append(set(part))
            return part

        return names, read, elements

    monkeypatch.setattr(MegatronSource, "hf_part_tasks", recording)
    megatron_to_hf(base()["ckpt"], tmp_path / "hf", max_shard_size=SHARD)
    want = _tree(one_process["hf"])
    shards = sorted(k for k in want if k.endswith(".safetensors"))
    assert len(shards) >= 4
    got = {k: v for k, v in _tree(tmp_path / "hf").items() if k != MANIFEST}
    mine = [s for i, s in enumerate(shards) if i % 2 == rank]
    shared = [k for k in want if not k.endswith(".safetensors") and k != MANIFEST]
    assert sorted(got) == sorted(mine + (shared if rank == 0 else []))
    assert all(got[k] == want[k] for k in got)
    own: set[str] = set()
    for f in mine:
        with safe_open(tmp_path / "hf" / f, "pt") as h:
            own |= set(h.keys())
    every: set[str] = set()
    for f in shards:
        with safe_open(one_process["hf"] / f, "pt") as h:
            every |= set(h.keys())
    assert own <= set().union(*parts)
    assert all(p & own for p in parts), [sorted(p) for p in parts if not p & own]
    assert len(set().union(*parts)) < len(every)

    hf_to_megatron(base()["ref"], tmp_path / "mg", tp=2, pp=2)
    want = _tree(one_process["mg"])
    got = {k: v for k, v in _tree(tmp_path / "mg").items() if k != MANIFEST}
    stage = f"_{rank:03d}/model_optim_rng.pt"
    mine = [k for k in want if k.endswith(stage)]
    shared = [k for k in want if not k.endswith(".pt") and k != MANIFEST]
    assert len(mine) == 2 and sorted(got) == sorted(mine + (shared if rank == 0 else []))
    assert all(got[k] == want[k] for k in got)


def _flip_tensor_byte(path: Path) -> None:
    """One bit inside the first tensor record: same size, a valid zip, a wrong CRC-32."""
    with zipfile.ZipFile(path) as z:
        info = next(i for i in z.infolist() if i.filename.endswith("data/0"))
    data = bytearray(path.read_bytes())
    n = int.from_bytes(data[info.header_offset + 26:info.header_offset + 28], "little")
    m = int.from_bytes(data[info.header_offset + 28:info.header_offset + 30], "little")
    data[info.header_offset + 30 + n + m + 16] ^= 0x01
    path.write_bytes(bytes(data))


def assert_a_failing_rank_leaves_no_output(ckpt: Path, tmp_path: Path, argv: list) -> None:
    """A copy of `ckpt` without its manifest (only the CRC-32 guards it) with one tensor byte flipped in a file
    that process 1 alone checks; `argv` (the verb, then SRC and OUT as "{src}" and "{out}") run on 2
    processes must exit non-zero within the timeout naming that file, and leave neither OUT nor any
    temporary directory."""
    import shutil

    src = tmp_path / "ckpt"
    shutil.copytree(ckpt, src)
    (src / MANIFEST).unlink()
    files = sorted(src.rglob("model_optim_rng.pt"))
    theirs = [f for f in files if World(1, 2).owns_path(f)]
    assert theirs and len(theirs) < len(files)
    _flip_tensor_byte(theirs[0])
    outdir = tmp_path / "outs"
    outdir.mkdir()
    r = _torchrun([{"{src}": src, "{out}": outdir / "out"}.get(a, a) for a in argv], timeout=240)
    assert r.returncode != 0
    assert "CRC-32" in r.stderr and str(theirs[0]) in r.stderr
    assert os.listdir(outdir) == []


@pytest.mark.timeout(300)
def test_a_failing_rank_leaves_no_output(tmp_path: Path) -> None:
    """Rank 1 alone checks the CRC-32 of some input files; one of them is corrupt: rank 1 fails, and the
    whole job with it."""
    assert_a_failing_rank_leaves_no_output(base()["ckpt"], tmp_path,
                                           ["megatron-to-hf", "{src}", "{out}", "--max-shard-size", SHARD])


_RANK_0_FAILS_FIRST = """
import signal, sys, time
from pathlib import Path
import torch
from mconvert.layouts.megatron import save_rank_file
from mconvert.convert.scaleout import shared_atomic_output_dir, world_from_env
from mconvert.errors import MConvertError

def job():
    with shared_atomic_output_dir(sys.argv[1]) as tmp:
        if world_from_env().rank == 0:
            (tmp / "config.json").write_text("{}")
            raise MConvertError("rank 0 fails first")
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # torchrun's stop must not come before the write below
        deadline = time.monotonic() + 60
        while tmp.is_dir() and time.monotonic() < deadline:
            time.sleep(0.005)
        save_rank_file(tmp / "release" / "mp_rank_01_000" / "model_optim_rng.pt", {"x": torch.zeros(2)})

try:
    job()
except MConvertError as e:
    print("Error:", e, file=sys.stderr)
    sys.exit(1)
"""


@pytest.mark.timeout(300)
def test_rank_0_failing_first_leaves_no_output(tmp_path: Path) -> None:
    """Rank 0 fails and removes the temporary directory while rank 1 still converts: rank 1's next file (in a
    directory it creates) fails instead of creating the directory again, and names rank 0 as the cause."""
    script = tmp_path / "job.py"
    script.write_text(_RANK_0_FAILS_FIRST)
    outdir = tmp_path / "outs"
    outdir.mkdir()
    r = _torchrun([script, outdir / "out"], module=False)
    assert r.returncode != 0
    assert os.listdir(outdir) == []
    assert "rank 0 fails first" in r.stderr
    assert "torchrun rank 1: rank 0 stopped the job" in r.stderr


def _with_changes_only_the_manifest_sees(ckpt: Path, dst: Path, ranks: tuple[int, ...]) -> list[Path]:
    """A copy of `ckpt` with its manifest in which, for each process in `ranks` (of 2), one rank file it owns
    is changed where neither torch.load nor the CRC-32 look (`flip_record_padding`); returns the changed files."""
    import shutil

    shutil.copytree(ckpt, dst)
    files = sorted(dst.rglob("model_optim_rng.pt"))
    changed = [next(f for f in files if World(r, 2).owns_path(f)) for r in ranks]
    for f in changed:
        flip_record_padding(f)
    return changed


def test_each_process_hashes_the_input_files_it_owns(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Under torchrun the input's manifest is checked file by file, each file by the process that owns it: with
    one changed file per process, each process refuses its own."""
    from mconvert.io.atomic import verify_input
    from mconvert.io.crc import deferred_crc_checks

    src = tmp_path / "ckpt"
    changed = _with_changes_only_the_manifest_sees(base()["ckpt"], src, (0, 1))
    monkeypatch.setenv("WORLD_SIZE", "2")
    for rank in (0, 1):
        monkeypatch.setenv("RANK", str(rank))
        with pytest.raises(MConvertError) as e:
            with deferred_crc_checks():
                verify_input(src)
        assert str(e.value).startswith(f"{changed[rank]}: blake3 differs from the manifest"), rank
        assert "more" not in str(e.value)


@pytest.mark.timeout(300)
def test_a_change_only_the_manifest_sees_fails_the_torchrun_job(tmp_path: Path) -> None:
    changed, = _with_changes_only_the_manifest_sees(base()["ckpt"], tmp_path / "ckpt", (1,))
    outdir = tmp_path / "outs"
    outdir.mkdir()
    r = _torchrun(["megatron-to-hf", tmp_path / "ckpt", outdir / "out", "--max-shard-size", SHARD])
    assert r.returncode != 0
    assert f"{changed}: blake3 differs from the manifest" in r.stderr
    assert os.listdir(outdir) == []


def test_world_from_env() -> None:
    assert world_from_env({}) == World(0, 1)
    assert world_from_env({"WORLD_SIZE": "4", "RANK": "3"}) == World(3, 4)
    for bad in ({"WORLD_SIZE": "2", "RANK": "2"}, {"WORLD_SIZE": "x"}, {"WORLD_SIZE": "0"}):
        with pytest.raises(MConvertError, match="RANK|WORLD_SIZE"):
            world_from_env(bad)
    w = World(0, 3)
    assert [w.owner(i) for i in range(7)] == [0, 1, 2, 0, 1, 2, 0]


def test_plan_on_nodes_shares_out_the_file_groups() -> None:
    """The torchrun estimate: file groups = shards (HF) or target stages (Megatron); more machines never
    take longer; one process is the one-process estimate plus the start."""
    from mconvert.layouts.estimate import estimate, hf_files, scaleout_estimate
    from mconvert.mappings.families import preset

    spec = preset("llama3-405b")
    bw = {"copy_bytes_per_s": 1e9, "ratio_to_cp": {"megatron-to-hf": 2.0, "reshard": 2.5}, "base_rss_bytes": 0}
    one = scaleout_estimate(estimate(spec, "hf", tp=8, pp=16, bandwidth=bw), 1, 1, start_seconds=0)
    assert one.scaleout["file_groups"] == len(hf_files(spec, 2))
    assert one.scaleout["expected_seconds"] == pytest.approx(one.expected_seconds)
    times = [scaleout_estimate(estimate(spec, "hf", tp=8, pp=16, bandwidth=bw), n, 8)
             .scaleout["expected_seconds"] for n in (1, 2, 4, 8)]
    assert times == sorted(times, reverse=True) and times[-1] < times[0] / 2
    rs = scaleout_estimate(estimate(spec, "megatron", tp=8, pp=16, target_tp=8, target_pp=8, bandwidth=bw), 4, 4)
    assert rs.scaleout["file_groups"] == 8 and rs.scaleout["busy_processes"] == 8
    assert any("only 8 of 16 processes" in n for n in rs.notes)
    net = scaleout_estimate(estimate(spec, "hf", tp=8, pp=16, bandwidth=bw), 4, 8, network_bytes_per_s=1e8)
    assert net.scaleout["bottleneck"] == "network"
    with pytest.raises(MConvertError, match="--nodes 0"):
        scaleout_estimate(estimate(spec, "hf", tp=8, pp=16, bandwidth=bw), 0, 1)
    # a converter faster than cp (cp's copy goes through the page cache; ours writes with O_DIRECT): one process
    # on one machine is still the one-process estimate, and more machines still only help
    fast = {**bw, "ratio_to_cp": {"megatron-to-hf": 0.25}}
    one = scaleout_estimate(estimate(spec, "hf", tp=8, pp=16, bandwidth=fast), 1, 1, start_seconds=0)
    assert one.scaleout["expected_seconds"] == pytest.approx(one.expected_seconds)
    times = [scaleout_estimate(estimate(spec, "hf", tp=8, pp=16, bandwidth=fast), n, 1, start_seconds=0)
             .scaleout["expected_seconds"] for n in (1, 2, 4)]
    assert times == sorted(times, reverse=True) and times[-1] < times[0] / 2


def test_processes_of_one_machine_share_its_cores(monkeypatch: pytest.MonkeyPatch) -> None:
    """torchrun's LOCAL_WORLD_SIZE processes split the cores the machine lets this process use."""
    from mconvert.io.tuning import process_cores

    cores = len(os.sched_getaffinity(0))
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert process_cores() == cores
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert process_cores() == max(1, cores // 2)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(4 * cores))
    assert process_cores() == 1


@pytest.mark.parametrize("argv", [["megatron-to-gguf", "{ckpt}", "{out}"], ["hf-to-gguf", "{ref}", "{out}"],
                                  ["to-onnx", "{ref}", "{out}"]])
def test_one_process_verbs_are_refused_under_torchrun(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                      capsys: pytest.CaptureFixture, argv: list[str]) -> None:
    """A verb that cannot share its work is refused under torchrun before anything is written (else every
    process would write the whole output and all but one would fail at the commit)."""
    from safety_common import assert_one_line_error, run_cli

    args = [a.format(ckpt=base()["ckpt"], ref=base()["ref"], out=tmp_path / "out") for a in argv]
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    code, _, err = run_cli(args, capsys)
    assert_one_line_error(code, err, f"{argv[0]} runs in one process", "torchrun")
    assert os.listdir(tmp_path) == []


@pytest.mark.timeout(120)
def test_world_size_without_torchrun_is_one_error_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                        capsys: pytest.CaptureFixture) -> None:
    from safety_common import assert_one_line_error, run_cli

    ckpt = base()["ckpt"]
    for k in ("MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    code, _, err = run_cli(["megatron-to-hf", ckpt, tmp_path / "out"], capsys)
    assert_one_line_error(code, err, "WORLD_SIZE=2", "start the job with torchrun")
    assert os.listdir(tmp_path) == []
