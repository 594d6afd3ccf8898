"""The tracker: memory per device, phase, step and module while a block runs.

:class:`Tracker` composes parts, each owning its state:

* :class:`~memkit.tracking.state.TrackState` (state.py): the few values every hook reads;
* :class:`~memkit.tracking.models.TrackedModels` (models.py): the models and optimizers;
* :class:`~memkit.tracking.device_set.DeviceSet` (device_set.py): the devices, their
  counters and records, each segment's peak attributed;
* :class:`~memkit.tracking.phases.PhaseMachine` (phases.py): passes, phases, step boundaries;
* :class:`~memkit.tracking.evidence.Evidence` (evidence.py): what is read of the live model
  and optimizer, the leak search;
* :class:`~memkit.tracking.hooks.Hooks` (hooks.py): the hooks, every way in from torch;
* :class:`~memkit.tracking.history_file.HistoryFile` (history_file.py): the memory history.

Here: entering and leaving the block (backends, virtual devices), wiring the parts, and the
report; the breakdown (breakdown.py) and the OOM post-mortem (postmortem.py) are pure
functions of what the parts recorded. :func:`~memkit.tracking.api.track` creates one.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from types import FrameType, TracebackType
from typing import Any, Literal

import torch

from memkit import cuda_autocast
from memkit.advice.track import track_advice
from memkit.devices import CudaBackend, SimulatedBackend, VirtualDeviceBackend, get_backend
from memkit.distributed import launched_rank, world_size
from memkit.errors import warn_user
from memkit.oom import find_oom
from memkit.simulated.accountant import counting_now, node_of, op_inputs_of
from memkit.simulated.ddp_buckets import counting_buckets
from memkit.simulated.eager import eager_note
from memkit.simulated.history import DEFAULT_MAX_ENTRIES
from memkit.simulated.virtual_devices import VirtualDevices, active_virtual_devices, is_active
from memkit.tracking import leaks
from memkit.tracking.breakdown import PeakMoment
from memkit.tracking.ddp import ddp_calling, is_ddp
from memkit.tracking.device_set import DeviceSet, remembered_sizes
from memkit.tracking.evidence import Evidence
from memkit.tracking.fsdp import FsdpUnits, counting_resizes, find_fsdp_units
from memkit.tracking.history_file import HistoryFile
from memkit.tracking.hooks import Hooks
from memkit.tracking.models import TrackedModels, is_compiled
from memkit.tracking.options import check_track_options, check_whole
from memkit.tracking.phases import PhaseMachine
from memkit.tracking.postmortem import (
    OomEvidence,
    build_postmortem,
    failing_call,
    oom_device_index,
)
from memkit.tracking.rank_gather import GATHER_TIMEOUT, RankWatch
from memkit.tracking.records import (
    DEFAULT_TIMELINE_LIMIT,
    DeviceRecord,
    current_leak,
    device_info,
    device_report,
    display_names,
    module_records,
    step_record,
)
from memkit.tracking.report import PHASES, OomPostMortem, StepRecord, TrackReport
from memkit.tracking.state import BACKWARD, FORWARD, OPTIMIZER, OTHER, TrackState
from memkit.units import format_size

__all__ = ["DEFAULT_MODULE_EVERY", "DEFAULT_TIMELINE_LIMIT", "Tracker"]

DEFAULT_MODULE_EVERY = 100
"""On an accelerator, module hooks run on steps 0 and 1 and then on every 100th step."""

log = logging.getLogger(__name__)


class Tracker:
    """Tracks memory per device, phase, step and module while a block runs.

    Use :func:`track` to create one. Re-entering a finished tracker is not supported.

    Args:
        model: the model (its submodules get hooks), or ``None`` for every module (global
            hooks). ``nn.DataParallel`` works: replicas share the hooks, and each record goes to
            the device its tensors are on. On the simulated device other models that run (a
            distillation teacher, an EMA copy) are found and counted too, as on a GPU.
        optimizer: an optimizer, several, or ``None`` for every optimizer (global hooks). Steps
            are counted from its ``step()`` (the first optimizer seen, with global hooks).
        device: the device to track (``"cuda:0"``, ``"cpu"`` for the simulated device); ``None``:
            the virtual devices of an enclosing ``memkit.simulate(..., devices=N)`` block, else
            the current accelerator, else the simulated cpu device. A
            :class:`~memkit.simulated.virtual_devices.VirtualDevices` tracks its devices (entered
            here if not already; one row per virtual device). On an accelerator or virtual
            devices, other devices the model's tensors use are added as they appear.
        budget: the simulated device's size (``"300MiB"``): the block raises
            ``torch.OutOfMemoryError`` when it is crossed, as a GPU of that size would; on a
            real GPU, a cap for the block (``set_per_process_memory_fraction``).
        per_module: module detail (default): hooks on every module on sampled steps (see
            ``module_every``); ``False``: hooks on the model alone (steps and phases only,
            least overhead).
        module_every: module hooks on steps 0 and 1 and then every ``module_every``-th step;
            steps and phases are measured on every step either way. ``1``: every step (exact
            module rows, at a cost per module call). Default: every step on the simulated
            device (its per-op counting costs far more than the hooks), 100 on an accelerator
            (docs/track.md, "What it costs").
        postmortem: ``"stderr"`` prints the OOM post-mortem there when an OOM leaves the block;
            ``None`` only logs it. It is on ``tracker.report().oom`` either way, and the
            exception propagates unchanged.
        timeline_limit: counter readings kept per device.
        leak_warmup: step boundaries the leak detector ignores at the start (gradients and
            optimizer state appear).
        leak_window: rises from step to step (without a fall in between) that make a leak.
        gather_timeout: seconds to wait for the other ranks' summaries at the end.
        memory_history: write PyTorch's memory snapshot (``_dump_snapshot``'s format, pickle
            protocol 4) to this file when the block ends, also after an OOM; it opens at
            https://pytorch.org/memory_viz and in ``memkit inspect``. On CUDA PyTorch records it
            (python stacks, the last ``history_entries`` events); on the simulated device memkit
            does (docs/memory-history.md). Under torchrun each rank writes ``NAME.rankN.EXT``.
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
        check_track_options(
            per_module=per_module,
            module_every=module_every,
            timeline_limit=timeline_limit,
            postmortem=postmortem,
        )
        self.per_module = per_module
        self.module_every = module_every
        self.postmortem = postmortem
        self.gather_timeout = gather_timeout
        self.backend: Any = None
        """The tracked device's backend (once the block began)."""
        self.notes: list[str] = []
        """The report's notes, as the parts add them."""
        self._over_budget: int | None = None  # a budget that could not be an exact cap
        self.caught_ooms = 0  # OOMs the script caught and went on from, on every device
        # the parts (see the module docstring), wired to each other
        self.state = state = TrackState()
        self.models = models = TrackedModels(model, optimizer, state.lock)
        self.evidence = evidence = Evidence(models, state, leak_warmup)
        self.devices = devices = DeviceSet(
            state,
            evidence,
            timeline_limit=timeline_limit,
            leak_warmup=leak_warmup,
            leak_window=leak_window,
        )
        self.phases = phases = PhaseMachine(state, devices, evidence, models, self.notes)
        self.hooks = Hooks(state, devices, phases, evidence, models, self.notes, per_module)
        self.history = HistoryFile(memory_history, history_entries)
        models.on_model = self._model_found
        phases.on_step = self.hooks.schedule_detail
        phases.find_compiled = self.hooks.find_compiled_in_place
        phases.on_new_optimizer = self.hooks.look_for_models
        self._device_arg = device
        self._budget = budget
        self._stack: contextlib.ExitStack | None = None
        self._cuda_regions: set[torch.dtype] = set()  # entered on a device that is not CUDA
        self._used = False
        self._t_end: float | None = None
        self._oom: OomPostMortem | None = None
        self._ranks_watch: RankWatch | None = None

    # ------------------------------------------------------------------------------------
    # entering and leaving

    def __enter__(self) -> Tracker:
        if self._used:
            raise RuntimeError("a Tracker can be used for one block only; call memkit.track again")
        self._used = True
        state, models, evidence, hooks = self.state, self.models, self.evidence, self.hooks
        vd = self._virtual_devices()
        backend: Any = (
            VirtualDeviceBackend(vd, self._first_virtual(vd))
            if vd is not None
            else get_backend(self._device_arg, self._budget)  # type: ignore[arg-type]
        )
        self.backend = backend
        self.history.prepare(backend)  # checked before anything is hooked
        stack = self._stack = contextlib.ExitStack()
        # last out: the user's peak counters go back once the patches and any cap are gone
        stack.callback(lambda: self.notes.extend(self.devices.restore_user_peaks()))
        try:
            if vd is not None:
                if not is_active(vd):
                    stack.enter_context(vd)
                self.notes.append(
                    f"{vd.n} virtual devices (memkit.simulate(devices={vd.n})): each device's "
                    "peak and current bytes are its tagged storages'; replicas of memkit's "
                    "DataParallel stand-in run one after another in this thread"
                )
            self.history.start(stack)  # before the tracked objects are counted
            if isinstance(backend, SimulatedBackend):
                self._count_on_the_simulated_device(backend, stack)
            elif isinstance(backend, CudaBackend) and backend.budget is not None:
                self._cap(backend, backend.budget, stack)
            state.t0 = self.phases.step_t0 = time.perf_counter()
            primary = self.devices.open(backend, vd, stack)
            evidence.find_witness()
            state.fsdp = find_fsdp_units(models.root_modules())
            simulated = isinstance(backend, (SimulatedBackend, VirtualDeviceBackend))
            hooks.module_every = self.module_every or (1 if simulated else DEFAULT_MODULE_EVERY)
            # a graph scan walks autograd graphs in Python: on an accelerator, as rarely as
            # module detail (a step there is short, and every microsecond of it is wall time)
            evidence.leak_watch.period = max(leaks.SCAN_PERIOD, hooks.module_every)
            # compiled models run eagerly while the simulated device counts: module detail
            models.eager = counting_now()
            models.compiled = (
                not models.eager and models.model is not None and is_compiled(models.model)
            )
            primary.base_grads_none = evidence.grads_none()
            primary.base_state_empty = evidence.state_empty()
            hooks.install()
            if RankWatch.wanted():
                self._ranks_watch = hooks.ranks_watch = RankWatch(self, self.gather_timeout)
                self._ranks_watch.install()
            state.active = True
        except BaseException:
            hooks.remove()
            stack.close()
            raise
        return self

    def _count_on_the_simulated_device(
        self, backend: SimulatedBackend, stack: contextlib.ExitStack
    ) -> None:
        stack.enter_context(backend.activate())
        stack.enter_context(counting_resizes())  # FSDP2 resizes storages outside ops
        # DDP's buckets, allocated when a script wraps its model (between steps)
        stack.enter_context(counting_buckets(backend.accountant))
        tracked = [x for x in (self.models.model, *self.models.optimizers) if x is not None]
        if tracked:
            backend.track(*tracked)
        # host-side work between steps (datasets, data loading) is not device memory; an
        # EMA's update writes device memory (writes_between_steps)
        backend.count_ops(False, False)
        stack.callback(backend.count_ops, True, True)
        stack.enter_context(backend.writes_between_steps())
        if backend.device.type != "cuda":  # a GPU script's own autocast("cuda") regions
            self._cuda_regions = stack.enter_context(cuda_autocast.regions_entered())
        self.notes.append(
            "simulated device: counts the model, its inputs and what training and "
            "evaluation steps create, in the thread that entered the block (not "
            "datasets or data loading, nor buffers made between steps that the steps index, "
            "such as an RL rollout or replay buffer: on a GPU they count where they live; not "
            "other threads, e.g. DataParallel replicas)"
        )

    def _cap(self, backend: CudaBackend, budget: int, stack: contextlib.ExitStack) -> None:
        """A cap on a real device: the caching allocator raises a real OOM past ``budget``.
        The cap binds new segments only: cached free ones are given back first, or a step
        could reuse more than the budget from the cache. Segments that live tensors keep
        cannot be given back; where they hold more than the budget, a cap at the budget would
        fail every new segment (an OOM no card of that size raises): new segments may then
        take what the budget leaves beside the tensors, and a peak past it is said at the end."""
        backend.empty_cache()
        held, allocated = backend.reserved(), backend.allocated()
        if held <= budget:
            stack.enter_context(backend.capped_at(budget))
            self.notes.append(
                f"capped at the budget ({format_size(budget)}) for the block: "
                "torch.cuda.set_per_process_memory_fraction"
            )
            return
        room = max(0, budget - allocated)
        stack.enter_context(backend.capped_at(held + room))
        self._over_budget = budget
        note = (
            f"the budget ({format_size(budget)}) is not an exact cap here: "
            f"{format_size(held)} stayed reserved when the block began, in segments that live "
            f"tensors ({format_size(allocated)}) keep, which empty_cache() cannot give back. A "
            "cap at the budget would fail every new segment, so new segments may take the "
            f"{format_size(room)} the budget leaves beside those tensors, and the free parts of "
            "the kept segments serve requests too. For an exact cap, start the block before "
            "the large tensors that left those segments, or in a fresh process "
            "(`memkit run --budget`)"
        )
        self.notes.append(note)
        warn_user("memkit.track: " + note)

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> Literal[False]:
        state, devices = self.state, self.devices
        try:
            note = self.history.write()  # first: after an OOM, the failed step's tensors live
            if note is not None:
                self.notes.append(note)
            with state.lock:
                with contextlib.suppress(Exception):  # (never memkit's error at the block's end)
                    self.hooks.settle_late()  # (the last forward's output, as the block ends)
                if exc is None:
                    self.phases.finish()
                elif find_oom(exc) is not None:
                    self._find_optimizers(tb)
                    if self.models.all_optimizers():
                        self.phases.first_step_failed()
                self.phases.block_ends(failed=exc is not None)
            state.active = False
            self._t_end = time.perf_counter()
            self.hooks.remove()
            with state.lock:
                state.failed = exc is not None
                devices.close_all()
                self._note_over_budget()
                for dev in devices.records.values():
                    devices.resolve_pending(dev)
                    with contextlib.suppress(Exception):  # else read when the report is made
                        dev.info = device_info(dev.backend)
            if exc is not None and find_oom(exc) is not None:
                try:
                    self._oom = build_postmortem(exc, self._oom_evidence(exc, tb))
                except Exception:  # never hide the user's OOM behind our own error
                    log.exception("memkit could not build the OOM post-mortem")
                if self._oom is not None:
                    log.info("%s", self._oom)
                    if self.postmortem == "stderr":
                        sys.stderr.write(str(self._oom) + "\n")
                        sys.stderr.flush()
            for dev in devices.records.values():
                self._note_caught_ooms(dev)
            if self._ranks_watch is not None:
                self._ranks_watch.remove()
                self._ranks_watch.finish(exc is None)
        finally:
            with contextlib.suppress(Exception):  # the line trace never outlives the block
                self.evidence.leak_watch.settle(end=True)
            self.evidence.release()  # keep no reference to the model's tensors
            with contextlib.suppress(Exception):  # what the report reads of the model
                self.evidence.keep_layout()
            if self._stack is not None:
                self._stack.close()
        return False

    def _note_over_budget(self) -> None:
        """Where the budget could not be an exact cap: a peak past it, which a card of that
        size would not have held."""
        budget = self._over_budget
        if budget is None:
            return
        for dev in self.devices.records.values():
            if dev.peak > budget:
                self.notes.append(
                    f"{dev.key}'s allocated peak ({format_size(dev.peak)}) is above the budget "
                    f"({format_size(budget)}): on a card of that size this block runs out"
                )

    def _note_caught_ooms(self, dev: DeviceRecord) -> None:
        """A note when ``dev`` ran out of memory during the block and the script went on (an
        OOM handler that retries with a smaller batch or skips one): nothing else would say."""
        if dev.ooms_at_start is None:
            return
        try:
            caught = dev.backend.ooms() - dev.ooms_at_start
        except Exception:
            return
        ended = self._oom is not None and self._oom.device == dev.key
        if ended:
            caught -= 1  # the one the block ends with: the post-mortem's
        self.caught_ooms += max(0, caught)  # (rank 0's table marks a rank that caught one)
        if caught > 0:
            times = "once" if caught == 1 else f"{caught} times"
            note = (
                f"{dev.key} ran out of memory {times} and the script caught it and went on (an "
                "OOM handler retrying with a smaller batch, or skipping one): the peaks are of "
                "what ran, the failed allocations are not in them"
            )
            if dev.failed_peak is not None and not ended:
                step, shape = dev.failed_peak
                batch = "" if shape is None else f", input shape {shape}"
                note += (
                    f"; the training peak is of an attempt that ran out (step {step}{batch}), "
                    "up to its failed request: the breakdown and the advice describe that "
                    "attempt, not a step that completed"
                )
            self.notes.append(note)

    # ------------------------------------------------------------------------------------
    # wiring: a model found running, the backend's devices

    def _model_found(self, module: torch.nn.Module, newly_compiled: bool) -> None:
        """A model is seen running for the first time (``models.root_info``)."""
        models, evidence, sim = self.models, self.evidence, self.devices.sim
        if newly_compiled and models.model is None:
            self.hooks.set_detail(False)  # hooks on the models alone from now on
        if evidence.witness_missing():  # none yet, or gone
            evidence.find_witness()
        if models.model is None:  # a model found running: its FSDP2 units, if any
            self.state.fsdp = find_fsdp_units(models.root_modules())
        if not is_ddp(module) and (wrapper := ddp_calling(sys._getframe(1))) is not None:
            models.wrapped_by(wrapper)  # (track(model) around DDP(model), Lightning's ddp)
        if _is_lightning_module(module):
            evidence.facts.lightning_automatic = bool(
                getattr(module, "automatic_optimization", True)
            )
        if sim is not None:
            before = sim.allocated()
            sim.track(module)  # the model lives on the device
            added = sim.allocated() - before
            dev = self.devices.primary
            if added and dev is not None and dev.forward_base is not None:
                # on a GPU it was there before the forward began: no activation of a forward
                # running now (a teacher found inside the student's step)
                dev.forward_base += added
            if is_compiled(module) and not any("torch.compile" in n for n in self.notes):
                self.notes.append(
                    eager_note("the simulated device (a TorchDispatchMode)", "on a GPU")
                )

    def _virtual_devices(self) -> VirtualDevices | None:
        """The virtual devices to track: given as ``device``, or the enclosing block's."""
        if isinstance(self._device_arg, VirtualDevices):
            return self._device_arg
        if self._device_arg is None and self._budget is None:
            return active_virtual_devices()
        return None

    def _first_virtual(self, vd: VirtualDevices) -> int:
        """The primary virtual device: DataParallel's output device, else the current one."""
        model = self.models.model
        if isinstance(model, torch.nn.DataParallel) and model.device_ids:
            return int(getattr(model, "output_device", model.device_ids[0]))
        return max(0, vd.current_device)

    def root_modules(self) -> list[torch.nn.Module]:
        """The model given to track(), or else the outermost modules seen running a forward."""
        return self.models.root_modules()

    # ------------------------------------------------------------------------------------
    # the OOM post-mortem's evidence (the post-mortem itself: postmortem.py)

    def _find_optimizers(self, tb: TracebackType | None) -> None:
        """An OOM ends the block while no optimizer was given or seen stepping: look for the
        script's own in the frames it ran out in (step 0's OOM, under ``memkit run``)."""
        if not self.models.all_optimizers():
            start = _innermost(tb)
            found = leaks.optimizers_in_frames(start) or leaks.framework_optimizers(start)
            self.models.found_in_frames(found)

    def _oom_evidence(self, exc: BaseException, tb: TracebackType | None) -> OomEvidence:
        """Read what the post-mortem of ``exc`` needs, from the records and the live objects;
        a leak still growing gets the suspects of a last scan at the failure (``tb``)."""
        state, devices, evidence = self.state, self.devices, self.evidence
        place = failing_call(exc, evidence.failed_call)
        if place is None:
            dev = devices.primary or next(iter(devices.records.values()))
            phase = state.phase
            place = (dev, phase, state.step, dev.bw_module if phase == BACKWARD else None, None)
        dev, phase, step, key, pass_base = place
        step = self.phases.optimizer_step_of(step)
        display = display_names(devices.records.values())
        stat = None if key is None else dev.modules.get(key)
        index = oom_device_index(exc)
        if index is not None and state.single is None:  # several devices: the message's
            dev = devices.records.get(index, dev)
        self._find_optimizers(tb)
        persistent = devices.persistent(dev)
        fsdp = state.fsdp
        grads_none, state_empty = evidence.grads_none(), evidence.state_empty()
        facts = evidence.facts
        # an evaluation pass's own base: not a pass inside a step's forward or backward (a
        # teacher's, FixMatch's pseudo-labels: the forward before it holds the step's graph)
        evaluation = (
            pass_base is not None
            and facts.frozen_model is None
            and self.phases.eval_return not in (FORWARD, BACKWARD)
        )
        # its activations: what the pass added (its batch, made before it, is other), else
        # what the step's training forward began with; between steps, none (a snapshot's
        # copies, an EMA's update: other)
        base, base_grads_none, base_state_empty = (
            (pass_base, grads_none, state_empty)
            if evaluation
            else (dev.forward_base, dev.base_grads_none, dev.base_state_empty)
        )
        if phase == OTHER and state.trained:
            base = None
        moment = PeakMoment(
            dev.last[0],
            step,
            phase,
            display(key),
            base,
            base_grads_none,
            base_state_empty,
            grads_none,
            state_empty,
            0 if fsdp is None else fsdp.gathered(),
            dev.base_gathered,
            released=dev.base_released() if phase in (BACKWARD, OPTIMIZER) and base else 0,
            input_shape=facts.last_input,
        )
        leak = current_leak(dev)  # growth that had stopped did not run out
        if leak is not None and leak is dev.leak:
            leak = dev.leak = evidence.leak_watch.suspects_at_failure(leak, tb)
        cap = dev.backend.capacity()
        accountant = getattr(dev.backend, "accountant", None)  # (the simulated device's)
        return OomEvidence(
            device=dev.key,
            step=step,
            moment=moment,
            module_type=None if stat is None else stat.type_name,
            at_oom=getattr(accountant, "in_use_at_oom", None),
            node=node_of(accountant, exc),
            op_inputs=op_inputs_of(accountant, exc),
            appended_losses=() if leak is not None else leaks.appended_losses(_innermost(tb)),
            capacity=cap.total,
            free=cap.free,
            cap_raised=self._over_budget is not None,
            persistent=persistent,
            remembered=remembered_sizes(dev),
            modules=tuple(module_records(dev, display)),
            leak=leak,
            last_root=facts.last_root,
            last_input=facts.last_input,
            frozen_model=facts.frozen_model,
            micro_batches=max(
                max((s.backward_passes for s in dev.steps), default=1),
                facts.accumulation_steps or 1,  # the trainer's setting: before a step ended
                self.phases.micro_batches,  # an optimizer step that failed: its own
            ),
            setup=dev.setup,
            rank=launched_rank(),
            autocast_forwards=facts.autocast_forwards,
            batch_bytes=self.phases.batch_bytes(evaluation),
            after_backward=state.backwards > self.phases.backwards_at_optimizer,
        )

    # ------------------------------------------------------------------------------------
    # the report and what callbacks read while the block runs

    def report(self) -> TrackReport:
        """The report so far (inside the block: a snapshot; after it: the final one). Read
        between a forward and its backward, the model's own module row and those of the
        layers whose output it returned leave out that forward's pass: it is settled when
        the loop's backward (or next forward) shows what it kept."""
        state, devices, facts = self.state, self.devices, self.evidence.facts
        with state.lock:
            if state.active:
                devices.close_all()
            records = devices.records
            display = display_names(records.values())
            rows = []
            for key in sorted(records, key=lambda k: (k is None, k)):
                dev = records[key]
                devices.resolve_pending(dev)
                rows.append(device_report(dev, display))
            later_notes = [
                note
                for dev in records.values()
                if (note := leaks.explained_growth_note(dev.key, dev.growth)) is not None
            ]
            past = self._past_budget_note()
            if past is not None:
                later_notes.append(past)
            if facts.uncounted and self.devices.sim is not None:
                later_notes.append(_uncounted_note(str(self.devices.sim.device), facts.uncounted))
            if state.fsdp is not None:
                later_notes.append(_fsdp_note(state.fsdp))
            if state.step == 0 and facts.eval_forwards and not state.trained:
                later_notes.append(
                    "no training step ran (inference alone): memory growth and the graphs or "
                    "tensors a loop keeps are looked for at step boundaries, so they were not; "
                    "with memkit.track, call tracker.step() once per iteration of the loop (a "
                    "batch, a generate() call) to have them looked for"
                )
            if self._cuda_regions:
                said = " and ".join(
                    sorted(str(d).removeprefix("torch.") for d in self._cuda_regions)
                )
                later_notes.append(
                    f"the script's torch.autocast('cuda', {said}) regions cast nothing on "
                    f"{self.devices.kind}: these are float32 numbers (their forwards count as "
                    f"under autocast for the advice); on a GPU they run in {said}, and hold "
                    "less (memkit estimate runs them as a GPU would)"
                )
            elif self.devices.sim is not None and facts.autocast_forwards:
                later_notes.append(
                    "torch.autocast on the CPU: its op lists differ from CUDA's (a loss in the "
                    "region makes a float32 copy of its bf16 input on the CPU), so a GPU's "
                    "numbers under autocast can differ (sweep BJ: an LSTM LM saved 11.07 MiB "
                    "here with its loss inside the region, 26.44 with it outside; memkit "
                    "estimate --amp bf16 runs CUDA's lists)"
                )
        end = self._t_end if self._t_end is not None else time.perf_counter()
        rank = launched_rank()
        world = None if rank is None else world_size()
        report = TrackReport(
            devices=tuple(rows),
            steps=state.step,
            mode=self._mode(),
            duration_s=end - state.t0,
            oom=self._oom,
            eval_grad_forwards=facts.eval_grad,
            eval_forwards=facts.eval_forwards,
            step_rule=self.phases.step_rule(),
            rank=rank,
            world_size=world,
            notes=(*self.notes, *later_notes),
            ranks=None if self._ranks_watch is None else self._ranks_watch.report,
            **self.evidence.advice_fields(devices.kind),
        )
        advice = track_advice(report, eval_grad_bytes=facts.eval_grad_bytes)
        if self._ranks_watch is not None:
            advice = [*self._ranks_watch.local_advice(), *advice]
        return TrackReport(**{**report.__dict__, "advice": tuple(advice)})

    def _past_budget_note(self) -> str | None:
        """Why the simulated device's peak is above its budget, where it is: tensors that
        existed before were counted past it (a model found running, a batch), which never
        raises."""
        sim = self.devices.sim
        if sim is None:
            return None
        acct = sim.accountant
        if not acct.adopted_past_budget or acct.budget is None:
            return None
        return (
            f"{sim.device}: tensors made before they were counted (a model found running, a "
            f"batch) took it {format_size(acct.adopted_past_budget)} past its "
            f"{format_size(acct.budget)} budget, so the peak is above it: counting them never "
            "raises (an allocation after it does); on a GPU of this size moving them there "
            "(`.to(device)`) would have failed"
        )

    def _mode(self) -> str:
        """The report's mode: what the module rows cover."""
        if not self.per_module:
            return "steps-only"
        if self.models.compiled:
            return "steps-only (torch.compile: no module hooks)"
        every = self.hooks.module_every
        if every <= 1:
            return "per-module"
        n = max(1, self.state.step)
        sampled = n if n <= 2 else 2 + (n - 1) // every
        return f"per-module on {sampled} sampled step(s): 0, 1, then one in every {every}"

    def trainer_settings(
        self, *, accumulation_steps: int | None = None, checkpointing: bool | None = None
    ) -> None:
        """What the trainer running the block is set to do, for the advice (a framework
        callback tells it when training starts): ``accumulation_steps`` micro-batches per
        optimizer step, activation ``checkpointing`` on or off (``None``: not told). Without
        them the tracker learns accumulation at the first optimizer step and checkpointing at
        the first recompute, so an OOM in the first micro-batch would advise both.

        Raises:
            ConfigError: ``accumulation_steps`` is not a whole number >= 1.
        """
        check_whole(
            "accumulation_steps", accumulation_steps, 1, "micro-batches", none_means="not told"
        )
        with self.state.lock:
            self.evidence.trainer_settings(
                accumulation_steps, None if checkpointing is None else bool(checkpointing)
            )

    def step(self) -> None:
        """Mark a step boundary (for loops without an optimizer, or to count steps yourself).

        Once called, optimizer steps no longer count as boundaries: only these calls do.
        """
        state = self.state
        if not state.active:
            return
        with state.lock:
            self.phases.manual_step(sys._getframe(1))

    def begin_eval(self) -> None:
        """An evaluation loop begins (a framework's validation): everything until
        :meth:`end_eval` is the eval phase, not only the model's forwards. Nests."""
        state = self.state
        if not state.active:
            return
        with state.lock:
            self.phases.begin_eval()

    def end_eval(self) -> int | None:
        """The evaluation loop :meth:`begin_eval` started ends; returns its peak allocated bytes
        on the tracked device (``None`` if nothing ran in it, or while loops are still nested)."""
        state = self.state
        if not state.active:
            return None
        with state.lock:
            return self.phases.end_eval()

    def batch_on_device(self, batch: Any) -> None:
        """A framework moved ``batch`` to the device for the step that begins (Lightning's
        ``batch_to_device``, before ``training_step``): on the simulated device its tensors
        count from now on, as on a GPU, where a step that reads it late (a GAN's generator
        half first) holds it all along. Nothing to do on a real device: its counters saw the
        copy."""
        sim, state = self.devices.sim, self.state
        if sim is None or not state.active:
            return
        try:
            with state.lock:
                sim.track(batch, inputs=True)
        except Exception:  # memkit's own failure never reaches the training loop
            log.debug("counting the batch failed", exc_info=True)

    def steps_since(self, step: int) -> list[StepRecord]:
        """The tracked device's records of the steps numbered ``step`` and later (cheap: for a
        callback that logs each step's peaks). None while steps are counted from backward
        passes before an optimizer known stepped: those records are folded into one step when
        its first step shows that they were micro-batches (gradient accumulation)."""
        dev = self.devices.primary
        if dev is None or (self.phases.step_rule() == "backward" and self.models.all_optimizers()):
            return []
        out: list[StepRecord] = []
        for row in reversed(dev.steps):
            if row.step < step:
                break
            out.append(step_record(row))
        out.reverse()
        return out

    def open_step_peaks(self) -> dict[str, int | None]:
        """Peak allocated bytes per phase since the last step boundary (the step in progress,
        and what ran after the last step: an evaluation) on the tracked device."""
        state = self.state
        with state.lock:
            if state.active:
                self.devices.close_all()
            dev = self.devices.primary
            if dev is None:
                return dict.fromkeys(PHASES)
            return dict(zip(PHASES, dev.step_phase, strict=True))

    @property
    def current_step(self) -> int:
        """Steps completed so far."""
        return self.state.step

    @property
    def phase(self) -> str:
        """The phase running now."""
        return PHASES[self.state.phase]

    @property
    def history_file(self) -> Path | None:
        """Where the memory history was written (after the block)."""
        return self.history.file

    @property
    def history_error(self) -> str | None:
        """Why the memory history could not be written, if it could not."""
        return self.history.error


