"""The devices a tracker records and their counters: one
:class:`~memkit.tracking.records.DeviceRecord` per device the tracked code uses, found as its
tensors appear there, and the attribution of every segment's peak (:func:`segment_closer`, the
hot path's).

A *segment* is the time since the previous hook on a device: every hook reads the device's
counters (allocated, reserved and both peaks), resets the peak, and closes the segment: its
peak belongs to the phase running (and to the module of the hook's caller), so the per-phase
and per-step peaks are exact. A new training peak is kept as a
:class:`~memkit.tracking.breakdown.PeakMoment`, categorised off the hot path
(:meth:`DeviceSet.resolve_pending`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from collections.abc import Callable
from typing import Any

import torch

from memkit.devices import (
    CudaBackend,
    SimulatedBackend,
    UserPeaks,
    VirtualDeviceBackend,
    counter_reader,
    current_device_index,
    get_backend,
    visible_devices,
)
from memkit.simulated.virtual_devices import VirtualDevices
from memkit.tracking.breakdown import PeakMoment, Persistent, breakdown
from memkit.tracking.evidence import Evidence
from memkit.tracking.leaks import GrowthDetector
from memkit.tracking.records import DEFAULT_STEP_LIMIT, DeviceRecord
from memkit.tracking.report import Breakdown
from memkit.tracking.state import BACKWARD, EVAL, FORWARD, OPTIMIZER, TrackState

__all__ = ["DeviceSet", "SegmentCloser", "remembered_sizes", "segment_closer"]

log = logging.getLogger(__name__)

_clock = time.perf_counter

SegmentCloser = Callable[[DeviceRecord, int, int, "str | None"], None]
"""``close(dev, peak, peak_reserved, module)``: attribute a segment's peaks."""


def segment_closer(state: TrackState, evidence: Evidence) -> SegmentCloser:
    """The function that attributes a segment's peak ``p`` (reserved ``pr``) on ``dev`` to
    the phase running and, at a new training peak, keeps the moment for the breakdown
    (``owner``: the module the segment ran in).

    A closure, not a method: it runs several times per module call and reads ``state`` as
    cheaply as a method reads ``self``.
    """

    def close(dev: DeviceRecord, p: int, pr: int, owner: str | None) -> None:
        # nested: a device's peak is at least its step's, the step's at least each phase's
        ph = state.phase
        sp = dev.step_phase
        cur = sp[ph]
        if cur is None or p > cur:
            sp[ph] = p
            if p > dev.step_peak:
                dev.step_peak = p
                if p > dev.peak:
                    dev.peak = p
        if pr > dev.step_peak_res:
            dev.step_peak_res = pr
            if pr > dev.peak_res:
                dev.peak_res = pr
        gathered = 0
        if state.fsdp is not None:
            # FSDP2's all-gathered parameters during the segment: read at both of its ends
            # (a unit's all-gather and reshard sit between memkit's hooks, see fsdp.py)
            start, dev.gathered = dev.gathered, state.fsdp.gathered()
            gathered = start if start > dev.gathered else dev.gathered
        if p > dev.train_peak and (ph != EVAL or not state.trained) and not state.failed:
            dev.train_peak = p
            dev.failed_peak = None
            dev.pending = PeakMoment(
                p,
                state.step,
                ph,
                owner,
                dev.forward_base,
                dev.base_grads_none,
                dev.base_state_empty,
                evidence.grads_none(),
                evidence.state_empty(),
                gathered,
                dev.base_gathered,
                evidence.marked if ph == FORWARD else (),
                dev.base_flags,
                dev.base_released() if ph in (BACKWARD, OPTIMIZER) else 0,
                evidence.facts.last_input,
            )

    return close


