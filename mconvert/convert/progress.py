"""A progress bar on stderr for the deployment writers, advanced once per unit."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.progress import Progress


class UnitProgress:
    """A rich progress bar on stderr, advanced once per unit."""

    def __init__(self, what: str, total: int) -> None:
        self._p = Progress(console=Console(stderr=True), transient=True)
        self._task = self._p.add_task(what, total=total)

    def __enter__(self) -> Any:
        self._p.start()
        return lambda: self._p.advance(self._task)

    def __exit__(self, *exc: Any) -> None:
        self._p.stop()
