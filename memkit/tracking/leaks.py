"""Leaks: memory that grows from one step boundary to the next, and the variable behind it.

A healthy training loop leaves each step at the same level: activations are freed, gradients
and optimizer state are reused. :class:`GrowthDetector` watches those levels and flags growth
above their high-water mark that persists for ``window`` rises without a fall (after
``warmup`` steps, while gradients and optimizer state are created).

The classic cause is a tensor that still carries an autograd graph after the optimizer step,
held by a live variable: ``running_loss += loss`` (with ``retain_graph=True`` or without a
backward the graph keeps its saved activations), ``history.append(logits)``. :func:`scan_frames`
walks the frames of the training thread (the thread that runs the step boundary) and finds
locals that are such tensors, or shallow containers of them, or attributes of ``self`` or of the
script's own objects (``losses.sum``). Two scans
a step apart tell a growing graph (a suspect) from the step's own ``loss``: a graph that grows
still holds a root the earlier scan saw; a ``loss`` built afresh holds none, even when it is
larger (progressive unfreezing).

It runs only when growth is detected, and in rounds of three graph scans every
:data:`SCAN_PERIOD` steps, never on every step: frame inspection costs tens to hundreds of
microseconds and would not be free to leave on.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import inspect
import itertools
import linecache
import logging
import math
import os
import re
import sys
import tokenize
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from types import CodeType, FrameType
from typing import Any

from memkit.optimizers import unwrap_optimizer
from memkit.tracking.line_trace import LineTrace, empty_locals_copy
from memkit.tracking.report import LeakFinding, LeakSuspect
from memkit.units import format_size

__all__ = [
    "GRAPH_NODE_LIMIT",
    "Candidate",
    "GrowthDetector",
    "LeakWatch",
    "compare_scans",
    "explained_growth_note",
    "graph_size",
    "growth_finding",
    "scan_frames",
]

log = logging.getLogger(__name__)

GRAPH_NODE_LIMIT = 20_000
"""Autograd nodes counted at most per tensor (bounds the cost on huge leaked graphs)."""

SCAN_PERIOD = 25
"""Steps between rounds of three graph scans (leaks that device memory does not show)."""

_CONTAINER_PEEK = 3
"""Elements looked at from each end of a list/tuple (and values of a dict)."""

_OBJECT_TENSORS = 256
"""Values looked at inside one object a container holds (a key-value cache's layers)."""

_OBJECTS = 16
"""The user's objects (not ``self``) whose attributes a scan looks at, per frame."""

_OBJECT_ATTRS = 32
"""The attributes a scan looks at per object (the first assigned: ``AverageMeter.sum``)."""

_MEMKIT_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


def _library_dirs() -> tuple[str, ...]:
    global _LIBRARY_DIRS
    if _LIBRARY_DIRS is not None:
        return _LIBRARY_DIRS
    dirs = [_MEMKIT_DIR]
    torch = sys.modules.get("torch")
    torch_file = getattr(torch, "__file__", None)
    if torch_file:
        dirs.append(os.path.dirname(os.path.abspath(torch_file)) + os.sep)
    dirs.append(os.path.dirname(os.path.abspath(os.__file__)) + os.sep)  # the stdlib (runpy...)
    if not torch_file:
        return tuple(dirs)
    _LIBRARY_DIRS = tuple(dirs)  # fixed once torch is imported
    return _LIBRARY_DIRS


_LIBRARY_DIRS: tuple[str, ...] | None = None

_USER_FILES: dict[str, bool] = {}
"""Absolute code file names -> whether their frames are the user's (:func:`_user_frames`)."""


def _is_user_file(filename: str, skip: tuple[str, ...]) -> bool:
    known = _USER_FILES.get(filename)
    if known is not None:
        return known
    user = not os.path.abspath(filename).startswith(skip) and not filename.startswith("<frozen")
    if os.path.isabs(filename) and skip is _LIBRARY_DIRS:  # a relative one moves with the cwd
        if len(_USER_FILES) > 4096:
            _USER_FILES.clear()
        _USER_FILES[filename] = user
    return user


class GrowthDetector:
    """Flags allocated memory that climbs from step boundary to step boundary.

    A healthy loop comes back to the same level at every boundary. A leak climbs a staircase:
    every step (``running_loss += loss`` with its graph), or every N steps (an evaluation every
    N steps that keeps its loss with the graph). Its memory never comes back, so each of its
    rises takes the level above the highest it has been since the warm-up (the high-water
    mark): a rise counts only above that mark. Levels that go up and down (batches or
    episodes of varying length, an evaluation's drop and the rise back to where the level was)
    stay below it. The detector follows the levels since they last came down and calls it a
    leak at the ``window``-th rise; any fall starts over (the mark stays). The climb starts
    at the mark just before its first rise: its numbers describe the rises (for a staircase,
    the bytes of its typical rise and the steps between two rises). Rises far smaller than
    the typical one (a few hundred bytes a step before each evaluation) count as rises but
    do not set the steps between two rises.

    Growth that stops is not a leak: an optimizer whose history fills up (LBFGS keeps
    ``history_size`` entries), a cache that reaches its size. After a leak was called,
    :attr:`stopped` says the level has not risen for ``max(window, 2 * period)`` boundaries
    (``period``: the steps between two rises of the climb), so a leak that rises every N
    steps is not taken for a plateau between its rises.

    Nor is growth of the persistent bytes (parameters, gradients, optimizer state): parameters
    made trainable mid-run (progressive unfreezing) get gradients and optimizer state. A rise
    observed with ``persistent`` bytes that grew since the last ones given is :attr:`explained`
    by as much (all of it when at most an eighth is left: the allocator rounds new tensors
    up); only the rest counts.

    Args:
        warmup: step boundaries ignored at the start (gradients and optimizer state appear).
        window: rises (without a fall in between) needed to call it a leak.
        min_growth: bytes below which a rise is ignored (allocator rounding).
    """

    def __init__(self, warmup: int = 2, window: int = 3, min_growth: int = 1) -> None:
        self.warmup = warmup
        self.window = window
        self.min_growth = min_growth
        self._start: tuple[int, int] | None = None  # (step, high-water mark) before the climb
        self._last = 0
        self._high: int | None = None  # the highest level observed after the warm-up
        self._rise_steps: list[int] = []  # the steps of the climb's rises
        self._rise_bytes: list[int] = []  # and their bytes (less explained)
        self._explained_in_climb = 0  # bytes of the climb's rises that persistent bytes explain
        self._persistent: int | None = None  # the last persistent bytes given
        self._seen = 0
        self.finding: tuple[int, int, int] | None = None  # (growth/step, first step, steps)
        self.grown = 0  # the bytes that climb grew by, first step to the last (less explained)
        self.period = 1  # steps between two rises of the climb that was called a leak
        self.last_rise = -1  # the step of the last rise of that climb
        self.last_step = -1  # the last boundary observed
        self.explained: list[tuple[int, int]] = []  # (step, bytes): rises of persistent bytes

    @property
    def rises(self) -> int:
        """Rises of the current climb."""
        return len(self._rise_steps)

    @property
    def stopped(self) -> bool:
        """A leak was called, and the level has not risen since for ``max(window, 2 *
        period)`` step boundaries: the growth plateaued (or came back down)."""
        if self.finding is None:
            return False
        return self.last_step - self.last_rise >= max(self.window, 2 * self.period)

    @property
    def climb_start(self) -> int | None:
        """The step the current climb began at (its mark), if one began."""
        return None if self._start is None else self._start[0]

    def wants_persistent(self, allocated: int) -> bool:
        """Whether :meth:`observe` at ``allocated`` would use the persistent bytes: a rise
        after the warm-up, or the first boundary after it (the bytes a rise is compared to).
        Measuring them walks the parameters and optimizer state: only then."""
        if self._seen + 1 <= self.warmup:
            return False
        if self._persistent is None:
            return True
        return self._high is not None and allocated - self._high >= self.min_growth

    def observe(self, step: int, allocated: int, persistent: int | None = None) -> bool:
        """Record a boundary level (``persistent``: the bytes of parameters, gradients and
        optimizer state now, if measured); return True at the ``window``-th rise of a climb
        (and at every further rise)."""
        self._seen += 1
        self.last_step = step
        before = self._persistent
        if persistent is not None:
            self._persistent = persistent
        if self._seen <= self.warmup:
            return False
        high = self._high
        self._high = allocated if high is None else max(high, allocated)
        if high is None or allocated < self._last:
            self._start, self._last = (step, self._high), allocated
            self._rise_steps, self._rise_bytes, self._explained_in_climb = [], [], 0
            return False
        rise = allocated - high  # above the mark: memory the device never held before
        self._last = allocated
        explained = 0
        if persistent is not None and before is not None and rise >= self.min_growth:
            explained = max(0, min(rise, persistent - before))
            if (rise - explained) * 8 <= explained:  # the rest: rounding the new tensors (a
                explained = rise  # leak in the same step beyond an eighth of them still counts)
        if explained:
            self.explained.append((step, explained))
            self._explained_in_climb += explained
        if rise - explained < self.min_growth:
            if not self._rise_steps:  # the climb has not begun: it would begin here
                self._start, self._explained_in_climb = (step, self._high), 0
            return False
        rises = self._rise_steps
        rises.append(step)
        self._rise_bytes.append(rise - explained)
        if len(rises) < self.window:
            return False
        first_step, first = self._start or (step, high)  # set with the mark
        grown = allocated - first - self._explained_in_climb
        steps = step - first_step
        steps_of, bytes_of = _merged_runs(rises, self._rise_bytes)
        carrying = _carrying(bytes_of)
        stairs = [s for s, b in zip(steps_of, bytes_of, strict=True) if b >= carrying]
        if len(stairs) < 2:  # one rise carries the growth: no spacing yet, all rises give it
            stairs = steps_of
        period = max(1, round((stairs[-1] - stairs[0]) / (len(stairs) - 1)))
        # steady growth: the average over the steps; a staircase: its typical rise (the
        # first can carry one-off allocations too) over its period
        per_step = grown // steps if period == 1 else _typical(bytes_of) // period
        if steps and per_step * steps > grown * 1.1:  # stairs of varying height: the typical
            per_step = grown // steps  # one said more than the whole climb (sweep CD)
        self.finding = (per_step, first_step, steps)
        self.grown = grown
        self.period = period
        self.last_rise = step
        return True


def _merged_runs(steps: list[int], rises: list[int]) -> tuple[list[int], list[int]]:
    """Pairs of rises at consecutive step boundaries as one rise (its last step, their
    bytes), in a sparse staircase: one iteration's growth seen over two boundaries (a PPO
    rollout whose kept values land partly before the update's first step) is one stair, not
    two. A climb that rises at most boundaries (steady growth, a missed boundary or not; a
    stair every 2 steps with bumps between) or in runs of more than two is left as it is.

    >>> _merged_runs([15, 16, 31, 32, 47, 48], [64, 133, 64, 133, 64, 133])
    ([16, 32, 48], [197, 197, 197])
    >>> _merged_runs([3, 4, 5, 7, 8, 9], [1, 1, 1, 1, 1, 1])  # steady, one boundary missed
    ([3, 4, 5, 7, 8, 9], [1, 1, 1, 1, 1, 1])
    >>> _merged_runs([3, 4, 7, 8, 11, 12], [140, 70, 140, 70, 140, 70])  # every 4th, in two
    ([4, 8, 12], [210, 210, 210])
    """
    # rises at more than half the boundaries (a climb that starts and ends on a pair of
    # rises every 4 steps spans two boundaries fewer than its stairs: sweep CB's evaluation
    # every 4th episode, called 'every 2 steps')
    if 2 * len(steps) > steps[-1] - steps[0] + 3:
        return steps, rises
    merged_steps: list[int] = []
    merged: list[int] = []
    run = 0
    for step, rise in zip(steps, rises, strict=True):
        if merged_steps and step == merged_steps[-1] + 1:
            run += 1
            if run > 1:  # three boundaries in a row: not one stair seen twice
                return steps, rises
            merged_steps[-1], merged[-1] = step, merged[-1] + rise
        else:
            run = 0
            merged_steps.append(step)
            merged.append(rise)
    if len(merged_steps) < 2:
        return steps, rises
    return merged_steps, merged


_ALLOCATOR_BUMP = 16
"""A rise this many times smaller than the climb's typical rise does not carry its growth
(an allocator-sized bump a step before each evaluation that keeps its graph)."""


def _typical(rises: list[int]) -> int:
    """The rise that carries a climb's growth: the smallest rise such that the rises at
    least as large carry half the bytes (a median weighted by bytes: small bumps weigh
    nothing, however many)."""
    ordered = sorted(rises, reverse=True)
    half, carried = sum(ordered) / 2, 0
    for rise in ordered:
        carried += rise
        if carried >= half:
            return rise
    return ordered[-1]


def _carrying(rises: list[int]) -> int:
    """The least bytes of a rise that carries the climb's growth (its steps set the period)."""
    return _typical(rises) // _ALLOCATOR_BUMP


def explained_growth_note(device: str, growth: GrowthDetector) -> str | None:
    """A note for rises of ``device``'s level that new parameters, buffers, gradients or
    optimizer state account for (parameters made trainable mid-run; a buffer grown to a
    longer input), if any."""
    if not growth.explained:
        return None
    total = sum(b for _, b in growth.explained)
    steps = ", ".join(str(s) for s, _ in growth.explained[:8])
    more = ", ..." if len(growth.explained) > 8 else ""
    said = (
        f"{device}: memory rose by {format_size(total)} at step(s) {steps}{more}, all of it "
        "the model's parameters and buffers, gradients and optimizer state"
    )
    if _still_rising(growth):  # not a few events: state that grows with the steps
        return (
            f"{said}, at {len(growth.explained)} steps: state that grows step after step runs "
            "out in a long run (SGD's momentum on sparse gradients appends each step's rows "
            "uncoalesced: SparseAdam or Adagrad keep a fixed size; a model grown at every "
            "step); where it stops growing, it is no leak"
        )
    return (
        f"{said} (parameters made trainable mid-run, e.g. progressive unfreezing, or new "
        "parameter groups; a buffer a module grows to a longer input, e.g. a cached causal "
        "mask; or a new model while earlier ones stay alive): not a leak"
    )


_STEADILY = 8
"""Rises of the persistent bytes at this many steps, still going on at the end, are growth
with the steps, not a few events (unfreezing stages, a mask grown to the longest input)."""


def _still_rising(growth: GrowthDetector) -> bool:
    """Whether the persistent bytes rose at :data:`_STEADILY` steps or more and were still
    rising when the run ended (within twice their spacing), as :attr:`GrowthDetector.stopped`
    asks of a climb: growth that stopped (the longest input seen, the last layer unfrozen) is
    no leak however many steps it took."""
    steps = [s for s, _ in growth.explained]
    if len(steps) < _STEADILY:
        return False
    spacing = max(1, round((steps[-1] - steps[0]) / (len(steps) - 1)))
    return growth.last_step - steps[-1] < max(growth.window, 2 * spacing)


@dataclass
class Candidate:
    """One variable found holding an autograd graph in one scan, or (scans for holders) a
    container holding device tensors."""

    name: str
    function: str
    filename: str
    frame_line: int
    kind: str
    size: int  # graph nodes (a tensor's; a container's, plus its length)
    code: CodeType  # the frame's code: first_line reads its source only when asked
    scalar: bool = True  # its graphs end in one-element tensors (a loss), not in states
    length: int = 0  # a container's length
    nodes: frozenset[NodeKey] = frozenset()  # its graph's nodes (:func:`node_key`), but
    # the parameters' AccumulateGrad nodes (every step's graph shares them)
    carries: bool | None = None  # its graph holds a node of the scan it was compared to
    graph: bool = True  # it holds an autograd graph (else: a container of device tensors)
    nbytes: int = 0  # a container's device tensors, estimated (its first item's, and
    # item_bytes for each other one)
    item_bytes: int = 0  # what one more item of it holds on the device (storages new to it)
    item_shape: tuple[int, ...] | None = None  # its last item's (or its own) tensor's shape
    maxlen: int | None = None  # a deque's
    owner: type | None = None  # an object's attribute: the class whose methods grow it

    @functools.cached_property
    def _line(self) -> tuple[str, str, int, bool]:
        if self.owner is not None:
            found = _line_in_class(self.owner, self.name.rsplit(".", 1)[1], self.graph)
            if found is not None:
                return found
        line, built, _ = self._lines
        return self.filename, _code_at(self.code, line).co_name, line, built

    @functools.cached_property
    def _lines(self) -> tuple[int, bool, tuple[int, ...]]:
        return _first_line(self.code, self.frame_line, self.name, self.graph)

    @property
    def ties(self) -> dict[CodeType, frozenset[int]]:
        """Where the lines that grow it alike are, when there are several (a global list
        appended at the top level and in a function, in branches of which one runs): the
        source cannot tell which runs (:mod:`memkit.tracking.line_trace` sees it)."""
        if self.owner is not None:
            return {}
        _, _, lines = self._lines
        out: dict[CodeType, set[int]] = {}
        for line in lines:
            out.setdefault(_code_at(self.code, line), set()).add(line)
        return {code: frozenset(found) for code, found in out.items()}

    @property
    def first_line(self) -> int:
        """The line that grows or assigns the variable (reading the source costs more than
        a scan: only suspects need it)."""
        return self._line[2]

    @property
    def place(self) -> tuple[str, str]:
        """The file and function of :attr:`first_line` (a script's global: the function the
        line is in; an object's attribute: its class's method that grows it,
        ``ReplayMemory.push``)."""
        return self._line[0], self._line[1]

    @property
    def built_on_itself(self) -> bool:
        """That line grows it (``+=``, ``.append(``) or builds it from itself
        (``y, h = model(x, h)``): the variable a growing graph is kept in, not one derived
        from it (a ``logs`` dict, the ``loss`` computed through an RNN's ``hidden``)."""
        return self._line[3]


NodeKey = tuple[int, int]
"""An autograd node's identity across scans: its ``id`` and its sequence number."""


def node_key(node: Any) -> NodeKey:
    """``node``'s :data:`NodeKey`. The sequence number counts the nodes a thread creates: two
    nodes of the training thread never share one, so a dead node's address taken by a new
    node does not pass for it (other threads count on their own, from 0 in each new one:
    DataParallel's replicas; their nodes are never a variable's root)."""
    seq = getattr(node, "_sequence_nr", None)
    return id(node), (seq() if seq is not None else -1)


def graph_size(tensor: Any, limit: int = GRAPH_NODE_LIMIT) -> int:
    """Autograd nodes reachable from ``tensor.grad_fn``, counted up to ``limit``."""
    return graph_nodes([tensor], limit)


def graph_nodes(tensors: Iterable[Any], limit: int = GRAPH_NODE_LIMIT) -> int:
    """Autograd nodes reachable from the ``grad_fn`` of any of ``tensors`` (each once),
    counted up to ``limit``."""
    return len(_walk(tensors, limit))


_SHARED_SEQUENCE_NR = 2**64 - 1
"""The sequence number of AccumulateGrad nodes: a parameter's, in every step's graph."""


def _walk(tensors: Iterable[Any], limit: int) -> dict[int, Any]:
    """Autograd nodes reachable from the ``grad_fn`` of any of ``tensors`` (each once, up to
    ``limit``), by ``id``."""
    seen: dict[int, Any] = {}
    stack = []
    for tensor in tensors:
        root = getattr(tensor, "grad_fn", None)
        if root is not None and id(root) not in seen:
            seen[id(root)] = root
            stack.append(root)
    while stack and len(seen) < limit:
        node = stack.pop()
        for nxt, _ in getattr(node, "next_functions", ()):
            if nxt is not None and (i := id(nxt)) not in seen:
                seen[i] = nxt
                stack.append(nxt)
    return seen


def _saved_storages(
    tensor: Any, torch: Any, exclude: frozenset[int], limit: int = GRAPH_NODE_LIMIT
) -> dict[int, int]:
    """The storages (address -> bytes) of the tensors the autograd graph behind ``tensor``
    still saves for its backward (up to ``limit`` nodes): none for a graph a backward has
    freed (a finished step's loss), the activations of the nodes a failed backward did not
    reach, all of them for a graph no backward ran through. Read without unpacking them (a
    saved-tensor hook's, a checkpoint's or ``save_on_cpu``'s, is not run: those are left out),
    custom autograd Functions' too; the storages in ``exclude`` (the parameters) are not."""
    seen: dict[int, int] = {}
    if not hasattr(torch._C._autograd.SavedTensor, "data"):
        return seen  # (torch < 2.10 reads them only by unpacking: a checkpoint would rerun)
    plain = (torch.Tensor, torch.nn.Parameter)
    for node in _walk([tensor], limit).values():
        for name in _raw_saved_names(type(node).__name__, type(node)):
            try:
                value = getattr(node, name)
                saved = value if isinstance(value, (tuple, list)) else (value,)
                tensors: list[Any] = [
                    getattr(st, "data", None)
                    for st in saved
                    if getattr(st, "unpack_hook", None) is None
                ]
            except RuntimeError:  # freed by a backward that ran through this node
                break
            for t in tensors:
                if type(t) in plain and t.layout is torch.strided:
                    storage = t.untyped_storage()
                    ptr = storage.data_ptr()
                    if ptr not in exclude:
                        seen[ptr] = storage.nbytes()
    return seen


_RAW_SAVED: dict[str, tuple[str, ...]] = {}


def _raw_saved_names(kind: str, node_type: type) -> tuple[str, ...]:
    """The attributes of an autograd node type (``kind``: its name) that hold its saved
    tensors without unpacking them."""
    names = _RAW_SAVED.get(kind)
    if names is None:
        names = _RAW_SAVED[kind] = tuple(n for n in dir(node_type) if n.startswith("_raw_saved_"))
    return names


def graph_holders(
    start: FrameType | None,
    exclude: frozenset[int] = frozenset(),
    among: frozenset[int] | None = None,
) -> tuple[list[tuple[str, str, int]], int]:
    """The variables in the user frames from ``start`` outwards that hold a tensor whose
    autograd graph still saves tensors for a backward (``(name, function, line)``, the one
    saving most first), and the bytes those saved tensors hold together (the storages in
    ``exclude``, the models' parameters, left out); ``among``: only the tensors of these ids."""
    torch = sys.modules.get("torch")
    if torch is None:
        return [], 0
    holders: list[tuple[int, tuple[str, str, int]]] = []
    union: dict[int, int] = {}
    seen: set[int] = set()
    for frame in _user_frames(start):
        for name, value, _ in _frame_values(frame, torch):
            if id(value) in seen or not _has_graph(value, torch.Tensor):
                continue
            if among is not None and id(value) not in among:
                continue
            seen.add(id(value))
            saved = _saved_storages(value, torch, exclude)
            if saved:
                union.update(saved)
                holders.append((sum(saved.values()), (name, frame.f_code.co_name, frame.f_lineno)))
    holders.sort(key=lambda h: -h[0])
    return [h for _, h in holders], sum(union.values())


def appended_losses(start: FrameType | None) -> tuple[str, ...]:
    """Containers in the user frames from ``start`` outwards that a line grows
    (``losses.append(loss)``) with one-element tensors still holding their autograd graphs,
    two or more: each keeps its step's activations (a leak that runs out before the growth
    detector's window, sweep CO: at step 4 of a loop keeping every loss). Described as
    ``"`losses` (4 of them, train() in train.py:61)"``; () when none, or when the scan fails."""
    try:
        found = scan_frames(start)
    except Exception:  # inspection must never break the post-mortem
        log.debug("loss scan failed", exc_info=True)
        return ()
    return tuple(
        f"`{c.name}` ({c.length} of them, {c.place[1]}() in "
        f"{os.path.basename(c.place[0])}:{c.first_line})"
        for c in found
        if c.kind == "container" and c.graph and c.scalar and c.length >= 2 and c.built_on_itself
    )


def _own_nodes(nodes: dict[int, Any]) -> frozenset[NodeKey]:
    """The keys of ``nodes`` but the parameters' AccumulateGrad nodes."""
    keys = (node_key(n) for n in nodes.values())
    return frozenset(k for k in keys if k[1] != _SHARED_SEQUENCE_NR)


def _has_graph(value: Any, tensor_type: type) -> bool:
    return isinstance(value, tensor_type) and getattr(value, "grad_fn", None) is not None


def _peek(value: Any) -> list[Any] | None:
    """A list's, tuple's or deque's first and last few items, a dict's first few values
    (``None``: not such a container)."""
    if isinstance(value, (list, tuple)):
        n = len(value)
        return [*value[:_CONTAINER_PEEK], *value[max(_CONTAINER_PEEK, n - _CONTAINER_PEEK) :]]
    if isinstance(value, collections.deque):
        return [*itertools.islice(value, _CONTAINER_PEEK), *_tail(value)]
    if isinstance(value, dict):
        return list(itertools.islice(value.values(), 2 * _CONTAINER_PEEK))
    return None


def _weights(value: Any, items: list[Any], torch: Any) -> bool:
    """Whether ``value``'s items seen (``items``, and a dict's last few too) are all
    parameters: ``params = list(model.parameters())`` for the optimizer or gradient clipping
    holds the model's weights, never what grows."""
    if isinstance(value, dict):
        items = [*items, *_tail(value)]
    return all(isinstance(item, torch.nn.Parameter) for item in items)


def _tail(value: Any) -> list[Any]:
    """A list's, tuple's, deque's or dict's last few items (values), oldest first, past its
    first few (``[]`` when it holds no more than those)."""
    n = len(value)
    if n <= _CONTAINER_PEEK:
        return []
    if isinstance(value, dict):
        items = list(itertools.islice(reversed(value.values()), _CONTAINER_PEEK))
        return items[: n - _CONTAINER_PEEK][::-1]
    return [value[i] for i in range(max(_CONTAINER_PEEK, n - _CONTAINER_PEEK), n)]


def tensors_within(values: Iterable[Any], tensor_type: type, limit: int = 4096) -> list[Any]:
    """The tensors among ``values`` and up to three levels inside them: tuples, lists,
    mappings and plain objects' attributes (a key-value cache: transformers' legacy tuples of
    ``(key, value)`` per layer, its ``DynamicCache`` of layers holding ``keys`` and
    ``values``); not inside modules or classes. Stops after about ``limit`` values (a
    training forward's output, walked at every step: tensors cost a check each)."""
    torch = sys.modules.get("torch")
    leaf = (str, bytes, int, float, type) if torch is None else _leaf_types(torch)
    found: list[Any] = []
    todo: list[tuple[Any, int]] = []
    for value in values:
        if isinstance(value, tensor_type):
            found.append(value)
        elif value is not None and not isinstance(value, leaf):
            todo.append((value, 1))
    looked = 0
    while todo and looked < limit:
        value, depth = todo.pop()
        if isinstance(value, (tuple, list, collections.deque)):
            inner: Any = value
        elif isinstance(value, Mapping):
            inner = value.values()
        else:
            inner = getattr(value, "__dict__", None)
            if not isinstance(inner, dict):
                continue
            inner = inner.values()
        room = limit - looked
        looked += len(inner)
        for item in itertools.islice(inner, room):
            if isinstance(item, tensor_type):
                found.append(item)
            elif depth < 3 and item is not None and not isinstance(item, leaf):
                todo.append((item, depth + 1))
    return found


@functools.lru_cache(maxsize=1)
def _leaf_types(torch: Any) -> tuple[type, ...]:
    """What :func:`tensors_within` never looks into: numbers, strings, classes, modules,
    devices and dtypes."""
    return (str, bytes, int, float, type, torch.nn.Module, torch.device, torch.dtype)


def _item_tensors(item: Any, tensor_type: type) -> list[Any]:
    """The tensors of one container item: itself, or inside it and one level deeper (a
    ``(state, action, reward)`` transition, a dict of outputs), or in a plain object's
    attributes (a key-value cache: :func:`tensors_within`)."""
    if isinstance(item, tensor_type):
        return [item]
    if _peek(item) is None:
        return tensors_within((item,), tensor_type, _OBJECT_TENSORS)
    found = []
    for inner in _peek(item) or ():
        if isinstance(inner, tensor_type):
            found.append(inner)
        else:
            found += [v for v in _peek(inner) or () if isinstance(v, tensor_type)]
    return found


def _storages(tensors: list[Any], counts: Callable[[Any], bool]) -> dict[tuple[int, int], int]:
    """The storages of ``tensors`` on the device ``counts`` says: ``(address, bytes)`` ->
    bytes (a sparse tensor, or one without storage, adds nothing)."""
    out = {}
    for t in tensors:
        with contextlib.suppress(Exception):
            if counts(t):
                storage = t.untyped_storage()
                nbytes = int(storage.nbytes())
                out[(storage.data_ptr(), nbytes)] = nbytes
    return out


def _held_bytes(
    value: Any, tensor_type: type, counts: Callable[[Any], bool]
) -> tuple[int, int, tuple[int, ...] | None]:
    """What the container ``value`` holds on the device: ``(item bytes, total bytes, the shape
    of the last item's largest tensor)``. The item bytes are what one more item adds, from its
    last few items: the storages each adds to those before it (a transition's ``next_state``
    is the next one's ``state``: counted once); the total, its first item's and as much for
    each other one."""
    head = _peek(value) or []
    tail = _tail(value) or head[-_CONTAINER_PEEK:]
    if not tail:
        return 0, 0, None
    parts = [_item_tensors(item, tensor_type) for item in tail]
    # the last item's largest tensor (a turn's scores beside its tokens)
    last = max(parts[-1], key=lambda t: t.numel() * t.element_size(), default=None)
    shape = None if last is None else tuple(map(int, last.shape))
    seen = _storages(parts[0], counts)
    if len(parts) == 1:
        item = sum(seen.values())
    else:
        added = 0
        for tensors in parts[1:]:
            for key, nbytes in _storages(tensors, counts).items():
                if key not in seen:
                    seen[key] = nbytes
                    added += nbytes
        item = added // (len(parts) - 1)
    first = sum(_storages(_item_tensors(head[0], tensor_type), counts).values())
    return item, first + item * (len(value) - 1), shape


def _container_graph(value: Any, tensor_type: type) -> list[Any]:
    """The graph-carrying tensors among a container's peeked items, and two levels deep (a
    dict of per-step dicts of metrics, a list of ``(loss, logits)`` pairs); none: not such a
    container."""
    items = _peek(value)
    if items is None:
        return []
    found = []
    for item in items:
        if _has_graph(item, tensor_type):
            found.append(item)
        elif (inner := _peek(item)) is not None:
            found += [v for v in inner if _has_graph(v, tensor_type)]
        elif not isinstance(item, tensor_type):
            objects = tensors_within((item,), tensor_type, _OBJECT_TENSORS)
            found += [v for v in objects if _has_graph(v, tensor_type)]
    return found


def _user_frames(start: FrameType | None, limit: int = 30) -> Iterator[FrameType]:
    skip = _library_dirs()
    frame = start
    depth = 0
    while frame is not None and depth < limit:
        if _is_user_file(frame.f_code.co_filename, skip):
            yield frame
        frame = frame.f_back
        depth += 1


def _frame_locals(frame: FrameType) -> dict[str, Any]:
    """A copy of ``frame``'s locals (a script's top level: its globals; ``{}`` for an exotic
    frame)."""
    try:
        names = dict(frame.f_locals)
    except Exception:  # exotic frames
        return {}
    empty_locals_copy(frame)  # (left filled, it kept the loop's `x` after it was reassigned)
    return names


def optimizers_in_frames(start: FrameType | None) -> list[Any]:
    """The ``torch.optim.Optimizer`` objects among the locals of the first user frame from
    ``start`` outwards that has any (a script's top level: its globals), or among the
    attributes of a local ``self``, or in a dict, list or tuple one of those holds (one
    optimizer per parameter, stepped in a gradient hook: sweep BH): the script trains,
    though no optimizer stepped yet."""
    torch = sys.modules.get("torch")
    if torch is None:
        return []
    optimizer = torch.optim.Optimizer
    for frame in _user_frames(start):
        names = _frame_locals(frame)
        values = list(names.values())
        owner = names.get("self")
        if owner is not None and hasattr(owner, "__dict__"):
            with contextlib.suppress(TypeError):
                values += list(vars(owner).values())
        for value in list(values):
            if isinstance(value, dict):
                values += itertools.islice(value.values(), 100_000)
            elif isinstance(value, (list, tuple)):
                values += value[:100_000]
        found = {id(v): v for v in values if isinstance(v, optimizer)}
        if found:  # (unwrapped: accelerate's AcceleratedOptimizer is an Optimizer too)
            inner = (unwrap_optimizer(v) for v in found.values())
            return list({id(o): o for o in inner if o is not None}.values())
    return []


def compiled_in_frames(start: FrameType | None, optimizers: list[Any]) -> str | None:
    """The name of a ``torch.compile``'d function (not a module: those are found running) in
    the user frames from ``start`` outwards, their globals included, or of an optimizer's
    compiled ``step``; ``None`` if there is none."""
    for frame in _user_frames(start):
        for names in (_frame_locals(frame), frame.f_globals):
            for name, value in list(names.items()):
                if _compiled_function(name, value):
                    return name
    for optimizer in optimizers:
        if hasattr(getattr(optimizer, "__dict__", {}).get("step"), "_torchdynamo_orig_callable"):
            return f"{type(optimizer).__name__}.step"
    return None


def uncounted_tensors(
    start: FrameType | None, counted: Callable[[Any], bool], least: int = 1 << 20
) -> list[tuple[str, int]]:
    """``(name, bytes)`` of what the user frames from ``start`` outwards (as a leak scan sees
    them) hold of ``least`` bytes or more in tensors whose storage ``counted`` says the
    simulated device does not count, largest first: a tensor, or a list, deque or tuple of
    them or of tuples of them (a replay buffer's transitions: sweep CD); a dataset in host
    memory, or a buffer the script makes between steps and indexes in them (a PPO
    rollout's)."""
    torch = sys.modules.get("torch")
    if torch is None:
        return []
    from memkit.simulated.accountant import held_storages  # (torch is loaded: see above)

    seen: set[int] = set()
    found: list[tuple[str, int]] = []
    for frame in _user_frames(start):
        for name, value, _ in _frame_values(frame, torch):
            held = held_storages(value, counted)
            size = sum(n for ptr, n in held.items() if ptr not in seen)
            seen.update(held)
            if size >= least:
                found.append((name, size))
    return sorted(found, key=lambda f: -f[1])


def _compiled_function(name: str, value: Any) -> bool:
    """Whether ``value`` is a ``torch.compile``'d function: not Dynamo's own
    ``__compiled_fn_N`` in a module's globals, not a ``@torch.compiler.disable``'d one (which
    carries the attribute too), not a module (review 3)."""
    if name.startswith("__") or not hasattr(value, "_torchdynamo_orig_callable"):
        return False
    torch = sys.modules.get("torch")
    is_module = torch is not None and isinstance(value, torch.nn.Module)
    return not is_module and not getattr(value, "_torchdynamo_disable", False)


def framework_optimizers(start: FrameType | None, limit: int = 60) -> list[Any]:
    """The optimizer a framework's own frame holds as ``self.optimizer`` (transformers'
    ``Trainer`` run as ``Trainer(...).train()``: no user frame holds it; sweep BX: a step-0 OOM
    under ``memkit run`` then left AdamW's state to come out, and the cut it advised ran out),
    unwrapped (accelerate's ``AcceleratedOptimizer``). For a traceback's finished frames (an
    OOM's): a running frame's locals read here would stay in its ``f_locals`` copy."""
    frame, depth = start, 0
    while frame is not None and depth < limit:
        owner = _frame_locals(frame).get("self") if frame.f_code.co_argcount else None
        try:  # (a framework's property may raise: at an OOM, never memkit's error)
            held = getattr(owner, "optimizer", None) if owner is not None else None
            inner = unwrap_optimizer(held) if held is not None else None
        except Exception:
            inner = None
        if inner is not None:
            return [inner]
        frame, depth = frame.f_back, depth + 1
    return []


_ASSIGN = r"(?<![\w.])(?:self\.)?{name}\s*(\+=|-=|\*=|=(?!=)|\.append\(|\.extend\(|\[[^\]]*\]\s*=)"


_ASSIGN_ATTR = r"(?<![\w.])self\.{name}\s*(\+=|-=|\*=|=(?!=)|\.append\(|\.extend\(|\[[^\]]*\]\s*=)"
"""A method's line that grows or assigns an attribute of ``self`` (``self.memory.append(``)."""

_TO_NUMBER = re.compile(r"\.item\(\)|\.detach\(\)|\.tolist\(\)|\.numpy\(\)|\bfloat\(|\bint\(")
"""What makes a line store a number, not a graph (the healthy twin of a leaking line)."""

_NUMBER = re.compile(r"\.item\(\)|\.tolist\(\)|\.numpy\(\)|\bfloat\(|\bint\(")
"""What makes a line store a number, not a tensor."""


_NAME = re.compile(r"(?<![\w.])[A-Za-z_]\w*(?![\w(])")
"""A variable's name in an expression (not an attribute, not a call)."""


def _first_line(
    code: CodeType, lineno: int, name: str, graph: bool = True
) -> tuple[int, bool, tuple[int, ...]]:
    """The line that grows or assigns ``name`` in the function of ``code`` (augmented
    assignment or append preferred, and a line that keeps a tensor over one that stores a
    number; ``graph``: it holds a graph, else tensors without one, and a line that detaches
    is preferred), else the frame's current line ``lineno``; whether that line grows
    ``name`` or builds it from itself; and the lines that grow it as well as that one does
    (itself included), when there are several."""
    if code.co_name == "<module>":  # a script's top level: all of its file
        lines, start = linecache.getlines(code.co_filename), 1
    else:
        try:
            lines, start = inspect.getsourcelines(code)
        except (OSError, TypeError):
            return lineno, False, ()
    bare = name.split(".", 1)[1] if name.startswith("self.") else name
    nested = _nested_lines(code, bare)  # another scope's `loss` is not this one's (sweep CE)
    if nested:
        lines = [line if start + i not in nested else "\n" for i, line in enumerate(lines)]
    best = _best_lines(lines, start, _ASSIGN.format(name=re.escape(bare)), bare, graph)
    if best is None:
        return lineno, False, ()
    rank, found = best
    return found[0], rank <= 3, tuple(found) if rank <= 1 and len(found) > 1 else ()


def _nested_lines(code: CodeType, name: str) -> set[int]:
    """The lines of the functions defined in ``code`` (their decorators included; not
    lambdas or comprehensions, which are its own scope's lines) where ``name`` is a local of
    their own: another scope's variable (sweep CE: main()'s `loss` was named at a line of a
    nested `estimate_loss()` that assigns its own). One they use from outside (a global, a
    closure's list they append to) is the same object: its lines stay."""
    found: set[int] = set()
    for const in code.co_consts:
        if not isinstance(const, CodeType) or const.co_name.startswith("<"):
            continue
        if name in const.co_varnames or name in const.co_cellvars:  # (a closure's own, too)
            last = max((n for _, _, n in const.co_lines() if n is not None), default=0)
            found.update(range(const.co_firstlineno, last + 1))
        else:  # a function inside it may have its own (main -> evaluate -> one_batch)
            found |= _nested_lines(const, name)
    return found


def _code_at(code: CodeType, line: int) -> CodeType:
    """The innermost function of ``code`` (itself, or one defined in it) that ``line`` is
    in: a script's top level names the function a line of its file is in (not lambdas or
    comprehensions: the function they are in)."""
    for const in code.co_consts:
        if isinstance(const, CodeType) and not const.co_name.startswith("<"):
            found = _code_at(const, line)
            if found is not const or any(n == line for _, _, n in const.co_lines()):
                return found
    return code


@functools.lru_cache(maxsize=16)
def _code_only(lines: tuple[str, ...]) -> tuple[str, ...]:
    """``lines`` with their strings and comments blanked out (sweep BG: a docstring quoting
    ``running_loss += loss`` was named as the line that grows it; review: so was a comment or
    a logged string); as they are where they do not tokenize. Cached: each scan looks up
    every suspect in the same few files."""
    masked = [list(line) for line in lines]
    try:
        for token in tokenize.generate_tokens(iter(lines).__next__):
            if token.type not in (tokenize.STRING, tokenize.COMMENT):
                continue
            (row, col), (end_row, end_col) = token.start, token.end
            for r in range(row - 1, end_row):
                first = col if r == row - 1 else 0
                last = end_col if r == end_row - 1 else len(masked[r])
                masked[r][first:last] = " " * (last - first)
    except (tokenize.TokenError, SyntaxError, IndentationError):
        return lines
    return tuple("".join(chars) for chars in masked)


_LITERAL = re.compile(r"\s*(?:None|True|False|-?\d[\w.]*|'[^']*'|\"[^\"]*\")\s*\)?\s*$")
"""What a line stores when it is a literal: ``None)`` of ``self.memory.append(None)``."""


def _best_lines(
    lines: list[str], start: int, assign: str, bare: str, graph: bool = True
) -> tuple[int, list[int]] | None:
    """``(rank, line numbers)`` of the lines of ``lines`` (the first numbered ``start``) that
    ``assign`` matches best, the one to name first: growing it ranks 0, building it on
    itself 2, assigning it 4, and one more where the line stores a number (``graph``: what
    it holds has a graph; else tensors without one, and of two lines that rank alike, one
    that detaches comes first: ``fakes.append(fake.detach())``); of the lines that build it
    on itself, only the last; ``None``: no line matches."""
    pattern = re.compile(assign)
    best: tuple[int, bool] | None = None
    found: list[int] = []
    for i, text in enumerate(_code_only(tuple(lines))):
        m = pattern.search(text)
        if m is None:
            continue
        rest = text[m.end() :]
        if m.group(1) in ("+=", ".append(", ".extend(", "-=", "*=") or m.group(1)[0] == "[":
            rank = 0
        elif re.search(rf"(?<![\w.]){re.escape(bare)}\b", rest):
            rank = 2  # built on itself: ``total = total + loss``, ``y, h = model(x, h)``
        else:
            rank = 4
        if (_TO_NUMBER if graph else _NUMBER).search(rest):
            rank += 1
        if _LITERAL.match(rest):  # a placeholder stored (the PyTorch DQN tutorial's
            rank += 5  # ``self.memory.append(None)`` before ``self.memory[i] = ...``: sweep CB)
        kept = graph or ".detach()" not in rest  # tensors without a graph: detached there
        # of the lines that build it on itself, the last: a detaching helper comes before
        # the model's call in a loop (``h = repackage(h)``, then ``y, h = model(x, h)``)
        if best is None or (rank, kept) < best or (rank == best[0] == 2):
            best, found = (rank, kept), [start + i]
        elif (rank, kept) == best:
            found.append(start + i)
    return None if best is None else (best[0], found)


def _line_in_class(cls: type, attr: str, graph: bool = True) -> tuple[str, str, int, bool] | None:
    """Where a method of ``cls`` (or of a base class of the user's) grows or assigns
    ``self.<attr>``: ``(file, "Class.method", line, grows it)``, the line that grows it
    preferred (``ReplayMemory.push``'s ``self.memory.append(...)`` over ``__init__``'s
    ``self.memory = deque(...)``); ``None``: none found."""
    assign = _ASSIGN_ATTR.format(name=re.escape(attr))
    best: tuple[int, int, str, str] | None = None
    for klass in cls.__mro__[:-1]:  # not ``object``
        for fn_name, fn in vars(klass).items():
            code = getattr(fn, "__code__", None)
            if code is None or not _is_user_file(code.co_filename, _library_dirs()):
                continue
            try:
                lines, start = inspect.getsourcelines(code)
            except (OSError, TypeError):
                continue
            found = _best_lines(lines, start, assign, "self." + attr, graph)
            if found is not None and (best is None or found[0] < best[0]):
                best = (found[0], found[1][0], code.co_filename, f"{klass.__name__}.{fn_name}")
    if best is None:
        return None
    rank, line, filename, function = best
    return filename, function, line, rank <= 3


def scan_frames(
    start: FrameType | None = None,
    since: list[Candidate] | None = None,
    holders: Callable[[Any], bool] | None = None,
) -> list[Candidate]:
    """Find variables in the user frames from ``start`` outwards that hold autograd graphs.

    Looks at each frame's locals (a script's top level: its globals), two levels into lists,
    tuples, deques and dicts, at the attributes of a local named ``self`` and at those of the
    user's other objects there (``memory.memory``: a replay buffer's deque; ``losses.sum``: an
    ``AverageMeter`` fed the loss), :data:`_OBJECT_ATTRS` of each of the first
    :data:`_OBJECTS` objects of a frame. Frames of torch, memkit and the standard library are
    skipped; an object seen in several frames (a list a
    nested function closes over) is one variable, named in the innermost. ``since``: an
    earlier scan; each candidate's ``carries`` says whether its graph holds a node one of that
    scan's graphs held. ``holders``: whether a tensor is on the device that grows; given, the
    containers of such tensors without a graph are candidates too (``fakes.append(
    fake.detach())``), with the bytes they hold.
    """
    torch = sys.modules.get("torch")
    if torch is None:
        return []
    tensor_type = torch.Tensor
    if start is None:
        start = sys._getframe(1)
    out: list[Candidate] = []
    earlier = frozenset() if since is None else frozenset().union(*(c.nodes for c in since))
    earlier_ids = {i for i, _ in earlier}
    seen: set[int] = set()  # the objects named already (in an inner frame)
    for frame in _user_frames(start):
        for name, value, owner in _frame_values(frame, torch):
            if id(value) in seen:
                continue
            graph = True
            if _has_graph(value, tensor_type):
                kind, tensors = "tensor", [value]
            elif tensors := _container_graph(value, tensor_type):
                kind = "container"
            elif (
                holders is not None
                and (seen_items := _peek(value))
                and not _weights(value, seen_items, torch)
            ):
                kind, graph = "container", False
            else:
                continue
            nbytes = item_bytes = 0
            shape = tuple(map(int, value.shape)) if kind == "tensor" else None
            if kind == "container" and holders is not None:
                item_bytes, nbytes, shape = _held_bytes(value, tensor_type, holders)
                if not graph and nbytes <= 0:
                    continue  # no device tensor in it
            elif kind == "container":  # (a graph scan) the shape of its last graph's tensor:
                shape = tuple(map(int, tensors[-1].shape))  # the advice's .item() or not
            seen.add(id(value))
            walked = _walk(tensors, GRAPH_NODE_LIMIT)
            nodes = len(walked)
            keys = _own_nodes(walked)
            reached = bool(earlier_ids.intersection(walked)) and not earlier.isdisjoint(keys)
            # a list that grows (``losses.append(loss)``) grows in length; a state carried
            # from step to step (an RNN's ``hidden`` tuple, never detached) in its graph
            length = len(value) if kind == "container" else 0
            size = length + nodes
            out.append(
                Candidate(
                    name=name,
                    function=frame.f_code.co_name,
                    filename=frame.f_code.co_filename,
                    frame_line=frame.f_lineno,
                    kind=kind,
                    size=size,
                    code=frame.f_code,
                    scalar=all(t.numel() == 1 for t in tensors)
                    if graph
                    else shape is not None and math.prod(shape) == 1,
                    length=length,
                    nodes=keys,
                    carries=None if since is None or not graph else reached,
                    graph=graph,
                    nbytes=nbytes,
                    item_bytes=item_bytes,
                    item_shape=shape,
                    maxlen=getattr(value, "maxlen", None),
                    owner=owner,
                )
            )
    return out


def _frame_values(frame: FrameType, torch: Any) -> list[tuple[str, Any, type | None]]:
    """``(name, value, owner)`` of what a scan looks at in ``frame``: its locals, the
    attributes of ``self`` (``self.history``) and of the user's other objects among them
    (``memory.memory``, with the object's class as ``owner``; the first :data:`_OBJECT_ATTRS`
    of each of the first :data:`_OBJECTS`)."""
    names = _frame_locals(frame)
    out: list[tuple[str, Any, type | None]] = []
    objects = 0
    for key, value in names.items():
        if key.startswith("__"):
            continue
        out.append((key, value, None))
        if objects >= _OBJECTS or key == "self":
            continue
        # the script's own objects, and its own classes (``Stats.total += loss``)
        owner = value if _user_class(value, torch) else type(value)
        if owner is value or _user_object(value, torch):
            objects += 1
            with contextlib.suppress(TypeError):
                attrs = (kv for kv in vars(value).items() if not kv[0].startswith("__"))
                out.extend(
                    (f"{key}.{k}", v, owner) for k, v in itertools.islice(attrs, _OBJECT_ATTRS)
                )
    owner = names.get("self")
    if owner is not None and hasattr(owner, "__dict__") and not isinstance(owner, torch.nn.Module):
        with contextlib.suppress(TypeError):
            out.extend((f"self.{k}", v, None) for k, v in vars(owner).items())
    return out


_INSTALLED = (f"{os.sep}site-packages{os.sep}", f"{os.sep}dist-packages{os.sep}")
"""Where installed packages live: their objects are no script's own (a trainer, a loader)."""

_USER_TYPES: dict[type, bool] = {}
"""Classes -> whether their instances are the user's objects (:func:`_user_object`)."""


def _user_class(value: Any, torch: Any) -> bool:
    """Whether ``value`` is a class the user wrote (not a model's): its class attributes are
    the script's state too."""
    return (
        isinstance(value, type)
        and not issubclass(value, torch.nn.Module)
        and _user_file(sys.modules.get(value.__module__))
    )


def _user_file(module: Any) -> bool:
    """Whether ``module`` is one of the user's files, not an installed package's."""
    filename = getattr(module, "__file__", None)
    return (
        isinstance(filename, str)
        and _is_user_file(filename, _library_dirs())
        and not any(part in filename for part in _INSTALLED)
    )


def _user_object(value: Any, torch: Any) -> bool:
    """Whether ``value`` is an instance of a class the user wrote (its module is a user file,
    not an installed package's), with attributes: not a model, a tensor, a class, a function,
    or a library's object."""
    cls = type(value)
    known = _USER_TYPES.get(cls)
    if known is None:
        known = not issubclass(cls, (torch.nn.Module, torch.Tensor, type)) and _user_file(
            sys.modules.get(cls.__module__)
        )
        if len(_USER_TYPES) > 1024:
            _USER_TYPES.clear()
        _USER_TYPES[cls] = known
    return known and hasattr(value, "__dict__")


def _key(c: Candidate) -> tuple[str, str, str]:
    return (c.filename, c.function, c.name)


def _grew(c: Candidate, last: Candidate | None) -> bool:
    """``c`` holds more than ``last`` (the same variable in an earlier scan) by building on
    it: a graph that grows keeps the earlier nodes, so it holds an earlier root (``carries``;
    ``None``: not scanned against the earlier scan, size alone). A graph built afresh each
    step that is larger than before (more parameters made trainable) does not grow."""
    return last is not None and c.size > last.size and c.carries is not False


def compare_scans(
    before: list[Candidate], after: list[Candidate], steps: int = 1
) -> list[LeakSuspect]:
    """Suspects from two scans ``steps`` steps apart (``after`` scanned ``since=before``):
    candidates in ``after`` whose graph or length grew (:func:`_grew`) are confirmed
    (``growing=True``) and listed first, the one holding the most more device bytes a step
    first (where bytes are counted), then the smallest graph:
    the variable the others' graphs were built from (``total_loss``, not a ``logs`` dict made
    from it; an LSTM's ``hidden``, not the ``loss`` computed through it); with no ``before``
    every candidate is listed, largest first, unconfirmed."""
    previous = {_key(c): c for c in before}
    found: list[tuple[tuple[Any, ...], LeakSuspect]] = []
    for c in after:
        last = previous.get(_key(c))
        grew = _grew(c, last)
        if before and not grew:
            continue
        # its graph grew while its length did not (a list that grows is losses kept), and it
        # ends in tensors of more than one element: a state each step builds on
        carried = grew and c.graph and not c.scalar and (last is None or c.length <= last.length)
        filename, function = c.place
        code = linecache.getline(filename, c.first_line).strip()
        added = 0 if last is None else max(0, c.nbytes - last.nbytes) // max(1, steps)
        suspect = LeakSuspect(
            name=c.name,
            function=function,
            filename=filename,
            line=c.first_line,
            code=code,
            kind=c.kind,
            graph_nodes=c.size,
            growing=grew,
            carried=carried,
            graph=c.graph,
            length=c.length,
            maxlen=c.maxlen,
            item_shape=c.item_shape,
            item_bytes=c.item_bytes,
            tensor_bytes=c.nbytes,
            bytes_per_step=added,
        )
        if grew:  # what a line grows or builds on itself first; then what holds the most
            # more device bytes a step (a list of batch outputs before its list of targets),
            # then the smallest graph (a container's without its length), containers first
            order: tuple[Any, ...] = (
                False,
                not c.built_on_itself,
                -added,
                c.size - c.length,
                c.kind != "container",
            )
        else:  # the largest first, containers first
            order = (True, c.kind != "container", -c.size)
        found.append((order, suspect))
    found.sort(key=lambda pair: pair[0])
    return [suspect for _, suspect in found]


def growth_finding(
    device: str,
    growth: GrowthDetector,
    suspects: tuple[LeakSuspect, ...],
    step: int,
    held_batches: tuple[int, int] = (0, 0),
    graph: LeakFinding | None = None,
) -> LeakFinding:
    """The leak a device's growth detector called (at step ``step``), with ``suspects``;
    ``held_batches``: ``(count, bytes)`` of the batches still alive (simulated device);
    ``graph``: a graph the graph scans saw growing before: its ``graph_growth`` is kept, and
    its suspects where none of ``suspects`` was seen growing."""
    rate, first, steps = growth.finding or (0, step, 0)
    graph_growth = 0
    if graph is not None:
        graph_growth = graph.graph_growth
        if not (suspects and suspects[0].growing):
            suspects = graph.suspects
    return LeakFinding(
        device, rate, first, steps, suspects, graph_growth=graph_growth, period=growth.period,
        held_batches=held_batches[0], held_batch_bytes=held_batches[1],
        grown_bytes=growth.grown if growth.finding else 0,
    )  # fmt: skip


def growing_in_all(scans: list[list[Candidate]]) -> list[LeakSuspect]:
    """Suspects from consecutive scans: variables whose graph (or length) grew at every scan.

    A healthy loop's ``loss`` holds a graph of the same size each step; ``running_loss`` that
    adds each step's loss with its graph holds a graph that grows every step.
    """
    seen: dict[tuple[str, str, str], list[Candidate]] = {}
    for scan in scans:
        for c in scan:
            seen.setdefault(_key(c), []).append(c)
    grew = {
        key
        for key, seq in seen.items()
        if len(seq) == len(scans) and all(_grew(b, a) for a, b in itertools.pairwise(seq))
    }
    return compare_scans(scans[-2], [c for c in scans[-1] if _key(c) in grew])


class LeakWatch:
    """The tracker's leak search at step boundaries: a frame scan when a device's memory
    grows (who holds it), and rounds of graph scans (graphs that grow in host memory only).

    Attributes:
        graph_scans: the scans of the current round of graph scans.
        scan: the last scan made on growth, and ``scan_step`` its step.
        confirmed: a suspect grew between two scans.
        suspects: the suspects of the last scan on growth.
    """

    def __init__(self, warmup: int, period: int = SCAN_PERIOD) -> None:
        self.warmup = warmup
        self.period = period  # the graph scans' period: three scans in a row every period
        self.graph_scans: list[list[Candidate]] = []
        self.scan: list[Candidate] | None = None
        self.scan_step = -1
        self.confirmed = False
        self.suspects: tuple[LeakSuspect, ...] = ()
        self.holders: Callable[[Any], bool] | None = None  # the last on_growth's
        self.trace: LineTrace | None = None  # the line trace of the first suspect found
        self._traced: tuple[str, str, int] | None = None  # its (name, file, line) as named
        # from the source, while the trace has not settled
        self.moved: dict[tuple[str, str, int], tuple[str, str, int, str]] = {}  # suspects
        # (name, file, line) -> (file, function, line, code) where the trace saw them grow

    def due(self, step: int) -> bool:
        """Whether the step boundary after step ``step`` scans (:meth:`scan_graphs`)."""
        offset = step - self.warmup
        return offset >= 0 and offset % self.period < 3

    def scan_graphs(self, step: int, frame: Any, device: str) -> LeakFinding | None:
        """Three scans in a row every ``period`` steps: a variable whose autograd graph grows
        at each (``running_loss += loss``) is a leak even when device memory stays flat
        (backward freed the saved tensors; the graph's nodes pile up in host memory). Returns
        the leak found, on ``device``."""
        if not self.due(step):
            return None
        offset = step - self.warmup
        scans = self.graph_scans if offset % self.period else []
        try:
            current = scan_frames(frame, since=scans[-1] if scans else None)
        except Exception:  # inspection must never break training
            log.debug("graph scan failed", exc_info=True)
            return None
        scans.append(current)
        self.graph_scans = scans
        if len(scans) < 3:
            return None
        suspects = growing_in_all(scans)
        if not suspects:
            return None
        self._trace_lines(current, suspects[0], frame)
        nodes = suspects[0].graph_nodes
        start = next(c.size for c in scans[0] if c.name == suspects[0].name)
        leak = LeakFinding(
            device, 0, step - 2, 2, tuple(suspects), graph_growth=(nodes - start) // 2
        )
        log.info("memkit: %s at %s", leak.headline(), suspects[0].where)
        return leak

    def on_growth(
        self, frame: Any, step: int, holders: Callable[[Any], bool] | None = None
    ) -> tuple[LeakSuspect, ...]:
        """A device grew over its growth window (at step ``step``): the variables behind it,
        from a scan of the frames (once until a suspect is confirmed); ``holders``: whether
        a tensor is on a device that grows (containers of such tensors are suspects too)."""
        self.holders = holders
        scan_now = self.scan is None or (not self.confirmed and step > self.scan_step)
        if scan_now:
            try:
                current = scan_frames(frame, since=self.scan, holders=holders)
            except Exception:  # inspection must never break training
                log.debug("leak scan failed", exc_info=True)
                current = []
            suspects = compare_scans(self.scan or [], current, step - self.scan_step)
            if self.scan is not None and not any(s.growing for s in suspects):
                suspects = compare_scans([], current)
            else:
                self.confirmed = self.confirmed or any(s.growing for s in suspects)
                if suspects and suspects[0].growing:
                    self._trace_lines(current, suspects[0], frame)
            self.scan = current
            self.scan_step = step
            self.suspects = tuple(suspects)
        return self.suspects

    def _trace_lines(self, scan: list[Candidate], top: LeakSuspect, frame: Any) -> None:
        """When ``top`` (of ``scan``) has several lines that grow it alike, trace from
        ``frame`` on which of them runs (once per block: the first suspect found)."""
        if self.trace is not None:
            return
        for c in scan:
            if c.name == top.name and c.place[0] == top.filename and c.first_line == top.line:
                ties = c.ties
                if sum(map(len, ties.values())) > 1:
                    self._guess_line(scan, c, top)
                    self.trace = LineTrace(ties)
                    with contextlib.suppress(Exception):  # inspection must never break training
                        if self.trace.start(frame):
                            self._traced = (top.name, top.filename, top.line)
                return

    def _guess_line(self, scan: list[Candidate], c: Candidate, top: LeakSuspect) -> None:
        """Until the trace sees one run (an evaluation every N steps may not run while it
        traces), name the first of ``c``'s lines that grows it with a variable the scan
        saw holding a graph in its frame (``val_losses.append(vloss)``, not the branch
        that never ran: ``val_losses.append(tot / 3)``), if not the first line itself."""
        graphs = {o.name for o in scan if o.code is c.code and o.graph and o.kind == "tensor"}
        assign = re.compile(_ASSIGN.format(name=re.escape(c.name.removeprefix("self."))))
        for code, lines in c.ties.items():
            for line in sorted(lines):
                text = linecache.getline(code.co_filename, line)
                m = assign.search(text)
                if m is not None and graphs.intersection(_NAME.findall(text[m.end() :])):
                    if line != top.line:
                        self.moved[(top.name, top.filename, top.line)] = (
                            code.co_filename, code.co_name, line, text.strip(),
                        )  # fmt: skip
                    return

    def settle(self, end: bool = False) -> bool:
        """A step boundary (``end``: the block's end, which stops the trace): whether the line
        trace saw one of its lines run now, which :meth:`placed` names from then on."""
        trace, traced = self.trace, self._traced
        if trace is None or traced is None:
            return False
        if trace.hit is None:
            if end:
                trace.stop()
            elif trace.active:
                trace.tick()
            if trace.active:
                return False
            trace.release()
            self._traced = None  # none ran: the line named from the source stays
            return False
        trace.release()
        code, line = trace.hit
        text = linecache.getline(code.co_filename, line).strip()
        self.moved[traced] = (code.co_filename, code.co_name, line, text)
        self._traced = None
        return True

    def placed(self, leak: LeakFinding | None) -> LeakFinding | None:
        """``leak`` with its suspects named where the line trace saw them grow."""
        moved = self.moved
        if leak is None or not moved:
            return leak
        suspects = list(leak.suspects)
        for i, s in enumerate(suspects):
            to = moved.get((s.name, s.filename, s.line))
            if to is not None:
                filename, function, line, code = to
                suspects[i] = dataclasses.replace(
                    s, filename=filename, function=function, line=line, code=code
                )
        if suspects == list(leak.suspects):
            return leak
        return dataclasses.replace(leak, suspects=tuple(suspects))

    def suspects_at_failure(self, leak: LeakFinding, tb: Any) -> LeakFinding:
        """``leak`` with the suspects of a last scan at the failure (``tb``: its traceback),
        when no suspect was confirmed before and that scan confirms one."""
        if self.confirmed or tb is None:
            return leak
        inner = tb
        while inner.tb_next is not None:
            inner = inner.tb_next
        with contextlib.suppress(Exception):
            later = scan_frames(inner.tb_frame, since=self.scan, holders=self.holders)
            suspects = compare_scans(self.scan or [], later)
            if any(s.growing for s in suspects):
                return dataclasses.replace(leak, suspects=tuple(suspects))
        return leak
