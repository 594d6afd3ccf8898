"""The tracker: memory per device, phase, step and module while a block runs.

:class:`Tracker` coordinates the parts, each in its own file:

* memkit/tracking/hooks.py: the hooks and the hot path (:class:`~memkit.tracking.hooks.Hooks`);
* memkit/tracking/phases.py: the phase and pass state machine, step boundaries
  (:class:`~memkit.tracking.phases.PhaseMachine`);
* memkit/tracking/records.py: per-device, per-module and per-step records;
* memkit/tracking/breakdown.py: the category breakdown at the training peak;
* memkit/tracking/leaks.py: growth and the variables behind it;
* memkit/tracking/postmortem.py: the OOM post-mortem;
* memkit/tracking/rank_gather.py: the summaries of all ranks, gathered to rank 0.

Here: entering and leaving the block (backends, virtual devices, the memory history), the
devices, and the report. :func:`~memkit.tracking.api.track` creates one.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any, Literal

import torch

from memkit.advice.track import track_advice
from memkit.devices import (
    CudaBackend,
    SimulatedBackend,
    UserPeaks,
    VirtualDeviceBackend,
    counter_reader,
    current_device_index,
    get_backend,
    visible_devices,
)
from memkit.devices.history import MemoryHistory
from memkit.distributed import launched_rank, world_size
from memkit.oom import find_oom
from memkit.simulated.history import DEFAULT_MAX_ENTRIES
from memkit.simulated.virtual_devices import VirtualDevices, active_virtual_devices, is_active
from memkit.tracking import leaks
from memkit.tracking.breakdown import breakdown, gradient_witness, param_dtype, persistent_bytes
from memkit.tracking.fsdp import FsdpUnits, counting_resizes, find_fsdp_units
from memkit.tracking.hooks import Hooks
from memkit.tracking.outputs import check_writable, rank_path
from memkit.tracking.phases import BACKWARD, OTHER, is_compiled
from memkit.tracking.postmortem import build_postmortem, failing_call
from memkit.tracking.rank_gather import GATHER_TIMEOUT, RankWatch
from memkit.tracking.records import (
    DEFAULT_STEP_LIMIT,
    DEFAULT_TIMELINE_LIMIT,
    DeviceRecord,
    RootInfo,
    RunFacts,
    device_report,
    module_records,
)
from memkit.tracking.report import (
    PHASES,
    Breakdown,
    ModuleRecord,
    OomPostMortem,
    TrackReport,
)
from memkit.units import format_size

__all__ = ["DEFAULT_MODULE_EVERY", "DEFAULT_TIMELINE_LIMIT", "Tracker"]

DEFAULT_MODULE_EVERY = 100
"""On an accelerator, module hooks run on steps 0 and 1 and then on every 100th step."""

log = logging.getLogger(__name__)


class Tracker(Hooks):
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
            :class:`~memkit.simulated.virtual_devices.VirtualDevices` tracks its devices (entered
            here if not already). On an accelerator or virtual devices, other devices the model's
            tensors use are added as they appear.
        budget: the simulated device's size (``"300MiB"``), or a cap on a real one.
        per_module: module detail (default): hooks on every module on sampled steps (see
            ``module_every``); ``False``: hooks on the model alone (steps and phases only).
        module_every: module hooks on steps 0 and 1 and then every ``module_every``-th step;
            steps and phases are measured on every step either way. ``1``: every step (exact
            module rows, at a cost per module call). Default: every step on the simulated
            device (its per-op counting costs far more than the hooks), 100 on an accelerator.
        postmortem: ``"stderr"`` prints the OOM post-mortem there when an OOM leaves the block;
            ``None`` only logs it. It is on ``tracker.report().oom`` either way.
        timeline_limit: readings kept per device.
        leak_warmup: step boundaries the leak detector ignores at the start (gradients and
            optimizer state appear).
        leak_window: rises from step to step (without a fall in between) that make a leak.
        gather_timeout: seconds to wait for the other ranks' summaries at the end.
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
        module_every: int | None = None,
        postmortem: str | None = "stderr",
        timeline_limit: int = DEFAULT_TIMELINE_LIMIT,
        leak_warmup: int = 2,
        leak_window: int = 3,
        gather_timeout: float = GATHER_TIMEOUT,
        memory_history: str | Path | None = None,
        history_entries: int = DEFAULT_MAX_ENTRIES,
    ) -> None:
        """Long: it sets every attribute of the tracker's state, which the parts (hooks.py,
        phases.py) declare and read; one list keeps that state in one place."""
        if postmortem not in ("stderr", None):
            raise ValueError(f"postmortem must be 'stderr' or None, found {postmortem!r}")
        self.model = model
        if optimizer is None:
            self.optimizers: list[torch.optim.Optimizer] = []
        elif isinstance(optimizer, torch.optim.Optimizer):
            self.optimizers = [optimizer]
        else:
            self.optimizers = list(optimizer)
        if module_every is not None and (
            not isinstance(module_every, int) or isinstance(module_every, bool) or module_every < 1
        ):
            raise ValueError(
                f"module_every must be a whole number of steps >= 1, found {module_every!r}"
            )
        self.per_module = per_module
        self.module_every = module_every
        self.postmortem = postmortem
        self._device_arg = device
        self._budget = budget
        self._timeline_limit = timeline_limit
        self._leak_warmup = leak_warmup
        self._leak_window = leak_window
        self._handles: list[Any] = []
        self._detail_handles: list[Any] = []  # module detail's hooks (sampled steps)
        self._detail_on = False
        self._layout: tuple[bool, bool] | None = None  # (module detail, global hooks)
        self._module_every = 1
        self._compiled = False  # a torch.compile'd model: no module hooks
        self._stack_ctx: contextlib.ExitStack | None = None
        self._tls = threading.local()
        self._lock = threading.RLock()
        self._devices: dict[Any, DeviceRecord] = {}
        self._single: DeviceRecord | None = None
        self._primary: DeviceRecord | None = None
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
        self._roots: dict[int, RootInfo] = {}
        self._owners: dict[int, RootInfo] = {}  # id(submodule) -> the root it belongs to
        self._sim: SimulatedBackend | None = None
        self._fsdp: FsdpUnits | None = None  # FSDP2's units in the tracked models
        self._vd: VirtualDevices | None = None
        self._facts = RunFacts()
        self._trained = False
        self._failed = False  # an exception is leaving the block: what it holds is no peak
        self._eval_return = OTHER
        self._eval_hold = 0  # begin_eval() calls not yet ended: the eval phase is held
        self._backward_steps = 0  # steps counted from backward passes, not yet confirmed
        self._backwards_in_step = 0
        self._backwards_at_optimizer = 0  # _backwards_in_step at the last optimizer step
        self._micro_batches = 0  # the most backward passes one optimizer step used, this step
        self._warning_filter: Any = None
        self._seen_optimizers: dict[int, weakref.ref[Any]] = {}
        # a parameter whose .grad says whether gradients are allocated; weak, so that the
        # tracker never keeps a deleted model's tensor (or the memory history would show it)
        self._grad_witness: weakref.ref[torch.Tensor] | None = None
        self._backward_depth = 0
        self._optimizer_calls = 0  # optimizer.step() calls seen (a GradScaler skip makes none)
        self._last_root: tuple[bool, bool] | None = None
        self._fail: tuple[int, DeviceRecord, int, int, str | None] | None = None
        self._leak_watch = leaks.LeakWatch(leak_warmup)
        self._oom: OomPostMortem | None = None
        self.backend: Any = None
        self.notes: list[str] = []
        # -- across ranks (memkit/tracking/rank_gather.py) --
        self.gather_timeout = gather_timeout
        self._ranks_watch: RankWatch | None = None
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
                stack.enter_context(counting_resizes())  # FSDP2 resizes storages outside ops
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
            elif isinstance(backend, CudaBackend) and backend.budget is not None:
                # a cap on a real device: the caching allocator raises a real OOM past it. The
                # cap binds new segments only: cached free ones are given back first, or a
                # step could reuse more than the budget from the cache
                backend.empty_cache()
                stack.enter_context(backend.activate())
                held = backend.reserved()
                self.notes.append(
                    f"capped at the budget ({format_size(backend.budget)}) for the block: "
                    "torch.cuda.set_per_process_memory_fraction"
                    + (
                        f"; {format_size(held)} was already reserved when it began, above it"
                        if held > backend.budget
                        else ""
                    )
                )
            self._t0 = time.perf_counter()
            self._step_t0 = self._t0
            primary = self._add_device(backend.device, backend)
            self._primary = primary
            if vd is None and (
                isinstance(backend, SimulatedBackend) or len(visible_devices()) <= 1
            ):
                self._single = primary
            self._grad_witness = self._find_grad_witness()
            self._fsdp = find_fsdp_units(self.root_modules())
            simulated = isinstance(backend, (SimulatedBackend, VirtualDeviceBackend))
            self._module_every = self.module_every or (1 if simulated else DEFAULT_MODULE_EVERY)
            # a graph scan walks autograd graphs in Python: on an accelerator, as rarely as
            # module detail (a step there is short, and every microsecond of it is wall time)
            self._leak_watch.period = max(leaks.SCAN_PERIOD, self._module_every)
            self._compiled = self.model is not None and is_compiled(self.model)
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
            self._grad_witness = None  # keep no reference to the model's tensors
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

    def _index_of(self, tensor: torch.Tensor | None) -> int:
        """The device index of ``tensor`` (virtual: its tag; -1 for the current device)."""
        if tensor is None:
            return -1
        vd = self._vd
        return vd.where(tensor) if vd is not None else tensor.get_device()

    def _add_device(self, device: torch.device, backend: Any = None) -> DeviceRecord:
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
            peaks = None
            if isinstance(backend, CudaBackend) and backend.device.type == "cuda":
                # memkit resets the peak counters: the user's reads stay what they would be
                read, _ = counter_reader(backend)
                peaks = UserPeaks(backend.index, read)
                if self._stack_ctx is not None:
                    self._stack_ctx.enter_context(peaks.installed())
            dev = DeviceRecord(label, backend, self._timeline_limit, DEFAULT_STEP_LIMIT, peaks)
            dev.growth = leaks.GrowthDetector(self._leak_warmup, self._leak_window)
            dev.step_start = dev.baseline
            self._devices[key] = dev
            return dev

    def _dev_index(self, index: int) -> DeviceRecord:
        if index < 0:
            vd = self._vd
            index = (
                max(0, vd.current_device) if vd is not None else current_device_index(self._kind)
            )
        dev = self._devices.get(index)
        if dev is None:
            dev = self._add_device(torch.device(self._kind, index))
        return dev

    def _dev_for_args(self, args: Any) -> DeviceRecord:
        single = self._single
        if single is not None:
            return single
        for a in args:
            if isinstance(a, torch.Tensor):
                return self._dev_index(self._index_of(a))
        return self._dev_index(-1)

    def _advice_evidence(self) -> dict[str, Any]:
        """What the advice rules need that the device records do not hold (cold path)."""
        self._capture_evidence()
        out: dict[str, Any] = {
            "param_dtype": self._facts.param_dtype,
            "optimizer_name": self._facts.optimizer_name,
            "autocast_forwards": self._facts.autocast_forwards,
            "steps_with_grads_at_forward": self._facts.grads_steps,
            "dp_output_bytes": self._facts.dp_output_bytes,
        }
        model = self.model
        if isinstance(model, torch.nn.DataParallel) and model.device_ids:
            ids = tuple(int(getattr(d, "index", d)) for d in model.device_ids)
            out["dp_device_ids"] = ids
            out["dp_output_device"] = f"{self._kind}:{int(getattr(model, 'output_device', ids[0]))}"
        return out

    # ------------------------------------------------------------------------------------
    # the tracked model and optimizers, the breakdown (cold path: memkit/tracking/breakdown.py)

    def root_modules(self) -> list[torch.nn.Module]:
        """The model given to track(), or else the outermost modules seen running a forward."""
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

    def _find_grad_witness(self) -> weakref.ref[torch.Tensor] | None:
        param = gradient_witness(self.root_modules(), self._all_optimizers())
        return None if param is None else weakref.ref(param)

    def _grads_none(self) -> bool:
        if self._grad_witness is None:
            return True
        param = self._grad_witness()
        if param is None:  # its model is gone: a new one (k-fold), or none (main() returned)
            found = self._find_grad_witness()
            param = None if found is None else found()
            if param is None:  # what was last seen
                return self._facts.grads_were_none
            self._grad_witness = found
        self._facts.grads_were_none = none = param.grad is None
        return none

    def _state_empty(self) -> bool:
        opts = self._all_optimizers()
        if not opts and self._seen_optimizers:  # gone: what was last seen
            return self._facts.state_was_empty
        self._facts.state_was_empty = all(not opt.state for opt in opts)
        return self._facts.state_was_empty

    def _capture_evidence(self) -> None:
        """Read what the advice needs from the live model and optimizer (they may be gone by
        the time the report is made: a script's ``main()`` returned)."""
        dtype = param_dtype(self.root_modules())
        if dtype is not None:
            self._facts.param_dtype = dtype
        opts = self._all_optimizers()
        if opts and self._facts.optimizer_name is None:
            self._facts.optimizer_name = type(opts[0]).__name__

    def _persistent(self, dev: DeviceRecord) -> tuple[int, int, int]:
        """Bytes of parameters (and buffers), gradients and optimizer state on ``dev``."""
        return persistent_bytes(
            dev,
            self.root_modules(),
            self._all_optimizers(),
            self.model,
            dev is self._primary,
            self._fsdp,
        )

    def _resolve_pending(self, dev: DeviceRecord) -> None:
        """Categorise the new training peak ``dev`` saw (``dev.pending``), if any."""
        pending = dev.pending
        if pending is None:
            return
        dev.pending = None
        try:
            dev.breakdown = breakdown(dev, self._persistent(dev), *pending)
        except Exception:  # the breakdown is best effort
            log.debug("breakdown failed", exc_info=True)

    def _breakdown_now(
        self, dev: DeviceRecord, total: int, step: int, phase: int, module: str | None
    ) -> Breakdown:
        """What ``total`` allocated bytes of ``dev`` consist of now (an OOM's)."""
        return breakdown(
            dev,
            self._persistent(dev),
            total,
            step,
            phase,
            module,
            dev.forward_base,
            dev.base_grads_none,
            dev.base_state_empty,
            self._grads_none(),
            self._state_empty(),
            0 if self._fsdp is None else self._fsdp.gathered(),
            dev.base_gathered,
        )

    def _postmortem(self, exc: BaseException, tb: TracebackType | None) -> OomPostMortem:
        place = failing_call(exc, self._fail)
        if place is None:
            dev = self._primary or next(iter(self._devices.values()))
            phase = self._phase
            place = (dev, phase, self._step, dev.bw_module if phase == BACKWARD else None)
        return build_postmortem(
            exc,
            tb,
            place=place,
            devices=self._devices if self._single is None else None,
            display=self._namer(),
            categorise=self._breakdown_now,
            module_records=self._module_records,
            leak_watch=self._leak_watch,
            last_root=self._last_root,
            last_input=self._facts.last_input,
        )

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

    def _module_records(self, dev: DeviceRecord) -> list[ModuleRecord]:
        return module_records(dev, self._namer())

    def report(self) -> TrackReport:
        """The report so far (inside the block: a snapshot; after it: the final one)."""
        with self._lock:
            if self._active:
                self._close_all(None)
            display = self._namer()
            devices = []
            for key in sorted(self._devices, key=lambda k: (k is None, k)):
                dev = self._devices[key]
                self._resolve_pending(dev)
                devices.append(device_report(dev, display))
        end = self._t_end if self._t_end is not None else time.perf_counter()
        rank = launched_rank()
        world = None if rank is None else world_size()
        report = TrackReport(
            devices=tuple(devices),
            steps=self._step,
            mode=self._mode(),
            duration_s=end - self._t0,
            oom=self._oom,
            eval_grad_forwards=self._facts.eval_grad,
            eval_forwards=self._facts.eval_forwards,
            eval_input_shape=self._facts.eval_input,
            step_rule=self._step_rule(),
            rank=rank,
            world_size=world,
            notes=tuple(self.notes),
            ranks=None if self._ranks_watch is None else self._ranks_watch.report,
            **self._advice_evidence(),
        )
        advice = track_advice(report, eval_grad_bytes=self._facts.eval_grad_bytes)
        if self._ranks_watch is not None:
            advice = [*self._ranks_watch.local_advice(), *advice]
        return TrackReport(**{**report.__dict__, "advice": tuple(advice)})

    def _mode(self) -> str:
        """The report's mode: what the module rows cover."""
        if not self.per_module:
            return "steps-only"
        if self._compiled:
            return "steps-only (torch.compile: no module hooks)"
        if self._module_every <= 1:
            return "per-module"
        every, n = self._module_every, max(1, self._step)
        sampled = n if n <= 2 else 2 + (n - 1) // every
        return f"per-module on {sampled} sampled step(s): 0, 1, then one in every {every}"

    @property
    def current_step(self) -> int:
        """Steps completed so far."""
        return self._step

    @property
    def phase(self) -> str:
        """The phase running now."""
        return PHASES[self._phase]
