"""``memkit inspect``: memkit's view of a PyTorch memory snapshot, from any run.

A snapshot is the pickle ``torch.cuda.memory._dump_snapshot`` writes (or memkit's
``--memory-history``, the same format from the simulated device; see :mod:`memkit.history`).
:func:`inspect_snapshot` reads it and returns a frozen :class:`SnapshotInspection`: per device,

* **fragmentation**: reserved (segments) against allocated (active blocks), the free bytes in
  segments that also hold live blocks (*split* blocks: ``empty_cache`` cannot return them, and
  they serve only requests that fit in one of them), whole free segments, the largest free block;
* **what is allocated**, at the end and at the trace's peak, by category, guessed from each
  allocation's Python frames (:func:`categorize`);
* **the largest allocations** with their frames, at the end and at the peak;
* **OOM events** in the trace, with what was allocated and reserved then;
* **advice** (``fragmentation``, from :mod:`memkit.advice`).

The trace counts *requested* bytes (the ``size`` of ``alloc`` and ``free_completed`` events, as
memory_viz's timeline does): the peak is walked back from the end, whose level is the requested
bytes of the blocks still allocated. Without a trace (``enabled="state"``, or a plain
``torch.cuda.memory_snapshot()`` list) only the end state is known.

Reading is safe: the unpickler refuses every class (a snapshot holds only dicts, lists, strings
and numbers; loading anything else could run code). Nothing here imports torch.

Examples:
    >>> from memkit.inspection import inspect_snapshot
    >>> block = {"size": 1024, "requested_size": 1000, "state": "active_allocated", "frames": []}
    >>> seg = {"device": 0, "address": 0, "total_size": 2048, "stream": 0,
    ...        "blocks": [block, {"size": 1024, "state": "inactive"}]}
    >>> view = inspect_snapshot({"segments": [seg], "device_traces": [[]]})
    >>> view.devices[0].reserved, view.devices[0].allocated, view.devices[0].inactive_split
    (2048, 1024, 1024)
"""

from __future__ import annotations

import io
import json
import os
import pickle
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from memkit import advice as advice_rules
from memkit.advice import Advice, advice_html, advice_text
from memkit.errors import ConfigError
from memkit.render import html as h
from memkit.render import text
from memkit.units import format_size

__all__ = [
    "CATEGORIES",
    "Allocation",
    "DeviceInspection",
    "Frame",
    "OomEvent",
    "SnapshotInspection",
    "categorize",
    "inspect_snapshot",
    "load_snapshot",
]

CATEGORIES = ("parameters", "gradients", "optimizer state", "activations", "other", "unknown")
"""Categories, in the order reports list them (``unknown``: no frames were recorded)."""

MAX_TIMELINE_POINTS = 600
"""Points kept of the allocated/reserved timeline (bucket maxima, so the peak survives)."""

_MODULE_FILE = "torch/nn/modules/module.py"
_PARAMETER_CALLS = frozenset(
    {"_apply", "convert", "to", "cuda", "to_empty", "load_state_dict", "_load_from_state_dict"}
)
_PARAMETER_NAMES = frozenset(
    {
        "load_state_dict",
        "_load_from_state_dict",
        "from_pretrained",
        "_load_state_dict_into_meta_model",
        "reset_parameters",
    }
)
_BACKWARD_NAMES = frozenset({"backward", "_engine_run_backward", "run_backward"})


# -- frames and categories ---------------------------------------------------------------------


@dataclass(frozen=True)
class Frame:
    """One Python frame of an allocation's stack."""

    filename: str
    line: int
    name: str

    def __str__(self) -> str:
        return f"{self.filename}:{self.line}:{self.name}"

    @property
    def short(self) -> str:
        """``file.py:LINE:name`` (the file's base name)."""
        return f"{self.filename.replace(os.sep, '/').rsplit('/', 1)[-1]}:{self.line}:{self.name}"


