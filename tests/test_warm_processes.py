"""The tests' warm processes (tests/warm_processes.py) end as fresh ones do: the same exit
code, output and signal status for each way a script can end. Compared with the same script
started cold (these scripts import nothing heavy, so the cold run is cheap)."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from conftest import warm

ENDINGS = {
    "exit code": "import sys\nprint('out')\nsys.exit(3)\n",
    "exit message": "import sys\nsys.exit('bye')\n",
    "exception": "def f():\n    raise ValueError('boom')\nf()\n",
    "keyboard interrupt": "raise KeyboardInterrupt\n",
    "atexit and finalizer": textwrap.dedent(
        """
        import atexit, weakref
        class Box:
            pass
        box = Box()
        weakref.finalize(box, print, "finalized")
        atexit.register(print, "at exit")
        print("end of script", end="")
        """
    ),
    "non-daemon thread": textwrap.dedent(
        """
        import threading, time
        threading.Thread(target=lambda: (time.sleep(0.2), print("thread done"))).start()
        """
    ),
    "killed by a signal": "import os, signal\nos.kill(os.getpid(), signal.SIGTERM)\n",
    "killed by SIGKILL": "import os\nprint('before', flush=True)\nos.kill(os.getpid(), 9)\n",
    "__del__ at the end": textwrap.dedent(
        """
        class Noisy:
            def __del__(self):
                print("del ran")
        noisy = Noisy()
        print("end")
        """
    ),
    "stdout replaced": textwrap.dedent(
        """
        import io, sys
        sys.stdout.write("to the original stdout")
        sys.stdout = io.StringIO()
        """
    ),
    "argv and path": "import os, sys\nprint(sys.argv[1:], sys.path[0] == os.getcwd())\n",
}


@pytest.mark.parametrize("ending", list(ENDINGS))
def test_a_warm_process_ends_as_a_cold_one(tmp_path: Path, ending: str) -> None:
    script = tmp_path / "script.py"
    script.write_text(ENDINGS[ending])
    command = [sys.executable, str(script), "a b", "c"]
    _compare(command, tmp_path)


def test_a_missing_script_is_said_as_python_says_it(tmp_path: Path) -> None:
    _compare([sys.executable, str(tmp_path / "missing.py")], tmp_path)


def _compare(command: list[str], cwd: Path) -> None:
    if warm(command) is command:
        pytest.skip("processes start cold (MEMKIT_TESTS_COLD, or no fork server here)")
    cold = subprocess.run(command, cwd=cwd, capture_output=True, text=True, timeout=60)
    hot = subprocess.run(warm(command), cwd=cwd, capture_output=True, text=True, timeout=60)
    assert (hot.returncode, hot.stdout, hot.stderr) == (cold.returncode, cold.stdout, cold.stderr)


@pytest.mark.parametrize("how", ["-m", "-c"])
def test_a_module_and_code_run_as_from_a_cold_python(tmp_path: Path, how: str) -> None:
    code = "import os, sys\nprint(__name__, sys.argv, sys.path[0] in ('', os.getcwd()))\n"
    (tmp_path / "mod.py").write_text(code)
    _compare([sys.executable, how, "mod" if how == "-m" else code, "x"], tmp_path)


def test_a_signal_to_the_proxy_reaches_the_child(tmp_path: Path) -> None:
    script = tmp_path / "wait.py"
    script.write_text(
        "import os, signal, sys, time\n"
        "signal.signal(signal.SIGTERM, lambda *a: (os.write(1, b'terminated\\n'), sys.exit(7)))\n"
        "print('ready', flush=True)\n"
        "time.sleep(60)\n"
    )
    proc = subprocess.Popen(
        warm([sys.executable, str(script)]), stdout=subprocess.PIPE, text=True, cwd=tmp_path
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert (proc.returncode, out) == (7, "terminated\n")
