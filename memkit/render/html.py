"""Self-contained HTML pieces: tables, stacked bars, SVG line plots, a page shell.

No JavaScript and nothing from the network: each output works offline, in a notebook cell
(``_repr_html_``) or as a file opened in a browser.
"""

from __future__ import annotations

import html
import math
from collections.abc import Callable, Sequence

from memkit.units import format_size

__all__ = [
    "PALETTE",
    "Raw",
    "axis_ticks",
    "escape",
    "fragment",
    "legend",
    "line_plot",
    "page",
    "stacked_bar",
    "table",
]

PALETTE = ("#4e79a7", "#f28e2b", "#e15759", "#76b7b2", "#59a14f", "#edc948", "#b07aa1", "#9c755f")

STYLE = """
.memkit{font-family:system-ui,-apple-system,Segoe UI,Roboto,sans-serif;font-size:13px;color:#222}
.memkit table{border-collapse:collapse;margin:6px 0}
.memkit th,.memkit td{padding:3px 8px;border-bottom:1px solid #ddd;text-align:left}
.memkit td.num{text-align:right;font-variant-numeric:tabular-nums}
.memkit th{background:#f4f4f4}
.memkit .bar{display:flex;height:14px;width:260px;background:#eee;border-radius:3px;overflow:hidden}
.memkit .note{color:#666;font-size:12px}
.memkit .legend span{display:inline-block;margin-right:10px}
.memkit .swatch{display:inline-block;width:10px;height:10px;margin-right:3px;vertical-align:middle}
.memkit h2{font-size:16px;margin:12px 0 4px}.memkit h3{font-size:14px;margin:10px 0 4px}
""".strip()


def escape(value: object) -> str:
    """HTML-escape any value's text (``None`` becomes ``-``)."""
    return "-" if value is None else html.escape(str(value))


def table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """An HTML table; numeric cells are right-aligned. Cells that are :class:`Raw` are not
    escaped."""
    head = "".join(f"<th>{escape(h)}</th>" for h in headers)
    body = []
    for row in rows:
        cells = []
        for cell in row:
            if isinstance(cell, Raw):
                cells.append(f"<td>{cell}</td>")
            elif isinstance(cell, (int, float)) and not isinstance(cell, bool):
                cells.append(f'<td class="num">{escape(cell)}</td>')
            else:
                cells.append(f"<td>{escape(cell)}</td>")
        body.append("<tr>" + "".join(cells) + "</tr>")
    return f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table>"


class Raw(str):
    """Markup that :func:`table` inserts as is."""


def stacked_bar(parts: Sequence[tuple[str, float]], total: float, *, width_px: int = 260) -> Raw:
    """A horizontal bar of ``parts`` (label, value) out of ``total``; hover shows the label."""
    segments = []
    for i, (label, value) in enumerate(parts):
        if total <= 0 or value <= 0:
            continue
        pct = min(100.0, 100.0 * value / total)
        color = PALETTE[i % len(PALETTE)]
        segments.append(
            f'<div title="{escape(label)}" style="width:{pct:.2f}%;background:{color}"></div>'
        )
    return Raw(f'<div class="bar" style="width:{width_px}px">{"".join(segments)}</div>')


def legend(labels: Sequence[str]) -> str:
    """Colour swatches for the labels, in :data:`PALETTE` order."""
    items = "".join(
        f'<span><i class="swatch" style="background:{PALETTE[i % len(PALETTE)]}"></i>'
        f"{escape(label)}</span>"
        for i, label in enumerate(labels)
    )
    return f'<div class="legend">{items}</div>'


def _nice_step(raw: float, integer: bool) -> float:
    """The smallest of 1, 2, 5 times a power of ten that is at least ``raw``."""
    if raw <= 0:
        return 1.0
    base = 10.0 ** math.floor(math.log10(raw))
    step = next(m * base for m in (1, 2, 5, 10) if m * base >= raw * (1 - 1e-9))
    return max(1.0, round(step)) if integer else step


