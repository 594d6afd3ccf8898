"""What a memory snapshot says, per device: fragmentation, what is allocated (at the end and at
the trace's peak), the largest allocations, OOM events, notes and advice."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from memkit import advice as advice_rules
from memkit.inspection.frames import (
    CATEGORIES,
    Frame,
    bound_gradients,
    categorize,
    frames_of,
    freed_within,
)
from memkit.inspection.loading import load_snapshot, normalise
from memkit.inspection.results import Allocation, DeviceInspection, OomEvent, SnapshotInspection

__all__ = ["MAX_TIMELINE_POINTS", "inspect_snapshot"]

_SMALL_SIZE = 1 << 20
"""The caching allocator's ``kSmallSize``: requests up to 1 MiB use the small pool."""

MAX_TIMELINE_POINTS = 600
"""Points kept of the allocated/reserved timeline (bucket maxima, so the peak survives)."""


def _block_frames(block: Mapping[str, Any]) -> Any:
    if "frames" in block:
        return block["frames"]
    history = block.get("history")
    if isinstance(history, list) and history and isinstance(history[0], dict):
        return history[0].get("frames", [])
    return []


def _block_requested(block: Mapping[str, Any]) -> int:
    value = block.get("requested_size")
    if isinstance(value, int):
        return value
    history = block.get("history")
    if isinstance(history, list) and history and isinstance(history[0], dict):
        real = history[0].get("real_size")
        if isinstance(real, int):
            return real
    return int(block["size"])


def _by_category(items: Sequence[tuple[str, int]]) -> tuple[tuple[str, int], ...]:
    sums = dict.fromkeys(CATEGORIES, 0)
    for category, nbytes in items:
        sums[category] = sums.get(category, 0) + nbytes
    return tuple((name, value) for name, value in sums.items() if value)


def _bounded(allocs: list[Allocation]) -> list[Allocation]:
    """``allocs`` (alive together) with gradients bounded by the parameters among them."""
    labels = bound_gradients([(a.category, a.requested_size) for a in allocs])
    return [
        a if a.category == c else replace(a, category=c)
        for a, c in zip(allocs, labels, strict=True)
    ]


def _typical_request(sizes: Sequence[int]) -> int:
    """The byte-weighted median request: half of the bytes asked for came in requests at least
    this large (the workload's typical large request)."""
    ordered = sorted(s for s in sizes if s > 0)
    half, running = sum(ordered) / 2, 0
    for size in reversed(ordered):
        running += size
        if running >= half:
            return size
    return 0


