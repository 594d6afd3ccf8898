"""Rules on the caching allocator and the device: fragmentation, other processes, and when
``torch.cuda.empty_cache()`` helps. Functions of readings (a snapshot's row, a track report's
peaks, an OOM message's numbers); no hardware access."""

from __future__ import annotations

import logging
import re
from collections.abc import Sequence
from typing import TYPE_CHECKING

from memkit.advice.form import CUDA_CONTEXT_BYTES, Advice, MiB
from memkit.units import format_size, parse_size

if TYPE_CHECKING:
    from memkit.inspection.results import DeviceInspection

__all__ = [
    "device_advice",
    "empty_cache",
    "fragmentation",
    "other_processes",
    "processes_in_oom_message",
    "snapshot_fragmentation",
]

log = logging.getLogger(__name__)

_FRAGMENTATION_FIX = (
    "Start the process with `PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True` (segments "
    "grow instead of splitting; set before CUDA initialises); inputs of varying shapes "
    "fragment most: pad them to a few fixed sizes."
)


def fragmentation(
    *,
    reserved: int,
    allocated: int,
    device: str = "the device",
    tried_to_allocate: int | None = None,
    capacity: int | None = None,
    peak_allocated: int | None = None,
) -> Advice | None:
    """``fragmentation``: memory reserved by the caching allocator but not usable.

    At an OOM (``tried_to_allocate`` given): fires when reserved-unallocated memory is at least
    the failed request, or 10% of the capacity. Otherwise (a snapshot): fires when ``reserved``
    exceeds the most ever allocated at once (``peak_allocated``) by 20% of reserved and at
    least 256 MiB: the cache grew past any real need, so its blocks could not be reused.
    """
    cached = reserved - allocated
    if tried_to_allocate is not None:
        big = cached >= tried_to_allocate or (capacity is not None and cached >= 0.1 * capacity)
        if cached <= 0 or not big:
            return None
        evidence = (
            f"When {format_size(tried_to_allocate)} could not be allocated on {device}, "
            f"{format_size(cached)} was reserved by PyTorch but unallocated "
            f"({format_size(reserved)} reserved, {format_size(allocated)} in tensors): free "
            "blocks too small or split to hold the request."
        )
        severity = "critical" if cached >= tried_to_allocate else "warning"
        saving = cached
    else:
        if peak_allocated is None:
            return None
        slack = reserved - peak_allocated
        if slack < 256 * MiB or slack < 0.2 * reserved:
            return None
        evidence = (
            f"{device} has {format_size(reserved)} reserved while the most ever allocated at "
            f"once is {format_size(peak_allocated)}: {format_size(slack)} of cached blocks "
            "could not be reused for later requests (fragmentation)."
        )
        severity, saving = "info", slack
    return Advice(
        code="fragmentation",
        title=f"{format_size(saving)} reserved but unusable (fragmentation)",
        evidence=evidence,
        action=_FRAGMENTATION_FIX,
        saving_bytes=saving,
        severity=severity,
    )


def other_processes(
    *,
    used: int,
    this_process: int,
    device: str = "the device",
    total: int | None = None,
    context_bytes: int = CUDA_CONTEXT_BYTES,
    processes: Sequence[tuple[int, str, int]] | None = None,
    includes_context: bool = False,
) -> Advice | None:
    """``other-processes``: device-wide used memory far above this process's share.

    Args:
        used: device-wide used bytes (nvidia-smi, ``cudaMemGetInfo``).
        this_process: this process's reserved bytes, or (``includes_context=True``) its whole
            use as an OOM message gives it ("this process has X memory in use").
        total: the device's size.
        context_bytes: the CUDA context allowance (ignored with ``includes_context``).
        processes: ``(pid, name, bytes)`` of the other processes, where the driver lists them.

    Fires when the rest is at least 512 MiB and 5% of ``total``.
    """
    mine = this_process + (0 if includes_context else context_bytes)
    rest = used - mine
    if rest < 512 * MiB or (total and rest < 0.05 * total):
        return None
    named = (
        "; the driver lists "
        + ", ".join(
            f"pid {pid}{' ' + name if name else ''} ({format_size(b)})"
            for pid, name, b in processes
        )
        if processes
        else ""
    )
    share = f" of {format_size(total)}" if total else ""
    context = "" if includes_context else f" + ~{format_size(context_bytes)} CUDA context"
    return Advice(
        code="other-processes",
        title=f"other processes hold {format_size(rest)} on {device}",
        evidence=(
            f"{device} has {format_size(used)}{share} in use, this process "
            f"{format_size(this_process)}{context}: {format_size(rest)} belongs to other "
            f"processes{named}."
        ),
        action=(
            "Find them with `nvidia-smi --query-compute-apps=pid,process_name,used_memory "
            "--format=csv` (a stale notebook kernel, a previous run, a dataloader worker that "
            "initialised CUDA) and stop them, or choose a free GPU: `CUDA_VISIBLE_DEVICES=<n>`."
        ),
        saving_bytes=rest,
        severity="warning",
    )


