"""``memkit run``: run a training script as ``__main__`` under global tracking.

The script gets its own ``sys.argv`` (``[script, *args]``, ``script`` as typed), ``sys.path[0]``
(its directory), an absolute ``__file__`` and code file name (a script that changes directory
still finds its neighbours, and its frames are found in a traceback), ``__package__`` ``None``
and ``sys.modules["__main__"]``, as ``python script.py args`` (Python 3.9+) gives them. A module
(``module=True``, ``memkit run -m pkg.train``) runs as ``python -m pkg.train args`` runs it,
through :func:`runpy.run_module`: ``sys.path[0]`` the current directory, ``sys.argv[0]`` its
file, ``__package__`` and ``__spec__`` set (relative imports work), a package's ``__main__``.
Every module and every optimizer is tracked through torch's global hooks, so no line of the
script changes. The exit code is the script's:

* ``0`` when it returns, the ``SystemExit`` code when it calls ``sys.exit`` as the system keeps
  it (``sys.exit(256)``: 0 on POSIX), ``1`` for ``sys.exit("message")``, the message printed;
* ``1`` when an out-of-memory error escapes it (what Python itself exits with; also memkit's
  "does not fit");
* ``3`` when any other exception escapes it (memkit's "your code raised"; Python exits 1);
* ``130`` on ``KeyboardInterrupt`` (Ctrl-C): as for SIGTERM, the report notes ``interrupted
  by Ctrl-C at step N`` and names the script's line, without a traceback;
* ``143`` (128 + 15) when ``SIGTERM`` stopped it (under :class:`SignalGuard`, which ``memkit
  run`` installs): the report is still built, with the note ``interrupted by SIGTERM at step
  N``, and its files are still written. torchrun sends SIGTERM to the other ranks when one
  fails.

An error that is not an OOM and a non-zero ``sys.exit`` are notes of the report too (``the
script raised ValueError: ... (exit 3: ...)``, ``the script exited with code 3 (sys.exit)``),
so a JSON report tells a failed run from a clean one (an OOM is ``report.oom``).

Under ``torchrun`` (``RANK``/``LOCAL_RANK`` set), each rank tracks ``cuda:LOCAL_RANK`` unless
``--device`` says otherwise, its output lines start with ``[rank N]`` and its files are
written as ``NAME.rankN.EXT``; rank 0 prints the full report, the others one line
(:func:`summary_line`). Gathering the ranks' reports is the distributed module's job.
"""

from __future__ import annotations

import builtins
import contextlib
import dataclasses
import functools
import gc
import importlib.machinery
import importlib.util
import io
import os
import pkgutil
import runpy
import signal
import sys
import threading
import traceback
import types
import zipfile
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import FrameType, TracebackType
from typing import TYPE_CHECKING, Any

from memkit.advice.lightning import in_lightning_terms
from memkit.devices import visible_devices
from memkit.distributed import give_up_waiting, launched_rank, local_rank
from memkit.errors import ConfigError, on_command_line
from memkit.oom import find_oom, recover
from memkit.simulated.history import DEFAULT_MAX_ENTRIES
from memkit.tracking.rank_gather import SENT_AFTER_ERROR
from memkit.tracking.report import TrackReport
from memkit.tracking.tracker import Tracker
from memkit.units import format_size

if TYPE_CHECKING:
    from memkit.tracking.tracker import Tracker

__all__ = [
    "RunOutcome",
    "SignalGuard",
    "Terminated",
    "default_device",
    "rank_prefix",
    "run_script",
    "summary_line",
]

EXIT_OOM = 1
EXIT_USER_ERROR = 3
EXIT_INTERRUPTED = 130
EXIT_TERMINATED = 128 + int(signal.SIGTERM)
"""143: the conventional exit code of a process ended by SIGTERM (128 + 15)."""


RETRY_SECONDS = 0.2
"""How long :class:`SignalGuard` waits before sending SIGTERM again when the script did not
stop (the exception was raised where Python drops exceptions)."""


