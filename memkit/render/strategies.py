"""Text and HTML layout of :class:`memkit.strategies.StrategyComparison` (pure, torch-free)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from memkit.render import html as h
from memkit.render.advice import advice_html, advice_text
from memkit.render.text import bound_words, section
from memkit.units import format_size

if TYPE_CHECKING:
    from memkit.strategies import StrategyComparison

__all__ = ["comparison_html_body", "comparison_text"]


def _header(comparison: StrategyComparison) -> list[str]:
    gpus = range(comparison.gpus)
    return ["strategy", "global batch", *[f"cuda:{i}" for i in gpus], "excess 0"]


def _rows(comparison: StrategyComparison) -> list[list[str]]:
    rows = []
    for r in comparison.results:
        batch = (
            "failed"
            if r.error
            else "-"
            if r.max_global_batch is None
            else f"at least {r.max_global_batch}"
            if r.hit_max_batch
            else str(r.max_global_batch)
        )
        peaks = [format_size(p) for p in r.per_device_peaks]
        peaks += ["-"] * (comparison.gpus - len(peaks))  # nothing fit: no peak at any size
        rows.append([r.strategy, batch, *peaks, format_size(r.excess_bytes)])
    return rows


def _remarks(comparison: StrategyComparison) -> list[str]:
    """What the table does not say: why a strategy failed, what lives on cuda:0 only, the
    largest unit FSDP all-gathers, DDP against DataParallel when it fits no larger batch."""
    lines: list[str] = []
    for r in comparison.results:
        if r.error:
            lines.append(f"{r.strategy}: failed: {r.error}")
        if r.hit_max_batch and r.max_global_batch is not None:  # a lower bound
            peak = max(r.per_device_peaks) if r.per_device_peaks else None
            bound = bound_words(comparison.max_batch, peak, min(comparison.budgets))
            lines.append(f"{r.strategy}: at least {r.max_global_batch}{bound}")
        if r.excess_parts:
            parts = ", ".join(f"{k} {format_size(v)}" for k, v in r.excess_parts)
            lines.append(f"{r.strategy}: on cuda:0 only: {parts}")
    fsdp = comparison.result("fsdp")
    if fsdp is not None and fsdp.largest_unit is not None:
        name, size = fsdp.largest_unit
        lines.append(
            f"fsdp: each rank holds its shards; the largest unit all-gathered: "
            f"{name or 'the root'} ({format_size(size)} unsharded)"
        )
    dp, ddp = comparison.result("dp"), comparison.result("ddp")
    if dp is None or ddp is None or dp.max_global_batch is None:
        return lines
    if (ddp.max_global_batch or 0) < dp.max_global_batch:
        lines.append(
            "ddp fits a smaller global batch here: each rank holds its own gradients, their "
            "bucket copy and optimizer state, which DataParallel keeps on cuda:0 only"
        )
    elif ddp.max_global_batch == dp.max_global_batch:
        lines.append(
            f"ddp and dp fit the same global batch; at it each ddp rank peaks at "
            f"{format_size(max(ddp.per_device_peaks))}, dp's cuda:0 at "
            f"{format_size(dp.per_device_peaks[0])}"
        )
    return lines


def comparison_text(comparison: StrategyComparison) -> str:
    """The per-strategy table, what lives on cuda:0 only, the advice and the notes."""
    sizes = ", ".join(format_size(b) for b in comparison.budgets)
    lines = [
        f"{comparison.path}: {comparison.gpus} virtual GPUs ({sizes}) on {comparison.device}",
        "largest global batch that fits on every device, and each device's peak at it",
        "",
    ]
    header = _header(comparison)
    rows = [header, *_rows(comparison)]
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    for k, row in enumerate(rows):
        lines.append("  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)))
        if k == 0:
            lines.append("  ".join("-" * w for w in widths))
    lines += _remarks(comparison)
    lines += section("advice", advice_text(comparison.advice))
    lines += section("notes:", [f"- {note}" for note in comparison.notes])
    return "\n".join(lines)


def comparison_html_body(comparison: StrategyComparison) -> str:
    """The table, its remarks, the advice and the notes as HTML (no page shell)."""
    sizes = ", ".join(format_size(b) for b in comparison.budgets)
    remarks = "".join(f'<p class="note">{h.escape(line)}</p>' for line in _remarks(comparison))
    notes = "".join(f"<li>{h.escape(note)}</li>" for note in comparison.notes)
    return (
        f"<h3>{h.escape(comparison.path)}: {comparison.gpus} virtual GPUs "
        f"({h.escape(sizes)})</h3>"
        + h.table(_header(comparison), _rows(comparison))
        + remarks
        + advice_html(comparison.advice)
        + (f'<ul class="note">{notes}</ul>' if notes else "")
    )
