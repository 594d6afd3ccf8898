"""Tracking across ranks: each rank's summary gathered to rank 0, compared, and advised on.

Under an initialised process group, :class:`memkit.tracking.tracker.Tracker` sends one
:class:`RankSummary` per rank to rank 0 when the block ends, or just before the script calls
``torch.distributed.destroy_process_group()`` (the usual end of a torchrun script, after which
the group's store is gone). The summaries travel through the process group's store
(:func:`memkit.distributed.gather_to_rank0`), never in a collective, so they cannot meet the
script's own collectives: a rank whose block ended with an exception that the script caught
sends its summary too and goes on (to a ``barrier()``, say) while rank 0 collects. Rank 0
waits for the others up to a timeout and names the ranks that did not send as missing; rank 0
itself does not wait when its own block ended with an exception (that exception must go on
now). Rank 0's report then carries a :class:`RanksReport`: a per-rank table (peak, phase and
step of the peak, capacity, how a rank's block ended), the imbalance between ranks, the rank
closest to its capacity (the first to run out when the batch grows: the "slowest to fit"),
and the DDP advice (``ddp-unused-parameters``, ``ddp-gpu0-context``).
"""

from __future__ import annotations

import collections
import logging
import os
import socket
import sys
from dataclasses import dataclass
from typing import Any, ClassVar

from memkit import distributed
from memkit.advice import Advice
from memkit.advice.distributed import ContextReading, ddp_gpu0_context, ddp_unused_parameters
from memkit.devices import cuda_context_reading
from memkit.errors import DistributedError
from memkit.patching import Restore
from memkit.render import track as layout
from memkit.results import Result

__all__ = [
    "GATHER_TIMEOUT",
    "SENT_AFTER_ERROR",
    "RankSummary",
    "RankWatch",
    "RanksReport",
    "rank_advice",
    "summarize",
]

log = logging.getLogger(__name__)

GATHER_TIMEOUT = 300.0
"""Seconds rank 0 waits for the other ranks' summaries; those that did not come are missing."""

SENT_AFTER_ERROR = "this rank's block ended with an exception; its summary was sent to rank 0"
"""The note of a rank other than 0 whose block raised: rank 0's report has its summary if
rank 0's own block ended normally (rank 0 does not wait otherwise)."""

_BLOCKS: collections.Counter[str] = collections.Counter()
"""Tracked blocks under a process group started so far, per call site: the n-th block of a
call site on every rank exchanges its summaries under the same store keys (a block only rank 0
runs, at a call site of its own, shifts no other's numbers)."""


def _call_site() -> str:
    """``file:line`` of the first caller outside memkit and contextlib (the user's ``with
    memkit.track(...)``; memkit's own for ``memkit run``): the same on every rank."""
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    frame = sys._getframe(1)
    while frame is not None:
        name = frame.f_code.co_filename
        if not (name.startswith(package) or name.endswith("contextlib.py")):
            return f"{os.path.basename(name)}:{frame.f_lineno}"
        frame = frame.f_back  # type: ignore[assignment]
    return "memkit"


@dataclass(frozen=True)
class RankSummary:
    """One rank's memory in a few numbers (small: it travels to rank 0).

    Attributes:
        rank, local_rank: global and node-local rank.
        node: host name.
        device: the device with the highest peak on this rank.
        peak_allocated, peak_reserved, capacity: bytes on that device.
        peak_phase, peak_step: where the peak happened (``None`` if unknown).
        steps: steps completed.
        oom: ``"step N, phase of module"`` when an OOM ended the block on this rank.
        error: the exception that ended the block on this rank, if any (``"ValueError:
            bad batch"``), an OOM's too.
        unused_parameters: trainable parameters with no gradient at an optimizer step.
        unused_bytes: their bytes, with their slots in DDP's gradient buckets.
        find_unused_parameters: the DDP model's setting, if a DDP model was tracked.
        ooms_caught: out-of-memory errors the script caught on this rank and went on (an OOM
            handler retrying with a smaller batch): their failed allocations are in no peak.
        cuda_initialized, current_device: the CUDA context reading (``ddp-gpu0-context``).
    """

    rank: int
    local_rank: int
    node: str
    device: str
    peak_allocated: int
    peak_reserved: int
    capacity: int | None
    peak_phase: str | None
    peak_step: int | None
    steps: int
    oom: str | None = None
    error: str | None = None
    unused_parameters: tuple[str, ...] = ()
    unused_bytes: int = 0
    find_unused_parameters: bool | None = None
    ooms_caught: int = 0
    cuda_initialized: bool = False
    current_device: int | None = None

    @property
    def used_share(self) -> float | None:
        """Peak reserved over capacity."""
        return None if not self.capacity else self.peak_reserved / self.capacity


