"""``memkit estimate``: the largest batch of a model file on a GPU you do not have, on meta
tensors."""

from __future__ import annotations

import sys
from typing import Any

import click

from memkit.cli.compare import _compare
from memkit.cli.exits import handle_errors, model_code_cannot_exit
from memkit.cli.parsing import (
    _parse_margin,
    _parse_seq_lens,
    _parse_size_option,
    check_batch_range,
)
from memkit.cli.streams import _user_output_to_stderr
from memkit.errors import ConfigError


def _estimate_archs() -> list[str]:
    from memkit.estimation.families import DEVICE_FAMILIES  # torch-free: --help stays light

    return list(DEVICE_FAMILIES)


_ESTIMATE_ARCHS = _estimate_archs()
"""The keys of memkit.estimation.DEVICE_FAMILIES (listed here so --help needs no torch)."""


def _parse_arch(ctx: click.Context, param: click.Parameter, value: str) -> str:
    """A family (``hopper``) or a card of one (``H100``): the family's name."""
    from memkit.estimation.families import family_of  # torch-free: --help stays light

    try:
        return family_of(value).name
    except ConfigError as exc:
        raise click.BadParameter(str(exc)) from None


def _parse_amp(_ctx: click.Context, _param: click.Parameter, value: str | None) -> str | None:
    """``--amp``'s dtype for autocast: ``None`` for fp32 (no autocast), as in Python."""
    from memkit.estimation.search import autocast_name

    return autocast_name(value)


def _no_dtype(ctx: click.Context, _param: click.Parameter, value: str | None) -> None:
    """``--dtype``/``--precision``, which people try: said where precision is set (sweep BJ:
    click offered ``--mode``)."""
    if value is not None:
        raise click.UsageError(
            "memkit estimate has no --dtype or --precision: mixed precision is --amp bf16 (or "
            "fp16: torch.autocast over fp32 weights); for weights held in bf16, cast the model in "
            "build_model() (model.to(torch.bfloat16)), which the estimate runs as it is",
            ctx,
        )


@click.command("estimate")
@click.argument("file", type=click.Path(dir_okay=False))
@click.option("--dtype", "--precision", "dtype", hidden=True, expose_value=False,
              callback=_no_dtype, is_eager=True)  # fmt: skip
@click.option("--device-memory", required=True, callback=_parse_size_option,
              help="The GPU's total memory: 24GiB, 40GiB, 80GB (GB is decimal).")  # fmt: skip
@click.option("--mode", type=click.Choice(["train", "infer"]), default="train", show_default=True)
@click.option("--seq-len", callback=_parse_seq_lens, default=None,
              help="Sequence length(s) for make_batch(batch_size, seq_len): 512,1024.")  # fmt: skip
@click.option("--amp", type=click.Choice(["fp32", "bf16", "fp16"], case_sensitive=False),
              default=None, callback=_parse_amp, help="Model torch.autocast in bf16 or fp16 "
              "(fp32 master weights); fp32: no autocast [default: fp32].")  # fmt: skip
@click.option("--attention", type=click.Choice(["auto", "math", "efficient", "flash"],
              case_sensitive=False), default="auto", show_default=True,
              help="SDPA kernel on the target (auto: what PyTorch would pick).")  # fmt: skip
@click.option("--arch", callback=_parse_arch, default="ampere", show_default=True,
              help=f"GPU family ({', '.join(_ESTIMATE_ARCHS)}) or a card of one (H100, A100, "
              "RTX 4090): CUDA context, cuBLAS workspace, attention kernels.")  # fmt: skip
@click.option("--context", callback=_parse_size_option, default=None,
              help="CUDA context size [default: the family's, see docs/estimate.md].")  # fmt: skip
@click.option("--min-batch", type=click.IntRange(min=1), default=1, show_default=True)
@click.option("--max-batch", type=click.IntRange(min=1), default=None)
@click.option("--margin", callback=_parse_margin, default=None,
              help="Memory the recommended batch leaves free, percent [default: 5].")  # fmt: skip
@click.option("--json", "as_json", is_flag=True, help="Print JSON on stdout.")
@click.option("--gpus", type=click.IntRange(min=2), default=None, help="Compare "
              "strategies (--strategies, default dp,ddp) on this many GPUs of --device-memory "
              "each.")  # fmt: skip
@click.option("--strategies", default=None, metavar="dp,ddp,fsdp", help="Compare "
              "DataParallel, DDP and FSDP2 (default dp,ddp) on --gpus GPUs, on meta tensors "
              "(docs/distributed.md).")  # fmt: skip
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
    memkit estimate examples/mlp.py --device-memory 24GiB --amp bf16
    memkit estimate examples/gpt2_small.py --device-memory 24GiB --seq-len 1024 --amp bf16
      (GPT-2 small needs: pip install -e ".[transformers]")
    """
    if gpus is not None or strategies is not None:
        from memkit.estimation import AMP_DTYPES
        from memkit.estimation.families import target_card
        from memkit.estimation.target_step import TargetStep

        card = target_card(arch, device_memory, context, None)
        target = TargetStep(card, attention, None if amp is None else AMP_DTYPES[amp])
        _compare(
            file, gpus, strategies, device_memory, device="meta", max_batch=max_batch,
            seq_len=seq_len, as_json=as_json,
            ignored={"--mode": mode != "train", "--min-batch": min_batch != 1,
                     "--margin": margin is not None},
            context=card.context_bytes, target=target,
        )  # fmt: skip
        return
    from memkit.estimation import DEFAULT_MARGIN, estimate

    check_batch_range(min_batch, max_batch)
    options: dict[str, Any] = {
        "device_memory": device_memory, "mode": mode, "amp": amp, "attention": attention,
        "arch": arch, "context": context, "min_batch": min_batch, "max_batch": max_batch,
        "margin": DEFAULT_MARGIN if margin is None else margin,
    }  # fmt: skip
    from memkit.estimation.result import EstimateSweep

    lengths: list[int | None] = list(seq_len) if seq_len else [None]
    with _user_output_to_stderr() as echo, model_code_cannot_exit():
        results = [estimate(file, seq_len=length, **options) for length in lengths]
    result = results[0] if len(results) == 1 else EstimateSweep(tuple(results))
    echo(result.to_json() if as_json else str(result))
    if not result.fits:
        sys.exit(1)
