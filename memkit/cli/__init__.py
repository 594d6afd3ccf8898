"""The ``memkit`` command line: thin click commands that parse, call, render and exit.

Exit codes: 0 success; 1 does not fit (even the minimum); 2 usage, configuration or model-file
error; 3 the user's code raised an error that is not an OOM, or memkit itself failed; 4 a
distributed failure; 130 interrupted (Ctrl-C). A :class:`~memkit.errors.MemkitError` becomes one
line on stderr (``memkit: error: ...``); any other exception escaping a command is memkit's own
failure: one line naming it (``memkit: internal error: ...``), exit 3, never 1 ("does not fit").
torch is imported inside command bodies only, so ``memkit --help`` stays fast.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
import traceback
import warnings
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import click

from memkit import __version__
from memkit.errors import MemkitError

F = TypeVar("F", bound=Callable[..., Any])

EXIT_INTERNAL = 3
"""memkit itself failed (an exception that is neither a MemkitError nor the user's)."""
EXIT_INTERRUPTED = 130
"""Ctrl-C (128 + SIGINT), as a shell reports it."""


def handle_errors(func: F) -> F:
    """Turn a MemkitError into one line on stderr and its exit code; Ctrl-C into exit 130
    (``memkit: interrupted``); any other exception into one line naming it and exit 3 (set
    ``MEMKIT_TRACEBACK=1`` for its traceback). Never exit 1 for these: 1 means "does not fit".
    """

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return func(*args, **kwargs)
        except MemkitError as exc:
            click.echo(f"memkit: error: {exc}", err=True)
            sys.exit(exc.exit_code)
        except KeyboardInterrupt:
            click.echo("memkit: interrupted", err=True)
            sys.exit(EXIT_INTERRUPTED)
        except (click.exceptions.ClickException, click.exceptions.Abort, click.exceptions.Exit):
            raise
        except Exception as exc:
            if os.environ.get("MEMKIT_TRACEBACK"):
                click.echo(traceback.format_exc().rstrip(), err=True)
            cause = str(exc).strip().splitlines()
            click.echo(
                f"memkit: internal error: {type(exc).__name__}"
                + (f": {cause[0][:300]}" if cause else "")
                + " (a failure in memkit itself, not in your code; MEMKIT_TRACEBACK=1 shows "
                "where; please report it)",
                err=True,
            )
            sys.exit(EXIT_INTERNAL)

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
    memkit inspect mem.pickle  memkit's view of a PyTorch memory snapshot
    """


def main(argv: list[str] | None = None) -> None:
    """Console-script entry point."""
    # torch warns at import when NumPy is absent; memkit does not need NumPy.
    warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
    cli.main(args=argv, prog_name="memkit")


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
    return lengths


@cli.command()
@click.argument("file", type=click.Path(dir_okay=False))
@click.option("--mode", callback=_parse_modes, default="train", show_default=True,
              help="train, infer, or train,infer for both in one run (evaluation has no "
              "gradients or optimizer state, so its batch can be larger).")  # fmt: skip
@click.option("--device", default=None, help="cuda, cuda:N, cpu (simulated)... [default: the "
              "current accelerator, else cpu]")  # fmt: skip
@click.option("--budget", default=None, help="Memory cap, e.g. 8GiB. On cpu: the simulated "
              "device's size, at most the available RAM [default: 1GiB, or half the available "
              "RAM if less].")  # fmt: skip
@click.option("--min-batch", type=click.IntRange(min=1), default=1, show_default=True)
@click.option("--max-batch", type=click.IntRange(min=1), default=None)
@click.option("--steps", type=click.IntRange(min=1), default=2, show_default=True,
              help="Full steps per trial (optimizer state appears on the first).")  # fmt: skip
@click.option("--margin", callback=_parse_margin, default=None,
              help="Capacity the recommended batch leaves free, in percent "
              "[default: 5].")  # fmt: skip
@click.option("--target-batch", type=click.IntRange(min=1), default=None,
              help="Effective batch you want: advises gradient accumulation.")  # fmt: skip
@click.option("--seq-len", callback=_parse_seq_lens, default=None,
              help="Sequence length(s) for make_batch(batch_size, seq_len): "
              "128,512,2048.")  # fmt: skip
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object on stdout.")
@click.option("--ddp", is_flag=True, help="Under torchrun: wrap the model in "
              "DistributedDataParallel for the trials (its buckets and all-reduce are "
              "measured).")  # fmt: skip
@click.option("--timeout", type=click.FloatRange(min=0, min_open=True), default=None,
              metavar="SECONDS", help="Under torchrun: how long a rank waits for the others "
              "before failing (exit 4) [default: 1800].")  # fmt: skip
@click.option("--dist-backend", default=None, metavar="NAME", help="Under torchrun: the "
              "process group's backend [default: nccl on cuda, else gloo; gloo puts several "
              "ranks on one GPU].")  # fmt: skip
@click.option("--gpus", type=click.IntRange(min=2), default=None, help="With --strategies: "
              "this many virtual GPUs of --budget each (--device cpu).")  # fmt: skip
@click.option("--strategies", default=None, metavar="dp,ddp", help="Compare DataParallel and "
              "DDP on --gpus virtual GPUs: largest global batch and per-device peaks "
              "(docs/distributed.md).")  # fmt: skip
@handle_errors
def probe(
    file: str,
    mode: list[str],
    device: str | None,
    budget: str | None,
    min_batch: int,
    max_batch: int | None,
    steps: int,
    margin: float | None,
    target_batch: int | None,
    seq_len: list[int] | None,
    as_json: bool,
    ddp: bool,
    timeout: float | None,
    dist_backend: str | None,
    gpus: int | None = None,
    strategies: str | None = None,
) -> None:
    """Find the largest batch size of a model file that fits, exactly.

    FILE defines build_model() and make_batch(batch_size), and optionally build_optimizer,
    loss_fn and train_step (see docs/probe.md). Exit codes: 0 found, 1 even --min-batch does
    not fit, 2 usage or model-file error, 3 the step raised an error that is not an OOM (or
    memkit failed), 4 a rank failed or timed out, 130 interrupted. With --json, stdout is one
    JSON object: what the model file prints goes to stderr.

    \b
    Under torchrun every rank probes its own device (cuda:LOCAL_RANK, or a simulated cpu
    device) and the ranks agree on one size that fits on all; rank 0 prints the report:
      torchrun --nproc-per-node 2 --no-python memkit probe model.py --ddp
      torchrun --nproc-per-node 2 --no-python memkit probe model.py --device cpu \\
          --budget 1GiB,512MiB
    """
    if gpus is not None or strategies is not None:
        _compare(
            file, gpus, strategies, budget, device=device or "cpu", max_batch=max_batch,
            seq_len=seq_len, as_json=as_json, steps=steps,
            ignored={"--mode": mode != ["train"], "--min-batch": min_batch != 1,
                     "--margin": margin is not None, "--target-batch": target_batch is not None,
                     "--ddp": ddp, "--timeout": timeout is not None,
                     "--dist-backend": dist_backend is not None},
        )  # fmt: skip
        return
    from memkit import distributed
    from memkit.probing.result import ProbeModes, ProbeResult
    from memkit.probing.runner import DEFAULT_MARGIN, probe_file

    if max_batch is not None and max_batch < min_batch:
        raise click.BadParameter(
            f"--max-batch ({max_batch}) must be at least --min-batch ({min_batch})"
        )
    world, me = distributed.world_size(), distributed.rank()
    on_host = _host_budgets(budget, world, me)
    budget = _rank_budget(budget, world, me)
    device = _rank_device(device, world, distributed.local_rank())
    backend = _check_target(device, budget, on_host)  # before the model file loads: exit 2
    if backend.device.type == "meta":
        from memkit.errors import ConfigError

        raise ConfigError(
            "--device meta: probe runs real steps and measures them; meta tensors hold no data. "
            "Use memkit estimate FILE --device-memory SIZE for meta-device estimates, or "
            "--device cpu --budget SIZE for a simulated device that runs the steps"
        )
    rank_device = backend.device if world > 1 else "cpu"
    wait = timeout if timeout is not None else (1800.0 if world > 1 else None)
    with (
        distributed.process_group_from_env(rank_device, backend=dist_backend, timeout=wait),
        _user_output_to_stderr(),
    ):
        per_mode = [
            probe_file(
                file,
                seq_len=seq_len,
                device=device,
                mode=one,
                budget=budget,
                min_batch=min_batch,
                max_batch=max_batch,
                steps=steps,
                margin=DEFAULT_MARGIN if margin is None else margin,
                target_batch=target_batch if one == "train" else None,
                progress=me == 0 and not as_json and _stderr_is_terminal(),
                ddp=ddp,
                timeout=wait,
            )
            for one in mode
        ]
    result = per_mode[0] if len(per_mode) == 1 else ProbeModes(tuple(per_mode))
    if me == 0:
        click.echo(result.to_json() if as_json else str(result))
    results = [
        r for one in per_mode for r in ([one] if isinstance(one, ProbeResult) else one.results)
    ]
    if any(r.max_batch_size is None for r in results):
        sys.exit(1)


@contextlib.contextmanager
def _user_output_to_stderr() -> Iterator[None]:
    """While the model file runs, what it writes to standard output goes to standard error:
    Python's prints and what native code writes to file descriptor 1 alike, so that with
    ``--json`` stdout is one JSON object."""
    stdout = sys.stdout
    try:
        real = stdout.fileno() == 1
    except (AttributeError, OSError, ValueError):  # no descriptor (a test runner, a notebook)
        real = False
    with contextlib.ExitStack() as stack:
        if real:
            stdout.flush()
            saved = os.dup(1)
            os.dup2(2, 1)

            def restore() -> None:
                stdout.flush()
                os.dup2(saved, 1)
                os.close(saved)

            stack.callback(restore)
        stack.enter_context(contextlib.redirect_stdout(sys.stderr))
        yield


def _stderr_is_terminal() -> bool:
    """Progress lines only for a person watching: not in logs, pipes or CI."""
    try:
        return sys.stderr.isatty()
    except (AttributeError, ValueError):
        return False


def _compare(
    file: str,
    gpus: int | None,
    strategies: str | None,
    budget: str | int | None,
    *,
    device: str,
    max_batch: int | None,
    seq_len: list[int] | None,
    as_json: bool,
    steps: int = 2,
    ignored: dict[str, bool],
    context: int = 0,
) -> None:
    """``--gpus N [--strategies dp,ddp]``: DP vs DDP on N virtual devices (memkit.strategies).

    ``ignored``: the command's options the comparison does not use, and whether each was
    given (a given one is refused, never silently dropped). ``context``: bytes each device
    loses to the CUDA context before PyTorch allocates (``memkit estimate`` on meta).
    """
    import dataclasses

    from memkit import distributed
    from memkit.errors import ConfigError
    from memkit.strategies import STRATEGIES, compare_strategies
    from memkit.units import format_size

    option = "--device-memory" if device == "meta" else "--budget"
    if gpus is None:
        raise ConfigError("--strategies compares strategies on virtual GPUs: give --gpus N too")
    if budget is None:
        raise ConfigError(f"--gpus {gpus}: give each virtual GPU's memory with {option} SIZE")
    if device not in ("cpu", "meta"):
        raise ConfigError(f"--gpus runs on virtual devices (--device cpu), not on {device!r}")
    given = [name for name, on in ignored.items() if on]
    if given:
        raise ConfigError(
            f"{', '.join(given)}: not used by the --gpus comparison (training steps of each "
            "strategy on virtual GPUs); drop them, or run without --gpus for one device"
        )
    if distributed.world_size() > 1:
        raise ConfigError("--gpus simulates every GPU in one process: run it without torchrun")
    if seq_len is not None and len(seq_len) > 1:
        raise ConfigError(f"--gpus takes one --seq-len, found {len(seq_len)}")
    text = str(budget)
    parts = [part.strip() for part in text.split(",")] if isinstance(budget, str) else []
    sizes = [_budget_bytes(part, text) for part in parts] if parts else [int(budget)]
    if len(sizes) not in (1, gpus):
        raise ConfigError(
            f"{option} {text!r}: give one size for every GPU or {gpus} sizes, one per GPU; "
            f"found {len(sizes)}"
        )
    if device == "cpu":
        _check_host_backs(parts * gpus if len(parts) == 1 else parts, "virtual GPUs")
    if context and min(sizes) <= context:
        raise ConfigError(
            f"{option} {format_size(min(sizes))} is not larger than the CUDA context "
            f"({format_size(context)}); give the card's total memory, e.g. 24GiB"
        )
    names = [n.strip() for n in (strategies or ",".join(STRATEGIES)).split(",") if n.strip()]
    with _user_output_to_stderr():
        result = compare_strategies(
            file, gpus=gpus, budget=[size - context for size in sizes] if len(sizes) > 1
            else sizes[0] - context, strategies=names, device=device, steps=steps,
            seq_len=seq_len[0] if seq_len else None, max_batch=max_batch,
        )  # fmt: skip
    if context:
        result = dataclasses.replace(result, notes=(
            f"meta tensors: each GPU's memory less a {format_size(context)} CUDA context; "
            "tensor bytes, without the caching allocator's rounding or cuBLAS's workspace "
            "(memkit estimate models both for one card)",
        ))  # fmt: skip
    click.echo(result.to_json() if as_json else str(result))
    if any(r.max_global_batch is None for r in result.results):
        sys.exit(1)


def _rank_budget(budget: str | None, world: int, rank: int) -> str | None:
    """This rank's entry of ``--budget A,B,...`` (one per rank), or the single budget.

    Every entry is checked first (a positive size), so a bad one fails every rank the same way.

    Raises:
        ConfigError: an entry is not a positive size, or the number of entries is neither one
            nor the world size.
    """
    if budget is None:
        return None
    parts = [part.strip() for part in budget.split(",")]
    for part in parts:
        _budget_bytes(part, budget)
    if len(parts) == 1:
        return parts[0]
    if len(parts) != world:
        from memkit.errors import ConfigError

        if world == 1:
            raise ConfigError(
                f"--budget {budget!r} gives {len(parts)} sizes, one per rank, but this is a "
                "single process (not launched by torchrun: WORLD_SIZE is unset or 1); give one "
                f"size (--budget {parts[0]}), or launch {len(parts)} ranks with torchrun "
                f"--nproc-per-node {len(parts)} --no-python memkit ..."
            )
        raise ConfigError(
            f"--budget has {len(parts)} sizes ({budget}) but the world has {world} rank(s); "
            "give one size for every rank, or a single size for all (launch with torchrun "
            "--nproc-per-node N for N ranks)"
        )
    return parts[rank]


def _budget_bytes(part: str, budget: str) -> int:
    """One ``--budget`` entry in bytes; a ConfigError naming the option unless positive."""
    from memkit.errors import ConfigError
    from memkit.units import parse_size

    hint = (
        "expected a positive size such as 300MiB or 8GiB (binary K M G T, or decimal kB MB GB "
        "TB), or one per rank under torchrun (1GiB,512MiB)"
    )
    if part.startswith("-"):
        raise ConfigError(f"--budget {budget!r}: {hint}; found the negative size {part!r}")
    try:
        size = parse_size(part)
    except ConfigError as exc:
        raise ConfigError(f"--budget {budget!r}: {exc}") from None
    if size <= 0:
        raise ConfigError(f"--budget {budget!r}: {hint}; found {part!r}, which is 0 bytes")
    return size


def _host_budgets(budget: str | None, world: int, rank: int) -> list[str]:
    """The ``--budget`` entries of the ranks that share this machine (torchrun's
    ``LOCAL_WORLD_SIZE`` ranks, numbered from ``rank - LOCAL_RANK``), this rank's included."""
    from memkit import distributed

    if budget is None:
        return []
    parts = [part.strip() for part in budget.split(",")]
    local = min(distributed.local_world_size(), world)
    if len(parts) == 1:
        return parts * local
    first = rank - distributed.local_rank()
    return parts[first : first + local]


def _check_target(device: str | None, budget: str | None, on_host: list[str]) -> Any:
    """The backend of this rank's device and budget (already resolved per rank), checked
    before anything runs: a device this machine does not have is a ConfigError naming
    ``--device`` (exit 2), and so are simulated cpu devices larger, together, than the RAM
    this machine has available (their tensors are real; ``on_host`` are the budgets of the
    ranks on this machine). Shared by ``memkit probe`` and ``memkit run``."""
    from memkit.devices import SimulatedBackend, get_backend
    from memkit.errors import ConfigError

    try:
        backend = get_backend(device, budget)
    except ConfigError as exc:
        raise ConfigError(f"--device {device!r}: {exc}" if device else str(exc)) from None
    if isinstance(backend, SimulatedBackend) and backend.device.type == "cpu" and budget:
        _check_host_backs(on_host or [budget])
    return backend


def _check_host_backs(budgets: list[str], what: str = "ranks on this machine") -> None:
    """A ConfigError (exit 2) when the simulated cpu devices of the ranks on this machine
    hold more, together, than its available RAM: their tensors are real, so the machine would
    run out of RAM (or swap) before a simulated device reached its limit."""
    from memkit.devices import host_memory
    from memkit.errors import ConfigError
    from memkit.units import format_size, parse_size

    host = host_memory()
    need = sum(parse_size(b) for b in budgets)
    if host.available is None or need <= host.available:
        return
    total = "" if host.total is None else f" of {format_size(host.total)}"
    given = f"--budget {budgets[0]!r}"
    if len(budgets) > 1:
        given = (
            f"--budget {','.join(dict.fromkeys(budgets))}: the {len(budgets)} {what} "
            f"simulate {format_size(need)} in all, and"
        )
    else:
        given += ":"
    raise ConfigError(
        f"{given} the simulated cpu device holds real tensors, so it can be at most the RAM "
        f"this machine has available: {format_size(host.available)}{total}. Give a smaller "
        "--budget (or free some RAM), or probe a real GPU with --device cuda"
    )


def _rank_device(device: str | None, world: int, local_rank: int) -> str | None:
    """Under torchrun: ``cuda`` (or no device with a GPU) means ``cuda:LOCAL_RANK``."""
    if world <= 1:
        return device
    if device is None:
        from memkit.devices import visible_devices

        devices = visible_devices()
        return None if not devices else f"{devices[0].type}:{local_rank}"
    if ":" not in device and device not in ("cpu", "meta"):
        return f"{device}:{local_rank}"
    return device


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
        if tty:
            click.echo("")  # leave the prompt below the last frame
        raise  # handle_errors: memkit: interrupted, exit 130


@cli.command(
    "run",
    context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False},
)
@click.option("--device", default=None, help="cuda:N, or cpu (simulated). Default: current GPU.")
@click.option("--budget", default=None, help="Simulated device size (cpu), or a cap: 300MiB; "
              "under torchrun one per rank: 1GiB,512MiB.")  # fmt: skip
