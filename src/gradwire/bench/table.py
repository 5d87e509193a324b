"""Progress bars shared by the benchmarks (tables: :mod:`gradwire.tables`)."""

from __future__ import annotations

import sys
from contextlib import contextmanager
from typing import Any, Iterator


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

