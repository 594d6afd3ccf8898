"""Shared fixtures: small real models and a clean simulated device per test."""

from __future__ import annotations

import gc

import pytest
import torch

# Files under tests/ that are run or loaded by the tests, never imported as modules: with
# --doctest-modules pytest would import them (and run the scripts) to look for doctests.
collect_ignore_glob = ["modelfiles/*", "realworld/scripts/*", "scenarios/*", "rank_processes.py"]


@pytest.fixture(autouse=True)
def _seed_and_collect():
    torch.manual_seed(0)
    yield
    # free what a test left in reference cycles (tensors the next test's device would count);
    # then freeze the survivors, so the next collection looks only at what that test makes
    gc.collect()
    gc.freeze()


@pytest.fixture
def mlp() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--update-golden",
        action="store_true",
        help="rewrite tests/golden/*.txt from the current output instead of comparing",
    )


@pytest.fixture
def golden(request: pytest.FixtureRequest):
    """``golden(name, text)``: compare CLI text with tests/golden/NAME.txt (timings masked);
    ``pytest --update-golden`` rewrites the files."""
    import re
    from pathlib import Path

    folder = Path(__file__).parent / "golden"
    update = request.config.getoption("--update-golden")

    def check(name: str, text: str) -> None:
        text = re.sub(r"(?m)(\s)\d+\.\d\ds$", r"\1#.##s", text)  # seconds per trial
        text = re.sub(r"(?m)( {2,})\d+\.\d\d$", lambda m: m.group(1) + "#.##", text)
        path = folder / f"{name}.txt"
        if update:
            folder.mkdir(exist_ok=True)
            path.write_text(text, encoding="utf-8")
            return
        assert path.exists(), f"no golden file {path}: run pytest --update-golden"
        assert text == path.read_text(encoding="utf-8"), (
            f"{name}: output differs from {path} (if the change is intended, rerun with "
            "--update-golden and review the diff)"
        )

    return check
