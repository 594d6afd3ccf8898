"""The GPU families ``memkit estimate`` knows (CUDA context, cuBLAS workspace, compute
capability) and the target card an estimate is for.

Torch-free: the families can be listed without importing torch.
"""

from __future__ import annotations

from dataclasses import dataclass

from memkit.errors import ConfigError
from memkit.units import format_size, parse_size

__all__ = [
    "DEFAULT_FAMILY",
    "DEVICE_FAMILIES",
    "DeviceFamily",
    "TargetCard",
    "family_of",
    "target_card",
]


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
        DeviceFamily("ampere", 80, 500 * _MIB, _PRE_HOPPER_WORKSPACE, "A100, A30"),
        DeviceFamily(
            "ampere-sm86", 86, 500 * _MIB, _PRE_HOPPER_WORKSPACE, "A10, A40, RTX 3090, RTX A6000"
        ),
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


def _card_key(name: str) -> str:
    return "".join(c for c in name.lower() if c.isalnum())


_CARDS: dict[str, DeviceFamily] = {
    _card_key(card): f for f in DEVICE_FAMILIES.values() for card in f.examples.split(", ")
}
"""A card named in a family's examples (``H100``, ``rtx 4090``) -> its family."""


def family_of(device: str | DeviceFamily) -> DeviceFamily:
    """The family named ``device`` (any case), or the family of a card it names (``"H100"``:
    hopper), or ``device`` itself when it is one."""
    if isinstance(device, DeviceFamily):
        return device
    family = DEVICE_FAMILIES.get(device.lower()) or _CARDS.get(_card_key(device))
    if family is None:
        cards = "; ".join(f"{f.name} ({f.examples})" for f in DEVICE_FAMILIES.values())
        raise ConfigError(
            f"unknown device family {device!r}; expected a family or one of its cards: {cards}"
        )
    return family


@dataclass(frozen=True)
class TargetCard:
    """The card an estimate is for: its family, memory, CUDA context and cuBLAS workspace.

    Attributes:
        family: the GPU family.
        total: the card's memory.
        context_bytes: the CUDA context's size.
        context_given: the context was given (``--context``), not the family's default.
        workspace_bytes: one cuBLAS workspace.
    """

    family: DeviceFamily
    total: int
    context_bytes: int
    context_given: bool
    workspace_bytes: int

    @property
    def usable(self) -> int:
        """What the caching allocator may reserve: the card minus the CUDA context."""
        return self.total - self.context_bytes


def target_card(
    device: str | DeviceFamily,
    device_memory: int | str,
    context: int | str | None,
    workspace: int | str | None,
) -> TargetCard:
    """The card of :func:`memkit.estimation.estimate`'s arguments (family defaults filled in).

    Raises:
        ConfigError: an unknown family, a card no larger than its CUDA context, or a context
            below 1 MiB but not 0 (a size given without its unit).
    """
    family = family_of(device)
    total = parse_size(device_memory)
    context_bytes = family.context_bytes if context is None else parse_size(context)
    if 0 < context_bytes < _MIB:
        raise ConfigError(
            f"a CUDA context of {format_size(context_bytes)} ({context!r}) is surely a unit "
            "mistake: contexts take hundreds of MiB, and a size without a unit is bytes; give "
            "one, e.g. 500MiB (0 for none)"
        )
    if total <= context_bytes:
        raise ConfigError(
            f"device memory {format_size(total)} is not larger than the CUDA context "
            f"({format_size(context_bytes)}); give the card's total memory, e.g. 24GiB"
        )
    workspace_bytes = family.cublas_workspace_bytes if workspace is None else parse_size(workspace)
    return TargetCard(family, total, context_bytes, context is not None, workspace_bytes)
