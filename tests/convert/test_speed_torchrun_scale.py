"""torchrun's loose ends: rank 0's report lists every rank's files (table and --json, one document), a
TensorRT-LLM process cuts only its own rank files' tensors, and `plan --to trtllm` estimates the rank files
(bytes as the written files hold them) and their torchrun share-out."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from safetensors import safe_open

from mconvert.io import world as world_state
from mconvert.convert.scaleout import World
from safety_common import base
from test_speed_torchrun import _torchrun

SHARD = "40KB"  # several shards from the tiny model, so that both ranks own some


@pytest.fixture(scope="module")
def one_process_report(tmp_path_factory: pytest.TempPathFactory) -> dict:
    from mconvert.convert.verbs import megatron_to_hf

    return megatron_to_hf(base()["ckpt"], tmp_path_factory.mktemp("one") / "hf", max_shard_size=SHARD)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_rank0_report_lists_every_ranks_files(one_process_report: dict, tmp_path: Path) -> None:
    """--json on torchrun: exactly one JSON document on stdout (rank 1 prints nothing), whose files are the
    one-process report's files, each named with the rank that wrote it (shard i: rank i mod 2; the shared files:
    rank 0); the table on stderr has the rank column."""
    r = _torchrun(["megatron-to-hf", base()["ckpt"], tmp_path / "hf", "--max-shard-size", SHARD, "--json"])
    assert r.returncode == 0, r.stderr[-3000:]
    report = json.loads(r.stdout)  # a second document would make this raise
    assert report["processes"] == 2
    want = one_process_report["files"]
    assert [(f["path"], f["bytes"]) for f in report["files"]] == [(f["path"], f["bytes"]) for f in want]
    shards = sorted(f["path"] for f in want if f["path"].endswith(".safetensors"))
    assert len(shards) >= 4
    for f in report["files"]:
        assert f["rank"] == (shards.index(f["path"]) % 2 if f["path"] in shards else 0), f
    assert not any(".status" in f["path"] for f in report["files"])

    r = _torchrun(["megatron-to-hf", base()["ckpt"], tmp_path / "hf2", "--max-shard-size", SHARD])
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stderr.count("megatron-to-hf →") == 1  # one table, rank 0's
    assert "rank" in r.stderr and all(s in r.stderr for s in shards)


def test_trtllm_process_cuts_only_its_rank_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Process 1 of 2 at --tp 4 writes rank1 and rank3: every cutting form is asked for those two ranks' tensors
    only (the other ranks' copies are never made), and its files hold the one-process bytes."""
    from collections.abc import Sequence

    from mconvert.convert.driver import drive
    from mconvert.convert.sources import open_source
    from mconvert.convert.deploy.trtllm import TrtllmWriter, prepare
    from mconvert.convert.verbs import megatron_to_trtllm
    from mconvert.mappings import deploy

    megatron_to_trtllm(base()["ckpt"], tmp_path / "one", tp=4)
    asked: list[tuple[str, int]] = []

    class Recording(Sequence):
        def __init__(self, form: str, inner: Sequence) -> None:
            self.form, self.inner = form, inner

        def __len__(self) -> int:
            return len(self.inner)

        def __getitem__(self, r: int):  # type: ignore[override]
            asked.append((self.form, r))
            return self.inner[r]

    def recording(form: str, f):
        return lambda *a: Recording(form, f(*a))

    forms = {k: recording(k, f) for k, f in deploy.FORMS.items()}
    monkeypatch.setattr(deploy, "FORMS", forms)
    monkeypatch.setattr(world_state, "_WORLD", World(1, 2))  # process 1's part alone, its writer driven
    src = open_source(base()["ckpt"])
    (tmp_path / "r1").mkdir()
    drive(src, TrtllmWriter(tmp_path / "r1", prepare(src.spec, 4, source=str(src.path))))
    src.close()
    assert {f for f, _ in asked} >= {"qkv_cat", "split"}  # the fused QKV (a copy per rank) was cut here
    assert sorted({r for _, r in asked}) == [1, 3]
    assert sorted(p.name for p in (tmp_path / "r1").glob("rank*")) == ["rank1.safetensors", "rank3.safetensors"]
    for name in ("rank1.safetensors", "rank3.safetensors"):
        assert (tmp_path / "r1" / name).read_bytes() == (tmp_path / "one" / name).read_bytes()


def test_plan_to_trtllm_matches_the_written_rank_files(tmp_path: Path) -> None:
    """`plan --to trtllm`: each rank file's tensor bytes as safetensors (not our code) reads them back from a
    real megatron-to-trtllm output; on torchrun the rank files are the groups and each busy process reads the
    whole input."""
    from mconvert.layouts.estimate import estimate, scaleout_estimate
    from mconvert.convert.sources import open_source
    from mconvert.convert.verbs import megatron_to_trtllm

    megatron_to_trtllm(base()["ckpt"], tmp_path / "trt", tp=2)
    src = open_source(base()["ckpt"])
    spec = src.spec
    src.close()
    bw = {"copy_bytes_per_s": 1e9, "ratio_to_cp": {}, "base_rss_bytes": 0}
    est = estimate(spec, "trtllm", tp=2, pp=2, target_tp=2, bandwidth=bw)
    assert est.operation == "megatron-to-trtllm" and est.target == "trtllm TP=2"
    written = {}
    for r in range(2):
        with safe_open(str(tmp_path / "trt" / f"rank{r}.safetensors"), "pt") as f:
            written[f"rank{r}.safetensors"] = sum(f.get_tensor(k).numel() * f.get_tensor(k).element_size()
                                                  for k in f.keys())
    planned = {f["path"]: f["bytes"] for f in est.files["write"]}
    assert {k: planned[k] for k in written} == written
    assert planned["config.json"] == (tmp_path / "trt" / "config.json").stat().st_size

    so = scaleout_estimate(estimate(spec, "trtllm", tp=2, pp=2, target_tp=2, bandwidth=bw), 1, 4,
                           start_seconds=0).scaleout
    assert so["file_groups"] == 2 and so["busy_processes"] == 2
    assert so["largest_node_io_bytes"] == pytest.approx(2 * (est.read_bytes + written["rank0.safetensors"]))


