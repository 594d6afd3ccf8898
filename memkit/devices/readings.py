"""Device-wide GPU readings from the driver: NVML in process, nvidia-smi (GPUtil) as fallback.

They see what the caching allocator cannot: memory used by every process, the processes on each
GPU, names in CUDA order by UUID. An unavailable reading is ``None`` with a reason, never a
crash: no driver, pynvml or GPUtil missing or broken (GPUtil needs ``distutils``, gone in
Python 3.12) only empties those columns. For snapshots, never for hot paths such as hooks.

Readers call each other through the package (``memkit.devices.nvml_stats``...), so replacing one
there (a test, a platform shim) replaces it for :func:`gpu_stats` too.
"""

from __future__ import annotations

import contextlib
import logging
import os
from dataclasses import dataclass
from typing import Any

import torch

log = logging.getLogger(__name__)


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
