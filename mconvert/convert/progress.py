"""The one progress bar of the writing verbs: on stderr, advanced once per unit, gone when done."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import TypeVar

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

U = TypeVar("U")


def unit_progress(units: Iterable[U], what: str, enabled: bool = True) -> Iterator[U]:
    """Yield `units`, showing `what`, the unit being written and how many are done (nothing when not `enabled`:
    library calls and tests stay quiet)."""
    units = list(units)
    if not enabled:
        yield from units
        return
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[u]}"),
                  TimeElapsedColumn(), console=Console(stderr=True), transient=True) as bar:
        task = bar.add_task(what, total=len(units), u="")
        for u in units:
            bar.update(task, u=f"unit {u}")
            yield u
            bar.advance(task)
