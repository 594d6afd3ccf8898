"""One accounted training step on ``meta`` tensors, replayed through the allocator model.

:class:`MetaSession` holds the meta model, its optimizer and the target's settings and runs a
trial per batch size; :class:`TargetMode` applies the target's autocast policy and attention
kernel above autograd; :class:`StepRecorder` receives the accountant's allocations and frees,
feeds the caching-allocator model and labels bytes for the breakdown.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import os
import re
import sys
import threading
import time
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

from memkit.cuda_autocast import requested, requests_recorded
from memkit.errors import MemkitError, ModelFileError, UserCodeError
from memkit.estimation.attention import choose_kernel, fused_attention
from memkit.estimation.autocast import AutocastPolicy
from memkit.estimation.workspaces import KernelWorkspaces
from memkit.modelfile import ModelSpec, batch_args, call_user, step_traceback
from memkit.probing.step import StepPlan, call_model, inference_mode_as_no_grad, to_device
from memkit.simulated.accountant import MemoryAccountant, storages_of, tensors_of
from memkit.simulated.allocator import CachingAllocatorModel

__all__ = [
    "META",
    "MetaSession",
    "StepRecorder",
    "TargetMode",
    "TrialPeaks",
    "run_guarded",
    "target_mode",
    "target_rules_on",
]

META = torch.device("meta")

_SIMULATED_RUN = "memkit probe FILE --device cpu --budget <the GPU's memory less its CUDA context>"
"""The run that measures a step the estimate cannot run on meta, on the simulated device."""

_REDISPATCH: Callable[..., Any] | None = getattr(torch.overrides, "redispatch_function", None)
"""``torch.overrides.redispatch_function`` where the installed PyTorch has it (2.13 does):
runs a Python function's body past its own ``__torch_function__`` check, so a mode back on its
stack sees the calls inside."""


def _is_meta_bool(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.is_meta and value.numel() == 1


class TargetMode(TorchFunctionMode):
    """Applies autocast's policy and the attention-kernel footprint above autograd."""

    def __init__(
        self, policy: AutocastPolicy | None, attention: str, sm: int, inference: bool = False
    ) -> None:
        super().__init__()
        self.policy = policy
        self.attention = attention
        self.sm = sm
        self.inference = inference
        self.file_dtypes: set[torch.dtype] = set()
        """The dtypes of the file's own ``torch.autocast("cuda")`` regions the step entered."""
        self.cpu_dtypes: set[torch.dtype] = set()
        """The half dtypes of the file's own ``torch.autocast("cpu")`` regions the step entered
        (they cast nothing on the target's CUDA tensors)."""
        self._regions: list[tuple[AutocastPolicy | None, bool, torch.dtype]] = []
        self.kernels: set[str] = set()
        self.data_checks = 0  # truth values read from meta tensors (approximated as true)
        self.generate_checks = 0  # of them, inside a Hugging Face generate() (its stopping)
        self.step_codes: frozenset[types.CodeType] = frozenset()  # the file's own step's code
        self.step_reads = 0  # ``.item()`` in that step's own lines (:func:`value_on_meta`)
        self._entered = 0
        self._in_backward = 0
        self._bodies: list[Callable[..., Any]] = []  # Python functions running with the mode on
        self._cpu_dtype = torch.get_autocast_dtype("cpu")
        self._mark = torch.float16 if self._cpu_dtype != torch.float16 else torch.bfloat16

    def __enter__(self) -> TargetMode:
        if self._entered == 0 and self.policy is not None:
            # torch.utils.checkpoint saves the autocast state of a checkpointed forward and
            # re-enters it around the recompute in backward (_get_autocast_kwargs); for meta
            # tensors the one state it carries is CPU autocast's. Its dtype says that the
            # policy is on (CPU autocast itself stays disabled: nothing is cast by it).
            self._cpu_dtype = torch.get_autocast_dtype("cpu")
            self._mark = torch.float16 if self._cpu_dtype != torch.float16 else torch.bfloat16
            torch.set_autocast_dtype("cpu", self._mark)
        self._entered += 1
        super().__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        super().__exit__(*exc)
        self._entered -= 1
        if self._entered == 0 and self.policy is not None:
            torch.set_autocast_dtype("cpu", self._cpu_dtype)

    @property
    def in_backward(self) -> bool:
        """Whether a backward the mode runs is under way (a checkpoint's recompute)."""
        return self._in_backward > 0

    def file_region_begins(self, dtype: torch.dtype, enabled: bool) -> None:
        """The file's own ``torch.autocast("cuda", dtype, enabled)`` region begins (a CPU
        build disables it, and meta tensors have no autocast key): the policy for ``dtype``
        on inside it, as the target's autocast would be; ``enabled=False`` (an fp32 loss
        inside an autocast forward) turns it off. CPU autocast's dtype carries the mark that a
        checkpoint's recompute in backward reads (:meth:`__enter__`)."""
        policy = self.policy
        self._regions.append(
            (policy, policy is not None and policy.enabled, torch.get_autocast_dtype("cpu"))
        )
        if enabled and dtype in (torch.bfloat16, torch.float16):
            self.file_dtypes.add(dtype)
            if policy is None or policy.dtype != dtype:
                policy = self.policy = AutocastPolicy(dtype, inference=self.inference)
            policy.enabled = True
            torch.set_autocast_dtype("cpu", self._mark)
        else:  # off (an fp32 region too): no policy, and no mark for a recompute inside
            if policy is not None:
                policy.enabled = False
            torch.set_autocast_dtype("cpu", self._cpu_dtype)

    def file_region_ends(self) -> None:
        """The region :meth:`file_region_begins` began ends: the policy as it was before it
        (a policy the region made stays, off, for the recompute of a checkpoint inside it),
        its weight casts dropped where the outermost region ends, as autocast's cache is."""
        policy, enabled, cpu_dtype = self._regions.pop()
        if policy is not None:
            self.policy = policy
            policy.enabled = enabled
        elif self.policy is not None:
            self.policy.enabled = False
        if not self._regions and self.policy is not None:
            self.policy.clear_cache()
        torch.set_autocast_dtype("cpu", cpu_dtype)

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        if func is torch.Tensor.backward or func is torch.autograd.backward:
            return self._backward(func, args, kwargs)
        if self._in_backward and self.policy is not None:
            # only a checkpoint's recompute runs under autocast in backward, as its forward did
            self.policy.enabled = torch.get_autocast_dtype("cpu") == self._mark
        name = getattr(func, "__name__", "")
        if (
            name == "item"
            and self.step_codes
            and args
            and _is_meta_bool(args[0])
            and args[0].is_floating_point()  # (an integer is a length or a count: review CM)
            and sys._getframe(1).f_code in self.step_codes
        ):
            # the file's train_step or eval_step returning `loss.item()`, as docs/probe.md
            # has it (sweep CQ: exit 3 on a file the probe ran): a number returned, printed or
            # kept holds no device memory; one computed with or decided on stops the step
            # (review CL: read as 0, a length trimmed the batch to nothing, answer 1336x)
            self.step_reads += 1
            return value_on_meta()
        if name == "__bool__" and args and _is_meta_bool(args[0]):
            # A data-dependent check on a meta tensor has no value: take it as true, the case
            # of the batches make_batch builds (an all-ones attention mask's `mask.all()`).
            self.data_checks += 1
            if _in_generate(sys._getframe(1)):
                self.generate_checks += 1
            return True
        if self.policy is not None:
            if name == "cross_entropy":
                result = self.policy.cross_entropy(args, kwargs)
                if result is not NotImplemented:
                    return result
            args, kwargs = self.policy.cast_args(name, args, kwargs)
        if name in _SAME_DTYPE_OPS:
            _refuse_mixed_dtypes(name, args, kwargs)
        if name == "scaled_dot_product_attention":
            return self._attention(func, args, kwargs)
        if name == "dropout" and self.attention != "cpu-flash":  # cpu-flash: a CPU target
            return self._dropout(func, args, kwargs)
        return self._call(func, types, args, kwargs)

    def _call(
        self, func: Callable[..., Any], types: Any, args: tuple[Any, ...], kw: dict[str, Any]
    ) -> Any:
        """Run ``func``; a Python function (``F.multi_head_attention_forward``,
        ``F.layer_norm``, a ``Tensor`` method written in Python) with this mode back on, so the
        torch calls inside it get the target's rules too (the SDPA call inside
        ``nn.MultiheadAttention``, the autocast policy of its linears). A mode handling a call
        is off its stack; builtins have no torch calls inside that it would miss. Without
        :data:`_REDISPATCH` (an older PyTorch) the body runs without the mode, as one call.

        A ``Tensor`` method written in Python that calls its C namesake (``Tensor.unflatten``'s
        ``super().unflatten``) gets the Python method back as ``func`` from the C call: inside
        its own body it runs as one call, the builtin it stands for."""
        if _REDISPATCH is None or not inspect.isfunction(func) or func in self._bodies:
            return func(*args, **kw)
        self._bodies.append(func)
        try:
            with self:
                return _REDISPATCH(func, types, args, kw)
        finally:
            self._bodies.pop()

    def _backward(self, func: Callable[..., Any], args: tuple[Any, ...], kw: dict[str, Any]) -> Any:
        """Backward, with this mode active while autograd runs it: the Python code backward
        calls (a checkpoint's recompute of its forward) runs as the forward ran (dropout,
        attention, the autocast policy where the forward had it).

        A mode handling a call is off its stack, and ``torch.autograd.backward`` hands any call
        with tensors to the active modes; called with the outputs' gradient edges (tensors no
        more), it runs the engine with the mode back on the stack, which the engine keeps.
        """
        policy = self.policy
        # a backward inside one of the file's regions: the region (and its cast cache, which
        # autocast keeps until the region ends) goes on after it
        resume = bool(self._regions) and policy is not None and policy.enabled
        cpu_dtype = torch.get_autocast_dtype("cpu")
        if policy is not None:  # the autocast region ends where backward starts
            if resume:  # off in backward (but for a recompute), its cache kept
                policy.enabled, policy.weak = False, True
            else:
                policy.end_region()
            torch.set_autocast_dtype("cpu", self._cpu_dtype)
        try:
            edges = _gradient_edges(func, args, kw)
            if edges is None:  # what the edges cannot say (inputs=, an implicit non-scalar grad)
                return func(*args, **kw)
            self._in_backward += 1
            try:
                with self:
                    torch.autograd.backward(*edges)
            finally:
                self._in_backward -= 1
            return None
        finally:
            if self.policy is not None:
                self.policy.enabled = False  # whatever the last recompute left
            if resume and policy is not None:
                policy.enabled, policy.weak = True, False
                torch.set_autocast_dtype("cpu", cpu_dtype)

    @staticmethod
    def _dropout(func: Callable[..., Any], args: tuple[Any, ...], kw: dict[str, Any]) -> Any:
        """Dropout as CUDA runs it: ``at::native::dropout`` takes the fused ``native_dropout``
        (its backward saves a 1-byte bool mask) when the input is on CUDA and ``0 < p < 1``
        (``is_fused_kernel_acceptable``); elsewhere, meta included, it multiplies by a noise
        tensor of the input's dtype, which backward saves (4 bytes an element in fp32).
        In-place dropout takes the noise path on CUDA too, and runs as it is."""
        names = ("input", "p", "training", "inplace")
        bound = dict(zip(names, args, strict=False)) | kw
        x = bound.get("input")
        p = float(bound.get("p", 0.5))
        training = bound.get("training", bound.get("train", True))
        if (
            isinstance(x, torch.Tensor)
            and training
            and not bound.get("inplace", False)
            and 0.0 < p < 1.0
            and x.numel() > 0
        ):
            return torch.native_dropout(x, p, True)[0]
        return func(*args, **kw)

    def _attention(
        self, func: Callable[..., Any], args: tuple[Any, ...], kw: dict[str, Any]
    ) -> Any:
        names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale")
        bound = dict(zip(names, args, strict=False)) | kw
        query, key, value = bound["query"], bound["key"], bound["value"]
        mask = bound.get("attn_mask")
        dropout = float(bound.get("dropout_p") or 0.0)
        causal = bool(bound.get("is_causal", False))
        kernel = choose_kernel(self.attention, query, key, value, mask, self.sm, dropout, causal)
        self.kernels.add(kernel)
        if kernel == "math":
            return func(*args, **kw)
        return fused_attention(query, key, value, kernel, self.sm, mask)