def empty_cache(
    *,
    reserved: int,
    allocated: int,
    device: str = "the device",
    other_bytes: int = 0,
    free: int | None = None,
    cache_releases: int = 0,
    steps: int = 0,
) -> Advice | None:
    """``empty-cache``: when ``torch.cuda.empty_cache()`` helps, and when it only costs time.

    Helps: at least 256 MiB is cached (reserved, unallocated) while other processes hold at
    least 512 MiB of the device and its free memory is below what is cached: releasing the
    cache gives them room. Costs: the cache was released ``cache_releases`` times over
    ``steps`` steps (reserved dropping between readings) with no other process needing it:
    each call makes the next step ``cudaMalloc`` everything again, and frees nothing this
    process can use (the allocator reuses its cache anyway).
    """
    cached = max(0, reserved - allocated)
    needed = other_bytes >= 512 * MiB and (free is None or free < cached)
    if cached >= 256 * MiB and needed:
        return Advice(
            code="empty-cache",
            title=f"empty_cache() would give {format_size(cached)} back to other processes",
            evidence=(
                f"{device}: {format_size(cached)} reserved but unallocated "
                f"({format_size(reserved)} reserved, {format_size(allocated)} in tensors), while "
                f"other processes hold {format_size(other_bytes)}"
                + ("" if free is None else f" and only {format_size(free)} is free")
                + "."
            ),
            action=(
                "Call `torch.cuda.empty_cache()` once at the point where another process needs "
                "the memory (after training, before evaluation in a second process); not in "
                "the training loop."
            ),
            saving_bytes=cached,
            severity="info",
        )
    if cache_releases >= 2 and steps >= 2 and other_bytes < 512 * MiB:
        return Advice(
            code="empty-cache",
            title="empty_cache() in the loop only costs time",
            evidence=(
                f"{device}: the allocator's cache was released {cache_releases} times in "
                f"{steps} steps (reserved memory dropped between readings) and no other "
                "process needs it: every step then reserves the memory again from the driver."
            ),
            action=(
                "Remove `torch.cuda.empty_cache()` from the loop: it does not lower this "
                "process's peak (the allocator reuses its cache) and each call forces slow "
                "cudaMalloc/cudaFree calls. For fragmentation use expandable_segments instead."
            ),
            severity="info",
        )
    return None


def device_advice(
    device: str,
    *,
    total: int | None,
    used: int | None,
    allocated: int | None,
    reserved: int | None,
    peak_allocated: int | None = None,
    context_bytes: int = CUDA_CONTEXT_BYTES,
) -> list[Advice]:
    """``other-processes``, ``fragmentation`` and ``empty-cache`` from one device's readings
    (a snapshot's row); ``None`` readings make the rules that need them stay silent."""
    out: list[Advice | None] = []
    if used is not None and reserved is not None:
        out.append(
            other_processes(
                used=used,
                this_process=reserved,
                total=total,
                device=device,
                context_bytes=context_bytes,
            )
        )
    if reserved is not None and allocated is not None:
        out.append(
            fragmentation(
                reserved=reserved,
                allocated=allocated,
                peak_allocated=peak_allocated,
                device=device,
            )
        )
        other = 0 if used is None else max(0, used - reserved - context_bytes)
        free = None if used is None or total is None else max(0, total - used)
        out.append(
            empty_cache(
                reserved=reserved, allocated=allocated, device=device, other_bytes=other, free=free
            )
        )
    return [a for a in out if a is not None]


