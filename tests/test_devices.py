"""Backends: the simulated device, host memory, device parsing, guarded GPUtil."""

from __future__ import annotations

import builtins
import os
import sys
import types

import pytest
import torch

from memkit import devices
from memkit.devices import (
    Capacity,
    default_cpu_budget,
    get_backend,
    host_memory,
    nvidia_smi_stats,
)
from memkit.errors import ConfigError, on_command_line


def test_cpu_backend_is_simulated_with_budget():
    backend = get_backend("cpu", "256MiB")
    assert backend.capacity() == Capacity(256 * 1024**2, 256 * 1024**2, "budget")
    assert "simulated" in backend.accounting
    with backend.activate():
        t = torch.ones(1024)
    assert backend.allocated() == backend.reserved() == 4096
    assert backend.capacity().free == 256 * 1024**2 - 4096
    del t
    assert backend.peak_allocated() == 4096
    backend.reset_peak()
    assert backend.peak_allocated() == 0
    # the budget is a limit to the byte: what is free fits, one byte more is a torch OOM
    with backend.activate():
        kept = torch.ones(1024)
        fits = torch.empty(256 * 1024**2 - 4096, dtype=torch.uint8)
        assert backend.allocated() == 256 * 1024**2
        del fits
        with pytest.raises(torch.OutOfMemoryError, match="Simulated device cpu out of memory"):
            torch.empty(256 * 1024**2 - 4096 + 1, dtype=torch.uint8)
    assert backend.allocated() == 4096 and kept.numel() == 1024


def test_none_means_accelerator_else_simulated_cpu():
    backend = get_backend(None)
    if torch.cuda.is_available():
        assert backend.kind == "cuda"
    else:
        assert backend.kind == "simulated" and "simulated" in backend.accounting
        assert backend.budget == pytest.approx(default_cpu_budget(), rel=0.2)


def test_default_cpu_budget_is_a_share_of_available_ram():
    available = host_memory().available
    assert available is not None
    assert 0 < default_cpu_budget() <= available


def test_meta_backend_has_no_budget_by_default():
    backend = get_backend("meta")
    assert backend.budget is None
    assert backend.capacity().total is None
    assert backend.capacity().reason


@pytest.mark.parametrize("bad", ["gpu0", "cuda:x", "tpu:"])
def test_bad_device_string_is_a_config_error(bad):
    with pytest.raises(ConfigError, match="expected a device"):
        get_backend(bad)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU message")
def test_cuda_without_gpu_says_what_to_do():
    """In the words of the caller: a command's options, the Python API's keywords."""
    with pytest.raises(ConfigError) as api:
        get_backend("cuda:0")
    assert 'memkit.simulate("SIZE")' in str(api.value) and "--device" not in str(api.value)
    with on_command_line(), pytest.raises(ConfigError, match="--device cpu --budget SIZE"):
        get_backend("cuda:0")


def test_bad_budget_is_a_config_error():
    with pytest.raises(ConfigError, match="lots"):
        get_backend("cpu", "lots")


def test_host_memory_reads_psutil():
    host = host_memory()
    assert host.reason is None
    assert host.process_rss and host.process_rss > 10 * 1024**2
    assert host.total and host.available and host.available <= host.total


def test_gputil_without_nvidia_smi_gives_reason_not_crash():
    stats, reason = nvidia_smi_stats()
    if not stats:
        assert reason


def test_gputil_import_failure_gives_reason(monkeypatch):
    real_import = builtins.__import__

    def broken(name, *args, **kwargs):
        if name == "GPUtil":
            raise ModuleNotFoundError("No module named 'distutils'")
        return real_import(name, *args, **kwargs)

    monkeypatch.delitem(sys.modules, "GPUtil", raising=False)
    monkeypatch.setattr(builtins, "__import__", broken)
    stats, reason = nvidia_smi_stats()
    assert stats == []
    assert "distutils" in reason


# -- NVML (nvidia-ml-py), with a fake pynvml ------------------------------------------------


