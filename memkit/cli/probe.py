"""``memkit probe``: the largest batch of a model file that fits, measured (one device, every
rank under torchrun, or ``--gpus N`` virtual devices)."""

from __future__ import annotations

import sys
from typing import Any

import click

from memkit.cli.compare import _compare
from memkit.cli.exits import handle_errors, model_code_cannot_exit
from memkit.cli.parsing import (
    _parse_margin,
    _parse_modes,
    _parse_seq_lens,
    check_batch_range,
)
from memkit.cli.streams import _stderr_is_terminal, _user_output_to_stderr
from memkit.cli.targets import _check_target, _rank_device, _this_rank_budget


# probe runs ~80 lines: one parameter per option and the --help text (its docstring); the
# checks are _probe_target, the --gpus comparison memkit.cli.compare.
@click.command()
@click.argument("file", type=click.Path(dir_okay=False))
@click.option("--mode", callback=_parse_modes, default="train", show_default=True,
              help="train, infer, or train,infer for both in one run (evaluation keeps no "
              "activations for a backward, so its batch can be larger; with train,infer its "
              "trials hold training's optimizer state and gradients, as an evaluation inside "
              "training does).")  # fmt: skip
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
              help="Effective batch you want: advises gradient accumulation (and answers "
              "for the accumulating step when it does).")  # fmt: skip
@click.option("--accumulate", type=click.IntRange(min=1), default=None, metavar="K",
              help="The script accumulates gradients over K micro-batches per optimizer "
              "step: answer for that step.")  # fmt: skip
@click.option("--seq-len", callback=_parse_seq_lens, default=None,
              help="Sequence length(s) for make_batch(batch_size, seq_len): "
              "128,512,2048.")  # fmt: skip
@click.option("--keep", type=click.Choice(["output", "loss"]), default="output",
              show_default=True, help="What the default step keeps, as your loop does: the "
              "model's output until the next forward (`out = model(x)`), or the loss only "
              "(`loss = model(x).loss`, transformers' Trainer).")  # fmt: skip
@click.option("--prefetch", is_flag=True, help="The script makes the next batch on the "
              "device before the last is let go (a replay buffer's sample); with --accumulate "
              "K it fetches all K micro-batches of an optimizer step first (transformers 5's "
              "Trainer): hold them so.")  # fmt: skip
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
@click.option("--gpus", type=click.IntRange(min=2), default=None, help="Compare "
              "strategies (--strategies, default dp,ddp) on this many virtual GPUs of --budget "
              "each (--device cpu).")  # fmt: skip
