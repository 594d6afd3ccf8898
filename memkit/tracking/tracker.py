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
import dataclasses
import functools
import logging
import math
import sys
import threading
import time
import warnings
import weakref
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any, Literal

import torch
from torch.utils._python_dispatch import _disable_current_modes

from memkit.devices import (
    SimulatedBackend,
    VirtualDeviceBackend,
    counter_reader,
    current_device_index,
    get_backend,
    visible_devices,
)
from memkit.distributed import launched_rank, world_size
from memkit.history import DEFAULT_MAX_ENTRIES, MemoryHistory
from memkit.oom import find_oom, oom_source, parse_oom_message
from memkit.tracking import leaks
from memkit.tracking.rank_gather import GATHER_TIMEOUT, RanksReport, RankWatch
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
from memkit.tracking.run import check_writable, rank_path
from memkit.virtual_devices import VirtualDevices, active_virtual_devices, is_active

__all__ = ["Tracker", "track"]

log = logging.getLogger(__name__)

_clock = time.perf_counter

FORWARD, BACKWARD, OPTIMIZER, OTHER, EVAL = range(5)

TRAIN_PASS, EVAL_PASS, RECOMPUTE = range(3)
"""What a root forward is: a training forward (builds a graph for backward), an evaluation
pass (``no_grad``/``inference_mode``, eval mode, or nothing that could build a graph), or the
recomputation of a checkpointed forward inside backward."""

SCAN_PERIOD = 25
"""Steps between rounds of three graph scans (leaks that device memory does not show)."""

_COMPILE_WARNING = r"Using `torch\.compile\(module\)` when there are global hooks"

DEFAULT_TIMELINE_LIMIT = 100_000
"""Counter readings kept per device (the most recent ones)."""

DEFAULT_STEP_LIMIT = 100_000
"""Step records kept per device (the most recent ones)."""


class _Frame:
    """One module call in progress (per thread)."""

    __slots__ = ("alloc_in", "children", "dev", "eval_grad", "kind", "max", "mid", "ms", "name")

    def __init__(
        self, name: str, mid: int, dev: _Device, alloc_in: int, ms: _ModuleStat, kind: int
    ) -> None:
        self.name = name
        self.ms = ms
        self.mid = mid
        self.dev = dev
        self.alloc_in = alloc_in
        self.max = alloc_in
        self.children = 0
        self.eval_grad = False
        self.kind = kind


class _Ignored:
    """A module call outside the trained model (a loss module, a data transform)."""

    __slots__ = ("mid",)
    kind = -1

    def __init__(self, mid: int) -> None:
        self.mid = mid


class _Root:
    """What the tracker knows about one top-level module it has seen (cold path)."""

    __slots__ = ("keys", "model", "ref", "trainable")

    def __init__(self, module: torch.nn.Module, keys: dict[int, str | None]) -> None:
        self.ref = weakref.ref(module)
        self.keys = keys  # id(submodule) -> module key (None: a transparent wrapper)
        params = [p.requires_grad for p in module.parameters()]
        self.model = bool(params)  # only a module with parameters can be the trained model
        self.trainable = any(params)


class _ModuleStat:
    __slots__ = (
        "act_max",
        "bw",
        "calls",
        "eval_calls",
        "leaf",
        "over_max",
        "peak",
        "recompute_calls",
        "self_max",
        "step_id",
        "step_max",
        "step_sum",
        "type_name",
    )

    def __init__(
        self, leaf: bool, bw: Callable[[torch.Tensor], None] | None, type_name: str
    ) -> None:
        self.bw = bw
        self.type_name = type_name
        self.calls = 0
        self.eval_calls = 0
        self.recompute_calls = 0
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
        self.step_phase: list[int | None] = [None] * len(PHASES)
        self.phase_peak: list[int | None] = [None] * len(PHASES)
        self.step_peak = a
        self.step_peak_res = r
        self.peak = a
        self.train_peak = a
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
        self.params_full = 0
        self.grads_full = 0
        self.state_full = 0
        self.backwards = 0  # training backward passes in the current step
        self.growth = leaks.GrowthDetector()
        self.leak: LeakFinding | None = None
        self.eval_saved: int | None = None  # the step's eval peak before begin_eval()
        self.eval_window: int | None = None  # the last begin_eval()..end_eval() peak


