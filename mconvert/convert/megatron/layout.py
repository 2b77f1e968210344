"""Megatron legacy "torch" checkpoint layout: directory names, the latest-iteration file, stage math.

Pure path and index arithmetic plus the two small file writes every writer shares (rank file, tracker).
    CKPT/latest_checkpointed_iteration.txt          "10" or "release"
    CKPT/iter_0000010/mp_rank_TT[_PPP][_EEE]/model_optim_rng.pt
(`_PPP` only when PP > 1, `_EEE` only when expert parallel EP > 1: `mp_rank_00_001` is a PP rank or an EP rank
depending on the args.)
"""

from __future__ import annotations

import numbers
import os
import re
from pathlib import Path
from typing import Any


from mconvert.io.paths import inside_file, make_dirs, read_small
from mconvert.errors import MConvertError

TRACKER = "latest_checkpointed_iteration.txt"
RANK_FILE = "model_optim_rng.pt"
CHECKPOINT_VERSION = 3.0
_RANK_RE = re.compile(r"^mp_rank_(\d{2})(?:_(\d{3}))?(?:_(\d{3}))?$")


def checked_iteration(value: Any, what: str) -> int | str:
    """`value` as Megatron-LM's loader reads an iteration (the tracker's text, an `iter_%07d` name): 'release'
    or an integer >= 0 — not a bool, not 2.5, not -3, which would be written as a tracker `True` or an
    `iter_-000003` no loader opens. Anything else is one MConvertError naming `what`."""
    if isinstance(value, str) and value == "release":
        return value
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0:
        shown = repr(value)[:40]
        raise MConvertError(f"{what}: iteration {shown} is not a training iteration (an integer >= 0, or 'release'); "
                            "the file is damaged or was edited — re-copy the checkpoint")
    return int(value)


def iteration_dir_name(iteration: int | str) -> str:
    it = checked_iteration(iteration, "internal: the iteration to write")
    return "release" if it == "release" else f"iter_{it:07d}"


def stored_iteration(state: dict[str, Any], directory: int | str | None, source: Path) -> int | str | None:
    """The iteration a checkpoint's rank file or `common.pt` stores (`state['iteration']`), checked: a
    valid iteration (`checked_iteration`) equal to its directory's (`iter_0000005` holds 5: Megatron-LM saves
    them together, so another number means a damaged or edited file, and converting it would renumber the
    checkpoint). A release directory keeps 'release'; a directory named otherwise takes the stored number."""
    if directory == "release" or state.get("iteration") is None:
        return directory
    it = checked_iteration(state["iteration"], f"{source}: 'iteration'")
    if directory is not None and it != directory:
        raise MConvertError(f"{source}: 'iteration' is {it} but the file lies in {iteration_dir_name(directory)}; "
                            "Megatron-LM saves both as one number — re-copy the checkpoint (or rename the directory "
                            "to the iteration the file holds)")
    return it


def rank_dir_name(tp_rank: int, pp_rank: int, pp_size: int, ep_rank: int = 0, ep_size: int = 1) -> str:
    """`mp_rank_TT`, + `_PPP` when PP > 1, + `_EEE` when EP > 1 (Megatron-LM's get_checkpoint_name)."""
    name = f"mp_rank_{tp_rank:02d}" if pp_size == 1 else f"mp_rank_{tp_rank:02d}_{pp_rank:03d}"
    return name if ep_size == 1 else f"{name}_{ep_rank:03d}"


def rank_file(root: str | Path, iteration: int | str, tp_rank: int, pp_rank: int, pp_size: int,
              ep_rank: int = 0, ep_size: int = 1) -> Path:
    return (Path(root) / iteration_dir_name(iteration) / rank_dir_name(tp_rank, pp_rank, pp_size, ep_rank, ep_size)
            / RANK_FILE)


def parse_rank_dir(name: str) -> tuple[int, int | None] | None:
    """`mp_rank_01_002` -> (1, 2); `mp_rank_01` -> (1, None); anything else -> None."""
    m = _RANK_RE.match(name)
    if not m:
        return None
    return int(m.group(1)), (int(m.group(2)) if m.group(2) is not None else None)


