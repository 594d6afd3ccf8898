"""The package's public face: lazy exports that stay functions, whatever was imported first."""

from __future__ import annotations

import importlib
import subprocess
import sys

import memkit

SUBMODULES = [
    "memkit.probing.search",
    "memkit.probing.runner",
    "memkit.tracking.tracker",
    "memkit.snapshots",
    "memkit.microbatching",
    "memkit.estimation",
]
FUNCTIONS = ["probe", "probe_file", "track", "snapshot", "microbatch", "estimate", "simulate"]


def test_exported_functions_stay_functions_after_submodule_imports():
    for name in SUBMODULES:
        importlib.import_module(name)
    for name in FUNCTIONS:
        value = getattr(memkit, name)
        assert callable(value) and getattr(value, "__name__", "") == name, name


def test_every_name_in_all_resolves():
    for name in memkit.__all__:
        assert getattr(memkit, name) is not None


def test_torch_frameworks_and_cuda_are_loaded_only_when_needed():
    """In one fresh interpreter (each costs an ``import torch`` when it gets that far):
    ``import memkit``, ``import memkit.integrations`` and ``memkit --help`` load neither torch
    nor a framework; the integrations' shared part loads torch (the tracker) but no framework
    (only ``memkit.integrations.lightning``/``.transformers`` need theirs); none of them, nor
    ``get_backend(None)`` and ``visible_devices()``, initialises CUDA."""
    names = "('torch', 'lightning', 'transformers', 'accelerate', 'pytorch_lightning')"
    loaded = f"print(sorted(m for m in {names} if m in sys.modules));"
    code = (
        f"import sys, memkit; {loaded}"
        f"import memkit.integrations; {loaded}"
        "from click.testing import CliRunner; from memkit.cli import cli;"
        "r = CliRunner().invoke(cli, ['--help']); assert r.exit_code == 0, r.output;"
        f"{loaded}"
        f"import memkit.integrations._common; {loaded}"
        "import torch; print(torch.cuda.is_initialized());"
        "from memkit.devices import get_backend, visible_devices;"
        "get_backend(None); visible_devices(); print(torch.cuda.is_initialized())"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["[]", "[]", "[]", "['torch']", "False", "False"]
