"""`memkit run SCRIPT`: the scenario scripts of real failures, exit codes, argv, files, ranks."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from conftest import warm

from memkit.cli import cli

SCENARIOS = Path(__file__).parent / "scenarios"


def run(*args: str):
    return CliRunner().invoke(cli, ["run", *args])


def test_accumulating_loss_leak_is_named_then_runs_out():
    result = run(
        "--device", "cpu", "--budget", "6MiB",
        str(SCENARIOS / "accumulating_loss_leak.py"), "--steps", "40",
    )  # fmt: skip
    assert result.exit_code == 1, result.output
    err = result.stderr
    assert "Traceback" in err and "OutOfMemoryError" in err
    assert "memory grows by" in err and "[graph-retained]" in err
    assert "`running_loss`" in err and "accumulating_loss_leak.py:train()" in err
    assert "loss.item()" in err
    assert "memkit: out of memory on cpu" in err


def test_backward_oom_names_phase_and_layer(tmp_path):
    out, page = tmp_path / "report.json", tmp_path / "report.html"
    result = run(
        "--device", "cpu", "--budget", "28MiB", "--json", str(out), "--html", str(page),
        str(SCENARIOS / "backward_oom.py"), "--steps", "1",
    )  # fmt: skip
    assert result.exit_code == 1, result.output
    # the autograd node that ran out, and the module backward last reached (sweep CO)
    assert "at step 0, backward, in AddmmBackward0, after the gradient reached classifier" in (
        result.stderr
    )
    data = json.loads(out.read_text())
    oom = data["oom"]
    assert oom["phase"] == "backward" and oom["module"] == "classifier"
    assert oom["node"] == "AddmmBackward0"
    assert oom["tried_to_allocate"] == 8 * 1024**2 and oom["capacity"] == 28 * 1024**2
    assert oom["breakdown"]["parameters"] > 0 and oom["breakdown"]["activations"] > 0
    assert any(a["code"] == "oom-activations" for a in oom["advice"])
    # the post-mortem's advice is the page's advice: no "No advice" section after it
    html = page.read_text()
    assert "oom-activations" in html and "No advice" not in html
    assert html.count("<h3>Advice</h3>") == 1


def test_eval_without_no_grad_is_diagnosed():
    result = run(
        "--device", "cpu", "--budget", "48MiB",
        str(SCENARIOS / "eval_without_no_grad.py"), "--train-steps", "1",
    )  # fmt: skip
    assert result.exit_code == 1, result.output
    err = result.stderr
    assert "eval mode with autograd recording" in err
    assert "[eval-grad-enabled]" in err and "torch.no_grad()" in err


def test_frozen_backbone_trains_and_writes_files(tmp_path):
    out, page = tmp_path / "r.json", tmp_path / "r.html"
    result = run(
        "--device", "cpu", "--budget", "128MiB", "--json", str(out), "--html", str(page),
        str(SCENARIOS / "frozen_backbone.py"), "--steps", "2", "--batch", "8",
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    assert "step 1 loss" in result.stdout and "memkit track" not in result.stdout
    assert "2 step(s)" in result.stderr
    data = json.loads(out.read_text())
    assert data["steps"] == 2
    # hand count: only the head trains, so only it has gradients and AdamW state (two moments
    # and a 4-byte step per parameter tensor); the peak is step 1's forward, after step 0's
    head = (32 * 64 + 64 + 64 * 10 + 10) * 4
    device = data["devices"][0]
    assert device["breakdown"]["gradients"] == head
    assert device["breakdown"]["optimizer_state"] == 2 * head + 4 * 4
    # the frozen backbone keeps no activation for backward: its first conv's output alone
    # (batch 8 x 16 x 32 x 32 float32) is more than the whole backward peak
    assert device["phase_peaks"]["backward"] < 8 * 16 * 32 * 32 * 4 < device["peak_allocated"]
    html = page.read_text()
    assert html.startswith("<!DOCTYPE html>") and "<svg" in html and "<script" not in html


def write(tmp_path: Path, text: str) -> Path:
    script = tmp_path / "train.py"
    script.write_text(text)
    return script


def test_exit_codes_argv_and_main(tmp_path):
    script = write(
        tmp_path,
        "import sys\nprint('argv', sys.argv[1:], __name__)\nsys.exit(int(sys.argv[1]))\n",
    )
    result = run("--device", "cpu", "--budget", "8MiB", str(script), "7", "--flag")
    assert result.exit_code == 7
    assert "argv ['7', '--flag'] __main__" in result.stdout
    bad = write(tmp_path, "raise ValueError('not an oom')\n")
    result = run("--device", "cpu", "--budget", "8MiB", str(bad))
    assert result.exit_code == 3 and "ValueError: not an oom" in result.stderr
    missing = run("--device", "cpu", str(tmp_path / "nope.py"))
    assert missing.exit_code == 2 and "memkit: error:" in missing.output


def test_steps_only_and_rank_prefix(tmp_path, monkeypatch):
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    script = write(
        tmp_path,
        "import torch\nm = torch.nn.Linear(8, 8)\nopt = torch.optim.SGD(m.parameters(), lr=.1)\n"
        "for _ in range(3):\n    m(torch.randn(4, 8)).sum().backward(); opt.step()\n",
    )
    result = run(
        "--device", "cpu", "--budget", "8MiB", "--steps-only", "--json",
        str(tmp_path / "report.json"), str(script),
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    # a rank other than 0 prints one line, and writes its file; the script made no process
    # group, so nothing is gathered into rank 0's report, and the line says so
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("[rank 1] memkit: 3 step(s), peak ")
    assert " on cpu of 8.00 MiB; not gathered into rank 0's report" in lines[0]
    assert "ranks not gathered: no process group" in " ".join(
        json.loads((tmp_path / "report.rank1.json").read_text())["notes"]
    )
    assert "report.rank1.json" in lines[0] and "memkit track" not in result.stderr
    data = json.loads((tmp_path / "report.rank1.json").read_text())
    assert data["rank"] == 1 and data["steps"] == 3 and data["mode"] == "steps-only"
    monkeypatch.setenv("RANK", "0")
    result = run("--device", "cpu", "--budget", "8MiB", "--steps-only", str(script))
    assert result.exit_code == 0, result.output
    assert "[rank 0] memkit track rank 0/2: 3 step(s)" in result.stderr
    assert "mode steps-only" in result.stderr and "at the training peak" in result.stderr


def marker_script(tmp_path: Path) -> tuple[Path, Path]:
    """A script that leaves a marker file when it runs (so a test can tell it never started)."""
    marker = tmp_path / "ran.marker"
    script = write(tmp_path, f"open({str(marker)!r}, 'w').write('ran')\n")
    return script, marker


@pytest.mark.parametrize(
    ("args", "fragments"),
    [
        (["--device", "cpu", "--budget", "12XB"], ["--budget '12XB'", "unknown size unit"]),
        (["--device", "cpu", "--budget", "0"], ["--budget '0'", "positive size", "300MiB"]),
        (["--device", "cpu", "--budget", "-1GiB"], ["--budget '-1GiB'", "positive size"]),
        (["--device", "tpu"], ["--device 'tpu'", "expected a device such as", "'cpu'"]),
        (["--device", "nonsense"], ["--device 'nonsense'", "expected a device such as"]),
        (["--device", "cpu", "--budget", "1GiB,2GiB"],
         ["--budget '1GiB,2GiB'", "single process", "torchrun --nproc-per-node 2"]),
    ],
)  # fmt: skip
def test_bad_options_exit_2_before_the_script_runs(tmp_path, args, fragments):
    script, marker = marker_script(tmp_path)
    result = run(*args, str(script))
    assert result.exit_code == 2, result.output
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("memkit: error: "), result.stderr
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])
    assert "step(s)" not in result.output and not marker.exists()


@pytest.mark.skipif(torch.cuda.device_count() > 7, reason="this machine has a cuda:7")
def test_missing_gpu_exits_2_before_the_script_runs(tmp_path):
    script, marker = marker_script(tmp_path)
    result = run("--device", "cuda:7", str(script))
    assert result.exit_code == 2, result.output
    line = result.stderr.strip()
    assert line.startswith("memkit: error: --device 'cuda:7': ") and "\n" not in line
    assert "--device cpu --budget" in line and not marker.exists()


@pytest.mark.parametrize("option", ["--json", "--html"])
def test_missing_output_folder_exits_2_before_the_script_runs(tmp_path, option):
    script, marker = marker_script(tmp_path)
    target = tmp_path / "no" / "such" / "report.out"
    result = run("--device", "cpu", "--budget", "8MiB", option, str(target), str(script))
    assert result.exit_code == 2, result.output
    line = result.stderr.strip()
    assert line.startswith(f"memkit: error: {option} ") and "\n" not in line
    assert str(target.parent) in line and "does not exist" in line and "mkdir -p" in line
    assert not marker.exists()
    blocked = tmp_path / "a_file"
    blocked.write_text("")
    result = run("--device", "cpu", "--budget", "8MiB", option, str(blocked / "r.out"),
                 str(script))  # fmt: skip
    assert result.exit_code == 2 and "is not a folder" in result.stderr
    assert not marker.exists()


def test_per_rank_budgets_under_torchrun(tmp_path, monkeypatch):
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    script, marker = marker_script(tmp_path)
    out = tmp_path / "r.json"
    result = run("--device", "cpu", "--budget", "8MiB,16MiB", "--json", str(out), str(script))
    assert result.exit_code == 0, result.output
    data = json.loads((tmp_path / "r.rank1.json").read_text())
    assert data["devices"][0]["capacity"] == 16 * 1024**2  # rank 1 takes the second entry
    marker.unlink()
    result = run("--device", "cpu", "--budget", "8MiB,16MiB,4MiB", str(script))
    assert result.exit_code == 2 and "3 sizes" in result.stderr and "2 rank(s)" in result.stderr
    assert not marker.exists()


def test_output_lost_during_the_run_keeps_the_script_exit_code(tmp_path):
    folder = tmp_path / "out"
    folder.mkdir()
    script = write(tmp_path, f"import shutil\nshutil.rmtree({str(folder)!r})\n")
    result = run("--device", "cpu", "--budget", "8MiB", "--json", str(folder / "r.json"),
                 str(script))  # fmt: skip
    assert result.exit_code == 0, result.output  # the script's, not 1
    assert "memkit: error: --json" in result.stderr and "could not write" in result.stderr
    # the script ran no model forward: one line says so instead of an empty report (#25)
    assert "Traceback" not in result.stderr and "before its first step" in result.stderr


@pytest.mark.slow
def test_real_process_keeps_exit_code(tmp_path):
    script = write(
        tmp_path, "import torch\nm = torch.nn.Linear(64, 1024)\nm(torch.randn(512, 64))\n"
    )
    proc = subprocess.run(
        warm([sys.executable, "-m", "memkit", "run", "--device", "cpu", "--budget", "1MiB",
              str(script)]),
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 1, proc.stderr
    assert "memkit: out of memory on cpu at step 0, forward of Linear" in proc.stderr


def test_sigterm_handler_is_installed_for_the_run_then_restored(tmp_path):
    def mine(signum, frame):  # pragma: no cover - never called
        pass

    previous = signal.signal(signal.SIGTERM, mine)
    try:
        script = write(
            tmp_path, "import signal\nprint(signal.getsignal(signal.SIGTERM).__qualname__)\n"
        )
        result = run("--device", "cpu", "--budget", "8MiB", str(script))
        assert result.exit_code == 0, result.output
        assert "SignalGuard._handle" in result.stdout  # the script ran under memkit's handler
        assert signal.getsignal(signal.SIGTERM) is mine  # and the previous one is back
    finally:
        signal.signal(signal.SIGTERM, previous)


LOOP_FOREVER = """
import torch
m = torch.nn.Linear(16, 16)
opt = torch.optim.SGD(m.parameters(), lr=0.1)
step = 0
while True:
    m(torch.randn(8, 16)).sum().backward()
    opt.step()
    opt.zero_grad()
    step += 1
    if step == 3:
        print("step 3", flush=True)
