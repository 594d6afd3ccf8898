"""Leak advice: ``graph-retained`` (a live variable holds a growing autograd graph),
``tensors-kept`` (a container of device tensors without a graph grows; a deque with a
``maxlen`` says where it levels off) and ``memory-growth`` (memory grows and no variable is
named), from the tracker's leak findings (:mod:`memkit.tracking.leaks` finds them)."""

from __future__ import annotations

import math
import re
from typing import TYPE_CHECKING

from memkit.advice.form import Advice
from memkit.units import format_shape, format_size

if TYPE_CHECKING:
    from memkit.tracking.report import LeakFinding, LeakSuspect

__all__ = ["graph_retained_advice"]


def graph_retained_advice(leaks: list[LeakFinding]) -> list[Advice]:
    """``graph-retained``: memory grows each step and a live variable holds an autograd
    graph; ``tensors-kept``: a container of device tensors grows; ``memory-growth``: memory
    grows and neither is found."""
    out: list[Advice] = []
    for leak in leaks:
        growth = _growth(leak)
        names = ", ".join(f"`{s.name}` ({s.where})" for s in leak.suspects[:3])
        top = leak.suspects[0] if leak.suspects else None
        if top is None or not top.growing:
            held = _held_batches(leak)
            out.append(_memory_growth(leak, growth + held, counted_late=bool(held)))
        elif not top.graph:
            out.append(_tensors_kept(leak, top, growth))
        else:
            out.append(_graph_retained(leak, top, growth, names))
    return out


def _growth(leak: LeakFinding, saving: bool = True) -> str:
    """The evidence's first sentences: how the memory (or a graph) grew, and by how much in
    all (``saving``: said to be the saving)."""
    if leak.period > 1:
        return (
            f"Allocated memory on {leak.device} grew by "
            f"{format_size(leak.growth_per_step * leak.period)} every {leak.period} steps "
            f"over {leak.steps} steps (from step {leak.first_step}) without coming back down"
            + _in_all(leak, saving)
        )
    if leak.graph_growth and leak.growth_per_step <= 0:
        return (
            f"An autograd graph grew by about {leak.graph_growth} nodes per step (from step "
            f"{leak.first_step}); device memory on {leak.device} showed no lasting growth "
            "(backward freed the saved tensors, or the holder is emptied from time to time), "
            "but every step's graph nodes stay alive in host memory while it holds them, and "
            "the tensors it holds stay on the device."
        )
    return (
        f"Allocated memory on {leak.device} grew by {format_size(leak.growth_per_step)} "
        f"per step over {leak.steps} steps (from step {leak.first_step}) without "
        "coming back down" + _in_all(leak, saving)
    )


def _in_all(leak: LeakFinding, saving: bool = True) -> str:
    """The end of :func:`_growth`'s sentence: the bytes grown over the climb, as measured
    (``saving``: said to be what fixing it frees at least; growth before the climb's start
    and after the last step read is not in it)."""
    if leak.grown_bytes <= 0:
        return "."
    last = leak.first_step + leak.steps
    return (
        f": {format_size(leak.grown_bytes)} in all from step {leak.first_step} to step {last}"
        + (", the least that fixing it saves (a longer run keeps more)." if saving else ".")
    )


def _held_batches(leak: LeakFinding) -> str:
    """On the simulated device, the batches the model read while the memory grew that are
    still alive, when they account for most of the growth (a list of batches built before
    training counts there batch by batch; their labels, which the model does not read, are
    the rest); nothing where no container was seen growing. Batches a dataset keeps that an
    earlier epoch counted explain nothing later (a detection dataset's target dicts)."""
    grown = leak.growth_per_step * leak.steps
    if not (leak.held_batches > 1 and grown > 0 and 4 * leak.held_batch_bytes >= 3 * grown):
        return ""
    return (
        f" {leak.held_batches} input tensors the model read while it grew are still alive "
        f"({format_size(leak.held_batch_bytes)}): the simulated device counts a host "
        "tensor from the step that first feeds it to the model, so batches a script "
        "keeps (a list built before training) grow here one by one. On a GPU they "
        "would be there from the start if moved up front, or copied per step."
    )


