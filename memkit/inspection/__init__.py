"""``memkit inspect``: memkit's view of a PyTorch memory snapshot, from any run.

A snapshot is the pickle ``torch.cuda.memory._dump_snapshot`` writes (or memkit's
``--memory-history``, the same format from the simulated device; see
:mod:`memkit.simulated.history`). :func:`inspect_snapshot` reads it and returns a frozen
:class:`SnapshotInspection`: per device,

* **free memory and fragmentation**: reserved (segments) against allocated (active blocks); the
  free bytes in whole empty segments (cache: ``empty_cache`` returns them) apart from those in
  segments that also hold live blocks (*split* blocks); fragmentation as the share of the free
  memory that cannot serve a reference request (the failed one at an OOM, else the typical
  large one);
* **what is allocated**, at the end and at the trace's peak, by category, guessed from each
  allocation's Python frames (:func:`categorize`), gradients bounded by the parameters
  (:func:`~memkit.inspection.frames.bound_gradients`);
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

from memkit.inspection.analysis import MAX_TIMELINE_POINTS, inspect_snapshot
from memkit.inspection.frames import CATEGORIES, Frame, categorize
from memkit.inspection.loading import load_snapshot
from memkit.inspection.results import (
    Allocation,
    DeviceInspection,
    OomEvent,
    SnapshotInspection,
)

__all__ = [
    "CATEGORIES",
    "MAX_TIMELINE_POINTS",
    "Allocation",
    "DeviceInspection",
    "Frame",
    "OomEvent",
    "SnapshotInspection",
    "categorize",
    "inspect_snapshot",
    "load_snapshot",
]
