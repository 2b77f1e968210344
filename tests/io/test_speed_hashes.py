"""Manifest hashes and CRC-32, against answers we did not compute: the `blake3` package's and hashlib's digests
of the files as read back, zlib's CRC-32 of the same bytes, and a manifest laid out exactly as mconvert wrote
it before BLAKE3 (version 1, sha256, no `hash` field)."""

from __future__ import annotations

import hashlib
import json
import mmap
import os
import random
import zlib
from pathlib import Path

import blake3
import pytest

from mconvert.io.atomic import MANIFEST, check_manifest
from mconvert.io.hashing import HashingFile, crc32, hash_file, set_manifest_hash
from mconvert.errors import MConvertError
from safety_common import assert_one_line_error, base, copy_of, run_cli


@pytest.fixture(autouse=True)
def _default_hash():
    yield
    set_manifest_hash("blake3")  # the CLI sets it process-wide; each test starts from the default


# ---- CRC-32 ------------------------------------------------------------------------------------------------
def test_crc32_is_isal_and_equals_zlib_on_random_data() -> None:
    assert "isal" in (crc32.__module__ or "")  # the fast CRC is the one in use, not a silent zlib fallback
    rng = random.Random(7)
    for n in (0, 1, 3, 7, 8, 15, 63, 64, 65, 4095, 4096, 4097, (1 << 20) + 13, 9 << 20):
        data = rng.randbytes(n)
        assert crc32(data) == zlib.crc32(data), n
        assert crc32(memoryview(data)) == zlib.crc32(data), n


def test_crc32_chained_over_blocks_equals_zlib_of_the_whole() -> None:
    """The input check reads a record through a fixed buffer and chains the CRC block by block."""
    rng = random.Random(11)
    data = rng.randbytes((3 << 20) + 4099)
    for block in (1, 4096, 65536, 1 << 20, 8 << 20):
        crc = 0
        for i in range(0, len(data), block if block > 1 else 997):
            crc = crc32(memoryview(data)[i:i + (block if block > 1 else 997)], crc)
        assert crc == zlib.crc32(data), block
    start = zlib.crc32(b"seed bytes")
    assert crc32(data, start) == zlib.crc32(data, start)


def test_torch_save_records_get_the_crc_zlib_computes(tmp_path: Path) -> None:
    """The zip stream's CRC fields (written through the fast CRC) are what zipfile's own zlib check expects."""
    import zipfile

    ckpt = base()["ckpt"]
    files = sorted(ckpt.rglob("model_optim_rng.pt"))
    assert files, f"no rank files under {ckpt}"
    for f in files:
        with zipfile.ZipFile(f) as z:
            assert z.testzip() is None


# ---- HashingFile ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("algorithm", ["blake3", "sha256"])
@pytest.mark.parametrize("direct", [False, True])
def test_hashing_file_digest_is_the_reference_digest(tmp_path: Path, algorithm: str, direct: bool) -> None:
    rng = random.Random(3)
    pieces = [rng.randbytes(n) for n in (10, 4096, (2 << 20) + 5, 0, 77)]
    f = HashingFile(tmp_path / "x", direct=direct, algorithm=algorithm, chunk=1 << 20)
    for p in pieces:
        f.write(p)
    digest = f.close()
    want = b"".join(pieces)
    assert (tmp_path / "x").read_bytes() == want
    ref = blake3.blake3(want) if algorithm == "blake3" else hashlib.sha256(want)
    assert digest == ref.hexdigest()


