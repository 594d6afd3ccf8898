"""Memory backends: one per device kind, each reading its own counters.

* :class:`CudaBackend`: the CUDA caching allocator's counters (``memory_allocated``,
  ``memory_reserved`` and their peaks), ``cudaMemGetInfo`` for device-wide free/total (which
  includes the CUDA context and other processes). Other accelerators (XPU, MPS...) use the same
  class through ``torch.accelerator``.
* :class:`SimulatedBackend`: memkit's :class:`~memkit.simulated.accountant.MemoryAccountant` with a
  budget.
  ``--device cpu`` uses it: a deterministic device of the budget's size on any machine.
  Dispatch modes are thread-local, so its counting is active only in threads that entered
  :meth:`SimulatedBackend.activate`.
* :class:`VirtualDeviceBackend`: one device of a
  :class:`~memkit.simulated.virtual_devices.VirtualDevices`
  block.

:func:`get_backend` picks one for a device string; :func:`visible_devices` lists the
accelerators torch sees. Neither initialises CUDA.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch

from memkit.cublas import cublas_workspace_bytes
from memkit.devices.host import default_cpu_budget
from memkit.devices.state import current_accelerator, tensor_device
from memkit.errors import ConfigError, spelled
from memkit.patching import Restore
from memkit.simulated.accountant import MemoryAccountant
from memkit.units import format_size, parse_budget

log = logging.getLogger(__name__)

_MODULE_FILE = torch.nn.Module._apply.__code__.co_filename
"""Where ``Module.cpu()`` calls ``.cpu()`` of each parameter and buffer: the model moves
(Lightning's teardown), which no host view may replace."""


@dataclass(frozen=True)
class Capacity:
    """How much memory a device offers this process.

    Attributes:
        total: the device's size for this process (a ``--budget`` caps it), bytes or ``None``.
        free: what this process can still allocate now, bytes or ``None``.
        source: where the numbers come from (``"cudaMemGetInfo"``, ``"budget"``...).
        reason: why a value is ``None``, else ``None``.
    """

    total: int | None
    free: int | None
    source: str
    reason: str | None = None


@runtime_checkable
class MemoryBackend(Protocol):
    """Memory counters of one device. Reading a counter never allocates, syncs or spawns."""

    device: torch.device
    kind: str
    accounting: str
    budget: int | None

    def name(self) -> str: ...
    def allocated(self) -> int: ...
    def reserved(self) -> int: ...
    def peak_allocated(self) -> int: ...
    def peak_reserved(self) -> int: ...
    def reset_peak(self) -> None: ...
    def capacity(self) -> Capacity: ...
    def empty_cache(self) -> None: ...
    def synchronize(self) -> None: ...
    def activate(self) -> contextlib.AbstractContextManager[Any]: ...


def accelerator_available() -> bool:
    """Whether torch sees an accelerator (CUDA, XPU, MPS...), without initialising CUDA."""
    acc = getattr(torch, "accelerator", None)
    if acc is not None:
        return bool(acc.is_available())
    return torch.cuda.is_available()


class CudaBackend:
    """Counters of the caching allocator of a CUDA device (or another torch accelerator).

    With a ``budget``, :meth:`capacity` reports at most the budget: probing then treats the
    device as that large.
    """

    kind = "cuda"

    def __init__(self, device: torch.device, budget: int | None = None) -> None:
        self.device = device
        self.budget = budget
        self._mod: Any = torch.cuda if device.type == "cuda" else torch.accelerator
        self.kind = device.type

    @functools.cached_property
    def accounting(self) -> str:
        """The counters, and on CUDA the cuBLAS workspaces they hold that no tensor owns."""
        counters = (
            f"{self.device.type} caching allocator counters (memory_allocated / memory_reserved)"
        )
        if self.device.type != "cuda" or torch.version.hip:  # ROCm's hipBLAS sizes differ
            return counters
        try:
            major = torch.cuda.get_device_properties(self.index).major
        except (AssertionError, RuntimeError):  # read after a CUDA stand-in's block ended
            return counters
        each = format_size(cublas_workspace_bytes(major))
        return (
            f"{counters}; they include PyTorch's cuBLAS workspaces, {each} for each thread and "
            "stream that has run a matmul (in training usually two: the forward's thread and "
            "autograd's), which no tensor owns: part of 'other' in a breakdown"
        )

    @property
    def index(self) -> int:
        return self.device.index or 0

    def name(self) -> str:
        if self.device.type == "cuda":
            return str(torch.cuda.get_device_name(self.index))
        return str(self.device)

    def allocated(self) -> int:
        return int(self._mod.memory_allocated(self.index))

    def reserved(self) -> int:
        return int(self._mod.memory_reserved(self.index))

    def peak_allocated(self) -> int:
        return int(self._mod.max_memory_allocated(self.index))

    def peak_reserved(self) -> int:
        return int(self._mod.max_memory_reserved(self.index))

    def reset_peak(self) -> None:
        self._mod.reset_peak_memory_stats(self.index)

    def ooms(self) -> int:
        """Allocations the caching allocator refused so far (its ``num_ooms``)."""
        return int(self._mod.memory_stats(self.index).get("num_ooms", 0))

    def device_wide(self) -> tuple[int, int] | None:
        """``(free, total)`` for the whole device, as the driver sees it (all processes)."""
        try:
            if self.device.type == "cuda":
                free, total = torch.cuda.mem_get_info(self.index)
            else:
                free, total = torch.accelerator.get_memory_info(self.index)
        except (RuntimeError, AttributeError) as exc:
            log.debug("device-wide memory info unavailable: %s", exc)
            return None
        return int(free), int(total)

    def _current(self) -> tuple[int, int]:
        """``(allocated, reserved)`` now, from one read of the allocator's statistics."""
        stats = self._mod.memory_stats(self.index)
        return (
            int(stats.get("allocated_bytes.all.current", 0)),
            int(stats.get("reserved_bytes.all.current", 0)),
        )

    def capacity(self) -> Capacity:
        info = self.device_wide()
        if info is None:
            if self.budget is None:
                return Capacity(
                    None, None, "none", "the driver gives no free/total for this device"
                )
            return Capacity(self.budget, self.budget - self.reserved(), "budget")
        free, total = info
        allocated, reserved = self._current()
        # What this process can still get: the driver's free memory plus its own cached blocks.
        own_free = free + reserved - allocated
        if self.budget is not None and self.budget < total:
            return Capacity(self.budget, min(own_free, self.budget - allocated), "budget")
        return Capacity(total, own_free, "cudaMemGetInfo")

    def holds(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` lives on this device, as :func:`memkit.devices.tensor_device`
        says (the tracker's breakdown asks; the CUDA stand-in answers there for its tensors)."""
        dev = tensor_device(tensor)
        return dev.type == self.device.type and (dev.index is None or dev.index == self.index)

    def empty_cache(self) -> None:
        self._mod.empty_cache()

    def inactive_split(self) -> int:
        """Free bytes inside segments that also hold live blocks (``inactive_split_bytes``):
        what ``empty_cache()`` cannot give back."""
        stats = self._mod.memory_stats(self.index)
        return int(stats.get("inactive_split_bytes.all.current", 0))

    def free_workspaces(self) -> None:
        """Give PyTorch's cuBLAS workspaces back to the cache (:mod:`memkit.cublas`): a fresh
        process has none until its first matmuls, which place them among what its step holds
        then; the next matmul in each thread makes its workspace again."""
        clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
        if clear is not None and self.device.type == "cuda" and torch.cuda.is_initialized():
            clear()

    def synchronize(self) -> None:
        self._mod.synchronize(self.index)

    def activate(self) -> contextlib.AbstractContextManager[Any]:
        """Real devices count in every thread. With a budget on CUDA, the caching allocator is
        capped at it for the block (``set_per_process_memory_fraction``), so allocations past
        the budget raise a real ``torch.OutOfMemoryError``."""
        if self.budget is None or self.device.type != "cuda":
            return contextlib.nullcontext()
        return self.capped_at(self.budget)

    def uncapped(self) -> contextlib.AbstractContextManager[Any]:
        """The whole device, without the budget's cap (set only inside :meth:`activate`)."""
        return contextlib.nullcontext()

    @contextlib.contextmanager
    def capped_at(self, nbytes: int) -> Iterator[None]:
        """The caching allocator capped at ``nbytes`` reserved (its new segments fail past it)."""
        total = torch.cuda.get_device_properties(self.index).total_memory
        getter = getattr(torch.cuda, "get_per_process_memory_fraction", None)
        before = 1.0 if getter is None else getter(self.index)
        torch.cuda.set_per_process_memory_fraction(min(1.0, nbytes / total), self.index)
        try:
            yield
        finally:
            torch.cuda.set_per_process_memory_fraction(before, self.index)

    def __repr__(self) -> str:
        return f"CudaBackend({self.device})"


class SimulatedBackend:
    """A device of ``budget`` bytes simulated by counting tensor storages (see
    memkit.simulated.accountant).

    Its counters advance only for ops run inside :meth:`activate` in the same thread: dispatch
    modes are thread-local. It has no cache, so reserved equals allocated.
    """

    kind = "simulated"
    thread_local = True

    def __init__(
        self,
        device: str | torch.device = "cpu",
        budget: int | None = None,
        *,
        rounding: str = "none",
    ) -> None:
        self.device = torch.device(device)
        self.budget = budget
        self.accountant = MemoryAccountant(self.device, budget, rounding=rounding)
        rule = "CUDA 512-byte block rounding" if rounding == "cuda" else "exact bytes"
        self.accounting = (
            f"memkit simulated device: live tensor storages on {self.device} counted by a "
            f"TorchDispatchMode ({rule})"
        )

    def name(self) -> str:
        size = "no budget" if self.budget is None else format_size(self.budget)
        return f"simulated {self.device} ({size})"

    def allocated(self) -> int:
        return self.accountant.current

    def reserved(self) -> int:
        return self.accountant.current

    def peak_allocated(self) -> int:
        return self.accountant.peak

    def peak_reserved(self) -> int:
        return self.accountant.peak

    def reset_peak(self) -> None:
        self.accountant.reset_peak()

    def ooms(self) -> int:
        """Allocations refused so far (the budget was reached)."""
        return int(self.accountant.num_ooms)

    def capacity(self) -> Capacity:
        if self.budget is None:
            return Capacity(None, None, "budget", "the simulated device has no budget")
        return Capacity(self.budget, max(0, self.budget - self.accountant.current), "budget")

    def empty_cache(self) -> None:
        """No cache to empty: freed storages leave the count at once."""

    def synchronize(self) -> None:
        """Ops run synchronously on the simulated device."""

    def track(self, *objects: Any, inputs: bool = False) -> None:
        """Count existing objects (model, optimizer, tensors) on this device from now on;
        ``inputs``: data reaching the device, a view counted by its own elements."""
        self.accountant.track(*objects, inputs=inputs)

    def activate(self) -> contextlib.AbstractContextManager[Any]:
        """Count ops run in this thread until the block exits (re-entrant)."""
        return self.accountant

    @contextlib.contextmanager
    def uncapped(self) -> Iterator[None]:
        """Count ops as :meth:`activate` does, but with no budget: nothing runs out."""
        acct = self.accountant
        budget, acct.budget = acct.budget, None
        try:
            with acct:
                yield
        finally:
            acct.budget = budget

    def count_ops(self, counting: bool, adopting: bool) -> None:
        """Whether ops now create device memory (``counting``) and whether storages made
        earlier become device memory when an op reads them (``adopting``): a tracker turns
        both off for host-side work (data loading, code between steps)."""
        acct = self.accountant
        acct.counting = counting
        acct.adopting = adopting

    @contextlib.contextmanager
    def writes_between_steps(self) -> Iterator[None]:
        """While counting is off, ops that read counted tensors are device work: what they
        make counts, what they write into is adopted (an EMA's update); ``.cpu()`` of a plain
        tensor that needs no gradient returns a host view, from which ops make host tensors
        (:attr:`MemoryAccountant.device_work`, :meth:`MemoryAccountant.host_view`), in the
        thread that entered, not in ``Module.cpu()``."""
        acct = self.accountant
        original = torch.Tensor.cpu
        thread = threading.get_ident()

        def cpu(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
            out = original(tensor, *args, **kwargs)
            if (
                out is tensor
                and handle.live
                and acct.device_work
                and not acct.counting
                and threading.get_ident() == thread
                and sys._getframe(1).f_code.co_filename != _MODULE_FILE  # (Module.cpu())
            ):
                try:
                    return acct.host_view(out)  # (a GPU script's copy to the host)
                except Exception:  # memkit's own failure never reaches the script
                    log.debug("host view failed", exc_info=True)
            return out

        handle = Restore(torch.Tensor, "cpu", original, cpu)
        torch.Tensor.cpu = cpu  # type: ignore[method-assign,assignment]
        before, acct.device_work = acct.device_work, True
        try:
            yield
        finally:
            acct.device_work = before
            handle.remove()

    def __repr__(self) -> str:
        return f"SimulatedBackend({self.device}, budget={self.budget})"


class VirtualDeviceBackend:
    """One virtual device (``cuda:i``) of a
    :class:`~memkit.simulated.virtual_devices.VirtualDevices` block, for the tracker: its counters
    are that device's, its peak is a segment peak of its own (the block's :meth:`peak_of` stays
    intact)."""

    kind = "simulated"
    thread_local = False

    def __init__(self, devices: Any, index: int) -> None:
        self.devices = devices
        self.index = index
        self.device = torch.device("cuda", index)
        self.budget = devices.budgets[index]
        self.accounting = (
            f"memkit virtual device cuda:{index} of {devices.n}: live tensor storages tagged "
            "with that device, counted by a TorchDispatchMode (exact bytes)"
        )

    def name(self) -> str:
        size = "no budget" if self.budget is None else format_size(self.budget)
        return f"virtual cuda:{self.index} of {self.devices.n} ({size})"

    def allocated(self) -> int:
        return int(self.devices.current_of(self.index))

    reserved = allocated

    def peak_allocated(self) -> int:
        return int(self.devices.window_peak(self.index))

    peak_reserved = peak_allocated

    def reset_peak(self) -> None:
        self.devices.reset_window(self.index)

    def capacity(self) -> Capacity:
        if self.budget is None:
            return Capacity(None, None, "budget", "the virtual device has no budget")
        return Capacity(self.budget, max(0, self.budget - self.allocated()), "budget")

    def holds(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` lives on this virtual device."""
        return bool(self.devices.where(tensor) == self.index)

    def empty_cache(self) -> None:
        """No cache to empty."""

    def synchronize(self) -> None:
        """Ops run synchronously."""

    def __repr__(self) -> str:
        return f"VirtualDeviceBackend(cuda:{self.index} of {self.devices.n})"


_RUN_FORMS = "'cpu' (simulated), 'cuda', 'cuda:N', 'xpu:N', 'mps'"
_DEVICE_FORMS = (
    "'cpu' (simulated), 'meta' (simulated, no compute), 'cuda', 'cuda:N', 'xpu:N', 'mps'"
)


def parse_device(device: str | torch.device | None, *, meta: bool = True) -> torch.device | None:
    """``device`` as a ``torch.device`` (``None`` stays ``None``).

    Raises:
        ConfigError: torch does not know it; the message lists the forms memkit takes
            (``meta=False``: without meta, for commands that run real steps).
    """
    if device is None or isinstance(device, torch.device):
        return device
    try:
        return torch.device(str(device).strip())
    except (RuntimeError, ValueError):
        forms = _DEVICE_FORMS if meta else _RUN_FORMS
        raise ConfigError(
            f"expected a device such as {forms}, found {device!r}, which torch does not "
            "know as a device; give one of those (memkit snapshot lists this machine's)"
        ) from None


def get_backend(
    device: str | torch.device | None = None,
    budget: int | str | None = None,
    *,
    rounding: str = "none",
    meta: bool = True,
) -> CudaBackend | SimulatedBackend:
    """Pick the backend for a device.

    Args:
        device: ``"cuda:1"``, ``"cpu"``, a ``torch.device``, or ``None`` for the current
            accelerator if there is one, else the simulated cpu device.
        budget: bytes or a size string. On ``cpu``/``meta`` it is the simulated device's size
            (default on cpu: 1 GiB, or half the available RAM if less; unlimited on meta); on
            a GPU it caps the capacity below the real one.
        rounding: simulated devices only: ``"none"`` or ``"cuda"``.
        meta: whether the caller takes ``meta``, for the messages (``False``: the commands
            that run real steps list the devices without it).

    Raises:
        ConfigError: unknown device string, or an accelerator that this machine does not have.
    """
    dev = parse_device(device, meta=meta)
    size = None if budget is None else parse_budget(budget)
    if dev is None:
        dev = current_accelerator() or torch.device("cpu")
    if dev.type == "cpu":
        return SimulatedBackend(
            dev, size if size is not None else default_cpu_budget(), rounding=rounding
        )
    if dev.type == "meta":
        return SimulatedBackend(dev, size, rounding=rounding)
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(
                f"device {dev} was asked for, but this torch ({torch.__version__}) sees no CUDA "
                f"device; use {_how_to_simulate()} to simulate a GPU of that size"
            )
        count = torch.cuda.device_count()
        if (dev.index or 0) >= count:
            raise ConfigError(
                f"device {dev} was asked for, but only {count} CUDA device(s) are visible "
                f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}); "
                f"give cuda:0 to cuda:{count - 1}, or {_how_to_simulate()} to simulate one"
            )
        return CudaBackend(torch.device("cuda", dev.index or 0), size)
    acc = current_accelerator()
    if acc is None or acc.type != dev.type or not hasattr(torch.accelerator, "memory_allocated"):
        raise ConfigError(
            f"device {dev} is not available here; this machine has {_devices_here(meta)}"
        )
    return CudaBackend(torch.device(dev.type, dev.index or 0), size)


def _how_to_simulate() -> str:
    """How to ask for the simulated device instead: a ``memkit`` command's options, else the
    Python API's."""
    return spelled(
        "--device cpu --budget SIZE",
        'device="cpu" with budget="SIZE" (memkit.probe, memkit.track) or a '
        'memkit.simulate("SIZE") block',
    )


def _devices_here(meta: bool) -> str:
    """The devices this machine has, as ``--device`` takes them (``meta`` too when taken)."""
    forms = ["'cpu' (simulated)", *(["'meta' (simulated, no compute)"] if meta else [])]
    visible = visible_devices()
    if visible:
        kind = visible[0].type
        last = f", ..., '{visible[-1]}'" if len(visible) > 1 else ""
        forms.append(f"'{kind}', '{visible[0]}'{last}")
    return ", ".join(forms)


def visible_devices() -> list[torch.device]:
    """The accelerator devices this process can see, in torch's index order (no CUDA init)."""
    acc = current_accelerator()
    if acc is None:
        return []
    count = torch.cuda.device_count() if acc.type == "cuda" else torch.accelerator.device_count()
    return [torch.device(acc.type, i) for i in range(count)]
