"""``memkit.track``: the entry point that creates a :class:`~memkit.tracking.tracker.Tracker`.

Derived from :class:`Tracker`, not repeated: ``track`` takes :class:`Tracker`'s parameters
(its signature is :class:`Tracker`'s, for ``help()`` and for type checkers alike) and its
docstring's ``Args:`` are :class:`Tracker`'s.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import ParamSpec, TypeVar

from memkit.tracking.tracker import Tracker

__all__ = ["track"]

P = ParamSpec("P")
T = TypeVar("T")


def _docstring_section(doc: str | None, title: str) -> str:
    """The ``title:`` section of a Google-style docstring, to the next section or the end.

    >>> _docstring_section('''Summary.
    ...
    ...     Args:
    ...         x: a number.
    ...
    ...     Returns:
    ...         its double.
    ...     ''', "Args")
    'Args:\\n    x: a number.'
    """
    lines = inspect.cleandoc(doc or "").splitlines()
    start = lines.index(f"{title}:")
    end = start + 1
    while end < len(lines) and (not lines[end] or lines[end].startswith(" ")):
        end += 1
    return "\n".join(lines[start:end]).rstrip()


def _creator(cls: Callable[P, T], name: str, doc: str) -> Callable[P, T]:
    """A function named ``name`` that returns ``cls(*args, **kwargs)``: ``cls``'s signature,
    and ``doc`` with ``{args}`` replaced by ``cls``'s docstring's ``Args:`` section."""

    def create(*args: P.args, **kwargs: P.kwargs) -> T:
        return cls(*args, **kwargs)

    create.__name__ = create.__qualname__ = name
    create.__doc__ = inspect.cleandoc(doc).replace(
        "{args}", _docstring_section(cls.__doc__, "Args")
    )
    create.__signature__ = inspect.signature(cls).replace(  # type: ignore[attr-defined]
        return_annotation=getattr(cls, "__name__", "")
    )
    return create


track = _creator(
    Tracker,
    "track",
    """Track memory per device, phase, step and module while the ``with`` block runs.

    Returns a :class:`~memkit.tracking.tracker.Tracker` (its parameters below); after the
    block, ``tracker.report()`` is the :class:`~memkit.tracking.report.TrackReport`.

    Under a ``torch.distributed`` process group every rank tracks its own device, and when
    the block ends (or when the script calls ``destroy_process_group()``) each rank's summary
    is gathered to rank 0, whose ``report().ranks`` holds the per-rank table, the imbalance,
    the rank closest to its capacity and the DDP advice (docs/distributed.md). All ranks must
    run the block; a rank missing for ``gather_timeout`` seconds leaves a note, not a hang.

    {args}

    Examples:
        >>> import torch, memkit
        >>> model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(),
        ...                             torch.nn.Linear(256, 10))
        >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> with memkit.track(model, opt, device="cpu", budget="64MiB") as tracker:
        ...     for _ in range(3):
        ...         model(torch.randn(32, 64)).sum().backward()
        ...         opt.step(); opt.zero_grad()
        >>> report = tracker.report()
        >>> report.steps, report.devices[0].phase_peaks["backward"] is not None
        (3, True)
    """,
)
