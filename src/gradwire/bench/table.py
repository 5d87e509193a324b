"""Plain-text tables and progress bars shared by the benchmarks."""

from __future__ import annotations

import sys
from contextlib import contextmanager
from typing import Any, Iterator, Sequence


def format_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """Columns aligned: text left, numbers right (a cell counts as a number if float() accepts it)."""
    cells = [[str(c) for c in headers]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]

    def is_number(text: str) -> bool:
        try:
            float(text.replace(",", "").rstrip("x%"))
            return True
        except ValueError:
            return False

    lines = []
    for row_number, row in enumerate(cells):
        parts = [c.rjust(w) if row_number and is_number(c) else c.ljust(w) for c, w in zip(row, widths)]
        lines.append("  ".join(parts).rstrip())
        if row_number == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


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
