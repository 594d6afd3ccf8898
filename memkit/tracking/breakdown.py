"""What allocated memory consisted of at the training peak (or at an OOM), and the evidence
read from the live model and optimizer for it.

Parameters, gradients and optimizer state are byte sums of the tracked objects' tensors on the
device (each storage once; under FSDP2 the rank's shards); all-gathered parameters are FSDP2's
unsharded parameters and all-gather buffers at the peak (memkit/tracking/fsdp.py); activations
are the growth since the step's forward began, less what was created of those since then;
other is the rest. The tracker runs this off the
hot path: when a phase ends or a forward returns after a new peak (``DeviceRecord.pending``).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import astuple
from typing import Any

import torch

from memkit.simulated.accountant import storage_of
from memkit.tracking.fsdp import FsdpUnits
from memkit.tracking.phases import BACKWARD, FORWARD, OPTIMIZER, forward_autocast
from memkit.tracking.records import DeviceRecord
from memkit.tracking.report import PHASES, Breakdown, TrainingSetup

__all__ = [
    "breakdown",
    "forward_autocast",
    "gradient_witness",
    "param_dtype",
    "persistent_bytes",
    "state_tensors",
    "training_setup",
]

_STATE_DEPTH = 3
"""How deep :func:`state_tensors` looks into lists, tuples and dicts of an optimizer's state."""


def param_dtype(modules: Iterable[torch.nn.Module]) -> str | None:
    """The dtype holding most bytes of the modules' trainable floating parameters."""
    sizes: dict[str, int] = {}
    for mod in modules:
        for p in mod.parameters():
            if p.requires_grad and p.is_floating_point():
                key = str(p.dtype).replace("torch.", "")
                sizes[key] = sizes.get(key, 0) + int(p.numel() * p.element_size())
    return max(sizes, key=lambda k: sizes[k]) if sizes else None


def training_setup(
    modules: Sequence[torch.nn.Module], optimizers: Sequence[Any]
) -> TrainingSetup | None:
    """The model's and optimizer's facts the advice reads (``None`` when neither exists)."""
    if not modules and not optimizers:
        return None
    history = None
    if optimizers:
        group = optimizers[0].param_groups[0] if optimizers[0].param_groups else {}
        size = group.get("history_size")
        history = size if isinstance(size, int) else None
    autocast = next((d for m in modules if (d := forward_autocast(m)) is not None), None)
    return TrainingSetup(
        param_dtype=param_dtype(modules),
        optimizer=type(optimizers[0]).__name__ if optimizers else None,
        history_size=history,
        forward_autocast=autocast,
    )


def _merged(old: TrainingSetup | None, new: TrainingSetup | None) -> TrainingSetup | None:
    """``new``, with what it could not read (the model or optimizer gone) kept from ``old``."""
    if old is None or new is None:
        return new or old
    return TrainingSetup(
        *(b if b is not None else a for a, b in zip(astuple(old), astuple(new), strict=True))
    )


def state_tensors(value: Any, depth: int = _STATE_DEPTH) -> list[torch.Tensor]:
    """The tensors of one optimizer state entry: the value itself, or inside lists, tuples and
    dicts (LBFGS keeps its history as lists: ``old_dirs``, ``old_stps``)."""
    if isinstance(value, torch.Tensor):
        return [value]
    if depth <= 0:
        return []
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in state_tensors(v, depth - 1)]
    return []


def gradient_witness(
    modules: Iterable[torch.nn.Module], optimizers: Iterable[Any]
) -> torch.Tensor | None:
    """A trainable parameter whose ``.grad`` tells whether gradients are allocated now (all
    of a model's gradients come and go together: backward creates them, ``zero_grad`` frees
    them). An optimizer's first: a module seen first may be one that never trains (a
    distillation teacher in eval mode whose parameters still require grad)."""
    for opt in optimizers:
        for group in opt.param_groups:
            for p in group["params"]:
                if p.requires_grad:
                    return p
    for mod in modules:
        for p in mod.parameters():
            if p.requires_grad:
                return p
    return None


