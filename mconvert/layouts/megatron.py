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
from typing import Any, Mapping


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


# ---- pipeline stages ----------------------------------------------------------------------------------
SPLIT_ARGS = ("decoder_first_pipeline_num_layers", "decoder_last_pipeline_num_layers",
              "pipeline_model_parallel_layout", "account_for_embedding_in_pipeline_split",
              "account_for_loss_in_pipeline_split")
# megatron-core's TransformerConfig names of the first two (older Megatron-LM args carried these)
_CONFIG_ALIASES = {"num_layers_in_first_pipeline_stage": "decoder_first_pipeline_num_layers",
                   "num_layers_in_last_pipeline_stage": "decoder_last_pipeline_num_layers"}
_LAYOUT_CHARS = {"E": "embedding", "L": "loss", "t": "decoder", "m": "mtp"}


def parse_pipeline_layout(text: str, what: str = "--pipeline-model-parallel-layout") -> list[str]:
    """A Megatron-LM layout string -> one string of layer letters per (virtual) stage, in model-chunk order
    (megatron-core `PipelineParallelLayerLayout.parse_str_to_list`): commas are cosmetic, `(...)*n` and `x*n`
    repeat, `|` ends a stage; E embedding, t decoder layer, m MTP layer, L loss."""
    s = text.replace(",", "")
    for pattern in (r"\(([^)]+)\)\*(\d+)", r"(.)\*(\d+)"):
        s = re.sub(pattern, lambda m: m.group(1) * int(m.group(2)), s)
    stages = s.split("|")
    bad = sorted({c for st in stages for c in st if c not in _LAYOUT_CHARS})
    if bad:
        raise MConvertError(f"{what} {text[:80]!r}: unknown layer letter(s) {', '.join(map(repr, bad))}; "
                            "Megatron-LM knows E (embedding), t (decoder layer), m (MTP layer), L (loss), "
                            "| between stages, (…)*n and x*n")
    return stages


