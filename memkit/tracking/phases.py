"""The phase and pass state machine: which phase runs (forward, backward, optimizer, other,
eval), what a root forward is (a training pass, an evaluation pass, a checkpointed forward
recomputed in backward), and where steps end (the step rules).

:class:`PhaseMachine` is a part of :class:`~memkit.tracking.tracker.Tracker` (a base class,
not an object of its own): the hooks read ``_phase`` and ``_step`` on every call, and an extra
object between them would cost an attribute lookup per hook. Transitions and boundaries run
under the tracker's lock, at most a few times per step, never per module.
"""

from __future__ import annotations

import math
import sys
import threading
import time
import weakref
from typing import TYPE_CHECKING, Any

import torch

from memkit.devices import SimulatedBackend
from memkit.tracking import leaks
from memkit.tracking.fsdp import FsdpUnits, find_fsdp_units, user_class_name
from memkit.tracking.records import (
    DeviceRecord,
    Frame,
    RootInfo,
    RunFacts,
    close_step,
    merge_steps,
)
from memkit.tracking.report import PHASES, StepRecord

__all__ = [
    "BACKWARD",
    "EVAL",
    "EVAL_PASS",
    "FORWARD",
    "OPTIMIZER",
    "OTHER",
    "RECOMPUTE",
    "TRAIN_PASS",
    "PhaseMachine",
    "forward_autocast",
    "is_compiled",
]

FORWARD, BACKWARD, OPTIMIZER, OTHER, EVAL = range(5)
"""Phases, as indices into :data:`~memkit.tracking.report.PHASES`."""

TRAIN_PASS, EVAL_PASS, RECOMPUTE = range(3)
"""What a root forward is: a training forward (builds a graph for backward), an evaluation
pass (``no_grad``/``inference_mode``, eval mode, or nothing that could build a graph), or the
recomputation of a checkpointed forward inside backward."""


