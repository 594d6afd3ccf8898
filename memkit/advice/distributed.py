"""Advice rules for DDP runs: functions of per-rank readings that return :class:`Advice`.

Pure functions (no torch, no collectives): the readings are gathered to rank 0 by
:mod:`memkit.tracking.rank_gather`, and tests construct them directly.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from memkit.advice import CUDA_CONTEXT_BYTES, Advice
from memkit.units import format_size

__all__ = ["ContextReading", "ddp_gpu0_context", "ddp_unused_parameters"]


def _modules(names: Sequence[str]) -> list[str]:
    """``"module.head.weight"`` -> ``"head"``: the modules owning the parameters, in order."""
    out: list[str] = []
    for name in names:
        parts = name.split(".")
        if parts and parts[0] == "module":  # DDP's wrapper prefix
            parts = parts[1:]
        owner = ".".join(parts[:-1]) or "(the model itself)"
        if owner not in out:
            out.append(owner)
    return out


def ddp_unused_parameters(
    unused_by_rank: Mapping[int, Sequence[str]],
    *,
    unused_bytes: int | None = None,
    find_unused_parameters: bool | None = None,
) -> Advice | None:
    """``ddp-unused-parameters``: trainable parameters that got no gradient in a DDP step.

    Args:
        unused_by_rank: per rank, the names of trainable parameters whose ``.grad`` was
            ``None`` at an optimizer step.
        unused_bytes: their size, if known (memory that trains nothing, plus its bucket share).
        find_unused_parameters: the DDP model's setting, if known.

    Examples:
        >>> ddp_unused_parameters({0: [], 1: []}) is None
        True
        >>> ddp_unused_parameters({0: ["module.aux.weight"], 1: ["module.aux.weight"]}).code
        'ddp-unused-parameters'
    """
    names = sorted({n for names in unused_by_rank.values() for n in names})
    if not names:
        return None
    ranks = sorted(r for r, n in unused_by_rank.items() if n)
    modules = _modules(names)
    shown = ", ".join(modules[:8]) + (f" and {len(modules) - 8} more" if len(modules) > 8 else "")
    size = f" ({format_size(unused_bytes)})" if unused_bytes else ""
    if find_unused_parameters:
        cost = (
            "find_unused_parameters=True is on: DDP walks the autograd graph after every "
            "forward to find them, which costs time on every step."
        )
    else:
        cost = (
            "Without find_unused_parameters=True, DDP waits for their gradients and fails on "
            "the next step ('Expected to have finished reduction in the prior iteration'); "
            "with it, DDP walks the autograd graph after every forward, which costs time."
        )
    return Advice(
        code="ddp-unused-parameters",
        title=f"{len(names)} parameter(s) get no gradient under DDP",
        evidence=(
            f"At an optimizer step, {len(names)} trainable parameter(s){size} had no gradient "
            f"(on rank(s) {', '.join(map(str, ranks))}); they belong to: {shown}. {cost}"
        ),
        action=(
            "Remove the modules that do not take part in the loss, or freeze them "
            "(requires_grad_(False)) so DDP does not wait for them; only if they are used on "
            "some steps and not others, keep find_unused_parameters=True and accept its cost."
        ),
        saving_bytes=unused_bytes,
        severity="warning",
    )


@dataclass(frozen=True)
class ContextReading:
    """One rank's CUDA context reading.

    Attributes:
        rank: global rank.
        local_rank: ``LOCAL_RANK`` (the GPU it should use on its node).
        cuda_initialized: whether this process initialised CUDA.
        current_device: the current CUDA device index (``torch.cuda.current_device()``).
        node: a host name, so ranks on different nodes are not mixed up.
    """

    rank: int
    local_rank: int
    cuda_initialized: bool
    current_device: int | None
    node: str = ""


def ddp_gpu0_context(readings: Sequence[ContextReading]) -> Advice | None:
    """``ddp-gpu0-context``: several ranks of a node made GPU 0 current (a context each there).

    Fires when, on one node, at least two ranks initialised CUDA with device 0 current while
    their ``LOCAL_RANK`` differs: the ranks other than local rank 0 forgot
    ``torch.cuda.set_device(local_rank)``, so each created a CUDA context (and often tensors)
    on GPU 0, which runs out of memory first.

    Examples:
        >>> ok = [ContextReading(0, 0, True, 0), ContextReading(1, 1, True, 1)]
        >>> ddp_gpu0_context(ok) is None
        True
        >>> bad = [ContextReading(0, 0, True, 0), ContextReading(1, 1, True, 0)]
        >>> ddp_gpu0_context(bad).code
        'ddp-gpu0-context'
    """
    by_node: dict[str, list[ContextReading]] = {}
    for reading in readings:
        if reading.cuda_initialized and reading.current_device == 0:
            by_node.setdefault(reading.node, []).append(reading)
    wrong = [r for group in by_node.values() if len(group) >= 2 for r in group if r.local_rank != 0]
    if not wrong:
        return None
    ranks = ", ".join(str(r.rank) for r in wrong)
    extra = len(wrong) * CUDA_CONTEXT_BYTES
    return Advice(
        code="ddp-gpu0-context",
        title=f"{len(wrong) + 1} ranks use GPU 0: torch.cuda.set_device(local_rank) is missing",
        evidence=(
            f"Rank(s) {ranks} have LOCAL_RANK other than 0 but GPU 0 as their current device, "
            "so each created a CUDA context (about 300-600 MiB) on GPU 0, and any tensor made "
            "with device='cuda' lands there too: GPU 0 runs out of memory first."
        ),
        action=(
            "At the start of every rank, before any CUDA call: local_rank = "
            "int(os.environ['LOCAL_RANK']); torch.cuda.set_device(local_rank); then create "
            "tensors on f'cuda:{local_rank}' and wrap with DDP(model, device_ids=[local_rank])."
        ),
        saving_bytes=extra,
        severity="critical",
    )
