"""The OOM post-mortem: where an out-of-memory error that left the tracked block happened, what
memory held, the modules that kept the most, any growth seen before, and the advice.

A pure function of values: the tracker reads its records and the live objects once, in
``Tracker.__exit__``, into an :class:`OomEvidence` (the place of the failing call, which the
forward post hook that saw the exception records, else the phase running then), and
:func:`build_postmortem` turns it and the exception's message into the
:class:`~memkit.tracking.report.OomPostMortem`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from memkit.advice.oom import oom_advice
from memkit.oom import OomDetails, find_oom, oom_source, parse_oom_message
from memkit.tracking.breakdown import PeakMoment, Persistent, breakdown
from memkit.tracking.records import DeviceRecord
from memkit.tracking.report import (
    PHASES,
    LeakFinding,
    ModuleRecord,
    OomPostMortem,
    TrainingSetup,
    made_outside,
)

__all__ = [
    "FailedCall",
    "OomEvidence",
    "Place",
    "build_postmortem",
    "failing_call",
    "oom_device_index",
    "top_activation_modules",
]

Place = tuple[DeviceRecord, int, int, "str | None", "int | None"]
"""Where memory ran out: the device's records, the phase (an index into PHASES), the step, the
module key (``None`` outside any module) and, in an evaluation pass, the bytes allocated when
that pass began (``None`` elsewhere: a training forward's base is its step's)."""

FailedCall = tuple[int, DeviceRecord, int, int, "str | None", "int | None"]
"""What the forward post hook records when a module's forward raises: ``id`` of the exception,
then the :data:`Place`."""


def failing_call(exc: BaseException, fail: FailedCall | None) -> Place | None:
    """The place of the module call that raised ``exc``, if the hooks recorded it (``exc``, or an
    exception in its cause/context chain, is the one they saw)."""
    if fail is None:
        return None
    chain_ids: set[int] = set()
    e: BaseException | None = exc
    while e is not None and len(chain_ids) < 64:
        chain_ids.add(id(e))
        e = e.__cause__ or e.__context__
    return fail[1:] if fail[0] in chain_ids else None


def oom_device_index(exc: BaseException) -> int | None:
    """The device index the OOM's message names (``None``: it names none)."""
    return parse_oom_message(find_oom(exc) or exc).device_index


@dataclass(frozen=True)
class OomEvidence:
    """What the tracker read for the post-mortem when the OOM left the block.

    Attributes:
        device: the device that ran out (the message's, else the failing call's).
        step: the step it happened in.
        moment: the failing call's step, phase and module (as reports name it), with its
            device's readings (``total``: the last allocated bytes read, before the failing op).
        module_type: the failing module's class name, if known.
        at_oom: the bytes in use when the failing op ran, where the device knows them (the
            simulated device).
        capacity, free: the device's, read then (the message's win when it has them).
        persistent: the persistent memory measured then; ``remembered``: the largest seen.
        modules: the device's module records.
        leak: growth that was still going on, with its suspects.
        last_root: ``(training, grad_enabled)`` of the last forward of the model.
        last_input: the shape of the last forward's first tensor input.
        frozen_model: ``(name, parameter bytes, updated in place, bf16 saving)`` when that
            forward was an evaluation pass of a model no optimizer trains.
        micro_batches: the most backward passes one step used.
        setup: the model's and optimizer's facts.
        rank: the process's rank under torchrun.
        autocast_forwards: training forwards run under ``torch.autocast`` so far.
        after_backward: a backward ran since the last optimizer step (an OOM outside the
            model between them: gradient clipping, SAM's perturbation, ``unscale_``).
        batch_bytes: the bytes of the last training forward's first input (in an evaluation
            pass, its own), if it is alive.
        node: the autograd node that ran out inside a backward, where the device knows it
            (the simulated one).
        appended_losses: containers the script grows with losses that keep their graphs
            (:func:`~memkit.tracking.leaks.appended_losses`), where no leak was found.
        op_inputs: the bytes of the failing op's inputs, parameters left out, where the
            device knows them (the simulated one).
    """

    device: str
    step: int
    moment: PeakMoment
    module_type: str | None
    at_oom: int | None
    capacity: int | None
    free: int | None
    persistent: Persistent
    remembered: Persistent
    modules: tuple[ModuleRecord, ...]
    leak: LeakFinding | None
    last_root: tuple[bool, bool] | None
    last_input: tuple[int, ...] | None
    frozen_model: tuple[str, int, bool, int] | None
    micro_batches: int
    setup: TrainingSetup | None
    rank: int | None
    autocast_forwards: int = 0
    batch_bytes: int = 0
    after_backward: bool = False
    cap_raised: bool = False  # a budget below kept segments: the CUDA cap was set above it
    node: str | None = None
    appended_losses: tuple[str, ...] = ()
    op_inputs: int | None = None


def own_kept(m: ModuleRecord) -> int:
    """What ``m`` itself (not its child modules) kept per step: a leaf's per-step sum; a
    parent's own bytes per call times its calls per step (an attention module that keeps its
    score matrices while its Dropout child keeps the mask)."""
    if m.leaf:
        return m.activation_bytes_per_step or m.self_activation_bytes
    per_step, per_call = m.activation_bytes_per_step or 0, m.activation_bytes
    calls = round(per_step / per_call) if per_step > 0 and per_call > 0 else 1
    return m.self_activation_bytes * max(1, calls)


