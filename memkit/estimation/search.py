"""The entry point of ``memkit estimate``: :func:`estimate` and :func:`simulated_peak`."""

from __future__ import annotations

import contextlib
import json
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from memkit import advice as advice_rules
from memkit.accounting import MemoryAccountant, tensors_of
from memkit.advice import Advice, advice_html, advice_text
from memkit.errors import ConfigError, ModelFileError
from memkit.estimation.allocator import CachingAllocatorModel
from memkit.estimation.attention import ATTENTION_KERNELS, choose_kernel, fused_attention
from memkit.estimation.autocast import AutocastPolicy, autocast_lists
from memkit.modelfile import ModelSpec, call_user, load_model_file, make_optimizer
from memkit.probing.search import SearchResult, search_max_batch
from memkit.probing.step import StepPlan, call_model, check_batch, to_device
from memkit.render import html as h
from memkit.render.text import table
from memkit.units import format_size, parse_size

__all__ = [
    "AMP_DTYPES",
    "DEFAULT_FAMILY",
    "DEVICE_FAMILIES",
    "DeviceFamily",
    "Estimate",
    "EstimateBreakdown",
    "EstimateTrial",
    "estimate",
    "simulated_peak",
]

log = logging.getLogger(__name__)

META = torch.device("meta")
DEFAULT_MARGIN = 0.05
MAX_BATCH_CEILING = 1 << 20
AMP_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class DeviceFamily:
    """What memkit assumes about a GPU family.

    Attributes:
        name: the family (``"ampere"``).
        sm: compute capability times ten (80), for the attention-kernel choice.
        context_bytes: device memory the CUDA context takes before PyTorch allocates anything.
        cublas_workspace_bytes: one cuBLAS workspace (PyTorch's default for the family).
        examples: cards of the family.
    """

    name: str
    sm: int
    context_bytes: int
    cublas_workspace_bytes: int
    examples: str


_MIB = 1 << 20
_PRE_HOPPER_WORKSPACE = 4096 * 1024 * 2 + 16 * 1024 * 8
"""PyTorch's default cuBLAS workspace before Hopper (``:4096:2:16:8``, 8.125 MiB)."""
_HOPPER_WORKSPACE = 32 * _MIB
"""PyTorch's default cuBLAS workspace on sm90 and later (32 MiB)."""

DEVICE_FAMILIES: dict[str, DeviceFamily] = {
    f.name: f
    for f in (
        DeviceFamily("volta", 70, 400 * _MIB, _PRE_HOPPER_WORKSPACE, "V100"),
        DeviceFamily("turing", 75, 400 * _MIB, _PRE_HOPPER_WORKSPACE, "T4, RTX 2080"),
        DeviceFamily("ampere", 80, 500 * _MIB, _PRE_HOPPER_WORKSPACE, "A100, A10, RTX 3090"),
        DeviceFamily("ada", 89, 500 * _MIB, _PRE_HOPPER_WORKSPACE, "L4, L40S, RTX 4090"),
        DeviceFamily("hopper", 90, 600 * _MIB, _HOPPER_WORKSPACE, "H100, H200"),
        DeviceFamily("blackwell", 100, 700 * _MIB, _HOPPER_WORKSPACE, "B200"),
    )
}
"""CUDA context and cuBLAS workspace per family (CUDA 12, lazy module loading, the default).

The context sizes are typical ``nvidia-smi`` readings of a PyTorch process that has just
initialised CUDA (driver, runtime and lazily loaded kernels; cuDNN and NCCL add more when used);
they vary by driver and CUDA version, so ``--context`` overrides them and
``benchmarks/estimate_accuracy.py`` measures the real one (``mem_get_info`` used minus
``memory_reserved``). The workspaces are PyTorch's defaults (``CUBLAS_WORKSPACE_CONFIG``).
"""
DEFAULT_FAMILY = "ampere"