def _frame_rule(filename: str, name: str) -> str | None:
    """The category one frame implies, or ``None`` (see :func:`categorize`)."""
    path = filename.replace(os.sep, "/")
    if path.startswith("<memkit"):  # memkit's marker: a storage counted when first read
        return "parameters" if name == "parameter" else "other"
    base = path.rsplit("/", 1)[-1]
    if "/optim/" in path or "/optimizers/" in path or "optimizer" in base:
        return "optimizer state"
    if name in _BACKWARD_NAMES or (name == "grad" and "autograd" in path):
        return "gradients"
    if path.endswith(_MODULE_FILE) and name in _PARAMETER_CALLS:
        return "parameters"
    if ("/torch/nn/modules/" in path and name == "__init__") or name in _PARAMETER_NAMES:
        return "parameters"
    if path.endswith("torch/nn/parameter.py"):
        return "parameters"
    if name == "forward" or (path.endswith(_MODULE_FILE) and name.endswith("call_impl")):
        return "activations"
    return None


def categorize(frames: Sequence[Mapping[str, Any]] | Sequence[Frame]) -> str:
    """What an allocation probably is, from its frames (innermost first); the first frame that
    matches a rule decides:

    * memkit's marker frame (``<memkit...>``, a storage counted when first read on the
      simulated device): ``parameters`` for an ``nn.Parameter``, else ``other``;
    * a file in an ``optim``/``optimizers`` folder or named ``*optimizer*``
      (``torch/optim/adam.py``, ``accelerate/optimizer.py``): ``optimizer state``;
    * a function ``backward``, ``_engine_run_backward``, ``run_backward``, or autograd's
      ``grad``: ``gradients``;
    * building or moving a model: ``Module._apply``/``convert``/``to``/``cuda``/``to_empty``, a
      module's ``__init__``, ``reset_parameters``, ``load_state_dict``, ``from_pretrained``:
      ``parameters``;
    * a ``forward`` (or ``Module._call_impl``): ``activations``.

    No match: ``other`` (data, the loss, your own code); no frames at all: ``unknown``. Blocks
    that live on after a step keep the category of where they were made: gradients made in
    backward, optimizer state in ``step``, activations kept for backward in ``forward``.
    """
    if not frames:
        return "unknown"
    for f in frames:
        if isinstance(f, Frame):
            rule = _frame_rule(f.filename, f.name)
        else:
            rule = _frame_rule(str(f.get("filename", "")), str(f.get("name", "")))
        if rule is not None:
            return rule
    return "other"


def _frames(raw: Any) -> tuple[Frame, ...]:
    if not isinstance(raw, (list, tuple)):
        return ()
    out = []
    for f in raw:
        if isinstance(f, Mapping):
            line = f.get("line", 0)
            out.append(
                Frame(
                    str(f.get("filename", "?")),
                    int(line) if isinstance(line, int) else 0,
                    str(f.get("name", "?")),
                )
            )
    return tuple(out)


def _frames_json(frames: Sequence[Frame]) -> list[dict[str, Any]]:
    return [{"filename": f.filename, "line": f.line, "name": f.name} for f in frames]


_MEMKIT_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))).replace(os.sep, "/") + "/"
_LIBRARY_DIRS = ("/site-packages/", "/dist-packages/", "/torch/", "/lib/python")


def _yours(frame: Frame) -> bool:
    """A frame of the user's code: not a library's (torch, site-packages, the standard
    library), not memkit's, not a marker."""
    path = frame.filename.replace(os.sep, "/")
    if path.startswith("<") and path != "<stdin>":
        return False
    return not path.startswith(_MEMKIT_DIR) and not any(d in path for d in _LIBRARY_DIRS)


def _where(frames: Sequence[Frame]) -> str:
    """Where an allocation was made: the innermost frame of your code (not torch's, a
    library's or memkit's), ``>`` the innermost frame when that is another; ``-`` without
    frames."""
    if not frames:
        return "-"
    own = next((f for f in frames if _yours(f)), None)
    if own is None:
        return frames[0].short
    if own is frames[0]:
        return own.short
    return f"{own.short} > {frames[0].short}"


