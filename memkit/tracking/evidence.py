"""What the tracker gathers beyond the device counters: read from the live model and
optimizer while they exist (a script's ``main()`` may have returned by the time the report is
made), for the breakdown, the report's advice and the OOM post-mortem.

:class:`Evidence` owns it: the run's facts (:class:`~memkit.tracking.records.RunFacts`), the
gradient witness (one parameter whose ``.grad`` says whether gradients exist), the leak search
(:class:`~memkit.tracking.leaks.LeakWatch`) and the module call an exception left. The
functions below read the live objects: persistent bytes on a device, the parameters' dtype, the
training setup.
"""

from __future__ import annotations

import math
import sys
import warnings
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import astuple, dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from memkit.advice.training import state_buffers
from memkit.devices import tensor_device
from memkit.optimizers import state_tensors, steps_in_backward
from memkit.simulated.accountant import storages_of
from memkit.tracking.breakdown import Persistent
from memkit.tracking.ddp import bucket_bytes, bucket_views, is_ddp
from memkit.tracking.fsdp import FsdpUnits, wrapped_module
from memkit.tracking.leaks import LeakWatch
from memkit.tracking.models import TrackedModels, forward_autocast
from memkit.tracking.records import RunFacts
from memkit.tracking.report import TrainingSetup

if TYPE_CHECKING:
    from memkit.tracking.postmortem import FailedCall
    from memkit.tracking.records import DeviceRecord
    from memkit.tracking.state import TrackState

__all__ = [
    "Evidence",
    "WeightCensus",
    "gradient_witnesses",
    "param_dtype",
    "persistent_bytes",
    "training_setup",
]