def axis_ticks(
    lo: float, hi: float, count: int = 5, *, binary: bool = False, integer: bool = False
) -> list[float]:
    """Round values for the ticks of an axis from ``lo`` to ``hi``, about ``count`` intervals.

    Steps are 1, 2 or 5 times a power of ten; with ``binary`` (bytes), of the largest binary
    unit below ``hi`` (KiB, MiB, GiB...), so sizes tick at 20 GiB, 40 GiB... and not at 21.5 GB;
    with ``integer`` (steps), never below 1. Only values inside ``[lo, hi]`` are returned.

    Examples:
        >>> axis_ticks(0, 9.5)
        [0.0, 2.0, 4.0, 6.0, 8.0]
        >>> [int(t) // 2**20 for t in axis_ticks(0, 6 * 2**20, binary=True)]
        [0, 2, 4, 6]
    """
    if not hi > lo:
        return [lo]
    unit = 1.0
    if binary:
        while hi / unit >= 1024 and unit < 1024.0**4:
            unit *= 1024
    step = _nice_step((hi - lo) / unit / max(1, count), integer and unit == 1) * unit
    first = math.ceil(lo / step - 1e-9)
    last = math.floor(hi / step + 1e-9)
    return [k * step + 0.0 for k in range(first, last + 1)]


def _number(value: float, step: float) -> str:
    """``value`` with as many decimals as ``step`` needs (``0.5`` -> 1, ``20`` -> 0)."""
    decimals = 0 if step >= 1 else min(6, -math.floor(math.log10(step)))
    return f"{value:.{decimals}f}"


