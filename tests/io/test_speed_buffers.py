"""The pool of reused read and merge buffers (`io.buffers`): a slot is never handed out again while any tensor,
view or queued write still uses it; it is reused once free; the pool never holds more than was live at once;
and conversions with every tensor pooled write the same bytes as with the pool off."""

from __future__ import annotations

import gc
import hashlib
import threading
from pathlib import Path

import pytest
import torch

from mconvert.io import buffers
from mconvert.io.buffers import BufferPool
from mconvert.io.hashing import HashingFile, tensor_bytes
from mconvert.errors import MConvertError


def _span(t: torch.Tensor) -> tuple[int, int]:
    s = t.untyped_storage()
    return s.data_ptr(), s.data_ptr() + s.nbytes()


def test_a_viewed_slot_is_not_recycled() -> None:
    """After the tensor is dropped, a view of it (a row, a transpose, a numpy array, a memoryview) keeps its
    slot: tensors taken meanwhile lie elsewhere and writing them leaves the view's bytes as they were."""
    pool = BufferPool()
    views = {"row": lambda x: x[7:9], "t": lambda x: x.t(), "numpy": lambda x: x.numpy(),
             "memoryview": tensor_bytes}
    back = {"row": lambda v: v, "t": lambda v: v.t(), "numpy": torch.from_numpy,
            "memoryview": lambda v: torch.frombuffer(v, dtype=torch.float32).view(256, 1024)}
    for keep in views:
        t = pool.empty((256, 1024), torch.float32)
        t.copy_(torch.arange(t.numel(), dtype=torch.float32).view(256, 1024))
        want = t.clone()[7:9] if keep == "row" else t.clone()
        view = views[keep](t)
        lo, hi = _span(t)
        del t
        gc.collect()
        others = [pool.empty((256, 1024), torch.float32) for _ in range(3)]
        for o in others:
            a, b = _span(o)
            assert b <= lo or a >= hi, f"{keep}: a slot still viewed was handed out again"
            o.fill_(-1.0)
        assert torch.equal(back[keep](view), want), f"{keep}: the view's bytes changed"
        del view, others
        gc.collect()


def test_a_freed_slot_is_reused_and_the_pool_stays_within_its_peak() -> None:
    """Once no view is left, the next tensor of that size takes the same memory; live + idle bytes never
    exceed the most bytes ever live at once by more than the slack (idle slots of other sizes are unmapped
    to stay within it)."""
    pool = BufferPool()
    a = pool.empty((1 << 20,), torch.uint8)
    ptr = a.data_ptr()
    del a
    gc.collect()
    b = pool.empty((1 << 20,), torch.uint8)
    assert b.data_ptr() == ptr and pool.reused == 1 and pool.mapped == 1
    del b
    sizes = [3 << 20, 1 << 20, 5 << 20, 3 << 20, 8 << 20, 1 << 20, 2 << 20]
    live: list[torch.Tensor] = []
    for i, n in enumerate(sizes * 3):
        live.append(pool.empty((n,), torch.uint8))
        if i % 2:
            live.pop(0)
        gc.collect()
        assert pool.live + pool.idle <= pool.high + pool.high // buffers.SLACK
        assert pool.live >= sum(t.numel() for t in live)
    del live
    gc.collect()
    assert pool.live == 0 and pool.idle <= pool.high + pool.high // buffers.SLACK
    pool.trim()
    assert pool.idle == 0


@pytest.mark.timeout(60)
def test_a_queued_write_keeps_its_slot(tmp_path: Path) -> None:
    """A pooled tensor queued on a HashingFile and dropped by the caller is written with its own bytes, even
    when the writer gets to it only after new pooled tensors of the same size were taken and overwritten."""
    pool = BufferPool()
    go = threading.Event()
    f = HashingFile(tmp_path / "x.bin", algorithm="sha256")
    f.write_later(lambda: (go.wait(30), b"")[1])  # holds the writer thread until the overwrites are done
    t = pool.empty((1 << 20,), torch.uint8)
    t.copy_(torch.randint(0, 256, (1 << 20,), dtype=torch.uint8))
    want = bytes(tensor_bytes(t))
    f.write(tensor_bytes(t), keep=t)
    del t
    gc.collect()
    others = [pool.empty((1 << 20,), torch.uint8) for _ in range(2)]
    for o in others:
        o.fill_(0xAB)
    go.set()
    digest = f.close()
    assert (tmp_path / "x.bin").read_bytes() == want
    assert digest == hashlib.sha256(want).hexdigest()