class _Restore:
    """A removable handle that puts an attribute back (if nobody replaced it since)."""

    def __init__(self, owner: Any, name: str, original: Any, replacement: Any) -> None:
        self.owner, self.name, self.original, self.replacement = owner, name, original, replacement

    def remove(self) -> None:
        if getattr(self.owner, self.name) is self.replacement:
            setattr(self.owner, self.name, self.original)


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
            the virtual devices of an enclosing ``memkit.simulate(..., devices=N)`` block, else
            the current accelerator, else the simulated cpu device. A
            :class:`~memkit.virtual_devices.VirtualDevices` tracks its devices (entered here if
            not already). On an accelerator or virtual devices, other devices the model's
            tensors use are added as they appear.
        budget: the simulated device's size (``"300MiB"``), or a cap on a real one.
        per_module: hooks on every module (default); ``False``: on ``model`` only (or none at
            all without a model), for the least overhead.
        postmortem: ``"stderr"`` prints the OOM post-mortem there when an OOM leaves the block;
            ``None`` only logs it. It is on ``tracker.report().oom`` either way.
        timeline_limit: readings kept per device.
        memory_history: a file to write PyTorch's memory snapshot to when the block ends (also
            when it ends with an OOM): on CUDA PyTorch's own recording, on the simulated device
            memkit's (docs/memory-history.md). Under torchrun each rank writes
            ``NAME.rankN.EXT``.
        history_entries: events the memory history keeps (the most recent).
    """

    def __init__(
        self,
        model: torch.nn.Module | None = None,
        optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer] | None = None,
        *,
        device: str | torch.device | VirtualDevices | None = None,
        budget: int | str | None = None,
        per_module: bool = True,
        postmortem: str | None = "stderr",
        timeline_limit: int = DEFAULT_TIMELINE_LIMIT,
        leak_warmup: int = 2,
        leak_window: int = 3,
        gather_timeout: float = GATHER_TIMEOUT,
        memory_history: str | Path | None = None,
        history_entries: int = DEFAULT_MAX_ENTRIES,
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
        self._roots: dict[int, _Root] = {}
        self._owners: dict[int, _Root] = {}  # id(submodule) -> the root it belongs to
        self._sim: SimulatedBackend | None = None
        self._vd: VirtualDevices | None = None
        self._eval_forwards = 0
        self._trained = False
        self._failed = False  # an exception is leaving the block: what it holds is no peak
        self._eval_input: tuple[int, ...] | None = None
        self._eval_return = OTHER
        self._eval_hold = 0  # begin_eval() calls not yet ended: the eval phase is held
        self._last_input: tuple[int, ...] | None = None
        self._backward_steps = 0  # steps counted from backward passes, not yet confirmed
        self._backwards_in_step = 0
        self._warning_filter: Any = None
        self._seen_optimizers: dict[int, weakref.ref[Any]] = {}
        self._probe: torch.Tensor | None = None
        self._backward_depth = 0
        self._unwrap: tuple[Any, Any] | None = None
        self._eval_grad = 0
        self._eval_grad_bytes = 0
        # -- evidence for the advice rules, captured while the objects are alive --
        self._param_dtype: str | None = None
        self._optimizer_name: str | None = None
        self._state_was_empty = True
        self._graph_scans: list[list[leaks.Candidate]] = []
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
        # -- across ranks (memkit/tracking/rank_gather.py) --
        self.gather_timeout = gather_timeout
        self._ranks_watch: RankWatch | None = None
        self._ranks_report: RanksReport | None = None
        # -- memory history (memkit/history.py) --
        self._history_path = None if memory_history is None else Path(memory_history)
        self._history_entries = history_entries
        self._history: MemoryHistory | None = None
        self.history_file: Path | None = None
        """Where the memory history was written (after the block)."""
        self.history_error: str | None = None
        """Why it could not be written, if it could not."""

    # ------------------------------------------------------------------------------------
    # entering and leaving

    def __enter__(self) -> Tracker:
        if self._used:
            raise RuntimeError("a Tracker can be used for one block only; call memkit.track again")
        self._used = True
        vd = self._virtual_devices()
        backend: Any = (
            VirtualDeviceBackend(vd, self._first_virtual(vd))
            if vd is not None
            else get_backend(self._device_arg, self._budget)  # type: ignore[arg-type]
        )
        self.backend = backend
        if self._history_path is not None:  # checked before anything is hooked
            path = rank_path(self._history_path)
            check_writable(path, "memory_history")
            self._history = MemoryHistory(backend, path, max_entries=self._history_entries)
        stack = contextlib.ExitStack()
        self._stack_ctx = stack
        try:
            if vd is not None:
                self._vd = vd
                if not is_active(vd):
                    stack.enter_context(vd)
                self.notes.append(
                    f"{vd.n} virtual devices (memkit.simulate(devices={vd.n})): each device's "
                    "peak and current bytes are its tagged storages'; replicas of memkit's "
                    "DataParallel stand-in run one after another in this thread"
                )
            self._kind = backend.device.type
            if self._history is not None:  # before the tracked objects are counted
                self._history.start()
                stack.callback(self._history.stop)
            if isinstance(backend, SimulatedBackend):
                self._sim = backend
                stack.enter_context(backend.activate())
                tracked = [x for x in (self.model, *self.optimizers) if x is not None]
                if tracked:
                    backend.track(*tracked)
                # host-side work between steps (datasets, data loading) is not device memory
                backend.count_ops(False, False)
                stack.callback(backend.count_ops, True, True)
                self.notes.append(
                    "simulated device: counts the model, its inputs and what training and "
                    "evaluation steps create, in the thread that entered the block (not "
                    "datasets or data loading; not other threads, e.g. DataParallel replicas)"
                )
            self._t0 = time.perf_counter()
            self._step_t0 = self._t0
            primary = self._add_device(backend.device, backend)
            self._primary = primary
            if vd is None and (
                isinstance(backend, SimulatedBackend) or len(visible_devices()) <= 1
            ):
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
            self._write_history()  # first: after an OOM, the failed step's tensors are alive
            if exc is None and self._backwards_in_step and self._step_rule() == "backward":
                with self._lock:  # the last step of a loop without an optimizer
                    self._boundary(None)
            self._active = False
            self._t_end = time.perf_counter()
            self._remove()
            with self._lock:
                self._failed = exc is not None
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

    def _write_history(self) -> None:
        history = self._history
        if history is None:
            return
        try:
            self.history_file = history.dump()
        except Exception as exc:  # never hide the user's exception behind our own
            self.history_error = f"{type(exc).__name__}: {exc}"
            log.warning("memkit could not write the memory history: %s", self.history_error)
            self.notes.append(
                f"memory history: could not write {history.path} ({self.history_error})"
            )
        else:
            self.notes.append(
                f"memory history: {self.history_file} (open it at https://pytorch.org/memory_viz, "
                f"or: memkit inspect {self.history_file})"
            )

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
        else:  # every module: the trained model is found as its forward runs
            h.append(nn_module.register_module_forward_pre_hook(self._global_pre))
            h.append(nn_module.register_module_forward_hook(self._make_post(""), always_call=True))
            # torch warns once per call site that global hooks also fire for torch.compile's
            # wrapper; memkit expects that and keeps the user's stderr quiet
            before = list(warnings.filters)
            warnings.filterwarnings("ignore", message=_COMPILE_WARNING)
            added = warnings.filters[0]
            self._warning_filter = None if added in before else added  # a user's stays
        self._wrap_backward()
        self._wrap_data_loading()
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

    def _wrap_data_loading(self) -> None:
        """Data loading is host work: while a DataLoader fetches a batch (datasets, transforms,
        collation), the simulated device counts nothing."""
        sim = self._sim
        if sim is None:
            return
        from torch.utils.data import dataloader

        cls = dataloader._BaseDataLoaderIter
        original = cls.__next__

        @functools.wraps(original)
        def fetch(it: Any) -> Any:
            acct = sim.accountant
            if _only_mode(acct):  # the usual case: leave the dispatch mode for the fetch
                with _disable_current_modes():
                    return original(it)
            if not _mode_active(acct):  # another thread (a prefetcher): it counts nothing
                return original(it)
            saved = acct.counting, acct.adopting
            sim.count_ops(False, False)
            try:
                return original(it)
            finally:
                sim.count_ops(*saved)

        cls.__next__ = fetch  # type: ignore[method-assign,assignment]
        self._handles.append(_Restore(cls, "__next__", original, fetch))

    def _remove(self) -> None:
        if self._warning_filter is not None:
            with contextlib.suppress(ValueError):
                warnings.filters.remove(self._warning_filter)  # type: ignore[attr-defined]
                warnings._filters_mutated()  # type: ignore[attr-defined]
            self._warning_filter = None
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

    def _virtual_devices(self) -> VirtualDevices | None:
        """The virtual devices to track: given as ``device``, or the enclosing block's."""
        if isinstance(self._device_arg, VirtualDevices):
            return self._device_arg
        if self._device_arg is None and self._budget is None:
            return active_virtual_devices()
        return None

    def _first_virtual(self, vd: VirtualDevices) -> int:
        """The primary virtual device: DataParallel's output device, else the current one."""
        model = self.model
        if isinstance(model, torch.nn.DataParallel) and model.device_ids:
            return int(getattr(model, "output_device", model.device_ids[0]))
        return max(0, vd.current_device)

    def _index_of(self, tensor: torch.Tensor) -> int:
        """The device index of ``tensor`` (virtual: its tag; -1 for the current device)."""
        vd = self._vd
        return vd.where(tensor) if vd is not None else tensor.get_device()

    def _add_device(self, device: torch.device, backend: Any = None) -> _Device:
        with self._lock:
            key = device.index if device.type != "cpu" else -1
            dev = self._devices.get(key)
            if dev is not None:
                return dev
            if backend is None and self._vd is not None:
                backend = VirtualDeviceBackend(self._vd, device.index or 0)
            elif backend is None:
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
            vd = self._vd
            index = (
                max(0, vd.current_device) if vd is not None else current_device_index(self._kind)
            )
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
                return self._dev_index(self._index_of(a))
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
        if p > dev.train_peak and (ph != EVAL or not self._trained) and not self._failed:
            dev.train_peak = p
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
        root = type(self.model).__name__
        key = f"{root}.{name}" if name else root

        def pre(module: torch.nn.Module, args: Any) -> None:
            impl(key, leaf, module, args, None)

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
        root: _Root | None = None
        if stack:
            if stack[-1].kind < 0 or not self.per_module:
                stack.append(_Ignored(id(module)))
                return
            keys = tls.keys
        else:
            root = self._owners.get(id(module))
            if root is None or root.ref() is None:  # not a part of a model seen before
                root = self._root_info(module)
                if not root.model:  # a loss module, a data transform: not the model
                    stack.append(_Ignored(id(module)))
                    return
            keys = tls.keys = root.keys
        key = keys.get(id(module), "")
        if key is None:  # torch.compile's wrapped module: its wrapper stands for it
            return
        if not key:
            key = f"{next(iter(keys.values()))}.{type(module).__name__}"
        self._pre(key, not module._modules, module, args, root)

    def _pre(
        self, name: str, leaf: bool, module: torch.nn.Module, args: Any, root: _Root | None
    ) -> None:
        if not self._active:
            return
        tls = self._tls
        try:
            stack = tls.stack
        except AttributeError:
            stack = tls.stack = []
        if stack:
            if stack[-1].kind < 0:  # inside a module that is not the model
                stack.append(_Ignored(id(module)))
                return
        elif root is None:
            root = self._root_info(module)
            if not root.model:  # a parameterless submodule run on its own (a loss, a metric)
                stack.append(_Ignored(id(module)))
                return
        dev = self._single or self._dev_for_args(args)
        kind = stack[-1].kind if stack else self._root_pre(module, args, root)
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
            inner = getattr(module, "_orig_mod", module)  # torch.compile's wrapper: the model
            ms = dev.modules[name] = _ModuleStat(leaf, bw, type(inner).__name__)
        frame = _Frame(name, id(module), dev, a, ms, kind)
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
        kind = frame.kind
        if kind < 0:
            return
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
        step = self._step
        if kind == TRAIN_PASS:  # what a training forward keeps for backward
            ms.calls += 1
            if delta > ms.act_max:
                ms.act_max = delta
            own = delta - frame.children
            if own > ms.self_max:
                ms.self_max = own
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
        elif kind == EVAL_PASS:
            ms.eval_calls += 1
        else:
            ms.recompute_calls += 1
        if stack:
            parent = stack[-1]
            parent.children += delta
            if fmax > parent.max:
                parent.max = fmax
        else:
            self._root_post(frame, delta, dev)
        bw = ms.bw
        if bw is not None and kind == TRAIN_PASS:
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
        dev = self._single or self._dev_index(self._index_of(grad))
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
                self._backwards_in_step += 1
                self._transition(OTHER)

    def _end_queued(self) -> None:
        if self._active and self._backward_depth == 0:
            with self._lock:
                if self._phase == BACKWARD:
                    self._backwards_in_step += 1
                    self._transition(OTHER)

    def _root_pre(self, module: torch.nn.Module, args: Any, root: _Root | None) -> int:
        """A forward of the model begins: which pass it is, and the phase it starts."""
        if self._phase == BACKWARD:  # a checkpointed forward recomputed inside backward
            return RECOMPUTE
        if root is None:
            root = self._root_info(module)
        grad = torch.is_grad_enabled()
        self._last_root = (module.training, grad)
        self._last_input = shape = _input_shape(args)
        sim = self._sim
        if not grad or not module.training or not (root.trainable or _needs_grad(args)):
            kind = EVAL_PASS
            self._eval_forwards += 1
            if shape is not None and (
                self._eval_input is None or math.prod(shape) > math.prod(self._eval_input)
            ):
                self._eval_input = shape
            if self._phase != EVAL:
                with self._lock:
                    if self._phase != EVAL:
                        self._eval_return = self._phase
                        self._transition(EVAL)
        else:
            kind = TRAIN_PASS
            if _autocast_on(self._kind):  # advice: mixed-precision
                self._autocast_forwards += 1
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
                        if self._step > self._grads_checked_step and self._seen_optimizers:
                            self._grads_checked_step = self._step
                            if not self._grads_none():
                                self._grads_steps += 1
        if sim is not None:  # the batch reaches the model: it is on the device now
            sim.count_ops(True, True)
            sim.track(args)
        return kind

    def _root_post(self, frame: _Frame, delta: int, dev: _Device) -> None:
        """The model's forward returned."""
        if frame.eval_grad:
            self._eval_grad += 1
            if delta > self._eval_grad_bytes:
                self._eval_grad_bytes = delta
        if dev.pending is not None:  # a new peak in this forward: categorise it now
            with self._lock:
                self._resolve_pending(dev)
        if frame.kind == EVAL_PASS:
            if self._eval_hold:  # a framework's evaluation loop: the rest of it is eval too
                if self._sim is not None:
                    self._sim.count_ops(True, False)
            elif self._phase == EVAL:
                with self._lock:
                    if self._phase == EVAL and not self._eval_hold:
                        self._transition(self._eval_return)
        elif frame.kind == TRAIN_PASS and self._sim is not None:
            self._sim.count_ops(True, False)  # the loss: new tensors count, host data does not

    def _root_info(self, module: torch.nn.Module) -> _Root:
        """The model ``module`` heads: its module keys (``GPT.transformer.h.0``), seen once."""
        entry = self._roots.get(id(module))
        if entry is not None and entry.ref() is module:
            return entry
        with self._lock:  # replica threads (DataParallel) meet new roots at the same time
            return self._new_root(module)

    def _new_root(self, module: torch.nn.Module) -> _Root:
        target = getattr(module, "_orig_mod", None)
        compiled = isinstance(target, torch.nn.Module)
        inner: torch.nn.Module = target if compiled else module  # type: ignore[assignment]
        name = type(inner).__name__
        keys: dict[int, str | None] = {id(module): name}
        if compiled:
            keys[id(inner)] = None
        for path, sub in inner.named_modules():
            if path:
                keys[id(sub)] = f"{name}.{path}"
        if len(self._roots) > 256:
            self._roots = {k: v for k, v in self._roots.items() if v.ref() is not None}
            self._owners = {k: v for k, v in self._owners.items() if v.ref() is not None}
        root = _Root(module, keys)
        self._roots[id(module)] = root
        if not root.model:
            return root
        for sub_id in keys:
            if sub_id != id(module):
                self._owners[sub_id] = root
        if self._probe is None:
            self._probe = self._find_probe()
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
        self._capture_evidence()
        out: dict[str, Any] = {
            "param_dtype": self._param_dtype,
            "optimizer_name": self._optimizer_name,
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

    def _opt_pre(
        self, optimizer: Any, args: Any, kwargs: Any
    ) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
        if not self._active:
            return None
        if id(optimizer) not in self._seen_optimizers:
            self._seen_optimizers[id(optimizer)] = weakref.ref(optimizer)
            if self._step_owner is None:
                self._step_owner = weakref.ref(optimizer)
                self._optimizer_name = type(optimizer).__name__
            if self._probe is None:
                self._probe = self._find_probe()
        # ``optimizer.step(closure)`` (Lightning's automatic optimization, LBFGS): the forward
        # and backward run inside step(); the optimizer's own work starts when the closure
        # returns. ``args`` starts with the optimizer itself.
        kwargs = dict(kwargs or {})
        closure = kwargs.get("closure")
        if callable(closure):
            kwargs["closure"] = self._after_closure(optimizer, closure)
            return tuple(args), kwargs
        if len(args) > 1 and callable(args[1]):
            return (args[0], self._after_closure(optimizer, args[1]), *args[2:]), kwargs
        self._optimizer_begins(optimizer)
        return None

    def _after_closure(self, optimizer: Any, closure: Callable[..., Any]) -> Callable[..., Any]:
        begins = self._optimizer_begins

        def run_closure(*args: Any, **kwargs: Any) -> Any:
            result = closure(*args, **kwargs)
            begins(optimizer)
            return result

        return run_closure

    def _optimizer_begins(self, optimizer: Any) -> None:
        """The optimizer's own work starts (its step, after any closure it was given)."""
        if not self._active:
            return
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
                if self._backward_steps:
                    self._merge_backward_steps()
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
        if self._sim is not None:  # device memory is what the step's phases create
            self._sim.count_ops(phase != OTHER, phase in (BACKWARD, OPTIMIZER))

    def _boundary(self, frame: Any) -> None:
        self._close_all(None)
        now = time.perf_counter()
        growing: list[_Device] = []
        if self._step < 3 or self._param_dtype is None:
            self._capture_evidence()
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
                    backward_passes=self._backwards_in_step,
                )
            )
            for i, v in enumerate(dev.step_phase):
                cur = dev.phase_peak[i]
                if v is not None and (cur is None or v > cur):
                    dev.phase_peak[i] = v
            dev.step_phase = [None] * len(PHASES)
            dev.step_peak, dev.step_peak_res = a, r
            dev.step_start = a
            dev.forward_base = a
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
            if dev.growth.observe(self._step, a):
                growing.append(dev)
        step = self._step
        self._step += 1
        self._step_t0 = now
        self._backwards_in_step = 0
        self._phase = OTHER
        if self._sim is not None:
            self._sim.count_ops(False, False)
        if growing:
            self._on_growth(growing, frame)
        elif frame is not None and not self._leaks_found():
            self._scan_graphs(step, frame)

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
            parts = [s for s in dev.steps if s.step >= first]
            kept = [s for s in dev.steps if s.step < first]
            if parts:
                phases = {
                    ph: max((v for s in parts if (v := s.phase_peaks.get(ph)) is not None),
                            default=None)
                    for ph in PHASES
                }  # fmt: skip
                kept.append(
                    StepRecord(
                        step=first,
                        start_allocated=parts[0].start_allocated,
                        end_allocated=parts[-1].end_allocated,
                        peak_allocated=max(s.peak_allocated for s in parts),
                        peak_reserved=max(s.peak_reserved for s in parts),
                        phase_peaks=phases,
                        duration_s=sum(s.duration_s for s in parts),
                        backward_passes=sum(s.backward_passes for s in parts),
                    )
                )
            dev.steps.clear()
            dev.steps.extend(kept)
            timeline = dev.timeline
            i = len(timeline) - 1
            while i >= 0 and timeline[i][1] >= first:  # readings of the merged micro-batches
                t, _, *rest = timeline[i]
                timeline[i] = (t, first, *rest)  # type: ignore[assignment]
                i -= 1
            dev.growth = leaks.GrowthDetector(self._leak_warmup, self._leak_window)
            for ms in dev.modules.values():
                ms.step_id = -1
        self._step = first + 1
        self._grads_checked_step = min(self._grads_checked_step, self._step)
        self._graph_scans = []

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

    # ------------------------------------------------------------------------------------
    # leaks

    def _leaks_found(self) -> bool:
        return any(dev.leak is not None for dev in self._devices.values())

    def _scan_graphs(self, step: int, frame: Any) -> None:
        """Three scans in a row every SCAN_PERIOD steps: a variable whose autograd graph grows
        at each (``running_loss += loss``) is a leak even when device memory stays flat
        (backward freed the saved tensors; the graph's nodes pile up in host memory)."""
        offset = step - self._leak_warmup
        if offset < 0 or offset % SCAN_PERIOD >= 3:
            return
        try:
            current = leaks.scan_frames(frame)
        except Exception:  # inspection must never break training
            log.debug("graph scan failed", exc_info=True)
            return
        scans = self._graph_scans if offset % SCAN_PERIOD else []
        scans.append(current)
        self._graph_scans = scans
        if len(scans) < 3:
            return
        suspects = leaks.growing_in_all(scans)
        if not suspects:
            return
        dev = self._primary or next(iter(self._devices.values()))
        nodes = suspects[0].graph_nodes
        start = next(c.size for c in scans[0] if c.name == suspects[0].name)
        dev.leak = LeakFinding(
            dev.key, 0, step - 2, 2, tuple(suspects), graph_growth=(nodes - start) // 2
        )
        log.info("memkit: %s at %s", dev.leak.headline(), suspects[0].where)

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
            period = max(1, round(steps / max(1, dev.growth.rises)))
            dev.leak = LeakFinding(dev.key, growth, first, steps, self._suspects, period=period)
            if first_time:  # the report says it; the log is for those who listen
                log.info("memkit: on %s, %s", dev.key, dev.leak.headline())

    # ------------------------------------------------------------------------------------
    # model, optimizer and the breakdown (cold path)

    def _capture_evidence(self) -> None:
        """Read what the advice needs from the live model and optimizer (they may be gone by
        the time the report is made: a script's ``main()`` returned)."""
        sizes: dict[str, int] = {}
        for mod in self._root_modules():
            for p in mod.parameters():
                if p.requires_grad and p.is_floating_point():
                    key = str(p.dtype).replace("torch.", "")
                    sizes[key] = sizes.get(key, 0) + int(p.numel() * p.element_size())
        if sizes:
            self._param_dtype = max(sizes, key=lambda k: sizes[k])
        opts = self._all_optimizers()
        if opts and self._optimizer_name is None:
            self._optimizer_name = type(opts[0]).__name__

    def _root_modules(self) -> list[torch.nn.Module]:
        if self.model is not None:
            return [self.model]
        out = []
        for root in self._roots.values():
            mod = root.ref()
            if mod is not None and root.model:
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
        opts = self._all_optimizers()
        if not opts and self._seen_optimizers:  # gone: what was last seen
            return self._state_was_empty
        self._state_was_empty = all(not opt.state for opt in opts)
        return self._state_was_empty

    def _persistent(self, dev: _Device) -> tuple[int, int, int]:
        """Bytes of parameters (and buffers), gradients and optimizer state on ``dev``."""
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
        if params == 0 and not all_params:  # the model is gone: what was last seen
            params = dev.params_full
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
        module = self._namer()(module)
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
                    leak = dataclasses.replace(leak, suspects=tuple(suspects))
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
            input_shape=self._last_input,
        )
        advice = rules.oom_advice(pm, details.reserved_unallocated, details=details)
        return OomPostMortem(**{**pm.__dict__, "advice": tuple(advice)})

    # ------------------------------------------------------------------------------------
    # the report

    def _namer(self) -> Callable[[str | None], str | None]:
        """Module keys (``Model.path``) as reports show them: the path alone while one model
        (however often re-created or reloaded) is tracked, else with its model's class."""
        roots = {k.split(".", 1)[0] for dev in self._devices.values() for k in dev.modules}

        def display(key: str | None) -> str | None:
            if key is None or len(roots) > 1:
                return key
            root, _, path = key.partition(".")
            return path or root

        return display

    def _module_records(self, dev: _Device) -> list[ModuleRecord]:
        display = self._namer()
        out = []
        for name, ms in dev.modules.items():
            if ms.calls + ms.eval_calls + ms.recompute_calls == 0:
                continue
            out.append(
                ModuleRecord(
                    path=display(name) or name,
                    device=dev.key,
                    calls=ms.calls,
                    activation_bytes=ms.act_max,
                    self_activation_bytes=ms.self_max,
                    activation_bytes_per_step=ms.step_max,
                    peak_allocated=ms.peak,
                    peak_over_entry=ms.over_max,
                    leaf=ms.leaf,
                    eval_calls=ms.eval_calls,
                    recompute_calls=ms.recompute_calls,
                    type_name=ms.type_name,
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
            display = self._namer()
            for key in sorted(self._devices, key=lambda k: (k is None, k)):
                dev = self._devices[key]
                self._resolve_pending(dev)
                phase_peaks: dict[str, int | None] = {}
                for i, name in enumerate(PHASES):
                    vals = [v for v in (dev.phase_peak[i], dev.step_phase[i]) if v is not None]
                    phase_peaks[name] = max(vals) if vals else None
                timeline = tuple(
                    TimelinePoint(t, s, PHASES[ph], display(m), a, r)
                    for t, s, ph, m, a, r in dev.timeline
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
                        breakdown=None
                        if dev.breakdown is None
                        else dataclasses.replace(
                            dev.breakdown, module=display(dev.breakdown.module)
                        ),
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
            eval_forwards=self._eval_forwards,
            eval_input_shape=self._eval_input,
            step_rule=self._step_rule(),
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


def _mode_active(mode: Any) -> bool:
    """``mode`` is on this thread's dispatch-mode stack."""
    stack = torch._C._get_dispatch_stack_at
    return any(stack(i) is mode for i in range(torch._C._len_torch_dispatch_stack()))


def _only_mode(mode: Any) -> bool:
    """``mode`` is the only dispatch mode active in this thread."""
    return torch._C._len_torch_dispatch_stack() == 1 and torch._C._get_dispatch_stack_at(0) is mode


def _input_shape(args: Any) -> tuple[int, ...] | None:
    """The shape of a forward's first tensor argument (its batch dimension is the model's
    business: ``(batch, ...)`` for most, ``(seq, batch)`` for a seq-first RNN)."""
    for a in args:
        if isinstance(a, torch.Tensor):
            return tuple(int(n) for n in a.shape)
    return None


def _needs_grad(args: Any) -> bool:
    return any(isinstance(a, torch.Tensor) and a.requires_grad for a in args)


def _autocast_on(kind: str) -> bool:
    try:
        return bool(torch.is_autocast_enabled(kind))
    except (RuntimeError, TypeError):  # a device type autocast does not know (meta)
        return False


def track(
    model: torch.nn.Module | None = None,
    optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer] | None = None,
    *,
    device: str | torch.device | VirtualDevices | None = None,
    budget: int | str | None = None,
    per_module: bool = True,
    postmortem: str | None = "stderr",
    timeline_limit: int = DEFAULT_TIMELINE_LIMIT,
    gather_timeout: float = GATHER_TIMEOUT,
    memory_history: str | Path | None = None,
    history_entries: int = DEFAULT_MAX_ENTRIES,
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
        device: ``"cuda:0"``..., ``"cpu"`` (the simulated device), a ``VirtualDevices``
            (``memkit.simulate(budget, devices=N)``: one row per virtual device), or ``None``:
            the enclosing ``simulate(devices=N)`` block's devices, else the current accelerator,
            else the simulated cpu device.
        budget: size of the simulated device (``"300MiB"``): the block raises
            ``torch.OutOfMemoryError`` when it is crossed, as a GPU of that size would.
        per_module: hooks on every module (default), or on the model only (least overhead).
        postmortem: ``"stderr"`` (default) prints the diagnosis of an OOM that leaves the block;
            ``None`` only logs it. The exception propagates unchanged either way.
        timeline_limit: counter readings kept per device.
        memory_history: write PyTorch's memory snapshot (``_dump_snapshot``'s format, pickle
            protocol 4) to this file when the block ends, also after an OOM; it opens at
            https://pytorch.org/memory_viz and in ``memkit inspect``. On CUDA PyTorch records it
            (python stacks, the last ``history_entries`` events); on the simulated device memkit
            does. Under torchrun each rank writes ``NAME.rankN.EXT``.
        history_entries: events the memory history keeps (the most recent).

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
        memory_history=memory_history,
        history_entries=history_entries,
    )