class Evidence:
    """The evidence a tracker gathers (see the module docstring).

    Args:
        models: the tracked models and optimizers.
        state: the tracker's shared state (FSDP2's units).
        leak_warmup: step boundaries the leak search ignores at the start.

    Attributes:
        facts: what the training used and did, for the report and the advice.
        leak_watch: the leak search at step boundaries.
        failed_call: where the last module call that raised was (the forward post hook
            records it): ``id`` of the exception, then the place (the post-mortem's).
    """

    def __init__(self, models: TrackedModels, state: TrackState, leak_warmup: int) -> None:
        self.models = models
        self.facts = RunFacts()
        self.leak_watch = LeakWatch(leak_warmup)
        self.failed_call: FailedCall | None = None
        self._state = state
        # parameters whose .grad says whether gradients are allocated (one per optimizer);
        # weak, so that the tracker never keeps a deleted model's tensor (or the memory
        # history would show it)
        self._witnesses: tuple[weakref.ref[torch.Tensor], ...] = ()
        self.witness_epoch = 0  # bumped when the witnesses change (their flags mean others)
        self.several = False  # gradients watched for more than one optimizer (marks needed)
        self.walked_dtype: str | None = None  # param_dtype() as the last persistent() found it
        self._flags_read: tuple[int, frozenset[int]] | None = None  # (step, models) last read
        self._model_checkpoints = False  # ... and whether one checkpoints activations
        # the witnesses' flags (grad_flags()) at the last mark in a training forward: its
        # start, a model's forward beginning or returning (zero_grad runs between those)
        self.marked: tuple[bool, ...] = ()
        self._stale_again = -1  # a step stale_due looks again at (after a new optimizer)
        # what stale_check found, to confirm: (step, [(model, [(parameter, its .grad)]), ...])
        self._stale: (
            tuple[int, list[tuple[str, list[tuple[weakref.ref[torch.Tensor], ...]]]]] | None
        ) = None

    def find_witness(self, optimizers: list[Any] | None = None) -> None:
        """Pick the gradient witnesses anew (an optimizer first seen: its parameter is a better
        witness than a module seen first, a teacher's), among ``optimizers``' parameters if
        given (those stepping now, where the steps' owner changed: a k-fold run's earlier
        optimizers, alive, hold the kept models' gradients)."""
        self._set_witnesses(self._new_witnesses(optimizers))

    def _new_witnesses(
        self, optimizers: list[Any] | None = None
    ) -> tuple[weakref.ref[torch.Tensor], ...]:
        chosen = self.models.all_optimizers() if optimizers is None else optimizers
        found = gradient_witnesses(self.models.root_modules(), chosen)
        return tuple(weakref.ref(p) for p in found)

    def witness_missing(self) -> bool:
        """No witness yet, or its model is gone."""
        return not self._witnesses or any(w() is None for w in self._witnesses)

    def release(self) -> None:
        """Keep no reference to the model's tensors or the user's exception (the block ended)."""
        self._set_witnesses(())
        self.failed_call = None

    def grads_none(self) -> bool:
        """Whether the models have no gradients allocated now (what was last seen, once they
        are gone)."""
        none = True
        for witness in self._witnesses:
            param = witness()
            if param is None:  # its model is gone: a new one (k-fold), or none (main() returned)
                found = self._new_witnesses()
                if not found or found[0]() is None:  # what was last seen
                    return self.facts.grads_were_none
                self._set_witnesses(found)
                return self.grads_none()
            if param.grad is not None:
                none = False
        if self._witnesses:
            self.facts.grads_were_none = none
        return none

    def _set_witnesses(self, found: tuple[weakref.ref[torch.Tensor], ...]) -> None:
        self._witnesses = found
        self.witness_epoch += 1
        self.several = len(found) > 1
        self.marked = ()

    def grad_flags(self) -> tuple[bool, ...]:
        """Per witness (one per optimizer), whether its gradient is allocated now: which
        optimizers' gradients exist (``()``: no witness, or its model is gone)."""
        flags = []
        for witness in self._witnesses:
            param = witness()
            if param is None:  # its model is gone: a new one (k-fold), or none
                found = self._new_witnesses()
                if not found or found[0]() is None:
                    return ()
                self._set_witnesses(found)
                return self.grad_flags()
            flags.append(param.grad is not None)
        return tuple(flags)

    def idle_gradient_bytes(self) -> int:
        """Bytes of the gradients allocated now, each storage once, on the optimizers'
        parameters that are frozen now, with several optimizers: a GAN's other model, frozen
        by Lightning's ``toggle_optimizer`` for this one's update, with the gradients of its
        own last step (review: a parameter another optimizer steps later in the same step is
        no such one, nor one whose gradients a backward through it just refilled)."""
        optimizers = self.models.all_optimizers()
        if len(optimizers) < 2:
            return 0
        frozen = [
            p
            for o in optimizers
            for g in o.param_groups
            for p in g["params"]
            if not p.requires_grad and p.grad is not None and p.grad.layout is torch.strided
        ]
        return sum(n for _, n in _gradient_bytes([("", frozen)]))

    def gradient_bytes(self) -> int:
        """Bytes of the gradients the models hold now, each storage once."""
        return sum(n for _, n in self.gradients_by_model())

    def gradients_by_model(self) -> tuple[tuple[str, int], ...]:
        """The gradients the models hold now, by model (its row's name: ``Generator``), each
        storage once (DDP's bucket views are the buckets': ``zero_grad`` frees nothing of
        them); models without gradients left out."""
        return _gradient_bytes(
            (name, [p for p in params if p.grad is not None]) for name, params in self._params()
        )

    def _params(self) -> Iterator[tuple[str, list[torch.Tensor]]]:
        """Each model's name (its row's: ``Generator``) and parameters, but DDP's bucket
        views (the buckets': ``zero_grad`` frees nothing of them)."""
        models = self.models
        for module in models.root_modules():
            root = models.roots.get(id(module))
            name = root.keys.get(id(module)) if root is not None else None
            views = bucket_views(module) if is_ddp(module) else ()
            params: list[torch.Tensor] = [p for p in module.parameters() if id(p) not in views]
            yield name or type(module).__name__, params

    def stale_due(self, step: int, new_optimizer: bool) -> bool:
        """Whether the end of step ``step`` looks for stale gradients: steps 0-2, every
        :data:`_STALE_EVERY`-th, one where an optimizer stepped for the first time, and
        :data:`_RECENT_STEPS` after that (the optimizer it replaced no longer counts as
        stepping: a k-fold run's earlier fold)."""
        if new_optimizer:
            self._stale_again = step + _RECENT_STEPS
        return new_optimizer or step < 3 or step % _STALE_EVERY == 0 or step == self._stale_again

    @property
    def stale_pending(self) -> bool:
        """Whether :meth:`stale_check` found parameters to confirm at the next boundary."""
        return self._stale is not None

    def stale_check(
        self, step: int, due: bool, holds: Callable[[torch.Tensor], bool] | None
    ) -> None:
        """At the end of step ``step`` (``due``: look for new ones): gradients that no
        optimizer steps (models kept after their training, as a k-fold run keeps each fold's
        for an ensemble; parameters left out of the optimizer that still require grad), on
        the device (``holds``): none that an optimizer stepped in the last
        :data:`_RECENT_STEPS` steps holds (a WGAN's generator, stepped every fifth), and
        confirmed at the next boundary (a GAN's discriminator, whose gradients the generator's
        backward made, steps after the generator's step ends step 0), where the same gradient
        tensors are still there: ones freed and made anew in the step (an fp32 master-weights
        loop's half model, whose gradients are copied to the master copies' and freed after
        each step; sweep BJ) live for a backward, not a step. What optimizers still alive but
        no longer stepping hold counts for nothing (a trainer that keeps each fold's). Each
        look's bytes are kept by step: the advice claims what was found at the last look
        before the peak."""
        stepped = self.models.stepped(since=step - _RECENT_STEPS + 1)
        ids = {id(p) for opt in stepped for group in opt.param_groups for p in group["params"]}
        pending, self._stale = self._stale, None
        facts = self.facts
        if pending is not None:
            seen_at, found = pending
            alive = (
                (name, [p for p, g in ((r(), g()) for r, g in refs) if p is not None and
                        g is not None and p.grad is g])
                for name, refs in found
            )  # fmt: skip
            stale = _gradient_bytes(
                (name, [p for p in params if id(p) not in ids]) for name, params in alive
            )
            total = sum(n for _, n in stale)
            facts.stale_looks = (*facts.stale_looks[-63:], (seen_at, total))
            if total > sum(n for _, n in facts.stale_gradients):
                facts.stale_gradients, facts.stale_step = stale, seen_at
        if not due or not stepped:  # (no optimizer stepped: manual updates)
            return
        found = [
            (name, [(weakref.ref(p), weakref.ref(p.grad)) for p in params
                    if p.grad is not None and id(p) not in ids and (holds is None or holds(p))])
            for name, params in self._params()
        ]  # fmt: skip
        found = [(name, refs) for name, refs in found if refs]
        if found:
            self._stale = (step, found)
        elif pending is None:  # none at this look (the last one before a peak may say so)
            facts.stale_looks = (*facts.stale_looks[-63:], (step, 0))

    def state_empty(self) -> bool:
        """Whether no optimizer holds state now (what was last seen, once they are gone)."""
        models = self.models
        opts = models.optimizers or models.all_optimizers()
        if not opts and models.seen_optimizers:  # gone: what was last seen
            return self.facts.state_was_empty
        empty = True
        for opt in opts:
            if opt.state:
                empty = False
                break
        self.facts.state_was_empty = empty
        return empty

    def capture(self, walked: bool = False) -> None:
        """Read what the advice needs from the live model and optimizer (``walked``: the
        parameters' dtype is the one :meth:`persistent` found just now)."""
        dtype = self.walked_dtype if walked else param_dtype(self.models.root_modules())
        if dtype is not None:
            self.facts.param_dtype = dtype
        opts = self.models.all_optimizers()
        if opts and self.facts.optimizer_name is None:
            self.facts.optimizer_name = type(opts[0]).__name__
        self.keep_layout()

    def keep_layout(self) -> None:
        """Keep a DataParallel model's devices (the tracker calls it as the block ends, before
        letting go of the model: a report made later still knows them)."""
        model = self.models.model
        if isinstance(model, torch.nn.DataParallel) and model.device_ids:
            ids = tuple(int(getattr(d, "index", d)) for d in model.device_ids)
            self.facts.dp_layout = (ids, int(getattr(model, "output_device", ids[0])))

    def persistent(self, dev: DeviceRecord, primary: bool) -> Persistent:
        """Bytes of parameters (and buffers), gradients and optimizer state on ``dev`` now
        (``primary``: the tracked device, where a DataParallel model's own parameters are);
        records the training setup on ``dev`` while the objects are alive."""
        models = self.models
        modules, optimizers = models.root_modules(), models.all_optimizers()
        census = WeightCensus()
        sizes = persistent_bytes(
            dev, modules, optimizers, models.model, primary, self._state.fsdp, census,
            models.ddp_wrappers(),
        )  # fmt: skip
        self.walked_dtype = _largest(census.trainable_dtypes)
        facts = self.facts
        if facts.accumulation_steps is None:  # no framework callback told it
            facts.accumulation_steps = accelerate_accumulation(modules)
        if facts.checkpointing is None:  # (before any recompute: an OOM in step 0)
            # once a step (transformers walks the model's modules to answer; a script may turn
            # checkpointing on after its first steps: review)
            read = (self._state.step, frozenset(map(id, modules)))
            if read != self._flags_read:
                self._flags_read = read
                self._model_checkpoints = any(checkpointing_flag(m) is True for m in modules)
            if facts.checkpoint_seen or self._model_checkpoints:
                facts.checkpointing = True
        # once a step is enough (and when a model or optimizer is found, or a trainer's
        # settings arrive)
        key = (
            self._state.step, len(modules), len(optimizers),
            facts.accumulation_steps, facts.checkpointing,
        )  # fmt: skip
        if (modules or optimizers) and dev.setup_key != key:
            setup = training_setup(
                modules, optimizers, self.walked_dtype, facts, census, self._state.fsdp
            )
            dev.setup = _merged(dev.setup, setup)
            dev.setup_key = key
        return sizes

    def trainer_settings(self, accumulation_steps: int | None, checkpointing: bool | None) -> None:
        """Keep what a framework's trainer is set to do (``None``: not told): the report's
        setup and the post-mortem carry it from the start, before the first optimizer step
        shows the accumulation or the first recompute shows the checkpointing."""
        if accumulation_steps is not None:
            self.facts.accumulation_steps = accumulation_steps
        if checkpointing is not None:
            self.facts.checkpointing = checkpointing

    def advice_fields(self, kind: str) -> dict[str, Any]:
        """What the advice rules need that the device records do not hold (``kind``: the
        device type, for a DataParallel model's output device)."""
        self.capture()
        facts = self.facts
        # a frozen model that ran in fewer than half of the steps (4 or more) is evaluation,
        # an EMA copy validated on a batch of the training batch's size: no teacher runs so
        # seldom (sweep CG: "on the training batch" for a ViT's EMA validation)
        steps = self._state.step
        teacher = not (steps >= 4 and facts.frozen_steps * 2 < steps)
        shapes = [facts.eval_input, None if teacher else facts.frozen_input]
        out: dict[str, Any] = {
            "eval_input_shape": max(
                (s for s in shapes if s is not None), key=math.prod, default=None
            ),
            "param_dtype": facts.param_dtype,
            "optimizer_name": facts.optimizer_name,
            "autocast_forwards": facts.autocast_forwards,
            "unsafe_loss": facts.unsafe_loss,
            "steps_with_grads_at_forward": facts.grads_steps,
            "grads_at_forward_bytes": facts.grads_at_forward_bytes,
            "steps_with_grads_into_backward": facts.grads_into_backward,
            "stale_gradients": facts.stale_gradients,
            "stale_step": facts.stale_step,
            "stale_looks": facts.stale_looks,
            "retry_held": facts.retry_held,
            "retained_held": facts.retained_held,
            "dp_output_bytes": facts.dp_output_bytes,
            "frozen_model": facts.frozen_seen if teacher else None,
            "frozen_forwards": facts.frozen_forwards if teacher else 0,
            "frozen_input_shape": facts.frozen_input if teacher else None,
            "frozen_peaks": dict(facts.frozen_peaks) if teacher else {},
            "frozen_bases": dict(facts.frozen_bases) if teacher else {},
            "frozen_autocast": facts.frozen_autocast and teacher,
        }
        if facts.dp_layout is not None:
            ids, output = facts.dp_layout
            out["dp_device_ids"] = ids
            out["dp_output_device"] = f"{kind}:{output}"
        return out


