"""Golden files for the text a person reads: wording regressions show as a diff.

Regenerate with ``python -m pytest tests/test_golden.py --update-golden`` and review the diff.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from click.testing import CliRunner

from memkit.cli import cli

FILES = Path(__file__).parent / "modelfiles"


@pytest.mark.parametrize(
    ("name", "args"),
    [
        ("probe_fits", ["ok_mlp.py", "--budget", "12MiB"]),
        ("probe_does_not_fit", ["ok_mlp.py", "--budget", "256KiB"]),
        ("probe_accumulation", ["ok_mlp.py", "--budget", "12MiB", "--target-batch", "10000"]),
        ("probe_train_infer", ["ok_mlp.py", "--budget", "12MiB", "--mode", "train,infer"]),
    ],
)
def test_probe_text(golden, name, args):
    file, *rest = args
    result = CliRunner().invoke(cli, ["probe", str(FILES / file), "--device", "cpu", *rest])
    assert result.exit_code in (0, 1), result.output
    golden(name, result.stdout)


def test_probe_sweep_text(golden):
    result = CliRunner().invoke(
        cli,
        ["probe", "examples/gpt2.py", "--device", "cpu", "--budget", "96MiB", "--seq-len",
         "16,32", "--max-batch", "64"],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    golden("probe_sweep", result.stdout)


def test_estimate_text(golden):
    result = CliRunner().invoke(
        cli,
        ["estimate", "examples/gpt2.py", "--device-memory", "8GiB", "--seq-len", "128"],
    )
    assert result.exit_code == 0, result.output
    golden("estimate_gpt2", result.stdout)


def test_run_report_text(golden):
    """`memkit run` on the plain training script of examples/: the report on stderr."""
    result = CliRunner().invoke(
        cli,
        ["run", "--device", "cpu", "--budget", "256MiB", "examples/train.py", "--epochs", "1"],
    )
    assert result.exit_code == 0, result.output
    report = re.sub(r"step\(s\) in \d+\.\d\d s", "step(s) in #.## s", result.stderr)
    golden("run_train", report)


@pytest.mark.skipif(
    __import__("memkit.devices").devices.accelerator_available(),
    reason="the golden snapshot is of a machine with no accelerator",
)
def test_snapshot_text(golden):
    """`memkit snapshot` on a machine with no accelerator: host RAM masked (it moves)."""
    result = CliRunner().invoke(cli, ["snapshot"])
    assert result.exit_code == 0, result.output
    text = re.sub(  # the host line's sizes move from run to run
        r"(?m)^(host: .*)$",
        lambda m: re.sub(r"\d+(\.\d+)? (B|KiB|MiB|GiB|TiB)\b", "# B", m.group(1)),
        result.stdout,
    )
    text = re.sub(r"\d{4}-\d\d-\d\d[ T][\d:.]+", "<time>", text)
    text = re.sub(r"\b\d+(\.\d+)?%", "#%", text)
    golden("snapshot_no_accelerator", text)
