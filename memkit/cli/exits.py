"""How a command ends: :func:`handle_errors` turns what escapes a command into one line on
stderr and the documented exit code (see :mod:`memkit.cli`)."""

from __future__ import annotations

import functools
import os
import sys
import traceback
from collections.abc import Callable
from typing import Any, TypeVar

import click

from memkit.errors import MemkitError

F = TypeVar("F", bound=Callable[..., Any])

EXIT_INTERNAL = 3
"""memkit itself failed (an exception that is neither a MemkitError nor the user's)."""
EXIT_INTERRUPTED = 130
"""Ctrl-C (128 + SIGINT), as a shell reports it."""


def handle_errors(func: F) -> F:
    """Turn a MemkitError into one line on stderr and its exit code; Ctrl-C into exit 130
    (``memkit: interrupted``); any other exception into one line naming it and exit 3 (set
    ``MEMKIT_TRACEBACK=1`` for its traceback). Never exit 1 for these: 1 means "does not fit".
    """

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return func(*args, **kwargs)
        except MemkitError as exc:
            click.echo(f"memkit: error: {exc}", err=True)
            sys.exit(exc.exit_code)
        except KeyboardInterrupt:
            click.echo("memkit: interrupted", err=True)
            sys.exit(EXIT_INTERRUPTED)
        except (click.exceptions.ClickException, click.exceptions.Abort, click.exceptions.Exit):
            raise
        except Exception as exc:
            if os.environ.get("MEMKIT_TRACEBACK"):
                click.echo(traceback.format_exc().rstrip(), err=True)
            cause = str(exc).strip().splitlines()
            click.echo(
                f"memkit: internal error: {type(exc).__name__}"
                + (f": {cause[0][:300]}" if cause else "")
                + " (a failure in memkit itself, not in your code; MEMKIT_TRACEBACK=1 shows "
                "where; please report it)",
                err=True,
            )
            sys.exit(EXIT_INTERNAL)

    return wrapper  # type: ignore[return-value]
