"""The one place that touches hardware: memory backends per device kind.

Every other module asks a :class:`MemoryBackend` for numbers; only this module calls
``torch.cuda``, ``torch.accelerator``, NVML (``pynvml``), GPUtil (nvidia-smi) and psutil.
Backends:

* :class:`CudaBackend`: the CUDA caching allocator's counters (``memory_allocated``,
  ``memory_reserved`` and their peaks), ``cudaMemGetInfo`` for device-wide free/total (which
  includes the CUDA context and other processes). Other accelerators (XPU, MPS...) use the same
  class through ``torch.accelerator``.
* :class:`SimulatedBackend`: memkit's :class:`~memkit.accounting.MemoryAccountant` with a budget.
  ``--device cpu`` uses it: a deterministic device of the budget's size on any machine.
  Dispatch modes are thread-local, so its counting is active only in threads that entered
  :meth:`SimulatedBackend.activate`.
* host memory (:func:`host_memory`): psutil's process RSS and available RAM.

Device-wide readings (memory used by every process, the processes on each GPU, names in CUDA
order by UUID) come from the driver's NVML library in process (:func:`nvml_stats`, through
``nvidia-ml-py``), with GPUtil (nvidia-smi in a subprocess) as the fallback (:func:`gpu_stats`).
An unavailable reading is ``None`` with a reason, never a crash: no driver, pynvml or GPUtil
missing or broken (GPUtil needs ``distutils``, gone in Python 3.12) only empties those columns.
Both are for snapshots, never for hot paths such as hooks.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch

from memkit.accounting import MemoryAccountant
from memkit.errors import ConfigError
from memkit.units import format_size, parse_size

__all__ = [
    "Capacity",
    "CudaBackend",
    "GpuProcess",
    "GpuStats",
    "HostMemory",
    "MemoryBackend",
    "SimulatedBackend",
    "VirtualDeviceBackend",
    "accelerator_available",
    "collective_device",
    "counter_reader",
    "cuda_context_reading",
    "cuda_history_snapshot",
    "current_device_index",
    "default_cpu_budget",
    "get_backend",
    "gpu_stats",
    "host_memory",
    "nvidia_smi_stats",
    "nvml_stats",
    "restore_rng_state",
    "rng_state",
    "set_current_device",
    "start_cuda_history",
    "stop_cuda_history",
    "visible_devices",
]

log = logging.getLogger(__name__)

DEFAULT_CPU_BUDGET = 1024**3
"""The simulated cpu device's size when no budget is given: a modest device (1 GiB), so a
probe without --budget ends in seconds, not minutes and gigabytes of RAM."""
DEFAULT_CPU_BUDGET_SHARE = 0.5
"""Share of available RAM the default simulated cpu device is capped at, on a small machine."""


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


def _current_accelerator() -> torch.device | None:
    acc = getattr(torch, "accelerator", None)
    if acc is not None and acc.is_available():
        dev = acc.current_accelerator()
        return None if dev is None else torch.device(dev.type, acc.current_device_index())
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return None


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
        self.accounting = (
            f"{device.type} caching allocator counters (memory_allocated / memory_reserved)"
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

    def capacity(self) -> Capacity:
        info = self.device_wide()
        if info is None:
            if self.budget is None:
                return Capacity(
                    None, None, "none", "the driver gives no free/total for this device"
                )
            return Capacity(self.budget, self.budget - self.reserved(), "budget")
        free, total = info
        # What this process can still get: the driver's free memory plus its own cached blocks.
        own_free = free + self.reserved() - self.allocated()
        if self.budget is not None and self.budget < total:
            return Capacity(self.budget, min(own_free, self.budget - self.allocated()), "budget")
        return Capacity(total, own_free, "cudaMemGetInfo")

    def empty_cache(self) -> None:
        self._mod.empty_cache()

    def synchronize(self) -> None:
        self._mod.synchronize(self.index)

    def activate(self) -> contextlib.AbstractContextManager[Any]:
        """Real devices count in every thread. With a budget on CUDA, the caching allocator is
        capped at it for the block (``set_per_process_memory_fraction``), so allocations past
        the budget raise a real ``torch.OutOfMemoryError``."""
        if self.budget is None or self.device.type != "cuda":
            return contextlib.nullcontext()
        return self._capped()

    @contextlib.contextmanager
    def _capped(self) -> Iterator[None]:
        total = torch.cuda.get_device_properties(self.index).total_memory
        getter = getattr(torch.cuda, "get_per_process_memory_fraction", None)
        before = 1.0 if getter is None else getter(self.index)
        torch.cuda.set_per_process_memory_fraction(min(1.0, (self.budget or 0) / total), self.index)
        try:
            yield
        finally:
            torch.cuda.set_per_process_memory_fraction(before, self.index)

    def __repr__(self) -> str:
        return f"CudaBackend({self.device})"


class SimulatedBackend:
    """A device of ``budget`` bytes simulated by counting tensor storages (see accounting.py).

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

    def capacity(self) -> Capacity:
        if self.budget is None:
            return Capacity(None, None, "budget", "the simulated device has no budget")
        return Capacity(self.budget, max(0, self.budget - self.accountant.current), "budget")

    def empty_cache(self) -> None:
        """No cache to empty: freed storages leave the count at once."""

    def synchronize(self) -> None:
        """Ops run synchronously on the simulated device."""

    def track(self, *objects: Any) -> None:
        """Count existing objects (model, optimizer, tensors) on this device from now on."""
        self.accountant.track(*objects)

    def activate(self) -> contextlib.AbstractContextManager[Any]:
        """Count ops run in this thread until the block exits (re-entrant)."""
        return self.accountant

    def count_ops(self, counting: bool, adopting: bool) -> None:
        """Whether ops now create device memory (``counting``) and whether storages made
        earlier become device memory when an op reads them (``adopting``): a tracker turns
        both off for host-side work (data loading, code between steps)."""
        acct = self.accountant
        acct.counting = counting
        acct.adopting = adopting

    def __repr__(self) -> str:
        return f"SimulatedBackend({self.device}, budget={self.budget})"


