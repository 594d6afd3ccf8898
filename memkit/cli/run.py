"""``memkit run``: a training script under memory tracking; the report goes to stderr (the
engine is :func:`memkit.tracking.run.run_script`)."""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import click

from memkit.cli.exits import handle_errors
from memkit.cli.parsing import reject_mistyped_option
from memkit.cli.targets import _check_target, _this_rank_budget

if TYPE_CHECKING:
    from memkit.tracking.report import TrackReport
    from memkit.tracking.run import RunOutcome


class _RunCommand(click.Command):
    """``memkit run``, which takes ``-mNAME`` as python does (``-m NAME``), and a script file
    named like an option (``-mx.py``) as the script."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        return super().parse_args(ctx, _as_click_reads_them(ctx, args))


def _as_click_reads_them(ctx: click.Context, args: list[str]) -> list[str]:
    """``args`` with, among memkit's options (before SCRIPT), ``-mpkg.train`` split into ``-m
    pkg.train`` (click would read ``-mpkg`` as ``-m -p -k -g``) and ``--`` put before a file
    whose name starts with ``-`` (click would read ``-mx.py`` as ``-m -x.py``)."""
    takes_value = {
        name
        for p in ctx.command.get_params(ctx)
        if isinstance(p, click.Option) and not p.is_flag
        for name in p.opts
    }
    i = 0
    while i < len(args) and args[i].startswith("-") and args[i] not in ("-", "--"):
        if os.path.isfile(args[i]):
            return [*args[:i], "--", *args[i:]]
        if args[i].startswith("-m") and len(args[i]) > 2:
            return [*args[:i], "-m", args[i][2:], *args[i + 1 :]]
        i += 2 if args[i] in takes_value else 1
    return args


@click.command(
    "run",
    cls=_RunCommand,
    context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False},
)
@click.option("--device", default=None, help="cuda:N, or cpu (simulated) [default: the current "
              "GPU; on a machine without one, the simulated cpu device of --budget, else of 1 "
              "GiB or half the available RAM if less].")  # fmt: skip
@click.option("--budget", default=None, help="Simulated device size (cpu), or a cap: 300MiB; "
              "under torchrun one per rank: 1GiB,512MiB.")  # fmt: skip
@click.option("--json", "json_path", default=None, type=click.Path(dir_okay=False),
              help="Write the report as JSON to a file (torchrun: NAME.rankN.json per rank); "
              "not '-': stdout is the script's.")  # fmt: skip
@click.option("--html", "html_path", default=None, type=click.Path(dir_okay=False),
              help="Write a self-contained HTML report (no network, no scripts).")  # fmt: skip
@click.option("--per-module/--steps-only", default=True,
              help="Module detail (default), or hooks at step boundaries only.")  # fmt: skip
@click.option("--module-every", type=click.IntRange(min=1), default=None, metavar="N",
              help="Module hooks on steps 0, 1 and every Nth step (steps and phases: every "
              "step). 1: every step. [default: 100 on a GPU, 1 on cpu]")  # fmt: skip
@click.option("--memory-history", "history_path", default=None, type=click.Path(dir_okay=False),
              metavar="FILE", help="Write PyTorch's memory snapshot (alloc/free events with "
              "stacks) to FILE when the script ends, for pytorch.org/memory_viz or memkit "
              "inspect; on cpu from the simulated device (torchrun: NAME.rankN.EXT).")  # fmt: skip
@click.option("--history-entries", type=click.IntRange(min=1), default=None, metavar="N",
              help="Events the memory history keeps, the most recent [default: "
              "100000].")  # fmt: skip
@click.option("-m", "--module", "as_module", is_flag=True,
              help="SCRIPT is a module's name, run as python -m runs it (relative imports "
              "work): memkit run -m pkg.train [ARGS]...")  # fmt: skip
@click.argument("script", required=False, metavar="SCRIPT|-m MODULE")
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
@handle_errors
def run_command(
    device: str | None,
    budget: str | None,
    json_path: str | None,
    html_path: str | None,
    per_module: bool,
    module_every: int | None,
    history_path: str | None,
    history_entries: int | None,
    as_module: bool,
    script: str | None,
    args: tuple[str, ...],
) -> None:
    """Run a training SCRIPT (or -m MODULE, as python -m) under memory tracking; print the
    report (and OOM post-mortem).

    The script runs as __main__ with its own ARGS and keeps its exit code (an OOM exits 1,
    another error 3, SIGTERM 143 with the report still written). The report goes to stderr;
    stdout is the script's. The options are checked before the script starts (exit 2).

    \b
    memkit run train.py --epochs 1
    memkit run -m pkg.train --epochs 1   # as python -m pkg.train, from pkg's parent folder
    memkit run --device cpu --budget 300MiB train.py
    memkit run --memory-history mem.pickle train.py   # then: memkit inspect mem.pickle
    torchrun --nproc-per-node 2 --no-python memkit run train.py
    """
    from memkit.tracking.outputs import rank_path
    from memkit.tracking.run import SignalGuard, run_script

    ctx = click.get_current_context()
    if script is None:
        raise click.UsageError(
            "-m needs a module's name, as python -m does: memkit run [OPTIONS] -m pkg.train "
            "[ARGS]..."
            if as_module
            else "Missing argument 'SCRIPT': memkit run [OPTIONS] SCRIPT [ARGS]... (or -m MODULE)",
            ctx,
        )
    reject_mistyped_option(ctx, script)
    device, budget, outputs = _check_run_options(device, budget, json_path, html_path, history_path)
    # the files are written after the script ran, and a script may change directory (hydra's
    # job.chdir): a relative path means the directory memkit was started in; they are shown
    # as typed
    start = Path.cwd()
    outputs = [(option, path.absolute()) for option, path in outputs]
    if history_path:
        history_path = os.path.abspath(history_path)

    def shown(path: str | Path) -> str | Path:
        return Path(path).relative_to(start) if Path(path).is_relative_to(start) else path

    # SIGTERM (torchrun stops every rank when one fails) ends the script, not the report: it
    # raises in the script, the report is built, written and printed; exit 143
    with SignalGuard() as guard:
        outcome = run_script(
            script,
            list(args),
            device=device,
            budget=budget,
            per_module=per_module,
            module_every=module_every,
            sigterm=guard,
            memory_history=history_path,
            history_entries=history_entries,
            module=as_module,
        )
        written = _write_reports(outcome.report, outputs)
        if outcome.history_error is not None:
            click.echo(f"memkit: error: --memory-history "
                       f"{str(shown(rank_path(history_path or '')))!r}: "
                       f"could not write the memory history ({outcome.history_error})",
                       err=True)  # fmt: skip
        elif outcome.history_file is not None:
            written.append(outcome.history_file)
        misplaced = _misplaced_options(ctx, args, outcome.refused)
        target = "-m MODULE" if as_module else "SCRIPT"
        _print_outcome(outcome, [shown(f) for f in written], misplaced, target)
    sys.exit(outcome.exit_code)


def _misplaced_options(
    ctx: click.Context, args: tuple[str, ...], refused: str | None = None
) -> list[str]:
    """memkit run's own options among the script's ARGS (``memkit run train.py --budget
    16MiB`` gives ``--budget`` to the script, as documented): named in a hint when the script
    then exits 2 (its argparse refusing them) before its first step. With the argparse
    message (``refused``), only those it names: the ones the script took are not the
    problem."""
    names = {o for p in ctx.command.get_params(ctx) for o in (*p.opts, *p.secondary_opts)}
    names -= {"-h", "--help"}
    given = dict.fromkeys(a.split("=", 1)[0] for a in args if a.split("=", 1)[0] in names)
    if refused is None:
        return list(given)
    return [n for n in given if re.search(rf"(?<![\w-]){re.escape(n)}(?![\w-])", refused)]


def _check_run_options(
    device: str | None,
    budget: str | None,
    json_path: str | None,
    html_path: str | None,
    history_path: str | None,
) -> tuple[str | None, str | None, list[tuple[str, Path]]]:
    """This rank's device and budget, and the report files to write as ``(option, path)``,
    all checked before the script starts: a bad option must not cost a run (exit 2).
    ``--device meta`` is one: a script's tensors are on cpu or a GPU, and meta would count
    nothing (a report of zeros)."""
    from memkit.errors import ConfigError
    from memkit.tracking.outputs import check_writable, rank_path
    from memkit.tracking.run import default_device

    for option, path in (("--json", json_path), ("--html", html_path),
                         ("--memory-history", history_path)):  # fmt: skip
        if path == "-":
            raise ConfigError(
                f"{option} '-': expected a file name; memkit run's stdout is the script's "
                "own output, so the report cannot go there without mixing with it (and '-' "
                f"is not written as a file). Give a file ({option} report"
                f"{'.pickle' if option == '--memory-history' else option.replace('--', '.')}); "
                "the text report is on stderr"
            )
    budget, on_host = _this_rank_budget(budget)
    device = default_device(device)
    if _check_target(device, budget, on_host).device.type == "meta":
        raise ConfigError(
            "--device meta: memkit run counts the memory the script's tensors use on one "
            "device, and a script's tensors are on cpu or a GPU (meta would count nothing). "
            "Use --device cpu --budget SIZE for the simulated device, or memkit estimate "
            "FILE --device-memory SIZE for an estimate on meta tensors"
        )
    outputs = [
        (option, rank_path(path))
        for option, path in (("--json", json_path), ("--html", html_path))
        if path
    ]
    for option, out in outputs:
        check_writable(out, option)
    if history_path:
        check_writable(rank_path(history_path), "--memory-history")
    return device, budget, outputs


def _write_reports(report: TrackReport, outputs: list[tuple[str, Path]]) -> list[str | Path]:
    """Write ``--json`` and ``--html``; the files written. A file that cannot be written (a
    full disk: the paths were checked before the run) is one error line, not the end."""
    written: list[str | Path] = []
    for option, out in outputs:
        try:
            if option == "--json":
                report.to_json(out)
            else:
                report.to_html(out)
        except OSError as exc:
            click.echo(f"memkit: error: {option} {str(out)!r}: could not write the report "
                       f"({exc.strerror or exc})", err=True)  # fmt: skip
        else:
            written.append(out)
    return written


def _print_outcome(
    outcome: RunOutcome,
    written: list[str | Path],
    misplaced: Sequence[str] = (),
    target: str = "SCRIPT",
) -> None:
    """The script's traceback, then the report on stderr: in full on rank 0 (or without
    torchrun), one summary line on the other ranks (with the OOM post-mortem only they know).
    ``misplaced``: memkit's options the script was given (:func:`_misplaced_options`), after
    ``target`` (``SCRIPT``, ``-m MODULE``)."""
    from memkit import distributed
    from memkit.tracking.run import rank_prefix, summary_line

    report = outcome.report
    prefix = rank_prefix()
    if outcome.traceback:
        click.echo(outcome.traceback.rstrip("\n"), err=True)
        if _NO_CUDA.search(outcome.traceback):
            click.echo(prefix + NO_CUDA_HINT, err=True)
    interrupted = outcome.interrupted is not None and distributed.launched_rank() in (None, 0)
    if distributed.launched_rank() not in (None, 0):
        # rank 0 prints the full report (with every rank's row when there was a group)
        text = summary_line(report, written)
        if report.oom is not None:  # only this rank knows where it ran out
            text += "\n" + str(report.oom)
    elif ran_anything(report):
        text = str(report)
    elif interrupted:
        text = (
            f"memkit: interrupted by {outcome.interrupted} before the script's first step (no "
            f"model forward ran): nothing to report (exit {outcome.exit_code})"
        )
        interrupted = False
    else:
        text = before_first_step(outcome.exit_code, outcome.ended)
        if outcome.exit_code == 2 and misplaced:
            text += (
                f" The script was given {', '.join(misplaced)}, which memkit run has too: "
                f"memkit's options go before {target} (memkit run [OPTIONS] {target} "
                f"[ARGS]...); what follows {target} is the script's."
            )
    if interrupted:
        note = next(n for n in report.notes if n.startswith("interrupted by "))
        text += f"\n\nmemkit: {note} (exit {outcome.exit_code})"
    click.echo("\n".join(prefix + line for line in text.splitlines()), err=True)


_NO_CUDA = re.compile(
    r"Torch not compiled with CUDA enabled|Found no NVIDIA driver|No CUDA GPUs are available"
    r"|on a CUDA device but torch\.cuda\.is_available\(\) is False"
)
"""What torch says when a script asks for a CUDA device on a machine without one."""
NO_CUDA_HINT = (
    "memkit: the script asks for a CUDA device and this machine has none; memkit run's "
    "simulated device is the CPU (--device cpu). Let the script fall back to it (device = "
    "'cuda' if torch.cuda.is_available() else 'cpu'; map_location='cpu' for a checkpoint), "
    "or, for a model spread over several GPUs (.to('cuda:1')), run it with python, its "
    "loop inside `with memkit.simulate(budget, devices=N) as acct, memkit.track(model, "
    "optimizer):` and acct.to(x, i) for each .to('cuda:i'): one row per GPU "
    "(docs/simulated-device.md)."
)


def ran_anything(report: TrackReport) -> bool:
    """Whether the script got as far as a model forward (or a step): else its report is
    empty, and one line says so instead (:func:`before_first_step`)."""
    if report.steps or report.oom is not None or report.eval_forwards:
        return True
    return any(
        d.modules or any(v is not None for p, v in d.phase_peaks.items() if p != "other")
        for d in report.devices
    )


def before_first_step(exit_code: int, ended: str | None = None) -> str:
    """The one line for a script that ended before any model forward ran (its own argparse
    rejecting an option, ``--help``, an error it raised); ``ended`` is how it ended
    (:attr:`RunOutcome.ended`). A ``sys.exit`` code is the script's own, not memkit's; an
    error it raised exits 3, memkit's code for it."""
    if ended is not None and not ended.startswith("the script exited"):
        return f"memkit: {ended}, before its first step (no model forward ran): nothing to report."
    how = "ended" if exit_code == 0 else f"exited with code {exit_code}"
    return (
        f"memkit: the script {how} before its first step (no model forward ran): nothing to "
        "report. The exit code is the script's own; memkit's usage errors exit 2 with a "
        "'memkit: error:' line before the script starts."
    )
