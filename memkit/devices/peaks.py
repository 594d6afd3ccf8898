"""The user's peak counters, kept true while memkit resets them.

memkit's hooks read a CUDA device's peak counters and reset them at every phase boundary: that
is how each phase, step and module gets its own exact peak. Without care the user's own reads
(``torch.cuda.max_memory_allocated()``, ``memory_stats()``: Lightning's ``DeviceStatsMonitor``,
transformers' memory metrics, a script's own logging) would then see only the time since
memkit's last reset. :class:`UserPeaks` keeps what the user would read:

* every peak memkit reads just before it resets is folded into the user's view (memkit's
  resets go through :meth:`UserPeaks.resetting`); with blocks nested (or in two threads) on
  one device, each block's reset is also carried into the others' readings
  (:attr:`UserPeaks.carry`), and so is a reset of the user's;
* during the block, torch's Python functions that read the counters (``memory_stats`` and
  everything built on it, ``torch.accelerator.memory_stats``) answer the larger of the real
  counter and that view, and ``reset_peak_memory_stats`` resets the view too: the user's own
  resets keep their meaning;
* when the block ends (after a budget's cap is lifted), the real allocated peak counter is
  raised back to the view by briefly allocating from the caching allocator's free cached blocks
  (:func:`plan_pieces`: no new device memory, no synchronisation); when the cache no longer
  holds enough (the budget's cap, an out-of-memory error and the user's ``empty_cache`` all give
  cached memory back to the driver), by one fresh allocation that is given back at once (a
  ``cudaMalloc``/``cudaFree`` pair). The reserved peak is the current reserved bytes unless
  memory was given back to the driver, which no allocation can undo without holding it:
  :attr:`UserPeaks.shortfall` says so, and the tracker's report carries it as a note.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from typing import Any

import torch

from memkit.devices import state
from memkit.patching import Restore
from memkit.units import format_size

log = logging.getLogger(__name__)

__all__ = ["SMALL_REQUEST", "UserPeaks", "cached_free_blocks", "empty_on", "plan_pieces"]

SMALL_REQUEST = 1 << 20
"""Requests up to 1 MiB come from the caching allocator's small pool (kSmallSize)."""

_ALLOC, _RES = "allocated_bytes", "reserved_bytes"


def plan_pieces(free_blocks: list[tuple[int, bool]], need: int) -> list[int]:
    """Sizes of allocations that together take ``need`` bytes from cached free blocks.

    ``free_blocks``: ``(size, small_pool)`` of each inactive block on the stream. A request
    of more than 1 MiB is served from the large pool, one of at most 1 MiB from the small pool;
    asking for a free block's own size (largest first) always finds a block, so nothing new is
    reserved. A remainder no block of its pool can serve is taken as a larger request from a
    large block (the peak then rises a little past the target, never short of it).
    """
    large = sorted((s for s, small in free_blocks if not small and s > SMALL_REQUEST), reverse=True)
    small = sorted((s for s, small in free_blocks if small), reverse=True)
    pieces: list[int] = []
    spare: list[int] = []  # large free blocks (or what a split leaves) not taken
    left = need
    for size in large:
        if left <= SMALL_REQUEST:
            spare.append(size)
            continue
        take = min(size, left)
        pieces.append(take)
        left -= take
        if size - take > SMALL_REQUEST:
            spare.append(size - take)
    for size in small:
        if left <= 0:
            break
        take = min(size, left)
        pieces.append(take)
        left -= take
    if 0 < left <= SMALL_REQUEST and any(s > SMALL_REQUEST + 512 for s in spare):
        pieces.append(SMALL_REQUEST + 512)  # served from the large pool, not a new segment
        left = 0
    return pieces if left <= 0 else []


_ACTIVE: dict[int, list[UserPeaks]] = {}
"""The :class:`UserPeaks` of the blocks running now, per CUDA device: nested blocks (or blocks
in two threads) reset the same counters, so each reset is carried into the others' readings."""