class Terminated(BaseException):
    """Raised in the script's main thread by :class:`SignalGuard` when SIGTERM arrives.

    A ``BaseException`` (like ``KeyboardInterrupt`` and ``SystemExit``), so ``except
    Exception`` in the script does not swallow it; ``finally`` blocks and the tracker's
    ``__exit__`` run, and the report is built.
    """

    def __init__(self, signum: int) -> None:
        self.signum = signum
        self.signame = signal.Signals(signum).name
        super().__init__(f"terminated by {self.signame}")


class SignalGuard:
    """Turn SIGTERM into :class:`Terminated` while a script runs, so its report survives; never
    lose a Ctrl-C or SIGTERM that lands where Python drops exceptions.

    Entered, it installs a SIGTERM handler (main thread only: Python runs signal handlers
    there; elsewhere it does nothing) and restores the previous handler on exit. Inside
    :meth:`armed` (the script's run) the first SIGTERM raises :class:`Terminated`; a SIGTERM
    before that is raised as soon as the script starts, and any later one is ignored until
    the guard exits, so the report is printed and written in full; either makes rank 0 stop
    waiting for the other ranks' summaries (:func:`memkit.distributed.give_up_waiting`, until
    the guard exits): the job is being stopped, and a dead rank would cost the whole gather
    timeout, past torchrun's grace period. A :class:`Terminated` that
    Python drops (see :meth:`_retry_later`) is not printed as "Exception ignored": it is sent
    again instead, and raised when the script ends first. Ctrl-C is left to Python's own
    handler, but a ``KeyboardInterrupt`` dropped the same way is treated alike: not printed,
    SIGINT sent again, raised when the script ends first. One guard is entered once.
    """

    def __init__(self) -> None:
        self._previous: Any = None
        self._previous_unraisable: Any = None
        self._installed = False
        self._armed = False
        self._raised = False
        self._in_block = False
        self._dropped: int | None = None
        self._dropped_interrupt = False
        self._interrupt_timer: threading.Timer | None = None
        self.pending: int | None = None

    def __enter__(self) -> SignalGuard:
        if self._installed:
            raise RuntimeError("a SignalGuard is entered once at a time")
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, self._handle)
            self._previous_unraisable = sys.unraisablehook
            sys.unraisablehook = self._unraisable
            self._installed = True
        return self

    def __exit__(self, *exc: object) -> None:
        if self._installed:
            previous = signal.SIG_DFL if self._previous is None else self._previous
            signal.signal(signal.SIGTERM, previous)
            give_up_waiting(False)
            if sys.unraisablehook == self._unraisable:  # not replaced since: put back
                sys.unraisablehook = self._previous_unraisable
            self._installed = False

    def _handle(self, signum: int, _frame: FrameType | None) -> None:
        if self._raised:
            return
        if self._armed:
            self._raised = True
            self._armed = False
            self._retry_later(signum)
            raise Terminated(signum)
        self.pending = signum
        give_up_waiting()  # the job is being stopped: rank 0 waits for no dead rank now

    def _unraisable(self, unraisable: Any) -> None:
        exc = unraisable.exc_value
        if isinstance(exc, Terminated):
            self._dropped = exc.signum  # _retry_later sends it again; armed() raises it at the end
            return
        if isinstance(exc, KeyboardInterrupt) and self._in_block:
            # Ctrl-C's KeyboardInterrupt dropped the same way: the user's Ctrl-C would be lost
            # (the script runs on) behind a traceback of the callback it landed in
            self._dropped_interrupt = True
            self._interrupt_later()
            return
        self._previous_unraisable(unraisable)

    def _interrupt_later(self) -> None:
        """SIGINT again after :data:`RETRY_SECONDS` while the script still runs (Python's own
        handler raises ``KeyboardInterrupt`` there, or it is dropped and sent again). Once sent,
        the interrupt is the script's: one it catches is not raised again at its end."""

        def again() -> None:
            if self._in_block:
                self._dropped_interrupt = False
                os.kill(os.getpid(), signal.SIGINT)

        if self._interrupt_timer is not None:
            self._interrupt_timer.cancel()
        self._interrupt_timer = threading.Timer(RETRY_SECONDS, again)
        self._interrupt_timer.daemon = True
        self._interrupt_timer.start()

    def _retry_later(self, signum: int) -> None:
        """Python runs a signal handler between any two bytecodes, also inside a weakref
        callback (the simulated device's free hook) or a ``__del__``, where an exception is
        printed and dropped: if the script is still running after :data:`RETRY_SECONDS`, the
        signal is sent again, until :class:`Terminated` lands where it stops the script."""

        def again() -> None:
            if self._in_block:
                self._raised, self._armed = False, True
                os.kill(os.getpid(), signum)

        timer = threading.Timer(RETRY_SECONDS, again)
        timer.daemon = True
        timer.start()

    @contextlib.contextmanager
    def armed(self) -> Iterator[None]:
        """The block in which SIGTERM raises :class:`Terminated` (the script's run)."""
        if self.pending is not None and not self._raised:
            self._raised = True
            raise Terminated(self.pending)
        self._armed = self._in_block = True
        try:
            yield
        except SystemExit:
            if self._dropped is None and not self._dropped_interrupt:
                raise
        except KeyboardInterrupt:
            self._dropped_interrupt = False  # Ctrl-C landed where it stops the script
            raise
        finally:
            self._armed = self._in_block = False
            if self._interrupt_timer is not None:
                self._interrupt_timer.cancel()
                self._interrupt_timer = None
        if self._dropped is not None:  # the script ended before the signal was sent again
            raise Terminated(self._dropped)
        if self._dropped_interrupt:
            self._dropped_interrupt = False
            raise KeyboardInterrupt


