"""Text and HTML layout of :class:`memkit.snapshots.Snapshot` and :class:`~memkit.snapshots.
SnapshotDiff`: pure functions of the result objects, no torch at import."""

from __future__ import annotations

from datetime import datetime
from typing import TYPE_CHECKING

from memkit.render import html as h
from memkit.render import text
from memkit.render.advice import advice_html, advice_text
from memkit.units import format_size

if TYPE_CHECKING:
    from memkit.snapshots.results import DeviceSnapshot, Snapshot, SnapshotDiff

__all__ = [
    "BAR_LABELS",
    "FREE_COLOR",
    "device_rows_text",
    "diff_html",
    "diff_text",
    "diff_title",
    "missing_lines",
    "snapshot_html",
    "snapshot_text",
    "snapshot_title",
    "watch_lines",
]

BAR_LABELS = (
    "allocated (this process's tensors)",
    "reserved, not allocated (cache, fragmentation)",
    "CUDA context + other processes",
)
FREE_COLOR = "#e6e6e6"

_DEVICE_HEADERS = (
    "device",
    "name",
    "used / total",
    "allocated",
    "reserved",
    "peak alloc",
    "util",
    "temp",
)
_CATEGORY_HEADERS = ("device", "parameters", "buffers", "gradients", "optimizer state")
_TENSOR_HEADERS = ["bytes", "shape", "dtype", "device", "kind", "name"]
_DIFF_HEADERS = ["where", "what", "before", "after", "change"]

_LOCAL_STYLE = (
    "<style>.memkit-snapshot td,.memkit-diff td{white-space:nowrap}"
    ".memkit-snapshot td .note{white-space:normal;max-width:280px}"
    ".memkit ul.note{margin:4px 0;padding-left:18px}</style>"
)


# -- cells ----------------------------------------------------------------------------------
def _na(reason: str | None) -> h.Raw:
    return h.Raw(f'<span class="na" title="{h.escape(reason or "unavailable")}">n/a</span>')


def _size_cell(value: int | None, reason: str | None = None) -> object:
    return format_size(value) if value is not None else _na(reason)


def _pct(value: float | None) -> str | None:
    return None if value is None else f"{value:.0f}%"


def _temp(value: float | None) -> str | None:
    return None if value is None else f"{value:.0f} °C"


def _used_of_total(dev: DeviceSnapshot) -> str:
    if dev.total is None:
        return "n/a"
    used = "n/a" if dev.used is None else format_size(dev.used)
    return f"{used} / {format_size(dev.total)}"


def _stamp(ts: float) -> str:
    return datetime.fromtimestamp(ts).strftime("%Y-%m-%d %H:%M:%S")


def _explain_text(snap: Snapshot) -> str:
    return "\n".join(f"  {name}: {line}" for name, line in snap.explain())


def _explain_html(snap: Snapshot) -> str:
    items = "".join(
        f"<li><b>{h.escape(n)}</b>: {h.escape(line)}</li>" for n, line in snap.explain()
    )
    return f'<ul class="note explain">{items}</ul>'


def _bar_legend_html(simulated: bool = False) -> str:
    labels = BAR_LABELS[:1] if simulated else BAR_LABELS  # (no cache, no context: sweep CO)
    return h.legend(labels).replace(
        "</div>",
        f'<span><i class="swatch" style="background:{FREE_COLOR}"></i>free</span></div>',
    )


# -- snapshot: text -------------------------------------------------------------------------
def snapshot_title(snap: Snapshot, sep: str = "  ") -> str:
    """``memkit snapshot  <time>  [label]`` (``sep`` between the parts)."""
    label = f"{sep}[{snap.label}]" if snap.label else ""
    return f"memkit snapshot{sep}{_stamp(snap.taken_at)}{label}"


def device_rows_text(snap: Snapshot) -> list[list[object]]:
    """The device table's rows as text cells (used by the CLI's watch mode too)."""
    return [
        [
            d.device,
            d.name,
            _used_of_total(d),
            format_size(d.allocated),
            format_size(d.reserved),
            format_size(d.peak_allocated),
            _pct(d.utilization) or "n/a",
            _temp(d.temperature) or "n/a",
        ]
        for d in snap.devices
    ]


