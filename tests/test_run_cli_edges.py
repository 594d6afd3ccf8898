"""`memkit run`'s edges (issue #25): a mistyped memkit option before the script, `--json -`,
what runs without `--device`, and a script that exits before its first step."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

from memkit.cli import cli

ARGPARSE_SCRIPT = """import argparse
import torch
parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=2)
args = parser.parse_args()
model = torch.nn.Linear(8, 8)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(args.steps):
    model(torch.randn(4, 8)).sum().backward()
    opt.step()
    opt.zero_grad()
open(MARKER, "w").write("ran")
"""


def invoke(*args: str):
    return CliRunner().invoke(cli, list(args))


def script(tmp_path: Path) -> tuple[Path, Path]:
    marker = tmp_path / "ran.marker"
    path = tmp_path / "train.py"
    path.write_text(ARGPARSE_SCRIPT.replace("MARKER", repr(str(marker))))
    return path, marker


@pytest.mark.parametrize(
    ("typo", "meant"), [("--budjet", "--budget"), ("--devcie", "--device"), ("--jsn", "--json")]
)
def test_a_mistyped_option_before_the_script_is_a_usage_error(tmp_path, typo, meant):
    path, marker = script(tmp_path)
    result = invoke("run", "--device", "cpu", typo, "64MiB", str(path))
    assert result.exit_code == 2, result.output
    assert f"No such option '{typo}'" in result.stderr
    assert f"Did you mean '{meant}'?" in result.stderr
    assert "found no file" not in result.output and not marker.exists()


def test_probe_says_the_same_for_its_options(tmp_path):
    result = invoke("probe", "--devcie", "cpu", str(tmp_path / "model.py"))
    assert result.exit_code == 2 and "Did you mean '--device'?" in result.stderr


def test_a_script_named_like_an_option_still_runs(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    path, marker = script(tmp_path)
    odd = tmp_path / "-odd.py"
    odd.write_text(path.read_text())
    result = invoke("run", "--device", "cpu", "--budget", "8MiB", "-odd.py")
    assert result.exit_code == 0, result.output
    assert marker.exists() and "2 step(s)" in result.stderr


@pytest.mark.parametrize("option", ["--json", "--html", "--memory-history"])
def test_dash_is_refused_not_written_as_a_file(tmp_path, monkeypatch, option):
    monkeypatch.chdir(tmp_path)
    path, marker = script(tmp_path)
    result = invoke("run", "--device", "cpu", "--budget", "8MiB", option, "-", str(path))
    assert result.exit_code == 2, result.output
    (line,) = result.stderr.splitlines()
    assert line.startswith(f"memkit: error: {option} '-': expected a file name")
    assert "stdout is the script's" in line
    assert not (tmp_path / "-").exists() and not marker.exists()


def test_help_says_what_runs_without_a_device():
    result = invoke("run", "--help")
    text = " ".join(result.output.split())
    assert "Default: current GPU" not in text
    assert "on a machine without one, the simulated cpu device" in text


def test_a_script_that_exits_before_its_first_step_says_so_in_one_line(tmp_path):
    path, marker = script(tmp_path)
    result = invoke("run", "--device", "cpu", "--budget", "8MiB", str(path), "--stepz", "3")
    assert result.exit_code == 2  # the script's argparse, not memkit
    assert "unrecognized arguments: --stepz" in result.stderr
    lines = [line for line in result.stderr.splitlines() if line.startswith("memkit:")]
    assert lines == [
        "memkit: the script exited with code 2 before its first step (no model forward ran): "
        "nothing to report. The exit code is the script's own; memkit's usage errors exit 2 "
        "with a 'memkit: error:' line before the script starts."
    ]
    assert "memkit track:" not in result.stderr and not marker.exists()
    # the same script, run through: the full report, not the line
    ok = invoke("run", "--device", "cpu", "--budget", "8MiB", str(path), "--steps", "2")
    assert ok.exit_code == 0 and marker.exists()
    assert "memkit track: 2 step(s)" in ok.stderr and "before its first step" not in ok.stderr


def test_ctrl_c_before_the_first_step_says_so_in_one_line(tmp_path):
    """Sweep C pressed Ctrl-C while a script was still loading: it got "the script exited with
    code 130 before its first step ... the exit code is the script's own" and then "interrupted
    by Ctrl-C at step 0; the numbers cover what ran until then". One line now, and it is true."""
    path = tmp_path / "slow_start.py"
    path.write_text("raise KeyboardInterrupt  # Ctrl-C while the script still loads its data\n")
    result = invoke("run", "--device", "cpu", "--budget", "8MiB", str(path))
    assert result.exit_code == 130
    lines = [line for line in result.stderr.splitlines() if line.startswith("memkit:")]
    assert lines == [
        "memkit: interrupted by Ctrl-C before the script's first step (no model forward ran): "
        "nothing to report (exit 130)"
    ], result.stderr


