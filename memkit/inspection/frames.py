"""Python frames of an allocation and the category they suggest (parameters, gradients,
optimizer state, activations, other), and where in your code an allocation was made."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = [
    "CATEGORIES",
    "Frame",
    "bound_gradients",
    "categorize",
    "frames_of",
    "freed_within",
    "where_of",
]

CATEGORIES = (
    "parameters",
    "gradients",
    "backward temporaries",
    "backward, unsorted",
    "optimizer state",
    "optimizer temporaries",
    "activations",
    "other",
    "unknown",
)
"""Categories, in the order reports list them (``unknown``: no frames were recorded). Frames
name only ``gradients``; the inspection then keeps as gradients the backward allocations that a
parameter of the same size can account for, one each: the rest are ``backward temporaries``, or
``backward, unsorted`` where no parameter was recorded (see :func:`bound_gradients`). At the
peak, where the trace says how a block live then was freed (:func:`freed_within`), a block
backward made and freed is a ``backward temporary``, and one an optimizer step made and freed
an ``optimizer temporary``."""

_MODULE_FILE = "torch/nn/modules/module.py"
_PARAMETER_CALLS = frozenset(
    {"_apply", "convert", "to", "cuda", "to_empty", "load_state_dict", "_load_from_state_dict"}
)
_PARAMETER_NAMES = frozenset(
    {
        "load_state_dict",
        "_load_from_state_dict",
        "from_pretrained",
        "_load_state_dict_into_meta_model",
        "reset_parameters",
    }
)
_BACKWARD_NAMES = frozenset({"backward", "_engine_run_backward", "run_backward"})


# -- frames and categories ---------------------------------------------------------------------


@dataclass(frozen=True)
class Frame:
    """One Python frame of an allocation's stack."""

    filename: str
    line: int
    name: str

    def __str__(self) -> str:
        return f"{self.filename}:{self.line}:{self.name}"

    @property
    def short(self) -> str:
        """``file.py:LINE:name`` (the file's base name)."""
        return f"{self.filename.replace(os.sep, '/').rsplit('/', 1)[-1]}:{self.line}:{self.name}"


def _frame_rule(filename: str, name: str) -> str | None:
    """The category one frame implies, or ``None`` (see :func:`categorize`)."""
    path = filename.replace(os.sep, "/")
    if path.startswith("<memkit"):  # memkit's marker: a storage counted when first read
        return "parameters" if name == "parameter" else "other"
    base = path.rsplit("/", 1)[-1]
    if "/optim/" in path or "/optimizers/" in path or "optimizer" in base:
        return "optimizer state"
    if name in _BACKWARD_NAMES or (name == "grad" and "autograd" in path):
        return "gradients"
    if path.endswith(_MODULE_FILE) and name in _PARAMETER_CALLS:
        return "parameters"
    if ("/torch/nn/modules/" in path and name == "__init__") or name in _PARAMETER_NAMES:
        return "parameters"
    if path.endswith("torch/nn/parameter.py"):
        return "parameters"
    if name == "forward" or (path.endswith(_MODULE_FILE) and name.endswith("call_impl")):
        return "activations"
    return None


def categorize(frames: Sequence[Mapping[str, Any]] | Sequence[Frame]) -> str:
    """What an allocation probably is, from its frames (innermost first); the first frame that
    matches a rule decides:

    * memkit's marker frame (``<memkit...>``, a storage counted when first read on the
      simulated device): ``parameters`` for an ``nn.Parameter``, else ``other``;
    * a file in an ``optim``/``optimizers`` folder or named ``*optimizer*``
      (``torch/optim/adam.py``, ``accelerate/optimizer.py``): ``optimizer state``;
    * a function ``backward``, ``_engine_run_backward``, ``run_backward``, or autograd's
      ``grad``: ``gradients``;
    * building or moving a model: ``Module._apply``/``convert``/``to``/``cuda``/``to_empty``, a
      module's ``__init__``, ``reset_parameters``, ``load_state_dict``, ``from_pretrained``:
      ``parameters``;
    * a ``forward`` (or ``Module._call_impl``): ``activations``.

    No match: ``other`` (data, the loss, your own code); no frames at all: ``unknown``. Blocks
    that live on after a step keep the category of where they were made: gradients made in
    backward, optimizer state in ``step``, activations kept for backward in ``forward``.
    """
    if not frames:
        return "unknown"
    for f in frames:
        if isinstance(f, Frame):
            rule = _frame_rule(f.filename, f.name)
        else:
            rule = _frame_rule(str(f.get("filename", "")), str(f.get("name", "")))
        if rule is not None:
            return rule
    return "other"


