"""Memory history: PyTorch's memory-snapshot format, recorded on CUDA or on the simulated device.

PyTorch records what its CUDA caching allocator does with
``torch.cuda.memory._record_memory_history`` and saves it with ``_dump_snapshot``: a pickled dict
that https://pytorch.org/memory_viz and ``torch.cuda._memory_viz`` draw. It has

* ``segments``: the memory held at the end, one dict per ``cudaMalloc``'d segment (``device``,
  ``address``, ``total_size``, ``stream``...), each split into ``blocks`` (``size``,
  ``requested_size``, ``state``: ``active_allocated``/``active_pending_free``/``inactive``, and
  the ``frames`` of the allocation);
* ``device_traces``: one list per device of events (``action``: ``alloc``, ``free_requested``,
  ``free_completed``, ``segment_alloc``, ``segment_free``, ``oom``...; ``addr``, ``size``,
  ``stream``, ``frames``, ``time_us``; an ``oom`` has ``device_free`` instead of ``addr``).

A frame is ``{"filename", "line", "name"}``, innermost first.

:class:`~memkit.devices.history.MemoryHistory` is what ``memkit.track(..., memory_history=FILE)``
and ``memkit run --memory-history FILE`` use: on CUDA PyTorch records (python stacks, a bounded
ring of events); on the simulated device :class:`SimulatedHistory`, here, records the same format
from memkit's own accounting, so a trace taken on a machine without a GPU opens in memory_viz. Files
are written with pickle protocol 4 (:data:`PICKLE_PROTOCOL`): memory_viz's reader accepts protocols
2 to 4, and Python 3.14 pickles with protocol 5 by default (``_dump_snapshot`` uses the default, so
memkit pickles the snapshot itself).

The simulated layout (memkit's choice; a CPU has no caching allocator to copy):

* one segment per live storage, holding one ``active_allocated`` block of the storage's counted
  bytes: reserved equals allocated, as on the simulated device;
* per storage the events ``segment_alloc``, ``alloc`` when it is counted and ``free_requested``,
  ``free_completed``, ``segment_free`` when it is freed; an ``oom`` event (with ``device_free``,
  the budget left) when an op crosses the budget;
* addresses are memkit's own, from :data:`ADDRESS_BASE` up in allocation order, aligned to 512
  bytes and never reused (they are not host addresses);
* frames come from walking the Python stack (``sys._getframe``), innermost first, at most
  ``frame_depth`` of them, memkit's own frames left out; frees get the stack where the last
  reference went. A storage that existed before (made during data loading or before the block,
  counted when an op first reads it) gets an innermost marker frame
  ``{"filename": "<memkit: existed before an op read it>", "line": 0, "name": "parameter"}``
  (``"tensor"`` for anything but an ``nn.Parameter``) above the stack where it was first read;
* a ``memkit`` key says who wrote it, the device, the budget and how many events were dropped.
"""

from __future__ import annotations

import logging
import os
import pickle
import sys
import threading
import time
from collections import deque
from pathlib import Path
from types import FrameType
from typing import Any

from memkit._version import __version__
from memkit.simulated.accountant import MemoryAccountant

__all__ = [
    "ADDRESS_BASE",
    "ADOPTED_FILENAME",
    "DEFAULT_FRAME_DEPTH",
    "DEFAULT_MAX_ENTRIES",
    "PICKLE_PROTOCOL",
    "SimulatedHistory",
    "without_memkit_frames",
    "write_snapshot",
]

log = logging.getLogger(__name__)

PICKLE_PROTOCOL = 4
"""The protocol memkit writes: memory_viz's unpickler rejects anything above 4."""
DEFAULT_MAX_ENTRIES = 100_000
"""Events kept (the most recent), on CUDA and on the simulated device."""
DEFAULT_FRAME_DEPTH = 64
"""Python frames kept per event on the simulated device (the innermost ones)."""
ADDRESS_BASE = 1 << 40
"""The first address the simulated device hands out (1 TiB: clear of zero, exact in JavaScript)."""
ALIGNMENT = 512
"""Simulated addresses are multiples of this (the CUDA caching allocator's block size)."""
LARGE_SEGMENT = 1 << 20
"""Segments above 1 MiB are ``large`` (the CUDA allocator's pool split)."""
ADOPTED_FILENAME = "<memkit: existed before an op read it>"
"""The marker frame's filename for storages counted when first read (see the module docs)."""