def _memory_growth(leak: LeakFinding, growth: str, *, counted_late: bool = False) -> Advice:
    """``memory-growth``: no variable was seen growing; those seen holding a graph are the
    step's own (its loss), not shown to be the cause: say what was seen, claim nothing.
    ``counted_late``: the batches the script keeps explain the growth (the simulated device
    counts each from its first step): information, no leak on a GPU and nothing to save."""
    if counted_late:
        return Advice(
            code="memory-growth",
            title=f"memory on {leak.device} grows by the batches the script keeps: the "
            "simulated device's count, no leak",
            evidence=growth,
            action="Nothing to fix for a GPU run, unless the script keeps the batches on the "
            "GPU (a list moved up front: there from the first step, so the peak is the one "
            "of the last steps here); to see the steady state on the simulated device, run "
            "more steps than the list holds.",
            severity="info",
        )
    shown = leak.suspects[:3]
    with_graph = ", ".join(f"`{s.name}` ({s.where})" for s in shown if s.graph)
    without = ", ".join(f"`{s.name}` ({s.where})" for s in shown if not s.graph)
    seen = (
        f" At the end of a step {with_graph} held an autograd graph, but none of their "
        "graphs grew between two scans: the step's own, most likely, not the cause."
        if with_graph
        else " No variable of the training thread holds an autograd graph."
    )
    if without:  # (inference-mode samples kept between the scans that would see them grow)
        seen += (
            f" {without} kept device tensors without a graph and "
            + ("was" if without.count("`") == 2 else "were")
            + " not seen growing "
            "between two scans (the scans run every few steps: a list that grows between "
            "them, near the end of a run, is not confirmed)."
        )
    every = "every step" if leak.period <= 1 else f"every {leak.period} steps"
    return Advice(
        code="memory-growth",
        title=f"memory grows {every} on {leak.device}",
        evidence=growth + seen + " Look for tensors kept in caches or globals, or deeper "
        "than the scan looks (it sees locals, the attributes of `self` and of the script's "
        "own objects, and containers two levels deep).",
        action="Keep only Python numbers across steps (`.item()`); move tensors you store to "
        "the CPU (`.detach().cpu()`: detaching alone keeps their bytes on the device); bound "
        "what grows with the step count (`collections.deque(maxlen=N)`).",
        saving_bytes=leak.grown_bytes or None,
        severity="warning",
    )