class VirtualDeviceBackend:
    """One virtual device (``cuda:i``) of a :class:`~memkit.virtual_devices.VirtualDevices`
    block, for the tracker: its counters are that device's, its peak is a segment peak of its
    own (the block's :meth:`peak_of` stays intact)."""

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


@dataclass(frozen=True)
class HostMemory:
    """Host RAM as psutil sees it. Values are ``None`` with a ``reason`` when unavailable."""

    process_rss: int | None
    available: int | None
    total: int | None
    reason: str | None = None


def host_memory() -> HostMemory:
    """This process's resident memory and the machine's available and total RAM."""
    try:
        import psutil
    except ImportError as exc:
        return HostMemory(None, None, None, f"psutil is not importable: {exc}")
    vm = psutil.virtual_memory()
    return HostMemory(int(psutil.Process().memory_info().rss), int(vm.available), int(vm.total))


def default_cpu_budget() -> int:
    """The simulated cpu device's default size: 1 GiB, or half the available RAM if less."""
    available = host_memory().available
    if available is None:
        return DEFAULT_CPU_BUDGET
    return min(DEFAULT_CPU_BUDGET, int(available * DEFAULT_CPU_BUDGET_SHARE))


_DEVICE_FORMS = (
    "'cpu' (simulated), 'meta' (simulated, no compute), 'cuda', 'cuda:N', 'xpu:N', 'mps'"
)


def _parse_device(device: str | torch.device | None) -> torch.device | None:
    if device is None or isinstance(device, torch.device):
        return device
    try:
        return torch.device(str(device).strip())
    except (RuntimeError, ValueError):
        raise ConfigError(
            f"expected a device such as {_DEVICE_FORMS}, found {device!r}, which torch does not "
            "know as a device; give one of those (memkit snapshot lists this machine's)"
        ) from None