@dataclass(frozen=True)
class RanksReport(Result):
    """Every rank's summary, on rank 0 (layout: :mod:`memkit.render.track`).

    Attributes:
        ranks: the summaries that arrived, by rank.
        advice: the DDP rules over them.
        missing: ranks that sent no summary within ``timeout`` seconds (stopped, stuck, or
            not running the block); the imbalance and the tightest rank leave them out.
        timeout: how long rank 0 waited for them (``None``: it stopped waiting early, the
            job being stopped).
        absent: of ``missing``, the ranks that did not enter the block at all (a block rank 0
            alone runs): rank 0 did not wait for them.
    """

    SCHEMA: ClassVar[str] = "memkit.RanksReport/1"
    HTML_TITLE: ClassVar[str] = "memkit track: ranks"
    JSON_INDENT: ClassVar[int | None] = 1
    HEADERS: ClassVar[tuple[str, ...]] = tuple(layout.RANK_HEADERS)

    ranks: tuple[RankSummary, ...]
    advice: tuple[Advice, ...] = ()
    missing: tuple[int, ...] = ()
    timeout: float | None = None
    absent: tuple[int, ...] = ()

    @property
    def world_size(self) -> int:
        return len(self.ranks) + len(self.missing)

    @property
    def imbalance(self) -> float:
        """``(max - min) / max`` of the ranks' peak reserved bytes (0: perfectly even)."""
        peaks = [r.peak_reserved for r in self.ranks]
        return 0.0 if not peaks or max(peaks) == 0 else (max(peaks) - min(peaks)) / max(peaks)

    @property
    def tightest_rank(self) -> int | None:
        """The rank with the least room left (by share of capacity; by peak without one)."""
        if not self.ranks:
            return None
        if all(r.capacity for r in self.ranks):
            return max(self.ranks, key=lambda r: (r.used_share or 0.0, -r.rank)).rank
        return max(self.ranks, key=lambda r: (r.peak_reserved, -r.rank)).rank

    def rows(self) -> list[list[object]]:
        """The per-rank table's rows (under :attr:`HEADERS`)."""
        return layout.rank_rows(self)

    def headline(self) -> str:
        """The imbalance and the rank closest to its capacity."""
        return layout.ranks_headline(self)

    def _json_fields(self, out: dict[str, Any]) -> dict[str, Any]:
        out.update(
            world_size=self.world_size, imbalance=self.imbalance, tightest_rank=self.tightest_rank
        )
        return out

    def __str__(self) -> str:
        return layout.ranks_text(self)

    def __repr__(self) -> str:
        return (
            f"RanksReport(world_size={self.world_size}, tightest_rank={self.tightest_rank}, "
            f"imbalance={self.imbalance:.2f})"
        )

    def html_body(self) -> str:
        return layout.ranks_html_body(self)


def rank_advice(ranks: tuple[RankSummary, ...]) -> list[Advice]:
    """The DDP rules over the gathered summaries."""
    out: list[Advice] = []
    unused = ddp_unused_parameters(
        {r.rank: r.unused_parameters for r in ranks},
        unused_bytes=max((r.unused_bytes for r in ranks), default=0) or None,
        find_unused_parameters=next(
            (r.find_unused_parameters for r in ranks if r.find_unused_parameters is not None),
            None,
        ),
    )
    if unused is not None:
        out.append(unused)
    context = ddp_gpu0_context(
        [
            ContextReading(r.rank, r.local_rank, r.cuda_initialized, r.current_device, r.node)
            for r in ranks
        ]
    )
    if context is not None:
        out.append(context)
    return out


