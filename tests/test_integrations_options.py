"""What both framework callbacks check when they are made (their shared base class): a bad
``device`` or ``budget`` is a ConfigError naming the option, not a traceback when fit() or
train() starts."""

from __future__ import annotations

import importlib

import pytest

from memkit.errors import ConfigError

BAD = [
    ({"device": "cpu", "budget": "12XB"}, r"budget='12XB': unknown size unit"),
    ({"device": "gpu"}, r"device='gpu': expected a device such as"),
    ({"device": "meta"}, r"device='meta': .* would count nothing"),
    ({"device": "cuda:7"}, r"device='cuda:7': device cuda:7 "),  # no such GPU here
]


@pytest.mark.parametrize("framework", ["lightning", "transformers"])
@pytest.mark.parametrize(("options", "message"), BAD, ids=["budget", "unknown", "meta", "no-gpu"])
def test_a_bad_option_is_refused_when_the_callback_is_made(framework, options, message):
    pytest.importorskip("lightning" if framework == "lightning" else "transformers")
    callback = importlib.import_module(f"memkit.integrations.{framework}").MemkitCallback
    with pytest.raises(ConfigError, match=message):
        callback(**options)
