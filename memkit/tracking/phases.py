"""The phase machine: which phase runs (forward, backward, optimizer, other, eval), what a
root forward is (a training pass, an evaluation pass, a checkpointed forward recomputed in
backward), and where steps end (the step rules).

:class:`PhaseMachine` owns what the step rules need (backward passes, optimizer calls, the
evaluation windows) and writes the phase and the step to the shared
:class:`~memkit.tracking.state.TrackState`, which the hooks read on every call. Transitions and
boundaries run under the tracker's lock, at most a few times per step, never per module; the
hooks (memkit/tracking/hooks.py) call in when a root forward starts or ends, when backward
starts or ends and when an optimizer steps.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import logging
import math
import operator
import sys
import time
import weakref
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from memkit import cuda_autocast
from memkit.oom import is_oom
from memkit.simulated.eager import eager_note
from memkit.tracking.breakdown import Persistent
from memkit.tracking.device_set import DeviceSet
from memkit.tracking.evidence import Evidence
from memkit.tracking.leaks import (
    compiled_in_frames,
    graph_holders,
    growth_finding,
    optimizers_in_frames,
    tensors_within,
    uncounted_tensors,
)
from memkit.tracking.models import TrackedModels, replaces
from memkit.tracking.records import (
    DeviceRecord,
    Frame,
    RootInfo,
    close_step,
    current_leak,
    fold_steps,
)
from memkit.tracking.state import (
    BACKWARD,
    EVAL,
    EVAL_PASS,
    FORWARD,
    OPTIMIZER,
    OTHER,
    RECOMPUTE,
    TRAIN_PASS,
    TrackState,
)

__all__ = ["PhaseMachine", "needs_grad", "output_values"]

_REWALKS = 32
"""The most steps (after the first three) whose forward, beginning higher than at any walk,
has the gradients walked again for ``zero-grad-keeps-grads``."""

log = logging.getLogger(__name__)


class PhaseMachine:
    """Phase transitions, root forwards, step boundaries and evaluation windows.

    Args:
        state: the shared state (``phase``, ``step``, ``backwards`` are written here).
        devices: the tracked devices (closed at every transition).
        evidence: what the boundaries read of the live model and optimizer.
        models: the tracked models and optimizers.
        notes: the report's notes.

    Attributes:
        on_step: called when a step begins (the hooks schedule module detail for it).
        find_compiled: called at a step's end when no model is known and its backward ran
            without a forward the hooks saw: wraps the models compiled in place it finds
            (whether it found one).
        on_new_optimizer: called when an optimizer is first seen stepping beside the owner
            (the hooks look for models until the next step boundary).
    """

    def __init__(
        self,
        state: TrackState,
        devices: DeviceSet,
        evidence: Evidence,
        models: TrackedModels,
        notes: list[str],
    ) -> None:
        self.state = state
        self.devices = devices
        self.evidence = evidence
        self.models = models
        self.notes = notes
        self.on_step: Callable[[], None] = lambda: None
        self.find_compiled: Callable[[], bool] = lambda: False
        self.unseen_said = False  # (a backward without a forward seen, no model known: once)
        self.on_new_optimizer: Callable[[], None] = lambda: None
        self.step_t0 = 0.0
        self.manual_steps = False
        self.step_owner: weakref.ref[Any] | None = None  # the optimizer whose steps count
        self.owner_stepped = -1  # state.backward_passes when it last stepped
        self.owner_since = -1  # and when it became the owner
        # an optimizer first seen beside the owner, and the backward passes at its first step:
        # it takes over at its next step if the owner did not step between (optimizer_called)
        self._successor: tuple[weakref.ref[Any], int] | None = None
        self._former: weakref.ref[Any] | None = None  # the owner a successor took over from
        self.optimizer_calls = 0  # optimizer.step() calls seen (a GradScaler skip makes none)
        self.backward_depth = 0
        self.step_in_backward = False  # an optimizer stepped inside this backward
        self.step_after_backward = False  # ... so the step ends, unless an owner steps
        self.backward_raised = False  # the last backward raised (its phase stays till the next)
        self.backward_steps = 0  # steps counted from backward passes, not yet confirmed
        self.abandoned_steps = 0  # of those, the ones before an attempt that raised
        self.backwards_at_optimizer = 0  # state.backwards at the last optimizer step
        self.failed_base: int | None = None  # where a training attempt that ran out began
        # (step, input shape) of the attempt that ran out, until the segment after it closes
        self.failed_attempt: tuple[int, tuple[int, ...] | None] | None = None
        self.before_backward: Callable[[], None] | None = None  # (the hooks' late keeps)
        self.micro_batches = 0  # the most backward passes one optimizer step used, this step
        self.eval_return = OTHER
        self.eval_hold = 0  # begin_eval() calls not yet ended: the eval phase is held
        self.grads_none_at_forward = True  # no gradients when the last forward began
        self.grads_found_step = -1  # the step whose first forward found gradients allocated
        self.grads_walk_level = 0  # the devices' forward base at the last gradient walk
        self.grads_rewalks = 0  # the walks since the first three
        # the last training forward's first input (the batch an OOM's advice weighs; a list
        # of images is all of them)
        self.train_input: tuple[weakref.ref[torch.Tensor], ...] = ()
        self.eval_batch: tuple[weakref.ref[torch.Tensor], ...] = ()  # the last evaluation's
        # the step's own tensors: the inputs and outputs of this step's training forwards
        # first seen in it (``own``, held weakly), and the last step's (``last_own``). The
        # growth detector's levels leave out those alive (a loop's `x` and `logits`, a
        # decoder's `encoder_outputs`, alive into the next step's forward), so batches whose
        # shape grows on schedule (sorted length buckets, a curriculum) are no leak. A tensor
        # seen in an earlier step is kept, not the step's (a validation set an evaluation
        # that keeps a graph feeds every N steps; a fixed batch)
        self.own: set[weakref.ref[torch.Tensor]] = set()
        self.last_own: set[weakref.ref[torch.Tensor]] = set()
        # the objects among this and the last step's training outputs (a key-value cache),
        # held weakly: their tensors are the step's own too, walked only when the own bytes
        # are measured (a walk a step would cost per layer), by id; an object the last step
        # returned too is kept, not the step's
        self.own_objects: dict[int, weakref.ref[Any]] = {}
        self.last_own_objects: dict[int, weakref.ref[Any]] = {}
        self.seen: set[weakref.ref[torch.Tensor]] = set()  # every input and output seen
        self.seen_room = _SEEN_ROOM  # what ``seen`` takes before its dead ones are dropped
        # the shapes of the step's batches: the tensor inputs of its training forwards (one
        # level into a list, tuple or mapping) but a state fed back (an input on the storage
        # of this or the last step's output: Transformer-XL's `mems`); per level read, the
        # own bytes taken off it when the shapes last changed (:meth:`_own_discount`)
        self.batch_shapes: list[torch.Size] = []
        # the storages of this and the last step's training outputs, by address, held
        # weakly: an address whose storage died is free for the next batch (malloc reuses it)
        self.output_ptrs: dict[int, weakref.ref[Any]] = {}
        self.last_output_ptrs: dict[int, weakref.ref[Any]] = {}
        self._discounts: dict[tuple[bool, str], tuple[tuple[Any, ...], int]] = {}
        self.optimizer_near: bool | None = None  # an optimizer in the user's frames (once)
        self.optimizer_failed = False  # the block ran out in the first optimizer step
        self.oom_attempts = 0  # training forwards or backwards an OOM ended (caught or not)
        self.grads_freed_between = False  # a step counted from backward passes began gradless
        self.other_stepped = False  # an optimizer not the owner stepped since the boundary
        # the losses a backward(retain_graph=True) began at (steps 0-3), and whether the
        # backward running now keeps its graph (retain-graph-held)
        self.retained: list[weakref.ref[torch.Tensor]] = []
        self.retaining = False
        self.frozen_segment = False  # the eval segment open now is a frozen model's forwards
        # the model whose part (a submodule called alone: `model.decode(z)`'s fc3, fc4, dec)
        # ran the last evaluation pass: its next parts are the same pass
        self.eval_part_of: RootInfo | None = None
        # the place in its model of the last part that pass ran: a part again, or one
        # registered before it (`model.encode` after `model.decode`), begins a new pass
        self.eval_part_at = -1
        self._part_places: dict[int, tuple[RootInfo, int, dict[int, int]]] = {}
        self._eval_before: tuple[tuple[DeviceRecord, int | None, int], ...] = ()

    # root forwards (the hooks call these for a model's own forward)

    def root_pre(self, module: torch.nn.Module, args: Any, root: RootInfo | None) -> int:
        """A forward of the model begins: which pass it is, and the phase it starts."""
        state = self.state
        if state.phase == BACKWARD and not self.backward_raised:  # a checkpointed forward
            return RECOMPUTE  # recomputed inside backward
        if root is None:
            root = self.models.root_info(module)
        grad = torch.is_grad_enabled()
        training = module.training
        facts = self.evidence.facts
        if root.first_pass is None:
            root.first_pass = state.backward_passes
        if root.averaged and self.models.optimizes(module):  # an AveragedModel trained
            root.averaged = False
        facts.last_root = (training, grad)
        first, shape = _first_input(args)
        facts.last_input = shape
        sim = self.devices.sim
        began = False
        if not grad or not training or root.averaged or not (root.trainable() or needs_grad(args)):
            kind = EVAL_PASS
            # a submodule run alone: its model's root, or its own beside the model's
            owner = self.models.owners.get(id(module))
            part = root if root.ref() is not module else owner if owner is not root else None
            # (sweep CF: a VAE's decode outside forward was 3 passes, fc3, fc4 and dec; sweep
            # CH: four decodes in a row are four)
            at = -1 if part is None else self._part_place(part, module)
            if part is None or part is not self.eval_part_of or at <= self.eval_part_at:
                facts.eval_forwards += 1
            self.eval_part_of, self.eval_part_at = part, at
            # a teacher or reference model runs on the training batch; a model no optimizer
            # trains evaluated on another batch size (an EMA copy's validation) is evaluation.
            # Before any training forward (a teacher called first in step 0) there is no batch
            # to compare with: where an optimizer is at hand, it is a teacher; in a script
            # with none (inference alone) it is evaluation
            train = facts.train_input
            facts.frozen_model = (
                self.models.frozen_model(module, root)
                if shape and (shape[0] == train[0] if train is not None else self._training_ahead())
                else None
            )
            frozen = facts.frozen_model is not None
            if frozen:  # the step's own work, counted apart from evaluation's
                facts.frozen_forwards += 1
                seen, this = facts.frozen_all, facts.frozen_model
                if this is not None and seen.get(this[0]) != this:
                    seen[this[0]] = this
                    facts.frozen_seen = _together_frozen(seen.values())
                facts.frozen_autocast = facts.frozen_autocast or self._autocast_at(module)
                if facts.frozen_step != state.step:
                    facts.frozen_step = state.step
                    facts.frozen_steps += 1
            else:  # (a post-mortem's evaluation batch)
                self.eval_batch = tuple(map(weakref.ref, first))
            largest = facts.frozen_input if frozen else facts.eval_input
            # (a part's input is no batch of its model's: a decode's 7x7 maps)
            if (
                part is None
                and shape is not None
                and (largest is None or math.prod(shape) > math.prod(largest))
            ):
                if frozen:
                    facts.frozen_input = shape
                else:
                    facts.eval_input = shape
            if state.phase != EVAL:
                with state.lock:
                    if state.phase != EVAL:
                        self.eval_return = state.phase
                        self.transition(EVAL)
                        if frozen:
                            self._frozen_segment_begins()
            elif frozen != self.frozen_segment:  # evaluation, then a teacher (or the reverse)
                with state.lock:  # in one eval phase: each its own segment
                    self._close_segment()
                    if frozen:
                        self._frozen_segment_begins()
        else:
            kind = TRAIN_PASS
            facts.frozen_model = None
            facts.train_input = shape
            self.train_input = tuple(map(weakref.ref, first))
            # advice: mixed-precision. An autocast wrapping the model's forward itself
            # (accelerate's mixed precision) is entered after this hook: read the wrapper
            if self._autocast_at(module):
                facts.autocast_forwards += 1
            if state.phase != FORWARD:
                with state.lock:
                    if state.phase != FORWARD:
                        self._training_forward_begins(sys._getframe(1), root.trained)
                        began = True
            root.trained = True
            values = _values_in(args)
            fed_back, last = self.output_ptrs, self.last_output_ptrs
            self.batch_shapes += [
                v.shape
                for v in values
                if isinstance(v, torch.Tensor)
                and v.layout is torch.strided
                and not _fed_back(v.data_ptr(), fed_back, last)
            ]
            self._take_own(values)
        if sim is not None:  # the batch reaches the model: it is on the device now
            sim.count_ops(True, True)
            sim.track(args, inputs=True)
            if began:  # and was when the forward began (a script's ``.to("cuda")``): the
                # breakdown's "other", as on a GPU, not activations; so are parameters made
                # since the last step (a block a growing model appended, on the GPU before
                # its forward), not the first call's activations
                sim.track(module)
                for dev in self.devices.records.values():
                    dev.forward_base = dev.read()[0]
        if began:
            self._forward_floor()
        return kind

    def _forward_floor(self) -> None:
        """A training forward began: the level it began at, less the step's own tensors
        (this forward's inputs, the last step's inputs and outputs, while they live), is as
        low as the last step's memory came back to (the episode's lists freed after the
        optimizer step that ended it); the growth detector takes the lowest (:meth:`boundary`)."""
        single = self.state.single
        for dev in (single,) if single is not None else self.devices.records.values():
            if dev.forward_base is not None:
                level = dev.forward_base - self._own_discount(True, dev, single is not None)
                if dev.step_floor is None or level < dev.step_floor:
                    dev.step_floor = level
                    # the detector takes the lower of it and the boundary's level: the bytes
                    # it compares a rise with are measured here only where it takes this one
                    pending = dev.growth_pending
                    taken = pending is None or level < pending[1]
                    dev.floor_persistent = (
                        _lasting(self.devices.persistent(dev))
                        if taken and dev.growth.wants_persistent(level)
                        else None
                    )

    def _part_place(self, root: RootInfo, module: torch.nn.Module) -> int:
        """``module``'s place among ``root``'s modules, in the order they were registered."""
        found = self._part_places.get(id(root))
        if found is None or found[0] is not root or found[1] != len(root.keys):  # (rewalked)
            found = (root, len(root.keys), {key: i for i, key in enumerate(root.keys)})
            self._part_places[id(root)] = found
        return found[2].get(id(module), -1)

    def _autocast_at(self, module: torch.nn.Module) -> bool:
        """Whether ``module``'s forward runs under autocast: on now, the script's own CUDA
        region (which a CPU run disables), or one wrapping its ``forward`` (accelerate's
        mixed precision, entered after this hook: read the wrapper)."""
        return (
            _autocast_on(self.devices.kind)
            or cuda_autocast.inside()
            or self.models.forward_autocast(module) is not None
        )

    def _training_ahead(self) -> bool:
        """Whether training is at hand though no training forward ran yet, in step 0 before
        any backward: an optimizer is known, or one is in the user's frames (looked for once:
        an inference script pays one frame scan, a training loop that calls its teacher
        first none after its first training forward)."""
        if self.state.step or self.state.backwards:  # a step ran without a training forward
            return False
        if self.models.all_optimizers():
            return True
        if self.optimizer_near is None:
            try:
                self.optimizer_near = bool(optimizers_in_frames(sys._getframe(1)))
            except Exception:  # inspection must never break training
                log.debug("optimizer search failed", exc_info=True)
                self.optimizer_near = False
        return self.optimizer_near

    def _training_forward_begins(self, frame: Any, trained_before: bool) -> None:
        """A step's first training forward begins (``trained_before``: its model's training
        forwards ran before this one)."""
        state, facts = self.state, self.evidence.facts
        if state.backwards and self.step_rule() == "backward":
            # no optimizer steps: a new training forward after a backward begins the next step
            self.boundary(frame)
            self.backward_steps += 1
        elif self.step_after_backward:  # the optimizer steps ran inside the last backward
            self.step_after_backward = False
            self.boundary(frame)
        self.transition(FORWARD)
        if self.failed_base is not None:
            self._retry_begins(frame)
        if not state.trained:  # from now on the breakdown is training's
            state.trained = True
            for dev in self.devices.records.values():
                dev.train_peak, dev.pending, dev.breakdown = 0, None, None
                dev.train_peak_at_forward, dev.failed_peak = 0, None
        # advice: zero-grad-keeps-grads (a step's first forward, from step 1 on; not while steps
        # are counted from backward passes, where the next micro-batch's forward rightly finds
        # the accumulating gradients: also when the optimizer was seen stepping before the
        # forward, as Lightning's optimizer.step(closure) runs the last micro-batch's inside it;
        # nor at a model's first training forward: the gradients alive then are no step's of
        # its own, and its optimizer is not known yet: a k-fold run's next model, the earlier
        # folds' models kept for an ensemble with theirs; nor while a new optimizer may yet
        # take the steps' ownership, which picks the witnesses anew)
        if (
            state.step > facts.grads_checked_step
            and self.models.seen_optimizers
            and not self.backward_steps
            and trained_before
        ):
            facts.grads_checked_step = state.step  # (the step's first forward only)
            if self._successor is None and not self.grads_none_at_forward:  # (read just now)
                facts.grads_steps += 1
                self.grads_found_step = state.step
                # what the advice quotes: a walk in the first three such steps, then where the
                # forward begins at least 1% higher than at any walk, up to _REWALKS times
                # (gradients that grow as layers are unfrozen; sweep CH quoted the head's
                # 20 KiB of 6 MiB; not at every step of a level that keeps rising: a leak)
                level = sum(d.forward_base or 0 for d in self.devices.records.values())
                rise = self.grads_walk_level // 100
                risen = level > self.grads_walk_level + rise and self.grads_rewalks < _REWALKS
                if facts.grads_steps <= 3 or risen:
                    self.grads_rewalks += facts.grads_steps > 3
                    self.grads_walk_level = max(self.grads_walk_level, level)
                    found = self.evidence.gradient_bytes()
                    facts.grads_at_forward_bytes = max(facts.grads_at_forward_bytes, found)

    def _retry_begins(self, frame: Any) -> None:
        """The first training forward after a caught OOM: where it begins with more than the
        failed attempt began with, and variables in the user's frames hold autograd graphs
        that still save tensors for a backward (an inline step's ``out`` and ``loss``, which
        outlive the ``except`` block; not a finished step's loss, whose backward freed them),
        they are what the retry carries, their saved bytes (``oom-retry-holds``)."""
        base, self.failed_base = self.failed_base, None
        primary = self.devices.primary
        now = None if primary is None else primary.forward_base
        if base is None or now is None or now - base < 1 << 20:  # (nothing more held)
            return
        holders, held = graph_holders(frame, self._weights())
        if holders and held >= 1 << 20:  # what their graphs save, counted
            self.evidence.facts.retry_held = (self.state.step, held, _named(holders))

    def _weights(self) -> frozenset[int]:
        """The storages of the models' parameters and buffers (no activations of a graph)."""
        return frozenset(
            t.untyped_storage().data_ptr()
            for model in self.models.root_modules()
            for t in itertools.chain(model.parameters(), model.buffers())
            if type(t) in (torch.Tensor, torch.nn.Parameter) and t.layout is torch.strided
        )

    def backward_keeps(self, roots: Any, retain: bool) -> None:
        """A backward begins at ``roots``; ``retain``: it keeps their graph. Such losses are
        remembered in steps 0-3 (a few), for :meth:`retained_after`."""
        self.retaining = retain
        facts = self.evidence.facts
        if not retain or self.state.step > 3 or facts.retained_held is not None:
            return
        tensors = [roots] if isinstance(roots, torch.Tensor) else roots
        if isinstance(tensors, (list, tuple)) and len(self.retained) < 8:
            self.retained += [
                weakref.ref(t) for t in tensors if isinstance(t, torch.Tensor) and t.grad_fn
            ]

    def retained_after(self, frame: Any) -> None:
        """A backward that keeps no graph ended: graphs an earlier ``backward(retain_graph=
        True)`` ran through that still save tensors (1 MiB or more), held by the script's
        variables, are memory no backward will use (sweep BY: a DCGAN's discriminator loss on
        an undetached ``fake``, retained to let the generator's step through, kept 4 MiB)."""
        if self.retaining or not self.retained:
            return
        alive = [t for r in self.retained if (t := r()) is not None]
        self.retained = [weakref.ref(t) for t in alive]
        if not alive:
            return
        holders, held = graph_holders(frame, self._weights(), frozenset(map(id, alive)))
        if holders and held >= 1 << 20:
            self.evidence.facts.retained_held = (self.state.step, held, _named(holders))
            self.retained = []

    def root_post(self, frame: Frame, delta: int, dev: DeviceRecord) -> None:
        """The model's forward returned (``delta``: what it left allocated on ``dev``). The
        hooks call it unless there is nothing to do: a training pass with no graph kept in
        eval mode, no pending peak and no simulated device (keep them in step)."""
        state, sim = self.state, self.devices.sim
        if frame.eval_grad:
            facts = self.evidence.facts
            facts.eval_grad += 1
            if delta > facts.eval_grad_bytes:
                facts.eval_grad_bytes = delta
        if dev.pending is not None:  # a new peak in this forward: categorise it now
            with state.lock:
                self.devices.resolve_pending(dev)
        if frame.kind == EVAL_PASS:
            if self.eval_hold:  # a framework's evaluation loop: the rest of it is eval too
                if sim is not None:
                    sim.count_ops(True, False)
            elif state.phase == EVAL and not self._between_steps():
                # an evaluation pass inside a training step (a distillation teacher after the
                # student's forward; a validation batch between backward and the optimizer
                # step): back to the step's phase
                with state.lock:
                    if state.phase == EVAL and not self.eval_hold:
                        in_forward = self.eval_return == FORWARD  # (the step's graph alive)
                        self.transition(self.eval_return, resumes=True)
                        for dev in self.devices.records.values():  # (its peak: the step's)
                            inside = dev.step_phase[EVAL] or 0
                            if inside > dev.eval_in_step:
                                dev.eval_in_step = inside
                            if in_forward and inside > dev.eval_in_forward:
                                dev.eval_in_forward = inside
            elif sim is not None:
                # one between steps (a test loop) stays evaluation until training resumes, so
                # what its outputs hold is its own; what follows the forward is host work to
                # the simulated device, as between steps (on a GPU the counters say)
                sim.count_ops(False, False)
        elif frame.kind == TRAIN_PASS and sim is not None:
            sim.count_ops(True, False)  # the loss: new tensors count, host data does not

    def _between_steps(self) -> bool:
        """Whether an evaluation pass that just ended ran between training steps: nothing of
        a step had run (no backward since the last optimizer step), or no optimizer is known
        (manual SGD: a step ends with its backward). After a backward with an optimizer known
        it may be inside the step (before the optimizer step), so it is not."""
        if self.eval_return != OTHER:
            return False
        models = self.models
        no_optimizer = not (models.optimizers or models.seen_optimizers or self.manual_steps)
        return self.state.backwards == 0 or no_optimizer

    # backward and the optimizer (the hooks call these; under the lock)

    def begin_backward(self) -> None:
        """``torch.autograd.backward`` begins."""
        if self.state.phase != BACKWARD:
            self.transition(BACKWARD)
        self.backward_depth += 1

    def end_backward(self) -> None:
        """``torch.autograd.backward`` returned."""
        if self.backward_depth > 0:
            self.backward_depth -= 1
        if self.state.phase == BACKWARD and self.backward_depth == 0:
            self._backward_done()

    def backward_ended(self) -> None:
        """The autograd engine finished a backward that did not go through
        ``torch.autograd.backward`` (its end was queued when a gradient hook saw it)."""
        if self.state.phase == BACKWARD:
            self._backward_done()

    def _backward_done(self) -> None:
        """A backward pass ended."""
        state = self.state
        state.backwards += 1
        state.backward_passes += 1
        self.transition(OTHER)
        if self.step_in_backward:  # the step ends where the next training forward begins,
            self.step_in_backward = False  # unless an optimizer owning the steps steps first
            self._count_micro_batches()
            self.step_after_backward = True

    def backward_failed(self) -> None:
        """``torch.autograd.backward`` raised (the phase stays: a post-mortem reads it; a
        forward after it, in a script that caught the error, is a new pass, no recompute)."""
        self.backward_depth = max(0, self.backward_depth - 1)
        self.backward_raised = self.backward_depth == 0
        if self.backward_raised:
            self.step_in_backward = False  # (its steps ran in a backward that raised)
        self.attempt_failed(sys.exc_info()[1], closed=False)  # while the error propagates

    def attempt_failed(self, exc: BaseException | None, closed: bool = True) -> None:
        """A training forward or backward raised ``exc``, and the script may go on. After an
        OOM, an OOM handler zeroes the gradients and retries smaller (as ``memkit.microbatch``
        does): the backward passes before it are no micro-batches of the optimizer step that
        follows. Another error (a bad sample skipped) leaves the count alone.

        The training peak is the attempt's if it rose since the attempt's forward began: a
        forward's segment was ``closed`` just now; what the error left until the next model
        forward (a backward's segment) closes at that forward's start (:meth:`failed_settled`),
        if the script goes on (the one a block ends with is the post-mortem's)."""
        if exc is None or not is_oom(exc):
            return
        self.oom_attempts += 1
        self.failed_attempt = (self.state.step, self.evidence.facts.last_input)
        if closed:
            self._mark_failed_peak()
        self.backwards_at_optimizer = self.state.backwards
        self.abandoned_steps = self.backward_steps
        primary = self.devices.primary
        if primary is not None and self.evidence.facts.retry_held is None:
            self.failed_base = primary.forward_base  # where the failed attempt began

    def _owner(self) -> Any:
        """The optimizer whose steps count, if it is alive."""
        return None if self.step_owner is None else self.step_owner()

    def optimizer_called(self, optimizer: Any, in_backward: bool = False) -> None:
        """``optimizer.step()`` was called (before any closure it was given runs);
        ``in_backward``: in a gradient hook, where it is seen but takes no ownership of the
        steps (:meth:`optimizer_in_backward`)."""
        self.optimizer_calls += 1
        if in_backward:
            if self.models.see_optimizer(optimizer):
                self.evidence.find_witness()
            return
        owner = self._owner()
        passes = self.state.backward_passes
        if owner is not None and owner is not optimizer:
            self.other_stepped = True
        if owner is optimizer:
            self.owner_stepped = passes
            if self._successor is not None:  # the owner steps on: no successor (review 3:
                self._successor = None  # a one-off optimizer kept alive stayed pending)
        elif self._former is not None and self._former() is optimizer:
            # the owner a successor took over from steps again (an optimizer over a part of
            # its parameters stepping in a row, a value head's): its steps count again
            self._former = None
            self._owner_is(optimizer, passes)
            owner = optimizer
        if self.models.see_optimizer(optimizer):
            # none yet, or freed, or made anew over its parameters while it stepped no more
            # (a backward ran since its last step; one over a part of them stepping beside
            # it, after the same backward, stays the owner)
            idle = self.owner_stepped < passes
            if owner is None or (idle and replaces(optimizer, [owner])):
                self._owner_is(optimizer, passes)
            elif owner is not optimizer:
                # the next model's of a k-fold run whose earlier optimizers a trainer keeps
                # alive (Accelerate's, a kept LightningModule's), or a part of the owner's
                # parameters, may take over at its next step (its model is known by then: on a
                # GPU too, where models are looked for from now to the next step boundary)
                self._successor = (weakref.ref(optimizer), passes)
                self.on_new_optimizer()
            # an optimizer's parameter: the witness a module seen first (a teacher) may not be
            self.evidence.find_witness()
        elif self._successor is not None and self._successor[0]() is optimizer:
            first, self._successor = self._successor[1], None
            # the owner stepped no more since the successor's first step: before it, or right
            # before it where that step ran its own backward passes (a closure's: LBFGS after
            # Adam, the two-stage PINN recipe; an owner stepping beside it ends the claim)
            if owner is not None and (
                self.owner_stepped < first or (self.owner_stepped == first < passes)
            ):
                self._succeed(optimizer, owner, passes)

    def _succeed(self, optimizer: Any, owner: Any, passes: int) -> bool:
        """``optimizer`` takes the steps over from ``owner``, if it may (a part of its
        parameters, or a model first seen since it began): whether it did."""
        if not self.models.may_succeed(optimizer, owner, self.owner_since):
            return False
        self._former = weakref.ref(owner)
        self._owner_is(optimizer, passes)
        for dev in self.devices.records.values():
            # the last boundary's level: its persistent bytes, read at the next one, would
            # hold the new model's state made since (a rise taken for a leak)
            dev.growth_pending = None
        self.evidence.find_witness(self.models.stepped(since=self.state.step))
        return True

    def _owner_is(self, optimizer: Any, passes: int) -> None:
        """``optimizer``'s steps count from now on (``passes``: the backward passes now)."""
        self.step_owner = weakref.ref(optimizer)
        self.owner_stepped = self.owner_since = passes
        self.evidence.facts.optimizer_name = type(optimizer).__name__

    def optimizer_begins(self) -> None:
        """The optimizer's own work starts (its step, after any closure it was given)."""
        self._count_micro_batches()
        self.transition(OPTIMIZER)

    def _count_micro_batches(self) -> None:
        """An optimizer step: the backward passes it is the first to use are its micro-batches
        (a GAN's two optimizers, each after its own backward, are no gradient accumulation)."""
        if self.backward_steps and not self.manual_steps:
            self._fold_backward_steps()
        backwards = self.state.backwards
        fresh = backwards - self.backwards_at_optimizer
        self.backwards_at_optimizer = backwards
        if fresh > self.micro_batches:
            self.micro_batches = fresh

    def optimizer_in_backward(self) -> None:
        """An ``optimizer.step()`` returned inside a backward: the optimizer step fused into
        backward (PyTorch's tutorial: one optimizer per parameter, stepped by
        ``register_post_accumulate_grad_hook`` as its gradient is made; sweep BH). Its work
        stays backward's, and no such optimizer owns the steps: the step ends where the next
        training forward begins, unless an optimizer stepped outside backward (beside those,
        an AdamW over the rest) ends it first. Before, each step ended at the first such
        step, mid-backward."""
        owner = self._owner()
        if not self.manual_steps and owner is None:  # (none, or gone: a k-fold's last fold's)
            self.step_in_backward = True

    def optimizer_ends(self, optimizer: Any, frame: Any) -> None:
        """``optimizer.step()`` returned: the step's end, if this optimizer's steps count
        (``frame``: the caller's, where the leak search starts)."""
        owner = self._owner()
        if not self.manual_steps and (owner is None or owner is optimizer):
            self.step_after_backward = False
            self.boundary(frame)
        else:
            self.transition(OTHER)

    # transitions and step boundaries (under the lock; not per module)

    def transition(self, phase: int, resumes: bool = False) -> None:
        """Close every device's segment in the phase that ends (one device: only it), and start
        ``phase``; ``resumes``: the step's phase goes on after an evaluation pass inside it (a
        teacher's forward after the student's): the forward's base stays the one it began with,
        so what the student's forward keeps stays its activations."""
        devices, state = self.devices, self.state
        single = state.single
        if phase == BACKWARD:
            if self.before_backward is not None:
                self.before_backward()  # (the model's output: kept for this backward or dropped)
            if self.grads_found_step == state.step:  # the step's first backward: still there?
                self.grads_found_step = -1  # (``set_to_none=False``; not a late ``zero_grad()``)
                self.evidence.facts.grads_into_backward += not self.evidence.grads_none()
        self._close_segment()
        if state.phase == EVAL and phase != EVAL:
            self._eval_ends()
        ends_forward = state.phase == FORWARD and phase != EVAL
        for dev in (single,) if single is not None else devices.records.values():
            if dev.pending is not None:
                devices.resolve_pending(dev)
            if ends_forward and dev.forward_peak:
                devices.forward_ended(dev)
            if phase != BACKWARD:
                dev.bw_module = None
        if phase == FORWARD and not resumes:
            evidence = self.evidence
            grads_none, state_empty = evidence.grads_none(), evidence.state_empty()
            self.grads_none_at_forward = grads_none
            if evidence.several:
                devices.mark_gradients()
            # this step's (a micro-batch's ``logits``) and the last's; the forward's own inputs
            # join ``own`` after this
            last = [t for t in map(_DEREF, self.own | self.last_own) if t is not None]
            for dev in (single,) if single is not None else devices.records.values():
                on = last if single is not None else filter(_on_devices([dev]), last)
                dev.base_outputs = _storages(on)
                dev.forward_base = dev.last[0]
                dev.train_peak_at_forward = dev.train_peak
                dev.base_gathered = dev.gathered
                dev.base_grads_none = grads_none
                dev.base_state_empty = state_empty
                dev.base_flags = evidence.marked
        state.phase = phase
        self.backward_raised = False
        if devices.sim is not None:  # device memory is what the step's phases create
            devices.sim.count_ops(phase != OTHER, phase in (BACKWARD, OPTIMIZER))

    def _eval_ends(self) -> None:
        """An evaluation ended: what it left allocated above what it began with (results kept
        beyond it, with their graphs under grad: eval-grad-enabled)."""
        for dev in self.devices.records.values():
            if dev.last[0] - dev.eval_base > dev.eval_left:
                dev.eval_left = dev.last[0] - dev.eval_base

    def _close_segment(self) -> None:
        """Close every device's segment (one device: only it); a segment of a frozen model's
        forwards (a teacher's, :meth:`_frozen_segment_begins`) also keeps its peak apart, per
        device, in the run's facts."""
        devices, single = self.devices, self.state.single
        if single is not None:
            devices.close_one(single)
        else:
            devices.close_all()
        if self.failed_attempt is not None:  # the first segment closed after an OOM
            self.failed_settled()
        if not self.frozen_segment:
            return
        self.frozen_segment = False
        facts = self.evidence.facts
        peaks = facts.frozen_peaks
        for dev, earlier, base in self._eval_before:
            peak = dev.step_phase[EVAL]
            if peak is not None and peak > peaks.get(dev.key, -1):
                peaks[dev.key] = peak
                facts.frozen_bases[dev.key] = base
            if earlier is not None and (peak is None or earlier > peak):
                dev.step_phase[EVAL] = earlier
        self._eval_before = ()

    def _mark_failed_peak(self) -> None:
        """Mark the devices whose training peak rose in the attempt that ran out."""
        for dev in self.devices.records.values():
            if dev.train_peak > dev.train_peak_at_forward:
                dev.failed_peak = self.failed_attempt

    def failed_settled(self) -> None:
        """The segment after an attempt that ran out closed (at a boundary, or where the next
        model forward begins: a retry's own peak comes after it): marked, and done."""
        self._mark_failed_peak()
        self.failed_attempt = None

    def _frozen_segment_begins(self) -> None:
        """The eval segment that begins now is a frozen model's forward: its devices' eval
        peak starts afresh (what the segment's closes write there is its own peak) and is
        put back when it ends."""
        single = self.state.single
        records = (single,) if single is not None else tuple(self.devices.records.values())
        self._eval_before = tuple((dev, dev.step_phase[EVAL], dev.last[0]) for dev in records)
        for dev in records:
            dev.step_phase[EVAL] = None
        self.frozen_segment = True

    def boundary(self, frame: Any) -> None:
        """A step ends (``frame``: the caller's, where the leak search starts; ``None``: no
        search)."""
        state, devices, evidence, models = self.state, self.devices, self.evidence, self.models
        single = state.single
        self._close_segment()
        primary = devices.primary
        unseen = primary is not None and primary.step_phase[FORWARD] is None and state.backwards
        if unseen and models.model is None and not models.compiled and not self.unseen_said:
            self.unseen_said = True
            if self.find_compiled():
                models.compiled = True
                self.notes.append(
                    "a model compiled in place (`model.compile()`) ran its forward where "
                    f"memkit's global hooks cannot see it, until step {state.step} ended: "
                    "memkit found it then and tracks its forward from the next step, around "
                    "its compiled call (the graph untouched), without module rows; its earlier "
                    "forwards count as 'other'. `memkit.track(model)` sees it from its first "
                    "step"
                )
            else:
                self.notes.append(
                    "a backward ran without a model forward memkit's hooks saw (a forward "
                    "inside a `@torch.compile` function such as a train step, or a model called "
                    "as a plain function): the forward's memory counts as 'other', and the "
                    "steps and phases stay exact; compile the model rather than the step to "
                    "have the forward measured"
                )
        if models.model is not None and not models.compiled and unseen:
            # a backward without a forward the hooks saw: the model runs inside a compiled
            # graph (compiled after track() began), where hooks must stay out of the way
            models.compiled = True
            self.notes.append(
                "the model's forward ran where memkit's hooks cannot see it, inside code "
                "TorchDynamo compiled (the model compiled after the block began, or a compiled "
                "function that calls it, such as a `@torch.compile` train step): its memory "
                "counts as 'other' and the steps and phases stay exact; to have the forward "
                "measured, pass the compiled model to track() or compile the model rather "
                "than the step"
            )
        if state.step == 0 and devices.sim is not None:
            self._compiled_ran_eagerly(frame)
        elif state.step == 2 and devices.sim is not None and frame is not None:
            self._look_for_uncounted(frame)
        now = time.perf_counter()
        growing: list[DeviceRecord] = []
        # backward passes before one optimizer step (without an optimizer: all of the step's)
        micro = max(self.micro_batches, state.backwards - self.backwards_at_optimizer)
        step = state.step
        grads_none, state_empty = evidence.grads_none(), evidence.state_empty()
        flags = evidence.grad_flags() if evidence.several else ()
        captured = False
        own = self.own
        by_backward = not self.manual_steps and not self.models.seen_optimizers  # step_rule()
        if by_backward and step and grads_none:  # (a step that updates by hand, or a retry)
            self.grads_freed_between = True
        self.other_stepped = False
        for dev in devices.records.values():
            sizes = None
            if dev.pending is not None:  # measured once for the breakdown and for remember
                sizes = devices.persistent(dev)
                devices.resolve_pending(dev, sizes)
            close_step(dev, step, now - self.step_t0, micro)
            dev.base_grads_none = grads_none
            dev.base_state_empty = state_empty
            dev.base_flags = flags
            dev.bw_module = None
            level = dev.last[0]
            if (step < 3 and level != dev.kept_level) or (
                not dev.grads_remembered and not grads_none
            ):
                # remember the persistent sizes while they exist (first steps only, and only
                # when the memory kept across the boundary changed): the objects may be gone
                # when the report is made (a script's main() returned)
                devices.remember(dev, sizes or devices.persistent(dev))
                dev.kept_level = level
                # once, with gradients allocated (they may count 0 bytes: DDP's
                # gradient_as_bucket_view makes them the buckets' views)
                dev.grads_remembered = dev.grads_remembered or not grads_none
                captured = True
            # the last step's level, now that this step's forwards began: what it left
            # (persistent bytes: rises that new trainable parameters explain are no leak)
            pending, floor = dev.growth_pending, dev.step_floor
            if pending is not None:
                last_step, last_level, persistent = pending
                if floor is None or last_level <= floor:  # the boundary's level is the lower:
                    if persistent is None and dev.growth.wants_persistent(last_level):
                        sizes = sizes or devices.persistent(dev)  # its bytes, where needed,
                        persistent = _lasting(sizes)  # as they are now
                else:
                    last_level, persistent = floor, dev.floor_persistent
                if dev.growth.observe(last_step, last_level, persistent):
                    growing.append(dev)
                _mark_held_inputs(dev)
            left = level - self._own_discount(False, dev, single is not None)
            # steps counted from backward passes: this boundary is a training forward's start
            # (or the block's end), and so may not be the next: the bytes a rise is compared
            # with are measured with its level (the last step's gradients, alive at the
            # block's end, were no parameters made trainable)
            known = None
            if by_backward and dev.growth.wants_persistent(left):
                sizes = sizes or devices.persistent(dev)
                known = _lasting(sizes)
            dev.growth_pending = (step, left, known)
            dev.step_floor = dev.floor_persistent = None
        if captured or evidence.facts.param_dtype is None:
            evidence.capture(walked=captured)  # the dtype as the walk for remember found it
        state.step = step + 1
        self.step_t0 = now
        self.last_own, self.own = own, set()
        self.last_own_objects, self.own_objects = self.own_objects, {}
        self.last_output_ptrs, self.output_ptrs = self.output_ptrs, {}
        self.batch_shapes = []
        state.backwards = self.backwards_at_optimizer = self.micro_batches = 0
        state.phase = OTHER
        if devices.sim is not None:
            devices.sim.count_ops(False, False)
        watch = evidence.leak_watch
        changed = watch.settle() or bool(growing)  # (the findings' suspects to place anew)
        if growing:
            self._growth_found(growing, frame)
        elif (
            frame is not None
            and watch.due(step)
            and (
                current_leak(single) is None
                if single is not None
                else not any(current_leak(d) is not None for d in devices.records.values())
            )
        ):
            dev = primary or next(iter(devices.records.values()))
            dev.graph_leak = watch.scan_graphs(step, frame, dev.key)
            changed = True
        if changed and watch.moved:
            self._place_suspects()
        self.on_step()

    def _place_suspects(self) -> None:
        """The findings' suspects named where the line trace saw them grow."""
        placed = self.evidence.leak_watch.placed
        for dev in self.devices.records.values():
            dev.leak, dev.graph_leak = placed(dev.leak), placed(dev.graph_leak)

    def _growth_found(self, growing: list[DeviceRecord], frame: Any) -> None:
        """The growth detectors of ``growing`` called a leak: their findings, with the
        variables behind it (a scan of the frames from ``frame``), and a graph the graph
        scans saw growing kept in them."""
        suspects = self.evidence.leak_watch.on_growth(frame, self.state.step, _on_devices(growing))
        for dev in growing:
            first_time = dev.leak is None
            accountant = getattr(dev.backend, "accountant", None)
            held = (0, 0)
            if accountant is not None:  # the batches counted since the climb began
                (count, nbytes), (count_then, bytes_then) = (
                    accountant.held_input_bytes(),
                    dev.held_at_climb[1],
                )
                held = (max(0, count - count_then), max(0, nbytes - bytes_then))
            dev.leak = growth_finding(
                dev.key, dev.growth, suspects, self.state.step, held, dev.graph_leak
            )
            if first_time:  # the report says it; the log is for those who listen
                log.info("memkit: on %s, %s", dev.key, dev.leak.headline())

    def block_ends(self, failed: bool) -> None:
        """The block ends: the last step boundary's level to the growth detectors, where a
        training forward began after it (the step an OOM ended, or a last part step); the line
        trace stops. Not where the block ended normally after another optimizer than the one
        counting the steps stepped past the last boundary (a GAN's generator step after the
        discriminator's optimizer step): that floor is of part of a step, taken where the
        earlier steps' were not (sweep BY: 3.6 MB of the generator's graph called a
        1.15 MiB-a-step leak)."""
        watch = self.evidence.leak_watch
        watch.settle(end=True)
        growing = []
        for dev in self.devices.records.values():
            pending, dev.growth_pending = dev.growth_pending, None
            if pending is None or dev.step_floor is None or (self.other_stepped and not failed):
                continue
            step, level, known = pending
            floor = dev.step_floor
            persistent = dev.floor_persistent if floor < level else known
            if dev.growth.observe(step, min(level, floor), persistent):
                growing.append(dev)
        if growing:
            self._growth_found(growing, None)
        watch.settle(end=True)  # a trace the growth found just now: not begun, stopped
        if watch.moved:
            self._place_suspects()

    def batch_bytes(self, evaluation: bool = False) -> int:
        """The bytes of the last training forward's first input while it lives (0: none);
        ``evaluation``: of the last evaluation pass's (a model no optimizer trains run on the
        training batch, a teacher's, left out)."""
        refs = self.eval_batch if evaluation else self.train_input
        return sum(int(t.numel() * t.element_size()) for r in refs if (t := r()) is not None)

    def note_output(self, output: Any) -> None:
        """A training forward of the model returned ``output``: its tensors (one level into a
        tuple, list or mapping: a Hugging Face output's loss and logits) and the objects among
        them (its key-value cache, walked when the own bytes are measured) are the step's
        own."""
        values = output_values(output)
        self._take_own(values)
        ptrs = self.output_ptrs
        for v in values:
            if isinstance(v, torch.Tensor):
                if v.layout is torch.strided:
                    ptrs[v.data_ptr()] = weakref.ref(v.untyped_storage())
            elif v is not None and not isinstance(v, _NOT_OBJECTS):
                self._take_own_object(v)

    def _take_own_object(self, value: Any) -> None:
        """An object a training forward returned (a key-value cache) is the step's own, unless
        this or the last step returned it already (the same object alive: a dead one's id is
        free for the next)."""
        key = id(value)
        for seen in (self.own_objects, self.last_own_objects):
            ref = seen.get(key)
            if ref is not None and ref() is value:
                return
        if type(value).__weakrefoffset__:  # (else no weak references, ``__slots__``: not walked)
            self.own_objects[key] = weakref.ref(value)

    def _own_discount(self, at_forward: bool, dev: DeviceRecord, single: bool) -> int:
        """The bytes of the step's own tensors alive on ``dev`` (at a forward's start: the
        last step's too), taken off a level the growth detector reads: measured anew when
        the shapes of the step's batches changed since the last measure (their sizes follow
        the batches': sorted length buckets, a curriculum), else the last measure. A state
        fed back into the model on its output's storage (Transformer-XL's memory, never cut)
        is no batch: while the batches keep their shapes, its growth shows."""
        key = (at_forward, dev.key)
        batch = tuple(self.batch_shapes)
        memo = self._discounts.get(key)
        if memo is not None and memo[0] == batch:
            return memo[1]
        refs = self.own | self.last_own if at_forward else self.own
        objects = [*self.own_objects.values()]
        if at_forward:
            objects += self.last_own_objects.values()
        alive = [o for o in map(_DEREF, objects) if o is not None]
        if alive:
            refs = refs | set(map(weakref.ref, tensors_within(alive, torch.Tensor)))
        value = _alive_bytes(refs, None if single else [dev])
        self._discounts[key] = (batch, value)
        return value

    def _take_own(self, values: Iterable[Any]) -> None:
        """The tensors among ``values`` that no step saw before are this step's own."""
        new = {weakref.ref(v) for v in values if isinstance(v, torch.Tensor)}
        new -= self.seen
        if new:
            if len(self.seen) >= self.seen_room:
                self._forget_dead()
            self.seen |= new
            self.own |= new

    def _forget_dead(self) -> None:
        """Drop the references to tensors freed since (in C); ``seen`` then takes as many
        again as are alive (a step of many forwards, a DQN's acting ones)."""
        seen, own = self.seen, self.own
        self.seen = set(itertools.compress(seen, map(_ALIVE, map(_DEREF, seen))))
        self.own = set(itertools.compress(own, map(_ALIVE, map(_DEREF, own))))
        self.seen_room = max(_SEEN_ROOM, 2 * len(self.seen))

    def step_rule(self) -> str:
        """What counts steps: ``"manual"`` (Tracker.step()), ``"optimizer"``, or, while no
        optimizer has stepped, ``"backward"`` (a training forward after a backward)."""
        if self.manual_steps:
            return "manual"
        return "optimizer" if self.models.seen_optimizers or self.optimizer_failed else "backward"

    def optimizer_step_of(self, step: int) -> int:
        """The optimizer step that ``step`` is in: while steps are counted from backward
        passes and the trainer said it accumulates (``accumulation_steps`` told), fewer of
        them than it accumulates are micro-batches of the optimizer step that began them, as
        :meth:`_fold_backward_steps` will fold them (an OOM in step 0's second micro-batch is
        in step 0); else ``step``."""
        if self.optimizer_failed:  # (folded at the block's end: all in the failed step)
            return min(step, self.state.step)
        n = self.backward_steps
        k = self.evidence.facts.accumulation_steps or 1
        if not n or self.manual_steps or k < 2 or n >= k:  # (k or more: no optimizer steps)
            return step
        return min(step, self.state.step - n)

    def _fold_backward_steps(self) -> None:
        """The first optimizer step begins after steps counted from backward passes: they
        were the micro-batches of the step it ends (gradient accumulation). Their records fold
        into the step in progress, which takes the first one's number and their backward
        passes: an OOM in this optimizer step is in that step, with its micro-batches."""
        state, devices = self.state, self.devices
        n, self.backward_steps = self.backward_steps, 0
        first = state.step - n
        counted_from, self.abandoned_steps = first + self.abandoned_steps, 0
        passes, duration = 0, 0.0
        for dev in devices.records.values():
            passes, duration = fold_steps(dev, first, counted_from)
            dev.growth, dev.growth_pending = devices.growth_detector(), None
            # a peak found in a micro-batch belongs to the folded step
            if dev.pending is not None and (dev.pending.step or 0) > first:
                dev.pending = dev.pending._replace(step=first)
            if dev.breakdown is not None and (dev.breakdown.step or 0) > first:
                dev.breakdown = dataclasses.replace(dev.breakdown, step=first)
        state.step = first
        state.backwards += passes
        self.step_t0 -= duration
        facts = self.evidence.facts
        facts.grads_checked_step = min(facts.grads_checked_step, first + 1)
        self.evidence.leak_watch.graph_scans = []

    def _compiled_ran_eagerly(self, frame: Any) -> None:
        """The first step ends on the simulated device: a ``torch.compile``'d function in the
        user's frames (a train step, ``opt.step``) ran eagerly there, as a compiled model does
        (sweep BR: no note said so); looked for once."""
        if frame is None or any(n.startswith("torch.compile") for n in self.notes):
            return
        try:
            name = compiled_in_frames(frame, self.models.all_optimizers())
        except Exception:  # inspection must never break training
            log.debug("compiled function search failed", exc_info=True)
            return
        if name is not None:
            self.notes.append(
                eager_note("the simulated device (a TorchDispatchMode)", "on a GPU")
                + f" (found: `{name}`)"
            )

    def _look_for_uncounted(self, frame: Any) -> None:
        """Step 2 ends on the simulated device: the tensors of 1 MiB or more the script holds
        that it does not count (sweep CB: a PPO's 8 MiB rollout buffer, indexed for every
        minibatch, left out, and only a generic note said so); looked for once."""
        sim = self.devices.sim
        if sim is None:
            return
        try:
            found = uncounted_tensors(frame, sim.accountant.counts)
        except Exception:  # inspection must never break training
            log.debug("uncounted tensor search failed", exc_info=True)
            return
        self.evidence.facts.uncounted = tuple(found[:4])

    def first_step_failed(self) -> None:
        """The block ends with an OOM before any optimizer stepped, though the script has one:
        where the steps counted from backward passes were the retried attempts of the
        optimizer step that ran out (OOMs caught before: ``memkit.microbatch`` splitting ever
        smaller; memory 'growing' across attempts of other sizes is none), or its
        micro-batches (gradients never freed between them, and no growth found across them),
        they are no steps of their own. Not a loop that updates by hand and frees the
        gradients each step (an optimizer it holds and never steps: review 3)."""
        if not self.backward_steps or self.manual_steps or self.models.seen_optimizers:
            return
        retried = self.oom_attempts > 1
        leaks = any(dev.leak is not None for dev in self.devices.records.values())
        if not retried and (self.grads_freed_between or leaks):
            return
        self._fold_backward_steps()
        self.optimizer_failed = True  # steps are the optimizer's: none completed
        if retried:
            for dev in self.devices.records.values():
                dev.leak = None

    def manual_step(self, frame: Any) -> None:
        """``Tracker.step()``: a step boundary; from now on only these calls are. The first
        call, right after an optimizer step ended the step (no training ran since, an
        evaluation may have: a loop calling ``optimizer.step()`` then ``tracker.step()``), is
        that boundary, not an empty step (sweep BQ: 61 steps for 60 iterations)."""
        first = not self.manual_steps
        self.manual_steps = True
        self.step_in_backward = self.step_after_backward = False  # (these calls end steps)
        state = self.state
        just_ended = (
            state.step > 0 and state.phase in (OTHER, EVAL) and not state.backwards
            and not self.own and not self.batch_shapes
        )  # fmt: skip
        if not (first and just_ended):
            self.boundary(frame)

    def finish(self) -> None:
        """The block ends normally: the last step of a loop without an optimizer ends too."""
        if (self.state.backwards and self.step_rule() == "backward") or self.step_after_backward:
            self.boundary(None)
        elif self.frozen_segment:  # a frozen model's forward was the last thing to run
            self._close_segment()

    # evaluation windows (a framework's validation loop)

    def begin_eval(self) -> None:
        """An evaluation loop begins: everything until :meth:`end_eval` is the eval phase."""
        state = self.state
        self.eval_hold += 1
        if self.eval_hold > 1:
            return
        if state.phase != EVAL:
            self.eval_return = state.phase
            self.transition(EVAL)
        else:
            self.devices.close_all()
        for dev in self.devices.records.values():  # this loop's own peak, kept apart
            dev.eval_saved = dev.step_phase[EVAL]
            dev.step_phase[EVAL] = None

    def end_eval(self) -> int | None:
        """The evaluation loop ends; returns its peak allocated bytes on the tracked device
        (``None`` if nothing ran in it, or while loops are still nested)."""
        if not self.eval_hold:
            return None
        self.eval_hold -= 1
        if self.eval_hold:
            return None
        if self.state.phase == EVAL:
            self.transition(self.eval_return)
        else:
            self.devices.close_all()
        for dev in self.devices.records.values():
            window, saved = dev.step_phase[EVAL], dev.eval_saved
            dev.step_phase[EVAL] = (
                window if saved is None else saved if window is None else max(saved, window)
            )
            dev.eval_window = window
        primary = self.devices.primary
        return None if primary is None else primary.eval_window


def _on_devices(records: list[DeviceRecord]) -> Callable[[torch.Tensor], bool]:
    """Whether a tensor lives on one of the devices of ``records`` (the backend says, where
    it can: a virtual device, the CUDA stand-in; else its device type and index)."""
    checks = []
    for dev in records:
        holds = getattr(dev.backend, "holds", None)
        if holds is None:
            target = dev.backend.device

            def holds(t: torch.Tensor, target: torch.device = target) -> bool:
                return t.device.type == target.type and (
                    target.index is None or t.device.index in (None, target.index)
                )

        checks.append(holds)
    return lambda t: any(check(t) for check in checks)


_SEEN_ROOM = 256
"""References to the tensors seen that are kept before the dead ones are dropped."""


def _fed_back(ptr: int, *outputs: dict[int, weakref.ref[Any]]) -> bool:
    """Whether an input at address ``ptr`` is on the storage of a step's output still alive
    (a state fed back: Transformer-XL's `mems`), not a new batch where a dead one was."""
    return any((ref := out.get(ptr)) is not None and ref() is not None for out in outputs)


_NOT_OBJECTS = (torch.Tensor, str, bytes, int, float, tuple, list, Mapping)
"""Output values that are no object to walk later (tensors, numbers, containers)."""


def _alive_bytes(refs: set[weakref.ref[torch.Tensor]], on: list[DeviceRecord] | None) -> int:
    """The bytes of the dense tensors ``refs`` hold that are alive (on the devices of ``on``;
    ``None``: the one device)."""
    if on is None:
        try:  # (in C: twice a step)
            return sum(map(_NBYTES, filter(_ALIVE, map(_DEREF, refs))))
        except RuntimeError:  # a sparse tensor has no nbytes
            pass
    holds = None if on is None else _on_devices(on)
    total = 0
    for ref in refs:
        t = ref()
        if t is not None and t.layout is torch.strided and (holds is None or holds(t)):
            total += t.nbytes
    return total


def _storages(tensors: Iterable[torch.Tensor]) -> dict[int, tuple[weakref.ref[Any], int]]:
    """The dense ``tensors``' storages: data pointer -> (weak reference, bytes); not a
    wrapper subclass's (a DTensor's storage has no data pointer to read)."""
    out = {}
    for t in tensors:
        if t.layout is torch.strided and not is_traceable_wrapper_subclass(t):
            storage = t.untyped_storage()
            out[storage.data_ptr()] = (weakref.ref(storage), storage.nbytes())
    return out


_DEREF = operator.methodcaller("__call__")
_ALIVE = functools.partial(operator.is_not, None)
_NBYTES = operator.attrgetter("nbytes")


def _values_in(args: Any) -> Any:
    """A forward's arguments, and the values one level inside those that are a tuple, list
    or mapping (a batch given as one dict)."""
    for a in args:
        if isinstance(a, (tuple, list, Mapping)):
            break
    else:
        return args
    out: list[Any] = []
    for a in args:
        if isinstance(a, (tuple, list, Mapping)):
            out.extend(output_values(a))
        else:
            out.append(a)
    return out


def output_values(output: Any) -> Any:
    """A forward output's values, one level: a tuple or list itself, a mapping's values, else
    the output alone."""
    if isinstance(output, (torch.Tensor, tuple, list)):
        return (output,) if isinstance(output, torch.Tensor) else output
    # (a dict first: a Hugging Face output, at less than an abstract class's check)
    return output.values() if isinstance(output, (dict, Mapping)) else (output,)


def _mark_held_inputs(dev: DeviceRecord) -> None:
    """On the simulated device, the batches held when ``dev``'s growth detector's climb began
    (taken when it begins or begins again)."""
    accountant = getattr(dev.backend, "accountant", None)
    start = dev.growth.climb_start
    if accountant is not None and start != dev.held_at_climb[0]:
        dev.held_at_climb = (start, accountant.held_input_bytes())


def _first_input(args: Any) -> tuple[list[torch.Tensor], tuple[int, ...] | None]:
    """A forward's first tensor argument and its shape (the batch dimension is the model's
    business: ``(batch, ...)`` for most, ``(seq, batch)`` for a seq-first RNN). Without one, a
    list or tuple of tensors: its tensors; where their shapes differ (a detection model's
    images of different sizes), one sample each, the shape the count before the first one's
    (``4x3x300x212``: 4 images, the first 3x300x212); where they are alike (``[x, mask]`` of
    one batch, or images of one size) no shape can say which dimension is the batch: none.
    A graph batch (``x, edge_index, batch`` as PyG's layers take them: floating node features
    first, an integer ``(2, E)`` tensor among the other arguments, ``E`` not their count)
    counts nodes in its first dimension, not samples: its shape says no batch size either
    (sweep CF: "halve the micro-batch (1601 -> 800)" for 20 graphs; review: not token ids and
    a mask of a batch of 2).

    >>> images = [torch.zeros(3, 5), torch.zeros(3, 7)]
    >>> _first_input((1, torch.zeros(2, 3)))[1], _first_input((images,))[1]
    ((2, 3), (2, 3, 5))
    >>> _first_input(([torch.zeros(4, 2)] * 2,))[1] is None
    True
    >>> _first_input((torch.zeros(7, 3), torch.zeros(2, 12, dtype=torch.long)))[1] is None
    True
    >>> ids = torch.zeros(2, 9, dtype=torch.long)  # a batch of 2 and its mask: no graph
    >>> _first_input((ids, ids))[1]
    (2, 9)
    """
    for a in args:
        if isinstance(a, torch.Tensor):
            graph = (
                a.is_floating_point()
                and a.dim() == 2
                and any(
                    isinstance(e, torch.Tensor)
                    and e.dim() == 2
                    and e.shape[0] == 2
                    and e.shape[1] != a.shape[0]
                    and not e.is_floating_point()
                    and not e.is_complex()
                    and e.dtype is not torch.bool
                    for e in args
                    if e is not a
                )
            )
            return [a], None if graph else tuple(map(int, a.shape))
    for a in args:
        if isinstance(a, list | tuple) and a and all(isinstance(t, torch.Tensor) for t in a):
            if len({t.shape for t in a}) == 1:
                return list(a), None
            return list(a), (len(a), *map(int, a[0].shape))
    return [], None


def _lasting(sizes: Persistent) -> int:
    """The persistent bytes a growth detector compares a rise with: parameters, buffers,
    optimizer state, DDP's buckets, and for gradients the trainable parameters' bytes,
    whether their gradients are allocated now or not. Gradients come and go within a step,
    and the bytes are measured where the level is not always (sweep CE: a nanoGPT loop's
    gradients, alive at one boundary and freed where the baseline was read, made an
    evaluation's appended logits "all of it the model's parameters ... not a leak"); a layer
    made trainable adds its gradients' size all the same (progressive unfreezing, its
    gradients kept by ``zero_grad(set_to_none=False)``: review)."""
    return sizes.parameters + sizes.optimizer_state + sizes.buckets + sizes.trainable


def _together_frozen(
    models: Iterable[tuple[str, int, bool, int]],
) -> tuple[str, int, bool, int]:
    """The frozen models a run's steps call, as one (sweep CH: two teachers of one class,
    their forwards counted together, were priced as the last one's)."""
    found = list(models)
    return (
        " and ".join(f"{m[0]}" for m in found),
        sum(m[1] for m in found),
        any(m[2] for m in found),
        sum(m[3] for m in found),
    )


def needs_grad(args: Any) -> bool:
    """Whether a tensor among ``args`` requires grad (a forward fed it records a graph)."""
    return any(isinstance(a, torch.Tensor) and a.requires_grad for a in args)


def _autocast_on(kind: str) -> bool:
    try:
        return bool(torch.is_autocast_enabled(kind))
    except (RuntimeError, TypeError):  # a device type autocast does not know (meta)
        return False


def _named(holders: list[tuple[str, str, int]]) -> tuple[str, ...]:
    """The first four graph holders as the advice names them: `name` (function():line)."""
    return tuple(f"`{name}` ({function}():{line})" for name, function, line in holders)[:4]
