"""Plain-text tables for reports and benchmarks."""

from __future__ import annotations

from typing import Any, Sequence


def format_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """An aligned text table: a header row, a rule, then the rows.

    Text is aligned left and numbers right (a cell counts as a number if ``float()`` accepts it
    once thousands separators and a trailing x or % are removed).

    Args:
        headers: the column names.
        rows: one sequence of cells per row, as many as ``headers``; any values (``str()``-ed).

    Returns:
        The table, lines joined by newlines, without trailing spaces.
    """
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