def get_backend(
    device: str | torch.device | None = None,
    budget: int | str | None = None,
    *,
    rounding: str = "none",
) -> CudaBackend | SimulatedBackend:
    """Pick the backend for a device.

    Args:
        device: ``"cuda:1"``, ``"cpu"``, a ``torch.device``, or ``None`` for the current
            accelerator if there is one, else the simulated cpu device.
        budget: bytes or a size string. On ``cpu``/``meta`` it is the simulated device's size
            (default on cpu: 1 GiB, or half the available RAM if less; unlimited on meta); on
            a GPU it caps the capacity below the real one.
        rounding: simulated devices only: ``"none"`` or ``"cuda"``.

    Raises:
        ConfigError: unknown device string, or an accelerator that this machine does not have.
    """
    dev = _parse_device(device)
    size = None if budget is None else parse_size(budget)
    if size is not None and size <= 0:
        raise ConfigError(
            f"expected a positive budget such as 300MiB or 8GiB, found {budget!r}, which is 0 bytes"
        )
    if dev is None:
        dev = _current_accelerator() or torch.device("cpu")
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
                "device; use --device cpu --budget SIZE to simulate a GPU of that size"
            )
        count = torch.cuda.device_count()
        if (dev.index or 0) >= count:
            raise ConfigError(
                f"device {dev} was asked for, but only {count} CUDA device(s) are visible "
                f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}); "
                f"give cuda:0 to cuda:{count - 1}, or --device cpu --budget SIZE to simulate one"
            )
        return CudaBackend(torch.device("cuda", dev.index or 0), size)
    acc = _current_accelerator()
    if acc is None or acc.type != dev.type or not hasattr(torch.accelerator, "memory_allocated"):
        raise ConfigError(
            f"device {dev} is not available here; expected one of {_DEVICE_FORMS} "
            "for a device this machine has"
        )
    return CudaBackend(torch.device(dev.type, dev.index or 0), size)


def visible_devices() -> list[torch.device]:
    """The accelerator devices this process can see, in torch's index order (no CUDA init)."""
    acc = _current_accelerator()
    if acc is None:
        return []
    count = torch.cuda.device_count() if acc.type == "cuda" else torch.accelerator.device_count()
    return [torch.device(acc.type, i) for i in range(count)]


@dataclass(frozen=True)
class GpuProcess:
    """A process holding memory on a GPU, as the driver (NVML) lists it.

    Attributes:
        pid: its process id as the driver sees it (in a container, possibly the host's).
        used: bytes it holds on the GPU, or ``None`` where the driver does not say (Windows
            WDDM, some containers).
        this_process: it is this Python process (same pid).
    """

    pid: int
    used: int | None
    this_process: bool


@dataclass(frozen=True)
class GpuStats:
    """One GPU as the driver sees it (NVML, else nvidia-smi through GPUtil), mapped to CUDA
    index order by UUID.

    Attributes:
        cuda_index: its index in this process's CUDA order, ``None`` if torch cannot see it.
        uuid, name: the driver's UUID and product name.
        utilization: percent of time a kernel ran (last sample period), if reported.
        temperature: degrees Celsius, if reported.
        memory_used: bytes used on the device by every process and context.
        memory_total: the device's size in bytes.
        processes: the compute processes on it (NVML only; ``None`` where not read).
        source: ``"nvml"`` or ``"nvidia-smi"``.
    """

    cuda_index: int | None
    uuid: str
    name: str
    utilization: float | None
    temperature: float | None
    memory_used: int | None
    memory_total: int | None
    processes: tuple[GpuProcess, ...] | None = None
    source: str = "nvidia-smi"

    @property
    def other_processes(self) -> tuple[GpuProcess, ...] | None:
        """The processes on this GPU other than this one (``None`` where not read)."""
        if self.processes is None:
            return None
        return tuple(p for p in self.processes if not p.this_process)

    @property
    def other_processes_used(self) -> int | None:
        """Bytes the other processes hold (``None`` if not read or a process does not say)."""
        others = self.other_processes
        if others is None or any(p.used is None for p in others):
            return None
        return sum(p.used or 0 for p in others)


def _norm_uuid(uuid: Any) -> str:
    text = str(uuid).strip().lower()
    return text[4:] if text.startswith("gpu-") else text


