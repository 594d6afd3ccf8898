"""`memkit run SCRIPT`: the scenario scripts of real failures, exit codes, argv, files, ranks."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from memkit.cli import cli

SCENARIOS = Path(__file__).parent / "scenarios"


def run(*args: str):
    return CliRunner().invoke(cli, ["run", *args])


def test_accumulating_loss_leak_is_named_then_runs_out():
    result = run(
        "--device", "cpu", "--budget", "6MiB",
        str(SCENARIOS / "accumulating_loss_leak.py"), "--steps", "40",
    )  # fmt: skip
    assert result.exit_code == 1, result.output
    err = result.stderr
    assert "Traceback" in err and "OutOfMemoryError" in err
    assert "memory grows by" in err and "[graph-retained]" in err
    assert "`running_loss`" in err and "accumulating_loss_leak.py:train()" in err
    assert "loss.item()" in err
    assert "memkit: out of memory on cpu" in err


def test_backward_oom_names_phase_and_layer(tmp_path):
    out = tmp_path / "report.json"
    result = run(
        "--device", "cpu", "--budget", "28MiB", "--json", str(out),
        str(SCENARIOS / "backward_oom.py"), "--steps", "1",
    )  # fmt: skip
    assert result.exit_code == 1, result.output
    assert "at step 0, backward of classifier" in result.stderr
    data = json.loads(out.read_text())
    oom = data["oom"]
    assert oom["phase"] == "backward" and oom["module"] == "classifier"
    assert oom["tried_to_allocate"] == 8 * 1024**2 and oom["capacity"] == 28 * 1024**2
    assert oom["breakdown"]["parameters"] > 0 and oom["breakdown"]["activations"] > 0
    assert any(a["code"] == "oom-activations" for a in oom["advice"])


def test_eval_without_no_grad_is_diagnosed():
    result = run(
        "--device", "cpu", "--budget", "48MiB",
        str(SCENARIOS / "eval_without_no_grad.py"), "--train-steps", "1",
    )  # fmt: skip
    assert result.exit_code == 1, result.output
    err = result.stderr
    assert "eval mode with autograd recording" in err
    assert "[eval-grad-enabled]" in err and "torch.no_grad()" in err


def test_frozen_backbone_trains_and_writes_files(tmp_path):
    out, page = tmp_path / "r.json", tmp_path / "r.html"
    result = run(
        "--device", "cpu", "--budget", "128MiB", "--json", str(out), "--html", str(page),
        str(SCENARIOS / "frozen_backbone.py"), "--steps", "2", "--batch", "8",
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    assert "step 1 loss" in result.stdout and "memkit track" not in result.stdout
    assert "2 step(s)" in result.stderr
    data = json.loads(out.read_text())
    assert data["steps"] == 2 and data["devices"][0]["phase_peaks"]["backward"] is not None
    html = page.read_text()
    assert html.startswith("<!DOCTYPE html>") and "<svg" in html and "<script" not in html


def write(tmp_path: Path, text: str) -> Path:
    script = tmp_path / "train.py"
    script.write_text(text)
    return script


def test_exit_codes_argv_and_main(tmp_path):
    script = write(
        tmp_path,
        "import sys\nprint('argv', sys.argv[1:], __name__)\nsys.exit(int(sys.argv[1]))\n",
    )
    result = run("--device", "cpu", "--budget", "8MiB", str(script), "7", "--flag")
    assert result.exit_code == 7
    assert "argv ['7', '--flag'] __main__" in result.stdout
    bad = write(tmp_path, "raise ValueError('not an oom')\n")
    result = run("--device", "cpu", "--budget", "8MiB", str(bad))
    assert result.exit_code == 3 and "ValueError: not an oom" in result.stderr
    missing = run("--device", "cpu", str(tmp_path / "nope.py"))
    assert missing.exit_code == 2 and "memkit: error:" in missing.output


def test_steps_only_and_rank_prefix(tmp_path, monkeypatch):
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    script = write(
        tmp_path,
        "import torch\nm = torch.nn.Linear(8, 8)\nopt = torch.optim.SGD(m.parameters(), lr=.1)\n"
        "for _ in range(3):\n    m(torch.randn(4, 8)).sum().backward(); opt.step()\n",
    )
    result = run(
        "--device", "cpu", "--budget", "8MiB", "--steps-only", "--json",
        str(tmp_path / "report.json"), str(script),
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert lines and all(line.startswith("[rank 1] ") for line in lines)
    assert "rank 1/2" in result.stderr and "mode steps-only" in result.stderr
    data = json.loads((tmp_path / "report.rank1.json").read_text())
    assert data["rank"] == 1 and data["steps"] == 3


@pytest.mark.slow
def test_real_process_keeps_exit_code(tmp_path):
    script = write(
        tmp_path, "import torch\nm = torch.nn.Linear(64, 1024)\nm(torch.randn(512, 64))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-m", "memkit", "run", "--device", "cpu", "--budget", "1MiB",
         str(script)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 1, proc.stderr
    assert "memkit: out of memory on cpu at step 0, forward of Linear" in proc.stderr