@dataclass(frozen=True)
class EstimateTrial:
    """One batch size estimated.

    Attributes:
        batch_size: the size.
        allocated_peak: estimated ``torch.cuda.max_memory_allocated`` for the step.
        reserved_peak: estimated ``torch.cuda.max_memory_reserved``; decides the fit.
        counted_peak: peak of the live tensor storages alone (512-byte rounded), without the
            allocator's block slack and the cuBLAS workspace: what the simulated device counts.
        fits: the reserved peak is within the usable memory.
        seconds: wall time of the trial.
    """

    batch_size: int
    allocated_peak: int
    reserved_peak: int
    counted_peak: int
    fits: bool
    seconds: float

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict."""
        return {
            "batch_size": self.batch_size,
            "allocated_peak": self.allocated_peak,
            "reserved_peak": self.reserved_peak,
            "counted_peak": self.counted_peak,
            "fits": self.fits,
            "seconds": round(self.seconds, 6),
        }


@dataclass(frozen=True)
class EstimateBreakdown:
    """What the allocated peak of one batch size is made of, at the moment of the peak.

    Attributes:
        batch_size: the size it describes.
        parameters: parameters and buffers (all of them, frozen ones too).
        gradients: gradients alive at the peak (trainable parameters only).
        optimizer_state: optimizer state (moments...) alive at the peak.
        activations: everything else alive at the peak: activations kept for backward,
            temporaries, autocast's cast copies, optimizer temporaries.
        workspace: cuBLAS workspaces.
        allocator_slack: allocated block bytes beyond the requests (unsplit blocks).
    """

    batch_size: int
    parameters: int
    gradients: int
    optimizer_state: int
    activations: int
    workspace: int
    allocator_slack: int

    @property
    def total(self) -> int:
        """Sum of the parts: the allocated peak."""
        return (
            self.parameters
            + self.gradients
            + self.optimizer_state
            + self.activations
            + self.workspace
            + self.allocator_slack
        )

    def rows(self) -> list[tuple[str, int]]:
        """``(label, bytes)`` per part."""
        return [
            ("parameters", self.parameters),
            ("gradients", self.gradients),
            ("optimizer state", self.optimizer_state),
            ("activations and temporaries", self.activations),
            ("cuBLAS workspace", self.workspace),
            ("allocator block slack", self.allocator_slack),
        ]

    def to_dict(self) -> dict[str, int]:
        """JSON-ready dict."""
        return {
            "batch_size": self.batch_size,
            "parameters": self.parameters,
            "gradients": self.gradients,
            "optimizer_state": self.optimizer_state,
            "activations": self.activations,
            "workspace": self.workspace,
            "allocator_slack": self.allocator_slack,
            "total": self.total,
        }


@dataclass(frozen=True)
class Estimate:
    """What :func:`estimate` predicts for one model, mode and target device."""

    model_file: str | None
    device: str
    device_memory: int
    context_bytes: int
    mode: str
    trials: tuple[EstimateTrial, ...]
    max_batch_size: int | None
    recommended_batch_size: int | None
    margin: float
    min_batch: int
    max_batch: int | None
    hit_max_batch: bool = False
    seq_len: int | None = None
    amp: str | None = None
    attention: str = "auto"
    attention_kernels: tuple[str, ...] = ()
    num_parameters: int = 0
    trainable_parameters: int = 0
    breakdown: EstimateBreakdown | None = None
    fixed_bytes: float | None = None
    per_sample_bytes: float | None = None
    assumptions: tuple[str, ...] = ()
    advice: tuple[Advice, ...] = ()
    seconds: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict, compare=False)

    @property
    def usable_bytes(self) -> int:
        """What the caching allocator may reserve: the card minus the CUDA context."""
        return max(0, self.device_memory - self.context_bytes)

    @property
    def fits(self) -> bool:
        """Whether at least ``min_batch`` fits."""
        return self.max_batch_size is not None

    def trial(self, batch_size: int) -> EstimateTrial | None:
        """The trial estimated at ``batch_size``, if any."""
        return next((t for t in self.trials if t.batch_size == batch_size), None)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dictionary (the ``--json`` output)."""
        return {
            "model_file": self.model_file,
            "device": self.device,
            "device_memory": self.device_memory,
            "context_bytes": self.context_bytes,
            "usable_bytes": self.usable_bytes,
            "mode": self.mode,
            "seq_len": self.seq_len,
            "amp": self.amp,
            "attention": self.attention,
            "attention_kernels": list(self.attention_kernels),
            "num_parameters": self.num_parameters,
            "trainable_parameters": self.trainable_parameters,
            "max_batch_size": self.max_batch_size,
            "recommended_batch_size": self.recommended_batch_size,
            "margin": self.margin,
            "min_batch": self.min_batch,
            "max_batch": self.max_batch,
            "hit_max_batch": self.hit_max_batch,
            "memory_model": None
            if self.per_sample_bytes is None
            else {"fixed_bytes": self.fixed_bytes, "per_sample_bytes": self.per_sample_bytes},
            "breakdown": None if self.breakdown is None else self.breakdown.to_dict(),
            "assumptions": list(self.assumptions),
            "trials": [t.to_dict() for t in self.trials],
            "advice": [a.to_dict() for a in self.advice],
            "seconds": round(self.seconds, 3),
        }

    def to_json(self, indent: int | None = 2) -> str:
        """The ``--json`` output."""
        return json.dumps(self.to_dict(), indent=indent)

    def _headline(self) -> str:
        card = f"{format_size(self.device_memory)} {self.device}"
        seq = f", seq_len {self.seq_len}" if self.seq_len is not None else ""
        amp = f", {self.amp} autocast" if self.amp else ", fp32"
        usable = (
            f"{format_size(self.usable_bytes)} usable after a "
            f"{format_size(self.context_bytes)} CUDA context"
        )
        if self.max_batch_size is None:
            need = self.trials[0].reserved_peak if self.trials else None
            return (
                f"Estimated not to fit: batch {self.min_batch} ({self.mode}{seq}{amp}) needs "
                f"{format_size(need)} reserved on a {card} ({usable})."
            )
        bound = " (the --max-batch limit, not a memory limit)" if self.hit_max_batch else ""
        return (
            f"Estimated largest batch ({self.mode}{seq}{amp}) on a {card} ({usable}): "
            f"{self.max_batch_size}{bound}; recommended {self.recommended_batch_size} "
            f"(leaves {self.margin:.0%} free)."
        )

    def _trial_rows(self) -> list[list[object]]:
        return [
            [
                t.batch_size,
                "yes" if t.fits else "no",
                format_size(t.allocated_peak),
                format_size(t.reserved_peak),
            ]
            for t in sorted(self.trials, key=lambda t: t.batch_size)
        ]

    def _breakdown_rows(self) -> list[list[object]]:
        if self.breakdown is None:
            return []
        total = self.breakdown.total or 1
        rows: list[list[object]] = [
            [label, format_size(nbytes), f"{nbytes / total:.0%}"]
            for label, nbytes in self.breakdown.rows()
        ]
        return [*rows, ["allocated peak", format_size(self.breakdown.total), "100%"]]

    def __str__(self) -> str:
        parts = [self._headline(), ""]
        parts.append(
            table(["batch", "fits", "allocated", "reserved"], self._trial_rows(), align="rlrr")
        )
        if self.breakdown is not None:
            parts += [
                "",
                table(
                    ["", "bytes", "share"],
                    self._breakdown_rows(),
                    align="lrr",
                    title=f"breakdown at batch {self.breakdown.batch_size}:",
                ),
            ]
        if self.per_sample_bytes is not None:
            parts.append(
                f"\nmemory model: {format_size(self.fixed_bytes)} + "
                f"{format_size(self.per_sample_bytes)} per sample (reserved)"
            )
        parts.append("assumptions:")
        parts.extend(f"  {a}" for a in self.assumptions)
        text = advice_text(self.advice)
        if text:
            parts += ["", "advice:", text]
        return "\n".join(parts)

    def __repr__(self) -> str:
        return (
            f"Estimate(max_batch_size={self.max_batch_size}, "
            f"recommended_batch_size={self.recommended_batch_size}, device={self.device!r}, "
            f"device_memory={format_size(self.device_memory)!r}, mode={self.mode!r}, "
            f"amp={self.amp!r}, trials={len(self.trials)})"
        )

    def _repr_html_(self) -> str:
        body = f"<h3>memkit estimate</h3><p>{h.escape(self._headline())}</p>" + h.table(
            ["batch", "fits", "allocated", "reserved"], self._trial_rows()
        )
        if self.breakdown is not None:
            body += f"<p>breakdown at batch {self.breakdown.batch_size}:</p>" + h.table(
                ["", "bytes", "share"], self._breakdown_rows()
            )
        body += (
            '<p class="note">'
            + "<br>".join(h.escape(a) for a in self.assumptions)
            + "</p>"
            + advice_html(self.advice)
        )
        return h.fragment(body)