def top_activation_modules(
    records: Sequence[ModuleRecord], n: int = 5
) -> tuple[tuple[str, int], ...]:
    """``(path, bytes)`` of the ``n`` modules that kept the most activation memory themselves
    (:func:`own_kept`: leaves and parents alike, never a parent's children counted twice)."""
    top = sorted(records, key=own_kept, reverse=True)
    return tuple((m.path, own_kept(m)) for m in top if own_kept(m) > 0)[:n]


def _checkpointed(
    modules: Sequence[ModuleRecord],
) -> tuple[tuple[str, ...], Callable[[str], bool]]:
    """The outermost modules recomputed in backward (activation checkpointing already runs
    there), and whether a path lies inside one of them: what such a module "kept" at its
    forward's end is freed when the block ends (only the block's input is saved)."""
    recomputed = [m.path for m in modules if m.recompute_calls]
    blocks = set(recomputed)
    # checkpoint(model, x): the one tracked model's own row (its class name) holds every other
    # row, though their paths carry no prefix of it
    root = next(
        (
            m.path
            for m in modules
            if m.recompute_calls
            and m.path == m.type_name
            and not any(o.path.startswith(m.path + ".") for o in modules)
        ),
        None,
    )
    if root is not None:
        return (root,), lambda path: path != root

    def inside(path: str) -> bool:
        return any(path.startswith(block + ".") for block in blocks)

    return tuple(p for p in recomputed if not inside(p)), inside


def build_postmortem(exc: BaseException, evidence: OomEvidence) -> OomPostMortem:
    """The post-mortem of ``exc`` (an OOM, or an exception whose chain holds one)."""
    oom = find_oom(exc) or exc
    details = parse_oom_message(oom)
    moment = evidence.moment
    # the last reading came before the failing op; what was in use when it failed is larger
    # when that op's inputs were made since: exact from the simulated device, else from the
    # message (rounded to its two decimals)
    at_oom = evidence.at_oom
    a = max(moment.total, at_oom if at_oom is not None else details.allocated_by_pytorch or 0)
    parts = breakdown(moment._replace(total=a), evidence.persistent, evidence.remembered)
    training, grad_enabled = evidence.last_root if evidence.last_root else (None, None)
    first_line = str(oom).strip().splitlines()[0] if str(oom).strip() else ""
    checkpointed, inside = _checkpointed(evidence.modules)
    capacity, free = _capacity_and_free(
        details, evidence.capacity, evidence.free, evidence.cap_raised
    )
    pm = OomPostMortem(
        device=evidence.device,
        step=evidence.step,
        phase=PHASES[moment.phase],
        module=_in_frozen_model(moment.module, evidence.frozen_model),
        training=training,
        grad_enabled=grad_enabled,
        exception=f"{type(oom).__name__}: {first_line}",
        source=oom_source(oom),
        tried_to_allocate=details.tried_to_allocate,
        capacity=capacity,
        free=free,
        allocated=a,
        breakdown=parts,
        top_modules=top_activation_modules([m for m in evidence.modules if not inside(m.path)]),
        made_outside=made_outside(
            parts.activations, PHASES[moment.phase], moment.module, evidence.modules
        )
        if parts is not None
        else None,
        leak=evidence.leak,
        advice=(),
        rank=evidence.rank,
        input_shape=evidence.last_input,
        module_type=evidence.module_type,
        micro_batches=evidence.micro_batches,
        setup=evidence.setup,
        checkpointed=checkpointed,
        frozen_model=evidence.frozen_model,
        autocast_forwards=evidence.autocast_forwards,
        after_backward=evidence.after_backward,
        # the first optimizer step (no state when the step began) was creating it
        optimizer_state_partial=(
            PHASES[moment.phase] == "optimizer"
            and moment.state_empty
            and parts is not None
            and parts.optimizer_state > 0
        ),
        batch_bytes=evidence.batch_bytes,
        node=evidence.node if PHASES[moment.phase] == "backward" else None,
        appended_losses=evidence.appended_losses,
        op_input_bytes=evidence.op_inputs,
    )
    advice = oom_advice(pm, details.reserved_unallocated, details=details)
    return OomPostMortem(**{**pm.__dict__, "advice": tuple(advice)})


def _in_frozen_model(module: str | None, frozen: tuple[str, int, bool, int] | None) -> str | None:
    """``module``'s name with the frozen model's in front, where the failing pass was a frozen
    model's (a teacher run before any trained model was seen is the one model known, so its
    modules' keys come bare: ``net.1``, named ``Teacher.net.1`` once the student runs)."""
    if module is None or frozen is None:
        return module
    name = frozen[0]
    return module if module == name or module.startswith(name + ".") else f"{name}.{module}"


def _capacity_and_free(
    details: OomDetails, capacity: int | None, free: int | None, cap_raised: bool = False
) -> tuple[int | None, int | None]:
    """The capacity and free memory the post-mortem states: under a cap
    (``set_per_process_memory_fraction``: the message's "N allowed") the cap and what the
    allocator may still reserve below it, not the whole card's; else the message's, else the
    device's own readings. Where the cap was raised above the budget (segments live tensors
    kept), the budget and what it leaves beside the allocated tensors. The device's own
    capacity where the message's is that one rounded (a simulated device's budget)."""
    if cap_raised and capacity is not None:
        return capacity, max(0, capacity - (details.allocated_by_pytorch or 0))
    if details.allowed is not None:
        held = details.reserved_total or details.allocated_by_pytorch or 0
        return details.allowed, max(0, details.allowed - held)
    said = details.capacity
    if said is None or (capacity is not None and abs(said - capacity) <= said / 200):
        said = capacity  # (the device's own reading is exact; the message rounds it)
    return said, details.free if details.free is not None else free
