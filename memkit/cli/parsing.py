"""Click callbacks that parse the commands' option values (a bad value: exit 2, naming it)."""

from __future__ import annotations

import click

from memkit.errors import MemkitError


def _parse_margin(_ctx: click.Context, _param: click.Parameter, value: str | None) -> float | None:
    if value is None:
        return None
    text = value.strip().rstrip("%")
    try:
        pct = float(text)
    except ValueError:
        raise click.BadParameter(
            f"expected a percentage such as 5 or 5%, found {value!r}"
        ) from None
    if not 0 <= pct < 100:
        raise click.BadParameter(f"expected a percentage in [0, 100), found {value!r}")
    if 0 < pct < 1 and not value.strip().endswith("%"):
        raise click.BadParameter(
            f"{value!r} is a percentage here ({pct}%), and reads like a fraction (the Python "
            f"API's margin={value} is {pct * 100:g}%): write {pct * 100:g} or {pct * 100:g}% "
            f"for that, or {value}% for a margin below 1%"
        )
    return pct / 100


def _parse_modes(_ctx: click.Context, _param: click.Parameter, value: str) -> list[str]:
    modes = [part.strip() for part in value.split(",") if part.strip()]
    if (
        not modes
        or any(m not in ("train", "infer") for m in modes)
        or len(set(modes)) != len(modes)
    ):
        raise click.BadParameter(f"expected train, infer or train,infer, found {value!r}")
    return modes


def _parse_seq_lens(
    _ctx: click.Context, _param: click.Parameter, value: str | None
) -> list[int] | None:
    if value is None:
        return None
    try:
        lengths = [int(part) for part in value.split(",") if part.strip()]
    except ValueError:
        raise click.BadParameter(f"expected L or L1,L2,... (integers), found {value!r}") from None
    if not lengths or any(n < 1 for n in lengths):
        raise click.BadParameter(f"expected positive sequence lengths, found {value!r}")
    once = list(dict.fromkeys(lengths))
    if len(once) != len(lengths):
        twice = sorted({n for n in lengths if lengths.count(n) > 1})
        raise click.BadParameter(
            f"each length once, found {value!r} ({', '.join(map(str, twice))} more than once): "
            f"give {','.join(map(str, once))}"
        )
    return lengths


def _parse_size_option(
    _ctx: click.Context, _param: click.Parameter, value: str | None
) -> int | None:
    if value is None:
        return None
    from memkit.units import parse_size

    try:
        return parse_size(value)
    except MemkitError as exc:
        raise click.BadParameter(str(exc)) from None


def check_batch_range(min_batch: int, max_batch: int | None) -> None:
    """A usage error (exit 2) when ``--max-batch`` is below ``--min-batch``."""
    if max_batch is not None and max_batch < min_batch:
        raise click.BadParameter(
            f"--max-batch ({max_batch}) must be at least --min-batch ({min_batch})"
        )


def reject_mistyped_option(ctx: click.Context, value: str) -> None:
    """A usage error (exit 2, with click's "Did you mean") when ``value``, taken for a
    command's positional argument, is an option the command does not have: ``memkit run
    --budjet 64MiB train.py`` must not look for a script named ``--budjet``. A file of that
    name still counts as the argument (``./-odd.py`` always does)."""
    import difflib
    from pathlib import Path

    if not value.startswith("-") or value == "-" or Path(value).is_file():
        return
    name = value.split("=", 1)[0]
    options = [o for p in ctx.command.get_params(ctx) for o in (*p.opts, *p.secondary_opts)]
    close = difflib.get_close_matches(name, [o for o in options if o.startswith("--")], n=3)
    raise click.NoSuchOption(name, possibilities=close, ctx=ctx)
