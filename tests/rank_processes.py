"""Waiting for the worker processes of a multi-rank test: bounded, so a hang fails the test."""

from __future__ import annotations

import subprocess
import time

import pytest


def wait_for_ranks(procs: list[subprocess.Popen[bytes]], limit: float, what: str) -> list[str]:
    """Each process's combined output; kills them all and fails the test after ``limit`` s."""
    deadline = time.monotonic() + limit
    logs = []
    try:
        for proc in procs:
            remaining = max(0.1, deadline - time.monotonic())
            logs.append(proc.communicate(timeout=remaining)[0].decode(errors="replace"))
    except subprocess.TimeoutExpired:
        for proc in procs:
            proc.kill()
            proc.communicate()
        pytest.fail(f"{what} did not finish within {limit} s (a hang)")
    return logs
