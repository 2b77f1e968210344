"""An input mconvert wrote is checked against its manifest on the bytes the conversion reads anyway
(`hashing.FollowedDigest`): its digest is the file's (hashlib's, the `blake3` package's) whatever order the
readers go in, a changed byte anywhere in the file is refused, and the kernel's count of bytes the process
read shows the input read about once, not twice."""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import blake3
import pytest

from mconvert.convert import base as convert_base
from mconvert.io.atomic import MANIFEST
from mconvert.io.hashing import GAP_READ, FollowedDigest, pread_into
from mconvert.errors import MConvertError
from safety_common import big_llama_hf, flip_record_padding, run_cli


def _truth(data: bytes, algorithm: str) -> str:
    return hashlib.sha256(data).hexdigest() if algorithm == "sha256" else blake3.blake3(data).hexdigest()


def _layout(size: int, seed: int) -> list[tuple[int, int]]:
    """(offset, bytes) of the 'tensors' of a file of `size` bytes: pieces of 1 KiB to 12 MiB with small unread
    gaps between them (headers), one unread region larger than GAP_READ (records nobody converts)."""
    rng = random.Random(seed)
    pieces, pos = [], 4096  # a header nobody reads
    skip_at = size // 2
    while pos < size:
        if skip_at <= pos < skip_at + GAP_READ:
            pos = skip_at + GAP_READ + 4096
            continue
        n = min(size - pos, rng.choice([1024, 8192, 300_000, 1 << 20, 5 << 20, 12 << 20]))
        pieces.append((pos, n))
        pos += n + rng.choice([0, 64, 128, 4096])
    return pieces


def _read(path: Path, digest: FollowedDigest, pieces: list[tuple[int, int]], threads: int) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        def one(piece: tuple[int, int]) -> None:
            pos, n = piece
            pread_into(fd, memoryview(bytearray(n)), pos, path, f"@{pos}", digest=digest)

        if threads == 1:
            for p in pieces:
                one(p)
        else:
            with ThreadPoolExecutor(threads) as ex:
                list(ex.map(one, pieces))
    finally:
        os.close(fd)


