"""One interface for memkit's results: JSON from the dataclass fields, HTML from one body.

Every top-level result (:class:`~memkit.probing.result.ProbeResult`,
:class:`~memkit.tracking.report.TrackReport`, :class:`~memkit.snapshots.Snapshot`,
:class:`~memkit.estimation.Estimate`, ...) is a frozen dataclass that mixes in :class:`Result`
and so has the same methods:

- ``to_dict()``: the fields, JSON-ready (nested results through their own ``to_dict``, tuples
  as lists), after the class's :meth:`Record._json_fields` hook has added its computed fields;
  the first key is ``"schema"``, the class's :attr:`Result.SCHEMA` (``"memkit.ProbeResult/1"``).
- ``to_json(path=None, *, indent=...)``: that dict as JSON text, also written to ``path``.
- ``html_body()``: the HTML without page shell or style (the class supplies it, from
  :mod:`memkit.render`).
- ``_repr_html_()``: the notebook fragment (the body in a scoped style).
- ``to_html(path=None)``: a whole self-contained page, also written to ``path``.
- ``__str__()``: the text layout (the class supplies it, from :mod:`memkit.render`).
- ``__repr__()``: one line, the class name and the few numbers that matter (the class
  supplies it; the text is ``str()``, the notebook shows the HTML).

Nested records (a trial, a device's row) mix in :class:`Record` for the same ``to_dict``
without a schema. Torch-free.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, ClassVar

from memkit.render import html as h

__all__ = ["Record", "Result", "json_fields", "json_value", "memory_model_json", "write_json"]


def json_value(value: Any) -> Any:
    """``value`` as JSON-ready data: ``to_dict()`` where there is one, dataclasses as dicts of
    their fields, tuples as lists, paths as text; anything else as is."""
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    to_dict = getattr(value, "to_dict", None)
    if to_dict is not None and not isinstance(value, type):
        return to_dict()
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return json_fields(value)
    if isinstance(value, (list, tuple)):
        return [json_value(v) for v in value]
    if isinstance(value, dict):
        return {k: json_value(v) for k, v in value.items()}
    if isinstance(value, Path):
        return str(value)
    return value


def json_fields(obj: Any, skip: tuple[str, ...] = ()) -> dict[str, Any]:
    """A dataclass's fields, in declaration order, as JSON-ready values (``skip``: left out)."""
    return {
        f.name: json_value(getattr(obj, f.name))
        for f in dataclasses.fields(obj)
        if f.name not in skip
    }


def write_json(data: Any, path: str | Path | None, indent: int | None) -> str:
    """``data`` as JSON text; also written to ``path`` (with a final newline) if given."""
    text = json.dumps(data, indent=indent)
    if path is not None:
        Path(path).write_text(text + "\n", encoding="utf-8")
    return text


def memory_model_json(out: dict[str, Any]) -> dict[str, Any]:
    """Move a result's ``fixed_bytes`` and ``per_sample_bytes`` (its peak as a line of the
    batch size) and ``per_pair_bytes`` (where present: a ``batch**2`` term) into one
    ``memory_model`` key (``None`` without a model); returns ``out``."""
    fixed, per_sample = out.pop("fixed_bytes"), out.pop("per_sample_bytes")
    per_pair = out.pop("per_pair_bytes", None)
    model = None if per_sample is None else {"fixed_bytes": fixed, "per_sample_bytes": per_sample}
    if model is not None and per_pair is not None:
        model["per_pair_bytes"] = per_pair
    out["memory_model"] = model
    return out


class Record:
    """``to_dict()`` for a frozen dataclass: its fields, then the class's computed fields."""

    __slots__ = ()

    _JSON_SKIP: ClassVar[tuple[str, ...]] = ()
    """Fields the :meth:`_json_fields` hook writes itself (or leaves out)."""

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict: the fields, then what :meth:`_json_fields` adds or reshapes."""
        return self._json_fields(json_fields(self, self._JSON_SKIP))

    def _json_fields(self, out: dict[str, Any]) -> dict[str, Any]:
        """The hook: ``out`` holds the fields already JSON-ready; add the computed fields
        (properties), reshape or drop some, and return it."""
        return out


_INDENT_DEFAULT: Any = object()
"""``to_json``'s ``indent`` when not given (``None`` is a value: one line)."""


class Result(Record):
    """The interface of every top-level result (see the module docstring).

    A subclass sets :attr:`SCHEMA` and :attr:`HTML_TITLE`, defines ``__str__`` and
    :meth:`html_body` (both from :mod:`memkit.render`) and a one-line ``__repr__``.
    """

    __slots__ = ()

    SCHEMA: ClassVar[str]
    """The version key's value: ``"memkit.<class>/<version>"``, the first key of ``to_dict``."""
    HTML_TITLE: ClassVar[str]
    """The title of the page :meth:`to_html` writes."""
    JSON_INDENT: ClassVar[int | None] = 2
    """``to_json``'s default indentation."""

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict: ``schema``, the fields, and the class's computed fields."""
        return {"schema": self.SCHEMA, **super().to_dict()}

    def to_json(
        self,
        path: str | Path | None = None,
        *,
        indent: int | None = _INDENT_DEFAULT,
        **dict_options: Any,
    ) -> str:
        """:meth:`to_dict` as JSON text; also written to ``path`` if given.

        ``indent`` defaults to :attr:`JSON_INDENT`; ``indent=None`` is one line.
        ``dict_options`` go to ``to_dict`` (``report.to_json(timeline=False)``).
        """
        if indent is _INDENT_DEFAULT:
            indent = self.JSON_INDENT
        return write_json(self.to_dict(**dict_options), path, indent)

    def __str__(self) -> str:
        raise NotImplementedError(f"{type(self).__name__} has no text layout")

    def html_body(self) -> str:
        """The HTML without page shell or style (from :mod:`memkit.render`)."""
        raise NotImplementedError(f"{type(self).__name__} has no HTML layout")

    def _repr_html_(self) -> str:
        return h.fragment(self.html_body())

    def to_html(self, path: str | Path | None = None) -> str:
        """A self-contained HTML page (inline SVG, no scripts); also written to ``path``."""
        page = h.page(self.HTML_TITLE, self.html_body())
        if path is not None:
            Path(path).write_text(page, encoding="utf-8")
        return page
