"""Where a command runs, checked before anything runs: this rank's ``--budget`` entry, its
device, and whether the simulated cpu devices of the ranks on this machine fit in its RAM
(a ConfigError naming the option: exit 2). Shared by ``probe``, ``run`` and ``--gpus``."""

from __future__ import annotations

from typing import Any


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
        backend = get_backend(device, budget, meta=False)  # the forms probe and run take
    except ConfigError as exc:
        said, own = str(exc), f"budget={budget!r}: "
        if said.startswith(own):  # the budget's own fault: name it
            raise ConfigError(f"--budget {budget!r}: {said.removeprefix(own)}") from None
        raise ConfigError(f"--device {device!r}: {said}" if device else said) from None
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
        "--budget (or free some RAM), or use a real GPU with --device cuda"
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


def _this_rank_budget(budget: str | None) -> tuple[str | None, list[str]]:
    """This rank's ``--budget`` entry (checked) and the entries of the ranks on this machine,
    this rank's included (for :func:`_check_target`)."""
    from memkit import distributed

    world, rank = distributed.world_size(), distributed.rank()
    on_host = _host_budgets(budget, world, rank)
    return _rank_budget(budget, world, rank), on_host
