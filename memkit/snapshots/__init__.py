"""Snapshots: every device at a glance, and what changed between two moments.

:func:`snapshot` reads each visible device (through :mod:`memkit.devices`, the one module that
touches hardware), the host's memory, and, when given a model and an optimizer, what this
process's memory is made of: parameters, buffers, gradients, optimizer state and other tensors.
The result is a frozen :class:`Snapshot` that renders as a text table (``repr``), an HTML table
with a stacked bar per device (``_repr_html_``, shown by notebooks) and JSON (:meth:`~Snapshot.
to_json`). Subtracting two snapshots gives a :class:`SnapshotDiff` that lists only what changed.

Three numbers people mix up, each on the rendering:

* **allocated**: bytes of live tensors this process made (``torch.cuda.memory_allocated``);
* **reserved**: allocated plus blocks PyTorch's caching allocator keeps for reuse; the gap is
  cache and fragmentation, and ``torch.cuda.empty_cache()`` gives it back to the driver;
* **used** (what nvidia-smi shows): reserved plus the CUDA context of every process on the device
  (a few hundred MiB each) plus the memory of other processes.

Reading device-wide memory never creates a CUDA context on a device this process has not used:
the driver's view (NVML through nvidia-ml-py, else nvidia-smi through GPUtil) is read first,
``cudaMemGetInfo`` only for devices this process
already holds memory on or that were named explicitly. A value that cannot be read is ``None``
with a reason (:meth:`DeviceSnapshot.why`), never a crash.

Examples:
    >>> import torch, memkit
    >>> model = torch.nn.Linear(8, 8)
    >>> snap = memkit.snapshot(model)
    >>> snap.categories[0].parameters
    288
"""

from memkit.render.snapshots import BAR_LABELS
from memkit.snapshots.reading import DeviceArg, snapshot
from memkit.snapshots.results import (
    EXPLAIN,
    SCHEMA,
    Categories,
    Change,
    DeviceSnapshot,
    HostSnapshot,
    Snapshot,
    SnapshotDiff,
    TensorInfo,
)

__all__ = [
    "BAR_LABELS",
    "EXPLAIN",
    "SCHEMA",
    "Categories",
    "Change",
    "DeviceArg",
    "DeviceSnapshot",
    "HostSnapshot",
    "Snapshot",
    "SnapshotDiff",
    "TensorInfo",
    "snapshot",
]
