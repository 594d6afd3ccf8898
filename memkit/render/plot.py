"""Optional matplotlib drawings shared by snapshots and tracker reports.

matplotlib is an optional extra (``pip install 'memkit[plot]'``): nothing here imports it at
module import time, and :func:`require_matplotlib` turns its absence into a
:class:`~memkit.errors.ConfigError` that says how to install it. Sizes are given in bytes and
drawn in one binary unit chosen from the data (``memory (GiB)``), so tick labels stay round.

Examples:
    >>> from memkit.render import plot
    >>> ax = plot.stacked_bars([("cuda:0", [("allocated", 3 * 2**30), ("free", 5 * 2**30)])])
    >>> ax.get_xlabel()
    'memory (GiB)'
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from memkit.errors import ConfigError
from memkit.render.html import PALETTE

__all__ = ["INSTALL_HINT", "require_matplotlib", "size_unit", "stacked_bars", "timeline"]

log = logging.getLogger(__name__)

INSTALL_HINT = "pip install 'memkit[plot]'"

_UNITS = (("B", 1), ("KiB", 1024), ("MiB", 1024**2), ("GiB", 1024**3), ("TiB", 1024**4))


def require_matplotlib() -> Any:
    """Import and return ``matplotlib.pyplot``.

    Raises:
        ConfigError: matplotlib is not installed; the message names the install command.
    """
    try:
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise ConfigError(
            f"matplotlib is not installed: {INSTALL_HINT} (or pip install matplotlib) to draw "
            f"plots; the HTML and text renderings need nothing extra ({exc})"
        ) from None
    return plt


def size_unit(max_bytes: float) -> tuple[str, int]:
    """The binary unit to draw ``max_bytes`` in: ``(name, bytes per unit)``."""
    name, factor = _UNITS[0]
    for unit_name, unit_factor in _UNITS:
        if max_bytes >= unit_factor:
            name, factor = unit_name, unit_factor
    return name, factor


def _axes(ax: Any, figsize: tuple[float, float]) -> Any:
    if ax is not None:
        return ax
    plt = require_matplotlib()
    _, new_ax = plt.subplots(figsize=figsize)
    return new_ax


def stacked_bars(
    rows: Sequence[tuple[str, Sequence[tuple[str, float]]]],
    *,
    ax: Any = None,
    title: str | None = None,
    colors: Sequence[str] | None = None,
) -> Any:
    """Horizontal stacked bars, one per row, of byte-sized segments.

    Args:
        rows: ``(row label, [(segment label, bytes), ...])``; segment ``i`` of every row gets
            colour ``i`` and the legend shows the first row's segment labels.
        ax: a matplotlib Axes to draw on (default: a new figure).
        title: the Axes title.
        colors: one colour per segment position (default: memkit's HTML palette).

    Returns:
        The matplotlib Axes.

    Raises:
        ConfigError: matplotlib is not installed.
    """
    require_matplotlib()
    ax = _axes(ax, (9.0, 1.4 + 0.45 * max(1, len(rows))))
    palette = list(colors or PALETTE)
    biggest = max((sum(v for _, v in parts) for _, parts in rows), default=0.0)
    unit, factor = size_unit(biggest)
    labelled: set[str] = set()
    for y, (_, parts) in enumerate(rows):
        left = 0.0
        for i, (label, value) in enumerate(parts):
            width = max(0.0, float(value)) / factor
            ax.barh(
                y,
                width,
                left=left,
                color=palette[i % len(palette)],
                edgecolor="white",
                label=None if label in labelled else label,
            )
            labelled.add(label)
            left += width
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels([label for label, _ in rows])
    ax.invert_yaxis()
    ax.set_xlabel(f"memory ({unit})")
    if title:
        ax.set_title(title)
    if not rows:
        ax.text(
            0.5,
            0.5,
            "no device with a known size",
            ha="center",
            va="center",
            transform=ax.transAxes,
        )
    else:
        ax.legend(loc="center left", bbox_to_anchor=(1.01, 0.5), fontsize="small", frameon=False)
    return ax


def timeline(
    series: Sequence[tuple[str, Sequence[tuple[float, float]]]],
    *,
    ax: Any = None,
    title: str | None = None,
    x_label: str = "time (s)",
    spans: Sequence[tuple[float, float, str]] = (),
    limit: float | None = None,
    limit_label: str = "capacity",
) -> Any:
    """Memory over time: one line per named series of ``(x, bytes)`` points.

    Args:
        series: ``(name, [(x, bytes), ...])`` per line (``"cuda:0 allocated"``...).
        ax: a matplotlib Axes to draw on (default: a new figure).
        title: the Axes title.
        x_label: what x is (seconds, steps...).
        spans: ``(start, end, label)`` regions shaded behind the lines (forward, backward,
            optimizer...); spans with the same label share a colour and one legend entry.
        limit: a horizontal dashed line in bytes (the device's capacity or budget).
        limit_label: the legend text of ``limit``.

    Returns:
        The matplotlib Axes.

    Raises:
        ConfigError: matplotlib is not installed.
    """
    require_matplotlib()
    ax = _axes(ax, (8.0, 3.5))
    values = [y for _, pts in series for _, y in pts]
    if limit is not None:
        values.append(limit)
    unit, factor = size_unit(max(values, default=0.0))
    span_colors: dict[str, str] = {}
    for start, end, label in spans:
        first = label not in span_colors
        color = span_colors.setdefault(label, PALETTE[(len(span_colors) + 3) % len(PALETTE)])
        ax.axvspan(start, end, color=color, alpha=0.15, lw=0, label=label if first else None)
    for i, (name, pts) in enumerate(series):
        if not pts:
            continue
        xs = [x for x, _ in pts]
        ys = [y / factor for _, y in pts]
        ax.plot(xs, ys, color=PALETTE[i % len(PALETTE)], lw=1.5, label=name)
    if limit is not None:
        ax.axhline(limit / factor, color="#444", ls="--", lw=1, label=limit_label)
    ax.set_xlabel(x_label)
    ax.set_ylabel(f"memory ({unit})")
    ax.set_ylim(bottom=0)
    if title:
        ax.set_title(title)
    if series or spans or limit is not None:
        ax.legend(fontsize="small", frameon=False)
    return ax