@pytest.mark.parametrize("algorithm", ["blake3", "sha256"])
@pytest.mark.parametrize("direct", [False, True])
def test_hashing_file_gathers_strided_tensors_into_the_reference_bytes(tmp_path: Path, algorithm: str, direct: bool,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Row-split TP shards (views whose rows lie at the parent's stride) are written as their row-major bytes,
    copied on the writer thread straight into the staging chunks: rows cut by chunk ends at odd places, a
    transposed view and a 3-D view beside them; the CRC-32 of each is zlib's, the digest the reference's. With
    O_DIRECT no contiguous copy of a row-strided view is made."""
    import numpy as np
    import torch

    from mconvert.io import buffers
    from mconvert.io.hashing import Checksum

    g = torch.Generator().manual_seed(5)
    full = torch.randn(300, 4 * 1031, generator=g)  # rows of 1031 floats: no row fills a 64 KiB chunk evenly
    views = [full[:, k * 1031:(k + 1) * 1031] for k in range(4)]  # the row split of Megatron's row-parallel layers
    odd = [full[7:9, 5:6], full[:1, 3:3000], torch.randn(40, 70, generator=g).t(),
           torch.randn(6, 8, 30, generator=g)[:, ::2, :], torch.randn(3, 5, generator=g).to(torch.bfloat16)[:, 1:4]]
    if direct:
        def refused(t):
            if t.dim() == 2 and t.stride(1) == 1 and t.shape[0] > 1:
                raise AssertionError("a row-strided view was made contiguous before staging")
            return was(t)
        was = buffers.contiguous
        monkeypatch.setattr(buffers, "contiguous", refused)
    f = HashingFile(tmp_path / "x", direct=direct, algorithm=algorithm, chunk=64 << 10)
    f.write(b"head")
    cks = []
    for t in views + odd:
        cks.append(Checksum())
        f.write(t, crc=cks[-1])
    digest = f.close()
    want_parts = [np.ascontiguousarray(t.view(torch.int16).numpy() if t.dtype == torch.bfloat16 else t.numpy())
                  .tobytes() for t in views + odd]
    want = b"head" + b"".join(want_parts)
    assert (tmp_path / "x").read_bytes() == want
    assert [c.value for c in cks] == [zlib.crc32(w) for w in want_parts]
    ref = blake3.blake3(want) if algorithm == "blake3" else hashlib.sha256(want)
    assert digest == ref.hexdigest()


def _random_pieces(rng: random.Random, size: int) -> list[tuple[int, bytes]]:
    """`size` bytes cut at random places (aligned, unaligned, inside one block, across several), shuffled."""
    cuts = sorted({0, size, *(c for c in (4096, 4096 * 3, 4097, 8191) if c < size),
                   *(rng.randrange(size) for _ in range(40))})
    pieces = [(a, rng.randbytes(b - a)) for a, b in zip(cuts, cuts[1:])]
    rng.shuffle(pieces)
    return pieces


@pytest.mark.parametrize("algorithm", ["blake3", "sha256"])
@pytest.mark.parametrize("direct", [False, True])
def test_random_direct_file_in_any_order_is_the_bytes_and_reference_digest(tmp_path: Path, algorithm: str,
                                                                           direct: bool) -> None:
    """Pieces at random offsets in random order, through chunks smaller than some pieces: the file read back
    holds exactly the bytes, and the digest is blake3's / hashlib's of them; O_DIRECT is used where asked."""
    from mconvert.io.hashing import RandomDirectFile

    rng = random.Random(13)
    for size in (1, 4095, 4096, 4097, (3 << 20) + 4099):
        pieces = _random_pieces(rng, size)
        path = tmp_path / f"r{size}"
        f = RandomDirectFile(path, size, direct=direct, chunk=1 << 20, algorithm=algorithm)
        if direct and not f.direct:
            pytest.skip("this file system refuses O_DIRECT")
        for at, data in pieces:
            f.write(data, at)
        digest = f.close()
        want = bytearray(size)
        for at, data in pieces:
            want[at:at + len(data)] = data
        assert path.read_bytes() == bytes(want), size
        ref = blake3.blake3(bytes(want)) if algorithm == "blake3" else hashlib.sha256(bytes(want))
        assert digest == ref.hexdigest(), size


def test_random_direct_file_written_in_file_order_is_hashed_without_reading_it_back(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Bytes brought front to back (a small piece ahead of the rest kept until the chain reaches it) are hashed
    as they come: with every read of the file refused, the digest is still blake3's of the bytes."""
    from mconvert.io.hashing import RandomDirectFile

    rng = random.Random(17)
    size = (3 << 20) + 777
    data = rng.randbytes(size)
    f = RandomDirectFile(tmp_path / "ordered", size, chunk=1 << 20)
    f.write(data[size - 100:], size - 100)
    for a in range(0, size - 100, 300_001):
        f.write(data[a:min(a + 300_001, size - 100)], a)

    def refused(*a, **k):
        raise AssertionError("the file was read back")

    monkeypatch.setattr(os, "preadv", refused)
    assert f.close() == blake3.blake3(data).hexdigest()
    monkeypatch.undo()
    assert (tmp_path / "ordered").read_bytes() == data


@pytest.mark.parametrize("direct", [False, True])
def test_random_direct_file_catches_up_reading_back_only_what_came_ahead(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch,
                                                                        direct: bool) -> None:
    """Stacked slices as a GGUF's MoE layer brings them (expert e's three slices to three regions, each at
    e x slice, the regions and the layers unaligned): `catch_up` at each layer's end moves the digest's front
    there, reading back at most the two regions that came ahead of it (less what it kept), so the digest is
    blake3's of the bytes and `close` reads nothing back."""
    from mconvert.io import hashing
    from mconvert.io.hashing import RandomDirectFile

    rng = random.Random(29)
    head, experts, slice_, layers = 1001, 8, 300_017, 2  # more ahead of the front than it keeps in memory
    layer = 3 * experts * slice_
    size = head + layers * layer
    data = rng.randbytes(size)
    f = RandomDirectFile(tmp_path / "stacked", size, direct=direct, chunk=1 << 20)
    if direct and not f.direct:
        pytest.skip("this file system refuses O_DIRECT")
    read = [0]
    real = os.preadv

    def counted(fd, bufs, pos):
        k = real(fd, bufs, pos)
        read[0] += max(0, k)
        return k

    monkeypatch.setattr(hashing.os, "preadv", counted)
    f.write(data[:head], 0)
    before = 0
    for lay in range(layers):
        base = head + lay * layer
        for e in range(experts):
            for r in range(3):
                at = base + r * experts * slice_ + e * slice_
                f.write(data[at:at + slice_], at)
        f.catch_up(base + layer)
        ahead = 2 * experts * slice_
        assert hashing.AHEAD_KEEP < ahead
        assert 0 < read[0] - before <= ahead + 2 * 4096, (lay, read[0] - before)
        before = read[0]
    got = read[0]
    assert f.close() == blake3.blake3(data).hexdigest()
    assert read[0] == got  # nothing left to read back at close
    assert (tmp_path / "stacked").read_bytes() == data


def test_random_direct_file_refuses_a_byte_never_written_or_written_twice(tmp_path: Path) -> None:
    from mconvert.io.hashing import RandomDirectFile

    f = RandomDirectFile(tmp_path / "gap", 10000, chunk=1 << 20)
    f.write(b"x" * 5000, 0)
    f.write(b"y" * 4000, 6000)
    with pytest.raises(MConvertError, match="byte 5000 of its 10000 never written"):
        f.close()
    f = RandomDirectFile(tmp_path / "twice", 10000, chunk=1 << 20)
    f.write(b"x" * 100, 0)
    with pytest.raises(MConvertError, match=r"bytes \[0, 4096\) written more than once"):
        f.write(b"x" * 4096, 0)
    f.abort()
    with pytest.raises(MConvertError, match="outside"):
        RandomDirectFile(tmp_path / "out", 100).write(b"z" * 10, 95)


@pytest.mark.parametrize("algorithm", ["blake3", "sha256"])
def test_hash_file_through_mappings_is_the_reference_digest(tmp_path: Path, algorithm: str) -> None:
    """The mapped window (our own outputs) against hashlib / blake3 over the whole bytes: files shorter than,
    equal to and across window boundaries, and empty."""
    window = mmap.ALLOCATIONGRANULARITY
    rng = random.Random(5)
    for n in (0, 1, window - 1, window, window + 1, 3 * window + 17):
        data = rng.randbytes(n)
        path = tmp_path / f"f{n}"
        path.write_bytes(data)
        ref = blake3.blake3(data) if algorithm == "blake3" else hashlib.sha256(data)
        assert hash_file(path, algorithm, chunk=window, mapped=True) == ref.hexdigest(), n
        assert hash_file(path, algorithm, chunk=window) == ref.hexdigest(), n


def test_the_manifest_of_large_outputs_maps_little_at_a_time(tmp_path: Path) -> None:
    """write_manifest hashes four output files at once through mappings, whose pages count in the resident
    set: the peak (the kernel's VmHWM) grows by about four windows, not four 16 MiB buffers."""
    from mconvert.convert.driver import peak_rss_bytes
    from mconvert.io.atomic import write_manifest
    from mconvert.io.hashing import MAP_WINDOW

    rng = random.Random(9)
    for i in range(4):
        (tmp_path / f"f{i}").write_bytes(rng.randbytes(40 << 20))
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS now
    base = _rss()
    write_manifest(tmp_path)
    assert peak_rss_bytes() - base < 4 * MAP_WINDOW + (12 << 20)
    assert check_manifest(tmp_path) == []


def _rss() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


def test_hash_file_reads_where_the_file_cannot_be_mapped(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*_a: object, **_k: object) -> None:
        raise OSError(19, "No such device")  # ENODEV: what mmap(2) answers on a file system without mappings

    data = random.Random(6).randbytes(100_000)
    (tmp_path / "f").write_bytes(data)
    monkeypatch.setattr(mmap, "mmap", refuse)
    assert hash_file(tmp_path / "f", "blake3", mapped=True) == blake3.blake3(data).hexdigest()


# ---- manifests -----------------------------------------------------------------------------------------------
def _files(root: Path) -> list[Path]:
    files = sorted(p for p in root.rglob("*") if p.is_file() and p.name != MANIFEST)
    assert files, f"no files under {root}"  # each caller checks every file: none would pass
    return files


def test_default_manifest_is_blake3_of_every_file() -> None:
    for which in ("ckpt", "ref"):
        root = base()[which]
        doc = json.loads((root / MANIFEST).read_text())
        assert doc["hash"] == "blake3" and doc["version"] == 2
        listed = doc["files"]
        assert sorted(listed) == [str(p.relative_to(root)) for p in _files(root)]
        for p in _files(root):
            entry = listed[str(p.relative_to(root))]
            assert entry == {"blake3": blake3.blake3(p.read_bytes()).hexdigest(), "bytes": p.stat().st_size}
        assert check_manifest(root) == []


def test_blake3_manifest_catches_a_flipped_bit(tmp_path: Path) -> None:
    out = copy_of("ref", tmp_path / "hf", manifest=True)
    f = out / "model.safetensors"
    data = bytearray(f.read_bytes())
    data[len(data) // 3] ^= 0x04
    f.write_bytes(bytes(data))
    problems = check_manifest(out)
    assert len(problems) == 1 and "blake3 differs" in problems[0] and str(f) in problems[0]


@pytest.mark.timeout(300)
def test_manifest_hash_sha256_on_each_writing_verb(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """--manifest-hash sha256: hashlib's sha256 of every file, version 1 (readable by mconvert before BLAKE3)."""
    ckpt, ref = base()["ckpt"], base()["ref"]
    runs = {
        "hf": ["megatron-to-hf", ckpt, tmp_path / "hf"],
        "mg": ["hf-to-megatron", ref, tmp_path / "mg", "--tp", "2"],
        "rs": ["reshard", ckpt, tmp_path / "rs", "--tp", "1", "--pp", "1"],
        "trt": ["megatron-to-trtllm", ckpt, tmp_path / "trt", "--tp", "2"],
    }
    for name, argv in runs.items():
        code, out, err = run_cli([*argv, "--manifest-hash", "sha256"], capsys)
        assert code == 0, (name, err)
        root = tmp_path / name
        doc = json.loads((root / MANIFEST).read_text())
        assert doc["hash"] == "sha256" and doc["version"] == 1, name
        for p in _files(root):
            assert doc["files"][str(p.relative_to(root))]["sha256"] == hashlib.sha256(p.read_bytes()).hexdigest()
        assert check_manifest(root) == []
        set_manifest_hash("blake3")


def _old_manifest(root: Path) -> None:
    """The manifest exactly as mconvert wrote it before BLAKE3 (atomic.write_manifest of that version)."""
    entries = {str(p.relative_to(root)): {"sha256": hashlib.sha256(p.read_bytes()).hexdigest(),
                                          "bytes": p.stat().st_size} for p in _files(root)}
    (root / MANIFEST).write_text(json.dumps({"version": 1, "files": entries}, indent=1, sort_keys=True) + "\n")


def test_old_sha256_manifest_stays_valid(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out = copy_of("ref", tmp_path / "hf")
    _old_manifest(out)
    assert check_manifest(out) == []
    code, stdout, err = run_cli(["verify", out, "--json"], capsys)
    assert '"manifest"' in stdout and "differ" not in stdout
    # as an input: intact it converts, changed it is refused by its sha256
    from mconvert.convert.verbs import hf_to_megatron

    hf_to_megatron(out, tmp_path / "mg", tp=1, pp=1)
    f = out / "model.safetensors"
    data = bytearray(f.read_bytes())
    data[-7] ^= 0x10
    f.write_bytes(bytes(data))
    with pytest.raises(MConvertError, match="sha256 differs from the manifest"):
        hf_to_megatron(out, tmp_path / "mg2", tp=1, pp=1)
    assert not (tmp_path / "mg2").exists()


def test_manifest_naming_an_unknown_hash_is_unreadable(tmp_path: Path) -> None:
    out = copy_of("ref", tmp_path / "hf", manifest=True)
    doc = json.loads((out / MANIFEST).read_text())
    doc["hash"] = "md5"
    (out / MANIFEST).write_text(json.dumps(doc))
    problems = check_manifest(out)
    assert len(problems) == 1 and "unreadable manifest" in problems[0] and "md5" in problems[0]


def test_entry_without_the_named_digest_is_tampering(tmp_path: Path) -> None:
    out = copy_of("ref", tmp_path / "hf", manifest=True)
    doc = json.loads((out / MANIFEST).read_text())
    doc["files"]["config.json"] = {"sha256": "0" * 64, "bytes": (out / "config.json").stat().st_size}
    (out / MANIFEST).write_text(json.dumps(doc))
    problems = check_manifest(out)
    assert len(problems) == 1 and "'config.json' has no blake3 digest" in problems[0]


@pytest.mark.timeout(120)
def test_unknown_manifest_hash_option_is_one_error_line(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    code, out, err = run_cli(["megatron-to-hf", base()["ckpt"], tmp_path / "hf", "--manifest-hash", "md5"], capsys)
    assert_one_line_error(code, err, "unknown manifest hash 'md5'", "blake3, sha256")
    assert not (tmp_path / "hf").exists() and os.listdir(tmp_path) == []
