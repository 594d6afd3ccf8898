"""`memkit run -m MODULE`: a module run as `python -m MODULE` runs it (relative imports, argv,
`__main__`), with what `memkit run SCRIPT` does (the report, exit codes, the traceback), and a
clear usage error for a module that is not there."""

from __future__ import annotations

import importlib
import json
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner

from memkit.cli import cli

MODEL = """import torch


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(64, 64)

    def forward(self, x):
        return self.fc(x)
"""

TRAIN = """import sys
import torch
from IMPORT import Net


def main():
    print("argv", sys.argv, "package", __package__, "path0", sys.path[0])
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(int(sys.argv[1])):
        model(torch.randn(BATCH, 64)).sum().backward()
        opt.step()
        opt.zero_grad()
    if "--fail" in sys.argv:
        raise ValueError("bad value")


if __name__ == "__main__":
    main()
"""


def run(*args: str):
    return CliRunner().invoke(cli, ["run", "--device", "cpu", "--budget", "8MiB", *args])


@pytest.fixture
def project(tmp_path: Path, monkeypatch) -> Iterator[Path]:
    """The current directory, holding the package ``trainpkg`` (``train`` imports ``.model``);
    the modules it imports are forgotten after the test."""
    pkg = tmp_path / "trainpkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "model.py").write_text(MODEL)
    (pkg / "train.py").write_text(TRAIN.replace("IMPORT", ".model").replace("BATCH", "8"))
    monkeypatch.chdir(tmp_path)
    importlib.invalidate_caches()
    yield tmp_path
    for name, module in list(sys.modules.items()):
        if str(getattr(module, "__file__", None) or "").startswith(str(tmp_path)):
            del sys.modules[name]


def comparable(report: dict) -> dict:
    """The JSON report without what changes from run to run (times)."""
    for device in report["devices"]:
        device.pop("timeline")
        for step in device["steps"]:
            step.pop("duration_s")
    return {k: v for k, v in report.items() if k != "duration_s"}


@pytest.mark.parametrize(("batch", "extra", "code"), [("8", "--fail", 3), ("40000", "", 1)])
def test_a_package_with_relative_imports_runs_as_its_file_equivalent_does(
    project, batch, extra, code
):
    """The file of a module with relative imports fails (ImportError); with -m it runs, and
    gets the report and exit code of the same code as a plain script (an error: 3; an OOM: 1)."""
    train = project / "trainpkg" / "train.py"
    train.write_text(train.read_text().replace("randn(8", f"randn({batch}"))
    flat = project / "flat"
    flat.mkdir()
    (flat / "model.py").write_text(MODEL)
    (flat / "train.py").write_text(TRAIN.replace("IMPORT", "model").replace("BATCH", batch))
    as_file = run(str(train), "1")
    assert as_file.exit_code == 3 and "attempted relative import" in as_file.stderr

    args = ["2", *([extra] if extra else [])]
    module = run("--json", "m.json", "-m", "trainpkg.train", *args)
    script = run("--json", "s.json", str(flat / "train.py"), *args)
    assert module.exit_code == script.exit_code == code, module.output
    reports = [json.loads((project / name).read_text()) for name in ("m.json", "s.json")]
    assert reports[0]["steps"] == (2 if code == 3 else 0)
    assert comparable(reports[0]) == comparable(reports[1])
    # the traceback starts at the module's own frame, as the script's at the script's
    first = module.stderr.split("Traceback (most recent call last):\n")[1].splitlines()[0]
    assert first == f'  File "{train}", line 19, in <module>'


def test_argv_package_path_and_the_main_guard_are_python_dash_ms(project):
    """sys.argv[0] is the module's file, what follows the module is its own (memkit's options
    too), __package__ is set, sys.path[0] is the current directory, and -mNAME works."""
    result = run("-m", "trainpkg.train", "2", "--budget", "16MiB")
    assert result.exit_code == 0, result.output
    train = str(project / "trainpkg" / "train.py")
    argv = [train, "2", "--budget", "16MiB"]
    assert f"argv {argv} package trainpkg path0 {project}" in result.stdout  # main() ran
    assert "memkit track: 2 step(s)" in result.stderr
    joined = run("-mtrainpkg.train", "1")
    assert joined.exit_code == 0 and f"argv {[train, '1']}" in joined.stdout, joined.output
    assert sys.argv[0] != train and sys.path[0] != str(project)  # restored


