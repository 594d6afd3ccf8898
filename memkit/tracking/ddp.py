"""DDP (``torch.nn.parallel.DistributedDataParallel``) under the tracker: its gradient buckets,
read from DDP's own objects.

DDP's ``Reducer`` (torch/csrc/distributed/c10d/reducer.cpp, read for torch 2.11 to 2.13)
allocates one flat tensor per bucket when the model is wrapped (``initialize_buckets``), on the
parameters' device, whatever the backend (gloo on CPU, NCCL on CUDA): together one copy of
every dense gradient DDP reduces, kept for the model's life (re-allocated once, same total, when
the buckets are rebuilt at the second iteration's forward). Backward copies each gradient into
its bucket, all-reduces the bucket and copies it back. With ``gradient_as_bucket_view=True``
the gradients *are* views of the buckets: counted once, as the buckets, which stay when
``zero_grad`` sets the gradients to ``None``. The sizes are the Reducer's own, as DDP's logger
reports them (``_get_ddp_logging_data()``: ``bucket_sizes``, ``rebuilt_bucket_sizes``).
"""

from __future__ import annotations

from types import FrameType
from typing import Any

import torch

from memkit import distributed

__all__ = ["bucket_bytes", "bucket_views", "ddp_calling", "is_ddp"]


def is_ddp(module: torch.nn.Module) -> bool:
    """Whether ``module`` is a DDP model with a Reducer (its buckets)."""
    return distributed.is_ddp(module) and getattr(module, "reducer", None) is not None


def _reducer_sizes(ddp: Any) -> list[int]:
    """The byte size of each of the Reducer's buckets now (the rebuilt ones once rebuilt)."""
    try:
        data = ddp._get_ddp_logging_data()
    except Exception:  # a torch without DDP's logger
        return []
    text = data.get("rebuilt_bucket_sizes") or data.get("bucket_sizes") or ""
    return [int(s) for s in str(text).replace(" ", "").split(",") if s.isdigit()]


def bucket_bytes(ddp: Any) -> int:
    """Bytes of ``ddp``'s gradient buckets (with ``gradient_as_bucket_view`` its gradients'
    storage too: :func:`bucket_views` says whose gradients not to count again)."""
    return sum(_reducer_sizes(ddp))


def bucket_views(ddp: Any) -> set[int]:
    """The ids of the parameters whose gradients are views of ``ddp``'s buckets (with
    ``gradient_as_bucket_view``; none without): counted as the buckets, once, whether the
    gradients exist or ``zero_grad`` set them to ``None`` (the buckets stay)."""
    if not getattr(ddp, "gradient_as_bucket_view", False):
        return set()
    return {id(p) for p in ddp.module.parameters()}


def ddp_calling(frame: FrameType | None, limit: int = 40) -> Any:
    """The DDP model whose forward is on the stack from ``frame`` outwards (``None``: none): a
    tracked model DDP wraps (``memkit.track(model)`` around ``DDP(model)``, Lightning's
    ``pl_module``, the transformers Trainer's model) runs inside its forward. Looked for when a
    model first runs (a frame walk, once)."""
    depth = 0
    while frame is not None and depth < limit:
        owner = frame.f_locals.get("self") if frame.f_code.co_name == "forward" else None
        if owner is not None and is_ddp(owner):
            return owner
        frame, depth = frame.f_back, depth + 1
    return None