def _unusable(free: Sequence[tuple[int, bool]], request: int) -> int:
    """Bytes of free split blocks (``(size, small pool)``) that cannot serve ``request``: too
    small, or in the other pool (requests up to 1 MiB come only from the small pool)."""
    small = request <= _SMALL_SIZE
    rounded = max(512, -(-request // 512) * 512)
    return sum(size for size, pool_small in free if pool_small != small or size < rounded)


def _downsample(points: list[tuple[int, int, int]], limit: int) -> tuple[tuple[int, int, int], ...]:
    if len(points) <= limit:
        return tuple(points)
    step = -(-len(points) // limit)
    out = []
    for start in range(0, len(points), step):
        chunk = points[start : start + step]
        out.append(max(chunk, key=lambda p: (p[1], p[2])))
    return tuple(out)


def _device(
    index: int, segments: list[dict[str, Any]], trace: list[dict[str, Any]], top: int
) -> DeviceInspection:
    reserved = allocated = requested = pending = split = split_blocks = empty = largest_free = 0
    live: dict[int, tuple[int, int, tuple[Frame, ...]]] = {}  # addr -> (size, requested, frames)
    split_free: list[tuple[int, bool]] = []  # free blocks in segments with live ones
    for seg in segments:
        total = int(seg["total_size"])
        kind = seg.get("segment_type")
        small_pool = kind == "small" if kind is not None else total <= 2 * _SMALL_SIZE
        reserved += total
        seg_addr = seg.get("address")
        addr = seg_addr if isinstance(seg_addr, int) else 0
        has_active = False
        free_here: list[int] = []
        for b in seg["blocks"]:
            size = int(b["size"])
            given = b.get("address")
            b_addr = given if isinstance(given, int) else addr
            state = str(b.get("state", "inactive"))
            if state.startswith("active"):
                has_active = True
                allocated += size
                req = _block_requested(b)
                requested += req
                if state != "active_allocated":
                    pending += size
                live[b_addr] = (size, req, frames_of(_block_frames(b)))
            else:
                free_here.append(size)
                largest_free = max(largest_free, size)
            addr = b_addr + size
        if has_active:
            split += sum(free_here)
            split_blocks += len(free_here)
            split_free.extend((size, small_pool) for size in free_here)
        else:
            empty += total
    end_allocs = _bounded(
        [Allocation(a, size, req, categorize(f), f) for a, (size, req, f) in live.items()]
    )
    end_allocs.sort(key=lambda x: (-x.size, x.address))
    result: dict[str, Any] = {
        "device": index,
        "segments": len(segments),
        "reserved": reserved,
        "allocated": allocated,
        "requested": requested,
        "pending_free": pending,
        "inactive": reserved - allocated,
        "inactive_split": split,
        "inactive_split_blocks": split_blocks,
        "empty_segments": empty,
        "largest_free_block": largest_free,
        "categories": _by_category([(a.category, a.size) for a in end_allocs]),
        "largest": tuple(end_allocs[:top]),
    }
    if trace:
        result.update(_trace(trace, live, requested, reserved, top))
    ooms = result.get("ooms", ())
    if ooms:
        request, how = ooms[-1].size, "the request that failed (the last OOM)"
    else:
        sizes = [int(e.get("size") or 0) for e in trace if e.get("action") == "alloc"]
        request = _typical_request(sizes or [req for _, req, _ in live.values()])
        how = "the typical large request (half of the bytes asked for came in requests this large"
        how += " or larger)"
    result["reference_request"] = request
    result["reference_request_how"] = how
    result["unusable_free"] = _unusable(split_free, request) if request else split
    return DeviceInspection(**result)


def _trace(
    trace: list[dict[str, Any]],
    live: dict[int, tuple[int, int, tuple[Frame, ...]]],
    end_level: int,
    end_reserved: int,
    top: int,
) -> dict[str, Any]:
    """Peak, categories at the peak, OOMs and the timeline, walked back from the end.

    Over 80 lines on purpose: one backward walk over the trace keeps the running level, the
    reserved bytes, the pairing of allocs with frees and the OOM events in step; split into
    passes, each would have to re-derive the others' state at every event.
    """
    n = len(trace)
    alloc_at: dict[Any, int] = {}
    paired: dict[int, int | None] = {}
    allocs = frees = 0
    delta = [0] * n
    res_delta = [0] * n
    # allocations made up to each event by another pass than backward, or than an optimizer
    # step (a forward's activations; backward's or the step's): a block freed with none made
    # in between is freed within its own pass (a temporary); one made before and freed after,
    # e.g. LBFGS history replaced a step later, lived past it (review)
    not_backward = [0] * (n + 1)
    not_optimizer = [0] * (n + 1)
    made_at: dict[int, str] = {}  # each allocation's category, by its event
    for i, e in enumerate(trace):
        action, addr, size = e["action"], e.get("addr"), e.get("size", 0)
        size = size if isinstance(size, int) else 0
        made = categorize(frames_of(e.get("frames"))) if action == "alloc" else None
        if made is not None:
            made_at[i] = made
        not_backward[i + 1] = not_backward[i] + (made in ("activations", "optimizer state"))
        not_optimizer[i + 1] = not_optimizer[i] + (made in ("activations", "gradients"))
        if action == "alloc":
            allocs += 1
            alloc_at[addr] = i
            delta[i] = size
        elif action == "free_completed":
            frees += 1
            paired[i] = alloc_at.pop(addr, None)
            delta[i] = -size
        elif action in ("segment_alloc", "segment_map"):
            res_delta[i] = size
        elif action in ("segment_free", "segment_unmap"):
            res_delta[i] = -size
    # levels after each event, from the end backwards
    after = [0] * n
    res_after = [0] * n
    level, res = end_level, end_reserved
    for i in range(n - 1, -1, -1):
        after[i], res_after[i] = level, res
        level -= delta[i]
        res -= res_delta[i]
    start_level, start_res = level, res
    peak, peak_index = start_level, -1
    for i in range(n):
        if after[i] > peak:
            peak, peak_index = after[i], i
    peak_res = max([start_res, *res_after])
    # whether frees carry stacks of their own: under torch's context="alloc" the allocator
    # writes each free with its allocation's stack (review), which says nothing of where it
    # was freed; in a real free stack most differ from the allocation's
    pairs = [(i, j) for i, j in paired.items() if j is not None]
    same = sum(trace[i].get("frames") == trace[j].get("frames") for i, j in pairs)
    free_stacks = bool(pairs) and same < 0.9 * len(pairs)
    # what was live at the peak: undo the events after it (with how each block freed since
    # was freed: a backward's or an optimizer step's temporary)
    state = {a: (req, frames, "") for a, (_, req, frames) in live.items()}
    for i in range(n - 1, peak_index, -1):
        e = trace[i]
        if e["action"] == "alloc":
            state.pop(e.get("addr"), None)  # type: ignore[arg-type]
        elif e["action"] == "free_completed":
            j = paired.get(i)
            frames = frames_of(trace[j].get("frames")) if j is not None else ()
            size = e.get("size", 0)
            made = made_at.get(j, "unknown") if j is not None else "unknown"
            # the free's own stack, and only where nothing outside the pass was allocated in
            # between
            freed = frames_of(e.get("frames"))
            outside = not_backward if made == "gradients" else not_optimizer
            within = free_stacks and j is not None and outside[i] == outside[j + 1]
            state[e.get("addr")] = (  # type: ignore[index]
                size if isinstance(size, int) else 0,
                frames,
                freed_within(made, freed) if within else made,
            )
    peak_allocs = _bounded(
        [
            Allocation(
                a if isinstance(a, int) else 0, req, req, freed or categorize(frames), frames
            )
            for a, (req, frames, freed) in state.items()
        ]
    )
    peak_allocs.sort(key=lambda x: (-x.size, x.address))
    last_change = max(
        (i for i in range(n) if delta[i] or res_delta[i] or trace[i]["action"] == "alloc"),
        default=-1,
    )
    ooms = []
    for i, e in enumerate(trace):
        if e["action"] == "oom":
            free = e.get("device_free")
            size = e.get("size", 0)
            ooms.append(
                OomEvent(
                    index=i,
                    size=size if isinstance(size, int) else 0,
                    device_free=free if isinstance(free, int) else None,
                    allocated=after[i],
                    reserved=res_after[i],
                    frames=frames_of(e.get("frames")),
                    final=i > last_change,
                )
            )
    points = [(-1, start_level, start_res)] + [(i, after[i], res_after[i]) for i in range(n)]
    return {
        "trace_entries": n,
        "allocs": allocs,
        "frees": frees,
        "unpaired_frees": sum(1 for j in paired.values() if j is None),
        "peak_allocated": peak,
        "peak_reserved": peak_res,
        "peak_index": peak_index,
        "peak_categories": _by_category([(a.category, a.size) for a in peak_allocs]),
        "peak_largest": tuple(peak_allocs[:top]),
        "ooms": tuple(ooms),
        "timeline": _downsample(points, MAX_TIMELINE_POINTS),
    }


def _device_of(segment: Mapping[str, Any]) -> int:
    device = segment.get("device", 0)
    return device if isinstance(device, int) else 0


def inspect_snapshot(
    source: str | Path | Mapping[str, Any], *, top: int = 10
) -> SnapshotInspection:
    """memkit's view of a PyTorch memory snapshot: a file (``_dump_snapshot``'s pickle, or
    ``memkit run --memory-history``'s) or the dict itself (``torch.cuda.memory._snapshot()``).

    Raises:
        ConfigError: the file is missing, not a pickle, or not a snapshot (exit 2).
    """
    if isinstance(source, Mapping):
        data, protocol, name = normalise(dict(source), "<dict>"), None, "<dict>"
    else:
        data, protocol = load_snapshot(source)
        name = str(source)
    segments: list[dict[str, Any]] = data["segments"]
    traces: list[list[dict[str, Any]]] = data["device_traces"]
    meta = data.get("memkit") if isinstance(data.get("memkit"), dict) else None
    indices = sorted({_device_of(s) for s in segments} | {i for i, t in enumerate(traces) if t})
    devices = tuple(
        _device(
            i,
            [s for s in segments if _device_of(s) == i],
            traces[i] if i < len(traces) else [],
            top,
        )
        for i in indices
    )
    settings = data.get("allocator_settings")
    expandable = None
    if isinstance(settings, dict) and isinstance(settings.get("expandable_segments"), bool):
        expandable = settings["expandable_segments"]
    writer = (
        f"{meta.get('writer', 'memkit')}, {meta.get('device', 'simulated device')}"
        if meta is not None
        else "PyTorch caching allocator snapshot"
    )
    advice, advice_notes = advice_rules.snapshot_fragmentation(
        devices, simulated=meta is not None, expandable=expandable
    )
    notes = _notes(devices, meta, protocol, expandable) + advice_notes
    return SnapshotInspection(
        source=name,
        writer=writer,
        simulated=meta is not None,
        protocol=protocol,
        devices=devices,
        expandable_segments=expandable,
        notes=tuple(notes),
        advice=tuple(advice),
        top=top,
    )


def _notes(
    devices: Sequence[DeviceInspection],
    meta: Mapping[str, Any] | None,
    protocol: int | None,
    expandable: bool | None,
) -> list[str]:
    notes = [
        "categories are guesses from each allocation's Python frames (optimizer code, "
        "backward, module construction, forward; see docs/memory-history.md); 'unknown': no "
        "frames were recorded (allocated before recording began, or without stacks). "
        "Backward's allocations count as gradients only up to one per parameter of the same "
        "size alive with them; the rest are 'backward temporaries' ('backward, unsorted' when "
        "no parameter was recorded). At the peak, a block that backward made and freed is a "
        "backward temporary, and one an optimizer step made and freed (not by zero_grad) an "
        "'optimizer temporary', where the trace recorded the stacks of frees",
        "fragmentation: the share of the free memory in segments that cannot serve the "
        "reference request (the failed one at an OOM, else the typical large one); cached empty "
        "segments are not fragments: empty_cache() returns them, and the allocator frees them "
        "itself before it would run out",
    ]
    if any(d.trace_entries for d in devices):
        notes.append(
            "the trace's peak counts requested bytes over the recorded window, as memory_viz's "
            "timeline does; allocated and reserved count whole blocks"
        )
    if any(d.unpaired_frees for d in devices):
        notes.append(
            "the trace begins after the process did: it frees allocations it never saw made "
            "(recording started late, or the oldest events were dropped, max_entries); the "
            "peak covers the recorded window only"
        )
    if meta is not None:
        notes.append(
            "written by memkit from its simulated device: one segment per storage, so "
            "reserved equals allocated and there is no fragmentation to find"
        )
        dropped = meta.get("events_dropped")
        if isinstance(dropped, int) and dropped > 0:
            notes.append(f"{dropped} older event(s) were dropped (max_entries)")
    if protocol is not None and protocol > 4:
        notes.append(
            f"this file is pickle protocol {protocol}: pytorch.org/memory_viz reads protocols 2 "
            "to 4 (Python 3.14 pickles with 5 by default); memkit run --memory-history writes 4"
        )
    if not any(d.trace_entries for d in devices):
        notes.append(
            "no trace events: recorded without history (enabled='state'), or the segments "
            "alone (torch.cuda.memory_snapshot()); only the state at the end is known"
        )
    if expandable:
        notes.append("expandable_segments is on in this run's allocator settings")
    return notes
