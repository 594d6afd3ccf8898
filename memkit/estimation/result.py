"""The result of :func:`memkit.estimation.estimate`: trials, breakdown and the estimate itself.

Data only (torch-free); the text and HTML layout is :mod:`memkit.render.estimate`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from memkit.advice import Advice
from memkit.render.estimate import estimate_html, estimate_text
from memkit.units import format_size

__all__ = ["Estimate", "EstimateBreakdown", "EstimateTrial"]


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

    def __str__(self) -> str:
        return estimate_text(self)

    def __repr__(self) -> str:
        return (
            f"Estimate(max_batch_size={self.max_batch_size}, "
            f"recommended_batch_size={self.recommended_batch_size}, device={self.device!r}, "
            f"device_memory={format_size(self.device_memory)!r}, mode={self.mode!r}, "
            f"amp={self.amp!r}, trials={len(self.trials)})"
        )

    def _repr_html_(self) -> str:
        return estimate_html(self)
