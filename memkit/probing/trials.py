"""One probe trial: the oracle that :func:`memkit.probing.search.search_max_batch` calls.

:class:`TrialRunner` runs ``steps`` full steps at one batch size (more while the memory kept
between steps grows, and over the whole cycle of a step whose work varies from call to call:
:mod:`memkit.probing.schedule`), measures the peak (cut into parts by :class:`PartPeaks`),
recovers from an out-of-memory error and, inside a process group,
agrees the outcome with the other ranks. Any other error stops the probe: a step that raises
something else (:class:`~memkit.errors.UserCodeError`), or the machine's own RAM running out
under the simulated device (:func:`host_failure`).
"""

from __future__ import annotations

import contextlib
import gc
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from memkit import distributed
from memkit.devices import (
    CudaBackend,
    SimulatedBackend,
    counter_reader,
    host_memory,
    requested_reader,
)
from memkit.distributed import RankStatus
from memkit.errors import (
    ConfigError,
    DistributedError,
    MemkitError,
    ModelFileError,
    UserCodeError,
)
from memkit.modelfile import batch_args, step_traceback
from memkit.oom import is_oom, parse_oom_message, recover
from memkit.optimizers import unwrap_optimizer
from memkit.probing.hints import step_hint
from memkit.probing.hooks import ProbeHook
from memkit.probing.ranks import PeerFailed, RankSync, agreed_outcome
from memkit.probing.result import ProbeTrial
from memkit.probing.schedule import Schedule, StepWatch, StepWork, WorkLog
from memkit.probing.state import SavedState
from memkit.probing.step import StepPlan, batch_shapes, to_device
from memkit.simulated.accountant import storages_of
from memkit.units import format_size

__all__ = [
    "MAX_STEPS",
    "PART_MODULES",
    "Backend",
    "Kept",
    "PartPeaks",
    "TrialCallback",
    "TrialRunner",
    "first_line",
    "host_failure",
    "optimizer_state_bytes",
]

Backend = CudaBackend | SimulatedBackend
TrialCallback = Callable[[ProbeTrial], None]


def larger_shapes(
    known: list[tuple[int, ...]] | None, shapes: list[tuple[int, ...]]
) -> list[tuple[int, ...]]:
    """Each tensor's largest dimensions over ``known`` and ``shapes``, dimension by dimension
    (the larger by elements where the ranks differ; ``shapes`` where the batches hold
    different numbers of tensors).

    >>> larger_shapes([(2, 9), (3, 4, 8)], [(2, 12), (3, 6, 5)])
    [(2, 12), (3, 6, 8)]
    """
    if known is None or len(known) != len(shapes):
        return shapes
    return [
        tuple(map(max, a, b)) if len(a) == len(b) else max(a, b, key=math.prod)
        for a, b in zip(known, shapes, strict=True)
    ]


def first_line(exc: BaseException, limit: int = 200) -> str:
    """The error's message in one line of at most ``limit`` characters, cut after its last
    whole sentence that fits (else with an ellipsis), or its type's name.

    >>> first_line(RuntimeError("Out of memory. Tried to allocate 2 MiB. " + "x" * 300))
    'Out of memory. Tried to allocate 2 MiB.'
    """
    text = str(exc).strip()
    if not text:
        return type(exc).__name__
    line = text.splitlines()[0]
    if len(line) <= limit:
        return line
    end = line.rfind(". ", 0, limit)
    return line[: end + 1] if end > 0 else line[: limit - 1] + "\u2026"


_HOST_ALLOCATOR_FRAGMENTS = ("DefaultCPUAllocator", "alloc_cpu.cpp")


