"""A causal language model fine-tuned with accelerate, in the shape of transformers'
``examples/pytorch/language-modeling/run_clm_no_trainer.py``: ``Accelerator(
gradient_accumulation_steps=..., mixed_precision=...)``, ``accelerator.prepare`` of the model,
optimizer, dataloader and scheduler, ``with accelerator.accumulate(model):`` around
``model(**batch)``, ``accelerator.backward(loss)``, ``optimizer.step()``,
``lr_scheduler.step()``, ``optimizer.zero_grad()``; AdamW over weight-decay groups.

Pitfalls for memkit: gradient accumulation (the optimizer steps every
``--gradient_accumulation_steps`` micro-batches); accelerate's mixed precision
(``--mixed_precision bf16`` or ``ACCELERATE_MIXED_PRECISION=bf16``) wraps ``model.forward`` in
autocast, entered inside the call, after any forward pre-hook; the model is called with
keyword arguments (``model(**batch)``) and returns an output object with ``.loss``.

A small GPT-like model on random tokens (no downloads); runs on a CPU in seconds.

``memkit probe`` also reads this file as a model file (``build_model``, ``make_batch``,
``build_optimizer``; ``train`` is the loop its answer is checked against): the same model with an
8192-token vocabulary, so that a sample costs about as much as the gradients. The pitfall there:
gradient accumulation keeps the gradients of the first micro-batch alive through the forwards of
micro-batches 2..k, so a probe that frees gradients before every forward answers a size that fits
only without accumulation. ``memkit probe tests/realworld/scripts/accelerate_clm.py --device cpu
--budget 80MiB --target-batch 64``.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import torch
from accelerate import Accelerator
from torch import nn
from torch.utils.data import DataLoader, Dataset


@dataclass
class CausalLMOutput:
    loss: torch.Tensor | None
    logits: torch.Tensor


class Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, heads, batch_first=True)
        self.ln_2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = self.ln_1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.ln_2(x))


class TinyCausalLM(nn.Module):
    def __init__(self, vocab: int, d: int, layers: int, heads: int, block: int) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, d)
        self.wpe = nn.Embedding(block, d)
        self.h = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None
                ) -> CausalLMOutput:  # fmt: skip
        t = input_ids.size(1)
        mask = torch.triu(torch.full((t, t), float("-inf")), diagonal=1)
        x = self.wte(input_ids) + self.wpe(torch.arange(t))
        for block in self.h:
            x = block(x, mask)
        logits = self.lm_head(self.ln_f(x))
        loss = None
        if labels is not None:
            loss = nn.functional.cross_entropy(
                logits[:, :-1].reshape(-1, logits.size(-1)).float(), labels[:, 1:].reshape(-1)
            )
        return CausalLMOutput(loss, logits)


class RandomTokens(Dataset):
    def __init__(self, n: int, block: int, vocab: int) -> None:
        g = torch.Generator().manual_seed(0)
        self.data = torch.randint(0, vocab, (n, block), generator=g)

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.data[i], "labels": self.data[i]}


def grouped(model: nn.Module, weight_decay: float = 0.0) -> list[dict]:
    """The script's parameter groups: no weight decay for biases and LayerNorm weights."""
    no_decay = ["bias", "layer_norm.weight"]
    return [
        {"params": [p for n, p in model.named_parameters() if not any(nd in n for nd in no_decay)],
         "weight_decay": weight_decay},
        {"params": [p for n, p in model.named_parameters() if any(nd in n for nd in no_decay)],
         "weight_decay": 0.0},
    ]  # fmt: skip


def train(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    train_dataset: Dataset,
    batch_size: int,
    accumulation: int,
    max_train_steps: int,
    mixed_precision: str | None = None,
) -> None:
    """The script's training loop, through accelerate."""
    # mixed precision from the flag, else ACCELERATE_MIXED_PRECISION (accelerate launch)
    accelerator = Accelerator(
        gradient_accumulation_steps=accumulation, mixed_precision=mixed_precision, cpu=True
    )
    train_dataloader = DataLoader(train_dataset, batch_size=batch_size)
    lr_scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    model, optimizer, train_dataloader, lr_scheduler = accelerator.prepare(
        model, optimizer, train_dataloader, lr_scheduler
    )
    model.train()
    completed_steps = 0
    for batch in train_dataloader:
        with accelerator.accumulate(model):
            outputs = model(**batch)
            loss = outputs.loss
            accelerator.backward(loss)
            optimizer.step()
            lr_scheduler.step()
            optimizer.zero_grad()
        if accelerator.sync_gradients:
            completed_steps += 1
            print(f"step {completed_steps} loss {loss.item():.4f}")
        if completed_steps >= max_train_steps:
            break


# -- the model file that memkit probe reads: a larger vocabulary, so a sample costs more ------

VOCAB, N_EMBD, N_LAYER, N_HEAD, BLOCK_SIZE = 8192, 128, 2, 4, 64


def build_model() -> nn.Module:
    torch.manual_seed(0)
    return TinyCausalLM(VOCAB, N_EMBD, N_LAYER, N_HEAD, BLOCK_SIZE)


def build_optimizer(params) -> torch.optim.Optimizer:
    """AdamW: the same state (two moments per parameter) as the script's two groups."""
    return torch.optim.AdamW(params, lr=5e-5)


def make_batch(batch_size: int) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, VOCAB, (batch_size, BLOCK_SIZE))
    return {"input_ids": ids, "labels": ids}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--per_device_train_batch_size", type=int, default=8)
    parser.add_argument("--gradient_accumulation_steps", type=int, default=4)
    parser.add_argument("--mixed_precision", default=None, choices=["no", "bf16", "fp16"])
    parser.add_argument("--max_train_steps", type=int, default=3)
    parser.add_argument("--block_size", type=int, default=64)
    parser.add_argument("--n_embd", type=int, default=128)
    parser.add_argument("--n_layer", type=int, default=2)
    parser.add_argument("--vocab_size", type=int, default=512)
    parser.add_argument("--learning_rate", type=float, default=5e-5)
    parser.add_argument("--weight_decay", type=float, default=0.0)
    args = parser.parse_args()

    torch.manual_seed(0)
    model = TinyCausalLM(args.vocab_size, args.n_embd, args.n_layer, 4, args.block_size)
    steps = args.max_train_steps * args.gradient_accumulation_steps
    train_dataset = RandomTokens(steps * args.per_device_train_batch_size, args.block_size,
                                 args.vocab_size)  # fmt: skip
    optimizer = torch.optim.AdamW(grouped(model, args.weight_decay), lr=args.learning_rate)
    train(model, optimizer, train_dataset, args.per_device_train_batch_size,
          args.gradient_accumulation_steps, args.max_train_steps, args.mixed_precision)  # fmt: skip


if __name__ == "__main__":
    main()
