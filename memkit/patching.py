"""Replacing an attribute of torch for a block, and putting it back (:class:`Restore`).

memkit wraps a few of torch's functions while a tracked block runs (``torch.autograd.backward``,
the peak-counter readers, ``GradScaler.step``...). Blocks may nest and, in two threads, end in
any order: each replacement is a link in a chain per attribute, and the attribute goes back to
torch's own when the last live link is removed.
"""

from __future__ import annotations

import logging
from typing import Any, ClassVar

__all__ = ["Restore"]

log = logging.getLogger(__name__)


class Restore:
    """A removable handle that puts an attribute back.

    Blocks in two threads (or a tracker left open) may end out of order: a wrapper removed
    while another block's wrapper sits on top of it goes dead (``live`` is False: it only
    calls what it wrapped), and is taken out of the chain when everything above it is gone.
    An attribute someone else replaced since stays theirs, with ours left (dead) in their
    chain, and in this chain's list for as long as theirs stays."""

    _chains: ClassVar[dict[tuple[int, str], list[Restore]]] = {}

    def __init__(self, owner: Any, name: str, original: Any, replacement: Any) -> None:
        self.owner, self.name, self.original, self.replacement = owner, name, original, replacement
        self.live = True
        self._chain = Restore._chains.setdefault((id(owner), name), [])
        self._chain.append(self)

    def remove(self) -> None:
        self.live = False
        chain = self._chain
        while chain and not chain[-1].live:
            top = chain[-1]
            if getattr(self.owner, self.name) is not top.replacement:
                log.debug("%s.%s was replaced again; leaving it", self.owner, self.name)
                break
            setattr(self.owner, self.name, top.original)
            chain.pop()