"""


SIGNAL_IN_A_FINALIZER = """
import os, signal, weakref
import torch
m = torch.nn.Linear(16, 16)
opt = torch.optim.SGD(m.parameters(), lr=0.1)
class Box:
    pass
box = Box()
weakref.finalize(box, lambda: (os.kill(os.getpid(), signal.SIGNAL), sum(range(10000))))
step = 0
while True:
    m(torch.randn(8, 16)).sum().backward()
    opt.step()
    opt.zero_grad()
    step += 1
    if step == 3:
        del box  # its finalizer runs, and SIGTERM arrives inside it
        print("survived the finalizer", flush=True)  # the first exception was dropped
"""

SIGTERM_IN_A_FINALIZER_AT_THE_END = """
import os, signal, weakref
class Box:
    pass
box = Box()
weakref.finalize(box, lambda: (os.kill(os.getpid(), signal.SIGTERM), sum(range(10000))))
del box
print("survived the finalizer", flush=True)
"""


def _start_run(script: Path, out: Path, *options: str) -> subprocess.Popen[str]:
    """``memkit run --device cpu --budget 8MiB --json OUT [OPTIONS] SCRIPT`` in a process of
    its own, its output piped (for the signal tests)."""
    return subprocess.Popen(
        warm([sys.executable, "-m", "memkit", "run", "--device", "cpu", "--budget", "8MiB",
              "--json", str(out), *options, str(script)]),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize(
    ("signame", "code", "said"), [("SIGTERM", 143, "SIGTERM"), ("SIGINT", 130, "Ctrl-C")]
)
def test_a_signal_that_lands_where_python_drops_exceptions_still_stops_the_script(
    tmp_path, signame, code, said
):
    """A signal handler can run inside a weakref callback or a __del__ (the simulated device
    frees storages in one), where Python drops an exception: the run must still stop with its
    code and its report, not loop on with every later SIGTERM ignored (or the Ctrl-C lost), and
    print no traceback."""
    script = write(tmp_path, SIGNAL_IN_A_FINALIZER.replace("SIGNAL", signame))
    out = tmp_path / "r.json"
    proc = _start_run(script, out)
    try:
        out_text, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert "survived the finalizer" in out_text  # the path under test: dropped, sent again
    assert proc.returncode == code, err[-3000:]
    assert "Exception ignored" not in err and "Traceback" not in err
    notes = json.loads(out.read_text())["notes"]
    assert any(n.startswith(f"interrupted by {said}") for n in notes), notes


def test_the_sigterm_guard_puts_the_unraisable_hook_back_and_is_entered_once():
    from memkit.tracking.run import SignalGuard

    before = sys.unraisablehook
    guard = SignalGuard()
    with guard:
        assert sys.unraisablehook != before
        with pytest.raises(RuntimeError, match="entered once"):
            guard.__enter__()
    assert sys.unraisablehook is before
    with guard:  # again, after it exited
        pass
    assert sys.unraisablehook is before


def test_a_ctrl_c_dropped_just_before_the_script_ends_is_raised_at_its_end():
    """The KeyboardInterrupt Python dropped (printed as "Exception ignored" without the guard)
    would be sent again 0.2 s later; the script ends first: its end raises it."""
    from types import SimpleNamespace

    from memkit.tracking.run import SignalGuard

    with SignalGuard() as guard, pytest.raises(KeyboardInterrupt), guard.armed():
        sys.unraisablehook(SimpleNamespace(exc_value=KeyboardInterrupt(), object=None))
    with SignalGuard() as guard, guard.armed():  # nothing dropped: nothing raised
        pass


@pytest.mark.slow
def test_sigterm_dropped_just_before_the_script_ends_still_exits_143(tmp_path):
    """The dropped Terminated would be sent again 0.2 s later, but the script ends first: the
    run must not report success."""
    script = write(tmp_path, SIGTERM_IN_A_FINALIZER_AT_THE_END)
    result = subprocess.run(
        warm([sys.executable, "-m", "memkit", "run", "--device", "cpu", str(script)]),
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert "survived the finalizer" in result.stdout
    assert result.returncode == 143, result.stderr[-3000:]
    assert "memkit: interrupted by SIGTERM" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.slow
def test_ctrl_c_still_writes_the_report_and_exits_130_without_a_traceback(tmp_path):
    script = write(tmp_path, LOOP_FOREVER)
    out = tmp_path / "r.json"
    proc = _start_run(script, out)
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "step 3", "the script never reached step 3"
        for _ in range(5):  # as a user presses Ctrl-C again when one lands where Python drops it
            proc.send_signal(signal.SIGINT)
            try:
                _, err = proc.communicate(timeout=5)
                break
            except subprocess.TimeoutExpired:
                continue
        else:  # interrupted, still writing its report on a loaded machine
            _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 130, err[-3000:]
    data = json.loads(out.read_text())
    note = next(n for n in data["notes"] if n.startswith("interrupted by Ctrl-C"))
    assert re.match(r"interrupted by Ctrl-C at step \d+ \(train.py line \d+", note), note
    assert "memkit: interrupted by Ctrl-C at step" in err and "(exit 130)" in err
    assert "Traceback" not in err and "memkit/" not in err  # no frames of memkit's hooks


@pytest.mark.slow
def test_sigterm_still_writes_the_report_and_exits_143(tmp_path):
    script = write(tmp_path, LOOP_FOREVER)
    out, page = tmp_path / "r.json", tmp_path / "r.html"
    proc = _start_run(script, out, "--html", str(page))
    watchdog = threading.Timer(120, proc.kill)  # a hang fails the test instead of blocking it
    watchdog.start()
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "step 3", "the script never reached step 3"
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        watchdog.cancel()
        if proc.poll() is None:  # never leave it running (a loop that ignores SIGTERM spins)
            proc.kill()
            proc.communicate()
    assert proc.returncode == 143, err[-3000:]
    data = json.loads(out.read_text())
    note = next(n for n in data["notes"] if n.startswith("interrupted by SIGTERM"))
    match = re.match(r"interrupted by SIGTERM at step (\d+) \(train.py line \d+, in <module>\)",
                     note)  # fmt: skip
    assert match and int(match.group(1)) == data["steps"] >= 3, note
    assert data["devices"][0]["peak_allocated"] > 0
    assert "interrupted by SIGTERM at step" in page.read_text()
    assert f"memkit track: {data['steps']} step(s)" in err  # the full report on stderr
    assert "memkit: interrupted by SIGTERM at step" in err and "(exit 143)" in err
    assert "Traceback" not in err


def test_a_ctrl_c_sent_again_and_handled_by_the_script_is_not_raised_at_its_end():
    """The dropped KeyboardInterrupt is sent again as SIGINT; a script that catches it (to save
    a checkpoint, say) and ends normally must not get a second one from memkit at its end."""
    import time
    from types import SimpleNamespace

    from memkit.tracking.run import SignalGuard

    handled = []
    with SignalGuard() as guard, guard.armed():
        sys.unraisablehook(SimpleNamespace(exc_value=KeyboardInterrupt(), object=None))
        try:
            time.sleep(5)  # the SIGINT sent again lands here
        except KeyboardInterrupt:
            handled.append(True)
    assert handled == [True]