def test_the_console_entry_point_words_click_usage_errors_as_one_memkit_line(tmp_path, capsys):
    """What a user's shell runs (``memkit = memkit.cli:main``): a mistyped option or a missing
    argument is the one line ``memkit: error: ...``, exit 2, as memkit's own usage errors; a
    script's argparse error looks different."""
    from memkit.cli import main

    path, marker = script(tmp_path)
    for argv, fragment in (
        (["run", "--budjet", "64MiB", str(path)], "No such option '--budjet'"),
        (["probe"], "Missing argument 'FILE'"),
        (["run", "-m"], "-m needs a module's name, as python -m does"),
    ):
        with pytest.raises(SystemExit) as exit_info:
            main(argv)
        err = capsys.readouterr().err
        assert exit_info.value.code == 2
        assert err.startswith("memkit: error: ") and fragment in err
        assert len(err.strip().splitlines()) == 1 and "Usage:" not in err
    assert not marker.exists()
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0


# -- the script as Python runs it (sweep L) ------------------------------------------------------
CHDIR_SCRIPT = """import os, sys
import torch
print("file", __file__)
print("argv0", sys.argv[0])
print("package", __package__, "spec", __spec__)
print("main", sys.modules["__main__"].__file__ == __file__)
HERE = os.path.dirname(__file__)
os.chdir(os.path.join(HERE, "outputs"))  # as hydra.job.chdir=True does
print("cfg", open(os.path.join(os.path.dirname(__file__), "conf.txt")).read())
model = torch.nn.Linear(8, 8)
model(torch.randn(4, 8)).sum().backward()
if sys.argv[1:] == ["fail"]:
    raise ValueError("after the chdir")
if sys.argv[1:] == ["stop"]:
    raise KeyboardInterrupt
"""


@pytest.mark.parametrize("typed", ["proj/train.py", "./proj/train.py"])
def test_the_script_gets_an_absolute_file_as_python_gives_it(tmp_path, monkeypatch, typed):
    """Sweep L: a script run as `memkit run proj/train.py` got __file__ 'proj/train.py', so
    after changing directory it could not find its own config (FileNotFoundError, exit 3);
    `python proj/train.py` gives an absolute __file__ (Python 3.9+), argv[0] as typed and
    __package__ None."""
    project = tmp_path / "proj"
    (project / "outputs").mkdir(parents=True)
    (project / "conf.txt").write_text("lr=0.1")
    (project / "train.py").write_text(CHDIR_SCRIPT)
    monkeypatch.chdir(tmp_path)
    result = invoke("run", "--device", "cpu", "--budget", "8MiB", typed)
    assert result.exit_code == 0, result.output
    out = result.stdout.splitlines()
    assert f"file {project / 'train.py'}" in out
    assert f"argv0 {typed}" in out
    assert "package None spec None" in out and "main True" in out and "cfg lr=0.1" in out


def test_after_a_chdir_the_traceback_and_the_ctrl_c_line_still_find_the_script(
    tmp_path, monkeypatch
):
    project = tmp_path / "proj"
    (project / "outputs").mkdir(parents=True)
    (project / "conf.txt").write_text("lr=0.1")
    (project / "train.py").write_text(CHDIR_SCRIPT)
    monkeypatch.chdir(tmp_path)
    failed = invoke("run", "--device", "cpu", "--budget", "8MiB", "proj/train.py", "fail")
    assert failed.exit_code == 3, failed.output
    trace = failed.stderr[failed.stderr.index("Traceback") :]
    frames = [line for line in trace.splitlines() if line.startswith("  File ")]
    # trimmed to the script's frames: memkit's own are left out
    assert frames and all(f'"{project / "train.py"}"' in line for line in frames), frames
    monkeypatch.chdir(tmp_path)  # the script changed this process's directory
    stopped = invoke("run", "--device", "cpu", "--budget", "8MiB", "proj/train.py", "stop")
    assert stopped.exit_code == 130
    assert "(train.py line 15, in <module>)" in stopped.stderr, stopped.stderr


