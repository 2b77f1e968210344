"""The torch.save zip format: rank files written byte-identical to `torch.save` while their tensors stream in,
and tensors of a saved file read by their offset without unpickling it again.

Writing: torch's own writer runs without storage bytes (`torch.serialization.skip_data`) to lay the file out;
the record bytes are then filled in (`save_spooled`, from a `Spool` of parked tensors) or written front to
back as they arrive (`TorchSaveStream`), with each record's CRC-32, the central directory and
`.data/serialization_id` set as torch.save sets them. Reading: a `TensorIndex` maps each tensor of a safely
loaded, memory-mapped state to its record offset, so a unit's shards are pread into fresh memory and no
mapped page stays resident (`LazyModel`).
"""

from __future__ import annotations

import functools
import os
import struct
import zipfile
from pathlib import Path
from typing import Any

import torch

from mconvert.io import buffers, repickle
from mconvert.io.hashing import Checksum, HashingFile, crc32, numel, pread_into, tensor_bytes
from mconvert.io.paths import make_dirs, owned_fd
from mconvert.io.crc import ZipRecords, followed_digest, zip_records
from mconvert.errors import MConvertError


# ---- reading: a rank file's tensors by file offset, without unpickling it again ----------------------------
def _all_tensors(obj: Any, out: list[torch.Tensor], depth: int = 0) -> None:
    if isinstance(obj, torch.Tensor):
        out.append(obj)
    elif depth < 12 and isinstance(obj, dict):
        for v in obj.values():
            _all_tensors(v, out, depth + 1)
    elif depth < 12 and isinstance(obj, (list, tuple)):
        for v in obj:
            _all_tensors(v, out, depth + 1)


class TensorIndex:
    """Where each tensor of a torch zip checkpoint lives in the file, so a unit's shards can be `pread` into
    fresh memory: no second unpickling per unit, no mmap pages left resident in the process.

    Built from an already (safely) loaded mmap'd state: the storages of a mmap load are slices of one mapping
    at the zip records' offsets, so sorting both gives the record of every storage; sizes are checked one by
    one and any doubt returns None (callers then keep reading through the loaded state)."""

    def __init__(self, path: Path, entries: dict[str, tuple], crc: ZipRecords | None = None) -> None:
        self.path = path
        self.entries = entries  # key -> (record offset, dtype, shape, stride, storage offset (elements), nbytes)
        self.crc = crc  # the input's record-wise CRC-32 check, fed with the bytes as they are read
        self.digest = followed_digest(path)  # the input's manifest digest, fed the same way

    @classmethod
    def build(cls, path: str | Path, state: Any, tensors: dict[str, torch.Tensor]) -> "TensorIndex | None":
        """Index `tensors` (key -> tensor of the mmap-loaded `state` of `path`)."""
        path = Path(path)
        try:
            reader = torch._C.PyTorchFileReader(str(path))
            records = [r for r in reader.get_all_records() if r.startswith("data/")]
            rec = sorted((reader.get_record_offset(r), r) for r in records)
            # torch.save records the writer's byte order; torch.load assumes little without the record
            order = bytes(reader.get_record("byteorder")) if reader.has_record("byteorder") else b"little"
            with zipfile.ZipFile(path) as z:
                size_of = {i.filename.split("/", 1)[1]: i.file_size for i in z.infolist() if "/" in i.filename}
        except Exception:  # noqa: BLE001 - not a zip checkpoint (legacy pickle): no index
            return None
        if order != b"little":  # the record bytes are read raw: a byte-swapped tensor would convert silently
            raise MConvertError(
                f"{path}: saved on a {order.decode('ascii', 'replace')[:16]}-endian machine (its byteorder record); "
                "mconvert reads tensor bytes as little-endian — re-save it on a little-endian machine "
                "(torch.load, then torch.save)")
        everything: list[torch.Tensor] = []
        _all_tensors(state, everything)
        storages: dict[int, int] = {}
        for t in everything:
            s = t.untyped_storage()
            storages[s.data_ptr()] = s.nbytes()
        ptrs = sorted(storages)
        if len(ptrs) != len(rec) or any(p == 0 for p in ptrs):
            return None
        base = ptrs[0] - rec[0][0]
        record_of: dict[int, int] = {}
        for p, (off, name) in zip(ptrs, rec):
            if p - base != off or storages[p] != size_of.get(name, -1):
                return None
            record_of[p] = off
        entries = {}
        for k, t in tensors.items():
            s = t.untyped_storage()
            entries[k] = (record_of[s.data_ptr()], t.dtype, tuple(t.shape), tuple(t.stride()), t.storage_offset(),
                          s.nbytes())
        crc = zip_records(path)
        if crc is not None:  # these records are read whole by the conversion: checked on those bytes
            crc.claim(e[0] for e in entries.values())
        return cls(path, entries, crc)

    def read_into(self, fd: int, key: str, dst: torch.Tensor, start: int = 0) -> bool:
        """pread bytes [start, start + dst.nbytes) of the stored (contiguous) tensor `key` straight into `dst`
        (contiguous, same dtype); False when the stored tensor is a strided view (then use `read`)."""
        off, dtype, shape, stride, soff, nbytes = self.entries[key]
        n = dst.numel() * dst.element_size()
        if (dtype != dst.dtype or not dst.is_contiguous() or list(stride) != contiguous_strides(shape)
                or start + n > numel(shape) * dst.element_size()):
            return False
        self._pread(fd, key, memoryview(dst.reshape(-1).view(torch.uint8).numpy()),
                    off + soff * dst.element_size() + start)
        return True

    def _pread(self, fd: int, key: str, mv: memoryview, pos: int) -> None:
        pread_into(fd, mv, pos, self.path, key, self.crc, self.digest)

    def read(self, fd: int, key: str) -> torch.Tensor:
        """The tensor `key`, read with one pread into pooled memory (its whole storage, then the same view)."""
        off, dtype, shape, stride, soff, nbytes = self.entries[key]
        buf = buffers.empty((nbytes,), torch.uint8)
        self._pread(fd, key, memoryview(buf.numpy()), off)
        typed = buf.view(dtype)
        if soff == 0 and list(stride) == contiguous_strides(shape) and typed.numel() == numel(shape):
            return typed.view(shape)
        return torch.as_strided(typed, shape, stride, soff)


