"""The standard streams while a command runs: the user's output kept off stdout, memkit's log
records kept out of the user's logging, and whether a person watches stderr."""

from __future__ import annotations

import contextlib
import logging
import logging.config
import os
import sys
from collections.abc import Callable, Iterator

import click

from memkit.cli.exits import raise_if_interrupted


class _StderrHandler(logging.StreamHandler):
    """Writes to whatever ``sys.stderr`` is when a record comes (a test runner's, a
    redirect's), not to the stream of when it was made."""

    @property
    def stream(self) -> object:
        return sys.stderr

    @stream.setter
    def stream(self, _value: object) -> None:
        pass


@contextlib.contextmanager
def memkit_logs_to_stderr() -> Iterator[None]:
    """While a command runs, memkit's log records (the ``memkit`` logger) do not reach the
    handlers of the user's code (``logging.basicConfig(stream=sys.stdout)`` in a script or a
    model file): the command prints what memkit has to say itself, and its warnings go to
    stderr, one line each. Restored after (the Python API leaves memkit's records to the
    application's logging)."""
    logger = logging.getLogger("memkit")
    handler = _StderrHandler()
    handler.setLevel(logging.WARNING)
    handler.setFormatter(logging.Formatter("%(message)s"))
    saved = logger.propagate
    # a logging.config.dictConfig or fileConfig (disable_existing_loggers, their default) in a
    # script or a library it imports disables the loggers made before it, memkit's among
    # them: enabled now, and again after each such call while the command runs
    disabled = _enable_memkit_loggers()
    configs = {name: getattr(logging.config, name) for name in ("dictConfig", "fileConfig")}
    for name, configure in configs.items():
        setattr(logging.config, name, _reenabling(configure))
    logger.addHandler(handler)
    logger.propagate = False
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.propagate = saved
        for name, configure in configs.items():
            setattr(logging.config, name, configure)
        for found in disabled:
            found.disabled = True


def _enable_memkit_loggers() -> list[logging.Logger]:
    """Enable memkit's disabled loggers; those it enabled."""
    disabled = [
        found
        for name, found in logging.root.manager.loggerDict.items()
        if (name == "memkit" or name.startswith("memkit."))
        and isinstance(found, logging.Logger)
        and found.disabled
    ]
    for found in disabled:
        found.disabled = False
    return disabled


def _reenabling(configure: Callable[..., None]) -> Callable[..., None]:
    """``configure`` (``logging.config.dictConfig``), then memkit's loggers enabled again."""

    def wrapper(*args: object, **kwargs: object) -> None:
        try:
            configure(*args, **kwargs)
        finally:
            _enable_memkit_loggers()

    return wrapper


@contextlib.contextmanager
def _user_output_to_stderr() -> Iterator[Callable[[str], None]]:
    """While the model file runs, what it writes to standard output goes to standard error:
    Python's prints and what native code writes to file descriptor 1 alike, so that with
    ``--json`` stdout is one JSON object. Yields ``echo``, which writes memkit's own output
    (the report, the JSON) to the real standard output.

    Descriptor 1 stays on stderr after the block, until the process ends: what the model file
    prints at interpreter exit (``atexit``, ``__del__``, ``weakref.finalize``) cannot follow
    the JSON either; ``echo`` writes to a duplicate of the original descriptor. Without a
    descriptor (a test runner, a notebook) only ``sys.stdout`` is redirected, for the block.
    """
    stdout = sys.stdout
    saved: int | None = None
    try:
        if stdout.fileno() == 1:
            stdout.flush()
            saved = os.dup(1)
    except (AttributeError, OSError, ValueError):  # no descriptor, or a closed one
        saved = None
    if saved is not None:
        os.dup2(2, 1)  # for good: the original is `saved`, echo's
    encoding = getattr(stdout, "encoding", None) or "utf-8"

    def echo(text: str) -> None:
        raise_if_interrupted()  # no answer after a Ctrl-C (memkit: interrupted, exit 130)
        if saved is None:
            click.echo(text, file=stdout)
            return
        with open(saved, "w", encoding=encoding, errors="replace", closefd=False) as out:
            out.write(text + "\n")

    with contextlib.redirect_stdout(sys.stderr):
        yield echo
    if saved is not None:
        stdout.flush()  # what the file printed, buffered: to stderr, where fd 1 now goes


def _stderr_is_terminal() -> bool:
    """Progress lines only for a person watching: not in logs, pipes or CI."""
    try:
        return sys.stderr.isatty()
    except (AttributeError, ValueError):
        return False