def test_relative_report_paths_mean_the_directory_memkit_started_in(tmp_path, monkeypatch):
    """Sweep HH: the paths were checked against the starting directory but written after the
    script's chdir: into outputs/reports/ when that existed too, else not at all."""
    project = tmp_path / "proj"
    (project / "outputs" / "reports").mkdir(parents=True)
    (project / "conf.txt").write_text("lr=0.1")
    (project / "train.py").write_text(CHDIR_SCRIPT)
    (tmp_path / "reports").mkdir()
    monkeypatch.chdir(tmp_path)
    result = invoke("run", "--device", "cpu", "--budget", "8MiB", "--json", "reports/r.json",
                    "--html", "reports/r.html", "proj/train.py")  # fmt: skip
    assert result.exit_code == 0, result.output
    assert (tmp_path / "reports" / "r.json").is_file()
    assert (tmp_path / "reports" / "r.html").is_file()
    assert not list((project / "outputs" / "reports").iterdir())


# -- how the script ended, in the report ----------------------------------------------------------
ENDINGS = """import sys
import torch
model = torch.nn.Linear(8, 8)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
model(torch.randn(4, 8)).sum().backward()
opt.step()
END
"""


@pytest.mark.parametrize(
    ("end", "code", "note"),
    [
        ("raise ValueError('bad value mid-training')", 3,
         "the script raised ValueError: bad value mid-training (exit 3: memkit's code for an "
         "error the script raised)"),
        ("sys.exit(3)", 3, "the script exited with code 3 (sys.exit)"),
        ("sys.exit('bye')", 1, "the script exited with sys.exit('bye') (exit 1)"),
        ("sys.exit(256)", 0, "the script exited with sys.exit(256) (exit 0)"),
        ("sys.exit([1, 2])", 1, "the script exited with sys.exit([1, 2]) (exit 1)"),
        ("sys.exit(0)", 0, None),
        ("pass", 0, None),
    ],
)  # fmt: skip
def test_the_json_report_says_how_the_script_ended(tmp_path, end, code, note):
    """Sweep L: a ValueError mid-run, sys.exit(3) and sys.exit("msg") all gave a JSON report
    that read as a clean run (`oom: null`, no note)."""
    import json

    path = tmp_path / "train.py"
    path.write_text(ENDINGS.replace("END", end))
    out = tmp_path / "r.json"
    result = invoke("run", "--device", "cpu", "--budget", "8MiB", "--json", str(out), str(path))
    assert result.exit_code == code, result.output
    report = json.loads(out.read_text())
    endings = [n for n in report["notes"] if n.startswith("the script ")]
    assert endings == ([note] if note else []) and report["oom"] is None
    if note:
        assert note in result.stderr  # the text report's notes too


def test_an_error_before_the_first_step_is_not_called_the_scripts_exit_code(tmp_path):
    """Sweep L: "the script exited with code 3 ... The exit code is the script's own" for a
    script that raised: Python exits 1 there, 3 is memkit's code for an error it raised."""
    path = tmp_path / "train.py"
    path.write_text("open('no/such/config.txt')\n")
    result = invoke("run", "--device", "cpu", "--budget", "8MiB", str(path))
    assert result.exit_code == 3
    lines = [line for line in result.stderr.splitlines() if line.startswith("memkit:")]
    assert lines == [
        "memkit: the script raised FileNotFoundError: [Errno 2] No such file or directory: "
        "'no/such/config.txt' (exit 3: memkit's code for an error the script raised), before "
        "its first step (no model forward ran): nothing to report."
    ], result.stderr


# -- memkit's log records and the script's logging ------------------------------------------------
@pytest.fixture
def restore_logging():
    import logging

    root = logging.getLogger()
    saved = root.handlers[:], root.level
    yield
    root.handlers[:] = saved[0]
    root.setLevel(saved[1])


