"""Process and thread state held by torch and the accelerator runtime: RNG states, the current
device, whether CUDA is initialised, and where a collective's tensors must live."""

from __future__ import annotations

import logging
import sys
from typing import Any

import torch

log = logging.getLogger(__name__)

cuda_standin: Any = None
"""The active CUDA stand-in (:mod:`memkit.devices.cuda_standin`), or ``None``: while one is
active, :func:`tensor_device` and the cached-block functions of :mod:`memkit.devices.peaks`
answer from it (its device tensors are cpu tensors)."""


def current_accelerator() -> torch.device | None:
    """The current device of the accelerator torch sees (``torch.accelerator``), or ``None``."""
    acc = getattr(torch, "accelerator", None)
    if acc is not None and acc.is_available():
        dev = acc.current_accelerator()
        return None if dev is None else torch.device(dev.type, acc.current_device_index())
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return None


def rng_state() -> dict[str, Any]:
    """Every RNG state a training step can advance: Python, NumPy (if imported), torch CPU and
    each initialised accelerator."""
    import random

    state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        state["numpy"] = numpy.random.get_state()
    if torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    """Put back what :func:`rng_state` saved."""
    import random

    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "numpy" in state:
        sys.modules["numpy"].random.set_state(state["numpy"])
    if "cuda" in state:
        torch.cuda.set_rng_state_all(state["cuda"])


def tensor_device(tensor: torch.Tensor) -> torch.device:
    """The device memkit takes ``tensor`` to live on: ``tensor.device``, or what the active
    CUDA stand-in says (``cuda:0`` for its device tensors, which are cpu tensors)."""
    if cuda_standin is not None:
        return cuda_standin.tensor_device(tensor)
    return tensor.device


def collective_device(pg_backend: str) -> torch.device:
    """Where a small tensor for a ``torch.distributed`` collective must live for ``pg_backend``.

    ``"gloo"`` (and ``"mpi"``, and mixed ``"cpu:gloo,cuda:nccl"`` strings, which accept cpu
    tensors) gets ``cpu``; ``"nccl"`` the current cuda device; any other backend (``"xccl"``,
    ``"hccl"``...) the current accelerator, or ``cpu`` when there is none.
    """
    name = pg_backend.lower()
    if "gloo" in name or name == "mpi":
        return torch.device("cpu")
    if name == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return current_accelerator() or torch.device("cpu")


def current_device_index(device_type: str) -> int:
    """The current device index of this thread for an accelerator type (``"cuda"``, ``"xpu"``).

    ``nn.DataParallel`` sets it in each replica thread, so a hook can tell which device it runs
    for without looking at tensors. Returns 0 when the type is not initialised or unknown.
    """
    try:
        if device_type == "cuda":
            return int(torch.cuda.current_device()) if torch.cuda.is_initialized() else 0
        acc = getattr(torch, "accelerator", None)
        if acc is not None and acc.is_available():
            return int(acc.current_device_index())
    except (RuntimeError, AssertionError) as exc:  # pragma: no cover - driver specific
        log.debug("no current %s device: %s", device_type, exc)
    return 0


def set_current_device(device: torch.device) -> None:
    """Make ``device`` this process's current accelerator device (before creating an NCCL
    group, or every rank lands on GPU 0). A no-op for devices without a current index."""
    if device.type == "cuda" and torch.cuda.is_available():
        torch.cuda.set_device(device.index if device.index is not None else 0)


def cuda_context_reading() -> tuple[bool, int | None]:
    """``(CUDA initialised in this process, current CUDA device)``, without initialising CUDA."""
    initialized = bool(torch.cuda.is_available() and torch.cuda.is_initialized())
    return initialized, (torch.cuda.current_device() if initialized else None)
