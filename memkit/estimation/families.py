"""The GPU families ``memkit estimate`` knows (CUDA context, cuBLAS workspace, compute
capability) and the target card an estimate is for.

Torch-free: the families can be listed without importing torch.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from memkit.cublas import HOPPER_WORKSPACE, PRE_HOPPER_WORKSPACE
from memkit.errors import ConfigError
from memkit.units import format_size, parse_budget, parse_size

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
        cards: cards of the family (``--arch`` takes their names too); the first few are
            its :attr:`examples`.
    """

    name: str
    sm: int
    context_bytes: int
    cublas_workspace_bytes: int
    cards: tuple[str, ...]

    @property
    def examples(self) -> str:
        """The family's best-known cards, for reports."""
        return ", ".join(self.cards[:4])


_MIB = 1 << 20

DEVICE_FAMILIES: dict[str, DeviceFamily] = {
    f.name: f
    for f in (
        DeviceFamily("volta", 70, 400 * _MIB, PRE_HOPPER_WORKSPACE, ("V100", "Titan V")),
        DeviceFamily(
            "turing",
            75,
            400 * _MIB,
            PRE_HOPPER_WORKSPACE,
            (
                "T4",
                "RTX 2080",
                "RTX 2080 Ti",
                "RTX 2070",
                "RTX 2060",
                "Titan RTX",
                "Quadro RTX 8000",
                "Quadro RTX 6000",
            ),
        ),
        DeviceFamily("ampere", 80, 500 * _MIB, PRE_HOPPER_WORKSPACE, ("A100", "A30", "A800")),
        DeviceFamily(
            "ampere-sm86",
            86,
            500 * _MIB,
            PRE_HOPPER_WORKSPACE,
            (
                "A10",
                "A40",
                "RTX 3090",
                "RTX A6000",
                "A10G",
                "A16",
                "A2",
                "RTX 3080",
                "RTX 3070",
                "RTX 3060",
                "RTX 3050",
                "RTX A5000",
                "RTX A4000",
                "A6000",
                "A5000",
                "A4000",
                "A2000",
                "A1000",
                "RTX A2000",
                "RTX A1000",
            ),
        ),
        DeviceFamily(
            "ada",
            89,
            500 * _MIB,
            PRE_HOPPER_WORKSPACE,
            (
                "L4",
                "L40S",
                "RTX 4090",
                "L40",
                "RTX 4080",
                "RTX 4070",
                "RTX 4060",
                "RTX 6000 Ada",
                "L20",
            ),
        ),
        DeviceFamily(
            "hopper", 90, 600 * _MIB, HOPPER_WORKSPACE, ("H100", "H200", "GH200", "H800", "H20")
        ),
        DeviceFamily("blackwell", 100, 700 * _MIB, HOPPER_WORKSPACE, ("B200", "GB200", "B100")),
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
    key = "".join(c for c in name.lower() if c.isalnum())
    for prefix in ("nvidia", "geforce", "tesla"):
        key = key.removeprefix(prefix)
    return key


_CARDS: list[tuple[str, DeviceFamily]] = sorted(
    ((_card_key(card), f) for f in DEVICE_FAMILIES.values() for card in f.cards),
    key=lambda item: -len(item[0]),
)
"""(card key, family), longest first: a card name is matched by its longest known prefix."""


def _card_family(name: str) -> DeviceFamily | None:
    """The family of a card named as people and ``torch.cuda.get_device_name()`` write it
    (``"H100"``, ``"rtx 4090"``, ``"NVIDIA A100-SXM4-80GB"``, ``"NVIDIA H100 80GB HBM3"``):
    its longest known prefix, where the name does not go on with a digit (``"A1000"`` is no
    A100; ``"H100 80GB"`` is one)."""
    words = "".join(c if c.isalnum() else " " for c in name.lower()).split()
    while words and words[0] in ("nvidia", "geforce", "tesla"):
        words = words[1:]
    key = "".join(words)
    breaks = set(itertools.accumulate(map(len, words)))  # where a word of the name ends
    return next(
        (
            family
            for card, family in _CARDS
            if key.startswith(card)
            and (len(card) in breaks or not key[len(card) : len(card) + 1].isdigit())
        ),
        None,
    )


def family_of(device: str | DeviceFamily) -> DeviceFamily:
    """The family named ``device`` (any case), or the family of a card it names (``"H100"``:
    hopper), or ``device`` itself when it is one."""
    if isinstance(device, DeviceFamily):
        return device
    family = DEVICE_FAMILIES.get(device.lower()) or _card_family(device)
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
    total = parse_budget(device_memory, "device_memory")  # (16: a GiB count without its unit)
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
