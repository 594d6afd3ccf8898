"""The one place that touches hardware: memory backends and readings per device kind.

Every other module asks this package for numbers; only its modules call ``torch.cuda``,
``torch.accelerator``, NVML (``pynvml``), GPUtil (nvidia-smi) and psutil:

* :mod:`~memkit.devices.backends`: :class:`MemoryBackend` and its kinds (CUDA and other torch
  accelerators, the simulated device, a virtual device), :func:`get_backend`,
  :func:`visible_devices`.
* :mod:`~memkit.devices.host`: host RAM through psutil (:func:`host_memory`) and the simulated
  cpu device's default size.
* :mod:`~memkit.devices.readings`: device-wide GPU readings from the driver (:func:`nvml_stats`,
  :func:`nvidia_smi_stats`, :func:`gpu_stats`), for snapshots, never for hot paths.
* :mod:`~memkit.devices.counters`: cheap counter readers for hooks (:func:`counter_reader`,
  :func:`peak_taker`).
* :mod:`~memkit.devices.peaks`: the user's peak counters kept true while memkit resets them
  (:class:`UserPeaks`).
* :mod:`~memkit.devices.state`: RNG states, the current device, CUDA's initialisation, the
  device a collective needs.
* :mod:`~memkit.devices.history`: the memory history (the CUDA allocator's trace or the simulated
  one).
* :mod:`~memkit.devices.cuda_standin`: a stand-in for ``torch.cuda``'s memory API backed by the
  simulated device, so that memkit's CUDA code runs in tests without a GPU (imported on demand).

Import it from here (``memkit.devices.X``): readers that use other readers call them through
this package, so replacing one here replaces it everywhere. Importing it does not initialise
CUDA.
"""

from __future__ import annotations

from memkit.devices.backends import (
    Capacity,
    CudaBackend,
    MemoryBackend,
    SimulatedBackend,
    VirtualDeviceBackend,
    accelerator_available,
    get_backend,
    parse_device,
    visible_devices,
)
from memkit.devices.counters import counter_reader, peak_taker, requested_reader
from memkit.devices.history import MemoryHistory
from memkit.devices.host import (
    HostMemory,
    default_cpu_budget,
    host_memory,
)
from memkit.devices.peaks import UserPeaks, cached_free_blocks, empty_on
from memkit.devices.readings import (
    GpuProcess,
    GpuStats,
    gpu_stats,
    nvidia_smi_stats,
    nvml_stats,
)
from memkit.devices.readings import (
    _cuda_uuids as _cuda_uuids,  # readings call it through the package
)
from memkit.devices.state import (
    collective_device,
    cuda_context_reading,
    current_device_index,
    restore_rng_state,
    rng_state,
    set_current_device,
    tensor_device,
)

__all__ = [
    "Capacity",
    "CudaBackend",
    "GpuProcess",
    "GpuStats",
    "HostMemory",
    "MemoryBackend",
    "MemoryHistory",
    "SimulatedBackend",
    "UserPeaks",
    "VirtualDeviceBackend",
    "accelerator_available",
    "cached_free_blocks",
    "collective_device",
    "counter_reader",
    "cuda_context_reading",
    "current_device_index",
    "default_cpu_budget",
    "empty_on",
    "get_backend",
    "gpu_stats",
    "host_memory",
    "nvidia_smi_stats",
    "nvml_stats",
    "parse_device",
    "peak_taker",
    "requested_reader",
    "restore_rng_state",
    "rng_state",
    "set_current_device",
    "tensor_device",
    "visible_devices",
]