def watch_lines(snap: Snapshot) -> list[str]:
    """One line per device and one for the host: the CLI's non-TTY watch output."""
    stamp = datetime.fromtimestamp(snap.taken_at).isoformat(timespec="seconds")
    lines = []
    for d in snap.devices:
        if d.kind == "none":
            lines.append(f"{stamp}  none  {d.name}")
            continue
        lines.append(
            f"{stamp}  {d.device}  allocated {format_size(d.allocated)}  reserved "
            f"{format_size(d.reserved)}  used {_used_of_total(d)}"
        )
    lines.append(
        f"{stamp}  host  rss {format_size(snap.host.process_rss)}  available "
        f"{format_size(snap.host.available)} / {format_size(snap.host.total)}"
    )
    return lines


def missing_lines(snap: Snapshot) -> list[str]:
    """One line per distinct reason a value is missing, naming the device and fields."""
    lines: list[str] = []
    for d in snap.devices:
        by_reason: dict[str, list[str]] = {}
        for name, reason in d.missing:
            by_reason.setdefault(reason, []).append(name)
        for reason, names in by_reason.items():
            if d.kind == "none":
                lines.append(f"{d.name}: {reason}")
            else:
                lines.append(f"{d.device} {', '.join(names)}: {reason}")
    if snap.host.reason:
        lines.append(f"host: {snap.host.reason}")
    return lines


def _tensor_rows(snap: Snapshot, times: str) -> list[list[object]]:
    """Rows of the largest-tensors table; ``times`` joins the shape (``x`` or ``×``)."""
    return [
        [
            format_size(t.nbytes),
            times.join(map(str, t.shape)) or "scalar",
            t.dtype,
            t.device,
            t.kind,
            t.label,
        ]
        for t in snap.tensors
    ]


def _category_sizes(snap: Snapshot) -> list[list[object]]:
    """Per device: name, parameters, buffers, gradients, optimizer state (formatted)."""
    return [
        [
            c.device,
            format_size(c.parameters),
            format_size(c.buffers),
            format_size(c.gradients),
            format_size(c.optimizer_state),
        ]
        for c in snap.categories
    ]


def snapshot_text(snap: Snapshot) -> str:
    """The snapshot as text: devices, host, what it holds, largest tensors, notes, advice."""
    title = snapshot_title(snap)
    parts = [text.table(_DEVICE_HEADERS, device_rows_text(snap), align="llrrrrrr", title=title)]
    host = snap.host
    parts.append(
        f"host: process RSS {format_size(host.process_rss)}, available "
        f"{format_size(host.available)} of {format_size(host.total)}"
    )
    if snap.categories:
        rows = [
            [*sizes, format_size(c.other), c.other_how]
            for sizes, c in zip(_category_sizes(snap), snap.categories, strict=True)
        ]
        headers = [*_CATEGORY_HEADERS, "other", "other = "]
        parts.append(text.table(headers, rows, align="lrrrrrl", title="\nwhat it holds"))
        parts.extend(f"  {c.device} counts {c.counted_as}" for c in snap.categories if c.counted_as)
    if snap.tensors:
        rows = _tensor_rows(snap, "x")
        parts.append(text.table(_TENSOR_HEADERS, rows, align="rlllll", title="\nlargest tensors"))
    missing = missing_lines(snap)
    if missing:
        parts.append("\nmissing values:\n" + "\n".join(f"  {m}" for m in missing))
    if snap.notes:
        parts.append("\nnotes:\n" + "\n".join(f"  {n}" for n in snap.notes))
    if snap.advice:
        parts.append("\nadvice:\n" + advice_text(snap.advice))
    parts.append("\n" + _explain_text(snap))
    return "\n".join(parts)


# -- snapshot: HTML -------------------------------------------------------------------------
def _device_row_html(d: DeviceSnapshot) -> list[object]:
    bar: object = h.stacked_bar(d.bar_parts(), d.total) if d.total else _na(d.why("total"))
    note = f'<div class="note">{h.escape(d.accounting)}</div>' if d.accounting else ""
    if d.total is not None or d.used is not None:
        used_total: object = h.Raw(
            f"{_size_cell(d.used, d.why('used'))} / {_size_cell(d.total, d.why('total'))}"
        )
    else:
        used_total = _na(d.why("total"))
    return [
        h.Raw(f"<b>{h.escape(d.device)}</b>"),
        h.Raw(h.escape(d.name) + note),
        bar,
        used_total,
        _size_cell(d.allocated, d.why("allocated")),
        _size_cell(d.reserved, d.why("reserved")),
        _size_cell(d.peak_allocated, d.why("peak_allocated")),
        _pct(d.utilization) or _na(d.why("utilization")),
        _temp(d.temperature) or _na(d.why("temperature")),
    ]