@click.option("--json", "json_path", default=None, type=click.Path(dir_okay=False),
              help="Write the report as JSON (torchrun: NAME.rankN.json per rank).")  # fmt: skip
@click.option("--html", "html_path", default=None, type=click.Path(dir_okay=False),
              help="Write a self-contained HTML report (no network, no scripts).")  # fmt: skip
@click.option("--per-module/--steps-only", default=True,
              help="Hooks on every module (default), or only at step boundaries.")  # fmt: skip
@click.option("--memory-history", "history_path", default=None, type=click.Path(dir_okay=False),
              metavar="FILE", help="Write PyTorch's memory snapshot (alloc/free events with "
              "stacks) to FILE when the script ends, for pytorch.org/memory_viz or memkit "
              "inspect; on cpu from the simulated device (torchrun: NAME.rankN.EXT).")  # fmt: skip
@click.option("--history-entries", type=click.IntRange(min=1), default=None, metavar="N",
              help="Events the memory history keeps, the most recent [default: "
              "100000].")  # fmt: skip
@click.argument("script", type=click.Path(dir_okay=False))
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
@handle_errors
def run_command(
    device: str | None,
    budget: str | None,
    json_path: str | None,
    html_path: str | None,
    per_module: bool,
    history_path: str | None,
    history_entries: int | None,
    script: str,
    args: tuple[str, ...],
) -> None:
    """Run a training SCRIPT under memory tracking; print the report (and OOM post-mortem).

    The script runs as __main__ with its own ARGS and keeps its exit code (an OOM exits 1,
    another error 3, SIGTERM 143 with the report still written). The report goes to stderr;
    stdout is the script's. The options are checked before the script starts (exit 2).

    \b
    memkit run train.py --epochs 1
    memkit run --device cpu --budget 300MiB train.py
    memkit run --memory-history mem.pickle train.py   # then: memkit inspect mem.pickle
    torchrun --nproc-per-node 2 --no-python memkit run train.py
    """
    from memkit import distributed
    from memkit.tracking.run import (
        SigtermGuard,
        check_writable,
        default_device,
        rank_path,
        rank_prefix,
        run_script,
        summary_line,
    )

    # everything is checked before the script starts: a bad option must not cost a run
    on_host = _host_budgets(budget, distributed.world_size(), distributed.rank())
    budget = _rank_budget(budget, distributed.world_size(), distributed.rank())
    device = default_device(device)
    _check_target(device, budget, on_host)
    outputs = [
        (option, rank_path(path))
        for option, path in (("--json", json_path), ("--html", html_path))
        if path
    ]
    for option, out in outputs:
        check_writable(out, option)
    if history_path:
        check_writable(rank_path(history_path), "--memory-history")
    # SIGTERM (torchrun stops every rank when one fails) ends the script, not the report: it
    # raises in the script, the report is built, written and printed; exit 143
    with SigtermGuard() as guard:
        outcome = run_script(
            script,
            list(args),
            device=device,
            budget=budget,
            per_module=per_module,
            sigterm=guard,
            memory_history=history_path,
            history_entries=history_entries,
        )
        report = outcome.report
        written = []
        for option, out in outputs:
            try:
                if option == "--json":
                    report.to_json(out)
                else:
                    report.to_html(out)
            except OSError as exc:  # checked before the run; a full disk can still fail here
                click.echo(f"memkit: error: {option} {str(out)!r}: could not write the report "
                           f"({exc.strerror or exc})", err=True)  # fmt: skip
            else:
                written.append(out)
        if outcome.history_error is not None:
            click.echo(f"memkit: error: --memory-history {str(rank_path(history_path or ''))!r}: "
                       f"could not write the memory history ({outcome.history_error})",
                       err=True)  # fmt: skip
        elif outcome.history_file is not None:
            written.append(outcome.history_file)
        prefix = rank_prefix()
        if outcome.traceback:
            click.echo(outcome.traceback.rstrip("\n"), err=True)
        if distributed.launched_rank() in (None, 0):
            text = str(report)
        else:  # rank 0 prints the full report (with every rank's row when there was a group)
            text = summary_line(report, written)
            if report.oom is not None:  # only this rank knows where it ran out
                text += "\n" + str(report.oom)
        if outcome.interrupted is not None and distributed.launched_rank() in (None, 0):
            note = next(n for n in report.notes if n.startswith("interrupted by "))
            text += f"\n\nmemkit: {note} (exit {outcome.exit_code})"
        click.echo("\n".join(prefix + line for line in text.splitlines()), err=True)
    sys.exit(outcome.exit_code)