ORDERS = {
    "file order": lambda ps, rng: ps,
    "reversed": lambda ps, rng: ps[::-1],
    "shuffled": lambda ps, rng: rng.sample(ps, len(ps)),
    "units out of order": lambda ps, rng: ps[len(ps) // 3:] + ps[:len(ps) // 3],
}


@pytest.fixture(scope="module")
def blob(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, bytes]:
    path = tmp_path_factory.mktemp("followed") / "blob.bin"
    data = random.Random(1).randbytes(48 << 20)
    path.write_bytes(data)
    return path, data


@pytest.mark.parametrize("algorithm", ["blake3", "sha256"])
@pytest.mark.parametrize("order", list(ORDERS))
@pytest.mark.parametrize("threads", [1, 4])
def test_the_followed_digest_is_the_files_digest_in_any_read_order(
        blob: tuple[Path, bytes], algorithm: str, order: str, threads: int) -> None:
    path, data = blob
    pieces = ORDERS[order](_layout(len(data), seed=threads), random.Random(7))
    d = FollowedDigest(path, algorithm, _truth(data, algorithm), len(data))
    _read(path, d, pieces, threads)
    assert d.finish() is None
    assert d.on_read + d.again == len(data)  # every byte hashed exactly once
    if order == "file order" and threads == 1:  # only the headers and the unread region are read again
        unread = len(data) - sum(n for _, n in pieces)
        assert d.again == unread
    wrong = FollowedDigest(path, algorithm, _truth(data[:-1] + b"\0", algorithm), len(data))
    _read(path, wrong, pieces, threads)
    assert "differs from the manifest" in (wrong.finish() or "")


def test_a_block_just_ahead_waits_for_the_read_before_it_instead_of_being_read_again(
        blob: tuple[Path, bytes]) -> None:
    """The readers' pool pattern: one thread reads [0, n) while another reads [n, 2n) of the same file. The
    second one's blocks wait for the first read and are hashed as read: no byte of either is read again, only
    the rest of the file at `finish`."""
    path, data = blob
    n = 4 << 20
    d = FollowedDigest(path, "blake3", _truth(data, "blake3"), len(data))
    fd = os.open(path, os.O_RDONLY)
    try:
        first = d.begin(0, n)  # the first read is in flight before the second one starts
        second = threading.Thread(target=pread_into, args=(fd, memoryview(bytearray(n)), n, path, "b"),
                                  kwargs={"digest": d})
        second.start()
        time.sleep(0.05)
        d.saw(0, memoryview(data[:n]), fd, first)
        d.end(first)
        second.join()
    finally:
        os.close(fd)
    assert d.finish() is None
    assert (d.on_read, d.again) == (2 * n, len(data) - 2 * n)


def test_a_read_that_timed_out_waiting_waits_no_more(blob: tuple[Path, bytes]) -> None:
    """A read in flight that never moves (a stalled reader): the read after it waits FOLLOW_WAIT_S once, then
    reads on without waiting per block; its blocks are read again later and the digest still matches."""
    from mconvert.io import hashing

    path, data = blob
    n = 4 << 20  # four blocks
    d = FollowedDigest(path, "blake3", _truth(data, "blake3"), len(data))
    fd = os.open(path, os.O_RDONLY)
    try:
        stalled = d.begin(0, n)
        t0 = time.monotonic()
        pread_into(fd, memoryview(bytearray(n)), n, path, "b", digest=d)
        took = time.monotonic() - t0
        d.end(stalled)
    finally:
        os.close(fd)
    assert hashing.FOLLOW_WAIT_S <= took < 3 * hashing.FOLLOW_WAIT_S
    assert d.finish() is None and d.on_read + d.again == len(data)


@pytest.mark.parametrize("order", ["reversed", "shuffled"])
def test_a_catch_up_cut_short_goes_on_later(blob: tuple[Path, bytes], monkeypatch: pytest.MonkeyPatch,
                                            order: str) -> None:
    """Catching up on blocks read ahead stops after CATCH_UP bytes (other readers wait on the lock
    meanwhile); the digest is still the file's."""
    from mconvert.io import hashing

    monkeypatch.setattr(hashing, "CATCH_UP", 1 << 20)
    path, data = blob
    pieces = ORDERS[order](_layout(len(data), seed=3), random.Random(5))
    d = FollowedDigest(path, "blake3", _truth(data, "blake3"), len(data))
    _read(path, d, pieces, 4)
    assert d.finish() is None and d.on_read + d.again == len(data)


def test_a_file_shorter_longer_or_swapped_for_a_fifo_is_a_problem(tmp_path: Path) -> None:
    data = random.Random(2).randbytes(3 << 20)
    path = tmp_path / "f.bin"
    path.write_bytes(data[:-10])
    d = FollowedDigest(path, "blake3", _truth(data, "blake3"), len(data))
    _read(path, d, [(0, 1 << 20)], 1)
    assert "manifest" in (d.finish() or "") and d.problem == d.finish()
    path.write_bytes(data + b"x")
    d = FollowedDigest(path, "blake3", _truth(data, "blake3"), len(data))
    assert "size" in (d.finish() or "")
    path.unlink()
    os.mkfifo(path)  # swapped for a FIFO after the manifest was read: refused, never waited on
    d = FollowedDigest(path, "blake3", _truth(data, "blake3"), len(data))
    assert "not a regular file" in (d.finish() or "")


# ---- whole conversions: the kernel's byte count, and changes where no reader looks --------------------------
def _rchar() -> int:
    """Bytes this process has read with read(2)-family calls (the kernel's count, /proc/self/io)."""
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("rchar:"))


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """mconvert-written inputs (with their manifests) of a 29 MB Llama, and copies without the manifest."""
    from mconvert.convert.verbs import hf_to_megatron, megatron_to_hf

    root = tmp_path_factory.mktemp("followed-inputs")
    hf_to_megatron(big_llama_hf(), root / "mg", tp=2, pp=2)
    megatron_to_hf(root / "mg", root / "hf")
    out = {"mg": root / "mg", "hf": root / "hf"}
    for name in ("mg", "hf"):
        shutil.copytree(root / name, root / f"{name}-bare")
        (root / f"{name}-bare" / MANIFEST).unlink()
        out[f"{name}-bare"] = root / f"{name}-bare"
    return out


def _convert(verb: str, src: Path, out: Path) -> dict:
    from mconvert.convert.verbs import hf_to_megatron, megatron_to_hf, reshard

    if verb == "megatron-to-hf":
        return megatron_to_hf(src, out)
    if verb == "hf-to-megatron":
        return hf_to_megatron(src, out, tp=2, pp=2)
    return reshard(src, out, tp=1, pp=1)


