"""Virtual devices: the simulated device standing for N accelerators at once.

``memkit.simulate("24GiB", devices=4)`` (or ``simulate(["24GiB", "12GiB"])`` for unequal cards)
returns a :class:`VirtualDevices` accountant. The tensors stay ordinary ``cpu`` (or ``meta``)
tensors; what makes them live on "GPU i" is a tag the accountant keeps per storage:

* a tensor created by an op with tensor inputs lives on its inputs' device, as on CUDA;
* a tensor created by an op without tensor inputs (``torch.randn(...)``, ``torch.zeros``)
  lives on the *current* virtual device (0 unless :meth:`VirtualDevices.on` says
  otherwise; DataParallel's replicas run with their own device current, as in torch);
* a tensor that existed before the block and was never placed is on the **host** (``cpu``):
  it is not counted, and using it together with device tensors fails like on CUDA;
* :meth:`VirtualDevices.to` (``memkit.to_virtual``) places tensors, modules and optimizers.

An op whose tensors are on different devices raises PyTorch's ``RuntimeError`` ("Expected all
tensors to be on the same device, but found at least two devices, cuda:0 and cuda:1!"), with
CUDA's exceptions: a 0-dimensional host tensor may join device tensors, ``copy_`` copies across
devices, and the ``_foreach_*`` ops take lists spanning devices. Virtual device ``i`` is named
``cuda:i`` in messages and reports: it stands for that GPU.

Each device has its own current and peak bytes and its own budget; crossing device i's budget
raises ``torch.OutOfMemoryError`` naming ``cuda:i``. The single-device accountant
(:class:`~memkit.simulated.accountant.MemoryAccountant`) is unchanged: this subclass has its own
dispatch handler, so ``simulate(budget)`` costs what it did.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import weakref
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from memkit.simulated.accountant import MemoryAccountant, _tensors, tensors_of
from memkit.units import format_size, parse_size

__all__ = [
    "HOST",
    "SimulationError",
    "VirtualDevices",
    "active_virtual_devices",
    "device_name",
    "is_active",
    "to_virtual",
]

HOST = -1
"""The device index of host (cpu) tensors: not counted on any virtual device."""

_MIXED = "Expected all tensors to be on the same device, but found at least two devices, "


class SimulationError(RuntimeError):
    """An op found a tensor that memkit's own simulation of a strategy places (FSDP's
    parameters, gathered for a unit's forward and backward) where that simulation had left it:
    memkit's error, not the user's tensor placement. Worded as PyTorch's device-mismatch error,
    with what memkit knows."""


_ACTIVE: list[VirtualDevices] = []  # entered VirtualDevices, innermost last


def device_name(index: int) -> str:
    """``cuda:i`` for a virtual device, ``cpu`` for the host."""
    return "cpu" if index == HOST else f"cuda:{index}"


def active_virtual_devices() -> VirtualDevices | None:
    """The innermost :class:`VirtualDevices` block being run, if any."""
    return _ACTIVE[-1] if _ACTIVE else None


class VirtualDevices(MemoryAccountant):
    """Counts live storages per virtual device (``cuda:0`` ... ``cuda:N-1``), each with a budget.

    Args:
        budgets: one budget per device (bytes, a size string, or ``None`` for no limit).
        device: the real device the tensors are on: ``"cpu"`` (real compute) or ``"meta"``.
        rounding: ``"none"`` or ``"cuda"``, as for :class:`MemoryAccountant`.

    ``current``/``peak`` are the sums over devices; :meth:`current_of`, :meth:`peak_of` and
    :attr:`peaks` are per device.
    """

    def __init__(
        self,
        budgets: Sequence[int | str | None],
        device: str | torch.device = "cpu",
        *,
        rounding: str = "none",
    ) -> None:
        if not budgets:
            raise ValueError("virtual devices need at least one budget")
        super().__init__(device, None, rounding=rounding, name=f"{len(budgets)} virtual devices")
        self.budgets: list[int | None] = [None if b is None else parse_size(b) for b in budgets]
        self.n = len(self.budgets)
        self._where: dict[int, int] = {}
        self._cur = [0] * self.n
        self._peaks = [0] * self.n
        self._windows = [0] * self.n  # peaks a tracker reads and resets (peaks stay intact)
        self._tls = threading.local()
        # tensors whose placement memkit's own simulation manages, and which one (``managed``)
        self._managed: list[tuple[weakref.ref[torch.Tensor], str]] = []

    # -- counters ---------------------------------------------------------------------------
    def current_of(self, index: int) -> int:
        """Bytes live on virtual device ``index`` now."""
        return self._cur[index]

    def peak_of(self, index: int) -> int:
        """Peak bytes on virtual device ``index`` since creation or :meth:`reset_peak`."""
        return self._peaks[index]

    @property
    def peaks(self) -> list[int]:
        """Peak bytes per device."""
        return list(self._peaks)

    def reset_peak(self, index: int | None = None) -> None:
        """Set the peak of one device (or all, and the total) to its current bytes."""
        with self._lock:
            if index is None:
                self._peaks = list(self._cur)
                self._peak = self._current
            else:
                self._peaks[index] = self._cur[index]

    def window_peak(self, index: int) -> int:
        """Peak bytes on device ``index`` since :meth:`reset_window` (a tracker's segment)."""
        return self._windows[index]

    def window_counters(self, index: int) -> tuple[int, int]:
        """``(current, window peak)`` of device ``index`` in one call, for per-call hooks."""
        return self._cur[index], self._windows[index]

    def reset_window(self, index: int) -> None:
        """Start a new segment on device ``index``; :meth:`peak_of` is not affected."""
        self._windows[index] = self._cur[index]

    def where(self, tensor: torch.Tensor) -> int:
        """The virtual device of ``tensor`` (:data:`HOST` for host tensors)."""
        storage = self._storage(tensor)
        return HOST if storage is None else self._where.get(id(storage), HOST)

    # -- the current device (per thread) --------------------------------------------------------
    @property
    def current_device(self) -> int:
        """Where ops without tensor inputs put their outputs in this thread (default 0)."""
        return getattr(self._tls, "device", 0)

    @contextlib.contextmanager
    def on(self, index: int) -> Iterator[None]:
        """Make ``index`` (or :data:`HOST`) the current device, like ``torch.cuda.device``."""
        self._check_index(index)
        before = self.current_device
        self._tls.device = index
        try:
            yield
        finally:
            self._tls.device = before

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Ops in the block create host memory (memkit's own bookkeeping, data preparation)."""
        with self.on(HOST):
            before = self.counting
            self.counting = False
            try:
                yield
            finally:
                self.counting = before

    def _check_index(self, index: int) -> None:
        if index != HOST and not 0 <= index < self.n:
            raise RuntimeError(
                f"CUDA error: invalid device ordinal (cuda:{index}; {self.n} virtual devices: "
                f"cuda:0 to cuda:{self.n - 1})"
            )

    # -- placement ------------------------------------------------------------------------------
    def to(self, obj: Any, index: int) -> Any:
        """Place ``obj`` on virtual device ``index`` (:data:`HOST`: back to the host).

        A tensor is copied (a new storage on that device; the original is untouched), as
        ``tensor.to("cuda:i")`` does; a tensor already there is returned as is. A module's
        parameters, buffers and gradients and an optimizer's state move in place, as
        ``module.to("cuda:i")`` does. Returns the placed object.
        """
        self._check_index(index)
        if isinstance(obj, torch.Tensor):
            source = self.where(obj)
            if source == index:
                return obj
            return _Copied.apply(obj, self, source, index)
        self._place(list(tensors_of(obj)), index)
        return obj

    def _copy_to(self, tensor: torch.Tensor, index: int) -> torch.Tensor:
        """A copy of ``tensor`` on ``index``, counted there only."""
        with self.paused():
            copy = tensor.detach().clone()
        self._place([copy], index)
        return copy

    def managed(self, tensors: Sequence[torch.Tensor], by: str) -> None:
        """Mark ``tensors`` as placed by memkit's simulation ``by`` (``"memkit's simulated
        FSDP"``), not by the user: an op that finds one on the host, where that simulation left
        it, raises :class:`SimulationError` (memkit's error) rather than the placement hint."""
        self._managed += [(weakref.ref(t), by) for t in tensors]

    def _managed_on_host(self, inputs: list[torch.Tensor]) -> str | None:
        """The simulation that left one of ``inputs`` on the host, if one did."""
        if not self._managed:
            return None
        owners = {}
        for ref, by in self._managed:
            t = ref()
            if t is not None:
                owners[t.untyped_storage()._cdata] = by
        for t in inputs:
            if self.where(t) != HOST:
                continue
            try:
                key = t.untyped_storage()._cdata
            except Exception:  # a wrapper with no storage of its own
                continue
            if key in owners:
                return owners[key]
        return None

    def _place(self, tensors: list[torch.Tensor], index: int) -> None:
        """Tag the storages of ``tensors`` as living on ``index`` (bytes move with them)."""
        pending: dict[int, tuple[Any, int]] = {}
        for tensor in tensors:
            storage = self._storage(tensor)
            if storage is not None:
                pending.setdefault(id(storage), (storage, self._size(storage)))
        with self._lock:
            for key, (_, nbytes) in pending.items():
                old = self._where.pop(key, HOST)
                if old != HOST:
                    self._live.pop(key, None)
                    self._cur[old] -= nbytes
                    self._current -= nbytes
            if index == HOST:
                return
            added = sum(n for _, n in pending.values())
            budget = self.budgets[index]
            if budget is not None and self._cur[index] + added > budget:
                self.num_ooms += 1
                raise torch.OutOfMemoryError(self._oom_on(index, added))
            self._register_on(pending, index)

    def track(self, *objects: Any, inputs: bool = False) -> VirtualDevices:
        """Count existing objects on the current device (0 unless set), each storage whole
        (``inputs`` too: a batch is placed on a virtual device by ``.to``, a copy)."""
        index = self.current_device
        if index != HOST:
            self._place(list(tensors_of(objects)), index)
        return self

    def hold(self, index: int, nbytes: int) -> None:
        """Count ``nbytes`` that no tensor holds on device ``index`` until the block ends (a
        kernel's workspace, which PyTorch keeps once made); past the budget it raises
        ``torch.OutOfMemoryError`` as an allocation would."""
        self._check_index(index)
        if index == HOST or nbytes <= 0:
            return
        with self._lock:
            budget = self.budgets[index]
            if budget is not None and self._cur[index] + nbytes > budget:
                self.num_ooms += 1
                raise torch.OutOfMemoryError(self._oom_on(index, nbytes))
            self._cur[index] += nbytes
            self._current += nbytes
            self.num_allocs += 1
            self._raise_peaks(index)

    def _register_on(self, pending: dict[int, tuple[Any, int]], index: int) -> None:
        # caller holds the lock
        for key, (storage, nbytes) in pending.items():
            if key in self._live:
                continue
            self._live[key] = (weakref.ref(storage, functools.partial(self._on_free, key)), nbytes)
            self._where[key] = index
            self._cur[index] += nbytes
            self._current += nbytes
            self.num_allocs += 1
        self._raise_peaks(index)

    def _raise_peaks(self, index: int) -> None:
        # caller holds the lock
        if self._cur[index] > self._peaks[index]:
            self._peaks[index] = self._cur[index]
        if self._cur[index] > self._windows[index]:
            self._windows[index] = self._cur[index]
        if self._current > self._peak:
            self._peak = self._current

    def _on_free(self, key: int, _ref: object = None) -> None:
        with self._lock:
            entry = self._live.pop(key, None)
            index = self._where.pop(key, HOST)
            if entry is not None:
                self._current -= entry[1]
                if index != HOST:
                    self._cur[index] -= entry[1]

    # -- the dispatch hook --------------------------------------------------------------------
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not self.counting:
            return func(*args, **kwargs)
        name = func.__name__
        inputs = _tensors(args) + (_tensors(kwargs) if kwargs else [])
        foreach = name.startswith("_foreach_")
        target = self._target(inputs, name, foreach)
        out = func(*args, **kwargs)
        outs = _tensors(out)
        if not outs:
            return out
        if foreach and isinstance(out, (list, tuple)) and args and isinstance(args[0], list):
            places = [self.where(t) for t in args[0]]
            groups: dict[int, list[torch.Tensor]] = {}
            for i, t in enumerate(outs):
                groups.setdefault(places[i] if i < len(places) else target, []).append(t)
        else:
            groups = {target: outs}
        for index, tensors in groups.items():
            if index == HOST:
                continue
            new: dict[int, tuple[Any, int]] = {}
            for t in tensors:
                storage = self._storage(t)
                if storage is not None and id(storage) not in self._live:
                    new.setdefault(id(storage), (storage, self._size(storage)))
            if not new:
                continue
            added = sum(size for _, size in new.values())
            budget = self.budgets[index]
            if budget is not None and self._cur[index] + added > budget:
                self.num_ooms += 1
                message = self._oom_on(index, added)
                del out, outs, new, groups
                raise torch.OutOfMemoryError(message)
            with self._lock:
                self._register_on(new, index)
        return out

    def _target(self, inputs: list[torch.Tensor], name: str, foreach: bool) -> int:
        """The device of an op's outputs; raises when its inputs are on different devices."""
        if not inputs:
            return self.current_device
        found: list[int] = []
        scalar_host = False
        for t in inputs:
            index = self.where(t)
            if index == HOST and (t.dim() == 0 or t.numel() == 0):
                # a cpu scalar may join cuda tensors; an empty one (transformers' cache starts
                # from torch.tensor([], device=key.device): the cpu here, the gpu on a gpu)
                # holds nothing to place
                scalar_host = True
                continue
            if index not in found:
                found.append(index)
        if not found:
            return HOST if scalar_host else self.current_device
        if len(found) > 1 and not foreach and not name.startswith(("copy_", "_copy_from")):
            by = self._managed_on_host(inputs) if HOST in found else None
            if by is not None:
                raise SimulationError(
                    f"{_MIXED}{device_name(found[0])} and {device_name(found[1])}! "
                    f"[memkit virtual devices: in {name}; the cpu tensor is a parameter {by} "
                    "had moved back to the host: an internal error of memkit's simulation, "
                    "not your tensor placement (please report it)]"
                )
            raise RuntimeError(
                f"{_MIXED}{device_name(found[0])} and {device_name(found[1])}! "
                f"[memkit virtual devices: in {name}; tensors are placed with "
                "memkit.to_virtual(tensor, i) or by the DataParallel stand-in]"
            )
        if name.startswith(("copy_", "_copy_from")):
            return self.where(inputs[0])
        return found[0]

    def _oom_on(self, index: int, tried: int) -> str:
        budget = self.budgets[index] or 0
        cur = self._cur[index]
        return (
            f"CUDA out of memory on virtual device {device_name(index)}. Tried to allocate "
            f"{format_size(tried)}. GPU {index} has a total capacity of {format_size(budget)} "
            f"of which {format_size(max(0, budget - cur))} is free. "
            f"{format_size(cur)} in use by tensors memkit counts. "
            "[memkit.simulate(devices=...): a simulated device, worded like CUDA's message]"
        )

    def __enter__(self) -> VirtualDevices:
        super().__enter__()
        _ACTIVE.append(self)
        return self

    def __exit__(self, *exc: Any) -> None:
        if self in _ACTIVE:
            _ACTIVE.remove(self)
        super().__exit__(*exc)

    def __repr__(self) -> str:
        parts = ", ".join(
            f"{device_name(i)} {format_size(self._cur[i])}"
            + ("" if b is None else f"/{format_size(b)}")
            for i, b in enumerate(self.budgets)
        )
        return f"VirtualDevices({self.device}: {parts})"


def is_active(devices: VirtualDevices) -> bool:
    """Whether ``devices`` is being run (its ``with`` block entered and not left)."""
    return devices in _ACTIVE


def to_virtual(obj: Any, index: int) -> Any:
    """Place a tensor, module or optimizer on virtual device ``index`` of the active block."""
    vd = active_virtual_devices()
    if vd is None:
        raise RuntimeError(
            "memkit.to_virtual needs a `with memkit.simulate(..., devices=N):` block around it"
        )
    return vd.to(obj, index)


class _Copied(torch.autograd.Function):
    """``tensor.to("cuda:i")`` between virtual devices, with its backward as on a GPU
    (``ToCopyBackward``): the gradient comes back as a copy on the source device, and the
    source keeps its graph (a model split over two devices trains its first half)."""

    @staticmethod
    def forward(
        ctx: Any, tensor: torch.Tensor, acct: VirtualDevices, source: int, index: int
    ) -> Any:
        ctx.acct, ctx.source, ctx.index = acct, source, index
        return acct._copy_to(tensor, index)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        # itself differentiable, as ToCopyBackward is (a gradient penalty's create_graph)
        return _Copied.apply(grad, ctx.acct, ctx.index, ctx.source), None, None, None
