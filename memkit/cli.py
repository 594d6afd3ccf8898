"""The ``memkit`` command line: thin click commands that parse, call, render and exit.

Exit codes: 0 success; 1 does not fit (even the minimum); 2 usage, configuration or model-file
error; 3 the user's code raised an error that is not an OOM; 4 a distributed failure. A
:class:`~memkit.errors.MemkitError` becomes one line on stderr (``memkit: error: ...``).
torch is imported inside command bodies only, so ``memkit --help`` stays fast.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import Any, TypeVar

import click

from memkit import __version__
from memkit.errors import MemkitError

F = TypeVar("F", bound=Callable[..., Any])


def handle_errors(func: F) -> F:
    """Turn a MemkitError into one line on stderr and its exit code."""

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return func(*args, **kwargs)
        except MemkitError as exc:
            click.echo(f"memkit: error: {exc}", err=True)
            sys.exit(exc.exit_code)

    return wrapper  # type: ignore[return-value]


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="memkit")
def cli() -> None:
    """Measure, explain and fix PyTorch out-of-memory errors.

    \b
    memkit probe model.py      largest batch that fits, exactly
    memkit run train.py        memory per device, module and phase while a script trains
    memkit snapshot            what is on every device right now
    memkit estimate model.py   will it fit on a GPU you do not have?
    """


def main(argv: list[str] | None = None) -> None:
    """Console-script entry point."""
    cli.main(args=argv, prog_name="memkit")