def line_plot(
    series: Sequence[tuple[str, Sequence[tuple[float, float]]]],
    *,
    width: int = 640,
    height: int = 220,
    x_label: str = "",
    y_label: str = "",
    y_format: Callable[[float], str] | None = None,
    y_bytes: bool = False,
    x_format: Callable[[float], str] | None = None,
    x_integer: bool = False,
    markers: bool = False,
    levels: Sequence[tuple[str, float]] = (),
) -> str:
    """An inline SVG line plot of named series of ``(x, y)`` points, with ticks on both axes.

    The y axis starts at 0 and ends at the first tick above the data; the x axis spans the
    data. Tick values are round (:func:`axis_ticks`) and drawn with light grid lines.

    Args:
        series: ``(name, [(x, y), ...])`` per line.
        x_label, y_label: what the axes show (``"seconds"``, ``"step"``); the x label is drawn
            under the axis, the y label is the plot's accessible name.
        y_format: a y value to its tick label; default: :func:`memkit.units.format_size` with
            ``y_bytes``, else the number.
        y_bytes: y values are bytes: ticks at powers of 1024 times 1, 2 or 5.
        x_format: an x value to its tick label (default: the number, with the decimals the
            tick step needs).
        x_integer: x values are counts (steps): integer ticks only.
        markers: mark every point (with its values on hover), for series of few points.
        levels: ``(label, y)`` per dashed horizontal line across the plot, labelled on it (a
            peak the readings do not reach); the y axis reaches them.
    """
    points = [p for _, pts in series for p in pts]
    if not points:
        return '<p class="note">no data to plot</p>'
    x0, x1 = min(p[0] for p in points), max(p[0] for p in points)
    if x1 <= x0:  # one x value: centre it
        x0, x1 = (x0 - 0.5, x0 + 0.5) if x_integer else (x0, x0 + 1)
    y_max = max([p[1] for p in points] + [y for _, y in levels])
    y_ticks = axis_ticks(0.0, y_max if y_max > 0 else 1.0, 4, binary=y_bytes)
    y_step = y_ticks[1] - y_ticks[0] if len(y_ticks) > 1 else 1.0
    if y_ticks[-1] < y_max * (1 - 1e-9):
        y_ticks.append(y_ticks[-1] + y_step)
    y1 = y_ticks[-1] or 1.0
    x_ticks = axis_ticks(x0, x1, 6, integer=x_integer)
    x_step = x_ticks[1] - x_ticks[0] if len(x_ticks) > 1 else 1.0
    if y_format is None:
        y_fmt: Callable[[float], str] = format_size if y_bytes else (lambda v: _number(v, y_step))
    else:
        y_fmt = y_format
    x_fmt = x_format or (lambda v: _number(v, x_step))
    left, right, top, bottom = 76, 24, 10, 40
    pw, ph = width - left - right, height - top - bottom

    def sx(x: float) -> float:
        return left + (x - x0) / (x1 - x0) * pw

    def sy(y: float) -> float:
        return top + ph - (y / y1) * ph

    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'role="img" aria-label="{escape(y_label)}">',
        f'<rect x="{left}" y="{top}" width="{pw}" height="{ph}" fill="#fafafa" stroke="#ccc"/>',
    ]
    for value in y_ticks:
        y = sy(value)
        parts.append(
            f'<line x1="{left}" y1="{y:.1f}" x2="{left + pw}" y2="{y:.1f}" stroke="#e4e4e4"/>'
            f'<line x1="{left - 4}" y1="{y:.1f}" x2="{left}" y2="{y:.1f}" stroke="#888"/>'
            f'<text class="tick-y" x="{left - 6}" y="{y + 3.5:.1f}" font-size="10" '
            f'text-anchor="end">{escape(y_fmt(value))}</text>'
        )
    base = top + ph
    for value in x_ticks:
        x = sx(value)
        parts.append(
            f'<line x1="{x:.1f}" y1="{top}" x2="{x:.1f}" y2="{base}" stroke="#eeeeee"/>'
            f'<line x1="{x:.1f}" y1="{base}" x2="{x:.1f}" y2="{base + 4}" stroke="#888"/>'
            f'<text class="tick-x" x="{x:.1f}" y="{base + 15}" font-size="10" '
            f'text-anchor="middle">{escape(x_fmt(value))}</text>'
        )
    for i, (name, pts) in enumerate(series):
        if not pts:
            continue
        color = PALETTE[i % len(PALETTE)]
        coords = " ".join(f"{sx(x):.1f},{sy(y):.1f}" for x, y in pts)
        parts.append(
            f'<polyline fill="none" stroke="{color}" stroke-width="1.5" points="{coords}">'
            f"<title>{escape(name)}</title></polyline>"
        )
        if markers:
            parts.extend(
                f'<circle cx="{sx(x):.1f}" cy="{sy(y):.1f}" r="2.5" fill="{color}">'
                f"<title>{escape(name)}: {escape(x_fmt(x))}, {escape(y_fmt(y))}</title></circle>"
                for x, y in pts
            )
    for label, value in levels:
        y = sy(value)
        parts.append(
            f'<line class="level" x1="{left}" y1="{y:.1f}" x2="{left + pw}" y2="{y:.1f}" '
            f'stroke="#c0392b" stroke-dasharray="5,3"><title>{escape(label)}</title></line>'
            f'<text class="level" x="{left + pw - 4}" y="{y - 4:.1f}" font-size="10" '
            f'fill="#c0392b" text-anchor="end">{escape(label)}</text>'
        )
    parts.append(
        f'<text x="{left + pw / 2}" y="{height - 4}" font-size="11" text-anchor="middle">'
        f"{escape(x_label)}</text>"
    )
    parts.append("</svg>")
    return "".join(parts) + legend([name for name, _ in series])


def fragment(body: str) -> str:
    """Wrap markup for a notebook cell: scoped style plus a ``memkit`` container."""
    return f'<div class="memkit"><style>{STYLE}</style>{body}</div>'


def page(title: str, body: str) -> str:
    """A whole self-contained HTML document."""
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        f"<title>{escape(title)}</title></head><body>{fragment(body)}</body></html>\n"
    )