def test_empty_gives_the_asked_shape_dtype_and_memory() -> None:
    """Pooled or not (below `MIN_BYTES`), `empty` is a contiguous CPU tensor of the asked shape and dtype whose
    bytes are writable."""
    for shape, dtype in [((3, 5), torch.float32), ((1024, 1024), torch.bfloat16), ((600, 700), torch.float32),
                         ((0, 4), torch.float32), ((1 << 20,), torch.int8)]:
        t = buffers.empty(shape, dtype)
        assert tuple(t.shape) == shape and t.dtype == dtype and t.is_contiguous() and t.device.type == "cpu"
        if t.numel():
            t.fill_(1)
            assert bool((t == 1).all())


@pytest.fixture(scope="module")
def small_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from mconvert.trainer.train import TrainConfig, train

    ck = tmp_path_factory.mktemp("pool") / "ck"
    train(TrainConfig(preset="tiny-gpt2", tp=2, pp=2, steps=1, save=str(ck), force=True, quiet=True, device="cpu"))
    return ck


def _tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.mark.timeout(300)
def test_conversions_with_every_tensor_pooled_write_the_same_bytes(small_ckpt: Path, tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """megatron-to-hf, hf-to-megatron and reshard with every read and merge buffer taken from the pool (and
    reused: the small model's tensors all qualify) write the very files, manifest included, that they write
    with the pool off."""
    from mconvert.convert.verbs import hf_to_megatron, megatron_to_hf, reshard

    def run(tag: str) -> dict[str, dict[str, bytes]]:
        megatron_to_hf(small_ckpt, tmp_path / tag / "hf")
        hf_to_megatron(tmp_path / tag / "hf", tmp_path / tag / "mg", tp=1, pp=2)
        reshard(small_ckpt, tmp_path / tag / "rs", tp=1, pp=1)
        return {k: _tree(tmp_path / tag / k) for k in ("hf", "mg", "rs")}

    monkeypatch.setattr(buffers, "_DISABLED", True)
    off = run("off")
    monkeypatch.setattr(buffers, "_DISABLED", False)
    monkeypatch.setattr(buffers, "MIN_BYTES", 1)
    before = buffers.POOL.reused
    on = run("on")
    assert buffers.POOL.reused > before, "the conversions took nothing from the pool"
    assert buffers.POOL.idle == 0, "a finished conversion left idle buffers mapped"
    for k in off:
        assert off[k].keys() == on[k].keys() and off[k] == on[k], f"{k}: pooled buffers changed the output"


@pytest.mark.timeout(30)
def test_a_slot_freed_while_the_pool_is_locked_is_taken_back_later() -> None:
    """A tensor freed while the pool's lock is held (a garbage collection inside the pool's own bookkeeping)
    neither deadlocks nor loses its slot: the next request of that size gets it."""
    pool = BufferPool()
    t = pool.empty((1 << 20,), torch.uint8)
    ptr = t.data_ptr()
    with pool._lock:
        del t  # its finalizer runs here, on this thread, with the lock held
        gc.collect()
    again = pool.empty((1 << 20,), torch.uint8)
    assert again.data_ptr() == ptr and pool.reused == 1 and pool.mapped == 1


def test_a_changing_mix_of_sizes_is_served_from_resident_slots(monkeypatch: pytest.MonkeyPatch) -> None:
    """The tensors in flight change their mix of sizes from one moment to the next (here four of 4 MiB, then
    three of 4 MiB, one of 3 and one of 1): serving both from resident slots takes a quarter more than the
    most bytes live at once, which the slack allows, so after the first round no memory is mapped again.
    Without the slack each switch evicts the slots the other mix needs and maps them anew. (Slots of exact
    sizes only: FIT is the other remedy, tested below.)"""
    monkeypatch.setattr(buffers, "FIT", 1)
    mib = 1 << 20
    mixes = [[4, 4, 4, 4], [4, 4, 4, 3, 1]]

    def new_mappings() -> int:
        pool = BufferPool()
        for i in range(10):
            held = [pool.empty((n * mib,), torch.uint8) for n in mixes[i % 2]]
            del held
            gc.collect()
            if i == 1:
                first = pool.mapped
        assert pool.high == 16 * mib
        return pool.mapped - first

    assert new_mappings() == 0
    monkeypatch.setattr(buffers, "SLACK", 1 << 40)
    assert new_mappings() >= 8


def test_a_tensor_without_a_slot_of_its_size_takes_a_larger_idle_one() -> None:
    """No idle slot of its size: the smallest idle slot up to FIT times larger is lent (its memory, no new
    mapping), the rest of it unused; a slot more than FIT times larger is left for a tensor of its size."""
    mib = 1 << 20
    pool = BufferPool()
    big, mid = pool.empty((16 * mib,), torch.uint8), pool.empty((8 * mib,), torch.uint8)
    spans = {16: big.data_ptr(), 8: mid.data_ptr()}
    del big, mid
    gc.collect()
    t = pool.empty((5 * mib,), torch.uint8)  # 8 and 16 MiB both hold it: the smaller is lent
    assert t.data_ptr() == spans[8] and pool.mapped == 2 and t.numel() == 5 * mib
    t.fill_(7)
    small = pool.empty((3 * mib,), torch.uint8)  # 16 MiB is more than FIT times 3 MiB: new memory
    assert small.data_ptr() != spans[16] and pool.mapped == 3
    assert pool.live == 8 * mib + 3 * mib and pool.idle == 16 * mib
    four = pool.empty((4 * mib,), torch.uint8)  # exactly FIT times smaller than the idle 16 MiB slot
    assert four.data_ptr() == spans[16] and pool.mapped == 3
    assert bool((t == 7).all())


def test_a_larger_tensor_grows_an_idle_slot_instead_of_mapping_a_new_one() -> None:
    """No idle slot holds it: the largest smaller idle slot is grown to its size (mremap), so the pages
    resident already are used again (the bytes left there are still there) and only the extension is new; the
    whole grown tensor is writable. A slot a view still holds is not idle and never grown; an idle slot that
    cannot be grown now (a dying view still exports it) is left, and new memory is mapped instead."""
    mib = 1 << 20
    pool = BufferPool()
    a, b, c = (pool.empty((n * mib,), torch.uint8) for n in (3, 2, 4))
    c.fill_(5)
    del a, b, c
    gc.collect()
    t = pool.empty((5 * mib,), torch.uint8)  # grows the 4 MiB slot
    assert pool.mapped == 3 and pool.grown == 1 and pool.live == 5 * mib and pool.idle == 5 * mib
    assert bool((t[:4 * mib] == 5).all())  # the 4 MiB slot moved with its pages: not new memory
    t.fill_(9)
    assert bool((t == 9).all())

    held = t[:10]  # a view keeps the 5 MiB slot: a larger tensor cannot take or grow it
    del t
    gc.collect()
    u = pool.empty((6 * mib,), torch.uint8)  # grows the idle 3 MiB slot, not the held 5 MiB one
    assert pool.grown == 2 and pool.mapped == 3 and bool((held == 9).all())
    assert pool.live + pool.idle <= pool.high + pool.high // buffers.SLACK
    del u
    gc.collect()
    six = next(s for s in pool._idle.values() if len(s) == 6 * mib)
    export = memoryview(six)  # the slot a 7 MiB tensor would grow is still exported: it cannot be resized
    v = pool.empty((7 * mib,), torch.uint8)
    assert pool.grown == 2 and pool.mapped == 4 and v.numel() == 7 * mib
    export.release()


@pytest.mark.timeout(60)
def test_pmap_iter_gives_results_in_order_with_a_bounded_lead(monkeypatch: pytest.MonkeyPatch) -> None:
    """The readers' ordered map: results in item order (slow early items included), never more items started
    and not yet taken than the pool has workers, the first error raised at its item, and once the consumer
    stops no item still running and none started after."""
    import time

    from mconvert.convert import base

    monkeypatch.setattr(base, "_POOL", None)
    monkeypatch.setattr(base, "_POOL_SIZE", 0)
    monkeypatch.setattr(base, "_WORKERS", 2)
    started: list[int] = []
    finished: list[int] = []
    lock = threading.Lock()

    slow_after_first = [False]  # the last part: items after the first take long, so some are running at close

    def fn(x: int) -> int:
        with lock:
            started.append(x)
        time.sleep(0.2 if slow_after_first[0] and x else 0.05 if x % 3 == 0 else 0.0)
        with lock:
            finished.append(x)
        if x == 7:
            raise ValueError("seven")
        return x * x

    got = []
    for i, r in enumerate(base.pmap_iter(fn, range(6))):
        with lock:
            assert len(started) <= i + 1 + 2, f"{len(started)} items started when item {i} was taken"
        got.append(r)
    assert got == [x * x for x in range(6)]
    with pytest.raises(ValueError, match="seven"):
        list(base.pmap_iter(fn, range(5, 12)))
    started.clear()
    finished.clear()
    slow_after_first[0] = True
    it = base.pmap_iter(fn, range(100))
    assert next(it) == 0
    it.close()
    with lock:
        assert sorted(finished) == sorted(started), (started, finished)  # none still running once it stops
    time.sleep(0.3)
    assert len(started) <= 3, started  # the pool's two, plus the one started as the first was taken
    base._POOL.shutdown(wait=True)


@pytest.mark.timeout(60)
def test_pmap_iter_runs_the_next_large_item_beside_one_in_progress(monkeypatch: pytest.MonkeyPatch) -> None:
    """A layer's parameters come weight, bias, weight, bias: a small item (a bias) takes no worker's place,
    so two weights are read at once, never more large items started and not yet taken than the pool has
    workers, and never more than LEAD per worker in all."""
    import time

    from mconvert.convert import base

    monkeypatch.setattr(base, "_POOL", None)
    monkeypatch.setattr(base, "_POOL_SIZE", 0)
    monkeypatch.setattr(base, "_WORKERS", 2)
    sizes = {x: (base.SMALL_ELEMENTS if x % 2 == 0 else base.SMALL_ELEMENTS - 1) for x in range(40)}
    running: set[int] = set()
    started: list[int] = []
    most_large_at_once = [0]
    lock = threading.Lock()

    def fn(x: int) -> int:
        with lock:
            started.append(x)
            running.add(x)
            most_large_at_once[0] = max(most_large_at_once[0], sum(1 for r in running if r % 2 == 0))
        time.sleep(0.05 if x % 2 == 0 else 0.0)
        with lock:
            running.discard(x)
        return x

    taken = []
    for i, r in enumerate(base.pmap_iter(fn, range(40), sizes.__getitem__)):
        with lock:
            ahead = [x for x in started if x > i]
        assert sum(1 for x in ahead if x % 2 == 0) <= 2, f"large items ahead of item {i}: {ahead}"
        assert len(ahead) <= base.LEAD * 2, f"items ahead of item {i}: {ahead}"
        taken.append(r)
    assert taken == list(range(40))
    assert most_large_at_once[0] == 2  # one weight at a time when every item held a worker's place
    base._POOL.shutdown(wait=True)


class _UnitsSource:
    """A source of `n` units of (weight, bias) whose reads are logged; unit `bad` fails its checks."""

    def __init__(self, n: int, log: list, lock: threading.Lock, bad: int | None = None) -> None:
        self.n, self.log, self.lock, self.bad = n, log, lock, bad

    def hf_part_tasks(self, unit: int, only: set[str] | None = None) -> tuple:
        import time

        from mconvert.convert import base

        if unit == self.bad:
            raise MConvertError(f"unit {unit} is incomplete")

        def one(name: str) -> dict:
            with self.lock:
                self.log.append(("start", unit, name))
            time.sleep(0.05 if name == "w" else 0.0)
            return {f"{unit}.{name}": torch.zeros(1)}

        return ["w", "b"], one, {"w": base.SMALL_ELEMENTS, "b": 1}.__getitem__


@pytest.mark.timeout(60)
def test_parts_ahead_starts_the_next_unit_before_the_last_part_is_taken(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every unit's parameters run on one pool: unit k+1's weight starts while the writer still takes unit k's
    last part; parts come in unit order, a unit `needs` passes over comes as (unit, SKIP) in its turn, with
    `ends` each unit's end as (unit, END) after its parts, and a unit whose checks fail raises after the parts
    of the units before it were taken."""
    import time

    from mconvert.convert import base

    monkeypatch.setattr(base, "_POOL", None)
    monkeypatch.setattr(base, "_POOL_SIZE", 0)
    monkeypatch.setattr(base, "_WORKERS", 2)
    log: list = []
    lock = threading.Lock()
    got = []
    src = _UnitsSource(6, log, lock)
    for unit, part in base.parts_ahead(iter(range(6)), lambda u: u != 3, src.hf_part_tasks):
        with lock:
            log.append(("taken", unit, part if part is base.SKIP else next(iter(part))))
        got.append((unit, part if part is base.SKIP else list(part)))
        time.sleep(0.03)  # the writer's time
    assert got == [(u, [f"{u}.{n}"]) for u in (0, 1, 2) for n in ("w", "b")] + [(3, base.SKIP)] + [
        (u, [f"{u}.{n}"]) for u in (4, 5) for n in ("w", "b")]
    for k, nxt in ((0, 1), (1, 2), (4, 5)):  # the next unit's weight started before this unit's bias was taken
        assert log.index(("start", nxt, "w")) < log.index(("taken", k, f"{k}.b")), (k, log)
    log.clear()
    taken = []
    with pytest.raises(MConvertError, match="unit 2 is incomplete"):
        src = _UnitsSource(5, log, lock, bad=2)
        for unit, part in base.parts_ahead(iter(range(5)), lambda u: True, src.hf_part_tasks, ends=True):
            taken.append(f"{unit}.end" if part is base.END else next(iter(part)))
    assert taken == ["0.w", "0.b", "0.end", "1.w", "1.b", "1.end"]
    base._POOL.shutdown(wait=True)


@pytest.mark.timeout(300)
def test_megatron_to_hf_hands_the_writer_one_parameter_at_a_time(small_ckpt: Path, tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """The HF writer takes each layer parameter by parameter (`parts_ahead`), so what it has written is freed
    before the rest of the layer is read; the files are those of a conversion given whole layers."""
    from mconvert.convert.hf import writer as hf_mod
    from mconvert.convert.verbs import megatron_to_hf

    seen: list[int] = []
    add = hf_mod.HFWriter.add

    def spy(self, unit, tensors):  # noqa: ANN001
        if isinstance(unit, int):
            seen.append(len({n.rsplit(".", 1)[0] for n in tensors}))  # modules given in this call
        return add(self, unit, tensors)

    monkeypatch.setattr(hf_mod.HFWriter, "add", spy)
    megatron_to_hf(small_ckpt, tmp_path / "parts")
    assert seen and max(seen) == 1, seen
    monkeypatch.setattr(hf_mod.HFWriter, "takes_parts", False)
    seen.clear()
    megatron_to_hf(small_ckpt, tmp_path / "whole")
    assert min(seen) > 1, seen  # the same writer given whole layers: several modules per call
    assert _tree(tmp_path / "parts") == _tree(tmp_path / "whole")


def _layer_parts_seen(monkeypatch: pytest.MonkeyPatch, writer: type) -> list[int]:
    """How many tensors each `writer.add` call brings for a layer (an empty end-of-layer call not counted)."""
    seen: list[int] = []
    add = writer.add

    def spy(self, unit, tensors, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003
        if isinstance(unit, int) and tensors:
            seen.append(len(tensors))
        return add(self, unit, tensors, *args, **kwargs)

    monkeypatch.setattr(writer, "add", spy)
    return seen


@pytest.mark.timeout(300)
@pytest.mark.parametrize("preset", ["tiny-gpt2", "tiny-llama"])
def test_hf_to_megatron_hands_the_writer_one_parameter_at_a_time(preset: str, tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """The streaming Megatron writer takes each layer parameter by parameter (`read_mcore_parts`; GPT-2's
    Conv1D weights read transposed block by block, Llama's q/k/v and gate/up placed row by row), so a layer is
    never in memory whole; the rank files are those of a conversion given whole layers (which
    `test_bench_io.test_streamed_hf_to_megatron_equals_torch_save` holds to torch.save's bytes)."""
    from mconvert.convert.megatron import writer as mg
    from mconvert.convert.verbs import hf_to_megatron, megatron_to_hf
    from mconvert.trainer.train import TrainConfig, train

    ck = tmp_path / "ck"
    train(TrainConfig(preset=preset, tp=1, pp=1, steps=1, save=str(ck), force=True, quiet=True, device="cpu"))
    megatron_to_hf(ck, tmp_path / "hf")
    seen = _layer_parts_seen(monkeypatch, mg.MegatronWriter)
    hf_to_megatron(tmp_path / "hf", tmp_path / "parts", tp=2, pp=2)
    assert seen and max(seen) == 1, seen
    monkeypatch.setattr(mg.MegatronWriter, "takes_parts", property(lambda self: False))
    seen.clear()
    hf_to_megatron(tmp_path / "hf", tmp_path / "whole", tp=2, pp=2)
    assert min(seen) > 1, seen  # whole layers: every parameter of the layer in one call
    assert _tree(tmp_path / "parts") == _tree(tmp_path / "whole")


@pytest.mark.timeout(300)
def test_reshard_hands_the_writer_one_parameter_at_a_time(small_ckpt: Path, tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """reshard streams a layer to the Megatron writer parameter by parameter too (`read_mcore_parts`); its
    rank files are those of whole layers (`test_bench_io.test_streamed_reshard_equals_torch_save` holds the
    streamed path to torch.save's bytes)."""
    from mconvert.convert.megatron import writer as mg
    from mconvert.convert.verbs import reshard

    seen = _layer_parts_seen(monkeypatch, mg.MegatronWriter)
    reshard(small_ckpt, tmp_path / "parts", tp=1, pp=1)
    assert seen and max(seen) == 1, seen
    monkeypatch.setattr(mg.MegatronWriter, "takes_parts", property(lambda self: False))
    seen.clear()
    reshard(small_ckpt, tmp_path / "whole", tp=1, pp=1)
    assert min(seen) > 1, seen
    assert _tree(tmp_path / "parts") == _tree(tmp_path / "whole")


@pytest.mark.timeout(300)
def test_megatron_to_ft_takes_a_layer_in_parts_and_refuses_a_missing_parameter(small_ckpt: Path, tmp_path: Path,
                                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """The FasterTransformer writer takes each layer parameter by parameter, writing the same files as when
    given whole layers (`test_deploy_ft` holds those to FT's loader file list and to transformers' logits);
    a layer that ends without one of its parameters is refused by name, as a whole layer without it is."""
    from mconvert.convert.deploy import fastertransformer as ft
    from mconvert.convert.verbs import megatron_to_ft
    from mconvert.convert.megatron.source import MegatronSource
    from mconvert.errors import MConvertError

    seen = _layer_parts_seen(monkeypatch, ft.FTWriter)
    megatron_to_ft(small_ckpt, tmp_path / "parts", infer_tp=2)
    assert seen and max(seen) == 1, seen
    monkeypatch.setattr(ft.FTWriter, "takes_parts", False)
    seen.clear()
    megatron_to_ft(small_ckpt, tmp_path / "whole", infer_tp=2)
    assert min(seen) > 1, seen
    assert _tree(tmp_path / "parts") == _tree(tmp_path / "whole")

    src = MegatronSource(small_ckpt)
    layer = src.read_mcore(0)
    dropped = "decoder.layers.0.mlp.linear_fc2.weight"
    out = tmp_path / "missing"
    out.mkdir()
    w = ft.FTWriter(out, ft.prepare(src.spec, 2, source="ck"))
    for name, t in layer.items():
        if name != dropped:
            w.add(0, {name: t}, complete=False)
    with pytest.raises(MConvertError, match=f"parameter '{dropped}' is missing"):
        w.add(0, {}, complete=True)
    w.abort()
    src.close()
