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


def test_marginal_per_input_and_startup_targets(bench) -> None:
    """HF-side verbs' marginal cost is per GB of the HF directory against cp of that directory; the start-up
    rows are held to the issue's limits (0.5 s for --help and plan, 2 s for the smallest conversion)."""
    def row(wall: float, cpu: float) -> dict:
        return {"wall_s": wall, "cpu_s": cpu, "peak_rss": 1}

    depth = {"8": {"layers": 8, "bytes": 2e9, "hf_bytes": 1e9, "cp": row(1.0, 0.5), "cp-hf": row(1.0, 0.5),
                   "megatron-to-hf": row(2.0, 2.0), "hf-to-gguf": row(1.5, 1.0)},
             "32": {"layers": 32, "bytes": 6e9, "hf_bytes": 3e9, "cp": row(3.0, 1.5), "cp-hf": row(1.4, 0.9),
                    "megatron-to-hf": row(4.4, 5.0), "hf-to-gguf": row(2.6, 2.0)}}
    m = bench.marginal(depth)
    assert m["cp"] == pytest.approx(0.5) and m["cp-hf"] == pytest.approx(0.2)
    assert m["megatron-to-hf"] == pytest.approx(0.6) and m["hf-to-gguf"] == pytest.approx(0.55)
    x = bench.marginal_ratios(m)
    assert x == pytest.approx({"megatron-to-hf": 1.2, "hf-to-gguf": 2.75})
    rep = {"preset": "gpt2-1b", "marginal_s_per_gb": m,
           "startup": {"mconvert --help": row(0.2, 0.1), "mconvert plan": row(0.6, 0.5),
                       "megatron-to-hf tiny-llama": row(1.9, 1.5)}}
    verdict = {t["target"]: t["pass"] for t in bench.targets(rep)}
    assert verdict == {"mconvert --help ≤ 0.5 s wall": True, "mconvert plan ≤ 0.5 s wall": False,
                       "megatron-to-hf tiny-llama ≤ 2 s wall": True}


def test_llama_marginal_figures(bench) -> None:
    """The Llama section's marginal cost: the difference of two depths' rows per extra GB, against cp's of the
    same input over the same bytes."""
    import gguf_peer

    def fig(nbytes: float, ours: float, cp: float) -> dict:
        return {"bytes": nbytes, "ours_wall_s": ours, "ours_cpu_s": ours / 2, "cp_wall_s": cp, "cp_cpu_s": cp / 4}

    lo = {"megatron-to-hf": fig(0.5e9, 1.0, 0.3), "hf-to-gguf": fig(0.4e9, 0.5, 0.2)}
    hi = {"megatron-to-hf": fig(1.5e9, 1.5, 0.7), "hf-to-gguf": fig(0.4e9, 0.6, 0.3)}
    out = gguf_peer.marginal_figures(lo, hi)
    assert list(out) == ["megatron-to-hf"]  # no extra bytes, no marginal figure
    r = out["megatron-to-hf"]
    assert r["ours_wall_s_per_gb"] == pytest.approx(0.5) and r["cp_wall_s_per_gb"] == pytest.approx(0.4)
    assert r["x_cp_wall"] == pytest.approx(1.25) and r["x_cp_cpu"] == pytest.approx(0.25 / 0.1)
    rep = {"llama_per_byte": {"marginal": out, "tp": 4, "pp": 2, "layers": (4, 12)}}
    (t,) = bench.targets(rep)
    assert t["target"] == "megatron-to-hf marginal wall cost ≤ 1.1 × cp's (Llama TP4 PP2)" and t["pass"] is False


def test_bridge_figures_commands_and_table(bench, tmp_path: Path, monkeypatch) -> None:
    """The Megatron-Bridge section: each direction's peer over ours from the rows' medians, the Bridge commands
    (its venv's interpreter, the helper, this process's Python variables unset, the export's HF dir beside the
    checkpoint), ours writing torch_dist, and the markdown table; a report without the venv says so."""
    import bridge_peer

    def row(wall: float, cpu: float) -> dict:
        return {"wall_s": wall, "cpu_s": cpu, "peak_rss": int(1e9), "runs": [{"wall_s": wall, "cpu_s": cpu}]}

    rows = {"cp bridge hf": row(0.8, 0.3), "Megatron-Bridge HF → Megatron": row(20.0, 12.0),
            "mconvert HF → Megatron": row(2.5, 2.0), "Megatron-Bridge Megatron → HF": row(18.0, 9.0),
            "mconvert Megatron → HF": row(3.0, 3.0)}
    hf = tmp_path / "llama-1.3gb"
    assert [j[0] for j in bridge_peer.jobs(hf)] == list(rows)
    assert {j[0]: j[2] for j in bridge_peer.jobs(hf)}["mconvert Megatron → HF"] == tmp_path / "llama-1.3gb-bridge"
    figs = bridge_peer.figures(rows, int(1.6e9))
    assert figs["HF → Megatron"]["speedup"] == pytest.approx(8.0)
    assert figs["HF → Megatron"]["cpu_speedup"] == pytest.approx(6.0)
    assert figs["Megatron → HF"]["speedup"] == pytest.approx(6.0)
    assert figs["Megatron → HF"]["ours"]["wall_s_per_gb"] == pytest.approx(3.0 / 1.6)
    assert figs["Megatron → HF"]["peer"]["x_cp"] == pytest.approx(18.0 / 0.8)

    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").write_text("")
    monkeypatch.setenv("BRIDGE_VENV", str(venv))
    monkeypatch.setenv("PYTHONPATH", "/somewhere")
    exp = bridge_peer.command("bridge:export", tmp_path / "llama-1.3gb-bridge", tmp_path / "out", ["mc"])
    assert exp[0] == "env" and "--unset=PYTHONPATH" in exp and "CUDA_VISIBLE_DEVICES=" in exp
    py, ckpt = str(venv / "bin" / "python"), str(tmp_path / "llama-1.3gb-bridge")
    assert exp[-6:] == [py, str(bridge_peer.HELPER), "export", str(hf), ckpt, str(tmp_path / "out")]
    imp = bridge_peer.command("bridge:import", hf, tmp_path / "o", ["mc"])
    assert imp[-5:] == [py, str(bridge_peer.HELPER), "import", str(hf), str(tmp_path / "o")]
    assert bridge_peer.command("hf-to-megatron-dist", hf, tmp_path / "o", ["mc"]) == [
        "mc", "hf-to-megatron", str(hf), str(tmp_path / "o"), "--format", "torch_dist"]
    monkeypatch.setenv("BRIDGE_VENV", str(tmp_path / "none"))
    assert bridge_peer.python() is None
    md = "\n".join(bench.bridge_markdown({"bridge": {"rows": figs, "model": "llama-1.3gb", "load": (1.0, 1.0, 1.0),
                                                     "cpus": 2}}))
    assert "| HF → Megatron | mconvert hf-to-megatron --format torch_dist | 2.50 | 2.00 |" in md
    assert "| 8.00 | 6.00 |" in md and "Megatron-Bridge export_ckpt" in md
    assert bench.bridge_markdown({"bridge": {"left_out": "no venv"}}) == ["", "Megatron-Bridge section left out: no venv."]
