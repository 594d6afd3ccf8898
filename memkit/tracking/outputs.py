"""Where a report goes: one file per rank under torchrun, checked writable before training."""

from __future__ import annotations

import os
from pathlib import Path

from memkit.distributed import launched_rank
from memkit.errors import ConfigError

__all__ = ["check_writable", "rank_path"]


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
