"""Two real gloo ranks on CPU for the tests, started once for all of them.

Starting a rank costs a rendezvous and a process group, more than most scenarios run, so the
tests' 2-rank scenarios share one launch: each test module registers its scenario with
:func:`rank_scenario` when it is imported, and every registered scenario runs, in order, in one
pair of processes (started warm: tests/warm_processes.py). The ranks get torchrun's environment
(``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ...) without torchrun's start-up cost, and one
process group from it, made as ``memkit probe`` makes it
(:func:`memkit.distributed.process_group_from_env`). Every wait is bounded: a hang fails the
tests and kills the ranks.

The launch starts in the background when collection ends (:class:`SharedLaunch`), so the
ranks run while the other tests do; the session fixture ``gloo_ranks`` (tests/conftest.py)
waits for it. Under pytest-xdist one worker launches (the first to take a file lock) and the
others read its results.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from warm_processes import warm_command

ROOT = Path(__file__).resolve().parents[1]

# A scenario's code defines ``run(rank: int, args) -> dict`` (JSON-able); it runs in a folder
# of its own (the working directory, also on sys.path) holding its files. An exception is
# recorded with its traceback and the next scenario runs.
WORKER = textwrap.dedent(
    """
    import json, os, sys, traceback
    from memkit import distributed

    rank = int(os.environ["RANK"])
    spec, out = sys.argv[1], sys.argv[2]
    results = {}
    with distributed.process_group_from_env("cpu", timeout=30):
        for name, code, folder, args in json.loads(open(spec).read()):
            os.chdir(folder)
            sys.path.insert(0, folder)
            print(f"-- scenario {name}", flush=True)
            try:
                namespace = {"__name__": f"scenario_{name}"}
                exec(compile(code, f"<scenario {name}>", "exec"), namespace)
                results[name] = namespace["run"](rank, args)
            except Exception:
                results[name] = {"traceback": traceback.format_exc()}
            finally:
                sys.path.remove(folder)
            with open(out, "w") as f:  # after each: what ran is kept if a later one hangs
                json.dump(results, f)
    """
)


@dataclass(frozen=True)
class RankScenario:
    """A scenario both ranks run; ``args`` is computed in the test process at launch."""

    name: str
    code: str
    files: dict[str, str]
    args: Callable[[], Any] | None
    last: bool


SCENARIOS: dict[str, RankScenario] = {}


def rank_scenario(
    name: str,
    code: str,
    *,
    files: dict[str, str] | None = None,
    args: Callable[[], Any] | None = None,
    last: bool = False,
) -> None:
    """Register a scenario for the shared launch (call at module level). ``last``: run after
    the others (one that leaves the group unusable: a rank that exits)."""
    SCENARIOS[name] = RankScenario(name, code, files or {}, args, last)


@dataclass(frozen=True)
class RankRun:
    """One scenario's results, rank 0's and rank 1's, and the folder it ran in."""

    name: str
    folder: Path
    results: list[dict]
    logs: list[str]

    def checked(self) -> RankRun:
        """Itself; fails the test with the ranks' tracebacks if the scenario raised."""
        failed = [r["traceback"] for r in self.results if "traceback" in r]
        if failed:
            pytest.fail(f"scenario {self.name} raised on a rank:\n" + "\n".join(failed))
        return self


def prepare_scenarios(folder: Path) -> list[RankScenario]:
    """Write every registered scenario's files and arguments into ``folder``, the ``last`` ones
    at the end; in the calling thread, as ``args`` may use torch (and its global RNG)."""
    folder.mkdir()
    order = sorted(SCENARIOS.values(), key=lambda s: s.last)  # stable: registration order
    spec = []
    for scenario in order:
        where = folder / scenario.name
        where.mkdir()
        for file_name, text in scenario.files.items():
            (where / file_name).write_text(text)
        args = scenario.args() if scenario.args is not None else None
        spec.append([scenario.name, scenario.code, str(where), args])
    (folder / "spec.json").write_text(json.dumps(spec))
    (folder / "worker.py").write_text(WORKER)
    return order


