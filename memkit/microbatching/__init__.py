"""An OOM-proof training step that keeps the effective batch: split, accumulate, step once.

``memkit.microbatch(train_step, model=model, optimizer=opt)`` returns a step function. Give it a
full batch: it runs ``train_step`` on the batch (or on micro-batches of it), does the backward
passes, accumulates the gradients, calls ``optimizer.step()`` once and clears the gradients.
When the device runs out of memory it recovers (:func:`memkit.oom.recover`), splits the *same*
batch into more micro-batches and tries again: no data is skipped, the optimizer steps exactly
once per batch, and it sees the gradient of the whole batch (up to floating-point summation
order), not the gradient of a smaller batch.

What gets split (see :func:`split_batch`): the batch size ``B`` is the dim 0 along which the
batch's tensors hold the most bytes (:func:`batch_size_of`). Every tensor whose dim 0 is ``B``
is cut into ``n`` contiguous views along dim 0 (sizes differ by at most one, larger first); a
list of ``B`` per-sample items, not all of them such tensors or holding one (a detection
batch's target dicts, captions), is sliced the same way, and a list of per-sample records (dicts
of tensors of differing lengths: one per graph) sets ``B`` to its length; batches whose samples
are groups of rows (PyG-style graph batches) are refused with a ``ConfigError``;
dicts/mappings, tuples, named tuples and other lists are walked and rebuilt. Anything else is
given unchanged to every micro-batch: Python scalars and strings, 0-d tensors, tensors whose
dim 0 is not ``B``, ``None``. "Dim 0" is ``batch_dim``: 1 for sequence-first batches, which a
model with sequence-first layers must say (it is refused otherwise).

Loss scaling: ``train_step`` returns the mean loss over its micro-batch; micro-batch ``i`` is
back-propagated with weight ``w_i / sum(w)``, where ``w_i`` is its number of samples by default.
The accumulated gradient then equals the full-batch gradient whenever the full-batch loss is the
mean over samples of per-sample losses. For a token-mean loss (language models) that holds only
if every sample has the same number of counted tokens; otherwise pass ``weight=`` returning the
number of tokens the micro-batch's loss averages over, and it is exact again. A batch holding a
mapping with ``num_items_in_batch`` (transformers' Trainer convention: the loss is a sum divided
by the whole batch's count, which every micro-batch receives) has its micro-batches' losses
summed, unweighted, unless ``weight=`` is given. A mapping batch whose ``labels`` hold -100,
split after an OOM without ``weight=`` into micro-batches of unequal shares of counted labels,
is warned of once (the weight to pass); the first split warning also says, once, what
splitting does to a loss that is not a per-sample mean (a sum, class-weighted
cross-entropy, in-batch negatives).

Not identical to the full batch: layers that compute statistics over the batch (BatchNorm in
training mode, anything using in-batch negatives) see micro-batches, as with any gradient
accumulation; their running statistics are updated once per micro-batch.

Split policy (:class:`SplitPolicy`): the largest micro-batch size known to work is remembered
and reused for later batches. On an OOM at micro-batch size ``s`` the next size is
``ceil(s / 2)``, or less when the OOM message shows that even half cannot fit (see
:meth:`SplitPolicy.on_oom`). After ``grow_after`` clean steps a larger size (half way, in chunk
counts, to the chunks at which the smallest size failed; half the chunks if none failed) is
tried once; if it runs out of memory the same batch is retried at the remembered size and the
patience doubles. A failed attempt's forward passes may have updated BatchNorm running
statistics and drawn random numbers (dropout): the statistics (``restore_buffers``) and the
random number generators are restored before the retry.

DDP: with a :class:`~torch.nn.parallel.DistributedDataParallel` model, every micro-batch runs
under ``model.no_sync()``, ranks agree on the split count before running and on "did any rank
fail" after, and only then memkit all-reduces the gradients itself, once per batch. So no rank
is ever inside a collective while another recovers from an OOM; the price is that gradient
communication no longer overlaps the backward pass. docs/microbatch.md says why.

Examples:
    >>> import torch
    >>> from memkit.microbatching import microbatch  # also memkit.microbatch
    >>> model = torch.nn.Linear(8, 2)
    >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
    >>> @microbatch(model=model, optimizer=opt)
    ... def step(batch):
    ...     x, y = batch
    ...     return torch.nn.functional.mse_loss(model(x), y)
    >>> loss = step((torch.randn(16, 8), torch.randn(16, 2)))
    >>> step.steps, step.last.chunks
    (1, 1)
"""

from memkit.microbatching.policy import SplitPolicy, oom_size_bound
from memkit.microbatching.splitting import batch_size_of, chunk_sizes, split_batch
from memkit.microbatching.step import MicroBatchStep, StepInfo, Weight, microbatch

__all__ = [
    "MicroBatchStep",
    "SplitPolicy",
    "StepInfo",
    "Weight",
    "batch_size_of",
    "chunk_sizes",
    "microbatch",
    "oom_size_bound",
    "split_batch",
]
