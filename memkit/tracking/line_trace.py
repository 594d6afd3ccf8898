"""Which of a leaking variable's lines runs: a short line trace of the training thread.

A variable can have several lines that grow it alike: a script's global list appended at its
top level and in a function, in branches of which only one runs. The source cannot tell which;
:class:`LineTrace` watches the lines run, in the code objects that hold them only, from a step
boundary until one of them runs or a few boundaries pass. It runs once per leak found, never
while another tracer (a debugger, coverage) is set or after torch.compile made graphs, and
leaves the thread untraced.
"""

from __future__ import annotations

import inspect
import os
import sys
from types import CodeType, FrameType
from typing import Any

__all__ = ["LineTrace", "empty_locals_copy"]

_STALE_LOCALS = sys.version_info < (3, 13)
"""Whether a trace call copies the frame's locals into a dict the frame keeps (PEP 667 made
``f_locals`` a view of the variables in 3.13)."""

_RUNNING: list[LineTrace] = []
"""The traces on now: a process forked while one is on (a DataLoader's workers) stops it in the
child, where no step boundary would ever stop it."""


def _stop_in_child() -> None:
    for trace in list(_RUNNING):
        trace.stop()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_stop_in_child)


class LineTrace:
    """Traces ``lines`` (code object -> line numbers) in the calling thread.

    Args:
        lines: the candidate lines, by the code object they are in.
        limit: step boundaries (:meth:`tick`) after which it stops without a hit.

    Attributes:
        hit: the code object and line that ran first, once one did.
    """

    def __init__(self, lines: dict[CodeType, frozenset[int]], limit: int = 2) -> None:
        self.lines = lines
        self.limit = limit
        self.hit: tuple[CodeType, int] | None = None
        self.active = False
        self._tracer = self._call  # one bound method: what sys.gettrace() gives back

    def start(self, frame: FrameType | None) -> bool:
        """Trace from now on: the frames from ``frame`` outwards that run candidate code (the
        loop that called the step's end), and every call into such code. Whether it started
        (not where a tracer is set already)."""
        if sys.gettrace() is not None or _compiled_graphs():
            return False
        while frame is not None:
            if frame.f_code in self.lines:
                frame.f_trace = self._line
            frame = frame.f_back
        self.active = True
        _RUNNING.append(self)
        sys.settrace(self._tracer)
        return True

    def tick(self) -> None:
        """A step boundary passed: stop after ``limit`` of them."""
        self.limit -= 1
        if self.limit <= 0:
            self.stop()

    def stop(self) -> None:
        """Trace no more (the frames given a trace function call it once more, and drop it)."""
        self.active = False
        if self in _RUNNING:
            _RUNNING.remove(self)
        if sys.gettrace() == self._tracer:
            sys.settrace(None)

    def release(self, inside: FrameType | None = None) -> None:
        """Once stopped, called where no trace call of these frames runs (a step boundary,
        the block's end, a trace call of another frame ``inside``): the frames on the calling
        stack that run candidate code are traced no more, and each loses the copy of its
        locals that every trace call refreshed (Python before 3.13 keeps it on the frame,
        holding the values as they were then: a list the loop has replaced since stayed alive
        while the loop ran on, and memkit measured it)."""
        if self.active:
            return
        frame: FrameType | None = sys._getframe(1)
        while frame is not None:
            if frame.f_code in self.lines and frame is not inside:
                frame.f_trace = None
                empty_locals_copy(frame)
            frame = frame.f_back

    def _call(self, frame: FrameType, event: str, arg: Any) -> Any:
        if not self.active:  # stopped from another thread, or the first call after a hit
            sys.settrace(None)
            if self.hit is not None:
                self.release(inside=frame)
            return None
        return self._line if frame.f_code in self.lines else None

    def _line(self, frame: FrameType, event: str, arg: Any) -> Any:
        if not self.active:
            return None
        if event == "line" and frame.f_lineno in self.lines.get(frame.f_code, ()):
            # Python writes this frame's copy of its locals back to them after this call (a
            # copy released here would delete them): the next call of any function releases
            # the frames' copies, and ends the trace (:meth:`_call`)
            self.hit = (frame.f_code, frame.f_lineno)
            self.active = False
            if self in _RUNNING:
                _RUNNING.remove(self)
            return None
        return self._line


def empty_locals_copy(frame: FrameType) -> None:
    """Empty the copy of a function frame's locals that reading ``f_locals`` (or a trace call)
    left cached on the frame before Python 3.13, which keeps the values as they were then
    alive (a step's tensors into the next). Its variables are untouched. Left alone where
    something else holds that dict: the function's own ``cfg = locals()`` is the same one."""
    if not _STALE_LOCALS or not frame.f_code.co_flags & inspect.CO_OPTIMIZED:
        return
    copy = frame.f_locals
    if sys.getrefcount(copy) <= 3:  # the frame's, this name's and the call's argument
        copy.clear()


def _compiled_graphs() -> bool:
    """Whether torch.compile made graphs in this process: a trace function set while compiled
    code runs could change what Dynamo does (its frames are evaluated by its own hook), so
    memkit, which must cause no recompilation, traces nothing then."""
    dynamo = sys.modules.get("torch._dynamo.utils")
    counters = getattr(dynamo, "counters", None)
    try:
        return bool(counters is not None and counters["stats"]["unique_graphs"])
    except Exception:  # a torch whose counters differ: do not trace
        return True
