"""Results of :func:`memkit.track`: frozen records that render as text, HTML and JSON.

A :class:`TrackReport` holds one :class:`DeviceReport` per device the tracked code used, the
advice, and, when an out-of-memory error ended the block, an :class:`OomPostMortem`. Everything
here is a pure function of the recorded numbers: no torch at import, nothing measured. The text
and HTML layout is :mod:`memkit.render.track`; the shared methods (``to_dict``, ``to_json``,
``to_html``...) come from :class:`memkit.results.Result`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from memkit.advice import Advice
from memkit.render import track as layout
from memkit.results import Result, json_fields
from memkit.units import format_size

if TYPE_CHECKING:
    from memkit.tracking.rank_gather import RanksReport

__all__ = [
    "PHASES",
    "Breakdown",
    "DeviceReport",
    "LeakFinding",
    "LeakSuspect",
    "ModuleRecord",
    "OomPostMortem",
    "StepRecord",
    "TimelinePoint",
    "TrackReport",
    "TrainingSetup",
]

PHASES = ("forward", "backward", "optimizer", "other", "eval")
"""Phases, in the order memkit reports them: a training step's forward (until its backward),
backward (with any checkpointed forward it recomputes), optimizer step, the time between them
(data loading, logging), and evaluation passes (forwards under ``no_grad``/``inference_mode`` or
in eval mode), which are reported on their own and never added to training's numbers."""


@dataclass(frozen=True)
class TimelinePoint:
    """One reading of a device's counters, taken by a hook.

    Attributes:
        t: seconds since the tracked block started.
        step: optimizer steps completed before this reading.
        phase: one of :data:`PHASES`.
        module: the module whose hook took it (``None`` at phase or step boundaries).
        allocated: bytes held by tensors.
        reserved: bytes held by the allocator (equal to ``allocated`` on the simulated device).
    """

    t: float
    step: int
    phase: str
    module: str | None
    allocated: int
    reserved: int


@dataclass(frozen=True)
class StepRecord:
    """One training step on one device (from one step boundary to the next).

    Attributes:
        step: the step's number (0 is the first).
        start_allocated: allocated bytes at the boundary that started it.
        end_allocated: allocated bytes at the boundary that ended it. A leak shows as
            ``end_allocated`` growing step after step.
        peak_allocated: the highest allocated bytes during the step.
        peak_reserved: the highest reserved bytes during the step.
        phase_peaks: peak allocated bytes per phase (``None``: the phase did not occur).
        duration_s: wall time of the step.
        backward_passes: the most training backward passes one optimizer step of the step
            used (more than one: gradient accumulation over micro-batches; two optimizers
            each stepping after its own backward, as a GAN's, count one); without an
            optimizer, the step's backward passes.
    """

    step: int
    start_allocated: int
    end_allocated: int
    peak_allocated: int
    peak_reserved: int
    phase_peaks: dict[str, int | None]
    duration_s: float
    backward_passes: int = 1


@dataclass(frozen=True)
class ModuleRecord:
    """Memory of one module on one device, over every call.

    Only training forwards count in the byte numbers: evaluation passes and the forwards that
    gradient checkpointing recomputes inside backward are counted in ``eval_calls`` and
    ``recompute_calls`` alone.

    Attributes:
        path: the module's name in its model (``transformer.h.0.attn``); the model itself is
            named by its class. With several models (a GAN), paths start with the model's class.
        device: the device its calls ran on.
        calls: how many training forward calls were seen.
        activation_bytes: the largest growth of allocated memory across one forward call
            (allocated after its forward minus before): what the call left behind, mostly what
            backward will need. Includes its children's.
        self_activation_bytes: the same, minus what its child modules left behind.
        activation_bytes_per_step: the largest sum over the calls before one backward (a
            module called several times in one pass keeps several sets; micro-batches and the
            passes of an optimizer's closure, as LBFGS runs, are not added: each backward frees
            its own); without a backward, the sum over the calls of a step. A pass adds only
            while its graph lives: one whose outputs were dropped with no backward (a DQN's
            acting forward) keeps nothing from then on.
        peak_allocated: the highest allocated bytes reached while its forward ran.
        peak_over_entry: that peak minus allocated at entry: the transient the call needed.
        leaf: the module has no child modules.
        eval_calls: forward calls in evaluation passes.
        recompute_calls: forwards recomputed inside backward (gradient checkpointing).
        type_name: the module's class name (``Linear``), shown beside the path as
            ``0 (Linear)``; ``None`` when not recorded (then the path alone is shown).
        first_call: its place in the order the device's modules were first called (0 for the
            first; a parent comes before its children, a block's modules in the order its
            forward runs them); ``None`` when not recorded.
        output_bytes: for a module with children, the bytes of the largest tensor a training
            call returned (its first tensor: a block's hidden states), what checkpointing the
            module keeps in its place; ``None`` for a leaf or when not recorded.
        frozen_float32_bytes: its own float32 parameters that require no grad (a frozen base
            layer under LoRA), where a training call's input required grad (with grad on):
            autocast casts them anew at each call and keeps the half copy for backward (the
            gradient of the input needs the weight); 0 otherwise (a frozen encoder run under
            ``no_grad``, or on the raw batch).
        trainable_float32_bytes: its own float32 parameters that require grad (autocast
            caches one half copy of each, in a half layer).
    """

    path: str
    device: str
    calls: int
    activation_bytes: int
    self_activation_bytes: int
    activation_bytes_per_step: int | None
    peak_allocated: int
    peak_over_entry: int
    leaf: bool
    eval_calls: int = 0
    recompute_calls: int = 0
    type_name: str | None = None
    first_call: int | None = None
    output_bytes: int | None = None
    frozen_float32_bytes: int = 0
    trainable_float32_bytes: int = 0