def test_a_package_runs_its_main_and_a_ctrl_c_names_the_modules_line(project):
    (project / "trainpkg" / "__main__.py").write_text(
        "import sys\nfrom .train import main\n\nprint(__name__, __spec__.name)\n"
        "sys.argv[1:] = ['1']\nmain()\nraise KeyboardInterrupt\n"
    )
    result = run("-m", "trainpkg")
    assert result.exit_code == 130, result.output
    assert "__main__ trainpkg.__main__" in result.stdout
    assert "memkit: interrupted by Ctrl-C at step 1 (__main__.py line 7, in <module>)" in (
        result.stderr
    )


def test_an_error_while_importing_the_package_is_the_scripts_error(project):
    (project / "trainpkg" / "__init__.py").write_text("import torch\n\n1 / 0\n")
    result = run("-m", "trainpkg.train", "1")
    assert result.exit_code == 3, result.output
    assert result.stderr.startswith(
        "Traceback (most recent call last):\n"
        f'  File "{project / "trainpkg" / "__init__.py"}", line 3, in <module>\n'
    )
    assert "ZeroDivisionError" in result.stderr


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["-m", "nosuch.train"], "-m nosuch.train: No module named 'nosuch'; looked for from "
                                 "{cwd} as python -m does (the current directory first, then "
                                 "sys.path)"),
        (["-m", "trainpkg.nosuch"], "-m trainpkg.nosuch: No module named trainpkg.nosuch; "
                                    "looked for from {cwd}"),
        (["-m", "trainpkg"], "No module named trainpkg.__main__; 'trainpkg' is a package and "
                             "cannot be directly executed; looked for from {cwd}"),
        (["-m", "trainpkg/train.py"], "-m trainpkg/train.py: a file's name, where -m takes a "
                                      "module's (pkg.train for pkg/train.py, from the directory "
                                      "that holds pkg); memkit run trainpkg/train.py runs the "
                                      "file as a script"),
        (["-m", ".train"], "-m '.train': expected a module's full name"),
        (["-m"], "-m needs a module's name, as python -m does"),
    ],
)  # fmt: skip
def test_a_module_that_is_not_there_is_a_usage_error(project, args, says):
    result = run("--json", "r.json", *args)
    assert result.exit_code == 2, result.output
    assert says.format(cwd=project) in result.stderr.splitlines()[-1]
    assert "Traceback" not in result.stderr and result.stdout == ""
    if "'nosuch'" in says:  # looked for before the run: no report file either
        assert not (project / "r.json").exists()


def test_memkits_options_after_the_module_get_the_hint_for_modules(project):
    (project / "trainpkg" / "cli.py").write_text(
        "import argparse\nargparse.ArgumentParser().parse_args()\n"
    )
    result = run("-m", "trainpkg.cli", "--budget", "16MiB")
    assert result.exit_code == 2, result.output
    assert "unrecognized arguments: --budget 16MiB" in result.stderr
    assert (
        "memkit's options go before -m MODULE (memkit run [OPTIONS] -m MODULE [ARGS]...); what "
        "follows -m MODULE is the script's." in " ".join(result.stderr.split())
    )


def test_a_script_file_named_like_dash_m_is_still_a_script(project):
    (project / "-mx.py").write_text("print('script', __name__, __package__)\n")
    result = run("-mx.py")
    assert result.exit_code == 0, result.output
    assert result.stdout == "script __main__ None\n"


def test_under_torchrun_each_rank_writes_its_own_file(project, monkeypatch):
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    result = run("--json", "r.json", "-m", "trainpkg.train", "2")
    assert result.exit_code == 0, result.output
    assert result.stderr.startswith("[rank 1] memkit: 2 step(s), peak ")
    assert json.loads((project / "r.rank1.json").read_text())["steps"] == 2