def persistent_bytes(
    dev: DeviceRecord,
    modules: Sequence[torch.nn.Module],
    optimizers: Sequence[Any],
    model: torch.nn.Module | None,
    primary: bool,
    fsdp: FsdpUnits | None = None,
) -> tuple[int, int, int]:
    """Bytes of parameters (and buffers), gradients and optimizer state on ``dev``.

    Each storage counts once (tied weights, views); ``model`` is the tracked model (a
    DataParallel one's replicas count on the devices other than the ``primary`` one).
    Optimizer state is every tensor in ``optimizer.state``, also inside lists, tuples and
    dicts. Under FSDP2 (``fsdp``) the parameters are the rank's shards, whatever the modules
    hold now: their unsharded parameters are all-gathered ones, counted apart. While the
    objects are alive this also records ``dev.setup`` (:func:`training_setup`), which the
    report and the OOM post-mortem carry.
    """
    target = dev.backend.device
    holds = getattr(dev.backend, "holds", None)
    seen: set[tuple[int, int]] = set()

    def size(t: torch.Tensor) -> int:
        if holds is not None:
            if not holds(t):
                return 0
        elif t.device.type != target.type or (
            target.index is not None and t.device.index not in (None, target.index)
        ):
            return 0
        storage = storage_of(t)
        if storage is None:
            return 0
        key = (storage.data_ptr(), storage.nbytes())
        if key in seen or storage.nbytes() == 0:
            return 0
        seen.add(key)
        return int(storage.nbytes())

    if fsdp is not None:  # unsharded storages (allocated now) are not this rank's parameters
        seen.update((s.data_ptr(), s.nbytes()) for s in fsdp.unsharded_storages())
    params = grads = state = 0
    all_params: list[torch.Tensor] = [] if fsdp is None else fsdp.sharded_params()
    for mod in modules:
        all_params.extend(mod.parameters())
        for b in mod.buffers():
            params += size(b)
    for opt in optimizers:
        for group in opt.param_groups:
            all_params.extend(group["params"])
    for p in all_params:
        params += size(p)
    for p in all_params:
        if p.grad is not None:
            grads += size(p.grad)
    for opt in optimizers:
        for st in opt.state.values():
            for t in state_tensors(st):
                state += size(t)
    if modules or optimizers:
        dev.setup = _merged(dev.setup, training_setup(modules, optimizers))
    if params == 0 and not all_params:  # the model is gone: what was last seen
        params = dev.params_full
    if params == 0 and isinstance(model, torch.nn.DataParallel) and not primary:
        # replicas on the other devices: broadcast copies of the weights for each forward
        params = sum(int(p.numel() * p.element_size()) for p in model.parameters())
    return params, grads, state


def breakdown(
    dev: DeviceRecord,
    persistent: tuple[int, int, int],
    total: int,
    step: int | None,
    phase: int,
    module: str | None,
    base: int | None,
    grads_none: bool,
    state_empty: bool,
    grads_none_now: bool,
    state_empty_now: bool,
    gathered: int = 0,
    gathered_base: int = 0,
) -> Breakdown:
    """``total`` allocated bytes of ``dev`` by category, at a moment of phase ``phase``.

    ``persistent``: :func:`persistent_bytes` now; ``base``: allocated bytes when the step's
    forward began (``None``: unknown, no activations); ``grads_none``/``state_empty``: whether
    gradients and optimizer state were absent then, ``*_now``: whether they are now;
    ``gathered``/``gathered_base``: FSDP2's all-gathered bytes at the moment and when the
    forward began.
    """
    params, grads_now, state_now = persistent
    # sizes of full gradients / state, remembered: they may be freed (zero_grad with
    # set_to_none) between the peak and this computation
    dev.grads_full = max(dev.grads_full, grads_now)
    dev.state_full = max(dev.state_full, state_now)
    grads_known = grads_now or dev.grads_full
    state_known = state_now or dev.state_full
    # in backward, gradients are created progressively: as of the end of it, capped below.
    # In forward they can only disappear (zero_grad after the loss): present at the peak
    # if present when the forward began.
    if phase == FORWARD:
        grads_none_now = grads_none_now and grads_none
    grads = grads_now if phase == BACKWARD else 0 if grads_none_now else grads_known
    state = 0 if state_empty_now else state_known
    note = None
    gathered = max(0, min(gathered, total - params - state))
    rest = total - params - grads - state - gathered
    if rest < 0:
        # gradients are counted when the phase ended; in backward they grow after the peak
        grads = max(0, grads + rest)
        rest = max(0, total - params - grads - state)
        note = "gradients counted at the end of the phase, capped to fit the total"
    if base is None:
        acts, other = 0, rest
    else:
        grads_base = 0 if grads_none else grads_known
        state_base = 0 if state_empty else state_known
        other = max(0, base - params - grads_base - state_base - gathered_base)
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
        step=step,
        phase=PHASES[phase],
        module=module,
        note=note,
        gathered_parameters=gathered,
    )