def target_mode(
    policy_dtype: torch.dtype | None, attention: str, sm: int, *, inference: bool = False
) -> TargetMode:
    """A fresh :class:`TargetMode` for one step: autocast's policy for ``policy_dtype`` (none
    for fp32), the attention kernel request and the target's compute capability."""
    policy = None if policy_dtype is None else AutocastPolicy(policy_dtype, inference=inference)
    return TargetMode(policy, attention, sm, inference)


def _in_generate(frame: Any, depth: int = 40) -> bool:
    """Whether ``frame`` runs inside a Hugging Face ``generate()`` (``transformers.generation``),
    whose stopping checks read the sequences' values."""
    while frame is not None and depth > 0:
        if frame.f_code.co_name == "generate" and frame.f_globals.get("__name__", "").startswith(
            "transformers.generation"
        ):
            return True
        frame, depth = frame.f_back, depth - 1
    return False


@contextlib.contextmanager
def target_rules_on(mode: TargetMode) -> Iterator[TargetMode]:
    """Run the block as the target runs a step: ``mode``'s rules above autograd, and eager even
    for a ``torch.compile``'d model (TorchDynamo does not compile under the accountant, and the
    unaccounted warm-up must run what is counted). The fused inference path of
    ``nn.TransformerEncoder``/``MultiheadAttention`` is off, as meta tensors would have it: its
    checks read the padding mask's values first (``_nested_tensor_from_mask_left_aligned`` has
    no meta kernel), and the estimate does not model that path (docs/estimate.md)."""
    fastpath = torch.backends.mha.get_fastpath_enabled()
    torch.backends.mha.set_fastpath_enabled(False)
    try:
        with torch.compiler.set_stance("force_eager"), _file_autocast(mode), mode:
            yield mode
    finally:
        torch.backends.mha.set_fastpath_enabled(fastpath)