class FakeNVML:
    """A stand-in for ``pynvml``: GPUs as (uuid, name, used, total, util, temp, processes);
    a reading given as an exception class raises it."""

    NVML_TEMPERATURE_GPU = 0

    class NVMLError(Exception):
        pass

    class NVMLError_LibraryNotFound(NVMLError):
        pass

    class NVMLError_NotSupported(NVMLError):
        pass

    def __init__(self, gpus=None, init_error=None):
        self.gpus = gpus or []
        self.init_error = init_error
        self.shutdowns = 0

    def nvmlInit(self):
        if self.init_error is not None:
            raise self.init_error("NVML Shared Library Not Found")

    def nvmlShutdown(self):
        self.shutdowns += 1

    def nvmlDeviceGetCount(self):
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, i):
        return self.gpus[i]

    def nvmlDeviceGetUUID(self, gpu):
        return gpu["uuid"].encode()  # older bindings return bytes

    def nvmlDeviceGetName(self, gpu):
        return gpu["name"]

    def nvmlDeviceGetMemoryInfo(self, gpu):
        return types.SimpleNamespace(used=gpu["used"], total=gpu["total"], free=0)

    def _read(self, value):
        if isinstance(value, type) and issubclass(value, Exception):
            raise value("Not Supported")
        return value

    def nvmlDeviceGetUtilizationRates(self, gpu):
        return types.SimpleNamespace(gpu=self._read(gpu["util"]), memory=0)

    def nvmlDeviceGetTemperature(self, gpu, sensor):
        return self._read(gpu["temp"])

    def nvmlDeviceGetComputeRunningProcesses(self, gpu):
        return [types.SimpleNamespace(pid=pid, usedGpuMemory=used) for pid, used in gpu["procs"]]


def test_nvml_without_a_driver_or_binding_is_a_reason(monkeypatch):
    fake = FakeNVML(init_error=FakeNVML.NVMLError_LibraryNotFound)
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    stats, reason = devices.nvml_stats()
    assert stats == [] and "no NVIDIA driver" in reason and "Library Not Found" in reason
    monkeypatch.setattr(
        devices.readings, "nvidia_smi_stats", lambda: ([], "nvidia-smi found no GPU")
    )
    stats, reason = devices.gpu_stats()  # GPUtil is the fallback; both reasons are given
    assert stats == [] and "NVML: NVML is unavailable" in reason and "GPUtil: nvidia-smi" in reason
    monkeypatch.setitem(sys.modules, "pynvml", None)  # nvidia-ml-py not installed
    stats, reason = devices.nvml_stats()
    assert stats == [] and "not importable" in reason


def test_nvml_gpus_in_cuda_order_with_their_processes(monkeypatch):
    gib = 1 << 30
    me = os.getpid()
    fake = FakeNVML(
        [  # NVML's (PCI) order; CUDA's order is the other way round
            {"uuid": "GPU-bbb", "name": "NVIDIA B", "used": 1 * gib, "total": 40 * gib,
             "util": 5, "temp": FakeNVML.NVMLError_NotSupported, "procs": [(77, None)]},
            {"uuid": "GPU-aaa", "name": "NVIDIA A", "used": 6 * gib, "total": 80 * gib,
             "util": 90, "temp": 61, "procs": [(4242, 3 * gib), (me, 2 * gib)]},
        ]
    )  # fmt: skip
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    monkeypatch.setattr(devices.readings, "_cuda_uuids", lambda: {"aaa": 0, "bbb": 1})

    def no_gputil():
        raise AssertionError("GPUtil must not run when NVML answers")

    monkeypatch.setattr(devices.readings, "nvidia_smi_stats", no_gputil)
    stats, reason = devices.gpu_stats()
    assert reason is None and fake.shutdowns == 1
    a, b = stats
    assert [(s.cuda_index, s.uuid, s.name, s.source) for s in stats] == [
        (0, "GPU-aaa", "NVIDIA A", "nvml"),
        (1, "GPU-bbb", "NVIDIA B", "nvml"),
    ]
    assert (a.memory_used, a.memory_total, a.utilization, a.temperature) == (
        6 * gib, 80 * gib, 90.0, 61.0,
    )  # fmt: skip
    assert b.temperature is None and b.utilization == 5.0  # not supported on B: None
    assert [(p.pid, p.used, p.this_process) for p in a.processes] == sorted(
        [(4242, 3 * gib, False), (me, 2 * gib, True)]
    )
    assert a.other_processes_used == 3 * gib
    assert b.other_processes_used is None  # the driver does not say how much pid 77 holds


def test_snapshot_reads_gpus_from_nvml(monkeypatch):
    from memkit.snapshots import snapshot

    gib = 1 << 30
    fake = FakeNVML(
        [{"uuid": "GPU-aaa", "name": "NVIDIA A", "used": 6 * gib, "total": 80 * gib,
          "util": 90, "temp": 61, "procs": []}]
    )  # fmt: skip
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    monkeypatch.setattr(devices.readings, "_cuda_uuids", dict)
    monkeypatch.setattr(devices, "visible_devices", list)  # torch sees none of them
    row = snapshot().devices[0]
    assert (row.name, row.used, row.total, row.used_source) == ("NVIDIA A", 6 * gib, 80 * gib,
                                                                 "nvml")  # fmt: skip


def test_real_nvml_here_gives_gpus_or_a_reason():
    stats, reason = devices.nvml_stats()
    assert stats or reason
    assert all(s.source == "nvml" and s.memory_total for s in stats)
