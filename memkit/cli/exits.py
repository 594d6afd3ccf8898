"""How a command ends: :func:`handle_errors` turns what escapes a command into one line on
stderr and the documented exit code (see :mod:`memkit.cli`)."""

from __future__ import annotations

import contextlib
import functools
import os
import sys
import traceback
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import click

from memkit.errors import MemkitError, UserCodeError

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


@contextlib.contextmanager
def model_code_cannot_exit() -> Iterator[None]:
    """While memkit runs a model file's code: a ``SystemExit`` from it (``sys.exit`` in a
    model's ``forward``, say) is a :class:`UserCodeError` (exit 3, one line), not the end of
    memkit with the file's exit code and no report. (Its functions' ``sys.exit`` is caught
    where they are called, :class:`memkit.modelfile.SysExitCalled`; loading it is exit 2.)"""
    try:
        yield
    except SystemExit as exc:
        where = "".join(traceback.format_tb(exc.__traceback__)[-1:]).rstrip()
        raise UserCodeError(
            f"the model file's code called sys.exit({exc.code!r}) while memkit ran it; memkit "
            "runs its code many times: return, or raise an error, instead"
            + (f"\n{where}" if where else ""),
            original=exc,
        ) from exc
