"""The OOM post-mortem: where an out-of-memory error that left the tracked block happened, what
memory held, the modules that kept the most, any growth seen before, and the advice.

Built once, in ``Tracker.__exit__``, from the tracker's records: the place of the failing call
(the forward post hook that saw the exception records it), else the phase running then.
"""

from __future__ import annotations

from collections.abc import Callable
from types import TracebackType

from memkit.advice.oom import oom_advice
from memkit.distributed import launched_rank
from memkit.oom import find_oom, oom_source, parse_oom_message
from memkit.tracking.leaks import LeakWatch
from memkit.tracking.records import DeviceRecord, current_leak
from memkit.tracking.report import PHASES, Breakdown, ModuleRecord, OomPostMortem

__all__ = ["Place", "build_postmortem", "failing_call"]

Place = tuple[DeviceRecord, int, int, "str | None"]
"""Where memory ran out: the device's records, the phase (an index into PHASES), the step and
the module key (``None`` outside any module)."""

FailedCall = tuple[int, DeviceRecord, int, int, "str | None"]
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


def own_kept(m: ModuleRecord) -> int:
    """What ``m`` itself (not its child modules) kept per step: a leaf's per-step sum; a
    parent's own bytes per call times its calls per step (an attention module that keeps its
    score matrices while its Dropout child keeps the mask)."""
    if m.leaf:
        return m.activation_bytes_per_step or m.self_activation_bytes
    per_step, per_call = m.activation_bytes_per_step or 0, m.activation_bytes
    calls = round(per_step / per_call) if per_step > 0 and per_call > 0 else 1
    return m.self_activation_bytes * max(1, calls)


def top_activation_modules(records: list[ModuleRecord], n: int = 5) -> tuple[tuple[str, int], ...]:
    """``(path, bytes)`` of the ``n`` modules that kept the most activation memory themselves
    (:func:`own_kept`: leaves and parents alike, never a parent's children counted twice)."""
    top = sorted(records, key=own_kept, reverse=True)
    return tuple((m.path, own_kept(m)) for m in top if own_kept(m) > 0)[:n]


def build_postmortem(
    exc: BaseException,
    tb: TracebackType | None,
    *,
    place: Place,
    devices: dict[int, DeviceRecord] | None,
    display: Callable[[str | None], str | None],
    categorise: Callable[[DeviceRecord, int, int, int, str | None], Breakdown],
    module_records: Callable[[DeviceRecord], list[ModuleRecord]],
    leak_watch: LeakWatch,
    last_root: tuple[bool, bool] | None,
    last_input: tuple[int, ...] | None,
) -> OomPostMortem:
    """The post-mortem of ``exc`` (an OOM, or an exception whose chain holds one).

    Args:
        exc, tb: the exception leaving the block and its traceback.
        place: where it happened (:func:`failing_call`, else the phase running).
        devices: the device records by index, where the message's device index picks one
            (several devices tracked); ``None``: one device.
        display: module keys as reports show them.
        categorise: ``(dev, allocated, step, phase, module) -> Breakdown``.
        module_records: a device's per-module records.
        leak_watch: the tracker's leak search (a last scan at the failure).
        last_root: ``(training, grad_enabled)`` of the last forward of the model.
        last_input: the shape of the last forward's first tensor input.
    """
    oom = find_oom(exc) or exc
    details = parse_oom_message(oom)
    dev, phase, step, key = place
    module = display(key)
    stat = None if key is None else dev.modules.get(key)
    if details.device_index is not None and devices is not None:
        dev = devices.get(details.device_index, dev)
    # the last reading came before the failing op; what was in use when it failed is larger
    # when that op's inputs were made since: exact from the simulated device, else from the
    # message (rounded to its two decimals)
    accountant = getattr(dev.backend, "accountant", None)
    at_oom = getattr(accountant, "in_use_at_oom", None)
    a = max(dev.last[0], at_oom if at_oom is not None else details.allocated_by_pytorch or 0)
    breakdown = categorise(dev, a, step, phase, module)
    cap = dev.backend.capacity()
    capacity = details.capacity if details.capacity is not None else cap.total
    free = details.free if details.free is not None else cap.free
    leak = current_leak(dev)  # growth that had stopped did not run out
    if leak is not None:
        leak = leak_watch.suspects_at_failure(leak, tb)
        dev.leak = leak
    training, grad_enabled = last_root if last_root else (None, None)
    first_line = str(oom).strip().splitlines()[0] if str(oom).strip() else ""
    pm = OomPostMortem(
        device=dev.key,
        step=step,
        phase=PHASES[phase],
        module=module,
        training=training,
        grad_enabled=grad_enabled,
        exception=f"{type(oom).__name__}: {first_line}",
        source=oom_source(oom),
        tried_to_allocate=details.tried_to_allocate,
        capacity=capacity,
        free=free,
        allocated=a,
        breakdown=breakdown,
        top_modules=top_activation_modules(module_records(dev)),
        leak=leak,
        advice=(),
        rank=launched_rank(),
        input_shape=last_input,
        module_type=None if stat is None else stat.type_name,
        micro_batches=max((s.backward_passes for s in dev.steps), default=1),
        setup=dev.setup,
    )
    advice = oom_advice(pm, details.reserved_unallocated, details=details)
    return OomPostMortem(**{**pm.__dict__, "advice": tuple(advice)})