# -- results -------------------------------------------------------------------------------------


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
        return _where(self.frames)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready."""
        return {
            "address": self.address,
            "size": self.size,
            "requested_size": self.requested_size,
            "category": self.category,
            "where": self.where,
            "frames": [
                {"filename": f.filename, "line": f.line, "name": f.name} for f in self.frames
            ],
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
            "where": _where(self.frames),
            "frames": [
                {"filename": f.filename, "line": f.line, "name": f.name} for f in self.frames
            ],
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

    # -- text -------------------------------------------------------------------------------
    def _title(self) -> str:
        proto = "" if self.protocol is None else f", pickle protocol {self.protocol}"
        return f"memkit inspect {self.source}: {self.writer}{proto}"

    def __str__(self) -> str:
        lines = [self._title()]
        for d in self.devices:
            lines.append("")
            lines.extend(_device_text(d))
        if self.advice:
            lines.extend(["", "advice:", advice_text(self.advice)])
        if self.notes:
            lines.extend(["", "notes:", *(f"- {n}" for n in self.notes)])
        return "\n".join(lines)

    def __repr__(self) -> str:
        return str(self)

    # -- HTML -------------------------------------------------------------------------------
    def html_body(self) -> str:
        """The inspection as HTML, without the page shell."""
        body = [f"<h2>{h.escape(self._title())}</h2>"]
        for d in self.devices:
            body.append(_device_html(d))
        body.append("<h3>Advice</h3>")
        body.append(advice_html(list(self.advice)))
        if self.notes:
            body.append("".join(f'<p class="note">{h.escape(n)}</p>' for n in self.notes))
        return "".join(body)

    def _repr_html_(self) -> str:
        return h.fragment(self.html_body())

    def to_html(self, path: str | Path | None = None) -> str:
        """A self-contained HTML page (inline SVG, no scripts); also written to ``path``."""
        page = h.page("memkit inspect", self.html_body())
        if path is not None:
            Path(path).write_text(page, encoding="utf-8")
        return page


def _size(value: int | None) -> str:
    return "-" if value is None else format_size(value)


def _category_rows(d: DeviceInspection) -> list[list[object]]:
    end, peak = dict(d.categories), dict(d.peak_categories)
    rows: list[list[object]] = []
    for name in CATEGORIES:
        if end.get(name) or peak.get(name):
            row: list[object] = [name, format_size(end.get(name, 0))]
            if d.peak_categories:
                row.append(format_size(peak.get(name, 0)))
            rows.append(row)
    return rows


def _category_headers(d: DeviceInspection) -> list[str]:
    return ["category", "at the end"] + (["at the peak"] if d.peak_categories else [])


def _allocation_rows(allocs: Sequence[Allocation]) -> list[list[object]]:
    return [[format_size(a.size), a.category, a.where] for a in allocs]


def _summary(d: DeviceInspection) -> list[str]:
    lines = [
        f"device {d.device}: {d.segments} segment(s), reserved {format_size(d.reserved)}, "
        f"allocated {format_size(d.allocated)} (requested {format_size(d.requested)})",
        f"free in segments {format_size(d.inactive)}: split blocks {format_size(d.inactive_split)}"
        f" in {d.inactive_split_blocks} block(s), empty segments {format_size(d.empty_segments)},"
        f" largest free block {format_size(d.largest_free_block)}"
        + (f", fragmentation {100 * d.fragmentation:.0f}%" if d.inactive > 0 else ""),
    ]
    if d.pending_free:
        lines.append(f"pending free (waiting for another stream): {format_size(d.pending_free)}")
    if d.trace_entries:
        at = "before the first event" if d.peak_index == -1 else f"at event {d.peak_index}"
        lines.append(
            f"trace: {d.trace_entries} event(s), {d.allocs} alloc(s), {d.frees} free(s), "
            f"{len(d.ooms)} OOM(s); peak {_size(d.peak_allocated)} allocated {at}, "
            f"{_size(d.peak_reserved)} reserved at most"
        )
    else:
        lines.append("trace: none (only the state at the end)")
    return lines


def _device_text(d: DeviceInspection) -> list[str]:
    lines = _summary(d)
    rows = _category_rows(d)
    if rows:
        lines.append(text.table(_category_headers(d), rows, title="what is allocated"))
    for o in d.ooms:
        lines.append(
            f"OOM at event {o.index}: {format_size(o.size)} requested, "
            f"{_size(o.device_free)} free on the device, {format_size(o.allocated)} allocated, "
            f"{format_size(o.reserved)} reserved; at {_where(o.frames)}"
        )
    if d.peak_largest:
        lines.append(
            text.table(
                ["bytes", "category", "where"],
                _allocation_rows(d.peak_largest),
                title="largest allocations at the peak",
            )
        )
    if d.largest:
        lines.append(
            text.table(
                ["bytes", "category", "where"],
                _allocation_rows(d.largest),
                title="largest allocations at the end",
            )
        )
    return lines


def _device_html(d: DeviceInspection) -> str:
    body = [f"<h2>device {d.device}</h2>"]
    body.extend(f'<p class="note">{h.escape(line)}</p>' for line in _summary(d))
    parts = [
        ("allocated", float(d.allocated)),
        ("free in split blocks", float(d.inactive_split)),
        ("empty segments", float(d.empty_segments)),
    ]
    if d.reserved > 0:
        body.append(h.stacked_bar(parts, float(d.reserved)))
        body.append(h.legend([name for name, _ in parts]))
    rows = _category_rows(d)
    if rows:
        body.append("<h3>What is allocated</h3>")
        body.append(h.table(_category_headers(d), rows))
    if len(d.timeline) > 1:
        series = [("allocated", [(float(i), float(a)) for i, a, _ in d.timeline])]
        if any(r != a for _, a, r in d.timeline):
            series.append(("reserved", [(float(i), float(r)) for i, _, r in d.timeline]))
        body.append("<h3>Memory over the trace</h3>")
        body.append(
            h.line_plot(
                series,
                width=900,
                height=220,
                x_label="trace event",
                y_label="memory",
                y_bytes=True,
                x_integer=True,
            )
        )
    if d.ooms:
        body.append("<h3>Out of memory</h3>")
        body.append(
            h.table(
                ["event", "requested", "free on device", "allocated", "reserved", "where"],
                [
                    [
                        o.index,
                        format_size(o.size),
                        _size(o.device_free),
                        format_size(o.allocated),
                        format_size(o.reserved),
                        _where(o.frames),
                    ]
                    for o in d.ooms
                ],
            )
        )
    for title, allocs in (("at the peak", d.peak_largest), ("at the end", d.largest)):
        if allocs:
            body.append(f"<h3>Largest allocations {title}</h3>")
            body.append(
                h.table(
                    ["bytes", "category", "where", "frames"],
                    [
                        [
                            format_size(a.size),
                            a.category,
                            a.where,
                            h.Raw("<br>".join(h.escape(f.short) for f in a.frames[:12])),
                        ]
                        for a in allocs
                    ],
                )
            )
    return "".join(body)


# -- reading ------------------------------------------------------------------------------------


class _Refused(Exception):
    """The pickle asked for a class: not a memory snapshot."""


class _SnapshotUnpickler(pickle.Unpickler):
    """Builds only dicts, lists, tuples, strings and numbers; refuses every class."""

    def find_class(self, module: str, name: str) -> Any:
        raise _Refused(f"{module}.{name}")

    def persistent_load(self, pid: Any) -> Any:
        raise _Refused("a persistent id (torch.save's storages)")


_EXPECTED = (
    "expected a PyTorch memory snapshot: the pickle torch.cuda.memory._dump_snapshot() writes, "
    "or memkit run --memory-history FILE"
)


def load_snapshot(path: str | Path) -> tuple[dict[str, Any], int | None]:
    """Read a snapshot pickle: ``(snapshot, pickle protocol)``.

    Raises:
        ConfigError: no such file, not a pickle, a pickle of something else, a protocol this
            Python cannot read; the message says which and what was expected (exit 2).
    """
    path = Path(path)
    where = str(path)
    if not path.exists():
        raise ConfigError(f"{where!r}: no such file; {_EXPECTED}")
    if path.is_dir():
        raise ConfigError(f"{where!r} is a folder; {_EXPECTED}")
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise ConfigError(
            f"{where!r}: cannot be read ({exc.strerror or exc}); {_EXPECTED}"
        ) from None
    if not data:
        raise ConfigError(f"{where!r} is empty; {_EXPECTED}")
    if data[:4] == b"PK\x03\x04":
        raise ConfigError(
            f"{where!r} is a zip archive (what torch.save writes), not a pickled snapshot; "
            f"{_EXPECTED}"
        )
    protocol = data[1] if data[0] == 0x80 and len(data) > 1 else None
    try:
        loaded = _SnapshotUnpickler(io.BytesIO(data)).load()
    except _Refused as exc:
        raise ConfigError(
            f"{where!r} is a pickle of other objects (it names {exc}); a memory snapshot holds "
            f"only dicts, lists, strings and numbers, and memkit loads nothing else (unpickling "
            f"objects can run code); {_EXPECTED}"
        ) from None
    except ValueError as exc:
        if protocol is not None and protocol > pickle.HIGHEST_PROTOCOL:
            raise ConfigError(
                f"{where!r} is pickle protocol {protocol}, newer than this Python "
                f"({sys.version.split()[0]}) reads (up to {pickle.HIGHEST_PROTOCOL}); inspect it "
                "with the Python that wrote it, or have it saved with protocol 4"
            ) from None
        raise ConfigError(f"{where!r} is not a readable pickle ({exc}); {_EXPECTED}") from None
    except Exception as exc:  # UnpicklingError, EOFError, and whatever garbage bytes cause
        raise ConfigError(
            f"{where!r} is not a pickle (or a truncated one: {type(exc).__name__}: "
            f"{str(exc)[:200]}); {_EXPECTED}"
        ) from None
    return _normalise(loaded, where), protocol


def _describe(value: Any) -> str:
    if isinstance(value, dict):
        keys = sorted(map(str, value))[:8]
        return f"a dict with keys {keys}"
    if isinstance(value, (list, tuple)):
        return f"a {type(value).__name__} of {len(value)} item(s)"
    return f"a {type(value).__name__}"


def _normalise(data: Any, where: str) -> dict[str, Any]:
    """The snapshot as ``{"segments": [...], "device_traces": [[...], ...], ...}``; a list of
    segments (``torch.cuda.memory_snapshot()``, older dumps) is accepted, as memory_viz does."""
    if isinstance(data, list) and all(isinstance(s, dict) and "blocks" in s for s in data):
        data = {"segments": data, "device_traces": []}
    if not isinstance(data, dict) or "segments" not in data:
        raise ConfigError(
            f"{where!r} holds {_describe(data)}, not a memory snapshot ('segments' and "
            f"'device_traces'); {_EXPECTED}"
        )
    segments = data["segments"]
    traces = data.get("device_traces", data.get("traces", []))
    if not isinstance(segments, list) or not all(
        isinstance(s, dict) and isinstance(s.get("blocks"), list) for s in segments
    ):
        raise ConfigError(
            f"{where!r}: 'segments' should be a list of segments with 'blocks', found "
            f"{_describe(segments)}; {_EXPECTED}"
        )
    if not isinstance(traces, list) or not all(isinstance(t, list) for t in traces):
        raise ConfigError(
            f"{where!r}: 'device_traces' should be a list with one list of events per device, "
            f"found {_describe(traces)}; {_EXPECTED}"
        )
    for i, seg in enumerate(segments):
        for key in ("total_size",):
            if not isinstance(seg.get(key), int):
                raise ConfigError(f"{where!r}: segment {i} has no integer {key!r}; {_EXPECTED}")
        for b in seg["blocks"]:
            if not isinstance(b, dict) or not isinstance(b.get("size"), int):
                raise ConfigError(
                    f"{where!r}: segment {i} has a block without an integer 'size'; {_EXPECTED}"
                )
    for d, trace in enumerate(traces):
        for e in trace:
            if not isinstance(e, dict) or not isinstance(e.get("action"), str):
                raise ConfigError(
                    f"{where!r}: device {d}'s trace has an event without an 'action'; {_EXPECTED}"
                )
    return {**data, "segments": segments, "device_traces": traces}


# -- analysis -----------------------------------------------------------------------------------


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
    for seg in segments:
        total = int(seg["total_size"])
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
                live[b_addr] = (size, req, _frames(_block_frames(b)))
            else:
                free_here.append(size)
                largest_free = max(largest_free, size)
            addr = b_addr + size
        if has_active:
            split += sum(free_here)
            split_blocks += len(free_here)
        else:
            empty += total
    categories = {a: categorize(f) for a, (_, _, f) in live.items()}
    end_allocs = [
        Allocation(a, size, req, categories[a], frames) for a, (size, req, frames) in live.items()
    ]
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
    return DeviceInspection(**result)


def _trace(
    trace: list[dict[str, Any]],
    live: dict[int, tuple[int, int, tuple[Frame, ...]]],
    end_level: int,
    end_reserved: int,
    top: int,
) -> dict[str, Any]:
    """Peak, categories at the peak, OOMs and the timeline, walked back from the end."""
    n = len(trace)
    alloc_at: dict[Any, int] = {}
    paired: dict[int, int | None] = {}
    allocs = frees = 0
    delta = [0] * n
    res_delta = [0] * n
    for i, e in enumerate(trace):
        action, addr, size = e["action"], e.get("addr"), e.get("size", 0)
        size = size if isinstance(size, int) else 0
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
    # what was live at the peak: undo the events after it
    state = {a: (req, frames) for a, (_, req, frames) in live.items()}
    for i in range(n - 1, peak_index, -1):
        e = trace[i]
        if e["action"] == "alloc":
            state.pop(e.get("addr"), None)  # type: ignore[arg-type]
        elif e["action"] == "free_completed":
            j = paired.get(i)
            frames = _frames(trace[j].get("frames")) if j is not None else ()
            size = e.get("size", 0)
            state[e.get("addr")] = (size if isinstance(size, int) else 0, frames)  # type: ignore[index]
    peak_allocs = [
        Allocation(a if isinstance(a, int) else 0, req, req, categorize(frames), frames)
        for a, (req, frames) in state.items()
    ]
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
                    frames=_frames(e.get("frames")),
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
        data, protocol, name = _normalise(dict(source), "<dict>"), None, "<dict>"
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
    advice, advice_notes = _advice(devices, simulated=meta is not None, expandable=expandable)
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
        "categories are guessed from each allocation's Python frames (optimizer code, "
        "backward, module construction, forward; see docs/memory-history.md); 'unknown': no "
        "frames were recorded (allocated before recording began, or without stacks)"
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


def _advice(
    devices: Sequence[DeviceInspection], *, simulated: bool, expandable: bool | None
) -> tuple[list[Advice], list[str]]:
    """``fragmentation`` per device, and notes on OOMs it does not explain."""
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
            found = advice_rules.fragmentation(
                reserved=last.reserved,
                allocated=last.allocated,
                device=name,
                tried_to_allocate=last.size,
            )
        else:
            peak = max(d.allocated, d.peak_allocated or 0)
            found = advice_rules.fragmentation(
                reserved=d.reserved, allocated=d.allocated, device=name, peak_allocated=peak
            )
        if found is not None:
            out.append(found)
    return out, notes