@contextlib.contextmanager
def _file_autocast(mode: TargetMode) -> Iterator[None]:
    """The file's own ``torch.autocast("cuda", ...)`` regions (``torch.amp.autocast``,
    ``torch.cuda.amp.autocast``, as a decorator too; made in the step, or at the file's top
    where :func:`~memkit.cuda_autocast.requests_recorded` saw it made) run as the target runs
    them: each region turns ``mode``'s autocast policy on for its dtype
    (:meth:`TargetMode.file_region_begins`), and ``torch.is_autocast_enabled("cuda")`` reads
    true inside it (``torch.amp.custom_fwd``).
    Without this, a CPU build disables them with a warning, and a file written for a GPU
    was estimated in fp32: nanoGPT's step 71 on a 3 GiB card where the H200 fit 118. The
    class's methods are wrapped for the block only, and act in this thread only; CUDA
    autocast's state is put back after it (a region the step never left)."""
    cls = torch.amp.autocast_mode.autocast
    enter, exit_ = cls.__enter__, cls.__exit__
    thread = threading.get_ident()
    state = torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda")

    def _region(self: Any) -> tuple[torch.dtype, bool] | None:
        if threading.get_ident() != thread:
            return None
        return requested(self)

    def __enter__(self: Any) -> Any:
        region = _region(self)
        if region is None:
            if self.device != "cpu" or mode.in_backward or threading.get_ident() != thread:
                return enter(self)  # (a checkpoint's recompute re-enters the mark it saved)
            # the file's own CPU autocast: nothing on the target's CUDA step (nor on meta
            # tensors); its dtype must not take the place of the policy's mark
            if self._enabled and self.fast_dtype in (torch.float16, torch.bfloat16):
                mode.cpu_dtypes.add(self.fast_dtype)
            dtype = torch.get_autocast_dtype("cpu")
            entered = enter(self)
            torch.set_autocast_dtype("cpu", dtype)  # torch's __exit__ restores its own
            return entered
        mode.file_region_begins(*region)
        try:
            entered = enter(self)
        except BaseException:
            mode.file_region_ends()
            raise
        torch.set_autocast_enabled("cuda", region[1])  # torch's __exit__ restores it
        return entered

    def __exit__(self: Any, *exc: Any) -> Any:
        try:
            return exit_(self, *exc)
        finally:
            if _region(self) is not None:
                mode.file_region_ends()

    cls.__enter__, cls.__exit__ = __enter__, __exit__  # type: ignore[method-assign]
    try:
        with requests_recorded():
            yield
    finally:
        cls.__enter__, cls.__exit__ = enter, exit_  # type: ignore[method-assign]
        torch.set_autocast_enabled("cuda", state[0])
        torch.set_autocast_dtype("cuda", state[1])


