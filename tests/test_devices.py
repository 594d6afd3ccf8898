"""Backends: the simulated device, host memory, device parsing, guarded GPUtil."""

from __future__ import annotations

import builtins
import subprocess
import sys

import pytest
import torch

from memkit.devices import (
    Capacity,
    MemoryBackend,
    SimulatedBackend,
    default_cpu_budget,
    get_backend,
    host_memory,
    nvidia_smi_stats,
)
from memkit.errors import ConfigError


def test_cpu_backend_is_simulated_with_budget():
    backend = get_backend("cpu", "256MiB")
    assert isinstance(backend, SimulatedBackend)
    assert isinstance(backend, MemoryBackend)
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


def test_none_means_accelerator_else_simulated_cpu():
    backend = get_backend(None)
    if torch.cuda.is_available():
        assert backend.kind == "cuda"
    else:
        assert isinstance(backend, SimulatedBackend)
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
    with pytest.raises(ConfigError, match="--device cpu --budget"):
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


def test_import_memkit_and_help_do_not_initialise_cuda_or_import_torch():
    code = (
        "import sys, memkit; assert 'torch' not in sys.modules, 'torch imported';"
        "from memkit.cli import cli;"
        "from click.testing import CliRunner; r = CliRunner().invoke(cli, ['--help']);"
        "assert r.exit_code == 0, r.output; assert 'torch' not in sys.modules;"
        "import torch; print(torch.cuda.is_initialized())"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_get_backend_does_not_initialise_cuda():
    code = (
        "import torch; from memkit.devices import get_backend, visible_devices;"
        "get_backend(None); visible_devices(); print(torch.cuda.is_initialized())"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
