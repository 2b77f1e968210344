"""Importing mconvert changes no process-wide state: tuning (threads, heap, collector, huge pages) is the CLI's."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

PROBE = r"""
import gc, json, os, pkgutil, importlib
import torch
before = {"env": dict(os.environ), "threads": torch.get_num_threads(), "interop": torch.get_num_interop_threads(),
          "gc_threshold": gc.get_threshold(), "gc_frozen": gc.get_freeze_count(), "gc_enabled": gc.isenabled()}
import mconvert
names = ["mconvert"]
for pkg in ("mconvert", "mconvert.convert", "mconvert.convert.io", "mconvert.mappings", "mconvert.trainer",
            "mconvert.validators"):
    importlib.import_module(pkg)
    names += [f"{pkg}.{m.name}" for m in pkgutil.iter_modules(importlib.import_module(pkg).__path__)]
for n in names:
    try:
        importlib.import_module(n)
    except ImportError as e:  # an optional dependency of one module: say which
        print("skip", n, e)
after = {"env": dict(os.environ), "threads": torch.get_num_threads(), "interop": torch.get_num_interop_threads(),
         "gc_threshold": gc.get_threshold(), "gc_frozen": gc.get_freeze_count(), "gc_enabled": gc.isenabled()}
print(json.dumps({"before": before, "after": after, "modules": len(names)}))
"""


@pytest.mark.timeout(300)
def test_importing_mconvert_changes_no_process_state():
    env = {k: v for k, v in os.environ.items() if k != "THP_MEM_ALLOC_ENABLE"}
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[1])
    r = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, env=env, timeout=280)
    assert r.returncode == 0, r.stderr[-2000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["modules"] > 30  # every module of every subpackage was imported
    before, after = got["before"], got["after"]
    assert "THP_MEM_ALLOC_ENABLE" not in after["env"]
    assert after["env"] == before["env"]
    assert after == before


def test_cli_applies_tuning_and_library_does_not(tmp_path):
    """`tuning.apply()` is what the CLI's conversion verbs call: it changes exactly the settings it names."""
    probe = ("import gc, os, torch, json; from mconvert.convert.io import tuning; "
             "os.environ.pop('THP_MEM_ALLOC_ENABLE', None); t0 = torch.get_num_threads(); tuning.apply(); "
             "print(json.dumps({'thp': os.environ.get('THP_MEM_ALLOC_ENABLE'), 'frozen': gc.get_freeze_count(), "
             "'threshold': gc.get_threshold()[0], 'threads': torch.get_num_threads(), 't0': t0, "
             "'cores': len(os.sched_getaffinity(0))}))")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    r = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["thp"] == "1" and got["frozen"] > 0 and got["threshold"] == 50_000
    assert got["threads"] == min(got["t0"], max(1, got["cores"] - 1))