@dataclass(frozen=True)
class Breakdown:
    """What allocated memory consisted of at one moment (a peak, or an OOM).

    Parameters, gradients and optimizer state are byte sums of the tracked model's and
    optimizer's tensors on the device (each storage once). Activations are what the step's
    forward and backward added on top (growth since the step's forward began, minus gradients
    and optimizer state created since then); other is what was there before the forward and is
    none of the above (the batch, user tensors, leaked graphs). Under FSDP2, parameters,
    gradients and optimizer state are the rank's shards, and ``gathered_parameters`` are the
    unsharded parameters and all-gather buffers alive at that moment. Under DDP,
    ``gradient_buckets`` are its Reducer's flat gradient buckets (a copy of the gradients;
    with ``gradient_as_bucket_view`` the gradients' own storage too: counted once, as the
    buckets, the gradients then 0). At a peak in a forward
    where several models run, ``gradient_models`` are the gradients by the model that holds
    them (its row's name and bytes: a GAN's generator's, kept from its step through the
    critic's forward); ``()`` elsewhere. At a forward's peak, ``gradients_after_forward`` are
    those of its gradients still allocated when that forward phase ended (the phase after it
    holds them: a GAN's generator's, through the critic's backward and step); ``None``
    elsewhere. At a peak in backward or an optimizer's step where several optimizers run,
    ``idle_gradients`` are the gradients allocated then on the optimizers' frozen parameters
    (a GAN's generator's, kept from its step through the discriminator's update, for which
    Lightning's ``toggle_optimizer`` freezes it); 0 elsewhere. ``input_shape``: the last
    model forward's first tensor input then (batches of varying shapes: which one set the
    peak). See docs/track.md for the approximations.
    """

    total: int
    parameters: int
    gradients: int
    optimizer_state: int
    activations: int
    other: int
    step: int | None
    phase: str | None
    module: str | None
    note: str | None = None
    gathered_parameters: int = 0
    gradient_models: tuple[tuple[str, int], ...] = ()
    idle_gradients: int = 0
    gradients_after_forward: int | None = None
    gradient_buckets: int = 0
    input_shape: tuple[int, ...] | None = None

    def parts(self) -> list[tuple[str, int]]:
        """``(category, bytes)`` in display order (all-gathered parameters: FSDP2's only;
        gradient buckets: DDP's only)."""
        gathered = [("all-gathered parameters", self.gathered_parameters)]
        buckets = [("DDP gradient buckets", self.gradient_buckets)]
        return [
            ("parameters", self.parameters),
            ("gradients", self.gradients),
            ("optimizer state", self.optimizer_state),
            *(gathered if self.gathered_parameters else []),
            *(buckets if self.gradient_buckets else []),
            ("activations", self.activations),
            ("other", self.other),
        ]

    def text(self) -> str:
        """One line per category with its share of the total."""
        return layout.breakdown_text(self)


