"""``memkit inspect``: memkit's view of a PyTorch memory snapshot."""

from __future__ import annotations

import click

from memkit.cli.exits import handle_errors


@click.command("inspect")
@click.argument("file", type=click.Path(dir_okay=False))
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object on stdout.")
@click.option("--html", "html_path", default=None, type=click.Path(dir_okay=False),
              metavar="PATH", help="Also write a self-contained HTML page (no network, no "
              "scripts).")  # fmt: skip
@click.option("--top", type=click.IntRange(min=1), default=10, show_default=True,
              help="Largest allocations listed (at the end, and at the trace's peak).")  # fmt: skip
@handle_errors
def inspect_command(file: str, as_json: bool, html_path: str | None, top: int) -> None:
    """memkit's view of a PyTorch memory snapshot FILE.

    FILE is the pickle torch.cuda.memory._dump_snapshot() writes, from any run, or memkit run
    --memory-history's. Prints fragmentation (reserved vs allocated, split blocks, the largest
    free block), what is allocated by category at the end and at the trace's peak (guessed from
    the frames), the largest allocations with their frames, OOM events and advice. Exit codes:
    0 read; 2 not a snapshot (not a pickle, a pickle of something else, a protocol this Python
    cannot read) or a bad option. See docs/memory-history.md.

    \b
    memkit inspect mem.pickle
    memkit inspect mem.pickle --json > view.json
    memkit inspect mem.pickle --html view.html
    """
    from pathlib import Path

    from memkit.errors import ConfigError
    from memkit.inspection import inspect_snapshot

    if html_path == "-":
        raise ConfigError(
            "--html '-': expected a file name; stdout has the text view (or --json's object), "
            "so the page cannot go there, and '-' is not written as a file. Give a file "
            "(--html view.html)"
        )
    page = Path(html_path) if html_path else None
    if page is not None and not page.parent.is_dir():  # before reading a large file
        raise ConfigError(
            f"--html {html_path!r}: expected a file in an existing folder, but the folder "
            f"{str(page.parent)!r} does not exist; create it first or give another path"
        )
    result = inspect_snapshot(file, top=top)
    if page is not None:
        try:
            result.to_html(page)
        except OSError as exc:
            raise ConfigError(
                f"--html {html_path!r}: could not write the page ({exc.strerror or exc})"
            ) from None
    click.echo(result.to_json() if as_json else str(result))
