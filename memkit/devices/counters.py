"""Cheap counter readers for hooks that run once per module call (:mod:`memkit.tracking`)."""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any, Protocol

import torch

from memkit.devices.backends import CudaBackend, SimulatedBackend, VirtualDeviceBackend
from memkit.devices.peaks import UserPeaks

log = logging.getLogger(__name__)


class CounterReader(Protocol):
    """``() -> (allocated, reserved, peak_allocated, peak_reserved)`` of one device, in bytes."""

    def __call__(self) -> tuple[int, int, int, int]: ...


class PeakResetter(Protocol):
    """``() -> None``: reset a device's peak counters to their current values."""

    def __call__(self) -> None: ...


_FAST_STATS: set[Any] = set()
"""The kinds of ``_cuda_memoryStats`` function (:func:`_function_kind`) whose nested dict was
read as :func:`counter_reader` reads it (torch's, or a stand-in's)."""


def _function_kind(fn: Any) -> tuple[Any, Any]:
    """``fn``'s class of owner and function: the same for every stand-in's bound method, and
    holding no instance."""
    return type(getattr(fn, "__self__", None)), getattr(fn, "__func__", fn)


def counter_reader(
    backend: Any, peaks: UserPeaks | None = None
) -> tuple[CounterReader, PeakResetter]:
    """A fast ``(read, reset_peak)`` pair for hooks that run once per module call.

    ``read()`` returns ``(allocated, reserved, peak_allocated, peak_reserved)`` in one call;
    ``reset_peak()`` resets both peaks. On CUDA, ``read`` calls ``torch._C._cuda_memoryStats``
    once (the public ``torch.cuda.memory_allocated`` builds and sorts a flat dict of every
    statistic per call, several times slower) and returns zeros while CUDA is not initialised.
    Neither function synchronises, allocates device memory or spawns a process. With
    ``peaks`` (CUDA), ``reset_peak`` first folds the peaks read last into the user's view and
    the other running blocks' readings, and ``read`` reports at least what other resets took
    since this block's last one (:mod:`memkit.devices.peaks`): callers read, then reset.
    """
    if isinstance(backend, SimulatedBackend):
        acct = backend.accountant
        sim_counters = acct.counters

        def read_sim() -> tuple[int, int, int, int]:
            cur, peak = sim_counters()
            return cur, cur, peak, peak

        return read_sim, acct.reset_peak
    if isinstance(backend, VirtualDeviceBackend):
        vd, i = backend.devices, backend.index
        window_counters = vd.window_counters

        def read_virtual() -> tuple[int, int, int, int]:
            cur, peak = window_counters(i)
            return cur, cur, peak, peak

        return read_virtual, functools.partial(vd.reset_window, i)
    if isinstance(backend, CudaBackend) and backend.device.type == "cuda":
        index = backend.index
        stats = getattr(torch._C, "_cuda_memoryStats", None)
        reset = getattr(torch._C, "_cuda_resetPeakMemoryStats", None)
        is_initialized = torch.cuda.is_initialized
        if stats is not None and reset is not None:
            last = [0, 0]  # the real peaks read last, for ``peaks``
            carry = None if peaks is None else peaks.carry  # what other resets took
            ready = [False]  # CUDA initialised (asked until it is: it stays so)

            def initialized() -> bool:
                if not ready[0]:
                    ready[0] = is_initialized()
                return ready[0]

            def read_cuda() -> tuple[int, int, int, int]:
                if not ready[0] and not initialized():
                    return 0, 0, 0, 0
                s = stats(index)
                a, r = s["allocated_bytes"]["all"], s["reserved_bytes"]["all"]
                p, pr = last[0], last[1] = a["peak"], r["peak"]
                if carry is not None and carry[0]:
                    p, pr = max(p, carry[0]), max(pr, carry[1])
                return a["current"], r["current"], p, pr

            resetting = None if peaks is None else peaks.resetting

            def reset_cuda() -> None:
                if ready[0] or initialized():
                    if resetting is not None:
                        resetting(last[0], last[1])
                    reset(index)

            kind = _function_kind(stats)
            if kind in _FAST_STATS:  # checked once per kind of counter function (a read each)
                return read_cuda, reset_cuda
            try:
                read_cuda()
            except (KeyError, TypeError, RuntimeError) as exc:  # pragma: no cover - torch drift
                log.debug("fast CUDA counters unavailable (%s); using memory_stats", exc)
            else:
                if initialized():
                    _FAST_STATS.add(kind)
                return read_cuda, reset_cuda

    def read_generic() -> tuple[int, int, int, int]:
        return (
            backend.allocated(),
            backend.reserved(),
            backend.peak_allocated(),
            backend.peak_reserved(),
        )

    return read_generic, backend.reset_peak


def peak_taker(read: CounterReader, reset: PeakResetter) -> CounterReader:
    """``take()``: ``read()`` and, where a peak is above its current value, ``reset()`` (a
    segment's end: its peaks read, the next one's started; a peak equal to the current bytes
    is already where a reset would put it, one counter call saved)."""

    def take() -> tuple[int, int, int, int]:
        a, r, p, pr = read()
        if p > a or pr > r:
            reset()
        return a, r, p, pr

    return take


def requested_reader(backend: Any) -> Callable[[], int]:
    """``() -> int``: the bytes live tensors asked for. On CUDA the caching allocator's
    ``requested_bytes``: unlike what is allocated, it does not move with the cached block that
    served a request (a large block is not split for less than 1 MiB, so the same tensor kept
    from one step to the next counts up to 1 MiB more or less); elsewhere what is allocated."""
    stats = getattr(torch._C, "_cuda_memoryStats", None)
    if isinstance(backend, CudaBackend) and backend.device.type == "cuda" and stats is not None:
        index = backend.index

        def read_requested() -> int:
            if not torch.cuda.is_initialized():
                return 0
            nested = stats(index)  # (the nested dict: no flattening, as counter_reader reads)
            pool = nested.get("requested_bytes") or nested["allocated_bytes"]
            return int(pool["all"]["current"])

        return read_requested
    read = counter_reader(backend)[0]
    return lambda: read()[0]