def contiguous_strides(shape: tuple[int, ...]) -> list[int]:
    """The strides of a contiguous (row-major) tensor of `shape`."""
    out, acc = [], 1
    for s in reversed(shape):
        out.append(acc)
        acc *= s
    return list(reversed(out))


class LazyModel:
    """A rank file's model dict for one chunk, read tensor by tensor through a TensorIndex."""

    def __init__(self, index: TensorIndex, fd: int, prefix: str, owns_fd: bool = False) -> None:
        self.index, self.fd, self.prefix = index, fd, prefix
        self._close = owned_fd(self, fd) if owns_fd else None

    def close(self) -> None:
        """Close the descriptor if this model owns it (a rank file's chunks share their source's)."""
        if self._close is not None:
            self._close()

    def __contains__(self, key: str) -> bool:
        return self.prefix + key in self.index.entries

    def keys(self) -> list[str]:
        """The keys of this chunk, in the file's order."""
        n = len(self.prefix)
        return [k[n:] for k in self.index.entries if k.startswith(self.prefix)]

    def meta(self, key: str) -> torch.Tensor:
        """A meta-device tensor of `key`'s shape and dtype, from the index (no data read)."""
        _, dtype, shape, *_ = self.index.entries[self.prefix + key]
        return torch.empty(shape, dtype=dtype, device="meta")

    def __getitem__(self, key: str) -> torch.Tensor:
        return self.index.read(self.fd, self.prefix + key)

    def dtype(self, key: str) -> torch.dtype:
        return self.index.entries[self.prefix + key][1]

    def read_into(self, key: str, dst: torch.Tensor, start: int = 0) -> bool:
        return self.index.read_into(self.fd, self.prefix + key, dst, start)


