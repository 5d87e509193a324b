"""Progress bars and the output check shared by the benchmarks (tables: :mod:`gradwire.tables`)."""

from __future__ import annotations

import os
import sys
from contextlib import contextmanager
from typing import Any, Iterator, Optional


@contextmanager
def progress(total: int, description: str) -> Iterator[Any]:
    """A tqdm bar on stderr; silent when stderr is not a terminal (logs, CI)."""
    from tqdm import tqdm

    bar = tqdm(total=total, desc=description, file=sys.stderr, leave=False, dynamic_ncols=True,
               disable=not sys.stderr.isatty())
    try:
        yield bar
    finally:
        bar.close()


def json_path_error(path: Optional[str]) -> Optional[str]:
    """Why ``--json PATH`` cannot be written, in one line, or None (also for no ``--json``).

    Checked before any measuring, so that a long run does not end on an unwritable path; a file
    that was not there before is removed again (a refused run leaves nothing behind).
    """
    if not path:
        return None
    existed = os.path.exists(path)
    try:
        with open(path, "a"):
            pass
    except OSError as error:
        return f"--json={path!r} cannot be written ({error.strerror or error})"
    if not existed:
        os.remove(path)
    return None
