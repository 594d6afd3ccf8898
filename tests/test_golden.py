"""Golden files for the text a person reads: wording regressions show as a diff.

Regenerate with ``python -m pytest tests/test_golden.py --update-golden`` and review the diff.
"""

from __future__ import annotations

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