class UserPeaks:
    """The peaks a user of one CUDA device would read had memkit never reset them; and, for
    the block's own readings, the peaks other resets took away since the block's last reset.

    Args:
        index: the CUDA device.
        read: reads the real counters (``(allocated, reserved, peak, peak_reserved)``).

    Attributes:
        allocated, reserved: the user's view of the peaks.
        carry: ``[peak, peak_reserved]`` that another block's reset (or the user's) took from
            the counters since this block's last reset; the block's reader reports at least it.
        shortfall: why the real counters could not be put back after the block, if they could
            not.
    """

    def __init__(self, index: int, read: Callable[[], tuple[int, int, int, int]]) -> None:
        self.index = index
        self._read = read
        _, _, p, pr = read()
        self.allocated = p  # the user's view: peaks since their last reset
        self.reserved = pr
        self.carry = [0, 0]
        self.shortfall: str | None = None
        self.live = False  # its patches answer the user's view (between install and exit)

    def fold(self, peak: int, peak_reserved: int) -> None:
        """Raise the user's view to these peaks."""
        if peak > self.allocated:
            self.allocated = peak
        if peak_reserved > self.reserved:
            self.reserved = peak_reserved

    def resetting(self, peak: int, peak_reserved: int) -> None:
        """This block read these real peaks and is about to reset the counters: every running
        block's user view keeps them, and the other blocks' readings carry them."""
        if peak > self.allocated:  # (fold, inline: once per segment of every step)
            self.allocated = peak
        if peak_reserved > self.reserved:
            self.reserved = peak_reserved
        running = _ACTIVE.get(self.index)
        if running and (len(running) > 1 or running[0] is not self):  # other blocks
            for other in running:
                if other is not self:
                    other.fold(peak, peak_reserved)
                    other._carry(peak, peak_reserved)
        carry = self.carry
        if carry[0] or carry[1]:
            carry[0] = carry[1] = 0

    def _carry(self, peak: int, peak_reserved: int) -> None:
        carry = self.carry
        if peak > carry[0]:
            carry[0] = peak
        if peak_reserved > carry[1]:
            carry[1] = peak_reserved

    def user_resetting(self) -> None:
        """The user is about to reset the counters: every running block's readings carry
        what the counters held."""
        _, _, p, pr = self._read()
        for block in _ACTIVE.get(self.index, [self]):
            block._carry(p, pr)

    def view(self, stats: dict[str, Any], flat: bool) -> dict[str, Any]:
        """``stats`` (nested as ``_cuda_memoryStats``, or flat as ``memory_stats``) with the
        user's peaks."""
        for key, mine in ((_ALLOC, self.allocated), (_RES, self.reserved)):
            if flat:
                name = f"{key}.all.peak"
                if name in stats and stats[name] < mine:
                    stats[name] = mine
            else:
                entry = stats.get(key, {}).get("all")
                if entry is not None and entry.get("peak", 0) < mine:
                    entry["peak"] = mine
        return stats

    def user_reset(self) -> None:
        """The user reset the peaks: their view starts again from now."""
        a, r, _, _ = self._read()
        self.allocated, self.reserved = a, r

    @contextlib.contextmanager
    def installed(self) -> Iterator[UserPeaks]:
        """Torch's counter functions answer the user's view for the block (the real counters
        are put back by :meth:`restore`, called once a budget's cap is lifted)."""
        handles = []
        for mod, name, fn in _patches(self):
            handles.append(Restore(mod, name, getattr(mod, name), fn))
            setattr(mod, name, fn)
        running = _ACTIVE.setdefault(self.index, [])
        running.append(self)
        self.live = True
        try:
            yield self
        finally:
            self.live = False  # a later block's patches may still call ours: we pass through
            running.remove(self)
            for handle in reversed(handles):
                handle.remove()

    def restore(self) -> None:
        """Raise the real counters to the user's view (after the block); never raises: what
        could not be put back is in :attr:`shortfall`."""
        try:
            self._restore()
        except Exception as exc:  # never the user's problem
            self.shortfall = f"memkit could not restore the peak counters ({exc})"
            log.debug("restoring the peak counters failed", exc_info=True)

    def _restore(self) -> None:
        running = _ACTIVE.get(self.index)
        if running:  # a block still runs on the device: it puts the counters back, ours too
            for block in running:
                block.fold(self.allocated, self.reserved)
            return
        a, _, p, _ = self._read()
        need = self.allocated - a
        if self.allocated > p and need > 0:
            pieces = plan_pieces(cached_free_blocks(self.index), need)
            if pieces:
                held = [empty_on(self.index, n) for n in pieces]
                del held
            elif free_on(self.index) > need:
                _allocate_uncapped(self.index, need)
            else:
                self.shortfall = (
                    f"after the block, torch.cuda.max_memory_allocated() reads {format_size(p)}, "
                    f"below the block's peak {format_size(self.allocated)}: the device has too "
                    "little free memory to raise it back"
                )
                return
        _, _, _, pr = self._read()
        if self.reserved > pr:
            self.shortfall = (
                f"after the block, torch.cuda.max_memory_reserved() reads {format_size(pr)}, "
                f"below the block's peak {format_size(self.reserved)}: cached memory was given "
                "back to the driver during the block (empty_cache, an out-of-memory error or a "
                "budget's cap), and raising the counter back would mean holding that memory"
            )