class DeviceSet:
    """The tracked devices' records (see the module docstring).

    Args:
        state: the tracker's shared state (``single`` is set here).
        evidence: what the breakdown measures persistent memory with.
        timeline_limit: readings kept per device.
        leak_warmup, leak_window: each device's growth detector's.

    Attributes:
        records: device index (-1 for cpu) -> its record.
        primary: the tracked device's record (the backend's), once the block began.
        kind: the device type (``"cuda"``, ``"cpu"``...).
        vd: the tracked virtual devices, if any.
        sim: the simulated device's backend, when it is the tracked device.
        close: :func:`segment_closer`'s function.
    """

    def __init__(
        self,
        state: TrackState,
        evidence: Evidence,
        *,
        timeline_limit: int,
        leak_warmup: int,
        leak_window: int,
    ) -> None:
        self.state = state
        self.evidence = evidence
        self.records: dict[int, DeviceRecord] = {}
        self.primary: DeviceRecord | None = None
        self.kind = "cpu"
        self.vd: VirtualDevices | None = None
        self.sim: SimulatedBackend | None = None
        self.close = segment_closer(state, evidence)
        self._timeline_limit = timeline_limit
        self._leak_warmup = leak_warmup
        self._leak_window = leak_window
        self._stack: contextlib.ExitStack | None = None
        self.user_peaks: list[UserPeaks] = []

    def open(
        self, backend: Any, vd: VirtualDevices | None, stack: contextlib.ExitStack
    ) -> DeviceRecord:
        """The block begins on ``backend``'s device (the primary one); what is installed for
        the block (the user's peak counters kept true) goes on ``stack``."""
        self.vd = vd
        self.kind = backend.device.type
        self._stack = stack
        if isinstance(backend, SimulatedBackend):
            self.sim = backend
        primary = self.primary = self.add(backend.device, backend)
        if vd is None and (isinstance(backend, SimulatedBackend) or len(visible_devices()) <= 1):
            self.state.single = primary
        return primary

    def add(self, device: torch.device, backend: Any = None) -> DeviceRecord:
        """``device``'s record, made the first time a tracked tensor is seen there."""
        with self.state.lock:
            key = device.index if device.type != "cpu" else -1
            dev = self.records.get(key)
            if dev is not None:
                return dev
            if backend is None and self.vd is not None:
                backend = VirtualDeviceBackend(self.vd, device.index or 0)
            elif backend is None:
                backend = get_backend(device)
            label = (
                str(device)
                if device.index is not None or device.type == "cpu"
                else (f"{device.type}:0")
            )
            peaks = None
            if isinstance(backend, CudaBackend) and backend.device.type == "cuda":
                # memkit resets the peak counters: the user's reads stay what they would be
                read, _ = counter_reader(backend)
                peaks = UserPeaks(backend.index, read)
                if self._stack is not None:
                    self._stack.enter_context(peaks.installed())
                    self.user_peaks.append(peaks)
            dev = DeviceRecord(label, backend, self._timeline_limit, DEFAULT_STEP_LIMIT, peaks)
            dev.growth = self.growth_detector()
            dev.step_start = dev.baseline
            self.records[key] = dev
            return dev

    def restore_user_peaks(self) -> list[str]:
        """Put the user's peak counters back on every CUDA device (the block has ended and
        any budget's cap is lifted); what could not be put back, as report notes."""
        notes = []
        for peaks in self.user_peaks:
            peaks.restore()
            if peaks.shortfall is not None:
                notes.append(f"cuda:{peaks.index}: {peaks.shortfall}")
        return notes

    def growth_detector(self) -> GrowthDetector:
        """A fresh growth detector for a device's step boundaries."""
        return GrowthDetector(self._leak_warmup, self._leak_window)

    def index_of(self, tensor: torch.Tensor | None) -> int:
        """The device index of ``tensor`` (virtual: its tag; -1 for the current device)."""
        if tensor is None:
            return -1
        vd = self.vd
        return vd.where(tensor) if vd is not None else tensor.get_device()

    def by_index(self, index: int) -> DeviceRecord:
        """The record of device ``index`` (-1: this thread's current device)."""
        if index < 0:
            vd = self.vd
            index = max(0, vd.current_device) if vd is not None else current_device_index(self.kind)
        dev = self.records.get(index)
        if dev is None:
            dev = self.add(torch.device(self.kind, index))
        return dev

    def for_args(self, args: Any) -> DeviceRecord:
        """The record of the device a module call's first tensor argument is on (several
        devices: DataParallel's replicas, a model split over devices)."""
        for a in args:
            if isinstance(a, torch.Tensor):
                return self.by_index(self.index_of(a))
        return self.by_index(-1)

    def close_all(self) -> None:
        """Read every device and close its segment (a phase or step boundary, the report).

        The peaks are reset only when one is above its current value: a peak equal to the
        current bytes is already where a reset would put it (one counter call saved)."""
        for dev in self.records.values():
            self.close_one(dev)

    def close_one(self, dev: DeviceRecord) -> None:
        """Read one device and close its segment (:meth:`close_all` for one device)."""
        a, r, p, pr = dev.take()
        self.close(dev, p, pr, dev.bw_module)
        state = self.state
        dev.timeline.append((_clock() - state.t0, state.step, state.phase, None, a, r))
        dev.events += 1
        dev.last = (a, r)

    def persistent(self, dev: DeviceRecord) -> Persistent:
        """The tracked objects' persistent bytes on ``dev`` now (live tensors)."""
        return self.evidence.persistent(dev, dev is self.primary)

    def remember(self, dev: DeviceRecord, sizes: Persistent) -> None:
        """Keep the largest persistent sizes ``dev`` has seen: the objects may be gone (or
        their gradients freed) when the report is made."""
        dev.params_full = max(dev.params_full, sizes.parameters)
        dev.grads_full = max(dev.grads_full, sizes.gradients)
        dev.state_full = max(dev.state_full, sizes.optimizer_state)

    def mark_gradients(self) -> None:
        """A mark in a training forward (its start, a model's forward beginning or returning,
        where ``zero_grad`` may have run since the last): the gradient witnesses' flags now,
        with the gradient bytes they stand for measured on every device the first time they
        are seen (a walk per new set of flags, not per step). The callers call it only where
        several optimizers run (``Evidence.several``): one optimizer's gradients at a
        forward's peak are those it began with, and the breakdown reads ``grads_none`` then
        (the hot path pays nothing)."""
        evidence = self.evidence
        flags = evidence.marked = evidence.grad_flags()
        if True in flags:
            epoch = evidence.witness_epoch
            for dev in self.records.values():
                if flags not in dev.grad_sizes or dev.grad_epoch != epoch:
                    self._note_gradients(dev, flags, self.persistent(dev))

    def _note_gradients(self, dev: DeviceRecord, flags: tuple[bool, ...], now: Persistent) -> None:
        """Keep ``dev``'s gradient bytes ``now`` as those of the witness ``flags`` (and by
        model, where several models run). Sizes of other witnesses (a model of an earlier
        k-fold run) are dropped; none is kept for allocated flags that measured nothing (the
        flags were read before the measure: a ``zero_grad`` between)."""
        epoch = self.evidence.witness_epoch
        if dev.grad_epoch != epoch:
            dev.grad_sizes, dev.grad_models, dev.grad_epoch = {}, {}, epoch
        if True in flags and not now.gradients:
            return
        dev.grad_sizes[flags] = now.gradients
        if True in flags and len(self.evidence.models.root_modules()) > 1:
            dev.grad_models[flags] = self.evidence.gradients_by_model()

    def forward_ended(self, dev: DeviceRecord) -> None:
        """The forward whose peak ``dev``'s breakdown is ended: which of the gradients alive
        at the peak are still allocated (those the next phase holds)."""
        dev.forward_peak = False
        found = dev.breakdown
        flags = self.evidence.grad_flags()
        if found is None or not flags:
            return
        if True in flags and flags not in dev.grad_sizes:
            self._note_gradients(dev, flags, self.persistent(dev))
        after = dev.grad_sizes.get(flags, 0) if True in flags else 0
        dev.breakdown = dataclasses.replace(
            found, gradients_after_forward=min(after, found.gradients)
        )

    def resolve_pending(self, dev: DeviceRecord, now: Persistent | None = None) -> None:
        """Categorise the new training peak ``dev`` saw (``dev.pending``), if any (``now``:
        the persistent sizes on ``dev``, if the caller measured them just now)."""
        pending = dev.pending
        if pending is None:
            return
        dev.pending = None
        try:
            dev.breakdown = self._categorise(dev, pending, now or self.persistent(dev))
        except Exception:  # the breakdown is best effort
            log.debug("breakdown failed", exc_info=True)

    def _categorise(self, dev: DeviceRecord, moment: PeakMoment, now: Persistent) -> Breakdown:
        remembered = remembered_sizes(dev)
        dev.grads_full = max(dev.grads_full, now.gradients)
        dev.state_full = max(dev.state_full, now.optimizer_state)
        if self.state.phase != BACKWARD and self.evidence.several:
            # (inside backward, only some layers' exist yet)
            self._note_gradients(dev, self.evidence.grad_flags(), now)
        found = breakdown(moment, now, remembered, dev.grad_sizes)
        dev.forward_peak = moment.phase == FORWARD
        # whose, where several models run (a GAN's): for zero-grad-keeps-grads
        several = len(self.evidence.models.root_modules()) > 1
        if found.gradients and moment.phase == FORWARD and several:
            by_model = dev.grad_models.get(moment.alive) or self.evidence.gradients_by_model()
            found = dataclasses.replace(found, gradient_models=by_model)
        elif found.gradients and moment.phase in (BACKWARD, OPTIMIZER):
            # (categorised as the phase ends: the gradients are still as they were in it)
            idle = self.evidence.idle_gradient_bytes()
            found = dataclasses.replace(found, idle_gradients=min(found.gradients, idle))
        return found


def remembered_sizes(dev: DeviceRecord) -> Persistent:
    """The largest parameters, gradients and optimizer state ``dev`` has seen (they stand in
    for what was freed or is gone when a moment is categorised)."""
    return Persistent(dev.params_full, dev.grads_full, dev.state_full)
