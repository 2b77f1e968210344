"""Byte-level fuzz over checkpoint files: flip, zero or truncate random bytes of a tiny checkpoint's `.pt`,
`.safetensors`, `config.json` and `latest_checkpointed_iteration.txt`, run the real conversion, and classify.

Every case must end in one of:
  refused     exit 1, one `error:` line, no traceback, no OUT;
  same        exit 0 and the output equals the undamaged conversion (the bytes did not matter);
  undetectable  exit 0 and a different output, where EVERY damaged byte lies inside raw tensor data (or the
              damaged config.json is still valid JSON describing another model). safetensors and config.json
              carry no checksums: no reader can tell such a change from a real weight. A `.pt` carries torch's
              per-entry CRC-32, which mconvert checks (torch.load does not): with it, "undetectable" is not
              allowed for `.pt` damage. The `megatron-nocrc` group turns the check off, as for a file saved
              without CRCs, to exercise the readers' own checks. A checkpoint mconvert wrote (it has a
              manifest) is protected entirely — every damage to one of those is refused.
Anything else — a traceback, a hang (alarm), or a changed output from damage outside tensor data — fails.
Deterministic: the cases come from one seeded RNG.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import struct
import zipfile
from collections import Counter
from pathlib import Path

import pytest
import torch
from safety_common import assert_one_line_error, base, copy_of, hf_tensors, run_cli

from mconvert.io.safeload import safe_load
from mconvert.mappings.families import spec_from_megatron_args

RANK_FILES = [f"release/mp_rank_{t:02d}_{p:03d}/model_optim_rng.pt" for t in range(2) for p in range(2)]
TRACKER = "latest_checkpointed_iteration.txt"
OUTCOMES: Counter = Counter()
RAN: set[tuple[str, str, str, int]] = set()  # the cases classified in this process


def _cases() -> list[tuple[str, str, str, int]]:
    """(direction, file, mutation, seed). direction: megatron (no manifest), hf, protected (with manifest)."""
    rng = random.Random(int(os.environ.get("MCONVERT_FUZZ_SEED", "20260601")))
    scale = int(os.environ.get("MCONVERT_FUZZ_SCALE", "1"))  # more cases for a longer, exploratory run
    cases = []
    for direction in ("megatron", "megatron-nocrc"):
        for _ in range(20 * scale):
            f = rng.choice(RANK_FILES * 3 + [TRACKER])
            mutation = rng.choice(["flip", "meta", "meta", "zero", "truncate"])
            cases.append((direction, f, mutation, rng.randrange(1 << 30)))
    for _ in range(10 * scale):
        f = rng.choice(["model.safetensors"] * 2 + ["config.json"])
        cases.append(("hf", f, rng.choice(["flip", "meta", "zero", "truncate"]), rng.randrange(1 << 30)))
    for _ in range(6 * scale):
        f = rng.choice(RANK_FILES + [TRACKER])
        cases.append(("protected", f, rng.choice(["flip", "zero", "truncate"]), rng.randrange(1 << 30)))
    return cases


def _damage(path: Path, mutation: str, seed: int) -> dict[int, int] | None:
    """Damage `path` in place; returns {offset: new byte} of what changed (None for a truncation).

    flip: 1-8 random bytes anywhere; meta: 1-3 bytes outside raw tensor data (pickle, zip records, safetensors
    header); zero: a run of up to 64 bytes; truncate: cut at a random length."""
    rng = random.Random(seed)
    orig = path.read_bytes()
    data = bytearray(orig)
    if mutation == "truncate":
        path.write_bytes(orig[: rng.randrange(0, len(orig))])
        return None
    if mutation in ("flip", "meta"):
        regions = _tensor_regions(path) if mutation == "meta" else []
        candidates = [i for i in range(len(data)) if not any(a <= i < b for a, b in regions)]
        for _ in range(rng.randint(1, 8 if mutation == "flip" else 3)):
            i = rng.choice(candidates)
            data[i] ^= rng.randint(1, 255)
    else:  # zero a run of bytes
        start = rng.randrange(len(data))
        for i in range(start, min(len(data), start + rng.randint(1, 64))):
            data[i] = 0
    path.write_bytes(bytes(data))
    return {i: data[i] for i in range(len(data)) if data[i] != orig[i]}


def _tensor_regions(path: Path) -> list[tuple[int, int]]:
    """[start, end) byte ranges holding raw tensor data in an undamaged .pt (zip) or .safetensors file."""
    if path.suffix == ".safetensors":
        raw = path.read_bytes()
        header = struct.unpack("<Q", raw[:8])[0]
        return [(8 + header, len(raw))]
    if path.suffix == ".pt":
        regions = []
        raw = path.read_bytes()
        with zipfile.ZipFile(path) as z:
            for info in z.infolist():
                parts = info.filename.split("/")
                if len(parts) >= 2 and parts[-2] == "data" and parts[-1].isdigit():
                    off = info.header_offset
                    name_len, extra_len = struct.unpack("<HH", raw[off + 26: off + 30])
                    start = off + 30 + name_len + extra_len
                    regions.append((start, start + info.compress_size))
        return regions
    return []


def _megatron_equal(out: Path, ref: Path) -> bool:
    for rel in RANK_FILES:
        a, b = safe_load(out / rel), safe_load(ref / rel)
        if spec_from_megatron_args(a["args"]) != spec_from_megatron_args(b["args"]):
            return False
        ma, mb = a["model"], b["model"]
        if ma.keys() != mb.keys() or not all(
                not isinstance(ma[k], torch.Tensor) or torch.equal(ma[k], mb[k]) for k in ma):
            return False
    return True


def _hf_equal(out: Path, ref: Path) -> bool:
    a, b = hf_tensors(out), hf_tensors(ref)
    return (a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
            and json.loads((out / "config.json").read_text()) == json.loads((ref / "config.json").read_text()))


class _Hang(Exception):
    pass


def _alarm(signum, frame):
    raise _Hang()


CASES = _cases()


@pytest.mark.parametrize("direction,rel,mutation,seed", CASES,
                         ids=[f"{d}-{r.split('/')[-2] if '/' in r else r}-{m}-{s % 1000}" for d, r, m, s in CASES])
def test_damaged_file_is_refused_or_converted_correctly(direction, rel, mutation, seed, tmp_path, capsys,
                                                        monkeypatch):
    outcome = _check_case(direction, rel, mutation, seed, tmp_path, capsys, monkeypatch)
    if outcome is None:
        pytest.skip("the mutation changed nothing")


def _check_case(direction, rel, mutation, seed, tmp_path, capsys, monkeypatch) -> str | None:
    """Damage, convert and classify one case (failing the test where the outcome is not allowed); records and
    returns the outcome, or None where the mutation changed no byte."""
    RAN.add((direction, rel, mutation, seed))
    b = base()
    if direction == "megatron-nocrc":  # as for files saved with torch's crc32 option off: the readers alone
        monkeypatch.setenv("MCONVERT_SKIP_CRC", "1")
    if direction == "hf":
        src = copy_of("hf", tmp_path / "src")
        argv = ["hf-to-megatron", src, tmp_path / "out", "--tp", "2", "--pp", "2"]
        ref, equal = b["ckpt"], _megatron_equal
    else:
        src = copy_of("ckpt", tmp_path / "src", manifest=direction == "protected")
        argv = ["megatron-to-hf", src, tmp_path / "out"]
        ref, equal = b["ref"], _hf_equal
    target = src / rel
    regions = _tensor_regions(target)
    before = target.read_bytes()
    changed = _damage(target, mutation, seed)
    if target.read_bytes() == before:
        return None
    code, err = _convert(argv, capsys, f"{direction} {rel} {mutation} seed={seed}")
    out = tmp_path / "out"
    if code != 0:
        assert_one_line_error(code, err, details=None)  # damage may break several fields: one line each
        assert not out.exists()
        if direction == "protected":
            assert "manifest" in err, err
        return _record(direction, "refused")
    assert direction != "protected", f"a damaged file of an mconvert checkpoint was converted: {rel}"
    if direction == "megatron" and equal(out, ref) is False and rel != TRACKER:
        pytest.fail(f"{rel} passed its CRC-32 check yet converted differently: {mutation} seed={seed}")
    if equal(out, ref):
        return _record(direction, "same")
    # a different output: allowed only when the bytes that made it different are raw tensor data
    if rel == "config.json":
        try:
            assert isinstance(json.loads(target.read_text()), dict)
        except (ValueError, UnicodeDecodeError, AssertionError):
            pytest.fail(f"invalid config.json converted: {mutation} seed={seed}")
        return _record(direction, "undetectable")
    assert changed is not None, f"a truncated {rel} was converted into a different model (seed={seed})"
    outside = {i: v for i, v in changed.items() if not any(a <= i < b for a, b in regions)}
    if outside:  # apply only the damage outside tensor data: it alone must not change the model
        data = bytearray(before)
        for i, v in outside.items():
            data[i] = v
        target.write_bytes(bytes(data))
        shutil.rmtree(out)
        code2, _ = _convert(argv, capsys, f"{direction} {rel} metadata-only seed={seed}")
        assert code2 == 0 and equal(out, ref), (
            f"damage outside tensor data changed the model silently: {rel} offsets {sorted(outside)[:10]} seed={seed}")
    return _record(direction, "undetectable")


def _record(direction: str, outcome: str) -> str:
    OUTCOMES[(direction, outcome)] += 1
    return outcome


def _convert(argv: list, capsys, what: str) -> tuple[int, str]:
    old = signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(60)
    try:
        code, _, err = run_cli(argv, capsys)
    except _Hang:
        pytest.fail(f"hang: {what}")
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
    return code, err


def test_zz_fuzz_summary(capsys, tmp_path):
    """Every direction refused some damage: the damage reaches the readers' and the manifest's checks. Where the
    module's cases did not all run first (this test alone, or a selection), it runs a direction's remaining cases
    itself until one is refused, so the check never rests on an empty count."""
    directions = list(dict.fromkeys(d for d, *_ in CASES))
    for direction in directions:
        left = [c for c in CASES if c[0] == direction and c not in RAN]
        while not OUTCOMES[(direction, "refused")] and left:
            case = left.pop(0)
            work = tmp_path / f"{direction}-{len(left)}"
            work.mkdir()
            with pytest.MonkeyPatch.context() as mp:
                _check_case(*case, work, capsys, mp)
    with capsys.disabled():
        print("\nbyte fuzz outcomes:", dict(sorted(OUTCOMES.items())))
    assert [d for d in directions if not OUTCOMES[(d, "refused")]] == []