_ALLOC, _FREE_REQUESTED, _FREE_COMPLETED, _SEGMENT_ALLOC, _SEGMENT_FREE, _OOM = range(6)
_ACTIONS = ("alloc", "free_requested", "free_completed", "segment_alloc", "segment_free", "oom")

_MEMKIT_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep
_TORCH_WRAPPERS = (
    "torch/_compile.py",
    "torch/_dynamo/eval_frame.py",
    "torch/utils/_python_dispatch.py",
)
_INTERNAL: dict[str, bool] = {}


def _internal(filename: str) -> bool:
    """memkit's own files and torch's dispatch wrappers: left out at the top of a stack."""
    known = _INTERNAL.get(filename)
    if known is None:
        path = filename.replace(os.sep, "/")
        known = filename.startswith(_MEMKIT_DIR) or path.endswith(_TORCH_WRAPPERS)
        _INTERNAL[filename] = known
    return known


_PACKAGE_DIR = os.path.dirname(_MEMKIT_DIR.rstrip(os.sep)) + os.sep
_LAUNCHERS = {
    (os.path.join(_PACKAGE_DIR, "tracking", "run.py"), name)
    for name in ("_exec_as_main", "_run_module_as_main")
}
"""``memkit run``'s frames that run the script or the module (``-m``): the script's own
stack ends under them (with runpy's frames between, for ``-m`` and a zip application)."""
_DISABLE_WRAPPER = "torch/_dynamo/external_utils.py"
"""The file of the wrapper ``torch._dynamo.disable`` puts around a function (memkit's hooks)."""


