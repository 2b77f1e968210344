"""The Source contract (`SourceBase`): a Source yields one unit (embedding, a layer, final) at a time, and declares
every capability the driver and the verbs read, with its default, as `convert/writer.py` does for writers.

Pivot (docs/architecture.md): full, unsharded tensors. `read_mcore(unit)` gives them under canonical megatron-core
local-spec names (global layer index, vocab rows as stored — padded for a Megatron source);
`read_hf(unit)` gives them under HF names through the family plugin (vocab rows = the true vocab).
Writers consume units one by one, so peak memory is one unit's shards plus the output buffer.
"""

from __future__ import annotations

import math
import threading
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor, wait
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mconvert.errors import MConvertError
from mconvert.mappings import to_hf
from mconvert.spec import ModelSpec, Unit, comes_whole

if TYPE_CHECKING:
    import torch


def units_of(spec: ModelSpec, split_experts: bool = False) -> list[Unit]:
    """"embedding", each layer (or, with `split_experts`, each MoE layer's dense part and experts), "final"."""
    return spec.units(split_experts)


class SourceBase:
    """The Source contract every input format subclasses (`open_source` returns one): `units()` and `read_hf` =
    the family plugin over `read_mcore`, and every capability the driver (`driver.drive`) and the verbs
    (`convert/verbs.py`) read, declared here with its default. A source overrides what it has (a class
    attribute, an instance attribute set in `__init__`, or a method); nothing asks a source with getattr /
    hasattr what it happens to define (`tests/convert/test_convert_writer.py` reads the code with ast)."""

    path: Path
    format: str  # "megatron" | "megatron-torch_dist" | "hf"
    spec: ModelSpec
    tokenizer_dir: Path | None = None  # where tokenizer files live, when known
    tp: int = 1
    pp: int = 1
    vpp: int | None = None
    ep: int = 1  # expert-parallel size (Megatron MoE checkpoints)
    iteration: int | str | None = None
    # the checkpoint's pipeline split (a Megatron source: its `layouts.megatron.PipelineSplit`, even or uneven); a
    # reshard keeps it at the same PP/VPP
    split: Any = None
    # False where the vocab size is a padded guess (args without vocab_size, no tokenizer found)
    vocab_known: bool = True
    # the directory above the iteration directory (a Megatron source), where carried HF metadata may lie
    root: Path | None = None
    iter_dir: Path | None = None  # a Megatron source's iteration directory
    args: Any = None  # a Megatron source's args (Namespace or dict), carried into a reshard's output
    shapes: dict[str, tuple[int, ...]] | None = None  # a Megatron torch source: each parameter's shape on TP rank 0
    config: dict[str, Any] | None = None  # an HF source's config.json
    # an HF source's block-scaled FP8 weights: the (rows, cols) of one scale's block (`hf.fp8.block_config`)
    fp8_block: tuple[int, int] | None = None
    # a torch_dist source: its distributed optimizer's layout; Megatron-Bridge's writer info and run_config.yaml
    optimizer_layout: str | None = None
    writer: dict[str, Any] | None = None
    bridge_config: dict[str, Any] | None = None
    # what the memory pre-check counted (`bounds.held_together` part -> bytes) and the file it names; the driver
    # checks it again for a writer fed whole layers or whole units (`bounds.held_by_writer`)
    held_sizes: dict[Any, int] | None = None
    held_source: str = ""

    # `preview(unit)`: what `read_mcore(unit)` returns, as meta tensors, without reading data — sources that
    # can say define it (Megatron torch, HF safetensors); writers then lay their files out ahead
    preview = None
    # Whether `read_*` / `preview` also take a `LayerPart` (an MoE layer's dense part or one expert): the
    # driver then moves one expert at a time to writers that take them too
    splits_experts = False
    # How the driver may read a unit in parts for a writer that `takes_parts`: `hf_part_tasks` /
    # `mcore_part_tasks` give a unit's reads as tasks that several units share one pool over (`parts_ahead`),
    # `read_mcore_parts` gives an mcore unit in parts; a source without them is read unit by unit
    gives_hf_tasks = False
    gives_mcore_tasks = False
    gives_mcore_parts = False

    def can_preview(self) -> bool:
        """Whether `preview` holds for every unit (a source may have one that some inputs cannot give)."""
        return True

    def train_state(self) -> dict[str, Any] | None:
        """Megatron-Bridge's training counters (`train_state.pt`) of a torch_dist source, or None."""
        return None

    def listed_files(self) -> list[dict[str, Any]] | None:
        """The checkpoint's files with their bytes, as `inspect` lists them (a torch_dist source); None: not
        listed."""
        return None

    def units(self, split_experts: bool = False) -> list[Unit]:
        return units_of(self.spec, split_experts and self.splits_experts)

    def read_mcore(self, unit: Unit) -> dict[str, torch.Tensor]:  # pragma: no cover - abstract
        raise NotImplementedError

    def read_hf(self, unit: Unit) -> dict[str, torch.Tensor]:
        """Full tensors under HF names, vocab stripped to the true vocab."""
        return to_hf(self.spec, unit, self.read_mcore(unit), source=str(self.path))

    def read_hf_parts(self, unit: Unit, only: set[str] | None = None) -> Iterator[dict[str, torch.Tensor]]:
        """`read_hf(unit)` in consecutive parts (same tensors, same order), each given as soon as it is ready,
        for a writer that takes a unit in parts (`takes_parts`): what it has written is freed before the rest
        of the unit is read. `only` (the writer's `wants`): the HF names the writer keeps; a source may leave
        a parameter none of whose HF tensors it names unread. This default gives the whole unit as one part."""
        yield self.read_hf(unit)

    def hf_part_tasks(self, unit: Unit, only: set[str] | None = None) -> PartTasks:  # pragma: no cover - declared
        """`read_hf_parts(unit, only)` as tasks on one pool (`gives_hf_tasks`)."""
        raise NotImplementedError

    def mcore_part_tasks(self, unit: Unit) -> PartTasks:  # pragma: no cover - declared
        """`read_mcore_parts(unit)` as tasks on one pool (`gives_mcore_tasks`)."""
        raise NotImplementedError

    def read_mcore_parts(self, unit: Unit) -> Iterator[dict[str, torch.Tensor]]:  # pragma: no cover - declared
        """`read_mcore(unit)` in consecutive parts (`gives_mcore_parts`)."""
        raise NotImplementedError

    def read_unit(self, unit: Unit, with_optimizer: bool = False) -> tuple[dict[str, torch.Tensor], dict[str, dict]]:
        """(`read_mcore(unit)`, each parameter's optimizer states) for a writer that `takes_states`; a source
        that holds no optimizer states refuses."""
        raise MConvertError(f"{self.path}: a {self.format} checkpoint holds no optimizer states")

    def read_unit_parts(self, unit: Unit, with_optimizer: bool = False
                        ) -> Iterator[tuple[dict[str, torch.Tensor], dict[str, dict]]]:
        """`read_unit(unit, with_optimizer)` in consecutive parts (same tensors and states, same order), for a
        writer that `takes_states` and `takes_parts`. This default gives the whole unit as one part."""
        yield self.read_unit(unit, with_optimizer)

    def close(self) -> None:
        """Release what the source keeps open (files, descriptors); a source holding nothing open does nothing."""

    def __enter__(self) -> "SourceBase":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def describe(self) -> str:
        par = f"TP={self.tp} PP={self.pp}" + (f" VPP={self.vpp}" if self.vpp else "") + (
            f" EP={self.ep}" if self.ep > 1 else "")
        return f"{self.format} checkpoint {self.path} ({self.spec.family}, {par})"