def host_failure(exc: BaseException, backend: Backend, batch_size: int) -> ConfigError | None:
    """On the simulated cpu device: the error that stops the probe when the *machine* ran out
    of RAM (the host allocator failed, or Python's MemoryError) before the simulated device
    reached its budget. That is not the simulated device's limit, so it must never be counted
    as "does not fit"; ``None`` for anything else (the simulated device's own OOM included)."""
    if not isinstance(backend, SimulatedBackend) or backend.device.type != "cpu":
        return None
    if isinstance(exc, torch.OutOfMemoryError) and not any(
        f in str(exc) for f in _HOST_ALLOCATOR_FRAGMENTS
    ):
        return None  # the simulated device's own OOM
    if not isinstance(exc, MemoryError) and not any(
        f in str(exc) for f in _HOST_ALLOCATOR_FRAGMENTS
    ):
        return None
    available = host_memory().available
    have = "" if available is None else f" (available now: {format_size(available)})"
    said = first_line(exc).rstrip(".")
    return ConfigError(
        f"the machine ran out of RAM at batch size {batch_size} before the simulated device's "
        f"budget ({format_size(backend.budget)}) was reached: {said}. This is the "
        "host's limit, not the simulated device's, so memkit stopped instead of counting it as "
        f"'does not fit'. Give a smaller --budget that this machine can back{have}, or free "
        "some RAM"
    )


PART_MODULES = 48
"""At most this many modules cut a trial's peak into parts: the outermost ones, level by level.
Each cut reads the device's counters once (on CUDA one ``torch._C._cuda_memoryStats`` call,
about 18 us, through :func:`memkit.devices.counter_reader`) and resets the peaks, three times
per module and step."""
MAX_STEPS = 16
"""While the memory kept between a trial's steps still grows (an optimizer's history, a cache
that fills), or the step's work varies and no cycle is seen yet, the trial steps on, up to
this many steps."""


_PATH_CHANGES_WITH_HOOKS = (torch.nn.TransformerEncoderLayer,)
"""Modules whose forward takes another path when it or a module inside it has forward hooks:
``TransformerEncoderLayer`` leaves its fused inference kernel (torch/nn/modules/transformer.py,
"forward pre-/hooks are attached to the module") for the op-by-op path, which keeps more
memory. The probe cuts no part inside them: it must measure the model's own path."""


def _outer_modules(model: torch.nn.Module, limit: int) -> list[torch.nn.Module]:
    """The model and its submodules, breadth first, while a whole level fits in ``limit``;
    none that is or lies inside a :data:`_PATH_CHANGES_WITH_HOOKS` module."""
    if isinstance(model, _PATH_CHANGES_WITH_HOOKS):
        return []
    chosen, level = [model], [model]
    while level:
        level = [
            child
            for module in level
            for child in module.children()
            if not isinstance(child, _PATH_CHANGES_WITH_HOOKS)
        ]
        if len(chosen) + len(level) > limit:
            break
        chosen += level
    return chosen


