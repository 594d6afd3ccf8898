"""A training step whose work varies from call to call (a schedule), seen and covered.

A model file's ``train_step`` may do different work at different calls: a GAN's generator
stepped every ``n_critic``-th call, gradient accumulation written with a counter, an extra
regularisation pass every k calls. A trial of 2 steps then measures whichever calls it
happened to run. :class:`StepWatch` records, for each step of a trial, which optimizers
stepped (every ``torch.optim.Optimizer``, those the probe was not given too, through the global
step hook) and how many backward passes reached the model's parameters; :func:`cycle_of` finds
the cycle those records repeat; :class:`WorkLog` keeps what the trials have shown and says what
the next trials must run (:class:`memkit.probing.trials.TrialRunner` asks it); :class:`Schedule`
is what the report says of it.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

from memkit.errors import spelled
from memkit.optimizers import unwrap_optimizer

__all__ = ["Schedule", "StepWatch", "StepWork", "WorkLog", "cycle_of", "steady_from"]


@dataclass(frozen=True)
class StepWork:
    """What one step did: each optimizer that stepped (its number in the watch, times) and the
    backward passes that reached the model's parameters (the most gradients any one of them
    received)."""

    stepped: tuple[tuple[int, int], ...]
    backwards: int


class StepWatch:
    """Hooks that record each step's :class:`StepWork` while :meth:`watching`; they keep no
    tensor and no optimizer alive."""

    def __init__(self, model: torch.nn.Module, optimizer: Any) -> None:
        self.model = model
        # the one whose steps are seen (inside a DeferredOptimizer, an AcceleratedOptimizer)
        self.optimizer = unwrap_optimizer(optimizer) or optimizer
        self.names: list[str] = []  # each optimizer seen, by number
        self._numbers: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()
        self._stepped: dict[int, int] = {}
        self._grads: list[int] = []

    def _on_step(self, optimizer: Any, *_: Any) -> None:
        number = self._numbers.get(optimizer)
        if number is None:
            number = self._numbers[optimizer] = len(self.names)
            self.names.append(self._name(optimizer))
        self._stepped[number] = self._stepped.get(number, 0) + 1

    def _name(self, optimizer: Any) -> str:
        kind = type(optimizer).__name__
        if optimizer is self.optimizer:
            return f"{kind} (the probe's optimizer)"
        count = sum(p.numel() for g in optimizer.param_groups for p in g["params"])
        return f"another {kind} ({count:,} parameters)"

    @contextlib.contextmanager
    def watching(self) -> Iterator[None]:
        handles = [register_optimizer_step_post_hook(self._on_step)]
        params = [p for p in self.model.parameters() if p.requires_grad and p.is_leaf]
        if hasattr(self.model, "_orig_mod"):
            params = []  # (a compiled model: no hooks on its parameters)
        self._grads = [0] * len(params)
        for i, param in enumerate(params):
            handles.append(param.register_post_accumulate_grad_hook(self._counter(i)))
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()
            self._stepped.clear()

    def _counter(self, i: int) -> Any:
        def count(_: torch.Tensor) -> None:
            self._grads[i] += 1

        return count

    def take(self) -> StepWork:
        """The work since the last call (one step's)."""
        work = StepWork(tuple(sorted(self._stepped.items())), max(self._grads, default=0))
        self._stepped.clear()
        self._grads = [0] * len(self._grads)
        return work


def cycle_of(works: Sequence[StepWork], known: int | None = None) -> int | None:
    """The number of steps after which ``works`` repeat: 1 when every step did the same work;
    ``known`` when they agree with it; else, once every work they did has come back, the
    shortest ``p`` with ``works[i] == works[i + p]`` for every ``i``; ``None`` when no cycle
    is seen (``a b a`` is none yet: ``b`` has not come back).

    Examples:
        >>> a, b = StepWork(((0, 1),), 1), StepWork(((0, 1), (1, 1)), 2)
        >>> cycle_of([b, a, a]), cycle_of([b, a, a, b]), cycle_of([a, a, a, a])
        (None, 3, 1)
        >>> later = [a, a, a, b, a, a]  # a trial of 6 steps, once a 5-step cycle is known
        >>> cycle_of(later), cycle_of(later, known=5)
        (None, 5)
    """
    if len(set(works)) <= 1:
        return 1
    n = len(works)
    if known is not None and all(works[i] == works[i + known] for i in range(n - known)):
        return known
    if any(works.count(w) < 2 for w in set(works)):
        return None
    return next(
        (p for p in range(1, n) if all(works[i] == works[i + p] for i in range(n - p))), None
    )


def steady_from(works: Sequence[StepWork]) -> int:
    """The step from which every step did the same work as the last one (0-based).

    Examples:
        >>> a, b = StepWork((), 1), StepWork(((0, 1),), 1)
        >>> steady_from([a, a, b, b, b])
        2
    """
    start = len(works) - 1
    while start > 0 and works[start - 1] == works[-1]:
        start -= 1
    return start


@dataclass(frozen=True)
class Schedule:
    """A step whose work varied, as the trial that showed it saw it.

    Attributes:
        works: that trial's steps.
        batch_size: its batch size.
        optimizers: each optimizer's description, by its number in ``works``.
        cycle: the steps after which the work repeats; ``None`` when it did not repeat within
            the trial (a one-off, or a cycle longer than the trial).
        trial_steps: the steps every trial runs since.
        alike_after: when the trial that showed it ran out (``works`` are the steps it
            completed), the steps a later trial then ran, all alike; else ``None``.
    """

    works: tuple[StepWork, ...]
    batch_size: int
    optimizers: tuple[str, ...]
    cycle: int | None
    trial_steps: int
    alike_after: int | None = None

    def describe(self) -> str:
        """The report's sentence."""
        n = len(self.works)
        said = []
        for number, name in enumerate(self.optimizers):
            at = [i + 1 for i, w in enumerate(self.works) if number in dict(w.stepped)]
            when = "at every step" if len(at) == n else _steps_words(at)
            said.append(f"{name} stepped {when}")
        backwards = [w.backwards for w in self.works]
        if len(set(backwards)) > 1:
            said.append(f"backward passes per step: {', '.join(map(str, backwards))}")
        steps = f"{n} step" + ("" if n == 1 else "s")
        over = f"over {steps}"
        if self.alike_after is not None:
            over = f"in the {steps} it completed before it ran out"
        seen = f"the step varies from call to call: at batch {self.batch_size}, {over}, "
        seen += "; ".join(said) if said else "no optimizer stepped"
        if self.alike_after is not None:
            return (
                f"{seen} (work no earlier step did): no cycle seen, the next trial ran "
                f"{self.alike_after} steps alike (a one-off, or a schedule longer than that, "
                f"which the trials do not cover: {spelled('--steps N', 'steps=N')} runs N steps)"
            )
        if self.cycle is not None:
            return (
                f"{seen}: a {self.cycle}-step cycle, so every trial runs {self.trial_steps} steps "
                "(the cycle and the step after it)"
            )
        return (
            f"{seen}: no cycle within {n} steps (a one-off, or a schedule longer than that, "
            f"which the trials do not cover: {spelled('--steps N', 'steps=N')} runs N steps); "
            "every trial runs "
            f"{self.trial_steps} steps"
        )


def _steps_words(at: Sequence[int]) -> str:
    if not at:
        return "at no step"
    if len(at) == 1:
        return f"at step {at[0]} only"
    return f"at steps {', '.join(map(str, at[:-1]))} and {at[-1]}"


class WorkLog:
    """What the trials have shown of the step's work, and what that asks of the next trials.

    ``usual`` holds the works the steps are known to go through (none before the first
    trial). A trial whose steps vary, or do a work not in ``usual``, brings news. A trial that
    completes steps on (:meth:`keeps_stepping`) until its steps repeat: a cycle, which every
    trial runs from then on with the step after it (``cycle_steps``); or ``max_steps``
    without one: every trial runs up to the step after the last change (a start-up such as a
    gradient scaler's skipped steps), and no trial steps on for news again (``settled``).
    News in a trial that ran out, with no cycle in the steps it completed, makes the next
    trials hunt: step on until their own steps vary and repeat (a hunt of ``max_steps`` steps
    alike settles). The fits of the trials before the latest news (``valid_from``, in the
    order run) were measured without it.
    """

    def __init__(self, watch: StepWatch, max_steps: int) -> None:
        self.watch = watch
        self.max_steps = max_steps
        self.cycle: int | None = None  # the steps after which the work repeats, once seen
        self.usual: frozenset[StepWork] = frozenset()
        self.hunting = False
        self.settled = False
        self.cycle_steps = 0  # the steps every trial runs to cover the cycle (0: none)
        self.valid_from = 0  # the first trial (in the order run) that ran with all the news
        self.schedule: Schedule | None = None
        self._news: tuple[tuple[StepWork, ...], int] = ((), 0)  # a failed trial's, and its size

    def _novel(self, works: Sequence[StepWork]) -> bool:
        return bool(self.usual) and any(w not in self.usual for w in works)

    def cycle_in(self, works: Sequence[StepWork]) -> int | None:
        """:func:`cycle_of` a trial's steps so far, against the known cycle unless they did a
        work not seen before."""
        return cycle_of(works, None if self._novel(works) else self.cycle)

    def keeps_stepping(self, works: Sequence[StepWork]) -> bool:
        """Whether a trial with these steps so far steps on for news: they vary with no cycle
        seen, or are all alike while hunting or doing a work not seen before."""
        if self.settled:
            return False
        cycle = self.cycle_in(works)
        return cycle is None or (cycle == 1 and (self.hunting or self._novel(works)))

    def note(
        self, works: Sequence[StepWork], batch_size: int, index: int, *, completed: bool, steps: int
    ) -> None:
        """After the trial ``index`` (in the order run), with ``steps`` asked of a trial: what
        its steps (of a trial that ran out, those it completed) say."""
        if self.settled or not works:
            return
        novel = self._novel(works)
        cycle = cycle_of(works, None if novel else self.cycle)
        if not self.usual and cycle == 1:  # the first steps seen, all alike
            self.usual = frozenset(works)
            return
        if not novel and (cycle == 1 or (cycle is not None and cycle == self.cycle)):
            if completed and self.hunting:  # max_steps alike: what varied does not come soon
                self.hunting, self.settled = False, True
                news, size = self._news
                self.schedule = Schedule(
                    news, size, tuple(self.watch.names), None, max(steps, self.cycle_steps),
                    alike_after=len(works),
                )  # fmt: skip
            return
        if not completed and cycle in (None, 1):
            self.hunting = True
            self.valid_from = index + 1
            self._news = (tuple(works), batch_size)
            return
        self.hunting = False
        if cycle in (None, 1):  # max_steps with no cycle (or all alike, doing a new work)
            self.settled = True
            needed = steady_from(works) + 1
        else:
            self.cycle = cycle
            needed = cycle + 1
        self.usual = frozenset(works)
        self.cycle_steps = max(self.cycle_steps, min(self.max_steps, needed))
        self.valid_from = index if completed else index + 1
        self.schedule = Schedule(
            tuple(works),
            batch_size,
            tuple(self.watch.names),
            None if self.settled else cycle,
            max(steps, self.cycle_steps),
        )