def _categories_html(snap: Snapshot) -> str:
    rows = [
        [
            *sizes,
            _size_cell(c.other, c.other_how),
            h.Raw(f'<span class="note">{h.escape(c.other_how)}</span>'),
        ]
        for sizes, c in zip(_category_sizes(snap), snap.categories, strict=True)
    ]
    headers = [*_CATEGORY_HEADERS, "other tensors", "other = "]
    counted = "".join(
        f'<p class="note">{h.escape(c.device)} counts {h.escape(c.counted_as)}</p>'
        for c in snap.categories
        if c.counted_as
    )
    return "<h3>what it holds</h3>" + h.table(headers, rows) + counted


def _remarks_html(snap: Snapshot) -> list[str]:
    """Missing values, notes and advice."""
    body = []
    missing = missing_lines(snap)
    if missing:
        items = "".join(f"<li>{h.escape(m)}</li>" for m in missing)
        body.append(f'<p class="note">Missing values:</p><ul class="note missing">{items}</ul>')
    if snap.notes:
        items = "".join(f"<li>{h.escape(n)}</li>" for n in snap.notes)
        body.append(f'<ul class="note notes">{items}</ul>')
    if snap.advice:
        body.append(advice_html(snap.advice))
    return body


def snapshot_html(snap: Snapshot) -> str:
    """The snapshot as an HTML fragment (without the scoped style; see ``h.fragment``)."""
    title = f"memkit snapshot · {_stamp(snap.taken_at)}" + (
        f" · {h.escape(snap.label)}" if snap.label else ""
    )
    headers = ["device", "name", "memory", *_DEVICE_HEADERS[2:]]
    rows = [_device_row_html(d) for d in snap.devices]
    body = [_LOCAL_STYLE, f"<h3>{title}</h3>", h.table(headers, rows)]
    if any(d.total for d in snap.devices):
        body.append(_bar_legend_html(all(d.kind == "simulated" for d in snap.devices)))
    host = snap.host
    body.append(
        f'<p class="host"><b>host</b>: process RSS {_size_cell(host.process_rss, host.reason)}'
        f", available {_size_cell(host.available, host.reason)} of "
        f"{_size_cell(host.total, host.reason)}</p>"
    )
    if snap.categories:
        body.append(_categories_html(snap))
    if snap.tensors:
        body.append("<h3>largest tensors</h3>")
        body.append(h.table(_TENSOR_HEADERS, _tensor_rows(snap, "×")))
    body.extend(_remarks_html(snap))
    body.append(_explain_html(snap))
    return f'<div class="memkit-snapshot">{"".join(body)}</div>'


# -- diff -----------------------------------------------------------------------------------
def diff_title(diff: SnapshotDiff) -> str:
    """``memkit snapshot diff  (+1.0 s)  before -> after``."""
    names = ""
    if diff.before_label or diff.after_label:
        names = f"  {diff.before_label or 'before'} -> {diff.after_label or 'after'}"
    return f"memkit snapshot diff  ({diff.elapsed:+.1f} s){names}"


def diff_text(diff: SnapshotDiff) -> str:
    """The diff as a text table (or ``no changes``)."""
    notes = "".join(f"\nnote: {n}" for n in diff.notes)
    if not diff.changes:
        return f"{diff_title(diff)}{notes}\nno changes"
    rows = [
        [c.where, c.label, c.format_value(c.before), c.format_value(c.after), c.format_delta()]
        for c in diff.changes
    ]
    return text.table(_DIFF_HEADERS, rows, align="llrrr", title=diff_title(diff)) + notes


def diff_html(diff: SnapshotDiff) -> str:
    """The diff as an HTML fragment; growth red, shrinkage green (more available is good)."""
    title = f"<h3>{h.escape(diff_title(diff))}</h3>"
    if diff.notes:
        items = "".join(f"<li>{h.escape(n)}</li>" for n in diff.notes)
        title += f'<ul class="note notes">{items}</ul>'
    if not diff.changes:
        return f'<div class="memkit-diff">{title}<p class="note">no changes</p></div>'
    rows: list[list[object]] = []
    for c in diff.changes:
        delta = c.delta
        if delta and c.what == "available":
            delta = -delta  # more available memory is good news
        color = "#c0392b" if delta and delta > 0 else ("#2e7d32" if delta else "#555")
        rows.append(
            [
                c.where,
                c.label,
                c.format_value(c.before),
                c.format_value(c.after),
                h.Raw(f'<b style="color:{color}">{h.escape(c.format_delta())}</b>'),
            ]
        )
    table_html = h.table(_DIFF_HEADERS, rows)
    return f'<div class="memkit-diff">{_LOCAL_STYLE}{title}{table_html}</div>'
