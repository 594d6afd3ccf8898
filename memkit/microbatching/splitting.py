"""Splitting a batch into micro-batches: its size, the chunk sizes, and the split itself
(tensors, and lists, tuples, dicts and dataclass-like mappings of them)."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import torch

from memkit.errors import ConfigError

__all__ = ["batch_size_of", "chunk_sizes", "split_batch"]


def _leaves(obj: Any) -> Iterator[Any]:
    if isinstance(obj, Mapping):
        for value in obj.values():
            yield from _leaves(value)
    elif isinstance(obj, (tuple, list)):
        for value in obj:
            yield from _leaves(value)
    else:
        yield obj


def batch_size_of(batch: Any, dim: int = 0) -> int | None:
    """The batch size: the size of dim ``dim`` (0; 1 for sequence-first batches) that the
    batch's tensors (with that dim) hold the most bytes along, the per-sample data (a shared
    ``positions`` tensor of another length is not it); among equals, the first found depth
    first. ``None`` if no such tensor.

    Examples:
        >>> import torch
        >>> batch_size_of({"ids": torch.zeros(4, 7), "n": 3})
        4
        >>> batch_size_of({"pos": torch.arange(16), "x": torch.zeros(2000, 64)})
        2000
        >>> batch_size_of(3) is None
        True
    """
    weight: dict[int, int] = {}
    for leaf in _leaves(batch):
        if isinstance(leaf, torch.Tensor) and leaf.dim() > dim:
            size = int(leaf.shape[dim])
            weight[size] = weight.get(size, 0) + leaf.numel() * leaf.element_size() + 1
    return max(weight, key=weight.__getitem__) if weight else None


def _batch_axis(tensor: torch.Tensor, size: int, dim: int) -> int | None:
    """The dim ``tensor`` is split along: ``dim`` when it is ``size`` long there; with
    ``dim`` 1, else dim 0 when that is ``size`` long (a sequence-first batch's labels or
    lengths, or a batch-first ``(B, T)`` padding mask); else ``None`` (given whole to every
    micro-batch)."""
    if tensor.dim() > dim and tensor.shape[dim] == size:
        return dim
    if dim == 1 and tensor.dim() > 0 and tensor.shape[0] == size:
        return 0
    return None


def _holds_rows(obj: Any, size: int, dim: int) -> bool:
    """Whether ``obj`` holds a tensor with ``size`` rows (something split along ``dim``)."""
    return any(
        isinstance(leaf, torch.Tensor) and _batch_axis(leaf, size, dim) is not None
        for leaf in _leaves(obj)
    )


def chunk_sizes(batch_size: int, chunks: int) -> list[int]:
    """Sizes of ``chunks`` micro-batches of a batch: as equal as possible, larger first.

    Examples:
        >>> chunk_sizes(10, 4)
        [3, 3, 2, 2]
    """
    if chunks < 1 or chunks > max(1, batch_size):
        raise ConfigError(f"expected 1 <= chunks <= {batch_size}, found {chunks}")
    q, r = divmod(batch_size, chunks)
    return [q + 1] * r + [q] * (chunks - r)


def _rebuild_mapping(template: Mapping[Any, Any], data: dict[Any, Any]) -> Any:
    if type(template) is dict:
        return data
    try:
        factory: Any = type(template)
        return factory(data)  # e.g. transformers' BatchEncoding, OrderedDict
    except Exception:  # a mapping type that cannot be built from a dict
        return data


def split_batch(batch: Any, chunks: int, batch_size: int | None = None, dim: int = 0) -> list[Any]:
    """Split ``batch`` into ``chunks`` micro-batches along dim ``dim`` (views, no copies).

    Tensors whose dim ``dim`` equals the batch size are split; a list of one item per sample (as
    long as the batch, and not every item a tensor, or holding one, of that many rows: a
    detection batch's target dicts, one of which may hold as many boxes as the batch has
    images) is sliced; mappings, tuples (named tuples too) and other lists are rebuilt around their
    split items; everything else is passed unchanged to every micro-batch.

    Args:
        batch: a tensor, or a mapping/tuple/list (nested) of tensors and other values.
        chunks: how many micro-batches, ``1 <= chunks <= batch_size``.
        batch_size: the batch size; default :func:`batch_size_of`.
        dim: the batch dimension (1 for sequence-first batches: ``(seq, batch, ...)``).

    Examples:
        >>> import torch
        >>> parts = split_batch({"x": torch.arange(5), "k": 2}, 2)
        >>> [p["x"].tolist() for p in parts], parts[1]["k"]
        ([[0, 1, 2], [3, 4]], 2)
    """
    size = batch_size if batch_size is not None else batch_size_of(batch, dim)
    if size is None or chunks == 1:
        return [batch]
    sizes = chunk_sizes(size, chunks)

    def split(obj: Any) -> list[Any]:
        if isinstance(obj, torch.Tensor):
            axis = _batch_axis(obj, size, dim)
            return [obj] * chunks if axis is None else list(obj.split(sizes, axis))
        if isinstance(obj, Mapping):
            parts = {key: split(value) for key, value in obj.items()}
            return [
                _rebuild_mapping(obj, {key: part[i] for key, part in parts.items()})
                for i in range(chunks)
            ]
        if isinstance(obj, tuple):
            columns = [split(value) for value in obj]
            rows = [[column[i] for column in columns] for i in range(chunks)]
            if hasattr(obj, "_fields"):  # named tuple
                return [type(obj)(*row) for row in rows]
            return [tuple(row) for row in rows]
        if isinstance(obj, list):
            if len(obj) == size and size > 1 and not all(_holds_rows(i, size, dim) for i in obj):
                # one item per sample (a detection batch's target dicts, captions): sliced
                starts = [sum(sizes[:i]) for i in range(chunks)]
                return [obj[start : start + n] for start, n in zip(starts, sizes, strict=True)]
            columns = [split(value) for value in obj]
            return [[column[i] for column in columns] for i in range(chunks)]
        return [obj] * chunks

    return split(batch)
