"""Importing mconvert changes no process-wide state: tuning (threads, heap, collector, huge pages) is the CLI's."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from mconvert.io import tuning

# Modules whose import may fail for want of an optional dependency. None today: every module imports what is
# not a declared dependency where it uses it, so each import below must succeed.
OPTIONAL_IMPORTS: frozenset[str] = frozenset()

PROBE = r"""
import gc, json, os, pathlib, sys, importlib
import torch
before = {"env": dict(os.environ), "threads": torch.get_num_threads(), "interop": torch.get_num_interop_threads(),
          "gc_threshold": gc.get_threshold(), "gc_frozen": gc.get_freeze_count(), "gc_enabled": gc.isenabled()}
import mconvert
root = pathlib.Path(mconvert.__file__).parent
names = sorted(".".join(("mconvert",) + p.relative_to(root).with_suffix("").parts).removesuffix(".__init__")
               for p in root.rglob("*.py"))
failed = {}
for n in names:
    try:
        importlib.import_module(n)
    except ImportError as e:
        failed[n] = f"{type(e).__name__}: {e}"
imported = [n for n in names if n in sys.modules]
after = {"env": dict(os.environ), "threads": torch.get_num_threads(), "interop": torch.get_num_interop_threads(),
         "gc_threshold": gc.get_threshold(), "gc_frozen": gc.get_freeze_count(), "gc_enabled": gc.isenabled()}
print(json.dumps({"before": before, "after": after, "names": names, "failed": failed, "imported": imported}))
"""


@pytest.mark.timeout(300)
def test_importing_mconvert_changes_no_process_state():
    """Every module of the package (each .py file) is imported in one fresh interpreter; the settings the CLI's
    tuning changes are the same after as before."""
    env = {k: v for k, v in os.environ.items() if k != "THP_MEM_ALLOC_ENABLE"}
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[1])
    r = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, env=env, timeout=280)
    assert r.returncode == 0, r.stderr[-2000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert set(got["failed"]) <= OPTIONAL_IMPORTS, got["failed"]
    assert got["imported"] == [n for n in got["names"] if n not in got["failed"]]
    assert {"mconvert.cli", "mconvert.io.tuning", "mconvert.trainer.main"} <= set(got["imported"])
    before, after = got["before"], got["after"]
    assert "THP_MEM_ALLOC_ENABLE" not in after["env"]
    assert after["env"] == before["env"]
    assert after == before


def _probe(code: str) -> Any:
    """The JSON `code` prints last, run in a fresh interpreter with this checkout on the path."""
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_cli_applies_tuning_and_library_does_not(tmp_path):
    """`tuning.apply()` is what the CLI's conversion verbs call: it changes exactly the settings it names."""
    probe = ("import gc, os, torch, json; from mconvert.io import tuning; "
             "os.environ.pop('THP_MEM_ALLOC_ENABLE', None); t0 = torch.get_num_threads(); tuning.apply(); "
             "print(json.dumps({'thp': os.environ.get('THP_MEM_ALLOC_ENABLE'), 'frozen': gc.get_freeze_count(), "
             "'threshold': gc.get_threshold()[0], 'threads': torch.get_num_threads(), 't0': t0, "
             "'cores': len(os.sched_getaffinity(0))}))")
    got = _probe(probe)
    assert got["thp"] == (None if tuning.host_takes_back_huge_pages() else "1")
    assert got["frozen"] > 0 and got["threshold"] == 50_000
    assert got["threads"] == min(got["t0"], max(1, got["cores"] - 1))


def test_a_torch_free_verb_takes_back_the_huge_page_default_but_not_a_users_setting():
    """hf-to-gguf (`tuning.apply(with_torch=False)`) has no torch allocator to tune: the pool's buffers stay on
    4 KiB pages unless the user asked for huge pages."""
    probe = ("import os, json; from mconvert.io import tuning; out = []\n"
             "for user in (None, '1'):\n"
             "    os.environ.pop('THP_MEM_ALLOC_ENABLE', None)\n"
             "    if user: os.environ['THP_MEM_ALLOC_ENABLE'] = user\n"
             "    tuning.huge_pages(); was = os.environ.get('THP_MEM_ALLOC_ENABLE'); tuning.apply(with_torch=False)\n"
             "    out.append([was, os.environ.get('THP_MEM_ALLOC_ENABLE')])\n"
             "print(json.dumps(out))")
    default = None if tuning.host_takes_back_huge_pages() else "1"
    assert _probe(probe) == [[default, None], ["1", "1"]]


def _sysfs(root: Path, order: int | None, balloon_features: str | None, huge: int = 2 << 20) -> Path:
    """A /sys of a machine: the page-reporting order (None: no page reporting), the huge page size, a virtio
    net device and, unless None, a balloon device with the given feature bits."""
    (root / "kernel/mm/transparent_hugepage").mkdir(parents=True)
    (root / "kernel/mm/transparent_hugepage/hpage_pmd_size").write_text(f"{huge}\n")
    if order is not None:
        (root / "module/page_reporting/parameters").mkdir(parents=True)
        (root / "module/page_reporting/parameters/page_reporting_order").write_text(f"{order}\n")
    for name, dev, features in (("virtio0", "0x0001", "1" * 64), ("virtio1", "0x0005", balloon_features)):
        if features is not None:
            (root / "bus/virtio/devices" / name).mkdir(parents=True)
            (root / "bus/virtio/devices" / name / "device").write_text(dev + "\n")
            (root / "bus/virtio/devices" / name / "features").write_text(features + "\n")
    return root


REPORTING = "011001" + "0" * 58  # the balloon's feature bits: stats, deflate on OOM, free page reporting (bit 5)


@pytest.mark.parametrize("order,features,huge,want", [
    (9, REPORTING, 2 << 20, True),  # free 2 MB blocks go back to the host: no huge pages by default
    (11, REPORTING, 2 << 20, False),  # only 8 MB blocks are reported
    (9, "011000" + "0" * 58, 2 << 20, False),  # a balloon without free page reporting
    (9, None, 2 << 20, False),  # no balloon
    (None, REPORTING, 2 << 20, False),  # a kernel without page reporting
    (0, REPORTING, 2 << 20, True),
    (9, REPORTING, 1 << 20, False),  # huge pages smaller than the reported blocks
])
def test_huge_pages_only_where_the_host_does_not_take_them_back(tmp_path, order, features, huge, want):
    """`host_takes_back_huge_pages` reads the balloon's free page reporting and its block order from /sys:
    True only where free blocks of a huge page's size go back to the host."""
    assert tuning.host_takes_back_huge_pages(_sysfs(tmp_path, order, features, huge)) is want
    assert tuning.host_takes_back_huge_pages(tmp_path / "absent") is False
