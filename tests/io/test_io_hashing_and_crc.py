"""Hashed writes, deferred CRC checks and streamed rank files, each against an answer we did not compute:
hashlib's sha256 of the same bytes, the bytes themselves, and the CRC-32 torch.save stored in the zip."""

from __future__ import annotations

import os
import zipfile
import zlib
from pathlib import Path
from typing import Any

import blake3
import pytest
import torch
from safety_common import sha_tree

from mconvert.io import hashing
from mconvert.io.safeload import safe_load
from mconvert.io.crc import deferred_crc_checks, wait_crc_checks
from mconvert.io.hashing import HashingFile
from mconvert.errors import MConvertError


def _pieces(seed: int) -> list[bytes | torch.Tensor]:
    """Writes of awkward sizes: a few bytes, exact and off-by-one chunk sizes, tensors large enough for the
    GIL-free copy, read-only bytes, and an odd tail so the last O_DIRECT block is padded then cut."""
    g = torch.Generator().manual_seed(seed)
    chunk = hashing.CHUNK
    sizes = [7, 4096, chunk - 7 - 4096, 1, chunk, (3 << 20) + 3, 2 * chunk + 12345, 333]
    out: list[bytes | torch.Tensor] = []
    for i, n in enumerate(sizes):
        t = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)
        out.append(bytes(t.numpy()) if i % 3 == 0 else t)
    return out


def _raw(p: bytes | torch.Tensor) -> bytes:
    return p if isinstance(p, bytes) else bytes(p.numpy())


def _write_and_check(path: Path, seed: int, direct: bool = True, as_bytes: bool = False) -> HashingFile:
    """Write `_pieces(seed)` through a HashingFile (tensors as views, or all as bytes); the file must hold
    exactly their bytes and close() must return hashlib's sha256 of them."""
    pieces = _pieces(seed)
    f = HashingFile(path, direct=direct)
    for p in pieces:
        if as_bytes or not isinstance(p, torch.Tensor):
            f.write(_raw(p))
        else:
            f.write(memoryview(p.numpy()), keep=p)
    digest = f.close()
    want = b"".join(_raw(p) for p in pieces)
    got = path.read_bytes()
    assert len(got) == len(want)  # the O_DIRECT tail padding was cut off
    assert got == want
    assert digest == blake3.blake3(want).hexdigest()  # the manifest's default hash
    return f


@pytest.mark.parametrize("direct", [True, False])
def test_hashing_file_bytes_and_digest_match_hashlib(tmp_path: Path, direct: bool) -> None:
    _write_and_check(tmp_path / "x.bin", 1, direct=direct)


@pytest.mark.parametrize("direct", [True, False])
def test_hashing_file_writes_row_blocks_as_one_record(tmp_path: Path, direct: bool) -> None:
    """A tuple of tensors (a gated shard's gate and up blocks, one a strided view) is written as the bytes of
    their concatenation, with one CRC-32 over them all, across staging-chunk boundaries."""
    from mconvert.mappings.transforms import RowBlocks

    g = torch.Generator().manual_seed(3)
    full = torch.randn(96, 2000, generator=g)
    blocks = RowBlocks((full[:40, 7:1907], full[50:96, 100:2000]))
    f = HashingFile(tmp_path / "x.bin", direct=direct, chunk=1 << 16)
    ck = hashing.Checksum()
    f.write(b"head")
    f.write(blocks, crc=ck)
    f.write(b"tail")
    digest = f.close()
    cat = torch.cat([b.contiguous() for b in blocks]).numpy().tobytes()
    want = b"head" + cat + b"tail"
    assert (tmp_path / "x.bin").read_bytes() == want
    assert ck.value == zlib.crc32(cat)
    assert digest == blake3.blake3(want).hexdigest()


