"""memkit track: memory per device, phase, step and module while real training runs.

``with memkit.track(model, optimizer=opt) as tracker: ...`` then ``tracker.report()``; or, with
no code change, ``memkit run train.py``. See docs/track.md.
"""

from __future__ import annotations

from memkit.tracking.api import track
from memkit.tracking.report import (
    PHASES,
    Breakdown,
    DeviceReport,
    LeakFinding,
    LeakSuspect,
    ModuleRecord,
    OomPostMortem,
    StepRecord,
    TimelinePoint,
    TrackReport,
)
from memkit.tracking.tracker import Tracker

__all__ = [
    "PHASES",
    "Breakdown",
    "DeviceReport",
    "LeakFinding",
    "LeakSuspect",
    "ModuleRecord",
    "OomPostMortem",
    "StepRecord",
    "TimelinePoint",
    "TrackReport",
    "Tracker",
    "track",
]
