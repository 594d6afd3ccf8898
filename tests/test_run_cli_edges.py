"""`memkit run`'s edges (issue #25): a mistyped memkit option before the script, `--json -`,
what runs without `--device`, and a script that exits before its first step."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

from memkit.cli import cli

ARGPARSE_SCRIPT = """import argparse
import torch
parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=2)
args = parser.parse_args()
model = torch.nn.Linear(8, 8)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(args.steps):
    model(torch.randn(4, 8)).sum().backward()
    opt.step()
    opt.zero_grad()
open(MARKER, "w").write("ran")
"""


def invoke(*args: str):
    return CliRunner().invoke(cli, list(args))


def script(tmp_path: Path) -> tuple[Path, Path]:
    marker = tmp_path / "ran.marker"
    path = tmp_path / "train.py"
    path.write_text(ARGPARSE_SCRIPT.replace("MARKER", repr(str(marker))))
    return path, marker


@pytest.mark.parametrize(
    ("typo", "meant"), [("--budjet", "--budget"), ("--devcie", "--device"), ("--jsn", "--json")]
)
def test_a_mistyped_option_before_the_script_is_a_usage_error(tmp_path, typo, meant):
    path, marker = script(tmp_path)
    result = invoke("run", "--device", "cpu", typo, "64MiB", str(path))
    assert result.exit_code == 2, result.output
    assert f"No such option '{typo}'" in result.stderr
    assert f"Did you mean '{meant}'?" in result.stderr
    assert "found no file" not in result.output and not marker.exists()


def test_probe_says_the_same_for_its_options(tmp_path):
    result = invoke("probe", "--devcie", "cpu", str(tmp_path / "model.py"))
    assert result.exit_code == 2 and "Did you mean '--device'?" in result.stderr


def test_a_script_named_like_an_option_still_runs(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    path, marker = script(tmp_path)
    odd = tmp_path / "-odd.py"
    odd.write_text(path.read_text())
    result = invoke("run", "--device", "cpu", "--budget", "8MiB", "-odd.py")
    assert result.exit_code == 0, result.output
    assert marker.exists() and "2 step(s)" in result.stderr


@pytest.mark.parametrize("option", ["--json", "--html", "--memory-history"])
def test_dash_is_refused_not_written_as_a_file(tmp_path, monkeypatch, option):
    monkeypatch.chdir(tmp_path)
    path, marker = script(tmp_path)
    result = invoke("run", "--device", "cpu", "--budget", "8MiB", option, "-", str(path))
    assert result.exit_code == 2, result.output
    (line,) = result.stderr.splitlines()
    assert line.startswith(f"memkit: error: {option} '-': expected a file name")
    assert "stdout is the script's" in line
    assert not (tmp_path / "-").exists() and not marker.exists()


def test_help_says_what_runs_without_a_device():
    result = invoke("run", "--help")
    text = " ".join(result.output.split())
    assert "Default: current GPU" not in text
    assert "on a machine without one, the simulated cpu device" in text


def test_a_script_that_exits_before_its_first_step_says_so_in_one_line(tmp_path):
    path, marker = script(tmp_path)
    result = invoke("run", "--device", "cpu", "--budget", "8MiB", str(path), "--stepz", "3")
    assert result.exit_code == 2  # the script's argparse, not memkit
    assert "unrecognized arguments: --stepz" in result.stderr
    lines = [line for line in result.stderr.splitlines() if line.startswith("memkit:")]
    assert lines == [
        "memkit: the script exited with code 2 before its first step (no model forward ran): "
        "nothing to report. The exit code is the script's own; memkit's usage errors exit 2 "
        "with a 'memkit: error:' line before the script starts."
    ]
    assert "memkit track:" not in result.stderr and not marker.exists()
    # the same script, run through: the full report, not the line
    ok = invoke("run", "--device", "cpu", "--budget", "8MiB", str(path), "--steps", "2")
    assert ok.exit_code == 0 and marker.exists()
    assert "memkit track: 2 step(s)" in ok.stderr and "before its first step" not in ok.stderr


def test_ctrl_c_before_the_first_step_says_so_in_one_line(tmp_path):
    """Sweep C pressed Ctrl-C while a script was still loading: it got "the script exited with
    code 130 before its first step ... the exit code is the script's own" and then "interrupted
    by Ctrl-C at step 0; the numbers cover what ran until then". One line now, and it is true."""
    path = tmp_path / "slow_start.py"
    path.write_text("raise KeyboardInterrupt  # Ctrl-C while the script still loads its data\n")
    result = invoke("run", "--device", "cpu", "--budget", "8MiB", str(path))
    assert result.exit_code == 130
    lines = [line for line in result.stderr.splitlines() if line.startswith("memkit:")]
    assert lines == [
        "memkit: interrupted by Ctrl-C before the script's first step (no model forward ran): "
        "nothing to report (exit 130)"
    ], result.stderr


def test_the_console_entry_point_words_click_usage_errors_as_one_memkit_line(tmp_path, capsys):
    """What a user's shell runs (``memkit = memkit.cli:main``): a mistyped option or a missing
    argument is the one line ``memkit: error: ...``, exit 2, as memkit's own usage errors; a
    script's argparse error looks different."""
    from memkit.cli import main

    path, marker = script(tmp_path)
    for argv, fragment in (
        (["run", "--budjet", "64MiB", str(path)], "No such option '--budjet'"),
        (["probe"], "Missing argument 'FILE'"),
    ):
        with pytest.raises(SystemExit) as exit_info:
            main(argv)
        err = capsys.readouterr().err
        assert exit_info.value.code == 2
        assert err.startswith("memkit: error: ") and fragment in err
        assert len(err.strip().splitlines()) == 1 and "Usage:" not in err
    assert not marker.exists()
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