@dataclass(frozen=True)
class RunOutcome:
    """What ``memkit run`` observed.

    Attributes:
        exit_code: the code to exit with (see the module docstring).
        report: the tracking report (with ``report.oom`` after an OOM).
        traceback: the formatted traceback of an exception that escaped the script, from the
            script's own frames on, else ``None``.
        oom: an out-of-memory error ended the script.
        interrupted: what stopped the script (``"SIGTERM"``, ``"Ctrl-C"``), else ``None``.
        ended: how the script ended when it raised an error that is not an OOM or exited
            with a code other than 0 (``"the script exited with code 3 (sys.exit)"``), also
            a note of the report; else ``None``.
        history_file: where the memory history was written (``--memory-history``), else
            ``None``.
        history_error: why it could not be written, else ``None``.
        refused: the message of the script's argparse when it refused its arguments
            (``"unrecognized arguments: --module-every 3"``), else ``None``.
    """

    exit_code: int
    report: TrackReport
    traceback: str | None
    oom: bool
    interrupted: str | None = None
    ended: str | None = None
    history_file: Path | None = None
    history_error: str | None = None
    refused: str | None = None


def rank_prefix() -> str:
    """``"[rank N] "`` under torchrun (``RANK`` set), else ``""``."""
    rank = launched_rank()
    return "" if rank is None else f"[rank {rank}] "


def summary_line(report: TrackReport, files: Sequence[str | Path] = ()) -> str:
    """One line for the ranks other than 0 under torchrun (rank 0 prints the full report)."""
    parts = [f"memkit: {report.steps} step(s)"]
    devices = list(report.devices)
    if devices:
        top = max(devices, key=lambda d: d.peak_allocated)
        parts[0] += f", peak {format_size(top.peak_allocated)} on {top.device}"
        if top.capacity:
            parts[0] += f" of {format_size(top.capacity)}"
    if report.oom is not None:
        parts.append(f"out of memory at {report.oom.where}")
    parts.extend(n.split(";")[0] for n in report.notes if n.startswith("interrupted by "))
    rest = "full report on rank 0"
    if any(n.startswith("ranks not gathered") for n in report.notes):
        rest = "not gathered into rank 0's report"
    elif any(n.startswith(SENT_AFTER_ERROR) for n in report.notes):
        rest = "summary sent to rank 0 (in its report if rank 0 ended normally)"
    if files:
        rest += " (this rank's: " + ", ".join(str(f) for f in files) + ")"
    return "; ".join([*parts, rest])


