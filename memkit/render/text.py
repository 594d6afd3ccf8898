"""Plain-text tables for terminals and ``__repr__``."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

__all__ = ["table"]


def table(
    headers: Sequence[str],
    rows: Sequence[Sequence[object]],
    *,
    align: str | None = None,
    title: str | None = None,
) -> str:
    """Render rows as an aligned text table.

    Args:
        headers: column titles.
        rows: cells; ``None`` renders as ``-``.
        align: one character per column, ``l`` or ``r`` (default: text left, numbers right).
        title: a line printed above the table.

    Examples:
        >>> print(table(["size", "fits"], [[8, "yes"], [16, "no"]]))
        size  fits
        ----  ----
           8  yes
          16  no
    """
    cells = [["-" if c is None else str(c) for c in row] for row in rows]
    widths = [len(h) for h in headers]
    for row in cells:
        for i, cell in enumerate(row):
            widths[i] = max(widths[i], len(cell))
    if align is None:
        align = "".join(
            "r"
            if rows
            and all(isinstance(r[i], (int, float)) for r in rows if r[i] is not None)
            and any(r[i] is not None for r in rows)
            else "l"
            for i in range(len(headers))
        )

    def fmt(row: Sequence[str]) -> str:
        parts = [
            cell.rjust(widths[i]) if align[i] == "r" else cell.ljust(widths[i])
            for i, cell in enumerate(row)
        ]
        return "  ".join(parts).rstrip()

    lines = [] if title is None else [title]
    lines.append(fmt(list(headers)))
    lines.append(fmt(["-" * w for w in widths]))
    lines.extend(fmt(row) for row in cells)
    return "\n".join(lines)


def section(heading: str, body: str | Iterable[str]) -> list[str]:
    """A report's section as lines, ``["", heading, *body]``; no lines when the body is empty
    (an empty string, or no lines)."""
    lines = ([body] if body else []) if isinstance(body, str) else list(body)
    return ["", heading, *lines] if lines else []
