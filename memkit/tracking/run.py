"""``memkit run``: run a training script as ``__main__`` under global tracking.

The script gets its own ``sys.argv`` (``[script, *args]``) and ``sys.path[0]`` (its directory),
exactly as ``python script.py args`` would give it. Every module and every optimizer is tracked
through torch's global hooks, so no line of the script changes. The exit code is the script's:

* ``0`` when it returns, the ``SystemExit`` code when it calls ``sys.exit``;
* ``1`` when an out-of-memory error escapes it (what Python itself exits with; also memkit's
  "does not fit");
* ``3`` when any other exception escapes it (memkit's "your code raised");
* ``130`` on ``KeyboardInterrupt``.

Under ``torchrun`` (``RANK``/``LOCAL_RANK`` set), each rank tracks ``cuda:LOCAL_RANK`` unless
``--device`` says otherwise, its output lines start with ``[rank N]`` and its files are
written as ``NAME.rankN.EXT``; rank 0 prints the full report, the others one line
(:func:`summary_line`). Gathering the ranks' reports is the distributed module's job.
"""

from __future__ import annotations

import os
import runpy
import sys
import traceback
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

from memkit.distributed import launched_rank, local_rank
from memkit.errors import ConfigError
from memkit.oom import find_oom, recover
from memkit.tracking.report import TrackReport
from memkit.units import format_size

__all__ = [
    "RunOutcome",
    "check_writable",
    "default_device",
    "rank_path",
    "rank_prefix",
    "run_script",
    "summary_line",
]

EXIT_OOM = 1
EXIT_USER_ERROR = 3
EXIT_INTERRUPTED = 130


@dataclass(frozen=True)
class RunOutcome:
    """What ``memkit run`` observed.

    Attributes:
        exit_code: the code to exit with (see the module docstring).
        report: the tracking report (with ``report.oom`` after an OOM).
        traceback: the formatted traceback of an exception that escaped the script, from the
            script's own frames on, else ``None``.
        oom: an out-of-memory error ended the script.
    """

    exit_code: int
    report: TrackReport
    traceback: str | None
    oom: bool


def rank_prefix() -> str:
    """``"[rank N] "`` under torchrun (``RANK`` set), else ``""``."""
    rank = launched_rank()
    return "" if rank is None else f"[rank {rank}] "


def rank_path(path: str | Path) -> Path:
    """``report.json`` -> ``report.rank0.json`` under torchrun, unchanged otherwise."""
    path = Path(path)
    rank = launched_rank()
    if rank is None:
        return path
    return path.with_name(f"{path.stem}.rank{rank}{path.suffix}")


def check_writable(path: str | Path, option: str) -> None:
    """Check, before the script runs, that ``option``'s file (``--json``, ``--html``) can be
    written: its folder exists and is writable, and it is not a folder itself.

    Raises:
        ConfigError: it cannot be written (exit 2); the message says what to do.
    """
    path = Path(path)
    folder = path.parent
    where = f"{option} {str(path)!r}"
    if not folder.exists():
        raise ConfigError(
            f"{where}: expected a file in an existing folder, but the folder {str(folder)!r} "
            f"does not exist; create it first (mkdir -p {folder}) or give another path"
        )
    if not folder.is_dir():
        raise ConfigError(
            f"{where}: expected a file in a folder, but {str(folder)!r} is not a folder; "
            "give another path"
        )
    if path.is_dir():
        raise ConfigError(f"{where}: expected a file name, found a folder; add a file name")
    target = path if path.exists() else folder
    if not os.access(target, os.W_OK):
        raise ConfigError(
            f"{where}: expected a writable file, but {str(target)!r} is not writable by this "
            "user; give a path in a folder you can write to"
        )


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
    rest = "full report on rank 0"
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
    from memkit.devices import visible_devices

    visible = visible_devices()
    if not visible:
        return None
    return str(visible[local % len(visible)])


def _script_traceback(exc: BaseException, script: Path) -> str:
    """The exception formatted from the script's first frame on (memkit's frames left out)."""
    tb: TracebackType | None = exc.__traceback__
    target = str(script.resolve())
    start = tb
    while start is not None:
        if os.path.abspath(start.tb_frame.f_code.co_filename) == target:
            break
        start = start.tb_next
    return "".join(traceback.format_exception(type(exc), exc, start or tb))


def run_script(
    script: str | Path,
    args: list[str] | tuple[str, ...] = (),
    *,
    device: str | None = None,
    budget: str | int | None = None,
    per_module: bool = True,
) -> RunOutcome:
    """Run ``script`` as ``__main__`` with ``args`` under :func:`memkit.track` (global hooks).

    Raises:
        ConfigError: the script does not exist or is not a file.
    """
    from memkit.tracking.tracker import Tracker

    path = Path(script)
    if not path.is_file():
        raise ConfigError(
            f"expected a Python training script, found no file at {str(path)!r}; "
            "usage: memkit run [OPTIONS] SCRIPT [ARGS]..."
        )
    tracker = Tracker(
        None,
        None,
        device=default_device(device),
        budget=budget,
        per_module=per_module,
        postmortem=None,
    )
    saved_argv, saved_path0 = sys.argv[:], sys.path[0] if sys.path else None
    sys.argv = [str(path), *args]
    script_dir = str(path.resolve().parent)
    if sys.path:
        sys.path[0] = script_dir
    else:
        sys.path.insert(0, script_dir)
    exit_code = 0
    text: str | None = None
    failed: BaseException | None = None
    oom = False
    try:
        with tracker:
            runpy.run_path(str(path), run_name="__main__")
    except SystemExit as exc:
        code = exc.code
        if code is None:
            exit_code = 0
        elif isinstance(code, int):
            exit_code = code
        else:
            text = str(code)
            exit_code = 1
    except KeyboardInterrupt as exc:
        text = _script_traceback(exc, path)
        exit_code = EXIT_INTERRUPTED
    except BaseException as exc:
        text = _script_traceback(exc, path)
        oom = find_oom(exc) is not None
        exit_code = EXIT_OOM if oom else EXIT_USER_ERROR
        failed = exc
    finally:
        sys.argv = saved_argv
        if saved_path0 is not None:
            sys.path[0] = saved_path0
    if failed is not None:
        # the traceback holds the failed step's frames and tensors: release them
        recover(None, failed)
        del failed
    return RunOutcome(exit_code=exit_code, report=tracker.report(), traceback=text, oom=oom)