def default_device(device: str | None) -> str | None:
    """The device to track: ``device`` if given; under torchrun ``cuda:LOCAL_RANK`` (or the
    machine's accelerator type) when there is an accelerator; else ``None`` (the backend's
    default: the current accelerator, or the simulated cpu device)."""
    if device is not None:
        return device
    if launched_rank() is None:
        return None
    local = local_rank()

    visible = visible_devices()
    if not visible:
        return None
    return str(visible[local % len(visible)])


def _script_traceback(exc: BaseException) -> str:
    """The exception formatted from the script's first frame on (memkit's and runpy's frames
    before it left out: runpy runs a module and a zip application). A syntax error of the
    script itself (no frame of it ran) is its file, line and caret, as Python prints it."""
    runner = {_script_traceback.__code__.co_filename, runpy.run_module.__code__.co_filename}
    tb: TracebackType | None = exc.__traceback__
    start = tb
    while start is not None and start.tb_frame.f_code.co_filename in runner:
        start = start.tb_next
    if start is None and isinstance(exc, SyntaxError):
        return "".join(traceback.format_exception_only(type(exc), exc))
    shown = traceback.TracebackException(type(exc), exc, start or tb)
    shown.stack = traceback.StackSummary.from_list(_without_passthrough(list(shown.stack)))
    return "".join(shown.format())


_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
_DISABLE_WRAPPERS = frozenset({"nonrecursive_disable_wrapper", "_fn"})


def _without_passthrough(frames: list[traceback.FrameSummary]) -> list[traceback.FrameSummary]:
    """``frames`` without memkit's own pass-through frames in the middle (its wrappers of
    ``torch.autograd.backward`` and the engine, and torch's ``compiler.disable`` wrappers
    beside them): the user's code calls torch there, and memkit's frames only hide that
    (sweep BW: wrappers.py frames in an OOM's traceback). A frame where the error itself was
    raised (the last) is kept, memkit's too."""
    mine = [f.filename.startswith(_PACKAGE) for f in frames]
    drop = [m and i < len(frames) - 1 for i, m in enumerate(mine)]
    for i, f in enumerate(frames):
        near = (i > 0 and drop[i - 1]) or (i + 1 < len(frames) and drop[i + 1])
        if f.name in _DISABLE_WRAPPERS and "_dynamo" in f.filename and near:
            drop[i] = True
    return [f for f, gone in zip(frames, drop, strict=True) if not gone]


def _script_line(exc: BaseException) -> str | None:
    """``train.py line 42, in train``: the innermost frame of the ``__main__`` module (the
    script's, the module's) in the traceback."""
    found = None
    tb: TracebackType | None = exc.__traceback__
    while tb is not None:
        code = tb.tb_frame.f_code
        if tb.tb_frame.f_globals.get("__name__") == "__main__":
            found = f"{os.path.basename(code.co_filename)} line {tb.tb_lineno}, in {code.co_name}"
        tb = tb.tb_next
    return found


