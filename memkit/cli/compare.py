"""``--gpus N [--strategies dp,ddp,fsdp]`` of ``memkit probe`` and ``memkit estimate``:
DataParallel, DDP and FSDP2 on N virtual devices (:mod:`memkit.strategies`)."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

from memkit.cli.exits import model_code_cannot_exit
from memkit.cli.streams import _user_output_to_stderr
from memkit.cli.targets import _budget_bytes, _check_host_backs

if TYPE_CHECKING:
    from memkit.strategies import StepTarget


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
    target: StepTarget | None = None,
) -> None:
    """``--gpus N [--strategies dp,ddp,fsdp]``: the strategies on N virtual devices
    (memkit.strategies).

    ``ignored``: the command's options the comparison does not use, and whether each was
    given (a given one is refused, never silently dropped). ``context``: bytes each device
    loses to the CUDA context before PyTorch allocates and ``target`` the GPU's step rules
    (``memkit estimate`` on meta).
    """
    import dataclasses

    from memkit import distributed
    from memkit.errors import ConfigError
    from memkit.strategies import DEFAULT_STRATEGIES, compare_strategies
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
    chosen = strategies or ",".join(DEFAULT_STRATEGIES)
    names = [n.strip() for n in chosen.split(",") if n.strip()]
    with _user_output_to_stderr() as echo, model_code_cannot_exit():
        result = compare_strategies(
            file, gpus=gpus, budget=[size - context for size in sizes] if len(sizes) > 1
            else sizes[0] - context, strategies=names, device=device, steps=steps,
            seq_len=seq_len[0] if seq_len else None, max_batch=max_batch, target=target,
        )  # fmt: skip
    if context:
        result = dataclasses.replace(result, notes=(
            f"meta tensors: each GPU's memory less a {format_size(context)} CUDA context; "
            "tensor bytes and workspaces, without the caching allocator's rounding and "
            "segments (memkit estimate models them for one card)", *result.notes,
        ))  # fmt: skip
    echo(result.to_json() if as_json else str(result))
    if any(r.error is not None for r in result.results):
        sys.exit(3)  # a strategy's step failed (the others' results are above)
    if any(r.max_global_batch is None for r in result.results):
        sys.exit(1)