def test_memkits_log_records_stay_out_of_the_scripts_handlers(tmp_path, restore_logging):
    """Sweep L: a script logging to stdout (transformers' run_clm.py does) got memkit's whole OOM
    post-mortem on ITS stdout (and a second copy on stderr), and its train.log memkit's INFO."""
    import logging

    path = tmp_path / "train.py"
    path.write_text(
        "import logging, sys\nimport torch\n"
        "root = logging.getLogger()  # logging.basicConfig(stream=sys.stdout), which pytest's\n"
        "out = logging.StreamHandler(sys.stdout)  # handlers on the root would turn off\n"
        "out.setFormatter(logging.Formatter('[%(name)s] %(message)s'))\n"
        "root.addHandler(out); root.setLevel(logging.INFO)\n"
        "root.addHandler(logging.FileHandler(sys.argv[1]))\n"
        "logging.info('user line')\n"
        "model = torch.nn.Sequential(torch.nn.Linear(256, 4096), torch.nn.Linear(4096, 10))\n"
        "opt = torch.optim.Adam(model.parameters())\n"
        "for bs in (16, 64, 1024):\n"
        "    model(torch.randn(bs, 256)).sum().backward(); opt.step(); opt.zero_grad()\n"
    )
    log_file = tmp_path / "train.log"
    result = invoke("run", "--device", "cpu", "--budget", "24MiB", str(path), str(log_file))
    logging.getLogger().handlers[-1].close()
    assert result.exit_code == 1, result.output
    assert result.stdout.splitlines() == ["[root] user line"]
    assert log_file.read_text().splitlines() == ["user line"]
    assert result.stderr.count("memkit: out of memory on cpu") == 1
    assert logging.getLogger("memkit").propagate  # restored after the command


def test_memkits_warnings_still_reach_stderr_under_a_command(capsys, caplog):
    import logging

    from memkit.cli.streams import memkit_logs_to_stderr

    with caplog.at_level(logging.INFO):
        with memkit_logs_to_stderr():
            logging.getLogger("memkit.tracking.hooks").warning("memkit: a hook failed")
            logging.getLogger("memkit.tracking.leaks").info("memory grows (a passing guess)")
        assert capsys.readouterr().err == "memkit: a hook failed\n"
        assert caplog.records == []  # the root's handlers (the user's) saw neither
        logging.getLogger("memkit.x").info("after")
    assert [r.getMessage() for r in caplog.records] == ["after"]  # the API's: propagated


def test_memkits_warnings_reach_stderr_after_a_dict_config_disabled_its_loggers(capsys):
    """A script or library calling logging.config.dictConfig (disable_existing_loggers is its
    default) disabled memkit's loggers, and the command's warnings went nowhere (seen as an
    order-dependent failure of the test above)."""
    import logging
    import logging.config

    from memkit.cli.streams import memkit_logs_to_stderr

    hooks = logging.getLogger("memkit.tracking.hooks")
    loggers = [v for v in logging.root.manager.loggerDict.values() if isinstance(v, logging.Logger)]
    before = [(found, found.disabled) for found in loggers]
    root = logging.getLogger()
    saved = root.handlers[:], root.level
    logging.config.dictConfig({"version": 1, "disable_existing_loggers": True})
    try:
        assert hooks.disabled
        with memkit_logs_to_stderr():
            hooks.warning("memkit: a hook failed")
            # the script's own dictConfig, while the command runs (review)
            logging.config.dictConfig({"version": 1, "disable_existing_loggers": True})
            hooks.warning("memkit: and again")
        assert capsys.readouterr().err == "memkit: a hook failed\nmemkit: and again\n"
        assert hooks.disabled  # as the script left it, after the command
    finally:  # every logger as it was (the test's dictConfig touched them all)
        for found, was in before:
            found.disabled = was
        root.handlers[:] = saved[0]
        root.setLevel(saved[1])


# -- memkit's options after SCRIPT --------------------------------------------------------------
def test_memkit_options_after_the_script_get_a_hint_when_the_script_refuses_them(tmp_path):
    path, marker = script(tmp_path)
    result = invoke("run", "--device", "cpu", str(path), "--budget", "16MiB")
    assert result.exit_code == 2 and not marker.exists()
    assert "unrecognized arguments: --budget 16MiB" in result.stderr
    assert (
        "The script was given --budget, which memkit run has too: memkit's options go before "
        "SCRIPT (memkit run [OPTIONS] SCRIPT [ARGS]...)" in result.stderr
    )
    other = invoke("run", "--device", "cpu", "--budget", "8MiB", str(path), "--stepz", "1")
    assert other.exit_code == 2 and "memkit's options go before SCRIPT" not in other.stderr


def test_the_hint_names_only_the_options_the_script_refused(tmp_path):
    """Sweep W: the script took --device (its own) and refused --module-every; the hint named
    both."""
    path = tmp_path / "train.py"
    path.write_text("import argparse\np = argparse.ArgumentParser()\np.add_argument('--device')\n"
                    "p.parse_args()\n")  # fmt: skip
    result = invoke("run", "--device", "cpu", str(path), "--module-every", "3", "--device", "cpu")
    assert result.exit_code == 2
    assert "The script was given --module-every, which memkit run has too" in result.stderr