def run_script(
    script: str | Path,
    args: list[str] | tuple[str, ...] = (),
    *,
    device: str | None = None,
    budget: str | int | None = None,
    per_module: bool = True,
    module_every: int | None = None,
    sigterm: SignalGuard | None = None,
    memory_history: str | Path | None = None,
    history_entries: int | None = None,
    module: bool = False,
) -> RunOutcome:
    """Run ``script`` as ``__main__`` with ``args`` under :func:`memkit.track` (global hooks);
    with ``module``, ``script`` is a module's name, run as ``python -m`` runs it.

    With an entered ``sigterm`` guard, a SIGTERM stops the script with :class:`Terminated`:
    exit code 143, and a report noting ``interrupted by SIGTERM at step N``. With
    ``memory_history``, PyTorch's memory snapshot of the run is written there when it ends
    (``NAME.rankN.EXT`` under torchrun).

    Raises:
        ConfigError: the script does not exist or is not a file; no module of that name.
    """
    run: Callable[[], dict[str, Any]]
    if module:
        name = os.fspath(script)
        argv0, path0 = "-m", os.getcwd()  # python -m's, until runpy sets the module's file
        run = functools.partial(_run_module_as_main, name)
    else:
        path = _script_file(script)
        argv0, path0 = os.fspath(script), str(path.resolve().parent)
        # absolute now: the script may change directory
        run = functools.partial(_exec_as_main, os.path.abspath(path))
    armed = sigterm.armed() if sigterm is not None else contextlib.nullcontext()
    with _as_main(argv0, path0, args):
        if module:
            _check_module(name)  # before the tracker: a module that is not there costs nothing
        tracker = Tracker(
            None,
            None,
            device=default_device(device),
            budget=budget,
            per_module=per_module,
            module_every=module_every,
            postmortem=None,
            memory_history=memory_history,
            history_entries=DEFAULT_MAX_ENTRIES if history_entries is None else history_entries,
        )
        ending = _run_tracked(run, tracker, armed)
    if ending.failed is not None:
        # the traceback holds the failed step's frames and tensors: release them
        recover(None, ending.failed)
        ending.failed = None
    # The script's globals live on in a reference cycle (its functions hold them): collect
    # them now, while the interpreter is whole. Left to interpreter shutdown, a DDP model's
    # gloo threads were torn down mid-finalization ("terminate called without an active
    # exception", SIGABRT after the report was printed).
    gc.collect()
    report = tracker.report()
    automatic = tracker.evidence.facts.lightning_automatic
    if automatic is not None:  # the advice in Lightning's terms, as its callback says it
        report = report.in_terms(
            functools.partial(in_lightning_terms, manual_optimization=not automatic)
        )
    if ending.interrupted is not None:
        at = f" ({ending.where})" if ending.where else ""
        note = (
            f"interrupted by {ending.interrupted} at step {report.steps}{at}; the numbers cover "
            "what ran until then"
        )
        report = dataclasses.replace(report, notes=(*report.notes, note))
    elif ending.ended is not None:
        report = dataclasses.replace(report, notes=(*report.notes, ending.ended))
    return RunOutcome(
        exit_code=ending.exit_code,
        report=report,
        traceback=ending.traceback,
        oom=ending.oom,
        interrupted=ending.interrupted,
        ended=ending.ended,
        history_file=tracker.history_file,
        history_error=tracker.history_error,
        refused=ending.refused,
    )


def _script_file(script: str | Path) -> Path:
    """``script`` as a path, or a ConfigError (exit 2) when no file is there."""
    path = Path(script)
    if not path.is_file():
        raise ConfigError(
            f"expected a Python training script, found no file at {str(path)!r}; "
            "usage: memkit run [OPTIONS] SCRIPT [ARGS]..."
        )
    return path


@contextlib.contextmanager
def _as_main(argv0: str, path0: str, args: Sequence[str]) -> Iterator[None]:
    """``sys.argv`` (``[argv0, *args]``) and ``sys.path[0]`` as ``python script.py args`` (the
    script as given; its folder) or ``python -m NAME args`` (``-m``; the current directory)
    sets them, restored after."""
    saved_argv, saved_path0 = sys.argv[:], sys.path[0] if sys.path else None
    sys.argv = [argv0, *args]
    if sys.path:
        sys.path[0] = path0
    else:
        sys.path.insert(0, path0)
    try:
        yield
    finally:
        sys.argv = saved_argv
        if saved_path0 is not None:
            sys.path[0] = saved_path0


