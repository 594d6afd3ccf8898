"""After an OOM: release what the failed step held (:func:`recover`), and catch OOMs only
(:func:`catch_oom`), so recovery runs outside the ``except`` block."""

from __future__ import annotations

import gc
import logging
import sys
import traceback
from dataclasses import dataclass
from types import TracebackType
from typing import Protocol

from memkit.oom.recognising import exception_chain, is_oom

log = logging.getLogger(__name__)


class RecoverableBackend(Protocol):
    """What :func:`recover` needs of a backend (every ``memkit.devices.MemoryBackend`` has it)."""

    def empty_cache(self) -> None: ...
    def reset_peak(self) -> None: ...


def _forget_last_exception(chain: list[BaseException], tracebacks: list[TracebackType]) -> None:
    """Drop ``sys.last_*`` (set by the REPL, IPython, pdb) and IPython's own traceback
    (``get_ipython().InteractiveTB.tb``) when they hold this exception."""
    cleared = False
    for name in ("last_value", "last_exc"):
        held = getattr(sys, name, None)
        if held is not None and any(held is e for e in chain):
            setattr(sys, name, None)
            cleared = True
    held_tb = getattr(sys, "last_traceback", None)
    if held_tb is not None and (cleared or any(held_tb is tb for tb in tracebacks)):
        setattr(sys, "last_traceback", None)  # noqa: B010 - typeshed types it non-optional
        cleared = True
    if cleared and hasattr(sys, "last_type"):
        setattr(sys, "last_type", None)  # noqa: B010
    # IPython (a notebook's kernel) keeps the last uncaught error's traceback of its own, for
    # %debug: while it is there, the failed cell's frames and tensors stay (sweep BU: 24 of
    # 32 MiB stayed after recover)
    get = getattr(sys.modules.get("IPython"), "get_ipython", None)
    printer = getattr(get() if callable(get) else None, "InteractiveTB", None)
    held_tb = getattr(printer, "tb", None)
    if held_tb is not None and (cleared or any(held_tb is tb for tb in tracebacks)):
        printer.tb = None  # type: ignore[union-attr]


def _clear_tracebacks(exc: BaseException) -> None:
    """Step 1 of :func:`recover`; a function of its own so its locals are gone before gc."""
    chain = list(exception_chain(exc))
    tracebacks = [e.__traceback__ for e in chain if e.__traceback__ is not None]
    _forget_last_exception(chain, tracebacks)
    for tb in tracebacks:
        try:
            traceback.clear_frames(tb)
        except RuntimeError:  # clear_frames already skips executing frames; just in case
            log.debug("could not clear every frame of %r", tb, exc_info=True)
    for member in chain:
        member.__traceback__ = None
    log.debug("recover: cleared %d traceback(s) of %d exception(s)", len(tracebacks), len(chain))


def recover(backend: RecoverableBackend | None = None, exc: BaseException | None = None) -> None:
    """Release what a failed step held; call it AFTER the ``except`` block, not inside it.

    Steps, in order:

    1. if ``exc`` is given, for it and every exception in its chain (``__cause__``,
       ``__context__``, group members): ``traceback.clear_frames`` on its traceback, then
       ``__traceback__ = None``. Clearing a finished frame drops its locals, which is what frees
       the failed step's tensors. Frames still executing (the caller's own) cannot be cleared and
       are skipped. ``sys.last_value``/``last_exc``/``last_traceback`` (kept by the REPL and
       IPython) and IPython's ``InteractiveTB.tb`` are reset when they point at this
       exception;
    2. ``gc.collect()``, for reference cycles (autograd graphs, closures);
    3. ``backend.empty_cache()`` then ``backend.reset_peak()``, if a backend is given.

    Inside the ``except`` block the exception is still being handled and Python keeps it (and so
    every frame and tensor) alive; that is why the pattern below keeps only a reference and
    recovers after. Delete your own reference afterwards too. Log or format the traceback
    *before* calling this: afterwards the exception has none, and its frames have no locals.

    Args:
        backend: any object with ``empty_cache()`` and ``reset_peak()``, typically a
            ``memkit.devices.MemoryBackend``; ``None`` skips step 3.
        exc: the OOM that was caught; ``None`` skips step 1.

    Examples:
        >>> def step(batch):
        ...     raise MemoryError("pretend the batch did not fit")
        >>> backend, batch = None, [1, 2, 3]
        >>> failed = None
        >>> try:
        ...     step(batch)
        ... except Exception as e:
        ...     if not is_oom(e): raise
        ...     failed = e
        >>> if failed is not None:
        ...     recover(backend, failed); del failed

        Or, with :func:`catch_oom`:

        >>> with catch_oom() as caught:
        ...     step(batch)
        >>> if caught.oom:
        ...     recover(backend, caught.take())
    """
    if exc is not None:
        _clear_tracebacks(exc)
    collected = gc.collect()
    log.debug("recover: gc.collect() found %d unreachable object(s)", collected)
    if backend is not None:
        backend.empty_cache()
        backend.reset_peak()


@dataclass
class CaughtOom:
    """What :func:`catch_oom` caught: ``oom`` is the exception, or ``None`` if nothing failed."""

    oom: BaseException | None = None

    def take(self) -> BaseException | None:
        """Return the exception and forget it, so this holder keeps nothing alive."""
        exc, self.oom = self.oom, None
        return exc

    def __bool__(self) -> bool:
        return self.oom is not None


class _OomCatcher:
    def __init__(self, follow_chain: bool) -> None:
        self._follow_chain = follow_chain
        self._caught = CaughtOom()

    def __enter__(self) -> CaughtOom:
        return self._caught

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool:
        if exc is None or not is_oom(exc, follow_chain=self._follow_chain):
            return False  # nothing raised, or not an OOM: let it propagate untouched
        self._caught.oom = exc
        return True


def catch_oom(*, follow_chain: bool = False) -> _OomCatcher:
    """Context manager that swallows OOMs only; every other exception propagates untouched.

    It yields a :class:`CaughtOom`; after the block, ``caught.oom`` is the OOM or ``None``. With
    ``follow_chain=True`` an error that wraps an OOM is swallowed too, and ``caught.oom`` is the
    outer exception (so :func:`recover` clears the whole chain).

    Examples:
        >>> with catch_oom() as caught:
        ...     raise MemoryError()
        >>> type(caught.take()).__name__, caught.oom
        ('MemoryError', None)
    """
    return _OomCatcher(follow_chain)