_PROCESS = re.compile(r"Process (\d+) has ([0-9.]+ ?[KMGT]i?B) memory in use")


def processes_in_oom_message(message: str) -> list[tuple[int, str, int]]:
    """``(pid, "", bytes)`` of the other processes a CUDA OOM message names ("Process 1234 has
    3.00 GiB memory in use", PyTorch >= 2.1 where the driver allows it).

    Examples:
        >>> processes_in_oom_message("... Process 4242 has 3.00 GiB memory in use. ...")
        [(4242, '', 3221225472)]
    """
    out = []
    for pid, size in _PROCESS.findall(message):
        try:
            out.append((int(pid), "", parse_size(size.replace(" ", ""))))
        except Exception:  # a size we cannot read: leave that process out
            log.debug("unreadable size %r in an OOM message", size)
    return out


def snapshot_fragmentation(
    devices: Sequence[DeviceInspection], *, simulated: bool, expandable: bool | None
) -> tuple[list[Advice], list[str]]:
    """``fragmentation`` per device of a memory snapshot (``memkit inspect``), and notes on the
    OOMs it does not explain: an OOM recorded at the dump whose request a free block could have
    held was not fragmentation. Nothing on the simulated device (nothing to fragment) or with
    ``expandable_segments`` on (the fix is already in place)."""
    if simulated or expandable:  # nothing to fragment, or the fix is already on
        return [], []
    out, notes = [], []
    for d in devices:
        name = f"cuda:{d.device}"
        last = d.ooms[-1] if d.ooms else None
        found = None
        if last is not None and last.final:  # the segments are the memory at the OOM
            if d.largest_free_block >= last.size:
                notes.append(
                    f"{name}: the OOM of {format_size(last.size)} is not fragmentation: a free "
                    f"block of {format_size(d.largest_free_block)} could hold it (another "
                    "stream's or memory pool's, or freed since)"
                )
                continue
            found = fragmentation(
                reserved=last.reserved,
                allocated=last.allocated,
                device=name,
                tried_to_allocate=last.size,
            )
        else:
            found = _split_blocks(d, name)
        if found is not None:
            out.append(found)
    return out, notes


def _split_blocks(d: DeviceInspection, name: str) -> Advice | None:
    """``fragmentation`` of a snapshot not dumped at an OOM: the free bytes in segments with
    live blocks that cannot serve the reference request (``unusable_free``, the fragmentation
    line's bytes), no more than reserved minus whole empty segments (cache: ``empty_cache()``
    or the allocator itself returns them) minus the most allocated at once. Fires at 256 MiB
    and 20% of the reserved bytes outside empty segments."""
    in_use = d.reserved - d.empty_segments  # segments holding live blocks
    most = max(d.allocated, d.peak_allocated or 0)
    unusable = max(0, min(d.unusable_free, in_use - most))
    if unusable < 256 * MiB or unusable < 0.2 * in_use:
        return None
    known = (
        f"the most allocated at once is {format_size(most)}"
        if d.peak_allocated is not None
        else f"{format_size(d.allocated)} is allocated at the end (no trace: the peak is unknown)"
    )
    cache = (
        f", {format_size(d.empty_segments)} of it in whole empty segments (cache, not "
        "fragmentation: empty_cache() or the allocator itself returns it)"
        if d.empty_segments
        else ""
    )
    return Advice(
        code="fragmentation",
        title=f"{format_size(unusable)} reserved but unusable (fragmentation)",
        evidence=(
            f"{name} has {format_size(d.reserved)} reserved{cache}; {known}: "
            f"{format_size(unusable)} free in segments that also hold live blocks cannot serve "
            f"a {format_size(d.reference_request)} request, {d.reference_request_how}."
        ),
        action=_FRAGMENTATION_FIX,
        saving_bytes=unusable,
        severity="info",
    )
