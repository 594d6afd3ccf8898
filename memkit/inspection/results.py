"""The results of :func:`~memkit.inspection.inspect_snapshot`: allocations, OOM events, one
device, and the :class:`SnapshotInspection` that gathers them. Frozen dataclasses with
``to_dict``/``to_json``; their text and HTML layout is in :mod:`memkit.render.inspection`."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from memkit.advice import Advice
from memkit.inspection.frames import Frame, frames_json, where_of
from memkit.render import html as h
from memkit.render import inspection as layout

__all__ = ["Allocation", "DeviceInspection", "OomEvent", "SnapshotInspection"]


@dataclass(frozen=True)
class Allocation:
    """One allocation: its block, what it probably is and where it was made.

    Attributes:
        address: the block's address.
        size: bytes it occupies (the block; in the peak lists, the requested bytes).
        requested_size: bytes asked for.
        category: see :func:`categorize`.
        frames: its Python stack, innermost first (empty when not recorded).
    """

    address: int
    size: int
    requested_size: int
    category: str
    frames: tuple[Frame, ...] = ()

    @property
    def where(self) -> str:
        """The innermost frame of your code (``train.py:42:step``), ``> torch's`` frame."""
        return where_of(self.frames)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready."""
        return {
            "address": self.address,
            "size": self.size,
            "requested_size": self.requested_size,
            "category": self.category,
            "where": self.where,
            "frames": frames_json(self.frames),
        }


@dataclass(frozen=True)
class OomEvent:
    """An ``oom`` event of the trace: a request the allocator could not serve.

    Attributes:
        index: its position in the device's trace.
        size: bytes requested.
        device_free: what the device still had free (CUDA: ``cudaMemGetInfo``; memkit's
            simulated device: the budget left).
        allocated: requested bytes allocated just before (from the trace).
        reserved: bytes reserved just before (from the trace's segment events).
        frames: where it was asked for.
        final: nothing was allocated, freed or reserved after it: the snapshot's segments are
            the memory at this OOM (a dump at the failure).
    """

    index: int
    size: int
    device_free: int | None
    allocated: int
    reserved: int
    frames: tuple[Frame, ...] = ()
    final: bool = False

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready."""
        return {
            "index": self.index,
            "final": self.final,
            "size": self.size,
            "device_free": self.device_free,
            "allocated": self.allocated,
            "reserved": self.reserved,
            "where": where_of(self.frames),
            "frames": frames_json(self.frames),
        }


@dataclass(frozen=True)
class DeviceInspection:
    """One device of a snapshot (sizes in bytes).

    Attributes:
        device: the device index.
        segments: segments held at the end.
        reserved: their total size (``torch.cuda.memory_reserved``).
        allocated: bytes of active blocks (``memory_allocated``; includes blocks pending free).
        requested: bytes those blocks' allocations asked for (the rest is rounding).
        pending_free: active blocks waiting for another stream before they are free.
        inactive: reserved but not allocated.
        inactive_split: inactive bytes in segments that also hold active blocks: fragmentation
            proper (``empty_cache`` cannot release them).
        inactive_split_blocks: how many such blocks.
        empty_segments: bytes in segments without an active block (``empty_cache`` releases
            them).
        largest_free_block: the largest inactive block: the largest request served without
            new memory.
        categories: ``(category, bytes)`` of the active blocks at the end.
        largest: the largest active blocks at the end, largest first.
        trace_entries: events in the device's trace.
        allocs, frees: ``alloc`` and ``free_completed`` events.
        unpaired_frees: frees of allocations made before the trace's first event.
        peak_allocated: the most requested bytes allocated at once in the trace window
            (``None`` without a trace).
        peak_reserved: the most reserved in the window (segment events).
        peak_index: the event at the peak (``-1``: before the first event).
        peak_categories: ``(category, bytes)`` at the peak (requested bytes).
        peak_largest: the largest allocations live at the peak.
        ooms: the trace's ``oom`` events.
        timeline: ``(event index, allocated, reserved)``, at most
            :data:`MAX_TIMELINE_POINTS` points (the highest of each stretch).
    """

    device: int
    segments: int
    reserved: int
    allocated: int
    requested: int
    pending_free: int
    inactive: int
    inactive_split: int
    inactive_split_blocks: int
    empty_segments: int
    largest_free_block: int
    categories: tuple[tuple[str, int], ...]
    largest: tuple[Allocation, ...]
    trace_entries: int = 0
    allocs: int = 0
    frees: int = 0
    unpaired_frees: int = 0
    peak_allocated: int | None = None
    peak_reserved: int | None = None
    peak_index: int | None = None
    peak_categories: tuple[tuple[str, int], ...] = ()
    peak_largest: tuple[Allocation, ...] = ()
    ooms: tuple[OomEvent, ...] = ()
    timeline: tuple[tuple[int, int, int], ...] = ()

    @property
    def fragmentation(self) -> float:
        """``1 - largest free block / free bytes``: 0 when the free memory is one block (or
        there is none), near 1 when it is scattered in many small ones."""
        return 0.0 if self.inactive <= 0 else 1.0 - self.largest_free_block / self.inactive

    def category(self, name: str, *, at_peak: bool = False) -> int:
        """Bytes of one category at the end (or at the peak)."""
        return dict(self.peak_categories if at_peak else self.categories).get(name, 0)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready."""
        return {
            "device": self.device,
            "segments": self.segments,
            "reserved": self.reserved,
            "allocated": self.allocated,
            "requested": self.requested,
            "pending_free": self.pending_free,
            "inactive": self.inactive,
            "inactive_split": self.inactive_split,
            "inactive_split_blocks": self.inactive_split_blocks,
            "empty_segments": self.empty_segments,
            "largest_free_block": self.largest_free_block,
            "fragmentation": self.fragmentation,
            "categories": dict(self.categories),
            "largest": [a.to_dict() for a in self.largest],
            "trace_entries": self.trace_entries,
            "allocs": self.allocs,
            "frees": self.frees,
            "unpaired_frees": self.unpaired_frees,
            "peak_allocated": self.peak_allocated,
            "peak_reserved": self.peak_reserved,
            "peak_index": self.peak_index,
            "peak_categories": dict(self.peak_categories),
            "peak_largest": [a.to_dict() for a in self.peak_largest],
            "ooms": [o.to_dict() for o in self.ooms],
            "timeline": [list(p) for p in self.timeline],
            "timeline_fields": ["event", "allocated", "reserved"],
        }


@dataclass(frozen=True)
class SnapshotInspection:
    """memkit's view of a PyTorch memory snapshot; see :func:`inspect_snapshot`.

    Renders as text (``str``), HTML (``_repr_html_``, :meth:`to_html`) and JSON
    (:meth:`to_json`).

    Attributes:
        source: the file read (or ``"<dict>"``).
        writer: who wrote it (PyTorch's allocator, or memkit's simulated device).
        simulated: written by memkit from the simulated device.
        protocol: the pickle protocol of the file (``None``: not read from a file, or before
            protocol 2).
        devices: one entry per device with segments or trace events.
        expandable_segments: the allocator setting, when the snapshot records it.
        notes: what the numbers cover and how they were found.
        advice: recommendations (``fragmentation``).
        top: how many allocations the largest lists keep.
    """

    source: str
    writer: str
    simulated: bool
    protocol: int | None
    devices: tuple[DeviceInspection, ...]
    expandable_segments: bool | None = None
    notes: tuple[str, ...] = ()
    advice: tuple[Advice, ...] = ()
    top: int = 10

    def device(self, index: int) -> DeviceInspection:
        """The entry of a device.

        Raises:
            KeyError: the snapshot has nothing on that device.
        """
        for dev in self.devices:
            if dev.device == index:
                return dev
        raise KeyError(
            f"no device {index} in this snapshot; found {[d.device for d in self.devices]}"
        )

    # -- JSON -------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """JSON-ready (sizes in bytes)."""
        return {
            "kind": "memkit.SnapshotInspection",
            "source": self.source,
            "writer": self.writer,
            "simulated": self.simulated,
            "protocol": self.protocol,
            "expandable_segments": self.expandable_segments,
            "top": self.top,
            "devices": [d.to_dict() for d in self.devices],
            "notes": list(self.notes),
            "advice": [a.to_dict() for a in self.advice],
        }

    def to_json(self, path: str | Path | None = None) -> str:
        """As JSON; also written to ``path`` if given."""
        out = json.dumps(self.to_dict(), indent=1)
        if path is not None:
            Path(path).write_text(out + "\n", encoding="utf-8")
        return out

    # -- renderings (layout in memkit.render.inspection) -------------------------------------
    def __str__(self) -> str:
        return layout.inspection_text(self)

    def __repr__(self) -> str:
        return str(self)

    def html_body(self) -> str:
        """The inspection as HTML, without the page shell."""
        return layout.inspection_html(self)

    def _repr_html_(self) -> str:
        return h.fragment(self.html_body())

    def to_html(self, path: str | Path | None = None) -> str:
        """A self-contained HTML page (inline SVG, no scripts); also written to ``path``."""
        page = h.page("memkit inspect", self.html_body())
        if path is not None:
            Path(path).write_text(page, encoding="utf-8")
        return page
