"""Golden files: what a person reads and what a program parses, so that a change shows as a diff.

* tests/golden/NAME.txt: the command line's text (probe, estimate, run, snapshot), timings
  masked;
* tests/golden/results/CASE.txt, .json, .html: every result kind of :data:`result_cases.CASES`
  (built from fixed numbers: no clock, no host name) as ``str()``, ``to_json()`` and
  ``html_body()``. The HTML is one line; the file holds it split after each ``>`` followed
  by ``<`` (no other change), so that a diff shows the element that changed. Wall-clock
  times in the text are masked (``<time>``: the local time zone moves them).

Regenerate after an intended change with ``python -m pytest tests/test_golden.py
--update-golden``, then review ``git diff tests/golden`` before committing.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from click.testing import CliRunner
from result_cases import CASES

from memkit.cli import cli

FILES = Path(__file__).parent / "modelfiles"


def _timings_masked(text: str) -> str:
    """The seconds a trial or a step took (``0.42s``, a table's last column) as ``#.##``."""
    text = re.sub(r"(?m)(\s)\d+\.\d\ds$", r"\1#.##s", text)
    return re.sub(r"(?m)( {2,})\d+\.\d\d$", lambda m: m.group(1) + "#.##", text)


def _clock_masked(text: str) -> str:
    """Dates and times of day (a snapshot's ``taken_at`` in local time) as ``<time>``."""
    return re.sub(r"\d{4}-\d\d-\d\d[ T][\d:.]+", "<time>", text)


@pytest.mark.parametrize("case", sorted(CASES))
def test_result_text_json_and_html(golden, case):
    result = CASES[case]()
    golden(f"results/{case}", _clock_masked(str(result)) + "\n")
    golden(f"results/{case}", result.to_json() + "\n", ".json")
    body = result.html_body()
    assert "\n" not in body, "the HTML split below is reversible only for one-line markup"
    golden(f"results/{case}", _clock_masked(body.replace("><", ">\n<")) + "\n", ".html")


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
    golden(name, _timings_masked(result.stdout))


def test_probe_sweep_text(golden):
    result = CliRunner().invoke(
        cli,
        ["probe", "examples/gpt2.py", "--device", "cpu", "--budget", "96MiB", "--seq-len",
         "16,32", "--max-batch", "64"],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    golden("probe_sweep", _timings_masked(result.stdout))


def test_estimate_text(golden):
    result = CliRunner().invoke(
        cli,
        ["estimate", "examples/gpt2.py", "--device-memory", "8GiB", "--seq-len", "128"],
    )
    assert result.exit_code == 0, result.output
    golden("estimate_gpt2", _timings_masked(result.stdout))


def test_run_report_text(golden):
    """`memkit run` on the plain training script of examples/: the report on stderr."""
    result = CliRunner().invoke(
        cli,
        ["run", "--device", "cpu", "--budget", "256MiB", "examples/train.py", "--epochs", "1"],
    )
    assert result.exit_code == 0, result.output
    report = re.sub(r"step\(s\) in \d+\.\d\d s", "step(s) in #.## s", result.stderr)
    golden("run_train", _timings_masked(report))


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
    text = re.sub(r"\b\d+(\.\d+)?%", "#%", _clock_masked(text))
    golden("snapshot_no_accelerator", _timings_masked(text))