class PartPeaks:
    """A trial's peak cut into parts at every module's forward start and end, every module
    output's gradient (backward, module by module) and the optimizer step's start and end.

    A step's peak is the largest of many lines in the batch size: each moment of the step
    holds some bytes that do not depend on the batch and some that grow with it. At small
    sizes a flat moment (the optimizer step, the embedding's dense gradient at the end of
    backward) sets the whole peak and hides the growing one, so a line through whole peaks
    aims far past the limit. The search fits a line to each part instead and aims where the
    first of them reaches the capacity. The parts are *allocated* peaks, the smooth measure
    (on CUDA the reserved peak moves in allocator segments); the reserved peak of the whole
    trial is kept beside them. The hooks only read and reset the device's counters (one call
    each through ``counters``); they keep no tensor, and a copy of the model or optimizer that
    the step makes (an EMA's ``copy.deepcopy``) holds them inert (:mod:`memkit.probing.hooks`).
    """

    def __init__(self, counters: tuple[Any, Any], model: torch.nn.Module, optimizer: Any) -> None:
        self.read, self.reset = counters
        self.parts: list[int] = []
        self.reserved = 0
        self.hooks: list[ProbeHook] = []  # a step's copy of the model gets none of them
        handles: list[Any] = []
        stepping = unwrap_optimizer(optimizer)  # (an AcceleratedOptimizer has no hooks)
        if stepping is not None:
            handles += [
                stepping.register_step_pre_hook(self._hook(self._cut)),
                stepping.register_step_post_hook(self._hook(self._cut)),
            ]
        if not hasattr(model, "_orig_mod"):  # hooks inside a compiled model would recompile it
            for module in _outer_modules(model, PART_MODULES):
                handles.append(module.register_forward_pre_hook(self._hook(self._cut)))
                handles.append(module.register_forward_hook(self._hook(self._after_forward)))
        self.handles = handles

    def _hook(self, call: Callable[..., Any]) -> ProbeHook:
        hook = ProbeHook(call)
        self.hooks.append(hook)
        return hook

    def _cut(self, *_: Any) -> None:
        _, _, peak_allocated, peak_reserved = self.read()
        self.parts.append(peak_allocated)
        if peak_reserved > self.reserved:
            self.reserved = peak_reserved
        self.reset()

    def _after_forward(self, module: Any, args: Any, output: Any) -> None:
        self._cut()
        if isinstance(output, torch.Tensor):
            tensors: Any = (output,)
        elif isinstance(output, dict):
            tensors = output.values()
        elif isinstance(output, (tuple, list)):
            tensors = output
        else:
            return
        for tensor in tensors:
            if isinstance(tensor, torch.Tensor) and tensor.requires_grad:
                tensor.register_hook(self._hook(self._cut))

    def finish(self) -> tuple[int, int, tuple[int, ...]]:
        """``(peak_reserved, peak_allocated, part_peaks)`` of the whole trial, once it has
        ended; the parts are allocated peaks."""
        self._cut()
        return self.reserved, max(self.parts), tuple(self.parts)

    def close(self) -> None:
        """Remove the hooks; those a handle cannot reach (an output kept past the trial)
        do nothing from now on."""
        for handle in self.handles:
            handle.remove()
        self.handles = []
        for hook in self.hooks:
            hook.close()
        self.hooks = []


def _tensor_bytes(obj: Any, seen: set[int]) -> int:
    """Bytes of the distinct tensors in a nest of dicts, lists and tuples (an optimizer's
    state: Adam's moments, LBFGS's direction history)."""
    if isinstance(obj, torch.Tensor):
        total = 0
        for storage in storages_of(obj):  # a sparse tensor's (SGD's momentum): its parts'
            key = storage.data_ptr() if obj.device.type != "meta" else id(storage)
            if key not in seen:
                seen.add(key)
                total += storage.nbytes()
        return total
    if isinstance(obj, dict):
        return sum(_tensor_bytes(v, seen) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_tensor_bytes(v, seen) for v in obj)
    return 0


def _stepped_params(model: torch.nn.Module, optimizer: Any) -> tuple[torch.Tensor, ...]:
    """The parameters a training step should write in place (their version counters move):
    the optimizer's (a linear probe's head, not its frozen-by-omission backbone), else the
    model's trainable ones."""
    if optimizer is not None and getattr(optimizer, "param_groups", None):
        return tuple(p for g in optimizer.param_groups for p in g["params"] if p.requires_grad)
    return tuple(p for p in model.parameters() if p.requires_grad)


def _sampled_values(params: tuple[torch.Tensor, ...]) -> list[torch.Tensor]:
    """A few values of each of the first 8 ``params``, copied to the host: a fused optimizer
    (``AdamW(fused=True)``, transformers' default) and writes through ``.data`` (``p.data.add_``
    in pytorch/examples' word_language_model) change parameters without moving their version
    counters."""
    local = [p.to_local() if hasattr(p, "to_local") else p for p in params[:8]]  # (FSDP2 shards)
    return [t.detach().reshape(-1)[:16].to("cpu", copy=True) for t in local]


def _state_without_tensors(optimizer: Any) -> bool:
    """Whether the optimizer keeps per-parameter state that holds no tensor of more than one
    element (a step counter alone): state an optimizer may make at a later step (one that
    switches to Adam's moments at its third step)."""
    state = getattr(optimizer, "state", None)
    if not state:
        return False
    return not any(
        isinstance(value, torch.Tensor) and value.numel() > 1
        for entry in list(state.values())
        if isinstance(entry, dict)
        for value in entry.values()
    )