def test_plan_to_trtllm_on_the_command_line() -> None:
    """The CLI verb: --to trtllm with --target-tp and --nodes; a TP that does not divide the heads is one
    error line."""
    import subprocess
    import sys

    from safety_common import ROOT

    env = {"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}
    ok = subprocess.run([sys.executable, "-m", "mconvert.cli", "plan", "--preset", "llama3-405b", "--tp", "8",
                         "--pp", "16", "--to", "trtllm", "--target-tp", "8", "--nodes", "2", "--procs-per-node", "8",
                         "--json"], env=env, capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0, ok.stderr
    d = json.loads(ok.stdout)
    assert d["operation"] == "megatron-to-trtllm" and d["write_files"] == 9
    assert d["scaleout"]["busy_processes"] == 8 and d["scaleout"]["file_groups"] == 8
    bad = subprocess.run([sys.executable, "-m", "mconvert.cli", "plan", "--preset", "llama3-405b", "--tp", "8",
                          "--to", "trtllm", "--target-tp", "3"], env=env, capture_output=True, text=True, timeout=120)
    assert bad.returncode == 1
    assert bad.stderr.strip().splitlines() == [bad.stderr.strip()] and "--tp 3 does not divide" in bad.stderr


def _flip_record_byte(path: Path, suffix: str, at: int = 0) -> None:
    """One bit inside the record whose name ends with `suffix`: same size, a valid zip, a wrong CRC-32."""
    import zipfile

    with zipfile.ZipFile(path) as z:
        info = next(i for i in z.infolist() if i.filename.endswith(suffix))
    data = bytearray(path.read_bytes())
    n = int.from_bytes(data[info.header_offset + 26:info.header_offset + 28], "little")
    m = int.from_bytes(data[info.header_offset + 28:info.header_offset + 30], "little")
    data[info.header_offset + 30 + n + m + at] ^= 0x01
    path.write_bytes(bytes(data))


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_corrupt_record_no_reader_claims_is_refused_on_torchrun(tmp_path: Path) -> None:
    """The records no conversion reads (here `.data/serialization_id`) are checked by the one rank that owns the
    file: a flipped bit there still fails the job with the CRC-32 refusal naming the file, and no output."""
    import shutil

    from mconvert.io.atomic import MANIFEST

    src = tmp_path / "ckpt"
    shutil.copytree(base()["ckpt"], src)
    (src / MANIFEST).unlink()  # only the CRC-32 guards it
    victim = sorted(src.rglob("model_optim_rng.pt"))[-1]
    _flip_record_byte(victim, ".data/serialization_id")
    (tmp_path / "outs").mkdir()
    r = _torchrun(["megatron-to-hf", src, tmp_path / "outs" / "hf", "--max-shard-size", SHARD], timeout=240)
    assert r.returncode != 0
    assert "CRC-32" in r.stderr and str(victim) in r.stderr and "serialization_id" in r.stderr
    assert list((tmp_path / "outs").iterdir()) == []


def test_rank0_checks_only_the_records_no_rank_read(tmp_path: Path) -> None:
    """`check_unread` (rank 0, from every rank's tally): a claimed record another rank checked on its reads is
    not read again, even when its bytes are now bad; one that no rank read whole is checked, and refused."""
    import shutil
    import zipfile

    from mconvert.io.crc import ZipRecords, check_unread
    from mconvert.errors import MConvertError

    f = tmp_path / "model_optim_rng.pt"
    shutil.copy(sorted(base()["ckpt"].rglob("model_optim_rng.pt"))[0], f)
    with zipfile.ZipFile(f) as z:
        name = next(i.filename for i in z.infolist() if i.filename.endswith("data/0"))
    recs = ZipRecords.parse(f)
    assert recs is not None
    offset = next(o for o, (_, _, n) in recs.entries.items() if n == name)
    _flip_record_byte(f, "data/0", at=16)
    read_by_rank1 = [{str(f): {"done": [], "left": [offset]}}, {str(f): {"done": [offset], "left": []}}]
    check_unread(read_by_rank1)  # rank 1 checked it on the bytes it converted: not read a second time
    with pytest.raises(MConvertError, match=r"CRC-32.*re-copy") as e:
        check_unread([{str(f): {"done": [], "left": [offset]}}, {str(f): {"done": [], "left": [offset]}}])
    assert str(f) in str(e.value) and name in str(e.value)