def param_dtype(modules: Iterable[torch.nn.Module]) -> str | None:
    """The dtype holding most bytes of the modules' trainable floating parameters."""
    sizes: dict[str, int] = {}
    for mod in modules:
        for p in mod.parameters():
            _count_dtype(p, sizes)
    return _largest(sizes)


def _count_dtype(p: torch.Tensor, sizes: dict[str, int]) -> None:
    """Add a parameter's bytes to its dtype's, if it is trainable and floating (or complex:
    a Fourier layer's spectral weights)."""
    if p.requires_grad and (p.is_floating_point() or p.is_complex()):
        key = str(p.dtype).replace("torch.", "")
        sizes[key] = sizes.get(key, 0) + int(p.numel() * p.element_size())


def _largest(sizes: dict[str, int]) -> str | None:
    return max(sizes, key=lambda k: sizes[k]) if sizes else None


@dataclass
class WeightCensus:
    """What :func:`persistent_bytes` finds of the weights in its walk, beside the totals.

    Attributes:
        trainable_dtypes: bytes of the trainable floating (and complex) parameters by dtype (what
            :func:`param_dtype` counts).
        optimized: bytes of the parameters the optimizers step, on the device (those that
            require grad: a frozen backbone in an optimizer over all parameters is not).
        narrow: bytes of the parameters and buffers (trainable or frozen) on the device held
            in 16 bits or fewer: a bf16 or int8 frozen base.
        stepped_in_backward: the largest trainable parameter's bytes among those whose
            post-accumulate-grad hooks step an optimizer (the optimizer step fused into
            backward), else 0; ``stepped_in_backward_total``: all of theirs.
        optimizers: where several step, ``(class name, state bytes, stepped bytes)`` of each
            on the device (a storage two of them hold counts for the first).
    """

    trainable_dtypes: dict[str, int] = field(default_factory=dict)
    optimized: int = 0
    narrow: int = 0
    stepped_in_backward: int = 0
    stepped_in_backward_total: int = 0
    optimizers: list[tuple[str, int, int]] = field(default_factory=list)

    def add(self, t: torch.Tensor, nbytes: int) -> None:
        """Count ``nbytes`` of weight ``t`` (0 where counted already, or on another device)."""
        if t.dtype != torch.bool and t.element_size() <= 2:
            self.narrow += nbytes


