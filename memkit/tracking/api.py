"""``memkit.track``: the entry point that creates a :class:`~memkit.tracking.tracker.Tracker`.

Its parameters are :class:`Tracker`'s, one for one (tests/test_track.py compares the two
signatures, so that neither can drop or add one alone).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch

from memkit.simulated.history import DEFAULT_MAX_ENTRIES
from memkit.simulated.virtual_devices import VirtualDevices
from memkit.tracking.rank_gather import GATHER_TIMEOUT
from memkit.tracking.records import DEFAULT_TIMELINE_LIMIT
from memkit.tracking.tracker import Tracker

__all__ = ["track"]


def track(
    model: torch.nn.Module | None = None,
    optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer] | None = None,
    *,
    device: str | torch.device | VirtualDevices | None = None,
    budget: int | str | None = None,
    per_module: bool = True,
    module_every: int | None = None,
    postmortem: str | None = "stderr",
    timeline_limit: int = DEFAULT_TIMELINE_LIMIT,
    leak_warmup: int = 2,
    leak_window: int = 3,
    gather_timeout: float = GATHER_TIMEOUT,
    memory_history: str | Path | None = None,
    history_entries: int = DEFAULT_MAX_ENTRIES,
) -> Tracker:
    """Track memory per device, phase, step and module while the ``with`` block runs.

    Under a ``torch.distributed`` process group every rank tracks its own device, and when
    the block ends (or when the script calls ``destroy_process_group()``) each rank's summary
    is gathered to rank 0, whose ``report().ranks`` holds the per-rank table, the imbalance,
    the rank closest to its capacity and the DDP advice (docs/distributed.md). All ranks must
    run the block; a rank missing for ``gather_timeout`` seconds leaves a note, not a hang.

    Args:
        model: the model to hook, or ``None`` for every module (global hooks).
        optimizer: the optimizer(s) whose steps count as step boundaries, or ``None`` for any.
        device: ``"cuda:0"``..., ``"cpu"`` (the simulated device), a ``VirtualDevices``
            (``memkit.simulate(budget, devices=N)``: one row per virtual device), or ``None``:
            the enclosing ``simulate(devices=N)`` block's devices, else the current accelerator,
            else the simulated cpu device.
        budget: size of the simulated device (``"300MiB"``): the block raises
            ``torch.OutOfMemoryError`` when it is crossed, as a GPU of that size would.
        per_module: module detail (default), or hooks on the model only (least overhead).
        module_every: module hooks on steps 0 and 1 and then every ``module_every``-th step
            (steps and phases are exact on every step); ``1``: every step. Default: every step
            on the simulated device, 100 on an accelerator (docs/track.md, "What it costs").
        postmortem: ``"stderr"`` (default) prints the diagnosis of an OOM that leaves the block;
            ``None`` only logs it. The exception propagates unchanged either way.
        timeline_limit: counter readings kept per device.
        leak_warmup: step boundaries the leak detector ignores at the start (gradients and
            optimizer state appear).
        leak_window: rises from step to step (without a fall in between) that make a leak.
        gather_timeout: seconds to wait for the other ranks' summaries at the end.
        memory_history: write PyTorch's memory snapshot (``_dump_snapshot``'s format, pickle
            protocol 4) to this file when the block ends, also after an OOM; it opens at
            https://pytorch.org/memory_viz and in ``memkit inspect``. On CUDA PyTorch records it
            (python stacks, the last ``history_entries`` events); on the simulated device memkit
            does. Under torchrun each rank writes ``NAME.rankN.EXT``.
        history_entries: events the memory history keeps (the most recent).

    Examples:
        >>> import torch, memkit
        >>> model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(),
        ...                             torch.nn.Linear(256, 10))
        >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> with memkit.track(model, opt, device="cpu", budget="64MiB") as tracker:
        ...     for _ in range(3):
        ...         model(torch.randn(32, 64)).sum().backward()
        ...         opt.step(); opt.zero_grad()
        >>> report = tracker.report()
        >>> report.steps, report.devices[0].phase_peaks["backward"] is not None
        (3, True)
    """
    return Tracker(
        model,
        optimizer,
        device=device,
        budget=budget,
        per_module=per_module,
        module_every=module_every,
        postmortem=postmortem,
        timeline_limit=timeline_limit,
        leak_warmup=leak_warmup,
        leak_window=leak_window,
        gather_timeout=gather_timeout,
        memory_history=memory_history,
        history_entries=history_entries,
    )
