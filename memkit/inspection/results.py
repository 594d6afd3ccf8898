"""The results of :func:`~memkit.inspection.inspect_snapshot`: allocations, OOM events, one
device, and the :class:`SnapshotInspection` that gathers them. Frozen dataclasses with
the shared result methods (:class:`memkit.results.Result`); their text and HTML layout is in
:mod:`memkit.render.inspection`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from memkit.advice import Advice
from memkit.inspection.frames import CATEGORIES, Frame, where_of
from memkit.render import inspection as layout
from memkit.results import Record, Result
from memkit.units import format_size

__all__ = ["Allocation", "DeviceInspection", "OomEvent", "SnapshotInspection"]


@dataclass(frozen=True)
class Allocation(Record):
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

    def _json_fields(self, out: dict[str, Any]) -> dict[str, Any]:
        out["where"] = self.where
        return out


@dataclass(frozen=True)
class OomEvent(Record):
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

    @property
    def where(self) -> str:
        """The innermost frame of your code, as :attr:`Allocation.where`."""
        return where_of(self.frames)

    def _json_fields(self, out: dict[str, Any]) -> dict[str, Any]:
        out["where"] = self.where
        return out


@dataclass(frozen=True)
class DeviceInspection(Record):
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
        reference_request: the request fragmentation is measured against: the last OOM's, or
            the typical large request (byte-weighted median of the requests).
        reference_request_how: which of the two it is.
        unusable_free: free bytes in segments with live blocks that cannot serve
            ``reference_request`` (too small, or in the other pool).
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

    CATEGORIES: ClassVar[tuple[str, ...]] = CATEGORIES
    """The categories, in report order."""

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
    reference_request: int = 0
    reference_request_how: str = ""
    unusable_free: int = 0

    @property
    def fragmentation(self) -> float:
        """What fragmentation costs: the share of the free memory (``inactive``) that cannot
        serve a ``reference_request``. Cached empty segments can (the allocator frees them and
        asks the driver again), so memory ``empty_cache()`` would return is not counted."""
        return 0.0 if self.inactive <= 0 else self.unusable_free / self.inactive

    def category(self, name: str, *, at_peak: bool = False) -> int:
        """Bytes of one category at the end (or at the peak)."""
        return dict(self.peak_categories if at_peak else self.categories).get(name, 0)

    def _json_fields(self, out: dict[str, Any]) -> dict[str, Any]:
        """Plus ``fragmentation``; categories as dicts, the timeline's columns named."""
        out["fragmentation"] = self.fragmentation
        out["categories"] = dict(self.categories)
        out["peak_categories"] = dict(self.peak_categories)
        out["timeline_fields"] = ["event", "allocated", "reserved"]
        return out


@dataclass(frozen=True)
class SnapshotInspection(Result):
    """memkit's view of a PyTorch memory snapshot; see :func:`inspect_snapshot`.

    Renders as text (``str``), HTML (``_repr_html_``, ``to_html``) and JSON (``to_json``).

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

    SCHEMA: ClassVar[str] = "memkit.SnapshotInspection/1"
    HTML_TITLE: ClassVar[str] = "memkit inspect"
    JSON_INDENT: ClassVar[int | None] = 1

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

    # -- renderings (layout in memkit.render.inspection) -------------------------------------
    def __str__(self) -> str:
        return layout.inspection_text(self)

    def __repr__(self) -> str:
        """One line: the file, and over its devices the reserved bytes at the end, the peak
        reserved in the trace and the OOM events (the text is ``str()``)."""
        peaks = [d.peak_reserved for d in self.devices if d.peak_reserved is not None]
        return (
            f"SnapshotInspection({self.source!r}, devices={len(self.devices)}, "
            f"reserved={format_size(sum(d.reserved for d in self.devices))!r}, "
            f"peak_reserved={format_size(max(peaks) if peaks else None)!r}, "
            f"ooms={sum(len(d.ooms) for d in self.devices)})"
        )

    def html_body(self) -> str:
        """The inspection as HTML, without the page shell."""
        return layout.inspection_html(self)