def summarize(report: Any, extra: dict[str, Any]) -> RankSummary:
    """This rank's :class:`RankSummary` from its :class:`~memkit.tracking.report.TrackReport`."""
    devices = list(report.devices)
    dev = max(devices, key=lambda d: d.peak_reserved) if devices else None
    peak_phase = None
    peak_step = None
    if dev is not None:
        phases = {p: v for p, v in dev.phase_peaks.items() if v is not None}
        peak_phase = max(phases, key=lambda p: phases[p]) if phases else None
        if dev.steps:
            peak_step = max(dev.steps, key=lambda s: s.peak_allocated).step
        # the breakdown is training's peak: it names the phase only where that is the device's
        # peak (sweep BW: an evaluation's 4.81 MiB was labelled backward, whose peak was 446 KiB)
        bd = dev.breakdown
        if bd is not None and bd.phase and (peak_phase is None or bd.phase == peak_phase):
            peak_phase = bd.phase
            peak_step = bd.step if bd.step is not None else peak_step
    oom = report.oom

    initialized, current = cuda_context_reading()
    return RankSummary(
        rank=distributed.rank(),
        local_rank=distributed.local_rank(),
        node=socket.gethostname(),
        device="" if dev is None else dev.device,
        peak_allocated=0 if dev is None else dev.peak_allocated,
        peak_reserved=0 if dev is None else dev.peak_reserved,
        capacity=None if dev is None else dev.capacity,
        peak_phase=peak_phase,
        peak_step=peak_step,
        steps=report.steps,
        oom=None if oom is None else f"step {oom.step}, {oom.phase}",
        cuda_initialized=initialized,
        current_device=current,
        **extra,
    )