# ---- writing: a rank file that is byte-identical to torch.save, without holding the stage in memory ----------
class Spool:
    """Bytes of tensors parked in a file as they arrive; each comes back as a placeholder tensor of its shape
    and dtype (untouched memory, no RSS) that `save_spooled` fills into the final file from here."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        self.size = 0
        self.where: dict[int, tuple[int, int, int]] = {}  # storage _cdata -> (spool offset, nbytes, crc32)

    def park(self, t: torch.Tensor) -> torch.Tensor:
        if not t.is_contiguous():
            t = t.contiguous()
        mv = tensor_bytes(t) if t.numel() else memoryview(b"")
        n = len(mv)
        done = 0
        while done < n:
            done += os.pwrite(self.fd, mv[done:], self.size + done)
        # the placeholder's storage maps the spool's first n bytes privately: right size, cpu location,
        # never touched (torch.empty could reuse heap pages that count in RSS)
        storage = torch.UntypedStorage.from_file(str(self.path), False, n)
        ph = torch.empty(0, dtype=t.dtype).set_(storage, 0, tuple(t.shape), contiguous_strides(tuple(t.shape)))
        self.where[ph.untyped_storage()._cdata] = (self.size, n, crc32(mv))
        self.size += n
        return ph

    def close(self) -> None:
        os.close(self.fd)
        self.path.unlink(missing_ok=True)


def _central_entries(data: bytes, start: int, count: int) -> list[tuple[int, str]]:
    """(offset of the entry, file name) of every central directory entry from `start`."""
    out, pos = [], start
    for _ in range(count):
        if data[pos:pos + 4] != b"PK\x01\x02":
            raise ValueError("central directory entry signature")
        n, e, c = struct.unpack_from("<HHH", data, pos + 28)
        out.append((pos, data[pos + 46:pos + 46 + n].decode()))
        pos += 46 + n + e + c
    return out


def _save_skeleton(state: Any, path: Path) -> list[torch.Tensor]:
    """`torch.save(state, path)` without storage bytes (`torch.serialization.skip_data`: the records' space
    is left as holes); returns the tensors whose storages became records data/0, data/1, ... in that order."""
    order: list[torch.Tensor] = []
    seen: set[int] = set()

    class _Pickler(repickle.Pickler):  # writes the stand-ins of safely loaded args back as they were read
        def reducer_override(self, obj: Any) -> Any:
            if isinstance(obj, torch.Tensor):
                cd = obj.untyped_storage()._cdata
                if cd not in seen:
                    seen.add(cd)
                    order.append(obj)
            return NotImplemented

    class _PickleModule:
        Pickler = _Pickler
        dump = repickle.dump

    with torch.serialization.skip_data():
        torch.save(state, path, pickle_module=_PickleModule)
    return order


def _serialization_id(infos: list[Any], sid_name: str, crc_of: Any, old: bytes) -> bytes:
    """`.data/serialization_id` as torch.save sets it: the record-name half of `old` kept, then torch's
    combined hash of the CRC-32s (`crc_of(name)`) of the records before it that have a data descriptor."""
    mask = (1 << 64) - 1
    comb = 0
    for i in infos:
        if i.filename == sid_name:
            break
        if not i.flag_bits & 8:  # torch combines the CRCs it sees in data descriptors only
            continue
        comb = (comb ^ ((crc_of(i.filename) + 0x9E3779B9 + ((comb << 6) & mask) + (comb >> 2)) & mask)) & mask
    return old[:20] + f"{comb:020d}".encode()


def save_spooled(state: Any, path: str | Path, spool: Spool) -> None:
    """`torch.save(state, path)` where the data of placeholder tensors lives in `spool`: the file is written
    with torch's own writer without storage bytes (`torch.serialization.skip_data`), the bytes are copied in
    from the spool by the kernel (copy_file_range), then the CRC32 fields and `.data/serialization_id` are
    set as torch.save sets them — the result is byte-identical to torch.save of the real tensors."""
    path = Path(path)
    order = _save_skeleton(state, path)
    reader = torch._C.PyTorchFileReader(str(path))
    with zipfile.ZipFile(path) as z:
        infos = z.infolist()
        start_dir = z.start_dir
    prefix = infos[0].filename.split("/", 1)[0] + "/"
    crcs: dict[str, int] = {i.filename: i.CRC for i in infos}
    size_of = {i.filename: i.file_size for i in infos}
    flags = {i.filename: i.flag_bits for i in infos}
    fd = os.open(path, os.O_RDWR)
    try:
        for key, t in enumerate(order):
            name = f"data/{key}"
            off = reader.get_record_offset(name)
            s = t.untyped_storage()
            if s._cdata in spool.where:
                soff, n, crc = spool.where[s._cdata]
                if n != size_of[prefix + name]:
                    raise MConvertError(f"internal: {path}: record {name} holds {size_of[prefix + name]} bytes, "
                                        f"the spool {n}")
                done = 0
                while done < n:
                    k = os.copy_file_range(spool.fd, fd, n - done, soff + done, off + done)
                    if k <= 0:
                        raise MConvertError(f"{path}: copy from {spool.path} failed (disk full?)")
                    done += k
            else:  # a real tensor of the state (rng state, ...): its whole storage, as torch.save writes it
                raw = torch.empty(0, dtype=torch.uint8).set_(s, 0, (s.nbytes(),))
                mv = memoryview(raw.numpy()) if s.nbytes() else memoryview(b"")
                n, crc = len(mv), crc32(mv)
                done = 0
                while done < n:
                    done += os.pwrite(fd, mv[done:], off + done)
            crcs[prefix + name] = crc
            if not flags[prefix + name] & 8:  # no data descriptor (an empty record): nothing else to set
                continue
            # the data descriptor after the record: PK\x07\x08, crc32, sizes
            if os.pread(fd, 4, off + n) != b"PK\x07\x08":
                raise MConvertError(f"internal: {path}: no data descriptor after {name}")
            os.pwrite(fd, struct.pack("<I", crc), off + n + 4)
        # serialization_id: torch's combined hash of record names (kept) and of record CRC32s (recomputed)
        sid_name = prefix + ".data/serialization_id"
        if sid_name in crcs:
            soff = reader.get_record_offset(".data/serialization_id")
            sid = _serialization_id(infos, sid_name, crcs.__getitem__, os.pread(fd, 40, soff))
            os.pwrite(fd, sid, soff)
            crcs[sid_name] = crc32(sid)
            if os.pread(fd, 4, soff + 40) != b"PK\x07\x08":
                raise MConvertError(f"internal: {path}: no data descriptor after the serialization id")
            os.pwrite(fd, struct.pack("<I", crcs[sid_name]), soff + 44)
        size = os.fstat(fd).st_size
        tail = os.pread(fd, size - start_dir, start_dir)
        for pos, name in _central_entries(tail, 0, len(infos)):
            os.pwrite(fd, struct.pack("<I", crcs[name]), start_dir + pos + 16)
    finally:
        os.close(fd)


class TorchSaveStream:
    """The file `torch.save(state)` writes, written front to back while the bytes of its placeholder tensors
    arrive — no spool, no second copy, hashed on the way.

    `state` holds placeholders (tensors of the right shape and dtype whose memory is never touched) for the
    data still to come, and real tensors (rng states) for the rest. The file's layout comes from torch's own
    writer run without data (`torch.serialization.skip_data`) into a sparse skeleton; the bytes are then
    written in file order through `HashingFile(direct=True)`: skeleton bytes up to a record, the record's
    data as it is `feed`-ed, and so on. The CRC-32 of every record goes into its data descriptor (right after
    it), the central directory and `.data/serialization_id` as `save_spooled` sets them, so the file is
    byte-identical to torch.save. A record that arrives before its turn waits in memory until it."""

    def __init__(self, state: Any, path: str | Path, placeholders: list[torch.Tensor]) -> None:
        self.path = Path(path)
        # same base name as `path`: torch names the zip's top folder after the file it writes
        skel_dir = self.path.parent / f".skeleton-{self.path.name}"
        make_dirs(skel_dir)
        skel = skel_dir / self.path.name
        try:
            order = _save_skeleton(state, skel)
            reader = torch._C.PyTorchFileReader(str(skel))
            with zipfile.ZipFile(skel) as z:
                self._infos = z.infolist()
                self._start_dir = z.start_dir
            self._prefix = self._infos[0].filename.split("/", 1)[0] + "/"
            self._size = os.path.getsize(skel)
            self._skel_fd = os.open(skel, os.O_RDONLY)
        finally:
            skel.unlink(missing_ok=True)  # the open descriptor keeps it readable
            skel_dir.rmdir()
        by_name = {i.filename: i for i in self._infos}
        self._records: list[tuple[int, int, bool]] = []  # (data offset, nbytes, has a data descriptor)
        self._real: dict[int, torch.Tensor] = {}
        self._index_of: dict[int, int] = {}
        wanted = {t.untyped_storage()._cdata for t in placeholders}
        for k, t in enumerate(order):
            info = by_name[f"{self._prefix}data/{k}"]
            self._records.append((reader.get_record_offset(f"data/{k}"), info.file_size, bool(info.flag_bits & 8)))
            cd = t.untyped_storage()._cdata
            self._index_of[cd] = k
            if cd not in wanted:
                self._real[k] = t
        self._sid_off = (reader.get_record_offset(".data/serialization_id")
                         if f"{self._prefix}.data/serialization_id" in by_name else None)
        self._crcs: dict[str, int] = {i.filename: i.CRC for i in self._infos}
        self._early: dict[int, torch.Tensor] = {}
        self._desc: list[tuple[int, Checksum]] = []  # (file offset of a CRC field to patch, its value)
        self._ck: dict[str, Checksum] = {}  # data record -> its CRC-32, taken on the writer thread
        self._next = 0
        self._pos = 0
        # rank files of a stage are open together (one per TP rank): smaller staging chunks each
        self._f = HashingFile(self.path, direct=True, chunk=4 << 20, max_pending=4 << 20)
        self._drain()

    def record_of(self, t: torch.Tensor) -> int:
        return self._index_of[t.untyped_storage()._cdata]

    def feed(self, placeholder: torch.Tensor, data: torch.Tensor) -> None:
        """The bytes of `placeholder` (same shape and dtype, contiguous whole storage) are `data`."""
        k = self.record_of(placeholder)
        n = self._records[k][1]
        if data.numel() * data.element_size() != n or data.dtype != placeholder.dtype:
            raise MConvertError(f"internal: {self.path}: record data/{k} holds {n} bytes of {placeholder.dtype}, "
                                f"got {tuple(data.shape)} {data.dtype}")
        self._early[k] = data
        self._drain()

    def _drain(self) -> None:
        while self._next < len(self._records):
            k = self._next
            t = self._early.pop(k, None)
            if t is None:
                t = self._real.get(k)
                if t is not None:  # a real tensor of the state: its whole storage, as torch.save writes it
                    s = t.untyped_storage()
                    t = torch.empty(0, dtype=torch.uint8).set_(s, 0, (s.nbytes(),))
            if t is None:
                return
            off, n, desc = self._records[k]
            self._skeleton_to(off)
            ck = Checksum()
            self._ck[f"{self._prefix}data/{k}"] = ck
            if desc:
                self._desc.append((off + n + 4, ck))
            self._f.write(t if n else memoryview(b""), keep=t, crc=ck)  # copied, CRC-32 taken on its thread
            self._pos = off + n
            self._next += 1

    def _skeleton_to(self, end: int) -> None:
        """Skeleton bytes [pos, end), read and patched on the writer thread in turn — after the data before
        them, whose CRC-32 the writer thread has then taken."""
        while self._pos < end:
            n = min(end - self._pos, 8 << 20)
            self._f.write_later(functools.partial(self._skeleton_bytes, self._pos, n))
            self._pos += n

    def _skeleton_bytes(self, start: int, n: int) -> bytes:
        raw = bytearray(os.pread(self._skel_fd, n, start))
        if len(raw) != n:
            raise MConvertError(f"internal: {self.path}: skeleton shorter than its layout")
        end = start + n

        def put(at: int, value: bytes) -> None:
            lo, hi = max(at, start), min(at + len(value), end)
            if lo < hi:
                raw[lo - start:hi - start] = value[lo - at:hi - at]

        while self._desc and self._desc[0][0] < end:  # data descriptors: PK\x07\x08, crc32, sizes
            at, ck = self._desc[0]
            put(at, struct.pack("<I", ck.value))
            if at + 4 > end:
                break  # straddles the next piece: patched there too
            self._desc.pop(0)
        if self._sid_off is not None and start < self._sid_off + 48 and self._sid_off < end:
            put(self._sid_off, self._sid_bytes())
            put(self._sid_off + 44, struct.pack("<I", self._crc(self._prefix + ".data/serialization_id")))
        if end > self._start_dir:
            tail = os.pread(self._skel_fd, self._size - self._start_dir, self._start_dir)
            for pos, name in _central_entries(tail, 0, len(self._infos)):
                put(self._start_dir + pos + 16, struct.pack("<I", self._crc(name)))
        return bytes(raw)

    def _crc(self, name: str) -> int:
        ck = self._ck.get(name)
        return self._crcs[name] if ck is None else ck.value

    def _sid_bytes(self) -> bytes:
        """`.data/serialization_id` as torch.save sets it (computed once, on the writer thread)."""
        if getattr(self, "_sid", None) is None:
            sid_name = self._prefix + ".data/serialization_id"
            self._sid = _serialization_id(self._infos, sid_name, self._crc, os.pread(self._skel_fd, 40, self._sid_off))
            self._crcs[sid_name] = crc32(self._sid)
        return self._sid

    @property
    def complete(self) -> bool:
        return self._next == len(self._records)

    def close(self) -> str:
        """Write the rest (every record must have arrived) and return the file's digest (the manifest's hash)."""
        if not self.complete:
            missing = [k for k in range(self._next, len(self._records)) if k not in self._early]
            raise MConvertError(f"internal: {self.path}: records {missing[:3]} never arrived")
        self._skeleton_to(self._size)
        try:
            return self._f.close()
        finally:
            os.close(self._skel_fd)

    def abort(self) -> None:
        self._f.abort()
        os.close(self._skel_fd)

