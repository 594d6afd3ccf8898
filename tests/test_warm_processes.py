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
    "argv and path": "import os, sys\nprint(sys.argv[1:], sys.path[0] == os.getcwd())\n",
}


@pytest.mark.parametrize("ending", list(ENDINGS))
def test_a_warm_process_ends_as_a_cold_one(tmp_path: Path, ending: str) -> None:
    script = tmp_path / "script.py"
    script.write_text(ENDINGS[ending])
    command = [sys.executable, str(script), "a b", "c"]
    cold = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=60)
    hot = subprocess.run(warm(command), cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert warm(command) != command, "the server did not start: nothing compared"
    assert (hot.returncode, hot.stdout, hot.stderr) == (cold.returncode, cold.stdout, cold.stderr)


@pytest.mark.parametrize("how", ["-m", "-c"])
def test_a_module_and_code_run_as_from_a_cold_python(tmp_path: Path, how: str) -> None:
    code = "import os, sys\nprint(__name__, sys.argv, sys.path[0] in ('', os.getcwd()))\n"
    (tmp_path / "mod.py").write_text(code)
    command = [sys.executable, how, "mod" if how == "-m" else code, "x"]
    cold = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=60)
    hot = subprocess.run(warm(command), cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert (hot.returncode, hot.stdout, hot.stderr) == (cold.returncode, cold.stdout, cold.stderr)
    assert cold.returncode == 0 and "__main__" in cold.stdout


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
