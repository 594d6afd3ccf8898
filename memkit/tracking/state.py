"""The tracker's shared state: the few values every hook reads, in one small object.

The parts of a :class:`~memkit.tracking.tracker.Tracker` (the devices, the phase machine, the
evidence, the hooks) each own their state; what the hot path reads on every module call
(whether tracking is on, the phase, the step, whether module detail is on, the one device
record of a single-device run...) lives here, in a ``__slots__`` object each part holds, so a
hook reads it in one attribute hop. The phase machine writes ``phase``, ``step`` and
``backwards``; the hooks write ``detail_on`` and ``active``; the devices ``single``.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from memkit.tracking.fsdp import FsdpUnits
    from memkit.tracking.records import DeviceRecord

__all__ = [
    "BACKWARD",
    "EVAL",
    "EVAL_PASS",
    "FORWARD",
    "OPTIMIZER",
    "OTHER",
    "RECOMPUTE",
    "TRAIN_PASS",
    "TrackState",
]

FORWARD, BACKWARD, OPTIMIZER, OTHER, EVAL = range(5)
"""Phases, as indices into :data:`~memkit.tracking.report.PHASES`."""

TRAIN_PASS, EVAL_PASS, RECOMPUTE = range(3)
"""What a root forward is: a training forward (builds a graph for backward), an evaluation
pass (``no_grad``/``inference_mode``, eval mode, or nothing that could build a graph), or the
recomputation of a checkpointed forward inside backward."""


class TrackState:
    """What the hooks read on every call (see the module docstring).

    Attributes:
        active: tracking is on (inside the block, and no hook of memkit's has failed).
        phase: the phase running now (:data:`FORWARD`...).
        step: steps completed.
        backwards: training backward passes completed in the current step.
        graph_grads: gradients being taken with ``create_graph=True`` that do not accumulate
            (a gradient penalty's ``torch.autograd.grad``): part of the forward, whose
            gradient hooks must not take them for a backward.
        detail_on: module detail's hooks are installed for this step.
        single: the one device's record when only one device can be used (the hooks skip
            routing a call to its device), else ``None``.
        trained: a training forward has run (from then on the breakdown is training's).
        failed: an exception is leaving the block: what it holds is no peak.
        fsdp: FSDP2's units in the tracked models, read at every segment boundary.
        t0: ``time.perf_counter()`` when the block began (timeline times are since then).
        lock: the one lock of the tracker's parts (transitions, new devices, the report;
            never taken per module call).
    """

    __slots__ = (
        "active",
        "backward_passes",
        "backwards",
        "detail_on",
        "failed",
        "fsdp",
        "graph_grads",
        "lock",
        "phase",
        "single",
        "step",
        "t0",
        "trained",
    )

    def __init__(self) -> None:
        self.active = False
        self.phase = OTHER
        self.step = 0
        self.backwards = 0
        self.backward_passes = 0  # in the whole block (backwards: in the step)
        self.graph_grads = 0
        self.detail_on = False
        self.single: DeviceRecord | None = None
        self.trained = False
        self.failed = False
        self.fsdp: FsdpUnits | None = None
        self.t0 = 0.0
        self.lock = threading.RLock()
