"""Real processes for the tests, started from a warm interpreter (a fork server).

A test that needs a process of its own (a signal, an exit code, torchrun's ranks) would pay a
fresh interpreter's start-up each time: ``import torch`` and ``torch._dynamo``, which torch
imports at the first optimizer it builds (``Optimizer.add_param_group`` is wrapped by
``torch._disable_dynamo``): about 4.5 s of CPU on a small machine, more than most scenarios
run. The server here imports them once and forks a child for each command.

:func:`warm_command` turns a command (``python -m memkit run ...``, ``python script.py``,
``memkit ...``, ``torchrun ...``) into one that runs through the server, for
``subprocess.Popen``/``subprocess.run`` as before: what starts is a small proxy (Python with
no site packages, a few milliseconds) that hands its working directory, environment, argv and
standard streams to the server, forwards the signals it receives to the child, and exits as
the child did (its code, or killed by the same signal). The child runs the command in a fresh
``__main__`` and ends as a fresh interpreter would: threads joined, ``atexit``, ``__main__``'s
globals cleared, the streams flushed, the exit status of an uncaught ``KeyboardInterrupt``
(tests/test_warm_processes.py compares). What differs from a fresh process: the modules
imported ahead (so never use it to check what a command imports), interpreter flags other
than ``-u``, and the hash seed (the server's, for every child). When the proxy dies (a test
killed it after a hang), the server kills the child's process group; without a server to talk
to, the proxy becomes the command itself.

One server per test run: the first pytest process that needs it starts it (a file lock in
the run's folder, as the shared rank launch does); it exits when the run's main pytest process
does. ``MEMKIT_TESTS_COLD=1`` runs every command as it is, cold, to compare.

This file is also the server (``python warm_processes.py serve SOCKET WATCHED_PID``) and the
proxy (``python -I -S warm_processes.py SOCKET COMMAND...``): standard library imports only.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import signal
import socket
import struct
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve()
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1,
             signal.SIGUSR2)  # fmt: skip
PRELOAD = (
    "torch", "torch._dynamo", "torch.distributed", "torch.distributed.run",
    "torch.distributed.fsdp", "memkit.cli", "memkit.tracking", "memkit.probing", "runpy",
    "importlib.metadata",
)  # fmt: skip


# -- in the tests' process ---------------------------------------------------------------------

_socket: list[str | None] = []  # the server's socket, once known (None: run cold)
_started: list[subprocess.Popen[bytes]] = []
_BASE_PATH: list[str] = []  # in the server: its sys.path, less its own folder


def warm_command(command: list[str], run_folder: Path) -> list[str]:
    """``command`` run through the run's server (started if none is): ``python -m M``,
    ``python SCRIPT``, ``python -c CODE`` or a console script's name (``memkit``,
    ``torchrun``); ``run_folder`` is shared by the run's pytest processes."""
    if not _socket:
        _socket.append(None if os.environ.get("MEMKIT_TESTS_COLD") else _server(run_folder))
    if _socket[0] is None:
        return command
    return [sys.executable, "-I", "-S", str(HERE), _socket[0], *command]


def warm_entrypoint(command: list[str], run_folder: Path) -> list[str]:
    """torchrun's arguments after its options that start each rank's ``command`` warm:
    ``PROXY SOCKET COMMAND...``, which torchrun runs as ``python -u PROXY ...`` (cold:
    ``--no-python COMMAND...``)."""
    warm = warm_command(command, run_folder)
    return ["--no-python", *command] if warm is command else warm[3:]


