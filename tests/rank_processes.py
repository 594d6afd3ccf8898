"""Waiting for the worker processes of a multi-rank test: bounded, so a hang fails the test."""

from __future__ import annotations

import socket
import subprocess
import time
from collections.abc import Callable

import pytest


def free_port() -> int:
    """A port the OS says is free now; another process may take it before rank 0 binds it,
    so a launcher that uses it retries when rank 0 finds it taken (:func:`port_was_taken`)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def port_was_taken(log: str) -> bool:
    """Whether a rank's output says the rendezvous port was in use (then: launch again)."""
    return "EADDRINUSE" in log or "ddress already in use" in log


def _kill(procs: list[subprocess.Popen[bytes]]) -> None:
    for proc in procs:
        proc.kill()
        proc.communicate()


def wait_for_ranks(
    procs: list[subprocess.Popen[bytes]],
    limit: float,
    what: str,
    abandon: Callable[[str], bool] | None = None,
) -> list[str] | None:
    """Each process's combined output; kills them all and fails the test after ``limit`` s.

    With ``abandon``: as soon as a finished process's output satisfies it, the others are
    killed and ``None`` is returned (the caller launches again).
    """
    deadline = time.monotonic() + limit
    logs = []
    try:
        for proc in procs:
            remaining = max(0.1, deadline - time.monotonic())
            logs.append(proc.communicate(timeout=remaining)[0].decode(errors="replace"))
            if abandon is not None and abandon(logs[-1]):
                _kill(procs)
                return None
    except subprocess.TimeoutExpired:
        _kill(procs)
        pytest.fail(f"{what} did not finish within {limit} s (a hang)")
    return logs
