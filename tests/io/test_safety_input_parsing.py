"""Input files whose bytes would be read wrong, or whose malformed fields could end in an internal error:
big-endian torch.save zips (read raw by offset), zips that name an entry twice, legacy QKV versions on a GQA
model, safetensors headers safetensors itself refuses, manifests with absurd sizes or nesting, a negative
tracker iteration. Each is refused on one line naming the file, with no OUT left behind."""

from __future__ import annotations

import json
import shutil
import struct
import sys
import warnings
import zipfile
from pathlib import Path

import pytest
import torch

from safety_common import assert_one_line_error, hf_tensors, make_hf_llama, run_cli

DEEP = 100_000  # deeper than any recursive JSON parser goes


@pytest.fixture(scope="module")
def fx(tmp_path_factory) -> dict[str, Path]:
    """A 1-layer GQA llama: HF dir, its TP=1 PP=1 Megatron checkpoint (with manifest), and that converted back."""
    from mconvert.convert.verbs import hf_to_megatron, megatron_to_hf

    root = tmp_path_factory.mktemp("parse")
    hf = make_hf_llama(root / "hf", layers=1)
    ckpt = root / "ckpt"
    hf_to_megatron(hf, ckpt, tp=1, pp=1)
    ref = root / "ref"
    megatron_to_hf(ckpt, ref)
    return {"hf": hf, "ckpt": ckpt, "ref": ref}


def _copy(src: Path, dst: Path, manifest: bool = False) -> Path:
    shutil.copytree(src, dst)
    if not manifest:
        (dst / "mconvert-manifest.json").unlink(missing_ok=True)
    return dst


def _rank(ckpt: Path) -> Path:
    return ckpt / "release" / "mp_rank_00" / "model_optim_rng.pt"


def _refused(code: int, err: str, out: Path, *words: str) -> str:
    """One `error:` line holding `words`, and neither OUT nor its hidden temporary directory left."""
    line = assert_one_line_error(code, err, *words)
    assert not out.exists(), line
    assert not list(out.parent.glob(f".{out.name}.mconvert-tmp-*")), line
    return line


def _loaded(path: Path) -> dict:
    from mconvert.io.safeload import safe_load

    def own(o):  # materialized: the file is memory-mapped and about to be rewritten
        if isinstance(o, torch.Tensor):
            return o.clone()
        if isinstance(o, dict):
            return {k: own(v) for k, v in o.items()}
        return o

    return own(safe_load(path))


def _swapped(o):
    """Every tensor's storage byte-swapped: what a big-endian host holds in memory for the same values."""
    if isinstance(o, torch.Tensor):
        t = o.clone()
        t.untyped_storage().byteswap(t.dtype)
        return t
    if isinstance(o, dict):
        return {k: _swapped(v) for k, v in o.items()}
    if isinstance(o, list):
        return [_swapped(v) for v in o]
    return o


def _save(state: dict, path: Path, big: bool) -> None:
    """torch.save as a big-endian host writes it (byteorder record `big`, swapped bytes), or a little-endian twin."""
    if not big:
        torch.save(state, path)
        return
    real = sys.byteorder
    sys.byteorder = "big"  # torch.save writes sys.byteorder into the zip's byteorder record
    try:
        torch.save(_swapped(state), path)
    finally:
        sys.byteorder = real


# ---- F1: big-endian torch.save zips -----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def endian(fx, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("endian")
    out = {}
    for big in (True, False):
        ck = _copy(fx["ckpt"], root / f"ckpt-{big}")
        _save(_loaded(_rank(ck)), _rank(ck), big)
        hf = root / f"hf-{big}"
        hf.mkdir()
        shutil.copy(fx["hf"] / "config.json", hf)
        _save({k: v.clone() for k, v in hf_tensors(fx["hf"]).items()}, hf / "pytorch_model.bin", big)
        out[f"ckpt-{big}"], out[f"hf-{big}"] = ck, hf
    return out


