"""How a command ends: :func:`handle_errors` turns what escapes a command into one line on
stderr and the documented exit code (see :mod:`memkit.cli`)."""

from __future__ import annotations

import contextlib
import functools
import os
import signal
import sys
import threading
import traceback
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import click

from memkit.errors import MemkitError, UserCodeError, on_command_line

F = TypeVar("F", bound=Callable[..., Any])

EXIT_INTERNAL = 3
"""memkit itself failed (an exception that is neither a MemkitError nor the user's)."""
EXIT_INTERRUPTED = 130
"""Ctrl-C (128 + SIGINT), as a shell reports it."""


def handle_errors(func: F) -> F:
    """Turn a MemkitError into one line on stderr and its exit code; Ctrl-C into exit 130
    (``memkit: interrupted``); any other exception into one line naming it and exit 3 (set
    ``MEMKIT_TRACEBACK=1`` for its traceback). Never exit 1 for these: 1 means "does not fit".
    Its messages name options as the command line spells them (:func:`memkit.errors.spelled`).
    """

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            with interrupts_kept(), on_command_line():
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


RESEND_SECONDS = 0.2
"""How soon a Ctrl-C Python dropped is sent again (:func:`interrupts_kept`)."""

_DROPPED = threading.Event()  # a Ctrl-C Python dropped in the command that runs now


def raise_if_interrupted() -> None:
    """Stop before a result is written when a Ctrl-C was dropped and not sent again yet (a
    command that ends within :data:`RESEND_SECONDS` of it would print its answer first)."""
    if _DROPPED.is_set():
        raise KeyboardInterrupt


@contextlib.contextmanager
def interrupts_kept() -> Iterator[None]:
    """No Ctrl-C is lost: Python runs its handler between any two bytecodes, also inside a
    weakref callback (the simulated device's free hook) or a ``__del__``, where the
    ``KeyboardInterrupt`` is printed as "Exception ignored" and dropped, and the command ran on
    with a free it never counted (a probe then answered a wrong size with exit 0). A dropped
    one is sent again after :data:`RESEND_SECONDS`, until it lands where it stops the
    command, and raised at the block's end if the block ends first (also by ``sys.exit``).
    Nothing is sent once the block has ended. Main thread only."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = sys.unraisablehook
    lock = threading.Lock()
    state = {"dropped": False, "pending": False, "open": True}

    def resend() -> None:
        with lock:
            if not state["open"]:
                return
            state["pending"] = False
        os.kill(os.getpid(), signal.SIGINT)

    def hook(unraisable: Any) -> None:
        if not isinstance(unraisable.exc_value, KeyboardInterrupt):
            previous(unraisable)
            return
        with lock:
            state["dropped"] = True
            if state["open"]:  # (a hook left installed after its command sets nothing)
                _DROPPED.set()
            if state["pending"] or not state["open"]:
                return
            state["pending"] = True
        timer = threading.Timer(RESEND_SECONDS, resend)
        timer.daemon = True
        timer.start()

    sys.unraisablehook = hook
    _DROPPED.clear()
    try:
        yield
    except SystemExit:
        if state["dropped"]:  # the command ended before the Ctrl-C sent again stopped it
            raise KeyboardInterrupt from None
        raise
    finally:
        with lock:
            state["open"] = False
            _DROPPED.clear()
        if sys.unraisablehook is hook:
            sys.unraisablehook = previous
    if state["dropped"]:  # the block ended before a Ctrl-C sent again stopped it
        raise KeyboardInterrupt


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