@cli.command("inspect")
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


def _estimate_archs() -> list[str]:
    from memkit.estimation.families import DEVICE_FAMILIES  # torch-free: --help stays light

    return list(DEVICE_FAMILIES)


_ESTIMATE_ARCHS = _estimate_archs()
"""The keys of memkit.estimation.DEVICE_FAMILIES (listed here so --help needs no torch)."""


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


@cli.command("estimate")
@click.argument("file", type=click.Path(dir_okay=False))
@click.option("--device-memory", required=True, callback=_parse_size_option,
              help="The GPU's total memory: 24GiB, 40GiB, 80GB (GB is decimal).")  # fmt: skip
@click.option("--mode", type=click.Choice(["train", "infer"]), default="train", show_default=True)
@click.option("--seq-len", callback=_parse_seq_lens, default=None,
              help="Sequence length(s) for make_batch(batch_size, seq_len): 512,1024.")  # fmt: skip
@click.option("--amp", type=click.Choice(["bf16", "fp16"]), default=None,
              help="Model torch.autocast (fp32 master weights) [default: fp32].")  # fmt: skip
@click.option("--attention", type=click.Choice(["auto", "math", "efficient", "flash"]),
              default="auto", show_default=True,
              help="SDPA kernel on the target (auto: what PyTorch would pick).")  # fmt: skip