class PipelineSplit:
    """Which global decoder layers each pipeline rank and virtual chunk holds.

    `counts[c][p]`: decoder layers of chunk c on PP rank p. Model chunks run in the order (c, p) — chunk 0 of
    every rank, then chunk 1 … — and take consecutive layers (megatron-core `get_transformer_layer_offset`,
    `PipelineParallelLayerLayout.get_layer_offset`). An even split, Megatron-LM's
    `--decoder-first/last-pipeline-num-layers`, `--account-for-embedding/loss-in-pipeline-split` and
    `--pipeline-model-parallel-layout` are all such a table; `args` keeps the Megatron-LM args that state it."""

    def __init__(self, pp: int, vpp: int | None, counts: list[list[int]], args: dict[str, Any]) -> None:
        self.pp, self.vpp, self.counts, self.args = pp, vpp, counts, args
        self.num_layers = sum(map(sum, counts))
        self._offsets: dict[tuple[int, int], int] = {}
        at = 0
        for c, row in enumerate(counts):
            for p, n in enumerate(row):
                self._offsets[(c, p)] = at
                at += n

    def __eq__(self, other: object) -> bool:
        return isinstance(other, PipelineSplit) and (self.pp, self.vpp, self.counts) == (other.pp, other.vpp,
                                                                                        other.counts)

    def __repr__(self) -> str:
        return f"PipelineSplit(pp={self.pp}, vpp={self.vpp}, counts={self.counts})"

    @property
    def even(self) -> bool:
        return not any(v not in (None, False) for v in self.args.values())

    def stage_layers(self, pp_rank: int) -> list[range]:
        """Global layers of PP rank `pp_rank`: one range per virtual chunk."""
        return [range(self._offsets[(c, pp_rank)], self._offsets[(c, pp_rank)] + self.counts[c][pp_rank])
                for c in range(len(self.counts))]

    def layer_counts(self) -> list[int]:
        """Decoder layers per PP rank, all its chunks together."""
        return [sum(row[p] for row in self.counts) for p in range(self.pp)]

    def layer_location(self, layer: int) -> tuple[int, int, int]:
        """Global layer -> (pp_rank, chunk, local index within the chunk)."""
        for (c, p), start in self._offsets.items():
            if start <= layer < start + self.counts[c][p]:
                return p, c, layer - start
        raise MConvertError(f"internal: layer {layer} is outside the {self.num_layers} layers of {self!r}")

    def megatron_args(self) -> dict[str, Any]:
        """The Megatron-LM args that state this split (an even split: their defaults)."""
        return {k: self.args.get(k, False if k.startswith("account") else None) for k in SPLIT_ARGS}

    def describe(self) -> str:
        """The split in the words of the args that state it, for reports and errors."""
        set_ = {k: v for k, v in self.args.items() if v not in (None, False)}
        return ", ".join(f"{k}={v}" for k, v in set_.items()) or "even"

    # ---- constructors ----
    @classmethod
    def make(cls, num_layers: int, pp: int, vpp: int | None = None, first: int | None = None,
             last: int | None = None, layout: str | None = None, embedding_in_split: bool = False,
             loss_in_split: bool = False, mtp_num_layers: int | None = None) -> "PipelineSplit":
        """The split Megatron-LM builds from these args; values that do not describe one are one MConvertError
        naming them (megatron-core's asserts in `get_num_layers_to_build` / `PipelineParallelLayerLayout`)."""
        args: dict[str, Any] = {"decoder_first_pipeline_num_layers": first, "decoder_last_pipeline_num_layers": last,
                                "pipeline_model_parallel_layout": layout,
                                "account_for_embedding_in_pipeline_split": bool(embedding_in_split),
                                "account_for_loss_in_pipeline_split": bool(loss_in_split)}
        if layout is not None:
            others = [k for k, v in args.items() if k != "pipeline_model_parallel_layout" and v not in (None, False)]
            if others:
                raise MConvertError(f"pipeline_model_parallel_layout={layout!r} with {others[0]}={args[others[0]]!r}: "
                                    "Megatron-LM takes one way of splitting the pipeline; drop one of them")
            return cls._from_layout(num_layers, pp, vpp, layout, mtp_num_layers, args)
        if pp == 1:
            extra = [k for k, v in args.items() if v not in (None, False)]
            if extra:
                raise MConvertError(f"{extra[0]}={args[extra[0]]!r} needs pipeline parallelism (PP > 1); drop it")
        chunks = vpp or 1
        if first is not None or last is not None:
            if embedding_in_split or loss_in_split:
                raise MConvertError("decoder_first/last_pipeline_num_layers with account_for_embedding/loss_in_"
                                    "pipeline_split: megatron-core refuses the pair; drop one")
            return cls._first_last(num_layers, pp, vpp, first, last, args)
        total = num_layers + bool(embedding_in_split) + bool(loss_in_split)
        if total % (pp * chunks):
            what = "num_layers" + (" + 1 (embedding)" if embedding_in_split else "") + \
                (" + 1 (loss)" if loss_in_split else "")
            raise MConvertError(f"PP={pp}" + (f"×VPP={vpp}" if vpp else "") + f" does not divide {what}={total}; "
                                "pick a PP that does, or give the first and last stages their own layer counts "
                                "(--decoder-first-pipeline-num-layers / --decoder-last-pipeline-num-layers)")
        per = total // (pp * chunks)
        counts = [[per] * pp for _ in range(chunks)]
        counts[0][0] -= bool(embedding_in_split)
        counts[-1][-1] -= bool(loss_in_split)
        if min(counts[0][0], counts[-1][-1]) < 0:
            raise MConvertError(f"PP={pp}: a stage of {per} layers cannot give one to the embedding or the loss; "
                                "drop --account-for-embedding/loss-in-pipeline-split")
        return cls(pp, vpp, counts, args)

    @classmethod
    def _first_last(cls, num_layers: int, pp: int, vpp: int | None, first: int | None, last: int | None,
                    args: dict[str, Any]) -> "PipelineSplit":
        chunks = vpp or 1
        named = ", ".join(f"{k}={v}" for k, v in args.items() if v not in (None, False))
        for v in (first, last):
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 0):
                raise MConvertError(f"{named}: a stage's layer count is a whole number >= 0")
        middle_stages = pp - (first is not None) - (last is not None)
        middle = num_layers - (first or 0) - (last or 0)
        if middle < 0 or (middle_stages == 0 and middle):
            raise MConvertError(f"{named} at PP={pp}: the stages hold {num_layers - middle} layers, the model "
                                f"{num_layers}; the counts must add up to num_layers")
        if middle_stages and middle % middle_stages:
            raise MConvertError(f"{named}: the {middle} layers left for the {middle_stages} middle stages at PP={pp} "
                                "do not divide evenly (megatron-core needs equal middle stages)")
        per_stage = middle // middle_stages if middle_stages else 0
        if vpp:
            bad = [(n, s) for n, s in ((first, "first"), (last, "last"), (per_stage, "middle"))
                   if n is not None and n % vpp]
            if bad:
                raise MConvertError(f"{named}: the {bad[0][1]} stage's {bad[0][0]} layers do not divide into "
                                    f"VPP={vpp} chunks; use --pipeline-model-parallel-layout for such a split")
        row = [per_stage // chunks] * pp
        if first is not None:
            row[0] = first // chunks
        if last is not None:
            row[-1] = last // chunks
        return cls(pp, vpp, [list(row) for _ in range(chunks)], args)

    @classmethod
    def _from_layout(cls, num_layers: int, pp: int, vpp: int | None, layout: str, mtp_num_layers: int | None,
                     args: dict[str, Any]) -> "PipelineSplit":
        what = f"pipeline_model_parallel_layout={layout!r}"
        if not isinstance(layout, str):
            raise MConvertError(f"{what}: a layout string (like 'Et*3|(tt|)*29,m|L') is expected")
        stages = parse_pipeline_layout(layout, "pipeline_model_parallel_layout")
        if len(stages) % pp:
            raise MConvertError(f"{what}: {len(stages)} stages do not divide among PP={pp} ranks")
        chunks = len(stages) // pp
        if (vpp or 1) != chunks:
            raise MConvertError(f"{what}: {len(stages)} stages at PP={pp} are {chunks} virtual chunks per rank, "
                                f"but the checkpoint has VPP={vpp or 1}; the layout does not describe it")
        flat = "".join(stages)
        if not flat.startswith("E") or flat.count("E") != 1:
            raise MConvertError(f"{what}: the embedding (E) comes once, first")
        if not flat.endswith("L") or flat.count("L") != 1:
            raise MConvertError(f"{what}: the loss (L) comes once, last")
        if flat.count("t") != num_layers:
            raise MConvertError(f"{what}: {flat.count('t')} decoder layers (t), the model has num_layers={num_layers}")
        if flat.count("m") != (mtp_num_layers or 0):
            raise MConvertError(f"{what}: {flat.count('m')} MTP layers (m), the model has "
                                f"mtp_num_layers={mtp_num_layers or 0}")
        if "m" in flat and ("m" not in stages[-1] or "t" in flat[flat.index("m"):]):
            raise MConvertError(f"{what}: MTP layers (m) on a stage of their own are not read (mconvert reads them "
                                "with the final norm, on the last stage after every decoder layer); reshard them "
                                "onto the last stage with Megatron-LM, or convert without the layout")
        counts = [[stages[c * pp + p].count("t") for p in range(pp)] for c in range(chunks)]
        return cls(pp, vpp, counts, args)

    @classmethod
    def from_args(cls, args: Mapping[str, Any], num_layers: int, pp: int, vpp: int | None,
                  source: str) -> "PipelineSplit":
        """The split a Megatron checkpoint's args state, at its PP and VPP; inconsistent args are one error
        naming `source`."""
        a = {k: args.get(k) for k in SPLIT_ARGS}
        for old, new in _CONFIG_ALIASES.items():
            if a[new] is None and args.get(old) is not None:
                a[new] = args[old]
        layout = a["pipeline_model_parallel_layout"]
        if isinstance(layout, list):  # a YAML run config may hold the parsed form: one list per stage
            layout = "|".join("".join({v: k for k, v in _LAYOUT_CHARS.items()}.get(str(x).strip().lower(), "?")
                                      for x in row) for row in layout)
        try:
            return cls.make(num_layers, pp, vpp, a["decoder_first_pipeline_num_layers"],
                            a["decoder_last_pipeline_num_layers"], layout,
                            bool(a["account_for_embedding_in_pipeline_split"]),
                            bool(a["account_for_loss_in_pipeline_split"]), args.get("mtp_num_layers"))
        except MConvertError as e:
            raise MConvertError(f"{source}: {e}") from None


def stage_layers(num_layers: int, pp: int, pp_rank: int, vpp: int | None = None) -> list[range]:
    """Global layer indices of pipeline rank `pp_rank` in an even split: one range per virtual chunk.

    Without VPP the layers are contiguous blocks; with VPP chunk c of rank r holds model chunk c·pp + r
    (PP=2, VPP=2, 4 layers: rank 0 holds 0 and 2, rank 1 holds 1 and 3)."""
    return PipelineSplit.make(num_layers, pp, vpp).stage_layers(pp_rank)


def layer_location(num_layers: int, pp: int, layer: int, vpp: int | None = None) -> tuple[int, int, int]:
    """Global layer -> (pp_rank, chunk, local index within the chunk), in an even split."""
    return PipelineSplit.make(num_layers, pp, vpp).layer_location(layer)
