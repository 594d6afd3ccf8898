"""Shared fixtures: small real models and a clean simulated device per test."""

from __future__ import annotations

import gc
import os
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

# One intra-op thread, in this process and every process a test starts (inherited): the tests
# run many small ops, which two OpenMP threads contending with other processes on a small
# machine make several times slower (spinning, not working). Memory counts do not depend on it.
# Set before torch is imported; an OMP_NUM_THREADS of the caller's own is kept.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", os.environ["OMP_NUM_THREADS"])

import pytest
import torch
from rank_processes import RankRun, SharedLaunch
from warm_processes import warm_command, warm_entrypoint

torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))  # in case torch was imported first

ROOT = Path(__file__).resolve().parents[1]

# Files under tests/ that are run or loaded by the tests, never imported as modules: with
# --doctest-modules pytest would import them (and run the scripts) to look for doctests.
collect_ignore_glob = [
    "modelfiles/*", "realworld/scripts/*", "scenarios/*", "rank_processes.py",
    "lightning_models.py", "warm_processes.py",
]  # fmt: skip


_unfrozen = [False]  # whether gc.unfreeze() ran since the last freeze below
_unfreeze = gc.unfreeze


def _noting_unfreeze() -> None:
    _unfrozen[0] = True
    _unfreeze()


# a probe unfreezes the whole heap at its end (memkit.probing.runner._probing); noted here
# because gc.get_freeze_count() walks the frozen objects to count them (48 ms a call here)
gc.unfreeze = _noting_unfreeze


@pytest.fixture(autouse=True)
def _seed_and_collect():
    torch.manual_seed(0)
    yield
    # accelerate's process-wide state (a Trainer's or an Accelerator's gradient accumulation)
    # outlives a test: the next one's AcceleratedOptimizer skipped its steps (a fresh-clone CI
    # run counted 12 steps of 3)
    state = sys.modules.get("accelerate.state")
    if state is not None:
        state.AcceleratorState._reset_state(reset_partial_state=True)
        state.GradientState._reset_state()
    # free what a test left in reference cycles (tensors the next test's device would count);
    # then freeze the survivors, so the next collection looks only at what that test makes.
    # After a probe unfroze the heap, a collection would walk all of it (0.1-0.2 s here, and
    # the probe collected at its end where the device still held memory): what such a test
    # left is frozen as it is, except on a real GPU, where a cycle it left (an OOM's traceback
    # after the probe) would hold device memory into the next tests' readings.
    if not _unfrozen[0] or torch.cuda.is_initialized():
        gc.collect()
    gc.freeze()
    _unfrozen[0] = False


@pytest.fixture
def one_rank():
    """A one-rank gloo process group in this process (FSDP2 and DDP need one)."""
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.fixture
def mlp() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--update-golden",
        action="store_true",
        help="rewrite the golden files under tests/golden/ from the current output instead of "
        "comparing (tests/test_golden.py)",
    )


@pytest.fixture
def golden(request: pytest.FixtureRequest):
    """``golden(name, text, suffix=".txt")``: compare ``text`` with tests/golden/NAME+SUFFIX
    (``name`` may hold a folder: ``results/probe``); ``pytest --update-golden`` rewrites the
    files instead. What varies between runs is the caller's to mask."""
    folder = Path(__file__).parent / "golden"
    update = request.config.getoption("--update-golden")

    def check(name: str, text: str, suffix: str = ".txt") -> None:
        path = folder / f"{name}{suffix}"
        if update:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text, encoding="utf-8")
            return
        assert path.exists(), f"no golden file {path}: run pytest --update-golden"
        assert text == path.read_text(encoding="utf-8"), (
            f"{name}: output differs from {path} (if the change is intended, rerun with "
            "--update-golden and review the diff)"
        )

    return check


_run_folder: list[Path] = []  # the test run's temporary folder, shared by xdist workers


