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


def test_import_is_cheap_and_torch_free():
    code = "import sys, memkit; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_integrations_package_imports_no_framework():
    """``import memkit`` and ``import memkit.integrations`` load neither torch nor the
    frameworks; their shared part loads torch (the tracker) but no framework; only
    ``memkit.integrations.lightning``/``.transformers`` need theirs."""
    names = "('torch', 'lightning', 'transformers', 'accelerate', 'pytorch_lightning')"
    code = (
        "import sys, memkit, memkit.integrations;"
        f"print(sorted(m for m in {names} if m in sys.modules));"
        "import memkit.integrations._common;"
        f"print(sorted(m for m in {names} if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["[]", "['torch']"]
