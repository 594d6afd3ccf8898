"""Plain-text tables for terminals and ``__repr__``."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from memkit.units import format_size

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


def bound_words(max_batch: int | None, peak: int | None, capacity: int | None) -> str:
    """What stopped a search that never ran out: the ``--max-batch`` given, or (``max_batch``
    ``None``) memkit's own ceiling; with how much of the capacity the size left free.

    Examples:
        >>> bound_words(64, 500, 1000)
        ' (the --max-batch limit, not a memory limit: it leaves 50% free)'
        >>> bound_words(None, None, None)
        " (memkit's search ceiling, not a memory limit: --max-batch to search higher)"
    """
    free = f": it leaves {1 - peak / capacity:.0%} free" if peak is not None and capacity else ""
    if max_batch is not None:
        return f" (the --max-batch limit, not a memory limit{free})"
    more = "; --max-batch to search higher" if free else ": --max-batch to search higher"
    return f" (memkit's search ceiling, not a memory limit{free}{more})"


def recommended_words(
    rec: int | None,
    margin: float,
    peak: int | None,
    capacity: int | None,
    interpolated: bool = False,
) -> str:
    """``recommended N (leaves 5% free)``, only where the numbers say so: ``peak`` is the
    recommended size's measured peak (``None``: not run), ``capacity`` what it is held against;
    ``interpolated``: a size between two sizes tried, not run (its margin is the line's).

    Examples:
        >>> recommended_words(30, 0.05, 950, 1000)
        'recommended 30 (leaves 5% free)'
        >>> recommended_words(1, 0.05, 990, 1000)
        'no size leaves 5% free (batch 1 leaves 1.0%)'
    """
    share = f"{margin:.0%}"
    if rec is None:
        return f"no size leaves {share} free"
    if peak is not None and capacity:
        free = 1 - peak / capacity
        if free < margin:
            return f"no size leaves {share} free (batch {rec} leaves {free:.1%})"
    if interpolated:
        return f"recommended {rec} (leaves about {share} free: interpolated, not run)"
    return f"recommended {rec} (leaves {share} free)"


def memory_model_words(
    fixed: float, per_sample: float, what: str = "", per_pair: float | None = None
) -> str:
    """The reported line ``fixed + per_sample per sample`` (``what``: ``" (reserved)"``). A
    negative fixed part is the chord of peaks that grow faster than the batch (a B x B term:
    a contrastive loss's logits), or that scatter: the line says so rather than read as a
    fixed cost; so does a negative slope.

    Examples:
        >>> memory_model_words(1 << 20, 1 << 10)
        'memory model: 1.00 MiB + 1.00 KiB per sample'
        >>> memory_model_words(-(1 << 20), 1 << 10).endswith("do not extrapolate it)")
        True
        >>> memory_model_words(30 << 20, -(1 << 10)).endswith("no model of the step)")
        True
    """
    if per_pair is not None:
        pair = f"{per_pair:.3g} B" if per_pair < 1024 else format_size(per_pair)
        return (
            f"memory model: {format_size(fixed)} {'+' if per_sample >= 0 else '-'} "
            f"{format_size(abs(per_sample))} per sample + {pair} per pair of "
            f"samples{what} (the peaks grow with the square of the batch: a batch x batch "
            "tensor, such as a contrastive loss's similarity matrix or a pairwise distance "
            "matrix; doubling the batch quadruples that part)"
        )
    line = f"memory model: {format_size(fixed)} + {format_size(per_sample)} per sample{what}"
    if per_sample < 0:
        line += (
            " (the peaks fall as the batch grows here: trials that kept different memory "
            "between steps, or scatter; no model of the step)"
        )
    elif fixed < 0:
        line += (
            " (a chord through the largest sizes, not a fixed cost: the peaks grow faster "
            "than the batch there, or scatter; do not extrapolate it)"
        )
    return line