def training_setup(
    modules: Sequence[torch.nn.Module],
    optimizers: Sequence[Any],
    dtype: str | None,
    facts: RunFacts | None = None,
    census: WeightCensus | None = None,
    fsdp: FsdpUnits | None = None,
) -> TrainingSetup | None:
    """The model's and optimizer's facts the advice reads (``None`` when neither exists;
    ``dtype``: :func:`param_dtype` of ``modules``, as the caller's walk found it), with the
    trainer's settings ``facts`` holds (:meth:`Evidence.trainer_settings`) and the weights'
    sizes the caller's walk counted (``census``)."""
    if not modules and not optimizers:
        return None
    history = foreach = buffers = lead = None
    if optimizers:
        # the optimizer whose steps count (LBFGS after Adam: the second), else the first seen
        named = None if facts is None else facts.optimizer_name
        lead = next((o for o in optimizers if type(o).__name__ == named), optimizers[0])
        group = lead.param_groups[0] if lead.param_groups else {}
        size = group.get("history_size")
        history = size if isinstance(size, int) else None
        foreach = _steps_foreach(group)
        buffers = state_buffers(type(lead).__name__, group)
    autocast = next((d for m in modules if (d := forward_autocast(m)) is not None), None)
    sparse, dense = _embeddings(modules, optimizers)
    return TrainingSetup(
        param_dtype=dtype,
        optimizer=None if lead is None else type(lead).__name__,
        history_size=history,
        forward_autocast=autocast,
        optimizer_foreach=foreach,
        accumulation_steps=None if facts is None else facts.accumulation_steps,
        checkpointing=None if facts is None else facts.checkpointing,
        sparse_gradients=sparse,
        dense_embeddings=dense,
        optimized_bytes=census.optimized if census is not None and optimizers else None,
        narrow_weight_bytes=census.narrow if census is not None and modules else None,
        trainable_bytes=sum(census.trainable_dtypes.values())
        if census is not None and modules
        else None,
        float64_bytes=sum(census.trainable_dtypes.get(d, 0) for d in ("float64", "complex128"))
        if census is not None and modules
        else None,
        state_buffers=buffers,
        stepped_in_backward_bytes=(census.stepped_in_backward, census.stepped_in_backward_total)
        if census is not None and modules and census.stepped_in_backward
        else None,
        wrapper=_wrapper(modules),
        sharding=None if fsdp is None else fsdp.sharding(),
        optimizer_states=tuple(census.optimizers)
        if census is not None and len(optimizers) > 1
        else None,
    )


