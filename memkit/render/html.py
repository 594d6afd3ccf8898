"""Self-contained HTML pieces: tables, stacked bars, SVG line plots, a page shell.

No JavaScript and nothing from the network: each output works offline, in a notebook cell
(``_repr_html_``) or as a file opened in a browser.
"""

from __future__ import annotations

import html
from collections.abc import Sequence

__all__ = [
    "PALETTE",
    "Raw",
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


def line_plot(
    series: Sequence[tuple[str, Sequence[tuple[float, float]]]],
    *,
    width: int = 640,
    height: int = 220,
    x_label: str = "",
    y_label: str = "",
    y_format: object = None,
) -> str:
    """An inline SVG line plot of named series of ``(x, y)`` points.

    ``y_format`` is a callable turning a y value into a tick label (e.g. ``format_size``).
    """
    points = [p for _, pts in series for p in pts]
    if not points:
        return '<p class="note">no data to plot</p>'
    fmt = y_format if callable(y_format) else (lambda v: f"{v:g}")
    x0, x1 = min(p[0] for p in points), max(p[0] for p in points)
    y1 = max(p[1] for p in points) or 1.0
    x1 = x1 if x1 > x0 else x0 + 1
    left, right, top, bottom = 70, 10, 10, 30
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
    for frac in (0.0, 0.5, 1.0):
        y = sy(y1 * frac)
        parts.append(
            f'<text x="{left - 4}" y="{y + 4:.1f}" font-size="10" text-anchor="end">'
            f"{escape(fmt(y1 * frac))}</text>"
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
    parts.append(
        f'<text x="{left + pw / 2}" y="{height - 6}" font-size="11" text-anchor="middle">'
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
