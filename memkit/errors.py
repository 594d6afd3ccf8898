"""One exception hierarchy for memkit, rooted at :class:`MemkitError`.

Every error says what was expected, what was found and what to do. The CLI turns a
``MemkitError`` into one line on stderr and exits with the class's ``exit_code``:

==========================  =========  ============================================
class                       exit code  meaning
==========================  =========  ============================================
``DoesNotFitError``         1          even the minimum batch does not fit
``ConfigError``             2          bad option, size, device or configuration
``MissingDependencyError``  2          an optional dependency is not installed
``ModelFileError``          2          the model file is missing or unusable
``UserCodeError``           3          the user's own code raised a non-OOM error
``DistributedError``        4          a rank failed or timed out
==========================  =========  ============================================
"""

from __future__ import annotations

import contextlib
import contextvars
import os
import reprlib
import sys
import warnings
from collections.abc import Iterator

__all__ = [
    "ConfigError",
    "DistributedError",
    "DoesNotFitError",
    "MemkitError",
    "MissingDependencyError",
    "ModelFileError",
    "UserCodeError",
    "check_flag",
    "check_whole",
    "found",
    "on_command_line",
    "spelled",
    "warn_user",
]

_ON_COMMAND_LINE = contextvars.ContextVar("memkit_on_command_line", default=False)


@contextlib.contextmanager
def on_command_line(on: bool = True) -> Iterator[None]:
    """While a ``memkit`` command runs: :func:`spelled` names what to give as its options
    (``on=False``: while ``memkit run`` runs the user's script, whose own calls of memkit's
    Python API are told its keywords)."""
    token = _ON_COMMAND_LINE.set(on)
    try:
        yield
    finally:
        _ON_COMMAND_LINE.reset(token)


def spelled(option: str, keyword: str) -> str:
    """What a message tells the user to give: ``option`` (``--seq-len N``) under a ``memkit``
    command, ``keyword`` (``seq_len=N``) in the Python API."""
    return option if _ON_COMMAND_LINE.get() else keyword


class MemkitError(RuntimeError):
    """Base class of every error memkit raises on purpose."""

    exit_code: int = 2


class ConfigError(MemkitError, ValueError):
    """Bad configuration: an option, a size, a device name, an argument combination."""

    exit_code = 2


class MissingDependencyError(ConfigError, ImportError):
    """An optional dependency (an extra such as ``memkit[lightning]``) is not installed.

    Also an ``ImportError``, so ``except ImportError`` around an optional import catches it.
    """

    exit_code = 2


class ModelFileError(MemkitError):
    """A model file could not be loaded or does not follow the model-file protocol."""

    exit_code = 2


class DoesNotFitError(MemkitError):
    """The work does not fit in the available memory even at the smallest size tried.

    Attributes:
        needed_bytes: the measured (or estimated) peak of the smallest attempt, if known.
        capacity_bytes: the memory that was available, if known.
    """

    exit_code = 1

    def __init__(
        self, message: str, *, needed_bytes: int | None = None, capacity_bytes: int | None = None
    ) -> None:
        super().__init__(message)
        self.needed_bytes = needed_bytes
        self.capacity_bytes = capacity_bytes


class UserCodeError(MemkitError):
    """The user's code raised an error that is not an out-of-memory error.

    The original exception is chained as ``__cause__`` and kept on ``original``.
    """

    exit_code = 3

    def __init__(self, message: str, original: BaseException | None = None) -> None:
        super().__init__(message)
        self.original = original


class DistributedError(MemkitError):
    """A collective operation failed or timed out across ranks."""

    exit_code = 4


def found(value: object) -> str:
    """``'10' (str)``: the value and its type, which tells ``'10'`` from ``10``."""
    return f"{reprlib.repr(value)} ({type(value).__name__})"


def check_whole(
    name: str, value: object, minimum: int, what: str, *, none_means: str | None = None
) -> None:
    """``value`` is a whole number (not a bool) of at least ``minimum``, or ``None`` where
    ``none_means`` says what ``None`` stands for.

    Raises:
        ConfigError: naming ``name``, ``what`` it counts, and what was found.
    """
    if value is None and none_means is not None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        alternative = "" if none_means is None else f" (None: {none_means})"
        raise ConfigError(
            f"{name}: expected a whole number of {what} >= {minimum}{alternative}, "
            f"found {found(value)}"
        )


def check_flag(name: str, value: object) -> None:
    """``value`` is ``True`` or ``False`` (a string such as ``"no"`` would be taken as true).

    Raises:
        ConfigError: naming ``name`` and what was found.
    """
    if not isinstance(value, bool):
        raise ConfigError(f"{name}: expected True or False, found {found(value)}")


_PACKAGE = os.path.dirname(os.path.abspath(__file__)) + os.sep


def warn_user(message: str, category: type[Warning] = UserWarning) -> None:
    """``warnings.warn`` pointed at the first caller outside memkit: the user's ``with
    memkit.track(...)`` line, or the trainer's frame that called a callback, wherever
    inside memkit the warning was raised (Python 3.11 has no ``skip_file_prefixes``)."""
    frame, level = sys._getframe(1), 1
    while frame.f_back is not None and frame.f_code.co_filename.startswith(_PACKAGE):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, category, stacklevel=level + 1)
