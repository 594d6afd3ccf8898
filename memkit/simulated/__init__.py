"""The simulated device: memkit's stand-in for a GPU on any machine, by counting tensor bytes.

A CPU has no memory budget to run out of and no caching allocator to read. memkit makes one:

* :mod:`~memkit.simulated.accountant`: :class:`MemoryAccountant`, a ``TorchDispatchMode`` that
  counts the bytes of every live tensor storage made on the device, keeps the peak, and raises
  ``torch.OutOfMemoryError`` when an op would pass the budget (:func:`simulate`);
* :mod:`~memkit.simulated.allocator`: PyTorch's CUDA caching allocator as a model (block
  rounding, segments, splitting): what the stand-in and the estimate report as reserved memory;
* :mod:`~memkit.simulated.virtual_devices`: several devices at once (``simulate(devices=N)``),
  a device tag per storage, PyTorch's placement errors;
* :mod:`~memkit.simulated.parallel`: ``nn.DataParallel`` (scatter, replicate, gather,
  reduce-add) and DDP replicas with their gradient buckets on virtual devices;
* :mod:`~memkit.simulated.fsdp`: FSDP2's shards, all-gathers and reduce-scatters per rank;
* :mod:`~memkit.simulated.storage_resizes`: real FSDP2's storage resizes (its frees of
  unsharded parameters) made visible to the count;
* :mod:`~memkit.simulated.history`: PyTorch's memory-snapshot format, recorded from the
  accountant so a trace taken without a GPU opens in memory_viz.

:class:`memkit.devices.SimulatedBackend` and the CUDA stand-in (:mod:`memkit.devices.cuda_standin`)
put this behind the same interface as a real device. Nothing here imports anything of memkit but
:mod:`memkit.units` and :mod:`memkit.errors`.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from memkit.errors import ConfigError, found
from memkit.simulated.accountant import MemoryAccountant, tensors_of
from memkit.simulated.virtual_devices import VirtualDevices
from memkit.units import parse_budget

__all__ = ["MemoryAccountant", "VirtualDevices", "simulate"]


def simulate(
    budget: int | str | list[int | str | None] | tuple[int | str | None, ...] | None,
    device: str | torch.device = "cpu",
    *,
    track: Any = None,
    rounding: str = "none",
    devices: int | None = None,
) -> MemoryAccountant:
    """A device of ``budget`` bytes for the ``with`` block: ``with simulate("512MiB") as acct:``.

    Tensors created on ``device`` inside the block are counted; crossing the budget raises
    ``torch.OutOfMemoryError`` from the op that crossed it, so OOM handling can be tested on a
    laptop. ``track`` names objects that already exist (a model, an optimizer, or a tuple of them)
    whose memory counts from the start.

    Args:
        budget: bytes or a size string (``"512MiB"``); ``None`` counts without a limit.
        device: ``"cpu"`` (real compute) or ``"meta"`` (shapes only, no compute).
        track: a model, optimizer, tensor, or a tuple/list of them.
        rounding: ``"none"`` or ``"cuda"`` (count like the CUDA caching allocator).
        devices: stand for this many accelerators, ``budget`` each (or give ``budget`` as a
            list, one per device): returns a
            :class:`memkit.simulated.virtual_devices.VirtualDevices` whose tensors live on
            ``cuda:0`` ... ``cuda:N-1`` (docs/simulated-device.md); ``track`` objects go on
            ``cuda:0``.

    Examples:
        >>> import torch, memkit
        >>> with memkit.simulate("1MiB") as acct:
        ...     try:
        ...         torch.empty(1024, 1024)  # 4 MiB
        ...     except torch.OutOfMemoryError:
        ...         print("out of memory")
        out of memory
    """
    for each in budget if isinstance(budget, (list, tuple)) else [budget]:
        if each is not None:
            parse_budget(each)
    if track is not None:
        if not isinstance(track, (list, tuple)) and isinstance(track, Iterator):
            track = list(track)  # model.parameters()
        _check_trackable(track)
    if devices is not None or isinstance(budget, (list, tuple)):
        if isinstance(budget, (list, tuple)):
            if devices is not None and devices != len(budget):
                raise ValueError(f"devices={devices} but {len(budget)} budgets were given")
            budgets = list(budget)
        else:
            if devices is None or devices < 1:
                raise ValueError(f"devices must be at least 1, found {devices}")
            budgets = [budget] * devices
        virtual = VirtualDevices(budgets, device, rounding=rounding)
        if track is not None:
            virtual.track(track)
        return virtual
    accountant = MemoryAccountant(device, budget, rounding=rounding)
    if track is not None:
        accountant.track(track)
    return accountant


def _check_trackable(track: Any) -> None:
    """``track`` is a model, an optimizer, a tensor, or a tuple/list of them (``None`` items
    skipped; or an object holding tensors: a model's output); anything else would silently
    count nothing.

    Raises:
        ConfigError: naming what was found and what to pass.
    """
    for item in track if isinstance(track, (list, tuple)) else (track,):
        if item is None or isinstance(
            item, (torch.Tensor, torch.nn.Module, torch.optim.Optimizer)
        ):  # (None: an optional optimizer not made)
            continue
        if isinstance(item, (str, bytes, int, float, bool)) or next(tensors_of(item), None) is None:
            raise ConfigError(
                f"track: expected a model, an optimizer, a tensor, or a tuple/list of them, "
                f"found {found(item)}, which holds no torch tensor: pass the objects themselves "
                "(a NumPy array: torch.from_numpy(array))"
            )
