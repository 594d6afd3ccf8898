"""The hooks: module forward pre/post hooks, gradient hooks, optimizer step hooks, and the hot
path they share (the torch functions wrapped for the block, ``autograd.backward`` among them,
are in memkit/tracking/wrappers.py).

``with memkit.track(model, optimizer=opt) as tracker:`` installs

* forward pre/post hooks on ``model`` itself for the whole block, and on every submodule on the
  steps that have module detail (``per_module``: steps 0, 1, then every ``module_every``-th;
  removed in between); with no model, torch's global module hooks
  (``register_module_forward_pre_hook``/``register_module_forward_hook``) on those steps and on
  step 0, hooks on the models found in between; none inside a ``torch.compile`` graph; on the
  simulated device with a model given, a global pre-hook that finds the other models that run
  (a distillation teacher: counted, and its forwards count as the given model's do);
* a pre-hook on the autograd node of each module's output (registered by the forward post
  hook): it fires
  when backward reaches that module, which marks the start of the module's backward. The first
  one of a backward pass queues an autograd-engine callback that marks its end. memkit does not
  use ``register_full_backward_hook``: it wraps every module's inputs and outputs in an extra
  autograd function, which breaks in-place ops (``ReLU(inplace=True)``) and costs more;
* optimizer step pre/post hooks (``optimizer`` given), else the global
  ``register_optimizer_step_pre_hook``/``register_optimizer_step_post_hook``.

Hooks only read counters (:func:`memkit.devices.counter_reader`: one call returns allocated,
reserved and both peaks) and reset the peak, append a tuple to a bounded deque and update a few
integers: no sync, no subprocess, no device allocation. Every hook closes a segment
(:func:`~memkit.tracking.device_set.segment_closer`); what the user reads of the peak counters
is kept true (memkit/devices/peaks.py). Anything heavier (the breakdown, the leak scan) runs at
phase or step boundaries (memkit/tracking/phases.py).

:class:`Hooks` is every way in from torch: it reads the shared
:class:`~memkit.tracking.state.TrackState` (one attribute hop) and keeps the per-thread stacks
of module calls; phases, steps and the evidence are the other parts'.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import gc
import logging
import sys
import threading
import time
import types
import warnings
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, cast

import torch

from memkit.oom import is_oom
from memkit.tracking.device_set import DeviceSet
from memkit.tracking.evidence import Evidence
from memkit.tracking.fsdp import is_fsdp_unit, user_class_name, wrapped_module
from memkit.tracking.leaks import tensors_within
from memkit.tracking.models import TrackedModels
from memkit.tracking.phases import PhaseMachine, needs_grad
from memkit.tracking.records import Frame, IgnoredCall, ModuleStat, PendingKeep, RootInfo
from memkit.tracking.state import BACKWARD, EVAL_PASS, FORWARD, TRAIN_PASS, TrackState
from memkit.tracking.wrappers import (
    eager,
    skipped_by_dynamo,
    wrap_backward,
    wrap_data_loading,
    wrap_engine,
    wrap_grad_scaler,
)

if TYPE_CHECKING:
    from memkit.tracking.rank_gather import RankWatch

__all__ = ["Hooks"]

log = logging.getLogger(__name__)

_clock = time.perf_counter
_get_ident = threading.get_ident
_compiling = torch.compiler.is_dynamo_compiling  # False in eager; True while Dynamo traces
_grad_enabled = torch.is_grad_enabled
_saved_tensor_hooks = torch._C._autograd._top_saved_tensors_default_hooks
_OFF_DEVICE_PACKERS = ("_checkpoint_hook.", "save_on_cpu.")
"""The saved-tensor hooks known to keep nothing on the device: non-reentrant activation
checkpointing's (it recomputes) and ``save_on_cpu``'s (it copies to the host). Other hooks
(logging, compression on the device) may keep tensors there."""


def _off_device_region() -> object | None:
    """The saved-tensor hook that keeps nothing on the device, if one is on (see
    :data:`_OFF_DEVICE_PACKERS`): one per checkpoint region, told apart by identity (the
    object itself, held: a region that saved nothing frees its hook, and the next region's
    could take its address) (``None``: none)."""
    hooks = _saved_tensor_hooks(False)
    if hooks is None:
        return None
    pack = hooks[0]
    return pack if getattr(pack, "__qualname__", "").startswith(_OFF_DEVICE_PACKERS) else None


def _recomputes(region: object) -> bool:
    """Whether the saved-tensor hook ``region`` is non-reentrant checkpointing's."""
    return getattr(region, "__qualname__", "").startswith(_OFF_DEVICE_PACKERS[0])


_LOOK_EVERY = 10
"""Steps at least between two looks for models a new optimizer asks for (a loop that makes
one every step, a per-batch latent's, would pay a sampled step's hooks every step)."""

_LOSS_LOOKS = 3
"""The first backward passes whose losses are looked at (:func:`autocast_unsafe_loss`)."""

_UNSAFE_GRAD_FNS = {"BinaryCrossEntropyBackward0": "binary_cross_entropy"}
"""Backward nodes of the ops CUDA's autocast refuses to run ("unsafe to autocast")."""

_COMPILE_WARNING = r"Using `torch\.compile\(module\)` when there are global hooks"

_BLOCK_THREADS: collections.Counter[int] = collections.Counter()
"""The threads that entered a tracked block now (a block's backward wrappers are process-wide:
with blocks in two threads, each takes the backward passes of its own thread only)."""