def _tensors_kept(leak: LeakFinding, top: LeakSuspect, growth: str) -> Advice:
    """``tensors-kept``: a container of device tensors without a graph grows (detached
    outputs kept in a list; a replay buffer filling up). A deque with a ``maxlen`` levels off
    at ``maxlen`` items: said, with the bytes it will hold. On the simulated device, tensors
    the line moves off the device (``.detach().cpu()``) stay counted: said, no leak."""
    shape = (
        ""
        if top.item_shape is None
        else f" (the last's largest a {format_shape(top.item_shape)} tensor)"
    )
    line = f"; line: `{top.code}`" if top.code else ""
    held = (
        f" `{top.name}` ({top.where}{line}) held {top.length} item(s) when scanned, about "
        f"{format_size(top.item_bytes)} each on {leak.device}{shape}: "
        f"{format_size(top.tensor_bytes)}"
        + (
            f", and grew by {format_size(top.bytes_per_step)} per step between two scans"
            if top.bytes_per_step
            else ""
        )
        + ": its tensors carry no graph; their own bytes are what stays."
    )
    if top.maxlen is not None and top.maxlen > top.length:
        full = top.tensor_bytes + (top.maxlen - top.length) * top.item_bytes
        return Advice(
            code="tensors-kept",
            title=f"`{top.name}` fills up to its maxlen ({top.maxlen}) on {leak.device}",
            evidence=growth + held + f" It is a deque with maxlen={top.maxlen}: it stops "
            f"growing at {top.maxlen} items, about {format_size(full)} "
            f"({top.maxlen - top.length} more than when scanned). A buffer with a capacity, "
            "not a leak: the growth levels off there.",
            action=f"Nothing to fix if {format_size(full)} fits beside the step; to hold "
            "less, lower the capacity, or keep the items on the CPU and move each sampled "
            "batch to the device.",
            saving_bytes=None,
            severity="info",
        )
    moved = _OFF_DEVICE.search(top.code)
    if leak.device == "cpu" and moved is not None:  # the simulated device: `.cpu()` is a no-op
        return Advice(
            code="tensors-kept",
            title=f"`{top.name}` keeps tensors its line moves off the device: the simulated "
            "device's count, no leak",
            evidence=_growth(leak, saving=False)
            + held
            + f" Its line moves them off the device (`{moved[1]}`): "
            "on a GPU it frees the device; the simulated device runs on the CPU, where "
            f"`{moved[1]}` keeps the same tensor, so their bytes stay counted here.",
            action="Nothing to fix for the device; they still take host memory: keep only "
            "the last N (`collections.deque(maxlen=N)`), or none, if that matters.",
            saving_bytes=None,
            severity="info",
        )
    numbers = top.item_shape is not None and math.prod(top.item_shape) == 1
    stored = _stored(top)
    item = f"`{stored}.item()`" if numbers else f"`{stored}.detach().cpu()`"
    store = _store(top, item)
    saving = leak.grown_bytes
    rate = leak.growth_per_step
    if saving and top.bytes_per_step and rate and top.bytes_per_step < rate:  # a part of it
        saving = saving * top.bytes_per_step // rate
        growth = _growth(leak, saving=False) + (
            f" `{top.name}` grew by {format_size(top.bytes_per_step)} of each step's "
            f"{format_size(rate)}: fixing it saves about {format_size(saving)} of that."
        )
    return Advice(
        code="tensors-kept",
        title=f"`{top.name}` keeps device tensors across steps on {leak.device}",
        evidence=growth + held,
        action=f"Keep them off the device: {store}"
        + ("" if numbers else " (detaching alone keeps their bytes)")
        + "; or keep only the last N (`collections.deque(maxlen=N)`), or none.",
        saving_bytes=saving or top.tensor_bytes or None,
        severity="warning",
    )


_OFF_DEVICE = re.compile(
    r"(\.cpu\(\)|\.numpy\(\)|\.to\(\s*(?:device\s*=\s*)?"
    r"(?:['\"]cpu['\"]|torch\.device\(\s*['\"]cpu['\"]\s*\))[^()]*\))"
    r"(?:\.(?:detach|clone|float|double|half|contiguous)\(\)|\[[^\]]*\])*[\s)\],]*(?:#.*)?$"
)
"""A line whose stored expression ends by moving its tensor off the device (a no-op on the
simulated device, which is the CPU): ``features.append(out.detach().cpu())``, ``d[k] =
x.cpu()``; not ``hist.append((out.detach(), loss.item()))``, which keeps ``out``."""


def _stored(top: LeakSuspect) -> str:
    """The tensor ``top``'s line stores, when the line says it simply (``logits`` in
    ``history.append(logits.detach())``, ``loss`` in ``total += loss``), its moves and
    copies taken off; else ``x``."""
    name = re.escape(top.name.rsplit(".", 1)[-1])
    found = re.search(
        rf"{name}\s*(?:\.append\((?P<arg>.*)\)|\[[^\]]*\]\s*=(?!=)(?P<value>.*)|\+=(?P<sum>.*))",
        top.code.split("#", 1)[0].strip(),
    )
    if found is None:
        return "x"
    expr = next(g for g in found.groups() if g is not None).strip()
    if not re.fullmatch(r"[A-Za-z_][\w.]*(?:\([\w.\[\]:*\s-]*\))?(?:\.\w+\(\))*", expr):
        return "x"  # (a call of names is quoted: `torch.cat(policy.saved_log_probs)`)
    if expr in ("None", "True", "False"):  # (sweep CB: `None.detach().cpu()`)
        return "x"
    callee = expr.split("(", 1)[0].rsplit(".", 1)[-1]
    if "(" in expr and callee[:1].isupper():  # a class made there (a namedtuple Transition:
        return "x"  # `.detach()` on it raises: sweep CD)
    return re.sub(r"(?:\.(?:detach|clone|cpu)\(\))+$", "", expr) or "x"