def test_fixture_is_what_torch_load_reads_back(endian, fx):
    from mconvert.io.safeload import safe_load

    with zipfile.ZipFile(_rank(endian["ckpt-True"])) as z:
        assert z.read(next(n for n in z.namelist() if n.endswith("/byteorder"))) == b"big"
    assert all(torch.equal(safe_load(endian["hf-True"] / "pytorch_model.bin")[k], v)
               for k, v in hf_tensors(fx["hf"]).items())


@pytest.mark.parametrize("verb", ["megatron-to-hf", "reshard"])
def test_big_endian_rank_file_is_refused(endian, tmp_path, capsys, verb):
    out = tmp_path / "out"
    extra = ["--tp", "1", "--pp", "1"] if verb == "reshard" else []
    code, _, err = run_cli([verb, endian["ckpt-True"], out, *extra], capsys)
    line = _refused(code, err, out, str(_rank(endian["ckpt-True"])), "big-endian", "re-save it on a little-endian")
    assert "NaN" not in line


def test_big_endian_pytorch_model_bin_is_refused(endian, tmp_path, capsys):
    out = tmp_path / "out"
    code, _, err = run_cli(["hf-to-megatron", endian["hf-True"], out, "--tp", "1", "--pp", "1"], capsys)
    _refused(code, err, out, str(endian["hf-True"] / "pytorch_model.bin"), "big-endian")


def test_little_endian_twins_still_convert(endian, fx, tmp_path, capsys):
    code, _, err = run_cli(["megatron-to-hf", endian["ckpt-False"], tmp_path / "a"], capsys)
    assert code == 0, err
    ref = hf_tensors(fx["ref"])
    got = hf_tensors(tmp_path / "a")
    assert got.keys() == ref.keys() and all(torch.equal(got[k], ref[k]) for k in ref)
    code, _, err = run_cli(["hf-to-megatron", endian["hf-False"], tmp_path / "b", "--tp", "1", "--pp", "1"], capsys)
    assert code == 0, err


# ---- duplicate zip entries, negative tracker iteration ----------------------------------------------------------
def test_zip_naming_an_entry_twice_is_refused(fx, tmp_path, capsys):
    ck = _copy(fx["ckpt"], tmp_path / "ck")
    p = _rank(ck)
    with zipfile.ZipFile(p) as z:
        items = [(i.filename, z.read(i.filename)) for i in z.infolist()]
    name, data = next((n, b) for n, b in items if "/data/" in n and len(b) > 1000)
    with warnings.catch_warnings(), zipfile.ZipFile(p, "w", zipfile.ZIP_STORED) as z:
        warnings.simplefilter("ignore")  # zipfile's own "Duplicate name" warning
        for n, b in items:
            z.writestr(n, b)
        z.writestr(name, bytes(len(data)))  # torch reads the first copy, Python's zipfile the last
    out = tmp_path / "out"
    code, _, err = run_cli(["megatron-to-hf", ck, out], capsys)
    _refused(code, err, out, str(p), name, "two entries")


def test_negative_tracker_iteration_is_refused(fx, tmp_path, capsys):
    ck = _copy(fx["ckpt"], tmp_path / "ck")
    (ck / "release").rename(ck / "iter_-000001")
    tracker = ck / "latest_checkpointed_iteration.txt"
    tracker.write_text("-1")
    out = tmp_path / "out"
    code, _, err = run_cli(["megatron-to-hf", ck, out], capsys)
    _refused(code, err, out, str(tracker), "-1", "negative")
    # the same directory named by --iteration, for a verb that writes and one that only reads
    code, _, err = run_cli(["megatron-to-hf", ck, out, "--iteration", "-1"], capsys)
    _refused(code, err, out, "--iteration -1", ">= 0")
    code, _, err = run_cli(["inspect", ck, "--iteration", "-1"], capsys)
    assert code == 1 and err.strip().splitlines() == [err.strip()] and "--iteration -1" in err, err