def _server(run_folder: Path) -> str | None:
    """The socket of the run's server, starting it unless another process of the run did."""
    if not hasattr(os, "fork") or not hasattr(socket, "AF_UNIX"):
        return None
    run_folder.mkdir(parents=True, exist_ok=True)
    path = run_folder / "warm.sock"
    if len(str(path)) > 100:  # an AF_UNIX path is at most 108 bytes
        return None
    with open(run_folder / "warm.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not path.exists():
            # the run's main process: an xdist worker's parent, else this one
            watched = os.getppid() if "PYTEST_XDIST_WORKER" in os.environ else os.getpid()
            server = subprocess.Popen(
                [sys.executable, str(HERE), "serve", str(path), str(watched)],
                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, start_new_session=True,
            )  # fmt: skip
            assert server.stdout is not None
            if server.stdout.readline().strip() != b"ready":
                server.kill()
                raise RuntimeError("the tests' process server did not start")
            _started.append(server)  # it outlives this process's tests, not its object
    return str(path)


# -- the server ----------------------------------------------------------------------------------


def serve(path: str, watched: int) -> dict[str, Any] | None:
    """Fork a child for each request until ``watched`` exits. Returns the request in the child
    (which runs it at the top level), ``None`` in the server when it is done."""
    for name in PRELOAD:
        __import__(name)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    listener.settimeout(0.02)
    sys.stdout.write("ready\n")
    sys.stdout.flush()
    children: dict[int, socket.socket] = {}  # child pid -> its proxy's connection
    in_child = False
    try:
        while _alive(watched):
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                conn = None
            if conn is not None:
                try:
                    conn.settimeout(10)
                    request, fds = _receive(conn)
                except (OSError, ValueError, struct.error):  # a proxy gone mid-request
                    conn.close()
                    continue
                pid = os.fork()
                if pid == 0:
                    in_child = True
                    listener.close()
                    for other in (conn, *children.values()):
                        other.close()
                    _become(request, fds)
                    return request
                for fd in fds:
                    os.close(fd)
                children[pid] = conn
                try:
                    conn.settimeout(None)
                    conn.sendall(b"%d\n" % pid)
                except OSError:  # the proxy is gone: its child is stopped below
                    pass
            _reap(children)
    finally:
        if not in_child:
            for pid in children:
                _kill_group(pid)
            with contextlib.suppress(OSError):
                os.unlink(path)
    return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _reap(children: dict[int, socket.socket]) -> None:
    """Send each exited child's wait status to its proxy; kill the children whose proxy is
    gone (killed by a test after a hang)."""
    while children:
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid == 0:
            break
        conn = children.pop(pid, None)
        if conn is not None:
            with contextlib.suppress(OSError):
                conn.sendall(b"%d\n" % status)
            conn.close()
    for pid, conn in list(children.items()):
        conn.setblocking(False)
        try:
            gone = conn.recv(1) == b""
        except BlockingIOError:
            gone = False
        except OSError:
            gone = True
        conn.setblocking(True)
        if gone:
            _kill_group(pid)


def _kill_group(pid: int) -> None:
    with contextlib.suppress(OSError):
        os.killpg(pid, signal.SIGKILL)


def _receive(conn: socket.socket) -> tuple[dict[str, Any], list[int]]:
    head, fds, _, _ = socket.recv_fds(conn, 4, 3)
    (size,) = struct.unpack("!I", head)
    body = b""
    while len(body) < size:
        chunk = conn.recv(size - len(body))
        if not chunk:
            raise ConnectionError("the proxy closed its connection mid-request")
        body += chunk
    return json.loads(body), fds


def _become(request: dict[str, Any], fds: list[int]) -> None:
    """In the child: take the proxy's process, as far as a fork can (a process group of its
    own, so that the server can stop it and what it starts)."""
    os.setpgid(0, 0)
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
    for fd in set(fds):
        if fd > 2:
            os.close(fd)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    extra = [p for p in request["env"].get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.path[:] = [request["path0"], *extra, *_BASE_PATH]
    sys.argv[:] = request["argv"]
    threads = request["env"].get("OMP_NUM_THREADS", "")
    torch = sys.modules.get("torch")
    if torch is not None and threads.isdigit() and int(threads) > 0:
        torch.set_num_threads(int(threads))  # a fork starts torch's pool anew, at its default
    unbuffered = request.get("unbuffered", False) or bool(request["env"].get("PYTHONUNBUFFERED"))
    sys.stdin = sys.__stdin__ = _stream(0, "r", False, False)
    sys.stdout = sys.__stdout__ = _stream(1, "w", os.isatty(1), unbuffered)
    sys.stderr = sys.__stderr__ = _stream(2, "w", True, unbuffered)


def _stream(fd: int, mode: str, line: bool, through: bool) -> Any:
    """A standard stream as Python makes it at start-up."""
    import io

    raw = io.FileIO(fd, mode, closefd=False)
    buffered = io.BufferedReader(raw) if mode == "r" else io.BufferedWriter(raw)
    errors = "backslashreplace" if fd == 2 else "strict"
    return io.TextIOWrapper(
        buffered, encoding="utf-8", errors=errors, line_buffering=line, write_through=through
    )


def run_request(request: dict[str, Any]) -> None:
    """Run the command in this (forked) interpreter and end as ``python ...`` ends: the
    threads joined, ``atexit`` run, ``__main__``'s globals cleared (their ``__del__`` run),
    the streams flushed, an uncaught exception printed (exit 1), an uncaught
    ``KeyboardInterrupt`` ending by SIGINT. Other modules are not torn down one by one: that
    would write to every page of the heap shared with the server (a second of copying here)."""
    import atexit
    import threading

    code = 0
    interrupted = False
    try:
        _run(request["kind"], request["target"])
    except SystemExit as exc:
        if exc.code is None or isinstance(exc.code, int):
            code = exc.code or 0
        else:
            print(exc.code, file=sys.stderr)
            code = 1
    except BaseException as exc:
        tb = exc.__traceback__
        while tb is not None and _ours(tb.tb_frame.f_code.co_filename):
            tb = tb.tb_next  # this file's and runpy's frames: a fresh interpreter has none
        sys.excepthook(type(exc), exc.with_traceback(tb), tb)
        interrupted, code = isinstance(exc, KeyboardInterrupt), 1
    threading._shutdown()  # type: ignore[attr-defined]
    atexit._run_exitfuncs()
    main = sys.modules["__main__"].__dict__
    for name in [n for n in main if n.startswith("_") and n != "__builtins__"] + list(main):
        if name != "__builtins__":  # as Python clears a module at its end: _names first
            main[name] = None
    for stream in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__):
        try:
            if stream is not None:
                stream.flush()
        except Exception:
            code = code or 120  # as Python does when it cannot flush at exit
    if interrupted:
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    os._exit(code)


def _ours(filename: str) -> bool:
    return filename == str(HERE) or "runpy" in filename


def _run(kind: str, target: str) -> None:
    """Run the command in a fresh ``__main__`` module, as ``python`` would."""
    import builtins
    import runpy
    import types

    main = types.ModuleType("__main__")
    main.__dict__["__builtins__"] = builtins
    sys.modules["__main__"] = main
    if kind == "module":
        runpy._run_module_as_main(target)  # type: ignore[attr-defined]  # python -m's own
    elif kind == "script":
        try:
            with open(target, "rb") as f:
                source = f.read()
        except OSError as exc:
            print(f"{sys.executable}: can't open file {target!r}: [Errno {exc.errno}] "
                  f"{exc.strerror}", file=sys.stderr)  # fmt: skip
            sys.exit(2)
        main.__dict__.update(__file__=target, __cached__=None)
        exec(compile(source, target, "exec"), main.__dict__)
    elif kind == "code":
        exec(compile(target, "<string>", "exec"), main.__dict__)
    else:  # a console script
        from importlib.metadata import entry_points

        found = list(entry_points(group="console_scripts", name=target))
        if not found:  # what a shell says of a command it cannot find
            where = f"{target!r} is installed for {sys.executable}"
            print(f"warm_processes: no console script {where} (pip install -e .)", file=sys.stderr)
            sys.exit(127)
        sys.exit(found[0].load()())


# -- the proxy -----------------------------------------------------------------------------------


def _request(command: list[str]) -> dict[str, Any]:
    """What to run for ``command``, in the server's terms."""
    cwd = os.getcwd()
    name = os.path.basename(command[0])
    if name.startswith("python"):
        args = command[1:]
        if args[:1] == ["-m"]:
            return {"kind": "module", "target": args[1], "argv": [args[1], *args[2:]],
                    "path0": cwd}  # fmt: skip
        if args[:1] == ["-c"]:
            return {"kind": "code", "target": args[1], "argv": ["-c", *args[2:]], "path0": ""}
        unbuffered = args[:1] == ["-u"]  # torchrun's way of starting a script
        if unbuffered:
            args = args[1:]
        if not args or args[0].startswith("-"):
            raise SystemExit(f"warm_processes: unsupported python command {command}")
        script = os.path.abspath(args[0])
        return {"kind": "script", "target": script, "argv": [args[0], *args[1:]],
                "path0": os.path.dirname(script), "unbuffered": unbuffered}  # fmt: skip
    where = os.path.join(os.path.dirname(sys.executable), name)
    return {"kind": "console", "target": name, "argv": [where, *command[1:]],
            "path0": os.path.dirname(where)}  # fmt: skip


def proxy(path: str, command: list[str]) -> None:
    """Run ``command`` in a child of the server as this process, and end as it ends; without
    a server to talk to, become the command itself (cold)."""
    request = _request(command)
    request["cwd"], request["env"] = os.getcwd(), dict(os.environ)
    body = json.dumps(request).encode()
    # a signal that comes before the child's pid is known waits, then goes to the child
    signal.pthread_sigmask(signal.SIG_BLOCK, FORWARDED)
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.connect(path)
        socket.send_fds(conn, [struct.pack("!I", len(body))], [0, 1, 2])
        conn.sendall(body)
        reader = conn.makefile("rb")
        child = int(reader.readline())
    except (OSError, ValueError):
        signal.pthread_sigmask(signal.SIG_UNBLOCK, FORWARDED)
        os.execvp(command[0], command)

    def forward(signum: int, frame: Any) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(child, signum)

    for signum in FORWARDED:
        signal.signal(signum, forward)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, FORWARDED)
    line = reader.readline()
    if not line:
        raise SystemExit(f"warm_processes: the server lost the child {child}")
    code = os.waitstatus_to_exitcode(int(line))
    if code < 0:  # killed by a signal: so is this process
        if -code not in (signal.SIGKILL, signal.SIGSTOP):
            signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
        time.sleep(1)
    os._exit(code)


if __name__ == "__main__":
    if sys.argv[1] == "serve":
        _BASE_PATH[:] = sys.path[1:]  # not this folder: the tests are no modules of the child
        sys.path[:] = _BASE_PATH
        _request_in_child = serve(sys.argv[2], int(sys.argv[3]))
        if _request_in_child is not None:
            del _request_in_child["env"]
            run_request(_request_in_child)
    else:
        proxy(sys.argv[1], sys.argv[2:])
