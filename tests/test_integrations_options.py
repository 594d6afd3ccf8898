"""What both framework callbacks check when they are made (their shared base class): a bad
option is a ConfigError naming the option, what was expected and what was found, not a
traceback when fit() or train() starts. The tracking options are checked by the same function
as ``memkit.track``'s (memkit/tracking/options.py)."""

from __future__ import annotations

import importlib

import pytest
import torch

import memkit
from memkit.errors import ConfigError

BAD = [
    ({"device": "cpu", "budget": "12XB"}, r"budget='12XB': unknown size unit"),
    ({"device": "gpu"}, r"device='gpu': expected a device such as"),
    ({"device": "meta"}, r"device='meta': .* would count nothing"),
    ({"device": "cuda:7"}, r"device='cuda:7': device cuda:7 "),  # no such GPU here
    ({"per_module": "yes"}, r"per_module: expected True or False, found 'yes' \(str\)"),
    ({"log_peaks": "no"}, r"log_peaks: expected True or False, found 'no' \(str\)"),
    ({"postmortem": "stdout"}, r"postmortem: expected 'stderr' or None, found 'stdout'"),
    *(
        ({"module_every": bad}, rf"module_every: expected a whole number of steps >= 1 "
         rf"\(None: the default\), found {found}")
        for bad, found in ((0, r"0 \(int\)"), (-5, "-5"), ("10", r"'10' \(str\)"),
                           (2.5, r"2.5 \(float\)"), (True, r"True \(bool\)"))
    ),
    ({"timeline_limit": -1}, r"timeline_limit: expected a whole number of counter readings >= 0, "
     r"found -1 \(int\)"),
    ({"timeline_limit": "x"}, r"timeline_limit: .* found 'x' \(str\)"),
]  # fmt: skip
TRACKER_OPTIONS = ("per_module", "module_every", "timeline_limit", "postmortem")


@pytest.mark.parametrize("framework", ["lightning", "transformers"])
@pytest.mark.parametrize(("options", "message"), BAD, ids=lambda v: str(v)[:30])
def test_a_bad_option_is_refused_when_the_callback_is_made(framework, options, message):
    pytest.importorskip("lightning" if framework == "lightning" else "transformers")
    callback = importlib.import_module(f"memkit.integrations.{framework}").MemkitCallback
    with pytest.raises(ConfigError, match=message):
        callback(**options)


@pytest.mark.parametrize(
    ("options", "message"), [(o, m) for o, m in BAD if set(o) <= set(TRACKER_OPTIONS)],
    ids=lambda v: str(v)[:30],
)  # fmt: skip
def test_memkit_track_refuses_the_same_options_with_the_same_words(options, message):
    """Before: timeline_limit=-1 was "maxlen must be non-negative" and "x" a TypeError, both
    from inside the tracker's records when the block began."""
    with pytest.raises(ConfigError, match=message):
        memkit.track(torch.nn.Linear(2, 2), device="cpu", **options)


def test_good_options_are_taken():
    """The edges that are fine: timeline_limit=0 (no readings kept), module_every=1."""
    model = torch.nn.Linear(2, 2)
    with memkit.track(model, device="cpu", timeline_limit=0, module_every=1) as tracker:
        model(torch.randn(1, 2)).sum().backward()
    assert tracker.report().devices[0].timeline == ()