# ---- F8: legacy QKV on GQA, safetensors and manifest parsing ----------------------------------------------------
@pytest.mark.parametrize("version", [0, 1])
def test_legacy_checkpoint_version_on_a_gqa_model_is_refused(fx, tmp_path, capsys, version):
    ck = _copy(fx["ckpt"], tmp_path / "ck")
    st = _loaded(_rank(ck))
    st["checkpoint_version"] = version
    torch.save(st, _rank(ck))
    out = tmp_path / "out"
    code, _, err = run_cli(["megatron-to-hf", ck, out], capsys)
    _refused(code, err, out, str(_rank(ck)), f"checkpoint_version {version}", "num_query_groups")


def _edit_header(d: Path, edit) -> Path:
    """Rewrite `d/model.safetensors`'s header text with `edit(text, first tensor name, its entry)`, data kept."""
    f = d / "model.safetensors"
    raw = f.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    text = raw[8:8 + n].decode().rstrip()
    head = json.loads(text)
    first = min((k for k in head if k != "__metadata__"), key=lambda k: head[k]["data_offsets"][0])
    new = edit(text, first, head[first]).encode()
    new += b" " * (-(len(new) + 8) % 8)
    f.write_bytes(struct.pack("<Q", len(new)) + new + raw[8 + n:])
    return f


def _entry(text: str, entry: dict, **changed) -> str:
    """`text` (safetensors writes it compact) with one entry replaced by itself with `changed` fields (raw JSON)."""
    old = json.dumps(entry, separators=(",", ":"))
    assert text.count(old) == 1, old
    body = ",".join(f'"{k}":{changed.get(k, json.dumps(v, separators=(",", ":")))}' for k, v in entry.items())
    return text.replace(old, "{" + body + "}")


def _metadata(text: str, new: str) -> str:
    old = '"__metadata__":{"format":"pt"}'
    assert text.count(old) == 1
    return text.replace(old, '"__metadata__":' + new)


def _shape(e: dict, first: str) -> str:
    return json.dumps([first] + e["shape"][1:])


HEADERS = {  # name -> (edit, words of the refusal)
    "deep": (lambda t, k, e: t[:-1] + ', "zz": ' + "[" * DEEP + "]" * DEEP + "}", ["nested too deeply"]),
    "shape_inf": (lambda t, k, e: _entry(t, e, shape=_shape(e, "1e400")), [" shape entry"]),
    "offsets_inf": (lambda t, k, e: _entry(t, e, data_offsets='[0,1e400]'), ["data_offsets entry"]),
    # F9: what safetensors' own parser refuses ("invalid type: floating point `128.5`, expected usize", ...)
    "shape_frac": (lambda t, k, e: _entry(t, e, shape=_shape(e, str(e["shape"][0] + 0.5))), ["shape entry"]),
    "offsets_bool": (lambda t, k, e: _entry(t, e, data_offsets=f'[false,{e["data_offsets"][1]}]'),
                     ["data_offsets entry is false"]),
    "metadata_object": (lambda t, k, e: _metadata(t, '{"format":{"x":[1]}}'), ["__metadata__"]),
}


@pytest.mark.parametrize("case", sorted(HEADERS))
def test_safetensors_header_is_refused(fx, tmp_path, capsys, case):
    edit, words = HEADERS[case]
    hf = _copy(fx["hf"], tmp_path / "hf")
    f = _edit_header(hf, edit)
    out = tmp_path / "out"
    code, _, err = run_cli(["hf-to-megatron", hf, out, "--tp", "1", "--pp", "1"], capsys)
    _refused(code, err, out, str(f), "unreadable safetensors file", *words)