def optimizer_state_bytes(optimizer: Any) -> int:
    """Bytes the optimizer's state holds (``optimizer.state``), each storage counted once."""
    state = getattr(optimizer, "state", None)
    return 0 if not state else _tensor_bytes(dict(state), set())


@dataclass(frozen=True)
class Kept:
    """What a trial's loop kept between its steps: the tensors' bytes after each step (CUDA's
    requested bytes, which the cached blocks' slack does not move), and the
    optimizer state's bytes after each step; ``cycle``: the steps after which the step's work
    repeats (1: every step alike), so that steps are compared with the same call of the cycle."""

    after_step: tuple[int, ...]
    optimizer: tuple[int, ...]
    cycle: int = 1

    @property
    def growth(self) -> int:
        """Bytes kept after the last step beyond those kept after the first step at the same
        point of the cycle."""
        if not self.after_step:
            return 0
        first = (len(self.after_step) - 1) % self.cycle
        return max(0, self.after_step[-1] - self.after_step[first])

    @property
    def optimizer_growth(self) -> int:
        """Of :attr:`growth`, the bytes the optimizer's state added."""
        return max(0, self.optimizer[-1] - self.optimizer[0]) if self.optimizer else 0

    @property
    def still_growing(self) -> bool:
        """Whether the last step still added to what is kept (to what the same point of the
        previous cycle kept)."""
        back = self.cycle + 1
        return len(self.after_step) >= back and self.after_step[-1] > self.after_step[-back]