def cached_free_blocks(index: int) -> list[tuple[int, bool]]:
    """``(size, small_pool)`` of the caching allocator's free blocks on CUDA device ``index``
    for the current stream (``torch.cuda.memory_snapshot()``), or the CUDA stand-in's."""
    if state.cuda_standin is not None:
        return state.cuda_standin.cached_free_blocks(index)
    stream = torch.cuda.current_stream(index).cuda_stream
    out = []
    for seg in torch.cuda.memory_snapshot():
        if seg.get("device") != index or seg.get("stream", stream) != stream:
            continue
        small = seg.get("segment_type") == "small"
        out += [(b["size"], small) for b in seg.get("blocks", ()) if b["state"] == "inactive"]
    return out


def _allocate_uncapped(index: int, nbytes: int) -> None:
    """Allocate ``nbytes`` on CUDA device ``index`` past any ``set_per_process_memory_fraction``
    cap (the user's own cap may be below a peak they reached before setting it), then give the
    new segment back to the driver and put the cap back."""
    getter = getattr(torch.cuda, "get_per_process_memory_fraction", None)
    fraction = getter(index) if getter is not None else 1.0
    if fraction < 1.0:
        torch.cuda.set_per_process_memory_fraction(1.0, index)
    try:
        held = [empty_on(index, nbytes)]
        del held
    finally:
        if fraction < 1.0:
            torch.cuda.set_per_process_memory_fraction(fraction, index)
    torch.cuda.empty_cache()


def free_on(index: int) -> int:
    """Free device memory on CUDA device ``index`` as the driver reports it
    (``torch.cuda.mem_get_info``; the CUDA stand-in answers for its device)."""
    return int(torch.cuda.mem_get_info(index)[0])


def empty_on(index: int, nbytes: int) -> torch.Tensor:
    """An uninitialised tensor of ``nbytes`` on CUDA device ``index`` (no copy, no sync), or on
    the CUDA stand-in."""
    if state.cuda_standin is not None:
        return state.cuda_standin.empty_on(index, nbytes)
    return torch.empty(nbytes, dtype=torch.uint8, device=torch.device("cuda", index))


def _patches(peaks: UserPeaks) -> list[tuple[Any, str, Callable[..., Any]]]:
    """The counter functions of torch.cuda (and torch.accelerator) wrapped for ``peaks``."""
    import torch.cuda.memory as cuda_memory

    index = peaks.index
    out: list[tuple[Any, str, Callable[..., Any]]] = []

    def ours(device: Any) -> bool:
        try:
            return torch.cuda._get_device_index(device, optional=True) == index
        except (RuntimeError, ValueError, AssertionError):
            return False

    nested = cuda_memory.memory_stats_as_nested_dict
    reset = cuda_memory.reset_peak_memory_stats

    def memory_stats_as_nested_dict(device: Any = None) -> dict[str, Any]:
        stats = nested(device=device)
        return peaks.view(stats, flat=False) if stats and peaks.live and ours(device) else stats

    def reset_peak_memory_stats(device: Any = None) -> None:
        mine = peaks.live and ours(device)
        if mine:
            peaks.user_resetting()
        reset(device)
        if mine:
            peaks.user_reset()

    for mod in (cuda_memory, torch.cuda):
        out.append((mod, "memory_stats_as_nested_dict", memory_stats_as_nested_dict))
        out.append((mod, "reset_peak_memory_stats", reset_peak_memory_stats))
    acc: Any = getattr(torch, "accelerator", None)
    acc_memory: Any = getattr(acc, "memory", None)
    if acc_memory is not None and hasattr(acc_memory, "memory_stats"):
        flat_stats = acc_memory.memory_stats
        acc_reset = acc_memory.reset_peak_memory_stats

        def acc_memory_stats(device_index: Any = None, /) -> Any:
            stats = flat_stats(device_index)
            mine = peaks.live and ours(device_index)
            return peaks.view(stats, flat=True) if stats and mine else stats

        def acc_reset_peak(device_index: Any = None, /) -> None:
            mine = peaks.live and ours(device_index)
            if mine:
                peaks.user_resetting()
            acc_reset(device_index)
            if mine:
                peaks.user_reset()

        for mod in (acc_memory, acc):
            out.append((mod, "memory_stats", acc_memory_stats))
            out.append((mod, "reset_peak_memory_stats", acc_reset_peak))
    return out