def made_outside(
    activations: int, phase: str, module: str | None, modules: Sequence[ModuleRecord]
) -> tuple[int, int] | None:
    """``(kept, outside)`` where most of ``activations`` at a moment of ``phase`` (inside
    ``module``) were made outside the models' modules: the loss or the step's own code (a
    contrastive loss's batch x batch matrix, sweep BT). ``kept``: what the models' own rows
    (a root's path is its class name, ``Net#2`` for a second one) kept until a backward.
    ``None`` inside a model's forward, which had kept only part (sweep BX), without those rows,
    or where the models kept at least a third of it."""
    if not (phase == "backward" or (phase == "forward" and module is None)):
        return None
    roots = [
        m
        for m in modules
        if m.calls > 0
        and m.type_name is not None
        and (m.path == m.type_name or m.path.startswith(m.type_name + "#"))
    ]
    kept = sum(m.activation_bytes_per_step or m.activation_bytes for m in roots)
    outside = activations - kept
    if not kept or outside < max(activations // 2, 2 * kept):
        return None
    return kept, outside


@dataclass(frozen=True)
class TrainingSetup:
    """What the advice needs of the live model and optimizer, read while they exist (the
    breakdown reads them; the post-mortem and the report carry them).

    Attributes:
        param_dtype: the dtype holding most of the trainable floating parameters' bytes.
        optimizer: the (first) optimizer's class name.
        history_size: LBFGS's ``history_size`` (its kept pairs of flat parameter copies).
        forward_autocast: the dtype of a ``torch.autocast`` that wraps the model's ``forward``
            itself (accelerate's mixed precision, ``@torch.autocast`` on ``forward``): it is
            entered after the forward pre-hooks, so ``autocast_forwards`` does not count it.
        optimizer_foreach: whether the (first) optimizer steps with the ``foreach``
            implementation: its ``foreach`` setting, else torch's default (on when the
            parameters are on CUDA and it is not ``fused``); ``False`` for an optimizer
            without the option (SparseAdam, non-torch optimizers).
        accumulation_steps: micro-batches per optimizer step as the trainer is set
            (transformers' ``gradient_accumulation_steps``, Lightning's
            ``accumulate_grad_batches``), told by a framework callback; ``None``: not told.
        checkpointing: whether activations are checkpointed: the trainer's setting
            (transformers' ``gradient_checkpointing``, told by a framework callback), the
            model's own flag (transformers' ``is_activation_checkpointing``), or a training
            forward seen inside a non-reentrant checkpoint region; ``None``: none says.
        sparse_gradients: the model makes sparse gradients (an ``nn.Embedding`` or
            ``nn.EmbeddingBag`` with ``sparse=True``) or an optimizer is SparseAdam: the
            advice offers only optimizers that take them.
        optimized_bytes: bytes of the parameters the optimizers step, on the device (each
            storage once; those that require grad): the optimizer state's buffers per
            parameter are its bytes over these.
        narrow_weight_bytes: bytes of the model's parameters and buffers, trainable or frozen,
            held in 16 bits or fewer (a bf16 or int8 frozen base): autocast neither halves
            their layers' work nor copies them.
        trainable_bytes: bytes of the model's floating (or complex) parameters that require
            grad: the gradients backward will make, known before an optimizer has stepped (a
            LoRA's adapters, not its frozen base).
        state_buffers: buffers of the parameters' size the (first) optimizer's state holds
            per parameter once it has stepped, from its class and settings (AdamW 2, SGD 1
            with momentum and 0 without); ``None``: an optimizer not known.
        float64_bytes: of ``trainable_bytes``, those in double precision (float64, and
            complex128: a Fourier layer's under a float64 default; a float64 head on a float32
            body: what single precision would halve).
        stepped_in_backward_bytes: where parameters have post-accumulate-grad hooks that step
            an optimizer (the optimizer step fused into backward, each parameter stepped and
            its gradient freed as backward makes it), ``(largest, all)``: the largest such
            parameter's bytes (the most of their gradients alive at once) and all of theirs;
            where they are all the trained ones, gradients cannot accumulate.
        wrapper: the framework that wrapped the model (``"accelerate"``: prepared by an
            ``Accelerator``; ``"fabric"``: Lightning Fabric's ``setup``), whose own switches
            the advice names; ``None``: none seen.
        sharding: FSDP2 over the model: ``(ranks, half)``, the ranks its parameters,
            gradients and optimizer state are sharded over (the figures are this rank's
            shards) and the 16-bit dtype its ``MixedPrecisionPolicy`` computes in (``None``:
            the parameters' own); ``None``: no ``fully_shard``.
        dense_embeddings: ``(path, weight bytes, row bytes)`` of each trainable
            ``nn.Embedding`` with dense gradients (``sparse=False``) whose weight no other
            module shares (not tied to an output layer): backward gives it a gradient of the
            whole table, where ``sparse=True`` gives one row per index looked up.
        optimizer_states: where several optimizers step, ``(class name, state bytes,
            stepped bytes)`` of each (DLRM's SparseAdam over the tables and Adam over the
            MLPs): the advice prices the one with the most state, not the first's name on
            all of it; ``None``: one optimizer.
    """

    param_dtype: str | None = None
    optimizer: str | None = None
    history_size: int | None = None
    forward_autocast: str | None = None
    optimizer_foreach: bool | None = None
    accumulation_steps: int | None = None
    checkpointing: bool | None = None
    sparse_gradients: bool | None = None
    optimized_bytes: int | None = None
    narrow_weight_bytes: int | None = None
    trainable_bytes: int | None = None
    state_buffers: int | None = None
    float64_bytes: int | None = None
    stepped_in_backward_bytes: tuple[int, int] | None = None
    wrapper: str | None = None
    dense_embeddings: tuple[tuple[str, int, int], ...] = ()
    sharding: tuple[int, str | None] | None = None
    optimizer_states: tuple[tuple[str, int, int], ...] | None = None


@dataclass(frozen=True)
class LeakSuspect:
    """A live variable of the training thread that holds an autograd graph, or a container
    of device tensors that grows.

    Attributes:
        name: the variable (``running_loss``, ``self.history``, ``losses[...]``).
        function: the function whose frame holds it (``<module>`` for a script's top level).
        filename: that function's file.
        line: the line that assigns or grows it, if found in the source, else the frame's
            current line.
        code: that line's text.
        kind: ``"tensor"`` or ``"container"`` (a list, tuple, deque or dict of such
            tensors).
        graph_nodes: autograd nodes reachable from it (counted up to a bound); for a
            container, from the tensors it shows first and last, plus its length.
        growing: it grew between two inspections (confirmed), else a candidate.
        carried: its graph grew while it kept its length, through tensors of more than one
            element: a state each step builds on (an RNN's ``hidden``, never detached), not
            losses kept (a sum, or a list that grows).
        graph: it holds an autograd graph (else a container of tensors without one).
        length: a container's length.
        maxlen: a deque's ``maxlen`` (it stops growing there).
        item_shape: the shape of its last item's tensor (a tensor's own).
        item_bytes: what one more item of a container holds on the device (the storages it
            adds to those of the items before it), estimated from its last items.
        tensor_bytes: what a container holds on the device (its first item's bytes, and
            ``item_bytes`` for each other one).
        bytes_per_step: how much ``tensor_bytes`` grew per step between two inspections.
    """

    name: str
    function: str
    filename: str
    line: int
    code: str
    kind: str
    graph_nodes: int
    growing: bool
    carried: bool = False
    graph: bool = True
    length: int = 0
    maxlen: int | None = None
    item_shape: tuple[int, ...] | None = None
    item_bytes: int = 0
    tensor_bytes: int = 0
    bytes_per_step: int = 0

    @property
    def where(self) -> str:
        """``train.py:train():42``."""
        return f"{Path(self.filename).name}:{self.function}():{self.line}"


@dataclass(frozen=True)
class LeakFinding:
    """Memory that grows from one step boundary to the next.

    Attributes:
        device: the device.
        growth_per_step: average growth of allocated bytes per step over the window.
        first_step: the step where the growth was first seen.
        steps: the steps over which it grew (without ever coming back down).
        suspects: variables holding autograd graphs (the classic cause), most likely first.
        graph_growth: autograd nodes added per step to a graph a variable holds; set when
            the graph scans saw it grow, device memory flat (backward freed its tensors, its
            nodes pile up in host memory), and kept on growth of device memory found later.
        period: steps between two rises (1: every step; 20: an evaluation every 20 steps that
            keeps its graph).
        held_batches, held_batch_bytes: on the simulated device, the batches counted when
            they reached the model that were still alive when the growth was called, and their
            bytes (a list of pre-built batches grows there batch by batch).
        grown_bytes: what it grew by over ``steps``, as measured (the last level read, less
            the climb's start): what fixing it frees by then.
    """

    device: str
    growth_per_step: int
    first_step: int
    steps: int
    suspects: tuple[LeakSuspect, ...] = ()
    graph_growth: int = 0
    period: int = 1
    held_batches: int = 0
    held_batch_bytes: int = 0
    grown_bytes: int = 0

    def headline(self) -> str:
        """One line: what grows, by how much."""
        return layout.leak_headline(self)


@dataclass(frozen=True)
class OomPostMortem(Result):
    """Where and why an out-of-memory error ended the tracked block.

    Attributes:
        device: the device that ran out.
        step: the step it happened in.
        phase: ``forward``, ``backward``, ``optimizer`` or ``other``.
        module: the innermost module running (forward) or whose backward was running, or
            ``None`` outside any module (the loss, the optimizer).
        training: the root module's ``training`` flag at the last forward, if known.
        grad_enabled: whether autograd was recording at the last forward, if known.
        exception: the exception's type and first line.
        source: which OOM rule matched (``torch.OutOfMemoryError``, ``cuBLAS``...).
        tried_to_allocate: the failed request, from the message.
        capacity: the device's size (message, else the backend).
        free: free bytes (message, else the backend).
        allocated: bytes held by tensors when it failed.
        breakdown: those bytes by category.
        top_modules: ``(path, bytes)``: the modules that kept the most activation memory.
        leak: growth seen before the failure, if any.
        advice: what to do.
        rank: the distributed rank, if any.
        input_shape: the shape of the last model forward's first tensor input, if any.
        module_type: ``module``'s class name, if known.
        micro_batches: the most training backward passes one optimizer step had used before
            it failed (over 1: gradient accumulation already runs).
        setup: the model's and optimizer's facts the advice reads, if seen.
        checkpointed: the outermost modules whose forward ran again in backward (activation
            checkpointing already runs there); ``top_modules`` leaves out what is inside them.
        frozen_model: ``(name, parameter bytes, updated, bf16 saving)`` when the failing pass was an
            evaluation pass of a model no optimizer trains (a distillation teacher, a DPO
            reference model), which runs on the training batch in every step; ``updated``: its
            parameters are written in place between passes (an EMA or mean teacher).
        autocast_forwards: training forwards that had run under ``torch.autocast`` (the
            failing one included): the forward is mixed precision already.
        optimizer_state_partial: it failed in an optimizer step that began with no optimizer
            state: the state in the breakdown is the part that step had created.
        batch_bytes: the bytes of the training batch alive when it failed (the last training
            forward's first input; in an evaluation pass, its own; 0: none, or gone), part of
            ``other`` in the breakdown.
        after_backward: a backward had run since the last optimizer step (an OOM between
            them, outside the model: gradient clipping, SAM's perturbation, ``unscale_``).
        made_outside: ``(kept, outside)`` where most of the activations were made outside
            the model's modules (:func:`made_outside`: the loss, the step's own code), which
            checkpointing the model's blocks does not touch; ``None`` otherwise.
        node: in backward, the autograd node that ran out (``ReluBackward0``), where the
            device can tell (the simulated one): ``module`` is the last module with parameters
            whose gradient backward reached, whose own backward may have ended (sweep CO: a
            ReLU after conv2 was said to be fc1's backward).
        appended_losses: where no leak was found, the containers the script grows with losses
            that keep their autograd graphs (``"`losses` (4 of them, train() in
            train.py:61)"``): a leak that ran out before memkit's growth window.
        op_input_bytes: the bytes of the failing op's inputs (its parameters left out), where
            the device can tell (the simulated one): what that op holds beside its output
            under ``no_grad`` too.
    """

    SCHEMA: ClassVar[str] = "memkit.OomPostMortem/1"
    HTML_TITLE: ClassVar[str] = "memkit out-of-memory post-mortem"

    device: str
    step: int
    phase: str
    module: str | None
    training: bool | None
    grad_enabled: bool | None
    exception: str
    source: str | None
    tried_to_allocate: int | None
    capacity: int | None
    free: int | None
    allocated: int | None
    breakdown: Breakdown | None
    top_modules: tuple[tuple[str, int], ...]
    leak: LeakFinding | None
    advice: tuple[Advice, ...]
    rank: int | None = None
    input_shape: tuple[int, ...] | None = None
    module_type: str | None = None
    micro_batches: int = 1
    setup: TrainingSetup | None = None
    checkpointed: tuple[str, ...] = ()
    frozen_model: tuple[str, int, bool, int] | None = None
    autocast_forwards: int = 0
    optimizer_state_partial: bool = False
    batch_bytes: int = 0
    after_backward: bool = False
    made_outside: tuple[int, int] | None = None
    node: str | None = None
    appended_losses: tuple[str, ...] = ()
    op_input_bytes: int | None = None

    @property
    def where(self) -> str:
        """``step 3, backward of transformer.h.1.mlp (MLP)``."""
        module = self.module
        if module is not None and self.module_type and self.module_type != module:
            module = f"{module} ({self.module_type})"  # a bare index (`1`) says little alone
        if self.phase == "eval":
            inside = "" if module is None else f" in {module}"
            return f"step {self.step}, an evaluation pass{inside}"
        if self.node is not None and self.phase == "backward":
            place = f"backward, in {self.node}" + (
                "" if module is None else f", after the gradient reached {module}"
            )
        elif module is not None:
            place = f"{self.phase} of {module}"
        elif self.phase == "forward":
            place = "forward, outside any module (e.g. the loss)"
        else:
            place = f"{self.phase}, outside any module"
        return f"step {self.step}, {place}"

    def _json_fields(self, out: dict[str, Any]) -> dict[str, Any]:
        out["where"] = self.where
        return out

    def __str__(self) -> str:
        return layout.postmortem_text(self)

    def __repr__(self) -> str:
        return (
            f"OomPostMortem({self.where!r}, device={self.device!r}, "
            f"tried_to_allocate={format_size(self.tried_to_allocate)!r}, "
            f"allocated={format_size(self.allocated)!r}, capacity={format_size(self.capacity)!r})"
        )

    def html_body(self) -> str:
        """An HTML section (no page shell)."""
        return layout.postmortem_html(self)


@dataclass(frozen=True)
class DeviceReport:
    """Everything recorded for one device.

    Attributes:
        device: ``cuda:0``, ``cpu`` (simulated)...
        name: the backend's description (GPU name, or ``simulated cpu (300.00 MiB)``).
        accounting: what the numbers count.
        capacity: the device's size for this process, if known.
        baseline_allocated: allocated bytes when tracking started.
        final_allocated: allocated bytes when it ended.
        peak_allocated: the highest allocated bytes seen.
        peak_reserved: the highest reserved bytes seen.
        phase_peaks: peak allocated bytes per phase over the whole run.
        steps: one record per completed step.
        modules: per-module records, largest activations first.
        breakdown: what training's peak consisted of (an evaluation pass's peak when nothing
            trained); ``phase_peaks["eval"]`` is evaluation's peak.
        timeline: counter readings (the most recent ones, up to the tracker's limit).
        timeline_dropped: older readings that did not fit the limit.
        leak: growth from step to step, if detected.
        setup: the model's and optimizer's facts the advice reads, if seen.
        breakdown_ran_out: the breakdown is of a training attempt that then ran out of memory
            (up to its failed request; the script caught the error, or the block ended with it).
        eval_carried: the most bytes an evaluation pass began with above what its evaluation
            (its run of passes between training steps) began with: outputs, or graphs, that
            its earlier passes left alive (a ``test_loss += loss`` under grad, kept outputs).
        eval_left: the most an evaluation left allocated when it ended, above what it began
            with: results kept beyond it (with their graphs, under grad).
        eval_in_step: the highest eval-column peak of passes that ran inside a training step
            (a frozen model fed other inputs than the training batch, multi-crop views): the
            step's memory, not a test loop's.
        eval_in_forward: of those, the highest of passes that ran between the step's training
            forward and its backward, its graph alive (a teacher after the student's forward,
            FixMatch's pseudo-labels): training's work, where a validation between backward
            and the optimizer step is not.
    """

    PHASES: ClassVar[tuple[str, ...]] = PHASES
    """The phases, in report order (the layout's columns)."""

    device: str
    name: str
    accounting: str
    capacity: int | None
    baseline_allocated: int
    final_allocated: int
    peak_allocated: int
    peak_reserved: int
    phase_peaks: dict[str, int | None]
    steps: tuple[StepRecord, ...] = ()
    modules: tuple[ModuleRecord, ...] = ()
    breakdown: Breakdown | None = None
    timeline: tuple[TimelinePoint, ...] = field(default=(), repr=False)
    timeline_dropped: int = 0
    leak: LeakFinding | None = None
    setup: TrainingSetup | None = None
    breakdown_ran_out: bool = False
    eval_carried: int = 0
    eval_left: int = 0
    eval_in_step: int = 0
    eval_in_forward: int = 0

    def top_modules(self, n: int = 10) -> list[ModuleRecord]:
        """The ``n`` modules that kept the most activation memory (own, excluding children),
        of those that ran in training (a frozen teacher's rows, evaluation only, hold no
        training numbers)."""
        return sorted(
            (m for m in self.modules if m.calls or m.recompute_calls),
            key=lambda m: (m.self_activation_bytes, m.activation_bytes_per_step or 0),
            reverse=True,
        )[:n]

    def summary_row(self) -> list[object]:
        """A row for the device summary table."""
        return layout.device_summary_row(self)


@dataclass(frozen=True)
class TrackReport(Result):
    """What :func:`memkit.track` (or ``memkit run``) recorded.

    Attributes:
        devices: one report per device, in device order.
        steps: completed steps (optimizer steps, or ``Tracker.step()`` calls).
        mode: ``"per-module"`` or ``"steps-only"``.
        duration_s: wall time of the tracked block.
        advice: recommendations from what was measured.
        oom: the post-mortem, when an out-of-memory error ended the block.
        eval_grad_forwards: forward passes run in eval mode with autograd recording.
        eval_forwards: evaluation passes (model forwards under ``no_grad``/``inference_mode``,
            in eval mode, or unable to build a graph); their peak is ``phase_peaks["eval"]``.
        eval_input_shape: the largest first tensor input of an evaluation pass (its shape),
            but a frozen model's.
        step_rule: what counted steps: ``"optimizer"`` (``optimizer.step()``), ``"backward"``
            (no optimizer stepped: a training forward after a backward starts a step) or
            ``"manual"`` (``Tracker.step()``).
        rank: the distributed rank (``RANK``), if any.
        world_size: the number of ranks, if any.
        notes: caveats about how the numbers were obtained.
        param_dtype: the dtype holding most of the model's trainable floating parameters.
        optimizer_name: the (first) optimizer's class name.
        autocast_forwards: forward passes run under ``torch.autocast``.
        unsafe_loss: an op in the loss that CUDA's autocast refuses to run
            (``"binary_cross_entropy"``: ``nn.BCELoss``), seen in the first backward passes.
        steps_with_grads_at_forward: steps (after the first) whose first forward began with
            gradients allocated (``zero-grad-keeps-grads``).
        grads_at_forward_bytes: the most gradient bytes allocated when such a forward began
            (measured at the first three, then up to 32 times more where a forward began
            more than 1% higher than at any measure: gradients that grow as layers are
            unfrozen).
        steps_with_grads_into_backward: of those steps, the ones whose first backward began
            with them still allocated (``zero_grad(set_to_none=False)``, where backward adds
            into them; not a ``zero_grad()`` between forward and backward).
        stale_gradients: ``(model, bytes)`` of gradients held by parameters that no
            optimizer stepped over a whole step, the most seen at once (looked for at steps
            0-2, every 25th and where an optimizer steps for the first time); ``stale_step``:
            the step that saw them; ``stale_looks``: ``(step, bytes)`` of each look
            (``stale-gradients``).
        retry_held: ``(step, bytes, holders)`` where the first training forward after a
            caught OOM began with the failed attempt's graph still held by variables of the
            script (``oom-retry-holds``): ``bytes`` its saved tensors hold.
        retained_held: ``(step, bytes, holders)`` where a backward ended while graphs that a
            ``backward(retain_graph=True)`` had run through still saved tensors, held by
            variables of the script (``retain-graph-held``).
        dp_device_ids: a DataParallel model's ``device_ids``.
        dp_output_device: its output device (``"cuda:0"``).
        dp_output_bytes: the largest output it gathered on the output device.
        frozen_model: ``(name, parameter bytes, updated, bf16 saving)`` of a model no optimizer
            trains that ran on the training batch (a distillation teacher, a DPO reference
            model; updated: written in place between its passes, an EMA teacher; bf16 saving:
            what holding it in bf16 frees of its parameters), if any.
        frozen_forwards: its forwards (evaluation passes, counted in ``eval_forwards`` too).
        frozen_input_shape: the largest first tensor input of those forwards.
        frozen_peaks: device -> the peak of those forwards (in ``phase_peaks["eval"]`` too).
        frozen_bases: device -> allocated when the forward of that peak began.
        frozen_autocast: a forward of that model ran under autocast (its activations are
            half already).
        ranks: on rank 0 of a process group, every rank's summary, the imbalance and the DDP
            advice (:class:`memkit.tracking.rank_gather.RanksReport`); ``None`` otherwise.
    """

    PHASES: ClassVar[tuple[str, ...]] = PHASES
    """The phases, in report order (the layout's columns)."""

    SCHEMA: ClassVar[str] = "memkit.TrackReport/1"
    HTML_TITLE: ClassVar[str] = "memkit track report"
    JSON_INDENT: ClassVar[int | None] = 1
    _JSON_SKIP: ClassVar[tuple[str, ...]] = ("devices",)

    devices: tuple[DeviceReport, ...]
    steps: int
    mode: str
    duration_s: float
    advice: tuple[Advice, ...] = ()
    oom: OomPostMortem | None = None
    eval_grad_forwards: int = 0
    eval_forwards: int = 0
    eval_input_shape: tuple[int, ...] | None = None
    step_rule: str = "optimizer"
    rank: int | None = None
    world_size: int | None = None
    notes: tuple[str, ...] = ()
    # what the training used: facts in the JSON that the advice rules (advice/track.py) read
    param_dtype: str | None = None
    optimizer_name: str | None = None
    autocast_forwards: int = 0
    unsafe_loss: str | None = None
    steps_with_grads_at_forward: int = 0
    grads_at_forward_bytes: int = 0
    steps_with_grads_into_backward: int = 0
    stale_gradients: tuple[tuple[str, int], ...] = ()
    stale_step: int | None = None
    stale_looks: tuple[tuple[int, int], ...] = ()
    retry_held: tuple[int, int, tuple[str, ...]] | None = None
    retained_held: tuple[int, int, tuple[str, ...]] | None = None
    dp_device_ids: tuple[int, ...] = ()
    dp_output_device: str | None = None
    dp_output_bytes: int = 0
    frozen_model: tuple[str, int, bool, int] | None = None
    frozen_forwards: int = 0
    frozen_input_shape: tuple[int, ...] | None = None
    frozen_peaks: dict[str, int] = field(default_factory=dict)
    frozen_bases: dict[str, int] = field(default_factory=dict)
    frozen_autocast: bool = False
    ranks: RanksReport | None = None

    # -- access ---------------------------------------------------------------------------
    def device(self, name: str) -> DeviceReport:
        """The report of one device (``"cuda:1"``, ``"cpu"``); KeyError if it was not used."""
        for dev in self.devices:
            if dev.device == name:
                return dev
        raise KeyError(
            f"no device {name!r} in this report; devices: {[d.device for d in self.devices]}"
        )

    @property
    def peak_allocated(self) -> int:
        """The highest allocated bytes over all devices."""
        return max((d.peak_allocated for d in self.devices), default=0)

    @property
    def micro_batches(self) -> int:
        """The most micro-batches in one step (``StepRecord.backward_passes``; over 1:
        gradient accumulation)."""
        return max((s.backward_passes for d in self.devices for s in d.steps), default=1)

    @property
    def leaks(self) -> list[LeakFinding]:
        """Devices whose memory grew step after step."""
        return [d.leak for d in self.devices if d.leak is not None]

    def in_terms(self, say: Callable[[Iterable[Advice]], tuple[Advice, ...]]) -> TrackReport:
        """This report with its advice, and its post-mortem's, said as ``say`` says them (a
        framework's terms: :mod:`memkit.advice.lightning`)."""
        oom = self.oom
        if oom is not None:
            oom = dataclasses.replace(oom, advice=say(oom.advice))
        return dataclasses.replace(self, advice=say(self.advice), oom=oom)

    # -- JSON (memkit/results.py) --------------------------------------------------------
    def to_dict(self, *, timeline: bool = True) -> dict[str, Any]:
        """JSON-ready dict (``timeline=False`` leaves the per-reading timeline out)."""
        out = super().to_dict()
        out["devices"] = [_device_json(dev, timeline) for dev in self.devices]
        return out

    def _json_fields(self, out: dict[str, Any]) -> dict[str, Any]:
        out["micro_batches"] = self.micro_batches
        if self.ranks is None:
            del out["ranks"]
        return out

    # -- text and HTML (memkit/render/track.py) ------------------------------------------
    def __str__(self) -> str:
        return layout.report_text(self)

    def __repr__(self) -> str:
        peak_reserved = max((d.peak_reserved for d in self.devices), default=0)
        return (
            f"TrackReport(steps={self.steps}, devices={len(self.devices)}, "
            f"peak_allocated={format_size(self.peak_allocated)!r}, "
            f"peak_reserved={format_size(peak_reserved)!r}, oom={self.oom is not None})"
        )

    def html_body(self) -> str:
        """The report's HTML without the page shell."""
        return layout.report_html_body(self)


TIMELINE_FIELDS = ["t", "step", "phase", "module", "allocated", "reserved"]
"""The columns of a device's ``timeline`` in the JSON (one row per reading)."""


def _device_json(dev: DeviceReport, timeline: bool) -> dict[str, Any]:
    """A device's record as JSON; its timeline as rows of :data:`TIMELINE_FIELDS`."""
    out = json_fields(dev, skip=("timeline",))
    if timeline:
        out["timeline"] = [
            [p.t, p.step, p.phase, p.module, p.allocated, p.reserved] for p in dev.timeline
        ]
        out["timeline_fields"] = list(TIMELINE_FIELDS)
    return out
