"""The one exception type a user sees: a single line saying what is wrong, where, and what to do.

Also the small readers every module shares so that a wrong-shaped input ends in that one line: a JSON
file whose top level must be an object, a value that must have a given type, a count option that must be >= 1.
"""

from __future__ import annotations

import unicodedata
from typing import Any, Sequence

from rich.markup import escape


class MConvertError(Exception):
    """A user-facing error. The CLI prints `error: <message>` and exits 1 (MCONVERT_DEBUG=1 shows a traceback).

    `details`: one line per item of a refusal that names several (the message is then their summary); the CLI
    prints each under the `error:` line, escaped on its own, so no item can split or forge a line. `str(e)` is
    the message and the details, one to a line."""

    def __init__(self, message: str, details: Sequence[str] = ()) -> None:
        if details:
            super().__init__(message, tuple(details))
        else:
            super().__init__(message)

    @property
    def summary(self) -> str:
        """The first line: the whole message of a one-item error, the summary of a several-item one."""
        return str(self.args[0]) if self.args else ""

    @property
    def details(self) -> tuple[str, ...]:
        """One line per item the summary counts (empty for a one-item error)."""
        return tuple(self.args[1]) if len(self.args) > 1 else ()

    def __str__(self) -> str:
        return "\n".join((self.summary, *self.details)) if self.details else super().__str__()


# Bidirectional overrides and isolates reorder what a terminal shows (a path can be made to read as another).
_BIDI = frozenset("\u061c\u200e\u200f\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069")


def escape_controls(text: str) -> str:
    """`text` with every control character shown as an escape (`\\n`, `\\x1b`, `\\u2028`): one visible line that
    no file name or key can split, recolour or reorder. Everything else is kept verbatim."""
    out = []
    for ch in text:
        if ch in "\n\r\t":
            out.append({"\n": "\\n", "\r": "\\r", "\t": "\\t"}[ch])
        elif ch in _BIDI or unicodedata.category(ch) in ("Cc", "Zl", "Zp"):
            o = ord(ch)
            out.append(f"\\x{o:02x}" if o < 0x100 else f"\\u{o:04x}")
        else:
            out.append(ch)
    return "".join(out)


def renamed(text: str, private: object, shown: object) -> str:
    """A message about a private temporary path (a staged copy, a scratch export) naming what the user knows
    instead (`shown`): the private path is gone by the time the message is read."""
    return text.replace(str(private), str(shown))


def rich_safe(text: object) -> str:
    """`text` ready to embed in rich markup: control characters escaped (above) and markup brackets escaped, so
    a path `[v2]` prints as itself and `[/x]` cannot crash the printer. Every report line that shows a file
    name, a key or an exception's text passes through here."""
    return escape(escape_controls(str(text)))


_TYPE_WORDS = {dict: "an object", list: "an array", str: "a string", bool: "a boolean", int: "an integer",
               float: "a number", type(None): "null"}


def type_name(value: Any) -> str:
    """The JSON word for a parsed value's type (`an object`, `an array`, `a string`, ...), else the Python name."""
    return _TYPE_WORDS.get(type(value), f"a {type(value).__name__}")


def expect(value: Any, types: type | tuple[type, ...], where: str, fix: str = "fix or re-create it") -> Any:
    """`value` when it is an instance of `types` (a bool is never taken for a number), else one MConvertError:
    `where` names the file and key, e.g. `config.ini [gpt] head_num`."""
    want = types if isinstance(types, tuple) else (types,)
    if isinstance(value, want) and not (isinstance(value, bool) and bool not in want):
        return value
    words = " or ".join(_TYPE_WORDS.get(t, f"a {t.__name__}") for t in want)
    raise MConvertError(f"{where}: expected {words}, found {type_name(value)} ({_short(value)}); {fix}")


def at_least_one(flag: str, value: int | None, advice: str) -> None:
    """Refuse a size or count option below 1 (None: not given), naming it and saying what to pass instead."""
    if value is not None and value < 1:
        raise MConvertError(f"{flag} must be >= 1, got {value}; {advice}")


def _short(value: Any, limit: int = 60) -> str:
    r = repr(value)
    return r if len(r) <= limit else r[: limit - 3] + "..."
