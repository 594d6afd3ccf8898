"""Which storage a listed tensor is: a number per storage object, the same in every snapshot
this process takes while that storage lives, and never given to a later storage.

A data pointer is not an identity: after a free, the allocator hands the same address (and often
the same size) to the next tensor. So the number is bound to the storage object itself, through
a weak reference: when the storage is freed its number is retired, and a storage made later at
the same address gets a new one. PyTorch keeps a storage's Python object for as long as the
storage lives (tensors and views holding it), so the number does not change while it lives.
"""

from __future__ import annotations

import itertools
import threading
import weakref
from typing import Any

__all__ = ["still_holds", "storage_serial"]

_lock = threading.RLock()  # a collection inside the lock may run _retire in this thread
_serials = itertools.count(1)
_by_object: dict[int, tuple[weakref.ref[Any], int]] = {}  # id(storage) -> (ref, serial)
_by_serial: dict[int, weakref.ref[Any]] = {}


def _retire(object_id: int, serial: int) -> None:
    """A storage died: forget its number (unless its id already went to a newer storage)."""
    with _lock:
        _by_serial.pop(serial, None)
        known = _by_object.get(object_id)
        if known is not None and known[1] == serial:
            del _by_object[object_id]


def storage_serial(storage: Any) -> int | None:
    """The number of ``storage`` (a ``torch.UntypedStorage``), or ``None`` if it cannot be
    referenced weakly."""
    object_id = id(storage)
    with _lock:
        known = _by_object.get(object_id)
        if known is not None and known[0]() is storage:
            return known[1]
        serial = next(_serials)
        try:
            ref = weakref.ref(storage, lambda _ref: _retire(object_id, serial))
        except TypeError:
            return None
        _by_object[object_id] = (ref, serial)
        _by_serial[serial] = ref
        return serial


def still_holds(serial: int, nbytes: int) -> bool:
    """Whether the storage numbered ``serial`` (in this process) is alive and still holds
    ``nbytes`` (a storage resized to 0, as FSDP frees its parameters, does not)."""
    ref = _by_serial.get(serial)
    storage = None if ref is None else ref()
    return storage is not None and int(storage.nbytes()) == nbytes