# --------------------------------------------------------------------------------------------
# The target's policies on meta: autocast and the attention kernel
# --------------------------------------------------------------------------------------------


def _is_meta_bool(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.is_meta and value.numel() == 1


class _TargetMode(TorchFunctionMode):
    """Applies autocast's policy and the attention-kernel footprint above autograd."""

    def __init__(self, policy: AutocastPolicy | None, attention: str, sm: int) -> None:
        super().__init__()
        self.policy = policy
        self.attention = attention
        self.sm = sm
        self.kernels: set[str] = set()
        self.data_checks = 0  # truth values read from meta tensors (approximated as true)

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        if func is torch.Tensor.backward or func is torch.autograd.backward:
            if self.policy is not None:  # the autocast region ends where backward starts
                self.policy.enabled = False
                self.policy.clear_cache()
            return func(*args, **kwargs)
        name = getattr(func, "__name__", "")
        if name == "__bool__" and args and _is_meta_bool(args[0]):
            # A data-dependent check on a meta tensor has no value: take it as true, the case
            # of the batches make_batch builds (an all-ones attention mask's `mask.all()`).
            self.data_checks += 1
            return True
        if self.policy is not None:
            args, kwargs = self.policy.cast_args(name, args, kwargs)
        if name == "scaled_dot_product_attention":
            return self._attention(func, args, kwargs)
        return func(*args, **kwargs)

    def _attention(
        self, func: Callable[..., Any], args: tuple[Any, ...], kw: dict[str, Any]
    ) -> Any:
        names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale")
        bound = dict(zip(names, args, strict=False)) | kw
        query, key, value = bound["query"], bound["key"], bound["value"]
        mask = bound.get("attn_mask")
        dropout = float(bound.get("dropout_p") or 0.0)
        kernel = choose_kernel(self.attention, query, key, value, mask, self.sm, dropout)
        self.kernels.add(kernel)
        if kernel == "math":
            return func(*args, **kw)
        return fused_attention(query, key, value, kernel, self.sm)


# --------------------------------------------------------------------------------------------
# One trial: the accountant's events replayed through the allocator, labelled for the breakdown
# --------------------------------------------------------------------------------------------

_CATEGORIES = ("parameters", "gradients", "optimizer_state", "activations")


class _Recorder:
    """Receives the accountant's alloc/free events: allocator model plus per-category bytes."""

    def __init__(self, allocator: CachingAllocatorModel) -> None:
        self.allocator = allocator
        self.phase = "activations"
        self.labels: dict[int, tuple[str, int]] = {}
        self.bytes = dict.fromkeys(_CATEGORIES, 0)
        self.total = 0
        self.peak_total = 0
        self.peak_parts = dict(self.bytes)
        self.peak_slack = 0
        self._fresh_key: int | None = None

    def on_alloc(self, key: int, nbytes: int) -> None:
        self.allocator.malloc(key, nbytes)
        self.labels[key] = (self.phase, nbytes)
        self.bytes[self.phase] += nbytes
        self.total += nbytes
        if self.total > self.peak_total:
            self.peak_total = self.total
            self.peak_parts = dict(self.bytes)
            self._fresh_key = key
        else:
            self._fresh_key = None

    def on_free(self, key: int, nbytes: int) -> None:
        self.allocator.free(key)
        label = self.labels.pop(key, None)
        if label is not None:
            self.bytes[label[0]] -= label[1]
            self.total -= label[1]
        self._fresh_key = None

    def relabel(self, tensor: torch.Tensor | None, category: str) -> None:
        if tensor is None or tensor.device.type != "meta":
            return
        key = id(tensor.untyped_storage())
        label = self.labels.get(key)
        if label is None or label[0] == category:
            return
        old, nbytes = label
        self.labels[key] = (category, nbytes)
        self.bytes[old] -= nbytes
        self.bytes[category] += nbytes
        if key == self._fresh_key:  # the peak was taken at this very allocation
            self.peak_parts[old] -= nbytes
            self.peak_parts[category] += nbytes


@dataclass
class _Peaks:
    allocated: int
    reserved: int
    counted: int
    ooms: int
    parts: dict[str, int]
    slack: int
    workspace: int
    seconds: float


@dataclass
class _Session:
    """Everything a trial needs: the meta model, its optimizer and the target's settings."""

    spec: ModelSpec
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer | None
    plan: StepPlan
    seq_len: int | None
    usable: int
    workspace: int
    policy_dtype: torch.dtype | None
    attention: str
    sm: int
    kernels: set[str] = field(default_factory=set)
    data_checks: int = 0
    cache: dict[int, _Peaks] = field(default_factory=dict)

    def batch(self, batch_size: int) -> Any:
        args = [batch_size] if self.seq_len is None else [batch_size, self.seq_len]
        with torch.device(META):
            made = call_user(
                self.spec.make_batch, *args, what=f"make_batch({batch_size})", path=self.spec.path
            )
        return to_device(made, META)

    def _mode(self) -> _TargetMode:
        policy = None if self.policy_dtype is None else AutocastPolicy(self.policy_dtype)
        return _TargetMode(policy, self.attention, self.sm)

    def step(self, batch_size: int) -> None:
        mode = self._mode()
        batch = self.batch(batch_size)
        with mode:
            self.plan(self.model, batch, self.optimizer)
        del batch
        self.kernels |= mode.kernels
        self.data_checks += mode.data_checks

    def prime(self, batch_size: int) -> None:
        """The previous step's output, as the steady state holds it during the next forward
        (the default step keeps it like a loop's `out = model(x)`): made by an unaccounted
        forward without a graph, counted from the accounted step's start."""
        self.plan.release()
        if self.plan.train_step is not None:
            return
        batch = self.batch(batch_size)
        with torch.no_grad(), self._mode():
            self.plan.hold(call_model(self.model, batch))

    def run(self, batch_size: int) -> _Peaks:
        cached = self.cache.get(batch_size)
        if cached is not None:
            return cached
        started = time.perf_counter()
        allocator = CachingAllocatorModel(capacity=self.usable)
        recorder = _Recorder(allocator)
        accountant = MemoryAccountant(META, None, rounding="cuda", name="estimate")
        accountant.on_alloc = recorder.on_alloc
        accountant.on_free = recorder.on_free
        workspaces = 2 if self.plan.mode == "train" else 1
        for i in range(workspaces if self.workspace else 0):
            allocator.malloc(("cublas-workspace", i), self.workspace)
        recorder.phase = "parameters"
        accountant.track(self.model)
        recorder.phase = "optimizer_state"
        if self.optimizer is not None:
            accountant.track(self.optimizer)
        self.prime(batch_size)
        recorder.phase = "activations"
        accountant.track(self.plan.kept)
        with self._hooks(recorder), accountant:
            self.step(batch_size)
        self.plan.release()
        accountant.on_alloc = accountant.on_free = None
        workspace = self.workspace * workspaces
        peaks = _Peaks(
            allocated=allocator.peak_allocated,
            reserved=allocator.peak_reserved,
            counted=accountant.peak,
            ooms=allocator.num_ooms,
            parts=dict(recorder.peak_parts),
            slack=max(0, allocator.peak_allocated - workspace - accountant.peak),
            workspace=workspace,
            seconds=time.perf_counter() - started,
        )
        self.cache[batch_size] = peaks
        return peaks

    @contextlib.contextmanager
    def _hooks(self, recorder: _Recorder) -> Iterator[None]:
        handles: list[Any] = []

        def grad_hook(param: torch.Tensor) -> None:
            recorder.relabel(param.grad, "gradients")

        for param in self.model.parameters():
            if param.requires_grad:
                handles.append(param.register_post_accumulate_grad_hook(grad_hook))
        if self.optimizer is not None:
            optimizer = self.optimizer

            def post_step(*_: Any) -> None:
                for tensor in tensors_of(list(optimizer.state.values())):
                    recorder.relabel(tensor, "optimizer_state")

            handles.append(optimizer.register_step_post_hook(post_step))
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()


# --------------------------------------------------------------------------------------------
# The public entry point
# --------------------------------------------------------------------------------------------


def _family(device: str | DeviceFamily) -> DeviceFamily:
    if isinstance(device, DeviceFamily):
        return device
    family = DEVICE_FAMILIES.get(device.lower())
    if family is None:
        raise ConfigError(
            f"unknown device family {device!r}; expected one of {', '.join(DEVICE_FAMILIES)}"
        )
    return family


def _build_meta_model(spec: ModelSpec) -> torch.nn.Module:
    with torch.device(META):
        model = call_user(spec.build_model, what="build_model()", path=spec.path)
    if not isinstance(model, torch.nn.Module):
        raise ModelFileError(
            f"build_model() in {spec.path} returned {type(model).__name__}; expected a "
            "torch.nn.Module"
        )
    off_meta = [
        t.device for t in (*model.parameters(), *model.buffers()) if t.device.type != "meta"
    ]
    if off_meta:
        log.info("build_model() put tensors on %s; moving them to meta", off_meta[0])
        model = model.to(META)
    return model


def _build_optimizer(
    spec: ModelSpec, model: torch.nn.Module, foreach: bool | None, assumptions: list[str]
) -> torch.optim.Optimizer:
    optimizer, name = make_optimizer(spec, model)
    impl = "foreach (CUDA default)" if foreach is None else ("foreach" if foreach else "for-loop")
    use = True if foreach is None else foreach
    for group in optimizer.param_groups:
        if "foreach" in group and group["foreach"] is None:
            group["foreach"] = use
    assumptions.append(f"optimizer: {name}, {impl} implementation")
    return optimizer


def estimate(
    model_file: str | Path | ModelSpec,
    *,
    device_memory: int | str,
    mode: str = "train",
    seq_len: int | None = None,
    amp: str | None = None,
    attention: str = "auto",
    device: str | DeviceFamily = DEFAULT_FAMILY,
    context: int | str | None = None,
    min_batch: int = 1,
    max_batch: int | None = None,
    margin: float = DEFAULT_MARGIN,
    foreach: bool | None = None,
    workspace: int | str | None = None,
) -> Estimate:
    """Estimate the largest batch of a model file that fits on a GPU, without one.

    Args:
        model_file: a model file's path (see docs/probe.md), or a loaded ``ModelSpec``.
        device_memory: the card's total memory (``"24GiB"``, ``"40GiB"``; ``GB`` is decimal).
        mode: ``"train"`` or ``"infer"``.
        seq_len: passed to ``make_batch(batch_size, seq_len)``.
        amp: ``None`` (fp32), ``"bf16"`` or ``"fp16"``: autocast's policy on the forward.
        attention: ``"auto"`` (what PyTorch picks on the target), ``"math"``, ``"efficient"``
            or ``"flash"`` (falls back when the inputs do not allow it).
        device: the GPU family (a key of :data:`DEVICE_FAMILIES`): context, cuBLAS workspace,
            which attention kernels exist.
        context: the CUDA context's size; default: the family's.
        min_batch, max_batch: bounds of the search (``max_batch`` defaults to 2**20).
        margin: share of the usable memory the recommended batch leaves free.
        foreach: the optimizer's implementation where the model file leaves it unset; ``None``
            means the CUDA default (foreach). ``False`` reproduces the simulated cpu device.
        workspace: one cuBLAS workspace; default: the family's; ``0`` for none.

    Returns:
        An :class:`Estimate`.

    Raises:
        ConfigError: a bad argument. ModelFileError: an unusable model file.
    """
    started = time.perf_counter()
    if mode not in ("train", "infer"):
        raise ConfigError(f"mode must be 'train' or 'infer', found {mode!r}")
    if amp is not None and amp not in AMP_DTYPES:
        raise ConfigError(f"amp must be one of {', '.join(AMP_DTYPES)} or None, found {amp!r}")
    if attention not in ATTENTION_KERNELS:
        raise ConfigError(
            f"attention must be one of {', '.join(ATTENTION_KERNELS)}, found {attention!r}"
        )
    if min_batch < 1 or (max_batch is not None and max_batch < min_batch):
        raise ConfigError(
            f"need 1 <= min_batch <= max_batch, found min_batch={min_batch}, max_batch={max_batch}"
        )
    if not 0 <= margin < 1:
        raise ConfigError(f"margin is a fraction in [0, 1), found {margin}")
    family = _family(device)
    total = parse_size(device_memory)
    context_bytes = family.context_bytes if context is None else parse_size(context)
    if total <= context_bytes:
        raise ConfigError(
            f"device memory {format_size(total)} is not larger than the CUDA context "
            f"({format_size(context_bytes)}); give the card's total memory, e.g. 24GiB"
        )
    workspace_bytes = family.cublas_workspace_bytes if workspace is None else parse_size(workspace)

    spec = model_file if isinstance(model_file, ModelSpec) else load_model_file(model_file)
    if seq_len is not None and not spec.takes_seq_len:
        raise ModelFileError(
            f"a sequence length ({seq_len}) was given but make_batch in {spec.path} takes no "
            "seq_len; define make_batch(batch_size, seq_len)"
        )
    model = _build_meta_model(spec)
    params = list(model.parameters())
    num_params = sum(p.numel() for p in params)
    trainable = sum(p.numel() for p in params if p.requires_grad)
    assumptions: list[str] = [
        f"target: {family.name} (sm{family.sm}; e.g. {family.examples}), "
        f"{format_size(total)} total",
        f"CUDA context: {format_size(context_bytes)}"
        + (" (family default; override with --context)" if context is None else " (given)"),
        "allocator: PyTorch CUDA caching allocator, default settings, one stream "
        "(512-byte blocks, 2 MiB small / 20 MiB large segments, best fit, split, merge)",
        f"cuBLAS workspace: {format_size(workspace_bytes)} per thread that runs matmuls"
        + (" (2 in training: autograd's device thread has its own)" if mode == "train" else ""),
        "amp: "
        + (
            "none (fp32)"
            if amp is None
            else f"torch.autocast('cuda', {amp}) policy on the forward; fp32 master weights; "
            f"op lists from {autocast_lists().source}"
        ),
        f"parameters: {num_params:,} ({trainable:,} trainable, {num_params - trainable:,} "
        "frozen: no gradients, no optimizer state)",
    ]
    optimizer = None
    if mode == "train":
        model.train()
        optimizer = _build_optimizer(spec, model, foreach, assumptions)
    else:
        model.eval()
    plan = StepPlan(mode, loss_fn=spec.loss_fn, train_step=spec.train_step)
    session = _Session(
        spec=spec, model=model, optimizer=optimizer, plan=plan, seq_len=seq_len,
        usable=total - context_bytes, workspace=workspace_bytes,
        policy_dtype=None if amp is None else AMP_DTYPES[amp], attention=attention, sm=family.sm,
    )  # fmt: skip
    layout = check_batch(
        session.batch(min_batch), min_batch, f"make_batch({min_batch}) in {spec.path}",
        bigger=session.batch(min_batch + 1),
    )  # fmt: skip
    if layout is not None:
        assumptions.append(layout)
    if optimizer is not None:  # warm-up: creates the optimizer state (not accounted)
        _guard(lambda: session.step(min_batch), min_batch)
        model.zero_grad(set_to_none=True)

    def oracle(batch_size: int) -> tuple[bool, int | None]:
        peaks = _guard(lambda: session.run(batch_size), batch_size)
        return peaks.ooms == 0 and peaks.reserved <= session.usable, peaks.reserved

    search = search_max_batch(
        oracle,
        capacity_bytes=session.usable,
        min_batch=min_batch,
        max_batch=max_batch if max_batch is not None else MAX_BATCH_CEILING,
        margin=margin,
    )
    focus = search.recommended_batch_size or min_batch
    peaks = _guard(lambda: session.run(focus), focus)
    breakdown = EstimateBreakdown(
        batch_size=focus,
        parameters=peaks.parts["parameters"],
        gradients=peaks.parts["gradients"],
        optimizer_state=peaks.parts["optimizer_state"],
        activations=peaks.parts["activations"],
        workspace=peaks.workspace,
        allocator_slack=max(0, peaks.allocated - peaks.workspace - peaks.counted),
    )
    kernels = tuple(sorted(session.kernels))
    assumptions.append(_attention_line(attention, kernels, family))
    assumptions += plan.describe()
    if session.data_checks:
        assumptions.append(
            "data-dependent checks (`if mask.all():` and the like) read from meta tensors were "
            f"taken as true ({session.data_checks} times in the trials): right for batches "
            "without padding, as make_batch usually builds them"
        )
    assumptions.append("make_batch ran under torch.device('meta'): its tensors are shapes only")
    trials = tuple(_trial(t.batch_size, session.cache[t.batch_size], t.fits) for t in search.trials)
    advice = _advice(search, session, breakdown, amp, mode, total, context_bytes)
    fit = search.model
    return Estimate(
        model_file=spec.path,
        device=family.name,
        device_memory=total,
        context_bytes=context_bytes,
        mode=mode,
        trials=trials,
        max_batch_size=search.max_batch_size,
        recommended_batch_size=search.recommended_batch_size,
        margin=margin,
        min_batch=min_batch,
        max_batch=max_batch,
        hit_max_batch=search.hit_max_batch and max_batch is not None,
        seq_len=seq_len,
        amp=amp,
        attention=attention,
        attention_kernels=kernels,
        num_parameters=num_params,
        trainable_parameters=trainable,
        breakdown=breakdown,
        fixed_bytes=None if fit is None else fit.fixed_bytes,
        per_sample_bytes=None if fit is None else fit.per_sample_bytes,
        assumptions=tuple(assumptions),
        advice=tuple(advice),
        seconds=time.perf_counter() - started,
    )


def _guard(run: Callable[[], Any], batch_size: int) -> Any:
    """Run a meta step; the user's code failing becomes a clear error (never an OOM)."""
    from memkit.errors import MemkitError, UserCodeError

    try:
        return run()
    except MemkitError:
        raise
    except Exception as exc:
        raise UserCodeError(
            f"the step raised {type(exc).__name__} at batch size {batch_size} on meta tensors: "
            f"{exc}. Code that reads tensor values (.item(), data-dependent shapes, printing) "
            "cannot run on meta; move it out of the step or define train_step without it.",
            original=exc,
        ) from exc


def _trial(batch_size: int, peaks: _Peaks, fits: bool) -> EstimateTrial:
    return EstimateTrial(
        batch_size, peaks.allocated, peaks.reserved, peaks.counted, fits, peaks.seconds
    )


def _attention_line(requested: str, kernels: tuple[str, ...], family: DeviceFamily) -> str:
    if not kernels:
        return "attention: no F.scaled_dot_product_attention call seen"
    how = "chosen as PyTorch would on" if requested == "auto" else "requested; on"
    line = f"attention: {', '.join(kernels)} kernel ({how} sm{family.sm}; --attention overrides)"
    if "flash" in kernels and requested == "auto" and family.sm in (90, 100):
        line += (
            "; PyTorch builds with cuDNN > 9.15 run cuDNN attention here first, whose forward"
            " keeps the same tensors: flash's footprint stands in for it"
        )
    return line


def _advice(
    search: SearchResult,
    session: _Session,
    breakdown: EstimateBreakdown,
    amp: str | None,
    mode: str,
    total: int,
    context_bytes: int,
) -> list[Advice]:
    advice: list[Advice] = []
    usable = total - context_bytes
    focus = breakdown.batch_size
    peaks = session.cache[focus]
    if search.max_batch_size is None:
        advice.append(
            Advice(
                code="does-not-fit",
                title=f"Even batch {focus} is estimated not to fit",
                evidence=(
                    f"Batch {focus} ({mode}) needs an estimated {format_size(peaks.reserved)} "
                    f"reserved; the card has {format_size(usable)} usable "
                    f"({format_size(total)} minus a {format_size(context_bytes)} CUDA context)."
                ),
                action=(
                    "Use a larger card, or reduce what every step holds: mixed precision "
                    "(--amp bf16), activation checkpointing, a lighter optimizer, or shard "
                    "parameters and optimizer state across GPUs (FSDP/ZeRO)."
                ),
                severity="critical",
            )
        )
    if amp is None and breakdown.activations > 0.2 * breakdown.total:
        saving = None
        try:
            fields = {**session.__dict__, "policy_dtype": torch.bfloat16}
            bf16 = _Session(**{**fields, "cache": {}, "kernels": set()})
            saving = max(0, peaks.allocated - bf16.run(focus).allocated)
        except Exception as exc:  # advice must never break the estimate
            log.debug("bf16 comparison failed: %s", exc)
        # one implementation per code: the rules live in memkit.advice (issue #5)
        mp = advice_rules.mixed_precision(
            param_dtype="float32",  # no --amp: the estimate computes in the model's fp32
            autocast=False,
            activation_bytes=breakdown.activations,
            peak_bytes=breakdown.total,
            parameter_bytes=breakdown.parameters,
            device=f"the estimated card, batch {focus}",
            saving_bytes=saving,  # measured: a bf16 estimate of the same batch
            min_share=0.2,
        )
        if mp is not None:
            advice.append(mp)
    if mode == "train":
        opt = advice_rules.optimizer_state(
            optimizer_state_bytes=breakdown.optimizer_state,
            parameter_bytes=breakdown.parameters,
            peak_bytes=breakdown.total,
            capacity=None,  # an estimate asks "would it fit": always relevant
            device=f"the estimated card, batch {focus}",
        )
        if opt is not None:
            advice.append(opt)
    return advice


def simulated_peak(
    model_file: str | Path | ModelSpec,
    batch_size: int,
    *,
    mode: str = "train",
    seq_len: int | None = None,
    steps: int = 2,
) -> int:
    """The peak the simulated cpu device counts for real steps of a model file (validation).

    Builds the model on cpu, runs ``steps`` real steps from an empty optimizer state (as a
    ``memkit probe --device cpu`` trial does) under a :class:`MemoryAccountant` with CUDA
    rounding, and returns its peak. ``estimate(..., foreach=False, attention="math",
    workspace=0)`` counts the same storages on meta: its trials' ``counted_peak`` should agree.
    """
    spec = model_file if isinstance(model_file, ModelSpec) else load_model_file(model_file)
    model = call_user(spec.build_model, what="build_model()", path=spec.path)
    optimizer: Any = None
    if mode == "train":
        model.train()
        if spec.build_optimizer is not None:
            optimizer = spec.build_optimizer(model.parameters())
        else:
            optimizer = torch.optim.AdamW(model.parameters())
    else:
        model.eval()
    plan = StepPlan(mode, loss_fn=spec.loss_fn, train_step=spec.train_step)
    cpu = torch.device("cpu")
    accountant = MemoryAccountant(cpu, None, rounding="cuda")
    accountant.track(model, optimizer)
    args = [batch_size] if seq_len is None else [batch_size, seq_len]
    with accountant:
        for _ in range(steps):
            batch = to_device(spec.make_batch(*args), cpu)
            plan(model, batch, optimizer)
            del batch
    return accountant.peak
