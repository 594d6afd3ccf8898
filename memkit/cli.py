"""The ``memkit`` command line: thin click commands that parse, call, render and exit.

Exit codes: 0 success; 1 does not fit (even the minimum); 2 usage, configuration or model-file
error; 3 the user's code raised an error that is not an OOM; 4 a distributed failure. A
:class:`~memkit.errors.MemkitError` becomes one line on stderr (``memkit: error: ...``).
torch is imported inside command bodies only, so ``memkit --help`` stays fast.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import Any, TypeVar

import click

from memkit import __version__
from memkit.errors import MemkitError

F = TypeVar("F", bound=Callable[..., Any])


def handle_errors(func: F) -> F:
    """Turn a MemkitError into one line on stderr and its exit code."""

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return func(*args, **kwargs)
        except MemkitError as exc:
            click.echo(f"memkit: error: {exc}", err=True)
            sys.exit(exc.exit_code)

    return wrapper  # type: ignore[return-value]


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="memkit")
def cli() -> None:
    """Measure, explain and fix PyTorch out-of-memory errors.

    \b
    memkit probe model.py      largest batch that fits, exactly
    memkit run train.py        memory per device, module and phase while a script trains
    memkit snapshot            what is on every device right now
    memkit estimate model.py   will it fit on a GPU you do not have?
    """


def main(argv: list[str] | None = None) -> None:
    """Console-script entry point."""
    cli.main(args=argv, prog_name="memkit")


def _stdout_is_tty() -> bool:
    """Whether stdout is a terminal (watch mode then redraws in place)."""
    isatty = getattr(sys.stdout, "isatty", None)
    return bool(isatty and isatty())


@cli.command("snapshot")
@click.option("--json", "as_json", is_flag=True,
              help="Print JSON (in watch mode: one object per line per reading).")  # fmt: skip
@click.option("--watch", type=click.FloatRange(min=0), default=None, metavar="SECONDS",
              help="Read again every SECONDS: refreshes in place on a terminal, else prints one "
              "line per device per reading.")  # fmt: skip
@click.option("--count", type=click.IntRange(min=1), default=None, metavar="N",
              help="Stop after N readings (alone, it implies --watch 1).")  # fmt: skip
@handle_errors
def snapshot_command(as_json: bool, watch: float | None, count: int | None) -> None:
    """What is on every device right now: memory, peaks, utilisation, host RAM.

    Devices are listed in CUDA index order. Values that cannot be read say why (no GPU,
    nvidia-smi missing...). See docs/snapshot.md.
    """
    import time

    from memkit.snapshots import snapshot

    if watch is None and count is None:
        snap = snapshot()
        click.echo(snap.to_json() if as_json else str(snap))
        return
    interval = 1.0 if watch is None else watch
    tty = _stdout_is_tty() and not as_json
    ticks = 0
    next_at = time.monotonic()
    try:
        while count is None or ticks < count:
            if ticks:
                next_at += interval
                time.sleep(max(0.0, next_at - time.monotonic()))
            snap = snapshot()
            ticks += 1
            if as_json:
                click.echo(snap.to_json(indent=None))
            elif tty:  # cursor home, redraw, clear what the previous frame left below
                lines = str(snap).splitlines()
                home = "\x1b[2J\x1b[H" if ticks == 1 else "\x1b[H"
                frame = "\n".join(f"{line}\x1b[K" for line in lines)
                click.echo(home + frame + "\x1b[J", color=True)
            else:
                for line in snap.watch_lines():
                    click.echo(line)
    except KeyboardInterrupt:
        pass


@cli.command(
    "run",
    context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False},
)
@click.option("--device", default=None, help="cuda:N, or cpu (simulated). Default: current GPU.")
@click.option("--budget", default=None, help="Simulated device size (cpu), or a cap: 300MiB.")
@click.option("--json", "json_path", default=None, type=click.Path(dir_okay=False),
              help="Write the report as JSON (torchrun: NAME.rankN.json per rank).")  # fmt: skip
@click.option("--html", "html_path", default=None, type=click.Path(dir_okay=False),
              help="Write a self-contained HTML report (no network, no scripts).")  # fmt: skip
@click.option("--per-module/--steps-only", default=True,
              help="Hooks on every module (default), or only at step boundaries.")  # fmt: skip
@click.argument("script", type=click.Path(dir_okay=False))
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
@handle_errors
def run_command(
    device: str | None,
    budget: str | None,
    json_path: str | None,
    html_path: str | None,
    per_module: bool,
    script: str,
    args: tuple[str, ...],
) -> None:
    """Run a training SCRIPT under memory tracking; print the report (and OOM post-mortem).

    The script runs as __main__ with its own ARGS and keeps its exit code (an OOM exits 1,
    another error 3). The report goes to stderr; stdout is the script's.

    \b
    memkit run train.py --epochs 1
    memkit run --device cpu --budget 300MiB train.py
    torchrun --nproc-per-node 2 --no-python memkit run train.py
    """
    from memkit.track.run import rank_path, rank_prefix, run_script

    outcome = run_script(script, list(args), device=device, budget=budget, per_module=per_module)
    prefix = rank_prefix()
    if outcome.traceback:
        click.echo(outcome.traceback.rstrip("\n"), err=True)
    click.echo("\n".join(prefix + line for line in str(outcome.report).splitlines()), err=True)
    if json_path:
        outcome.report.to_json(rank_path(json_path))
    if html_path:
        outcome.report.to_html(rank_path(html_path))
    sys.exit(outcome.exit_code)
