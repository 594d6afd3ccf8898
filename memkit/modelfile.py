"""The model-file protocol shared by ``memkit probe`` and ``memkit estimate``.

A model file is a Python file that defines::

    def build_model() -> torch.nn.Module: ...                      # required
    def make_batch(batch_size: int) -> Tensor | tuple | dict: ...  # required; may take seq_len
    def build_optimizer(params) -> torch.optim.Optimizer: ...      # optional, default AdamW
    def loss_fn(output, batch) -> Tensor: ...                      # optional
    def train_step(model, batch, optimizer) -> None: ...           # optional: replaces the step
    def eval_step(model, batch) -> Any: ...                        # optional: --mode infer's step

Loading a file runs it once as a module (its directory is put on ``sys.path`` so it can import
its neighbours, and ``sys.argv`` is ``[path]``: an ``argparse`` at import sees no memkit option).
Every way a file can be unusable becomes a :class:`ModelFileError` that says what was expected,
what was found and where; a ``sys.exit`` while it loads is one too. A ``sys.exit`` in one of its
functions becomes :class:`SysExitCalled`, an error of that function like any other (memkit runs
them many times: they return or raise, they do not end the process).
"""

from __future__ import annotations

import functools
import importlib.util
import inspect
import os
import re
import sys
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

from memkit.errors import ModelFileError, spelled

__all__ = [
    "EXPECTED_SIGNATURES",
    "ModelSpec",
    "SysExitCalled",
    "batch_args",
    "build_model",
    "call_user",
    "check_seq_len",
    "load_model_file",
    "make_optimizer",
    "needs_seq_len",
    "seq_len_missing",
]

EXPECTED_SIGNATURES = """\
    def build_model() -> torch.nn.Module                  (required)
    def make_batch(batch_size[, seq_len]) -> Tensor | tuple | dict   (required)
    def build_optimizer(params) -> torch.optim.Optimizer  (optional, default AdamW)
    def loss_fn(output, batch) -> Tensor                  (optional)
    def train_step(model, batch, optimizer) -> Any        (optional)
    def eval_step(model, batch) -> Any                    (optional, --mode infer)"""

_REQUIRED = ("build_model", "make_batch")
_OPTIONAL = ("build_optimizer", "loss_fn", "train_step", "eval_step")


class SysExitCalled(Exception):
    """A model file's function called ``sys.exit`` (raised ``SystemExit``): an error of that
    function, handled where it was called as any other (``SystemExit`` would end memkit with
    the file's exit code and no report). The ``SystemExit`` is its ``__cause__``."""


def _exit_is_an_error(func: Callable[..., Any], name: str, path: str) -> Callable[..., Any]:
    """``func`` (the model file's ``name``), raising :class:`SysExitCalled` where it calls
    ``sys.exit``; its signature is ``func``'s (``__wrapped__``)."""

    @functools.wraps(func)
    def call(*args: Any, **kwargs: Any) -> Any:
        try:
            return func(*args, **kwargs)
        except SystemExit as exc:
            raise SysExitCalled(
                f"{name}() in {path} called sys.exit({exc.code!r}); memkit calls a model "
                "file's functions many times: return, or raise an error, instead"
            ) from exc

    return call


@dataclass(frozen=True)
class ModelSpec:
    """The functions a model file provides (optional ones are ``None`` when absent)."""

    path: str
    build_model: Callable[[], Any]
    make_batch: Callable[..., Any]
    build_optimizer: Callable[[Any], Any] | None = None
    loss_fn: Callable[[Any, Any], Any] | None = None
    train_step: Callable[[Any, Any, Any], Any] | None = None
    eval_step: Callable[[Any, Any], Any] | None = None

    @property
    def takes_seq_len(self) -> bool:
        """Whether ``make_batch`` accepts a ``seq_len`` argument."""
        return accepts_seq_len(self.make_batch)


def accepts_seq_len(make_batch: Callable[..., Any]) -> bool:
    """True when ``make_batch`` has a ``seq_len`` parameter or a second positional one."""
    try:
        params = list(inspect.signature(make_batch).parameters.values())
    except (TypeError, ValueError):
        return False
    if any(p.name == "seq_len" or p.kind is p.VAR_KEYWORD for p in params):
        return True
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return len(positional) >= 2 or any(p.kind is p.VAR_POSITIONAL for p in params)


def _user_traceback(exc: BaseException, path: str) -> str:
    """The traceback of an exception, from the first frame inside the user's file on."""
    frames = traceback.extract_tb(exc.__traceback__)
    start = next((i for i, f in enumerate(frames) if f.filename == path), 0)
    lines = traceback.format_list(frames[start:])
    lines += traceback.format_exception_only(type(exc), exc)
    return "".join(lines).rstrip()