def _users_frames(frames: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``frames`` (innermost first) as the script's own run would have recorded them: without
    memkit's frames (its wrappers of ``backward`` and its hooks), the Dynamo-disable wrapper
    around each of them, and, under ``memkit run``, the launcher's frames below the script's
    ``<module>`` (memkit's command line, click, runpy)."""
    kept: list[dict[str, Any]] = []
    after_memkit = False
    for frame in frames:
        filename = frame.get("filename", "")
        if filename.startswith(_PACKAGE_DIR):
            if (filename, frame.get("name")) in _LAUNCHERS:
                while kept and "runpy" in kept[-1].get("filename", ""):
                    kept.pop()  # (runpy.run_module's frames under the module's <module>)
                break
            after_memkit = True
            continue
        if after_memkit and filename.replace(os.sep, "/").endswith(_DISABLE_WRAPPER):
            continue
        after_memkit = False
        kept.append(frame)
    return kept


def without_memkit_frames(snapshot: dict[str, Any]) -> dict[str, Any]:
    """``snapshot`` (PyTorch's format: recorded on CUDA or by :class:`SimulatedHistory`) with
    every stack as the script's own run would show it (:func:`_users_frames`), so that the
    viewer and ``memkit inspect`` show the user's lines, not memkit's. Frames lists shared
    between events stay shared; the dict is changed in place and returned."""
    done: dict[int, list[dict[str, Any]]] = {}

    def clean(entry: dict[str, Any]) -> None:
        frames = entry.get("frames")
        if frames:
            found = done.get(id(frames))
            if found is None:
                found = done[id(frames)] = _users_frames(frames)
            entry["frames"] = found

    for segment in snapshot.get("segments", ()):
        clean(segment)
        for block in segment.get("blocks", ()):
            clean(block)
    for trace in snapshot.get("device_traces", ()):
        for event in trace:
            clean(event)
    return snapshot


def write_snapshot(snapshot: dict[str, Any], path: str | Path) -> Path:
    """Pickle ``snapshot`` to ``path`` with protocol 4 (atomically: a partial file never
    replaces a good one); returns the path."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:
            pickle.dump(snapshot, f, protocol=PICKLE_PROTOCOL)
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    return path


class SimulatedHistory:
    """Records a :class:`~memkit.simulated.accountant.MemoryAccountant`'s allocations and frees in
    PyTorch's memory-snapshot format (layout in the module docs).

    ``start()`` makes it the accountant's observer (while nobody observes, the accountant pays
    nothing); storages already counted then are in the snapshot's segments without frames, as
    on CUDA for blocks allocated before recording began. ``snapshot()`` returns the dict,
    ``dump(path)`` writes it, ``stop()`` detaches.

    Examples:
        >>> import torch, memkit
        >>> from memkit.simulated.history import SimulatedHistory
        >>> with memkit.simulate("64MiB") as acct:
        ...     history = SimulatedHistory(acct).start()
        ...     x = torch.empty(1024)
        >>> history.stop()
        >>> [e["action"] for e in history.snapshot()["device_traces"][0]]
        ['segment_alloc', 'alloc']
    """

    def __init__(
        self,
        accountant: MemoryAccountant,
        *,
        max_entries: int = DEFAULT_MAX_ENTRIES,
        frame_depth: int = DEFAULT_FRAME_DEPTH,
    ) -> None:
        if max_entries < 1 or frame_depth < 1:
            raise ValueError("max_entries and frame_depth must be positive")
        self.accountant = accountant
        self.max_entries = max_entries
        self.frame_depth = frame_depth
        self.events_recorded = 0
        # Events and live entries are tuples of ints (action, address, size, stack id, time):
        # the garbage collector stops tracking those, so a full ring costs it nothing. A stack
        # id indexes self._stacks, one frames list per distinct stack (shared in the pickle).
        self._events: deque[tuple[int, int, int, int, int]] = deque(maxlen=max_entries)
        self._live: dict[int, tuple[int, int, int, int]] = {}  # key -> (addr, size, req, stack)
        self._next = ADDRESS_BASE
        self._stacks: list[list[dict[str, Any]]] = [[]]  # id 0: no frames
        self._stack_ids: dict[tuple[Any, ...], int] = {}
        self._frames: dict[tuple[int, int], dict[str, Any]] = {}
        self._codes: dict[int, Any] = {}  # keeps each code object alive, so its id stays its own
        self._markers = {
            None: None,
            "parameter": {"filename": ADOPTED_FILENAME, "line": 0, "name": "parameter"},
            "tensor": {"filename": ADOPTED_FILENAME, "line": 0, "name": "tensor"},
        }
        # The accountant calls the observer methods under its own lock; this one keeps
        # snapshot() from reading the events while they change. Re-entrant: a collection
        # inside snapshot() can free a counted storage, and freed() then runs in this thread.
        self._lock = threading.RLock()
        self._recording = False

    @property
    def recording(self) -> bool:
        """Whether this history observes its accountant."""
        return self._recording

    # -- hooking --------------------------------------------------------------------------
    def start(self) -> SimulatedHistory:
        """Observe the accountant; returns ``self``.

        Raises:
            RuntimeError: another observer (another history) already records this accountant.
        """
        self.accountant.observe(self)
        self._recording = True
        return self

    def stop(self) -> None:
        """Stop observing the accountant (what was recorded stays)."""
        if self._recording:
            self.accountant.stop_observing()
            self._recording = False

    # -- the observer (memkit.simulated.accountant.StorageObserver, called under the accountant's
    # lock) --
    def _address(self, nbytes: int) -> int:
        addr = self._next
        self._next += -(-max(nbytes, 1) // ALIGNMENT) * ALIGNMENT
        return addr

    def already_counted(self, storages: list[tuple[int, int, int]]) -> None:
        with self._lock:
            for key, counted, requested in storages:
                if counted > 0 and key not in self._live:
                    self._live[key] = (self._address(counted), counted, requested, 0)

    def allocated(self, key: int, counted: int, requested: int, existed: str | None) -> None:
        if counted <= 0:
            return
        stack = self._stack(existed)
        now = time.time_ns() // 1000
        with self._lock:
            addr = self._address(counted)
            self._live[key] = (addr, counted, requested, stack)
            events = self._events
            events.append((_SEGMENT_ALLOC, addr, counted, stack, now))
            events.append((_ALLOC, addr, requested, stack, now))
            self.events_recorded += 2

    def freed(self, key: int, counted: int) -> None:
        with self._lock:
            entry = self._live.pop(key, None)
            if entry is None:
                return
            addr, size, requested, _ = entry
            stack = self._stack(None)
            now = time.time_ns() // 1000
            events = self._events
            events.append((_FREE_REQUESTED, addr, requested, stack, now))
            events.append((_FREE_COMPLETED, addr, requested, stack, now))
            events.append((_SEGMENT_FREE, addr, size, stack, now))
            self.events_recorded += 3

    def out_of_memory(self, tried: int, free: int) -> None:
        stack = self._stack(None)
        with self._lock:
            self._events.append((_OOM, free, tried, stack, time.time_ns() // 1000))
            self.events_recorded += 1

    def _stack(self, marker: str | None) -> int:
        """The id of the Python stack here, innermost first, memkit's frames at the top left
        out (``marker``: ``"parameter"`` or ``"tensor"`` puts that marker frame above it)."""
        f: FrameType | None = sys._getframe(2)
        while f is not None and _internal(f.f_code.co_filename):
            f = f.f_back
        frames: list[FrameType] = []
        key: list[Any] = [marker]
        depth = self.frame_depth
        while f is not None and len(frames) < depth:
            frames.append(f)
            key.append(id(f.f_code))
            key.append(f.f_lasti)
            f = f.f_back
        stack_key = tuple(key)
        found = self._stack_ids.get(stack_key)
        if found is not None:
            return found
        marker_frame = self._markers[marker]
        stack = [] if marker_frame is None else [marker_frame]
        cache = self._frames
        for frame in frames:
            code = frame.f_code
            fkey = (id(code), frame.f_lasti)
            entry = cache.get(fkey)
            if entry is None:
                entry = {"filename": code.co_filename, "line": frame.f_lineno or 0,
                         "name": code.co_name}  # fmt: skip
                cache[fkey] = entry
                self._codes[id(code)] = code
            stack.append(entry)
        self._stacks.append(stack)
        self._stack_ids[stack_key] = len(self._stacks) - 1
        return len(self._stacks) - 1

    # -- results --------------------------------------------------------------------------
    def snapshot(self) -> dict[str, Any]:
        """The recorded history in PyTorch's snapshot format (a new dict; frames are shared)."""
        acct = self.accountant
        with self._lock:
            live = sorted(self._live.values(), key=lambda e: e[0])
            events = list(self._events)
            recorded = self.events_recorded
        segments = []
        stacks = self._stacks
        for addr, size, requested, stack in live:
            frames = stacks[stack]
            block = {
                "address": addr,
                "size": size,
                "requested_size": requested,
                "state": "active_allocated",
                "frames": frames,
            }
            segments.append(
                {
                    "device": 0,
                    "address": addr,
                    "total_size": size,
                    "allocated_size": size,
                    "active_size": size,
                    "requested_size": requested,
                    "stream": 0,
                    "segment_type": "large" if size > LARGE_SEGMENT else "small",
                    "segment_pool_id": (0, 0),
                    "is_expandable": False,
                    "frames": frames,
                    "blocks": [block],
                }
            )
        trace = []
        for action, addr, size, stack, when in events:
            trace.append(
                {
                    "action": _ACTIONS[action],
                    "device_free" if action == _OOM else "addr": addr,
                    "size": size,
                    "stream": 0,
                    "frames": stacks[stack],
                    "time_us": when,
                }
            )
        return {
            "segments": segments,
            "device_traces": [trace],
            "memkit": {
                "writer": f"memkit {__version__}",
                "device": f"simulated {acct.device}",
                "budget": acct.budget,
                "rounding": acct.rounding,
                "layout": "one segment per storage; memkit's own addresses",
                "max_entries": self.max_entries,
                "frame_depth": self.frame_depth,
                "events_recorded": recorded,
                "events_dropped": recorded - len(events),
            },
        }

    def dump(self, path: str | Path) -> Path:
        """Write :meth:`snapshot` to ``path`` (pickle protocol 4)."""
        return write_snapshot(self.snapshot(), path)
