"""memkit inside the trainers people use: Lightning and transformers callbacks.

Each submodule needs its framework, installed with an extra, and is imported only when used
(``import memkit`` imports neither):

* :mod:`memkit.integrations.lightning` (``pip install memkit[lightning]``): ``MemkitCallback``
  for ``lightning.pytorch.Trainer`` and ``probe_batch_size`` for a ``LightningModule``;
* :mod:`memkit.integrations.transformers` (``pip install memkit[transformers]``):
  ``MemkitCallback`` for ``transformers.Trainer``.

See docs/integrations.md.
"""

from __future__ import annotations

__all__: list[str] = []
