"""Byte sizes: parse ``"8GiB"``, ``"1.5GB"``, ``"512M"`` into bytes and format bytes for people.

Units are explicit:

* binary (powers of 1024): ``KiB MiB GiB TiB`` and the short forms ``K M G T`` (``k`` too);
* decimal (powers of 1000): ``kB KB MB GB TB``;
* ``B`` or no unit: bytes.

So ``"8G" == "8GiB" == 8 * 1024**3`` while ``"8GB" == 8 * 1000**3``: the short form follows
``nvidia-smi`` and PyTorch, which report memory in binary units. Case is ignored except that a
trailing ``b`` alone is read as bytes. Whitespace between number and unit is allowed.

Examples:
    >>> parse_size("512MiB")
    536870912
    >>> parse_size("1.5GB")
    1500000000
    >>> format_size(3 * 1024**3)
    '3.00 GiB'
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from memkit.errors import ConfigError

__all__ = [
    "format_names",
    "format_percent",
    "format_shape",
    "format_size",
    "parse_budget",
    "parse_size",
    "size_option",
]

_UNITS: dict[str, int] = {
    "": 1,
    "b": 1,
    "k": 1024,
    "kib": 1024,
    "m": 1024**2,
    "mib": 1024**2,
    "g": 1024**3,
    "gib": 1024**3,
    "t": 1024**4,
    "tib": 1024**4,
    "kb": 1000,
    "mb": 1000**2,
    "gb": 1000**3,
    "tb": 1000**4,
}
_ACCEPTED = (
    "a number of bytes, or a number with a unit: KiB MiB GiB TiB (also K M G T), kB MB GB TB"
)
_PATTERN = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(text: str | int | float) -> int:
    """Return the number of bytes that ``text`` names.

    Args:
        text: ``"8GiB"``, ``"8G"``, ``"512MiB"``, ``"1.5GB"``, ``"1024"`` or an int.

    Raises:
        ConfigError: the text is not a size (the message names it and the accepted forms).
    """
    if isinstance(text, bool):
        raise ConfigError(f"expected a size, found {text!r}; accepted: {_ACCEPTED}")
    if isinstance(text, int):
        if text < 0:
            raise ConfigError(f"expected a non-negative size, found {text}")
        return text
    if isinstance(text, float):
        if text < 0 or text != text:
            raise ConfigError(f"expected a non-negative size, found {text}")
        return round(text)
    match = _PATTERN.match(str(text))
    if match is None:
        raise ConfigError(f"expected a size, found {text!r}; accepted: {_ACCEPTED}")
    number, unit = match.groups()
    factor = _UNITS.get(unit.lower())
    if factor is None:
        raise ConfigError(f"unknown size unit {unit!r} in {text!r}; accepted: {_ACCEPTED}")
    return round(float(number) * factor)


_FORGOTTEN_UNIT = 256
"""A budget without a unit below this many bytes is taken for one whose unit was forgotten."""

_BARE_NUMBER = re.compile(r"\s*\d+(\.\d*)?\s*$")


def parse_budget(budget: str | int | float, option: str = "budget") -> int:
    """The bytes of a device budget: a positive size. A number without a unit is bytes, and
    one below 256 (a card's size in GiB: 8, 24, 80, 141) is taken for a forgotten unit.

    Raises:
        ConfigError: naming ``option``, what was found and what to give instead.

    >>> parse_budget("24GiB"), parse_budget(120_000)
    (25769803776, 120000)
    >>> try:
    ...     parse_budget(12)
    ... except ConfigError as exc:
    ...     print(str(exc)[:43])
    budget=12: 12 is 12 bytes (a number without
    """
    try:
        size = parse_size(budget)
    except ConfigError as exc:
        raise ConfigError(f"{option}={budget!r}: {exc}") from None
    if size <= 0:
        raise ConfigError(
            f"{option}={budget!r}: expected a positive size such as 300MiB or 8GiB, found 0 bytes"
        )
    bare = isinstance(budget, (int, float)) or _BARE_NUMBER.match(str(budget))
    if bare and size < _FORGOTTEN_UNIT:
        raise ConfigError(
            f"{option}={budget!r}: {budget} is {size} bytes (a number without a unit is "
            f"bytes), a device too small to mean; give a unit, e.g. '{budget}GiB' or "
            f"'{budget}MiB' (or at least {_FORGOTTEN_UNIT} bytes)"
        )
    return size


def format_size(n: int | float | None, *, signed: bool = False) -> str:
    """Format bytes with binary units: ``format_size(1536) == '1.50 KiB'``.

    ``None`` becomes ``"n/a"``; ``signed=True`` puts ``+`` before positive values (for diffs).
    """
    if n is None:
        return "n/a"
    sign = "-" if n < 0 else ("+" if signed and n > 0 else "")
    value = float(abs(n))
    if value < 1024:
        return f"{sign}{int(value)} B"
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        value /= 1024
        if value < 1024 or unit == "TiB":
            return f"{sign}{value:.2f} {unit}"
    raise AssertionError("unreachable")


def size_option(n: int) -> str:
    """``n`` bytes as a command-line size that means exactly ``n``: the largest binary unit
    that divides it (``size_option(8 << 20) == '8MiB'``), else bytes (``'1000'``)."""
    for unit, factor in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n and n % factor == 0:
            return f"{n // factor}{unit}"
    return str(n)


def format_percent(fraction: float) -> str:
    """``fraction`` as a percentage: whole above 10%, one decimal below, never a false 0%.

    Examples:
        >>> format_percent(0.4512), format_percent(0.0034), format_percent(0.00001)
        ('45%', '0.3%', 'under 0.1%')
    """
    percent = 100.0 * fraction
    if 0 < percent < 0.05:
        return "under 0.1%"
    return f"{percent:.0f}%" if percent >= 9.95 else f"{percent:.1f}%"


def format_shape(shape: Sequence[int]) -> str:
    """``(1000, 1, 28, 28)``."""
    return "(" + ", ".join(str(n) for n in shape) + ("," if len(shape) == 1 else "") + ")"


def format_names(names: Sequence[str], shown: int = 3) -> str:
    """The first ``shown`` of ``names``, and how many more.

    >>> format_names(["a", "b", "c", "d"]), format_names(["a"])
    ('a, b, c and 1 more', 'a')
    """
    more = len(names) - shown
    return ", ".join(names[:shown]) + (f" and {more} more" if more > 0 else "")
