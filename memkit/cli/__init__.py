"""The ``memkit`` command line: thin click commands that parse, call, render and exit.

Exit codes: 0 success; 1 does not fit (even the minimum); 2 usage, configuration or model-file
error; 3 the user's code raised an error that is not an OOM, or memkit itself failed; 4 a
distributed failure; 130 interrupted (Ctrl-C). A :class:`~memkit.errors.MemkitError` becomes one
line on stderr (``memkit: error: ...``); any other exception escaping a command is memkit's own
failure: one line naming it (``memkit: internal error: ...``), exit 3, never 1 ("does not fit").
While a command runs, memkit's log records stay out of the user's logging handlers (its
warnings go to stderr).
torch is imported inside command bodies only, so ``memkit --help`` stays fast.

One module per command (probe, run, estimate, snapshot, inspect; ``--gpus`` in compare), the
shared option checks in parsing, targets and streams, the exit codes in exits.
"""

from __future__ import annotations

import sys
import warnings

import click

from memkit._version import __version__
from memkit.cli import estimate, inspect, probe, run, snapshot
from memkit.cli.estimate import _ESTIMATE_ARCHS, estimate_command
from memkit.cli.exits import EXIT_INTERNAL, EXIT_INTERRUPTED, handle_errors
from memkit.cli.inspect import inspect_command
from memkit.cli.run import run_command
from memkit.cli.snapshot import _stdout_is_tty, snapshot_command
from memkit.cli.streams import (
    _stderr_is_terminal,
    _user_output_to_stderr,
    memkit_logs_to_stderr,
)
from memkit.cli.targets import _check_host_backs, _check_target, _host_budgets, _rank_budget

__all__ = [
    "EXIT_INTERNAL",
    "EXIT_INTERRUPTED",
    "_ESTIMATE_ARCHS",
    "_check_host_backs",
    "_check_target",
    "_host_budgets",
    "_rank_budget",
    "_stderr_is_terminal",
    "_stdout_is_tty",
    "_user_output_to_stderr",
    "cli",
    "estimate_command",
    "handle_errors",
    "inspect_command",
    "main",
    "run_command",
    "snapshot_command",
]


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="memkit")
def cli() -> None:
    """Measure, explain and fix PyTorch out-of-memory errors.

    \b
    memkit probe model.py      largest batch that fits, exactly
    memkit run train.py        memory per device, module and phase while a script trains
    memkit snapshot            what is on every device right now
    memkit estimate model.py   will it fit on a GPU you do not have?
    memkit inspect mem.pickle  memkit's view of a PyTorch memory snapshot
    """
    # memkit prints its own report: its log records stay out of the user's logging handlers
    click.get_current_context().with_resource(memkit_logs_to_stderr())


def main(argv: list[str] | None = None) -> None:
    """Console-script entry point. A usage error click finds (a mistyped option, a missing
    argument) is one line, ``memkit: error: ...``, as memkit's own are: a script's argparse
    error (the same exit code 2 under ``memkit run``) looks different."""
    # torch warns at import when NumPy is absent; memkit does not need NumPy.
    warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
    try:
        code = cli.main(args=argv, prog_name="memkit", standalone_mode=False)
    except click.UsageError as exc:
        where = exc.ctx.command_path if exc.ctx is not None else "memkit"
        sys.stderr.write(f"memkit: error: {exc.format_message()} (see '{where} --help')\n")
        sys.exit(exc.exit_code)
    except click.ClickException as exc:
        exc.show()
        sys.exit(exc.exit_code)
    except click.exceptions.Abort:
        sys.stderr.write("Aborted!\n")
        sys.exit(1)
    sys.exit(code if isinstance(code, int) else 0)


for _command in (
    probe.probe,
    snapshot.snapshot_command,
    run.run_command,
    inspect.inspect_command,
    estimate.estimate_command,
):
    cli.add_command(_command)
