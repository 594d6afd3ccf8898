"""Text and HTML layout of :func:`memkit.track`'s results (:mod:`memkit.tracking.report`).

Pure functions of the recorded numbers: the result classes delegate their ``__str__``,
``text()``, ``html()`` and ``html_body()`` here. No torch at import.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from memkit.render import html as h
from memkit.render.advice import advice_html, advice_text
from memkit.render.text import section, table
from memkit.units import format_percent, format_shape, format_size

if TYPE_CHECKING:
    from memkit.tracking.rank_gather import RanksReport
    from memkit.tracking.report import (
        Breakdown,
        DeviceReport,
        LeakFinding,
        ModuleRecord,
        OomPostMortem,
        TimelinePoint,
        TrackReport,
    )

__all__ = [
    "CAPACITY_IN_PLOT",
    "MAX_PLOT_POINTS",
    "MODULE_HEADERS",
    "RANK_HEADERS",
    "STEP_RULES",
    "breakdown_html",
    "breakdown_text",
    "device_summary_row",
    "leak_headline",
    "postmortem_html",
    "postmortem_text",
    "rank_rows",
    "ranks_headline",
    "ranks_html_body",
    "ranks_text",
    "report_html_body",
    "report_text",
    "summary_headers",
]

MAX_PLOT_POINTS = 1200
"""The HTML plot keeps at most this many points per device (peak-preserving downsampling)."""

CAPACITY_IN_PLOT = 4
"""The HTML memory plot draws the capacity line when it is at most this many times the peak
(further up, it would squash the readings to the floor; a note gives it instead)."""

STEP_RULES = {
    "optimizer": "steps counted at optimizer.step()",
    "backward": "steps counted from backward passes (no optimizer stepped)",
    "manual": "steps counted at Tracker.step()",
}

MODULE_HEADERS = ["module", "calls", "kept/step", "kept (self)", "peak inside", "transient"]


def _size(value: int | None) -> str:
    return "-" if value is None else format_size(value)


def summary_headers(phases: Sequence[str]) -> list[str]:
    """The columns of the device summary table (one per phase)."""
    return ["device", "name", "capacity", "peak alloc", "peak reserved", *phases, "steps"]


def device_summary_row(dev: DeviceReport) -> list[object]:
    """A row of the device summary table."""
    return [
        dev.device,
        dev.name,
        _size(dev.capacity),
        _size(dev.peak_allocated),
        _size(dev.peak_reserved),
        *(_size(dev.phase_peaks.get(p)) for p in dev.PHASES),
        len(dev.steps),
    ]


def module_label(m: ModuleRecord) -> str:
    """``path (Type)``; the path alone without a type, or when the path is the type (the model
    itself is named by its class)."""
    if not m.type_name or m.type_name == m.path:
        return m.path
    return f"{m.path} ({m.type_name})"


def _module_row(m: ModuleRecord) -> list[object]:
    return [
        module_label(m),
        m.calls,
        _size(m.activation_bytes_per_step),
        _size(m.self_activation_bytes),
        _size(m.peak_allocated),
        _size(m.peak_over_entry),
    ]


def _downsample(points: Sequence[TimelinePoint], limit: int) -> list[TimelinePoint]:
    """At most ``limit`` points: each bucket's lowest and highest readings, in time order
    (peaks survive, and so does the swing of every step within a bucket)."""
    if len(points) <= limit:
        return list(points)
    bucket = -(-len(points) // max(1, limit // 2))
    out = []
    for i in range(0, len(points), bucket):
        chunk = points[i : i + bucket]
        low = min(chunk, key=lambda p: p.allocated)
        high = max(chunk, key=lambda p: p.allocated)
        out.extend(sorted({id(low): low, id(high): high}.values(), key=lambda p: p.t))
    return out


# ----------------------------------------------------------------------------------------
# the breakdown and the post-mortem


def breakdown_text(bd: Breakdown) -> str:
    """One line per category with its share of the total."""
    rows = []
    for name, value in bd.parts():
        share = f"{100.0 * value / bd.total:.0f}%" if bd.total else "-"
        rows.append([name, format_size(value), share])
    rows.append(["total", format_size(bd.total), ""])
    text = table(["category", "bytes", "share"], rows, align="lrr")
    return text + f"\nnote: {bd.note}" if bd.note else text


def breakdown_html(bd: Breakdown, title: str = "At the peak", where: str | None = None) -> str:
    """A section: the categories as a stacked bar, a legend and a table (``where``: the
    moment's place, else its step, phase and module)."""
    parts = [(f"{name}: {format_size(v)}", float(v)) for name, v in bd.parts()]
    if where is None:
        where = ", ".join(
            x
            for x in (
                None if bd.step is None else f"step {bd.step}",
                bd.phase,
                None if bd.module is None else bd.module,
            )
            if x
        )
    rows = [[name, format_size(v)] for name, v in bd.parts()]
    note = f'<p class="note">{h.escape(bd.note)}</p>' if bd.note else ""
    return (
        f"<h3>{h.escape(title)} ({h.escape(format_size(bd.total))}; {h.escape(where)})</h3>"
        + h.stacked_bar(parts, float(bd.total), width_px=480)
        + h.legend([name for name, _ in bd.parts()])
        + h.table(["category", "bytes"], rows)
        + note
    )


def leak_headline(leak: LeakFinding) -> str:
    """One line: what grows, by how much."""
    if leak.graph_growth and leak.growth_per_step <= 0:
        held = f" held by `{leak.suspects[0].name}`" if leak.suspects else ""
        return (
            f"an autograd graph{held} grows by about {leak.graph_growth} nodes per step "
            f"(host memory; since step {leak.first_step})"
        )
    if leak.period > 1:
        return (
            f"memory grows by {format_size(leak.growth_per_step * leak.period)} every "
            f"{leak.period} steps (since step {leak.first_step}, over {leak.steps} steps)"
        )
    return (
        f"memory grows by {format_size(leak.growth_per_step)} per step "
        f"(since step {leak.first_step}, over {leak.steps} steps)"
    )


def postmortem_text(pm: OomPostMortem) -> str:
    """The post-mortem as printed to stderr."""
    rank = "" if pm.rank is None else f" (rank {pm.rank})"
    shape = pm.input_shape
    batch = "" if not shape else f" (the model's input: {'x'.join(map(str, shape))})"
    lines = [
        f"memkit: out of memory on {pm.device}{rank} at {pm.where}{batch}",
        f"  {pm.exception}",
        f"  tried to allocate {_size(pm.tried_to_allocate)}; "
        f"capacity {_size(pm.capacity)}, free {_size(pm.free)}, "
        f"held by tensors {_size(pm.allocated)}",
    ]
    if pm.training is False and pm.grad_enabled:
        lines.append("  the last forward ran in eval mode with autograd recording")
    if pm.breakdown is not None:
        lines.append("  what was allocated:")
        lines.extend("    " + line for line in breakdown_text(pm.breakdown).splitlines())
    if pm.top_modules:
        lines.append("  largest activations (kept after forward, per step):")
        rows = [[path, format_size(size)] for path, size in pm.top_modules]
        lines.extend("    " + line for line in table(["module", "bytes"], rows).splitlines())
    if pm.leak is not None:
        lines.append(f"  before this, {leak_headline(pm.leak)}")
    if pm.advice:
        lines.append("  advice:")
        lines.extend("    " + line for line in advice_text(pm.advice).splitlines())
    return "\n".join(lines)


def postmortem_html(pm: OomPostMortem) -> str:
    """The post-mortem as an HTML section (no page shell)."""
    rows = [
        ["where", pm.where],
        ["exception", pm.exception],
        ["tried to allocate", _size(pm.tried_to_allocate)],
        ["capacity", _size(pm.capacity)],
        ["free", _size(pm.free)],
        ["held by tensors", _size(pm.allocated)],
    ]
    body = [f"<h2>Out of memory on {h.escape(pm.device)}</h2>", h.table(["", ""], rows)]
    if pm.breakdown is not None:
        body.append(breakdown_html(pm.breakdown, "When it failed"))
    if pm.top_modules:
        body.append("<h3>Largest activations</h3>")
        body.append(h.table(["module", "bytes"], [[p, format_size(s)] for p, s in pm.top_modules]))
    body.append("<h3>Advice</h3>")
    body.append(advice_html(list(pm.advice)))
    return "".join(body)


# ----------------------------------------------------------------------------------------
# across ranks (rank 0's report)

RANK_HEADERS = ["rank", "device", "peak alloc", "peak reserved", "capacity", "used", "phase",
                "step", ""]  # fmt: skip


def rank_rows(ranks: RanksReport) -> list[list[object]]:
    """One row per rank, under :data:`RANK_HEADERS`."""
    tight = ranks.tightest_rank
    return [
        [
            r.rank,
            r.device,
            format_size(r.peak_allocated),
            format_size(r.peak_reserved),
            format_size(r.capacity),
            "" if r.used_share is None else f"{r.used_share:.0%}",
            r.peak_phase or "",
            "" if r.peak_step is None else r.peak_step,
            ("OOM " + r.oom)
            if r.oom
            else ("raised " + r.error.split(":")[0])
            if r.error
            else ", ".join(
                part
                for part in (
                    f"caught {r.ooms_caught} OOM(s)" if r.ooms_caught else "",
                    "tightest" if r.rank == tight else "",
                )
                if part
            ),
        ]
        for r in ranks.ranks
    ]


def ranks_headline(ranks: RanksReport) -> str:
    """The imbalance and the rank closest to its capacity, in one line (and the ranks that
    sent no summary)."""
    missing = ""
    late = [r for r in ranks.missing if r not in ranks.absent]
    if late:
        wait = "" if ranks.timeout is None else f" within {ranks.timeout:g} s"
        missing = f"; rank(s) {', '.join(map(str, late))} sent no summary{wait} and are left out"
    if ranks.absent:  # (sweep BW: "within 300 s" for a block of 0.52 s rank 1 never ran)
        missing += (
            f"; rank(s) {', '.join(map(str, ranks.absent))} did not run this block and are left out"
        )
    return (
        f"{ranks.world_size} ranks{missing}; imbalance between ranks {ranks.imbalance:.0%} of "
        f"the largest peak; rank {ranks.tightest_rank} is the closest to its capacity (the "
        "first to run out as the batch grows)"
    )


def ranks_text(ranks: RanksReport) -> str:
    """The headline, the per-rank table and the advice across ranks."""
    parts = [ranks_headline(ranks), "", table(RANK_HEADERS, rank_rows(ranks), title="ranks")]
    parts += section("advice across ranks:", advice_text(ranks.advice))
    return "\n".join(parts)


def ranks_html_body(ranks: RanksReport) -> str:
    """The same as HTML (no page shell)."""
    return (
        f"<h3>Ranks</h3><p>{h.escape(ranks_headline(ranks))}</p>"
        + h.table(RANK_HEADERS, rank_rows(ranks))
        + (advice_html(list(ranks.advice)) if ranks.advice else "")
    )


# ----------------------------------------------------------------------------------------
# the report


def report_text(report: TrackReport) -> str:
    """The whole report as text (``str(report)``, ``memkit run``'s output)."""
    rank = "" if report.rank is None else f" rank {report.rank}/{report.world_size}"
    lines = [
        f"memkit track{rank}: {report.steps} step(s) in {report.duration_s:.2f} s, "
        f"mode {report.mode}; {STEP_RULES[report.step_rule]}",
    ]
    if report.micro_batches > 1:
        lines.append(
            f"gradient accumulation: up to {report.micro_batches} backward passes per optimizer "
            "step (micro-batches, or a loss backwarded in parts: a GAN discriminator's real "
            "and fake halves); kept/step is one pass's (each backward frees its own)"
        )
    checkpointing = _checkpointing_line(report)
    if checkpointing:
        lines.append(checkpointing)
    if report.eval_forwards:
        batch = (
            ""
            if report.eval_input_shape is None
            else f", largest input {format_shape(report.eval_input_shape)}"
        )
        frozen = report.frozen_model
        if frozen is not None and report.frozen_forwards:
            shape = report.frozen_input_shape
            on = "" if shape is None else f" {format_shape(shape)}"
            others = "" if not batch else f"; the others'{batch.removeprefix(',')}"
            batch = (
                f", {report.frozen_forwards} of them by `{frozen[0]}` (a model no optimizer "
                f"trains) on the training batch{on}{others}"
            )
        lines.append(
            f"evaluation: {report.eval_forwards} forward pass(es){batch}, reported apart "
            "from training (the eval column); module bytes are training forwards only"
        )
    lines += [
        "",
        table(
            summary_headers(report.PHASES),
            [d.summary_row() for d in report.devices],
            title="devices",
        ),
    ]
    for dev in report.devices:
        lines.append("")
        lines.extend(_device_text(dev))
    if report.ranks is not None:
        lines.extend(["", ranks_text(report.ranks)])
    lines += section("advice:", advice_text(report.advice))
    lines += section("notes:", [f"- {note}" for note in report.notes])
    if report.oom is not None:
        lines.extend(["", str(report.oom)])
    return "\n".join(lines)


def _checkpointing_line(report: TrackReport) -> str | None:
    """``activation checkpointing: on (the trainer's setting); ... recomputed in backward``
    where the trainer says it is on or a forward was seen recomputed; else ``None``."""
    told = any(d.setup is not None and d.setup.checkpointing for d in report.devices)
    recomputed = [m for d in report.devices for m in d.modules if m.recompute_calls]
    ordered = sorted(recomputed, key=lambda m: m.first_call or 0)
    paths = list(dict.fromkeys(m.path for m in ordered))  # once, whatever the devices
    outer = [p for p in paths if not any(p.startswith(q + ".") for q in paths)]
    if not told and not outer:
        return None
    setting = " on (the model's or the trainer's setting);" if told else ""
    if not outer:
        return f"activation checkpointing:{setting} no forward seen recomputed in backward"
    span = outer[0] if len(outer) == 1 else f"{outer[0]} ... {outer[-1]}"
    return (
        f"activation checkpointing:{setting} {len(outer)} module(s) recomputed their forward in "
        f"backward ({span})"
    )


def _breakdown_place(dev: DeviceReport, bd: Breakdown) -> tuple[str, str]:
    """What the device's breakdown is of (``the training peak``) and where it was (``step 5,
    forward, Net``); after an error that ended a part of a step higher than it (its segment
    belongs to the post-mortem), the highest moment measured before the error, and where the
    higher peak was."""
    where = ", ".join(
        x
        for x in (
            None if bd.step is None else f"step {bd.step}",
            bd.phase,
            next((module_label(m) for m in dev.modules if m.path == bd.module), bd.module),
            None if not bd.input_shape else f"input {'x'.join(map(str, bd.input_shape))}",
        )
        if x
    )
    trained = bd.phase != "eval" and any(s.backward_passes for s in dev.steps)
    what = "the training peak" if trained else "the peak"
    peaks = {p: v for p, v in dev.phase_peaks.items() if v is not None and p != "eval"}
    highest = max(peaks, key=lambda p: peaks[p], default=None)
    if highest is not None and peaks[highest] > bd.total:  # in the segment that failed
        what = f"the highest {'training ' if trained else ''}moment measured before the error"
        where += f"; the {highest} peak, {format_size(peaks[highest])}, was where it failed"
    elif dev.breakdown_ran_out:
        where += "; in an attempt that then ran out of memory"
    return what, where


def _device_text(dev: DeviceReport) -> list[str]:
    lines = [f"{dev.device}: {dev.accounting}"]
    if dev.breakdown is not None:
        what, where = _breakdown_place(dev, dev.breakdown)
        lines.append(f"at {what} ({where}):")
        lines.extend("  " + line for line in dev.breakdown.text().splitlines())
    top = dev.top_modules(10)
    if top:
        lines.append(table(MODULE_HEADERS, [_module_row(m) for m in top], title="top modules"))
    if dev.leak is not None:
        lines.append(leak_headline(dev.leak))
    return lines


def report_html_body(report: TrackReport) -> str:
    """The report's HTML without the page shell."""
    rank = "" if report.rank is None else f" (rank {report.rank}/{report.world_size})"
    body = [
        f"<h2>memkit track{h.escape(rank)}</h2>",
        f'<p class="note">{report.steps} step(s) in {report.duration_s:.2f} s, mode '
        f"{h.escape(report.mode)}</p>",
    ]
    if report.oom is not None:
        body.append(report.oom.html_body())
    body.append("<h3>Devices</h3>")
    body.append(h.table(summary_headers(report.PHASES), [d.summary_row() for d in report.devices]))
    for dev in report.devices:
        body.extend(_device_html(dev))
    if report.ranks is not None:
        body.append(ranks_html_body(report.ranks))
    if report.advice or report.oom is None:  # the post-mortem above has its own advice
        body.append("<h3>Advice</h3>")
        body.append(advice_html(list(report.advice)))
    if report.notes:
        body.append("".join(f'<p class="note">{h.escape(n)}</p>' for n in report.notes))
    return "".join(body)


def _device_html(dev: DeviceReport) -> list[str]:
    body = [
        f"<h2>{h.escape(dev.device)}: {h.escape(dev.name)}</h2>",
        f'<p class="note">{h.escape(dev.accounting)}</p>',
        "<h3>Memory over time</h3>",
        *_memory_plot(dev),
    ]
    if dev.timeline_dropped:
        body.append(f'<p class="note">{dev.timeline_dropped} older readings not kept.</p>')
    if dev.steps:
        body.append("<h3>Peak per step</h3>")
        body.append(
            h.line_plot(
                [
                    ("step peak", [(s.step, float(s.peak_allocated)) for s in dev.steps]),
                    ("end of step", [(s.step, float(s.end_allocated)) for s in dev.steps]),
                ],
                width=900,
                height=180,
                x_label="step",
                y_label="memory per step",
                y_bytes=True,
                x_integer=True,
                markers=len(dev.steps) <= 60,
            )
        )
    if dev.breakdown is not None:
        what, where = _breakdown_place(dev, dev.breakdown)
        body.append(breakdown_html(dev.breakdown, f"At {what}", where))
    top = dev.top_modules(25)
    if top:
        body.append("<h3>Modules (largest activations first)</h3>")
        body.append(h.table(MODULE_HEADERS, [_module_row(m) for m in top]))
    return body


def _memory_plot(dev: DeviceReport) -> list[str]:
    """The readings over time (allocated, reserved where it differs, the capacity when it
    fits the chart) and the reported peak as a labelled line (readings are taken at hooks, so
    a peak between them, an optimizer's temporaries, is above every reading), then a note on
    the capacity when it does not fit."""
    pts = _downsample(dev.timeline, MAX_PLOT_POINTS)
    series = [("allocated", [(p.t, float(p.allocated)) for p in pts])]
    if any(p.reserved != p.allocated for p in pts):
        series.append(("reserved", [(p.t, float(p.reserved)) for p in pts]))
    highest = max(dev.peak_allocated, dev.peak_reserved)
    capacity_note = ""
    if dev.capacity and dev.capacity <= CAPACITY_IN_PLOT * highest:
        series.append(
            ("capacity", [(pts[0].t, dev.capacity), (pts[-1].t, dev.capacity)] if pts else [])
        )
    elif dev.capacity:  # a flat line far above would squash the readings to the floor
        capacity_note = (
            f'<p class="note">capacity {h.escape(format_size(dev.capacity))} is above '
            f"this chart: the peak, {h.escape(format_size(highest))}, is "
            f"{format_percent(highest / dev.capacity)} of it.</p>"
        )
    between = bool(pts) and dev.peak_allocated > max(p.allocated for p in pts)
    peak = f"peak allocated {format_size(dev.peak_allocated)}"
    plot = h.line_plot(
        series,
        width=900,
        height=240,
        x_label="seconds since the start",
        y_label="memory",
        y_bytes=True,
        levels=[(f"{peak}, between readings" if between else peak, float(dev.peak_allocated))],
    )
    return [plot, capacity_note]