def _cuda_uuids() -> dict[str, int]:
    """UUID -> CUDA index for visible devices (only when CUDA is already initialised, or cheap)."""
    out: dict[str, int] = {}
    if not torch.cuda.is_available():
        return out
    for i in range(torch.cuda.device_count()):
        try:
            out[_norm_uuid(torch.cuda.get_device_properties(i).uuid)] = i
        except (RuntimeError, AttributeError) as exc:  # pragma: no cover - driver specific
            log.debug("no uuid for cuda:%d: %s", i, exc)
    return out


def nvml_stats() -> tuple[list[GpuStats], str | None]:
    """GPUs as the driver's NVML library reports them (``nvidia-ml-py``'s ``pynvml``: in
    process, no subprocess), in CUDA order, and a reason when there are none.

    Device-wide memory (every process and context), utilisation, temperature and the compute
    processes on each GPU. Initialises and shuts NVML down on each call: for snapshots, never
    for hot paths.
    """
    try:
        import pynvml
    except Exception as exc:
        return [], f"nvidia-ml-py (pynvml) is not importable ({type(exc).__name__}: {exc})"
    try:
        pynvml.nvmlInit()
    except Exception as exc:  # NVMLError_LibraryNotFound / DriverNotLoaded: no NVIDIA driver
        return [], f"NVML is unavailable ({type(exc).__name__}: {exc}): no NVIDIA driver here"
    try:
        count = int(pynvml.nvmlDeviceGetCount())
        if count == 0:
            return [], "NVML found no GPU"
        order = _cuda_uuids()
        stats = [_nvml_device(pynvml, i, order) for i in range(count)]
    except Exception as exc:  # a driver error in the middle: no partial reading
        return [], f"NVML failed ({type(exc).__name__}: {exc})"
    finally:
        with contextlib.suppress(Exception):
            pynvml.nvmlShutdown()
    stats.sort(key=lambda s: (s.cuda_index is None, s.cuda_index or 0))
    return stats, None


def _nvml_text(value: Any) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


def _nvml_device(pynvml: Any, index: int, order: dict[str, int]) -> GpuStats:
    """One GPU's NVML readings; a reading the GPU does not support is ``None``."""
    handle = pynvml.nvmlDeviceGetHandleByIndex(index)
    uuid = _nvml_text(pynvml.nvmlDeviceGetUUID(handle))
    name = _nvml_text(pynvml.nvmlDeviceGetName(handle))
    memory = pynvml.nvmlDeviceGetMemoryInfo(handle)

    def optional(read: Any) -> Any:
        try:
            return read()
        except pynvml.NVMLError as exc:  # NotSupported on some GPUs, NoPermission in VMs
            log.debug("NVML reading unavailable on GPU %d: %s", index, exc)
            return None

    util = optional(lambda: pynvml.nvmlDeviceGetUtilizationRates(handle))
    temp = optional(lambda: pynvml.nvmlDeviceGetTemperature(handle, pynvml.NVML_TEMPERATURE_GPU))
    found = optional(lambda: pynvml.nvmlDeviceGetComputeRunningProcesses(handle))
    me = os.getpid()
    processes = None
    if found is not None:
        used: dict[int, int | None] = {}
        for proc in found:
            value = getattr(proc, "usedGpuMemory", None)
            used[int(proc.pid)] = None if value is None else int(value)
        processes = tuple(GpuProcess(pid, b, pid == me) for pid, b in sorted(used.items()))
    return GpuStats(
        cuda_index=order.get(_norm_uuid(uuid)),
        uuid=uuid,
        name=name,
        utilization=None if util is None else float(util.gpu),
        temperature=None if temp is None else float(temp),
        memory_used=int(memory.used),
        memory_total=int(memory.total),
        processes=processes,
        source="nvml",
    )


