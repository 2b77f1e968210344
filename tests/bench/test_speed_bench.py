"""The bench's new figures on a synthetic report (made-up numbers, no timing): the marginal s/GB between two
depths, the CPU s/GB column, the torchrun target, and every command ending with sync."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"


@pytest.fixture(scope="module")
def bench():
    sys.path.insert(0, str(BENCH))
    import bench as b

    return b


def _op(wall: float) -> dict:
    return {"wall_s": wall, "cpu_s": wall, "peak_rss": int(0.8e9), "peak_anon": 0, "ratio_to_cp": wall,
            "cpu_ratio_to_cp": wall, "rss_ratio_to_cp": 1.0, "cpu_s_per_gb": wall / 3.3}


def test_marginal_cost_and_torchrun_target(bench) -> None:
    depth = {"8": {"layers": 8, "bytes": 1.6e9, "megatron-to-hf": _op(3.0), "reshard": _op(2.0),
                   "hf-to-megatron": _op(2.5)},
             "32": {"layers": 32, "bytes": 6.4e9, "megatron-to-hf": _op(6.0), "reshard": _op(8.0),
                    "hf-to-megatron": _op(9.7)}}
    m = bench.marginal(depth)
    assert m == pytest.approx({"megatron-to-hf": 3.0 / 4.8, "reshard": 6.0 / 4.8, "hf-to-megatron": 7.2 / 4.8})
    rep = {"preset": "gpt2-1b", "repeats": 3, "machine": {"cpus": 2, "date": "now"},
           "model": {"layers": 16, "parameters": 8e8, "largest_layer_bytes": 2e8, "largest_unit_bytes": 2e8},
           "build": {"files": 12, "bytes": 3.3e9}, "cache": {"warm": True},
           "ops": {"cp": _op(1.0), "megatron-to-hf": _op(1.9), "reshard": _op(2.0),
                   "megatron-to-hf 1GB shards": _op(3.0),
                   "megatron-to-hf 1GB shards, torchrun 1 process": _op(2.2),
                   "megatron-to-hf 1GB shards, torchrun 2 processes": _op(2.4)},
           "depth": depth, "marginal_s_per_gb": m}
    verdict = {t["target"]: t["pass"] for t in bench.targets(rep)}
    assert verdict["megatron-to-hf marginal cost ≤ 1.0 s/GB"] is True
    assert verdict["hf-to-megatron marginal cost ≤ 1.0 s/GB"] is False
    assert verdict["torchrun with 2 processes no slower than 1 process"] is True
    launcher = "torchrun with 2 processes no slower than torchrun with 1 process (launcher on both sides)"
    assert verdict[launcher] is False
    assert next(t["value"] for t in bench.targets(rep) if t["target"] == launcher) == pytest.approx(2.4 / 2.2)
    rep["targets"] = bench.targets(rep)
    md = bench.markdown(rep)
    assert "hf-to-megatron 1.50 s/GB" in md and "CPU s/GB" in md and "sync -f" in md


def test_every_measured_command_ends_with_sync(bench, tmp_path: Path) -> None:
    import subprocess

    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "f").write_bytes(b"x" * 100)
    cmd = bench.op_command("cp", tmp_path / "src", tmp_path / "out")
    assert cmd[:2] == ["sh", "-c"] and "sync -f" in cmd[2]
    subprocess.run(cmd, check=True)
    assert (tmp_path / "out" / "f").read_bytes() == b"x" * 100
    for n in ("1", "2"):
        cmd = bench.op_command(f"megatron-to-hf-torchrun{n}", tmp_path / "src", tmp_path / "o2")
        assert cmd[4:10] == [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", n]


def test_ab_compares_every_output_file(tmp_path) -> None:
    """`bench/ab.py` (make bench-ab) names a file whose bytes differ between the two versions' outputs, and one
    that only one of them wrote; identical trees give none."""
    sys.path.insert(0, str(BENCH))
    import ab

    a, b = tmp_path / "a", tmp_path / "b"
    for root in (a, b):
        (root / "iter_0000001" / "mp_rank_00").mkdir(parents=True)
        (root / "config.json").write_text('{"x": 1}')
        (root / "iter_0000001" / "mp_rank_00" / "model_optim_rng.pt").write_bytes(bytes(range(256)) * 4)
    assert ab.differing_files(a, b) == []
    (b / "iter_0000001" / "mp_rank_00" / "model_optim_rng.pt").write_bytes(bytes(range(256)) * 3 + bytes(256))
    (a / "extra.safetensors").write_bytes(b"\0")
    assert ab.differing_files(a, b) == ["extra.safetensors", "iter_0000001/mp_rank_00/model_optim_rng.pt"]