def freed_within(category: str, free_frames: Sequence[Frame]) -> str:
    """The category of a block made where ``category`` says, given the frames that freed it:
    one made in backward and freed in backward is a ``backward temporary`` (a gradient is
    freed by ``zero_grad``, or lives on), one made in an optimizer step and freed in one (not
    by ``zero_grad``) an ``optimizer temporary`` (the state lives on). No frames: as made.

    Examples:
        >>> step = [Frame("/torch/optim/adam.py", 1, "_single_tensor_adam")]
        >>> freed_within("optimizer state", step)
        'optimizer temporaries'
        >>> freed_within("gradients", [Frame("/torch/optim/optimizer.py", 1, "zero_grad")])
        'gradients'
    """
    if not free_frames or any(f.name == "zero_grad" for f in free_frames):
        return category
    freed_in = categorize(free_frames)
    if category == "gradients" and freed_in == "gradients":
        return "backward temporaries"
    if category == "optimizer state" and freed_in == "optimizer state":
        return "optimizer temporaries"
    return category


def bound_gradients(items: Sequence[tuple[str, int]]) -> list[str]:
    """The categories of ``(category, requested bytes)`` allocations alive together, with the
    frame guess ``gradients`` bounded by what is possible: a gradient has its parameter's size,
    and there is at most one per parameter. Backward allocations matched to a parameter of the
    same size stay ``gradients``; the others are ``backward temporaries`` (backward's
    intermediate results), or ``backward, unsorted`` when no parameter is among ``items``
    (recorded before the history began: nothing to bound them by).

    Examples:
        >>> bound_gradients([("parameters", 4096), ("gradients", 4096), ("gradients", 4096)])
        ['parameters', 'gradients', 'backward temporaries']
    """
    sizes: dict[int, int] = {}
    for category, nbytes in items:
        if category == "parameters":
            sizes[nbytes] = sizes.get(nbytes, 0) + 1
    out = []
    for category, nbytes in items:
        if category == "gradients":
            if not sizes:
                category = "backward, unsorted"
            elif sizes.get(nbytes, 0) > 0:
                sizes[nbytes] -= 1
            else:
                category = "backward temporaries"
        out.append(category)
    return out


def frames_of(raw: Any) -> tuple[Frame, ...]:
    if not isinstance(raw, (list, tuple)):
        return ()
    out = []
    for f in raw:
        if isinstance(f, Mapping):
            line = f.get("line", 0)
            out.append(
                Frame(
                    str(f.get("filename", "?")),
                    int(line) if isinstance(line, int) else 0,
                    str(f.get("name", "?")),
                )
            )
    return tuple(out)


_MEMKIT_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))).replace(os.sep, "/") + "/"
_LIBRARY_DIRS = ("/site-packages/", "/dist-packages/", "/torch/", "/lib/python")


def _yours(frame: Frame) -> bool:
    """A frame of the user's code: not a library's (torch, site-packages, the standard
    library), not memkit's, not a marker."""
    path = frame.filename.replace(os.sep, "/")
    if path.startswith("<") and path != "<stdin>":
        return False
    return not path.startswith(_MEMKIT_DIR) and not any(d in path for d in _LIBRARY_DIRS)


def where_of(frames: Sequence[Frame]) -> str:
    """Where an allocation was made: the innermost frame of your code (not torch's, a
    library's or memkit's), ``>`` the innermost frame when that is another; ``-`` without
    frames."""
    if not frames:
        return "-"
    own = next((f for f in frames if _yours(f)), None)
    if own is None:
        return frames[0].short
    if own is frames[0]:
        return own.short
    return f"{own.short} > {frames[0].short}"
