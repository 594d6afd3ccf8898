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


def _is_records(obj: Any, dim: int = 0) -> bool:
    """Whether ``obj`` is a list of per-sample records: mappings holding tensors whose lengths
    differ inside one of them (a graph's nodes and edges), or, three or more of them, from
    one to the next (an image's boxes). A list of batched dicts (``default_collate`` of
    samples that are tuples of dicts) has one length throughout; two batched dicts of two
    sizes (a labelled and an unlabelled batch, Lightning's CombinedLoader) are no records."""
    if not isinstance(obj, list) or len(obj) < 2 or not all(isinstance(i, Mapping) for i in obj):
        return False
    per_item = [
        {
            int(leaf.shape[dim] if leaf.dim() > dim else leaf.shape[0])
            for leaf in _leaves(item)
            if isinstance(leaf, torch.Tensor) and leaf.dim() > 0
        }
        for item in obj
    ]
    if any(len(lengths) > 1 for lengths in per_item):
        return True
    if len(set().union(*per_item)) < 2:
        return False
    # lengths that differ from one dict to the next: records when three or more, or two of
    # the same keys (two images' boxes); two of different keys are two batches (columns)
    return len(obj) > 2 or len({frozenset(item) for item in obj}) == 1


def _records_lengths(obj: Any, dim: int) -> list[int]:
    """The lengths of the lists of per-sample records in ``obj``."""
    if _is_records(obj, dim):
        return [len(obj)]
    values = obj.values() if isinstance(obj, Mapping) else obj
    if isinstance(obj, (Mapping, tuple, list)):
        return [n for value in values for n in _records_lengths(value, dim)]
    return []


def batch_size_of(batch: Any, dim: int = 0) -> int | None:
    """The batch size: the size of dim ``dim`` (0; 1 for sequence-first batches) that the
    batch's tensors (with that dim) hold the most bytes along, the per-sample data (a shared
    ``positions`` tensor of another length is not it); among equals, the first found depth
    first. ``None`` if no such tensor. A list of per-sample records (dicts of tensors of
    differing lengths: one per graph, per image's boxes) sets it: its length.

    Examples:
        >>> import torch
        >>> batch_size_of({"ids": torch.zeros(4, 7), "n": 3})
        4
        >>> batch_size_of({"pos": torch.arange(16), "x": torch.zeros(2000, 64)})
        2000
        >>> batch_size_of(3) is None
        True
        >>> batch_size_of([{"x": torch.zeros(12, 8), "y": torch.zeros(1)}] * 5)
        5
    """
    records = sorted(set(_records_lengths(batch, dim)))
    if len(records) > 1:
        raise ConfigError(
            f"the batch holds lists of per-sample records of different lengths {records}: "
            "each should have one item per sample"
        )
    if records:
        return records[0]
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


def _named_leaves(obj: Any, path: str = "batch", lists: bool = False) -> Iterator[tuple[str, Any]]:
    """``(path, leaf)`` pairs (``batch["x"]``, ``batch[0]``); records lists are leaves; with
    ``lists``, the lists and tuples are given too."""
    if lists and isinstance(obj, (tuple, list)):
        yield path, obj
    if isinstance(obj, Mapping):
        for key, value in obj.items():
            yield from _named_leaves(value, f"{path}[{key!r}]", lists)
    elif isinstance(obj, (tuple, list)) and not _is_records(obj):
        for i, value in enumerate(obj):
            yield from _named_leaves(value, f"{path}[{i}]", lists)
    else:
        yield path, obj


_INTEGER = (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8)


def _why_unsplittable(batch: Any, size: int, dim: int) -> str | None:
    """Why splitting ``batch`` into groups of its ``size`` rows would cut samples apart, or
    ``None``: a sorted id vector grouping the rows into samples that another value counts (PyG's
    ``batch`` with per-graph labels), an index tensor into the rows (``edge_index``), or a list
    of per-sample tensors whose own dim 0 was taken for the batch (images: their channels)."""
    leaves = list(_named_leaves(batch))
    tensors = [(n, t) for n, t in leaves if isinstance(t, torch.Tensor) and t.dim() > 0]
    whole = [(n, t) for n, t in tensors if _batch_axis(t, size, dim) is None]
    # an index tensor into the rows, (2, E) as PyG's edge_index (a whole 0/1 mask is none)
    index = next(
        (
            (name, t)
            for name, t in tensors
            if t.dtype in _INTEGER
            and t.dim() == 2
            and t.shape[0] == 2
            and t.numel() > 0
            and _batch_axis(t, size, dim) is None
        ),
        None,
    )
    if index is not None:
        name, t = index
        low, high = int(t.min()), int(t.max())
        if low >= 0 and 2 <= high < size and size // 2 <= high:
            return (
                f"{name} holds indices into the {size} rows (0..{high}); each micro-batch would "
                "hold some of the rows but get every index (rows grouped into graphs: "
                "PyG's edge_index)"
            )
    counted_by = {int(t.shape[0]) for _, t in whole}  # (an int counts too little: a views count)
    for name, obj in _named_leaves(batch, lists=True):
        counted = isinstance(obj, (tuple, list)) and 1 < len(obj) != size and len(obj) in counted_by
        if counted and all(
            isinstance(i, torch.Tensor) and _batch_axis(i, size, dim) == dim for i in obj
        ):
            return (
                f"{name} is a list of {len(obj)} tensors, as many as the samples counted "
                f"elsewhere in the batch, but their own dim {dim} ({size}: an image's "
                "channels?) was taken for the batch"
            )
    return None


def _refuse_unsplittable(batch: Any, size: int, dim: int) -> None:
    why = _why_unsplittable(batch, size, dim)
    if why is None:
        return
    shapes = [
        f"{n} {tuple(t.shape)}" for n, t in _named_leaves(batch) if isinstance(t, torch.Tensor)
    ]
    raise ConfigError(
        f"memkit cannot split this batch into micro-batches: its batch size was taken as {size} "
        f"(dim {dim} of {', '.join(shapes[:8])}{', ...' if len(shapes) > 8 else ''}), but {why}. "
        "Pass a batch that splits per sample: a list of per-sample items (one dict per graph or "
        "image) that your train_step collates, or tensors whose dim "
        f"{dim} is the sample (stack the images)"
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
    split items; everything else is passed unchanged to every micro-batch. A batch whose samples
    are groups of rows (graphs: node features with a sorted graph-id vector, an ``edge_index``
    into the rows) or a list of per-sample tensors mistaken for columns is refused.

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

    Raises:
        ConfigError: the batch cannot be split per sample (see above).
    """
    size = batch_size if batch_size is not None else batch_size_of(batch, dim)
    if size is None or chunks == 1:
        return [batch]
    sizes = chunk_sizes(size, chunks)
    _refuse_unsplittable(batch, size, dim)

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
            per_sample = _is_records(obj, dim) or not all(_holds_rows(i, size, dim) for i in obj)
            if len(obj) == size and size > 1 and per_sample:
                # one item per sample (a detection batch's target dicts, captions): sliced
                starts = [sum(sizes[:i]) for i in range(chunks)]
                return [obj[start : start + n] for start, n in zip(starts, sizes, strict=True)]
            columns = [split(value) for value in obj]
            return [[column[i] for column in columns] for i in range(chunks)]
        return [obj] * chunks

    return split(batch)
