"""Fabricate nanoGPT's shakespeare_char data (uint16 train.bin/val.bin, meta.pkl with 65
symbols), as its prepare.py writes it, without downloading anything."""

import pickle
from pathlib import Path

import numpy as np

out = Path(__file__).parent / "nanogpt" / "data" / "shakespeare_char"
out.mkdir(parents=True, exist_ok=True)
chars = [chr(c) for c in range(32, 97)]
rng = np.random.default_rng(0)
for name, n in (("train", 1_000_000), ("val", 100_000)):
    rng.integers(0, 65, n).astype(np.uint16).tofile(out / f"{name}.bin")
meta = {
    "vocab_size": 65,
    "itos": dict(enumerate(chars)),
    "stoi": {c: i for i, c in enumerate(chars)},
}
(out / "meta.pkl").write_bytes(pickle.dumps(meta))