@dataclass
class TrialRunner:
    """The oracle handed to the search: runs one batch size and reports (fits, peak)."""

    model: torch.nn.Module
    make_batch: Callable[..., Any]
    optimizer: Any
    step: StepPlan
    backend: Backend
    steps: int
    capacity: int | None
    saved: SavedState
    seq_len: int | None = None
    on_trial: TrialCallback | None = None
    sync: RankSync | None = None
    capacities: tuple[int | None, ...] | None = None
    timeout: float | None = None
    on_start: Callable[[int], None] | None = None

    def __post_init__(self) -> None:
        self.records: dict[int, ProbeTrial] = {}
        self.counters = counter_reader(self.backend)
        self.kept_bytes = requested_reader(self.backend)  # what steps keep: blocks' slack aside
        self.baseline: int | None = None  # allocated between trials, once collected
        self.collections = 0  # gc.collect() calls between trials (not after OOMs)
        self.held_after_oom: dict[int, int] = {}  # batch size -> bytes its OOM left held
        # training: the first trial that completes, when the optimizer's state holds no tensor
        # yet (_state_without_tensors), steps on until it does (up to MAX_STEPS); the trials
        # then run at least as many steps as that took
        self._awaiting_state = self.step.mode == "train" and self.optimizer is not None
        self.state_appeared_at: int | None = None  # the step that made it, if one did
        # training: whether the first trial that ran its steps left the parameters as they
        # were (no optimizer step ran: a train_step without optimizer.step() or backward),
        # and no later trial changed them
        self.untrained: int | None = None  # the batch size of that trial, if it did
        self._checked_training = self.step.mode != "train"
        # training: a step whose work varies from call to call (memkit.probing.schedule): what
        # the trials have shown, and what it asks of the next trials; a fit measured before the
        # latest news is superseded (the runner's caller retests the answer)
        self.log = (
            WorkLog(StepWatch(self.model, self.optimizer), MAX_STEPS)
            if self.step.mode == "train"
            else None
        )
        self._works: list[StepWork] = []  # the work of the last trial's steps (with a watch)
        self.history: list[ProbeTrial] = []  # every trial, in the order run
        # batch size -> each input tensor's largest shape the trials drew at it (a
        # make_batch of random lengths draws another at every call)
        self.largest_inputs: dict[int, list[tuple[int, ...]]] = {}

    @property
    def trial_steps(self) -> int:
        """The steps a trial runs at least."""
        return self.steps if self.log is None else max(self.steps, self.log.cycle_steps)

    @property
    def schedule(self) -> Schedule | None:
        """What the trials showed of a step whose work varies, if they did."""
        return None if self.log is None else self.log.schedule

    def superseded(self, index: int) -> bool:
        """Whether the trial ``index`` (in the order run) fit before the trials showed how
        the step's work varies: its fit does not count."""
        return self.history[index].fits and self.log is not None and index < self.log.valid_from

    def answer_superseded(self, batch_size: int) -> bool:
        """Whether the last trial at ``batch_size`` is :meth:`superseded`."""
        last = max(i for i, t in enumerate(self.history) if t.batch_size == batch_size)
        return self.superseded(last)

    def _batch(self, batch_size: int) -> Any:
        args = batch_args(batch_size, self.seq_len)
        try:
            batch = self.make_batch(*args)
            shapes = batch_shapes(batch)
            known = self.largest_inputs.get(batch_size)
            self.largest_inputs[batch_size] = larger_shapes(known, shapes)
            return batch
        except Exception as exc:
            if is_oom(exc) or isinstance(exc, MemoryError):
                raise  # a batch made on the device that does not fit: the trial's answer
            shown = ", ".join(map(str, args))
            raise ModelFileError(
                f"make_batch({shown}) raised {type(exc).__name__}: {exc}; if it cannot make "
                "batches this large, give the largest it can make as --max-batch (max_batch= "
                "in the Python API)"
            ) from exc

    def _device_batch(self, batch_size: int) -> Any:
        """``make_batch``'s batch on the device. On the simulated device a batch is host
        tensors (``to_device`` leaves them), counted as they reach the device: made without
        counting, then each tensor at its own size, so a batch sliced from a dataset in RAM
        (``x_train[:n]``) counts its rows, as ``.to("cuda")`` would copy them, not the whole
        dataset it views."""
        backend = self.backend
        if not isinstance(backend, SimulatedBackend):
            return to_device(self._batch(batch_size), backend.device)
        backend.count_ops(False, False)
        try:
            batch = to_device(self._batch(batch_size), backend.device)
        finally:
            backend.count_ops(True, True)
        backend.track(batch, inputs=True)
        return batch

    def _clean(self) -> None:
        """Back to the state before any trial: no gradients, the modules' plain attributes and
        the optimizer's state as saved, an empty cache and fresh peaks. ``gc.collect()`` only
        before the first trial and when more is allocated than after the last collection
        (reference cycles keeping tensors alive); after an OOM, :func:`memkit.oom.recover` has
        collected already.

        What survives a collection is frozen (as the probe froze what was alive before it, and
        unfreezes at its end): the modules and caches a first CUDA step creates lazily
        (about 100,000 objects with fused AdamW and autocast on nanoGPT) made every later
        collection cost 50-120 ms on the H200 machine; frozen, a collection walks only the
        trial's own objects. Reference counting still frees them; the probe's end unfreezes."""
        if self.step.mode == "train":  # (an evaluation's trials keep what training left)
            self.model.zero_grad(set_to_none=True)
        self.saved.reset_attributes()  # a history the steps append to: not the next trial's
        self.saved.reset_optimizer()
        self._free_workspaces()
        read = self.counters[0]
        if self.baseline is None or read()[0] > self.baseline:
            gc.collect()
            gc.freeze()
            self.collections += 1
            # what a collection leaves is not garbage (a cache the model keeps, made by the
            # first trial): the next trials start from it
            self.baseline = read()[0]
        self.backend.empty_cache()
        self.counters[1]()

    def _free_workspaces(self) -> None:
        """On a GPU, no cuBLAS workspaces before a trial: a fresh process makes them at its
        first matmuls (the forward's thread, then autograd's), among what the step holds then,
        where they may reuse a freed block; made once by the first trial and kept, they held
        segments of their own through every later trial. The likely cause (not yet checked on a
        GPU) of the H200's run 5: under caps of a few hundred MiB, four of six model files'
        loops fit one more sample in a fresh process than the probe said, and one ran out at
        the probe's answer; the CUDA stand-in, which follows the allocator's rules but has no
        workspaces, is exact on the two of them tried there (CLIP, the EMA)."""
        free = getattr(self.backend, "free_workspaces", None)
        if free is not None and self.trial_steps > 1:  # (a loop's later steps hold them:
            free()  # a one-step trial stands for those, with them made already)

    def _run_steps(self, batch_size: int, *, extend: bool = True, steps: int = 0) -> Kept:
        """``steps`` steps (the trial's when 0), then more (``extend``; up to ``MAX_STEPS``)
        while what the loop keeps between steps still grows, and while the steps' work varies
        with no cycle seen yet (or, after a failed trial's steps varied, until they vary).
        Returns what was kept after each step; each step's work is in ``_works`` (with
        ``extend``), also when a step raised."""
        steps = steps or self.trial_steps
        kept: list[int] = []
        state: list[int] = []
        log = self.log if extend else None
        works: list[StepWork] = []
        if log is not None:
            self._works = works
        cycle: int | None = 1
        cycling = False
        state_before = optimizer_state_bytes(self.optimizer)
        held: list[Any] = []  # the last step's prefetched micro-batches (prefetch)
        try:
            with log.watch.watching() if log is not None else contextlib.nullcontext():
                while True:
                    micro = self.step.micro_batches
                    if self.step.prefetch:  # all K (or the next one) on the device, then run;
                        # the last step's go once the next step's are fetched (Trainer's
                        # get_batch_samples rebinds its list then)
                        fetched = [
                            self._device_batch(batch_size) for _ in range(self.step.accumulation)
                        ]
                        held = fetched
                        del fetched
                    for i in range(micro):
                        batch = held[i] if held else self._device_batch(batch_size)
                        self.step(self.model, batch, self.optimizer, last=i == micro - 1)
                        del batch
                    if self.sync is not None:
                        self.sync.end_step()
                    kept.append(self.kept_bytes())
                    state.append(optimizer_state_bytes(self.optimizer))
                    if log is not None:
                        works.append(log.watch.take())
                        cycle = log.cycle_in(works)
                        cycling = log.keeps_stepping(works)  # news not yet seen through
                    done = len(kept) >= steps
                    # kept memory is compared with the same point of the cycle; a first step
                    # that created the optimizer's state (Adam's) is followed by one whose
                    # forward meets it, also with steps=1
                    back = 1 if cycle is None else cycle
                    growing = extend and (kept[-1] > kept[-1 - back] if len(kept) > back else
                                          state[0] > state_before)  # fmt: skip
                    # a history that grows with a step now and then skipped (LBFGS keeps a
                    # pair only where the curvature allows): one level step is not the end
                    growing = growing or (
                        extend and back == 1 and len(kept) > 2 and kept[-2] > kept[-3]
                    )  # (a step whose work varies has its own rule: its cycle)
                    awaiting = extend and self._awaiting_state
                    if awaiting and not _state_without_tensors(self.optimizer):
                        if self.state_appeared_at is None and len(kept) > steps:
                            self.state_appeared_at = len(kept)
                        awaiting = False
                    if len(kept) >= max(steps, MAX_STEPS):
                        break
                    if done and not growing and not awaiting and not cycling:
                        break
        finally:
            held.clear()
            self.step.release()  # the trial's loop is over: its last output goes too
        return Kept(tuple(kept), tuple(state), cycle or 1)

    def _note_work(self, batch_size: int, *, completed: bool = True) -> None:
        """After a trial (of one that ran out, the steps it completed): what its steps' work
        says, kept by the :class:`~memkit.probing.schedule.WorkLog`."""
        if self.log is not None:
            self.log.note(
                self._works, batch_size, len(self.history), completed=completed,
                steps=self.steps,
            )  # fmt: skip

    def __call__(
        self, batch_size: int
    ) -> tuple[bool, int | None, tuple[int, ...] | None, int | None]:
        if self.on_start is not None:
            self.on_start(batch_size)
        if self.capacities is not None:
            return self._call_ranks(batch_size)
        self._clean()
        before = self.counters[0]()[0]
        failed: BaseException | None = None
        split = PartPeaks(self.counters, self.model, self.optimizer)
        kept: Kept | None = None
        started = time.perf_counter()
        # checked on the first trial that completes, and again while none stepped the
        # optimizer (a step that steps every k-th call: a later trial runs its cycle)
        looks = not self._checked_training or self.untrained is not None
        witnesses = _stepped_params(self.model, self.optimizer) if looks else ()
        versions = [p._version for p in witnesses]
        values = _sampled_values(witnesses)
        try:
            with self.backend.activate():
                kept = self._run_steps(batch_size)
            self._note_work(batch_size)
            if self._awaiting_state:  # the first trial that completed has looked
                self._awaiting_state = False
                self.steps = max(self.steps, self.state_appeared_at or 0)
            if witnesses:
                unchanged = all(
                    p._version == v for p, v in zip(witnesses, versions, strict=True)
                ) and all(map(torch.equal, values, _sampled_values(witnesses)))
                if not self._checked_training:
                    self._checked_training = True
                    self.untrained = batch_size if unchanged else None
                elif not unchanged:
                    self.untrained = None  # a later trial stepped it
        except MemkitError:
            raise
        except Exception as exc:
            host = host_failure(exc, self.backend, batch_size)
            if host is not None:
                recover(self.backend, exc)
                raise host from None
            if not is_oom(exc):
                raise UserCodeError(
                    f"the {self.step.name} raised {type(exc).__name__} at batch size "
                    f"{batch_size}; this is not an out-of-memory error, so memkit stopped "
                    "instead of retrying:\n"
                    + step_traceback(exc)
                    + step_hint(exc, batch_size, self.step),
                    original=exc,
                ) from exc
            failed = exc
        finally:  # whatever ends the trial (an error, Ctrl-C), the model keeps no hook of ours
            split.close()
        seconds = time.perf_counter() - started
        parts: tuple[int, ...] | None = None
        allocated: int | None = None
        if failed is not None:
            # Bytes known to be needed: what was held when the allocation failed (from the
            # message: the unwinding has freed some already) plus what it tried to get.
            need = parse_oom_message(failed).needed_at_least(self.backend.allocated())
            error = first_line(failed)
            recover(self.backend, failed)
            del failed
            self.model.zero_grad(set_to_none=True)
            self._note_work(batch_size, completed=False)
            self._release_failed_step(batch_size, before)
            record = ProbeTrial(batch_size, False, need, seconds, None, error)
        else:
            peak, allocated, parts = split.finish()
            fits = self.capacity is None or peak <= self.capacity
            over = None if fits else f"peak {format_size(peak)} exceeds the capacity"
            assert kept is not None
            record = ProbeTrial(
                batch_size, fits, peak, seconds, allocated, over,
                steps_run=len(kept.after_step),
                kept_growth_bytes=kept.growth or None,
                optimizer_growth_bytes=kept.optimizer_growth or None,
                still_growing=kept.still_growing,
                part_peaks=parts,
            )  # fmt: skip
        self.records[batch_size] = record
        self.history.append(record)
        if self.on_trial is not None:
            self.on_trial(record)
        return record.fits, record.peak_bytes, parts, allocated

    def _release_failed_step(self, batch_size: int, before: int) -> None:
        """After an OOM at ``batch_size``: give back what the failed step left allocated
        beyond ``before`` (the trial's start), so that it does not make the next trials run out.

        The step's own tensors are gone once :func:`memkit.oom.recover` has run; what stays is
        held by the script's own variables. A global that keeps the last logits (nanoGPT's
        ``logits``, kept until the next forward) keeps their whole autograd graph when backward
        ran out, since the graph is freed only by a backward that completes. In a training loop
        the next iteration rebinds the variable; here one step at the smallest size that fit
        does the same, run without the budget's cap (the held bytes fill most of it).
        Whatever is still held after it is recorded in ``held_after_oom``.
        """
        self._free_workspaces()  # (the trial made them again: not what the step left)
        read = self.counters[0]
        if read()[0] <= before:
            return
        fitted = [size for size, record in self.records.items() if record.fits]
        if not fitted:  # nothing fit: no trial follows that it could fail (and a first
            return  # trial's lazy allocations, a cuBLAS workspace, are no one's to blame)
        try:
            with self.backend.uncapped():
                # what the failed step left half-written: a gradient scaler's stage after
                # unscale_, LBFGS's state after an OOM inside its closure (n_iter set,
                # prev_flat_grad not yet); put back uncapped, beside what the step left
                self.saved.reset_optimizer()
                self._run_steps(min(fitted), extend=False, steps=1)
        except Exception as exc:
            if not is_oom(exc):
                raise UserCodeError(
                    f"the {self.step.name} raised {type(exc).__name__} at batch size "
                    f"{min(fitted)}, which had fit before; this is not an out-of-memory "
                    "error, so memkit stopped:\n" + step_traceback(exc),
                    original=exc,
                ) from exc
            recover(self.backend, exc)
            del exc
        self._clean()
        held = read()[0] - before
        if held > 0:
            self.held_after_oom[batch_size] = held

    def _call_ranks(
        self, batch_size: int
    ) -> tuple[bool, int | None, tuple[int, ...] | None, int | None]:
        """One trial on every rank; the agreed outcome (same on every rank)."""
        self._clean()
        caught: BaseException | None = None
        started = time.perf_counter()
        try:
            synced = self.sync.trial() if self.sync else contextlib.nullcontext()
            with self.backend.activate(), synced:
                self._run_steps(batch_size, extend=False)  # the ranks step in lockstep
        except DistributedError:
            raise  # a collective failed: the group cannot be used for the exchange
        except Exception as exc:
            caught = exc
        seconds = time.perf_counter() - started
        status, error, local_error = RankStatus.OK, None, None
        need: int | None = None
        if caught is not None:
            if isinstance(caught, PeerFailed):
                status = RankStatus.ABORTED
            elif isinstance(caught, MemkitError):
                status, local_error = RankStatus.ERROR, caught
            elif (host := host_failure(caught, self.backend, batch_size)) is not None:
                status, local_error = RankStatus.ERROR, host
            elif not is_oom(caught):
                status = RankStatus.ERROR
                local_error = UserCodeError(
                    f"rank {distributed.rank()}: the {self.step.name} raised "
                    f"{type(caught).__name__} at batch size {batch_size}; this is not an "
                    "out-of-memory error, so memkit stopped instead of retrying:\n"
                    + step_traceback(caught)
                    + step_hint(caught, batch_size, self.step),
                    original=caught,
                )
                local_error.__cause__ = caught
            else:
                status = RankStatus.OOM
                need = parse_oom_message(caught).needed_at_least(self.backend.allocated())
                error = first_line(caught)
            if local_error is None:
                recover(self.backend, caught)
            del caught
            self.model.zero_grad(set_to_none=True)
        if self.sync is not None and status in (RankStatus.OOM, RankStatus.ERROR):
            self.sync.fail(status)
        peak = alloc = None
        fits = 0
        if status == RankStatus.OK:
            peak, alloc = self.backend.peak_reserved(), self.backend.peak_allocated()
            fits = int(self.capacity is None or peak <= self.capacity)
        rows = distributed.all_gather_ints([status, fits, peak, alloc, need], timeout=self.timeout)
        if local_error is not None:
            raise local_error
        assert self.capacities is not None
        outcome = agreed_outcome(rows, self.capacities)
        if outcome.status == RankStatus.ERROR:
            bad = [r for r, row in enumerate(rows) if row[0] == RankStatus.ERROR]
            raise DistributedError(
                f"rank {distributed.rank()}: rank(s) {bad} raised an error that is not an OOM "
                f"at batch size {batch_size}; see that rank's traceback"
            )
        if not outcome.fits:
            ranks = ", ".join(str(r) for r in outcome.failed_ranks)
            error = f"does not fit on rank(s) {ranks}" + (f": {error}" if error else "")
        record = ProbeTrial(
            batch_size, outcome.fits, outcome.peak_bytes, seconds,
            outcome.peak_allocated_bytes, error, rank_peaks=outcome.rank_peaks,
        )  # fmt: skip
        self.records[batch_size] = record
        self.history.append(record)
        if self.on_trial is not None:
            self.on_trial(record)
        return record.fits, record.peak_bytes, None, None
