"""A GPT-2 language model built from a config (no download), probed per sequence length.

    memkit probe examples/gpt2.py --device cpu --budget 512MiB --seq-len 64,128,256

``make_batch`` takes ``seq_len`` and returns a dict, so the default step calls
``model(**batch)`` and backpropagates ``output.loss`` (transformers computes it from labels).
"""

import torch
from transformers import GPT2Config, GPT2LMHeadModel

CONFIG = GPT2Config(
    vocab_size=2048, n_positions=512, n_embd=128, n_layer=4, n_head=4,
    resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    bos_token_id=0, eos_token_id=0,  # inside the 2048-word vocabulary
)  # fmt: skip


def build_model() -> torch.nn.Module:
    return GPT2LMHeadModel(CONFIG)


def make_batch(batch_size: int, seq_len: int = 128) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, CONFIG.vocab_size, (batch_size, seq_len))
    return {"input_ids": ids, "labels": ids}