def _wrapper(modules: Sequence[torch.nn.Module]) -> str | None:
    """The framework that wrapped one of ``modules``: ``"accelerate"`` or ``"fabric"``."""
    for module in modules:
        if getattr(module, "_is_accelerate_prepared", False):
            return "accelerate"
        if type(module).__name__ == "_FabricModule":
            return "fabric"
    return None


def checkpointing_flag(module: Any) -> bool | None:
    """What a transformers model says of its activation checkpointing
    (``is_activation_checkpointing``; before transformers 5, ``is_gradient_checkpointing``,
    a deprecated alias in 5.x whose warning is kept from the script); ``None``: it has no
    such flag."""
    cls = type(module)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        for name in ("is_activation_checkpointing", "is_gradient_checkpointing"):
            if hasattr(cls, name):
                try:
                    flag = getattr(module, name)
                except Exception:  # (a property of another library's model that fails)
                    return None
                return flag if isinstance(flag, bool) else None
    return None


def accelerate_accumulation(modules: Sequence[torch.nn.Module]) -> int | None:
    """The micro-batches per optimizer step of the Hugging Face ``Accelerator`` that prepared
    one of ``modules`` (``Accelerator(gradient_accumulation_steps=4)`` with
    ``accelerator.accumulate``), read from accelerate's shared ``GradientState`` without
    creating it (``None``: no module prepared by accelerate, or an ``Accelerator`` that does not
    accumulate: transformers' ``Trainer`` makes one with 1 and accumulates on its own). The
    state is process-wide and outlives the ``Accelerator``: a model accelerate did not prepare
    is not read by it."""
    if not any(getattr(m, "_is_accelerate_prepared", False) for m in modules):
        return None
    module = sys.modules.get("accelerate.state")
    shared = getattr(getattr(module, "GradientState", None), "_shared_state", None)
    if not isinstance(shared, dict):
        return None
    kwargs = shared.get("plugin_kwargs")
    steps = kwargs.get("num_steps") if isinstance(kwargs, dict) else None
    return steps if isinstance(steps, int) and steps > 1 else None