@pytest.fixture
def workers(request: pytest.FixtureRequest) -> Iterator[int]:
    convert_base.set_workers(request.param)
    yield request.param
    convert_base.set_workers(0)


@pytest.mark.parametrize("workers", [1, 0], indirect=True, ids=["one reader", "the readers' pool"])
@pytest.mark.parametrize("verb,src", [("megatron-to-hf", "mg"), ("hf-to-megatron", "hf"), ("reshard", "mg")])
def test_an_input_with_a_manifest_is_read_about_once(written: dict[str, Path], tmp_path: Path, verb: str, src: str,
                                                    workers: int) -> None:
    """The same conversion of the same bytes with and without the manifest: what the check adds to the bytes
    the process reads (a second pass added all of them). One reader reads each file in order, so only headers
    and pickles are read again; the pool's threads read neighbouring tensors at once, and a block read ahead
    of the hashed prefix is read again from the page cache once the prefix reaches it."""
    size = sum(p.stat().st_size for p in written[src].rglob("*") if p.is_file() and p.name != MANIFEST)
    reads = {}
    for name in (f"{src}-bare", src):
        before = _rchar()
        report = _convert(verb, written[name], tmp_path / name)
        reads[name] = _rchar() - before
    checked = report["input_manifest"]
    assert checked["bytes"] == size and checked["hashed_as_read"] + checked["read_again"] == size
    extra = reads[src] - reads[f"{src}-bare"]
    assert extra <= (0.1 if workers == 1 else 0.6) * size, (extra, size, checked)
    assert "input_manifest" not in _convert(verb, written[f"{src}-bare"], tmp_path / "again")


def test_a_change_where_no_reader_looks_is_refused(written: dict[str, Path], tmp_path: Path) -> None:
    """A byte of a zip record's local header (its alignment padding: neither torch.load nor the CRC-32 look
    at it), and the side file of special token ids, changed but still valid: the manifest refuses both, and
    nothing is written."""
    from mconvert.convert.verbs import megatron_to_hf

    ckpt = tmp_path / "mg"
    shutil.copytree(written["mg"], ckpt)
    rank = sorted(ckpt.rglob("model_optim_rng.pt"))[-1]
    flip_record_padding(rank)
    with pytest.raises(MConvertError, match=f"{rank.name}: blake3 differs from the manifest"):
        megatron_to_hf(ckpt, tmp_path / "out")
    assert not (tmp_path / "out").exists()

    shutil.rmtree(ckpt)
    shutil.copytree(written["mg"], ckpt)
    ids = ckpt / "hf_token_ids.json"
    ids.write_text(ids.read_text().replace('"bos_token_id": 1', '"bos_token_id": 3'))  # still valid, not the same
    with pytest.raises(MConvertError, match="hf_token_ids.json: blake3 differs from the manifest"):
        megatron_to_hf(ckpt, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_the_followed_checks_leave_no_threads(written: dict[str, Path], tmp_path: Path) -> None:
    from mconvert.convert.verbs import hf_to_megatron

    before = {t.name for t in threading.enumerate()}
    hf_to_megatron(written["hf"], tmp_path / "mg", tp=1, pp=1)
    assert not {t.name for t in threading.enumerate() if t.name.startswith("manifest")} - before


def test_the_report_tells_how_the_input_was_checked(written: dict[str, Path], tmp_path: Path,
                                                    capsys: pytest.CaptureFixture) -> None:
    """The table names the check's figures readably; --json gives them as numbers that add up to the input."""
    code, _, err = run_cli(["megatron-to-hf", written["mg"], tmp_path / "a"], capsys)
    assert code == 0
    line = " ".join(err.split())
    listed = json.loads((written["mg"] / MANIFEST).read_text())["files"]
    size = sum(e["bytes"] for e in listed.values())
    assert f"input_manifest: files {len(listed)}, bytes {size:,}, hashed_as_read " in line and "read_again " in line
    code, out, _ = run_cli(["megatron-to-hf", written["mg"], tmp_path / "b", "--json"], capsys)
    checked = json.loads(out)["input_manifest"]
    assert code == 0 and checked["hashed_as_read"] + checked["read_again"] == checked["bytes"]
    code, out, _ = run_cli(["megatron-to-hf", written["mg-bare"], tmp_path / "c", "--json"], capsys)
    assert code == 0 and "input_manifest" not in json.loads(out)

