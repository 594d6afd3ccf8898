"""Text and HTML layout of :mod:`memkit.probing.result`'s results (torch-free, pure)."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from memkit.render import html as h
from memkit.render.advice import advice_html, advice_text
from memkit.render.text import (
    bound_words,
    memory_model_words,
    recommended_words,
    section,
    table,
)
from memkit.units import format_size

if TYPE_CHECKING:
    from memkit.probing.result import ProbeModes, ProbeResult, ProbeSweep, ProbeTrial

__all__ = [
    "modes_html_body",
    "modes_text",
    "probe_headline",
    "probe_html_body",
    "probe_text",
    "sweep_html_body",
    "sweep_text",
]

_TRIAL_HEAD = ["batch", "fits", "peak", "seconds"]
_RANK_HEAD = ["rank", "capacity", "peak", "used", "room left", ""]
_SWEEP_HEAD = ["seq_len", "max batch", "recommended", "trials", "peak"]


def _peak_cell(trial: ProbeTrial) -> str:
    """A trial's peak; for a failed one, the lower bound its OOM gave (never a "peak" above
    the capacity that no allocation reached)."""
    if trial.fits or trial.peak_bytes is None:
        return format_size(trial.peak_bytes)
    return f"needs >= {format_size(trial.peak_bytes)}"


def _fits_cell(trial: ProbeTrial) -> str:
    if not trial.fits:
        return "OOM"
    return "yes, too few steps" if trial.superseded else "yes"


def _trial_rows(result: ProbeResult) -> list[list[object]]:
    return [[t.batch_size, _fits_cell(t), _peak_cell(t), f"{t.seconds:.2f}"] for t in result.trials]


def _rank_rows(result: ProbeResult) -> list[list[object]]:
    rows: list[list[object]] = []
    tight = result.tightest_rank
    for r in range(result.world_size):
        peak = result.per_rank_peaks[r] if r < len(result.per_rank_peaks) else None
        cap = result.per_rank_capacities[r] if r < len(result.per_rank_capacities) else None
        room = None if peak is None or cap is None else cap - peak
        share = "" if peak is None or not cap else f"{peak / cap:.0%}"
        rows.append(
            [
                r,
                format_size(cap),
                format_size(peak),
                share,
                format_size(room),
                "tightest" if r == tight else "",
            ]
        )
    return rows


def _shows_ranks(result: ProbeResult) -> bool:
    return result.world_size > 1 and bool(result.per_rank_peaks)


def _recommended_words(result: ProbeResult) -> str:
    """``recommended N (leaves 5% free)``, only where the numbers say so."""
    rec = result.recommended_batch_size
    ran = None if rec is None else result.trial(rec)
    peak = None if ran is None else ran.peak_bytes
    return recommended_words(
        rec,
        result.margin,
        peak,
        result.capacity_bytes,
        interpolated=rec is not None and ran is None,
    )


def probe_headline(result: ProbeResult) -> str:
    """One sentence: the largest batch that fits, where, and what to train with."""
    where = f"{result.device_name} [{result.device}]"
    cap = format_size(result.capacity_bytes)
    seq = f", seq_len {result.seq_len}" if result.seq_len is not None else ""
    if result.world_size > 1:
        where = f"{result.world_size} ranks{' (DDP)' if result.ddp else ''}, {where} on rank 0"
        cap = f"{cap} (the smallest rank's)"
    if result.max_batch_size is None:
        return (
            f"Does not fit: batch {result.min_batch} ({result.mode}{seq}) needs more than the "
            f"{cap} of {where}."
        )
    words = _recommended_words(result)
    if result.hit_max_batch:  # no memory limit found: the bound, and what it left free
        top = result.trial(result.max_batch_size)
        peak = None if top is None else top.peak_bytes
        bound = bound_words(result.max_batch, peak, result.capacity_bytes)
        return (
            f"Largest batch that fits ({result.mode}{seq}) on {where}, capacity {cap}: at least "
            f"{result.max_batch_size}{bound}"
            + ("" if result.recommended_batch_size == result.max_batch_size else f"; {words}")
            + "."
        )
    return (
        f"Largest batch that fits ({result.mode}{seq}) on {where}, capacity {cap}: "
        f"{result.max_batch_size}; {words}."
    )


def probe_text(result: ProbeResult) -> str:
    """The headline, the trial table, per-rank peaks, the memory model and the advice."""
    parts = [probe_headline(result), ""]
    parts.append(table(_TRIAL_HEAD, _trial_rows(result), align="rlrr"))
    if _shows_ranks(result):
        parts.append(f"\nper rank at batch {result.max_batch_size} (every rank runs that batch):")
        parts.append(table(_RANK_HEAD, _rank_rows(result), align="rrrrrl"))
    if result.per_sample_bytes is not None and result.fixed_bytes is not None:
        parts.append(
            "\n"
            + memory_model_words(
                result.fixed_bytes, result.per_sample_bytes, per_pair=result.per_pair_bytes
            )
        )
    parts.append(f"accounting: {result.accounting}")
    parts.extend(result.defaults)
    parts += section("advice:", advice_text(result.advice))
    return "\n".join(parts)


def probe_html_body(result: ProbeResult) -> str:
    """The same as HTML (no page shell)."""
    return (
        f"<h3>memkit probe</h3><p>{h.escape(probe_headline(result))}</p>"
        + h.table(_TRIAL_HEAD, _trial_rows(result))
        + (h.table(_RANK_HEAD, _rank_rows(result)) if _shows_ranks(result) else "")
        + f'<p class="note">accounting: {h.escape(result.accounting)}<br>'
        + "<br>".join(h.escape(d) for d in result.defaults)
        + "</p>"
        + advice_html(result.advice)
    )


def _sweep_rows(sweep: ProbeSweep) -> list[list[object]]:
    return [
        [
            r.seq_len,
            f">={r.max_batch_size}" if r.hit_max_batch else r.max_batch_size,  # a bound
            r.recommended_batch_size,
            len(r.trials),
            format_size(max((t.peak_bytes or 0 for t in r.trials if t.fits), default=None)),
        ]
        for r in sweep.results
    ]


def sweep_text(sweep: ProbeSweep) -> str:
    """The largest batch per sequence length, as a table, and the advice."""
    first = sweep.results[0]
    head = (
        f"Largest batch per sequence length ({first.mode}) on {first.device_name} "
        f"[{first.device}], capacity {format_size(first.capacity_bytes)}:"
    )
    body = table(_SWEEP_HEAD, _sweep_rows(sweep))
    shared = [d for d in first.defaults if all(d in r.defaults for r in sweep.results[1:])]
    advice = advice_text(
        dataclasses.replace(a, title=f"seq_len {r.seq_len}: {a.title}")  # whose it is
        for r in sweep.results
        for a in r.advice
    )
    lines = ["", *shared] if shared else []  # the report lines every length shares
    return "\n".join([head, "", body, *lines, *section("advice:", advice)])


def sweep_html_body(sweep: ProbeSweep) -> str:
    """The same table as HTML."""
    return "<h3>memkit probe: max batch per sequence length</h3>" + h.table(
        _SWEEP_HEAD, _sweep_rows(sweep)
    )


def modes_text(modes: ProbeModes) -> str:
    """One line with each mode's largest batch, then each mode's own text."""
    heads = [f"{mode} {batch}" for mode, batch in modes.largest_batches.items()]
    summary = f"Largest batch per mode: {', '.join(heads)}\n\n" if heads else ""
    return summary + "\n\n".join(str(r) for r in modes.results)


def modes_html_body(modes: ProbeModes) -> str:
    """Each mode's HTML, one after the other."""
    return "".join(r.html_body() for r in modes.results)