def test_a_syntax_error_shows_the_scripts_line_not_memkits_frames(tmp_path):
    path = tmp_path / "train.py"
    path.write_text("import torch\ndef f(:\n    pass\n")
    result = invoke("run", "--device", "cpu", str(path))
    assert result.exit_code == 3
    assert result.stderr.startswith(f'  File "{path}", line 2\n    def f(:\n          ^\n'
                                    "SyntaxError: invalid syntax\n")  # fmt: skip
    assert "memkit" not in result.stderr.split("SyntaxError")[0]


def test_a_compiled_script_and_a_zip_application_still_run(tmp_path):
    """What `python FILE` runs besides a source file, memkit run runs too (a .pyc through
    memkit's own loader, a zip application through runpy)."""
    import py_compile
    import zipapp

    app = tmp_path / "app"
    app.mkdir()
    (app / "__main__.py").write_text(
        "import torch\nm = torch.nn.Linear(4, 4)\nm(torch.randn(2, 4)).sum().backward()\n"
        "print('ran', __name__)\n"
    )
    compiled = tmp_path / "train.pyc"
    py_compile.compile(str(app / "__main__.py"), cfile=str(compiled), doraise=True)
    zipapp.create_archive(app, tmp_path / "app.pyz")
    for path in (compiled, tmp_path / "app.pyz"):
        result = invoke("run", "--device", "cpu", "--budget", "8MiB", str(path))
        assert result.exit_code == 0, result.output
        assert "ran __main__" in result.stdout and "memkit track: 1 step(s)" in result.stderr


def test_the_scripts_own_memkit_calls_are_told_keywords_not_memkits_options(tmp_path):
    """Under `memkit run`, a script calling ``memkit.probe(..., seq_len=8)`` is the Python
    API's user: its errors name ``seq_len=``, not the command line's ``--seq-len``."""
    path = tmp_path / "api_in_script.py"
    path.write_text(
        "import torch\nimport memkit\n\n"
        "try:\n"
        "    memkit.probe(torch.nn.Linear(8, 8), lambda n: torch.randn(n, 8), seq_len=8,\n"
        "                 device='cpu', budget='8MiB')\n"
        "except memkit.errors.MemkitError as exc:\n"
        "    print('ERR', exc)\n"
    )
    result = invoke("run", "--device", "cpu", str(path))
    assert result.exit_code == 0, result.output
    (line,) = [x for x in result.stdout.splitlines() if x.startswith("ERR")]
    assert "seq_len=8 was given" in line and "--seq-len" not in line


def test_a_script_that_asks_for_cuda_on_a_machine_without_one_is_told_what_to_do(tmp_path):
    """Sweep FF: the model-parallel tutorial's `.to('cuda:0')` under --device cpu ended with
    torch's 'Torch not compiled with CUDA enabled' and nothing on what memkit offers."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    path = tmp_path / "mp.py"
    path.write_text("import torch\nnet = torch.nn.Linear(4, 4).to('cuda:0')\n")
    result = invoke("run", "--device", "cpu", "--budget", "8MiB", str(path))
    assert result.exit_code == 3
    assert "this machine has none" in result.stderr
    assert "memkit.simulate(budget, devices=N)" in result.stderr


def test_the_scripts_traceback_leaves_out_memkits_passthrough_frames():
    """Sweep BW: an OOM in backward under memkit run showed memkit's backward wrapper (and
    torch's compiler.disable wrappers around it) between the script's frames and torch's."""
    import torch

    import memkit
    from memkit.tracking.run import _script_traceback

    model = torch.nn.Sequential(
        torch.nn.Linear(256, 4096), torch.nn.ReLU(), torch.nn.Linear(4096, 8)
    )
    caught = None
    try:
        with memkit.track(model, device="cpu", budget="24MiB", postmortem=None):
            model(torch.randn(512, 256)).square().mean().backward()  # backward runs out
    except torch.OutOfMemoryError as exc:
        caught = exc
    assert caught is not None
    text = _script_traceback(caught)
    assert "wrappers.py" not in text and "nonrecursive_disable_wrapper" not in text
    assert "test_run_cli_edges.py" in text and "OutOfMemoryError" in text
    del caught