def _embeddings(
    modules: Sequence[torch.nn.Module], optimizers: Sequence[Any]
) -> tuple[bool | None, tuple[tuple[str, int, int], ...]]:
    """Whether training makes sparse gradients (an embedding with ``sparse=True`` among the
    modules, or a SparseAdam; ``None``: neither seen and no module left to ask), and the
    trainable ``nn.Embedding`` tables with dense gradients that no other module shares
    (:attr:`TrainingSetup.dense_embeddings`; paths as the tracker names a model's modules)."""
    sparse = any(type(opt).__name__ == "SparseAdam" for opt in optimizers)
    tables: list[tuple[str, torch.nn.Embedding]] = []
    owners: dict[int, int] = {}
    for root in modules:
        inner = root
        for _ in range(4):  # (a compiled or Fabric-wrapped model: named as the tracker does)
            inner = wrapped_module(inner) or inner
        for path, module in inner.named_modules():
            for p in module._parameters.values():
                if p is not None:
                    owners[id(p)] = owners.get(id(p), 0) + 1
            if isinstance(module, _SPARSE_CAPABLE) and module.sparse:
                sparse = True
            elif isinstance(module, torch.nn.Embedding) and module.weight.requires_grad:
                tables.append((path, module))
    dense = tuple(
        (path, int(m.weight.nbytes), int(m.weight.shape[1]) * m.weight.element_size())
        for path, m in tables
        if owners.get(id(m.weight)) == 1 and m.weight.dim() == 2
    )
    return (True if sparse else False if modules else None), dense