_MEMKIT_DIR = os.path.dirname(os.path.abspath(__file__))
_MODULE_CALL = os.path.join("torch", "nn", "modules", "module.py")


def step_traceback(exc: BaseException, hide: tuple[str, ...] = ()) -> str:
    """The traceback of an error the user's step raised, with its causes (``raise ... from``)
    and contexts, without memkit's own frames and torch's module-call plumbing
    (``Module.__call__``) nor those of files under ``hide``: the frames of the model file, the
    model and the torch functions it called. ``MEMKIT_TRACEBACK=1`` keeps every frame (a bug
    in memkit's default step)."""

    def frame_file(text: str) -> str | None:
        return text.split('"', 2)[1] if text.lstrip().startswith('File "') else None

    whole = os.environ.get("MEMKIT_TRACEBACK") == "1"
    out = [
        text
        for text in traceback.TracebackException.from_exception(exc).format()
        if whole
        or (name := frame_file(text)) is None
        or not (
            name.startswith(_MEMKIT_DIR) or name.endswith(_MODULE_CALL) or name.startswith(hide)
        )
    ]
    header = "Traceback (most recent call last):\n"  # dropped where no frame is left under it
    after = [*out[1:], ""]
    kept = [t for t, a in zip(out, after, strict=True) if t != header or frame_file(a)]
    return "".join(kept).rstrip()


def call_user(func: Callable[..., Any], *args: Any, what: str, path: str) -> Any:
    """Call a model-file function; a failure becomes a ModelFileError with its traceback."""
    try:
        return func(*args)
    except SysExitCalled as exc:  # its message names the function; the traceback is the exit's
        raise ModelFileError(f"{exc}\n{_user_traceback(exc.__cause__ or exc, path)}") from exc
    except Exception as exc:
        hint = (  # (sweep CL: a make_batch ending in .to('cuda'), on a machine without it)
            "\nIt asked for CUDA, which this machine does not have: make_batch and "
            "build_model return their tensors and model as made (on the CPU), and memkit "
            "moves them to the device it measures"
            if what.startswith(("make_batch", "build_model")) and _NO_CUDA.search(str(exc))
            else ""
        )
        raise ModelFileError(
            f"{what} in {path} raised {type(exc).__name__}: {exc}{hint}\n"
            f"{_user_traceback(exc, path)}"
        ) from exc


_NO_CUDA = re.compile(
    r"not compiled with CUDA|compiled without CUDA|No CUDA GPUs are available|no NVIDIA driver"
    r"|CUDA driver|accelerator device when none is available|_cuda_setDevice",
    re.IGNORECASE,
)
"""What torch says where a model file asks for CUDA on a machine without it."""


def load_model_file(path: str | Path) -> ModelSpec:
    """Run a model file and collect its functions.

    Raises:
        ModelFileError: the file is missing, is not Python, has a syntax error (with file:line),
            raises while loading (with its traceback), or lacks a required function.
    """
    file = Path(path)
    if not file.exists():
        raise ModelFileError(
            f"model file {str(path)!r} not found; expected a Python file defining:\n"
            f"{EXPECTED_SIGNATURES}"
        )
    if not file.is_file():
        raise ModelFileError(f"model file {str(path)!r} is a directory, not a Python file")
    resolved = str(file.resolve())
    module = _execute(file, resolved)
    missing = [name for name in _REQUIRED if not callable(getattr(module, name, None))]
    if missing:
        own = {
            name: value
            for name, value in vars(module).items()
            if callable(value)
            and not name.startswith("_")
            and getattr(value, "__module__", None) == module.__name__
        }
        functions = sorted(n for n, v in own.items() if not isinstance(v, type))
        classes = sorted(n for n, v in own.items() if isinstance(v, type))
        found = f"found functions: {', '.join(functions) or 'none'}" + (
            f"; classes: {', '.join(classes)}" if classes else ""
        )
        raise ModelFileError(
            f"{path} does not define {' and '.join(missing)}; {found}. A model file "
            f"defines:\n{EXPECTED_SIGNATURES}"
        )
    optional: dict[str, Any] = {}
    for name in _OPTIONAL:
        value = getattr(module, name, None)
        if value is not None and not callable(value):
            raise ModelFileError(f"{path}: {name} is a {type(value).__name__}, expected a function")
        optional[name] = None if value is None else _exit_is_an_error(value, name, resolved)
    return ModelSpec(
        path=resolved,
        build_model=_exit_is_an_error(module.build_model, "build_model", resolved),
        make_batch=_exit_is_an_error(module.make_batch, "make_batch", resolved),
        **optional,
    )


