"""A step's own ``torch.autocast("cuda", ...)`` regions where no GPU runs them.

A CPU build of torch disables a CUDA autocast object when it is made (with a warning), so
what the file asked for is lost; on a CUDA build probing the simulated device it stays on but
casts nothing on CPU tensors. The estimate runs such regions as the target GPU would
(:mod:`memkit.estimation.meta_step`), and the probe on a non-CUDA device says its numbers are
not the region's dtype (:func:`regions_entered`), and so does the tracker, which counts a
training forward inside such a region as one under autocast (:func:`inside`).
"""

from __future__ import annotations

import contextlib
import threading
import warnings
from collections.abc import Iterator
from typing import Any

import torch

from memkit.patching import Restore

__all__ = ["inside", "regions_entered", "requested", "requests_recorded"]

_open = threading.local()  # per thread: (region id, half?) of the CUDA autocast regions now
# entered, innermost last; ``busy``: inside a watched enter or exit (nested watches: once)


def inside() -> bool:
    """Whether this thread's innermost CUDA autocast region that the block of
    :func:`regions_entered` saw entered asks for half precision (which a device that is not
    CUDA runs in float32)."""
    stack: list[tuple[int, bool]] = getattr(_open, "stack", [])
    return bool(stack) and stack[-1][1]


def requested(region: Any) -> tuple[torch.dtype, bool] | None:
    """The ``(dtype, enabled)`` a CUDA autocast object made under :func:`requests_recorded`
    asked for; ``None`` for any other object."""
    return getattr(region, "_memkit_region", None)


@contextlib.contextmanager
def requests_recorded() -> Iterator[None]:
    """torch's ``autocast("cuda", ...)`` objects made in the block, in this thread, keep the
    ``(dtype, enabled)`` they asked for (:func:`requested`), which a CPU build overrides (it
    disables them with a warning, silenced here). Loading a model file under it covers the
    objects made at its top (nanoGPT's ``ctx``, a ``@torch.autocast("cuda", enabled=False)``
    on a function)."""
    cls = torch.amp.autocast_mode.autocast
    init, thread = cls.__init__, threading.get_ident()

    def __init__(self: Any, device_type: str, *args: Any, **kwargs: Any) -> None:
        if device_type != "cuda" or threading.get_ident() != thread or not handle.live:
            init(self, device_type, *args, **kwargs)
            return
        given = dict(zip(("dtype", "enabled", "cache_enabled"), args, strict=False)) | kwargs
        with warnings.catch_warnings():  # "CUDA is not available ... Disabling autocast"
            warnings.simplefilter("ignore")
            init(self, device_type, *args, **kwargs)
        dtype = given.get("dtype") or torch.get_autocast_dtype("cuda")
        self._memkit_region = (dtype, bool(given.get("enabled", True)))

    # (blocks in two threads may end in any order: Restore puts torch's own back last)
    handle = Restore(cls, "__init__", init, __init__)
    cls.__init__ = __init__  # type: ignore[method-assign]
    try:
        yield
    finally:
        handle.remove()


@contextlib.contextmanager
def regions_entered() -> Iterator[set[torch.dtype]]:
    """The half-precision dtypes of the CUDA autocast regions the block enters in this thread
    (made in the block, or under an earlier :func:`requests_recorded`), ``enabled=False``
    and float32 regions left out."""
    cls = torch.amp.autocast_mode.autocast
    enter, leave, thread = cls.__enter__, cls.__exit__, threading.get_ident()
    found: set[torch.dtype] = set()

    def __enter__(self: Any) -> Any:
        region = requested(self) if threading.get_ident() == thread and live[0].live else None
        if region is None or getattr(_open, "busy", False):
            return enter(self)
        _open.busy = True  # (a watch nested in this one patched enter too: it only enters)
        try:
            entered = enter(self)
        finally:
            _open.busy = False
        half = region[1] and region[0] in (torch.float16, torch.bfloat16)
        if half:
            found.add(region[0])
        _open.stack.append((id(self), half))  # (enabled=False nested in a region: not inside)
        return entered

    def __exit__(self: Any, *exc: Any) -> Any:
        stack = getattr(_open, "stack", None)
        dead = not live[1].live or threading.get_ident() != thread
        if not stack or dead or getattr(_open, "busy", False):
            return leave(self, *exc)
        for i in range(len(stack) - 1, -1, -1):  # this region's innermost entry
            if stack[i][0] == id(self):
                del stack[i]
                break
        _open.busy = True  # (a watch nested in this one patched exit too: it only exits)
        try:
            return leave(self, *exc)
        finally:
            _open.busy = False

    if not hasattr(_open, "stack"):
        _open.stack = []
    depth = len(_open.stack)
    live = (Restore(cls, "__enter__", enter, __enter__), Restore(cls, "__exit__", leave, __exit__))
    cls.__enter__ = __enter__  # type: ignore[method-assign]
    cls.__exit__ = __exit__  # type: ignore[method-assign]
    try:
        with requests_recorded():
            yield found
    finally:
        for handle in live:
            handle.remove()
        del _open.stack[depth:]  # a region still open at the block's end exits unwatched