@click.option("--strategies", default=None, metavar="dp,ddp,fsdp", help="Compare "
              "DataParallel, DDP and FSDP2 (default dp,ddp) on --gpus virtual GPUs: largest "
              "global batch and per-device peaks "
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
    accumulate: int | None,
    seq_len: list[int] | None,
    keep: str,
    prefetch: bool,
    as_json: bool,
    ddp: bool,
    timeout: float | None,
    dist_backend: str | None,
    gpus: int | None = None,
    strategies: str | None = None,
) -> None:
    """Find the largest batch size of a model file that fits, exactly.

    FILE defines build_model() and make_batch(batch_size), and optionally build_optimizer,
    loss_fn, train_step and eval_step (--mode infer's; see docs/probe.md). Exit codes: 0 found,
    1 even --min-batch does not fit, 2 usage or model-file error, 3 the step raised an error
    that is not an OOM (or memkit failed), 4 a rank failed or timed out, 130 interrupted; with
    train,infer, an error in the second mode prints the first mode's report, then exits with
    the error's code. With --json, stdout is one JSON object: what the model file prints goes
    to stderr.

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
                     "--accumulate": accumulate is not None, "--keep": keep != "output",
                     "--prefetch": prefetch,
                     "--ddp": ddp, "--timeout": timeout is not None,
                     "--dist-backend": dist_backend is not None},
        )  # fmt: skip
        return
    from memkit import distributed
    from memkit.errors import MemkitError
    from memkit.probing.result import ProbeModes, ProbeResult
    from memkit.probing.runner import DEFAULT_MARGIN, ProbeOptions, probe_file

    check_batch_range(min_batch, max_batch)
    training_only = _training_only(mode, target_batch, accumulate)
    device, budget, backend = _probe_target(device, budget)
    world, me = distributed.world_size(), distributed.rank()
    rank_device = backend.device if world > 1 else "cpu"
    wait = timeout if timeout is not None else (1800.0 if world > 1 else None)
    with (
        distributed.process_group_from_env(rank_device, backend=dist_backend, timeout=wait),
        _user_output_to_stderr() as echo,
        model_code_cannot_exit(),
    ):
        options = ProbeOptions(
            min_batch=min_batch, max_batch=max_batch, steps=steps,
            margin=DEFAULT_MARGIN if margin is None else margin, target_batch=target_batch,
            accumulation=accumulate, ddp=ddp, timeout=wait, keep_output=keep == "output",
            prefetch=prefetch,
        )  # fmt: skip
        per_mode: list[Any] = []
        stopped: MemkitError | None = None
        for one in mode:
            try:
                per_mode.append(probe_file(
                    file, _in_mode(options, one, training="train" in mode), seq_len=seq_len,
                    device=device, budget=budget,
                    progress=me == 0 and not as_json and _stderr_is_terminal(),
                ))  # fmt: skip
            except MemkitError as exc:
                if not per_mode:
                    raise
                stopped = exc  # the modes probed before it keep their answers
                break
    if training_only and "infer" in mode[: len(per_mode)]:  # --mode infer alone refused them
        at = mode.index("infer")
        per_mode[at] = _with_line(per_mode[at], f"{training_only}: applied to the train probe "
                                  "only (evaluation has no gradients to accumulate)")  # fmt: skip
    result = per_mode[0] if len(mode) == 1 else ProbeModes(tuple(per_mode))
    if me == 0:
        echo(result.to_json() if as_json else str(result))
    if stopped is not None:
        done = ",".join(mode[: len(per_mode)])
        if me == 0:
            click.echo(f"memkit: --mode {done} finished, its report is on stdout; "
                       f"--mode {mode[len(per_mode)]} stopped:", err=True)  # fmt: skip
        raise stopped
    results = [
        r for one in per_mode for r in ([one] if isinstance(one, ProbeResult) else one.results)
    ]
    if any(r.max_batch_size is None for r in results):
        sys.exit(1)


def _training_only(mode: list[str], target_batch: int | None, accumulate: int | None) -> str:
    """The options given that are training's (``--target-batch``, ``--accumulate``), as
    typed: refused with ``--mode infer`` alone (exit 2); with ``train,infer`` the evaluation
    report says they went to training only."""
    from memkit.errors import ConfigError

    given = [
        f"{name} {value}"
        for name, value in (("--target-batch", target_batch), ("--accumulate", accumulate))
        if value is not None
    ]
    if given and "train" not in mode:
        they, them = ("they apply", "them") if len(given) > 1 else ("it applies", "it")
        raise ConfigError(
            f"{' and '.join(given)} with --mode infer: {they} to training (gradient "
            "accumulation over optimizer steps), and --mode infer probes evaluation, a forward "
            f"under no_grad with no gradients and no optimizer step. Drop {them}, or probe "
            f"training with --mode train (--mode train,infer: the train probe takes {them}, the "
            "infer probe does not)"
        )
    return " and ".join(given)


def _with_line(result: Any, line: str) -> Any:
    """``result`` (a probe, or one per sequence length) with ``line`` among its report's
    lines (``defaults``)."""
    import dataclasses

    from memkit.probing.result import ProbeResult

    if isinstance(result, ProbeResult):
        return dataclasses.replace(result, defaults=(*result.defaults, line))
    return dataclasses.replace(result, results=tuple(_with_line(r, line) for r in result.results))


def _in_mode(options: Any, mode: str, *, training: bool) -> Any:
    """``options`` for one ``--mode``: target batch and accumulation are training's; with
    training in the same run (``train,infer``), evaluation holds training's optimizer state."""
    import dataclasses

    if mode == "train":
        return options
    return dataclasses.replace(
        options,
        mode=mode,
        target_batch=None,
        accumulation=None,
        prefetch=False,
        training_state=training,
    )


def _probe_target(device: str | None, budget: str | None) -> tuple[str | None, str | None, Any]:
    """This rank's device, budget and backend, checked before the model file loads (exit 2).

    Raises:
        ConfigError: a bad ``--budget`` or ``--device`` (see :func:`_check_target`), or
            ``--device meta``: probe runs real steps, meta tensors hold no data.
    """
    from memkit import distributed

    budget, on_host = _this_rank_budget(budget)
    device = _rank_device(device, distributed.world_size(), distributed.local_rank())
    backend = _check_target(device, budget, on_host)
    if backend.device.type == "meta":
        from memkit.errors import ConfigError

        raise ConfigError(
            "--device meta: probe runs real steps and measures them; meta tensors hold no data. "
            "Use memkit estimate FILE --device-memory SIZE for meta-device estimates, or "
            "--device cpu --budget SIZE for a simulated device that runs the steps"
        )
    return device, budget, backend