ST_PROBES = {  # header JSON of one F32 tensor of 2 elements (8 data bytes)
    "plain": '{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}',
    "extra field": '{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8],"x":1}}',
    "metadata null": '{"__metadata__":null,"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}',
    "metadata strings": '{"__metadata__":{"format":"pt"},"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}',
    "shape 2.0": '{"a":{"dtype":"F32","shape":[2.0],"data_offsets":[0,8]}}',
    "shape 2e0": '{"a":{"dtype":"F32","shape":[2e0],"data_offsets":[0,8]}}',
    "shape string": '{"a":{"dtype":"F32","shape":"2","data_offsets":[0,8]}}',
    "shape object": '{"a":{"dtype":"F32","shape":{"0":2},"data_offsets":[0,8]}}',
    "shape null": '{"a":{"dtype":"F32","shape":null,"data_offsets":[0,8]}}',
    "shape negative": '{"a":{"dtype":"F32","shape":[-2],"data_offsets":[0,8]}}',
    "shape true": '{"a":{"dtype":"F32","shape":[true, 2],"data_offsets":[0,8]}}',
    "shape 2**64": '{"a":{"dtype":"F32","shape":[2,18446744073709551616,0],"data_offsets":[0,8]}}',
    "shape overflow": '{"a":{"dtype":"F32","shape":[2,18446744073709551615,0],"data_offsets":[0,8]}}',
    "offsets 8.0": '{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8.0]}}',
    "offsets false": '{"a":{"dtype":"F32","shape":[2],"data_offsets":[false,8]}}',
    "offsets three": '{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8,8]}}',
    "no shape": '{"a":{"dtype":"F32","data_offsets":[0,8]}}',
    "dtype lower case": '{"a":{"dtype":"f32","shape":[2],"data_offsets":[0,8]}}',
    "metadata int value": '{"__metadata__":{"x":1},"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}',
    "metadata null value": '{"__metadata__":{"x":null},"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}',
    "metadata list": '{"__metadata__":[],"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}',
    "metadata string": '{"__metadata__":"x","a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}',
}


@pytest.mark.parametrize("case", sorted(ST_PROBES))
def test_decode_header_accepts_what_safetensors_accepts(tmp_path, case):
    from safetensors import safe_open

    from mconvert.io.safetensors_arrays import decode_header

    head = ST_PROBES[case].encode()
    head += b" " * (-(len(head) + 8) % 8)
    raw = struct.pack("<Q", len(head)) + head + bytes(8)
    f = tmp_path / "x.safetensors"
    f.write_bytes(raw)
    try:
        with safe_open(str(f), "pt"):
            theirs = True
    except Exception:  # noqa: BLE001 - safetensors' refusal, whatever its type
        theirs = False
    try:
        decode_header(raw[:8], lambda n: raw[8:8 + n], len(raw))
        ours = True
    except ValueError:
        ours = False
    assert ours == theirs, f"{case}: safetensors {'accepts' if theirs else 'refuses'} it, mconvert does not"


MANIFESTS = {
    "deep": (lambda text: '{"a": ' + "[" * DEEP + "]" * DEEP + "}", "nested too deeply"),
    "bytes_inf": (lambda text: __import__("re").sub(r'"bytes": \d+', '"bytes": 1e400', text, count=1),
                  "not a file size"),
}


@pytest.mark.parametrize("case", sorted(MANIFESTS))
def test_input_manifest_malformed_is_one_line(fx, tmp_path, capsys, case):
    edit, words = MANIFESTS[case]
    ck = _copy(fx["ckpt"], tmp_path / "ck", manifest=True)
    m = ck / "mconvert-manifest.json"
    m.write_text(edit(m.read_text()))
    out = tmp_path / "out"
    code, _, err = run_cli(["megatron-to-hf", ck, out], capsys)
    _refused(code, err, out, str(m), words)


@pytest.mark.parametrize("case", sorted(MANIFESTS))
def test_verify_reports_a_malformed_manifest_as_a_failed_check(fx, tmp_path, capsys, case):
    edit, words = MANIFESTS[case]
    hf = _copy(fx["ref"], tmp_path / "hf", manifest=True)
    m = hf / "mconvert-manifest.json"
    m.write_text(edit(m.read_text()))
    code, out, err = run_cli(["verify", hf], capsys)
    assert code != 0
    assert "internal error" not in out + err and "Traceback" not in out + err, out + err
    lines = [ln.strip() for ln in err.splitlines() if ln.strip()]
    assert lines[-1].startswith("NOT READY"), err
    marks = [ln for ln in lines if ln.startswith("✗ manifest")]
    assert len(marks) == 1 and words in marks[0] and str(m) in marks[0], err
