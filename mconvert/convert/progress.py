"""The one progress bar of the writing verbs: on stderr (a terminal only), advanced once per unit, gone when done."""

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
    console = Console(stderr=True)
    if not enabled or not console.is_interactive:  # a bar shows only on a terminal; elsewhere rich would end it
        yield from units  # with an empty line, before the one `error:` line of a failure
        return
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[u]}"),
                  TimeElapsedColumn(), console=console, transient=True) as bar:
        task = bar.add_task(what, total=len(units), u="")
        for u in units:
            bar.update(task, u=f"unit {u}")
            yield u
            bar.advance(task)