_SPARSE_CAPABLE = (torch.nn.Embedding, torch.nn.EmbeddingBag)
"""Modules whose ``sparse=True`` makes their weight's gradient a sparse COO tensor."""


def _steps_foreach(group: dict[str, Any]) -> bool:
    """Whether an optimizer's param group steps with ``foreach``: its setting, else torch's
    default (on where the parameters are on CUDA, unless ``fused``); ``False`` for an
    optimizer without the option (no ``foreach`` key: SparseAdam, LBFGS, non-torch ones),
    which ``foreach=False`` would make raise a TypeError."""
    if "foreach" not in group:
        return False
    if group.get("fused"):
        return False
    if group["foreach"] is not None:
        return bool(group["foreach"])
    params = group.get("params") or []
    return bool(params) and all(tensor_device(p).type == "cuda" for p in params)


def _merged(old: TrainingSetup | None, new: TrainingSetup | None) -> TrainingSetup | None:
    """``new``, with what it could not read (the model or optimizer gone) kept from ``old``."""
    if old is None or new is None:
        return new or old
    return TrainingSetup(
        *(b if b is not None else a for a, b in zip(astuple(old), astuple(new), strict=True))
    )


def gradient_witnesses(
    modules: Iterable[torch.nn.Module], optimizers: Iterable[Any]
) -> list[torch.Tensor]:
    """Parameters whose ``.grad`` tells whether gradients are allocated now: one per
    optimizer (an optimizer's gradients come and go together: backward creates them, its
    ``zero_grad`` frees them; a GAN's two optimizers free theirs at different times). Without
    an optimizer, the first module's trainable parameter; optimizers first, as a module seen
    first may be one that never trains (a distillation teacher in eval mode whose parameters
    still require grad)."""
    found: list[torch.Tensor] = []
    for opt in optimizers:
        params = [p for group in opt.param_groups for p in group["params"]]
        # a parameter frozen now may train later (a GAN's discriminator, frozen for the
        # generator's update): a trainable one first, else any of the optimizer's
        param = next((p for p in params if p.requires_grad), params[0] if params else None)
        if param is not None and not any(param is f for f in found):
            found.append(param)
    if found:
        return found
    for mod in modules:
        for p in mod.parameters():
            if p.requires_grad:
                return [p]
    return []


