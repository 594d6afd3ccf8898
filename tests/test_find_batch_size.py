"""@memkit.find_batch_size: measured steps down after OOM, recovery, no retry of real bugs."""

from __future__ import annotations

import pytest
import torch

import memkit
from memkit.errors import DoesNotFitError


def test_retries_with_a_measured_size_not_blind_halving():
    calls = []

    @memkit.find_batch_size(start=4096)
    def train(batch_size, width):
        calls.append(batch_size)
        with memkit.simulate("8MiB"):
            x = torch.ones(batch_size, width)
            return float(x.sum())

    assert train(1024) > 0
    attempts = train.attempts
    assert [a.ok for a in attempts] == [False] * (len(attempts) - 1) + [True]
    assert calls[0] == 4096
    # 16 MiB needed at 4096 for an 8 MiB device: the measured line aims near 1945, far above
    # the 1024 that halving twice would settle on
    assert calls[-1] > 1024
    assert len(calls) <= 3


def test_non_oom_errors_propagate_at_once():
    calls = []

    @memkit.find_batch_size(start=64)
    def train(batch_size):
        calls.append(batch_size)
        raise KeyError("labels")

    with pytest.raises(KeyError):
        train()
    assert calls == [64]


def test_gives_up_below_min_batch_with_a_memkit_error():
    @memkit.find_batch_size(start=8, min_batch=4)
    def train(batch_size):
        with memkit.simulate("1KiB"):
            torch.ones(batch_size, 1024)

    with pytest.raises(DoesNotFitError, match="min_batch=4"):
        train()


def test_the_answer_is_a_size_that_fits_bounded_by_the_last_failure():
    """What the docs promise: the returned size fits, and the largest size that fits lies
    between it and the last size that failed (``attempts``); not that it is the largest."""
    largest = 1000  # a device of exactly 1000 float32 rows of 2048

    @memkit.find_batch_size(start=4096)
    def train(batch_size):
        with memkit.simulate(largest * 2048 * 4):
            torch.ones(batch_size, 2048)
        return batch_size

    got = train()
    attempts = train.attempts
    failed = [a.batch_size for a in attempts if not a.ok]
    assert attempts[-1].ok and attempts[-1].batch_size == got <= largest
    assert failed and min(failed) > largest  # so largest is in [got, min(failed))
