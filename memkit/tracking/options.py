"""The tracking options, checked once for every way in (``memkit.track``, the framework
callbacks): a bad value is a ConfigError naming the option, what was expected and what was
found, when the tracker or the callback is made, not a traceback from deep inside the tracker
when training starts.

>>> check_track_options(module_every=10, timeline_limit=0)
>>> check_track_options(per_module="no")
Traceback (most recent call last):
...
memkit.errors.ConfigError: per_module: expected True or False, found 'no' (str)
"""

from __future__ import annotations

from memkit.errors import ConfigError, check_flag, check_whole, found

__all__ = ["check_flag", "check_track_options", "check_whole"]

POSTMORTEM_TARGETS = ("stderr", None)
"""Where the OOM post-mortem goes: stderr, or only the log (``None``)."""


def check_track_options(
    *,
    per_module: object = True,
    module_every: object = None,
    timeline_limit: object = 0,
    postmortem: object = "stderr",
) -> None:
    """The options a tracker takes from ``memkit.track`` and the framework callbacks.

    Raises:
        ConfigError: the first bad option, named, with what was expected and what was found.
    """
    check_flag("per_module", per_module)
    check_whole("module_every", module_every, 1, "steps", none_means="the default")
    check_whole("timeline_limit", timeline_limit, 0, "counter readings")
    if postmortem not in POSTMORTEM_TARGETS:
        raise ConfigError(f"postmortem: expected 'stderr' or None, found {found(postmortem)}")