@dataclass
class _ScriptEnding:
    """How the script ended, as :func:`_run_tracked` saw it."""

    exit_code: int = 0
    traceback: str | None = None
    failed: BaseException | None = None
    oom: bool = False
    interrupted: str | None = None
    where: str | None = None
    ended: str | None = None
    refused: str | None = None


def _exec_as_main(main_file: str) -> dict[str, Any]:
    """Run the script at ``main_file`` (absolute) as ``sys.modules["__main__"]``; its globals.

    As Python runs a script: ``__file__`` and the code's file name absolute, ``__package__``
    and ``__spec__`` ``None``; a compiled ``.pyc`` runs too. A zip application goes to
    :func:`runpy.run_path` (which runs its ``__main__.py``)."""
    if zipfile.is_zipfile(main_file):
        return runpy.run_path(main_file, run_name="__main__")
    with io.open_code(main_file) as file:
        code = pkgutil.read_code(file)  # a .pyc file's code, else None
    if code is None:
        with io.open_code(main_file) as file:
            code = compile(file.read(), main_file, "exec", dont_inherit=True)
    module = types.ModuleType("__main__")
    module.__dict__.update(
        __file__=main_file,
        __cached__=None,
        __package__=None,
        __spec__=None,
        __loader__=importlib.machinery.SourceFileLoader("__main__", main_file),
        __builtins__=builtins,
    )
    saved = sys.modules.get("__main__")
    sys.modules["__main__"] = module  # pickle and multiprocessing find the script's classes
    try:
        exec(code, module.__dict__)
    finally:
        if saved is not None:
            sys.modules["__main__"] = saved
    return module.__dict__


class _NoSuchModule(Exception):
    """runpy found no module of the name given (a ConfigError once the tracker has ended)."""


def _check_module(name: str) -> None:
    """A ConfigError (exit 2) when ``python -m name`` would find no module from here, looked
    for without running any of its code: a name that is empty, relative or a file's, a top
    package (or module) that is not there. A module inside the package is looked for by runpy
    once the package is imported (:func:`_run_module_as_main`)."""
    example = "pkg.train for pkg/train.py, from the directory that holds pkg"
    if not name or name.startswith("."):
        raise ConfigError(f"-m {name!r}: expected a module's full name, as python -m takes it "
                          f"({example})")  # fmt: skip
    if "/" in name or os.sep in name or (name.endswith(".py") and os.path.isfile(name)):
        raise ConfigError(
            f"-m {name}: a file's name, where -m takes a module's ({example}); memkit run "
            f"{name} runs the file as a script"
        )
    top = name.partition(".")[0]
    try:
        found = importlib.util.find_spec(top) is not None
    except (ImportError, ValueError):  # ValueError: a module of that name has no __spec__
        found = False
    if not found:
        raise ConfigError(_no_module(name, f"No module named {top!r}"))


def _no_module(name: str, what: str) -> str:
    """The error for ``-m name``: ``what`` was not found (runpy's words), and from where."""
    return (
        f"-m {name}: {what.rstrip('.')}; looked for from {os.getcwd()} as python -m does (the "
        "current directory first, then sys.path): give the module's full name from the "
        "directory that holds its package (memkit run -m pkg.train, for pkg/train.py)"
    )


def _run_module_as_main(name: str) -> dict[str, Any]:
    """Run the module ``name`` as ``python -m name`` runs it (:func:`runpy.run_module`); its
    globals. runpy's "no module" (raised where it looks the module up, after importing its
    package, not by the package's own imports) is a :class:`_NoSuchModule`."""
    try:
        return runpy.run_module(name, run_name="__main__", alter_sys=True)
    except ImportError as exc:
        tb = exc.__traceback__
        while tb is not None and tb.tb_next is not None:
            tb = tb.tb_next
        raiser = tb.tb_frame.f_code if tb is not None else None
        if raiser is None or (raiser.co_name, raiser.co_filename) != (
            "_get_module_details",
            runpy.run_module.__code__.co_filename,
        ):
            raise
        raise _NoSuchModule(_no_module(name, str(exc))) from None


