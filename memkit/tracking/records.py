"""What the tracker records: per device, per module, per step, and the calls in progress.

The hot path (memkit/tracking/hooks.py, device_set.py) updates these plain attributes
directly; the functions here close a step's record, merge the steps counted from backward
passes, and turn a device's records into the report's
:class:`~memkit.tracking.report.DeviceReport`. Torch is only used for the types of module
references.
"""

from __future__ import annotations

import dataclasses
import weakref
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
from torch.nn.utils.parametrize import ParametrizationList
from torch.optim.swa_utils import AveragedModel

from memkit.devices import UserPeaks, counter_reader, peak_taker
from memkit.tracking import leaks
from memkit.tracking.report import (
    PHASES,
    Breakdown,
    DeviceReport,
    LeakFinding,
    ModuleRecord,
    StepRecord,
    TimelinePoint,
    TrainingSetup,
    made_outside,
)
from memkit.units import format_size

if TYPE_CHECKING:
    from memkit.tracking.breakdown import PeakMoment

__all__ = [
    "DEFAULT_STEP_LIMIT",
    "DEFAULT_TIMELINE_LIMIT",
    "DeviceRecord",
    "Frame",
    "IgnoredCall",
    "ModuleStat",
    "RootInfo",
    "RunFacts",
    "StepRow",
    "close_step",
    "current_leak",
    "device_report",
    "display_names",
    "fold_steps",
    "module_records",
    "step_record",
]

Namer = Callable[[str | None], str | None]
"""Module keys to the names reports show (:func:`display_names`)."""

DEFAULT_TIMELINE_LIMIT = 100_000
"""Counter readings kept per device (the most recent ones)."""

DEFAULT_STEP_LIMIT = 100_000
"""Step records kept per device (the most recent ones)."""


class StepRow(NamedTuple):
    """One step as the boundary keeps it (the hot path builds no dataclass): the fields of
    :class:`~memkit.tracking.report.StepRecord`, the phase peaks as a tuple in ``PHASES``
    order (:func:`step_record` makes the record)."""

    step: int
    start: int
    end: int
    peak: int
    peak_reserved: int
    phases: tuple[int | None, ...]
    duration_s: float
    backward_passes: int


@dataclasses.dataclass
class RunFacts:
    """What the training used and did beyond the device records, for the report and the
    advice (captured while the objects are alive)."""

    eval_forwards: int = 0
    eval_input: tuple[int, ...] | None = None  # the largest evaluation input's shape
    last_input: tuple[int, ...] | None = None  # the last model forward's input shape
    last_root: tuple[bool, bool] | None = None  # (training, grad enabled) of that forward
    # the model and its parameter bytes, when that forward was an evaluation pass of a model
    # no optimizer trains (a distillation teacher, a DPO reference model)
    frozen_model: tuple[str, int, bool, int] | None = None
    # the forwards of such models on the training batch (a teacher's in every step): how many,
    # the last such model, its largest input, and their peak per device (in the eval column)
    frozen_forwards: int = 0
    frozen_seen: tuple[str, int, bool, int] | None = None  # all of them, as one
    frozen_all: dict[str, tuple[str, int, bool, int]] = dataclasses.field(default_factory=dict)
    frozen_input: tuple[int, ...] | None = None
    frozen_peaks: dict[str, int] = dataclasses.field(default_factory=dict)
    # device -> allocated when the forward that set its frozen peak began
    frozen_bases: dict[str, int] = dataclasses.field(default_factory=dict)
    frozen_autocast: bool = False  # a forward of such a model ran under autocast
    frozen_steps: int = 0  # the steps such forwards ran in
    frozen_step: int = -1  # the last of them
    train_input: tuple[int, ...] | None = None  # the last training forward's input shape
    eval_grad: int = 0  # eval-mode forwards that recorded a graph
    eval_grad_bytes: int = 0  # the most such a forward kept
    param_dtype: str | None = None
    optimizer_name: str | None = None
    state_was_empty: bool = True  # no optimizer had state at the last look
    grads_were_none: bool = True  # the model had no gradients at the last look
    autocast_forwards: int = 0
    unsafe_loss: str | None = None  # a loss CUDA's autocast refuses (binary_cross_entropy)
    grads_steps: int = 0  # steps whose first forward found gradients allocated
    grads_at_forward_bytes: int = 0  # the most gradient bytes such a forward found
    grads_into_backward: int = 0  # of those steps, the ones whose first backward found them too
    grads_checked_step: int = 0
    # gradients of parameters no optimizer steps, by model: the most seen at once, and the
    # step that saw them; every look's (step, bytes) (``stale-gradients``)
    stale_gradients: tuple[tuple[str, int], ...] = ()
    stale_step: int | None = None
    stale_looks: tuple[tuple[int, int], ...] = ()
    # a training forward after a caught OOM that began with the failed attempt's graph still
    # held: (the step, the bytes its saved tensors hold, the variables holding it)
    retry_held: tuple[int, int, tuple[str, ...]] | None = None
    # a graph a backward(retain_graph=True) ran through, still saving tensors after a later
    # backward: (the step, the bytes, the variables holding it)
    retained_held: tuple[int, int, tuple[str, ...]] | None = None
    # on the simulated device, (name, bytes) of tensors of 1 MiB or more in the script's frames
    # it does not count, looked for once at step 2's start (a dataset, a rollout buffer)
    uncounted: tuple[tuple[str, int], ...] = ()
    dp_output_bytes: int = 0  # the largest output DataParallel gathered
    dp_layout: tuple[tuple[int, ...], int] | None = None  # its device_ids and output device
    # the trainer's settings, told by a framework callback (Tracker.trainer_settings) before
    # the first step: known before the first optimizer step or recompute shows them
    accumulation_steps: int | None = None
    checkpointing: bool | None = None
    checkpoint_seen: bool = False  # a training forward ran inside torch.utils.checkpoint
    offload_noted: bool = False  # ... inside save_on_cpu, said on the simulated device
    # a model found running is a LightningModule: its automatic_optimization (``None``: no
    # Lightning), so that memkit run says the advice in Lightning's terms as its callback does
    lightning_automatic: bool | None = None


