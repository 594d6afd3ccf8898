"""The live tracker: module, autograd and optimizer hooks that read device counters.

``with memkit.track(model, optimizer=opt) as tracker:`` installs

* forward pre/post hooks on every submodule of ``model`` (``per_module=True``), on ``model``
  alone (``per_module=False``), or, with no model, torch's global module hooks
  (``register_module_forward_pre_hook``/``register_module_forward_hook``);
* a gradient hook on each module's output tensor (registered by the forward post hook): it fires
  when backward reaches that module, which marks the start of the module's backward. The first
  one of a backward pass queues an autograd-engine callback that marks its end. memkit does not
  use ``register_full_backward_hook``: it wraps every module's inputs and outputs in an extra
  autograd function, which breaks in-place ops (``ReLU(inplace=True)``) and costs more;
* optimizer step pre/post hooks (``optimizer`` given), else the global
  ``register_optimizer_step_pre_hook``/``register_optimizer_step_post_hook``.

Hooks only read counters (:func:`memkit.devices.counter_reader`: one call returns allocated,
reserved and both peaks) and reset the peak, append a tuple to a bounded deque and update a few
integers: no sync, no subprocess, no device allocation. Anything heavier (the breakdown of the
peak into parameters, gradients, optimizer state and activations; the leak scan) runs at phase
or step boundaries, and only when a new peak or a growth was seen.

Peaks: every hook closes a *segment* (the time since the previous hook on that device): the
device's peak counter is read and reset. A segment's peak belongs to the phase and innermost
module running during it, so per-phase, per-step and per-module peaks are exact, not sampled.
Side effect: ``torch.cuda.max_memory_allocated()`` is reset at every hook while tracking; use the
report's peaks instead.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import sys
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from types import TracebackType
from typing import Any, Literal

import torch

from memkit.devices import (
    SimulatedBackend,
    counter_reader,
    current_device_index,
    get_backend,
    visible_devices,
)
from memkit.distributed import launched_rank, world_size
from memkit.oom import find_oom, oom_source, parse_oom_message
from memkit.tracking import leaks
from memkit.tracking.ranks import GATHER_TIMEOUT, RanksReport, RankWatch
from memkit.tracking.report import (
    PHASES,
    Breakdown,
    DeviceReport,
    LeakFinding,
    ModuleRecord,
    OomPostMortem,
    StepRecord,
    TimelinePoint,
    TrackReport,
)

__all__ = ["Tracker", "track"]

log = logging.getLogger(__name__)

_clock = time.perf_counter

FORWARD, BACKWARD, OPTIMIZER, OTHER = range(4)

DEFAULT_TIMELINE_LIMIT = 100_000
"""Counter readings kept per device (the most recent ones)."""

DEFAULT_STEP_LIMIT = 100_000
"""Step records kept per device (the most recent ones)."""


class _Frame:
    """One module call in progress (per thread)."""

    __slots__ = ("alloc_in", "children", "dev", "eval_grad", "max", "mid", "ms", "name")

    def __init__(self, name: str, mid: int, dev: _Device, alloc_in: int, ms: _ModuleStat) -> None:
        self.name = name
        self.ms = ms
        self.mid = mid
        self.dev = dev
        self.alloc_in = alloc_in
        self.max = alloc_in
        self.children = 0
        self.eval_grad = False


class _ModuleStat:
    __slots__ = (
        "act_max",
        "bw",
        "calls",
        "leaf",
        "over_max",
        "peak",
        "self_max",
        "step_id",
        "step_max",
        "step_sum",
    )

    def __init__(self, leaf: bool, bw: Callable[[torch.Tensor], None] | None) -> None:
        self.bw = bw
        self.calls = 0
        self.act_max = 0
        self.self_max = 0
        self.step_id = -1
        self.step_sum = 0
        self.step_max = 0
        self.peak = 0
        self.over_max = 0
        self.leaf = leaf


class _Device:
    """Everything recorded for one device; hot-path fields are plain attributes."""

    def __init__(self, key: str, backend: Any, timeline_limit: int, step_limit: int) -> None:
        self.key = key
        self.backend = backend
        self.read, self.reset = counter_reader(backend)
        a, r, _, _ = self.read()
        self.reset()
        self.baseline = a
        self.timeline: deque[tuple[float, int, int, str | None, int, int]] = deque(
            maxlen=timeline_limit
        )
        self.events = 0
        self.step_phase: list[int | None] = [None, None, None, None]
        self.phase_peak: list[int | None] = [None, None, None, None]
        self.step_peak = a
        self.step_peak_res = r
        self.peak = a
        self.peak_res = r
        self.pending: tuple[Any, ...] | None = None
        self.breakdown: Breakdown | None = None
        self.modules: dict[str, _ModuleStat] = {}
        self.steps: deque[StepRecord] = deque(maxlen=step_limit)
        self.step_start = a
        self.forward_base: int | None = a
        self.base_grads_none = True
        self.base_state_empty = True
        self.bw_module: str | None = None
        self.last = (a, r)
        self.grads_full = 0
        self.state_full = 0
        self.growth = leaks.GrowthDetector()
        self.leak: LeakFinding | None = None


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


def _queue_callback(fn: Callable[[], None]) -> bool:
    try:
        torch.autograd.Variable._execution_engine.queue_callback(fn)
    except (RuntimeError, AttributeError) as exc:
        log.debug("cannot queue an end-of-backward callback: %s", exc)
        return False
    return True


class Tracker:
    """Tracks memory per device, phase, step and module while a block runs.

    Use :func:`track` to create one. Re-entering a finished tracker is not supported.

    Args:
        model: the model (its submodules get hooks), or ``None`` for every module (global
            hooks). ``nn.DataParallel`` works: replicas share the hooks, and each record goes to
            the device its tensors are on.
        optimizer: an optimizer, several, or ``None`` for every optimizer (global hooks). Steps
            are counted from its ``step()`` (the first optimizer seen, with global hooks).
        device: the device to track (``"cuda:0"``, ``"cpu"`` for the simulated device); ``None``:
            the current accelerator, else the simulated cpu device. On an accelerator, other
            devices the model's tensors use are added as they appear.
        budget: the simulated device's size (``"300MiB"``), or a cap on a real one.
        per_module: hooks on every module (default); ``False``: on ``model`` only (or none at
            all without a model), for the least overhead.
        postmortem: ``"stderr"`` prints the OOM post-mortem there when an OOM leaves the block;
            ``None`` only logs it. It is on ``tracker.report().oom`` either way.
        timeline_limit: readings kept per device.
    """

    def __init__(
        self,
        model: torch.nn.Module | None = None,
        optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer] | None = None,
        *,
        device: str | torch.device | None = None,
        budget: int | str | None = None,
        per_module: bool = True,
        postmortem: str | None = "stderr",
        timeline_limit: int = DEFAULT_TIMELINE_LIMIT,
        leak_warmup: int = 2,
        leak_window: int = 3,
        gather_timeout: float = GATHER_TIMEOUT,
    ) -> None:
        if postmortem not in ("stderr", None):
            raise ValueError(f"postmortem must be 'stderr' or None, found {postmortem!r}")
        self.model = model
        if optimizer is None:
            self.optimizers: list[torch.optim.Optimizer] = []
        elif isinstance(optimizer, torch.optim.Optimizer):
            self.optimizers = [optimizer]
        else:
            self.optimizers = list(optimizer)
        self.per_module = per_module
        self.postmortem = postmortem
        self._device_arg = device
        self._budget = budget
        self._timeline_limit = timeline_limit
        self._leak_warmup = leak_warmup
        self._leak_window = leak_window
        self._handles: list[Any] = []
        self._stack_ctx: contextlib.ExitStack | None = None
        self._tls = threading.local()
        self._lock = threading.RLock()
        self._devices: dict[Any, _Device] = {}
        self._single: _Device | None = None
        self._primary: _Device | None = None
        self._kind = "cpu"
        self._phase = OTHER
        self._step = 0
        self._t0 = 0.0
        self._t_end: float | None = None
        self._step_t0 = 0.0
        self._active = False
        self._used = False
        self._manual_steps = False
        self._step_owner: weakref.ref[Any] | None = None
        self._roots: dict[int, tuple[weakref.ref[Any], dict[int, str]]] = {}
        self._global_root_count = 0
        self._seen_optimizers: dict[int, weakref.ref[Any]] = {}
        self._probe: torch.Tensor | None = None
        self._backward_depth = 0
        self._unwrap: tuple[Any, Any] | None = None
        self._eval_grad = 0
        self._eval_grad_bytes = 0
        # -- evidence for the advice rules (memkit/advice.py; issue #5) --
        self._autocast_forwards = 0
        self._grads_steps = 0
        self._grads_checked_step = 0
        self._dp_output_bytes = 0
        self._last_root: tuple[bool, bool] | None = None
        self._fail: tuple[int, _Device, int, int, str | None] | None = None
        self._scan: list[leaks.Candidate] | None = None
        self._scan_step = -1
        self._confirmed = False
        self._suspects: tuple[Any, ...] = ()
        self._report: TrackReport | None = None
        self._oom: OomPostMortem | None = None
        self.backend: Any = None
        self.notes: list[str] = []
        # -- across ranks (memkit/tracking/ranks.py) --
        self.gather_timeout = gather_timeout
        self._ranks_watch: RankWatch | None = None
        self._ranks_report: RanksReport | None = None

    # ------------------------------------------------------------------------------------
    # entering and leaving

    def __enter__(self) -> Tracker:
        if self._used:
            raise RuntimeError("a Tracker can be used for one block only; call memkit.track again")
        self._used = True
        backend = get_backend(self._device_arg, self._budget)
        self.backend = backend
        stack = contextlib.ExitStack()
        self._stack_ctx = stack
        try:
            self._kind = backend.device.type
            if isinstance(backend, SimulatedBackend):
                stack.enter_context(backend.activate())
                tracked = [x for x in (self.model, *self.optimizers) if x is not None]
                if tracked:
                    backend.track(*tracked)
                self.notes.append(
                    "simulated device: counts live tensor storages in the thread that entered "
                    "the block (other threads, e.g. DataParallel replicas, are not counted)"
                )
            self._t0 = time.perf_counter()
            self._step_t0 = self._t0
            primary = self._add_device(backend.device, backend)
            self._primary = primary
            if isinstance(backend, SimulatedBackend) or len(visible_devices()) <= 1:
                self._single = primary
            self._probe = self._find_probe()
            primary.base_grads_none = self._grads_none()
            primary.base_state_empty = self._state_empty()
            self._install()
            if RankWatch.wanted():
                self._ranks_watch = RankWatch(self, self.gather_timeout)
                self._ranks_watch.install()
            self._active = True
        except BaseException:
            self._remove()
            stack.close()
            raise
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> Literal[False]:
        try:
            self._active = False
            self._t_end = time.perf_counter()
            self._remove()
            with self._lock:
                self._close_all(None)
                for dev in self._devices.values():
                    self._resolve_pending(dev)
            if exc is not None and find_oom(exc) is not None:
                try:
                    self._oom = self._postmortem(exc, tb)
                except Exception:  # never hide the user's OOM behind our own error
                    log.exception("memkit could not build the OOM post-mortem")
                if self._oom is not None:
                    log.info("%s", self._oom)
                    if self.postmortem == "stderr":
                        sys.stderr.write(str(self._oom) + "\n")
                        sys.stderr.flush()
            if self._ranks_watch is not None:
                self._ranks_watch.remove()
                self._ranks_watch.finish(exc is None)
        finally:
            self._fail = None
            self._probe = None  # keep no reference to the model's tensors
            if self._stack_ctx is not None:
                self._stack_ctx.close()
        return False

    def _install(self) -> None:
        from torch.nn.modules import module as nn_module
        from torch.optim import optimizer as optim_module

        h = self._handles
        if self.model is not None:
            root_name = type(self.model).__name__
            targets: Iterable[tuple[str, torch.nn.Module]] = (
                self.model.named_modules() if self.per_module else [("", self.model)]
            )
            for name, mod in targets:
                label = name or root_name
                leaf = not any(True for _ in mod.children())
                h.append(mod.register_forward_pre_hook(self._make_pre(label, leaf)))
                h.append(mod.register_forward_hook(self._make_post(label), always_call=True))
            if isinstance(self.model, torch.nn.DataParallel):  # advice: dp-loss-on-replicas
                h.append(self.model.register_forward_hook(self._make_dp_output()))
        elif self.per_module:
            h.append(nn_module.register_module_forward_pre_hook(self._global_pre))
            h.append(nn_module.register_module_forward_hook(self._make_post(""), always_call=True))
        self._wrap_backward()
        if self.optimizers:
            for opt in self.optimizers:
                h.append(opt.register_step_pre_hook(self._opt_pre))
                h.append(opt.register_step_post_hook(self._opt_post))
        else:
            h.append(optim_module.register_optimizer_step_pre_hook(self._opt_pre))
            h.append(optim_module.register_optimizer_step_post_hook(self._opt_post))

    def _wrap_backward(self) -> None:
        """Mark backward's start and end exactly: wrap ``torch.autograd.backward`` (what
        ``Tensor.backward`` calls) for the block. The first gradient hook comes too late: the
        loss's own backward (e.g. the gradient of the logits) runs before it."""
        autograd = torch.autograd
        original = autograd.backward
        begin, end = self._begin_backward, self._end_backward

        def failed() -> None:
            with self._lock:
                self._backward_depth = max(0, self._backward_depth - 1)

        @functools.wraps(original)
        def backward(*args: Any, **kwargs: Any) -> Any:
            begin()
            try:
                result = original(*args, **kwargs)
            except BaseException:
                failed()  # keep the phase: a post-mortem reads it
                raise
            end()
            return result

        autograd.backward = backward
        self._unwrap = (original, backward)

    def _remove(self) -> None:
        if self._ranks_watch is not None:
            self._ranks_watch.remove()
        unwrap = self._unwrap
        if unwrap is not None:
            original, wrapper = unwrap
            if torch.autograd.backward is wrapper:
                torch.autograd.backward = original
            else:  # someone wrapped it after us: leave theirs, make ours a no-op
                log.debug("torch.autograd.backward was re-wrapped; leaving it")
            self._unwrap = None
        while self._handles:
            handle = self._handles.pop()
            try:
                handle.remove()
            except Exception:  # a handle whose owner is gone
                log.debug("could not remove hook %r", handle, exc_info=True)

    # ------------------------------------------------------------------------------------
    # devices

    def _add_device(self, device: torch.device, backend: Any = None) -> _Device:
        with self._lock:
            key = device.index if device.type != "cpu" else -1
            dev = self._devices.get(key)
            if dev is not None:
                return dev
            if backend is None:
                backend = get_backend(device)
            label = (
                str(device)
                if device.index is not None or device.type == "cpu"
                else (f"{device.type}:0")
            )
            dev = _Device(label, backend, self._timeline_limit, DEFAULT_STEP_LIMIT)
            dev.growth = leaks.GrowthDetector(self._leak_warmup, self._leak_window)
            dev.step_start = dev.baseline
            self._devices[key] = dev
            return dev

    def _dev_index(self, index: int) -> _Device:
        if index < 0:
            index = current_device_index(self._kind)
        dev = self._devices.get(index)
        if dev is None:
            dev = self._add_device(torch.device(self._kind, index))
        return dev

    def _dev_for_args(self, args: Any) -> _Device:
        single = self._single
        if single is not None:
            return single
        for a in args:
            if isinstance(a, torch.Tensor):
                return self._dev_index(a.get_device())
        return self._dev_index(-1)

    # ------------------------------------------------------------------------------------
    # the hot path

    def _close(self, dev: _Device, p: int, pr: int, owner: str | None) -> None:
        """Attribute a segment's peak ``p`` (reserved ``pr``) to the current phase."""
        ph = self._phase
        sp = dev.step_phase
        cur = sp[ph]
        if cur is None or p > cur:
            sp[ph] = p
        if p > dev.step_peak:
            dev.step_peak = p
        if pr > dev.step_peak_res:
            dev.step_peak_res = pr
        if pr > dev.peak_res:
            dev.peak_res = pr
        if p > dev.peak:
            dev.peak = p
            dev.pending = (
                p,
                self._step,
                ph,
                owner,
                dev.forward_base,
                dev.base_grads_none,
                dev.base_state_empty,
                self._grads_none(),
                self._state_empty(),
            )

    # Hooks on modules are plain closures, not bound methods or partials: ``copy.deepcopy`` of
    # a tracked model (an EMA copy) copies functions by reference, but would try to copy the
    # tracker (and its locks) through a bound method. Inert once the block has exited.
    def _make_pre(self, name: str, leaf: bool) -> Callable[[Any, Any], None]:
        impl = self._pre

        def pre(module: torch.nn.Module, args: Any) -> None:
            impl(name, leaf, module, args)

        return pre

    def _make_post(self, name: str) -> Callable[[Any, Any, Any], None]:
        impl = self._post

        def post(module: torch.nn.Module, args: Any, output: Any) -> None:
            impl(module, args, output)

        return post

    def _global_pre(self, module: torch.nn.Module, args: Any) -> None:
        if not self._active:
            return
        tls = self._tls
        try:
            stack = tls.stack
        except AttributeError:
            stack = tls.stack = []
        if not stack:
            names = tls.names = self._root_names(module)
        else:
            names = getattr(tls, "names", {})
        name = names.get(id(module))
        if name is None:
            name = type(module).__name__
        self._pre(name, not module._modules, module, args)

    def _pre(self, name: str, leaf: bool, module: torch.nn.Module, args: Any) -> None:
        if not self._active:
            return
        tls = self._tls
        try:
            stack = tls.stack
        except AttributeError:
            stack = tls.stack = []
        dev = self._single or self._dev_for_args(args)
        if not stack:
            self._root_pre(module)
        a, r, p, pr = dev.read()
        if p > a:
            dev.reset()
        if stack:
            top = stack[-1]
            self._close(dev, p, pr, top.name)
            if p > top.max:
                top.max = p
        else:
            self._close(dev, p, pr, None)
        ms = dev.modules.get(name)
        if ms is None:
            # gradient hooks only where backward does real work: modules with their own
            # parameters, and the top-level module (backward start in steps-only mode)
            hook = bool(module._parameters) or not stack
            bw = functools.partial(self._bw, name) if hook else None
            ms = dev.modules[name] = _ModuleStat(leaf, bw)
        frame = _Frame(name, id(module), dev, a, ms)
        if not stack and not module.training and torch.is_grad_enabled():
            frame.eval_grad = True
        stack.append(frame)
        dev.timeline.append((_clock() - self._t0, self._step, self._phase, name, a, r))
        dev.events += 1

    def _post(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        if not self._active:
            return
        tls = self._tls
        stack = getattr(tls, "stack", None)
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
        dev = frame.dev
        a, r, p, pr = dev.read()
        if p > a:
            dev.reset()
        name = frame.name
        self._close(dev, p, pr, name)
        fmax = frame.max if frame.max > p else p
        if output is None:
            exc = sys.exc_info()[1]
            if exc is not None and (self._fail is None or self._fail[0] != id(exc)):
                self._fail = (id(exc), dev, self._phase, self._step, name)
        alloc_in = frame.alloc_in
        delta = a - alloc_in
        ms = frame.ms
        ms.calls += 1
        if delta > ms.act_max:
            ms.act_max = delta
        own = delta - frame.children
        if own > ms.self_max:
            ms.self_max = own
        step = self._step
        if ms.step_id != step:
            ms.step_id = step
            ms.step_sum = delta
        else:
            ms.step_sum += delta
        if ms.step_sum > ms.step_max:
            ms.step_max = ms.step_sum
        if fmax > ms.peak:
            ms.peak = fmax
        if fmax - alloc_in > ms.over_max:
            ms.over_max = fmax - alloc_in
        if stack:
            parent = stack[-1]
            parent.children += delta
            if fmax > parent.max:
                parent.max = fmax
        else:
            if frame.eval_grad:
                self._eval_grad += 1
                if delta > self._eval_grad_bytes:
                    self._eval_grad_bytes = delta
            if dev.pending is not None:  # a new peak in this forward: categorise it now
                with self._lock:
                    self._resolve_pending(dev)
        bw = ms.bw
        if bw is not None:
            t = output if type(output) is torch.Tensor else _first_tensor(output)
            if t is not None and t.requires_grad:
                last = getattr(tls, "hooked", None)
                if last is None or last() is not t:
                    t.register_hook(bw)
                    tls.hooked = weakref.ref(t)
        dev.timeline.append((_clock() - self._t0, step, self._phase, name, a, r))
        dev.events += 1

    def _bw(self, name: str, grad: torch.Tensor) -> None:
        if not self._active:
            return
        if self._phase != BACKWARD:  # a backward that did not go through autograd.backward
            with self._lock:
                if self._phase != BACKWARD:
                    self._transition(BACKWARD)
                    _queue_callback(self._end_queued)
        dev = self._single or self._dev_index(grad.get_device())
        if self.per_module:
            a, r, p, pr = dev.read()
            if p > a:
                dev.reset()
            self._close(dev, p, pr, dev.bw_module)
            dev.timeline.append((_clock() - self._t0, self._step, BACKWARD, name, a, r))
            dev.events += 1
        dev.bw_module = name

    def _begin_backward(self) -> None:
        if not self._active:
            return
        with self._lock:
            if self._phase != BACKWARD:
                self._transition(BACKWARD)
            self._backward_depth += 1

    def _end_backward(self) -> None:
        if not self._active:
            return
        with self._lock:
            if self._backward_depth > 0:
                self._backward_depth -= 1
            if self._phase == BACKWARD and self._backward_depth == 0:
                self._transition(OTHER)

    def _end_queued(self) -> None:
        if self._active and self._backward_depth == 0:
            with self._lock:
                if self._phase == BACKWARD:
                    self._transition(OTHER)

    def _root_pre(self, module: torch.nn.Module) -> None:
        self._last_root = (module.training, torch.is_grad_enabled())
        if _autocast_on(self._kind):  # advice: mixed-precision
            self._autocast_forwards += 1
        if self._phase != FORWARD:
            with self._lock:
                if self._phase != FORWARD:
                    self._transition(FORWARD)
                    # advice: zero-grad-keeps-grads (a step's first forward, from step 1 on)
                    if self._step > self._grads_checked_step and module.training:
                        self._grads_checked_step = self._step
                        if not self._grads_none():
                            self._grads_steps += 1

    def _make_dp_output(self) -> Callable[[Any, Any, Any], None]:
        """A forward hook on a DataParallel model: the largest gathered output, in bytes."""

        def hook(module: torch.nn.Module, args: Any, output: Any) -> None:
            if not self._active:
                return
            values = output.values() if isinstance(output, dict) else output
            tensors = [output] if isinstance(output, torch.Tensor) else list(values or ())
            size = sum(
                int(t.numel() * t.element_size()) for t in tensors if isinstance(t, torch.Tensor)
            )
            if size > self._dp_output_bytes:
                self._dp_output_bytes = size

        return hook

    def _advice_evidence(self) -> dict[str, Any]:
        """What the advice rules need that the device records do not hold (cold path)."""
        sizes: dict[str, int] = {}
        for mod in self._root_modules():
            for p in mod.parameters():
                if p.requires_grad and p.is_floating_point():
                    key = str(p.dtype).replace("torch.", "")
                    sizes[key] = sizes.get(key, 0) + int(p.numel() * p.element_size())
        opts = self._all_optimizers()
        out: dict[str, Any] = {
            "param_dtype": max(sizes, key=lambda k: sizes[k]) if sizes else None,
            "optimizer_name": type(opts[0]).__name__ if opts else None,
            "autocast_forwards": self._autocast_forwards,
            "steps_with_grads_at_forward": self._grads_steps,
            "dp_output_bytes": self._dp_output_bytes,
        }
        model = self.model
        if isinstance(model, torch.nn.DataParallel) and model.device_ids:
            ids = tuple(int(getattr(d, "index", d)) for d in model.device_ids)
            out["dp_device_ids"] = ids
            out["dp_output_device"] = f"{self._kind}:{int(getattr(model, 'output_device', ids[0]))}"
        return out

    def _opt_pre(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if not self._active:
            return
        if id(optimizer) not in self._seen_optimizers:
            self._seen_optimizers[id(optimizer)] = weakref.ref(optimizer)
            if self._step_owner is None:
                self._step_owner = weakref.ref(optimizer)
            if self._probe is None:
                self._probe = self._find_probe()
        if self._ranks_watch is not None:
            self._ranks_watch.on_step(optimizer)
        with self._lock:
            self._transition(OPTIMIZER)

    def _opt_post(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if not self._active:
            return
        with self._lock:
            owner = self._step_owner() if self._step_owner is not None else None
            if not self._manual_steps and (owner is None or owner is optimizer):
                self._boundary(sys._getframe(1))
            else:
                self._transition(OTHER)

    # ------------------------------------------------------------------------------------
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
                dev.base_grads_none = self._grads_none()
                dev.base_state_empty = self._state_empty()
            if phase != BACKWARD:
                dev.bw_module = None
        self._phase = phase

    def _boundary(self, frame: Any) -> None:
        self._close_all(None)
        now = time.perf_counter()
        growing: list[_Device] = []
        for dev in self._devices.values():
            self._resolve_pending(dev)
            a, r = dev.last
            dev.steps.append(
                StepRecord(
                    step=self._step,
                    start_allocated=dev.step_start,
                    end_allocated=a,
                    peak_allocated=dev.step_peak,
                    peak_reserved=dev.step_peak_res,
                    phase_peaks=dict(zip(PHASES, dev.step_phase, strict=True)),
                    duration_s=now - self._step_t0,
                )
            )
            for i, v in enumerate(dev.step_phase):
                cur = dev.phase_peak[i]
                if v is not None and (cur is None or v > cur):
                    dev.phase_peak[i] = v
            dev.step_phase = [None, None, None, None]
            dev.step_peak, dev.step_peak_res = a, r
            dev.step_start = a
            dev.forward_base = a
            dev.base_grads_none = self._grads_none()
            dev.base_state_empty = self._state_empty()
            dev.bw_module = None
            if self._step < 3 or (dev.grads_full == 0 and not self._grads_none()):
                # remember the full gradient and state sizes while they exist (first steps only)
                _, g, st = self._persistent(dev)
                dev.grads_full = max(dev.grads_full, g)
                dev.state_full = max(dev.state_full, st)
            if dev.growth.observe(self._step, a):
                growing.append(dev)
        self._step += 1
        self._step_t0 = now
        self._phase = OTHER
        if growing:
            self._on_growth(growing, frame)

    def step(self) -> None:
        """Mark a step boundary (for loops without an optimizer, or to count steps yourself).

        Once called, optimizer steps no longer count as boundaries: only these calls do.
        """
        if not self._active:
            return
        with self._lock:
            self._manual_steps = True
            self._boundary(sys._getframe(1))

    # ------------------------------------------------------------------------------------
    # leaks

    def _on_growth(self, devices: list[_Device], frame: Any) -> None:
        scan_now = self._scan is None or (not self._confirmed and self._step > self._scan_step)
        if scan_now:
            try:
                current = leaks.scan_frames(frame)
            except Exception:  # inspection must never break training
                log.debug("leak scan failed", exc_info=True)
                current = []
            suspects = leaks.compare_scans(self._scan or [], current)
            if self._scan is not None and not any(s.growing for s in suspects):
                suspects = leaks.compare_scans([], current)
            else:
                self._confirmed = self._confirmed or any(s.growing for s in suspects)
            self._scan = current
            self._scan_step = self._step
            self._suspects = tuple(suspects)
        for dev in devices:
            growth, first, steps = dev.growth.finding or (0, self._step, 0)
            first_time = dev.leak is None
            dev.leak = LeakFinding(dev.key, growth, first, steps, self._suspects)
            if first_time:
                log.warning(
                    "memkit: memory on %s grows by %d bytes per step (%d steps)",
                    dev.key,
                    growth,
                    steps,
                )

    # ------------------------------------------------------------------------------------
    # model, optimizer and the breakdown (cold path)

    def _root_names(self, module: torch.nn.Module) -> dict[int, str]:
        entry = self._roots.get(id(module))
        if entry is not None and entry[0]() is module:
            return entry[1]
        first = not self._roots
        prefix = "" if first else type(module).__name__ + "."
        names = {id(module): type(module).__name__}
        for path, sub in module.named_modules():
            if path:
                names[id(sub)] = prefix + path
        if len(self._roots) > 256:
            self._roots = {k: v for k, v in self._roots.items() if v[0]() is not None}
        self._roots[id(module)] = (weakref.ref(module), names)
        if self._probe is None:
            self._probe = self._find_probe()
        return names

    def _root_modules(self) -> list[torch.nn.Module]:
        if self.model is not None:
            return [self.model]
        out = []
        for ref, _ in self._roots.values():
            mod = ref()
            if mod is not None:
                out.append(mod)
        return out

    def _all_optimizers(self) -> list[Any]:
        if self.optimizers:
            return list(self.optimizers)
        return [o for o in (r() for r in self._seen_optimizers.values()) if o is not None]

    def _find_probe(self) -> torch.Tensor | None:
        for mod in self._root_modules():
            for p in mod.parameters():
                if p.requires_grad:
                    return p
        for opt in self._all_optimizers():
            for group in opt.param_groups:
                for p in group["params"]:
                    if p.requires_grad:
                        return p
        return None

    def _grads_none(self) -> bool:
        return self._probe is None or self._probe.grad is None

    def _state_empty(self) -> bool:
        return all(not opt.state for opt in self._all_optimizers())

    def _persistent(self, dev: _Device) -> tuple[int, int, int]:
        """Bytes of parameters (and buffers), gradients and optimizer state on ``dev``."""
        target = dev.backend.device
        seen: set[tuple[int, int]] = set()

        def size(t: torch.Tensor) -> int:
            if t.device.type != target.type or (
                target.index is not None and t.device.index not in (None, target.index)
            ):
                return 0
            try:
                storage = t.untyped_storage()
            except (RuntimeError, NotImplementedError):
                return 0
            key = (storage.data_ptr(), storage.nbytes())
            if key in seen or storage.nbytes() == 0:
                return 0
            seen.add(key)
            return int(storage.nbytes())

        params = grads = state = 0
        all_params: list[torch.Tensor] = []
        for mod in self._root_modules():
            all_params.extend(mod.parameters())
            for b in mod.buffers():
                params += size(b)
        for opt in self._all_optimizers():
            for group in opt.param_groups:
                all_params.extend(group["params"])
        for p in all_params:
            params += size(p)
        for p in all_params:
            if p.grad is not None:
                grads += size(p.grad)
        for opt in self._all_optimizers():
            for st in opt.state.values():
                for v in st.values() if isinstance(st, dict) else ():
                    if isinstance(v, torch.Tensor):
                        state += size(v)
        if (
            params == 0
            and isinstance(self.model, torch.nn.DataParallel)
            and dev is not self._primary
        ):
            # replicas on the other devices: broadcast copies of the weights for each forward
            params = sum(int(p.numel() * p.element_size()) for p in self.model.parameters())
        return params, grads, state

    def _breakdown(
        self,
        dev: _Device,
        total: int,
        step: int | None,
        phase: int,
        module: str | None,
        base: int | None,
        grads_none: bool,
        state_empty: bool,
        grads_none_now: bool,
        state_empty_now: bool,
    ) -> Breakdown:
        params, grads_now, state_now = self._persistent(dev)
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
        rest = total - params - grads - state
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
            other = max(0, base - params - grads_base - state_base)
            acts = max(0, rest - other)
            other = rest - acts
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
        )

    def _resolve_pending(self, dev: _Device) -> None:
        pending = dev.pending
        if pending is None:
            return
        dev.pending = None
        try:
            dev.breakdown = self._breakdown(dev, *pending)
        except Exception:  # the breakdown is best effort
            log.debug("breakdown failed", exc_info=True)

    # ------------------------------------------------------------------------------------
    # post-mortem

    def _postmortem(self, exc: BaseException, tb: TracebackType | None) -> OomPostMortem:
        from memkit.tracking import rules

        oom = find_oom(exc) or exc
        details = parse_oom_message(oom)
        chain_ids: set[int] = set()
        e: BaseException | None = exc
        while e is not None and len(chain_ids) < 64:
            chain_ids.add(id(e))
            e = e.__cause__ or e.__context__
        fail = self._fail if self._fail is not None and self._fail[0] in chain_ids else None
        if fail is not None:
            _, dev, phase, step, module = fail
        else:
            dev = self._primary or next(iter(self._devices.values()))
            phase, step = self._phase, self._step
            module = dev.bw_module if phase == BACKWARD else None
        if details.device_index is not None and self._single is None:
            dev = self._devices.get(details.device_index, dev)
        a, _ = dev.last
        breakdown = self._breakdown(
            dev,
            a,
            step,
            phase,
            module,
            dev.forward_base,
            dev.base_grads_none,
            dev.base_state_empty,
            self._grads_none(),
            self._state_empty(),
        )
        cap = dev.backend.capacity()
        capacity = details.capacity if details.capacity is not None else cap.total
        free = details.free if details.free is not None else cap.free
        records = self._module_records(dev)
        top = sorted(
            records,
            key=lambda m: m.activation_bytes_per_step or m.self_activation_bytes,
            reverse=True,
        )
        top_modules = tuple(
            (m.path, m.activation_bytes_per_step or m.self_activation_bytes)
            for m in top
            if m.leaf and (m.activation_bytes_per_step or m.self_activation_bytes) > 0
        )[:5]
        leak = dev.leak
        if leak is not None and not self._confirmed and tb is not None:
            inner = tb
            while inner.tb_next is not None:
                inner = inner.tb_next
            with contextlib.suppress(Exception):
                suspects = leaks.compare_scans(self._scan or [], leaks.scan_frames(inner.tb_frame))
                if any(s.growing for s in suspects):
                    leak = LeakFinding(
                        leak.device,
                        leak.growth_per_step,
                        leak.first_step,
                        leak.steps,
                        tuple(suspects),
                    )
                    dev.leak = leak
        training, grad_enabled = self._last_root if self._last_root else (None, None)
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
            top_modules=top_modules,
            leak=leak,
            advice=(),
            rank=launched_rank(),
        )
        advice = rules.oom_advice(pm, details.reserved_unallocated, details=details)
        return OomPostMortem(**{**pm.__dict__, "advice": tuple(advice)})

    # ------------------------------------------------------------------------------------
    # the report

    def _module_records(self, dev: _Device) -> list[ModuleRecord]:
        out = []
        for name, ms in dev.modules.items():
            if ms.calls == 0:
                continue
            out.append(
                ModuleRecord(
                    path=name,
                    device=dev.key,
                    calls=ms.calls,
                    activation_bytes=ms.act_max,
                    self_activation_bytes=ms.self_max,
                    activation_bytes_per_step=ms.step_max,
                    peak_allocated=ms.peak,
                    peak_over_entry=ms.over_max,
                    leaf=ms.leaf,
                )
            )
        out.sort(key=lambda m: m.self_activation_bytes, reverse=True)
        return out

    def report(self) -> TrackReport:
        """The report so far (inside the block: a snapshot; after it: the final one)."""
        from memkit.tracking import rules

        with self._lock:
            if self._active:
                self._close_all(None)
            devices = []
            for key in sorted(self._devices, key=lambda k: (k is None, k)):
                dev = self._devices[key]
                self._resolve_pending(dev)
                phase_peaks: dict[str, int | None] = {}
                for i, name in enumerate(PHASES):
                    vals = [v for v in (dev.phase_peak[i], dev.step_phase[i]) if v is not None]
                    phase_peaks[name] = max(vals) if vals else None
                timeline = tuple(
                    TimelinePoint(t, s, PHASES[ph], m, a, r) for t, s, ph, m, a, r in dev.timeline
                )
                cap = dev.backend.capacity()
                devices.append(
                    DeviceReport(
                        device=dev.key,
                        name=dev.backend.name(),
                        accounting=dev.backend.accounting,
                        capacity=cap.total,
                        baseline_allocated=dev.baseline,
                        final_allocated=dev.last[0],
                        peak_allocated=dev.peak,
                        peak_reserved=dev.peak_res,
                        phase_peaks=phase_peaks,
                        steps=tuple(dev.steps),
                        modules=tuple(self._module_records(dev)),
                        breakdown=dev.breakdown,
                        timeline=timeline,
                        timeline_dropped=max(0, dev.events - len(dev.timeline)),
                        leak=dev.leak,
                    )
                )
        end = self._t_end if self._t_end is not None else time.perf_counter()
        rank = launched_rank()
        world = None if rank is None else world_size()
        report = TrackReport(
            devices=tuple(devices),
            steps=self._step,
            mode="per-module" if self.per_module else "steps-only",
            duration_s=end - self._t0,
            oom=self._oom,
            eval_grad_forwards=self._eval_grad,
            rank=rank,
            world_size=world,
            notes=tuple(self.notes),
            ranks=self._ranks_report,
            **self._advice_evidence(),
        )
        advice = rules.track_advice(report, eval_grad_bytes=self._eval_grad_bytes)
        return TrackReport(**{**report.__dict__, "advice": tuple(advice)})

    @property
    def current_step(self) -> int:
        """Steps completed so far."""
        return self._step

    @property
    def phase(self) -> str:
        """The phase running now."""
        return PHASES[self._phase]


def _autocast_on(kind: str) -> bool:
    try:
        return bool(torch.is_autocast_enabled(kind))
    except (RuntimeError, TypeError):  # a device type autocast does not know (meta)
        return False


def track(
    model: torch.nn.Module | None = None,
    optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer] | None = None,
    *,
    device: str | torch.device | None = None,
    budget: int | str | None = None,
    per_module: bool = True,
    postmortem: str | None = "stderr",
    timeline_limit: int = DEFAULT_TIMELINE_LIMIT,
    gather_timeout: float = GATHER_TIMEOUT,
) -> Tracker:
    """Track memory per device, phase, step and module while the ``with`` block runs.

    Under a ``torch.distributed`` process group every rank tracks its own device, and when
    the block ends (or when the script calls ``destroy_process_group()``) each rank's summary
    is gathered to rank 0, whose ``report().ranks`` holds the per-rank table, the imbalance,
    the rank closest to its capacity and the DDP advice (docs/distributed.md). All ranks must
    run the block; a rank missing for ``gather_timeout`` seconds leaves a note, not a hang.

    Args:
        model: the model to hook, or ``None`` for every module (global hooks).
        optimizer: the optimizer(s) whose steps count as step boundaries, or ``None`` for any.
        device: ``"cuda:0"``..., ``"cpu"`` (the simulated device), or ``None`` for the current
            accelerator (else the simulated cpu device).
        budget: size of the simulated device (``"300MiB"``): the block raises
            ``torch.OutOfMemoryError`` when it is crossed, as a GPU of that size would.
        per_module: hooks on every module (default), or on the model only (least overhead).
        postmortem: ``"stderr"`` (default) prints the diagnosis of an OOM that leaves the block;
            ``None`` only logs it. The exception propagates unchanged either way.
        timeline_limit: counter readings kept per device.

    Examples:
        >>> import torch, memkit
        >>> model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(),
        ...                             torch.nn.Linear(256, 10))
        >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> with memkit.track(model, opt, device="cpu", budget="64MiB") as tracker:
        ...     for _ in range(3):
        ...         model(torch.randn(32, 64)).sum().backward()
        ...         opt.step(); opt.zero_grad()
        >>> report = tracker.report()
        >>> report.steps, report.devices[0].phase_peaks["backward"] is not None
        (3, True)
    """
    return Tracker(
        model,
        optimizer,
        device=device,
        budget=budget,
        per_module=per_module,
        postmortem=postmortem,
        timeline_limit=timeline_limit,
        gather_timeout=gather_timeout,
    )