def gpu_stats() -> tuple[list[GpuStats], str | None]:
    """Every GPU the driver sees, in CUDA order: NVML (:func:`nvml_stats`), else nvidia-smi
    through GPUtil (:func:`nvidia_smi_stats`); with none, why neither gave any. For
    snapshots, never for hot paths."""
    stats, nvml_reason = nvml_stats()
    if stats:
        return stats, None
    stats, smi_reason = nvidia_smi_stats()
    if stats:
        return stats, None
    return [], f"NVML: {nvml_reason}; GPUtil: {smi_reason}"


def nvidia_smi_stats() -> tuple[list[GpuStats], str | None]:
    """GPUs as nvidia-smi reports them, in CUDA order, and a reason when there are none.

    Runs nvidia-smi in a subprocess (through GPUtil): for snapshots, never for hot paths.
    """
    try:
        import GPUtil
    except Exception as exc:  # ImportError, or distutils missing on Python >= 3.12
        return [], f"GPUtil is not importable ({type(exc).__name__}: {exc})"
    try:
        gpus = GPUtil.getGPUs()
    except Exception as exc:  # GPUtil raises whatever nvidia-smi's output parsing hits
        return [], f"GPUtil/nvidia-smi failed ({type(exc).__name__}: {exc})"
    if not gpus:
        return [], "nvidia-smi found no GPU (or is not installed)"
    order = _cuda_uuids()
    mib = 1024 * 1024
    stats = [
        GpuStats(
            cuda_index=order.get(_norm_uuid(g.uuid)),
            uuid=str(g.uuid),
            name=str(g.name),
            utilization=None if g.load is None else float(g.load) * 100.0,
            temperature=None if g.temperature is None else float(g.temperature),
            memory_used=None if g.memoryUsed is None else int(g.memoryUsed * mib),
            memory_total=None if g.memoryTotal is None else int(g.memoryTotal * mib),
            source="nvidia-smi",
        )
        for g in gpus
    ]
    stats.sort(key=lambda s: (s.cuda_index is None, s.cuda_index or 0))
    return stats, None


def rng_state() -> dict[str, Any]:
    """Every RNG state a training step can advance: Python, NumPy (if imported), torch CPU and
    each initialised accelerator."""
    import random

    state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        state["numpy"] = numpy.random.get_state()
    if torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    """Put back what :func:`rng_state` saved."""
    import random

    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "numpy" in state:
        sys.modules["numpy"].random.set_state(state["numpy"])
    if "cuda" in state:
        torch.cuda.set_rng_state_all(state["cuda"])


def collective_device(pg_backend: str) -> torch.device:
    """Where a small tensor for a ``torch.distributed`` collective must live for ``pg_backend``.

    ``"gloo"`` (and ``"mpi"``, and mixed ``"cpu:gloo,cuda:nccl"`` strings, which accept cpu
    tensors) gets ``cpu``; ``"nccl"`` the current cuda device; any other backend (``"xccl"``,
    ``"hccl"``...) the current accelerator, or ``cpu`` when there is none.
    """
    name = pg_backend.lower()
    if "gloo" in name or name == "mpi":
        return torch.device("cpu")
    if name == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return _current_accelerator() or torch.device("cpu")


# --- tracker support (memkit.tracking): cheap counter readers for hooks ----------------------


class CounterReader(Protocol):
    """``() -> (allocated, reserved, peak_allocated, peak_reserved)`` of one device, in bytes."""

    def __call__(self) -> tuple[int, int, int, int]: ...


class PeakResetter(Protocol):
    """``() -> None``: reset a device's peak counters to their current values."""

    def __call__(self) -> None: ...


