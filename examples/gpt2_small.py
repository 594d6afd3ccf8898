"""GPT-2 small (124M parameters, the default ``GPT2Config``), for ``memkit estimate``.

    memkit estimate examples/gpt2_small.py --device-memory 24GiB --seq-len 1024 --amp bf16

Built from a config (no download). Under ``memkit estimate`` it is built on ``meta``, so it
costs no host RAM; ``memkit probe`` on a real GPU runs it for real.
"""

import torch
from transformers import GPT2Config, GPT2LMHeadModel

CONFIG = GPT2Config()


def build_model() -> torch.nn.Module:
    return GPT2LMHeadModel(CONFIG)


def make_batch(batch_size: int, seq_len: int = 1024) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, CONFIG.vocab_size, (batch_size, seq_len))
    return {"input_ids": ids, "labels": ids}
