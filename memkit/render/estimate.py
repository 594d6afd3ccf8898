"""The layout of an :class:`~memkit.estimation.result.Estimate` and an
:class:`~memkit.estimation.result.EstimateSweep`: terminal text and HTML.

Pure functions of the result (no torch at import): the headline, the trial table, the
breakdown table, the memory model, the assumptions and the advice; for a sweep, one row per
sequence length above each length's own report.
"""

from __future__ import annotations

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
    from memkit.estimation.result import Estimate, EstimateSweep

__all__ = [
    "estimate_headline",
    "estimate_html_body",
    "estimate_text",
    "sweep_html_body",
    "sweep_text",
]

_TRIAL_HEADERS = ["batch", "fits", "allocated", "reserved"]
_BREAKDOWN_HEADERS = ["", "bytes", "share"]
_SWEEP_HEADERS = ["seq_len", "max batch", "recommended", "reserved", "per sample"]


def _precision(est: Estimate) -> str:
    """``fp32``, or the model's own weights' dtype (``bfloat16 weights``), without autocast."""
    return "fp32" if est.weights_dtype is None else f"{est.weights_dtype} weights"


def estimate_headline(est: Estimate) -> str:
    """One sentence: the largest and recommended batch on the card, or what batch 1 needs."""
    card = f"{format_size(est.device_memory)} {est.device}"
    seq = f", seq_len {est.seq_len}" if est.seq_len is not None else ""
    amp = f", {est.amp} autocast" if est.amp else f", {_precision(est)}"
    usable = (
        f"{format_size(est.usable_bytes)} usable after a "
        f"{format_size(est.context_bytes)} CUDA context"
    )
    if est.max_batch_size is None:
        first = est.trials[0] if est.trials else None
        need = format_size(None if first is None else first.reserved_peak)
        return (
            f"Estimated not to fit: batch {est.min_batch} ({est.mode}{seq}{amp}) needs "
            f"{'more than ' if first is not None and first.ran_out else ''}{need} reserved on "
            f"a {card} ({usable})."
        )
    rec = est.recommended_batch_size
    ran = next((t for t in est.trials if t.batch_size == rec), None)
    peak = None if ran is None else ran.reserved_peak
    words = recommended_words(rec, est.margin, peak, est.usable_bytes)
    if est.hit_max_batch:  # no memory limit found: the bound, and what it left free
        top = next((t for t in est.trials if t.batch_size == est.max_batch_size), None)
        bound = bound_words(
            est.max_batch, None if top is None else top.reserved_peak, est.usable_bytes
        )
        return (
            f"Estimated largest batch ({est.mode}{seq}{amp}) on a {card} ({usable}): at least "
            f"{est.max_batch_size}{bound}"
            + ("" if rec == est.max_batch_size else f"; {words}")
            + "."
        )
    return (
        f"Estimated largest batch ({est.mode}{seq}{amp}) on a {card} ({usable}): "
        f"{est.max_batch_size}; {words}."
    )


def _trial_rows(est: Estimate) -> list[list[object]]:
    return [
        [
            t.batch_size,
            "yes" if t.fits else "no",
            (">= " if t.ran_out else "") + format_size(t.allocated_peak),
            (">= " if t.ran_out else "") + format_size(t.reserved_peak),
        ]
        for t in sorted(est.trials, key=lambda t: t.batch_size)
    ]


def _breakdown_rows(est: Estimate) -> list[list[object]]:
    if est.breakdown is None:
        return []
    total = est.breakdown.total or 1
    rows: list[list[object]] = [
        [label, format_size(nbytes), f"{nbytes / total:.0%}"]
        for label, nbytes in est.breakdown.rows()
    ]
    return [*rows, ["allocated peak", format_size(est.breakdown.total), "100%"]]


def estimate_text(est: Estimate) -> str:
    """The terminal report (``memkit estimate``'s output, ``str(estimate)``)."""
    parts = [estimate_headline(est), ""]
    parts.append(table(_TRIAL_HEADERS, _trial_rows(est), align="rlrr"))
    if est.breakdown is not None:
        parts += [
            "",
            table(
                _BREAKDOWN_HEADERS,
                _breakdown_rows(est),
                align="lrr",
                title=f"breakdown at batch {est.breakdown.batch_size}:",
            ),
        ]
    if est.per_sample_bytes is not None and est.fixed_bytes is not None:
        parts.append(
            "\n"
            + memory_model_words(
                est.fixed_bytes, est.per_sample_bytes, " (reserved)", est.per_pair_bytes
            )
        )
    parts.append("assumptions:")
    parts.extend(f"  {a}" for a in est.assumptions)
    parts += section("advice:", advice_text(est.advice))
    return "\n".join(parts)


def estimate_html_body(est: Estimate) -> str:
    """The estimate as HTML (no page shell, no style; see :class:`memkit.results.Result`)."""
    body = f"<h3>memkit estimate</h3><p>{h.escape(estimate_headline(est))}</p>" + h.table(
        _TRIAL_HEADERS, _trial_rows(est)
    )
    if est.breakdown is not None:
        body += f"<p>breakdown at batch {est.breakdown.batch_size}:</p>" + h.table(
            _BREAKDOWN_HEADERS, _breakdown_rows(est)
        )
    body += (
        '<p class="note">'
        + "<br>".join(h.escape(a) for a in est.assumptions)
        + "</p>"
        + advice_html(est.advice)
    )
    return body


def _sweep_rows(sweep: EstimateSweep) -> list[list[object]]:
    """Per length: the largest and recommended batch, the reserved peak of the largest, and
    the memory model's bytes per sample."""
    rows: list[list[object]] = []
    for est in sweep.results:
        largest = None if est.max_batch_size is None else est.trial(est.max_batch_size)
        rows.append(
            [
                est.seq_len,
                f">={est.max_batch_size}" if est.hit_max_batch else est.max_batch_size,
                est.recommended_batch_size,
                None if largest is None else format_size(largest.reserved_peak),
                None if est.per_sample_bytes is None else format_size(est.per_sample_bytes),
            ]
        )
    return rows


def _sweep_headline(sweep: EstimateSweep) -> str:
    first = sweep.results[0]
    amp = f"{first.amp} autocast" if first.amp else _precision(first)
    return (
        f"Estimated largest batch per sequence length ({first.mode}, {amp}) on a "
        f"{format_size(first.device_memory)} {first.device} "
        f"({format_size(first.usable_bytes)} usable):"
    )


def sweep_text(sweep: EstimateSweep) -> str:
    """One row per sequence length (reserved: at the largest batch), then each length's own
    report (``memkit estimate --seq-len 512,1024``)."""
    summary = [_sweep_headline(sweep), "", table(_SWEEP_HEADERS, _sweep_rows(sweep), align="rrrrr")]
    return "\n\n".join(["\n".join(summary), *(estimate_text(est) for est in sweep.results)])


def sweep_html_body(sweep: EstimateSweep) -> str:
    """The same as HTML: the table, then each length's estimate."""
    return (
        "<h3>memkit estimate: max batch per sequence length</h3>"
        f"<p>{h.escape(_sweep_headline(sweep))}</p>"
        + h.table(_SWEEP_HEADERS, _sweep_rows(sweep))
        + "".join(estimate_html_body(est) for est in sweep.results)
    )