class Frame:
    """One module call in progress (per thread)."""

    __slots__ = (
        "alloc_in",
        "children",
        "dev",
        "eval_grad",
        "gathered_in",
        "keeps_nothing",
        "kind",
        "max",
        "mid",
        "ms",
        "name",
        "outputs",
        "region",
        "region_children",
        "unsaved",
    )

    def __init__(
        self, name: str, mid: int, dev: DeviceRecord, alloc_in: int, ms: ModuleStat, kind: int
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
        self.gathered_in = dev.gathered  # FSDP2's all-gathered bytes at entry
        # autograd saves nothing on the device in the call (grad off, or saved-tensor hooks:
        # activation checkpointing, save_on_cpu), and in its caller neither: what it leaves
        # is transient (its outputs die inside the caller's region), kept by no backward
        self.unsaved = False
        self.keeps_nothing = False
        # the saved-tensor hook active at entry (``None``: none): one non-reentrant checkpoint
        # region; in a caller outside any region, what its children left in one region
        # (transformers checkpoints a layer's ``forward``, not its call: the layer's children
        # then share the region, and only what the layer returns is kept)
        self.region: object | None = None
        self.region_children: list[tuple[object, ModuleStat, int, int]] | None = None
        # its children's training calls (and theirs that they returned on), kept once this
        # call ends: an output that died before it returned (a Linear's, which the ReLU after
        # it does not save) was not kept
        self.outputs: list[PendingKeep] | None = None


class PendingKeep:
    """A training call's kept bytes, waiting for what it returned to die or live on: the
    stat, bytes kept (less its children's: ``own``), and per storage it returned (a weak
    reference, its bytes and address, and whether it came from the call's own child);
    ``counted``: in its caller's children's bytes already."""

    __slots__ = ("counted", "delta", "ms", "outputs", "own")

    def __init__(
        self, ms: ModuleStat, delta: int, own: int, outputs: list[tuple[Any, int, int, bool]]
    ) -> None:
        self.ms = ms
        self.delta = delta
        self.own = own
        self.outputs = outputs
        self.counted = False


class IgnoredCall:
    """A module call outside the trained model (a loss module, a data transform)."""

    __slots__ = ("mid",)
    kind = -1

    def __init__(self, mid: int) -> None:
        self.mid = mid


class RootInfo:
    """What the tracker knows about one top-level module it has seen (cold path)."""

    __slots__ = (
        "_sample", "_trained_param", "averaged", "first_pass", "keys", "model", "ref", "trained",
        "walked_step",
    )  # fmt: skip

    def __init__(self, module: torch.nn.Module, keys: dict[int, str | None]) -> None:
        self.ref = weakref.ref(module)
        self.keys = keys  # id(submodule) -> module key (None: a transparent wrapper)
        self.walked_step = -1  # the step its module was last walked for a module not in keys
        # only modules with parameters can be trained; a parametrization (weight_norm,
        # spectral_norm) runs whenever its attribute is read, at registration and by a
        # script's logging too: it is part of the model that reads it, never a model itself
        self.model = not isinstance(module, ParametrizationList) and any(
            True for _ in module.parameters()
        )
        self._trained_param: weakref.ref[torch.Tensor] | None = None
        self._sample: tuple[weakref.ref[torch.Tensor], ...] = ()
        self.trained = False  # a training forward of it ran
        self.first_pass: int | None = None  # the backward passes at its first forward
        # an averaged copy (torch.optim.swa_utils: SWA, EMA): no optimizer ever steps it, so
        # its forwards are evaluation, in training mode with its parameters requiring grad too
        self.averaged = isinstance(module, AveragedModel)

    def trainable(self) -> bool:
        """Whether a parameter of the module requires grad now: asked at each forward, as a
        GAN freezes its discriminator for the generator's update and unfreezes it for its own
        (``requires_grad_(False)``/``(True)``). The parameter found trainable last is asked
        first; a module found frozen is asked again through a sample of its parameters (the
        first, the last and a few between: freezing and unfreezing go by whole modules), not
        by walking all of them at every forward (a frozen VGG of a perceptual loss)."""
        found = self._trained_param
        param = found() if found is not None else None
        if param is not None and param.requires_grad:
            return True
        sample = [ref() for ref in self._sample]
        if sample and all(p is not None for p in sample):
            for param in sample:
                if param is not None and param.requires_grad:
                    self._trained_param = weakref.ref(param)
                    return True
            return False
        module = self.ref()
        params = list(module.parameters()) if module is not None else []
        picked = params[:: max(1, len(params) // 6)]
        if params and params[-1] is not picked[-1]:
            picked.append(params[-1])
        self._sample = tuple(weakref.ref(p) for p in picked)
        for param in params:
            if param.requires_grad:
                self._trained_param = weakref.ref(param)
                return True
        return False


class ModuleStat:
    """One module's numbers on one device (updated by the forward hooks)."""

    __slots__ = (
        "act_max",
        "bw",
        "calls",
        "eval_calls",
        "frozen32",
        "grad_input",
        "leaf",
        "out_max",
        "over_max",
        "peak",
        "recompute_calls",
        "self_max",
        "step_id",
        "step_max",
        "step_passes",
        "step_sum",
        "trainable32",
        "type_name",
    )

    def __init__(
        self,
        leaf: bool,
        bw: Callable[[torch.Tensor], None] | None,
        type_name: str,
        weights: tuple[int, int] = (0, 0),
    ) -> None:
        self.bw = bw
        self.type_name = type_name
        # its own float32 parameters' bytes, frozen and trainable; whether a training call's
        # input required grad (with grad on), read where it has frozen ones
        self.frozen32, self.trainable32 = weights
        self.grad_input = False
        self.calls = 0
        self.eval_calls = 0
        self.recompute_calls = 0
        self.act_max = 0
        self.self_max = 0
        self.step_id = -1
        self.step_sum = 0
        # this step's passes (until a backward) whose graph may still live, oldest first:
        # [pass number, bytes its calls kept]; ``step_sum`` is their total
        self.step_passes: list[list[int]] = []
        self.step_max = 0
        self.peak = 0
        self.over_max = 0
        self.out_max = 0  # a container's largest training output (checkpointing keeps it)
        self.leaf = leaf


class DeviceRecord:
    """Everything recorded for one device; hot-path fields are plain attributes."""

    def __init__(
        self,
        key: str,
        backend: Any,
        timeline_limit: int,
        step_limit: int,
        peaks: UserPeaks | None = None,
    ) -> None:
        self.key = key
        self.backend = backend
        # ``peaks``: the user's peak counters, kept while ``reset`` resets them; ``take``:
        # read, and reset the peaks that are above their current values
        self.read, self.reset = counter_reader(backend, peaks)
        self.take = peak_taker(self.read, self.reset)
        a, r, _, _ = self.read()
        self.reset()
        self.baseline = a
        self.info: tuple[Any, str] | None = None  # (capacity, name), kept as the block ends
        ooms = getattr(backend, "ooms", None)  # allocations refused so far, where counted
        self.ooms_at_start: int | None = ooms() if ooms is not None else None
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
        self.train_peak_at_forward = a  # ... when the last training forward began
        # (step, input shape): the training peak is of an attempt that ran out of memory
        # (a caught OOM: the breakdown and advice describe it) until a later one is higher
        self.failed_peak: tuple[int, tuple[int, ...] | None] | None = None
        self.eval_base = a  # allocated when the last evaluation (its first pass) began
        self.eval_carried = 0  # the most an evaluation's pass began with above its base
        self.eval_left = 0  # the most an evaluation left when it ended above its base
        self.eval_in_step = 0  # the highest eval peak of passes inside a training step
        self.eval_in_forward = 0  # of them, passes between its forward and its backward
        self.peak_res = r
        self.pending: PeakMoment | None = None  # a training peak not yet categorised
        self.breakdown: Breakdown | None = None
        self.modules: dict[str, ModuleStat] = {}
        self.steps: deque[StepRow] = deque(maxlen=step_limit)  # step_record() makes each
        self.step_start = a
        self.forward_base: int | None = a
        self.gathered = 0  # FSDP2's all-gathered bytes at the last segment boundary
        self.base_gathered = 0  # ... when the step's forward began
        self.base_grads_none = True
        self.base_state_empty = True
        self.base_flags: tuple[bool, ...] = ()  # the gradient witnesses' flags then
        # the last step's own storages alive then (data pointer -> (weak reference, bytes))
        self.base_outputs: dict[int, tuple[weakref.ref[Any], int]] = {}
        # gradient bytes here last measured with each set of witness flags (and by model,
        # where several models run): the breakdown's gradients at a forward's peak
        self.grad_sizes: dict[tuple[bool, ...], int] = {}
        self.grad_models: dict[tuple[bool, ...], tuple[tuple[str, int], ...]] = {}
        self.grad_epoch = 0  # the witnesses (Evidence.witness_epoch) those sizes are of
        self.grads_remembered = False  # remember() ran while gradients were allocated
        self.forward_peak = False  # the breakdown is of the forward running (until it ends)
        self.bw_module: str | None = None
        self.last = (a, r)
        self.kept_level: int | None = None  # allocated at the step boundary last remembered
        self.params_full = 0
        self.grads_full = 0
        self.state_full = 0
        self.backwards = 0  # training backward passes in the current step
        self.growth = leaks.GrowthDetector()
        # (simulated device) the batches held when the growth detector's climb began: its
        # step and (count, bytes), so that batches a dataset keeps, counted the first time an
        # epoch feeds them, explain only growth made while they were counted
        self.held_at_climb: tuple[int | None, tuple[int, int]] = (None, (0, 0))
        # the growth detector sees a step's level once the next step's forwards began: the
        # lowest of the level at the step's end and those the next step's training forwards
        # began at (less their new batch), what the step left behind once its own tensors
        # were freed
        self.growth_pending: tuple[int, int, int | None] | None = None  # (step, level,
        # persistent bytes measured with it, or None) at the last step boundary, not yet
        # given to the detector
        self.step_floor: int | None = None  # the lowest level a training forward began at
        # since that boundary, less its batch
        self.floor_persistent: int | None = None  # the persistent bytes there, measured only
        # where the detector would compare them (a rise): a walk of the parameters and state
        self.leak: LeakFinding | None = None  # the growth detector's
        self.graph_leak: LeakFinding | None = None  # the graph scans' (host memory)
        self.eval_saved: int | None = None  # the step's eval peak before begin_eval()
        self.eval_window: int | None = None  # the last begin_eval()..end_eval() peak
        self.setup: TrainingSetup | None = None  # the model's facts (evidence.py reads them)
        self.setup_key: tuple[int, int, int, int | None, bool | None] | None = None  # read last

    def base_released(self) -> int:
        """Bytes of the last step's own storages alive when the forward began that are freed
        now (a loop's ``logits``, rebound when the forward returned)."""
        return sum(n for ref, n in self.base_outputs.values() if ref() is None)


def display_names(records: Iterable[DeviceRecord]) -> Namer:
    """Module keys (``Model.path``) as reports show them: the path alone while one model
    (however often re-created or reloaded) is tracked, else with its model's class."""
    roots = {k.split(".", 1)[0] for dev in records for k in dev.modules}

    def display(key: str | None) -> str | None:
        if key is None or len(roots) > 1:
            return key
        root, _, path = key.partition(".")
        return path or root

    return display


def module_records(dev: DeviceRecord, display: Namer) -> list[ModuleRecord]:
    """The report's per-module records of ``dev``, largest own activations first."""
    out = []
    for first_call, (name, ms) in enumerate(dev.modules.items()):  # kept in first-call order
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
                first_call=first_call,
                output_bytes=None if ms.leaf or not ms.out_max else ms.out_max,
                frozen_float32_bytes=ms.frozen32 if ms.grad_input else 0,
                trainable_float32_bytes=ms.trainable32,
            )
        )
    out.sort(key=lambda m: m.self_activation_bytes, reverse=True)
    return out


def step_record(row: StepRow) -> StepRecord:
    """The report's record of a step kept as a :class:`StepRow`."""
    return StepRecord(
        step=row.step,
        start_allocated=row.start,
        end_allocated=row.end,
        peak_allocated=row.peak,
        peak_reserved=row.peak_reserved,
        phase_peaks=dict(zip(PHASES, row.phases, strict=True)),
        duration_s=row.duration_s,
        backward_passes=row.backward_passes,
    )


def close_step(dev: DeviceRecord, step: int, duration_s: float, backward_passes: int) -> None:
    """Record step ``step`` of ``dev`` (its peaks since the last boundary) and start the next
    one at the allocated bytes read last."""
    a, r = dev.last
    sp = dev.step_phase
    dev.steps.append(
        StepRow(step, dev.step_start, a, dev.step_peak, dev.step_peak_res, tuple(sp), duration_s,
                backward_passes)
    )  # fmt: skip
    dev.phase_peak = [
        v if c is None or (v is not None and v > c) else c
        for c, v in zip(dev.phase_peak, sp, strict=True)
    ]
    dev.step_phase = [None] * len(PHASES)
    dev.step_peak, dev.step_peak_res = a, r
    dev.step_start = a
    dev.forward_base = a
    dev.base_gathered = dev.gathered


def fold_steps(dev: DeviceRecord, first: int, counted_from: int) -> tuple[int, float]:
    """Fold the records of steps ``first`` and later into the step in progress, which becomes
    step ``first`` (the micro-batches of one step, counted from backward passes before an
    optimizer stepped). Returns the backward passes of the steps folded from ``counted_from``
    on (the earlier ones were an attempt that raised and was retried) and their duration."""
    parts: list[StepRow] = []
    while dev.steps and dev.steps[-1].step >= first:
        parts.insert(0, dev.steps.pop())
    if parts:
        dev.step_start = parts[0].start
        dev.step_peak = max(dev.step_peak, *(s.peak for s in parts))
        dev.step_peak_res = max(dev.step_peak_res, *(s.peak_reserved for s in parts))
        sp = dev.step_phase
        for i in range(len(PHASES)):
            values = [v for v in (sp[i], *(s.phases[i] for s in parts)) if v is not None]
            sp[i] = max(values) if values else None
    timeline = dev.timeline
    i = len(timeline) - 1
    while i >= 0 and timeline[i][1] >= first:  # readings of the folded micro-batches
        t, _, *rest = timeline[i]
        timeline[i] = (t, first, *rest)  # type: ignore[assignment]
        i -= 1
    for ms in dev.modules.values():
        ms.step_id = -1
    passes = sum(s.backward_passes for s in parts if s.step >= counted_from)
    return passes, sum(s.duration_s for s in parts)


def current_leak(dev: DeviceRecord) -> LeakFinding | None:
    """``dev``'s leak finding: growth of device memory, unless it has since stopped
    (:attr:`~memkit.tracking.leaks.GrowthDetector.stopped`): a plateau is not a leak; else
    a graph the graph scans saw growing in host memory, which stays (growth found after it
    keeps it)."""
    leak = dev.leak
    if leak is not None and (not dev.growth.stopped or _holds_graphs(leak)):
        return leak
    return dev.graph_leak


def _holds_graphs(leak: LeakFinding) -> bool:
    """Whether the growth stopped while a list kept the autograd graphs it grew with (a loss
    kept with its graph in some epochs only): those graphs stay alive, a leak of its own."""
    top = leak.suspects[0] if leak.suspects else None
    return top is not None and top.growing and top.graph and top.kind == "container"


def device_info(backend: Any) -> tuple[Any, str]:
    """``backend``'s capacity and name, as the report shows them: read before the block's end
    lifts its cap and while the device is there (a report asked for later reads these)."""
    return backend.capacity(), backend.name()


def device_report(dev: DeviceRecord, display: Namer) -> DeviceReport:
    """``dev``'s records as the report shows them (module keys through ``display``)."""
    phase_peaks: dict[str, int | None] = {}
    for i, name in enumerate(PHASES):
        vals = [v for v in (dev.phase_peak[i], dev.step_phase[i]) if v is not None]
        phase_peaks[name] = max(vals) if vals else None
    timeline = tuple(
        TimelinePoint(t, s, PHASES[ph], display(m), a, r) for t, s, ph, m, a, r in dev.timeline
    )
    cap, name = dev.info or device_info(dev.backend)
    modules = tuple(module_records(dev, display))
    return DeviceReport(
        device=dev.key,
        name=name,
        accounting=dev.backend.accounting,
        capacity=cap.total,
        baseline_allocated=dev.baseline,
        final_allocated=dev.last[0],
        peak_allocated=dev.peak,
        peak_reserved=dev.peak_res,
        phase_peaks=phase_peaks,
        steps=tuple(map(step_record, dev.steps)),
        modules=modules,
        breakdown=None
        if dev.breakdown is None
        else dataclasses.replace(
            dev.breakdown,
            module=display(dev.breakdown.module),
            note=_with_outside_note(dev.breakdown, modules),
        ),
        timeline=timeline,
        timeline_dropped=max(0, dev.events - len(dev.timeline)),
        leak=current_leak(dev),
        setup=dev.setup,
        breakdown_ran_out=dev.breakdown is not None and dev.failed_peak is not None,
        eval_carried=dev.eval_carried,
        eval_left=dev.eval_left,
        eval_in_step=dev.eval_in_step,
        eval_in_forward=dev.eval_in_forward,
    )


def _with_outside_note(bd: Breakdown, modules: Sequence[ModuleRecord]) -> str | None:
    """The breakdown's note, with where a training peak's activations were mostly made
    outside the model's modules (:func:`~memkit.tracking.report.made_outside`; sweep BT: a
    contrastive loss's batch x batch tensors were 88 of 89 MiB at the peak, and no line of
    the report named them)."""
    found = made_outside(bd.activations, bd.phase or "", bd.module, modules)
    if found is None:
        return bd.note
    kept, outside = found
    recomputed = [m.path for m in modules if m.recompute_calls]
    outer = [p for p in recomputed if not any(p.startswith(q + ".") for q in recomputed)]
    if outer and bd.phase == "backward":  # (sweeps CF, CG: taken for the loss's)
        names = ", ".join(outer[:3]) + (", ..." if len(outer) > 3 else "")
        said = (
            f"the model's modules kept {format_size(kept)} of the activations until backward; "
            f"the other {format_size(outside)} were made inside backward, by the recomputed "
            f"forwards of the checkpointed {names} (what checkpointing costs at the peak) and "
            "the gradients flowing back, which no module row's kept bytes show"
        )
    else:
        said = (
            f"the model's modules kept {format_size(kept)} of the activations until backward; "
            f"the other {format_size(outside)} were made outside its modules, by the loss or "
            "the step's own code (a batch x batch matrix of a contrastive loss, the logits of "
            "a large vocabulary), which no module row shows"
        )
    return f"{bd.note}; {said}" if bd.note else said