def _store(top: LeakSuspect, item: str) -> str:
    """How ``top`` would store ``item`` instead: in a dict it fills, or appended."""
    if re.search(rf"{re.escape(top.name.rsplit('.', 1)[-1])}\s*\[[^\]]*\]\s*=(?!=)", top.code):
        return f"`{top.name}[key] = {item.strip('`')}`"
    return f"`{top.name}.append({item.strip('`')})`"


def _graph_retained(leak: LeakFinding, top: LeakSuspect, growth: str, names: str) -> Advice:
    """``graph-retained``: the fix fits what is kept. A state the next step builds on: detach
    it where each step begins. One-element tensors (losses): ``.item()``. Larger tensors (a
    batch of generated images): ``.detach()`` frees only the graph's saved tensors, their own
    bytes stay on the device unless moved with ``.cpu()``. The saving: what the fix frees of
    the growth measured (``.detach().cpu()``, all of it)."""
    rate = leak.growth_per_step
    own = ""
    x = _stored(top)
    if top.carried:  # a state the next step builds on: cut its graph at each step
        action = (
            f"Detach `{top.name}` where each step begins (`{top.name} = "
            + (
                f"tuple(h.detach() for h in {top.name})`"
                if top.kind == "container"
                else f"{top.name}.detach()`"
            )
            + ", as truncated backpropagation through time does), so backward stops at "
            "the step; `retain_graph=True` is then no longer needed."
        )
    elif top.kind != "container":
        scalar = top.item_shape is None or math.prod(top.item_shape) == 1
        fix = (
            f"`{top.name} += loss.item()` (or `loss.detach()`)"
            if scalar
            else f"`{top.name} += {x}.detach()` (its size stays; only the graph went on growing)"
        )
        action = f"Store numbers, not graphs: {fix}. Use `torch.no_grad()` for code that "
        action += "only logs."
    elif top.item_shape is None or math.prod(top.item_shape) == 1:  # losses kept in a list
        action = f"Store numbers, not graphs: {_store(top, f'`{x}.item()`')} (or `{x}.detach()`). "
        action += "Use `torch.no_grad()` for code that only logs."
    else:  # tensors of their own size: detaching keeps their bytes
        # (the scans' estimate of a list of tensors of varying sizes can pass the growth
        # measured: sweep CB's episodes' log-probs, "786 B of the 141 B")
        tensors = min(top.bytes_per_step, rate) if top.bytes_per_step else 0
        graph = max(0, rate - tensors) if tensors else None
        shape = format_shape(top.item_shape)
        own = (
            f" The tensors themselves (the last a {shape} one) are about {format_size(tensors)} "
            f"of the {format_size(rate)} it grew by per step."
            if tensors
            else ""
        )
        detach = (
            f"`{x}.detach()` alone frees only the graph's saved tensors"
            + (
                f" ({format_size(graph)} per step here"
                + (": backward had freed them already)" if graph == 0 else ")")
                if graph is not None
                else ""
            )
            + ", not the tensors' own bytes"
        )
        action = (
            f"Keep them without their graph and off {leak.device}: "
            f"{_store(top, f'`{x}.detach().cpu()`')} frees all of it; {detach}; or do not keep "
            "them. Use `torch.no_grad()` for code that only logs."
        )
    return Advice(
        code="graph-retained",
        title=f"`{top.name}` keeps an autograd graph alive across steps",
        evidence=growth
        + f" Still holding a graph at the end of a step: {names}"
        + (f"; line: `{top.code}`" if top.code else "")
        + ". Each step's graph (and whatever tensors it saved) stays alive."
        + own,
        action=action,
        saving_bytes=leak.grown_bytes or None,
        severity="critical",
    )