def _innermost(tb: TracebackType | None) -> FrameType | None:
    """The frame an exception was raised in (its traceback's last)."""
    frame = None
    while tb is not None:
        frame, tb = tb.tb_frame, tb.tb_next
    return frame


def _is_lightning_module(module: torch.nn.Module) -> bool:
    """Whether ``module`` is a ``LightningModule`` (by its classes: Lightning is not imported
    for it)."""
    return any(
        cls.__name__ == "LightningModule"
        and cls.__module__.startswith(("lightning.", "pytorch_lightning."))
        for cls in type(module).__mro__
    )


def _fsdp_note(units: FsdpUnits) -> str:
    """What the figures are under FSDP2 (sweep CC: no report said FSDP or sharding)."""
    ranks, half = units.sharding()
    largest = units.largest_unit()
    unit = (
        ""
        if largest is None
        else f" (the largest, {largest[0] or 'the root'}: {format_size(largest[1])})"
    )
    policy = (
        f"; its MixedPrecisionPolicy gathers and computes in {half}"
        if half
        else "; no MixedPrecisionPolicy: it gathers and computes in the parameters' dtype"
    )
    return (
        f"FSDP2 (fully_shard) over {ranks} rank(s): parameters, gradients and optimizer state "
        f"are this rank's shards (1/{ranks} of each, padded to a multiple of {ranks} rows); "
        "'all-gathered parameters' are the units it unsharded at that moment, each gathered "
        f"whole for its forward and again for its backward{unit}{policy}"
    )


def _uncounted_note(device: str, found: tuple[tuple[str, int], ...]) -> str:
    """The tensors the script holds that the simulated device did not count (sweep CB: a
    PPO's 8 MiB rollout buffer left out, and a budget passed a setting needing 1.5x it)."""
    names = ", ".join(f"`{name}` ({format_size(size)})" for name, size in found)
    total = format_size(sum(size for _, size in found))
    return (
        f"{device}: the script holds tensors it did not count: {names}: made outside the "
        "steps (before the block, or between steps: a dataset in host memory, rightly left "
        "out; an RL rollout or replay buffer, which on a GPU lives on the device) or read "
        "only by the loss (a batch's targets, a segmentation mask: on a GPU, moved there "
        f"with the batch). Where they live on the GPU, add them ({total} at the end of step 2; "
        "a buffer still filling holds more later) to these peaks"
    )