# ---- the readers' thread pool: a unit's parameters read and re-laid several at once ---------------------------
_POOL: Any = None
_POOL_SIZE = 0
_WORKERS = 0  # 0: one per core of this process (at least 2, at most 8)
SMALL_ELEMENTS = 1 << 18  # `pmap_iter`: an item whose result holds fewer elements takes no worker's place
LEAD = 4  # `pmap_iter`: items started and not yet taken, at most, per worker


def set_workers(n: int) -> None:
    """`--workers N`: how many parameters are read and re-laid at once (1: one after another; 0: one per core).
    Memory grows with N by at most N large parameters (their merged form) and a few small ones, not by units."""
    global _POOL, _WORKERS
    if n < 0:
        raise MConvertError(f"--workers {n}: expected 0 (one per core) or a positive number")
    if _POOL is not None:
        _POOL.shutdown(wait=True)
        _POOL = None
    _WORKERS = n


def _pool() -> Any:
    """The readers' thread pool (`set_workers`), created on first use; None when one worker is asked for, or
    by default where this process has one core (a torchrun process on a machine it shares with another)."""
    global _POOL, _POOL_SIZE
    if _WORKERS == 1:
        return None
    if _POOL is None:
        from mconvert.io.tuning import process_cores

        size = _WORKERS or min(process_cores(), 8)
        if size == 1:
            return None
        _POOL_SIZE = size
        _POOL = ThreadPoolExecutor(_POOL_SIZE, thread_name_prefix="read-param")
    return _POOL


def pmap(fn: Any, items: Any) -> list[Any]:
    """`list(map(fn, items))` on the readers' pool — serially when already on it (a nested map on a full
    pool would wait for itself). Exceptions surface in item order, as with map."""
    pool = _pool()
    if pool is None or threading.current_thread().name.startswith("read-param"):
        return [fn(x) for x in items]
    return list(pool.map(fn, items))