def counter_reader(backend: Any) -> tuple[CounterReader, PeakResetter]:
    """A fast ``(read, reset_peak)`` pair for hooks that run once per module call.

    ``read()`` returns ``(allocated, reserved, peak_allocated, peak_reserved)`` in one call;
    ``reset_peak()`` resets both peaks. On CUDA, ``read`` calls ``torch._C._cuda_memoryStats``
    once (the public ``torch.cuda.memory_allocated`` builds and sorts a flat dict of every
    statistic per call, several times slower) and returns zeros while CUDA is not initialised.
    Neither function synchronises, allocates device memory or spawns a process.
    """
    if isinstance(backend, SimulatedBackend):
        acct = backend.accountant

        def read_sim() -> tuple[int, int, int, int]:
            cur, peak = acct._current, acct._peak
            return cur, cur, peak, peak

        return read_sim, acct.reset_peak
    if isinstance(backend, VirtualDeviceBackend):
        vd, i = backend.devices, backend.index

        def read_virtual() -> tuple[int, int, int, int]:
            cur, peak = vd._cur[i], vd._windows[i]
            return cur, cur, peak, peak

        return read_virtual, functools.partial(vd.reset_window, i)
    if isinstance(backend, CudaBackend) and backend.device.type == "cuda":
        index = backend.index
        stats = getattr(torch._C, "_cuda_memoryStats", None)
        reset = getattr(torch._C, "_cuda_resetPeakMemoryStats", None)
        initialized = torch.cuda.is_initialized
        if stats is not None and reset is not None:

            def read_cuda() -> tuple[int, int, int, int]:
                if not initialized():
                    return 0, 0, 0, 0
                s = stats(index)
                a, r = s["allocated_bytes"]["all"], s["reserved_bytes"]["all"]
                return a["current"], r["current"], a["peak"], r["peak"]

            def reset_cuda() -> None:
                if initialized():
                    reset(index)

            try:
                read_cuda()
            except (KeyError, TypeError, RuntimeError) as exc:  # pragma: no cover - torch drift
                log.debug("fast CUDA counters unavailable (%s); using memory_stats", exc)
            else:
                return read_cuda, reset_cuda

    def read_generic() -> tuple[int, int, int, int]:
        return (
            backend.allocated(),
            backend.reserved(),
            backend.peak_allocated(),
            backend.peak_reserved(),
        )

    return read_generic, backend.reset_peak


def current_device_index(device_type: str) -> int:
    """The current device index of this thread for an accelerator type (``"cuda"``, ``"xpu"``).

    ``nn.DataParallel`` sets it in each replica thread, so a hook can tell which device it runs
    for without looking at tensors. Returns 0 when the type is not initialised or unknown.
    """
    try:
        if device_type == "cuda":
            return int(torch.cuda.current_device()) if torch.cuda.is_initialized() else 0
        acc = getattr(torch, "accelerator", None)
        if acc is not None and acc.is_available():
            return int(acc.current_device_index())
    except (RuntimeError, AssertionError) as exc:  # pragma: no cover - driver specific
        log.debug("no current %s device: %s", device_type, exc)
    return 0


def set_current_device(device: torch.device) -> None:
    """Make ``device`` this process's current accelerator device (before creating an NCCL
    group, or every rank lands on GPU 0). A no-op for devices without a current index."""
    if device.type == "cuda" and torch.cuda.is_available():
        torch.cuda.set_device(device.index if device.index is not None else 0)


def cuda_context_reading() -> tuple[bool, int | None]:
    """``(CUDA initialised in this process, current CUDA device)``, without initialising CUDA."""
    initialized = bool(torch.cuda.is_available() and torch.cuda.is_initialized())
    return initialized, (torch.cuda.current_device() if initialized else None)


# --- memory history (memkit.history): the CUDA caching allocator's own trace ------------------


def start_cuda_history(max_entries: int) -> None:
    """Record every allocation and free of the CUDA caching allocator, with its Python stack
    (``stacks="python"``: no C++ frames, the cheap kind; ``context="all"``: stacks for frees
    too), keeping the last ``max_entries`` events (torch's ring buffer drops older ones).
    Recording covers every CUDA device of the process."""
    torch.cuda.memory._record_memory_history(
        enabled="all", context="all", stacks="python", max_entries=max_entries
    )


def cuda_history_snapshot() -> dict[str, Any]:
    """The allocator's segments and the recorded trace: ``torch.cuda.memory._snapshot()``, the
    dict that ``torch.cuda.memory._dump_snapshot`` pickles."""
    return dict(torch.cuda.memory._snapshot())


def stop_cuda_history() -> None:
    """Stop recording (``_record_memory_history(enabled=None)``)."""
    torch.cuda.memory._record_memory_history(enabled=None)
