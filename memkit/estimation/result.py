"""The result of :func:`memkit.estimation.estimate`: trials, breakdown and the estimate itself;
one estimate per sequence length (``memkit estimate --seq-len 512,1024``) is an
:class:`EstimateSweep`.

Data only (torch-free); the text and HTML layout is :mod:`memkit.render.estimate`, the shared
methods (``to_dict``, ``to_json``, ``to_html``...) :class:`memkit.results.Result`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from memkit.advice import Advice
from memkit.render import estimate as layout
from memkit.results import Record, Result, memory_model_json
from memkit.units import format_size

__all__ = ["Estimate", "EstimateBreakdown", "EstimateSweep", "EstimateTrial"]


@dataclass(frozen=True)
class EstimateTrial(Record):
    """One batch size estimated.

    Attributes:
        batch_size: the size.
        allocated_peak: estimated ``torch.cuda.max_memory_allocated`` for the step.
        reserved_peak: estimated ``torch.cuda.max_memory_reserved``; decides the fit.
        counted_peak: peak of the live tensor storages alone (512-byte rounded), without the
            allocator's block slack and the cuBLAS workspace: what the simulated device counts.
        fits: the reserved peak is within the usable memory.
        seconds: wall time of the trial.
        ran_out: the allocator model ran out of the usable memory during the step: the peaks
            are those reached when it failed, so the step needs more than them.
    """

    batch_size: int
    allocated_peak: int
    reserved_peak: int
    counted_peak: int
    fits: bool
    seconds: float
    ran_out: bool = False

    def _json_fields(self, out: dict[str, Any]) -> dict[str, Any]:
        out["seconds"] = round(self.seconds, 6)
        return out


@dataclass(frozen=True)
class EstimateBreakdown(Record):
    """What the allocated peak of one batch size is made of, at the moment of the peak.

    Attributes:
        batch_size: the size it describes.
        parameters: parameters and buffers (all of them, frozen ones too).
        gradients: gradients alive at the peak (trainable parameters only).
        optimizer_state: optimizer state (moments...) alive at the peak.
        activations: everything else alive at the peak: activations kept for backward,
            temporaries, autocast's cast copies, optimizer temporaries.
        workspace: cuBLAS and cuBLASLt workspaces.
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
            ("cuBLAS/cuBLASLt workspaces", self.workspace),
            ("allocator block slack", self.allocator_slack),
        ]

    def _json_fields(self, out: dict[str, Any]) -> dict[str, Any]:
        out["total"] = self.total
        return out


@dataclass(frozen=True)
class Estimate(Result):
    """What :func:`estimate` predicts for one model, mode and target device."""

    SCHEMA: ClassVar[str] = "memkit.Estimate/1"
    HTML_TITLE: ClassVar[str] = "memkit estimate"
    _JSON_SKIP: ClassVar[tuple[str, ...]] = ("extra",)

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
    weights_dtype: str | None = None  # most of the parameters' bytes, where not float32
    attention: str = "auto"
    attention_kernels: tuple[str, ...] = ()
    num_parameters: int = 0
    trainable_parameters: int = 0
    breakdown: EstimateBreakdown | None = None
    fixed_bytes: float | None = None
    per_sample_bytes: float | None = None
    per_pair_bytes: float | None = None
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

    def _json_fields(self, out: dict[str, Any]) -> dict[str, Any]:
        """The ``--json`` output: ``usable_bytes`` added, the line's two numbers as
        ``memory_model``, ``seconds`` to the millisecond; ``extra`` is not part of it."""
        memory_model_json(out)
        out["usable_bytes"] = self.usable_bytes
        out["seconds"] = round(self.seconds, 3)
        return out

    def __str__(self) -> str:
        return layout.estimate_text(self)

    def __repr__(self) -> str:
        return (
            f"Estimate(max_batch_size={self.max_batch_size}, "
            f"recommended_batch_size={self.recommended_batch_size}, device={self.device!r}, "
            f"device_memory={format_size(self.device_memory)!r}, mode={self.mode!r}, "
            f"amp={self.amp!r}, trials={len(self.trials)})"
        )

    def html_body(self) -> str:
        return layout.estimate_html_body(self)


@dataclass(frozen=True)
class EstimateSweep(Result):
    """One estimate per sequence length, same model, card and options (``memkit estimate
    --seq-len 512,1024``). Its JSON is ``{"schema": ..., "seq_lens": [estimate, ...]}``."""

    SCHEMA: ClassVar[str] = "memkit.EstimateSweep/1"
    HTML_TITLE: ClassVar[str] = "memkit estimate"

    results: tuple[Estimate, ...]

    def __post_init__(self) -> None:
        if not self.results:
            raise ValueError("an EstimateSweep needs at least one estimate")

    @property
    def fits(self) -> bool:
        """Whether at least ``min_batch`` fits at every sequence length."""
        return all(r.fits for r in self.results)

    @property
    def largest_batches(self) -> dict[int | None, int | None]:
        """The largest batch per sequence length."""
        return {r.seq_len: r.max_batch_size for r in self.results}

    def result(self, seq_len: int) -> Estimate | None:
        """The estimate at ``seq_len``, if it was made."""
        return next((r for r in self.results if r.seq_len == seq_len), None)

    def _json_fields(self, out: dict[str, Any]) -> dict[str, Any]:
        return {"seq_lens": out["results"]}

    def __str__(self) -> str:
        return layout.sweep_text(self)

    def __repr__(self) -> str:
        pairs = ", ".join(f"{seq}: {batch}" for seq, batch in self.largest_batches.items())
        return f"EstimateSweep({{{pairs}}})"

    def html_body(self) -> str:
        return layout.sweep_html_body(self)
