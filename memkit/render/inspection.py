"""Text and HTML layout of :class:`memkit.inspection.SnapshotInspection` (``memkit inspect``):
pure functions of the result objects, no torch at import."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from memkit.render import html as h
from memkit.render import text
from memkit.render.advice import advice_html, advice_text
from memkit.units import format_size

if TYPE_CHECKING:
    from memkit.inspection.results import Allocation, DeviceInspection, SnapshotInspection

__all__ = ["inspection_html", "inspection_text", "inspection_title"]


def inspection_title(view: SnapshotInspection) -> str:
    """``memkit inspect <file>: <writer>, pickle protocol N``."""
    proto = "" if view.protocol is None else f", pickle protocol {view.protocol}"
    return f"memkit inspect {view.source}: {view.writer}{proto}"


def inspection_text(view: SnapshotInspection) -> str:
    """The inspection as text: each device, then advice and notes."""
    lines = [inspection_title(view)]
    for d in view.devices:
        lines.append("")
        lines.extend(_device_text(d))
    lines += text.section("advice:", advice_text(view.advice))
    lines += text.section("notes:", [f"- {n}" for n in view.notes])
    return "\n".join(lines)


def inspection_html(view: SnapshotInspection) -> str:
    """The inspection as HTML, without the page shell."""
    body = [f"<h2>{h.escape(inspection_title(view))}</h2>"]
    for d in view.devices:
        body.append(_device_html(d))
    body.append("<h3>Advice</h3>")
    body.append(advice_html(list(view.advice)))
    if view.notes:
        body.append("".join(f'<p class="note">{h.escape(n)}</p>' for n in view.notes))
    return "".join(body)


def _size(value: int | None) -> str:
    return "-" if value is None else format_size(value)


def _category_rows(d: DeviceInspection) -> list[list[object]]:
    end, peak = dict(d.categories), dict(d.peak_categories)
    rows: list[list[object]] = []
    for name in d.CATEGORIES:
        if end.get(name) or peak.get(name):
            row: list[object] = [name, format_size(end.get(name, 0))]
            if d.peak_categories:
                row.append(format_size(peak.get(name, 0)))
            rows.append(row)
    return rows


def _category_headers(d: DeviceInspection) -> list[str]:
    return ["category", "at the end"] + (["at the peak"] if d.peak_categories else [])


def _allocation_rows(allocs: Sequence[Allocation]) -> list[list[object]]:
    return [[format_size(a.size), a.category, a.where] for a in allocs]


def _summary(d: DeviceInspection) -> list[str]:
    lines = [
        f"device {d.device}: {d.segments} segment(s), reserved {format_size(d.reserved)}, "
        f"allocated {format_size(d.allocated)} (requested {format_size(d.requested)})",
        f"free in segments {format_size(d.inactive)}: cached in empty segments "
        f"{format_size(d.empty_segments)} (empty_cache() returns them), in split blocks "
        f"{format_size(d.inactive_split)} ({d.inactive_split_blocks} block(s)); largest free "
        f"block {format_size(d.largest_free_block)}",
    ]
    if d.inactive > 0 and d.reference_request:
        lines.append(
            f"fragmentation {100 * d.fragmentation:.0f}%: {format_size(d.unusable_free)} of the "
            f"free memory cannot serve a {format_size(d.reference_request)} request, "
            f"{d.reference_request_how}"
        )
    if d.pending_free:
        lines.append(f"pending free (waiting for another stream): {format_size(d.pending_free)}")
    if d.trace_entries:
        at = "before the first event" if d.peak_index == -1 else f"at event {d.peak_index}"
        lines.append(
            f"trace: {d.trace_entries} event(s), {d.allocs} alloc(s), {d.frees} free(s), "
            f"{len(d.ooms)} OOM(s); peak {_size(d.peak_allocated)} allocated {at}, "
            f"{_size(d.peak_reserved)} reserved at most"
        )
    else:
        lines.append("trace: none (only the state at the end)")
    return lines


def _device_text(d: DeviceInspection) -> list[str]:
    lines = _summary(d)
    rows = _category_rows(d)
    if rows:
        title = "what is allocated (categories guessed from frames; see notes)"
        lines.append(text.table(_category_headers(d), rows, title=title))
    for o in d.ooms:
        lines.append(
            f"OOM at event {o.index}: {format_size(o.size)} requested, "
            f"{_size(o.device_free)} free on the device, {format_size(o.allocated)} allocated, "
            f"{format_size(o.reserved)} reserved; at {o.where}"
        )
    for when, allocs in (("at the peak", d.peak_largest), ("at the end", d.largest)):
        if allocs:
            lines.append(
                text.table(
                    ["bytes", "category", "where"],
                    _allocation_rows(allocs),
                    title=f"largest allocations {when}",
                )
            )
    return lines


def _device_html(d: DeviceInspection) -> str:
    body = [f"<h2>device {d.device}</h2>"]
    body.extend(f'<p class="note">{h.escape(line)}</p>' for line in _summary(d))
    parts = [
        ("allocated", float(d.allocated)),
        ("free in split blocks", float(d.inactive_split)),
        ("empty segments", float(d.empty_segments)),
    ]
    if d.reserved > 0:
        body.append(h.stacked_bar(parts, float(d.reserved)))
        body.append(h.legend([name for name, _ in parts]))
    rows = _category_rows(d)
    if rows:
        body.append("<h3>What is allocated</h3>")
        body.append(h.table(_category_headers(d), rows))
    if len(d.timeline) > 1:
        series = [("allocated", [(float(i), float(a)) for i, a, _ in d.timeline])]
        if any(r != a for _, a, r in d.timeline):
            series.append(("reserved", [(float(i), float(r)) for i, _, r in d.timeline]))
        body.append("<h3>Memory over the trace</h3>")
        body.append(
            h.line_plot(
                series,
                width=900,
                height=220,
                x_label="trace event",
                y_label="memory",
                y_bytes=True,
                x_integer=True,
            )
        )
    if d.ooms:
        body.append("<h3>Out of memory</h3>")
        body.append(
            h.table(
                ["event", "requested", "free on device", "allocated", "reserved", "where"],
                [
                    [
                        o.index,
                        format_size(o.size),
                        _size(o.device_free),
                        format_size(o.allocated),
                        format_size(o.reserved),
                        o.where,
                    ]
                    for o in d.ooms
                ],
            )
        )
    for title, allocs in (("at the peak", d.peak_largest), ("at the end", d.largest)):
        if allocs:
            body.append(f"<h3>Largest allocations {title}</h3>")
            body.append(
                h.table(
                    ["bytes", "category", "where", "frames"],
                    [
                        [
                            format_size(a.size),
                            a.category,
                            a.where,
                            h.Raw("<br>".join(h.escape(f.short) for f in a.frames[:12])),
                        ]
                        for a in allocs
                    ],
                )
            )
    return "".join(body)