def persistent_bytes(
    dev: DeviceRecord,
    modules: Sequence[torch.nn.Module],
    optimizers: Sequence[Any],
    model: torch.nn.Module | None,
    primary: bool,
    fsdp: FsdpUnits | None = None,
    census: WeightCensus | None = None,
    wrappers: Sequence[torch.nn.Module] = (),
) -> Persistent:
    """Bytes of parameters (and buffers), gradients, optimizer state and DDP's gradient
    buckets (memkit/tracking/ddp.py) on ``dev``.

    Each storage counts once (tied weights, views); ``model`` is the tracked model (a
    DataParallel one's replicas count on the devices other than the ``primary`` one).
    Optimizer state is every tensor in ``optimizer.state``, also inside lists, tuples and
    dicts. Under FSDP2 (``fsdp``) the parameters are the rank's shards, whatever the modules
    hold now: their unsharded parameters are all-gathered ones, counted apart. With neither
    modules nor optimizers left, the parameters are the most ``dev`` saw (``params_full``).
    ``census``: filled in the same walk (:class:`WeightCensus`); ``wrappers``: DDP models
    that wrap the modules (their buckets count).
    """
    target = dev.backend.device
    holds = getattr(dev.backend, "holds", None)
    seen: set[tuple[int, int]] = set()  # storages counted, or found elsewhere

    def size(t: torch.Tensor) -> int:
        """Bytes of ``t``'s storages (a sparse tensor's indices and values) not counted yet."""
        storages = storages_of(t)
        if not storages:
            return 0
        here = holds(t) if holds is not None else _on(t, target)
        total = 0
        for storage in storages:
            nbytes = storage.nbytes()
            key = (storage.data_ptr(), nbytes)
            if key not in seen:
                seen.add(key)
                total += int(nbytes) if here else 0
        return total

    if fsdp is not None:  # unsharded storages (allocated now) are not this rank's parameters
        seen.update((s.data_ptr(), s.nbytes()) for s in fsdp.unsharded_storages())
    params = grads = state = 0
    # each parameter once (the model's are the optimizer's too): by identity
    unique: dict[int, torch.Tensor] = {}
    if fsdp is not None:
        unique.update((id(p), p) for p in fsdp.sharded_params())
    for mod in modules:
        for param in mod.parameters():
            unique[id(param)] = param
            if census is not None:
                _count_dtype(param, census.trainable_dtypes)
        for b in mod.buffers():
            n = size(b)
            params += n
            if census is not None:
                census.add(b, n)
    optimized: set[int] = set()  # (frozen ones get no gradient: stepped like none; sweep BH)
    for opt in optimizers:
        for group in opt.param_groups:
            unique.update((id(p), p) for p in group["params"])
            optimized.update(id(p) for p in group["params"] if p.requires_grad)
    all_params = list(unique.values())
    trainable = 0
    for p in all_params:
        n = size(p)
        params += n
        if p.requires_grad:
            trainable += n
        if census is not None:
            census.add(p, n)
            if id(p) in optimized:
                census.optimized += n
            if n and p.requires_grad and steps_in_backward(p):
                census.stepped_in_backward = max(census.stepped_in_backward, n)
                census.stepped_in_backward_total += n
    ddps = list({id(m): m for m in (*modules, *wrappers) if is_ddp(m)}.values())
    views = set().union(*map(bucket_views, ddps)) if ddps else set()
    for p in all_params:
        if p.grad is not None and id(p) not in views:  # (a view of a bucket: the bucket's)
            grads += size(p.grad)
    for opt in optimizers:
        own = sum(size(t) for st in opt.state.values() for t in state_tensors(st))
        state += own
        if census is not None and len(optimizers) > 1:  # (optimizer-state: each apart)
            stepped = {
                st.data_ptr(): st.nbytes()
                for g in opt.param_groups
                for p in g["params"]
                if p.requires_grad and (holds(p) if holds is not None else _on(p, target))
                for st in storages_of(p)
            }
            census.optimizers.append((type(opt).__name__, own, int(sum(stepped.values()))))
    if params == 0 and not all_params:  # the model is gone: what was last seen
        params = dev.params_full
    if params == 0 and isinstance(model, torch.nn.DataParallel) and not primary:
        # replicas on the other devices: broadcast copies of the weights for each forward
        params = sum(int(p.numel() * p.element_size()) for p in model.parameters())
    buckets = 0
    for mod in ddps:  # DDP's gradient buckets, on its parameters' device
        first = next(mod.parameters(), None)
        if first is not None and (holds(first) if holds is not None else _on(first, target)):
            buckets += bucket_bytes(mod)
    return Persistent(params, grads, state, buckets, trainable)


def _on(t: torch.Tensor, target: torch.device) -> bool:
    """Whether ``t`` is on the device ``target`` (any index where it has none)."""
    return t.device.type == target.type and (
        target.index is None or t.device.index in (None, target.index)
    )


_STALE_EVERY = 25
"""Step boundaries between looks for stale gradients (:meth:`Evidence.stale_due`)."""

_RECENT_STEPS = 10
"""An optimizer that stepped within this many steps still steps its parameters (one stepped
every k-th step: a WGAN's generator, SAC's policy): their gradients are not stale."""


def _gradient_bytes(
    params_by_model: Iterable[tuple[str, list[torch.Tensor]]],
) -> tuple[tuple[str, int], ...]:
    """The bytes of the parameters' gradients, by model, each storage once (a sparse
    gradient: its indices and values); models without any left out."""
    seen: set[int] = set()
    out = []
    for name, params in params_by_model:
        total = 0
        for param in params:
            grad = param.grad
            for storage in storages_of(grad) if grad is not None else ():
                if id(storage) not in seen:
                    seen.add(id(storage))
                    total += storage.nbytes()
        if total:
            out.append((name, total))
    return tuple(out)
