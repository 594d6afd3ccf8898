"""The target GPU's rules for training steps that another component runs on meta tensors.

``memkit estimate --gpus N`` compares DataParallel, DDP and FSDP2 on virtual devices
(:mod:`memkit.strategies`, which cannot import this package: it is handed a
:class:`TargetStep`). Each of its steps runs under the rules the one-card estimate's
:class:`~memkit.estimation.meta_step.MetaSession` applies, from the same code:

* :class:`~memkit.estimation.meta_step.TargetMode`: the attention kernel PyTorch would pick on
  the target (meta alone runs the math path, which keeps the ``L x S`` matrix), CUDA's fused
  dropout (a 1-byte mask), autocast's policy with ``--amp``;
* the optimizer's CUDA default implementation (foreach), as
  :func:`~memkit.estimation.meta_model.build_target_optimizer` sets it;
* the cuBLAS and cuBLASLt workspaces (:class:`~memkit.estimation.workspaces.KernelWorkspaces`),
  per GPU and thread, counted on the GPU that ran the matmul.

Not applied there: the caching allocator's model (the comparison counts tensor bytes, no
512-byte rounding, no segments; the one-card estimate has both).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from memkit.estimation.assumptions import attention_line
from memkit.estimation.families import TargetCard
from memkit.estimation.meta_model import build_target_optimizer
from memkit.estimation.meta_step import target_mode, target_rules_on
from memkit.estimation.workspaces import KernelWorkspaces
from memkit.modelfile import ModelSpec
from memkit.simulated.accountant import tensors_of
from memkit.simulated.virtual_devices import HOST, VirtualDevices
from memkit.units import format_size

__all__ = ["TargetStep"]


@dataclass
class TargetStep:
    """A target card's step rules, applied to the steps of the ``--gpus`` comparison.

    Attributes:
        card: the target (its family's compute capability and cuBLAS workspace).
        attention: the ``--attention`` request (``"auto"``: what PyTorch picks on the card).
        policy_dtype: autocast's dtype (``--amp``), ``None`` for fp32.
        foreach: the optimizer's implementation where the file leaves it unset (``None``: the
            CUDA default, foreach), as :func:`memkit.estimation.estimate` takes it.
        kernels: the attention kernels the steps used so far.
        optimizer_line: how the optimizer was built (its implementation), once it was.
    """

    card: TargetCard
    attention: str = "auto"
    policy_dtype: torch.dtype | None = None
    foreach: bool | None = None
    kernels: set[str] = field(default_factory=set)
    optimizer_line: str = ""

    def optimizer(self, spec: ModelSpec, model: torch.nn.Module) -> torch.optim.Optimizer:
        """The file's optimizer over ``model``'s parameters with CUDA's default implementation."""
        optimizer, self.optimizer_line = build_target_optimizer(spec, model, self.foreach)
        return optimizer

    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        """One training step under the target's rules (attention, dropout, autocast)."""
        mode = target_mode(self.policy_dtype, self.attention, self.card.family.sm)
        try:
            with target_rules_on(mode):
                yield
        finally:
            self.kernels |= mode.kernels

    def workspaces(self, devices: VirtualDevices) -> KernelWorkspaces:
        """A trial's cuBLAS/cuBLASLt workspaces: made on a GPU at its first matmul per thread
        (forward, autograd's backward thread), held on it to the end of the trial."""

        def device_of(output: Any) -> int:
            first = next(tensors_of(output, depth=1), None)
            return HOST if first is None else devices.where(first)

        def allocate(key: Any, nbytes: int) -> None:
            devices.hold(key[-1], nbytes)

        return KernelWorkspaces(allocate, self.card.workspace_bytes, device_of=device_of)

    def notes(self) -> tuple[str, ...]:
        """What the steps assumed of the target, for the comparison's notes."""
        family = self.card.family
        lines = [
            f"target: {family.name} (sm{family.sm}); each GPU's cuBLAS workspace "
            f"{format_size(self.card.workspace_bytes)} per thread that runs matmuls (2 in "
            "training) and cuBLASLt's 1.00 MiB per thread that runs a Linear with a bias",
            attention_line(self.attention, sorted(self.kernels), family),
            "dropout: CUDA's fused kernel (a 1-byte mask kept for backward)",
        ]
        if self.policy_dtype is not None:
            lines.append(f"amp: torch.autocast('cuda', {self.policy_dtype}) policy on the forward")
        if self.optimizer_line:
            lines.append(self.optimizer_line)
        return tuple(lines)