def launch_scenarios(
    folder: Path, order: list[RankScenario], limit: float, run_folder: Path
) -> dict[str, RankRun]:
    """Run the scenarios :func:`prepare_scenarios` wrote into ``folder`` as ranks 0 and 1,
    started warm (tests/warm_processes.py; ``run_folder``: the test run's)."""
    outs = [folder / f"rank{rank}.json" for rank in (0, 1)]
    for _attempt in range(3):  # again with another port if rank 0 found its port taken
        port = free_port()
        for out in outs:
            out.unlink(missing_ok=True)
        procs = []
        for rank in (0, 1):
            env = {**os.environ, "PYTHONPATH": str(ROOT), "RANK": str(rank),
                   "LOCAL_RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2",
                   "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}  # fmt: skip
            worker = [sys.executable, str(folder / "worker.py"), str(folder / "spec.json"),
                      str(outs[rank])]  # fmt: skip
            command = warm_command(worker, run_folder)
            procs.append(
                subprocess.Popen(
                    command, env=env, cwd=folder, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
                )
            )
        logs = wait_for_ranks(procs, limit, "the 2-rank scenarios", abandon=port_was_taken)
        if logs is not None:
            break
    assert logs is not None, "the rendezvous port was taken three times in a row"
    ranks = []
    for rank, out in enumerate(outs):
        assert out.exists(), f"rank {rank} wrote nothing:\n{logs[rank][-4000:]}"
        ranks.append(json.loads(out.read_text()))
    runs = {}
    for scenario in order:
        missing = [rank for rank in (0, 1) if scenario.name not in ranks[rank]]
        assert not missing, f"scenario {scenario.name} did not finish on rank(s) {missing}:\n" + (
            "\n".join(log[-4000:] for log in logs)
        )
        results = [ranks[0][scenario.name], ranks[1][scenario.name]]
        runs[scenario.name] = RankRun(scenario.name, folder / scenario.name, results, logs)
    return runs


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


class SharedLaunch:
    """The one launch of the registered scenarios in this test run, shared by the processes of
    the run (pytest-xdist workers) through a folder of the run's temporary directory: the first
    process to lock it launches, in a background thread, and writes ``runs.json``; the others
    wait for the lock and read that file."""

    def __init__(self, limit: float) -> None:
        self.limit = limit
        self.folder: Path | None = None
        self._thread: threading.Thread | None = None

    def start(self, folder: Path) -> None:
        """Launch in the background unless another process of the run is launching or did."""
        folder.mkdir(exist_ok=True)
        self.folder = folder
        lock = open(folder / "lock", "w")  # noqa: SIM115 - held by the thread until done
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock.close()
            return
        if (folder / "runs.json").exists():
            lock.close()
            return
        where = folder / f"scenarios-{os.getpid()}"
        try:
            order = prepare_scenarios(where)  # here: args() may use torch, not beside a test
        except BaseException as exc:
            self._write({"error": f"{type(exc).__name__}: {exc}"})
            lock.close()
            return

        def launch() -> None:
            try:
                self._launch(where, order)
            finally:
                lock.close()  # releases the lock: the waiting processes read runs.json

        self._thread = threading.Thread(target=launch, name="gloo-ranks", daemon=True)
        self._thread.start()

    def _launch(self, where: Path, order: list[RankScenario]) -> None:
        try:
            assert self.folder is not None
            runs = launch_scenarios(where, order, self.limit, self.folder.parent)
            data = {name: [str(r.folder), r.results, r.logs] for name, r in runs.items()}
        except BaseException as exc:  # pytest.fail is a BaseException: the tests report it
            data = {"error": f"{type(exc).__name__}: {exc}"}
        self._write({"runs": data} if "error" not in data else data)

    def _write(self, data: dict[str, Any]) -> None:
        assert self.folder is not None
        (self.folder / "runs.json.tmp").write_text(json.dumps(data))
        os.replace(self.folder / "runs.json.tmp", self.folder / "runs.json")

    def runs(self) -> dict[str, RankRun]:
        """The launch's results, waiting for it (launching here if no process did)."""
        if self.folder is None:
            pytest.fail("the 2-rank launch was not started (pytest_collection_finish)")
        self.join()
        with open(self.folder / "lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # until the launching process is done
            if not (self.folder / "runs.json").exists():  # its process ended before launching
                where = self.folder / f"scenarios-{os.getpid()}-late"
                self._launch(where, prepare_scenarios(where))
        data = json.loads((self.folder / "runs.json").read_text())
        if "error" in data:
            pytest.fail(f"the 2-rank launch failed: {data['error']}")
        return {
            name: RankRun(name, Path(f), res, logs) for name, (f, res, logs) in data["runs"].items()
        }

    def join(self) -> None:
        """Wait for this process's background launch, if it started one."""
        if self._thread is not None:
            self._thread.join()
