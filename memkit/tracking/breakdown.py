"""What allocated memory consisted of at the training peak (or at an OOM): a pure function of
the moment's readings and the persistent memory measured for it.

Parameters, gradients and optimizer state are byte sums of the tracked objects' tensors on the
device (each storage once; under FSDP2 the rank's shards), measured while the objects are alive
(:meth:`memkit.tracking.evidence.Evidence.persistent`); all-gathered parameters are FSDP2's
unsharded parameters and all-gather buffers at the peak (memkit/tracking/fsdp.py); gradient
buckets are DDP's (memkit/tracking/ddp.py: on the device since the model was wrapped); activations
are the growth since the step's forward began, less what was created of those since then;
other is the rest. The tracker categorises off the hot path: when a phase ends or a forward
returns after a new peak (``DeviceRecord.pending``). No torch here.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import NamedTuple

from memkit.tracking.report import PHASES, Breakdown
from memkit.tracking.state import BACKWARD, FORWARD, OPTIMIZER

__all__ = ["PeakMoment", "Persistent", "breakdown"]


class Persistent(NamedTuple):
    """Bytes of parameters (and buffers), gradients, optimizer state and DDP's gradient
    buckets (those not counted as gradients) on one device; ``trainable``: of the
    parameters, those that require grad (what their gradients take, allocated or not)."""

    parameters: int
    gradients: int
    optimizer_state: int
    buckets: int = 0
    trainable: int = 0


class PeakMoment(NamedTuple):
    """One moment of a device to categorise: its allocated bytes, where it was, and what the
    step's forward began with.

    Attributes:
        total: allocated bytes.
        step, phase, module: the step, the phase (an index into ``PHASES``) and the module key
            (``None``: outside any module).
        base: allocated bytes when the step's forward began (``None``: unknown, no
            activations).
        grads_none, state_empty: whether gradients and optimizer state were absent then.
        grads_none_now, state_empty_now: whether they were absent at the moment.
        gathered, gathered_base: FSDP2's all-gathered bytes at the moment and when the forward
            began.
        alive, alive_base: the gradient witnesses' flags (one per optimizer: whether its
            gradients were allocated) at the moment, for a forward's (as of the last mark before
            it: the forward's start, a model's forward beginning or returning; ``()`` where
            not read), and when the forward began: the keys of the gradient bytes
            :func:`breakdown` is given.
        input_shape: the last model forward's first tensor input then.
        released: bytes ``base`` held of the last step's outputs (a loop's ``logits``, rebound
            when the forward returns) freed since: not held at a moment in backward or the
            optimizer, so not "other" there (sweep BI).
    """

    total: int
    step: int | None
    phase: int
    module: str | None
    base: int | None
    grads_none: bool
    state_empty: bool
    grads_none_now: bool
    state_empty_now: bool
    gathered: int = 0
    gathered_base: int = 0
    alive: tuple[bool, ...] = ()
    alive_base: tuple[bool, ...] = ()
    released: int = 0
    input_shape: tuple[int, ...] | None = None


def breakdown(
    moment: PeakMoment,
    now: Persistent,
    remembered: Persistent,
    sizes: Mapping[tuple[bool, ...], int] | None = None,
) -> Breakdown:
    """``moment``'s allocated bytes by category.

    ``now``: the persistent memory measured for it (after the moment: when the phase ended, or
    at the OOM); ``remembered``: the largest gradients and optimizer state seen before, which
    stand in for ones freed since the moment (``zero_grad`` with ``set_to_none`` between the
    peak and the measurement); ``sizes``: the gradient bytes last measured with each set of
    witness flags, which give the gradients at a forward's peak (``moment.alive``) and when
    the forward began (``moment.alive_base``) where known: several optimizers free theirs at
    different times (a GAN's critic's ``zero_grad`` after its forward's peak, before its
    backward), so those alive then may be more than the measurement finds and fewer than the
    largest seen.

    >>> m = PeakMoment(1000, 0, FORWARD, None, 400, False, False, False, False)
    >>> b = breakdown(m, Persistent(100, 100, 200), Persistent(0, 0, 0))
    >>> b.parameters, b.gradients, b.optimizer_state, b.activations, b.other
    (100, 100, 200, 600, 0)
    """
    total, phase = moment.total, moment.phase
    params, grads_now, state_now = now.parameters, now.gradients, now.optimizer_state
    grads_known = grads_now or remembered.gradients
    state_known = state_now or remembered.optimizer_state
    # in backward, gradients are created progressively: as of the end of it, capped below.
    # In forward they can only disappear (zero_grad after the loss): present at the peak
    # if present when the forward began.
    grads_none_now = moment.grads_none_now
    if phase == FORWARD:
        grads_none_now = grads_none_now and moment.grads_none
    grads = grads_now if phase == BACKWARD else 0 if grads_none_now else grads_known
    at_peak = _gradients(moment.alive, sizes) if phase == FORWARD else None
    at_base = _gradients(moment.alive_base, sizes)
    if at_peak is not None:  # never more than the forward began with
        grads = at_peak if at_base is None else min(at_peak, at_base)
    state = 0 if moment.state_empty_now else state_known
    note = None
    gathered = max(0, min(moment.gathered, total - params - state))
    # DDP's buckets: allocated when the model was wrapped, before any forward
    buckets = max(0, min(now.buckets, total - params - state - gathered))
    rest = total - params - grads - state - gathered - buckets
    if rest < 0:
        # gradients are counted when the phase ended; in backward they grow after the peak
        grads = max(0, grads + rest)
        rest = max(0, total - params - grads - state - gathered - buckets)
        note = "gradients counted at the end of the phase, capped to fit the total"
    if moment.base is None:
        acts, other = 0, rest
    else:
        grads_base = at_base if at_base is not None else 0 if moment.grads_none else grads_known
        state_base = 0 if moment.state_empty else state_known
        held = params + grads_base + state_base + moment.gathered_base + buckets
        other = max(0, moment.base - moment.released - held)
        acts = max(0, rest - other)
        other = rest - acts
    if phase == BACKWARD and grads:
        note = (note + "; " if note else "") + (
            "gradients as of the end of backward: at a peak inside backward only those of the "
            "layers backward had reached existed (none kept from before if zero_grad ran "
            "before backward), so gradients may be overstated and activations understated by "
            "as much"
        )
    if phase == OPTIMIZER and acts:
        note = (note + "; " if note else "") + (
            "in the optimizer phase, activations are the optimizer's temporaries and any "
            "activations still alive"
        )
    return Breakdown(
        total=total,
        parameters=params,
        gradients=grads,
        optimizer_state=state,
        activations=acts,
        other=other,
        step=moment.step,
        phase=PHASES[phase],
        module=moment.module,
        note=note,
        gathered_parameters=gathered,
        gradient_buckets=buckets,
        input_shape=moment.input_shape,
    )


def _gradients(flags: tuple[bool, ...], sizes: Mapping[tuple[bool, ...], int] | None) -> int | None:
    """The gradient bytes the witness ``flags`` stand for (``None``: not known)."""
    if not flags or sizes is None:
        return None
    return sizes.get(flags) if any(flags) else 0