class RankWatch:
    """What a :class:`~memkit.tracking.tracker.Tracker` does under a process group.

    Records trainable parameters without a gradient at the first optimizer steps (and drops
    any that gets one later: a module used on some steps only is what
    ``find_unused_parameters=True`` is for), wraps ``torch.distributed.destroy_process_group``
    for the block (so the summaries are sent while the group's store still exists) and sends
    them at the end of the block otherwise.
    """

    CHECKED_STEPS = 3
    """Optimizer steps at which every parameter is looked at (bounded overhead); later steps
    look only at those still without a gradient."""

    def __init__(self, tracker: Any, timeout: float = GATHER_TIMEOUT) -> None:
        self.tracker = tracker
        self.timeout = timeout
        site = _call_site()
        self.block = f"{site}/{_BLOCKS[site]}"
        _BLOCKS[site] += 1
        # ranks say they run the block (where the group exists already: not under `memkit
        # run`, whose block begins before the script makes it, and which every rank runs)
        self.announced = distributed.is_distributed() and distributed.announce(
            f"track/{self.block}"
        )
        self.unused: dict[str, int] = {}
        """Trainable parameters with no gradient at every step looked at, with their bytes."""
        self.find_unused: bool | None = None
        self.checked = 0
        self.done = False
        self.gathered = False
        self.report: RanksReport | None = None
        """Rank 0's report of all ranks, once gathered (the tracker's report shows it)."""
        self._restore: Restore | None = None
        self._candidates: dict[str, Any] = {}  # name -> parameter, while in self.unused
        self._used: set[str] = set()

    @staticmethod
    def wanted() -> bool:
        """Whether a multi-rank process group is (or will be) in use."""
        return distributed.is_distributed() or distributed.world_size() > 1

    def on_step(self, optimizer: Any) -> None:
        """At an optimizer step (before it): note trainable parameters with no gradient, and
        forget those that have one now."""
        if self.checked >= self.CHECKED_STEPS:
            for name, param in list(self._candidates.items()):
                if param.grad is not None:
                    self._got_gradient(name)
            return
        self.checked += 1
        names: dict[int, str] = {}
        in_ddp: set[int] = set()
        for root in self.tracker.root_modules():
            ddp = hasattr(root, "find_unused_parameters")
            if self.find_unused is None and ddp:
                self.find_unused = bool(root.find_unused_parameters)
            for name, param in root.named_parameters():
                names.setdefault(id(param), name)
                if ddp:
                    in_ddp.add(id(param))
        for group in optimizer.param_groups:
            for i, param in enumerate(group["params"]):
                if not param.requires_grad:
                    continue
                name = names.get(id(param), f"param_groups[...][{i}]")
                if param.grad is not None:
                    self._got_gradient(name)
                elif name not in self._used:
                    nbytes = param.numel() * param.element_size()
                    # DDP's gradient buckets keep a slot for it as well
                    self.unused[name] = 2 * nbytes if id(param) in in_ddp else nbytes
                    self._candidates[name] = param

    def _got_gradient(self, name: str) -> None:
        self._used.add(name)
        self.unused.pop(name, None)
        self._candidates.pop(name, None)

    def install(self) -> None:
        """Wrap ``torch.distributed.destroy_process_group`` for the block."""
        import torch.distributed as dist

        if not dist.is_available():
            return
        original = dist.destroy_process_group

        def destroy_process_group(group: Any = None, *args: Any, **kwargs: Any) -> Any:
            if group is None and not self.done:
                self.gather_now()
            return original(group, *args, **kwargs)

        dist.destroy_process_group = destroy_process_group
        self._restore = Restore(dist, "destroy_process_group", original, destroy_process_group)

    def remove(self) -> None:
        if self._restore is not None:
            self._restore.remove()
            self._restore = None

    def local_advice(self) -> list[Advice]:
        """What this rank alone can advise when the ranks were not gathered (its block ended
        with an exception, such as DDP's 'Expected to have finished reduction' that unused
        parameters cause): rank 0's report may not have it."""
        if self.gathered or not self.unused or self.find_unused is not False:
            return []  # gathered, nothing unused, or no DDP model that waits for them
        rank = distributed.rank()
        advice = ddp_unused_parameters(
            {rank: sorted(self.unused)},
            unused_bytes=sum(self.unused.values()),
            find_unused_parameters=self.find_unused,
        )
        return [] if advice is None else [advice]

    def finish(self, clean: bool, error: BaseException | None = None) -> None:
        """At the end of the block: send or gather if not done yet. After an exception
        (``error``; else the one being handled) a rank other than 0 still sends its summary,
        which cannot block it, and rank 0 does not wait for the others: its exception must go
        on now, and the others may be stuck in a collective it will never join."""
        self._candidates.clear()  # no reference to the model's parameters after the block
        if self.done:
            return
        if clean:
            self.gather_now()
            return
        self.done = True
        if distributed.rank() == 0:
            self.tracker.notes.append(
                "ranks not gathered: this rank's block ended with an exception"
            )
            return
        if not self._grouped():
            return
        if error is None:
            error = sys.exc_info()[1]
        what = "an exception" if error is None else f"{type(error).__name__}: {error}"
        if self._send(what[:200]):
            self.tracker.notes.append(
                f"{SENT_AFTER_ERROR} (in rank 0's report if rank 0's block ended normally)"
            )

    def gather_now(self) -> None:
        """Send this rank's summary; on rank 0, collect every rank's into :attr:`report`."""
        self.done = True
        if not self._grouped():
            return
        if distributed.rank() != 0:
            if self._send(None):
                self.gathered = True
                self.tracker.notes.append("this rank's summary was sent to rank 0's report")
            return
        try:
            got = distributed.gather_to_rank0(
                self._summary(None), f"track/{self.block}", timeout=self.timeout,
                only_announced=self.announced,
            )  # fmt: skip
        except DistributedError as exc:
            self._failed(exc)
            return
        assert got is not None  # rank 0
        ranks = tuple(sorted(got.objects.values(), key=lambda r: r.rank))
        waited = None if got.gave_up else self.timeout
        self.report = RanksReport(
            ranks, tuple(rank_advice(ranks)), got.missing, waited, tuple(got.absent)
        )
        self.gathered = True
        late = [r for r in got.missing if r not in got.absent]
        if late:
            within = (
                "before rank 0 stopped waiting (the job was being stopped: SIGTERM)"
                if got.gave_up
                else f"within {self.timeout:g} s (stopped, stuck, or not running this block)"
            )
            self.tracker.notes.append(
                f"rank(s) {', '.join(map(str, late))} sent no summary {within}: "
                "missing from the ranks table"
            )
        if got.absent:
            self.tracker.notes.append(
                f"rank(s) {', '.join(map(str, got.absent))} did not enter this block (not "
                f"within {distributed.ANNOUNCE_GRACE:g} s of rank 0's end: a block rank 0 "
                "alone runs?): missing from the ranks table"
            )

    def _grouped(self) -> bool:
        """Whether there are ranks to gather (a note when launched with ranks but no group)."""
        if distributed.is_distributed() and distributed.world_size() > 1:
            return True
        if distributed.world_size() > 1:  # launched with ranks, no group (never, or gone)
            self.tracker.notes.append("ranks not gathered: no process group when the block ended")
        return False

    def _summary(self, error: str | None) -> RankSummary:
        extra = {
            "unused_parameters": tuple(sorted(self.unused)),
            "unused_bytes": sum(self.unused.values()),
            "find_unused_parameters": self.find_unused,
            "error": error,
            "ooms_caught": self.tracker.caught_ooms,
        }
        return summarize(self.tracker.report(), extra)

    def _send(self, error: str | None) -> bool:
        """Send this rank's summary to rank 0 (a rank other than 0); whether it went."""
        try:
            distributed.gather_to_rank0(
                self._summary(error), f"track/{self.block}", timeout=self.timeout
            )
        except DistributedError as exc:
            self._failed(exc)
            return False
        return True

    def _failed(self, exc: DistributedError) -> None:
        log.warning("memkit: could not gather the ranks' summaries: %s", exc)
        self.tracker.notes.append(f"ranks not gathered: {exc}")