class PhaseMachine:
    """Phase transitions, root forwards, step boundaries and evaluation windows."""

    # the tracker's state this part reads and writes (set in Tracker.__init__)
    optimizers: list[torch.optim.Optimizer]
    _active: bool
    _lock: threading.RLock
    _devices: dict[Any, DeviceRecord]
    _primary: DeviceRecord | None
    _kind: str
    _phase: int
    _step: int
    _t0: float
    _step_t0: float
    _sim: SimulatedBackend | None
    _fsdp: FsdpUnits | None
    _facts: RunFacts
    _manual_steps: bool
    _trained: bool
    _eval_return: int
    _eval_hold: int
    _last_root: tuple[bool, bool] | None
    _backward_steps: int
    _backwards_in_step: int
    _backwards_at_optimizer: int
    _micro_batches: int
    _seen_optimizers: dict[int, weakref.ref[Any]]
    _leak_warmup: int
    _leak_window: int
    _leak_watch: leaks.LeakWatch
    _roots: dict[int, RootInfo]
    _owners: dict[int, RootInfo]
    _grad_witness: weakref.ref[torch.Tensor] | None
    _compiled: bool
    model: torch.nn.Module | None
    notes: list[str]

    if TYPE_CHECKING:  # defined by the other parts of Tracker

        def _close(self, dev: DeviceRecord, p: int, pr: int, owner: str | None) -> None: ...
        def _resolve_pending(self, dev: DeviceRecord) -> None: ...
        def _grads_none(self) -> bool: ...
        def _state_empty(self) -> bool: ...
        def _capture_evidence(self) -> None: ...
        def _persistent(self, dev: DeviceRecord) -> tuple[int, int, int]: ...
        def _find_grad_witness(self) -> weakref.ref[torch.Tensor] | None: ...
        def root_modules(self) -> list[torch.nn.Module]: ...
        def _schedule_detail(self) -> None: ...
        def _set_detail(self, on: bool, *, force: bool = False) -> None: ...

    def _root_pre(self, module: torch.nn.Module, args: Any, root: RootInfo | None) -> int:
        """A forward of the model begins: which pass it is, and the phase it starts."""
        if self._phase == BACKWARD:  # a checkpointed forward recomputed inside backward
            return RECOMPUTE
        if root is None:
            root = self._root_info(module)
        grad = torch.is_grad_enabled()
        self._last_root = (module.training, grad)
        facts = self._facts
        facts.last_input = shape = _input_shape(args)
        sim = self._sim
        if not grad or not module.training or not (root.trainable or _needs_grad(args)):
            kind = EVAL_PASS
            facts.eval_forwards += 1
            if shape is not None and (
                facts.eval_input is None or math.prod(shape) > math.prod(facts.eval_input)
            ):
                facts.eval_input = shape
            if self._phase != EVAL:
                with self._lock:
                    if self._phase != EVAL:
                        self._eval_return = self._phase
                        self._transition(EVAL)
        else:
            kind = TRAIN_PASS
            # advice: mixed-precision. An autocast wrapping the model's forward itself
            # (accelerate's mixed precision) is entered after this hook: read the wrapper
            if _autocast_on(self._kind) or forward_autocast(module) is not None:
                facts.autocast_forwards += 1
            if self._phase != FORWARD:
                with self._lock:
                    if self._phase != FORWARD:
                        if self._backwards_in_step and self._step_rule() == "backward":
                            # no optimizer steps: a new training forward after a backward
                            # begins the next step
                            self._boundary(sys._getframe(1))
                            self._backward_steps += 1
                        self._transition(FORWARD)
                        if not self._trained:  # from now on the breakdown is training's
                            self._trained = True
                            for dev in self._devices.values():
                                dev.train_peak, dev.pending, dev.breakdown = 0, None, None
                        # advice: zero-grad-keeps-grads (a step's first forward, from step 1
                        # on; not while steps are counted from backward passes, where the next
                        # micro-batch's forward rightly finds the accumulating gradients)
                        if self._step > facts.grads_checked_step and self._seen_optimizers:
                            facts.grads_checked_step = self._step
                            if not self._grads_none():
                                facts.grads_steps += 1
        if sim is not None:  # the batch reaches the model: it is on the device now
            sim.count_ops(True, True)
            sim.track(args)
        return kind

    def _root_post(self, frame: Frame, delta: int, dev: DeviceRecord) -> None:
        """The model's forward returned."""
        if frame.eval_grad:
            facts = self._facts
            facts.eval_grad += 1
            if delta > facts.eval_grad_bytes:
                facts.eval_grad_bytes = delta
        if dev.pending is not None:  # a new peak in this forward: categorise it now
            with self._lock:
                self._resolve_pending(dev)
        if frame.kind == EVAL_PASS:
            if self._eval_hold:  # a framework's evaluation loop: the rest of it is eval too
                if self._sim is not None:
                    self._sim.count_ops(True, False)
            elif self._phase == EVAL and not self._between_steps():
                # an evaluation pass inside a training step (a distillation teacher after the
                # student's forward; a validation batch between backward and the optimizer
                # step): back to the step's phase
                with self._lock:
                    if self._phase == EVAL and not self._eval_hold:
                        self._transition(self._eval_return)
            elif self._sim is not None:
                # one between steps (a test loop) stays evaluation until training resumes, so
                # what its outputs hold is its own; what follows the forward is host work to
                # the simulated device, as between steps (on a GPU the counters say)
                self._sim.count_ops(False, False)
        elif frame.kind == TRAIN_PASS and self._sim is not None:
            self._sim.count_ops(True, False)  # the loss: new tensors count, host data does not

    def _between_steps(self) -> bool:
        """Whether an evaluation pass that just ended ran between training steps: nothing of
        a step had run (no backward since the last optimizer step), or no optimizer is known
        (manual SGD: a step ends with its backward). After a backward with an optimizer known
        it may be inside the step (before the optimizer step), so it is not."""
        if self._eval_return != OTHER:
            return False
        no_optimizer = not (self.optimizers or self._seen_optimizers or self._manual_steps)
        return self._backwards_in_step == 0 or no_optimizer

    def _root_info(self, module: torch.nn.Module) -> RootInfo:
        """The model ``module`` heads: its module keys (``GPT.transformer.h.0``), seen once."""
        entry = self._roots.get(id(module))
        if entry is not None and entry.ref() is module:
            return entry
        with self._lock:  # replica threads (DataParallel) meet new roots at the same time
            return self._new_root(module)

    def _new_root(self, module: torch.nn.Module) -> RootInfo:
        target = getattr(module, "_orig_mod", None)
        compiled = isinstance(target, torch.nn.Module)
        inner: torch.nn.Module = target if compiled else module  # type: ignore[assignment]
        name = user_class_name(inner)
        keys: dict[int, str | None] = {id(module): name}
        if compiled:
            keys[id(inner)] = None
        for path, sub in inner.named_modules():
            if path:
                keys[id(sub)] = f"{name}.{path}"
        if len(self._roots) > 256:
            self._roots = {k: v for k, v in self._roots.items() if v.ref() is not None}
            self._owners = {k: v for k, v in self._owners.items() if v.ref() is not None}
        root = RootInfo(module, keys)
        self._roots[id(module)] = root
        if not root.model:
            return root
        if not self._compiled and is_compiled(module):
            # module hooks inside a compiled graph would break it or make TorchDynamo
            # recompile: from now on, hooks on the models alone (steps and phases stay exact)
            self._compiled = True
            if self.model is None:
                self._set_detail(False)
        for sub_id in keys:
            if sub_id != id(module):
                self._owners[sub_id] = root
        if self._grad_witness is None or self._grad_witness() is None:  # none yet, or gone
            self._grad_witness = self._find_grad_witness()
        if self.model is None:  # a model found running: its FSDP2 units, if any
            self._fsdp = find_fsdp_units(self.root_modules())
        sim = self._sim
        if sim is not None:
            sim.track(module)  # the model lives on the device
            if compiled and not any("torch.compile" in n for n in self.notes):
                self.notes.append(
                    "torch.compile: TorchDynamo does not compile while the simulated device "
                    "(a TorchDispatchMode) counts ops, so the compiled model ran eagerly and "
                    "these are eager PyTorch's numbers; compiled kernels fuse ops and often keep "
                    "less activation memory (measure the compiled program on a GPU)"
                )
        return root

    # transitions and step boundaries (under the lock; not per module)

    def _close_all(self, owner: str | None) -> None:
        now = time.perf_counter() - self._t0
        for dev in self._devices.values():
            a, r, p, pr = dev.read()
            dev.reset()
            self._close(dev, p, pr, owner if owner is not None else dev.bw_module)
            dev.timeline.append((now, self._step, self._phase, None, a, r))
            dev.events += 1
            dev.last = (a, r)

    def _transition(self, phase: int) -> None:
        self._close_all(None)
        for dev in self._devices.values():
            self._resolve_pending(dev)
            if phase == FORWARD:
                dev.forward_base = dev.last[0]
                dev.base_gathered = dev.gathered
                dev.base_grads_none = self._grads_none()
                dev.base_state_empty = self._state_empty()
            if phase != BACKWARD:
                dev.bw_module = None
        self._phase = phase
        if self._sim is not None:  # device memory is what the step's phases create
            self._sim.count_ops(phase != OTHER, phase in (BACKWARD, OPTIMIZER))

    def _boundary(self, frame: Any) -> None:
        self._close_all(None)
        primary = self._primary
        if (
            self.model is not None
            and not self._compiled
            and primary is not None
            and primary.step_phase[FORWARD] is None
            and self._backwards_in_step
        ):
            # a backward without a forward the hooks saw: the model runs inside a compiled
            # graph (compiled after track() began), where hooks must stay out of the way
            self._compiled = True
            self.notes.append(
                "the model's forward ran where memkit's hooks cannot see it (torch.compile "
                "after the block began?): its memory counts as 'other'; pass the compiled "
                "model to track() to have forward measured"
            )
        now = time.perf_counter()
        growing: list[DeviceRecord] = []
        # backward passes before one optimizer step (without an optimizer: all of the step's)
        micro = max(self._micro_batches, self._backwards_in_step - self._backwards_at_optimizer)
        if self._step < 3 or self._facts.param_dtype is None:
            self._capture_evidence()
        for dev in self._devices.values():
            self._resolve_pending(dev)
            close_step(dev, self._step, now - self._step_t0, micro)
            dev.base_grads_none = self._grads_none()
            dev.base_state_empty = self._state_empty()
            dev.bw_module = None
            if self._step < 3 or (dev.grads_full == 0 and not self._grads_none()):
                # remember the persistent sizes while they exist (first steps only): the
                # objects may be gone when the report is made (a script's main() returned)
                p, g, st = self._persistent(dev)
                dev.params_full = max(dev.params_full, p)
                dev.grads_full = max(dev.grads_full, g)
                dev.state_full = max(dev.state_full, st)
            if dev.growth.observe(self._step, dev.last[0]):
                growing.append(dev)
        step = self._step
        self._step += 1
        self._step_t0 = now
        self._backwards_in_step = self._backwards_at_optimizer = self._micro_batches = 0
        self._phase = OTHER
        if self._sim is not None:
            self._sim.count_ops(False, False)
        if growing:
            self._leak_watch.on_growth(growing, frame, self._step)
        elif frame is not None and not any(d.leak is not None for d in self._devices.values()):
            primary = self._primary or next(iter(self._devices.values()))
            self._leak_watch.scan_graphs(step, frame, primary)
        self._schedule_detail()

    def _step_rule(self) -> str:
        """What counts steps: ``"manual"`` (Tracker.step()), ``"optimizer"``, or, while no
        optimizer has stepped, ``"backward"`` (a training forward after a backward)."""
        if self._manual_steps:
            return "manual"
        return "optimizer" if self._seen_optimizers else "backward"

    def _merge_backward_steps(self) -> None:
        """The first optimizer step came after steps counted from backward passes: they were
        the micro-batches of one step (gradient accumulation). Merge their records."""
        n, self._backward_steps = self._backward_steps, 0
        first = self._step - 1 - n
        for dev in self._devices.values():
            merge_steps(dev, first)
            dev.growth = leaks.GrowthDetector(self._leak_warmup, self._leak_window)
        self._step = first + 1
        self._facts.grads_checked_step = min(self._facts.grads_checked_step, self._step)
        self._leak_watch.graph_scans = []
        self._schedule_detail()

    def begin_eval(self) -> None:
        """An evaluation loop begins (a framework's validation): everything until
        :meth:`end_eval` is the eval phase, not only the model's forwards. Nests."""
        if not self._active:
            return
        with self._lock:
            self._eval_hold += 1
            if self._eval_hold > 1:
                return
            if self._phase != EVAL:
                self._eval_return = self._phase
                self._transition(EVAL)
            else:
                self._close_all(None)
            for dev in self._devices.values():  # this loop's own peak, kept apart until its end
                dev.eval_saved = dev.step_phase[EVAL]
                dev.step_phase[EVAL] = None

    def end_eval(self) -> int | None:
        """The evaluation loop :meth:`begin_eval` started ends; returns its peak allocated bytes
        on the tracked device (``None`` if nothing ran in it, or while loops are still nested)."""
        if not self._active or not self._eval_hold:
            return None
        with self._lock:
            self._eval_hold -= 1
            if self._eval_hold:
                return None
            if self._phase == EVAL:
                self._transition(self._eval_return)
            else:
                self._close_all(None)
            for dev in self._devices.values():
                window, saved = dev.step_phase[EVAL], dev.eval_saved
                dev.step_phase[EVAL] = (
                    window if saved is None else saved if window is None else max(saved, window)
                )
                dev.eval_window = window
            primary = self._primary
            return None if primary is None else primary.eval_window

    def steps_since(self, step: int) -> list[StepRecord]:
        """The tracked device's records of the steps numbered ``step`` and later (cheap: for a
        callback that logs each step's peaks)."""
        dev = self._primary
        if dev is None:
            return []
        out: list[StepRecord] = []
        for record in reversed(dev.steps):
            if record.step < step:
                break
            out.append(record)
        out.reverse()
        return out

    def open_step_peaks(self) -> dict[str, int | None]:
        """Peak allocated bytes per phase since the last step boundary (the step in progress,
        and what ran after the last step: an evaluation) on the tracked device."""
        with self._lock:
            if self._active:
                self._close_all(None)
            dev = self._primary
            if dev is None:
                return dict.fromkeys(PHASES)
            return dict(zip(PHASES, dev.step_phase, strict=True))

    def step(self) -> None:
        """Mark a step boundary (for loops without an optimizer, or to count steps yourself).

        Once called, optimizer steps no longer count as boundaries: only these calls do.
        """
        if not self._active:
            return
        with self._lock:
            self._manual_steps = True
            self._boundary(sys._getframe(1))