def pmap_iter(fn: Any, items: Any, size: Callable[[Any], int] | None = None) -> Iterator[Any]:
    """`map(fn, items)` on the readers' pool, each result given in order as soon as it and those before it are
    done: a result waits for its consumer, not for the rest of the items. At most as many large items started
    and not yet taken as the pool has workers, and LEAD times that many items in all; an item is large unless
    `size(item)` (its result's element count) is below SMALL_ELEMENTS. A bias or a norm thus never holds a
    worker's place: the next large item starts beside the one in progress, where counting every item would
    leave a layer's weights, each followed by its bias, to be read one at a time. `items` is taken one item at
    a time as items start (an iterator's own work runs on the consumer's thread then). Serially when already
    on the pool. Exceptions, `items`' own included, surface in item order; when the consumer stops (an error,
    a writer that failed), items not started are never run and the running ones finish before it goes on:
    none still reads a source the caller then closes."""
    pool = _pool()
    if pool is None or threading.current_thread().name.startswith("read-param"):
        for x in items:
            yield fn(x)
        return
    todo = iter(items)
    ahead: list[Any] = []  # the next item, taken from `items` and not started yet (a large one waiting its turn)
    started: deque[tuple[Future[Any], bool]] = deque()
    large, ended = 0, False

    def start() -> None:
        nonlocal large, ended
        while not ended and len(started) < LEAD * _POOL_SIZE:
            if not ahead:
                try:
                    ahead.append(next(todo))
                except StopIteration:
                    ended = True
                    return
                except Exception as e:  # noqa: BLE001 - raised in its turn, after the items before it
                    failed: Future[Any] = Future()
                    failed.set_exception(e)
                    started.append((failed, False))
                    ended = True
                    return
            big = size is None or size(ahead[0]) >= SMALL_ELEMENTS
            if big and large >= _POOL_SIZE:
                return
            started.append((pool.submit(fn, ahead.pop()), big))
            large += big

    try:
        start()
        while started:
            future, big = started.popleft()
            done = future.result()
            large -= big
            start()  # the next items start while the consumer takes this one
            yield done
    finally:
        for f, _ in started:
            f.cancel()
        wait([f for f, _ in started])


SKIP, END = object(), object()  # `parts_ahead`'s marks: a unit passed over; a unit's last part given
# one unit's reads (`hf_part_tasks`, `mcore_part_tasks`): its items in order, the call that reads one part, and
# each item's element count (`pmap_iter`'s `size`)
PartTasks = tuple[list[Any], Callable[[Any], dict[str, "torch.Tensor"]], Callable[[Any], int]]


def parts_ahead(units: Iterator[Unit], needs: Callable[[Unit], bool],
                tasks: Callable[[Unit], PartTasks],
                ends: bool = False) -> Iterator[tuple[Unit, Any]]:
    """(unit, part) for the parts of every unit in order, every unit's reads on one `pmap_iter`: `tasks(unit)`
    gives a unit's items in order, the call that reads one (a part) and each one's element count, and is asked
    as the pool reaches the unit (its checks run then). The next unit's first parts are read while the last
    ones of the unit before are still being taken, so the readers do not wait at each unit's end for the
    writer. (unit, SKIP) for a unit `needs` passes over; with `ends`, (unit, END) after a unit's last part."""
    def items() -> Iterator[tuple[Unit, Any, Any, int]]:
        for unit in units:
            if not needs(unit):
                yield unit, SKIP, None, 0
                continue
            names, one, elements = tasks(unit)
            for name in names:
                yield unit, name, one, elements(name)
            if ends:
                yield unit, END, None, 0

    def run(item: tuple[Unit, Any, Any, int]) -> tuple[Unit, Any]:
        unit, name, one, _ = item
        return unit, name if one is None else one(name)

    yield from pmap_iter(run, items(), lambda item: item[3])


class LayerParts(SourceBase):
    """A source whose dense layers reach a Megatron-side writer parameter by parameter: `read_mcore_parts` and
    `mcore_part_tasks` from its `layer_part_tasks(layer)`."""

    gives_mcore_tasks = True
    gives_mcore_parts = True

    def layer_part_tasks(self, unit: Unit) -> PartTasks:  # pragma: no cover - abstract
        """One dense layer's items in order, the call that reads one part, their element counts."""
        raise NotImplementedError

    def comes_whole(self, unit: Unit) -> bool:
        """`spec.comes_whole` of this source's model."""
        return comes_whole(self.spec, unit)

    def read_mcore_parts(self, unit: Unit) -> Iterator[dict[str, torch.Tensor]]:
        """`read_mcore(unit)` in parts, same tensors, same order: a dense layer's parameters one per part on the
        readers' pool, each given as soon as it and those before it are read (a layer is not in memory whole);
        a unit that `comes_whole`, read here, its parameters several at once."""
        if self.comes_whole(unit):
            yield self.read_mcore(unit)
            return
        names, one, elements = self.layer_part_tasks(unit)
        yield from pmap_iter(one, names, elements)

    def mcore_part_tasks(self, unit: Unit) -> PartTasks:
        """What `read_mcore_parts(unit)` reads, for a caller that runs several units on one pool (`parts_ahead`):
        the items in order, the call that reads one part and each one's element count. A unit that
        `comes_whole` is one item."""
        if self.comes_whole(unit):
            return [unit], lambda u: self.read_mcore(u), lambda u: SMALL_ELEMENTS
        return self.layer_part_tasks(unit)


def param_elements(spec: ModelSpec, unit: Unit) -> Callable[[str], int]:
    """Parameter name -> its element count in the full model (`pmap_iter`'s `size`); a name the spec does not
    declare counts as large."""
    sizes = {d.name: math.prod(d.shape) for d in spec.unit_params(unit)}
    return lambda name: sizes.get(name, SMALL_ELEMENTS)