def run_folder() -> Path:
    """The test run's temporary folder (one for all of its xdist workers)."""
    if not _run_folder:
        raise RuntimeError("run_folder() before the collection finished")
    return _run_folder[0]


def warm(command: list[str]) -> list[str]:
    """``command`` (``python -m memkit ...``, ``python SCRIPT``, ``memkit``, ``torchrun``)
    started from a warm interpreter: a real process that skips ``import torch``
    (tests/warm_processes.py). Not for a test of what a command imports."""
    return warm_command(command, run_folder())


def torchrun(
    cwd: Path, command: list[str], *, limit: float, python_path: str = ""
) -> subprocess.CompletedProcess[str]:
    """``torchrun --standalone --nproc-per-node 2`` running ``command`` (``["memkit", "run",
    ...]``) as each rank, in ``cwd``, memkit importable (and ``python_path``), without the
    launcher variables of an outer run; torchrun and the ranks start warm (:func:`warm`).
    Tests import it (``from conftest import torchrun``); a hang kills torchrun's process group
    and fails the test."""
    if not (Path(sys.executable).parent / "torchrun").exists():
        pytest.skip("torchrun is not installed next to this Python")
    env = {**os.environ, "PYTHONPATH": f"{ROOT}:{python_path}" if python_path else str(ROOT)}
    env["PATH"] = f"{Path(sys.executable).parent}:{env['PATH']}"
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    ranks = warm_entrypoint(command, run_folder())
    cmd = warm(["torchrun", "--standalone", "--nproc-per-node", "2", *ranks])
    proc = subprocess.Popen(
        cmd, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True,
    )  # fmt: skip
    try:
        out, err = proc.communicate(timeout=limit)
    except subprocess.TimeoutExpired:
        # the proxy's group: the server then stops torchrun; its ranks (each in a session of
        # its own) are stopped when the test run ends, if their own timeouts have not
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        pytest.fail(f"torchrun {' '.join(command[:3])} did not finish within {limit} s (a hang)")
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


_ranks = SharedLaunch(limit=240.0)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The tests marked ``slow`` (real processes: torchrun, signals, a kernel, a browser) first,
    in their order: under pytest-xdist they then overlap the rest instead of ending the run
    one after another on whichever worker got them last. The tests that read the shared 2-rank
    launch last: it runs in the background from the start, and a test that waited for it
    would hold its worker idle."""

    def order(item: pytest.Item) -> int:
        if "gloo_ranks" in getattr(item, "fixturenames", ()):
            return 2
        return 0 if item.get_closest_marker("slow") is not None else 1

    items.sort(key=order)


def pytest_collection_finish(session: pytest.Session) -> None:
    """Start the 2-rank launch in the background when a collected test needs it."""
    if session.config.option.collectonly:
        return
    # the run's temporary directory (pytest keeps the last 3): an xdist worker's basetemp is a
    # folder of it, popen-gwN; tmp_path_factory is a fixture, not yet available here
    base = session.config._tmp_path_factory.getbasetemp()  # type: ignore[attr-defined]
    _run_folder[:] = [base.parent if "PYTEST_XDIST_WORKER" in os.environ else base]
    if any("gloo_ranks" in getattr(item, "fixturenames", ()) for item in session.items):
        _ranks.start(run_folder() / "ranks")


def pytest_sessionfinish(session: pytest.Session) -> None:
    _ranks.join()  # a launch this process started, for another xdist worker's tests


@pytest.fixture(scope="session")
def gloo_ranks() -> Callable[[str], RankRun]:
    """``gloo_ranks(name)``: the results of the 2-rank scenario ``name``. Every scenario the
    test modules registered (``rank_processes.rank_scenario``) runs in one launch of two gloo
    ranks per test run, started in the background when collection ends (a rank's start-up
    costs more than most scenarios)."""
    runs = _ranks.runs()
    return lambda name: runs[name].checked()