class Hooks:
    """Installs and removes the hooks; the hot path that attributes every segment's peak.

    Args:
        state: the shared state the hooks read on every call.
        devices: the tracked devices (``devices.close`` attributes a segment).
        phases: the phase machine the root forwards, backward and optimizer steps drive.
        evidence: what the hooks note for the report and the post-mortem.
        models: the tracked models and optimizers.
        notes: the report's notes.
        per_module: module detail on sampled steps (``False``: the model's own hooks only).

    Attributes:
        module_every: module detail's period in steps (set when the block begins).
        ranks_watch: the tracking across ranks, under a process group.
    """

    def __init__(
        self,
        state: TrackState,
        devices: DeviceSet,
        phases: PhaseMachine,
        evidence: Evidence,
        models: TrackedModels,
        notes: list[str],
        per_module: bool,
    ) -> None:
        self.state = state
        self.devices = devices
        self.phases = phases
        phases.before_backward = self.settle_late
        self.evidence = evidence
        self.models = models
        self.notes = notes
        self.per_module = per_module
        self._compiled_searched = False
        self.module_every = 1
        self.ranks_watch: RankWatch | None = None
        self._close = devices.close
        # each thread's module calls: the thread that made the tracker (the block's, as a
        # rule) in an attribute, other threads' (DataParallel's replicas) in a thread-local
        self._main_thread = threading.get_ident()
        self._main_calls = _ThreadCalls()
        self._tls = threading.local()
        self._handles: list[Any] = []
        self._detail_handles: list[Any] = []  # module detail's hooks (sampled steps)
        self._detail_pres: dict[tuple[str, str, bool], Callable[[Any, Any], None]] = {}
        self._detail_post: Callable[..., None] | None = None
        self._layout: tuple[bool, bool] | None = None  # (module detail, global hooks)
        self._trained = 0  # models.trained_count() when the model's names were last read
        self._seen = 0  # models.optimizers_seen then
        self._look_now = False  # the step that begins looks for models (schedule_detail)
        self._looked_at = -_LOOK_EVERY  # the step look_for_models last looked at
        self._engine_wrapped = False  # backward found at the autograd engine's entry
        self._loss_looks = 0  # backward passes whose loss was looked at (autocast_unsafe_loss)
        self._row_on = True  # the model's own row is measured on this step (a sampled one)
        self._warning_filter: Any = None
        # training forwards that raised (a script that catches an OOM and retries smaller):
        # what their calls kept is not added to the retry's
        self._failed_passes = 0
        # the model's training passes that kept bytes, numbered; for each, weak references to
        # the pre-hook dicts of its outputs' autograd nodes: gone once its graph is freed
        self._pass_no = 0
        self._pruned_below = 0  # passes below it missing from _pass_graphs died
        self._prune_at = 64  # the record's size that prunes it
        # keeps waiting for what the model returned, by thread (DataParallel's replicas)
        self._late: dict[int, list[tuple[PendingKeep, int]]] = {}
        self._pass_graphs: dict[int, tuple[weakref.ref[Any], ...]] = {}
        # the pre-hook dicts by node id: a node an output shares with an earlier pass (a model
        # that returns a cached tensor) gets one hook, not one per pass
        self._node_hooks: dict[int, weakref.ref[Any]] = {}

    def install(self) -> None:
        """Install the hooks of the block (and module detail's, if step 0 has it)."""
        from torch.optim import optimizer as optim_module

        self._main_thread = threading.get_ident()  # the thread that enters the block
        h = self._handles
        model = self.models.model
        leaf = model is not None and not any(True for _ in model.children())
        if model is not None and getattr(model, "_compiled_call_impl", None) is not None:
            # ``model.compile()``: Dynamo traces the module's hooks into its graph, where they
            # do nothing; around the compiled call they run as Python, the graph untouched
            h.append(_AroundCompiledCall(model, self._make_root_pre(leaf), self._make_post()))
        elif model is not None:  # the model's own hooks stay for the block
            # first of its pre-hooks, as torch's global hooks are (memkit run's): what the
            # user's own do (spectral_norm computes the weight in one) and FSDP2's root
            # all-gather are the model's forward (on the simulated device, a gather before
            # memkit's hook would run outside the step's counted phases)
            h.append(
                model.register_forward_pre_hook(
                    self._make_root_pre(leaf), with_kwargs=True, prepend=True
                )
            )
            # before FSDP2's own post-hook (its reshard), which ends the unit's forward
            h.append(
                model.register_forward_hook(
                    self._make_post(),
                    always_call=True,
                    prepend=is_fsdp_unit(model),
                    with_kwargs=True,
                )
            )
            if isinstance(model, torch.nn.DataParallel):  # advice: dp-loss-on-replicas
                h.append(model.register_forward_hook(self._make_dp_output()))
        if model is None or self.devices.sim is not None:
            # torch warns once per call site that global hooks also fire for torch.compile's
            # wrapper; memkit expects that and keeps the user's stderr quiet
            before = list(warnings.filters)
            warnings.filterwarnings("ignore", message=_COMPILE_WARNING)
            added = warnings.filters[0]
            self._warning_filter = None if added in before else added  # a user's stays
        if model is not None and self.devices.sim is not None:
            h.append(self._find_other_models(model))
        shield, mine = self._shield, self._mine
        _BLOCK_THREADS[self._main_thread] += 1
        h.append(_Leave(self._main_thread))
        h.append(
            wrap_backward(
                mine(shield(self._begin_backward)),
                mine(shield(self._end_backward)),
                mine(self._backward_failed),
            )
        )
        engine = wrap_engine(
            mine(self._engine_begins),
            shield(self._end_backward),
            self._backward_failed,
            mine(self._graph_grad),
        )
        if engine is not None:
            h.append(engine)
        self._engine_wrapped = engine is not None
        if self.devices.sim is not None:
            h.append(wrap_data_loading(self.devices.sim))
        phases = self.phases
        h.append(wrap_grad_scaler(lambda: phases.optimizer_calls, shield(self._scaler_skipped)))
        # every optimizer's steps, the given ones' and those that replace them counted
        # (TrackedModels.counts): one made anew in the block has no hooks of its own
        h.append(optim_module.register_optimizer_step_pre_hook(eager(shield(self._opt_pre))))
        h.append(optim_module.register_optimizer_step_post_hook(eager(shield(self._opt_post))))
        self.set_detail(self._wants_detail(0), force=True)

    # module detail: on sampled steps only (_wants_detail says which)

    def set_detail(self, on: bool, *, force: bool = False) -> None:
        """Install the hooks of module detail (``on``), or the model's own hooks alone.

        With a model: its submodules' hooks come and go. Without one: torch's global module
        hooks on detail steps and on the steps that look for models (step 0, then every
        ``module_every``-th, never once a compiled model is seen), else hooks on the models
        seen so far: a model first used on another step is found at the next such step.
        """
        model = self.models.model
        look = model is None and (on or self._looks_for_models(self.state.step) or self._look_now)
        layout = (on, look)
        if layout == self._layout and not force:
            return
        self._remove_detail()
        self._layout = layout
        self.state.detail_on = on
        h = self._detail_handles
        if model is not None:
            if not on:
                return
            root_name = _model_name(model)
            made = self._detail_pres  # made once, installed on each sampled step
            post = self._detail_post
            if post is None:
                post = self._detail_post = self._make_post()
            inner = model  # (the model a wrapper holds: Fabric's, its paths without the prefix)
            for _ in range(4):
                inner = wrapped_module(inner) or inner
            for name, mod in inner.named_modules():
                if not name:
                    continue  # the model's own hooks are permanent
                leaf = all(m is None for m in mod._modules.values())  # no child module
                key = (root_name, name, leaf)
                pre = made.get(key)
                if pre is None:
                    pre = made[key] = self._make_pre(name, leaf, root_name)
                # first of its pre-hooks: what the user's own do (spectral_norm computes the
                # weight in one) and an FSDP2 unit's all-gather are the module's forward, as
                # torch's global hooks see it
                h.append(mod.register_forward_pre_hook(pre, prepend=True))
                h.append(
                    mod.register_forward_hook(
                        post, always_call=True, prepend=is_fsdp_unit(mod), with_kwargs=True
                    )
                )
            return
        from torch.nn.modules import module as nn_module

        if look:
            h.append(nn_module.register_module_forward_pre_hook(self._shield(self._global_pre)))
            h.append(
                nn_module.register_module_forward_hook(
                    self._make_post(), always_call=True, with_kwargs=True
                )
            )
            return
        root_post = self._make_post()  # (a keyword input it returns is no output)
        pre = self._global_pre
        failed = self._hook_failed

        def root_pre(module: torch.nn.Module, args: Any, kwargs: Any) -> None:
            try:
                pre(module, (*args, *kwargs.values()) if kwargs else args)
            except Exception as exc:
                failed(exc)

        for root in list(self.models.roots.values()):
            mod = root.ref()
            if mod is not None and root.model:
                h.append(mod.register_forward_pre_hook(root_pre, with_kwargs=True, prepend=True))
                h.append(
                    mod.register_forward_hook(
                        root_post, always_call=True, prepend=is_fsdp_unit(mod), with_kwargs=True
                    )
                )

    def look_for_models(self) -> None:
        """Look for models that run from now to the next step boundary (no model given): an
        optimizer was first seen stepping beside the steps' owner, and its model (a k-fold
        run's next one) tells whether it takes the owner's place (:meth:`PhaseMachine.
        optimizer_called`)."""
        state = self.state
        if (
            self.models.model is None
            and not self.models.compiled
            and state.active
            and state.step >= self._looked_at + _LOOK_EVERY  # (a new optimizer every step)
        ):
            self._looked_at = state.step
            self._look_now = True
            self.set_detail(state.detail_on)

    def _looks_for_models(self, step: int) -> bool:
        """Whether global hooks look for models on step ``step`` (no model given)."""
        return not self.models.compiled and step % self.module_every == 0

    def _sampled(self, step: int) -> bool:
        """Whether step ``step`` is sampled: the first two steps (the first makes the
        optimizer state, the second is the steady state), then every ``module_every``-th."""
        every = self.module_every
        return every <= 1 or step < 2 or step % every == 0

    def _wants_detail(self, step: int) -> bool:
        """Whether step ``step`` gets module detail: a sampled step (never for a compiled
        model: hooks inside its graph would break it)."""
        return self.per_module and not self.models.compiled and self._sampled(step)

    def schedule_detail(self) -> None:
        """At a step boundary: module detail for the step that begins, or not; the model's own
        row measured on that step, or not (``_row_on``)."""
        self._row_on = self._sampled(self.state.step)
        on = self._wants_detail(self.state.step)
        models = self.models
        grown = False
        seen = models.optimizers_seen
        step = self.state.step - 1  # (the step that ended)
        new = seen != self._seen
        self._look_now = False  # (look_for_models: until this boundary)
        due = self.evidence.stale_due(step, new)
        if due or self.evidence.stale_pending:
            primary = self.devices.primary
            holds = None if primary is None else getattr(primary.backend, "holds", None)
            self.evidence.stale_check(step, due, holds)
        if self._row_on or new:  # on sampled steps, and for a new optimizer
            self._seen = seen
            trained = models.trained_count()
            grown = trained != self._trained
        if grown:  # an optimizer made anew or given more parameters: the model may have grown
            self._trained = trained
            for root in list(models.roots.values()):
                if root.model:
                    models.rewalk(root)  # (its modules' names)
        if models.model is not None and self._layout == (on, False):
            if on and grown:
                self.set_detail(on, force=True)  # hooks on its new modules too
            return  # else as it is (the usual case: set_detail would find the same)
        self.set_detail(on)

    def _remove_detail(self) -> None:
        handles = self._detail_handles
        while handles:
            handles.pop().remove()

    def _shield(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """``fn`` as a hook that never takes training down: a failure of memkit's own stops
        the tracking with a note (the report so far stays true); an out-of-memory error is the
        device's, and goes on to the user."""

        def shielded(*args: Any, **kwargs: Any) -> Any:
            try:
                return fn(*args, **kwargs)
            except Exception as exc:
                self._hook_failed(exc)
                return None

        return shielded

    def _mine(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """``fn`` for the process-wide wrappers: it runs for calls from this block's thread,
        or from a thread that entered no tracked block (a background training thread); another
        block's thread's backward is that block's."""
        me = self._main_thread

        def for_this_block(*args: Any, **kwargs: Any) -> Any:
            ident = _get_ident()
            if ident == me or ident not in _BLOCK_THREADS:
                return fn(*args, **kwargs)
            return False  # not a backward of ours (the engine's ``begin`` reads it)

        return for_this_block

    def _hook_failed(self, exc: Exception) -> None:
        """A hook of memkit's raised ``exc``: re-raised if it is an out-of-memory error (the
        user's step ran out), else tracking stops here and the report says why."""
        if is_oom(exc):
            raise exc
        state = self.state
        if not state.active:
            return
        state.active = False
        log.warning(
            "memkit: a tracking hook failed (%s: %s); tracking stopped", type(exc).__name__, exc
        )
        log.debug("the failed hook's traceback", exc_info=exc)
        self.notes.append(
            f"memkit stopped tracking at step {state.step}: its own hook failed "
            f"({type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}); "
            "training went on, and what is reported was measured before that (please report "
            "this to memkit)"
        )

    def _region_seen(self, region: object) -> None:
        """A training forward runs inside a saved-tensor hook that keeps nothing on the device:
        checkpointing is on; offloading (``save_on_cpu``) on the simulated device, where the
        host copy is the device tensor itself, keeps counting what a GPU would move off (a
        note, once; sweep BH)."""
        facts = self.evidence.facts
        if _recomputes(region):
            facts.checkpoint_seen = True
        elif self.devices.sim is not None and not facts.offload_noted:
            facts.offload_noted = True
            self.notes.append(
                "save_on_cpu: on the simulated device a tensor's host copy is the tensor itself, "
                "so the activations it offloads stay counted, where a GPU moves them to the host "
                "(measure offloading with memkit.devices.cuda_standin, or on a GPU)"
            )

    def remove(self) -> None:
        """Remove every hook and put back every wrapped function."""
        if self._warning_filter is not None:
            with contextlib.suppress(ValueError):
                warnings.filters.remove(self._warning_filter)  # type: ignore[attr-defined]
                warnings._filters_mutated()  # type: ignore[attr-defined]
            self._warning_filter = None
        if self.ranks_watch is not None:
            self.ranks_watch.remove()
        self._remove_detail()
        while self._handles:
            handle = self._handles.pop()
            try:
                handle.remove()
            except Exception:  # a handle whose owner is gone
                log.debug("could not remove hook %r", handle, exc_info=True)

    # the hot path

    # Hooks on modules are plain closures, not bound methods or partials: ``copy.deepcopy`` of
    # a tracked model (an EMA copy) copies functions by reference, but would try to copy the
    # tracker (and its locks) through a bound method. Inert once the block has exited.
    def _make_pre(
        self, name: str, leaf: bool, root: str | None = None
    ) -> Callable[[Any, Any], None]:
        impl = self._pre
        root = root or _model_name(self.models.model)
        key = f"{root}.{name}" if name else root

        failed = self._hook_failed

        def pre(module: torch.nn.Module, args: Any) -> None:
            if not _compiling():  # traced by TorchDynamo: nothing to do, nothing to guard
                try:
                    impl(key, leaf, module, args, None)
                except Exception as exc:
                    failed(exc)

        return pre

    def find_compiled_in_place(self) -> bool:
        """Without a given model (``memkit run``): the models compiled in place
        (``model.compile()``) alive now, each run from then on inside hooks around its compiled
        call, as a given one is (:class:`_AroundCompiledCall`). torch's global hooks run
        inside that call, where TorchDynamo traces them as the no-ops they are while it
        traces: such a model is never seen otherwise (sweep BR). Looked for once, in the
        collector's objects; whether one was found. Module detail stops: its global hooks
        coming and going would change the compiled call's guards."""
        if self._compiled_searched:
            return False
        self._compiled_searched = True
        # trained by an optimizer seen stepping: not a compiled teacher or loss module (review)
        trained = {
            id(p)
            for o in self.models.all_optimizers()
            for g in o.param_groups
            for p in g["params"]
            if p.requires_grad
        }
        found = [
            o
            for o in gc.get_objects()
            if issubclass(type(o), torch.nn.Module)  # (type(): a dead weak proxy raises)
            and getattr(o, "_compiled_call_impl", None) is not None
            and any(id(p) in trained for p in o.parameters())
        ]
        inner = {id(sub) for m in found for sub in m.modules() if sub is not m}
        roots = [m for m in found if id(m) not in inner]
        if not roots:
            return False
        self.set_detail(False)
        post = self._make_post()

        def pre(module: torch.nn.Module, args: Any, kwargs: Any) -> None:
            self._global_pre(module, (*args, *kwargs.values()) if kwargs else args)

        self._handles.extend(_AroundCompiledCall(m, pre, post) for m in roots)
        return True

    def _make_root_pre(self, leaf: bool) -> Callable[[Any, Any, Any], None]:
        """The model's own pre-hook: its keyword arguments count as inputs too
        (``model(**batch)``: the input's shape, the batch reaching the device)."""
        impl = self._pre
        key = _model_name(self.models.model)

        failed = self._hook_failed

        def pre(module: torch.nn.Module, args: Any, kwargs: Any) -> None:
            if not _compiling():
                try:
                    impl(key, leaf, module, (*args, *kwargs.values()) if kwargs else args, None)
                except Exception as exc:
                    failed(exc)

        return pre

    def _make_post(self) -> Callable[..., None]:
        """The forward post-hook (the same for every module: the frame names it), registered
        ``with_kwargs=True``: a call's keyword tensors are its inputs too (T5's
        ``position_bias``, passed to every layer and returned on), never its own output."""
        impl = self._post

        failed = self._hook_failed

        def post(module: torch.nn.Module, args: Any, *rest: Any) -> None:
            # (torch calls a global always_call hook without the keywords when the forward
            # raised, and _AroundCompiledCall without them: ``(module, args, output)``)
            kwargs, output = rest if len(rest) == 2 else (None, rest[0])
            if not _compiling():
                try:
                    impl(module, (*args, *kwargs.values()) if kwargs else args, output)
                except Exception as exc:
                    failed(exc)

        return post

    def _global_pre(self, module: torch.nn.Module, args: Any) -> None:
        state = self.state
        if not state.active or _compiling():
            return
        calls = self._main_calls if _get_ident() == self._main_thread else self._other_calls()
        stack = calls.stack
        root: RootInfo | None = None
        if stack:
            if self._reentered(stack, module) and self._unwind_stale(stack, module):
                self._global_pre(module, args)  # as a call on what is left of the stack
                return
            if stack[-1].kind < 0 or not state.detail_on:
                stack.append(IgnoredCall(id(module)))
                return
            keys = calls.keys
        else:
            models = self.models
            root = models.owners.get(id(module))
            if root is None or root.ref() is None:  # not a part of a model seen before
                root = models.root_info(module)
                if not root.model:  # a loss module, a data transform: not the model, but
                    return  # it may call one (fairseq's ``criterion(model, sample)``)
            keys = calls.keys = root.keys
            # a model's call: its keyword tensors are inputs too (``model(im_q=..., im_k=...)``),
            # which torch's global pre-hooks are not given
            kwargs = _call_kwargs(module)
            if kwargs:
                args = (*args, *kwargs.values())
        key = keys.get(id(module), "")
        if key == "" and stack:  # a module added to the model since (a growing model's block)
            owner = self.models.roots.get(stack[0].mid)
            if owner is not None and owner.keys is keys:
                key = self.models.key_of(owner, module, state.step)
        if key is None:  # torch.compile's wrapped module: its wrapper stands for it
            return
        if not key:
            key = f"{next(iter(keys.values()))}.{type(module).__name__}"
        self._pre(key, not module._modules, module, args, root)

    def _find_other_models(self, model: torch.nn.Module) -> Any:
        """On the simulated device, with ``model`` given: a torch global forward pre-hook that
        finds the other models that run in the block (a distillation teacher, an EMA copy
        evaluated, a GAN's discriminator). On a GPU they are on the device, so here a model's
        parameters and buffers are counted when it first runs (``models.root_info`` tells the
        tracker, which counts them), and what its forwards create and read counts as in the
        given model's forward (:meth:`_counting_hooks`); phases stay as on a GPU, where
        nothing hooks it. The hook's cost, a dictionary lookup per module call (and torch's
        slower call path for every module once a global hook exists), is paid on the
        simulated device only, whose per-op counting costs far more; the handle removes it."""
        from torch.nn.modules import module as nn_module

        state, models = self.state, self.models
        main, failed, handles = self._main_thread, self._hook_failed, self._handles
        known: dict[int, weakref.ref[torch.nn.Module]] = {}
        hooks: list[tuple[Callable[..., None], Callable[..., None]]] = []  # made once

        def see(module: torch.nn.Module) -> None:
            if len(known) > 4096:  # modules made and dropped (a loss module made per step)
                for key in [k for k, ref in known.items() if ref() is None]:
                    del known[key]
            for sub in module.modules():
                known[id(sub)] = weakref.ref(sub)

        def found(module: torch.nn.Module, args: Any) -> None:
            see(module)
            if not models.root_info(module).model:  # a loss module, a data transform
                return
            if not hooks:
                hooks.append(self._counting_hooks())
            begin, end = hooks[0]
            handles.append(module.register_forward_pre_hook(begin, with_kwargs=True))
            handles.append(module.register_forward_hook(end, always_call=True))
            # this call's pre-hooks were gathered before it was hooked: it begins here
            begin(module, args, _call_kwargs(module) or {})

        def pre(module: torch.nn.Module, args: Any) -> None:
            entry = known.get(id(module))
            if entry is not None and entry() is module:
                return  # a module of the given model, or of one found: the usual case
            if _compiling() or not state.active or _get_ident() != main:
                return
            try:
                found(module, args)
            except Exception as exc:
                failed(exc)

        see(model)
        return nn_module.register_module_forward_pre_hook(pre)

    def _counting_hooks(self) -> tuple[Callable[..., None], Callable[..., None]]:
        """The simulated device's pre- and post-hook for a model found beside the given one:
        a forward of it outside the given model's counts what it creates and the tensors it
        reads (its batch: counted as the given model's is), as the given model's forward
        does, and the counting goes back to what it was when it returns (a teacher's forward
        at a step's start: its activations and logits count; the host work after it does
        not). Inside the given model's forward they change nothing."""
        state, sim, calls, main = self.state, self.devices.sim, self._main_calls, self._main_thread
        assert sim is not None
        acct = sim.accountant
        # (the module, the counting before its forward), innermost last
        saved: list[tuple[int, tuple[bool, bool]]] = []
        failed = self._hook_failed

        def begin(module: torch.nn.Module, args: Any, kwargs: Any) -> None:
            if calls.stack or not state.active or _compiling() or _get_ident() != main:
                return
            try:
                saved.append((id(module), (acct.counting, acct.adopting)))
                sim.count_ops(True, True)
                sim.track((*args, *kwargs.values()) if kwargs else args, inputs=True)
            except Exception as exc:
                failed(exc)

        def end(module: torch.nn.Module, args: Any, output: Any) -> None:
            if saved and saved[-1][0] == id(module) and _get_ident() == main:
                sim.count_ops(*saved.pop()[1])

        return begin, end

    def _other_calls(self) -> _ThreadCalls:
        """The module calls of a thread other than the block's."""
        tls = self._tls
        try:
            return tls.calls
        except AttributeError:
            calls = tls.calls = _ThreadCalls()
            return calls

    def _pre(
        self, name: str, leaf: bool, module: torch.nn.Module, args: Any, root: RootInfo | None
    ) -> None:
        state = self.state
        if not state.active:
            return
        calls = self._main_calls if _get_ident() == self._main_thread else self._other_calls()
        stack = calls.stack
        top = stack[-1] if stack else None
        if top is not None:
            if stack[0].mid == id(module) and self._unwind_stale(stack, module):
                self._pre(name, leaf, module, args, root)  # as a call on what is left
                return
            if top.kind < 0:  # inside a module that is not the model
                stack.append(IgnoredCall(id(module)))
                return
        elif root is None:
            root = self.models.root_info(module)
            if not root.model:  # a parameterless submodule run on its own (a loss, a metric)
                stack.append(IgnoredCall(id(module)))
                return
        dev = state.single or self.devices.for_args(args)
        if top is not None:
            kind = top.kind
            a, r, p, pr = dev.take()
            self._close(dev, p, pr, top.name)
            if p > top.max:
                top.max = p
        else:
            if self._late:  # the last forward's output: the loop has dropped it or not
                self.settle_late(_get_ident())
            events = dev.events
            kind = self.phases.root_pre(module, args, root)
            if dev.events != events:  # a transition read, reset and closed just now (on
                # the simulated device, before root_pre counted the batch: no activation)
                a, r = dev.last if self.devices.sim is None else dev.read()[:2]
            else:
                a, r, p, pr = dev.take()
                self._close(dev, p, pr, None)
                if self.phases.failed_attempt is not None:  # (a retry in the same phase)
                    self.phases.failed_settled()
            if kind == TRAIN_PASS and self.evidence.several and state.phase == FORWARD:
                self.devices.mark_gradients()  # (zero_grad may have run since)
            elif kind == EVAL_PASS:
                if dev.events != events:  # an evaluation begins (or its segment anew)
                    dev.eval_base = a
                elif a - dev.eval_base > dev.eval_carried:
                    dev.eval_carried = a - dev.eval_base  # what its earlier passes left
        ms = dev.modules.get(name)
        if ms is None:
            # gradient hooks only where backward does real work: modules with their own
            # parameters, and the top-level module (backward start in steps-only mode)
            hook = bool(module._parameters) or top is None
            bw = self._shield(functools.partial(self._bw, name)) if hook else None
            ms = dev.modules[name] = ModuleStat(
                leaf, bw, user_class_name(module), _own_weights(module) if hook else (0, 0)
            )
        frame = Frame(name, id(module), dev, a, ms, kind)
        if kind == TRAIN_PASS:
            frame.region = region = _off_device_region()
            if region is not None:
                self._region_seen(region)
            frame.unsaved = unsaved = region is not None or not _grad_enabled()
            frame.keeps_nothing = unsaved and top is not None and top.unsaved
            if ms.frozen32 and not ms.grad_input and not unsaved:  # (mixed-precision's copies)
                ms.grad_input = needs_grad(args)
        # (a training pass runs in training mode: no need to read the module again; an
        # averaged copy's pass is evaluation in either mode)
        if (
            top is None
            and kind != TRAIN_PASS
            and (not module.training or (root is not None and root.averaged))
            and torch.is_grad_enabled()
            # a model with trainable parameters: one frozen by ``requires_grad_(False)``
            # records no graph of its own (sweep CI: a DPO reference so frozen was told it
            # kept 1.00 MiB for a backward that never comes), and fed a tensor that requires
            # grad it is part of training's graph (sweep CL: a perceptual loss's feature net)
            and root is not None
            and root.trainable()
        ):
            frame.eval_grad = True
        stack.append(frame)
        dev.timeline.append((_clock() - state.t0, state.step, state.phase, name, a, r))
        dev.events += 1

    def _reentered(self, stack: list[Any], module: torch.nn.Module) -> bool:
        """Whether ``module`` (global hooks) may be entered on a stack that no forward runs
        any more: it is the stack's first call, or a model entered inside a module that is
        not one (a loss module)."""
        if stack[0].mid == id(module):
            return True
        if stack[0].kind >= 0:
            return False
        root = self.models.roots.get(id(module))
        return root is not None and root.model and root.ref() is module

    def _unwind_stale(self, stack: list[Any], module: torch.nn.Module) -> bool:
        """``module`` is entered while ``stack`` begins with a call of it, or of a module that
        is not the model: the calls whose forward no longer runs are dropped. A
        ``KeyboardInterrupt`` (any ``BaseException``) raised in a forward skips torch's
        always-call hooks, so their post-hooks never ran; the script caught it and goes on
        (saves, evaluates). A training pass dropped is given up, as one that raised. Whether
        any call was dropped (a model that calls itself drops none)."""
        running = _running_calls(sys._getframe(2))
        running[id(module)] -= 1  # this call's own
        for i, frame in enumerate(stack):
            if running[frame.mid] > 0:
                running[frame.mid] -= 1
                continue
            if i == 0 and frame.kind == TRAIN_PASS:
                self._failed_passes += 1
            for dropped in stack[i:]:  # counted as calls that raised are
                if dropped.kind == TRAIN_PASS:
                    dropped.ms.calls += 1
            del stack[i:]
            return True
        return False

    def _post(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        state = self.state
        if not state.active:
            return
        calls = self._main_calls if _get_ident() == self._main_thread else self._other_calls()
        stack = calls.stack
        if not stack:
            return
        frame = stack.pop()
        if frame.mid != id(module):
            # a module whose post hook did not run (hooks added mid-forward): unwind to ours
            stack.append(frame)
            for i in range(len(stack) - 1, -1, -1):
                if stack[i].mid == id(module):
                    del stack[i + 1 :]
                    break
            else:
                return
            frame = stack.pop()
        kind = frame.kind
        if kind < 0:
            return
        dev = frame.dev
        if (
            not stack
            and kind == TRAIN_PASS
            and not self._row_on
            and output is not None
            and self._engine_wrapped
            and dev.pending is None
            and self.devices.sim is None
            and state.fsdp is None
            and not frame.region_children
        ):
            # a training forward of the model between sampled steps: its segment goes on
            # into the loss (the forward phase either way) and closes where backward begins;
            # a read here would only feed the model's own row, sampled like the others (also
            # in steps-only mode and for a compiled model, where it is the only row)
            self.phases.note_output(output)
            if self.evidence.several and state.phase == FORWARD:
                self.devices.mark_gradients()
            return
        a, r, p, pr = dev.take()
        name = frame.name
        self._close(dev, p, pr, name)
        fmax = frame.max if frame.max > p else p
        raised = False
        if output is None:
            exc = sys.exc_info()[1]
            raised = exc is not None
            failed = self.evidence.failed_call
            if raised and (failed is None or failed[0] != id(exc)):
                outer = stack[0] if stack else frame  # the pass's outermost call
                base = outer.alloc_in if kind == EVAL_PASS else None
                self.evidence.failed_call = (id(exc), dev, state.phase, state.step, name, base)
        alloc_in = frame.alloc_in
        delta = a - alloc_in
        if state.fsdp is not None:  # FSDP2's all-gathers are no activations of the module's
            delta -= dev.gathered - frame.gathered_in
        ms = frame.ms
        step = state.step
        keeps = kind == TRAIN_PASS and not frame.keeps_nothing and not raised
        if frame.region_children:  # its children's region ended inside it: they kept alone
            self._settle_region(frame, None)
        returned: dict[int, Any] = {}  # what it returned, by storage (sampled steps; a root)
        if frame.outputs or (
            kind == TRAIN_PASS and (state.detail_on or not stack) and output is not None
        ):
            returned = _storages_of(output)
        child_outputs = self._settle_outputs(frame, returned, stack) if frame.outputs else ()
        t: torch.Tensor | None = None  # the output's first tensor, found once where needed
        if kind == TRAIN_PASS:  # a call that raised keeps nothing: its pass is given up
            ms.calls += 1
            if fmax > ms.peak:
                ms.peak = fmax
            if fmax - alloc_in > ms.over_max:
                ms.over_max = fmax - alloc_in
            if not ms.leaf and not raised and state.detail_on:  # a block (sampled steps, with
                # module detail): what checkpointing it would keep
                t = output if type(output) is torch.Tensor else _first_tensor(output)
                out_bytes = 0 if t is None else t.numel() * t.element_size()
                if out_bytes > ms.out_max:
                    ms.out_max = out_bytes
            if raised and not stack:
                self._failed_passes += 1
                self.phases.attempt_failed(sys.exc_info()[1])
        elif kind == EVAL_PASS:
            ms.eval_calls += 1
        else:
            ms.recompute_calls += 1
        parent = stack[-1] if stack else None
        if parent is None and kind == TRAIN_PASS and not raised:
            self.phases.note_output(output)  # the growth detector's levels leave it out
            if self.evidence.several and state.phase == FORWARD:
                self.devices.mark_gradients()
        if keeps and frame.region is not None and parent is not None and not parent.unsaved:
            # the outermost call in a checkpoint region: it keeps what it returns, unless the
            # region began in its caller and its siblings share it (then only what the caller
            # returns is kept); a sibling or the caller's end tells which
            keeps = self._settle_region(parent, frame.region)
            if keeps:
                entries = parent.region_children
                if entries is None:
                    entries = parent.region_children = []
                entries.append((frame.region, ms, delta, delta - frame.children))
                keeps = False  # kept when settled
        # what a training forward keeps for backward: a call's once its caller ends
        # (_settle_outputs); the model's own once the loop's backward or next forward shows
        # what it did with the output (a transformers model's logits beside its loss: dropped)
        deferred = keeps and self._defer(
            parent, ms, delta, delta - frame.children, returned, args, child_outputs
        )
        if keeps and not deferred:
            self._keep(ms, delta, delta - frame.children)
        if keeps and parent is None:
            self._pass_ends(output)
        if parent is not None:
            if (keeps or kind != TRAIN_PASS) and not deferred:
                parent.children += delta
            if fmax > parent.max:
                parent.max = fmax
        elif (
            frame.kind != TRAIN_PASS
            or frame.eval_grad
            or dev.pending is not None
            or self.devices.sim is not None
        ):
            if frame.eval_grad:  # what it kept for a backward: the output stays under no_grad
                delta = max(0, delta - _new_output_bytes(output, args))
            self.phases.root_post(frame, delta, dev)  # (else it has nothing to do)
        bw = ms.bw
        # off the sampled steps the model's own gradient hook would only find a backward that
        # bypassed torch.autograd.backward: the engine's wrapper finds those (wrap_engine)
        if bw is not None and kind == TRAIN_PASS and (state.detail_on or not self._engine_wrapped):
            if t is None:  # (a block's found it above)
                t = output if type(output) is torch.Tensor else _first_tensor(output)
            if t is not None and t.requires_grad:
                last = calls.hooked
                if last is None or last() is not t:
                    _hook_backward(t, bw)
                    calls.hooked = weakref.ref(t)
            elif t is None:  # an RNN's (PackedSequence(data, ...), (h, c)): each part's
                for part in _nested_firsts(output):  # first tensor (sweep CA: the LSTM's
                    if part.requires_grad:  # backward was put on the head before it)
                        _hook_backward(part, bw)
        dev.timeline.append((_clock() - state.t0, step, state.phase, name, a, r))
        dev.events += 1

    def _keep(self, ms: ModuleStat, delta: int, own: int, now: int | None = None) -> None:
        """A training call kept ``delta`` bytes for backward (``own``: less its children's;
        ``now``: its pass's number, where it is settled after the pass ended)."""
        if delta > ms.act_max:
            ms.act_max = delta
        if own > ms.self_max:
            ms.self_max = own
        # a module's calls add up until the next backward frees what they keep (a shared
        # block called twice in one forward; two forwards before one backward), while the
        # passes that made them live: a pass whose outputs were dropped with no backward (a
        # DQN's acting forward, `q_network(obs).argmax()`) freed its graph and keeps nothing
        # from then on. The next backward starts again: micro-batches, the passes of an
        # optimizer's closure (LBFGS), a retry after a forward that raised
        key = (self._failed_passes << 40) | (self.state.step << 20) | self.state.backwards
        passes = ms.step_passes
        if now is None:
            now = self._pass_no
        if ms.step_id != key:
            ms.step_id = key
            passes.clear()
            ms.step_sum = 0
        elif passes[-1][0] != now:  # its first call in this pass: passes freed since?
            alive = [p for p in passes if self._graph_lives(p[0])]
            if len(alive) != len(passes):  # (any of them: a freed pass between two kept)
                ms.step_sum = sum(p[1] for p in alive)
                passes[:] = alive
        if passes and passes[-1][0] == now:
            passes[-1][1] += delta
        else:
            passes.append([now, delta])
        ms.step_sum += delta
        if ms.step_sum > ms.step_max:
            ms.step_max = ms.step_sum

    def _pass_ends(self, output: Any) -> None:
        """A training pass of the model returned ``output`` (its calls kept bytes): the pass
        is numbered, and its outputs' autograd nodes get a no-op pre-hook whose dict, held
        weakly, says whether its graph still lives (:meth:`_graph_lives`)."""
        refs = tuple(self._node_hook(t.grad_fn) for t in _graph_outputs(output))
        graphs = self._pass_graphs
        if len(graphs) >= self._prune_at:  # keep the passes whose graph still lives
            self._pass_graphs = graphs = {
                n: r for n, r in graphs.items() if any(ref() is not None for ref in r)
            }  # (one with no node found: taken to live until now, dropped)
            self._pruned_below = self._pass_no  # (a pass missing below it died)
            self._prune_at = max(64, 2 * len(graphs))  # (amortized: many alive at once)
        graphs[self._pass_no] = refs  # (no node: taken to live until the next pruning)
        self._pass_no += 1

    def _node_hook(self, node: Any) -> weakref.ref[Any]:
        """A weak reference to the dict of ``node``'s no-op pre-hook, registered once."""
        hooks = self._node_hooks
        ref = hooks.get(id(node))
        if ref is not None and ref() is not None:  # (a dead node's id, reused: its dict died)
            return ref
        if len(hooks) >= 256:
            self._node_hooks = hooks = {k: r for k, r in hooks.items() if r() is not None}
        ref = hooks[id(node)] = node.register_prehook(_no_op).hooks_dict_ref
        return ref

    def _graph_lives(self, number: int) -> bool:
        """Whether training pass ``number``'s graph may still live: one of its outputs'
        autograd nodes does (a pass whose outputs had no node found: taken to live until the
        record is next pruned; one not numbered yet: alive; one pruned: dead)."""
        refs = self._pass_graphs.get(number)
        if refs is None:  # not numbered yet, or pruned as dead (a keep settled late)
            return number >= self._pruned_below
        return not refs or any(ref() is not None for ref in refs)

    def _defer(
        self,
        parent: Frame | None,
        ms: ModuleStat,
        delta: int,
        own: int,
        returned: dict[int, Any],
        args: Any,
        child_outputs: set[int] | tuple[()],
    ) -> bool:
        """Leave a training call's keep to its caller's end (``parent``), or, the model's own
        (``None``), to what the loop does with its output (:meth:`settle_late`), where it
        returned tensors of storages of its own (not its inputs'): whether it did."""
        if delta <= 0 or not returned:
            return False
        inputs = _storages_of(args, depth=2)
        mine = [
            (weakref.ref(storage), storage.nbytes(), ptr, ptr in child_outputs)
            for ptr, storage in returned.items()
            if ptr not in inputs
        ]
        if not mine:
            return False  # (its input, or a view of it: nothing of its own to free)
        entry = PendingKeep(ms, delta, own, mine)
        if parent is None:
            self._late.setdefault(_get_ident(), []).append((entry, self._pass_no))
        elif parent.outputs is None:
            parent.outputs = [entry]
        else:
            parent.outputs.append(entry)
        return True

    def settle_late(self, thread: int | None = None) -> None:
        """A backward begins, or another forward (``thread``: in that thread: its own keeps
        only), or the block ends: what the model returned and the loop dropped (``loss =
        model(**batch).loss``: the logits) was kept by no backward; the keeps that waited for
        it are made."""
        threads = list(self._late) if thread is None else [thread]
        late = [entry for t in threads for entry in self._late.pop(t, ())]
        for entry, number in late:
            for storage, nbytes, _, from_child in entry.outputs:
                if storage() is None:
                    entry.delta -= nbytes
                    if not from_child:
                        entry.own -= nbytes
            self._keep(entry.ms, max(0, entry.delta), max(0, entry.own), number)

    def _settle_outputs(self, frame: Frame, returned: dict[int, Any], stack: list[Any]) -> set[int]:
        """``frame`` ends: each call it deferred (its children's, and theirs that it returns
        on) keeps what it kept, less what it returned that died (a non-inplace ``Linear ->
        ReLU``: the ReLU saves its own output, the Linear's is freed as soon as the ReLU
        returns; a dropout's output added to the residual stream two levels up). What is still
        alive and returned on waits for the caller's end. The addresses of the children's
        outputs."""
        entries, frame.outputs = frame.outputs or [], None
        caller = stack[-1] if stack and isinstance(stack[-1], Frame) else None
        addresses: set[int] = set()
        for entry in entries:
            alive = []
            for out in entry.outputs:
                storage, nbytes, ptr, from_child = out
                if storage() is None:  # freed before this caller returned: kept by no backward
                    entry.delta -= nbytes
                    if not from_child:  # (else its child's row gives it back)
                        entry.own -= nbytes
                else:
                    alive.append(out)
                    if not entry.counted:  # (a dead one's address may be a new storage's)
                        addresses.add(ptr)
            if not entry.counted:  # (a call's bytes count in its own caller only)
                entry.counted = True
                frame.children += max(0, entry.delta)
            passed = [out for out in alive if out[2] in returned]
            if passed and caller is not None:  # returned on: its fate is decided higher up
                entry.outputs = passed
                if caller.outputs is None:
                    caller.outputs = []
                caller.outputs.append(entry)
            elif passed:  # the model returned it: the loop decides
                entry.outputs = passed
                self._late.setdefault(_get_ident(), []).append((entry, self._pass_no))
            else:
                self._keep(entry.ms, max(0, entry.delta), max(0, entry.own))
        return addresses

    def _settle_region(self, parent: Frame, region: object | None) -> bool:
        """A child of ``parent`` ended in checkpoint region ``region`` (``None``: ``parent``
        ends): the children left waiting in other regions were each their region's outermost
        call and keep what they returned; those in ``region`` shared it with this one, inside
        ``parent``'s forward, and keep nothing. Whether this one may keep."""
        entries = parent.region_children or []
        shared = parent.region is not None and parent.region is region
        for entry in entries:
            if entry[0] is region:
                shared = True
            else:
                self._keep(entry[1], entry[2], entry[3])
                parent.children += entry[2]
        parent.region_children = None
        if shared:
            parent.region = region  # later children in it keep nothing either
        return not shared

    def _bw(self, name: str, grads: Any) -> None:
        """Backward reached module ``name``'s output (``grads``: its gradient, or the
        gradients its autograd node receives)."""
        state = self.state
        if not state.active or state.graph_grads:  # a gradient penalty's: part of the forward
            return
        if state.phase != BACKWARD:  # a backward that did not go through autograd.backward
            with state.lock:
                if state.phase != BACKWARD:
                    self.phases.transition(BACKWARD)
                    _queue_callback(self._shield(self._end_queued))
        dev = state.single or self.devices.by_index(self.devices.index_of(_first_tensor(grads)))
        if state.detail_on:
            a, r, p, pr = dev.take()
            self._close(dev, p, pr, dev.bw_module)
            dev.timeline.append((_clock() - state.t0, state.step, BACKWARD, name, a, r))
            dev.events += 1
        dev.bw_module = name

    # backward and the optimizer: the phase machine's, under the lock

    def _begin_backward(self, roots: Any, retain: bool) -> None:
        state = self.state
        if not state.active:
            return
        with state.lock:
            self.phases.begin_backward()
            if retain or self.phases.retaining:
                self.phases.backward_keeps(roots, retain)
            if self._loss_looks < _LOSS_LOOKS:  # (the first passes only: no per-step cost)
                self._loss_looks += 1
                facts = self.evidence.facts
                facts.unsafe_loss = facts.unsafe_loss or autocast_unsafe_loss(roots)

    def _end_backward(self) -> None:
        state = self.state
        if not state.active:
            return
        with state.lock:
            self.phases.end_backward()
            if self.phases.retained:  # (a backward(retain_graph=True) ran: steps 0-3)
                self.phases.retained_after(sys._getframe(1))

    def _engine_begins(self) -> bool:
        """The autograd engine is entered: a backward begins there if a training forward ran
        and no backward was marked yet (``torch.autograd.grad``, or a ``backward`` imported
        before the block): what the first gradient hook would find."""
        state = self.state
        if not state.active or state.phase != FORWARD:
            return False
        try:
            with state.lock:
                if state.phase != FORWARD:
                    return False
                self.phases.transition(BACKWARD)
                self.phases.backward_depth += 1
        except Exception as exc:
            self._hook_failed(exc)
            return False
        return True

    def _graph_grad(self, change: int) -> None:
        """A gradient that builds graph for the loss (``create_graph=True``, not accumulated:
        a gradient penalty) begins (+1) or ends (-1): no backward pass, no phase of its own."""
        self.state.graph_grads += change

    def _end_queued(self) -> None:
        state = self.state
        if state.active and self.phases.backward_depth == 0:
            with state.lock:
                self.phases.backward_ended()

    def _backward_failed(self) -> None:
        with self.state.lock:
            self.phases.backward_failed()

    def _scaler_skipped(self, optimizer: Any) -> None:
        """A step GradScaler skipped: it ends the training step as optimizer.step() would."""
        if not self.state.active:
            return
        if self._opt_pre(optimizer, (optimizer,), {}) is None:
            self._opt_post(optimizer, (), {})

    def _make_dp_output(self) -> Callable[[Any, Any, Any], None]:
        """A forward hook on a DataParallel model: the largest gathered output, in bytes."""
        state, facts = self.state, self.evidence.facts

        def hook(module: torch.nn.Module, args: Any, output: Any) -> None:
            if not state.active:
                return
            values = output.values() if isinstance(output, dict) else output
            tensors = [output] if isinstance(output, torch.Tensor) else list(values or ())
            size = sum(
                int(t.numel() * t.element_size()) for t in tensors if isinstance(t, torch.Tensor)
            )
            if size > facts.dp_output_bytes:
                facts.dp_output_bytes = size

        return hook

    def _opt_pre(
        self, optimizer: Any, args: Any, kwargs: Any
    ) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
        if not self.state.active:
            return None
        self.models.stepping(optimizer, self.state.step)
        if not self.models.counts(optimizer, self.state.backward_passes):
            return None
        in_backward = self.phases.backward_depth > 0  # in a gradient hook: backward's work
        self.phases.optimizer_called(optimizer, in_backward)
        if in_backward:
            return None
        # ``optimizer.step(closure)`` (Lightning's automatic optimization, LBFGS): the forward
        # and backward run inside step(); the optimizer's own work starts when the closure
        # returns. ``args`` starts with the optimizer itself.
        closure = kwargs.get("closure") if kwargs else None
        if callable(closure):
            kwargs = {**kwargs, "closure": self._after_closure(optimizer, closure)}
            return tuple(args), kwargs
        if len(args) > 1 and callable(args[1]):
            return (args[0], self._after_closure(optimizer, args[1]), *args[2:]), dict(kwargs or {})
        self._optimizer_begins(optimizer)
        return None

    def _after_closure(self, optimizer: Any, closure: Callable[..., Any]) -> Callable[..., Any]:
        begins = eager(self._optimizer_begins)

        @skipped_by_dynamo  # (the closure, the user's forward and backward, stays compiled)
        def run_closure(*args: Any, **kwargs: Any) -> Any:
            result = closure(*args, **kwargs)
            begins(optimizer)
            return result

        return run_closure

    def _optimizer_begins(self, optimizer: Any) -> None:
        """The optimizer's own work starts (its step, after any closure it was given)."""
        state = self.state
        if not state.active:
            return
        if self.ranks_watch is not None:
            self.ranks_watch.on_step(optimizer)
        with state.lock:
            self.phases.optimizer_begins()

    def _opt_post(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        state = self.state
        if not state.active or not self.models.counts(optimizer, state.backward_passes, False):
            return
        with state.lock:
            if self.phases.backward_depth > 0:
                self.phases.optimizer_in_backward()
            else:
                self.phases.optimizer_ends(optimizer, sys._getframe(1))


def _nested_tensors(values: Any, depth: int) -> list[torch.Tensor]:
    """The tensors in ``values``: itself, or in its tuples, lists and dicts ``depth`` levels
    down (a key-value cache object is not walked)."""
    found: list[torch.Tensor] = []
    level, items = 0, [values]
    while items:
        inner: list[Any] = []
        for t in items:
            if isinstance(t, torch.Tensor):
                found.append(t)
            elif level == depth:
                continue  # (a container at the last level read: not walked)
            elif isinstance(t, (tuple, list)):
                inner.extend(t)
            elif isinstance(t, dict):
                inner.extend(t.values())
        level, items = level + 1, inner
    return found


def _graph_outputs(output: Any) -> list[torch.Tensor]:
    """The tensors with an autograd node in a forward's ``output``, three levels down
    (``((logits,),)``, a model output's fields), each node once."""
    nodes = {id(t.grad_fn): t for t in _nested_tensors(output, 3) if t.grad_fn is not None}
    return list(nodes.values())


_PLAIN = (torch.Tensor, torch.nn.Parameter)


def _storages_of(values: Any, depth: int = 1) -> dict[int, Any]:
    """The storages of the plain strided tensors in ``values`` (``depth`` levels down: a
    module's output one, its arguments two), by address. A tensor subclass (DTensor, a
    wrapper) has no storage of its own to watch: none is taken."""
    found: dict[int, Any] = {}
    for t in _nested_tensors(values, depth):
        if type(t) in _PLAIN and t.layout is torch.strided:
            storage = t.untyped_storage()
            found.setdefault(storage.data_ptr(), storage)
    return found


def _new_output_bytes(output: Any, args: Any) -> int:
    """The bytes of the storages a forward's output holds (nested: a key-value cache too),
    each once (views of one tensor: ``chunk``), less those of its inputs (a VAE returning its
    input beside its reconstruction): what the forward made that it returned."""
    inputs = {
        t.untyped_storage().data_ptr()
        for t in tensors_within(args, torch.Tensor)
        if t.layout is torch.strided
    }
    seen: dict[int, int] = {}
    for t in tensors_within((output,), torch.Tensor):
        if t.layout is torch.strided:
            storage = t.untyped_storage()
            ptr = storage.data_ptr()
            if ptr not in inputs:
                seen[ptr] = storage.nbytes()
    return sum(seen.values())


class _ThreadCalls:
    """One thread's module calls: its stack (a :class:`Frame`, or an :class:`IgnoredCall`
    with ``kind < 0``), the module keys of the model it runs (global hooks), and the output
    given a gradient hook last."""

    __slots__ = ("hooked", "keys", "stack")

    def __init__(self) -> None:
        self.stack: list[Any] = []
        self.keys: dict[int, str | None] = {}
        self.hooked: weakref.ref[torch.Tensor] | None = None


def _model_name(model: torch.nn.Module | None) -> str:
    """A model's class name as the user wrote it (:func:`user_class_name`)."""
    return "NoneType" if model is None else user_class_name(model)


def _call_codes() -> frozenset[types.CodeType]:
    """The code of ``Module._call_impl`` and of the closures in it (``inner``, where torch
    2.x calls the forward pre-hooks)."""
    code = torch.nn.Module._call_impl.__code__
    return frozenset({code, *(c for c in code.co_consts if isinstance(c, types.CodeType))})


_CALL_CODES = _call_codes()


def _call_kwargs(module: torch.nn.Module) -> dict[str, Any] | None:
    """The keyword arguments of ``module``'s call in progress, read from torch's
    ``Module._call_impl`` frame (torch gives its global forward pre-hooks the positional
    ones only); ``None`` where that frame is not found. Asked once per model call."""
    frame: types.FrameType | None = sys._getframe(1)
    for _ in range(8):
        if frame is None:
            return None
        if frame.f_code in _CALL_CODES:
            local = frame.f_locals
            if local.get("self") is module:
                kwargs = local.get("kwargs")
                return kwargs if isinstance(kwargs, dict) else None
        frame = frame.f_back
    return None


_CALL_IMPL = torch.nn.Module._call_impl.__code__


def _running_calls(frame: types.FrameType | None) -> collections.Counter[int]:
    """The modules whose call runs on this thread's Python stack from ``frame`` up: their
    ids, with how many of their calls are in progress."""
    running: collections.Counter[int] = collections.Counter()
    while frame is not None:
        if frame.f_code is _CALL_IMPL:
            running[id(frame.f_locals.get("self"))] += 1
        frame = frame.f_back
    return running


def _hook_backward(t: torch.Tensor, hook: Any) -> None:
    """``hook`` runs when backward reaches ``t``'s gradient."""
    node = t.grad_fn
    if node is not None:  # a node pre-hook: half the cost of a tensor hook
        node.register_prehook(hook)
    else:
        t.register_hook(hook)


def _nested_firsts(value: Any) -> list[torch.Tensor]:
    """The first tensor of each tuple in a tuple output (an RNN's packed output's ``data``
    and its ``h``), for an output with no tensor of its own at the top."""
    if not isinstance(value, (tuple, list)):
        return []
    return [v[0] for v in value if isinstance(v, tuple) and v and isinstance(v[0], torch.Tensor)]


def _first_tensor(value: Any) -> torch.Tensor | None:
    """The first tensor of a module output: itself, or in a tuple/list/dict (one level)."""
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, (tuple, list)):
        for v in value:
            if isinstance(v, torch.Tensor):
                return v
        return None
    if isinstance(value, dict):
        for v in value.values():
            if isinstance(v, torch.Tensor):
                return v
    return None


def _no_op(grad: Any) -> None:
    """A pre-hook that changes nothing: its dict's life is its node's."""


def _queue_callback(fn: Callable[[], None]) -> bool:
    try:
        torch.autograd.Variable._execution_engine.queue_callback(fn)
    except (RuntimeError, AttributeError) as exc:
        log.debug("cannot queue an end-of-backward callback: %s", exc)
        return False
    return True


class _Leave:
    """The handle that takes a block's thread off :data:`_BLOCK_THREADS` when it ends."""

    def __init__(self, ident: int) -> None:
        self.ident = ident

    def remove(self) -> None:
        _BLOCK_THREADS[self.ident] -= 1
        if _BLOCK_THREADS[self.ident] <= 0:
            del _BLOCK_THREADS[self.ident]


class _AroundCompiledCall:
    """The model's own hooks around the call ``model.compile()`` made (``pre(module, args,
    kwargs)`` before, ``post(module, args, output)`` after: ``output`` ``None`` while its
    exception is raised), until :meth:`remove` puts the compiled call back."""

    def __init__(
        self,
        model: torch.nn.Module,
        pre: Callable[[Any, Any, Any], None],
        post: Callable[[Any, Any, Any], None],
    ) -> None:
        self.model = model
        self.compiled = compiled = cast(Callable[..., Any], model._compiled_call_impl)

        def call(*args: Any, **kwargs: Any) -> Any:
            pre(model, args, kwargs)
            try:
                output = compiled(*args, **kwargs)
            except BaseException:
                post(model, args, None)
                raise
            post(model, args, output)
            return output

        self.call = call
        model._compiled_call_impl = call

    def remove(self) -> None:
        if self.model._compiled_call_impl is self.call:
            self.model._compiled_call_impl = self.compiled


def autocast_unsafe_loss(roots: Any, limit: int = 32) -> str | None:
    """The op CUDA's autocast refuses (``binary_cross_entropy``: ``nn.BCELoss``) among the
    first ``limit`` nodes of the graph backward starts from (a loss made of several: their
    sum, its mean), else ``None``. Sweep BY: the mixed-precision advice told a DCGAN with
    ``nn.BCELoss`` to autocast, which raises on a GPU."""
    tensors = [roots] if isinstance(roots, torch.Tensor) else roots
    if not isinstance(tensors, (list, tuple)):
        return None
    queue = [t.grad_fn for t in tensors if isinstance(t, torch.Tensor) and t.grad_fn is not None]
    seen = 0
    while queue and seen < limit:
        node = queue.pop(0)
        seen += 1
        found = _UNSAFE_GRAD_FNS.get(node.name())
        if found is not None:
            return found
        queue += [n for n, _ in node.next_functions if n is not None]
    return None


def _own_weights(module: torch.nn.Module) -> tuple[int, int]:
    """``(frozen, trainable)`` float32 bytes of ``module``'s own parameters: autocast casts a
    frozen float32 weight anew at each call of a half layer, and caches its casts of the
    trainable ones (``mixed-precision``)."""
    frozen = trainable = 0
    for p in module._parameters.values():
        if p is not None and p.dtype == torch.float32:
            if p.requires_grad:
                trainable += p.numel() * 4
            else:
                frozen += p.numel() * 4
    return frozen, trainable