def _execute(file: Path, resolved: str) -> ModuleType:
    name = f"memkit_model_{abs(hash(resolved)):x}"
    spec = importlib.util.spec_from_file_location(name, resolved)
    if spec is None or spec.loader is None:
        raise ModelFileError(f"{file} cannot be loaded as Python (expected a .py file)")
    module = importlib.util.module_from_spec(spec)
    folder = str(file.resolve().parent)
    if folder not in sys.path:  # like running a script: its folder's modules are importable
        sys.path.insert(0, folder)
    sys.modules[name] = module
    saved_argv, sys.argv = sys.argv, [resolved]  # not memkit's options: the file's argparse
    try:
        spec.loader.exec_module(module)
    except SystemExit as exc:
        sys.modules.pop(name, None)
        raise ModelFileError(
            f"loading {file} called sys.exit({exc.code!r}): a model file defines functions "
            "for memkit to call, it does not end the process while it loads (put a script's "
            "own code under if __name__ == '__main__':)\n"
            f"{_user_traceback(exc, resolved)}"
        ) from None
    except SyntaxError as exc:
        sys.modules.pop(name, None)
        raise ModelFileError(
            f"syntax error in {exc.filename or file}:{exc.lineno}: {exc.msg}\n"
            f"    {(exc.text or '').rstrip()}"
        ) from None
    except Exception as exc:
        sys.modules.pop(name, None)
        raise ModelFileError(
            f"loading {file} raised {type(exc).__name__}: {exc}\n{_user_traceback(exc, resolved)}"
        ) from exc
    finally:
        sys.argv = saved_argv
    return module


def batch_args(batch_size: int, seq_len: int | None) -> tuple[int, ...]:
    """``make_batch``'s arguments: ``(batch_size,)``, or ``(batch_size, seq_len)`` where a
    sequence length is given."""
    return (batch_size,) if seq_len is None else (batch_size, seq_len)


def check_seq_len(spec: ModelSpec, seq_len: int | None) -> None:
    """``make_batch`` takes the sequence length given, and needs none when none is: else a
    :class:`ModelFileError` that says what to give (as the command line or the Python API
    spells it)."""
    if seq_len is not None and not spec.takes_seq_len:
        given = spelled(f"--seq-len {seq_len}", f"seq_len={seq_len}")
        raise ModelFileError(
            f"{given} was given but make_batch in {spec.path} takes no seq_len; define "
            "make_batch(batch_size, seq_len), or leave the sequence length out"
        )
    if seq_len is None and needs_seq_len(spec.make_batch):
        raise ModelFileError(f"make_batch in {spec.path} {seq_len_missing(spec.make_batch)}")


def needs_seq_len(make_batch: Callable[..., Any]) -> bool:
    """True when ``make_batch`` cannot be called with the batch size alone, but can with a
    sequence length after it."""
    try:
        signature = inspect.signature(make_batch)
    except (TypeError, ValueError):
        return False
    for args, fits in (((1,), False), ((1, 1), True)):
        try:
            signature.bind(*args)
        except TypeError:
            continue
        return fits
    return False


def seq_len_missing(make_batch: Callable[..., Any]) -> str:
    """What to do when ``make_batch`` needs a sequence length and none was given."""
    return (
        f"needs a sequence length (its signature is {inspect.signature(make_batch)}) and none "
        f"was given: give one with {spelled('--seq-len N', 'seq_len=N')}, or give seq_len a "
        "default"
    )


def build_model(spec: ModelSpec) -> Any:
    """Call the file's ``build_model`` (on the current default device); anything but a
    ``torch.nn.Module`` is a :class:`ModelFileError`."""
    import torch

    model = call_user(spec.build_model, what="build_model()", path=spec.path)
    if not isinstance(model, torch.nn.Module):
        raise ModelFileError(
            f"build_model() in {spec.path} returned {type(model).__name__}; expected a "
            "torch.nn.Module"
        )
    return model


def make_optimizer(spec: ModelSpec, model: Any) -> tuple[Any, str]:
    """The optimizer a model file asks for (``build_optimizer``) or AdamW, and how to name it
    in a report (``"SGD (build_optimizer)"``, ``"AdamW (default)"``)."""
    import torch

    if spec.build_optimizer is None:
        if next(iter(model.parameters()), None) is None:
            raise ModelFileError(
                f"{spec.path}: build_model() returned a {type(model).__name__} with no "
                "parameters, so there is nothing to train (the default optimizer, AdamW, needs "
                "some); probe its forward alone with --mode infer, or return the model you train"
            )
        return torch.optim.AdamW(model.parameters()), "AdamW (default)"
    optimizer = call_user(
        spec.build_optimizer, model.parameters(), what="build_optimizer()", path=spec.path
    )
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ModelFileError(
            f"build_optimizer() in {spec.path} returned {type(optimizer).__name__}; "
            "expected a torch.optim.Optimizer"
        )
    return optimizer, f"{type(optimizer).__name__} (build_optimizer)"
