"""The standard streams while a command runs: the user's output kept off stdout, and whether
a person watches stderr."""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator


@contextlib.contextmanager
def _user_output_to_stderr() -> Iterator[None]:
    """While the model file runs, what it writes to standard output goes to standard error:
    Python's prints and what native code writes to file descriptor 1 alike, so that with
    ``--json`` stdout is one JSON object."""
    stdout = sys.stdout
    try:
        real = stdout.fileno() == 1
    except (AttributeError, OSError, ValueError):  # no descriptor (a test runner, a notebook)
        real = False
    with contextlib.ExitStack() as stack:
        if real:
            stdout.flush()
            saved = os.dup(1)
            os.dup2(2, 1)

            def restore() -> None:
                stdout.flush()
                os.dup2(saved, 1)
                os.close(saved)

            stack.callback(restore)
        stack.enter_context(contextlib.redirect_stdout(sys.stderr))
        yield


def _stderr_is_terminal() -> bool:
    """Progress lines only for a person watching: not in logs, pipes or CI."""
    try:
        return sys.stderr.isatty()
    except (AttributeError, ValueError):
        return False
