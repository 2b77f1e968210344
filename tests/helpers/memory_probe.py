"""Peak memory of conversions, measured as the MoE memory tests measure it: in a fresh process, each verb after a
warm-up run of it (lazy imports, thread pools, allocator arenas) on a small model and a reset of the peak, peak RSS
(VmHWM: ru_maxrss would carry the parent's peak across fork+exec) minus the RSS before the verb.

`peak_over_baseline(verbs, mg, warm, out)`: `verbs` is Python source defining `VERBS`, a dict verb -> (its source
as a template of `{mg}` and `{out}`, a call `(src, out, **kw)` of `mconvert.convert.verbs`), in the order they run
(a verb may read an earlier one's output under `{out}`); returns verb -> {"delta": the peak over the baseline,
"buffer": the HF writer's largest part (`hf_buffer_peak_bytes`, None for other outputs), "writer_buffer": the
writer's buffers as the dry run's plan states them}. An output is deleted once measured unless a later verb reads
it or the caller `keep`s it (the warm-up's once it is done): the largest of these tests writes tens of GB
otherwise."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

_HEAD = r"""
import json, shutil, sys, psutil
from pathlib import Path
from mconvert.convert import driver, verbs
from mconvert.io import tuning
tuning.apply()  # as the mconvert command does before a conversion (heap threshold, threads, gc)
mg, warm, out, keep = sys.argv[1], sys.argv[2], sys.argv[3], set(json.loads(sys.argv[4]))
"""

_LOOP = r"""
Path(out, "warm").mkdir()
for verb, (src, call) in VERBS.items():  # first on a smaller model of the same kind
    call(src.format(mg=warm, out=out + "/warm"), f"{out}/warm/{verb}")
shutil.rmtree(f"{out}/warm")
got = {}
names = list(VERBS)
for i, (verb, (src, call)) in enumerate(VERBS.items()):
    src = src.format(mg=mg, out=out)
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS now
    base = psutil.Process().memory_info().rss
    rep = call(src, f"{out}/{verb}")
    peak = driver.peak_rss_bytes()
    plan = call(src, f"{out}/{verb}.plan", dry_run=True)
    got[verb] = {"delta": peak - base, "buffer": rep.get("hf_buffer_peak_bytes"),
                 "writer_buffer": plan.get("writer_buffer_bytes")}
    for done in names[:i + 1]:  # what no later verb reads and the caller does not keep
        if done not in keep and not any("{out}/" + done in VERBS[v][0] for v in names[i + 1:]):
            for p in (Path(out, done), Path(out, done + ".mconvert-manifest.json"), Path(out, done + ".plan")):
                shutil.rmtree(p) if p.is_dir() else p.unlink(missing_ok=True)
print(json.dumps(got))
"""


def peak_over_baseline(verbs: str, mg: Path, warm: Path, out: Path, keep: tuple[str, ...] = ()) -> dict[str, dict]:
    """Each verb of `verbs` run on checkpoint `mg` (after a run on `warm`), writing under `out` (where the outputs
    of the verbs in `keep` stay); see the module."""
    out.mkdir()
    r = subprocess.run([sys.executable, "-c", _HEAD + verbs + _LOOP, str(mg), str(warm), str(out), json.dumps(keep)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(r.stdout.strip().splitlines()[-1])