def test_hashing_file_keeps_two_direct_writes_in_flight(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """O_DIRECT chunks go to the disk two at a time, each at its own offset (the disk is never idle between
    writes); the file still holds exactly the bytes written, in order."""
    import threading
    import time

    real_pwrite = os.pwrite
    lock = threading.Lock()
    now, most = [0], [0]

    def slow(fd, data, at):  # noqa: ANN001
        with lock:
            now[0] += 1
            most[0] = max(most[0], now[0])
        time.sleep(0.05)  # a disk's latency
        try:
            return real_pwrite(fd, data, at)
        finally:
            with lock:
                now[0] -= 1

    monkeypatch.setattr(os, "pwrite", slow)
    path = tmp_path / "q.bin"
    data = bytes(range(256)) * (((6 << 20) + 12345) // 256)  # six chunks and a partial one
    f = HashingFile(path, direct=True, chunk=1 << 20)
    f.write(data)
    f.close()
    assert path.read_bytes() == data
    assert not f.direct or most[0] == hashing.IO_WRITES == 2


def test_hashing_file_direct_is_used_where_the_fs_allows_it(tmp_path: Path) -> None:
    f = HashingFile(tmp_path / "y.bin", direct=True)
    f.write(b"abc")
    f.close()
    probe = os.open(tmp_path / "probe", os.O_WRONLY | os.O_CREAT | getattr(os, "O_DIRECT", 0))
    os.close(probe)  # this file system takes O_DIRECT: the writer must have used it
    assert f.direct == hasattr(os, "O_DIRECT")


def test_hashing_file_falls_back_when_o_direct_open_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real_open = os.open

    def no_direct(path, flags, *a):  # a file system without O_DIRECT (tmpfs on older kernels, FUSE)
        if flags & getattr(os, "O_DIRECT", 0):
            raise OSError(22, "Invalid argument")
        return real_open(path, flags, *a)

    monkeypatch.setattr(os, "open", no_direct)
    f = _write_and_check(tmp_path / "z.bin", 2, as_bytes=True)
    assert not f.direct


def test_hashing_file_falls_back_when_o_direct_write_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The open succeeds but the first write gets EINVAL (from every writing thread at once): the same bytes then
    go out buffered."""
    real_write, real_pwrite = os.write, os.pwrite
    refused: list[int] = []

    def refuse_direct(fd):  # noqa: ANN001
        import fcntl

        if fcntl.fcntl(fd, fcntl.F_GETFL) & getattr(os, "O_DIRECT", 0):
            refused.append(fd)
            raise OSError(22, "Invalid argument")

    def picky(fd, data):  # noqa: ANN001
        refuse_direct(fd)
        return real_write(fd, data)

    def picky_at(fd, data, at):  # noqa: ANN001
        refuse_direct(fd)
        return real_pwrite(fd, data, at)

    monkeypatch.setattr(os, "write", picky)
    monkeypatch.setattr(os, "pwrite", picky_at)
    _write_and_check(tmp_path / "w.bin", 3, as_bytes=True)
    assert refused or not hasattr(os, "O_DIRECT")


def test_hashing_file_reports_a_write_error_as_os_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def full(fd, data, *at):  # noqa: ANN001, ANN002
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "write", full)
    monkeypatch.setattr(os, "pwrite", full)
    f = HashingFile(tmp_path / "v.bin", direct=True)
    f.write(bytes(hashing.CHUNK + 1))
    with pytest.raises(OSError, match="No space left"):
        f.close()


def _torch_file(path: Path) -> Path:
    torch.save({"model": {"w": torch.arange(4096, dtype=torch.float32)}}, path)
    return path


def _flip_tensor_byte(path: Path) -> None:
    with zipfile.ZipFile(path) as z:
        info = next(i for i in z.infolist() if i.filename.endswith("data/0"))
    data = bytearray(path.read_bytes())
    n, m = int.from_bytes(data[info.header_offset + 26:info.header_offset + 28], "little"), \
        int.from_bytes(data[info.header_offset + 28:info.header_offset + 30], "little")
    data[info.header_offset + 30 + n + m + 100] ^= 0x01
    path.write_bytes(bytes(data))


def test_deferred_crc_check_reports_the_flipped_bit_at_wait(tmp_path: Path) -> None:
    good = _torch_file(tmp_path / "good.pt")
    bad = _torch_file(tmp_path / "bad.pt")
    _flip_tensor_byte(bad)
    with pytest.raises(MConvertError, match="bad.pt.*CRC-32"):
        with deferred_crc_checks():
            safe_load(good)
            safe_load(bad)  # returns: the check runs on the background thread
            wait_crc_checks()  # where the driver waits, before committing


def test_deferred_crc_failure_wins_over_the_error_it_caused(tmp_path: Path) -> None:
    bad = _torch_file(tmp_path / "bad.pt")
    _flip_tensor_byte(bad)
    with pytest.raises(MConvertError, match="CRC-32"):
        with deferred_crc_checks():
            safe_load(bad)
            raise MConvertError("a later check tripped over the corrupt bytes")


def test_megatron_to_hf_refuses_a_flipped_bit_and_leaves_no_output(tmp_path: Path) -> None:
    from mconvert.convert.verbs import megatron_to_hf
    from mconvert.trainer.train import TrainConfig, train

    ck = tmp_path / "ck"
    train(TrainConfig(preset="tiny-gpt2", tp=2, pp=1, steps=0, save=str(ck), force=True, quiet=True, device="cpu"))
    rank = sorted(ck.rglob("model_optim_rng.pt"))[-1]
    _flip_tensor_byte(rank)
    with pytest.raises(MConvertError, match="CRC-32"):
        megatron_to_hf(ck, tmp_path / "hf")
    assert not (tmp_path / "hf").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".hf")]


# ---- rank files streamed from the source's preview (io.torchsave.TorchSaveStream) --------------------------------
@pytest.fixture(scope="module")
def trained(trained_checkpoint) -> dict[str, Path]:
    return {preset: trained_checkpoint(preset=preset, tp=2, pp=2, steps=1, force=True)
            for preset in ("tiny-gpt2", "tiny-llama")}


@pytest.mark.parametrize("preset", ["tiny-gpt2", "tiny-llama"])
@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 1), (1, 2), (2, 2)])
def test_streamed_reshard_equals_torch_save(trained: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                            preset: str, tp: int, pp: int) -> None:
    """Reshard with rank files streamed from the preview == the same reshard through torch.save of each
    whole state dict (the stage-buffered path), byte for byte; tied heads at PP > 1 included."""
    from mconvert.convert import verbs
    from mconvert.convert.megatron.writer import MegatronWriter

    calls: list[Any] = []
    real_open = MegatronWriter._open_stage
    monkeypatch.setattr(MegatronWriter, "_open_stage", lambda self, p: (calls.append(p), real_open(self, p))[1])
    verbs.reshard(trained[preset], tmp_path / "streamed", tp=tp, pp=pp)
    assert sorted(calls) == list(range(pp))  # the streamed path ran, once per stage
    monkeypatch.setattr(verbs, "_preview", lambda src: None)
    monkeypatch.setattr(MegatronWriter, "_spool", lambda self, p, t: _NoSpool())
    verbs.reshard(trained[preset], tmp_path / "saved", tp=tp, pp=pp)
    assert sha_tree(tmp_path / "streamed") == sha_tree(tmp_path / "saved")


class _NoSpool:
    def park(self, x: torch.Tensor) -> torch.Tensor:
        return x


@pytest.mark.parametrize("preset", ["tiny-gpt2", "tiny-llama"])
def test_streamed_hf_to_megatron_equals_torch_save(trained: dict[str, Path], tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch, preset: str) -> None:
    from mconvert.convert import verbs
    from mconvert.convert.megatron.writer import MegatronWriter

    verbs.megatron_to_hf(trained[preset], tmp_path / "hf")
    verbs.hf_to_megatron(tmp_path / "hf", tmp_path / "streamed", tp=2, pp=2)
    monkeypatch.setattr(verbs, "_preview", lambda src: None)
    monkeypatch.setattr(MegatronWriter, "_spool", lambda self, p, t: _NoSpool())
    verbs.hf_to_megatron(tmp_path / "hf", tmp_path / "saved", tp=2, pp=2)
    assert sha_tree(tmp_path / "streamed") == sha_tree(tmp_path / "saved")


@pytest.mark.parametrize("preset", ["tiny-gpt2", "tiny-llama"])
def test_preview_matches_what_is_read(trained: dict[str, Path], tmp_path: Path, preset: str) -> None:
    """Each source's preview (names in order, shapes, dtypes) is what read_mcore then returns."""
    from mconvert.convert.verbs import megatron_to_hf
    from mconvert.convert.sources import open_source

    megatron_to_hf(trained[preset], tmp_path / "hf")
    for src in (open_source(trained[preset]), open_source(tmp_path / "hf")):
        for unit in src.units():
            got = src.read_mcore(unit)
            want = src.preview(unit)
            assert [(n, tuple(t.shape), t.dtype) for n, t in want.items()] == \
                [(n, tuple(t.shape), t.dtype) for n, t in got.items()], (src.format, unit)


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_merge_transposed_is_merge_laid_out_for_a_transpose(tp: int) -> None:
    from mconvert.mappings.transforms import merge, merge_transposed

    g = torch.Generator().manual_seed(tp)
    shards = [torch.randn(6, 5, generator=g) for _ in range(tp)]
    got = merge_transposed(shards, "row", "w")
    assert torch.equal(got, torch.cat(shards, dim=1)) and torch.equal(got, merge(shards, "row", "w"))
    assert tp == 1 or got.t().is_contiguous()
    bad = shards[:-1] + [torch.randn(6, 4, generator=g)]
    if tp > 1:
        with pytest.raises(MConvertError, match="TP rank"):
            merge_transposed(bad, "row", "w")
    col = [torch.randn(3, 5, generator=g) for _ in range(tp)]
    assert torch.equal(merge_transposed(col, "column", "w"), torch.cat(col, dim=0))  # other kinds: merge


def test_changed_input_with_a_manifest_is_refused_though_checked_in_the_background(
        trained: dict[str, Path], tmp_path: Path) -> None:
    """The manifest check of an input mconvert wrote runs beside the conversion; its failure still stops the
    output from being committed, and its message is the one the user sees."""
    from mconvert.convert.verbs import hf_to_megatron, megatron_to_hf, reshard

    megatron_to_hf(trained["tiny-llama"], tmp_path / "hf")
    st = tmp_path / "hf" / "model.safetensors"
    data = bytearray(st.read_bytes())
    data[-5] ^= 0x40  # a bit inside the last tensor: safetensors has no checksum of its own
    st.write_bytes(bytes(data))
    with pytest.raises(MConvertError, match="blake3 differs from the manifest"):
        hf_to_megatron(tmp_path / "hf", tmp_path / "mg", tp=1, pp=1)
    assert not (tmp_path / "mg").exists()
    reshard(trained["tiny-llama"], tmp_path / "r", tp=1, pp=1)
    rank = sorted((tmp_path / "r").rglob("model_optim_rng.pt"))[0]
    _flip_tensor_byte(rank)
    with pytest.raises(MConvertError, match="blake3 differs from the manifest|CRC-32"):
        megatron_to_hf(tmp_path / "r", tmp_path / "hf2")
    assert not (tmp_path / "hf2").exists()


def test_workers_change_the_speed_not_the_bytes(trained: dict[str, Path], tmp_path: Path) -> None:
    """`--workers 1` (one parameter at a time) and `--workers 3` write the same files as the default."""
    from typer.testing import CliRunner

    from mconvert.cli import app
    from mconvert.convert.base import set_workers

    runner = CliRunner()
    try:
        for w in (0, 1, 3):
            for verb, extra in (("megatron-to-hf", []), ("reshard", ["--tp", "1", "--pp", "2"])):
                r = runner.invoke(app, [verb, str(trained["tiny-llama"]), str(tmp_path / f"{verb}-{w}"),
                                        "--workers", str(w), *extra])
                assert r.exit_code == 0, r.output
        for verb in ("megatron-to-hf", "reshard"):
            assert sha_tree(tmp_path / f"{verb}-0") == sha_tree(tmp_path / f"{verb}-1") == \
                sha_tree(tmp_path / f"{verb}-3")
        import subprocess
        import sys

        r = subprocess.run([sys.executable, "-m", "mconvert.cli", "reshard", str(trained["tiny-llama"]),
                            str(tmp_path / "bad"), "--workers", "-1"], capture_output=True, text=True)
        assert r.returncode == 1 and "--workers -1" in r.stderr and "Traceback" not in r.stderr
        assert not (tmp_path / "bad").exists()
    finally:
        set_workers(0)


def test_a_failed_conversion_leaves_no_writer_threads(trained: dict[str, Path], tmp_path: Path) -> None:
    """A conversion that fails half-way (a NaN in the final unit) stops its streams: no writer thread, no
    staging memory and no open file is left in the caller's process, and no output directory."""
    import threading

    from mconvert.convert.verbs import hf_to_megatron, megatron_to_hf, reshard

    def writers() -> list[str]:
        return [t.name for t in threading.enumerate() if t.name.startswith(("write ", "odirect "))]

    before = writers()
    megatron_to_hf(trained["tiny-gpt2"], tmp_path / "hf")
    st = tmp_path / "hf" / "model.safetensors"
    (tmp_path / "hf" / "mconvert-manifest.json").unlink()  # edited on purpose: no manifest to refuse it
    from safetensors.torch import load_file, save_file

    tensors = load_file(st)
    tensors["transformer.ln_f.weight"][0] = float("nan")  # the final unit: the last stage's files are open
    save_file(tensors, st, metadata={"format": "pt"})
    with pytest.raises(MConvertError, match="NaN"):
        hf_to_megatron(tmp_path / "hf", tmp_path / "mg", tp=2, pp=2)
    rank = sorted(trained["tiny-gpt2"].rglob("model_optim_rng.pt"))[-1]
    copy = tmp_path / "ck"
    import shutil

    shutil.copytree(trained["tiny-gpt2"], copy)
    _flip_tensor_byte(sorted(copy.rglob("model_optim_rng.pt"))[-1])
    for fn, kw in ((megatron_to_hf, {}), (reshard, {"tp": 1, "pp": 1})):
        with pytest.raises(MConvertError):
            fn(copy, tmp_path / f"out-{fn.__name__}", **kw)
        assert not (tmp_path / f"out-{fn.__name__}").exists()
    assert rank.exists() and not (tmp_path / "mg").exists()
    assert writers() == before


def _mapping_flags(addr: int) -> list[str]:
    """The VmFlags of the mapping of this process that holds address `addr` (/proc/self/smaps)."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= addr < hi
        elif inside and head == "VmFlags:":
            return line.split()[1:]
    raise AssertionError(f"no mapping holds {addr:#x}")


@pytest.mark.skipif(not hashing.huge_page_bytes() or hashing.CHUNK % hashing.huge_page_bytes()
                    or not Path("/proc/self/smaps").exists(),
                    reason="no transparent huge pages, or huge pages larger than a staging chunk")
def test_staging_chunks_start_at_a_huge_page_and_ask_for_huge_pages() -> None:
    # an O_DIRECT write from 4 KiB pages reaches the disk in requests of max_segments pages; from huge pages in
    # requests of the device's largest size: the staging chunk is huge-page aligned and advised (the kernel's
    # own record of the advice, VmFlags "hg"), and the bytes written from it are the bytes given
    import ctypes

    huge = hashing.huge_page_bytes()
    chunk = hashing._take_chunk(hashing.CHUNK)
    try:
        assert len(chunk) == hashing.CHUNK
        ref = ctypes.c_char.from_buffer(chunk)
        addr = ctypes.addressof(ref)
        del ref
        assert addr % huge == 0
        assert "hg" in _mapping_flags(addr), _mapping_flags(addr)
        chunk[:5] = b"abcde"
        chunk[-3:] = b"xyz"
        assert bytes(chunk[:5]) + bytes(chunk[-3:]) == b"abcdexyz"
    finally:
        hashing._give_chunk(chunk)
