"""The one exception type a user sees: a single line saying what is wrong, where, and what to do."""


class MConvertError(Exception):
    """A user-facing error. The CLI prints `error: <message>` and exits 1 (MCONVERT_DEBUG=1 shows a traceback)."""
