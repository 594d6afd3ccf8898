"""examples/notebook.ipynb runs in a real ipykernel, and its cells render memkit's HTML.

The kernel is this test's own interpreter (``sys.executable``, so the project's virtual
environment, started warm: tests/warm_processes.py), declared by a kernelspec written to a
temporary ``JUPYTER_PATH``: nothing is installed in the user's Jupyter directories, and a
``python3`` kernelspec elsewhere on the machine (pointing at another Python) cannot be picked
by mistake.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
from conftest import warm

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
NOTEBOOK = EXAMPLES / "notebook.ipynb"
KERNEL = "memkit-test"


@pytest.fixture
def kernel_name(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """A kernelspec for this interpreter in a temporary Jupyter path; hermetic runtime dirs."""
    spec = tmp_path / "jupyter" / "kernels" / KERNEL
    spec.mkdir(parents=True)
    (spec / "kernel.json").write_text(
        json.dumps(
            {
                "argv": warm(
                    [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"]
                ),
                "display_name": f"memkit test ({sys.executable})",
                "language": "python",
            }
        )
    )
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path / "jupyter"))
    monkeypatch.setenv("JUPYTER_RUNTIME_DIR", str(tmp_path / "runtime"))
    monkeypatch.setenv("JUPYTER_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.setenv("JUPYTER_CONFIG_DIR", str(tmp_path / "config"))
    monkeypatch.setenv("JUPYTER_PLATFORM_DIRS", "1")
    monkeypatch.setenv("IPYTHONDIR", str(tmp_path / "ipython"))
    monkeypatch.setenv("PYDEVD_DISABLE_FILE_VALIDATION", "1")  # quiet debugger warning
    return KERNEL


def _by_tag(nb: Any, tag: str) -> Any:
    for cell in nb.cells:
        if tag in cell.get("metadata", {}).get("tags", []):
            return cell
    raise AssertionError(f"no cell tagged {tag!r} in {NOTEBOOK.name}")


def _html(cell: Any) -> str:
    return "".join(
        out.get("data", {}).get("text/html", "")
        for out in cell.get("outputs", [])
        if out.get("output_type") in ("execute_result", "display_data")
    )


def _stdout(cell: Any) -> str:
    return "".join(
        out.get("text", "")
        for out in cell.get("outputs", [])
        if out.get("output_type") == "stream" and out.get("name") == "stdout"
    )


@pytest.mark.slow
def test_notebook_executes_and_renders_html(kernel_name: str) -> None:
    nb = nbformat.read(NOTEBOOK, as_version=4)
    client = nbclient.NotebookClient(
        nb,
        timeout=120,
        kernel_name=kernel_name,
        resources={"metadata": {"path": str(EXAMPLES)}},
    )
    client.execute()  # raises CellExecutionError, with the traceback, if a cell fails

    for cell in nb.cells:
        errors = [o for o in cell.get("outputs", []) if o.get("output_type") == "error"]
        assert not errors, errors

    table = _html(_by_tag(nb, "snapshot"))
    assert '<div class="memkit">' in table and "memkit-snapshot" in table
    assert 'class="bar"' in table or "no accelerator visible" in table
    assert "used</b>: what nvidia-smi shows" in table  # the one-line explanations

    model = _html(_by_tag(nb, "model-snapshot"))
    assert "what it holds" in model and "optimizer state" in model
    assert "embed.weight (= head.weight)" in model  # tied weights named once, with the alias

    diff = _html(_by_tag(nb, "diff"))
    assert "memkit-diff" in diff and "start -&gt; after one step" in diff
    assert "gradients" in diff and "+" in diff

    assert "memkit snapshot diff" in _stdout(_by_tag(nb, "diff-text"))

    simulated = _html(_by_tag(nb, "simulated"))
    assert "simulated cpu" in simulated and 'class="bar"' in simulated
    assert "live storages minus the categorised ones" in simulated

    assert "OOM: Simulated device cpu out of memory" in _stdout(_by_tag(nb, "simulated-oom"))

    probe = _html(_by_tag(nb, "probe-result"))
    assert "memkit probe" in probe and "Largest batch that fits (train)" in probe
    assert "[accumulate]" not in probe and "accumulate" in probe  # the advice table

    track = _html(_by_tag(nb, "track-report"))
    assert "<svg" in track  # the memory-over-time plot
    assert "embed" in track and "block" in track  # the module table