def rank_dir_parts(name: str) -> tuple[int, ...] | None:
    """`mp_rank_01_002_001` -> (1, 2, 1); `mp_rank_01` -> (1,); anything else -> None."""
    m = _RANK_RE.match(name)
    return None if m is None else tuple(int(g) for g in m.groups() if g is not None)


def rank_of_parts(parts: tuple[int, ...], pp_size: int, ep_size: int) -> tuple[int, int, int] | None:
    """A rank dir's numbers -> (tp_rank, pp_rank, ep_rank), read with the run's PP and EP sizes (the second
    number is the PP rank unless PP == 1 and EP > 1); None when the name has more numbers than the sizes allow.
    `mp_rank_TT_000` at PP == 1 (transformers' conversion script writes it) is PP rank 0."""
    if len(parts) == 3:
        return (parts[0], parts[1], parts[2]) if ep_size > 1 else None
    if len(parts) == 2:
        return (parts[0], 0, parts[1]) if ep_size > 1 and pp_size == 1 else (parts[0], parts[1], 0)
    return parts[0], 0, 0


def read_latest(root: str | Path, other: str | None = "pass --iteration") -> int | str:
    """The iteration named by the tracker file: an int or 'release'. One-line error when unreadable; `other`:
    the caller's way around the tracker, named in the error (None: the caller has none)."""
    path = Path(root) / TRACKER
    alt = f" or {other}" if other else ""
    if not os.path.lexists(path):
        raise MConvertError(f"{path}: not found; is {root} a Megatron checkpoint directory?"
                            + (f" ({alt.strip()})" if other else ""))
    try:
        text = read_small(inside_file(root, TRACKER, f"{root}: tracker file"), "tracker").decode().strip()
    except UnicodeDecodeError as e:
        raise MConvertError(f"{path}: unreadable ({e}); write the iteration number into it{alt}") from None
    if text == "release":
        return "release"
    try:
        it = int(text)
    except ValueError:
        raise MConvertError(
            f"{path}: expected an iteration number or 'release', found {text[:40]!r}; fix it{alt}"
        ) from None
    if it < 0:  # no iter_* directory Megatron-LM (or the trainer, which starts at 0) writes has one
        raise MConvertError(f"{path}: iteration {it} is negative; write the iteration number of a saved iter_* "
                            f"directory into it{alt}")
    return it


def write_latest(root: str | Path, iteration: int | str) -> None:
    path = Path(root) / TRACKER
    tmp = path.with_suffix(".tmp")
    tmp.write_text(str(checked_iteration(iteration, "internal: the iteration to write")))
    os.replace(tmp, path)


def save_rank_file(path: str | Path, state: dict[str, Any]) -> None:
    """torch.save into a temporary name, then rename: a killed save never leaves a truncated rank file."""
    path = Path(path)
    make_dirs(path.parent)
    tmp = path.with_name(path.name + ".tmp")
    from mconvert.io import repickle  # torch: the names and paths above serve `plan` without it

    repickle.save(state, tmp)
    os.replace(tmp, path)


def stage_layers(num_layers: int, pp: int, pp_rank: int, vpp: int | None = None) -> list[range]:
    """Global layer indices held by pipeline rank `pp_rank`: one list per virtual chunk (one when no VPP).

    Without VPP the layers are contiguous blocks; with VPP chunk c of rank r holds model chunk c·pp + r
    (PP=2, VPP=2, 4 layers: rank 0 holds 0 and 2, rank 1 holds 1 and 3). Ranges, not lists: the layer count
    comes from args that are checked against the weights only after the stage's keys are read."""
    chunks = vpp or 1
    if num_layers % (pp * chunks):
        raise MConvertError(f"PP={pp}×VPP={chunks} does not divide num_layers={num_layers}")
    per = num_layers // (pp * chunks)
    return [range((c * pp + pp_rank) * per, (c * pp + pp_rank + 1) * per) for c in range(chunks)]


def layer_location(num_layers: int, pp: int, layer: int, vpp: int | None = None) -> tuple[int, int, int]:
    """Global layer -> (pp_rank, chunk, local index within the chunk)."""
    chunks = vpp or 1
    per = num_layers // (pp * chunks)
    model_chunk, local = divmod(layer, per)
    chunk, pp_rank = divmod(model_chunk, pp)
    return pp_rank, chunk, local
