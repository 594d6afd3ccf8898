"""The command-line skeleton: version, help, error lines and exit codes."""

from __future__ import annotations

import subprocess
import sys

import click
from click.testing import CliRunner

import memkit
from memkit.cli import cli, handle_errors
from memkit.errors import ConfigError, DoesNotFitError, UserCodeError


def test_version_and_help():
    runner = CliRunner()
    result = runner.invoke(cli, ["--version"])
    assert result.exit_code == 0
    assert memkit.__version__ in result.output
    result = runner.invoke(cli, ["--help"])
    assert result.exit_code == 0
    assert "out-of-memory" in result.output


def test_unknown_command_is_a_usage_error():
    result = CliRunner().invoke(cli, ["frobnicate"])
    assert result.exit_code == 2


def test_memkit_error_becomes_one_line_and_its_exit_code():
    @click.command()
    @click.argument("kind")
    @handle_errors
    def boom(kind: str) -> None:
        errors = {
            "config": ConfigError("bad thing; do X"),
            "fit": DoesNotFitError("too big"),
            "user": UserCodeError("your code raised"),
        }
        raise errors[kind]

    runner = CliRunner()
    for kind, code in [("config", 2), ("fit", 1), ("user", 3)]:
        result = runner.invoke(boom, [kind])
        assert result.exit_code == code
        assert result.output.startswith("memkit: error: ")
        assert result.output.count("\n") == 1
        assert "Traceback" not in result.output


def test_python_dash_m_and_console_script():
    out = subprocess.run(
        [sys.executable, "-m", "memkit", "--version"], capture_output=True, text=True, check=True
    )
    assert memkit.__version__ in out.stdout
