"""The scratch directory a shared test builder keeps its models in, one per test run and removed at its exit.

The process that first imports a builder creates it and names it in its environment; a process that
multiprocessing starts for a test (to unpickle a test's function, it imports the test's modules again) finds
the name there and uses that directory rather than creating one of its own, which it could never remove: such
a process ends with `os._exit`, skipping atexit."""

from __future__ import annotations

import atexit
import os
import re
import shutil
import tempfile
from pathlib import Path


def scratch_dir(prefix: str, module: str) -> Path:
    """This test run's directory for the builders of `module` (its `__name__`: a module imported under two
    names keeps two caches of built models, and each gets its own directory)."""
    key = "MCONVERT_TEST_SCRATCH_" + re.sub(r"\W", "_", f"{prefix}{module}").upper()
    known = os.environ.get(key)
    if known:
        return Path(known)
    d = Path(tempfile.mkdtemp(prefix=prefix))
    os.environ[key] = str(d)
    atexit.register(shutil.rmtree, d, True)
    return d
