"""``memkit snapshot``: what is on every device right now, once or watched."""

from __future__ import annotations

import sys

import click

from memkit.cli.exits import handle_errors


def _stdout_is_tty() -> bool:
    """Whether stdout is a terminal (watch mode then redraws in place)."""
    isatty = getattr(sys.stdout, "isatty", None)
    return bool(isatty and isatty())


@click.command("snapshot")
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
        if tty:
            click.echo("")  # leave the prompt below the last frame
        raise  # handle_errors: memkit: interrupted, exit 130