def _run_tracked(
    run: Callable[[], dict[str, Any]],
    tracker: Tracker,
    armed: contextlib.AbstractContextManager[Any],
) -> _ScriptEnding:
    """Run the script (``run``: its globals) under ``tracker`` (and the armed SIGTERM guard);
    how it ended, with its exit code (see the module docstring). Whatever escapes the script
    is caught here, but a module that is not there: a ConfigError, after the tracker ended.
    """
    ending = _ScriptEnding()
    script_globals: dict[str, Any] | None = None
    try:
        # the script's own calls of memkit's API are told its keywords, not memkit's options
        with tracker, armed, on_command_line(False):
            # kept until the tracker has exited: its end (and the memory history's) is the
            # script's end, with what its globals still hold, whether or not they are in a cycle
            script_globals = run()
    except _NoSuchModule as exc:
        raise ConfigError(str(exc)) from None
    except SystemExit as exc:
        _script_exited(exc, ending)
    except KeyboardInterrupt as exc:  # like SIGTERM: where it was, not a traceback
        ending.exit_code = EXIT_INTERRUPTED
        ending.where = _script_line(exc)
        ending.interrupted = "Ctrl-C"
    except Terminated as exc:  # not an error of the script: where it was, not a traceback
        ending.exit_code = 128 + exc.signum
        ending.where = _script_line(exc)
        ending.interrupted = exc.signame
    except BaseException as exc:
        ending.traceback = _script_traceback(exc)
        ending.oom = find_oom(exc) is not None
        ending.exit_code = EXIT_OOM if ending.oom else EXIT_USER_ERROR
        ending.failed = exc
        if not ending.oom:  # an OOM is the report's own (report.oom)
            message = _shorten(str(exc))
            ending.ended = (
                f"the script raised {type(exc).__name__}{': ' + message if message else ''} "
                f"(exit {EXIT_USER_ERROR}: memkit's code for an error the script raised)"
            )
    del script_globals  # the script's objects can go now
    return ending


def _script_exited(exc: SystemExit, ending: _ScriptEnding) -> None:
    """How a ``SystemExit`` ends the script, as Python ends it: an int is the status the
    system keeps (its low 8 bits on POSIX: ``sys.exit(256)`` exits 0), any other object is
    printed (its ``str``) and exits 1. A code other than 0 is a note."""
    code = exc.code
    ending.refused = _argparse_refusal(exc)
    if code is None:
        return
    if isinstance(code, int):
        status = code & 0xFF if os.name == "posix" else int(code)
        ending.exit_code = status
        if code != status:
            ending.ended = f"the script exited with sys.exit({int(code)}) (exit {status})"
        elif code:
            ending.ended = f"the script exited with code {status} (sys.exit)"
        return
    ending.traceback = str(code)
    ending.exit_code = 1
    ending.ended = f"the script exited with sys.exit({_shorten(repr(code))}) (exit 1)"


def _argparse_refusal(exc: SystemExit) -> str | None:
    """The message of ``argparse.ArgumentParser.error`` when it raised ``exc`` (its frame is
    in the traceback), else ``None``."""
    tb: TracebackType | None = exc.__traceback__
    while tb is not None:
        frame = tb.tb_frame
        if frame.f_code.co_name == "error" and frame.f_globals.get("__name__") == "argparse":
            message = frame.f_locals.get("message")
            return message if isinstance(message, str) else None
        tb = tb.tb_next
    return None


def _shorten(text: str, limit: int = 200) -> str:
    """The first line of ``text``, at most ``limit`` characters (for a note)."""
    lines = text.strip().splitlines()
    first = lines[0] if lines else ""
    return first if len(first) <= limit else first[: limit - 3] + "..."