_SAME_DTYPE_OPS = frozenset(
    {"mm", "addmm", "bmm", "baddbmm", "matmul", "__matmul__", "__rmatmul__", "linear",
     "conv1d", "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d", "conv_transpose3d",
     "convolution", "_convolution"}
)  # fmt: skip
"""Ops whose CUDA kernels refuse floating inputs of different dtypes (``ADDMM_META``, bmm's and
baddbmm's checks in ``LinearAlgebra.cpp``; ``check_input_same_type_as_parameters`` in
``Convolution.cpp``), and whose meta kernels do not check it."""


def _refuse_mixed_dtypes(name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """Raise as the GPU would when an op of :data:`_SAME_DTYPE_OPS` gets floating inputs of
    different dtypes (after the autocast policy cast them: autocast leaves float64 alone)."""
    dtypes = {
        t.dtype
        for t in tree_flatten((args, kwargs))[0]
        if isinstance(t, torch.Tensor) and t.is_floating_point()
    }
    if len(dtypes) > 1:
        said = " and ".join(sorted(str(d) for d in dtypes))
        why = " (autocast does not cast float64)" if torch.float64 in dtypes else ""
        raise RuntimeError(
            f"{name} got floating-point inputs of different dtypes ({said}), which its CUDA "
            f"kernel refuses{why}: cast the model and the batch to one dtype"
        )


def _gradient_edges(
    func: Callable[..., Any], args: tuple[Any, ...], kw: dict[str, Any]
) -> tuple[Any, ...] | None:
    """``torch.autograd.backward``'s arguments with the outputs as gradient edges and their
    gradients made (a scalar's ones, as ``_make_grads`` makes them), or ``None`` where the
    call is left as it is: ``inputs=`` given, an output that needs no gradient, or a
    non-scalar output without a gradient (the error is PyTorch's)."""
    names: tuple[str, ...]
    if func is torch.Tensor.backward:
        names = ("tensors", "gradient", "retain_graph", "create_graph", "inputs")
    else:
        names = ("tensors", "grad_tensors", "retain_graph", "create_graph", "grad_variables",
                 "inputs")  # fmt: skip
    bound = dict(zip(names, args, strict=False)) | kw
    if bound.get("inputs") is not None:
        return None
    tensors = bound["tensors"]
    outputs = (tensors,) if isinstance(tensors, torch.Tensor) else tuple(tensors)
    grads = bound.get("gradient", bound.get("grad_tensors"))
    grads = (grads,) * len(outputs) if grads is None or isinstance(grads, torch.Tensor) else grads
    if len(grads) != len(outputs) or any(
        not isinstance(out, torch.Tensor) or not out.requires_grad for out in outputs
    ):
        return None
    made = []
    for out, grad in zip(outputs, grads, strict=True):
        if grad is None:
            if out.numel() != 1:
                return None
            grad = torch.ones_like(out, memory_format=torch.preserve_format)
        made.append(grad)
    edges = tuple(torch.autograd.graph.get_gradient_edge(out) for out in outputs)
    return edges, tuple(made), bound.get("retain_graph"), bool(bound.get("create_graph"))


# --------------------------------------------------------------------------------------------
# One trial: the accountant's events replayed through the allocator, labelled for the breakdown
# --------------------------------------------------------------------------------------------

_CATEGORIES = ("parameters", "gradients", "optimizer_state", "activations")


class StepRecorder:
    """The accountant's observer (:class:`~memkit.simulated.accountant.StorageObserver`): replays
    its allocations and frees through the allocator model and sums bytes per category.

    A storage's category is its final one: optimizer state made by the first step's
    ``optimizer.step()`` and gradients are relabelled once they are known to be that, and the
    breakdown at the peak (:attr:`peak_parts`) counts the storages alive then by that label;
    a storage that becomes a parameter's is one from then on (:meth:`relabel`).
    """

    def __init__(self, allocator: CachingAllocatorModel) -> None:
        self.allocator = allocator
        self.phase = "activations"
        self.steps = 0  # optimizer steps seen
        self.total = 0
        self.peak_total = 0
        self._serials: dict[int, int] = {}  # live key -> serial of its allocation
        # per serial: [category, bytes, event it was allocated at, event it was freed at]
        self._storages: list[list[Any]] = []
        self._events = 0
        self._peak_event = -1

    def already_counted(self, storages: list[tuple[int, int, int]]) -> None:
        assert not storages, "the recorder observes a fresh accountant"

    def out_of_memory(self, tried: int, free: int) -> None:
        pass  # the accountant has no budget; the allocator model counts its own OOMs

    def allocated(self, key: int, nbytes: int, requested: int, existed: str | None) -> None:
        self.allocator.malloc(key, nbytes)
        self._serials[key] = len(self._storages)
        self._storages.append([self.phase, nbytes, self._events, None])
        self.total += nbytes
        if self.total > self.peak_total:
            self.peak_total = self.total
            self._peak_event = self._events
        self._events += 1

    def freed(self, key: int, nbytes: int) -> None:
        self.allocator.free(key)
        serial = self._serials.pop(key, None)
        if serial is not None:
            entry = self._storages[serial]
            entry[3] = self._events
            self.total -= entry[1]
        self._events += 1

    def relabel(self, tensor: torch.Tensor | None, category: str, from_now: bool = False) -> None:
        """``tensor``'s storages are ``category``: since they were made, or ``from_now`` on (a
        storage that becomes a parameter's: SAM's copy of the weights, its state until then)."""
        if tensor is None or tensor.device.type != "meta":
            return
        for storage in storages_of(tensor):  # a sparse gradient: its indices and values
            serial = self._serials.get(id(storage))
            if serial is None:
                continue
            entry = self._storages[serial]
            if not from_now or entry[2] == self._events:
                entry[0] = category
            elif entry[0] != category:  # its life so far keeps its label
                entry[3] = self._events
                self._serials[id(storage)] = len(self._storages)
                self._storages.append([category, entry[1], self._events, None])

    @property
    def peak_parts(self) -> dict[str, int]:
        """Bytes per category of the storages alive at the counted peak."""
        parts = dict.fromkeys(_CATEGORIES, 0)
        peak = self._peak_event
        for category, nbytes, born, died in self._storages:
            if born <= peak and (died is None or died > peak):
                parts[category] += nbytes
        return parts


@dataclass
class TrialPeaks:
    """What one trial reached: the allocator model's peaks, the counted storages' peak, the
    allocator's out-of-memory count, the breakdown at the peak and the trial's wall time."""

    allocated: int
    reserved: int
    counted: int
    ooms: int
    parts: dict[str, int]
    slack: int
    workspace: int
    seconds: float


@dataclass
class MetaSession:
    """Everything a trial needs: the meta model, its optimizer and the target's settings."""

    spec: ModelSpec
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer | None
    plan: StepPlan
    seq_len: int | None
    usable: int
    workspace: int
    policy_dtype: torch.dtype | None
    attention: str
    sm: int
    keep_output: bool = True
    kernels: set[str] = field(default_factory=set)
    file_dtypes: set[torch.dtype] = field(default_factory=set)
    """The dtypes of the file's own ``torch.autocast("cuda")`` regions the steps entered."""
    cpu_dtypes: set[torch.dtype] = field(default_factory=set)
    """The half dtypes of its own ``torch.autocast("cpu")`` regions the steps entered."""
    data_checks: int = 0
    generate_checks: int = 0
    step_reads: int = 0  # the file's step's own `.item()` calls (value_on_meta)
    unstepped: set[int] = field(default_factory=set)  # train trials that stepped no optimizer
    cache: dict[int, TrialPeaks] = field(default_factory=dict)

    def with_amp(self, policy_dtype: torch.dtype | None) -> MetaSession:
        """The same model and target under another autocast dtype, with no trials yet."""
        return dataclasses.replace(self, policy_dtype=policy_dtype, kernels=set(), cache={})

    def batch(self, batch_size: int) -> Any:
        args = batch_args(batch_size, self.seq_len)
        try:
            with torch.device(META):
                made = call_user(
                    self.spec.make_batch, *args, what=f"make_batch({batch_size})",
                    path=self.spec.path,
                )  # fmt: skip
        except ModelFileError as exc:
            meta = r"\bmeta (tensors?|device)\b|register_meta"
            if not re.search(meta, str(exc.__cause__), re.IGNORECASE):
                raise
            # (sweep CI: a make_batch ending in .to(device) was told it read a value)
            copied = "copy out of meta" in str(exc.__cause__)
            raise ModelFileError(
                f"{exc}\nmemkit estimate runs make_batch under torch.device('meta'): the tensors "
                "it makes have shapes and no values"
                + (
                    ", and a copy of one to the CPU (.to('cpu'), .to(device) with a CPU "
                    "device, .cpu(), .numpy()) has no data to copy. Return the tensors as "
                    "made: memkit moves the batch to the device itself"
                    if copied
                    else ", so a value read from one (.item(), .tolist(), a length drawn with "
                    "torch.randint) has none. Draw such numbers with Python's random module, "
                    "or use `memkit probe`, which runs on real values"
                )
            ) from exc.__cause__
        return to_device(made, META)

    def _mode(self) -> TargetMode:
        inference = self.plan.mode == "infer"
        mode = target_mode(self.policy_dtype, self.attention, self.sm, inference=inference)
        step = self.spec.eval_step if inference else self.spec.train_step
        code = None if step is None else getattr(inspect.unwrap(step), "__code__", None)
        mode.step_codes = frozenset() if code is None else frozenset({code})
        return mode

    def step(self, batch_size: int) -> None:
        """One step on meta under the target's rules (:func:`target_rules_on`)."""
        mode = self._mode()
        batch = self.batch(batch_size)
        with target_rules_on(mode):
            if self.plan.mode == "infer":
                self._infer(batch)
            else:
                self.plan(self.model, batch, self.optimizer)
        del batch
        self.kernels |= mode.kernels
        self.file_dtypes |= mode.file_dtypes
        self.cpu_dtypes |= mode.cpu_dtypes
        self.data_checks += mode.data_checks
        self.generate_checks += mode.generate_checks
        self.step_reads += mode.step_reads

    def warm_up(self, batch_size: int) -> None:
        """One unaccounted step: the step's errors surface before the search starts (the
        meta kernels' gaps filled as in a trial: :class:`KernelWorkspaces`, allocating
        nothing)."""
        with KernelWorkspaces(lambda key, nbytes: None, 0):
            self.step(batch_size)
        self.plan.release()
        self.model.zero_grad(set_to_none=True)

    def _infer(self, batch: Any) -> None:
        """The inference step: the forward under ``torch.no_grad()`` on meta, for the GPU's
        ``torch.inference_mode()``.

        Both keep no graph, but under ``inference_mode`` a composite op (``cross_entropy``,
        ``linear`` on 3-D inputs...) reaches the accountant as one call, whose inner ops'
        temporaries (``cross_entropy``'s log-probabilities) are never counted; on a GPU they
        are allocated all the same. ``no_grad`` keeps the autograd keys, where those ops
        decompose above the accountant, as they run on CUDA. With the file's ``loss_fn``, the
        loss follows the forward, as in ``memkit probe``'s evaluation step; the file's
        ``eval_step`` replaces both.
        """
        with torch.no_grad():
            if self.plan.eval_step is not None:
                # held as the probe's step holds it (`out = eval_step(...)` in a loop); its own
                # inference_mode runs as no_grad, for the same reason (sweep BL)
                with inference_mode_as_no_grad():
                    self.plan.hold(self.plan.eval_step(self.model, batch))
                return
            output = call_model(self.model, batch)
            if self.keep_output:
                self.plan.hold(output)  # the previous output lived until this forward returned
            if self.plan.loss_fn is not None:  # an eval loop's `loss_fn(...).item()`
                self.plan.loss_fn(output, batch)
        del output

    def run(self, batch_size: int) -> TrialPeaks:
        """A trial as ``memkit probe`` runs one on a GPU: the parameters, then two steps from an
        empty optimizer state, all replayed through one allocator model. The first step creates
        the optimizer state and the kernel workspaces where a GPU creates them, and leaves the
        cached segments the second step reuses; the second holds the first one's output during
        its forward (the default step keeps it, like a loop's ``out = model(x)``)."""
        cached = self.cache.get(batch_size)
        if cached is not None:
            return cached
        started = time.perf_counter()
        allocator = CachingAllocatorModel(capacity=self.usable)
        recorder = StepRecorder(allocator)
        accountant = MemoryAccountant(META, None, rounding="cuda", name="estimate")
        accountant.observe(recorder)
        workspaces = KernelWorkspaces(allocator.malloc, self.workspace)
        recorder.phase = "parameters"
        accountant.track(self.model)
        if self.optimizer is not None:
            self.optimizer.state.clear()  # created by the first step (relabelled by a hook)
        self.plan.release()
        recorder.phase = "activations"
        with self._hooks(recorder), accountant, workspaces:
            for _ in range(2):
                self.step(batch_size)
        if self.plan.mode == "train" and not recorder.steps and not allocator.num_ooms:
            self.unstepped.add(batch_size)  # no optimizer step: one every k-th call?
        self.plan.release()
        accountant.stop_observing()
        workspace = workspaces.allocated
        peaks = TrialPeaks(
            allocated=allocator.peak_allocated,
            reserved=allocator.peak_reserved,
            counted=accountant.peak,
            ooms=allocator.num_ooms,
            parts=dict(recorder.peak_parts),
            slack=max(0, allocator.peak_allocated - workspace - accountant.peak),
            workspace=workspace,
            seconds=time.perf_counter() - started,
        )
        self.cache[batch_size] = peaks
        return peaks

    @contextlib.contextmanager
    def _hooks(self, recorder: StepRecorder) -> Iterator[None]:
        handles: list[Any] = []

        def grad_hook(param: torch.Tensor) -> None:
            recorder.relabel(param.grad, "gradients")

        for param in self.model.parameters():
            if param.requires_grad:
                handles.append(param.register_post_accumulate_grad_hook(grad_hook))

        given = [] if self.optimizer is None else [self.optimizer]
        params = list(self.model.parameters())

        def any_step(optimizer: Any, *_: Any) -> None:
            """Any optimizer's step (the step's own, or one it wraps: SAM's base optimizer
            steps, SAM itself never does): its state and the given one's are optimizer
            state, and the parameters are parameters from now on, whatever storage a wrapper
            gave them: SAM's copy of the weights (``old_p``, its state since the step's first
            half made it) became theirs (``p.data = old_p``) before its base stepped."""
            recorder.steps += 1
            for opt in (optimizer, *given):
                for tensor in tensors_of(list(opt.state.values())):
                    recorder.relabel(tensor, "optimizer_state")
            for param in params:
                recorder.relabel(param, "parameters", from_now=True)

        handles.append(register_optimizer_step_post_hook(any_step))
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()


def run_guarded(run: Callable[[], Any], batch_size: int, mode: str = "train") -> Any:
    """Run a meta step of ``mode`` (``"train"``, ``"infer"``); the user's code failing becomes
    a clear error (never an OOM)."""
    try:
        return run()
    except MemkitError:
        raise
    except Exception as exc:
        text = str(exc)
        sparse = _sparse_on_meta(exc)
        missing = None if sparse else _no_meta_kernel(exc)
        if sparse or missing:  # the first sentence names the op; the rest lists dispatch keys
            text = text.split(". ", 1)[0]
        said = f"the step raised {type(exc).__name__} at batch size {batch_size}: " + text.rstrip(
            ".! "
        )
        if sparse:
            said += (
                ". The step makes sparse tensors, and PyTorch has no meta kernel for this sparse "
                "op, so memkit estimate cannot run it. Measure it on the simulated device "
                f"instead, which counts a sparse tensor's indices and values: {_SIMULATED_RUN}."
            )
        elif missing:
            said += (
                f". PyTorch has no meta kernel for {missing} (a torch op, not your code: CTC "
                "loss, some sparse or fused kernels), so memkit estimate cannot run this step. "
                f"Measure it on the simulated device instead, which runs it: {_SIMULATED_RUN}."
            )
        elif _host_tensor_met(exc):
            said += (
                ". The step made a tensor on the CPU (a torch.arange, zeros or ones without "
                "device=, or a buffer kept out of the model) and used it with the model's "
                "tensors: on a GPU it fails the same way ('Expected all tensors to be on the "
                "same device'). Make it on the input's device (device=x.device).\n"
                + step_traceback(exc, hide=_TORCH_META_CODE)  # where: the user's frames
            )
        elif _meta_only(exc):
            step = "eval_step" if mode == "infer" else "train_step"
            loss = (
                " (an evaluation's metric read from values: return the loss from "
                "loss_fn(output, batch) instead, which the estimate runs)"
                if mode == "infer"
                else ""
            )
            said += (
                ". It ran on meta tensors, which hold no values: code that reads them (.item(), "
                ".cpu(), .tolist(), data-dependent shapes such as nonzero or a mixture of "
                "experts' top-k routing, .numpy()) cannot run there. Where that code is in the "
                f"step only, move it out or define {step} without it{loss}; where it is the "
                "model's own (routing, or pack_padded_sequence, which reads its lengths' values "
                "on the CPU: memkit moves the whole batch to meta), measure it on the simulated "
                f"device instead, which runs it: {_SIMULATED_RUN}.\n"
                + step_traceback(exc, hide=_TORCH_META_CODE)  # where: the user's frames
            )
        else:  # a shape mismatch, a wrong argument: the same error on a GPU
            said += (
                ". The same error would stop this step on a GPU: check make_batch and the model "
                "(memkit probe FILE --device cpu runs the step for real).\n"
                + step_traceback(exc, hide=_TORCH_META_CODE)
            )
        raise UserCodeError(said, original=exc) from exc


_TORCH_META_CODE = tuple(
    os.path.join(os.path.dirname(torch.__file__), name)
    for name in (
        "_decomp", "_prims", "_prims_common", "_refs", "_meta_registrations.py", "_dynamo",
        "_library", "library.py", "_ops.py", "overrides.py", "_compile.py", "__init__.py",
    )
)  # fmt: skip
"""torch's own Python that runs an op on meta tensors (decompositions, references, meta
kernels, the dispatch around them): frames a step's error shows on meta and not on a GPU."""


def _sparse_on_meta(exc: BaseException) -> bool:
    """Whether an error is a sparse op that has no meta kernel (``aten::sparse_mask`` on the
    ``SparseMeta`` backend, ``aten::_to_sparse`` with meta tensors)."""
    if not isinstance(exc, NotImplementedError):
        return False
    first = str(exc).split(". ", 1)[0]
    return re.search(r"Sparse\w*Meta|aten::\w*sparse", first) is not None


def _no_meta_kernel(exc: BaseException) -> str | None:
    """The op an error says has no meta kernel (``aten::_ctc_loss.Tensor: attempted to run this
    operator with Meta tensors``, or older torch's ``Could not run '...' with arguments from the
    'Meta' backend``), if it says that."""
    if not isinstance(exc, NotImplementedError):
        return None
    text = str(exc)
    found = re.search(r"Could not run '([\w:.]+)' with arguments from the 'Meta' backend", text)
    found = found or re.match(r"([\w:.]+): attempted to run this operator with Meta tensors", text)
    return found.group(1) if found else None


def _host_tensor_met(exc: BaseException) -> bool:
    """Whether an error is a CPU tensor meeting the model's meta tensors in one op (torch's
    "Tensor on device meta is not on the expected device cpu!", "Expected all tensors to be on
    the same device, but found at least two devices, meta and cpu!")."""
    text = str(exc)
    return "meta" in text and "cpu" in text and ("expected device" in text or "same device" in text)


def _no_value(*_: Any) -> Any:
    raise RuntimeError(
        "a number read with .item() from a meta tensor was computed with or decided on, and "
        "meta tensors hold no values"
    )


_VALUE_USES = (
    "__bool__", "__int__", "__index__", "__trunc__", "__floor__", "__ceil__",
    "__lt__", "__le__", "__gt__", "__ge__", "__eq__", "__ne__", "__neg__", "__pos__",
    "__abs__", "__add__", "__radd__", "__sub__", "__rsub__", "__mul__", "__rmul__",
    "__truediv__", "__rtruediv__", "__floordiv__", "__rfloordiv__", "__mod__", "__rmod__",
    "__divmod__", "__rdivmod__", "__pow__", "__rpow__", "__and__", "__rand__", "__or__",
    "__ror__", "__xor__", "__rxor__", "__lshift__", "__rlshift__", "__rshift__", "__rrshift__",
    "__invert__",
)  # fmt: skip
"""What a number read from a meta tensor refuses: the uses that decide or compute with its
value. ``float()`` and ``round()`` pass (1.0): logging converts and rounds (numpy, a
TensorBoard or wandb scalar, ``round(loss.item(), 4)``; review CM)."""

_MetaFloat = type(
    "_MetaFloat", (float,), {**dict.fromkeys(_VALUE_USES, _no_value), "__hash__": float.__hash__}
)


def value_on_meta() -> float:
    """What ``tensor.item()`` of a floating-point tensor gives in the file's own step on
    meta: a number that can be returned, printed, formatted or kept, as a loss logged is,
    and that raises the meta error where Python computes with it, compares it or makes it a
    ``bool`` or an ``int`` (a loss spike skipped), as ``.item()`` itself did. C code reads
    its value without asking (``math.isfinite``, numpy), as do ``float()`` and ``round()``:
    1.0, finite and positive, so a NaN guard lets the step go on
    (review CM: a NaN underneath skipped backward and the optimizer, 2.75x too high). An
    integer's ``.item()`` (a length, a count: C code slices with it without asking either) is
    not given one.

    Examples:
        >>> loss = value_on_meta()
        >>> print(loss), [loss]
        1.0
        (None, [1.0])
        >>> loss < 1e-3
        Traceback (most recent call last):
        ...
        RuntimeError: a number read with .item() from a meta tensor was computed with ...
    """
    return _MetaFloat(1.0)


def _meta_only(exc: BaseException) -> bool:
    """Whether an error comes from running on meta tensors (values read, an op with no meta
    kernel), not from the user's code as such."""
    if isinstance(exc, NotImplementedError):
        return True
    return re.search(r"\bmeta\b", str(exc), re.IGNORECASE) is not None  # not 'metadata'