def _input_shape(args: Any) -> tuple[int, ...] | None:
    """The shape of a forward's first tensor argument (its batch dimension is the model's
    business: ``(batch, ...)`` for most, ``(seq, batch)`` for a seq-first RNN)."""
    for a in args:
        if isinstance(a, torch.Tensor):
            return tuple(int(n) for n in a.shape)
    return None


def _needs_grad(args: Any) -> bool:
    return any(isinstance(a, torch.Tensor) and a.requires_grad for a in args)


def forward_autocast(module: torch.nn.Module) -> str | None:
    """The dtype (``"bfloat16"``) of a ``torch.autocast`` that wraps ``module``'s ``forward``
    attribute itself, else ``None``.

    accelerate's mixed precision replaces ``model.forward`` with ``convert_outputs_to_fp32(
    autocast(forward))``; ``@torch.autocast(...)`` on a ``forward`` is the same. Such an
    autocast is entered inside the call, after the forward pre-hooks, so a hook never sees it
    on: this reads the wrapper chain instead (``__wrapped__``, ``model_forward``, ``__func__``
    and the closures' autocast instances).
    """
    autocast_type = getattr(torch.amp, "autocast", None)
    if autocast_type is None:
        return None
    fn: Any = module.__dict__.get("forward") or getattr(type(module), "forward", None)
    seen: set[int] = set()
    while fn is not None and id(fn) not in seen and len(seen) < 16:
        seen.add(id(fn))
        fn = getattr(fn, "__func__", fn)
        for cell in getattr(fn, "__closure__", None) or ():
            try:
                value = cell.cell_contents
            except ValueError:  # an empty cell
                continue
            if isinstance(value, autocast_type) and getattr(value, "_enabled", True):
                dtype = getattr(value, "fast_dtype", None)
                return None if dtype is None else str(dtype).replace("torch.", "")
        fn = getattr(fn, "__wrapped__", None) or getattr(fn, "model_forward", None)
    return None


def is_compiled(module: torch.nn.Module) -> bool:
    """``torch.compile(model)`` (a wrapper with ``_orig_mod``) or ``model.compile()``."""
    return isinstance(getattr(module, "_orig_mod", None), torch.nn.Module) or (
        getattr(module, "_compiled_call_impl", None) is not None
    )


def _autocast_on(kind: str) -> bool:
    try:
        return bool(torch.is_autocast_enabled(kind))
    except (RuntimeError, TypeError):  # a device type autocast does not know (meta)
        return False