@click.option("--arch", type=click.Choice(_ESTIMATE_ARCHS), default="ampere", show_default=True,
              help="GPU family: CUDA context, cuBLAS workspace, attention kernels.")  # fmt: skip
@click.option("--context", callback=_parse_size_option, default=None,
              help="CUDA context size [default: the family's, see docs/estimate.md].")  # fmt: skip
@click.option("--min-batch", type=click.IntRange(min=1), default=1, show_default=True)
@click.option("--max-batch", type=click.IntRange(min=1), default=None)
@click.option("--margin", callback=_parse_margin, default=None,
              help="Memory the recommended batch leaves free, percent [default: 5].")  # fmt: skip
@click.option("--json", "as_json", is_flag=True, help="Print JSON on stdout.")
@click.option("--gpus", type=click.IntRange(min=2), default=None, help="With --strategies: "
              "this many GPUs of --device-memory each.")  # fmt: skip
@click.option("--strategies", default=None, metavar="dp,ddp", help="Compare DataParallel and "
              "DDP on --gpus GPUs, on meta tensors (docs/distributed.md).")  # fmt: skip
@handle_errors
def estimate_command(
    file: str,
    device_memory: int,
    mode: str,
    seq_len: list[int] | None,
    amp: str | None,
    attention: str,
    arch: str,
    context: int | None,
    min_batch: int,
    max_batch: int | None,
    margin: float | None,
    as_json: bool,
    gpus: int | None = None,
    strategies: str | None = None,
) -> None:
    """Estimate the largest batch of a model file on a GPU you do not have (no GPU needed).

    Every trial runs on meta tensors: nothing is computed, no memory is used. Reports the
    estimated allocated and reserved peaks per batch, the largest batch that fits, a
    breakdown and advice (see docs/estimate.md). Exit codes: 0 fits, 1 even --min-batch is
    estimated not to fit, 2 usage or model-file error, 3 the step failed on meta tensors.

    \b
    memkit estimate examples/gpt2_small.py --device-memory 24GiB --seq-len 1024 --amp bf16
    """
    import json

    if gpus is not None or strategies is not None:
        from memkit.estimation import DEVICE_FAMILIES

        _compare(
            file, gpus, strategies, device_memory, device="meta", max_batch=max_batch,
            seq_len=seq_len, as_json=as_json,
            ignored={"--mode": mode != "train", "--amp": amp is not None,
                     "--attention": attention != "auto", "--min-batch": min_batch != 1,
                     "--margin": margin is not None},
            context=DEVICE_FAMILIES[arch].context_bytes if context is None else context,
        )  # fmt: skip
        return
    from memkit.estimation import DEFAULT_MARGIN, estimate

    if max_batch is not None and max_batch < min_batch:
        raise click.BadParameter(
            f"--max-batch ({max_batch}) must be at least --min-batch ({min_batch})"
        )
    options: dict[str, Any] = {
        "device_memory": device_memory, "mode": mode, "amp": amp, "attention": attention,
        "device": arch, "context": context, "min_batch": min_batch, "max_batch": max_batch,
        "margin": DEFAULT_MARGIN if margin is None else margin,
    }  # fmt: skip
    lengths: list[int | None] = list(seq_len) if seq_len else [None]
    with _user_output_to_stderr():
        results = [estimate(file, seq_len=length, **options) for length in lengths]
    if as_json:
        payload: Any = results[0].to_dict() if len(results) == 1 else {
            "seq_lens": [r.to_dict() for r in results]
        }  # fmt: skip
        click.echo(json.dumps(payload, indent=2))
    else:
        click.echo("\n\n".join(str(r) for r in results))
    if any(r.max_batch_size is None for r in results):
        sys.exit(1)
